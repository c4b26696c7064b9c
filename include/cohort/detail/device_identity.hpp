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

inline std::optional<duplicate_device> find_duplicate_device(const std::vector<std::string>& identities) {
  for (std::size_t a = 0; a < identities.size(); ++a)
    for (std::size_t b = a + 1; b < identities.size(); ++b)
      if (identities[a] == identities[b])
        return duplicate_device{static_cast<int>(a), static_cast<int>(b), identities[a]};
  return std::nullopt;
}

inline std::string describe_duplicate(const duplicate_device& duplicate) {
  const auto bar = duplicate.identity.find('|');
  const std::string host = duplicate.identity.substr(0, bar);
  const std::string bus = bar == std::string::npos ? std::string() : duplicate.identity.substr(bar + 1);
  return "ranks " + std::to_string(duplicate.first_rank) + " and " + std::to_string(duplicate.second_rank) +
         " both drive the GPU at PCI " + bus + " on host " + host;
}

inline const char* duplicate_device_hint() {
  return "NCCL allows one rank per GPU: let cohort pick the device from LOCAL_RANK (the default, "
         "options.device = -1), and do not give every process the same CUDA_VISIBLE_DEVICES; "
         "launch at most as many ranks per node as GPUs";
}

}  // namespace cohort::inline v0::detail
