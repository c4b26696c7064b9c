#pragma once
// The class templates a trainer uses most, compiled once per engine when the program is
// separately compiled (cohort/config.hpp): this list is declared `extern` in every
// translation unit that includes the umbrella header, and defined by cohort/src.hpp. Other
// specializations are instantiated where they are used, as header-only.
//
// GCC and Clang still instantiate the inline member functions of an extern specialization
// where they would inline them, so only part of the work moves; the rest is cheap to parse.

#include "cohort/comm/process_group.hpp"
#include "cohort/config.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/types.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/comm/nccl.hpp"
#endif

// KEYWORD: `extern` for the program's translation units, empty in cohort/src.hpp.
#define COHORT_INSTANTIATIONS(KEYWORD, B)          \
  KEYWORD template class process_group<B>;         \
  KEYWORD template class training_state<B, float>; \
  KEYWORD template class training_state<B, bfloat16>;

#if defined(COHORT_SEPARATE_COMPILATION)
namespace cohort::inline v0 {
#if __has_include(<gloo/context.h>)
COHORT_INSTANTIATIONS(extern, gloo)
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
COHORT_INSTANTIATIONS(extern, nccl)
#endif
}  // namespace cohort::inline v0
#endif
