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
