#pragma once
// cohort/parallel/checkpoint.hpp's definitions: inline there when header-only, compiled once by
// <cohort/impl/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/error.hpp"
#include "cohort/guards.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/tools/detail/json.hpp"

namespace cohort::inline v0 {
namespace detail {

// A file descriptor closed when it goes: the error paths need no clean-up of their own.
class checkpoint_fd {
 public:
  explicit checkpoint_fd(int fd) noexcept : fd_(fd) {}
  checkpoint_fd(const checkpoint_fd&) = delete;
  checkpoint_fd& operator=(const checkpoint_fd&) = delete;
  ~checkpoint_fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }
  // Closes now, so that a failing close (a deferred write error) is seen: the errno, or 0.
  int close() noexcept {
    const int result = ::close(std::exchange(fd_, -1));
    return result == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

inline bool is_step_name(const std::string& name, std::uint64_t& step) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0) return false;
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  step = std::stoull(name.substr(5));
  return true;
}

// Some file systems cannot fsync a directory (EINVAL): the rename is still atomic there.
inline void sync_directory(const std::string& directory, int rank) {
  checkpoint_fd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY));
  if (fd.get() < 0 || (::fsync(fd.get()) != 0 && errno != EINVAL))
    throw error(rank, "save_checkpoint", "fsync of the directory " + directory + " failed: " + std::strerror(errno),
                "the checkpoint's rename may not survive a power loss on this file system");
}

inline std::string hex64(std::uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

}  // namespace detail

COHORT_DECL std::optional<std::string> newest_checkpoint(const std::string& directory) {
  std::optional<std::uint64_t> newest;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
    std::uint64_t step = 0;
    // Complete means committed: renamed from tmp-* to step-<N> after its index was written.
    if (!detail::is_step_name(entry.path().filename().string(), step)) continue;
    if (!std::filesystem::exists(entry.path() / "manifest.json", ec)) continue;
    if (!newest || step > *newest) newest = step;
  }
  if (!newest) return std::nullopt;
  return (std::filesystem::path(directory) / detail::checkpoint_step_name(*newest)).string();
}

namespace detail {

COHORT_DECL std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes) noexcept {
  const auto* at = static_cast<const unsigned char*>(data);
  std::uint64_t hash = 14695981039346656037ull;
  constexpr std::uint64_t prime = 1099511628211ull;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, at + i, 8);
    hash = (hash ^ word) * prime;
  }
  if (i < bytes) {
    std::uint64_t word = 0;
    std::memcpy(&word, at + i, bytes - i);
    hash = (hash ^ word) * prime;
  }
  return (hash ^ bytes) * prime;
}

COHORT_DECL std::uint64_t checkpoint_file_checksum(const std::vector<std::uint64_t>& blocks,
                                                   std::uint64_t bytes) noexcept {
  std::vector<std::uint64_t> words(blocks);
  words.push_back(bytes);
  return checkpoint_checksum(words.data(), words.size() * sizeof(std::uint64_t));
}

COHORT_DECL std::string checkpoint_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  return name;
}

COHORT_DECL std::string checkpoint_step_name(std::uint64_t step) { return "step-" + std::to_string(step); }

COHORT_DECL std::string checkpoint_staging_path(const std::string& directory, std::uint64_t step, std::uint64_t nonce) {
  return (std::filesystem::path(directory) / ("tmp-" + std::to_string(step) + "-" + hex64(nonce))).string();
}

COHORT_DECL std::string checkpoint_manifest_json(const checkpoint_manifest& m) {
  json root;
  root.set("format", "cohort-checkpoint");
  root.set("version", 1);
  root.set("step", m.step);
  root.set("optimizer_steps", m.optimizer_steps);
  root.set("world_size", m.world_size);
  root.set("strategy", m.strategy);
  root.set("parameter_dtype", m.parameter_dtype);
  json tensors = json::make_array();
  for (const auto& t : m.tensors) tensors.push_back(t);
  root.set("tensors", std::move(tensors));
  if (m.scaler) {
    json scaler;
    scaler.set("scale", m.scaler->scale);
    scaler.set("good_steps", m.scaler->good_steps);
    scaler.set("skipped_steps", m.scaler->skipped_steps);
    root.set("loss_scaler", std::move(scaler));
  } else {
    root.set("loss_scaler", nullptr);
  }
  json metadata = json::make_object();
  for (const auto& [key, value] : m.metadata) metadata.set(key, value);
  root.set("metadata", std::move(metadata));
  root.set("block_bytes", m.block_bytes);
  root.set("element_bytes", m.element_bytes);
  json regions = json::make_array();
  for (const auto& r : m.regions) {
    json region;
    region.set("name", r.name);
    region.set("count", r.count);
    region.set("dtype", r.dtype);
    regions.push_back(std::move(region));
  }
  root.set("regions", std::move(regions));
  json files = json::make_array();
  for (const auto& f : m.files) {
    json file;
    file.set("name", f.name);
    file.set("rank", f.rank);
    file.set("bytes", f.bytes);
    file.set("checksum", hex64(f.checksum));
    json blocks = json::make_array();
    for (const auto b : f.blocks) blocks.push_back(hex64(b));
    file.set("block_checksums", std::move(blocks));
    json pieces = json::make_array();
    for (const auto& p : f.pieces) {
      json piece;
      piece.set("tensor", m.tensors.at(p.tensor));
      piece.set("region", m.regions.at(p.region).name);
      piece.set("elements", json(json::array{json(p.first), json(p.first + p.count)}));
      piece.set("bytes", json(json::array{json(p.offset), json(p.offset + p.count * m.element_bytes)}));
      pieces.push_back(std::move(piece));
    }
    file.set("pieces", std::move(pieces));
    files.push_back(std::move(file));
  }
  root.set("files", std::move(files));
  return root.dump(1);
}

COHORT_DECL checkpoint_manifest read_checkpoint_manifest(const std::string& checkpoint, int rank) {
  const std::string path = (std::filesystem::path(checkpoint) / "manifest.json").string();
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw error(rank, "load_checkpoint", "cannot open " + path + ": " + std::strerror(errno),
                "a checkpoint without its index is incomplete (an interrupted save): resume_checkpoint skips it");
  std::stringstream text;
  text << in.rdbuf();
  checkpoint_manifest m;
  try {
    const json root = parse_json(text.str());
    if (root.at("format").as_string() != "cohort-checkpoint" || root.at("version").as_int64() != 1)
      throw error(rank, "load_checkpoint", "not a cohort checkpoint index, or another version");
    m.step = static_cast<std::uint64_t>(root.at("step").as_int64());
    m.optimizer_steps = static_cast<std::uint64_t>(root.at("optimizer_steps").as_int64());
    m.world_size = static_cast<int>(root.at("world_size").as_int64());
    m.strategy = root.at("strategy").as_string();
    m.parameter_dtype = root.at("parameter_dtype").as_string();
    m.block_bytes = static_cast<std::uint64_t>(root.at("block_bytes").as_int64());
    m.element_bytes = static_cast<std::uint64_t>(root.at("element_bytes").as_int64());
    if (m.block_bytes == 0 || m.element_bytes == 0) throw error(rank, "load_checkpoint", "block or element size 0");
    for (const auto& t : root.at("tensors").as_array()) m.tensors.push_back(t.as_string());
    if (const json& scaler = root.at("loss_scaler"); !scaler.is_null())
      m.scaler = loss_scaler::saved_state{scaler.at("scale").as_number(),
                                          static_cast<std::uint32_t>(scaler.at("good_steps").as_int64()),
                                          static_cast<std::uint64_t>(scaler.at("skipped_steps").as_int64())};
    for (const auto& [key, value] : root.at("metadata").as_object()) m.metadata[key] = value.as_string();
    std::map<std::string, std::size_t> region_index, tensor_index;
    for (std::size_t t = 0; t < m.tensors.size(); ++t) tensor_index[m.tensors[t]] = t;
    for (const auto& r : root.at("regions").as_array()) {
      region_index[r.at("name").as_string()] = m.regions.size();
      m.regions.push_back(
          {r.at("name").as_string(), static_cast<std::uint64_t>(r.at("count").as_int64()), r.at("dtype").as_string()});
    }
    const auto index_of = [&](const std::map<std::string, std::size_t>& names, const std::string& name) {
      const auto found = names.find(name);
      if (found == names.end()) throw error(rank, "load_checkpoint", "a piece names '" + name + "', never declared");
      return found->second;
    };
    for (const auto& f : root.at("files").as_array()) {
      checkpoint_file file;
      file.name = f.at("name").as_string();
      if (file.name.find('/') != std::string::npos || file.name == "..")
        throw error(rank, "load_checkpoint", "file name '" + file.name + "' leaves the checkpoint's directory");
      file.rank = static_cast<int>(f.at("rank").as_int64());
      file.bytes = static_cast<std::uint64_t>(f.at("bytes").as_int64());
      file.checksum = std::stoull(f.at("checksum").as_string(), nullptr, 16);
      for (const auto& b : f.at("block_checksums").as_array())
        file.blocks.push_back(std::stoull(b.as_string(), nullptr, 16));
      if (file.blocks.size() != (file.bytes + m.block_bytes - 1) / m.block_bytes ||
          checkpoint_file_checksum(file.blocks, file.bytes) != file.checksum)
        throw error(rank, "load_checkpoint", "the block checksums of " + file.name + " do not match its checksum");
      for (const auto& p : f.at("pieces").as_array()) {
        checkpoint_piece piece;
        piece.tensor = index_of(tensor_index, p.at("tensor").as_string());
        piece.region = index_of(region_index, p.at("region").as_string());
        piece.first = static_cast<std::uint64_t>(p.at("elements").at(0).as_int64());
        piece.count = static_cast<std::uint64_t>(p.at("elements").at(1).as_int64()) - piece.first;
        piece.offset = static_cast<std::uint64_t>(p.at("bytes").at(0).as_int64());
        file.pieces.push_back(piece);
      }
      m.files.push_back(std::move(file));
    }
  } catch (const error& failure) {
    throw error(rank, "load_checkpoint", path + ": " + failure.detail(),
                "the index is damaged or from another version; load an earlier checkpoint");
  } catch (const std::exception& failure) {
    throw error(rank, "load_checkpoint", path + ": " + failure.what(),
                "the index is damaged or from another version; load an earlier checkpoint");
  }
  return m;
}

COHORT_DECL void begin_checkpoint(const std::string& directory, const std::string& staging, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw error(rank, "save_checkpoint", "cannot create " + directory + ": " + ec.message(),
                "the checkpoint directory must be writable by the ranks that save");
  // What interrupted saves left: never loaded, removed here (saves are collective, so no
  // other save of this job is under way).
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec))
    if (entry.path().filename().string().rfind("tmp-", 0) == 0) std::filesystem::remove_all(entry.path(), ec);
  if (!std::filesystem::create_directory(staging, ec) || ec)
    throw error(rank, "save_checkpoint", "cannot create " + staging + ": " + (ec ? ec.message() : "it exists"),
                "the checkpoint directory must be writable by the ranks that save");
}

COHORT_DECL checkpoint_staging::checkpoint_staging(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (at == MAP_FAILED)
    throw error(-1, "save_checkpoint",
                "cannot map " + std::to_string(bytes) + " bytes of host staging: " + std::strerror(errno),
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

COHORT_DECL checkpoint_file_writer::checkpoint_file_writer(std::string path, std::size_t block_bytes, int rank,
                                                           int& failed_errno)
    : path_(std::move(path)), block_bytes_(block_bytes), rank_(rank), failed_errno_(failed_errno) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw failure("cannot create");
}

COHORT_DECL checkpoint_file_writer::~checkpoint_file_writer() {
  if (fd_ >= 0) ::close(fd_);
}

COHORT_DECL error checkpoint_file_writer::failure(const std::string& what) {
  failed_errno_ = errno;
  return error(rank_, "save_checkpoint", what + " " + path_ + ": " + std::strerror(failed_errno_),
               "free space or fix permissions; the previous checkpoint is intact");
}

COHORT_DECL void checkpoint_file_writer::append(const char* data, std::size_t bytes) {
  // Checksums first, while the previous chunk's write-back runs in the kernel: the disk, not
  // this thread, is then what a save waits for.
  for (std::size_t done = 0; done < bytes; done += block_bytes_)
    blocks_.push_back(checkpoint_checksum(data + done, std::min(block_bytes_, bytes - done)));
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t wrote = ::write(fd_, data + done, std::min<std::size_t>(bytes - done, std::size_t{1} << 30));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) throw failure("writing");
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

COHORT_DECL std::vector<std::uint64_t> checkpoint_file_writer::finish() {
  if (::fsync(fd_) != 0) throw failure("fsync of");
  const int result = ::close(std::exchange(fd_, -1));
  if (result != 0) throw failure("closing");
  return std::move(blocks_);
}

COHORT_DECL std::vector<std::uint8_t> checkpoint_outcome_bytes(bool failed, int failed_errno,
                                                               const std::vector<std::uint64_t>& blocks) {
  std::vector<std::uint64_t> words{failed ? 1u : 0u, static_cast<std::uint64_t>(failed_errno)};
  words.insert(words.end(), blocks.begin(), blocks.end());
  std::vector<std::uint8_t> out(words.size() * sizeof(std::uint64_t));
  std::memcpy(out.data(), words.data(), out.size());
  return out;
}

COHORT_DECL bool parse_checkpoint_outcome(std::span<const std::uint8_t> value, bool& failed, int& failed_errno,
                                          std::vector<std::uint64_t>& blocks) {
  if (value.size() < 2 * sizeof(std::uint64_t) || value.size() % sizeof(std::uint64_t) != 0) return false;
  std::vector<std::uint64_t> words(value.size() / sizeof(std::uint64_t));
  std::memcpy(words.data(), value.data(), value.size());
  failed = words[0] != 0;
  failed_errno = static_cast<int>(words[1]);
  blocks.assign(words.begin() + 2, words.end());
  return true;
}

COHORT_DECL void commit_checkpoint(const std::string& directory, const std::string& staging,
                                   const checkpoint_manifest& manifest, std::size_t keep_last, int rank) {
  // The index last: a directory with one is complete. atomic_write_file fsyncs it and the
  // staging directory.
  atomic_write_file((std::filesystem::path(staging) / "manifest.json").string(), checkpoint_manifest_json(manifest),
                    rank);
  const std::filesystem::path target = std::filesystem::path(directory) / checkpoint_step_name(manifest.step);
  std::error_code ec;
  // A checkpoint of the same step is replaced: moved aside (a tmp-* name, so an interruption
  // leaves it to the next save's clean-up), then the new one renamed into place.
  const std::filesystem::path aside = staging + "-replaced";
  const bool replacing = std::filesystem::exists(target, ec);
  if (replacing) std::filesystem::rename(target, aside, ec);
  if (!ec) std::filesystem::rename(staging, target, ec);
  if (ec)
    throw error(rank, "save_checkpoint", "cannot rename " + staging + " to " + target.string() + ": " + ec.message(),
                "the previous checkpoint is intact; the partial one is removed by the next save");
  sync_directory(directory, rank);
  if (replacing) std::filesystem::remove_all(aside, ec);
  if (keep_last == 0) return;
  // The newest keep_last complete ones stay; a step-* without an index is not ours (we rename
  // only complete ones) and is left alone.
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> steps;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
    std::uint64_t step = 0;
    if (is_step_name(entry.path().filename().string(), step) &&
        std::filesystem::exists(entry.path() / "manifest.json", ec))
      steps.emplace_back(step, entry.path());
  }
  std::sort(steps.begin(), steps.end());
  for (std::size_t i = 0; i + keep_last < steps.size(); ++i) std::filesystem::remove_all(steps[i].second, ec);
}

COHORT_DECL std::vector<std::size_t> match_checkpoint(const checkpoint_manifest& manifest,
                                                      const std::string& checkpoint,
                                                      const std::vector<std::string>& region_names,
                                                      const std::vector<std::uint64_t>& region_counts,
                                                      const std::string& dtype, const std::vector<std::string>& tensors,
                                                      int rank) {
  const std::string index = (std::filesystem::path(checkpoint) / "manifest.json").string();
  const auto list = [](const std::vector<std::string>& names) {
    std::string text;
    for (const auto& n : names) text += (text.empty() ? "" : ", ") + n;
    return "[" + text + "]";
  };
  if (manifest.tensors != tensors)
    throw error(
        rank, "load_checkpoint",
        index + " holds the optimizer state " + list(manifest.tensors) + ", this training state keeps " + list(tensors),
        "resume with the optimizer that saved it (AdamW, or SGD with or without momentum)");
  std::map<std::string, std::size_t> saved;
  for (std::size_t r = 0; r < manifest.regions.size(); ++r) saved[manifest.regions[r].name] = r;
  std::vector<std::size_t> out(region_names.size());
  for (std::size_t r = 0; r < region_names.size(); ++r) {
    const auto found = saved.find(region_names[r]);
    if (found == saved.end())
      throw error(rank, "load_checkpoint",
                  "region '" + region_names[r] + "' (" + std::to_string(region_counts[r]) + " elements) is not in " +
                      index + ", which holds " + std::to_string(manifest.regions.size()) + " regions",
                  "this checkpoint is of another model; name the regions as the saving run did");
    const auto& theirs = manifest.regions[found->second];
    if (theirs.count != region_counts[r] || theirs.dtype != dtype)
      throw error(rank, "load_checkpoint",
                  "region '" + region_names[r] + "': " + index + " holds " + std::to_string(theirs.count) +
                      " elements of " + theirs.dtype + ", this training state " + std::to_string(region_counts[r]) +
                      " of " + dtype,
                  theirs.dtype != dtype ? "load it into a state whose masters have the checkpoint's dtype"
                                        : "this checkpoint is of another model (or another size of it)");
    out[r] = found->second;
  }
  if (manifest.regions.size() != region_names.size())
    throw error(rank, "load_checkpoint",
                index + " holds " + std::to_string(manifest.regions.size()) + " regions, this training state " +
                    std::to_string(region_names.size()),
                "this checkpoint is of another model: every region must be loaded");
  return out;
}

COHORT_DECL std::uint64_t read_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                          const std::vector<checkpoint_need>& needs, std::size_t element_bytes,
                                          int rank, std::int64_t& failed_file) {
  struct request {
    std::uint64_t offset, bytes;
    char* into;
  };
  // Which pieces of which files hold each (tensor, region).
  std::map<std::pair<std::size_t, std::size_t>, std::vector<std::pair<std::size_t, const checkpoint_piece*>>> holders;
  for (std::size_t f = 0; f < manifest.files.size(); ++f)
    for (const auto& p : manifest.files[f].pieces) holders[{p.tensor, p.region}].emplace_back(f, &p);
  failed_file = -1;
  std::vector<std::vector<request>> requests(manifest.files.size());
  for (const auto& need : needs) {
    std::uint64_t covered = 0;
    for (const auto& [f, p] : holders[{need.tensor, need.region}]) {
      const std::uint64_t low = std::max(need.first, p->first);
      const std::uint64_t high = std::min(need.first + need.count, p->first + p->count);
      if (low >= high) continue;
      requests[f].push_back({p->offset + (low - p->first) * element_bytes, (high - low) * element_bytes,
                             static_cast<char*>(need.into) + (low - need.first) * element_bytes});
      covered += high - low;
    }
    if (covered != need.count)
      throw error(rank, "load_checkpoint",
                  checkpoint + "/manifest.json: elements " + std::to_string(need.first) + ".." +
                      std::to_string(need.first + need.count) + " of region '" + manifest.regions.at(need.region).name +
                      "' (" + manifest.tensors.at(need.tensor) + ") are held " + std::to_string(covered) +
                      " times over, not once",
                  "the index is damaged; load an earlier checkpoint");
  }
  const std::uint64_t block = manifest.block_bytes;
  std::uint64_t bytes_read = 0;
  std::vector<char> buffer;
  for (std::size_t f = 0; f < requests.size(); ++f) {
    auto& mine = requests[f];
    if (mine.empty()) continue;
    failed_file = static_cast<std::int64_t>(f);
    const auto& file = manifest.files[f];
    const std::string path = (std::filesystem::path(checkpoint) / file.name).string();
    const std::string named = path + " (written by rank " + std::to_string(file.rank) + ")";
    checkpoint_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat status {};
    if (fd.get() < 0 || ::fstat(fd.get(), &status) != 0)
      throw error(rank, "load_checkpoint", "cannot open " + named + ": " + std::strerror(errno),
                  "every file of the checkpoint must be readable by every rank (a shared file system)");
    if (static_cast<std::uint64_t>(status.st_size) != file.bytes)
      throw error(
          rank, "load_checkpoint",
          named + " has " + std::to_string(status.st_size) + " bytes, its index says " + std::to_string(file.bytes),
          "the file was truncated or replaced after the checkpoint was committed; load an earlier one");
    std::sort(mine.begin(), mine.end(), [](const request& a, const request& b) { return a.offset < b.offset; });
    // Runs of whole blocks, each needed block read once and verified before use.
    for (std::size_t i = 0; i < mine.size();) {
      const std::uint64_t first_block = mine[i].offset / block;
      std::uint64_t last_block = (mine[i].offset + mine[i].bytes - 1) / block;
      std::size_t j = i + 1;
      for (; j < mine.size() && mine[j].offset / block <= last_block + 1; ++j)
        last_block = std::max(last_block, (mine[j].offset + mine[j].bytes - 1) / block);
      const std::uint64_t start = first_block * block;
      const std::uint64_t length = std::min((last_block + 1) * block, file.bytes) - start;
      buffer.resize(length);
      for (std::uint64_t done = 0; done < length;) {
        const ssize_t got = ::pread(fd.get(), buffer.data() + done, length - done, static_cast<off_t>(start + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
          throw error(rank, "load_checkpoint",
                      "reading bytes " + std::to_string(start + done) + ".." + std::to_string(start + length) + " of " +
                          named + " failed: " + (got == 0 ? "end of file" : std::strerror(errno)),
                      "the file system failed or the file was truncated; load an earlier checkpoint");
        done += static_cast<std::uint64_t>(got);
      }
      bytes_read += length;
      for (std::uint64_t b = first_block; b <= last_block; ++b) {
        const std::uint64_t at = (b - first_block) * block, size = std::min(block, length - at);
        const std::uint64_t found = checkpoint_checksum(buffer.data() + at, size);
        if (found != file.blocks.at(b))
          throw error(rank, "load_checkpoint",
                      named + ": block " + std::to_string(b) + " (bytes " + std::to_string(start + at) + ".." +
                          std::to_string(start + at + size) + ") has checksum " + hex64(found) + ", its index says " +
                          hex64(file.blocks[b]),
                      "the file was altered or damaged after it was written; load an earlier checkpoint");
      }
      for (std::size_t k = i; k < j; ++k)
        std::memcpy(mine[k].into, buffer.data() + (mine[k].offset - start), mine[k].bytes);
      i = j;
    }
  }
  failed_file = -1;
  return bytes_read;
}

COHORT_DECL std::string safetensors_dtype(const std::string& dtype) {
  if (dtype == "float") return "F32";
  if (dtype == "double") return "F64";
  if (dtype == "half") return "F16";
  if (dtype == "bfloat16") return "BF16";
  return {};
}

namespace {
// Every element of the first `tensors` tensors of every region, tensor after tensor, region
// after region, into one buffer: one pass, each block read once.
std::vector<char> read_whole_tensors(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                     std::size_t tensors, std::uint64_t& bytes_read) {
  std::uint64_t total = 0;
  for (const auto& r : manifest.regions) total += r.count;
  std::vector<char> data(tensors * total * manifest.element_bytes);
  std::vector<checkpoint_need> needs;
  std::uint64_t at = 0;
  for (std::size_t t = 0; t < tensors; ++t)
    for (std::size_t r = 0; r < manifest.regions.size(); ++r) {
      needs.push_back({t, r, 0, manifest.regions[r].count, data.data() + at * manifest.element_bytes});
      at += manifest.regions[r].count;
    }
  std::int64_t failed_file = -1;
  bytes_read += read_checkpoint(checkpoint, manifest, needs, manifest.element_bytes, -1, failed_file);
  return data;
}
}  // namespace

}  // namespace detail

COHORT_DECL std::uint64_t verify_checkpoint(const std::string& checkpoint) {
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, -1);
  std::uint64_t bytes_read = 0;
  detail::read_whole_tensors(checkpoint, manifest, manifest.tensors.size(), bytes_read);
  return bytes_read;
}

COHORT_DECL void consolidate_checkpoint(const std::string& checkpoint, const std::string& safetensors_path) {
  const auto manifest = detail::read_checkpoint_manifest(checkpoint, -1);
  std::uint64_t bytes_read = 0;
  const auto data = detail::read_whole_tensors(checkpoint, manifest, 1, bytes_read);
  detail::json header = detail::json::make_object();
  std::uint64_t offset = 0;
  for (const auto& r : manifest.regions) {
    const std::string dtype = detail::safetensors_dtype(r.dtype);
    if (dtype.empty())
      throw error(-1, "consolidate_checkpoint", "region '" + r.name + "' has dtype " + r.dtype,
                  "safetensors names float, double, half and bfloat16");
    detail::json entry;
    entry.set("dtype", dtype);
    entry.set("shape", detail::json(detail::json::array{detail::json(r.count)}));
    const std::uint64_t bytes = r.count * manifest.element_bytes;
    entry.set("data_offsets", detail::json(detail::json::array{detail::json(offset), detail::json(offset + bytes)}));
    header.set(r.name, std::move(entry));
    offset += bytes;
  }
  detail::json metadata;
  metadata.set("format", "pt");
  metadata.set("cohort_step", std::to_string(manifest.step));
  header.set("__metadata__", std::move(metadata));
  std::string text = header.dump();
  // The data starts 8-byte aligned: the header is padded with spaces, as the format allows.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  std::string file(8, '\0');
  const std::uint64_t length = text.size();
  for (int b = 0; b < 8; ++b) file[static_cast<std::size_t>(b)] = static_cast<char>((length >> (8 * b)) & 0xffu);
  file += text;
  file.append(data.data(), data.size());
  atomic_write_file(safetensors_path, file, -1);
}

}  // namespace cohort::inline v0
