// Compiled once (COHORT_SEPARATE_COMPILATION), a process group over a backend of the user's own,
// which the library does not hold: tests/compiled_specialization.sh expects the compile-time
// error that names COHORT_TEMPLATE_BODIES without it, and a unit that compiles with it.
#include <cohort/cohort.hpp>

#include <chrono>
#include <cstddef>

// Only what the group's barrier uses of its engine: this unit is compiled, never run.
struct own_backend {
  struct work {
    void wait() {}
  };
  struct options {
    std::chrono::milliseconds timeout{1000};
    bool debug_checks = false;
  };
  using stream_type = std::nullptr_t;
  static constexpr cohort::memory_space space = cohort::memory_space::host;
  static constexpr const char* name = "own";
  work barrier() { return {}; }
};

own_backend::work synchronise(cohort::process_group<own_backend>& group) { return group.barrier(); }
