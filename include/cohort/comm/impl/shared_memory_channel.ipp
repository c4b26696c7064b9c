#pragma once
// cohort/comm/detail/shared_memory_channel.hpp's definitions: inline there when header-only,
// compiled once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION.

#include <fcntl.h>
#include <linux/futex.h>
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
  std::atomic<std::uint64_t> signature{0};           // the call the owner's last phase belongs to
};

namespace shared_memory {

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                  std::atomic<std::uint32_t>::is_always_lock_free,
              "a futex word must be a plain 32-bit word");

// The slot starts on the page after the header.
inline constexpr std::size_t header_bytes = 4096;
inline constexpr std::string_view format = "cohort-shm-1";
// How long a futex wait sleeps before it looks again at what can end the wait (a peer gone,
// the timeout); a post wakes it at once.
inline constexpr std::chrono::milliseconds look_again{100};

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

// A file descriptor owned for the length of a scope.
struct owned_fd {
  int fd = -1;
  owned_fd() = default;
  explicit owned_fd(int f) : fd(f) {}
  owned_fd(const owned_fd&) = delete;
  owned_fd& operator=(const owned_fd&) = delete;
  ~owned_fd() {
    if (fd >= 0) ::close(fd);
  }
};

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

COHORT_DECL auto shared_memory_channel::create(int rank, int size, std::size_t slot_bytes)
    -> std::unique_ptr<shared_memory_channel> {
  namespace shm = shared_memory;
  std::unique_ptr<shared_memory_channel> channel(new shared_memory_channel(rank, size, slot_bytes));
  channel->own_pid_ = static_cast<long>(::getpid());
  channel->segments_.resize(static_cast<std::size_t>(size));
  const std::size_t segment_bytes = shm::header_bytes + slot_bytes;
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
  const std::size_t segment_bytes = shm::header_bytes + slot_bytes_;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    shm::published_segment theirs;
    if (!shm::decode(published[static_cast<std::size_t>(peer)], theirs) || theirs.bytes != slot_bytes_) return false;
    const std::string path = text("/proc/", std::to_string(theirs.pid), "/fd/", std::to_string(theirs.fd));
    const shm::owned_fd opened(::open(path.c_str(), O_RDWR | O_CLOEXEC));
    struct stat status {};
    if (opened.fd < 0 || ::fstat(opened.fd, &status) != 0 || static_cast<std::size_t>(status.st_size) != segment_bytes)
      return false;
    void* base = ::mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened.fd, 0);
    if (base == MAP_FAILED) return false;
    segments_[static_cast<std::size_t>(peer)] = mapping(base, segment_bytes);
    // A token that differs: the path led to another process's descriptor (another pid
    // namespace under the same host name), not to this group's segment.
    const header& head = segments_[static_cast<std::size_t>(peer)].head();
    if (head.token[0] != theirs.token[0] || head.token[1] != theirs.token[1]) return false;
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

COHORT_DECL void shared_memory_channel::post() {
  header& own = segments_[static_cast<std::size_t>(rank_)].head();
  own.posted.store(++posted_, std::memory_order_release);
  shared_memory::wake_all(own.posted);
}

COHORT_DECL void shared_memory_channel::wait_for_all(std::uint32_t phase, std::uint64_t signature,
                                                     std::chrono::milliseconds timeout) {
  namespace shm = shared_memory;
  const auto started = std::chrono::steady_clock::now();
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    header& theirs = segments_[static_cast<std::size_t>(peer)].head();
    const auto arrived = [&](std::uint32_t seen) {
      return shm::reached(seen, phase) &&
             (signature == 0 || theirs.signature.load(std::memory_order_relaxed) == signature);
    };
    // A peer a moment behind posts within microseconds: a short spin saves a sleep and a
    // wake-up, a longer one would take the core from the trainer's own threads.
    std::uint32_t seen = theirs.posted.load(std::memory_order_acquire);
    for (int spin = 0; spin < 256 && !arrived(seen); ++spin) {
      shm::pause();
      seen = theirs.posted.load(std::memory_order_acquire);
    }
    while (!arrived(seen)) {
      check_peers_or_throw(peer, phase, signature, started, timeout);
      const auto left = timeout - (std::chrono::steady_clock::now() - started);
      shm::wait_while(theirs.posted, seen,
                      std::min<std::chrono::nanoseconds>(
                          shm::look_again, std::max<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(0))));
      seen = theirs.posted.load(std::memory_order_acquire);
    }
  }
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
    const long pid = processes_[static_cast<std::size_t>(peer)].pid;
    const bool gone =
        !closed && pid > 0 && pid != own_pid_ && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (!closed && !gone) continue;
    if (shared_memory::reached(theirs.posted.load(std::memory_order_acquire), phase) &&
        (signature == 0 || theirs.signature.load(std::memory_order_relaxed) == signature))
      continue;
    throw shared_memory_failure(text("rank ", std::to_string(peer),
                                     gone ? "'s process is gone: connection closed by peer (shared memory)"
                                          : " closed its connection: connection closed by peer (shared memory)"),
                                false);
  }
  if (std::chrono::steady_clock::now() - started >= timeout)
    throw shared_memory_failure(
        text("Timed out after ", format_duration(timeout), " waiting for rank ", std::to_string(waiting_for),
             " in shared memory (phase ", std::to_string(phase), ")"),
        true);
}

namespace shared_memory {

// The reduction of one part: out = own (op) the peers' parts, in rank order, the last
// addition dividing when averaging. `out` may be `own` (an in-place reduce-scatter).
inline void reduce_part(std::byte* out, const std::byte* own, std::span<const std::byte* const> peers, std::size_t n,
                        const shared_memory_channel::reduction& reduce) {
  for (std::size_t i = 0; i < peers.size(); ++i) {
    const std::byte* left = i == 0 ? own : out;
    if (i + 1 == peers.size() && reduce.divisor > 1)
      reduce.divided(out, left, peers[i], n, reduce.divisor);
    else
      reduce.combine(out, left, peers[i], n);
  }
}

}  // namespace shared_memory

COHORT_DECL void shared_memory_channel::all_reduce(const void* in, void* out, std::size_t count, std::size_t element,
                                                   const reduction& reduce, std::uint64_t signature,
                                                   std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  const std::size_t chunk = std::max<std::size_t>(1, slot_bytes_ / element);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  std::vector<const std::byte*> parts(world - 1);
  header& own = segments_[me].head();
  for (std::size_t first = 0; first < count; first += chunk) {
    const std::size_t m = std::min(chunk, count - first);
    // Rank p reduces elements [lo(p), lo(p + 1)) of the chunk.
    const auto lo = [&](std::size_t p) { return m * p / world; };
    const std::size_t mine_begin = lo(me), mine_end = lo(me + 1);
    const std::byte* chunk_in = source + first * element;
    std::byte* chunk_out = target + first * element;
    // 1: the peers' parts of this rank's input into its slot (its own part stays: its own
    // reduction reads it from the input).
    wait_for_all(posted_, 0, timeout);
    own.signature.store(signature, std::memory_order_relaxed);
    std::memcpy(own_slot(), chunk_in, mine_begin * element);
    std::memcpy(own_slot() + mine_end * element, chunk_in + mine_end * element, (m - mine_end) * element);
    post();
    wait_for_all(posted_, signature, timeout);
    // 2: this rank's part reduced, into its slot (where its own part is not) and its output.
    if (mine_end > mine_begin) {
      for (std::size_t p = 0, i = 0; p < world; ++p)
        if (p != me) parts[i++] = peer_slot(static_cast<int>(p)) + mine_begin * element;
      std::byte* reduced = own_slot() + mine_begin * element;
      shared_memory::reduce_part(reduced, chunk_in + mine_begin * element, parts, mine_end - mine_begin, reduce);
      std::memcpy(chunk_out + mine_begin * element, reduced, (mine_end - mine_begin) * element);
    }
    post();
    wait_for_all(posted_, signature, timeout);
    // 3: the peers' reduced parts, from their slots.
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(chunk_out + lo(p) * element, peer_slot(static_cast<int>(p)) + lo(p) * element,
                    (lo(p + 1) - lo(p)) * element);
    post();
  }
}

COHORT_DECL void shared_memory_channel::reduce_scatter(const void* in, void* out, std::size_t count_per_rank,
                                                       std::size_t element, const reduction& reduce,
                                                       std::uint64_t signature, std::chrono::milliseconds timeout) {
  const auto* source = static_cast<const std::byte*>(in);
  auto* target = static_cast<std::byte*>(out);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t me = static_cast<std::size_t>(rank_);
  const std::size_t block = std::max<std::size_t>(1, slot_bytes_ / (element * world));
  std::vector<const std::byte*> parts(world - 1);
  header& own = segments_[me].head();
  for (std::size_t first = 0; first < count_per_rank; first += block) {
    const std::size_t m = std::min(block, count_per_rank - first);
    // 1: every peer's share of this rank's input, side by side in its slot.
    wait_for_all(posted_, 0, timeout);
    own.signature.store(signature, std::memory_order_relaxed);
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(own_slot() + p * m * element, source + (p * count_per_rank + first) * element, m * element);
    post();
    wait_for_all(posted_, signature, timeout);
    // 2: this rank's share, reduced from its input and the peers' slots. (Out may be inside
    // the input: at most the elements this chunk has read already.)
    for (std::size_t p = 0, i = 0; p < world; ++p)
      if (p != me) parts[i++] = peer_slot(static_cast<int>(p)) + me * m * element;
    shared_memory::reduce_part(target + first * element, source + (me * count_per_rank + first) * element, parts, m,
                               reduce);
    post();
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
  header& own = segments_[me].head();
  std::byte* own_block = target + me * count_per_rank * element;
  if (own_block != source) std::memcpy(own_block, source, count_per_rank * element);
  for (std::size_t first = 0; first < count_per_rank; first += block) {
    const std::size_t m = std::min(block, count_per_rank - first);
    wait_for_all(posted_, 0, timeout);
    own.signature.store(signature, std::memory_order_relaxed);
    std::memcpy(own_slot(), source + first * element, m * element);
    post();
    wait_for_all(posted_, signature, timeout);
    for (std::size_t p = 0; p < world; ++p)
      if (p != me)
        std::memcpy(target + (p * count_per_rank + first) * element, peer_slot(static_cast<int>(p)), m * element);
    post();
  }
}

}  // namespace cohort::inline v0::detail
