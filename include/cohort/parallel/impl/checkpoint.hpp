#pragma once
// cohort/parallel/checkpoint.hpp's templates: always included header-only; compiled once, only by
// the library's unit (cohort/src.hpp) and by units that define COHORT_TEMPLATE_BODIES.
// Over 400 lines: the checkpoint writer's and reader's templates, one format's two halves.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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

// A rank's failure as the other ranks learn it: its kind (the exception type to raise), its
// detail and its hint, in its own words.
struct checkpoint_failure {
  enum kind_type : std::int64_t { none = 0, other = 1, mismatch = 2, damaged = 3 };
  std::int64_t kind = none;
  std::string detail, hint;
};

inline checkpoint_failure describe_checkpoint_failure(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const checkpoint_mismatch_error& e) {
    return {checkpoint_failure::mismatch, e.detail(), e.hint()};
  } catch (const checkpoint_damaged_error& e) {
    return {checkpoint_failure::damaged, e.detail(), e.hint()};
  } catch (const error& e) {
    return {checkpoint_failure::other, e.detail(), e.hint()};
  } catch (const std::exception& e) {
    return {checkpoint_failure::other, e.what(), {}};
  } catch (...) {
    return {checkpoint_failure::other, "an exception that is not a std::exception", {}};
  }
}

// Collective: every rank learns whether any rank's `failure` is set, and why. Returns this
// rank's own failure, or, where only others failed, an error of the same type carrying the
// lowest failing rank's own message and hint (so the cause reaches every rank, whichever
// rank's error a launcher or run_ranks prints); null when none failed. A count row, then,
// only when something failed, the messages (at most 4 KiB each) as rows of one length.
template <backend B>
std::exception_ptr agree_on_failure(process_group<B>& group, std::string_view operation,
                                    const std::exception_ptr& failure) {
  constexpr std::size_t most = 4096;
  std::string words;
  checkpoint_failure mine;
  if (failure) {
    mine = describe_checkpoint_failure(failure);
    words = detail::text(mine.detail.substr(0, most - 1 - std::min(mine.hint.size(), most / 2)), std::string(1, '\0'),
                         mine.hint.substr(0, most / 2));
  }
  const std::int64_t row[2] = {mine.kind, static_cast<std::int64_t>(words.size())};
  const auto rows = all_gather_values(group, std::span<const std::int64_t>(row, 2));
  std::vector<int> failing;
  std::size_t longest = 0;
  for (int r = 0; r < group.size(); ++r)
    if (rows[2 * static_cast<std::size_t>(r)] != checkpoint_failure::none) {
      failing.push_back(r);
      longest = std::max(longest, static_cast<std::size_t>(rows[2 * static_cast<std::size_t>(r) + 1]));
    }
  if (failing.empty()) return nullptr;
  std::vector<std::int64_t> text((longest + 7) / 8, 0);
  std::memcpy(text.data(), words.data(), words.size());
  const auto texts = all_gather_values(group, std::span<const std::int64_t>(text));
  if (failure) return failure;
  const int first = failing.front();
  const auto* theirs = reinterpret_cast<const char*>(texts.data() + static_cast<std::size_t>(first) * text.size());
  const std::string_view said(theirs, static_cast<std::size_t>(rows[2 * static_cast<std::size_t>(first) + 1]));
  const auto split = std::min(said.find('\0'), said.size());
  const std::string detail_text = detail::text(
      format_ranks(failing), " failed", (failing.size() > 1 ? detail::text("; rank ", std::to_string(first)) : ""),
      ": ", said.substr(0, split));
  const std::string_view hint = split < said.size() ? said.substr(split + 1) : std::string_view();
  switch (rows[2 * static_cast<std::size_t>(first)]) {
    case checkpoint_failure::mismatch:
      return std::make_exception_ptr(checkpoint_mismatch_error(group.rank(), operation, detail_text, hint));
    case checkpoint_failure::damaged:
      return std::make_exception_ptr(checkpoint_damaged_error(group.rank(), operation, detail_text, hint));
    default: return std::make_exception_ptr(error(group.rank(), operation, detail_text, hint));
  }
}

// Runs `attempt` on this rank and lets every rank know whether any rank failed: the failing
// rank rethrows its own error, the others one with its message (agree_on_failure), so that no
// rank waits in a later collective for one that gave up.
template <backend B>
void checkpoint_together(process_group<B>& group, std::string_view operation, const std::function<void()>& attempt) {
  std::exception_ptr failure;
  try {
    attempt();
  } catch (...) {
    failure = std::current_exception();
  }
  if (const auto agreed = agree_on_failure(group, operation, failure)) std::rethrow_exception(agreed);
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
  checkpoint_manifest manifest;  // all but the checksums (rank 0: the files' segments too)
  checkpoint_fault fault;
  double seconds = 0;        // begin, on the saving thread
  double write_seconds = 0;  // the writer's, which spans the copy
  // The copy's and the write's times, for the state's timeline (its step when the save began).
  std::chrono::steady_clock::time_point copy_began{}, copy_ended{}, write_began{}, write_ended{};
  std::uint64_t timeline_step = 0;

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
    write_began = started;
    write_ended = std::chrono::steady_clock::now();
    write_seconds = std::chrono::duration<double>(write_ended - started).count();
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
      commit_checkpoint(directory, staging, m, keep_last, rank, fault);
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
  if (const timeline* recorder = state.options().timeline) pending->timeline_step = recorder->step();

  // Rank 0 locks the directory, clears what interrupted saves left in DIR/.cohort and makes
  // the staging directory there; its name (random, so a restarted job never reuses one)
  // reaches every rank.
  std::int64_t nonce = 0;
  if (rank == 0)
    nonce = static_cast<std::int64_t>(detail::random_checkpoint_bits() & 0x7fffffffu) << 20 |
            static_cast<std::int64_t>(step & 0xfffff);
  nonce = all_gather_values(group, std::span<const std::int64_t>(&nonce, 1))[0];
  pending->staging = checkpoint_staging_path(directory, step, static_cast<std::uint64_t>(nonce));
  pending->file = detail::text(pending->staging, "/", checkpoint_file_name(rank));
  pending->keys = group.group_store();
  pending->key_prefix = detail::text("checkpoint/", std::to_string(nonce), "/");
  // Rank 0 alone writes the index: the run and the job are its.
  std::string run, job;
  checkpoint_together(group, "save_checkpoint", [&] {
    if (rank != 0) return;
    run = begin_checkpoint(directory, pending->staging, step, rank);
    job = launcher_job_id();
  });

  // This rank's file: each tensor's elements of its segments.
  for (std::size_t t = 0; t < tensors.size(); ++t)
    for (const auto& s : state.checkpoint_segments(rank)) {
      pending->sources.emplace_back(reinterpret_cast<const char*>(state.checkpoint_data(t, s)),
                                    s.count * sizeof(master));
      pending->bytes += s.count * sizeof(master);
    }

  // The index as of this step. Every rank's file is a function of the layout, so rank 0 names
  // every file's segments and the checksums travel in rows of one length.
  auto& m = pending->manifest;
  m.run = std::move(run);
  m.job = std::move(job);
  m.step = step;
  m.optimizer_steps = state.steps();
  m.block_bytes = pending->block_bytes;
  m.element_bytes = sizeof(master);
  m.world_size = world;
  m.strategy = std::string(to_string(state.strategy()));
  m.parameter_dtype = std::string(to_string(dtype_v<P>));
  m.dtype = std::string(to_string(dtype_v<master>));
  m.tensors = tensors;
  if (state.options().scaler) m.scaler = state.options().scaler->save();
  m.metadata = options.metadata;
  const auto& regions = state.regions();
  for (std::size_t r = 0; r < regions.size(); ++r) {
    std::vector<std::uint64_t> shape(regions[r].shape.begin(), regions[r].shape.end());
    if (shape.empty()) shape.push_back(regions[r].count);
    m.regions.push_back({checkpoint_region_name(regions, r), regions[r].count, std::move(shape)});
  }
  for (int r = 0; r < world; ++r) {
    checkpoint_file f;
    f.name = checkpoint_file_name(r);
    f.rank = r;
    for (const auto& s : state.checkpoint_segments(r)) {
      if (rank == 0) f.segments.push_back({s.region, s.offset - state.regions()[s.region].offset, s.count});
      f.elements += s.count;
    }
    f.bytes = tensors.size() * f.elements * sizeof(master);
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
  pending.copy_began = std::chrono::steady_clock::now();
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
    pending.copy_ended = std::chrono::steady_clock::now();
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
  if (pending.copy_failure && !pending.failure) pending.failure = pending.copy_failure;
  // Any rank's failed write raised on every rank, in that rank's words (its file, its errno).
  const auto write_failure = agree_on_failure(group, operation, pending.failure);
  pending.stop = true;
  if (pending.writer.joinable()) pending.writer.join();
  if (write_failure) {
    forget_key();
    std::rethrow_exception(write_failure);
  }
  // Rank 0's commit: 1 made in the background, 2 failed there, 0 left to this agreement.
  std::int64_t commit = pending.committed ? 1 : pending.commit_failure ? 2 : 0;
  commit = all_gather_values(group, std::span<const std::int64_t>(&commit, 1))[0];
  forget_key();
  auto& m = pending.manifest;
  if (commit == 2) std::rethrow_exception(agree_on_failure(group, operation, pending.commit_failure));
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
    checkpoint_together(group, operation, [&] {
      if (rank == 0) commit_checkpoint(pending.directory, pending.staging, m, pending.keep_last, rank, pending.fault);
    });
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

// A save's copy and write on the state's timeline, once agreed (the training thread records).
template <class Master>
void record_checkpoint_save(timeline* recorder, const pending_checkpoint<Master>& pending) {
  if (!recorder || !recorder->recording()) return;
  recorder->add_track_span(timeline::checkpoint_copy_track, "checkpoint: copies", "checkpoint: copy to host staging",
                           timeline_category::checkpoint, pending.timeline_step, pending.copy_began,
                           pending.copy_ended);
  recorder->add_track_span(timeline::checkpoint_file_track, "checkpoint: file", "checkpoint: write",
                           timeline_category::checkpoint, pending.timeline_step, pending.write_began,
                           pending.write_ended);
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
    auto info = detail::agree_checkpoint_save(state.group(), *pending);
    detail::record_checkpoint_save(state.options().timeline, *pending);
    return info;
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
  // The writing copy's outcome, in its own words, on every copy.
  if (const auto agreed = detail::agree_on_failure(*replicas, "save_checkpoint", failure))
    std::rethrow_exception(agreed);
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

// Out of the class: a throw here destroys the pending save's pointer, whose type is defined
// above, in the bodies that compiled-once units do not see.
template <backend B, element P, element G>
async_checkpointer<B, P, G>::async_checkpointer(training_state<B, P, G>& state) : state_(&state) {
  if (state.replica_count() > 1)
    throw error(state.rank(), "async_checkpointer", "an asynchronous save of a state with replicas is not supported",
                "save a hybrid-sharded state with save_checkpoint");
}

template <backend B, element P, element G>
async_checkpointer<B, P, G>::~async_checkpointer() {
  // Not agreed on (that takes every rank): committed only if rank 0's writer already had every
  // key; otherwise the files stay in DIR/.cohort, never loaded, removed by the next save.
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
  detail::record_checkpoint_save(state_->options().timeline, *pending);
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

  // Every rank reads the same index and checks it the same way; the verdict is agreed all the
  // same (a file system may fail one rank alone), so no rank goes on while another gave up.
  detail::checkpoint_manifest manifest;
  std::vector<std::size_t> in_manifest;
  detail::checkpoint_together(group, operation, [&] {
    manifest = detail::read_checkpoint_manifest(checkpoint, rank);
    std::vector<std::string> names;
    std::vector<std::uint64_t> counts;
    for (std::size_t r = 0; r < regions.size(); ++r) {
      names.push_back(detail::checkpoint_region_name(regions, r));
      counts.push_back(regions[r].count);
    }
    in_manifest = detail::match_checkpoint(manifest, checkpoint, names, counts, std::string(to_string(dtype_v<master>)),
                                           tensors, rank);
  });

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
  std::uint64_t bytes_read = 0;
  std::vector<detail::checkpoint_part> parts;
  const auto read_began = std::chrono::steady_clock::now();
  detail::checkpoint_together(
      group, operation, [&] { bytes_read = detail::read_checkpoint(checkpoint, manifest, needs, {}, rank, parts); });
  // The blocks that straddle two ranks' reads: verified from every reader's part, on every
  // rank alike, before any of it reaches the state.
  detail::check_checkpoint_parts(checkpoint, manifest, detail::gather_checkpoint_parts(group, parts), rank);

  const auto copy_began = std::chrono::steady_clock::now();
  for (std::size_t t = 0, at = 0; t < tensors.size(); ++t)
    for (const auto& s : segments) {
      engine.copy(state.checkpoint_data(t, s), staged.data() + at, s.count * sizeof(master));
      at += s.count;
    }
  engine.record().wait();
  if (timeline* recorder = state.options().timeline) {
    const auto copied = std::chrono::steady_clock::now();
    recorder->add_track_span(timeline::checkpoint_file_track, "checkpoint: file", "checkpoint: read and verify",
                             timeline_category::checkpoint, recorder->step(), read_began, copy_began);
    recorder->add_track_span(timeline::checkpoint_copy_track, "checkpoint: copies",
                             "checkpoint: copy from host staging", timeline_category::checkpoint, recorder->step(),
                             copy_began, copied);
  }
  state.finish_checkpoint_load(manifest.optimizer_steps);
  if (state.options().scaler && manifest.scaler) state.options().scaler->restore(*manifest.scaler);

  checkpoint_info info;
  info.path = checkpoint;
  info.step = manifest.step;
  info.optimizer_steps = manifest.optimizer_steps;
  info.world_size = manifest.world_size;
  info.strategy = manifest.strategy;
  info.metadata = manifest.metadata;
  info.run = manifest.run;
  info.job = manifest.job;
  info.bytes_read = bytes_read;
  info.seconds = detail::seconds_since(started);
  return info;
}

template <backend B, element P, element G>
std::optional<checkpoint_info> resume_checkpoint(training_state<B, P, G>& state, const std::string& directory,
                                                 const resume_options& options) {
  constexpr std::string_view operation = "resume_checkpoint";
  auto& group = state.group();
  process_group<B>* replicas = state.replica_count() > 1 ? state.replicas() : nullptr;
  // The job's rank 0 (the first copy's, with replicas) speaks for the job: it takes the
  // directory's lock and decides which checkpoint every rank loads, even while the directory
  // changes under them.
  const bool leader = group.rank() == 0 && (!replicas || replicas->rank() == 0);
  // A verdict of the group's ranks, then of the copies: every rank of the job throws alike.
  const auto agree = [&](std::exception_ptr failure) {
    failure = detail::agree_on_failure(group, operation, failure);
    if (replicas) failure = detail::agree_on_failure(*replicas, operation, failure);
    return failure;
  };
  detail::resume_candidates opened;  // the leader's
  {
    std::exception_ptr failure;
    if (leader) try {
        opened = detail::open_checkpoints_for_resume(directory, group.rank(), operation);
      } catch (...) {
        failure = std::current_exception();
      }
    if (const auto agreed = agree(failure)) std::rethrow_exception(agreed);
  }
  std::vector<std::string> skipped;
  for (std::size_t k = 0;; ++k) {
    std::int64_t next =
        leader && k < opened.newest_first.size() ? static_cast<std::int64_t>(opened.newest_first[k]) : -1;
    broadcast_values(group, std::span<std::int64_t>(&next, 1), 0);
    if (replicas) broadcast_values(*replicas, std::span<std::int64_t>(&next, 1), 0);
    if (next < 0) break;
    const std::string path =
        detail::text(directory, "/", detail::checkpoint_step_name(static_cast<std::uint64_t>(next)));
    std::exception_ptr failure;
    checkpoint_info info;
    try {
      info = load_checkpoint(state, path);
    } catch (const checkpoint_damaged_error&) {
      failure = std::current_exception();
    }
    // With replicas each copy loads on its own: one that failed makes every copy go on.
    if (replicas) failure = detail::agree_on_failure(*replicas, operation, failure);
    if (!failure) {
      // Whose it is, judged by the leader against the directory's run; a refusal is every rank's.
      std::exception_ptr other_run;
      if (leader) try {
          detail::check_checkpoint_run(directory, path, info, opened.locked, options.refuse_other_run, group.rank());
        } catch (...) {
          other_run = std::current_exception();
        }
      if (const auto agreed = agree(other_run)) std::rethrow_exception(agreed);
      info.skipped = std::move(skipped);
      return info;
    }
    try {
      std::rethrow_exception(failure);
    } catch (const checkpoint_damaged_error& damaged) {
      if (!options.fall_back) throw;
      skipped.push_back(detail::text(path, ": ", damaged.detail()));
      if (leader) detail::checkpoint_warning(group.rank(), detail::text("skipping ", skipped.back()));
    }
  }
  if (skipped.empty()) return std::nullopt;
  std::string all;
  for (const auto& s : skipped) all += detail::text((all.empty() ? "" : "; "), s);
  throw checkpoint_damaged_error(group.rank(), operation,
                                 detail::text("no intact checkpoint in ", directory, ": ", all),
                                 "every checkpoint there is damaged: start afresh, or restore one from a copy");
}

}  // namespace cohort::inline v0
