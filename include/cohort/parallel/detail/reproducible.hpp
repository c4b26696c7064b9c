#pragma once
// training_state's reproducible mode (training_options::reproducible, docs/design.md
// "Reproducible training"): the pieces that do not depend on the state's template arguments,
// compiled once (impl/reproducible.ipp) rather than in every trainer's instantiation.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "cohort/config.hpp"

namespace cohort::inline v0::detail {

// Why `micro_batches` over `ranks` ranks (the group's size times its replicas') cannot give the
// bits of one rank, or empty: each rank must hold a run of 2^j micro-batches (M divisible by
// the ranks, M / ranks a power of two), unless one rank sums them all; with replicas the
// group's ranks must be a power of two too (the group's partial is one node of the tree).
COHORT_DECL std::string reproducible_refusal(std::size_t micro_batches, std::size_t group_size, std::size_t replicas);

// Every rank's micro-steps this step (one entry per rank), against the rule's `expected`:
// empty when all match, else the refusal naming each rank that differs.
COHORT_DECL std::string micro_step_disagreement(std::span<const std::int64_t> micro_steps, std::size_t expected,
                                                std::size_t micro_batches);

// The global norm from every rank's exact fixed-point sum of squares, {high, low} pairs (a
// rank's elements e add floor((e / max)^2 x 2^64) split into its high and low 32 bits), summed
// in 128 bits: max x sqrt(total / 2^64), the same whatever cut the ranks' shares.
COHORT_DECL double fixed_point_norm(std::span<const std::uint64_t> high_low_pairs, double max);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/reproducible.ipp"
#endif
