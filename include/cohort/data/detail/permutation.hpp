#pragma once
// A counter-based permutation of [0, n): element i of the shuffled order is computed on its
// own, in O(1) expected time, from (seed, epoch, n, i) alone. Nothing is stored and nothing
// depends on evaluation order, so the host sampler, a Thrust kernel on a GPU and a Thrust
// loop on the CPU all produce the same permutation bit for bit.
//
// The algorithm (part of cohort's compatibility promise: changing it changes every shuffle):
//
//   mix(z)        = splitmix64's finalizer:
//                   z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27; z *= 0x94d049bb133111eb;
//                   z ^= z >> 31
//   splitmix64(x) = mix(x + 0x9e3779b97f4a7c15)
//   round keys    : k = splitmix64(seed); k = splitmix64(k ^ epoch);
//                   key[r] = splitmix64(k + r) for r = 0 .. rounds-1   (rounds = 6)
//   domain        : [0, 2^b), b the smallest even number >= 2 with 2^b >= n; h = b / 2
//   Feistel round : split x into (left, right) of h bits each (left = high half);
//                   (left, right) <- (right, left ^ (mix(right ^ key[r]) & (2^h - 1)))
//   bijection     : x -> six rounds -> (left << h) | right, a permutation of [0, 2^b)
//   cycle-walking : permutation(i) applies the Feistel bijection to i, then again to the
//                   result, until the value falls in [0, n). Because 2^b < 4n, this takes
//                   fewer than four applications on average, and it stays a bijection of
//                   [0, n) (each cycle of the big permutation is walked in order).
//
// Everything here is trivially copyable and marked COHORT_HOST_DEVICE, so device code can
// capture these objects by value.

#include <cstdint>

#include "cohort/detail/host_device.hpp"

namespace cohort::inline v0::detail {

COHORT_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z;
}

COHORT_HOST_DEVICE constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  return mix64(x + 0x9e3779b97f4a7c15ULL);
}

class feistel_permutation {
 public:
  static constexpr int rounds = 6;

  feistel_permutation() = default;

  COHORT_HOST_DEVICE constexpr feistel_permutation(std::uint64_t size, std::uint64_t seed, std::uint64_t epoch) noexcept
      : size_(size) {
    int bits = 2;
    // 2^bits >= size; bits = 64 covers every size a std::uint64_t can hold.
    while (bits < 64 && (std::uint64_t{1} << bits) < size) bits += 2;
    half_bits_ = bits / 2;
    half_mask_ = (std::uint64_t{1} << half_bits_) - 1;
    std::uint64_t k = splitmix64(seed);
    k = splitmix64(k ^ epoch);
    for (int r = 0; r < rounds; ++r) keys_[r] = splitmix64(k + static_cast<std::uint64_t>(r));
  }

  COHORT_HOST_DEVICE constexpr std::uint64_t size() const noexcept { return size_; }

  // The element at position `i` (< size()) of the shuffled order.
  COHORT_HOST_DEVICE constexpr std::uint64_t operator()(std::uint64_t i) const noexcept {
    std::uint64_t x = i;
    do {
      x = encrypt(x);
    } while (x >= size_);
    return x;
  }

 private:
  COHORT_HOST_DEVICE constexpr std::uint64_t encrypt(std::uint64_t x) const noexcept {
    std::uint64_t left = (x >> half_bits_) & half_mask_;
    std::uint64_t right = x & half_mask_;
    for (int r = 0; r < rounds; ++r) {
      const std::uint64_t next_right = left ^ (mix64(right ^ keys_[r]) & half_mask_);
      left = right;
      right = next_right;
    }
    return (left << half_bits_) | right;
  }

  std::uint64_t size_ = 0;
  int half_bits_ = 1;
  std::uint64_t half_mask_ = 1;
  std::uint64_t keys_[rounds] = {};
};

// Where a rank's j-th index sits in the epoch's (padded) list. The list is cut into rounds of
// `round` positions, of which each rank reads a contiguous `run` (round = run x world): rank r
// reads positions [k round + r run, k round + (r + 1) run) in round k. torch's interleaved
// assignment is run = 1 (round = world: positions r, r + world, ...); the micro-batch mode's
// is a global step of M micro-batches of b samples (round = M b, run = M / world x b).
COHORT_HOST_DEVICE constexpr std::uint64_t epoch_position(std::uint64_t j, std::uint64_t run, std::uint64_t round,
                                                          std::uint64_t rank) noexcept {
  return j / run * round + rank * run + j % run;
}

// Which dataset index a rank reads at each of its positions, following
// torch.utils.data.DistributedSampler: the (optionally shuffled) list of dataset indices is
// padded by wrapping around to its start (or truncated, with drop_last) to
// total_size = samples_per_rank * world, and rank r takes its positions by epoch_position
// (r, r + world, ... by default). Without even batches (sampler_options::even_batches = false)
// the positions are the same, only none reaches n, so nothing wraps; samples_per_rank then
// differs between ranks.
struct rank_index_map {
  feistel_permutation permutation;
  std::uint64_t dataset_size = 0;
  std::uint64_t samples_per_rank = 0;  // on this rank
  std::uint64_t run = 1;               // consecutive positions this rank reads per round
  std::uint64_t round = 1;             // positions per round, every rank's runs
  std::uint64_t rank = 0;
  bool shuffle = false;

  // j < samples_per_rank.
  COHORT_HOST_DEVICE constexpr std::uint64_t operator()(std::uint64_t j) const noexcept {
    // Padding repeats the list from its start as often as needed (torch does the same when
    // the padding is longer than the dataset).
    const std::uint64_t position = epoch_position(j, run, round, rank) % dataset_size;
    return shuffle ? permutation(position) : position;
  }
};

}  // namespace cohort::inline v0::detail
