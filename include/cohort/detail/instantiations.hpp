#pragma once
// The templates a trainer uses most, compiled once per engine when the program is separately
// compiled (cohort/config.hpp): this list (cohort/detail/compiled_specializations.hpp) is
// declared `extern` in every translation unit that includes the umbrella header, and defined
// by cohort/src.hpp. Such a unit does not parse training_state's and the checkpoint's
// out-of-class bodies at all; one that uses another specialization defines
// COHORT_TEMPLATE_BODIES and instantiates it where it is used, as header-only.
//
// GCC and Clang still instantiate the inline member functions of an extern specialization
// where they would inline them: those are in the class bodies, cheap to parse.

#include "cohort/comm/process_group.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/compiled_specializations.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/types.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
#include "cohort/comm/nccl.hpp"
#endif

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
