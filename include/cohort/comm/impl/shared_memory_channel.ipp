#pragma once
// cohort/comm/detail/shared_memory_channel.hpp's definitions: inline there when header-only,
// compiled once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION.

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <span>
#include <string>

#include "cohort/comm/detail/shared_memory_channel.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0::detail {

// The start of every segment, in shared memory. The words the peers wait on sit on a cache
// line of their own, away from the token the owner writes once.
struct shared_memory_channel::header {
  std::uint64_t token[2] = {0, 0};  // random: proves a mapping is the segment its owner published
  std::uint64_t slot_bytes = 0;
  alignas(64) std::atomic<std::uint32_t> posted{0};  // the owner's phases so far (a futex word)
  std::atomic<std::uint32_t> closed{0};              // 1: the owner shut its channel down or left
  std::atomic<std::uint32_t> waiters{0};             // peers asleep on `posted` (a post wakes them)
  // The call each phase belongs to, by the phase's parity: a peer is at most one phase ahead
  // of a rank that waits for it (every post follows a wait for all at the phase before), so
  // its next phase never overwrites the one waited for.
  std::atomic<std::uint64_t> signature[2] = {0, 0};
};

namespace shared_memory {

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                  std::atomic<std::uint32_t>::is_always_lock_free,
              "a futex word must be a plain 32-bit word");

// The slot starts on the page after the header.
inline constexpr std::size_t header_bytes = 4096;
inline constexpr std::string_view format = "cohort-shm-2";
// How long a futex wait sleeps before it looks again at what can end the wait (a peer gone,
// the timeout); a post wakes it at once.
inline constexpr std::chrono::milliseconds look_again{100};
// How long a wait spins before it sleeps. A peer a moment behind posts within microseconds,
// and a sleep and its wake-up cost tens of them: most of a small all-reduce's time, so its
// one wait spins long. A chunk's phases take 100 us and more, and on a host with few cores a
// long spin takes the core from the peer that is still copying (or the trainer's threads).
inline constexpr std::chrono::microseconds spin_small{50};
inline constexpr std::chrono::microseconds spin_chunk{10};

inline void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Shared (not private) futexes: the waiter and the waker are often different processes.
inline void wait_while(std::atomic<std::uint32_t>& word, std::uint32_t seen, std::chrono::nanoseconds at_most) {
  const auto ns = std::max<std::int64_t>(at_most.count(), 1000);
  timespec bound{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, seen, &bound, nullptr, 0);
}
inline void wake_all(std::atomic<std::uint32_t>& word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Phases count up and wrap: reached when `seen` is at or past `phase`.
inline bool reached(std::uint32_t seen, std::uint32_t phase) noexcept {
  return static_cast<std::int32_t>(seen - phase) >= 0;
}

COHORT_DECL owned_fd::~owned_fd() {
  if (fd >= 0) ::close(fd);
}

// A descriptor of process `pid` that polls readable once it has ended (zombie or reaped) and
// never names another process that reuses the pid; -1 where the kernel has none (before 5.3).
inline owned_fd process_handle(long pid) {
#if defined(SYS_pidfd_open)
  return owned_fd(static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0u)));
#else
  (void)pid;
  return owned_fd();
#endif
}

inline std::size_t segment_bytes(std::size_t slot_bytes) {
  return header_bytes + slot_bytes + 2 * shared_memory_channel::small_bytes;
}

// Where a segment is, as its owner publishes it.
struct published_segment {
  long pid = 0;
  int fd = -1;
  std::uint64_t token[2] = {0, 0};
  std::uint64_t bytes = 0;
};

inline std::string encode(const published_segment& segment) {
  char text[160];
  std::snprintf(text, sizeof text, "%s %ld %d %llu %llu %llu", std::string(format).c_str(), segment.pid, segment.fd,
                static_cast<unsigned long long>(segment.token[0]), static_cast<unsigned long long>(segment.token[1]),
                static_cast<unsigned long long>(segment.bytes));
  return text;
}

// False for "none" (its owner has no segment) and for anything malformed.
inline bool decode(const std::string& text, published_segment& out) {
  char tag[32] = {};
  unsigned long long t0 = 0, t1 = 0, n = 0;
  if (std::sscanf(text.c_str(), "%31s %ld %d %llu %llu %llu", tag, &out.pid, &out.fd, &t0, &t1, &n) != 6) return false;
  if (format != tag || out.pid <= 0 || out.fd < 0) return false;
  out.token[0] = t0;
  out.token[1] = t1;
  out.bytes = n;
  return true;
}

}  // namespace shared_memory

COHORT_DECL shared_memory_channel::mapping::~mapping() {
  if (base != nullptr) ::munmap(base, bytes);
}

COHORT_DECL std::byte* shared_memory_channel::mapping::slot() const noexcept {
  return static_cast<std::byte*>(base) + shared_memory::header_bytes;
}

COHORT_DECL std::byte* shared_memory_channel::mapping::small_slot(std::size_t slot_bytes,
                                                                  std::uint32_t phase) const noexcept {
  return slot() + slot_bytes + (phase & 1u) * small_bytes;
}

COHORT_DECL auto shared_memory_channel::create(int rank, int size, std::size_t slot_bytes)
    -> std::unique_ptr<shared_memory_channel> {
  namespace shm = shared_memory;
  std::unique_ptr<shared_memory_channel> channel(new shared_memory_channel(rank, size, slot_bytes));
  channel->own_pid_ = static_cast<long>(::getpid());
  channel->segments_.resize(static_cast<std::size_t>(size));
  const std::size_t segment_bytes = shm::segment_bytes(slot_bytes);
  channel->own_fd_ = static_cast<int>(::syscall(SYS_memfd_create, "cohort-gloo", static_cast<unsigned>(MFD_CLOEXEC)));
  if (channel->own_fd_ < 0 || ::ftruncate(channel->own_fd_, static_cast<off_t>(segment_bytes)) != 0) return nullptr;
  void* base = ::mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, channel->own_fd_, 0);
  if (base == MAP_FAILED) return nullptr;
  channel->segments_[static_cast<std::size_t>(rank)] = mapping(base, segment_bytes);
  auto* head = new (base) header{};
  // Random, from the kernel (not <random>: a heavy header for every trainer that includes
  // cohort header-only); where that fails, what this segment alone has (its address and pid)
  // and the time, still unlikely to be met by a descriptor of another process.
  if (::getrandom(head->token, sizeof head->token, 0) != static_cast<ssize_t>(sizeof head->token)) {
    head->token[0] = reinterpret_cast<std::uintptr_t>(base) ^ static_cast<std::uint64_t>(channel->own_pid_);
    head->token[1] = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  head->slot_bytes = slot_bytes;
  return channel;
}

COHORT_DECL std::string shared_memory_channel::published() const {
  const header& head = segments_[static_cast<std::size_t>(rank_)].head();
  return shared_memory::encode({own_pid_, own_fd_, {head.token[0], head.token[1]}, slot_bytes_});
}

COHORT_DECL bool shared_memory_channel::map_peers(const std::vector<std::string>& published,
                                                  const std::vector<peer_process>& processes) {
  namespace shm = shared_memory;
  processes_ = processes;
  peer_processes_.clear();
  peer_processes_.resize(static_cast<std::size_t>(size_));
  const std::size_t segment_bytes = shm::segment_bytes(slot_bytes_);
  const auto same_file = [](const struct stat& a, const struct stat& b) {
    return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
  };
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    shm::published_segment theirs;
    if (!shm::decode(published[static_cast<std::size_t>(peer)], theirs) || theirs.bytes != slot_bytes_) return false;
    // The record is followed read-only until the token proves it leads to the peer's
    // segment: one that leads elsewhere (another pid namespace's process under the same
    // numbers, a forged record) gets no writable descriptor of whatever it names. Only a
    // regular file of the segment's size is opened at all (O_NONBLOCK, O_NOCTTY: a FIFO or a
    // terminal that slipped in between neither blocks nor becomes this process's).
    const std::string path = text("/proc/", std::to_string(theirs.pid), "/fd/", std::to_string(theirs.fd));
    struct stat named {};
    if (::stat(path.c_str(), &named) != 0 || !S_ISREG(named.st_mode) ||
        static_cast<std::size_t>(named.st_size) != segment_bytes)
      return false;
    const shm::owned_fd readable(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    struct stat opened {};
    if (readable.fd < 0 || ::fstat(readable.fd, &opened) != 0 || !same_file(opened, named)) return false;
    void* head_only = ::mmap(nullptr, shm::header_bytes, PROT_READ, MAP_SHARED, readable.fd, 0);
    if (head_only == MAP_FAILED) return false;
    const mapping head_mapping(head_only, shm::header_bytes);
    if (head_mapping.head().token[0] != theirs.token[0] || head_mapping.head().token[1] != theirs.token[1])
      return false;
    // Proven: writable now, reopened through this process's own descriptor (the same file,
    // whatever the peer's descriptor table holds by now).
    const shm::owned_fd writable(
        ::open(text("/proc/self/fd/", std::to_string(readable.fd)).c_str(), O_RDWR | O_CLOEXEC));
    struct stat reopened {};
    if (writable.fd < 0 || ::fstat(writable.fd, &reopened) != 0 || !same_file(reopened, named)) return false;
    void* base = ::mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, writable.fd, 0);
    if (base == MAP_FAILED) return false;
    segments_[static_cast<std::size_t>(peer)] = mapping(base, segment_bytes);
    // The process that holds the segment, as a handle: its end is seen even while it is a
    // zombie its launcher has not reaped, or after its pid went to another process.
    if (theirs.pid != own_pid_) peer_processes_[static_cast<std::size_t>(peer)] = shm::process_handle(theirs.pid);
  }
  return true;
}

COHORT_DECL void shared_memory_channel::release_descriptor() noexcept {
  if (own_fd_ >= 0) ::close(own_fd_);
  own_fd_ = -1;
}

COHORT_DECL shared_memory_channel::~shared_memory_channel() {
  release_descriptor();
  auto& own = segments_[static_cast<std::size_t>(rank_)];
  if (own.base == nullptr) return;
  own.head().closed.store(1, std::memory_order_release);
  shared_memory::wake_all(own.head().posted);
}

COHORT_DECL void shared_memory_channel::shut_down() noexcept {
  shut_.store(true, std::memory_order_release);
  segments_[static_cast<std::size_t>(rank_)].head().closed.store(1, std::memory_order_release);
  // This rank's own waits sleep on its peers' words, the peers' on this rank's.
  for (const auto& segment : segments_)
    if (segment.base != nullptr) shared_memory::wake_all(segment.head().posted);
}

COHORT_DECL void shared_memory_channel::post(std::uint64_t signature) {
  header& own = segments_[static_cast<std::size_t>(rank_)].head();
  ++posted_;
  own.signature[posted_ & 1u].store(signature, std::memory_order_relaxed);
  // Sequentially consistent, with the waiter's count and its futex's look at the word: either
  // this post sees a waiter that registered, or that waiter's futex sees this post.
  own.posted.store(posted_, std::memory_order_seq_cst);
  if (own.waiters.load(std::memory_order_seq_cst) != 0) shared_memory::wake_all(own.posted);
}

COHORT_DECL void shared_memory_channel::wait_for_all(std::uint32_t phase, std::uint64_t signature,
                                                     std::chrono::milliseconds timeout,
                                                     std::chrono::microseconds spin) {
  namespace shm = shared_memory;
  std::chrono::steady_clock::time_point started{};  // read only once a wait has to sleep
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    header& theirs = segments_[static_cast<std::size_t>(peer)].head();
    const auto arrived = [&](std::uint32_t seen) {
      return shm::reached(seen, phase) &&
             (signature == 0 || theirs.signature[phase & 1u].load(std::memory_order_relaxed) == signature);
    };
    std::uint32_t seen = theirs.posted.load(std::memory_order_acquire);
    if (arrived(seen)) continue;
    const auto spin_until = std::chrono::steady_clock::now() + spin;
    do {
      for (int spin = 0; spin < 64 && !arrived(seen); ++spin) {
        shm::pause();
        seen = theirs.posted.load(std::memory_order_acquire);
      }
    } while (!arrived(seen) && std::chrono::steady_clock::now() < spin_until);
    if (arrived(seen)) continue;
    if (started == std::chrono::steady_clock::time_point{}) started = std::chrono::steady_clock::now();
    while (!arrived(seen)) {
      check_peers_or_throw(peer, phase, signature, started, timeout);
      const auto left = timeout - (std::chrono::steady_clock::now() - started);
      theirs.waiters.fetch_add(1, std::memory_order_seq_cst);
      shm::wait_while(theirs.posted, seen,
                      std::min<std::chrono::nanoseconds>(
                          shm::look_again, std::max<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(0))));
      theirs.waiters.fetch_sub(1, std::memory_order_seq_cst);
      seen = theirs.posted.load(std::memory_order_acquire);
    }
  }
}

COHORT_DECL bool shared_memory_channel::peer_process_ended(int peer) const {
  const int handle = peer_processes_.empty() ? -1 : peer_processes_[static_cast<std::size_t>(peer)].fd;
  if (handle >= 0) {
    pollfd ended{handle, POLLIN, 0};
    return ::poll(&ended, 1, 0) > 0 && (ended.revents & POLLIN) != 0;
  }
  // No handle (a kernel without pidfds): the process table, blind to a zombie.
  const long pid = processes_.empty() ? 0 : processes_[static_cast<std::size_t>(peer)].pid;
  return pid > 0 && pid != own_pid_ && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

COHORT_DECL void shared_memory_channel::check_peers_or_throw(int waiting_for, std::uint32_t phase,
                                                             std::uint64_t signature,
                                                             std::chrono::steady_clock::time_point started,
                                                             std::chrono::milliseconds timeout) const {
  if (shut_.load(std::memory_order_acquire))
    throw shared_memory_failure("this rank's connections were shut down (shared memory)", false);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    const header& theirs = segments_[static_cast<std::size_t>(peer)].head();
    // A peer posts before it closes: one that closed (or ended) after posting what this wait
    // needs of it, in this call, has not failed it: it may have finished the call and left
    // while another peer is slower (its counter is read again after the flag, which orders
    // after its posts). A later wait it cannot meet fails then. One that posted in another
    // call and closed has failed this one: it will post nothing more.
    const bool closed = theirs.closed.load(std::memory_order_acquire) != 0;
    const bool gone = !closed && peer_process_ended(peer);
    if (!closed && !gone) continue;
    if (shared_memory::reached(theirs.posted.load(std::memory_order_acquire), phase) &&
        (signature == 0 || theirs.signature[phase & 1u].load(std::memory_order_relaxed) == signature))
      continue;
    throw shared_memory_failure({}, peer,
                                gone ? "'s process is gone: connection closed by peer (shared memory)"
                                     : " closed its connection: connection closed by peer (shared memory)",
                                false);
  }
  if (std::chrono::steady_clock::now() - started >= timeout)
    throw shared_memory_failure(text("Timed out after ", format_duration(timeout), " waiting for "), waiting_for,
                                text(" in shared memory (phase ", std::to_string(phase), ")"), true);
}

namespace shared_memory {

// The reduction of one part: out = parts[first] (op) every other rank's part, in rank order,
// the last addition dividing when averaging. `out` may be parts[first] (an in-place
// reduce-scatter).
inline void reduce_part(std::byte* out, std::span<const std::byte* const> parts, std::size_t first, std::size_t n,
                        const shared_memory_channel::reduction& reduce) {
  // Rank `first`'s contribution, then every other rank's in rank order: an index skipped in
  // place rather than a list of the others built per chunk (an allocation on the hot path).
  const std::byte* left = parts[first];
  std::size_t left_to_add = parts.size() - 1;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    if (p == first) continue;
    if (--left_to_add == 0 && reduce.divisor > 1)
      reduce.divided(out, left, parts[p], n, reduce.divisor);
    else
      reduce.combine(out, left, parts[p], n);
    left = out;
  }
}

}  // namespace shared_memory

COHORT_DECL void shared_memory_channel::all_reduce(const void* in, void* out, std::size_t count, std::size_t element,
                                                   const reduction& reduce, std::uint64_t signature,
                                                   std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  // Decided by the call's size, the same on every rank.
  if (count * element <= small_bytes)
    return all_reduce_small(source, target, count, element, reduce, signature, timeout);
  const std::size_t chunk = std::max<std::size_t>(1, slot_bytes_ / element);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  std::vector<const std::byte*> parts(world);
  for (std::size_t first = 0; first < count; first += chunk) {
    const std::size_t m = std::min(chunk, count - first);
    // Rank p reduces elements [lo(p), lo(p + 1)) of the chunk.
    const auto lo = [&](std::size_t p) { return m * p / world; };
    const std::size_t mine_begin = lo(me), mine_end = lo(me + 1);
    const std::byte* chunk_in = source + first * element;
    std::byte* chunk_out = target + first * element;
    // 1: the peers' parts of this rank's input into its slot (its own part stays: its own
    // reduction reads it from the input).
    wait_for_all(posted_, 0, timeout, shared_memory::spin_chunk);
    std::memcpy(own_slot(), chunk_in, mine_begin * element);
    std::memcpy(own_slot() + mine_end * element, chunk_in + mine_end * element, (m - mine_end) * element);
    post(signature);
    wait_for_all(posted_, signature, timeout, shared_memory::spin_chunk);
    // 2: this rank's part reduced, into its slot (where its own part is not) and its output.
    if (mine_end > mine_begin) {
      for (std::size_t p = 0; p < world; ++p)
        parts[p] = (p == me ? chunk_in : peer_slot(static_cast<int>(p))) + mine_begin * element;
      std::byte* reduced = own_slot() + mine_begin * element;
      if (reduce.sum_in_rank_order != nullptr)
        reduce.sum_in_rank_order(reduced, reinterpret_cast<const void* const*>(parts.data()), world,
                                 mine_end - mine_begin, reduce.divisor);
      else
        shared_memory::reduce_part(reduced, parts, me, mine_end - mine_begin, reduce);
      std::memcpy(chunk_out + mine_begin * element, reduced, (mine_end - mine_begin) * element);
    }
    post(signature);
    wait_for_all(posted_, signature, timeout, shared_memory::spin_chunk);
    // 3: the peers' reduced parts, from their slots.
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(chunk_out + lo(p) * element, peer_slot(static_cast<int>(p)) + lo(p) * element,
                    (lo(p + 1) - lo(p)) * element);
    post(signature);
  }
}

COHORT_DECL void shared_memory_channel::all_reduce_small(const std::byte* in, std::byte* out, std::size_t count,
                                                         std::size_t element, const reduction& reduce,
                                                         std::uint64_t signature, std::chrono::milliseconds timeout) {
  const std::size_t world = static_cast<std::size_t>(size_);
  // Every peer has posted this rank's last phase (free after a small call, which waited for
  // it): none is more than one phase ahead, and none still reads the small slot written next.
  wait_for_all(posted_, 0, timeout, shared_memory::spin_small);
  std::memcpy(segments_[static_cast<std::size_t>(rank_)].small_slot(slot_bytes_, posted_ + 1), in, count * element);
  post(signature);
  wait_for_all(posted_, signature, timeout, shared_memory::spin_small);
  // Every contribution from the slots (this rank's too: `out` may be `in`), in rank order.
  std::vector<const std::byte*> parts(world);
  for (std::size_t p = 0; p < world; ++p) parts[p] = segments_[p].small_slot(slot_bytes_, posted_);
  if (reduce.sum_in_rank_order != nullptr)
    reduce.sum_in_rank_order(out, reinterpret_cast<const void* const*>(parts.data()), world, count, reduce.divisor);
  else
    shared_memory::reduce_part(out, parts, 0, count, reduce);
}

COHORT_DECL void shared_memory_channel::reduce_scatter(const void* in, void* out, std::size_t count_per_rank,
                                                       std::size_t element, const reduction& reduce,
                                                       std::uint64_t signature, std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  const std::size_t block = std::max<std::size_t>(1, slot_bytes_ / (element * world));
  std::vector<const std::byte*> parts(world);
  for (std::size_t first = 0; first < count_per_rank; first += block) {
    const std::size_t m = std::min(block, count_per_rank - first);
    // 1: every peer's share of this rank's input, side by side in its slot.
    wait_for_all(posted_, 0, timeout, shared_memory::spin_chunk);
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(own_slot() + p * m * element, source + (p * count_per_rank + first) * element, m * element);
    post(signature);
    wait_for_all(posted_, signature, timeout, shared_memory::spin_chunk);
    // 2: this rank's share, reduced from its input and the peers' slots. (Out may be inside
    // the input: at most the elements this chunk has read already.)
    for (std::size_t p = 0; p < world; ++p)
      parts[p] = p == me ? source + (me * count_per_rank + first) * element
                         : peer_slot(static_cast<int>(p)) + me * m * element;
    if (reduce.sum_in_rank_order != nullptr)
      reduce.sum_in_rank_order(target + first * element, reinterpret_cast<const void* const*>(parts.data()), world, m,
                               reduce.divisor);
    else
      shared_memory::reduce_part(target + first * element, parts, me, m, reduce);
    post(signature);
  }
}

COHORT_DECL void shared_memory_channel::all_gather(const void* in, void* out, std::size_t count_per_rank,
                                                   std::size_t element, std::uint64_t signature,
                                                   std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  const std::size_t block = std::max<std::size_t>(1, slot_bytes_ / element);
  std::byte* own_block = target + me * count_per_rank * element;
  if (own_block != source) std::memcpy(own_block, source, count_per_rank * element);
  for (std::size_t first = 0; first < count_per_rank; first += block) {
    const std::size_t m = std::min(block, count_per_rank - first);
    wait_for_all(posted_, 0, timeout, shared_memory::spin_chunk);
    std::memcpy(own_slot(), source + first * element, m * element);
    post(signature);
    wait_for_all(posted_, signature, timeout, shared_memory::spin_chunk);
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(target + (p * count_per_rank + first) * element, peer_slot(static_cast<int>(p)), m * element);
    post(signature);
  }
}

COHORT_DECL void shared_memory_channel::all_to_all(const void* in, void* out, std::size_t count_per_rank,
                                                   std::size_t element, std::uint64_t signature,
                                                   std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  const std::size_t block = std::max<std::size_t>(1, slot_bytes_ / (element * world));
  if (count_per_rank == 0) return;  // no round: nothing posted, on every rank alike
  std::memcpy(target + me * count_per_rank * element, source + me * count_per_rank * element, count_per_rank * element);
  for (std::size_t first = 0; first < count_per_rank; first += block) {
    const std::size_t m = std::min(block, count_per_rank - first);
    wait_for_all(posted_, 0, timeout, shared_memory::spin_chunk);
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(own_slot() + p * m * element, source + (p * count_per_rank + first) * element, m * element);
    post(signature);
    wait_for_all(posted_, signature, timeout, shared_memory::spin_chunk);
    for (std::size_t q = 0; q < world; ++q)
      if (q != me)
        std::memcpy(target + (q * count_per_rank + first) * element, peer_slot(static_cast<int>(q)) + me * m * element,
                    m * element);
    post(signature);
  }
}

}  // namespace cohort::inline v0::detail
