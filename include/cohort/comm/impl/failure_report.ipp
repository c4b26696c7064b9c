#pragma once
// The failure side's definitions (cohort/comm/detail/failure_report.hpp): header-only, cold
// templates (COHORT_COLD) but for the watchdog's destructor, so that only a unit that runs an
// engine instantiates them; compiled once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION
// (see cohort/config.hpp).

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0::detail {

COHORT_COLD_BODY std::string describe(const call_record& call) {
  std::string text(to_string(call.kind));
  if (call.sequence != 0) text += detail::text(" #", std::to_string(call.sequence));
  const std::string context = call.context.empty() ? std::string() : detail::text(" [", call.context.view(), "]");
  if (call.kind == call_kind::barrier) return detail::text(text, context);
  text += detail::text(" (", cohort::to_string(call.type), " x ", std::to_string(call.count));
  if (call.kind == call_kind::all_reduce || call.kind == call_kind::reduce_scatter)
    text += detail::text(", ", cohort::to_string(call.reduce));
  if (call.kind == call_kind::broadcast) text += detail::text(", root ", std::to_string(call.peer));
  if (detail::is_point_to_point(call.kind)) {
    text += detail::text(", peer ", std::to_string(call.peer));
    if (call.tag != 0) text += detail::text(", tag ", std::to_string(call.tag));
  }
  return detail::text(text, ")", context);
}

COHORT_COLD_BODY std::string describe_with_peer(const call_record& call) {
  if (!detail::is_point_to_point(call.kind)) return describe(call);
  const bool sending = call.kind == call_kind::send;
  return detail::text(
      to_string(call.kind), (call.sequence != 0 ? detail::text(" #", std::to_string(call.sequence)) : ""),
      (sending ? " to rank " : " from rank "), std::to_string(call.peer), " of ",
      std::to_string(call.count * cohort::size_of(call.type)), " bytes (", cohort::to_string(call.type), " x ",
      std::to_string(call.count), (call.tag != 0 ? detail::text(", tag ", std::to_string(call.tag)) : ""), ")",
      (call.context.empty() ? "" : detail::text(" [", call.context.view(), "]")));
}

COHORT_COLD_BODY std::string group_name(const store& group_store) {
  // A subgroup's prefix_store wraps its parent's: the full prefix is the chain's, outermost last.
  std::string prefix;
  const store* level = &group_store;
  while (const auto* prefixed = dynamic_cast<const prefix_store*>(level)) {
    prefix = prefixed->prefix() + prefix;
    level = prefixed->inner().get();
  }
  // Keys above the group's own (a job's namespace, torchrun's attempt) are not its name.
  if (const auto own = prefix.find("cohort/pg"); own != std::string::npos) prefix.erase(0, own + 7);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  std::replace(prefix.begin(), prefix.end(), '/', '.');
  return prefix.empty() ? std::string("group") : prefix;
}

COHORT_COLD_BODY std::string trace_directory(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* value = std::getenv("COHORT_TRACE_DIR");
  return value ? std::string(value) : std::string();
}

COHORT_COLD_BODY std::string write_trace(const std::string& directory, const trace_identity& who,
                                         const flight_recorder& recorder, std::string_view failure) {
  if (directory.empty()) return {};
  try {
    const std::string path = detail::text(directory, "/rank", std::to_string(who.rank), ".", who.group, ".json");
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    std::string json = detail::text(
        "{\n  \"version\": 1,\n  \"group\": \"", json_escape(who.group), "\",\n  \"backend\": \"",
        json_escape(who.backend), "\",\n  \"rank\": ", std::to_string(who.rank),
        ",\n  \"world\": ", std::to_string(who.world), ",\n  \"host\": \"", json_escape(host),
        "\",\n  \"pid\": ", std::to_string(::getpid()), ",\n  \"written_us\": ", std::to_string(now_us()),
        ",\n  \"error\": \"", json_escape(failure), "\",\n  \"last_issued\": ", std::to_string(recorder.last_issued()),
        ",\n  \"last_completed\": ", std::to_string(recorder.last_completed()),
        ",\n  \"capacity\": ", std::to_string(recorder.capacity()), ",\n  \"entries\": [");
    const auto calls = recorder.snapshot();
    for (std::size_t k = 0; k < calls.size(); ++k) {
      const call_record& call = calls[k];
      json += detail::text(
          k ? "," : "", "\n    {\"sequence\": ", std::to_string(call.sequence), ", \"kind\": \"", to_string(call.kind),
          "\", \"dtype\": \"", cohort::to_string(call.type), "\", \"count\": ", std::to_string(call.count),
          ", \"op\": \"", cohort::to_string(call.reduce), "\", \"peer\": ", std::to_string(call.peer),
          ", \"tag\": ", std::to_string(call.tag), ", \"state\": \"", to_string(call.state),
          "\", \"issued_us\": ", std::to_string(call.issued_us), ", \"started_us\": ", std::to_string(call.started_us),
          ", \"completed_us\": ", std::to_string(call.completed_us),
          (call.context.empty() ? std::string()
                                : detail::text(", \"context\": \"", json_escape(call.context.view()), "\"")),
          "}");
    }
    json += "\n  ]\n}\n";
    // Written whole under a temporary name, then renamed: a reader never sees half a file.
    const std::string partial = detail::text(path, ".partial");
    std::FILE* file = std::fopen(partial.c_str(), "w");
    if (file == nullptr) return {};
    const bool written = std::fwrite(json.data(), 1, json.size(), file) == json.size();
    if (std::fclose(file) != 0 || !written || std::rename(partial.c_str(), path.c_str()) != 0) {
      std::remove(partial.c_str());
      return {};
    }
    return path;
  } catch (...) {
    return {};
  }
}

inline constexpr std::string_view status_format = "cohort-status-1";
inline constexpr std::uint8_t status_activities = 4;
inline constexpr std::uint8_t status_reductions = 5;

COHORT_COLD inline std::string status_key(int rank) { return detail::text("status/", std::to_string(rank)); }

// "all_reduce #7 (float x 8, sum)" without the context: what must be equal across ranks.
COHORT_COLD inline bool same_signature(const call_record& a, const call_record& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == call_kind::barrier) return true;
  if (a.type != b.type || a.count != b.count) return false;
  if ((a.kind == call_kind::all_reduce || a.kind == call_kind::reduce_scatter) && a.reduce != b.reduce) return false;
  if (a.kind == call_kind::broadcast && a.peer != b.peer) return false;
  return true;
}

// A status about call #s of this group: the rank is in it, failed in it, or left with it as
// its last call.
COHORT_COLD inline bool status_concerns(const rank_status& status, std::uint64_t sequence) {
  return status.activity != rank_activity::joined && status.call.sequence == sequence &&
         !is_point_to_point(status.call.kind);
}

COHORT_COLD [[gnu::cold]] inline std::string first_line_of(std::string_view text, std::size_t limit = 240) {
  std::string line(text.substr(0, text.find_first_of("\r\n")));
  if (line.size() > limit) line = detail::text(line.substr(0, limit), "...");
  return line;
}

COHORT_COLD [[gnu::cold]] inline std::string left_how(const rank_status& status) {
  std::string how = detail::text("left the group after issuing ", std::to_string(status.issued), " collective",
                                 (status.issued == 1 ? "" : "s"));
  if (!status.note.empty() || status.call.sequence != 0) {
    how += " (";
    if (!status.note.empty()) how += status.note;
    if (status.call.sequence != 0)
      how += detail::text((status.note.empty() ? "" : "; "), "its last: ", describe(status.call));
    how += ")";
  }
  return how;
}

// The parts of a disagreement, each naming ranks; see find_disagreement.
struct disagreement {
  std::vector<std::string> parts;
};

// `victims_doom`: a rank whose group failed in this very call dooms it too (a waiting rank
// stops waiting); a failing rank names such ranks as being in the call with it instead.
COHORT_COLD [[gnu::cold]] inline disagreement disagree(int rank, const call_record& mine,
                                                       std::span<const std::optional<rank_status>> statuses,
                                                       bool victims_doom, const rank_naming& names) {
  disagreement found;
  // Every call #s known: this rank's and those the others report, grouped by signature and
  // context, in rank order (so every rank lists them alike).
  std::vector<std::pair<call_record, std::vector<int>>> calls;
  bool differ = false;
  std::vector<std::pair<std::string, std::vector<int>>> left, failed, victims;
  const auto add = [](auto& groups, const std::string& what, int who) {
    for (auto& [text, ranks] : groups)
      if (text == what) return ranks.push_back(who);
    groups.push_back({what, {who}});
  };
  const auto place = [&](const call_record& call, int who) {
    for (auto& [known, ranks] : calls)
      if (same_signature(known, call) && known.context == call.context) return ranks.push_back(who);
    calls.push_back({call, {who}});
  };
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    const int peer = static_cast<int>(r);
    if (peer == rank) {
      place(mine, rank);
      continue;
    }
    if (!statuses[r]) continue;
    const rank_status& status = *statuses[r];
    if (status_concerns(status, mine.sequence)) {
      place(status.call, peer);
      if (!same_signature(mine, status.call)) differ = true;
      if (victims_doom && status.activity == rank_activity::failed && same_signature(mine, status.call))
        add(victims, detail::text("failed in ", describe(status.call), ": ", first_line_of(status.note)), peer);
      continue;
    }
    if (status.activity == rank_activity::left && status.issued < mine.sequence) {
      add(left, left_how(status), peer);
      continue;
    }
    if (status.activity == rank_activity::failed)
      add(failed,
          detail::text("failed", (status.call.sequence ? detail::text(" in ", describe(status.call)) : ""),
                       (status.note.empty() ? "" : detail::text(": ", first_line_of(status.note)))),
          peer);
  }
  // A rank that failed in this very call says why; when the calls differ, that is why.
  if (!differ) failed.insert(failed.begin(), victims.begin(), victims.end());
  // Ranks that entered evaluation() while the others are in another call or left: the cause,
  // said before the calls (which alone read as a generic mismatch).
  std::vector<int> evaluating, elsewhere;
  for (const auto& [call, ranks] : calls) {
    const bool in_evaluation = call.context.view().ends_with(evaluation_agreement);
    if (!in_evaluation && !differ) continue;  // the same call: it pairs with the agreement
    auto& into = in_evaluation ? evaluating : elsewhere;
    into.insert(into.end(), ranks.begin(), ranks.end());
  }
  for (const auto& [how, ranks] : left) elsewhere.insert(elsewhere.end(), ranks.begin(), ranks.end());
  if (!evaluating.empty() && !elsewhere.empty()) {
    std::sort(evaluating.begin(), evaluating.end());
    std::sort(elsewhere.begin(), elsewhere.end());
    found.parts.push_back(detail::text(names(evaluating),
                                       " entered evaluation() (sampling or evaluating) alone, without ",
                                       names(elsewhere), ": ", evaluation_alone_hint));
  }
  if (differ) {
    std::string text = detail::text(different_calls, std::to_string(mine.sequence), ": ");
    for (std::size_t k = 0; k < calls.size(); ++k) {
      const auto& [call, ranks] = calls[k];
      text += detail::text((k ? "; " : ""), names(ranks), (ranks.size() == 1 ? " is in " : " are in "), describe(call));
    }
    found.parts.push_back(std::move(text));
  }
  for (auto& [how, ranks] : left)
    found.parts.push_back(detail::text(names(ranks), " ", how, ", so ", (ranks.size() == 1 ? "it" : "they"),
                                       " never issued ", describe(mine)));
  for (auto& [what, ranks] : failed)
    found.parts.push_back(detail::text(names(ranks), (ranks.size() == 1 ? "'s group " : "' group "), what));
  return found;
}

COHORT_COLD [[gnu::cold]] inline std::string join_parts(const std::vector<std::string>& parts) {
  std::string text;
  for (const auto& part : parts) text += detail::text((text.empty() ? "" : "; "), part);
  return text;
}

COHORT_COLD_BODY std::string encode_status(const rank_status& status) {
  const call_record& call = status.call;
  std::string counts;
  for (const auto count : status.by_kind) counts += detail::text(",", std::to_string(count));
  return detail::text(status_format, "\n", std::to_string(static_cast<int>(status.activity)), ",",
                      std::to_string(status.issued), ",", std::to_string(status.completed), ",",
                      std::to_string(static_cast<int>(call.kind)), ",", std::to_string(call.sequence), ",",
                      std::to_string(static_cast<int>(call.type)), ",", std::to_string(call.count), ",",
                      std::to_string(static_cast<int>(call.reduce)), ",", std::to_string(call.peer), ",",
                      std::to_string(call.tag), counts, "\n", call.context.view(), "\n", status.note);
}

COHORT_COLD_BODY std::string describe_counts(const std::array<std::uint64_t, call_kinds>& by_kind) {
  std::vector<std::string> parts;
  for (std::size_t k = 0; k < call_kinds; ++k)
    if (by_kind[k] != 0)
      parts.push_back(detail::text(std::to_string(by_kind[k]), " ", to_string(static_cast<call_kind>(k)),
                                   (by_kind[k] == 1 ? "" : "s")));
  if (parts.empty()) return "no collectives";
  std::string text = parts.front();
  for (std::size_t k = 1; k < parts.size(); ++k)
    text += detail::text((k + 1 == parts.size() ? " and " : ", "), parts[k]);
  return text;
}

COHORT_COLD_BODY bool decode_status(std::string_view text, rank_status& out) {
  const auto line = [&](std::string_view& rest) {
    const auto end = rest.find('\n');
    if (end == std::string_view::npos) return std::optional<std::string_view>();
    const std::string_view head = rest.substr(0, end);
    rest.remove_prefix(end + 1);
    return std::optional<std::string_view>(head);
  };
  std::string_view rest = text;
  const auto format = line(rest);
  const auto numbers = line(rest);
  const auto context = line(rest);
  if (!format || *format != status_format || !numbers || !context) return false;
  constexpr int fields = 10 + static_cast<int>(call_kinds);
  std::uint64_t field[fields] = {};
  std::int64_t peer = 0;
  std::string_view list = *numbers;
  for (int k = 0; k < fields; ++k) {
    const auto end = std::min(list.find(','), list.size());
    const std::string_view item = list.substr(0, end);
    if (item.empty()) return false;
    const char* first = item.data();
    const char* last = item.data() + item.size();
    const auto [stop, status] = k == 8 ? std::from_chars(first, last, peer) : std::from_chars(first, last, field[k]);
    if (status != std::errc() || stop != last) return false;
    if ((k < fields - 1) != (end < list.size())) return false;
    list.remove_prefix(std::min(end + 1, list.size()));
  }
  if (field[0] >= status_activities || field[3] >= call_kinds || field[5] >= std::size(dtype_is_floating) ||
      field[7] >= status_reductions)
    return false;
  rank_status status;
  status.activity = static_cast<rank_activity>(field[0]);
  status.issued = field[1];
  status.completed = field[2];
  status.call.kind = static_cast<call_kind>(field[3]);
  status.call.sequence = field[4];
  status.call.type = static_cast<dtype>(field[5]);
  status.call.count = static_cast<std::size_t>(field[6]);
  status.call.reduce = static_cast<op>(field[7]);
  status.call.peer = static_cast<int>(peer);
  status.call.tag = field[9];
  for (std::size_t k = 0; k < call_kinds; ++k) status.by_kind[k] = field[10 + k];
  status.call.context.assign(*context);
  status.note = std::string(rest);
  out = std::move(status);
  return true;
}

COHORT_COLD_BODY std::string rank_naming::operator()(const std::vector<int>& group_ranks) const {
  if (is_world()) return format_ranks(group_ranks);
  std::vector<int> in_world;
  for (const int r : group_ranks) in_world.push_back(world_rank(r));
  return detail::text("world ", format_ranks(in_world), " (group ", format_ranks(group_ranks), ")");
}

COHORT_COLD_BODY std::string rank_naming::lead() const {
  if (is_world()) return {};
  std::string members;
  for (const int r : world) members += detail::text((members.empty() ? "" : ", "), std::to_string(r));
  return detail::text("group ", group, " (world ranks ", members, "): ");
}

COHORT_COLD_BODY status_board::status_board(std::shared_ptr<store> group_store, int rank, int size,
                                            std::chrono::milliseconds timeout, rank_naming names)
    : store_(std::move(group_store)), rank_(rank), size_(size), timeout_(timeout), names_(std::move(names)) {}

COHORT_COLD_BODY std::string status_board::location() const { return store_->location(); }

COHORT_COLD_BODY store& status_board::handle() {
  if (!own_made_) {
    // A store this handle could not reach a moment ago is not waited for again at once (the
    // progress monitor and a failing call ask one after the other).
    const auto now = std::chrono::steady_clock::now();
    if (!unreachable_.empty() && now - unreachable_at_ < window())
      throw error(rank_, "store", detail::text(unreachable_, " (", format_seconds(now - unreachable_at_), " ago)"));
    try {
      own_ = store_->bounded(window());  // throws when the store cannot be reached in time
    } catch (const std::exception& failure) {
      const auto* known = dynamic_cast<const error*>(&failure);
      unreachable_ = known ? known->detail() : std::string(failure.what());
      unreachable_at_ = std::chrono::steady_clock::now();
      throw;
    }
    unreachable_.clear();
    own_made_ = true;
  }
  return own_ ? *own_ : *store_;
}

COHORT_COLD_BODY void status_board::publish(const rank_status& status) {
  std::lock_guard lock(mutex_);
  store& board = handle();
  try {
    board.set(status_key(rank_), encode_status(status));
  } catch (...) {
    if (own_) own_made_ = false;  // a broken connection: the next request makes a new one
    throw;
  }
  if (status.activity == rank_activity::failed) failed_said_.store(true);
}

COHORT_COLD_BODY bool status_board::try_publish(const rank_status& status) noexcept {
  try {
    publish(status);
    return true;
  } catch (...) {
    return false;
  }
}

COHORT_COLD_BODY bool status_board::try_publish_on_group_store(const rank_status& status) noexcept {
  if (status.activity == rank_activity::left && failed_said_.load()) return false;
  try {
    store_->set(status_key(rank_), encode_status(status));
    if (status.activity == rank_activity::failed) failed_said_.store(true);
    return true;
  } catch (...) {
    return false;
  }
}

COHORT_COLD_BODY std::vector<std::optional<rank_status>> status_board::read(std::span<const int> ranks) {
  std::vector<int> every;
  if (ranks.empty()) {
    for (int r = 0; r < size_; ++r) every.push_back(r);
    ranks = every;
  }
  std::vector<std::string> keys;
  keys.reserve(ranks.size());
  for (const int r : ranks) keys.push_back(status_key(r));
  std::lock_guard lock(mutex_);
  store& board = handle();
  std::vector<std::optional<rank_status>> out(ranks.size());
  try {
    // Every rank wrote its key when it made the group, so one batched read answers at once;
    // keys missing still (a rank that never made it) are asked one by one.
    std::vector<bytes> values;
    bool all = true;
    try {
      values = board.multi_get(std::span<const std::string>(keys), std::chrono::milliseconds(1));
    } catch (const timeout_error&) {
      all = false;
    }
    for (std::size_t k = 0; k < keys.size(); ++k) {
      if (!all) {
        if (!board.check(std::span<const std::string>(&keys[k], 1))) continue;
        values.resize(keys.size());
        values[k] = board.get(keys[k], window());
      }
      rank_status status;
      if (decode_status(cohort::to_string(values[k]), status)) out[k] = std::move(status);
    }
  } catch (...) {
    if (own_) own_made_ = false;
    throw;
  }
  return out;
}

COHORT_COLD_BODY std::string find_disagreement(int rank, const call_record& mine,
                                               std::span<const std::optional<rank_status>> statuses,
                                               const rank_naming& names) {
  return join_parts(disagree(rank, mine, statuses, true, names).parts);
}

COHORT_COLD_BODY std::string name_the_peer(status_board& board, const call_record& mine, bool connection_lost) {
  const int peer = mine.peer;
  const std::string call = describe_with_peer(mine);
  const std::string own = detail::text("this rank is in ", call);
  if (peer < 0 || peer >= board.size() || peer == board.rank()) return own;
  // A rank says what it does when a call of its fails or waits long, and when it leaves: its
  // `joined` says nothing of this call. A peer that failed with this one says so within
  // moments; a closed connection was said before it closed (or its process is gone).
  const auto until = std::chrono::steady_clock::now() +
                     (connection_lost ? std::chrono::milliseconds(250) : std::chrono::milliseconds(board.window()));
  std::optional<rank_status> said;
  try {
    const int asked[1] = {peer};
    for (;;) {
      said = board.read(std::span<const int>(asked)).front();
      if ((said && said->activity != rank_activity::joined) || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(connection_lost ? 250 : 100));
    }
  } catch (const std::exception& failure) {
    return detail::text(own, "; what ", board.names()(peer), " does is unknown: the store cannot be reached (",
                        first_line_of(failure.what()), ")");
  }
  const std::string who = board.names()(peer);
  if (!said || said->activity == rank_activity::joined)
    return connection_lost
               ? detail::text(who, " (the peer) closed its connection: it died or exited during ", call)
               : detail::text(own, "; ", who, " said nothing of a call within ", format_duration(board.window()),
                              " (computing, or in a call that has not failed or waited long)");
  if (said->activity == rank_activity::left) return detail::text(own, "; ", who, " ", left_how(*said));
  const call_record& theirs = said->call;
  std::string text = detail::text(own, "; ", who, (said->activity == rank_activity::failed ? " failed in " : " is in "),
                                  describe_with_peer(theirs));
  // The peer's call is this one's pair (each names the other, same tag): then what differs.
  const bool paired = detail::is_point_to_point(theirs.kind) && theirs.kind != mine.kind &&
                      theirs.peer == board.rank() && theirs.tag == mine.tag;
  if (paired && (theirs.type != mine.type || theirs.count != mine.count))
    text += theirs.type != mine.type ? ": the dtypes differ" : ": the sizes differ";
  else if (!paired)
    text += detail::text(", not the ", (mine.kind == call_kind::send ? "recv" : "send"), " that pairs with this ",
                         to_string(mine.kind));
  return text;
}

COHORT_COLD_BODY call_record newest_collective(const flight_recorder& recorder) {
  const auto calls = recorder.snapshot();
  for (auto it = calls.rbegin(); it != calls.rend(); ++it)
    if (!is_point_to_point(it->kind)) return *it;
  return {};
}

COHORT_COLD_BODY std::string name_the_culprit(status_board& board, const call_record& mine, const rank_status& failed,
                                              bool connection_lost, std::span<const peer_status> known,
                                              const peer_probe& probe) {
  const int rank = board.rank();
  const int size = board.size();
  const std::string call = describe(mine);
  if (size < 2) return detail::text("this rank is in ", call);
  const auto window = board.window();
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + window;
  const auto seen = [&](int peer) {
    return static_cast<std::size_t>(peer) < known.size() ? known[static_cast<std::size_t>(peer)] : peer_status{};
  };
  // Asked at once, all together, of every peer the backend could not tell apart: alive but
  // silent, or cut off? (Threads of its own, not std::async: this cold path should not cost
  // every translation unit of a header-only program the futures' machinery.)
  std::vector<std::optional<peer_status>> asked(static_cast<std::size_t>(size));
  std::mutex asked_mutex;  // the askers write `asked` while the window reads it
  std::vector<std::jthread> askers;
  if (probe)
    for (int peer = 0; peer < size; ++peer)
      if (peer != rank && seen(peer).state == peer_state::unknown)
        askers.emplace_back([&, peer] {
          std::optional<peer_status> answer;
          try {
            answer = probe(peer);
          } catch (...) {}
          std::lock_guard lock(asked_mutex);
          asked[static_cast<std::size_t>(peer)] = std::move(answer);
        });
  // A peer the backend knows dead, or found unreachable, is not waited for; one whose
  // connection closed gets a moment (a peer that fails closes its connections just after it
  // says so).
  const auto gone = [&](int peer) {
    if (seen(peer).state == peer_state::stopped) return true;  // it cannot say anything now
    if (seen(peer).state == peer_state::died || seen(peer).state == peer_state::closed)
      return std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(300);
    std::lock_guard lock(asked_mutex);
    const auto& answer = asked[static_cast<std::size_t>(peer)];
    return answer && (answer->state == peer_state::unreachable || answer->state == peer_state::died);
  };
  const auto join_askers = [&] {
    for (auto& asker : askers)
      if (asker.joinable()) asker.join();
  };
  std::vector<std::optional<rank_status>> statuses(static_cast<std::size_t>(size));
  std::string unreachable_store;
  try {
    board.publish(failed);
    // A rank that fails publishes at once (its peers close their connections to it when they
    // fail, so a call of theirs ends as soon as one rank's does): wait until every peer has
    // said something about this call, left, failed, or is known dead, or the window ends.
    std::vector<int> open;
    for (int peer = 0; peer < size; ++peer)
      if (peer != rank) open.push_back(peer);
    for (;;) {
      const auto got = board.read(open);
      std::vector<int> still;
      for (std::size_t k = 0; k < open.size(); ++k) {
        const int peer = open[k];
        if (got[k]) statuses[static_cast<std::size_t>(peer)] = got[k];
        const auto& status = statuses[static_cast<std::size_t>(peer)];
        const bool settled =
            (status && (status_concerns(*status, mine.sequence) || status->activity == rank_activity::left ||
                        status->activity == rank_activity::failed)) ||
            gone(peer);
        if (!settled) still.push_back(peer);
      }
      open.swap(still);
      if (open.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          std::chrono::milliseconds(100), deadline - std::chrono::steady_clock::now()));
    }
  } catch (const std::exception& cut_off) {
    const auto* known_error = dynamic_cast<const error*>(&cut_off);
    const std::string where = board.location();
    unreachable_store =
        detail::text("cannot reach rank 0's store", (where.empty() ? "" : detail::text(" at ", where)), " within ",
                     format_duration(window), " (", (known_error ? known_error->detail() : std::string(cut_off.what())),
                     "): this rank is cut off from rank 0's node, or that node is lost");
  }
  join_askers();

  const disagreement found = disagree(rank, mine, statuses, false, board.names());
  std::vector<int> died, unreachable, stopped, closed, unknown, in_call{rank};
  std::vector<std::string> died_why, unreachable_why, stopped_why, closed_why, unknown_why;
  const auto note = [](std::vector<std::string>& list, const std::string& why) {
    if (!why.empty() && std::find(list.begin(), list.end(), why) == list.end()) list.push_back(why);
  };
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const auto& status = statuses[static_cast<std::size_t>(peer)];
    if (status && status_concerns(*status, mine.sequence)) {
      if (same_signature(status->call, mine)) in_call.push_back(peer);
      continue;  // in another call #s: the disagreement names it
    }
    if (status && (status->activity == rank_activity::failed ||
                   (status->activity == rank_activity::left && status->issued < mine.sequence)))
      continue;  // it said what it did: the disagreement names it
    peer_status state = seen(peer);
    if (state.state != peer_state::died && asked[static_cast<std::size_t>(peer)])
      state = *asked[static_cast<std::size_t>(peer)];
    if (state.state == peer_state::unknown && !probe && known.empty() && connection_lost)
      state.state = peer_state::died;
    // A closed connection proves a death only where nothing else explains it: a rank that
    // fails says so in the store before it closes, unless the store cannot be reached; and a
    // process this host sees running is not dead.
    if (state.state == peer_state::closed && !state.process_seen && unreachable_store.empty())
      state.state = peer_state::died;
    switch (state.state) {
      case peer_state::died:
        died.push_back(peer);
        note(died_why, state.why);
        break;
      case peer_state::unreachable:
        unreachable.push_back(peer);
        note(unreachable_why, state.why);
        break;
      case peer_state::stopped:
        stopped.push_back(peer);
        note(stopped_why, state.why);
        break;
      case peer_state::closed:
        closed.push_back(peer);
        note(closed_why, state.why);
        break;
      case peer_state::alive:
      case peer_state::unknown:
        unknown.push_back(peer);
        note(unknown_why, state.why);
        break;
    }
  }
  const auto reasons = [](std::string lead, const std::vector<std::string>& list) {
    for (const auto& why : list) lead += detail::text((lead.empty() ? "" : "; "), why);
    return lead.empty() ? lead : detail::text(" (", lead, ")");
  };
  std::vector<std::string> parts = found.parts;
  if (!died.empty())
    parts.push_back(detail::text(board.names()(died), " died or exited during ", call, reasons({}, died_why)));
  if (!unreachable.empty())
    parts.push_back(detail::text(board.names()(unreachable), (unreachable.size() == 1 ? " is" : " are"),
                                 " unreachable during ", call, reasons({}, unreachable_why)));
  if (!stopped.empty())
    parts.push_back(detail::text(board.names()(stopped), (stopped.size() == 1 ? " is" : " are"), " stopped during ",
                                 call, reasons({}, stopped_why)));
  if (!closed.empty())
    parts.push_back(
        detail::text(board.names()(closed), " closed ", (closed.size() == 1 ? "its connection" : "their connections"),
                     " during ", call,
                     reasons(unreachable_store.empty() ? std::string("no report: it fails or ends without saying so")
                                                       : std::string("no report: the store cannot be reached"),
                             closed_why)));
  if (!unknown.empty())
    parts.push_back(
        detail::text(board.names()(unknown), (unknown.size() == 1 ? " is" : " are"), " unknown",
                     reasons(unreachable_store.empty() ? detail::text("no report within ", format_duration(window),
                                                                      ": computing, stopped, or blocked outside cohort")
                                                       : std::string("no report: the store cannot be reached"),
                             unknown_why)));
  if (!unreachable_store.empty()) parts.push_back(unreachable_store);
  std::string text = join_parts(parts);
  if (text.empty()) text = detail::text("every rank reports ", call);
  std::sort(in_call.begin(), in_call.end());
  const bool lost = connection_lost || !died.empty();
  if (text.find(different_calls) == std::string::npos)  // that part already says who is in which call
    text = detail::text(text, "; ", board.names()(in_call), (in_call.size() == 1 ? " is" : " are"),
                        (lost ? " in " : " waiting in "), call);
  if (unreachable_store.empty()) {  // the whole story, for ranks that read it later
    rank_status told = failed;
    told.note = text;
    board.try_publish(told);
  }
  return text;
}

COHORT_COLD_BODY progress_monitor::progress_monitor(status_board& board, std::string group, settings when)
    : board_(board), group_(std::move(group)), when_(when) {}

COHORT_COLD_BODY std::string progress_monitor::tick(const std::optional<pending_call>& pending,
                                                    const rank_status& now_status) {
  if (!pending) {
    watching_ = 0;
    return {};
  }
  if (pending->call.sequence != watching_) {
    watching_ = pending->call.sequence;
    published_ = false;
    found_.clear();
    next_compare_ = when_.compare_after.count() > 0 ? pending->since + when_.compare_after
                                                    : std::chrono::steady_clock::time_point::max();
    next_line_ = when_.progress_interval.count() > 0 ? pending->since + when_.progress_interval
                                                     : std::chrono::steady_clock::time_point::max();
  }
  const auto now = std::chrono::steady_clock::now();
  std::string verdict;
  if (now >= next_compare_) {
    next_compare_ = now + std::max<std::chrono::milliseconds>(when_.compare_after, std::chrono::seconds(5));
    verdict = compare(*pending, now_status);
  }
  if (verdict.empty() && now >= next_line_) {
    while (next_line_ <= now) next_line_ += when_.progress_interval;
    say(*pending, now);
  }
  return verdict;
}

COHORT_COLD_BODY std::string progress_monitor::compare(const pending_call& pending, const rank_status& now) {
  const int rank = board_.rank();
  const call_record& mine = pending.call;
  try {
    if (!published_) {
      rank_status status = now;
      status.activity = rank_activity::in_call;
      status.call = mine;
      board_.publish(status);
      published_ = true;
    }
    auto statuses = board_.read();
    std::string verdict = find_disagreement(rank, mine, statuses, board_.names());
    if (!verdict.empty()) {
      // Doomed. Ranks that began waiting a moment after this one say what they are in a
      // moment later: given up to a second, every rank's error names every rank's call.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      const auto told = [&] {
        for (int peer = 0; peer < board_.size(); ++peer) {
          const auto& status = statuses[static_cast<std::size_t>(peer)];
          if (peer != rank &&
              !(status && (status_concerns(*status, mine.sequence) || status->activity == rank_activity::left ||
                           status->activity == rank_activity::failed)))
            return false;
        }
        return true;
      };
      while (!told() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        statuses = board_.read();
      }
      return find_disagreement(rank, mine, statuses, board_.names());
    }
    std::vector<int> with, without;
    for (int peer = 0; peer < board_.size(); ++peer) {
      if (peer == rank) continue;
      const auto& status = statuses[static_cast<std::size_t>(peer)];
      (status && status_concerns(*status, mine.sequence) ? with : without).push_back(peer);
    }
    found_.clear();
    if (!with.empty()) found_ = detail::text(board_.names()(with), (with.size() == 1 ? " is" : " are"), " in it too");
    if (!without.empty())
      found_ += detail::text((found_.empty() ? "" : "; "), "waiting for ", board_.names()(without),
                             " (no report of this call yet: not there yet, computing, or cannot be asked)");
  } catch (const std::exception& failure) {
    const std::string where = board_.location();
    found_ = detail::text("the store", (where.empty() ? "" : detail::text(" at ", where)),
                          " cannot be reached, so which ranks it waits for is unknown (", first_line_of(failure.what()),
                          ")");
  }
  return {};
}

COHORT_COLD_BODY void progress_monitor::say(const pending_call& pending,
                                            std::chrono::steady_clock::time_point now) const {
  progress_line(
      board_.names().world_rank(board_.rank()),
      detail::text((board_.names().is_world() ? detail::text(group_, ": ") : board_.names().lead()),
                   describe(pending.call), " has waited ", format_seconds(now - pending.since), " of its ",
                   format_duration(board_.timeout()), " timeout", (found_.empty() ? "" : detail::text("; ", found_))));
}

COHORT_COLD_BODY watchdog::watchdog(int rank, std::string group, async_error_handling policy,
                                    std::chrono::milliseconds interval, check_fn check)
    : rank_(rank),
      group_(std::move(group)),
      policy_(policy),
      interval_(interval),
      check_(std::move(check)),
      thread_([this] { loop(); }) {}

COHORT_DECL watchdog::~watchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

COHORT_COLD_BODY void watchdog::loop() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (wake_.wait_for(lock, interval_, [this] { return stopping_; })) return;
    lock.unlock();
    std::exception_ptr failure;
    try {
      failure = check_();
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    if (failure) {
      lock.unlock();
      act(failure);
      return;  // one failure ends a group: nothing later can be trusted
    }
  }
}

COHORT_COLD_BODY void watchdog::act(std::exception_ptr failure) {
  if (policy_ == async_error_handling::throw_on_next_call) {
    std::lock_guard lock(mutex_);
    failure_ = std::move(failure);
    found_.store(true, std::memory_order_release);
    return;
  }
  std::string message = "unknown failure";
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& known) {
    message = known.what();
    record_error_for_launcher(known);
  } catch (...) {
    record_error_for_launcher("unknown", message);
  }
  std::fprintf(stderr,
               "[cohort rank %d] watchdog of group %s: %s\n[cohort rank %d] ending the process (exit status 1): "
               "nothing waited for this work through cohort; set the backend option on_async_error = "
               "async_error_handling::throw_on_next_call to have the next call throw instead\n",
               rank_, group_.c_str(), message.c_str(), rank_);
  std::fflush(stderr);
  std::fflush(stdout);
  // No destructors: other threads may be inside the broken engine, and joining them would hang.
  std::_Exit(1);
}

}  // namespace cohort::inline v0::detail
