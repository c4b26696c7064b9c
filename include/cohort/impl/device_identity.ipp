#pragma once
// cohort/detail/device_identity.hpp's definitions: inline there when header-only, compiled once by
// <cohort/impl/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/detail/device_identity.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL std::optional<duplicate_device> find_duplicate_device(const std::vector<std::string>& identities) {
  for (std::size_t a = 0; a < identities.size(); ++a)
    for (std::size_t b = a + 1; b < identities.size(); ++b)
      if (identities[a] == identities[b])
        return duplicate_device{static_cast<int>(a), static_cast<int>(b), identities[a]};
  return std::nullopt;
}

COHORT_DECL std::string describe_duplicate(const duplicate_device& duplicate) {
  const auto bar = duplicate.identity.find('|');
  const std::string host = duplicate.identity.substr(0, bar);
  const std::string bus = bar == std::string::npos ? std::string() : duplicate.identity.substr(bar + 1);
  return "ranks " + std::to_string(duplicate.first_rank) + " and " + std::to_string(duplicate.second_rank) +
         " both drive the GPU at PCI " + bus + " on host " + host;
}

COHORT_DECL const char* duplicate_device_hint() {
  return "NCCL allows one rank per GPU: let cohort pick the device from LOCAL_RANK (the default, "
         "options.device = -1), and do not give every process the same CUDA_VISIBLE_DEVICES; "
         "launch at most as many ranks per node as GPUs";
}

}  // namespace cohort::inline v0::detail
