#pragma once
// Atomic writes: a file that readers see whole or not at all, even across a crash, and the
// collective that has the main process write it while the others wait.
//
//   cohort::atomic_write_on_main(pg, "ckpt.bin", bytes);  temp file + fsync + rename on rank 0;
//                                                         the others wait until it is complete
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

// ---- atomic writes --------------------------------------------------------------------------------

// Writes target atomically: readers see the old file (or none) until the new one is complete
// and durable. The data goes to a temporary file in the same directory, which is flushed,
// fsync'ed and renamed over target; then the directory is fsync'ed so the rename survives a
// crash. `write` fills the stream; if it throws, target is untouched and the temporary removed.
// target may be a std::filesystem::path (it converts).
COHORT_DECL void atomic_write_file(const std::string& target, const std::function<void(std::ostream&)>& write,
                                   int rank = -1);

COHORT_DECL void atomic_write_file(const std::string& target, std::string_view contents, int rank = -1);

// Collective: rank 0 writes target atomically, the others wait until it is in place, so no
// rank reads a half-written checkpoint. If rank 0 fails, it rethrows, and on host groups
// (Gloo) the others throw a cohort::error naming the failure instead of reading a stale file.
template <barrier_group G>
void atomic_write_on_main(G& group, const std::string& target, const std::function<void(std::ostream&)>& write) {
  const int rank = static_cast<int>(group.rank());
  auto write_it = [&] { atomic_write_file(target, write, rank); };
  detail::leader_first(group, rank == 0, write_it, "atomic_write_on_main", true, false);
}

template <barrier_group G>
void atomic_write_on_main(G& group, const std::string& target, std::string_view contents) {
  const int rank = static_cast<int>(group.rank());
  auto write_it = [&] { atomic_write_file(target, contents, rank); };
  detail::leader_first(group, rank == 0, write_it, "atomic_write_on_main", true, false);
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/run/impl/atomic_write.ipp"
#endif
