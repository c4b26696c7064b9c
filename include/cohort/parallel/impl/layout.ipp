#pragma once
// cohort/parallel/layout.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/parallel/layout.hpp"

namespace cohort::inline v0 {

COHORT_DECL std::vector<region> stacked_regions(const std::vector<stacked_tensor>& tensors, std::size_t layers,
                                                std::size_t first_layer, std::size_t offset) {
  std::vector<region> out;
  out.reserve(tensors.size() * layers);
  for (const auto& tensor : tensors)
    for (std::size_t l = 0; l < layers; ++l) {
      out.push_back({detail::text(tensor.name, ".", std::to_string(first_layer + l)), offset, tensor.per_layer,
                     first_layer + l, tensor.decay, 1.0, tensor.shape});
      offset += tensor.per_layer;
    }
  return out;
}

namespace detail {
namespace {
std::string describe_region(const std::vector<region>& regions, std::size_t i) {
  const auto& r = regions[i];
  return detail::text("region ", std::to_string(i), (r.name.empty() ? std::string() : detail::text(" '", r.name, "'")),
                      " (elements ", std::to_string(r.offset), "..", std::to_string(r.offset + r.count), ")");
}
std::size_t round_up(std::size_t value, std::size_t multiple) { return (value + multiple - 1) / multiple * multiple; }
}  // namespace

COHORT_DECL std::string check_regions(const std::vector<region>& regions) {
  if (regions.empty()) return "no regions: describe the model's tensors as regions of its flat buffer";
  std::set<std::string> names;
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].count == 0) return detail::text(describe_region(regions, i), " is empty");
    if (!regions[i].name.empty() && !names.insert(regions[i].name).second)
      return detail::text(describe_region(regions, i), " repeats the name '", regions[i].name, "'");
    if (!(regions[i].lr_scale >= 0))
      return detail::text(describe_region(regions, i), " has a negative or NaN lr_scale");
    if (const auto& shape = regions[i].shape; !shape.empty()) {
      std::size_t product = 1;
      std::string dims;
      for (const std::size_t d : shape) {
        product = d != 0 && product > SIZE_MAX / d ? 0 : product * d;  // 0: overflowed (or a 0 dimension)
        dims += detail::text((dims.empty() ? "" : ", "), std::to_string(d));
      }
      if (product != regions[i].count)
        return detail::text(
            describe_region(regions, i), " has shape [", dims, "], which holds ",
            (product == 0 && std::find(shape.begin(), shape.end(), 0) == shape.end() ? std::string("more than 2^64")
                                                                                     : std::to_string(product)),
            " elements, not its count ", std::to_string(regions[i].count));
    }
  }
  std::vector<std::size_t> order(regions.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return regions[a].offset != regions[b].offset ? regions[a].offset < regions[b].offset : a < b;
  });
  // Gaps are refused as firmly as overlaps: elements of the trainer's buffer that no region
  // covers would never be reduced, and their gradients would drift apart across ranks.
  std::size_t covered = 0;
  std::string gaps;
  std::size_t gap_count = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const auto& r = regions[order[k]];
    if (r.offset < covered)
      return detail::text(describe_region(regions, order[k]), " overlaps ", describe_region(regions, order[k - 1]),
                          ": each element belongs to one region");
    if (r.offset > covered && gap_count++ < 4)
      gaps += detail::text((gaps.empty() ? "" : ", "), std::to_string(covered), "..", std::to_string(r.offset));
    covered = r.offset + r.count;
  }
  if (gap_count > 0)
    return detail::text(
        "elements ", gaps,
        (gap_count > 4 ? detail::text(" (and ", std::to_string(gap_count - 4), " more ranges)") : ""),
        " of the flat buffer belong to no region: their gradients would never be reduced and would drift "
        "apart across ranks");
  return {};
}

COHORT_DECL storage_layout plan_storage(const std::vector<region>& regions, int world, std::size_t bucket_elements,
                                        bool merge_layers, std::size_t alignment) {
  storage_layout layout;
  layout.regions.resize(regions.size());
  for (const auto& r : regions) {
    layout.logical = std::max(layout.logical, r.offset + r.count);
    layout.layers = std::max(layout.layers, r.layer + 1);
  }
  const std::size_t n = static_cast<std::size_t>(std::max(world, 1));
  bucket_elements = std::max<std::size_t>(bucket_elements, 1);
  // Layer by layer; inside a layer, declaration order.
  layout.regions_of_layer.assign(layout.layers, {});
  for (std::size_t i = 0; i < regions.size(); ++i) layout.regions_of_layer[regions[i].layer].push_back(i);
  const auto& by_layer = layout.regions_of_layer;

  bucket_range open;
  std::size_t open_content = 0;  // aligned elements placed in `open`
  bool has_open = false;
  const auto close = [&] {
    if (!has_open) return;
    open.padded = round_up(std::max<std::size_t>(open_content, 1), n * alignment);
    open.shard = open.padded / n;
    layout.storage = open.begin + open.padded;
    layout.buckets.push_back(std::move(open));
    open = bucket_range{};
    open_content = 0;
    has_open = false;
  };
  layout.first_bucket_of_layer.assign(layout.layers + 1, 0);
  for (std::size_t l = 0; l < layout.layers; ++l) {
    if (!merge_layers) close();
    // A layer that starts inside a merged bucket shares it; otherwise its first bucket is next.
    layout.first_bucket_of_layer[l] = layout.buckets.size();
    for (const std::size_t i : by_layer[l]) {
      const std::size_t size = round_up(regions[i].count, alignment);
      if (has_open && open_content + size > bucket_elements) close();
      if (!has_open) {
        open.begin = layout.storage;
        open.layer = l;
        has_open = true;
      }
      layout.regions[i] = {open.begin + open_content, regions[i].count, layout.buckets.size()};
      open.regions.push_back(i);
      open_content += size;
      if (open_content >= bucket_elements) close();
    }
  }
  close();
  layout.first_bucket_of_layer[layout.layers] = layout.buckets.size();
  // With merging a bucket may hold several layers: a layer's buckets are those holding its
  // regions, from the first to the last.
  for (std::size_t l = 0; l < layout.layers; ++l)
    if (!by_layer[l].empty()) layout.first_bucket_of_layer[l] = layout.regions[by_layer[l].front()].bucket;
  return layout;
}

COHORT_DECL std::vector<shard_segment> owned_segments(const storage_layout& layout, int rank, bool sharded) {
  std::vector<shard_segment> out;
  std::size_t owned = 0;
  for (const auto& bucket : layout.buckets) {
    const std::size_t first = sharded ? bucket.begin + static_cast<std::size_t>(rank) * bucket.shard : bucket.begin;
    const std::size_t last = sharded ? first + bucket.shard : bucket.begin + bucket.padded;
    for (const std::size_t i : bucket.regions) {
      const auto& placed = layout.regions[i];
      const std::size_t low = std::max(first, placed.storage);
      const std::size_t high = std::min(last, placed.storage + placed.count);
      if (low < high) out.push_back({low, owned + (low - first), high - low, i});
    }
    owned += last - first;
  }
  return out;
}

COHORT_DECL std::vector<shard_segment> merged_for_update(const std::vector<shard_segment>& segments,
                                                         const std::vector<region>& regions) {
  std::vector<shard_segment> out;
  for (const auto& s : segments) {
    if (!out.empty()) {
      auto& last = out.back();
      const region& a = regions[last.region];
      const region& b = regions[s.region];
      const std::size_t storage_end = last.storage + last.count, owned_end = last.owned + last.count;
      if (a.decay == b.decay && a.lr_scale == b.lr_scale && s.storage >= storage_end && s.owned >= owned_end &&
          s.storage - storage_end == s.owned - owned_end) {
        last.count = s.storage + s.count - last.storage;
        continue;
      }
    }
    out.push_back(s);
  }
  return out;
}

COHORT_DECL std::int64_t layout_fingerprint(const std::vector<region>& regions, std::size_t bucket_elements,
                                            int strategy, int parameter_type, int gradient_type) {
  fnv1a hash;
  hash.mix(bucket_elements);
  hash.mix(static_cast<std::uint64_t>(strategy));
  hash.mix(static_cast<std::uint64_t>(parameter_type));
  hash.mix(static_cast<std::uint64_t>(gradient_type));
  for (const auto& r : regions) {
    hash.mix(r.offset);
    hash.mix(r.count);
    hash.mix(r.layer);
  }
  return static_cast<std::int64_t>(hash.value() & 0x7fffffffffffffffull);
}

}  // namespace detail
}  // namespace cohort::inline v0
