#pragma once
// cohort/detail/files.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>

#include "cohort/config.hpp"
#include "cohort/detail/files.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL std::string read_small_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return {};
  struct stat status {};
  char buffer[4096];
  const ssize_t got = ::fstat(fd, &status) == 0 && S_ISREG(status.st_mode) ? ::read(fd, buffer, sizeof buffer) : -1;
  ::close(fd);
  return got > 0 ? std::string(buffer, static_cast<std::size_t>(got)) : std::string();
}

COHORT_DECL int read_file(const std::string& path, std::string& contents) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  contents.clear();
  char buffer[4096];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int code = got < 0 ? errno : 0;
      ::close(fd);
      return code;
    }
    contents.append(buffer, static_cast<std::size_t>(got));
  }
}

COHORT_DECL std::error_code make_directories(const std::string& path) {
  if (path.empty()) return std::make_error_code(std::errc::invalid_argument);
  // Each prefix that ends before a '/', then the whole path: a part that exists is checked to
  // be a directory (through a symbolic link, as mkdir -p follows one).
  for (std::size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string part = path.substr(0, end);
    if (::mkdir(part.c_str(), 0777) != 0) {
      const int code = errno;
      struct stat status {};
      if (code != EEXIST || ::stat(part.c_str(), &status) != 0) return {code, std::generic_category()};
      if (!S_ISDIR(status.st_mode)) return std::make_error_code(std::errc::not_a_directory);
    }
    if (end == std::string::npos) return {};
  }
}

COHORT_DECL std::error_code remove_tree(const std::string& path) {
  struct stat status {};
  if (::lstat(path.c_str(), &status) != 0)
    return errno == ENOENT ? std::error_code() : std::error_code(errno, std::generic_category());
  if (S_ISDIR(status.st_mode)) {
    directory_stream entries(path);
    if (entries.stream == nullptr) return {errno, std::generic_category()};
    for (std::string name = entries.next(); !name.empty(); name = entries.next())
      if (const auto failure = remove_tree(path_in(path, name))) return failure;
    if (::rmdir(path.c_str()) != 0) return {errno, std::generic_category()};
    return {};
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return {errno, std::generic_category()};
  return {};
}

}  // namespace cohort::inline v0::detail
