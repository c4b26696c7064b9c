#pragma once
// Which address a rank listens on and publishes for its peers' connections (Gloo's pairs).
//
// A rank that picks badly fails in the worst way: the name of a Debian host resolves to
// 127.0.1.1 (the line its installer writes into /etc/hosts), which peers on other nodes can
// never reach, and a name that does not resolve crashes libgloo's device creation (it checks
// getaddrinfo's result against -1 only). So the choice is cohort's, made here with checked
// lookups, and Gloo is only ever given a numeric address:
//   1. options.hostname, resolved;
//   2. else options.interface or GLOO_SOCKET_IFNAME: that interface's address;
//   3. else, when the world spans nodes: the local address that routes to MASTER_ADDR (the
//      source address the kernel picks for a connected UDP socket; connect() on a datagram
//      socket sends nothing), or, where that is a loopback address (MASTER_ADDR is this
//      host), the first non-loopback address of an interface that is up; where MASTER_ADDR
//      itself resolves to a loopback address (this host's own name on Debian, 127.0.1.1),
//      the address at which the other nodes reached the store on this host (its server
//      records it), which is the one they reach;
//   4. else (one node): 127.0.0.1, so no port is exposed beyond the host.
// A loopback address is never published when the world spans nodes: that is an error naming
// the address and where it came from.

#include <sys/socket.h>

#include <functional>
#include <string>
#include <string_view>

#include "cohort/config.hpp"

namespace cohort::inline v0::detail {

struct listen_request {
  int rank = -1;              // named in errors
  std::string hostname;       // options.hostname
  std::string interface;      // options.interface
  std::string env_interface;  // GLOO_SOCKET_IFNAME
  std::string master_addr;
  int world_size = 1;
  int local_world_size = 1;
  // Where ranks of other nodes reached this host's store (store::reached_from_other_hosts),
  // waiting as long as the group may; empty when unknown. Asked only where MASTER_ADDR
  // resolves to a loopback address while the world spans nodes.
  std::function<std::string()> reached_by_other_nodes;
};

struct listen_choice {
  std::string address;  // numeric (IPv4 dotted or IPv6 text)
  std::string reason;   // one line: where the address came from
};

// Whether ranks live on more than one host: fewer ranks on this node than in the world, and
// MASTER_ADDR is not written as a loopback address (tests and single-host jobs simulate nodes
// on loopback, and say so by giving MASTER_ADDR as 127.0.0.1 or localhost).
COHORT_DECL bool world_spans_nodes(const listen_request& request);

// True for 127.0.0.0/8, ::1, ::ffff:127.x.y.z and "localhost".
COHORT_DECL bool is_loopback_address(std::string_view address);

// The numeric text of `address` (an IPv4-mapped IPv6 address as the IPv4 one); empty for a
// link-local address (useless to another host) or one that cannot be written out.
COHORT_DECL std::string reachable_numeric_address(const sockaddr* address, socklen_t length);

// The numeric address `name` resolves to (IPv4 first), with getaddrinfo's result checked:
// an unresolvable name is a cohort::error naming it, for rank `rank`, in `operation`.
COHORT_DECL std::string resolve_numeric(const std::string& name, int rank, std::string_view operation);

// The local address the kernel would send from to reach `numeric` (no packet is sent);
// empty when there is no route (with the reason in `why`).
COHORT_DECL std::string route_source_address(const std::string& numeric, std::string& why);

// The first IPv4 (else IPv6, not link-local) address of `interface`; empty if none. With an
// empty `interface`, the first such address of any interface that is up and not loopback.
// `seen` lists the interfaces looked at, for errors.
COHORT_DECL std::string interface_address(const std::string& interface, std::string& seen);

// The address this rank listens on and publishes (see the top of this file). Throws
// cohort::error naming the name, interface or address at fault.
COHORT_DECL listen_choice choose_listen_address(const listen_request& request);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/host_address.ipp"
#endif
