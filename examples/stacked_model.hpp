#pragma once
// A model as a hand-written trainer keeps it, llm.c's way: every parameter in one flat float
// buffer, each block tensor stacked over the blocks ([W_0 .. W_{L-1}] then [b_0 .. b_{L-1}])
// and reached by pointer arithmetic (block_w + l * width * width), the gradients in a second
// buffer of the same layout, and its own AdamW with clipping by the global norm. A residual
// MLP whose output layer is tied to its input layer, as GPT-2's logits are to its token
// embedding: h_0 = W_in x + b_in, h_{l+1} = h_l + tanh(W_l h_l + b_l), y = W_in^T h_L + b_out,
// mean squared error. Nothing here knows cohort: stacked_plain.hpp trains it alone, and
// stacked_cohort.hpp is that same trainer converted to cohort.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "mlp.hpp"  // uniform(): the examples' deterministic random numbers

namespace cohort_examples::stacked {

struct shape {
  std::size_t in = 16, width = 64, blocks = 6;  // the output has `in` values (tied to the input layer)
};

// Where each tensor starts in a flat buffer (parameters or gradients): the buffer's layout.
struct tensors {
  float* in_w;     // [width x in]
  float* in_b;     // [width]
  float* block_w;  // [blocks][width x width]
  float* block_b;  // [blocks][width]
  float* out_b;    // [in]: the output layer's weights are in_w's, transposed
};

inline std::size_t parameter_count(const shape& s) {
  return s.width * s.in + s.width + s.blocks * (s.width * s.width + s.width) + s.in;
}

inline tensors point(const shape& s, float* base) {
  tensors t{};
  t.in_w = base;
  t.in_b = t.in_w + s.width * s.in;
  t.block_w = t.in_b + s.width;
  t.block_b = t.block_w + s.blocks * s.width * s.width;
  t.out_b = t.block_b + s.blocks * s.width;
  return t;
}

inline void initialize(const shape& s, float* params, std::uint64_t seed) {
  const tensors p = point(s, params);
  const auto fill = [&](float* at, std::size_t n, double scale, std::uint64_t stream) {
    for (std::size_t i = 0; i < n; ++i) at[i] = static_cast<float>(scale * uniform(seed + stream, i));
  };
  fill(p.in_w, s.width * s.in, 1.0 / std::sqrt(static_cast<double>(s.in)), 1);
  fill(p.in_b, s.width, 0.1, 2);
  fill(p.block_w, s.blocks * s.width * s.width, 0.5 / std::sqrt(static_cast<double>(s.width)), 3);
  fill(p.block_b, s.blocks * s.width, 0.1, 4);
  fill(p.out_b, s.in, 0.0, 6);
}

// Rows `first` .. of each step's batch: inputs in [-1, 1), targets a smooth function of them.
struct dataset {
  shape s;
  std::size_t batch = 0;  // rows per step
  std::vector<float> x, y;
  dataset(const shape& model, std::size_t rows_per_step, int steps) : s(model), batch(rows_per_step) {
    const std::size_t rows = batch * static_cast<std::size_t>(steps);
    x.resize(rows * s.in);
    y.resize(rows * s.in);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(uniform(7, i));
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t o = 0; o < s.in; ++o) {
        double sum = 0;
        for (std::size_t i = 0; i < s.in; ++i) sum += std::sin(0.3 * static_cast<double>(o + 1) * x[r * s.in + i]);
        y[r * s.in + o] = static_cast<float>(sum / static_cast<double>(s.in));
      }
  }
  const float* inputs(int step, std::size_t first) const {
    return &x[(static_cast<std::size_t>(step) * batch + first) * s.in];
  }
  const float* targets(int step, std::size_t first) const {
    return &y[(static_cast<std::size_t>(step) * batch + first) * s.in];
  }
};

// The forward's activations for `batch` rows, kept for the backward.
struct activations {
  std::vector<float> h;      // [(blocks + 1) x batch x width]: each block's input, then the last
  std::vector<float> t;      // [blocks x batch x width]: each block's tanh
  std::vector<float> delta;  // [batch x width]: the loss gradient at the current h
  std::vector<float> dy;     // [batch x in]
  activations(const shape& s, std::size_t batch)
      : h((s.blocks + 1) * batch * s.width), t(s.blocks * batch * s.width), delta(batch * s.width), dy(batch * s.in) {}
};

// out[r] = W in[r] + b for `batch` rows; W is [n_out x n_in], row-major, or `transposed`
// [n_in x n_out] (the tied output layer reads the input layer's weights so).
inline void linear(const float* w, const float* b, const float* in, float* out, std::size_t batch, std::size_t n_in,
                   std::size_t n_out, bool transposed = false) {
  const std::size_t along_out = transposed ? 1 : n_in, along_in = transposed ? n_out : 1;
  for (std::size_t r = 0; r < batch; ++r)
    for (std::size_t o = 0; o < n_out; ++o) {
      float sum = b[o];
      for (std::size_t i = 0; i < n_in; ++i) sum += w[o * along_out + i * along_in] * in[r * n_in + i];
      out[r * n_out + o] = sum;
    }
}

// The gradients of W and b (added) from the output gradient `d` and the input, and the input's
// gradient (added into `d_in`, when given).
inline void linear_backward(const float* w, const float* in, const float* d, float* gw, float* gb, float* d_in,
                            std::size_t batch, std::size_t n_in, std::size_t n_out, bool transposed = false) {
  const std::size_t along_out = transposed ? 1 : n_in, along_in = transposed ? n_out : 1;
  for (std::size_t r = 0; r < batch; ++r)
    for (std::size_t o = 0; o < n_out; ++o) {
      const float dv = d[r * n_out + o];
      gb[o] += dv;
      for (std::size_t i = 0; i < n_in; ++i) {
        gw[o * along_out + i * along_in] += dv * in[r * n_in + i];
        if (d_in) d_in[r * n_in + i] += dv * w[o * along_out + i * along_in];
      }
    }
}

// One layer at a time, as llm.c's forward and backward walk the blocks: the trainer's loop
// passes each block's tensors (block_w + l * width * width, ...).
inline void forward_input(const shape& s, const float* w, const float* b, const float* x, std::size_t batch,
                          activations& a) {
  linear(w, b, x, a.h.data(), batch, s.in, s.width);
}
inline void forward_block(const shape& s, std::size_t l, const float* w, const float* b, std::size_t batch,
                          activations& a) {
  const float* in = &a.h[l * batch * s.width];
  float* t = &a.t[l * batch * s.width];
  float* out = &a.h[(l + 1) * batch * s.width];
  linear(w, b, in, t, batch, s.width, s.width);
  for (std::size_t i = 0; i < batch * s.width; ++i) {
    t[i] = std::tanh(t[i]);
    out[i] = in[i] + t[i];
  }
}
// The mean squared error of the output layer (w: the input layer's weights, tied), and the loss
// gradient at the last h.
inline float forward_output(const shape& s, const float* w, const float* b, const float* target, std::size_t batch,
                            activations& a) {
  const float* h = &a.h[s.blocks * batch * s.width];
  linear(w, b, h, a.dy.data(), batch, s.width, s.in, true);
  double loss = 0;
  const std::size_t n = batch * s.in;
  for (std::size_t k = 0; k < n; ++k) {
    const float diff = a.dy[k] - target[k];
    loss += static_cast<double>(diff) * diff;
    a.dy[k] = 2.0f * diff / static_cast<float>(n);
  }
  return static_cast<float>(loss / static_cast<double>(n));
}
// gw: the input layer's weight gradients, which the input layer's backward adds to later.
inline void backward_output(const shape& s, const float* w, float* gw, float* gb, std::size_t batch, activations& a) {
  std::fill(a.delta.begin(), a.delta.end(), 0.0f);
  linear_backward(w, &a.h[s.blocks * batch * s.width], a.dy.data(), gw, gb, a.delta.data(), batch, s.width, s.in, true);
}
inline void backward_block(const shape& s, std::size_t l, const float* w, float* gw, float* gb, std::size_t batch,
                           activations& a) {
  // delta is dL/dh_{l+1}; h_{l+1} = h_l + tanh(z): dL/dz = delta * (1 - t^2), dL/dh_l = delta + W^T dL/dz.
  const float* t = &a.t[l * batch * s.width];
  std::vector<float> dz(batch * s.width);
  for (std::size_t i = 0; i < dz.size(); ++i) dz[i] = a.delta[i] * (1.0f - t[i] * t[i]);
  linear_backward(w, &a.h[l * batch * s.width], dz.data(), gw, gb, a.delta.data(), batch, s.width, s.width);
}
inline void backward_input(const shape& s, const float* x, float* gw, float* gb, std::size_t batch,
                           const activations& a) {
  linear_backward(nullptr, x, a.delta.data(), gw, gb, nullptr, batch, s.in, s.width);
}

// The trainer's optimizer, as llm.c's: AdamW in float over n elements, step t from 1, every
// gradient multiplied by `grad_scale` (clipping) first.
struct adamw_settings {
  float lr = 2e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
};
inline void adamw(float* p, const float* g, float* m, float* v, std::size_t n, int t, const adamw_settings& o,
                  double grad_scale) {
  const float correction1 = 1.0f - std::pow(o.beta1, static_cast<float>(t));
  const float correction2 = 1.0f - std::pow(o.beta2, static_cast<float>(t));
  const auto scale = static_cast<float>(grad_scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float grad = g[i] * scale;
    m[i] = o.beta1 * m[i] + (1.0f - o.beta1) * grad;
    v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * grad * grad;
    const float mh = m[i] / correction1, vh = v[i] / correction2;
    p[i] -= o.lr * (mh / (std::sqrt(vh) + o.eps) + o.weight_decay * p[i]);
  }
}

// The gradients' global norm, and clipping by it as PyTorch's clip_grad_norm_: max / (norm +
// 1e-6) past the max.
inline double gradient_norm(const float* g, std::size_t n) {
  double squares = 0;
  for (std::size_t i = 0; i < n; ++i) squares += static_cast<double>(g[i]) * g[i];
  return std::sqrt(squares);
}
inline double clip_scale(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

// The trainer's settings.
struct run {
  int steps = 30;
  std::size_t batch = 48;  // rows per step, over all ranks
  adamw_settings adam;
  double max_grad_norm = 0.05;  // clips the first steps' gradients
  int sample_every = 10;        // steps between forward-only samples, which the trainer prints
  // Micro-batches of a step over all ranks, each rank running micro_batches / world of them as
  // micro-steps, their gradients added up (gradient accumulation); 0: one per rank.
  std::size_t micro_batches = 0;
  std::size_t micro_steps(int world) const { return micro_batches ? micro_batches / world : 1; }
  std::size_t rows(int world) const { return batch / (micro_steps(world) * static_cast<std::size_t>(world)); }
};

// The mean of a step's micro-batch losses.
inline float mean(const std::vector<float>& values) {
  float sum = 0;
  for (const float value : values) sum += value;
  return sum / static_cast<float>(values.size());
}

}  // namespace cohort_examples::stacked
