#pragma once
// cohort's version, and the versioned inline namespace every public name lives in.
// The inline namespace makes two translation units built against different cohort
// versions fail to link instead of silently mixing layouts.

#define COHORT_VERSION_MAJOR 0
#define COHORT_VERSION_MINOR 1
#define COHORT_VERSION_PATCH 0
#define COHORT_VERSION_STRING "0.1.0"

namespace cohort::inline v0 {
struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{COHORT_VERSION_MAJOR, COHORT_VERSION_MINOR, COHORT_VERSION_PATCH};
}  // namespace cohort::inline v0
