#pragma once
// The umbrella header: everything a trainer uses. Backends come in when their engine is
// available: Gloo when its headers are found, NCCL when the cohort::nccl target defines
// COHORT_HAS_NCCL=1 (it needs CUDA and NCCL to link). cohort/config.hpp says how it is built.
// The tools' headers (cohort/tools/: the planner, the topology probe, their JSON) are not
// included: a trainer does not pay for them; cohort-bench and cohort-plan include them.

#include "cohort/comm/host_values.hpp"
#include "cohort/comm/ops.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/config.hpp"
#include "cohort/data/batch.hpp"
#include "cohort/data/metrics.hpp"
#include "cohort/data/sampler.hpp"
#include "cohort/diagnostics/straggler.hpp"
#include "cohort/diagnostics/timeline.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/canonical_order.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/parallel/fingerprint.hpp"
#include "cohort/parallel/layout.hpp"
#include "cohort/parallel/loss_scaler.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/rendezvous/file_store.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"
#include "cohort/run/atomic_write.hpp"
#include "cohort/run/guards.hpp"
#include "cohort/run/logging.hpp"
#include "cohort/run/run_ranks.hpp"
#include "cohort/types.hpp"
#include "cohort/version.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/comm/nccl.hpp"
#endif

// Separately compiled, the library has instantiated the algorithms on each engine once.
#if defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/detail/instantiations.hpp"
#endif
