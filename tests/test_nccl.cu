// The NCCL backend at world size 1 (NCCL allows one rank per GPU, and CI has none):
// every collective and dtype, the device element-wise ops, stream ordering (pg.on(stream)
// included), host values staged through device memory, and timeouts of work handles.
// Without a GPU each case reports itself skipped.
#include <catch2/catch.hpp>

#include <cohort/comm/host_values.hpp>
#include <cohort/comm/nccl.hpp>
#include <cohort/comm/ops.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/data/batch.hpp>
#include <cohort/parallel/detail/reproducible.hpp>
#include <cohort/run/atomic_write.hpp>
#include <cohort/run/guards.hpp>
#include <cohort/run/logging.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    cohort_test::skip("no CUDA device on this machine: NCCL tests need a GPU");
  }
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(status));
}

// Uploads and downloads synchronise the whole device: the legacy stream they run on does
// not order with the group's non-blocking stream, and from pageable memory cudaMemcpy may
// return before its DMA lands, so a collective right after could read a stale tail.
template <class T>
struct device_buffer {
  T* data = nullptr;
  std::size_t count = 0;
  explicit device_buffer(std::size_t n) : count(n) { check(cudaMalloc(&data, n * sizeof(T) + 1), "malloc"); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(data); }
  void upload(const std::vector<T>& host) {
    check(cudaMemcpy(data, host.data(), count * sizeof(T), cudaMemcpyHostToDevice), "upload");
    check(cudaDeviceSynchronize(), "synchronize(upload)");
  }
  void zero() {
    check(cudaMemset(data, 0, count * sizeof(T)), "memset");
    check(cudaDeviceSynchronize(), "synchronize(memset)");
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    check(cudaDeviceSynchronize(), "synchronize(download)");
    check(cudaMemcpy(host.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  std::span<T> span() { return {data, count}; }
};

cohort::process_group<cohort::nccl> make_group() {
  return cohort::process_group<cohort::nccl>(std::make_shared<cohort::memory_store>(),
                                             cohort::launch_env::explicit_ranks(0, 1));
}

}  // namespace

static_assert(cohort::backend<cohort::nccl>);

TEMPLATE_TEST_CASE("NCCL collectives at world size 1 keep the data", "[nccl]", float, double, cohort::half,
                   cohort::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  require_gpu();
  auto pg = make_group();
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1} << 20}) {
    std::vector<TestType> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = TestType(static_cast<float>(i % 5 + 1));
    device_buffer<TestType> a(n), b(n);
    a.upload(host);
    for (cohort::op reduce :
         {cohort::op::sum, cohort::op::avg, cohort::op::min, cohort::op::max, cohort::op::product}) {
      pg.all_reduce(std::span<const TestType>(a.data, n), b.span(), reduce).wait();
      REQUIRE(b.download() == host);
    }
    pg.broadcast(a.span(), 0).wait();
    pg.all_gather(std::span<const TestType>(a.data, n), b.span()).wait();
    REQUIRE(b.download() == host);
    pg.reduce_scatter(std::span<const TestType>(a.data, n), b.span()).wait();
    REQUIRE(b.download() == host);
    pg.all_to_all(std::span<const TestType>(a.data, n), b.span()).wait();
    REQUIRE(b.download() == host);
  }
  pg.barrier().wait();
}

TEST_CASE("device element-wise ops match the host ones", "[nccl]") {
  require_gpu();
  auto pg = make_group();
  auto& engine = pg.backend();
  const std::size_t n = 100003;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.25f - 100.0f;
  device_buffer<float> values(n), copy(n);
  device_buffer<cohort::bfloat16> compressed(n);
  device_buffer<std::int64_t> bad(1);
  values.upload(host);
  cohort::scale(engine, values.data, n, cohort::dtype::float32, 0.5).wait();
  auto scaled = values.download();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(scaled[i] == host[i] * 0.5f);
  cohort::cast(engine, values.data, cohort::dtype::float32, compressed.data, cohort::dtype::bfloat16, n).wait();
  auto narrowed = compressed.download();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(narrowed[i] == cohort::bfloat16(scaled[i]));
  std::vector<cohort::copy_region> regions;
  for (std::size_t first = 0; first < n; first += 997)
    regions.push_back({copy.data + first, values.data + first, std::min<std::size_t>(997, n - first) * sizeof(float)});
  cohort::batched_copy(engine, std::span<const cohort::copy_region>(regions)).wait();
  REQUIRE(copy.download() == scaled);
  bad.zero();
  host[5] = NAN;
  host[77] = INFINITY;
  values.upload(host);
  cohort::count_nonfinite(engine, values.data, n, cohort::dtype::float32, bad.data).wait();
  REQUIRE(bad.download()[0] == 2);
}

// The reproducible norm's kernel against the host loop: the bins of the same values, added
// per element in pieces by atomics on the device and in runs on the host, make the same
// integer and the same inf/NaN count (values of every scale, subnormals, -0, an inf, a NaN).
TEMPLATE_TEST_CASE("the device's exact squares make the host's integer", "[nccl]", float, double, cohort::half,
                   cohort::bfloat16) {
  require_gpu();
  auto pg = make_group();
  constexpr auto type = cohort::dtype_v<TestType>;
  const std::size_t n = 100003;
  std::vector<TestType> host(n);
  for (std::size_t i = 0; i < n; ++i)
    host[i] = TestType(std::sin(0.37f * static_cast<float>(i)) * std::ldexp(1.0f, static_cast<int>(i % 61) - 40));
  host[3] = TestType(-0.0f);
  host[5] = TestType(NAN);
  host[77] = TestType(INFINITY);
  device_buffer<TestType> values(n);
  values.upload(host);
  const std::size_t words = cohort::detail::exact_squares_words(type);
  device_buffer<std::int64_t> bins(words);
  bins.zero();
  cohort::add_exact_squares(pg.backend(), values.data, n, type, bins.data).wait();
  std::vector<std::int64_t> expected(words, 0);
  cohort::detail::host::add_exact_squares(host.data(), n, type, expected.data());
  const auto got = bins.download();
  REQUIRE(cohort::detail::exact_squares_total(got, type) == cohort::detail::exact_squares_total(expected, type));
  REQUIRE(cohort::detail::exact_norm(got, type).nonfinite == 2);
}

TEST_CASE("a caller stream waits on a work without blocking the host", "[nccl]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t caller;
  cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking);
  device_buffer<float> data(1 << 20);
  cohort::fill(pg.backend(), data.data, data.count, cohort::dtype::float32, 2.0).wait();
  pg.backend().wait_for_caller(caller);
  auto w = pg.all_reduce(data.span(), cohort::op::sum);
  w.make_stream_wait(caller);
  float first = 0;
  cudaMemcpyAsync(&first, data.data, sizeof first, cudaMemcpyDeviceToHost, caller);
  cudaStreamSynchronize(caller);
  REQUIRE(first == 2.0f);
  REQUIRE(w.test());
  cudaStreamDestroy(caller);
}

namespace {
// Busy for `cycles` clock ticks, then fills data with value: work queued on the caller's
// stream that a stream-ordered collective has to wait for.
__global__ void late_fill(float* data, std::size_t n, float value, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {}
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    data[i] = value;
}
}  // namespace

TEST_CASE("a stream-ordered collective waits for the caller's stream, and the stream for it", "[nccl]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t caller;
  cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking);
  const std::size_t n = 1 << 20;
  device_buffer<float> in(n), out(n);
  cudaMemset(in.data, 0, n * sizeof(float));
  cudaMemset(out.data, 0, n * sizeof(float));
  cudaDeviceSynchronize();
  // About 0.1 s of spinning before the input is written: a collective that did not wait for
  // the caller's stream would reduce the zeros.
  late_fill<<<64, 256, 0, caller>>>(in.data, n, 3.0f, 200'000'000);
  auto done = pg.on(caller).all_reduce(std::span<const float>(in.data, n), out.span(), cohort::op::sum);
  // Read on the caller's stream, with no host wait on the work in between.
  std::vector<float> host(n);
  cudaMemcpyAsync(host.data(), out.data, n * sizeof(float), cudaMemcpyDeviceToHost, caller);
  REQUIRE(cudaStreamSynchronize(caller) == cudaSuccess);
  CHECK(std::count(host.begin(), host.end(), 3.0f) == static_cast<std::ptrdiff_t>(n));
  CHECK(done.test());
  // The view forwards every collective; one more on the same stream, in place.
  pg.on(caller).broadcast(out.span(), 0);
  REQUIRE(cudaStreamSynchronize(caller) == cudaSuccess);
  cudaStreamDestroy(caller);
}

TEST_CASE("host values across ranks are staged through device memory", "[nccl]") {
  require_gpu();
  auto pg = make_group();
  CHECK(cohort::all_reduce_value(pg, 2.5f, cohort::op::avg) == 2.5f);
  CHECK(cohort::all_reduce_value(pg, 1.25, cohort::op::max) == 1.25);
  CHECK(cohort::all_reduce_value(pg, std::size_t{7}) == 7);
  CHECK(cohort::all_reduce_values(pg, {1.0f, -2.0f, 3.0f}) == std::vector<float>{1.0f, -2.0f, 3.0f});
  const std::vector<std::int64_t> counts{4, 5};
  CHECK(cohort::all_reduce_values(pg, counts, cohort::op::min) == counts);
  // launch_plan compares the ranks' global batch through the same helper.
  std::ostringstream summary;
  CHECK(cohort::launch_plan(cohort::global_batch{.size = 64, .accumulation = 4}, pg, summary).per_device == 16);
  CHECK(summary.str() ==
        "cohort: per-device batch 16 x accumulation 4 x world 1 = effective batch 64 (from global "
        "batch 64)\n");
  cohort::main_printf(pg, "nccl: mean loss %.2f\n", cohort::all_reduce_value(pg, 0.5f, cohort::op::avg));
}

TEST_CASE("two ranks on one GPU are refused before NCCL sees them", "[nccl]") {
  require_gpu();
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(2);
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::nccl::options opts;
    opts.device = 0;  // both ranks on GPU 0
    opts.timeout = std::chrono::seconds(5);
    try {
      cohort::process_group<cohort::nccl> pg(store, cohort::launch_env::explicit_ranks(rank, 2), opts);
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (const auto& text : messages) {
    INFO(text);
    REQUIRE_THAT(text, Catch::Contains("ranks 0 and 1") && Catch::Contains("LOCAL_RANK"));
  }
}

namespace {
// Spins until the host sets *release: work queued behind it on a stream cannot start.
__global__ void spin_until(volatile int* release) {
  while (*release == 0) {}
}
}  // namespace

TEST_CASE("the watchdog bounds work nobody waits for, records it, and the next call throws", "[nccl][watchdog]") {
  require_gpu();
  cohort::nccl::options opts;
  opts.timeout = std::chrono::seconds(1);
  opts.watchdog_interval = std::chrono::milliseconds(50);
  opts.on_async_error = cohort::async_error_handling::throw_on_next_call;
  cohort::process_group<cohort::nccl> pg(std::make_shared<cohort::memory_store>(),
                                         cohort::launch_env::explicit_ranks(0, 1), opts);
  device_buffer<float> data(1024);
  pg.all_reduce(data.span()).wait();  // one that completes
  // Released however the case ends: a failed REQUIRE below must not leave the kernel spinning,
  // or every later cudaFree (the buffers', the communicator's abort) would wait for it forever.
  struct spinning_kernel {
    int* release = nullptr;
    cudaStream_t stream = nullptr;
    spinning_kernel() {
      check(cudaHostAlloc(&release, sizeof(int), cudaHostAllocMapped), "host_alloc");
      *release = 0;
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream_create");
      int* device_release = nullptr;
      check(cudaHostGetDevicePointer(&device_release, release, 0), "host_get_device_pointer");
      spin_until<<<1, 1, 0, stream>>>(device_release);
    }
    spinning_kernel(const spinning_kernel&) = delete;
    spinning_kernel& operator=(const spinning_kernel&) = delete;
    ~spinning_kernel() {
      if (release) *static_cast<volatile int*>(release) = 1;
      if (stream) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
      if (release) cudaFreeHost(release);
    }
  } spinning;
  cudaStream_t caller = spinning.stream;
  pg.backend().wait_for_caller(caller);
  auto stuck = pg.all_reduce(data.span());  // behind the spinning kernel: never waited for
  (void)stuck;
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const auto calls = pg.backend().recorder().snapshot();
  REQUIRE(calls.size() == 2);
  CHECK(calls[0].state == cohort::call_state::completed);
  CHECK(calls[1].sequence == 2);
  CHECK(calls[1].state == cohort::call_state::failed);
  try {
    pg.all_reduce(data.span());
    FAIL("a call on a group the watchdog aborted was accepted");
  } catch (const cohort::timeout_error& failure) {
    CHECK_THAT(failure.what(), Catch::Contains("all_reduce #2 (float x 1024, sum)") &&
                                   Catch::Contains("the watchdog aborted the communicator"));
  }
}
