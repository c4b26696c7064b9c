#pragma once
// The sharded checkpoint's file format (sharded_parameters::save_sharded / load_sharded): one
// file per rank, shard-<rank>-of-<world>.bin, a header (world, unit layout, master dtype,
// optimizer and its step count) followed, unit by unit, by the master shard and each
// optimizer state tensor. Independent of the backend and the element type.

#include <cstdint>
#include <cstring>
#include <istream>
#include <memory>
#include <ostream>
#include <string>
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
  static checkpoint_header read(std::istream& in, const std::string& path, int reader);
};

// The world size the checkpoint in `directory` was written with (from shard-0-of-<world>.bin).
std::uint32_t find_checkpoint_world(const std::string& directory, int rank);

// directory/name. Paths are strings in these declarations so that <cohort/sharded.hpp> does
// not cost every trainer TU <filesystem> and <fstream>; the definitions use them.
std::string join_path(const std::string& directory, const std::string& name);

// Creates directory and its parents; a failure is a cohort::error naming rank.
void create_checkpoint_directory(const std::string& directory, int rank);

// Every shard file of the checkpoint in `directory`, open, with its header read.
class checkpoint_reader {
 public:
  checkpoint_reader(const std::string& directory, int rank);
  checkpoint_reader(const checkpoint_reader&) = delete;
  checkpoint_reader& operator=(const checkpoint_reader&) = delete;
  ~checkpoint_reader();

  // One header per file of the old world, in rank order.
  const std::vector<checkpoint_header>& headers() const noexcept { return headers_; }

  // `bytes` bytes at `offset` of file `source` into `into`; a short read is a cohort::error
  // naming the file and the unit.
  void read(std::uint32_t source, std::uint64_t offset, void* into, std::size_t bytes, std::size_t unit);

 private:
  struct open_files;
  int rank_;
  std::vector<checkpoint_header> headers_;
  std::unique_ptr<open_files> files_;
};

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/impl/sharded_checkpoint.ipp"
#endif
