#pragma once
// cohort/parallel/checkpoint.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).
// Over 400 lines: the index's writer and its checked reader, the directory contract, the
// reader of the files; one format's halves.

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
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/tools/detail/json_cursor.hpp"

namespace cohort::inline v0 {
namespace detail {

// A file descriptor closed when it goes: the error paths need no clean-up of their own.
class checkpoint_fd {
 public:
  explicit checkpoint_fd(int fd) noexcept : fd_(fd) {}
  checkpoint_fd(checkpoint_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
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
  // Kept open until the process ends (the directory's lock: see lock_checkpoint_directory).
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

inline std::string hex64(std::uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}
// Exactly 16 lowercase hex digits, as hex64 writes them: any other spelling of the same value
// is refused, so that no edit of the index's text reads back as what was written.
inline bool parse_hex64(std::string_view text, std::uint64_t& value) {
  if (text.size() != 16) return false;
  value = 0;
  for (const char c : text) {
    if (c >= '0' && c <= '9')
      value = value << 4 | static_cast<std::uint64_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      value = value << 4 | static_cast<std::uint64_t>(c - 'a' + 10);
    else
      return false;
  }
  return true;
}

// step-<N> as checkpoint_step_name writes it: decimal digits, no leading zero, at most
// checkpoint_index_limits::max_count. Anything else named step-* is not cohort's.
inline bool parse_step_name(std::string_view name, std::uint64_t& step) {
  if (name.size() <= 5 || name.substr(0, 5) != "step-") return false;
  const std::string_view digits = name.substr(5);
  if (digits.size() > 1 && digits[0] == '0') return false;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  return ec == std::errc{} && end == digits.data() + digits.size() && step <= checkpoint_index_limits::max_count;
}

inline const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a special file";
}

inline std::string path_in(const std::string& directory, std::string_view name) {
  return (std::filesystem::path(directory) / name).string();
}

// `path` as a directory to open files in (the caller's path: a symlink to it is the caller's
// choice), or a checkpoint_damaged_error.
inline checkpoint_fd open_checkpoint_directory(const std::string& path, int rank, std::string_view operation) {
  checkpoint_fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0)
    throw checkpoint_damaged_error(rank, operation,
                                   detail::text("cannot open the directory ", path, ": ", std::strerror(errno)),
                                   "pass a checkpoint directory (DIR/step-<N>) every rank can read");
  return fd;
}

// `name` in the directory `directory_fd` (`directory` for messages), for reading: a regular
// file, never through a symbolic link, never blocking on a FIFO or a device (checked before
// the open and again on what was opened). Anything else is a checkpoint_damaged_error naming
// it and what it is.
inline checkpoint_fd open_checkpoint_file(int directory_fd, const std::string& directory, const std::string& name,
                                          int rank, std::string_view operation) {
  const std::string path = path_in(directory, name);
  const auto refuse = [&](const std::string& why) {
    throw checkpoint_damaged_error(rank, operation, detail::text(path, ": ", why),
                                   "a checkpoint's files are regular files cohort wrote; load an earlier checkpoint");
  };
  struct stat status {};
  if (::fstatat(directory_fd, name.c_str(), &status, AT_SYMLINK_NOFOLLOW) != 0)
    refuse(detail::text("cannot stat it: ", std::strerror(errno)));
  if (!S_ISREG(status.st_mode)) refuse(detail::text("is ", file_kind(status.st_mode), ", not a regular file"));
  checkpoint_fd fd(::openat(directory_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) refuse(detail::text("cannot open it: ", std::strerror(errno)));
  if (::fstat(fd.get(), &status) != 0) refuse(detail::text("cannot stat it: ", std::strerror(errno)));
  if (!S_ISREG(status.st_mode)) refuse(detail::text("is ", file_kind(status.st_mode), ", not a regular file"));
  return fd;
}

inline std::uint64_t file_size(int fd) {
  struct stat status {};
  return ::fstat(fd, &status) == 0 ? static_cast<std::uint64_t>(status.st_size) : 0;
}

// Reads file bytes [offset, offset + total) into `pieces` (each iovec's length adding up to
// `total`): one preadv for neighbouring requests, however the kernel splits it.
inline void read_exactly(int fd, std::vector<iovec> pieces, std::uint64_t offset, std::uint64_t total,
                         const std::string& named, int rank, std::string_view operation) {
  std::size_t first = 0;
  for (std::uint64_t done = 0; done < total;) {
    const int count = static_cast<int>(std::min<std::size_t>(pieces.size() - first, IOV_MAX));
    const ssize_t got = ::preadv(fd, pieces.data() + first, count, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw checkpoint_damaged_error(
          rank, operation,
          detail::text("reading bytes ", std::to_string(offset + done), "..", std::to_string(offset + total), " of ",
                       named, " failed: ", (got == 0 ? "end of file" : std::strerror(errno))),
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

// Some file systems cannot fsync a directory (EINVAL): the rename is still atomic there.
inline void sync_directory(const std::string& directory, int rank) {
  checkpoint_fd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || (::fsync(fd.get()) != 0 && errno != EINVAL))
    throw error(rank, "save_checkpoint",
                detail::text("fsync of the directory ", directory, " failed: ", std::strerror(errno)),
                "the checkpoint's rename may not survive a power loss on this file system");
}

COHORT_DECL void checkpoint_warning(int rank, std::string_view message) {
  std::string line = "cohort";
  if (rank >= 0) line += detail::text(" [rank ", std::to_string(rank), "]");
  line += detail::text(" warning: ", message, "\n");
  std::cerr << line << std::flush;  // one write per line keeps ranks' lines whole
}

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

// DIR/.cohort: cohort's own folder in a checkpoint directory (see checkpoint.hpp).
inline constexpr const char* checkpoint_own_folder = ".cohort";

COHORT_DECL std::string checkpoint_staging_path(const std::string& directory, std::uint64_t step, std::uint64_t nonce) {
  return (std::filesystem::path(directory) / checkpoint_own_folder /
          detail::text("staging-", std::to_string(step), "-", hex64(nonce)))
      .string();
}

// ---- the index ---------------------------------------------------------------------------------

namespace {

// The index's last line: the checksum of every byte before it.
constexpr std::string_view index_trailer_lead = ",\n \"index_checksum\": \"";
constexpr std::string_view index_trailer_tail = "\"\n}\n";
constexpr std::size_t index_trailer_bytes = index_trailer_lead.size() + 16 + index_trailer_tail.size();

std::uint64_t dtype_bytes(std::string_view dtype) {
  if (dtype == "double") return 8;
  if (dtype == "float") return 4;
  if (dtype == "half" || dtype == "bfloat16") return 2;
  return 0;
}

}  // namespace

COHORT_DECL std::string checkpoint_manifest_json(const checkpoint_manifest& m) {
  std::string out = "{\n";
  const auto member = [&](std::string_view name) {
    out += " ";
    json_write_string(out, name);
    out += ": ";
  };
  const auto string_member = [&](std::string_view name, std::string_view value) {
    member(name);
    json_write_string(out, value);
    out += ",\n";
  };
  const auto number_member = [&](std::string_view name, std::uint64_t value) {
    member(name);
    out += detail::text(std::to_string(value), ",\n");
  };
  string_member("format", "cohort-checkpoint");
  number_member("version", checkpoint_format_version);
  string_member("checksum", checkpoint_checksum_kind);
  number_member("step", m.step);
  number_member("optimizer_steps", m.optimizer_steps);
  number_member("world_size", static_cast<std::uint64_t>(m.world_size));
  string_member("strategy", m.strategy);
  string_member("parameter_dtype", m.parameter_dtype);
  string_member("dtype", m.dtype);
  number_member("block_bytes", m.block_bytes);
  member("tensors");
  out += '[';
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    if (t != 0) out += ", ";
    json_write_string(out, m.tensors[t]);
  }
  out += "],\n";
  member("loss_scaler");
  if (m.scaler)
    out += detail::text("{\"scale\": ", json_format_number(m.scaler->scale),
                        ", \"good_steps\": ", std::to_string(m.scaler->good_steps),
                        ", \"skipped_steps\": ", std::to_string(m.scaler->skipped_steps), "},\n");
  else
    out += "null,\n";
  member("metadata");
  out += '{';
  bool first = true;
  for (const auto& [key, value] : m.metadata) {
    out += first ? "\n  " : ",\n  ";
    first = false;
    json_write_string(out, key);
    out += ": ";
    json_write_string(out, value);
  }
  out += m.metadata.empty() ? "},\n" : "\n },\n";
  member("regions");
  out += '[';
  for (std::size_t r = 0; r < m.regions.size(); ++r) {
    const auto& region = m.regions[r];
    out += r == 0 ? "\n  {\"name\": " : ",\n  {\"name\": ";
    json_write_string(out, region.name);
    out += detail::text(", \"count\": ", std::to_string(region.count), ", \"shape\": [");
    for (std::size_t d = 0; d < region.shape.size(); ++d)
      out += detail::text((d == 0 ? "" : ", "), std::to_string(region.shape[d]));
    out += "]}";
  }
  out += m.regions.empty() ? "],\n" : "\n ],\n";
  member("files");
  out += '[';
  for (std::size_t f = 0; f < m.files.size(); ++f) {
    const auto& file = m.files[f];
    out += f == 0 ? "\n  {\"name\": " : ",\n  {\"name\": ";
    json_write_string(out, file.name);
    out += detail::text(", \"rank\": ", std::to_string(file.rank), ", \"bytes\": ", std::to_string(file.bytes),
                        ", \"checksum\": \"", hex64(file.checksum), "\",\n   \"segments\": [");
    for (std::size_t k = 0; k < file.segments.size(); ++k) {
      const auto& s = file.segments[k];
      out += detail::text((k == 0 ? "[" : ", ["), std::to_string(s.region), ", ", std::to_string(s.first), ", ",
                          std::to_string(s.count), "]");
    }
    out += "],\n   \"block_checksums\": [";
    for (std::size_t b = 0; b < file.blocks.size(); ++b)
      out += detail::text((b == 0 ? "\"" : ", \""), hex64(file.blocks[b]), "\"");
    out += "]}";
  }
  out += m.files.empty() ? "]" : "\n ]";
  const std::uint64_t checksum = checkpoint_checksum(out.data(), out.size());
  out += detail::text(index_trailer_lead, hex64(checksum), index_trailer_tail);
  return out;
}

namespace {

// What parsing an index keeps, added up as it grows (each vector's element counted twice, for
// the capacity it may double into), and refused past checkpoint_index_limits::max_memory:
// however the index is forged, reading it costs a bounded amount of memory.
class index_budget {
 public:
  void charge(std::uint64_t bytes) {
    used_ += bytes;
    if (used_ > checkpoint_index_limits::max_memory)
      throw error(
          -1, "json parse",
          detail::text("its contents take more than ", std::to_string(checkpoint_index_limits::max_memory >> 20),
                       " MiB of memory, the most an index may (at byte ", std::to_string(at_), ")"));
  }
  static std::uint64_t heap(const std::string& text) { return text.size() > 15 ? text.size() + 17 : 0; }
  void at(std::size_t position) { at_ = position; }

 private:
  std::uint64_t used_ = 0;
  std::size_t at_ = 0;
};

[[noreturn]] void refuse_index(std::string_view why) { throw error(-1, "json parse", why); }

// Every region's elements held exactly once, over every file's segments.
void check_tiling(const checkpoint_manifest& m, index_budget& budget) {
  struct held {
    std::uint64_t first, count;
    std::uint32_t region, file;
  };
  std::vector<held> all;
  std::size_t total = 0;
  for (const auto& f : m.files) total += f.segments.size();
  budget.charge(total * sizeof(held));
  all.reserve(total);
  for (std::size_t f = 0; f < m.files.size(); ++f)
    for (const auto& s : m.files[f].segments)
      all.push_back({s.first, s.count, static_cast<std::uint32_t>(s.region), static_cast<std::uint32_t>(f)});
  std::sort(all.begin(), all.end(),
            [](const held& a, const held& b) { return std::tie(a.region, a.first) < std::tie(b.region, b.first); });
  std::size_t k = 0;
  for (std::uint32_t r = 0; r < m.regions.size(); ++r) {
    const auto& region = m.regions[r];
    std::uint64_t covered = 0;
    for (; k < all.size() && all[k].region == r; ++k) {
      if (all[k].first != covered)
        refuse_index(
            detail::text("region '", region.name, "': ",
                         all[k].first < covered
                             ? detail::text("elements ", std::to_string(all[k].first), "..", std::to_string(covered),
                                            " are held twice (", m.files[all[k].file].name, " and ",
                                            m.files[all[k - 1].file].name, ")")
                             : detail::text("elements ", std::to_string(covered), "..", std::to_string(all[k].first),
                                            " are in no file")));
      covered = all[k].first + all[k].count;
    }
    if (covered != region.count)
      refuse_index(detail::text("region '", region.name, "' has ", std::to_string(region.count),
                                " elements, its files' segments hold ", std::to_string(covered)));
  }
}

}  // namespace

COHORT_DECL checkpoint_manifest parse_checkpoint_manifest(std::string_view text, const std::string& path, int rank,
                                                          std::string_view operation) {
  using limits = checkpoint_index_limits;
  const auto damaged = [&](std::string_view why, std::string_view hint) {
    return checkpoint_damaged_error(rank, operation, detail::text(path, ": ", why), hint);
  };
  constexpr std::string_view damaged_hint =
      "the index is damaged, truncated or edited; load an earlier checkpoint (resume_checkpoint falls back to it)";
  const auto other_version = [&](std::uint64_t version) {
    return damaged(detail::text("index version ", std::to_string(version), ", this build reads version ",
                                std::to_string(checkpoint_format_version),
                                (version == 1   ? " (version 1 kept FNV-1a block checksums)"
                                 : version == 2 ? " (version 2 had no checksum of the index itself)"
                                                : "")),
                   "read it with the cohort version that wrote it");
  };
  // Its last line first: the checksum of everything before it, verified before any of it is
  // used. Without one, the version says why (an older format) or the index is damaged.
  std::uint64_t stated = 0;
  const bool has_trailer =
      text.size() >= index_trailer_bytes &&
      text.substr(text.size() - index_trailer_bytes, index_trailer_lead.size()) == index_trailer_lead &&
      text.substr(text.size() - index_trailer_tail.size()) == index_trailer_tail &&
      parse_hex64(text.substr(text.size() - index_trailer_tail.size() - 16, 16), stated);
  if (!has_trailer) {
    std::optional<std::uint64_t> version;
    try {
      json_cursor in(text, {limits::max_bytes, 4});
      in.open('{');
      in.key("format");
      if (in.string() == "cohort-checkpoint") {
        in.comma();
        in.key("version");
        version = in.unsigned_integer();
      }
    } catch (const error&) {}
    if (version && *version != checkpoint_format_version) throw other_version(*version);
    throw damaged("its last line is not the index checksum line (damaged, truncated, or not a cohort index)",
                  damaged_hint);
  }
  const std::size_t body = text.size() - index_trailer_bytes;
  if (const std::uint64_t found = checkpoint_checksum(text.data(), body); found != stated)
    throw damaged(detail::text("the index checksum of its first ", std::to_string(body), " bytes is ", hex64(found),
                               ", its last line says ", hex64(stated)),
                  damaged_hint);

  // Then every member, in the order they are written, each checked as it is read and before
  // anything is allocated for what it says.
  checkpoint_manifest m;
  index_budget budget;
  try {
    json_cursor in(text, {limits::max_bytes, 4});
    const auto name_of = [&](std::string value, std::string_view what) {
      if (value.empty() || value.size() > limits::max_name)
        refuse_index(detail::text(what, " of ", std::to_string(value.size()), " bytes (1..",
                                  std::to_string(limits::max_name), " allowed)"));
      return value;
    };
    const auto number_in = [&](std::string_view what, std::uint64_t low, std::uint64_t high) {
      const std::uint64_t value = in.unsigned_integer();
      if (value < low || value > high)
        refuse_index(detail::text(what, " ", std::to_string(value), " is outside ", std::to_string(low), "..",
                                  std::to_string(high)));
      return value;
    };
    in.open('{');
    in.key("format");
    if (in.string() != "cohort-checkpoint") refuse_index("its format is not cohort-checkpoint");
    in.comma();
    in.key("version");
    if (const auto version = in.unsigned_integer(); version != checkpoint_format_version) throw other_version(version);
    in.comma();
    in.key("checksum");
    if (const auto kind = in.string(); kind != checkpoint_checksum_kind)
      throw damaged(
          detail::text("block checksums of kind '", kind, "', this build knows '", checkpoint_checksum_kind, "'"),
          "read it with the cohort version that wrote it");
    in.comma();
    in.key("step");
    m.step = number_in("step", 0, limits::max_count);
    in.comma();
    in.key("optimizer_steps");
    m.optimizer_steps = number_in("optimizer_steps", 0, limits::max_count);
    in.comma();
    in.key("world_size");
    m.world_size = static_cast<int>(number_in("world_size", 1, limits::max_world));
    in.comma();
    in.key("strategy");
    m.strategy = in.string();
    if (m.strategy.empty() || m.strategy.size() > 32 || !std::all_of(m.strategy.begin(), m.strategy.end(), [](char c) {
          return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
        }))
      refuse_index(detail::text("strategy '", m.strategy, "' is not a strategy's name"));
    in.comma();
    in.key("parameter_dtype");
    m.parameter_dtype = in.string();
    if (dtype_bytes(m.parameter_dtype) == 0)
      refuse_index(detail::text("parameter_dtype '", m.parameter_dtype, "' is not a dtype cohort writes"));
    in.comma();
    in.key("dtype");
    m.dtype = in.string();
    m.element_bytes = dtype_bytes(m.dtype);
    if (m.element_bytes == 0) refuse_index(detail::text("dtype '", m.dtype, "' is not a dtype cohort writes"));
    in.comma();
    in.key("block_bytes");
    m.block_bytes = number_in("block_bytes", limits::min_block, limits::max_block);
    in.comma();
    in.key("tensors");
    in.open('[');
    for (bool first = true; in.more(']', first); first = false) {
      if (m.tensors.size() == limits::max_tensors)
        refuse_index(detail::text("more than ", std::to_string(limits::max_tensors), " tensors per element"));
      m.tensors.push_back(name_of(in.string(), "a tensor name"));
      for (std::size_t t = 0; t + 1 < m.tensors.size(); ++t)
        if (m.tensors[t] == m.tensors.back()) refuse_index(detail::text("tensor '", m.tensors[t], "' is named twice"));
    }
    if (m.tensors.empty() || m.tensors[0] != "parameters") refuse_index("its first tensor is not 'parameters'");
    in.comma();
    in.key("loss_scaler");
    if (!in.null()) {
      loss_scaler::saved_state scaler{};
      in.open('{');
      in.key("scale");
      scaler.scale = in.number();
      if (!(scaler.scale > 0) || !std::isfinite(scaler.scale))
        refuse_index(detail::text("loss scale ", json_format_number(scaler.scale), " is not positive"));
      in.comma();
      in.key("good_steps");
      scaler.good_steps = static_cast<std::uint32_t>(number_in("good_steps", 0, UINT32_MAX));
      in.comma();
      in.key("skipped_steps");
      scaler.skipped_steps = number_in("skipped_steps", 0, limits::max_count);
      in.close('}');
      m.scaler = scaler;
    }
    in.comma();
    in.key("metadata");
    in.open('{');
    for (bool first = true; in.more('}', first); first = false) {
      budget.at(in.position());
      std::string key = name_of(in.string(), "a metadata key");
      in.open(':');
      std::string value = in.string();
      budget.charge(128 + index_budget::heap(key) + index_budget::heap(value));
      if (!m.metadata.emplace(std::move(key), std::move(value)).second) refuse_index("a metadata key is given twice");
    }
    in.comma();
    in.key("regions");
    in.open('[');
    for (bool first = true; in.more(']', first); first = false) {
      budget.at(in.position());
      checkpoint_region region;
      in.open('{');
      in.key("name");
      region.name = name_of(in.string(), "a region name");
      in.comma();
      in.key("count");
      region.count = number_in("a region's count", 1, limits::max_count);
      in.comma();
      in.key("shape");
      in.open('[');
      std::uint64_t product = 1;
      for (bool first_dimension = true; in.more(']', first_dimension); first_dimension = false) {
        if (region.shape.size() == limits::max_dimensions)
          refuse_index(detail::text("region '", region.name, "' has more than ", std::to_string(limits::max_dimensions),
                                    " dimensions"));
        region.shape.push_back(number_in("a dimension", 1, limits::max_count));
        product =
            product > limits::max_count / region.shape.back() ? limits::max_count + 1 : product * region.shape.back();
      }
      if (region.shape.empty() || product != region.count)
        refuse_index(detail::text("region '", region.name, "' has ", std::to_string(region.count),
                                  " elements, its shape holds ",
                                  (product > limits::max_count ? std::string("more than 2^56")
                                                               : std::to_string(region.shape.empty() ? 0 : product))));
      in.close('}');
      budget.charge(2 * sizeof(checkpoint_region) + index_budget::heap(region.name) + 16 * region.shape.size() + 32);
      m.regions.push_back(std::move(region));
    }
    if (m.regions.empty()) refuse_index("it names no region");
    {  // each name once: sorted, neighbours compared
      std::vector<const std::string*> names;
      budget.charge(m.regions.size() * sizeof(void*));
      names.reserve(m.regions.size());
      for (const auto& r : m.regions) names.push_back(&r.name);
      std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
      for (std::size_t k = 1; k < names.size(); ++k)
        if (*names[k] == *names[k - 1]) refuse_index(detail::text("region '", *names[k], "' is named twice"));
    }
    in.comma();
    in.key("files");
    in.open('[');
    for (bool first = true; in.more(']', first); first = false) {
      budget.at(in.position());
      if (m.files.size() == static_cast<std::size_t>(m.world_size))
        refuse_index(detail::text("more files than its world size ", std::to_string(m.world_size)));
      checkpoint_file file;
      file.rank = static_cast<int>(m.files.size());
      in.open('{');
      in.key("name");
      file.name = in.string();
      if (file.name != checkpoint_file_name(file.rank))
        refuse_index(detail::text("file ", std::to_string(file.rank), " is named '", file.name.substr(0, 64), "', not ",
                                  checkpoint_file_name(file.rank)));
      in.comma();
      in.key("rank");
      number_in(detail::text(file.name, "'s rank"), static_cast<std::uint64_t>(file.rank),
                static_cast<std::uint64_t>(file.rank));
      in.comma();
      in.key("bytes");
      file.bytes = in.unsigned_integer();
      in.comma();
      in.key("checksum");
      if (!parse_hex64(in.string(), file.checksum))
        refuse_index(detail::text(file.name, "'s checksum is not 16 hex digits"));
      in.comma();
      in.key("segments");
      in.open('[');
      for (bool first_segment = true; in.more(']', first_segment); first_segment = false) {
        checkpoint_segment s;
        in.open('[');
        s.region = static_cast<std::size_t>(number_in("a segment's region", 0, m.regions.size() - 1));
        in.comma();
        const auto& region = m.regions[s.region];
        s.first = number_in(detail::text("the first element of a segment of '", region.name, "'"), 0, region.count - 1);
        in.comma();
        s.count =
            number_in(detail::text("the count of a segment of '", region.name, "' from ", std::to_string(s.first)), 1,
                      region.count - s.first);
        in.close(']');
        file.elements += s.count;
        if (file.elements > limits::max_count)
          refuse_index(detail::text(file.name, "'s segments hold more than 2^56 elements"));
        budget.charge(2 * sizeof(checkpoint_segment));
        file.segments.push_back(s);
      }
      // The file's size follows from its segments: no byte of it unaccounted for, none twice.
      if (const std::uint64_t expected = m.tensors.size() * file.elements * m.element_bytes; file.bytes != expected)
        refuse_index(detail::text(file.name, " has ", std::to_string(file.bytes), " bytes, its segments hold ",
                                  std::to_string(file.elements), " elements of ", std::to_string(m.tensors.size()),
                                  " tensors of ", m.dtype, ": ", std::to_string(expected), " bytes"));
      in.comma();
      in.key("block_checksums");
      in.open('[');
      // One per block: at most what the rest of the text can spell (19 characters each), so
      // the reservation is bounded by the text whatever `bytes` says.
      const std::uint64_t blocks = (file.bytes + m.block_bytes - 1) / m.block_bytes;
      const std::uint64_t room = in.remaining() / 19 + 1;
      budget.charge(8 * std::min(blocks, room));
      file.blocks.reserve(static_cast<std::size_t>(std::min(blocks, room)));
      for (bool first_block = true; in.more(']', first_block); first_block = false) {
        std::uint64_t checksum = 0;
        if (file.blocks.size() == blocks)
          refuse_index(
              detail::text(file.name, " has more block checksums than its ", std::to_string(blocks), " blocks"));
        if (!parse_hex64(in.string(), checksum))
          refuse_index(detail::text("a block checksum of ", file.name, " is not 16 hex digits"));
        file.blocks.push_back(checksum);
      }
      if (file.blocks.size() != blocks)
        refuse_index(detail::text(file.name, " has ", std::to_string(file.blocks.size()), " block checksums for its ",
                                  std::to_string(blocks), " blocks"));
      if (checkpoint_file_checksum(file.blocks, file.bytes) != file.checksum)
        refuse_index(detail::text("the block checksums of ", file.name, " do not add up to its checksum"));
      in.close('}');
      budget.charge(2 * sizeof(checkpoint_file));
      m.files.push_back(std::move(file));
    }
    if (m.files.size() != static_cast<std::size_t>(m.world_size))
      refuse_index(
          detail::text(std::to_string(m.files.size()), " files for its world size ", std::to_string(m.world_size)));
    in.comma();
    in.key("index_checksum");
    in.string();
    in.close('}');
    in.finish();
    check_tiling(m, budget);
  } catch (const checkpoint_damaged_error&) {
    throw;
  } catch (const error& failure) {
    throw damaged(failure.detail(), failure.hint().empty() ? damaged_hint : std::string_view(failure.hint()));
  }
  return m;
}

COHORT_DECL checkpoint_manifest read_checkpoint_manifest(const std::string& checkpoint, int rank,
                                                         std::string_view operation) {
  const std::string path = path_in(checkpoint, "manifest.json");
  auto directory = open_checkpoint_directory(checkpoint, rank, operation);
  auto fd = open_checkpoint_file(directory.get(), checkpoint, "manifest.json", rank, operation);
  // Its size before a byte of it is read: a hostile index costs nothing past the limit.
  const std::uint64_t size = file_size(fd.get());
  if (size > checkpoint_index_limits::max_bytes)
    throw checkpoint_damaged_error(rank, operation,
                                   detail::text(path, " has ", std::to_string(size), " bytes, more than an index may (",
                                                std::to_string(checkpoint_index_limits::max_bytes >> 20), " MiB)"),
                                   "the index is damaged or not cohort's; load an earlier checkpoint");
  std::string text(static_cast<std::size_t>(size) + 1, '\0');
  std::size_t got = 0;
  for (ssize_t n = 0; got < text.size(); got += static_cast<std::size_t>(n)) {
    n = ::read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) {
      n = 0;
      continue;
    }
    if (n < 0)
      throw checkpoint_damaged_error(rank, operation, detail::text("reading ", path, " failed: ", std::strerror(errno)),
                                     "the file system failed; load an earlier checkpoint");
    if (n == 0) break;
  }
  if (got != size)
    throw checkpoint_damaged_error(rank, operation,
                                   detail::text(path, " changed size while it was read (", std::to_string(size),
                                                " bytes, then ", std::to_string(got), ")"),
                                   "something writes the checkpoint's index: one job at a time per directory");
  text.resize(got);
  auto m = parse_checkpoint_manifest(text, path, rank, operation);
  // A checkpoint named step-<N> is step N's: a directory renamed by hand is not resumed as
  // another step.
  std::uint64_t named = 0;
  if (parse_step_name(std::filesystem::path(checkpoint).filename().string(), named) && named != m.step)
    throw checkpoint_damaged_error(rank, operation,
                                   detail::text(path, " is the index of step ", std::to_string(m.step),
                                                ", in a directory named ", checkpoint_step_name(named)),
                                   "a checkpoint directory keeps the name it was committed under");
  return m;
}

}  // namespace detail

// ---- the directory -----------------------------------------------------------------------------

namespace detail {
namespace {

// Why DIR/<name> is not a committed cohort checkpoint, or nullptr when it is one: a directory
// (not a symlink) holding a regular manifest.json that begins as every cohort index has, of
// any version. Only those are loaded, replaced or pruned.
const char* not_a_checkpoint(int directory_fd, const std::string& name) {
  struct stat status {};
  if (::fstatat(directory_fd, name.c_str(), &status, AT_SYMLINK_NOFOLLOW) != 0) return "cannot be read";
  if (!S_ISDIR(status.st_mode)) return S_ISLNK(status.st_mode) ? "is a symbolic link" : "is not a directory";
  checkpoint_fd checkpoint(::openat(directory_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (checkpoint.get() < 0) return "cannot be read";
  if (::fstatat(checkpoint.get(), "manifest.json", &status, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(status.st_mode))
    return "holds no cohort index";
  checkpoint_fd index(::openat(checkpoint.get(), "manifest.json", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  constexpr std::string_view head = "{\n \"format\": \"cohort-checkpoint\"";
  char start[head.size()];
  if (index.get() < 0 || ::pread(index.get(), start, head.size(), 0) != static_cast<ssize_t>(head.size()) ||
      std::string_view(start, head.size()) != head)
    return "holds no cohort index";
  return nullptr;
}

struct directory_stream {
  DIR* stream;
  explicit directory_stream(const std::string& path) : stream(::opendir(path.c_str())) {}
  directory_stream(const directory_stream&) = delete;
  directory_stream& operator=(const directory_stream&) = delete;
  ~directory_stream() {
    if (stream) ::closedir(stream);
  }
  // The next name, skipping . and ..; empty at the end.
  std::string next() {
    while (stream)
      if (const dirent* entry = ::readdir(stream)) {
        const std::string_view name = entry->d_name;
        if (name != "." && name != "..") return std::string(name);
      } else {
        break;
      }
    return {};
  }
};

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

std::string read_small_file(const std::string& path) {
  checkpoint_fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  struct stat status {};
  if (fd.get() < 0 || ::fstat(fd.get(), &status) != 0 || !S_ISREG(status.st_mode)) return {};
  char buffer[4096];
  const ssize_t got = ::read(fd.get(), buffer, sizeof buffer);
  return got > 0 ? std::string(buffer, static_cast<std::size_t>(got)) : std::string();
}

lock_holder this_process() {
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

lock_holder parse_holder(const std::string& text) {
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
std::string own_folder(const std::string& directory, int rank, std::string_view operation) {
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

COHORT_DECL checkpoint_listing list_checkpoints(const std::string& directory) {
  checkpoint_listing out;
  directory_stream entries(directory);
  if (!entries.stream) return out;
  const int directory_fd = ::dirfd(entries.stream);
  for (std::string name = entries.next(); !name.empty(); name = entries.next()) {
    if (name.rfind("step-", 0) != 0) continue;
    std::uint64_t step = 0;
    if (!parse_step_name(name, step)) {
      out.ignored.push_back(detail::text(path_in(directory, name),
                                         ": not a step number cohort writes (step-<N>, N without leading zeros, "
                                         "below 2^56); never loaded, renamed or deleted"));
      continue;
    }
    if (const char* why = not_a_checkpoint(directory_fd, name))
      out.ignored.push_back(detail::text(path_in(directory, name), ": ", why,
                                         ", so not a cohort checkpoint; never loaded, renamed or deleted"));
    else
      out.committed.emplace_back(step, path_in(directory, name));
  }
  std::sort(out.committed.begin(), out.committed.end());
  std::sort(out.ignored.begin(), out.ignored.end());
  return out;
}

COHORT_DECL void lock_checkpoint_directory(const std::string& directory, int rank, std::string_view operation) {
  const std::string folder = own_folder(directory, rank, operation);
  const std::string lock_path = path_in(folder, "lock"), holder_path = path_in(folder, "holder");
  const lock_holder me = this_process();
  // This process holds it already: the lock's own file is not opened again (under NFS, flock
  // is a POSIX lock, which closing any descriptor of the file would release).
  if (parse_holder(read_small_file(holder_path)).same_process(me)) return;
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
  // Who holds it, for the next job's error: written whole (a temporary renamed over it).
  const std::string temporary = detail::text(holder_path, ".", me.pid);
  {
    checkpoint_fd out(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644));
    const std::string text = me.text();
    if (out.get() < 0 || ::write(out.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()) ||
        ::rename(temporary.c_str(), holder_path.c_str()) != 0)
      throw error(rank, operation, detail::text("cannot write ", holder_path, ": ", std::strerror(errno)),
                  "the checkpoint directory must be writable by rank 0");
  }
  // Held for as long as this process lives: no object of a trainer's spans a whole job (saves
  // and resumes are calls), and the kernel releases it however the process ends, so no stale
  // lock outlives its job.
  (void)lock.release();
}

COHORT_DECL void begin_checkpoint(const std::string& directory, const std::string& staging, std::uint64_t step,
                                  int rank) {
  constexpr std::string_view operation = "save_checkpoint";
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw error(rank, operation, detail::text("cannot create ", directory, ": ", ec.message()),
                "the checkpoint directory must be writable by the ranks that save");
  lock_checkpoint_directory(directory, rank, operation);
  // What interrupted saves and prunes of this directory left: cohort's own (the lock says no
  // other job uses the directory, and saves are collective, so none of this job is under way).
  const std::string folder = path_in(directory, checkpoint_own_folder);
  {
    directory_stream entries(folder);
    for (std::string name = entries.next(); !name.empty(); name = entries.next())
      if (name.rfind("staging-", 0) == 0 || name.rfind("pruning-", 0) == 0 || name.rfind("replaced-", 0) == 0)
        std::filesystem::remove_all(path_in(folder, name), ec);
  }
  const std::string target = path_in(directory, checkpoint_step_name(step));
  struct stat status {};
  if (::lstat(target.c_str(), &status) == 0) {
    checkpoint_fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (const char* why = not_a_checkpoint(dir.get(), checkpoint_step_name(step)))
      throw error(rank, operation,
                  detail::text(target, " exists and ", why, ": cohort replaces only its own checkpoints"),
                  "move it away, or save into another directory");
  }
  if (::mkdir(staging.c_str(), 0755) != 0)
    throw error(rank, operation, detail::text("cannot create ", staging, ": ", std::strerror(errno)),
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
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) throw failure("cannot create");
}

COHORT_DECL checkpoint_file_writer::~checkpoint_file_writer() {
  if (fd_ >= 0) ::close(fd_);
}

COHORT_DECL error checkpoint_file_writer::failure(const std::string& what) {
  failed_errno_ = errno;
  return error(rank_, "save_checkpoint",
               detail::text(what, " ", path_, ": ", std::strerror(failed_errno_), " (errno ",
                            std::to_string(failed_errno_), ")"),
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
  const std::string nonce = std::filesystem::path(staging).filename().string().substr(8);  // after "staging-"
  // A checkpoint of the same step is replaced: moved into DIR/.cohort first (the staging
  // directory's own name, so an interruption leaves it to the next save's clean-up).
  std::string aside;
  struct stat status {};
  if (::lstat(target.c_str(), &status) == 0) {
    checkpoint_fd dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (const char* why = not_a_checkpoint(dir.get(), name))
      throw error(rank, operation,
                  detail::text(target, " exists and ", why, ": cohort replaces only its own checkpoints"),
                  "move it away, or save into another directory");
    aside = path_in(folder, detail::text("replaced-", nonce));
    next_step();
    if (::rename(target.c_str(), aside.c_str()) != 0)
      throw failed(detail::text("cannot move ", target, " aside"), errno);
  }
  next_step();
  if (::rename(staging.c_str(), target.c_str()) != 0)
    throw failed(detail::text("cannot rename ", staging, " to ", target), errno);
  next_step();
  sync_directory(directory, rank);
  if (!aside.empty()) {
    next_step();
    std::error_code ec;
    std::filesystem::remove_all(aside, ec);
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
        std::error_code ec;
        std::filesystem::remove_all(path_in(pruning, file), ec);
      }
    }
    next_step();
    if (::rmdir(pruning.c_str()) != 0) throw failed(detail::text("cannot remove ", pruning), errno);
  }
}

COHORT_DECL std::vector<std::size_t> match_checkpoint(const checkpoint_manifest& manifest,
                                                      const std::string& checkpoint,
                                                      const std::vector<std::string>& region_names,
                                                      const std::vector<std::uint64_t>& region_counts,
                                                      const std::string& dtype, const std::vector<std::string>& tensors,
                                                      int rank) {
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

inline std::string checkpoint_file_named(const std::string& checkpoint, const checkpoint_file& file) {
  return detail::text(path_in(checkpoint, file.name), " (written by rank ", std::to_string(file.rank), ")");
}

COHORT_DECL std::uint64_t read_checkpoint(const std::string& checkpoint, const checkpoint_manifest& manifest,
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

COHORT_DECL std::string safetensors_dtype(const std::string& dtype) {
  if (dtype == "float") return "F32";
  if (dtype == "double") return "F64";
  if (dtype == "half") return "F16";
  if (dtype == "bfloat16") return "BF16";
  return {};
}

COHORT_DECL std::string describe_checkpoint(const std::string& checkpoint, const checkpoint_manifest& m) {
  std::uint64_t elements = 0, bytes = 0;
  for (const auto& r : m.regions) elements += r.count;
  for (const auto& f : m.files) bytes += f.bytes;
  std::string tensors;
  for (const auto& t : m.tensors) tensors += detail::text((tensors.empty() ? "" : ", "), t);
  std::string out = detail::text(checkpoint, "\n  step ", std::to_string(m.step), " (optimizer steps ",
                                 std::to_string(m.optimizer_steps), "), saved by ", std::to_string(m.world_size),
                                 " ranks under ", m.strategy, "; parameters ", m.parameter_dtype, ", masters ", m.dtype,
                                 "\n  tensors per element: ", tensors, "\n");
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

namespace {

// Every element of the first `tensors` tensors of every region, tensor after tensor, region
// after region, into `data`, and every block those lie in verified.
void read_whole_tensors(const std::string& checkpoint, const checkpoint_manifest& manifest, std::size_t tensors,
                        std::vector<char>& data, std::uint64_t& bytes_read) {
  std::vector<checkpoint_need> needs;
  std::uint64_t at = 0;
  for (std::size_t t = 0; t < tensors; ++t)
    for (std::size_t r = 0; r < manifest.regions.size(); ++r) {
      needs.push_back({t, r, 0, manifest.regions[r].count, data.data() + at * manifest.element_bytes});
      at += manifest.regions[r].count;
    }
  std::vector<checkpoint_part> parts;
  bytes_read += read_checkpoint(checkpoint, manifest, needs, {}, -1, parts);
  // Blocks only partly read (another tensor's bytes in them): read whole once more and
  // verified, as no other rank holds the rest.
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

COHORT_DECL std::optional<std::string> newest_checkpoint(const std::string& directory) {
  const auto listing = detail::list_checkpoints(directory);
  if (listing.committed.empty()) return std::nullopt;
  return listing.committed.back().second;
}

COHORT_DECL std::uint64_t verify_checkpoint(const std::string& checkpoint) {
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

COHORT_DECL void consolidate_checkpoint(const std::string& checkpoint, const std::string& safetensors_path) {
  constexpr std::string_view operation = "consolidate_checkpoint";
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
  const std::filesystem::path target(safetensors_path);
  const std::string parent = target.parent_path().empty() ? "." : target.parent_path().string();
  detail::temporary_file temporary{detail::path_in(
      parent, detail::text(".", target.filename().string(), ".cohort-tmp-", std::to_string(::getpid())))};
  ::unlink(temporary.path.c_str());
  {
    int code = 0;
    detail::checkpoint_file_writer out(temporary.path, std::size_t{1} << 20, -1, code);
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
  detail::sync_directory(parent, -1);
}

}  // namespace cohort::inline v0
