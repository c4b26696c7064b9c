// Ranks on simulated nodes (tests/multinode.hpp: network namespaces joined by a bridge, each
// with its own address, host name and /etc/hosts; two ranks per node, started with torchrun's
// variables): what a first multi-node run meets. Skipped, with the reason, where namespaces
// cannot be made (not root).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/launch.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cohort/run/atomic_write.hpp>
#include <cohort/run/guards.hpp>
#include <cohort/run/logging.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "../examples/mlp.hpp"
#include "multinode.hpp"
#include "support.hpp"

namespace {

using cohort_test::cluster;

std::unique_ptr<cluster> make_cluster(int nodes) {
  std::string why;
  auto made = cluster::make(nodes, why);
  if (!made) cohort_test::skip(why);
  return made;
}

// Skips the case once the cluster is deleted: skip() leaves the process at once, past every
// destructor, which would leave the namespaces behind.
[[noreturn]] void skip_without(std::unique_ptr<cluster>& nodes, const std::string& why) {
  nodes.reset();
  cohort_test::skip(why);
}

// torchrun's variables for `per_node` ranks on each node, rank 0 on node 0.
std::vector<cluster::rank_process> torchrun_ranks(cluster& nodes, int per_node) {
  std::vector<cluster::rank_process> ranks;
  const int count = static_cast<int>(nodes.nodes().size());
  for (int n = 0; n < count; ++n)
    for (int local = 0; local < per_node; ++local)
      ranks.push_back({n,
                       {{"RANK", std::to_string(n * per_node + local)},
                        {"WORLD_SIZE", std::to_string(count * per_node)},
                        {"LOCAL_RANK", std::to_string(local)},
                        {"LOCAL_WORLD_SIZE", std::to_string(per_node)},
                        {"GROUP_RANK", std::to_string(n)},
                        {"MASTER_ADDR", nodes.nodes()[0].address},
                        {"MASTER_PORT", "29400"}}});
  return ranks;
}

// Every node's /etc/hosts names every node by its address (a cluster set up well).
void hosts_name_every_node(cluster& nodes) {
  for (auto& n : nodes.nodes())
    for (const auto& other : nodes.nodes()) n.hosts.emplace_back(other.hostname, other.address);
}

cohort::gloo::options group_options(std::chrono::milliseconds timeout) {
  cohort::gloo::options opts;
  opts.timeout = timeout;
  if (const char* hostname = std::getenv("COHORT_TEST_HOSTNAME")) opts.hostname = hostname;
  return opts;
}

// A few steps of gradient descent on a quadratic whose gradient differs per rank; each rank
// checks its weights against the same steps computed here from every rank's gradient.
int train() {
  const auto env = cohort::launch_env::detect();
  auto store = cohort::connect_store(env);
  cohort::process_group<cohort::gloo> pg{store, env, group_options(std::chrono::seconds(10))};
  const auto gradient = [](int rank, const std::vector<double>& w, std::size_t i) {
    return (w[i] - (rank + 1.0) * static_cast<double>(i + 1)) * 0.5;
  };
  std::vector<double> w(8, 0.0), reference(8, 0.0);
  for (int step = 0; step < 5; ++step) {
    std::vector<double> g(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) g[i] = gradient(pg.rank(), w, i);
    pg.all_reduce(std::span<double>(g), cohort::op::avg).wait();
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= 0.5 * g[i];
    for (std::size_t i = 0; i < reference.size(); ++i) {
      double sum = 0;
      for (int r = 0; r < pg.size(); ++r) sum += gradient(r, reference, i);
      g[i] = sum / pg.size();
    }
    for (std::size_t i = 0; i < reference.size(); ++i) reference[i] -= 0.5 * g[i];
  }
  for (std::size_t i = 0; i < w.size(); ++i)
    if (std::fabs(w[i] - reference[i]) > 1e-9) return 1;
  pg.barrier().wait();
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("nodes whose names resolve to their addresses train with no interface named", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  const auto codes =
      cohort_test::wait_children(nodes->start(torchrun_ranks(*nodes, 2), train), std::chrono::seconds(60));
  REQUIRE(codes == std::vector<int>(4, 0));
}

// Debian's installer maps the host's own name to 127.0.1.1. Gloo listened there when no
// interface was named: the other nodes were refused or hung.
TEST_CASE("nodes whose own names resolve to 127.0.1.1 train with no interface named", "[multinode]") {
  auto nodes = make_cluster(3);
  for (auto& n : nodes->nodes()) {
    n.hosts.emplace_back(n.hostname, "127.0.1.1");
    for (const auto& other : nodes->nodes())
      if (other.hostname != n.hostname) n.hosts.emplace_back(other.hostname, other.address);
  }
  const auto codes =
      cohort_test::wait_children(nodes->start(torchrun_ranks(*nodes, 2), train), std::chrono::seconds(60));
  REQUIRE(codes == std::vector<int>(6, 0));
}

// A host name that resolves nowhere: Gloo's device creation looked it up (and, in some
// builds, crashed on the failed lookup).
TEST_CASE("nodes whose own names resolve nowhere train with no interface named", "[multinode]") {
  auto nodes = make_cluster(2);  // hosts files name only localhost
  const auto codes =
      cohort_test::wait_children(nodes->start(torchrun_ranks(*nodes, 2), train), std::chrono::seconds(60));
  REQUIRE(codes == std::vector<int>(4, 0));
}

// Node 0's ranks listen on an address node 1 has no route to. Node 1's ranks fail to
// connect at once; node 0's waited inside Gloo's connect for five times the timeout. Every
// rank must end within the timeout (3 s) and some slack, naming a rank and what it published.
TEST_CASE("an address a node cannot reach ends every rank's rendezvous within the timeout", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  const std::string unreachable =
      "10.230." + nodes->nodes()[0].address.substr(7, nodes->nodes()[0].address.rfind('.') - 7) + ".11";
  nodes->nodes()[0].extra_addresses.push_back(unreachable);
  auto ranks = torchrun_ranks(*nodes, 2);
  for (auto& rank : ranks)
    if (rank.node == 0) rank.env["COHORT_TEST_HOSTNAME"] = unreachable;
  const auto started = std::chrono::steady_clock::now();
  const auto codes = cohort_test::wait_children(
      nodes->start(ranks,
                   [] {
                     const auto env = cohort::launch_env::detect();
                     auto store = cohort::connect_store(env);
                     const auto start = std::chrono::steady_clock::now();
                     try {
                       cohort::process_group<cohort::gloo> pg{store, env, group_options(std::chrono::seconds(3))};
                     } catch (const cohort::error& failure) {
                       const double took = seconds_since(start);
                       std::fprintf(stderr, "rank %d after %.1f s: %s\n", env.rank, took, failure.what());
                       const std::string_view text = failure.what();
                       if (took > 3.0 + 4.0) return 4;
                       // Node 0's ranks wait for a peer on node 1; node 1's cannot connect to one on node 0.
                       const bool named = text.find("gloo.rendezvous") != std::string_view::npos &&
                                          text.find(" published 10.2") != std::string_view::npos;
                       return named ? 0 : 3;
                     }
                     return 1;
                   }),
      std::chrono::seconds(60));
  INFO("took " << seconds_since(started) << " s");
  REQUIRE(codes == std::vector<int>(4, 0));
}

namespace {

// A directory both the test and its ranks see (/tmp is shared: only /etc/hosts is bound).
std::string fresh_directory(const std::string& name) {
  const std::string path = "/tmp/cohort-multinode-" + std::to_string(::getpid()) + "-" + name;
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  return path;
}

bool wait_for_file(const std::string& path, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!std::filesystem::exists(path))
    if (std::chrono::steady_clock::now() > deadline)
      return false;
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return true;
}

// Two ranks per node, each told a fresh directory both sides see (COHORT_TEST_FLAGS): where
// the ranks leave their ready flags and the test its go.
std::vector<cluster::rank_process> ranks_with_flags(cluster& nodes, const std::string& name, std::string& flags) {
  flags = fresh_directory(name);
  auto ranks = torchrun_ranks(nodes, 2);
  for (auto& rank : ranks) rank.env["COHORT_TEST_FLAGS"] = flags;
  return ranks;
}

// In a rank: a group with a 3 s timeout whose failures surface at its next call, proven
// connected by one all-reduce.
cohort::process_group<cohort::gloo> connected_group(const cohort::launch_env& env) {
  auto opts = group_options(std::chrono::seconds(3));
  opts.on_async_error = cohort::async_error_handling::throw_on_next_call;
  cohort::process_group<cohort::gloo> pg{cohort::connect_store(env), env, opts};
  std::vector<float> data(1 << 10, 1.0f);
  pg.all_reduce(std::span<float>(data)).wait();
  return pg;
}

void flag_ready(const std::string& flags, int rank) { std::ofstream(flags + "/ready" + std::to_string(rank)).put('1'); }

// In the test: whether all `world` ranks flagged themselves ready in time.
bool all_ready(const std::string& flags, int world) {
  bool ready = true;
  for (int r = 0; r < world; ++r)
    ready = ready && wait_for_file(flags + "/ready" + std::to_string(r), std::chrono::seconds(30));
  return ready;
}

}  // namespace

// Node 1's link goes down between two calls (a partition: nothing closes, nothing arrives).
// Node 0's ranks must name ranks 2 and 3 unreachable (not "never issued"); node 1's ranks,
// cut off from the store on node 0, must say so themselves. Every rank within the group's
// timeout (3 s), the report's window (3 s) and slack.
namespace {

// `cut` partitions node 1 from node 0 once every rank has made one call.
void check_partition(cluster& nodes_ref, const std::function<void()>& cut) {
  auto* nodes = &nodes_ref;
  std::string flags;
  auto ranks = ranks_with_flags(*nodes, "partition", flags);
  auto children = nodes->start(ranks, [] {
    const auto env = cohort::launch_env::detect();
    const std::string flags = std::getenv("COHORT_TEST_FLAGS");
    auto pg = connected_group(env);
    std::vector<float> data(1 << 10, 1.0f);
    flag_ready(flags, env.rank);
    if (!wait_for_file(flags + "/go", std::chrono::seconds(30))) return 5;
    const auto start = std::chrono::steady_clock::now();
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      const double took = seconds_since(start);
      std::fprintf(stderr, "rank %d after %.1f s: %s\n", env.rank, took, failure.what());
      if (took > 3.0 + 3.0 + 4.0) return 4;
      const std::string_view text = failure.what();
      const bool named = env.rank < 2
                             ? text.find("ranks 2, 3 are unreachable during all_reduce #2") != text.npos
                             : text.find("cannot reach rank 0's store at " + env.master_addr + ":29400") != text.npos;
      return named ? 0 : 3;
    }
    return 1;
  });
  const bool ready = all_ready(flags, 4);
  if (ready) cut();
  std::ofstream(flags + "/go").put('1');
  const auto codes = cohort_test::wait_children(children, std::chrono::seconds(60));
  std::filesystem::remove_all(flags);
  REQUIRE(ready);
  REQUIRE(codes == std::vector<int>(4, 0));
}

}  // namespace

TEST_CASE("a partition names the unreachable ranks on one side and the store on the other", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  check_partition(*nodes, [&] { nodes->unplug(1); });
}

// The same partition with the link up and every packet to or from node 1 dropped (a
// firewall, or a switch that lost its way): no carrier change tells either side anything.
TEST_CASE("a partition by dropped packets names the same culprits on both sides", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string why;
  if (!nodes->can_drop(why)) skip_without(nodes, why);
  check_partition(*nodes, [&] {
    std::string failed;
    if (!nodes->drop(1, 1.0, failed)) std::fprintf(stderr, "could not partition: %s\n", failed.c_str());
  });
}

// Node 1 is cut off (every packet to and from it dropped) after its ranks connected to the
// store and before they create a group: the group's first store requests (its counter, then
// its rendezvous key) waited as long as the store's own timeout (300 s by default), not the
// group's. Every rank must end within the group's timeout (3 s) and slack: node 1's naming
// the store, node 0's the ranks that never arrived.
TEST_CASE("a store cut off before the rendezvous ends every rank within the group's timeout", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string why;
  if (!nodes->can_drop(why)) skip_without(nodes, why);
  std::string flags;
  auto ranks = ranks_with_flags(*nodes, "store-cut", flags);
  auto children = nodes->start(ranks, [] {
    const auto env = cohort::launch_env::detect();
    const std::string flags = std::getenv("COHORT_TEST_FLAGS");
    auto store = cohort::connect_store(env);
    flag_ready(flags, env.rank);
    if (!wait_for_file(flags + "/go", std::chrono::seconds(30))) return 5;
    const auto start = std::chrono::steady_clock::now();
    try {
      cohort::process_group<cohort::gloo> pg{store, env, group_options(std::chrono::seconds(3))};
    } catch (const cohort::error& failure) {
      const double took = seconds_since(start);
      std::fprintf(stderr, "rank %d after %.1f s: %s\n", env.rank, took, failure.what());
      if (took > 3.0 + 4.0) return 4;
      const std::string_view text = failure.what();
      const bool named = env.rank < 2 ? text.find("ranks 2, 3 never arrived at the rendezvous") != text.npos
                                      : text.find("store server at " + env.master_addr + ":29400") != text.npos;
      return named ? 0 : 3;
    }
    return 1;
  });
  const bool ready = all_ready(flags, 4);
  if (ready && !nodes->drop(1, 1.0, why)) std::fprintf(stderr, "could not cut node 1 off: %s\n", why.c_str());
  std::ofstream(flags + "/go").put('1');
  const auto codes = cohort_test::wait_children(children, std::chrono::seconds(60));
  std::filesystem::remove_all(flags);
  REQUIRE(ready);
  REQUIRE(codes == std::vector<int>(4, 0));
}

// Node 1 is killed (both its ranks, SIGKILL, mid-training): the kernel resets their
// connections. Node 0's ranks must name exactly ranks 2 and 3 as dead, within the timeout.
TEST_CASE("a killed node is named dead by the other node's ranks, and only it", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string flags;
  auto ranks = ranks_with_flags(*nodes, "killed", flags);
  auto children = nodes->start(ranks, [] {
    const auto env = cohort::launch_env::detect();
    const std::string flags = std::getenv("COHORT_TEST_FLAGS");
    auto pg = connected_group(env);
    std::vector<float> data(1 << 10, 1.0f);
    flag_ready(flags, env.rank);
    if (env.rank >= 2) {  // node 1 waits to be killed
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 6;
    }
    if (!wait_for_file(flags + "/go", std::chrono::seconds(30))) return 5;
    const auto start = std::chrono::steady_clock::now();
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      const double took = seconds_since(start);
      std::fprintf(stderr, "rank %d after %.1f s: %s\n", env.rank, took, failure.what());
      if (took > 3.0 + 3.0 + 4.0) return 4;
      const std::string_view text = failure.what();
      bool named = text.find("ranks 2, 3 died or exited during all_reduce #2") != text.npos;
      for (const char* wrong : {"rank 0 died", "rank 1 died", "ranks 0, 2, 3 died", "ranks 1, 2, 3 died",
                                "ranks 0, 1, 2, 3 died", "never issued", "unreachable"})
        named = named && text.find(wrong) == text.npos;
      return named ? 0 : 3;
    }
    return 1;
  });
  const bool ready = all_ready(flags, 4);
  if (ready) {
    ::kill(children[2], SIGKILL);
    ::kill(children[3], SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::ofstream(flags + "/go").put('1');
  const auto codes = cohort_test::wait_children(children, std::chrono::seconds(60));
  std::filesystem::remove_all(flags);
  REQUIRE(ready);
  REQUIRE(codes == std::vector<int>{0, 0, 128 + SIGKILL, 128 + SIGKILL});
}

// Per-node guards across real nodes: the node-local group holds this node's ranks only, and
// local_main_process_first runs the node's local main before the node's other ranks (each
// node's own file, as a per-node dataset cache would be).
TEST_CASE("node-local groups and local-main-first hold per simulated node", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string flags;
  auto ranks = ranks_with_flags(*nodes, "guards", flags);
  const auto codes = cohort_test::wait_children(
      nodes->start(ranks,
                   [] {
                     const auto env = cohort::launch_env::detect();
                     const std::string flags = std::getenv("COHORT_TEST_FLAGS");
                     auto store = cohort::connect_store(env);
                     cohort::process_group<cohort::gloo> pg{store, env, group_options(std::chrono::seconds(10))};
                     auto local = pg.node_local();
                     std::vector<int> mine{pg.rank()};
                     local.all_reduce(std::span<int>(mine)).wait();
                     const int first = pg.rank() - pg.local_rank();
                     if (local.size() != 2 || mine[0] != first + first + 1) return 2;
                     char host[64] = {};
                     ::gethostname(host, sizeof host - 1);
                     const std::string cache = flags + "/" + host;
                     bool ordered = true;
                     cohort::local_main_process_first(pg, [&] {
                       if (pg.local_rank() == 0)
                         std::ofstream(cache).put('1');
                       else
                         ordered = std::filesystem::exists(cache);
                     });
                     pg.barrier().wait();
                     return ordered ? 0 : 3;
                   }),
      std::chrono::seconds(60));
  std::filesystem::remove_all(flags);
  REQUIRE(codes == std::vector<int>(4, 0));
}

namespace {

// Hybrid sharding as a multi-node job uses it: parameters sharded inside each node (a group
// split by node, whose all-gathers and reduce-scatters stay on the node's loopback) and
// replicated across nodes (a group of the ranks with the same local rank, one per node:
// only the gradient shards' all-reduce crosses the link): training_state at zero3 with
// replicas. Adam on the examples' MLP; each
// node's first rank checks the full result against one process on the whole batch.
const std::vector<std::size_t> hybrid_widths{16, 48, 48, 4};
constexpr std::size_t hybrid_batch = 24;  // 6 samples per rank on 4 ranks
constexpr int hybrid_steps = 16;
constexpr double hybrid_lr = 1e-2;

cohort_examples::synthetic_data hybrid_data(const cohort_examples::mlp& model) {
  return cohort_examples::synthetic_data::make(hybrid_batch * hybrid_steps, model.input_width(), model.output_width(),
                                               22);
}

int train_hybrid() {
  const auto env = cohort::launch_env::detect();
  auto store = cohort::connect_store(env);
  cohort::process_group<cohort::gloo> pg{store, env, group_options(std::chrono::seconds(10))};
  const int node = env.node_rank();
  auto shards = pg.split(node, pg.local_rank());
  auto replicas = pg.split(pg.local_rank(), node);
  if (!shards || !replicas || shards->size() != env.local_world_size || replicas->size() != pg.size() / shards->size())
    return 2;
  // The node-local group really is this node's ranks: their global ranks, summed.
  std::vector<int> members{pg.rank()};
  shards->all_reduce(std::span<int>(members)).wait();
  const int first = node * env.local_world_size;
  if (members[0] != first + first + 1) return 2;

  const cohort_examples::mlp model(hybrid_widths);
  const auto data = hybrid_data(model);
  const auto sizes = model.parameter_sizes();
  std::vector<cohort::region> regions;  // W_l and b_l in layer l, one after the other
  std::size_t elements = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    regions.push_back({(t % 2 == 0 ? "W" : "b") + std::to_string(t / 2), elements, sizes[t], t / 2});
    elements += sizes[t];
  }
  cohort::training_state<cohort::gloo, float> state(
      *shards, regions, {.strategy = cohort::strategy::zero3, .adam = {.lr = hybrid_lr}, .prefetch = 1}, &*replicas);
  std::vector<std::vector<float>> tensors;
  for (auto n : sizes) tensors.emplace_back(n, 0.0f);
  model.initialize(std::vector<std::span<float>>(tensors.begin(), tensors.end()), 7);
  std::vector<float> initial;
  for (const auto& t : tensors) initial.insert(initial.end(), t.begin(), t.end());
  state.load_parameters(initial);
  std::vector<std::vector<float>> grads;
  for (auto n : sizes) grads.emplace_back(n);
  const std::size_t local = hybrid_batch / static_cast<std::size_t>(pg.size());
  for (int step = 0; step < hybrid_steps; ++step) {
    std::vector<cohort::training_state<cohort::gloo, float>::layer_view> layers;
    std::vector<std::span<float>> weights;
    for (std::size_t l = 0; l < model.layers(); ++l) {
      layers.push_back(state.gather(l));
      weights.push_back(layers.back().param(2 * l));
      weights.push_back(layers.back().param(2 * l + 1));
    }
    const std::size_t sample =
        static_cast<std::size_t>(step) * hybrid_batch + static_cast<std::size_t>(pg.rank()) * local;
    model.loss_and_gradients(weights, std::vector<std::span<float>>(grads.begin(), grads.end()),
                             std::span<const float>(data.inputs).subspan(sample * model.input_width()),
                             std::span<const float>(data.targets).subspan(sample * model.output_width()), local);
    layers.clear();
    for (std::size_t t = sizes.size(); t-- > 0;) {
      const auto gradient = state.gradient(t);
      std::copy(grads[t].begin(), grads[t].end(), gradient.begin());
      state.mark_ready(t);
    }
    state.step();
  }
  const auto flat = state.gather_parameters();
  std::vector<std::vector<float>> full;
  for (const auto& r : regions) full.emplace_back(flat.begin() + r.offset, flat.begin() + r.offset + r.count);
  int code = 0;
  if (shards->rank() == 0) {
    const auto single = cohort_examples::train_adam_single(model, data, hybrid_batch, hybrid_steps, hybrid_lr);
    const double worst = cohort_examples::max_difference(full, single);
    if (!(worst <= 1e-5)) {
      std::fprintf(stderr, "rank %d: hybrid sharding differs from one process by %.2e\n", pg.rank(), worst);
      code = 1;
    }
  }
  pg.barrier().wait();
  return code;
}

// Trains hybrid on 2 nodes x 2 ranks; every rank's exit code, and the seconds it took.
std::pair<std::vector<int>, double> run_hybrid(cluster& nodes, std::chrono::seconds limit) {
  const auto started = std::chrono::steady_clock::now();
  auto codes = cohort_test::wait_children(nodes.start(torchrun_ranks(nodes, 2), train_hybrid), limit);
  return {codes, seconds_since(started)};
}

}  // namespace

TEST_CASE("hybrid sharding per node on 2 nodes x 2 ranks equals one process", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  const auto [codes, took] = run_hybrid(*nodes, std::chrono::seconds(60));
  std::printf("hybrid sharding, 2 nodes x 2 ranks: %.2f s\n", took);
  REQUIRE(codes == std::vector<int>(4, 0));
}

// Faults on node 1's link, where the kernel has them: training must match as before, only
// slower, within the group's timeout on every call (no spurious timeouts).
TEST_CASE("delay of 2 ms and 50 ms on a node's link only slows hybrid training", "[multinode]") {
  for (const auto by : {std::chrono::milliseconds(2), std::chrono::milliseconds(50)}) {
    auto nodes = make_cluster(2);
    hosts_name_every_node(*nodes);
    std::string why;
    if (!nodes->delay(1, by, why)) skip_without(nodes, why);
    const auto [codes, took] = run_hybrid(*nodes, std::chrono::seconds(100));
    std::printf("hybrid sharding, %lld ms delay on node 1: %.2f s\n", static_cast<long long>(by.count()), took);
    INFO(by.count() << " ms delay, " << took << " s");
    REQUIRE(codes == std::vector<int>(4, 0));
  }
}

TEST_CASE("1% packet loss on a node's link only slows hybrid training", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string why;
  if (!nodes->drop(1, 0.01, why)) skip_without(nodes, why);
  const auto [codes, took] = run_hybrid(*nodes, std::chrono::seconds(100));
  std::printf("hybrid sharding, 1%% loss in and out of node 1: %.2f s\n", took);
  INFO(took << " s");
  REQUIRE(codes == std::vector<int>(4, 0));
}

TEST_CASE("a 1 Gbit/s limit on a node's link only slows hybrid training", "[multinode]") {
  auto nodes = make_cluster(2);
  hosts_name_every_node(*nodes);
  std::string why;
  if (!nodes->limit_rate(1, "1gbit", why)) skip_without(nodes, why);
  const auto [codes, took] = run_hybrid(*nodes, std::chrono::seconds(100));
  std::printf("hybrid sharding, 1 Gbit/s from node 1: %.2f s\n", took);
  INFO(took << " s");
  REQUIRE(codes == std::vector<int>(4, 0));
}
