// The same consumer program, compiled by nvcc with the NCCL backend in the umbrella header:
// a CUDA trainer includes <cohort/cohort.hpp> from its .cu files, so that must compile.
#include "consumer.cpp"
