#pragma once
// TCP rendezvous store speaking PyTorch c10d TCPStore's wire protocol (torch 2.x), so cohort
// programs and torch programs can share one store, and a cohort program started by
// `torchrun --no-python` joins the store torchrun's elastic agent already serves.
//
//   tcp_store          a client handle (a `store`); with options.is_server it also owns a
//                      tcp_store_server (tcp_store_server.hpp), which lives as long as this
//                      handle.
//   connect_store(env) what a launched program calls: see its comment.
//
// Like c10d's client, tcp_store puts options.key_prefix ("/") before every key on the wire,
// so `store.set("x", ...)` in Python and `get("x")` here name the same key.
// Protocol, limits and wire layout: rendezvous/detail/tcp_store_protocol.hpp. Trust model, the token
// (COHORT_STORE_TOKEN) and the server's limits: SECURITY.md.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/tcp_socket.hpp"
#include "cohort/rendezvous/detail/tcp_store_protocol.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store_server_options.hpp"

namespace cohort::inline v0 {

class tcp_store_server;  // tcp_store_server.hpp: include it to use server() beyond a null check

// ------------------------------------------------------------------------------------------
// The client. One connection per handle; a mutex makes a handle safe to share between
// threads (one request at a time, as c10d's client). After an I/O failure or a reply that
// did not come in time the connection is closed, and later calls say so.

struct tcp_store_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 29500;
  // Host a tcp_store_server on host:port inside this handle (port 0: any free port).
  bool is_server = false;
  // When set, every handle counts itself in under the key "init/" (as c10d does), and the
  // server-hosting handle waits, at most timeout, until this many have joined.
  std::optional<int> num_workers;
  bool wait_for_workers = true;
  // Bound of every operation (the store's timeout(); change it later with set_timeout).
  std::chrono::milliseconds timeout = store::default_timeout;
  // Connecting retries with exponential backoff (initial_backoff doubling up to max_backoff)
  // until connect_timeout, so a client may start before its server.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(60);
  std::chrono::milliseconds initial_backoff = std::chrono::milliseconds(10);
  std::chrono::milliseconds max_backoff = std::chrono::seconds(1);
  // While connecting takes longer, a line every this long says so (0: never). Default:
  // COHORT_PROGRESS_INTERVAL (seconds), else 30 s.
  std::chrono::milliseconds progress_interval = detail::default_progress_interval();
  // Put before every key on the wire; "/" is what c10d's TCPStore client uses.
  std::string key_prefix = "/";
  // Named in error messages.
  int rank = -1;
  // The shared secret (SECURITY.md). When set, this handle proves it in a challenge-response
  // handshake (never sending it) and accepts only a server that proves it too; a hosted
  // server then serves only such clients. Empty: c10d's protocol, as PyTorch speaks it.
  // connect_store fills it from COHORT_STORE_TOKEN or COHORT_STORE_TOKEN_FILE.
  std::string token;
  // Limits of the hosted server (is_server); its token is `token` above.
  tcp_store_server_options server;
  // connect_store's: when set, the handshake ends with COMPARE_SET(greeting_key, "", greeting)
  // in place of its PING, one request less per rank. Its answer proves the server speaks the
  // protocol as the PING's echo would, and is what the key holds (the job's record):
  // greeting_answer(). Connections made by bounded() send a PING.
  std::string greeting_key;
  std::string greeting;
};

// The token of SECURITY.md from the environment: COHORT_STORE_TOKEN, or the contents of the
// file COHORT_STORE_TOKEN_FILE names (one trailing newline dropped); empty when neither is
// set. Throws when both are set, or the file cannot be read or is empty.
COHORT_COLD std::string store_token_from_environment(int rank = -1);

class tcp_store final : public store {
 public:
  COHORT_DECL explicit tcp_store(tcp_store_options options);

  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;

  // What a launched program calls; the same as connect_store(env, options) below.
  COHORT_COLD static std::shared_ptr<store> connect(const launch_env& env, tcp_store_options options = {});

  const std::string& host() const noexcept { return options_.host; }
  std::uint16_t port() const noexcept { return options_.port; }
  std::string endpoint() const { return detail::tcp::endpoint(options_.host, options_.port); }
  // The server this handle hosts (options.is_server), else null.
  const std::shared_ptr<tcp_store_server>& server() const noexcept { return server_; }

  void set(std::string_view key, std::span<const std::uint8_t> value) override { set_within(key, value, timeout()); }
  using store::set;
  COHORT_DECL void set_within(std::string_view key, std::span<const std::uint8_t> value,
                              std::chrono::milliseconds timeout) override;

  // Waits for the key (c10d's client also WAITs before its GET), then reads it.
  COHORT_DECL bytes get(std::string_view key, std::chrono::milliseconds timeout) override;
  using store::get;

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return add_wire(wire_key("add", key), key, delta, timeout());
  }
  std::int64_t add_within(std::string_view key, std::int64_t delta, std::chrono::milliseconds timeout) override {
    return add_wire(wire_key("add", key), key, delta, timeout);
  }

  COHORT_DECL bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                std::span<const std::uint8_t> desired) override;

  COHORT_DECL bool check(std::span<const std::string> keys) override;

  COHORT_DECL void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override;
  using store::wait;

  COHORT_DECL bool delete_key(std::string_view key) override;

  // Counts every key on the server (c10d counts its "init/" key too).
  COHORT_DECL std::int64_t num_keys() override;

  // One WAIT for every key, then one MULTI_GET (c10d has had it since PyTorch 2.0, before
  // VALIDATE, so every server that passes cohort's handshake has it): two requests in all.
  COHORT_DECL std::vector<bytes> multi_get(std::span<const std::string> keys,
                                           std::chrono::milliseconds timeout) override;
  using store::multi_get;

  // c10d's extensions beyond `store` (Gloo's v2 store interface has the same ones).
  COHORT_DECL void append(std::string_view key, std::span<const std::uint8_t> value);

  COHORT_DECL void multi_set(std::span<const std::string> keys, std::span<const bytes> values);

  // A second connection to the same server (never hosting one), with `timeout` as its
  // timeout() and its connect timeout: see store::bounded.
  [[gnu::cold]] COHORT_DECL std::shared_ptr<store> bounded(std::chrono::milliseconds timeout) const override;
  std::string location() const override { return endpoint(); }
  // Read from cohort's server (the key tcp_store_protocol::store_reached_key); empty under
  // torchrun's agent store, which writes no such key.
  COHORT_DECL std::string reached_from_other_hosts(std::chrono::milliseconds limit) override;

  // One round trip; throws when the server does not answer within timeout().
  COHORT_DECL void ping();

  // Messages this handle has sent (the handshake's included): what bench_rendezvous counts.
  std::uint64_t requests_sent() const noexcept { return requests_.load(std::memory_order_relaxed); }
  // What the handshake's COMPARE_SET answered (options.greeting_key); empty without one.
  const bytes& greeting_answer() const noexcept { return greeting_answer_; }
  // Whether this handle proved the token (options.token) to its server.
  bool authenticated() const noexcept { return authenticated_; }

 private:
  using clock = detail::tcp::clock;
  using writer = detail::tcp_store_protocol::message_writer;
  using command = detail::tcp_store_protocol::command;
  using check_reply = detail::tcp_store_protocol::check_reply;
  using wait_reply = detail::tcp_store_protocol::wait_reply;

  static std::string_view first_key(std::span<const std::string> keys) {
    return keys.empty() ? std::string_view{} : std::string_view(keys.front());
  }

  static std::string quoted(std::string_view key) { return detail::text("'", key, "'"); }

  COHORT_DECL std::string wire_key(std::string_view operation, std::string_view key) const;

  COHORT_DECL void check_value_size(std::string_view operation, std::string_view key, std::size_t size) const;

  COHORT_DECL void write_key_list(writer& write, command which, std::span<const std::string> keys,
                                  std::string_view operation) const;

  // --- failure reporting: the connection is closed, and the reason kept for later calls.

  [[gnu::cold]] [[noreturn]] COHORT_DECL void fail(std::string_view operation, const std::string& detail);

  [[gnu::cold]] [[noreturn]] COHORT_DECL void fail_timeout(std::string_view operation, const std::string& detail);

  // The server wrote its busy marker (rendezvous/detail/tcp_store_protocol.hpp): retried by connect().
  [[gnu::cold]] [[noreturn]] COHORT_DECL void fail_busy(std::string_view operation);

  COHORT_DECL void usable(std::string_view operation) const;

  // --- raw I/O with a deadline.

  COHORT_DECL void send_all(std::string_view operation, std::span<const std::uint8_t> data, clock::time_point deadline);

  COHORT_DECL void receive_exact(std::string_view operation, std::string_view key, void* destination, std::size_t size,
                                 clock::time_point deadline);

  template <class T>
  T receive_value(std::string_view operation, std::string_view key, clock::time_point deadline) {
    T value{};
    receive_exact(operation, key, &value, sizeof(T), deadline);
    return value;
  }

  COHORT_DECL bytes receive_data(std::string_view operation, std::string_view key, clock::time_point deadline);

  void drop_connection() noexcept {
    socket_.reset();
    inbox_start_ = inbox_end_ = 0;
  }

  // --- one request and its reply, bounded by timeout().

  static void no_reply(clock::time_point) {}

  template <class Write, class Read = decltype(&no_reply)>
  void exchange_locked(std::string_view operation, Write&& write, Read&& read = &no_reply) {
    usable(operation);
    bytes message;
    writer out(message);
    write(out);
    const auto deadline = clock::now() + request_timeout();
    send_message(operation, message, deadline);
    read(deadline);
  }

  // exchange, waiting at most `limit` (or timeout(), if shorter) for the reply.
  template <class Write, class Read = decltype(&no_reply)>
  void exchange_within(std::string_view operation, std::chrono::milliseconds limit, Write&& write,
                       Read&& read = &no_reply) {
    std::lock_guard lock(mutex_);
    request_limit_ = limit;
    struct reset {
      std::chrono::milliseconds& limit;
      ~reset() { limit = std::chrono::milliseconds(0); }
    } back_to_timeout{request_limit_};
    exchange_locked(operation, std::forward<Write>(write), std::forward<Read>(read));
  }

  // What the request in flight waits at most (under mutex_), and what its timeout error says.
  std::chrono::milliseconds request_timeout() const noexcept {
    return request_limit_.count() > 0 ? std::min(request_limit_, timeout()) : timeout();
  }

  // For a wait or get with a bound of the caller's: the requests and replies around the wait
  // take at most that bound (at least 2 s), not the store's own timeout. Under mutex_.
  struct reply_bound {
    std::chrono::milliseconds& limit;
    std::chrono::milliseconds saved;
    reply_bound(std::chrono::milliseconds& slot, std::chrono::milliseconds wait) : limit(slot), saved(slot) {
      limit = std::max<std::chrono::milliseconds>(wait, std::chrono::seconds(2));
    }
    reply_bound(const reply_bound&) = delete;
    reply_bound& operator=(const reply_bound&) = delete;
    ~reply_bound() { limit = saved; }
  };

  void send_message(std::string_view operation, std::span<const std::uint8_t> data, clock::time_point deadline,
                    std::uint64_t messages = 1) {
    requests_.fetch_add(messages, std::memory_order_relaxed);
    send_all(operation, data, deadline);
  }

  template <class Write, class Read = decltype(&no_reply)>
  void exchange(std::string_view operation, Write&& write, Read&& read = &no_reply) {
    std::lock_guard lock(mutex_);
    exchange_locked(operation, std::forward<Write>(write), std::forward<Read>(read));
  }

  COHORT_DECL bytes get_locked(const std::string& wire, std::string_view key);

  COHORT_DECL std::int64_t add_wire(const std::string& wire, std::string_view key, std::int64_t delta,
                                    std::chrono::milliseconds limit);

  COHORT_DECL bool check_locked(std::span<const std::string> keys);

  // The server parks a WAIT until every key exists. When our time runs out we CANCEL_WAIT;
  // the server then confirms with WAIT_CANCELED, possibly after a STOP_WAITING that crossed
  // our cancel on the wire (then the keys did arrive, and the wait succeeded).
  COHORT_DECL void wait_locked(std::span<const std::string> keys, std::chrono::milliseconds limit,
                               std::string_view operation);

  COHORT_DECL void ping_locked(clock::time_point deadline, std::string_view operation);
  COHORT_DECL std::uint32_t append_ping(writer& out);  // returns the nonce to expect back
  COHORT_DECL void read_ping_echo(std::uint32_t nonce, clock::time_point deadline, std::string_view operation);
  // Throws what a refusal marker in place of an answer means (busy, token required); returns
  // for anything else.
  COHORT_DECL void fail_on_marker(std::uint32_t first_bytes, std::string_view operation);
  // The handshake's last request and its answer: options.greeting's COMPARE_SET, else a PING
  // (append_ping's nonce is returned and expected back).
  COHORT_DECL std::uint32_t append_handshake_end(writer& out);
  COHORT_DECL void read_handshake_end(std::uint32_t nonce, clock::time_point deadline);
  // Waits for the first bytes of the server's answer to the handshake; a server silent until
  // `deadline` is told the request ended (half-close) and what it answers then is named.
  COHORT_DECL void await_answer(clock::time_point deadline);
  // What arrives on the connection within `within` (up to 256 bytes), after what was read ahead.
  [[gnu::cold]] COHORT_DECL std::string read_available(std::chrono::milliseconds within);
  // "the server at X answered cohort's handshake with '...' ...": bytes that are not the protocol.
  [[gnu::cold]] COHORT_DECL std::string not_a_store(std::string_view answered) const;

  // --- connecting.

  COHORT_DECL void connect();

  // One attempt; returns why it failed, or an empty string once connected and validated.
  COHORT_DECL std::string try_connect(clock::time_point deadline);

  // VALIDATE, the token exchange (options.token), PING.
  COHORT_DECL void handshake_locked(clock::time_point deadline);
  COHORT_DECL void prove_token(const detail::tcp_store_protocol::nonce& client, clock::time_point deadline);

  [[gnu::cold]] COHORT_DECL void join_workers(int workers);

  tcp_store_options options_;
  std::shared_ptr<tcp_store_server> server_;  // declared first: outlives the connection
  std::mutex mutex_;
  detail::tcp::file_descriptor socket_;
  // Bytes of replies read ahead and not yet taken (receive_exact).
  static constexpr std::size_t inbox_capacity = std::size_t{64} << 10;
  bytes inbox_;
  std::size_t inbox_start_ = 0;  // inbox_[start, end) is unread
  std::size_t inbox_end_ = 0;
  std::string broken_;
  // Under mutex_: the bound a caller set on the request in flight (set_within, add_within);
  // zero when it is timeout().
  std::chrono::milliseconds request_limit_{0};
  std::uint32_t ping_count_ = 0;
  bytes greeting_answer_;
  std::atomic<std::uint64_t> requests_{0};
  bool authenticated_ = false;
  // What the server said it accepts (after the token exchange; else the protocol's ceilings).
  std::uint64_t max_key_bytes_ = detail::tcp_store_protocol::max_key_bytes;
  std::uint64_t max_value_bytes_ = detail::tcp_store_protocol::max_value_bytes;
  // How the last connection attempt's handshake went (connect() only). busy: the server is at
  // its connection limit (retried); fatal: an answer that retrying cannot change (a token
  // mismatch), thrown at once.
  enum class handshake { not_reached, refused, unanswered, busy, fatal } handshake_ = handshake::not_reached;
  std::string fatal_hint_;
};

// Connects a launched program to its rendezvous store.
//  - Under torchrun's elastic agent (env.use_agent_store): a client of the TCPStore the agent
//    already serves at MASTER_ADDR:MASTER_PORT, inside prefix_store(env.store_prefix()), the
//    keys torch workers of this restart attempt use. PyTorch's server checks no token, so a
//    token set there is refused with an error that says so.
//  - Otherwise rank 0 hosts a server on MASTER_ADDR:MASTER_PORT (that address only) and every
//    rank, rank 0 included, is a client of it. Rank 0's handle owns the server: keep it alive
//    until every rank is done with the store. The server keeps room for env.world_size ranks
//    (options.server.reserved_connections, unless set). Where MASTER_ADDR is a name (not a
//    loopback address as written) that resolves to a loopback address here while the world
//    spans nodes (Debian's /etc/hosts maps the host's own name to 127.0.1.1), the server
//    listens on every interface, as PyTorch's does: the other nodes reach this host by the
//    name's address in their own /etc/hosts or DNS (options.server.listen_on_every_interface).
// host, port, is_server and rank come from env; the token from options.token or else the
// environment (store_token_from_environment); timeouts, limits and num_workers from options.
// A rank waits for its store host at most the longer of options.connect_timeout and
// options.timeout (the job's wait), with progress lines. Every rank reads the job's identity in
// its handshake (options.greeting), refuses another job's store, and claims its rank (see
// rendezvous/detail/job_identity.hpp).
COHORT_COLD std::shared_ptr<store> connect_store(const launch_env& env, tcp_store_options options = {});

COHORT_COLD_BODY inline std::shared_ptr<store> tcp_store::connect(const launch_env& env, tcp_store_options options) {
  return connect_store(env, std::move(options));
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/tcp_store.ipp"
#endif
