// Checkpoints of a training state (cohort/parallel/checkpoint.hpp) against this disk, on Gloo
// ranks as threads over loopback.
//
//   bench_checkpoint [--ranks 4] [--bytes 256M] [--block-bytes 1M] [--rounds 3] [--between-ms 1000]
//                    [--compute-ms 200] [--dir DIR] [--json FILE]
//
// The state is --bytes in total over the ranks: fp32 parameters and Adam's two moments (a
// third each), sharded (zero3) so that each rank holds and writes a quarter. Every ratio is
// measured in A/B rounds (bench/ab_rounds.hpp: A B B A per round, --rounds rounds, every
// sample printed, the median of the rounds' ratios with its min-max spread), on the file
// system of --dir (default: the temporary directory):
//   - this disk's sequential write rate against the synchronous save's: one file of the
//     checkpoint's size written and fsynced, as `dd bs=64M conv=fsync` does (A), and a
//     save_checkpoint of the state (B), the same bytes; disk time / save time is the save's
//     share of the disk's rate (a virtual disk's rate wanders: hence the rounds);
//   - asynchronous saves (async_checkpointer) against the synchronous save: one checkpointer
//     saves as a trainer does, --between-ms apart (the training between two saves: the ranks
//     sleep, as a host does while its GPU computes). save() starts the copy into staging and
//     returns; the next step() waits for the copy to end (the state's checkpoint fence).
//     Blocked (A) is save()'s own time (the agreement on the previous save included) plus that
//     wait, after a simulated forward and backward of --compute-ms (a sleep) and without one
//     (0 ms), against the synchronous save (B); with the default staging bound and with a
//     quarter of it. Before a synchronous save the asynchronous write in flight is waited for
//     (untimed), so the two never share the disk. Also: the first save (its staging faulted
//     in, before the rounds), the time until rank 0's writer committed each save (the
//     directory polled every millisecond), and the host memory held: staging_peak_bytes and
//     the process's resident set above what it was before (sampled every millisecond;
//     getrusage's ru_maxrss too), against the configured staging bound;
//   - a load at other world sizes (saved at --ranks, loaded at 2 under ddp and 3 under zero3,
//     the files' pages dropped from the page cache first): bytes read in all against the
//     checkpoint's size, 1.00x: a rank reads exactly the bytes of its new shard, and a
//     checksum block straddling two ranks' shards is verified from the parts each read;
//   - reading an index (its checksum, then every field checked; in memory, no disk): indexes
//     of 10,000 to 160,000 metadata keys and of as many segments, the time per entry, which
//     stays flat (one pass), against the limits (16 MiB of text, 32 MiB parsed). --index-only
//     measures this alone.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../examples/command_line.hpp"
#include "ab_rounds.hpp"
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/error.hpp"
#include "cohort/parallel/checkpoint.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/run/run_ranks.hpp"
#include "cohort/tools/detail/json.hpp"

namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;
using group = cohort::process_group<cohort::gloo>;
using state_type = cohort::training_state<cohort::gloo>;
constexpr double mib = 1 << 20;

struct config {
  int ranks = 4;
  std::size_t bytes = std::size_t{256} << 20;
  std::size_t block_bytes = cohort::checkpoint_options{}.block_bytes;
  int rounds = 3;
  int between_ms = 1000;
  int compute_ms = 200;
  std::string dir, json_path;
  bool index_only = false;
};

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

std::size_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  const double value = std::stod(text, &used);
  const std::string unit = text.substr(used);
  const double scale = unit.empty() ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : 0;
  if (scale == 0 || value <= 0) throw std::runtime_error("--bytes " + text + ": a size such as 256M or 1G");
  return static_cast<std::size_t>(value * scale);
}

config parse(int argc, char** argv) {
  config cfg;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    const std::string& arg = args.flag();
    if (arg == "--ranks")
      cfg.ranks = std::stoi(args.value());
    else if (arg == "--bytes")
      cfg.bytes = parse_bytes(args.value());
    else if (arg == "--block-bytes")
      cfg.block_bytes = parse_bytes(args.value());
    else if (arg == "--rounds")
      cfg.rounds = std::stoi(args.value());
    else if (arg == "--between-ms")
      cfg.between_ms = std::stoi(args.value());
    else if (arg == "--compute-ms")
      cfg.compute_ms = std::stoi(args.value());
    else if (arg == "--dir")
      cfg.dir = args.value();
    else if (arg == "--json")
      cfg.json_path = args.value();
    else if (arg == "--index-only")
      cfg.index_only = true;
    else
      throw std::runtime_error(
          "unknown option " + arg +
          " (bench_checkpoint [--ranks N] [--bytes 256M] "
          "[--block-bytes 1M] [--rounds 3] [--between-ms 1000] [--compute-ms 200] [--dir DIR] [--json FILE] "
          "[--index-only])");
  }
  if (cfg.ranks < 1 || cfg.rounds < 1) throw std::runtime_error("--ranks and --rounds must be at least 1");
  return cfg;
}

std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

std::size_t max_resident_bytes() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::size_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

// The resident set's peak while it runs, sampled: ru_maxrss only ever grows, so it cannot
// show the peak of a phase that follows a larger one.
class rss_sampler {
 public:
  rss_sampler() : baseline_(resident_bytes()), peak_(baseline_) {
    thread_ = std::thread([this] {
      while (!stop_) {
        peak_ = std::max(peak_.load(), resident_bytes());
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  rss_sampler(const rss_sampler&) = delete;
  rss_sampler& operator=(const rss_sampler&) = delete;
  ~rss_sampler() { finish(); }
  std::size_t finish() {  // the peak above the resident set when it started
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
    return std::max(peak_.load(), resident_bytes()) - baseline_;
  }

 private:
  std::size_t baseline_;
  std::atomic<std::size_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// What `dd if=/dev/zero of=FILE bs=64M conv=fsync` measures, in this process: `bytes` written
// in 64 MiB writes of non-zero data, then fsynced. Seconds.
double sequential_write_seconds(const std::string& path, std::size_t bytes) {
  std::vector<char> buffer(std::min<std::size_t>(bytes, std::size_t{64} << 20));
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<char>(i * 131 + 7);
  const auto fail = [&](const char* what) {
    return cohort::error(-1, "bench_checkpoint", std::string(what) + " " + path + " failed: " + std::strerror(errno),
                         "--dir must name a writable directory with room for twice --bytes");
  };
  const auto started = clock_type::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw fail("open of");
  for (std::size_t done = 0; done < bytes;) {
    const ssize_t wrote = ::write(fd, buffer.data(), std::min(buffer.size(), bytes - done));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) {
      ::close(fd);
      throw fail("write of");
    }
    done += static_cast<std::size_t>(wrote);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    throw fail("fsync of");
  }
  ::close(fd);
  const double seconds = seconds_since(started);
  fs::remove(path);
  return seconds;
}

// The checkpoint's files out of the page cache (they were just written, so clean): the load
// below then reads from the disk, as a restarted job on another machine would.
void drop_cached(const std::string& checkpoint) {
  for (const auto& entry : fs::directory_iterator(checkpoint)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

std::vector<cohort::region> regions_for(std::size_t elements) {
  constexpr std::size_t count = 16;  // layers of equal size
  std::vector<cohort::region> regions;
  for (std::size_t r = 0, at = 0; r < count; ++r) {
    const std::size_t size = elements / count + (r < elements % count ? 1 : 0);
    regions.push_back({"layer" + std::to_string(r), at, size, r, true, 1.0});
    at += size;
  }
  return regions;
}

group make_group(const std::shared_ptr<cohort::store>& store, const cohort::launch_env& env) {
  cohort::gloo::options opts;
  opts.timeout = std::chrono::seconds(300);  // a save of a large state on a slow disk
  return group(store, env, opts);
}

struct async_result {
  std::size_t bound = 0;                 // staging bound per rank (configured; 0 resolved to the state)
  int compute_ms = 0;                    // the simulated forward and backward before the next step()
  double first_blocked = 0;              // slowest rank's first save, before the rounds: its staging faulted in
  cohort_bench::ab_result against_sync;  // blocked (slowest rank) against the synchronous save, seconds
  std::size_t staging_peak = 0;          // staging_peak_bytes, summed over the ranks
  std::size_t rss_peak = 0;              // sampled resident set above the one before
  std::vector<double> committed_runs;    // every asynchronous save: save() until committed
  std::vector<double> save_call_runs, fence_wait_runs;  // the two parts of blocked, every save in the rounds
};

struct results {
  std::size_t checkpoint_bytes = 0;           // every rank's file
  cohort_bench::ab_result disk_against_sync;  // disk write+fsync against the synchronous save, seconds
  std::vector<async_result> async;
  std::size_t maxrss_before = 0, maxrss_after_async = 0;
  struct load {
    int world = 0;
    std::string strategy;
    double seconds = 0;
    std::size_t bytes_read = 0;  // over its ranks
  };
  std::vector<load> loads;
};

// Every rank's largest value (threads of one process: a shared slot per rank).
double slowest(const std::vector<double>& per_rank) { return *std::max_element(per_rank.begin(), per_rank.end()); }

results run(const config& cfg) {
  results out;
  const std::size_t elements = cfg.bytes / (3 * sizeof(float));  // parameters, Adam's m and v
  const auto regions = regions_for(elements);
  const std::vector<float> initial = [&] {
    std::vector<float> values(elements);
    for (std::size_t i = 0; i < elements; ++i) values[i] = static_cast<float>(i % 1021) * 1e-3f;
    return values;
  }();
  out.checkpoint_bytes = 3 * elements * sizeof(float);
  const std::size_t rank_bytes = out.checkpoint_bytes / static_cast<std::size_t>(cfg.ranks);
  const auto ranks = static_cast<std::size_t>(cfg.ranks);
  // Slots per rank, shared by the rank threads; rank 0 reads them between barriers.
  std::vector<double> blocked(ranks), save_call(ranks), fence_wait(ranks), sync_seconds(ranks);
  std::vector<std::size_t> staging(ranks);
  std::string saved;
  const std::string async_dir = cfg.dir + "/async", sync_dir = cfg.dir + "/sync";
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    auto pg = make_group(store, env);
    const auto rank = static_cast<std::size_t>(env.rank);
    const bool leader = rank == 0;
    state_type state(pg, regions, {.strategy = cohort::strategy::zero3});
    state.load_parameters(initial);
    std::uint64_t step = 1;  // every save's step number, the same on every rank
    // The synchronous save (slowest rank); an asynchronous write in flight is finished first,
    // untimed, so that the two never share the disk.
    cohort::async_checkpointer<cohort::gloo, float, float>* in_flight = nullptr;
    const auto sync_sample = [&] {
      if (in_flight) in_flight->wait();
      pg.barrier().wait();
      const auto started = clock_type::now();
      const auto info =
          cohort::save_checkpoint(state, sync_dir, step++, {.keep_last = 1, .block_bytes = cfg.block_bytes});
      sync_seconds[rank] = seconds_since(started);
      pg.barrier().wait();
      if (leader) saved = info.path;
      return slowest(sync_seconds);
    };
    // Asynchronous saves first, while the resident set is only the state's: with the
    // default bound (the rank's state once) and with a quarter of it, which the checkpointer
    // meets by streaming the state through it while save() waits.
    for (const auto& [bound, compute_ms] : {std::pair{std::size_t{0}, 0}, std::pair{std::size_t{0}, cfg.compute_ms},
                                            std::pair{rank_bytes / 4, cfg.compute_ms}}) {
      async_result a;
      a.compute_ms = compute_ms;
      std::unique_ptr<rss_sampler> sampler;
      pg.barrier().wait();
      if (leader) {
        if (out.async.empty()) out.maxrss_before = max_resident_bytes();
        sampler = std::make_unique<rss_sampler>();
      }
      pg.barrier().wait();
      {
        cohort::async_checkpointer saver(state);
        cohort::checkpoint_options options{.keep_last = 2, .block_bytes = cfg.block_bytes};
        options.staging_bytes = bound;
        std::thread watcher;
        // One save as a trainer makes it: save(), the next forward and backward, the next
        // step()'s wait for the copy; then the training until the next save.
        const auto async_sample = [&] {
          const std::uint64_t this_step = step++;
          pg.barrier().wait();
          const auto started = clock_type::now();
          saver.save(async_dir, this_step, options);
          in_flight = &saver;
          save_call[rank] = seconds_since(started);
          std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));  // the next forward and backward
          fence_wait[rank] = state.checkpoint_fence().wait();                  // what the next step() waits
          blocked[rank] = save_call[rank] + fence_wait[rank];
          if (leader) {
            // Committed by rank 0's writer with no call of the trainer's: seen in the directory.
            if (watcher.joinable()) watcher.join();
            watcher = std::thread([&, started, this_step] {
              const std::string path = async_dir + "/step-" + std::to_string(this_step);
              while (cohort::newest_checkpoint(async_dir) != path && seconds_since(started) < 600)
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
              a.committed_runs.push_back(seconds_since(started));
            });
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(cfg.between_ms));  // the training between saves
          pg.barrier().wait();
          if (leader) {
            a.save_call_runs.push_back(slowest(save_call));
            a.fence_wait_runs.push_back(slowest(fence_wait));
          }
          return slowest(blocked);
        };
        a.first_blocked = async_sample();
        if (leader) a.save_call_runs.clear(), a.fence_wait_runs.clear();
        char what[128];
        std::snprintf(what, sizeof what, "asynchronous save (bound %.1f MiB/rank, %d ms compute) against synchronous",
                      static_cast<double>(bound == 0 ? rank_bytes : bound) / mib, compute_ms);
        a.against_sync = cohort_bench::ab_rounds(what, "blocked (save() + step()'s wait)", "synchronous save",
                                                 cfg.rounds, async_sample, sync_sample);
        saver.wait();
        in_flight = nullptr;
        if (leader) watcher.join();
        staging[rank] = saver.staging_peak_bytes();
      }
      pg.barrier().wait();
      if (leader) {
        a.bound = bound == 0 ? rank_bytes : bound;
        a.rss_peak = sampler->finish();
        for (const auto s : staging) a.staging_peak += s;
        out.async.push_back(std::move(a));
        out.maxrss_after_async = max_resident_bytes();
      }
      pg.barrier().wait();
    }
    // The disk against the synchronous save, the same bytes.
    auto disk_against_sync = cohort_bench::ab_rounds(
        "this disk's write+fsync against the synchronous save", "disk (dd conv=fsync)", "synchronous save", cfg.rounds,
        [&] {
          std::vector<double> disk{0};
          if (leader) disk[0] = sequential_write_seconds(cfg.dir + "/dd.bin", out.checkpoint_bytes);
          pg.barrier().wait();
          return disk[0];
        },
        sync_sample);
    if (leader) out.disk_against_sync = std::move(disk_against_sync);
  });

  // At other world sizes, each under another strategy than the save's.
  for (const auto& [world, strategy] : {std::pair{2, cohort::strategy::ddp}, std::pair{3, cohort::strategy::zero3}}) {
    drop_cached(saved);
    std::vector<double> seconds(static_cast<std::size_t>(world));
    std::vector<std::size_t> read(seconds.size());
    cohort::run_ranks(world, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      auto pg = make_group(store, env);
      state_type state(pg, regions, {.strategy = strategy});
      pg.barrier().wait();
      const auto started = clock_type::now();
      const auto info = cohort::load_checkpoint(state, saved);
      seconds[static_cast<std::size_t>(env.rank)] = seconds_since(started);
      read[static_cast<std::size_t>(env.rank)] = info.bytes_read;
    });
    results::load l{world, std::string(cohort::to_string(strategy)), slowest(seconds), 0};
    for (const auto r : read) l.bytes_read += r;
    out.loads.push_back(l);
  }
  return out;
}

// Reading an index of `entries` metadata keys or segments (the two parts an index grows by):
// the text built as a save writes it, then read back as a load reads it, median of 5.
struct index_row {
  std::string kind;
  std::size_t entries = 0, bytes = 0;
  double seconds = 0;
};
std::vector<index_row> index_rows() {
  std::vector<index_row> rows;
  for (const char* kind : {"metadata keys", "segments"})
    for (const std::size_t entries : {std::size_t{10000}, std::size_t{40000}, std::size_t{160000}}) {
      cohort::detail::checkpoint_manifest m;
      m.run = "0123456789abcdef";  // a save records its directory's run
      m.world_size = 1;
      m.strategy = "zero3";
      m.parameter_dtype = m.dtype = "float";
      m.element_bytes = 4;
      m.block_bytes = std::uint64_t{1} << 30;
      m.tensors = {"parameters", "adam.exp_avg", "adam.exp_avg_sq"};
      cohort::detail::checkpoint_file file;
      file.name = cohort::detail::checkpoint_file_name(0);
      const bool keys = std::string(kind) == "metadata keys";
      const std::uint64_t count = keys ? 1 : entries;
      m.regions = {{"weight", count, {count}}};
      for (std::uint64_t k = 0; k < (keys ? 1 : entries); ++k) file.segments.push_back({0, k, 1});
      if (keys)
        for (std::size_t k = 0; k < entries; ++k) m.metadata["sampler.position." + std::to_string(k)] = "0";
      file.elements = count;
      file.bytes = 3 * count * 4;
      file.blocks = {0};
      file.checksum = cohort::detail::checkpoint_file_checksum(file.blocks, file.bytes);
      m.files = {file};
      const std::string text = cohort::detail::checkpoint_manifest_json(m);
      std::vector<double> runs;
      for (int run = 0; run < 5; ++run) {
        const auto started = clock_type::now();
        const auto back = cohort::detail::parse_checkpoint_manifest(text, "manifest.json", -1, "bench_checkpoint");
        runs.push_back(seconds_since(started));
        if (back.metadata.size() != m.metadata.size() || back.files[0].segments.size() != file.segments.size())
          throw std::runtime_error("the index read back differs");
      }
      rows.push_back({kind, entries, text.size(), cohort_bench::median_of(runs)});
    }
  return rows;
}

void print_index_rows(const std::vector<index_row>& rows) {
  std::printf("%-44s %10s %12s %s\n", "reading an index (checksum, checks, parse)", "seconds", "MiB/s",
              "per entry; limits: 16 MiB of text, 32 MiB parsed");
  for (const auto& row : rows)
    std::printf("%-44s %10.4f %12.1f %.0f ns per entry, %.1f MiB of text\n",
                (std::to_string(row.entries) + " " + row.kind).c_str(), row.seconds,
                static_cast<double>(row.bytes) / row.seconds / mib,
                row.seconds / static_cast<double>(row.entries) * 1e9, static_cast<double>(row.bytes) / mib);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    config cfg = parse(argc, argv);
    const auto index = index_rows();
    if (cfg.index_only) {
      print_index_rows(index);
      return 0;
    }
    const bool own_dir = cfg.dir.empty();
    if (own_dir) cfg.dir = (fs::temp_directory_path() / ("cohort-bench-checkpoint-" + std::to_string(::getpid())));
    fs::create_directories(cfg.dir);
    const auto r = run(cfg);
    if (own_dir) fs::remove_all(cfg.dir);

    const double size = static_cast<double>(r.checkpoint_bytes);
    std::printf(
        "checkpoint of a %.0f MiB training state (fp32 parameters + Adam m, v), %d ranks (zero3) in %s, %.0f KiB "
        "blocks; A/B rounds: %d, A B B A each; asynchronous saves %d ms apart\n\n",
        size / mib, cfg.ranks, cfg.dir.c_str(), static_cast<double>(cfg.block_bytes) / 1024, cfg.rounds,
        cfg.between_ms);
    const auto& disk = r.disk_against_sync;
    cohort_bench::print_result(disk, "s", "%.3f");
    const double disk_rate = size / cohort_bench::median_of(disk.a_samples) / mib;
    const double sync_rate = size / cohort_bench::median_of(disk.b_samples) / mib;
    std::printf(
        "    the synchronous save writes at %.0f%% of this disk's rate [%.0f%%-%.0f%%] (%.0f MiB/s against %.0f MiB/s, "
        "medians)\n\n",
        100 * disk.median_ratio, 100 * disk.min_ratio, 100 * disk.max_ratio, sync_rate, disk_rate);
    for (const auto& a : r.async) {
      cohort_bench::print_result(a.against_sync, "s", "%.3f");
      std::printf("    blocked is %.1f%% of the synchronous save [%.1f%%-%.1f%%]; of it save() %s s, the wait %s s\n",
                  100 * a.against_sync.median_ratio, 100 * a.against_sync.min_ratio, 100 * a.against_sync.max_ratio,
                  cohort_bench::sample_list(a.save_call_runs, "%.3f").c_str(),
                  cohort_bench::sample_list(a.fence_wait_runs, "%.3f").c_str());
      std::printf("    the first save (staging faulted in, before the rounds): %.3f s\n", a.first_blocked);
      std::printf("    until committed by rank 0's writer, every save: %s s\n",
                  cohort_bench::sample_list(a.committed_runs, "%.2f").c_str());
      std::printf("    host memory: %.1f MiB staged, %.1f MiB resident above before; bound %.1f MiB (all ranks)\n\n",
                  static_cast<double>(a.staging_peak) / mib, static_cast<double>(a.rss_peak) / mib,
                  static_cast<double>(a.bound) * cfg.ranks / mib);
    }
    std::printf("peak RSS (getrusage): ru_maxrss %.1f MiB before the saves, %.1f MiB after (+%.1f MiB)\n",
                static_cast<double>(r.maxrss_before) / mib, static_cast<double>(r.maxrss_after_async) / mib,
                static_cast<double>(r.maxrss_after_async - r.maxrss_before) / mib);
    for (const auto& l : r.loads)
      std::printf("load at %d ranks (%s): %.3f s, %.1f MiB/s; read %.1f MiB in all, %.3fx the checkpoint\n", l.world,
                  l.strategy.c_str(), l.seconds, size / l.seconds / mib, static_cast<double>(l.bytes_read) / mib,
                  static_cast<double>(l.bytes_read) / size);
    print_index_rows(index);

    if (!cfg.json_path.empty()) {
      using cohort::detail::json;
      json doc = json::make_object();
      doc.set("benchmark", "bench_checkpoint");
      doc.set("backend", "gloo");
      doc.set("ranks", cfg.ranks);
      doc.set("strategy", "zero3");
      doc.set("checkpoint_bytes", static_cast<unsigned long>(r.checkpoint_bytes));
      doc.set("block_bytes", static_cast<unsigned long>(cfg.block_bytes));
      doc.set("rounds", cfg.rounds);
      const auto samples = [](const std::vector<double>& values) {
        return json(json::array(values.begin(), values.end()));
      };
      doc.set("disk_against_sync_save", cohort_bench::to_json(r.disk_against_sync));
      doc.set("between_saves_ms", cfg.between_ms);
      json async = json::make_array();
      for (const auto& a : r.async) {
        json row = json::make_object();
        row.set("staging_bound_bytes_per_rank", static_cast<unsigned long>(a.bound));
        row.set("simulated_compute_ms", a.compute_ms);
        row.set("first_blocked_seconds", a.first_blocked);
        row.set("blocked_against_sync_save", cohort_bench::to_json(a.against_sync));
        row.set("save_call_seconds_runs", samples(a.save_call_runs));
        row.set("fence_wait_seconds_runs", samples(a.fence_wait_runs));
        row.set("committed_seconds_runs", samples(a.committed_runs));
        row.set("staging_peak_bytes_all_ranks", static_cast<unsigned long>(a.staging_peak));
        row.set("rss_peak_above_before_bytes", static_cast<unsigned long>(a.rss_peak));
        async.push_back(std::move(row));
      }
      doc.set("async", std::move(async));
      doc.set("ru_maxrss_before_bytes", static_cast<unsigned long>(r.maxrss_before));
      doc.set("ru_maxrss_after_async_bytes", static_cast<unsigned long>(r.maxrss_after_async));
      json loads = json::make_array();
      for (const auto& l : r.loads) {
        json row = json::make_object();
        row.set("world", l.world);
        row.set("strategy", l.strategy);
        row.set("seconds", l.seconds);
        row.set("bytes_read", static_cast<unsigned long>(l.bytes_read));
        row.set("bytes_read_fraction_of_checkpoint", static_cast<double>(l.bytes_read) / size);
        loads.push_back(std::move(row));
      }
      doc.set("loads", std::move(loads));
      json indexes = json::make_array();
      for (const auto& row : index) {
        json entry = json::make_object();
        entry.set("kind", row.kind);
        entry.set("entries", static_cast<unsigned long>(row.entries));
        entry.set("bytes", static_cast<unsigned long>(row.bytes));
        entry.set("seconds", row.seconds);
        indexes.push_back(std::move(entry));
      }
      doc.set("index_reads", std::move(indexes));
      std::ofstream file(cfg.json_path);
      file << doc.dump(2) << "\n";
      if (!file) throw std::runtime_error("cannot write " + cfg.json_path);
    }
    return 0;
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", failure.what());
    return 1;
  }
}
