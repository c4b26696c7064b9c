// Host-side costs of cohort's building blocks (Google Benchmark):
//   sampler   indices per second, sequential and shuffled (Feistel permutation)
//   store     operations per second: memory_store (thread ranks) and tcp_store over loopback
//   ddp       training_state::mark_ready under ddp, alone (inside no_sync) and with bucket launches
//   checksum  a checkpoint's block checksum, bytes per second, against the FNV-1a it replaced
//   sha256    the parameter fingerprint's chunk digests, bytes per second on one core
//   timeline  a step of 12 spans and its end, the timeline stopped (one flag test) and recording
//
//   ./micro_host --benchmark_min_time=0.2

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/data/sampler.hpp"
#include "cohort/detail/sha256.hpp"
#include "cohort/diagnostics/timeline.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/parallel/training_state.hpp"
#define COHORT_MICRO_DDP 1
#endif

namespace {

// --- sampler ----------------------------------------------------------------------------------
void sampler_indices(benchmark::State& state) {
  const bool shuffle = state.range(0) != 0;
  cohort::distributed_sampler sampler(std::uint64_t{1} << 24, /*world=*/8, /*rank=*/3,
                                      {.shuffle = shuffle, .seed = 7, .drop_last = false});
  std::uint64_t epoch = 0, checksum = 0;
  for (auto _ : state) {
    sampler.set_epoch(epoch++);
    for (std::uint64_t j = 0; j < 4096; ++j) checksum += sampler[j];
  }
  benchmark::DoNotOptimize(checksum);
  state.SetItemsProcessed(state.iterations() * 4096);
  state.SetLabel(shuffle ? "shuffled" : "sequential");
}
BENCHMARK(sampler_indices)->Arg(0)->Arg(1);

// The whole per-epoch list, as a data loader would fetch it.
void sampler_epoch_list(benchmark::State& state) {
  cohort::distributed_sampler sampler(static_cast<std::uint64_t>(state.range(0)), 8, 3, {.shuffle = true, .seed = 7});
  std::uint64_t epoch = 0;
  for (auto _ : state) {
    sampler.set_epoch(epoch++);
    auto list = sampler.indices();
    benchmark::DoNotOptimize(list.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(sampler.size()));
}
BENCHMARK(sampler_epoch_list)->Arg(1 << 20)->Unit(benchmark::kMicrosecond);

// --- store ------------------------------------------------------------------------------------
template <class Store>
void store_set_get(benchmark::State& state, Store& store) {
  const std::string value(static_cast<std::size_t>(state.range(0)), 'x');
  std::size_t i = 0;
  for (auto _ : state) {
    const std::string key = "k" + std::to_string(i++ % 64);
    store.set(key, value);
    auto back = store.get(key);
    benchmark::DoNotOptimize(back.data());
  }
  state.SetItemsProcessed(state.iterations() * 2);  // two operations per iteration
}

template <class Store>
void store_add(benchmark::State& state, Store& store) {
  std::int64_t last = 0;
  for (auto _ : state) last = store.add("counter", 1);
  benchmark::DoNotOptimize(last);
  state.SetItemsProcessed(state.iterations());
}

void memory_store_set_get(benchmark::State& state) {
  cohort::memory_store store;
  store_set_get(state, store);
}
BENCHMARK(memory_store_set_get)->Arg(16)->Arg(4096);

void memory_store_add(benchmark::State& state) {
  cohort::memory_store store;
  store_add(state, store);
}
BENCHMARK(memory_store_add);

// A server and one client over loopback: every operation is one request/response round trip.
std::shared_ptr<cohort::tcp_store> loopback_tcp_store() {
  cohort::tcp_store_options options;
  options.host = "127.0.0.1";
  options.port = 0;  // any free port
  options.is_server = true;
  return std::make_shared<cohort::tcp_store>(options);
}

void tcp_store_set_get(benchmark::State& state) {
  auto store = loopback_tcp_store();
  store_set_get(state, *store);
}
BENCHMARK(tcp_store_set_get)->Arg(16)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();

void tcp_store_add(benchmark::State& state) {
  auto store = loopback_tcp_store();
  store_add(state, *store);
}
BENCHMARK(tcp_store_add)->Unit(benchmark::kMicrosecond)->UseRealTime();

#if defined(COHORT_MICRO_DDP)
// One rank (no peer to wait for): what mark_ready itself costs on the training thread.
// range(0): regions, each of 1024 floats (4 KiB) in a layer of its own, so the 64 KiB buckets
// hold 16 of them.
struct one_rank_ddp {
  std::shared_ptr<cohort::memory_store> store = std::make_shared<cohort::memory_store>();
  cohort::process_group<cohort::gloo> pg{store, cohort::launch_env::explicit_ranks(0, 1)};
  cohort::training_state<cohort::gloo> ddp;
  static std::vector<cohort::region> regions(std::size_t count) {
    std::vector<cohort::region> list;
    for (std::size_t r = 0; r < count; ++r) list.push_back({"r" + std::to_string(r), r * 1024, 1024, r});
    return list;
  }
  explicit one_rank_ddp(std::size_t count)
      : ddp(pg, regions(count), {.bucket_bytes = 64 << 10, .sgd = cohort::sgd_options{.lr = 0}}) {}
};

// Inside no_sync: bookkeeping only, no bucket launches (gradient accumulation micro-steps).
void ddp_mark_ready_no_sync(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  one_rank_ddp r(n);
  for (auto _ : state) {
    auto scope = r.ddp.no_sync();
    for (std::size_t i = n; i-- > 0;) r.ddp.mark_ready(i);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetLabel("items = mark_ready calls");
}
BENCHMARK(ddp_mark_ready_no_sync)->Arg(256)->Unit(benchmark::kMicrosecond);

// A synchronised step: mark_ready launches each bucket as it fills; step() waits, then makes
// one SGD pass (lr 0) over the gradients.
void ddp_mark_ready_step(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  one_rank_ddp r(n);
  for (auto _ : state) {
    for (std::size_t i = n; i-- > 0;) r.ddp.mark_ready(i);
    r.ddp.step();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetLabel("items = mark_ready calls, 16 per bucket, incl. step");
}
BENCHMARK(ddp_mark_ready_step)->Arg(256)->Unit(benchmark::kMicrosecond)->UseRealTime();
#endif

// --- checkpoint block checksum -----------------------------------------------------------------
// FNV-1a over 64-bit words, the index's version 1 block checksum: the baseline. A serial chain,
// one multiply's latency per 8 bytes.
std::uint64_t fnv1a_words(const unsigned char* data, std::size_t bytes) {
  std::uint64_t hash = 14695981039346656037ull;
  constexpr std::uint64_t prime = 1099511628211ull;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, data + i, 8);
    hash = (hash ^ word) * prime;
  }
  if (i < bytes) {
    std::uint64_t word = 0;
    std::memcpy(&word, data + i, bytes - i);
    hash = (hash ^ word) * prime;
  }
  return (hash ^ bytes) * prime;
}

// range(0): 0 FNV-1a (version 1), 1 the linear checksum (version 2); 1 MiB blocks (the default
// block_bytes) of a 64 MiB buffer, as a save checksums its file.
void checkpoint_checksum(benchmark::State& state) {
  constexpr std::size_t block = std::size_t{1} << 20;
  std::vector<unsigned char> data(std::size_t{64} << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  const bool linear = state.range(0) != 0;
  std::uint64_t sum = 0;
  for (auto _ : state)
    for (std::size_t at = 0; at < data.size(); at += block)
      sum +=
          linear ? cohort::detail::checkpoint_checksum(data.data() + at, block) : fnv1a_words(data.data() + at, block);
  benchmark::DoNotOptimize(sum);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(data.size()));
  state.SetLabel(linear ? "linear (version 2)" : "FNV-1a over 64-bit words (version 1)");
}
BENCHMARK(checkpoint_checksum)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// SHA-256 of 1 MiB chunks of a 64 MiB buffer, as parameter_sha256 hashes a rank's share of the
// parameters (cohort/parallel/fingerprint.hpp): what its time is, 1/N of the model at N ranks.
void fingerprint_sha256(benchmark::State& state) {
  constexpr std::size_t chunk = std::size_t{1} << 20;
  std::vector<std::uint8_t> data(std::size_t{64} << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 131 + 7);
  std::uint8_t sum = 0;
  for (auto _ : state)
    for (std::size_t at = 0; at < data.size(); at += chunk)
      sum ^= cohort::detail::sha256::of({data.data() + at, chunk})[0];
  benchmark::DoNotOptimize(sum);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(data.size()));
}
BENCHMARK(fingerprint_sha256)->Unit(benchmark::kMillisecond);

// --- gradient norms ---------------------------------------------------------------------------
// A step's norm pass over 12.8 M floats (a ResNet-50's gradient, half of it, as one rank of
// two measures it), one thread: Arg 0 the default's sum of squares in double, Arg 1 the
// reproducible mode's exact squares binned by exponent (items = elements: ns per element is
// 1e9 / items_per_second).
void gradient_norm_pass(benchmark::State& state) {
  std::vector<float> gradient(12'800'000);
  for (std::size_t i = 0; i < gradient.size(); ++i)
    gradient[i] = std::sin(0.37f * static_cast<float>(i)) * 1e-3f * static_cast<float>(1 + i % 7);
  const bool exact = state.range(0) != 0;
  std::vector<std::int64_t> bins(cohort::detail::exact_squares_words(cohort::dtype::float32));
  double sum = 0;
  for (auto _ : state) {
    if (exact)
      cohort::detail::host::add_exact_squares(gradient.data(), gradient.size(), cohort::dtype::float32, bins.data());
    else
      sum += cohort::detail::host::sum_of_squares(gradient.data(), gradient.size(), cohort::dtype::float32);
  }
  benchmark::DoNotOptimize(sum);
  benchmark::DoNotOptimize(bins.data());
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(gradient.size()));
  state.SetLabel(exact ? "add_exact_squares (reproducible)" : "sum_of_squares (default)");
}
BENCHMARK(gradient_norm_pass)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// --- timeline ---------------------------------------------------------------------------------
// What a zero3 step of examples/train records, about 12 spans and the step's end: Arg 0 with
// no directory (the timeline off: the one flag test), Arg 1 recording into its ring (its file
// written to $TMPDIR, or /tmp, when the recorder ends, outside the timed loop).
void timeline_step(benchmark::State& state) {
  cohort::timeline_options options;
  if (state.range(0) != 0) {
    const char* temporary = std::getenv("TMPDIR");
    options.directory = std::string(temporary != nullptr ? temporary : "/tmp") + "/cohort-micro-timeline";
  }
  cohort::timeline recorder(0, options);
  for (auto _ : state) {
    for (int span = 0; span < 12; ++span) {
      auto scope = recorder.span("forward");
      benchmark::DoNotOptimize(scope);
    }
    recorder.end_step();
  }
}
BENCHMARK(timeline_step)->Arg(0)->Arg(1)->Unit(benchmark::kNanosecond);

}  // namespace

BENCHMARK_MAIN();
