#pragma once
// The group's GPU made current for the length of one cohort call, and the caller's put back.
//
// CUDA's current device is per thread: a trainer thread that drives another GPU, a worker
// thread, or cohort's own watchdog would otherwise create events, launch kernels and record
// on whatever device that thread last used, and a kernel sent to a stream of another device
// fails. Switching only when needed keeps the common case (already current) to one cheap
// cudaGetDevice; restoring keeps cohort from moving the caller's current device under it.

#include <cuda_runtime_api.h>

namespace cohort::inline v0::detail {

class device_scope {
 public:
  explicit device_scope(int device) noexcept {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != device && cudaSetDevice(device) == cudaSuccess)
      previous_ = current;
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  ~device_scope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

}  // namespace cohort::inline v0::detail
