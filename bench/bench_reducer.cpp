// Data parallelism on a host engine, side by side with PyTorch, in A/B rounds.
//
// ResNet-50's gradient set (161 tensors, 25.6 M fp32 parameters) on Gloo ranks (threads of
// this process) and a simulated backward: per layer, a share of the compute time in proportion
// to its size, then its gradient written, last layer first. Every comparison is a pair of
// sides measured in A/B rounds (bench/ab_rounds.hpp: A B B A per round, every sample printed,
// the median of the rounds' ratios with its min-max spread), in each of two kinds of compute:
// `spin` busy-waits (a CPU trainer: the backward occupies the cores the communication needs
// too) and `sleep` idles (a GPU trainer, whose host thread only launches kernels).
//
// PyTorch's side is bench/peers/torch_ddp.py, a long-lived peer (DDP over Gloo, same shapes,
// same simulated backward) that this program drives sample by sample through a pipe, so that
// its samples and cohort's alternate within the same rounds; while one side runs, the other
// waits idle. --compute-ms is what the whole backward takes alone, gradient writes and
// framework included: each side calibrates its busy time until its own backward alone meets
// it (autograd and AccumulateGrad cost PyTorch's side time of its own), so the steps compare
// like for like.
//
// The pairs (--pairs picks some; targets from issue 36, and issue 33's for the adopted path):
//   raw-avg           one all-reduce of every gradient, average against sum (<= 1.15)
//   raw-torch         the same sum, cohort against PyTorch's dist.all_reduce
//   gradients-torch   the gradient-only step (the backward, its buckets all-reduced as it
//                     goes; the state's step measures the norm and leaves the update to the
//                     trainer) against DDP with gradient_as_bucket_view (<= 0.90)
//   gradients-serial  that step overlapped against the backward followed by the reduction (<= 1)
//   step-torch        a whole step, training_state ddp with AdamW and clipping at 1.0, against
//                     DDP (bucket views) + torch.optim.AdamW(foreach) + clip_grad_norm_ (<= 0.90)
//   step-serial       the whole step overlapped against not (<= 1)
//   zero1-torch       zero1 / zero2 against DDP + ZeroRedundancyOptimizer(AdamW)
//   zero2-torch
//   zero1-ddp         zero1 / zero2 against ddp, whole steps (<= 1)
//   zero2-ddp
//   zero2-serial      zero2 overlapped against not (<= 1)
//   adopted-ddp       the adopting constructor over the trainer's own buffers (which the
//   adopted-zero2     trainer zeroes itself) against the state's own buffers (<= 1.05: adopting
//                     costs nothing; at zero2 it is faster, the owned state's pooled buffers
//                     being zeroed on the Gloo worker behind the reductions)
//   reproducible-ddp  training_options::reproducible (M = the ranks: one micro-step each, the
//   reproducible-zero2 partials all-to-all'd and summed in the canonical order, the exact
//                     norm) against the default, whole steps (<= 1.15, issue 42)
//   zero3-p0          zero3 (units gathered in the forward and again in the backward) at
//   zero3-p1          prefetch 0, 1, 2 against ddp's whole step (<= 1.30)
//   zero3-p2
// --units blocks (the default) makes each of ResNet-50's blocks a unit (a layer of the state:
// the stem, the 16 bottlenecks, the classifier), as FSDP's auto-wrap by module would; --units
// tensors makes every tensor its own (161 gathers each way at zero3).
//
// --forward-ms adds a simulated forward to every whole step, before its backward, on both sides
// (no calibration: a sleep or spin of that length, shared by the tensors): what zero3's forward
// gathers hide behind in a real model (default 0, a step of backward and update only).
//
// --reductions-in-flight sets cohort's training_options::reductions_in_flight (default: the
// option's own, 2) on every side: how many bucket reductions a host backward may leave in
// flight, each holding a new bucket buffer, before it waits for the oldest (zero2, zero3).
//
//   bench_reducer [--ranks 2] [--iterations 4] [--rounds 3] [--compute-ms 120] [--forward-ms 0]
//                 [--compute-mode spin|sleep|both] [--units blocks|tensors] [--pairs a,b,...]
//                 [--reductions-in-flight N] [--json FILE] [--torch-peer bench/peers/torch_ddp.py]
//                 [--python python3]
#include <cohort/comm/gloo.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/store.hpp>
#include <cohort/run/run_ranks.hpp>
#include <cohort/tools/detail/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../examples/command_line.hpp"
#include "ab_rounds.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using group = cohort::process_group<cohort::gloo>;
using state_type = cohort::training_state<cohort::gloo>;
using cohort::strategy;
using cohort::detail::json;

struct tensor_shape {
  std::string name;
  std::size_t count;
  std::size_t block;  // ResNet-50's module it belongs to: stem 0, bottlenecks 1-16, classifier 17
};

// torchvision's resnet50 parameters in declaration order: conv weights (no bias), batch-norm
// weight and bias, and the classifier.
std::vector<tensor_shape> resnet50() {
  std::vector<tensor_shape> shapes;
  std::size_t block = 0;
  auto conv = [&](const std::string& name, std::size_t out, std::size_t in, std::size_t k) {
    shapes.push_back({name + ".weight", out * in * k * k, block});
  };
  auto bn = [&](const std::string& name, std::size_t channels) {
    shapes.push_back({name + ".weight", channels, block});
    shapes.push_back({name + ".bias", channels, block});
  };
  conv("conv1", 64, 3, 7);
  bn("bn1", 64);
  std::size_t in = 64;
  const std::size_t widths[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const std::size_t width = widths[stage];
    for (int b = 0; b < blocks[stage]; ++b) {
      ++block;
      const std::string prefix = "layer" + std::to_string(stage + 1) + "." + std::to_string(b) + ".";
      conv(prefix + "conv1", width, in, 1);
      bn(prefix + "bn1", width);
      conv(prefix + "conv2", width, width, 3);
      bn(prefix + "bn2", width);
      conv(prefix + "conv3", width * 4, width, 1);
      bn(prefix + "bn3", width * 4);
      if (b == 0) {
        conv(prefix + "downsample.0", width * 4, in, 1);
        bn(prefix + "downsample.1", width * 4);
      }
      in = width * 4;
    }
  }
  ++block;
  shapes.push_back({"fc.weight", 1000 * 2048, block});
  shapes.push_back({"fc.bias", 1000, block});
  return shapes;
}

double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

// User + system CPU time of the whole process (every rank's threads, Gloo's I/O threads).
double process_cpu_ms() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto ms = [](const timeval& t) { return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_usec) / 1e3; };
  return ms(usage.ru_utime) + ms(usage.ru_stime);
}

int usable_cores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

struct settings {
  int ranks = 2;
  int iterations = 4;  // steps per sample (its median)
  int rounds = 3;
  double compute_ms = 120;
  double forward_ms = 0;                    // a simulated forward before the backward, every whole step alike
  std::optional<int> reductions_in_flight;  // cohort's sides; unset: the option's default
  std::vector<bool> modes{false, true};     // sleep? spin first
  bool blocks = true;                       // --units
  std::vector<std::string> pairs;           // empty: all
  std::string json_path;
  std::string torch_peer;
  std::string python = "python3";
};

// --- the PyTorch peer, driven through its standard input ----------------------------------------
class torch_peer {
 public:
  // Starts `python peer --serve`; unavailable() says why when it could not (no torch: the
  // peer exits with status 77 at once).
  torch_peer(const settings& s) {
    int to_peer[2], from_peer[2];
    if (::pipe2(to_peer, O_CLOEXEC) != 0 || ::pipe2(from_peer, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    const std::string ranks = std::to_string(s.ranks), compute = std::to_string(s.compute_ms),
                      forward = std::to_string(s.forward_ms), iterations = std::to_string(s.iterations);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(to_peer[0], 0);
      ::dup2(from_peer[1], 1);
      ::execlp(s.python.c_str(), s.python.c_str(), s.torch_peer.c_str(), "--serve", "--ranks", ranks.c_str(),
               "--compute-ms", compute.c_str(), "--forward-ms", forward.c_str(), "--iterations", iterations.c_str(),
               static_cast<char*>(nullptr));
      std::perror("exec of the PyTorch peer");
      ::_exit(127);
    }
    ::close(to_peer[0]);
    ::close(from_peer[1]);
    in_ = to_peer[1];
    out_ = ::fdopen(from_peer[0], "r");
  }
  torch_peer(const torch_peer&) = delete;
  torch_peer& operator=(const torch_peer&) = delete;
  ~torch_peer() {
    if (in_ >= 0) {
      (void)!::write(in_, "quit\n", 5);
      ::close(in_);
    }
    if (out_) std::fclose(out_);
    if (pid_ > 0) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  bool available() const { return !failed_; }
  const std::string& failure() const { return failure_; }

  // One command, its reply (null once the peer has failed).
  json ask(const std::string& command) {
    if (failed_) return {};
    const std::string line = command + "\n";
    if (::write(in_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return fail("the pipe closed");
    char buffer[65536];
    while (std::fgets(buffer, sizeof buffer, out_)) {
      const std::string text = buffer;
      if (text.rfind("reply ", 0) != 0) {
        std::fputs(("  [peer] " + text).c_str(), stdout);
        continue;
      }
      json reply = cohort::detail::parse_json(text.substr(6));
      if (const json* error = reply.find("error")) return fail(error->as_string());
      if (const json* version = reply.find("torch_version")) version_ = version->as_string();
      return reply;
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return fail(WIFEXITED(status) && WEXITSTATUS(status) == 77 ? "torch is not installed"
                                                               : "it exited (status " + std::to_string(status) + ")");
  }
  const std::string& version() const { return version_; }

 private:
  json fail(const std::string& why) {
    failed_ = true;
    failure_ = why;
    return {};
  }
  pid_t pid_ = -1;
  int in_ = -1;
  std::FILE* out_ = nullptr;
  bool failed_ = false;
  std::string failure_, version_;
};

// --- the pairs ------------------------------------------------------------------------------------
struct pair_spec {
  const char* key;
  const char* what;
  const char* a;
  const char* b;
  std::optional<double> at_most = {};
  std::optional<double> at_least = {};
};

const std::vector<pair_spec>& all_pairs() {
  static const std::vector<pair_spec> pairs = {
      {"raw-avg", "one all-reduce of every gradient: average against sum", "avg", "sum", 1.15},
      {"raw-torch", "one all-reduce of every gradient (sum): cohort against PyTorch", "sum", "torch raw_sum"},
      {"gradients-torch", "gradient-only step, overlapped: cohort ddp against DDP with bucket views", "gradients",
       "torch ddp_views", 0.90},
      {"gradients-serial", "gradient-only step: overlapped against the backward, then the reduction", "gradients",
       "gradients serial", 1.0},
      {"step-torch", "whole step: ddp + AdamW + clipping against DDP + AdamW(foreach) + clip_grad_norm_", "ddp",
       "torch ddp_adamw", 0.90},
      {"step-serial", "whole step, ddp: overlapped against not", "ddp", "ddp serial", 1.0},
      {"zero1-torch", "whole step: zero1 against DDP + ZeroRedundancyOptimizer(AdamW)", "zero1", "torch ddp_zero"},
      {"zero2-torch", "whole step: zero2 against DDP + ZeroRedundancyOptimizer(AdamW)", "zero2", "torch ddp_zero"},
      {"zero1-ddp", "whole step: zero1 against ddp", "zero1", "ddp", 1.0},
      {"zero2-ddp", "whole step: zero2 against ddp", "zero2", "ddp", 1.0},
      {"zero2-serial", "whole step, zero2: overlapped against not", "zero2", "zero2 serial", 1.0},
      {"adopted-ddp", "whole step, ddp: the trainer's buffers adopted against the state's own", "ddp adopted", "ddp",
       1.05},
      {"adopted-zero2", "whole step, zero2: the trainer's buffers adopted against the state's own", "zero2 adopted",
       "zero2", 1.05},
      {"reproducible-ddp", "whole step, ddp: reproducible against the default", "ddp reproducible", "ddp", 1.15},
      {"reproducible-zero2", "whole step, zero2: reproducible against the default", "zero2 reproducible", "zero2",
       1.15},
      {"zero3-p0", "whole step: zero3 (prefetch 0) against ddp", "zero3 prefetch 0", "ddp", 1.30},
      {"zero3-p1", "whole step: zero3 (prefetch 1) against ddp", "zero3 prefetch 1", "ddp", 1.30},
      {"zero3-p2", "whole step: zero3 (prefetch 2) against ddp", "zero3 prefetch 2", "ddp", 1.30},
  };
  return pairs;
}

bool is_torch(const std::string& side) { return side.rfind("torch ", 0) == 0; }

// What one side is, parsed from its name: "ddp", "zero2 adopted", "gradients serial", ...
struct side_kind {
  strategy kind = strategy::ddp;
  bool adopted = false;
  bool serial = false;
  bool gradients_only = false;  // trainer_optimizer with nothing to update: the reduction and the norm
  bool reproducible = false;
  int prefetch = 1;
};

side_kind parse_side(const std::string& name) {
  side_kind s;
  std::istringstream words(name);
  std::string word;
  words >> word;
  if (word == "gradients") {
    s.gradients_only = s.adopted = true;
  } else if (const auto parsed = cohort::parse_strategy(word)) {
    s.kind = *parsed;
  } else {
    throw std::runtime_error("unknown side " + name);
  }
  while (words >> word) {
    if (word == "adopted") s.adopted = true;
    if (word == "serial") s.serial = true;
    if (word == "reproducible") s.reproducible = true;
    if (word == "prefetch") words >> s.prefetch;
  }
  return s;
}

struct pair_result {
  std::string mode, key;
  cohort_bench::ab_result rounds;
  double a_cpu_ms = 0, b_cpu_ms = 0;  // median CPU per step over the samples (all ranks)
};

struct mode_result {
  std::string mode;
  double compute_ms = 0, budget_ms = 0;  // cohort's backward alone, and its busy share
  json torch_compute;                    // the peer's calibration
  std::vector<pair_result> pairs;
};

class bench {
 public:
  bench(const settings& s) : settings_(s), shapes_(resnet50()) {
    for (const auto& shape : shapes_) total_ += shape.count;
    // Units: the state's layers. A unit's tensors are consecutive in declaration order.
    for (std::size_t t = 0, offset = 0; t < shapes_.size(); offset += shapes_[t++].count) {
      const std::size_t unit = s.blocks ? shapes_[t].block : t;
      regions_.push_back({shapes_[t].name, offset, shapes_[t].count, unit});
      if (units_.size() <= unit) units_.resize(unit + 1);
      units_[unit].push_back(t);
    }
  }

  std::size_t tensors() const { return shapes_.size(); }
  std::size_t parameters() const { return total_; }
  std::size_t units() const { return units_.size(); }

  std::vector<mode_result> run(torch_peer* peer) {
    std::vector<mode_result> results;
    cohort::run_ranks(settings_.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::gloo::options options;
      options.timeout = std::chrono::minutes(10);  // a rank waits while the peer runs its samples
      group pg(store, env, options);
      rank_context me{pg, env.rank == 0 ? peer : nullptr};
      for (const bool sleep : settings_.modes) {
        me.sleep = sleep;
        mode_result mode = measure_mode(me);
        if (env.rank == 0) results.push_back(std::move(mode));
      }
    });
    return results;
  }

 private:
  // One rank's thread: its group, and (rank 0) the peer.
  struct rank_context {
    group& pg;
    torch_peer* peer;
    bool sleep = false;
    double budget_ms = 0;  // per-step busy time the layers share (calibrated; rank 0's for all)
    bool leader() const { return pg.rank() == 0; }
  };

  // Tensor t's share of `total_ms` of compute (spun or slept, by the mode).
  void spend(const rank_context& me, std::size_t t, double total_ms) const {
    const auto share = std::chrono::nanoseconds(static_cast<std::int64_t>(
        total_ms * 1e6 * static_cast<double>(shapes_[t].count) / static_cast<double>(total_)));
    if (me.sleep) {
      std::this_thread::sleep_for(share);
    } else {
      const auto until = clock_type::now() + share;
      while (clock_type::now() < until) {}
    }
  }
  // One layer's share of the backward: its share of the busy time, then its gradient written.
  void layer_backward(const rank_context& me, std::size_t t, std::span<float> gradient) const {
    spend(me, t, me.budget_ms);
    std::fill(gradient.begin(), gradient.end(), 1e-3f * static_cast<float>(t % 7));
  }

  struct sample_value {
    double ms = 0, cpu_ms = 0;
  };
  // Rank 0's median over --iterations steps, every rank starting each together, and the
  // process's CPU per step (all ranks: they are threads of this process).
  sample_value timed(rank_context& me, const std::function<void()>& step, int iterations = 0) const {
    std::vector<double> times, cpu;
    for (int i = 0; i < (iterations > 0 ? iterations : settings_.iterations); ++i) {
      me.pg.barrier().wait();
      const double cpu_start = process_cpu_ms();
      const auto start = clock_type::now();
      step();
      times.push_back(ms_since(start));
      cpu.push_back(process_cpu_ms() - cpu_start);
    }
    return {cohort_bench::median_of(times), cohort_bench::median_of(cpu)};
  }

  // Sets the busy time so that the backward alone takes --compute-ms (rank 0's median
  // decides for every rank): up to 12 rounds, each moving the budget by the miss of the best
  // round so far, so that one noisy sample cannot throw it off; the best round's budget is
  // kept. Returns that round's time (the peer calibrates its side the same way).
  double calibrate(rank_context& me) {
    std::vector<float> scratch(total_);
    const auto backward = [&] {
      std::size_t offset = total_;
      for (std::size_t t = shapes_.size(); t-- > 0;) {
        offset -= shapes_[t].count;
        layer_backward(me, t, std::span<float>(scratch.data() + offset, shapes_[t].count));
      }
    };
    const double target = settings_.compute_ms;
    me.budget_ms = target;
    backward();
    double best_miss = -1, best_ms = 0, best_budget = target;
    for (int round = 0; round < 12; ++round) {
      std::vector<double> measured{timed(me, backward, std::max(4, settings_.iterations)).ms};
      me.pg.broadcast(std::span<double>(measured), 0).wait();
      const double miss = std::abs(measured[0] - target);
      if (best_miss < 0 || miss < best_miss) best_miss = miss, best_ms = measured[0], best_budget = me.budget_ms;
      if (miss <= 0.01 * target) break;
      me.budget_ms = std::max(0.0, best_budget + target - best_ms);
      if (me.budget_ms == 0 && best_budget == 0) break;
    }
    me.budget_ms = best_budget;
    return best_ms;
  }

  // A side: whatever it holds, and one step of it.
  struct side {
    std::unique_ptr<state_type> state;
    std::vector<float> parameters, gradients;  // adopted: the trainer's own
    std::function<void()> step;
    std::string torch_variant;  // a PyTorch side: the peer's
  };

  std::unique_ptr<side> make_side(rank_context& me, const std::string& name) {
    auto made = std::make_unique<side>();
    if (is_torch(name)) {
      made->torch_variant = name.substr(6);
      return made;
    }
    side& s = *made;
    if (name == "sum" || name == "avg") {
      s.gradients.assign(total_, 1.0f);
      const auto reduce = name == "sum" ? cohort::op::sum : cohort::op::avg;
      s.step = [&me, &s, reduce] { me.pg.all_reduce(std::span<float>(s.gradients), reduce).wait(); };
      return made;
    }
    const side_kind kind = parse_side(name);
    cohort::training_options options{.strategy = kind.kind,
                                     .adam = {.lr = 1e-4, .weight_decay = 0.01},
                                     .trainer_optimizer = kind.gradients_only,
                                     // This trainer reads its parameters through gather(), so
                                     // its own buffers may be published as the state's are.
                                     .defer_publication = kind.adopted,
                                     .max_grad_norm = kind.gradients_only ? 0.0 : 1.0,
                                     .prefetch = kind.prefetch};
    if (settings_.reductions_in_flight) options.reductions_in_flight = *settings_.reductions_in_flight;
    if (kind.reproducible)  // one micro-batch per rank a step, as the other sides
      options.reproducible = cohort::reproducible_options{static_cast<std::size_t>(settings_.ranks)};
    if (kind.adopted) {
      s.parameters.assign(total_, 0.01f);
      s.gradients.assign(total_, 0.0f);
      s.state = std::make_unique<state_type>(me.pg, std::span<float>(s.parameters), std::span<float>(s.gradients),
                                             regions_, options);
    } else {
      s.state = std::make_unique<state_type>(me.pg, regions_, options);
      s.state->load_parameters(std::vector<float>(total_, 0.01f));
    }
    state_type& state = *s.state;
    const bool zero_first = kind.adopted && !kind.gradients_only;  // the trainer's zero_grad
    s.step = [this, &me, &s, &state, kind, zero_first] {
      if (zero_first) std::memset(s.gradients.data(), 0, s.gradients.size() * sizeof(float));
      if (kind.kind == strategy::zero3 || (settings_.forward_ms > 0 && !kind.gradients_only))
        for (std::size_t u = 0; u < units_.size(); ++u) {  // the forward
          auto view = state.gather(u);
          for (const std::size_t t : units_[u]) spend(me, t, settings_.forward_ms);
        }
      for (std::size_t u = units_.size(); u-- > 0;) {
        auto view = state.gather(u);
        for (auto t = units_[u].rbegin(); t != units_[u].rend(); ++t) {
          layer_backward(me, *t, state.gradient(*t));
          if (!kind.serial) state.mark_ready(*t);
        }
      }
      if (kind.serial)
        for (std::size_t t = shapes_.size(); t-- > 0;) state.mark_ready(t);
      state.step();
      if (kind.gradients_only) state.publish_parameters();
    };
    return made;
  }

  sample_value sample(rank_context& me, side& s) {
    if (s.torch_variant.empty()) return timed(me, s.step);
    sample_value value;
    if (me.leader()) {
      const json reply = me.peer->ask("sample " + s.torch_variant + " " + std::to_string(settings_.iterations));
      if (!reply.is_null()) value = {reply.at("ms").as_number(), reply.at("cpu_ms").as_number()};
    }
    me.pg.barrier().wait();
    return value;
  }

  mode_result measure_mode(rank_context& me) {
    mode_result out;
    out.mode = me.sleep ? "sleep" : "spin";
    if (me.leader())
      std::printf("\n== simulated backward: %s (%s), %d ranks, %zu units ==\n", out.mode.c_str(),
                  me.sleep ? "the host thread idles, as under a GPU's kernels" : "busy-waits, as a CPU trainer",
                  settings_.ranks, units_.size());
    out.compute_ms = calibrate(me);
    out.budget_ms = me.budget_ms;
    // Every rank learns whether the peer is there (only rank 0 talks to it).
    std::vector<int> peer_ok{0};
    if (me.leader() && me.peer) {
      out.torch_compute = me.peer->ask("mode " + out.mode);
      peer_ok[0] = me.peer->available() ? 1 : 0;
      if (!peer_ok[0]) std::printf("PyTorch peer unavailable (%s): its pairs skipped\n", me.peer->failure().c_str());
    }
    me.pg.broadcast(std::span<int>(peer_ok), 0).wait();
    if (me.leader()) {
      std::printf("backward alone, calibrated to %.0f ms: cohort %.1f ms (%.1f ms busy)", settings_.compute_ms,
                  out.compute_ms, out.budget_ms);
      if (peer_ok[0])
        std::printf("; PyTorch %.1f ms with bucket views (%.1f ms busy), %.1f ms by default",
                    out.torch_compute.at("bucket_view_compute_ms").as_number(),
                    out.torch_compute.at("bucket_view_compute_budget_ms").as_number(),
                    out.torch_compute.at("compute_ms").as_number());
      std::printf("\n\n");
      std::fflush(stdout);
    }
    for (const auto& spec : all_pairs()) {
      if (!settings_.pairs.empty() &&
          std::find(settings_.pairs.begin(), settings_.pairs.end(), spec.key) == settings_.pairs.end())
        continue;
      const bool torch = is_torch(spec.a) || is_torch(spec.b);
      if (torch && !peer_ok[0]) continue;
      auto a = make_side(me, spec.a);
      auto b = make_side(me, spec.b);
      // Warm-up: buffers faulted in, pools filled, optimizer state allocated.
      for (side* s : {a.get(), b.get()})
        if (s->step) {
          s->step();
          s->step();
        }
      std::vector<double> a_cpu, b_cpu;
      auto result = cohort_bench::ab_rounds(
          spec.what, spec.a, spec.b, settings_.rounds,
          [&] {
            const auto v = sample(me, *a);
            a_cpu.push_back(v.cpu_ms);
            return v.ms;
          },
          [&] {
            const auto v = sample(me, *b);
            b_cpu.push_back(v.cpu_ms);
            return v.ms;
          });
      result.at_most = spec.at_most;
      result.at_least = spec.at_least;
      if (torch && me.leader()) me.peer->ask("drop");
      me.pg.barrier().wait();
      if (!me.leader()) continue;
      std::printf("[%s] ", out.mode.c_str());
      cohort_bench::print_result(result);
      const double a_cpu_ms = cohort_bench::median_of(a_cpu), b_cpu_ms = cohort_bench::median_of(b_cpu);
      std::printf("    CPU per step, all ranks (median): A %.1f ms, B %.1f ms\n", a_cpu_ms, b_cpu_ms);
      std::fflush(stdout);
      out.pairs.push_back({out.mode, spec.key, std::move(result), a_cpu_ms, b_cpu_ms});
    }
    return out;
  }

  settings settings_;
  std::vector<tensor_shape> shapes_;
  std::vector<cohort::region> regions_;
  std::vector<std::vector<std::size_t>> units_;  // tensor indices of each unit (a layer of the state)
  std::size_t total_ = 0;
};

}  // namespace

int main(int argc, char** argv) try {
  settings s;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    if (args.is("--ranks")) {
      s.ranks = std::stoi(args.value());
    } else if (args.is("--iterations")) {
      s.iterations = std::stoi(args.value());
    } else if (args.is("--rounds")) {
      s.rounds = std::stoi(args.value());
    } else if (args.is("--compute-ms")) {
      s.compute_ms = std::stod(args.value());
    } else if (args.is("--forward-ms")) {
      s.forward_ms = std::stod(args.value());
    } else if (args.is("--reductions-in-flight")) {
      s.reductions_in_flight = std::stoi(args.value());
      if (*s.reductions_in_flight < 0) throw std::runtime_error("--reductions-in-flight >= 0");
    } else if (args.is("--compute-mode")) {
      const std::string mode = args.value();
      if (mode != "spin" && mode != "sleep" && mode != "both")
        throw std::runtime_error("--compute-mode is spin, sleep or both");
      s.modes = mode == "both" ? std::vector<bool>{false, true} : std::vector<bool>{mode == "sleep"};
    } else if (args.is("--units")) {
      const std::string units = args.value();
      if (units != "blocks" && units != "tensors") throw std::runtime_error("--units is blocks or tensors");
      s.blocks = units == "blocks";
    } else if (args.is("--pairs")) {
      s.pairs = args.list();
      for (const auto& key : s.pairs)
        if (std::none_of(all_pairs().begin(), all_pairs().end(), [&](const pair_spec& p) { return key == p.key; }))
          throw std::runtime_error("--pairs: no pair named " + key);
    } else if (args.is("--json")) {
      s.json_path = args.value();
    } else if (args.is("--torch-peer")) {
      s.torch_peer = args.value();
    } else if (args.is("--python")) {
      s.python = args.value();
    } else {
      std::string usage =
          "usage: bench_reducer [--ranks N] [--iterations I] [--rounds R] [--compute-ms MS] [--forward-ms MS] "
          "[--compute-mode spin|sleep|both] [--units blocks|tensors] [--pairs a,b,...] [--reductions-in-flight N] "
          "[--json FILE] "
          "[--torch-peer bench/peers/torch_ddp.py] [--python python3]\npairs:";
      for (const auto& p : all_pairs()) usage += std::string(" ") + p.key;
      args.usage((usage + "\n").c_str());
    }
  }
  if (s.iterations < 1 || s.rounds < 1 || s.ranks < 1) throw std::runtime_error("--iterations, --rounds, --ranks >= 1");
  ::signal(SIGPIPE, SIG_IGN);  // a peer that died: its pipe's write fails instead
  const bench shape(s);
  std::printf(
      "ResNet-50 gradient set: %zu tensors in %zu units, %zu parameters (%.1f MB), %d Gloo ranks (threads), "
      "%d usable cores; A/B rounds: %d, A B B A each, a sample the median of %d steps\n",
      shape.tensors(), shape.units(), shape.parameters(), static_cast<double>(shape.parameters()) * 4 / 1e6, s.ranks,
      usable_cores(), s.rounds, s.iterations);
  if (s.reductions_in_flight) std::printf("cohort's reductions in flight: %d\n", *s.reductions_in_flight);
  std::unique_ptr<torch_peer> peer;
  if (!s.torch_peer.empty()) peer = std::make_unique<torch_peer>(s);
  bench b(s);
  const auto modes = b.run(peer.get());

  std::printf("\nsummary: median ratio [min-max] over %d rounds\n", s.rounds);
  std::printf("%-18s", "pair");
  for (const auto& m : modes) std::printf(" %24s", m.mode.c_str());
  std::printf("  target\n");
  for (const auto& spec : all_pairs()) {
    std::string line;
    bool any = false;
    for (const auto& m : modes) {
      char cell[64] = "-";
      for (const auto& p : m.pairs)
        if (p.key == spec.key) {
          std::snprintf(cell, sizeof cell, "%.3f [%.3f-%.3f]%s", p.rounds.median_ratio, p.rounds.min_ratio,
                        p.rounds.max_ratio, p.rounds.met() ? "" : " *");
          any = true;
        }
      char padded[80];
      std::snprintf(padded, sizeof padded, " %24s", cell);
      line += padded;
    }
    if (!any) continue;
    std::string target;
    if (spec.at_least && spec.at_most) {
      target = std::to_string(*spec.at_least).substr(0, 4) + "-" + std::to_string(*spec.at_most).substr(0, 4);
    } else if (spec.at_most) {
      target = "<= " + std::to_string(*spec.at_most).substr(0, 4);
    }
    std::printf("%-18s%s  %s\n", spec.key, line.c_str(), target.c_str());
  }
  std::printf("(* target not met)\n");

  if (!s.json_path.empty()) {
    json document = json::make_object();
    document.set("benchmark", "bench_reducer");
    document.set("ranks", s.ranks);
    document.set("tensors", shape.tensors());
    document.set("units", shape.units());
    document.set("parameters", shape.parameters());
    document.set("compute_ms_target", s.compute_ms);
    document.set("forward_ms", s.forward_ms);
    if (s.reductions_in_flight) document.set("reductions_in_flight", *s.reductions_in_flight);
    document.set("iterations_per_sample", s.iterations);
    document.set("rounds", s.rounds);
    if (peer && !peer->version().empty()) document.set("torch_version", peer->version());
    json list = json::make_array();
    for (const auto& m : modes) {
      json mode = json::make_object();
      mode.set("compute_mode", m.mode);
      mode.set("compute_alone_ms", m.compute_ms);
      mode.set("compute_busy_ms", m.budget_ms);
      if (!m.torch_compute.is_null()) mode.set("torch_compute", m.torch_compute);
      json pairs = json::make_array();
      for (const auto& p : m.pairs) {
        json item = cohort_bench::to_json(p.rounds);
        item.set("pair", p.key);
        item.set("a_cpu_ms_per_step", p.a_cpu_ms);
        item.set("b_cpu_ms_per_step", p.b_cpu_ms);
        pairs.push_back(std::move(item));
      }
      mode.set("pairs", std::move(pairs));
      list.push_back(std::move(mode));
    }
    document.set("modes", std::move(list));
    std::ofstream(s.json_path) << document.dump(2) << "\n";
    std::printf("wrote %s\n", s.json_path.c_str());
  }
  return 0;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "bench_reducer: %s\n", failure.what());
  return 1;
}
