// gradient_reducer on Gloo ranks as threads: bucket assignment, exact averaging, training
// equivalence with single-rank SGD, overlap, accumulation, unused gradients, errors,
// rebuilt buckets, compression and hooks.
#include <catch2/catch.hpp>

#include <cohort/backend/gloo.hpp>
#include <cohort/reducer.hpp>
#include <cohort/store.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "../examples/mlp.hpp"
#include "support.hpp"

namespace {

using group = cohort::process_group<cohort::gloo>;
using reducer = cohort::gradient_reducer<cohort::gloo>;
using cohort::dtype;

group make_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(5);
  return group(store, cohort::launch_env::explicit_ranks(rank, world), options);
}

using tensors = std::vector<std::vector<float>>;

std::vector<std::span<float>> spans(tensors& values) {
  std::vector<std::span<float>> result;
  for (auto& v : values) result.emplace_back(v);
  return result;
}

tensors zeros(const std::vector<std::size_t>& sizes) {
  tensors result;
  for (auto n : sizes) result.emplace_back(n, 0.0f);
  return result;
}

float max_abs_difference(const tensors& a, const tensors& b) {
  float worst = 0;
  for (std::size_t t = 0; t < a.size(); ++t)
    for (std::size_t i = 0; i < a[t].size(); ++i) worst = std::max(worst, std::abs(a[t][i] - b[t][i]));
  return worst;
}

// A model whose tensors are of varied sizes: biases of a few elements, weights from a few
// hundred to several thousand elements, so small caps split them over many buckets and
// some weights are larger than a cap.
const std::vector<std::size_t> small_widths{6, 40, 90, 30, 3};

struct training {
  std::vector<std::size_t> widths = small_widths;
  std::size_t samples = 12;  // divisible by 2, 3 and 4
  int steps = 4;
  float lr = 0.05f;
  cohort::reducer_options options = {.first_bucket_bytes = 2048, .bucket_bytes = 8192};
  cohort::gradient_storage storage = cohort::gradient_storage::bucket_views;
};

// SGD on the whole batch in one process: the reference.
tensors train_single(const training& setup) {
  const cohort_examples::mlp model(setup.widths);
  const auto data = cohort_examples::synthetic_data::make(setup.samples, model.input_width(), model.output_width(), 11);
  auto params = zeros(model.parameter_sizes());
  auto grads = zeros(model.parameter_sizes());
  auto p = spans(params);
  auto g = spans(grads);
  model.initialize(p, 3);
  for (int step = 0; step < setup.steps; ++step) {
    model.loss_and_gradients(p, g, data.inputs, data.targets, setup.samples);
    for (std::size_t t = 0; t < params.size(); ++t)
      for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= setup.lr * grads[t][i];
  }
  return params;
}

// The same SGD on `world` ranks, each on its contiguous shard of the batch, with the
// reducer averaging gradients. Returns rank 0's parameters; checks all ranks agree exactly.
tensors train_distributed(int world, const training& setup) {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<tensors> results(static_cast<std::size_t>(world));
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    const cohort_examples::mlp model(setup.widths);
    const auto data =
        cohort_examples::synthetic_data::make(setup.samples, model.input_width(), model.output_width(), 11);
    const std::size_t shard = setup.samples / static_cast<std::size_t>(world);
    const std::size_t first = shard * static_cast<std::size_t>(rank);
    std::span<const float> inputs(data.inputs.data() + first * model.input_width(), shard * model.input_width());
    std::span<const float> targets(data.targets.data() + first * model.output_width(), shard * model.output_width());

    auto params = zeros(model.parameter_sizes());
    auto p = spans(params);
    // Replicas start different and are made equal by the broadcast.
    model.initialize(p, rank == 0 ? 3 : 100 + static_cast<std::uint64_t>(rank));
    cohort::broadcast_parameters(pg, p).wait();

    auto user_grads = zeros(model.parameter_sizes());
    auto user_spans = spans(user_grads);
    const bool views = setup.storage == cohort::gradient_storage::bucket_views;
    auto ddp = views ? std::make_unique<reducer>(pg, model.parameter_sizes(), setup.options)
                     : std::make_unique<reducer>(pg, user_spans, setup.options);
    RANK_CHECK(ddp->storage() == setup.storage);
    for (int step = 0; step < setup.steps; ++step) {
      auto g = ddp->gradients();  // fetched each step: a rebuild may move the views
      model.loss_and_gradients(p, g, inputs, targets, shard, [&](std::size_t t) { ddp->mark_ready(t); });
      const auto summary = ddp->finish();
      RANK_CHECK(summary.synchronized);
      g = ddp->gradients();
      for (std::size_t t = 0; t < params.size(); ++t)
        for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= setup.lr * g[t][i];
    }
    results[static_cast<std::size_t>(rank)] = params;
  });
  for (int r = 1; r < world; ++r) REQUIRE(results[static_cast<std::size_t>(r)] == results[0]);
  return results[0];
}

}  // namespace

// ---- bucket assignment ---------------------------------------------------------------------

TEST_CASE("assign_buckets fills buckets back to front under the caps", "[reducer]") {
  // 4-byte floats; sizes chosen so the expected layout can be worked out by hand.
  const std::vector<std::size_t> sizes{100, 4, 300, 8, 2000, 4};
  const std::vector<dtype> types(sizes.size(), dtype::float32);
  const auto layout = cohort::assign_buckets(sizes, types, {.first_bucket_bytes = 64, .bucket_bytes = 2000});
  // Reverse order: 5 (4), 4 (2000 = 8000 B), 3 (8), 2 (300), 1 (4), 0 (100).
  // First bucket cap 64 B: gradient 5 (16 B), then gradient 4 would exceed it: close.
  // Gradient 4 alone (over the cap). Then 3 (32 B) + 2 (1200 B) + 1 (16 B) + 0 (400 B) = 1648 B.
  REQUIRE(layout.size() == 3);
  CHECK(layout[0].gradients == std::vector<std::size_t>{5});
  CHECK(layout[1].gradients == std::vector<std::size_t>{4});
  CHECK(layout[2].gradients == std::vector<std::size_t>{3, 2, 1, 0});
  CHECK(layout[2].offsets == std::vector<std::size_t>{0, 8, 308, 312});
  CHECK(layout[2].bytes() == (8 + 300 + 4 + 100) * 4);
  for (const auto& bucket : layout) {
    if (bucket.gradients.size() > 1) CHECK(bucket.bytes() <= 2000);
    for (auto offset : bucket.offsets) CHECK(offset % 4 == 0);  // 16-byte aligned
  }
}

TEST_CASE("assign_buckets keeps one dtype per bucket and follows a given order", "[reducer]") {
  const std::vector<std::size_t> sizes{16, 16, 16, 16};
  const std::vector<dtype> types{dtype::float32, dtype::float64, dtype::float32, dtype::float64};
  const auto reversed = cohort::assign_buckets(sizes, types, {.first_bucket_bytes = 1 << 20, .bucket_bytes = 1 << 20});
  REQUIRE(reversed.size() == 2);
  // Bucket order follows the first gradient of each: 3 (double) comes before 2 (float).
  CHECK(reversed[0].type == dtype::float64);
  CHECK(reversed[0].gradients == std::vector<std::size_t>{3, 1});
  CHECK(reversed[1].type == dtype::float32);
  CHECK(reversed[1].gradients == std::vector<std::size_t>{2, 0});

  const std::vector<std::size_t> order{0, 2, 1, 3};
  const auto custom = cohort::assign_buckets(sizes, types, {}, order);
  REQUIRE(custom.size() == 2);
  CHECK(custom[0].gradients == std::vector<std::size_t>{0, 2});
  CHECK(custom[1].gradients == std::vector<std::size_t>{1, 3});

  const std::vector<std::size_t> not_a_permutation{0, 0, 1, 2};
  CHECK_THROWS_WITH(cohort::assign_buckets(sizes, types, {}, not_a_permutation), Catch::Contains("permutation"));
}

TEST_CASE("assign_buckets with default caps: first bucket 1 MiB, the rest 25 MiB", "[reducer]") {
  // 40 tensors of 1 MiB / 8 each = 5 MiB in all.
  const std::vector<std::size_t> sizes(40, (1u << 20) / 8 / 4);
  const std::vector<dtype> types(sizes.size(), dtype::float32);
  const auto layout = cohort::assign_buckets(sizes, types);
  REQUIRE(layout.size() == 2);
  CHECK(layout[0].bytes() == (1u << 20));
  CHECK(layout[0].gradients.front() == 39);
  CHECK(layout[1].bytes() == 4u * (1u << 20));
}

// ---- exact averaging --------------------------------------------------------------------------

TEST_CASE("reducer averages mixed-dtype gradients, exactly for power-of-two worlds, both storage modes", "[reducer]") {
  const int world = GENERATE(2, 3, 4);
  const bool views = GENERATE(true, false);
  // Small integers, divided by the world size before the sum (as ncclAvg and PyTorch DDP do):
  // with a power-of-two world every quotient and every partial sum is exact, so the average
  // must be too; dividing by 3 rounds each contribution, so there a few ulps are allowed (the
  // ring adds contributions in a different order for each chunk).
  const std::vector<std::size_t> float_sizes{5, 300, 17, 1000, 3};
  const std::vector<std::size_t> double_sizes{7, 250};
  auto value = [](int rank, std::size_t tensor, std::size_t i) {
    return static_cast<double>((rank + 1) * static_cast<int>((i + 3 * tensor) % 11)) - 4.0;
  };
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    std::vector<cohort::gradient_spec> specs;
    std::vector<std::vector<float>> floats;
    std::vector<std::vector<double>> doubles;
    for (auto n : float_sizes) floats.emplace_back(n);
    for (auto n : double_sizes) doubles.emplace_back(n);
    // Interleave: f0 d0 f1 d1 f2 f3 f4.
    std::vector<std::pair<bool, std::size_t>> which{{false, 0}, {true, 0},  {false, 1}, {true, 1},
                                                    {false, 2}, {false, 3}, {false, 4}};
    for (auto [is_double, k] : which) {
      if (views)
        specs.emplace_back(is_double ? double_sizes[k] : float_sizes[k], is_double ? dtype::float64 : dtype::float32);
      else if (is_double)
        specs.emplace_back(std::span<double>(doubles[k]));
      else
        specs.emplace_back(std::span<float>(floats[k]));
    }
    reducer ddp(pg, specs, {.first_bucket_bytes = 256, .bucket_bytes = 1024});
    RANK_CHECK(ddp.bucket_count() >= 4, "buckets " << ddp.bucket_count());
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (std::size_t t = which.size(); t-- > 0;) {
        const auto [is_double, k] = which[t];
        if (is_double) {
          auto g = views ? ddp.gradient<double>(t) : std::span<double>(doubles[k]);
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = value(rank + iteration, t, i);
        } else {
          auto g = views ? ddp.gradient<float>(t) : std::span<float>(floats[k]);
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(value(rank + iteration, t, i));
        }
        ddp.mark_ready(t);
      }
      ddp.finish();
      for (std::size_t t = 0; t < which.size(); ++t) {
        const auto [is_double, k] = which[t];
        const std::size_t n = is_double ? double_sizes[k] : float_sizes[k];
        for (std::size_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int r = 0; r < world; ++r) sum += value(r + iteration, t, i);
          const bool exact = (world & (world - 1)) == 0;
          if (is_double) {
            const double got = views ? ddp.gradient<double>(t)[i] : doubles[k][i];
            const double expected = sum / world;
            const double allowed = exact ? 0.0 : 4 * std::numeric_limits<double>::epsilon() * std::abs(sum);
            RANK_CHECK(std::abs(got - expected) <= allowed,
                       "tensor " << t << "[" << i << "] " << got << " vs " << expected);
          } else {
            const float got = views ? ddp.gradient<float>(t)[i] : floats[k][i];
            const float expected = static_cast<float>(sum) / static_cast<float>(world);
            const float allowed =
                exact ? 0.0f : 4 * std::numeric_limits<float>::epsilon() * std::abs(static_cast<float>(sum));
            RANK_CHECK(std::abs(got - expected) <= allowed,
                       "tensor " << t << "[" << i << "] " << got << " vs " << expected);
          }
        }
      }
    }
  });
}

TEST_CASE("reducer averages integer gradients after the sum, truncating once", "[reducer]") {
  // Dividing each contribution first would truncate every one of them: 3 ranks holding
  // 1, 2, 3 average to 6 / 3 = 2, not 0 + 0 + 1 = 1.
  const int world = 3;
  const bool views = GENERATE(true, false);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    std::vector<std::int64_t> user(40);
    std::vector<float> user_floats(8);
    std::vector<cohort::gradient_spec> specs;
    if (views) {
      specs.emplace_back(user.size(), dtype::int64);
      specs.emplace_back(user_floats.size(), dtype::float32);
    } else {
      specs.emplace_back(std::span<std::int64_t>(user));
      specs.emplace_back(std::span<float>(user_floats));
    }
    reducer ddp(pg, specs, {.first_bucket_bytes = 64, .bucket_bytes = 1024});
    auto ints = views ? ddp.gradient<std::int64_t>(0) : std::span<std::int64_t>(user);
    auto floats = views ? ddp.gradient<float>(1) : std::span<float>(user_floats);
    for (std::size_t i = 0; i < ints.size(); ++i) ints[i] = (rank + 1) * static_cast<std::int64_t>(i) - 7;
    for (std::size_t i = 0; i < floats.size(); ++i) floats[i] = static_cast<float>(3 * (rank + 1));
    ddp.mark_ready(1);
    ddp.mark_ready(0);
    ddp.finish();
    for (std::size_t i = 0; i < ints.size(); ++i) {
      const std::int64_t sum = 6 * static_cast<std::int64_t>(i) - 21;
      RANK_CHECK(ints[i] == sum / world, "element " << i << ": " << ints[i] << " vs " << sum / world);
    }
    for (float f : floats) RANK_CHECK(f == 6.0f, "float average " << f);  // 1 + 2 + 3, each exact
  });
}

// ---- training equivalence ------------------------------------------------------------------------

TEST_CASE("data-parallel SGD equals single-rank SGD on the whole batch", "[reducer]") {
  const int world = GENERATE(2, 3, 4);
  const auto storage = GENERATE(cohort::gradient_storage::bucket_views, cohort::gradient_storage::user_buffers);
  training setup;
  setup.storage = storage;
  const auto expected = train_single(setup);
  const auto got = train_distributed(world, setup);
  INFO("world " << world << ", user buffers " << (storage == cohort::gradient_storage::user_buffers));
  CHECK(max_abs_difference(got, expected) <= 1e-5f);
  // Training moved the parameters: the comparison is not between two untouched copies.
  training still = setup;
  still.steps = 0;
  CHECK(max_abs_difference(expected, train_single(still)) > 1e-3f);
}

TEST_CASE("default caps: a weight larger than the 1 MiB first bucket, equivalence on 2 ranks", "[reducer]") {
  const auto storage = GENERATE(cohort::gradient_storage::bucket_views, cohort::gradient_storage::user_buffers);
  training setup;
  setup.widths = {8, 520, 520, 4};  // W1: 270400 floats, just over 1 MiB
  setup.samples = 4;
  setup.steps = 2;
  setup.options = {};
  setup.storage = storage;
  {
    const cohort_examples::mlp model(setup.widths);
    const auto sizes = model.parameter_sizes();
    const auto layout = cohort::assign_buckets(sizes, std::vector<dtype>(sizes.size(), dtype::float32));
    // b2 W2 b1 under the 1 MiB first cap; W1 alone is over it, so it opens the next bucket.
    REQUIRE(layout.size() == 2);
    CHECK(layout[0].gradients == std::vector<std::size_t>({5, 4, 3}));
    CHECK(layout[1].gradients == std::vector<std::size_t>({2, 1, 0}));
    CHECK(sizes[2] * 4 > (1u << 20));
  }
  CHECK(max_abs_difference(train_distributed(2, setup), train_single(setup)) <= 1e-5f);
}

// ---- overlap ---------------------------------------------------------------------------------------

TEST_CASE("the first bucket's all-reduce completes before the last gradient is marked", "[reducer]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    const cohort_examples::mlp model(small_widths);
    const auto data = cohort_examples::synthetic_data::make(4, model.input_width(), model.output_width(), 5);
    auto params = zeros(model.parameter_sizes());
    auto p = spans(params);
    model.initialize(p, 1);
    std::vector<std::string> events;
    reducer ddp(pg, model.parameter_sizes(),
                {.first_bucket_bytes = 2048, .bucket_bytes = 8192, .on_launch = [&](std::size_t b) {
                   events.push_back("launch " + std::to_string(b));
                 }});
    RANK_CHECK(ddp.bucket_count() >= 3);
    bool first_done_early = false;
    model.loss_and_gradients(p, ddp.gradients(), data.inputs, data.targets, 4, [&](std::size_t t) {
      if (t == 0) {  // W0, the last gradient the backward finishes
        RANK_CHECK(ddp.launched_buckets() >= 1);
        RANK_CHECK(ddp.launched_buckets() < ddp.bucket_count());
        // Completion needs the peer to have joined: real communication, during the backward.
        first_done_early = ddp.bucket_work(0).wait_for(std::chrono::seconds(5));
      }
      events.push_back("mark " + std::to_string(t));
      ddp.mark_ready(t);
    });
    ddp.finish();
    RANK_CHECK(first_done_early);
    const auto launch0 = std::find(events.begin(), events.end(), "launch 0");
    const auto mark_last = std::find(events.begin(), events.end(), "mark 0");
    RANK_CHECK(launch0 < mark_last);
    // Buckets launch in index order.
    std::vector<std::string> launches;
    for (const auto& e : events)
      if (e.rfind("launch", 0) == 0) launches.push_back(e);
    for (std::size_t b = 0; b < launches.size(); ++b) RANK_CHECK(launches[b] == "launch " + std::to_string(b));
  });
}

TEST_CASE("buckets launch in index order when gradients are ready out of order", "[reducer]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    std::vector<std::size_t> launched;
    reducer ddp(
        pg, std::vector<std::size_t>{64, 64, 64, 64},
        {.first_bucket_bytes = 256, .bucket_bytes = 256, .on_launch = [&](std::size_t b) { launched.push_back(b); }});
    RANK_CHECK(ddp.bucket_count() == 4);
    // Rank 1 finishes gradient 0 (the last bucket) first: nothing may launch until bucket 0 is ready.
    const std::vector<std::size_t> order =
        rank == 0 ? std::vector<std::size_t>{3, 2, 1, 0} : std::vector<std::size_t>{0, 1, 2, 3};
    for (auto t : order) {
      for (auto& x : ddp.gradient(t)) x = static_cast<float>(rank + 1);
      ddp.mark_ready(ddp.gradient(t));
    }
    if (rank == 1) RANK_CHECK(launched == std::vector<std::size_t>({0, 1, 2, 3}));
    ddp.finish();
    RANK_CHECK(launched == std::vector<std::size_t>({0, 1, 2, 3}));
    for (std::size_t t = 0; t < 4; ++t)
      for (auto x : ddp.gradient(t)) RANK_CHECK(x == 1.5f);
  });
}

// ---- accumulation -----------------------------------------------------------------------------------

TEST_CASE("no_sync over k micro-steps then one synchronised step equals one step on the k-fold batch", "[reducer]") {
  constexpr int world = 2;
  constexpr std::size_t micro = 3, per_micro = 2;
  const auto storage = GENERATE(cohort::gradient_storage::bucket_views, cohort::gradient_storage::user_buffers);
  const cohort_examples::mlp model(small_widths);
  const std::size_t total = world * micro * per_micro;
  const auto data = cohort_examples::synthetic_data::make(total, model.input_width(), model.output_width(), 21);
  const float lr = 0.1f;
  // Reference: one step on the whole batch.
  auto expected = zeros(model.parameter_sizes());
  {
    auto grads = zeros(model.parameter_sizes());
    auto p = spans(expected);
    auto g = spans(grads);
    model.initialize(p, 8);
    model.loss_and_gradients(p, g, data.inputs, data.targets, total);
    for (std::size_t t = 0; t < expected.size(); ++t)
      for (std::size_t i = 0; i < expected[t].size(); ++i) expected[t][i] -= lr * grads[t][i];
  }
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<tensors> results(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    auto params = zeros(model.parameter_sizes());
    auto p = spans(params);
    model.initialize(p, 8);
    auto user = zeros(model.parameter_sizes());
    auto user_spans = spans(user);
    std::atomic<int> launches{0};
    cohort::reducer_options options{
        .first_bucket_bytes = 2048, .bucket_bytes = 8192, .on_launch = [&](std::size_t) { ++launches; }};
    auto ddp = storage == cohort::gradient_storage::bucket_views
                   ? std::make_unique<reducer>(pg, model.parameter_sizes(), options)
                   : std::make_unique<reducer>(pg, user_spans, options);
    auto scratch = zeros(model.parameter_sizes());
    auto s = spans(scratch);
    auto micro_step = [&](std::size_t m) {
      const std::size_t first = (static_cast<std::size_t>(rank) * micro + m) * per_micro;
      std::span<const float> x(data.inputs.data() + first * model.input_width(), per_micro * model.input_width());
      std::span<const float> y(data.targets.data() + first * model.output_width(), per_micro * model.output_width());
      auto g = ddp->gradients();
      model.loss_and_gradients(p, s, x, y, per_micro, [&](std::size_t t) {
        for (std::size_t i = 0; i < g[t].size(); ++i) g[t][i] = (m == 0 ? 0.0f : g[t][i]) + scratch[t][i];
        ddp->mark_ready(t);
      });
      return ddp->finish();
    };
    {
      auto scope = ddp->no_sync();
      for (std::size_t m = 0; m + 1 < micro; ++m) {
        const auto summary = micro_step(m);
        RANK_CHECK(!summary.synchronized);
        RANK_CHECK(ddp->launched_buckets() == 0);
      }
    }
    RANK_CHECK(launches == 0, "communication inside no_sync");
    RANK_CHECK(micro_step(micro - 1).synchronized);
    RANK_CHECK(launches == static_cast<int>(ddp->bucket_count()));
    auto g = ddp->gradients();
    for (std::size_t t = 0; t < params.size(); ++t)
      for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= lr / micro * g[t][i];
    results[static_cast<std::size_t>(rank)] = params;
  });
  CHECK(max_abs_difference(results[0], expected) <= 1e-5f);
  CHECK(results[1] == results[0]);
}

// ---- errors -------------------------------------------------------------------------------------------

TEST_CASE("a gradient marked twice is an error naming it", "[reducer]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    reducer ddp(pg, std::vector<std::size_t>{10, 20, 30});
    ddp.mark_ready(2);
    RANK_CHECK_THROWS(cohort::error, ddp.mark_ready(2), "gradient 2 (30 x float) was marked ready twice");
  });
}

TEST_CASE("finish with a gradient never marked is an error listing it", "[reducer]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    reducer ddp(pg, std::vector<std::size_t>{10, 20, 30, 40}, {.first_bucket_bytes = 64, .bucket_bytes = 64});
    ddp.mark_ready(3);
    ddp.mark_ready(1);
    RANK_CHECK_THROWS(cohort::error, ddp.finish(),
                      "2 gradient(s) never marked ready: gradient 0 (10 x float), gradient 2 (30 x float)");
    // The reducer is usable again: a complete iteration works.
    for (std::size_t t = 4; t-- > 0;) {
      for (auto& x : ddp.gradient(t)) x = static_cast<float>(rank);
      ddp.mark_ready(t);
    }
    ddp.finish();
    for (std::size_t t = 0; t < 4; ++t)
      for (auto x : ddp.gradient(t)) RANK_CHECK(x == 0.5f);
  });
}

TEST_CASE("bucket layouts that differ across ranks are an error naming the ranks", "[reducer]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3);
    const std::vector<std::size_t> sizes =
        rank == 2 ? std::vector<std::size_t>{10, 21} : std::vector<std::size_t>{10, 20};
    const auto text = RANK_CHECK_THROWS(cohort::error, reducer(pg, sizes), "bucket layouts differ across ranks");
    RANK_CHECK(text.find("rank 0 has 2 gradients of 30 elements") != std::string::npos, text);
    RANK_CHECK(text.find("rank 2 has 2 gradients of 31 elements") != std::string::npos, text);
  });
}

namespace {
// Four gradients of 8 floats, one per 64-byte bucket, unused ones counted as zero; bucket
// views or user buffers.
struct unused_as_zero {
  tensors user = zeros({8, 8, 8, 8});
  std::vector<std::span<float>> user_spans = spans(user);
  std::unique_ptr<reducer> ddp;
  unused_as_zero(group& pg, bool views) {
    const cohort::reducer_options options{
        .first_bucket_bytes = 64, .bucket_bytes = 64, .unused = cohort::unused_gradients::zero};
    ddp = views ? std::make_unique<reducer>(pg, std::vector<std::size_t>{8, 8, 8, 8}, options)
                : std::make_unique<reducer>(pg, user_spans, options);
  }
};
}  // namespace

TEST_CASE("unused gradients count as zero when asked, and every rank learns which no rank used", "[reducer]") {
  constexpr int world = 2;
  const bool views = GENERATE(true, false);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    unused_as_zero setup(pg, views);
    auto& ddp = setup.ddp;
    auto g = ddp->gradients();
    for (auto& t : g) std::fill(t.begin(), t.end(), 99.0f);  // stale values an unused gradient must not leak
    ddp->finish();                                           // nothing used anywhere
    // Gradient 1: only rank 0 uses it. Gradient 2: nobody. Gradients 0 and 3: everybody.
    for (std::size_t t : {3u, 1u, 0u}) {
      if (t == 1 && rank != 0) continue;
      std::fill(g[t].begin(), g[t].end(), 4.0f * static_cast<float>(rank + 1));
      ddp->mark_ready(t);
    }
    const auto summary = ddp->finish();
    RANK_CHECK(summary.unused == std::vector<std::size_t>{2});
    for (auto x : g[0]) RANK_CHECK(x == 6.0f);
    for (auto x : g[1]) RANK_CHECK(x == 2.0f, x);  // (4 + 0) / 2
    for (auto x : g[2]) RANK_CHECK(x == 0.0f, x);
    for (auto x : g[3]) RANK_CHECK(x == 6.0f);
  });
}

TEST_CASE("unused gradients: a rank that marks every gradient and one that skips some stay in step",
          "[reducer][faults]") {
  constexpr int world = 2;
  const bool views = GENERATE(true, false);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    unused_as_zero setup(pg, views);
    auto& ddp = setup.ddp;
    auto g = ddp->gradients();
    // Step 1: rank 0 marks all four, rank 1 skips gradient 1. Step 2: the other way round,
    // rank 0 skips gradient 2. Step 3: both mark everything.
    for (int step = 0; step < 3; ++step) {
      const std::size_t skipped = step == 0 ? 1 : 2;
      const bool skips = (step == 0 && rank == 1) || (step == 1 && rank == 0);
      for (std::size_t t = 4; t-- > 0;) {
        std::fill(g[t].begin(), g[t].end(), 4.0f * static_cast<float>(rank + 1));
        if (skips && t == skipped) continue;
        ddp->mark_ready(t);
      }
      const auto summary = ddp->finish();
      RANK_CHECK(summary.unused.empty(), "step " << step << ": " << summary.unused.size() << " unused");
      for (std::size_t t = 0; t < 4; ++t) {
        const float want = step < 2 && t == skipped ? (skips ? 4.0f * (2 - rank) : 4.0f * (rank + 1)) / 2 : 6.0f;
        for (auto x : g[t]) RANK_CHECK(x == want, "step " << step << " gradient " << t << ": " << x << " != " << want);
      }
    }
  });
}

TEST_CASE("gradient sizes that differ only inside the alignment padding are refused on every rank",
          "[reducer][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    // {4, 2} and {4, 3} floats pad to the same 16-byte layout.
    const std::vector<std::size_t> sizes = rank == 1 ? std::vector<std::size_t>{4, 3} : std::vector<std::size_t>{4, 2};
    const auto text = RANK_CHECK_THROWS(cohort::error, reducer(pg, sizes), "bucket layouts differ across ranks");
    RANK_CHECK(text.find("gradient 1 is 2 x float on rank 0 but 3 x float on rank 1") != std::string::npos, text);
  });
}

TEST_CASE("gradient dtypes that differ across ranks are refused, naming the gradient", "[reducer][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3);
    std::vector<cohort::gradient_spec> specs{{8, dtype::float32}, {8, rank == 2 ? dtype::int32 : dtype::float32}};
    const auto text = RANK_CHECK_THROWS(cohort::error, reducer(pg, specs), "bucket layouts differ across ranks");
    RANK_CHECK(text.find("gradient 1 is 8 x float on rank 0 but 8 x int32 on rank 2") != std::string::npos, text);
  });
}

TEST_CASE("overlapping user buffers are refused on every rank, naming both gradients and the bytes",
          "[reducer][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    std::vector<float> flat(32, 0.0f);
    // Slices of one flat buffer; on rank 1 gradient 2 starts two floats too early.
    const std::size_t start2 = rank == 1 ? 14 : 16;
    std::vector<std::span<float>> buffers{std::span<float>(flat.data(), 8), std::span<float>(flat.data() + 8, 8),
                                          std::span<float>(flat.data() + start2, 8)};
    if (rank == 1) {
      const auto text = RANK_CHECK_THROWS(cohort::error, reducer(pg, buffers),
                                          "gradient 2 (8 x float) and gradient 1 (8 x float) overlap");
      RANK_CHECK(text.find("bytes 24..32 of gradient 1") != std::string::npos, text);
    } else {
      // Rank 0's own list is fine; it must not be left waiting for rank 1.
      RANK_CHECK_THROWS(cohort::error, reducer(pg, buffers), "rank 1 refused its gradients");
    }
  });
}

// ---- rebuilt buckets ----------------------------------------------------------------------------------

TEST_CASE("buckets rebuilt from the observed ready order give the same numbers", "[reducer]") {
  constexpr int world = 2;
  const auto storage = GENERATE(cohort::gradient_storage::bucket_views, cohort::gradient_storage::user_buffers);
  const cohort_examples::mlp model(small_widths);
  const auto sizes = model.parameter_sizes();
  const std::size_t n = sizes.size();
  // A backward that reports weights before biases, so the observed order differs from the
  // declaration order the default layout assumes. Rank 1 reports in yet another order:
  // rank 0's order must win everywhere.
  std::vector<std::size_t> rank0_order, rank1_order;
  for (std::size_t l = n / 2; l-- > 0;) rank0_order.insert(rank0_order.end(), {2 * l, 2 * l + 1});
  for (std::size_t t = 0; t < n; ++t) rank1_order.push_back(t);
  const auto data = cohort_examples::synthetic_data::make(8, model.input_width(), model.output_width(), 9);
  auto run = [&](bool rebuild) {
    auto store = std::make_shared<cohort::memory_store>();
    std::vector<tensors> results(world);
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      auto params = zeros(sizes);
      auto p = spans(params);
      model.initialize(p, 2);
      auto user = zeros(sizes);
      auto user_spans = spans(user);
      cohort::reducer_options options{
          .first_bucket_bytes = 2048, .bucket_bytes = 8192, .rebuild_after_first_iteration = rebuild};
      auto ddp = storage == cohort::gradient_storage::bucket_views ? std::make_unique<reducer>(pg, sizes, options)
                                                                   : std::make_unique<reducer>(pg, user_spans, options);
      const auto original = ddp->layout();
      std::span<const float> x(data.inputs.data() + 4 * rank * model.input_width(), 4 * model.input_width());
      std::span<const float> y(data.targets.data() + 4 * rank * model.output_width(), 4 * model.output_width());
      for (int step = 0; step < 3; ++step) {
        auto g = ddp->gradients();
        model.loss_and_gradients(p, g, x, y, 4);
        for (auto t : rank == 0 ? rank0_order : rank1_order) ddp->mark_ready(t);
        ddp->finish();
        if (step == 0 && rebuild) {
          RANK_CHECK(ddp->layout_generation() == 1);
          std::vector<dtype> types(n, dtype::float32);
          const auto expected = cohort::assign_buckets(sizes, types, {2048, 8192}, rank0_order);
          RANK_CHECK(ddp->layout() == expected);
          RANK_CHECK(ddp->layout() != original);
        }
        g = ddp->gradients();
        for (std::size_t t = 0; t < n; ++t)
          for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= 0.1f * g[t][i];
      }
      results[static_cast<std::size_t>(rank)] = params;
    });
    REQUIRE(results[1] == results[0]);
    return results[0];
  };
  const auto plain = run(false);
  const auto rebuilt = run(true);
  CHECK(max_abs_difference(plain, rebuilt) == 0.0f);  // two ranks: each sum is a single addition
}

// ---- compression, hooks, non-finite check ------------------------------------------------------------

TEST_CASE("compressed all-reduce in bfloat16 and half", "[reducer]") {
  constexpr int world = 2;
  const auto kind = GENERATE(cohort::compression::bfloat16, cohort::compression::half);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    reducer ddp(pg, std::vector<std::size_t>{100, 1000}, {.first_bucket_bytes = 256, .compress = kind});
    for (std::size_t t = 2; t-- > 0;) {
      auto g = ddp.gradient(t);
      // Exactly representable in both 16-bit formats (small integers and halves).
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>((i % 13) * (rank + 1)) * 0.5f;
      ddp.mark_ready(t);
    }
    ddp.finish();
    for (std::size_t t = 0; t < 2; ++t) {
      auto g = ddp.gradient(t);
      for (std::size_t i = 0; i < g.size(); ++i) RANK_CHECK(g[i] == static_cast<float>(i % 13) * 0.75f, g[i]);
    }
    // A value 16-bit formats cannot hold exactly comes back rounded, not exact.
    for (std::size_t t = 2; t-- > 0;) {
      std::fill(ddp.gradient(t).begin(), ddp.gradient(t).end(), 1.0f + 1.0f / 4096.0f);
      ddp.mark_ready(t);
    }
    ddp.finish();
    RANK_CHECK(ddp.gradient(0)[0] != 1.0f + 1.0f / 4096.0f);
    RANK_CHECK(std::abs(ddp.gradient(0)[0] - 1.0f) < 1e-2f);
  });
}

TEST_CASE("a user communication hook reduces every bucket, in bucket order", "[reducer]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    reducer ddp(pg, std::vector<std::size_t>{50, 60, 70}, {.first_bucket_bytes = 64, .bucket_bytes = 64});
    std::vector<std::size_t> seen;
    // Sum instead of average: the hook owns the arithmetic.
    ddp.register_comm_hook([&](group& g, const cohort::bucket_ref& bucket) {
      seen.push_back(bucket.index);
      RANK_CHECK(bucket.type == dtype::float32);
      return g.all_reduce(std::span<float>(static_cast<float*>(bucket.data), bucket.count), cohort::op::sum);
    });
    for (std::size_t t = 3; t-- > 0;) {
      std::fill(ddp.gradient(t).begin(), ddp.gradient(t).end(), static_cast<float>(rank + 1));
      ddp.mark_ready(t);
    }
    ddp.finish();
    RANK_CHECK(seen == std::vector<std::size_t>({0, 1, 2}));
    for (std::size_t t = 0; t < 3; ++t)
      for (auto x : ddp.gradient(t)) RANK_CHECK(x == 3.0f);
  });
}

TEST_CASE("a non-finite gradient on one rank makes every rank skip the step", "[reducer]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    reducer ddp(pg, std::vector<std::size_t>{16, 16}, {.check_nonfinite = true});
    for (int iteration = 0; iteration < 2; ++iteration) {
      for (std::size_t t = 2; t-- > 0;) {
        std::fill(ddp.gradient(t).begin(), ddp.gradient(t).end(), 1.0f);
        if (iteration == 1 && rank == 2 && t == 1) ddp.gradient(t)[5] = std::numeric_limits<float>::infinity();
        ddp.mark_ready(t);
      }
      const auto summary = ddp.finish();
      RANK_CHECK((summary.nonfinite > 0) == (iteration == 1), "iteration " << iteration);
    }
  });
}

TEST_CASE("broadcast_parameters makes replicas equal", "[reducer]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    tensors params{std::vector<float>(5, static_cast<float>(rank)),
                   std::vector<float>(7, 10.0f + static_cast<float>(rank))};
    cohort::broadcast_parameters(pg, spans(params), 1).wait();
    for (auto x : params[0]) RANK_CHECK(x == 1.0f);
    for (auto x : params[1]) RANK_CHECK(x == 11.0f);
  });
}

TEST_CASE("broadcast_parameters takes a vector of vectors and other lists of ranges", "[reducer]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    const auto mine = static_cast<float>(rank);
    tensors params{std::vector<float>(5, mine), std::vector<float>(7, 10.0f + mine), {}};
    cohort::broadcast_parameters(pg, params, 2).wait();  // std::vector<std::vector<float>>&
    for (auto x : params[0]) RANK_CHECK(x == 2.0f, "rank " << rank << " got " << x);
    for (auto x : params[1]) RANK_CHECK(x == 12.0f, "rank " << rank << " got " << x);
    std::array<std::array<double, 3>, 2> fixed{};
    for (auto& tensor : fixed) tensor.fill(100.0 + rank);
    cohort::broadcast_parameters(pg, fixed).wait();  // root 0
    for (const auto& tensor : fixed)
      for (auto x : tensor) RANK_CHECK(x == 100.0, "rank " << rank << " got " << x);
  });
}

namespace {
template <class List>
concept broadcastable_list = requires(group& pg, List&& list) {
  cohort::broadcast_parameters(pg, std::forward<List>(list));
};
}  // namespace

// The parameters must outlive the asynchronous broadcasts and be writable.
static_assert(broadcastable_list<tensors&>);
static_assert(!broadcastable_list<tensors>);
static_assert(!broadcastable_list<const tensors&>);
static_assert(broadcastable_list<std::vector<std::span<float>>>);  // spans: views of memory kept elsewhere
static_assert(!broadcastable_list<std::vector<std::span<const float>>&>);

TEST_CASE("gradient_reducer{pg, {512, 32}} means bucket views of those sizes", "[reducer]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    cohort::gradient_reducer ddp{pg, {512, 32}};  // was ambiguous: sizes or gradient specs
    RANK_CHECK(ddp.gradient_count() == 2);
    RANK_CHECK(ddp.gradient(0).size() == 512 && ddp.gradient(1).size() == 32);
    RANK_CHECK(ddp.storage() == cohort::gradient_storage::bucket_views);
    reducer with_options(pg, {3, 4, 5}, {.first_bucket_bytes = 16, .bucket_bytes = 16});
    RANK_CHECK(with_options.gradient_count() == 3 && with_options.bucket_count() == 3);
  });
}
