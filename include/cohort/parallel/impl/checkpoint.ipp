#pragma once
// cohort/parallel/checkpoint.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <fcntl.h>
#include <limits.h>
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
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/run/atomic_write.hpp"
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
    throw error(rank, "save_checkpoint",
                detail::text("fsync of the directory ", directory, " failed: ", std::strerror(errno)),
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

// The block checksum's keys (see checkpoint_checksum in checkpoint.hpp).
inline constexpr std::uint64_t checksum_mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A word's key is lane_keys[word % lanes] times chunk_key(word / lanes): the lanes' table
// stays in L1 and the inner loop is a widening 32x32->64 multiply-add, which vectorises
// (pmuludq, umlal); one 64-bit multiply per chunk spreads the keys over the whole block.
inline constexpr std::size_t checksum_lanes = 1024;
inline constexpr std::array<std::uint32_t, checksum_lanes> checksum_lane_keys = [] {
  std::array<std::uint32_t, checksum_lanes> keys{};
  for (std::size_t l = 0; l < checksum_lanes; ++l) keys[l] = static_cast<std::uint32_t>(checksum_mix(l)) | 1u;
  return keys;
}();
inline constexpr std::uint64_t checksum_chunk_key(std::uint64_t chunk) noexcept {
  return checksum_mix(chunk ^ 0x636f686f72742d63ull) | 1u;
}
inline constexpr std::uint64_t checksum_key(std::uint64_t word) noexcept {
  return checksum_lane_keys[word % checksum_lanes] * checksum_chunk_key(word / checksum_lanes);
}
// Bytes [at, at + bytes) of their 4-byte word (at % 4 + bytes <= 4), in place, the rest zero.
inline std::uint64_t checksum_partial_word(const unsigned char* data, std::uint64_t at, std::size_t bytes) noexcept {
  std::uint64_t word = 0;
  for (std::size_t k = 0; k < bytes; ++k) word |= std::uint64_t{data[k]} << (8 * ((at + k) % 4));
  return word * checksum_key(at / 4);
}

COHORT_DECL std::uint64_t checkpoint_checksum_part(const void* data, std::uint64_t at, std::size_t bytes) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t sum = 0;
  if (const std::size_t head = std::min<std::size_t>(bytes, (4 - at % 4) % 4); head != 0) {
    sum += checksum_partial_word(p, at, head);
    p += head;
    at += head;
    bytes -= head;
  }
  // Whole words, chunk by chunk: each chunk's products added in 64 bits, then keyed.
  for (std::uint64_t word = at / 4, end = word + bytes / 4; word < end;) {
    const std::size_t lane = word % checksum_lanes;
    const std::size_t count = std::min<std::uint64_t>(checksum_lanes - lane, end - word);
    std::uint64_t chunk = 0;
    for (std::size_t l = 0; l < count; ++l) {
      std::uint32_t value;
      std::memcpy(&value, p + 4 * l, 4);
      chunk += std::uint64_t{value} * checksum_lane_keys[lane + l];
    }
    sum += chunk * checksum_chunk_key(word / checksum_lanes);
    p += 4 * count;
    word += count;
  }
  if (const std::size_t tail = bytes % 4; tail != 0) sum += checksum_partial_word(p, at + bytes - tail, tail);
  return sum;
}

COHORT_DECL std::uint64_t checkpoint_checksum_finish(std::uint64_t parts, std::uint64_t bytes) noexcept {
  return parts + checksum_mix(bytes);
}

COHORT_DECL std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes) noexcept {
  return checkpoint_checksum_finish(checkpoint_checksum_part(data, 0, bytes), bytes);
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

COHORT_DECL std::string checkpoint_step_name(std::uint64_t step) { return detail::text("step-", std::to_string(step)); }

COHORT_DECL std::string checkpoint_staging_path(const std::string& directory, std::uint64_t step, std::uint64_t nonce) {
  return (std::filesystem::path(directory) / (detail::text("tmp-", std::to_string(step), "-", hex64(nonce)))).string();
}

COHORT_DECL std::string checkpoint_manifest_json(const checkpoint_manifest& m) {
  json root;
  root.set("format", "cohort-checkpoint");
  root.set("version", checkpoint_format_version);
  root.set("checksum", checkpoint_checksum_kind);
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
    throw error(rank, "load_checkpoint", detail::text("cannot open ", path, ": ", std::strerror(errno)),
                "a checkpoint without its index is incomplete (an interrupted save): resume_checkpoint skips it");
  std::stringstream text;
  text << in.rdbuf();
  checkpoint_manifest m;
  try {
    const json root = parse_json(text.str());
    if (root.at("format").as_string() != "cohort-checkpoint")
      throw error(rank, "load_checkpoint", "not a cohort checkpoint index");
    // Version 1 kept FNV-1a block checksums, which a block read in parts cannot be checked
    // against; a later version may change more than this build knows to read.
    if (const auto version = root.at("version").as_int64(); version != checkpoint_format_version)
      throw error(rank, "load_checkpoint",
                  detail::text("index version ", std::to_string(version), ", this build reads version ",
                               std::to_string(checkpoint_format_version),
                               (version < checkpoint_format_version ? " (version 1 kept FNV-1a block checksums)" : "")),
                  "read it with the cohort version that wrote it");
    if (const auto kind = root.at("checksum").as_string(); kind != checkpoint_checksum_kind)
      throw error(
          rank, "load_checkpoint",
          detail::text("block checksums of kind '", kind, "', this build knows '", checkpoint_checksum_kind, "'"),
          "read it with the cohort version that wrote it");
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
      if (found == names.end())
        throw error(rank, "load_checkpoint", detail::text("a piece names '", name, "', never declared"));
      return found->second;
    };
    for (const auto& f : root.at("files").as_array()) {
      checkpoint_file file;
      file.name = f.at("name").as_string();
      if (file.name.find('/') != std::string::npos || file.name == "..")
        throw error(rank, "load_checkpoint",
                    detail::text("file name '", file.name, "' leaves the checkpoint's directory"));
      file.rank = static_cast<int>(f.at("rank").as_int64());
      file.bytes = static_cast<std::uint64_t>(f.at("bytes").as_int64());
      file.checksum = std::stoull(f.at("checksum").as_string(), nullptr, 16);
      for (const auto& b : f.at("block_checksums").as_array())
        file.blocks.push_back(std::stoull(b.as_string(), nullptr, 16));
      if (file.blocks.size() != (file.bytes + m.block_bytes - 1) / m.block_bytes ||
          checkpoint_file_checksum(file.blocks, file.bytes) != file.checksum)
        throw error(rank, "load_checkpoint",
                    detail::text("the block checksums of ", file.name, " do not match its checksum"));
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
    throw error(rank, "load_checkpoint", detail::text(path, ": ", failure.detail()),
                failure.hint().empty() ? "the index is damaged or from another version; load an earlier checkpoint"
                                       : failure.hint());
  } catch (const std::exception& failure) {
    throw error(rank, "load_checkpoint", detail::text(path, ": ", failure.what()),
                "the index is damaged or from another version; load an earlier checkpoint");
  }
  return m;
}

COHORT_DECL void begin_checkpoint(const std::string& directory, const std::string& staging, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw error(rank, "save_checkpoint", detail::text("cannot create ", directory, ": ", ec.message()),
                "the checkpoint directory must be writable by the ranks that save");
  // What interrupted saves left: never loaded, removed here (saves are collective, so no
  // other save of this job is under way).
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec))
    if (entry.path().filename().string().rfind("tmp-", 0) == 0) std::filesystem::remove_all(entry.path(), ec);
  if (!std::filesystem::create_directory(staging, ec) || ec)
    throw error(rank, "save_checkpoint",
                detail::text("cannot create ", staging, ": ", (ec ? ec.message() : "it exists")),
                "the checkpoint directory must be writable by the ranks that save");
}

COHORT_DECL checkpoint_staging::checkpoint_staging(std::size_t bytes) : size_(bytes) {
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
  return error(rank_, "save_checkpoint", detail::text(what, " ", path_, ": ", std::strerror(failed_errno_)),
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
  const std::filesystem::path aside = detail::text(staging, "-replaced");
  const bool replacing = std::filesystem::exists(target, ec);
  if (replacing) std::filesystem::rename(target, aside, ec);
  if (!ec) std::filesystem::rename(staging, target, ec);
  if (ec)
    throw error(rank, "save_checkpoint",
                detail::text("cannot rename ", staging, " to ", target.string(), ": ", ec.message()),
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
    return detail::text("[", text, "]");
  };
  if (manifest.tensors != tensors)
    throw error(rank, "load_checkpoint",
                detail::text(index, " holds the optimizer state ", list(manifest.tensors),
                             ", this training state keeps ", list(tensors)),
                "resume with the optimizer that saved it (AdamW, or SGD with or without momentum)");
  std::map<std::string, std::size_t> saved;
  for (std::size_t r = 0; r < manifest.regions.size(); ++r) saved[manifest.regions[r].name] = r;
  std::vector<std::size_t> out(region_names.size());
  for (std::size_t r = 0; r < region_names.size(); ++r) {
    const auto found = saved.find(region_names[r]);
    if (found == saved.end())
      throw error(
          rank, "load_checkpoint",
          detail::text("region '", region_names[r], "' (", std::to_string(region_counts[r]), " elements) is not in ",
                       index, ", which holds ", std::to_string(manifest.regions.size()), " regions"),
          "this checkpoint is of another model; name the regions as the saving run did");
    const auto& theirs = manifest.regions[found->second];
    if (theirs.count != region_counts[r] || theirs.dtype != dtype)
      throw error(rank, "load_checkpoint",
                  detail::text("region '", region_names[r], "': ", index, " holds ", std::to_string(theirs.count),
                               " elements of ", theirs.dtype, ", this training state ",
                               std::to_string(region_counts[r]), " of ", dtype),
                  theirs.dtype != dtype ? "load it into a state whose masters have the checkpoint's dtype"
                                        : "this checkpoint is of another model (or another size of it)");
    out[r] = found->second;
  }
  if (manifest.regions.size() != region_names.size())
    throw error(rank, "load_checkpoint",
                detail::text(index, " holds ", std::to_string(manifest.regions.size()),
                             " regions, this training state ", std::to_string(region_names.size())),
                "this checkpoint is of another model: every region must be loaded");
  return out;
}

COHORT_DECL std::vector<checkpoint_range> checkpoint_gaps(const checkpoint_manifest& manifest) {
  std::vector<checkpoint_range> gaps;
  for (std::size_t f = 0; f < manifest.files.size(); ++f) {
    const auto& file = manifest.files[f];
    std::vector<std::pair<std::uint64_t, std::uint64_t>> held;
    for (const auto& p : file.pieces) held.emplace_back(p.offset, p.offset + p.count * manifest.element_bytes);
    std::sort(held.begin(), held.end());
    std::uint64_t at = 0;
    for (const auto& [begin, end] : held) {
      if (begin > at) gaps.push_back({f, at, std::min(begin, file.bytes) - at});
      at = std::max(at, end);
    }
    if (at < file.bytes) gaps.push_back({f, at, file.bytes - at});
  }
  return gaps;
}

// Reads file bytes [offset, offset + total) into `pieces` (each iovec's length adding up to
// `total`): one preadv for neighbouring requests, however the kernel splits it.
inline void read_exactly(int fd, std::vector<iovec> pieces, std::uint64_t offset, std::uint64_t total,
                         const std::string& named, int rank) {
  std::size_t first = 0;
  for (std::uint64_t done = 0; done < total;) {
    const int count = static_cast<int>(std::min<std::size_t>(pieces.size() - first, IOV_MAX));
    const ssize_t got = ::preadv(fd, pieces.data() + first, count, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw error(rank, "load_checkpoint",
                  detail::text("reading bytes ", std::to_string(offset + done), "..", std::to_string(offset + total),
                               " of ", named, " failed: ", (got == 0 ? "end of file" : std::strerror(errno))),
                  "the file system failed or the file was truncated; load an earlier checkpoint");
    done += static_cast<std::uint64_t>(got);
    for (auto left = static_cast<std::size_t>(got); left > 0;) {
      auto& piece = pieces[first];
      const std::size_t used = std::min(left, piece.iov_len);
      piece.iov_base = static_cast<char*>(piece.iov_base) + used;
      piece.iov_len -= used;
      left -= used;
      if (piece.iov_len == 0) ++first;
    }
  }
}

inline std::string checkpoint_file_named(const std::string& checkpoint, const checkpoint_file& file) {
  return detail::text((std::filesystem::path(checkpoint) / file.name).string(), " (written by rank ",
                      std::to_string(file.rank), ")");
}

COHORT_DECL std::uint64_t read_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest,
                                          const std::vector<checkpoint_need>& needs,
                                          const std::vector<checkpoint_range>& also_verify, std::size_t element_bytes,
                                          int rank, std::int64_t& failed_file, std::vector<checkpoint_part>& parts) {
  struct request {
    std::uint64_t offset, bytes;
    char* into;  // null: read only to be verified
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
                  detail::text(checkpoint, "/manifest.json: elements ", std::to_string(need.first), "..",
                               std::to_string(need.first + need.count), " of region '",
                               manifest.regions.at(need.region).name, "' (", manifest.tensors.at(need.tensor),
                               ") are held ", std::to_string(covered), " times over, not once"),
                  "the index is damaged; load an earlier checkpoint");
  }
  for (const auto& range : also_verify) requests.at(range.file).push_back({range.offset, range.bytes, nullptr});

  // Reads of at most this many bytes, each checksummed while it is still in the cache.
  constexpr std::uint64_t most = std::uint64_t{8} << 20;
  const std::uint64_t block = manifest.block_bytes;
  std::uint64_t bytes_read = 0;
  std::vector<char> scratch;
  for (std::size_t f = 0; f < requests.size(); ++f) {
    auto& mine = requests[f];
    if (mine.empty()) continue;
    failed_file = static_cast<std::int64_t>(f);
    const auto& file = manifest.files[f];
    const std::string path = (std::filesystem::path(checkpoint) / file.name).string();
    const std::string named = checkpoint_file_named(checkpoint, file);
    checkpoint_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat status {};
    if (fd.get() < 0 || ::fstat(fd.get(), &status) != 0)
      throw error(rank, "load_checkpoint", detail::text("cannot open ", named, ": ", std::strerror(errno)),
                  "every file of the checkpoint must be readable by every rank (a shared file system)");
    if (static_cast<std::uint64_t>(status.st_size) != file.bytes)
      throw error(rank, "load_checkpoint",
                  detail::text(named, " has ", std::to_string(status.st_size), " bytes, its index says ",
                               std::to_string(file.bytes)),
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
          throw error(rank, "load_checkpoint",
                      detail::text(named, ": block ", std::to_string(b), " (bytes ", std::to_string(b * block), "..",
                                   std::to_string(b * block + covered), ") has checksum ", hex64(found),
                                   ", its index says ", hex64(file.blocks[b])),
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
      read_exactly(fd.get(), std::move(pieces), start, end - start, named, rank);
      bytes_read += end - start;
      for (const auto& r : run) add(r.offset, r.bytes, r.into);
    }
    for (const auto& [b, sum_covered] : blocks) parts.push_back({f, b, sum_covered.first, sum_covered.second, rank});
  }
  failed_file = -1;
  return bytes_read;
}

COHORT_DECL void check_checkpoint_parts(const std::string& checkpoint, const checkpoint_manifest& manifest,
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
      readers += (readers.empty() ? "" : ", ") + std::to_string(parts[j].reader);
    }
    const std::string block = detail::text(checkpoint_file_named(checkpoint, file), ": block ", std::to_string(b),
                                           " (bytes ", std::to_string(begin), "..", std::to_string(begin + size), ")");
    if (b >= file.blocks.size() || covered != size)
      throw error(rank, "load_checkpoint",
                  detail::text(block, " was read in parts by ranks ", readers, ", ", std::to_string(covered),
                               " of its ", std::to_string(size), " bytes in all"),
                  "the index is damaged (its pieces overlap or leave bytes out); load an earlier checkpoint");
    if (const std::uint64_t found = checkpoint_checksum_finish(sum, size); found != file.blocks[b])
      throw error(rank, "load_checkpoint",
                  detail::text(block, " has checksum ", hex64(found), ", its index says ", hex64(file.blocks[b]),
                               " (read in parts by ranks ", readers, ")"),
                  "the file was altered or damaged after it was written; load an earlier checkpoint");
    i = j;
  }
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
// after region, into one buffer, and every block those lie in verified.
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
  std::vector<checkpoint_part> parts;
  bytes_read += read_checkpoint(checkpoint, manifest, needs, checkpoint_gaps(manifest), manifest.element_bytes, -1,
                                failed_file, parts);
  // Blocks only partly read (another tensor's bytes in them, when not every tensor is wanted):
  // read whole once more and verified, as no other rank holds the rest.
  std::vector<checkpoint_range> rest;
  for (const auto& p : parts) {
    const auto& file = manifest.files.at(p.file);
    const std::uint64_t begin = p.block * manifest.block_bytes;
    rest.push_back({p.file, begin, std::min(manifest.block_bytes, file.bytes - begin)});
  }
  if (!rest.empty()) {
    std::vector<checkpoint_part> none;
    bytes_read += read_checkpoint(checkpoint, manifest, {}, rest, manifest.element_bytes, -1, failed_file, none);
  }
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
      throw error(-1, "consolidate_checkpoint", detail::text("region '", r.name, "' has dtype ", r.dtype),
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
