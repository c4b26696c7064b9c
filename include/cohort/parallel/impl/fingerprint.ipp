#pragma once
// cohort/parallel/fingerprint.hpp's definitions: inline there when header-only, compiled once
// by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/sha256.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/parallel/fingerprint.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {

COHORT_DECL std::string fingerprint_of_chunks(std::span<const std::uint64_t> words) {
  return sha256_hex(sha256::of({reinterpret_cast<const std::uint8_t*>(words.data()), words.size_bytes()}));
}

namespace {

// A checkpoint's masters as the parameters they stand for: the same bytes where the types
// agree, else cast to the narrower parameter type as the state casts them.
template <class Parameter>
void cast_masters(const char* masters, std::size_t count, std::vector<std::uint8_t>& out) {
  out.resize(count * sizeof(Parameter));
  for (std::size_t i = 0; i < count; ++i) {
    float master = 0;
    std::memcpy(&master, masters + i * sizeof(float), sizeof master);
    const Parameter parameter(master);
    std::memcpy(out.data() + i * sizeof(Parameter), &parameter, sizeof parameter);
  }
}

}  // namespace
}  // namespace detail

COHORT_COLD_BODY std::string checkpoint_parameter_sha256(const std::string& checkpoint) {
  constexpr std::string_view operation = "checkpoint_parameter_sha256";
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, -1, operation);
  if (manifest.tensors.empty() || manifest.tensors.front() != "parameters")
    throw checkpoint_damaged_error(-1, operation, detail::text(checkpoint, "'s first tensor is not the parameters"),
                                   "the index names the parameters first in every checkpoint cohort writes");
  // The parameters' element size, and how to make them from the masters.
  const bool same_type = manifest.parameter_dtype == manifest.dtype;
  const bool from_float = manifest.dtype == to_string(dtype::float32);
  const bool to_half = from_float && manifest.parameter_dtype == to_string(dtype::float16);
  const bool to_bfloat16 = from_float && manifest.parameter_dtype == to_string(dtype::bfloat16);
  if (!same_type && !to_half && !to_bfloat16)
    throw error(
        -1, operation,
        detail::text(checkpoint, " keeps ", manifest.dtype, " masters of ", manifest.parameter_dtype, " parameters"),
        "the digest is defined over the parameters: float masters of half or bfloat16 parameters, or "
        "masters of the parameters' own type");
  const std::size_t parameter_bytes = same_type ? static_cast<std::size_t>(manifest.element_bytes) : 2;
  // Whole chunks per read, so that a chunk never spans two reads.
  constexpr std::size_t chunks_per_read = 16;
  const std::size_t elements_per_read = chunks_per_read * detail::fingerprint_chunk_bytes / parameter_bytes;

  std::vector<std::uint64_t> words;
  std::vector<char> masters;
  std::vector<std::uint8_t> parameters;
  for (std::size_t r = 0; r < manifest.regions.size(); ++r) {
    const std::uint64_t count = manifest.regions[r].count;
    for (std::uint64_t first = 0; first < count; first += elements_per_read) {
      const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(elements_per_read, count - first));
      masters.resize(take * static_cast<std::size_t>(manifest.element_bytes));
      detail::read_checkpoint_verified(checkpoint, manifest, {{0, r, first, take, masters.data()}});
      std::span<const std::uint8_t> bytes;
      if (same_type) {
        bytes = {reinterpret_cast<const std::uint8_t*>(masters.data()), masters.size()};
      } else {
        if (to_half)
          detail::cast_masters<half>(masters.data(), take, parameters);
        else
          detail::cast_masters<bfloat16>(masters.data(), take, parameters);
        bytes = parameters;
      }
      for (std::size_t at = 0; at < bytes.size(); at += detail::fingerprint_chunk_bytes) {
        const auto digest =
            detail::sha256::of(bytes.subspan(at, std::min(detail::fingerprint_chunk_bytes, bytes.size() - at)));
        words.resize(words.size() + detail::fingerprint_words_per_chunk);
        std::memcpy(words.data() + words.size() - detail::fingerprint_words_per_chunk, digest.data(), digest.size());
      }
    }
  }
  return detail::fingerprint_of_chunks(words);
}

}  // namespace cohort::inline v0
