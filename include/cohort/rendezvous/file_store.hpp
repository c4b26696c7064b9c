#pragma once
// A rendezvous store in a directory of a filesystem every rank can see (NFS, Lustre, GPFS,
// or /tmp for ranks on one node), for clusters where no rank can listen on a port.
//
// Layout: every key is one file, directory/<run id>/<encoded key>. Keys are scoped by the run
// id, so files an earlier run left behind (another run id) are never read; use an id unique
// to the run (Slurm's job id, torchrun's run id plus restart count, a timestamp).
//   - Writes are atomic: the value goes to a temporary file, then rename() puts it in place,
//     so a reader sees the old value or the whole new one, never a part.
//   - Read-modify-write (add, compare_set) and writes hold flock() on <run id>/.lock, which
//     Linux also honours across NFS clients (as a POSIX lock) on NFSv4 and NFSv3 with lockd.
//   - Waits poll the directory with backoff (1 ms doubling to 50 ms) until the timeout.
// Key encoding: [A-Za-z0-9_.-] stay as they are, every other byte becomes %XX, a leading '.'
// becomes %2E (names starting with '.' are the store's own), the empty key is "%". Names
// over 200 bytes keep their first 160 and end in "%~" + a 64-bit FNV-1a hash of the key.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0 {

namespace detail::file_store_names {

inline constexpr std::size_t max_name_bytes = 200;
inline constexpr std::size_t kept_name_bytes = 160;

COHORT_DECL std::string encode(std::string_view key);

}  // namespace detail::file_store_names

class file_store final : public store {
 public:
  // directory may be a std::filesystem::path (it converts).
  COHORT_DECL file_store(std::string directory, std::string run_id, int rank = -1);

  file_store(const file_store&) = delete;
  file_store& operator=(const file_store&) = delete;
  ~file_store() override {
    if (lock_fd_ >= 0) ::close(lock_fd_);
  }

  // directory/<encoded run id>: where this run's keys live.
  const std::string& path() const noexcept { return root_; }
  const std::string& run_id() const noexcept { return run_id_; }

  COHORT_DECL void set(std::string_view key, std::span<const std::uint8_t> value) override;
  using store::set;

  COHORT_DECL bytes get(std::string_view key, std::chrono::milliseconds timeout) override;
  using store::get;

  COHORT_DECL std::int64_t add(std::string_view key, std::int64_t delta) override;

  COHORT_DECL bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                std::span<const std::uint8_t> desired) override;

  bool check(std::span<const std::string> keys) override {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return exists(key); });
  }

  COHORT_DECL void wait(std::span<const std::string> keys, std::chrono::milliseconds limit) override;
  using store::wait;

  COHORT_DECL bool delete_key(std::string_view key) override;

  COHORT_DECL std::int64_t num_keys() override;

 private:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds first_pause{1};
  static constexpr std::chrono::milliseconds longest_pause{50};

  COHORT_DECL static void sleep_before_retry(std::chrono::milliseconds& pause, clock::time_point deadline);

  std::string file_of(std::string_view key) const { return root_ + '/' + detail::file_store_names::encode(key); }

  bool exists(std::string_view key) const { return ::access(file_of(key).c_str(), F_OK) == 0; }

  [[gnu::cold]] [[noreturn]] COHORT_DECL void fail(std::string_view operation, std::string_view key,
                                                   const std::string& what, int code) const;

  // The whole value, or nothing when the key is absent.
  COHORT_DECL std::optional<bytes> read(std::string_view operation, std::string_view key) const;

  COHORT_DECL void write_atomically(std::string_view operation, std::string_view key,
                                    std::span<const std::uint8_t> value);

  // Held while one read-modify-write runs: the mutex orders this handle's threads (flock
  // belongs to the open file, which they share), flock orders processes and other handles.
  class exclusive_lock {
   public:
    exclusive_lock(std::unique_lock<std::mutex> guard, int fd) : guard_(std::move(guard)), fd_(fd) {}
    exclusive_lock(const exclusive_lock&) = delete;
    exclusive_lock& operator=(const exclusive_lock&) = delete;
    ~exclusive_lock() { ::flock(fd_, LOCK_UN); }

   private:
    std::unique_lock<std::mutex> guard_;
    int fd_;
  };

  COHORT_DECL exclusive_lock exclusive(std::string_view operation, std::string_view key);

  std::string root_;
  std::string run_id_;
  std::mutex mutex_;
  int lock_fd_ = -1;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/file_store.ipp"
#endif
