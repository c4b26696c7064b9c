#pragma once
// tcp_store_server: the TCP store's server alone, speaking PyTorch c10d TCPStore's wire
// protocol (torch 2.x): a background thread over one listening socket, bound only to the
// address it is given (loopback stays loopback). tcp_store (tcp_store.hpp) hosts one inside
// rank 0's handle; protocol, limits and wire layout: rendezvous/detail/tcp_store_protocol.hpp; the trust
// model and what each setting protects: SECURITY.md.

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/tcp_socket.hpp"
#include "cohort/rendezvous/detail/tcp_store_protocol.hpp"
#include "cohort/rendezvous/tcp_store_server_options.hpp"

namespace cohort::inline v0 {

// tcp_store_server_options: cohort/rendezvous/tcp_store_server_options.hpp.

// ------------------------------------------------------------------------------------------
// The server: one thread, epoll over the listening socket and every connection. Requests are
// decoded from per-connection buffers (rendezvous/detail/tcp_store_protocol.hpp bounds every length);
// WAITs are parked here and answered when their keys appear. A malformed or refused request,
// or any failure while serving one connection, closes that connection only.

class tcp_store_server {
 public:
  // Listens on host:port (port 0: a free port, see port()). host "" listens on every
  // interface; any other host listens only on the address it resolves to.
  COHORT_DECL explicit tcp_store_server(std::string host, std::uint16_t port = 0, int rank = -1,
                                        tcp_store_server_options options = {});

  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;

  COHORT_DECL ~tcp_store_server();

  const std::string& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::string endpoint() const { return detail::tcp::endpoint(host_, port_); }
  const tcp_store_server_options& options() const noexcept { return options_; }
  // The connection limit in force (options.max_connections, or the one derived from the
  // descriptor limit).
  std::size_t max_connections() const noexcept { return max_connections_; }

  // Connections closed because they sent something malformed or were refused (limits, token,
  // timeouts, capacity), and the last reason why. The first few are also printed on stderr
  // (a refused rank would otherwise only see a reset).
  std::size_t rejected_connections() const noexcept { return rejected_.load(); }
  COHORT_DECL std::string last_rejection() const;
  // Bytes the server holds now (what max_memory_bytes bounds) and connections open now.
  std::uint64_t held_bytes() const noexcept { return held_published_.load(std::memory_order_relaxed); }
  std::size_t open_connections() const noexcept { return open_published_.load(std::memory_order_relaxed); }

 private:
  using bytes_t = std::vector<std::uint8_t>;
  using clock = detail::tcp::clock;
  static constexpr std::size_t read_chunk = std::size_t{64} << 10;
  // Reading stops after this much per connection per round, so one fast sender cannot
  // starve the others.
  static constexpr std::size_t read_budget = std::size_t{4} << 20;
  // An emptied input buffer up to this size is kept for the next request, a larger one freed.
  static constexpr std::size_t kept_input = 4096;
  // Requests up to this size draw on the last eighth of the memory budget too.
  static constexpr std::uint64_t small_request = std::uint64_t{64} << 10;
  static constexpr std::uint64_t entry_overhead = 64;  // what an entry costs beyond key and value

  // A stored value, shared by the map and by every reply still sending it; it counts itself
  // in the server's memory while it lives.
  struct value_block {
    bytes_t bytes;
    std::uint64_t* held;
    value_block(bytes_t data, std::uint64_t* counter) : bytes(std::move(data)), held(counter) { *held += bytes.size(); }
    value_block(const value_block&) = delete;
    value_block& operator=(const value_block&) = delete;
    ~value_block() { *held -= bytes.size(); }
  };
  using value_ptr = std::shared_ptr<const value_block>;

  struct output_segment {
    value_ptr shared;  // a value sent without copying, or
    bytes_t owned;     // bytes of the reply itself
    std::size_t offset = 0;
    std::size_t size() const noexcept { return shared ? shared->bytes.size() : owned.size(); }
    const std::uint8_t* data() const noexcept { return shared ? shared->bytes.data() : owned.data(); }
  };

  enum class stage : std::uint8_t { fresh, validated, challenged, ready };

  struct connection {
    std::uint64_t id = 0;
    detail::tcp::file_descriptor socket;
    bytes_t input;
    std::size_t input_start = 0;      // bytes of input already consumed
    std::uint64_t input_needed = 0;   // don't re-parse until this many unconsumed bytes
    std::uint64_t input_counted = 0;  // input's capacity as counted in held_
    std::deque<output_segment> output;
    std::uint64_t output_queued = 0;  // unsent bytes in output
    std::string peer;                 // "address:port", for the log
    stage step = stage::fresh;
    bool productive = false;  // has sent a store request (not only the handshake)
    bool closing = false;
    std::uint32_t interest = 0;  // the epoll events registered
    clock::time_point accepted;
    clock::time_point last_input;
    clock::time_point last_output;
    detail::tcp_store_protocol::nonce client_nonce{};
    detail::tcp_store_protocol::nonce server_nonce{};
    std::size_t keys_awaited = 0;
    std::vector<std::string> waiting_on;
  };

  COHORT_DECL void listen_on(std::uint16_t port);
  COHORT_DECL void size_connection_limit();

  COHORT_DECL void serve();
  COHORT_DECL void accept_all();
  COHORT_DECL void place(int fd);
  // Holds the connection's local address under store_reached_key (tcp_store_protocol.hpp)
  // unless it is a loopback (or link-local) one: where ranks of other hosts reach this one.
  [[gnu::cold]] COHORT_DECL void note_reached_address(int fd);
  [[gnu::cold]] COHORT_DECL bool evict_untrusted(const char* why);
  [[gnu::cold]] COHORT_DECL void refuse_busy(int fd);
  COHORT_DECL void drain_and_close(int fd);
  bool trusted(const connection& conn) const noexcept {
    return conn.step == stage::ready && (!options_.token.empty() || conn.productive);
  }

  COHORT_DECL void receive(connection& conn);
  COHORT_DECL bool take_input(connection& conn, const std::uint8_t* data, std::size_t size);
  COHORT_DECL void process(connection& conn);
  COHORT_DECL bool gatekeep(connection& conn, std::uint8_t code);
  COHORT_DECL void handle(connection& conn, detail::tcp_store_protocol::request& request);
  [[gnu::cold]] COHORT_DECL void authenticate(connection& conn, detail::tcp_store_protocol::request& request);

  COHORT_DECL bool admit(std::uint64_t more, std::uint64_t request_size) const noexcept;
  COHORT_DECL bool store_value(connection& conn, const std::string& key, bytes_t value);
  value_ptr make_value(bytes_t data) { return std::make_shared<const value_block>(std::move(data), &held_); }
  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return data_.count(key) > 0; });
  }

  COHORT_DECL void wake_waiters(const std::string& key);
  COHORT_DECL void clear_wait_state(connection& conn);

  // Queues a reply (its own bytes, then a stored value sent without copying); send also
  // writes what the socket takes now.
  COHORT_DECL void queue(connection& conn, bytes_t reply, value_ptr shared = nullptr);
  COHORT_DECL void send(connection& conn, bytes_t reply, value_ptr shared = nullptr);
  COHORT_DECL void flush(connection& conn);
  bool backpressured(const connection& conn) const noexcept {
    return conn.output_queued > options_.max_queued_reply_bytes;
  }
  COHORT_DECL void update_interest(connection& conn);
  COHORT_DECL void sweep(clock::time_point now);

  // Logs why, writes the farewell bytes (a last reply, or a marker: busy_marker,
  // token_required_marker, when not 0) and closes.
  [[gnu::cold]] COHORT_DECL void reject(connection& conn, const std::string& reason,
                                        std::span<const std::uint8_t> farewell);
  [[gnu::cold]] COHORT_DECL void reject(connection& conn, const std::string& reason, std::uint32_t marker = 0);
  COHORT_DECL void close_now(connection& conn);
  [[gnu::cold]] COHORT_DECL void log_refusal(const std::string& peer, const std::string& reason);
  // A client presented another job's record where this server holds its job's (options.job).
  [[gnu::cold]] COHORT_DECL void note_stranger(const connection& conn, std::span<const std::uint8_t> presented);
  static constexpr std::size_t logged_rejections = 8;

  COHORT_DECL void remove_closed();
  void publish_stats() noexcept {
    held_published_.store(held_, std::memory_order_relaxed);
    open_published_.store(connections_.size(), std::memory_order_relaxed);
  }

  std::string host_;
  int rank_ = -1;
  std::uint16_t port_ = 0;
  tcp_store_server_options options_;
  detail::tcp_store_protocol::limits limits_;
  std::size_t max_connections_ = 0;
  detail::tcp::file_descriptor listener_;
  detail::tcp::file_descriptor wake_read_;
  detail::tcp::file_descriptor wake_write_;
  detail::tcp::file_descriptor epoll_;
  detail::tcp::file_descriptor spare_;  // given up to take a connection when out of descriptors

  // Owned by the server thread once it runs. held_ is declared before everything that holds
  // value blocks, which count themselves out of it when destroyed.
  std::uint64_t held_ = 0;
  bool reached_ = false;  // store_reached_key is held
  std::unordered_map<std::string, value_ptr> data_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_;
  std::unordered_map<std::uint64_t, connection> connections_;
  std::vector<std::uint64_t> dirty_;    // connections whose epoll interest may have changed
  std::vector<std::uint64_t> closing_;  // connections to remove at the end of the round
  std::vector<std::uint8_t> scratch_ = std::vector<std::uint8_t>(read_chunk);
  std::uint64_t next_id_ = 2;  // 0 and 1 are the wake pipe and the listener

  std::atomic<std::size_t> rejected_{0};
  std::atomic<std::uint64_t> held_published_{0};
  std::atomic<std::size_t> open_published_{0};
  mutable std::mutex report_mutex_;
  std::string last_rejection_;
  std::thread thread_;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/tcp_store_server.ipp"
#endif
