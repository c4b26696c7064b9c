#pragma once
// The host backend's intra-host transport for its bulk collectives (all-reduce,
// reduce-scatter, all-gather): when every rank of a group runs on one host, they meet in
// shared memory instead of Gloo's TCP over loopback, where each byte costs a send and a
// receive copy through the kernel and a system call per slice. As NCCL's SHM transport and
// MPI's shared-memory BTLs do; Gloo has none.
//
// Each rank owns one segment (an anonymous memfd, opened by its peers through
// /proc/<pid>/fd: nothing is named in /dev/shm, so nothing is left behind by a rank that
// dies) holding a header and a slot. A collective moves through the slots a chunk at a time
// in phases: a rank writes what its peers need into its own slot, posts the phase, waits
// until every peer has posted it, then reads from theirs. Every post is followed by a wait
// for all at that phase, so no rank runs more than one phase ahead of another, and a chunk
// begins only once every peer has posted the previous chunk's last phase, the one after
// which it no longer reads this rank's slot.
//
// A message that fits a small slot (an all-reduce up to small_bytes) takes one phase, not
// three, and its wait spins longer before it sleeps: every rank writes its whole input, posts, and reduces every rank's
// contribution itself, in rank order (the same bits everywhere). Its small slots alternate by the phase's parity, so a
// rank may write the next call's while a slower peer still reads this one's.
//
// Waits are bounded like a Gloo call: a short spin (a peer a moment behind posts within
// microseconds), then a futex wait (no CPU while waiting, the cores are the trainer's) in
// slices, each ending in a look at what can end the wait early: this rank's channel shut
// down (gloo::abort_transport), a peer that shut its down or closed, a peer process that is
// gone (a pidfd: a zombie or a reused pid reads as gone), and the group's timeout. A post
// wakes only a peer that said it sleeps (a waiter count): no system call when none does. The failures read as Gloo's
// would (a closed connection, a timeout), so gloo::explain names the culprit the same way for both.
//
// Ranks in different calls never read each other's data: each posts its call's signature
// with every phase, and a peer whose signature differs counts as not arrived; the wait
// then ends as a Gloo call with mismatched tags does (the progress monitor's verdict, or the
// timeout).

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/host_math.hpp"

namespace cohort::inline v0::detail {

namespace shared_memory {

// A file descriptor owned for the length of its owner.
struct owned_fd {
  int fd = -1;
  owned_fd() = default;
  explicit owned_fd(int f) : fd(f) {}
  owned_fd(owned_fd&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  owned_fd& operator=(owned_fd&& other) noexcept {
    std::swap(fd, other.fd);
    return *this;
  }
  COHORT_DECL ~owned_fd();
};

}  // namespace shared_memory

// A shared-memory wait that failed: read as a Gloo I/O failure (gloo::explain).
class shared_memory_failure : public std::runtime_error {
 public:
  shared_memory_failure(const std::string& what, bool timed_out) : std::runtime_error(what), timed_out_(timed_out) {}
  // About one peer: `before` "rank <peer>" `after`, the peer by its number in the channel (the
  // group's): a subgroup says it by world rank (text_naming_peer).
  shared_memory_failure(const std::string& before, int peer, const std::string& after, bool timed_out)
      : std::runtime_error(before + "rank " + std::to_string(peer) + after),
        timed_out_(timed_out),
        peer_(peer),
        before_(before),
        after_(after) {}
  bool timed_out() const noexcept { return timed_out_; }
  // The failure's text with its peer named by `name` ("world rank 3 (group rank 1)").
  template <class Naming>
  std::string text_naming_peer(const Naming& name) const {
    return peer_ < 0 ? std::string(what()) : before_ + name(peer_) + after_;
  }

 private:
  bool timed_out_;
  int peer_ = -1;
  std::string before_;
  std::string after_;
};

class shared_memory_channel {
 public:
  // The bytes of one rank's slot: a chunk of an all-reduce, or of every rank's block of a
  // reduce-scatter. Small enough to stay in the last-level cache between the rank that writes
  // it and the peers that read it; large enough that a phase's wake-up is a small part of it.
  static constexpr std::size_t default_slot_bytes = std::size_t{1} << 20;
  // Each of the two small slots: an all-reduce up to this size takes one phase (a rank then
  // reduces every rank's whole message, cheap while it is this small).
  static constexpr std::size_t small_bytes = std::size_t{64} << 10;

  // What rank `peer` runs as (for the liveness check): its process id, 0 when unknown.
  struct peer_process {
    long pid = 0;
  };

  // The rendezvous happens in Gloo's (gloo::connect): every rank makes its segment first and
  // publishes where it is with its addresses (published()); once the mesh is up, it maps every
  // peer's (map_peers), and the ranks agree over TCP that all of them could before any uses
  // it. A peer in another container or pid namespace, or no /proc: Gloo's TCP carries the group.
  //
  // This rank's segment; null where it cannot be made (no memfd, no memory).
  COHORT_DECL static std::unique_ptr<shared_memory_channel> create(int rank, int size,
                                                                   std::size_t slot_bytes = default_slot_bytes);
  // Where this rank's segment is, for its peers ("cohort-shm-2 <pid> <fd> <token> <bytes>").
  COHORT_DECL std::string published() const;
  // Maps every peer's segment from what it published, through the process that owns it;
  // false where one cannot be (each rank says so to the others before any collective). A
  // record is followed read-only until its token proves it is the peer's segment: a forged
  // or stale one (another process's descriptor) is never opened for writing.
  COHORT_DECL bool map_peers(const std::vector<std::string>& published, const std::vector<peer_process>& processes);
  // Closes this rank's descriptor of its segment, once every peer has mapped it: the memory
  // lives while it is mapped, and goes with the last rank to unmap it.
  COHORT_DECL void release_descriptor() noexcept;

  shared_memory_channel(const shared_memory_channel&) = delete;
  shared_memory_channel& operator=(const shared_memory_channel&) = delete;
  // Says the channel closed (a peer waiting on this rank fails at once), then unmaps.
  COHORT_DECL ~shared_memory_channel();

  // The collectives, on elements of `element` bytes. `signature` identifies the call (the same
  // on every rank in the same call); `timeout` bounds each wait. `combine` is out = a (op) b;
  // `divisor` > 1 makes the last addition of each element's sum divide (`divided`), an average.
  // Every element's result is computed in one order (its owner's contribution first, then
  // the others' in rank order; a small all-reduce: rank order) by one rank and copied to the
  // rest, or by every rank alike: bit-identical everywhere. `sum_in_rank_order`, where set (a
  // 16-bit float's sum or average), replaces both: every contribution in rank order, added in
  // float and rounded once, as Gloo's TCP path does (the result does not depend on the
  // transport, nor overflows where the average does not).
  struct reduction {
    reduce_fn combine = nullptr;
    divided_reduce_fn divided = nullptr;
    rank_order_sum_fn sum_in_rank_order = nullptr;
    int divisor = 1;
  };
  // in may be out (in place); any other overlap: the caller copies `in` first.
  COHORT_DECL void all_reduce(const void* in, void* out, std::size_t count, std::size_t element,
                              const reduction& reduce, std::uint64_t signature, std::chrono::milliseconds timeout);
  // in: size * count_per_rank elements, out: count_per_rank (out may be `in`'s own block;
  // any other overlap: the caller copies `in` first).
  COHORT_DECL void reduce_scatter(const void* in, void* out, std::size_t count_per_rank, std::size_t element,
                                  const reduction& reduce, std::uint64_t signature, std::chrono::milliseconds timeout);
  // in: count_per_rank elements, out: size * count_per_rank (in may be out's own block; any
  // other overlap: the caller copies `in` first).
  COHORT_DECL void all_gather(const void* in, void* out, std::size_t count_per_rank, std::size_t element,
                              std::uint64_t signature, std::chrono::milliseconds timeout);
  // in and out: size * count_per_rank each, part p of `in` going to rank p, part q of `out`
  // coming from rank q (they must not overlap: the caller copies `in` first). Each round every
  // rank posts one block of each of its parts, the slot cut into `size` pieces.
  COHORT_DECL void all_to_all(const void* in, void* out, std::size_t count_per_rank, std::size_t element,
                              std::uint64_t signature, std::chrono::milliseconds timeout);

  // Ends every wait of this channel, here and on the peers (gloo::abort_transport): each
  // fails as a closed connection, and so does every later call.
  COHORT_DECL void shut_down() noexcept;

  std::size_t slot_bytes() const noexcept { return slot_bytes_; }

 private:
  struct header;
  // One mapped segment: this rank's own, or a peer's.
  struct mapping {
    void* base = nullptr;
    std::size_t bytes = 0;
    mapping() = default;
    mapping(void* b, std::size_t n) : base(b), bytes(n) {}
    mapping(mapping&& other) noexcept : base(other.base), bytes(other.bytes) { other.base = nullptr; }
    mapping& operator=(mapping&& other) noexcept {
      std::swap(base, other.base);
      std::swap(bytes, other.bytes);
      return *this;
    }
    COHORT_DECL ~mapping();
    header& head() const noexcept { return *static_cast<header*>(base); }
    std::byte* slot() const noexcept;
    // The small slot a phase of that parity writes (after the slot of `slot_bytes`).
    std::byte* small_slot(std::size_t slot_bytes, std::uint32_t phase) const noexcept;
  };

  shared_memory_channel(int rank, int size, std::size_t slot_bytes)
      : rank_(rank), size_(size), slot_bytes_(slot_bytes) {}

  // Posts this rank's next phase (and the call's signature with it) and wakes its waiters.
  COHORT_DECL void post(std::uint64_t signature);
  // An all-reduce that fits a small slot: one phase.
  COHORT_DECL void all_reduce_small(const std::byte* in, std::byte* out, std::size_t count, std::size_t element,
                                    const reduction& reduce, std::uint64_t signature,
                                    std::chrono::milliseconds timeout);
  // Whether rank `peer`'s process has ended (a zombie, not yet reaped, has).
  COHORT_DECL bool peer_process_ended(int peer) const;
  // Until every peer has posted `phase`; `signature`: and is in the same call (0: any call).
  // Spins for up to `spin` before it sleeps.
  COHORT_DECL void wait_for_all(std::uint32_t phase, std::uint64_t signature, std::chrono::milliseconds timeout,
                                std::chrono::microseconds spin);
  [[gnu::cold]] COHORT_DECL void check_peers_or_throw(int waiting_for, std::uint32_t phase, std::uint64_t signature,
                                                      std::chrono::steady_clock::time_point started,
                                                      std::chrono::milliseconds timeout) const;
  std::byte* own_slot() const noexcept { return segments_[static_cast<std::size_t>(rank_)].slot(); }
  const std::byte* peer_slot(int peer) const noexcept { return segments_[static_cast<std::size_t>(peer)].slot(); }

  int rank_;
  int size_;
  std::size_t slot_bytes_;
  std::vector<mapping> segments_;        // by rank; this rank's own is its own segment
  int own_fd_ = -1;                      // its memfd, until release_descriptor()
  std::vector<peer_process> processes_;  // by rank
  // By rank: a pidfd of the peer's process, opened once its segment proved to be the one it
  // published (readable once it ends; immune to its pid's reuse); -1 where there is none.
  std::vector<shared_memory::owned_fd> peer_processes_;
  long own_pid_ = 0;
  std::uint32_t posted_ = 0;       // this rank's phases so far (its header's word, as it last wrote it)
  std::atomic<bool> shut_{false};  // shut_down() was called
};

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/shared_memory_channel.ipp"
#endif
