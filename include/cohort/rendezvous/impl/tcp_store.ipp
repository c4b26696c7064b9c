#pragma once
// cohort/rendezvous/tcp_store.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>
#include "cohort/comm/detail/host_address.hpp"
#include "cohort/detail/files.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/detail/tcp_socket.hpp"
#include "cohort/rendezvous/detail/tcp_store_protocol.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store_server.hpp"

#include "cohort/config.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

namespace cohort::inline v0 {

COHORT_DECL tcp_store::tcp_store(tcp_store_options options) : options_(std::move(options)) {
  set_timeout(options_.timeout);
  set_rank(options_.rank);
  if (options_.is_server) {
    auto server_options = options_.server;
    server_options.token = options_.token;
    server_ =
        std::make_shared<tcp_store_server>(options_.host, options_.port, options_.rank, std::move(server_options));
    options_.port = server_->port();
  }
  connect();
  if (options_.num_workers && options_.wait_for_workers) join_workers(*options_.num_workers);
}

COHORT_DECL auto tcp_store::bounded(std::chrono::milliseconds timeout) const -> std::shared_ptr<store> {
  tcp_store_options options = options_;
  options.is_server = false;  // the server stays with this handle
  options.num_workers.reset();
  options.timeout = timeout;
  options.connect_timeout = timeout;
  options.max_backoff = std::min(options.max_backoff, std::max(timeout / 4, std::chrono::milliseconds(1)));
  options.rank = rank();
  options.greeting_key.clear();
  return std::make_shared<tcp_store>(std::move(options));
}

COHORT_DECL auto tcp_store::set_within(std::string_view key, std::span<const std::uint8_t> value,
                                       std::chrono::milliseconds timeout) -> void {
  check_value_size("set", key, value.size());
  exchange_within("set", timeout, [&](writer& write) {
    write.command(command::set);
    write.string(wire_key("set", key));
    write.data(value);
  });
}

COHORT_DECL auto tcp_store::get(std::string_view key, std::chrono::milliseconds timeout) -> bytes {
  const std::string name(key);
  std::lock_guard lock(mutex_);
  const reply_bound bound(request_limit_, timeout);
  wait_locked(std::span<const std::string>(&name, 1), timeout, "get");
  return get_locked(wire_key("get", key), key);
}

COHORT_DECL auto tcp_store::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                        std::span<const std::uint8_t> desired) -> bytes {
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

COHORT_DECL auto tcp_store::check(std::span<const std::string> keys) -> bool {
  std::lock_guard lock(mutex_);
  return check_locked(keys);
}

COHORT_DECL auto tcp_store::wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) -> void {
  std::lock_guard lock(mutex_);
  const reply_bound bound(request_limit_, timeout);
  wait_locked(keys, timeout, "wait");
}

COHORT_DECL auto tcp_store::delete_key(std::string_view key) -> bool {
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

COHORT_DECL auto tcp_store::num_keys() -> std::int64_t {
  std::int64_t count = 0;
  exchange(
      "num_keys", [&](writer& write) { write.command(command::num_keys); },
      [&](clock::time_point deadline) { count = receive_value<std::int64_t>("num_keys", {}, deadline); });
  return count;
}

COHORT_DECL auto tcp_store::append(std::string_view key, std::span<const std::uint8_t> value) -> void {
  check_value_size("append", key, value.size());
  exchange("append", [&](writer& write) {
    write.command(command::append);
    write.string(wire_key("append", key));
    write.data(value);
  });
}

COHORT_DECL auto tcp_store::multi_get(std::span<const std::string> keys, std::chrono::milliseconds timeout)
    -> std::vector<bytes> {
  std::lock_guard lock(mutex_);
  const reply_bound bound(request_limit_, timeout);
  wait_locked(keys, timeout, "multi_get");
  std::vector<bytes> values;
  values.reserve(keys.size());
  // One MULTI_GET per 128 Ki keys (the protocol's bound on a key list).
  const std::size_t batch = detail::tcp_store_protocol::max_keys_per_request;
  for (std::size_t first = 0; first < keys.size(); first += batch) {
    const auto part = keys.subspan(first, std::min(batch, keys.size() - first));
    exchange_locked(
        "multi_get", [&](writer& write) { write_key_list(write, command::multi_get, part, "multi_get"); },
        [&](clock::time_point deadline) {
          for (const auto& key : part) values.push_back(receive_data("multi_get", key, deadline));
        });
  }
  return values;
}

COHORT_DECL auto tcp_store::multi_set(std::span<const std::string> keys, std::span<const bytes> values) -> void {
  if (keys.size() != values.size())
    throw error(rank(), "store.multi_set",
                detail::text(std::to_string(keys.size()), " keys but ", std::to_string(values.size()), " values"),
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

COHORT_DECL auto tcp_store::ping() -> void {
  std::lock_guard lock(mutex_);
  usable("ping");
  ping_locked(clock::now() + timeout(), "ping");
}

COHORT_DECL auto tcp_store::wire_key(std::string_view operation, std::string_view key) const -> std::string {
  if (options_.key_prefix.size() + key.size() > max_key_bytes_)
    throw error(
        rank(), detail::text("store.", operation),
        detail::text("key of ", std::to_string(options_.key_prefix.size() + key.size()),
                     " bytes (with the key prefix) exceeds the store's limit of ", std::to_string(max_key_bytes_)),
        "use short keys; put data in the value");
  return options_.key_prefix + std::string(key);
}

COHORT_DECL auto tcp_store::check_value_size(std::string_view operation, std::string_view key, std::size_t size) const
    -> void {
  if (size > max_value_bytes_)
    throw error(rank(), detail::text("store.", operation),
                detail::text("value of ", std::to_string(size), " bytes for key ", quoted(key),
                             " exceeds the store's limit of ", std::to_string(max_value_bytes_), " bytes"),
                "a rendezvous store carries addresses and ids; move bulk data with a "
                "collective");
}

COHORT_DECL auto tcp_store::write_key_list(writer& write, command which, std::span<const std::string> keys,
                                           std::string_view operation) const -> void {
  write.command(which);
  write.u64(keys.size());
  for (const auto& key : keys) write.string(wire_key(operation, key));
}

COHORT_DECL auto tcp_store::fail(std::string_view operation, const std::string& detail) -> void {
  drop_connection();
  broken_ = detail;
  throw error(rank(), detail::text("store.", operation), detail,
              "the store server (rank 0 or the launcher's agent) may have exited, or refused a request: "
              "cohort's server closes a connection that sends a value over its max_value_bytes or a request "
              "past its memory budget (tcp_store_server_options, SECURITY.md), and prints why in its log");
}

COHORT_DECL auto tcp_store::fail_timeout(std::string_view operation, const std::string& detail) -> void {
  drop_connection();
  broken_ = detail;
  throw timeout_error(rank(), detail::text("store.", operation), detail,
                      "the store server is overloaded or stalled, or cut off from this host; check the "
                      "server host and the network between, or raise the timeout");
}

COHORT_DECL auto tcp_store::fail_busy(std::string_view operation) -> void {
  handshake_ = handshake::busy;
  fail(operation,
       detail::text("the server at ", endpoint(), " is at its connection limit and turned this connection away"));
}

COHORT_DECL auto tcp_store::usable(std::string_view operation) const -> void {
  if (!socket_)
    throw error(rank(), detail::text("store.", operation),
                detail::text("the connection to the store server at ", endpoint(),
                             " was closed by an earlier failure: ", broken_),
                "create a new store handle");
}

COHORT_DECL auto tcp_store::send_all(std::string_view operation, std::span<const std::uint8_t> data,
                                     clock::time_point deadline) -> void {
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
        fail_timeout(operation, detail::text("could not send to the store server at ", endpoint(), " within ",
                                             detail::format_duration(request_timeout())));
      continue;
    }
    fail(operation,
         detail::text("sending to the store server at ", endpoint(), " failed: ", detail::tcp::errno_text(errno)));
  }
}

COHORT_DECL auto tcp_store::receive_exact(std::string_view operation, std::string_view key, void* destination,
                                          std::size_t size, clock::time_point deadline) -> void {
  auto* out = static_cast<std::uint8_t*>(destination);
  std::size_t done = 0;
  // Replies are read ahead into the inbox, so a MULTI_GET of N values costs a few recv calls,
  // not two per value; a large value goes straight to its destination.
  auto take_buffered = [&] {
    const std::size_t taken = std::min(size - done, inbox_end_ - inbox_start_);
    if (taken > 0) std::memcpy(out + done, inbox_.data() + inbox_start_, taken);
    done += taken;
    inbox_start_ += taken;
  };
  take_buffered();
  while (done < size) {
    const bool direct = size - done >= inbox_capacity;
    if (!direct && inbox_.size() < inbox_capacity) inbox_.resize(inbox_capacity);
    const ssize_t got = direct ? ::recv(socket_.get(), out + done, size - done, 0)
                               : ::recv(socket_.get(), inbox_.data(), inbox_capacity, 0);
    if (got > 0) {
      if (direct) {
        done += static_cast<std::size_t>(got);
      } else {
        inbox_start_ = 0;
        inbox_end_ = static_cast<std::size_t>(got);
        take_buffered();
      }
      continue;
    }
    const std::string about = key.empty() ? std::string() : detail::text(" for key ", quoted(key));
    if (got == 0) fail(operation, detail::text("the store server at ", endpoint(), " closed the connection", about));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      fail(operation, detail::text("receiving from the store server at ", endpoint(), about,
                                   " failed: ", detail::tcp::errno_text(errno)));
    if (!detail::tcp::poll_until(socket_.get(), POLLIN, deadline))
      fail_timeout(operation, detail::text("no reply from the store server at ", endpoint(), about, " within ",
                                           detail::format_duration(request_timeout())));
  }
}

COHORT_DECL auto tcp_store::receive_data(std::string_view operation, std::string_view key, clock::time_point deadline)
    -> bytes {
  const auto size = receive_value<std::uint64_t>(operation, key, deadline);
  if (size > detail::tcp_store_protocol::max_value_bytes)
    fail(operation, detail::text("the store server at ", endpoint(), " announced a value of ", std::to_string(size),
                                 " bytes for key ", quoted(key), ", over the limit of ",
                                 std::to_string(detail::tcp_store_protocol::max_value_bytes)));
  bytes value(size);
  receive_exact(operation, key, value.data(), value.size(), deadline);
  return value;
}

COHORT_DECL auto tcp_store::get_locked(const std::string& wire, std::string_view key) -> bytes {
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

COHORT_DECL auto tcp_store::add_wire(const std::string& wire, std::string_view key, std::int64_t delta,
                                     std::chrono::milliseconds limit) -> std::int64_t {
  std::int64_t value = 0;
  exchange_within(
      "add", limit,
      [&](writer& write) {
        write.command(command::add);
        write.string(wire);
        write.i64(delta);
      },
      [&](clock::time_point deadline) { value = receive_value<std::int64_t>("add", key, deadline); });
  return value;
}

COHORT_DECL auto tcp_store::check_locked(std::span<const std::string> keys) -> bool {
  std::uint8_t reply = 0;
  exchange_locked(
      "check", [&](writer& write) { write_key_list(write, command::check, keys, "check"); },
      [&](clock::time_point deadline) { reply = receive_value<std::uint8_t>("check", first_key(keys), deadline); });
  if (reply != static_cast<std::uint8_t>(check_reply::ready) &&
      reply != static_cast<std::uint8_t>(check_reply::not_ready))
    fail("check", detail::text("the store server answered CHECK with ", std::to_string(reply)));
  return reply == static_cast<std::uint8_t>(check_reply::ready);
}

COHORT_DECL auto tcp_store::wait_locked(std::span<const std::string> keys, std::chrono::milliseconds limit,
                                        std::string_view operation) -> void {
  usable(operation);
  if (keys.empty()) return;
  bytes message;
  writer out(message);
  write_key_list(out, command::wait, keys, operation);
  const auto start = clock::now();
  // Every step past the wait itself (sending, the server's answer to a cancel) is bounded by
  // request_timeout(): a caller's bound when it gave one (reply_bound), so that a store gone
  // silent ends a bounded wait soon after its bound, not after the store's own timeout.
  send_message(operation, message, start + std::max(limit, request_timeout()));
  const std::uint8_t stop = static_cast<std::uint8_t>(wait_reply::stop_waiting);
  const std::uint8_t canceled = static_cast<std::uint8_t>(wait_reply::wait_canceled);
  if (inbox_start_ < inbox_end_ || detail::tcp::poll_until(socket_.get(), POLLIN, start + limit)) {
    const auto reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + request_timeout());
    if (reply != stop) fail(operation, detail::text("the store server answered WAIT with ", std::to_string(reply)));
    return;
  }
  message.assign(1, static_cast<std::uint8_t>(command::cancel_wait));
  send_message(operation, message, clock::now() + request_timeout());
  auto reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + request_timeout());
  const bool arrived = reply == stop;
  if (arrived) reply = receive_value<std::uint8_t>(operation, first_key(keys), clock::now() + request_timeout());
  if (reply != canceled)
    fail(operation, detail::text("the store server answered CANCEL_WAIT with ", std::to_string(reply)));
  if (arrived) return;
  std::vector<std::string> missing;
  for (const auto& key : keys)
    if (!check_locked(std::span<const std::string>(&key, 1))) missing.push_back(key);
  if (missing.empty()) return;  // they arrived while we were cancelling
  throw_timeout(operation, missing, limit);
}

COHORT_DECL auto tcp_store::ping_locked(clock::time_point deadline, std::string_view operation) -> void {
  bytes message;
  writer out(message);
  const std::uint32_t nonce = append_ping(out);
  send_message(operation, message, deadline);
  read_ping_echo(nonce, deadline, operation);
}

COHORT_DECL auto tcp_store::append_ping(writer& out) -> std::uint32_t {
  namespace protocol = detail::tcp_store_protocol;
  std::uint32_t nonce = static_cast<std::uint32_t>(::getpid()) ^ (++ping_count_ * 0x9E3779B9u);
  if (nonce == protocol::busy_marker || nonce == protocol::token_required_marker) nonce ^= 1;
  out.command(command::ping);
  out.u32(nonce);
  return nonce;
}

COHORT_DECL auto tcp_store::read_ping_echo(std::uint32_t nonce, clock::time_point deadline, std::string_view operation)
    -> void {
  namespace protocol = detail::tcp_store_protocol;
  const auto echoed = receive_value<std::uint32_t>(operation, {}, deadline);
  if (echoed == nonce) return;
  fail_on_marker(echoed, operation);
  // Bytes, but not the protocol's: whatever answered is no TCPStore of PyTorch 2.x, and no
  // retry changes that. Say what it was.
  std::string answered(reinterpret_cast<const char*>(&echoed), sizeof echoed);
  answered += read_available(std::chrono::milliseconds(300));
  handshake_ = handshake::fatal;
  fatal_hint_ = "MASTER_PORT is another program's: pick a free port for the job (and check MASTER_ADDR)";
  fail(operation, not_a_store(answered));
}

COHORT_DECL auto tcp_store::fail_on_marker(std::uint32_t first_bytes, std::string_view operation) -> void {
  namespace protocol = detail::tcp_store_protocol;
  if (first_bytes == protocol::busy_marker) fail_busy(operation);
  if (first_bytes == protocol::token_required_marker) {
    handshake_ = handshake::fatal;
    fatal_hint_ =
        "set the same COHORT_STORE_TOKEN (or COHORT_STORE_TOKEN_FILE) on every rank, rank 0 included "
        "(SECURITY.md)";
    fail(operation,
         detail::text("the store server at ", endpoint(),
                      " requires a token (COHORT_STORE_TOKEN) and this rank has none, so it refused the connection"));
  }
}

COHORT_DECL auto tcp_store::append_handshake_end(writer& out) -> std::uint32_t {
  if (options_.greeting_key.empty()) return append_ping(out);
  out.command(command::compare_set);
  out.string(wire_key("connect", options_.greeting_key));
  out.data({});
  out.data(std::span(reinterpret_cast<const std::uint8_t*>(options_.greeting.data()), options_.greeting.size()));
  return 0;
}

COHORT_DECL auto tcp_store::read_handshake_end(std::uint32_t nonce, clock::time_point deadline) -> void {
  if (options_.greeting_key.empty()) return read_ping_echo(nonce, deadline, "connect");
  // The answer's first 4 bytes are a refusal marker, or the first half of the value's length.
  std::array<std::uint32_t, 2> halves{};
  halves[0] = receive_value<std::uint32_t>("connect", {}, deadline);
  fail_on_marker(halves[0], "connect");
  halves[1] = receive_value<std::uint32_t>("connect", {}, deadline);
  std::uint64_t size = 0;
  std::memcpy(&size, halves.data(), sizeof size);
  if (size > detail::tcp_store_protocol::max_value_bytes) {
    std::string answered(reinterpret_cast<const char*>(halves.data()), sizeof halves);
    answered += read_available(std::chrono::milliseconds(300));
    handshake_ = handshake::fatal;
    fatal_hint_ = "MASTER_PORT is another program's: pick a free port for the job (and check MASTER_ADDR)";
    fail("connect", not_a_store(answered));
  }
  greeting_answer_.assign(size, 0);
  receive_exact("connect", options_.greeting_key, greeting_answer_.data(), greeting_answer_.size(), deadline);
}

COHORT_DECL auto tcp_store::await_answer(clock::time_point deadline) -> void {
  if (inbox_start_ < inbox_end_ || detail::tcp::poll_until(socket_.get(), POLLIN, deadline)) return;
  // No answer. A program that reads whole request lines (an HTTP server) waits for the end of
  // the request: say there is no more, and take what it answers then.
  if (::shutdown(socket_.get(), SHUT_WR) == 0) {
    const std::string answered = read_available(std::chrono::seconds(1));
    if (!answered.empty()) {
      handshake_ = handshake::fatal;
      fatal_hint_ = "MASTER_PORT is another program's: pick a free port for the job (and check MASTER_ADDR)";
      fail("connect", not_a_store(answered));
    }
  }
  fail_timeout("connect", detail::text("the server at ", endpoint(),
                                       " accepted the connection and never answered "
                                       "cohort's handshake within ",
                                       detail::format_duration(request_timeout())));
}

COHORT_DECL auto tcp_store::read_available(std::chrono::milliseconds within) -> std::string {
  std::string more(inbox_.begin() + static_cast<std::ptrdiff_t>(inbox_start_),
                   inbox_.begin() + static_cast<std::ptrdiff_t>(inbox_end_));
  inbox_start_ = inbox_end_ = 0;
  const auto until = clock::now() + within;
  char chunk[256];
  while (more.size() < 256 && socket_ && detail::tcp::poll_until(socket_.get(), POLLIN, until)) {
    const ssize_t got = ::recv(socket_.get(), chunk, sizeof chunk, 0);
    if (got <= 0) break;
    more.append(chunk, static_cast<std::size_t>(got));
  }
  return more;
}

COHORT_DECL auto tcp_store::not_a_store(std::string_view answered) const -> std::string {
  std::string shown;
  for (const unsigned char c : answered.substr(0, 64)) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      shown += static_cast<char>(c);
    } else {
      static constexpr char digits[] = "0123456789abcdef";
      shown += detail::text("\\x", std::string_view(&digits[c >> 4], 1), std::string_view(&digits[c & 15], 1));
    }
  }
  if (answered.size() > 64) shown += "...";
  return detail::text("the server at ", endpoint(), " answered cohort's handshake with '", shown, "' (",
                      std::to_string(answered.size()),
                      " bytes), which is not the TCPStore protocol (PyTorch 2.x): another program holds this port");
}

COHORT_DECL auto tcp_store::connect() -> void {
  const auto start = clock::now();
  const auto deadline = start + options_.connect_timeout;
  detail::progress_clock lines(options_.progress_interval, start);
  auto backoff = std::max(options_.initial_backoff, std::chrono::milliseconds(1));
  std::string last_error;
  int attempts = 0;
  int refused_in_a_row = 0;
  int unanswered_in_a_row = 0;
  int busy = 0;
  for (;;) {
    ++attempts;
    handshake_ = handshake::not_reached;
    last_error = try_connect(deadline);
    if (last_error.empty()) return;
    if (handshake_ == handshake::fatal)
      throw error(rank(), "tcp_store.connect",
                  detail::text(last_error, " (after ", detail::format_seconds(clock::now() - start), ", attempt ",
                               std::to_string(attempts), ")"),
                  fatal_hint_);
    if (handshake_ == handshake::busy) ++busy;
    // A store answers the handshake at once, even one just started: a listener that accepted
    // twice and never answered is no store, however long the connect timeout.
    unanswered_in_a_row = handshake_ == handshake::unanswered ? unanswered_in_a_row + 1 : 0;
    if (unanswered_in_a_row == 2)
      throw error(rank(), "tcp_store.connect",
                  detail::text("something listens on ", endpoint(),
                               " but does not speak the store protocol: it accepted the connection and never "
                               "answered cohort's handshake, twice in a row, in ",
                               detail::format_seconds(clock::now() - start), " (last: ", last_error, ")"),
                  "check that MASTER_ADDR:MASTER_PORT is this job's rank 0 (or its launcher's agent store) and "
                  "not another service's port; a rank 0 that is stopped (SIGSTOP, a debugger) looks the same");
    // A server that accepts the connection and then closes it at cohort's first message is
    // an answer, not a server still starting: after a few, say what it means.
    refused_in_a_row = handshake_ == handshake::refused ? refused_in_a_row + 1 : 0;
    if (refused_in_a_row == 3 && !options_.token.empty())
      throw error(
          rank(), "tcp_store.connect",
          detail::text("the server at ", endpoint(),
                       " accepted the connection and closed it during cohort's token handshake 3 times in a row "
                       "in ",
                       detail::format_seconds(clock::now() - start), " (last: ", last_error,
                       "): it checks no token. PyTorch's TCPStore (torchrun's agent store among them) has no "
                       "authentication"),
          "a token needs rank 0 to serve the store with cohort (connect_store without torchrun's agent "
          "store); otherwise unset COHORT_STORE_TOKEN on every rank");
    if (refused_in_a_row == 3)
      throw error(rank(), "tcp_store.connect",
                  detail::text("the server at ", endpoint(),
                               " accepted the connection and closed it during cohort's "
                               "handshake (VALIDATE, then PING) 3 times in a row in ",
                               detail::format_seconds(clock::now() - start), " (last: ", last_error,
                               "): ", detail::tcp::other_protocol),
                  "run a PyTorch >= 2.0 TCPStore (torchrun of torch 2.x), or let cohort's rank 0 host the "
                  "store; check that MASTER_PORT is not another service's port");
    const auto now = clock::now();
    if (now >= deadline) break;
    if (lines.due(now))
      detail::progress_line(rank(), detail::text("tcp_store: still connecting to the store server at ", endpoint(),
                                                 " (", detail::format_seconds(now - start), " of ",
                                                 detail::format_duration(options_.connect_timeout), ", ",
                                                 std::to_string(attempts), " attempts; last: ", last_error, ")"));
    std::this_thread::sleep_for(std::min<clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::max(options_.max_backoff, backoff));
  }
  std::string why;
  if (busy > 0)
    why = detail::text(
        "; the server turned ", std::to_string(busy),
        " attempt(s) away at its connection limit: look for clients that are not the job's (SECURITY.md), or "
        "raise tcp_store_server_options::max_connections or ulimit -n on the rank serving the store");
  else if (handshake_ == handshake::unanswered)
    why = detail::text("; the server accepted the connection but never answered the handshake: ",
                       detail::tcp::other_protocol);
  throw timeout_error(rank(), "tcp_store.connect",
                      detail::text("could not connect to the store server at ", endpoint(), " in ",
                                   detail::format_seconds(clock::now() - start),
                                   " (its connect timeout: ", detail::format_duration(options_.connect_timeout), "; ",
                                   std::to_string(attempts), " attempts; last error: ", last_error, ")", why),
                      "check MASTER_ADDR and MASTER_PORT, that rank 0 (or the launcher's "
                      "agent) is running, and that no firewall blocks the port");
}

COHORT_DECL auto tcp_store::try_connect(clock::time_point deadline) -> std::string {
  detail::tcp::address_list addresses;
  const std::string unresolved = detail::tcp::resolve(options_.host, options_.port, false, addresses);
  if (!unresolved.empty()) return detail::text("cannot resolve ", options_.host, ": ", unresolved);
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
    drop_connection();
    socket_ = std::move(fd);
    broken_.clear();
    try {
      // A store answers the handshake at once; a just-accepted connection gets 2 to 5 s, even
      // at the connect deadline. (The bound is what its errors name, not the store's timeout.)
      const auto answer =
          std::clamp<clock::duration>(deadline - clock::now(), std::chrono::seconds(2), std::chrono::seconds(5));
      request_limit_ = std::chrono::duration_cast<std::chrono::milliseconds>(answer);
      struct reset {
        std::chrono::milliseconds& limit;
        ~reset() { limit = std::chrono::milliseconds(0); }
      } back_to_timeout{request_limit_};
      handshake_locked(clock::now() + answer);
      return {};
    } catch (const timeout_error& failure) {
      drop_connection();
      if (handshake_ == handshake::not_reached) handshake_ = handshake::unanswered;
      last_error = detail::text("handshake failed: ", failure.detail());
    } catch (const error& failure) {
      drop_connection();
      if (handshake_ == handshake::not_reached) handshake_ = handshake::refused;
      last_error = (handshake_ == handshake::fatal ? "" : "handshake failed: ") + failure.detail();
      if (handshake_ == handshake::fatal) return last_error;
    }
  }
  return last_error;
}

COHORT_DECL auto tcp_store::handshake_locked(clock::time_point deadline) -> void {
  namespace protocol = detail::tcp_store_protocol;
  // One message per round trip: VALIDATE and PING together (one round trip), or with a token
  // VALIDATE and AUTH_HELLO, then AUTH_PROOF and PING (two).
  bytes message;
  writer out(message);
  out.command(command::validate);
  out.u32(protocol::validation_magic);
  if (options_.token.empty()) {
    const std::uint32_t nonce = append_handshake_end(out);
    send_message("connect", message, deadline, 2);
    await_answer(deadline);
    return read_handshake_end(nonce, deadline);
  }
  protocol::nonce client{};
  if (!detail::random_bytes(client))
    throw error(rank(), "tcp_store.connect", "no random source (getrandom, /dev/urandom) for the token handshake");
  out.command(command::auth_hello);
  out.u8(protocol::auth_version);
  out.raw_bytes(client);
  send_message("connect", message, deadline, 2);
  await_answer(deadline);
  const auto status = receive_value<std::uint8_t>("connect", {}, deadline);
  if (status == protocol::busy_first_byte) fail_busy("connect");
  if (status == static_cast<std::uint8_t>(protocol::auth_reply::no_token)) {
    handshake_ = handshake::fatal;
    fatal_hint_ = "set the same COHORT_STORE_TOKEN on every rank, rank 0 included, or unset it everywhere";
    fail("connect", detail::text("the store server at ", endpoint(),
                                 " was started without a token, and this rank has one (COHORT_STORE_TOKEN)"));
  }
  if (status != static_cast<std::uint8_t>(protocol::auth_reply::challenge))
    fail("connect", detail::text("the server at ", endpoint(), " answered AUTH_HELLO with ", std::to_string(status)));
  prove_token(client, deadline);
}

COHORT_DECL auto tcp_store::prove_token(const detail::tcp_store_protocol::nonce& client, clock::time_point deadline)
    -> void {
  namespace protocol = detail::tcp_store_protocol;
  protocol::nonce server{};
  detail::sha256_digest claimed{};
  receive_exact("connect", {}, server.data(), server.size(), deadline);
  receive_exact("connect", {}, claimed.data(), claimed.size(), deadline);
  if (!detail::equal_in_constant_time(protocol::server_proof(options_.token, client, server), claimed)) {
    handshake_ = handshake::fatal;
    fatal_hint_ =
        "set the same COHORT_STORE_TOKEN (or the same COHORT_STORE_TOKEN_FILE contents) on every rank, "
        "and check that MASTER_ADDR:MASTER_PORT is this job's rank 0";
    fail("connect",
         detail::text("the store server at ", endpoint(),
                      " could not prove that it knows this rank's token: rank 0 has another COHORT_STORE_TOKEN, or "
                      "the server is not this job's"));
  }
  const auto proof = protocol::client_proof(options_.token, client, server);
  bytes message;
  writer out(message);
  out.command(command::auth_proof);
  out.raw_bytes(proof);
  const std::uint32_t nonce = append_handshake_end(out);
  send_message("connect", message, deadline, 2);
  const auto status = receive_value<std::uint8_t>("connect", {}, deadline);
  if (status == protocol::busy_first_byte) fail_busy("connect");
  if (status != static_cast<std::uint8_t>(protocol::auth_reply::accepted)) {
    handshake_ = handshake::fatal;
    fatal_hint_ = "set the same COHORT_STORE_TOKEN on every rank";
    fail("connect", detail::text("the store server at ", endpoint(), " refused this rank's token proof"));
  }
  max_key_bytes_ = std::min(receive_value<std::uint64_t>("connect", {}, deadline), protocol::max_key_bytes);
  max_value_bytes_ = std::min(receive_value<std::uint64_t>("connect", {}, deadline), protocol::max_value_bytes);
  authenticated_ = true;
  read_handshake_end(nonce, deadline);
}

COHORT_DECL auto tcp_store::join_workers(int workers) -> void {
  const std::string init_key = "init/";  // c10d's key, without the key prefix
  add_wire(init_key, init_key, 1, timeout());
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
      throw timeout_error(
          rank(), "tcp_store.wait_for_workers",
          detail::text(std::to_string(joined), " of ", std::to_string(workers), " workers joined the store at ",
                       endpoint(), " within ", detail::format_duration(timeout())),
          "check that every rank was started with the same world size and "
          "master address");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_COLD_BODY std::string store_token_from_environment(int rank) {
  const char* token = std::getenv("COHORT_STORE_TOKEN");
  const char* file = std::getenv("COHORT_STORE_TOKEN_FILE");
  if (token && !*token) token = nullptr;
  if (file && !*file) file = nullptr;
  if (token && file)
    throw error(rank, "store_token", "both COHORT_STORE_TOKEN and COHORT_STORE_TOKEN_FILE are set",
                "set one of them, the same on every rank");
  if (token) return token;
  if (!file) return {};
  std::string text;
  if (const int code = detail::read_file(file, text); code != 0)
    throw error(rank, "store_token",
                detail::text("cannot read COHORT_STORE_TOKEN_FILE=", file, ": ", std::strerror(code)),
                "the file must exist and be readable by this rank on every node");
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.empty())
    throw error(rank, "store_token", detail::text("COHORT_STORE_TOKEN_FILE=", file, " is empty"),
                "write the token into it (for example: head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)");
  return text;
}

namespace detail {

// A random name of this process's making: the store host's names a job without an id, a
// claimant's tells its rank claim from another process's.
COHORT_COLD inline std::string random_nonce() {
  std::array<std::uint8_t, 8> bits{};
  if (!random_bytes(bits)) {
    const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    for (std::size_t k = 0; k < bits.size(); ++k) bits[k] = static_cast<std::uint8_t>((now ^ ::getpid()) >> (8 * k));
  }
  static constexpr char digits[] = "0123456789abcdef";
  std::string nonce = "cohort-";
  for (const auto b : bits) {
    nonce += digits[b >> 4];
    nonce += digits[b & 15];
  }
  return nonce;
}

// This process as a job's rank describes itself at the rendezvous.
COHORT_COLD inline job_identity this_rank_of_job(const launch_env& env) {
  job_identity mine;
  mine.id = env.run_id;
  mine.nonce = random_nonce();
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '?';
  mine.host = host;
  mine.pid = static_cast<long>(::getpid());
  mine.rank = env.rank;
  mine.world = env.world_size;
  return mine;
}

// Where a job keeps its keys: under its id, or, without one, under its store host's nonce.
COHORT_COLD inline std::string job_prefix(const job_identity& job) {
  return detail::text("job/", job.id.empty() ? job.nonce : job.id, "/");
}

COHORT_COLD inline std::string describe_claimant(const job_identity& mine) {
  return detail::text("rank ", std::to_string(mine.rank), " of job ", (mine.id.empty() ? "(no id)" : mine.id.c_str()),
                      " on ", mine.host, ", pid ", std::to_string(mine.pid));
}

// A second process claims a rank of a job it cannot be told apart from: the job is marked
// collided, and every rank of it stops before its first collective (check_not_collided).
COHORT_COLD [[gnu::cold]] inline void mark_collided(store& job_store, const job_identity& mine,
                                                    const std::string& first) {
  const std::string what = detail::text("two processes claimed rank ", std::to_string(mine.rank), ": ", first,
                                        ", then ", describe_claimant(mine),
                                        " (two jobs without distinct ids share MASTER_ADDR:MASTER_PORT, or a "
                                        "rank was started twice)");
  try {
    job_store.set(std::string(job_collided_key), to_bytes(what));
  } catch (const error&) {  // the claimant fails either way; the job then meets the rank it lacks
  }
}

// Rank 0 could not listen on MASTER_PORT: who holds it? A store client with a short bound asks
// (a cohort job's rank 0 says which job; anything else says what it is). A cohort job that
// this rank 0 cannot be told apart from (the same id, or neither has one) now has two rank 0s:
// it is marked collided.
COHORT_COLD [[gnu::cold]] inline std::string who_holds_the_port(tcp_store_options options, const job_identity& mine) {
  options.is_server = false;
  options.greeting_key.clear();  // nothing of this job is written to a store it does not hold
  options.num_workers.reset();
  options.connect_timeout = std::chrono::seconds(2);
  options.timeout = std::chrono::seconds(2);
  options.max_backoff = std::chrono::milliseconds(250);
  options.progress_interval = std::chrono::milliseconds(0);
  try {
    auto holder = std::make_shared<tcp_store>(options);
    std::string record;
    try {
      record = to_string(holder->get(job_key, std::chrono::seconds(1)));
    } catch (const timeout_error&) {
      return "a TCPStore server that serves no cohort job (another program's, a PyTorch one for instance)";
    }
    job_identity theirs;
    if (!decode_job(record, theirs))
      return "a TCPStore server whose cohort/job key holds something cohort does not write";
    if (theirs.id != mine.id) return detail::text("rank 0 of another cohort job: ", describe_job(theirs));
    prefix_store job_store(holder, job_prefix(theirs));
    mark_collided(job_store, mine, describe_claimant(theirs));
    return detail::text("rank 0 of ", describe_job(theirs),
                        ", which this job cannot be told apart from: that job is marked collided, and its ranks stop "
                        "before their first collective");
  } catch (const error& failure) {
    return detail::text("a program that is no store cohort can use: ", failure.detail());
  } catch (const std::exception& failure) {
    return failure.what();
  }
}

// The rendezvous of one job: every rank reads the job's identity (rank 0's server holds it
// from its start; under torchrun's agent store the first rank to come writes it), refuses a
// store of another job (ids differ, or one of the two has none), claims its rank, and keeps its
// keys under the job's own prefix.
// `record` is what the connection's handshake read (tcp_store_options::greeting).
COHORT_COLD inline std::shared_ptr<store> join_job(std::shared_ptr<store> shared, const job_identity& mine,
                                                   const launch_env& env, const bytes& record) {
  const std::string where = shared->location();
  const std::string key(job_key);
  job_identity theirs;
  if (!decode_job(to_string(record), theirs))
    throw malformed_store_value(env.rank, "connect_store", key, record,
                                "a cohort job's identity (cohort-job-2, then id, nonce, host, pid, rank and world)");
  const std::string self = detail::text("this rank (", describe_claimant(mine), ")");
  const char* shared_port =
      "give each job its own MASTER_PORT (or MASTER_ADDR): two jobs on one port mix their ranks otherwise";
  if (mine.id != theirs.id)
    throw error(env.rank, "connect_store",
                detail::text(self, " reached the store at ", where, ", which serves ", describe_job(theirs),
                             (mine.id.empty() || theirs.id.empty()
                                  ? ": a job without an id (none set, or torchrun's default `none`) never joins one "
                                    "with an id, nor the reverse"
                                  : ": another job holds MASTER_ADDR:MASTER_PORT"),
                             "; this rank was refused before it wrote anything there"),
                shared_port);
  if (theirs.world != env.world_size)
    throw error(env.rank, "connect_store",
                detail::text(self, " was started with a world of ", std::to_string(env.world_size),
                             ", but the store at ", where, " serves ", describe_job(theirs),
                             ": another job, or a rank started with another "
                             "WORLD_SIZE"),
                detail::text(shared_port, "; start every rank of a job with the same WORLD_SIZE"));
  // Under torchrun's agent store the attempt's prefix is the job's own already.
  std::shared_ptr<store> job_store = env.use_agent_store && theirs.id.empty()
                                         ? std::move(shared)
                                         : std::make_shared<prefix_store>(std::move(shared), job_prefix(theirs));
  // One process per rank: a second claimant is another job's rank that this job cannot be
  // told apart from, or a rank started twice. Both fail, and so does the job they met.
  const std::string claim = detail::text(describe_claimant(mine), ", claim ", mine.nonce);
  const std::string claimed_key = detail::text("cohort/rank_claimed/", std::to_string(env.rank));
  const std::string holder = to_string(job_store->compare_set(claimed_key, {}, to_bytes(claim)));
  if (holder != claim) {
    const std::string first = holder.substr(0, holder.rfind(", claim "));
    mark_collided(*job_store, mine, first);
    throw error(env.rank, "connect_store",
                detail::text("job collision: ", self, " is the second process to claim rank ", std::to_string(env.rank),
                             " of ", describe_job(theirs), " (the first: ", first,
                             "): another job that cannot be told apart from this one (no distinct job id) shares "
                             "MASTER_ADDR:MASTER_PORT, or rank ",
                             std::to_string(env.rank),
                             " was started twice; the job is marked collided and every rank of it stops before its "
                             "first collective"),
                detail::text(shared_port,
                             "; a job id (COHORT_JOB_ID, or the launcher's: TORCHELASTIC_RUN_ID other than `none`, "
                             "SLURM_JOB_ID, Open MPI's) lets a stranger be refused before it joins"));
  }
  return job_store;
}

}  // namespace detail

COHORT_DECL std::string tcp_store::reached_from_other_hosts(std::chrono::milliseconds limit) {
  // cohort's server holds the job's record at the top from its start; torchrun's agent holds
  // it under the attempt's prefix (and writes no reached address).
  const std::string served_by_cohort(detail::job_key);
  if (!check(std::span<const std::string>(&served_by_cohort, 1))) return {};
  try {
    return to_string(get(detail::tcp_store_protocol::store_reached_key, limit));
  } catch (const timeout_error&) {
    return {};
  }
}

COHORT_COLD_BODY std::shared_ptr<store> connect_store(const launch_env& env, tcp_store_options options) {
  options.host = env.master_addr;
  options.port = env.master_port;
  options.rank = env.rank;
  // Nodes of one job start minutes apart under real schedulers: a rank waits for the store
  // host as long as the job waits for its ranks (with progress lines), not a shorter limit.
  options.connect_timeout = std::max(options.connect_timeout, options.timeout);
  if (options.token.empty()) options.token = store_token_from_environment(env.rank);
  if (options.server.reserved_connections == 0 && env.world_size > 0)
    options.server.reserved_connections = static_cast<std::size_t>(env.world_size);
  detail::job_identity mine = detail::this_rank_of_job(env);
  // The job's record is read (under torchrun's agent store, written by the first rank) by the
  // handshake's own round trip.
  options.greeting_key = detail::text(env.store_prefix(), detail::job_key);
  options.greeting = detail::encode_job(mine);
  if (env.use_agent_store) {
    if (!options.token.empty())
      throw error(env.rank, "connect_store",
                  "a store token is set (COHORT_STORE_TOKEN or COHORT_STORE_TOKEN_FILE), but under torchrun's agent "
                  "store (TORCHELASTIC_USE_AGENT_STORE=True) the store is PyTorch's TCPStore, which checks no token",
                  "unset the token for this job, or start the ranks another way (mpirun, srun, COHORT_* variables) "
                  "so that rank 0 serves a cohort store that checks it (SECURITY.md)");
    options.is_server = false;
    auto agent_store = std::make_shared<tcp_store>(std::move(options));
    const bytes record = agent_store->greeting_answer();
    return detail::join_job(std::make_shared<prefix_store>(std::move(agent_store), env.store_prefix()), mine, env,
                            record);
  }
  options.is_server = env.rank == 0;
  if (options.is_server) {
    options.server.job = detail::encode_job(mine);
    detail::listen_request listening;
    listening.master_addr = env.master_addr;
    listening.world_size = env.world_size;
    listening.local_world_size = env.local_world_size;
    if (detail::world_spans_nodes(listening)) {
      detail::tcp::address_list addresses;  // a name that does not resolve: the server says so
      if (detail::tcp::resolve(env.master_addr, options.port, true, addresses).empty())
        for (const addrinfo* entry = addresses.head; entry; entry = entry->ai_next)
          if (detail::is_loopback_address(detail::reachable_numeric_address(entry->ai_addr, entry->ai_addrlen)))
            options.server.listen_on_every_interface = true;
    }
  }
  std::shared_ptr<tcp_store> handle;
  try {
    handle = std::make_shared<tcp_store>(options);
  } catch (const error& failure) {
    if (!options.is_server || failure.operation() != "tcp_store_server" ||
        failure.detail().find("in use") == std::string::npos)
      throw;
    throw error(env.rank, "connect_store",
                detail::text("rank 0 of ", detail::describe_job(mine),
                             " cannot serve the job's store: ", detail::tcp::endpoint(options.host, options.port),
                             " is in use, held by ", detail::who_holds_the_port(options, mine)),
                "pick another MASTER_PORT for this job (the same on every rank), or stop the program that holds it");
  }
  const bytes record = handle->greeting_answer();
  return detail::join_job(std::move(handle), mine, env, record);
}

}  // namespace cohort::inline v0
