#pragma once
// One exception type for everything cohort reports. Each error says which rank hit it,
// which operation was running, the sizes involved, and the most likely fix, because the
// person reading it is usually looking at the interleaved logs of many processes.

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/version.hpp"

namespace cohort::inline v0 {

class error : public std::runtime_error {
 public:
  // rank < 0 means "not known here" (for example before the launch environment is read).
  // Views, copied here: a throw site passes literals and one message, and builds no strings of
  // its own (hundreds of sites; each string built there is code and a clean-up path).
  // Compiled once separately (cohort/impl/error.ipp): every unit that throws one would
  // otherwise emit the message's composition.
  COHORT_DECL error(int rank, std::string_view operation, std::string_view detail, std::string_view hint = {});

  int rank() const noexcept { return rank_; }
  const std::string& operation() const noexcept { return operation_; }
  const std::string& detail() const noexcept { return detail_; }
  const std::string& hint() const noexcept { return hint_; }

 private:
  COHORT_DECL static std::string compose(int rank, std::string_view operation, std::string_view detail,
                                         std::string_view hint);

  int rank_;
  std::string operation_;
  std::string detail_;
  std::string hint_;
};

// A wait that ran out of time: a peer that never arrived, a key never set, a collective
// some rank never entered. Separate type so callers can retry or abort deliberately.
class timeout_error : public error {
 public:
  using error::error;
};

namespace detail {
// COHORT_DEBUG set to anything but "" or "0": cross-rank checks, and debug lines on stderr.
inline bool debug_from_environment() {
  const char* value = std::getenv("COHORT_DEBUG");
  return value && *value && std::string(value) != "0";
}
inline std::string format_duration(std::chrono::milliseconds ms) {
  if (ms.count() % 1000 == 0) return detail::text(std::to_string(ms.count() / 1000), " s");
  return detail::text(std::to_string(ms.count()), " ms");
}
// "rank 2" or "ranks 0, 1, 3", as errors name them.
inline std::string format_ranks(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t k = 0; k < ranks.size(); ++k) text += (k ? ", " : "") + std::to_string(ranks[k]);
  return text;
}
}  // namespace detail

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/error.ipp"
#endif
