#pragma once
// launch.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see config.hpp).

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"

namespace cohort::inline v0 {

namespace detail {

inline std::string_view trim_spaces(std::string_view text) {
  constexpr std::string_view spaces = " \t\r\n";
  const auto first = text.find_first_not_of(spaces);
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(spaces);
  return text.substr(first, last - first + 1);
}

inline std::optional<long long> parse_integer(std::string_view text) {
  text = trim_spaces(text);
  long long value = 0;
  const auto* end = text.data() + text.size();
  const auto [stop, status] = std::from_chars(text.data(), end, value);
  if (text.empty() || status != std::errc{} || stop != end) return std::nullopt;
  return value;
}

inline bool all_digits(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A malformed list like "n[0-999999999]" must fail, not exhaust memory.
inline constexpr std::size_t max_expanded_entries = 1'000'000;

[[noreturn]] inline void fail_nodelist(std::string_view nodelist, const std::string& why) {
  throw error(-1, "expand_slurm_nodelist", detail::text("cannot expand '", nodelist, "': ", why),
              "Slurm writes lists like 'gpu[01-03,07],cpu1'; check SLURM_JOB_NODELIST");
}

[[noreturn]] inline void fail_tasks_per_node(std::string_view tasks_per_node, const std::string& why) {
  throw error(-1, "expand_slurm_tasks_per_node", detail::text("cannot expand '", tasks_per_node, "': ", why),
              "Slurm writes counts like '2(x3),1'; check SLURM_TASKS_PER_NODE");
}

// Calls item(text) for each comma-separated item, empty ones included ("a,,b" has three):
// both of Slurm's list formats are split this way before their items are parsed.
template <class Item>
void for_each_comma_item(std::string_view list, Item&& item) {
  std::size_t start = 0;
  while (start <= list.size()) {
    auto comma = list.find(',', start);
    if (comma == std::string_view::npos) comma = list.size();
    item(list.substr(start, comma - start));
    start = comma + 1;
  }
}

// "01-03,07" -> {"01","02","03","07"}; the width of a range's lower bound is kept, as Slurm does.
inline std::vector<std::string> expand_bracket(std::string_view nodelist, std::string_view inside) {
  std::vector<std::string> values;
  for_each_comma_item(inside, [&](std::string_view item) {
    const auto dash = item.find('-');
    const auto low_text = item.substr(0, dash);
    const auto high_text = dash == std::string_view::npos ? low_text : item.substr(dash + 1);
    if (!all_digits(low_text) || !all_digits(high_text))
      fail_nodelist(nodelist,
                    detail::text("'[", inside, "]' holds '", item, "', which is neither a number nor a range a-b"));
    const auto low = parse_integer(low_text);
    const auto high = parse_integer(high_text);
    if (!low || !high || *high < *low)
      fail_nodelist(nodelist, detail::text("range '", item, "' is reversed or too large"));
    if (static_cast<std::size_t>(*high - *low) >= max_expanded_entries)
      fail_nodelist(nodelist, detail::text("range '", item, "' has more than ", std::to_string(max_expanded_entries),
                                           " entries"));
    for (long long value = *low; value <= *high; ++value) {
      auto digits = std::to_string(value);
      if (digits.size() < low_text.size()) digits.insert(0, low_text.size() - digits.size(), '0');
      values.push_back(std::move(digits));
    }
  });
  return values;
}

// One host expression: literal text and bracket groups, e.g. "rack[1-2]-n[01-02]"; several
// groups multiply, the leftmost varying slowest.
inline void expand_host(std::string_view nodelist, std::string_view host, std::vector<std::string>& out) {
  std::vector<std::string> partial{""};
  std::size_t position = 0;
  while (position < host.size()) {
    const auto open = host.find('[', position);
    const auto literal = host.substr(position, open == std::string_view::npos ? host.npos : open - position);
    if (literal.find(']') != std::string_view::npos) fail_nodelist(nodelist, "unmatched ']'");
    for (auto& name : partial) name += literal;
    if (open == std::string_view::npos) break;
    const auto close = host.find(']', open);
    if (close == std::string_view::npos) fail_nodelist(nodelist, "unmatched '['");
    const auto values = expand_bracket(nodelist, host.substr(open + 1, close - open - 1));
    if (partial.size() * values.size() > max_expanded_entries)
      fail_nodelist(nodelist, detail::text("more than ", std::to_string(max_expanded_entries), " hosts"));
    std::vector<std::string> longer;
    longer.reserve(partial.size() * values.size());
    for (const auto& name : partial)
      for (const auto& value : values) longer.push_back(name + value);
    partial = std::move(longer);
    position = close + 1;
  }
  if (out.size() + partial.size() > max_expanded_entries)
    fail_nodelist(nodelist, detail::text("more than ", std::to_string(max_expanded_entries), " hosts"));
  for (auto& name : partial) out.push_back(std::move(name));
}

}  // namespace detail

// "gpu[01-03,07],cpu1" -> gpu01 gpu02 gpu03 gpu07 cpu1. Commas inside brackets separate
// numbers; commas outside separate hosts. Zero padding of the lower bound is kept.
COHORT_DECL std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist) {
  const auto text = detail::trim_spaces(nodelist);
  std::vector<std::string> hosts;
  if (text.empty()) return hosts;
  std::size_t start = 0;
  int depth = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    const char c = i < text.size() ? text[i] : ',';
    if (c == '[') {
      if (++depth > 1) detail::fail_nodelist(nodelist, "nested '['");
    } else if (c == ']') {
      if (--depth < 0) detail::fail_nodelist(nodelist, "unmatched ']'");
    } else if (c == ',' && depth == 0) {
      const auto host = text.substr(start, i - start);
      if (host.empty()) detail::fail_nodelist(nodelist, "empty host name");
      detail::expand_host(nodelist, host, hosts);
      start = i + 1;
    }
  }
  if (depth != 0) detail::fail_nodelist(nodelist, "unmatched '['");
  return hosts;
}

// "2(x3),1" -> 2 2 2 1: Slurm's run-length form of SLURM_TASKS_PER_NODE.
COHORT_DECL std::vector<int> expand_slurm_tasks_per_node(std::string_view tasks_per_node) {
  const auto fail = [&](const std::string& why) { detail::fail_tasks_per_node(tasks_per_node, why); };
  const auto text = detail::trim_spaces(tasks_per_node);
  std::vector<int> counts;
  if (text.empty()) fail("it is empty");
  detail::for_each_comma_item(text, [&](std::string_view item) {
    const auto paren = item.find('(');
    const auto count_text = item.substr(0, paren);
    long long repeat = 1;
    if (paren != std::string_view::npos) {
      const auto inside = item.substr(paren + 1);
      if (inside.size() < 3 || inside.front() != 'x' || inside.back() != ')' ||
          !detail::all_digits(inside.substr(1, inside.size() - 2)))
        fail(detail::text("'", item, "' is not of the form N(xM)"));
      repeat = detail::parse_integer(inside.substr(1, inside.size() - 2)).value_or(0);
    }
    const auto count = detail::all_digits(count_text) ? detail::parse_integer(count_text) : std::nullopt;
    if (!count || *count > 1'000'000) fail(detail::text("'", item, "' does not start with a task count"));
    if (repeat < 1 || counts.size() + static_cast<std::size_t>(repeat) > detail::max_expanded_entries)
      fail(detail::text("'", item, "' has a repeat count out of range"));
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
  });
  return counts;
}

namespace detail {

// Reads one launcher's variables and reports problems in that launcher's words.
class launch_reader {
 public:
  launch_reader(const launch_env::getenv_fn& getenv, launcher source) : getenv_(getenv), source_(source) {}

  std::optional<std::string> get(std::string_view name) const {
    auto value = getenv_(name);
    if (value && value->empty()) return std::nullopt;
    return value;
  }
  bool has(std::string_view name) const { return get(name).has_value(); }
  bool has_any(std::initializer_list<std::string_view> names) const {
    return std::any_of(names.begin(), names.end(), [&](auto name) { return has(name); });
  }

  // Every name must be set once any of the family is; the message lists the set and the unset.
  void require_all(std::initializer_list<std::string_view> names, const std::string& hint) const {
    std::string present;
    std::string missing;
    for (auto name : names) {
      auto& list = has(name) ? present : missing;
      if (!list.empty()) list += ", ";
      list += name;
    }
    if (!missing.empty()) fail(detail::text("partial environment: ", present, " set but ", missing, " not set"), hint);
  }

  int integer(std::string_view name) const {
    const auto value = get(name);
    if (!value) fail(detail::text(name, " is not set"), detail::text("set ", name, " to an integer"));
    const auto number = parse_integer(*value);
    if (!number || *number < INT32_MIN || *number > INT32_MAX)
      fail(detail::text(name, "='", *value, "' is not an integer in the int range"),
           detail::text("set ", name, " to a decimal integer"));
    return static_cast<int>(*number);
  }
  std::optional<int> optional_integer(std::string_view name) const {
    if (!has(name)) return std::nullopt;
    return integer(name);
  }

  [[noreturn]] void fail(const std::string& detail, const std::string& hint) const {
    throw error(-1, detail::text("launch detection (", to_string(source_), ")"), detail, hint);
  }

  launcher source() const { return source_; }

 private:
  const launch_env::getenv_fn& getenv_;
  launcher source_;
};

// The variable (or argument) names that fed each field, for messages.
struct rank_names {
  std::string rank, world_size, local_rank, local_world_size;
};

inline void validate_ranks(const launch_env& env, const rank_names& names,
                           const std::function<void(const std::string&, const std::string&)>& fail) {
  const auto show = [](const std::string& name, int value) { return detail::text(name, "=", std::to_string(value)); };
  if (env.world_size <= 0)
    fail(detail::text(show(names.world_size, env.world_size), " must be positive"), "the world has at least one rank");
  if (env.rank < 0 || env.rank >= env.world_size)
    fail(detail::text(show(names.rank, env.rank), " is outside [0, ", names.world_size, "=",
                      std::to_string(env.world_size), ")"),
         "ranks count from 0 to world size - 1; check that every process got the same world size");
  if (env.local_world_size <= 0)
    fail(detail::text(show(names.local_world_size, env.local_world_size), " must be positive"),
         "each node runs at least one rank");
  if (env.local_world_size > env.world_size)
    fail(detail::text(show(names.local_world_size, env.local_world_size), " exceeds ",
                      show(names.world_size, env.world_size)),
         "a node cannot hold more ranks than the whole world");
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size)
    fail(detail::text(show(names.local_rank, env.local_rank), " is outside [0, ", names.local_world_size, "=",
                      std::to_string(env.local_world_size), ")"),
         "local ranks count from 0 to the number of ranks on this node - 1");
}

[[gnu::cold]] inline void read_explicit_overrides(const launch_reader& in, launch_env& env, rank_names& names) {
  in.require_all({"COHORT_RANK", "COHORT_WORLD_SIZE"},
                 "set both COHORT_RANK and COHORT_WORLD_SIZE (and optionally COHORT_LOCAL_RANK with "
                 "COHORT_LOCAL_WORLD_SIZE), or unset all of them to use the launcher's variables");
  env.rank = in.integer("COHORT_RANK");
  env.world_size = in.integer("COHORT_WORLD_SIZE");
  names = {"COHORT_RANK", "COHORT_WORLD_SIZE", "COHORT_LOCAL_RANK", "COHORT_LOCAL_WORLD_SIZE"};
  if (in.has_any({"COHORT_LOCAL_RANK", "COHORT_LOCAL_WORLD_SIZE"})) {
    in.require_all({"COHORT_RANK", "COHORT_WORLD_SIZE", "COHORT_LOCAL_RANK", "COHORT_LOCAL_WORLD_SIZE"},
                   "set COHORT_LOCAL_RANK and COHORT_LOCAL_WORLD_SIZE together, or neither (one node)");
    env.local_rank = in.integer("COHORT_LOCAL_RANK");
    env.local_world_size = in.integer("COHORT_LOCAL_WORLD_SIZE");
  } else {
    env.local_rank = env.rank;
    env.local_world_size = env.world_size;
    names.local_rank = "COHORT_RANK";
    names.local_world_size = "COHORT_WORLD_SIZE";
  }
}

[[gnu::cold]] inline void read_torchrun(const launch_reader& in, launch_env& env, rank_names& names) {
  in.require_all({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
                 "torchrun sets all four; when launching by hand set every one of them, or use "
                 "COHORT_RANK/COHORT_WORLD_SIZE");
  names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  env.rank = in.integer("RANK");
  env.world_size = in.integer("WORLD_SIZE");
  env.local_rank = in.integer("LOCAL_RANK");
  env.local_world_size = in.integer("LOCAL_WORLD_SIZE");
  if (const auto group = in.optional_integer("GROUP_RANK")) {
    if (*group < 0)
      in.fail(detail::text("GROUP_RANK=", std::to_string(*group), " is negative"), "node indices count from 0");
    env.node_index = *group;
  }
  if (const auto agent = in.get("TORCHELASTIC_USE_AGENT_STORE")) {
    if (*agent == "True" || *agent == "true" || *agent == "1")
      env.use_agent_store = true;
    else if (*agent != "False" && *agent != "false" && *agent != "0")
      in.fail(detail::text("TORCHELASTIC_USE_AGENT_STORE='", *agent, "' is neither True nor False"),
              "torchrun writes True or False");
  }
  if (const auto restarts = in.optional_integer("TORCHELASTIC_RESTART_COUNT")) {
    if (*restarts < 0)
      in.fail(detail::text("TORCHELASTIC_RESTART_COUNT=", std::to_string(*restarts), " is negative"),
              "restart counts start at 0");
    env.restart_count = *restarts;
  } else if (env.use_agent_store) {
    in.fail("TORCHELASTIC_USE_AGENT_STORE=True but TORCHELASTIC_RESTART_COUNT is not set",
            "the agent store's keys are prefixed with the restart attempt; set "
            "TORCHELASTIC_RESTART_COUNT (torchrun does)");
  }
  // `none` is torchrun's default --rdzv-id: every job started without one has it, so it is no id.
  env.run_id = in.get("TORCHELASTIC_RUN_ID").value_or("");
  if (env.run_id == "none") env.run_id.clear();
}

[[gnu::cold]] inline void read_open_mpi(const launch_reader& in, launch_env& env, rank_names& names) {
  names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
  in.require_all(
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      "Open MPI's mpirun sets all four; a stale variable left in the shell can look like "
      "a partial launch");
  env.rank = in.integer("OMPI_COMM_WORLD_RANK");
  env.world_size = in.integer("OMPI_COMM_WORLD_SIZE");
  env.local_rank = in.integer("OMPI_COMM_WORLD_LOCAL_RANK");
  env.local_world_size = in.integer("OMPI_COMM_WORLD_LOCAL_SIZE");
  env.run_id = in.get("OMPI_MCA_ess_base_jobid").value_or(in.get("PMIX_NAMESPACE").value_or(""));
}

// Returns false when Slurm should be read instead (PMI ranks from srun's PMI plugin).
[[gnu::cold]] inline bool read_mpich(const launch_reader& in, bool slurm_present, launch_env& env, rank_names& names) {
  names = {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};
  const bool has_local = in.has_any({"MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
  if (!has_local && slurm_present && in.has("PMI_RANK") && in.has("PMI_SIZE")) return false;
  in.require_all({"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
                 "mpiexec (Hydra, Intel MPI) sets all four; with another PMI launcher set "
                 "COHORT_LOCAL_RANK and COHORT_LOCAL_WORLD_SIZE alongside COHORT_RANK and "
                 "COHORT_WORLD_SIZE");
  env.rank = in.integer("PMI_RANK");
  env.world_size = in.integer("PMI_SIZE");
  env.local_rank = in.integer("MPI_LOCALRANKID");
  env.local_world_size = in.integer("MPI_LOCALNRANKS");
  env.run_id = in.get("PMI_JOBID").value_or("");
  return true;
}

[[gnu::cold]] inline void read_slurm(const launch_reader& in, launch_env& env, rank_names& names) {
  in.require_all({"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
                 "srun sets these for every task; a program started directly in an sbatch script "
                 "is not an srun task (run it with srun, or unset the SLURM_ variables)");
  names = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""};
  env.rank = in.integer("SLURM_PROCID");
  env.world_size = in.integer("SLURM_NTASKS");
  env.local_rank = in.integer("SLURM_LOCALID");
  const auto node_id = in.optional_integer("SLURM_NODEID");
  if (node_id && *node_id < 0)
    in.fail(detail::text("SLURM_NODEID=", std::to_string(*node_id), " is negative"), "node indices count from 0");

  if (const auto per_node = in.get("SLURM_TASKS_PER_NODE")) {
    names.local_world_size = "SLURM_TASKS_PER_NODE";
    std::vector<int> counts;
    try {
      counts = expand_slurm_tasks_per_node(*per_node);
    } catch (const error& bad) {
      in.fail(detail::text("SLURM_TASKS_PER_NODE='", *per_node, "' is malformed: ", bad.detail()),
              "Slurm writes counts like '2(x3),1'");
    }
    int node = -1;
    if (node_id) {
      node = *node_id;
    } else {
      // Block distribution (srun's default): node k holds the ranks after those of nodes < k.
      long long first_rank_of_next = 0;
      for (std::size_t k = 0; k < counts.size(); ++k) {
        first_rank_of_next += counts[k];
        if (env.rank < first_rank_of_next) {
          node = static_cast<int>(k);
          break;
        }
      }
      if (node < 0)
        in.fail(detail::text("SLURM_PROCID=", std::to_string(env.rank), " is beyond the ",
                             std::to_string(first_rank_of_next), " tasks of SLURM_TASKS_PER_NODE='", *per_node, "'"),
                "set SLURM_NODEID, or check SLURM_NTASKS against SLURM_TASKS_PER_NODE");
    }
    if (static_cast<std::size_t>(node) >= counts.size())
      in.fail(detail::text("SLURM_NODEID=", std::to_string(node), " but SLURM_TASKS_PER_NODE='", *per_node, "' lists ",
                           std::to_string(counts.size()), " nodes"),
              "the node index must be below the number of nodes in SLURM_TASKS_PER_NODE");
    env.local_world_size = counts[static_cast<std::size_t>(node)];
    env.node_index = node;
  } else if (in.has("SLURM_NTASKS_PER_NODE")) {
    names.local_world_size = "SLURM_NTASKS_PER_NODE";
    env.local_world_size = in.integer("SLURM_NTASKS_PER_NODE");
    if (node_id) env.node_index = *node_id;
  } else {
    in.fail(
        "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID set but neither SLURM_TASKS_PER_NODE nor "
        "SLURM_NTASKS_PER_NODE is set, so the number of tasks on this node is unknown",
        "srun sets SLURM_TASKS_PER_NODE; or pass --ntasks-per-node");
  }

  const auto nodelist_name = in.has("SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
  if (const auto nodelist = in.get(nodelist_name)) {
    try {
      env.hosts = expand_slurm_nodelist(*nodelist);
    } catch (const error& bad) {
      in.fail(detail::text(nodelist_name, "='", *nodelist, "' is malformed: ", bad.detail()),
              "Slurm writes node lists like 'gpu[01-03,07],cpu1'");
    }
  }
  env.run_id = in.get("SLURM_JOB_ID").value_or(in.get("SLURM_JOBID").value_or(""));
}

// RANK/WORLD_SIZE set by something other than torchrun, beside a launcher that started this
// process: see the precedence notes at the top. Read before torchrun's own checks, so that a
// stale set that is also partial is named beside the launcher's, not alone as a partial launch.
[[gnu::cold]] inline void refuse_stale_torchrun_names(const launch_reader& in) {
  if (in.has_any({"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK", "ROLE_RANK"})) return;
  struct family {
    launcher source;
    std::array<std::string_view, 4> names;  // rank, world size, then the rest ("" for none)
  };
  constexpr std::array<std::string_view, 4> torchrun_names{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  // "NAME=value ..." of the family's variables that are set.
  const auto seen = [&](const std::array<std::string_view, 4>& names) {
    std::string text;
    for (const auto name : names)
      if (!name.empty())
        if (const auto value = in.get(name)) text += detail::text((text.empty() ? "" : " "), name, "=", *value);
    return text;
  };
  const auto set_names = [&](const std::array<std::string_view, 4>& names) {
    std::string text;
    for (const auto name : names)
      if (!name.empty() && in.has(name)) text += detail::text((text.empty() ? "" : " "), name);
    return text;
  };
  const bool complete = std::all_of(torchrun_names.begin(), torchrun_names.end(), [&](auto n) { return in.has(n); });
  const auto rank = complete ? parse_integer(*in.get("RANK")) : std::nullopt;
  const auto world = complete ? parse_integer(*in.get("WORLD_SIZE")) : std::nullopt;
  for (const family& other : {family{launcher::open_mpi,
                                     {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "OMPI_COMM_WORLD_LOCAL_SIZE"}},
                              family{launcher::mpich, {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}},
                              family{launcher::slurm, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""}}}) {
    const auto rank_text = in.get(other.names[0]), world_text = in.get(other.names[1]);
    if (!rank_text || !world_text) continue;
    if (complete) {
      // An unreadable number is torchrun's own check's to name; an agreeing set, a wrapper's.
      const auto their_rank = parse_integer(*rank_text), their_world = parse_integer(*world_text);
      if (!rank || !world || !their_rank || !their_world || (*their_rank == *rank && *their_world == *world)) continue;
    }
    throw error(
        -1, "launch detection",
        detail::text("torchrun's ", seen(torchrun_names),
                     " (but none of torchrun's own variables such as TORCHELASTIC_RUN_ID are set",
                     (complete ? "" : ", and not all four of them"), ") ",
                     (complete ? "disagree with " : "are set beside "), to_string(other.source), "'s ",
                     seen(other.names), ", which started this process"),
        detail::text("torchrun's variables look left over in the shell: unset them (unset ", set_names(torchrun_names),
                     ") or make them agree with ", to_string(other.source), "'s, then launch again"));
  }
}

inline void read_master(const launch_reader& in, launch_env& env) {
  if (const auto port = in.get("MASTER_PORT")) {
    const auto number = parse_integer(*port);
    if (!number || *number < 1 || *number > 65535)
      in.fail(detail::text("MASTER_PORT='", *port, "' is not a port number in 1..65535"),
              "set MASTER_PORT to a free TCP port, e.g. 29500");
    env.master_port = static_cast<std::uint16_t>(*number);
  }
  if (const auto addr = in.get("MASTER_ADDR")) {
    env.master_addr = std::string(trim_spaces(*addr));
    return;
  }
  if (in.source() == launcher::slurm && !env.hosts.empty()) {
    env.master_addr = env.hosts.front();
    return;
  }
  if (env.local_world_size == env.world_size) {
    env.master_addr = "127.0.0.1";
    return;
  }
  std::string why = detail::text("MASTER_ADDR is not set and the ", std::to_string(env.world_size),
                                 " ranks span several nodes (", std::to_string(env.local_world_size), " on this one)");
  if (in.source() == launcher::slurm) why += ", and SLURM_JOB_NODELIST is not set either";
  in.fail(why, "export MASTER_ADDR=<address of the node that runs rank 0> (and MASTER_PORT) to every rank");
}

}  // namespace detail

COHORT_DECL launch_env launch_env::detect(const getenv_fn& getenv) {
  using detail::launch_reader;
  const launch_reader probe{getenv, launcher::explicit_values};
  const bool slurm_present = probe.has_any({"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"});

  launch_env env;
  detail::rank_names names{"rank", "world size", "local rank", "local world size"};
  auto source = launcher::explicit_values;
  if (probe.has_any({"COHORT_RANK", "COHORT_WORLD_SIZE", "COHORT_LOCAL_RANK", "COHORT_LOCAL_WORLD_SIZE"})) {
    detail::read_explicit_overrides(launch_reader{getenv, source}, env, names);
  } else if (probe.has_any({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})) {
    source = launcher::torchrun;
    detail::refuse_stale_torchrun_names(probe);
    detail::read_torchrun(launch_reader{getenv, source}, env, names);
  } else if (probe.has_any({"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                            "OMPI_COMM_WORLD_LOCAL_SIZE"})) {
    source = launcher::open_mpi;
    detail::read_open_mpi(launch_reader{getenv, source}, env, names);
  } else if (probe.has_any({"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}) &&
             detail::read_mpich(launch_reader{getenv, launcher::mpich}, slurm_present, env, names)) {
    source = launcher::mpich;
  } else if (slurm_present) {
    source = launcher::slurm;
    detail::read_slurm(launch_reader{getenv, source}, env, names);
  }
  env.source = source;

  const launch_reader in{getenv, source};
  detail::validate_ranks(env, names, [&](const std::string& what, const std::string& hint) { in.fail(what, hint); });
  detail::read_master(in, env);
  if (const auto job = in.get("COHORT_JOB_ID")) env.run_id = *job;
  return env;
}

COHORT_DECL launch_env launch_env::detect() {
  return detect([](std::string_view name) -> std::optional<std::string> {
    const std::string key{name};
    if (const char* value = std::getenv(key.c_str())) return std::string{value};
    return std::nullopt;
  });
}

COHORT_DECL launch_env launch_env::explicit_values(int rank, int world_size, int local_rank, int local_world_size,
                                                   std::string master_addr, std::uint16_t master_port) {
  launch_env env;
  env.rank = rank;
  env.world_size = world_size;
  env.local_rank = local_rank;
  env.local_world_size = local_world_size;
  env.master_addr = std::move(master_addr);
  env.master_port = master_port;
  env.source = launcher::explicit_values;
  detail::validate_ranks(env, {"rank", "world_size", "local_rank", "local_world_size"},
                         [](const std::string& what, const std::string& hint) {
                           throw error(-1, "launch_env::explicit_values", what, hint);
                         });
  return env;
}

COHORT_DECL std::string detail::json_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out;
}

COHORT_DECL bool record_error_for_launcher(std::string_view type_name, std::string_view message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return false;
  // "x": never replace a file already there (the first error is the root cause).
  std::FILE* file = std::fopen(path, "wx");
  if (file == nullptr) return false;
  const std::string summary = detail::json_escape(detail::text(type_name, ": ", message));
  // torchrun's agent reads message.message and message.extraInfo.timestamp; py_callstack is
  // where a Python worker puts its traceback, shown when present.
  const std::string json =
      detail::text("{\"message\": {\"message\": \"", summary, "\", \"extraInfo\": {\"py_callstack\": \"", summary,
                   "\\n(a C++ program: no Python call stack)\", \"timestamp\": \"",
                   std::to_string(static_cast<long long>(std::time(nullptr))), "\"}}}");
  const bool written = std::fwrite(json.data(), 1, json.size(), file) == json.size();
  return std::fclose(file) == 0 && written;
}

COHORT_DECL bool record_error_for_launcher(const std::exception& failure) {
  const char* type_name = dynamic_cast<const timeout_error*>(&failure) ? "cohort::timeout_error"
                          : dynamic_cast<const error*>(&failure)       ? "cohort::error"
                                                                       : "std::exception";
  return record_error_for_launcher(type_name, failure.what());
}

}  // namespace cohort::inline v0
