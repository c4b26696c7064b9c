#pragma once
// The measuring core of cohort-bench, shared with tests/test_bench_model.cpp.
//
// Conventions are those of nccl-tests, so figures compare one to one:
//   size   the larger of the send and receive buffers in bytes (the full buffer);
//   count  the element count passed to the collective (per rank for all_gather, reduce_scatter
//          and alltoall, where the per-rank share is rounded down to a 16-byte multiple);
//   time   mean time of one call in microseconds, averaged over ranks;
//   algbw  size / time (GB/s, 1e9 bytes per second);
//   busbw  algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and
//          alltoall, x 1 for broadcast: what each rank's link carried, comparable across
//          collectives and rank counts, and what the planner's beta = 1 / busbw expects.
//
// Next to cohort's process_group call the same collective is timed straight on the engine
// (gloo::allreduce on the group's own Gloo context; ncclAllReduce on its communicator and
// stream), in alternating blocks for the raw time and busbw columns. The wrapper's overhead
// figure, cohort / raw busbw (= raw time / cohort time), comes from a phase of its own:
// single calls interleaved one by one (cohort, raw, raw, cohort, ...), each timed alone, and
// the ratio of their lower quartiles (the medians' ratio is reported too). Neighbouring calls
// share the machine's state. On a shared box call times are bimodal: the call's own cost, or
// that plus a scheduler tick (4 ms at HZ=250) when the box delayed a wake-up, which hits a
// quarter to half of all small calls here; the lower quartile measures the call itself
// whatever that share is, while a constant per-call wrapper cost still shifts it in full.
// Block means and even medians differ between runs by more than the wrapper costs.
//
// On Gloo every timed iteration is issue + wait (how a blocking raw gloo call behaves), so
// the ratio includes the whole hand-off to cohort's worker thread and back. On NCCL calls are
// issued back to back and the last one waited for, as nccl-tests does.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/host_math.hpp"
#include "cohort/error.hpp"
#include "cohort/tools/detail/json.hpp"
#include "cohort/tools/planner.hpp"
#include "cohort/types.hpp"
#include "cohort/version.hpp"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>

#if defined(COHORT_HAS_NCCL)
#include "cohort/comm/nccl.hpp"
#endif

namespace cohort_bench {

using cohort::dtype;
using cohort::op;

// The planner's names for the collectives: one vocabulary for the library, the bench and
// the planner.
using operation = cohort::collective;
using cohort::bus_factor;
using cohort::to_string;

inline std::optional<operation> parse_operation(std::string_view name) { return cohort::find_collective(name); }

inline bool has_reduction(operation value) {
  return value == operation::all_reduce || value == operation::reduce_scatter;
}
inline bool has_root(operation value) { return value == operation::broadcast; }
// cohort has no in-place alltoall (a chunk would be overwritten before it is sent).
inline bool has_in_place(operation value) { return value != operation::all_to_all; }

// Buffer shapes for a requested size, as nccl-tests derives them.
struct layout {
  std::size_t count = 0;       // elements passed to the call (nccl-tests' "count" column)
  std::size_t send_count = 0;  // elements in the send buffer
  std::size_t recv_count = 0;  // elements in the receive buffer
  std::size_t element = 4;
  std::size_t bytes() const { return std::max(send_count, recv_count) * element; }  // "size"
};

inline layout layout_for(operation value, std::size_t requested_bytes, std::size_t element, int world) {
  layout shape;
  shape.element = element;
  const std::size_t total = requested_bytes / element;
  const auto n = static_cast<std::size_t>(world);
  // Per-rank shares are rounded down to whole 16-byte vectors (what NCCL's kernels like).
  const std::size_t align = std::max<std::size_t>(1, 16 / element);
  const std::size_t share = (total / n) / align * align;
  switch (value) {
    case operation::all_reduce:
    case operation::broadcast: shape.count = shape.send_count = shape.recv_count = total; break;
    case operation::all_gather: shape.count = share, shape.send_count = share, shape.recv_count = share * n; break;
    case operation::reduce_scatter: shape.count = share, shape.send_count = share * n, shape.recv_count = share; break;
    case operation::all_to_all: shape.count = share, shape.send_count = shape.recv_count = share * n; break;
  }
  return shape;
}

struct options {
  operation what = operation::all_reduce;
  std::string backend = "gloo";
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t(128) << 20;
  std::size_t factor = 2;
  int iterations = 20;  // per timed block
  int warmup = 5;       // per size, before timing
  int repetitions = 3;  // alternating cohort / raw blocks; the median block counts
  // Interleaved single calls per side behind cohort / raw. 0: as many as fit in about two
  // seconds per size (from the warm-up's pace), at least iterations x repetitions, at most 1000.
  int ratio_pairs = 0;
  dtype type = dtype::float32;
  op reduce = op::sum;
  int root = 0;
  bool check = true;
  bool compare_raw = true;
  // Which block counts: the median (default), or the fastest, which on a shared machine
  // drops the blocks a preemption slowed down and keeps the intrinsic cost.
  bool fastest_block = false;
};

inline std::vector<std::size_t> sizes(const options& o) {
  std::vector<std::size_t> list;
  for (std::size_t size = std::max<std::size_t>(o.min_bytes, 1); size <= o.max_bytes;
       size = o.factor > 1 ? size * o.factor : size + std::max<std::size_t>(o.min_bytes, 1))
    list.push_back(size);
  return list;
}

struct row {
  std::size_t bytes = 0;
  std::size_t count = 0;
  double time_us = 0;
  double algbw_GBps = 0;
  double busbw_GBps = 0;
  double wrong = -1;  // -1: not checked
  std::optional<double> inplace_time_us, inplace_algbw_GBps, inplace_busbw_GBps, inplace_wrong;
  std::optional<double> raw_time_us, raw_busbw_GBps;
  std::optional<double> cohort_over_raw;         // lower quartiles of interleaved single calls
  std::optional<double> cohort_over_raw_median;  // their medians
};

// --- values for the correctness check --------------------------------------------------
// Small integers, so sums, products and extremes are exact in every dtype (bf16 holds
// integers to 256); products draw from {1, 2} so 2^world stays representable.
inline double input_value(op reduce, int rank, std::size_t index) {
  if (reduce == op::product) return 1 + double((static_cast<std::size_t>(rank) + index) % 2);
  return double((static_cast<std::size_t>(rank) * 5 + index * 3) % 11);
}

inline double combine(op reduce, double a, double b) {
  switch (reduce) {
    case op::sum:
    case op::avg: return a + b;
    case op::product: return a * b;
    case op::min: return std::min(a, b);
    case op::max: return std::max(a, b);
  }
  return a;
}

template <class T>
double to_double(T value) {
  if constexpr (std::is_same_v<T, cohort::half> || std::is_same_v<T, cohort::bfloat16>)
    return static_cast<float>(value);
  else
    return static_cast<double>(value);
}
template <class T>
T from_double(double value) {
  if constexpr (std::is_same_v<T, cohort::half> || std::is_same_v<T, cohort::bfloat16>)
    return T(static_cast<float>(value));
  else if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<std::int64_t>(value));  // wraps as the engine's integers do
  else
    return static_cast<T>(value);
}

// The reduction of input_value over every rank at one index, in T as the engine computes it.
template <class T>
T reduced_value(op reduce, int world, std::size_t index) {
  double total = input_value(reduce, 0, index);
  for (int r = 1; r < world; ++r) total = combine(reduce, total, input_value(reduce, r, index));
  if (reduce == op::avg) {
    if constexpr (std::is_integral_v<T>)
      return static_cast<T>(static_cast<std::int64_t>(total) / world);
    else
      return from_double<T>(total / world);
  }
  return from_double<T>(total);
}

template <class T>
bool same_value(T got, T expected, op reduce) {
  const double a = to_double(got), b = to_double(expected);
  if (a == b) return true;
  if (reduce != op::avg) return false;  // everything but averages is exact
  const double tolerance = std::is_integral_v<T> ? 0.0 : (sizeof(T) == 2 ? 1e-2 : sizeof(T) == 4 ? 1e-6 : 1e-12);
  return std::fabs(a - b) <= tolerance * std::max(1.0, std::fabs(b));
}

// Fills this rank's send buffer (and the receive buffer, for in-place calls) on the host.
template <class T>
void fill_inputs(operation what, op reduce, int rank, const layout& shape, std::vector<T>& send, std::vector<T>& recv,
                 bool in_place, int root) {
  send.assign(shape.send_count, T{});
  recv.assign(shape.recv_count, from_double<T>(0));
  for (std::size_t i = 0; i < shape.send_count; ++i) send[i] = from_double<T>(input_value(reduce, rank, i));
  if (what == operation::broadcast) {  // the root's data lives in the buffer that is broadcast
    if (rank == root)
      recv = send;
    else
      for (auto& v : recv) v = from_double<T>(99);
  }
  if (!in_place) return;
  if (what == operation::all_reduce) recv = send;
  if (what == operation::all_gather)
    std::copy(send.begin(), send.end(), recv.begin() + static_cast<std::ptrdiff_t>(rank * shape.count));
}

// Elements of this rank's result that differ from the independently computed expectation.
// `result` is the receive buffer, or for an in-place reduce_scatter the send buffer.
template <class T>
std::size_t count_wrong(operation what, op reduce, int rank, int world, int root, const layout& shape,
                        const std::vector<T>& result, bool in_place) {
  std::size_t wrong = 0;
  const std::size_t n = shape.count;
  switch (what) {
    case operation::all_reduce:
      for (std::size_t i = 0; i < n; ++i) wrong += !same_value(result[i], reduced_value<T>(reduce, world, i), reduce);
      break;
    case operation::all_gather:
      for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < n; ++i)
          wrong += !(to_double(result[std::size_t(r) * n + i]) == to_double(from_double<T>(input_value(reduce, r, i))));
      break;
    case operation::reduce_scatter: {
      const std::size_t offset = in_place ? std::size_t(rank) * n : 0;
      for (std::size_t i = 0; i < n; ++i)
        wrong += !same_value(result[offset + i], reduced_value<T>(reduce, world, std::size_t(rank) * n + i), reduce);
      break;
    }
    case operation::broadcast:
      for (std::size_t i = 0; i < n; ++i)
        wrong += !(to_double(result[i]) == to_double(from_double<T>(input_value(reduce, root, i))));
      break;
    case operation::all_to_all:
      for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < n; ++i)
          wrong += !(to_double(result[std::size_t(r) * n + i]) ==
                     to_double(from_double<T>(input_value(reduce, r, std::size_t(rank) * n + i))));
      break;
  }
  return wrong;
}

// Linear interpolation between order statistics; q in [0, 1].
inline double quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const auto below = static_cast<std::size_t>(position);
  const std::size_t above = std::min(below + 1, values.size() - 1);
  return values[below] + (position - static_cast<double>(below)) * (values[above] - values[below]);
}

inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// --- engines -------------------------------------------------------------------------------
// What differs between backends: where buffers live, how a timed block waits, and the raw
// engine call that cohort's call is compared with.
template <class B>
struct engine;

// A tag of its own for the raw calls, away from the signature-derived tags cohort uses.
inline constexpr std::uint32_t raw_gloo_tag = 0x7fff0000u;

template <>
struct engine<cohort::gloo> {
  using group = cohort::process_group<cohort::gloo>;
  static constexpr const char* raw_name = "gloo";

  template <class T>
  static T* allocate(group& pg, std::size_t count) {
    return static_cast<T*>(pg.backend().allocate(std::max<std::size_t>(count, 1) * sizeof(T)));
  }
  template <class T>
  static void release(group& pg, T* pointer, std::size_t count) {
    pg.backend().deallocate(pointer, std::max<std::size_t>(count, 1) * sizeof(T));
  }
  template <class T>
  static void upload(group&, T* destination, const std::vector<T>& source) {
    std::memcpy(destination, source.data(), source.size() * sizeof(T));
  }
  template <class T>
  static void download(group&, std::vector<T>& destination, const T* source, std::size_t count) {
    destination.assign(source, source + count);
  }

  // Issue + wait, every iteration.
  template <class Call>
  static double time_cohort(group&, int iterations, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) call().wait();
    return seconds_since(start);
  }
  template <class Call>
  static double time_raw(group&, int iterations, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) call();
    return seconds_since(start);
  }

  // The collective written directly against Gloo on the group's own context, doing what
  // cohort's call does (cohort supplies averaging and the reduce function for every dtype).
  template <class T>
  static void raw(group& pg, operation what, op reduce, const T* in, T* out, const layout& shape, int root) {
    const auto& context = pg.backend().context();
    const auto timeout = pg.backend().settings().timeout;
    const std::size_t n = shape.count, world = static_cast<std::size_t>(pg.size());
    switch (what) {
      case operation::all_reduce: {
        ::gloo::AllreduceOptions o(context);
        o.setTag(raw_gloo_tag);
        o.setInput(const_cast<T*>(in), n);
        o.setOutput(out, n);
        o.setReduceFunction(cohort::detail::reduce_function<T>(reduce));
        o.setTimeout(timeout);
        ::gloo::allreduce(o);
        if (reduce == op::avg) cohort::detail::divide(out, n, pg.size());
        return;
      }
      case operation::all_gather: {
        ::gloo::AllgatherOptions o(context);
        o.setTag(raw_gloo_tag + 1);
        o.setInput(const_cast<T*>(in), n);
        o.setOutput(out, n * world);
        o.setTimeout(timeout);
        ::gloo::allgather(o);
        return;
      }
      case operation::reduce_scatter: {
        // Gloo has no options-style reduce-scatter: all-to-all, then a local reduction, as
        // cohort's backend does it.
        static thread_local std::vector<T> gathered;
        gathered.resize(n * world);
        ::gloo::AlltoallOptions o(context);
        o.setTag(raw_gloo_tag + 2);
        o.setInput(const_cast<T*>(in), n * world);
        o.setOutput(gathered.data(), n * world);
        o.setTimeout(timeout);
        ::gloo::alltoall(o);
        std::memcpy(out, gathered.data(), n * sizeof(T));
        const auto combine_into = cohort::detail::reduce_function<T>(reduce);
        for (std::size_t r = 1; r < world; ++r) combine_into(out, out, gathered.data() + r * n, n);
        if (reduce == op::avg) cohort::detail::divide(out, n, pg.size());
        return;
      }
      case operation::broadcast: {
        ::gloo::BroadcastOptions o(context);
        o.setTag(raw_gloo_tag + 3);
        o.setOutput(out, n);
        o.setRoot(root);
        o.setTimeout(timeout);
        ::gloo::broadcast(o);
        return;
      }
      case operation::all_to_all: {
        ::gloo::AlltoallOptions o(context);
        o.setTag(raw_gloo_tag + 4);
        o.setInput(const_cast<T*>(in), n * world);
        o.setOutput(out, n * world);
        o.setTimeout(timeout);
        ::gloo::alltoall(o);
        return;
      }
    }
  }
};

#if defined(COHORT_HAS_NCCL)
template <>
struct engine<cohort::nccl> {
  using group = cohort::process_group<cohort::nccl>;
  static constexpr const char* raw_name = "nccl";

  static void check(cudaError_t status, int rank, const char* what) {
    if (status != cudaSuccess)
      throw cohort::error(rank, std::string("cohort-bench.") + what, cudaGetErrorString(status));
  }
  template <class T>
  static T* allocate(group& pg, std::size_t count) {
    return static_cast<T*>(pg.backend().allocate(std::max<std::size_t>(count, 1) * sizeof(T)));
  }
  template <class T>
  static void release(group& pg, T* pointer, std::size_t count) {
    pg.backend().deallocate(pointer, std::max<std::size_t>(count, 1) * sizeof(T));
  }
  template <class T>
  static void upload(group& pg, T* destination, const std::vector<T>& source) {
    check(cudaSetDevice(pg.backend().device()), pg.rank(), "set_device");
    // On the group's stream, not the legacy one: from pageable memory cudaMemcpy may return
    // before its DMA lands, and the group's non-blocking stream does not wait for the legacy
    // stream, so a collective could read a stale tail.
    check(cudaMemcpyAsync(destination, source.data(), source.size() * sizeof(T), cudaMemcpyHostToDevice,
                          pg.backend().stream()),
          pg.rank(), "upload");
    check(cudaStreamSynchronize(pg.backend().stream()), pg.rank(), "stream_synchronize(upload)");
  }
  template <class T>
  static void download(group& pg, std::vector<T>& destination, const T* source, std::size_t count) {
    destination.resize(count);
    check(cudaMemcpyAsync(destination.data(), source, count * sizeof(T), cudaMemcpyDeviceToHost, pg.backend().stream()),
          pg.rank(), "download");
    check(cudaStreamSynchronize(pg.backend().stream()), pg.rank(), "stream_synchronize(download)");
  }

  // Back to back, then wait for the last (nccl-tests' timing).
  template <class Call>
  static double time_cohort(group&, int iterations, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    typename group::work last;
    for (int i = 0; i < iterations; ++i) last = call();
    last.wait();
    return seconds_since(start);
  }
  template <class Call>
  static double time_raw(group& pg, int iterations, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) call();
    check(cudaStreamSynchronize(pg.backend().stream()), pg.rank(), "stream_synchronize");
    return seconds_since(start);
  }

  // The communicator is non-blocking: a call may answer ncclInProgress until enqueued.
  static void settle(group& pg, ncclResult_t status, const char* what) {
    while (status == ncclInProgress) ncclCommGetAsyncError(pg.backend().communicator(), &status);
    if (status != ncclSuccess) throw cohort::error(pg.rank(), std::string("raw ") + what, ncclGetErrorString(status));
  }

  template <class T>
  static void raw(group& pg, operation what, op reduce, const T* in, T* out, const layout& shape, int root) {
    auto comm = pg.backend().communicator();
    auto stream = pg.backend().stream();
    const auto type = cohort::detail::nccl_type(cohort::dtype_v<T>);
    const std::size_t n = shape.count;
    switch (what) {
      case operation::all_reduce:
        return settle(pg, ncclAllReduce(in, out, n, type, cohort::detail::nccl_op(reduce), comm, stream),
                      "ncclAllReduce");
      case operation::all_gather: return settle(pg, ncclAllGather(in, out, n, type, comm, stream), "ncclAllGather");
      case operation::reduce_scatter:
        return settle(pg, ncclReduceScatter(in, out, n, type, cohort::detail::nccl_op(reduce), comm, stream),
                      "ncclReduceScatter");
      case operation::broadcast:
        return settle(pg, ncclBroadcast(out, out, n, type, root, comm, stream), "ncclBroadcast");
      case operation::all_to_all: {
        ncclResult_t status = ncclGroupStart();
        for (int peer = 0; peer < pg.size() && status == ncclSuccess; ++peer) {
          status = ncclSend(in + n * std::size_t(peer), n, type, peer, comm, stream);
          if (status == ncclSuccess) status = ncclRecv(out + n * std::size_t(peer), n, type, peer, comm, stream);
        }
        const ncclResult_t ended = ncclGroupEnd();
        return settle(pg, status != ncclSuccess ? status : ended, "ncclSend/ncclRecv");
      }
    }
  }
};
#endif

// cohort's call: out of place, or in place on the buffers nccl-tests uses for it.
template <class B, class T>
typename B::work cohort_call(cohort::process_group<B>& pg, operation what, op reduce, T* send, T* recv,
                             const layout& shape, int root, bool in_place) {
  const std::size_t n = shape.count, world = static_cast<std::size_t>(pg.size());
  const std::size_t me = static_cast<std::size_t>(pg.rank());
  switch (what) {
    case operation::all_reduce:
      if (in_place) return pg.all_reduce(std::span<T>(recv, n), reduce);
      return pg.all_reduce(std::span<const T>(send, n), std::span<T>(recv, n), reduce);
    case operation::all_gather:
      return pg.all_gather(std::span<const T>(in_place ? recv + me * n : send, n), std::span<T>(recv, n * world));
    case operation::reduce_scatter:
      if (in_place)
        return pg.reduce_scatter(std::span<const T>(send, n * world), std::span<T>(send + me * n, n), reduce);
      return pg.reduce_scatter(std::span<const T>(send, n * world), std::span<T>(recv, n), reduce);
    case operation::broadcast:  // cohort's broadcast is in place; both columns time it
      return pg.broadcast(std::span<T>(recv, n), root);
    case operation::all_to_all:
      return pg.all_to_all(std::span<const T>(send, n * world), std::span<T>(recv, n * world));
  }
  return {};
}

// Runs the whole sweep on this rank. `control` is a Gloo group of the same ranks used for
// barriers and for averaging the timings; every rank returns the same rows.
template <class B>
std::vector<row> run(cohort::process_group<B>& pg, cohort::process_group<cohort::gloo>& control, const options& o,
                     const std::function<void(const row&)>& on_row = {}) {
  std::vector<row> rows;
  cohort::visit_dtype(o.type, [&](auto sample) {
    using T = decltype(sample);
    using E = engine<B>;
    const int world = pg.size(), rank = pg.rank();
    const auto size_list = sizes(o);
    if (size_list.empty()) return;
    const layout biggest = layout_for(o.what, size_list.back(), sizeof(T), world);
    const std::size_t send_capacity = std::max(biggest.send_count, biggest.recv_count);
    T* send = E::template allocate<T>(pg, send_capacity);
    T* recv = E::template allocate<T>(pg, send_capacity);
    struct buffers_guard {
      cohort::process_group<B>& pg;
      T *send, *recv;
      std::size_t capacity;
      ~buffers_guard() {
        E::release(pg, send, capacity);
        E::release(pg, recv, capacity);
      }
    } guard{pg, send, recv, send_capacity};
    std::vector<T> host_send, host_recv, result;
    auto barrier = [&] { control.barrier().wait(); };

    for (const std::size_t requested : size_list) {
      const layout shape = layout_for(o.what, requested, sizeof(T), world);
      if (shape.count == 0) continue;  // too small to split across the ranks
      const bool in_place_too = has_in_place(o.what);
      auto prepare = [&](bool in_place) {
        fill_inputs(o.what, o.reduce, rank, shape, host_send, host_recv, in_place, o.root);
        E::upload(pg, send, host_send);
        E::upload(pg, recv, host_recv);
      };
      auto call = [&](bool in_place) { return cohort_call(pg, o.what, o.reduce, send, recv, shape, o.root, in_place); };
      auto raw_call = [&] { E::raw(pg, o.what, o.reduce, send, recv, shape, o.root); };

      // Correctness: one out-of-place and one in-place call on known data.
      double wrong[2] = {-1, -1};
      if (o.check) {
        for (int in_place = 0; in_place < (in_place_too ? 2 : 1); ++in_place) {
          prepare(in_place != 0);
          call(in_place != 0).wait();
          const bool scatter_in_place = in_place && o.what == operation::reduce_scatter;
          E::download(pg, result, scatter_in_place ? send : recv,
                      scatter_in_place ? shape.send_count : shape.recv_count);
          wrong[in_place] = double(count_wrong(o.what, o.reduce, rank, world, o.root, shape, result, in_place != 0));
        }
      }
      prepare(false);

      const double warmup_seconds = E::time_cohort(pg, o.warmup, [&] { return call(false); });
      if (o.compare_raw) E::time_raw(pg, o.warmup, raw_call);

      const int iterations = std::max(1, o.iterations);
      std::vector<double> cohort_blocks, raw_blocks, in_place_blocks;
      for (int rep = 0; rep < std::max(1, o.repetitions); ++rep) {
        // Alternate which goes first, so neither always follows the other's tail.
        const bool raw_first = o.compare_raw && rep % 2 == 1;
        if (raw_first) {
          barrier();
          raw_blocks.push_back(E::time_raw(pg, iterations, raw_call) / iterations);
        }
        barrier();
        cohort_blocks.push_back(E::time_cohort(pg, iterations, [&] { return call(false); }) / iterations);
        if (o.compare_raw && !raw_first) {
          barrier();
          raw_blocks.push_back(E::time_raw(pg, iterations, raw_call) / iterations);
        }
      }
      if (in_place_too) {
        for (int rep = 0; rep < std::max(1, o.repetitions); ++rep) {
          barrier();
          in_place_blocks.push_back(E::time_cohort(pg, iterations, [&] { return call(true); }) / iterations);
        }
      }

      // The overhead figure: single calls interleaved, alternating which goes first.
      std::vector<double> cohort_calls, raw_calls;
      if (o.compare_raw) {
        int pairs = o.ratio_pairs;
        if (pairs <= 0) {
          const int least = std::max(1, iterations * std::max(1, o.repetitions));
          const double per_call = o.warmup > 0 ? warmup_seconds / o.warmup : 0.0;
          pairs = per_call > 0 ? static_cast<int>(std::clamp(1.0 / per_call, double(least), 1000.0)) : least;
          // Every rank must make the same number of calls: rank 0's pace decides.
          std::vector<double> agreed{double(pairs)};
          control.broadcast(std::span<double>(agreed), 0).wait();
          pairs = static_cast<int>(agreed[0]);
        }
        barrier();
        for (int i = 0; i < pairs; ++i) {
          if (i % 2 == 1) raw_calls.push_back(E::time_raw(pg, 1, raw_call));
          cohort_calls.push_back(E::time_cohort(pg, 1, [&] { return call(false); }));
          if (i % 2 == 0) raw_calls.push_back(E::time_raw(pg, 1, raw_call));
        }
      }

      // Average over ranks (nccl-tests), and sum the wrong elements.
      auto pick = [&](const std::vector<double>& blocks) {
        if (blocks.empty()) return 0.0;
        return o.fastest_block ? *std::min_element(blocks.begin(), blocks.end()) : median(blocks);
      };
      const double quartile_ratio = o.compare_raw ? quantile(raw_calls, 0.25) / quantile(cohort_calls, 0.25) : 0.0;
      const double median_ratio = o.compare_raw ? median(raw_calls) / median(cohort_calls) : 0.0;
      std::vector<double> figures = {pick(cohort_blocks), pick(raw_blocks), pick(in_place_blocks), quartile_ratio,
                                     median_ratio};
      control.all_reduce(std::span<double>(figures), op::avg).wait();
      std::vector<double> errors = {std::max(0.0, wrong[0]), std::max(0.0, wrong[1])};
      control.all_reduce(std::span<double>(errors), op::sum).wait();

      row r;
      r.bytes = shape.bytes();
      r.count = shape.count;
      const double factor = bus_factor(o.what, world);
      r.time_us = figures[0] * 1e6;
      r.algbw_GBps = figures[0] > 0 ? double(r.bytes) / figures[0] / 1e9 : 0;
      r.busbw_GBps = r.algbw_GBps * factor;
      r.wrong = o.check ? errors[0] : -1;
      if (in_place_too) {
        r.inplace_time_us = figures[2] * 1e6;
        r.inplace_algbw_GBps = figures[2] > 0 ? double(r.bytes) / figures[2] / 1e9 : 0;
        r.inplace_busbw_GBps = *r.inplace_algbw_GBps * factor;
        r.inplace_wrong = o.check ? errors[1] : -1;
      }
      if (o.compare_raw) {
        r.raw_time_us = figures[1] * 1e6;
        r.raw_busbw_GBps = figures[1] > 0 ? double(r.bytes) / figures[1] / 1e9 * factor : 0;
        r.cohort_over_raw = figures[3];
        r.cohort_over_raw_median = figures[4];
      }
      rows.push_back(r);
      if (on_row) on_row(r);
    }
  });
  return rows;
}

// --- output ----------------------------------------------------------------------------------
// nccl-tests fits a number into a fixed width by dropping decimals, then to exponent form.
inline std::string fit(double value, int width) {
  char text[64];
  for (int decimals = 2; decimals >= 0; --decimals)
    if (std::snprintf(text, sizeof text, "%*.*f", width, decimals, value) <= width) return text;
  std::snprintf(text, sizeof text, "%*.1e", width, value);
  return text;
}

inline std::string wrong_text(std::optional<double> wrong) {
  if (!wrong || *wrong < 0) return "   N/A";
  char text[32];
  std::snprintf(text, sizeof text, "%6g", *wrong);
  return text;
}

inline std::string header(const options& o) {
  std::string text;
  text +=
      "#                                                              out-of-place                       "
      "in-place          ";
  if (o.compare_raw) text += "    raw engine, out-of-place";
  text +=
      "\n#       size         count      type   redop    root     time   algbw   busbw #wrong     time   "
      "algbw   busbw #wrong";
  if (o.compare_raw) text += "     time   busbw  cohort/raw";
  text +=
      "\n#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  "
      "(GB/s)  (GB/s)       ";
  if (o.compare_raw) text += "     (us)  (GB/s)   (busbw)";
  return text + "\n";
}

inline std::string format_row(const options& o, const row& r) {
  char text[512];
  const std::string type{cohort::to_string(o.type)};
  const std::string redop = has_reduction(o.what) ? std::string(cohort::to_string(o.reduce)) : "none";
  const int root = has_root(o.what) ? o.root : -1;
  std::snprintf(text, sizeof text, "%12zu  %12zu  %8s  %6s  %6d", r.bytes, r.count, type.c_str(), redop.c_str(), root);
  std::string line = text;
  line +=
      "  " + fit(r.time_us, 7) + "  " + fit(r.algbw_GBps, 6) + "  " + fit(r.busbw_GBps, 6) + "  " + wrong_text(r.wrong);
  if (r.inplace_time_us)
    line += "  " + fit(*r.inplace_time_us, 7) + "  " + fit(*r.inplace_algbw_GBps, 6) + "  " +
            fit(*r.inplace_busbw_GBps, 6) + "  " + wrong_text(r.inplace_wrong);
  else
    line += "        -       -       -     N/A";
  if (r.raw_time_us) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%10.3f", *r.cohort_over_raw);
    line += "  " + fit(*r.raw_time_us, 7) + "  " + fit(*r.raw_busbw_GBps, 6) + "  " + ratio;
  }
  return line + "\n";
}

struct summary {
  double wrong = 0;
  double average_busbw_GBps = 0;                              // over every out-of-place and in-place row, as nccl-tests
  std::optional<double> min_ratio, mean_ratio;                // lower quartiles (the column)
  std::optional<double> min_median_ratio, mean_median_ratio;  // medians
};

inline summary summarize(const std::vector<row>& rows) {
  summary s;
  double total = 0;
  int counted = 0, ratios = 0;
  double ratio_total = 0, median_total = 0;
  for (const auto& r : rows) {
    s.wrong += std::max(0.0, r.wrong) + std::max(0.0, r.inplace_wrong.value_or(0));
    total += r.busbw_GBps, ++counted;
    if (r.inplace_busbw_GBps) total += *r.inplace_busbw_GBps, ++counted;
    if (r.cohort_over_raw) {
      s.min_ratio = std::min(s.min_ratio.value_or(*r.cohort_over_raw), *r.cohort_over_raw);
      ratio_total += *r.cohort_over_raw, ++ratios;
      const double at_median = r.cohort_over_raw_median.value_or(*r.cohort_over_raw);
      s.min_median_ratio = std::min(s.min_median_ratio.value_or(at_median), at_median);
      median_total += at_median;
    }
  }
  s.average_busbw_GBps = counted ? total / counted : 0;
  if (ratios) s.mean_ratio = ratio_total / ratios, s.mean_median_ratio = median_total / ratios;
  return s;
}

inline std::string footer(const std::vector<row>& rows) {
  const summary s = summarize(rows);
  char text[256];
  std::string out;
  std::snprintf(text, sizeof text, "# %-20s : %g %s\n", "Out of bounds values", s.wrong, s.wrong ? "FAILED" : "OK");
  out += text;
  std::snprintf(text, sizeof text, "# %-20s : %g \n", "Avg bus bandwidth", s.average_busbw_GBps);
  out += text;
  if (s.min_ratio) {
    std::snprintf(text, sizeof text, "# %-20s : min %.3f, mean %.3f (target >= 0.98)\n", "cohort / raw busbw",
                  *s.min_ratio, *s.mean_ratio);
    out += text;
    std::snprintf(text, sizeof text, "# %-20s : min %.3f, mean %.3f (lower quartiles above; medians here)\n", "",
                  *s.min_median_ratio, *s.mean_median_ratio);
    out += text;
  }
  return out + "#\n";
}

// The result file: the schema of cohort/tools/planner.hpp (parse_bench_result reads it) plus
// extra fields: per-row type/redop/root, in-place #wrong, the raw engine's figures.
inline cohort::detail::json to_json(const options& o, int world, const std::vector<row>& rows,
                                    cohort::detail::json env) {
  using cohort::detail::json;
  json items = json::make_array();
  for (const auto& r : rows) {
    json item = json::make_object();
    item.set("bytes", double(r.bytes));
    item.set("count", double(r.count));
    item.set("type", std::string(cohort::to_string(o.type)));
    item.set("redop", has_reduction(o.what) ? std::string(cohort::to_string(o.reduce)) : std::string("none"));
    item.set("root", has_root(o.what) ? o.root : -1);
    item.set("time_us", r.time_us);
    item.set("algbw_GBps", r.algbw_GBps);
    item.set("busbw_GBps", r.busbw_GBps);
    item.set("wrong", r.wrong < 0 ? json() : json(r.wrong));
    if (r.inplace_time_us) {
      item.set("inplace_time_us", *r.inplace_time_us);
      item.set("inplace_algbw_GBps", *r.inplace_algbw_GBps);
      item.set("inplace_busbw_GBps", *r.inplace_busbw_GBps);
      item.set("inplace_wrong", *r.inplace_wrong < 0 ? json() : json(*r.inplace_wrong));
    }
    if (r.raw_time_us) {
      item.set("raw_time_us", *r.raw_time_us);
      item.set("raw_busbw_GBps", *r.raw_busbw_GBps);
      item.set("cohort_over_raw", *r.cohort_over_raw);
      if (r.cohort_over_raw_median) item.set("cohort_over_raw_median", *r.cohort_over_raw_median);
    }
    items.push_back(std::move(item));
  }
  const summary s = summarize(rows);
  json document = json::make_object();
  document.set("tool", "cohort-bench");
  document.set("operation", to_string(o.what));
  document.set("backend", o.backend);
  document.set("world", world);
  document.set("dtype", std::string(cohort::to_string(o.type)));
  document.set("redop", has_reduction(o.what) ? std::string(cohort::to_string(o.reduce)) : std::string("none"));
  document.set("root", has_root(o.what) ? o.root : -1);
  document.set("iterations", o.iterations);
  document.set("warmup", o.warmup);
  document.set("repetitions", o.repetitions);
  document.set("statistic", o.fastest_block ? "fastest block" : "median block");
  document.set("rows", std::move(items));
  document.set("avg_busbw_GBps", s.average_busbw_GBps);
  document.set("wrong_total", s.wrong);
  if (s.min_ratio) {
    document.set("min_cohort_over_raw", *s.min_ratio);
    document.set("mean_cohort_over_raw", *s.mean_ratio);
    document.set("cohort_over_raw_statistic", "lower quartile of interleaved single calls");
    document.set("min_cohort_over_raw_median", *s.min_median_ratio);
    document.set("mean_cohort_over_raw_median", *s.mean_median_ratio);
  }
  document.set("env", std::move(env));
  return document;
}

}  // namespace cohort_bench
