#pragma once
// A part of cohort/src.hpp: the process groups' plain code, the engines' (where they are
// available, as in the umbrella header) and run_ranks'.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/impl/src_comm.hpp, a part of cohort/src.hpp, needs COHORT_SEPARATE_COMPILATION everywhere"
#endif
#include "cohort/comm/impl/device_identity.ipp"
#include "cohort/comm/impl/failure_report.ipp"
#include "cohort/comm/impl/flight_recorder.ipp"
#include "cohort/comm/impl/host_address.ipp"
#include "cohort/comm/impl/host_elementwise.ipp"
#include "cohort/config.hpp"
#include "cohort/impl/error.ipp"
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
