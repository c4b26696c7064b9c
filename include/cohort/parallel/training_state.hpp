#pragma once
// training_state<Backend, P, G>: one training state under every strategy. The same trainer
// source trains data-parallel (DDP), with optimizer state sharded (ZeRO-1), with gradients
// sharded too (ZeRO-2), or with parameters sharded as well (ZeRO-3, FSDP), by one option:
// Over 400 lines: one class's declaration and its contract, which a trainer reads in one place
// (the member templates' bodies are in impl/training_state.hpp).
//
//   std::vector<cohort::region> regions = ...;     // the model's tensors in its flat buffer
//   cohort::training_state<cohort::gloo> state{pg, regions,
//       {.strategy = cohort::strategy::zero2, .adam = {.lr = 3e-4, .weight_decay = 0.1},
//        .max_grad_norm = 1.0}};
//   state.load_parameters(initial);                // the trainer's flat buffer, on every rank
//   for (l in layers)           { auto layer = state.gather(l); forward(layer.param(r)...); }
//   for (l in layers, reversed) { auto layer = state.gather(l);
//                                 backward(layer.param(r)..., state.gradient(r)...);
//                                 state.mark_ready(r) for the layer's regions; }
//   auto result = state.step();                    // norm, clipping, AdamW, parameters back
//
// What each strategy keeps per rank (N ranks, P bytes of parameters):
//   ddp    parameters, gradients and optimizer state in full; gradients all-reduced per
//          bucket as the backward marks them; every rank updates everything.
//   zero1  optimizer state 1/N: buckets reduce-scattered in step(), this rank's shard updated,
//          the parameters all-gathered back in place.
//   zero2  gradients 1/N as well: a bucket's gradients live in a pooled buffer from its first
//          gradient() to its reduce-scatter, launched during the backward.
//   zero3  parameters 1/N as well: gather(layer) all-gathers a layer into a pooled buffer
//          (prefetching the next in the direction of travel) and the view's end releases it.
// Wire bytes per step (nccl-tests bus bytes): 2(N-1)/N x P for ddp, zero1 and zero2,
// 3(N-1)/N x P for zero3 (the gathers of the forward and of the backward, the reduce-scatter).
//
// Hybrid sharding (HSDP): pass `replicas`, the ranks that hold this rank's place in copies of
// the state's group (one rank per copy, e.g. a node-local group with the ranks of the same
// local rank on the other nodes beside it):
//
//   auto node  = pg.split(env.node_rank(), pg.local_rank());   // shards: N ranks per node
//   auto peers = pg.split(pg.local_rank(), env.node_rank());   // replicas: R nodes
//   cohort::training_state<cohort::nccl> state{*node, regions, options, &*peers};
//
// The state shards inside its group as above, and every reduction in the group (a bucket's
// reduce-scatter, or its all-reduce under ddp) is followed by an average of the part this
// rank keeps across the replicas: every copy of the group then holds bit-for-bit the same
// gradients, so the norm counts each element once, an inf or a NaN on any rank of any copy
// reaches every copy (every rank skips alike), and the copies' updates stay identical without
// exchanging parameters. Only the gradients cross between copies: R copies add 2(R-1)/R x the
// kept gradients to each rank's wire bytes (P/N sharded, P under ddp). Every copy must have
// the same group size, and each replica group one rank per place; the constructor checks both.
// Checkpoints: save_checkpoint has the first copy write, every copy loads; join() and an
// async_checkpointer refuse replicas.
//
// One layout serves them all (cohort/parallel/layout.hpp): regions placed in cohort's
// storage layer by layer, buckets of whole regions of one layer padded to a multiple of the
// world, each rank's shard one equal slice of every bucket. Buckets launch last to first
// (the backward's order), each once all its regions are marked and every bucket before it
// in that order has launched: the same sequence of collectives on every rank, whatever order
// a rank marks in. A region a rank never marks contributes zeros. One optimizer layer
// (AdamW, or SGD with momentum) runs over this rank's segments with per-region weight decay
// and learning-rate scale, fp32 masters where P is narrower (P itself where it is float), the
// global norm (each element counted once) and its clipping, and a loss scaler whose skip is
// the same on every rank.
//
// Gradients are zero at the start of each step: a backward may add into gradient(r) or
// overwrite it; under no_sync() it must add, for the micro-steps to accumulate. On a device
// backend set_stream() names the stream the trainer computes on: collectives wait for it,
// and it waits for the gathers and the step. Not thread-safe: one training thread drives it.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/comm/detail/buffer_pool.hpp"
#include "cohort/comm/host_values.hpp"
#include "cohort/comm/ops.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/diagnostics/straggler.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/gradient_statistics.hpp"
#include "cohort/parallel/layout.hpp"
#include "cohort/parallel/loss_scaler.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

enum class strategy : std::uint8_t { ddp, zero1, zero2, zero3 };

constexpr std::string_view to_string(strategy s) noexcept {
  switch (s) {
    case strategy::ddp: return "ddp";
    case strategy::zero1: return "zero1";
    case strategy::zero2: return "zero2";
    case strategy::zero3: return "zero3";
  }
  return "unknown";
}

// "ddp", "zero1", "zero2", "zero3" (as cohort-plan advises them); nullopt for anything else.
constexpr std::optional<strategy> parse_strategy(std::string_view text) noexcept {
  for (strategy s : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    if (text == to_string(s)) return s;
  return std::nullopt;
}

struct training_options {
  cohort::strategy strategy = strategy::ddp;
  std::size_t bucket_bytes = std::size_t{25} << 20;  // of gradients, per bucket
  adam_options adam = {};                            // AdamW, the default optimizer
  std::optional<sgd_options> sgd = {};               // set: SGD (with momentum) instead
  double max_grad_norm = 0;                          // > 0: clip the global norm to this
  // fp16: the trainer scales its loss by scaler->scale(); step() unscales, and skips on every
  // rank when any rank's gradients hold an inf or a NaN. It must outlive the state.
  loss_scaler* scaler = nullptr;
  int prefetch = 1;  // zero3: layers gathered ahead, in the direction of travel
  // Called as each bucket's reduction is queued (bucket index): to see the overlap.
  std::function<void(std::size_t bucket)> on_launch = {};
  // Straggler report (cohort/diagnostics/straggler.hpp; it must outlive the state): each step() ends a
  // step, and its time counts as waiting for communication; so does a zero3 gather()'s wait.
  straggler_report* straggler = nullptr;
};

// Bytes one rank holds, by kind; pooled buffers count at their peak.
struct training_memory {
  std::size_t parameters = 0;       // resident parameters (zero3: the shard) and gathered layers
  std::size_t gradients = 0;        // resident gradients (zero2/3: the shard) and bucket buffers
  std::size_t optimizer_state = 0;  // masters (where apart from the parameters), moments, scratch
  std::size_t total() const noexcept { return parameters + gradients + optimizer_state; }
};

// A copy of the saved state in flight on another thread (an async_checkpointer's snapshot):
// whatever changes that state (step, a load) waits for it first. Held by the state; armed and
// released by the copy's owner.
class checkpoint_copy_fence {
 public:
  void arm() {
    std::lock_guard lock(mutex_);
    ++copies_;
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      --copies_;
    }
    done_.notify_all();
  }
  // Until no copy is in flight; the seconds it waited (0 when none was).
  double wait() {
    std::unique_lock lock(mutex_);
    if (copies_ == 0) return 0;
    const auto started = std::chrono::steady_clock::now();
    done_.wait(lock, [&] { return copies_ == 0; });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    waited_ += waited;
    return waited;
  }
  // Every wait so far, in seconds: the training time a checkpoint's copy cost.
  double waited_seconds() const {
    std::lock_guard lock(mutex_);
    return waited_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable done_;
  int copies_ = 0;
  double waited_ = 0;
};

template <backend B, element P = float, element G = P>
class training_state {
 public:
  using work = typename B::work;
  using stream_type = typename B::stream_type;
  // The optimizer's arithmetic: fp32, or fp64 for fp64 parameters.
  using master_type = std::conditional_t<std::is_same_v<P, double>, double, float>;
  static_assert(is_floating(dtype_v<P>) && is_floating(dtype_v<G>), "training_state trains floating parameters");

  // Collective: every rank passes the same regions and options. A rank whose own input is
  // unusable does not throw alone (the others would wait for it until the timeout): every
  // rank learns in one exchange whether any refused, and all throw together.
  // `replicas` (hybrid sharding, above; it must outlive the state): this rank's replica group.
  training_state(process_group<B>& group, std::vector<region> regions, training_options options = {},
                 process_group<B>* replicas = nullptr);
  training_state(const training_state&) = delete;
  training_state& operator=(const training_state&) = delete;
  ~training_state();

  // CUDA: the stream the trainer computes on (default: the legacy default stream).
  void set_stream(stream_type stream) noexcept { caller_stream_ = stream; }

  // --- parameters ----------------------------------------------------------------------------
  // The trainer's flat buffer (its logical layout), the same on every rank: each rank keeps
  // what its strategy holds. Under ddp, zero1 and zero2, where ranks hold the parameters
  // whole, rank 0's buffer is broadcast (collective), so replicas start equal whatever each
  // rank passed; at zero3 each element comes from the one rank that holds it. Host memory on a
  // host backend; any memory cudaMemcpy reaches on a device one.
  void load_parameters(std::span<const P> logical);
  // Collective: the parameters in the trainer's flat layout, on every rank (host memory).
  std::vector<P> gather_parameters();

  // A layer's parameters while the view lives: free where parameters stay resident (ddp,
  // zero1, zero2); at zero3 an all-gather into a pooled buffer, released at the view's end.
  class layer_view {
   public:
    layer_view() = default;
    layer_view(layer_view&& other) noexcept { *this = std::move(other); }
    layer_view& operator=(layer_view&& other) noexcept {
      if (this != &other) {
        reset();
        state_ = std::exchange(other.state_, nullptr);
        layer_ = other.layer_;
      }
      return *this;
    }
    ~layer_view() { reset(); }
    // Region r's parameters (r must belong to this layer). Device memory on a device backend.
    std::span<P> param(std::size_t r) const { return state_->parameter_span(layer_, r); }
    std::size_t layer() const noexcept { return layer_; }
    void reset() noexcept {
      if (state_) std::exchange(state_, nullptr)->release_layer(layer_);
    }

   private:
    friend class training_state;
    layer_view(training_state* state, std::size_t layer) : state_(state), layer_(layer) {}
    training_state* state_ = nullptr;
    std::size_t layer_ = 0;
  };
  [[nodiscard]] layer_view gather(std::size_t layer);

  // --- gradients and the step ----------------------------------------------------------------
  // Where the backward writes region r's gradient (zero at the start of a step). At zero2
  // and zero3 valid from this call until r's bucket is reduced: ask right before writing.
  std::span<G> gradient(std::size_t r);
  // Region r's gradient is final (once per step). ddp and zero2 launch every bucket this
  // completes, in the order all ranks share; zero1 reduces in step(); zero3 reduces a layer's
  // buckets once the backward's view of it ends (at the next gather or step()), so that its
  // gathers and reductions interleave alike on every rank whatever each marked.
  void mark_ready(std::size_t r);
  // Every region of `layer` at once (a transformer block's tensors, stacked or not).
  void mark_layer_ready(std::size_t layer);
  // Reduces what is left, then the global norm, clipping and the loss scaler's decision,
  // the optimizer on this rank's segments and the parameters back where they are read.
  step_result step();

  // Gradient-accumulation micro-steps: while the scope lives, mark_ready only bookkeeps.
  // The gradients accumulate where they are (zero2/3: the bucket buffers stay held until
  // the synchronised micro-step, as FSDP's no_sync keeps unsharded gradients).
  class no_sync_scope {
   public:
    explicit no_sync_scope(training_state& state) : state_(&state) { ++state_->no_sync_depth_; }
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    ~no_sync_scope() {
      if (--state_->no_sync_depth_ == 0) state_->reset_marks();
    }

   private:
    training_state* state_;
  };
  [[nodiscard]] no_sync_scope no_sync();

  // --- uneven inputs -------------------------------------------------------------------------
  // A rank that runs out of batches enters the scope's end and keeps answering the others'
  // steps (reductions with zero gradients, the gathers zero3 needs) until every rank has run
  // out, so ranks with different numbers of batches never hang (PyTorch's Join):
  //
  //   {
  //     auto joined = state.join();
  //     while (loader.next(batch)) { forward; backward; state.step(); }
  //   }   // waits here, answering the others, until every rank's loader is done
  //
  // While the scope lives, each micro-step starts with one small agreement (an all-reduce of
  // three integers at its first call into the state) that tells every rank how many still
  // have data. The averaged gradients then divide by the ranks that contributed (or by the
  // initial world, `divide_by_initial_world`), and every rank steps alike. Between the state's
  // own calls, a trainer must issue no other collective inside the scope: a joined rank is
  // waiting in the agreement, and every rank fails naming the mismatch within the timeout.
  // At zero3 a joined rank answers whatever gathers the ranks with data make (forward then
  // backward, views kept from the forward, a layer gathered again for recomputation, layers
  // skipped): while a rank sits out, the ranks with data announce each gather, reduction and
  // step() in one more such all-reduce, and the joined ranks issue the same. The ranks with
  // data must still gather alike, as without a join; one that differs is named at the
  // announcement, before a gather pairs with the wrong one.
  struct join_options {
    bool divide_by_initial_world = false;
  };
  class join_scope {
   public:
    join_scope(training_state& state, join_options options) : state_(&state) {
      if (state_->join_) fail_nested();
      state_->join_ = options;
    }
    join_scope(const join_scope&) = delete;
    join_scope& operator=(const join_scope&) = delete;
    // Answers the others until every rank has joined, unless an exception is unwinding.
    ~join_scope() noexcept(false) {
      if (state_ && std::uncaught_exceptions() == 0) finish();
      if (state_) state_->join_.reset();
    }
    // The same as the scope's end, to call where an error must surface from a named call.
    void finish() {
      if (!state_) return;
      training_state* state = std::exchange(state_, nullptr);
      struct clear {
        training_state* s;
        ~clear() { s->join_.reset(); }
      } cleared{state};
      state->answer_until_all_joined();
    }

   private:
    [[noreturn]] void fail_nested() const {
      throw error(state_->rank(), "training_state.join", "a join scope is already open",
                  "open one join scope around the training loop");
    }
    training_state* state_;
  };
  [[nodiscard]] join_scope join(join_options options = {}) {
    if (replicated())
      fail("join", "a join scope with replicas (hybrid sharding) is not supported",
           "give every rank the same number of batches (e.g. the sampler's even_batches), or train without replicas");
    return join_scope(*this, options);
  }
  // Ranks that contributed to the last step (the world, outside a join scope).
  int last_contributors() const noexcept { return last_contributors_; }

  // --- what it is and what it holds ----------------------------------------------------------
  cohort::strategy strategy() const noexcept { return options_.strategy; }
  const training_options& options() const noexcept { return options_; }
  const std::vector<region>& regions() const noexcept { return regions_; }
  // The region named `name` (throws, naming it, when there is none).
  std::size_t region_index(std::string_view name) const;
  std::size_t layer_count() const noexcept { return layout_.layers; }
  std::size_t bucket_count() const noexcept { return layout_.buckets.size(); }
  // Buckets whose reduction has been queued in the current step.
  std::size_t launched_buckets() const noexcept { return launched_; }
  std::size_t parameter_count() const noexcept { return layout_.logical; }
  // Elements this rank's optimizer updates (its shard, or everything under ddp).
  std::size_t owned_elements() const noexcept { return owned_; }
  training_memory memory() const noexcept;
  // Gradient and parameter bytes the last step put on the wire (nccl-tests bus bytes), from
  // its first gather or gradient to the end of step().
  std::size_t wire_bytes_per_step() const noexcept { return last_step_wire_bytes_; }
  std::uint64_t steps() const noexcept { return steps_; }
  void set_lr(double lr) noexcept {
    options_.adam.lr = lr;
    if (options_.sgd) options_.sgd->lr = lr;
  }
  int rank() const noexcept { return group_->rank(); }
  int world_size() const noexcept { return group_->world_size(); }
  process_group<B>& group() noexcept { return *group_; }
  // Hybrid sharding's replica group (nullptr when none was given).
  process_group<B>* replicas() noexcept { return replicas_; }
  // Copies of the state's group that average their gradients (1 without replicas).
  int replica_count() const noexcept { return replicas_ ? replicas_->world_size() : 1; }

  // --- checkpoints (cohort/parallel/checkpoint.hpp) ------------------------------------------
  // Rank `r`'s part of the regions in a checkpoint written at this world size: its shard of
  // every bucket, cut by region, whatever the strategy. Under ddp too, where every rank holds
  // everything: the ranks then write disjoint parts in parallel, and a load reads each element
  // once and gathers the copies. A pure function of the layout, the same on every rank.
  std::vector<shard_segment> checkpoint_segments(int r) const { return detail::owned_segments(layout_, r, true); }
  // Where region r sits in the storage: segment s holds elements [s.storage - placement(r).storage,
  // + s.count) of region r.
  const placed_region& placement(std::size_t r) const { return layout_.regions.at(r); }
  // The optimizer's state per element, in a checkpoint's order: the masters (the parameters
  // themselves where P is the master type), then Adam's two moments, or SGD's momentum.
  std::vector<std::string> checkpoint_tensors() const {
    std::vector<std::string> names{"parameters"};
    if (!options_.sgd)
      names.insert(names.end(), {"adam.exp_avg", "adam.exp_avg_sq"});
    else if (options_.sgd->momentum != 0)
      names.emplace_back("sgd.momentum");
    return names;
  }
  // Checkpoint tensor t's elements for segment s of checkpoint_segments(rank()) (device memory
  // on a device backend): what a save copies out and a load writes.
  master_type* checkpoint_data(std::size_t t, const shard_segment& s);
  // After a load wrote every checkpoint tensor through checkpoint_data for every segment of
  // checkpoint_segments(rank()): the parameters cast from the masters, the copies other ranks
  // hold gathered (ddp: everything; zero1/zero2: the parameters) and the optimizer's step
  // count set. Collective; between steps.
  void finish_checkpoint_load(std::uint64_t optimizer_steps);
  // An asynchronous save's copy of the state still in flight: step(), load_parameters() and a
  // load (checkpoint_data, finish_checkpoint_load) wait for it before they change the state.
  checkpoint_copy_fence& checkpoint_fence() noexcept { return snapshot_; }

 private:
  using pool_type = detail::buffer_pool<B>;
  using pooled = typename pool_type::buffer;

  checkpoint_copy_fence snapshot_;  // see checkpoint_fence()

  bool sharded() const noexcept { return options_.strategy != strategy::ddp; }
  bool sharded_gradients() const noexcept {
    return options_.strategy == strategy::zero2 || options_.strategy == strategy::zero3;
  }
  bool sharded_parameters() const noexcept { return options_.strategy == strategy::zero3; }
  bool separate_master() const noexcept { return !std::is_same_v<P, master_type>; }
  std::size_t world() const noexcept { return static_cast<std::size_t>(group_->world_size()); }
  std::size_t my_rank() const noexcept { return static_cast<std::size_t>(group_->rank()); }

  [[noreturn]] void fail(std::string_view operation, const std::string& what, const std::string& hint) const {
    throw error(rank(), detail::text("training_state.", operation), what, hint);
  }
  std::string describe(std::size_t r) const {
    return detail::text("region ", std::to_string(r),
                        (regions_[r].name.empty() ? "" : detail::text(" '", regions_[r].name, "'")));
  }
  void check_region(std::string_view operation, std::size_t r) const {
    if (r >= regions_.size())
      fail(operation, detail::text("region ", std::to_string(r), " of ", std::to_string(regions_.size())),
           "regions are numbered as they were passed");
  }

  void agree_on_layout(const std::string& refusal);
  void agree_on_replicas();
  bool replicated() const noexcept { return replicas_ && replicas_->world_size() > 1; }
  // After the group's reduction `reduced` of `count` gradients at `data`: their average across
  // the replicas, which the group's later work waits for.
  void average_across_replicas(work& reduced, G* data, std::size_t count);
  void allocate_buffers();
  template <class T>
  T* allocate_zeroed(detail::backend_buffer<B>& buffer, std::size_t count);

  // The caller may use what `done` produced: the host waits for it on a host backend; on a
  // device one the caller's stream does.
  void hand_to_caller(const work& done) {
    if constexpr (B::space == memory_space::host)
      done.wait();
    else
      done.make_stream_wait(caller_stream_);
  }

  std::span<P> parameter_span(std::size_t layer, std::size_t r);
  void release_layer(std::size_t layer) noexcept;
  void gather_bucket(std::size_t b);
  void prefetch_after(std::size_t layer);
  void drop_gathered();

  G* bucket_gradients(std::size_t b, bool for_caller);
  void launch_ready();
  void launch(std::size_t b);
  void reset_marks();
  // The join scope's talk, all-reduces of three integers that a joined rank joins with zeros:
  // each micro-step's agreement {1, ends with step(), agreement_mark} from every rank with
  // data, and at zero3, while a rank sits out, an announcement {what, bucket,
  // announcement_mark} before each gather, reduction and step(). The announcement's mark is a
  // prime that divides no agreement's sum (n x 36090, n below it), so the two never read alike.
  enum class joined_call : std::int64_t { gather = 1, reduce = 2, step = 3 };
  static constexpr std::int64_t agreement_mark = 36090;  // "cohortJN" % 1000003
  static constexpr std::int64_t announcement_mark = 999983;
  void exchange(std::int64_t (&values)[3]);
  // The agreement, as a rank with data. Returns how many ranks have data.
  int agree();
  void take_agreement(const std::int64_t (&sum)[3]);
  void announce(joined_call what, std::size_t bucket);
  // `what` and `bucket` as an announcement carries them (or as a joined rank decoded them).
  static std::string describe_call(std::int64_t what, std::int64_t bucket) {
    const std::string b = std::to_string(bucket);
    switch (static_cast<joined_call>(what)) {
      case joined_call::gather: return detail::text("the gather of bucket ", b);
      case joined_call::reduce: return detail::text("the reduction of bucket ", b);
      case joined_call::step: return "step()";
    }
    return detail::text("call ", std::to_string(what), " on bucket ", b);
  }
  // Inside a micro-step that step() does not end. (A joined rank calls no gather() or
  // mark_ready(): it issues what it is told, so its own no_sync state never matters.)
  bool accumulating() const noexcept { return no_sync_depth_ > 0; }
  void begin_call() {
    if (join_ && !agreed_) contributors_ = agree();
  }
  void answer_until_all_joined();
  void measure(step_result& result);
  void update(double grad_scale);
  void publish_parameters();
  // Every bucket's shards of `base` (storage-sized) all-gathered in place.
  template <class T>
  void gather_whole(T* base);

  master_type* master_at(const shard_segment& s) {
    if (separate_master()) return master_.template as<master_type>() + s.owned;
    P* base = params_.template as<P>();
    return reinterpret_cast<master_type*>(sharded_parameters() ? base + s.owned : base + s.storage);
  }
  G* reduced_gradient_at(const shard_segment& s) {
    return sharded_gradients() ? grad_shard_.template as<G>() + s.owned : grads_.template as<G>() + s.storage;
  }
  void count_wire(std::size_t bytes, bool all_reduce) noexcept {
    const std::size_t n = world();
    wire_bytes_ += (all_reduce ? 2 : 1) * (n - 1) * bytes / n;
  }

  process_group<B>* group_;
  process_group<B>* replicas_;
  std::vector<region> regions_;
  training_options options_;
  detail::storage_layout layout_;
  std::vector<shard_segment> segments_;         // this rank's pieces, one per region
  std::vector<shard_segment> update_segments_;  // the same joined across padding: the optimizer's
  std::vector<std::size_t> shard_offset_;       // owned offset of each bucket's shard (sharded)
  std::size_t owned_ = 0;

  detail::backend_buffer<B> params_;      // storage (zero3: the owned shards)
  detail::backend_buffer<B> grads_;       // storage (ddp, zero1)
  detail::backend_buffer<B> grad_shard_;  // owned (zero2, zero3)
  detail::backend_buffer<B> master_;      // owned, where P is not the master type
  detail::backend_buffer<B> first_;       // owned: Adam's first moment, or SGD's momentum
  detail::backend_buffer<B> second_;      // owned: Adam's second moment
  detail::backend_buffer<B> scratch_;     // owned: gradients cast to the master type
  detail::backend_buffer<B> stats_;       // the non-finite count and the sum of squares
  pool_type gradient_pool_;
  pool_type parameter_pool_;
  std::size_t gradient_pool_bytes_ = 0, parameter_pool_bytes_ = 0;  // allocated by each pool

  std::vector<pooled> bucket_grads_;   // zero2/3: held gradient buffers
  std::vector<pooled> bucket_params_;  // zero3: gathered parameter buffers
  std::vector<work> bucket_gathered_;  // zero3: the gather of each held buffer
  std::vector<int> layer_users_;       // zero3: live views per layer
  std::optional<std::size_t> last_gathered_;

  std::vector<std::uint8_t> marked_;
  std::vector<std::size_t> pending_;         // unmarked regions per bucket
  std::vector<std::uint8_t> due_;            // zero3: released by the backward, to be reduced
  std::vector<std::uint8_t> backward_view_;  // zero3: by layer, gathered by the backward
  std::size_t launched_ = 0;                 // buckets launched, from the last
  int no_sync_depth_ = 0;
  // The join scope's options while one is open; whether this micro-step's agreement is done,
  // and how many ranks it found with data.
  std::optional<join_options> join_;
  bool agreed_ = false;
  bool sync_micro_step_ = true;
  bool announcing_ = false;  // zero3, with data, while a rank sits out: announce each collective
  int contributors_ = 0;
  int last_contributors_ = 0;
  std::uint64_t steps_ = 0;
  std::size_t wire_bytes_ = 0, last_step_wire_bytes_ = 0;
  stream_type caller_stream_{};
};

}  // namespace cohort::inline v0

#include "cohort/parallel/impl/training_state.hpp"
