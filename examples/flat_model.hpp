#pragma once
// The examples' MLP (mlp.hpp) with its parameters in one flat buffer laid out the way llm.c
// lays out GPT-2's: tensor-major, the hidden layers' tensors stacked ([W_1 .. W_L] then
// [b_1 .. b_L]), so one tensor of every layer is contiguous and a layer's parameters are not.
// The gradients sit in a second flat buffer of the same layout. The backward finishes them
// layer by layer, last layer first, as a transformer's does.
#include <cstddef>
#include <span>
#include <vector>

#include <cohort/reducer.hpp>

#include "mlp.hpp"

namespace cohort_examples {

struct flat_layout {
  // One region per mlp tensor (W0, b0, W1, b1, ...), into the flat buffer.
  std::vector<cohort::gradient_region> regions;
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

}  // namespace cohort_examples
