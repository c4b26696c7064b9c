// cohort-trace: which rank broke the collective, from the traces the ranks left behind.
//
//   COHORT_TRACE_DIR=/shared/traces torchrun ... ./trainer     # a collective fails
//   cohort-trace /shared/traces
//
// Reads every rank<R>.<group>.json in the directory (the flight recorder's files, one per
// rank and process group), compares the ranks' calls group by group and prints, per group:
// the ranks that wrote no trace, the first collective the ranks disagree on (a rank that
// never issued it, or issued another call), or else the oldest one not completed; sends
// without their recv and size mismatches; what could not be judged because the rings had
// overwritten it; and each rank's recorded error. --json prints the same as JSON.
// Exit status: 0 nothing wrong found, 1 a finding (see --help), 2 usage or I/O error.
// See include/cohort/diagnostics/trace.hpp.
//
//   COHORT_TIMELINE=/shared/timeline torchrun ... ./trainer
//   cohort-trace timeline /shared/timeline -o merged.json --plot verdict.svg
//
// Merges the ranks' timelines (include/cohort/diagnostics/timeline.hpp) into one Chrome
// trace (Perfetto, chrome://tracing: one process row per rank, aligned on the steps), prints
// each rank's step split into compute, exposed communication and other, and with --plot
// draws that split as an SVG of stacked bars.

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "cohort/diagnostics/trace.hpp"
#include "cohort/tools/timeline_merge.hpp"

namespace {

constexpr const char* usage = R"(usage: cohort-trace DIR [--json]
       cohort-trace timeline DIR [-o merged.json] [--plot verdict.svg]

Reads the flight-recorder traces ranks write when a collective fails and COHORT_TRACE_DIR=DIR
is set (DIR/rank<R>.<group>.json, one per rank and process group) and names the rank at fault:
  - ranks that wrote no trace (still running, stopped, or died before they could);
  - the first collective the ranks disagree on: a rank that never issued it, or a rank that
    issued another call (kind, dtype, count, op, root) at the same sequence number;
  - when they all agree, the oldest collective not completed and which ranks are in it;
  - sends without their matching recv (or the reverse), and send/recv size mismatches;
  - what cannot be judged because a ring (the last `capacity` calls) no longer holds it;
  - each rank's recorded error (first line).

cohort-trace timeline reads the timelines ranks write when COHORT_TIMELINE=DIR is set
(DIR/rank<R>.timeline.json), merges them into one Chrome trace (-o; Perfetto and
chrome://tracing open it: one process row per rank, every rank's step k side by side) and
prints each rank's mean step split into compute, exposed communication (waiting on the
engine) and other; --plot writes that split as an SVG of stacked bars. Each bucket's
engine work and a checkpoint's copies and file have rows of their own beside each rank's
training thread. Exit status 1 when spans overlap without nesting (the files were not
cohort::timeline's); 2 as below, and for files of two runs in one DIR (other world sizes, a
rank twice): give each run its own DIR.

Options
  --json      machine-readable output
  --help      this text

Exit status
  0  the traces were analysed and show nothing wrong
  1  the traces were analysed and show a finding (a disagreement, a call not completed, a
     missing or unreadable trace)
  2  usage error, DIR cannot be read, or DIR holds no trace files
)";

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "cohort-trace: " << message << "\n(see cohort-trace --help)\n";
  std::exit(2);
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out.flush()) fail("cannot write " + path);
}

int timeline_main(const std::vector<std::string>& args) {
  std::string directory, merged_path, plot_path;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto value = [&] {
      if (i + 1 >= args.size()) fail(args[i] + " needs a file name");
      return args[++i];
    };
    if (args[i] == "-o")
      merged_path = value();
    else if (args[i] == "--plot")
      plot_path = value();
    else if (args[i].rfind("-", 0) == 0 && args[i].size() > 1)
      fail("unknown option " + args[i]);
    else if (directory.empty())
      directory = args[i];
    else
      fail("one directory only (got \"" + directory + "\" and \"" + args[i] + "\")");
  }
  if (directory.empty()) fail("give the timeline directory (the run's COHORT_TIMELINE)");
  const auto merged = cohort::merge_timelines(directory);
  if (!merged_path.empty()) write_file(merged_path, merged.document.dump());
  if (!plot_path.empty()) write_file(plot_path, cohort::timeline_svg(merged.ranks));
  std::printf("%zu ranks, %zu steps every rank recorded (from step %llu, aligned on their ends); ms per step:\n",
              merged.ranks.size(), merged.common_steps.size(), static_cast<unsigned long long>(merged.aligned_on_step));
  for (const auto& r : merged.ranks)
    std::printf("  rank %d: step %.2f = compute %.2f + exposed communication %.2f (%.0f%%) + other %.2f\n", r.rank,
                r.step_ms, r.compute_ms, r.exposed_ms, 100 * r.exposed_share(), r.other_ms);
  if (!merged.missing_ranks.empty()) {
    std::string missing;
    for (const int rank : merged.missing_ranks) missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
    std::printf("warning: no timeline from rank %s of the world's %zu (a rank that ended no step, or died first)\n",
                missing.c_str(), merged.ranks.size() + merged.missing_ranks.size());
  }
  if (merged.ranks.size() > 1 && merged.common_steps.empty())
    std::printf("warning: no step every rank recorded, so the ranks are not aligned: each keeps its own clock\n");
  if (merged.unnested > 0) {
    std::printf("%zu spans overlap another without nesting in it: the split above counts them twice\n",
                merged.unnested);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    bool json_output = false;
    std::string directory;
    std::vector<std::string> args(argv + 1, argv + argc);
    if (!args.empty() && args.front() == "timeline") return timeline_main({args.begin() + 1, args.end()});
    for (const auto& arg : args) {
      if (arg == "--help" || arg == "-h") {
        std::cout << usage;
        return 0;
      } else if (arg == "--json") {
        json_output = true;
      } else if (arg.rfind("-", 0) == 0 && arg.size() > 1) {
        fail("unknown option " + arg);
      } else if (directory.empty()) {
        directory = arg;
      } else {
        fail("one directory only (got \"" + directory + "\" and \"" + arg + "\")");
      }
    }
    if (directory.empty()) fail("give the trace directory (the run's COHORT_TRACE_DIR)");

    const auto report = cohort::analyze_traces(directory);
    if (report.groups.empty() && report.problems.empty())
      fail("no trace files (rank<R>.<group>.json) in \"" + directory + "\"");
    if (json_output)
      std::cout << cohort::to_json(report, 2) << "\n";
    else
      std::cout << cohort::format_trace_report(report);
    return report.has_findings() ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "cohort-trace: " << e.what() << "\n";
    return 2;
  }
}
