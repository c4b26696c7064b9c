// The same consumer program, compiled by nvcc with the NCCL backend in the umbrella header:
// a CUDA trainer includes <cohort/cohort.hpp> from its .cu files, so that must compile. With
// consumer_nvcc_second.cu, two files that both instantiate cohort's kernels link as one.
#include "consumer.cpp"

namespace consumer_nvcc {
cohort::nccl::work scale_on(cohort::nccl& engine, float* device_data, std::size_t count, double factor) {
  cohort::fill(engine, device_data, count, cohort::dtype::float32, 1.0);
  return cohort::scale(engine, device_data, count, cohort::dtype::float32, factor);
}
}  // namespace consumer_nvcc
