#pragma once
// FNV-1a over the bytes of 64-bit words: a cheap fingerprint that every rank computes the
// same way, for comparing what ranks are about to do (call signatures, bucket layouts).
// Not for anything an adversary chooses.

#include <cstdint>

namespace cohort::inline v0::detail {

class fnv1a {
 public:
  constexpr void mix(std::uint64_t word) noexcept {
    for (int byte = 0; byte < 8; ++byte) {
      hash_ ^= (word >> (8 * byte)) & 0xffu;
      hash_ *= 1099511628211ull;
    }
  }
  constexpr std::uint64_t value() const noexcept { return hash_; }

 private:
  std::uint64_t hash_ = 1469598103934665603ull;
};

}  // namespace cohort::inline v0::detail
