#pragma once
// Checkpoints of a training_state (cohort/parallel/training_state.hpp) that survive a crash
// and load at another world size and under another strategy:
//
//   cohort::save_checkpoint(state, "ckpt", step, {.metadata = {{"epoch", "3"}, {"position", "1200"}}});
//   ...                                          // a later run, any world size, any strategy
//   if (auto resumed = cohort::resume_checkpoint(state, "ckpt")) first_step = resumed->step + 1;
//
// What is kept: per element the parameters (the fp32/fp64 masters where the parameters are
// narrower), Adam's two moments or SGD's momentum; the optimizer's step count, the loss
// scaler's state, the trainer's step and its key/value metadata (sampler epoch and position,
// seeds).
//
// On disk, DIR/step-<N>/ holds one file per rank of the saving run, rank-<r>.bin, and one
// index, manifest.json. Every rank writes its own file in parallel: its shard of every bucket
// (under ddp too, so no byte is written twice), tensor after tensor, each tensor's segments
// back to back (so the index states no offsets: they follow from the segments' counts). The
// index names each region's element count and shape, the masters' dtype and, for each file,
// which elements of which region its segments hold, with a checksum per block of the file
// and one over the blocks; the last line is a checksum of everything before it, verified
// before anything in the index is used.
//
// The directory contract (docs/design.md "Checkpoints"): cohort creates, renames and deletes
// only DIR/step-<N> directories holding a cohort index and what lies in DIR/.cohort/, its own
// folder; every other entry of DIR is never touched. Where DIR/.cohort exists, a step-<N>
// holding a manifest.json is cohort's whatever its bytes: an unreadable index is a damaged
// checkpoint, never a stranger's. DIR/.cohort/run names the run DIR belongs to (made at the
// first save, kept across relaunches); each index records it and the launcher's job id, and
// a resume refuses a checkpoint of another run (resume_options::refuse_other_run). One job at a time: rank 0 holds an
// flock on DIR/.cohort/lock for as long as its process lives (the kernel releases it when
// the process ends, however it ends), and a second job's save or resume is refused at once,
// naming the first (host, pid, program, since when).
//
// Atomic: the files go into DIR/.cohort/staging-<N>-<random>, each fsynced; rank 0 writes the
// index last, then renames the directory to DIR/step-<N> and fsyncs DIR. A crash at any moment
// leaves the previous step-<M> intact; what a crash leaves in DIR/.cohort is removed by the
// next save. Pruning (all but the last `keep_last` checkpoints) first renames a checkpoint
// into DIR/.cohort (one atomic step: it is gone from DIR whole), then deletes it there.
//
// Streamed: a rank's state goes to its file through a staging pool of at most
// checkpoint_options::staging_bytes (the state once by default) in chunks of whole checksum
// blocks, copied in as one writer thread drains them (write, start of the write-back, the
// blocks' checksums; fsync at the end). The synchronous and the asynchronous save share it.
//
// Committed as soon as every file is durable: each rank's writer publishes its block checksums
// (or its failure) under the save's key in the group's store; rank 0's writer waits for every
// rank's key (short polls, never holding the store for long), writes the index, renames and
// prunes. No collective of the trainer's is needed: with a save every K steps, a crash after
// step k resumes after the newest save whose files were all durable, so it loses at most
// K - 1 steps, plus the steps trained while the newest save was being written when the crash
// came during that write. The next save() or wait() agrees on the outcome (a small
// all-gather): an error of any rank's write is raised on every rank with that rank's own
// message (the file, the errno); a save rank 0 did not commit in the background (it stopped
// early) is committed there collectively; the keys are deleted.
//
// Loads anywhere: each rank reads, from whichever files hold them, exactly the bytes of its
// new shard (counted); ranks that hold copies (ddp's everything, zero1/zero2's parameters)
// gather them from the others, so each byte is read once in all. Only regular files are
// opened, never through a symlink (a FIFO or device in the checkpoint fails at once, named).
// Every block is verified: by the rank that read it whole, or, where it straddles two ranks'
// shards, on every rank from the checksum parts each reader sent (the block checksum is
// linear). A refusal is agreed: every rank throws, with the refusing rank's own message.
// Another model's regions, optimizer or dtype is a checkpoint_mismatch_error naming the
// region, the sizes and the file; a damaged checkpoint (its index, a file missing or altered)
// a checkpoint_damaged_error naming the file, and, for a block, the rank that wrote it and
// the ranks that read it.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/parallel/loss_scaler.hpp"
#include "cohort/parallel/training_state.hpp"

namespace cohort::inline v0 {

struct checkpoint_options {
  // The trainer's own state, restored with the rest: sampler epoch and position, seeds.
  std::map<std::string, std::string> metadata = {};
  std::size_t keep_last = 3;  // complete checkpoints kept in the directory; 0 keeps all
  // Checksum granularity: what a damaged file's error points at, and one index entry each.
  // A load reads the same bytes whatever it is (each rank its shard's, a block shared at a
  // shard edge checked from both parts), so smaller blocks only lengthen the index.
  std::size_t block_bytes = std::size_t{1} << 20;
  // Host memory a save stages the rank's state through; 0: the rank's state once (a
  // synchronous save uses at most four 8 MiB chunks of it). Below the state (at least one
  // block), the state streams through it: the copy ends once the last chunk is in, so the next
  // step() waits for the write of all but the bound's worth.
  std::size_t staging_bytes = 0;
};

struct checkpoint_info {
  std::string path;                   // DIR/step-<N>
  std::uint64_t step = 0;             // the trainer's step, as save_checkpoint was given it
  std::uint64_t optimizer_steps = 0;  // updates the optimizer made (skipped steps excluded)
  int world_size = 0;                 // of the run that saved it
  std::string strategy;               // of the run that saved it
  std::map<std::string, std::string> metadata;
  // load and resume: the run that saved it (its directory's DIR/.cohort/run, kept across the
  // run's relaunches) and the launcher's job id of the job that saved it (COHORT_JOB_ID,
  // TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's; empty without one). Both empty for a
  // checkpoint of index version 3, which recorded neither.
  std::string run, job;
  std::uint64_t bytes_written = 0;  // by this rank (save)
  std::uint64_t bytes_read = 0;     // by this rank (load): its new shard; over all ranks, the checkpoint once
  double seconds = 0;               // this call, on this rank
  // resume_checkpoint: the newer checkpoints it refused as damaged, newest first, each
  // "DIR/step-<N>: why".
  std::vector<std::string> skipped;
};

// A checkpoint that does not fit this training state (another model's regions or sizes,
// another optimizer, another master dtype): the call or the configuration needs fixing, not
// the files, and resume_checkpoint does not fall back past it.
class checkpoint_mismatch_error : public error {
 public:
  using error::error;
};

// A checkpoint that is damaged or incomplete: its index fails its checksum or its checks, a
// file is missing, truncated, altered or not a regular file. An earlier checkpoint may be
// intact; resume_checkpoint falls back to it (resume_options::fall_back).
class checkpoint_damaged_error : public error {
 public:
  using error::error;
};

struct resume_options {
  // When the newest checkpoint is damaged: true loads the newest intact one and names the
  // ones skipped (checkpoint_info::skipped, and a warning on rank 0); false refuses with the
  // newest one's checkpoint_damaged_error.
  bool fall_back = true;
  // When the checkpoint to load was saved by another run than the directory's (another job's
  // checkpoint copied in): true refuses it, on every rank, with a checkpoint_mismatch_error
  // naming both runs and the job that saved it; false loads it with a warning on rank 0 (a
  // deliberate copy to continue from). A checkpoint older than run ids loads with a note.
  bool refuse_other_run = true;
};

// Collective. Saves the state after `step` (the trainer's count) as DIR/step-<step>; returns
// once the checkpoint is committed. Between steps. With replicas (hybrid sharding) every copy
// of the group holds the same state: the first copy (replica rank 0) writes it, at the
// group's size, and the others return once it is committed (their bytes_written 0).
template <backend B, element P, element G>
checkpoint_info save_checkpoint(training_state<B, P, G>& state, const std::string& directory, std::uint64_t step,
                                const checkpoint_options& options = {});

namespace detail {
template <class Master>
struct pending_checkpoint;

// Host memory a save stages through: mapped, never zero-filled, huge pages asked for, so that
// faulting it in (the first save's copy) costs one fault per 2 MiB rather than per 4 KiB.
class checkpoint_staging {
 public:
  checkpoint_staging() = default;
  COHORT_COLD explicit checkpoint_staging(std::size_t bytes);
  checkpoint_staging(checkpoint_staging&& other) noexcept;
  checkpoint_staging& operator=(checkpoint_staging&& other) noexcept;
  ~checkpoint_staging();
  char* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

// Tests only, never part of a trainer's options: a fault one rank's writer injects in the
// next save of an async_checkpointer, so that the commit agreement is tested where ranks
// differ (a real failure of a real file, not a mock of the engine).
struct checkpoint_fault {
  int rank = -1;                // no rank
  bool cannot_create = false;   // the file is created in a directory that does not exist (ENOENT)
  bool hold_published = false;  // after fsync, the checksums are held back until the process dies
  // Rank 0: the process SIGKILLs itself at this step of the commit (the index written, the
  // renames, the fsyncs, each file and directory pruning removes), counted from 0.
  int die_at_commit_step = -1;
};
struct checkpoint_fault_injection {
  template <class Saver>
  static void arm(Saver& saver, const checkpoint_fault& fault) {
    saver.next_fault_ = fault;
  }
};
}  // namespace detail

// Saves that block training hardly at all: save() begins the save (the index as of this step)
// and starts copying the state into host staging on a thread of its own, overlapping the
// trainer's next forward and backward; the state's step() (and a load) first waits for that
// copy, through the fence the state holds (training_state::checkpoint_fence()), so the
// checkpoint is this step's. The rank's file is written and fsynced on a writer thread, and
// committed by rank 0's writer thread as soon as every rank's file is durable (see the top of
// this file). The copy goes through the engine from that thread, chunk by chunk, between the
// trainer's own work (Gloo: its queue, so a chunk's memmove may wait behind a gather of the
// forward; a device backend: its stream, into pageable staging). The next save() or wait()
// (collective) agrees on the outcome: an error of any rank's write surfaces there on every
// rank, with that rank's message (the file, the errno); a save not committed in the
// background is committed there. One save in flight at a time.
//
//   cohort::async_checkpointer saver(state);
//   if (step % 100 == 0) saver.save("ckpt", step, {.metadata = ...});   // returns the previous one's info
//   ...
//   saver.wait();                                                       // before exit: commits the last
template <backend B, element P, element G>
class async_checkpointer {
 public:
  // Not with replicas (hybrid sharding): save_checkpoint saves such a state.
  explicit async_checkpointer(training_state<B, P, G>& state);
  async_checkpointer(const async_checkpointer&) = delete;
  async_checkpointer& operator=(const async_checkpointer&) = delete;
  // Waits for the write in flight; rank 0 stops waiting for the other ranks' keys. One never
  // committed stays in DIR/.cohort, never loaded, removed by the next save.
  ~async_checkpointer();

  // Collective. Agrees on the previous save (its info, or nullopt when there was none), then
  // stages this step's state and starts writing it.
  std::optional<checkpoint_info> save(const std::string& directory, std::uint64_t step,
                                      const checkpoint_options& options = {});
  // Collective. Waits for the save in flight and agrees on it; nullopt when there is none.
  std::optional<checkpoint_info> wait();

  // The last save() call (the next step()'s wait for the copy: checkpoint_fence().waited_seconds()).
  double last_blocked_seconds() const noexcept { return last_blocked_seconds_; }
  std::uint64_t staging_peak_bytes() const noexcept { return staging_peak_; }

 private:
  using pending_type = detail::pending_checkpoint<typename training_state<B, P, G>::master_type>;
  training_state<B, P, G>* state_;
  std::unique_ptr<pending_type> pending_;
  // The last save's staging pool, kept for the next: otherwise every save allocates and
  // faults in its staging inside the copy that training waits for.
  detail::checkpoint_staging spare_;
  detail::checkpoint_fault next_fault_;  // tests only: armed through detail::checkpoint_fault_injection
  friend struct detail::checkpoint_fault_injection;
  double last_blocked_seconds_ = 0;
  std::uint64_t staging_peak_ = 0;
};

// Collective. Loads DIR/step-<N> (the path a checkpoint_info names) into `state`, whatever the
// world size and strategy that saved it. The loss scaler's state goes to options().scaler.
// Nothing reaches the state unless every byte of the checkpoint the ranks read was verified.
template <backend B, element P, element G>
checkpoint_info load_checkpoint(training_state<B, P, G>& state, const std::string& checkpoint);

// Collective. Loads the newest intact checkpoint in `directory` (see resume_options); nullopt
// when there is none at all (a first run). The trainer continues after the returned step,
// with the returned metadata. Rank 0 takes the directory's lock first: a directory another
// job uses is refused on every rank, naming that job.
template <backend B, element P, element G>
std::optional<checkpoint_info> resume_checkpoint(training_state<B, P, G>& state, const std::string& directory,
                                                 const resume_options& options = {});

// The newest committed checkpoint in `directory`: DIR/step-<N> with a cohort index, largest N
// (in a directory cohort saved to, with any manifest.json: one whose index cannot be read is
// damaged, which verify and load then say).
COHORT_COLD std::optional<std::string> newest_checkpoint(const std::string& directory);

// Reads every byte of the checkpoint at `checkpoint` (file after file, a few MiB at a time)
// and checks the index and every block's checksum; the bytes read. A damaged one is a
// checkpoint_damaged_error naming the file (and, for a block, the rank that wrote it).
COHORT_COLD std::uint64_t verify_checkpoint(const std::string& checkpoint);

// The checkpoint's parameters (the masters, as saved), whatever world size wrote them, as one
// safetensors file (an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and data offsets, the raw data): one tensor per region, named and shaped as the
// region. Written atomically (a temporary sibling, fsynced, renamed). Checksums verified on
// the way.
COHORT_COLD void consolidate_checkpoint(const std::string& checkpoint, const std::string& safetensors_path);

namespace detail {

// The index's contents (manifest.json).
struct checkpoint_segment {
  std::size_t region = 0;              // in checkpoint_manifest::regions
  std::uint64_t first = 0, count = 0;  // elements of the region
};
struct checkpoint_file {
  std::string name;  // rank-<r>.bin, in the checkpoint's directory
  int rank = 0;      // that wrote it
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;         // over the block checksums
  std::vector<std::uint64_t> blocks;  // one per block_bytes of the file
  // Each tensor's part of the file holds these, in this order, back to back; the tensors'
  // parts follow each other in checkpoint_manifest::tensors' order. Segment k of tensor t
  // starts at byte (t * elements + first elements of segments 0..k-1) * element_bytes.
  std::vector<checkpoint_segment> segments;
  std::uint64_t elements = 0;  // per tensor: the segments' counts added up (derived)
};
struct checkpoint_region {
  std::string name;
  std::uint64_t count = 0;
  std::vector<std::uint64_t> shape;  // row-major; its product is count
};
struct checkpoint_manifest {
  // The run that saved it (16 hex digits: its directory's DIR/.cohort/run) and the launcher's
  // job id of the job that saved it (may be empty); both empty in an index of version 3.
  std::string run, job;
  std::uint64_t step = 0, optimizer_steps = 0, block_bytes = 0;
  std::uint64_t element_bytes = 0;  // of dtype (derived)
  int world_size = 0;
  std::string strategy, parameter_dtype;
  std::string dtype;                 // the masters', every tensor's and region's
  std::vector<std::string> tensors;  // "parameters", then the optimizer's
  std::optional<loss_scaler::saved_state> scaler;
  std::map<std::string, std::string> metadata;
  std::vector<checkpoint_region> regions;
  std::vector<checkpoint_file> files;  // by rank
};

// What an index may be, checked before anything is allocated for it or read because of it:
// a hostile or damaged index costs at most max_bytes of text plus max_memory of what parsing
// keeps, and one pass over the text (names sorted once to find duplicates: n log n).
struct checkpoint_index_limits {
  static constexpr std::size_t max_bytes = std::size_t{16} << 20;   // manifest.json, by fstat before it is read
  static constexpr std::size_t max_memory = std::size_t{32} << 20;  // its parsed contents, accounted as they grow
  static constexpr std::size_t max_name = 4096;                     // a region's name, a metadata key
  static constexpr int max_world = 1 << 20;                         // files
  static constexpr std::size_t max_tensors = 16;                    // per element
  static constexpr std::size_t max_dimensions = 16;                 // of a region's shape
  static constexpr std::uint64_t min_block = 64, max_block = std::uint64_t{1} << 30;
  static constexpr std::uint64_t max_count = std::uint64_t{1} << 56;  // elements, steps: below 2^63 in bytes
};

// The index's text: the members in a fixed order, then a last member "index_checksum", the
// block checksum of every byte before its line.
COHORT_COLD std::string checkpoint_manifest_json(const checkpoint_manifest& manifest);
// The index of the checkpoint at `checkpoint`, verified (its checksum, then every field
// against the others: files by rank, segments tiling each region once and each file's bytes
// exactly, counts, shapes, sizes, names) before it is returned; a missing, special, oversized
// or malformed one is a checkpoint_damaged_error naming the path. `operation` names the caller
// in the error.
COHORT_COLD checkpoint_manifest read_checkpoint_manifest(const std::string& checkpoint, int rank,
                                                         std::string_view operation = "load_checkpoint");
// The same from the index's text, which `path` names in errors.
COHORT_COLD checkpoint_manifest parse_checkpoint_manifest(std::string_view text, const std::string& path, int rank,
                                                          std::string_view operation);

// The index's version and its block checksums' kind: an index of another is refused by name.
// Version 1 kept FNV-1a block checksums; version 2 no checksum of the index itself and each
// piece's offset; version 3 the index checksum, segments whose offsets follow from their
// counts, region shapes; version 4 (written) adds the run and the job that saved it. Versions
// 3 and 4 are read.
inline constexpr int checkpoint_format_version = 4;
inline constexpr int checkpoint_oldest_readable_version = 3;
inline constexpr const char* checkpoint_checksum_kind = "linear32";

// A block's checksum, linear so that a block read in parts by several ranks is verified
// without any of them reading it whole: the parts' sums add up (wrapping) to the block's.
//   H(block) = mix(bytes) + sum over j of h_j * K(j)   (mod 2^64)
// h_j the block's j-th 32-bit little-endian word (the tail zero-padded), K(j) =
// lane[j % 1024] * chunk(j / 1024): 1024 odd 32-bit keys and an odd 64-bit key per 4 KiB, all
// fixed. One changed word always changes it (h_j * lane is exact in 64 bits, the chunk key
// odd). Two flipped sign bits, which FNV-1a over 64-bit words (this format's version 1) always
// missed, change it always within a chunk and elsewhere for all but about one pair of
// positions in 2^33. The inner loop is a 32x32->64 multiply-add, which vectorises: faster
// than FNV's serial chain.
COHORT_COLD std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes) noexcept;
// `bytes` bytes that lie at offset `at` of their block: their part of the sum.
COHORT_COLD std::uint64_t checkpoint_checksum_part(const void* data, std::uint64_t at, std::size_t bytes) noexcept;
// The block's checksum from its parts' sum and its length.
COHORT_COLD std::uint64_t checkpoint_checksum_finish(std::uint64_t parts, std::uint64_t bytes) noexcept;
COHORT_COLD std::uint64_t checkpoint_file_checksum(const std::vector<std::uint64_t>& blocks,
                                                   std::uint64_t bytes) noexcept;

COHORT_COLD std::string checkpoint_file_name(int rank);            // rank-00003.bin
COHORT_COLD std::string checkpoint_step_name(std::uint64_t step);  // step-<N>
// DIR/.cohort/staging-<N>-<nonce>: cohort's own folder holds every save in progress.
COHORT_COLD std::string checkpoint_staging_path(const std::string& directory, std::uint64_t step, std::uint64_t nonce);

// DIR's committed checkpoints, by step, and what looks like one without being cohort's
// (step-* names that are not a canonical step number, or hold no manifest.json, or, where DIR
// has no DIR/.cohort, one that does not begin as a cohort index; symlinks): those are never
// loaded, renamed or deleted.
struct checkpoint_listing {
  std::vector<std::pair<std::uint64_t, std::string>> committed;  // step, DIR/step-<N>; oldest first
  std::vector<std::string> ignored;                              // "DIR/name: why"
};
COHORT_COLD checkpoint_listing list_checkpoints(const std::string& directory);

// DIR made, with its parents, where missing; a failure is the error_code's message, empty on
// success. Compiled with the rest, so the checkpoint templates need not include <filesystem>.
COHORT_COLD std::string create_checkpoint_directory(const std::string& directory);
// 64 bits from std::random_device: a staging directory's nonce, a run's id.
COHORT_COLD std::uint64_t random_checkpoint_bits();
// Rank 0 of a job that saves to or resumes from DIR: DIR/.cohort made, its lock taken (or
// found held by this process already). Another process holding it is a cohort::error naming
// it: its host, pid, program and since when. The lock is held until the process ends.
// `required` false (a resume): a DIR this process cannot write is not locked (a warning, and
// false): no job of this user can change it.
COHORT_COLD bool lock_checkpoint_directory(const std::string& directory, int rank, std::string_view operation,
                                           bool required = true);
// A resume's start on the job's rank 0: DIR made (so that its lock holds from the start of
// the job), its lock taken where DIR is writable, what the listing ignores warned of, and the
// committed steps, newest first. Compiled with the rest: the resume template, which every
// trainer's unit that resumes instantiates, does not instantiate the listing's containers.
struct resume_candidates {
  std::vector<std::uint64_t> newest_first;
  bool locked = false;  // DIR is this job's to write
};
COHORT_COLD resume_candidates open_checkpoints_for_resume(const std::string& directory, int rank,
                                                          std::string_view operation);
// The run a checkpoint directory belongs to: DIR/.cohort/run (16 hex digits), made at the
// first save into DIR and kept across the run's relaunches; empty where there is none yet.
COHORT_COLD std::string read_checkpoint_run(const std::string& directory);
// Rank 0 holding DIR's lock: DIR/.cohort/run, written as `run` (a fresh random one when empty)
// where there is none yet; the run it holds.
COHORT_COLD std::string claim_checkpoint_run(const std::string& directory, int rank, std::string_view operation,
                                             const std::string& run = {});
// The launcher's job id of this process's job (launch_env::run_id); empty without one.
COHORT_COLD std::string launcher_job_id();
// The leader of a resume, once `checkpoint` (DIR/step-<N>) loaded as `loaded`: is it DIR's
// run's? Another run's is a checkpoint_mismatch_error naming both runs and the job that saved
// it, or, `refuse_other_run` false, a warning; one older than run ids is a note. A DIR without
// a run yet takes the checkpoint's (where `locked`: DIR is this job's), so the run keeps it.
COHORT_COLD void check_checkpoint_run(const std::string& directory, const std::string& checkpoint,
                                      const checkpoint_info& loaded, bool locked, bool refuse_other_run, int rank);
// Rank 0, before a save: DIR created and locked, what interrupted saves and prunes left in
// DIR/.cohort removed, the staging directory created; the directory's run (claimed). A
// DIR/step-<step> that is not a cohort checkpoint is refused (never replaced).
COHORT_COLD std::string begin_checkpoint(const std::string& directory, const std::string& staging, std::uint64_t step,
                                         int rank);
// One rank's file, written as it streams in: created by the constructor, appended chunk by
// chunk (each a whole number of blocks but the last; its write-back started at once, so the
// final fsync finds little left), finished by fsync and close. A failure is a cohort::error
// naming the path and the errno.
class checkpoint_file_writer {
 public:
  // `failed_errno` receives the errno of a failure, for the other ranks' errors. `operation`
  // and `hint` are what a failure names: each caller knows what is left intact when it fails.
  COHORT_COLD checkpoint_file_writer(
      std::string path, std::size_t block_bytes, int rank, int& failed_errno,
      std::string_view operation = "save_checkpoint",
      std::string_view hint = "free space or fix permissions; the previous checkpoint is intact");
  checkpoint_file_writer(const checkpoint_file_writer&) = delete;
  checkpoint_file_writer& operator=(const checkpoint_file_writer&) = delete;
  ~checkpoint_file_writer();
  COHORT_COLD void append(const char* data, std::size_t bytes);
  // fsync and close; the checksums of the file's blocks.
  COHORT_COLD std::vector<std::uint64_t> finish();

 private:
  COHORT_COLD error failure(const std::string& what);
  std::string path_;
  std::size_t block_bytes_;
  int rank_;
  std::string operation_, hint_;
  int fd_ = -1;
  std::uint64_t written_ = 0;
  std::vector<std::uint64_t> blocks_;
  int& failed_errno_;
};
// A rank's published outcome (its key in the group's store): failed or not, the errno, the
// block checksums.
COHORT_COLD std::vector<std::uint8_t> checkpoint_outcome_bytes(bool failed, int failed_errno,
                                                               const std::vector<std::uint64_t>& blocks);
COHORT_COLD bool parse_checkpoint_outcome(std::span<const std::uint8_t> value, bool& failed, int& failed_errno,
                                          std::vector<std::uint64_t>& blocks);
// Rank 0, once every file is durable: the index written (fsynced) into the staging directory,
// which is renamed to DIR/step-<N>; DIR fsynced; all but the newest keep_last pruned (each
// renamed into DIR/.cohort, then deleted there). `fault`: tests' kill points.
COHORT_COLD void commit_checkpoint(const std::string& directory, const std::string& staging,
                                   const checkpoint_manifest& manifest, std::size_t keep_last, int rank,
                                   const checkpoint_fault& fault = {});

// What a loading rank needs: elements [first, first + count) of a region's tensor into `into`.
struct checkpoint_need {
  std::size_t tensor = 0, region = 0;  // in the manifest's lists
  std::uint64_t first = 0, count = 0;
  void* into = nullptr;
};
// Refuses a checkpoint of another model (region names, counts), dtype or optimizer with a
// checkpoint_mismatch_error naming the region, the sizes and the index file; for each of
// `regions`, its index in the manifest.
COHORT_COLD std::vector<std::size_t> match_checkpoint(const checkpoint_manifest& manifest,
                                                      const std::string& checkpoint,
                                                      const std::vector<std::string>& region_names,
                                                      const std::vector<std::uint64_t>& region_counts,
                                                      const std::string& dtype, const std::vector<std::string>& tensors,
                                                      int rank);
// Bytes [offset, offset + bytes) of manifest.files[file].
struct checkpoint_range {
  std::size_t file = 0;
  std::uint64_t offset = 0, bytes = 0;
};
// What a rank read of a block it did not read whole: its part of the block's checksum.
struct checkpoint_part {
  std::size_t file = 0;
  std::uint64_t block = 0, sum = 0, bytes = 0;
  int reader = 0;  // the rank
};
// Reads exactly what `needs` names, and the `also_verify` ranges, from the files that hold
// them (each a regular file of the checkpoint's directory, its size the index's): neighbouring
// ranges in one read, nothing between them. Every block read whole is verified here; for
// each block read only in part, its part is appended to `parts`, for check_checkpoint_parts
// once every rank's parts are together. Returns the bytes read.
COHORT_COLD std::uint64_t read_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                          const std::vector<checkpoint_need>& needs,
                                          const std::vector<checkpoint_range>& also_verify, int rank,
                                          std::vector<checkpoint_part>& parts);
// One process reading on its own (the tools, not a load): exactly what `needs` names, and
// every block it lies in verified (a block read only in part is read whole once more). The
// bytes read.
COHORT_COLD std::uint64_t read_checkpoint_verified(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                                   const std::vector<checkpoint_need>& needs);
// Every rank's parts of the blocks read in parts: each block's sum must be its checksum and
// its parts must cover it exactly. A mismatch is a checkpoint_damaged_error naming the file,
// the rank that wrote it, the block and the ranks that read it; the same on every rank given
// the same parts.
COHORT_COLD void check_checkpoint_parts(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                        std::vector<checkpoint_part> parts, int rank);

// safetensors' dtype name of a checkpoint dtype ("float" -> "F32"); empty for none.
COHORT_COLD std::string safetensors_dtype(const std::string& dtype);
// What cohort-ckpt inspect prints: the run, then per region its name, dtype, shape, elements
// and bytes per tensor, then the files.
COHORT_COLD std::string describe_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest);
// "cohort [rank r] warning: ..." on stderr, one write.
COHORT_COLD void checkpoint_warning(int rank, std::string_view message);

}  // namespace detail
}  // namespace cohort::inline v0

// Compiled once, the templates' bodies are the library's unit's (and those that ask for them).
#if !defined(COHORT_SEPARATE_COMPILATION) || defined(COHORT_TEMPLATE_BODIES)
#include "cohort/parallel/impl/checkpoint.hpp"
#endif

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/checkpoint.ipp"
#endif
