#pragma once
// The distributed sampler's indices computed by Thrust: on a GPU when compiled by nvcc for
// the CUDA system, or on the CPU with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP (or OMP).
// Every element is produced by the same counter-based rule as the host sampler
// (cohort/data/detail/permutation.hpp), so the result is bit-identical to
// distributed_sampler::indices() for the same dataset size, world, rank, seed and epoch.
//
//   cohort::distributed_sampler sampler{n, pg, {.seed = 7}};
//   sampler.set_epoch(epoch);
//   thrust::device_vector<std::uint64_t> mine = cohort::device_indices(sampler);
//
// Needs Thrust on the include path (CUDA 13: <cuda>/include/cccl; CUDA 12: <cuda>/include).

#include <cstdint>

#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>

#include "cohort/data/detail/permutation.hpp"
#include "cohort/data/sampler.hpp"

namespace cohort::inline v0 {

// This rank's indices for the sampler's current epoch, written through `out` under the given
// Thrust execution policy (thrust::device, thrust::cuda::par.on(stream), thrust::host, ...).
// `out` needs room for sampler.size() elements (this rank's own count, which differs between
// ranks when even_batches is off). Does not count as a pass over the epoch.
template <class ExecutionPolicy, class OutputIterator>
OutputIterator rank_indices(ExecutionPolicy&& exec, const distributed_sampler& sampler, OutputIterator out) {
  const thrust::counting_iterator<std::uint64_t> first(0);
  return thrust::transform(exec, first, first + static_cast<std::ptrdiff_t>(sampler.size()), out, sampler.index_map());
}

// The same, into a new device vector; counts as a pass (like distributed_sampler::indices(),
// it warns once if a shuffled epoch is read twice without set_epoch).
inline thrust::device_vector<std::uint64_t> device_indices(distributed_sampler& sampler) {
  sampler.begin_pass();
  thrust::device_vector<std::uint64_t> out(static_cast<std::size_t>(sampler.size()));
  rank_indices(thrust::device, sampler, out.begin());
  return out;
}

// The whole shuffled order of [0, n) for (seed, epoch): element i is the dataset index at
// position i before padding and splitting across ranks.
template <class ExecutionPolicy, class OutputIterator>
OutputIterator shuffled_order(ExecutionPolicy&& exec, std::uint64_t n, std::uint64_t seed, std::uint64_t epoch,
                              OutputIterator out) {
  const thrust::counting_iterator<std::uint64_t> first(0);
  return thrust::transform(exec, first, first + static_cast<std::ptrdiff_t>(n), out,
                           detail::feistel_permutation(n, seed, epoch));
}

inline thrust::device_vector<std::uint64_t> device_shuffled_order(std::uint64_t n, std::uint64_t seed,
                                                                  std::uint64_t epoch) {
  thrust::device_vector<std::uint64_t> out(static_cast<std::size_t>(n));
  shuffled_order(thrust::device, n, seed, epoch, out.begin());
  return out;
}

}  // namespace cohort::inline v0
