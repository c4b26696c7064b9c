#pragma once
// cohort/detail/sha256.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "cohort/config.hpp"
#include "cohort/detail/sha256.hpp"

namespace cohort::inline v0::detail {

namespace sha256_constants {
inline constexpr std::array<std::uint32_t, 64> round{
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
inline constexpr std::array<std::uint32_t, 8> initial{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                                      0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
constexpr std::uint32_t rotr(std::uint32_t x, int n) noexcept { return (x >> n) | (x << (32 - n)); }
}  // namespace sha256_constants

COHORT_DECL void sha256::reset() noexcept {
  state_ = sha256_constants::initial;
  pending_size_ = 0;
  total_bytes_ = 0;
}

COHORT_DECL void sha256::block(const std::uint8_t* data) noexcept {
  using sha256_constants::rotr;
  std::array<std::uint32_t, 64> w{};
  for (std::size_t i = 0; i < 16; ++i)
    w[i] = (std::uint32_t{data[4 * i]} << 24) | (std::uint32_t{data[4 * i + 1]} << 16) |
           (std::uint32_t{data[4 * i + 2]} << 8) | std::uint32_t{data[4 * i + 3]};
  for (std::size_t i = 16; i < 64; ++i) {
    const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  auto [a, b, c, d, e, f, g, h] = state_;
  for (std::size_t i = 0; i < 64; ++i) {
    const std::uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    const std::uint32_t choose = (e & f) ^ (~e & g);
    const std::uint32_t t1 = h + s1 + choose + sha256_constants::round[i] + w[i];
    const std::uint32_t s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    const std::uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
    const std::uint32_t t2 = s0 + majority;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  const std::array<std::uint32_t, 8> mixed{a, b, c, d, e, f, g, h};
  for (std::size_t i = 0; i < 8; ++i) state_[i] += mixed[i];
}

COHORT_DECL void sha256::update(std::span<const std::uint8_t> data) noexcept {
  total_bytes_ += data.size();
  std::size_t used = 0;
  if (pending_size_ > 0) {
    used = std::min(data.size(), pending_.size() - pending_size_);
    std::memcpy(pending_.data() + pending_size_, data.data(), used);
    pending_size_ += used;
    if (pending_size_ < pending_.size()) return;
    block(pending_.data());
    pending_size_ = 0;
  }
  for (; used + 64 <= data.size(); used += 64) block(data.data() + used);
  if (used < data.size()) {
    std::memcpy(pending_.data(), data.data() + used, data.size() - used);
    pending_size_ = data.size() - used;
  }
}

COHORT_DECL sha256_digest sha256::finish() noexcept {
  const std::uint64_t bits = total_bytes_ * 8;
  std::array<std::uint8_t, 72> padding{};
  padding[0] = 0x80;
  // Pad to 56 bytes mod 64, then the message length in bits, big-endian.
  const std::size_t pad = (pending_size_ < 56 ? 56 : 120) - pending_size_;
  for (std::size_t i = 0; i < 8; ++i) padding[pad + i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
  const std::uint64_t counted = total_bytes_;
  update(std::span<const std::uint8_t>(padding.data(), pad + 8));
  total_bytes_ = counted;
  sha256_digest out{};
  for (std::size_t i = 0; i < 8; ++i)
    for (std::size_t j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * j));
  reset();
  return out;
}

}  // namespace cohort::inline v0::detail
