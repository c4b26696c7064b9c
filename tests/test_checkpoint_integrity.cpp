// Checkpoints tried from outside, as a hostile or unlucky user would (cohort/parallel/
// checkpoint.hpp): every single bit of a small checkpoint's index and shards flipped, each
// refused naming the file; forged indexes whose checksum was recomputed,
// refused by their checks, in bounded memory (peak RSS measured); foreign files and folders
// in the directory untouched through 20 saves with pruning; a second job on the directory
// refused at once; a kill at every step of a commit and of pruning; FIFOs and symlinks; the
// cause of a failure on every rank, with ranks as threads and as processes; resume falling
// back past a damaged checkpoint; shapes in the export, loaded by PyTorch with strict=True.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/parallel/checkpoint.hpp>
#include <cohort/rendezvous/file_store.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_fixtures.hpp"

namespace {

namespace fs = std::filesystem;
using cohort::region;
using cohort::strategy;
using cohort_test::checkpoint_scratch;
using cohort_test::flip_bit;
using cohort_test::load_errors;
using state_type = cohort::training_state<cohort::gloo, double>;

// A matrix with its shape, then two layers of a stacked weight (each 3 x 4) and bias.
std::vector<region> small_regions() {
  std::vector<region> regions{{"embedding", 0, 24, 0, true, 1.0, {6, 4}}};
  const auto stacked = cohort::stacked_regions({{"w", 12, true, {3, 4}}, {"b", 3, false}}, 2, 1, 24);
  regions.insert(regions.end(), stacked.begin(), stacked.end());
  return regions;
}

std::vector<double> parameters_for(std::size_t n, double step) {
  std::vector<double> values(n);
  for (std::size_t i = 0; i < n; ++i) values[i] = std::sin(0.3 * static_cast<double>(i) + step);
  return values;
}

// Saves the state of `regions` (parameters that depend on the step, a loss scaler, metadata)
// at `world` ranks under zero2 as DIR/step-<step>, for each step in `steps`.
void save_steps(const fs::path& dir, const std::vector<std::uint64_t>& steps, int world = 2,
                const std::vector<region>& regions = small_regions(), std::size_t keep_last = 0,
                std::map<std::string, std::string> metadata = {{"next_step", "1"}, {"seed", "1234"}}) {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    cohort::loss_scaler scaler({.initial_scale = 512});
    state_type state(pg, regions, {.strategy = strategy::zero2, .scaler = &scaler});
    const std::size_t n = regions.back().offset + regions.back().count;
    for (const auto step : steps) {
      state.load_parameters(parameters_for(n, static_cast<double>(step)));
      cohort::save_checkpoint(state, dir.string(), step,
                              {.metadata = metadata, .keep_last = keep_last, .block_bytes = 64});
    }
  });
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_file(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// The error `fn` throws, as text; empty when it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& failure) {
    return failure.what();
  }
  return {};
}

// Runs `fn` in a child process that must end within `limit`: what it wrote to `out` (its
// error text), or "TIMED OUT" if it had to be killed (a reader that blocked).
std::string in_child(const std::function<std::string()>& fn, std::chrono::seconds limit = std::chrono::seconds(20)) {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    std::string text;
    try {
      text = fn();
    } catch (const std::exception& failure) {
      text = std::string("child threw: ") + failure.what();
    }
    (void)!::write(pipe_fds[1], text.data(), text.size());
    std::_Exit(0);
  }
  ::close(pipe_fds[1]);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      ::close(pipe_fds[0]);
      return "TIMED OUT";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string text;
  char buffer[4096];
  for (ssize_t got; (got = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;)
    text.append(buffer, static_cast<std::size_t>(got));
  ::close(pipe_fds[0]);
  return text;
}

// The index's text with its last line (the checksum of the rest) made true again: a forged
// index, as someone who knows the format would make one.
std::string reseal(std::string text) {
  const auto last = text.rfind(",\n \"index_checksum\"");
  REQUIRE(last != std::string::npos);
  text.resize(last);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(cohort::detail::checkpoint_checksum(text.data(), text.size())));
  return text + ",\n \"index_checksum\": \"" + hex + "\"\n}\n";
}

}  // namespace

TEST_CASE("every single-bit change of a small checkpoint's index and shards is refused, naming the file",
          "[checkpoint][integrity]") {
  const auto dir = checkpoint_scratch("sweep");
  save_steps(dir, {7});
  const auto checkpoint = dir / "step-7";
  const auto bytes_in_checkpoint = cohort::verify_checkpoint(checkpoint.string());
  // In process, file by file: flip one bit, verify (which reads the index, then every byte of
  // every file), flip it back.
  struct sweep {
    std::size_t flips = 0, silent = 0, unnamed = 0;
    std::string first_unnamed;
  };
  const auto run = [&](const std::string& name, std::uint64_t stride) {
    sweep result;
    const auto file = checkpoint / name;
    const auto size = fs::file_size(file);
    const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
    for (std::uint64_t at = 0; at < size; at += stride)
      for (int bit = 0; bit < 8; ++bit) {
        unsigned char byte = 0;
        REQUIRE(::pread(fd, &byte, 1, static_cast<off_t>(at)) == 1);
        const unsigned char flipped = static_cast<unsigned char>(byte ^ (1u << bit));
        REQUIRE(::pwrite(fd, &flipped, 1, static_cast<off_t>(at)) == 1);
        ++result.flips;
        try {
          (void)cohort::verify_checkpoint(checkpoint.string());
          ++result.silent;
        } catch (const cohort::checkpoint_damaged_error& failure) {
          if (std::string(failure.what()).find((checkpoint / name).string()) == std::string::npos) {
            if (result.unnamed++ == 0) result.first_unnamed = failure.what();
          }
        }
        REQUIRE(::pwrite(fd, &byte, 1, static_cast<off_t>(at)) == 1);
      }
    ::close(fd);
    return result;
  };
  const auto started = std::chrono::steady_clock::now();
  const auto index = run("manifest.json", 1);  // every bit
  INFO(index.first_unnamed);
  CHECK(index.flips == 8 * fs::file_size(checkpoint / "manifest.json"));
  CHECK(index.silent == 0);
  CHECK(index.unnamed == 0);
  std::size_t shard_flips = 0;
  for (const auto* name : {"rank-00000.bin", "rank-00001.bin"}) {
    const auto shard = run(name, 1);  // every bit here too: the checkpoint is small
    INFO(name << ": " << shard.first_unnamed);
    CHECK(shard.silent == 0);
    CHECK(shard.unnamed == 0);
    shard_flips += shard.flips;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf(
      "single-bit sweep: %zu flips of the index, %zu of the shards (%llu bytes), every bit: 0 accepted, "
      "in %.2f s\n",
      index.flips, shard_flips, static_cast<unsigned long long>(bytes_in_checkpoint), seconds);
  // The checkpoint is intact again, and loads; a sample of index flips through a load at
  // another world: every rank refuses, naming the index.
  CHECK(cohort::verify_checkpoint(checkpoint.string()) == bytes_in_checkpoint);
  const auto size = fs::file_size(checkpoint / "manifest.json");
  for (std::uint64_t at = 0; at < size; at += size / 5) {
    flip_bit(checkpoint / "manifest.json", at, static_cast<int>(at % 8));
    for (const auto& text : load_errors(checkpoint, 3, small_regions())) {
      INFO("byte " << at << ": " << text);
      CHECK(text.find((checkpoint / "manifest.json").string()) != std::string::npos);
    }
    flip_bit(checkpoint / "manifest.json", at, static_cast<int>(at % 8));
  }
  CHECK(load_errors(checkpoint, 3, small_regions()) == std::vector<std::string>(3));
  fs::remove_all(dir);
}

TEST_CASE("a forged index (its checksum recomputed) is refused by its checks, naming the field and the file",
          "[checkpoint][integrity]") {
  const auto dir = checkpoint_scratch("forged");
  save_steps(dir, {3});
  const auto checkpoint = dir / "step-3";
  const auto index = checkpoint / "manifest.json";
  const std::string original = read_file(index);
  const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1);
  using cohort::detail::checkpoint_manifest;
  struct forgery {
    std::string what, expected;
    std::function<void(checkpoint_manifest&)> edit;
  };
  const std::vector<forgery> forgeries = {
      {"a region's count lowered", "'w.0'",  // region 1: the stacked w of block 0
       [](checkpoint_manifest& m) { m.regions[1].count -= 1, m.regions[1].shape = {m.regions[1].count}; }},
      {"a segment moved by one element", "region '",
       [](checkpoint_manifest& m) {
         auto& s = m.files[1].segments.front();
         s.first = s.first > 0 ? s.first - 1 : s.first + 1;
       }},
      {"a segment shortened (a gap)", "", [](checkpoint_manifest& m) { m.files[0].segments.back().count -= 1; }},
      {"a file longer than its segments", "its segments hold", [](checkpoint_manifest& m) { m.files[0].bytes += 8; }},
      {"world size 3, two files", "2 files for its world size 3", [](checkpoint_manifest& m) { m.world_size = 3; }},
      {"a file named out of the directory", "is named '../rank-00000.bin'",
       [](checkpoint_manifest& m) { m.files[0].name = "../rank-00000.bin"; }},
      {"ranks swapped", "not rank-00000.bin", [](checkpoint_manifest& m) { std::swap(m.files[0], m.files[1]); }},
      {"block size 0", "block_bytes 0 is outside", [](checkpoint_manifest& m) { m.block_bytes = 0; }},
      {"block size 2^40", "block_bytes 1099511627776 is outside",
       [](checkpoint_manifest& m) { m.block_bytes = std::uint64_t{1} << 40; }},
      {"a step of 2^63", "step 9223372036854775808 is outside",
       [](checkpoint_manifest& m) { m.step = std::uint64_t{1} << 63; }},
      {"optimizer steps of 2^60", "optimizer_steps",
       [](checkpoint_manifest& m) { m.optimizer_steps = std::uint64_t{1} << 60; }},
      {"an unknown dtype", "dtype 'int8'", [](checkpoint_manifest& m) { m.dtype = "int8"; }},
      {"a shape of another size", "its shape holds 25",
       [](checkpoint_manifest& m) {
         m.regions[0].shape = {5, 5};
       }},
      {"the Adam moments named twice", "named twice", [](checkpoint_manifest& m) { m.tensors[2] = m.tensors[1]; }},
      {"the moments first", "first tensor is not 'parameters'",
       [](checkpoint_manifest& m) { std::swap(m.tensors[0], m.tensors[1]); }},
      {"a region named twice", "is named twice", [](checkpoint_manifest& m) { m.regions[2].name = m.regions[1].name; }},
      {"a block checksum dropped", "block checksums for its",
       [](checkpoint_manifest& m) {
         m.files[0].blocks.pop_back();
         m.files[0].checksum = cohort::detail::checkpoint_file_checksum(m.files[0].blocks, m.files[0].bytes);
       }},
      {"a block checksum changed", "do not add up", [](checkpoint_manifest& m) { m.files[1].blocks[0] ^= 1; }},
      {"a region 2^50 elements long", "",
       [](checkpoint_manifest& m) {
         m.regions[0].count = std::uint64_t{1} << 50, m.regions[0].shape = {m.regions[0].count};
       }},
      {"a loss scale of 0", "loss scale 0 is not positive", [](checkpoint_manifest& m) { m.scaler->scale = 0; }},
      {"a strategy cohort has not", "strategy 'zero9' is not one of cohort's",
       [](checkpoint_manifest& m) { m.strategy = "zero9"; }},
      {"Adam with one moment", "tensors [parameters, adam.exp_avg] are not a set cohort writes",
       [](checkpoint_manifest& m) { m.tensors.pop_back(); }},
      {"masters narrower than the parameters", "dtype 'float' is not the masters' dtype of parameter_dtype 'double'",
       [](checkpoint_manifest& m) { m.dtype = "float"; }},
      {"a run that is not one", "run 'run-1' is not 16 lowercase hex digits",
       [](checkpoint_manifest& m) { m.run = "run-1"; }},
      {"a job id with a line break", "job 'a\nb' (3 bytes) is not a launcher's job id",
       [](checkpoint_manifest& m) { m.job = "a\nb"; }},
  };
  for (const auto& f : forgeries) {
    auto forged = manifest;
    f.edit(forged);
    write_file(index, cohort::detail::checkpoint_manifest_json(forged));
    const std::string text = error_of([&] { cohort::verify_checkpoint(checkpoint.string()); });
    INFO(f.what << ": " << text);
    CHECK(text.find(index.string()) != std::string::npos);
    CHECK(text.find(f.expected) != std::string::npos);
  }
  // Edits of the text itself, resealed: a member out of its place, one added, a number spelt
  // another way, the step of another directory.
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"step\": 3,\n \"optimizer_steps\": 0,", "\"optimizer_steps\": 0,\n \"step\": 3,"},
      {"\"world_size\": 2,", "\"world_size\": 2,\n \"extra\": 1,"},
      {"\"world_size\": 2,", "\"world_size\": 02,"},
      {"\"step\": 3,", "\"step\": 4,"},
  };
  for (const auto& [from, to] : edits) {
    std::string text = original;
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    write_file(index, reseal(text));
    const std::string error = error_of([&] { cohort::verify_checkpoint(checkpoint.string()); });
    INFO(to << ": " << error);
    CHECK(error.find(index.string()) != std::string::npos);
  }
  write_file(index, original);
  CHECK(cohort::verify_checkpoint(checkpoint.string()) > 0);
  fs::remove_all(dir);
}

TEST_CASE("a forged index costs bounded memory: at most twice the checkpoint plus 64 MiB of peak RSS",
          "[checkpoint][integrity]") {
  if (cohort_test::sanitized)
    cohort_test::skip("a sanitizer's allocator keeps freed memory and shadows the rest: peak RSS says nothing here");
  const auto dir = checkpoint_scratch("memory");
  save_steps(dir, {3});
  const auto checkpoint = dir / "step-3";
  const auto index = checkpoint / "manifest.json";
  const std::string original = read_file(index);
  const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1);
  std::uint64_t checkpoint_bytes = 0;
  for (const auto& f : manifest.files) checkpoint_bytes += f.bytes;
  // The peak resident set of a fresh process (this program again, running only the hidden
  // case below) that makes one call on the checkpoint, above that of one that makes none: what
  // the call itself took.
  const auto peak_of = [&](const char* call) {
    const auto result = dir / "peak.txt";
    fs::remove(result);
    std::fflush(nullptr);
    const pid_t child = ::fork();
    if (child == 0) {
      ::setenv("COHORT_TEST_CALL", call, 1);
      ::setenv("COHORT_TEST_CHECKPOINT", checkpoint.c_str(), 1);
      ::setenv("COHORT_TEST_RESULT", result.c_str(), 1);
      (void)!::freopen("/dev/null", "w", stdout);
      ::execl("/proc/self/exe", "test_checkpoint_integrity", "one checkpoint call for the memory test", nullptr);
      std::_Exit(127);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
    std::int64_t kib = 0;
    std::ifstream(result) >> kib;
    REQUIRE(kib > 0);
    return kib * 1024;
  };
  const std::int64_t baseline = peak_of("none");
  const std::int64_t bound = 2 * static_cast<std::int64_t>(checkpoint_bytes) + (std::int64_t{64} << 20);
  const auto measure = [&](const std::string& what) {
    for (const auto* call : {"verify", "consolidate", "inspect"}) {
      const std::int64_t extra = peak_of(call) - baseline;
      std::printf("%s, %s: peak RSS %+.1f MiB (bound %.1f MiB)\n", what.c_str(), call, extra / 1048576.0,
                  bound / 1048576.0);
      CHECK(extra <= bound);
    }
  };
  measure("the index as written");
  // 1 GiB of index (sparse): refused by its size before a byte is read.
  write_file(index, "");
  ::truncate(index.c_str(), off_t{1} << 30);
  measure("a 1 GiB index");
  // 16 MiB, sealed, of tiny metadata keys: refused when what it keeps passes 32 MiB.
  {
    std::string text = original;
    const auto at = text.find("\"metadata\": {") + 13;
    std::string keys;
    for (std::size_t k = 0; keys.size() < (std::size_t{15} << 20); ++k)
      keys += "\n  \"" + std::to_string(k) + "\": \"\",";
    text.insert(at, keys);
    write_file(index, reseal(text));
    CHECK(fs::file_size(index) < (std::size_t{16} << 20));
    CHECK_THAT(error_of([&] { cohort::verify_checkpoint(checkpoint.string()); }), Catch::Contains("MiB of memory"));
    measure("a 15 MiB index of tiny metadata keys");
  }
  // 900,000 segments of one element each, sealed: refused when what it keeps passes 32 MiB.
  {
    auto forged = manifest;
    constexpr std::uint64_t count = 900000;
    forged.regions = {{"r", count, {count}}};
    forged.world_size = 1;
    forged.files.resize(1);
    auto& file = forged.files[0];
    file.segments.clear();
    for (std::uint64_t k = 0; k < count; ++k) file.segments.push_back({0, k, 1});
    file.elements = count;
    file.bytes = forged.tensors.size() * count * forged.element_bytes;
    forged.block_bytes = std::uint64_t{1} << 30;
    file.blocks = {0};
    file.checksum = cohort::detail::checkpoint_file_checksum(file.blocks, file.bytes);
    write_file(index, cohort::detail::checkpoint_manifest_json(forged));
    CHECK(fs::file_size(index) < (std::size_t{16} << 20));
    CHECK_THAT(error_of([&] { cohort::verify_checkpoint(checkpoint.string()); }), Catch::Contains("MiB of memory"));
    measure("a 14 MiB index of 900,000 segments");
  }
  // A region of 2^40 elements, its segment and file claiming as much: refused by the files'
  // real sizes before anything of that size is allocated.
  {
    auto forged = manifest;
    forged.regions.resize(1);
    forged.regions[0].count = std::uint64_t{1} << 40;
    forged.regions[0].shape = {forged.regions[0].count};
    forged.files.resize(1);
    forged.world_size = 1;
    forged.files[0].segments = {{0, 0, forged.regions[0].count}};
    forged.files[0].elements = forged.regions[0].count;
    forged.files[0].bytes = forged.tensors.size() * forged.regions[0].count * forged.element_bytes;
    forged.block_bytes = std::uint64_t{1} << 30;
    forged.files[0].blocks.assign(forged.files[0].bytes >> 30, 0);
    forged.files[0].checksum = cohort::detail::checkpoint_file_checksum(forged.files[0].blocks, forged.files[0].bytes);
    write_file(index, cohort::detail::checkpoint_manifest_json(forged));
    CHECK_THAT(
        error_of([&] { cohort::consolidate_checkpoint(checkpoint.string(), (dir / "out.safetensors").string()); }),
        Catch::Contains("bytes, its index says"));
    measure("a region of 2^40 elements");
  }
  fs::remove_all(dir);
}

// What the memory test runs in a fresh process: one call, named by COHORT_TEST_CALL, on the
// checkpoint COHORT_TEST_CHECKPOINT names. Hidden: it runs only when named.
TEST_CASE("one checkpoint call for the memory test", "[.][checkpoint]") {
  const char* call = std::getenv("COHORT_TEST_CALL");
  const char* checkpoint = std::getenv("COHORT_TEST_CHECKPOINT");
  if (!call || !checkpoint) return;
  const std::string which = call;
  try {
    if (which == "verify") (void)cohort::verify_checkpoint(checkpoint);
    if (which == "consolidate")
      cohort::consolidate_checkpoint(checkpoint, (fs::path(checkpoint).parent_path() / "out.safetensors").string());
    if (which == "inspect") (void)cohort::detail::read_checkpoint_manifest(checkpoint, -1);
  } catch (const cohort::error&) {
    // refused: what it cost is the question
  }
  // The peak resident set of this process image (VmHWM: since the exec, unlike getrusage's,
  // which counts the forked parent's pages too).
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) std::ofstream(std::getenv("COHORT_TEST_RESULT")) << std::stoll(line.substr(6));
}

TEST_CASE("an index of 80,000 metadata keys loads in one pass, every key kept", "[checkpoint][integrity]") {
  const auto dir = checkpoint_scratch("keys");
  std::map<std::string, std::string> metadata;
  for (int k = 0; k < 80000; ++k) metadata["key-" + std::to_string(k)] = std::to_string(k * 7);
  save_steps(dir, {1}, 1, small_regions(), 0, metadata);  // one rank: no peer waits on its commit
  const auto started = std::chrono::steady_clock::now();
  const auto manifest = cohort::detail::read_checkpoint_manifest((dir / "step-1").string(), -1);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("an index of 80,000 metadata keys (%.1f MiB) read in %.3f s\n",
              static_cast<double>(fs::file_size(dir / "step-1" / "manifest.json")) / 1048576.0, seconds);
  CHECK(manifest.metadata == metadata);
  fs::remove_all(dir);
}

TEST_CASE("foreign files and folders, tmp-* and step-* lookalikes, symlinks and FIFOs survive 20 saves with pruning",
          "[checkpoint][integrity][directory]") {
  const auto root = checkpoint_scratch("foreign");
  const auto dir = root / "ckpt", outside = root / "outside";
  fs::create_directories(dir / "tmp-datasets" / "sub");
  fs::create_directories(outside);
  write_file(outside / "weights.bin", "outside the directory");
  write_file(dir / "tmp-datasets" / "a.bin", std::string(3000, 'a'));
  write_file(dir / "tmp-datasets" / "sub" / "b.txt", "b");
  write_file(dir / "tmp-notes.txt", "notes");
  write_file(dir / ".hidden", "hidden");
  for (const auto* name : {"step-007", "step-abc", "step-99999999999999999999", "step-1", "step-5.bak"}) {
    fs::create_directories(dir / name);
    write_file(dir / name / "manifest.json", std::string("not cohort's: ") + name);
  }
  fs::remove(dir / "step-1" / "manifest.json");  // a step number, no index
  write_file(dir / "step-1" / "rank-00000.bin", "data");
  write_file(dir / "step-2", "a file named like a step");
  fs::create_directory_symlink(outside, dir / "step-3");
  fs::create_symlink(outside / "weights.bin", dir / "link-out");
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0644) == 0);
  REQUIRE(::mkfifo((dir / "step-4").c_str(), 0644) == 0);
  // Every entry below DIR (symlinks not followed, cohort's own left out) and below the place a
  // symlink points to: kind, and the bytes of a file or the target of a link.
  const auto snapshot = [&] {
    std::map<std::string, std::string> entries;
    for (const auto& base : {dir, outside})
      for (auto it = fs::recursive_directory_iterator(base); it != fs::recursive_directory_iterator(); ++it) {
        const auto relative = base.filename().string() + "/" + fs::relative(it->path(), base).string();
        const auto name = it->path().filename().string();
        if (it->path().parent_path() == dir &&
            (name == ".cohort" || (name.rfind("step-1", 0) == 0 && name.size() == 8))) {
          if (it->is_directory() && !it->is_symlink()) it.disable_recursion_pending();
          continue;  // cohort's checkpoints (step-100 .. step-119) and its own folder
        }
        const auto status = it->symlink_status();
        std::string value = std::to_string(static_cast<int>(status.type()));
        if (fs::is_symlink(status))
          value += " -> " + fs::read_symlink(it->path()).string();
        else if (fs::is_regular_file(status))
          value += ": " + read_file(it->path());
        entries[relative] = value;
      }
    return entries;
  };
  const auto before = snapshot();
  REQUIRE(before.size() >= 17);
  std::vector<std::uint64_t> steps;
  for (std::uint64_t s = 100; s < 120; ++s) steps.push_back(s);
  save_steps(dir, steps, 2, small_regions(), 3);
  CHECK(snapshot() == before);
  const auto listing = cohort::detail::list_checkpoints(dir.string());
  REQUIRE(listing.committed.size() == 3);
  CHECK(listing.committed.front().first == 117);
  CHECK(listing.ignored.size() == 8);  // every step-* lookalike, each with why
  // A resume loads the newest (warning about the lookalikes); a save at a step whose name a
  // foreign entry has is refused naming it, which stays as it was.
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(2);
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    state_type state(pg, small_regions(), {.strategy = strategy::zero3});
    const auto resumed = cohort::resume_checkpoint(state, dir.string());
    RANK_CHECK(resumed && resumed->step == 119);
    errors[static_cast<std::size_t>(rank)] = error_of([&] { cohort::save_checkpoint(state, dir.string(), 2); });
  });
  for (const auto& text : errors) {
    INFO(text);
    CHECK(text.find((dir / "step-2").string() + " exists and is not a directory") != std::string::npos);
  }
  CHECK(snapshot() == before);
  std::printf("20 saves, keep_last 3: %zu foreign entries unchanged, %zu lookalikes ignored\n", before.size(),
              listing.ignored.size());
  fs::remove_all(root);
}

TEST_CASE("a second job on the directory is refused in under a second, naming the first, and the lock goes with it",
          "[checkpoint][integrity][directory]") {
  const auto dir = checkpoint_scratch("two-jobs");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  std::fflush(nullptr);
  const pid_t first = ::fork();
  REQUIRE(first >= 0);
  if (first == 0) {  // the first job: resumes (nothing yet), saves, then trains on
    try {
      ::close(ready[0]);
      save_steps(dir, {1});
      (void)!::write(ready[1], "x", 1);
      std::this_thread::sleep_for(std::chrono::seconds(60));
    } catch (...) {}
    std::_Exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  ::close(ready[0]);
  std::vector<std::string> errors(2);
  std::vector<double> seconds(2);
  const auto second_job = [&] {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      state_type state(pg, small_regions(), {.strategy = strategy::zero2});
      const auto started = std::chrono::steady_clock::now();
      errors[static_cast<std::size_t>(rank)] = error_of([&] { cohort::resume_checkpoint(state, dir.string()); });
      seconds[static_cast<std::size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    });
  };
  second_job();
  for (int r = 0; r < 2; ++r) {
    const auto& text = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << text);
    CHECK(text.find(dir.string() + " is in use by another job: pid " + std::to_string(first)) != std::string::npos);
    CHECK(text.find("on host ") != std::string::npos);
    CHECK(seconds[static_cast<std::size_t>(r)] < 1.0);
  }
  std::printf("second job refused in %.3f s: %s\n", seconds[0], errors[0].c_str());
  // The first job ends (killed): its lock goes with its process, and the directory is free.
  ::kill(first, SIGKILL);
  ::waitpid(first, nullptr, 0);
  second_job();
  CHECK(errors == std::vector<std::string>(2));
  fs::remove_all(dir);
}

TEST_CASE("a lock holder killed while writing who it is leaves holder.<pid>: the next resume and save remove it",
          "[checkpoint][integrity][directory]") {
  const auto root = checkpoint_scratch("stale-holder");
  const auto resumed = root / "resumed", saved = root / "saved";
  // A process that dies (SIGKILL) after writing its temporary into `dir`'s own folder, before
  // renaming it: its pid is then a dead one's, and the lock it held went with it. Both are
  // made before this process starts any rank thread (a fork then copies none).
  const auto killed_holder = [&](const fs::path& dir) {
    std::fflush(nullptr);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      fs::create_directories(dir / ".cohort");
      const auto pid = std::to_string(::getpid());
      const auto text = "host here\npid " + pid + "\nstart 1\nprogram killed\nsince then\n";
      write_file(dir / ".cohort" / ("holder." + pid), text);
      write_file(dir / ".cohort" / "holder", text);  // the holder file names the dead process too
      ::raise(SIGKILL);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE(WIFSIGNALED(status));
    const auto left = dir / ".cohort" / ("holder." + std::to_string(child));
    REQUIRE(fs::exists(left));
    return left;
  };
  const auto left_by_resumed = killed_holder(resumed), left_by_saved = killed_holder(saved);
  const auto me = "pid " + std::to_string(::getpid()) + "\n";
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    state_type state(pg, small_regions(), {.strategy = strategy::zero2});
    RANK_CHECK(!cohort::resume_checkpoint(state, resumed.string()).has_value());
  });
  CHECK_FALSE(fs::exists(left_by_resumed));
  CHECK(read_file(resumed / ".cohort" / "holder").find(me) != std::string::npos);
  save_steps(saved, {1});
  CHECK_FALSE(fs::exists(left_by_saved));
  CHECK(read_file(saved / ".cohort" / "holder").find(me) != std::string::npos);
  CHECK(fs::exists(saved / "step-1" / "manifest.json"));
  fs::remove_all(root);
}

TEST_CASE(
    "a kill at every step of a commit and of pruning leaves no loadable half-checkpoint, and no leftover after "
    "the next save",
    "[checkpoint][integrity][directory]") {
  // One rank, a small state: step 1 and 2 saved, then a save of step `last` that dies at
  // commit step k (pruning step 1 with keep_last 2, or replacing step 2), for every k until
  // the save completes.
  const auto regions = small_regions();
  const std::size_t n = regions.back().offset + regions.back().count;
  const auto job = [&](const fs::path& dir, std::uint64_t last, int die_at) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(1, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 1);
      state_type state(pg, regions, {.strategy = strategy::zero2});
      cohort::async_checkpointer saver(state);
      for (const std::uint64_t step : {std::uint64_t{1}, std::uint64_t{2}, last}) {
        if (step == last && die_at >= 0)
          cohort::detail::checkpoint_fault_injection::arm(saver, {.rank = 0, .die_at_commit_step = die_at});
        state.load_parameters(parameters_for(n, static_cast<double>(step)));
        saver.save(dir.string(), step, {.keep_last = 2, .block_bytes = 64});
        saver.wait();
      }
    });
  };
  for (const std::uint64_t last : {std::uint64_t{3}, std::uint64_t{2}}) {
    int points = 0;
    for (int k = 0;; ++k) {
      const auto dir = checkpoint_scratch("prune-kill");
      std::fflush(nullptr);
      const pid_t child = ::fork();
      REQUIRE(child >= 0);
      if (child == 0) {
        try {
          job(dir, last, k);
        } catch (...) {
          std::_Exit(1);
        }
        std::_Exit(0);
      }
      int status = 0;
      REQUIRE(::waitpid(child, &status, 0) == child);
      const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      INFO("saving step " << last << ", killed at commit step " << k);
      CHECK((killed || (WIFEXITED(status) && WEXITSTATUS(status) == 0)));
      // Whatever a resume could take for a checkpoint verifies, and the newest is 2 or 3.
      const auto after_kill = cohort::detail::list_checkpoints(dir.string());
      REQUIRE_FALSE(after_kill.committed.empty());
      for (const auto& [step, path] : after_kill.committed) CHECK(cohort::verify_checkpoint(path) > 0);
      CHECK(after_kill.ignored.empty());  // no step-* without its index, none half-deleted
      // Pruning: step 2 or 3 is the newest. Replacing step 2: where the file system cannot swap
      // two names in one step (renameat2 RENAME_EXCHANGE), the old step 2 is moved away
      // before the new one is renamed in, and step 1 may be the newest.
      CHECK(after_kill.committed.back().first >= (last == 3 ? 2 : 1));
      // The next save (another process: this one is the next job) leaves nothing behind.
      job(dir, 4, -1);
      const auto next = cohort::detail::list_checkpoints(dir.string());
      CHECK(next.committed.size() == 2);
      for (const auto& [step, path] : next.committed) CHECK(cohort::verify_checkpoint(path) > 0);
      std::set<std::string> own;
      for (const auto& entry : fs::directory_iterator(dir / ".cohort")) own.insert(entry.path().filename().string());
      CHECK(own == std::set<std::string>{"holder", "lock", "run"});
      fs::remove_all(dir);
      if (!killed) break;
      ++points;
    }
    std::printf("saving step %llu (%s): killed at each of its %d commit steps, none left a loadable half-checkpoint\n",
                static_cast<unsigned long long>(last), last == 3 ? "pruning step 1" : "replacing step 2", points);
    CHECK(points >= (last == 3 ? 9 : 5));
  }
}

TEST_CASE("FIFOs and symlinks in a checkpoint are refused at once, naming them", "[checkpoint][integrity][directory]") {
  const auto dir = checkpoint_scratch("special");
  save_steps(dir, {5});
  const auto checkpoint = dir / "step-5";
  const auto shard = checkpoint / "rank-00001.bin", index = checkpoint / "manifest.json";
  const auto copy = dir / "copy.bin";
  fs::copy_file(shard, copy);
  const auto verify_error = [&] {
    return in_child([&] { return error_of([&] { cohort::verify_checkpoint(checkpoint.string()); }); });
  };
  // A FIFO in place of a shard: verify, and a load at 2 and 3 ranks, fail at once naming it.
  fs::remove(shard);
  REQUIRE(::mkfifo(shard.c_str(), 0644) == 0);
  CHECK_THAT(verify_error(), Catch::Contains(shard.string() + ": is a FIFO, not a regular file"));
  const auto load = in_child([&] {
    std::string all;
    for (const int world : {2, 3})
      for (const auto& text : load_errors(checkpoint, world, small_regions())) all += text + "\n";
    return all;
  });
  CHECK(load != "TIMED OUT");
  CHECK_THAT(load, Catch::Contains(shard.string() + ": is a FIFO"));
  // A symlink to a copy of the shard outside the checkpoint: never followed.
  fs::remove(shard);
  fs::create_symlink(copy, shard);
  CHECK_THAT(verify_error(), Catch::Contains(shard.string() + ": is a symbolic link, not a regular file"));
  fs::remove(shard);
  fs::copy_file(copy, shard);
  CHECK(cohort::verify_checkpoint(checkpoint.string()) > 0);
  // A FIFO in place of the index.
  fs::rename(index, dir / "index.json");
  REQUIRE(::mkfifo(index.c_str(), 0644) == 0);
  CHECK_THAT(verify_error(), Catch::Contains(index.string() + ": is a FIFO, not a regular file"));
  // In cohort's own directory, a checkpoint whose index cannot be read is a damaged one (that
  // verify and resume refuse, naming it), never a stranger's to skip.
  CHECK(cohort::newest_checkpoint(dir.string()) == checkpoint.string());
  fs::remove_all(dir);
}

TEST_CASE("a rank's refusal reaches every rank with its cause, with ranks as threads and as processes",
          "[checkpoint][integrity][errors]") {
  const auto dir = checkpoint_scratch("cause");
  // Saved in a child, so that this process starts the ranks below with no Gloo of its own.
  CHECK(in_child([&] {
          save_steps(dir, {6});
          return std::string();
        }) == "");
  const auto checkpoint = dir / "step-6";
  // Rank 1's file gone: at 3 ranks, the ranks that read from it (1 and 2) refuse; rank 0,
  // which reads only rank 0's file, learns why from them.
  const auto shard = checkpoint / "rank-00001.bin";
  fs::rename(shard, dir / "aside.bin");
  const auto check = [&](const std::vector<std::string>& errors, const char* mode) {
    for (std::size_t r = 0; r < errors.size(); ++r) {
      INFO(mode << ", rank " << r << ": " << errors[r]);
      CHECK(errors[r].find(shard.string() + ": cannot stat it: " + std::strerror(ENOENT)) != std::string::npos);
    }
    INFO(mode << ", rank 0: " << errors[0]);
    CHECK(errors[0].find("ranks 1, 2 failed; rank 1: " + shard.string()) != std::string::npos);
  };
  // Processes: three, meeting in a file store; each writes its error where the test reads it.
  const auto store_dir = dir / "store";
  std::fflush(nullptr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < 3; ++rank) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      std::string text;
      try {
        auto store = std::make_shared<cohort::file_store>(store_dir.string(), "cause", rank);
        cohort::gloo::options options;
        options.timeout = std::chrono::seconds(10);
        cohort::process_group<cohort::gloo> pg(store, cohort::launch_env::explicit_ranks(rank, 3), options);
        state_type state(pg, small_regions(), {.strategy = strategy::zero2});
        text = error_of([&] { cohort::load_checkpoint(state, checkpoint.string()); });
      } catch (const std::exception& failure) {
        text = std::string("setup failed: ") + failure.what();
      }
      write_file(dir / ("error-" + std::to_string(rank) + ".txt"), text);
      std::_Exit(0);
    }
    children.push_back(child);
  }
  for (const pid_t child : children) ::waitpid(child, nullptr, 0);
  std::vector<std::string> errors;
  for (int rank = 0; rank < 3; ++rank) errors.push_back(read_file(dir / ("error-" + std::to_string(rank) + ".txt")));
  check(errors, "processes");
  check(load_errors(checkpoint, 3, small_regions()), "threads");
  fs::remove_all(dir);
}

TEST_CASE("a failed write of the index names the file and the errno on every rank", "[checkpoint][integrity][errors]") {
  // A file size limit that the ranks' files fit under and the index (8 KiB of metadata) does
  // not: the index's write fails with EFBIG, a real failure of a real write.
  const auto dir = checkpoint_scratch("index-write");
  const auto text = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{6000, 6000};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::string all;
    auto store = std::make_shared<cohort::memory_store>();
    std::vector<std::string> errors(2);
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      state_type state(pg, small_regions(), {.strategy = strategy::zero2});
      errors[static_cast<std::size_t>(rank)] = error_of([&] {
        cohort::save_checkpoint(state, dir.string(), 1, {.metadata = {{"big", std::string(8192, 'x')}}});
      });
    });
    for (const auto& e : errors) all += e + "\n";
    return all;
  });
  INFO(text);
  CHECK(text.find("manifest.json: " + std::string(std::strerror(EFBIG)) + " (errno " + std::to_string(EFBIG) + ")") !=
        std::string::npos);
  CHECK(text.find("rank 0 failed: writing") != std::string::npos);  // rank 1's error carries rank 0's cause
  CHECK_FALSE(cohort::newest_checkpoint(dir.string()).has_value());
  fs::remove_all(dir);
}

TEST_CASE("resume falls back past a damaged checkpoint naming it, refuses when asked to, and never past another model",
          "[checkpoint][integrity][resume]") {
  const auto dir = checkpoint_scratch("fallback");
  save_steps(dir, {4, 9});
  flip_bit(dir / "step-9" / "rank-00001.bin", 10, 2);
  const auto regions = small_regions();
  const std::size_t n = regions.back().offset + regions.back().count;
  const auto resume = [&](const cohort::resume_options& options, const std::vector<region>& model) {
    std::vector<std::string> errors(2);
    std::vector<cohort::checkpoint_info> infos(2);
    std::vector<std::vector<double>> parameters(2);
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      state_type state(pg, model, {.strategy = strategy::zero1});
      errors[static_cast<std::size_t>(rank)] = error_of([&] {
        if (auto info = cohort::resume_checkpoint(state, dir.string(), options))
          infos[static_cast<std::size_t>(rank)] = *info;
      });
      parameters[static_cast<std::size_t>(rank)] = state.gather_parameters();
    });
    return std::tuple{errors, infos, parameters};
  };
  {
    const auto [errors, infos, parameters] = resume({}, regions);
    CHECK(errors == std::vector<std::string>(2));
    CHECK(infos[1].step == 4);
    CHECK(parameters[1] == parameters_for(n, 4.0));
    REQUIRE(infos[0].skipped.size() == 1);
    CHECK(infos[0].skipped[0].find((dir / "step-9").string() + ": ") == 0);
    CHECK(infos[0].skipped[0].find("rank-00001.bin (written by rank 1): block 0") != std::string::npos);
  }
  {
    const auto [errors, infos, parameters] = resume({.fall_back = false}, regions);
    for (const auto& text : errors) {
      INFO(text);
      CHECK(text.find((dir / "step-9" / "rank-00001.bin").string()) != std::string::npos);
    }
  }
  {
    auto other = regions;
    other[0].count = 20, other[0].shape = {};
    for (std::size_t r = 1; r < other.size(); ++r) other[r].offset -= 4;
    const auto [errors, infos, parameters] = resume({}, other);
    for (const auto& text : errors) {
      INFO(text);
      CHECK(text.find("region 'embedding'") != std::string::npos);  // the newest's mismatch, not a fall back
      CHECK(text.find("step-9/manifest.json") != std::string::npos);
    }
  }
  flip_bit(dir / "step-4" / "manifest.json", 40, 0);
  {
    const auto [errors, infos, parameters] = resume({}, regions);
    for (const auto& text : errors) {
      INFO(text);
      CHECK(text.find("no intact checkpoint in " + dir.string()) != std::string::npos);
      CHECK(text.find("step-9: ") != std::string::npos);
      CHECK(text.find("step-4: ") != std::string::npos);
    }
  }
  fs::remove_all(dir);
}

// The first bytes of `file` overwritten with `bytes` (what a torn sector or a stray write does).
void overwrite_head(const fs::path& file, const std::string& bytes) {
  std::fstream out(file, std::ios::binary | std::ios::in | std::ios::out);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

TEST_CASE("damage in an index's first bytes marks the checkpoint damaged, never foreign, in cohort's directory",
          "[checkpoint][integrity][resume]") {
  const auto dir = checkpoint_scratch("damaged-head");
  save_steps(dir, {4, 9});
  overwrite_head(dir / "step-9" / "manifest.json", "<<garbage>>");
  // Listed as cohort's (its directory carries cohort's contract), and refused by its reader.
  const auto listing = cohort::detail::list_checkpoints(dir.string());
  CHECK(listing.ignored.empty());
  REQUIRE(listing.committed.size() == 2);
  CHECK(cohort::newest_checkpoint(dir.string()) == (dir / "step-9").string());
  CHECK_THROWS_AS(cohort::verify_checkpoint((dir / "step-9").string()), cohort::checkpoint_damaged_error);
  CHECK_THROWS_WITH(cohort::verify_checkpoint((dir / "step-9").string()),
                    Catch::Contains((dir / "step-9" / "manifest.json").string()));
  if (const auto verify = cohort_test::run_ckpt_tool("verify " + dir.string())) {
    INFO(verify->first);
    CHECK(verify->second == 1);
    CHECK(verify->first.find((dir / "step-9").string() + " is damaged") != std::string::npos);
    CHECK(verify->first.find("older checkpoints, which a resume falls back to: " + (dir / "step-4").string()) !=
          std::string::npos);
    const auto consolidate =
        cohort_test::run_ckpt_tool("consolidate " + dir.string() + " " + (dir / "out.safetensors").string());
    INFO(consolidate->first);
    CHECK(consolidate->second == 1);
    CHECK(consolidate->first.find((dir / "step-9").string() + " is damaged") != std::string::npos);
    CHECK_FALSE(fs::exists(dir / "out.safetensors"));
  }
  // Resume falls back to step 4 and names step 9 as skipped; the next save at step 9 replaces it.
  const auto regions = small_regions();
  const std::size_t n = regions.back().offset + regions.back().count;
  std::vector<cohort::checkpoint_info> infos(2);
  std::vector<std::string> errors(2);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    state_type state(pg, regions, {.strategy = strategy::zero3});
    errors[static_cast<std::size_t>(rank)] = error_of([&] {
      infos[static_cast<std::size_t>(rank)] = cohort::resume_checkpoint(state, dir.string()).value();
      RANK_CHECK(state.gather_parameters() == parameters_for(n, 4.0));
      state.load_parameters(parameters_for(n, 9.5));
      cohort::save_checkpoint(state, dir.string(), 9);
    });
  });
  CHECK(errors == std::vector<std::string>(2));
  CHECK(infos[0].step == 4);
  REQUIRE(infos[0].skipped.size() == 1);
  CHECK(infos[0].skipped[0].find((dir / "step-9").string() + ": ") == 0);
  CHECK(cohort::verify_checkpoint((dir / "step-9").string()) > 0);
  // The only checkpoint, damaged so: resume refuses on every rank rather than start from step 0.
  const auto alone = checkpoint_scratch("damaged-head-alone");
  save_steps(alone, {3});
  overwrite_head(alone / "step-3" / "manifest.json", "[");
  auto other_store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(other_store, rank, 2);
    state_type state(pg, regions, {.strategy = strategy::zero2});
    errors[static_cast<std::size_t>(rank)] = error_of([&] { (void)cohort::resume_checkpoint(state, alone.string()); });
  });
  for (const auto& text : errors) {
    INFO(text);
    CHECK(text.find("no intact checkpoint in " + alone.string()) != std::string::npos);
    CHECK(text.find((alone / "step-3").string() + ": ") != std::string::npos);
  }
  fs::remove_all(dir);
  fs::remove_all(alone);
}

TEST_CASE("consolidate's errors carry consolidate's hint, and cohort-ckpt names itself once",
          "[checkpoint][integrity][messages]") {
  const auto dir = checkpoint_scratch("messages");
  save_steps(dir, {2});
  const auto text = error_of([&] {
    cohort::consolidate_checkpoint((dir / "step-2").string(), (dir / "no-such-folder" / "out.safetensors").string());
  });
  INFO(text);
  CHECK(text.find("cohort consolidate_checkpoint: cannot create") == 0);
  CHECK(text.find("the checkpoint is only read") != std::string::npos);
  CHECK(text.find("previous checkpoint") == std::string::npos);  // save's words
  if (const auto tool = cohort_test::run_ckpt_tool("verify " + (dir / "empty").string())) {
    INFO(tool->first);
    CHECK(tool->second == 1);
    CHECK(tool->first.find("cohort-ckpt verify: no committed checkpoint in") == 0);
    CHECK(tool->first.find("cohort-ckpt", 1) == std::string::npos);  // its prefix once
    const auto export_error =
        cohort_test::run_ckpt_tool("consolidate " + dir.string() + " " + (dir / "no-such-folder" / "x").string());
    INFO(export_error->first);
    CHECK(export_error->second == 1);
    CHECK(export_error->first.find("cohort-ckpt consolidate: cannot create") == 0);
    CHECK(export_error->first.find("cohort ") == std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint records its run and job: another run's, copied in, is refused at resume (or warned of)",
          "[checkpoint][integrity][resume]") {
  const auto root = checkpoint_scratch("runs");
  const auto ours = root / "ours", theirs = root / "theirs", older = root / "older";
  save_steps(ours, {2, 5});
  save_steps(theirs, {7});  // another job, the same model
  const auto run_of = [](const fs::path& checkpoint) {
    return cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1).run;
  };
  const std::string our_run = cohort::detail::read_checkpoint_run(ours.string());
  REQUIRE(our_run.size() == 16);
  CHECK(run_of(ours / "step-2") == our_run);
  CHECK(run_of(ours / "step-5") == our_run);  // kept from save to save
  CHECK(run_of(theirs / "step-7") != our_run);
  CHECK_THAT(cohort::detail::describe_checkpoint(
                 (ours / "step-5").string(), cohort::detail::read_checkpoint_manifest((ours / "step-5").string(), -1)),
             Catch::Contains("run " + our_run + ", job "));
  fs::copy(theirs / "step-7", ours / "step-7");
  const auto resume = [&](const fs::path& dir, const cohort::resume_options& options) {
    std::vector<std::string> errors(2);
    std::vector<cohort::checkpoint_info> infos(2);
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      state_type state(pg, small_regions(), {.strategy = strategy::zero2});
      try {
        infos[static_cast<std::size_t>(rank)] = cohort::resume_checkpoint(state, dir.string(), options).value();
        cohort::save_checkpoint(state, dir.string(), infos[static_cast<std::size_t>(rank)].step + 1);
      } catch (const cohort::checkpoint_mismatch_error& failure) {
        errors[static_cast<std::size_t>(rank)] = failure.what();
      }
    });
    return std::pair{errors, infos};
  };
  {
    const auto [errors, infos] = resume(ours, {});
    for (const auto& text : errors) {
      INFO(text);
      CHECK(text.find((ours / "step-7").string() + " was saved by run " + run_of(theirs / "step-7")) !=
            std::string::npos);
      CHECK(text.find(ours.string() + " belongs to run " + our_run) != std::string::npos);
    }
  }
  {
    const auto [errors, infos] = resume(ours, {.refuse_other_run = false});  // a deliberate copy
    CHECK(errors == std::vector<std::string>(2));
    CHECK(infos[1].step == 7);
    CHECK(infos[1].run == run_of(theirs / "step-7"));
    CHECK(run_of(ours / "step-8") == our_run);  // the directory's run goes on
  }
  // An index of version 3 (no run, no job) in a directory without a run: loads, and the next
  // save records one.
  save_steps(older, {3});
  fs::remove(older / ".cohort" / "run");
  std::string text = read_file(older / "step-3" / "manifest.json");
  const auto from = text.find(" \"run\": "), to = text.find(" \"step\": ");
  REQUIRE((from != std::string::npos && to != std::string::npos));
  text.erase(from, to - from);
  text.replace(text.find("\"version\": 4"), 12, "\"version\": 3");
  write_file(older / "step-3" / "manifest.json", reseal(text));
  CHECK(run_of(older / "step-3").empty());
  {
    const auto [errors, infos] = resume(older, {});
    CHECK(errors == std::vector<std::string>(2));
    CHECK(infos[0].step == 3);
    CHECK(infos[0].run.empty());
  }
  const std::string new_run = cohort::detail::read_checkpoint_run(older.string());
  CHECK(new_run.size() == 16);
  CHECK(run_of(older / "step-4") == new_run);
  fs::remove_all(root);
}

TEST_CASE("regions carry shapes: checked, kept in the index, listed by inspect, exported and loaded by PyTorch",
          "[checkpoint][integrity][safetensors]") {
  CHECK_THAT(cohort::detail::check_regions({{"w", 0, 12, 0, true, 1.0, {3, 5}}}),
             Catch::Contains("has shape [3, 5], which holds 15 elements, not its count 12"));
  CHECK(cohort::detail::check_regions({{"w", 0, 12, 0, true, 1.0, {3, 4}}}).empty());
  CHECK(cohort::stacked_regions({{"w", 12, true, {3, 4}}}, 2)[1].shape == std::vector<std::size_t>{3, 4});
  // nn.Sequential(Linear(4, 8), Tanh(), Linear(8, 3)): its state_dict's names and shapes.
  const std::vector<region> regions{{"0.weight", 0, 32, 0, true, 1.0, {8, 4}},
                                    {"0.bias", 32, 8, 0, false, 1.0, {8}},
                                    {"2.weight", 40, 24, 1, true, 1.0, {3, 8}},
                                    {"2.bias", 64, 3, 1, false, 1.0}};
  const auto dir = checkpoint_scratch("shapes");
  std::vector<float> values(67);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.125f * static_cast<float>(i) - 3.0f;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, float> state(pg, regions, {.strategy = strategy::zero3});
    state.load_parameters(values);
    cohort::save_checkpoint(state, dir.string(), 12, {.block_bytes = 64});
  });
  const auto checkpoint = dir / "step-12";
  const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1);
  CHECK(manifest.regions[0].shape == std::vector<std::uint64_t>{8, 4});
  CHECK(manifest.regions[3].shape == std::vector<std::uint64_t>{3});  // none given: 1-D
  const std::string listing = cohort::detail::describe_checkpoint(checkpoint.string(), manifest);
  std::printf("%s", listing.c_str());
  // A row per region: name, dtype, shape, elements, bytes per tensor.
  for (const auto* row : {R"(0\.weight +float +\[8, 4\] +32 +128)", R"(2\.bias +float +\[3\] +3 +12)"})
    CHECK(std::regex_search(listing, std::regex(row)));
  const auto out = dir / "model.safetensors";
  cohort::consolidate_checkpoint(checkpoint.string(), out.string());
  // PyTorch, where a Python has it: the file into the module it came from, strict=True, with
  // safetensors' own reader where installed (else the format read by hand).
  std::string python;
  for (const auto* candidate : {"python3", "/usr/bin/python3"})
    if (python.empty() && std::system((std::string(candidate) + " -c 'import torch' 2>/dev/null").c_str()) == 0)
      python = candidate;
  if (python.empty()) cohort_test::skip("no Python here has PyTorch: the export's shapes were checked in C++ alone");
  const auto script = dir / "load.py";
  write_file(script, R"(import json, struct, sys, torch
path = sys.argv[1]
try:
    from safetensors.torch import load_file
    tensors, reader = load_file(path), "safetensors"
except ImportError:
    data = open(path, "rb").read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    tensors, reader = {}, "by-hand"
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = bytearray(data[8 + length + begin:8 + length + end])
        tensors[name] = torch.frombuffer(raw, dtype=torch.float32).reshape(entry["shape"])
module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
module.load_state_dict(tensors, strict=True)
flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
print("loaded", reader, len(flat), repr(float(flat.sum())), repr(float(flat[33])))
)");
  const auto result = dir / "result.txt";
  REQUIRE(std::system((python + " " + script.string() + " " + out.string() + " > " + result.string()).c_str()) == 0);
  std::ifstream in(result);
  std::string loaded, reader;
  std::size_t count = 0;
  double sum = 0, element = 0;
  in >> loaded >> reader >> count >> sum >> element;
  std::printf("PyTorch (%s) loaded the export into nn.Sequential with strict=True, read by %s: %zu parameters\n",
              python.c_str(), reader.c_str(), count);
  CHECK(loaded == "loaded");
  CHECK(count == values.size());
  double expected = 0;
  for (const float v : values) expected += v;
  CHECK(sum == expected);        // multiples of 1/8: exact in float and double alike
  CHECK(element == values[33]);  // 0.bias[1], in the module's parameter order
  fs::remove_all(dir);
}
