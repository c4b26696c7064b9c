#pragma once
// SHA-256 (FIPS 180-4), written here so that cohort needs no crypto library. Two users: the
// TCP store's token handshake (HMAC-SHA256, rendezvous/detail/hmac.hpp) and the parameter
// fingerprint (parallel/fingerprint.hpp), a digest users compare across runs. Tested against
// FIPS 180's vectors (tests/test_store.cpp). Included only where a digest is made, so that no
// other translation unit parses it.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "cohort/config.hpp"

namespace cohort::inline v0::detail {

using sha256_digest = std::array<std::uint8_t, 32>;

class sha256 {
 public:
  sha256() noexcept { reset(); }

  COHORT_DECL void reset() noexcept;
  COHORT_DECL void update(std::span<const std::uint8_t> data) noexcept;
  void update(std::string_view text) noexcept {
    update(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
  }
  COHORT_DECL sha256_digest finish() noexcept;

  static sha256_digest of(std::span<const std::uint8_t> data) noexcept {
    sha256 hash;
    hash.update(data);
    return hash.finish();
  }

 private:
  COHORT_DECL void block(const std::uint8_t* data) noexcept;

  std::array<std::uint32_t, 8> state_{};
  std::array<std::uint8_t, 64> pending_{};
  std::size_t pending_size_ = 0;
  std::uint64_t total_bytes_ = 0;
};

// 64 lower-case hex digits.
inline std::string sha256_hex(const sha256_digest& digest) {
  constexpr std::string_view digits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * digest.size());
  for (const std::uint8_t byte : digest) {
    out += digits[byte >> 4];
    out += digits[byte & 0xf];
  }
  return out;
}

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/sha256.ipp"
#endif
