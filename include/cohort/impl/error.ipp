#pragma once
// cohort/error.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <string>
#include <string_view>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

COHORT_DECL error::error(int rank, std::string_view operation, std::string_view detail, std::string_view hint)
    : std::runtime_error(compose(rank, operation, detail, hint)),
      rank_(rank),
      operation_(operation),
      detail_(detail),
      hint_(hint) {}

COHORT_DECL std::string error::compose(int rank, std::string_view operation, std::string_view detail,
                                       std::string_view hint) {
  std::string text = "cohort";
  if (rank >= 0) text += detail::text(" [rank ", std::to_string(rank), "]");
  text += detail::text(" ", operation, ": ", detail);
  if (!hint.empty()) text += detail::text(" (hint: ", hint, ")");
  return text;
}

}  // namespace cohort::inline v0
