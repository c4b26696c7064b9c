// gradient_reducer on NCCL at world size 1 (NCCL allows one rank per GPU): bucket views and
// user buffers in device memory, ordering on a caller stream, compression, the non-finite
// check, and bucket launches during the backward. Without a GPU each case reports itself
// skipped.
#include <catch2/catch.hpp>

#include <cohort/backend/nccl.hpp>
#include <cohort/reducer.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "support.hpp"

namespace {

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    cohort_test::skip("no CUDA device on this machine: NCCL reducer tests need a GPU");
  }
}

using group = cohort::process_group<cohort::nccl>;
using reducer = cohort::gradient_reducer<cohort::nccl>;

group make_group() {
  cohort::nccl::options options;
  options.timeout = std::chrono::seconds(20);
  return group(std::make_shared<cohort::memory_store>(), cohort::launch_env::explicit_ranks(0, 1), options);
}

// Writes value(i) into a device span on `stream`, as a backward kernel would.
__global__ void write_kernel(float* data, std::size_t n, float scale) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = scale * static_cast<float>(i % 17);
}
void write_on(cudaStream_t stream, std::span<float> gradient, float scale) {
  write_kernel<<<static_cast<unsigned>((gradient.size() + 255) / 256), 256, 0, stream>>>(gradient.data(),
                                                                                         gradient.size(), scale);
}

std::vector<float> download(std::span<const float> device, cudaStream_t stream) {
  std::vector<float> host(device.size());
  cudaMemcpyAsync(host.data(), device.data(), device.size_bytes(), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return host;
}

}  // namespace

TEST_CASE("NCCL reducer with bucket views on a caller stream", "[reducer][cuda]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const std::vector<std::size_t> sizes{100, 70000, 3, 300000, 17};
  reducer ddp(pg, sizes, {.first_bucket_bytes = 4096, .bucket_bytes = 1 << 20});
  ddp.set_stream(stream);
  REQUIRE(ddp.bucket_count() >= 3);
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (std::size_t t = sizes.size(); t-- > 0;) {
      write_on(stream, ddp.gradient(t), static_cast<float>(iteration + 1));
      if (t == 0) {
        // The last gradient: earlier buckets are already on their way.
        REQUIRE(ddp.launched_buckets() >= 1);
        REQUIRE(ddp.bucket_work(0).wait_for(std::chrono::seconds(10)));
      }
      ddp.mark_ready(t);
    }
    ddp.finish();  // the caller's stream waits; the host does not
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto values = download(ddp.gradient(t), stream);
      for (std::size_t i = 0; i < values.size(); ++i)
        REQUIRE(values[i] == static_cast<float>(iteration + 1) * static_cast<float>(i % 17));
    }
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("NCCL reducer with user buffers, compression and the non-finite check", "[reducer][cuda]") {
  require_gpu();
  auto kind = GENERATE(cohort::compression::none, cohort::compression::bfloat16, cohort::compression::half);
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  const std::vector<std::size_t> sizes{1000, 5, 250000, 64};
  std::vector<float*> buffers;
  std::vector<std::span<float>> spans;
  for (auto n : sizes) {
    float* p = nullptr;
    REQUIRE(cudaMalloc(&p, n * sizeof(float)) == cudaSuccess);
    buffers.push_back(p);
    spans.emplace_back(p, n);
  }
  {
    reducer ddp(pg, spans, {.first_bucket_bytes = 8192, .compress = kind, .check_nonfinite = true});
    ddp.set_stream(stream);
    for (std::size_t t = sizes.size(); t-- > 0;) {
      write_on(stream, spans[t], 0.5f);  // small multiples of 0.5: exact in bfloat16 and half
      ddp.mark_ready(spans[t]);
    }
    auto summary = ddp.finish();
    REQUIRE_FALSE(summary.nonfinite);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto values = download(spans[t], stream);
      for (std::size_t i = 0; i < values.size(); ++i) REQUIRE(values[i] == 0.5f * static_cast<float>(i % 17));
    }
    // A NaN in one gradient is found after the reduction.
    for (std::size_t t = sizes.size(); t-- > 0;) {
      write_on(stream, spans[t], 1.0f);
      if (t == 2) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        cudaMemcpyAsync(spans[t].data() + 7, &nan, sizeof nan, cudaMemcpyHostToDevice, stream);
      }
      ddp.mark_ready(t);
    }
    summary = ddp.finish();
    REQUIRE(summary.nonfinite == 1);
  }
  for (auto p : buffers) cudaFree(p);
  cudaStreamDestroy(stream);
}

TEST_CASE("NCCL reducer: no_sync communicates nothing, errors name gradients", "[reducer][cuda]") {
  require_gpu();
  auto pg = make_group();
  reducer ddp(pg, std::vector<std::size_t>{10, 20});
  {
    auto scope = ddp.no_sync();
    ddp.mark_ready(1);
    ddp.mark_ready(0);
    REQUIRE(ddp.launched_buckets() == 0);
    REQUIRE_FALSE(ddp.finish().synchronized);
  }
  ddp.mark_ready(1);
  REQUIRE_THROWS_WITH(ddp.mark_ready(1), Catch::Contains("gradient 1 (20 x float) was marked ready twice"));
  REQUIRE_THROWS_WITH(ddp.finish(), Catch::Contains("gradient 0 (10 x float)"));
}
