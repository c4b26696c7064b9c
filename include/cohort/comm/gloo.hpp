#pragma once
// Host backend on Gloo (Debian libgloo-dev): collectives over TCP on host memory, and over
// shared memory between the ranks of one host for the bulk collectives (all-reduce,
// reduce-scatter, all-gather; cohort/comm/detail/shared_memory_channel.hpp).
//
// Each backend instance owns one Gloo context and one FIFO worker thread; every call is
// queued on the worker and returns a work handle at once, so collectives run
// asynchronously and complete in issue order. Gloo has no half/bfloat16 arithmetic and
// no averaging; cohort supplies both. reduce_scatter is an all-to-all followed by a local
// reduction, which puts (n-1)/n of the data on the wire, as a bandwidth-optimal
// reduce-scatter does, instead of all-reducing everything and keeping a slice.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

// Gloo's own types appear here only by name, so that a program built with
// COHORT_SEPARATE_COMPILATION does not parse Gloo's headers in every translation unit
// (they cost as much as twenty standard headers); cohort/comm/impl/gloo.ipp includes them.
namespace gloo {
class Context;
namespace transport {
class Context;
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace cohort::inline v0 {

namespace detail {

// An element of N bytes: what Gloo's buffer setters need to know of a dtype.
template <std::size_t N>
struct element_bytes {
  unsigned char bytes[N];
};

class shared_memory_channel;
// The engine's worker queue, by name only: its waits are compiled with the engine (gloo.ipp).
template <class Task>
class fifo_worker;

// A posted point-to-point operation, waited for separately (see gloo::send).
struct gloo_p2p {
  std::mutex mutex;  // guards buffer against abort() from the group's destructor
  std::unique_ptr<::gloo::transport::UnboundBuffer> buffer;
  std::uint64_t post_sequence = 0;
  bool sending = false;
  bool debug = false;  // COHORT_DEBUG: the completion compares both sides first

  COHORT_DECL gloo_p2p();
  COHORT_DECL ~gloo_p2p();
  // Ends a wait that no peer will ever match (the group is going away).
  COHORT_DECL void abort();
};

// What a rank published at the rendezvous (gloo::connect): where it runs and listens, for
// connecting and for errors and failure reports that name it.
struct gloo_peer {
  std::string host;           // its gethostname()
  long pid = 0;               // its process id
  std::string process_table;  // where `pid` means something: boot id and pid namespace (see process_table_id)
  std::string address;        // the numeric address it listens on
  std::vector<char> pairs;    // its pairs' addresses (Gloo's bytes), one per other rank in order
  std::string shared_memory;  // where its shared-memory segment is; empty: it has none (TCP only)
};

struct gloo_task {
  enum class kind : std::uint8_t {
    all_reduce,
    reduce_scatter,
    all_gather,
    broadcast,
    all_to_all,
    send,
    recv,
    barrier,
    function,
    p2p_wait
  };
  kind what = kind::function;
  dtype type = dtype::float32;
  op reduce = op::sum;
  const void* in = nullptr;
  void* out = nullptr;
  std::size_t count = 0;  // elements (per rank for reduce_scatter, all_gather, all_to_all)
  int peer = 0;           // root for broadcast, peer for send/recv
  std::uint64_t tag = 0;
  // The call's number in its group: collectives (and barriers) count 1, 2, ... in issue
  // order; point-to-point calls count per (peer, tag, direction). 0 for host tasks.
  std::uint64_t sequence = 0;
  std::uint64_t record = 0;  // the call's id in the group's flight recorder (0: not recorded)
  call_label context;        // the group's call_context when the call was issued
  std::function<void()> fn;
  std::shared_ptr<gloo_p2p> p2p;
};

}  // namespace detail

class gloo {
 public:
  static constexpr memory_space space = memory_space::host;
  static constexpr std::string_view name = "gloo";
  // Host memory has no streams: the caller's order is its own thread. Where a device backend
  // orders work on streams, this one blocks or does nothing (see wait_for_caller, work's
  // make_stream_wait), so algorithms read the same on both.
  using stream_type = std::nullptr_t;

  struct options {
    // Bounds every collective and the rendezvous: a peer that never arrives or dies turns
    // into a timeout_error on every other rank after at most this long.
    std::chrono::milliseconds timeout{std::chrono::minutes(10)};
    // Cross-rank checks of every call's signature, and of collectives inside on_main.
    // Also turned on by the environment variable COHORT_DEBUG=1.
    bool debug_checks = false;
    // Address this rank listens on (a name or a numeric address), else the address of
    // `interface`, else of GLOO_SOCKET_IFNAME's interface. All empty: 127.0.0.1 on one node;
    // across nodes the local address that routes to MASTER_ADDR (cohort/comm/detail/host_address.hpp).
    std::string hostname;
    std::string interface;
    // The flight recorder's ring: the last this many calls, written to
    // `trace_dir`/rank<R>.<group>.json when a call fails. 0 turns recording off.
    std::size_t flight_recorder_entries = 2048;
    // Empty: the environment variable COHORT_TRACE_DIR; unset: no trace files.
    std::string trace_dir;
    // How often the watchdog looks for failures no cohort call has reported; 0: no watchdog.
    // Every Gloo call is bounded by `timeout` on its own, so here the watchdog acts on a
    // failed call nobody waits for within `timeout` (see async_error_handling).
    std::chrono::milliseconds watchdog_interval{std::chrono::seconds(1)};
    async_error_handling on_async_error = async_error_handling::abort_process;
    // How often the watchdog of a job's first group reads the job's collided mark: a process
    // of another job that cannot be told apart from this one (no distinct id) may claim a rank
    // first, train with this job's ranks, and be found out only when this job's own rank comes
    // later and marks the job. The group then fails on every rank naming the collision. One
    // store request a rank each time (6 a minute by default), on a connection of its own made
    // at the first check. 0: never (run_ranks' verdict still reads the mark at the run's end).
    std::chrono::milliseconds collision_check_interval{std::chrono::seconds(10)};
    // A collective not complete after this long compares what every rank says it does (their
    // status keys; then every max(this, 5 s)): ranks in different calls, or one that left or
    // failed, end it on every rank within seconds, naming each rank's call; a rank only late
    // is waited for. 0: never. Needs the watchdog (failure_report.hpp, progress_monitor).
    std::chrono::milliseconds compare_calls_after{std::chrono::seconds(3)};
    // How often a waiting call (and the rendezvous) prints what it waits for and for whom; 0:
    // never. Default: COHORT_PROGRESS_INTERVAL (seconds), else 30 s.
    std::chrono::milliseconds progress_interval = detail::default_progress_interval();
    // When every rank of the group runs on one host, all-reduce, reduce-scatter and all-gather
    // meet in shared memory rather than in TCP over loopback (the others stay on Gloo): the
    // same results, without the kernel's copies and system calls. Used only where every rank
    // asks for it and can map every peer's segment; off here or COHORT_GLOO_SHARED_MEMORY=0 on
    // any rank keeps the whole group on TCP.
    bool shared_memory = true;
  };

  // The engine's own worker queue: its work handles point into it.
 private:
  using worker_type = detail::fifo_worker<detail::gloo_task>;

 public:
  // A completion handle: (worker, sequence number). Copyable; an empty handle is complete.
  class work {
   public:
    work() = default;
    work(std::shared_ptr<worker_type> worker, std::uint64_t seq) : worker_(std::move(worker)), seq_(seq) {}

    // True when complete; rethrows the failure of a failed operation.
    COHORT_COLD bool test() const;
    // Blocks until complete. Engine operations are bounded by the group's timeout, so this
    // returns or throws within it.
    COHORT_COLD void wait() const;
    // False when still running after `timeout`.
    COHORT_COLD bool wait_for(std::chrono::milliseconds timeout) const;
    std::uint64_t sequence() const noexcept { return seq_; }
    // The caller's order waits for this work: on the host, the calling thread blocks.
    COHORT_COLD void make_stream_wait(stream_type) const { wait(); }

   private:
    COHORT_COLD void rethrow_failure() const;
    std::shared_ptr<worker_type> worker_;
    std::uint64_t seq_ = 0;
  };

  // Rendezvous through `store` (keys under the store's own prefix) and connect a full mesh.
  COHORT_COLD gloo(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts);

  // A new context over an existing device (subgroups): `world_ranks`, the world rank of each
  // of its ranks in order (its size), is what its messages name them by.
  COHORT_COLD gloo(const gloo& parent, std::shared_ptr<cohort::store> store, int rank, std::vector<int> world_ranks);

  gloo(const gloo&) = delete;
  gloo& operator=(const gloo&) = delete;
  // Finishes queued work first: the worker's tasks refer to this context.
  COHORT_DECL ~gloo();

  // Subgroup of a split (process_group::split did the bookkeeping): a new Gloo context over
  // the same device, rendezvousing under the subgroup's store prefix. `members`: the parent's
  // rank of each of its ranks, in order.
  COHORT_COLD static std::unique_ptr<gloo> split(gloo& parent, std::shared_ptr<cohort::store> sub_store, int color,
                                                 int /*key*/, int new_rank, const std::vector<int>& members);

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  // The address this rank listens on and published at the rendezvous (numeric).
  const std::string& address() const noexcept { return address_; }
  const options& settings() const noexcept { return options_; }
  // How its messages name its ranks: a subgroup's by world rank, with the group.
  const detail::rank_naming& names() const noexcept { return names_; }
  // The group's last calls (see options::flight_recorder_entries).
  const flight_recorder& recorder() const noexcept { return recorder_; }
  // Writes the flight recorder to `directory` now (as a failure does when trace_dir is set);
  // returns the file's path, empty when it could not be written.
  COHORT_COLD [[gnu::cold]] std::string write_trace(const std::string& directory, std::string_view reason) const;
  // Cross-rank checks of point-to-point pairs (process_group::set_debug_checks sets this).
  void set_debug_checks(bool on) noexcept { debug_checks_.store(on, std::memory_order_relaxed); }
  // The context recorded with each call issued from now on (process_group::call_context).
  const call_label& call_context() const noexcept { return call_context_; }
  void set_call_context(const call_label& label) noexcept { call_context_ = label; }
  const std::shared_ptr<::gloo::Context>& context() const noexcept { return context_; }
  // Whether all-reduce, reduce-scatter and all-gather go through shared memory (the whole
  // group on this host, options::shared_memory on every rank); false: Gloo's TCP.
  bool uses_shared_memory() const noexcept { return shared_memory_ != nullptr; }

  // --- collectives (type-erased; process_group<gloo> adds the typed, checked surface) -----
  COHORT_COLD work all_reduce(const void* in, void* out, std::size_t count, dtype type, op reduce) {
    return submit(task(task_kind::all_reduce, type, reduce, in, out, count));
  }
  COHORT_COLD work reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype type, op reduce) {
    return submit(task(task_kind::reduce_scatter, type, reduce, in, out, count_per_rank));
  }
  COHORT_COLD work all_gather(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return submit(task(task_kind::all_gather, type, op::sum, in, out, count_per_rank));
  }
  COHORT_COLD work broadcast(void* data, std::size_t count, dtype type, int root) {
    return submit(task(task_kind::broadcast, type, op::sum, nullptr, data, count, root));
  }
  COHORT_COLD work all_to_all(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return submit(task(task_kind::all_to_all, type, op::sum, in, out, count_per_rank));
  }
  // Point-to-point operations are posted in issue order on the group's worker, after every
  // earlier call, and never block it: a blocking send in the queue would deadlock a ring of
  // ranks that all send before they receive. A second worker waits for their completion, in
  // posting order; the returned work completes when the peer has matched the operation.
  COHORT_COLD work send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t tag) {
    return post(task(task_kind::send, type, op::sum, data, nullptr, count, peer, tag));
  }
  COHORT_COLD work recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t tag) {
    return post(task(task_kind::recv, type, op::sum, nullptr, data, count, peer, tag));
  }
  COHORT_COLD work barrier() { return submit(task(task_kind::barrier)); }
  // Grouped calls (process_group::grouped): the worker runs calls one after another in
  // issue order anyway, so a group changes nothing on Gloo.
  void group_start() noexcept {}
  void group_end() noexcept {}

  // --- ordering and memory: what algorithms written once over any backend need ----------
  // Runs fn on the worker after everything queued before it (host "kernels").
  COHORT_COLD work enqueue(std::function<void()> fn);
  // Completes when everything queued so far has completed.
  COHORT_COLD work record() { return submit(task(task_kind::function)); }
  // The group's own order, as a stream: the worker (make_stream_wait on it blocks).
  stream_type stream() const noexcept { return nullptr; }
  // Later work waits for what the caller queued: on the host the caller's work is done
  // when it calls, so there is nothing to wait for.
  void wait_for_caller(stream_type) noexcept {}

  static void* allocate(std::size_t bytes) { return ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{64}); }
  static void deallocate(void* pointer, std::size_t /*bytes*/) noexcept {
    ::operator delete (pointer, std::align_val_t{64});
  }
  COHORT_COLD work copy(void* destination, const void* source, std::size_t bytes);

 private:
  using task_kind = detail::gloo_task::kind;

  // Chooses the address to listen on (detail::choose_listen_address) into `address`; asks
  // `rendezvous` where the other nodes reached this host where MASTER_ADDR cannot say.
  COHORT_COLD static std::shared_ptr<::gloo::transport::Device> make_device(const launch_env& env, const options& opts,
                                                                            cohort::store& rendezvous,
                                                                            std::string& address);

  // The rendezvous: publishes this rank's pair addresses, reads every rank's with one
  // multi_get, and connects the full mesh (connect_mesh), all within options.timeout.
  COHORT_COLD void connect(std::shared_ptr<cohort::store> store);
  COHORT_COLD void connect_mesh(::gloo::transport::Context& transport, std::chrono::steady_clock::time_point deadline);
  // Keeps shared_memory_ where every rank is on this host and mapped every peer's segment
  // (they agree over the mesh); drops it otherwise, on every rank alike.
  COHORT_COLD void agree_on_shared_memory(const detail::gloo_peer& mine);
  // The address `peer` published for its pair with this rank (Gloo's bytes).
  COHORT_COLD std::vector<char> peer_pair_address(int peer) const;
  // "rank 3 published 10.0.0.4 (host node1, pid 812, its pair for this rank at [10.0.0.4]:40123)";
  // a subgroup's "world rank 3 (group rank 1) published ...".
  COHORT_COLD [[gnu::cold]] std::string describe_peer(int peer) const;
  COHORT_COLD void start_watchdog();
  // The watchdog's check: the progress monitor on the call that waits (a disagreement ends
  // it), then a failed call no wait or test reported within `timeout` (the failure it acts on).
  COHORT_COLD std::exception_ptr watch();
  // The job's collided mark, read at most every collision_check_interval (a job's first group
  // only): the collision's error once found, else null (a store out of reach included).
  COHORT_COLD std::exception_ptr job_collision();
  COHORT_COLD std::exception_ptr unreported_failure() const;
  // This rank's status now (issued and completed collectives), for the status board.
  COHORT_DECL detail::rank_status status(detail::rank_activity activity) const;
  // Ends every wait on this group's connections, here and on the peers (which see them close),
  // by shutting its sockets down: Gloo offers no abort of a running collective.
  COHORT_COLD void abort_transport() noexcept;

  COHORT_COLD static detail::gloo_task task(task_kind what, dtype type = dtype::uint8, op reduce = op::sum,
                                            const void* in = nullptr, void* out = nullptr, std::size_t count = 0,
                                            int peer = 0, std::uint64_t tag = 0);

  COHORT_COLD work submit(detail::gloo_task queued);

  COHORT_COLD work post(detail::gloo_task operation);

  COHORT_COLD static call_record as_call(const detail::gloo_task& task);
  COHORT_COLD static std::string describe(const detail::gloo_task& task);

  COHORT_COLD void run(detail::gloo_task& task);
  // The cohort error a failed engine call becomes, naming the call and the rank at fault.
  COHORT_COLD [[gnu::cold]] std::exception_ptr explain(const detail::gloo_task& task, std::exception_ptr raised);
  // The first failure of the group writes its flight recorder (when trace_dir is set).
  COHORT_COLD [[gnu::cold]] void keep_trace(const std::exception_ptr& failure);
  // COHORT_DEBUG: both sides of a point-to-point pair publish what they move; the
  // completion (never the caller: a ring of sends would deadlock) compares them.
  COHORT_COLD [[gnu::cold]] std::string p2p_debug_key(const detail::gloo_task& task, bool mine) const;
  COHORT_COLD [[gnu::cold]] void check_p2p_pair(const detail::gloo_task& task);

  COHORT_COLD void execute(detail::gloo_task& task);

  // The collectives for elements of sizeof(T) bytes (T: detail::element_bytes<N>).
  template <class T>
  void execute_sized(detail::gloo_task& task);
  // A 16-bit float's all-reduce sum or average (detail::rank_order_sum_function): every
  // contribution in rank order, added in float, rounded once.
  COHORT_COLD void all_reduce_in_rank_order(detail::gloo_task& task);
  // The bulk collectives through shared_memory_; false for the others, which stay on Gloo.
  COHORT_COLD bool execute_in_shared_memory(detail::gloo_task& task);
  // The error a failed transport call becomes (Gloo's I/O failure, or shared memory's):
  // the monitor's verdict, the culprit, and whether it timed out.
  COHORT_COLD [[gnu::cold]] std::exception_ptr explain_transport_failure(const detail::gloo_task& task,
                                                                         const std::string& what, bool timed_out);

  // Gloo matches messages by slot, and a message larger than the receiver expects aborts
  // the process from Gloo's I/O thread. Deriving the tag from what the call moves (kind,
  // dtype, count, op, root) and from its sequence number makes mismatched calls use
  // different slots: they never match, and the mismatch surfaces as an error on every rank
  // instead of a crash, or of call n on one rank meeting call n+1 of another.
  COHORT_COLD static std::uint64_t signature(const detail::gloo_task& task);
  COHORT_COLD static std::uint32_t collective_tag(const detail::gloo_task& task) {
    return static_cast<std::uint32_t>(signature(task) & 0x7fffffffu);
  }

  COHORT_COLD [[gnu::cold]] [[noreturn]] void throw_timeout(const detail::gloo_task& task);

  // After a call failed: who is at fault (detail::name_the_culprit for collectives; a
  // point-to-point call whose connection closed names its peer).
  COHORT_COLD [[gnu::cold]] std::string name_the_culprit(const detail::gloo_task& task, bool connection_lost);
  // What `peer` is, without its help (for a rank that sent no failure report): its process
  // on this host and the state of its pair; asked before abort_transport closes the pairs.
  COHORT_COLD [[gnu::cold]] detail::peer_status probe_peer(int peer) const;
  // Whether a remote peer's host answers a connection attempt (unreachable, or alive).
  COHORT_COLD [[gnu::cold]] detail::peer_status probe_host(int peer) const;
  // Which ranks never published their rendezvous address (a rendezvous that timed out).
  COHORT_COLD [[gnu::cold]] std::string missing_at_rendezvous(cohort::store& store) const;
  // " (world of 4; this rank published 10.0.0.1)", a subgroup's " (group of 2; ...)": what the
  // rendezvous' errors add.
  COHORT_COLD [[gnu::cold]] std::string rendezvous_context() const;

  // Point-to-point slots carry the user tag and the message size (see signature), in a
  // range of their own, away from the slots Gloo's collectives use.
  COHORT_COLD static std::uint64_t point_to_point_slot(const detail::gloo_task& task) {
    return (1ull << 63) | (signature(task) >> 1);
  }

  COHORT_COLD std::vector<std::byte>& scratch_bytes(std::size_t bytes);

  int rank_;
  int size_;
  int world_rank_;  // rank_ in the world group: what this rank's errors and lines say
  // How its messages name its ranks: a subgroup's (made by split) by world rank, with the group.
  detail::rank_naming names_;
  options options_;
  std::string address_;  // what this rank listens on and publishes (see make_device)
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  std::shared_ptr<cohort::store> store_;  // the group's namespace, for failure reports
  std::vector<detail::gloo_peer> peers_;  // what every rank published (connect)
  std::atomic<std::uint64_t> collectives_issued_{0};
  flight_recorder recorder_{options_.flight_recorder_entries};
  std::atomic<bool> trace_written_{false};
  std::atomic<bool> debug_checks_{false};
  std::map<std::tuple<int, std::uint64_t, bool>, std::uint64_t> p2p_issued_;  // guarded by p2p_mutex_
  std::vector<std::byte> scratch_;                                            // used by the worker thread only
  // The intra-host transport, when the whole group is on one host (connect); null: TCP only.
  std::unique_ptr<detail::shared_memory_channel> shared_memory_;
  std::shared_ptr<worker_type> worker_;  // last: their threads run run(), which uses the above
  std::shared_ptr<worker_type> p2p_worker_;
  std::mutex p2p_mutex_;
  std::vector<std::weak_ptr<detail::gloo_p2p>> live_p2p_;
  call_label call_context_;  // the caller's thread only (process_group::call_context)
  // The collective the engine runs now and since when (progress monitor), and the counts.
  mutable std::mutex running_mutex_;
  const detail::gloo_task* running_ = nullptr;
  std::chrono::steady_clock::time_point running_since_{};
  std::atomic<std::uint64_t> collectives_completed_{0};
  std::array<std::atomic<std::uint64_t>, call_kinds> issued_by_kind_{};  // of collectives_issued_
  std::unique_ptr<detail::status_board> board_;
  std::unique_ptr<detail::progress_monitor> monitor_;
  std::mutex verdict_mutex_;
  std::string verdict_;  // why the monitor ended the group's call (the disagreement found)
  // A job's first group (process_group's cohort/pg1, whose collision check passed at its
  // start) reads the job's collided mark in job_store_, on a handle of its own: the watchdog's.
  std::shared_ptr<store> job_store_;
  std::shared_ptr<store> job_handle_;
  std::chrono::steady_clock::time_point next_job_check_{};
  std::exception_ptr collision_;                // once found (under verdict_mutex_): the call it ended fails with it
  std::unique_ptr<detail::watchdog> watchdog_;  // destroyed first: it reads the workers
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/gloo.ipp"
#endif
