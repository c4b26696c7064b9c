#pragma once
// What every backend needs to say who is at fault when a call fails:
//
// - the flight recorder itself (cohort/comm/flight_recorder.hpp);
// - write_trace: on a failure, the ring goes to COHORT_TRACE_DIR/rank<R>.<group>.json,
//   which `cohort-trace DIR` reads across ranks.
// - the status board: each rank's status/<rank> key in its group's store (joined, in a call,
//   failed, left), written only when something is worth knowing, never per call;
// - progress_monitor: a call that waits long compares the ranks' statuses (ranks found in
//   different calls fail within seconds, naming each rank's call) and prints progress lines;
// - name_the_culprit: after a failure each rank publishes what failed and reads the others'
//   statuses for a short, bounded while, so the error names the rank at fault ("ranks 2, 3
//   died or exited during all_reduce #7 (float x 8, sum); ranks 0, 1 are in it") instead of
//   an address or a key, and accuses no rank it could not ask.
// - watchdog: a thread per group that enforces the group's timeout on work nobody waits
//   for through cohort, and acts on failures nobody observes (see async_error_handling).

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cohort/comm/flight_recorder.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

class store;

namespace detail {

// "all_reduce #7 (float x 8, sum)", "broadcast #2 (int32 x 4, root 1)", "send #1 (float x 3,
// peer 2, tag 5)", "barrier #9": how errors, reports and trace analysis name a call.
COHORT_COLD std::string describe(const call_record& call);

// Who wrote a trace file.
struct trace_identity {
  std::string group;  // "pg1", "pg1.split0.color1": see group_name
  std::string_view backend;
  int rank = 0;
  int world = 1;
};

// The group's name in trace files and reports, from its store's prefix ("cohort/pg1/" -> "pg1").
COHORT_COLD std::string group_name(const store& group_store);

// `configured`, else COHORT_TRACE_DIR, else empty (no trace files).
COHORT_COLD std::string trace_directory(const std::string& configured);

// Writes DIR/rank<R>.<group>.json (format: docs/design.md, "Flight recorder"); returns its
// path, or an empty string when it could not be written. Never throws: it runs while an
// error is on its way.
COHORT_COLD [[gnu::cold]] std::string write_trace(const std::string& directory, const trace_identity& who,
                                                  const flight_recorder& recorder, std::string_view failure);

// What a backend can tell of a peer without its help.
// "This host" is this process table (the same kernel boot and pid namespace), not the host
// name: cloned machines share names, and a pid means nothing in another table.
enum class peer_state : std::uint8_t {
  unknown,      // no way to tell (a backend without probes)
  alive,        // connected (or its process runs, on this host)
  died,         // its process (on this host) is gone, or (elsewhere) its connection closed
  unreachable,  // no connection to it and its host does not answer
  stopped,      // its process (on this host) is stopped: SIGSTOP, a debugger, ^Z
  closed,       // its connection closed while its process runs (on this host), or can't be seen
};
struct peer_status {
  peer_state state = peer_state::unknown;
  std::string why;            // "its connection closed", "no answer from 10.0.0.3 within 1 s", ...
  bool process_seen = false;  // its process was found in this host's process table
};

// How a group's messages name its ranks: a subgroup's by world rank and its own, since the
// group-local numbers alone name other processes than the reader thinks.
struct rank_naming {
  std::string group;       // "pg1.split0.color1": see group_name
  std::vector<int> world;  // the world rank of each group rank; empty: the group is the world
  bool is_world() const noexcept { return world.empty(); }
  int world_rank(int group_rank) const {
    return is_world() || group_rank < 0 || static_cast<std::size_t>(group_rank) >= world.size()
               ? group_rank
               : world[static_cast<std::size_t>(group_rank)];
  }
  // "rank 2", "ranks 0, 1"; in a subgroup "world rank 3 (group rank 1)", "world ranks 1, 3
  // (group ranks 0, 1)".
  COHORT_COLD std::string operator()(const std::vector<int>& group_ranks) const;
  std::string operator()(int group_rank) const { return (*this)(std::vector<int>{group_rank}); }
  // What every message of a subgroup starts with: "group pg1.split0.color1 (world ranks 1,
  // 3): "; empty for the world.
  COHORT_COLD std::string lead() const;
};
// Tells alive from unreachable, without the peer's help (may take up to a second).
using peer_probe = std::function<peer_status(int peer)>;

// --- what each rank of a group says it is doing ------------------------------------------
// Every rank keeps one key in its group's store, status/<rank>: what it is doing as far as
// the others need to know. It writes the key when the group is made (joined), when a call
// has waited long enough to be compared (in_call), when the group fails on it (failed) and
// when the group is destroyed (left): never per call. A waiting rank reads everyone's to
// tell a rank that is merely late from one that is in another call, has failed or has left;
// a failing rank reads them to name who is at fault; run_ranks' exit reads them to compare
// how many collectives each rank issued.
enum class rank_activity : std::uint8_t { joined, in_call, failed, left };

struct rank_status {
  rank_activity activity = rank_activity::joined;
  std::uint64_t issued = 0;                         // collectives (and barriers) this rank has issued in the group
  std::uint64_t completed = 0;                      // of which completed
  std::array<std::uint64_t, call_kinds> by_kind{};  // `issued` by call_kind (send and recv: 0)
  // in_call, failed: the call (its sequence is 0 when there is none); left: its last call,
  // when the flight recorder still holds it.
  call_record call;
  std::string note;  // failed: why; left: how it left
};

// "20 all_reduces and 1 all_gather": what by_kind counts.
COHORT_COLD [[gnu::cold]] std::string describe_counts(const std::array<std::uint64_t, call_kinds>& by_kind);

COHORT_COLD std::string encode_status(const rank_status& status);
// False when `text` is not what encode_status writes.
COHORT_COLD bool decode_status(std::string_view text, rank_status& out);

// The window in which a failing rank collects the others' reports, and the bound of every
// store request made on a failure or progress path: the group's timeout, at most 5 s.
inline std::chrono::milliseconds report_window(std::chrono::milliseconds timeout) {
  return std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
}

// The status keys of one group, read and written through a store handle of their own,
// bounded by report_window (store::bounded: connecting included), made on first use: a
// request of the trainer's on the group's handle (a long WAIT) cannot hold them up, and a
// store gone silent holds them for the window, not for the store's own minutes. Safe to
// share between the group's threads.
class status_board {
 public:
  COHORT_COLD status_board(std::shared_ptr<store> group_store, int rank, int size, std::chrono::milliseconds timeout,
                           rank_naming names = {});

  int rank() const noexcept { return rank_; }
  const rank_naming& names() const noexcept { return names_; }
  int size() const noexcept { return size_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  std::chrono::milliseconds window() const noexcept { return report_window(timeout_); }
  // "10.0.0.1:29500", or empty for an in-process store.
  COHORT_COLD std::string location() const;
  const store& group_store() const noexcept { return *store_; }

  // Writes this rank's key; throws when the store cannot be reached within the window.
  COHORT_COLD void publish(const rank_status& status);
  // Never throws (destructors, and paths on which an error is already on its way).
  COHORT_COLD bool try_publish(const rank_status& status) noexcept;
  // Through the group's own handle, which a SET does not wait on (no reply): for what is said
  // when the group is made and destroyed, without a connection of the board's own. A `left`
  // after a `failed` is not written: the failure says more (a peer still in the call that
  // reads it later learns the call and the cause, not that a group was destroyed).
  COHORT_COLD bool try_publish_on_group_store(const rank_status& status) noexcept;
  // The keys of `ranks` (every rank when empty), in that order: nullopt where a rank wrote
  // none or something that does not parse. Throws when the store cannot be reached.
  COHORT_COLD std::vector<std::optional<rank_status>> read(std::span<const int> ranks = {});

 private:
  COHORT_COLD store& handle();

  std::shared_ptr<store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  rank_naming names_;
  std::mutex mutex_;  // one request at a time on `own_`, which is made on first use
  std::shared_ptr<store> own_;
  bool own_made_ = false;
  std::string unreachable_;  // why the last attempt to make `own_` failed, and when
  std::chrono::steady_clock::time_point unreachable_at_{};
  std::atomic<bool> failed_said_{false};
};

// What the other ranks' statuses prove about `mine`, this rank's oldest collective not yet
// complete (number s): ranks in another call #s (kind, dtype, count, op or root differ),
// ranks that left the group having issued fewer than s collectives, ranks whose group has
// failed. Empty when nothing proves that the ranks cannot meet in `mine` (ranks that are late,
// busy computing, or have not said what they do, may still come).
// How a disagreement starts when the ranks are in different calls, and the hint of its error.
inline constexpr std::string_view different_calls = "the ranks are in different calls #";
inline constexpr std::string_view different_calls_hint =
    "every rank must issue the same collectives in the same order; the calls named (and their call_context) show "
    "where each rank was";

// The call context of the small all-reduce that opens evaluation() at zero3 (training_state):
// a rank found in it while the others are in another call, or have left the group, entered
// evaluation() alone, and the disagreement says so (its gathers are collectives the others
// never issue), with what to do instead.
inline constexpr std::string_view evaluation_agreement = "evaluation() agreement";
inline constexpr std::string_view evaluation_alone_hint =
    "at zero3 evaluation() and sampling gather parameters, which are collectives: run evaluation() and its "
    "gathers on every rank (only rank 0 need print the output), or gather the whole model on every rank first and "
    "sample from that copy on one";

COHORT_COLD [[gnu::cold]] std::string find_disagreement(int rank, const call_record& mine,
                                                        std::span<const std::optional<rank_status>> statuses,
                                                        const rank_naming& names = {});

// "recv #1 from rank 0 of 200 bytes (float x 50, tag 3)": a send or recv as its peer and size
// name it (describe() for any other call).
COHORT_COLD [[gnu::cold]] std::string describe_with_peer(const call_record& call);

// After point-to-point call `mine` failed on this rank (its status `failed` already
// published): what its peer said of itself, read for at most the report window (once, and
// again after a moment, when `connection_lost`): "rank 0 is in send #1 to rank 1 of 400 bytes
// (float x 100, tag 3): the sizes differ", a collective, a failure or its leaving; else that
// it closed its connection (`connection_lost`) or said nothing.
COHORT_COLD [[gnu::cold]] std::string name_the_peer(status_board& board, const call_record& mine, bool connection_lost);

// After `mine` failed on this rank: publishes `failed` (this rank's status) in the group's
// store, reads the other ranks' statuses for at most the report window and says who is at
// fault. A rank whose status concerns this call is in it (or in another call #s); one that
// left or failed says so itself; one with no such report is named as `known` (what the
// backend saw of it before anything was closed: died, alive) and `probe` (asked meanwhile
// whether its host answers: unreachable) find it, and otherwise as unknown: no report,
// never accused. Without probes, `connection_lost` (the engine saw a connection close) names
// silent ranks dead.
COHORT_COLD [[gnu::cold]] std::string name_the_culprit(status_board& board, const call_record& mine,
                                                       const rank_status& failed, bool connection_lost,
                                                       std::span<const peer_status> known = {},
                                                       const peer_probe& probe = {});

// The oldest collective this rank has issued and not completed, and since when it runs
// (started, on Gloo; issued, on NCCL).
struct pending_call {
  call_record call;
  std::chrono::steady_clock::time_point since;
};

// What a backend's watchdog does for a call that waits long: after `compare_after` it
// publishes the call as this rank's status and compares the other ranks' (then every
// max(compare_after, 5 s)), so ranks found in different calls fail within seconds instead
// of the timeout; every `progress_interval` it prints one line saying what the call waits
// for and for whom. A rank that is only late (computing, slower) is not an error: it gets
// progress lines. Runs on the watchdog's thread.
class progress_monitor {
 public:
  struct settings {
    std::chrono::milliseconds compare_after{};      // 0: never compare
    std::chrono::milliseconds progress_interval{};  // 0: no progress lines
  };
  COHORT_COLD progress_monitor(status_board& board, std::string group, settings when);

  // `pending`: what this rank's engine has not completed (nullopt: nothing); `now`: this
  // rank's counts. Returns the disagreement that dooms that call (find_disagreement), or an
  // empty string.
  COHORT_COLD std::string tick(const std::optional<pending_call>& pending, const rank_status& now);

 private:
  COHORT_COLD [[gnu::cold]] std::string compare(const pending_call& pending, const rank_status& now);
  COHORT_COLD [[gnu::cold]] void say(const pending_call& pending, std::chrono::steady_clock::time_point now) const;

  status_board& board_;
  std::string group_;
  settings when_;
  std::uint64_t watching_ = 0;  // the record id of the pending call watched (0: none)
  std::chrono::steady_clock::time_point next_compare_{};
  std::chrono::steady_clock::time_point next_line_{};
  bool published_ = false;
  std::string found_;  // what the last comparison found, for the progress lines
};

// The flight recorder's newest collective (sequence 0 when it holds none).
COHORT_COLD call_record newest_collective(const flight_recorder& recorder);

// A thread that calls check() every `interval` until it returns a failure (or the watchdog
// is destroyed), then hands the failure to the policy: abort_process ends the process,
// throw_on_next_call keeps it for rethrow_if_failed(). check() runs on the watchdog's thread.
class watchdog {
 public:
  using check_fn = std::function<std::exception_ptr()>;

  COHORT_COLD watchdog(int rank, std::string group, async_error_handling policy, std::chrono::milliseconds interval,
                       check_fn check);
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  COHORT_DECL ~watchdog();

  // Throws the failure the watchdog found, if any (throw_on_next_call): every call of the
  // group starts with it, so a broken group is reported at the next call, not later.
  void rethrow_if_failed() const {
    if (!found_.load(std::memory_order_acquire)) [[likely]]
      return;
    std::lock_guard lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  COHORT_COLD void loop();
  COHORT_COLD void act(std::exception_ptr failure);

  int rank_;
  std::string group_;
  async_error_handling policy_;
  std::chrono::milliseconds interval_;
  check_fn check_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::atomic<bool> found_{false};
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace detail
}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/failure_report.ipp"
#endif
