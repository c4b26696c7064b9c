#pragma once
// The one translation unit of a program built with COHORT_SEPARATE_COMPILATION (see
// cohort/config.hpp) includes this header: it defines cohort's non-template code once.
// The backends' parts come in when their engine is available, as in the umbrella header.
// It is four parts, each of which may be a unit of its own instead (as
// cohort_add_compiled_library compiles them, side by side on a machine's cores); a program
// compiles each part once, in one unit or in four.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/src.hpp is for programs built with COHORT_SEPARATE_COMPILATION defined everywhere"
#endif

#include "cohort/impl/src_comm.hpp"
#include "cohort/impl/src_parallel.hpp"
#include "cohort/impl/src_rendezvous.hpp"
#include "cohort/impl/src_templates.hpp"
