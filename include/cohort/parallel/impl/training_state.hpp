#pragma once
// training_state's member bodies (cohort/parallel/training_state.hpp): always included
// header-only; compiled once, only by the library's unit (cohort/src.hpp) and by units that
// define COHORT_TEMPLATE_BODIES (see cohort/detail/compiled_specializations.hpp).
// Over 400 lines: the bodies of one class's members, kept together as the class is.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/parallel/training_state.hpp"

namespace cohort::inline v0 {

template <backend B, element P, element G>
training_state<B, P, G>::training_state(process_group<B>& group, std::vector<region> regions, training_options options,
                                        process_group<B>* replicas)
    : training_state(group, std::nullopt, std::move(regions), std::move(options), replicas) {}

template <backend B, element P, element G>
training_state<B, P, G>::training_state(process_group<B>& group, std::span<P> parameters, std::span<G> gradients,
                                        std::vector<region> regions, training_options options,
                                        process_group<B>* replicas)
    : training_state(group, adopted_buffers{parameters, gradients}, std::move(regions), std::move(options), replicas) {
  if (!parameters.empty()) load_parameters(std::span<const P>(parameters.data(), parameters.size()));
}

template <backend B, element P, element G>
training_state<B, P, G>::training_state(process_group<B>& group, std::optional<adopted_buffers> adopted,
                                        std::vector<region> regions, training_options options,
                                        process_group<B>* replicas)
    : group_(&group),
      replicas_(replicas),
      regions_(std::move(regions)),
      options_(std::move(options)),
      adopted_(adopted.has_value()),
      adopted_parameters_(adopted && !adopted->parameters.empty()),
      gradient_pool_(group.backend()),
      parameter_pool_(group.backend()),
      staging_pool_(group.backend()) {
  options_.trainer_optimizer = trainer_optimizer();  // what options() says from here
  // The adopted buffers' length is the flat buffer's: the gradients', or where they come later
  // (bind_gradients) the parameters' (the same; absent at zero3 only), or the regions' extent.
  std::size_t elements = 0;
  if (adopted) elements = adopted->gradients.empty() ? adopted->parameters.size() : adopted->gradients.size();
  if (adopted && elements == 0)
    for (const auto& r : regions_) elements = std::max(elements, r.offset + r.count);
  P* const parameters = adopted ? adopted->parameters.data() : nullptr;
  G* const gradients = adopted ? adopted->gradients.data() : nullptr;
  std::string refusal;
  if (adopted && !adopted->parameters.empty() && !parameters)
    refusal = detail::text("the adopted parameter buffer is null (", std::to_string(adopted->parameters.size()),
                           " elements): pass the trainer's allocated parameters (at zero3 an empty span lets the "
                           "state keep them)");
  else if (adopted && !adopted->gradients.empty() && !gradients)
    refusal = detail::text("the adopted gradient buffer is null (", std::to_string(adopted->gradients.size()),
                           " elements): a trainer that allocates its gradients in its first backward passes an empty "
                           "span here and bind_gradients(its buffer) once allocated, before its first mark");
  else if (adopted && adopted->parameters.empty() && options_.strategy != strategy::zero3)
    refusal = detail::text("no adopted parameter buffer under ", to_string(options_.strategy),
                           ": the state updates the trainer's parameters in place (only zero3 may go without)");
  else if (adopted && !adopted->parameters.empty() && !adopted->gradients.empty() &&
           adopted->parameters.size() != elements)
    refusal = detail::text("the adopted parameter buffer has ", std::to_string(adopted->parameters.size()),
                           " elements, the gradient buffer ", std::to_string(elements),
                           ": they hold the same tensors at the same offsets");
  if (refusal.empty()) refusal = detail::check_regions(regions_, elements);
  const auto s = static_cast<int>(options_.strategy);
  if (refusal.empty() && (s < 0 || s > 3))
    refusal = detail::text("strategy ", std::to_string(s), ": use strategy::ddp, zero1, zero2 or zero3");
  if (refusal.empty() && options_.bucket_bytes < sizeof(G))
    refusal = detail::text("bucket_bytes ", std::to_string(options_.bucket_bytes), " is below one gradient element");
  if (refusal.empty() && options_.prefetch < 0)
    refusal = detail::text("prefetch ", std::to_string(options_.prefetch), " < 0");
  if (refusal.empty() && options_.reductions_in_flight < 0)
    refusal = detail::text("reductions_in_flight ", std::to_string(options_.reductions_in_flight), " < 0");
  if (refusal.empty() && options_.reproducible)
    refusal = detail::reproducible_refusal(options_.reproducible->micro_batches, world(),
                                           replicas_ ? static_cast<std::size_t>(replicas_->world_size()) : 1);
  agree_on_layout(refusal, elements);
  if (replicas_) agree_on_replicas();

  layout_ =
      detail::plan_layout(regions_, group.world_size(), std::max<std::size_t>(options_.bucket_bytes / sizeof(G), 1),
                          !sharded_parameters(), options_.first_bucket_bytes / sizeof(G));
  owned_ = sharded() ? layout_.owned : layout_.elements;
  // The norm's pieces, by bucket: each element counted once over the ranks, whose parts the
  // step sums. Sharded, each rank's chunks; under ddp, where every rank holds the whole
  // averaged bucket, the same cut: each rank reads 1/N of the gradients, not all of them, for
  // one scalar all-reduce a step. The remainders, alike on every rank, count in rank 0's part.
  norm_by_bucket_.assign(layout_.buckets.size(), {});
  for (const auto& piece : detail::chunk_segments(regions_, layout_, group.rank(), group.rank() == 0, !sharded()))
    norm_by_bucket_[layout_.regions[piece.region].bucket].push_back(piece);
  for (auto& pieces : norm_by_bucket_) pieces = detail::joined_segments(pieces, regions_, false);
  if (sharded()) {
    update_segments_ = detail::chunk_segments(regions_, layout_, group.rank(), true, false);
  } else {
    for (std::size_t r = 0; r < regions_.size(); ++r)
      update_segments_.push_back({regions_[r].offset, regions_[r].offset, regions_[r].count, r});
    std::sort(update_segments_.begin(), update_segments_.end(),
              [](const shard_segment& a, const shard_segment& b) { return a.offset < b.offset; });
  }
  const std::vector<shard_segment> pieces = update_segments_;  // by region, for owned_spans()
  // Joined within a bucket only: each bucket's update is published before the next is done.
  const std::size_t buckets = layout_.buckets.size();
  std::vector<std::vector<shard_segment>> by_bucket(buckets);
  for (const auto& piece : pieces) by_bucket[layout_.regions[piece.region].bucket].push_back(piece);
  update_segments_.clear();
  update_first_.assign(1, 0);
  for (const auto& in_bucket : by_bucket) {
    for (const auto& joined : detail::joined_segments(in_bucket, regions_, true)) update_segments_.push_back(joined);
    update_first_.push_back(update_segments_.size());
  }

  deferred_publications_.resize(buckets);
  bucket_grads_.resize(buckets);
  bucket_params_.resize(buckets);
  bucket_gathered_.resize(buckets);
  layer_users_.assign(layout_.layers, 0);
  backward_gathered_.assign(layout_.layers, 0);
  marked_.assign(regions_.size(), 0);
  pending_.assign(buckets, 0);
  due_.assign(buckets, 0);
  gathered_in_place_.assign(buckets, 0);
  for (std::size_t b = 0, start = 0; b < buckets; start += layout_.buckets[b++].elements)
    packed_start_.push_back(start);
  reset_marks();
  params_ = flat_parameters() ? parameters : nullptr;
  grads_ = gradients;
  allocate_buffers();
  owned_pieces_ = pieces;
  build_owned_spans();
  // Nothing overlaps the backward when one bucket holds everything: say so once, where it
  // costs (a model of more than a few MiB), instead of leaving bucket_count() to tell.
  const std::size_t gradient_bytes = layout_.elements * sizeof(G);
  if (buckets == 1 && group.world_size() > 1 && group.rank() == 0 && gradient_bytes > (std::size_t{4} << 20))
    std::fprintf(stderr,
                 "[cohort rank 0] training_state: one bucket holds all %zu gradient bytes, so its reduction "
                 "cannot overlap the backward; lower bucket_bytes (now %zu) to overlap\n",
                 gradient_bytes, options_.bucket_bytes);
}

template <backend B, element P, element G>
training_state<B, P, G>::~training_state() {
  if (views_) {
    // The views point into memory freed here: name them, and cut them off, so that a later
    // param() throws instead of reading freed memory.
    std::string layers;
    std::size_t count = 0;
    for (layer_view* view = views_; view; view = view->next_, ++count)
      if (count < 8) layers += detail::text(count == 0 ? "" : ", ", std::to_string(view->layer_));
    std::fprintf(stderr,
                 "[cohort rank %d] training_state destroyed while %zu layer view(s) are alive (layer %s%s): they "
                 "point into its memory; end every view before the state\n",
                 rank(), count, layers.c_str(), count > 8 ? ", ..." : "");
    while (layer_view* view = views_) {
      views_ = view->next_;
      view->state_ = nullptr;
      view->previous_ = view->next_ = nullptr;
    }
#if !defined(NDEBUG)
    std::abort();
#endif
  }
  try {
    group_->backend().record().wait();  // nothing queued may still use what is freed
  } catch (...) {
    // A failed group: the memory is still ours to free.
  }
  for (auto& held : bucket_grads_)
    if (held.data) gradient_pool_.release(held);
  for (auto& held : bucket_params_)
    if (held.data) parameter_pool_.release(held);
}

template <backend B, element P, element G>
void training_state<B, P, G>::agree_on_layout(const std::string& refusal, std::size_t elements) {
  // One row per rank: whether it refused, a fingerprint of everything the collectives pair
  // up by, and the sizes an error names.
  std::size_t flat = elements;
  for (const auto& r : regions_) flat = std::max(flat, r.offset + r.count);
  fingerprint_ = detail::layout_fingerprint(regions_, flat, options_.bucket_bytes / sizeof(G),
                                            options_.first_bucket_bytes / sizeof(G),
                                            static_cast<int>(options_.strategy) + (trainer_optimizer() ? 16 : 0),
                                            static_cast<int>(dtype_v<P>), static_cast<int>(dtype_v<G>));
  // Reproducible: M and the micro-batch size, which every rank must share (replicas compare
  // them through the fingerprint).
  const auto batches = static_cast<std::int64_t>(options_.reproducible ? options_.reproducible->micro_batches : 0);
  const auto batch_size =
      static_cast<std::int64_t>(options_.reproducible ? options_.reproducible->micro_batch_size : 0);
  if (options_.reproducible) {
    detail::fnv1a hash;
    for (const std::int64_t word : {fingerprint_, batches, batch_size}) hash.mix(static_cast<std::uint64_t>(word));
    fingerprint_ = static_cast<std::int64_t>(hash.value());
  }
  constexpr std::size_t width = 6;
  const std::int64_t row[width] = {
      refusal.empty() ? 0 : 1,         fingerprint_, static_cast<std::int64_t>(regions_.size()),
      static_cast<std::int64_t>(flat), batches,      batch_size};
  const auto all = all_gather_values(*group_, std::span<const std::int64_t>(row, width));
  if (!refusal.empty())
    fail("layout", refusal,
         options_.reproducible && refusal.starts_with("reproducible")
             ? "choose M and the world together (8 micro-batches: 1, 2, 4 or 8 ranks), or train without the mode"
             : "describe every tensor of the flat buffer once, as a region");
  for (int r = 0; r < group_->world_size(); ++r)
    if (all[static_cast<std::size_t>(r) * width] != 0)
      fail("layout", detail::text("rank ", std::to_string(r), " refused its regions or options (its error says why)"),
           "build the state from the same model on every rank");
  for (int r = 1; r < group_->world_size(); ++r) {
    const auto* theirs = &all[static_cast<std::size_t>(r) * width];
    if (theirs[4] != all[4] || theirs[5] != all[5])
      fail("layout",
           detail::text("reproducible: rank ", std::to_string(r), " has ", std::to_string(theirs[4]),
                        " micro-batches of ", std::to_string(theirs[5]), " samples, rank 0 ", std::to_string(all[4]),
                        " of ", std::to_string(all[5])),
           "every rank must pass the same reproducible_options (M and the micro-batch size): the same global batch "
           "cut into the same micro-batches");
    if (theirs[1] != all[1])
      fail("layout",
           detail::text("rank ", std::to_string(r), " has ", std::to_string(theirs[2]), " regions over ",
                        std::to_string(theirs[3]), " elements, rank 0 ", std::to_string(all[2]), " over ",
                        std::to_string(all[3]),
                        (theirs[2] == all[2] && theirs[3] == all[3]
                             ? " (the same sizes: their offsets, layers, strategy, bucket_bytes or dtypes differ)"
                             : "")),
           "every rank must pass the same regions, strategy, bucket size and dtypes, or the collectives pair "
           "up wrongly");
  }
}
// Hybrid sharding: every member of this rank's replica group must hold the same place in a
// group of the same size with the same layout (checked over the replicas), and every rank of
// the group must have as many replicas (checked over the group, which also carries a refusal
// to the whole group: each refused replica group has a member in every group, so every rank
// of the job throws).
template <backend B, element P, element G>
void training_state<B, P, G>::agree_on_replicas() {
  const std::int64_t mine[3] = {group_->rank(), group_->world_size(), fingerprint_};
  const auto rows = all_gather_values(*replicas_, std::span<const std::int64_t>(mine, 3));
  const std::string me = detail::text("replica rank ", std::to_string(replicas_->rank()), " (this rank)");
  std::string refusal;
  for (int r = 0; r < replicas_->world_size() && refusal.empty(); ++r) {
    const auto* theirs = &rows[static_cast<std::size_t>(r) * 3];
    if (theirs[0] != mine[0] || theirs[1] != mine[1])
      refusal = detail::text("replica rank ", std::to_string(r), " is rank ", std::to_string(theirs[0]),
                             " of a group of ", std::to_string(theirs[1]), ", ", me, " rank ", std::to_string(mine[0]),
                             " of a group of ", std::to_string(mine[1]));
    else if (theirs[2] != mine[2])
      refusal = detail::text("replica rank ", std::to_string(r),
                             " has other regions, strategy, bucket size or dtypes than ", me);
  }
  const std::int64_t row[2] = {refusal.empty() ? 0 : 1, replicas_->world_size()};
  const auto all = all_gather_values(*group_, std::span<const std::int64_t>(row, 2));
  const std::string hint =
      "replicas are one rank per copy of the group, each at the same place in an equal group: split by local "
      "rank beside the split by node";
  if (!refusal.empty()) fail("replicas", refusal, hint);
  for (int r = 0; r < group_->world_size(); ++r)
    if (all[static_cast<std::size_t>(r) * 2] != 0)
      fail("replicas",
           detail::text("rank ", std::to_string(r), " of the group refused its replicas (its error says why)"), hint);
  for (int r = 1; r < group_->world_size(); ++r)
    if (all[static_cast<std::size_t>(r) * 2 + 1] != all[1])
      fail("replicas",
           detail::text("rank ", std::to_string(r), " of the group has ",
                        std::to_string(all[static_cast<std::size_t>(r) * 2 + 1]), " replicas, rank 0 has ",
                        std::to_string(all[1])),
           hint);
}

template <backend B, element P, element G>
template <class T>
T* training_state<B, P, G>::allocate_zeroed(detail::backend_buffer<B>& buffer, std::size_t count) {
  auto& engine = group_->backend();
  buffer = detail::backend_buffer<B>(engine, std::max<std::size_t>(count, 1) * sizeof(T));
  fill(engine, buffer.data(), count, dtype_v<T>, 0.0);
  return buffer.template as<T>();
}

template <backend B, element P, element G>
void training_state<B, P, G>::allocate_buffers() {
  // What the trainer did not lend: the flat parameters (zero3: the shard), the flat gradients
  // (ddp, zero1) or the reduced shard (zero2, zero3).
  if (!params_) params_ = allocate_zeroed<P>(own_params_, flat_parameters() ? layout_.elements : owned_);
  if (!adopted_ && flat_gradients()) grads_ = allocate_zeroed<G>(own_grads_, layout_.elements);
  if (!flat_gradients()) allocate_zeroed<G>(grad_shard_, owned_);
  if (!trainer_optimizer()) {
    if (separate_master()) allocate_zeroed<master_type>(master_, owned_);
    const bool adam = !options_.sgd;
    if (adam || options_.sgd->momentum != 0) allocate_zeroed<master_type>(first_, owned_);
    if (adam) allocate_zeroed<master_type>(second_, owned_);
    if (!std::is_same_v<G, master_type>) allocate_zeroed<master_type>(scratch_, owned_);
  }
  allocate_zeroed<double>(stats_, 2);  // the non-finite count and this step's sum of squares
  // Reproducible: the exact norm's bins (comm/detail/exact_squares.hpp).
  if (options_.reproducible) {
    allocate_zeroed<std::int64_t>(exact_norm_, detail::exact_squares_words(dtype_v<G>));
    exact_norm_total_.resize(detail::exact_squares_words(dtype_v<G>));
  }
  group_->backend().record().wait();
}

// --- parameters ------------------------------------------------------------------------------
template <backend B, element P, element G>
void training_state<B, P, G>::check_training_call(std::string_view operation) const {
  check_published(operation);
  if (evaluating_ > 0)
    fail(operation, detail::text(operation, "() inside evaluation()"),
         "evaluation() is for forward-only passes: end the scope before the training step's backward");
}

template <backend B, element P, element G>
void training_state<B, P, G>::check_published(std::string_view operation) const {
  if (deferred_failure_) std::rethrow_exception(std::exchange(deferred_failure_, nullptr));
  if (publish_due_)
    fail(operation, "the last step's update was not published (publish_parameters() was not called)",
         "with the trainer's optimizer (trainer_optimizer, the default over adopted buffers), call "
         "publish_parameters() after updating owned_spans(), after every step(); or pass trainer_optimizer = false "
         "for the state's");
}

template <backend B, element P, element G>
void training_state<B, P, G>::check_gradients_bound(std::string_view operation) const {
  if (!grads_ && flat_gradients())
    fail(operation,
         detail::text(operation,
                      "() with no gradient buffer: the adopting constructor was given an empty one, and "
                      "bind_gradients() was not called"),
         "call state.bind_gradients(the trainer's flat gradient buffer) once it is allocated, before the first "
         "gradient() or mark_ready()");
}

template <backend B, element P, element G>
void training_state<B, P, G>::build_owned_spans() {
  owned_spans_.clear();
  if (!trainer_optimizer() || (!grads_ && flat_gradients())) return;
  for (const auto& piece : owned_pieces_)
    owned_spans_.push_back({piece.region,
                            piece.offset,
                            piece.owned,
                            {parameter_at(piece), piece.count},
                            {reduced_gradient_at(piece), piece.count}});
}

template <backend B, element P, element G>
void training_state<B, P, G>::bind_gradients(std::span<G> gradients) {
  const char* const hint =
      "pass an empty gradient span to the adopting constructor, then bind the trainer's flat gradient buffer once, "
      "before its first mark";
  if (!adopted_) fail("bind_gradients", "the state keeps its own gradients (it adopted no buffers)", hint);
  if (grads_)
    fail("bind_gradients", "a gradient buffer is bound already (given at construction, or bound before)", hint);
  if (gradients.size() != layout_.elements || !gradients.data())
    fail("bind_gradients",
         detail::text("a gradient buffer of ", std::to_string(gradients.size()), " elements",
                      gradients.data() ? "" : " at a null pointer", " for a flat buffer of ",
                      std::to_string(layout_.elements)),
         "bind the trainer's allocated flat gradient buffer, the parameters' length");
  grads_ = gradients.data();
  build_owned_spans();
}

// --- parameters ------------------------------------------------------------------------------

template <backend B, element P, element G>
void training_state<B, P, G>::load_parameters(std::span<const P> flat) {
  snapshot_.wait();
  if (flat.size() != layout_.elements) {
    const bool longer = flat.size() > layout_.elements;
    fail("load_parameters",
         detail::text(std::to_string(flat.size()), " elements for regions covering ", std::to_string(layout_.elements),
                      (longer ? detail::text(": elements ", std::to_string(layout_.elements), "..",
                                             std::to_string(flat.size()), " belong to no region")
                              : std::string())),
         longer ? "describe every tensor of the flat buffer as a region (one left out at its end?), or pass only the "
                  "flat buffer"
                : "pass the trainer's whole flat parameter buffer");
  }
  check_training_call("load_parameters");
  await_all_parameters();
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);
  if (!flat_parameters()) {
    // This rank's chunks; the remainders every rank holds come from rank 0.
    for (const auto& s : update_segments_) engine.copy(params_ + s.owned, flat.data() + s.offset, s.count * sizeof(P));
    spread(params_, false, true);
  } else {
    if (flat.data() != params_) engine.copy(params_, flat.data(), layout_.elements * sizeof(P));
    // Where every rank holds the parameters whole, rank 0's are everyone's (as DDP broadcasts
    // at construction): ranks initialised with different seeds still start as one model. At
    // zero3 each chunk is its holder's, the remainders rank 0's.
    if (sharded_parameters())
      spread(params_, true, true);
    else if (world() > 1)
      group_->broadcast(std::span<P>(params_, layout_.elements), 0);
  }
  // Hybrid: the first copy's parameters are every copy's, whatever each copy was given.
  if (replicated()) {
    const std::size_t held = flat_parameters() ? layout_.elements : owned_;
    work copied = group_->backend().record();
    copied.make_stream_wait(replicas_->backend().stream());
    copied = replicas_->broadcast(std::span<P>(params_, held), 0);
    copied.make_stream_wait(engine.stream());
  }
  if (separate_master())
    for (const auto& s : update_segments_)
      cast(engine, parameter_at(s), dtype_v<P>, master_at(s), dtype_v<master_type>, s.count);
  drop_gathered();
  if (sharded_parameters() && flat_parameters())
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b) poison_unheld(b);
  engine.record().wait();  // the caller's buffer may go once this returns
}

template <backend B, element P, element G>
std::vector<P> training_state<B, P, G>::gather_parameters() {
  await_all_parameters();
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);
  const std::size_t step_wire_bytes = wire_bytes_, step_copied_bytes = copied_bytes_;  // a check's, not a step's
  std::vector<P> flat(layout_.elements);
  if (!sharded_parameters()) {
    engine.copy(flat.data(), params_, layout_.elements * sizeof(P)).wait();
    return flat;
  }
  for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bucket = layout_.buckets[b];
    gather_bucket(b);
    for (const auto& range : bucket.ranges)
      engine.copy(flat.data() + range.offset, gathered_range(b, range), range.count * sizeof(P));
    if (layer_users_[bucket.layer] == 0) {
      engine.record().wait();
      end_gathered(b, engine.record());
    }
  }
  engine.record().wait();
  wire_bytes_ = step_wire_bytes;
  copied_bytes_ = step_copied_bytes;
  return flat;
}

template <backend B, element P, element G>
auto training_state<B, P, G>::gather(std::size_t layer) -> layer_view {
  if (layer >= layout_.layers)
    fail("gather", detail::text("layer ", std::to_string(layer), " of ", std::to_string(layout_.layers)),
         "layers are the regions' layer numbers, 0 .. layers - 1");
  check_published("gather");
  if (!sharded_parameters()) {
    if (evaluating_ == 0) begin_call();
    if (deferred_count_ > 0)
      for (const std::size_t r : layout_.regions_of_layer[layer]) await_parameters(layout_.regions[r].bucket);
    ++layer_users_[layer];
    return layer_view(this, layer);
  }
  if (evaluating_ > 0) {
    if (!evaluation_agreed_ && !announcing_) agree_on_evaluation(layer);
    // Not a step's: no forward or backward, no reduction; its bytes are evaluation's.
    const std::size_t before = wire_bytes_;
    for (std::size_t b = layout_.first_bucket_of_layer[layer]; b < layout_.first_bucket_of_layer[layer + 1]; ++b) {
      gather_bucket(b);
      hand_to_caller(bucket_gathered_[b]);
    }
    evaluation_wire_bytes_ += wire_bytes_ - before;
    wire_bytes_ = before;
    ++layer_users_[layer];
    return layer_view(this, layer);
  }
  begin_call();
  // The first gather of a micro-step is the forward's; the first at or below the last one
  // begins the backward. Once the backward has moved below a layer whose latest gather was
  // its own, that layer's buckets are due: reduced from here (the next launch). A layer read
  // twice in the forward (a tied embedding) only begins the backward early, which costs no
  // overlap; a layer recomputed in the backward is due once the backward has passed it again.
  // The gathers are collectives, so all of this is the same on every rank.
  if (!backward_phase_ && last_gathered_ && layer <= *last_gathered_) backward_phase_ = true;
  if (backward_phase_ && !accumulating()) mark_due_above(layer);
  backward_gathered_[layer] = backward_phase_;
  for (std::size_t b = layout_.first_bucket_of_layer[layer]; b < layout_.first_bucket_of_layer[layer + 1]; ++b)
    gather_bucket(b);
  // The next layers' gathers go out before the reductions the backward has made due, as FSDP's
  // backward prefetch orders them: on the group's one queue the next gather would otherwise
  // wait behind this layer's reductions, and the next layer's compute with it.
  prefetch_after(layer);
  if (!accumulating()) launch_ready();  // what the backward finished so far
  // The straggler report counts the time the caller waits here for the gathers.
  straggler_report* const report = options_.straggler && options_.straggler->enabled() ? options_.straggler : nullptr;
  timeline* const recorder = options_.timeline && options_.timeline->recording() ? options_.timeline : nullptr;
  const auto entered = report || recorder ? straggler_report::clock::now() : straggler_report::clock::time_point{};
  const std::int64_t cpu_entered = report && report->times_cpu() ? straggler_report::thread_cpu_ns() : 0;
  for (std::size_t b = layout_.first_bucket_of_layer[layer]; b < layout_.first_bucket_of_layer[layer + 1]; ++b)
    hand_to_caller(bucket_gathered_[b]);
  if (report || recorder) {
    const auto now = straggler_report::clock::now();
    if (report) report->add_wait(wait_kind::gather, now - entered);
    if (report && report->times_cpu()) report->add_wait_cpu(straggler_report::thread_cpu_ns() - cpu_entered);
    if (recorder)
      recorder->add_span(detail::text("gather wait layer ", std::to_string(layer)), timeline_category::communication,
                         entered, now);
  }
  ++layer_users_[layer];
  last_gathered_ = layer;
  return layer_view(this, layer);
}

template <backend B, element P, element G>
void training_state<B, P, G>::mark_due_above(std::size_t layer) {
  for (std::size_t l = layer + 1; l < layout_.layers; ++l)
    if (backward_gathered_[l] && layer_users_[l] == 0)
      for (std::size_t b = layout_.first_bucket_of_layer[l]; b < layout_.first_bucket_of_layer[l + 1]; ++b) due_[b] = 1;
}

template <backend B, element P, element G>
std::span<P> training_state<B, P, G>::parameter_span(std::size_t layer, std::size_t r) {
  check_region("param", r);
  if (regions_[r].layer != layer)
    fail("param",
         detail::text(describe(r), " is in layer ", std::to_string(regions_[r].layer), ", not layer ",
                      std::to_string(layer)),
         "gather the region's own layer");
  const auto& placed = layout_.regions[r];
  if (deferred_count_ > 0) await_parameters(placed.bucket);  // a view kept from before the step
  if (flat_parameters()) return {params_ + regions_[r].offset, regions_[r].count};
  return {static_cast<P*>(bucket_params_[placed.bucket].data) + placed.packed, regions_[r].count};
}

// A bucket's ranges all-gathered: over the state's shards into a pooled buffer, end to end
// (each rank's chunks, then the remainder every rank holds, copied in); over an adopted
// buffer in place, at the ranges' own offsets, where this rank's chunks and the remainders
// already are.
template <backend B, element P, element G>
void training_state<B, P, G>::gather_bucket(std::size_t b) {
  if (is_gathered(b)) return;  // held, or prefetched
  announce(joined_call::gather, b);
  auto& engine = group_->backend();
  const auto& bucket = layout_.buckets[b];
  const std::size_t n = world();
  if (flat_parameters()) {
    gathered_in_place_[b] = 1;
  } else {
    const std::size_t bytes = bucket.elements * sizeof(P);
    const std::size_t before = parameter_pool_.allocations();
    bucket_params_[b] = parameter_pool_.take(bytes);
    if (parameter_pool_.allocations() != before) parameter_pool_bytes_ += bytes;
  }
  engine.wait_for_caller(caller_stream_);  // a reused buffer's last readers (the trainer's own: its writes) are done
  work done;
  const std::uint64_t first_call = engine_calls_begin();
  if (!flat_parameters())
    for (const auto& range : bucket.ranges)
      if (range.remainder > 0)
        done = copy_in_step(gathered_range(b, range) + n * range.chunk, params_ + range.owned + range.chunk,
                            range.remainder * sizeof(P));
  {
    // Named in errors, progress lines and traces: a gather one rank issues alone (sampling on
    // rank 0 only) is recognised as such by every rank.
    char label[96];  // on the stack: a gather is on the step's path, a label costs no allocation
    if (evaluating_ > 0)
      std::snprintf(label, sizeof label, "evaluation gather of layer %zu", bucket.layer);
    else
      std::snprintf(label, sizeof label, "step %llu gather of layer %zu", static_cast<unsigned long long>(steps_) + 1,
                    bucket.layer);
    const auto labelled = group_->call_context_within(label);
    auto together = group_->grouped();
    if (flat_parameters()) {
      if (n > 1) done = all_gather_chunks(b, params_);  // at 1 rank the buffer is whole already
    } else {
      for (const auto& range : bucket.ranges)
        if (range.chunk > 0) {
          done = group_->all_gather(std::span<const P>(params_ + range.owned, range.chunk),
                                    std::span<P>(gathered_range(b, range), n * range.chunk));
          count_wire(n * range.chunk * sizeof(P), false);
          if (n == 1 && evaluating_ == 0) copied_bytes_ += range.chunk * sizeof(P);  // one rank's gather: a copy
        }
    }
    together.end();
  }
  bucket_gathered_[b] = std::move(done);
  note_engine_span(b, engine_work::gather, first_call);
}

template <backend B, element P, element G>
void training_state<B, P, G>::prefetch_after(std::size_t layer) {
  // From the top layer the next gathers can only be the backward's, downward: at the forward's
  // last layer they go out while it computes, as at the backward's first.
  const bool backward = (last_gathered_ && layer < *last_gathered_) || layer + 1 == layout_.layers;
  for (int ahead = 1; ahead <= options_.prefetch; ++ahead) {
    const auto step = static_cast<std::size_t>(ahead);
    if (backward ? layer < step : layer + step >= layout_.layers) break;
    const std::size_t next = backward ? layer - step : layer + step;
    for (std::size_t b = layout_.first_bucket_of_layer[next]; b < layout_.first_bucket_of_layer[next + 1]; ++b)
      gather_bucket(b);
  }
}

template <backend B, element P, element G>
void training_state<B, P, G>::release_layer(std::size_t layer) noexcept {
  if (--layer_users_[layer] > 0 || !sharded_parameters()) return;
  // The forward's top layer is the backward's first: it stays gathered into the backward
  // rather than be gathered again at once (FSDP2 keeps its root unsharded after the forward
  // alike). step() drops it with every other gathered layer. The same on every rank: which
  // layers are held decides which gathers are issued.
  if (!backward_phase_ && evaluating_ == 0 && layer + 1 == layout_.layers) return;
  for (std::size_t b = layout_.first_bucket_of_layer[layer]; b < layout_.first_bucket_of_layer[layer + 1]; ++b) {
    if (!is_gathered(b)) continue;
    try {
      end_gathered(b, group_->backend().record());
    } catch (...) {
      // A failed group: the buffer is freed once its gather is done, whatever happened (an
      // adopted buffer's bytes are left as they are: the group can gather no more).
      gathered_in_place_[b] = 0;
      if (!bucket_params_[b].data) continue;
      bucket_params_[b].last_use = bucket_gathered_[b];
      parameter_pool_.put(std::exchange(bucket_params_[b], pooled{}));
    }
  }
}

template <backend B, element P, element G>
void training_state<B, P, G>::end_gathered(std::size_t b, work last_use) {
  // The timeline's row of the bucket shows it gathered from its gather's completion to here.
  for (auto noted = engine_spans_.rbegin(); noted != engine_spans_.rend(); ++noted)
    if (noted->bucket == b && noted->what == engine_work::gather) {
      engine_spans_.push_back(
          {b, engine_work::gathered, noted->step, noted->first_call, noted->last_call, timeline::clock::now()});
      break;
    }
  if (flat_parameters()) {
    gathered_in_place_[b] = 0;
    poison_unheld(b);
    return;
  }
  bucket_params_[b].last_use = std::move(last_use);
  parameter_pool_.put(std::exchange(bucket_params_[b], pooled{}));
}

// Outside a gather the other ranks' chunks in the trainer's buffer would be stale from the
// first step on (they were last gathered before it): NaN instead, in every build, so that a
// read through the trainer's own pointers outside gather() shows in its loss at once. A
// trainer's update over the whole buffer writes NaN there and its real update in this rank's
// chunks, which the next gather spreads: nothing is lost. One fill of what the gather wrote.
template <backend B, element P, element G>
void training_state<B, P, G>::poison_unheld(std::size_t b) {
  const std::size_t n = world(), k = my_rank();
  if (n == 1) return;  // every element is this rank's
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);  // the trainer's reads of the layer
  const double poison = std::numeric_limits<double>::quiet_NaN();
  for (const auto& range : layout_.buckets[b].ranges) {
    if (range.chunk == 0) continue;
    P* whole = params_ + range.offset;
    if (k > 0) fill(engine, whole, k * range.chunk, dtype_v<P>, poison);
    if (k + 1 < n) fill(engine, whole + (k + 1) * range.chunk, (n - k - 1) * range.chunk, dtype_v<P>, poison);
  }
}

// Gathered parameters are stale once the step updates the shards, and a prefetch nobody
// used holds memory: both go back to the pool.
template <backend B, element P, element G>
void training_state<B, P, G>::drop_gathered() {
  if (!sharded_parameters()) return;
  for (std::size_t b = 0; b < bucket_params_.size(); ++b) {
    if (!is_gathered(b)) continue;
    if (layer_users_[layout_.buckets[b].layer] > 0)
      fail("step", detail::text("layer ", std::to_string(layout_.buckets[b].layer), " is still gathered"),
           "end the layer's view (it goes out of scope, or reset()) before step(): its parameters change");
    end_gathered(b, group_->backend().record());
  }
  last_gathered_.reset();
}

// --- gradients and the step --------------------------------------------------------------------

template <backend B, element P, element G>
G* training_state<B, P, G>::bucket_gradients(std::size_t b, bool for_caller) {
  if (!bucket_grads_[b].data) {
    auto& engine = group_->backend();
    const std::size_t bytes = layout_.buckets[b].elements * sizeof(G);
    const std::size_t before = gradient_pool_.allocations();
    // The host's backward writes the buffer itself: rather than wait for a reduction in
    // flight to reuse its buffer, it takes a new one while reductions_in_flight allow.
    const bool host = B::space == memory_space::host;
    const auto buffers = static_cast<std::size_t>(options_.reductions_in_flight) + 1;
    bucket_grads_[b] = host && !gradient_pool_.idle_fits(bytes) && gradient_pool_.allocations() < buffers
                           ? gradient_pool_.take_new(bytes)
                           : gradient_pool_.take(bytes, host);  // the host waits for reuse
    if (gradient_pool_.allocations() != before) {
      gradient_pool_bytes_ += bytes;
      // A new buffer is zeroed here (on the host by the caller: a fill queued on the worker
      // would wait for every reduction in flight, and the backward with it).
      if constexpr (B::space == memory_space::host) {
        std::memset(bucket_grads_[b].data, 0, bytes);
      } else {
        const work zeroed = fill(engine, bucket_grads_[b].data, layout_.buckets[b].elements, dtype_v<G>, 0.0);
        if (for_caller) hand_to_caller(zeroed);
      }
    } else if (for_caller) {
      // A pooled one was zeroed right after the reduction that last read it (launch()).
      hand_to_caller(bucket_grads_[b].last_use);
    }
  }
  return static_cast<G*>(bucket_grads_[b].data);
}

template <backend B, element P, element G>
std::span<G> training_state<B, P, G>::gradient(std::size_t r) {
  check_region("gradient", r);
  check_training_call("gradient");
  check_gradients_bound("gradient");
  begin_call();
  const auto& placed = layout_.regions[r];
  const std::size_t position = layout_.buckets.size() - 1 - placed.bucket;  // in launch order
  if (position < launched_)
    fail("gradient", detail::text("the bucket of ", describe(r), " was already reduced this step"),
         "ask for a region's gradient (and write it) before marking its bucket's regions ready");
  if (flat_gradients()) return {grads_ + regions_[r].offset, regions_[r].count};
  return {bucket_gradients(placed.bucket, true) + placed.packed, regions_[r].count};
}

template <backend B, element P, element G>
void training_state<B, P, G>::mark_ready(std::size_t r) {
  check_region("mark_ready", r);
  check_training_call("mark_ready");
  check_gradients_bound("mark_ready");
  begin_call();
  if (marked_[r])
    fail("mark_ready", detail::text(describe(r), " marked twice in one step"),
         "mark each region once per backward pass");
  marked_[r] = 1;
  --pending_[layout_.regions[r].bucket];
  // ddp, zero1 and zero2 launch as marks complete buckets; zero3 as the
  // backward's gathers move below a layer, since its gathers interleave with the reductions
  // and marks differ across ranks (a region one rank leaves unused), while gathers do not.
  if (!accumulating() && !sharded_parameters()) launch_ready();
}

template <backend B, element P, element G>
void training_state<B, P, G>::mark_layer_ready(std::size_t layer) {
  if (layer >= layout_.layers)
    fail("mark_layer_ready", detail::text("layer ", std::to_string(layer), " of ", std::to_string(layout_.layers)),
         "layers are the regions' layer numbers, 0 .. layers - 1");
  for (const std::size_t r : layout_.regions_of_layer[layer]) mark_ready(r);
}

template <backend B, element P, element G>
void training_state<B, P, G>::launch_ready() {
  const std::size_t buckets = layout_.buckets.size();
  const auto ready = [&](std::size_t b) { return sharded_parameters() ? due_[b] != 0 : pending_[b] == 0; };
  while (launched_ < buckets && ready(buckets - 1 - launched_)) launch(buckets - 1 - launched_++);
}

// One bucket's reduction, range by range, as one grouped launch: ddp all-reduces each range in
// place; sharded strategies reduce-scatter each range's chunks (in place in a flat buffer, or
// from the pooled bucket buffer into the owned shard) and all-reduce its remainder. Then, with
// replicas, every part this rank keeps is averaged across the copies.
template <backend B, element P, element G>
void training_state<B, P, G>::launch(std::size_t b) {
  check_gradients_bound("reduce");  // zero3 reduces as the backward's gathers move down
  announce(joined_call::reduce, b);
  auto& engine = group_->backend();
  const auto& bucket = layout_.buckets[b];
  engine.wait_for_caller(caller_stream_);
  if (options_.on_launch) options_.on_launch(b);
  const std::size_t n = world(), k = my_rank();
  // A bucket this rank never wrote contributes zeros (a pooled buffer is zeroed when taken).
  G* pooled_gradients = flat_gradients() ? nullptr : bucket_gradients(b, false);
  G* shard = flat_gradients() ? nullptr : grad_shard_.template as<G>();
  kept_.clear();
  // The step's agreement on the micro-steps goes before the bucket's calls: not its span.
  if (reproducible() && !micro_steps_agreed_) agree_on_micro_steps();
  const std::uint64_t first_call = engine_calls_begin();
  if (reproducible()) {
    reduce_canonically(b, pooled_gradients, shard, first_call);
    if (pooled_gradients) {
      bucket_grads_[b].last_use =
          fill(engine, bucket_grads_[b].data, bucket_grads_[b].capacity / sizeof(G), dtype_v<G>, 0.0);
      gradient_pool_.put(std::exchange(bucket_grads_[b], pooled{}));
    }
    return;
  }
  work reduced;
  {
    char label[96];
    std::snprintf(label, sizeof label, "step %llu reduction of bucket %zu (layer %zu)",
                  static_cast<unsigned long long>(steps_) + 1, b, bucket.layer);
    const auto labelled = group_->call_context_within(label);
    auto together = group_->grouped();
    for (const auto& range : bucket.ranges) {
      G* source = flat_gradients() ? grads_ + range.offset : pooled_gradients + range.packed;
      if (options_.strategy == strategy::ddp) {
        reduced = group_->all_reduce(std::span<G>(source, range.count), op::avg);
        count_wire(range.count * sizeof(G), true);
        kept_.emplace_back(source, range.count);
        continue;
      }
      if (range.chunk > 0) {
        G* chunk = flat_gradients() ? source + k * range.chunk : shard + range.owned;
        reduced = group_->reduce_scatter(std::span<const G>(source, n * range.chunk), std::span<G>(chunk, range.chunk),
                                         op::avg);
        count_wire(n * range.chunk * sizeof(G), false);
        kept_.emplace_back(chunk, range.chunk);
      }
      if (range.remainder > 0) {
        G* rest = flat_gradients() ? source + n * range.chunk : shard + range.owned + range.chunk;
        reduced = group_->all_reduce(std::span<const G>(source + n * range.chunk, range.remainder),
                                     std::span<G>(rest, range.remainder), op::avg);
        count_wire(range.remainder * sizeof(G), true);
        kept_.emplace_back(rest, range.remainder);
      }
    }
    together.end();
  }
  note_engine_span(b, engine_work::reduction, first_call);
  // The bucket buffer goes back to the pool zeroed for its next bucket, in the backend's order
  // right after the reduction that read it: the backward that takes it next neither zeroes it
  // nor waits for that reduction (the pool prefers a buffer whose zeroing is done).
  if (pooled_gradients) {
    bucket_grads_[b].last_use =
        fill(engine, bucket_grads_[b].data, bucket_grads_[b].capacity / sizeof(G), dtype_v<G>, 0.0);
    gradient_pool_.put(std::exchange(bucket_grads_[b], pooled{}));
  }
  if (replicated()) {
    // The replicas' queue waits for the group's reduction, and the group's later work (the
    // next reductions, the norm, the step's update) for the average. On a host backend both
    // waits block the caller: the average is synchronous there, while NCCL orders it on the
    // streams.
    reduced.make_stream_wait(replicas_->backend().stream());
    const std::uint64_t first_across = engine_calls_begin(engine_work::across_replicas);
    {
      auto together = replicas_->grouped();
      for (const auto& [data, count] : kept_) reduced = replicas_->all_reduce(std::span<G>(data, count), op::avg);
      together.end();
    }
    note_engine_span(b, engine_work::across_replicas, first_across);
    reduced.make_stream_wait(engine.stream());
    const auto copies = static_cast<std::size_t>(replicas_->world_size());
    for (const auto& part : kept_) wire_bytes_ += 2 * (copies - 1) * part.second * sizeof(G) / copies;
  }
  // This rank's part of the norm, as the bucket's gradients are final: in the backend's order
  // after its reduction, while the backward goes on, rather than in a pass of step()'s own
  // after the last bucket.
  auto* squares = static_cast<double*>(stats_.data()) + 1;
  for (const auto& s : norm_by_bucket_[b]) sum_of_squares(engine, reduced_gradient_at(s), s.count, dtype_v<G>, squares);
}

template <backend B, element P, element G>
void training_state<B, P, G>::reset_marks() {
  std::fill(marked_.begin(), marked_.end(), std::uint8_t{0});
  for (auto& count : pending_) count = 0;
  for (const auto& placed : layout_.regions) ++pending_[placed.bucket];
  std::fill(due_.begin(), due_.end(), std::uint8_t{0});
  std::fill(backward_gathered_.begin(), backward_gathered_.end(), std::uint8_t{0});
  backward_phase_ = false;
  launched_ = 0;
  // The next step's norm adds its buckets' squares to zero, each as it is reduced.
  if (stats_.data()) fill(group_->backend(), stats_.data(), 2, dtype::float64, 0.0);
  if (exact_norm_.data())
    fill(group_->backend(), exact_norm_.data(), detail::exact_squares_words(dtype_v<G>), dtype::int64, 0.0);
  last_gathered_.reset();  // a micro-step's end: the next gather is a forward's
  agreed_ = false;         // and under a join, the next call agrees again
  announcing_ = false;
}
// Every rank adds its three integers; a joined rank listens with zeros.
template <backend B, element P, element G>
void training_state<B, P, G>::exchange(std::int64_t (&values)[3]) {
  if constexpr (B::space == memory_space::host) {
    group_->all_reduce(std::span<std::int64_t>(values), op::sum).wait();
  } else {
    auto& engine = group_->backend();
    auto* staged = static_cast<std::int64_t*>(group_->value_staging(sizeof values));
    engine.copy(staged, values, sizeof values);
    group_->all_reduce(std::span<std::int64_t>(staged, 3), op::sum);
    engine.copy(values, staged, sizeof values).wait();
  }
}

// Every rank enters evaluation() at zero3 with the same first gather after the same step: sums
// of n times {the mark, the layer, the steps}. A rank that evaluates alone pairs this small
// all-reduce with the others' gathers or agreement instead (another call, which the group
// names on every rank, or sums that are not n times these).
template <backend B, element P, element G>
void training_state<B, P, G>::agree_on_evaluation(std::size_t layer) {
  const std::int64_t mine[3] = {evaluation_mark, static_cast<std::int64_t>(layer), static_cast<std::int64_t>(steps_)};
  std::int64_t sum[3] = {mine[0], mine[1], mine[2]};
  {
    const auto labelled = group_->call_context_within(detail::evaluation_agreement);
    exchange(sum);
  }
  const auto n = static_cast<std::int64_t>(world());
  if (sum[0] != mine[0] * n || sum[1] != mine[1] * n || sum[2] != mine[2] * n)
    fail("evaluation",
         detail::text("this rank began evaluation() with a gather of layer ", std::to_string(layer), " after step ",
                      std::to_string(steps_), ", but not every rank did",
                      (sum[0] == mine[0] * n ? " (a layer or a step differs)"
                                             : " (one is in another call of the state's, or of its own)")),
         std::string(detail::evaluation_alone_hint));
  evaluation_agreed_ = true;
}

// The micro-step's agreement, as a rank with data: every such rank adds {1, ends with step(),
// the agreement's mark}, a joined rank zeros. The sums say how many still train and whether
// the micro-step is synchronised; a mark that is not `ranks with data` x the mark means a
// foreign collective was paired with it.
template <backend B, element P, element G>
int training_state<B, P, G>::agree() {
  std::int64_t sum[3] = {1, no_sync_depth_ == 0 ? 1 : 0, agreement_mark};
  exchange(sum);
  agreed_ = true;
  take_agreement(sum);
  // At zero3 a joined rank cannot know which gathers this micro-step makes: it is told each.
  announcing_ = sharded_parameters() && contributors_ < group_->world_size();
  return contributors_;
}

template <backend B, element P, element G>
void training_state<B, P, G>::take_agreement(const std::int64_t (&sum)[3]) {
  if (sum[0] < 1 || sum[2] != agreement_mark * sum[0])
    fail("join", "the join's agreement was paired with another collective",
         "inside a join's loop issue no collective of your own between the state's calls: a rank that ran "
         "out of data is waiting in the agreement");
  if (sum[1] != 0 && sum[1] != sum[0])
    fail("join",
         detail::text(std::to_string(sum[1]), " of the ", std::to_string(sum[0]),
                      " ranks with data end this micro-step with step(), the others are inside no_sync"),
         "every rank with data must accumulate the same number of micro-steps");
  sync_micro_step_ = sum[1] != 0;
  contributors_ = static_cast<int>(sum[0]);
}

// At zero3, in a micro-step some rank sits out: before each collective of its own, every rank
// with data says which (the same on all of them, as collectives must be), so the joined ranks
// issue it too. Checked here as well: a rank with data that differs is named before anything
// pairs with the wrong call.
template <backend B, element P, element G>
void training_state<B, P, G>::announce(joined_call what, std::size_t bucket) {
  if (!announcing_) return;
  const std::int64_t mine[3] = {static_cast<std::int64_t>(what), static_cast<std::int64_t>(bucket), announcement_mark};
  std::int64_t sum[3] = {mine[0], mine[1], mine[2]};
  exchange(sum);
  const std::int64_t n = contributors_;
  if (sum[0] != mine[0] * n || sum[1] != mine[1] * n || sum[2] != mine[2] * n)
    fail("join",
         detail::text(
             "this rank's next call at zero3 is ", describe_call(mine[0], mine[1]), ", but not every rank with data (",
             std::to_string(n), ", this one included) announced it",
             (sum[2] == mine[2] * n ? "" : ": one is in another call of the state's, or in a collective of its own")),
         "every rank with data must gather and step alike (the gathers are collectives): the same layers, in "
         "the same order, with views ended at the same points");
}

// This rank has no more data: it answers every micro-step the others take, with no
// gradients of its own, until the agreement finds no rank with data. Under ddp, zero1 and
// zero2 a micro-step's collectives follow from the agreement alone (every bucket once, in
// order, then step()); at zero3 they follow the trainer's gathers, which the ranks with data
// announce one by one.
template <backend B, element P, element G>
void training_state<B, P, G>::answer_until_all_joined() {
  if (agreed_)
    fail("join", "the loop ended in the middle of a step (the state was called since the last step())",
         "end the join's loop after step(), when this rank has no more batches");
  const std::size_t buckets = layout_.buckets.size();
  auto& engine = group_->backend();
  // Nothing of this rank's is reduced from here: its adopted gradients start at zero (a rank
  // with no batch at all may never have bound any: the state's zeros stand in).
  if (adopted_ && !grads_) {
    grads_ = allocate_zeroed<G>(own_grads_, layout_.elements);
    build_owned_spans();
  }
  if (adopted_) fill(engine, grads_, layout_.elements, dtype_v<G>, 0.0);
  for (;;) {
    std::int64_t sum[3] = {0, 0, 0};
    exchange(sum);
    if (sum[0] == 0 && sum[1] == 0 && sum[2] == 0) break;  // every rank is here: no one has data
    const std::int64_t n = contributors_;
    if (sum[2] != announcement_mark * n || n < 1 || !sharded_parameters()) {
      take_agreement(sum);  // a micro-step begins (or a foreign collective, named)
      agreed_ = true;
      if (!sharded_parameters()) {
        if (sync_micro_step_)
          answer_step();
        else
          reset_marks();  // as a no_sync scope's end
      }
      continue;
    }
    const std::int64_t what = sum[0] / n, b = sum[1] / n;
    const bool whole = sum[0] % n == 0 && sum[1] % n == 0 && b >= 0 && static_cast<std::size_t>(b) < buckets;
    const auto bucket = static_cast<std::size_t>(b);
    if (whole && what == static_cast<std::int64_t>(joined_call::gather)) {
      gather_bucket(bucket);  // this rank's shard for the others; nothing here reads it
      end_gathered(bucket, bucket_gathered_[bucket]);
    } else if (whole && what == static_cast<std::int64_t>(joined_call::reduce) && launched_ < buckets &&
               bucket == buckets - 1 - launched_) {
      launch(buckets - 1 - launched_++);  // zeros
    } else if (whole && what == static_cast<std::int64_t>(joined_call::step)) {
      answer_step();
    } else if (!whole) {
      fail("join",
           detail::text("the ", std::to_string(n), " ranks with data announced different calls (sums ",
                        std::to_string(sum[0]), ", ", std::to_string(sum[1]), ": not ", std::to_string(n),
                        " times one call)"),
           "every rank with data must gather and step alike (the gathers are collectives)");
    } else {
      fail("join",
           detail::text("the ranks with data announced ", describe_call(what, b), " after ", std::to_string(launched_),
                        " of ", std::to_string(buckets), " bucket reductions, which a joined rank cannot answer"),
           "reductions go from the last bucket to the first, each once a step");
    }
  }
  agreed_ = false;
}

template <backend B, element P, element G>
void training_state<B, P, G>::answer_step() {
  const step_result result = step();
  if (trainer_optimizer()) {
    if (!result.skipped) join_->update(result);
    publish_parameters();
  }
  // The step reduced in place into the adopted gradients: zero again for the next.
  if (adopted_) fill(group_->backend(), grads_, layout_.elements, dtype_v<G>, 0.0);
}

template <backend B, element P, element G>
auto training_state<B, P, G>::no_sync() -> no_sync_scope {
  if (launched_ > 0)
    fail("no_sync", detail::text(std::to_string(launched_), " bucket(s) already launched this step"),
         "enter no_sync before the backward pass, not during it");
  return no_sync_scope(*this);
}

template <backend B, element P, element G>
std::size_t training_state<B, P, G>::region_index(std::string_view name) const {
  for (std::size_t r = 0; r < regions_.size(); ++r)
    if (regions_[r].name == name) return r;
  fail("region_index", detail::text("no region is named '", name, "'"), "use a name the regions were given");
}

// Each rank measures its chunks of every bucket (rank 0 the remainders too) and the ranks'
// parts are summed, every element counted once: sharded, those are the gradients it owns;
// under ddp every rank holds the same averaged gradients, and reading 1/N of them each costs
// one scalar all-reduce where measuring all on every rank would read N times as much. With
// replicas every copy of the group holds the same averaged gradients (an inf anywhere made its
// average inf or NaN in every copy): the group's sum is the global one, the same everywhere.
template <backend B, element P, element G>
void training_state<B, P, G>::measure(step_result& result) {
  if (reproducible()) return measure_exactly(result);
  auto& engine = group_->backend();
  // Every bucket has been launched, and added its squares as it was (launch()).
  detail::agree_on_gradient_statistics(
      *group_, stats_.data(), world() > 1,
      [&](std::int64_t* count) {
        for (const auto& pieces : norm_by_bucket_)
          for (const auto& s : pieces) count_nonfinite(engine, reduced_gradient_at(s), s.count, dtype_v<G>, count);
      },
      result);
}

// The update runs in the caller's order and each bucket's parameters are all-gathered on the
// group as soon as its update is queued: on the host the calling thread updates bucket b + 1
// while the group's worker sends bucket b, on a device the caller's stream computes while the
// group's sends. Buckets go in the forward's order (bucket 0 holds the first layers), so a
// deferred publication (defers_publication) is done first where the next forward reads first.
template <backend B, element P, element G>
void training_state<B, P, G>::update_and_publish(double grad_scale) {
  auto& engine = group_->backend();
  hand_to_caller(engine.record());  // the reductions the update reads
  const bool zero_gradients = !adopted_ && flat_gradients();
  for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
    update_bucket(b, grad_scale, zero_gradients);
    if (!publishes_parameters()) continue;
    engine.wait_for_caller(caller_stream_);  // the bucket's update
    publish_bucket(b);
  }
  engine.wait_for_caller(caller_stream_);  // the group's next work after the update's reads and writes
}

template <backend B, element P, element G>
void training_state<B, P, G>::update_bucket(std::size_t b, double grad_scale, bool zero_gradients) {
  auto& engine = group_->backend();
  master_type* first = first_.data() ? first_.template as<master_type>() : nullptr;
  master_type* second = second_.data() ? second_.template as<master_type>() : nullptr;
  for (std::size_t i = update_first_[b]; i < update_first_[b + 1]; ++i) {
    const shard_segment& s = update_segments_[i];
    const region& r = regions_[s.region];
    const master_type* gradient = nullptr;
    if constexpr (std::is_same_v<G, master_type>) {
      gradient = reduced_gradient_at(s);
    } else {
      master_type* widened = scratch_.template as<master_type>() + s.owned;
      cast_in_caller_order(engine, caller_stream_, reduced_gradient_at(s), dtype_v<G>, widened, dtype_v<master_type>,
                           s.count);
      gradient = widened;
    }
    if (options_.sgd) {
      const auto& o = *options_.sgd;
      const detail::sgd_coefficients c{o.lr * r.lr_scale, o.momentum, r.decay ? o.weight_decay : 0.0, grad_scale};
      sgd_step_in_caller_order(engine, caller_stream_, master_at(s), gradient, first ? first + s.owned : nullptr,
                               s.count, c);
    } else {
      detail::adam_coefficients c = detail::adam_coefficients_at(options_.adam, steps_, grad_scale);
      c.lr *= r.lr_scale;
      c.weight_decay = r.decay ? options_.adam.weight_decay : 0.0;
      adam_step_in_caller_order(engine, caller_stream_, master_at(s), gradient, first + s.owned, second + s.owned,
                                s.count, c);
    }
    if (separate_master())
      cast_in_caller_order(engine, caller_stream_, master_at(s), dtype_v<master_type>, parameter_at(s), dtype_v<P>,
                           s.count);
  }
  if (zero_gradients)
    for (const auto& range : layout_.buckets[b].ranges)
      fill_in_caller_order(engine, caller_stream_, grads_ + range.offset, range.count, dtype_v<G>, 0.0);
}

template <backend B, element P, element G>
void training_state<B, P, G>::publish_bucket(std::size_t b) {
  char label[96];
  std::snprintf(label, sizeof label, "step %llu publication of bucket %zu (layer %zu)",
                static_cast<unsigned long long>(steps_), b, layout_.buckets[b].layer);
  const auto labelled = group_->call_context_within(label);
  auto together = group_->grouped();
  work done = all_gather_chunks(b, params_);
  together.end();
  if (defers_publication()) {
    if (!deferred_publications_[b]) ++deferred_count_;
    deferred_publications_[b] = std::move(done);
  }
}

template <backend B, element P, element G>
void training_state<B, P, G>::await_parameters(std::size_t b) {
  if (!deferred_publications_[b]) return;
  hand_to_caller(*deferred_publications_[b]);
  deferred_publications_[b].reset();
  --deferred_count_;
}

template <backend B, element P, element G>
void training_state<B, P, G>::await_all_parameters() {
  for (std::size_t b = 0; deferred_count_ > 0 && b < deferred_publications_.size(); ++b) await_parameters(b);
}

template <backend B, element P, element G>
void training_state<B, P, G>::publish_parameters() {
  if (!trainer_optimizer())
    fail("publish_parameters", "the state's own optimizer publishes its updates in step()",
         "call publish_parameters() only with training_options::trainer_optimizer");
  if (!publish_due_)
    fail("publish_parameters", "no step() to publish: it was called already, or before the first step()",
         "call it once after each step(), after updating owned_spans()");
  publish_due_ = false;
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);  // the trainer's update
  // Owned flat gradients start the next step at zero once the trainer's update has read them.
  const work zeroed = !adopted_ && flat_gradients() ? fill(engine, grads_, layout_.elements, dtype_v<G>, 0.0) : work{};
  if (!skipped_update_ && publishes_parameters())
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b) publish_bucket(b);
  hand_to_caller(deferred_count_ > 0 ? zeroed : engine.record());
  last_step_wire_bytes_ += std::exchange(wire_bytes_, 0);
}

template <backend B, element P, element G>
step_result training_state<B, P, G>::step() {
  snapshot_.wait();  // a checkpoint's copy of the masters and moments in flight
  check_training_call("step");
  check_gradients_bound("step");
  await_all_parameters();  // the last publication: the update writes where it reads
  if (no_sync_depth_ > 0)
    fail("step", "step() inside no_sync: this micro-step's gradients were not reduced",
         "end the no_sync scope before the last micro-step's backward, then step()");
  straggler_report* const report = options_.straggler && options_.straggler->enabled() ? options_.straggler : nullptr;
  timeline* const recorder = options_.timeline && options_.timeline->recording() ? options_.timeline : nullptr;
  const auto entered = report || recorder ? straggler_report::clock::now() : straggler_report::clock::time_point{};
  const std::int64_t cpu_entered = report && report->times_cpu() ? straggler_report::thread_cpu_ns() : 0;
  auto& engine = group_->backend();
  begin_call();
  // The reductions averaged over the world; under a join only `contributors` ranks gave
  // gradients, and the average is theirs unless the initial world is the divisor.
  const int contributors = join_ ? contributors_ : group_->world_size();
  const double divisor_fix = join_ && !join_->divide_by_initial_world
                                 ? static_cast<double>(group_->world_size()) / std::max(contributors, 1)
                                 : 1.0;
  last_contributors_ = contributors;
  drop_gathered();
  last_overlapped_ = launched_;
  warn_if_overlap_lost();
  for (auto& count : pending_) count = 0;  // unmarked regions contribute what they hold
  std::fill(due_.begin(), due_.end(), std::uint8_t{1});
  launch_ready();
  announce(joined_call::step, 0);
  step_result result;
  result.loss_scale = options_.scaler ? options_.scaler->scale() : 1.0;
  measure(result);  // waits for every bucket's reduction
  const auto reduced = recorder ? timeline::clock::now() : timeline::clock::time_point{};
  // A stopped timeline takes none: what was noted before it stopped goes.
  if (recorder)
    record_engine_spans();
  else
    engine_spans_.clear();
  result.grad_norm *= divisor_fix;
  result.skipped = result.nonfinite > 0;
  if (options_.scaler) options_.scaler->update(result.skipped);
  result.gradient_scale = 0;
  if (!result.skipped) {
    result.clip_factor = detail::clip_factor(result.grad_norm, options_.max_grad_norm);
    result.gradient_scale = result.clip_factor * divisor_fix / result.loss_scale;
    ++steps_;
    if (!trainer_optimizer()) update_and_publish(result.gradient_scale);
  }
  // Owned flat gradients start the next step at zero: update_and_publish zeroes each bucket's
  // once updated, publish_parameters once the trainer's optimizer has read them, and a skipped
  // step's are dropped here. Adopted ones are the trainer's to zero.
  if (result.skipped && !adopted_ && flat_gradients() && !trainer_optimizer())
    fill(engine, grads_, layout_.elements, dtype_v<G>, 0.0);
  // A deferred publication is waited for where its parameters are read; all else is done.
  if (deferred_count_ == 0) hand_to_caller(engine.record());
  reset_marks();
  folded_ = 0;
  micro_steps_agreed_ = false;
  publish_due_ = trainer_optimizer();
  skipped_update_ = result.skipped;
  last_step_wire_bytes_ = std::exchange(wire_bytes_, 0);
  last_step_copied_bytes_ = std::exchange(copied_bytes_, 0);
  if (report || recorder) {
    const auto now = straggler_report::clock::now();
    if (report) {
      report->add_wait(wait_kind::reduce, now - entered);
      if (report->times_cpu()) report->add_wait_cpu(straggler_report::thread_cpu_ns() - cpu_entered);
      report->end_step(now);
    }
    if (recorder) {
      recorder->add_span("step: reductions", timeline_category::communication, entered, reduced);
      recorder->add_span("step: update", timeline_category::optimizer, reduced, now);
      recorder->end_step(now);
    }
  }
  // A stopped timeline still counts the steps, so that a later start() numbers them alike.
  if (options_.timeline && !recorder) options_.timeline->end_step();
  return result;
}

template <backend B, element P, element G>
void training_state<B, P, G>::note_engine_span(std::size_t b, engine_work what, std::uint64_t first_call) {
  if (first_call == 0) return;
  const std::uint64_t last_call = engine_calls(what).last_id();
  if (last_call < first_call) return;  // nothing issued (a flight recorder of no entries)
  engine_spans_.push_back({b, what, options_.timeline->step(), first_call, last_call, {}});
}

template <backend B, element P, element G>
void training_state<B, P, G>::record_engine_spans() {
  timeline& recorder = *options_.timeline;
  std::size_t still_pending = 0;
  for (const auto& noted : engine_spans_) {
    const auto timed = engine_calls(noted.what).span_of(noted.first_call, noted.last_call);
    using outcome = flight_recorder::calls_span::state;
    // A device's completion the flight recorder has not seen yet: tried again at the next
    // steps (one step later at most on the host, where the reductions were waited for).
    if (timed.outcome == outcome::pending && noted.step + 2 >= recorder.step()) {
      engine_spans_[still_pending++] = noted;
      continue;
    }
    if (timed.outcome != outcome::complete || noted.step + 2 < recorder.step()) continue;
    const auto& bucket = layout_.buckets[noted.bucket];
    char track_name[64], name[64];
    std::snprintf(track_name, sizeof track_name, "bucket %zu (layer %zu)", noted.bucket, bucket.layer);
    const char* what = noted.what == engine_work::gather            ? "gather"
                       : noted.what == engine_work::gathered        ? "gathered"
                       : noted.what == engine_work::across_replicas ? "across replicas"
                       : reproducible()                             ? "canonical sum"
                       : options_.strategy == strategy::ddp         ? "all-reduce"
                                                                    : "reduce-scatter";
    std::snprintf(name, sizeof name, "%s bucket %zu", what, noted.bucket);
    const auto track = static_cast<std::uint32_t>(1 + noted.bucket);
    if (noted.what == engine_work::gathered)
      recorder.add_track_span(track, track_name, name, timeline_category::engine, noted.step, timed.completed,
                              noted.released);
    else
      recorder.add_track_span(track, track_name, name, timeline_category::engine, noted.step, timed.issued,
                              timed.completed);
  }
  engine_spans_.resize(still_pending);
}

// Nothing of the backward overlapped its reductions though it could have: said once (rank 0),
// with the likely cause, instead of a step that is silently slower.
template <backend B, element P, element G>
void training_state<B, P, G>::warn_if_overlap_lost() {
  if (warned_overlap_ || launched_ > 0 || layout_.buckets.size() < 2 || world() < 2 || rank() != 0 || join_) return;
  warned_overlap_ = true;
  std::fprintf(stderr,
               "[cohort rank 0] training_state: 0 of %zu buckets were reduced during the backward (%s): the step "
               "waited for all of them. %s\n",
               layout_.buckets.size(), std::string(to_string(options_.strategy)).c_str(),
               sharded_parameters()
                   ? "At zero3 a layer's buckets are reduced once the backward's gathers have moved below it: "
                     "gather each layer again in the backward (a view kept from the forward is never the "
                     "backward's), and keep forward-only passes inside state.evaluation()"
                   : "Mark each region ready (mark_ready, mark_layer_ready) as soon as its gradient is final, "
                     "during the backward, not all at its end");
}

// --- reproducible training (training_options::reproducible) ------------------------------------

// Level l of the binary counter over this step's micro-steps: a whole gradient in the packed
// numbering, allocated at its first use (m = 2^j micro-steps need j levels).
template <backend B, element P, element G>
G* training_state<B, P, G>::fold_level(std::size_t level) {
  while (fold_levels_.size() <= level)
    fold_levels_.emplace_back(group_->backend(), std::max<std::size_t>(layout_.elements, 1) * sizeof(G));
  return fold_levels_[level].template as<G>();
}

// A no_sync scope's micro-step, the t-th of the step (t micro-steps folded before it), joins
// the canonical tree as canonical_sum's counter adds a value: carry = level[l] + carry for every
// level l the low set bits of t name, then carry becomes the next level's node; the gradients
// start the next micro-step at zero. In the backend's order, after the trainer's backward.
template <backend B, element P, element G>
void training_state<B, P, G>::fold_micro_step() {
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);
  std::size_t level = 0;
  while ((folded_ >> level) & 1) ++level;
  G* const carried_into = fold_level(level);
  const std::size_t buckets = layout_.buckets.size();
  for (std::size_t b = 0; b < buckets; ++b) {
    G* const pooled_gradients = flat_gradients() ? nullptr : bucket_gradients(b, false);
    for (const auto& range : layout_.buckets[b].ranges) {
      G* const carry = gradient_source(range, pooled_gradients);
      const std::size_t at = packed_start_[b] + range.packed;
      for (std::size_t l = 0; l < level; ++l)
        accumulate(engine, fold_level(l) + at, dtype_v<G>, carry, dtype_v<G>, range.count, true);
      accumulate(engine, carry, dtype_v<G>, carried_into + at, dtype_v<G>, range.count, false);
      fill(engine, carry, range.count, dtype_v<G>, 0.0);
    }
  }
  ++folded_;
  hand_to_caller(engine.record());  // the next backward writes into the zeroed gradients
}

// At the step's first reduction every rank says how many micro-steps it ran: a rank with
// another count (one more micro-batch, one fewer) would change the tree, so every rank refuses,
// naming each that differs. A rank still accumulating joins this exchange at its own last
// micro-step, and fails alike. With replicas the groups' counts then meet over the replicas
// (the world's, in replica order): a copy that refused alone would leave the others waiting in
// the exchange over the copies until the timeout.
template <backend B, element P, element G>
void training_state<B, P, G>::agree_on_micro_steps() {
  micro_steps_agreed_ = true;
  const auto mine = static_cast<std::int64_t>(folded_ + 1);
  constexpr std::string_view agreement = "reproducible micro-step agreement";
  std::vector<std::int64_t> counts;
  {
    const auto labelled = group_->call_context_within(agreement);
    counts = all_gather_values(*group_, std::span<const std::int64_t>(&mine, 1));
  }
  if (replicated()) {
    const auto labelled = replicas_->call_context_within(agreement);
    counts = all_gather_values(*replicas_, std::span<const std::int64_t>(counts));
  }
  const std::string refusal =
      detail::micro_step_disagreement(counts, micro_steps_per_rank(), options_.reproducible->micro_batches);
  if (!refusal.empty())
    fail("step", refusal,
         "run the first M / world - 1 micro-steps each inside its own no_sync() scope, the last outside it, then "
         "step(), on every rank");
}

template <backend B, element P, element G>
void training_state<B, P, G>::sum_parts(G* staged, std::size_t parts, std::size_t count, bool divide_by_batches,
                                        G* to) {
  // One fused pass (a task on the worker, a kernel on a device): the tree's n - 1 additions,
  // the divide and the copy as separate passes read and wrote the bucket n + 1 times.
  const int divisor = divide_by_batches ? static_cast<int>(options_.reproducible->micro_batches) : 0;
  canonical_sum_parts(group_->backend(), staged, parts, count, dtype_v<G>, divisor, to);
}

// Bucket b in the canonical tree: this rank's partial (its source, with every level of the
// counter, lowest first: canonical_sum's final loop); each range's chunk k of every rank's
// partial brought to rank k (an all-to-all: a ring reduce-scatter's bytes) and its remainder to
// every rank (an all-gather), summed in rank order by the tree over the ranks, divided by M once
// (with replicas after the sum over the copies, in replica order). ddp then all-gathers the
// chunks, as zero1 publishes. Each exchange is one grouped launch, the sums after it.
template <backend B, element P, element G>
void training_state<B, P, G>::reduce_canonically(std::size_t b, G* pooled_gradients, G* shard,
                                                 std::uint64_t first_call) {
  if (!micro_steps_agreed_) agree_on_micro_steps();
  auto& engine = group_->backend();
  const auto& bucket = layout_.buckets[b];
  const std::size_t n = world(), k = my_rank();
  for (const auto& range : bucket.ranges)
    for (std::size_t l = 0; l < fold_levels_.size(); ++l)
      if ((folded_ >> l) & 1)
        accumulate(engine, fold_levels_[l].template as<G>() + packed_start_[b] + range.packed, dtype_v<G>,
                   gradient_source(range, pooled_gradients), dtype_v<G>, range.count, true);
  // Between two ranks the tree over the ranks is one addition, which commutes: the host
  // transport's reduce-scatter (its sum in either order, then its divide) gives the canonical
  // sum's bits, summing where the parts arrive rather than from a staged copy of them. Not
  // for 16-bit floats (the transport rounds once where the tree rounds the sum, then the
  // quotient), nor on a device (ncclAvg may scale each part before the sum).
  const bool in_transport = n == 2 && !replicated() && B::space == memory_space::host &&
                            (std::is_same_v<G, float> || std::is_same_v<G, double>);
  const auto batches = static_cast<int>(options_.reproducible->micro_batches);
  std::size_t staged_elements = 0, kept_elements = 0;
  for (const auto& range : bucket.ranges) {
    staged_elements += n * ((in_transport ? 0 : range.chunk) + range.remainder);
    kept_elements += range.chunk + range.remainder;
  }
  const std::size_t copies = static_cast<std::size_t>(replica_count());
  const std::size_t bytes = std::max<std::size_t>(std::max(staged_elements, copies * kept_elements), 1) * sizeof(G);
  const std::size_t before = staging_pool_.allocations();
  auto staging = staging_pool_.take(bytes);
  if (staging_pool_.allocations() != before) staging_pool_bytes_ += bytes;
  G* const staged = static_cast<G*>(staging.data);
  {
    char label[96];
    std::snprintf(label, sizeof label, "step %llu reproducible exchange of bucket %zu (layer %zu)",
                  static_cast<unsigned long long>(steps_) + 1, b, bucket.layer);
    const auto labelled = group_->call_context_within(label);
    auto together = group_->grouped();
    std::size_t at = 0;
    for (const auto& range : bucket.ranges) {
      G* source = gradient_source(range, pooled_gradients);
      if (range.chunk > 0 && in_transport) {
        G* chunk = flat_gradients() ? source + k * range.chunk : shard + range.owned;
        group_->reduce_scatter(std::span<const G>(source, n * range.chunk), std::span<G>(chunk, range.chunk),
                               batches == 2 ? op::avg : op::sum);
        count_wire(n * range.chunk * sizeof(G), false);
      } else if (range.chunk > 0) {
        if (n == 1)
          engine.copy(staged + at, source, range.chunk * sizeof(G));
        else
          group_->all_to_all(std::span<const G>(source, n * range.chunk), std::span<G>(staged + at, n * range.chunk));
        count_wire(n * range.chunk * sizeof(G), false);
      }
      if (!in_transport) at += n * range.chunk;
      if (range.remainder > 0) {
        group_->all_gather(std::span<const G>(source + n * range.chunk, range.remainder),
                           std::span<G>(staged + at, n * range.remainder));
        count_wire(n * range.remainder * sizeof(G), false);
      }
      at += n * range.remainder;
    }
    together.end();
  }
  const bool divide_here = !replicated();
  std::size_t at = 0;
  for (const auto& range : bucket.ranges) {
    G* source = gradient_source(range, pooled_gradients);
    if (range.chunk > 0) {
      G* chunk = flat_gradients() ? source + k * range.chunk : shard + range.owned;
      if (!in_transport)
        sum_parts(staged + at, n, range.chunk, divide_here, chunk);
      else if (batches != 2)
        divide(engine, chunk, range.chunk, dtype_v<G>, batches);
      kept_.emplace_back(chunk, range.chunk);
    }
    if (!in_transport) at += n * range.chunk;
    if (range.remainder > 0) {
      G* rest = flat_gradients() ? source + n * range.chunk : shard + range.owned + range.chunk;
      sum_parts(staged + at, n, range.remainder, divide_here, rest);
      kept_.emplace_back(rest, range.remainder);
    }
    at += n * range.remainder;
  }
  note_engine_span(b, engine_work::reduction, first_call);
  if (replicated()) {
    // Each copy's part is the node of its group's positions: the copies' nodes, gathered in
    // replica order, continue the tree. The replicas' queue waits for the group's sums, and
    // the group's later work for the gathered nodes (on a host backend both block the caller).
    work summed = engine.record();
    summed.make_stream_wait(replicas_->backend().stream());
    work gathered;
    const std::uint64_t first_across = engine_calls_begin(engine_work::across_replicas);
    {
      auto together = replicas_->grouped();
      std::size_t offset = 0;
      for (const auto& [data, count] : kept_) {
        gathered =
            replicas_->all_gather(std::span<const G>(data, count), std::span<G>(staged + offset, copies * count));
        offset += copies * count;
        wire_bytes_ += (copies - 1) * count * sizeof(G);
      }
      together.end();
    }
    note_engine_span(b, engine_work::across_replicas, first_across);
    gathered.make_stream_wait(engine.stream());
    std::size_t offset = 0;
    for (const auto& [data, count] : kept_) {
      sum_parts(staged + offset, copies, count, true, data);
      offset += copies * count;
    }
  }
  // This rank's part of the norm's exact squares, as the bucket is final (as launch() adds squares).
  for (const auto& s : norm_by_bucket_[b])
    add_exact_squares(engine, reduced_gradient_at(s), s.count, dtype_v<G>, exact_norm_.template as<std::int64_t>());
  if (options_.strategy == strategy::ddp && n > 1) {
    auto together = group_->grouped();
    all_gather_chunks(b, grads_);
    together.end();
  }
  staging.last_use = engine.record();
  staging_pool_.put(std::move(staging));
}

// The norm from exact integers, the same bits whatever cut the ranks' shares: each bucket's
// squares were binned by exponent as it was reduced (exact_squares.hpp), the ranks' bins summed
// by one all-reduce op::sum (integers: order-free) and turned into the norm once, the same way
// on every rank. The infs and NaNs have a bin of their own: their count, as the default path's.
template <backend B, element P, element G>
void training_state<B, P, G>::measure_exactly(step_result& result) {
  auto& engine = group_->backend();
  const std::size_t words = detail::exact_squares_words(dtype_v<G>);
  auto* bins = exact_norm_.template as<std::int64_t>();
  if (world() > 1) group_->all_reduce(std::span<std::int64_t>(bins, words), op::sum);
  engine.copy(exact_norm_total_.data(), bins, words * sizeof(std::int64_t)).wait();
  const auto exact = detail::exact_norm(exact_norm_total_, dtype_v<G>);
  result.nonfinite = exact.nonfinite;
  result.grad_norm = exact.norm / result.loss_scale;  // NaN stays NaN
}

// --- checkpoints -----------------------------------------------------------------------------

template <backend B, element P, element G>
auto training_state<B, P, G>::checkpoint_data(std::size_t t, const shard_segment& s) -> master_type* {
  snapshot_.wait();  // a load writes through it
  await_all_parameters();
  switch (t) {
    case 0:
      if (!separate_master() && !std::is_same_v<P, master_type>)
        fail("checkpoint",
             "the parameters are narrower than the masters, and the trainer's optimizer keeps the masters",
             "with trainer_optimizer and narrow parameters, checkpoint the trainer's masters yourself");
      return master_at(s);
    case 1:
      if (first_.data()) return first_.template as<master_type>() + s.owned;
      break;
    case 2:
      if (second_.data()) return second_.template as<master_type>() + s.owned;
      break;
    default: break;
  }
  fail("checkpoint",
       detail::text("checkpoint tensor ", std::to_string(t), " of ", std::to_string(checkpoint_tensors().size())),
       "the tensors are those checkpoint_tensors() names");
}

template <backend B, element P, element G>
void training_state<B, P, G>::finish_checkpoint_load(std::uint64_t optimizer_steps) {
  snapshot_.wait();
  check_published("finish_checkpoint_load");
  await_all_parameters();
  auto& engine = group_->backend();
  engine.wait_for_caller(caller_stream_);
  drop_gathered();
  if (separate_master())
    for (const auto& s : checkpoint_segments(rank()))
      cast(engine, master_at(s), dtype_v<master_type>, parameter_at(s), dtype_v<P>, s.count);
  // What each rank read is its chunks (rank 0: the remainders too): every copy made whole
  // (zero3 over an adopted buffer: then what it does not hold poisoned again).
  spread(params_, flat_parameters(), true);
  if (sharded_parameters() && flat_parameters())
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b) poison_unheld(b);
  const bool flat_state = !sharded();
  if (separate_master()) spread(master_.template as<master_type>(), flat_state, true);
  if (first_.data()) spread(first_.template as<master_type>(), flat_state, true);
  if (second_.data()) spread(second_.template as<master_type>(), flat_state, true);
  steps_ = optimizer_steps;
  hand_to_caller(engine.record());
  engine.record().wait();
}

// A template member, not a generic lambda with a template head: nvcc's host pass (g++ 12)
// refuses those inside a member of a class template.
template <backend B, element P, element G>
template <class T>
void training_state<B, P, G>::spread(T* base, bool flat, bool remainders) {
  const std::size_t n = world();
  if (n == 1) return;
  auto together = group_->grouped();
  for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
    if (flat) all_gather_chunks(b, base);
    if (remainders)
      for (const auto& range : layout_.buckets[b].ranges)
        if (range.remainder > 0)
          group_->broadcast(
              std::span<T>(base + (flat ? range.offset + n * range.chunk : range.owned + range.chunk), range.remainder),
              0);
  }
  together.end();
}

template <backend B, element P, element G>
template <class T>
auto training_state<B, P, G>::all_gather_chunks(std::size_t b, T* base) -> work {
  const std::size_t n = world(), k = my_rank();
  work done;
  for (const auto& range : layout_.buckets[b].ranges)
    if (range.chunk > 0) {
      T* whole = base + range.offset;
      done = group_->all_gather(std::span<const T>(whole + k * range.chunk, range.chunk),
                                std::span<T>(whole, n * range.chunk));
      count_wire(n * range.chunk * sizeof(T), false);
    }
  return done;
}

template <backend B, element P, element G>
training_memory training_state<B, P, G>::memory() const noexcept {
  training_memory m;
  m.parameters = own_params_.bytes() + parameter_pool_bytes_;
  m.gradients = own_grads_.bytes() + grad_shard_.bytes() + gradient_pool_bytes_;
  m.optimizer_state = master_.bytes() + first_.bytes() + second_.bytes() + scratch_.bytes();
  if (adopted_parameters_) m.adopted_parameters = layout_.elements * sizeof(P);
  if (adopted_ && grads_ && own_grads_.bytes() == 0) m.adopted_gradients = layout_.elements * sizeof(G);
  for (const auto& level : fold_levels_) m.reproducible += level.bytes();
  m.reproducible += staging_pool_bytes_ + exact_norm_.bytes();
  return m;
}

}  // namespace cohort::inline v0
