#pragma once
// The algorithms' class templates a trainer uses most, instantiated once per engine in the
// program's cohort library (cohort/impl/src.hpp) and declared extern by the umbrella header
// under COHORT_SEPARATE_COMPILATION: a trainer's translation units then compile none of their
// out-of-line work. Other specializations are instantiated where they are used, as before. On
// NCCL this needs COHORT_SEPARATE_DEVICE_CODE (the library compiled the kernels they launch).
//
// GCC and Clang still instantiate the inline member functions of an extern specialization
// where they would inline them, so only part of the work moves; the rest is cheap to parse.

#include "cohort/parallel/training_state.hpp"
#include "cohort/process_group.hpp"
#include "cohort/types.hpp"

#if defined(COHORT_HAS_GLOO) && COHORT_HAS_GLOO
#include "cohort/backend/gloo.hpp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/backend/nccl.hpp"
#endif

// KEYWORD: `extern` for the declarations, empty for the one definition.
#define COHORT_ALGORITHM_INSTANTIATIONS(KEYWORD, B) \
  KEYWORD template class process_group<B>;          \
  KEYWORD template class training_state<B, float>;  \
  KEYWORD template class training_state<B, bfloat16>;

#if defined(COHORT_HAS_GLOO) && COHORT_HAS_GLOO
#define COHORT_INSTANTIATES_GLOO 1
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL && defined(COHORT_SEPARATE_DEVICE_CODE)
#define COHORT_INSTANTIATES_NCCL 1
#endif

#if !defined(COHORT_INSTANTIATIONS_DEFINED_HERE)
namespace cohort::inline v0 {
#if defined(COHORT_INSTANTIATES_GLOO)
COHORT_ALGORITHM_INSTANTIATIONS(extern, gloo)
#endif
#if defined(COHORT_INSTANTIATES_NCCL)
COHORT_ALGORITHM_INSTANTIATIONS(extern, nccl)
#endif
}  // namespace cohort::inline v0
#endif
