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
      out.push_back({detail::text(tensor.name, ".", std::to_string(l)), offset, tensor.per_layer, first_layer + l,
                     tensor.decay, 1.0, tensor.shape});
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
}  // namespace

COHORT_DECL std::string check_regions(const std::vector<region>& regions, std::size_t elements) {
  if (regions.empty()) return "no regions: describe the model's tensors as regions of its flat buffer";
  std::set<std::string> names;
  for (std::size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].count == 0) return detail::text(describe_region(regions, i), " is empty");
    if (!regions[i].name.empty() && !names.insert(regions[i].name).second)
      return detail::text(describe_region(regions, i), " repeats the name '", regions[i].name, "'");
    if (!(regions[i].lr_scale >= 0))
      return detail::text(describe_region(regions, i), " has a negative or NaN lr_scale");
    if (elements != 0 && regions[i].offset + regions[i].count > elements)
      return detail::text(describe_region(regions, i), " ends past the buffer's ", std::to_string(elements),
                          " elements");
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
  const auto gap = [&](std::size_t from, std::size_t to) {
    if (gap_count++ < 4)
      gaps += detail::text((gaps.empty() ? "" : ", "), std::to_string(from), "..", std::to_string(to));
  };
  for (std::size_t k = 0; k < order.size(); ++k) {
    const auto& r = regions[order[k]];
    if (r.offset < covered)
      return detail::text(describe_region(regions, order[k]), " overlaps ", describe_region(regions, order[k - 1]),
                          ": each element belongs to one region");
    if (r.offset > covered) gap(covered, r.offset);
    covered = r.offset + r.count;
  }
  const bool tail = elements > covered;
  if (tail) gap(covered, elements);
  if (gap_count > 0)
    return detail::text(
        "elements ", gaps,
        (gap_count > 4 ? detail::text(" (and ", std::to_string(gap_count - 4), " more ranges)") : ""), " of the ",
        std::to_string(tail || elements != 0 ? elements : covered),
        "-element flat buffer belong to no region: their gradients would never be reduced and would drift apart "
        "across ranks",
        (tail ? " (a tensor at the buffer's end left out of the regions?)" : ""));
  return {};
}

COHORT_DECL state_layout plan_layout(const std::vector<region>& regions, int world, std::size_t bucket_elements,
                                     bool merge_layers, std::size_t first_bucket_elements) {
  state_layout layout;
  layout.world = std::max(world, 1);
  layout.regions.resize(regions.size());
  for (const auto& r : regions) {
    layout.elements = std::max(layout.elements, r.offset + r.count);
    layout.layers = std::max(layout.layers, r.layer + 1);
  }
  const auto n = static_cast<std::size_t>(layout.world);
  bucket_elements = std::max<std::size_t>(bucket_elements, 1);
  first_bucket_elements =
      first_bucket_elements == 0 ? bucket_elements : std::min(first_bucket_elements, bucket_elements);
  layout.regions_of_layer.assign(layout.layers, {});
  for (std::size_t i = 0; i < regions.size(); ++i) layout.regions_of_layer[regions[i].layer].push_back(i);

  // Buckets fill layer by layer. Merged (ddp, zero1, zero2), in the backward's order: from the
  // last layer down, a layer's regions last to first, as DDP fills its buckets in reverse
  // parameter order, so that the bucket that launches first is the one that fills first and
  // only the last to launch holds what is left. A bucket takes whole layers while they fit,
  // closes once it holds its target (first_bucket_elements for the first to launch, so that
  // the reduction starts early in the backward; bucket_elements for the others) and never
  // grows past bucket_elements: a layer larger than that is cut between its regions, and a
  // region larger than that gets a bucket of its own. Layer by layer (zero3, which gathers
  // layer by layer): each layer's regions in declaration order, in buckets of its own.
  std::vector<bucket> planned;
  bucket open;
  std::size_t open_elements = 0;
  const auto close = [&] {
    if (open.regions.empty()) return;
    planned.push_back(std::move(open));
    open = bucket{};
    open_elements = 0;
  };
  const auto target = [&] { return merge_layers && planned.empty() ? first_bucket_elements : bucket_elements; };
  for (std::size_t k = 0; k < layout.layers; ++k) {
    const std::size_t l = merge_layers ? layout.layers - 1 - k : k;
    std::vector<std::size_t> in_layer = layout.regions_of_layer[l];
    if (merge_layers) std::reverse(in_layer.begin(), in_layer.end());
    std::size_t layer_elements = 0;
    for (const std::size_t i : in_layer) layer_elements += regions[i].count;
    if (!merge_layers || open_elements + layer_elements > bucket_elements) close();
    const bool whole = layer_elements <= bucket_elements;
    for (const std::size_t i : in_layer) {
      if (!whole && open_elements + regions[i].count > bucket_elements) close();
      open.layer = open.regions.empty() ? l : std::min(open.layer, l);
      open.regions.push_back(i);
      open_elements += regions[i].count;
      if (!whole && open_elements >= target()) close();
    }
    if (whole && open_elements >= target()) close();
  }
  close();
  if (merge_layers) std::reverse(planned.begin(), planned.end());  // buckets are numbered by layer, upward

  // Each bucket's regions in buffer order, joined into ranges where adjacent, each range cut
  // into chunks and a remainder; owned positions run on from bucket to bucket.
  for (auto& b : planned) {
    std::sort(b.regions.begin(), b.regions.end(),
              [&](std::size_t x, std::size_t y) { return regions[x].offset < regions[y].offset; });
    const std::size_t index = layout.buckets.size();
    for (const std::size_t i : b.regions) {
      const region& r = regions[i];
      if (b.ranges.empty() || b.ranges.back().offset + b.ranges.back().count != r.offset)
        b.ranges.push_back({r.offset, 0, b.elements, 0, 0, 0});
      layout.regions[i] = {index, b.ranges.size() - 1, b.elements};
      b.ranges.back().count += r.count;
      b.elements += r.count;
    }
    for (auto& range : b.ranges) {
      range.chunk = range.count / n;
      range.remainder = range.count - range.chunk * n;
      range.owned = layout.owned;
      layout.owned += range.chunk + range.remainder;
    }
    layout.buckets.push_back(std::move(b));
  }
  // A layer's buckets are those holding its regions, from the first to the last (with merging
  // a bucket may hold several layers); an empty layer starts where the next one does.
  layout.first_bucket_of_layer.assign(layout.layers + 1, 0);
  layout.first_bucket_of_layer[layout.layers] = layout.buckets.size();
  for (std::size_t l = layout.layers; l-- > 0;)
    layout.first_bucket_of_layer[l] = layout.regions_of_layer[l].empty()
                                          ? layout.first_bucket_of_layer[l + 1]
                                          : layout.regions[layout.regions_of_layer[l].front()].bucket;
  return layout;
}

COHORT_DECL std::vector<shard_segment> chunk_segments(const std::vector<region>& regions, const state_layout& layout,
                                                      int rank, bool remainders, bool flat) {
  std::vector<shard_segment> out;
  const auto k = static_cast<std::size_t>(rank), n = static_cast<std::size_t>(layout.world);
  for (const auto& bucket : layout.buckets) {
    // bucket.regions and bucket.ranges are both in buffer order: range q's regions are the
    // next ones whose placement names q.
    std::size_t first_region = 0;
    for (std::size_t q = 0; q < bucket.ranges.size(); ++q) {
      const auto& range = bucket.ranges[q];
      std::size_t end_region = first_region;
      while (end_region < bucket.regions.size() && layout.regions[bucket.regions[end_region]].range == q) ++end_region;
      // Elements [first, last) of the flat buffer, at owned position `owned`, cut by region.
      const auto cut = [&](std::size_t first, std::size_t last, std::size_t owned) {
        for (std::size_t j = first_region; j < end_region; ++j) {
          const region& r = regions[bucket.regions[j]];
          const std::size_t low = std::max(first, r.offset), high = std::min(last, r.offset + r.count);
          if (low < high) out.push_back({low, flat ? low : owned + (low - first), high - low, bucket.regions[j]});
        }
      };
      if (range.chunk > 0) cut(range.offset + k * range.chunk, range.offset + (k + 1) * range.chunk, range.owned);
      if (remainders && range.remainder > 0)
        cut(range.offset + n * range.chunk, range.offset + range.count, range.owned + range.chunk);
      first_region = end_region;
    }
  }
  return out;
}

COHORT_DECL std::vector<shard_segment> joined_segments(const std::vector<shard_segment>& segments,
                                                       const std::vector<region>& regions, bool same_group) {
  std::vector<shard_segment> out;
  for (const auto& s : segments) {
    if (!out.empty()) {
      auto& last = out.back();
      const region& a = regions[last.region];
      const region& b = regions[s.region];
      if ((!same_group || (a.decay == b.decay && a.lr_scale == b.lr_scale)) && s.offset == last.offset + last.count &&
          s.owned == last.owned + last.count) {
        last.count += s.count;
        continue;
      }
    }
    out.push_back(s);
  }
  return out;
}

COHORT_DECL std::int64_t layout_fingerprint(const std::vector<region>& regions, std::size_t elements,
                                            std::size_t bucket_elements, std::size_t first_bucket_elements,
                                            int strategy, int parameter_type, int gradient_type) {
  fnv1a hash;
  hash.mix(elements);
  hash.mix(bucket_elements);
  hash.mix(first_bucket_elements);
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
