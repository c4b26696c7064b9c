// The parameter fingerprint (cohort/parallel/fingerprint.hpp): the same parameters give the
// same digest at 1 to 4 ranks under every strategy, over the state's buffers and the trainer's,
// and hybrid 2 x 2, equal to the definition computed here from the flat buffer; one element that
// only one rank holds changes it on every rank; and a checkpoint's digest (what cohort-ckpt
// inspect prints) is the live state's, for fp32 and for bfloat16 parameters kept as fp32
// masters, stays the same once the checkpoint is loaded at another world size and strategy, and
// is what Python's hashlib makes of the checkpoint's safetensors export by the definition;
// a digest asked for on one rank alone fails on both, named, within the group's timeout. Real
// ranks: threads with Gloo contexts over loopback.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/parallel/checkpoint.hpp>
#include <cohort/parallel/fingerprint.hpp>
#include <cohort/parallel/training_state.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "checkpoint_fixtures.hpp"
#include "fingerprint_fixtures.hpp"
#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;

// A region of two chunks (300,007 floats: 1 MiB and 151,452 bytes), declared first though it
// lies last in the buffer; small stacked tensors (37 and 5 elements: no world of 2 to 4 divides
// them) in layers 1 to 3; then a region of exactly 1 MiB, one whole chunk.
std::vector<region> model_regions() {
  std::vector<region> regions{{"embedding", 126 + 262144, 300007, 0, true, 1.0}};
  const auto stacked = cohort::stacked_regions({{"w", 37, true}, {"b", 5, false}}, 3, 1, 0);
  regions.insert(regions.end(), stacked.begin(), stacked.end());
  regions.push_back({"head", 126, 262144, 4, true, 1.0});
  return regions;
}
constexpr std::size_t model_elements = 126 + 262144 + 300007;

template <class P>
std::vector<P> initial_parameters() {
  std::vector<P> flat(model_elements);
  for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = P(0.5F * std::sin(0.013F * static_cast<float>(i)));
  return flat;
}

cohort::training_options options_for(strategy kind) {
  cohort::training_options options;
  options.strategy = kind;
  options.bucket_bytes = 64 << 10;  // several buckets and ranges
  options.first_bucket_bytes = 4 << 10;
  return options;
}

// One step of the state's optimizer: the forward's gathers, then the backward writes every
// region's gradient (the same on every rank) and marks it.
template <class State>
void train_one_step(State& state) {
  using G = std::remove_reference_t<decltype(state.gradient(0)[0])>;
  const auto& regions = state.regions();
  for (std::size_t l = 0; l < state.layer_count(); ++l) (void)state.gather(l);
  for (std::size_t l = state.layer_count(); l-- > 0;) {
    const auto layer = state.gather(l);
    for (std::size_t r = 0; r < regions.size(); ++r) {
      if (regions[r].layer != l) continue;
      auto gradient = state.gradient(r);
      for (std::size_t j = 0; j < gradient.size(); ++j)
        gradient[j] = G(0.01F * static_cast<float>((regions[r].offset + j) % 7) - 0.03F);
      state.mark_ready(r);
    }
  }
  (void)state.step();
}

std::string label(strategy kind, int world, bool adopted) {
  return std::string(cohort::to_string(kind)) + " at " + std::to_string(world) + " ranks, " +
         (adopted ? "adopted buffers" : "owned buffers");
}

}  // namespace

TEST_CASE("the same parameters give the same digest at 1 to 4 ranks under ddp, zero1, zero2 and zero3",
          "[fingerprint][gloo]") {
  const auto regions = model_regions();
  const auto flat = initial_parameters<float>();
  const std::string expected = cohort_test::expected_parameter_sha256(flat, regions);
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const int world : {1, 2, 3, 4})
      for (const bool adopted : {false, true}) {
        std::vector<std::string> digests(static_cast<std::size_t>(world));
        auto store = std::make_shared<cohort::memory_store>();
        cohort_test::run_ranks(world, [&](int rank) {
          auto pg = cohort_test::make_gloo_group(store, rank, world);
          std::vector<float> parameters = flat, gradients(flat.size());
          std::optional<cohort::training_state<cohort::gloo>> state;
          if (adopted) {
            state.emplace(pg, std::span<float>(parameters), std::span<float>(gradients), regions, options_for(kind));
          } else {
            state.emplace(pg, regions, options_for(kind));
            state->load_parameters(flat);
          }
          digests[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(*state);
        });
        for (int rank = 0; rank < world; ++rank) {
          INFO(label(kind, world, adopted) << ", rank " << rank);
          CHECK(digests[static_cast<std::size_t>(rank)] == expected);
        }
      }
}

TEST_CASE("hybrid sharding 2 x 2 gives the digest of one process on every rank", "[fingerprint][gloo][hybrid]") {
  const auto regions = model_regions();
  const auto flat = initial_parameters<float>();
  const std::string expected = cohort_test::expected_parameter_sha256(flat, regions);
  for (const strategy kind : {strategy::zero1, strategy::zero3}) {
    std::vector<std::string> digests(4);
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(4, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 4);
      auto shards = pg.split(rank / 2, rank);
      auto replicas = pg.split(rank % 2, rank);
      cohort::training_state<cohort::gloo> state(*shards, regions, options_for(kind), &*replicas);
      state.load_parameters(flat);
      digests[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(state);
    });
    for (std::size_t rank = 0; rank < 4; ++rank) {
      INFO(cohort::to_string(kind) << ", rank " << rank);
      CHECK(digests[rank] == expected);
    }
  }
}

TEST_CASE("one element of rank 1's zero3 shard, changed there alone, changes the digest on every rank",
          "[fingerprint][gloo]") {
  constexpr int world = 3;
  const auto regions = model_regions();
  const auto flat = initial_parameters<float>();
  std::vector<std::string> before(world), after(world);
  std::size_t changed = 0;  // the element rank 1 changed, in the flat buffer
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    auto options = options_for(strategy::zero3);
    options.trainer_optimizer = true;  // owned_spans(): this rank's shard, writable
    cohort::training_state<cohort::gloo> state(pg, regions, options);
    state.load_parameters(flat);
    before[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(state);
    if (rank == 1) {
      // The largest piece of rank 1's shard: a chunk of a range, which no other rank holds.
      const auto& spans = state.owned_spans();
      const auto largest = std::max_element(spans.begin(), spans.end(), [](const auto& a, const auto& b) {
        return a.parameters.size() < b.parameters.size();
      });
      RANK_CHECK(largest->parameters.size() > static_cast<std::size_t>(world));
      largest->parameters[0] += 1.0F;
      changed = largest->offset;
    }
    after[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(state);
  });
  auto altered = flat;
  altered[changed] += 1.0F;
  const std::string expected = cohort_test::expected_parameter_sha256(altered, regions);
  // The element's fingerprint chunk is hashed by another rank than 1, which saw it only
  // through the gather: the embedding's first chunk (fingerprint chunk 0, rank 0's).
  REQUIRE(changed >= regions[0].offset);
  REQUIRE((changed - regions[0].offset) * sizeof(float) < std::size_t{1} << 20);
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    CHECK(before[static_cast<std::size_t>(rank)] == cohort_test::expected_parameter_sha256(flat, regions));
    CHECK(after[static_cast<std::size_t>(rank)] != before[static_cast<std::size_t>(rank)]);
    CHECK(after[static_cast<std::size_t>(rank)] == expected);
  }
}

TEST_CASE("parameter_sha256 inside join()'s loop is refused at once, before it meets a joined rank's agreement",
          "[fingerprint][gloo][faults]") {
  const auto regions = model_regions();
  const auto flat = initial_parameters<float>();
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo> state(pg, regions, options_for(strategy::ddp));
    state.load_parameters(flat);
    const int batches = rank == 0 ? 2 : 1;  // rank 1 has joined (it answers) at rank 0's second step
    const auto train = [&] {
      state.join([&] {
        for (int batch = 0; batch < batches; ++batch) {
          train_one_step(state);
          if (batch == 1) (void)cohort::parameter_sha256(state);
        }
      });
    };
    if (rank == 0)
      RANK_CHECK_THROWS(cohort::error, train(), "parameter_sha256: called inside join()'s loop");
    else  // in the agreement, told by the group that rank 0 left (as when a join's loop throws)
      RANK_CHECK_THROWS(cohort::error, train(), "");
  });
}

TEMPLATE_TEST_CASE("a checkpoint's digest is the live state's, and the state's once loaded at another world size",
                   "[fingerprint][checkpoint][gloo]", float, cohort::bfloat16) {
  using P = TestType;
  const auto regions = model_regions();
  const auto dir =
      cohort_test::checkpoint_scratch(std::string("fingerprint-") + std::string(cohort::to_string(cohort::dtype_v<P>)));
  std::vector<std::string> live(2), loaded(3);
  std::string saved_path;
  {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      cohort::training_state<cohort::gloo, P> state(pg, regions, options_for(strategy::zero3));
      state.load_parameters(initial_parameters<P>());
      train_one_step(state);  // masters no longer what the parameters were loaded as
      const auto saved = cohort::save_checkpoint(state, dir.string(), 1);
      if (rank == 0) saved_path = saved.path;
      live[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(state);
    });
  }
  // What cohort-ckpt inspect prints as `parameters sha256`.
  const std::string from_checkpoint = cohort::checkpoint_parameter_sha256(saved_path);
  {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(3, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 3);
      cohort::training_state<cohort::gloo, P> state(pg, regions, options_for(strategy::ddp));
      (void)cohort::load_checkpoint(state, saved_path);
      loaded[static_cast<std::size_t>(rank)] = cohort::parameter_sha256(state);
    });
  }
  CHECK(live[0] != cohort_test::expected_parameter_sha256(initial_parameters<P>(), regions));  // the step changed them
  for (const auto& digest : live) CHECK(digest == from_checkpoint);
  for (const auto& digest : loaded) CHECK(digest == from_checkpoint);
  // cohort-ckpt itself, where it was built: its last line, for the checkpoint's directory.
  if (const auto tool = cohort_test::run_ckpt_tool("inspect " + dir.string())) {
    CHECK(tool->second == 0);
    CHECK(tool->first.ends_with("\nparameters sha256 " + from_checkpoint + "\n"));
  }
  // The definition as the header writes it in Python (hashlib alone), over the checkpoint's
  // safetensors export: the regions as declared, their bytes as stored.
  if (std::is_same_v<P, float> && std::system("python3 -c pass 2>/dev/null") == 0) {
    const auto exported = dir / "model.safetensors", script = dir / "digest.py", result = dir / "digest.txt";
    cohort::consolidate_checkpoint(saved_path, exported.string());
    std::ofstream(script) << R"(import hashlib, json, struct, sys
data = open(sys.argv[1], "rb").read()
(length,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + length])
digests = b""
for begin, end in sorted(entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"):
    region = data[8 + length + begin:8 + length + end]
    digests += b"".join(hashlib.sha256(region[at:at + 2**20]).digest() for at in range(0, len(region), 2**20))
print(hashlib.sha256(digests).hexdigest())
)";
    REQUIRE(std::system(("python3 " + script.string() + " " + exported.string() + " > " + result.string()).c_str()) ==
            0);
    std::string from_python;
    std::ifstream(result) >> from_python;
    CHECK(from_python == from_checkpoint);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a digest asked for on rank 0 alone fails on every rank within seconds, naming it, never a digest",
          "[fingerprint][gloo]") {
  const auto regions = model_regions();
  const auto flat = initial_parameters<float>();
  for (const strategy kind : {strategy::ddp, strategy::zero3}) {
    std::vector<std::string> errors(2);
    auto store = std::make_shared<cohort::memory_store>();
    const auto started = std::chrono::steady_clock::now();
    cohort_test::run_ranks(2, [&](int rank) {
      cohort::gloo::options quick;
      quick.timeout = std::chrono::seconds(2);  // the failure's bound: the test's length
      cohort_test::gloo_group pg(store, cohort::launch_env::explicit_ranks(rank, 2), quick);
      cohort::training_state<cohort::gloo> state(pg, regions, options_for(kind));
      state.load_parameters(flat);
      try {
        if (rank == 0)
          (void)cohort::parameter_sha256(state);  // printed on rank 0 only: a common slip
        else
          train_one_step(state);
      } catch (const cohort::error& failure) {
        errors[static_cast<std::size_t>(rank)] = failure.what();
      }
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    INFO(cohort::to_string(kind) << ": " << errors[0] << " | " << errors[1]);
    // Named on both ranks: at zero3 by the evaluation's agreement, under ddp (whose gathers are
    // no collectives) by the digests' all-reduce's own label.
    const std::string named = kind == strategy::zero3 ? "entered evaluation() (sampling or evaluating) alone"
                                                      : "(int64 x 36, sum) [parameter_sha256]";
    CHECK(errors[0].find(named) != std::string::npos);
    CHECK(errors[1].find(named) != std::string::npos);
    CHECK(seconds < 10);
  }
}
