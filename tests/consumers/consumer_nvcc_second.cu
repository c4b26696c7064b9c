// A second .cu file of the same CUDA program, launching cohort's kernels too: a trainer's
// .cu files all include cohort's headers, so the program must link (kernels in a header are
// emitted once, not once per file).
#include <cohort/cohort.hpp>

namespace consumer_nvcc {
// The same kernels as consumer_nvcc.cu's, instantiated here too.
cohort::nccl::work fill_and_scale(cohort::nccl& engine, float* device_data, std::size_t count, double factor) {
  cohort::fill(engine, device_data, count, cohort::dtype::float32, 0.0);
  return cohort::scale(engine, device_data, count, cohort::dtype::float32, factor);
}
}  // namespace consumer_nvcc
