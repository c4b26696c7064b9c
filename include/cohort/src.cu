#pragma once
// The device half of cohort/src.hpp: a separately compiled program with NCCL compiles this file
// once, with nvcc (cohort_add_compiled_library adds it when cohort::nccl is linked), so the
// device backend's element-wise kernels and their launchers exist once for the whole program
// and its other translation units, plain C++ or .cu, see the launchers' declarations only.
#if !defined(COHORT_SEPARATE_COMPILATION) || !defined(__CUDACC__)
#error "cohort/src.cu is the device code of a program built with COHORT_SEPARATE_COMPILATION, compiled by nvcc"
#endif

#include "cohort/comm/detail/device_elementwise.cuh"

namespace cohort::inline v0::detail::device {

// The element types the optimizers' updates compute in (16-bit parameters keep float masters).
template void launch_sgd<float>(cudaStream_t, float*, const float*, float*, std::size_t, const sgd_coefficients&);
template void launch_sgd<double>(cudaStream_t, double*, const double*, double*, std::size_t, const sgd_coefficients&);
template void launch_adam<float>(cudaStream_t, float*, const float*, float*, float*, std::size_t,
                                 const adam_coefficients&);
template void launch_adam<double>(cudaStream_t, double*, const double*, double*, double*, std::size_t,
                                  const adam_coefficients&);

}  // namespace cohort::inline v0::detail::device
