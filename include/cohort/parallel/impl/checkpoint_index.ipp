#pragma once
// cohort/parallel/checkpoint.hpp's definitions, part one: the block checksum, the index's
// writer and its checked reader, and the few file primitives both parts use (included by
// impl/checkpoint.ipp; cold templates when header-only, as there, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION).
// Over 400 lines: the index's writer and its reader belong together, one format's halves; the
// reader checks every field as it reads it.

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/files.hpp"
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

COHORT_COLD inline std::string hex64(std::uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}
// Exactly 16 lowercase hex digits, as hex64 writes them: any other spelling of the same value
// is refused, so that no edit of the index's text reads back as what was written.
COHORT_COLD inline bool parse_hex64(std::string_view text, std::uint64_t& value) {
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
COHORT_COLD inline bool parse_step_name(std::string_view name, std::uint64_t& step) {
  if (name.size() <= 5 || name.substr(0, 5) != "step-") return false;
  const std::string_view digits = name.substr(5);
  if (digits.size() > 1 && digits[0] == '0') return false;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  return ec == std::errc{} && end == digits.data() + digits.size() && step <= checkpoint_index_limits::max_count;
}

COHORT_COLD inline const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a special file";
}

// `path` as a directory to open files in (the caller's path: a symlink to it is the caller's
// choice), or a checkpoint_damaged_error.
COHORT_COLD inline checkpoint_fd open_checkpoint_directory(const std::string& path, int rank,
                                                           std::string_view operation) {
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
COHORT_COLD inline checkpoint_fd open_checkpoint_file(int directory_fd, const std::string& directory,
                                                      const std::string& name, int rank, std::string_view operation) {
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

COHORT_COLD inline std::uint64_t file_size(int fd) {
  struct stat status {};
  return ::fstat(fd, &status) == 0 ? static_cast<std::uint64_t>(status.st_size) : 0;
}

// Reads file bytes [offset, offset + total) into `pieces` (each iovec's length adding up to
// `total`): one preadv for neighbouring requests, however the kernel splits it.
COHORT_COLD inline void read_exactly(int fd, std::vector<iovec> pieces, std::uint64_t offset, std::uint64_t total,
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
COHORT_COLD inline void sync_directory(
    const std::string& directory, int rank, std::string_view operation = "save_checkpoint",
    std::string_view hint = "the checkpoint's rename may not survive a power loss on this file system") {
  checkpoint_fd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || (::fsync(fd.get()) != 0 && errno != EINVAL))
    throw error(rank, operation, detail::text("fsync of the directory ", directory, " failed: ", std::strerror(errno)),
                hint);
}

COHORT_COLD_BODY void checkpoint_warning(int rank, std::string_view message) {
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
COHORT_COLD inline std::uint64_t checksum_partial_word(const unsigned char* data, std::uint64_t at,
                                                       std::size_t bytes) noexcept {
  std::uint64_t word = 0;
  for (std::size_t k = 0; k < bytes; ++k) word |= std::uint64_t{data[k]} << (8 * ((at + k) % 4));
  return word * checksum_key(at / 4);
}

COHORT_COLD_BODY std::uint64_t checkpoint_checksum_part(const void* data, std::uint64_t at,
                                                        std::size_t bytes) noexcept {
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

COHORT_COLD_BODY std::uint64_t checkpoint_checksum_finish(std::uint64_t parts, std::uint64_t bytes) noexcept {
  return parts + checksum_mix(bytes);
}

COHORT_COLD_BODY std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes) noexcept {
  return checkpoint_checksum_finish(checkpoint_checksum_part(data, 0, bytes), bytes);
}

COHORT_COLD_BODY std::uint64_t checkpoint_file_checksum(const std::vector<std::uint64_t>& blocks,
                                                        std::uint64_t bytes) noexcept {
  std::vector<std::uint64_t> words(blocks);
  words.push_back(bytes);
  return checkpoint_checksum(words.data(), words.size() * sizeof(std::uint64_t));
}

COHORT_COLD_BODY std::string checkpoint_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  return name;
}

COHORT_COLD_BODY std::string checkpoint_step_name(std::uint64_t step) {
  return detail::text("step-", std::to_string(step));
}

// DIR/.cohort: cohort's own folder in a checkpoint directory (see checkpoint.hpp).
inline constexpr const char* checkpoint_own_folder = ".cohort";

COHORT_COLD_BODY std::string checkpoint_staging_path(const std::string& directory, std::uint64_t step,
                                                     std::uint64_t nonce) {
  return path_in(path_in(directory, checkpoint_own_folder),
                 detail::text("staging-", std::to_string(step), "-", hex64(nonce)));
}

// ---- the index ---------------------------------------------------------------------------------

namespace {

// The index's last line: the checksum of every byte before it.
constexpr std::string_view index_trailer_lead = ",\n \"index_checksum\": \"";
constexpr std::string_view index_trailer_tail = "\"\n}\n";
constexpr std::size_t index_trailer_bytes = index_trailer_lead.size() + 16 + index_trailer_tail.size();

// What an index may name: the strategies, and the tensors per element as
// training_state::checkpoint_tensors() names them (the parameters, then the optimizer's
// moments or momentum where the optimizer is cohort's).
constexpr strategy checkpoint_strategies[] = {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3};
COHORT_COLD bool is_checkpoint_tensor_set(const std::vector<std::string>& tensors) {
  if (tensors.empty() || tensors[0] != "parameters") return false;
  if (tensors.size() == 2) return tensors[1] == "sgd.momentum";
  if (tensors.size() == 3) return tensors[1] == "adam.exp_avg" && tensors[2] == "adam.exp_avg_sq";
  return tensors.size() == 1;
}

COHORT_COLD std::uint64_t dtype_bytes(std::string_view dtype) {
  if (dtype == "double") return 8;
  if (dtype == "float") return 4;
  if (dtype == "half" || dtype == "bfloat16") return 2;
  return 0;
}

}  // namespace

COHORT_COLD_BODY std::string checkpoint_manifest_json(const checkpoint_manifest& m) {
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
  string_member("run", m.run);
  string_member("job", m.job);
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

COHORT_COLD [[noreturn]] void refuse_index(std::string_view why) { throw error(-1, "json parse", why); }

// Every region's elements held exactly once, over every file's segments.
COHORT_COLD void check_tiling(const checkpoint_manifest& m, index_budget& budget) {
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

COHORT_COLD_BODY checkpoint_manifest parse_checkpoint_manifest(std::string_view text, const std::string& path, int rank,
                                                               std::string_view operation) {
  using limits = checkpoint_index_limits;
  const auto damaged = [&](std::string_view why, std::string_view hint) {
    return checkpoint_damaged_error(rank, operation, detail::text(path, ": ", why), hint);
  };
  constexpr std::string_view damaged_hint =
      "the index is damaged, truncated or edited; load an earlier checkpoint (resume_checkpoint falls back to it)";
  const auto other_version = [&](std::uint64_t version) {
    return damaged(detail::text("index version ", std::to_string(version), ", this build reads versions ",
                                std::to_string(checkpoint_oldest_readable_version), " to ",
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
    if (version && (*version < checkpoint_oldest_readable_version || *version > checkpoint_format_version))
      throw other_version(*version);
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
    const auto version = in.unsigned_integer();
    if (version < checkpoint_oldest_readable_version || version > checkpoint_format_version)
      throw other_version(version);
    in.comma();
    in.key("checksum");
    if (const auto kind = in.string(); kind != checkpoint_checksum_kind)
      throw damaged(
          detail::text("block checksums of kind '", kind, "', this build knows '", checkpoint_checksum_kind, "'"),
          "read it with the cohort version that wrote it");
    in.comma();
    if (version >= 4) {
      in.key("run");
      m.run = in.string();
      if (std::uint64_t run = 0; !parse_hex64(m.run, run))
        refuse_index(detail::text("run '", m.run.substr(0, 64), "' is not 16 lowercase hex digits"));
      in.comma();
      in.key("job");
      m.job = in.string();
      if (m.job.size() > 256 || !std::all_of(m.job.begin(), m.job.end(), [](char c) { return c >= 0x20 && c < 0x7f; }))
        refuse_index(detail::text("job '", m.job.substr(0, 64), "' (", std::to_string(m.job.size()),
                                  " bytes) is not a launcher's job id: at most 256 printable characters"));
      in.comma();
    }
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
    if (std::none_of(std::begin(checkpoint_strategies), std::end(checkpoint_strategies),
                     [&](strategy known) { return m.strategy == to_string(known); }))
      refuse_index(
          detail::text("strategy '", m.strategy.substr(0, 64), "' is not one of cohort's (ddp, zero1, zero2, zero3)"));
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
    // The masters are double for double parameters, float for every narrower one.
    if (const std::string_view masters = m.parameter_dtype == "double" ? "double" : "float"; m.dtype != masters)
      refuse_index(detail::text("dtype '", m.dtype, "' is not the masters' dtype of parameter_dtype '",
                                m.parameter_dtype, "' (", masters, ")"));
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
    if (!is_checkpoint_tensor_set(m.tensors)) {
      std::string named;
      for (const auto& t : m.tensors) named += detail::text((named.empty() ? "" : ", "), t);
      refuse_index(detail::text("tensors [", named,
                                "] are not a set cohort writes (parameters, then adam.exp_avg and adam.exp_avg_sq, "
                                "or sgd.momentum, or nothing)"));
    }
    in.comma();
    in.key("loss_scaler");
    if (!in.null()) {
      loss_scaler::saved_state scaler{};
      in.open('{');
      in.key("scale");
      scaler.scale = in.number();
      if (!(scaler.scale > 0) || !is_finite(scaler.scale))
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

COHORT_COLD_BODY checkpoint_manifest read_checkpoint_manifest(const std::string& checkpoint, int rank,
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
  if (parse_step_name(file_name(checkpoint), named) && named != m.step)
    throw checkpoint_damaged_error(rank, operation,
                                   detail::text(path, " is the index of step ", std::to_string(m.step),
                                                ", in a directory named ", checkpoint_step_name(named)),
                                   "a checkpoint directory keeps the name it was committed under");
  return m;
}

}  // namespace detail

}  // namespace cohort::inline v0
