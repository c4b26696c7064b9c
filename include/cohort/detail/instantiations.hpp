#pragma once
// The templates a trainer uses most, compiled once per engine when the program is separately
// compiled (cohort/config.hpp): this list (cohort/detail/compiled_specializations.hpp) is
// defined by cohort/src.hpp. A unit that includes the umbrella header does not parse
// process_group's, training_state's and the checkpoint's out-of-class bodies at all; one that
// uses another specialization defines COHORT_TEMPLATE_BODIES and instantiates it where it is
// used, as header-only, with this list declared extern.
//
// GCC and Clang still instantiate the inline member functions of a specialization where they
// would inline them: those are in the class bodies, cheap to parse.

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

// Declared extern only where the unit sees the bodies (COHORT_TEMPLATE_BODIES), so that it does
// not compile the library's specializations again. A unit without them cannot instantiate a
// body anyway (its calls reach the library's), and the declarations would make it instantiate
// every listed class, ten with two engines, mostly ones it never names.
#if defined(COHORT_SEPARATE_COMPILATION) && defined(COHORT_TEMPLATE_BODIES)
namespace cohort::inline v0 {
#if __has_include(<gloo/context.h>)
COHORT_INSTANTIATIONS(extern, gloo)
#endif
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
COHORT_INSTANTIATIONS(extern, nccl)
#endif
}  // namespace cohort::inline v0
#endif
