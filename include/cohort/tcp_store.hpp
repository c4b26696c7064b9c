#pragma once
// TCP rendezvous store speaking PyTorch c10d TCPStore's wire protocol (torch 2.x), so cohort
// programs and torch programs can share one store, and a cohort program started by
// `torchrun --no-python` joins the store torchrun's elastic agent already serves.
//
//   tcp_store_server   the server alone: a background thread polling one listening socket,
//                      bound only to the address it is given (loopback stays loopback).
//   tcp_store          a client handle (a `store`); with options.is_server it also owns the
//                      server, which lives as long as this handle.
//   connect_store(env) what a launched program calls: see its comment.
//
// Like c10d's client, tcp_store puts options.key_prefix ("/") before every key on the wire,
// so `store.set("x", ...)` in Python and `get("x")` here name the same key.
// Protocol, limits and wire layout: detail/tcp_store_protocol.hpp.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/detail/tcp_store_protocol.hpp"
#include "cohort/error.hpp"
#include "cohort/launch.hpp"
#include "cohort/store.hpp"

namespace cohort::inline v0 {

namespace detail::tcp {

using clock = std::chrono::steady_clock;

inline std::string errno_text(int code) { return std::system_category().message(code); }

// Owns one file descriptor.
class file_descriptor {
 public:
  file_descriptor() = default;
  explicit file_descriptor(int fd) noexcept : fd_(fd) {}
  file_descriptor(file_descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  file_descriptor& operator=(file_descriptor&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  file_descriptor(const file_descriptor&) = delete;
  file_descriptor& operator=(const file_descriptor&) = delete;
  ~file_descriptor() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

inline std::string endpoint(const std::string& host, std::uint16_t port) {
  // IPv6 literals are bracketed so the port stays readable.
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

inline std::chrono::milliseconds elapsed_since(clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
}

// Waits until fd is ready for events or the deadline passes; false on timeout.
inline bool poll_until(int fd, short events, clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now());
    const int wait_ms = static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, INT_MAX));
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, wait_ms);
    if (ready > 0) return true;
    if (ready == 0) {
      if (clock::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) return true;  // let the following send/recv report the error
  }
}

struct address_list {
  addrinfo* head = nullptr;
  address_list() = default;
  address_list(const address_list&) = delete;
  address_list& operator=(const address_list&) = delete;
  ~address_list() {
    if (head) ::freeaddrinfo(head);
  }
};

// Resolves host:port for a stream socket; returns getaddrinfo's error text, or empty on success.
inline std::string resolve(const std::string& host, std::uint16_t port, bool passive, address_list& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string service = std::to_string(port);
  const bool wildcard = host.empty();
  const int status = ::getaddrinfo(wildcard ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (status != 0) return status == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(status);
  return {};
}

// "address:port" of a connected socket's peer, for the server's log.
inline std::string peer_of(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = {};
  std::uint16_t port = 0;
  if (peer.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&peer);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
    port = ntohs(v6->sin6_port);
  } else {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&peer);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
  }
  return endpoint(host, port);
}

// What the handshake's failure most likely means, said on both sides of it.
inline constexpr std::string_view other_protocol =
    "it speaks another c10d store protocol (PyTorch before 2.0, Debian's python3-torch 1.13 for "
    "one, numbers its commands from SET = 0 and sends no VALIDATE) or is not a TCPStore at all; "
    "cohort speaks the TCPStore protocol of PyTorch 2.x (classic and libuv servers)";

inline void set_no_delay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

}  // namespace detail::tcp

// ------------------------------------------------------------------------------------------
// The server: one thread, poll() over the listening socket and every connection. Requests
// are decoded from per-connection buffers (detail/tcp_store_protocol.hpp bounds every length);
// WAITs are parked here and answered when their keys appear. A malformed request, or any
// failure while serving one connection, closes that connection only.

class tcp_store_server {
 public:
  // Listens on host:port (port 0: a free port, see port()). host "" listens on every
  // interface; any other host listens only on the address it resolves to.
  explicit tcp_store_server(std::string host, std::uint16_t port = 0, int rank = -1)
      : host_(std::move(host)), rank_(rank) {
    listen_on(port);
    int pipe_ends[2];
    if (::pipe2(pipe_ends, O_CLOEXEC | O_NONBLOCK) != 0)
      throw error(rank_, "tcp_store_server", "pipe2 failed: " + detail::tcp::errno_text(errno));
    wake_read_.reset(pipe_ends[0]);
    wake_write_.reset(pipe_ends[1]);
    thread_ = std::thread([this] { serve(); });
  }

  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;

  ~tcp_store_server() {
    const char stop = 1;
    while (::write(wake_write_.get(), &stop, 1) < 0 && errno == EINTR) {}
    if (thread_.joinable()) thread_.join();
  }

  const std::string& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::string endpoint() const { return detail::tcp::endpoint(host_, port_); }

  // Connections closed because they sent something malformed, and the last reason why. The
  // first few are also printed on stderr (a refused rank would otherwise only see a reset).
  std::size_t rejected_connections() const noexcept { return rejected_.load(); }
  std::string last_rejection() const {
    std::lock_guard lock(report_mutex_);
    return last_rejection_;
  }

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

  void listen_on(std::uint16_t port) {
    detail::tcp::address_list addresses;
    const std::string failure = detail::tcp::resolve(host_, port, true, addresses);
    if (!failure.empty())
      throw error(rank_, "tcp_store_server",
                  "cannot resolve listen address " + detail::tcp::endpoint(host_, port) + ": " + failure,
                  "set MASTER_ADDR to an address of this host");
    std::string last_error = "no address";
    for (addrinfo* entry = addresses.head; entry; entry = entry->ai_next) {
      detail::tcp::file_descriptor fd(
          ::socket(entry->ai_family, entry->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, entry->ai_protocol));
      if (!fd) {
        last_error = detail::tcp::errno_text(errno);
        continue;
      }
      const int on = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
      if (::bind(fd.get(), entry->ai_addr, entry->ai_addrlen) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
        last_error = detail::tcp::errno_text(errno);
        continue;
      }
      sockaddr_storage bound{};
      socklen_t length = sizeof(bound);
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
      port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listener_ = std::move(fd);
      return;
    }
    throw error(rank_, "tcp_store_server", "cannot listen on " + detail::tcp::endpoint(host_, port) + ": " + last_error,
                "the port may be taken by another job (pick another MASTER_PORT) or the "
                "address may not belong to this host");
  }

  void serve() {
    std::vector<pollfd> polled;
    std::vector<std::uint64_t> polled_ids;
    for (;;) {
      polled.clear();
      polled_ids.clear();
      polled.push_back({wake_read_.get(), POLLIN, 0});
      polled.push_back({listener_.get(), POLLIN, 0});
      for (auto& [id, conn] : connections_) {
        short events = POLLIN;
        if (conn.output.size() > conn.output_start) events |= POLLOUT;
        polled.push_back({conn.socket.get(), events, 0});
        polled_ids.push_back(id);
      }
      if (::poll(polled.data(), polled.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;  // cannot happen with valid descriptors; stop rather than spin
      }
      if (polled[0].revents != 0) return;
      if (polled[1].revents != 0) accept_all();
      for (std::size_t i = 2; i < polled.size(); ++i) {
        if (polled[i].revents == 0) continue;
        const auto it = connections_.find(polled_ids[i - 2]);
        if (it == connections_.end() || it->second.closing) continue;
        try {
          if (polled[i].revents & POLLOUT) flush(it->second);
          if (polled[i].revents & (POLLIN | POLLHUP | POLLERR)) receive(it->first, it->second);
        } catch (const std::exception& failure) {
          reject(it->second, failure.what());
        }
      }
      remove_closed();
    }
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        // Out of descriptors or memory: the pending connection stays queued and poll() would
        // report it again at once, so pause instead of spinning.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;  // EAGAIN, or a connection that died before we took it
      }
      detail::tcp::set_no_delay(fd);
      connection conn;
      conn.socket.reset(fd);
      conn.peer = detail::tcp::peer_of(fd);
      connections_.emplace(next_id_++, std::move(conn));
    }
  }

  void receive(std::uint64_t id, connection& conn) {
    std::size_t taken = 0;
    while (taken < read_budget) {
      const std::size_t old_size = conn.input.size();
      conn.input.resize(old_size + read_chunk);
      const ssize_t got = ::recv(conn.socket.get(), conn.input.data() + old_size, read_chunk, 0);
      conn.input.resize(old_size + static_cast<std::size_t>(std::max<ssize_t>(got, 0)));
      if (got > 0) {
        taken += static_cast<std::size_t>(got);
        continue;
      }
      if (got < 0 && (errno == EINTR)) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      // The peer closed (or the connection failed): serve what it sent before that.
      process(id, conn);
      conn.closing = true;
      return;
    }
    process(id, conn);
  }

  void process(std::uint64_t id, connection& conn) {
    namespace protocol = detail::tcp_store_protocol;
    protocol::request request;
    while (!conn.closing) {
      const std::span<const std::uint8_t> unread(conn.input.data() + conn.input_start,
                                                 conn.input.size() - conn.input_start);
      if (unread.empty() || unread.size() < conn.input_needed) break;
      const auto parsed = protocol::parse_request(unread, request);
      if (parsed.status == protocol::parse_status::incomplete) {
        conn.input_needed = parsed.bytes;
        break;
      }
      if (parsed.status == protocol::parse_status::malformed) {
        reject(conn, parsed.error);
        return;
      }
      conn.input_start += parsed.bytes;
      conn.input_needed = 0;
      handle(id, conn, request);
    }
    // Drop what was consumed; copy the unread tail down only when it is worth it.
    if (conn.input_start == conn.input.size()) {
      conn.input.clear();
      conn.input_start = 0;
      if (conn.input.capacity() > 4 * read_chunk) bytes_t().swap(conn.input);
    } else if (conn.input_start > read_chunk) {
      conn.input.erase(conn.input.begin(), conn.input.begin() + static_cast<std::ptrdiff_t>(conn.input_start));
      conn.input_start = 0;
    }
  }

  void handle(std::uint64_t id, connection& conn, detail::tcp_store_protocol::request& request) {
    namespace protocol = detail::tcp_store_protocol;
    using protocol::command;
    if (!conn.validated && request.command != command::validate)
      return reject(conn, std::string("first message was ") + protocol::command_name(request.command) +
                              " (command byte " + std::to_string(static_cast<int>(request.command)) +
                              "), not VALIDATE: " + std::string(detail::tcp::other_protocol));
    bytes_t reply;
    protocol::message_writer write(reply);
    switch (request.command) {
      case command::validate:
        if (request.word != protocol::validation_magic)
          return reject(conn, "VALIDATE carried magic " + std::to_string(request.word) + ", not " +
                                  std::to_string(protocol::validation_magic) + ": " +
                                  std::string(detail::tcp::other_protocol));
        conn.validated = true;
        break;
      case command::ping: write.u32(request.word); break;
      case command::set:
        data_[request.keys[0]] = std::move(request.values[0]);
        wake_waiters(request.keys[0]);
        break;
      case command::append: {
        auto& value = data_[request.keys[0]];
        if (value.size() + request.values[0].size() > protocol::max_value_bytes)
          return reject(conn, "APPEND would grow key '" + request.keys[0] + "' past " +
                                  std::to_string(protocol::max_value_bytes) + " bytes");
        value.insert(value.end(), request.values[0].begin(), request.values[0].end());
        wake_waiters(request.keys[0]);
        break;
      }
      case command::compare_set: {
        // c10d's semantics: an absent key matches an empty expected value; otherwise the
        // reply is what the key holds afterwards (for an absent key: the expected value).
        const std::string& key = request.keys[0];
        auto& expected = request.values[0];
        auto& desired = request.values[1];
        auto found = data_.find(key);
        if (found == data_.end()) {
          if (expected.empty()) {
            write.data(desired);
            data_.emplace(key, std::move(desired));
            wake_waiters(key);
          } else {
            write.data(expected);
          }
        } else {
          if (found->second == expected) found->second = std::move(desired);
          write.data(found->second);
        }
        break;
      }
      case command::get: {
        const auto found = data_.find(request.keys[0]);
        write.data(found == data_.end() ? bytes_t{} : found->second);
        break;
      }
      case command::add: {
        const std::string& key = request.keys[0];
        std::int64_t value = 0;
        if (const auto found = data_.find(key); found != data_.end()) {
          const auto* first = reinterpret_cast<const char*>(found->second.data());
          const auto* last = first + found->second.size();
          const auto [end, status] = std::from_chars(first, last, value);
          if (status != std::errc() || end != last)
            return reject(conn, "ADD on key '" + key + "' whose value is not a decimal integer");
        }
        if (__builtin_add_overflow(value, request.delta, &value))
          return reject(conn, "ADD on key '" + key + "' overflows int64");
        const std::string text = std::to_string(value);
        data_[key] = bytes_t(text.begin(), text.end());
        write.i64(value);
        wake_waiters(key);
        break;
      }
      case command::check:
        write.u8(static_cast<std::uint8_t>(all_present(request.keys) ? protocol::check_reply::ready
                                                                     : protocol::check_reply::not_ready));
        break;
      case command::wait:
        if (conn.keys_awaited > 0) return reject(conn, "WAIT while another WAIT is pending");
        for (const auto& key : request.keys) {
          if (data_.count(key)) continue;
          waiters_[key].push_back(id);
          conn.waiting_on.push_back(key);
          ++conn.keys_awaited;
        }
        if (conn.keys_awaited == 0) write.u8(static_cast<std::uint8_t>(protocol::wait_reply::stop_waiting));
        break;
      case command::cancel_wait:
        clear_wait_state(id, conn);
        write.u8(static_cast<std::uint8_t>(protocol::wait_reply::wait_canceled));
        break;
      case command::num_keys: write.i64(static_cast<std::int64_t>(data_.size())); break;
      case command::delete_key: write.i64(static_cast<std::int64_t>(data_.erase(request.keys[0]))); break;
      case command::multi_get:
        for (const auto& key : request.keys) {
          const auto found = data_.find(key);
          write.data(found == data_.end() ? bytes_t{} : found->second);
        }
        break;
      case command::multi_set:
        for (std::size_t i = 0; i < request.keys.size(); ++i) {
          data_[request.keys[i]] = std::move(request.values[i]);
          wake_waiters(request.keys[i]);
        }
        break;
    }
    if (!reply.empty()) send(conn, reply);
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return data_.count(key) > 0; });
  }

  void wake_waiters(const std::string& key) {
    const auto found = waiters_.find(key);
    if (found == waiters_.end()) return;
    const std::vector<std::uint64_t> ids = std::move(found->second);
    waiters_.erase(found);
    for (const std::uint64_t id : ids) {
      const auto waiter = connections_.find(id);
      if (waiter == connections_.end() || waiter->second.closing) continue;
      connection& conn = waiter->second;
      if (conn.keys_awaited == 0 || --conn.keys_awaited > 0) continue;
      conn.waiting_on.clear();
      const bytes_t reply{static_cast<std::uint8_t>(detail::tcp_store_protocol::wait_reply::stop_waiting)};
      try {
        send(conn, reply);
      } catch (const std::exception& failure) {
        reject(conn, failure.what());
      }
    }
  }

  void clear_wait_state(std::uint64_t id, connection& conn) {
    for (const auto& key : conn.waiting_on) {
      const auto found = waiters_.find(key);
      if (found == waiters_.end()) continue;
      std::erase(found->second, id);
      if (found->second.empty()) waiters_.erase(found);
    }
    conn.waiting_on.clear();
    conn.keys_awaited = 0;
  }

  void send(connection& conn, std::span<const std::uint8_t> reply) {
    if (conn.output.size() - conn.output_start + reply.size() > max_queued_reply_bytes)
      return reject(conn, "client is not reading its replies (" +
                              std::to_string(conn.output.size() - conn.output_start) + " bytes queued)");
    conn.output.insert(conn.output.end(), reply.begin(), reply.end());
    flush(conn);
  }

  void flush(connection& conn) {
    while (conn.output_start < conn.output.size()) {
      const ssize_t sent = ::send(conn.socket.get(), conn.output.data() + conn.output_start,
                                  conn.output.size() - conn.output_start, MSG_NOSIGNAL);
      if (sent > 0) {
        conn.output_start += static_cast<std::size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // poll says when
      conn.closing = true;                                                // the peer went away; nothing to report
      return;
    }
    conn.output.clear();
    conn.output_start = 0;
  }

  void reject(connection& conn, const std::string& reason) {
    if (conn.closing) return;
    conn.closing = true;
    const std::size_t count = ++rejected_;
    if (count <= logged_rejections)
      std::fprintf(stderr, "cohort%s tcp_store_server %s: closed the connection of %s: %s%s\n",
                   rank_ >= 0 ? (" [rank " + std::to_string(rank_) + "]").c_str() : "", endpoint().c_str(),
                   conn.peer.c_str(), reason.c_str(),
                   count == logged_rejections ? " (further refusals are counted, not printed)" : "");
    std::lock_guard lock(report_mutex_);
    last_rejection_ = reason;
  }
  static constexpr std::size_t logged_rejections = 8;

  void remove_closed() {
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (!it->second.closing) {
        ++it;
        continue;
      }
      clear_wait_state(it->first, it->second);
      it = connections_.erase(it);
    }
  }

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
  // Put before every key on the wire; "/" is what c10d's TCPStore client uses.
  std::string key_prefix = "/";
  // Named in error messages.
  int rank = -1;
};

class tcp_store final : public store {
 public:
  explicit tcp_store(tcp_store_options options) : options_(std::move(options)) {
    set_timeout(options_.timeout);
    set_rank(options_.rank);
    if (options_.is_server) {
      server_ = std::make_shared<tcp_store_server>(options_.host, options_.port, options_.rank);
      options_.port = server_->port();
    }
    connect();
    if (options_.num_workers && options_.wait_for_workers) join_workers(*options_.num_workers);
  }

  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;

  // What a launched program calls; the same as connect_store(env, options) below.
  static std::shared_ptr<store> connect(const launch_env& env, tcp_store_options options = {});

  const std::string& host() const noexcept { return options_.host; }
  std::uint16_t port() const noexcept { return options_.port; }
  std::string endpoint() const { return detail::tcp::endpoint(options_.host, options_.port); }
  // The server this handle hosts (options.is_server), else null.
  const std::shared_ptr<tcp_store_server>& server() const noexcept { return server_; }

  void set(std::string_view key, std::span<const std::uint8_t> value) override {
    check_value_size("set", key, value.size());
    exchange("set", [&](writer& write) {
      write.command(command::set);
      write.string(wire_key("set", key));
      write.data(value);
    });
  }
  using store::set;

  // Waits for the key (c10d's client also WAITs before its GET), then reads it.
  bytes get(std::string_view key, std::chrono::milliseconds timeout) override {
    const std::string name(key);
    std::lock_guard lock(mutex_);
    wait_locked(std::span<const std::string>(&name, 1), timeout, "get");
    return get_locked(wire_key("get", key), key);
  }
  using store::get;

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return add_wire(wire_key("add", key), key, delta);
  }

  bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override {
    check_value_size("compare_set", key, expected.size());
    check_value_size("compare_set", key, desired.size());
    bytes value;
    exchange(
        "compare_set",
        [&](writer& write) {
          write.command(command::compare_set);
          write.string(wire_key("compare_set", key));
          write.data(expected);
          write.data(desired);
        },
        [&](clock::time_point deadline) { value = receive_data("compare_set", key, deadline); });
    return value;
  }

  bool check(std::span<const std::string> keys) override {
    std::lock_guard lock(mutex_);
    return check_locked(keys);
  }

  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override {
    std::lock_guard lock(mutex_);
    wait_locked(keys, timeout, "wait");
  }
  using store::wait;

  bool delete_key(std::string_view key) override {
    std::int64_t deleted = 0;
    exchange(
        "delete_key",
        [&](writer& write) {
          write.command(command::delete_key);
          write.string(wire_key("delete_key", key));
        },
        [&](clock::time_point deadline) { deleted = receive_value<std::int64_t>("delete_key", key, deadline); });
    return deleted == 1;
  }

  // Counts every key on the server (c10d counts its "init/" key too).
  std::int64_t num_keys() override {
    std::int64_t count = 0;
    exchange(
        "num_keys", [&](writer& write) { write.command(command::num_keys); },
        [&](clock::time_point deadline) { count = receive_value<std::int64_t>("num_keys", {}, deadline); });
    return count;
  }

  // c10d's extensions beyond `store` (Gloo's v2 store interface has the same ones).
  void append(std::string_view key, std::span<const std::uint8_t> value) {
    check_value_size("append", key, value.size());
    exchange("append", [&](writer& write) {
      write.command(command::append);
      write.string(wire_key("append", key));
      write.data(value);
    });
  }

  // Waits for every key, then returns their values in order.
  std::vector<bytes> multi_get(std::span<const std::string> keys) {
    std::lock_guard lock(mutex_);
    wait_locked(keys, timeout(), "multi_get");
    std::vector<bytes> values;
    exchange_locked(
        "multi_get", [&](writer& write) { write_key_list(write, command::multi_get, keys, "multi_get"); },
        [&](clock::time_point deadline) {
          for (const auto& key : keys) values.push_back(receive_data("multi_get", key, deadline));
        });
    return values;
  }

  void multi_set(std::span<const std::string> keys, std::span<const bytes> values) {
    if (keys.size() != values.size())
      throw error(rank(), "store.multi_set",
                  std::to_string(keys.size()) + " keys but " + std::to_string(values.size()) + " values",
                  "pass one value per key");
    for (std::size_t i = 0; i < keys.size(); ++i) check_value_size("multi_set", keys[i], values[i].size());
    exchange("multi_set", [&](writer& write) {
      write.command(command::multi_set);
      write.u64(keys.size());
      for (std::size_t i = 0; i < keys.size(); ++i) {
        write.string(wire_key("multi_set", keys[i]));
        write.data(values[i]);
      }
    });
  }

  // One round trip; throws when the server does not answer within timeout().
  void ping() {
    std::lock_guard lock(mutex_);
    usable("ping");
    ping_locked(clock::now() + timeout(), "ping");
  }

 private:
  using clock = detail::tcp::clock;
  using writer = detail::tcp_store_protocol::message_writer;
  using command = detail::tcp_store_protocol::command;
  using check_reply = detail::tcp_store_protocol::check_reply;
  using wait_reply = detail::tcp_store_protocol::wait_reply;

  static std::string_view first_key(std::span<const std::string> keys) {
    return keys.empty() ? std::string_view{} : std::string_view(keys.front());
  }

  static std::string quoted(std::string_view key) { return "'" + std::string(key) + "'"; }

  std::string wire_key(std::string_view operation, std::string_view key) const {
    if (key.size() > detail::tcp_store_protocol::max_key_bytes)
      throw error(rank(), "store." + std::string(operation),
                  "key of " + std::to_string(key.size()) + " bytes exceeds the limit of " +
                      std::to_string(detail::tcp_store_protocol::max_key_bytes),
                  "use short keys; put data in the value");
    return options_.key_prefix + std::string(key);
  }

  void check_value_size(std::string_view operation, std::string_view key, std::size_t size) const {
    if (size > detail::tcp_store_protocol::max_value_bytes)
      throw error(rank(), "store." + std::string(operation),
                  "value of " + std::to_string(size) + " bytes for key " + quoted(key) +
                      " exceeds the store's limit of " + std::to_string(detail::tcp_store_protocol::max_value_bytes) +
                      " bytes",
                  "a rendezvous store carries addresses and ids; move bulk data with a "
                  "collective");
  }

  void write_key_list(writer& write, command which, std::span<const std::string> keys,
                      std::string_view operation) const {
    write.command(which);
    write.u64(keys.size());
    for (const auto& key : keys) write.string(wire_key(operation, key));
  }

  // --- failure reporting: the connection is closed, and the reason kept for later calls.

  [[noreturn]] void fail(std::string_view operation, const std::string& detail) {
    socket_.reset();
    broken_ = detail;
    throw error(rank(), "store." + std::string(operation), detail,
                "the store server (rank 0 or the launcher's agent) may have exited or "
                "rejected the request; look at its log");
  }

  [[noreturn]] void fail_timeout(std::string_view operation, const std::string& detail) {
    socket_.reset();
    broken_ = detail;
    throw timeout_error(rank(), "store." + std::string(operation), detail,
                        "the store server is overloaded or stalled; raise the store timeout "
                        "or check the server host");
  }

  void usable(std::string_view operation) const {
    if (!socket_)
      throw error(
          rank(), "store." + std::string(operation),
          "the connection to the store server at " + endpoint() + " was closed by an earlier failure: " + broken_,
          "create a new store handle");
  }

  // --- raw I/O with a deadline.

  void send_all(std::string_view operation, std::span<const std::uint8_t> data, clock::time_point deadline) {
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t sent = ::send(socket_.get(), data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (sent > 0) {
        done += static_cast<std::size_t>(sent);
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!detail::tcp::poll_until(socket_.get(), POLLOUT, deadline))
          fail_timeout(operation, "could not send to the store server at " + endpoint() + " within " +
                                      detail::format_duration(timeout()));
        continue;
      }
      fail(operation, "sending to the store server at " + endpoint() + " failed: " + detail::tcp::errno_text(errno));
    }
  }

  void receive_exact(std::string_view operation, std::string_view key, void* destination, std::size_t size,
                     clock::time_point deadline) {
    auto* out = static_cast<std::uint8_t*>(destination);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t got = ::recv(socket_.get(), out + done, size - done, 0);
      if (got > 0) {
        done += static_cast<std::size_t>(got);
        continue;
      }
      const std::string about = key.empty() ? std::string() : " for key " + quoted(key);
      if (got == 0) fail(operation, "the store server at " + endpoint() + " closed the connection" + about);
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        fail(operation,
             "receiving from the store server at " + endpoint() + about + " failed: " + detail::tcp::errno_text(errno));
      if (!detail::tcp::poll_until(socket_.get(), POLLIN, deadline))
        fail_timeout(operation, "no reply from the store server at " + endpoint() + about + " within " +
                                    detail::format_duration(timeout()));
    }
  }

  template <class T>
  T receive_value(std::string_view operation, std::string_view key, clock::time_point deadline) {
    T value{};
    receive_exact(operation, key, &value, sizeof(T), deadline);
    return value;
  }

  bytes receive_data(std::string_view operation, std::string_view key, clock::time_point deadline) {
    const auto size = receive_value<std::uint64_t>(operation, key, deadline);
    if (size > detail::tcp_store_protocol::max_value_bytes)
      fail(operation, "the store server at " + endpoint() + " announced a value of " + std::to_string(size) +
                          " bytes for key " + quoted(key) + ", over the limit of " +
                          std::to_string(detail::tcp_store_protocol::max_value_bytes));
    bytes value(size);
    receive_exact(operation, key, value.data(), value.size(), deadline);
    return value;
  }

  // --- one request and its reply, bounded by timeout().

  static void no_reply(clock::time_point) {}

  template <class Write, class Read = decltype(&no_reply)>
  void exchange_locked(std::string_view operation, Write&& write, Read&& read = &no_reply) {
    usable(operation);
    bytes message;
    writer out(message);
    write(out);
    const auto deadline = clock::now() + timeout();
    send_all(operation, message, deadline);
    read(deadline);
  }

  template <class Write, class Read = decltype(&no_reply)>
  void exchange(std::string_view operation, Write&& write, Read&& read = &no_reply) {
    std::lock_guard lock(mutex_);
    exchange_locked(operation, std::forward<Write>(write), std::forward<Read>(read));
  }

  bytes get_locked(const std::string& wire, std::string_view key) {
    bytes value;
    exchange_locked(
        "get",
        [&](writer& write) {
          write.command(command::get);
          write.string(wire);
        },
        [&](clock::time_point deadline) { value = receive_data("get", key, deadline); });
    return value;
  }

  std::int64_t add_wire(const std::string& wire, std::string_view key, std::int64_t delta) {
    std::int64_t value = 0;
    exchange(
        "add",
        [&](writer& write) {
          write.command(command::add);
          write.string(wire);
          write.i64(delta);
        },
        [&](clock::time_point deadline) { value = receive_value<std::int64_t>("add", key, deadline); });
    return value;
  }

  bool check_locked(std::span<const std::string> keys) {
    std::uint8_t reply = 0;
    exchange_locked(
        "check", [&](writer& write) { write_key_list(write, command::check, keys, "check"); },
        [&](clock::time_point deadline) { reply = receive_value<std::uint8_t>("check", first_key(keys), deadline); });
    if (reply != static_cast<std::uint8_t>(check_reply::ready) &&
        reply != static_cast<std::uint8_t>(check_reply::not_ready))
      fail("check", "the store server answered CHECK with " + std::to_string(reply));
    return reply == static_cast<std::uint8_t>(check_reply::ready);
  }

  // The server parks a WAIT until every key exists. When our time runs out we CANCEL_WAIT;
  // the server then confirms with WAIT_CANCELED, possibly after a STOP_WAITING that crossed
  // our cancel on the wire (then the keys did arrive, and the wait succeeded).
  void wait_locked(std::span<const std::string> keys, std::chrono::milliseconds limit, std::string_view operation) {
    usable(operation);
    if (keys.empty()) return;
    bytes message;
    writer out(message);
    write_key_list(out, command::wait, keys, operation);
    const auto start = clock::now();
    send_all(operation, message, start + std::max(limit, timeout()));
    const std::uint8_t stop = static_cast<std::uint8_t>(wait_reply::stop_waiting);
    const std::uint8_t canceled = static_cast<std::uint8_t>(wait_reply::wait_canceled);
    if (detail::tcp::poll_until(socket_.get(), POLLIN, start + limit)) {
      const auto reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + timeout());
      if (reply != stop) fail(operation, "the store server answered WAIT with " + std::to_string(reply));
      return;
    }
    message.assign(1, static_cast<std::uint8_t>(command::cancel_wait));
    send_all(operation, message, clock::now() + timeout());
    auto reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + timeout());
    const bool arrived = reply == stop;
    if (arrived) reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + timeout());
    if (reply != canceled) fail(operation, "the store server answered CANCEL_WAIT with " + std::to_string(reply));
    if (arrived) return;
    std::vector<std::string> missing;
    for (const auto& key : keys)
      if (!check_locked(std::span<const std::string>(&key, 1))) missing.push_back(key);
    if (missing.empty()) return;  // they arrived while we were cancelling
    throw_timeout(operation, missing, limit);
  }

  void ping_locked(clock::time_point deadline, std::string_view operation) {
    const std::uint32_t nonce = static_cast<std::uint32_t>(::getpid()) ^ (++ping_count_ * 0x9E3779B9u);
    bytes message;
    writer out(message);
    out.command(command::ping);
    out.u32(nonce);
    send_all(operation, message, deadline);
    const auto echoed = receive_value<std::uint32_t>(operation, {}, deadline);
    if (echoed != nonce)
      fail(operation, "the server at " + endpoint() + " echoed PING " + std::to_string(nonce) + " as " +
                          std::to_string(echoed) + "; it does not speak TCPStore");
  }

  // --- connecting.

  void connect() {
    const auto start = clock::now();
    const auto deadline = start + options_.connect_timeout;
    auto backoff = std::max(options_.initial_backoff, std::chrono::milliseconds(1));
    std::string last_error;
    int attempts = 0;
    int refused_in_a_row = 0;
    for (;;) {
      ++attempts;
      handshake_ = handshake::not_reached;
      last_error = try_connect(deadline);
      if (last_error.empty()) return;
      // A server that accepts the connection and then closes it at cohort's first message is
      // an answer, not a server still starting: after a few, say what it means.
      refused_in_a_row = handshake_ == handshake::refused ? refused_in_a_row + 1 : 0;
      if (refused_in_a_row == 3)
        throw error(rank(), "tcp_store.connect",
                    "the server at " + endpoint() +
                        " accepted the connection and closed it during cohort's "
                        "handshake (VALIDATE, then PING) 3 times in a row (last: " +
                        last_error + "): " + std::string(detail::tcp::other_protocol),
                    "run a PyTorch >= 2.0 TCPStore (torchrun of torch 2.x), or let cohort's rank 0 host the "
                    "store; check that MASTER_PORT is not another service's port");
      const auto now = clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::min<clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::max(options_.max_backoff, backoff));
    }
    throw timeout_error(rank(), "tcp_store.connect",
                        "could not connect to the store server at " + endpoint() + " within " +
                            detail::format_duration(options_.connect_timeout) + " (" + std::to_string(attempts) +
                            " attempts; last error: " + last_error + ")" +
                            (handshake_ == handshake::unanswered
                                 ? "; the server accepted the connection but never answered the handshake: " +
                                       std::string(detail::tcp::other_protocol)
                                 : std::string()),
                        "check MASTER_ADDR and MASTER_PORT, that rank 0 (or the launcher's "
                        "agent) is running, and that no firewall blocks the port");
  }

  // One attempt; returns why it failed, or an empty string once connected and validated.
  std::string try_connect(clock::time_point deadline) {
    detail::tcp::address_list addresses;
    const std::string unresolved = detail::tcp::resolve(options_.host, options_.port, false, addresses);
    if (!unresolved.empty()) return "cannot resolve " + options_.host + ": " + unresolved;
    std::string last_error = "no address";
    for (addrinfo* entry = addresses.head; entry; entry = entry->ai_next) {
      detail::tcp::file_descriptor fd(
          ::socket(entry->ai_family, entry->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, entry->ai_protocol));
      if (!fd) {
        last_error = detail::tcp::errno_text(errno);
        continue;
      }
      if (::connect(fd.get(), entry->ai_addr, entry->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
          last_error = detail::tcp::errno_text(errno);
          continue;
        }
        if (!detail::tcp::poll_until(fd.get(), POLLOUT, deadline)) {
          last_error = "connect timed out";
          continue;
        }
        int status = 0;
        socklen_t length = sizeof(status);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &status, &length);
        if (status != 0) {
          last_error = detail::tcp::errno_text(status);
          continue;
        }
      }
      detail::tcp::set_no_delay(fd.get());
      socket_ = std::move(fd);
      broken_.clear();
      try {
        // A just-accepted connection gets a moment to answer even at the connect deadline.
        const auto handshake_deadline = std::max(deadline, clock::now() + std::chrono::seconds(2));
        bytes message;
        writer out(message);
        out.command(command::validate);
        out.u32(detail::tcp_store_protocol::validation_magic);
        send_all("connect", message, handshake_deadline);
        ping_locked(handshake_deadline, "connect");
        return {};
      } catch (const timeout_error& failure) {
        socket_.reset();
        handshake_ = handshake::unanswered;
        last_error = "handshake failed: " + failure.detail();
      } catch (const error& failure) {
        socket_.reset();
        handshake_ = handshake::refused;
        last_error = "handshake failed: " + failure.detail();
      }
    }
    return last_error;
  }

  void join_workers(int workers) {
    const std::string init_key = "init/";  // c10d's key, without the key prefix
    add_wire(init_key, init_key, 1);
    if (!server_) return;
    const auto start = clock::now();
    auto pause = std::chrono::milliseconds(5);
    for (;;) {
      bytes value;
      {
        std::lock_guard lock(mutex_);
        value = get_locked(init_key, init_key);
      }
      std::int64_t joined = 0;
      std::from_chars(reinterpret_cast<const char*>(value.data()),
                      reinterpret_cast<const char*>(value.data() + value.size()), joined);
      if (joined >= workers) return;
      if (clock::now() - start >= timeout())
        throw timeout_error(rank(), "tcp_store.wait_for_workers",
                            std::to_string(joined) + " of " + std::to_string(workers) +
                                " workers joined the store at " + endpoint() + " within " +
                                detail::format_duration(timeout()),
                            "check that every rank was started with the same world size and "
                            "master address");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
    }
  }

  tcp_store_options options_;
  std::shared_ptr<tcp_store_server> server_;  // declared first: outlives the connection
  std::mutex mutex_;
  detail::tcp::file_descriptor socket_;
  std::string broken_;
  std::uint32_t ping_count_ = 0;
  // How the last connection attempt's handshake went (connect() only).
  enum class handshake { not_reached, refused, unanswered } handshake_ = handshake::not_reached;
};

// Connects a launched program to its rendezvous store.
//  - Under torchrun's elastic agent (env.use_agent_store): a client of the TCPStore the agent
//    already serves at MASTER_ADDR:MASTER_PORT, inside prefix_store(env.store_prefix()), the
//    keys torch workers of this restart attempt use.
//  - Otherwise rank 0 hosts a server on MASTER_ADDR:MASTER_PORT (that address only) and every
//    rank, rank 0 included, is a client of it. Rank 0's handle owns the server: keep it alive
//    until every rank is done with the store.
// host, port, is_server and rank come from env; timeouts and num_workers from options.
inline std::shared_ptr<store> connect_store(const launch_env& env, tcp_store_options options = {}) {
  options.host = env.master_addr;
  options.port = env.master_port;
  options.rank = env.rank;
  if (env.use_agent_store) {
    options.is_server = false;
    auto agent_store = std::make_shared<tcp_store>(std::move(options));
    return std::make_shared<prefix_store>(std::move(agent_store), env.store_prefix());
  }
  options.is_server = env.rank == 0;
  return std::make_shared<tcp_store>(std::move(options));
}

inline std::shared_ptr<store> tcp_store::connect(const launch_env& env, tcp_store_options options) {
  return connect_store(env, std::move(options));
}

}  // namespace cohort::inline v0
