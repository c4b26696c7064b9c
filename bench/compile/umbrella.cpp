// The umbrella header alone: what every translation unit of a trainer that includes
// <cohort/cohort.hpp> pays before it uses anything.
#include <cohort/cohort.hpp>
