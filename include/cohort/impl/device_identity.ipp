#pragma once
// cohort/detail/device_identity.hpp's definitions: inline there when header-only, compiled once by
// <cohort/impl/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <cctype>
#include <optional>
#include <string>
#include <string_view>
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

COHORT_DECL bool well_formed_device_identity(std::string_view identity) {
  const auto bar = identity.find('|');
  if (bar == 0 || bar == std::string_view::npos || bar > 255) return false;
  for (const unsigned char c : identity.substr(0, bar))
    if (c < 0x21 || c > 0x7e) return false;
  // domain (4 to 8 hex digits) ':' bus (2) ':' device (2) '.' function (1)
  const std::string_view bus = identity.substr(bar + 1);
  const auto first = bus.find(':');
  if (first < 4 || first > 8 || bus.size() != first + 8) return false;
  for (std::size_t i = 0; i < bus.size(); ++i) {
    const char c = bus[i];
    const bool separator = i == first || i == first + 3 || i == first + 6;
    if (separator ? c != (i == first + 6 ? '.' : ':') : !std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace cohort::inline v0::detail
