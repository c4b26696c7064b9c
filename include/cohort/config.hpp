#pragma once
// How cohort is built: the only macros that decide it, each documented here once.
//
//   COHORT_SEPARATE_COMPILATION  defined for the whole program: cohort's non-template code is
//       compiled once, by the one translation unit that includes <cohort/src.hpp> (and, with
//       NCCL, the device code once, by the one .cu that includes <cohort/src.cu>). Undefined
//       (the default), cohort is header-only: nothing to build or link. CMake:
//       cohort_add_compiled_library(name) builds those units (src.hpp as its four parts,
//       impl/src_*.hpp, one unit each) and defines the macro for whatever links the library
//       (cmake/cohortCompiled.cmake).
//   COHORT_DECL  on every declaration of a function compiled in src.hpp or src.cu, and on its
//       definition in a subsystem's impl/*.ipp: `inline` header-only, nothing when separately
//       compiled. A reader of a header sees on the declaration that its body lives elsewhere.
//   COHORT_HAS_NCCL  the program links NCCL and the CUDA runtime (the cohort::nccl target
//       defines it): the umbrella header brings the NCCL backend, src.hpp compiles it.
//   COHORT_INSTANTIATIONS(KEYWORD, B)  the one list of templates compiled once per engine B
//       when separately compiled (process_group, training_state and the checkpoint functions
//       over float and bfloat16; cohort/detail/compiled_specializations.hpp): defined in
//       src.hpp, declared `extern` in the program's units that define COHORT_TEMPLATE_BODIES.
//   COHORT_TEMPLATE_BODIES  separately compiled, a translation unit that uses a specialization
//       outside that list (training_state<gloo, double>, <nccl, half>, a backend of its own)
//       defines it before including cohort: it then parses and instantiates process_group's,
//       training_state's and the checkpoint's out-of-class bodies (impl/*.hpp) itself, as
//       header-only. Without it such a unit does not compile (a static_assert in
//       training_state, or process_group for a backend of its own, names the macro);
//       units using the list's specializations only never see those bodies. Header-only it
//       changes nothing.
//
//   COHORT_COLD  on the declaration of a function compiled in src.hpp that a unit of the
//       umbrella need not call (the checkpoint's files and index, the Gloo engine, the failure
//       reports, the straggler report, the launched half of run_ranks and connect_store):
//       `template <class = void>` header-only, nothing when separately compiled;
//       COHORT_COLD_BODY on its definition in impl/*.ipp (`template <class>`, and nothing).
//       Header-only, an inline body is analysed in every unit that includes it, and every
//       template it uses (containers' members, shared_ptr's, string building, Gloo's) is
//       instantiated there, called or not; a function template's body is only parsed until a
//       unit calls it (g++ and clang both defer). Callers write `f(x)` as before, and
//       `&f` where the target type is known (a member pointer); a second declaration of the
//       function, or `auto p = &f`, does not compile header-only. Virtual functions and
//       destructors cannot be cold, and what a non-template body calls is instantiated where
//       that body is: a cold chain starts at a constructor or a free function. Compiled once,
//       nothing changes: src.hpp compiles plain functions.
//       COHORT_COLD is cold for the compiler (few units call it), not at run time, so it does
//       not imply [[gnu::cold]]. That attribute is written by hand, on the declaration, for
//       what runs only when something fails or on one launcher's branch (failure reports, the
//       launched end of run_ranks, the launchers' readers, the store server's refusals): g++
//       compiles such a function for size and inlines little into it, the cheaper for every
//       unit that compiles it. Never on a function that a caller reaches on every path (a
//       constructor, connect_store, launch_env::detect): g++ then takes the caller as cold as
//       well, up to the trainer's own function and its loop
//       (header:compiled_library_places_failure_paths_cold).
//
// Gloo needs no macro: wherever <gloo/context.h> is found (__has_include), the umbrella header
// brings the Gloo backend and src.hpp compiles it; link cohort::gloo (or -lgloo).
//
// Where code lives, in every subsystem folder (rendezvous/, comm/, parallel/, ...): the
// public header declares; templates' bodies are in the header or its impl/*.hpp, included
// header-only (and, separately compiled, for process_group, training_state and the
// checkpoint, only by src.hpp and units defining COHORT_TEMPLATE_BODIES); plain code is in
// impl/*.ipp, which the header includes only when header-only.

#if defined(COHORT_SEPARATE_COMPILATION)
#define COHORT_DECL
#else
#define COHORT_DECL inline
#endif

#if defined(COHORT_SEPARATE_COMPILATION)
#define COHORT_COLD
#define COHORT_COLD_BODY
#else
#define COHORT_COLD template <class = void>
#define COHORT_COLD_BODY template <class>
#endif
