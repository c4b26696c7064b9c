#pragma once
// How cohort's non-template code is compiled.
//
// Header-only (the default): every definition is inline in the headers, and each
// translation unit that uses one compiles it. Nothing to build or link.
//
// Separate compilation: define COHORT_SEPARATE_COMPILATION for the whole program; the
// headers then only declare cohort's non-template code (launch detection, the stores, the
// engines' backends, the guards' file writing, ...) and exactly one translation unit
// includes <cohort/impl/src.hpp>, which defines it once. Templates stay in the headers, but
// that unit also instantiates the algorithms' class templates a trainer uses most on each
// engine (cohort/detail/instantiations.hpp), which the umbrella header then declares extern.
// A trainer of many translation units then compiles that code once instead of in each.
// CMake: cohort_add_compiled_library(name) (cmake/cohortCompiled.cmake) builds that unit.
//
// COHORT_DECL marks those definitions (in cohort/impl/*.ipp): inline when header-only.
//
// Separate device code: COHORT_SEPARATE_DEVICE_CODE as well (cohort_add_compiled_library
// defines it when the project has CUDA enabled and cohort::nccl exists). The library then also
// compiles, with nvcc, the element-wise kernels of the device backend and their launchers
// (cohort/impl/device_src.cuh), and instantiates the algorithms' class templates on NCCL as
// it does on Gloo (cohort/detail/instantiations.hpp). A translation unit then sees the
// launchers' declarations only: it instantiates no kernel, and any C++ compiler can compile
// algorithms on NCCL; without it, each .cu file that uses them compiles the kernels itself.

#if defined(COHORT_SEPARATE_COMPILATION)
#define COHORT_DECL
#else
#define COHORT_DECL inline
#endif

// COHORT_COLD marks what runs only once something has failed (error reports, flight-recorder
// traces, naming the culprit): the compiler optimises it for size and lays it out of the hot
// paths' way. Header-only, every translation unit that reaches it compiles it, so that also
// saves compile time.
#if defined(__GNUC__) || defined(__clang__)
#define COHORT_COLD [[gnu::cold]]
#else
#define COHORT_COLD
#endif

#if defined(COHORT_SEPARATE_DEVICE_CODE)
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "COHORT_SEPARATE_DEVICE_CODE is a kind of separate compilation: define COHORT_SEPARATE_COMPILATION too"
#endif
#define COHORT_DEVICE_DECL
#else
#define COHORT_DEVICE_DECL inline
#endif

// Which engines this program has: Gloo when its headers are found (or COHORT_HAS_GLOO=1 is
// given), NCCL when the cohort::nccl target defines COHORT_HAS_NCCL=1 (it needs CUDA and NCCL
// to link). The umbrella header and cohort/impl/src.hpp bring in the backends they name.
#if !defined(COHORT_HAS_GLOO) && __has_include(<gloo/context.h>)
#define COHORT_HAS_GLOO 1
#endif
