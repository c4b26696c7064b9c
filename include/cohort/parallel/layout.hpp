#pragma once
// The one layout under every strategy of training_state (cohort/parallel/training_state.hpp):
// a trainer's tensors as regions of its flat buffer, kept in the trainer's own order (nothing
// is moved, reordered or padded inside that buffer), grouped into buckets by layer. A bucket is
// a set of regions; the regions of a bucket that sit next to each other in the buffer form one
// range, and each range is cut into one equal chunk per rank plus a remainder of fewer than
// world elements. Everything that moves or updates gradients and parameters (all-reduce,
// reduce-scatter, all-gather, the optimizer's segments, the global norm, a checkpoint's
// pieces) works on these ranges and chunks. Pure functions of the regions, the world and the
// options: every rank derives the same layout, and it is tested without communication.
//
// Why chunk plus remainder: a reduce-scatter or all-gather needs equal counts per rank, and a
// range of the trainer's buffer cannot be padded. A range of `count` elements is reduce-
// scattered over its first world x (count / world) elements, rank k keeping chunk k; the last
// count % world elements (none when the world divides the count, as it does most tensors) are
// all-reduced instead and every rank holds and updates them, as under data parallelism.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/config.hpp"

namespace cohort::inline v0 {

// One tensor of the trainer's model: elements [offset, offset + count) of its flat buffer
// (llm.c's params_memory, say). `layer` is the unit ZeRO-3 gathers together and the order of
// the backward (the highest layer finishes first); buckets never split a layer's region.
struct region {
  std::string name;
  std::size_t offset = 0;
  std::size_t count = 0;
  std::size_t layer = 0;
  bool decay = true;      // AdamW's decoupled weight decay applies (matrices, not biases/norms)
  double lr_scale = 1.0;  // a parameter group's learning rate, relative to the optimizer's
  // The tensor's shape, row-major (a Linear's weight: {out, in}), for what exports it
  // (consolidate_checkpoint's safetensors); empty: 1-D, {count}. Its product must be count.
  std::vector<std::size_t> shape = {};
};

// Regions of a tensor-major layout stacked over layers, as llm.c lays out GPT-2's blocks:
// tensor t's `layers` copies sit one after another in the buffer ([W_0 .. W_{L-1}] then
// [b_0 .. b_{L-1}]), so one tensor of every block is contiguous and a block's tensors are not.
// The buffer stays in that order: region t * layers + l is block l's slice of tensor t, at
// `offset` + (the tensors before it) + l x per_layer, named "<name>.<l>" with the trainer's
// own block number l (0 .. layers - 1), in the state's layer `first_layer + l`, with the
// tensor's decay flag and per-layer shape.
struct stacked_tensor {
  std::string name;
  std::size_t per_layer = 0;
  bool decay = true;
  std::vector<std::size_t> shape = {};  // of one layer's tensor; empty: {per_layer}
};
std::vector<region> stacked_regions(const std::vector<stacked_tensor>& tensors, std::size_t layers,
                                    std::size_t first_layer = 0, std::size_t offset = 0);

// Where one region lives among the state's buckets.
struct placed_region {
  std::size_t bucket = 0;
  std::size_t range = 0;   // its range in the bucket
  std::size_t packed = 0;  // its offset in the bucket's packed buffer (the ranges end to end)
};

// A piece of one region that this rank updates (or, in a checkpoint, that a rank writes):
// elements [offset, offset + count) of the flat buffer, at `owned` in the rank's owned
// numbering (the optimizer state's index: under ddp the flat buffer's own offsets; sharded,
// the rank's chunks and the remainders, range after range).
struct shard_segment {
  std::size_t offset = 0;
  std::size_t owned = 0;
  std::size_t count = 0;
  std::size_t region = 0;
};

namespace detail {

// A run of the flat buffer inside a bucket: whole regions, adjacent in the buffer.
struct bucket_range {
  std::size_t offset = 0;  // in the flat buffer
  std::size_t count = 0;
  std::size_t packed = 0;     // in the bucket's packed buffer
  std::size_t owned = 0;      // sharded: this range's chunk, then its remainder, in every rank's owned numbering
  std::size_t chunk = 0;      // count / world: rank k's part is [offset + k x chunk, + chunk)
  std::size_t remainder = 0;  // count % world, at [offset + world x chunk, offset + count): held by every rank
};

struct bucket {
  std::vector<bucket_range> ranges;  // by offset
  std::vector<std::size_t> regions;  // by offset
  std::size_t elements = 0;          // of its regions: the packed buffer's length
  std::size_t layer = 0;             // its first layer (zero3: its only one)
};

struct state_layout {
  std::vector<placed_region> regions;                      // by region index
  std::vector<bucket> buckets;                             // by layer, upward; they launch last to first
  std::vector<std::size_t> first_bucket_of_layer;          // by layer, and one past the last layer
  std::vector<std::vector<std::size_t>> regions_of_layer;  // region indices, declaration order
  std::size_t elements = 0;                                // of the trainer's flat buffer
  std::size_t layers = 0;
  std::size_t owned = 0;  // sharded: elements each rank owns (its chunks and every remainder)
  int world = 1;
};

// Every region inside [0, elements), none overlapping, none empty, every element covered; the
// names unique. `elements` 0: the buffer ends where the last region does. The first problem
// as text (naming regions and element ranges), or empty.
std::string check_regions(const std::vector<region>& regions, std::size_t elements = 0);

// Buckets of whole regions, numbered by layer upward (they launch last to first). Merged
// (`merge_layers`: ddp, zero1, zero2) they fill in the backward's order, from the last layer's
// last region down, across layers, as DDP's do: each closes once it holds `bucket_elements`,
// the first to launch once it holds `first_bucket_elements` (0: the same; capped at
// bucket_elements), so that the reduction starts early in the backward; none grows past
// bucket_elements (a larger region gets a bucket of its own), and the last to launch holds
// what is left. Layer by layer (ZeRO-3, which gathers layer by layer): a layer's regions in
// declaration order, up to bucket_elements. Each bucket's regions are joined into ranges
// where they are adjacent in the buffer.
state_layout plan_layout(const std::vector<region>& regions, int world, std::size_t bucket_elements, bool merge_layers,
                         std::size_t first_bucket_elements = 0);

// The pieces of `rank`'s chunks, by region, in the rank's owned numbering (`flat`: the flat
// buffer's offsets instead, as under ddp), with the remainders too where `remainders` says.
std::vector<shard_segment> chunk_segments(const std::vector<region>& regions, const state_layout& layout, int rank,
                                          bool remainders, bool flat);

// Consecutive pieces joined where both their offsets and their owned positions run on, and
// (`same_group`) their weight decay and learning-rate scale match: fewer calls for the
// optimizer (same_group) and for the norm (any pieces).
std::vector<shard_segment> joined_segments(const std::vector<shard_segment>& segments,
                                           const std::vector<region>& regions, bool same_group);

// A fingerprint of what must match across ranks for the collectives to pair up.
std::int64_t layout_fingerprint(const std::vector<region>& regions, std::size_t elements, std::size_t bucket_elements,
                                std::size_t first_bucket_elements, int strategy, int parameter_type, int gradient_type);

}  // namespace detail
}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/layout.ipp"
#endif
