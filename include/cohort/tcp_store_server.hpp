#pragma once
// tcp_store_server: the TCP store's server alone, speaking PyTorch c10d TCPStore's wire
// protocol (torch 2.x): a background thread polling one listening socket, bound only to the
// address it is given (loopback stays loopback). tcp_store (tcp_store.hpp) hosts one inside
// rank 0's handle; protocol, limits and wire layout: detail/tcp_store_protocol.hpp.

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/detail/tcp_socket.hpp"
#include "cohort/detail/tcp_store_protocol.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

// ------------------------------------------------------------------------------------------
// The server: one thread, poll() over the listening socket and every connection. Requests
// are decoded from per-connection buffers (detail/tcp_store_protocol.hpp bounds every length);
// WAITs are parked here and answered when their keys appear. A malformed request, or any
// failure while serving one connection, closes that connection only.

class tcp_store_server {
 public:
  // Listens on host:port (port 0: a free port, see port()). host "" listens on every
  // interface; any other host listens only on the address it resolves to.
  explicit tcp_store_server(std::string host, std::uint16_t port = 0, int rank = -1);

  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;

  ~tcp_store_server();

  const std::string& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::string endpoint() const { return detail::tcp::endpoint(host_, port_); }

  // Connections closed because they sent something malformed, and the last reason why. The
  // first few are also printed on stderr (a refused rank would otherwise only see a reset).
  std::size_t rejected_connections() const noexcept { return rejected_.load(); }
  std::string last_rejection() const;

 private:
  using bytes_t = std::vector<std::uint8_t>;
  static constexpr std::size_t read_chunk = std::size_t{64} << 10;
  // Reading stops after this much per connection per poll round, so one fast sender cannot
  // starve the others.
  static constexpr std::size_t read_budget = std::size_t{4} << 20;
  // A client that stops reading its replies is cut off once this much is queued for it.
  static constexpr std::uint64_t max_queued_reply_bytes =
      detail::tcp_store_protocol::max_request_bytes + detail::tcp_store_protocol::max_value_bytes;

  struct connection {
    detail::tcp::file_descriptor socket;
    bytes_t input;
    std::size_t input_start = 0;     // bytes of input already consumed
    std::uint64_t input_needed = 0;  // don't re-parse until this many unconsumed bytes
    bytes_t output;
    std::size_t output_start = 0;
    std::string peer;  // "address:port", for the log
    bool validated = false;
    bool closing = false;
    std::size_t keys_awaited = 0;
    std::vector<std::string> waiting_on;
  };

  void listen_on(std::uint16_t port);

  void serve();

  void accept_all();

  void receive(std::uint64_t id, connection& conn);

  void process(std::uint64_t id, connection& conn);

  void handle(std::uint64_t id, connection& conn, detail::tcp_store_protocol::request& request);

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return data_.count(key) > 0; });
  }

  void wake_waiters(const std::string& key);

  void clear_wait_state(std::uint64_t id, connection& conn);

  void send(connection& conn, std::span<const std::uint8_t> reply);

  void flush(connection& conn);

  void reject(connection& conn, const std::string& reason);
  static constexpr std::size_t logged_rejections = 8;

  void remove_closed();

  std::string host_;
  int rank_ = -1;
  std::uint16_t port_ = 0;
  detail::tcp::file_descriptor listener_;
  detail::tcp::file_descriptor wake_read_;
  detail::tcp::file_descriptor wake_write_;

  // Owned by the server thread once it runs.
  std::unordered_map<std::string, bytes_t> data_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_;
  std::unordered_map<std::uint64_t, connection> connections_;
  std::uint64_t next_id_ = 1;

  std::atomic<std::size_t> rejected_{0};
  mutable std::mutex report_mutex_;
  std::string last_rejection_;
  std::thread thread_;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/tcp_store_server.ipp"
#endif
