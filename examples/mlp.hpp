#pragma once
// A small multi-layer perceptron with a hand-written backward pass, shared by the examples,
// the tests and the benchmarks: the kind of model a hand-written trainer has. Parameters
// are separate tensors (W0, b0, W1, b1, ...) in declaration order, and the backward pass
// finishes them back to front, reporting each as soon as it is final, which is what a
// training state needs (mark_ready) to overlap communication with the rest of the backward pass.

#include <algorithm>
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

  // One layer at a time, for callers that hold only one layer's weights at once (at zero3,
  // training_state gathers a layer for the trainer to run, and releases it after).
  //
  // out = act(W in + b) for `batch` rows; act is tanh except on the last layer.
  void forward_layer(std::size_t l, std::span<const float> w, std::span<const float> b, std::span<const float> in,
                     std::span<float> out, std::size_t batch) const {
    const std::size_t in_width = widths_[l], out_width = widths_[l + 1];
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t o = 0; o < out_width; ++o) {
        float sum = b[o];
        const float* x = &in[s * in_width];
        const float* row = &w[o * in_width];
        for (std::size_t i = 0; i < in_width; ++i) sum += row[i] * x[i];
        out[s * out_width + o] = l + 1 < layers() ? std::tanh(sum) : sum;
      }
  }

  // Mean squared error of the network's output, and its gradient with respect to the output.
  float output_loss(std::span<const float> out, std::span<const float> targets, std::size_t batch,
                    std::span<float> delta) const {
    const std::size_t n = batch * output_width();
    double loss = 0;
    for (std::size_t k = 0; k < n; ++k) {
      const float diff = out[k] - targets[k];
      loss += static_cast<double>(diff) * diff;
      delta[k] = 2.0f * diff / static_cast<float>(n);
    }
    return static_cast<float>(loss / static_cast<double>(n));
  }

  // Given delta (the loss gradient at layer l's pre-activation output) and the layer's input,
  // writes the gradients of W_l and b_l and, when `previous` is not empty, the delta of
  // layer l-1 (through tanh', since every hidden layer's output is a tanh).
  void backward_layer(std::size_t l, std::span<const float> w, std::span<const float> in, std::span<const float> delta,
                      std::span<float> gw, std::span<float> gb, std::span<float> previous, std::size_t batch) const {
    const std::size_t in_width = widths_[l], out_width = widths_[l + 1];
    for (std::size_t o = 0; o < out_width; ++o) {
      float sum = 0;
      for (std::size_t s = 0; s < batch; ++s) sum += delta[s * out_width + o];
      gb[o] = sum;
    }
    for (std::size_t o = 0; o < out_width; ++o)
      for (std::size_t i = 0; i < in_width; ++i) {
        float sum = 0;
        for (std::size_t s = 0; s < batch; ++s) sum += delta[s * out_width + o] * in[s * in_width + i];
        gw[o * in_width + i] = sum;
      }
    if (!previous.empty()) backward_layer_delta(l, w, in, delta, previous, batch);
  }

  // Mean squared error over the batch, and its gradient into `gradients` (overwritten).
  // on_ready(t) is called as soon as gradient t is final: b_last, W_last, ..., b0, W0.
  float loss_and_gradients(std::span<const std::span<float>> parameters, std::span<const std::span<float>> gradients,
                           std::span<const float> inputs, std::span<const float> targets, std::size_t batch,
                           const std::function<void(std::size_t)>& on_ready = {}) const {
    std::vector<std::vector<float>> activation(layers() + 1);
    activation[0].assign(inputs.begin(), inputs.begin() + static_cast<std::ptrdiff_t>(batch * input_width()));
    for (std::size_t l = 0; l < layers(); ++l) {
      activation[l + 1].assign(batch * widths_[l + 1], 0.0f);
      forward_layer(l, parameters[2 * l], parameters[2 * l + 1], activation[l], activation[l + 1], batch);
    }
    std::vector<float> delta(batch * output_width());
    const float loss = output_loss(activation.back(), targets, batch, delta);
    for (std::size_t l = layers(); l-- > 0;) {
      std::vector<float> previous(l > 0 ? batch * widths_[l] : 0);
      // Bias first, then weights: report each as soon as it is final.
      backward_layer(l, parameters[2 * l], activation[l], delta, gradients[2 * l], gradients[2 * l + 1], {}, batch);
      if (on_ready) {
        on_ready(2 * l + 1);
        on_ready(2 * l);
      }
      if (l == 0) break;
      backward_layer_delta(l, parameters[2 * l], activation[l], delta, previous, batch);
      delta = std::move(previous);
    }
    return loss;
  }

 private:
  void backward_layer_delta(std::size_t l, std::span<const float> w, std::span<const float> in,
                            std::span<const float> delta, std::span<float> previous, std::size_t batch) const {
    const std::size_t in_width = widths_[l], out_width = widths_[l + 1];
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t i = 0; i < in_width; ++i) {
        float sum = 0;
        for (std::size_t o = 0; o < out_width; ++o) sum += delta[s * out_width + o] * w[o * in_width + i];
        const float a = in[s * in_width + i];
        previous[s * in_width + i] = sum * (1.0f - a * a);  // tanh'
      }
  }

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

// One process on whole batches of `data`, Adam (beta 0.9, 0.999, eps 1e-8, no weight decay)
// written out in float: the hybrid-sharding test's reference (test_multinode).
inline std::vector<std::vector<float>> train_adam_single(const mlp& model, const synthetic_data& data,
                                                         std::size_t batch, int steps, double lr) {
  std::vector<std::vector<float>> params, grads, m, v;
  for (auto n : model.parameter_sizes()) {
    params.emplace_back(n, 0.0f);
    grads.emplace_back(n, 0.0f);
    m.emplace_back(n, 0.0f);
    v.emplace_back(n, 0.0f);
  }
  model.initialize(std::vector<std::span<float>>(params.begin(), params.end()), 7);
  for (int step = 0; step < steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * batch;
    model.loss_and_gradients(std::vector<std::span<float>>(params.begin(), params.end()),
                             std::vector<std::span<float>>(grads.begin(), grads.end()),
                             std::span<const float>(data.inputs).subspan(first * model.input_width()),
                             std::span<const float>(data.targets).subspan(first * model.output_width()), batch);
    const double t = step + 1;
    for (std::size_t k = 0; k < params.size(); ++k)
      for (std::size_t i = 0; i < params[k].size(); ++i) {
        const float g = grads[k][i];
        m[k][i] = 0.9f * m[k][i] + 0.1f * g;
        v[k][i] = 0.999f * v[k][i] + static_cast<float>(1 - 0.999) * g * g;
        const float m_hat = m[k][i] / static_cast<float>(1 - std::pow(0.9, t));
        const float v_hat = v[k][i] / static_cast<float>(1 - std::pow(0.999, t));
        params[k][i] -= static_cast<float>(lr) * (m_hat / (std::sqrt(v_hat) + 1e-8f));
      }
  }
  return params;
}

// The largest |a - b| over every element of two sets of tensors of the same shapes.
inline double max_difference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double worst = a.size() == b.size() ? 0.0 : INFINITY;
  for (std::size_t k = 0; k < a.size() && k < b.size(); ++k) {
    if (a[k].size() != b[k].size()) return INFINITY;
    for (std::size_t i = 0; i < a[k].size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(a[k][i]) - static_cast<double>(b[k][i])));
  }
  return worst;
}

}  // namespace cohort_examples
