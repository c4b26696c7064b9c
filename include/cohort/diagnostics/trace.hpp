#pragma once
// cohort's flight-recorder analyzer: reads the trace files ranks write when a collective fails
// (COHORT_TRACE_DIR=DIR), compares them across ranks and names the rank at fault. The
// installed program cohort-trace is a thin front end.
// Over 400 lines: one reader and analysis, used only by cohort-trace and its tests (not in
// the umbrella header, so no trainer compiles it).
//
// ---------------------------------------------------------------------------------------
// Trace file, version 1: DIR/rank<R>.<group>.json, one per rank and process group (R is the
// rank inside the group; group names look like pg1 or pg1.split0.color1).
//
//   {"version": 1, "group": "pg1", "backend": "gloo", "rank": 2, "world": 4,
//    "host": "node7", "pid": 1234, "written_us": 1764600000000000,   // system_clock, us
//    "error": "the failure that made this rank write the file",
//    "last_issued": 12,      // highest collective sequence this rank issued (0: none)
//    "last_completed": 11,   // highest collective sequence completed on this rank
//    "capacity": 2048,       // ring size: only the last `capacity` calls are kept
//    "entries": [            // oldest first
//      {"sequence": 11, "kind": "all_reduce", "dtype": "float", "count": 4096, "op": "sum",
//       "peer": -1, "tag": 0, "state": "completed",
//       "issued_us": ..., "started_us": ..., "completed_us": ...}]}     // 0: not reached
//
//   kind: all_reduce, reduce_scatter, all_gather, broadcast (peer = root), all_to_all,
//   barrier, send, recv (peer = the other rank, tag = the user's tag). Collectives count
//   1, 2, 3 ... per group in issue order; send and recv count per (peer, tag, direction):
//   the n-th send from A to B with tag t matches the n-th recv on B from A with tag t.
//   state: issued (queued, not started), started, completed, failed.
//
// ---------------------------------------------------------------------------------------
// What the analysis trusts. Calls complete in issue order on a rank (one FIFO worker on
// Gloo, one stream on NCCL), so last_issued and last_completed speak for every sequence,
// even those the ring no longer holds: s > last_issued was never issued, s <= last_completed
// completed. A call's signature (kind, dtype, count, op, root) is known only while the ring
// holds it; a ring that never filled (fewer entries than capacity) holds the rank's whole
// history. Signatures are compared only where every rank's ring reaches; older calls that
// some rank has not completed are reported as not judged rather than guessed at. A rank is
// accused only on what its own file says, or on what the files of the others prove.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/tools/detail/json.hpp"

namespace cohort::inline v0 {

inline constexpr int trace_format_version = 1;

// One recorded call.
struct trace_entry {
  std::int64_t sequence = 0;
  std::string kind;   // all_reduce ... barrier, send, recv
  std::string dtype;  // as types.hpp names them: float, double, half, bfloat16, int32, int64, uint8
  std::int64_t count = 0;
  std::string op;        // sum, avg, ...; meaningful for all_reduce and reduce_scatter only
  int peer = -1;         // broadcast: the root; send/recv: the other rank; else -1
  std::int64_t tag = 0;  // send/recv: the user's tag
  std::string state;     // issued, started, completed, failed
  std::int64_t issued_us = 0, started_us = 0, completed_us = 0;  // 0: not reached

  bool point_to_point() const noexcept { return kind == "send" || kind == "recv"; }
};

// One rank's file.
struct trace_file {
  std::filesystem::path path;  // empty when parsed from text
  int version = trace_format_version;
  std::string group;
  std::string backend;
  int rank = 0;
  int world = 1;
  std::string host;
  std::int64_t pid = 0;
  std::int64_t written_us = 0;
  std::string error;
  std::int64_t last_issued = 0;
  std::int64_t last_completed = 0;
  std::int64_t capacity = 0;
  std::vector<trace_entry> entries;

  // The ring filled up: calls older than entries.front() were overwritten.
  bool wrapped() const noexcept { return static_cast<std::int64_t>(entries.size()) >= capacity; }
};

enum class trace_finding_kind {
  never_issued,   // some ranks issued collective #s, others never did
  mismatch,       // ranks issued different collectives at the same sequence
  stuck,          // every rank agrees, but the oldest call not completed is named
  p2p_mismatch,   // a send and its matching recv disagree on dtype or count
  p2p_unmatched,  // a send without its recv, or a recv without its send
};

constexpr std::string_view to_string(trace_finding_kind kind) noexcept {
  switch (kind) {
    case trace_finding_kind::never_issued: return "never_issued";
    case trace_finding_kind::mismatch: return "mismatch";
    case trace_finding_kind::stuck: return "stuck";
    case trace_finding_kind::p2p_mismatch: return "p2p_mismatch";
    case trace_finding_kind::p2p_unmatched: return "p2p_unmatched";
  }
  return "?";
}

struct trace_finding {
  trace_finding_kind kind = trace_finding_kind::stuck;
  std::int64_t sequence = 0;  // the collective's sequence, or the send/recv's per-stream one
  std::vector<int> culprits;  // the ranks at fault as far as the traces tell (may be empty)
  std::vector<int> waiting;   // the ranks that issued the call, or the other side of a send/recv
  std::string text;           // one sentence naming ranks and calls
};

struct trace_rank_summary {
  int rank = 0;
  std::string path;
  std::string host;
  std::int64_t pid = 0;
  std::int64_t written_us = 0;
  std::int64_t last_issued = 0;
  std::int64_t last_completed = 0;
  std::int64_t entries = 0;
  std::int64_t capacity = 0;
  std::string error;  // first line, shortened
};

struct trace_group_report {
  std::string group;
  std::string backend;
  int world = 0;
  std::vector<int> present;  // ranks with a trace
  std::vector<int> missing;  // ranks without one
  std::vector<trace_rank_summary> ranks;
  std::vector<trace_finding> findings;  // collectives first (at most the first disagreement), then send/recv
  std::vector<std::string> notes;       // what could not be judged and why; odd files

  bool has_findings() const noexcept { return !findings.empty() || !missing.empty(); }
};

struct trace_problem {
  std::string path;
  std::string message;  // what is wrong with the file
};

struct trace_report {
  std::string directory;
  std::vector<trace_group_report> groups;
  std::vector<trace_problem> problems;  // trace files that could not be read
  std::vector<std::string> ignored;     // other files in the directory (not rank<R>.<group>.json)

  bool has_findings() const noexcept {
    if (!problems.empty()) return true;
    for (const auto& group : groups)
      if (group.has_findings()) return true;
    return false;
  }
};

namespace detail {

[[noreturn]] inline void trace_format_error(const std::string& what, const std::string& hint = {}) {
  throw error(-1, "read trace", what, hint);
}

inline const json& trace_field(const json& object, std::string_view key, const std::string& where) {
  const json* value = object.find(key);
  if (!value) trace_format_error(detail::text(where, "missing \"", key, "\""));
  return *value;
}

inline std::int64_t trace_int(const json& object, std::string_view key, const std::string& where, std::int64_t lo,
                              std::int64_t hi) {
  const json& value = trace_field(object, key, where);
  const std::string name = detail::text(where, "\"", key, "\"");
  if (!value.is_number()) trace_format_error(detail::text(name, " is a ", value.type_name(), ", expected an integer"));
  const double number = value.as_number();
  if (std::floor(number) != number || std::fabs(number) > 9007199254740992.0)
    trace_format_error(detail::text(name, " = ", json::format_number(number), ", expected an integer"));
  if (number < static_cast<double>(lo) || number > static_cast<double>(hi))
    trace_format_error(detail::text(name, " = ", json::format_number(number), " is outside ", std::to_string(lo), "..",
                                    std::to_string(hi)));
  return static_cast<std::int64_t>(number);
}

inline std::string trace_string(const json& object, std::string_view key, const std::string& where) {
  const json& value = trace_field(object, key, where);
  if (!value.is_string())
    trace_format_error(detail::text(where, "\"", key, "\" is a ", value.type_name(), ", expected a string"));
  return value.as_string();
}

inline constexpr std::string_view trace_kinds[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                                   "all_to_all", "barrier",        "send",       "recv"};
inline constexpr std::string_view trace_states[] = {"issued", "started", "completed", "failed"};

template <std::size_t N>
bool trace_one_of(std::string_view value, const std::string_view (&names)[N]) {
  return std::find(std::begin(names), std::end(names), value) != std::end(names);
}

// "all_reduce #7 (float x 4096, sum)", "broadcast #2 (float x 10, root 0)", "barrier #4".
inline std::string describe_collective(const trace_entry& e) {
  std::string text = detail::text(e.kind, " #", std::to_string(e.sequence));
  if (e.kind == "barrier") return text;
  text += detail::text(" (", e.dtype, " x ", std::to_string(e.count));
  if (e.kind == "all_reduce" || e.kind == "reduce_scatter") text += detail::text(", ", e.op);
  if (e.kind == "broadcast") text += detail::text(", root ", std::to_string(e.peer));
  return detail::text(text, ")");
}

// What must be equal on every rank; op counts for the reductions only, the root for broadcast.
inline std::string collective_signature(const trace_entry& e) {
  if (e.kind == "barrier") return e.kind;
  std::string key = detail::text(e.kind, "|", e.dtype, "|", std::to_string(e.count));
  if (e.kind == "all_reduce" || e.kind == "reduce_scatter") key += detail::text("|", e.op);
  if (e.kind == "broadcast") key += detail::text("|", std::to_string(e.peer));
  return key;
}

// "send #2 to rank 1 (float x 100, tag 3)", "recv #1 from rank 0 (float x 50, tag 3)".
inline std::string describe_p2p(const trace_entry& e) {
  return detail::text(e.kind, " #", std::to_string(e.sequence), (e.kind == "send" ? " to rank " : " from rank "),
                      std::to_string(e.peer), " (", e.dtype, " x ", std::to_string(e.count), ", tag ",
                      std::to_string(e.tag), ")");
}

inline std::string describe_call(const trace_entry& e) {
  return e.point_to_point() ? describe_p2p(e) : describe_collective(e);
}

inline std::string first_line_shortened(std::string_view text, std::size_t limit = 200) {
  const auto newline = text.find_first_of("\r\n");
  std::string line(text.substr(0, newline));
  if (line.size() > limit || newline != std::string_view::npos) {
    if (line.size() > limit) line.resize(limit);
    line += " ...";
  }
  return line;
}

// 2025-12-01 14:40:00.123 UTC
inline std::string format_utc(std::int64_t microseconds_since_epoch) {
  using namespace std::chrono;
  const sys_time<microseconds> when{microseconds{microseconds_since_epoch}};
  const auto day = floor<days>(when);
  const year_month_day date{day};
  const hh_mm_ss time{floor<milliseconds>(when - day)};
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%04d-%02u-%02u %02lld:%02lld:%02lld.%03lld UTC", int(date.year()),
                unsigned(date.month()), unsigned(date.day()), static_cast<long long>(time.hours().count()),
                static_cast<long long>(time.minutes().count()), static_cast<long long>(time.seconds().count()),
                static_cast<long long>(time.subseconds().count()));
  return buffer;
}

inline std::string is_are(const std::vector<int>& ranks) { return ranks.size() == 1 ? "is" : "are"; }

// rank<R>.<group>.json -> (R, group); nullopt for any other name.
inline std::optional<std::pair<int, std::string>> parse_trace_file_name(std::string_view name) {
  constexpr std::string_view prefix = "rank", suffix = ".json";
  if (name.size() <= prefix.size() + suffix.size() || name.substr(0, prefix.size()) != prefix ||
      name.substr(name.size() - suffix.size()) != suffix)
    return std::nullopt;
  std::string_view rest = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  std::size_t digits = 0;
  while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  if (digits == 0 || digits > 9 || digits + 1 >= rest.size() || rest[digits] != '.') return std::nullopt;
  return std::make_pair(std::stoi(std::string(rest.substr(0, digits))), std::string(rest.substr(digits + 1)));
}

}  // namespace detail

// Parses one trace file's text; throws cohort::error ("read trace" / "json parse") saying
// what is wrong and where.
inline trace_file parse_trace(std::string_view text) {
  using detail::json;
  using detail::trace_format_error;
  using detail::trace_int;
  using detail::trace_string;
  const json document = detail::parse_json(text);
  if (!document.is_object())
    trace_format_error(detail::text("the top level is a JSON ", document.type_name(), ", not an object"),
                       "expected a cohort flight-recorder trace (rank<R>.<group>.json)");
  const json* version = document.find("version");
  if (!version)
    trace_format_error("no \"version\" key: not a cohort flight-recorder trace",
                       "cohort-trace reads the rank<R>.<group>.json files ranks write under COHORT_TRACE_DIR");
  trace_file file;
  file.version = static_cast<int>(trace_int(document, "version", "", 0, 1 << 30));
  if (file.version != trace_format_version)
    trace_format_error(detail::text("trace format version ", std::to_string(file.version),
                                    "; this cohort-trace reads version ", std::to_string(trace_format_version)),
                       "analyze it with the cohort-trace of the cohort version that wrote it");
  constexpr std::int64_t big = std::int64_t{1} << 53;
  file.group = trace_string(document, "group", "");
  if (file.group.empty()) trace_format_error("\"group\" is empty");
  file.backend = trace_string(document, "backend", "");
  file.world = static_cast<int>(trace_int(document, "world", "", 1, 1 << 24));
  file.rank = static_cast<int>(trace_int(document, "rank", "", 0, file.world - 1));
  file.host = trace_string(document, "host", "");
  file.pid = trace_int(document, "pid", "", 0, big);
  file.written_us = trace_int(document, "written_us", "", 0, big);
  file.error = trace_string(document, "error", "");
  file.last_issued = trace_int(document, "last_issued", "", 0, big);
  file.last_completed = trace_int(document, "last_completed", "", 0, file.last_issued);
  file.capacity = trace_int(document, "capacity", "", 1, big);
  const json& entries = detail::trace_field(document, "entries", "");
  if (!entries.is_array()) trace_format_error(detail::text("\"entries\" is a ", entries.type_name(), ", not an array"));
  if (static_cast<std::int64_t>(entries.size()) > file.capacity)
    trace_format_error(detail::text("\"entries\" holds ", std::to_string(entries.size()),
                                    " calls, more than \"capacity\" ", std::to_string(file.capacity)));
  std::set<std::int64_t> collectives;
  std::set<std::tuple<int, std::int64_t, bool, std::int64_t>> streams;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const json& item = entries.at(i);
    const std::string where = detail::text("entries[", std::to_string(i), "]: ");
    if (!item.is_object()) trace_format_error(detail::text(where, "a ", item.type_name(), ", not an object"));
    trace_entry e;
    e.sequence = trace_int(item, "sequence", where, 1, big);
    e.kind = trace_string(item, "kind", where);
    if (!detail::trace_one_of(e.kind, detail::trace_kinds))
      trace_format_error(detail::text(where, "unknown kind \"", e.kind, "\""),
                         "all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, barrier, send, recv");
    e.dtype = trace_string(item, "dtype", where);
    e.count = trace_int(item, "count", where, 0, big);
    e.op = trace_string(item, "op", where);
    e.peer = static_cast<int>(trace_int(item, "peer", where, -1, file.world - 1));
    e.tag = trace_int(item, "tag", where, -big, big);
    e.state = trace_string(item, "state", where);
    if (!detail::trace_one_of(e.state, detail::trace_states))
      trace_format_error(detail::text(where, "unknown state \"", e.state, "\""), "issued, started, completed, failed");
    e.issued_us = trace_int(item, "issued_us", where, 0, big);
    e.started_us = trace_int(item, "started_us", where, 0, big);
    e.completed_us = trace_int(item, "completed_us", where, 0, big);
    if (e.point_to_point()) {
      if (e.peer < 0 || e.peer == file.rank)
        trace_format_error(
            detail::text(where, e.kind, " with peer ", std::to_string(e.peer), " on rank ", std::to_string(file.rank)));
      if (!streams.insert({e.peer, e.tag, e.kind == "send", e.sequence}).second)
        trace_format_error(detail::text(where, detail::describe_p2p(e), " appears twice"));
    } else {
      if (e.kind == "broadcast" && e.peer < 0)
        trace_format_error(detail::text(where, "broadcast without a root (\"peer\" -1)"));
      if (e.sequence > file.last_issued)
        trace_format_error(detail::text(where, e.kind, " #", std::to_string(e.sequence), " is past \"last_issued\" #",
                                        std::to_string(file.last_issued)));
      if (!collectives.insert(e.sequence).second)
        trace_format_error(detail::text(where, "collective #", std::to_string(e.sequence), " appears twice"));
    }
    file.entries.push_back(std::move(e));
  }
  return file;
}

// Reads and parses one file; errors name the file.
inline trace_file read_trace_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw error(-1, "read trace", detail::text("cannot open \"", path.string(), "\""),
                "check the path and permissions");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    trace_file file = parse_trace(text);
    file.path = path;
    return file;
  } catch (const error& e) {
    throw error(-1, "read trace", detail::text(path.string(), ": ", e.detail()), e.hint());
  }
}

namespace detail {

struct trace_rank_view {
  const trace_file* file = nullptr;
  std::map<std::int64_t, const trace_entry*> collectives;
  // (peer, tag, is_send) -> sequence -> entry
  std::map<std::tuple<int, std::int64_t, bool>, std::map<std::int64_t, const trace_entry*>> streams;
  std::int64_t known_from = 1;  // the oldest collective sequence whose signature this file can tell

  const trace_entry* collective(std::int64_t sequence) const {
    const auto found = collectives.find(sequence);
    return found == collectives.end() ? nullptr : found->second;
  }
};

inline trace_rank_view make_rank_view(const trace_file& file) {
  trace_rank_view view;
  view.file = &file;
  for (const auto& e : file.entries) {
    if (e.point_to_point())
      view.streams[{e.peer, e.tag, e.kind == "send"}][e.sequence] = &e;
    else
      view.collectives[e.sequence] = &e;
  }
  if (file.wrapped())
    view.known_from = view.collectives.empty() ? file.last_issued + 1 : view.collectives.begin()->first;
  return view;
}

// "(state started)" when all agree, "(rank 0 started, ranks 1, 3 issued)" otherwise.
inline std::string describe_states(const std::vector<std::pair<int, std::string>>& states) {
  std::vector<std::pair<std::string, std::vector<int>>> by_state;
  for (const auto& item : states) {
    auto found = std::find_if(by_state.begin(), by_state.end(),
                              [&](const auto& existing) { return existing.first == item.second; });
    if (found == by_state.end())
      by_state.push_back({item.second, {item.first}});
    else
      found->second.push_back(item.first);
  }
  if (by_state.size() == 1) return detail::text("(state ", by_state.front().first, ")");
  std::string text = "(";
  for (std::size_t k = 0; k < by_state.size(); ++k)
    text += detail::text((k ? ", " : ""), format_ranks(by_state[k].second), " ", by_state[k].first);
  return detail::text(text, ")");
}

inline bool all_waiting(const std::vector<std::pair<int, std::string>>& states) {
  return std::all_of(states.begin(), states.end(),
                     [](const auto& item) { return item.second == "issued" || item.second == "started"; });
}

// The state of collective #s on a rank: its entry's, or what last_completed proves.
inline std::string collective_state(const trace_rank_view& view, std::int64_t sequence) {
  if (const trace_entry* e = view.collective(sequence)) return e->state;
  if (view.file->last_completed >= sequence) return "completed";
  return "not completed";
}

inline std::string newest_call(const trace_rank_view& view) {
  const trace_file& f = *view.file;
  if (f.entries.empty()) return detail::text("rank ", std::to_string(f.rank), " recorded no call");
  const trace_entry& e = f.entries.back();
  return detail::text("rank ", std::to_string(f.rank), "'s newest call is ", describe_call(e), ", ", e.state);
}

// The signature groups of the ranks' entries at one sequence, largest group first (ties: the
// group holding the lowest rank first).
struct signature_group {
  std::string signature;
  const trace_entry* example = nullptr;
  std::vector<int> ranks;
};
inline std::vector<signature_group> group_signatures(const std::vector<std::pair<int, const trace_entry*>>& calls) {
  std::vector<signature_group> groups;
  for (const auto& [rank, e] : calls) {
    const std::string signature = collective_signature(*e);
    auto found =
        std::find_if(groups.begin(), groups.end(), [&](const auto& item) { return item.signature == signature; });
    if (found == groups.end())
      groups.push_back({signature, e, {rank}});
    else
      found->ranks.push_back(rank);
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const auto& a, const auto& b) { return a.ranks.size() > b.ranks.size(); });
  return groups;
}

inline trace_finding mismatch_finding(std::int64_t sequence, const std::vector<signature_group>& groups) {
  trace_finding finding;
  finding.kind = trace_finding_kind::mismatch;
  finding.sequence = sequence;
  const bool majority = groups.size() > 1 && groups[0].ranks.size() > groups[1].ranks.size();
  if (majority) {
    finding.waiting = groups[0].ranks;
    for (std::size_t k = 1; k < groups.size(); ++k) {
      finding.culprits.insert(finding.culprits.end(), groups[k].ranks.begin(), groups[k].ranks.end());
      finding.text += detail::text((k > 1 ? "; " : ""), format_ranks(groups[k].ranks), " issued ",
                                   describe_collective(*groups[k].example), " where ", format_ranks(groups[0].ranks),
                                   " issued ", describe_collective(*groups[0].example));
    }
  } else {
    finding.text = detail::text("ranks disagree at collective #", std::to_string(sequence), ": ");
    for (std::size_t k = 0; k < groups.size(); ++k) {
      finding.culprits.insert(finding.culprits.end(), groups[k].ranks.begin(), groups[k].ranks.end());
      finding.text += detail::text((k ? "; " : ""), format_ranks(groups[k].ranks), " issued ",
                                   describe_collective(*groups[k].example));
    }
    finding.text += " (no majority: the traces cannot tell which side is wrong)";
  }
  std::sort(finding.culprits.begin(), finding.culprits.end());
  return finding;
}

inline void analyze_collectives(const std::vector<trace_rank_view>& views, trace_group_report& report) {
  std::int64_t lowest_issued = views.front().file->last_issued, highest_issued = lowest_issued;
  std::int64_t lowest_completed = views.front().file->last_completed, known_from = 1;
  const trace_rank_view* shortest = &views.front();  // the ring that reaches back least far
  for (const auto& view : views) {
    lowest_issued = std::min(lowest_issued, view.file->last_issued);
    highest_issued = std::max(highest_issued, view.file->last_issued);
    lowest_completed = std::min(lowest_completed, view.file->last_completed);
    if (view.known_from > known_from) {
      known_from = view.known_from;
      shortest = &view;
    }
  }
  if (highest_issued == 0) {
    report.notes.push_back("no rank issued a collective in this group");
    return;
  }

  // Older calls that some rank has not completed, but whose signatures not every ring holds.
  const std::int64_t unjudged_last = std::min(known_from - 1, lowest_issued);
  if (lowest_completed + 1 <= unjudged_last) {
    const trace_file& f = *shortest->file;
    const bool several = unjudged_last > lowest_completed + 1;
    report.notes.push_back(detail::text(
        (several
             ? detail::text("collectives #", std::to_string(lowest_completed + 1), "..#", std::to_string(unjudged_last))
             : detail::text("collective #", std::to_string(unjudged_last))),
        " cannot be compared: not every rank completed ", (several ? "them" : "it"), ", and rank ",
        std::to_string(f.rank), "'s ring (", std::to_string(f.capacity), " calls) ",
        (shortest->collectives.empty()
             ? "holds no collective"
             : detail::text("starts at #", std::to_string(shortest->collectives.begin()->first)))));
  }

  // 1. Signatures, where every rank issued the call and every ring holds it.
  const std::int64_t first = std::max<std::int64_t>(known_from, 1);
  std::set<std::int64_t> sequences;  // bounded by the rings, whatever last_issued claims
  for (const auto& view : views) {
    const auto from = view.collectives.lower_bound(first), to = view.collectives.upper_bound(lowest_issued);
    const auto held = std::distance(from, to);
    for (auto it = from; it != to; ++it) sequences.insert(it->first);
    if (first <= lowest_issued && held < lowest_issued - first + 1)
      report.notes.push_back(detail::text(
          "rank ", std::to_string(view.file->rank), "'s trace lacks ", std::to_string(lowest_issued - first + 1 - held),
          " of the collectives #", std::to_string(first), "..#", std::to_string(lowest_issued),
          " it issued (an incomplete or inconsistent file): those are compared without it"));
  }
  for (const std::int64_t s : sequences) {
    std::vector<std::pair<int, const trace_entry*>> calls;
    for (const auto& view : views)
      if (const trace_entry* e = view.collective(s)) calls.emplace_back(view.file->rank, e);
    const auto groups = group_signatures(calls);
    if (groups.size() > 1) {
      report.findings.push_back(mismatch_finding(s, groups));
      return;
    }
  }

  // 2. A rank that stopped issuing: nobody issued past lowest_issued on it.
  if (lowest_issued < highest_issued) {
    const std::int64_t s = lowest_issued + 1;
    trace_finding finding;
    finding.kind = trace_finding_kind::never_issued;
    finding.sequence = s;
    std::vector<std::pair<int, const trace_entry*>> calls;
    std::vector<std::pair<int, std::string>> states;
    std::vector<const trace_rank_view*> silent;
    for (const auto& view : views) {
      if (view.file->last_issued < s) {
        finding.culprits.push_back(view.file->rank);
        silent.push_back(&view);
        continue;
      }
      finding.waiting.push_back(view.file->rank);
      states.emplace_back(view.file->rank, collective_state(view, s));
      if (const trace_entry* e = view.collective(s)) calls.emplace_back(view.file->rank, e);
    }
    const auto groups = group_signatures(calls);
    const std::string call =
        groups.empty()
            ? detail::text(
                  "collective #", std::to_string(s), " (kind and size unknown: ",
                  (finding.waiting.size() == 1
                       ? detail::text("rank ", std::to_string(finding.waiting[0]), "'s ring no longer holds it)")
                       : detail::text("the rings of ", format_ranks(finding.waiting), " no longer hold it)")))
            : describe_collective(*groups[0].example);
    finding.text = detail::text(
        format_ranks(finding.culprits), " never issued ", call, "; ", format_ranks(finding.waiting), " issued it",
        (all_waiting(states) ? detail::text(" and ", is_are(finding.waiting), " waiting in it ") : " "),
        describe_states(states));
    for (std::size_t k = 0; k < silent.size() && k < 4; ++k)
      finding.text += detail::text("; ", newest_call(*silent[k]));
    report.findings.push_back(std::move(finding));
    if (groups.size() > 1) report.findings.push_back(mismatch_finding(s, groups));
    return;
  }

  // 3. Every rank issued the same calls: the oldest one not completed everywhere.
  if (lowest_completed >= highest_issued) {
    report.notes.push_back(detail::text("every collective issued (#1..#", std::to_string(highest_issued),
                                        ") completed on every rank with a trace"));
    return;
  }
  const std::int64_t s = lowest_completed + 1;
  trace_finding finding;
  finding.kind = trace_finding_kind::stuck;
  finding.sequence = s;
  finding.culprits = report.missing;
  const trace_entry* example = nullptr;
  std::vector<int> done;
  std::vector<std::pair<int, std::string>> states;
  for (const auto& view : views) {
    if (!example) example = view.collective(s);
    if (view.file->last_completed >= s) {
      done.push_back(view.file->rank);
    } else {
      finding.waiting.push_back(view.file->rank);
      states.emplace_back(view.file->rank, collective_state(view, s));
    }
  }
  const std::string call = example ? describe_collective(*example) : detail::text("collective #", std::to_string(s));
  finding.text =
      detail::text(call, " did not complete: ",
                   (done.empty() ? std::string() : detail::text("it completed on ", format_ranks(done), "; ")),
                   format_ranks(finding.waiting), " issued it",
                   (all_waiting(states) ? detail::text(" and ", is_are(finding.waiting), " waiting in it ") : " "),
                   describe_states(states));
  if (!report.missing.empty())
    finding.text +=
        detail::text("; ", format_ranks(report.missing), " wrote no trace and ", is_are(report.missing), " the suspect",
                     (report.missing.size() == 1 ? "" : "s"), " (died, stopped, or still running outside cohort)");
  else if (done.empty())
    finding.text +=
        "; every rank is in it, so the traces name no culprit: see the errors (a lost link, a device "
        "fault, an aborted communicator)";
  report.findings.push_back(std::move(finding));
}

// How many calls of one send/recv stream a rank issued, when its file can tell: a ring that
// never filled holds them all; a full one holds the newest, so a stream with entries ends at
// its newest entry, and one with none in a full ring is unknown.
inline std::optional<std::int64_t> stream_length(const trace_rank_view& view,
                                                 const std::map<std::int64_t, const trace_entry*>* stream) {
  if (stream && !stream->empty()) return stream->rbegin()->first;
  if (!view.file->wrapped()) return 0;
  return std::nullopt;
}

inline void analyze_point_to_point(const std::vector<trace_rank_view>& views, trace_group_report& report) {
  std::map<int, const trace_rank_view*> by_rank;
  for (const auto& view : views) by_rank[view.file->rank] = &view;
  // (sender, receiver, tag) of every stream either side recorded.
  std::set<std::tuple<int, int, std::int64_t>> pairs;
  for (const auto& view : views)
    for (const auto& [key, stream] : view.streams) {
      const auto& [peer, tag, is_send] = key;
      if (is_send)
        pairs.insert({view.file->rank, peer, tag});
      else
        pairs.insert({peer, view.file->rank, tag});
    }
  auto stream_of = [](const trace_rank_view* view, int peer, std::int64_t tag,
                      bool is_send) -> const std::map<std::int64_t, const trace_entry*>* {
    if (!view) return nullptr;
    const auto found = view->streams.find({peer, tag, is_send});
    return found == view->streams.end() ? nullptr : &found->second;
  };
  for (const auto& [from, to, tag] : pairs) {
    const auto sender_it = by_rank.find(from), receiver_it = by_rank.find(to);
    if (sender_it == by_rank.end() || receiver_it == by_rank.end()) continue;  // that side wrote no trace
    const trace_rank_view* sender = sender_it->second;
    const trace_rank_view* receiver = receiver_it->second;
    const auto* sends = stream_of(sender, to, tag, true);
    const auto* recvs = stream_of(receiver, from, tag, false);
    const std::string a = detail::text("rank ", std::to_string(from)), b = detail::text("rank ", std::to_string(to));
    const std::string tag_text = detail::text("tag ", std::to_string(tag));
    bool reported = false;
    if (sends) {
      for (const auto& [n, send] : *sends) {
        const trace_entry* recv = nullptr;
        if (recvs)
          if (const auto found = recvs->find(n); found != recvs->end()) recv = found->second;
        if (recv) {
          if (recv->dtype != send->dtype || recv->count != send->count) {
            report.findings.push_back(
                {trace_finding_kind::p2p_mismatch,
                 n,
                 {from, to},
                 {},
                 detail::text(a, " sent ", send->dtype, " x ", std::to_string(send->count), " to ", b, " (", tag_text,
                              ", #", std::to_string(n), ") but ", b, "'s matching recv expects ", recv->dtype, " x ",
                              std::to_string(recv->count), " (send ", send->state, ", recv ", recv->state, ")")});
            reported = true;
            break;
          }
          continue;
        }
        const auto posted = stream_length(*receiver, recvs);
        if (!posted) {
          report.notes.push_back(detail::text("cannot tell whether ", b, " posted recv #", std::to_string(n), " from ",
                                              a, " (", tag_text, "): its full ring holds no recv of that stream"));
          reported = true;
          break;
        }
        if (*posted < n) {
          std::string what = detail::text(a, "'s send #", std::to_string(n), " to ", b, " (", tag_text,
                                          ") has no matching recv on ", b, ": ", b);
          what += detail::text(" posted ", std::to_string(*posted), (*posted == 1 ? " recv" : " recvs"), " from ", a,
                               " with ", tag_text, " (the send: ", send->dtype, " x ", std::to_string(send->count),
                               ", state ", send->state, ")");
          report.findings.push_back({trace_finding_kind::p2p_unmatched, n, {to}, {from}, std::move(what)});
          reported = true;
          break;
        }
        // Otherwise the recv is older than the receiver's ring: nothing to compare.
      }
    }
    if (reported || !recvs) continue;
    for (const auto& [n, recv] : *recvs) {
      if (sends && sends->count(n)) continue;  // compared above
      const auto posted = stream_length(*sender, sends);
      if (!posted) {
        report.notes.push_back(detail::text("cannot tell whether ", a, " posted send #", std::to_string(n), " to ", b,
                                            " (", tag_text, "): its full ring holds no send of that stream"));
        break;
      }
      if (*posted < n) {
        std::string what = detail::text(b, "'s recv #", std::to_string(n), " from ", a, " (", tag_text,
                                        ") has no matching send on ", a, ": ", a);
        what += detail::text(" posted ", std::to_string(*posted), (*posted == 1 ? " send" : " sends"), " to ", b,
                             " with ", tag_text, " (the recv: ", recv->dtype, " x ", std::to_string(recv->count),
                             ", state ", recv->state, ")");
        report.findings.push_back({trace_finding_kind::p2p_unmatched, n, {from}, {to}, std::move(what)});
        break;
      }
    }
  }
}

}  // namespace detail

// One group's files (the same "group"). Two files of one rank: the newer one is used.
inline trace_group_report analyze_group(std::vector<trace_file> files) {
  if (files.empty()) throw error(-1, "analyze traces", "no trace files for the group");
  trace_group_report report;
  report.group = files.front().group;
  std::sort(files.begin(), files.end(), [](const trace_file& a, const trace_file& b) {
    return std::tie(a.rank, b.written_us) < std::tie(b.rank, a.written_us);  // newest first per rank
  });
  std::vector<trace_file> kept;
  for (auto& file : files) {
    if (file.group != report.group)
      throw error(-1, "analyze traces",
                  detail::text("group \"", file.group, "\" among the files of group \"", report.group, "\""),
                  "pass one group's files to analyze_group");
    if (!kept.empty() && kept.back().rank == file.rank) {
      report.notes.push_back(detail::text(
          "rank ", std::to_string(file.rank), " has two traces: using ", kept.back().path.filename().string(),
          " (written ", detail::format_utc(kept.back().written_us), "), not ", file.path.filename().string(),
          " (written ", detail::format_utc(file.written_us), ")"));
      continue;
    }
    kept.push_back(std::move(file));
  }

  std::set<std::string> backends;
  std::set<int> worlds;
  std::int64_t first_written = kept.front().written_us, last_written = first_written;
  for (const auto& file : kept) {
    backends.insert(file.backend);
    worlds.insert(file.world);
    first_written = std::min(first_written, file.written_us);
    last_written = std::max(last_written, file.written_us);
    if (!file.path.empty()) {
      const auto named = detail::parse_trace_file_name(file.path.filename().string());
      if (named && (named->first != file.rank || named->second != file.group))
        report.notes.push_back(detail::text(file.path.filename().string(), " holds rank ", std::to_string(file.rank),
                                            " of group ", file.group, ": renamed or copied?"));
    }
    report.present.push_back(file.rank);
    trace_rank_summary summary;
    summary.rank = file.rank;
    summary.path = file.path.string();
    summary.host = file.host;
    summary.pid = file.pid;
    summary.written_us = file.written_us;
    summary.last_issued = file.last_issued;
    summary.last_completed = file.last_completed;
    summary.entries = static_cast<std::int64_t>(file.entries.size());
    summary.capacity = file.capacity;
    summary.error = detail::first_line_shortened(file.error);
    report.ranks.push_back(std::move(summary));
  }
  report.world = *worlds.rbegin();
  for (const auto& name : backends) report.backend += (report.backend.empty() ? "" : "/") + name;
  if (worlds.size() > 1) {
    std::string sizes;
    for (int world : worlds) sizes += (sizes.empty() ? "" : ", ") + std::to_string(world);
    report.notes.push_back(detail::text("the files disagree on the world size (", sizes, "): using ",
                                        std::to_string(report.world), "; some may be left from another run"));
  }
  if (backends.size() > 1)
    report.notes.push_back(
        detail::text("the files disagree on the backend (", report.backend, "): some may be left from another run"));
  if (last_written - first_written > std::int64_t{300} * 1000000)
    report.notes.push_back(
        detail::text("the traces were written ", std::to_string((last_written - first_written) / 1000000),
                     " s apart: some may be left from an earlier run (the directory is not cleared between runs)"));
  for (int rank = 0; rank < report.world; ++rank)
    if (!std::binary_search(report.present.begin(), report.present.end(), rank)) report.missing.push_back(rank);

  std::vector<detail::trace_rank_view> views;
  for (const auto& file : kept) views.push_back(detail::make_rank_view(file));
  detail::analyze_collectives(views, report);
  detail::analyze_point_to_point(views, report);
  return report;
}

// Every rank<R>.<group>.json in `directory`, grouped and analysed. Files that cannot be read
// become problems (the others are still analysed); a directory that cannot be listed throws.
inline trace_report analyze_traces(const std::filesystem::path& directory) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(directory, ec))
    throw error(-1, "analyze traces", detail::text("\"", directory.string(), "\" is not a directory"),
                "give the COHORT_TRACE_DIR the run wrote its traces to");
  trace_report report;
  report.directory = directory.string();
  std::vector<fs::path> paths;
  fs::directory_iterator it(directory, ec), end;
  if (ec) throw error(-1, "analyze traces", detail::text("cannot list \"", directory.string(), "\": ", ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) throw error(-1, "analyze traces", detail::text("cannot list \"", directory.string(), "\": ", ec.message()));
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) && detail::parse_trace_file_name(name))
      paths.push_back(it->path());
    else
      report.ignored.push_back(name);
  }
  std::sort(paths.begin(), paths.end());
  std::sort(report.ignored.begin(), report.ignored.end());
  std::map<std::string, std::vector<trace_file>> groups;
  for (const auto& path : paths) {
    try {
      trace_file file = read_trace_file(path);
      groups[file.group].push_back(std::move(file));
    } catch (const error& e) {
      std::string message = e.detail();
      if (message.rfind(detail::text(path.string(), ": "), 0) == 0) message.erase(0, path.string().size() + 2);
      if (!e.hint().empty()) message += detail::text(" (hint: ", e.hint(), ")");
      report.problems.push_back({path.string(), message});
    }
  }
  for (auto& [name, files] : groups) report.groups.push_back(analyze_group(std::move(files)));
  return report;
}

// The report as cohort-trace prints it.
inline std::string format_trace_report(const trace_report& report) {
  std::ostringstream out;
  std::size_t files = report.problems.size();
  for (const auto& group : report.groups) files += group.ranks.size();
  out << "cohort-trace: " << files << " trace file" << (files == 1 ? "" : "s") << " in " << report.directory << ", "
      << report.groups.size() << " group" << (report.groups.size() == 1 ? "" : "s") << "\n";
  if (!report.ignored.empty())
    out << "(ignored " << report.ignored.size() << " other file" << (report.ignored.size() == 1 ? "" : "s")
        << ", not named rank<R>.<group>.json)\n";
  for (const auto& problem : report.problems)
    out << "\nunreadable: " << problem.path << ": " << problem.message << "\n";
  for (const auto& group : report.groups) {
    out << "\ngroup " << group.group << " (" << group.backend << ", world " << group.world << ")\n";
    for (const auto& rank : group.ranks)
      out << "  rank " << rank.rank << " (" << rank.host << ", pid " << rank.pid << "): "
          << (rank.last_issued == 0 ? std::string("no collective issued")
                                    : detail::text("collectives issued #", std::to_string(rank.last_issued),
                                                   ", completed #", std::to_string(rank.last_completed)))
          << "; " << rank.entries << " of " << rank.capacity << " calls kept; written "
          << detail::format_utc(rank.written_us) << "\n";
    if (!group.missing.empty())
      out << "  " << detail::format_ranks(group.missing) << " wrote no trace (still running, stopped, or died before "
          << (group.missing.size() == 1 ? "it" : "they") << " could)\n";
    if (!group.findings.empty()) {
      out << "  findings\n";
      for (const auto& finding : group.findings) out << "  - " << finding.text << "\n";
    } else if (group.missing.empty()) {
      out << "  no disagreement found\n";
    }
    if (!group.notes.empty()) {
      out << "  notes\n";
      for (const auto& note : group.notes) out << "  - " << note << "\n";
    }
    bool any_error = false;
    for (const auto& rank : group.ranks) any_error = any_error || !rank.error.empty();
    if (any_error) {
      out << "  errors\n";
      for (const auto& rank : group.ranks)
        if (!rank.error.empty()) out << "    rank " << rank.rank << ": " << rank.error << "\n";
    }
  }
  return out.str();
}

inline std::string to_json(const trace_report& report, int indent = 1) {
  using detail::json;
  // Built in place: GCC 12 at -O3 reports a false maybe-uninitialized for json temporaries
  // moved into an array.
  auto ranks = [](const std::vector<int>& list) {
    json::array out;
    out.reserve(list.size());
    for (int rank : list) out.emplace_back(rank);
    return json(std::move(out));
  };
  json groups = json::make_array();
  for (const auto& group : report.groups) {
    json item = json::make_object();
    item.set("group", group.group);
    item.set("backend", group.backend);
    item.set("world", group.world);
    item.set("present", ranks(group.present));
    item.set("missing", ranks(group.missing));
    json summaries = json::make_array();
    for (const auto& rank : group.ranks) {
      json summary = json::make_object();
      summary.set("rank", rank.rank);
      summary.set("path", rank.path);
      summary.set("host", rank.host);
      summary.set("pid", rank.pid);
      summary.set("written_us", rank.written_us);
      summary.set("last_issued", rank.last_issued);
      summary.set("last_completed", rank.last_completed);
      summary.set("entries", rank.entries);
      summary.set("capacity", rank.capacity);
      summary.set("error", rank.error);
      summaries.push_back(std::move(summary));
    }
    item.set("ranks", std::move(summaries));
    json findings = json::make_array();
    for (const auto& finding : group.findings) {
      json entry = json::make_object();
      entry.set("kind", to_string(finding.kind));
      entry.set("sequence", finding.sequence);
      entry.set("culprits", ranks(finding.culprits));
      entry.set("waiting", ranks(finding.waiting));
      entry.set("text", finding.text);
      findings.push_back(std::move(entry));
    }
    item.set("findings", std::move(findings));
    json notes = json::make_array();
    for (const auto& note : group.notes) notes.push_back(note);
    item.set("notes", std::move(notes));
    groups.push_back(std::move(item));
  }
  json problems = json::make_array();
  for (const auto& problem : report.problems) {
    json entry = json::make_object();
    entry.set("path", problem.path);
    entry.set("error", problem.message);
    problems.push_back(std::move(entry));
  }
  json ignored = json::make_array();
  for (const auto& name : report.ignored) ignored.push_back(name);
  json document = json::make_object();
  document.set("tool", "cohort-trace");
  document.set("directory", report.directory);
  document.set("groups", std::move(groups));
  document.set("problems", std::move(problems));
  document.set("ignored", std::move(ignored));
  document.set("has_findings", report.has_findings());
  return document.dump(indent);
}

}  // namespace cohort::inline v0
