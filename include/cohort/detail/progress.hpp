#pragma once
// Progress lines: what a long wait prints while it waits, so that no rank is silent for
// minutes (the store's connection attempts, a rendezvous, a collective, run_ranks' exit).
// One line per interval on stderr, written whole ("cohort [rank 3] ..."), as NCCL's and
// torchrun's logs are on by default. COHORT_PROGRESS_INTERVAL (seconds; 0 turns the lines
// off) sets the default interval of every wait that has no option of its own.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "cohort/detail/text.hpp"

namespace cohort::inline v0::detail {

inline constexpr std::chrono::seconds standard_progress_interval{30};

// COHORT_PROGRESS_INTERVAL in whole seconds, else 30 s; 0: no progress lines.
inline std::chrono::milliseconds default_progress_interval() {
  const char* value = std::getenv("COHORT_PROGRESS_INTERVAL");
  if (!value || !*value) return standard_progress_interval;
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  if (end == value || *end != '\0' || !(seconds >= 0)) return standard_progress_interval;
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// "12.3 s": an elapsed time as a reader wants it.
inline std::string format_seconds(std::chrono::steady_clock::duration elapsed) {
  const double seconds = std::chrono::duration<double>(elapsed).count();
  char text[32];
  std::snprintf(text, sizeof text, seconds < 10 ? "%.1f s" : "%.0f s", seconds);
  return text;
}

// Writes "cohort [rank R] <text>" and a line break in one call, so lines of threads and
// processes never tear.
inline void progress_line(int rank, std::string_view text) {
  const std::string line = rank >= 0 ? detail::text("cohort [rank ", std::to_string(rank), "] ", text, "\n")
                                     : detail::text("cohort ", text, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

// When a waiting loop is due to say what it waits for: every `interval` after `start`
// (never with interval 0).
class progress_clock {
 public:
  using clock = std::chrono::steady_clock;
  explicit progress_clock(std::chrono::milliseconds interval, clock::time_point start = clock::now())
      : start_(start), interval_(interval), next_(start + interval) {}
  bool due(clock::time_point now = clock::now()) {
    if (interval_.count() <= 0 || now < next_) return false;
    while (next_ <= now) next_ += interval_;
    return true;
  }
  clock::time_point next() const noexcept { return interval_.count() > 0 ? next_ : clock::time_point::max(); }
  clock::duration elapsed(clock::time_point now = clock::now()) const noexcept { return now - start_; }
  clock::time_point start() const noexcept { return start_; }

 private:
  clock::time_point start_;
  std::chrono::milliseconds interval_;
  clock::time_point next_;
};

}  // namespace cohort::inline v0::detail
