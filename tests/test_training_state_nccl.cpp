// training_state on NCCL with one rank on one GPU: the device path of the same template
// (gathers into cudaMalloc'd pooled buffers ordered with a caller stream, the gradient and
// optimizer kernels, a checkpoint of device state, the parameter fingerprint's copies). Skipped without a GPU. A plain
// C++ file: the kernels come compiled from cohort_compiled (cohort::nccl, compiled once), as a trainer's .cpp would use
// them.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <cohort/comm/nccl.hpp>
#include <cohort/parallel/checkpoint.hpp>
#include <cohort/parallel/fingerprint.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/store.hpp>

#include "fingerprint_fixtures.hpp"
#include "support.hpp"

#if !defined(COHORT_SEPARATE_COMPILATION) || defined(__CUDACC__)
#error "test_training_state_nccl.cpp is the plain C++ test of the kernels cohort_compiled compiled"
#endif

namespace {

using group = cohort::process_group<cohort::nccl>;
using cohort::strategy;

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    cohort_test::skip("no CUDA device on this machine: the device training_state tests need a GPU");
}

group make_group() {
  cohort::nccl::options opts;
  opts.timeout = std::chrono::seconds(20);
  return group(std::make_shared<cohort::memory_store>(), cohort::launch_env::explicit_ranks(0, 1), opts);
}

template <class E>
std::vector<E> download(std::span<E> device) {
  std::vector<E> host(device.size());
  REQUIRE(cudaMemcpy(host.data(), device.data(), device.size() * sizeof(E), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

// Sizes that pad (5, 3, 1), a larger layer, and a bias left undecayed.
const std::vector<cohort::region> regions{
    {"a.w", 0, 5, 0}, {"a.b", 5, 3, 0, false}, {"one", 8, 1, 1}, {"c.w", 9, 300, 2}, {"c.b", 309, 20, 2, false}};
constexpr std::size_t elements = 329;

float original(std::size_t i) { return static_cast<float>(i % 50) * 0.25f - 3.0f; }
// The first n originals as E (bfloat16: rounded from the fp32 value).
template <class E>
std::vector<E> originals(std::size_t n) {
  std::vector<E> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = E(original(i));
  return out;
}

}  // namespace

TEST_CASE("device gathers return the original parameters, in fp32 and bfloat16, under ddp and zero3",
          "[training_state][nccl]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const auto full = originals<float>(elements);
  const auto rounded = originals<cohort::bfloat16>(elements);
  for (const strategy kind : {strategy::ddp, strategy::zero3}) {
    INFO(cohort::to_string(kind));
    cohort::training_state<cohort::nccl> fp32(pg, regions, {.strategy = kind, .bucket_bytes = 64});
    cohort::training_state<cohort::nccl, cohort::bfloat16, float> bf16(pg, regions, {.strategy = kind});
    fp32.set_stream(stream);
    bf16.set_stream(stream);
    fp32.load_parameters(full);  // host sources: the backend's copy reads any memory
    bf16.load_parameters(rounded);
    for (std::size_t l = 0; l < fp32.layer_count(); ++l) {
      auto a = fp32.gather(l);
      auto b = bf16.gather(l);
      for (std::size_t r = 0; r < regions.size(); ++r) {
        if (regions[r].layer != l) continue;
        REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
        const auto got = download(a.param(r));
        const auto got16 = download(b.param(r));
        for (std::size_t i = 0; i < got.size(); ++i) {
          REQUIRE(got[i] == full[regions[r].offset + i]);
          REQUIRE(got16[i] == rounded[regions[r].offset + i]);
        }
      }
    }
    CHECK(fp32.gather_parameters() == full);
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("device gradients, SGD and AdamW match the formulas computed on the host, and a checkpoint round-trips",
          "[training_state][nccl]") {
  require_gpu();
  auto pg = make_group();
  std::vector<float> full(elements);
  for (std::size_t i = 0; i < elements; ++i) full[i] = original(i);
  for (const strategy kind : {strategy::ddp, strategy::zero3})
    for (const bool sgd : {true, false}) {
      INFO(cohort::to_string(kind) << (sgd ? ", sgd" : ", adamw"));
      cohort::training_options options{.strategy = kind, .bucket_bytes = 256};
      if (sgd)
        options.sgd = cohort::sgd_options{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01};
      else
        options.adam = {.lr = 0.01, .weight_decay = 0.01};
      cohort::training_state<cohort::nccl> state(pg, regions, options);
      state.load_parameters(full);
      std::vector<double> expected(full.begin(), full.end()), m(elements), v(elements);
      for (int step = 1; step <= 2; ++step) {
        cohort::training_state<cohort::nccl>::layer_view view;
        for (std::size_t r = regions.size(); r-- > 0;) {
          // The layer's view lives while its regions' gradients are written (both of them).
          if (r + 1 == regions.size() || regions[r + 1].layer != regions[r].layer)
            view = state.gather(regions[r].layer);
          std::vector<float> host(regions[r].count);
          for (std::size_t i = 0; i < host.size(); ++i)
            host[i] = std::sin(0.1f * static_cast<float>(regions[r].offset + i) + static_cast<float>(step));
          const auto gradient = state.gradient(r);
          REQUIRE(cudaMemcpy(gradient.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) ==
                  cudaSuccess);
          state.mark_ready(r);
          const double decay = regions[r].decay ? 0.01 : 0.0;
          for (std::size_t i = 0; i < host.size(); ++i) {
            const std::size_t j = regions[r].offset + i;
            const double g = host[i];
            if (sgd) {
              m[j] = 0.9 * m[j] + g + decay * expected[j];
              expected[j] -= 0.1 * m[j];
            } else {
              m[j] = 0.9 * m[j] + 0.1 * g;
              v[j] = 0.999 * v[j] + 0.001 * g * g;
              const double mh = m[j] / (1 - std::pow(0.9, step)), vh = v[j] / (1 - std::pow(0.999, step));
              expected[j] -= 0.01 * (mh / (std::sqrt(vh) + 1e-8) + decay * expected[j]);
            }
          }
        }
        view.reset();
        const auto result = state.step();
        REQUIRE_FALSE(result.skipped);
      }
      const auto got = state.gather_parameters();
      double worst = 0;
      for (std::size_t i = 0; i < elements; ++i) worst = std::max(worst, std::abs(double(got[i]) - expected[i]));
      CHECK(worst <= 1e-4);
      const auto directory = std::filesystem::temp_directory_path() /
                             ("cohort-test-training-state-nccl-" + std::string(cohort::to_string(kind)));
      std::filesystem::remove_all(directory);
      const auto saved = cohort::save_checkpoint(state, directory.string(), 2);
      cohort::training_state<cohort::nccl> loaded(pg, regions, options);
      cohort::load_checkpoint(loaded, saved.path);
      CHECK(loaded.gather_parameters() == got);
      CHECK(loaded.steps() == state.steps());
      std::filesystem::remove_all(directory);
    }
}

// The trainer's own cudaMalloc'd buffers, adopted: its pointers are the state's under ddp,
// zero1 and zero2 (the step updates its parameter buffer in place), zero3 reads them through
// views; with the trainer's optimizer, owned_spans() point into its buffers.
TEST_CASE("adopted device buffers are updated in place, and the trainer's optimizer gets spans of them",
          "[training_state][nccl][adopted]") {
  require_gpu();
  auto pg = make_group();
  std::vector<float> full(elements), g(elements);
  for (std::size_t i = 0; i < elements; ++i) {
    full[i] = original(i);
    g[i] = std::cos(0.3f * static_cast<float>(i));
  }
  struct device_buffer {
    float* data = nullptr;
    explicit device_buffer(std::size_t n) { REQUIRE(cudaMalloc(&data, n * sizeof(float)) == cudaSuccess); }
    ~device_buffer() { cudaFree(data); }
  };
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const bool own : {false, true}) {
      INFO(cohort::to_string(kind) << (own ? ", the trainer's optimizer" : ", SGD at lr 1"));
      device_buffer params(elements), grads(elements);
      REQUIRE(cudaMemcpy(params.data, full.data(), elements * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(grads.data, g.data(), elements * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
      cohort::training_state<cohort::nccl> state(
          pg, std::span(params.data, elements), std::span(grads.data, elements), regions,
          {.strategy = kind, .bucket_bytes = 256, .sgd = cohort::sgd_options{.lr = 1}, .trainer_optimizer = own});
      for (std::size_t l = state.layer_count(); l-- > 0;) {
        auto view = state.gather(l);
        for (std::size_t r = 0; r < regions.size(); ++r) {
          if (regions[r].layer != l) continue;
          CHECK(state.gradient(r).data() == grads.data + regions[r].offset);
          CHECK(view.param(r).data() == params.data + regions[r].offset);  // zero3: gathered there
        }
        state.mark_layer_ready(l);
      }
      const auto result = state.step();
      REQUIRE_FALSE(result.skipped);
      if (own) {
        for (const auto& span : state.owned_spans()) {
          CHECK(span.gradients.data() == grads.data + span.offset);
          CHECK(span.parameters.data() == params.data + span.offset);
          // The trainer's update, p -= g, as its own kernel would do it.
          std::vector<float> p(span.parameters.size()), d(p.size());
          REQUIRE(cudaMemcpy(p.data(), span.parameters.data(), p.size() * sizeof(float), cudaMemcpyDeviceToHost) ==
                  cudaSuccess);
          REQUIRE(cudaMemcpy(d.data(), span.gradients.data(), d.size() * sizeof(float), cudaMemcpyDeviceToHost) ==
                  cudaSuccess);
          for (std::size_t i = 0; i < p.size(); ++i) p[i] -= d[i];
          REQUIRE(cudaMemcpy(span.parameters.data(), p.data(), p.size() * sizeof(float), cudaMemcpyHostToDevice) ==
                  cudaSuccess);
        }
        state.publish_parameters();
      }
      std::vector<float> expected(elements);
      for (std::size_t i = 0; i < elements; ++i) expected[i] = full[i] - g[i];
      CHECK(state.gather_parameters() == expected);
      if (kind != strategy::zero3) CHECK(download(std::span(params.data, elements)) == expected);
      CHECK(state.copied_bytes_per_step() == 0);
    }
}

TEST_CASE("the fingerprint of device parameters is the host definition's, in fp32 and bfloat16, under ddp and zero3",
          "[training_state][nccl][fingerprint]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  // A region of two 1 MiB chunks' worth (300,007 floats) beside the small ones: chunks copied
  // to the host one by one.
  auto model = regions;
  model.push_back({"embedding", elements, 300007, 3});
  const std::size_t n = elements + 300007;
  const auto full = originals<float>(n);
  const auto rounded = originals<cohort::bfloat16>(n);
  for (const strategy kind : {strategy::ddp, strategy::zero3}) {
    INFO(cohort::to_string(kind));
    cohort::training_state<cohort::nccl> fp32(pg, model, {.strategy = kind, .bucket_bytes = 1 << 16});
    cohort::training_state<cohort::nccl, cohort::bfloat16, float> bf16(pg, model, {.strategy = kind});
    fp32.set_stream(stream);
    bf16.set_stream(stream);
    fp32.load_parameters(full);
    bf16.load_parameters(rounded);
    CHECK(cohort::parameter_sha256(fp32) == cohort_test::expected_parameter_sha256(full, model));
    CHECK(cohort::parameter_sha256(bf16) == cohort_test::expected_parameter_sha256(rounded, model));
  }
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}
