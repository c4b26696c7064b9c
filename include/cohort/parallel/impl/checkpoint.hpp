#pragma once
// cohort/parallel/checkpoint.hpp's templates, always included.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/process_group.hpp"

namespace cohort::inline v0 {
namespace detail {

// Runs `attempt` on this rank and lets every rank know whether any rank failed: the failing
// rank rethrows its own error, the others throw one naming it, so that no rank waits in a
// later collective for one that gave up. `attempt` may set `code` (an errno, a file) for the
// others' message, which `describe` words.
template <backend B>
void checkpoint_together(process_group<B>& group, const std::string& operation,
                         const std::function<void(std::int64_t& code)>& attempt,
                         const std::function<std::string(int rank, std::int64_t code)>& describe,
                         const std::string& hint) {
  std::exception_ptr failure;
  std::int64_t row[2] = {0, 0};
  try {
    attempt(row[1]);
  } catch (...) {
    failure = std::current_exception();
    row[0] = 1;
  }
  const auto all = all_gather_values(group, std::span<const std::int64_t>(row, 2));
  if (failure) std::rethrow_exception(failure);
  for (int r = 0; r < group.size(); ++r)
    if (all[2 * static_cast<std::size_t>(r)] != 0)
      throw error(group.rank(), operation, describe(r, all[2 * static_cast<std::size_t>(r) + 1]), hint);
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline std::string checkpoint_region_name(const std::vector<region>& regions, std::size_t r) {
  return regions[r].name.empty() ? "#" + std::to_string(r) : regions[r].name;
}

}  // namespace detail

template <backend B, element P, element G>
checkpoint_info save_checkpoint(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                                const checkpoint_options& options) {
  using master = typename training_state<B, P, G>::master_type;
  const auto started = std::chrono::steady_clock::now();
  auto& group = state.group();
  auto& engine = group.backend();
  const int rank = group.rank(), world = group.size();
  const auto tensors = state.checkpoint_tensors();
  const std::size_t block_bytes = std::max<std::size_t>(options.block_bytes, 64);
  const std::string operation = "save_checkpoint";

  // Rank 0 clears what interrupted saves left and makes the staging directory; its name
  // (random, so two jobs or a restarted one never share it) reaches every rank.
  std::int64_t nonce = 0;
  if (rank == 0) nonce = static_cast<std::int64_t>(std::random_device{}() & 0x7fffffffu) << 20 | (step & 0xfffff);
  nonce = all_gather_values(group, std::span<const std::int64_t>(&nonce, 1))[0];
  const std::string staging = detail::checkpoint_staging_path(directory, step, static_cast<std::uint64_t>(nonce));
  detail::checkpoint_together(
      group, operation,
      [&](std::int64_t&) {
        if (rank == 0) detail::begin_checkpoint(directory, staging, rank);
      },
      [&](int, std::int64_t) { return "rank 0 could not prepare " + staging; },
      "the checkpoint directory must be writable by every rank (a shared file system)");

  // This rank's file: each tensor's elements of its segments, staged on the host (device
  // memory comes through the backend's copy), then written and fsynced.
  const auto segments = state.checkpoint_segments(rank);
  std::size_t owned = 0;
  for (const auto& s : segments) owned += s.count;
  std::vector<master> staged(owned * tensors.size());
  for (std::size_t t = 0, at = 0; t < tensors.size(); ++t)
    for (const auto& s : segments) {
      engine.copy(staged.data() + at, state.checkpoint_data(t, s), s.count * sizeof(master));
      at += s.count;
    }
  engine.record().wait();

  // Every rank's file size is a function of the layout: the checksums travel in rows of one
  // length.
  std::vector<std::vector<detail::segment>> all_segments(static_cast<std::size_t>(world));
  std::size_t most_blocks = 0;
  for (int r = 0; r < world; ++r) {
    all_segments[static_cast<std::size_t>(r)] = state.checkpoint_segments(r);
    std::size_t elements = 0;
    for (const auto& s : all_segments[static_cast<std::size_t>(r)]) elements += s.count;
    const std::size_t bytes = elements * tensors.size() * sizeof(master);
    most_blocks = std::max(most_blocks, (bytes + block_bytes - 1) / block_bytes);
  }
  std::vector<std::int64_t> row(2 + most_blocks, 0);
  std::exception_ptr failure;
  const std::string file = staging + "/" + detail::checkpoint_file_name(rank);
  int failed_errno = 0;
  try {
    const auto blocks = detail::write_checkpoint_file(file, staged.data(), staged.size() * sizeof(master), block_bytes,
                                                      rank, failed_errno);
    for (std::size_t b = 0; b < blocks.size(); ++b) std::memcpy(&row[2 + b], &blocks[b], sizeof(std::int64_t));
  } catch (...) {
    failure = std::current_exception();
    row[0] = 1;
    row[1] = failed_errno;
  }
  staged = {};
  const auto rows = all_gather_values(group, std::span<const std::int64_t>(row));
  if (failure) std::rethrow_exception(failure);
  for (int r = 0; r < world; ++r)
    if (rows[static_cast<std::size_t>(r) * row.size()] != 0)
      throw error(rank, operation,
                  "rank " + std::to_string(r) + " could not write " + staging + "/" + detail::checkpoint_file_name(r) +
                      " (errno " + std::to_string(rows[static_cast<std::size_t>(r) * row.size() + 1]) + ": " +
                      std::strerror(static_cast<int>(rows[static_cast<std::size_t>(r) * row.size() + 1])) + ")",
                  "free space or fix permissions; the previous checkpoint is intact");

  // Rank 0: the index, last, then the rename that commits.
  detail::checkpoint_manifest manifest;
  manifest.step = step;
  manifest.optimizer_steps = state.steps();
  manifest.block_bytes = block_bytes;
  manifest.element_bytes = sizeof(master);
  manifest.world_size = world;
  manifest.strategy = std::string(to_string(state.strategy()));
  manifest.parameter_dtype = std::string(to_string(dtype_v<P>));
  manifest.tensors = tensors;
  if (state.options().scaler) manifest.scaler = state.options().scaler->save();
  manifest.metadata = options.metadata;
  const auto& regions = state.regions();
  for (std::size_t r = 0; r < regions.size(); ++r)
    manifest.regions.push_back(
        {detail::checkpoint_region_name(regions, r), regions[r].count, std::string(to_string(dtype_v<master>))});
  if (rank == 0)
    for (int r = 0; r < world; ++r) {
      detail::checkpoint_file f;
      f.name = detail::checkpoint_file_name(r);
      f.rank = r;
      std::uint64_t offset = 0;
      for (std::size_t t = 0; t < tensors.size(); ++t)
        for (const auto& s : all_segments[static_cast<std::size_t>(r)]) {
          f.pieces.push_back({t, s.region, s.storage - state.placement(s.region).storage, s.count, offset});
          offset += s.count * sizeof(master);
        }
      f.bytes = offset;
      const std::size_t blocks = (offset + block_bytes - 1) / block_bytes;
      f.blocks.resize(blocks);
      std::memcpy(f.blocks.data(), &rows[static_cast<std::size_t>(r) * row.size() + 2], blocks * sizeof(std::uint64_t));
      f.checksum = detail::checkpoint_file_checksum(f.blocks, f.bytes);
      manifest.files.push_back(std::move(f));
    }
  detail::checkpoint_together(
      group, operation,
      [&](std::int64_t&) {
        if (rank == 0) detail::commit_checkpoint(directory, staging, manifest, options.keep_last, rank);
      },
      [&](int, std::int64_t) { return "rank 0 could not commit " + staging; },
      "the previous checkpoint is intact; the partial one is removed by the next save");

  checkpoint_info info;
  info.path = directory + "/" + detail::checkpoint_step_name(step);
  info.step = step;
  info.optimizer_steps = manifest.optimizer_steps;
  info.world_size = world;
  info.strategy = manifest.strategy;
  info.metadata = options.metadata;
  info.bytes_written = owned * tensors.size() * sizeof(master);
  info.seconds = detail::seconds_since(started);
  return info;
}

template <backend B, element P, element G>
checkpoint_info load_checkpoint(training_state<B, P, G>& state, const std::string& checkpoint) {
  using master = typename training_state<B, P, G>::master_type;
  const auto started = std::chrono::steady_clock::now();
  auto& group = state.group();
  auto& engine = group.backend();
  const int rank = group.rank();
  const auto tensors = state.checkpoint_tensors();
  const auto& regions = state.regions();
  const std::string operation = "load_checkpoint";

  // Every rank reads the same index and checks it the same way: a refusal here is the same on
  // every rank, and none waits for another.
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, rank);
  std::vector<std::string> names;
  std::vector<std::uint64_t> counts;
  for (std::size_t r = 0; r < regions.size(); ++r) {
    names.push_back(detail::checkpoint_region_name(regions, r));
    counts.push_back(regions[r].count);
  }
  if (manifest.element_bytes != sizeof(master))
    throw error(rank, operation,
                checkpoint + "/manifest.json holds " + std::to_string(manifest.element_bytes) +
                    "-byte elements, this training state's masters are " + std::string(to_string(dtype_v<master>)),
                "load it into a state whose masters have the checkpoint's dtype");
  const auto in_manifest = detail::match_checkpoint(manifest, checkpoint, names, counts,
                                                    std::string(to_string(dtype_v<master>)), tensors, rank);

  // This rank's shard of the new layout, read from wherever the old one put it.
  const auto segments = state.checkpoint_segments(rank);
  std::size_t owned = 0;
  for (const auto& s : segments) owned += s.count;
  std::vector<master> staged(owned * tensors.size());
  std::vector<detail::checkpoint_need> needs;
  for (std::size_t t = 0, at = 0; t < tensors.size(); ++t)
    for (const auto& s : segments) {
      needs.push_back(
          {t, in_manifest[s.region], s.storage - state.placement(s.region).storage, s.count, staged.data() + at});
      at += s.count;
    }
  std::uint64_t bytes_read = 0;
  detail::checkpoint_together(
      group, operation,
      [&](std::int64_t& failed_file) {
        bytes_read = detail::read_checkpoint(checkpoint, manifest, needs, sizeof(master), rank, failed_file);
      },
      [&](int r, std::int64_t file) {
        return "rank " + std::to_string(r) + " refused " + checkpoint +
               (file >= 0 && static_cast<std::size_t>(file) < manifest.files.size()
                    ? "/" + manifest.files[static_cast<std::size_t>(file)].name + " (written by rank " +
                          std::to_string(manifest.files[static_cast<std::size_t>(file)].rank) + ")"
                    : std::string()) +
               " (its error says why)";
      },
      "load an earlier checkpoint of the directory, or fix the file system");

  for (std::size_t t = 0, at = 0; t < tensors.size(); ++t)
    for (const auto& s : segments) {
      engine.copy(state.checkpoint_data(t, s), staged.data() + at, s.count * sizeof(master));
      at += s.count;
    }
  engine.record().wait();
  state.finish_checkpoint_load(manifest.optimizer_steps);
  if (state.options().scaler && manifest.scaler) state.options().scaler->restore(*manifest.scaler);

  checkpoint_info info;
  info.path = checkpoint;
  info.step = manifest.step;
  info.optimizer_steps = manifest.optimizer_steps;
  info.world_size = manifest.world_size;
  info.strategy = manifest.strategy;
  info.metadata = manifest.metadata;
  info.bytes_read = bytes_read;
  info.seconds = detail::seconds_since(started);
  return info;
}

template <backend B, element P, element G>
std::optional<checkpoint_info> resume_checkpoint(training_state<B, P, G>& state, const std::string& directory) {
  auto& group = state.group();
  // Rank 0 decides which one, so that every rank loads the same even while the directory
  // changes under them.
  std::int64_t row[2] = {0, 0};
  if (group.rank() == 0)
    if (const auto newest = newest_checkpoint(directory)) {
      row[0] = 1;
      row[1] = static_cast<std::int64_t>(std::stoull(newest->substr(newest->rfind("step-") + 5)));
    }
  const auto chosen = all_gather_values(group, std::span<const std::int64_t>(row, 2));
  if (chosen[0] == 0) return std::nullopt;
  return load_checkpoint(state, directory + "/" + detail::checkpoint_step_name(static_cast<std::uint64_t>(chosen[1])));
}

}  // namespace cohort::inline v0
