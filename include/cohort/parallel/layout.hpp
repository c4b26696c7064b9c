#pragma once
// The one layout under every strategy of training_state (cohort/parallel/training_state.hpp):
// a trainer's tensors as regions of one logical flat buffer, placed in cohort's storage layer
// by layer, cut into buckets that never cross a layer, each padded so it divides by the world
// and split into one equal shard per rank. Everything that moves or updates gradients and
// parameters (all-reduce, reduce-scatter, all-gather, the optimizer's segments, the global
// norm) works on these buckets and shards. Pure functions of the regions, the world and the
// options: every rank derives the same layout, and it is tested without communication.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/config.hpp"

namespace cohort::inline v0 {

// One tensor of the trainer's model: elements [offset, offset + count) of its logical flat
// buffer (llm.c's params_memory, say). `layer` is the unit ZeRO-3 gathers together and the
// order of the backward (the highest layer finishes first); buckets never cross layers.
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

// Regions of a tensor-major layout stacked over layers, as llm.c lays out GPT-2: tensor t's
// `layers` copies sit one after another ([W_0 .. W_{L-1}] then [b_0 .. b_{L-1}]), so a layer's
// tensors are not contiguous in the logical buffer. Region t * layers + l is tensor t of layer
// l, named "<name>.<l>", with that tensor's decay flag and per-layer shape.
struct stacked_tensor {
  std::string name;
  std::size_t per_layer = 0;
  bool decay = true;
  std::vector<std::size_t> shape = {};  // of one layer's tensor; empty: {per_layer}
};
std::vector<region> stacked_regions(const std::vector<stacked_tensor>& tensors, std::size_t layers,
                                    std::size_t first_layer = 0, std::size_t offset = 0);

// Where one region lives in cohort's storage.
struct placed_region {
  std::size_t storage = 0;  // element offset in the storage buffers
  std::size_t count = 0;
  std::size_t bucket = 0;
};

// A piece of this rank's part of the storage that belongs to one region: what the optimizer
// updates with one weight-decay choice and one learning-rate scale. `owned` is its offset in
// the rank's owned buffers (the concatenated shards, or under data parallelism the storage).
struct shard_segment {
  std::size_t storage = 0;
  std::size_t owned = 0;
  std::size_t count = 0;
  std::size_t region = 0;
};

namespace detail {

// A contiguous range of storage: whole regions of one layer, padded to a multiple of
// world x alignment elements, so that every rank's shard has the same size and starts aligned.
struct bucket_range {
  std::size_t begin = 0;   // storage offset
  std::size_t padded = 0;  // elements, a multiple of the world
  std::size_t shard = 0;   // padded / world: each rank's part
  std::size_t layer = 0;
  std::vector<std::size_t> regions;  // in storage order
};

struct storage_layout {
  std::vector<placed_region> regions;                      // by region index
  std::vector<bucket_range> buckets;                       // in storage order; they launch last to first
  std::vector<std::size_t> first_bucket_of_layer;          // by layer, and one past the last layer
  std::vector<std::vector<std::size_t>> regions_of_layer;  // region indices, declaration order
  std::size_t storage = 0;                                 // elements of the padded storage
  std::size_t logical = 0;                                 // elements of the trainer's flat buffer
  std::size_t layers = 0;
};

// Every region inside [0, logical), none overlapping, none empty, every element covered; the
// names unique. The first problem as text (naming regions and element ranges), or empty.
std::string check_regions(const std::vector<region>& regions);

// Regions placed layer by layer (declaration order inside a layer), each starting on an
// `alignment`-element boundary; buckets of whole regions of one layer up to `bucket_elements`
// (a region larger than that gets its own; `merge_layers`: consecutive small layers share one,
// which ZeRO-3 does not, since it gathers layer by layer), padded to world x alignment.
storage_layout plan_storage(const std::vector<region>& regions, int world, std::size_t bucket_elements,
                            bool merge_layers, std::size_t alignment);

// The pieces of storage a rank updates: under data parallelism (`sharded` false) every
// region whole, at owned == storage; sharded, this rank's shard of every bucket cut by region
// (padding and alignment gaps skipped), at owned offsets that concatenate the shards.
std::vector<shard_segment> owned_segments(const storage_layout& layout, int rank, bool sharded);

// The segments the optimizer and the norm walk, fewer: consecutive pieces with the same
// weight decay and learning-rate scale joined across the padding between them (storage and
// owned offsets advancing alike). Padding holds zeros in every buffer, and zeros stay zero
// under every update, so one call covers what took one per region.
std::vector<shard_segment> merged_for_update(const std::vector<shard_segment>& segments,
                                             const std::vector<region>& regions);

// A fingerprint of what must match across ranks for the collectives to pair up.
std::int64_t layout_fingerprint(const std::vector<region>& regions, std::size_t bucket_elements, int strategy,
                                int parameter_type, int gradient_type);

}  // namespace detail
}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/layout.ipp"
#endif
