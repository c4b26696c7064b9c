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
// Epoch positions: rank r's j-th index sits at position p = r + j * world of the padded
// list (epoch_position(j)); positions p >= n are padding, duplicates that exist only to even
// the ranks out. They are always the last ones a rank reads: is_padding(j) is
// j >= unpadded_size(). Evaluation must not count them (cohort/data/metrics.hpp's
// gather_for_metrics drops them).
//
// even_batches = false (with drop_last = false): no padding; rank r reads the same positions
// r, r + world, ... but only those below n, so the ranks with r < n % world read one index
// more than the others (ceil(n / world) against floor(n / world)). Together the ranks read
// every index exactly once. Ranks then run different numbers of batches, so a training loop
// over them must keep the ranks' collectives in step itself. With drop_last = true the ranks
// are even by dropping the tail and even_batches changes nothing.
//
// Micro-batch mode (micro_batches = M and micro_batch_size = b set; reproducible training's
// order, training_options::reproducible): micro-batch i of a global step holds the same samples
// at any world size, and each rank holds a contiguous run of them. The epoch's list (shuffled or
// not, padded as above) is cut into global steps of M x b positions; micro-batch i of step s is
// positions [s M b + i b, s M b + (i + 1) b), and rank r reads micro-batches
// [r m, (r + 1) m) of every step, m = M / world, in order: its j-th index is micro-step
// (j / b) % m of step j / (m b), which batch_sequence{sampler, b, m} yields micro-batch by
// micro-batch. M must be a multiple of the world (refused otherwise, naming the rule). The
// tail: drop_last drops an incomplete last global step; otherwise it is padded to a whole one
// by wrapping, as above (is_padding marks those samples, always the last ones a rank reads; a
// rank may then hold only padding in the last step, and its micro-batches are still run, as
// every rank's must be). even_batches = false is refused: every rank holds whole runs. torch's
// assignment is this rule with M = world and b = 1.
//
// The shuffled order is NOT torch's (torch.randperm on a Mersenne Twister); it is the
// counter-based Feistel permutation documented in cohort/data/detail/permutation.hpp, identical on
// every rank, on the host and on a GPU (see cohort/data/sampler_thrust.hpp), and it costs O(1) per
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

#include "cohort/config.hpp"
#include "cohort/data/detail/permutation.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

// Where cohort's one-time advice goes. Empty means std::cerr.
using warning_sink = std::function<void(std::string_view message)>;

namespace detail {
COHORT_DECL void emit_warning(const warning_sink& sink, int rank, std::string_view message);
}  // namespace detail

struct sampler_options {
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
  // true: every rank reads as many indices, padded by repeating samples (torch's rule);
  // false: each rank reads its true share, which differs by one between ranks.
  bool even_batches = true;
  warning_sink warn = {};  // empty: std::cerr
  // Micro-batch mode (above), both set or both 0: M micro-batches of micro_batch_size samples
  // per global step, the same at every world size (training_options::reproducible's).
  std::uint64_t micro_batches = 0;
  std::uint64_t micro_batch_size = 0;
};

class distributed_sampler {
 public:
  COHORT_DECL distributed_sampler(std::uint64_t dataset_size, int world, int rank, sampler_options options = {});

  // From any group with rank() and world_size() (cohort::process_group<gloo> or <nccl>, ...).
  template <class Group>
    requires requires(Group& group) {
      { group.rank() } -> std::convertible_to<int>;
      { group.world_size() } -> std::convertible_to<int>;
    }
  distributed_sampler(std::uint64_t dataset_size, Group& group, sampler_options options = {})
      : distributed_sampler(dataset_size, static_cast<int>(group.world_size()), static_cast<int>(group.rank()),
                            std::move(options)) {}

  // Starts a new epoch: a different (deterministic) order when shuffling.
  COHORT_DECL void set_epoch(std::uint64_t epoch) noexcept;
  std::uint64_t epoch() const noexcept { return epoch_; }

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_; }
  std::uint64_t dataset_size() const noexcept { return dataset_size_; }
  const sampler_options& options() const noexcept { return options_; }
  // Indices this rank reads per epoch, padding included; the same on every rank unless
  // even_batches is off.
  std::uint64_t size() const noexcept { return samples_per_rank_; }
  // Indices all ranks read together per epoch, padding included.
  std::uint64_t total_size() const noexcept { return total_size_; }
  // How many of this rank's size() indices are real samples rather than padding: the first
  // unpadded_size() positions are, the rest are duplicates.
  std::uint64_t unpadded_size() const noexcept { return unpadded_size_; }
  // Whether this rank's j-th index (j < size()) is a padded duplicate, added only to even
  // the ranks out.
  bool is_padding(std::uint64_t j) const noexcept { return j >= unpadded_size_ && j < samples_per_rank_; }
  // Where this rank's j-th index sits in the epoch's (padded) list: j * world + rank, or in
  // micro-batch mode its place in its global step's micro-batches (the header comment).
  std::uint64_t epoch_position(std::uint64_t j) const noexcept {
    return detail::epoch_position(j, run_, round_, static_cast<std::uint64_t>(rank_));
  }
  // Micro-batch mode: the micro-batches this rank reads of each global step (M / world), and
  // the global steps of the epoch, the padded last one included. 0 both when the mode is off.
  std::uint64_t micro_batches_per_rank() const noexcept {
    return options_.micro_batch_size ? run_ / options_.micro_batch_size : 0;
  }
  std::uint64_t global_steps() const noexcept { return options_.micro_batch_size ? samples_per_rank_ / run_ : 0; }

  // The j-th index this rank reads in the current epoch (random access; does not count as a
  // pass for the missing-set_epoch warning).
  std::uint64_t operator[](std::uint64_t j) const noexcept { return index_map()(j); }
  COHORT_DECL std::uint64_t at(std::uint64_t j) const;

  // The plain, trivially copyable rule behind operator[], usable in device code.
  COHORT_DECL detail::rank_index_map index_map() const noexcept;

  // Records the start of a pass over this epoch (begin(), indices() and batch sequences call
  // it); the second pass of a shuffled epoch without set_epoch warns, once per sampler.
  COHORT_DECL void begin_pass();

  // This rank's indices for the current epoch, materialized. Counts as a pass.
  COHORT_DECL std::vector<std::uint64_t> indices();

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
  COHORT_DECL iterator begin();
  iterator end() const { return iterator(index_map(), samples_per_rank_); }

 private:
  std::uint64_t dataset_size_;
  int world_;
  int rank_;
  sampler_options options_;
  std::uint64_t samples_per_rank_ = 0;  // on this rank
  std::uint64_t unpadded_size_ = 0;
  std::uint64_t total_size_ = 0;
  std::uint64_t run_ = 1;    // consecutive positions this rank reads per round (detail::epoch_position)
  std::uint64_t round_ = 1;  // positions per round: the world, or a global step's M x b
  std::uint64_t epoch_ = 0;
  int passes_this_epoch_ = 0;
  bool warned_same_order_ = false;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/data/impl/sampler.ipp"
#endif
