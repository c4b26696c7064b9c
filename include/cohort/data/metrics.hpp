#pragma once
// Evaluation that counts every sample once: per-sample values gathered from every rank in
// dataset order with the padded duplicates removed, and an even split of a range of work.
//
//   cohort::distributed_sampler sampler{n, pg, {.shuffle = true}};      // drop_last off: pads
//   std::vector<std::uint8_t> correct;                                   // one per index read
//   for (auto index : sampler) correct.push_back(predict(index) == label(index));
//   auto all = cohort::gather_for_metrics(pg, correct, sampler);         // n values, no padding
//
// Why: with drop_last = false the sampler repeats up to world - 1 samples so every rank reads
// as many; an accuracy over everything the ranks read counts those twice, over more samples
// than the dataset has. gather_for_metrics drops them, so the gathered metric is exactly the
// single-process one.
//
// Three ways to say where each rank's values belong:
//   - the sampler: rank r's j-th value is epoch position r + j * world (the sampler's
//     epoch_position), the result is in epoch order (dataset order when not shuffling; element
//     i belongs to the i-th index of the epoch's shuffled list otherwise), and the sampler's
//     padding (is_padding) is dropped. Each rank passes one value per index its sampler yielded
//     (size()), or only the real ones (unpadded_size());
//   - a process_slice from split_between_processes: rank r's values are the slice
//     [begin, end), concatenated in rank order; values past the slice's real length (its
//     padding) are dropped;
//   - the true total count: rank r's values follow rank r - 1's (concatenated in rank order,
//     spans of any length), and the result keeps the first total_count values (padding a
//     trainer appended at the end of the dataset is dropped).
//
// Collective and blocking: every rank calls it with the same kind of layout. First every rank
// learns every rank's count and whether its input is valid (one small all_gather), so a bad
// input on one rank is the same cohort::error on every rank, never a hang; then the values
// travel as bytes (any trivially copyable type): one all_gather padded to the longest rank's
// values (every_rank), or point-to-point sends of exactly each rank's values to rank 0
// (rank_zero; the other ranks get an empty vector).
//
// Memory: the values are host memory on every backend. On Gloo they are gathered where they
// are; on a device backend (NCCL) they are staged through the engine's memory (allocate,
// copy, collective, copy back): metrics are small, so the staging costs little beside the
// evaluation itself.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cohort/comm/process_group.hpp"
#include "cohort/config.hpp"
#include "cohort/data/sampler.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// ---- split_between_processes ----------------------------------------------------------------

// One rank's share of a range [0, range_size) split as evenly as possible: the slices are
// contiguous and in rank order, and the first range_size % world ranks hold one element more.
// With padding, every rank processes padded_size elements (the longest slice's length): a
// shorter slice repeats its element `repeated` (end - 1, the last element before its end;
// for an empty slice, the range's last element) until it is that long.
struct process_slice {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t range_size = 0;   // the whole range's length, the same on every rank
  std::uint64_t padded_size = 0;  // elements this rank processes: size(), or the longest slice's when padding
  bool padded = false;            // this rank repeats `repeated` padding() times
  std::uint64_t repeated = 0;     // the element repeated, when padded

  std::uint64_t size() const noexcept { return end - begin; }
  std::uint64_t padding() const noexcept { return padded_size - size(); }
  // The element this rank processes at its position j < padded_size.
  std::uint64_t operator[](std::uint64_t j) const noexcept { return j < size() ? begin + j : repeated; }
  // Whether position j is a repeat, added only to make the ranks' lengths equal.
  bool is_padding(std::uint64_t j) const noexcept { return j >= size() && j < padded_size; }
};

// A pure function of its arguments: rank r of world gets begin = r * (n / world) +
// min(r, n % world) and one element more than n / world when r < n % world.
COHORT_DECL process_slice split_between_processes(std::uint64_t range_size, int world, int rank, bool pad = false);

// The same for the calling rank of any group with rank() and world_size().
template <class Group>
  requires requires(Group& group) {
    { group.rank() } -> std::convertible_to<int>;
    { group.world_size() } -> std::convertible_to<int>;
  }
process_slice split_between_processes(std::uint64_t range_size, Group& group, bool pad = false) {
  return split_between_processes(range_size, static_cast<int>(group.world_size()), static_cast<int>(group.rank()), pad);
}

// ---- gather_for_metrics ---------------------------------------------------------------------

enum class gather_destination {
  every_rank,  // every rank gets the whole result
  rank_zero,   // rank 0 gets it, the others an empty vector (less traffic: no padded all_gather)
};

// Any contiguous range of trivially copyable values (they travel as bytes) that can be
// default-constructed (the result is a std::vector of them).
template <class R>
concept metric_values = requires(const R& values) {
  std::data(values);
  std::size(values);
  requires std::is_trivially_copyable_v<std::remove_cv_t<std::remove_pointer_t<decltype(std::data(values))>>>;
  requires std::is_default_constructible_v<std::remove_cv_t<std::remove_pointer_t<decltype(std::data(values))>>>;
};
template <class R>
using metric_value_t = std::remove_cv_t<std::remove_pointer_t<decltype(std::data(std::declval<const R&>()))>>;

namespace detail {

// What each rank tells the others before any value moves: enough for every rank to check
// every rank's input and to word the same error.
struct metrics_claim {
  std::int64_t count = 0;     // values this rank passed
  std::int64_t keep = 0;      // how many of them, from the start, are real
  std::int64_t problem = 0;   // metrics_problem: what is wrong with this rank's input
  std::int64_t expected = 0;  // with a problem: the count it should have passed ...
  std::int64_t or_else = 0;   // ... or this one (-1: no alternative)
  std::int64_t agreed = 0;    // what every rank must agree on: dataset size, range size, total count
  std::int64_t start = 0;     // slices and rank order: where this rank's values start
};
inline constexpr std::size_t metrics_claim_fields = 7;

enum class metrics_problem : std::int64_t {
  none = 0,
  count_differs_from_sampler,  // neither size() nor unpadded_size()
  count_differs_from_slice,    // neither size() nor padded_size
  sampler_of_another_group,    // the sampler's world or rank is not the group's
  sampler_of_micro_batches,    // the sampler reads runs of micro-batches, not interleaved positions
  too_many_values,             // the count does not fit the wire
};

// Where each rank's values belong in the result.
enum class metrics_layout {
  sampler_positions,  // rank r's j-th value at r + j * world; the values add up to at most the dataset
  slices,             // rank r's values at its slice's begin; the slices tile the range exactly
  rank_order,         // rank r's values after rank r - 1's; at least the total count in all
};

// Turns the claims every rank now holds into the same decision on every rank: throws the same
// cohort::error (apart from the "[rank r]" that raises it) if any rank's input is wrong.
// In rank_order, it also sets each claim's start (the sum of the counts before it).
COHORT_DECL void check_metrics_claims(int my_rank, std::vector<metrics_claim>& claims, std::size_t value_bytes,
                                      metrics_layout layout);

inline std::vector<std::int64_t> to_wire(const metrics_claim& claim) {
  return {claim.count, claim.keep, claim.problem, claim.expected, claim.or_else, claim.agreed, claim.start};
}
inline metrics_claim from_wire(const std::int64_t* fields) {
  return {fields[0], fields[1], fields[2], fields[3], fields[4], fields[5], fields[6]};
}

// An all_gather of host bytes (`all` holds world chunks of `chunk` bytes; `mine` is copied
// into this rank's chunk), staged through the engine's memory on a device backend.
template <backend B>
void all_gather_host_bytes(process_group<B>& group, const std::uint8_t* mine, std::size_t chunk, std::uint8_t* all) {
  const auto world = static_cast<std::size_t>(group.world_size());
  const std::size_t my_offset = static_cast<std::size_t>(group.rank()) * chunk;
  if (chunk != 0) std::memcpy(all + my_offset, mine, chunk);
  if constexpr (B::space == memory_space::host) {
    group.all_gather(std::span<const std::uint8_t>(all + my_offset, chunk), std::span<std::uint8_t>(all, chunk * world))
        .wait();
  } else {
    auto& engine = group.backend();
    backend_buffer<B> staged(engine, chunk * world);
    auto* device = static_cast<std::uint8_t*>(staged.data());
    engine.copy(device + my_offset, all + my_offset, chunk);
    group.all_gather(std::span<const std::uint8_t>(device + my_offset, chunk),
                     std::span<std::uint8_t>(device, chunk * world));
    engine.copy(all, device, chunk * world).wait();
  }
}

// Point-to-point host bytes; a device backend stages them.
inline constexpr std::uint64_t metrics_tag = 0x6d65747269637300;  // "metrics"

template <backend B>
void send_host_bytes(process_group<B>& group, const std::uint8_t* bytes, std::size_t count, int peer) {
  if constexpr (B::space == memory_space::host) {
    group.send(std::span<const std::uint8_t>(bytes, count), peer, metrics_tag).wait();
  } else {
    auto& engine = group.backend();
    backend_buffer<B> staged(engine, count);
    engine.copy(staged.data(), bytes, count);
    group.send(std::span<const std::uint8_t>(static_cast<const std::uint8_t*>(staged.data()), count), peer, metrics_tag)
        .wait();
  }
}

template <backend B>
void recv_host_bytes(process_group<B>& group, std::uint8_t* bytes, std::size_t count, int peer) {
  if constexpr (B::space == memory_space::host) {
    group.recv(std::span<std::uint8_t>(bytes, count), peer, metrics_tag).wait();
  } else {
    auto& engine = group.backend();
    backend_buffer<B> staged(engine, count);
    group.recv(std::span<std::uint8_t>(static_cast<std::uint8_t*>(staged.data()), count), peer, metrics_tag);
    engine.copy(bytes, staged.data(), count).wait();
  }
}

// The whole exchange once each rank's claim is made: claims, the checks, the values, and
// their order. `limit` (rank order) keeps only the first `limit` values.
template <backend B, class T>
std::vector<T> gather_metrics_values(process_group<B>& group, const T* values, metrics_claim claim,
                                     metrics_layout layout, gather_destination to,
                                     std::uint64_t limit = std::numeric_limits<std::uint64_t>::max()) {
  const auto world = static_cast<std::size_t>(group.world_size());
  const int my_rank = group.rank();

  const std::vector<std::int64_t> mine = to_wire(claim);
  std::vector<std::int64_t> wire(metrics_claim_fields * world);
  all_gather_host_bytes(group, reinterpret_cast<const std::uint8_t*>(mine.data()), sizeof(std::int64_t) * mine.size(),
                        reinterpret_cast<std::uint8_t*>(wire.data()));
  std::vector<metrics_claim> claims(world);
  for (std::size_t r = 0; r < world; ++r) claims[r] = from_wire(wire.data() + r * metrics_claim_fields);
  check_metrics_claims(my_rank, claims, sizeof(T), layout);  // the same verdict on every rank

  // Only each rank's real values travel.
  std::size_t longest = 0;
  std::size_t total = 0;
  for (const auto& c : claims) {
    longest = std::max(longest, static_cast<std::size_t>(c.keep));
    total += static_cast<std::size_t>(c.keep);
  }
  const std::size_t my_keep = static_cast<std::size_t>(claim.keep);
  std::vector<std::uint8_t> received;  // rank r's values at r * longest * sizeof(T)
  const std::size_t chunk = longest * sizeof(T);
  if (to == gather_destination::every_rank) {
    std::vector<std::uint8_t> padded(chunk, 0);
    if (my_keep != 0) std::memcpy(padded.data(), values, my_keep * sizeof(T));
    received.resize(chunk * world);
    if (chunk != 0) all_gather_host_bytes(group, padded.data(), chunk, received.data());
  } else if (my_rank != 0) {
    if (my_keep != 0) send_host_bytes(group, reinterpret_cast<const std::uint8_t*>(values), my_keep * sizeof(T), 0);
    return {};
  } else {
    received.resize(chunk * world);
    if (my_keep != 0) std::memcpy(received.data(), values, my_keep * sizeof(T));
    for (std::size_t r = 1; r < world; ++r) {
      const auto bytes = static_cast<std::size_t>(claims[r].keep) * sizeof(T);
      if (bytes != 0) recv_host_bytes(group, received.data() + r * chunk, bytes, static_cast<int>(r));
    }
  }

  std::vector<T> result(total);
  for (std::size_t r = 0; r < world; ++r) {
    const std::uint8_t* from = received.data() + r * chunk;
    const auto keep = static_cast<std::size_t>(claims[r].keep);
    if (layout == metrics_layout::sampler_positions) {
      // Epoch position r + j * world: the sampler's own rule (distributed_sampler::epoch_position).
      for (std::size_t j = 0; j < keep; ++j) std::memcpy(&result[r + j * world], from + j * sizeof(T), sizeof(T));
    } else if (keep != 0) {
      std::memcpy(&result[static_cast<std::size_t>(claims[r].start)], from, keep * sizeof(T));
    }
  }
  if (result.size() > limit) result.resize(static_cast<std::size_t>(limit));
  return result;
}

// A count as the wire carries it, or the too_many_values problem.
template <class T>
bool fits_wire(std::size_t count) {
  return count <= static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) / sizeof(T);
}

// The claim of a rank that passed `count` values where `expected` or `or_else` are right
// (`wrong` names the problem otherwise), its first `real` values the real ones, `agreed` what
// every rank must share. A claim with a problem keeps nothing: its values do not travel.
template <class T>
metrics_claim counted_claim(std::size_t count, std::uint64_t expected, std::uint64_t or_else, std::uint64_t real,
                            std::uint64_t agreed, metrics_problem wrong) {
  metrics_claim claim;
  claim.count = fits_wire<T>(count) ? static_cast<std::int64_t>(count) : -1;
  claim.keep = static_cast<std::int64_t>(std::min<std::uint64_t>(count, real));
  claim.agreed = static_cast<std::int64_t>(agreed);
  claim.expected = static_cast<std::int64_t>(expected);
  claim.or_else = static_cast<std::int64_t>(or_else);
  if (claim.count < 0)
    claim.problem = static_cast<std::int64_t>(metrics_problem::too_many_values);
  else if (count != expected && count != or_else)
    claim.problem = static_cast<std::int64_t>(wrong);
  if (claim.problem != 0) claim.keep = 0;
  return claim;
}

}  // namespace detail

// With cohort's sampler: `values` holds one value per index this rank's sampler yielded in
// the current epoch (sampler.size(), padding included, in the order yielded), or only the
// real ones (sampler.unpadded_size()). The result holds one value per real epoch position, in
// epoch order: n values (total_size() with drop_last, which drops the tail instead of padding).
template <backend B, metric_values Values>
std::vector<metric_value_t<Values>> gather_for_metrics(process_group<B>& group, const Values& values,
                                                       const distributed_sampler& sampler,
                                                       gather_destination to = gather_destination::every_rank) {
  using T = metric_value_t<Values>;
  detail::metrics_claim claim =
      detail::counted_claim<T>(std::size(values), sampler.size(), sampler.unpadded_size(), sampler.unpadded_size(),
                               sampler.dataset_size(), detail::metrics_problem::count_differs_from_sampler);
  if (sampler.world_size() != group.world_size() || sampler.rank() != group.rank()) {
    // Named before any count: the sampler's sizes are another group's.
    claim.problem = static_cast<std::int64_t>(detail::metrics_problem::sampler_of_another_group);
    claim.expected = sampler.world_size();
    claim.or_else = sampler.rank();
    claim.keep = 0;
  } else if (sampler.micro_batches_per_rank() != 0) {
    claim.problem = static_cast<std::int64_t>(detail::metrics_problem::sampler_of_micro_batches);
    claim.expected = static_cast<std::int64_t>(sampler.options().micro_batches);
    claim.keep = 0;
  }
  return detail::gather_metrics_values<B, T>(group, std::data(values), claim, detail::metrics_layout::sampler_positions,
                                             to);
}

// With split_between_processes: `values` holds this rank's slice.size() values, or
// slice.padded_size with the padding at the end. The result: range_size values in range order.
template <backend B, metric_values Values>
std::vector<metric_value_t<Values>> gather_for_metrics(process_group<B>& group, const Values& values,
                                                       const process_slice& slice,
                                                       gather_destination to = gather_destination::every_rank) {
  using T = metric_value_t<Values>;
  detail::metrics_claim claim =
      detail::counted_claim<T>(std::size(values), slice.size(), slice.padded_size, slice.size(), slice.range_size,
                               detail::metrics_problem::count_differs_from_slice);
  claim.start = static_cast<std::int64_t>(slice.begin);
  return detail::gather_metrics_values<B, T>(group, std::data(values), claim, detail::metrics_layout::slices, to);
}

// With neither: rank r's values follow rank r - 1's (spans of any length per rank), and the
// result keeps the first `total_count` of them, the dataset's true size: whatever a trainer
// padded at the end of the dataset is dropped. Every rank passes the same total_count; the
// ranks together must pass at least that many values.
template <backend B, metric_values Values>
std::vector<metric_value_t<Values>> gather_for_metrics(process_group<B>& group, const Values& values,
                                                       std::uint64_t total_count,
                                                       gather_destination to = gather_destination::every_rank) {
  using T = metric_value_t<Values>;
  const std::size_t count = std::size(values);
  detail::metrics_claim claim;
  claim.count = detail::fits_wire<T>(count) ? static_cast<std::int64_t>(count) : -1;
  claim.keep = claim.count < 0 ? 0 : claim.count;
  claim.agreed = static_cast<std::int64_t>(total_count);
  // claim.start: the counts of the ranks before this one, summed once every claim is known.
  claim.expected = -1;
  claim.or_else = -1;
  if (claim.count < 0) claim.problem = static_cast<std::int64_t>(detail::metrics_problem::too_many_values);
  return detail::gather_metrics_values<B, T>(group, std::data(values), claim, detail::metrics_layout::rank_order, to,
                                             total_count);
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/data/impl/metrics.ipp"
#endif
