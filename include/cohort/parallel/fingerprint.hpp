#pragma once
// parameter_sha256(state): one line that says whether two runs hold the same parameters,
// whatever world size, strategy (ddp, zero1, zero2, zero3, hybrid), bucket size and launcher
// each ran with; `cohort-ckpt inspect` prints the same line for a checkpoint
// (checkpoint_parameter_sha256). Users compare runs across clusters by it.
//
// The definition, which anyone can recompute from the flat parameter buffer:
//   - the regions in the order they were declared (the order a checkpoint keeps them in; the
//     flat buffer's own where they were declared by offset, as stacked_regions does);
//   - each region's parameter bytes (type P as in memory, little-endian) cut into chunks of
//     1 MiB, the region's last one shorter; a chunk never spans two regions;
//   - SHA-256 of each chunk; the digest is SHA-256 over the chunks' 32-byte digests, end to
//     end in that order, written as 64 lower-case hex digits.
// In Python, `flat` a little-endian NumPy array of P, `regions` the (offset, count) pairs as
// declared:
//   digests = b""
//   for o, n in regions:
//       data = flat[o:o + n].tobytes()
//       digests += b"".join(hashlib.sha256(data[at:at + 2**20]).digest() for at in range(0, len(data), 2**20))
//   print(hashlib.sha256(digests).hexdigest())
//
// Computed where the shards live: the model is never gathered on one rank. Inside
// evaluation(), layer by layer, gather(layer) (free under ddp, zero1 and zero2; at zero3 the
// layer's all-gather, released at the view's end), and each rank hashes the chunks whose
// global number (over all regions, in the order above) modulo the world is its rank, copying
// each to the host first on a device backend. The chunk digests then meet in one all-reduce of
// 64-bit words in which each rank fills only its own chunks' (exact: every sum has one term),
// and every rank hashes the same bytes. Costs: one pass of SHA-256 over 1/N of the parameters
// per rank, 32 bytes per MiB of parameters on the wire (plus zero3's gathers).
//
// A checkpoint keeps the parameters' masters (fp32, or fp64 for fp64 parameters): where the
// parameters are narrower (half, bfloat16), its digest hashes the masters cast to the
// parameter type as the state casts them (round to nearest even), which is what a state
// trained or loaded with the state's optimizer holds.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cohort/comm/host_values.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/sha256.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {

inline constexpr std::size_t fingerprint_chunk_bytes = std::size_t{1} << 20;
inline constexpr std::size_t fingerprint_words_per_chunk = sizeof(sha256_digest) / sizeof(std::uint64_t);

constexpr std::size_t fingerprint_chunks(std::uint64_t bytes) noexcept {
  return static_cast<std::size_t>((bytes + fingerprint_chunk_bytes - 1) / fingerprint_chunk_bytes);
}

// The digest of the chunk digests, end to end (words: fingerprint_words_per_chunk per chunk,
// the digest's bytes as memcpy put them there).
COHORT_DECL std::string fingerprint_of_chunks(std::span<const std::uint64_t> words);

}  // namespace detail

// Collective: every rank calls it between steps, alike (at zero3 its gathers pair up across
// the ranks); 64 lower-case hex digits, the same on every rank. Under trainer_optimizer, after
// publish_parameters(), as any gather. Refused inside join()'s loop, before any collective:
// there a rank out of data waits in the join's agreement, which the digest's all-reduce would
// meet instead (the others fail within their timeout, as when a join's loop throws).
template <backend B, element P, element G>
std::string parameter_sha256(training_state<B, P, G>& state) {
  if (state.joining())
    throw error(state.rank(), "parameter_sha256",
                "called inside join()'s loop: a rank that ran out of data waits there in the join's agreement, "
                "which the digest's all-reduce would pair with",
                "call parameter_sha256 on every rank after join() returns");
  const auto& regions = state.regions();
  std::vector<std::size_t> first_chunk(regions.size() + 1, 0);
  std::vector<std::vector<std::size_t>> regions_of_layer(state.layer_count());
  for (std::size_t r = 0; r < regions.size(); ++r) {
    first_chunk[r + 1] = first_chunk[r] + detail::fingerprint_chunks(regions[r].count * sizeof(P));
    regions_of_layer.at(regions[r].layer).push_back(r);
  }
  const auto world = static_cast<std::size_t>(state.world_size()), rank = static_cast<std::size_t>(state.rank());
  std::vector<std::uint64_t> words(first_chunk.back() * detail::fingerprint_words_per_chunk, 0);
  auto& engine = state.group().backend();
  std::vector<std::uint8_t> staging;  // a device backend's chunk, on the host
  {
    const auto evaluating = state.evaluation();
    for (std::size_t layer = 0; layer < regions_of_layer.size(); ++layer) {
      const auto view = state.gather(layer);
      if constexpr (B::space != memory_space::host) engine.wait_for_caller(state.stream());
      for (const std::size_t r : regions_of_layer[layer]) {
        const auto* bytes = reinterpret_cast<const std::uint8_t*>(view.param(r).data());
        const std::size_t total = regions[r].count * sizeof(P);
        for (std::size_t c = 0; c < first_chunk[r + 1] - first_chunk[r]; ++c) {
          const std::size_t chunk = first_chunk[r] + c;
          if (chunk % world != rank) continue;
          const std::size_t at = c * detail::fingerprint_chunk_bytes;
          std::span<const std::uint8_t> data(bytes + at, std::min(detail::fingerprint_chunk_bytes, total - at));
          if constexpr (B::space != memory_space::host) {
            staging.resize(data.size());
            engine.copy(staging.data(), data.data(), data.size()).wait();
            data = staging;
          }
          const detail::sha256_digest digest = detail::sha256::of(data);
          std::memcpy(words.data() + chunk * detail::fingerprint_words_per_chunk, digest.data(), digest.size());
        }
      }
    }
  }
  // Labelled, so that a rank that asks alone (printing on rank 0 only) is named as such on
  // every rank; at zero3 the evaluation's agreement names it first.
  const auto labelled = state.group().call_context_within("parameter_sha256");
  return detail::fingerprint_of_chunks(all_reduce_values(state.group(), words));
}

// parameter_sha256's digest of the checkpoint at `checkpoint` (DIR/step-<N>), from its stored
// parameters, every block read verified; what `cohort-ckpt inspect` prints. Reads one region's
// parameters at a time, in pieces of 16 MiB of parameters at most.
COHORT_COLD std::string checkpoint_parameter_sha256(const std::string& checkpoint);

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/fingerprint.ipp"
#endif
