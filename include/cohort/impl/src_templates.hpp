#pragma once
// A part of cohort/src.hpp: the list of cohort/detail/instantiations.hpp, defined here once
// for the program (every other translation unit declares it extern). On NCCL the kernels they
// launch are compiled by the program's one .cu that includes cohort/src.cu.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/impl/src_templates.hpp, a part of cohort/src.hpp, needs COHORT_SEPARATE_COMPILATION everywhere"
#endif
#include "cohort/comm/impl/process_group.hpp"
#include "cohort/config.hpp"
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
