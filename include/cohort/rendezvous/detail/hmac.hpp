#pragma once
// HMAC-SHA256 (RFC 2104) over cohort's SHA-256 (cohort/detail/sha256.hpp), a constant-time
// comparison and the kernel's random bytes: the TCP store's token handshake, in which a client
// proves it knows the shared token without sending it (tcp_store.hpp, SECURITY.md). Tested
// against RFC 4231's vectors (tests/test_store.cpp). Not a general crypto API: nothing else in
// cohort should need one.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>

#include "cohort/config.hpp"
#include "cohort/detail/sha256.hpp"

namespace cohort::inline v0::detail {

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
#include "cohort/rendezvous/impl/hmac.ipp"
#endif
