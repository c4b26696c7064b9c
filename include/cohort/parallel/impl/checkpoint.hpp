#pragma once
// cohort/parallel/checkpoint.hpp's templates, always included.
// Over 400 lines: the checkpoint writer's and reader's templates, one format's two halves.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/comm/host_values.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/rendezvous/store.hpp"

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
  return regions[r].name.empty() ? detail::text("#", std::to_string(r)) : regions[r].name;
}

}  // namespace detail

namespace detail {

// One save, one design for the synchronous and the asynchronous: begin (collective: the
// staging directory, the index as of this step), stream (the state copied chunk by chunk into
// a staging pool while a writer thread drains it into this rank's file, publishes the outcome
// and, on rank 0, commits once every rank's is in) and agree (collective: the outcome, and the
// commit where the writer did not make it).
template <class Master>
struct pending_checkpoint {
  std::string directory, staging, file;
  std::uint64_t step = 0;
  int rank = 0, world = 0;
  std::size_t block_bytes = 0, keep_last = 0;
  std::size_t most_blocks = 0;   // over every rank's file: the checksum rows' length
  std::uint64_t bytes = 0;       // of this rank's file
  checkpoint_manifest manifest;  // all but the checksums (rank 0: the files' pieces too)
  checkpoint_fault fault;
  double seconds = 0;        // begin, on the saving thread
  double write_seconds = 0;  // the writer's, which spans the copy

  // Where this rank's file comes from, in order: runs of the state's memory (device memory on a
  // device backend, copied by the engine).
  std::vector<std::pair<const char*, std::size_t>> sources;
  // The staging pool: chunk i of the file goes to slot i % slots, copied once chunk i - slots
  // is written.
  checkpoint_staging pool;
  std::size_t chunk_bytes = 0, slots = 0, chunks = 0;
  std::mutex mutex;
  std::condition_variable changed;
  std::size_t copied = 0, written = 0;  // chunks, under mutex
  bool stopped_copying = false;         // the copy failed: the writer stops (under mutex)
  bool stopped_writing = false;         // the write failed: the copy stops (under mutex)
  bool finished = false;                // written (or failed) and published (under mutex)

  // The writer's outcome, read once the writer is joined.
  std::vector<std::uint64_t> blocks;
  std::exception_ptr failure;
  int failed_errno = 0;
  // The background commit (rank 0), through the group's store.
  std::shared_ptr<store> keys;  // null: no background commit, the agreement commits
  std::string key_prefix;       // the save's own: its nonce
  bool published = false;
  std::atomic<bool> stop{false};  // rank 0's writer stops waiting for the other ranks' keys
  bool committed = false;         // by rank 0's writer
  std::exception_ptr commit_failure;
  std::thread writer;
  // An asynchronous save's copy into the pool, on its own thread while training goes on.
  std::thread copier;
  std::exception_ptr copy_failure;

  std::string key(int r) const { return key_prefix + std::to_string(r); }

  void write() {
    const auto started = std::chrono::steady_clock::now();
    try {
      if (fault.rank == rank && fault.cannot_create)
        file = detail::text(staging, "/missing/", checkpoint_file_name(rank));
      checkpoint_file_writer out(file, block_bytes, rank, failed_errno);
      for (std::size_t i = 0; i < chunks; ++i) {
        {
          std::unique_lock lock(mutex);
          changed.wait(lock, [&] { return copied > i || stopped_copying; });
          if (copied <= i) return;  // the copy failed: its error is the save's
        }
        const std::size_t at = i * chunk_bytes, size = std::min<std::size_t>(chunk_bytes, bytes - at);
        out.append(pool.data() + (i % slots) * chunk_bytes, size);
        {
          std::lock_guard lock(mutex);
          ++written;
        }
        changed.notify_all();
      }
      blocks = out.finish();
    } catch (...) {
      failure = std::current_exception();
      if (failed_errno == 0) failed_errno = EIO;
    }
    if (failure) {
      std::lock_guard lock(mutex);
      stopped_writing = true;
    }
    changed.notify_all();
    write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    publish();
    {
      std::lock_guard lock(mutex);
      finished = true;
    }
    changed.notify_all();
    if (rank == 0) commit_when_every_rank_is_in();
  }

  void publish() {
    if (!keys) return;
    if (fault.rank == rank && fault.hold_published && !failure)
      while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // dies here, in the test
    try {
      const auto value = checkpoint_outcome_bytes(failure != nullptr, failed_errno, blocks);
      keys->set(key(rank), std::span<const std::uint8_t>(value));
      published = true;
    } catch (...) {
      // The agreement commits it instead, or raises the write's error.
    }
  }

  // Rank 0's writer: once every rank's key is in, the index, the rename and the pruning. Polls
  // (a short request each time) so that the trainer's own requests on a shared store handle
  // are never held for long; stops on `stop` or after the store's timeout, leaving the commit to
  // the agreement.
  void commit_when_every_rank_is_in() {
    if (!keys || failure) return;
    std::vector<std::string> names;
    for (int r = 0; r < world; ++r) names.push_back(key(r));
    const auto started = std::chrono::steady_clock::now();
    auto m = manifest;
    try {
      for (auto pause = std::chrono::microseconds(200); !keys->check(names);
           pause = std::min(2 * pause, std::chrono::microseconds(20000))) {
        if (stop || std::chrono::steady_clock::now() - started > keys->timeout()) return;
        std::this_thread::sleep_for(pause);
      }
      const auto values = keys->multi_get(names, std::chrono::milliseconds(10000));
      for (int r = 0; r < world; ++r) {
        bool failed = false;
        int code = 0;
        auto& f = m.files[static_cast<std::size_t>(r)];
        if (!parse_checkpoint_outcome(values[static_cast<std::size_t>(r)], failed, code, f.blocks) || failed ||
            f.blocks.size() != (f.bytes + block_bytes - 1) / block_bytes)
          return;  // the agreement raises the failing rank's error
        f.checksum = checkpoint_file_checksum(f.blocks, f.bytes);
      }
    } catch (...) {
      return;  // the store failed: the agreement gathers the checksums and commits
    }
    // Once begun, the commit's outcome is the save's: a failure after the rename (the fsync of
    // DIR, the pruning) must not send the agreement to commit a second time.
    try {
      commit_checkpoint(directory, staging, m, keep_last, rank);
      committed = true;
    } catch (...) {
      commit_failure = std::current_exception();
    }
  }
};

template <backend B, element P, element G>
auto begin_checkpoint_save(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                           const checkpoint_options& options, bool synchronous, checkpoint_staging recycled = {},
                           const checkpoint_fault& fault = {}) {
  using master = typename training_state<B, P, G>::master_type;
  const auto started = std::chrono::steady_clock::now();
  auto& group = state.group();
  const int rank = group.rank(), world = group.world_size();
  const auto tensors = state.checkpoint_tensors();
  auto pending = std::make_unique<pending_checkpoint<master>>();
  pending->pool = std::move(recycled);  // its pages already faulted in: copying into it is the whole cost
  pending->directory = directory;
  pending->step = step;
  pending->rank = rank;
  pending->world = world;
  pending->block_bytes = std::max<std::size_t>(options.block_bytes, 64);
  pending->keep_last = options.keep_last;
  pending->fault = fault;

  // Rank 0 clears what interrupted saves left and makes the staging directory; its name
  // (random, so two jobs or a restarted one never share it) reaches every rank.
  std::int64_t nonce = 0;
  if (rank == 0)
    nonce = static_cast<std::int64_t>(std::random_device{}() & 0x7fffffffu) << 20 |
            static_cast<std::int64_t>(step & 0xfffff);
  nonce = all_gather_values(group, std::span<const std::int64_t>(&nonce, 1))[0];
  pending->staging = checkpoint_staging_path(directory, step, static_cast<std::uint64_t>(nonce));
  pending->file = detail::text(pending->staging, "/", checkpoint_file_name(rank));
  pending->keys = group.group_store();
  pending->key_prefix = detail::text("checkpoint/", std::to_string(nonce), "/");
  checkpoint_together(
      group, "save_checkpoint",
      [&](std::int64_t&) {
        if (rank == 0) begin_checkpoint(directory, pending->staging, rank);
      },
      [&](int, std::int64_t) { return detail::text("rank 0 could not prepare ", pending->staging); },
      "the checkpoint directory must be writable by every rank (a shared file system)");

  // This rank's file: each tensor's elements of its segments.
  for (std::size_t t = 0; t < tensors.size(); ++t)
    for (const auto& s : state.checkpoint_segments(rank)) {
      pending->sources.emplace_back(reinterpret_cast<const char*>(state.checkpoint_data(t, s)),
                                    s.count * sizeof(master));
      pending->bytes += s.count * sizeof(master);
    }

  // The index as of this step. Every rank's file is a function of the layout, so rank 0 names
  // every file's pieces and the checksums travel in rows of one length.
  auto& m = pending->manifest;
  m.step = step;
  m.optimizer_steps = state.steps();
  m.block_bytes = pending->block_bytes;
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
        if (rank == 0) f.pieces.push_back({t, s.region, s.offset - state.regions()[s.region].offset, s.count, f.bytes});
        f.bytes += s.count * sizeof(master);
      }
    pending->most_blocks = std::max(pending->most_blocks, (f.bytes + pending->block_bytes - 1) / pending->block_bytes);
    m.files.push_back(std::move(f));
  }

  // The pool: the file at once when the bound allows it, else slots of whole blocks within the
  // bound (at least one block), each at most 8 MiB so that the writer starts early. A
  // synchronous save waits for the write anyway: four slots are all it uses.
  const std::size_t block = pending->block_bytes;
  const std::size_t file_bytes = std::max<std::uint64_t>(pending->bytes, 1);
  const std::size_t most = std::max<std::size_t>(block, (std::size_t{8} << 20) / block * block);
  std::size_t bound = options.staging_bytes == 0 ? file_bytes : std::max(options.staging_bytes, block);
  if (synchronous) bound = std::min(bound, 4 * most);
  const std::size_t chunk = bound >= file_bytes ? most : std::min(most, std::max(block, bound / 4 / block * block));
  pending->chunk_bytes = chunk;
  pending->chunks = (pending->bytes + chunk - 1) / chunk;
  pending->slots =
      bound >= file_bytes ? pending->chunks : std::max<std::size_t>(1, std::min(pending->chunks, bound / chunk));
  const std::size_t pool_bytes = pending->slots >= pending->chunks ? pending->bytes : pending->slots * chunk;
  if (pending->pool.size() != pool_bytes) pending->pool = checkpoint_staging(pool_bytes);
  pending->seconds = seconds_since(started);
  return pending;
}

// The producer's half of the stream (on the training thread for a synchronous save, on the
// copier thread for an asynchronous one): each chunk copied into its slot once the writer has
// drained the chunk that held it. Returns once the last chunk is in; the state may change
// after that.
template <backend B, class Master>
void stage_checkpoint(B& engine, pending_checkpoint<Master>& pending) {
  try {
    std::size_t source = 0, within = 0;  // the next byte to copy: sources[source] + within
    for (std::size_t i = 0; i < pending.chunks; ++i) {
      {
        std::unique_lock lock(pending.mutex);
        pending.changed.wait(lock, [&] { return pending.written + pending.slots > i || pending.stopped_writing; });
        if (pending.stopped_writing) break;  // the writer's error is the save's
      }
      char* into = pending.pool.data() + (i % pending.slots) * pending.chunk_bytes;
      std::size_t left = std::min<std::size_t>(pending.chunk_bytes, pending.bytes - i * pending.chunk_bytes);
      while (left > 0) {
        const auto& [from, size] = pending.sources[source];
        const std::size_t take = std::min(left, size - within);
        engine.copy(into, from + within, take);
        into += take;
        left -= take;
        within += take;
        if (within == size) ++source, within = 0;
      }
      engine.record().wait();
      {
        std::lock_guard lock(pending.mutex);
        ++pending.copied;
      }
      pending.changed.notify_all();
    }
  } catch (...) {
    {
      std::lock_guard lock(pending.mutex);
      pending.stopped_copying = true;
    }
    pending.changed.notify_all();
    pending.stop = true;
    if (pending.writer.joinable()) pending.writer.join();
    std::lock_guard lock(pending.mutex);
    pending.finished = true;  // nothing published: the agreement (if any) commits nothing
    throw;
  }
}

// Collective. Waits for this rank's writer, then agrees on the outcome: any rank's write error
// raised on every rank, rank 0's background commit taken, or the commit made here.
template <backend B, class Master>
checkpoint_info agree_checkpoint_save(process_group<B>& group, pending_checkpoint<Master>& pending) {
  const auto started = std::chrono::steady_clock::now();
  const int rank = group.rank(), world = group.world_size();
  const std::string operation = "save_checkpoint";
  const auto forget_key = [&] {
    // Every rank has agreed, so rank 0's writer has read every key: the store does not grow.
    if (pending.published) try {
        pending.keys->delete_key(pending.key(rank));
      } catch (...) {}
  };
  // The writes first: once every rank's is finished, every key that will ever be published
  // is, so rank 0's writer either has them all or never will; it is stopped and joined.
  {
    std::unique_lock lock(pending.mutex);
    pending.changed.wait(lock, [&] { return pending.finished; });
  }
  // A copy that failed is this rank's failure (its writer stopped without publishing).
  if (pending.copy_failure && !pending.failure) {
    pending.failure = pending.copy_failure;
    pending.failed_errno = EIO;
  }
  std::int64_t row[2] = {pending.failure ? 1 : 0, pending.failed_errno};
  const auto rows = all_gather_values(group, std::span<const std::int64_t>(row, 2));
  pending.stop = true;
  if (pending.writer.joinable()) pending.writer.join();
  if (pending.failure) {
    forget_key();
    std::rethrow_exception(pending.failure);
  }
  for (int r = 0; r < world; ++r)
    if (rows[2 * static_cast<std::size_t>(r)] != 0) {
      forget_key();
      const int code = static_cast<int>(rows[2 * static_cast<std::size_t>(r) + 1]);
      throw error(
          rank, operation,
          detail::text("rank ", std::to_string(r), " could not write ", pending.staging, "/", checkpoint_file_name(r),
                       " (errno ", std::to_string(code), ": ", std::strerror(code), ")"),
          "free space or fix permissions; the previous checkpoint is intact");
    }
  // Rank 0's commit: 1 made in the background, 2 failed there, 0 left to this agreement.
  std::int64_t commit = pending.committed ? 1 : pending.commit_failure ? 2 : 0;
  commit = all_gather_values(group, std::span<const std::int64_t>(&commit, 1))[0];
  forget_key();
  auto& m = pending.manifest;
  if (commit == 2) {
    if (pending.commit_failure) std::rethrow_exception(pending.commit_failure);
    throw error(rank, operation, detail::text("rank 0 could not commit ", pending.staging),
                "the previous checkpoint is intact; the partial one is removed by the next save");
  }
  if (commit == 0) {
    // Not committed in the background (rank 0 stopped waiting, or the store failed): the
    // checksums gathered here, the index written by rank 0.
    std::vector<std::int64_t> blocks(pending.most_blocks, 0);
    std::memcpy(blocks.data(), pending.blocks.data(), pending.blocks.size() * sizeof(std::int64_t));
    const auto all = all_gather_values(group, std::span<const std::int64_t>(blocks));
    for (int r = 0; r < world; ++r) {
      auto& f = m.files[static_cast<std::size_t>(r)];
      f.blocks.resize((f.bytes + pending.block_bytes - 1) / pending.block_bytes);
      std::memcpy(f.blocks.data(), &all[static_cast<std::size_t>(r) * blocks.size()],
                  f.blocks.size() * sizeof(std::uint64_t));
      f.checksum = checkpoint_file_checksum(f.blocks, f.bytes);
    }
    checkpoint_together(
        group, operation,
        [&](std::int64_t&) {
          if (rank == 0) commit_checkpoint(pending.directory, pending.staging, m, pending.keep_last, rank);
        },
        [&](int, std::int64_t) { return detail::text("rank 0 could not commit ", pending.staging); },
        "the previous checkpoint is intact; the partial one is removed by the next save");
  }
  checkpoint_info info;
  info.path = detail::text(pending.directory, "/", checkpoint_step_name(pending.step));
  info.step = pending.step;
  info.optimizer_steps = m.optimizer_steps;
  info.world_size = world;
  info.strategy = m.strategy;
  info.metadata = m.metadata;
  info.bytes_written = pending.bytes;
  info.seconds = pending.seconds + pending.write_seconds + seconds_since(started);
  return info;
}

template <class Master>
void start_checkpoint_writer(pending_checkpoint<Master>& pending) {
  pending.writer = std::thread([&pending] { pending.write(); });
}

}  // namespace detail

template <backend B, element P, element G>
checkpoint_info save_checkpoint(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                                const checkpoint_options& options) {
  const auto save = [&] {
    auto pending = detail::begin_checkpoint_save(state, directory, step, options, true);
    detail::start_checkpoint_writer(*pending);
    detail::stage_checkpoint(state.group().backend(), *pending);
    return detail::agree_checkpoint_save(state.group(), *pending);
  };
  process_group<B>* replicas = state.replicas();
  if (state.replica_count() == 1) return save();
  // Hybrid sharding: the first copy of the group writes, every copy learns its outcome.
  checkpoint_info info;
  std::exception_ptr failure;
  if (replicas->rank() == 0) try {
      info = save();
    } catch (...) {
      failure = std::current_exception();
    }
  std::int64_t failed = failure ? 1 : 0;
  failed = all_gather_values(*replicas, std::span<const std::int64_t>(&failed, 1))[0];
  if (failure) std::rethrow_exception(failure);
  if (failed != 0)
    throw error(state.rank(), "save_checkpoint",
                detail::text("the copy of the group that writes (replica rank 0) could not save step ",
                             std::to_string(step), " in ", directory, " (its error says why)"),
                "the previous checkpoint is intact");
  if (replicas->rank() != 0) {
    info.path = detail::text(directory, "/", detail::checkpoint_step_name(step));
    info.step = step;
    info.optimizer_steps = state.steps();
    info.world_size = state.world_size();
    info.strategy = std::string(to_string(state.strategy()));
    info.metadata = options.metadata;
  }
  return info;
}

template <backend B, element P, element G>
async_checkpointer<B, P, G>::~async_checkpointer() {
  // Not agreed on (that takes every rank): committed only if rank 0's writer already had every
  // key; otherwise the files stay in a tmp-* directory, never loaded.
  if (!pending_) return;
  pending_->stop = true;
  if (pending_->copier.joinable()) pending_->copier.join();
  if (pending_->writer.joinable()) pending_->writer.join();
  if (pending_->published) try {
      pending_->keys->delete_key(pending_->key(pending_->rank));
    } catch (...) {}
}

template <backend B, element P, element G>
std::optional<checkpoint_info> async_checkpointer<B, P, G>::wait() {
  if (!pending_) return std::nullopt;
  auto pending = std::move(pending_);
  pending_.reset();
  if (pending->copier.joinable()) pending->copier.join();
  auto info = detail::agree_checkpoint_save(state_->group(), *pending);
  spare_ = std::move(pending->pool);  // written: the next save stages into the same memory
  return info;
}

template <backend B, element P, element G>
std::optional<checkpoint_info> async_checkpointer<B, P, G>::save(const std::string& directory, std::uint64_t step,
                                                                 const checkpoint_options& options) {
  auto previous = wait();
  const auto started = std::chrono::steady_clock::now();
  pending_ = detail::begin_checkpoint_save(*state_, directory, step, options, false, std::move(spare_),
                                           std::exchange(next_fault_, {}));
  detail::start_checkpoint_writer(*pending_);
  // The copy overlaps the trainer's next forward and backward: the state's step() (or a load)
  // waits on the fence until it is done, so the snapshot is this step's.
  auto& fence = state_->checkpoint_fence();
  fence.arm();
  pending_->copier = std::thread([pending = pending_.get(), state = state_, &fence] {
    try {
      detail::stage_checkpoint(state->group().backend(), *pending);
    } catch (...) {
      pending->copy_failure = std::current_exception();
    }
    fence.release();
  });
  staging_peak_ = std::max<std::uint64_t>(staging_peak_, pending_->pool.size());
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
                detail::text(checkpoint, "/manifest.json holds ", std::to_string(manifest.element_bytes),
                             "-byte elements, this training state's masters are ", to_string(dtype_v<master>)),
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
          {t, in_manifest[s.region], s.offset - state.regions()[s.region].offset, s.count, staged.data() + at});
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
        return detail::text(
            "rank ", std::to_string(r), " refused ", checkpoint,
            (file >= 0 && static_cast<std::size_t>(file) < manifest.files.size()
                 ? detail::text("/", manifest.files[static_cast<std::size_t>(file)].name, " (written by rank ",
                                std::to_string(manifest.files[static_cast<std::size_t>(file)].rank), ")")
                 : std::string()),
            " (its error says why)");
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
  auto chosen = all_gather_values(group, std::span<const std::int64_t>(row, 2));
  // With replicas, the first copy's choice: every copy loads the same.
  if (state.replica_count() > 1)
    chosen = all_gather_values(*state.replicas(), std::span<const std::int64_t>(chosen.data(), 2));
  if (chosen[0] == 0) return std::nullopt;
  return load_checkpoint(
      state, detail::text(directory, "/", detail::checkpoint_step_name(static_cast<std::uint64_t>(chosen[1]))));
}

}  // namespace cohort::inline v0
