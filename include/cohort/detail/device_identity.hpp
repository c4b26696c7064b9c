#pragma once
// Which GPU each rank drives, published through the store before NCCL initialises, so
// that two ranks on one GPU fail with a message naming both ranks and the fix instead of
// NCCL's "Duplicate GPU detected". Pure logic, tested without a GPU.

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cohort::inline v0::detail {

// identity: "<host>|<PCI bus id>" per rank, indexed by rank.
struct duplicate_device {
  int first_rank;
  int second_rank;
  std::string identity;
};

std::optional<duplicate_device> find_duplicate_device(const std::vector<std::string>& identities);

std::string describe_duplicate(const duplicate_device& duplicate);

const char* duplicate_device_hint();

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/detail/config.hpp"
#include "cohort/impl/device_identity.ipp"
#endif
