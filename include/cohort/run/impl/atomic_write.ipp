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
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

#include "cohort/config.hpp"
#include "cohort/run/atomic_write.hpp"

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL void fsync_path(const std::filesystem::path& path, bool directory, int rank) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0)
    throw error(rank, "atomic_write", detail::text("cannot open ", path.string(), " to fsync: ", std::strerror(errno)));
  const int result = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL); the rename is still atomic there.
  if (result != 0 && !(directory && (saved == EINVAL || saved == EROFS)))
    throw error(rank, "atomic_write", detail::text("fsync of ", path.string(), " failed: ", std::strerror(saved)),
                "check free space and the file system's health");
}

COHORT_DECL std::filesystem::path temporary_sibling(const std::filesystem::path& target) {
  // Same directory (rename must not cross file systems), hidden, unique per process and thread.
  const auto unique = detail::text(std::to_string(::getpid()), "-",
                                   std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  return target.parent_path() / (detail::text(".", target.filename().string(), ".cohort-tmp-", unique));
}

}  // namespace detail
}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_DECL void atomic_write_file(const std::string& target_name, const std::function<void(std::ostream&)>& write,
                                   int rank) {
  const std::filesystem::path target(target_name);
  if (target.filename().empty())
    throw error(rank, "atomic_write", detail::text("target '", target.string(), "' names no file"));
  const auto temporary = detail::temporary_sibling(target);
  try {
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      if (!out)
        throw error(rank, "atomic_write",
                    detail::text("cannot create ", temporary.string(), ": ", std::strerror(errno)),
                    "check that the directory exists and is writable");
      write(out);
      out.flush();
      if (!out)
        throw error(rank, "atomic_write", detail::text("writing ", temporary.string(), " failed"),
                    "check free space on the target's file system");
    }
    detail::fsync_path(temporary, false, rank);
    std::error_code ec;
    std::filesystem::rename(temporary, target, ec);
    if (ec)
      throw error(rank, "atomic_write",
                  detail::text("renaming ", temporary.string(), " to ", target.string(), " failed: ", ec.message()));
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
  const auto directory = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  detail::fsync_path(directory, true, rank);
}

COHORT_DECL void atomic_write_file(const std::string& target, std::string_view contents, int rank) {
  atomic_write_file(
      target, [&](std::ostream& out) { out.write(contents.data(), static_cast<std::streamsize>(contents.size())); },
      rank);
}

}  // namespace cohort::inline v0
