// Bucketed, overlapped gradient all-reduce on Gloo ranks (threads of this process) with a
// ResNet-50-shaped gradient set (161 tensors, 25.6 M parameters):
//  1. communication alone: one raw all-reduce of everything, one all-reduce per tensor, and
//     training_state under ddp at bucket caps 1 .. 100 MiB (its step a plain SGD pass at lr 0:
//     the one pass over the gradients a step needs, nothing else);
//  2. a simulated backward (per-layer compute proportional to the layer's size, plus
//     writing its gradient), without and with overlap: step time, compute time and exposed
//     communication (step - compute); then the training state under every strategy with AdamW.
// --compute-ms is what the whole backward takes alone, gradient writes included: each side
// (this program and the PyTorch peer) calibrates its per-layer busy time until its own
// "compute alone" meets it, since the framework around the compute costs each side a
// different amount (autograd and AccumulateGrad's copy into .grad on PyTorch's). The two
// step times then compare like for like, and exposed communication is shown beside them.
// The simulated compute comes in two kinds, each its own table: `spin` busy-waits (a CPU
// trainer: the backward occupies the cores the communication needs too) and `sleep` idles
// (a GPU trainer: the host thread only launches kernels). Every row also reports the CPU
// time the whole process spent per step (all ranks: they are threads of this process), from
// which a floor follows: on C cores no schedule finishes a step in less than
// (compute CPU + communication CPU) / C, however well it overlaps.
// Optionally runs bench/peers/torch_ddp.py (PyTorch DDP over Gloo, same shapes, same
// simulated backward) in the same run and prints the ratio of step times.
//
//   bench_reducer [--ranks 2] [--iterations 8] [--compute-ms 120] [--compute-mode spin|sleep|both]
//                 [--json FILE] [--torch-peer bench/peers/torch_ddp.py] [--python python3]
#include <cohort/comm/gloo.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/store.hpp>
#include <cohort/run/run_ranks.hpp>
#include <cohort/tools/detail/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include <sched.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using group = cohort::process_group<cohort::gloo>;
using cohort::detail::json;

struct tensor_shape {
  std::string name;
  std::size_t count;
};

// torchvision's resnet50 parameters in declaration order: conv weights (no bias), batch-norm
// weight and bias, and the classifier.
std::vector<tensor_shape> resnet50() {
  std::vector<tensor_shape> shapes;
  auto conv = [&](const std::string& name, std::size_t out, std::size_t in, std::size_t k) {
    shapes.push_back({name + ".weight", out * in * k * k});
  };
  auto bn = [&](const std::string& name, std::size_t channels) {
    shapes.push_back({name + ".weight", channels});
    shapes.push_back({name + ".bias", channels});
  };
  conv("conv1", 64, 3, 7);
  bn("bn1", 64);
  std::size_t in = 64;
  const std::size_t widths[] = {64, 128, 256, 512};
  const int blocks[] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const std::size_t width = widths[stage];
    for (int block = 0; block < blocks[stage]; ++block) {
      const std::string prefix = "layer" + std::to_string(stage + 1) + "." + std::to_string(block) + ".";
      conv(prefix + "conv1", width, in, 1);
      bn(prefix + "bn1", width);
      conv(prefix + "conv2", width, width, 3);
      bn(prefix + "bn2", width);
      conv(prefix + "conv3", width * 4, width, 1);
      bn(prefix + "bn3", width * 4);
      if (block == 0) {
        conv(prefix + "downsample.0", width * 4, in, 1);
        bn(prefix + "downsample.1", width * 4);
      }
      in = width * 4;
    }
  }
  shapes.push_back({"fc.weight", 1000 * 2048});
  shapes.push_back({"fc.bias", 1000});
  return shapes;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
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

// Cores this process may run on.
int usable_cores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// spin: the compute occupies this thread's core (a CPU trainer); sleep: the thread is idle
// while the compute runs elsewhere (a GPU trainer, whose host thread only launches kernels).
void simulate_compute(std::chrono::nanoseconds duration, bool sleep) {
  if (sleep) {
    std::this_thread::sleep_for(duration);
    return;
  }
  const auto until = clock_type::now() + duration;
  while (clock_type::now() < until) {}
}

struct settings {
  int ranks = 2;
  int iterations = 8;
  double compute_ms = 120;
  bool sleep_compute = false;  // --compute-mode sleep
  bool both_modes = true;      // --compute-mode both (the default): a table for each
  std::string json_path;
  std::string torch_peer;
  std::string python = "python3";
};

struct row {
  std::string what;
  double cap_mib = 0;
  std::size_t buckets = 0;
  double step_ms = 0;
  double compute_ms = 0;
  double cpu_ms = 0;     // process CPU per step, all ranks
  double budget_ms = 0;  // compute alone: the calibrated busy time within compute_ms
};

struct timing {
  double wall_ms = 0;
  double cpu_ms = 0;
};

class bench {
 public:
  bench(const settings& s) : settings_(s), shapes_(resnet50()) {
    for (const auto& shape : shapes_) {
      sizes_.push_back(shape.count);
      total_ += shape.count;
    }
  }

  std::size_t tensors() const { return shapes_.size(); }
  std::size_t parameters() const { return total_; }

  // Runs every measurement on `ranks` threads; rank 0 records.
  std::vector<row> run() {
    std::vector<row> rows;
    cohort::run_ranks(settings_.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::gloo::options options;
      options.timeout = std::chrono::seconds(60);
      group pg(store, env, options);
      measure_all(pg, env.rank == 0 ? &rows : nullptr);
    });
    return rows;
  }

 private:
  // Medians over iterations of fn's wall time and of the process's CPU time meanwhile, every
  // rank starting together (the CPU window is rank 0's; the ranks start and end together).
  timing timed(group& pg, const std::function<void()>& fn) {
    std::vector<double> times, cpu;
    for (int i = 0; i < settings_.iterations + 2; ++i) {
      pg.barrier().wait();
      const double cpu_start = process_cpu_ms();
      const auto start = clock_type::now();
      fn();
      if (i >= 2) {  // two warm-up iterations
        times.push_back(ms_since(start));
        cpu.push_back(process_cpu_ms() - cpu_start);
      }
    }
    return {median(times), median(cpu)};
  }

  // One layer's share of the backward: busy-wait for its share of the compute budget and
  // write its gradient.
  void layer_backward(std::size_t t, std::span<float> gradient) const {
    simulate_compute(std::chrono::nanoseconds(static_cast<std::int64_t>(
                         budget_ms_ * 1e6 * static_cast<double>(sizes_[t]) / static_cast<double>(total_))),
                     settings_.sleep_compute);
    std::fill(gradient.begin(), gradient.end(), 1e-3f * static_cast<float>(t % 7));
  }

  // Sets the per-layer budget so that the whole backward alone takes --compute-ms (rank 0's
  // median; every rank uses rank 0's budget). Returns the measured time.
  timing calibrate(group& pg, const std::function<void()>& backward) {
    // The ranks are threads sharing budget_ms_ (every one writes the same value): each decides
    // by its own copy, which another rank's write for the next round cannot change under it.
    double budget = settings_.compute_ms;
    budget_ms_ = budget;
    timing measured{};
    constexpr int rounds = 6;
    for (int round = 0;; ++round) {
      measured = timed(pg, backward);
      // Rank 0's measurement decides, for every rank: {measured, next budget}.
      std::vector<double> state{measured.wall_ms, std::max(0.0, budget + settings_.compute_ms - measured.wall_ms)};
      pg.broadcast(std::span<double>(state), 0).wait();
      const bool met = std::abs(state[0] - settings_.compute_ms) <= 0.01 * settings_.compute_ms;
      if (met || round + 1 == rounds || (budget == 0 && state[1] == 0)) break;
      budget = state[1];
      budget_ms_ = budget;
    }
    return measured;
  }

  void measure_all(group& pg, std::vector<row>* rows) {
    auto record = [&](std::string what, double cap, std::size_t buckets, timing t, double compute) {
      if (rows) rows->push_back({std::move(what), cap, buckets, t.wall_ms, compute, t.cpu_ms});
    };
    const std::size_t n = sizes_.size();
    // Communication alone.
    {
      std::vector<float> everything(total_, 1.0f);
      // Sum, in place: what the PyTorch peer's raw row does. Averaging on Gloo is the sum
      // and then a pass dividing the result (Gloo has no average), shown separately.
      record("raw all-reduce of all gradients (sum)", 0, 1,
             timed(pg, [&] { pg.all_reduce(std::span<float>(everything), cohort::op::sum).wait(); }), 0);
      record("raw all-reduce of all gradients (avg)", 0, 1,
             timed(pg, [&] { pg.all_reduce(std::span<float>(everything), cohort::op::avg).wait(); }), 0);
      std::vector<std::span<float>> per_tensor;
      std::size_t offset = 0;
      for (auto count : sizes_) {
        per_tensor.emplace_back(everything.data() + offset, count);
        offset += count;
      }
      record("per-tensor all-reduce (161 calls)", 0, n,
             timed(pg,
                   [&] {
                     cohort::gloo::work last;
                     for (std::size_t t = n; t-- > 0;) last = pg.all_reduce(per_tensor[t], cohort::op::avg);
                     last.wait();
                   }),
             0);
    }
    const double caps[] = {1, 5, 10, 25, 50, 100};
    // Every tensor its own layer, back to back in declaration order: under ddp the buckets fill
    // to the cap across layers and launch as the backward marks them, last to first.
    std::vector<cohort::region> layers;
    for (std::size_t t = 0, offset = 0; t < n; offset += sizes_[t++])
      layers.push_back({"t" + std::to_string(t), offset, sizes_[t], t});
    const std::vector<float> initial(total_, 0.01f);
    const auto ddp_options = [](std::size_t bytes) {
      return cohort::training_options{.bucket_bytes = bytes, .sgd = cohort::sgd_options{.lr = 0}};
    };
    for (double cap : caps) {
      const auto bytes = static_cast<std::size_t>(cap * (1 << 20));
      cohort::training_state<cohort::gloo> ddp(pg, layers, ddp_options(bytes));
      ddp.load_parameters(initial);
      record("ddp all-reduce + step, no compute", cap, ddp.bucket_count(),
             timed(pg,
                   [&] {
                     for (std::size_t t = n; t-- > 0;) ddp.mark_ready(t);
                     ddp.step();
                   }),
             0);
    }
    // Simulated backward.
    std::vector<float> scratch(total_);
    const timing compute_alone = calibrate(pg, [&] {
      std::size_t offset = total_;
      for (std::size_t t = n; t-- > 0;) {
        offset -= sizes_[t];
        layer_backward(t, std::span<float>(scratch.data() + offset, sizes_[t]));
      }
    });
    const double compute = compute_alone.wall_ms;
    record("backward compute alone", 0, 0, compute_alone, compute);
    if (rows) rows->back().budget_ms = budget_ms_;
    {
      cohort::training_state<cohort::gloo> ddp(pg, layers, ddp_options(std::size_t{25} << 20));
      ddp.load_parameters(initial);
      record("backward, then all-reduce (no overlap)", 25, ddp.bucket_count(),
             timed(pg,
                   [&] {
                     for (std::size_t t = n; t-- > 0;) layer_backward(t, ddp.gradient(t));
                     for (std::size_t t = n; t-- > 0;) ddp.mark_ready(t);
                     ddp.step();
                   }),
             compute);
    }
    for (double cap : caps) {
      const auto bytes = static_cast<std::size_t>(cap * (1 << 20));
      cohort::training_state<cohort::gloo> overlapped(pg, layers, ddp_options(bytes));
      overlapped.load_parameters(initial);
      record("backward overlapped with ddp's all-reduce", cap, overlapped.bucket_count(),
             timed(pg,
                   [&] {
                     for (std::size_t t = n; t-- > 0;) {
                       layer_backward(t, overlapped.gradient(t));
                       overlapped.mark_ready(t);
                     }
                     overlapped.step();
                   }),
             compute);
    }
    // The one training state under each strategy, the same backward and AdamW (at zero3 every
    // tensor is a layer, gathered in the forward and the backward).
    for (const auto kind :
         {cohort::strategy::ddp, cohort::strategy::zero1, cohort::strategy::zero2, cohort::strategy::zero3}) {
      cohort::training_state<cohort::gloo> state(
          pg, layers, {.strategy = kind, .bucket_bytes = std::size_t{25} << 20, .adam = {.lr = 1e-4}});
      state.load_parameters(initial);
      record("training_state " + std::string(cohort::to_string(kind)) + ": backward + AdamW", 25, state.bucket_count(),
             timed(pg,
                   [&] {
                     if (kind == cohort::strategy::zero3)
                       for (std::size_t t = 0; t < n; ++t) (void)state.gather(t);
                     for (std::size_t t = n; t-- > 0;) {
                       auto layer = state.gather(t);
                       layer_backward(t, state.gradient(t));
                       state.mark_ready(t);
                     }
                     state.step();
                   }),
             compute);
    }
  }

  settings settings_;
  double budget_ms_ = 0;  // per-step busy time the layers share (calibrated)
  std::vector<tensor_shape> shapes_;
  std::vector<std::size_t> sizes_;
  std::size_t total_ = 0;
};

// Runs the PyTorch peer; returns its JSON, or null when it is skipped (no torch) or fails.
json run_torch_peer(const settings& s) {
  if (s.torch_peer.empty()) return {};
  const std::string out = "/tmp/cohort_bench_reducer_torch_" + std::to_string(::getpid()) + ".json";
  std::ostringstream command;
  command << s.python << " " << s.torch_peer << " --ranks " << s.ranks << " --iterations " << s.iterations
          << " --compute-ms " << s.compute_ms << " --compute-mode " << (s.sleep_compute ? "sleep" : "spin")
          << " --json " << out;
  std::printf("\nrunning the PyTorch DDP peer: %s\n", command.str().c_str());
  std::fflush(stdout);
  const int status = std::system(command.str().c_str());
  if (status != 0) {
    std::printf("PyTorch peer skipped or failed (exit status %d)\n", WEXITSTATUS(status));
    return {};
  }
  std::ifstream file(out);
  std::stringstream text;
  text << file.rdbuf();
  std::remove(out.c_str());
  return cohort::detail::parse_json(text.str());
}

// One compute mode: cohort's table, the floor, and the PyTorch peer beside it.
json run_mode(const settings& s) {
  const char* mode = s.sleep_compute ? "sleep" : "spin";
  bench b(s);
  std::printf(
      "\n== simulated backward: %s (%s) ==\n", mode,
      s.sleep_compute ? "the host thread idles, as under a GPU's kernels" : "busy-waits on the core, as a CPU trainer");
  const auto rows = b.run();
  std::printf("\n%-46s %8s %8s %10s %10s %12s %10s\n", "measurement", "cap MiB", "buckets", "step ms", "compute",
              "exposed comm", "CPU ms");
  json results = json::make_array();
  const row* overlapped = nullptr;
  const row* compute_alone = nullptr;
  const row* comm_alone = nullptr;
  for (const auto& r : rows) {
    const double exposed = r.compute_ms > 0 ? r.step_ms - r.compute_ms : r.step_ms;
    std::printf("%-46s %8s %8zu %10.1f %10.1f %12.1f %10.1f\n", r.what.c_str(),
                r.cap_mib > 0 ? std::to_string(static_cast<int>(r.cap_mib)).c_str() : "-", r.buckets, r.step_ms,
                r.compute_ms, exposed, r.cpu_ms);
    if (r.what.find("overlapped") != std::string::npos && r.cap_mib == 25) overlapped = &r;
    if (r.what.find("compute alone") != std::string::npos) compute_alone = &r;
    if (r.what.find("no compute") != std::string::npos && r.cap_mib == 25) comm_alone = &r;
    json entry = json::make_object();
    entry.set("measurement", r.what);
    entry.set("cap_mib", r.cap_mib);
    entry.set("buckets", r.buckets);
    entry.set("step_ms", r.step_ms);
    entry.set("compute_ms", r.compute_ms);
    entry.set("exposed_comm_ms", exposed);
    entry.set("cpu_ms", r.cpu_ms);
    results.push_back(std::move(entry));
  }
  json document = json::make_object();
  document.set("compute_mode", mode);
  document.set("results", std::move(results));
  if (!overlapped || !compute_alone || !comm_alone) return document;
  // No schedule beats the longer of the two parts alone. On a host backend both also share
  // the cores: with idle compute (sleep) the CPU the two need over the cores there are is a
  // floor too; busy-waiting compute is elastic (a preempted spin ends on time all the same),
  // so there it is not.
  const int cores = usable_cores();
  const double cpu_bound = (compute_alone->cpu_ms + comm_alone->cpu_ms) / cores;
  double floor = std::max(compute_alone->step_ms, comm_alone->step_ms);
  std::printf("\nfloor: compute alone %.1f ms, communication alone %.1f ms (25 MiB buckets; CPU %.1f ms on %d cores)",
              compute_alone->step_ms, comm_alone->step_ms, comm_alone->cpu_ms, cores);
  if (s.sleep_compute) {
    floor = std::max(floor, cpu_bound);
    std::printf(", CPU of both (%.1f + %.1f ms) / %d cores = %.1f ms", compute_alone->cpu_ms, comm_alone->cpu_ms, cores,
                cpu_bound);
  }
  std::printf("\n  -> no overlap finishes a step in less than %.1f ms; the overlapped step is %.1f ms = %.2f x that\n",
              floor, overlapped->step_ms, overlapped->step_ms / floor);
  document.set("cores", cores);
  document.set("floor_ms", floor);
  document.set("overlapped_step_ms", overlapped->step_ms);
  const row* raw_sum = nullptr;
  for (const auto& r : rows)
    if (r.what.find("(sum)") != std::string::npos) raw_sum = &r;
  std::printf(
      "calibrated compute: %.1f ms busy + %.1f ms writing gradients and looping = %.1f ms alone (target %.1f)\n",
      compute_alone->budget_ms, compute_alone->step_ms - compute_alone->budget_ms, compute_alone->step_ms,
      s.compute_ms);
  const json torch = run_torch_peer(s);
  if (!torch.is_null()) {
    // cohort's ddp against DDP's gradient_as_bucket_view (the same memory layout: the backward
    // writes into the buckets), and DDP's default (copied into its buckets) beside it. cohort's
    // step also makes one SGD pass (lr 0) over the gradients, which the peer's does not.
    const double views_step = torch.at("ddp_bucket_view_step_ms").as_number();
    const double views_compute = torch.at("bucket_view_compute_ms").as_number();
    const double default_step = torch.at("ddp_step_ms").as_number();
    const double default_compute = torch.at("compute_ms").as_number();
    const double exposed = overlapped->step_ms - compute_alone->step_ms;
    const double views_exposed = views_step - views_compute;
    std::printf("\nside by side, compute %s, %d ranks, 25 MiB buckets (PyTorch %s DDP over Gloo):\n", mode, s.ranks,
                torch.at("torch_version").as_string().c_str());
    std::printf("  %-50s %9s %14s %12s\n", "", "cohort", "DDP bucket", "DDP default");
    std::printf("  %-50s %9s %14s %12s\n", "", "ddp", "views", "");
    const auto line = [](const char* what, double a, double b, double c) {
      std::printf("  %-50s %9.1f %14.1f %12.1f\n", what, a, b, c);
    };
    line("backward compute alone, ms (calibrated to target)", compute_alone->step_ms, views_compute, default_compute);
    line("  of which busy time, ms", compute_alone->budget_ms, torch.at("bucket_view_compute_budget_ms").as_number(),
         torch.at("compute_budget_ms").as_number());
    line("overlapped step, ms", overlapped->step_ms, views_step, default_step);
    line("exposed communication = step - compute, ms", exposed, views_exposed, default_step - default_compute);
    line("CPU per step, ms (all ranks)", overlapped->cpu_ms, torch.at("ddp_bucket_view_step_cpu_ms").as_number(),
         torch.at("ddp_step_cpu_ms").as_number());
    if (raw_sum)
      std::printf("  %-50s %9.1f %14.1f\n", "one all-reduce of every gradient (sum, in place)", raw_sum->step_ms,
                  torch.at("raw_all_reduce_ms").as_number());
    std::printf("  cohort / DDP with bucket views: step %.2f, exposed communication %.2f\n",
                overlapped->step_ms / views_step, exposed / views_exposed);
    document.set("torch", torch);
    document.set("ratio_to_torch_ddp", overlapped->step_ms / views_step);
    document.set("exposed_comm_ms", exposed);
    document.set("torch_exposed_comm_ms", views_exposed);
    document.set("exposed_ratio_to_torch_ddp", exposed / views_exposed);
  }
  return document;
}

}  // namespace

int main(int argc, char** argv) try {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] {
      return i + 1 < argc ? std::string(argv[++i]) : throw std::runtime_error(arg + " needs a value");
    };
    if (arg == "--ranks")
      s.ranks = std::stoi(value());
    else if (arg == "--iterations")
      s.iterations = std::stoi(value());
    else if (arg == "--compute-ms")
      s.compute_ms = std::stod(value());
    else if (arg == "--compute-mode") {
      const std::string mode = value();
      if (mode != "spin" && mode != "sleep" && mode != "both")
        throw std::runtime_error("--compute-mode is spin, sleep or both");
      s.both_modes = mode == "both";
      s.sleep_compute = mode == "sleep";
    } else if (arg == "--json")
      s.json_path = value();
    else if (arg == "--torch-peer")
      s.torch_peer = value();
    else if (arg == "--python")
      s.python = value();
    else {
      std::printf(
          "usage: bench_reducer [--ranks N] [--iterations I] [--compute-ms MS] [--compute-mode spin|sleep|both] "
          "[--json FILE] [--torch-peer bench/peers/torch_ddp.py] [--python python3]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  const bench shape(s);
  std::printf(
      "ResNet-50 gradient set: %zu tensors, %zu parameters (%.1f MB), %d Gloo ranks (threads), median of %d, "
      "%d usable cores\n",
      shape.tensors(), shape.parameters(), static_cast<double>(shape.parameters()) * 4 / 1e6, s.ranks, s.iterations,
      usable_cores());
  json modes = json::make_array();
  struct ratio_pair {
    std::string mode;
    double step, exposed;
  };
  std::vector<ratio_pair> ratios;
  for (const bool sleep : {false, true}) {
    if (!s.both_modes && sleep != s.sleep_compute) continue;
    settings one = s;
    one.sleep_compute = sleep;
    json result = run_mode(one);
    if (const json* ratio = result.find("ratio_to_torch_ddp"))
      ratios.push_back(
          {sleep ? "sleep" : "spin", ratio->as_number(), result.at("exposed_ratio_to_torch_ddp").as_number()});
    modes.push_back(std::move(result));
  }
  if (!ratios.empty()) {
    std::printf("\ncohort / PyTorch DDP with bucket views, same calibrated compute:");
    for (const auto& r : ratios)
      std::printf("  %s: step %.2f, exposed communication %.2f", r.mode.c_str(), r.step, r.exposed);
    std::printf("\n");
  }
  json document = json::make_object();
  document.set("benchmark", "bench_reducer");
  document.set("ranks", s.ranks);
  document.set("tensors", shape.tensors());
  document.set("parameters", shape.parameters());
  document.set("compute_ms_target", s.compute_ms);
  document.set("modes", std::move(modes));
  if (!s.json_path.empty()) {
    std::ofstream(s.json_path) << document.dump(2) << "\n";
    std::printf("wrote %s\n", s.json_path.c_str());
  }
  return 0;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "bench_reducer: %s\n", failure.what());
  return 1;
}
