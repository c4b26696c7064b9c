// cohort-plan: how to spread a training run over GPUs, before renting them.
//
//   cohort-plan --params 7e9 --dtype bf16 --gpus-per-node 8 --nodes 1 --link nvlink-h100
//               --per-device-batch 4 --accumulation 8 --compute-ms 850
//
// Prints the effective batch, the communication of data parallelism and of sharding under
// the alpha-beta model (constants and their sources shown), how much of it overlap hides,
// the predicted speedup and scaling efficiency, a recommendation, a bucket size, and the
// field's rules of thumb. --json prints the same as JSON. See include/cohort/tools/planner.hpp.

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/tools/detail/json.hpp"
#include "cohort/tools/planner.hpp"
#include "cohort/tools/topology.hpp"

namespace {

constexpr const char* usage = R"(usage: cohort-plan [options]

Model
  --params N             parameter count: 7e9, 7B, 350M, 125000 (K, M, B, T suffixes)
  --units a,b,c          parameters per sharding unit (layer), instead of or besides --params
  --dtype T              bf16 | fp16 | fp32 | fp8 (bytes per communicated element; default bf16)
  --gpu-mem SIZE         memory per GPU: 80G (GiB), 80GB (1e9 bytes), 81920M (default 80G)

Machine
  --gpus-per-node G      GPUs in each node (default 1)
  --nodes N              nodes (default 1)
  --link NAME            link inside a node (default nvlink-h100); --list-links shows them
  --inter-link NAME      link between nodes, per GPU (default ib-ndr)
  --bench FILE           cohort-bench JSON: fit alpha and beta from measurements and use them
                         for the link inside a node
  --alpha-us X --busbw-GBps Y
                         measured latency per ring step and bus bandwidth, inside a node
  --topology             probe this machine's GPUs, print the link matrix and advice

Training
  --per-device-batch B   samples per GPU per micro-batch (default 1)
  --accumulation A       micro-batches per optimizer step (default 1)
  --compute-ms T         forward + backward of one micro-batch on one GPU, milliseconds
  --one-gpu-hours H      how long the whole run would take on one GPU (for the 12-hour rule)
  --bucket SIZE          data-parallel bucket size (default: chosen by the planner)

Output
  --json                 machine-readable output
  --list-links           the link presets with their constants and sources
  --help                 this text
)";

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "cohort-plan: " << message << "\n(see cohort-plan --help)\n";
  std::exit(2);
}

double parse_number(const std::string& option, std::string_view text, std::string_view* rest = nullptr) {
  std::string copy(text);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(copy.c_str(), &end);
  if (end == copy.c_str() || errno == ERANGE || !std::isfinite(value))
    fail(option + ": \"" + copy + "\" is not a number");
  std::string_view tail = text.substr(static_cast<std::size_t>(end - copy.c_str()));
  if (rest)
    *rest = tail;
  else if (!tail.empty())
    fail(option + ": \"" + copy + "\" is not a number");
  return value;
}

// 7e9, 7B, 350M, 12.5K, 1T: counts with decimal suffixes.
double parse_count(const std::string& option, std::string_view text) {
  std::string_view suffix;
  double value = parse_number(option, text, &suffix);
  if (suffix == "K" || suffix == "k")
    value *= 1e3;
  else if (suffix == "M")
    value *= 1e6;
  else if (suffix == "B" || suffix == "G")
    value *= 1e9;
  else if (suffix == "T")
    value *= 1e12;
  else if (!suffix.empty())
    fail(option + ": unknown suffix \"" + std::string(suffix) + "\" (K, M, B, T)");
  if (value <= 0) fail(option + ": must be positive");
  return value;
}

// 80G / 80GiB (binary), 80GB (decimal), 512M, 4096 (bytes).
double parse_size(const std::string& option, std::string_view text) {
  std::string_view suffix;
  double value = parse_number(option, text, &suffix);
  struct unit {
    std::string_view name;
    double scale;
  };
  static constexpr unit units[] = {{"", 1},
                                   {"B", 1},
                                   {"K", 1024.0},
                                   {"KiB", 1024.0},
                                   {"KB", 1e3},
                                   {"M", 1 << 20},
                                   {"MiB", 1 << 20},
                                   {"MB", 1e6},
                                   {"G", 1 << 30},
                                   {"GiB", 1 << 30},
                                   {"GB", 1e9},
                                   {"T", 1099511627776.0},
                                   {"TiB", 1099511627776.0},
                                   {"TB", 1e12}};
  for (const auto& u : units)
    if (suffix == u.name) {
      if (value <= 0) fail(option + ": must be positive");
      return value * u.scale;
    }
  fail(option + ": unknown size suffix \"" + std::string(suffix) + "\" (K, M, G, T, KiB.., KB..)");
}

int parse_int(const std::string& option, std::string_view text, int minimum) {
  const double value = parse_number(option, text);
  if (value != std::floor(value) || value < minimum || value > 1e9)
    fail(option + ": expected a whole number of at least " + std::to_string(minimum) + ", got \"" + std::string(text) +
         "\"");
  return static_cast<int>(value);
}

int parse_dtype(std::string_view name) {
  if (name == "bf16" || name == "bfloat16" || name == "fp16" || name == "half" || name == "float16") return 2;
  if (name == "fp32" || name == "float" || name == "float32" || name == "tf32") return 4;
  if (name == "fp8" || name == "e4m3" || name == "e5m2") return 1;
  if (name == "fp64" || name == "double") return 8;
  fail("--dtype: unknown type \"" + std::string(name) + "\" (bf16, fp16, fp32, fp8, fp64)");
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

void list_links() {
  std::cout << "link presets (alpha: latency per ring step; busbw: all-reduce bus bandwidth, 1e9 B/s)\n\n";
  for (const auto& link : cohort::link_presets()) {
    std::cout << "  " << link.name << ": alpha " << fixed(link.alpha_seconds * 1e6, 1) << " us, busbw "
              << fixed(link.bus_bandwidth_bytes_per_second() / 1e9, 1) << " GB/s\n      " << link.source << "\n";
  }
}

void print_report(const cohort::plan_input& in, const cohort::plan_result& r) {
  using cohort::detail::format_bytes;
  using cohort::detail::format_percent;
  using cohort::detail::format_seconds;
  std::cout << "cohort-plan\n\n";
  std::cout << "model     " << fixed(r.parameters / 1e9, 3) << " B parameters in " << r.units << " units ("
            << format_bytes(r.parameter_bytes) << " at " << in.dtype_bytes << " bytes each)\n";
  std::cout << "machine   " << r.world << " GPU(s): " << in.gpus_per_node << " per node x " << in.nodes << " node(s); "
            << in.intra_node.name << (in.nodes > 1 ? " inside, " + in.inter_node.name + " between" : "") << "; "
            << format_bytes(in.gpu_memory_bytes) << " each\n";
  std::cout << "batch     effective " << r.effective_batch << " = " << in.per_device_batch << " per device x "
            << in.accumulation << " accumulation x " << r.world << " GPUs\n";
  std::cout << "compute   " << format_seconds(in.compute_seconds) << " per micro-batch, "
            << format_seconds(r.single_gpu_step_seconds) << " per optimizer step on one GPU\n\n";

  std::cout << "                          data parallel    sharded\n";
  auto row = [](const char* name, const std::string& dp, const std::string& sh) {
    std::string line = "  ";
    line += name;
    line.resize(26, ' ');
    std::string left = dp;
    left.resize(17, ' ');
    std::cout << line << left << sh << "\n";
  };
  const auto& dp = r.data_parallel;
  const auto& sh = r.sharded;
  row("bytes sent / step / GPU", format_bytes(dp.bytes_per_step), format_bytes(sh.bytes_per_step));
  row("communication / step", format_seconds(dp.comm_seconds), format_seconds(sh.comm_seconds));
  row("hidden by overlap", format_percent(dp.hidden_fraction), format_percent(sh.hidden_fraction));
  row("exposed / step", format_seconds(dp.exposed_seconds), format_seconds(sh.exposed_seconds));
  row("step time", format_seconds(dp.step_seconds), format_seconds(sh.step_seconds));
  row("speedup vs 1 GPU", fixed(dp.speedup, 2) + "x", fixed(sh.speedup, 2) + "x");
  row("scaling efficiency", format_percent(dp.efficiency), format_percent(sh.efficiency));
  row("model states / GPU", format_bytes(dp.memory_per_gpu_bytes) + (dp.fits ? "" : " (!)"),
      format_bytes(sh.memory_per_gpu_bytes) + (sh.fits ? "" : " (!)"));
  std::cout << "  (!) = over " << format_percent(in.usable_memory_fraction) << " of GPU memory\n\n";

  std::cout << "recommendation: " << cohort::to_string(r.recommended) << "\n";
  for (const auto& line : r.advice) std::cout << "  - " << line << "\n";
  std::cout << "\nrules of thumb\n";
  for (const auto& line : r.rules_of_thumb) std::cout << "  - " << line << "\n";
  std::cout << "\nassumptions\n";
  for (const auto& line : r.assumptions) std::cout << "  - " << line << "\n";
}

cohort::detail::json to_json(const cohort::plan_input& in, const cohort::plan_result& r) {
  using cohort::detail::json;
  auto estimate = [](const cohort::strategy_estimate& e) {
    json out = json::make_object();
    out.set("bytes_per_step", e.bytes_per_step);
    out.set("comm_seconds", e.comm_seconds);
    out.set("hidden_fraction", e.hidden_fraction);
    out.set("exposed_seconds", e.exposed_seconds);
    out.set("step_seconds", e.step_seconds);
    out.set("speedup", e.speedup);
    out.set("efficiency", e.efficiency);
    out.set("memory_per_gpu_bytes", e.memory_per_gpu_bytes);
    out.set("fits", e.fits);
    return out;
  };
  auto link = [](const cohort::link_model& l) {
    json out = json::make_object();
    out.set("name", l.name);
    out.set("alpha_seconds", l.alpha_seconds);
    out.set("busbw_GBps", l.bus_bandwidth_bytes_per_second() / 1e9);
    out.set("source", l.source);
    return out;
  };
  auto lines = [](const std::vector<std::string>& items) {
    json out = json::make_array();
    for (const auto& item : items) out.push_back(item);
    return out;
  };
  json out = json::make_object();
  out.set("tool", "cohort-plan");
  out.set("world", r.world);
  out.set("gpus_per_node", in.gpus_per_node);
  out.set("nodes", in.nodes);
  out.set("parameters", r.parameters);
  out.set("units", r.units);
  out.set("dtype_bytes", in.dtype_bytes);
  out.set("effective_batch", r.effective_batch);
  out.set("single_gpu_step_seconds", r.single_gpu_step_seconds);
  out.set("intra_node_link", link(in.intra_node));
  if (in.nodes > 1) out.set("inter_node_link", link(in.inter_node));
  out.set("data_parallel", estimate(r.data_parallel));
  out.set("sharded", estimate(r.sharded));
  out.set("fits_one_gpu", r.fits_one_gpu);
  out.set("recommended", std::string(cohort::to_string(r.recommended)));
  out.set("bucket_bytes", r.bucket_bytes);
  out.set("advice", lines(r.advice));
  out.set("rules_of_thumb", lines(r.rules_of_thumb));
  out.set("assumptions", lines(r.assumptions));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cohort::plan_input in;
    bool json_output = false, have_model = false, show_topology = false;
    std::optional<double> alpha_us, busbw;
    std::string bench_file;

    std::vector<std::string> args(argv + 1, argv + argc);
    for (std::size_t i = 0; i < args.size(); ++i) {
      std::string option = args[i];
      std::optional<std::string> inline_value;
      if (const auto eq = option.find('='); option.rfind("--", 0) == 0 && eq != std::string::npos) {
        inline_value = option.substr(eq + 1);
        option.resize(eq);
      }
      auto value = [&]() -> std::string {
        if (inline_value) return *inline_value;
        if (i + 1 >= args.size()) fail(option + " needs a value");
        return args[++i];
      };
      auto flag = [&] {
        if (inline_value) fail(option + " takes no value");
      };
      if (option == "--help" || option == "-h") {
        std::cout << usage;
        return 0;
      } else if (option == "--list-links") {
        flag();
        list_links();
        return 0;
      } else if (option == "--topology") {
        flag();
        show_topology = true;
      } else if (option == "--json") {
        flag();
        json_output = true;
      } else if (option == "--params") {
        in.parameters = parse_count(option, value());
        have_model = true;
      } else if (option == "--units") {
        std::string list = value();
        std::stringstream items(list);
        std::string item;
        while (std::getline(items, item, ',')) in.unit_parameters.push_back(parse_count(option, item));
        if (in.unit_parameters.empty()) fail("--units: empty list");
        have_model = true;
      } else if (option == "--dtype") {
        in.dtype_bytes = parse_dtype(value());
      } else if (option == "--gpu-mem") {
        in.gpu_memory_bytes = parse_size(option, value());
      } else if (option == "--gpus-per-node") {
        in.gpus_per_node = parse_int(option, value(), 1);
      } else if (option == "--nodes") {
        in.nodes = parse_int(option, value(), 1);
      } else if (option == "--link") {
        in.intra_node = cohort::link_model_by_name(value());
      } else if (option == "--inter-link") {
        in.inter_node = cohort::link_model_by_name(value());
      } else if (option == "--bench") {
        bench_file = value();
      } else if (option == "--alpha-us") {
        alpha_us = parse_number(option, value());
        if (*alpha_us < 0) fail("--alpha-us: must not be negative");
      } else if (option == "--busbw-GBps") {
        busbw = parse_number(option, value());
        if (*busbw <= 0) fail("--busbw-GBps: must be positive");
      } else if (option == "--per-device-batch") {
        in.per_device_batch = parse_int(option, value(), 1);
      } else if (option == "--accumulation") {
        in.accumulation = parse_int(option, value(), 1);
      } else if (option == "--compute-ms") {
        in.compute_seconds = parse_number(option, value()) / 1e3;
        if (in.compute_seconds < 0) fail("--compute-ms: must not be negative");
      } else if (option == "--one-gpu-hours") {
        in.single_gpu_hours = parse_number(option, value());
      } else if (option == "--bucket") {
        in.bucket_bytes = parse_size(option, value());
      } else {
        fail("unknown option " + option);
      }
    }

    if (show_topology) {
      const auto topo = cohort::probe_topology();
      std::cout << cohort::format_topology_matrix(topo);
      for (const auto& line : cohort::advice(topo)) std::cout << "advice: " << line << "\n";
      if (const auto preset = cohort::suggested_link_preset(topo); !preset.empty())
        std::cout << "closest link preset: --link " << preset << "\n";
      if (!have_model) return 0;
      std::cout << "\n";
    }
    if (!have_model) fail("give the model size: --params N or --units a,b,c");

    if (!bench_file.empty()) {
      const auto result = cohort::read_bench_file(bench_file);
      in.intra_node = cohort::fit_alpha_beta(result);
      in.intra_node.source += " (" + bench_file + ")";
    }
    if (alpha_us || busbw) {
      if (!alpha_us || !busbw) fail("--alpha-us and --busbw-GBps go together");
      in.intra_node.name = "measured";
      in.intra_node.alpha_seconds = *alpha_us * 1e-6;
      in.intra_node.beta_seconds_per_byte = 1.0 / (*busbw * 1e9);
      in.intra_node.kind = cohort::link_kind::unknown;
      in.intra_node.source = "given on the command line";
    }

    const auto result = cohort::plan(in);
    if (json_output)
      std::cout << to_json(in, result).dump(2) << "\n";
    else
      print_report(in, result);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "cohort-plan: " << e.what() << "\n";
    return 1;
  }
}
