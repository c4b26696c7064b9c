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
//
//   ./micro_collectives --benchmark_min_time=0.5 --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true

#include <benchmark/benchmark.h>

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

BENCHMARK_MAIN();
