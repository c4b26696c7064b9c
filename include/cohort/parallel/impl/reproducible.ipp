#pragma once
// cohort/parallel/detail/reproducible.hpp's definitions: inline there when header-only, compiled
// once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/comm/detail/exact_squares.hpp"
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

COHORT_DECL void check_exact_squares_words(std::span<const std::int64_t> words, dtype type) {
  const std::size_t needed = exact_squares_words(type);
  if (needed == 0 || words.size() < needed)
    throw std::invalid_argument(text("exact squares of ", to_string(type), ": ", std::to_string(words.size()),
                                     " words given, ", std::to_string(needed),
                                     needed == 0 ? " (not a floating type: no bins)" : " needed (its bins)"));
}

COHORT_DECL std::vector<std::uint32_t> exact_squares_total(std::span<const std::int64_t> words, dtype type) {
  const auto layout = exact_squares_layout_of(type);
  check_exact_squares_words(words, type);
  // 32-bit digits held in 64-bit words: each word's pieces (below 2^32, a few per digit and word)
  // are added where they fall, then the carries moved up once. The places span twice the
  // exponent range, a bin's limbs and the words' 63 bits.
  const int lowest = layout.unit_exponent(0);
  const int places = layout.unit_exponent(layout.nonfinite_bin() - 1) - lowest +
                     exact_squares_layout::limb_bits * layout.limbs() + 64 + 32;
  std::vector<std::uint64_t> digits(static_cast<std::size_t>(places / 32 + 2), 0);
  for (int bin = 0; bin < layout.nonfinite_bin(); ++bin)
    for (int limb = 0; limb < layout.limbs(); ++limb) {
      const int place = layout.unit_exponent(bin) - lowest + exact_squares_layout::limb_bits * limb;
      const auto word = words[static_cast<std::size_t>(bin) * static_cast<std::size_t>(layout.limbs()) +
                              static_cast<std::size_t>(limb)];
      auto shifted = static_cast<unsigned __int128>(static_cast<std::uint64_t>(word)) << (place % 32);
      for (auto d = static_cast<std::size_t>(place / 32); shifted != 0; ++d, shifted >>= 32)
        digits[d] += static_cast<std::uint64_t>(shifted & 0xffffffffu);
    }
  for (std::size_t d = 0; d + 1 < digits.size(); ++d) {
    digits[d + 1] += digits[d] >> 32;
    digits[d] &= 0xffffffffu;
  }
  auto high = digits.size();
  while (high > 0 && digits[high - 1] == 0) --high;
  return {digits.begin(), digits.begin() + static_cast<std::ptrdiff_t>(high)};
}

COHORT_DECL exact_norm_result exact_norm(std::span<const std::int64_t> words, dtype type) {
  const auto layout = exact_squares_layout_of(type);
  check_exact_squares_words(words, type);
  exact_norm_result result;
  // A count, in the non-finite bin's first word: each adds 1 to it (a run's count is below 2^16
  // on the host, so its pieces fall there too).
  result.nonfinite = words[static_cast<std::size_t>(layout.nonfinite_bin()) * static_cast<std::size_t>(layout.limbs())];
  if (result.nonfinite > 0) {
    result.norm = quiet_nan();
    return result;
  }
  const auto digits = exact_squares_total(words, type);
  if (digits.empty()) return result;  // every element 0 or -0
  // The top 64 bits from the highest set one, and whether any below them is set.
  const std::size_t h = digits.size() - 1;
  const auto digit = [&](std::size_t below) -> std::uint64_t { return h >= below ? digits[h - below] : 0; };
  const unsigned __int128 window =
      (static_cast<unsigned __int128>(digit(0)) << 64) | (static_cast<unsigned __int128>(digit(1)) << 32) | digit(2);
  const auto width = static_cast<int>(std::bit_width(digits[h]));  // the highest set bit is window's bit 63 + width
  const auto top = static_cast<std::uint64_t>(window >> width);
  bool sticky = (window & ((static_cast<unsigned __int128>(1) << width) - 1)) != 0;
  for (std::size_t d = 0; d + 2 < h && !sticky; ++d) sticky = digits[d] != 0;
  // Rounded to 53 bits, to nearest, ties to even.
  std::uint64_t significand = top >> 11;
  const std::uint64_t rest = top & 0x7ff;
  if (rest > 0x400 || (rest == 0x400 && (sticky || (significand & 1)))) ++significand;
  // The sum is significand x 2^exponent; its root, with the exponent made even first.
  int exponent = static_cast<int>(32 * h) + width - 1 - 52 + layout.unit_exponent(0);
  auto mantissa = static_cast<double>(significand);  // 2^53 after a carry: exact still
  if (exponent % 2 != 0) {
    mantissa *= 2;
    --exponent;
  }
  result.norm = times_power_of_two(square_root(mantissa), exponent / 2);
  return result;
}

}  // namespace cohort::inline v0::detail
