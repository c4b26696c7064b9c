#pragma once
// What the checkpoint tests share: a scratch directory, a flipped bit in a file, every rank's
// error from loading a checkpoint (real ranks: threads with Gloo over loopback), and what
// cohort-ckpt says.

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cohort/parallel/checkpoint.hpp>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace cohort_test {

// What cohort-ckpt wrote (stdout and stderr) and its exit status, where the tool was built
// (COHORT_CKPT_TOOL, bench/CMakeLists.txt); nullopt elsewhere.
inline std::optional<std::pair<std::string, int>> run_ckpt_tool(const std::string& arguments) {
#if defined(COHORT_CKPT_TOOL)
  const std::string command = std::string(COHORT_CKPT_TOOL) + " " + arguments + " 2>&1";
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command);
  std::string text;
  char buffer[4096];
  for (std::size_t got; (got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) text.append(buffer, got);
  const int status = ::pclose(pipe);
  return std::pair{text, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
#else
  (void)arguments;
  return std::nullopt;
#endif
}

inline std::filesystem::path checkpoint_scratch(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("cohort-test-checkpoint-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Flips bit `bit` of the byte at `offset` of `file`, in place; flipping it again restores it.
inline void flip_bit(const std::filesystem::path& file, std::uint64_t offset, int bit) {
  const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  unsigned char byte = 0;
  if (fd < 0 || ::pread(fd, &byte, 1, static_cast<off_t>(offset)) != 1)
    throw rank_failure("cannot read byte " + std::to_string(offset) + " of " + file.string());
  byte = static_cast<unsigned char>(byte ^ (1u << bit));
  const bool wrote = ::pwrite(fd, &byte, 1, static_cast<off_t>(offset)) == 1;
  ::close(fd);
  if (!wrote) throw rank_failure("cannot write byte " + std::to_string(offset) + " of " + file.string());
}

// Every rank's error text from loading `checkpoint` into a zero2 state of `regions` (empty: it
// loaded). `read_in_all`, where given: the bytes the ranks read, added up.
inline std::vector<std::string> load_errors(const std::filesystem::path& checkpoint, int world,
                                            const std::vector<cohort::region>& regions,
                                            std::uint64_t* read_in_all = nullptr) {
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::uint64_t> read(errors.size());
  auto store = std::make_shared<cohort::memory_store>();
  run_ranks(world, [&](int rank) {
    auto pg = make_gloo_group(store, rank, world);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = cohort::strategy::zero2});
    try {
      read[static_cast<std::size_t>(rank)] = cohort::load_checkpoint(state, checkpoint.string()).bytes_read;
    } catch (const cohort::error& failure) {
      errors[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  if (read_in_all) *read_in_all = std::accumulate(read.begin(), read.end(), std::uint64_t{0});
  return errors;
}

}  // namespace cohort_test
