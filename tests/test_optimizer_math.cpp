// The optimizer layer's scalar pieces, with no communication: detail/scalar_math.hpp's
// builtins against <cmath>, the host loops against the per-element formulas, and the loss
// scaler's schedule.
#include <catch2/catch.hpp>

#include <cohort/comm/detail/host_elementwise.hpp>
#include <cohort/detail/scalar_math.hpp>
#include <cohort/parallel/loss_scaler.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

// The optimizer layer's norms and Adam's update use detail/scalar_math.hpp's builtins in place of <cmath>:
// the same values, bit for bit, including at the edges.
TEST_CASE("scalar_math's builtins give what <cmath> gives", "[optimizer]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double denormal = std::numeric_limits<double>::denorm_min();
  for (double x : {0.0, -0.0, denormal, 1e-300, 0.5, 2.0, 3.0, 1e300, inf, -1.0, -inf, nan}) {
    const double root = cohort::detail::square_root(x);
    if (std::isnan(std::sqrt(x)))
      CHECK(std::isnan(root));
    else
      CHECK(root == std::sqrt(x));
    const auto single = static_cast<float>(x);
    const float single_root = cohort::detail::square_root(single);
    if (std::isnan(std::sqrt(single)))
      CHECK(std::isnan(single_root));
    else
      CHECK(single_root == std::sqrt(single));
    CHECK(cohort::detail::is_finite(x) == std::isfinite(x));
    CHECK(cohort::detail::is_finite(single) == std::isfinite(single));
  }
  for (double beta : {0.9, 0.999, 0.5})
    for (double t : {1.0, 2.0, 10.0, 1000.0, 1e6}) CHECK(cohort::detail::power(beta, t) == std::pow(beta, t));
  CHECK(std::isnan(cohort::detail::quiet_nan()));
}

// The host AdamW runs whole vectors of elements at a time (and the last few through a vector of
// their own): every element must come out bit for bit as detail::adam_update computes it,
// wherever it sits (a rank's part of a sharded range starts anywhere).
TEMPLATE_TEST_CASE("the host AdamW loop equals adam_update element by element", "[optimizer]", float, double) {
  using T = TestType;
  const cohort::detail::adam_coefficients c{.lr = 3e-3,
                                            .beta1 = 0.9,
                                            .beta2 = 0.999,
                                            .eps = 1e-8,
                                            .weight_decay = 0.1,
                                            .correction1 = 1 - std::pow(0.9, 3),
                                            .correction2 = 1 - std::pow(0.999, 3),
                                            .grad_scale = 0.37};
  const auto value = [](std::size_t i, double spread) {
    return static_cast<T>(std::sin(0.7 * static_cast<double>(i) + spread) * spread);
  };
  for (const std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{3}})
    for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5},
                                    std::size_t{8}, std::size_t{37}, std::size_t{1000}}) {
      const std::size_t n = offset + count;
      std::vector<T> p(n), g(n), m(n), v(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = value(i, 1.3);
        g[i] = value(i, 0.2);
        m[i] = value(i, 0.01);
        v[i] = static_cast<T>(std::abs(static_cast<double>(value(i, 0.003))));
      }
      auto want_p = p, want_m = m, want_v = v;
      for (std::size_t i = offset; i < n; ++i) cohort::detail::adam_update(want_p[i], g[i], want_m[i], want_v[i], c);
      cohort::detail::host::adam(p.data() + offset, g.data() + offset, m.data() + offset, v.data() + offset, count, c);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < n; ++i) differ += p[i] != want_p[i] || m[i] != want_m[i] || v[i] != want_v[i];
      INFO("offset " << offset << ", " << count << " elements");
      CHECK(differ == 0);
    }
}

TEST_CASE("the loss scaler backs off on a skipped step and grows after an interval of good ones", "[optimizer]") {
  cohort::loss_scaler scaler({.initial_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.update(true));  // skipped
  CHECK(scaler.scale() == 512);
  CHECK_FALSE(scaler.update(false));
  CHECK_FALSE(scaler.update(false));
  CHECK(scaler.scale() == 512);
  CHECK_FALSE(scaler.update(false));  // the third good step in a row
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.skipped_steps() == 1);
  cohort::loss_scaler floor({.initial_scale = 2, .min_scale = 1});
  floor.update(true);
  floor.update(true);
  CHECK(floor.scale() == 1);
  CHECK_THROWS_WITH(cohort::loss_scaler({.initial_scale = 0}), Catch::Contains("need initial > 0"));
}
