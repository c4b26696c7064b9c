#pragma once
// The parameter fingerprint's definition (cohort/parallel/fingerprint.hpp) computed straight
// from a flat host buffer, without the library's chunk numbering or all-reduce: what the tests
// hold parameter_sha256 to, on Gloo and on NCCL.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cohort/detail/sha256.hpp>
#include <cohort/parallel/layout.hpp>

namespace cohort_test {

// The regions as declared, each cut into 1 MiB chunks of its bytes, SHA-256 of each, then
// SHA-256 of the digests end to end.
template <class P>
std::string expected_parameter_sha256(const std::vector<P>& flat, const std::vector<cohort::region>& regions) {
  std::vector<std::uint8_t> digests;
  for (const auto& r : regions) {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(flat.data() + r.offset);
    const std::size_t total = r.count * sizeof(P);
    for (std::size_t at = 0; at < total; at += std::size_t{1} << 20) {
      const auto digest = cohort::detail::sha256::of({bytes + at, std::min(std::size_t{1} << 20, total - at)});
      digests.insert(digests.end(), digest.begin(), digest.end());
    }
  }
  return cohort::detail::sha256_hex(cohort::detail::sha256::of(digests));
}

}  // namespace cohort_test
