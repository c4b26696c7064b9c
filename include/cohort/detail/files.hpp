#pragma once
// Paths, directories and small files through POSIX calls: what cohort's file code (the
// checkpoint, the stores, logging, the Gloo engine's /proc reads) needs of <filesystem> and
// <fstream>, which header-only every unit of the umbrella would otherwise parse, with the
// <locale>, <iomanip> and <codecvt> they bring (issue 44: with <random>, 21 MB of the
// umbrella's 555 MB of g++ memory). header:umbrella_compiles_no_filesystem keeps them out.

#include <dirent.h>
#include <unistd.h>

#include <string>
#include <string_view>
#include <system_error>

#include "cohort/config.hpp"

namespace cohort::inline v0::detail {

// `name` inside `directory`, as std::filesystem::path's operator/ joins them: an absolute
// `name` stands alone, an empty `directory` adds nothing, and one '/' separates the two.
inline std::string path_in(std::string_view directory, std::string_view name) {
  if (directory.empty() || name.starts_with('/')) return std::string(name);
  std::string joined(directory);
  if (!joined.ends_with('/')) joined += '/';
  joined += name;
  return joined;
}

// What follows the last '/' ("" for a path that ends in one, as std::filesystem's filename).
inline std::string_view file_name(std::string_view path) {
  const auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// The directory `path` names a file in: what precedes its file name, "." for a bare name.
inline std::string parent_directory(std::string_view path) {
  const auto directory = path.substr(0, path.size() - file_name(path).size());
  return directory.empty() ? std::string(".") : std::string(directory);
}

// The names in a directory, . and .. skipped, as a cursor: the stream is closed with it.
struct directory_stream {
  DIR* stream;
  explicit directory_stream(const std::string& path) : stream(::opendir(path.c_str())) {}
  directory_stream(const directory_stream&) = delete;
  directory_stream& operator=(const directory_stream&) = delete;
  ~directory_stream() {
    if (stream) ::closedir(stream);
  }
  // The next name, skipping . and ..; empty at the end.
  std::string next() {
    while (stream)
      if (const dirent* entry = ::readdir(stream)) {
        const std::string_view name = entry->d_name;
        if (name != "." && name != "..") return std::string(name);
      } else {
        break;
      }
    return {};
  }
};

// The first 4 KB of a regular file (a /proc entry, a lock's note), not through a symbolic
// link; empty when it cannot be read.
COHORT_DECL std::string read_small_file(const std::string& path);

// All of `path` (a symbolic link or a pipe as well) into `contents`: 0, or the errno.
COHORT_DECL int read_file(const std::string& path, std::string& contents);

// `path` and every missing directory above it (std::filesystem::create_directories): no error
// when it is a directory already; not_a_directory when it, or a part of it, is something else.
COHORT_DECL std::error_code make_directories(const std::string& path);

// `path` and, when it is a directory, all it holds, symbolic links removed and not followed
// (std::filesystem::remove_all); no error when nothing is there. Stops at the first failure.
COHORT_DECL std::error_code remove_tree(const std::string& path);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/files.ipp"
#endif
