#pragma once
// A dynamic loss scaler for fp16 training (as torch.cuda.amp.GradScaler): the trainer
// multiplies its loss by scale() before the backward; the optimizer unscales the gradients,
// and when any rank's gradients hold an inf or a NaN the step is skipped on every rank and
// the scale backs off; after `growth_interval` good steps in a row it grows.
//
// The skip decision must be the same on every rank, or the replicas diverge: update() takes
// a flag that cohort computes across ranks (training_state's step() does), never a rank's
// own view.

#include <cstdint>
#include <string>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

struct loss_scaler_options {
  double initial_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::uint32_t growth_interval = 2000;  // good steps in a row before the scale grows
  double min_scale = 1.0;
};

class loss_scaler {
 public:
  explicit loss_scaler(loss_scaler_options options = {}) : options_(options), scale_(options.initial_scale) {
    if (!(options.initial_scale > 0) || !(options.growth_factor >= 1) || !(options.backoff_factor > 0) ||
        !(options.backoff_factor < 1) || options.growth_interval == 0)
      throw error(
          -1, "loss_scaler",
          detail::text("initial scale ", std::to_string(options.initial_scale), ", growth ",
                       std::to_string(options.growth_factor), ", backoff ", std::to_string(options.backoff_factor),
                       ", interval ", std::to_string(options.growth_interval)),
          "need initial > 0, growth >= 1, 0 < backoff < 1 and an interval of at least one step");
  }

  double scale() const noexcept { return scale_; }
  // The factor that undoes the scale on the gradients.
  double inverse() const noexcept { return 1.0 / scale_; }

  // After a step: `found_nonfinite` as agreed by every rank. Returns true when the step
  // must be skipped (it was), so a caller can write `if (scaler.update(found)) continue;`.
  bool update(bool found_nonfinite) noexcept {
    if (found_nonfinite) {
      scale_ =
          scale_ * options_.backoff_factor < options_.min_scale ? options_.min_scale : scale_ * options_.backoff_factor;
      good_steps_ = 0;
      ++skipped_;
      return true;
    }
    if (++good_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      good_steps_ = 0;
    }
    return false;
  }

  std::uint64_t skipped_steps() const noexcept { return skipped_; }

  // What a checkpoint keeps of the scaler: restored, it continues as if it had never stopped.
  struct saved_state {
    double scale = 0;
    std::uint32_t good_steps = 0;
    std::uint64_t skipped_steps = 0;
  };
  saved_state save() const noexcept { return {scale_, good_steps_, skipped_}; }
  void restore(const saved_state& saved) noexcept {
    scale_ = saved.scale;
    good_steps_ = saved.good_steps;
    skipped_ = saved.skipped_steps;
  }
  const loss_scaler_options& options() const noexcept { return options_; }

 private:
  loss_scaler_options options_;
  double scale_;
  std::uint32_t good_steps_ = 0;
  std::uint64_t skipped_ = 0;
};

}  // namespace cohort::inline v0
