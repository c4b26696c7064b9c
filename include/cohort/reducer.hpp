#pragma once
// gradient_reducer<Backend>: data parallelism (the DDP job) for hand-written training code.
//
//   cohort::gradient_reducer<cohort::gloo> ddp{pg, model.parameter_sizes()};   // bucket views
//   model.loss_and_gradients(params, ddp.gradients(), x, y, batch,
//                            [&](std::size_t i) { ddp.mark_ready(i); });       // backward
//   ddp.finish();                     // every gradient now holds the average over ranks
//
// Gradients are grouped into size-capped buckets in reverse declaration order (the order a
// backward pass finishes them); a bucket's all-reduce starts as soon as its last gradient is
// marked ready, while the rest of the backward pass still runs. Buckets launch in
// bucket-index order on every rank, so every rank issues the same collective sequence even
// when gradients become ready in different orders.
//
// Averaging is "divide before", as ncclAvg itself does for floating types (it pre-multiplies
// each input by 1/n and sums), and the same on every backend: mark_ready(i) divides floating
// gradient i by the world size in the caller's order (on Gloo right away on the calling
// thread, on NCCL a kernel on the caller's stream), while what the backward just wrote is
// still in cache, and floating buckets are all-reduced as sums. So there is no cold pass over
// the gradients after the wire, and on a host backend nothing is added to the worker that
// the backward shares cores with. Integer buckets are all-reduced with op::avg (summed, then
// divided once: dividing first would truncate every contribution). Compressed buckets
// (bfloat16, half) are averaged with op::avg in the compressed type, and a communication hook
// owns its bucket's averaging.
// Between mark_ready(i) and finish() a gradient belongs to the reducer on every backend (on
// a device its bucket is being reduced asynchronously): do not read or write it then.
//
// Memory: the reducer either owns the gradients (bucket views: one contiguous allocation per
// bucket, gradient(i) is a span into it, nothing is copied) or copies user-owned buffers into
// its buckets when a bucket launches and back after finish() (one batched copy per bucket,
// one kernel on CUDA). Which one follows from the constructor: sizes give bucket views,
// buffers give user buffers.
//
// Ordering, the same on every backend: each bucket's launch waits for what the caller has
// queued (wait_for_caller), its steps run in the backend's order (Gloo: tasks on the group's
// FIFO worker; NCCL: kernels and collectives on the group's stream), and finish() makes the
// caller's order wait for the result (Gloo: the calling thread blocks; NCCL: the caller's
// stream waits, the host does not).
//
// On a device backend the element-wise work launches kernels (cohort/ops.hpp): compile that
// translation unit with nvcc.
// Not thread-safe: one training thread calls mark_ready and finish.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/error.hpp"
#include "cohort/ops.hpp"
#include "cohort/process_group.hpp"
#include "cohort/straggler.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// ---- bucket assignment: a pure function, testable without communication ---------------

struct bucket_caps {
  std::size_t first_bucket_bytes = std::size_t{1} << 20;  // small, so communication starts early
  std::size_t bucket_bytes = std::size_t{25} << 20;
};

struct bucket_layout {
  dtype type = dtype::float32;
  std::vector<std::size_t> gradients;  // gradient indices, in the order they sit in the bucket
  std::vector<std::size_t> offsets;    // element offset of each gradient inside the bucket
  std::size_t elements = 0;            // including alignment padding
  std::size_t bytes() const noexcept { return elements * size_of(type); }
  friend bool operator==(const bucket_layout&, const bucket_layout&) = default;
};

namespace detail {
// Every gradient starts on a 16-byte boundary inside its bucket, so device kernels can use
// vector loads; the padding is zero and stays zero through the reduction.
std::size_t aligned_elements(std::size_t elements, dtype type);
}  // namespace detail

// Walks the gradients in `order` (empty: reverse declaration order) and fills one open bucket
// per dtype; a bucket closes when the next gradient would take it past its cap, or once it
// reaches the cap. The first bucket closed of each dtype uses first_bucket_bytes, later ones
// bucket_bytes. A gradient larger than a cap gets a bucket of its own. Buckets are numbered
// by the position of their first gradient in `order`, so bucket 0 is the first one ready.
std::vector<bucket_layout> assign_buckets(std::span<const std::size_t> sizes, std::span<const dtype> types,
                                          bucket_caps caps = {}, std::span<const std::size_t> order = {});

// ---- options and results ----------------------------------------------------------------

// bucket_views: the reducer owns the gradients (one allocation per bucket). user_buffers: the
// caller's buffers, copied into buckets and back. in_place: the caller's buffers reduced where
// they are (regions of a flat buffer, say): no bucket memory and no copies.
enum class gradient_storage { bucket_views, user_buffers, in_place };
enum class unused_gradients { error, zero };
enum class compression { none, bfloat16, half };

struct reducer_options {
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  std::size_t bucket_bytes = std::size_t{25} << 20;
  // error: finish() with unmarked gradients throws, listing them. zero: unmarked gradients
  // count as zero, and a used-mask is all-reduced so every rank knows which gradients no
  // rank produced (reduction_summary::unused).
  unused_gradients unused = unused_gradients::error;
  // Float buckets are cast to this type for the all-reduce and back (half the bytes).
  compression compress = compression::none;
  // After the first synchronised iteration, re-bucket in the observed ready order (rank 0's
  // order, broadcast). gradient(i) spans change then: fetch them again after finish().
  bool rebuild_after_first_iteration = false;
  // After the reduction, count non-finite values (one all-reduced flag): every rank learns
  // together whether to skip the step. On CUDA this one read blocks the host.
  bool check_nonfinite = false;
  // Called as each bucket's reduction is queued (bucket index): an event log for tests,
  // tracing or profiling.
  std::function<void(std::size_t bucket)> on_launch = {};
  // User buffers only: reduce them where they are instead of copying them through buckets.
  // A bucket's gradients that lie next to each other in memory form one run; each run is one
  // all-reduce, and a bucket's runs are one grouped call (one launch on NCCL). Gradients
  // then need no second copy in memory and no copy per step; hooks and compression, which
  // need a contiguous bucket, are not available.
  bool in_place = false;
  // Straggler report (cohort/straggler.hpp; it must outlive the reducer): each synchronised
  // finish() ends a step and counts the host's time inside it as waiting for communication.
  straggler_report* straggler = nullptr;
};

struct reduction_summary {
  bool synchronized = false;  // false inside no_sync: nothing was communicated
  // check_nonfinite: the NaN and Inf elements all ranks found together (0: none), as
  // step_result::nonfinite counts them.
  std::int64_t nonfinite = 0;
  std::vector<std::size_t> unused;  // unused_gradients::zero: gradients no rank marked
};

// One gradient: its element count and type, and for user-owned storage its buffer.
struct gradient_spec {
  std::size_t count = 0;
  dtype type = dtype::float32;
  void* data = nullptr;

  gradient_spec(std::size_t elements, dtype element_type = dtype::float32) : count(elements), type(element_type) {}
  template <element T>
    requires(!std::is_const_v<T>)
  gradient_spec(std::span<T> buffer) : count(buffer.size()), type(dtype_v<T>), data(buffer.data()) {}
};

// Gradient i of a trainer's flat gradient buffer: elements [offset, offset + count).
struct gradient_region {
  std::size_t offset = 0;
  std::size_t count = 0;
};

// The specs of regions of one flat buffer, for a reducer over the trainer's own memory
// (reducer_options::in_place). Every region must lie inside the buffer; overlaps are refused
// by the reducer, naming both regions.
template <element T>
  requires(!std::is_const_v<T>)
std::vector<gradient_spec> flat_gradients(std::span<T> buffer, std::span<const gradient_region> regions) {
  std::vector<gradient_spec> specs;
  specs.reserve(regions.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    const auto& region = regions[i];
    if (region.offset > buffer.size() || region.count > buffer.size() - region.offset)
      throw error(-1, "flat_gradients",
                  "region " + std::to_string(i) + " (elements " + std::to_string(region.offset) + ".." +
                      std::to_string(region.offset + region.count) + ") ends past the buffer of " +
                      std::to_string(buffer.size()) + " elements",
                  "regions are element offsets and counts inside the flat buffer");
    specs.emplace_back(buffer.subspan(region.offset, region.count));
  }
  return specs;
}
template <element T>
  requires(!std::is_const_v<T>)
std::vector<gradient_spec> flat_gradients(std::span<T> buffer, const std::vector<gradient_region>& regions) {
  return flat_gradients(buffer, std::span<const gradient_region>(regions));
}

// What a communication hook sees: one bucket, laid out contiguously in the backend's memory.
struct bucket_ref {
  std::size_t index;
  void* data;
  std::size_t count;
  dtype type;
};

namespace detail {
std::string describe_gradient(std::size_t index, std::size_t count, dtype type);

// The reducer's cross-rank layout check, apart from the template: the same code whatever the
// backend, compiled once under separate compilation. A row is what one rank contributes:
// whether it refused its gradients, a fingerprint of its layout, its gradient, element and
// bucket counts.
struct layout_check {
  enum column : std::size_t {
    refused_column,
    fingerprint_column,
    gradients_column,
    elements_column,
    buckets_column,
    layout_columns
  };
  static std::vector<std::int64_t> row(bool refused, std::span<const gradient_spec> specs,
                                       std::span<const bucket_layout> layout, compression compress, bool in_place,
                                       std::span<const std::size_t> run_counts, std::size_t buckets);
  // The first rank whose row differs from rank 0's, or world. A rank that refused makes every
  // rank throw: its own reason there, "rank r refused" on the others.
  static int first_mismatch(std::span<const std::int64_t> all, int world, int rank, const std::exception_ptr& refusal);
  static bool same_gradient_count(std::span<const std::int64_t> all, int world);
  // Every gradient's count and dtype, to name the first gradient that differs.
  static std::vector<std::int64_t> shapes(std::span<const gradient_spec> specs);
  // shapes_of_all: every rank's shapes(), or empty when the gradient counts differ.
  [[noreturn]] static void fail(int rank, std::span<const std::int64_t> all, int world, int other,
                                std::size_t gradients, std::span<const std::int64_t> shapes_of_all);
};
}  // namespace detail

// ---- the reducer --------------------------------------------------------------------------

template <backend B>
class gradient_reducer {
 public:
  using work = typename B::work;
  using stream_type = typename B::stream_type;
  // A user communication hook: reduce (average) the bucket in place across the group and
  // return the work whose completion means it is done. Runs in bucket order, after the
  // bucket's inputs are ready in the backend's order (FIFO worker / communication stream).
  using comm_hook = std::function<work(process_group<B>&, const bucket_ref&)>;

  // Collective: every rank constructs its reducer with the same gradients and caps; the
  // layout is compared across ranks once, here. The reducer owns its buckets when every
  // spec has no buffer (bucket views), and copies through them when every spec has one
  // (user buffers).
  //
  // A rank whose own list is unusable (overlapping buffers, say) does not throw alone: the
  // others would wait for it in the layout check until the timeout. Every rank first learns
  // whether any rank refused, then all throw together; the refusing rank throws its reason.
  gradient_reducer(process_group<B>& group, std::vector<gradient_spec> gradients, reducer_options options = {});

  // Bucket views of float32 gradients of these sizes.
  gradient_reducer(process_group<B>& group, const std::vector<std::size_t>& sizes, reducer_options options = {})
      : gradient_reducer(group, specs_from(sizes), std::move(options)) {}
  // gradient_reducer ddp{pg, {512, 32}}: sizes (a braced list would otherwise fit both the
  // sizes and the gradient_spec vector, and be ambiguous).
  gradient_reducer(process_group<B>& group, std::initializer_list<std::size_t> sizes, reducer_options options = {})
      : gradient_reducer(group, specs_from(std::vector<std::size_t>(sizes)), std::move(options)) {}

  // User buffers (spans of one element type), in declaration order.
  template <element T>
  gradient_reducer(process_group<B>& group, std::span<const std::span<T>> buffers, reducer_options options = {})
      : gradient_reducer(group, specs_from(buffers), std::move(options)) {}
  template <element T>
  gradient_reducer(process_group<B>& group, const std::vector<std::span<T>>& buffers, reducer_options options = {})
      : gradient_reducer(group, std::span<const std::span<T>>(buffers), std::move(options)) {}

  gradient_reducer(const gradient_reducer&) = delete;
  gradient_reducer& operator=(const gradient_reducer&) = delete;

  ~gradient_reducer();

  // ---- layout -------------------------------------------------------------------------------
  gradient_storage storage() const noexcept { return storage_; }
  std::size_t gradient_count() const noexcept { return specs_.size(); }
  std::size_t bucket_count() const noexcept { return buckets_.size(); }
  const std::vector<bucket_layout>& layout() const noexcept { return layout_; }
  // Gradient bytes copied per synchronised step (user buffers: into the buckets and back;
  // bucket views and in place: none), and bytes of bucket memory the reducer holds.
  std::size_t copied_bytes_per_step() const noexcept {
    if (storage_ != gradient_storage::user_buffers) return 0;
    std::size_t bytes = 0;
    for (const auto& spec : specs_) bytes += 2 * spec.count * size_of(spec.type);
    return bytes;
  }
  std::size_t bucket_memory_bytes() const noexcept {
    std::size_t bytes = 0;
    for (const auto& bucket : buckets_) bytes += bucket.memory.bytes() + bucket.compression.bytes();
    return bytes;
  }
  // In place: the number of collectives a synchronised step issues (one per run).
  std::size_t run_count() const noexcept {
    std::size_t runs = 0;
    for (const auto& bucket : buckets_) runs += storage_ == gradient_storage::in_place ? bucket.runs.size() : 1;
    return runs;
  }
  // Bumped by every rebuild: spans from gradient() of an older generation are stale.
  std::size_t layout_generation() const noexcept { return generation_; }
  // Which bucket holds gradient i.
  std::size_t bucket_of(std::size_t i) const { return placement_.at(i).bucket; }

  // Gradient i without its element type (where it lives, how many, which dtype): what
  // type-erased work over every gradient needs (clip_grad_norm, say).
  struct gradient_view {
    void* data;
    std::size_t count;
    dtype type;
  };
  gradient_view view(std::size_t i) {
    check_index("view", i);
    return {location(i), specs_[i].count, specs_[i].type};
  }
  process_group<B>& group() noexcept { return *group_; }

  // Bucket views: the span the backward writes gradient i into. User buffers: the user's span.
  template <element T = float>
  std::span<T> gradient(std::size_t i) {
    check_index("gradient", i);
    if (dtype_v<T> != specs_[i].type)
      throw error(rank(), "gradient_reducer.gradient",
                  detail::describe_gradient(i, specs_[i].count, specs_[i].type) + " requested as " +
                      std::string(to_string(dtype_v<T>)),
                  "ask for the element type the gradient was declared with");
    return std::span<T>(static_cast<T*>(location(i)), specs_[i].count);
  }
  // All gradients as spans (one element type), declaration order: what a backward takes.
  template <element T = float>
  std::vector<std::span<T>> gradients() {
    std::vector<std::span<T>> all;
    all.reserve(gradient_count());
    for (std::size_t i = 0; i < gradient_count(); ++i) all.push_back(gradient<T>(i));
    return all;
  }

  // ---- options after construction -------------------------------------------------------
  void register_comm_hook(comm_hook hook) {
    if (storage_ == gradient_storage::in_place)
      throw error(rank(), "gradient_reducer.register_comm_hook", "gradients are reduced in place (regions, no bucket)",
                  "a hook sees one contiguous bucket: use bucket views or user buffers for hooks");
    hook_ = std::move(hook);
  }
  // CUDA: the stream the backward runs on (default: the legacy default stream). Every bucket
  // launch waits for the work queued on it so far; finish() makes it wait for the reduction.
  void set_stream(stream_type stream) noexcept { caller_stream_ = stream; }

  // ---- the iteration --------------------------------------------------------------------------
  // Gradient i is final. When that completes the next buckets in index order, their
  // reductions are queued at once.
  void mark_ready(std::size_t i);
  // The gradient whose storage starts at span.data() (a bucket view or a user buffer).
  template <element T>
  void mark_ready(std::span<T> gradient) {
    const auto found = by_address_.find(static_cast<const void*>(gradient.data()));
    if (found == by_address_.end())
      throw error(rank(), "gradient_reducer.mark_ready", "no gradient starts at this span's address",
                  "pass a span from gradient(i) (bucket views) or one of the buffers the reducer was built from");
    mark_ready(found->second);
  }

  // Waits for every bucket (Gloo) or makes the caller's stream wait (CUDA); afterwards every
  // gradient holds the average across ranks. Inside no_sync: only ends the micro-step.
  // With a straggler report, a synchronised finish() ends the report's step, and its time
  // (entry to return: on Gloo the wait for the buckets, on CUDA only the queueing) is
  // counted as waiting.
  reduction_summary finish();

  // Gradient-accumulation micro-steps: while the scope lives, mark_ready only bookkeeps and
  // finish() communicates nothing. The gradients (views or user buffers) keep what the
  // backward leaves there; accumulate into them, and the next synchronised step reduces the
  // accumulated sums.
  class no_sync_scope {
   public:
    explicit no_sync_scope(gradient_reducer& reducer) : reducer_(&reducer) { ++reducer_->no_sync_depth_; }
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    ~no_sync_scope() {
      if (--reducer_->no_sync_depth_ == 0) reducer_->reset_iteration();
    }

   private:
    gradient_reducer* reducer_;
  };
  [[nodiscard]] no_sync_scope no_sync() {
    if (launched_ > 0)
      throw error(rank(), "gradient_reducer.no_sync",
                  std::to_string(launched_) + " bucket(s) already launched this iteration",
                  "enter no_sync before the backward pass, not during it");
    return no_sync_scope(*this);
  }

  // ---- observation ------------------------------------------------------------------------------
  // Buckets whose reduction has been queued in the current iteration.
  std::size_t launched_buckets() const noexcept { return launched_; }
  // The completion of bucket b's reduction in the current iteration (valid once launched).
  const work& bucket_work(std::size_t b) const { return buckets_.at(b).done; }
  // The ready order observed in the first synchronised iteration (what a rebuild uses).
  const std::vector<std::size_t>& observed_order() const noexcept { return observed_order_; }

  // Collective: re-buckets in rank 0's observed ready order (broadcast, so every rank agrees).
  // Gradient values are carried over; spans from gradient() must be fetched again.
  void rebuild_buckets();

 private:
  struct placement {
    std::size_t bucket = 0;
    std::size_t offset_bytes = 0;
  };
  struct bucket_storage {
    detail::backend_buffer<B> memory;       // the bucket's gradients (empty in place)
    detail::backend_buffer<B> compression;  // compression scratch, or empty
    std::vector<copy_region> copy_in;       // user buffers -> bucket
    std::vector<copy_region> copy_out;      // bucket -> user buffers
    struct run {
      void* data;
      std::size_t count;
    };
    std::vector<run> runs;  // in place: the bucket's gradients, adjacent ones merged
    work done;
  };

  static std::vector<gradient_spec> specs_from(const std::vector<std::size_t>& sizes) {
    std::vector<gradient_spec> specs;
    for (auto n : sizes) specs.emplace_back(n);
    return specs;
  }
  template <element T>
  static std::vector<gradient_spec> specs_from(std::span<const std::span<T>> buffers) {
    std::vector<gradient_spec> specs;
    for (auto buffer : buffers) specs.emplace_back(buffer);
    return specs;
  }

  int rank() const noexcept { return group_->rank(); }
  bucket_caps caps() const { return {options_.first_bucket_bytes, options_.bucket_bytes}; }

  void validate_specs() {
    std::size_t with_buffer = 0;
    for (const auto& spec : specs_) with_buffer += spec.data != nullptr;
    if (with_buffer != 0 && with_buffer != specs_.size())
      throw error(
          rank(), "gradient_reducer",
          std::to_string(with_buffer) + " of " + std::to_string(specs_.size()) + " gradients come with a buffer",
          "give every gradient a buffer (user buffers) or none (bucket views)");
    storage_ = with_buffer == 0 ? gradient_storage::bucket_views : gradient_storage::user_buffers;
    if (specs_.empty())
      throw error(rank(), "gradient_reducer", "no gradients", "pass the gradient sizes or buffers of the model");
    if (options_.in_place) {
      if (storage_ != gradient_storage::user_buffers)
        throw error(rank(), "gradient_reducer", "in_place without buffers: nothing to reduce in place",
                    "pass the gradients' buffers (spans, or flat_gradients regions), or drop in_place");
      if (options_.compress != compression::none)
        throw error(rank(), "gradient_reducer", "in_place with compression",
                    "compression casts a contiguous bucket: use bucket views or user buffers to compress");
      storage_ = gradient_storage::in_place;
    }
    if (storage_ != gradient_storage::bucket_views) refuse_overlapping_buffers();
  }

  // An element in two regions would be copied into two bucket slots and come back from
  // whichever is copied out last: averaged, yet silently wrong for the other gradient.
  void refuse_overlapping_buffers() const {
    struct region {
      std::uintptr_t begin, end;
      std::size_t index;
    };
    std::vector<region> regions;
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const auto begin = reinterpret_cast<std::uintptr_t>(specs_[i].data);
      const std::size_t bytes = specs_[i].count * size_of(specs_[i].type);
      if (bytes > 0) regions.push_back({begin, begin + bytes, i});
    }
    std::sort(regions.begin(), regions.end(), [](const region& a, const region& b) { return a.begin < b.begin; });
    std::size_t reach = 0;  // the region seen so far that ends last
    for (std::size_t k = 1; k < regions.size(); ++k) {
      if (regions[k - 1].end > regions[reach].end) reach = k - 1;
      const region& earlier = regions[reach];
      const region& later = regions[k];
      if (later.begin >= earlier.end) continue;
      const auto describe = [&](const region& r) {
        return detail::describe_gradient(r.index, specs_[r.index].count, specs_[r.index].type);
      };
      const std::size_t from = later.begin - earlier.begin;
      const std::size_t to = std::min(later.end, earlier.end) - earlier.begin;
      throw error(rank(), "gradient_reducer",
                  describe(later) + " and " + describe(earlier) + " overlap: gradient " + std::to_string(later.index) +
                      " starts at byte " + std::to_string(from) + " of gradient " + std::to_string(earlier.index) +
                      ", so bytes " + std::to_string(from) + ".." + std::to_string(to) + " of gradient " +
                      std::to_string(earlier.index) + " are in both",
                  "each gradient needs its own bytes; check the offsets of the slices of your flat buffer");
    }
  }

  void check_index(const char* operation, std::size_t i) const {
    if (i >= gradient_count())
      throw error(rank(), std::string("gradient_reducer.") + operation,
                  "gradient " + std::to_string(i) + " of " + std::to_string(gradient_count()),
                  "gradients are numbered 0 .. n-1 in declaration order");
  }

  void* location(std::size_t i) const {
    if (storage_ != gradient_storage::bucket_views) return specs_[i].data;
    const auto& where = placement_[i];
    return static_cast<char*>(buckets_[where.bucket].memory.data()) + where.offset_bytes;
  }

  static bool compressible(dtype type) { return type == dtype::float32 || type == dtype::float64; }
  dtype compressed_type() const {
    return options_.compress == compression::bfloat16 ? dtype::bfloat16 : dtype::float16;
  }

  // Allocates the buckets of `layout` (zeroed) and the per-gradient bookkeeping.
  void build(std::vector<bucket_layout> layout) {
    auto& engine = group_->backend();
    layout_ = std::move(layout);
    placement_.assign(gradient_count(), placement{});
    buckets_.clear();
    buckets_.resize(layout_.size());
    for (std::size_t b = 0; b < layout_.size(); ++b) {
      auto& bucket = buckets_[b];
      const auto& shape = layout_[b];
      for (std::size_t k = 0; k < shape.gradients.size(); ++k) {
        const std::size_t i = shape.gradients[k];
        placement_[i] = {b, shape.offsets[k] * size_of(shape.type)};
      }
      if (storage_ == gradient_storage::in_place) {
        bucket.runs = runs_of(shape);
        continue;
      }
      bucket.memory = detail::backend_buffer<B>(engine, shape.bytes());
      fill(engine, bucket.memory.data(), shape.elements, shape.type, 0.0);
      if (options_.compress != compression::none && compressible(shape.type))
        bucket.compression = detail::backend_buffer<B>(engine, shape.elements * size_of(compressed_type()));
    }
    by_address_.clear();
    for (std::size_t i = 0; i < gradient_count(); ++i) {
      if (storage_ == gradient_storage::user_buffers) {
        auto& bucket = buckets_[placement_[i].bucket];
        void* inside = static_cast<char*>(bucket.memory.data()) + placement_[i].offset_bytes;
        const std::size_t bytes = specs_[i].count * size_of(specs_[i].type);
        bucket.copy_in.push_back({inside, specs_[i].data, bytes});
        bucket.copy_out.push_back({specs_[i].data, inside, bytes});
      }
      by_address_[location(i)] = i;
    }
    engine.record().wait();  // the zero fill, before anyone writes a view
    pending_.assign(buckets_.size(), 0);
    marked_.assign(gradient_count(), 0);
    reset_iteration();
  }

  // In place: a bucket's gradients by address, those that touch merged into one run.
  std::vector<typename bucket_storage::run> runs_of(const bucket_layout& shape) const {
    std::vector<typename bucket_storage::run> runs;
    std::vector<std::size_t> members(shape.gradients);
    std::sort(members.begin(), members.end(),
              [&](std::size_t a, std::size_t b) { return std::less<const void*>{}(specs_[a].data, specs_[b].data); });
    const std::size_t width = size_of(shape.type);
    for (const std::size_t i : members) {
      if (specs_[i].count == 0) continue;
      if (!runs.empty() && static_cast<char*>(runs.back().data) + runs.back().count * width == specs_[i].data)
        runs.back().count += specs_[i].count;
      else
        runs.push_back({specs_[i].data, specs_[i].count});
    }
    return runs;
  }

  void reset_iteration() {
    std::fill(marked_.begin(), marked_.end(), std::uint8_t{0});
    marked_count_ = 0;
    launched_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      pending_[b] = layout_[b].gradients.size();
    }
    if (!observed_order_complete_) observed_order_.clear();
  }

  // Plain floating buckets: mark_ready averages each gradient (see the top).
  bool divides_when_marked(std::size_t b) const {
    return is_floating(layout_[b].type) && !hook_ && !buckets_[b].compression.data();
  }

  void launch_ready_buckets() {
    while (launched_ < buckets_.size() && pending_[launched_] == 0) launch(launched_++);
  }

  void launch(std::size_t b) {
    auto& engine = group_->backend();
    auto& bucket = buckets_[b];
    const auto& shape = layout_[b];
    engine.wait_for_caller(caller_stream_);
    if (storage_ == gradient_storage::user_buffers) batched_copy(engine, std::span<const copy_region>(bucket.copy_in));
    if (storage_ == gradient_storage::in_place) {
      const op reduce = divides_when_marked(b) ? op::sum : op::avg;
      // A bucket whose gradients are all empty has no run: it is done once what came before is.
      if (bucket.runs.empty()) {
        bucket.done = engine.record();
      } else {
        auto together = group_->grouped();
        for (const auto& run : bucket.runs) bucket.done = all_reduce_bucket(run.data, run.count, shape.type, reduce);
        together.end();
      }
    } else if (hook_) {
      bucket.done = hook_(*group_, bucket_ref{b, bucket.memory.data(), shape.elements, shape.type});
    } else if (bucket.compression.data()) {
      const dtype small = compressed_type();
      cast(engine, bucket.memory.data(), shape.type, bucket.compression.data(), small, shape.elements);
      all_reduce_bucket(bucket.compression.data(), shape.elements, small, op::avg);
      bucket.done = cast(engine, bucket.compression.data(), small, bucket.memory.data(), shape.type, shape.elements);
    } else {
      // Divided as each gradient was marked: sum. Integers: sum, then divide once.
      bucket.done = all_reduce_bucket(bucket.memory.data(), shape.elements, shape.type,
                                      divides_when_marked(b) ? op::sum : op::avg);
    }
    if (options_.on_launch) options_.on_launch(b);
  }

  work all_reduce_bucket(void* data, std::size_t count, dtype type, op reduce) {
    return visit_dtype(type, [&](auto sample) {
      using T = decltype(sample);
      return group_->all_reduce(std::span<T>(static_cast<T*>(data), count), reduce);
    });
  }

  void handle_unmarked() {
    if (options_.unused == unused_gradients::error) {
      std::string list;
      std::size_t shown = 0, missing = 0;
      for (std::size_t i = 0; i < gradient_count(); ++i) {
        if (marked_[i]) continue;
        ++missing;
        if (shown++ < 16)
          list += (list.empty() ? "" : ", ") + detail::describe_gradient(i, specs_[i].count, specs_[i].type);
      }
      if (missing > shown) list += ", ...";
      // Buckets already launched still own their memory on the wire: let them land before
      // the caller may write the next iteration's gradients there.
      for (std::size_t b = 0; b < launched_; ++b) buckets_[b].done.wait();
      reset_iteration();
      throw error(rank(), "gradient_reducer.finish",
                  std::to_string(missing) + " gradient(s) never marked ready: " + list,
                  "mark every gradient in the backward pass, or set unused = unused_gradients::zero for "
                  "parameters a step may skip");
    }
    // Unused here: zero in the bucket, then marked, so its bucket launches like any other.
    auto& engine = group_->backend();
    for (std::size_t i = 0; i < gradient_count(); ++i) {
      if (marked_[i]) continue;
      const auto& where = placement_[i];
      // In place the gradient itself is zeroed (the buffer is what gets reduced).
      void* zeroed = storage_ == gradient_storage::in_place
                         ? location(i)
                         : static_cast<char*>(buckets_[where.bucket].memory.data()) + where.offset_bytes;
      fill(engine, zeroed, specs_[i].count, specs_[i].type, 0.0);
      if (storage_ == gradient_storage::user_buffers) drop_copy_in(i);
      marked_[i] = 1;
      ++marked_count_;
      --pending_[where.bucket];
    }
    // The zero fill above runs in the backend's order, before the buckets that follow it.
    launch_ready_buckets();
    restore_copy_in();
  }

  // Which gradients did any rank produce? Every rank learns the same answer.
  void find_unused_everywhere(std::vector<std::uint8_t> used, reduction_summary& summary) {
    used = all_reduce_values(*group_, used, op::max);
    for (std::size_t i = 0; i < gradient_count(); ++i)
      if (!used[i]) summary.unused.push_back(i);
  }

  // A user buffer of a gradient unused this iteration is not read: its region is zero-filled.
  void drop_copy_in(std::size_t i) {
    auto& regions = buckets_[placement_[i].bucket].copy_in;
    for (auto& region : regions)
      if (region.source == specs_[i].data) {
        dropped_.push_back({&region, region.bytes});
        region.bytes = 0;
      }
  }
  void restore_copy_in() {
    for (auto& [region, bytes] : dropped_) region->bytes = bytes;
    dropped_.clear();
  }

  void check_nonfinite(reduction_summary& summary) {
    auto& engine = group_->backend();
    // The group's staging buffer: no allocation per step (nor a leak when a call throws).
    auto* counter = static_cast<std::int64_t*>(group_->value_staging(sizeof(std::int64_t)));
    fill(engine, counter, 1, dtype::int64, 0.0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (storage_ == gradient_storage::in_place) {
        for (const auto& run : buckets_[b].runs) count_nonfinite(engine, run.data, run.count, layout_[b].type, counter);
      } else {
        count_nonfinite(engine, buckets_[b].memory.data(), layout_[b].elements, layout_[b].type, counter);
      }
    }
    group_->all_reduce(std::span<std::int64_t>(counter, 1), op::sum);
    std::int64_t found = 0;
    engine.copy(&found, counter, sizeof found).wait();
    summary.nonfinite = found;
  }

  // Every rank's gradients and layout must match, or the collectives would pair mismatched
  // buckets. The real sizes and dtypes are compared, not only the padded layout: {4, 2} and
  // {4, 3} floats pad alike, and the third element would be averaged with padding. One
  // all-gather of a fingerprint per rank; a second, on a mismatch only, names the gradient.
  // A rank that refused its own list (`refusal`) says so here, so every rank throws at once.
  // Every rank's layout summary (detail::layout_check) in one all-gather; when they differ,
  // every rank throws the same error naming rank 0 and the first rank unlike it.
  void check_layout_across_ranks(const std::exception_ptr& refusal) {
    using check = detail::layout_check;
    std::vector<std::size_t> run_counts;
    for (const auto& bucket : buckets_)
      for (const auto& run : bucket.runs) run_counts.push_back(run.count);
    const auto row = check::row(refusal != nullptr, specs_, layout_, options_.compress,
                                storage_ == gradient_storage::in_place, run_counts, buckets_.size());
    const auto all = all_gather_values(*group_, std::span<const std::int64_t>(row));
    const int world = group_->world_size();
    const int other = check::first_mismatch(all, world, rank(), refusal);
    if (other == world) return;
    std::vector<std::int64_t> shapes;
    if (check::same_gradient_count(all, world))
      shapes = all_gather_values(*group_, std::span<const std::int64_t>(check::shapes(specs_)));
    check::fail(rank(), all, world, other, gradient_count(), shapes);
  }

  process_group<B>* group_;
  std::vector<gradient_spec> specs_;
  reducer_options options_;
  gradient_storage storage_ = gradient_storage::bucket_views;
  std::vector<bucket_layout> layout_;
  std::vector<bucket_storage> buckets_;
  std::vector<placement> placement_;
  std::unordered_map<const void*, std::size_t> by_address_;
  std::vector<std::size_t> pending_;  // gradients still unmarked, per bucket
  std::vector<std::uint8_t> marked_;
  std::size_t marked_count_ = 0;
  std::size_t launched_ = 0;  // buckets launched this iteration (always a prefix)
  int no_sync_depth_ = 0;
  std::vector<std::size_t> observed_order_;
  bool observed_order_complete_ = false;
  std::size_t generation_ = 0;
  std::vector<std::pair<copy_region*, std::size_t>> dropped_;
  comm_hook hook_;
  stream_type caller_stream_{};
};

template <backend B>
gradient_reducer<B>::gradient_reducer(process_group<B>& group, std::vector<gradient_spec> gradients,
                                      reducer_options options)
    : group_(&group), specs_(std::move(gradients)), options_(std::move(options)) {
  std::exception_ptr refusal;
  try {
    validate_specs();
    std::vector<std::size_t> sizes;
    std::vector<dtype> types;
    for (const auto& spec : specs_) {
      sizes.push_back(spec.count);
      types.push_back(spec.type);
    }
    build(assign_buckets(sizes, types, caps()));
  } catch (...) {
    refusal = std::current_exception();
  }
  check_layout_across_ranks(refusal);  // on a throw, the members free the buckets
}

template <backend B>
gradient_reducer<B>::~gradient_reducer() {
  // Queued reductions write into the buckets: let them finish before the members free them.
  try {
    group_->backend().record().wait();
  } catch (...) {
    // A failed group: the buckets are freed regardless.
  }
}

template <backend B>
auto gradient_reducer<B>::mark_ready(std::size_t i) -> void {
  check_index("mark_ready", i);
  if (marked_[i])
    throw error(
        rank(), "gradient_reducer.mark_ready",
        detail::describe_gradient(i, specs_[i].count, specs_[i].type) + " was marked ready twice in one iteration",
        "mark each gradient once per backward pass (shared parameters: accumulate first, then mark)");
  marked_[i] = 1;
  ++marked_count_;
  if (!observed_order_complete_) observed_order_.push_back(i);
  if (no_sync_depth_ > 0) return;
  const std::size_t bucket = placement_[i].bucket;
  if (group_->world_size() > 1 && divides_when_marked(bucket))  // dividing by 1 would be a pass for nothing
    divide_in_caller_order(group_->backend(), caller_stream_, location(i), specs_[i].count, specs_[i].type,
                           group_->world_size());
  --pending_[bucket];
  launch_ready_buckets();
}

template <backend B>
auto gradient_reducer<B>::finish() -> reduction_summary {
  reduction_summary summary;
  if (no_sync_depth_ > 0) {
    reset_iteration();
    return summary;
  }
  straggler_report* const report = options_.straggler && options_.straggler->enabled() ? options_.straggler : nullptr;
  const auto entered = report ? straggler_report::clock::now() : straggler_report::clock::time_point{};
  summary.synchronized = true;
  auto& engine = group_->backend();
  const bool find_unused = options_.unused == unused_gradients::zero;
  std::vector<std::uint8_t> used;
  if (find_unused) used = marked_;  // before handle_unmarked counts the zero-filled ones as marked
  if (marked_count_ < gradient_count()) handle_unmarked();
  launch_ready_buckets();
  // Every rank issues the used-mask exchange, whatever it marked: a rank that marked every
  // gradient must still meet a rank that did not.
  if (find_unused) find_unused_everywhere(std::move(used), summary);
  if (storage_ == gradient_storage::user_buffers) {
    for (auto& bucket : buckets_) batched_copy(engine, std::span<const copy_region>(bucket.copy_out));
  }
  if (options_.check_nonfinite) check_nonfinite(summary);
  engine.record().make_stream_wait(caller_stream_);
  const bool rebuild_now = options_.rebuild_after_first_iteration && generation_ == 0;
  observed_order_complete_ = true;
  reset_iteration();
  if (rebuild_now) rebuild_buckets();
  if (report) {
    const auto now = straggler_report::clock::now();
    report->add_wait(wait_kind::reduce, now - entered);
    report->end_step(now);
  }
  return summary;
}

template <backend B>
auto gradient_reducer<B>::rebuild_buckets() -> void {
  if (marked_count_ > 0 || launched_ > 0)
    throw error(rank(), "gradient_reducer.rebuild_buckets", "called in the middle of an iteration",
                "rebuild after finish(), before the next backward pass");
  std::vector<std::int64_t> order(gradient_count());
  const bool have_order = observed_order_.size() == gradient_count();
  std::vector<bool> listed(gradient_count(), false);
  std::size_t fill = 0;
  if (have_order)
    for (auto index : observed_order_) {
      order[fill++] = static_cast<std::int64_t>(index);
      listed[index] = true;
    }
  for (std::size_t i = gradient_count(); i-- > 0;)
    if (!listed[i]) order[fill++] = static_cast<std::int64_t>(i);
  broadcast_values(*group_, std::span<std::int64_t>(order), 0);
  std::vector<std::size_t> agreed(order.begin(), order.end());
  std::vector<std::size_t> sizes;
  std::vector<dtype> types;
  for (const auto& spec : specs_) {
    sizes.push_back(spec.count);
    types.push_back(spec.type);
  }
  auto layout = assign_buckets(sizes, types, caps(), agreed);
  auto old_buckets = std::move(buckets_);
  const auto old_placement = placement_;
  build(std::move(layout));
  if (storage_ == gradient_storage::bucket_views) {
    // Carry the (reduced) values over to the new views.
    std::vector<copy_region> moves;
    for (std::size_t i = 0; i < gradient_count(); ++i) {
      const auto& from = old_placement[i];
      const std::size_t bytes = specs_[i].count * size_of(specs_[i].type);
      moves.push_back(
          {location(i), static_cast<char*>(old_buckets[from.bucket].memory.data()) + from.offset_bytes, bytes});
    }
    auto& engine = group_->backend();
    batched_copy(engine, std::span<const copy_region>(moves));
    work moved = engine.record();
    moved.make_stream_wait(caller_stream_);
    moved.wait();
  } else {
    group_->backend().record().wait();
  }
  old_buckets.clear();  // after the copies out of them
  ++generation_;
}

// ---- helpers ---------------------------------------------------------------------------------

// Collective: every parameter takes rank `root`'s values, so replicas start equal. Returns
// the last broadcast's work: collectives complete in issue order, so waiting on it waits
// for all.
template <backend B, element T>
  requires(!std::is_const_v<T>)
typename B::work broadcast_parameters(process_group<B>& group, std::span<const std::span<T>> parameters, int root = 0) {
  typename B::work last;
  for (auto parameter : parameters) last = group.broadcast(parameter, root);
  return last;
}
template <backend B, element T>
  requires(!std::is_const_v<T>)
typename B::work broadcast_parameters(process_group<B>& group, const std::vector<std::span<T>>& parameters,
                                      int root = 0) {
  return broadcast_parameters(group, std::span<const std::span<T>>(parameters), root);
}
// Any range of contiguous ranges, each broadcast in place: a std::vector<std::vector<float>>,
// a std::array of std::arrays, a list of fixed-extent spans, ... (each one what pg.broadcast
// takes: the parameters must outlive the work, so the list is an lvalue).
template <class Parameters, class B>
concept broadcastable_parameters = list_of_contiguous_elements<std::remove_const_t<Parameters>> &&
    requires(process_group<B>& group, Parameters& parameters) {
  requires writable_contiguous_elements<std::remove_cvref_t<decltype(*std::begin(parameters))>>;
  group.broadcast(*std::begin(parameters), 0);
};
template <backend B, broadcastable_parameters<B> Parameters>
typename B::work broadcast_parameters(process_group<B>& group, Parameters& parameters, int root = 0) {
  typename B::work last;
  for (auto&& parameter : parameters) last = group.broadcast(parameter, root);
  return last;
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/reducer.ipp"
#endif
