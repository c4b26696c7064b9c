#pragma once
// The umbrella header: everything a trainer uses. Backends come in when their engine is
// available: Gloo when its headers are found (or COHORT_HAS_GLOO=1), NCCL when the
// cohort::nccl target defines COHORT_HAS_NCCL=1 (it needs CUDA and NCCL to link).
// The tools' headers (cohort/tools/: the planner, the topology probe, their JSON) are not
// included: a trainer does not pay for them; cohort-bench and cohort-plan include them.

#include "cohort/batch.hpp"
#include "cohort/detail/config.hpp"
#include "cohort/error.hpp"
#include "cohort/file_store.hpp"
#include "cohort/guards.hpp"
#include "cohort/launch.hpp"
#include "cohort/loss_scaler.hpp"
#include "cohort/metrics.hpp"
#include "cohort/ops.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/parallel/layout.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/process_group.hpp"
#include "cohort/run_ranks.hpp"
#include "cohort/sampler.hpp"
#include "cohort/store.hpp"
#include "cohort/straggler.hpp"
#include "cohort/tcp_store.hpp"
#include "cohort/types.hpp"
#include "cohort/version.hpp"

#if defined(COHORT_HAS_GLOO) && COHORT_HAS_GLOO
#include "cohort/backend/gloo.hpp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/backend/nccl.hpp"
#endif

// Separately compiled, the library has instantiated the algorithms on each engine once.
#if defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/detail/instantiations.hpp"
#endif
