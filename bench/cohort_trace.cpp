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

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "cohort/diagnostics/trace.hpp"

namespace {

constexpr const char* usage = R"(usage: cohort-trace DIR [--json]

Reads the flight-recorder traces ranks write when a collective fails and COHORT_TRACE_DIR=DIR
is set (DIR/rank<R>.<group>.json, one per rank and process group) and names the rank at fault:
  - ranks that wrote no trace (still running, stopped, or died before they could);
  - the first collective the ranks disagree on: a rank that never issued it, or a rank that
    issued another call (kind, dtype, count, op, root) at the same sequence number;
  - when they all agree, the oldest collective not completed and which ranks are in it;
  - sends without their matching recv (or the reverse), and send/recv size mismatches;
  - what cannot be judged because a ring (the last `capacity` calls) no longer holds it;
  - each rank's recorded error (first line).

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

}  // namespace

int main(int argc, char** argv) {
  try {
    bool json_output = false;
    std::string directory;
    std::vector<std::string> args(argv + 1, argv + argc);
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
