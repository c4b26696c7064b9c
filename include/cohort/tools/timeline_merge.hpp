#pragma once
// cohort-trace timeline: the ranks' timeline files (cohort/diagnostics/timeline.hpp) merged
// into one Chrome trace, each rank's step split into compute, exposed communication and
// other, and that split drawn as an SVG. The tools' only (it reads JSON and files).
//
// Alignment: each rank's events are shifted so that its steps end where rank 0's do, by the
// median over the steps every rank recorded of the difference of their ends. A step ends once
// its collectives did, which every rank had to enter, so the ends are the boundaries the ranks
// share (a step's start is not: the first one is when each rank made its timeline, seconds
// apart on a loaded host). Ranks of one host share the steady clock and shift by the ends'
// usual skew, a fraction of a millisecond; ranks of other hosts have unrelated clocks, and
// the shift is what makes their step k sit beside each other.
//
// The split of one step (span length S): compute is the union of its compute and optimizer
// spans less the communication waits inside them; exposed communication is the union of its
// communication spans (the caller waiting on the engine); other is what remains (data
// loading, anything the trainer did not wrap in a span). Step 1 (construction, first
// allocations) is left out of the means when later steps exist.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/tools/detail/json.hpp"

namespace cohort::inline v0 {

// One rank's mean step, in milliseconds.
struct timeline_rank_split {
  int rank = -1;
  std::uint64_t steps = 0;  // steps in the means
  double step_ms = 0;
  double compute_ms = 0;
  double exposed_ms = 0;
  double other_ms = 0;
  double exposed_share() const noexcept { return step_ms > 0 ? exposed_ms / step_ms : 0.0; }
};

struct merged_timeline {
  detail::json document;                    // the merged Chrome trace
  std::vector<timeline_rank_split> ranks;   // in rank order
  std::uint64_t aligned_on_step = 0;        // the first step every rank recorded (0: none)
  std::vector<std::uint64_t> common_steps;  // steps every rank recorded (none: the ranks stay unaligned)
  std::vector<int> missing_ranks;           // ranks of the files' world that wrote no file
  std::size_t unnested = 0;                 // spans that overlap another without nesting in it
};

namespace detail::timeline_merge_impl {

struct span {
  std::string name;
  std::string category;
  std::uint64_t step = 0;
  double begin_us = 0;
  double end_us = 0;
  std::int64_t track = 0;  // tid: 0 the training thread, else a bucket's row of the engine's work
};

inline double union_length(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0, open_begin = 0, open_end = -1;
  bool open = false;
  for (const auto& [begin, end] : intervals) {
    if (open && begin <= open_end) {
      open_end = std::max(open_end, end);
      continue;
    }
    if (open) total += open_end - open_begin;
    open_begin = begin;
    open_end = end;
    open = true;
  }
  if (open) total += open_end - open_begin;
  return total;
}

// The length of `inner`'s intervals that lie inside `outer`'s (both unions).
inline double overlap_length(const std::vector<std::pair<double, double>>& outer,
                             const std::vector<std::pair<double, double>>& inner) {
  std::vector<std::pair<double, double>> clipped;
  for (const auto& [ob, oe] : outer)
    for (const auto& [ib, ie] : inner) {
      const double b = std::max(ob, ib), e = std::min(oe, ie);
      if (e > b) clipped.emplace_back(b, e);
    }
  return union_length(std::move(clipped));
}

inline std::vector<std::pair<double, double>> merged_intervals(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  std::vector<std::pair<double, double>> merged;
  for (const auto& interval : intervals)
    if (!merged.empty() && interval.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, interval.second);
    else
      merged.push_back(interval);
  return merged;
}

struct rank_file {
  std::filesystem::path path;
  int rank = -1;
  std::int64_t world_size = 0;  // 0: the file does not say
  std::vector<span> spans;
  std::map<std::int64_t, std::string> track_names;  // tid > 0: its thread_name
  std::map<std::uint64_t, const span*> steps;       // the step spans by step
};

inline rank_file read_rank(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw error(-1, "cohort-trace timeline", "cannot read " + path.string(), "");
  const json document = parse_json(text.str());
  rank_file file;
  file.path = path;
  const json& other = document.at("otherData");
  file.rank = static_cast<int>(other.at("rank").as_int64());
  if (const json* world_size = other.find("world_size")) file.world_size = world_size->as_int64();
  for (const auto& e : document.at("traceEvents").as_array()) {
    const std::string& phase = e.at("ph").as_string();
    if (phase == "M" && e.at("name").as_string() == "thread_name" && e.at("tid").as_int64() > 0)
      file.track_names[e.at("tid").as_int64()] = e.at("args").at("name").as_string();
    if (phase != "X") continue;
    const double begin = e.at("ts").as_number();
    file.spans.push_back({e.at("name").as_string(), e.at("cat").as_string(),
                          static_cast<std::uint64_t>(e.at("args").at("step").as_int64()), begin,
                          begin + e.at("dur").as_number(), e.at("tid").as_int64()});
  }
  for (const auto& s : file.spans)
    if (s.category == "step") file.steps[s.step] = &s;
  return file;
}

inline timeline_rank_split split_of(const rank_file& file, const std::vector<std::uint64_t>& steps) {
  timeline_rank_split split;
  split.rank = file.rank;
  for (const std::uint64_t step : steps) {
    std::vector<std::pair<double, double>> compute, communication;
    for (const auto& s : file.spans) {
      if (s.step != step) continue;
      if (s.category == "compute" || s.category == "optimizer") compute.emplace_back(s.begin_us, s.end_us);
      if (s.category == "communication") communication.emplace_back(s.begin_us, s.end_us);
    }
    const span& whole = *file.steps.at(step);
    const double length = whole.end_us - whole.begin_us;
    const auto computing = merged_intervals(std::move(compute));
    const auto waiting = merged_intervals(std::move(communication));
    const double exposed = union_length(waiting);
    const double busy = std::max(union_length(computing) - overlap_length(computing, waiting), 0.0);
    split.step_ms += length / 1e3;
    split.exposed_ms += exposed / 1e3;
    split.compute_ms += busy / 1e3;
    split.other_ms += std::max(length - exposed - busy, 0.0) / 1e3;
  }
  split.steps = steps.size();
  if (!steps.empty()) {
    const double n = static_cast<double>(steps.size());
    split.step_ms /= n;
    split.compute_ms /= n;
    split.exposed_ms /= n;
    split.other_ms /= n;
  }
  return split;
}

}  // namespace detail::timeline_merge_impl

// Spans of one rank that overlap another span without lying inside it: the trace viewers
// draw such a span wrongly, and the split above would count its time twice. Zero for the files
// cohort::timeline writes, whose spans nest in their step.
inline std::size_t count_unnested(std::vector<std::pair<double, double>> spans) {
  // Begin ascending, the longer first: a parent before its children.
  std::sort(spans.begin(), spans.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first < b.first : a.second > b.second; });
  constexpr double slack_us = 1e-3;  // the file's precision
  std::vector<double> open;          // ends of the spans enclosing the current one
  std::size_t unnested = 0;
  for (const auto& [begin, end] : spans) {
    while (!open.empty() && open.back() <= begin + slack_us) open.pop_back();
    if (!open.empty() && end > open.back() + slack_us) ++unnested;
    open.push_back(end);
  }
  return unnested;
}

// Reads DIR/rank<R>.timeline.json for every rank present and merges them.
inline merged_timeline merge_timelines(const std::filesystem::path& directory) {
  using namespace detail::timeline_merge_impl;
  using detail::json;
  std::vector<rank_file> files;
  std::error_code failure;
  for (const auto& entry : std::filesystem::directory_iterator(directory, failure)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank", 0) == 0 && name.size() > 14 && name.ends_with(".timeline.json"))
      files.push_back(read_rank(entry.path()));
  }
  if (failure)
    throw error(-1, "cohort-trace timeline", "cannot read " + directory.string() + ": " + failure.message(),
                "give the run's COHORT_TIMELINE directory");
  if (files.empty())
    throw error(-1, "cohort-trace timeline", "no rank<R>.timeline.json in " + directory.string(),
                "run the trainer with COHORT_TIMELINE=DIR (the files are written as each rank ends)");
  std::sort(files.begin(), files.end(), [](const rank_file& a, const rank_file& b) { return a.rank < b.rank; });
  // Files of two runs in one directory (a run of another size, or a second run's rank 0 over
  // the first's) would be merged as one run's ranks: refused, naming both.
  const auto describe = [](const rank_file& file) {
    return detail::text(file.path.string(), " (rank ", std::to_string(file.rank), " of ",
                        file.world_size > 0 ? std::to_string(file.world_size) : std::string("?"), ")");
  };
  for (std::size_t i = 0; i < files.size(); ++i) {
    const auto& a = files[i];
    const auto& b = files[i + 1 < files.size() ? i + 1 : 0];
    const bool other_size = a.world_size > 0 && b.world_size > 0 && a.world_size != b.world_size;
    if ((&a != &b && a.rank == b.rank) || other_size || (a.world_size > 0 && a.rank >= a.world_size))
      throw error(-1, "cohort-trace timeline",
                  detail::text(describe(a), " and ", describe(b), " are not the ranks of one run"),
                  "give each run its own COHORT_TIMELINE directory");
  }

  merged_timeline merged;
  for (const auto& [step, whole] : files.front().steps) {
    bool everywhere = true;
    for (const auto& file : files) everywhere = everywhere && file.steps.count(step) > 0;
    if (everywhere) merged.common_steps.push_back(step);
  }
  std::vector<std::uint64_t> measured = merged.common_steps;
  if (measured.size() > 1 && measured.front() == 1) measured.erase(measured.begin());
  merged.aligned_on_step = merged.common_steps.empty() ? 0 : merged.common_steps.front();

  json events = json::make_array();
  const auto shift_of = [&](const rank_file& file) {
    std::vector<double> differences;
    for (const std::uint64_t step : merged.common_steps)
      differences.push_back(files.front().steps.at(step)->end_us - file.steps.at(step)->end_us);
    if (differences.empty()) return 0.0;
    // The median, an even count's two middle values averaged (as straggler_spread's).
    std::sort(differences.begin(), differences.end());
    const std::size_t n = differences.size();
    return n % 2 == 1 ? differences[n / 2] : (differences[n / 2 - 1] + differences[n / 2]) / 2;
  };
  // A rank that ended no step (or died first) wrote no file: the merge holds the others, and
  // says which are missing.
  for (int rank = 0, next = 0; rank < files.front().world_size; ++rank) {
    if (static_cast<std::size_t>(next) < files.size() && files[next].rank == rank)
      ++next;
    else
      merged.missing_ranks.push_back(rank);
  }
  for (const auto& file : files) {
    const double shift = shift_of(file);
    json name = json::make_object();
    name.set("name", "process_name");
    name.set("ph", "M");
    name.set("pid", file.rank);
    name.set("tid", 0);
    json args = json::make_object();
    args.set("name", "rank " + std::to_string(file.rank));
    name.set("args", std::move(args));
    events.push_back(std::move(name));
    for (const auto& [track, track_name] : file.track_names) {
      json thread = json::make_object();
      thread.set("name", "thread_name");
      thread.set("ph", "M");
      thread.set("pid", file.rank);
      thread.set("tid", track);
      json thread_args = json::make_object();
      thread_args.set("name", track_name);
      thread.set("args", std::move(thread_args));
      events.push_back(std::move(thread));
    }
    for (const auto& s : file.spans) {
      json e = json::make_object();
      e.set("name", s.name);
      e.set("cat", s.category);
      e.set("ph", "X");
      e.set("ts", s.begin_us + shift);
      e.set("dur", s.end_us - s.begin_us);
      e.set("pid", file.rank);
      e.set("tid", s.track);
      json step = json::make_object();
      step.set("step", s.step);
      e.set("args", std::move(step));
      events.push_back(std::move(e));
    }
    merged.ranks.push_back(split_of(file, measured));
    // Spans nest within their row: the training thread's, and each bucket's.
    std::map<std::int64_t, std::vector<std::pair<double, double>>> rows;
    for (const auto& s : file.spans) rows[s.track].emplace_back(s.begin_us, s.end_us);
    for (auto& [track, spans] : rows) merged.unnested += count_unnested(std::move(spans));
  }
  merged.document.set("traceEvents", std::move(events));
  merged.document.set("displayTimeUnit", "ms");
  json other = json::make_object();
  other.set("aligned_on_step", merged.aligned_on_step);
  other.set("ranks", static_cast<unsigned long>(files.size()));
  if (files.front().world_size > 0) other.set("world_size", files.front().world_size);
  other.set("aligned", files.size() == 1 || !merged.common_steps.empty());
  merged.document.set("otherData", std::move(other));
  return merged;
}

// Stacked horizontal bars, one per rank: compute, exposed communication, other (ms per step).
inline std::string timeline_svg(const std::vector<timeline_rank_split>& ranks) {
  constexpr double left = 70, bar_width = 560, bar_height = 22, gap = 10, top = 40;
  double longest = 0;
  for (const auto& r : ranks) longest = std::max(longest, r.compute_ms + r.exposed_ms + r.other_ms);
  if (longest <= 0) longest = 1;
  const double height = top + static_cast<double>(ranks.size()) * (bar_height + gap) + 40;
  std::string svg;
  char text[512];
  std::snprintf(text, sizeof text,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
                "font-size=\"12\">\n<text x=\"%.0f\" y=\"20\">ms per step by rank: compute, exposed communication, "
                "other</text>\n",
                left + bar_width + 140, height, left);
  svg += text;
  const char* colors[3] = {"#4c78a8", "#e45756", "#bab0ac"};
  double y = top;
  for (const auto& r : ranks) {
    std::snprintf(text, sizeof text, "<text x=\"4\" y=\"%.0f\">rank %d</text>\n", y + bar_height * 0.7, r.rank);
    svg += text;
    double x = left;
    const double parts[3] = {r.compute_ms, r.exposed_ms, r.other_ms};
    for (int p = 0; p < 3; ++p) {
      const double width = parts[p] / longest * bar_width;
      std::snprintf(
          text, sizeof text,
          "<rect x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" height=\"%.0f\" fill=\"%s\"><title>%.2f ms</title></rect>\n", x,
          y, width, bar_height, colors[p], parts[p]);
      svg += text;
      x += width;
    }
    std::snprintf(text, sizeof text, "<text x=\"%.1f\" y=\"%.0f\">%.2f ms (%.0f%% exposed)</text>\n", x + 6,
                  y + bar_height * 0.7, r.step_ms, 100 * r.exposed_share());
    svg += text;
    y += bar_height + gap;
  }
  for (int p = 0; p < 3; ++p) {
    const char* names[3] = {"compute", "exposed communication", "other"};
    std::snprintf(text, sizeof text,
                  "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%.0f\" "
                  "y=\"%.0f\">%s</text>\n",
                  left + p * 190.0, y + 8, colors[p], left + p * 190.0 + 16, y + 18, names[p]);
    svg += text;
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace cohort::inline v0
