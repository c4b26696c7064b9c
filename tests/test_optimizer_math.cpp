// The optimizer layer's scalar pieces, with no communication: detail/scalar_math.hpp's
// builtins against <cmath>, and the loss scaler's schedule.
#include <catch2/catch.hpp>

#include <cohort/detail/scalar_math.hpp>
#include <cohort/parallel/loss_scaler.hpp>

#include <cmath>
#include <limits>

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
