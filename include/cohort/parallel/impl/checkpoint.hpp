#pragma once
// cohort/parallel/checkpoint.hpp's templates, always included.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
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

// Every rank's parts of the blocks it read in part, on every rank: a count, then rows padded
// to the longest (file, block, sum, bytes each).
template <backend B>
std::vector<checkpoint_part> gather_checkpoint_parts(process_group<B>& group,
                                                     const std::vector<checkpoint_part>& parts) {
  const auto count = static_cast<std::int64_t>(parts.size());
  const auto counts = all_gather_values(group, std::span<const std::int64_t>(&count, 1));
  const auto most = static_cast<std::size_t>(*std::max_element(counts.begin(), counts.end()));
  std::vector<checkpoint_part> all;
  if (most == 0) return all;  // every block read whole by one rank (the same world)
  constexpr std::size_t width = 4;
  std::vector<std::int64_t> row(most * width, 0);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::uint64_t values[width] = {parts[i].file, parts[i].block, parts[i].sum, parts[i].bytes};
    std::memcpy(row.data() + i * width, values, sizeof values);
  }
  const auto rows = all_gather_values(group, std::span<const std::int64_t>(row));
  for (int r = 0; r < group.size(); ++r)
    for (std::size_t i = 0; i < static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]); ++i) {
      std::uint64_t values[width];
      std::memcpy(values, rows.data() + (static_cast<std::size_t>(r) * most + i) * width, sizeof values);
      all.push_back({static_cast<std::size_t>(values[0]), values[1], values[2], values[3], r});
    }
  return all;
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline std::string checkpoint_region_name(const std::vector<region>& regions, std::size_t r) {
  return regions[r].name.empty() ? "#" + std::to_string(r) : regions[r].name;
}

}  // namespace detail

namespace detail {

// One save in three phases, so that the middle one can run on a writer thread: begin
// (collective: the staging directory; the state copied to the host and described in the
// index while it is still this step's), write (this rank's file, no communication) and commit
// (collective: checksums gathered, the index written last, the rename).
template <class Master>
struct pending_checkpoint {
  std::string directory, staging, file;
  std::uint64_t step = 0;
  int rank = 0;
  std::size_t block_bytes = 0, keep_last = 0;
  std::size_t most_blocks = 0;   // over every rank's file: the checksum rows' length
  std::vector<Master> staged;    // this rank's file, until written
  bool keep_staging = false;     // an async_checkpointer reuses the memory for its next save
  std::uint64_t bytes = 0;       // of this rank's file
  checkpoint_manifest manifest;  // all but the checksums (rank 0: the files' pieces too)
  std::vector<std::uint64_t> blocks;
  std::exception_ptr failure;  // of the write
  int failed_errno = 0;
  double seconds = 0;  // begin and write, on this rank

  void write() {
    const auto started = std::chrono::steady_clock::now();
    try {
      blocks =
          write_checkpoint_file(file, staged.data(), staged.size() * sizeof(Master), block_bytes, rank, failed_errno);
    } catch (...) {
      failure = std::current_exception();
    }
    if (!keep_staging) staged = {};  // a one-off save's staging goes as soon as the file is written
    seconds += seconds_since(started);
  }
};

template <backend B, element P, element G>
auto begin_checkpoint_save(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                           const checkpoint_options& options,
                           std::vector<typename training_state<B, P, G>::master_type> recycled = {}) {
  using master = typename training_state<B, P, G>::master_type;
  const auto started = std::chrono::steady_clock::now();
  auto& group = state.group();
  auto& engine = group.backend();
  const int rank = group.rank(), world = group.size();
  const auto tensors = state.checkpoint_tensors();
  pending_checkpoint<master> pending;
  pending.staged = std::move(recycled);  // its pages already faulted in: copying into it is the whole cost
  pending.directory = directory;
  pending.step = step;
  pending.rank = rank;
  pending.block_bytes = std::max<std::size_t>(options.block_bytes, 64);
  pending.keep_last = options.keep_last;

  // Rank 0 clears what interrupted saves left and makes the staging directory; its name
  // (random, so two jobs or a restarted one never share it) reaches every rank.
  std::int64_t nonce = 0;
  if (rank == 0)
    nonce = static_cast<std::int64_t>(std::random_device{}() & 0x7fffffffu) << 20 |
            static_cast<std::int64_t>(step & 0xfffff);
  nonce = all_gather_values(group, std::span<const std::int64_t>(&nonce, 1))[0];
  pending.staging = checkpoint_staging_path(directory, step, static_cast<std::uint64_t>(nonce));
  pending.file = pending.staging + "/" + checkpoint_file_name(rank);
  checkpoint_together(
      group, "save_checkpoint",
      [&](std::int64_t&) {
        if (rank == 0) begin_checkpoint(directory, pending.staging, rank);
      },
      [&](int, std::int64_t) { return "rank 0 could not prepare " + pending.staging; },
      "the checkpoint directory must be writable by every rank (a shared file system)");

  // This rank's file: each tensor's elements of its segments, staged on the host (device
  // memory comes through the backend's copy).
  const auto segments = state.checkpoint_segments(rank);
  std::size_t owned = 0;
  for (const auto& s : segments) owned += s.count;
  pending.staged.resize(owned * tensors.size());
  for (std::size_t t = 0, at = 0; t < tensors.size(); ++t)
    for (const auto& s : segments) {
      engine.copy(pending.staged.data() + at, state.checkpoint_data(t, s), s.count * sizeof(master));
      at += s.count;
    }
  engine.record().wait();
  pending.bytes = pending.staged.size() * sizeof(master);

  // The index as of this step. Every rank's file is a function of the layout, so rank 0 names
  // every file's pieces and the checksums travel in rows of one length.
  auto& m = pending.manifest;
  m.step = step;
  m.optimizer_steps = state.steps();
  m.block_bytes = pending.block_bytes;
  m.element_bytes = sizeof(master);
  m.world_size = world;
  m.strategy = std::string(to_string(state.strategy()));
  m.parameter_dtype = std::string(to_string(dtype_v<P>));
  m.tensors = tensors;
  if (state.options().scaler) m.scaler = state.options().scaler->save();
  m.metadata = options.metadata;
  const auto& regions = state.regions();
  for (std::size_t r = 0; r < regions.size(); ++r)
    m.regions.push_back(
        {checkpoint_region_name(regions, r), regions[r].count, std::string(to_string(dtype_v<master>))});
  for (int r = 0; r < world; ++r) {
    checkpoint_file f;
    f.name = checkpoint_file_name(r);
    f.rank = r;
    for (std::size_t t = 0; t < tensors.size(); ++t)
      for (const auto& s : state.checkpoint_segments(r)) {
        if (rank == 0)
          f.pieces.push_back({t, s.region, s.storage - state.placement(s.region).storage, s.count, f.bytes});
        f.bytes += s.count * sizeof(master);
      }
    pending.most_blocks = std::max(pending.most_blocks, (f.bytes + pending.block_bytes - 1) / pending.block_bytes);
    m.files.push_back(std::move(f));
  }
  pending.seconds = seconds_since(started);
  return pending;
}

template <backend B, class Master>
checkpoint_info commit_checkpoint_save(process_group<B>& group, pending_checkpoint<Master>& pending) {
  const auto started = std::chrono::steady_clock::now();
  const int rank = group.rank(), world = group.size();
  const std::string operation = "save_checkpoint";
  std::vector<std::int64_t> row(2 + pending.most_blocks, 0);
  if (pending.failure) {
    row[0] = 1;
    row[1] = pending.failed_errno;
  } else {
    std::memcpy(row.data() + 2, pending.blocks.data(), pending.blocks.size() * sizeof(std::int64_t));
  }
  const auto rows = all_gather_values(group, std::span<const std::int64_t>(row));
  if (pending.failure) std::rethrow_exception(pending.failure);
  for (int r = 0; r < world; ++r)
    if (rows[static_cast<std::size_t>(r) * row.size()] != 0) {
      const int code = static_cast<int>(rows[static_cast<std::size_t>(r) * row.size() + 1]);
      throw error(rank, operation,
                  "rank " + std::to_string(r) + " could not write " + pending.staging + "/" + checkpoint_file_name(r) +
                      " (errno " + std::to_string(code) + ": " + std::strerror(code) + ")",
                  "free space or fix permissions; the previous checkpoint is intact");
    }
  auto& m = pending.manifest;
  for (int r = 0; r < world; ++r) {
    auto& f = m.files[static_cast<std::size_t>(r)];
    f.blocks.resize((f.bytes + pending.block_bytes - 1) / pending.block_bytes);
    std::memcpy(f.blocks.data(), &rows[static_cast<std::size_t>(r) * row.size() + 2],
                f.blocks.size() * sizeof(std::uint64_t));
    f.checksum = checkpoint_file_checksum(f.blocks, f.bytes);
  }
  checkpoint_together(
      group, operation,
      [&](std::int64_t&) {
        if (rank == 0) commit_checkpoint(pending.directory, pending.staging, m, pending.keep_last, rank);
      },
      [&](int, std::int64_t) { return "rank 0 could not commit " + pending.staging; },
      "the previous checkpoint is intact; the partial one is removed by the next save");
  checkpoint_info info;
  info.path = pending.directory + "/" + checkpoint_step_name(pending.step);
  info.step = pending.step;
  info.optimizer_steps = m.optimizer_steps;
  info.world_size = world;
  info.strategy = m.strategy;
  info.metadata = m.metadata;
  info.bytes_written = pending.bytes;
  info.seconds = pending.seconds + seconds_since(started);
  return info;
}

}  // namespace detail

template <backend B, element P, element G>
checkpoint_info save_checkpoint(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                                const checkpoint_options& options) {
  auto pending = detail::begin_checkpoint_save(state, directory, step, options);
  pending.write();
  return detail::commit_checkpoint_save(state.group(), pending);
}

template <backend B, element P, element G>
async_checkpointer<B, P, G>::~async_checkpointer() {
  // Not committed (that takes every rank): the files stay in a tmp-* directory, never loaded.
  if (writer_.joinable()) writer_.join();
}

template <backend B, element P, element G>
std::optional<checkpoint_info> async_checkpointer<B, P, G>::wait() {
  if (!pending_) return std::nullopt;
  if (writer_.joinable()) writer_.join();
  auto pending = std::move(pending_);
  pending_.reset();
  spare_ = std::move(pending->staged);  // written: the next save stages into the same memory
  return detail::commit_checkpoint_save(state_->group(), *pending);
}

template <backend B, element P, element G>
std::optional<checkpoint_info> async_checkpointer<B, P, G>::save(const std::string& directory, std::uint64_t step,
                                                                 const checkpoint_options& options) {
  auto previous = wait();
  const auto started = std::chrono::steady_clock::now();
  pending_ = std::make_unique<pending_type>(
      detail::begin_checkpoint_save(*state_, directory, step, options, std::move(spare_)));
  pending_->keep_staging = true;
  const std::size_t bound = options.staging_bytes;
  if (bound != 0 && pending_->bytes > bound) {
    // More than the staging bound allows to hold while training goes on: written now.
    pending_->write();
  } else {
    writer_ = std::thread([pending = pending_.get()] { pending->write(); });
  }
  staging_peak_ = std::max<std::uint64_t>(staging_peak_, pending_->bytes);
  last_blocked_seconds_ = detail::seconds_since(started);
  return previous;
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
  // Bytes no piece holds (none where this code saved) still have to be verified: each range
  // read by one rank.
  std::vector<detail::checkpoint_range> also_verify;
  const auto gaps = detail::checkpoint_gaps(manifest);
  for (std::size_t g = static_cast<std::size_t>(rank); g < gaps.size(); g += static_cast<std::size_t>(group.size()))
    also_verify.push_back(gaps[g]);
  std::uint64_t bytes_read = 0;
  std::vector<detail::checkpoint_part> parts;
  detail::checkpoint_together(
      group, operation,
      [&](std::int64_t& failed_file) {
        bytes_read =
            detail::read_checkpoint(checkpoint, manifest, needs, also_verify, sizeof(master), rank, failed_file, parts);
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
  // The blocks that straddle two ranks' reads: verified from every reader's part, on every
  // rank alike, before any of it reaches the state.
  detail::check_checkpoint_parts(checkpoint, manifest, detail::gather_checkpoint_parts(group, parts), rank);

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
