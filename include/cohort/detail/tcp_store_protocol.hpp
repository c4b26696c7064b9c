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
// Limits (c10d's libuv server has similar ones; ours are documented here and enforced on
// every length before anything is allocated). A request that breaks one is malformed, and a
// malformed request closes that one connection, never the server:
//   key            at most 64 KiB
//   value          at most 256 MiB (rendezvous data is addresses and ids, not tensors)
//   keys/request   at most 128 Ki
//   request        at most 2 x 256 MiB + 16 MiB in total (COMPARE_SET carries two values)

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
};
inline constexpr std::uint8_t last_command = static_cast<std::uint8_t>(command::ping);

enum class check_reply : std::uint8_t { ready = 0, not_ready = 1 };
enum class wait_reply : std::uint8_t { stop_waiting = 0, wait_canceled = 1 };

inline constexpr std::uint32_t validation_magic = 0x3C85F7CEu;

inline constexpr std::uint64_t max_key_bytes = std::uint64_t{64} << 10;
inline constexpr std::uint64_t max_value_bytes = std::uint64_t{256} << 20;
inline constexpr std::uint64_t max_keys_per_request = std::uint64_t{128} << 10;
inline constexpr std::uint64_t max_request_bytes = 2 * max_value_bytes + (std::uint64_t{16} << 20);

static_assert(std::endian::native == std::endian::little,
              "c10d's TCPStore sends integers in host order; cohort supports little-endian hosts");

const char* command_name(command c) noexcept;

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
//   delta   ADD;  word  VALIDATE's magic or PING's nonce.
struct request {
  tcp_store_protocol::command command = command::validate;
  std::vector<std::string> keys;
  std::vector<std::vector<std::uint8_t>> values;
  std::int64_t delta = 0;
  std::uint32_t word = 0;
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
  explicit cursor(std::span<const std::uint8_t> input) : input_(input) {}

  bool failed() const noexcept { return state_ != parse_status::complete; }
  parse_result result() const {
    if (state_ == parse_status::complete) return {parse_status::complete, position_, {}};
    return {state_, needed_, error_};
  }

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
      return malformed(std::string(what) + " count " + std::to_string(value) + " exceeds " +
                       std::to_string(max_keys_per_request));
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
      return malformed(std::string(what) + " of " + std::to_string(size) + " bytes exceeds the limit of " +
                       std::to_string(limit));
    return ensure(size);
  }

  bool ensure(std::uint64_t size) {
    const std::uint64_t end = position_ + size;
    if (end > max_request_bytes)
      return malformed("request of at least " + std::to_string(end) + " bytes exceeds the limit of " +
                       std::to_string(max_request_bytes));
    if (end > input_.size()) {
      state_ = parse_status::incomplete;
      needed_ = end;
      return false;
    }
    return true;
  }

  std::span<const std::uint8_t> input_;
  std::uint64_t position_ = 0;
  std::uint64_t needed_ = 0;
  parse_status state_ = parse_status::complete;
  std::string error_;
};

bool key_list(cursor& in, request& out);

}  // namespace parsing

// Decodes the request at the front of input, if it is all there.
parse_result parse_request(std::span<const std::uint8_t> input, request& out);

}  // namespace cohort::inline v0::detail::tcp_store_protocol

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/detail/config.hpp"
#include "cohort/impl/tcp_store_protocol.ipp"
#endif
