#pragma once
// The failure side's definitions (cohort/comm/detail/failure_report.hpp): inline there when
// header-only, compiled once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see
// cohort/config.hpp).

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL std::string describe(const call_record& call) {
  std::string text(to_string(call.kind));
  if (call.sequence != 0) text += detail::text(" #", std::to_string(call.sequence));
  if (call.kind == call_kind::barrier) return text;
  text += detail::text(" (", cohort::to_string(call.type), " x ", std::to_string(call.count));
  if (call.kind == call_kind::all_reduce || call.kind == call_kind::reduce_scatter)
    text += detail::text(", ", cohort::to_string(call.reduce));
  if (call.kind == call_kind::broadcast) text += detail::text(", root ", std::to_string(call.peer));
  if (detail::is_point_to_point(call.kind)) {
    text += detail::text(", peer ", std::to_string(call.peer));
    if (call.tag != 0) text += detail::text(", tag ", std::to_string(call.tag));
  }
  return detail::text(text, ")");
}

COHORT_DECL std::string group_name(const store& group_store) {
  // A subgroup's prefix_store wraps its parent's: the full prefix is the chain's, outermost last.
  std::string prefix;
  const store* level = &group_store;
  while (const auto* prefixed = dynamic_cast<const prefix_store*>(level)) {
    prefix = prefixed->prefix() + prefix;
    level = prefixed->inner().get();
  }
  if (prefix.rfind("cohort/", 0) == 0) prefix.erase(0, 7);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  std::replace(prefix.begin(), prefix.end(), '/', '.');
  return prefix.empty() ? std::string("group") : prefix;
}

COHORT_DECL std::string trace_directory(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* value = std::getenv("COHORT_TRACE_DIR");
  return value ? std::string(value) : std::string();
}

COHORT_DECL std::string write_trace(const std::string& directory, const trace_identity& who,
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
          ", \"completed_us\": ", std::to_string(call.completed_us), "}");
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

COHORT_DECL std::string name_the_culprit(store& group_store, int rank, int size, std::chrono::milliseconds timeout,
                                         const std::string& call, bool connection_lost, const peer_probe& probe) {
  if (size < 2) return detail::text("this rank is in ", call);
  // Each rank that fails publishes the call it is in; a rank that is not in a cohort call
  // (still computing, stopped, dead) publishes nothing. The window is short and bounded, and
  // so is every store request in it: a handle of its own bounded by the window (the group's
  // handle waits as long as the store's own timeout, minutes, when the store has gone silent).
  const auto window = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
  const auto deadline = std::chrono::steady_clock::now() + window;
  const auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(1));
  };
  const std::string prefix = "failure/";
  std::vector<int> died, unreachable, never, waiting{rank};
  std::vector<std::string> died_why, unreachable_why, never_why, differ;
  const auto note = [](std::vector<std::string>& list, const std::string& why) {
    if (!why.empty() && std::find(list.begin(), list.end(), why) == list.end()) list.push_back(why);
  };
  try {
    std::shared_ptr<store> own;
    try {
      own = group_store.bounded(window);
    } catch (const std::exception& cut_off) {
      const std::string where = group_store.location();
      const auto* known = dynamic_cast<const error*>(&cut_off);
      return detail::text("this rank is in ", call, "; cannot reach rank 0's store",
                          (where.empty() ? "" : detail::text(" at ", where)), " within ", format_duration(window), " (",
                          (known ? known->detail() : cut_off.what()),
                          "): this rank is cut off from rank 0's node, or rank 0 died");
    }
    store& reports = own ? *own : group_store;
    reports.set(prefix + std::to_string(rank), call);
    // A peer known dead now sends no more reports: nobody waits for it, but one it sent before
    // it died still counts (it was in the call: a victim, not the culprit).
    std::vector<std::string> keys;
    std::vector<int> peers;
    std::vector<bool> dead;
    std::vector<std::string> dead_why;
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      const peer_status status = probe ? probe(peer, false) : peer_status{};
      keys.push_back(prefix + std::to_string(peer));
      peers.push_back(peer);
      dead.push_back(status.state == peer_state::died);
      dead_why.push_back(status.why);
    }
    // One wait for the reports of the living; when some never come, which did is asked key
    // by key (so are the dead's).
    std::vector<std::string> expected;
    for (std::size_t k = 0; k < keys.size(); ++k)
      if (!dead[k]) expected.push_back(keys[k]);
    std::vector<bool> present(keys.size(), true);
    bool all_came = true;
    try {
      reports.wait(std::span<const std::string>(expected), left());
    } catch (const timeout_error&) {
      all_came = false;
    }
    for (std::size_t k = 0; k < keys.size(); ++k)
      if (dead[k] || !all_came) present[k] = reports.check(std::span<const std::string>(&keys[k], 1));
    std::vector<std::string> readable;
    for (std::size_t k = 0; k < keys.size(); ++k)
      if (present[k]) readable.push_back(keys[k]);
    const auto values = reports.multi_get(std::span<const std::string>(readable), left());
    // Silent peers: what are they? Asked again now, after the window (dead stays dead), all
    // at once: telling alive from unreachable may take a second each.
    // (Threads of its own, not std::async: this cold path should not cost every translation
    // unit of a header-only program the futures' machinery.)
    std::vector<std::optional<peer_status>> asked(keys.size());
    std::vector<std::exception_ptr> asking_failed(keys.size());
    {
      std::vector<std::jthread> askers;
      for (std::size_t k = 0; k < keys.size(); ++k)
        if (!present[k] && !dead[k] && probe)
          askers.emplace_back([&, k] {
            try {
              asked[k] = probe(peers[k], true);
            } catch (...) {
              asking_failed[k] = std::current_exception();
            }
          });
    }  // joins every asker
    for (std::size_t k = 0, v = 0; k < keys.size(); ++k) {
      const int peer = peers[k];
      if (present[k]) {
        const std::string theirs = cohort::to_string(values[v++]);
        if (theirs == call)
          waiting.push_back(peer);
        else
          differ.push_back(detail::text("rank ", std::to_string(peer), " is in ", theirs));
        continue;
      }
      if (asking_failed[k]) std::rethrow_exception(asking_failed[k]);
      const peer_status status =
          dead[k] ? peer_status{peer_state::died, dead_why[k]} : asked[k].value_or(peer_status{});
      switch (status.state) {
        case peer_state::died:
          died.push_back(peer);
          note(died_why, status.why);
          break;
        case peer_state::unreachable:
          unreachable.push_back(peer);
          note(unreachable_why, status.why);
          break;
        case peer_state::alive:
          never.push_back(peer);
          note(never_why, status.why);
          break;
        case peer_state::unknown: (connection_lost ? died : never).push_back(peer); break;
      }
    }
  } catch (const std::exception& unreachable_store) {
    const std::string where = group_store.location();
    return detail::text("this rank is in ", call, "; no failure reports: the group's store",
                        (where.empty() ? "" : detail::text(" at ", where)), " is unreachable (",
                        unreachable_store.what(), "), so the rank that serves it (rank 0 of the job) may have died");
  }
  // A dead peer was not waited for: its reasons are the probe's alone.
  const auto reasons = [&](const std::vector<std::string>& list, bool waited) {
    std::string text = waited ? detail::text("no report within ", format_duration(window)) : std::string();
    for (const auto& why : list) text += (text.empty() ? "" : "; ") + why;
    return text.empty() ? text : detail::text(" (", text, ")");
  };
  for (auto* list : {&died, &unreachable, &never, &waiting}) std::sort(list->begin(), list->end());
  std::vector<std::string> parts;
  if (!died.empty())
    parts.push_back(detail::text(format_ranks(died), " died or exited during ", call, reasons(died_why, !probe)));
  if (!unreachable.empty())
    parts.push_back(detail::text(format_ranks(unreachable), (unreachable.size() == 1 ? " is" : " are"),
                                 " unreachable during ", call, reasons(unreachable_why, true)));
  if (!never.empty())
    parts.push_back(detail::text(format_ranks(never), " never issued ", call, reasons(never_why, true)));
  for (const auto& line : differ) parts.push_back(line);
  std::string text;
  for (const auto& part : parts) text += (text.empty() ? "" : "; ") + part;
  if (text.empty()) text = detail::text("every rank reports ", call);
  const bool lost = connection_lost || !died.empty();
  return detail::text(text, "; ", format_ranks(waiting), (waiting.size() == 1 ? " is" : " are"),
                      (lost ? " in " : " waiting in "), call);
}

COHORT_DECL watchdog::watchdog(int rank, std::string group, async_error_handling policy,
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

COHORT_DECL void watchdog::loop() {
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

COHORT_DECL void watchdog::act(std::exception_ptr failure) {
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
