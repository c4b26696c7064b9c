#pragma once
// What the flat-buffer tests share (test_flat_reducer, test_clip): a Gloo group
// with a short timeout, and a model laid out as llm.c lays out its parameters.
#include <cohort/backend/gloo.hpp>
#include <cohort/process_group.hpp>
#include <cohort/reducer.hpp>
#include <cohort/store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace cohort_test {

using gloo_group = cohort::process_group<cohort::gloo>;

inline gloo_group make_gloo_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(5);
  return gloo_group(store, cohort::launch_env::explicit_ranks(rank, world), options);
}

// [embedding | a_0 .. a_{L-1} | b_0 .. b_{L-1}]: tensor-major, each tensor stacked over the
// layers. Regions in forward order: embedding, then per layer a_l, b_l. Only the a tensors
// (the "matrices") decay.
struct stacked_model {
  std::size_t embedding = 7, a = 5, b = 3, layers = 4;
  std::size_t elements() const { return embedding + layers * (a + b); }
  std::vector<cohort::gradient_region> regions() const {
    std::vector<cohort::gradient_region> list{{0, embedding}};
    for (std::size_t l = 0; l < layers; ++l) {
      list.push_back({embedding + l * a, a});
      list.push_back({embedding + layers * a + l * b, b});
    }
    return list;
  }
  std::vector<std::uint8_t> decay() const {
    std::vector<std::uint8_t> flags{0};
    for (std::size_t l = 0; l < layers; ++l) {
      flags.push_back(1);
      flags.push_back(0);
    }
    return flags;
  }
};

}  // namespace cohort_test
