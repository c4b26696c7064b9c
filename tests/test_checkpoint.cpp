// Checkpoints of the training state (cohort/parallel/checkpoint.hpp), with real files in a
// scratch directory and real ranks (threads with Gloo contexts over loopback): 20 steps
// uninterrupted against 10, save, load into a new state, 10 more, at the same world (bit-exact),
// at another world size and under another strategy; a partial checkpoint ignored, a flipped
// byte refused naming the file, and a process SIGKILLed while saving leaving the previous
// checkpoint loadable. Asynchronous saves: committed by rank 0's writer with no collective,
// streamed through a staging bound below the state, one rank's failed write raised on every
// rank, a rank killed before publishing its checksums leaving the step uncommitted.
// test_checkpoint_integrity.cpp tries the index and the directory as a hostile or unlucky
// user would.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/parallel/checkpoint.hpp>

#include <signal.h>
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
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint_fixtures.hpp"

namespace {

using cohort::region;
using cohort::strategy;
namespace fs = std::filesystem;

using cohort_test::load_errors;
fs::path scratch_dir(const std::string& name) { return cohort_test::checkpoint_scratch(name); }

// llm.c's layout, smaller: an embedding, then two tensors stacked over the layers.
std::vector<region> model_regions(std::size_t scale = 1) {
  std::vector<region> regions{{"embedding", 0, 23 * scale, 0, true, 1.0}};
  auto stacked = cohort::stacked_regions({{"w", 37 * scale, true}, {"b", 5 * scale, false}}, 4, 1, 23 * scale);
  stacked[1].lr_scale = 0.5;
  regions.insert(regions.end(), stacked.begin(), stacked.end());
  return regions;
}

// The global batch is the same at every world size: 12 samples a step, split among the ranks.
constexpr std::size_t global_batch = 12;
constexpr int inf_step = 13;  // rank 0 puts an inf here: every rank skips, the scale backs off

double target(std::size_t sample, std::size_t element) {
  return std::sin(0.37 * static_cast<double>(sample) + 0.11 * static_cast<double>(element));
}

struct run {
  int world = 2;
  strategy kind = strategy::ddp;
  int from = 0, to = 20;                     // steps [from, to)
  std::optional<fs::path> resume_from = {};  // resume_checkpoint before the first step
  std::optional<fs::path> save_to = {};      // save_checkpoint after the last step
  std::size_t scale = 1;                     // model size
  std::size_t block_bytes = 256;
  int async_every = 0;   // > 0: async_checkpointer saves to save_to after every this many steps
  int replicas = 1;      // > 1: hybrid sharding, groups of world / replicas ranks
  bool adopted = false;  // the trainer's own flat buffers, adopted by the state
};

struct outcome {
  std::vector<double> parameters;
  double loss_scale = 0;
  std::uint64_t skipped = 0, optimizer_steps = 0;
  cohort::checkpoint_info loaded, saved;
  double async_blocked = 0;  // the longest save() of the async saves
  std::uint64_t staging_peak = 0;
};

// `shards` and `replicas`: hybrid sharding's groups (the state's group is `pg` without them).
outcome train(const run& spec, cohort_test::gloo_group& pg, cohort_test::gloo_group* shards = nullptr,
              cohort_test::gloo_group* replicas = nullptr) {
  const auto regions = model_regions(spec.scale);
  const std::size_t n = regions.back().offset + regions.back().count;
  cohort::loss_scaler scaler({.initial_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  cohort::training_options options;
  options.strategy = spec.kind;
  options.bucket_bytes = 600;
  options.adam = {.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  options.max_grad_norm = 0.4;
  options.scaler = &scaler;
  options.trainer_optimizer = false;  // the state's AdamW, whose moments the checkpoints carry
  std::vector<double> initial(n), gradients(n);
  for (std::size_t i = 0; i < n; ++i) initial[i] = 0.5 * std::cos(0.7 * static_cast<double>(i));
  std::optional<cohort::training_state<cohort::gloo, double>> held;
  if (spec.adopted)
    held.emplace(shards ? *shards : pg, std::span(initial), std::span(gradients), regions, options, replicas);
  else
    held.emplace(shards ? *shards : pg, regions, options, replicas);
  auto& state = *held;
  if (!spec.adopted) state.load_parameters(initial);
  outcome out;
  int first = spec.from;
  if (spec.resume_from) {
    auto resumed = cohort::resume_checkpoint(state, spec.resume_from->string());
    RANK_CHECK(resumed.has_value());
    out.loaded = *resumed;
    RANK_CHECK(out.loaded.metadata.at("next_step") == std::to_string(out.loaded.step + 1));
    first = std::stoi(out.loaded.metadata.at("next_step"));
  }
  const int rank = pg.rank();
  std::optional<cohort::async_checkpointer<cohort::gloo, double, double>> saver;
  if (spec.async_every > 0) saver.emplace(state);
  const std::size_t mine = global_batch / static_cast<std::size_t>(spec.world);
  for (int step = first; step < spec.to; ++step) {
    std::fill(gradients.begin(), gradients.end(), 0.0);  // adopted: the trainer's to zero
    for (std::size_t l = 0; l < state.layer_count(); ++l) auto layer = state.gather(l);  // the forward
    for (std::size_t l = state.layer_count(); l-- > 0;) {
      auto layer = state.gather(l);
      for (std::size_t r = 0; r < regions.size(); ++r) {
        if (regions[r].layer != l) continue;
        auto gradient = state.gradient(r);
        const auto p = layer.param(r);
        for (std::size_t j = 0; j < p.size(); ++j) {
          double sum = 0;
          for (std::size_t s = 0; s < mine; ++s) {
            const std::size_t sample =
                static_cast<std::size_t>(step) * global_batch + static_cast<std::size_t>(rank) * mine + s;
            sum += (1.0 + static_cast<double>((regions[r].offset + j) % 3)) *
                   (p[j] - target(sample, regions[r].offset + j));
          }
          gradient[j] = sum / static_cast<double>(mine) * scaler.scale();
        }
        if (step == inf_step && rank == 0 && r == 0) gradient[0] = std::numeric_limits<double>::infinity();
        state.mark_ready(r);
      }
    }
    const auto result = state.step();
    RANK_CHECK(result.skipped == (step == inf_step));
    if (spec.async_every > 0 && (step + 1) % spec.async_every == 0) {
      saver->save(spec.save_to->string(), static_cast<std::uint64_t>(step),
                  {.metadata = {{"next_step", std::to_string(step + 1)}, {"seed", "1234"}}, .keep_last = 0});
      out.async_blocked = std::max(out.async_blocked, saver->last_blocked_seconds());
    }
  }
  if (spec.async_every > 0) {
    saver->wait();
    out.staging_peak = saver->staging_peak_bytes();
  } else if (spec.save_to)
    out.saved = cohort::save_checkpoint(state, spec.save_to->string(), static_cast<std::uint64_t>(spec.to - 1),
                                        {.metadata = {{"next_step", std::to_string(spec.to)}, {"seed", "1234"}},
                                         .keep_last = 2,
                                         .block_bytes = spec.block_bytes});
  out.parameters = state.gather_parameters();
  out.loss_scale = scaler.scale();
  out.skipped = scaler.skipped_steps();
  out.optimizer_steps = state.steps();
  return out;
}

std::vector<outcome> run_all(const run& spec) {
  std::vector<outcome> results(static_cast<std::size_t>(spec.world));
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(spec.world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, spec.world);
    if (spec.replicas == 1) {
      results[static_cast<std::size_t>(rank)] = train(spec, pg);
      return;
    }
    const int group = spec.world / spec.replicas;
    auto shards = pg.split(rank / group, rank);
    auto replicas = pg.split(rank % group, rank);
    results[static_cast<std::size_t>(rank)] = train(spec, pg, &*shards, &*replicas);
  });
  return results;
}

double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return a.size() == b.size() ? worst : INFINITY;
}

std::uint64_t bytes_in(const fs::path& checkpoint) {
  std::uint64_t total = 0;
  for (const auto& entry : fs::directory_iterator(checkpoint))
    if (entry.path().extension() == ".bin") total += fs::file_size(entry.path());
  return total;
}

// 20 steps uninterrupted at `before`'s world and strategy against 10 there, saved, and 10 at
// `after`'s, resumed from the checkpoint.
struct comparison {
  double difference = 0;
  outcome whole, resumed;
  std::uint64_t read_in_all = 0, checkpoint_bytes = 0;
};
comparison compare(run before, run after, const std::string& name) {
  const auto dir = scratch_dir(name);
  before.from = 0;
  before.to = 20;
  const auto whole = run_all(before);
  before.to = 10;
  before.save_to = dir;
  const auto first_half = run_all(before);
  after.to = 20;
  after.resume_from = dir;
  const auto second_half = run_all(after);
  comparison c;
  c.whole = whole[0];
  c.resumed = second_half[0];
  for (const auto& r : second_half) {
    c.difference = std::max(c.difference, max_difference(r.parameters, whole[0].parameters));
    c.read_in_all += r.loaded.bytes_read;
  }
  c.checkpoint_bytes = bytes_in(dir / "step-9");
  CHECK(second_half[0].loaded.step == 9);
  CHECK(second_half[0].loaded.world_size == before.world / before.replicas);
  CHECK(second_half[0].loaded.strategy == std::string(cohort::to_string(before.kind)));
  CHECK(second_half[0].loaded.metadata.at("seed") == "1234");
  CHECK(c.resumed.loss_scale == c.whole.loss_scale);
  CHECK(c.resumed.skipped == c.whole.skipped);
  CHECK(c.resumed.optimizer_steps == c.whole.optimizer_steps);
  (void)first_half;
  fs::remove_all(dir);
  return c;
}

}  // namespace

TEST_CASE("resumed at the same world and strategy, training continues bit-exactly", "[checkpoint][gloo]") {
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3}) {
    INFO(cohort::to_string(kind));
    const auto c = compare({.world = 2, .kind = kind}, {.world = 2, .kind = kind}, "same");
    CHECK(c.difference == 0.0);  // bit-exact: the same reductions in the same order
    CHECK(c.whole.skipped == 1);
    CHECK(c.read_in_all == c.checkpoint_bytes);  // each byte read once, by the rank that wrote it
  }
}

TEST_CASE("resumed at another world size, each byte read once in all, within 1e-9 in double", "[checkpoint][gloo]") {
  // A larger model, so that a shard's pieces span several 256-byte checksum blocks, and the
  // new shards' edges fall inside blocks: each such block is read in parts by two ranks, and
  // verified from them (a wrong sum would refuse the load).
  const std::vector<std::pair<run, run>> cases = {
      {{.world = 4, .kind = strategy::zero1, .scale = 20}, {.world = 2, .kind = strategy::ddp, .scale = 20}},
      {{.world = 4, .kind = strategy::zero1, .scale = 20}, {.world = 3, .kind = strategy::zero3, .scale = 20}},
      // Blocks of 250 bytes: their edges fall inside elements, and the parts inside words.
      {{.world = 2, .kind = strategy::zero1, .scale = 20, .block_bytes = 250},
       {.world = 3, .kind = strategy::zero1, .scale = 20}},
  };
  for (const auto& [before, after] : cases) {
    INFO(before.world << " ranks (" << cohort::to_string(before.kind) << ") -> " << after.world << " ("
                      << cohort::to_string(after.kind) << ")");
    const auto c = compare(before, after, "world");
    // Another world reduces the gradients in another order: equal within rounding, not bits.
    CHECK(c.difference < 1e-9);
    std::printf("world %d -> %d (%s): %llu bytes read in all, checkpoint %llu bytes\n", before.world, after.world,
                cohort::to_string(after.kind).data(), static_cast<unsigned long long>(c.read_in_all),
                static_cast<unsigned long long>(c.checkpoint_bytes));
    CHECK(c.read_in_all == c.checkpoint_bytes);  // counted: no byte read twice, none left out
  }
}

TEST_CASE("the trainer's adopted buffers and the state's own resume each other's checkpoints, any world and strategy",
          "[checkpoint][gloo][adopted]") {
  CHECK(compare({.world = 2, .kind = strategy::zero2, .adopted = true}, {.world = 2, .kind = strategy::zero2},
                "adopted-owned")
            .difference == 0.0);  // the same layout either way: bit-exact
  const std::vector<std::pair<run, run>> cases = {
      {{.world = 4, .kind = strategy::zero2, .scale = 20, .adopted = true},
       {.world = 2, .kind = strategy::ddp, .scale = 20}},
      {{.world = 3, .kind = strategy::zero1, .scale = 20},
       {.world = 2, .kind = strategy::zero3, .scale = 20, .adopted = true}},
      {{.world = 2, .kind = strategy::ddp, .adopted = true}, {.world = 3, .kind = strategy::zero1, .adopted = true}},
  };
  for (const auto& [before, after] : cases) {
    INFO(before.world << " ranks (" << cohort::to_string(before.kind) << (before.adopted ? ", adopted" : "") << ") -> "
                      << after.world << " (" << cohort::to_string(after.kind) << (after.adopted ? ", adopted" : "")
                      << ")");
    const auto c = compare(before, after, "adopted");
    CHECK(c.difference < 1e-9);
    CHECK(c.read_in_all == c.checkpoint_bytes);
  }
  // Asynchronous saves of adopted buffers while training goes on.
  const auto dir = scratch_dir("adopted-async");
  const auto saved =
      run_all({.world = 2, .kind = strategy::zero1, .to = 12, .save_to = dir, .async_every = 4, .adopted = true});
  const auto resumed = run_all({.world = 3, .kind = strategy::zero2, .to = 20, .resume_from = dir, .adopted = true});
  const auto whole = run_all({.world = 2, .kind = strategy::zero1, .to = 20});
  CHECK(resumed[0].loaded.step == 11);
  CHECK(max_difference(resumed[0].parameters, whole[0].parameters) < 1e-9);
  fs::remove_all(dir);
}

TEST_CASE("resumed under another strategy: zero2 as ddp, ddp as zero3, within 1e-9 in double", "[checkpoint][gloo]") {
  const auto a = compare({.world = 2, .kind = strategy::zero2}, {.world = 2, .kind = strategy::ddp}, "zero2-ddp");
  CHECK(a.difference < 1e-9);
  const auto b = compare({.world = 2, .kind = strategy::ddp}, {.world = 3, .kind = strategy::zero3}, "ddp-zero3");
  CHECK(b.difference < 1e-9);
}

// Hybrid sharding: every copy of the group holds the same state, so the first copy writes one
// checkpoint at the group's size, which a plain world resumes; and a hybrid state resumes from
// a plain checkpoint, every copy reading the same files.
TEST_CASE("a hybrid 2 x 2 state saves once at its group's size, resumed plain and resuming from plain",
          "[checkpoint][gloo][hybrid]") {
  const auto a = compare({.world = 4, .kind = strategy::zero3, .replicas = 2}, {.world = 3, .kind = strategy::zero1},
                         "hybrid-plain");
  CHECK(a.difference < 1e-9);
  CHECK(a.checkpoint_bytes == a.read_in_all);  // one copy's files: 2 ranks' shards, read once by 3
  const auto b = compare({.world = 2, .kind = strategy::zero2}, {.world = 4, .kind = strategy::ddp, .replicas = 2},
                         "plain-hybrid");
  CHECK(b.difference < 1e-9);
  CHECK(b.read_in_all == 2 * b.checkpoint_bytes);  // every copy reads the whole checkpoint
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 4);
    auto shards = pg.split(rank / 2, rank);
    auto replicas = pg.split(rank % 2, rank);
    cohort::training_state<cohort::gloo, double> state(*shards, model_regions(), {.strategy = strategy::zero2},
                                                       &*replicas);
    RANK_CHECK_THROWS(cohort::error, (cohort::async_checkpointer<cohort::gloo, double, double>(state)),
                      "an asynchronous save of a state with replicas is not supported");
  });
}

TEST_CASE("a save in progress (in DIR/.cohort) and a step without its index are ignored, the previous loads",
          "[checkpoint][gloo][faults]") {
  const auto dir = scratch_dir("partial");
  run_all({.world = 2, .to = 5, .save_to = dir});
  run_all({.world = 2, .to = 10, .resume_from = dir, .save_to = dir});
  REQUIRE(fs::exists(dir / "step-9" / "manifest.json"));
  // An interrupted save's staging directory, complete-looking, and a newer step without index.
  fs::copy(dir / "step-9", dir / ".cohort" / "staging-12-00000000deadbeef");
  fs::copy(dir / "step-9", dir / "step-15");
  fs::remove(dir / "step-15" / "manifest.json");
  REQUIRE(cohort::newest_checkpoint(dir.string()) == (dir / "step-9").string());
  const auto resumed = run_all({.world = 3, .kind = strategy::zero3, .to = 12, .resume_from = dir, .save_to = dir});
  CHECK(resumed[0].loaded.step == 9);
  // The next save cleaned what the interrupted one left in cohort's folder, kept the last two
  // complete, and left the step without an index alone: it is not a checkpoint of cohort's.
  CHECK_FALSE(fs::exists(dir / ".cohort" / "staging-12-00000000deadbeef"));
  CHECK(fs::exists(dir / "step-11" / "manifest.json"));
  CHECK(fs::exists(dir / "step-9" / "manifest.json"));
  CHECK_FALSE(fs::exists(dir / "step-4"));
  CHECK(fs::exists(dir / "step-15" / "rank-00000.bin"));
  fs::remove_all(dir);
}

TEST_CASE("a flipped byte is refused naming the file and the rank, and another model naming the region",
          "[checkpoint][gloo][faults]") {
  const auto dir = scratch_dir("flipped");
  run_all({.world = 2, .to = 3, .save_to = dir});
  const auto checkpoint = dir / "step-2";
  CHECK(load_errors(checkpoint, 2, model_regions()) == std::vector<std::string>(2));

  const auto mismatch = load_errors(checkpoint, 2, model_regions(2));
  for (const auto& text : mismatch) {
    INFO(text);
    CHECK(text.find("region 'embedding'") != std::string::npos);
    CHECK(text.find("23 elements of double") != std::string::npos);
    CHECK(text.find("46 of double") != std::string::npos);
    CHECK(text.find("step-2/manifest.json") != std::string::npos);
  }
  // Another optimizer: SGD with momentum cannot continue from AdamW's moments.
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, double> sgd(
        pg, model_regions(), {.strategy = strategy::zero2, .sgd = cohort::sgd_options{.momentum = 0.9}});
    RANK_CHECK_THROWS(cohort::error, cohort::load_checkpoint(sgd, checkpoint.string()),
                      "holds the optimizer state [parameters, adam.exp_avg, adam.exp_avg_sq], this training state "
                      "keeps [parameters, sgd.momentum]");
  });

  cohort_test::flip_bit(checkpoint / "rank-00001.bin", 100, 4);
  for (const int world : {2, 3}) {
    const auto errors = load_errors(checkpoint, world, model_regions());
    for (const auto& text : errors) {
      INFO(world << " ranks: " << text);
      CHECK(text.find("rank-00001.bin (written by rank 1)") != std::string::npos);
    }
    // The rank that read the damaged block says which block and what its checksum was.
    bool named_block = false;
    for (const auto& text : errors)
      named_block |= text.find("block 0 (bytes 0..256) has checksum") != std::string::npos;
    CHECK(named_block);
  }
  fs::remove_all(dir);
}

namespace {

// Which ranks of a `world`-rank zero2 state read which bytes of the checkpoint's files: their
// new shards (checkpoint_segments) against the index's segments. Per file, block: the readers.
std::map<std::pair<std::size_t, std::uint64_t>, std::set<int>> block_readers(const fs::path& checkpoint, int world) {
  const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1);
  struct shard {
    std::size_t region;
    std::uint64_t first, count;
    int rank;
  };
  std::vector<shard> shards;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    cohort::training_state<cohort::gloo, double> state(pg, model_regions(), {.strategy = strategy::zero2});
    if (rank == 0)
      for (int r = 0; r < world; ++r)
        for (const auto& s : state.checkpoint_segments(r))
          shards.push_back({s.region, s.offset - state.regions()[s.region].offset, s.count, r});
  });
  std::map<std::pair<std::size_t, std::uint64_t>, std::set<int>> readers;
  for (std::size_t f = 0; f < manifest.files.size(); ++f) {
    // Tensor t's segment k starts at element t * elements + (the counts before it).
    const auto& file = manifest.files[f];
    for (std::size_t t = 0; t < manifest.tensors.size(); ++t) {
      std::uint64_t at = t * file.elements;
      for (const auto& p : file.segments) {
        for (const auto& s : shards) {
          if (s.region != p.region) continue;  // the same regions in the same order: the same model
          const std::uint64_t low = std::max(p.first, s.first), high = std::min(p.first + p.count, s.first + s.count);
          if (low >= high) continue;
          const std::uint64_t begin = (at + low - p.first) * manifest.element_bytes;
          const std::uint64_t end = (at + high - p.first) * manifest.element_bytes;
          for (std::uint64_t b = begin / manifest.block_bytes; b * manifest.block_bytes < end; ++b)
            readers[{f, b}].insert(s.rank);
        }
        at += p.count;
      }
    }
  }
  return readers;
}

}  // namespace

TEST_CASE("a flipped byte in a block two ranks read in parts is refused on every rank", "[checkpoint][gloo][faults]") {
  const auto dir = scratch_dir("straddle");
  run_all({.world = 2, .to = 3, .save_to = dir});
  const auto checkpoint = dir / "step-2";
  const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint.string(), -1);
  // A block of rank 1's file that two of the 3 new ranks read parts of.
  std::optional<std::uint64_t> straddling;
  std::set<int> readers;
  for (const auto& [at, who] : block_readers(checkpoint, 3))
    if (at.first == 1 && who.size() == 2 && !straddling) {
      straddling = at.second;
      readers = who;
    }
  REQUIRE(straddling.has_value());
  const std::uint64_t begin = *straddling * manifest.block_bytes;
  cohort_test::flip_bit(checkpoint / "rank-00001.bin", begin + 13, 4);  // inside a word: the parts are split by bytes
  const std::string readers_text = std::to_string(*readers.begin()) + ", " + std::to_string(*readers.rbegin());
  const auto errors = load_errors(checkpoint, 3, model_regions());
  for (const auto& text : errors) {
    INFO(text);
    CHECK(text.find("rank-00001.bin (written by rank 1): block " + std::to_string(*straddling) + " (bytes " +
                    std::to_string(begin) + "..") != std::string::npos);
    CHECK(text.find("has checksum") != std::string::npos);
    CHECK(text.find("read in parts by ranks " + readers_text) != std::string::npos);
  }
  // The same world reads each file whole, by the rank that wrote it: refused there too.
  for (const auto& text : load_errors(checkpoint, 2, model_regions())) {
    INFO(text);
    CHECK(text.find("rank-00001.bin (written by rank 1)") != std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("the block checksum: parts at any split add up, and small damage always changes it", "[checkpoint]") {
  std::vector<unsigned char> block(1000 + 4096 * 2 + 3);  // several 4 KiB key chunks, an odd tail
  for (std::size_t i = 0; i < block.size(); ++i) block[i] = static_cast<unsigned char>(i * 131 + 7);
  using cohort::detail::checkpoint_checksum;
  using cohort::detail::checkpoint_checksum_finish;
  using cohort::detail::checkpoint_checksum_part;
  const std::uint64_t whole = checkpoint_checksum(block.data(), block.size());
  for (const std::size_t a : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{4095}, std::size_t{4099}})
    for (const std::size_t b : {std::size_t{6}, std::size_t{4097}, std::size_t{8000}, block.size()}) {
      if (a > b) continue;
      INFO("parts [0, " << a << "), [" << a << ", " << b << "), [" << b << ", end)");
      const std::uint64_t sum = checkpoint_checksum_part(block.data(), 0, a) +
                                checkpoint_checksum_part(block.data() + a, a, b - a) +
                                checkpoint_checksum_part(block.data() + b, b, block.size() - b);
      CHECK(checkpoint_checksum_finish(sum, block.size()) == whole);
    }
  // Any one flipped bit, anywhere (a sample); two flipped sign bits of doubles, which FNV-1a
  // over 64-bit words never saw; a zero byte appended.
  for (std::size_t at = 0; at < block.size(); at += 97)
    for (int bit = 0; bit < 8; ++bit) {
      auto damaged = block;
      damaged[at] = static_cast<unsigned char>(damaged[at] ^ (1u << bit));
      CHECK(checkpoint_checksum(damaged.data(), damaged.size()) != whole);
    }
  auto signs = block;
  signs[7] ^= 0x80;
  signs[8 * 300 + 7] ^= 0x80;
  CHECK(checkpoint_checksum(signs.data(), signs.size()) != whole);
  // Within a 4 KiB chunk that holds always, as no two words' keys are equal there (nor can
  // two add up to 2^33: each is below 2^32): a word of 1 at each position has its own sum.
  std::set<std::uint64_t> keys;
  const std::uint32_t one = 1;
  for (std::uint64_t word = 0; word < 1024; ++word) keys.insert(checkpoint_checksum_part(&one, 4 * word, 4));
  CHECK(keys.size() == 1024);
  auto longer = block;
  longer.push_back(0);
  CHECK(checkpoint_checksum(longer.data(), longer.size()) != whole);
}

TEST_CASE("an index of another version or checksum kind is refused, saying which", "[checkpoint][gloo][faults]") {
  const auto dir = scratch_dir("version");
  run_all({.world = 2, .to = 3, .save_to = dir});
  const auto index = dir / "step-2" / "manifest.json";
  std::string text;
  {
    std::ifstream in(index);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto rewrite = [&](const std::string& from, const std::string& to, bool seal) {
    std::string changed = text;
    const auto at = changed.find(from);
    REQUIRE(at != std::string::npos);
    changed.replace(at, from.size(), to);
    // The last line is the checksum of the rest: an older version has none, a forged index of
    // another kind has a true one.
    const auto last = changed.rfind(",\n \"index_checksum\"");
    REQUIRE(last != std::string::npos);
    changed.resize(last);
    if (seal)
      changed += ",\n \"index_checksum\": \"" + [&] {
        char hex[17];
        std::snprintf(
            hex, sizeof hex, "%016llx",
            static_cast<unsigned long long>(cohort::detail::checkpoint_checksum(changed.data(), changed.size())));
        return std::string(hex);
      }() + "\"\n}\n";
    else
      changed += "\n}\n";
    std::ofstream(index, std::ios::trunc) << changed;
  };
  rewrite("\"version\": 4", "\"version\": 2", false);
  for (const auto& error : load_errors(dir / "step-2", 2, model_regions())) {
    INFO(error);
    CHECK(error.find(
              "index version 2, this build reads versions 3 to 4 (version 2 had no checksum of the index itself)") !=
          std::string::npos);
  }
  rewrite("\"checksum\": \"linear32\"", "\"checksum\": \"crc64\"", true);
  CHECK_THROWS_WITH(cohort::verify_checkpoint((dir / "step-2").string()),
                    Catch::Contains("block checksums of kind 'crc64', this build knows 'linear32'") &&
                        Catch::Contains("manifest.json"));
  fs::remove_all(dir);
}

TEST_CASE("a process SIGKILLed while saving leaves the previous checkpoint loadable", "[checkpoint][gloo][faults]") {
  // About 9 MB a checkpoint at two ranks: a save takes long enough to be interrupted inside.
  const auto regions = model_regions(2000);
  for (const int delay_ms : {0, 9, 31, 400}) {
    const auto dir = scratch_dir("killed");
    std::fflush(nullptr);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      try {
        auto store = std::make_shared<cohort::memory_store>();
        cohort_test::run_ranks(2, [&](int rank) {
          auto pg = cohort_test::make_gloo_group(store, rank, 2);
          cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero1});
          for (std::uint64_t step = 0; step < 100000; ++step)
            cohort::save_checkpoint(state, dir.string(), step, {.keep_last = 2});
        });
      } catch (...) {
        std::_Exit(1);
      }
      std::_Exit(0);
    }
    // Killed a little after its first checkpoint is committed: somewhere in a later save.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!cohort::newest_checkpoint(dir.string()) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));
    const auto newest = cohort::newest_checkpoint(dir.string());
    REQUIRE(newest.has_value());
    std::size_t partial = 0;
    for (const auto& entry : fs::directory_iterator(dir / ".cohort"))
      partial += entry.path().filename().string().rfind("staging-", 0) == 0;
    std::printf("killed %d ms after the first commit: newest %s, %zu partial directories left\n", delay_ms,
                fs::path(*newest).filename().c_str(), partial);
    INFO(*newest);
    CHECK(load_errors(*newest, 2, regions) == std::vector<std::string>(2));
    fs::remove_all(dir);
  }
}

namespace {

// An independent safetensors reader: the format as its specification states it (an 8-byte
// little-endian header length, a JSON header, the data), the JSON taken apart by hand.
struct safetensor {
  std::string dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;
};
std::map<std::string, safetensor> read_safetensors(const fs::path& path, std::string& data) {
  std::ifstream in(path, std::ios::binary);
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  std::uint64_t length = 0;
  for (int b = 7; b >= 0; --b) length = length << 8 | length_bytes[b];
  std::string header(length, '\0');
  in.read(header.data(), static_cast<std::streamsize>(length));
  data.assign(std::istreambuf_iterator<char>(in), {});
  std::map<std::string, safetensor> out;
  // {"name":{"dtype":"F64","shape":[N],"data_offsets":[B,E]},...,"__metadata__":{...}}
  for (std::size_t at = header.find("\"dtype\""); at != std::string::npos; at = header.find("\"dtype\"", at + 1)) {
    const std::size_t name_end = header.rfind("\":{", at);
    const std::size_t name_begin = header.rfind('"', name_end - 1) + 1;
    safetensor t;
    const std::size_t dtype_begin = header.find('"', at + 8) + 1;
    t.dtype = header.substr(dtype_begin, header.find('"', dtype_begin) - dtype_begin);
    for (std::size_t d = header.find("\"shape\":[", at) + 9; header[d] != ']'; d = header.find_first_of(",]", d)) {
      if (header[d] == ',') ++d;
      t.shape.push_back(std::stoull(header.substr(d)));
    }
    const std::size_t offsets = header.find("\"data_offsets\":[", at) + 16;
    t.begin = std::stoull(header.substr(offsets));
    t.end = std::stoull(header.substr(header.find(',', offsets) + 1));
    out[header.substr(name_begin, name_end - name_begin)] = t;
  }
  return out;
}

}  // namespace

TEST_CASE("a checkpoint of 4 ranks under zero2 consolidates into one safetensors file of the parameters",
          "[checkpoint][gloo][safetensors]") {
  const auto dir = scratch_dir("safetensors");
  const auto saved = run_all({.world = 4, .kind = strategy::zero2, .to = 5, .save_to = dir});
  const auto checkpoint = dir / "step-4";
  CHECK(cohort::verify_checkpoint(checkpoint.string()) == bytes_in(checkpoint));
  cohort::consolidate_checkpoint(checkpoint.string(), (dir / "model.safetensors").string());
  std::string data;
  const auto tensors = read_safetensors(dir / "model.safetensors", data);
  const auto regions = model_regions();
  REQUIRE(tensors.size() == regions.size());
  for (const auto& r : regions) {
    INFO(r.name);
    REQUIRE(tensors.count(r.name) == 1);
    const auto& t = tensors.at(r.name);
    CHECK(t.dtype == "F64");
    CHECK(t.shape == std::vector<std::uint64_t>{r.count});  // no shape given: 1-D
    REQUIRE(t.end - t.begin == r.count * sizeof(double));
    std::vector<double> values(r.count);
    std::memcpy(values.data(), data.data() + t.begin, t.end - t.begin);
    for (std::size_t j = 0; j < r.count; ++j) CHECK(values[j] == saved[0].parameters[r.offset + j]);
  }
  // Python's safetensors package, where installed, reads the same.
  if (std::system("python3 -c 'import safetensors, numpy' 2>/dev/null") == 0) {
    const std::string script = "python3 -c \"from safetensors.numpy import load_file; t = load_file('" +
                               (dir / "model.safetensors").string() +
                               "'); print(len(t), repr(float(t['embedding'][0])))\" > " + (dir / "py.txt").string();
    REQUIRE(std::system(script.c_str()) == 0);
    std::ifstream in(dir / "py.txt");
    std::size_t count = 0;
    double first = 0;
    in >> count >> first;
    CHECK(count == regions.size());
    CHECK(first == saved[0].parameters[0]);
  } else {
    WARN("Python's safetensors package is not installed: the independent C++ reader alone checked the file");
  }
  fs::remove_all(dir);
}

TEST_CASE("asynchronous saves while training goes on: committed once written, resumed at another world",
          "[checkpoint][gloo][async]") {
  const auto dir = scratch_dir("async");
  const auto whole = run_all({.world = 2, .kind = strategy::zero2, .to = 20});
  const auto saving =
      run_all({.world = 2, .kind = strategy::zero2, .to = 20, .save_to = dir, .scale = 1, .async_every = 4});
  CHECK(max_difference(saving[0].parameters, whole[0].parameters) == 0.0);  // saving changes nothing
  for (const int step : {3, 7, 11, 15, 19}) CHECK(fs::exists(dir / ("step-" + std::to_string(step)) / "manifest.json"));
  // Staging held the rank's state once: its file.
  CHECK(saving[0].staging_peak == fs::file_size(dir / "step-19" / "rank-00000.bin"));
  fs::remove_all(dir / "step-15");
  fs::remove_all(dir / "step-19");
  const auto resumed = run_all({.world = 3, .kind = strategy::zero3, .to = 20, .resume_from = dir});
  CHECK(resumed[0].loaded.step == 11);
  CHECK(max_difference(resumed[0].parameters, whole[0].parameters) < 1e-9);
  fs::remove_all(dir);
}

TEST_CASE("an asynchronous save of a larger state blocks training for the copy only", "[checkpoint][gloo][async]") {
  // About 9 MB at two ranks: the synchronous save against the time save() blocks.
  const auto dir = scratch_dir("async-time");
  const auto regions = model_regions(2000);
  std::vector<double> sync_seconds(2), blocked(2);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero1});
    sync_seconds[static_cast<std::size_t>(rank)] = cohort::save_checkpoint(state, dir.string(), 1).seconds;
    cohort::async_checkpointer saver(state);
    saver.save(dir.string(), 2);
    blocked[static_cast<std::size_t>(rank)] = saver.last_blocked_seconds();
    const auto committed = saver.wait();
    RANK_CHECK(committed && committed->step == 2);
  });
  std::printf("9 MB state at 2 ranks: synchronous save %.4f s, asynchronous save() blocked %.4f s\n", sync_seconds[0],
              blocked[0]);
  CHECK(cohort::newest_checkpoint(dir.string()) == (dir / "step-2").string());
  CHECK(cohort::verify_checkpoint((dir / "step-2").string()) > 0);
  fs::remove_all(dir);
}

TEST_CASE("an asynchronous save commits once every rank's file is durable, with no collective of the trainer's",
          "[checkpoint][gloo][async]") {
  const auto dir = scratch_dir("async-commit");
  const auto regions = model_regions(200);
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::int64_t> keys_before(3), keys_after(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero2});
    cohort::async_checkpointer saver(state);
    pg.barrier().wait();
    keys_before[static_cast<std::size_t>(rank)] = store->num_keys();
    pg.barrier().wait();
    saver.save(dir.string(), 5, {.block_bytes = 4096});
    // No save(), no wait(), no collective: rank 0's writer commits once every key is in.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (cohort::newest_checkpoint(dir.string()) != (dir / "step-5").string() &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    RANK_CHECK(cohort::newest_checkpoint(dir.string()) == (dir / "step-5").string());
    const auto agreed = saver.wait();
    RANK_CHECK(agreed && agreed->step == 5);
    pg.barrier().wait();
    keys_after[static_cast<std::size_t>(rank)] = store->num_keys();
  });
  CHECK(keys_after[0] == keys_before[0]);  // each rank's key deleted once agreed: the store does not grow
  CHECK(cohort::verify_checkpoint((dir / "step-5").string()) > 0);
  fs::remove_all(dir);
}

TEST_CASE("a staging bound below the state streams the state through it: the same checkpoint, within the bound",
          "[checkpoint][gloo][async]") {
  const auto dir = scratch_dir("async-bound");
  const auto regions = model_regions(500);
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::uint64_t> peak(2), file_bytes(2);
  constexpr std::size_t bound = 16 << 10, block = 4 << 10;
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero1});
    std::vector<double> initial(regions.back().offset + regions.back().count);
    for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = std::cos(0.3 * static_cast<double>(i));
    state.load_parameters(initial);
    cohort::save_checkpoint(state, (dir / "whole").string(), 1, {.block_bytes = block});
    cohort::async_checkpointer saver(state);
    saver.save((dir / "bounded").string(), 1, {.block_bytes = block, .staging_bytes = bound});
    saver.wait();
    peak[static_cast<std::size_t>(rank)] = saver.staging_peak_bytes();
    file_bytes[static_cast<std::size_t>(rank)] =
        fs::file_size(dir / "whole" / "step-1" / cohort::detail::checkpoint_file_name(rank));
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": file " << file_bytes[static_cast<std::size_t>(r)] << " bytes");
    CHECK(file_bytes[static_cast<std::size_t>(r)] > 4 * bound);
    CHECK(peak[static_cast<std::size_t>(r)] <= bound);
    std::ifstream a(dir / "whole" / "step-1" / cohort::detail::checkpoint_file_name(r), std::ios::binary),
        b(dir / "bounded" / "step-1" / cohort::detail::checkpoint_file_name(r), std::ios::binary);
    CHECK(std::string(std::istreambuf_iterator<char>(a), {}) == std::string(std::istreambuf_iterator<char>(b), {}));
  }
  CHECK(cohort::verify_checkpoint((dir / "bounded" / "step-1").string()) > 0);
  fs::remove_all(dir);
}

TEST_CASE("one rank's write fails: the next wait() raises on every rank naming that rank, the file and the errno",
          "[checkpoint][gloo][async][faults]") {
  const auto dir = scratch_dir("async-fails");
  const auto regions = model_regions(20);
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero2});
    cohort::async_checkpointer saver(state);
    saver.save(dir.string(), 3);
    // Rank 1's file is created in a directory that does not exist: a real ENOENT of a real open.
    cohort::detail::checkpoint_fault_injection::arm(saver, {.rank = 1, .cannot_create = true});
    saver.save(dir.string(), 7);
    try {
      saver.wait();
    } catch (const cohort::error& failure) {
      errors[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    const auto& message = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << message);
    CHECK(message.find("rank-00001.bin") != std::string::npos);
    CHECK(message.find(std::strerror(ENOENT)) != std::string::npos);
    if (r != 1) CHECK(message.find("rank 1 failed: cannot create") != std::string::npos);
    CHECK(message.find("errno " + std::to_string(ENOENT)) != std::string::npos);
  }
  CHECK(cohort::newest_checkpoint(dir.string()) == (dir / "step-3").string());  // the previous stays the newest
  fs::remove_all(dir);
}

TEST_CASE("a rank killed after writing its file but before publishing it leaves that step uncommitted",
          "[checkpoint][gloo][async][faults]") {
  const auto dir = scratch_dir("async-killed");
  const auto regions = model_regions(200);
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    try {
      auto store = std::make_shared<cohort::memory_store>();
      cohort_test::run_ranks(2, [&](int rank) {
        auto pg = cohort_test::make_gloo_group(store, rank, 2);
        cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero1});
        cohort::save_checkpoint(state, dir.string(), 2);
        cohort::async_checkpointer saver(state);
        // Rank 1's writer fsyncs its file, then holds its checksums back: the process dies first.
        cohort::detail::checkpoint_fault_injection::arm(saver, {.rank = 1, .hold_published = true});
        saver.save(dir.string(), 5);
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));  // rank 0 has published and waits
          ::raise(SIGKILL);
        }
        std::this_thread::sleep_for(std::chrono::seconds(60));
      });
    } catch (...) {
      std::_Exit(1);
    }
    std::_Exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(cohort::newest_checkpoint(dir.string()) == (dir / "step-2").string());
  // Both files of step 5 are there and complete, in a staging directory that is never loaded.
  std::size_t written = 0;
  for (const auto& entry : fs::directory_iterator(dir / ".cohort"))
    if (entry.path().filename().string().rfind("staging-5-", 0) == 0)
      for (int r = 0; r < 2; ++r)
        written += fs::exists(entry.path() / cohort::detail::checkpoint_file_name(r)) &&
                   fs::file_size(entry.path() / cohort::detail::checkpoint_file_name(r)) ==
                       fs::file_size(dir / "step-2" / cohort::detail::checkpoint_file_name(r));
  CHECK(written == 2);
  CHECK(!fs::exists(dir / "step-5"));
  fs::remove_all(dir);
}

TEST_CASE("an asynchronous save's copy overlaps the next step, whose step() waits for it: the checkpoint is the step's",
          "[checkpoint][gloo][async]") {
  // About 9 MB at two ranks through a 256 KiB pool: the copy outlasts save() by the write.
  const auto dir = scratch_dir("async-fence");
  const auto regions = model_regions(2000);
  const std::size_t n = regions.back().offset + regions.back().count;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::vector<double>> before(2), loaded(2), after(2);
  std::vector<double> blocked(2), waited(2);
  cohort_test::run_ranks(2, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero1});
    std::vector<double> initial(n);
    for (std::size_t i = 0; i < n; ++i) initial[i] = std::sin(0.1 * static_cast<double>(i));
    state.load_parameters(initial);
    before[r] = state.gather_parameters();
    cohort::async_checkpointer saver(state);
    saver.save(dir.string(), 1, {.block_bytes = 64 << 10, .staging_bytes = 256 << 10});
    blocked[r] = saver.last_blocked_seconds();
    for (std::size_t l = state.layer_count(); l-- > 0;) {  // the next step's backward, then its update
      auto layer = state.gather(l);
      for (std::size_t g = 0; g < regions.size(); ++g) {
        if (regions[g].layer != l) continue;
        auto gradient = state.gradient(g);
        std::fill(gradient.begin(), gradient.end(), 0.25);
        state.mark_ready(g);
      }
    }
    state.step();  // waits for the copy: the checkpoint holds the parameters before it
    waited[r] = state.checkpoint_fence().waited_seconds();
    after[r] = state.gather_parameters();
    RANK_CHECK(saver.wait().has_value());
    cohort::training_state<cohort::gloo, double> fresh(pg, regions, {.strategy = strategy::zero1});
    cohort::load_checkpoint(fresh, (dir / "step-1").string());
    loaded[r] = fresh.gather_parameters();
  });
  std::printf("9 MB state at 2 ranks through a 256 KiB pool: save() blocked %.4f s, step() waited %.4f s\n", blocked[0],
              waited[0]);
  CHECK(before[0] != after[0]);   // the step changed the parameters
  CHECK(loaded[0] == before[0]);  // and the checkpoint is of the state before it
  CHECK(loaded[1] == before[1]);
  fs::remove_all(dir);
}
