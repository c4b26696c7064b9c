// The flight-recorder analyzer behind cohort-trace: synthetic trace directories for a skipped
// collective, a mismatched call, a dead peer, send/recv mismatches, rings too short to judge,
// and files that are corrupt or not traces at all.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cohort/diagnostics/trace.hpp"
#include "cohort/tools/detail/json.hpp"

namespace fs = std::filesystem;
using cohort::trace_finding_kind;
using cohort::detail::json;

namespace {

struct call {
  std::int64_t sequence = 0;
  std::string kind = "all_reduce";
  std::string state = "completed";
  std::string dtype = "float";
  std::int64_t count = 4096;
  std::string op = "sum";
  int peer = -1;
  std::int64_t tag = 0;
};

// all_reduce #first..#last, completed except the ones from `open_from` on, which are `state`.
std::vector<call> all_reduces(std::int64_t first, std::int64_t last, std::int64_t open_from = 0,
                              const std::string& state = "started") {
  std::vector<call> calls;
  for (std::int64_t s = first; s <= last; ++s) {
    call c;
    c.sequence = s;
    if (open_from && s >= open_from) c.state = state;
    calls.push_back(c);
  }
  return calls;
}

call p2p(const std::string& kind, std::int64_t sequence, int peer, std::int64_t tag, std::int64_t count,
         const std::string& state = "started") {
  call c;
  c.kind = kind;
  c.sequence = sequence;
  c.peer = peer;
  c.tag = tag;
  c.count = count;
  c.state = state;
  return c;
}

struct trace_spec {
  int rank = 0;
  int world = 2;
  std::int64_t last_issued = 0;
  std::int64_t last_completed = 0;
  std::int64_t capacity = 2048;
  std::vector<call> entries = {};
  std::string error = {};  // empty: a two-line timeout naming the rank
  std::string group = "pg1";
};

json trace_document(const trace_spec& spec) {
  json entries = json::make_array();
  std::int64_t clock = 1764600000000000;
  for (const auto& c : spec.entries) {
    json e = json::make_object();
    e.set("sequence", c.sequence);
    e.set("kind", c.kind);
    e.set("dtype", c.dtype);
    e.set("count", c.count);
    e.set("op", c.op);
    e.set("peer", c.peer);
    e.set("tag", c.tag);
    e.set("state", c.state);
    e.set("issued_us", clock += 10);
    e.set("started_us", c.state == "issued" ? 0 : clock + 1);
    e.set("completed_us", c.state == "completed" ? clock + 5 : 0);
    entries.push_back(std::move(e));
  }
  json document = json::make_object();
  document.set("version", 1);
  document.set("group", spec.group);
  document.set("backend", "gloo");
  document.set("rank", spec.rank);
  document.set("world", spec.world);
  document.set("host", "node" + std::to_string(spec.rank));
  document.set("pid", 4100 + spec.rank);
  document.set("written_us", 1764600030000000 + spec.rank * 1000);
  document.set("error", !spec.error.empty() ? spec.error
                                            : "cohort [rank " + std::to_string(spec.rank) +
                                                  "] gloo.all_reduce: timed out after 30 s\n[Gloo's own message]");
  document.set("last_issued", spec.last_issued);
  document.set("last_completed", spec.last_completed);
  document.set("capacity", spec.capacity);
  document.set("entries", std::move(entries));
  return document;
}

// A fresh directory under the system's temp directory, removed again at the end; with
// COHORT_TEST_TRACE_OUT=DIR set, DIR/<name> instead, kept for cohort-trace to read
// (docs/design.md's sample output comes from there).
struct trace_dir {
  fs::path path;
  bool keep = false;
  explicit trace_dir(const std::string& name) {
    const char* out = std::getenv("COHORT_TEST_TRACE_OUT");
    keep = out && *out;
    path = keep ? fs::path(out) / name
                : fs::temp_directory_path() / ("cohort_test_trace_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~trace_dir() {
    std::error_code ignored;
    if (!keep) fs::remove_all(path, ignored);
  }
  trace_dir(const trace_dir&) = delete;
  trace_dir& operator=(const trace_dir&) = delete;

  void write_text(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
  }
  void write(const trace_spec& spec) const {
    write_text("rank" + std::to_string(spec.rank) + "." + spec.group + ".json", trace_document(spec).dump(2));
  }
};

const cohort::trace_finding* find_kind(const cohort::trace_group_report& group, trace_finding_kind kind) {
  for (const auto& finding : group.findings)
    if (finding.kind == kind) return &finding;
  return nullptr;
}

bool any_contains(const std::vector<std::string>& lines, const std::string& needle) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& line) { return line.find(needle) != std::string::npos; });
}

using ranks = std::vector<int>;

}  // namespace

TEST_CASE("trace: a rank that never issued a collective is named, with the ranks waiting in it") {
  trace_dir dir("skipped");
  for (int rank : {0, 1, 3}) {
    trace_spec spec{.rank = rank, .world = 4, .last_issued = 5, .last_completed = 4, .entries = all_reduces(1, 5, 5)};
    dir.write(spec);
  }
  trace_spec late{.rank = 2, .world = 4, .last_issued = 4, .last_completed = 4, .entries = all_reduces(1, 4)};
  late.error = "cohort [rank 2] monitored_barrier: ranks 0, 1, 3 did not arrive within 30 s";
  dir.write(late);

  const auto report = cohort::analyze_traces(dir.path);
  REQUIRE(report.problems.empty());
  REQUIRE(report.groups.size() == 1);
  const auto& group = report.groups[0];
  CHECK(group.group == "pg1");
  CHECK(group.world == 4);
  CHECK(group.present == ranks{0, 1, 2, 3});
  CHECK(group.missing.empty());
  REQUIRE(group.findings.size() == 1);
  const auto& finding = group.findings[0];
  CHECK(finding.kind == trace_finding_kind::never_issued);
  CHECK(finding.sequence == 5);
  CHECK(finding.culprits == ranks{2});
  CHECK(finding.waiting == ranks{0, 1, 3});
  CHECK_THAT(finding.text, Catch::Contains("rank 2 never issued all_reduce #5 (float x 4096, sum); ranks 0, 1, 3 "
                                           "issued it and are waiting in it (state started)"));
  CHECK_THAT(finding.text, Catch::Contains("rank 2's newest call is all_reduce #4 (float x 4096, sum), completed"));
  CHECK(report.has_findings());

  const std::string text = cohort::format_trace_report(report);
  CHECK_THAT(text, Catch::Contains("group pg1 (gloo, world 4)"));
  CHECK_THAT(text, Catch::Contains("- rank 2 never issued all_reduce #5"));
  // Errors: the first line of each, per rank.
  CHECK_THAT(text, Catch::Contains("rank 2: cohort [rank 2] monitored_barrier: ranks 0, 1, 3 did not arrive"));
  CHECK_THAT(text, Catch::Contains("rank 3: cohort [rank 3] gloo.all_reduce: timed out after 30 s ..."));
  CHECK_THAT(text, !Catch::Contains("Gloo's own message"));

  // The JSON output carries the same finding.
  const json document = cohort::detail::parse_json(cohort::to_json(report));
  const json& parsed = document.at("groups").at(0).at("findings").at(0);
  CHECK(parsed.at("kind").as_string() == "never_issued");
  CHECK(parsed.at("sequence").as_int64() == 5);
  REQUIRE(parsed.at("culprits").size() == 1);
  CHECK(parsed.at("culprits").at(0).as_int64() == 2);
  CHECK(document.at("has_findings").as_bool());
}

TEST_CASE("trace: a rank that issued another collective at the same sequence is named") {
  SECTION("a majority: the odd rank out is the culprit") {
    trace_dir dir("mismatch");
    for (int rank : {0, 2})
      dir.write({.rank = rank, .world = 3, .last_issued = 7, .last_completed = 6, .entries = all_reduces(1, 7, 7)});
    auto odd = all_reduces(1, 6);
    call gather;
    gather.sequence = 7;
    gather.kind = "all_gather";
    gather.count = 10;
    gather.op = "avg";  // not part of an all_gather's signature; still shown nowhere
    gather.state = "started";
    odd.push_back(gather);
    dir.write({.rank = 1, .world = 3, .last_issued = 7, .last_completed = 6, .entries = odd});

    const auto report = cohort::analyze_traces(dir.path);
    REQUIRE(report.groups.size() == 1);
    const auto& group = report.groups[0];
    REQUIRE(group.findings.size() == 1);
    const auto& finding = group.findings[0];
    CHECK(finding.kind == trace_finding_kind::mismatch);
    CHECK(finding.sequence == 7);
    CHECK(finding.culprits == ranks{1});
    CHECK(finding.waiting == ranks{0, 2});
    CHECK(finding.text ==
          "rank 1 issued all_gather #7 (float x 10) where ranks 0, 2 issued all_reduce #7 (float x 4096, sum)");
  }
  SECTION("the reduction op counts for all_reduce; the first differing sequence is the one reported") {
    trace_dir dir("op");
    dir.write({.rank = 0, .world = 2, .last_issued = 9, .last_completed = 3, .entries = all_reduces(1, 9, 4)});
    auto other = all_reduces(1, 9, 4);
    other[3].op = "avg";  // #4
    other[6].count = 1;   // #7: a later difference, a consequence
    dir.write({.rank = 1, .world = 2, .last_issued = 9, .last_completed = 3, .entries = other});
    const auto report = cohort::analyze_traces(dir.path);
    const auto& group = report.groups.at(0);
    REQUIRE(group.findings.size() == 1);
    CHECK(group.findings[0].kind == trace_finding_kind::mismatch);
    CHECK(group.findings[0].sequence == 4);
    // Two ranks, two calls: no majority, both named and the text says it cannot tell.
    CHECK(group.findings[0].culprits == ranks{0, 1});
    CHECK_THAT(group.findings[0].text, Catch::Contains("rank 0 issued all_reduce #4 (float x 4096, sum)"));
    CHECK_THAT(group.findings[0].text, Catch::Contains("rank 1 issued all_reduce #4 (float x 4096, avg)"));
    CHECK_THAT(group.findings[0].text, Catch::Contains("no majority"));
  }
}

TEST_CASE("trace: a dead peer that wrote no trace is the suspect of the call everybody is stuck in") {
  trace_dir dir("dead");
  for (int rank : {0, 2, 3})  // rings of 16 calls: #73..#88, #88 started everywhere
    dir.write({.rank = rank,
               .world = 4,
               .last_issued = 88,
               .last_completed = 87,
               .capacity = 16,
               .entries = all_reduces(73, 88, 88)});
  const auto report = cohort::analyze_traces(dir.path);
  REQUIRE(report.groups.size() == 1);
  const auto& group = report.groups[0];
  CHECK(group.missing == ranks{1});
  CHECK(group.present == ranks{0, 2, 3});
  REQUIRE(group.findings.size() == 1);
  const auto& finding = group.findings[0];
  CHECK(finding.kind == trace_finding_kind::stuck);
  CHECK(finding.sequence == 88);
  CHECK(finding.culprits == ranks{1});
  CHECK(finding.waiting == ranks{0, 2, 3});
  CHECK_THAT(finding.text, Catch::Contains("all_reduce #88 (float x 4096, sum) did not complete: ranks 0, 2, 3 "
                                           "issued it and are waiting in it (state started)"));
  CHECK_THAT(finding.text, Catch::Contains("rank 1 wrote no trace and is the suspect"));
  CHECK(group.notes.empty());  // every older call completed: nothing left unjudged
  CHECK_THAT(cohort::format_trace_report(report),
             Catch::Contains("rank 1 wrote no trace (still running, stopped, or died before it could)"));
}

TEST_CASE("trace: a send and its recv that disagree, and a send nobody receives") {
  trace_dir dir("p2p");
  // Stream tag 3: sizes differ. Stream tag 5: rank 0 sent twice, rank 1 received once.
  dir.write({.rank = 0,
             .world = 2,
             .entries = {p2p("send", 1, 1, 3, 100), p2p("send", 1, 1, 5, 8, "completed"), p2p("send", 2, 1, 5, 8)}});
  dir.write({.rank = 1, .world = 2, .entries = {p2p("recv", 1, 0, 3, 50), p2p("recv", 1, 0, 5, 8, "completed")}});
  const auto report = cohort::analyze_traces(dir.path);
  const auto& group = report.groups.at(0);
  REQUIRE(group.findings.size() == 2);
  const auto* mismatch = find_kind(group, trace_finding_kind::p2p_mismatch);
  REQUIRE(mismatch);
  CHECK(mismatch->sequence == 1);
  CHECK(mismatch->culprits == ranks{0, 1});
  CHECK_THAT(mismatch->text,
             Catch::Contains("rank 0 sent float x 100 to rank 1 (tag 3, #1) but rank 1's matching recv expects "
                             "float x 50"));
  const auto* unmatched = find_kind(group, trace_finding_kind::p2p_unmatched);
  REQUIRE(unmatched);
  CHECK(unmatched->sequence == 2);
  CHECK(unmatched->culprits == ranks{1});
  CHECK(unmatched->waiting == ranks{0});
  CHECK_THAT(unmatched->text, Catch::Contains("rank 0's send #2 to rank 1 (tag 5) has no matching recv on rank 1"));
  CHECK_THAT(group.notes[0], Catch::Contains("no rank issued a collective"));

  SECTION("a recv whose send the sender's complete ring does not hold") {
    trace_dir other("p2p_recv");
    other.write({.rank = 0, .world = 2, .entries = {p2p("send", 1, 1, 7, 4, "completed")}});
    other.write({.rank = 1, .world = 2, .entries = {p2p("recv", 1, 0, 7, 4, "completed"), p2p("recv", 2, 0, 7, 4)}});
    const auto other_report = cohort::analyze_traces(other.path);
    const auto& g = other_report.groups.at(0);
    REQUIRE(g.findings.size() == 1);
    CHECK(g.findings[0].kind == trace_finding_kind::p2p_unmatched);
    CHECK(g.findings[0].culprits == ranks{0});
    CHECK_THAT(g.findings[0].text, Catch::Contains("rank 1's recv #2 from rank 0 (tag 7) has no matching send on "
                                                   "rank 0"));
  }
}

TEST_CASE("trace: rings that do not reach back far enough are not read as accusations") {
  SECTION("same last_issued, one ring holding only newer sends: nothing to compare, nobody accused") {
    trace_dir dir("windows");
    // Rank 0's ring (4 calls) holds all_reduce #9..#12; rank 1's holds only the four sends it
    // issued after its #12, which was overwritten.
    dir.write({.rank = 0,
               .world = 2,
               .last_issued = 12,
               .last_completed = 11,
               .capacity = 4,
               .entries = all_reduces(9, 12, 12)});
    dir.write({.rank = 1,
               .world = 2,
               .last_issued = 12,
               .last_completed = 11,
               .capacity = 4,
               .entries = {p2p("send", 1, 0, 1, 64), p2p("send", 2, 0, 1, 64), p2p("send", 3, 0, 1, 64),
                           p2p("send", 4, 0, 1, 64)}});
    const auto report = cohort::analyze_traces(dir.path);
    const auto& group = report.groups.at(0);
    CHECK(group.missing.empty());
    for (const auto& finding : group.findings) {
      CHECK(finding.culprits.empty());
      CHECK(finding.kind != trace_finding_kind::never_issued);
      CHECK(finding.kind != trace_finding_kind::mismatch);
      CHECK(finding.kind != trace_finding_kind::p2p_unmatched);
      CHECK(finding.kind != trace_finding_kind::p2p_mismatch);
    }
    // The call not completed is still described, with what each ring can say about it.
    REQUIRE(group.findings.size() == 1);
    CHECK(group.findings[0].kind == trace_finding_kind::stuck);
    CHECK(group.findings[0].sequence == 12);
    CHECK_THAT(group.findings[0].text, Catch::Contains("(rank 0 started, rank 1 not completed)"));
    CHECK(any_contains(group.notes, "collective #12 cannot be compared: not every rank completed it"));
    CHECK(any_contains(group.notes, "rank 1's ring (4 calls) holds no collective"));
    CHECK(any_contains(group.notes, "cannot tell whether rank 0 posted recv #1 from rank 1 (tag 1)"));
  }
  SECTION("rings that do not overlap: only what last_issued proves is said, the signature stays unknown") {
    trace_dir dir("disjoint");
    dir.write({.rank = 0,
               .world = 2,
               .last_issued = 20,
               .last_completed = 10,
               .capacity = 4,
               .entries = all_reduces(17, 20, 17)});
    dir.write(
        {.rank = 1, .world = 2, .last_issued = 10, .last_completed = 10, .capacity = 4, .entries = all_reduces(7, 10)});
    const auto dir_report = cohort::analyze_traces(dir.path);
    const auto& group = dir_report.groups.at(0);
    REQUIRE(group.findings.size() == 1);
    const auto& finding = group.findings[0];
    CHECK(finding.kind == trace_finding_kind::never_issued);
    CHECK(finding.sequence == 11);
    CHECK(finding.culprits == ranks{1});
    CHECK(finding.waiting == ranks{0});
    CHECK_THAT(finding.text,
               Catch::Contains("rank 1 never issued collective #11 (kind and size unknown: rank 0's ring no "
                               "longer holds it); rank 0 issued it (state not completed)"));
  }
  SECTION("an older call only one ring holds, that the other rank has not completed, is not compared") {
    trace_dir dir("partial");
    auto left = all_reduces(1, 8, 5);
    left[4].kind = "all_gather";  // #5 differs from rank 1's #5, which rank 1's ring lost
    dir.write({.rank = 0, .world = 2, .last_issued = 8, .last_completed = 4, .entries = left});
    dir.write(
        {.rank = 1, .world = 2, .last_issued = 8, .last_completed = 4, .capacity = 2, .entries = all_reduces(7, 8, 7)});
    const auto dir_report = cohort::analyze_traces(dir.path);
    const auto& group = dir_report.groups.at(0);
    REQUIRE(group.findings.size() == 1);
    CHECK(group.findings[0].kind == trace_finding_kind::stuck);
    CHECK(group.findings[0].culprits.empty());
    CHECK_THAT(group.findings[0].text, Catch::StartsWith("all_gather #5 (float x 4096) did not complete"));
    CHECK(any_contains(group.notes, "collectives #5..#6 cannot be compared"));
    CHECK(any_contains(group.notes, "rank 1's ring (2 calls) starts at #7"));
  }
}

TEST_CASE("trace: corrupt, foreign and other-version files are named with what is wrong") {
  trace_dir dir("corrupt");
  dir.write({.rank = 0, .world = 3, .last_issued = 2, .last_completed = 2, .entries = all_reduces(1, 2)});
  std::string truncated = trace_document({.rank = 1, .world = 3}).dump(2);
  truncated.resize(truncated.size() / 2);
  dir.write_text("rank1.pg1.json", truncated);
  dir.write_text("rank2.pg1.json", R"({"tool": "cohort-bench", "rows": []})");
  json newer = trace_document({.rank = 0, .world = 1, .group = "pg2"});
  newer.set("version", 2);
  dir.write_text("rank0.pg2.json", newer.dump());
  json bad_entry = trace_document({.rank = 0, .world = 1, .entries = all_reduces(1, 1), .group = "pg3"});
  bad_entry.set("last_issued", 1);
  bad_entry.as_object().back().second.as_array()[0].set("count", "many");
  dir.write_text("rank0.pg3.json", bad_entry.dump());
  dir.write_text("notes.txt", "not a trace");

  const auto report = cohort::analyze_traces(dir.path);
  REQUIRE(report.problems.size() == 4);
  auto problem = [&](const std::string& name) -> std::string {
    for (const auto& p : report.problems)
      if (fs::path(p.path).filename() == name) return p.message;
    return "no problem reported for " + name;
  };
  CHECK_THAT(problem("rank1.pg1.json"), Catch::Contains("at line") && Catch::Contains("column"));
  CHECK_THAT(problem("rank2.pg1.json"), Catch::Contains("not a cohort flight-recorder trace"));
  CHECK_THAT(problem("rank0.pg2.json"), Catch::Contains("trace format version 2; this cohort-trace reads version 1"));
  CHECK_THAT(problem("rank0.pg3.json"), Catch::Contains("entries[0]: \"count\" is a string, expected an integer"));
  CHECK(report.ignored == std::vector<std::string>{"notes.txt"});
  // The readable file is still analysed; the unreadable ranks count as having written nothing.
  REQUIRE(report.groups.size() == 1);
  CHECK(report.groups[0].missing == ranks{1, 2});
  CHECK(report.has_findings());
  const std::string text = cohort::format_trace_report(report);
  CHECK_THAT(text, Catch::Contains("unreadable: " + (dir.path / "rank1.pg1.json").string() + ": "));

  // The library's single-file reader names the file in its error.
  try {
    (void)cohort::read_trace_file(dir.path / "rank1.pg1.json");
    FAIL("a truncated file was accepted");
  } catch (const cohort::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("rank1.pg1.json: ") && Catch::Contains("at line"));
  }
  CHECK_THROWS_AS(cohort::analyze_traces(dir.path / "no such directory"), cohort::error);
  CHECK_THROWS_WITH(cohort::parse_trace(R"({"version": 1, "group": "pg1"})"), Catch::Contains("missing \"backend\""));
  CHECK_THROWS_WITH(cohort::parse_trace("[1, 2]"), Catch::Contains("the top level is a JSON array"));
}

TEST_CASE("trace: agreeing, completed traces report nothing, and subgroups are kept apart") {
  trace_dir dir("clean");
  for (int rank : {0, 1}) {
    dir.write({.rank = rank, .world = 2, .last_issued = 3, .last_completed = 3, .entries = all_reduces(1, 3)});
    dir.write({.rank = rank,
               .world = 2,
               .last_issued = 1,
               .last_completed = 0,
               .entries = all_reduces(1, 1, 1),
               .group = "pg1.split0.color1"});
  }
  const auto report = cohort::analyze_traces(dir.path);
  REQUIRE(report.groups.size() == 2);
  CHECK(report.groups[0].group == "pg1");
  CHECK(report.groups[0].findings.empty());
  CHECK_FALSE(report.groups[0].has_findings());
  CHECK(any_contains(report.groups[0].notes, "every collective issued (#1..#3) completed on every rank"));
  CHECK(report.groups[1].group == "pg1.split0.color1");
  REQUIRE(report.groups[1].findings.size() == 1);
  CHECK(report.groups[1].findings[0].kind == trace_finding_kind::stuck);
  CHECK_THAT(report.groups[1].findings[0].text, Catch::Contains("every rank is in it, so the traces name no culprit"));
  CHECK(report.has_findings());

  trace_dir only_clean("clean_only");
  for (int rank : {0, 1})
    only_clean.write({.rank = rank, .world = 2, .last_issued = 3, .last_completed = 3, .entries = all_reduces(1, 3)});
  const auto clean = cohort::analyze_traces(only_clean.path);
  CHECK_FALSE(clean.has_findings());
  CHECK_THAT(cohort::format_trace_report(clean), Catch::Contains("no disagreement found"));
}
