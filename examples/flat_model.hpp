#pragma once
// The examples' MLP (mlp.hpp) with its parameters in one flat buffer laid out the way llm.c
// lays out GPT-2's: tensor-major, the hidden layers' tensors stacked ([W_1 .. W_L] then
// [b_1 .. b_L]), so one tensor of every layer is contiguous and a layer's parameters are not.
// The gradients sit in a second flat buffer of the same layout. The backward finishes them
// layer by layer, last layer first, as a transformer's does.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <cohort/parallel/optimizer_options.hpp>

#include "mlp.hpp"

namespace cohort_examples {

struct flat_layout {
  // Elements [offset, offset + count) of the flat buffer.
  struct tensor_range {
    std::size_t offset = 0;
    std::size_t count = 0;
  };
  // One region per mlp tensor (W0, b0, W1, b1, ...), into the flat buffer.
  std::vector<tensor_range> regions;
  std::size_t elements = 0;
  // Weight decay for matrices only, as trainers do.
  std::vector<std::uint8_t> decay;

  // widths: input, hidden x L (equal), output.
  static flat_layout of(const mlp& model) {
    const auto sizes = model.parameter_sizes();
    const std::size_t tensors = sizes.size(), layers = tensors / 2;
    flat_layout layout;
    layout.regions.resize(tensors);
    std::size_t at = 0;
    const auto place = [&](std::size_t t) {
      layout.regions[t] = {at, sizes[t]};
      at += sizes[t];
    };
    // [W0 | W1 .. W_{L-2} | b0 | b1 .. b_{L-2} | W_{L-1} | b_{L-1}]: input and output layers
    // apart, the hidden ones stacked per tensor.
    place(0);
    for (std::size_t l = 1; l + 1 < layers; ++l) place(2 * l);
    place(1);
    for (std::size_t l = 1; l + 1 < layers; ++l) place(2 * l + 1);
    place(2 * (layers - 1));
    place(2 * (layers - 1) + 1);
    layout.elements = at;
    for (std::size_t t = 0; t < tensors; ++t) layout.decay.push_back(t % 2 == 0 ? 1 : 0);
    return layout;
  }

  // The mlp's per-tensor spans into a flat buffer of this layout.
  std::vector<std::span<float>> tensors(std::vector<float>& flat) const {
    std::vector<std::span<float>> spans;
    for (const auto& region : regions) spans.push_back(std::span<float>(flat).subspan(region.offset, region.count));
    return spans;
  }
};

// Rows [first, first + count) of a row-major table `width` wide: one shard of a batch.
inline std::span<const float> rows(const std::vector<float>& values, std::size_t first, std::size_t count,
                                   std::size_t width) {
  return std::span<const float>(values).subspan(first * width, count * width);
}

// The rows `indices` (a sampler's) of a row-major table `width` wide, in that order.
inline std::vector<float> rows_at(const std::vector<float>& values, std::span<const std::uint64_t> indices,
                                  std::size_t width) {
  std::vector<float> out;
  out.reserve(indices.size() * width);
  for (const std::uint64_t index : indices) {
    const auto row = rows(values, static_cast<std::size_t>(index), 1, width);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

// The examples' reference optimizer, written out in double on the host: AdamW with clipping
// by the global norm (max / (norm + 1e-6), as PyTorch) and weight decay where the layout
// says. The parameters keep a double master; the float copy is what the model reads.
class adamw_reference {
 public:
  adamw_reference(const flat_layout& layout, const std::vector<float>& initial, cohort::adam_options adam,
                  double max_grad_norm)
      : adam_(adam),
        max_grad_norm_(max_grad_norm),
        master_(initial.begin(), initial.end()),
        first_(initial.size()),
        second_(initial.size()),
        decays_(initial.size(), false) {
    for (std::size_t t = 0; t < layout.regions.size(); ++t)
      for (std::size_t e = 0; e < layout.regions[t].count; ++e)
        decays_[layout.regions[t].offset + e] = layout.decay[t] != 0;
  }

  void step(const std::vector<float>& gradients, std::vector<float>& parameters) {
    double squares = 0;
    for (float g : gradients) squares += static_cast<double>(g) * g;
    const double norm = std::sqrt(squares);
    const double clip = norm > max_grad_norm_ ? max_grad_norm_ / (norm + 1e-6) : 1.0;
    const double t = static_cast<double>(++steps_);
    const auto& o = adam_;
    for (std::size_t e = 0; e < parameters.size(); ++e) {
      const double g = gradients[e] * clip;
      first_[e] = o.beta1 * first_[e] + (1 - o.beta1) * g;
      second_[e] = o.beta2 * second_[e] + (1 - o.beta2) * g * g;
      const double mh = first_[e] / (1 - std::pow(o.beta1, t)), vh = second_[e] / (1 - std::pow(o.beta2, t));
      master_[e] -= o.lr * (mh / (std::sqrt(vh) + o.eps) + (decays_[e] ? o.weight_decay : 0.0) * master_[e]);
      parameters[e] = static_cast<float>(master_[e]);
    }
  }

 private:
  cohort::adam_options adam_;
  double max_grad_norm_;
  std::vector<double> master_, first_, second_;
  std::vector<bool> decays_;
  std::uint64_t steps_ = 0;
};

}  // namespace cohort_examples
