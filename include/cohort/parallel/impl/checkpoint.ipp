#pragma once
// cohort/parallel/checkpoint.hpp's definitions, part two: the directory contract (listing,
// lock, staging, commit, pruning), the writer of the ranks' files, the reader of them, and
// verify, consolidate and inspect; part one (impl/checkpoint_index.ipp) is the index.
// Header-only, cold templates (COHORT_COLD, cohort/config.hpp: only a unit that saves, loads
// or inspects a checkpoint instantiates them); compiled once by <cohort/src.hpp> under
// COHORT_SEPARATE_COMPILATION.
// Over 400 lines: the directory's rules and the files' reader and writer, one format's halves.

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/files.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/parallel/impl/checkpoint_index.ipp"
#include "cohort/rendezvous/detail/hmac.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/tools/detail/json_cursor.hpp"

namespace cohort::inline v0 {

// ---- the directory -----------------------------------------------------------------------------

namespace detail {
namespace {

// Whether DIR carries cohort's contract: its own folder DIR/.cohort (a real directory), which
// every save and every resume that could write made. There, a step-<N> directory with an index
// is cohort's whatever the index's bytes say: damage in its first bytes is damage, which the
// index's reader names, never a reason to take the checkpoint for a stranger's and skip it.
COHORT_COLD bool carries_cohort_contract(int directory_fd) {
  struct stat status {};
  return ::fstatat(directory_fd, checkpoint_own_folder, &status, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(status.st_mode);
}

// Why DIR/<name> is not a committed cohort checkpoint, or nullptr when it is one: a directory
// (not a symlink) holding a manifest.json that, in a directory carrying cohort's contract, is
// there at all, and elsewhere is a regular file that begins as every cohort index has, of any
// version. Only those are loaded, replaced or pruned; a damaged one is refused by its reader.
COHORT_COLD const char* not_a_checkpoint(int directory_fd, const std::string& name, bool cohort_directory) {
  struct stat status {};
  if (::fstatat(directory_fd, name.c_str(), &status, AT_SYMLINK_NOFOLLOW) != 0) return "cannot be read";
  if (!S_ISDIR(status.st_mode)) return S_ISLNK(status.st_mode) ? "is a symbolic link" : "is not a directory";
  checkpoint_fd checkpoint(::openat(directory_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (checkpoint.get() < 0) return "cannot be read";
  if (::fstatat(checkpoint.get(), "manifest.json", &status, AT_SYMLINK_NOFOLLOW) != 0) return "holds no cohort index";
  if (cohort_directory) return nullptr;
  if (!S_ISREG(status.st_mode)) return "holds no cohort index";
  checkpoint_fd index(::openat(checkpoint.get(), "manifest.json", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  constexpr std::string_view head = "{\n \"format\": \"cohort-checkpoint\"";
  char start[head.size()];
  if (index.get() < 0 || ::pread(index.get(), start, head.size(), 0) != static_cast<ssize_t>(head.size()) ||
      std::string_view(start, head.size()) != head)
    return "holds no cohort index";
  return nullptr;
}

// Who this process is, as the directory's lock records it: host, pid and the process's start
// time (pid and start together name one process of a host), the program, and the time.
struct lock_holder {
  std::string host, pid, start, program, since;
  bool same_process(const lock_holder& other) const {
    return host == other.host && pid == other.pid && start == other.start;
  }
  std::string text() const {
    return detail::text("host ", host, "\npid ", pid, "\nstart ", start, "\nprogram ", program, "\nsince ", since,
                        "\n");
  }
  std::string describe() const {
    if (pid.empty()) return "a process that has not yet written who it is";
    return detail::text("pid ", pid, " (", program, ") on host ", host, ", since ", since);
  }
};

// `text` as `path`, whole or not at all: a temporary sibling (<path>.<pid>) renamed over it.
// False on a failure (errno says which), the temporary removed.
COHORT_COLD bool write_small_file(const std::string& path, const std::string& text) {
  const std::string temporary = detail::text(path, ".", std::to_string(::getpid()));
  checkpoint_fd out(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (out.get() >= 0 && ::write(out.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
      out.close() == 0 && ::rename(temporary.c_str(), path.c_str()) == 0)
    return true;
  const int code = errno;
  ::unlink(temporary.c_str());
  errno = code;
  return false;
}

COHORT_COLD lock_holder this_process() {
  lock_holder me;
  char host[256] = {};
  me.host = ::gethostname(host, sizeof host - 1) == 0 ? host : "?";
  me.pid = std::to_string(::getpid());
  // /proc/self/stat: "pid (comm) state ..." with the start time the 22nd field; comm may hold
  // spaces and parentheses, so fields are counted after the last ')'.
  const std::string stat = read_small_file("/proc/self/stat");
  if (const auto close = stat.rfind(')'); close != std::string::npos) {
    std::size_t at = close + 2;
    for (int field = 3; field < 22 && at < stat.size(); ++field) at = stat.find(' ', at) + 1;
    me.start = stat.substr(at, stat.find(' ', at) - at);
  }
  me.program = read_small_file("/proc/self/comm");
  while (!me.program.empty() && me.program.back() == '\n') me.program.pop_back();
  if (me.program.empty()) me.program = "?";
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
  me.since = when;
  return me;
}

COHORT_COLD lock_holder parse_holder(const std::string& text) {
  lock_holder holder;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    const std::size_t space = line.find(' ');
    const std::string key = line.substr(0, space), value = space == std::string::npos ? "" : line.substr(space + 1);
    if (key == "host") holder.host = value;
    if (key == "pid") holder.pid = value;
    if (key == "start") holder.start = value;
    if (key == "program") holder.program = value;
    if (key == "since") holder.since = value;
    at = end + 1;
  }
  return holder;
}

// DIR/.cohort, made if it is not there; anything else by that name is refused.
COHORT_COLD std::string own_folder(const std::string& directory, int rank, std::string_view operation) {
  const std::string folder = path_in(directory, checkpoint_own_folder);
  if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST)
    throw error(rank, operation, detail::text("cannot create ", folder, ": ", std::strerror(errno)),
                "the checkpoint directory must be writable by rank 0");
  struct stat status {};
  if (::lstat(folder.c_str(), &status) != 0 || !S_ISDIR(status.st_mode))
    throw error(
        rank, operation,
        detail::text(folder, " is ", file_kind(status.st_mode), ", not the folder cohort keeps its own files in"),
        "move it away: cohort uses DIR/.cohort for its lock and its saves in progress");
  return folder;
}

}  // namespace

COHORT_COLD_BODY checkpoint_listing list_checkpoints(const std::string& directory) {
  checkpoint_listing out;
  directory_stream entries(directory);
  if (!entries.stream) return out;
  const int directory_fd = ::dirfd(entries.stream);
  const bool cohort_directory = carries_cohort_contract(directory_fd);
  for (std::string name = entries.next(); !name.empty(); name = entries.next()) {
    if (name.rfind("step-", 0) != 0) continue;
    std::uint64_t step = 0;
    if (!parse_step_name(name, step)) {
      out.ignored.push_back(detail::text(path_in(directory, name),
                                         ": not a step number cohort writes (step-<N>, N without leading zeros, "
                                         "below 2^56); never loaded, renamed or deleted"));
      continue;
    }
    if (const char* why = not_a_checkpoint(directory_fd, name, cohort_directory))
      out.ignored.push_back(detail::text(path_in(directory, name), ": ", why,
                                         ", so not a cohort checkpoint; never loaded, renamed or deleted"));
    else
      out.committed.emplace_back(step, path_in(directory, name));
  }
  std::sort(out.committed.begin(), out.committed.end());
  std::sort(out.ignored.begin(), out.ignored.end());
  return out;
}

COHORT_COLD_BODY bool lock_checkpoint_directory(const std::string& directory, int rank, std::string_view operation,
                                                bool required) {
  if (!required && ::access(directory.c_str(), W_OK) != 0) {
    checkpoint_warning(rank, detail::text(directory, " is not writable here (", std::strerror(errno),
                                          "): read without its lock, which only a job that can save there needs"));
    return false;
  }
  const std::string folder = own_folder(directory, rank, operation);
  const std::string lock_path = path_in(folder, "lock"), holder_path = path_in(folder, "holder");
  const lock_holder me = this_process();
  // This process holds it already: the lock's own file is not opened again (under NFS, flock
  // is a POSIX lock, which closing any descriptor of the file would release).
  if (parse_holder(read_small_file(holder_path)).same_process(me)) return true;
  checkpoint_fd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (lock.get() < 0)
    throw error(rank, operation, detail::text("cannot open the lock ", lock_path, ": ", std::strerror(errno)),
                "the checkpoint directory must be writable by rank 0");
  if (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    const int code = errno;
    if (code == EWOULDBLOCK)
      throw error(rank, operation,
                  detail::text(directory, " is in use by another job: ",
                               parse_holder(read_small_file(holder_path)).describe(), " holds ", lock_path),
                  "one job at a time per checkpoint directory: give this job its own, or stop the other (its lock "
                  "goes with its process)");
    throw error(rank, operation, detail::text("cannot lock ", lock_path, ": ", std::strerror(code)),
                "the file system must support flock (NFS with locking, Lustre mounted with -o flock)");
  }
  // What a holder killed between writing a temporary and renaming it left (holder.<pid>,
  // run.<pid> of a process that is gone): the lock is this process's now, so no other one
  // writes there.
  {
    directory_stream entries(folder);
    for (std::string name = entries.next(); !name.empty(); name = entries.next())
      if (name.rfind("holder.", 0) == 0 || name.rfind("run.", 0) == 0)
        ::unlinkat(::dirfd(entries.stream), name.c_str(), 0);
  }
  // Who holds it, for the next job's error: written whole.
  if (!write_small_file(holder_path, me.text()))
    throw error(rank, operation, detail::text("cannot write ", holder_path, ": ", std::strerror(errno)),
                "the checkpoint directory must be writable by rank 0");
  // Held for as long as this process lives: no object of a trainer's spans a whole job (saves
  // and resumes are calls), and the kernel releases it however the process ends, so no stale
  // lock outlives its job.
  (void)lock.release();
  return true;
}

COHORT_COLD_BODY resume_candidates open_checkpoints_for_resume(const std::string& directory, int rank,
                                                               std::string_view operation) {
  // One this job cannot write (a published checkpoint to start from) no job of this user can
  // change under it: resumed from without a lock.
  create_checkpoint_directory(directory);  // a failure is the lock's to name
  resume_candidates out;
  out.locked = lock_checkpoint_directory(directory, rank, operation, false);
  const auto listing = list_checkpoints(directory);
  for (const auto& ignored : listing.ignored) checkpoint_warning(rank, ignored);
  for (auto it = listing.committed.rbegin(); it != listing.committed.rend(); ++it)
    out.newest_first.push_back(it->first);
  return out;
}

COHORT_COLD_BODY std::string read_checkpoint_run(const std::string& directory) {
  std::string run = read_small_file(path_in(path_in(directory, checkpoint_own_folder), "run"));
  while (!run.empty() && run.back() == '\n') run.pop_back();
  std::uint64_t value = 0;
  return parse_hex64(run, value) ? run : std::string();
}

COHORT_COLD_BODY std::string create_checkpoint_directory(const std::string& directory) {
  const auto failure = make_directories(directory);
  return failure ? failure.message() : std::string{};
}

COHORT_COLD_BODY std::uint64_t random_checkpoint_bits() {
  // The kernel's generator (which std::random_device reads), without <random> in every unit.
  std::array<std::uint8_t, 8> bytes{};
  if (!random_bytes(bytes))
    throw std::system_error(errno, std::generic_category(), "no random source (getrandom, /dev/urandom)");
  std::uint64_t bits = 0;
  for (const auto b : bytes) bits = bits << 8 | b;
  return bits;
}

COHORT_COLD_BODY std::string claim_checkpoint_run(const std::string& directory, int rank, std::string_view operation,
                                                  const std::string& run) {
  if (auto held = read_checkpoint_run(directory); !held.empty()) return held;
  std::string claimed = run;
  if (claimed.empty()) claimed = hex64(random_checkpoint_bits());
  const std::string path = path_in(path_in(directory, checkpoint_own_folder), "run");
  if (!write_small_file(path, claimed + "\n"))
    throw error(rank, operation, detail::text("cannot write ", path, ": ", std::strerror(errno)),
                "the checkpoint directory must be writable by rank 0");
  return claimed;
}

COHORT_COLD_BODY std::string launcher_job_id() {
  // Detection refuses an inconsistent environment, which the job's rendezvous reported
  // already: the checkpoint then records no job id rather than failing the save.
  try {
    return launch_env::detect().run_id;
  } catch (const error&) {
    return {};
  }
}

COHORT_COLD_BODY void check_checkpoint_run(const std::string& directory, const std::string& checkpoint,
                                           const checkpoint_info& loaded, bool locked, bool refuse_other_run,
                                           int rank) {
  constexpr std::string_view operation = "resume_checkpoint";
  if (loaded.run.empty()) {
    checkpoint_warning(
        rank, detail::text(checkpoint, " was saved before checkpoints recorded their run (index version 3): loaded ",
                           "without checking that it is ", directory, "'s run's; the next save records the run"));
    return;
  }
  const std::string ours = read_checkpoint_run(directory);
  if (ours.empty()) {
    if (locked) claim_checkpoint_run(directory, rank, operation, loaded.run);
    return;
  }
  if (ours == loaded.run) return;
  const std::string why = detail::text(checkpoint, " was saved by run ", loaded.run,
                                       (loaded.job.empty() ? std::string(" (a job without a launcher's job id)")
                                                           : detail::text(" (job ", loaded.job, ")")),
                                       ", but ", directory, " belongs to run ", ours, " (",
                                       path_in(path_in(directory, checkpoint_own_folder), "run"),
                                       "): another job's checkpoint, copied in?");
  if (refuse_other_run)
    throw checkpoint_mismatch_error(rank, operation, why,
                                    "move it out of the directory (this run's newest then resumes), or pass "
                                    "resume_options{.refuse_other_run = false} to continue from it deliberately");
  checkpoint_warning(rank, detail::text(why, " Loaded anyway (resume_options::refuse_other_run is false)."));
}

COHORT_COLD_BODY std::string begin_checkpoint(const std::string& directory, const std::string& staging,
                                              std::uint64_t step, int rank) {
  constexpr std::string_view operation = "save_checkpoint";
  if (const auto failure = create_checkpoint_directory(directory); !failure.empty())
    throw error(rank, operation, detail::text("cannot create ", directory, ": ", failure),
                "the checkpoint directory must be writable by the ranks that save");
  // Judged before the lock makes DIR/.cohort: a directory cohort never saved to keeps the
  // stricter test for an entry of the step's name.
  const bool cohort_directory = [&] {
    checkpoint_fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    return dir.get() >= 0 && carries_cohort_contract(dir.get());
  }();
  lock_checkpoint_directory(directory, rank, operation);
  // What interrupted saves and prunes of this directory left: cohort's own (the lock says no
  // other job uses the directory, and saves are collective, so none of this job is under way).
  const std::string folder = path_in(directory, checkpoint_own_folder);
  {
    directory_stream entries(folder);
    // What cannot be removed now is removed by the next save.
    for (std::string name = entries.next(); !name.empty(); name = entries.next())
      if (name.rfind("staging-", 0) == 0 || name.rfind("pruning-", 0) == 0 || name.rfind("replaced-", 0) == 0)
        (void)remove_tree(path_in(folder, name));
  }
  const std::string target = path_in(directory, checkpoint_step_name(step));
  struct stat status {};
  if (::lstat(target.c_str(), &status) == 0) {
    checkpoint_fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (const char* why = not_a_checkpoint(dir.get(), checkpoint_step_name(step), cohort_directory))
      throw error(rank, operation,
                  detail::text(target, " exists and ", why, ": cohort replaces only its own checkpoints"),
                  "move it away, or save into another directory");
  }
  if (::mkdir(staging.c_str(), 0755) != 0)
    throw error(rank, operation, detail::text("cannot create ", staging, ": ", std::strerror(errno)),
                "the checkpoint directory must be writable by the ranks that save");
  return claim_checkpoint_run(directory, rank, operation);
}

COHORT_COLD_BODY checkpoint_staging::checkpoint_staging(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED)
    throw error(-1, "save_checkpoint",
                detail::text("cannot map ", std::to_string(bytes), " bytes of host staging: ", std::strerror(errno)),
                "lower checkpoint_options::staging_bytes: the state streams through a smaller pool");
#if defined(MADV_HUGEPAGE)
  ::madvise(at, bytes, MADV_HUGEPAGE);  // advisory: 4 KiB pages where the kernel has none
#endif
  data_ = static_cast<char*>(at);
}

COHORT_DECL checkpoint_staging::checkpoint_staging(checkpoint_staging&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

COHORT_DECL checkpoint_staging& checkpoint_staging::operator=(checkpoint_staging&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

COHORT_DECL checkpoint_staging::~checkpoint_staging() {
  if (data_) ::munmap(data_, size_);
}

COHORT_COLD_BODY checkpoint_file_writer::checkpoint_file_writer(std::string path, std::size_t block_bytes, int rank,
                                                                int& failed_errno, std::string_view operation,
                                                                std::string_view hint)
    : path_(std::move(path)),
      block_bytes_(block_bytes),
      rank_(rank),
      operation_(operation),
      hint_(hint),
      failed_errno_(failed_errno) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) throw failure("cannot create");
}

COHORT_DECL checkpoint_file_writer::~checkpoint_file_writer() {
  if (fd_ >= 0) ::close(fd_);
}

COHORT_COLD_BODY error checkpoint_file_writer::failure(const std::string& what) {
  failed_errno_ = errno;
  return error(rank_, operation_,
               detail::text(what, " ", path_, ": ", std::strerror(failed_errno_), " (errno ",
                            std::to_string(failed_errno_), ")"),
               hint_);
}

COHORT_COLD_BODY void checkpoint_file_writer::append(const char* data, std::size_t bytes) {
  // Checksums first, while the previous chunk's write-back runs in the kernel: the disk, not
  // this thread, is then what a save waits for.
  for (std::size_t done = 0; done < bytes; done += block_bytes_)
    blocks_.push_back(checkpoint_checksum(data + done, std::min(block_bytes_, bytes - done)));
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t wrote = ::write(fd_, data + done, std::min<std::size_t>(bytes - done, std::size_t{1} << 30));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      if (wrote == 0) errno = ENOSPC;  // a write of nothing: the device took no more
      throw failure("writing");
    }
    done += static_cast<std::size_t>(wrote);
  }
#if defined(__linux__)
  // Start writing these pages to the disk now rather than at the dirty threshold or the fsync:
  // the disk works while the next chunk is copied and checksummed. Advisory; an error shows at
  // the fsync.
  ::sync_file_range(fd_, static_cast<off_t>(written_), static_cast<off_t>(bytes), SYNC_FILE_RANGE_WRITE);
#endif
  written_ += bytes;
}

COHORT_COLD_BODY std::vector<std::uint64_t> checkpoint_file_writer::finish() {
  if (::fsync(fd_) != 0) throw failure("fsync of");
  const int result = ::close(std::exchange(fd_, -1));
  if (result != 0) throw failure("closing");
  return std::move(blocks_);
}

COHORT_COLD_BODY std::vector<std::uint8_t> checkpoint_outcome_bytes(bool failed, int failed_errno,
                                                                    const std::vector<std::uint64_t>& blocks) {
  std::vector<std::uint64_t> words{failed ? 1u : 0u, static_cast<std::uint64_t>(failed_errno)};
  words.insert(words.end(), blocks.begin(), blocks.end());
  std::vector<std::uint8_t> out(words.size() * sizeof(std::uint64_t));
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

COHORT_COLD_BODY bool parse_checkpoint_outcome(std::span<const std::uint8_t> value, bool& failed, int& failed_errno,
                                               std::vector<std::uint64_t>& blocks) {
  if (value.size() < 2 * sizeof(std::uint64_t) || value.size() % sizeof(std::uint64_t) != 0) return false;
  std::vector<std::uint64_t> words(value.size() / sizeof(std::uint64_t));
  std::memcpy(words.data(), value.data(), value.size());
  failed = words[0] != 0;
  failed_errno = static_cast<int>(words[1]);
  blocks.assign(words.begin() + 2, words.end());
  return true;
}

COHORT_COLD_BODY void commit_checkpoint(const std::string& directory, const std::string& staging,
                                        const checkpoint_manifest& manifest, std::size_t keep_last, int rank,
                                        const checkpoint_fault& fault) {
  constexpr std::string_view operation = "save_checkpoint";
  // Each step that changes the disk is one point a test can kill the process at: every
  // interruption must leave the previous checkpoints loadable and nothing a resume takes for
  // one, and what it leaves in DIR/.cohort must be what the next save removes.
  int point = 0;
  const auto next_step = [&] {
    if (fault.die_at_commit_step == point++) ::raise(SIGKILL);
  };
  const auto failed = [&](const std::string& what, int code) {
    return error(rank, operation, detail::text(what, ": ", std::strerror(code), " (errno ", std::to_string(code), ")"),
                 "the previous checkpoint is intact; what this save left is removed by the next save");
  };
  const std::string folder = path_in(directory, checkpoint_own_folder);
  // The index last: a directory with one is complete. Written and fsynced like the ranks'
  // files (an error names the errno), then the staging directory fsynced so its entry is.
  next_step();
  {
    int code = 0;
    checkpoint_file_writer index(path_in(staging, "manifest.json"), std::size_t{1} << 20, rank, code);
    const std::string text = checkpoint_manifest_json(manifest);
    index.append(text.data(), text.size());
    index.finish();
  }
  next_step();
  sync_directory(staging, rank);
  const std::string name = checkpoint_step_name(manifest.step), target = path_in(directory, name);
  const std::string nonce(file_name(staging).substr(8));  // after "staging-"
  // A checkpoint of the same step is replaced: the two swapped in one step where the file
  // system can (renameat2's RENAME_EXCHANGE: step-<N> is always one of them), else the old one
  // moved into DIR/.cohort first; either way it ends in DIR/.cohort, where an interruption
  // leaves it to the next save's clean-up.
  std::string aside;
  bool swapped = false;
  struct stat status {};
  if (::lstat(target.c_str(), &status) == 0) {
    checkpoint_fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (const char* why = not_a_checkpoint(dir.get(), name, carries_cohort_contract(dir.get())))
      throw error(rank, operation,
                  detail::text(target, " exists and ", why, ": cohort replaces only its own checkpoints"),
                  "move it away, or save into another directory");
    next_step();
#if defined(RENAME_EXCHANGE)
    swapped = ::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0;
    if (!swapped && errno != EINVAL && errno != ENOSYS && errno != ENOTSUP && errno != EOPNOTSUPP)
      throw failed(detail::text("cannot swap ", staging, " and ", target), errno);
#endif
    aside = swapped ? staging : path_in(folder, detail::text("replaced-", nonce));
    if (!swapped && ::rename(target.c_str(), aside.c_str()) != 0)
      throw failed(detail::text("cannot move ", target, " aside"), errno);
  }
  if (!swapped) {
    next_step();
    if (::rename(staging.c_str(), target.c_str()) != 0)
      throw failed(detail::text("cannot rename ", staging, " to ", target), errno);
  }
  next_step();
  sync_directory(directory, rank);
  if (!aside.empty()) {
    next_step();
    (void)remove_tree(aside);
  }
  if (keep_last == 0) return;
  // The newest keep_last committed checkpoints stay, this one always; the others are pruned:
  // renamed into DIR/.cohort (the one step that takes them out of DIR, whole), that rename
  // made durable, then deleted there file by file. A step-* that is not cohort's is never
  // counted or touched.
  auto committed = list_checkpoints(directory).committed;
  std::erase_if(committed, [&](const auto& c) { return c.first == manifest.step; });
  const std::size_t keep_others = keep_last - 1;
  for (std::size_t i = 0; i + keep_others < committed.size(); ++i) {
    const std::string& old = committed[i].second;
    const std::string pruning =
        path_in(folder, detail::text("pruning-", std::to_string(committed[i].first), "-", nonce));
    next_step();
    if (::rename(old.c_str(), pruning.c_str()) != 0) throw failed(detail::text("cannot prune ", old), errno);
    next_step();
    sync_directory(directory, rank);
    {
      directory_stream entries(pruning);
      for (std::string file = entries.next(); !file.empty(); file = entries.next()) {
        next_step();
        (void)remove_tree(path_in(pruning, file));
      }
    }
    next_step();
    if (::rmdir(pruning.c_str()) != 0) throw failed(detail::text("cannot remove ", pruning), errno);
  }
}

COHORT_COLD_BODY std::vector<std::size_t> match_checkpoint(const checkpoint_manifest& manifest,
                                                           const std::string& checkpoint,
                                                           const std::vector<std::string>& region_names,
                                                           const std::vector<std::uint64_t>& region_counts,
                                                           const std::string& dtype,
                                                           const std::vector<std::string>& tensors, int rank) {
  const std::string index = path_in(checkpoint, "manifest.json");
  const auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (const auto& n : names) text += detail::text((text.empty() ? "" : ", "), n);
    return detail::text("[", text, "]");
  };
  if (manifest.dtype != dtype)
    throw checkpoint_mismatch_error(
        rank, "load_checkpoint",
        detail::text(index, " holds elements of ", manifest.dtype, ", this training state's masters are ", dtype),
        "load it into a state whose masters have the checkpoint's dtype");
  if (manifest.tensors != tensors)
    throw checkpoint_mismatch_error(rank, "load_checkpoint",
                                    detail::text(index, " holds the optimizer state ", list(manifest.tensors),
                                                 ", this training state keeps ", list(tensors)),
                                    "resume with the optimizer that saved it (AdamW, or SGD with or without momentum)");
  std::map<std::string, std::size_t> saved;
  for (std::size_t r = 0; r < manifest.regions.size(); ++r) saved[manifest.regions[r].name] = r;
  std::vector<std::size_t> out(region_names.size());
  for (std::size_t r = 0; r < region_names.size(); ++r) {
    const auto found = saved.find(region_names[r]);
    if (found == saved.end())
      throw checkpoint_mismatch_error(
          rank, "load_checkpoint",
          detail::text("region '", region_names[r], "' (", std::to_string(region_counts[r]), " elements) is not in ",
                       index, ", which holds ", std::to_string(manifest.regions.size()), " regions"),
          "this checkpoint is of another model; name the regions as the saving run did");
    const auto& theirs = manifest.regions[found->second];
    if (theirs.count != region_counts[r])
      throw checkpoint_mismatch_error(
          rank, "load_checkpoint",
          detail::text("region '", region_names[r], "': ", index, " holds ", std::to_string(theirs.count),
                       " elements of ", manifest.dtype, ", this training state ", std::to_string(region_counts[r]),
                       " of ", dtype),
          "this checkpoint is of another model (or another size of it)");
    out[r] = found->second;
  }
  if (manifest.regions.size() != region_names.size())
    throw checkpoint_mismatch_error(rank, "load_checkpoint",
                                    detail::text(index, " holds ", std::to_string(manifest.regions.size()),
                                                 " regions, this training state ", std::to_string(region_names.size())),
                                    "this checkpoint is of another model: every region must be loaded");
  return out;
}

COHORT_COLD inline std::string checkpoint_file_named(const std::string& checkpoint, const checkpoint_file& file) {
  return detail::text(path_in(checkpoint, file.name), " (written by rank ", std::to_string(file.rank), ")");
}

COHORT_COLD_BODY std::uint64_t read_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                               const std::vector<checkpoint_need>& needs,
                                               const std::vector<checkpoint_range>& also_verify, int rank,
                                               std::vector<checkpoint_part>& parts) {
  constexpr std::string_view operation = "load_checkpoint";
  struct request {
    std::uint64_t offset, bytes;
    char* into;  // null: read only to be verified
  };
  const std::uint64_t element = manifest.element_bytes;
  std::vector<std::vector<request>> requests(manifest.files.size());
  if (!needs.empty()) {
    // Each region's segments over every file, in element order (the index was refused unless
    // they tile it): a need's holders are found by a binary search.
    struct holder {
      std::uint64_t first, count, at;  // at: elements before it in its file's tensor part
      std::size_t file;
    };
    std::vector<std::vector<holder>> by_region(manifest.regions.size());
    for (std::size_t f = 0; f < manifest.files.size(); ++f) {
      std::uint64_t at = 0;
      for (const auto& s : manifest.files[f].segments) {
        by_region[s.region].push_back({s.first, s.count, at, f});
        at += s.count;
      }
    }
    for (auto& list : by_region)
      std::sort(list.begin(), list.end(), [](const holder& a, const holder& b) { return a.first < b.first; });
    for (const auto& need : needs) {
      const auto& list = by_region.at(need.region);
      std::uint64_t covered = 0;
      auto it = std::upper_bound(list.begin(), list.end(), need.first,
                                 [](std::uint64_t first, const holder& h) { return first < h.first + h.count; });
      for (; it != list.end() && it->first < need.first + need.count; ++it) {
        const std::uint64_t low = std::max(need.first, it->first);
        const std::uint64_t high = std::min(need.first + need.count, it->first + it->count);
        const auto& file = manifest.files[it->file];
        requests[it->file].push_back({(need.tensor * file.elements + it->at + (low - it->first)) * element,
                                      (high - low) * element,
                                      static_cast<char*>(need.into) + (low - need.first) * element});
        covered += high - low;
      }
      if (covered != need.count)
        throw checkpoint_damaged_error(
            rank, operation,
            detail::text(path_in(checkpoint, "manifest.json"), ": elements ", std::to_string(need.first), "..",
                         std::to_string(need.first + need.count), " of region '", manifest.regions.at(need.region).name,
                         "' are held ", std::to_string(covered), " of ", std::to_string(need.count), " times"),
            "the index is damaged; load an earlier checkpoint");
    }
  }
  for (const auto& range : also_verify) requests.at(range.file).push_back({range.offset, range.bytes, nullptr});

  // Reads of at most this many bytes, each checksummed while it is still in the cache.
  constexpr std::uint64_t most = std::uint64_t{8} << 20;
  const std::uint64_t block = manifest.block_bytes;
  std::uint64_t bytes_read = 0;
  std::vector<char> scratch;
  std::optional<checkpoint_fd> directory;
  for (std::size_t f = 0; f < requests.size(); ++f) {
    auto& mine = requests[f];
    if (mine.empty()) continue;
    if (!directory) directory.emplace(open_checkpoint_directory(checkpoint, rank, operation));
    const auto& file = manifest.files[f];
    const std::string named = checkpoint_file_named(checkpoint, file);
    auto fd = open_checkpoint_file(directory->get(), checkpoint, file.name, rank, operation);
    if (const std::uint64_t size = file_size(fd.get()); size != file.bytes)
      throw checkpoint_damaged_error(
          rank, operation,
          detail::text(named, " has ", std::to_string(size), " bytes, its index says ", std::to_string(file.bytes)),
          "the file was truncated or replaced after the checkpoint was committed; load an earlier one");
    std::sort(mine.begin(), mine.end(), [](const request& a, const request& b) { return a.offset < b.offset; });
    // Each block's checksum added up over the parts of it this rank read: a block read whole
    // is verified here, one read in part is left to the ranks' exchange (parts).
    std::map<std::uint64_t, std::pair<std::uint64_t, std::uint64_t>> blocks;  // block: sum, bytes
    const auto block_size = [&](std::uint64_t b) { return std::min(block, file.bytes - b * block); };
    const auto add = [&](std::uint64_t offset, std::uint64_t bytes, const char* data) {
      for (std::uint64_t end = offset + bytes; offset < end;) {
        const std::uint64_t b = offset / block, upto = std::min(end, (b + 1) * block);
        std::uint64_t sum = checkpoint_checksum_part(data, offset - b * block, upto - offset);
        std::uint64_t covered = upto - offset;
        data += upto - offset;
        offset = upto;
        if (covered != block_size(b)) {  // a part: added to what this rank read of the block before
          auto& [sum_so_far, covered_so_far] = blocks[b];
          sum = sum_so_far += sum;
          covered = covered_so_far += covered;
          if (covered != block_size(b)) continue;
          blocks.erase(b);
        }
        if (const std::uint64_t found = checkpoint_checksum_finish(sum, covered); found != file.blocks.at(b))
          throw checkpoint_damaged_error(
              rank, operation,
              detail::text(named, ": block ", std::to_string(b), " (bytes ", std::to_string(b * block), "..",
                           std::to_string(b * block + covered), ") has checksum ", hex64(found), ", its index says ",
                           hex64(file.blocks[b])),
              "the file was altered or damaged after it was written; load an earlier checkpoint");
      }
    };
    // Neighbouring requests in one read; nothing between them is read.
    for (std::size_t i = 0; i < mine.size();) {
      std::vector<iovec> pieces;
      std::vector<request> run;
      const std::uint64_t start = mine[i].offset;
      std::uint64_t end = start;
      std::size_t unwanted = 0;  // bytes of the run read only to be verified
      for (; i < mine.size() && mine[i].offset == end && end - start < most; ++i) {
        // A large request goes in parts, so that each is checksummed while in the cache.
        auto& r = mine[i];
        const std::uint64_t take = std::min(r.bytes, most - (end - start));
        run.push_back({r.offset, take, r.into});
        if (r.into == nullptr) unwanted += take;
        end += take;
        if (take < r.bytes) {
          r = {r.offset + take, r.bytes - take, r.into == nullptr ? nullptr : r.into + take};
          break;
        }
      }
      scratch.resize(unwanted);
      for (std::size_t k = 0, used = 0; k < run.size(); ++k) {
        if (run[k].into == nullptr) {
          run[k].into = scratch.data() + used;
          used += run[k].bytes;
        }
        pieces.push_back({run[k].into, run[k].bytes});
      }
      read_exactly(fd.get(), std::move(pieces), start, end - start, named, rank, operation);
      bytes_read += end - start;
      for (const auto& r : run) add(r.offset, r.bytes, r.into);
    }
    for (const auto& [b, sum_covered] : blocks) parts.push_back({f, b, sum_covered.first, sum_covered.second, rank});
  }
  return bytes_read;
}

COHORT_COLD_BODY void check_checkpoint_parts(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                             std::vector<checkpoint_part> parts, int rank) {
  std::sort(parts.begin(), parts.end(), [](const checkpoint_part& a, const checkpoint_part& b) {
    return std::tie(a.file, a.block, a.reader) < std::tie(b.file, b.block, b.reader);
  });
  for (std::size_t i = 0; i < parts.size();) {
    const auto& file = manifest.files.at(parts[i].file);
    const std::uint64_t b = parts[i].block, begin = b * manifest.block_bytes;
    const std::uint64_t size = std::min(manifest.block_bytes, file.bytes - std::min(file.bytes, begin));
    std::uint64_t sum = 0, covered = 0;
    std::string readers;
    std::size_t j = i;
    for (; j < parts.size() && parts[j].file == parts[i].file && parts[j].block == b; ++j) {
      sum += parts[j].sum;
      covered += parts[j].bytes;
      readers += detail::text((readers.empty() ? "" : ", "), std::to_string(parts[j].reader));
    }
    const std::string block = detail::text(checkpoint_file_named(checkpoint, file), ": block ", std::to_string(b),
                                           " (bytes ", std::to_string(begin), "..", std::to_string(begin + size), ")");
    if (b >= file.blocks.size() || covered != size)
      throw checkpoint_damaged_error(
          rank, "load_checkpoint",
          detail::text(block, " was read in parts by ranks ", readers, ", ", std::to_string(covered), " of its ",
                       std::to_string(size), " bytes in all"),
          "the index is damaged; load an earlier checkpoint");
    if (const std::uint64_t found = checkpoint_checksum_finish(sum, size); found != file.blocks[b])
      throw checkpoint_damaged_error(
          rank, "load_checkpoint",
          detail::text(block, " has checksum ", hex64(found), ", its index says ", hex64(file.blocks[b]),
                       " (read in parts by ranks ", readers, ")"),
          "the file was altered or damaged after it was written; load an earlier checkpoint");
    i = j;
  }
}

COHORT_COLD_BODY std::string safetensors_dtype(const std::string& dtype) {
  if (dtype == "float") return "F32";
  if (dtype == "double") return "F64";
  if (dtype == "half") return "F16";
  if (dtype == "bfloat16") return "BF16";
  return {};
}

COHORT_COLD_BODY std::string describe_checkpoint(const std::string& checkpoint, const checkpoint_manifest& m) {
  std::uint64_t elements = 0, bytes = 0;
  for (const auto& r : m.regions) elements += r.count;
  for (const auto& f : m.files) bytes += f.bytes;
  std::string tensors;
  for (const auto& t : m.tensors) tensors += detail::text((tensors.empty() ? "" : ", "), t);
  std::string out = detail::text(checkpoint, "\n  step ", std::to_string(m.step), " (optimizer steps ",
                                 std::to_string(m.optimizer_steps), "), saved by ", std::to_string(m.world_size),
                                 " ranks under ", m.strategy, "; parameters ", m.parameter_dtype, ", masters ", m.dtype,
                                 "\n  tensors per element: ", tensors, "\n");
  out += m.run.empty() ? std::string("  run: not recorded (index version 3)\n")
                       : detail::text("  run ", m.run, ", job ", (m.job.empty() ? std::string("(none)") : m.job), "\n");
  if (m.scaler)
    out +=
        detail::text("  loss scale ", json_format_number(m.scaler->scale), " (", std::to_string(m.scaler->good_steps),
                     " good steps, ", std::to_string(m.scaler->skipped_steps), " skipped)\n");
  for (const auto& [key, value] : m.metadata) out += detail::text("  metadata ", key, " = ", value, "\n");
  out += detail::text("  ", std::to_string(m.regions.size()), " regions, ", std::to_string(elements), " elements; ",
                      std::to_string(m.files.size()), " files, ", std::to_string(bytes), " bytes, ",
                      std::to_string(m.block_bytes), "-byte checksum blocks\n");
  // Columns aligned: text left, numbers right.
  const auto table = [&](const std::vector<std::array<std::string, 5>>& rows, std::size_t text_columns) {
    std::array<std::size_t, 5> width{};
    for (const auto& row : rows)
      for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
    for (const auto& row : rows) {
      for (std::size_t c = 0; c < row.size(); ++c) {
        const std::string pad(width[c] - row[c].size(), ' ');
        out += c < text_columns ? detail::text("  ", row[c], pad) : detail::text("  ", pad, row[c]);
      }
      out += "\n";
    }
  };
  std::vector<std::array<std::string, 5>> regions{{"region", "dtype", "shape", "elements", "bytes per tensor"}};
  for (const auto& r : m.regions) {
    std::string shape;
    for (std::size_t d = 0; d < r.shape.size(); ++d) shape += detail::text((d ? ", " : ""), std::to_string(r.shape[d]));
    regions.push_back({r.name, m.dtype, detail::text("[", shape, "]"), std::to_string(r.count),
                       std::to_string(r.count * m.element_bytes)});
  }
  table(regions, 3);
  std::vector<std::array<std::string, 5>> files{{"file", "rank", "segments", "elements", "bytes"}};
  for (const auto& f : m.files)
    files.push_back({f.name, std::to_string(f.rank), std::to_string(f.segments.size()),
                     std::to_string(f.elements * m.tensors.size()), std::to_string(f.bytes)});
  table(files, 1);
  return out;
}

COHORT_COLD_BODY std::uint64_t read_checkpoint_verified(const std::string& checkpoint,
                                                        const checkpoint_manifest& manifest,
                                                        const std::vector<checkpoint_need>& needs) {
  std::vector<checkpoint_part> parts;
  std::uint64_t bytes_read = read_checkpoint(checkpoint, manifest, needs, {}, -1, parts);
  // Blocks only partly read (other bytes in them): read whole once more and verified, as no
  // other rank holds the rest.
  std::vector<checkpoint_range> rest;
  for (const auto& p : parts) {
    const auto& file = manifest.files.at(p.file);
    const std::uint64_t begin = p.block * manifest.block_bytes;
    rest.push_back({p.file, begin, std::min(manifest.block_bytes, file.bytes - begin)});
  }
  if (!rest.empty()) {
    std::vector<checkpoint_part> none;
    bytes_read += read_checkpoint(checkpoint, manifest, {}, rest, -1, none);
  }
  return bytes_read;
}

namespace {

// Every element of the first `tensors` tensors of every region, tensor after tensor, region
// after region, into `data`, and every block those lie in verified.
COHORT_COLD void read_whole_tensors(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                    std::size_t tensors, std::vector<char>& data, std::uint64_t& bytes_read) {
  std::vector<checkpoint_need> needs;
  std::uint64_t at = 0;
  for (std::size_t t = 0; t < tensors; ++t)
    for (std::size_t r = 0; r < manifest.regions.size(); ++r) {
      needs.push_back({t, r, 0, manifest.regions[r].count, data.data() + at * manifest.element_bytes});
      at += manifest.regions[r].count;
    }
  bytes_read += read_checkpoint_verified(checkpoint, manifest, needs);
}

// A file written whole or not at all: a temporary sibling, removed unless renamed into place.
struct temporary_file {
  std::string path;
  bool placed = false;
  ~temporary_file() {
    if (!placed) ::unlink(path.c_str());
  }
};

}  // namespace

}  // namespace detail

COHORT_COLD_BODY std::optional<std::string> newest_checkpoint(const std::string& directory) {
  const auto listing = detail::list_checkpoints(directory);
  if (listing.committed.empty()) return std::nullopt;
  return listing.committed.back().second;
}

COHORT_COLD_BODY std::uint64_t verify_checkpoint(const std::string& checkpoint) {
  constexpr std::string_view operation = "verify_checkpoint";
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, -1, operation);
  auto directory = detail::open_checkpoint_directory(checkpoint, -1, operation);
  // File after file, 8 MiB at a time: each block's checksum added up from its parts (the sum
  // is linear), so memory does not grow with the block size or the file.
  constexpr std::size_t chunk = std::size_t{8} << 20;
  std::vector<char> buffer;
  std::uint64_t bytes_read = 0;
  for (const auto& file : manifest.files) {
    const std::string named = detail::checkpoint_file_named(checkpoint, file);
    auto fd = detail::open_checkpoint_file(directory.get(), checkpoint, file.name, -1, operation);
    if (const std::uint64_t size = detail::file_size(fd.get()); size != file.bytes)
      throw checkpoint_damaged_error(
          -1, operation,
          detail::text(named, " has ", std::to_string(size), " bytes, its index says ", std::to_string(file.bytes)),
          "the file was truncated or replaced after the checkpoint was committed");
    buffer.resize(static_cast<std::size_t>(std::min<std::uint64_t>(chunk, file.bytes)));
    std::uint64_t sum = 0;
    for (std::uint64_t at = 0; at < file.bytes;) {
      const std::uint64_t block = at / manifest.block_bytes, block_begin = block * manifest.block_bytes;
      const std::uint64_t block_end = std::min(file.bytes, block_begin + manifest.block_bytes);
      const std::uint64_t take = std::min<std::uint64_t>(buffer.size(), block_end - at);
      detail::read_exactly(fd.get(), {{buffer.data(), static_cast<std::size_t>(take)}}, at, take, named, -1, operation);
      sum += detail::checkpoint_checksum_part(buffer.data(), at - block_begin, static_cast<std::size_t>(take));
      at += take;
      if (at == block_end) {
        if (const std::uint64_t found = detail::checkpoint_checksum_finish(sum, block_end - block_begin);
            found != file.blocks[block])
          throw checkpoint_damaged_error(
              -1, operation,
              detail::text(named, ": block ", std::to_string(block), " (bytes ", std::to_string(block_begin), "..",
                           std::to_string(block_end), ") has checksum ", detail::hex64(found), ", its index says ",
                           detail::hex64(file.blocks[block])),
              "the file was altered or damaged after it was written; load an earlier checkpoint");
        sum = 0;
      }
    }
    bytes_read += file.bytes;
  }
  return bytes_read;
}

COHORT_COLD_BODY void consolidate_checkpoint(const std::string& checkpoint, const std::string& safetensors_path) {
  constexpr std::string_view operation = "consolidate_checkpoint";
  // What a failure to write the export leaves: the checkpoint is only read, and the output's
  // path keeps what it held (the export goes to a temporary sibling, renamed once complete).
  constexpr std::string_view output_hint =
      "free space or fix permissions where the output goes; the checkpoint is only read and unchanged, and the "
      "output's path keeps what it held";
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, -1, operation);
  const std::string dtype = detail::safetensors_dtype(manifest.dtype);
  if (dtype.empty())
    throw error(-1, operation, detail::text(checkpoint, " holds ", manifest.dtype),
                "safetensors names float, double, half and bfloat16");
  // The files' real sizes before the parameters' memory is taken: an index that claims more
  // than the files hold costs nothing.
  {
    auto directory = detail::open_checkpoint_directory(checkpoint, -1, operation);
    for (const auto& file : manifest.files) {
      auto fd = detail::open_checkpoint_file(directory.get(), checkpoint, file.name, -1, operation);
      if (const std::uint64_t size = detail::file_size(fd.get()); size != file.bytes)
        throw checkpoint_damaged_error(
            -1, operation,
            detail::text(detail::checkpoint_file_named(checkpoint, file), " has ", std::to_string(size),
                         " bytes, its index says ", std::to_string(file.bytes)),
            "the file was truncated or replaced after the checkpoint was committed");
    }
  }
  std::uint64_t elements = 0;
  for (const auto& r : manifest.regions) elements += r.count;
  std::vector<char> data(static_cast<std::size_t>(elements * manifest.element_bytes));
  std::uint64_t bytes_read = 0;
  detail::read_whole_tensors(checkpoint, manifest, 1, data, bytes_read);
  // {"__metadata__":{...},"<region>":{"dtype":...,"shape":[...],"data_offsets":[begin,end]},...},
  // spaced as safetensors itself writes it.
  std::string header = "{\"__metadata__\":{\"format\":\"pt\",\"cohort_step\":";
  detail::json_write_string(header, std::to_string(manifest.step));
  header += "}";
  std::uint64_t offset = 0;
  for (const auto& r : manifest.regions) {
    if (r.name == "__metadata__")
      throw error(-1, operation, detail::text(checkpoint, " has a region named __metadata__"),
                  "safetensors keeps that name for the file's metadata; rename the region");
    header += ",";
    detail::json_write_string(header, r.name);
    header += detail::text(":{\"dtype\":\"", dtype, "\",\"shape\":[");
    for (std::size_t d = 0; d < r.shape.size(); ++d) header += detail::text((d ? "," : ""), std::to_string(r.shape[d]));
    const std::uint64_t bytes = r.count * manifest.element_bytes;
    header += detail::text("],\"data_offsets\":[", std::to_string(offset), ",", std::to_string(offset + bytes), "]}");
    offset += bytes;
  }
  header += "}";
  // The data starts 8-byte aligned: the header is padded with spaces, as the format allows.
  header.append((8 - header.size() % 8) % 8, ' ');
  char length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<char>((std::uint64_t{header.size()} >> (8 * b)) & 0xffu);
  // Whole or not at all: a temporary sibling, written, fsynced, renamed over the target, and
  // the directory fsynced; an error names the errno.
  const std::string parent = detail::parent_directory(safetensors_path);
  detail::temporary_file temporary{detail::path_in(
      parent, detail::text(".", detail::file_name(safetensors_path), ".cohort-tmp-", std::to_string(::getpid())))};
  ::unlink(temporary.path.c_str());
  {
    int code = 0;
    detail::checkpoint_file_writer out(temporary.path, std::size_t{1} << 20, -1, code, operation, output_hint);
    out.append(length, sizeof length);
    out.append(header.data(), header.size());
    out.append(data.data(), data.size());
    out.finish();
  }
  if (::rename(temporary.path.c_str(), safetensors_path.c_str()) != 0)
    throw error(-1, operation,
                detail::text("cannot rename ", temporary.path, " to ", safetensors_path, ": ", std::strerror(errno)),
                "the output's directory must be writable");
  temporary.placed = true;
  detail::sync_directory(parent, -1, operation,
                         "the export is in place but its rename may not survive a power loss on this file system");
}

}  // namespace cohort::inline v0
