#pragma once
// COHORT_HOST_DEVICE marks functions that run on the host and, under nvcc, on the device.

#if defined(__CUDACC__)
#define COHORT_HOST_DEVICE __host__ __device__
#else
#define COHORT_HOST_DEVICE
#endif
