#pragma once
// cohort/reducer.hpp's definitions: inline there when header-only, compiled once by <cohort/impl/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>
#include "cohort/detail/fnv1a.hpp"
#include "cohort/error.hpp"
#include "cohort/ops.hpp"
#include "cohort/process_group.hpp"
#include "cohort/types.hpp"

#include "cohort/detail/config.hpp"
#include "cohort/reducer.hpp"

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL std::size_t aligned_elements(std::size_t elements, dtype type) {
  const std::size_t per_word = std::max<std::size_t>(1, 16 / size_of(type));
  return (elements + per_word - 1) / per_word * per_word;
}

}  // namespace detail
}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_DECL std::vector<bucket_layout> assign_buckets(std::span<const std::size_t> sizes, std::span<const dtype> types,
                                                      bucket_caps caps, std::span<const std::size_t> order) {
  const std::size_t n = sizes.size();
  if (types.size() != n)
    throw error(-1, "assign_buckets", std::to_string(n) + " sizes but " + std::to_string(types.size()) + " dtypes",
                "pass one dtype per gradient");
  if (caps.first_bucket_bytes == 0 || caps.bucket_bytes == 0)
    throw error(-1, "assign_buckets", "a bucket cap of 0 bytes", "caps must be positive");
  std::vector<std::size_t> walk;
  if (order.empty()) {
    walk.resize(n);
    for (std::size_t i = 0; i < n; ++i) walk[i] = n - 1 - i;
  } else {
    walk.assign(order.begin(), order.end());
    std::vector<bool> seen(n, false);
    if (walk.size() != n)
      throw error(-1, "assign_buckets",
                  "order lists " + std::to_string(walk.size()) + " gradients of " + std::to_string(n),
                  "the order must be a permutation of 0 .. n-1");
    for (auto index : walk) {
      if (index >= n || seen[index])
        throw error(-1, "assign_buckets", "order is not a permutation (index " + std::to_string(index) + ")",
                    "list every gradient exactly once");
      seen[index] = true;
    }
  }
  struct open_bucket {
    bucket_layout layout;
    std::size_t first_position = 0;
    std::size_t closed = 0;  // buckets of this dtype closed so far
  };
  struct finished {
    bucket_layout layout;
    std::size_t first_position;
  };
  std::vector<open_bucket> open;  // one per dtype seen, small
  std::vector<finished> done;
  auto open_for = [&](dtype type) -> open_bucket& {
    for (auto& bucket : open)
      if (bucket.layout.type == type) return bucket;
    open.push_back({});
    open.back().layout.type = type;
    return open.back();
  };
  auto close = [&](open_bucket& bucket) {
    if (bucket.layout.gradients.empty()) return;
    done.push_back({std::move(bucket.layout), bucket.first_position});
    bucket.layout = bucket_layout{};
    bucket.layout.type = done.back().layout.type;
    ++bucket.closed;
  };
  for (std::size_t position = 0; position < n; ++position) {
    const std::size_t index = walk[position];
    const dtype type = types[index];
    open_bucket& bucket = open_for(type);
    const std::size_t padded = detail::aligned_elements(sizes[index], type);
    auto cap = [&] { return bucket.closed == 0 ? caps.first_bucket_bytes : caps.bucket_bytes; };
    if (!bucket.layout.gradients.empty() && (bucket.layout.elements + padded) * size_of(type) > cap()) close(bucket);
    if (bucket.layout.gradients.empty()) bucket.first_position = position;
    bucket.layout.gradients.push_back(index);
    bucket.layout.offsets.push_back(bucket.layout.elements);
    bucket.layout.elements += padded;
    if (bucket.layout.bytes() >= cap()) close(bucket);
  }
  for (auto& bucket : open) close(bucket);
  std::stable_sort(done.begin(), done.end(),
                   [](const finished& a, const finished& b) { return a.first_position < b.first_position; });
  std::vector<bucket_layout> result;
  result.reserve(done.size());
  for (auto& bucket : done) result.push_back(std::move(bucket.layout));
  return result;
}

}  // namespace cohort::inline v0

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL std::string describe_gradient(std::size_t index, std::size_t count, dtype type) {
  return "gradient " + std::to_string(index) + " (" + std::to_string(count) + " x " + std::string(to_string(type)) +
         ")";
}

}  // namespace detail
}  // namespace cohort::inline v0

namespace cohort::inline v0::detail {

COHORT_DECL std::vector<std::int64_t> layout_check::row(bool refused, std::span<const gradient_spec> specs,
                                                        std::span<const bucket_layout> layout, compression compress,
                                                        bool in_place, std::span<const std::size_t> run_counts,
                                                        std::size_t buckets) {
  fnv1a hash;
  std::size_t elements = 0;
  if (!refused) {
    for (const auto& spec : specs) {
      hash.mix(spec.count);
      hash.mix(static_cast<std::uint64_t>(spec.type));
      elements += spec.count;
    }
    for (const auto& bucket : layout) {
      hash.mix(static_cast<std::uint64_t>(bucket.type));
      hash.mix(bucket.elements);
      for (std::size_t k = 0; k < bucket.gradients.size(); ++k) {
        hash.mix(bucket.gradients[k]);
        hash.mix(bucket.offsets[k]);
      }
    }
    hash.mix(static_cast<std::uint64_t>(compress));
    // In place, each run is a collective of its own: the runs must match across ranks too
    // (a gradient adjacent to the next on one rank but not on another would pair an
    // all-reduce of one size with one of another).
    hash.mix(in_place);
    for (const auto count : run_counts) hash.mix(count);
  }
  std::vector<std::int64_t> mine(layout_columns);
  mine[refused_column] = refused ? 1 : 0;
  mine[fingerprint_column] = static_cast<std::int64_t>(hash.value() & 0x7fffffffffffffffull);
  mine[gradients_column] = static_cast<std::int64_t>(specs.size());
  mine[elements_column] = static_cast<std::int64_t>(elements);
  mine[buckets_column] = static_cast<std::int64_t>(buckets);
  return mine;
}

COHORT_DECL int layout_check::first_mismatch(std::span<const std::int64_t> all, int world, int rank,
                                             const std::exception_ptr& refusal) {
  const auto cell = [&](int r, std::size_t c) { return all[static_cast<std::size_t>(r) * layout_columns + c]; };
  for (int r = 0; r < world; ++r) {
    if (cell(r, refused_column) == 0) continue;
    if (refusal) std::rethrow_exception(refusal);  // this rank's own reason
    throw error(rank, "gradient_reducer",
                "rank " + std::to_string(r) + " refused its gradients, so no rank builds a reducer",
                "rank " + std::to_string(r) + "'s own error names the cause");
  }
  // Every rank sees the same table, so every rank names the same pair: rank 0 and the
  // first rank that differs from it.
  const auto differs = [&](int r) {
    for (auto c : {fingerprint_column, gradients_column, elements_column, buckets_column})
      if (cell(r, c) != cell(0, c)) return true;
    return false;
  };
  int other = 1;
  while (other < world && !differs(other)) ++other;
  return std::min(other, world);
}

COHORT_DECL bool layout_check::same_gradient_count(std::span<const std::int64_t> all, int world) {
  for (int r = 1; r < world; ++r)
    if (all[static_cast<std::size_t>(r) * layout_columns + gradients_column] != all[gradients_column]) return false;
  return true;
}

COHORT_DECL std::vector<std::int64_t> layout_check::shapes(std::span<const gradient_spec> specs) {
  std::vector<std::int64_t> shapes;
  shapes.reserve(2 * specs.size());
  for (const auto& spec : specs) {
    shapes.push_back(static_cast<std::int64_t>(spec.count));
    shapes.push_back(static_cast<std::int64_t>(spec.type));
  }
  return shapes;
}

COHORT_DECL void layout_check::fail(int rank, std::span<const std::int64_t> all, int world, int other,
                                    std::size_t gradients, std::span<const std::int64_t> shapes_of_all) {
  const auto cell = [&](int r, std::size_t c) { return all[static_cast<std::size_t>(r) * layout_columns + c]; };
  auto describe = [&](int r) {
    return "rank " + std::to_string(r) + " has " + std::to_string(cell(r, gradients_column)) + " gradients of " +
           std::to_string(cell(r, elements_column)) + " elements in " + std::to_string(cell(r, buckets_column)) +
           " buckets";
  };
  const std::string detail = "bucket layouts differ across ranks: " + describe(0) + "; " + describe(other);
  std::string named;
  if (!shapes_of_all.empty()) {
    const auto shape = [&](int r, std::size_t i) {
      const std::size_t at = (static_cast<std::size_t>(r) * gradients + i) * 2;
      return std::to_string(shapes_of_all[at]) + " x " +
             std::string(to_string(static_cast<dtype>(shapes_of_all[at + 1])));
    };
    for (std::size_t i = 0; i < gradients && named.empty(); ++i)
      for (int r = 1; r < world && named.empty(); ++r)
        if (shape(r, i) != shape(0, i))
          named = ": gradient " + std::to_string(i) + " is " + shape(0, i) + " on rank 0 but " + shape(r, i) +
                  " on rank " + std::to_string(r);
  }
  throw error(rank, "gradient_reducer",
              detail + (named.empty() ? " (sizes, dtypes, caps or compression differ)" : named),
              "build the reducer from the same model on every rank, with the same options");
}

}  // namespace cohort::inline v0::detail
