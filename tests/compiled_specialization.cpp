// Compiled once (COHORT_SEPARATE_COMPILATION), a unit that uses a specialization the library
// does not hold: tests/compiled_specialization.sh expects the compile-time error that names
// COHORT_TEMPLATE_BODIES without it, and a unit that compiles with it.
#include <cohort/cohort.hpp>

#include <string>
#include <utility>
#include <vector>

void train_in_double(cohort::process_group<cohort::gloo>& group, std::vector<cohort::region> regions) {
  cohort::training_state<cohort::gloo, double> state(group, std::move(regions));
  state.step();
  cohort::save_checkpoint(state, std::string("ckpt"), 1);
}
