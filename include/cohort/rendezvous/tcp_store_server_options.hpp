#pragma once
// The TCP store server's limits and token: what a tcp_store that hosts a server
// (tcp_store_options::server) and a tcp_store_server (tcp_store_server.hpp) are given. In a
// header of its own so that a client (tcp_store.hpp, the umbrella header) does not pull in
// the server's declarations.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace cohort::inline v0 {

// What the server lets any one client, and all of them together, hold. The defaults bound a
// server's memory to about max_memory_bytes plus its connections' small per-connection state,
// whatever its clients send; every refusal closes that one connection and is printed in the
// server's log (the first few; all are counted) with the peer's address and the reason.
struct tcp_store_server_options {
  // The largest key and value a request may carry (values: also what APPEND may grow a key
  // to). At most the protocol's ceilings (64 KiB, 256 MiB). A cohort client that proved the
  // token learns them in the handshake and refuses an oversized request itself.
  std::uint64_t max_key_bytes = std::uint64_t{64} << 10;
  std::uint64_t max_value_bytes = std::uint64_t{16} << 20;
  // Everything the server holds: keys, values (also those only replies still being sent
  // reference), and what it has read of requests not yet complete. Requests that would pass
  // it are refused; the last eighth is kept for requests of at most 64 KiB, so large requests
  // cannot starve the small ones a rendezvous is made of.
  std::uint64_t max_memory_bytes = std::uint64_t{128} << 20;
  // Replies queued for one connection above which the server stops reading that connection's
  // requests until the client has read them: a client that does not read its replies stops
  // being served, and costs no memory beyond its unread replies (values are shared, never
  // copied per reply).
  std::uint64_t max_queued_reply_bytes = std::uint64_t{1} << 20;
  // A connection that stops in the middle of a request, or leaves replies unread, for this
  // long is closed. Whole requests and a parked WAIT have no time limit.
  std::chrono::milliseconds idle_timeout = std::chrono::seconds(10);
  // A connection that has not finished the handshake (VALIDATE, and with a token the token
  // exchange) this long after it was accepted is closed.
  std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10);
  // Connections served at once; 0: three quarters of the descriptors this process has free
  // when the server starts (the rest is left to the job: Gloo's and NCCL's sockets, files).
  std::size_t max_connections = 0;
  // Room kept for the job's own ranks (connect_store sets the world size): connections that
  // have not proved themselves (finished the handshake and, without a token, sent a store
  // request) may take at most max_connections - reserved_connections (at least half) places;
  // past that the oldest of them is closed for a newcomer. When the descriptor limit is lower
  // than such a world needs, the server raises its soft limit towards the hard one.
  std::size_t reserved_connections = 0;
  // The shared secret of SECURITY.md (COHORT_STORE_TOKEN): when set, only clients that prove
  // they know it (tcp_store_protocol.hpp, AUTH_HELLO) are served, and nothing of another
  // connection is read past its first command byte. Empty: c10d's protocol, no authentication,
  // so PyTorch's clients can join.
  std::string token;
  // The job this server serves, as connect_store's rank 0 describes it (the record of
  // rendezvous/detail/job_identity.hpp): held under the key cohort/job (as c10d's clients name
  // it, "/cohort/job" on the wire) from the server's start, before any client can connect. A
  // rank of another job that reaches this store reads it when it connects and refuses itself;
  // the server prints each such stranger (its job, host and address). Empty: no job.
  std::string job;
  // Listen on every interface instead of the address given. connect_store sets it where
  // MASTER_ADDR names this host by a name that resolves to a loopback address here (Debian's
  // /etc/hosts maps the host's own name to 127.0.1.1) while the world spans nodes: the other
  // nodes reach this host by that name's address in their own /etc/hosts or DNS, as
  // PyTorch's TCPStore listens on every interface.
  bool listen_on_every_interface = false;
};

}  // namespace cohort::inline v0
