#pragma once
// What the training-state and checkpoint tests share: a Gloo group with a short timeout, and a
// small stacked model.
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/parallel/layout.hpp>
#include <cohort/rendezvous/store.hpp>

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

namespace cohort_test {

using gloo_group = cohort::process_group<cohort::gloo>;

inline gloo_group make_gloo_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(5);
  return gloo_group(store, cohort::launch_env::explicit_ranks(rank, world), options);
}

// [embedding | a_0 .. a_3 | b_0 .. b_3]: 39 elements, sizes no world of 2 to 6 divides evenly.
// Region 1 + l is a_l, 5 + l is b_l; the a tensors (the "matrices") decay, the embedding and
// the b tensors do not.
inline constexpr std::size_t stacked_embedding = 7, stacked_layers = 4;
inline std::vector<cohort::region> stacked_model() {
  std::vector<cohort::region> regions{{"embedding", 0, stacked_embedding, 0, false}};
  const auto stacked = cohort::stacked_regions({{"a", 5, true}, {"b", 3, false}}, stacked_layers, 1, stacked_embedding);
  regions.insert(regions.end(), stacked.begin(), stacked.end());
  return regions;
}
inline std::size_t element_count(const std::vector<cohort::region>& regions) {
  return regions.back().offset + regions.back().count;
}

}  // namespace cohort_test
