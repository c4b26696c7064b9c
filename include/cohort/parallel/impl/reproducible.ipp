#pragma once
// cohort/parallel/detail/reproducible.hpp's definitions: inline there when header-only, compiled
// once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "cohort/config.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/parallel/detail/reproducible.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL std::string reproducible_refusal(std::size_t micro_batches, std::size_t group_size, std::size_t replicas) {
  const std::size_t ranks = group_size * replicas;
  if (micro_batches == 0)
    return "reproducible: 0 micro-batches: set reproducible_options::micro_batches to M, the micro-batches of one "
           "global step";
  if (replicas > 1 && !std::has_single_bit(group_size))
    return text("reproducible: a group of ", std::to_string(group_size), " ranks with ", std::to_string(replicas),
                " replicas: with replicas the group's size must be a power of two (its partial sum is one node of "
                "the tree over the micro-batches)");
  if (ranks == 1 || (micro_batches % ranks == 0 && std::has_single_bit(micro_batches / ranks))) return {};
  return text("reproducible: ", std::to_string(micro_batches), " micro-batches over ", std::to_string(ranks),
              " ranks: each rank needs a run of 2^j of them (M divisible by the world, M / world a power of two), "
              "or one rank");
}

COHORT_DECL std::string micro_step_disagreement(std::span<const std::int64_t> micro_steps, std::size_t expected,
                                                std::size_t micro_batches) {
  std::string differing;
  for (std::size_t r = 0; r < micro_steps.size(); ++r)
    if (micro_steps[r] != static_cast<std::int64_t>(expected))
      differing +=
          text(differing.empty() ? "" : ", ", "rank ", std::to_string(r), " ran ", std::to_string(micro_steps[r]));
  if (differing.empty()) return {};
  return text("reproducible: ", differing, " micro-steps this step where every rank must run ",
              std::to_string(expected), " (", std::to_string(micro_batches), " micro-batches over ",
              std::to_string(micro_steps.size()), " ranks, each holding a run of M / world of them)");
}

COHORT_DECL double fixed_point_norm(std::span<const std::uint64_t> high_low_pairs, double max) {
  unsigned __int128 total = 0;
  for (std::size_t i = 0; i + 1 < high_low_pairs.size(); i += 2)
    total += (static_cast<unsigned __int128>(high_low_pairs[i]) << 32) + high_low_pairs[i + 1];
  return max * square_root(static_cast<double>(total) / 18446744073709551616.0);  // 2^64
}

}  // namespace cohort::inline v0::detail
