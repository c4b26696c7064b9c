#pragma once
// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the TCP store's token handshake: a
// client proves it knows the shared token without sending it (tcp_store.hpp, SECURITY.md).
// Written here so the handshake needs no crypto library; tested against FIPS 180's and RFC
// 4231's vectors (tests/test_store.cpp). Not a general crypto API: nothing else in cohort
// should need one.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
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

// HMAC-SHA256(key, the concatenation of parts).
COHORT_DECL sha256_digest hmac_sha256(std::span<const std::uint8_t> key,
                                      std::initializer_list<std::span<const std::uint8_t>> parts) noexcept;

// Compares without an early exit, so the time taken does not tell how many bytes matched.
COHORT_DECL bool equal_in_constant_time(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) noexcept;

// Fills out with bytes from the kernel's random source (getrandom, else /dev/urandom); false
// when neither is available.
COHORT_DECL bool random_bytes(std::span<std::uint8_t> out) noexcept;

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/sha256.ipp"
#endif
