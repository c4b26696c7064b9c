// training_state under ddp on NCCL at world size 1 (NCCL allows one rank per GPU): gradients
// in device memory written by kernels on the caller's stream, buckets launched during the
// backward, a NaN found after the reduction and skipped, no_sync that communicates nothing,
// and a region marked twice named. Plain SGD at lr 1 from zero makes the parameters minus the
// reduced gradients. Without a GPU each case reports itself skipped.
#include <catch2/catch.hpp>

#include <cohort/comm/nccl.hpp>
#include <cohort/parallel/training_state.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    cohort_test::skip("no CUDA device on this machine: NCCL training_state tests need a GPU");
  }
}

using group = cohort::process_group<cohort::nccl>;
using state_type = cohort::training_state<cohort::nccl>;

group make_group() {
  cohort::nccl::options options;
  options.timeout = std::chrono::seconds(20);
  return group(std::make_shared<cohort::memory_store>(), cohort::launch_env::explicit_ranks(0, 1), options);
}

// Writes scale x (i % 17) into a device span on `stream`, as a backward kernel would.
__global__ void write_kernel(float* data, std::size_t n, float scale) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = scale * static_cast<float>(i % 17);
}
void write_on(cudaStream_t stream, std::span<float> gradient, float scale) {
  write_kernel<<<static_cast<unsigned>((gradient.size() + 255) / 256), 256, 0, stream>>>(gradient.data(),
                                                                                         gradient.size(), scale);
}

// Tensors of varied sizes, each its own layer, back to back.
std::vector<cohort::region> regions_of(const std::vector<std::size_t>& sizes) {
  std::vector<cohort::region> regions;
  for (std::size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++])
    regions.push_back({"t" + std::to_string(t), at, sizes[t], t});
  return regions;
}

}  // namespace

TEST_CASE("NCCL training_state: ddp on a caller stream, buckets launched during the backward",
          "[training_state][cuda]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  {
    const std::vector<std::size_t> sizes{100, 70000, 3, 300000, 17};
    const auto regions = regions_of(sizes);
    state_type state{pg, regions, {.bucket_bytes = 1 << 20, .sgd = cohort::sgd_options{.lr = 1}}};
    state.set_stream(stream);
    REQUIRE(state.bucket_count() >= 2);
    std::size_t elements = 0;
    for (auto n : sizes) elements += n;
    state.load_parameters(std::vector<float>(elements, 0.0f));
    float applied = 0;
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (std::size_t t = sizes.size(); t-- > 0;) {
        write_on(stream, state.gradient(t), static_cast<float>(iteration + 1));
        if (t == 0) REQUIRE(state.launched_buckets() >= 1);  // the last gradient: earlier buckets are on their way
        state.mark_ready(t);
      }
      const auto result = state.step();  // the caller's stream waits; the host does not
      REQUIRE_FALSE(result.skipped);
      applied += static_cast<float>(iteration + 1);
    }
    const auto params = state.gather_parameters();
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::size_t i = 0; i < sizes[t]; ++i)
        REQUIRE(params[regions[t].offset + i] == -applied * static_cast<float>(i % 17));
  }
  cudaStreamDestroy(stream);
}

TEST_CASE(
    "NCCL training_state: a NaN is found after the reduction and the step skipped, no_sync communicates "
    "nothing, a region marked twice is named",
    "[training_state][cuda]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  {
    const std::vector<std::size_t> sizes{1000, 5, 250000, 64};
    const auto regions = regions_of(sizes);
    int launches = 0;
    state_type state{
        pg, regions, {.bucket_bytes = 8192, .sgd = cohort::sgd_options{.lr = 1}, .on_launch = [&](std::size_t) {
                        ++launches;
                      }}};
    state.set_stream(stream);
    state.load_parameters(std::vector<float>(251069, 0.0f));
    for (std::size_t t = sizes.size(); t-- > 0;) {
      write_on(stream, state.gradient(t), 1.0f);
      if (t == 2) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        cudaMemcpyAsync(state.gradient(t).data() + 7, &nan, sizeof nan, cudaMemcpyHostToDevice, stream);
      }
      state.mark_ready(t);
    }
    const auto skipped = state.step();
    REQUIRE(skipped.skipped);
    REQUIRE(skipped.nonfinite >= 1);
    for (const float p : state.gather_parameters()) REQUIRE(p == 0.0f);  // nothing updated
    launches = 0;
    {
      auto quiet = state.no_sync();
      for (std::size_t t = sizes.size(); t-- > 0;) state.mark_ready(t);
      REQUIRE(state.launched_buckets() == 0);
    }
    REQUIRE(launches == 0);
    state.mark_ready(1);
    REQUIRE_THROWS_WITH(state.mark_ready(1), Catch::Contains("region 1 't1' marked twice in one step"));
  }
  cudaStreamDestroy(stream);
}
