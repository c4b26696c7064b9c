#pragma once
// cohort's parallelism planner: given a model size, a batch and a link, how much does each
// strategy communicate, how much of it hides behind compute, what speedup does that leave,
// and which strategy to pick. The installed program cohort-plan is a thin front end.
// Over 400 lines: one cost model and its report, used only by the tools (not in the umbrella
// header, so no trainer compiles it).
//
// ---------------------------------------------------------------------------------------
// Cost model (alpha-beta, ring algorithms; p ranks, n bytes of the full buffer)
//
//   all-reduce            2(p-1) alpha + 2(p-1)/p n beta
//   all-gather            (p-1) alpha  + (p-1)/p n beta       (n = the gathered, full size)
//   reduce-scatter        (p-1) alpha  + (p-1)/p n beta       (n = the full input size)
//   broadcast (pipelined) (p-1) alpha  + n beta
//
// alpha is the latency of one ring step; beta = 1 / bus bandwidth, where bus bandwidth is
// what nccl-tests reports as busbw (algbw x 2(p-1)/p for all-reduce, x (p-1)/p for the
// gathers), so a published busbw plugs in directly: beta = 1 / busbw.
// Across nodes the collectives are hierarchical (what NCCL's trees and rings approximate):
// all-reduce = reduce-scatter inside the node, all-reduce of the 1/g slice across nodes
// (each GPU over its own NIC), all-gather inside the node.
//
// Per optimizer step (A = accumulation micro-batches, c = forward+backward of one micro-batch):
//   data parallelism  one all-reduce of the gradients per optimizer step (accumulation runs
//                     under no_sync), in buckets: 2(p-1)/p x gradient bytes on the wire;
//                     it overlaps the backward pass of the last micro-batch (taken as 2/3 of
//                     c) except the last bucket, which can only start when backward ends.
//   sharding          per micro-batch and per unit (layer): all-gather for forward,
//                     all-gather again for backward, reduce-scatter of the gradients:
//                     3(p-1)/p x parameter bytes plus 3 (p-1) alpha per unit. Gathers are
//                     prefetched behind compute; the first gather and the last
//                     reduce-scatter of every micro-batch stay exposed.
//
// Memory per GPU (model states only; activations are the user's and not modelled):
//   mixed-precision Adam keeps 16 bytes per parameter: 2 (bf16/fp16 weights) + 2 (gradients)
//   + 4 (fp32 master weights) + 4 + 4 (Adam moments); fp32 training without a master copy
//   also lands at 4 + 4 + 4 + 4 = 16. This is the accounting of the ZeRO paper (Rajbhandari
//   et al., 2020). Sharding divides it by p and adds the working set of the largest unit
//   (gathered weights, its prefetched successor, and its full gradient: 3 x unit bytes).
//   A model "fits" when its states take at most 80% of GPU memory, leaving the rest for
//   activations and workspace.
//
// ---------------------------------------------------------------------------------------
// cohort-bench result file (JSON), the format parse_bench_result reads and to_json writes:
//
//   {"tool": "cohort-bench", "operation": "all_reduce", "backend": "gloo", "world": 2,
//    "dtype": "float",
//    "rows": [{"bytes": 1048576, "count": 262144, "time_us": 812.5, "algbw_GBps": 1.29,
//              "busbw_GBps": 1.29, "wrong": 0,
//              "inplace_time_us": 800.1, "inplace_algbw_GBps": 1.31, "inplace_busbw_GBps": 1.31}],
//    "env": {...free-form: host, versions, launcher...}}
//
//   operation: all_reduce | all_gather | reduce_scatter | broadcast. bytes: the full buffer
//   (nccl-tests' "size"). time_us: mean time of one out-of-place call in microseconds.
//   GBps = 1e9 bytes per second. Required per row: bytes, time_us; the rest is optional.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/tools/detail/json.hpp"

namespace cohort::inline v0 {

// The collectives, named as process_group names them; "alltoall" (nccl-tests' name) is read
// as all_to_all too.
enum class collective { all_reduce, all_gather, reduce_scatter, broadcast, all_to_all };

inline constexpr collective every_collective[] = {collective::all_reduce, collective::all_gather,
                                                  collective::reduce_scatter, collective::broadcast,
                                                  collective::all_to_all};

constexpr std::string_view to_string(collective op) noexcept {
  switch (op) {
    case collective::all_reduce: return "all_reduce";
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::broadcast: return "broadcast";
    case collective::all_to_all: return "all_to_all";
  }
  return "?";
}

inline std::optional<collective> find_collective(std::string_view name) {
  if (name == "alltoall") return collective::all_to_all;
  for (collective op : every_collective)
    if (name == to_string(op)) return op;
  return std::nullopt;
}

inline collective parse_collective(std::string_view name) {
  if (const auto found = find_collective(name)) return *found;
  throw error(-1, "parse collective", detail::text("unknown operation \"", name, "\""),
              "one of all_reduce, all_gather, reduce_scatter, broadcast, all_to_all");
}

// host: CPU memory over loopback or sockets (Gloo); unknown: a measurement of an unnamed link.
enum class link_kind { nvlink, pcie, network, host, unknown };

// One link's alpha-beta constants. alpha: seconds per ring step; beta: seconds per byte of
// bus traffic (1 / busbw). source says where the numbers come from.
struct link_model {
  std::string name;
  double alpha_seconds = 0;
  double beta_seconds_per_byte = 0;
  link_kind kind = link_kind::pcie;
  std::string source;

  double bus_bandwidth_bytes_per_second() const {
    return beta_seconds_per_byte > 0 ? 1.0 / beta_seconds_per_byte : INFINITY;
  }
};

namespace detail {
inline link_model preset(std::string name, double alpha_us, double busbw_GBps, link_kind kind, std::string source) {
  return {std::move(name), alpha_us * 1e-6, 1.0 / (busbw_GBps * 1e9), kind, std::move(source)};
}
}  // namespace detail

// Published or derived constants. Bandwidths are all-reduce bus bandwidth (ring), the figure
// nccl-tests prints as busbw at large sizes; alpha is the per-step latency. They are starting
// points: a measured cohort-bench file of the actual machine (--bench) always wins.
inline std::vector<link_model> link_presets() {
  return {
      // NVLink 4 (H100/H200 SXM, NVSwitch): 900 GB/s per GPU both ways = 450 GB/s each way.
      // An NCCL maintainer puts the usable ring bandwidth at about 370 GB/s after ~20%
      // protocol overhead; NVLink SHARP all-reduce reaches ~480 GB/s busbw on 8 GPUs
      // (github.com/NVIDIA/nccl-tests/issues/212; a user's 8x H200 run peaks at 475 GB/s,
      // issues/272). Latency: a DGX A100 ring all-reduce of a few bytes on 8 GPUs takes
      // ~34 us over 14 ring steps, ~2.4 us per step (nccl-tests/issues/123).
      detail::preset("nvlink-h100", 2.5, 370, link_kind::nvlink,
                     "NVLink 4 line rate 450 GB/s/direction; ~370 GB/s ring busbw per NCCL maintainer "
                     "(nccl-tests#212), 475 GB/s NVLS peak on 8xH200 (nccl-tests#272); alpha ~2.4 us/step "
                     "from 8-GPU small all-reduce (nccl-tests#123)"),
      // NVLink 3 (A100 SXM, NVSwitch): 600 GB/s per GPU both ways = 300 GB/s each way;
      // single-node 8x A100 all_reduce_perf reports ~232 GB/s busbw (nccl-tests/issues/175),
      // ~200 GB/s on another 8x A100 server (nccl-tests/issues/149).
      detail::preset("nvlink-a100", 2.5, 230, link_kind::nvlink,
                     "NVLink 3 line rate 300 GB/s/direction; 8xA100 all_reduce busbw ~232 GB/s "
                     "(nccl-tests#175), ~200 GB/s (nccl-tests#149); alpha as nvlink-h100"),
      // PCIe Gen4 x16: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s each way. Rings through the
      // host bridge typically keep ~70% of it: 22 GB/s is an estimate, not a measurement.
      // Latency: 8x RTX 4090 on PCIe take ~42 us for an 8-byte all-reduce, ~3 us per ring
      // step (github.com/NVIDIA/nccl/issues/1530).
      detail::preset("pcie-gen4", 3.0, 22, link_kind::pcie,
                     "PCIe Gen4 x16 line rate 31.5 GB/s/direction, ~70% usable (estimate: measure "
                     "with cohort-bench); alpha ~3 us/step from 8-GPU PCIe small all-reduce (nccl#1530)"),
      detail::preset("pcie-gen5", 3.0, 44, link_kind::pcie,
                     "PCIe Gen5 x16 line rate 63 GB/s/direction, ~70% usable (estimate: measure with "
                     "cohort-bench); alpha as pcie-gen4"),
      // InfiniBand, per GPU with one NIC per GPU (rail-optimised nodes). NDR 400 Gb/s: an
      // NCCL maintainer expects 46-48 GB/s per NIC (nccl-tests/issues/290). HDR 200 Gb/s:
      // half of it; a 100 Gb/s EDR card reaches 12.2 GB/s, ~98% of line rate
      // (nccl-tests/issues/29). Latency per inter-node step: estimate.
      detail::preset("ib-ndr", 5.0, 46, link_kind::network,
                     "InfiniBand NDR 400 Gb/s, one NIC per GPU: 46-48 GB/s per NIC per NCCL maintainer "
                     "(nccl-tests#290); alpha estimated"),
      detail::preset("ib-hdr", 5.0, 23, link_kind::network,
                     "InfiniBand HDR 200 Gb/s, one NIC per GPU: ~23 GB/s (EDR 100 Gb/s reaches 12.2 GB/s, "
                     "nccl-tests#29); alpha estimated"),
      // Ethernet through NCCL's socket transport: line rate minus TCP overhead; estimates.
      detail::preset("ethernet-100g", 20.0, 10, link_kind::network,
                     "100 Gb/s Ethernet, TCP sockets: ~10 GB/s of the 12.5 GB/s line rate (estimate)"),
      detail::preset("ethernet-10g", 30.0, 1.1, link_kind::network,
                     "10 Gb/s Ethernet, TCP sockets: ~1.1 GB/s of the 1.25 GB/s line rate (estimate)"),
  };
}

inline std::optional<link_model> find_link_model(std::string_view name) {
  for (auto& link : link_presets())
    if (link.name == name) return link;
  return std::nullopt;
}

inline link_model link_model_by_name(std::string_view name) {
  if (auto link = find_link_model(name)) return *link;
  std::string known;
  for (const auto& link : link_presets()) known += (known.empty() ? "" : ", ") + link.name;
  throw error(-1, "link model", detail::text("unknown link class \"", name, "\""), detail::text("one of ", known));
}

// Time of one collective on a flat ring of `ranks` ranks; bytes is the full buffer.
inline double predict_time(collective op, double bytes, int ranks, const link_model& link) {
  if (ranks < 1) throw error(-1, "predict_time", detail::text("ranks = ", std::to_string(ranks)), "at least 1");
  if (bytes < 0) throw error(-1, "predict_time", "negative byte count");
  if (ranks == 1) return 0;
  const double p = ranks;
  const double a = link.alpha_seconds, b = link.beta_seconds_per_byte;
  switch (op) {
    case collective::all_reduce: return 2 * (p - 1) * a + 2 * (p - 1) / p * bytes * b;
    case collective::all_gather:
    case collective::reduce_scatter:
    case collective::all_to_all: return (p - 1) * a + (p - 1) / p * bytes * b;
    case collective::broadcast: return (p - 1) * a + bytes * b;
  }
  return 0;
}

// Hierarchical: gpus_per_node ranks on `intra`, nodes on `inter` (each GPU its own NIC).
inline double predict_time(collective op, double bytes, int gpus_per_node, int nodes, const link_model& intra,
                           const link_model& inter) {
  if (gpus_per_node < 1 || nodes < 1)
    throw error(-1, "predict_time",
                detail::text("gpus_per_node = ", std::to_string(gpus_per_node), ", nodes = ", std::to_string(nodes)),
                "both must be at least 1");
  if (nodes == 1) return predict_time(op, bytes, gpus_per_node, intra);
  if (gpus_per_node == 1) return predict_time(op, bytes, nodes, inter);
  const double slice = bytes / gpus_per_node;
  switch (op) {
    case collective::all_reduce:
      return predict_time(collective::reduce_scatter, bytes, gpus_per_node, intra) +
             predict_time(collective::all_reduce, slice, nodes, inter) +
             predict_time(collective::all_gather, bytes, gpus_per_node, intra);
    case collective::all_gather:
      return predict_time(collective::all_gather, slice, nodes, inter) +
             predict_time(collective::all_gather, bytes, gpus_per_node, intra);
    case collective::reduce_scatter:
      return predict_time(collective::reduce_scatter, bytes, gpus_per_node, intra) +
             predict_time(collective::reduce_scatter, slice, nodes, inter);
    case collective::broadcast:
      return predict_time(collective::broadcast, bytes, nodes, inter) +
             predict_time(collective::broadcast, bytes, gpus_per_node, intra);
    case collective::all_to_all:  // the off-node share crosses the network, the rest stays inside
      return predict_time(collective::all_to_all, bytes, nodes, inter) +
             predict_time(collective::all_to_all, bytes / nodes, gpus_per_node, intra);
  }
  return 0;
}

// Ring steps and bus-traffic factor of one collective: time = steps alpha + factor n beta.
inline double ring_steps(collective op, int ranks) {
  const double p = ranks;
  return op == collective::all_reduce ? 2 * (p - 1) : p - 1;
}
inline double bus_factor(collective op, int ranks) {
  const double p = ranks;
  switch (op) {
    case collective::all_reduce: return 2 * (p - 1) / p;
    case collective::all_gather:
    case collective::reduce_scatter:
    case collective::all_to_all: return (p - 1) / p;
    case collective::broadcast: return 1;
  }
  return 1;
}

// ---------------------------------------------------------------------------------------
// Measured constants: cohort-bench result files and a least-squares fit.

struct bench_row {
  double bytes = 0;
  double count = 0;
  double time_us = 0;
  double algbw_GBps = 0;
  double busbw_GBps = 0;
  double wrong = 0;
  std::optional<double> inplace_time_us;
  std::optional<double> inplace_algbw_GBps;
  std::optional<double> inplace_busbw_GBps;
};

struct bench_result {
  std::string tool = "cohort-bench";
  std::string operation = "all_reduce";
  std::string backend;
  int world = 1;
  std::string dtype = "float";
  std::vector<bench_row> rows;
  detail::json env = detail::json::make_object();
};

inline std::string to_json(const bench_result& result, int indent = 1) {
  using detail::json;
  json rows = json::make_array();
  for (const auto& row : result.rows) {
    json item = json::make_object();
    item.set("bytes", row.bytes);
    item.set("count", row.count);
    item.set("time_us", row.time_us);
    item.set("algbw_GBps", row.algbw_GBps);
    item.set("busbw_GBps", row.busbw_GBps);
    item.set("wrong", row.wrong);
    if (row.inplace_time_us) item.set("inplace_time_us", *row.inplace_time_us);
    if (row.inplace_algbw_GBps) item.set("inplace_algbw_GBps", *row.inplace_algbw_GBps);
    if (row.inplace_busbw_GBps) item.set("inplace_busbw_GBps", *row.inplace_busbw_GBps);
    rows.push_back(std::move(item));
  }
  json document = json::make_object();
  document.set("tool", result.tool);
  document.set("operation", result.operation);
  document.set("backend", result.backend);
  document.set("world", result.world);
  document.set("dtype", result.dtype);
  document.set("rows", std::move(rows));
  document.set("env", result.env);
  return document.dump(indent);
}

inline bench_result parse_bench_result(std::string_view text) {
  using detail::json;
  const json document = detail::parse_json(text);
  if (!document.is_object())
    throw error(-1, "read bench result", detail::text("top level is a ", document.type_name(), ", not an object"),
                "expected a cohort-bench result file");
  bench_result result;
  auto text_field = [&](const char* key, std::string& into) {
    if (const json* value = document.find(key)) into = value->as_string();
  };
  text_field("tool", result.tool);
  text_field("operation", result.operation);
  text_field("backend", result.backend);
  text_field("dtype", result.dtype);
  (void)parse_collective(result.operation);  // rejects unknown operations early
  const std::int64_t world = document.at("world").as_int64();
  if (world < 1 || world > 1 << 20)
    throw error(-1, "read bench result", detail::text("world = ", std::to_string(world)), "expected 1 or more ranks");
  result.world = static_cast<int>(world);
  std::size_t index = 0;
  for (const json& item : document.at("rows").as_array()) {
    auto number = [&](const char* key) -> std::optional<double> {
      const json* value = item.find(key);
      if (!value || value->is_null()) return std::nullopt;
      return value->as_number();
    };
    auto required = [&](const char* key) {
      if (!item.is_object())
        throw error(-1, "read bench result", detail::text("row ", std::to_string(index), " is a ", item.type_name()));
      auto value = number(key);
      if (!value)
        throw error(-1, "read bench result", detail::text("row ", std::to_string(index), " has no \"", key, "\""));
      return *value;
    };
    bench_row row;
    row.bytes = required("bytes");
    row.time_us = required("time_us");
    if (row.bytes < 0 || row.time_us < 0)
      throw error(-1, "read bench result",
                  detail::text("row ", std::to_string(index), " has a negative bytes or time_us"));
    row.count = number("count").value_or(0);
    row.algbw_GBps = number("algbw_GBps").value_or(0);
    row.busbw_GBps = number("busbw_GBps").value_or(0);
    row.wrong = number("wrong").value_or(0);
    row.inplace_time_us = number("inplace_time_us");
    row.inplace_algbw_GBps = number("inplace_algbw_GBps");
    row.inplace_busbw_GBps = number("inplace_busbw_GBps");
    result.rows.push_back(row);
    ++index;
  }
  if (const json* env = document.find("env")) result.env = *env;
  return result;
}

inline bench_result read_bench_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(-1, "read bench result", detail::text("cannot open \"", path, "\""), "check the path");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return parse_bench_result(text);
  } catch (const error& e) {
    throw error(-1, e.operation(), detail::text(path, ": ", e.detail()), e.hint());
  }
}

struct timing_sample {
  double bytes = 0;    // full buffer
  double seconds = 0;  // one call
};

// Least squares of time against bus traffic: t = steps(op,p) alpha + factor(op,p) bytes beta.
// A negative intercept (noise at small sizes) is clamped: alpha = 0 and the slope refitted
// through the origin.
inline link_model fit_alpha_beta(collective op, int world, std::span<const timing_sample> samples,
                                 std::string name = "measured") {
  if (world < 2)
    throw error(-1, "fit_alpha_beta", detail::text("world = ", std::to_string(world)),
                "a fit needs measurements with at least 2 ranks");
  if (samples.size() < 2)
    throw error(-1, "fit_alpha_beta", detail::text(std::to_string(samples.size()), " sample(s)"),
                "need at least two message sizes");
  const double factor = bus_factor(op, world), steps = ring_steps(op, world);
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(samples.size());
  for (const auto& s : samples) {
    const double x = factor * s.bytes;
    sx += x;
    sy += s.seconds;
    sxx += x * x;
    sxy += x * s.seconds;
  }
  const double spread = n * sxx - sx * sx;
  if (!(spread > 0))
    throw error(-1, "fit_alpha_beta", "all samples have the same size", "measure at two or more sizes");
  double slope = (n * sxy - sx * sy) / spread;
  double intercept = (sy - slope * sx) / n;
  if (intercept < 0) {
    intercept = 0;
    slope = sxy / sxx;
  }
  if (!(slope > 0))
    throw error(-1, "fit_alpha_beta", detail::text("time does not grow with size (slope ", std::to_string(slope), ")"),
                "measure larger messages, where bandwidth dominates");
  link_model link;
  link.name = std::move(name);
  link.alpha_seconds = intercept / steps;
  link.beta_seconds_per_byte = slope;
  link.kind = link_kind::host;
  std::ostringstream source;
  source << "least-squares fit of " << samples.size() << " " << to_string(op) << " timings on " << world << " ranks";
  link.source = source.str();
  return link;
}

inline link_model fit_alpha_beta(const bench_result& result) {
  std::vector<timing_sample> samples;
  for (const auto& row : result.rows) samples.push_back({row.bytes, row.time_us * 1e-6});
  link_model link =
      fit_alpha_beta(parse_collective(result.operation), result.world, samples,
                     detail::text("measured-", (result.backend.empty() ? std::string("bench") : result.backend)));
  link.kind = result.backend == "nccl" ? link_kind::unknown : link_kind::host;
  link.source +=
      detail::text(" from ", result.tool, (result.backend.empty() ? "" : detail::text(" (", result.backend, ")")));
  return link;
}

// ---------------------------------------------------------------------------------------
// The plan.

enum class plan_advice { single_gpu, data_parallel, sharded, does_not_fit };

constexpr std::string_view to_string(plan_advice s) noexcept {
  switch (s) {
    case plan_advice::single_gpu: return "single GPU";
    case plan_advice::data_parallel: return "data parallelism (training_state strategy::ddp)";
    case plan_advice::sharded: return "sharding (FSDP / ZeRO-3 style: training_state strategy::zero3)";
    case plan_advice::does_not_fit: return "does not fit";
  }
  return "?";
}

struct plan_input {
  double parameters = 0;                // total count; ignored when unit_parameters is given
  std::vector<double> unit_parameters;  // parameters per sharding unit (layer, block)
  int default_units = 32;               // units assumed when only a total is given
  int dtype_bytes = 2;                  // bytes per communicated element (bf16: 2)
  int gpus_per_node = 1;
  int nodes = 1;
  link_model intra_node = *find_link_model("nvlink-h100");
  link_model inter_node = *find_link_model("ib-ndr");
  int per_device_batch = 1;
  int accumulation = 1;
  double compute_seconds = 0;          // forward + backward of one micro-batch on one GPU
  double backward_fraction = 2.0 / 3;  // backward is about twice the forward
  double gpu_memory_bytes = 80.0 * (1ull << 30);
  double state_bytes_per_parameter = 16;  // mixed-precision Adam (see the top of this file)
  double usable_memory_fraction = 0.8;    // the rest is left for activations and workspace
  double bucket_bytes = 0;                // 0: the planner picks one
  double single_gpu_hours = 0;            // the whole run on one GPU, when known (0: unknown)
};

struct strategy_estimate {
  double bytes_per_step = 0;        // bytes each GPU sends per optimizer step (bus traffic)
  double comm_seconds = 0;          // communication per optimizer step, before overlap
  double hidden_fraction = 0;       // part of comm_seconds hidden behind compute
  double exposed_seconds = 0;       // what remains on the critical path
  double step_seconds = 0;          // one optimizer step
  double speedup = 0;               // samples per second vs one GPU (same per-device batch)
  double efficiency = 0;            // speedup / GPUs
  double memory_per_gpu_bytes = 0;  // model states
  bool fits = false;
};

struct plan_result {
  int world = 1;
  long long effective_batch = 0;
  double parameters = 0;
  int units = 0;
  double largest_unit_parameters = 0;
  double parameter_bytes = 0;  // parameters x dtype: also the gradient bytes
  double single_gpu_step_seconds = 0;
  double bucket_bytes = 0;
  int buckets = 0;
  strategy_estimate data_parallel;
  strategy_estimate sharded;
  bool fits_one_gpu = false;
  plan_advice recommended = plan_advice::single_gpu;
  std::vector<std::string> advice;          // the recommendation, then warnings
  std::vector<std::string> rules_of_thumb;  // the field's rules, always shown
  std::vector<std::string> assumptions;     // constants used and their sources
};

namespace detail {
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (std::fabs(bytes) >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(unit == 0 || std::fabs(bytes) >= 100 ? 0 : std::fabs(bytes) >= 10 ? 1 : 2);
  out << bytes << " " << units[unit];
  return out.str();
}
inline std::string format_seconds(double seconds) {
  std::ostringstream out;
  out.precision(3);
  if (seconds < 1e-3)
    out << seconds * 1e6 << " us";
  else if (seconds < 1)
    out << seconds * 1e3 << " ms";
  else if (seconds < 3600)
    out << seconds << " s";
  else
    out << seconds / 3600 << " h";
  return out.str();
}
inline std::string format_percent(double fraction) {
  std::ostringstream out;
  out.precision(3);
  out << fraction * 100 << "%";
  return out.str();
}

// The largest power-of-two MiB at most `bytes`, never below 1 MiB.
inline double round_down_to_power_of_two_mib(double bytes) {
  double mib = 1;
  while (mib * 2 * (1 << 20) <= bytes) mib *= 2;
  return mib * (1 << 20);
}
}  // namespace detail

// Bucket size for the data-parallel all-reduce: big enough that the ring's latency term is at
// most 10% of each bucket's transfer time (2(p-1) alpha <= 0.1 x 2(p-1)/p b beta, so
// b >= 10 p alpha / beta), small enough that at least four buckets exist so backward has
// something to overlap with and the last, exposed bucket stays small. 1 MiB to 256 MiB.
inline double recommended_bucket_bytes(double gradient_bytes, int ranks, const link_model& link) {
  const double latency_bound = 10.0 * ranks * link.alpha_seconds / link.beta_seconds_per_byte;
  const double overlap_bound = gradient_bytes / 4;
  double bucket = std::min(latency_bound, overlap_bound);
  bucket = std::clamp(bucket, double(1 << 20), double(256 << 20));
  return detail::round_down_to_power_of_two_mib(bucket);
}

inline plan_result plan(const plan_input& in) {
  auto check = [](bool ok, const std::string& what, const std::string& hint) {
    if (!ok) throw error(-1, "plan", what, hint);
  };
  check(in.gpus_per_node >= 1 && in.nodes >= 1,
        detail::text("gpus_per_node = ", std::to_string(in.gpus_per_node), ", nodes = ", std::to_string(in.nodes)),
        "both must be at least 1");
  check(in.dtype_bytes >= 1, detail::text("dtype_bytes = ", std::to_string(in.dtype_bytes)), "bf16 is 2, fp32 is 4");
  check(in.per_device_batch >= 1 && in.accumulation >= 1,
        detail::text("per_device_batch = ", std::to_string(in.per_device_batch),
                     ", accumulation = ", std::to_string(in.accumulation)),
        "both must be at least 1");
  check(in.compute_seconds >= 0, "negative compute time", "forward+backward seconds of one micro-batch");
  check(in.intra_node.beta_seconds_per_byte > 0 && in.inter_node.beta_seconds_per_byte > 0, "a link has no bandwidth",
        "beta = 1 / bus bandwidth must be positive");
  for (double unit : in.unit_parameters) check(unit > 0, "a unit with no parameters", "unit sizes must be > 0");
  check(!in.unit_parameters.empty() || in.parameters > 0, "no parameters", "give a parameter count or unit sizes");
  check(in.backward_fraction >= 0 && in.backward_fraction <= 1, "backward_fraction outside [0, 1]", "about 2/3");

  plan_result r;
  const int g = in.gpus_per_node, nodes = in.nodes;
  r.world = g * nodes;
  const double p = r.world;
  const double A = in.accumulation;
  const double c = in.compute_seconds;
  r.effective_batch = static_cast<long long>(in.per_device_batch) * in.accumulation * r.world;

  std::vector<double> units = in.unit_parameters;
  if (units.empty()) {
    const int count = std::max(1, in.default_units);
    units.assign(static_cast<std::size_t>(count), in.parameters / count);
  }
  r.units = static_cast<int>(units.size());
  r.parameters = 0;
  for (double u : units) r.parameters += u;
  r.largest_unit_parameters = *std::max_element(units.begin(), units.end());
  r.parameter_bytes = r.parameters * in.dtype_bytes;
  r.single_gpu_step_seconds = A * c;

  auto time = [&](collective op, double bytes) {
    return predict_time(op, bytes, g, nodes, in.intra_node, in.inter_node);
  };
  // The slowest link sets the pace of a flat ring: used for the bucket-size latency bound.
  const link_model& pace = nodes > 1 ? in.inter_node : in.intra_node;
  const double usable = in.usable_memory_fraction * in.gpu_memory_bytes;

  // --- data parallelism --------------------------------------------------------------
  auto& dp = r.data_parallel;
  r.bucket_bytes = in.bucket_bytes > 0 ? in.bucket_bytes : recommended_bucket_bytes(r.parameter_bytes, r.world, pace);
  r.buckets = static_cast<int>(std::ceil(r.parameter_bytes / r.bucket_bytes));
  dp.memory_per_gpu_bytes = r.parameters * in.state_bytes_per_parameter;
  dp.fits = dp.memory_per_gpu_bytes <= usable;
  if (r.world > 1) {
    dp.bytes_per_step = 2 * (p - 1) / p * r.parameter_bytes;
    const double full_buckets = std::floor(r.parameter_bytes / r.bucket_bytes);
    const double remainder = r.parameter_bytes - full_buckets * r.bucket_bytes;
    dp.comm_seconds = full_buckets * time(collective::all_reduce, r.bucket_bytes) +
                      (remainder > 0 ? time(collective::all_reduce, remainder) : 0.0);
    // Buckets are filled in backward order; the one holding the first layers is the last
    // ready, and it is the partial one when the sizes do not divide evenly.
    const double last_bucket = time(collective::all_reduce, remainder > 0 ? remainder : r.bucket_bytes);
    const double window = in.backward_fraction * c;
    dp.exposed_seconds = std::min(dp.comm_seconds, std::max(last_bucket, dp.comm_seconds - window));
  }
  dp.hidden_fraction = dp.comm_seconds > 0 ? 1 - dp.exposed_seconds / dp.comm_seconds : 0;
  dp.step_seconds = A * c + dp.exposed_seconds;

  // --- sharding ----------------------------------------------------------------------
  auto& sh = r.sharded;
  sh.memory_per_gpu_bytes = r.parameters * in.state_bytes_per_parameter / p +
                            (r.world > 1 ? 3 * r.largest_unit_parameters * in.dtype_bytes : 0.0);
  sh.fits = sh.memory_per_gpu_bytes <= usable;
  if (r.world > 1) {
    double gather_total = 0, scatter_total = 0;
    for (double u : units) {
      gather_total += time(collective::all_gather, u * in.dtype_bytes);
      scatter_total += time(collective::reduce_scatter, u * in.dtype_bytes);
    }
    const double first_gather = time(collective::all_gather, units.front() * in.dtype_bytes);
    const double last_scatter = time(collective::reduce_scatter, units.front() * in.dtype_bytes);
    const double forward_window = (1 - in.backward_fraction) * c;
    const double backward_window = in.backward_fraction * c;
    const double per_micro = 2 * gather_total + scatter_total;
    const double exposed_forward = std::min(gather_total, std::max(first_gather, gather_total - forward_window));
    const double backward_comm = gather_total + scatter_total;
    const double exposed_backward = std::min(backward_comm, std::max(last_scatter, backward_comm - backward_window));
    sh.bytes_per_step = A * 3 * (p - 1) / p * r.parameter_bytes;
    sh.comm_seconds = A * per_micro;
    sh.exposed_seconds = A * (exposed_forward + exposed_backward);
  }
  sh.hidden_fraction = sh.comm_seconds > 0 ? 1 - sh.exposed_seconds / sh.comm_seconds : 0;
  sh.step_seconds = A * c + sh.exposed_seconds;

  for (auto* estimate : {&dp, &sh}) {
    if (estimate->step_seconds > 0) {
      estimate->speedup = p * r.single_gpu_step_seconds / estimate->step_seconds;
      estimate->efficiency = estimate->speedup / p;
    } else {
      estimate->speedup = p;  // no compute time given: nothing to compare against
      estimate->efficiency = 1;
    }
  }
  r.fits_one_gpu = dp.fits;

  // --- recommendation ----------------------------------------------------------------
  using detail::format_bytes;
  using detail::format_percent;
  using detail::format_seconds;
  const bool slow_link =
      in.intra_node.kind == link_kind::pcie || (nodes > 1 && in.inter_node.kind != link_kind::nvlink);
  const std::string states =
      detail::text(format_bytes(dp.memory_per_gpu_bytes), " of model states vs ", format_bytes(usable), " usable (",
                   format_percent(in.usable_memory_fraction), " of ", format_bytes(in.gpu_memory_bytes), ")");
  if (r.world == 1) {
    r.recommended = dp.fits ? plan_advice::single_gpu : plan_advice::does_not_fit;
    r.advice.push_back(dp.fits ? detail::text("one GPU: nothing to communicate; the model fits (", states, ")")
                               : detail::text("the model does not fit one GPU (", states,
                                              "): shard it across several GPUs, or offload optimizer state"));
  } else if (dp.fits) {
    r.recommended = plan_advice::data_parallel;
    std::string text = detail::text("the model fits one GPU (", states, "): use data parallelism");
    if (sh.step_seconds > dp.step_seconds * 1.001) {
      text += detail::text(
          "; sharding", (in.intra_node.kind == link_kind::pcie ? " over PCIe" : ""), " would be slower (",
          format_seconds(sh.step_seconds), " vs ", format_seconds(dp.step_seconds),
          " per step: it moves 1.5x the bytes, 3(p-1)/p instead of 2(p-1)/p of the model, every micro-batch)");
    }
    r.advice.push_back(text);
  } else if (sh.fits) {
    r.recommended = plan_advice::sharded;
    r.advice.push_back(detail::text(
        "the model does not fit one GPU (", states, "): shard parameters, gradients and optimizer ", "state over the ",
        std::to_string(r.world), " GPUs, ", format_bytes(sh.memory_per_gpu_bytes), " per GPU"));
    if (slow_link && c > 0 && sh.efficiency < 0.8)
      r.advice.push_back(detail::text("warning: sharding gathers every unit twice per micro-batch, and over ",
                                      (in.intra_node.kind == link_kind::pcie ? "PCIe" : "this network"), " only ",
                                      format_percent(sh.hidden_fraction), " of it hides (scaling efficiency ",
                                      format_percent(sh.efficiency),
                                      "): prefer NVLink machines, larger micro-batches, or activation checkpointing to "
                                      "free memory for data parallelism"));
  } else {
    r.recommended = plan_advice::does_not_fit;
    const double needed = std::ceil(r.parameters * in.state_bytes_per_parameter /
                                    std::max(1.0, usable - 3 * r.largest_unit_parameters * in.dtype_bytes));
    r.advice.push_back(detail::text("the model does not fit even sharded over ", std::to_string(r.world), " GPUs (",
                                    format_bytes(sh.memory_per_gpu_bytes), " per GPU vs ", format_bytes(usable),
                                    " usable): at least ", std::to_string(static_cast<long long>(needed)),
                                    " GPUs, CPU offload of optimizer state, or tensor/pipeline parallelism"));
  }
  const strategy_estimate* chosen = r.recommended == plan_advice::sharded ? &sh : &dp;
  if (r.world > 1 && c > 0 && r.recommended != plan_advice::does_not_fit && chosen->efficiency < 0.5)
    r.advice.push_back(
        detail::text("warning: communication dominates (scaling efficiency ", format_percent(chosen->efficiency), "): ",
                     (r.recommended == plan_advice::data_parallel
                          ? "raise accumulation (data parallelism communicates once per optimizer step) or the "
                            "per-device batch"
                          : "raise the per-device batch (sharding communicates every micro-batch)"),
                     ", or use fewer GPUs on a faster link"));
  if (r.world > 1 && c == 0)
    r.advice.push_back(
        "no compute time given (--compute-ms): nothing hides communication; speedups are not meaningful");
  if (r.world > 1 && r.recommended == plan_advice::data_parallel)
    r.advice.push_back(
        detail::text("bucket size ", format_bytes(r.bucket_bytes), " (", std::to_string(r.buckets),
                     " buckets): the ring latency stays under 10% of each bucket's transfer, and at least "
                     "four buckets let backward hide all but the last"));

  r.rules_of_thumb.push_back(detail::text(
      "a run that takes under about twelve hours on one GPU rarely repays multi-GPU setup (launch, rendezvous, "
      "debugging): run it on one GPU and give the others different work",
      (in.single_gpu_hours > 0
           ? detail::text(" (this run: ", detail::format_seconds(in.single_gpu_hours * 3600), " on one GPU",
                          (in.single_gpu_hours < 12 ? ", under the threshold)" : ")"))
           : std::string())));
  r.rules_of_thumb.push_back(
      "for ablations, two different configurations on two GPUs beat one configuration on both: the same "
      "wall-clock, twice the answers, no communication");
  r.rules_of_thumb.push_back(
      detail::text("the effective batch is ", std::to_string(r.effective_batch),
                   " (per-device x accumulation x GPUs): when it changes, retune the learning rate "
                   "(linear scaling with warmup is the usual start)"));

  auto describe = [](const char* role, const link_model& link) {
    std::ostringstream out;
    out.precision(4);
    out << role << " " << link.name << ": alpha " << link.alpha_seconds * 1e6 << " us, busbw "
        << link.bus_bandwidth_bytes_per_second() / 1e9 << " GB/s; source: " << link.source;
    return out.str();
  };
  r.assumptions.push_back(describe("intra-node link", in.intra_node));
  if (nodes > 1) r.assumptions.push_back(describe("inter-node link (per GPU)", in.inter_node));
  r.assumptions.push_back(
      "ring alpha-beta model: all-reduce 2(p-1) alpha + 2(p-1)/p n beta; all-gather and "
      "reduce-scatter (p-1) alpha + (p-1)/p n beta; across nodes hierarchical");
  r.assumptions.push_back(
      detail::text("overlap: data-parallel all-reduce hides behind the last micro-batch's backward (",
                   format_percent(in.backward_fraction),
                   " of compute) except its last bucket; sharded gathers are prefetched, the first "
                   "gather and last reduce-scatter of each micro-batch stay exposed"));
  r.assumptions.push_back(
      detail::text(std::to_string(static_cast<int>(in.state_bytes_per_parameter)),
                   " bytes of model state per parameter (mixed-precision Adam, ZeRO accounting); "
                   "activations not included",
                   (in.unit_parameters.empty() ? detail::text("; ", std::to_string(r.units),
                                                              " equal sharding units assumed (give --units for real "
                                                              "layer sizes)")
                                               : std::string())));
  return r;
}

}  // namespace cohort::inline v0
