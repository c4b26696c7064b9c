#pragma once
// Helpers shared by cohort's tests: skipping with a reason, checks inside rank threads, and
// running N ranks as threads.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <cohort/run/run_ranks.hpp>

namespace cohort_test {

// A loopback port free a moment ago (bound, read, closed), for a test's MASTER_PORT.
inline std::uint16_t unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0) throw std::runtime_error("unused_port: no socket");
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    throw std::runtime_error("unused_port: cannot bind a loopback socket");
  }
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Built with AddressSanitizer or ThreadSanitizer (the asan, gcc-asan and tsan tiers): their
// allocators keep freed memory and shadow the rest, and their runtimes need descriptors of
// their own, so the few cases that measure memory or take every descriptor away skip there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif
#else
inline constexpr bool sanitized = false;
#endif

// ctest maps exit code 77 to "Skipped" (SKIP_RETURN_CODE); each TEST_CASE runs in its own
// process under ctest, so leaving the process skips exactly this case.
[[noreturn]] inline void skip(const std::string& reason) {
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

// Catch2 v2 assertions are not thread-safe: inside rank threads use RANK_CHECK, which
// throws; run_ranks rethrows the first failure on the test's own thread, where Catch
// reports it with the rank, file, line and the failed condition.
struct rank_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define RANK_CHECK(condition, ...)                                                               \
  do {                                                                                           \
    if (!(condition)) {                                                                          \
      std::ostringstream cohort_test_message;                                                    \
      cohort_test_message << __FILE__ << ":" << __LINE__                                         \
                          << ": RANK_CHECK(" #condition ") failed. " __VA_OPT__(<< __VA_ARGS__); \
      throw ::cohort_test::rank_failure(cohort_test_message.str());                              \
    }                                                                                            \
  } while (false)

// Checks that fn throws an Exception whose what() contains `needle`; returns the text.
template <class Exception, class Fn>
std::string expect_throw(Fn&& fn, const std::string& needle, const char* where) {
  try {
    fn();
  } catch (const Exception& failure) {
    const std::string text = failure.what();
    if (text.find(needle) == std::string::npos)
      throw rank_failure(std::string(where) + ": error text lacks '" + needle + "': " + text);
    return text;
  }
  throw rank_failure(std::string(where) + ": expected an exception containing '" + needle + "'");
}
#define COHORT_STRINGIFY2(x) #x
#define COHORT_STRINGIFY(x) COHORT_STRINGIFY2(x)
#define RANK_CHECK_THROWS(Exception, expression, needle) \
  ::cohort_test::expect_throw<Exception>([&] { (void)(expression); }, needle, __FILE__ ":" COHORT_STRINGIFY(__LINE__))

// Runs fn(rank) on `world` threads (cohort::run_ranks) and rethrows the first failure of the
// lowest failing rank, after every thread has finished (so a failing rank cannot leave the
// others dangling), as a rank_failure that names the rank. The test brings its own store.
inline void run_ranks(int world, const std::function<void(int)>& fn) {
  cohort::run_ranks(world, [&](const std::shared_ptr<cohort::store>&, const cohort::launch_env& env) {
    try {
      fn(env.rank);
    } catch (const std::exception& failure) {
      throw rank_failure("rank " + std::to_string(env.rank) + " of " + std::to_string(world) + ": " + failure.what());
    }
  });
}

// How a rank thread that stays out of cohort's calls (busy elsewhere, then gone) waits until the
// others have their errors: until `count` reaches `target`, or `limit` passes (their checks then
// say what went wrong). A fixed sleep had to outlast their slowest diagnosis, under a
// sanitizer, on every run.
inline void wait_for_count(const std::atomic<int>& count, int target, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (count.load() < target && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

}  // namespace cohort_test
