// The parallelism planner: the alpha-beta formulas against hand-computed numbers, the plan's
// arithmetic, recommendations that flip with model size and link, fitting measured
// constants, and the cohort-bench result file.

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "cohort/tools/planner.hpp"

using cohort::collective;
using cohort::link_model;

namespace {
link_model made_up_link(double alpha_us, double busbw_GBps, cohort::link_kind kind = cohort::link_kind::nvlink) {
  link_model link;
  link.name = "test";
  link.alpha_seconds = alpha_us * 1e-6;
  link.beta_seconds_per_byte = 1 / (busbw_GBps * 1e9);
  link.kind = kind;
  link.source = "test";
  return link;
}

bool any_contains(const std::vector<std::string>& lines, const std::string& needle) {
  for (const auto& line : lines)
    if (line.find(needle) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST_CASE("planner: ring formulas at p = 4, n = 1 GiB match the hand-computed values") {
  const link_model link = made_up_link(5, 20);  // 5 us, 20 GB/s
  const double n = 1073741824;
  // all-reduce: 2*3*5e-6 + (2*3/4) * 2^30 / 20e9 = 3e-5 + 0.0805306368
  CHECK(cohort::predict_time(collective::all_reduce, n, 4, link) == Approx(0.0805606368).epsilon(1e-12));
  // all-gather and reduce-scatter: 3*5e-6 + (3/4) * 2^30 / 20e9 = 1.5e-5 + 0.0402653184
  CHECK(cohort::predict_time(collective::all_gather, n, 4, link) == Approx(0.0402803184).epsilon(1e-12));
  CHECK(cohort::predict_time(collective::reduce_scatter, n, 4, link) == Approx(0.0402803184).epsilon(1e-12));
  // broadcast (pipelined): 3*5e-6 + 2^30 / 20e9
  CHECK(cohort::predict_time(collective::broadcast, n, 4, link) == Approx(0.0536870912 + 1.5e-5).epsilon(1e-12));
  CHECK(cohort::predict_time(collective::all_reduce, n, 1, link) == 0);
  CHECK_THROWS_AS(cohort::predict_time(collective::all_reduce, n, 0, link), cohort::error);
}

TEST_CASE("planner: hierarchical collectives reduce to the flat ones and add up across nodes") {
  const link_model nv = made_up_link(2, 300), ib = made_up_link(6, 40, cohort::link_kind::network);
  const double n = 8e9;
  CHECK(cohort::predict_time(collective::all_reduce, n, 8, 1, nv, ib) ==
        cohort::predict_time(collective::all_reduce, n, 8, nv));
  CHECK(cohort::predict_time(collective::all_reduce, n, 1, 4, nv, ib) ==
        cohort::predict_time(collective::all_reduce, n, 4, ib));
  // 8 GPUs x 2 nodes: reduce-scatter in the node (7 alpha + 7/8 n beta), all-reduce of n/8
  // between nodes (2 alpha + 2/2 n/8 beta), all-gather in the node (7 alpha + 7/8 n beta).
  const double expected =
      (7 * 2e-6 + 7.0 / 8 * n / 300e9) + (2 * 6e-6 + 1.0 * (n / 8) / 40e9) + (7 * 2e-6 + 7.0 / 8 * n / 300e9);
  CHECK(cohort::predict_time(collective::all_reduce, n, 8, 2, nv, ib) == Approx(expected).epsilon(1e-12));
}

TEST_CASE("planner: plan arithmetic for 4 GPUs, 1e9 parameters, 4 equal buckets") {
  cohort::plan_input in;
  in.parameters = 1e9;
  in.default_units = 10;
  in.dtype_bytes = 2;
  in.gpus_per_node = 4;
  in.intra_node = made_up_link(5, 100);
  in.per_device_batch = 8;
  in.accumulation = 2;
  in.compute_seconds = 0.3;
  in.gpu_memory_bytes = 80e9;
  in.bucket_bytes = 5e8;  // 2e9 gradient bytes: exactly four buckets
  const auto r = cohort::plan(in);

  CHECK(r.world == 4);
  CHECK(r.effective_batch == 8 * 2 * 4);
  CHECK(r.units == 10);
  CHECK(r.parameter_bytes == 2e9);
  CHECK(r.buckets == 4);
  CHECK(r.single_gpu_step_seconds == Approx(0.6));

  // Data parallel: 2(p-1)/p x gradient bytes; four all-reduces of 5e8 bytes.
  CHECK(r.data_parallel.bytes_per_step == Approx(1.5 * 2e9));
  const double bucket_time = 6 * 5e-6 + 1.5 * 5e8 / 100e9;  // 0.00753
  CHECK(r.data_parallel.comm_seconds == Approx(4 * bucket_time));
  // Window = 2/3 of 0.3 s = 0.2 s > comm, so only the last bucket is exposed.
  CHECK(r.data_parallel.exposed_seconds == Approx(bucket_time));
  CHECK(r.data_parallel.hidden_fraction == Approx(0.75));
  CHECK(r.data_parallel.step_seconds == Approx(0.6 + bucket_time));
  CHECK(r.data_parallel.speedup == Approx(4 * 0.6 / (0.6 + bucket_time)));
  CHECK(r.data_parallel.efficiency == Approx(0.6 / (0.6 + bucket_time)));

  // Sharded: 3(p-1)/p x parameter bytes per micro-batch, two micro-batches per step, and
  // 3 latency terms per unit per micro-batch.
  CHECK(r.sharded.bytes_per_step == Approx(2 * 3 * 0.75 * 2e9));
  const double unit_op = 3 * 5e-6 + 0.75 * 2e8 / 100e9;  // one gather or scatter of a 1e8-parameter unit
  CHECK(r.sharded.comm_seconds == Approx(2 * 3 * 10 * unit_op));
  // Forward: 10 gathers (0.01515 s) under a 0.1 s window: the first gather stays exposed.
  // Backward: 20 ops (0.0303 s) under a 0.2 s window: the last reduce-scatter stays exposed.
  CHECK(r.sharded.exposed_seconds == Approx(2 * (unit_op + unit_op)));

  // Memory: 16 bytes per parameter; sharded: 16/p plus three copies of the largest unit.
  CHECK(r.data_parallel.memory_per_gpu_bytes == Approx(16e9));
  CHECK(r.sharded.memory_per_gpu_bytes == Approx(4e9 + 3 * 1e8 * 2));
  CHECK(r.fits_one_gpu);
  CHECK(r.recommended == cohort::plan_advice::data_parallel);
}

TEST_CASE("planner: communication longer than the backward window is exposed beyond the last bucket") {
  cohort::plan_input in;
  in.parameters = 1e9;
  in.gpus_per_node = 8;
  in.intra_node = made_up_link(3, 10, cohort::link_kind::pcie);
  in.compute_seconds = 0.03;  // backward window 0.02 s
  in.bucket_bytes = 2.5e8;    // 8 buckets
  const auto r = cohort::plan(in);
  const double bucket_time = 14 * 3e-6 + 1.75 * 2.5e8 / 10e9;
  CHECK(r.data_parallel.comm_seconds == Approx(8 * bucket_time));
  CHECK(r.data_parallel.exposed_seconds == Approx(8 * bucket_time - 0.02));
}

TEST_CASE("planner: unit sizes set the sharding latency term and the largest working set") {
  cohort::plan_input in;
  in.unit_parameters = {1e8, 3e8, 1e8};
  in.dtype_bytes = 4;
  in.gpus_per_node = 2;
  in.intra_node = made_up_link(10, 50);
  in.compute_seconds = 0;  // nothing hides anything
  const auto r = cohort::plan(in);
  CHECK(r.parameters == 5e8);
  CHECK(r.units == 3);
  CHECK(r.largest_unit_parameters == 3e8);
  double expected = 0;
  for (double u : {1e8, 3e8, 1e8}) expected += 3 * (1 * 10e-6 + 0.5 * u * 4 / 50e9);
  CHECK(r.sharded.comm_seconds == Approx(expected));
  CHECK(r.sharded.exposed_seconds == Approx(expected));
  CHECK(r.sharded.memory_per_gpu_bytes == Approx(16 * 5e8 / 2 + 3 * 3e8 * 4));
  CHECK(any_contains(r.advice, "no compute time given"));
}

TEST_CASE("planner: recommendations flip with model size and link") {
  cohort::plan_input in;
  in.gpus_per_node = 8;
  in.compute_seconds = 0.5;
  in.gpu_memory_bytes = 80e9;

  SECTION("a model that fits one GPU: data parallelism") {
    in.parameters = 1e9;
    in.intra_node = *cohort::find_link_model("nvlink-h100");
    const auto r = cohort::plan(in);
    CHECK(r.fits_one_gpu);
    CHECK(r.recommended == cohort::plan_advice::data_parallel);
    CHECK(any_contains(r.advice, "use data parallelism"));
  }
  SECTION("over PCIe: data parallelism, and the text says sharding would be slower") {
    in.parameters = 1e9;
    in.intra_node = *cohort::find_link_model("pcie-gen4");
    const auto r = cohort::plan(in);
    CHECK(r.recommended == cohort::plan_advice::data_parallel);
    CHECK(r.sharded.step_seconds > r.data_parallel.step_seconds);
    CHECK(any_contains(r.advice, "sharding over PCIe would be slower"));
  }
  SECTION("a model too big for one GPU: sharding") {
    in.parameters = 20e9;  // 320 GB of states; 40 GB per GPU sharded over 8
    in.intra_node = *cohort::find_link_model("nvlink-h100");
    const auto r = cohort::plan(in);
    CHECK_FALSE(r.fits_one_gpu);
    CHECK(r.sharded.fits);
    CHECK(r.recommended == cohort::plan_advice::sharded);
    CHECK_FALSE(any_contains(r.advice, "warning: sharding"));
  }
  SECTION("a model too big for one GPU over PCIe: sharding, with a warning") {
    in.parameters = 20e9;
    in.intra_node = *cohort::find_link_model("pcie-gen4");
    const auto r = cohort::plan(in);
    CHECK(r.recommended == cohort::plan_advice::sharded);
    CHECK(any_contains(r.advice, "warning: sharding"));
  }
  SECTION("a model too big even sharded: does not fit, with the GPUs it would need") {
    in.parameters = 100e9;  // 1.6 TB of states: 200 GB per GPU over 8
    const auto r = cohort::plan(in);
    CHECK(r.recommended == cohort::plan_advice::does_not_fit);
    CHECK(any_contains(r.advice, "does not fit even sharded"));
  }
  SECTION("one GPU: nothing to communicate") {
    in.gpus_per_node = 1;
    in.parameters = 1e9;
    const auto r = cohort::plan(in);
    CHECK(r.recommended == cohort::plan_advice::single_gpu);
    CHECK(r.data_parallel.comm_seconds == 0);
    CHECK(r.data_parallel.speedup == Approx(1));
  }
  SECTION("communication-bound data parallelism asks for more accumulation") {
    in.parameters = 1e9;
    in.compute_seconds = 0.01;
    in.intra_node = *cohort::find_link_model("pcie-gen4");
    const auto r = cohort::plan(in);
    CHECK(r.data_parallel.efficiency < 0.5);
    CHECK(any_contains(r.advice, "raise accumulation"));
    in.accumulation = 64;
    const auto amortised = cohort::plan(in);
    CHECK(amortised.data_parallel.efficiency > r.data_parallel.efficiency);
  }
}

TEST_CASE("planner: the rules of thumb are always in the output") {
  cohort::plan_input in;
  in.parameters = 1e8;
  in.gpus_per_node = 2;
  in.compute_seconds = 0.1;
  in.single_gpu_hours = 5;
  const auto r = cohort::plan(in);
  CHECK(any_contains(r.rules_of_thumb, "twelve hours"));
  CHECK(any_contains(r.rules_of_thumb, "under the threshold"));
  CHECK(any_contains(r.rules_of_thumb, "two different configurations on two GPUs"));
  CHECK(any_contains(r.assumptions, "nvlink-h100"));
  CHECK(any_contains(r.assumptions, "nccl-tests"));
}

TEST_CASE("planner: bucket size bounds the latency term and leaves at least four buckets") {
  const link_model link = made_up_link(5, 20);  // 10 p alpha / beta = 10*8*5e-6*20e9 = 8e6 bytes
  const double bucket = cohort::recommended_bucket_bytes(10e9, 8, link);
  CHECK(bucket == 4 * (1 << 20));  // largest power-of-two MiB under 8e6 bytes (7.6 MiB)
  // The latency term of one bucket is at most 10%... of a bucket twice as large.
  CHECK(2 * 7 * link.alpha_seconds <= 0.1 * 2 * 7.0 / 8 * (2 * bucket) * link.beta_seconds_per_byte);
  // Small models: at most a quarter of the gradients, never below 1 MiB.
  CHECK(cohort::recommended_bucket_bytes(64.0 * (1 << 20), 8, *cohort::find_link_model("nvlink-h100")) ==
        16 * (1 << 20));
  CHECK(cohort::recommended_bucket_bytes(1000, 8, link) == 1 << 20);
}

TEST_CASE("planner: presets carry positive constants and a source, unknown names are refused") {
  for (const auto& link : cohort::link_presets()) {
    CHECK(link.alpha_seconds > 0);
    CHECK(link.beta_seconds_per_byte > 0);
    CHECK_FALSE(link.source.empty());
  }
  const auto h100 = cohort::link_model_by_name("nvlink-h100");
  CHECK(h100.bus_bandwidth_bytes_per_second() == Approx(370e9));
  CHECK(cohort::link_model_by_name("pcie-gen5").bus_bandwidth_bytes_per_second() >
        cohort::link_model_by_name("pcie-gen4").bus_bandwidth_bytes_per_second());
  CHECK_THROWS_WITH(cohort::link_model_by_name("nvlink-z9"),
                    Catch::Contains("nvlink-z9") && Catch::Contains("pcie-gen4"));
}

TEST_CASE("planner: fit_alpha_beta recovers known constants from synthetic timings") {
  for (collective op : {collective::all_reduce, collective::all_gather, collective::broadcast}) {
    for (int world : {2, 4, 8}) {
      const link_model truth = made_up_link(37, 3.5, cohort::link_kind::host);
      std::vector<cohort::timing_sample> samples;
      for (double bytes = 1024; bytes <= 256e6; bytes *= 4)
        samples.push_back({bytes, cohort::predict_time(op, bytes, world, truth)});
      const auto fitted = cohort::fit_alpha_beta(op, world, samples);
      CHECK(fitted.alpha_seconds == Approx(truth.alpha_seconds).epsilon(1e-6));
      CHECK(fitted.beta_seconds_per_byte == Approx(truth.beta_seconds_per_byte).epsilon(1e-9));
      // The fitted model predicts the measurements back.
      for (const auto& s : samples) CHECK(cohort::predict_time(op, s.bytes, world, fitted) == Approx(s.seconds));
    }
  }
}

TEST_CASE("planner: fit_alpha_beta clamps a negative intercept and refuses unusable input") {
  // Time exactly proportional to size, minus a little: the intercept would be negative.
  std::vector<cohort::timing_sample> samples = {{1e6, 1e-4 - 2e-6}, {2e6, 2e-4 - 2e-6}, {4e6, 4e-4 - 2e-6}};
  const auto fitted = cohort::fit_alpha_beta(collective::all_reduce, 2, samples);
  CHECK(fitted.alpha_seconds == 0);
  CHECK(fitted.beta_seconds_per_byte > 0);

  const std::vector<cohort::timing_sample> one = {{1e6, 1e-3}};
  CHECK_THROWS_WITH(cohort::fit_alpha_beta(collective::all_reduce, 2, one), Catch::Contains("two message sizes"));
  const std::vector<cohort::timing_sample> same = {{1e6, 1e-3}, {1e6, 2e-3}};
  CHECK_THROWS_WITH(cohort::fit_alpha_beta(collective::all_reduce, 2, same), Catch::Contains("same size"));
  CHECK_THROWS_WITH(cohort::fit_alpha_beta(collective::all_reduce, 1, samples), Catch::Contains("at least 2 ranks"));
  const std::vector<cohort::timing_sample> flat = {{1e3, 1e-3}, {1e6, 1e-3}};
  CHECK_THROWS_WITH(cohort::fit_alpha_beta(collective::all_reduce, 2, flat), Catch::Contains("does not grow"));
}

TEST_CASE("planner: a cohort-bench result file round-trips and feeds the fit") {
  const link_model truth = made_up_link(80, 1.2, cohort::link_kind::host);
  cohort::bench_result result;
  result.operation = "all_reduce";
  result.backend = "gloo";
  result.world = 2;
  result.env.set("host", "ci");
  for (double bytes = 4096; bytes <= 64e6; bytes *= 8) {
    cohort::bench_row row;
    row.bytes = bytes;
    row.count = bytes / 4;
    row.time_us = cohort::predict_time(collective::all_reduce, bytes, 2, truth) * 1e6;
    row.algbw_GBps = bytes / (row.time_us * 1e-6) / 1e9;
    row.busbw_GBps = row.algbw_GBps * cohort::bus_factor(collective::all_reduce, 2);
    row.inplace_time_us = row.time_us * 1.01;
    result.rows.push_back(row);
  }
  const std::string text = cohort::to_json(result);
  const auto back = cohort::parse_bench_result(text);
  CHECK(back.tool == "cohort-bench");
  CHECK(back.operation == "all_reduce");
  CHECK(back.backend == "gloo");
  CHECK(back.world == 2);
  REQUIRE(back.rows.size() == result.rows.size());
  for (std::size_t i = 0; i < back.rows.size(); ++i) {
    CHECK(back.rows[i].bytes == result.rows[i].bytes);
    CHECK(back.rows[i].time_us == result.rows[i].time_us);
    CHECK(back.rows[i].busbw_GBps == result.rows[i].busbw_GBps);
    CHECK(back.rows[i].inplace_time_us == result.rows[i].inplace_time_us);
    CHECK_FALSE(back.rows[i].inplace_busbw_GBps.has_value());
  }
  CHECK(back.env.at("host").as_string() == "ci");

  const auto fitted = cohort::fit_alpha_beta(back);
  CHECK(fitted.alpha_seconds == Approx(truth.alpha_seconds).epsilon(1e-6));
  CHECK(fitted.beta_seconds_per_byte == Approx(truth.beta_seconds_per_byte).epsilon(1e-9));
  CHECK(fitted.kind == cohort::link_kind::host);
  CHECK(fitted.name == "measured-gloo");

  // The measured link drives a plan like any preset.
  cohort::plan_input in;
  in.parameters = 1e6;
  in.gpus_per_node = 2;
  in.intra_node = fitted;
  in.bucket_bytes = 4e6;
  const auto r = cohort::plan(in);
  // 2e6 gradient bytes in one (partial) 4e6-byte bucket: one all-reduce of 2e6 bytes.
  CHECK(r.buckets == 1);
  CHECK(r.data_parallel.comm_seconds == Approx(cohort::predict_time(collective::all_reduce, 2e6, 2, truth)));
}

TEST_CASE("planner: malformed cohort-bench files are refused with the reason") {
  CHECK_THROWS_WITH(cohort::parse_bench_result("[1]"), Catch::Contains("not an object"));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 2})"), Catch::Contains("missing key \"rows\""));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"rows": []})"), Catch::Contains("missing key \"world\""));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 2, "operation": "all_to_one", "rows": []})"),
                    Catch::Contains("all_to_one"));
  // Both names of the all-to-all are read: the library's and nccl-tests'.
  CHECK(cohort::parse_collective("all_to_all") == cohort::collective::all_to_all);
  CHECK(cohort::parse_collective("alltoall") == cohort::collective::all_to_all);
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 0, "rows": []})"), Catch::Contains("world = 0"));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 2, "rows": [{"bytes": 8}]})"),
                    Catch::Contains("row 0 has no \"time_us\""));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 2, "rows": [{"bytes": 8, "time_us": "fast"}]})"),
                    Catch::Contains("expected a number"));
  CHECK_THROWS_WITH(cohort::parse_bench_result(R"({"world": 2, "rows": [{"bytes": 8, "time_us": 1},]})"),
                    Catch::Contains("json parse"));
  CHECK_THROWS_WITH(cohort::read_bench_file("/nonexistent/bench.json"), Catch::Contains("cannot open"));
}
