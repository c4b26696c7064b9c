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
// Protocol, limits and wire layout: detail/tcp_store_protocol.hpp.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/detail/tcp_socket.hpp"
#include "cohort/detail/tcp_store_protocol.hpp"
#include "cohort/error.hpp"
#include "cohort/launch.hpp"
#include "cohort/store.hpp"
#include "cohort/tcp_store_server.hpp"

namespace cohort::inline v0 {

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
