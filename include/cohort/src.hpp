#pragma once
// The one translation unit of a program built with COHORT_SEPARATE_COMPILATION (see
// cohort/config.hpp) includes this header: it defines cohort's non-template code once.
// The backends' parts come in when their engine is available, as in the umbrella header.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/src.hpp is for programs built with COHORT_SEPARATE_COMPILATION defined everywhere"
#endif

#include "cohort/comm/impl/device_identity.ipp"
#include "cohort/comm/impl/failure_report.ipp"
#include "cohort/comm/impl/flight_recorder.ipp"
#include "cohort/comm/impl/host_address.ipp"
#include "cohort/comm/impl/host_elementwise.ipp"
#include "cohort/config.hpp"
#include "cohort/data/impl/batch.ipp"
#include "cohort/data/impl/metrics.ipp"
#include "cohort/data/impl/sampler.ipp"
#include "cohort/diagnostics/impl/straggler.ipp"
#include "cohort/diagnostics/impl/timeline.ipp"
#include "cohort/impl/error.ipp"
#include "cohort/impl/files.ipp"
#include "cohort/impl/sha256.ipp"
#include "cohort/parallel/impl/checkpoint.ipp"
#include "cohort/parallel/impl/fingerprint.ipp"
#include "cohort/parallel/impl/layout.ipp"
#include "cohort/parallel/impl/reproducible.ipp"
#include "cohort/rendezvous/impl/file_store.ipp"
#include "cohort/rendezvous/impl/hmac.ipp"
#include "cohort/rendezvous/impl/launch.ipp"
#include "cohort/rendezvous/impl/store.ipp"
#include "cohort/rendezvous/impl/tcp_socket.ipp"
#include "cohort/rendezvous/impl/tcp_store.ipp"
#include "cohort/rendezvous/impl/tcp_store_protocol.ipp"
#include "cohort/rendezvous/impl/tcp_store_server.ipp"
#include "cohort/run/impl/atomic_write.ipp"
#include "cohort/run/impl/logging.ipp"
#include "cohort/run/impl/run_ranks.ipp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/impl/gloo.ipp"
#include "cohort/comm/impl/shared_memory_channel.ipp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/comm/impl/nccl.ipp"
#endif

// The list of cohort/detail/instantiations.hpp, defined here once for the program (every other
// translation unit declares it extern). On NCCL the kernels they launch are compiled by the
// program's one .cu that includes cohort/src.cu.
#include "cohort/comm/impl/process_group.hpp"
#include "cohort/detail/instantiations.hpp"
#include "cohort/parallel/impl/checkpoint.hpp"
#include "cohort/parallel/impl/training_state.hpp"
namespace cohort::inline v0 {
#if __has_include(<gloo/context.h>)
COHORT_INSTANTIATIONS(, gloo)
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
COHORT_INSTANTIATIONS(, nccl)
#endif
}  // namespace cohort::inline v0
