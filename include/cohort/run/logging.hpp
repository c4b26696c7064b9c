#pragma once
// Rank-aware logging: lines that say which rank wrote them, on the main process only or on
// every rank, and printf on stdout without interleaving the ranks' lines.
//
//   cohort::rank_logger log{pg};  log("loss ", loss);      "[rank 0/8] loss 0.25", main only
//   cohort::main_printf(pg, "loss %.4f\n", loss);         printf on stdout, main only
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

#include <fcntl.h>
#include <unistd.h>

#include "cohort/config.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

#include "cohort/run/guards.hpp"

namespace cohort::inline v0 {

// ---- rank-aware logging ---------------------------------------------------------------------

struct log_options {
  // Print from every rank, not only rank 0.
  bool all_ranks = false;
  // Non-empty: every rank (main or not) also appends its lines to directory/rank-<r>.log.
  // (A std::filesystem::path converts; paths are strings here so that this header does not
  // cost every trainer TU <filesystem>.)
  std::string directory = {};
  // Where console lines go, one call per whole line (prefix included, no newline).
  // Empty: std::clog.
  std::function<void(std::string_view line)> console = {};
};

// "[rank r/N] message" lines. Cheap to copy around by reference; not copyable itself (it may
// own a file).
class rank_logger {
 public:
  COHORT_DECL rank_logger(int rank, int world, log_options options = {});

  template <rank_group G>
  explicit rank_logger(const G& group, log_options options = {})
      : rank_logger(static_cast<int>(group.rank()), static_cast<int>(group.world_size()), std::move(options)) {}

  rank_logger(const rank_logger&) = delete;
  rank_logger& operator=(const rank_logger&) = delete;
  COHORT_DECL ~rank_logger();

  const std::string& prefix() const noexcept { return prefix_; }
  // directory/rank-<r>.log, or empty without a directory.
  const std::string& file() const noexcept { return file_path_; }
  bool prints_to_console() const noexcept { return options_.all_ranks || rank_ == 0; }

  COHORT_DECL void log(std::string_view message);

  // log("step ", step, " loss ", loss): the pieces streamed into one line.
  template <class... Parts>
  void operator()(const Parts&... parts) {
    std::ostringstream text;
    (text << ... << parts);
    log(text.str());
  }

 private:
  int rank_;
  int world_;
  log_options options_;
  std::string prefix_;
  std::string file_path_;
  std::FILE* file_ = nullptr;
  std::mutex file_mutex_;
};

// ---- printf on stdout ---------------------------------------------------------------------------
//
//   cohort::main_printf(pg, "step %d loss %.4f\n", step, loss);   rank 0 only
//   cohort::printf_on(pg, 3, "shard %zu ready\n", shard);         rank 3 only
//   cohort::rank_printf(pg, "loaded %d files\n", n);              every rank: "[rank 1] loaded 8 files"
//
// For trainers that print with printf: the lines go to stdout, formatted as printf formats
// them (the compiler checks the arguments against the format, as for printf). The first
// argument is a group (rank()) or a launch_env (.rank); no communication.
//
// Their lines and the trainer's own printf lines stay in the order the program printed
// them: both go through the same FILE* stdout, so they sit in one buffer in call order
// (writing to file descriptor 1 directly would overtake the trainer's lines still buffered
// there, which is the whole buffer when stdout is a pipe or a file). Each call is one
// fwrite of whole lines (stdio locks the FILE for it, so another thread's printf cannot land
// inside it), completed with a newline when the text lacks one, then fflush: under a
// launcher that merges the ranks' pipes, each rank's lines arrive whole and promptly.
// rank_printf prefixes every line of the text.

template <class G>
concept rank_source = rank_group<G> || requires(const G& env) {
  { env.rank } -> std::convertible_to<int>;
  { env.world_size } -> std::convertible_to<int>;
};

namespace detail {
template <rank_source G>
int rank_of(const G& who) {
  if constexpr (rank_group<G>)
    return static_cast<int>(who.rank());
  else
    return static_cast<int>(who.rank);
}
// Formats, prefixes each line with `prefix`, ends the text with a newline and writes it
// with one fwrite, then fflush. Never throws (printing must not end a training run).
COHORT_DECL void print_lines(std::FILE* out, std::string_view prefix, const char* format, std::va_list args) noexcept;
COHORT_DECL std::string rank_prefix(int rank);
}  // namespace detail

template <rank_source G>
[[gnu::format(printf, 2, 3)]] void main_printf(const G& who, const char* format, ...) {
  if (detail::rank_of(who) != 0) return;
  std::va_list args;
  va_start(args, format);
  detail::print_lines(stdout, {}, format, args);
  va_end(args);
}

template <rank_source G>
[[gnu::format(printf, 3, 4)]] void printf_on(const G& who, int printing_rank, const char* format, ...) {
  if (detail::rank_of(who) != printing_rank) return;
  std::va_list args;
  va_start(args, format);
  detail::print_lines(stdout, {}, format, args);
  va_end(args);
}

template <rank_source G>
[[gnu::format(printf, 2, 3)]] void rank_printf(const G& who, const char* format, ...) {
  const std::string prefix = detail::rank_prefix(detail::rank_of(who));
  std::va_list args;
  va_start(args, format);
  detail::print_lines(stdout, prefix, format, args);
  va_end(args);
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/run/impl/logging.ipp"
#endif
