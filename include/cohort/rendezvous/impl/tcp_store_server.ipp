#pragma once
// cohort/rendezvous/tcp_store_server.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>
#include "cohort/comm/detail/host_address.hpp"
#include "cohort/detail/files.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"
#include "cohort/rendezvous/detail/tcp_socket.hpp"
#include "cohort/rendezvous/detail/tcp_store_protocol.hpp"

#include "cohort/config.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/tcp_store_server.hpp"

namespace cohort::inline v0 {

namespace detail::store_server {

inline std::string mib(std::uint64_t bytes) {
  if (bytes >= (std::uint64_t{1} << 20) && bytes % (std::uint64_t{1} << 20) == 0)
    return detail::text(std::to_string(bytes >> 20), " MiB");
  return detail::text(std::to_string(bytes), " bytes");
}

inline constexpr std::chrono::milliseconds sweep_interval{250};

}  // namespace detail::store_server

COHORT_DECL tcp_store_server::tcp_store_server(std::string host, std::uint16_t port, int rank,
                                               tcp_store_server_options options)
    : host_(std::move(host)), rank_(rank), options_(std::move(options)) {
  namespace protocol = detail::tcp_store_protocol;
  using detail::store_server::mib;
  auto refuse = [&](const std::string& what) {
    throw error(rank_, "tcp_store_server", what,
                "see tcp_store_server_options in cohort/rendezvous/tcp_store_server.hpp");
  };
  if (options_.max_key_bytes == 0 || options_.max_key_bytes > protocol::max_key_bytes)
    refuse(detail::text("max_key_bytes ", std::to_string(options_.max_key_bytes), " is not in 1..",
                        std::to_string(protocol::max_key_bytes)));
  if (options_.max_value_bytes == 0 || options_.max_value_bytes > protocol::max_value_bytes)
    refuse(detail::text("max_value_bytes ", std::to_string(options_.max_value_bytes), " is not in 1..",
                        std::to_string(protocol::max_value_bytes)));
  if (options_.max_memory_bytes < (std::uint64_t{1} << 20))
    refuse(detail::text("max_memory_bytes ", mib(options_.max_memory_bytes), " is below 1 MiB"));
  limits_.max_key_bytes = options_.max_key_bytes;
  limits_.max_value_bytes = options_.max_value_bytes;
  limits_.max_request_bytes =
      std::min(protocol::max_request_bytes, 2 * options_.max_value_bytes + (std::uint64_t{16} << 20));
  listen_on(port);
  size_connection_limit();
  int pipe_ends[2];
  if (::pipe2(pipe_ends, O_CLOEXEC | O_NONBLOCK) != 0)
    throw error(rank_, "tcp_store_server", detail::text("pipe2 failed: ", detail::tcp::errno_text(errno)));
  wake_read_.reset(pipe_ends[0]);
  wake_write_.reset(pipe_ends[1]);
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_)
    throw error(rank_, "tcp_store_server", detail::text("epoll_create1 failed: ", detail::tcp::errno_text(errno)));
  epoll_event wake{};
  wake.events = EPOLLIN;
  wake.data.u64 = 0;
  epoll_event listen{};
  listen.events = EPOLLIN;
  listen.data.u64 = 1;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_read_.get(), &wake) != 0 ||
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &listen) != 0)
    throw error(rank_, "tcp_store_server", detail::text("epoll_ctl failed: ", detail::tcp::errno_text(errno)));
  spare_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!options_.job.empty()) {  // there before any client can ask
    const std::string key = detail::text("/", detail::job_key);
    data_.emplace(key, make_value(bytes_t(options_.job.begin(), options_.job.end())));
    held_ += key.size() + entry_overhead;
  }
  thread_ = std::thread([this] { serve(); });
}

COHORT_DECL tcp_store_server::~tcp_store_server() {
  const char stop = 1;
  while (::write(wake_write_.get(), &stop, 1) < 0 && errno == EINTR) {}
  if (thread_.joinable()) thread_.join();
}

COHORT_DECL auto tcp_store_server::last_rejection() const -> std::string {
  std::lock_guard lock(report_mutex_);
  return last_rejection_;
}

COHORT_DECL auto tcp_store_server::listen_on(std::uint16_t port) -> void {
  detail::tcp::address_list addresses;
  const std::string failure =
      detail::tcp::resolve(options_.listen_on_every_interface ? std::string() : host_, port, true, addresses);
  if (!failure.empty())
    throw error(rank_, "tcp_store_server",
                detail::text("cannot resolve listen address ", detail::tcp::endpoint(host_, port), ": ", failure),
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
  throw error(rank_, "tcp_store_server",
              detail::text("cannot listen on ", detail::tcp::endpoint(host_, port), ": ", last_error),
              "the port may be taken by another job (pick another MASTER_PORT) or the "
              "address may not belong to this host");
}

COHORT_DECL auto tcp_store_server::size_connection_limit() -> void {
  constexpr rlim_t ceiling = rlim_t{1} << 20;
  rlimit descriptors{};
  if (::getrlimit(RLIMIT_NOFILE, &descriptors) != 0) descriptors.rlim_cur = descriptors.rlim_max = 1024;
  const rlim_t needed = static_cast<rlim_t>(2 * options_.reserved_connections + 256);
  if (options_.reserved_connections > 0 && descriptors.rlim_cur < needed &&
      descriptors.rlim_max > descriptors.rlim_cur) {
    rlimit raised = descriptors;
    raised.rlim_cur = std::min(descriptors.rlim_max, needed);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) descriptors = raised;
  }
  if (options_.reserved_connections > 0 && descriptors.rlim_cur < needed)
    std::fprintf(stderr,
                 "cohort%s tcp_store_server: the descriptor limit (%llu, ulimit -n) is below the %llu a world of %zu "
                 "ranks needs on the rank serving the store; raise the hard limit (ulimit -Hn) or ranks will be "
                 "refused\n",
                 rank_ >= 0 ? (detail::text(" [rank ", std::to_string(rank_), "]")).c_str() : "",
                 static_cast<unsigned long long>(descriptors.rlim_cur), static_cast<unsigned long long>(needed),
                 options_.reserved_connections);
  const rlim_t limit = std::min(descriptors.rlim_cur == RLIM_INFINITY ? ceiling : descriptors.rlim_cur, ceiling);
  std::size_t open = 64;  // a guess when /proc is not there
  if (detail::directory_stream descriptors_open("/proc/self/fd"); descriptors_open.stream) {
    open = 0;
    while (!descriptors_open.next().empty()) ++open;
  }
  const std::size_t free = limit > open ? static_cast<std::size_t>(limit) - open : 0;
  max_connections_ = options_.max_connections > 0 ? options_.max_connections : std::max<std::size_t>(16, free / 4 * 3);
}

COHORT_DECL auto tcp_store_server::serve() -> void {
  std::array<epoll_event, 256> events{};
  auto next_sweep = clock::now() + detail::store_server::sweep_interval;
  for (;;) {
    int wait_ms = -1;
    if (!connections_.empty()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_sweep - clock::now());
      wait_ms = static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000));
    }
    const int ready = ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), wait_ms);
    if (ready < 0 && errno != EINTR) return;  // cannot happen with a valid epoll descriptor
    for (int i = 0; i < ready; ++i) {
      const std::uint64_t id = events[static_cast<std::size_t>(i)].data.u64;
      const std::uint32_t happened = events[static_cast<std::size_t>(i)].events;
      if (id == 0) return;
      if (id == 1) {
        accept_all();
        continue;
      }
      const auto it = connections_.find(id);
      if (it == connections_.end() || it->second.closing) continue;
      connection& conn = it->second;
      try {
        if (happened & (EPOLLOUT | EPOLLHUP | EPOLLERR)) flush(conn);
        if (!conn.closing && (happened & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !backpressured(conn)) receive(conn);
        // Replies drained below the cap: serve what was read while this client was not reading.
        if (!conn.closing && !backpressured(conn) && conn.input.size() > conn.input_start) process(conn);
      } catch (const std::exception& failure) {
        reject(conn, failure.what());
      }
      dirty_.push_back(id);
    }
    const auto now = clock::now();
    if (now >= next_sweep) {
      sweep(now);
      next_sweep = now + detail::store_server::sweep_interval;
    }
    for (const std::uint64_t id : dirty_)
      if (const auto it = connections_.find(id); it != connections_.end()) update_interest(it->second);
    dirty_.clear();
    remove_closed();
    publish_stats();
  }
}

COHORT_DECL auto tcp_store_server::accept_all() -> void {
  // A bounded number per round, so a flood of connections cannot starve the served ones.
  for (int round = 0; round < 256; ++round) {
    const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      place(fd);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EMFILE && errno != ENFILE) return;  // EAGAIN, or a connection that died before we took it
    // Out of descriptors: make room by closing a connection that has not proved itself;
    // failing that, take the newcomer with the spare descriptor and turn it away, or it would
    // wait in the backlog (and poll would report it again at once).
    if (evict_untrusted("the process is out of file descriptors")) continue;
    spare_.reset();
    const int taken = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (taken >= 0) {
      log_refusal(detail::tcp::peer_of(taken),
                  "refused at accept: the process is out of file descriptors (ulimit -n) and every connection is "
                  "a proven client");
      refuse_busy(taken);
    }
    spare_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (taken < 0) return;
  }
}

COHORT_DECL auto tcp_store_server::place(int fd) -> void {
  std::size_t untrusted = 0;
  for (const auto& [id, conn] : connections_)
    if (!conn.closing && !trusted(conn)) ++untrusted;
  const std::size_t open = connections_.size() - closing_.size();
  const std::size_t untrusted_cap = max_connections_ - std::min(options_.reserved_connections, max_connections_ / 2);
  if (open >= max_connections_ || untrusted >= untrusted_cap) {
    const char* why = open >= max_connections_ ? "the server is at its connection limit"
                                               : "too many connections have not proved themselves";
    if (!evict_untrusted(why)) {
      log_refusal(detail::tcp::peer_of(fd),
                  detail::text("refused at accept: the server is at its connection limit of ",
                               std::to_string(max_connections_), ", all of them proven clients"));
      refuse_busy(fd);
      return;
    }
  }
  detail::tcp::set_no_delay(fd);
  const std::uint64_t id = next_id_++;
  connection conn;
  conn.id = id;
  conn.socket.reset(fd);
  conn.peer = detail::tcp::peer_of(fd);
  conn.accepted = conn.last_input = conn.last_output = clock::now();
  if (!reached_) note_reached_address(fd);
  epoll_event interest{};
  interest.events = EPOLLIN;
  interest.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &interest) != 0) return;  // conn closes fd
  conn.interest = EPOLLIN;
  connections_.emplace(id, std::move(conn));
}

COHORT_DECL auto tcp_store_server::note_reached_address(int fd) -> void {
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) return;
  const std::string address = detail::reachable_numeric_address(reinterpret_cast<const sockaddr*>(&local), length);
  if (address.empty() || detail::is_loopback_address(address)) return;
  const std::string key = detail::text("/", detail::tcp_store_protocol::store_reached_key);
  auto value = make_value(bytes_t(address.begin(), address.end()));
  if (const auto found = data_.find(key); found != data_.end()) {
    found->second = std::move(value);
  } else {
    data_.emplace(key, std::move(value));
    held_ += key.size() + entry_overhead;
  }
  reached_ = true;
  wake_waiters(key);
}

COHORT_DECL auto tcp_store_server::evict_untrusted(const char* why) -> bool {
  connection* oldest = nullptr;
  for (auto& [id, conn] : connections_)
    if (!conn.closing && !trusted(conn) && (!oldest || conn.accepted < oldest->accepted)) oldest = &conn;
  if (!oldest) return false;
  // A client still in its handshake reads the marker where it expects a handshake reply and
  // retries; one past it would read the marker as a reply, so it is only closed.
  reject(*oldest,
         detail::text("closed to make room for a new connection (", why,
                      "; this one had not proved itself and was the oldest such)"),
         oldest->step != stage::ready ? detail::tcp_store_protocol::busy_marker : 0);
  return true;
}

COHORT_DECL auto tcp_store_server::refuse_busy(int fd) -> void {
  const std::uint32_t marker = detail::tcp_store_protocol::busy_marker;
  (void)::send(fd, &marker, sizeof marker, MSG_NOSIGNAL | MSG_DONTWAIT);
  drain_and_close(fd);
}

COHORT_DECL auto tcp_store_server::drain_and_close(int fd) -> void {
  // Closing with unread input would reset the connection, and the peer could lose the last
  // bytes written to it (a refusal marker): read what has already arrived first.
  for (int round = 0; round < 4; ++round)
    if (::recv(fd, scratch_.data(), scratch_.size(), MSG_DONTWAIT) <= 0) break;
  ::close(fd);
}

COHORT_DECL auto tcp_store_server::receive(connection& conn) -> void {
  std::size_t taken = 0;
  while (taken < read_budget && !conn.closing && !backpressured(conn)) {
    const ssize_t got = ::recv(conn.socket.get(), scratch_.data(), scratch_.size(), 0);
    if (got > 0) {
      taken += static_cast<std::size_t>(got);
      conn.last_input = clock::now();
      if (!take_input(conn, scratch_.data(), static_cast<std::size_t>(got))) return;
      process(conn);
      // A short read emptied the socket; epoll (level-triggered) reports it again when more
      // arrives, so no second recv only to hear EAGAIN.
      if (static_cast<std::size_t>(got) < scratch_.size()) return;
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // The peer closed (or the connection failed); what it sent before that was served.
    return close_now(conn);
  }
}

COHORT_DECL auto tcp_store_server::take_input(connection& conn, const std::uint8_t* data, std::size_t size) -> bool {
  using detail::store_server::mib;
  if (conn.input_start > 0) {
    conn.input.erase(conn.input.begin(), conn.input.begin() + static_cast<std::ptrdiff_t>(conn.input_start));
    conn.input_start = 0;
  }
  const std::uint64_t want = conn.input.size() + size;
  if (want > conn.input.capacity()) {
    // Grow towards the announced size of the request, never past it: memory follows what the
    // client really sent, not what it claims it will send.
    std::uint64_t target = want;
    if (conn.input_needed > target)
      target = std::min<std::uint64_t>(conn.input_needed, std::max<std::uint64_t>(2 * conn.input.capacity(), target));
    const std::uint64_t more = target - conn.input_counted;
    if (!admit(more, std::max<std::uint64_t>(conn.input_needed, want))) {
      reject(conn, detail::text("buffering ", std::to_string(want),
                                " bytes of a request would take the server past its memory "
                                "budget of ",
                                mib(options_.max_memory_bytes), " (it holds ", std::to_string(held_), " bytes)"));
      return false;
    }
    conn.input.reserve(static_cast<std::size_t>(target));
  }
  conn.input.insert(conn.input.end(), data, data + size);
  held_ += conn.input.capacity() - conn.input_counted;
  conn.input_counted = conn.input.capacity();
  return true;
}

COHORT_DECL auto tcp_store_server::process(connection& conn) -> void {
  namespace protocol = detail::tcp_store_protocol;
  using detail::store_server::mib;
  protocol::request request;
  while (!conn.closing && !backpressured(conn)) {
    const std::span<const std::uint8_t> unread(conn.input.data() + conn.input_start,
                                               conn.input.size() - conn.input_start);
    if (unread.empty() || unread.size() < conn.input_needed) break;
    if (conn.step != stage::ready && !gatekeep(conn, unread[0])) return;
    const auto parsed = protocol::parse_request(unread, request, limits_);
    if (parsed.status == protocol::parse_status::incomplete) {
      conn.input_needed = parsed.bytes;
      const std::uint64_t more = parsed.bytes > conn.input_counted ? parsed.bytes - conn.input_counted : 0;
      if (!admit(more, parsed.bytes))
        return reject(
            conn,
            detail::text("announced a ", protocol::command_name(request.command), " request of at least ",
                         std::to_string(parsed.bytes), " bytes, more than the server's memory budget of ",
                         mib(options_.max_memory_bytes), " allows now (it holds ", std::to_string(held_), " bytes)"));
      break;
    }
    if (parsed.status == protocol::parse_status::malformed) return reject(conn, parsed.error);
    conn.input_start += parsed.bytes;
    conn.input_needed = 0;
    handle(conn, request);
  }
  // Drop what was consumed, and the buffer once it is empty (an idle connection holds none).
  if (conn.input_start == conn.input.size()) {
    conn.input.clear();
    conn.input_start = 0;
    if (conn.input.capacity() > kept_input) bytes_t().swap(conn.input);
    held_ -= conn.input_counted - conn.input.capacity();
    conn.input_counted = conn.input.capacity();
  }
}

COHORT_DECL auto tcp_store_server::gatekeep(connection& conn, std::uint8_t code) -> bool {
  namespace protocol = detail::tcp_store_protocol;
  const auto expected = conn.step == stage::fresh       ? protocol::command::validate
                        : conn.step == stage::validated ? protocol::command::auth_hello
                                                        : protocol::command::auth_proof;
  if (code == static_cast<std::uint8_t>(expected)) return true;
  const std::string sent = protocol::known_command(code) ? protocol::command_name(static_cast<protocol::command>(code))
                                                         : "an unknown command";
  if (conn.step == stage::fresh) {
    reject(conn, detail::text("first message was ", sent, " (command byte ", std::to_string(code),
                              "), not VALIDATE: ", detail::tcp::other_protocol));
    return false;
  }
  // A client without the token does its PING here: the marker tells a cohort client why.
  reject(
      conn,
      detail::text("sent ", sent, " (command byte ", std::to_string(code),
                   ") without proving the store token: this server requires COHORT_STORE_TOKEN, and refuses everything "
                   "else before reading any key (PyTorch's TCPStore clients cannot prove a token)"),
      // connect_store's clients end their handshake with a COMPARE_SET in place of the PING.
      code == static_cast<std::uint8_t>(protocol::command::ping) ||
              code == static_cast<std::uint8_t>(protocol::command::compare_set)
          ? protocol::token_required_marker
          : 0);
  return false;
}

COHORT_DECL auto tcp_store_server::admit(std::uint64_t more, std::uint64_t request_size) const noexcept -> bool {
  const std::uint64_t budget = options_.max_memory_bytes;
  const std::uint64_t ceiling = request_size <= small_request ? budget : budget - budget / 8;
  return held_ + more <= ceiling;
}

COHORT_DECL auto tcp_store_server::store_value(connection& conn, const std::string& key, bytes_t value) -> bool {
  using detail::store_server::mib;
  const auto found = data_.find(key);
  const std::uint64_t size = value.size();
  std::uint64_t more = size + (found == data_.end() ? key.size() + entry_overhead : 0);
  // A replaced value is freed at once unless a reply still sends it.
  if (found != data_.end() && found->second.use_count() == 1) more -= std::min(more, found->second->bytes.size());
  if (!admit(more, size)) {
    reject(conn, detail::text("storing ", std::to_string(size), " bytes under key '", key,
                              "' would take the server past its memory budget of ", mib(options_.max_memory_bytes),
                              " (it holds ", std::to_string(held_), " bytes)"));
    return false;
  }
  if (found != data_.end()) {
    found->second = make_value(std::move(value));
  } else {
    data_.emplace(key, make_value(std::move(value)));
    held_ += key.size() + entry_overhead;
  }
  wake_waiters(key);
  return true;
}

COHORT_DECL auto tcp_store_server::authenticate(connection& conn, detail::tcp_store_protocol::request& request)
    -> void {
  namespace protocol = detail::tcp_store_protocol;
  bytes_t reply;
  protocol::message_writer write(reply);
  if (request.command == protocol::command::auth_hello) {
    if (options_.token.empty()) {
      write.u8(static_cast<std::uint8_t>(protocol::auth_reply::no_token));
      return reject(conn,
                    "a client offered a store token, but this server was started without one (set the same "
                    "COHORT_STORE_TOKEN on rank 0)",
                    std::span<const std::uint8_t>(reply));
    }
    if (conn.step != stage::validated) return reject(conn, "AUTH_HELLO repeated");
    if (request.word != protocol::auth_version)
      return reject(conn, detail::text("token handshake version ", std::to_string(request.word),
                                       ", this server speaks ", std::to_string(protocol::auth_version)));
    conn.client_nonce = request.token;
    if (!detail::random_bytes(conn.server_nonce)) return reject(conn, "no random source for the token handshake");
    const auto proof = protocol::server_proof(options_.token, conn.client_nonce, conn.server_nonce);
    write.u8(static_cast<std::uint8_t>(protocol::auth_reply::challenge));
    reply.insert(reply.end(), conn.server_nonce.begin(), conn.server_nonce.end());
    reply.insert(reply.end(), proof.begin(), proof.end());
    conn.step = stage::challenged;
    return send(conn, std::move(reply));
  }
  // AUTH_PROOF
  if (conn.step != stage::challenged) return reject(conn, "AUTH_PROOF out of order");
  const auto expected = protocol::client_proof(options_.token, conn.client_nonce, conn.server_nonce);
  if (!detail::equal_in_constant_time(expected, request.token)) {
    write.u8(static_cast<std::uint8_t>(protocol::auth_reply::refused));
    return reject(conn, "its token proof is wrong (a client with another COHORT_STORE_TOKEN)",
                  std::span<const std::uint8_t>(reply));
  }
  conn.step = stage::ready;
  write.u8(static_cast<std::uint8_t>(protocol::auth_reply::accepted));
  write.u64(options_.max_key_bytes);
  write.u64(options_.max_value_bytes);
  send(conn, std::move(reply));
}

COHORT_DECL auto tcp_store_server::handle(connection& conn, detail::tcp_store_protocol::request& request) -> void {
  namespace protocol = detail::tcp_store_protocol;
  using detail::store_server::mib;
  using protocol::command;
  bytes_t reply;
  protocol::message_writer write(reply);
  switch (request.command) {
    case command::validate:
      if (request.word != protocol::validation_magic)
        return reject(conn,
                      detail::text("VALIDATE carried magic ", std::to_string(request.word), ", not ",
                                   std::to_string(protocol::validation_magic), ": ", detail::tcp::other_protocol));
      if (conn.step != stage::fresh) return reject(conn, "VALIDATE repeated");
      conn.step = options_.token.empty() ? stage::ready : stage::validated;
      return;
    case command::auth_hello:
    case command::auth_proof: return authenticate(conn, request);
    case command::ping: write.u32(request.word); break;
    default: conn.productive = true; break;
  }
  switch (request.command) {
    case command::validate:
    case command::auth_hello:
    case command::auth_proof:
    case command::ping: break;
    case command::set: store_value(conn, request.keys[0], std::move(request.values[0])); break;
    case command::append: {
      const auto found = data_.find(request.keys[0]);
      const std::size_t old = found == data_.end() ? 0 : found->second->bytes.size();
      if (old + request.values[0].size() > options_.max_value_bytes)
        return reject(conn, detail::text("APPEND would grow key '", request.keys[0], "' past the limit of ",
                                         mib(options_.max_value_bytes), " per value"));
      bytes_t value;
      value.reserve(old + request.values[0].size());
      if (found != data_.end()) value = found->second->bytes;
      value.insert(value.end(), request.values[0].begin(), request.values[0].end());
      store_value(conn, request.keys[0], std::move(value));
      break;
    }
    case command::compare_set: {
      // c10d's semantics: an absent key matches an empty expected value; otherwise the
      // reply is what the key holds afterwards (for an absent key: the expected value).
      const std::string& key = request.keys[0];
      auto& expected = request.values[0];
      auto& desired = request.values[1];
      auto found = data_.find(key);
      const bool replace = found == data_.end() ? expected.empty() : found->second->bytes == expected;
      if (found == data_.end() && !replace) {
        write.data(expected);
        break;
      }
      if (!options_.job.empty() && !replace && key.size() == detail::job_key.size() + 1 &&
          key.compare(1, std::string::npos, detail::job_key) == 0)
        note_stranger(conn, desired);
      if (replace && !store_value(conn, key, std::move(desired))) return;
      found = data_.find(key);
      write.u64(found->second->bytes.size());
      return send(conn, std::move(reply), found->second);
    }
    case command::get: {
      const auto found = data_.find(request.keys[0]);
      if (found == data_.end()) {
        write.u64(0);
        break;
      }
      write.u64(found->second->bytes.size());
      return send(conn, std::move(reply), found->second);
    }
    case command::add: {
      const std::string& key = request.keys[0];
      std::int64_t value = 0;
      if (const auto found = data_.find(key); found != data_.end()) {
        const auto* first = reinterpret_cast<const char*>(found->second->bytes.data());
        const auto* last = first + found->second->bytes.size();
        const auto [end, status] = std::from_chars(first, last, value);
        if (status != std::errc() || end != last)
          return reject(conn, detail::text("ADD on key '", key, "' whose value is not a decimal integer"));
      }
      if (__builtin_add_overflow(value, request.delta, &value))
        return reject(conn, detail::text("ADD on key '", key, "' overflows int64"));
      const std::string text = std::to_string(value);
      if (!store_value(conn, key, bytes_t(text.begin(), text.end()))) return;
      write.i64(value);
      break;
    }
    case command::check:
      write.u8(static_cast<std::uint8_t>(all_present(request.keys) ? protocol::check_reply::ready
                                                                   : protocol::check_reply::not_ready));
      break;
    case command::wait: {
      if (conn.keys_awaited > 0) return reject(conn, "WAIT while another WAIT is pending");
      // A parked WAIT keeps its keys (twice: here and in the waiters' index) until they arrive.
      std::uint64_t parked = 0;
      for (const auto& key : request.keys)
        if (!data_.count(key)) parked += 2 * (key.size() + entry_overhead);
      if (parked > 0 && !admit(parked, parked))
        return reject(conn, detail::text("parking a WAIT on ", std::to_string(request.keys.size()),
                                         " keys would take the server past its memory budget of ",
                                         mib(options_.max_memory_bytes)));
      for (const auto& key : request.keys) {
        if (data_.count(key)) continue;
        waiters_[key].push_back(conn.id);
        conn.waiting_on.push_back(key);
        ++conn.keys_awaited;
      }
      held_ += parked;
      if (conn.keys_awaited == 0) write.u8(static_cast<std::uint8_t>(protocol::wait_reply::stop_waiting));
      break;
    }
    case command::cancel_wait:
      clear_wait_state(conn);
      write.u8(static_cast<std::uint8_t>(protocol::wait_reply::wait_canceled));
      break;
    case command::num_keys: write.i64(static_cast<std::int64_t>(data_.size())); break;
    case command::delete_key: {
      const auto found = data_.find(request.keys[0]);
      if (found != data_.end()) {
        held_ -= found->first.size() + entry_overhead;
        data_.erase(found);
      }
      write.i64(found != data_.end() ? 1 : 0);
      break;
    }
    case command::multi_get:
      for (const auto& key : request.keys) {
        const auto found = data_.find(key);
        if (found == data_.end()) {
          write.u64(0);
          continue;
        }
        write.u64(found->second->bytes.size());
        queue(conn, std::move(reply), found->second);
        reply.clear();
      }
      break;
    case command::multi_set:
      for (std::size_t i = 0; i < request.keys.size(); ++i)
        if (!store_value(conn, request.keys[i], std::move(request.values[i]))) return;
      break;
  }
  if (!reply.empty()) send(conn, std::move(reply));
}

COHORT_DECL auto tcp_store_server::wake_waiters(const std::string& key) -> void {
  const auto found = waiters_.find(key);
  if (found == waiters_.end()) return;
  const std::vector<std::uint64_t> ids = std::move(found->second);
  waiters_.erase(found);
  for (const std::uint64_t id : ids) {
    const auto waiter = connections_.find(id);
    if (waiter == connections_.end()) continue;
    held_ -= std::min<std::uint64_t>(held_, 2 * (key.size() + entry_overhead));
    connection& conn = waiter->second;
    if (conn.closing) continue;
    if (conn.keys_awaited == 0 || --conn.keys_awaited > 0) continue;
    conn.waiting_on.clear();
    try {
      send(conn, bytes_t{static_cast<std::uint8_t>(detail::tcp_store_protocol::wait_reply::stop_waiting)});
    } catch (const std::exception& failure) {
      reject(conn, failure.what());
    }
    dirty_.push_back(id);
  }
}

COHORT_DECL auto tcp_store_server::clear_wait_state(connection& conn) -> void {
  for (const auto& key : conn.waiting_on) {
    const auto found = waiters_.find(key);
    if (found == waiters_.end()) continue;
    const auto before = found->second.size();
    std::erase(found->second, conn.id);
    if (found->second.size() < before) held_ -= std::min<std::uint64_t>(held_, 2 * (key.size() + entry_overhead));
    if (found->second.empty()) waiters_.erase(found);
  }
  conn.waiting_on.clear();
  conn.keys_awaited = 0;
}

COHORT_DECL auto tcp_store_server::send(connection& conn, bytes_t reply, value_ptr shared) -> void {
  queue(conn, std::move(reply), std::move(shared));
  flush(conn);
}

COHORT_DECL auto tcp_store_server::queue(connection& conn, bytes_t reply, value_ptr shared) -> void {
  if (conn.output_queued == 0) conn.last_output = clock::now();
  // Small values are copied into the reply; large ones are sent from the stored block.
  constexpr std::size_t copied = 4096;
  if (shared && shared->bytes.size() <= copied) {
    reply.insert(reply.end(), shared->bytes.begin(), shared->bytes.end());
    shared.reset();
  }
  if (!reply.empty()) {
    conn.output_queued += reply.size();
    held_ += reply.size();
    if (!conn.output.empty() && !conn.output.back().shared) {
      auto& tail = conn.output.back().owned;
      tail.insert(tail.end(), reply.begin(), reply.end());
    } else {
      conn.output.push_back({nullptr, std::move(reply), 0});
    }
  }
  if (shared) {
    conn.output_queued += shared->bytes.size();
    conn.output.push_back({std::move(shared), {}, 0});
  }
}

COHORT_DECL auto tcp_store_server::flush(connection& conn) -> void {
  while (!conn.output.empty()) {
    std::array<iovec, 32> pieces{};
    std::size_t count = 0;
    for (auto it = conn.output.begin(); it != conn.output.end() && count < pieces.size(); ++it, ++count)
      pieces[count] = {const_cast<std::uint8_t*>(it->data()) + it->offset, it->size() - it->offset};
    msghdr message{};
    message.msg_iov = pieces.data();
    message.msg_iovlen = count;
    const ssize_t sent = ::sendmsg(conn.socket.get(), &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;  // epoll says when
      return close_now(conn);                               // the peer went away; nothing to report
    }
    conn.last_output = clock::now();
    auto left = static_cast<std::size_t>(sent);
    conn.output_queued -= left;
    while (left > 0) {
      auto& front = conn.output.front();
      const std::size_t rest = front.size() - front.offset;
      if (left < rest) {
        front.offset += left;
        break;
      }
      left -= rest;
      if (!front.shared) held_ -= front.owned.size();
      conn.output.pop_front();
    }
  }
}

COHORT_DECL auto tcp_store_server::update_interest(connection& conn) -> void {
  if (conn.closing) return;
  const std::uint32_t wanted =
      (backpressured(conn) ? 0u : std::uint32_t{EPOLLIN}) | (conn.output.empty() ? 0u : std::uint32_t{EPOLLOUT});
  if (wanted == conn.interest) return;
  epoll_event interest{};
  interest.events = wanted;
  interest.data.u64 = conn.id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, conn.socket.get(), &interest) == 0) conn.interest = wanted;
}

COHORT_DECL auto tcp_store_server::sweep(clock::time_point now) -> void {
  namespace protocol = detail::tcp_store_protocol;
  for (auto& [id, conn] : connections_) {
    if (conn.closing) continue;
    if (conn.step != stage::ready && now - conn.accepted > options_.handshake_timeout) {
      reject(conn, detail::text("did not finish the handshake (VALIDATE", options_.token.empty() ? "" : ", the token",
                                ") within ", detail::format_duration(options_.handshake_timeout)));
    } else if (conn.input.size() > conn.input_start && now - conn.last_input > options_.idle_timeout) {
      const auto code = conn.input[conn.input_start];
      reject(conn,
             detail::text("sent ", std::to_string(conn.input.size() - conn.input_start), " bytes of a ",
                          (protocol::known_command(code) ? protocol::command_name(static_cast<protocol::command>(code))
                                                         : "unknown"),
                          " request (of at least ", std::to_string(conn.input_needed), ") and nothing more for ",
                          detail::format_duration(options_.idle_timeout), ": a half-sent message"));
    } else if (!conn.output.empty() && now - conn.last_output > options_.idle_timeout) {
      reject(conn, detail::text("left ", std::to_string(conn.output_queued), " bytes of replies unread for ",
                                detail::format_duration(options_.idle_timeout)));
    }
  }
}

COHORT_DECL auto tcp_store_server::reject(connection& conn, const std::string& reason,
                                          std::span<const std::uint8_t> farewell) -> void {
  if (conn.closing) return;
  log_refusal(conn.peer, reason);  // counted before the peer can see the connection close
  if (!farewell.empty()) (void)::send(conn.socket.get(), farewell.data(), farewell.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  close_now(conn);
}

COHORT_DECL auto tcp_store_server::reject(connection& conn, const std::string& reason, std::uint32_t marker) -> void {
  std::uint8_t bytes[sizeof marker];
  std::memcpy(bytes, &marker, sizeof marker);
  reject(conn, reason, marker != 0 ? std::span<const std::uint8_t>(bytes) : std::span<const std::uint8_t>());
}

COHORT_DECL auto tcp_store_server::close_now(connection& conn) -> void {
  if (conn.closing) return;
  conn.closing = true;
  closing_.push_back(conn.id);
  // The descriptor goes at once (it leaves the epoll set with it), so a flood of refused
  // connections never holds descriptors until the end of the round.
  if (const int fd = conn.socket.release(); fd >= 0) drain_and_close(fd);
}

COHORT_DECL auto tcp_store_server::note_stranger(const connection& conn, std::span<const std::uint8_t> presented)
    -> void {
  detail::job_identity theirs, ours;
  if (!detail::decode_job(std::string_view(reinterpret_cast<const char*>(presented.data()), presented.size()),
                          theirs) ||
      !detail::decode_job(options_.job, ours) || theirs.id == ours.id)
    return;
  // The stranger refuses itself when it reads this job's record; said here too, on the job
  // that holds the port, so that both jobs' logs show the collision.
  std::fprintf(stderr,
               "cohort%s tcp_store_server %s: a rank of another job connected from %s: %s, while this store serves "
               "%s; it was refused (the two jobs share MASTER_ADDR:MASTER_PORT: give each its own MASTER_PORT)\n",
               rank_ >= 0 ? (detail::text(" [rank ", std::to_string(rank_), "]")).c_str() : "", endpoint().c_str(),
               conn.peer.c_str(), detail::describe_job(theirs).c_str(), detail::describe_job(ours).c_str());
}

COHORT_DECL auto tcp_store_server::log_refusal(const std::string& peer, const std::string& reason) -> void {
  const std::size_t count = ++rejected_;
  if (count <= logged_rejections)
    std::fprintf(stderr, "cohort%s tcp_store_server %s: closed the connection of %s: %s%s\n",
                 rank_ >= 0 ? (detail::text(" [rank ", std::to_string(rank_), "]")).c_str() : "", endpoint().c_str(),
                 peer.c_str(), reason.c_str(),
                 count == logged_rejections ? " (further refusals are counted, not printed)" : "");
  std::lock_guard lock(report_mutex_);
  last_rejection_ = reason;
}

COHORT_DECL auto tcp_store_server::remove_closed() -> void {
  for (const std::uint64_t id : closing_) {
    const auto it = connections_.find(id);
    if (it == connections_.end()) continue;
    connection& conn = it->second;
    clear_wait_state(conn);
    held_ -= std::min<std::uint64_t>(held_, conn.input_counted);
    for (const auto& segment : conn.output)
      if (!segment.shared) held_ -= std::min<std::uint64_t>(held_, segment.owned.size());
    connections_.erase(it);  // closes the socket, which leaves the epoll set
  }
  closing_.clear();
}

}  // namespace cohort::inline v0
