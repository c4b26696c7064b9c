#pragma once
// What the training-state and checkpoint tests share: a Gloo group with a short timeout.
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/rendezvous/store.hpp>

#include <chrono>
#include <memory>

namespace cohort_test {

using gloo_group = cohort::process_group<cohort::gloo>;

inline gloo_group make_gloo_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(5);
  return gloo_group(store, cohort::launch_env::explicit_ranks(rank, world), options);
}

}  // namespace cohort_test
