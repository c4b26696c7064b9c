#pragma once
// The timeline's recording and its file (cohort/diagnostics/timeline.hpp).

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cohort/detail/text.hpp"
#include "cohort/diagnostics/timeline.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

namespace detail::timeline_impl {

inline std::int64_t ns_of(timeline::clock::time_point at) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count();
}

// Microseconds with the nanoseconds kept (the format's unit is the microsecond).
inline void append_us(std::string& out, std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000 < 0 ? -(ns % 1000) : ns % 1000));
  out += text;
}

inline void append_string(std::string& out, std::string_view text) {
  out += '"';
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  out += '"';
}

inline void append_event(std::string& out, const timeline::event& e, int rank) {
  out += "{\"name\":";
  append_string(out, e.name);
  out += ",\"cat\":\"";
  out += to_string(e.category);
  out += "\",\"ph\":\"X\",\"ts\":";
  append_us(out, e.begin_ns);
  out += ",\"dur\":";
  append_us(out, e.end_ns - e.begin_ns);
  out += ",\"pid\":" + std::to_string(rank) + ",\"tid\":" + std::to_string(e.track) +
         ",\"args\":{\"step\":" + std::to_string(e.step) + "}}";
}

}  // namespace detail::timeline_impl

COHORT_DECL const char* to_string(timeline_category category) noexcept {
  switch (category) {
    case timeline_category::step: return "step";
    case timeline_category::compute: return "compute";
    case timeline_category::communication: return "communication";
    case timeline_category::optimizer: return "optimizer";
    case timeline_category::checkpoint: return "checkpoint";
    case timeline_category::engine: return "engine";
    case timeline_category::other: break;
  }
  return "other";
}

COHORT_DECL timeline::timeline(int rank, timeline_options options) : rank_(rank), options_(std::move(options)) {
  directory_ = options_.directory;
  if (directory_.empty())
    if (const char* from_environment = std::getenv("COHORT_TIMELINE")) directory_ = from_environment;
  if (options_.keep_steps == 0) options_.keep_steps = 1;
  if (options_.recording) start();
}

COHORT_DECL timeline::~timeline() {
  if (!enabled() || (ring_.size() == ring_first_ && kept_.empty())) return;
  try {
    write();
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "[cohort rank %d] timeline: %s\n", rank_, failure.what());
  }
}

COHORT_DECL std::string timeline::path() const {
  return detail::text(directory_, "/rank", std::to_string(rank_), ".timeline.json");
}

COHORT_DECL void timeline::start() {
  if (!enabled() || recording_) return;
  recording_ = true;
  step_began_ = clock::now();
}

COHORT_DECL void timeline::stop() { recording_ = false; }

COHORT_DECL void timeline::record(std::string_view name, timeline_category category, clock::time_point begin,
                                  clock::time_point end) {
  // A span begun in the previous step (or before recording) is cut at this step's start, so
  // that every span nests in its step's.
  if (begin < step_began_) begin = step_began_;
  if (end < begin) end = begin;
  ring_.push_back(
      {std::string(name), category, step_ + 1, detail::timeline_impl::ns_of(begin), detail::timeline_impl::ns_of(end)});
}

COHORT_DECL void timeline::record_on_track(std::uint32_t track, std::string_view track_name, std::string_view name,
                                           timeline_category category, std::uint64_t step, clock::time_point begin,
                                           clock::time_point end) {
  auto& row = tracks_[track];
  if (row.name.empty()) row.name = track_name;
  // A track's spans follow one another (its row draws them so): one that begins before the
  // last one ended (a device's completion seen late) begins at that end.
  const std::int64_t begin_ns = std::max(detail::timeline_impl::ns_of(begin), row.last_end_ns);
  const std::int64_t end_ns = std::max(detail::timeline_impl::ns_of(end), begin_ns);
  row.last_end_ns = end_ns;
  ring_.push_back({std::string(name), category, step, begin_ns, end_ns, track});
}

COHORT_DECL void timeline::boundary(clock::time_point now) {
  const std::uint64_t ended = step_ + 1;
  ring_.push_back({"step " + std::to_string(ended), timeline_category::step, ended,
                   detail::timeline_impl::ns_of(step_began_), detail::timeline_impl::ns_of(now)});
  step_began_ = now;
  while (ring_first_ < ring_.size() && ring_[ring_first_].step + options_.keep_steps <= ended) ++ring_first_;
  // Dropped events are erased once they are half the ring: amortized one move per event.
  if (ring_first_ > ring_.size() / 2) {
    ring_.erase(ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(ring_first_));
    ring_first_ = 0;
  }
}

COHORT_DECL void timeline::keep(std::uint64_t first, std::uint64_t last, std::string why) {
  if (!enabled() || kept_.size() >= options_.kept_windows) return;
  kept_window window{first, last, std::move(why), {}};
  for (std::size_t i = ring_first_; i < ring_.size(); ++i)
    if (ring_[i].step >= first && ring_[i].step <= last) window.events.push_back(ring_[i]);
  kept_.push_back(std::move(window));
}

COHORT_DECL std::vector<timeline::event> timeline::events() const {
  std::vector<event> all;
  // A kept window's steps that the ring still holds are written once, from the ring.
  const std::uint64_t ring_oldest = ring_first_ < ring_.size() ? ring_[ring_first_].step : step_ + 1;
  for (const auto& window : kept_)
    for (const auto& e : window.events)
      if (e.step < ring_oldest && (all.empty() || e.step >= all.back().step)) all.push_back(e);
  all.insert(all.end(), ring_.begin() + static_cast<std::ptrdiff_t>(ring_first_), ring_.end());
  return all;
}

COHORT_DECL std::string timeline::to_json() const {
  using detail::timeline_impl::append_string;
  std::string out = "{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
                    ",\"tid\":0,\"args\":{\"name\":\"rank " + std::to_string(rank_) + "\"}}";
  for (const auto& [track, row] : tracks_) {
    out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
           ",\"tid\":" + std::to_string(track) + ",\"args\":{\"name\":";
    append_string(out, row.name);
    out += "}}";
  }
  for (const auto& e : events()) {
    out += ",\n";
    detail::timeline_impl::append_event(out, e, rank_);
  }
  out += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" + std::to_string(rank_) +
         (world_size_ > 0 ? ",\"world_size\":" + std::to_string(world_size_) : std::string()) +
         ",\"clock\":\"steady\",\"kept\":[";
  for (std::size_t i = 0; i < kept_.size(); ++i) {
    if (i > 0) out += ",";
    out += "{\"first_step\":" + std::to_string(kept_[i].first) + ",\"last_step\":" + std::to_string(kept_[i].last) +
           ",\"why\":";
    append_string(out, kept_[i].why);
    out += "}";
  }
  out += "]}}\n";
  return out;
}

COHORT_DECL void timeline::write() const {
  if (!enabled()) return;
  if (::mkdir(directory_.c_str(), 0755) != 0 && errno != EEXIST)
    throw error(rank_, "timeline", detail::text("cannot create ", directory_, ": ", std::strerror(errno)),
                "COHORT_TIMELINE names a directory this process may create or write");
  const std::string file_path = path();
  const std::string text = to_json();
  std::FILE* file = std::fopen(file_path.c_str(), "we");
  if (!file)
    throw error(rank_, "timeline", detail::text("cannot open ", file_path, ": ", std::strerror(errno)),
                "COHORT_TIMELINE names a directory this process may write");
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed)
    throw error(rank_, "timeline",
                detail::text("cannot write ", file_path, " (", std::to_string(text.size()), " bytes)"),
                "is the disk full?");
}

}  // namespace cohort::inline v0
