#pragma once
// cohort/run/atomic_write.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <concepts>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include "cohort/detail/files.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

#include "cohort/config.hpp"
#include "cohort/run/atomic_write.hpp"

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL void fsync_path(const std::string& path, bool directory, int rank) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0)
    throw error(rank, "atomic_write", detail::text("cannot open ", path, " to fsync: ", std::strerror(errno)));
  const int result = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL); the rename is still atomic there.
  if (result != 0 && !(directory && (saved == EINVAL || saved == EROFS)))
    throw error(rank, "atomic_write", detail::text("fsync of ", path, " failed: ", std::strerror(saved)),
                "check free space and the file system's health");
}

// The stream buffer of a file this process creates: what std::ofstream would be, without
// <fstream> in every header-only unit. A write that fails makes the stream bad (errno says why);
// the descriptor is closed with it.
class created_file_buffer final : public std::streambuf {
 public:
  explicit created_file_buffer(const std::string& path)
      : fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666)) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  created_file_buffer(const created_file_buffer&) = delete;
  created_file_buffer& operator=(const created_file_buffer&) = delete;
  ~created_file_buffer() override {
    if (fd_ >= 0) ::close(fd_);
  }
  bool is_open() const noexcept { return fd_ >= 0; }

 protected:
  int_type overflow(int_type next) override {
    if (!drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(next, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(next);
      pbump(1);
    }
    return traits_type::not_eof(next);
  }
  int sync() override { return drain() ? 0 : -1; }

 private:
  bool drain() {
    for (const char* from = pbase(); from < pptr();) {
      const ssize_t wrote = ::write(fd_, from, static_cast<std::size_t>(pptr() - from));
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) return false;
      from += wrote;
    }
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return true;
  }

  int fd_;
  std::array<char, 8192> buffer_{};
};

COHORT_DECL std::string temporary_sibling(const std::string& target) {
  // Same directory (rename must not cross file systems), hidden, unique per process and thread.
  const auto unique = detail::text(std::to_string(::getpid()), "-",
                                   std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  return path_in(parent_directory(target), detail::text(".", file_name(target), ".cohort-tmp-", unique));
}

}  // namespace detail
}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_DECL void atomic_write_file(const std::string& target_name, const std::function<void(std::ostream&)>& write,
                                   int rank) {
  const std::string& target = target_name;
  if (detail::file_name(target).empty())
    throw error(rank, "atomic_write", detail::text("target '", target, "' names no file"));
  const auto temporary = detail::temporary_sibling(target);
  try {
    {
      detail::created_file_buffer file(temporary);
      if (!file.is_open())
        throw error(rank, "atomic_write", detail::text("cannot create ", temporary, ": ", std::strerror(errno)),
                    "check that the directory exists and is writable");
      std::ostream out(&file);
      write(out);
      out.flush();
      if (!out)
        throw error(rank, "atomic_write", detail::text("writing ", temporary, " failed"),
                    "check free space on the target's file system");
    }
    detail::fsync_path(temporary, false, rank);
    if (::rename(temporary.c_str(), target.c_str()) != 0)
      throw error(rank, "atomic_write",
                  detail::text("renaming ", temporary, " to ", target, " failed: ", std::strerror(errno)));
  } catch (...) {
    ::unlink(temporary.c_str());
    throw;
  }
  detail::fsync_path(detail::parent_directory(target), true, rank);
}

COHORT_DECL void atomic_write_file(const std::string& target, std::string_view contents, int rank) {
  atomic_write_file(
      target, [&](std::ostream& out) { out.write(contents.data(), static_cast<std::streamsize>(contents.size())); },
      rank);
}

}  // namespace cohort::inline v0
