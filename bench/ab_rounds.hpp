#pragma once
// A/B rounds: the one way bench/ programs compare two things (cohort against PyTorch, adopted
// buffers against owned ones, overlap against none, a save against the disk).
//
// On a small machine shared with other work, two runs of the same program differ by more than
// most differences worth measuring: the load drifts over seconds to minutes. Measuring A for a
// while and then B folds that drift into the ratio. So the two sides alternate in one
// invocation, A B B A in each round: a drift that is linear over a round costs both sides the
// same, and each round's ratio, (A1 + A2) / (B1 + B2), is free of it. Every sample is kept
// and printed; the figure is the median of the rounds' ratios, with their minimum and maximum
// as its spread (at least 3 rounds for a figure worth writing down).
//
// A sample is whatever the caller measures in one go (a median of a few steps, one save); the
// functions run in this order on every rank alike, so collective samples stay in step.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/tools/detail/json.hpp"

namespace cohort_bench {

struct ab_result {
  std::string what;                          // the comparison
  std::string a, b;                          // the two sides
  std::vector<double> a_samples, b_samples;  // in the order taken: round r's are [2r] then [2r + 1]
  std::vector<double> ratios;                // per round: (A1 + A2) / (B1 + B2)
  double median_ratio = 0, min_ratio = 0, max_ratio = 0;
  std::optional<double> at_most;   // the target: median ratio <= this
  std::optional<double> at_least;  // and >= this (a band, "within 5%")

  bool met() const { return (!at_most || median_ratio <= *at_most) && (!at_least || median_ratio >= *at_least); }
};

inline double median_of(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Fills in the ratios of a result whose samples are set (a caller that took them itself).
inline void summarize_rounds(ab_result& r) {
  r.ratios.clear();
  const std::size_t rounds = std::min(r.a_samples.size(), r.b_samples.size()) / 2;
  for (std::size_t k = 0; k < rounds; ++k) {
    const double b = r.b_samples[2 * k] + r.b_samples[2 * k + 1];
    r.ratios.push_back(b > 0 ? (r.a_samples[2 * k] + r.a_samples[2 * k + 1]) / b : 0);
  }
  r.median_ratio = median_of(r.ratios);
  r.min_ratio = r.ratios.empty() ? 0 : *std::min_element(r.ratios.begin(), r.ratios.end());
  r.max_ratio = r.ratios.empty() ? 0 : *std::max_element(r.ratios.begin(), r.ratios.end());
}

// `rounds` rounds of A B B A; `between` (if set) runs after every sample, e.g. to let a disk
// settle or to keep the ranks together.
inline ab_result ab_rounds(std::string what, std::string a_name, std::string b_name, int rounds,
                           const std::function<double()>& a, const std::function<double()>& b,
                           const std::function<void()>& between = {}) {
  ab_result r;
  r.what = std::move(what);
  r.a = std::move(a_name);
  r.b = std::move(b_name);
  const auto take = [&](const std::function<double()>& side, std::vector<double>& into) {
    into.push_back(side());
    if (between) between();
  };
  for (int k = 0; k < rounds; ++k) {
    take(a, r.a_samples);
    take(b, r.b_samples);
    take(b, r.b_samples);
    take(a, r.a_samples);
  }
  summarize_rounds(r);
  return r;
}

inline std::string sample_list(const std::vector<double>& values, const char* format = "%.1f") {
  std::string text;
  for (const double v : values) {
    char one[32];
    std::snprintf(one, sizeof one, format, v);
    text += (text.empty() ? "" : " ") + std::string(one);
  }
  return text;
}

// "what: A / B = 0.87 [0.84-0.91] over 3 rounds (target <= 0.90: met)", then every sample.
inline void print_result(const ab_result& r, const char* unit = "ms", const char* format = "%.1f",
                         std::FILE* out = stdout) {
  std::string target;
  if (r.at_most || r.at_least) {
    char text[96];
    if (r.at_most && r.at_least)
      std::snprintf(text, sizeof text, " (target %.2f-%.2f: %s)", *r.at_least, *r.at_most, r.met() ? "met" : "NOT met");
    else
      std::snprintf(text, sizeof text, " (target %s %.2f: %s)",
                    r.at_most ? "<=" : ">=", r.at_most ? *r.at_most : *r.at_least, r.met() ? "met" : "NOT met");
    target = text;
  }
  std::fprintf(out, "%s: %s / %s = %.3f [%.3f-%.3f] over %zu rounds%s\n", r.what.c_str(), r.a.c_str(), r.b.c_str(),
               r.median_ratio, r.min_ratio, r.max_ratio, r.ratios.size(), target.c_str());
  std::fprintf(out, "    A %-34s %s: %s\n", r.a.c_str(), unit, sample_list(r.a_samples, format).c_str());
  std::fprintf(out, "    B %-34s %s: %s\n", r.b.c_str(), unit, sample_list(r.b_samples, format).c_str());
  std::fprintf(out, "    ratio per round (A1+A2)/(B1+B2): %s\n", sample_list(r.ratios, "%.3f").c_str());
}

inline cohort::detail::json to_json(const ab_result& r) {
  using cohort::detail::json;
  const auto list = [](const std::vector<double>& values) { return json(json::array(values.begin(), values.end())); };
  json item = json::make_object();
  item.set("what", r.what);
  item.set("a", r.a);
  item.set("b", r.b);
  item.set("order", "A B B A per round");
  item.set("a_samples", list(r.a_samples));
  item.set("b_samples", list(r.b_samples));
  item.set("ratios", list(r.ratios));
  item.set("median_ratio", r.median_ratio);
  item.set("min_ratio", r.min_ratio);
  item.set("max_ratio", r.max_ratio);
  if (r.at_most) item.set("target_at_most", *r.at_most);
  if (r.at_least) item.set("target_at_least", *r.at_least);
  if (r.at_most || r.at_least) item.set("met", r.met());
  return item;
}

}  // namespace cohort_bench
