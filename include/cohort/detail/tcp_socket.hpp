#pragma once
// The POSIX socket pieces the TCP store's server and client share: an owning descriptor,
// name resolution, bounded polling, and the words both sides use for a peer that speaks
// another protocol.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace cohort::inline v0::detail::tcp {

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

}  // namespace cohort::inline v0::detail::tcp
