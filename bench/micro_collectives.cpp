// Process-group call overhead against the raw engine (Google Benchmark).
//
// Every benchmark runs as 1 rank and as 2 ranks (->Threads(2): each benchmark thread is one
// rank over loopback TCP, with its own Gloo context and worker thread). One rank isolates
// what cohort adds to a call, since Gloo then moves nothing: cohort's call is queued to the
// group's worker thread and waited for; the raw call is gloo::allreduce on the same context,
// on the calling thread.
//
//   gloo_cohort_all_reduce/bytes   pg.all_reduce(span).wait()
//   gloo_raw_all_reduce/bytes      gloo::allreduce(AllreduceOptions) on pg.backend().context()
//   gloo_cohort_round_trip         pg.backend().record().wait(): an empty task to the worker
//                                  and back, the hand-off alone
//   gloo_cohort_all_reduce_unrecorded/bytes
//                                  as gloo_cohort_all_reduce with the flight recorder off: the
//                                  difference is what recording every call costs
//   gloo_bucket_ranges/shape/fused  one bucket of a stacked (llm.c) layout, its ranges apart in
//                                  the flat buffer: one all-reduce per range back to back
//                                  (fused 0: what training_state does), or the ranges copied
//                                  into one staging buffer, one all-reduce, copied back
//                                  (fused 1). shape 0: a GPT-2 small block's 12 slices (7.1 M
//                                  floats); shape 1: 24 slices of 768 (LayerNorm weights and
//                                  biases: the small ranges where a fused call could pay)
//
//   ./micro_collectives --benchmark_min_time=0.5 --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true

#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <gloo/allreduce.h>

#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/host_math.hpp"
#include "cohort/rendezvous/store.hpp"

namespace {

// One store per world size for the whole program. The n-th group each rank creates on a
// store gets the key prefix n, so every run of a benchmark function (Google Benchmark calls
// it several times to size the iteration count) rendezvouses afresh, as long as all ranks
// of that store create their groups in lockstep: true per world size, not across them.
std::shared_ptr<cohort::store> shared_store(int world) {
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<cohort::store>> stores;
  std::lock_guard lock(mutex);
  auto& store = stores[world];
  if (!store) store = std::make_shared<cohort::memory_store>();
  return store;
}

cohort::process_group<cohort::gloo> make_group(const benchmark::State& state, std::size_t recorder_entries = 2048) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(30);
  options.flight_recorder_entries = recorder_entries;
  return cohort::process_group<cohort::gloo>(shared_store(state.threads()),
                                             cohort::launch_env::explicit_ranks(state.thread_index(), state.threads()),
                                             options);
}

void gloo_cohort_all_reduce(benchmark::State& state) {
  auto pg = make_group(state);
  std::vector<float> data(static_cast<std::size_t>(state.range(0)) / sizeof(float), 1.0f);
  for (auto _ : state) pg.all_reduce(std::span<float>(data)).wait();
  state.SetBytesProcessed(state.iterations() * state.range(0));
  pg.barrier().wait();  // no rank tears down its context while a peer is still in a call
}

void gloo_cohort_all_reduce_unrecorded(benchmark::State& state) {
  auto pg = make_group(state, 0);
  std::vector<float> data(static_cast<std::size_t>(state.range(0)) / sizeof(float), 1.0f);
  for (auto _ : state) pg.all_reduce(std::span<float>(data)).wait();
  state.SetBytesProcessed(state.iterations() * state.range(0));
  pg.barrier().wait();
}

void gloo_raw_all_reduce(benchmark::State& state) {
  auto pg = make_group(state);
  std::vector<float> data(static_cast<std::size_t>(state.range(0)) / sizeof(float), 1.0f);
  const auto& context = pg.backend().context();
  for (auto _ : state) {
    ::gloo::AllreduceOptions options(context);
    options.setTag(0x7ffe0000u);
    options.setOutput(data.data(), data.size());
    options.setReduceFunction(cohort::detail::reduce_function<float>(cohort::op::sum));
    options.setTimeout(std::chrono::seconds(30));
    ::gloo::allreduce(options);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  pg.barrier().wait();
}

void gloo_bucket_ranges(benchmark::State& state) {
  auto pg = make_group(state);
  std::vector<std::size_t> sizes;
  if (state.range(0) == 0)  // GPT-2 small, C = 768: ln1 w/b, qkv w/b, attproj w/b, ln2 w/b, fc w/b, fcproj w/b
    sizes = {768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768};
  else
    sizes.assign(24, 768);
  // Each range sits apart from the next in the flat buffer, as one block's slice of each
  // stacked tensor does: a gap of the range's own size between them.
  std::size_t total = 0;
  for (const auto size : sizes) total += size;
  std::vector<float> flat(2 * total, 1.0f), staging(total);
  const bool fused = state.range(1) != 0;
  for (auto _ : state) {
    if (fused) {
      std::size_t at = 0, offset = 0;
      for (const auto size : sizes) {
        std::memcpy(staging.data() + at, flat.data() + offset, size * sizeof(float));
        at += size;
        offset += 2 * size;
      }
      pg.all_reduce(std::span<float>(staging), cohort::op::avg).wait();
      at = offset = 0;
      for (const auto size : sizes) {
        std::memcpy(flat.data() + offset, staging.data() + at, size * sizeof(float));
        at += size;
        offset += 2 * size;
      }
    } else {
      cohort::gloo::work last;
      std::size_t offset = 0;
      for (const auto size : sizes) {
        last = pg.all_reduce(std::span<float>(flat.data() + offset, size), cohort::op::avg);
        offset += 2 * size;
      }
      last.wait();
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(total * sizeof(float)));
  pg.barrier().wait();
}

void gloo_cohort_round_trip(benchmark::State& state) {
  auto pg = make_group(state);
  for (auto _ : state) pg.backend().record().wait();
  pg.barrier().wait();
}

}  // namespace

BENCHMARK(gloo_cohort_all_reduce)->RangeMultiplier(64)->Range(64, 4 << 20)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(gloo_cohort_all_reduce_unrecorded)->Arg(64)->Threads(1)->UseRealTime();
BENCHMARK(gloo_raw_all_reduce)->RangeMultiplier(64)->Range(64, 4 << 20)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(gloo_cohort_round_trip)->Threads(1)->UseRealTime();
BENCHMARK(gloo_bucket_ranges)->ArgsProduct({{0, 1}, {0, 1}})->Threads(2)->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
