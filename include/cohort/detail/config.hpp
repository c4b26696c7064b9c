#pragma once
// How cohort's non-template code is compiled.
//
// Header-only (the default): every definition is inline in the headers, and each
// translation unit that uses one compiles it. Nothing to build or link.
//
// Separate compilation: define COHORT_SEPARATE_COMPILATION for the whole program; the
// headers then only declare cohort's non-template code (launch detection, the stores, the
// engines' backends, the guards' file writing, ...) and exactly one translation unit
// includes <cohort/impl/src.hpp>, which defines it once. Templates stay in the headers. A
// trainer of many translation units then compiles that code once instead of in each.
// CMake: cohort_add_compiled_library(name) (cmake/cohortCompiled.cmake) builds that unit.
//
// COHORT_DECL marks those definitions (in cohort/impl/*.ipp): inline when header-only.

#if defined(COHORT_SEPARATE_COMPILATION)
#define COHORT_DECL
#else
#define COHORT_DECL inline
#endif

// Which engines this program has: Gloo when its headers are found (or COHORT_HAS_GLOO=1 is
// given), NCCL when the cohort::nccl target defines COHORT_HAS_NCCL=1 (it needs CUDA and NCCL
// to link). The umbrella header and cohort/impl/src.hpp bring in the backends they name.
#if !defined(COHORT_HAS_GLOO) && __has_include(<gloo/context.h>)
#define COHORT_HAS_GLOO 1
#endif
