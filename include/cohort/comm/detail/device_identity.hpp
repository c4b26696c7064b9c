#pragma once
// Which GPU each rank drives, published through the store before NCCL initialises, so
// that two ranks on one GPU fail with a message naming both ranks and the fix instead of
// NCCL's "Duplicate GPU detected". Pure logic, tested without a GPU.

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cohort/config.hpp"

namespace cohort::inline v0::detail {

// identity: "<host>|<PCI bus id>" per rank, indexed by rank.
struct duplicate_device {
  int first_rank;
  int second_rank;
  std::string identity;
};

COHORT_DECL std::optional<duplicate_device> find_duplicate_device(const std::vector<std::string>& identities);

COHORT_DECL std::string describe_duplicate(const duplicate_device& duplicate);

COHORT_DECL const char* duplicate_device_hint();

// Whether an identity read from the store is one cohort writes: a host name (printable, no
// '|'), '|', and a PCI bus id as cudaDeviceGetPCIBusId prints it (domain:bus:device.function,
// in hex). Anything else was written by someone else and is refused before it is compared.
COHORT_DECL bool well_formed_device_identity(std::string_view identity);

// The device index a rank drives among the `visible` devices its process sees. `requested`
// (options.device) wins when set (>= 0); otherwise local_rank % visible: all GPUs visible, local
// rank r drives GPU r; a launcher that gives each process its own GPU through
// CUDA_VISIBLE_DEVICES leaves one visible, so every local rank drives its device 0. Where the
// counts disagree (more local ranks than GPUs) two ranks meet on one GPU, and the duplicate
// check names them with describe_device_counts. An empty `error` means `device` is good.
struct device_choice {
  int device = -1;
  std::string error;
  std::string hint;
};
COHORT_DECL device_choice choose_device(int requested, int local_rank, int visible, const char* cuda_visible_devices);

// "local rank 3 of 4 sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1)": what a duplicate or a bad
// choice is explained by.
COHORT_DECL std::string describe_device_counts(int local_rank, int local_world_size, int visible,
                                               const char* cuda_visible_devices);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/device_identity.ipp"
#endif
