#pragma once
// cohort/rendezvous/file_store.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>
#include "cohort/detail/files.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/store.hpp"

#include "cohort/config.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/rendezvous/file_store.hpp"

namespace cohort::inline v0 {

COHORT_DECL file_store::file_store(std::string directory, std::string run_id, int rank) : run_id_(std::move(run_id)) {
  set_rank(rank);
  if (run_id_.empty())
    throw error(rank, "file_store", detail::text("empty run id for store directory ", directory),
                "pass an id unique to this run (e.g. the Slurm job id), so files of an "
                "earlier run are never read");
  root_ = detail::path_in(directory, detail::file_store_names::encode(run_id_));
  if (const auto failure = detail::make_directories(root_))
    throw error(rank, "file_store", detail::text("cannot create store directory ", root_, ": ", failure.message()),
                "the directory must be on a filesystem every rank can write");
}

COHORT_DECL auto file_store::set(std::string_view key, std::span<const std::uint8_t> value) -> void {
  const auto lock = exclusive("set", key);
  write_atomically("set", key, value);
}

COHORT_DECL auto file_store::get(std::string_view key, std::chrono::milliseconds timeout) -> bytes {
  const std::string name(key);
  const auto deadline = clock::now() + timeout;
  auto pause = first_pause;
  for (;;) {
    if (auto value = read("get", key)) return std::move(*value);
    if (clock::now() >= deadline) throw_timeout("get", std::span<const std::string>(&name, 1), timeout);
    sleep_before_retry(pause, deadline);
  }
}

COHORT_DECL auto file_store::add(std::string_view key, std::int64_t delta) -> std::int64_t {
  const auto lock = exclusive("add", key);
  std::int64_t value = 0;
  if (const auto current = read("add", key)) {
    const auto* first = reinterpret_cast<const char*>(current->data());
    const auto* last = first + current->size();
    const auto [end, status] = std::from_chars(first, last, value);
    if (status != std::errc() || end != last)
      throw error(rank(), "store.add",
                  detail::text("key '", key, "' holds \"", to_string(*current), "\", not a decimal integer"),
                  "use add() only on keys that only add() writes");
  }
  if (__builtin_add_overflow(value, delta, &value))
    throw error(rank(), "store.add", detail::text("key '", key, "' overflows int64"));
  write_atomically("add", key, to_bytes(std::to_string(value)));
  return value;
}

COHORT_DECL auto file_store::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                         std::span<const std::uint8_t> desired) -> bytes {
  const auto lock = exclusive("compare_set", key);
  auto current = read("compare_set", key);
  if (!current) {
    if (!expected.empty()) return bytes(expected.begin(), expected.end());
  } else if (!std::equal(current->begin(), current->end(), expected.begin(), expected.end())) {
    return std::move(*current);
  }
  write_atomically("compare_set", key, desired);
  return bytes(desired.begin(), desired.end());
}

COHORT_DECL auto file_store::wait(std::span<const std::string> keys, std::chrono::milliseconds limit) -> void {
  const auto deadline = clock::now() + limit;
  auto pause = first_pause;
  for (;;) {
    std::vector<std::string> missing;
    for (const auto& key : keys)
      if (!exists(key)) missing.push_back(key);
    if (missing.empty()) return;
    if (clock::now() >= deadline) throw_timeout("wait", missing, limit);
    sleep_before_retry(pause, deadline);
  }
}

COHORT_DECL auto file_store::delete_key(std::string_view key) -> bool {
  const auto lock = exclusive("delete_key", key);
  return ::unlink(file_of(key).c_str()) == 0;
}

COHORT_DECL auto file_store::num_keys() -> std::int64_t {
  std::int64_t count = 0;
  detail::directory_stream entries(root_);
  for (std::string name = entries.next(); !name.empty(); name = entries.next())
    if (name.front() != '.') ++count;
  return count;
}

COHORT_DECL auto file_store::sleep_before_retry(std::chrono::milliseconds& pause, clock::time_point deadline) -> void {
  const auto left = deadline - clock::now();
  std::this_thread::sleep_for(std::min<clock::duration>(pause, std::max(left, clock::duration::zero())));
  pause = std::min(pause * 2, longest_pause);
}

COHORT_DECL auto file_store::fail(std::string_view operation, std::string_view key, const std::string& what,
                                  int code) const -> void {
  throw error(rank(), detail::text("store.", operation),
              detail::text(what, " for key '", key, "' in ", root_, ": ", std::system_category().message(code)),
              "check that the store directory is writable and not full");
}

COHORT_DECL auto file_store::read(std::string_view operation, std::string_view key) const -> std::optional<bytes> {
  const int fd = ::open(file_of(key).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    fail(operation, key, "cannot open", errno);
  }
  bytes value;
  std::uint8_t chunk[64 * 1024];
  for (;;) {
    const ssize_t got = ::read(fd, chunk, sizeof(chunk));
    if (got > 0) {
      value.insert(value.end(), chunk, chunk + got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    const int code = errno;
    ::close(fd);
    if (got < 0) fail(operation, key, "cannot read", code);
    return value;
  }
}

COHORT_DECL auto file_store::write_atomically(std::string_view operation, std::string_view key,
                                              std::span<const std::uint8_t> value) -> void {
  static std::atomic<std::uint64_t> sequence{0};
  const std::string target = file_of(key);
  const std::string temporary =
      detail::path_in(root_, detail::text(".tmp-", std::to_string(::getpid()), "-", std::to_string(++sequence)));
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail(operation, key, detail::text("cannot create ", detail::file_name(temporary)), errno);
  std::size_t done = 0;
  while (done < value.size()) {
    const ssize_t wrote = ::write(fd, value.data() + done, value.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) {
      const int code = errno;
      ::close(fd);
      ::unlink(temporary.c_str());
      fail(operation, key, "cannot write", code);
    }
    done += static_cast<std::size_t>(wrote);
  }
  if (::close(fd) != 0 || ::rename(temporary.c_str(), target.c_str()) != 0) {
    const int code = errno;
    ::unlink(temporary.c_str());
    fail(operation, key, "cannot publish", code);
  }
}

COHORT_DECL auto file_store::exclusive(std::string_view operation, std::string_view key) -> exclusive_lock {
  std::unique_lock guard(mutex_);
  if (lock_fd_ < 0) {
    lock_fd_ = ::open((detail::text(root_, "/.lock")).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd_ < 0) fail(operation, key, "cannot open the lock file", errno);
  }
  const auto deadline = clock::now() + timeout();
  auto pause = first_pause;
  while (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) fail(operation, key, "cannot lock", errno);
    if (clock::now() >= deadline)
      throw timeout_error(rank(), detail::text("store.", operation),
                          detail::text("waited ", detail::format_duration(timeout()), " for the lock ",
                                       (detail::text(root_, "/.lock")), " to update key '", key, "'"),
                          "another process holds the store's lock; it may be stuck");
    sleep_before_retry(pause, deadline);
  }
  return exclusive_lock(std::move(guard), lock_fd_);
}

}  // namespace cohort::inline v0

namespace cohort::inline v0 {
namespace detail::file_store_names {

COHORT_DECL std::string encode(std::string_view key) {
  if (key.empty()) return "%";
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string name;
  name.reserve(key.size());
  for (std::size_t i = 0; i < key.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                       c == '-' || (c == '.' && i > 0);
    if (plain) {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += hex[c >> 4];
      name += hex[c & 15];
    }
  }
  if (name.size() > max_name_bytes) {
    std::size_t keep = kept_name_bytes;
    // Never cut an escape in half.
    if (name[keep - 1] == '%')
      keep -= 1;
    else if (name[keep - 2] == '%')
      keep -= 2;
    char digits[17] = {};
    detail::fnv1a fingerprint;
    fingerprint.mix(key);
    const std::uint64_t hash = fingerprint.value();
    for (int i = 0; i < 16; ++i) digits[i] = hex[(hash >> (60 - 4 * i)) & 15];
    name = detail::text(name.substr(0, keep), "%~", digits);
  }
  return name;
}

}  // namespace detail::file_store_names
}  // namespace cohort::inline v0
