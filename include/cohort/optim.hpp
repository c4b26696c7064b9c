#pragma once
// Optimizers on sharded parameters: each rank updates only its shard of every unit, from
// its shard of the averaged gradient, so optimizer state is sharded too (ZeRO stages 1-3).
//
//   cohort::sharded_parameters<cohort::gloo, float> params{pg, units};
//   cohort::adam opt{params, {.lr = 1e-3}};
//   ... params.reduce_scatter_grad(u, full_grad) for every unit ...
//   opt.step();   // queued after the reductions, in the backend's own order
//
// The update is element-wise work in the backend's order (cohort/ops.hpp: a task on Gloo's
// worker, a kernel on NCCL's stream, whose translation unit nvcc compiles), from one
// per-element formula for both (detail::sgd_update, adam_update).

#include <cstdint>
#include <string>
#include <vector>

#include "cohort/detail/scalar_math.hpp"
#include "cohort/ops.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/sharded.hpp"

namespace cohort::inline v0 {

namespace detail {

// State shards (state_count per unit) in the backend's memory, zeroed, each owned by a
// backend_buffer; the sharded parameters' optimizer bytes account for them while they live.
template <backend B, class T>
class sharded_state {
 public:
  sharded_state(sharded_parameters<B, T>& params, std::size_t count) : params_(&params), count_(count) {
    auto& engine = params.group().backend();
    for (std::size_t u = 0; u < params.unit_count(); ++u)
      for (std::size_t k = 0; k < count; ++k) {
        auto& tensor = tensors_.emplace_back(engine, std::max<std::size_t>(params.shard_elements(u), 1) * sizeof(T));
        fill(engine, tensor.data(), params.shard_elements(u), dtype_v<T>, 0.0);
        params.account_optimizer(static_cast<std::ptrdiff_t>(tensor.bytes()));
      }
    engine.record().wait();
  }
  sharded_state(const sharded_state&) = delete;
  sharded_state& operator=(const sharded_state&) = delete;
  ~sharded_state() {
    try {
      params_->group().backend().record().wait();  // no queued update may still use them
    } catch (...) {
      // A failed group: the buffers are freed regardless.
    }
    for (const auto& tensor : tensors_) params_->account_optimizer(-static_cast<std::ptrdiff_t>(tensor.bytes()));
  }
  T* get(std::size_t unit, std::size_t index) const { return tensors_[unit * count_ + index].template as<T>(); }
  std::size_t count() const noexcept { return count_; }

 private:
  sharded_parameters<B, T>* params_;
  std::size_t count_;
  std::vector<backend_buffer<B>> tensors_;
};

}  // namespace detail

template <backend B, class T = float>
class sgd final : public sharded_optimizer_state<T> {
 public:
  sgd(sharded_parameters<B, T>& params, sgd_options opts = {})
      : params_(&params), options_(opts), state_(params, opts.momentum != 0 ? 1 : 0) {}

  // Updates every unit's shard with its gradient shard times grad_scale (unscaling a loss
  // scale, clipping: see clip_grad_norm); returns when-done work.
  typename B::work step(double grad_scale = 1.0);

  void set_lr(double lr) noexcept { options_.lr = lr; }
  const sgd_options& options() const noexcept { return options_; }

  std::string kind() const override { return "sgd"; }
  std::size_t state_count() const override { return state_.count(); }
  T* state(std::size_t unit, std::size_t index) override { return state_.get(unit, index); }
  std::uint64_t steps() const override { return steps_; }
  void set_steps(std::uint64_t steps) override { steps_ = steps; }

 private:
  sharded_parameters<B, T>* params_;
  sgd_options options_;
  detail::sharded_state<B, T> state_;
  std::uint64_t steps_ = 0;
};

template <backend B, class T>
auto sgd<B, T>::step(double grad_scale) -> typename B::work {
  ++steps_;
  auto& engine = params_->group().backend();
  const detail::sgd_coefficients c{options_.lr, options_.momentum, options_.weight_decay, grad_scale};
  for (std::size_t u = 0; u < params_->unit_count(); ++u) {
    T* parameters = params_->shard(u).data();
    const T* gradients = params_->grad_shard(u).data();
    T* momentum = state_.count() ? state_.get(u, 0) : nullptr;
    sgd_step(engine, parameters, gradients, momentum, params_->shard_elements(u), c);
  }
  return engine.record();
}

template <backend B, class T = float>
class adam final : public sharded_optimizer_state<T> {
 public:
  // decay_units: per unit, whether weight decay applies (trainers decay matrices, not biases
  // or norms); empty: every unit.
  adam(sharded_parameters<B, T>& params, adam_options opts = {}, std::vector<std::uint8_t> decay_units = {});

  // grad_scale multiplies every gradient first (loss-scale unscaling, clipping).
  typename B::work step(double grad_scale = 1.0);

  void set_lr(double lr) noexcept { options_.lr = lr; }
  const adam_options& options() const noexcept { return options_; }

  std::string kind() const override { return "adam"; }
  std::size_t state_count() const override { return 2; }
  T* state(std::size_t unit, std::size_t index) override { return state_.get(unit, index); }
  std::uint64_t steps() const override { return steps_; }
  void set_steps(std::uint64_t steps) override { steps_ = steps; }

 private:
  sharded_parameters<B, T>* params_;
  adam_options options_;
  detail::sharded_state<B, T> state_;
  std::vector<std::uint8_t> decay_units_;
  std::uint64_t steps_ = 0;
};

template <backend B, class T>
adam<B, T>::adam(sharded_parameters<B, T>& params, adam_options opts, std::vector<std::uint8_t> decay_units)
    : params_(&params), options_(opts), state_(params, 2), decay_units_(std::move(decay_units)) {
  if (!decay_units_.empty() && decay_units_.size() != params.unit_count())
    throw error(
        params.rank(), "adam",
        std::to_string(decay_units_.size()) + " decay flags for " + std::to_string(params.unit_count()) + " units",
        "one flag per unit, or none");
}

template <backend B, class T>
auto adam<B, T>::step(double grad_scale) -> typename B::work {
  ++steps_;
  auto& engine = params_->group().backend();
  const detail::adam_coefficients c = detail::adam_coefficients_at(options_, steps_, grad_scale);
  for (std::size_t u = 0; u < params_->unit_count(); ++u) {
    T* parameters = params_->shard(u).data();
    const T* gradients = params_->grad_shard(u).data();
    T* first = state_.get(u, 0);
    T* second = state_.get(u, 1);
    auto unit = c;
    if (!decay_units_.empty() && decay_units_[u] == 0) unit.weight_decay = 0;
    adam_step(engine, parameters, gradients, first, second, params_->shard_elements(u), unit);
  }
  return engine.record();
}

template <backend B, class T>
sgd(sharded_parameters<B, T>&, sgd_options) -> sgd<B, T>;
template <backend B, class T>
sgd(sharded_parameters<B, T>&) -> sgd<B, T>;
template <backend B, class T>
adam(sharded_parameters<B, T>&, adam_options) -> adam<B, T>;
template <backend B, class T>
adam(sharded_parameters<B, T>&, adam_options, std::vector<std::uint8_t>) -> adam<B, T>;
template <backend B, class T>
adam(sharded_parameters<B, T>&) -> adam<B, T>;

}  // namespace cohort::inline v0
