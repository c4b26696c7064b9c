#pragma once
// The POSIX socket pieces the TCP store's server and client share: an owning descriptor,
// name resolution, bounded polling, and the words both sides use for a peer that speaks
// another protocol.

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

#include "cohort/config.hpp"

struct addrinfo;  // <netdb.h>: the socket headers are for the definitions (tcp_socket.ipp)

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
  // Gives the descriptor up without closing it.
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

COHORT_DECL std::string endpoint(const std::string& host, std::uint16_t port);

inline std::chrono::milliseconds elapsed_since(clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
}

// Waits until fd is ready for events or the deadline passes; false on timeout.
COHORT_DECL bool poll_until(int fd, short events, clock::time_point deadline);

struct address_list {
  addrinfo* head = nullptr;
  address_list() = default;
  address_list(const address_list&) = delete;
  address_list& operator=(const address_list&) = delete;
  COHORT_DECL ~address_list();
};

// Resolves host:port for a stream socket; returns getaddrinfo's error text, or empty on success.
COHORT_DECL std::string resolve(const std::string& host, std::uint16_t port, bool passive, address_list& out);

// "address:port" of a connected socket's peer, for the server's log.
COHORT_DECL std::string peer_of(int fd);

// What the handshake's failure most likely means, said on both sides of it.
inline constexpr std::string_view other_protocol =
    "it speaks another c10d store protocol (PyTorch before 2.0, Debian's python3-torch 1.13 for "
    "one, numbers its commands from SET = 0 and sends no VALIDATE) or is not a TCPStore at all; "
    "cohort speaks the TCPStore protocol of PyTorch 2.x (classic and libuv servers)";

COHORT_DECL void set_no_delay(int fd);

}  // namespace cohort::inline v0::detail::tcp

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/tcp_socket.ipp"
#endif
