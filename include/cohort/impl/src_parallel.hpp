#pragma once
// A part of cohort/src.hpp: the training state's plain code (checkpoints, layouts,
// fingerprints, reproducible sums), the data pipeline and the diagnostics.
#if !defined(COHORT_SEPARATE_COMPILATION)
#error "cohort/impl/src_parallel.hpp, a part of cohort/src.hpp, needs COHORT_SEPARATE_COMPILATION everywhere"
#endif
#include "cohort/config.hpp"
#include "cohort/data/impl/batch.ipp"
#include "cohort/data/impl/metrics.ipp"
#include "cohort/data/impl/sampler.ipp"
#include "cohort/diagnostics/impl/straggler.ipp"
#include "cohort/diagnostics/impl/timeline.ipp"
#include "cohort/parallel/impl/checkpoint.ipp"
#include "cohort/parallel/impl/fingerprint.ipp"
#include "cohort/parallel/impl/layout.ipp"
#include "cohort/parallel/impl/reproducible.ipp"
