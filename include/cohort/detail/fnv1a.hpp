#pragma once
// FNV-1a over bytes (of 64-bit words, or of text): a cheap fingerprint that every rank
// computes the same way, for comparing what ranks are about to do (call signatures, bucket
// layouts) and for naming things (the file store's long keys). Not for anything an
// adversary chooses.

#include <cstdint>
#include <string_view>

namespace cohort::inline v0::detail {

class fnv1a {
 public:
  constexpr void mix(std::uint64_t word) noexcept {
    for (int byte = 0; byte < 8; ++byte) {
      hash_ ^= (word >> (8 * byte)) & 0xffu;
      hash_ *= 1099511628211ull;
    }
  }
  constexpr void mix(std::string_view text) noexcept {
    for (const unsigned char c : text) {
      hash_ ^= c;
      hash_ *= 1099511628211ull;
    }
  }
  constexpr std::uint64_t value() const noexcept { return hash_; }

 private:
  std::uint64_t hash_ = 14695981039346656037ull;  // the 64-bit offset basis
};

}  // namespace cohort::inline v0::detail
