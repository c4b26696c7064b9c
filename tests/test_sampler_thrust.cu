// The Thrust variant of the sampler on a GPU (CUDA system) must produce exactly the host
// sampler's indices; without a GPU every case reports itself skipped.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>

#include "cohort/data/sampler_thrust.hpp"
#include "support.hpp"

namespace {

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) cohort_test::skip("no CUDA device");
}

std::vector<std::uint64_t> to_std(const thrust::device_vector<std::uint64_t>& values) {
  thrust::host_vector<std::uint64_t> host = values;
  return std::vector<std::uint64_t>(host.begin(), host.end());
}

}  // namespace

TEST_CASE("sampler_thrust_cuda: the GPU computes the host sampler's indices, bit for bit", "[sampler][thrust][cuda]") {
  require_gpu();
  static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA, "this test runs Thrust's CUDA system");
  for (std::uint64_t n : {1u, 10u, 97u, 1000u, 65537u, 1000003u}) {
    for (int world : {1, 3, 8}) {
      for (bool shuffle : {true, false}) {
        for (bool drop_last : {false, true}) {
          for (std::uint64_t epoch : {0u, 5u}) {
            for (int rank = 0; rank < world; ++rank) {
              INFO("n=" << n << " world=" << world << " rank=" << rank << " shuffle=" << shuffle
                        << " drop_last=" << drop_last << " epoch=" << epoch);
              cohort::sampler_options options{.shuffle = shuffle, .seed = 2024, .drop_last = drop_last};
              cohort::distributed_sampler host{n, world, rank, options};
              host.set_epoch(epoch);
              cohort::distributed_sampler device{n, world, rank, options};
              device.set_epoch(epoch);
              REQUIRE(to_std(cohort::device_indices(device)) == host.indices());
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sampler_thrust_cuda: the GPU shuffled order is a permutation equal to the host's",
          "[sampler][thrust][cuda]") {
  require_gpu();
  for (std::uint64_t n : {2u, 257u, 10000019u}) {
    auto order = cohort::device_shuffled_order(n, 99, 3);
    const cohort::detail::feistel_permutation host{n, 99, 3};
    const auto values = to_std(order);
    REQUIRE(values.size() == n);
    std::uint64_t mismatches = 0;
    for (std::uint64_t i = 0; i < n; ++i) mismatches += values[i] != host(i) ? 1 : 0;
    CHECK(mismatches == 0);
    thrust::sort(order.begin(), order.end());
    thrust::device_vector<std::uint64_t> expected(static_cast<std::size_t>(n));
    thrust::sequence(expected.begin(), expected.end());
    CHECK(order == expected);
  }
}
