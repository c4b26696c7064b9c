#pragma once
// training_state<Backend, P, G>: one training state under every strategy. The same trainer
// source trains data-parallel (DDP), with optimizer state sharded (ZeRO-1), with gradients
// sharded too (ZeRO-2), or with parameters sharded as well (ZeRO-3, FSDP), by one option.
// Over 400 lines: one class's declaration and its contract, which a trainer reads in one place
// (the members' bodies are in impl/training_state.hpp).
//
// Most trainers already have their parameters and gradients in two flat buffers, tensors
// reached by pointer arithmetic (llm.c's `params.qkvw + l * 3*C*C`) and updated by their own
// optimizer. The state adopts those buffers where they are, in the trainer's order:
//
//   std::vector<cohort::region> regions = ...;     // the model's tensors in its flat buffer
//   cohort::training_state<cohort::nccl> state{pg, std::span(params, n), std::span(grads, n), regions,
//       {.strategy = cohort::strategy::zero2, .max_grad_norm = 1.0}};   // the trainer's optimizer updates
//   forward(params); zero(grads);                  // the trainer's own code, its own pointers
//   backward(...); state.mark_layer_ready(l);      // as each block's gradients are final
//   auto result = state.step();                    // reduced, norm, clip factor, skip decision
//   if (!result.skipped)
//     for (const auto& s : state.owned_spans())    // ddp: everything; zero1/zero2: this rank's part
//       my_adamw(s.parameters, s.gradients, m + s.owned, v + s.owned, result.gradient_scale);
//   state.publish_parameters();                    // zero1/zero2: the updated parts all-gathered back
//
// Or the state keeps the buffers and the optimizer (AdamW or SGD, fp32 masters, weight decay
// and learning-rate scale per region), and the trainer reads and writes through it:
//
//   cohort::training_state<cohort::gloo> state{pg, regions,
//       {.strategy = cohort::strategy::zero3, .adam = {.lr = 3e-4, .weight_decay = 0.1},
//        .max_grad_norm = 1.0}};
//   state.load_parameters(initial);                // the trainer's flat buffer, on every rank
//   for (l in layers)           { auto layer = state.gather(l); forward(layer.param(r)...); }
//   for (l in layers, reversed) { auto layer = state.gather(l);
//                                 backward(layer.param(r)..., state.gradient(r)...);
//                                 state.mark_ready(r) for the layer's regions; }
//   auto result = state.step();                    // norm, clipping, AdamW, parameters back
//
// Both keep one layout (cohort/parallel/layout.hpp): the trainer's buffer order, nothing moved
// or padded. With adopted buffers, under ddp, zero1 and zero2 the trainer's own pointers stay
// valid for the whole run (gather() and gradient() return spans into its buffers); at zero3
// the trainer's parameter buffer holds this rank's chunks, a gather(layer) lands the layer
// there at its own offsets (the trainer's pointers read it while the view lives), and the
// view's end fills what this rank does not hold with NaN, so that a read outside a gather is
// loud rather than stale. Adopted gradients are the trainer's: the state never zeroes them
// (zero them before each backward, as a trainer does; the reproducible mode zeroes them after
// each accumulated micro-step); owned ones are zero at the start of each step.
//
// What each strategy keeps per rank (N ranks, P bytes of parameters):
//   ddp    parameters, gradients and optimizer state in full; gradients all-reduced per
//          bucket as the backward marks them; every rank updates everything.
//   zero1  optimizer state 1/N: buckets reduce-scattered during the backward (in place in the
//          flat gradient buffer), this rank's part updated, the parameters all-gathered back
//          in place.
//   zero2  the same; owned gradients 1/N as well: a
//          bucket's gradients live in a pooled buffer from its first gradient() to its
//          reduction (adopted gradients are the trainer's, in full).
//   zero3  parameters 1/N as well: gather(layer) all-gathers a layer into a pooled buffer
//          (prefetching the next in the direction of travel) and the view's end releases it;
//          over an adopted parameter buffer, in place in it (which stays whole: no memory
//          saved over zero2; pass an empty parameter span for the state to keep the shards).
// Wire bytes per step (nccl-tests bus bytes): 2(N-1)/N x P for ddp, zero1 and zero2,
// 3(N-1)/N x P for zero3 (the gathers of the forward and of the backward, the reduce-scatter),
// less the top layer's backward gather: it stays gathered from the forward's end.
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
// Buckets are sets of regions, a layer's (or several small layers') at a time, and launch last
// to first (the backward's order), each once all its regions are marked and every bucket
// before it in that order has launched: the same sequence of collectives on every rank,
// whatever order a rank marks in. A bucket's ranges (its regions adjacent in the buffer) go
// out as one grouped launch on NCCL and back to back on Gloo. A region a rank never marks
// contributes what its gradient holds when its bucket is reduced (at step() at the latest):
// zeros if nothing was written there this step, whatever the trainer wrote otherwise.
//
// On a device backend set_stream() names the stream the trainer computes on: collectives wait
// for it, and it waits for the gathers and the step. Not thread-safe: one training thread
// drives it.

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
#include "cohort/config.hpp"
#include "cohort/detail/compiled_specializations.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/diagnostics/straggler.hpp"
#include "cohort/diagnostics/timeline.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/canonical_order.hpp"
#include "cohort/parallel/detail/reproducible.hpp"
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

// Reproducible training (training_options::reproducible): a step's global batch is M
// micro-batches numbered 0 .. M-1 whatever the world size, each rank holding a contiguous run of
// M / world of them; gradients are summed in one canonical order over the micro-batches
// (cohort/parallel/canonical_order.hpp), so that the parameters after every step have the same
// bits at any world size and strategy.
//
// The trainer's part: rank k runs m = M / world micro-steps a step, on micro-batches
// [k x m, (k + 1) x m) (with replicas k = replicas->rank() x group size + group rank); the
// first m - 1 each inside its own no_sync() scope, the last outside it, then step(). Each
// micro-step's backward writes its micro-batch's gradient (of its mean loss, not divided by
// the accumulation count) into zeroed gradients: the state zeroes them after folding each
// micro-step (owned and adopted alike), so a backward that adds into them needs nothing else
// within a step; adopted ones are the trainer's to zero before a step's first backward, as
// always. Kernels deterministic, the same micro-batch size on every rank. The state sums the M
// gradients in the canonical tree and divides by M once, at the end. The rule, refused at
// construction on every rank: M divisible by the ranks and M / ranks a power of two (any M at
// one rank); with replicas a group size that is a power of two. A rank that runs another
// number of micro-steps is refused at the step on every rank; join() is refused.
// Memory: ceil(log2(m)) gradient buffers (none at m = 1) and one staging bucket
// (training_memory::reproducible). Wire bytes: a ring reduce-scatter's (an all-to-all of each
// range's chunks), under ddp with the all-gather of the chunks: a ring all-reduce's.
struct reproducible_options {
  std::size_t micro_batches = 0;     // M, of one global step
  std::size_t micro_batch_size = 0;  // samples in each: every rank must pass the same (0: not checked)
};

struct training_options {
  cohort::strategy strategy = strategy::ddp;
  std::size_t bucket_bytes = std::size_t{25} << 20;  // of gradients, per bucket
  // ddp, zero1, zero2: the first bucket to launch (the last layers') closes once it holds
  // this much, so that the reduction starts early in the backward, as DDP's 1 MiB first bucket
  // (capped at bucket_bytes; 0: bucket_bytes). Buckets fill in the backward's order.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  adam_options adam = {};               // AdamW, the default optimizer
  std::optional<sgd_options> sgd = {};  // set: SGD (with momentum) instead
  // Whose optimizer updates the parameters. true: the trainer's own: step() reduces, measures
  // and decides (the global norm, the clip factor, the skip every rank takes), and the trainer
  // updates owned_spans() then calls publish_parameters(); the state keeps no optimizer state.
  // false: the state's (adam, or sgd). Unset: the buffers' owner's: the trainer's over adopted
  // buffers (DDP's reduce-only contract: a trainer that hands over its buffers keeps its
  // update), the state's over its own. The state's options() say what was chosen.
  std::optional<bool> trainer_optimizer = {};
  // zero1/zero2 over the trainer's parameter buffer: the step (or publish_parameters) returns
  // before the updated chunks are all-gathered back, and each layer's are waited for at its
  // next gather(layer), in the next forward, as the state's own buffers always are. Set it
  // only where the trainer reads its parameters through gather() (as zero3 needs anyway): a
  // read that bypasses it may see a chunk still in flight.
  bool defer_publication = false;
  double max_grad_norm = 0;  // > 0: clip the global norm to this
  // fp16: the trainer scales its loss by scaler->scale(); step() unscales, and skips on every
  // rank when any rank's gradients hold an inf or a NaN. It must outlive the state.
  loss_scaler* scaler = nullptr;
  int prefetch = 1;  // zero3: layers gathered ahead, in the direction of travel
  // zero2/zero3 with the state's gradient buffers on a host backend: the bucket reductions that
  // may be in flight, each holding its bucket's buffer, before the backward waits for the
  // oldest to reuse its buffer. Gradient memory is the shard plus (1 + this) buckets at most;
  // on a device buffers are reused in stream order and never waited for.
  int reductions_in_flight = 2;
  // Called as each bucket's reduction is queued (bucket index): to see the overlap.
  std::function<void(std::size_t bucket)> on_launch = {};
  // Straggler report (cohort/diagnostics/straggler.hpp; it must outlive the state): each step() ends a
  // step, and its time counts as waiting for communication; so does a zero3 gather()'s wait.
  straggler_report* straggler = nullptr;
  // Timeline (cohort/diagnostics/timeline.hpp; it must outlive the state): each step() ends a
  // step; the caller's waits (a zero3 gather's, step()'s for the reductions) and the update
  // are its spans.
  cohort::timeline* timeline = nullptr;
  // Set: bit-identical parameters at any world size, strategy and bucket size (see
  // reproducible_options and docs/design.md, "Reproducible training").
  std::optional<reproducible_options> reproducible = {};
};

// Bytes one rank's training holds, by kind: what the state allocated (pooled buffers at their
// peak) and the trainer's buffers it adopted, which stay whole under every strategy (zero3's
// gathers land in an adopted parameter buffer).
struct training_memory {
  std::size_t parameters = 0;          // resident parameters (zero3: the shard) and gathered layers
  std::size_t gradients = 0;           // resident gradients (zero2/3: the shard) and bucket buffers
  std::size_t optimizer_state = 0;     // masters (where apart from the parameters), moments, scratch
  std::size_t adopted_parameters = 0;  // the trainer's parameter buffer, adopted (not allocated here)
  std::size_t adopted_gradients = 0;   // the trainer's gradient buffer, adopted (once bound)
  // training_options::reproducible: the micro-step tree's gradient buffers, the staging of the
  // ranks' partial sums, the exact norm's integers (counted in allocated()).
  std::size_t reproducible = 0;
  std::size_t allocated() const noexcept { return parameters + gradients + optimizer_state + reproducible; }
  std::size_t total() const noexcept { return allocated() + adopted_parameters + adopted_gradients; }
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
#if defined(COHORT_SEPARATE_COMPILATION) && !defined(COHORT_TEMPLATE_BODIES)
  // Otherwise the unit would compile against members nobody defines: a link error, far from here.
  static_assert(detail::compiled_specialization<B, P, G>,
                "cohort: compiled once (COHORT_SEPARATE_COMPILATION), the library holds training_state for "
                "gloo and nccl with float or bfloat16 parameters only; for this backend or element type "
                "#define COHORT_TEMPLATE_BODIES before including cohort (or add it to the target's compile "
                "definitions) so that this unit compiles the bodies itself");
#endif

  // Collective: every rank passes the same regions and options. A rank whose own input is
  // unusable does not throw alone (the others would wait for it until the timeout): every
  // rank learns in one exchange whether any refused, and all throw together.
  // `replicas` (hybrid sharding, above; it must outlive the state): this rank's replica group.
  //
  // The state keeps the flat buffers (the trainer reads and writes through gather() and
  // gradient(), and calls load_parameters()):
  training_state(process_group<B>& group, std::vector<region> regions, training_options options = {},
                 process_group<B>* replicas = nullptr);
  // The trainer's own flat buffers, adopted where they are (host memory on a host backend,
  // device memory on a device one; they must outlive the state). Their length is the flat
  // buffer's: elements no region covers are refused, naming them; so is a null buffer of
  // non-zero length. The parameters are loaded as load_parameters() does (under ddp, zero1 and
  // zero2 rank 0's are everyone's). At zero3 `parameters` may be empty: the state then keeps
  // the shards, load_parameters() or a checkpoint gives them, and the layers are read
  // through gather()'s views only. An adopted parameter buffer at zero3 stays the trainer's:
  // gather(layer) lands the layer there, at its own offsets, and the view's end poisons what
  // this rank does not hold (see gather). Unless options.trainer_optimizer says otherwise, the
  // trainer's optimizer updates (owned_spans(), publish_parameters()). `gradients` may be
  // empty where the trainer allocates them later (in its first backward): bind_gradients()
  // then, before the first gradient() or mark; until then those refuse.
  training_state(process_group<B>& group, std::span<P> parameters, std::span<G> gradients, std::vector<region> regions,
                 training_options options = {}, process_group<B>* replicas = nullptr);
  training_state(const training_state&) = delete;
  training_state& operator=(const training_state&) = delete;
  // A layer view still alive here points into freed memory: it is named on stderr (and, in a
  // build without NDEBUG, the process aborts), and the view is cut off from the state.
  ~training_state();

  // CUDA: the stream the trainer computes on (default: the legacy default stream).
  void set_stream(stream_type stream) noexcept { caller_stream_ = stream; }
  // The stream set_stream() named: what a reader outside the state (parameter_sha256's copies)
  // waits for.
  stream_type stream() const noexcept { return caller_stream_; }

  // --- parameters ----------------------------------------------------------------------------
  // The trainer's flat buffer, the same on every rank: each rank keeps what its strategy
  // holds. Under ddp, zero1 and zero2, where ranks hold the parameters whole, rank 0's buffer
  // is broadcast (collective), so replicas start equal whatever each rank passed; at zero3 each
  // element comes from the one rank that holds it (the few every rank holds, from rank 0).
  // Host memory on a host backend; any memory cudaMemcpy reaches on a device one. With adopted
  // buffers it may be the adopted parameter buffer itself (nothing is copied then).
  void load_parameters(std::span<const P> flat);
  // Collective: the parameters in the trainer's flat layout, on every rank (host memory).
  std::vector<P> gather_parameters();

  class layer_view;
  // A layer's parameters while the view lives: free where parameters stay resident (ddp,
  // zero1, zero2: spans into the flat parameter buffer, adopted or not; at zero1/zero2 it
  // first waits for the layer's part of the last step's all-gather, which the step did not
  // wait for with the state's own buffers or defer_publication); at zero3 an all-gather into
  // a pooled buffer, released at the view's end, or in place into an adopted parameter
  // buffer, at the layer's own offsets, whose elements other ranks hold are NaN again from
  // the end of the layer's last view (in every build: stale otherwise).
  [[nodiscard]] layer_view gather(std::size_t layer);

  // --- gradients and the step ----------------------------------------------------------------
  // The trainer's flat gradient buffer, where the adopting constructor was given none: a
  // trainer that allocates it in its first backward binds it there, before its first mark.
  // Not collective (each rank binds its own, when it has it); once per state, at the flat
  // buffer's length.
  void bind_gradients(std::span<G> gradients);
  // Where the backward writes region r's gradient: the flat gradient buffer (adopted, or owned
  // under ddp and zero1), or at zero2 and zero3 with owned buffers the bucket's pooled buffer,
  // valid from this call until r's bucket is reduced: ask right before writing.
  std::span<G> gradient(std::size_t r);
  // Region r's gradient is final (once per step). ddp, zero1 and zero2 launch every bucket this
  // completes, in the order all ranks share; zero3 reduces a layer's
  // buckets once the backward has moved below the layer (at its next gather of a lower layer,
  // or step()), so that its gathers and reductions interleave alike on every rank whatever
  // each marked.
  void mark_ready(std::size_t r);
  // Every region of `layer` at once (a transformer block's tensors, stacked or not).
  void mark_layer_ready(std::size_t layer);
  // Reduces what is left, then the global norm, clipping and the loss scaler's decision; with
  // the state's optimizer, the update of this rank's part and the parameters back where they
  // are read. With trainer_optimizer, the update is the trainer's (owned_spans(), then
  // publish_parameters()).
  step_result step();

  // --- the trainer's own optimizer (training_options::trainer_optimizer) ---------------------
  // A piece of one region whose update is this rank's: under ddp every region whole, under
  // zero1/zero2 this rank's chunks (and the few elements every rank holds, which every rank
  // updates alike); at zero3 its shard. `owned` numbers the rank's owned elements 0 ..
  // owned_elements(): where the trainer keeps the piece's optimizer state. The gradients are
  // the averaged ones, before result.gradient_scale (clipping, loss scale, join's divisor).
  struct owned_span {
    std::size_t region = 0;
    std::size_t offset = 0;  // in the flat buffer
    std::size_t owned = 0;
    std::span<P> parameters;
    std::span<const G> gradients;
  };
  const std::vector<owned_span>& owned_spans() const noexcept { return owned_spans_; }
  // After the trainer's update (or a skipped step): zero1/zero2 all-gather every rank's
  // updated part into every rank's parameters; ddp and zero3 move nothing. Called once after
  // every step() under trainer_optimizer, whatever the strategy (one trainer source for
  // all): the state's next call refuses to go on without it.
  void publish_parameters();

  // Gradient-accumulation micro-steps: while the scope lives, mark_ready only bookkeeps.
  // The gradients accumulate where they are (owned zero2/3: the bucket buffers stay held
  // until the synchronised micro-step, as FSDP's no_sync keeps unsharded gradients).
  class no_sync_scope {
   public:
    explicit no_sync_scope(training_state& state) : state_(&state), exceptions_(std::uncaught_exceptions()) {
      ++state_->no_sync_depth_;
    }
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    // Reproducible: the micro-step's gradients are folded into the tree here (not while an
    // exception unwinds the scope: that micro-step is abandoned). A destructor must not throw,
    // so a failure of the fold is kept and thrown by the state's next call (gather, gradient,
    // mark_ready, step), before anything reads the gradients it left.
    ~no_sync_scope() {
      if (--state_->no_sync_depth_ > 0) return;
      try {
        if (state_->reproducible() && std::uncaught_exceptions() == exceptions_) state_->fold_micro_step();
        state_->reset_marks();
      } catch (...) {
        state_->deferred_failure_ = std::current_exception();
      }
    }

   private:
    training_state* state_;
    int exceptions_;
  };
  [[nodiscard]] no_sync_scope no_sync();

  // Forward-only passes (evaluation, sampling) between steps: gathers inside the scope are
  // not a training step's (at zero3 they do not count as a forward or a backward, and their
  // wire bytes go to evaluation_wire_bytes(), not wire_bytes_per_step()); gradient(),
  // mark_ready() and step() are refused inside it. At zero3 every rank must gather alike here
  // too: the gathers are collectives. The scope's first gather there begins with a small
  // agreement (one all-reduce of 3 integers), so a rank that samples alone while the others go
  // on training fails on every rank within the group's timeout, named as an evaluation,
  // instead of pairing its gathers with their forward's.
  class evaluation_scope {
   public:
    explicit evaluation_scope(training_state& state) : state_(&state) { ++state_->evaluating_; }
    evaluation_scope(const evaluation_scope&) = delete;
    evaluation_scope& operator=(const evaluation_scope&) = delete;
    ~evaluation_scope() {
      if (--state_->evaluating_ == 0) state_->evaluation_agreed_ = false;
    }

   private:
    training_state* state_;
  };
  [[nodiscard]] evaluation_scope evaluation() { return evaluation_scope(*this); }

  // --- uneven inputs -------------------------------------------------------------------------
  // A rank that runs out of batches keeps answering the others' steps (reductions with zero
  // gradients, the gathers zero3 needs) until every rank has run out, so ranks with different
  // numbers of batches never hang (PyTorch's Join):
  //
  //   state.join([&] {
  //     while (loader.next(batch)) { forward; backward; state.step(); }
  //   });   // returns once every rank's loader is done; errors throw from here, as any call's
  //
  // While `loop` runs, each micro-step starts with one small agreement (an all-reduce of three
  // integers at its first call into the state) that tells every rank how many still have
  // data. The averaged gradients then divide by the ranks that contributed (or by the initial
  // world, `divide_by_initial_world`), and every rank steps alike. Between the state's own
  // calls, a trainer must issue no other collective inside the loop: a joined rank is waiting
  // in the agreement, and every rank fails naming the mismatch within the timeout.
  // At zero3 a joined rank answers whatever gathers the ranks with data make (forward then
  // backward, views kept from the forward, a layer gathered again for recomputation, layers
  // skipped): while a rank sits out, the ranks with data announce each gather, reduction and
  // step() in one more such all-reduce, and the joined ranks issue the same. The ranks with
  // data must still gather alike, as without a join; one that differs is named at the
  // announcement, before a gather pairs with the wrong one. When `loop` throws, the rank
  // leaves at once (the others then fail within their timeout, naming it). A rank that
  // answers contributes zero gradients (adopted gradients are zeroed while it answers: its
  // trainer no longer does), and with trainer_optimizer it still updates its part of every
  // step the others take, through `update` (then publishes, as after any step).
  struct join_options {
    bool divide_by_initial_world = false;
    // trainer_optimizer: the trainer's update of owned_spans() for a step (not skipped).
    std::function<void(const step_result&)> update = {};
  };
  template <class Loop>
  void join(Loop&& loop, join_options options = {});
  // Ranks that contributed to the last step (the world, outside a join).
  int last_contributors() const noexcept { return last_contributors_; }
  // Inside join()'s loop, where a collective of the trainer's own would pair with the agreement
  // that a rank out of data waits in (parameter_sha256 refuses to run there).
  bool joining() const noexcept { return join_.has_value(); }

  // --- what it is and what it holds ----------------------------------------------------------
  cohort::strategy strategy() const noexcept { return options_.strategy; }
  // training_options::reproducible is set: bit-identical parameters at any world size.
  bool reproducible() const noexcept { return options_.reproducible.has_value(); }
  const training_options& options() const noexcept { return options_; }
  // Whose optimizer updates: true for the trainer's (owned_spans(), publish_parameters()),
  // false for the state's. Resolved at construction from the option or the buffers' owner; ask
  // here rather than test options().trainer_optimizer, an optional that is always set by then.
  bool trainer_optimizer() const noexcept { return options_.trainer_optimizer.value_or(adopted_); }
  const std::vector<region>& regions() const noexcept { return regions_; }
  // The region named `name` (throws, naming it, when there is none).
  std::size_t region_index(std::string_view name) const;
  // Whether the flat buffers are the trainer's (the adopting constructor).
  bool adopted() const noexcept { return adopted_; }
  std::size_t layer_count() const noexcept { return layout_.layers; }
  std::size_t bucket_count() const noexcept { return layout_.buckets.size(); }
  // Bucket b's regions, in buffer order.
  const std::vector<std::size_t>& bucket_regions(std::size_t b) const { return layout_.buckets.at(b).regions; }
  // Buckets whose reduction has been queued in the current step.
  std::size_t launched_buckets() const noexcept { return launched_; }
  // Buckets the last step reduced before step() was called: what overlapped the backward.
  std::size_t overlapped_buckets() const noexcept { return last_overlapped_; }
  std::size_t parameter_count() const noexcept { return layout_.elements; }
  // Elements this rank's optimizer updates (its part, or everything under ddp).
  std::size_t owned_elements() const noexcept { return owned_; }
  training_memory memory() const noexcept;
  // Gradient and parameter bytes the last step put on the wire (nccl-tests bus bytes), from
  // its first gather or gradient to the end of step(); evaluation() gathers and
  // gather_parameters() are not a step's.
  std::size_t wire_bytes_per_step() const noexcept { return last_step_wire_bytes_; }
  // Bytes every evaluation() gather so far put on the wire.
  std::size_t evaluation_wire_bytes() const noexcept { return evaluation_wire_bytes_; }
  // Parameter and gradient bytes the last step copied in memory rather than communicated: 0,
  // except at zero3 over the state's own shards the few elements of a range the world does
  // not divide, which every rank holds and copies into a gathered layer, and at one rank
  // every gather, a copy of the layer (an adopted buffer is gathered in place: nothing).
  std::size_t copied_bytes_per_step() const noexcept { return last_step_copied_bytes_; }
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
  // Rank `r`'s part of the regions in a checkpoint written at this world size: its chunks of
  // every range (rank 0 also the remainders), cut by region, whatever the strategy. Under ddp
  // too, where every rank holds everything: the ranks then write disjoint parts in parallel,
  // and a load reads each element once and gathers the copies. A pure function of the layout,
  // the same on every rank; a segment's `offset` is in the flat buffer.
  std::vector<shard_segment> checkpoint_segments(int r) const {
    return detail::chunk_segments(regions_, layout_, r, r == 0, !sharded());
  }
  // The optimizer's state per element, in a checkpoint's order: the masters (the parameters
  // themselves where P is the master type), then Adam's two moments, or SGD's momentum. Under
  // trainer_optimizer only the parameters (the trainer's optimizer keeps its own state).
  std::vector<std::string> checkpoint_tensors() const {
    std::vector<std::string> names{"parameters"};
    if (trainer_optimizer()) return names;
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
  // hold gathered (ddp: everything; zero1/zero2: the parameters; every strategy: the few
  // elements every rank holds) and the optimizer's step count set. Collective; between steps.
  void finish_checkpoint_load(std::uint64_t optimizer_steps);
  // An asynchronous save's copy of the state still in flight: step(), load_parameters() and a
  // load (checkpoint_data, finish_checkpoint_load) wait for it before they change the state.
  checkpoint_copy_fence& checkpoint_fence() noexcept { return snapshot_; }

  class layer_view {
   public:
    layer_view() = default;
    layer_view(layer_view&& other) noexcept { take(other); }
    layer_view& operator=(layer_view&& other) noexcept {
      if (this != &other) {
        reset();
        take(other);
      }
      return *this;
    }
    ~layer_view() { reset(); }
    // Region r's parameters (r must belong to this layer). Device memory on a device backend.
    std::span<P> param(std::size_t r) const {
      if (!state_) fail_detached(r);
      return state_->parameter_span(layer_, r);
    }
    std::size_t layer() const noexcept { return layer_; }
    void reset() noexcept {
      if (!state_) return;
      unlink();
      std::exchange(state_, nullptr)->release_layer(layer_);
    }

   private:
    friend class training_state;
    layer_view(training_state* state, std::size_t layer) : state_(state), layer_(layer) { link(); }
    // Live views form a list in their state, so that its end can name and detach them.
    void link() noexcept {
      next_ = state_->views_;
      if (next_) next_->previous_ = this;
      state_->views_ = this;
    }
    void unlink() noexcept {
      if (previous_)
        previous_->next_ = next_;
      else
        state_->views_ = next_;
      if (next_) next_->previous_ = previous_;
      previous_ = next_ = nullptr;
    }
    void take(layer_view& other) noexcept {
      if (!other.state_) return;
      state_ = other.state_;
      layer_ = other.layer_;
      previous_ = std::exchange(other.previous_, nullptr);
      next_ = std::exchange(other.next_, nullptr);
      (previous_ ? previous_->next_ : state_->views_) = this;
      if (next_) next_->previous_ = this;
      other.state_ = nullptr;
    }
    [[noreturn]] void fail_detached(std::size_t r) const {
      throw error(-1, "training_state.layer_view.param",
                  detail::text("region ", std::to_string(r), " of layer ", std::to_string(layer_),
                               ": the view outlived its training_state"),
                  "end layer views before the state they came from");
    }
    training_state* state_ = nullptr;
    std::size_t layer_ = 0;
    layer_view* previous_ = nullptr;
    layer_view* next_ = nullptr;
  };

 private:
  using pool_type = detail::buffer_pool<B>;
  using pooled = typename pool_type::buffer;

  checkpoint_copy_fence snapshot_;  // see checkpoint_fence()

  // Both constructors' common part: `adopted`, the trainer's buffers (else the state allocates).
  struct adopted_buffers {
    std::span<P> parameters;
    std::span<G> gradients;
  };
  training_state(process_group<B>& group, std::optional<adopted_buffers> adopted, std::vector<region> regions,
                 training_options options, process_group<B>* replicas);

  bool sharded() const noexcept { return options_.strategy != strategy::ddp; }
  bool sharded_parameters() const noexcept { return options_.strategy == strategy::zero3; }
  // The parameters in a flat buffer, in the trainer's numbering: every strategy but zero3 over
  // the state's own shards (an adopted buffer at zero3 holds this rank's chunks in place, and
  // its gathers land there).
  bool flat_parameters() const noexcept { return !sharded_parameters() || adopted_parameters_; }
  // Gradients in a flat buffer (adopted; owned under ddp and zero1), reduced in place; else
  // (owned zero2, zero3) in pooled bucket buffers, reduced into the owned shard.
  bool flat_gradients() const noexcept {
    return adopted_ || options_.strategy == strategy::ddp || options_.strategy == strategy::zero1;
  }
  bool separate_master() const noexcept { return !trainer_optimizer() && !std::is_same_v<P, master_type>; }
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
  // Every call that starts or continues a step: not inside evaluation(), not before the
  // trainer published its update.
  void check_training_call(std::string_view operation) const;
  void check_published(std::string_view operation) const;
  // Adopted gradients given at construction or bound since (bind_gradients).
  void check_gradients_bound(std::string_view operation) const;
  // trainer_optimizer: the owned pieces by region, where the trainer updates them.
  void build_owned_spans();

  void agree_on_layout(const std::string& refusal, std::size_t elements);
  [[gnu::cold]] void agree_on_replicas();
  bool replicated() const noexcept { return replicas_ && replicas_->world_size() > 1; }
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
  // zero3: whether bucket b's parameters are gathered (held, or prefetched); where range's
  // gathered parameters lie (the flat buffer, or the bucket's pooled buffer); their end.
  bool is_gathered(std::size_t b) const {
    return flat_parameters() ? gathered_in_place_[b] != 0 : bucket_params_[b].data != nullptr;
  }
  P* gathered_range(std::size_t b, const detail::bucket_range& range) const {
    return flat_parameters() ? params_ + range.offset : static_cast<P*>(bucket_params_[b].data) + range.packed;
  }
  void end_gathered(std::size_t b, work last_use);
  // zero3 over an adopted buffer: bucket b's elements this rank does not hold made NaN, so
  // that a read of them outside a gather is loud, not stale.
  void poison_unheld(std::size_t b);
  void gather_bucket(std::size_t b);
  void prefetch_after(std::size_t layer);
  void drop_gathered();
  // zero3: the backward has moved below `layer`: every higher layer whose latest gather was
  // the backward's and whose views have all ended has its buckets due for reduction.
  void mark_due_above(std::size_t layer);

  G* bucket_gradients(std::size_t b, bool for_caller);
  void launch_ready();
  void launch(std::size_t b);
  void reset_marks();
  // Reproducible mode: micro-steps per rank (m); a no_sync scope's micro-step folded into the
  // binary counter's levels (its gradients zeroed); the step's check that every rank ran m;
  // bucket b summed in the canonical tree (replacing launch's reductions); the exact norm.
  std::size_t micro_steps_per_rank() const noexcept {
    return options_.reproducible->micro_batches / (world() * static_cast<std::size_t>(replica_count()));
  }
  void fold_micro_step();
  void agree_on_micro_steps();
  G* fold_level(std::size_t level);
  G* gradient_source(const detail::bucket_range& range, G* pooled_gradients) const {
    return flat_gradients() ? grads_ + range.offset : pooled_gradients + range.packed;
  }
  // `first_call`: engine_calls_begin() before the bucket's calls (its timeline span is noted
  // before the replicas' exchange: a row's spans are kept in order).
  void reduce_canonically(std::size_t b, G* pooled_gradients, G* shard, std::uint64_t first_call);
  // The staging buffer's count elements summed as `parts` parts of `count` in the canonical
  // order, divided by M when `divide_by_batches`, into `to`.
  void sum_parts(G* staged, std::size_t parts, std::size_t count, bool divide_by_batches, G* to);
  void measure_exactly(step_result& result);
  // The join's talk, all-reduces of three integers that a joined rank joins with zeros:
  // each micro-step's agreement {1, ends with step(), agreement_mark} from every rank with
  // data, and at zero3, while a rank sits out, an announcement {what, bucket,
  // announcement_mark} before each gather, reduction and step(). The announcement's mark is a
  // prime that divides no agreement's sum (n x 36090, n below it), so the two never read alike.
  enum class joined_call : std::int64_t { gather = 1, reduce = 2, step = 3 };
  static constexpr std::int64_t agreement_mark = 36090;  // "cohortJN" % 1000003
  static constexpr std::int64_t announcement_mark = 999983;
  static constexpr std::int64_t evaluation_mark = 999979;
  void agree_on_evaluation(std::size_t layer);
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
  // A step this rank answers after its loop ended (see join).
  void answer_step();
  void measure(step_result& result);
  // Timeline: the engine's work on each bucket, noted as the ids of its calls in the group's
  // flight recorder (which times each call's issue and completion as the engine reports it)
  // and turned into spans on the bucket's row once step() has waited for the reductions, so
  // that no clock read, poll or wait is added to the step. `engine_calls_begin` is 0 when the
  // timeline is not recording: then nothing is noted. With replicas, a bucket's exchange across
  // them is noted in the replicas' group's recorder (across_replicas).
  enum class engine_work : std::uint8_t { reduction, gather, gathered, across_replicas };
  struct engine_span {
    std::size_t bucket = 0;
    engine_work what = engine_work::reduction;
    std::uint64_t step = 0;  // the timeline's
    std::uint64_t first_call = 0, last_call = 0;
    timeline::clock::time_point released{};  // gathered: when the release let it go
  };
  const flight_recorder& engine_calls(engine_work what) const {
    return (what == engine_work::across_replicas ? replicas_ : group_)->backend().recorder();
  }
  std::uint64_t engine_calls_begin(engine_work what = engine_work::reduction) const {
    if (!options_.timeline || !options_.timeline->recording()) return 0;
    return engine_calls(what).last_id() + 1;
  }
  void note_engine_span(std::size_t b, engine_work what, std::uint64_t first_call);
  void record_engine_spans();
  void warn_if_overlap_lost();
  // The state's own optimizer, bucket by bucket in the caller's order, each bucket's
  // parameters published (publish_bucket) as soon as its update is queued.
  void update_and_publish(double grad_scale);
  // Bucket b's owned segments updated, masters cast into narrower parameters, and the flat
  // gradients it read zeroed for the next step (`zero_gradients`), all in the caller's order.
  void update_bucket(std::size_t b, double grad_scale, bool zero_gradients);
  // zero1/zero2: every rank's updated chunks of bucket b all-gathered back into the flat
  // parameters, as one grouped launch on the group; deferred (defers_publication), its work
  // is kept for the bucket's next reader.
  void publish_bucket(std::size_t b);
  bool publishes_parameters() const noexcept {
    return (options_.strategy == strategy::zero1 || options_.strategy == strategy::zero2) && world() > 1;
  }
  // Where only the state hands out the parameters (its own buffer), or the trainer says it
  // reads them through gather() (defer_publication), a step returns before its publication
  // is done: each bucket's is waited for where its parameters are next read (gather, param),
  // any other reader waits for all.
  bool defers_publication() const noexcept {
    return publishes_parameters() && (!adopted_ || options_.defer_publication);
  }
  void await_parameters(std::size_t b);
  void await_all_parameters();
  // Every range's chunks of `base` all-gathered in place (`flat`: a flat buffer, where each
  // rank wrote its own chunks) and the remainders broadcast from rank 0 (`remainders`; `base`
  // in the flat or the owned numbering), so that every rank's copy is whole.
  template <class T>
  void spread(T* base, bool flat, bool remainders);
  // Bucket b's ranges of the flat buffer `base`: each rank's chunk all-gathered in place (no
  // grouping of its own). Returns the last call's work.
  template <class T>
  work all_gather_chunks(std::size_t b, T* base);
  // A copy of parameters or gradients on a step's path (counted: copied_bytes_per_step).
  work copy_in_step(void* to, const void* from, std::size_t bytes) {
    copied_bytes_ += bytes;
    return group_->backend().copy(to, from, bytes);
  }

  P* parameter_at(const shard_segment& s) const { return flat_parameters() ? params_ + s.offset : params_ + s.owned; }
  master_type* master_at(const shard_segment& s) {
    if (separate_master()) return master_.template as<master_type>() + s.owned;
    return reinterpret_cast<master_type*>(parameter_at(s));
  }
  G* reduced_gradient_at(const shard_segment& s) const {
    return flat_gradients() ? grads_ + s.offset : grad_shard_.template as<G>() + s.owned;
  }
  void count_wire(std::size_t bytes, bool all_reduce) noexcept {
    const std::size_t n = world();
    wire_bytes_ += (all_reduce ? 2 : 1) * (n - 1) * bytes / n;
  }

  process_group<B>* group_;
  process_group<B>* replicas_;
  std::vector<region> regions_;
  training_options options_;
  bool adopted_ = false;
  bool adopted_parameters_ = false;  // an adopted parameter buffer (zero3 may go without)
  std::int64_t fingerprint_ = 0;     // of what the collectives pair up by, the same on every rank
  detail::state_layout layout_;
  std::vector<shard_segment> update_segments_;              // the optimizer's: owned pieces joined by group
  std::vector<std::size_t> update_first_;                   // bucket b's are [update_first_[b], update_first_[b + 1])
  std::vector<std::vector<shard_segment>> norm_by_bucket_;  // the norm's, by bucket: each element once over the ranks
  std::vector<shard_segment> owned_pieces_;                 // this rank's update, by region
  std::vector<owned_span> owned_spans_;                     // trainer_optimizer: the owned pieces, by region
  std::size_t owned_ = 0;

  P* params_ = nullptr;                   // the flat parameters (adopted or owned), or zero3's owned shard
  G* grads_ = nullptr;                    // the flat gradients (adopted, or owned under ddp/zero1); null until bound
  detail::backend_buffer<B> own_params_;  // owned flat parameters, or zero3's shard
  detail::backend_buffer<B> own_grads_;   // owned flat gradients (ddp, zero1)
  detail::backend_buffer<B> grad_shard_;  // owned zero2/zero3: the reduced chunks and remainders
  detail::backend_buffer<B> master_;      // owned numbering, where P is not the master type
  detail::backend_buffer<B> first_;       // owned numbering: Adam's first moment, or SGD's momentum
  detail::backend_buffer<B> second_;      // owned numbering: Adam's second moment
  detail::backend_buffer<B> scratch_;     // owned numbering: gradients cast to the master type
  detail::backend_buffer<B> stats_;       // the non-finite count and the step's sum of squares so far
  pool_type gradient_pool_;
  pool_type parameter_pool_;
  std::size_t gradient_pool_bytes_ = 0, parameter_pool_bytes_ = 0;  // allocated by each pool

  std::vector<pooled> bucket_grads_;                        // owned zero2/3: held gradient buffers
  std::vector<pooled> bucket_params_;                       // zero3: gathered parameter buffers
  std::vector<work> bucket_gathered_;                       // zero3: the gather of each held buffer
  std::vector<std::uint8_t> gathered_in_place_;             // zero3 over an adopted buffer: by bucket
  std::vector<std::optional<work>> deferred_publications_;  // zero1/zero2: by bucket, not yet waited for
  std::size_t deferred_count_ = 0;
  std::vector<int> layer_users_;  // live views per layer
  layer_view* views_ = nullptr;   // the live views, to name and detach at the state's end
  std::optional<std::size_t> last_gathered_;
  bool backward_phase_ = false;                  // zero3: a gather went at or below the last one
  std::vector<std::uint8_t> backward_gathered_;  // zero3: by layer, its latest gather was the backward's

  std::vector<std::uint8_t> marked_;
  std::vector<std::size_t> pending_;              // unmarked regions per bucket
  std::vector<std::uint8_t> due_;                 // zero3: the backward is done with the bucket: to be reduced
  std::size_t launched_ = 0;                      // buckets launched, from the last
  std::vector<std::pair<G*, std::size_t>> kept_;  // a launch's reduced parts, for the replicas
  int no_sync_depth_ = 0;
  // A failure of a no_sync scope's end (its fold), thrown by the next call (check_published).
  mutable std::exception_ptr deferred_failure_;
  int evaluating_ = 0;
  bool evaluation_agreed_ = false;  // zero3: this evaluation() scope's agreement is done
  bool publish_due_ = false;        // trainer_optimizer: step() returned, publish_parameters() not yet called
  bool skipped_update_ = false;     // the last step was skipped: nothing to publish
  bool warned_overlap_ = false;
  // The join's options while one runs; whether this micro-step's agreement is done, and how
  // many ranks it found with data.
  std::optional<join_options> join_;
  bool agreed_ = false;
  bool sync_micro_step_ = true;
  bool announcing_ = false;  // zero3, with data, while a rank sits out: announce each collective
  int contributors_ = 0;
  int last_contributors_ = 0;
  std::uint64_t steps_ = 0;
  std::size_t last_overlapped_ = 0;
  std::size_t wire_bytes_ = 0, last_step_wire_bytes_ = 0, evaluation_wire_bytes_ = 0;
  std::size_t copied_bytes_ = 0, last_step_copied_bytes_ = 0;
  stream_type caller_stream_{};
  // Reproducible mode: the binary counter's levels (each the whole gradient, packed numbering:
  // bucket after bucket), each bucket's start there, the micro-steps folded this step, whether
  // this step's micro-steps were agreed on; the staging buffers of the ranks' partials; the
  // exact norm's bins.
  std::vector<detail::backend_buffer<B>> fold_levels_;
  std::vector<std::size_t> packed_start_;
  std::size_t folded_ = 0;
  bool micro_steps_agreed_ = false;
  pool_type staging_pool_;
  std::size_t staging_pool_bytes_ = 0;
  detail::backend_buffer<B> exact_norm_;
  std::vector<std::int64_t> exact_norm_total_;  // its ranks' sum, read back each step (sized once)
  std::vector<engine_span> engine_spans_;       // noted, not yet on the timeline
};

// Here, not with the other bodies: every unit instantiates it with its own loop.
template <backend B, element P, element G>
template <class Loop>
void training_state<B, P, G>::join(Loop&& loop, join_options options) {
  if (reproducible())
    fail("join",
         "reproducible: a join changes which ranks contribute, and with them the tree of the sum and its divisor",
         "give every rank its run of M / world micro-batches each step (the sampler's reproducible order), or train "
         "without training_options::reproducible");
  if (replicated())
    fail("join", "a join with replicas (hybrid sharding) is not supported",
         "give every rank the same number of batches (e.g. the sampler's even_batches), or train without replicas");
  if (join_) fail("join", "a join is already running", "run one join around the training loop");
  if (trainer_optimizer() && !options.update)
    fail("join", "with trainer_optimizer, a rank that ran out of data still updates its part of the others' steps",
         "pass join_options::update: your update of owned_spans(), given the step's result");
  join_ = std::move(options);
  // Whatever happens in the loop, the state leaves the join: an error propagates from here as
  // from any call, with no destructor in the way.
  struct leave {
    training_state* state;
    ~leave() {
      state->join_.reset();
      state->agreed_ = false;
    }
  } left{this};
  std::forward<Loop>(loop)();
  answer_until_all_joined();
}

}  // namespace cohort::inline v0

// The other bodies: compiled once, only in the library's unit and in units that ask for them.
#if !defined(COHORT_SEPARATE_COMPILATION) || defined(COHORT_TEMPLATE_BODIES)
#include "cohort/parallel/impl/training_state.hpp"
#endif
