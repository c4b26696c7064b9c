#pragma once
// The sharded checkpoint's file format (sharded_parameters::save_sharded / load_sharded): one
// file per rank, shard-<rank>-of-<world>.bin, a header (world, unit layout, master dtype,
// optimizer and its step count) followed, unit by unit, by the master shard and each
// optimizer state tensor. Independent of the backend and the element type.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <istream>
#include <optional>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0::detail {

inline std::string shard_file_name(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".bin";
}

struct saved_unit {
  bool replicated = false;
  std::uint64_t elements = 0, padded = 0, shard = 0;
  std::vector<std::size_t> sizes;
};
struct checkpoint_header {
  static constexpr char magic[8] = {'C', 'O', 'H', 'S', 'H', 'R', 'D', '1'};
  static constexpr std::uint32_t version = 1;
  std::uint32_t world = 0, rank = 0, type = 0, states = 0;
  std::string optimizer;
  std::uint64_t steps = 0;
  std::vector<saved_unit> units;
  std::uint64_t data_offset = 0;

  template <class V>
  static void put(std::ostream& out, V value) {
    out.write(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void write(std::ostream& out) const;
  static checkpoint_header read(std::istream& in, const std::filesystem::path& path, int reader);
};

// The world size the checkpoint in `directory` was written with (from shard-0-of-<world>.bin).
std::uint32_t find_checkpoint_world(const std::filesystem::path& directory, int rank);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/sharded_checkpoint.ipp"
#endif
