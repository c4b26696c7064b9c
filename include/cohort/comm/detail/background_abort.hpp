#pragma once
// An engine's abort run on a thread of its own, waited for at most a bound.
//
// Aborting a communicator can block for as long as the device is busy: NCCL's abort destroys
// the communicator, which frees device memory, and cudaFree waits for the device, so an abort
// behind a kernel that never ends (a peer's collective that never arrives, a caller's kernel
// the group's stream waits on) never returns (NCCL issues 549 and 829). Whoever aborts has
// already published the failure; it must still reach the caller, or end the process, on time.
// The abort then finishes, or not, on its own thread, which holds nothing of cohort's.

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

namespace cohort::inline v0::detail {

// Runs `abort` on a detached thread and waits for it at most `wait_at_most` (zero: not at
// all). True when it finished within the wait. Where no thread can be started it runs here.
inline bool abort_in_background(std::function<void()> abort, std::chrono::milliseconds wait_at_most) {
  struct completion {
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
  };
  auto state = std::make_shared<completion>();
  auto job = std::make_shared<std::function<void()>>(std::move(abort));
  try {
    std::thread([state, job] {
      (*job)();
      std::lock_guard lock(state->mutex);
      state->done = true;
      state->finished.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    (*job)();  // no thread to be had: abort here, however long it takes
    return true;
  }
  std::unique_lock lock(state->mutex);
  return state->finished.wait_for(lock, wait_at_most, [&] { return state->done; });
}

}  // namespace cohort::inline v0::detail
