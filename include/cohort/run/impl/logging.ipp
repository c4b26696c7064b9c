#pragma once
// cohort/run/logging.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
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
#include "cohort/run/logging.hpp"

namespace cohort::inline v0 {

COHORT_DECL rank_logger::rank_logger(int rank, int world, log_options options)
    : rank_(rank), world_(world), options_(std::move(options)) {
  prefix_ = detail::text("[rank ", std::to_string(rank_), "/", std::to_string(world_), "] ");
  if (!options_.directory.empty()) {
    (void)detail::make_directories(options_.directory);  // a failure is the fopen's, below
    file_path_ = detail::path_in(options_.directory, detail::text("rank-", std::to_string(rank_), ".log"));
    file_ = std::fopen(file_path_.c_str(), "ae");  // e: close-on-exec
    if (!file_)
      throw error(rank_, "rank_logger",
                  detail::text("cannot open log file ", file_path_, " for appending: ", std::strerror(errno)),
                  "check that the log directory is writable");
  }
}

COHORT_DECL rank_logger::~rank_logger() {
  if (file_) std::fclose(file_);
}

COHORT_DECL auto rank_logger::log(std::string_view message) -> void {
  std::string line = prefix_;
  line += message;
  if (prints_to_console()) {
    if (options_.console) {
      options_.console(line);
    } else {
      std::clog << (line + '\n') << std::flush;  // one write keeps ranks' lines whole
    }
  }
  if (file_) {
    line += '\n';
    std::lock_guard lock(file_mutex_);
    std::fwrite(line.data(), 1, line.size(), file_);
    std::fflush(file_);
  }
}

}  // namespace cohort::inline v0

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL std::string rank_prefix(int rank) { return detail::text("[rank ", std::to_string(rank), "] "); }

COHORT_DECL void print_lines(std::FILE* out, std::string_view prefix, const char* format, std::va_list args) noexcept {
  // va_copy and its va_end in this one function, whatever is thrown in between.
  std::va_list again;
  va_copy(again, args);
  std::string lines;
  try {
    char small[512];
    const int length = std::vsnprintf(small, sizeof small, format, args);
    std::string text;
    if (length > 0 && static_cast<std::size_t>(length) < sizeof small) {
      text.assign(small, static_cast<std::size_t>(length));
    } else if (length > 0) {
      text.resize(static_cast<std::size_t>(length) + 1);
      std::vsnprintf(text.data(), text.size(), format, again);
      text.resize(static_cast<std::size_t>(length));
    }
    if (!text.empty() && text.back() != '\n') text += '\n';  // every call ends its line
    if (prefix.empty()) {
      lines = std::move(text);
    } else {
      lines.reserve(text.size() + prefix.size() * 4);
      for (std::size_t begin = 0; begin < text.size();) {
        const std::size_t end = text.find('\n', begin) + 1;  // the text ends with '\n'
        lines += prefix;
        lines.append(text, begin, end - begin);
        begin = end;
      }
    }
  } catch (...) {
    lines.clear();  // out of memory: print nothing rather than end the run
  }
  va_end(again);
  if (lines.empty()) return;
  std::fwrite(lines.data(), 1, lines.size(), out);
  std::fflush(out);
}

}  // namespace detail
}  // namespace cohort::inline v0
