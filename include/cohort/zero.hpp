#pragma once
// zero_optimizer<Backend, P, G>: ZeRO stages 1 and 2 over a trainer's own flat buffers.
//
//   std::vector<cohort::gradient_region> tensors = ...;          // (offset, count) per tensor
//   cohort::zero_optimizer<cohort::gloo, float> zero{pg, params, grads, tensors,
//       {.stage = 2, .adam = {.lr = 3e-4, .weight_decay = 0.1}, .max_grad_norm = 1.0}};
//   backward(params, grads, [&](std::size_t t) { zero.mark_ready(t); });   // stage 2 overlaps
//   auto result = zero.step();       // reduce, norm, clip, Adam on this rank's shard, gather
//   zero.parameters_ready().wait();  // (NCCL: make_stream_wait(stream)) before the next forward
//
// The parameters stay resident in the trainer's buffer (P: float or bfloat16/half), the
// gradients in its gradient buffer (G). The flat buffer is cut into buckets of about
// `bucket_bytes`; each bucket's first N x floor(n/N) elements are reduce-scattered in place,
// so rank r owns chunk r of every bucket, and the last n mod N (< N) elements are
// all-reduced and updated on every rank alike (replicated). This rank keeps, in fp32: the
// master weights of what it owns (initialised from the trainer's parameters shard by shard,
// never a full fp32 copy), Adam's two moments, and the averaged gradient shard: optimizer
// state and gradient memory are 1/N of the model plus < N elements per bucket.
//
// Stage 1 reduce-scatters every bucket in step(); stage 2 launches each bucket as soon as
// every tensor that touches it is marked ready, overlapping the backward, in an order every
// rank derives from the regions alone (a bucket's last tensor in the backward order). After
// the reduction, one exchange of two numbers (the inf/NaN count and the sum of squares)
// gives every rank the same global gradient norm (replicated elements counted once) and
// the same skip decision; the step is then clipped and unscaled through Adam's gradient
// scale, the masters are cast into the trainer's buffer and each bucket is all-gathered
// back in place. Bytes on the wire per step: reduce-scatter + all-gather, the 2(N-1)/N x P
// of an all-reduce.
//
// The element-wise work runs in the backend's order (cohort/ops.hpp): on a device backend
// compile the translation unit with nvcc. Not thread-safe: one training thread drives it.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/error.hpp"
#include "cohort/loss_scaler.hpp"
#include "cohort/ops.hpp"
#include "cohort/optim.hpp"
#include "cohort/parallel/gradient_statistics.hpp"
#include "cohort/process_group.hpp"
#include "cohort/reducer.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

struct zero_options {
  int stage = 2;                                     // 1 or 2
  std::size_t bucket_bytes = std::size_t{25} << 20;  // of gradients (G), per bucket
  adam_options adam = {};
  double max_grad_norm = 0;  // > 0: clip the global gradient norm to this
  // Per region: whether weight decay applies (trainers decay matrices, not biases or norms).
  // Empty: every region decays. Elements outside every region never decay.
  std::vector<std::uint8_t> decay = {};
  // fp16: the trainer scales its loss by scaler->scale(); step() unscales, and skips the
  // step on every rank when any rank's gradients hold an inf or a NaN (it must outlive this).
  loss_scaler* scaler = nullptr;
};

// One result shape for every strategy (cohort/parallel/optimizer_options.hpp).
using zero_step_result = step_result;

template <backend B, element P = float, element G = P>
class zero_optimizer {
 public:
  using work = typename B::work;
  using stream_type = typename B::stream_type;

  // Collective: every rank passes buffers of the same size and the same regions and options.
  zero_optimizer(process_group<B>& group, std::span<P> parameters, std::span<G> gradients,
                 std::vector<gradient_region> regions, zero_options options = {});

  zero_optimizer(const zero_optimizer&) = delete;
  zero_optimizer& operator=(const zero_optimizer&) = delete;
  ~zero_optimizer();

  // CUDA: the stream the backward and forward run on (default: the legacy default stream).
  void set_stream(stream_type stream) noexcept { caller_stream_ = stream; }

  // Region i's gradient is final. Stage 2 launches every bucket this completes, in the order
  // all ranks share; stage 1 only counts.
  void mark_ready(std::size_t region);

  // Reduces what is left, then updates this rank's shard and gathers the parameters back
  // into the trainer's buffer (see parameters_ready()). Stage 2 wants every region marked.
  zero_step_result step();

  // The all-gather of the updated parameters: wait on it (Gloo) or make the forward's
  // stream wait (NCCL) before reading the parameters. Complete after a skipped step.
  const work& parameters_ready() const noexcept { return gathered_; }

  // --- what this rank holds and moves ------------------------------------------------------
  std::size_t owned_elements() const noexcept { return owned_; }
  // fp32 master weights + Adam's two moments, this rank's part.
  std::size_t optimizer_state_bytes() const noexcept { return 3 * owned_ * sizeof(float); }
  std::size_t gradient_shard_bytes() const noexcept { return owned_ * sizeof(float); }
  // Bytes this rank sends per step: reduce-scatter and all-gather (ring: (N-1)/N of each
  // bucket), and the remainders' all-reduce.
  std::size_t wire_bytes_per_step() const noexcept {
    const std::size_t n = static_cast<std::size_t>(group_->size());
    if (n == 1) return 0;
    std::size_t bytes = 0;
    for (const auto& bucket : buckets_) {
      bytes += (n - 1) * bucket.chunk * (sizeof(G) + sizeof(P));
      bytes += 2 * (n - 1) * bucket.remainder * sizeof(G) / n;
    }
    return bytes;
  }
  std::size_t bucket_count() const noexcept { return buckets_.size(); }
  std::uint64_t steps() const noexcept { return steps_; }
  void set_lr(double lr) noexcept { options_.adam.lr = lr; }
  const zero_options& settings() const noexcept { return options_; }

 private:
  struct bucket {
    std::size_t begin = 0, count = 0;  // elements of the flat buffers
    std::size_t chunk = 0;             // per rank: count / N
    std::size_t remainder = 0;         // count - N x chunk, replicated
    std::size_t chunk_offset = 0;      // of this rank's chunk in the shard (chunks first)
    std::size_t remainder_offset = 0;  // of the remainder in the shard (after every chunk)
    std::size_t ready_position = 0;    // when the backward completes it (launch order)
    std::size_t pending = 0;           // regions touching it still unmarked
  };
  struct segment {  // a piece of the shard with one weight-decay choice
    std::size_t offset, count;
    bool decay;
  };

  int rank() const noexcept { return group_->rank(); }
  std::size_t world() const noexcept { return static_cast<std::size_t>(group_->size()); }

  void validate(std::size_t parameter_count, std::size_t gradient_count) const {
    const auto fail = [&](const std::string& what, const std::string& hint) {
      throw error(rank(), "zero_optimizer", what, hint);
    };
    if (options_.stage != 1 && options_.stage != 2)
      fail("stage " + std::to_string(options_.stage), "stage 1 (optimizer state) or 2 (and gradients)");
    if (parameter_count != gradient_count)
      fail(std::to_string(parameter_count) + " parameters but " + std::to_string(gradient_count) + " gradients",
           "the parameter and gradient buffers have one element each per parameter");
    if (parameter_count == 0) fail("empty parameter buffer", "pass the model's flat buffers");
    if (!options_.decay.empty() && options_.decay.size() != regions_.size())
      fail(std::to_string(options_.decay.size()) + " decay flags for " + std::to_string(regions_.size()) + " regions",
           "one flag per region, or none");
    if (options_.bucket_bytes < sizeof(G)) fail("bucket_bytes below one element", "use megabytes");
    std::vector<std::size_t> order(regions_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return regions_[a].offset < regions_[b].offset; });
    for (std::size_t k = 0; k < order.size(); ++k) {
      const auto& region = regions_[order[k]];
      if (region.offset > parameter_count || region.count > parameter_count - region.offset)
        fail("region " + std::to_string(order[k]) + " ends past the buffer of " + std::to_string(parameter_count),
             "regions are element offsets and counts inside the flat buffers");
      if (k > 0) {
        const auto& before = regions_[order[k - 1]];
        if (before.offset + before.count > region.offset)
          fail("regions " + std::to_string(order[k - 1]) + " and " + std::to_string(order[k]) + " overlap",
               "each region needs its own elements");
      }
    }
  }

  // Buckets: consecutive slices of the flat buffers. Each one is launched once every region
  // touching it is marked; they launch in order of the backward position of their last
  // region (regions are marked in reverse order by a backward pass), the same on every rank.
  void plan_buckets() {
    const std::size_t per_bucket = std::max<std::size_t>(options_.bucket_bytes / sizeof(G), 1);
    std::vector<bucket> cut;
    for (std::size_t begin = 0; begin < elements_; begin += per_bucket)
      cut.push_back({.begin = begin, .count = std::min(per_bucket, elements_ - begin)});
    std::vector<std::vector<std::size_t>> touching(cut.size());
    for (std::size_t i = 0; i < regions_.size(); ++i) {
      const auto& region = regions_[i];
      if (region.count == 0) continue;
      const std::size_t backward_position = regions_.size() - 1 - i;
      for (std::size_t b = region.offset / per_bucket; b <= (region.offset + region.count - 1) / per_bucket; ++b) {
        touching[b].push_back(i);
        cut[b].ready_position = std::max(cut[b].ready_position, backward_position);
      }
    }
    std::vector<std::size_t> order(cut.size());
    for (std::size_t b = 0; b < order.size(); ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return cut[a].ready_position < cut[b].ready_position; });
    buckets_of_region_.assign(regions_.size(), {});
    const std::size_t n = world();
    std::size_t chunks = 0;
    for (const std::size_t b : order) {
      bucket next = cut[b];
      next.chunk = next.count / n;
      next.remainder = next.count - n * next.chunk;
      next.chunk_offset = chunks;
      chunks += next.chunk;
      for (const std::size_t i : touching[b]) buckets_of_region_[i].push_back(buckets_.size());
      touched_.push_back(touching[b].size());
      buckets_.push_back(next);
    }
    chunk_elements_ = chunks;
    std::size_t remainders = chunks;
    for (auto& b : buckets_) {
      b.remainder_offset = remainders;
      remainders += b.remainder;
    }
    owned_ = remainders;
    marked_.assign(regions_.size(), 0);
    reset_marks();
    build_segments();
  }

  // The shard's pieces by weight decay: chunks and remainders mapped back to the flat
  // buffer, cut where the decay choice changes.
  void build_segments() {
    std::vector<std::pair<std::size_t, bool>> decay_starts;  // flat offset where a region starts, its flag
    std::vector<std::size_t> order(regions_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return regions_[a].offset < regions_[b].offset; });
    const auto decays = [&](std::size_t flat) {
      // The region holding `flat`, if any (regions are few: a linear search per cut is fine).
      for (const std::size_t i : order) {
        const auto& region = regions_[i];
        if (flat >= region.offset && flat < region.offset + region.count)
          return options_.decay.empty() || options_.decay[i] != 0;
      }
      return false;
    };
    // Flat positions where the decay choice may change: region starts and ends.
    std::vector<std::size_t> cuts;
    for (const auto& region : regions_) {
      cuts.push_back(region.offset);
      cuts.push_back(region.offset + region.count);
    }
    std::sort(cuts.begin(), cuts.end());
    const auto add_piece = [&](std::size_t flat_begin, std::size_t count, std::size_t shard_offset) {
      std::size_t at = flat_begin;
      const std::size_t end = flat_begin + count;
      while (at < end) {
        auto next = std::upper_bound(cuts.begin(), cuts.end(), at);
        const std::size_t stop = next == cuts.end() ? end : std::min<std::size_t>(*next, end);
        const bool decay = decays(at);
        const std::size_t offset = shard_offset + (at - flat_begin);
        if (!segments_.empty() && segments_.back().decay == decay &&
            segments_.back().offset + segments_.back().count == offset)
          segments_.back().count += stop - at;
        else
          segments_.push_back({offset, stop - at, decay});
        at = stop;
      }
    };
    const std::size_t r = static_cast<std::size_t>(rank());
    for (const auto& b : buckets_) add_piece(b.begin + r * b.chunk, b.chunk, b.chunk_offset);
    for (const auto& b : buckets_) add_piece(b.begin + world() * b.chunk, b.remainder, b.remainder_offset);
  }

  // Every rank must cut the same buckets, or the collectives pair up wrongly.
  void check_across_ranks() {
    detail::fnv1a hash;
    hash.mix(elements_);
    hash.mix(static_cast<std::uint64_t>(options_.stage));
    hash.mix(options_.bucket_bytes);
    hash.mix(static_cast<std::uint64_t>(dtype_v<P>));
    hash.mix(static_cast<std::uint64_t>(dtype_v<G>));
    for (const auto& region : regions_) {
      hash.mix(region.offset);
      hash.mix(region.count);
    }
    const auto mine = static_cast<std::int64_t>(hash.value() & 0x7fffffffffffffffull);
    std::vector<std::int64_t> all(world());
    exchange_host(&mine, all.data(), [&](std::int64_t* in, std::int64_t* out) {
      return group_->all_gather(std::span<const std::int64_t>(in, 1), std::span<std::int64_t>(out, world()));
    });
    for (std::size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0])
        throw error(rank(), "zero_optimizer",
                    "rank " + std::to_string(r) +
                        " has another layout than rank 0 (buffer size, regions, stage, "
                        "bucket size or dtypes differ)",
                    "build the optimizer from the same model and options on every rank");
  }

  // A few host values through a collective, staged through the backend's memory.
  template <class T, class Collective>
  void exchange_host(const T* in_values, T* out_values, Collective&& collective) {
    auto& engine = group_->backend();
    auto* in = static_cast<T*>(engine.allocate(sizeof(T)));
    auto* out = static_cast<T*>(engine.allocate(world() * sizeof(T)));
    try {
      engine.copy(in, in_values, sizeof(T));
      collective(in, out);
      engine.copy(out_values, out, world() * sizeof(T)).wait();
    } catch (...) {
      try {
        engine.record().wait();
      } catch (...) {}
      engine.deallocate(in, sizeof(T));
      engine.deallocate(out, world() * sizeof(T));
      throw;
    }
    engine.deallocate(in, sizeof(T));
    engine.deallocate(out, world() * sizeof(T));
  }

  float* allocate_floats(std::size_t count) {
    auto& engine = group_->backend();
    const std::size_t bytes = std::max<std::size_t>(count, 1) * sizeof(float);
    void* pointer = engine.allocate(bytes);
    allocations_.push_back({pointer, bytes});
    fill(engine, pointer, count, dtype::float32, 0.0);
    return static_cast<float*>(pointer);
  }

  // fp32 masters from the trainer's parameters, one piece of the shard at a time.
  void allocate_state() {
    master_ = allocate_floats(owned_);
    first_ = allocate_floats(owned_);
    second_ = allocate_floats(owned_);
    gradient_shard_ = allocate_floats(owned_);
    auto& engine = group_->backend();
    stats_ = engine.allocate(2 * sizeof(double));
    allocations_.push_back({stats_, 2 * sizeof(double)});
    const std::size_t r = static_cast<std::size_t>(rank());
    engine.wait_for_caller(caller_stream_);
    for (const auto& b : buckets_) {
      if (b.chunk)
        cast(engine, parameters_ + b.begin + r * b.chunk, dtype_v<P>, master_ + b.chunk_offset, dtype::float32,
             b.chunk);
      if (b.remainder)
        cast(engine, parameters_ + b.begin + world() * b.chunk, dtype_v<P>, master_ + b.remainder_offset,
             dtype::float32, b.remainder);
    }
    engine.record().wait();
  }

  void reset_marks() {
    std::fill(marked_.begin(), marked_.end(), std::uint8_t{0});
    marked_count_ = 0;
    launched_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b) buckets_[b].pending = touched_[b];
  }

  void launch_ready() {
    while (launched_ < buckets_.size() && buckets_[launched_].pending == 0) launch(launched_++);
  }

  // In place: chunk r of the bucket is reduce-scattered onto rank r's chunk, the remainder
  // all-reduced; then this rank's part goes to its fp32 gradient shard.
  void launch(std::size_t index) {
    auto& engine = group_->backend();
    const bucket& b = buckets_[index];
    const std::size_t r = static_cast<std::size_t>(rank());
    G* base = gradients_ + b.begin;
    engine.wait_for_caller(caller_stream_);
    {
      auto together = group_->grouped();
      if (b.chunk)
        group_->reduce_scatter(std::span<const G>(base, world() * b.chunk), std::span<G>(base + r * b.chunk, b.chunk),
                               op::avg);
      if (b.remainder) group_->all_reduce(std::span<G>(base + world() * b.chunk, b.remainder), op::avg);
      together.end();
    }
    if (b.chunk)
      cast(engine, base + r * b.chunk, dtype_v<G>, gradient_shard_ + b.chunk_offset, dtype::float32, b.chunk);
    if (b.remainder)
      cast(engine, base + world() * b.chunk, dtype_v<G>, gradient_shard_ + b.remainder_offset, dtype::float32,
           b.remainder);
  }

  // Replicated elements (the remainders) are counted by rank 0 only: each element counts once.
  void measure(zero_step_result& result) {
    auto& engine = group_->backend();
    detail::agree_on_gradient_statistics(
        *group_, stats_, true,
        [&](double* squares) {
          sum_of_squares(engine, gradient_shard_, chunk_elements_, dtype::float32, squares);
          if (rank() == 0)
            sum_of_squares(engine, gradient_shard_ + chunk_elements_, owned_ - chunk_elements_, dtype::float32,
                           squares);
        },
        [&](std::int64_t* count) {
          count_nonfinite(engine, gradient_shard_, chunk_elements_, dtype::float32, count);
          if (rank() == 0)
            count_nonfinite(engine, gradient_shard_ + chunk_elements_, owned_ - chunk_elements_, dtype::float32, count);
        },
        result);
  }

  void update(double grad_scale) {
    auto& engine = group_->backend();
    ++steps_;
    const auto& o = options_.adam;
    detail::adam_coefficients c = detail::adam_coefficients_at(o, steps_, grad_scale);
    for (const auto& piece : segments_) {
      c.weight_decay = piece.decay ? o.weight_decay : 0.0;
      adam_step(engine, master_ + piece.offset, gradient_shard_ + piece.offset, first_ + piece.offset,
                second_ + piece.offset, piece.count, c);
    }
  }

  // The masters into the trainer's buffer, then every bucket's chunks gathered in place.
  work gather() {
    auto& engine = group_->backend();
    const std::size_t r = static_cast<std::size_t>(rank());
    for (const auto& b : buckets_) {
      if (b.chunk)
        cast(engine, master_ + b.chunk_offset, dtype::float32, parameters_ + b.begin + r * b.chunk, dtype_v<P>,
             b.chunk);
      if (b.remainder)
        cast(engine, master_ + b.remainder_offset, dtype::float32, parameters_ + b.begin + world() * b.chunk,
             dtype_v<P>, b.remainder);
    }
    {
      auto together = group_->grouped();
      for (const auto& b : buckets_)
        if (b.chunk)
          group_->all_gather(std::span<const P>(parameters_ + b.begin + r * b.chunk, b.chunk),
                             std::span<P>(parameters_ + b.begin, world() * b.chunk));
      together.end();
    }
    work done = engine.record();
    done.make_stream_wait(caller_stream_);
    return done;
  }

  process_group<B>* group_;
  P* parameters_;
  G* gradients_;
  std::size_t elements_;
  std::vector<gradient_region> regions_;
  zero_options options_;
  std::vector<bucket> buckets_;       // in launch order
  std::vector<std::size_t> touched_;  // regions touching each bucket
  std::vector<std::vector<std::size_t>> buckets_of_region_;
  std::vector<segment> segments_;
  std::vector<std::uint8_t> marked_;
  std::size_t marked_count_ = 0;
  std::size_t launched_ = 0;
  std::size_t chunk_elements_ = 0;
  std::size_t owned_ = 0;
  float* master_ = nullptr;
  float* first_ = nullptr;
  float* second_ = nullptr;
  float* gradient_shard_ = nullptr;
  void* stats_ = nullptr;
  std::vector<std::pair<void*, std::size_t>> allocations_;
  std::uint64_t steps_ = 0;
  work gathered_;
  stream_type caller_stream_{};
};

template <backend B, element P, element G>
zero_optimizer<B, P, G>::zero_optimizer(process_group<B>& group, std::span<P> parameters, std::span<G> gradients,
                                        std::vector<gradient_region> regions, zero_options options)
    : group_(&group),
      parameters_(parameters.data()),
      gradients_(gradients.data()),
      elements_(parameters.size()),
      regions_(std::move(regions)),
      options_(std::move(options)) {
  static_assert(is_floating(dtype_v<P>) && is_floating(dtype_v<G>), "ZeRO updates floating parameters");
  validate(parameters.size(), gradients.size());
  plan_buckets();
  check_across_ranks();
  allocate_state();
}

template <backend B, element P, element G>
zero_optimizer<B, P, G>::~zero_optimizer() {
  auto& engine = group_->backend();
  try {
    engine.record().wait();  // nothing queued may still use what is freed below
  } catch (...) {}
  for (auto& [pointer, bytes] : allocations_) engine.deallocate(pointer, bytes);
}

template <backend B, element P, element G>
auto zero_optimizer<B, P, G>::mark_ready(std::size_t region) -> void {
  if (region >= regions_.size())
    throw error(rank(), "zero_optimizer.mark_ready",
                "region " + std::to_string(region) + " of " + std::to_string(regions_.size()),
                "regions are numbered as they were passed");
  if (marked_[region])
    throw error(rank(), "zero_optimizer.mark_ready", "region " + std::to_string(region) + " marked twice in one step",
                "mark each region once per backward pass");
  marked_[region] = 1;
  ++marked_count_;
  for (const std::size_t b : buckets_of_region_[region]) --buckets_[b].pending;
  if (options_.stage == 2) launch_ready();
}

template <backend B, element P, element G>
auto zero_optimizer<B, P, G>::step() -> zero_step_result {
  if (options_.stage == 2 && marked_count_ != regions_.size()) {
    const std::size_t missing = regions_.size() - marked_count_;
    reset_marks();
    throw error(rank(), "zero_optimizer.step", std::to_string(missing) + " region(s) never marked ready",
                "stage 2 reduces buckets as their regions are marked: mark every region in the backward");
  }
  for (auto& bucket : buckets_) bucket.pending = 0;  // stage 1: everything is final now
  launch_ready();
  zero_step_result result;
  result.loss_scale = options_.scaler ? options_.scaler->scale() : 1.0;
  measure(result);
  const bool skip = result.nonfinite > 0;
  if (options_.scaler) options_.scaler->update(skip);
  result.skipped = skip;
  if (!skip) {
    result.clip_factor = detail::clip_factor(result.grad_norm, options_.max_grad_norm);
    update(result.clip_factor / result.loss_scale);
    gathered_ = gather();
  }
  reset_marks();
  return result;
}

}  // namespace cohort::inline v0
