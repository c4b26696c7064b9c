#pragma once
// Helpers shared by cohort's tests: skipping with a reason, and running N ranks as threads.

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cohort_test {

// ctest maps exit code 77 to "Skipped" (SKIP_RETURN_CODE); each TEST_CASE runs in its own
// process under ctest, so leaving the process skips exactly this case.
[[noreturn]] inline void skip(const std::string& reason) {
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

// Runs fn(rank) on `world` threads and rethrows the first exception any rank threw, after
// every thread has finished (so a failing rank cannot leave the others dangling).
inline void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        errors[static_cast<std::size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
}

}  // namespace cohort_test
