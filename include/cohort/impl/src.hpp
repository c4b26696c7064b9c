#pragma once
// The one translation unit of a program built with COHORT_SEPARATE_COMPILATION (see
// cohort/detail/config.hpp) includes this header: it defines cohort's non-template code once.
// The backends' parts come in when their engine is available, as in the umbrella header.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/impl/src.hpp is for programs built with COHORT_SEPARATE_COMPILATION defined everywhere"
#endif

#include "cohort/detail/config.hpp"
#include "cohort/impl/batch.ipp"
#include "cohort/impl/device_identity.ipp"
#include "cohort/impl/file_store.ipp"
#include "cohort/impl/flight_recorder.ipp"
#include "cohort/impl/guards.ipp"
#include "cohort/impl/host_address.ipp"
#include "cohort/impl/host_elementwise.ipp"
#include "cohort/impl/launch.ipp"
#include "cohort/impl/metrics.ipp"
#include "cohort/impl/run_ranks.ipp"
#include "cohort/impl/sampler.ipp"
#include "cohort/impl/sha256.ipp"
#include "cohort/impl/store.ipp"
#include "cohort/impl/straggler.ipp"
#include "cohort/impl/tcp_socket.ipp"
#include "cohort/impl/tcp_store.ipp"
#include "cohort/impl/tcp_store_protocol.ipp"
#include "cohort/impl/tcp_store_server.ipp"
#include "cohort/parallel/impl/checkpoint.ipp"
#include "cohort/parallel/impl/layout.ipp"

#if defined(COHORT_HAS_GLOO) && COHORT_HAS_GLOO
#include "cohort/impl/gloo.ipp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/impl/nccl.ipp"
#endif

// The algorithms' class templates on each engine, once for the program (the umbrella header
// declares them extern). On NCCL they launch kernels the library's .cu compiles
// (COHORT_SEPARATE_DEVICE_CODE, cohort/impl/device_src.cuh).
#define COHORT_INSTANTIATIONS_DEFINED_HERE 1
#include "cohort/cohort.hpp"
namespace cohort::inline v0 {
#if defined(COHORT_INSTANTIATES_GLOO)
COHORT_ALGORITHM_INSTANTIATIONS(, gloo)
#endif
#if defined(COHORT_INSTANTIATES_NCCL)
COHORT_ALGORITHM_INSTANTIATIONS(, nccl)
#endif
}  // namespace cohort::inline v0
