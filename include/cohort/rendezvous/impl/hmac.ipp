#pragma once
// cohort/rendezvous/detail/hmac.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>

#include "cohort/config.hpp"
#include "cohort/detail/sha256.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL sha256_digest hmac_sha256(std::span<const std::uint8_t> key,
                                      std::initializer_list<std::span<const std::uint8_t>> parts) noexcept {
  std::array<std::uint8_t, 64> block_key{};
  if (key.size() > block_key.size()) {
    const sha256_digest hashed = sha256::of(key);
    std::memcpy(block_key.data(), hashed.data(), hashed.size());
  } else if (!key.empty()) {
    std::memcpy(block_key.data(), key.data(), key.size());
  }
  std::array<std::uint8_t, 64> pad{};
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = block_key[i] ^ 0x36;
  sha256 inner;
  inner.update(pad);
  for (const auto part : parts) inner.update(part);
  const sha256_digest inner_digest = inner.finish();
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = block_key[i] ^ 0x5c;
  sha256 outer;
  outer.update(pad);
  outer.update(inner_digest);
  return outer.finish();
}

COHORT_DECL bool equal_in_constant_time(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) noexcept {
  if (a.size() != b.size()) return false;
  std::uint8_t difference = 0;
  for (std::size_t i = 0; i < a.size(); ++i) difference |= static_cast<std::uint8_t>(a[i] ^ b[i]);
  return difference == 0;
}

COHORT_DECL bool random_bytes(std::span<std::uint8_t> out) noexcept {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::getrandom(out.data() + done, out.size() - done, 0);
    if (got > 0) {
      done += static_cast<std::size_t>(got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    break;
  }
  if (done == out.size()) return true;
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  while (done < out.size()) {
    const ssize_t got = ::read(fd, out.data() + done, out.size() - done);
    if (got > 0) {
      done += static_cast<std::size_t>(got);
    } else if (!(got < 0 && errno == EINTR)) {
      break;
    }
  }
  ::close(fd);
  return done == out.size();
}

}  // namespace cohort::inline v0::detail
