#pragma once
// The device part of a program built with COHORT_SEPARATE_DEVICE_CODE: one .cu translation
// unit of the program's cohort library includes this header (cohort_add_compiled_library
// makes it when CUDA is enabled), so the device backend's element-wise kernels and their
// launchers are compiled once, by nvcc, for the whole program.
#if !defined(COHORT_SEPARATE_DEVICE_CODE) || !defined(__CUDACC__)
#error "cohort/impl/device_src.cuh is the .cu of a program built with COHORT_SEPARATE_DEVICE_CODE, compiled by nvcc"
#endif

#include "cohort/detail/device_elementwise.cuh"

namespace cohort::inline v0::detail::device {

// The element types the optimizers' updates compute in (16-bit parameters keep float masters).
template void launch_sgd<float>(cudaStream_t, float*, const float*, float*, std::size_t, const sgd_coefficients&);
template void launch_sgd<double>(cudaStream_t, double*, const double*, double*, std::size_t, const sgd_coefficients&);
template void launch_adam<float>(cudaStream_t, float*, const float*, float*, float*, std::size_t,
                                 const adam_coefficients&);
template void launch_adam<double>(cudaStream_t, double*, const double*, double*, double*, std::size_t,
                                  const adam_coefficients&);

}  // namespace cohort::inline v0::detail::device
