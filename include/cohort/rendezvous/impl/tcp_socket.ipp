#pragma once
// cohort/rendezvous/detail/tcp_socket.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

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

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/rendezvous/detail/tcp_socket.hpp"

namespace cohort::inline v0::detail::tcp {

COHORT_DECL address_list::~address_list() {
  if (head) ::freeaddrinfo(head);
}

COHORT_DECL std::string endpoint(const std::string& host, std::uint16_t port) {
  // IPv6 literals are bracketed so the port stays readable.
  if (host.find(':') != std::string::npos) return detail::text("[", host, "]:", std::to_string(port));
  return detail::text(host, ":", std::to_string(port));
}

COHORT_DECL bool poll_until(int fd, short events, clock::time_point deadline) {
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

COHORT_DECL std::string resolve(const std::string& host, std::uint16_t port, bool passive, address_list& out) {
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

COHORT_DECL std::string peer_of(int fd) {
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

COHORT_DECL void set_no_delay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

}  // namespace cohort::inline v0::detail::tcp
