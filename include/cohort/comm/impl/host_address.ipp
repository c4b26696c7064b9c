#pragma once
// cohort/comm/detail/host_address.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

#include "cohort/comm/detail/host_address.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0::detail {

namespace host_address_detail {

inline std::string numeric_text(const sockaddr* address, socklen_t length) {
  char text[NI_MAXHOST] = {};
  if (::getnameinfo(address, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) != 0) return {};
  std::string numeric = text;
  // A scope suffix (fe80::1%eth0) is local to this host: useless to a peer.
  if (const auto percent = numeric.find('%'); percent != std::string::npos) numeric.erase(percent);
  return numeric;
}

inline bool is_link_local(const sockaddr* address) {
  if (address->sa_family == AF_INET6) {
    const auto* six = reinterpret_cast<const sockaddr_in6*>(address);
    return IN6_IS_ADDR_LINKLOCAL(&six->sin6_addr);
  }
  if (address->sa_family == AF_INET) {
    const auto host = ntohl(reinterpret_cast<const sockaddr_in*>(address)->sin_addr.s_addr);
    return (host >> 16) == 0xa9feu;  // 169.254.0.0/16
  }
  return false;
}

}  // namespace host_address_detail

COHORT_DECL bool is_loopback_address(std::string_view address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0 ||
         address.rfind("::ffff:127.", 0) == 0;
}

COHORT_DECL std::string reachable_numeric_address(const sockaddr* address, socklen_t length) {
  if (host_address_detail::is_link_local(address)) return {};
  std::string numeric = host_address_detail::numeric_text(address, length);
  if (numeric.rfind("::ffff:", 0) == 0 && numeric.find('.') != std::string::npos) numeric.erase(0, 7);
  return numeric;
}

COHORT_DECL bool world_spans_nodes(const listen_request& request) {
  return request.local_world_size < request.world_size && !is_loopback_address(request.master_addr);
}

COHORT_DECL std::string resolve_numeric(const std::string& name, int rank, std::string_view operation) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const int status = ::getaddrinfo(name.c_str(), nullptr, &hints, &list);
  if (status != 0 || list == nullptr) {
    const std::string why = status == EAI_SYSTEM ? std::system_category().message(errno) : ::gai_strerror(status);
    if (list) ::freeaddrinfo(list);
    throw error(rank, operation, detail::text("cannot resolve '", name, "': ", why),
                "add the name to /etc/hosts or DNS, or give a numeric address");
  }
  // IPv4 first: it is what the other ranks' lookups most likely return too.
  const addrinfo* chosen = nullptr;
  for (const addrinfo* entry = list; entry; entry = entry->ai_next)
    if (entry->ai_family == AF_INET) {
      chosen = entry;
      break;
    }
  if (!chosen) chosen = list;
  std::string numeric = host_address_detail::numeric_text(chosen->ai_addr, chosen->ai_addrlen);
  ::freeaddrinfo(list);
  if (numeric.empty())
    throw error(rank, operation, detail::text("'", name, "' resolves to an address that cannot be written out"),
                "give a numeric address");
  return numeric;
}

COHORT_DECL std::string route_source_address(const std::string& numeric, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  if (::getaddrinfo(numeric.c_str(), "9", &hints, &list) != 0 || list == nullptr) {
    why = detail::text("'", numeric, "' is not a numeric address");
    return {};
  }
  std::string source;
  const int fd = ::socket(list->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    why = detail::text("socket: ", std::system_category().message(errno));
  } else if (::connect(fd, list->ai_addr, list->ai_addrlen) != 0) {  // a datagram connect sends nothing
    why = detail::text("no route to ", numeric, ": ", std::system_category().message(errno));
  } else {
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0)
      source = host_address_detail::numeric_text(reinterpret_cast<const sockaddr*>(&local), length);
    else
      why = detail::text("getsockname: ", std::system_category().message(errno));
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(list);
  return source;
}

COHORT_DECL std::string interface_address(const std::string& interface, std::string& seen) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    seen = detail::text("getifaddrs: ", std::system_category().message(errno));
    return {};
  }
  std::string four, six;
  for (const ifaddrs* entry = list; entry; entry = entry->ifa_next) {
    if (!entry->ifa_addr || !entry->ifa_name) continue;
    const int family = entry->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    const std::string name = entry->ifa_name;
    if (seen.find(detail::text(" ", name, " ")) == std::string::npos) seen += detail::text(" ", name, " ");
    if (interface.empty()) {
      if ((entry->ifa_flags & IFF_UP) == 0 || (entry->ifa_flags & IFF_LOOPBACK) != 0) continue;
    } else if (name != interface) {
      continue;
    }
    if (host_address_detail::is_link_local(entry->ifa_addr)) continue;
    const socklen_t length = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::string& slot = family == AF_INET ? four : six;
    if (slot.empty()) slot = host_address_detail::numeric_text(entry->ifa_addr, length);
  }
  ::freeifaddrs(list);
  // "  eth0  lo " -> "eth0, lo"
  std::string names;
  for (std::size_t at = 0; (at = seen.find_first_not_of(' ', at)) != std::string::npos;) {
    const std::size_t end = seen.find(' ', at);
    names += (names.empty() ? "" : ", ") + seen.substr(at, end - at);
    at = end;
  }
  seen = names;
  return four.empty() ? six : four;
}

COHORT_DECL listen_choice choose_listen_address(const listen_request& request) {
  const std::string operation = "gloo.choose_address";
  const bool spans = world_spans_nodes(request);
  const std::string world =
      detail::text("the world spans nodes (", std::to_string(request.local_world_size), " of ",
                   std::to_string(request.world_size), " ranks on this node, MASTER_ADDR ", request.master_addr, ")");
  listen_choice choice;
  std::string interface = request.interface;
  std::string named_by = "options.interface";
  if (interface.empty() && !request.env_interface.empty()) {
    interface = request.env_interface;
    named_by = "GLOO_SOCKET_IFNAME";
  }
  if (!request.hostname.empty()) {
    choice.address = resolve_numeric(request.hostname, request.rank, operation);
    choice.reason = detail::text("options.hostname ", request.hostname);
  } else if (!interface.empty()) {
    std::string seen;
    choice.address = interface_address(interface, seen);
    if (choice.address.empty())
      throw error(request.rank, operation,
                  detail::text(named_by, " names interface '", interface, "', which has no address"),
                  detail::text("interfaces with an address here: ", seen));
    choice.reason = detail::text(named_by, " ", interface);
  } else if (!spans) {
    choice.address = "127.0.0.1";  // one node: stay on loopback, never expose a port
    choice.reason = "every rank is on this node";
    return choice;
  } else {
    const std::string master = resolve_numeric(request.master_addr, request.rank, operation);
    if (is_loopback_address(master)) {
      // This host's own name on Debian: the other nodes reach it by another address, which
      // the store they connected to saw.
      choice.address = request.reached_by_other_nodes ? request.reached_by_other_nodes() : std::string();
      if (choice.address.empty())
        throw error(
            request.rank, operation,
            detail::text("MASTER_ADDR ", request.master_addr, " resolves to ", master, ", a loopback address, but ",
                         world, ", and no rank of another node reached this host's store to say at which address"),
            "set MASTER_ADDR to an address the other nodes reach (check /etc/hosts: Debian maps the "
            "host's own name to 127.0.1.1)");
      choice.reason = detail::text("the address at which the other nodes reached the store (MASTER_ADDR ",
                                   request.master_addr, " resolves to ", master, " here)");
      return choice;
    }
    std::string why;
    choice.address = route_source_address(master, why);
    choice.reason = detail::text("the address that routes to MASTER_ADDR ", request.master_addr,
                                 (master == request.master_addr ? "" : detail::text(" (", master, ")")));
    if (choice.address.empty() || is_loopback_address(choice.address)) {
      // MASTER_ADDR is an address of this host held by the loopback device, or unroutable.
      std::string seen;
      const std::string fallback = interface_address("", seen);
      if (fallback.empty())
        throw error(
            request.rank, operation,
            detail::text("no address of this host reaches MASTER_ADDR ", request.master_addr, " (",
                         (why.empty() ? detail::text("the route uses ", choice.address) : why),
                         ") and no interface other than loopback is up, but ", world),
            detail::text("set GLOO_SOCKET_IFNAME to the interface the nodes share (interfaces here: ", seen, ")"));
      choice.reason += detail::text(", or rather, since that gave ", (choice.address.empty() ? why : choice.address),
                                    ", the first interface that is up");
      choice.address = fallback;
    }
  }
  if (spans && is_loopback_address(choice.address))
    throw error(request.rank, operation,
                detail::text(choice.reason, " gives ", choice.address, ", a loopback address, but ", world,
                             ": the other nodes cannot reach it"),
                "name an address or interface the nodes share, or leave both unset to have cohort choose");
  return choice;
}

}  // namespace cohort::inline v0::detail
