#pragma once
// cohort/detail/sharded_checkpoint.hpp's definitions: inline there when header-only, compiled once by
// <cohort/impl/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <optional>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>
#include "cohort/error.hpp"

#include "cohort/detail/config.hpp"
#include "cohort/detail/sharded_checkpoint.hpp"

namespace cohort::inline v0::detail {

COHORT_DECL std::uint32_t find_checkpoint_world(const std::string& directory, int rank) {
  std::optional<std::uint32_t> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string prefix = "shard-0-of-";
    if (name.rfind(prefix, 0) != 0 || name.size() < prefix.size() + 5 || name.substr(name.size() - 4) != ".bin")
      continue;
    const auto world =
        static_cast<std::uint32_t>(std::stoul(name.substr(prefix.size(), name.size() - prefix.size() - 4)));
    if (found && *found != world)
      throw error(rank, "sharded_parameters.load_sharded",
                  directory + " holds checkpoints of world " + std::to_string(*found) + " and " + std::to_string(world),
                  "keep one sharded checkpoint per directory");
    found = world;
  }
  if (!found)
    throw error(rank, "sharded_parameters.load_sharded",
                "no shard-0-of-<world>.bin in " + directory + (ec ? " (" + ec.message() + ")" : ""),
                "pass the directory save_sharded wrote");
  return *found;
}

COHORT_DECL std::string join_path(const std::string& directory, const std::string& name) {
  return (std::filesystem::path(directory) / name).string();
}

COHORT_DECL void create_checkpoint_directory(const std::string& directory, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw error(rank, "sharded_parameters.save_sharded", "cannot create " + directory + ": " + ec.message(),
                "the checkpoint directory must be writable by the ranks that save");
}

struct checkpoint_reader::open_files {
  std::vector<std::ifstream> files;
};

COHORT_DECL checkpoint_reader::checkpoint_reader(const std::string& directory, int rank)
    : rank_(rank), files_(std::make_unique<open_files>()) {
  const std::uint32_t old_world = find_checkpoint_world(directory, rank);
  headers_.resize(old_world);
  files_->files.resize(old_world);
  for (std::uint32_t k = 0; k < old_world; ++k) {
    const auto path = join_path(directory, shard_file_name(static_cast<int>(k), static_cast<int>(old_world)));
    auto& file = files_->files[k];
    file.open(path, std::ios::binary);
    if (!file)
      throw error(rank, "sharded_parameters.load_sharded", "cannot open " + path,
                  "every shard file of the checkpoint must be readable by every rank (shared file system)");
    headers_[k] = checkpoint_header::read(file, path, rank);
  }
}

COHORT_DECL checkpoint_reader::~checkpoint_reader() = default;

COHORT_DECL void checkpoint_reader::read(std::uint32_t source, std::uint64_t offset, void* into, std::size_t bytes,
                                         std::size_t unit) {
  auto& in = files_->files.at(source);
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(static_cast<char*>(into), static_cast<std::streamsize>(bytes));
  if (!in)
    throw error(rank_, "sharded_parameters.load_sharded",
                "short read in shard file " + std::to_string(source) + " (unit " + std::to_string(unit) + ")",
                "the checkpoint is truncated or was written by another version");
}

}  // namespace cohort::inline v0::detail

namespace cohort::inline v0 {

COHORT_DECL auto detail::checkpoint_header::write(std::ostream& out) const -> void {
  out.write(magic, sizeof magic);
  put(out, version);
  put(out, world);
  put(out, rank);
  put(out, type);
  put(out, static_cast<std::uint32_t>(optimizer.size()));
  out.write(optimizer.data(), static_cast<std::streamsize>(optimizer.size()));
  put(out, steps);
  put(out, states);
  put(out, static_cast<std::uint64_t>(units.size()));
  for (const auto& u : units) {
    put(out, static_cast<std::uint8_t>(u.replicated));
    put(out, u.elements);
    put(out, u.padded);
    put(out, u.shard);
    put(out, static_cast<std::uint64_t>(u.sizes.size()));
    for (auto s : u.sizes) put(out, static_cast<std::uint64_t>(s));
  }
}

COHORT_DECL auto detail::checkpoint_header::read(std::istream& in, const std::string& path, int reader)
    -> checkpoint_header {
  auto bad = [&](const std::string& what) {
    return error(reader, "sharded_parameters.load_sharded", path + ": " + what,
                 "is this a cohort sharded checkpoint, complete and from this version?");
  };
  auto get = [&](auto& value) {
    in.read(reinterpret_cast<char*>(&value), sizeof value);
    if (!in) throw bad("truncated header");
  };
  char seen[8];
  in.read(seen, sizeof seen);
  if (!in || std::memcmp(seen, magic, sizeof magic) != 0) throw bad("bad magic");
  checkpoint_header h;
  std::uint32_t file_version = 0, name_length = 0;
  get(file_version);
  if (file_version != version) throw bad("version " + std::to_string(file_version));
  get(h.world);
  get(h.rank);
  get(h.type);
  get(name_length);
  if (name_length > 256) throw bad("optimizer name of " + std::to_string(name_length) + " bytes");
  h.optimizer.resize(name_length);
  in.read(h.optimizer.data(), name_length);
  get(h.steps);
  get(h.states);
  std::uint64_t count = 0;
  get(count);
  if (count > (1u << 24)) throw bad(std::to_string(count) + " units");
  for (std::uint64_t i = 0; i < count; ++i) {
    saved_unit u;
    std::uint8_t replicated = 0;
    std::uint64_t parameters = 0;
    get(replicated);
    u.replicated = replicated != 0;
    get(u.elements);
    get(u.padded);
    get(u.shard);
    get(parameters);
    if (parameters > (1u << 24)) throw bad(std::to_string(parameters) + " parameters in a unit");
    for (std::uint64_t p = 0; p < parameters; ++p) {
      std::uint64_t size = 0;
      get(size);
      u.sizes.push_back(static_cast<std::size_t>(size));
    }
    h.units.push_back(std::move(u));
  }
  h.data_offset = static_cast<std::uint64_t>(in.tellg());
  return h;
}

}  // namespace cohort::inline v0
