#pragma once
// cohort/backend/gloo.hpp's definitions: inline there when header-only, compiled once by <cohort/impl/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <vector>
#include "cohort/detail/fifo_worker.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/host_elementwise.hpp"
#include "cohort/detail/host_math.hpp"
#include "cohort/error.hpp"
#include "cohort/launch.hpp"
#include "cohort/store.hpp"
#include "cohort/types.hpp"

#include "cohort/backend/gloo.hpp"
#include "cohort/detail/config.hpp"

namespace cohort::inline v0 {

namespace detail {

// Gloo's rendezvous talks to cohort's store, so Gloo and NCCL share one rendezvous.
class gloo_store_adapter final : public ::gloo::rendezvous::Store {
 public:
  gloo_store_adapter(std::shared_ptr<cohort::store> inner, std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    inner_->set(key, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    const bytes value = inner_->get(key, timeout_);
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout.count() > 0 ? timeout : timeout_);
  }

 private:
  std::shared_ptr<cohort::store> inner_;
  std::chrono::milliseconds timeout_;
};

COHORT_DECL gloo_p2p::gloo_p2p() = default;
COHORT_DECL gloo_p2p::~gloo_p2p() = default;

COHORT_DECL void gloo_p2p::abort() {
  std::lock_guard lock(mutex);
  if (!buffer) return;
  if (sending)
    buffer->abortWaitSend();
  else
    buffer->abortWaitRecv();
}

}  // namespace detail

COHORT_DECL gloo::gloo(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts)
    : rank_(env.rank), size_(env.world_size), options_(opts) {
  device_ = make_device(env, opts);
  connect(std::move(store));
}

COHORT_DECL gloo::~gloo() {
  if (worker_) worker_->shutdown();
  // Point-to-point operations still unmatched would keep the completion worker waiting
  // for up to the timeout: end them, the group is going away.
  {
    std::lock_guard lock(p2p_mutex_);
    for (auto& weak : live_p2p_)
      if (auto pending = weak.lock()) pending->abort();
  }
  if (p2p_worker_) p2p_worker_->shutdown();
}

COHORT_DECL auto gloo::split(gloo& parent, std::shared_ptr<cohort::store> sub_store, int color, int /*key*/,
                             int new_rank, int new_size) -> std::unique_ptr<gloo> {
  if (color < 0) return nullptr;
  return std::make_unique<gloo>(parent, std::move(sub_store), new_rank, new_size);
}

COHORT_DECL auto gloo::enqueue(std::function<void()> fn) -> work {
  auto queued = task(task_kind::function);
  queued.fn = std::move(fn);
  return submit(std::move(queued));
}

COHORT_DECL auto gloo::copy(void* destination, const void* source, std::size_t bytes) -> work {
  // Still queued when empty: the returned work orders after everything before it.
  return enqueue([=] {
    if (bytes != 0) std::memmove(destination, source, bytes);  // null is allowed when empty
  });
}

COHORT_DECL auto gloo::make_device(const launch_env& env, const options& opts)
    -> std::shared_ptr<::gloo::transport::Device> {
  ::gloo::transport::tcp::attr attr;
  std::string interface = opts.interface;
  if (interface.empty()) {
    if (const char* name = std::getenv("GLOO_SOCKET_IFNAME")) interface = name;
  }
  if (!opts.hostname.empty())
    attr.hostname = opts.hostname;
  else if (!interface.empty())
    attr.iface = interface;
  else if (detail::is_loopback(env.master_addr) || env.world_size == env.local_world_size)
    attr.hostname = "127.0.0.1";  // one node: stay on loopback, never expose a port
  try {
    return ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& failure) {
    throw error(env.rank, "gloo.create_device", std::string("cannot open a TCP device: ") + failure.what(),
                "set options.hostname or GLOO_SOCKET_IFNAME to an address of this host");
  }
}

COHORT_DECL auto gloo::connect(std::shared_ptr<cohort::store> store) -> void {
  auto context = std::make_shared<::gloo::rendezvous::Context>(rank_, size_);
  context->setTimeout(options_.timeout);
  store_ = store;
  detail::gloo_store_adapter adapter(std::move(store), options_.timeout);
  try {
    context->connectFullMesh(adapter, device_);
  } catch (const timeout_error& failure) {
    throw timeout_error(
        rank_, "gloo.rendezvous",
        missing_at_rendezvous(*store_) + " (world of " + std::to_string(size_) + "): " + failure.detail(),
        "a rank never arrived: is every rank started with the same WORLD_SIZE "
        "and MASTER_ADDR/MASTER_PORT?");
  } catch (const ::gloo::Exception& failure) {
    throw error(rank_, "gloo.rendezvous", "world of " + std::to_string(size_) + ": " + failure.what(),
                "a peer is unreachable: check the network interface (GLOO_SOCKET_IFNAME)");
  }
  context_ = std::move(context);
  worker_ = std::make_shared<worker_type>([this](detail::gloo_task& task) { run(task); });
  p2p_worker_ = std::make_shared<worker_type>([this](detail::gloo_task& task) { run(task); });
}

COHORT_DECL auto gloo::task(task_kind what, dtype type, op reduce, const void* in, void* out, std::size_t count,
                            int peer, std::uint64_t tag) -> detail::gloo_task {
  detail::gloo_task queued;
  queued.what = what;
  queued.type = type;
  queued.reduce = reduce;
  queued.in = in;
  queued.out = out;
  queued.count = count;
  queued.peer = peer;
  queued.tag = tag;
  return queued;
}

COHORT_DECL auto gloo::submit(detail::gloo_task queued) -> work {
  if (queued.what != task_kind::function) queued.sequence = collectives_issued_.fetch_add(1) + 1;
  const std::uint64_t seq = worker_->submit(std::move(queued));
  return work(worker_, seq);
}

COHORT_DECL auto gloo::post(detail::gloo_task operation) -> work {
  auto pending = std::make_shared<detail::gloo_p2p>();
  {
    std::lock_guard lock(p2p_mutex_);
    std::erase_if(live_p2p_, [](const std::weak_ptr<detail::gloo_p2p>& weak) { return weak.expired(); });
    live_p2p_.push_back(pending);
    // A send to B with tag t is matched by B's recv from this rank with tag t, in order.
    operation.sequence = ++p2p_issued_[{operation.peer, operation.tag, operation.what == task_kind::send}];
  }
  auto completion = task(task_kind::p2p_wait, operation.type, op::sum, operation.in, operation.out, operation.count,
                         operation.peer, operation.tag);
  completion.sequence = operation.sequence;
  completion.p2p = pending;
  operation.p2p = pending;
  pending->sending = operation.what == task_kind::send;
  pending->post_sequence = worker_->submit(std::move(operation));
  return work(p2p_worker_, p2p_worker_->submit(std::move(completion)));
}

COHORT_DECL auto gloo::describe(const detail::gloo_task& task) -> std::string {
  static constexpr const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
                                          "send",       "recv",           "barrier",    "host_task", "p2p_wait"};
  std::string text = names[static_cast<int>(task.what)];
  if (task.sequence != 0) text += " #" + std::to_string(task.sequence);
  if (task.what == task_kind::barrier || task.what == task_kind::function) return text;
  text += " (" + std::string(to_string(task.type)) + " x " + std::to_string(task.count);
  if (task.what == task_kind::all_reduce || task.what == task_kind::reduce_scatter)
    text += ", " + std::string(to_string(task.reduce));
  if (task.what == task_kind::broadcast) text += ", root " + std::to_string(task.peer);
  if (task.what == task_kind::send || task.what == task_kind::recv || task.what == task_kind::p2p_wait)
    text += ", peer " + std::to_string(task.peer);
  return text + ")";
}

COHORT_DECL auto gloo::run(detail::gloo_task& task) -> void {
  try {
    execute(task);
  } catch (const error&) {
    throw;
  } catch (const ::gloo::IoException& failure) {
    const std::string what = failure.what();
    if (what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos)
      throw timeout_error(rank_, "gloo." + describe(task), name_the_culprit(task, false) + " [" + what + "]",
                          "a peer did not enter the same call within " + detail::format_duration(options_.timeout) +
                              ": it hangs, crashed, issued calls in another order, or "
                              "passed another size or dtype (COHORT_DEBUG=1 names the calls)");
    throw error(rank_, "gloo." + describe(task), name_the_culprit(task, true) + " [" + what + "]",
                "a peer closed its connection: it crashed or exited early, or sizes differ "
                "across ranks");
  } catch (const std::exception& failure) {
    throw error(rank_, "gloo." + describe(task), failure.what(),
                "sizes or dtypes may differ across ranks (set COHORT_DEBUG=1 to check)");
  }
}

COHORT_DECL auto gloo::execute(detail::gloo_task& task) -> void {
  switch (task.what) {
    case task_kind::function:
      if (task.fn) task.fn();
      return;
    case task_kind::p2p_wait: {
      worker_->wait_until_done(task.p2p->post_sequence, std::chrono::steady_clock::time_point::max());
      if (auto failure = worker_->failure(task.p2p->post_sequence)) std::rethrow_exception(failure);
      ::gloo::transport::UnboundBuffer* buffer = nullptr;
      {
        std::lock_guard lock(task.p2p->mutex);
        buffer = task.p2p->buffer.get();
      }
      if (!buffer) return;  // zero elements: nothing was posted
      const bool completed =
          task.p2p->sending ? buffer->waitSend(options_.timeout) : buffer->waitRecv(options_.timeout);
      {
        std::lock_guard lock(task.p2p->mutex);
        task.p2p->buffer.reset();
      }
      if (!completed) throw_timeout(task);
      return;
    }
    case task_kind::barrier: {
      ::gloo::BarrierOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setTimeout(options_.timeout);
      ::gloo::barrier(opts);
      return;
    }
    default: break;
  }
  if (task.count == 0) return;  // nothing moves; every rank agrees on that without talking
  // Gloo's buffers care about the element's width only; the arithmetic is the reduce
  // function's. Four widths, not seven dtypes, of the code below.
  switch (size_of(task.type)) {
    case 1: return execute_sized<detail::element_bytes<1>>(task);
    case 2: return execute_sized<detail::element_bytes<2>>(task);
    case 4: return execute_sized<detail::element_bytes<4>>(task);
    default: return execute_sized<detail::element_bytes<8>>(task);
  }
}

COHORT_DECL auto gloo::signature(const detail::gloo_task& task) -> std::uint64_t {
  detail::fnv1a hash;
  const auto mix = [&](std::uint64_t value) { hash.mix(value); };
  // A send and its recv must share a slot: both count as "point to point".
  const bool point_to_point = task.what == task_kind::send || task.what == task_kind::recv;
  mix(point_to_point ? 0xffu : static_cast<std::uint64_t>(task.what));
  mix(static_cast<std::uint64_t>(task.type));
  mix(task.count);
  mix(static_cast<std::uint64_t>(task.reduce));
  if (task.what == task_kind::broadcast) mix(static_cast<std::uint64_t>(task.peer));
  if (point_to_point) mix(task.tag);
  mix(task.sequence);
  return hash.value();
}

COHORT_DECL auto gloo::throw_timeout(const detail::gloo_task& task) -> void {
  throw timeout_error(rank_, "gloo." + describe(task),
                      "no matching peer operation within " + detail::format_duration(options_.timeout),
                      "the peer never posted the matching send/recv with the same tag, size and dtype");
}

COHORT_DECL auto gloo::name_the_culprit(const detail::gloo_task& task, bool connection_lost) -> std::string {
  const std::string mine = describe(task);
  const bool collective = task.what != task_kind::send && task.what != task_kind::recv &&
                          task.what != task_kind::p2p_wait && task.what != task_kind::function;
  if (!store_ || !collective || size_ < 2) return "this rank is in " + mine;
  // Each rank that fails publishes the call it is in; a rank that is not in a cohort call
  // (still computing, stopped, dead) publishes nothing. The window is short and bounded.
  const auto window = std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(5));
  const auto deadline = std::chrono::steady_clock::now() + window;
  const std::string prefix = "failure/";
  std::vector<int> silent, waiting{rank_};
  std::vector<std::string> differ;
  try {
    store_->set(prefix + std::to_string(rank_), std::to_string(task.sequence) + "\n" + mine);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      std::string report;
      try {
        report = to_string(store_->get(prefix + std::to_string(peer), std::max(left, std::chrono::milliseconds(1))));
      } catch (const timeout_error&) {
        silent.push_back(peer);
        continue;
      }
      const auto newline = report.find('\n');
      const std::string theirs = newline == std::string::npos ? report : report.substr(newline + 1);
      if (theirs == mine)
        waiting.push_back(peer);
      else
        differ.push_back("rank " + std::to_string(peer) + " is in " + theirs);
    }
  } catch (const std::exception& unreachable) {
    return "this rank is in " + mine + "; no failure reports: the group's store is unreachable (" + unreachable.what() +
           "), so the rank that serves it (rank 0 of the job) may have died";
  }
  std::sort(waiting.begin(), waiting.end());
  std::string text;
  if (!silent.empty())
    text = detail::format_ranks(silent) + (connection_lost ? " died or exited during " : " never issued ") + mine +
           " (no report within " + detail::format_duration(window) + ")";
  for (const auto& line : differ) text += (text.empty() ? "" : "; ") + line;
  if (text.empty()) text = "every rank reports " + mine;
  return text + "; " + detail::format_ranks(waiting) + (waiting.size() == 1 ? " is" : " are") +
         (connection_lost ? " in " : " waiting in ") + mine;
}

COHORT_DECL auto gloo::missing_at_rendezvous(cohort::store& store) const -> std::string {
  std::vector<int> missing;
  try {
    for (int peer = 0; peer < size_; ++peer) {
      const std::string key = std::to_string(peer);  // Gloo's full-mesh rendezvous key
      if (!store.check(std::span<const std::string>(&key, 1))) missing.push_back(peer);
    }
  } catch (const std::exception&) {
    return "the store is unreachable";
  }
  if (missing.empty()) return "every rank published its address";
  return detail::format_ranks(missing) + " never arrived at the rendezvous";
}

COHORT_DECL auto gloo::scratch_bytes(std::size_t bytes) -> std::vector<std::byte>& {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_;
}

template <class T>
COHORT_DECL auto gloo::execute_sized(detail::gloo_task& task) -> void {
  T* out = static_cast<T*>(task.out);
  const T* in = static_cast<const T*>(task.in);
  const std::size_t n = task.count;
  const std::size_t world = static_cast<std::size_t>(size_);
  switch (task.what) {
    case task_kind::all_reduce: {
      ::gloo::AllreduceOptions opts(context_);
      opts.setTag(collective_tag(task));
      // Out of place, Gloo copies each input segment just before it sends or reduces it,
      // while it is hot; a copy of the whole input first would be a cold pass of its own.
      if (in != out) opts.setInput(const_cast<T*>(in), n);
      opts.setOutput(out, n);
      opts.setReduceFunction(detail::reduce_function(task.type, task.reduce));
      opts.setTimeout(options_.timeout);
      ::gloo::allreduce(opts);
      if (task.reduce == op::avg) detail::elementwise<memory_space::host>::divide_now(out, n, task.type, size_);
      return;
    }
    case task_kind::reduce_scatter: {
      // All-to-all puts every rank's contribution to my chunk side by side, then one
      // local pass reduces them: (n-1)/n of the input crosses the wire.
      auto& scratch = scratch_bytes(world * n * sizeof(T));
      T* gathered = reinterpret_cast<T*>(scratch.data());
      if (world > 1) {
        ::gloo::AlltoallOptions opts(context_);
        opts.setTag(collective_tag(task));
        opts.setInput(const_cast<T*>(in), world * n);
        opts.setOutput(gathered, world * n);
        opts.setTimeout(options_.timeout);
        ::gloo::alltoall(opts);
      } else {
        std::memcpy(gathered, in, n * sizeof(T));
      }
      std::memmove(out, gathered, n * sizeof(T));
      const auto reduce = detail::reduce_function(task.type, task.reduce);
      for (std::size_t r = 1; r < world; ++r) reduce(out, out, gathered + r * n, n);
      if (task.reduce == op::avg) detail::elementwise<memory_space::host>::divide_now(out, n, task.type, size_);
      return;
    }
    case task_kind::all_gather: {
      ::gloo::AllgatherOptions opts(context_);
      opts.setTag(collective_tag(task));
      T* own_slot = out + static_cast<std::size_t>(rank_) * n;
      if (in != own_slot) std::memcpy(own_slot, in, n * sizeof(T));
      opts.setOutput(out, world * n);
      opts.setTimeout(options_.timeout);
      ::gloo::allgather(opts);
      return;
    }
    case task_kind::broadcast: {
      ::gloo::BroadcastOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setOutput(out, n);
      opts.setRoot(task.peer);
      opts.setTimeout(options_.timeout);
      ::gloo::broadcast(opts);
      return;
    }
    case task_kind::all_to_all: {
      if (world == 1) {
        if (in != out) std::memcpy(out, in, n * sizeof(T));
        return;
      }
      ::gloo::AlltoallOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setInput(const_cast<T*>(in), world * n);
      opts.setOutput(out, world * n);
      opts.setTimeout(options_.timeout);
      ::gloo::alltoall(opts);
      return;
    }
    case task_kind::send: {
      auto buffer = context_->createUnboundBuffer(const_cast<T*>(in), n * sizeof(T));
      buffer->send(task.peer, point_to_point_slot(task));
      std::lock_guard lock(task.p2p->mutex);
      task.p2p->buffer = std::move(buffer);
      return;
    }
    case task_kind::recv: {
      auto buffer = context_->createUnboundBuffer(out, n * sizeof(T));
      buffer->recv(task.peer, point_to_point_slot(task));
      std::lock_guard lock(task.p2p->mutex);
      task.p2p->buffer = std::move(buffer);
      return;
    }
    default: return;
  }
}

}  // namespace cohort::inline v0
