#pragma once
// timeline: where each rank's step goes, as a file a browser opens (Perfetto, chrome://tracing).
//
//   cohort::timeline timeline{pg};       // on when COHORT_TIMELINE=DIR is set (or options.directory)
//   cohort::training_state<cohort::gloo> state{pg, regions, {.timeline = &timeline}};
//   for (...) {
//     { auto forward = timeline.span("forward"); ... }
//     { auto backward = timeline.span("backward"); ... }
//     state.step();                       // ends the step (without a state: timeline.end_step())
//   }                                     // ~timeline writes DIR/rank<R>.timeline.json
//
// Each rank writes the Chrome trace event format: one complete event ("ph": "X") per span,
// microseconds on the host's steady clock (CLOCK_MONOTONIC: one clock for every process of a
// host), pid = the rank, and one "step" span per step that every other span of the step nests
// in. `cohort-trace timeline DIR -o merged.json` merges the ranks' files into one, shifting
// each rank so that its steps end where rank 0's do (ranks on other hosts have other
// clocks), and `--plot verdict.svg` draws each rank's step as compute, exposed communication
// and other.
//
// What the training state records (category in brackets):
//   "step N"                  [step]           boundary to boundary
//   "gather wait layer L"     [communication]  zero3: the caller waiting for a layer's gathers
//   "step: reductions"        [communication]  step() waiting for the buckets' reductions
//   "step: update"            [optimizer]      the update and the publication of parameters
// and the trainer's own spans, span("forward") [compute]. Spans of one step must nest: a span
// that crosses a step boundary (begun before step(), ended after) is cut at the boundary.
// Beside the training thread's row (tid 0), each bucket has a row of its own (tid 1 + bucket,
// "bucket B (layer L)") with the engine's work on it [engine], from hand-off to completion as
// the group's flight recorder timed it (read when step() has waited for the reductions):
//   "all-reduce bucket B" (ddp), "reduce-scatter bucket B" (zero1/2/3), "canonical sum
//   bucket B" (reproducible: the all-to-all of the ranks' partials and the sum),
//   "gather bucket B" (zero3) and "gathered bucket B" (zero3: its completion to the release)
// These overlap the training thread's spans (that is the overlap) and are not in the split.
//
// Memory: the events of the last `keep_steps` steps (a ring); the steps a slowdown kept
// (keep()) stay too, at most `kept_windows` windows. Cost: off (no directory, or stopped)
// one test per call; on, two clock reads and one event appended per span. Not thread-safe:
// the training thread records.

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cohort/config.hpp"

namespace cohort::inline v0 {

// What a span's time was spent on: the verdict splits each step by it.
// engine: the engine's work on a track of its own (a bucket's reduction from hand-off to
// completion), which overlaps the caller's spans rather than being one of them.
enum class timeline_category : std::uint8_t { step, compute, communication, optimizer, checkpoint, engine, other };

COHORT_DECL const char* to_string(timeline_category category) noexcept;

struct timeline_options {
  // Where rank<R>.timeline.json is written; empty: the COHORT_TIMELINE environment variable;
  // neither: the timeline is off and records nothing.
  std::string directory;
  // Steps kept in memory (and written): the last ones.
  std::size_t keep_steps = 64;
  // Windows keep() may pin beyond the ring.
  std::size_t kept_windows = 4;
  // false: nothing is recorded until start() (a window of steps: start() ... stop()).
  bool recording = true;
};

class timeline {
 public:
  using clock = std::chrono::steady_clock;

  struct event {
    std::string name;
    timeline_category category = timeline_category::other;
    std::uint64_t step = 0;  // the step it belongs to (1 = the first)
    std::int64_t begin_ns = 0;
    std::int64_t end_ns = 0;
    std::uint32_t track = 0;  // the row (tid): 0 the training thread, k > 0 a track's (add_track_span)
  };

  // A span from here to the end of the scope (or to end()).
  class scope {
   public:
    scope() = default;
    scope(timeline* owner, std::string_view name, timeline_category category)
        : owner_(owner), name_(name), category_(category), begin_(clock::now()) {}
    scope(scope&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)),
          name_(other.name_),
          category_(other.category_),
          begin_(other.begin_) {}
    scope& operator=(scope&&) = delete;
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() { end(); }
    void end() {
      if (owner_) std::exchange(owner_, nullptr)->add_span(name_, category_, begin_, clock::now());
    }

   private:
    timeline* owner_ = nullptr;
    std::string_view name_;  // the caller's text: a literal, or one that outlives the scope
    timeline_category category_ = timeline_category::other;
    clock::time_point begin_{};
  };

  // Every rank of `group` (anything with rank() and world_size()). The file says the group's
  // size, so that cohort-trace timeline never merges files of different runs.
  template <class Group>
  explicit timeline(Group& group, timeline_options options = {})
      : timeline(static_cast<int>(group.rank()), std::move(options)) {
    world_size_ = static_cast<int>(group.world_size());
  }
  COHORT_DECL explicit timeline(int rank, timeline_options options = {});
  timeline(const timeline&) = delete;
  timeline& operator=(const timeline&) = delete;
  // Writes the file (a failure is printed, not thrown).
  COHORT_DECL ~timeline();

  // A directory was given: the timeline can record.
  bool enabled() const noexcept { return !directory_.empty(); }
  // Recording now: what the hot path tests.
  bool recording() const noexcept { return recording_; }
  int rank() const noexcept { return rank_; }
  const std::string& directory() const noexcept { return directory_; }
  // The file this rank writes.
  COHORT_DECL std::string path() const;

  // A window of steps: start() begins recording at the current step, stop() ends it (the
  // events stay until written). No-ops when not enabled.
  COHORT_DECL void start();
  COHORT_DECL void stop();

  // The trainer's span; compute unless said otherwise. Off: an empty scope.
  scope span(std::string_view name, timeline_category category = timeline_category::compute) {
    return recording_ ? scope(this, name, category) : scope();
  }
  // A span measured elsewhere.
  void add_span(std::string_view name, timeline_category category, clock::time_point begin, clock::time_point end) {
    if (recording_) record(name, category, begin, end);
  }
  // Rows beside the training thread's: 1 + B is the training state's bucket B; these two the
  // checkpoint's copies (to and from host staging) and its file's write or read.
  static constexpr std::uint32_t checkpoint_copy_track = 1u << 20;
  static constexpr std::uint32_t checkpoint_file_track = checkpoint_copy_track + 1;

  // Work measured elsewhere (on another thread, or by the engine) on row `track` (> 0), which
  // it names (the first name given stays), in step `step`: not cut at a step's start, since it
  // overlaps the training thread's spans.
  void add_track_span(std::uint32_t track, std::string_view track_name, std::string_view name,
                      timeline_category category, std::uint64_t step, clock::time_point begin, clock::time_point end) {
    if (recording_) record_on_track(track, track_name, name, category, step, begin, end);
  }
  // A step ends (training_state::step() calls this when it has the timeline).
  void end_step() {
    if (recording_) boundary(clock::now());
    ++step_;
  }
  void end_step(clock::time_point now) {
    if (recording_) boundary(now);
    ++step_;
  }
  // The step being recorded (1 = the first).
  std::uint64_t step() const noexcept { return step_ + 1; }

  // Pins steps [first, last] beyond the ring (a slowdown's window), with why.
  COHORT_DECL void keep(std::uint64_t first, std::uint64_t last, std::string why);

  // The events in memory, oldest first (the kept windows' first).
  COHORT_DECL std::vector<event> events() const;
  // The whole file as text (what write() writes).
  COHORT_DECL std::string to_json() const;
  // Writes path() now; throws cohort::error when it cannot.
  COHORT_DECL void write() const;

 private:
  COHORT_DECL void record(std::string_view name, timeline_category category, clock::time_point begin,
                          clock::time_point end);
  COHORT_DECL void boundary(clock::time_point now);
  COHORT_DECL void record_on_track(std::uint32_t track, std::string_view track_name, std::string_view name,
                                   timeline_category category, std::uint64_t step, clock::time_point begin,
                                   clock::time_point end);

  struct kept_window {
    std::uint64_t first = 0;
    std::uint64_t last = 0;
    std::string why;
    std::vector<event> events;
  };

  int rank_ = 0;
  int world_size_ = 0;  // 0: not known (a timeline made from a rank alone)
  std::string directory_;
  timeline_options options_;
  bool recording_ = false;
  std::uint64_t step_ = 0;          // steps ended
  clock::time_point step_began_{};  // where the current step's span begins
  std::vector<event> ring_;         // events of the kept steps from ring_first_ on
  std::size_t ring_first_ = 0;      // events before it are dropped (compacted lazily)
  std::vector<kept_window> kept_;
  struct track_row {
    std::string name;
    std::int64_t last_end_ns = 0;  // where the row's next span may begin
  };
  std::map<std::uint32_t, track_row> tracks_;  // the rows beside the training thread's, by tid
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/diagnostics/impl/timeline.ipp"
#endif
