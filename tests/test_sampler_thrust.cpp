// The Thrust variant of the sampler, run through Thrust's CPP (host) system, must produce
// exactly the host sampler's indices. tests/test_sampler_thrust.cu runs the same comparison
// through CUDA on a GPU.
//
// Needs Thrust's headers on the include path (CUDA 13: /usr/local/cuda/include/cccl); without
// them every case reports itself skipped.
#ifndef THRUST_DEVICE_SYSTEM
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "support.hpp"

#if __has_include(<thrust/version.h>)
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>

#include "cohort/data/sampler_thrust.hpp"
#define COHORT_TEST_HAS_THRUST 1
#else
#define COHORT_TEST_HAS_THRUST 0
#endif

#if COHORT_TEST_HAS_THRUST

namespace {
std::vector<std::uint64_t> to_std(const thrust::device_vector<std::uint64_t>& values) {
  thrust::host_vector<std::uint64_t> host = values;
  return std::vector<std::uint64_t>(host.begin(), host.end());
}
}  // namespace

TEST_CASE("sampler_thrust: Thrust's host system gives the host sampler's indices, bit for bit", "[sampler][thrust]") {
  static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CPP, "this test runs Thrust's CPP system");
  for (std::uint64_t n : {1u, 10u, 97u, 1000u, 65537u}) {
    for (int world : {1, 3, 8}) {
      for (bool shuffle : {true, false}) {
        for (bool drop_last : {false, true}) {
          for (std::uint64_t epoch : {0u, 5u}) {
            for (int rank = 0; rank < world; ++rank) {
              INFO("n=" << n << " world=" << world << " rank=" << rank << " shuffle=" << shuffle
                        << " drop_last=" << drop_last << " epoch=" << epoch);
              cohort::distributed_sampler host{
                  n, world, rank, {.shuffle = shuffle, .seed = 2024, .drop_last = drop_last}};
              host.set_epoch(epoch);
              cohort::distributed_sampler device{
                  n, world, rank, {.shuffle = shuffle, .seed = 2024, .drop_last = drop_last}};
              device.set_epoch(epoch);
              REQUIRE(to_std(cohort::device_indices(device)) == host.indices());
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sampler_thrust: micro-batch mode's runs on the device equal the host's", "[sampler][thrust]") {
  for (int world : {1, 2, 4}) {
    for (int rank = 0; rank < world; ++rank) {
      INFO("world=" << world << " rank=" << rank);
      cohort::distributed_sampler host{100, world, rank, {.seed = 6, .micro_batches = 8, .micro_batch_size = 3}};
      cohort::distributed_sampler device{100, world, rank, {.seed = 6, .micro_batches = 8, .micro_batch_size = 3}};
      CHECK(to_std(cohort::device_indices(device)) == host.indices());
    }
  }
}

TEST_CASE("sampler_thrust: the device shuffled order is a permutation equal to the host's", "[sampler][thrust]") {
  for (std::uint64_t n : {2u, 255u, 256u, 257u, 100000u}) {
    auto order = cohort::device_shuffled_order(n, 99, 3);
    const cohort::detail::feistel_permutation host{n, 99, 3};
    const auto values = to_std(order);
    REQUIRE(values.size() == n);
    for (std::uint64_t i = 0; i < n; ++i) REQUIRE(values[i] == host(i));
    // Sorted, it must be 0 .. n-1: a bijection. (Sorted on the host: Thrust's sequential
    // sort of a device_vector binds a reference through a null system pointer, which UBSan
    // reports inside Thrust.)
    auto sorted = values;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::uint64_t> expected(static_cast<std::size_t>(n));
    std::iota(expected.begin(), expected.end(), std::uint64_t{0});
    CHECK(sorted == expected);
  }
}

TEST_CASE("sampler_thrust: explicit policies and the set_epoch warning", "[sampler][thrust]") {
  std::vector<std::string> warnings;
  cohort::distributed_sampler sampler{
      500, 4, 2, {.seed = 1, .warn = [&](std::string_view m) { warnings.emplace_back(m); }}};
  sampler.set_epoch(1);
  std::vector<std::uint64_t> through_host_policy(static_cast<std::size_t>(sampler.size()));
  cohort::rank_indices(thrust::host, sampler, through_host_policy.begin());
  CHECK(warnings.empty());  // policy form: not a pass
  CHECK(to_std(cohort::device_indices(sampler)) == through_host_policy);
  (void)cohort::device_indices(sampler);
  CHECK(warnings.size() == 1);  // second pass of epoch 1
}

TEST_CASE("sampler_thrust: uneven shares (even_batches off) match the host sampler", "[sampler][thrust]") {
  for (int rank = 0; rank < 4; ++rank) {
    cohort::distributed_sampler sampler{101, 4, rank, {.seed = 3, .even_batches = false}};
    std::vector<std::uint64_t> through_host_policy(static_cast<std::size_t>(sampler.size()));
    cohort::rank_indices(thrust::host, sampler, through_host_policy.begin());
    CHECK(through_host_policy.size() == (rank == 0 ? 26u : 25u));
    CHECK(to_std(cohort::device_indices(sampler)) == sampler.indices());
    CHECK(through_host_policy == sampler.indices());
  }
}

#else

TEST_CASE("sampler_thrust: Thrust's host system gives the host sampler's indices, bit for bit", "[sampler][thrust]") {
  cohort_test::skip("Thrust headers not on the include path (add <cuda>/include/cccl for this target)");
}

#endif
