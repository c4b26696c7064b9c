#pragma once
// distributed_sampler: each rank's disjoint, reproducible slice of a dataset, epoch by epoch.
//
// Assignment rule (the same as torch.utils.data.DistributedSampler, so a C++ program and a
// PyTorch program given the same order split it identically):
//   samples_per_rank = ceil(n / world)                         drop_last = false, or n % world == 0
//                    = ceil((n - world) / world) = floor(n / world)  drop_last = true
//   total_size       = samples_per_rank * world
//   list             = shuffle ? permutation(seed, epoch) of [0, n) : 0, 1, ..., n-1
//   padded list      = list extended by wrapping around to its start (drop_last = false),
//                      or its first total_size entries (drop_last = true)
//   rank r reads     padded[r], padded[r + world], padded[r + 2 world], ...   (padded[r::world])
// Every rank therefore gets exactly samples_per_rank indices; with drop_last = false at most
// world - 1 of them repeat an index from the start of the list.
//
// The shuffled order is NOT torch's (torch.randperm on a Mersenne Twister); it is the
// counter-based Feistel permutation documented in cohort/detail/permutation.hpp, identical on
// every rank, on the host and on a GPU (see cohort/sampler_thrust.hpp), and it costs O(1) per
// index with no per-epoch storage, so a billion-sample dataset needs no billion-entry vector.
//
// Call set_epoch(e) before each epoch. Iterating twice with shuffle on and no set_epoch in
// between yields the same order again -- the classic DistributedSampler bug -- so the sampler
// warns once when that happens.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/detail/permutation.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

// Where cohort's one-time advice goes. Empty means std::cerr.
using warning_sink = std::function<void(std::string_view message)>;

namespace detail {
inline void emit_warning(const warning_sink& sink, int rank, std::string_view message) {
  std::string line = "cohort";
  if (rank >= 0) line += " [rank " + std::to_string(rank) + "]";
  line += " warning: ";
  line += message;
  if (sink) {
    sink(line);
  } else {
    line += '\n';
    std::cerr << line << std::flush;  // one write per line keeps ranks' lines whole
  }
}
}  // namespace detail

struct sampler_options {
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
  warning_sink warn = {};  // empty: std::cerr
};

class distributed_sampler {
 public:
  distributed_sampler(std::uint64_t dataset_size, int world, int rank, sampler_options options = {})
      : dataset_size_(dataset_size), world_(world), rank_(rank), options_(std::move(options)) {
    if (world < 1)
      throw error(rank, "distributed_sampler", "world size must be at least 1, got " + std::to_string(world),
                  "pass the process group's size()");
    if (rank < 0 || rank >= world)
      throw error(rank, "distributed_sampler",
                  "rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world) + ")",
                  "pass the process group's rank(), not its local rank");
    const auto w = static_cast<std::uint64_t>(world);
    samples_per_rank_ = (options_.drop_last && dataset_size % w != 0)
                            ? dataset_size / w  // torch: ceil((n - w) / w)
                            : dataset_size / w + (dataset_size % w != 0 ? 1 : 0);
  }

  // From any group with rank() and size() (cohort::process_group<gloo> or <nccl>, ...).
  template <class Group>
    requires requires(Group& group) {
      { group.rank() } -> std::convertible_to<int>;
      { group.size() } -> std::convertible_to<int>;
    }
  distributed_sampler(std::uint64_t dataset_size, Group& group, sampler_options options = {})
      : distributed_sampler(dataset_size, static_cast<int>(group.size()), static_cast<int>(group.rank()),
                            std::move(options)) {}

  // Starts a new epoch: a different (deterministic) order when shuffling.
  void set_epoch(std::uint64_t epoch) noexcept {
    epoch_ = epoch;
    passes_this_epoch_ = 0;
  }
  std::uint64_t epoch() const noexcept { return epoch_; }

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_; }
  std::uint64_t dataset_size() const noexcept { return dataset_size_; }
  const sampler_options& options() const noexcept { return options_; }
  // Indices this rank reads per epoch; the same on every rank.
  std::uint64_t size() const noexcept { return samples_per_rank_; }
  std::uint64_t total_size() const noexcept { return samples_per_rank_ * static_cast<std::uint64_t>(world_); }

  // The j-th index this rank reads in the current epoch (random access; does not count as a
  // pass for the missing-set_epoch warning).
  std::uint64_t operator[](std::uint64_t j) const noexcept { return index_map()(j); }
  std::uint64_t at(std::uint64_t j) const {
    if (j >= samples_per_rank_)
      throw error(
          rank_, "distributed_sampler::at",
          "position " + std::to_string(j) + " is past this rank's " + std::to_string(samples_per_rank_) + " samples");
    return (*this)[j];
  }

  // The plain, trivially copyable rule behind operator[], usable in device code.
  detail::rank_index_map index_map() const noexcept {
    detail::rank_index_map map;
    map.permutation = detail::feistel_permutation(dataset_size_, options_.seed, epoch_);
    map.dataset_size = dataset_size_;
    map.samples_per_rank = samples_per_rank_;
    map.world = static_cast<std::uint64_t>(world_);
    map.rank = static_cast<std::uint64_t>(rank_);
    map.shuffle = options_.shuffle;
    return map;
  }

  // Records the start of a pass over this epoch (begin(), indices() and batch sequences call
  // it); the second pass of a shuffled epoch without set_epoch warns, once per sampler.
  void begin_pass() {
    ++passes_this_epoch_;
    if (options_.shuffle && passes_this_epoch_ == 2 && !warned_same_order_) {
      warned_same_order_ = true;
      detail::emit_warning(options_.warn, rank_,
                           "distributed_sampler: a new pass over the data started with shuffle on but without "
                           "set_epoch(); it repeats epoch " +
                               std::to_string(epoch_) +
                               "'s order exactly. Call sampler.set_epoch(epoch) at the start of every epoch.");
    }
  }

  // This rank's indices for the current epoch, materialized. Counts as a pass.
  std::vector<std::uint64_t> indices() {
    begin_pass();
    std::vector<std::uint64_t> out(static_cast<std::size_t>(samples_per_rank_));
    const auto map = index_map();
    for (std::uint64_t j = 0; j < samples_per_rank_; ++j) out[static_cast<std::size_t>(j)] = map(j);
    return out;
  }

  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using iterator_concept = std::forward_iterator_tag;
    using value_type = std::uint64_t;
    using difference_type = std::ptrdiff_t;
    using reference = std::uint64_t;
    using pointer = void;

    iterator() = default;
    iterator(detail::rank_index_map map, std::uint64_t position) : map_(map), position_(position) {}
    std::uint64_t operator*() const noexcept { return map_(position_); }
    iterator& operator++() noexcept {
      ++position_;
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator before = *this;
      ++position_;
      return before;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.position_ == b.position_; }

   private:
    detail::rank_index_map map_{};
    std::uint64_t position_ = 0;
  };

  // for (auto index : sampler) -- counts as a pass.
  iterator begin() {
    begin_pass();
    return iterator(index_map(), 0);
  }
  iterator end() const { return iterator(index_map(), samples_per_rank_); }

 private:
  std::uint64_t dataset_size_;
  int world_;
  int rank_;
  sampler_options options_;
  std::uint64_t samples_per_rank_ = 0;
  std::uint64_t epoch_ = 0;
  int passes_this_epoch_ = 0;
  bool warned_same_order_ = false;
};

}  // namespace cohort::inline v0
