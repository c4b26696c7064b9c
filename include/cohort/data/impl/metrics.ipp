#pragma once
// cohort/data/metrics.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/data/metrics.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

COHORT_DECL process_slice split_between_processes(std::uint64_t range_size, int world, int rank, bool pad) {
  if (world < 1)
    throw error(rank, detail::text("split_between_processes(", std::to_string(range_size), " elements)"),
                detail::text("world size must be at least 1, got ", std::to_string(world)),
                "pass the process group's size()");
  if (rank < 0 || rank >= world)
    throw error(rank, detail::text("split_between_processes(", std::to_string(range_size), " elements)"),
                detail::text("rank ", std::to_string(rank), " is outside [0, ", std::to_string(world), ")"),
                "pass the process group's rank(), not its local rank");
  const auto w = static_cast<std::uint64_t>(world);
  const auto r = static_cast<std::uint64_t>(rank);
  const std::uint64_t base = range_size / w;
  const std::uint64_t remainder = range_size % w;
  process_slice slice;
  slice.range_size = range_size;
  slice.begin = r * base + std::min(r, remainder);
  slice.end = slice.begin + base + (r < remainder ? 1 : 0);
  const std::uint64_t longest = base + (remainder != 0 ? 1 : 0);
  slice.padded_size = pad ? longest : slice.size();
  slice.padded = slice.padded_size > slice.size();
  // A padded slice is short only when the range is not empty, so end - 1 is an element of it:
  // the slice's last one, or for an empty slice (begin = end = range_size) the range's last.
  slice.repeated = slice.padded ? slice.end - 1 : 0;
  return slice;
}

namespace detail {

COHORT_DECL void check_metrics_claims(int my_rank, std::vector<metrics_claim>& claims, std::size_t value_bytes,
                                      metrics_layout layout) {
  const std::size_t world = claims.size();
  const std::string operation = detail::text("gather_for_metrics(values of ", std::to_string(value_bytes),
                                             " bytes, world ", std::to_string(world), ")");
  auto counts = [&] {
    std::string text;
    for (std::size_t r = 0; r < world; ++r) {
      if (r != 0) text += ", ";
      text += detail::text("rank ", std::to_string(r), ": ", std::to_string(claims[r].count));
    }
    return text;
  };
  const auto s = [](std::int64_t value) { return std::to_string(value); };

  // A rank's own input first: the lowest rank with a problem is named, the same on every rank.
  for (std::size_t r = 0; r < world; ++r) {
    const metrics_claim& c = claims[r];
    const std::string who = detail::text("rank ", std::to_string(r));
    switch (static_cast<metrics_problem>(c.problem)) {
      case metrics_problem::none: break;
      case metrics_problem::count_differs_from_sampler:
        throw error(my_rank, operation,
                    detail::text(who, " passed ", s(c.count), " values, but its sampler gave it ", s(c.expected),
                                 " indices this epoch (", s(c.or_else), " real, ", s(c.expected - c.or_else),
                                 " padding); counts passed: ", counts()),
                    "pass one value per index the sampler yielded on that rank, padding included (gather_for_metrics "
                    "drops it), or only its unpadded_size() real ones; every rank learned this in the same "
                    "collective, so none is left waiting");
      case metrics_problem::count_differs_from_slice:
        throw error(my_rank, operation,
                    detail::text(who, " passed ", s(c.count), " values, but its slice holds ", s(c.expected),
                                 " elements (", s(c.or_else), " with padding); counts passed: ", counts()),
                    "pass one value per element of the rank's process_slice, padded or not; every rank learned "
                    "this in the same collective, so none is left waiting");
      case metrics_problem::sampler_of_another_group:
        throw error(my_rank, operation,
                    detail::text(who, "'s sampler was built for rank ", s(c.or_else), " of a world of ", s(c.expected),
                                 ", not for that rank of this group's world of ", std::to_string(world)),
                    "build the sampler from the same group: distributed_sampler{n, pg, options}");
      case metrics_problem::sampler_of_micro_batches:
        throw error(my_rank, operation,
                    detail::text(who, "'s sampler is in micro-batch mode (", s(c.expected),
                                 " micro-batches per step): its ranks read runs of the epoch, which this gather does "
                                 "not place"),
                    "evaluate with a sampler without micro_batches: distributed_sampler{n, pg, {.shuffle = ...}}");
      case metrics_problem::too_many_values:
        throw error(my_rank, operation,
                    detail::text(who, " passed more values than a 64-bit count of bytes can hold (",
                                 std::to_string(std::numeric_limits<std::int64_t>::max() /
                                                static_cast<std::int64_t>(value_bytes)),
                                 " values of ", std::to_string(value_bytes), " bytes at most)"),
                    "gather a metric's per-sample values, not the data");
      default:
        throw error(my_rank, operation, detail::text(who, " reported an unknown problem code ", s(c.problem)),
                    "every rank must run the same version of cohort");
    }
  }

  const char* agreed_name = layout == metrics_layout::sampler_positions ? "dataset size"
                            : layout == metrics_layout::slices          ? "range size"
                                                                        : "total count";
  for (std::size_t r = 1; r < world; ++r)
    if (claims[r].agreed != claims[0].agreed)
      throw error(my_rank, operation,
                  detail::text("rank 0 passed a ", agreed_name, " of ", s(claims[0].agreed), " but rank ",
                               std::to_string(r), " passed ", s(claims[r].agreed)),
                  "every rank must describe the same dataset, with the same sampler or split");

  // The sizes on the wire: world chunks of the longest rank's values, and the result.
  std::uint64_t longest = 0;
  std::uint64_t total = 0;
  for (const auto& c : claims) {
    const auto keep = static_cast<std::uint64_t>(c.keep);
    longest = std::max(longest, keep);
    total += keep;  // each below 2^63 / value_bytes: the sum of a world of them fits in 64 bits
  }
  const std::uint64_t most = std::numeric_limits<std::size_t>::max();
  if (longest != 0 && (longest > most / value_bytes / world || total > most / value_bytes))
    throw error(my_rank, operation,
                detail::text("the gathered values would need ", std::to_string(world), " x ", std::to_string(longest),
                             " x ", std::to_string(value_bytes),
                             " bytes, more than this machine can address; counts passed: ", counts()),
                "gather a metric's per-sample values, not the data");

  if (layout == metrics_layout::sampler_positions) {
    // The real positions are 0 .. total - 1; rank r holds r, r + world, ... of them.
    for (std::size_t r = 0; r < world; ++r) {
      const std::uint64_t expected = total > r ? (total - r - 1) / world + 1 : 0;
      if (static_cast<std::uint64_t>(claims[r].keep) != expected ||
          total > static_cast<std::uint64_t>(claims[0].agreed))
        throw error(my_rank, operation,
                    detail::text("the ranks' samplers disagree: rank ", std::to_string(r), " holds ", s(claims[r].keep),
                                 " real values, but ", std::to_string(total), " real epoch positions give it ",
                                 std::to_string(expected), "; counts passed: ", counts()),
                    "build every rank's sampler with the same dataset size and options (drop_last, even_batches) "
                    "and set the same epoch");
    }
  } else if (layout == metrics_layout::slices) {
    std::uint64_t next = 0;
    for (std::size_t r = 0; r < world; ++r) {
      if (static_cast<std::uint64_t>(claims[r].start) != next)
        throw error(my_rank, operation,
                    detail::text("rank ", std::to_string(r), "'s slice starts at ", s(claims[r].start),
                                 ", but the slices before it end at ", std::to_string(next)),
                    "split the range with split_between_processes(n, pg) on every rank");
      next += static_cast<std::uint64_t>(claims[r].keep);
    }
    if (next != static_cast<std::uint64_t>(claims[0].agreed))
      throw error(
          my_rank, operation,
          detail::text("the slices cover ", std::to_string(next), " elements of a range of ", s(claims[0].agreed)),
          "split the range with split_between_processes(n, pg) on every rank");
  } else {
    std::uint64_t next = 0;
    for (auto& c : claims) {
      c.start = static_cast<std::int64_t>(next);
      next += static_cast<std::uint64_t>(c.keep);
    }
    if (next < static_cast<std::uint64_t>(claims[0].agreed))
      throw error(my_rank, operation,
                  detail::text("the ranks passed ", std::to_string(next), " values in all (", counts(),
                               "), fewer than the total count ", s(claims[0].agreed)),
                  "the total count is the dataset's true size: every real sample needs its value on some rank");
  }
}

}  // namespace detail
}  // namespace cohort::inline v0
