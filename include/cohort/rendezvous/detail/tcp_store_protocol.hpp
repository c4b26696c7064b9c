#pragma once
// The wire protocol of PyTorch's c10d TCPStore (torch 2.x numbering), kept in this one header
// so the client (tcp_store) and the server (tcp_store_server) cannot drift apart.
//
// A message is one command byte followed by its arguments, with no framing around it:
//   integers      host byte order (every host c10d runs on is little-endian), fixed width;
//   string/bytes  uint64 length, then that many bytes;
//   key list      uint64 count, then that many strings.
//
//   command          arguments                       reply
//   VALIDATE    0    uint32 magic 0x3C85F7CE         none (must be a connection's first message)
//   SET         1    key, value                      none
//   COMPARE_SET 2    key, expected, desired          bytes: the value held afterwards
//   GET         3    key                             bytes (empty when absent: clients WAIT first)
//   ADD         4    key, int64 delta                int64: the new value (stored as decimal text)
//   CHECK       5    key list                        uint8: READY 0 / NOT_READY 1
//   WAIT        6    key list                        uint8 STOP_WAITING 0, once every key exists
//   GETNUMKEYS  7    -                               int64
//   DELETE_KEY  8    key                             int64: number of keys deleted (0 or 1)
//   APPEND      9    key, bytes                      none
//   MULTI_GET  10    key list                        one bytes per key
//   MULTI_SET  11    uint64 count, (key, value)...   none
//   CANCEL_WAIT 12   -                               uint8 WAIT_CANCELED 1 (after any pending
//                                                    STOP_WAITING that was already sent)
//   PING       13    uint32 nonce                    uint32: the same nonce
//
// cohort's own extension, the token handshake. Only a cohort client that has a token sends
// it, and only to a cohort server (PyTorch's TCPStore has no authentication); without a
// token both sides speak plain c10d. Right after VALIDATE:
//   AUTH_HELLO 0xC0  uint8 version 1, 32-byte client nonce
//                    reply uint8 CHALLENGE 0, 32-byte server nonce, 32-byte server proof;
//                    or uint8 NO_TOKEN 2 (this server checks no token), then it closes
//   AUTH_PROOF 0xC1  32-byte client proof
//                    reply uint8 ACCEPTED 0, uint64 max key bytes, uint64 max value bytes
//                    (the server's limits, so the client refuses oversized requests itself);
//                    a wrong proof is answered REFUSED 1 and the connection closed
//   server proof = HMAC-SHA256(token, "cohort-store-v1 server" | client nonce | server nonce)
//   client proof = HMAC-SHA256(token, "cohort-store-v1 client" | server nonce | client nonce)
// Both nonces are fresh per connection, so a recorded proof is worth nothing on another one;
// the labels keep the server from being usable as an oracle for a client proof. Until it is
// ACCEPTED a connection may send nothing else: the server closes it at the first other command
// byte, before reading any key.
//
// A server at its connection limit writes the 4 bytes of busy_marker to a connection it will
// not serve and closes it; cohort's client reads them where it expects the PING echo (or the
// AUTH_HELLO reply) and retries with backoff instead of blaming the protocol. A server with a
// token answers a PING before the token exchange with token_required_marker, so a cohort
// client that has no token says so instead of blaming the protocol.
//
// Ceilings (c10d's libuv server has similar ones; ours are documented here and enforced on
// every length before anything is allocated). A request that breaks one is malformed, and a
// malformed request closes that one connection, never the server. A server may set lower
// limits (tcp_store_server_options), passed to the parser as `limits`:
//   key            at most 64 KiB
//   value          at most 256 MiB (rendezvous data is addresses and ids, not tensors)
//   keys/request   at most 128 Ki
//   request        at most 2 x 256 MiB + 16 MiB in total (COMPARE_SET carries two values)

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"

namespace cohort::inline v0::detail::tcp_store_protocol {

enum class command : std::uint8_t {
  validate = 0,
  set = 1,
  compare_set = 2,
  get = 3,
  add = 4,
  check = 5,
  wait = 6,
  num_keys = 7,
  delete_key = 8,
  append = 9,
  multi_get = 10,
  multi_set = 11,
  cancel_wait = 12,
  ping = 13,
  auth_hello = 0xC0,  // cohort's extension (see above)
  auth_proof = 0xC1,
};
inline constexpr std::uint8_t last_command = static_cast<std::uint8_t>(command::ping);  // of c10d's

enum class check_reply : std::uint8_t { ready = 0, not_ready = 1 };
enum class wait_reply : std::uint8_t { stop_waiting = 0, wait_canceled = 1 };

inline constexpr std::uint32_t validation_magic = 0x3C85F7CEu;

enum class auth_reply : std::uint8_t { challenge = 0, accepted = 0, refused = 1, no_token = 2 };
inline constexpr std::uint8_t auth_version = 1;
inline constexpr std::size_t auth_nonce_bytes = 32;
inline constexpr std::uint32_t busy_marker = 0xB05B05B0u;
inline constexpr std::uint8_t busy_first_byte = 0xB0;  // busy_marker's first byte on the wire
// What a server with a token writes where a client without one expects its PING echo.
inline constexpr std::uint32_t token_required_marker = 0xB07B07B0u;

using nonce = std::array<std::uint8_t, auth_nonce_bytes>;
// The proofs of the token handshake (see above).
COHORT_DECL sha256_digest server_proof(std::string_view token, const nonce& client, const nonce& server) noexcept;
COHORT_DECL sha256_digest client_proof(std::string_view token, const nonce& client, const nonce& server) noexcept;

// A key the server writes itself (c10d's clients name it so; "/cohort/store_reached_at" on the
// wire): the local address of the first connection it accepted on an address that is not
// loopback, that is, where ranks of other hosts reach this host (tcp_store.hpp,
// tcp_store::reached_from_other_hosts).
inline constexpr std::string_view store_reached_key = "cohort/store_reached_at";

inline constexpr std::uint64_t max_key_bytes = std::uint64_t{64} << 10;
inline constexpr std::uint64_t max_value_bytes = std::uint64_t{256} << 20;
inline constexpr std::uint64_t max_keys_per_request = std::uint64_t{128} << 10;
inline constexpr std::uint64_t max_request_bytes = 2 * max_value_bytes + (std::uint64_t{16} << 20);

// The lengths a parser accepts: the ceilings above, or a server's lower settings.
struct limits {
  std::uint64_t max_key_bytes = tcp_store_protocol::max_key_bytes;
  std::uint64_t max_value_bytes = tcp_store_protocol::max_value_bytes;
  std::uint64_t max_request_bytes = tcp_store_protocol::max_request_bytes;
};

static_assert(std::endian::native == std::endian::little,
              "c10d's TCPStore sends integers in host order; cohort supports little-endian hosts");

COHORT_DECL const char* command_name(command c) noexcept;
constexpr bool known_command(std::uint8_t code) noexcept {
  return code <= last_command || code == static_cast<std::uint8_t>(command::auth_hello) ||
         code == static_cast<std::uint8_t>(command::auth_proof);
}

// Builds one message (a request on the client, a reply on the server).
class message_writer {
 public:
  explicit message_writer(std::vector<std::uint8_t>& out) : out_(out) {}

  void command(tcp_store_protocol::command c) { u8(static_cast<std::uint8_t>(c)); }
  void u8(std::uint8_t value) { out_.push_back(value); }
  void u32(std::uint32_t value) { raw(value); }
  void u64(std::uint64_t value) { raw(value); }
  void i64(std::int64_t value) { raw(value); }
  void data(std::span<const std::uint8_t> value) {
    u64(value.size());
    out_.insert(out_.end(), value.begin(), value.end());
  }
  void string(std::string_view value) {
    u64(value.size());
    out_.insert(out_.end(), value.begin(), value.end());
  }
  // Bytes as they are, no length before them (the token handshake's fixed-size fields).
  void raw_bytes(std::span<const std::uint8_t> value) { out_.insert(out_.end(), value.begin(), value.end()); }

 private:
  template <class T>
  void raw(T value) {
    std::uint8_t encoded[sizeof(T)];
    std::memcpy(encoded, &value, sizeof(T));
    out_.insert(out_.end(), encoded, encoded + sizeof(T));
  }

  std::vector<std::uint8_t>& out_;
};

// One decoded request. Which fields are filled depends on the command:
//   keys    every command that names keys (MULTI_SET: one per pair);
//   values  SET/APPEND: 1; COMPARE_SET: expected, desired; MULTI_SET: one per key;
//   delta   ADD;  word  VALIDATE's magic, PING's nonce, AUTH_HELLO's version;
//   token   AUTH_HELLO's nonce or AUTH_PROOF's proof.
struct request {
  tcp_store_protocol::command command = command::validate;
  std::vector<std::string> keys;
  std::vector<std::vector<std::uint8_t>> values;
  std::int64_t delta = 0;
  std::uint32_t word = 0;
  std::array<std::uint8_t, auth_nonce_bytes> token{};
};

enum class parse_status { complete, incomplete, malformed };

struct parse_result {
  parse_status status = parse_status::incomplete;
  // complete: bytes the request took. incomplete: the input size at which trying again can
  // make progress (a lower bound), so a server need not re-parse on every small read.
  std::uint64_t bytes = 0;
  std::string error;  // malformed: what was wrong, with the sizes
};

namespace parsing {

// Reads from the front of a buffer; every read checks the bytes are there first, and every
// length is checked against its limit before anything of that length is allocated or waited for.
class cursor {
 public:
  explicit cursor(std::span<const std::uint8_t> input, const limits& bounds = {}) : input_(input), limits_(bounds) {}

  bool failed() const noexcept { return state_ != parse_status::complete; }
  parse_result result() const {
    if (state_ == parse_status::complete) return {parse_status::complete, position_, {}};
    return {state_, needed_, error_};
  }

  const limits& bounds() const noexcept { return limits_; }

  template <class T>
  bool fixed(T& value) {
    if (!ensure(sizeof(T))) return false;
    std::memcpy(&value, input_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return true;
  }

  bool string(std::string& value, std::uint64_t limit, const char* what) {
    std::uint64_t size = 0;
    if (!length(size, limit, what)) return false;
    value.assign(reinterpret_cast<const char*>(input_.data() + position_), size);
    position_ += size;
    return true;
  }

  bool data(std::vector<std::uint8_t>& value, std::uint64_t limit, const char* what) {
    std::uint64_t size = 0;
    if (!length(size, limit, what)) return false;
    value.assign(input_.data() + position_, input_.data() + position_ + size);
    position_ += size;
    return true;
  }

  bool count(std::uint64_t& value, const char* what) {
    if (!fixed(value)) return false;
    if (value > max_keys_per_request)
      return malformed(
          detail::text(what, " count ", std::to_string(value), " exceeds ", std::to_string(max_keys_per_request)));
    return true;
  }

  bool malformed(std::string error) {
    state_ = parse_status::malformed;
    error_ = std::move(error);
    return false;
  }

 private:
  bool length(std::uint64_t& size, std::uint64_t limit, const char* what) {
    if (!fixed(size)) return false;
    if (size > limit)
      return malformed(
          detail::text(what, " of ", std::to_string(size), " bytes exceeds the limit of ", std::to_string(limit)));
    return ensure(size);
  }

  bool ensure(std::uint64_t size) {
    const std::uint64_t end = position_ + size;
    if (end > limits_.max_request_bytes)
      return malformed(detail::text("request of at least ", std::to_string(end), " bytes exceeds the limit of ",
                                    std::to_string(limits_.max_request_bytes)));
    if (end > input_.size()) {
      state_ = parse_status::incomplete;
      needed_ = end;
      return false;
    }
    return true;
  }

  std::span<const std::uint8_t> input_;
  limits limits_;
  std::uint64_t position_ = 0;
  std::uint64_t needed_ = 0;
  parse_status state_ = parse_status::complete;
  std::string error_;
};

COHORT_DECL bool key_list(cursor& in, request& out);

}  // namespace parsing

// Decodes the request at the front of input, if it is all there.
COHORT_DECL parse_result parse_request(std::span<const std::uint8_t> input, request& out, const limits& bounds = {});

}  // namespace cohort::inline v0::detail::tcp_store_protocol

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/tcp_store_protocol.ipp"
#endif
