#pragma once
// cohort/tcp_store_server.hpp's definitions: inline there when header-only, compiled once by <cohort/impl/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

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
#include "cohort/detail/tcp_socket.hpp"
#include "cohort/detail/tcp_store_protocol.hpp"
#include "cohort/error.hpp"

#include "cohort/detail/config.hpp"
#include "cohort/tcp_store_server.hpp"

namespace cohort::inline v0 {

COHORT_DECL tcp_store_server::tcp_store_server(std::string host, std::uint16_t port, int rank)
    : host_(std::move(host)), rank_(rank) {
  listen_on(port);
  int pipe_ends[2];
  if (::pipe2(pipe_ends, O_CLOEXEC | O_NONBLOCK) != 0)
    throw error(rank_, "tcp_store_server", "pipe2 failed: " + detail::tcp::errno_text(errno));
  wake_read_.reset(pipe_ends[0]);
  wake_write_.reset(pipe_ends[1]);
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

COHORT_DECL auto tcp_store_server::serve() -> void {
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

COHORT_DECL auto tcp_store_server::accept_all() -> void {
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

COHORT_DECL auto tcp_store_server::receive(std::uint64_t id, connection& conn) -> void {
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

COHORT_DECL auto tcp_store_server::process(std::uint64_t id, connection& conn) -> void {
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

COHORT_DECL auto tcp_store_server::handle(std::uint64_t id, connection& conn,
                                          detail::tcp_store_protocol::request& request) -> void {
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

COHORT_DECL auto tcp_store_server::wake_waiters(const std::string& key) -> void {
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

COHORT_DECL auto tcp_store_server::clear_wait_state(std::uint64_t id, connection& conn) -> void {
  for (const auto& key : conn.waiting_on) {
    const auto found = waiters_.find(key);
    if (found == waiters_.end()) continue;
    std::erase(found->second, id);
    if (found->second.empty()) waiters_.erase(found);
  }
  conn.waiting_on.clear();
  conn.keys_awaited = 0;
}

COHORT_DECL auto tcp_store_server::send(connection& conn, std::span<const std::uint8_t> reply) -> void {
  if (conn.output.size() - conn.output_start + reply.size() > max_queued_reply_bytes)
    return reject(conn, "client is not reading its replies (" + std::to_string(conn.output.size() - conn.output_start) +
                            " bytes queued)");
  conn.output.insert(conn.output.end(), reply.begin(), reply.end());
  flush(conn);
}

COHORT_DECL auto tcp_store_server::flush(connection& conn) -> void {
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

COHORT_DECL auto tcp_store_server::reject(connection& conn, const std::string& reason) -> void {
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

COHORT_DECL auto tcp_store_server::remove_closed() -> void {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->second.closing) {
      ++it;
      continue;
    }
    clear_wait_state(it->first, it->second);
    it = connections_.erase(it);
  }
}

}  // namespace cohort::inline v0
