#pragma once
// cohort/comm/detail/device_identity.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <cctype>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cohort/comm/detail/device_identity.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"

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
  return detail::text("ranks ", std::to_string(duplicate.first_rank), " and ", std::to_string(duplicate.second_rank),
                      " both drive the GPU at PCI ", bus, " on host ", host);
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

COHORT_DECL std::string describe_device_counts(int local_rank, int local_world_size, int visible,
                                               const char* cuda_visible_devices) {
  return detail::text("local rank ", std::to_string(local_rank), " of ", std::to_string(local_world_size), " sees ",
                      std::to_string(visible), " GPU(s)",
                      (cuda_visible_devices ? detail::text(" (CUDA_VISIBLE_DEVICES=", cuda_visible_devices, ")")
                                            : std::string(" (CUDA_VISIBLE_DEVICES unset)")));
}

COHORT_DECL device_choice choose_device(int requested, int local_rank, int visible, const char* cuda_visible_devices) {
  const std::string seen =
      cuda_visible_devices ? detail::text(" (CUDA_VISIBLE_DEVICES=", cuda_visible_devices, ")") : std::string();
  if (visible <= 0)
    return {-1, detail::text("no GPU is visible to this process", seen),
            "check nvidia-smi, the driver, and that CUDA_VISIBLE_DEVICES names a GPU of this node"};
  if (requested >= 0) {
    if (requested < visible) return {requested, {}, {}};
    return {-1,
            detail::text("options.device ", std::to_string(requested), " but only ", std::to_string(visible),
                         " GPU(s) visible", seen),
            "device indices count the visible GPUs from 0; leave options.device at -1 to pick by LOCAL_RANK"};
  }
  if (local_rank < 0)
    return {-1, detail::text("local rank ", std::to_string(local_rank), " is negative"),
            "LOCAL_RANK (or the launcher's equivalent) must be 0 or more"};
  return {local_rank % visible, {}, {}};
}

}  // namespace cohort::inline v0::detail
