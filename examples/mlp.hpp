#pragma once
// A small multi-layer perceptron with a hand-written backward pass, shared by the examples,
// the tests and the benchmarks: the kind of model a hand-written trainer has. Parameters
// are separate tensors (W0, b0, W1, b1, ...) in declaration order, and the backward pass
// finishes them back to front, reporting each as soon as it is final, which is what a
// gradient reducer needs to overlap communication with the rest of the backward pass.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace cohort_examples {

// Deterministic pseudo-random numbers (splitmix64), identical on every platform.
inline double uniform(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e5ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;  // [-1, 1)
}

class mlp {
 public:
  // widths: input, hidden..., output. Activations are tanh; the loss is mean squared error.
  explicit mlp(std::vector<std::size_t> widths) : widths_(std::move(widths)) {}

  std::size_t layers() const { return widths_.size() - 1; }
  std::size_t input_width() const { return widths_.front(); }
  std::size_t output_width() const { return widths_.back(); }

  // Sizes of W0, b0, W1, b1, ... (W_l is out x in, row-major).
  std::vector<std::size_t> parameter_sizes() const {
    std::vector<std::size_t> sizes;
    for (std::size_t l = 0; l < layers(); ++l) {
      sizes.push_back(widths_[l + 1] * widths_[l]);
      sizes.push_back(widths_[l + 1]);
    }
    return sizes;
  }

  // Same initial weights for the same seed, on every rank.
  void initialize(std::span<const std::span<float>> parameters, std::uint64_t seed) const {
    for (std::size_t t = 0; t < parameters.size(); ++t) {
      const bool weight = t % 2 == 0;
      const double scale = weight ? 1.0 / std::sqrt(static_cast<double>(widths_[t / 2])) : 0.1;
      for (std::size_t i = 0; i < parameters[t].size(); ++i)
        parameters[t][i] = static_cast<float>(scale * uniform(seed + 1000 * t, i));
    }
  }

  // Mean squared error over the batch, and its gradient into `gradients` (overwritten).
  // on_ready(t) is called as soon as gradient t is final: b_last, W_last, ..., b0, W0.
  float loss_and_gradients(std::span<const std::span<float>> parameters, std::span<const std::span<float>> gradients,
                           std::span<const float> inputs, std::span<const float> targets, std::size_t batch,
                           const std::function<void(std::size_t)>& on_ready = {}) const {
    // Forward, keeping every layer's activations.
    std::vector<std::vector<float>> activation(layers() + 1);
    activation[0].assign(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(batch * input_width()));
    for (std::size_t l = 0; l < layers(); ++l) {
      const std::size_t in = widths_[l], out = widths_[l + 1];
      const float* w = parameters[2 * l].data();
      const float* b = parameters[2 * l + 1].data();
      auto& next = activation[l + 1];
      next.assign(batch * out, 0.0f);
      for (std::size_t s = 0; s < batch; ++s)
        for (std::size_t o = 0; o < out; ++o) {
          float sum = b[o];
          const float* x = &activation[l][s * in];
          const float* row = &w[o * in];
          for (std::size_t i = 0; i < in; ++i) sum += row[i] * x[i];
          next[s * out + o] = l + 1 < layers() ? std::tanh(sum) : sum;
        }
    }
    // Loss and its gradient with respect to the output.
    const std::size_t out_width = output_width();
    std::vector<float> delta(batch * out_width);
    double loss = 0;
    for (std::size_t k = 0; k < batch * out_width; ++k) {
      const float diff = activation.back()[k] - targets[k];
      loss += static_cast<double>(diff) * diff;
      delta[k] = 2.0f * diff / static_cast<float>(batch * out_width);
    }
    // Backward, last layer first.
    for (std::size_t l = layers(); l-- > 0;) {
      const std::size_t in = widths_[l], out = widths_[l + 1];
      float* gw = gradients[2 * l].data();
      float* gb = gradients[2 * l + 1].data();
      for (std::size_t o = 0; o < out; ++o) {
        float sum = 0;
        for (std::size_t s = 0; s < batch; ++s) sum += delta[s * out + o];
        gb[o] = sum;
      }
      if (on_ready) on_ready(2 * l + 1);
      for (std::size_t o = 0; o < out; ++o)
        for (std::size_t i = 0; i < in; ++i) {
          float sum = 0;
          for (std::size_t s = 0; s < batch; ++s) sum += delta[s * out + o] * activation[l][s * in + i];
          gw[o * in + i] = sum;
        }
      if (on_ready) on_ready(2 * l);
      if (l == 0) break;
      std::vector<float> previous(batch * in, 0.0f);
      const float* w = parameters[2 * l].data();
      for (std::size_t s = 0; s < batch; ++s)
        for (std::size_t i = 0; i < in; ++i) {
          float sum = 0;
          for (std::size_t o = 0; o < out; ++o) sum += delta[s * out + o] * w[o * in + i];
          const float a = activation[l][s * in + i];
          previous[s * in + i] = sum * (1.0f - a * a);  // tanh'
        }
      delta = std::move(previous);
    }
    return static_cast<float>(loss / static_cast<double>(batch * out_width));
  }

 private:
  std::vector<std::size_t> widths_;
};

// A synthetic regression task: targets from a fixed random "teacher" function of inputs.
struct synthetic_data {
  std::vector<float> inputs;   // samples x input_width
  std::vector<float> targets;  // samples x output_width
  std::size_t samples = 0;

  static synthetic_data make(std::size_t samples, std::size_t input_width, std::size_t output_width,
                             std::uint64_t seed) {
    synthetic_data data;
    data.samples = samples;
    data.inputs.resize(samples * input_width);
    data.targets.resize(samples * output_width);
    for (std::size_t k = 0; k < data.inputs.size(); ++k) data.inputs[k] = static_cast<float>(uniform(seed, k));
    for (std::size_t s = 0; s < samples; ++s)
      for (std::size_t o = 0; o < output_width; ++o) {
        double sum = 0;
        for (std::size_t i = 0; i < input_width; ++i)
          sum += uniform(seed + 7, o * input_width + i) * data.inputs[s * input_width + i];
        data.targets[s * output_width + o] = static_cast<float>(std::sin(sum));
      }
    return data;
  }
};

}  // namespace cohort_examples
