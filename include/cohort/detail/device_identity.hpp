#pragma once
// Which GPU each rank drives, published through the store before NCCL initialises, so
// that two ranks on one GPU fail with a message naming both ranks and the fix instead of
// NCCL's "Duplicate GPU detected". Pure logic, tested without a GPU.

#include <optional>
#include <string>
#include <string_view>
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

// Whether an identity read from the store is one cohort writes: a host name (printable, no
// '|'), '|', and a PCI bus id as cudaDeviceGetPCIBusId prints it (domain:bus:device.function,
// in hex). Anything else was written by someone else and is refused before it is compared.
bool well_formed_device_identity(std::string_view identity);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/detail/config.hpp"
#include "cohort/impl/device_identity.ipp"
#endif
