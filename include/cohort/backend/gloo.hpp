#pragma once
// Host backend on Gloo (Debian libgloo-dev): collectives over TCP on host memory.
//
// Each backend instance owns one Gloo context and one FIFO worker thread; every call is
// queued on the worker and returns a work handle at once, so collectives run
// asynchronously and complete in issue order. Gloo has no half/bfloat16 arithmetic and
// no averaging; cohort supplies both. reduce_scatter is an all-to-all followed by a local
// reduction, which puts (n-1)/n of the data on the wire, as a bandwidth-optimal
// reduce-scatter does, instead of all-reducing everything and keeping a slice.

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
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

// An element of N bytes: what Gloo's buffer setters need to know of a dtype.
template <std::size_t N>
struct element_bytes {
  unsigned char bytes[N];
};

// A posted point-to-point operation, waited for separately (see gloo::send).
struct gloo_p2p {
  std::mutex mutex;  // guards buffer against abort() from the group's destructor
  std::unique_ptr<::gloo::transport::UnboundBuffer> buffer;
  std::uint64_t post_sequence = 0;
  bool sending = false;

  // Ends a wait that no peer will ever match (the group is going away).
  void abort() {
    std::lock_guard lock(mutex);
    if (!buffer) return;
    if (sending)
      buffer->abortWaitSend();
    else
      buffer->abortWaitRecv();
  }
};

struct gloo_task {
  enum class kind : std::uint8_t {
    all_reduce,
    reduce_scatter,
    all_gather,
    broadcast,
    all_to_all,
    send,
    recv,
    barrier,
    function,
    p2p_wait
  };
  kind what = kind::function;
  dtype type = dtype::float32;
  op reduce = op::sum;
  const void* in = nullptr;
  void* out = nullptr;
  std::size_t count = 0;  // elements (per rank for reduce_scatter, all_gather, all_to_all)
  int peer = 0;           // root for broadcast, peer for send/recv
  std::uint64_t tag = 0;
  std::function<void()> fn;
  std::shared_ptr<gloo_p2p> p2p;
};

inline bool is_loopback(const std::string& address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0;
}

}  // namespace detail

class gloo {
 public:
  static constexpr memory_space space = memory_space::host;
  static constexpr std::string_view name = "gloo";
  // Host memory has no streams: the caller's order is its own thread. Where a device backend
  // orders work on streams, this one blocks or does nothing (see wait_for_caller, work's
  // make_stream_wait), so algorithms read the same on both.
  using stream_type = std::nullptr_t;

  struct options {
    // Bounds every collective and the rendezvous: a peer that never arrives or dies turns
    // into a timeout_error on every other rank after at most this long.
    std::chrono::milliseconds timeout{std::chrono::minutes(10)};
    // Cross-rank checks of every call's signature, and of collectives inside on_main.
    // Also turned on by the environment variable COHORT_DEBUG=1.
    bool debug_checks = false;
    // Address this rank listens on. Empty: loopback when MASTER_ADDR is loopback,
    // else this host's name (GLOO_SOCKET_IFNAME / `interface` select a NIC instead).
    std::string hostname;
    std::string interface;
  };

  using worker_type = detail::fifo_worker<detail::gloo_task>;

  // A completion handle: (worker, sequence number). Copyable; an empty handle is complete.
  class work {
   public:
    work() = default;
    work(std::shared_ptr<worker_type> worker, std::uint64_t seq) : worker_(std::move(worker)), seq_(seq) {}

    // True when complete; rethrows the failure of a failed operation.
    bool test() const {
      if (!worker_) return true;
      if (!worker_->done(seq_)) return false;
      rethrow_failure();
      return true;
    }
    // Blocks until complete. Engine operations are bounded by the group's timeout, so this
    // returns or throws within it.
    void wait() const {
      if (!worker_) return;
      worker_->wait_until_done(seq_, std::chrono::steady_clock::time_point::max());
      rethrow_failure();
    }
    // False when still running after `timeout`.
    bool wait_for(std::chrono::milliseconds timeout) const {
      if (!worker_) return true;
      if (!worker_->wait_until_done(seq_, std::chrono::steady_clock::now() + timeout)) return false;
      rethrow_failure();
      return true;
    }
    std::uint64_t sequence() const noexcept { return seq_; }
    // The caller's order waits for this work: on the host, the calling thread blocks.
    void make_stream_wait(stream_type) const { wait(); }

   private:
    void rethrow_failure() const {
      if (auto failure = worker_->failure(seq_)) std::rethrow_exception(failure);
    }
    std::shared_ptr<worker_type> worker_;
    std::uint64_t seq_ = 0;
  };

  // Rendezvous through `store` (keys under the store's own prefix) and connect a full mesh.
  gloo(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts)
      : rank_(env.rank), size_(env.world_size), options_(opts) {
    device_ = make_device(env, opts);
    connect(std::move(store));
  }

  // A new context over an existing device (subgroups).
  gloo(const gloo& parent, std::shared_ptr<cohort::store> store, int rank, int size)
      : rank_(rank), size_(size), options_(parent.options_), device_(parent.device_) {
    connect(std::move(store));
  }

  gloo(const gloo&) = delete;
  gloo& operator=(const gloo&) = delete;
  // Finishes queued work first: the worker's tasks refer to this context.
  ~gloo() {
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

  // Subgroup of a split (process_group::split did the bookkeeping): a new Gloo context over
  // the same device, rendezvousing under the subgroup's store prefix.
  static std::unique_ptr<gloo> split(gloo& parent, std::shared_ptr<cohort::store> sub_store, int color, int /*key*/,
                                     int new_rank, int new_size) {
    if (color < 0) return nullptr;
    return std::make_unique<gloo>(parent, std::move(sub_store), new_rank, new_size);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const options& settings() const noexcept { return options_; }
  const std::shared_ptr<::gloo::Context>& context() const noexcept { return context_; }

  // --- collectives (type-erased; process_group<gloo> adds the typed, checked surface) -----
  work all_reduce(const void* in, void* out, std::size_t count, dtype type, op reduce) {
    return submit(task(task_kind::all_reduce, type, reduce, in, out, count));
  }
  work reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype type, op reduce) {
    return submit(task(task_kind::reduce_scatter, type, reduce, in, out, count_per_rank));
  }
  work all_gather(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return submit(task(task_kind::all_gather, type, op::sum, in, out, count_per_rank));
  }
  work broadcast(void* data, std::size_t count, dtype type, int root) {
    return submit(task(task_kind::broadcast, type, op::sum, nullptr, data, count, root));
  }
  work all_to_all(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return submit(task(task_kind::all_to_all, type, op::sum, in, out, count_per_rank));
  }
  // Point-to-point operations are posted in issue order on the group's worker, after every
  // earlier call, and never block it: a blocking send in the queue would deadlock a ring of
  // ranks that all send before they receive. A second worker waits for their completion, in
  // posting order; the returned work completes when the peer has matched the operation.
  work send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t tag) {
    return post(task(task_kind::send, type, op::sum, data, nullptr, count, peer, tag));
  }
  work recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t tag) {
    return post(task(task_kind::recv, type, op::sum, nullptr, data, count, peer, tag));
  }
  work barrier() { return submit(task(task_kind::barrier)); }

  // --- ordering and memory: what algorithms written once over any backend need ----------
  // Runs fn on the worker after everything queued before it (host "kernels").
  work enqueue(std::function<void()> fn) {
    auto queued = task(task_kind::function);
    queued.fn = std::move(fn);
    return submit(std::move(queued));
  }
  // Completes when everything queued so far has completed.
  work record() { return submit(task(task_kind::function)); }
  // The group's own order, as a stream: the worker (make_stream_wait on it blocks).
  stream_type stream() const noexcept { return nullptr; }
  // Later work waits for what the caller queued: on the host the caller's work is done
  // when it calls, so there is nothing to wait for.
  void wait_for_caller(stream_type) noexcept {}

  static void* allocate(std::size_t bytes) { return ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{64}); }
  static void deallocate(void* pointer, std::size_t /*bytes*/) noexcept {
    ::operator delete (pointer, std::align_val_t{64});
  }
  work copy(void* destination, const void* source, std::size_t bytes) {
    // Still queued when empty: the returned work orders after everything before it.
    return enqueue([=] {
      if (bytes != 0) std::memmove(destination, source, bytes);  // null is allowed when empty
    });
  }

 private:
  using task_kind = detail::gloo_task::kind;

  static std::shared_ptr<::gloo::transport::Device> make_device(const launch_env& env, const options& opts) {
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

  void connect(std::shared_ptr<cohort::store> store) {
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank_, size_);
    context->setTimeout(options_.timeout);
    detail::gloo_store_adapter adapter(std::move(store), options_.timeout);
    try {
      context->connectFullMesh(adapter, device_);
    } catch (const timeout_error& failure) {
      throw timeout_error(rank_, "gloo.rendezvous", "world of " + std::to_string(size_) + ": " + failure.detail(),
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

  static detail::gloo_task task(task_kind what, dtype type = dtype::uint8, op reduce = op::sum,
                                const void* in = nullptr, void* out = nullptr, std::size_t count = 0, int peer = 0,
                                std::uint64_t tag = 0) {
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

  work submit(detail::gloo_task queued) {
    const std::uint64_t seq = worker_->submit(std::move(queued));
    return work(worker_, seq);
  }

  work post(detail::gloo_task operation) {
    auto pending = std::make_shared<detail::gloo_p2p>();
    {
      std::lock_guard lock(p2p_mutex_);
      std::erase_if(live_p2p_, [](const std::weak_ptr<detail::gloo_p2p>& weak) { return weak.expired(); });
      live_p2p_.push_back(pending);
    }
    auto completion = task(task_kind::p2p_wait, operation.type, op::sum, operation.in, operation.out, operation.count,
                           operation.peer, operation.tag);
    completion.p2p = pending;
    operation.p2p = pending;
    pending->sending = operation.what == task_kind::send;
    pending->post_sequence = worker_->submit(std::move(operation));
    return work(p2p_worker_, p2p_worker_->submit(std::move(completion)));
  }

  static std::string describe(const detail::gloo_task& task) {
    static constexpr const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
                                            "send",       "recv",           "barrier",    "host_task", "p2p_wait"};
    std::string text = names[static_cast<int>(task.what)];
    if (task.what == task_kind::barrier || task.what == task_kind::function) return text;
    text += "(" + std::string(to_string(task.type)) + " x " + std::to_string(task.count);
    if (task.what == task_kind::all_reduce || task.what == task_kind::reduce_scatter)
      text += ", " + std::string(to_string(task.reduce));
    if (task.what == task_kind::broadcast) text += ", root " + std::to_string(task.peer);
    if (task.what == task_kind::send || task.what == task_kind::recv || task.what == task_kind::p2p_wait)
      text += ", peer " + std::to_string(task.peer);
    return text + ")";
  }

  void run(detail::gloo_task& task) {
    try {
      execute(task);
    } catch (const error&) {
      throw;
    } catch (const ::gloo::IoException& failure) {
      const std::string what = failure.what();
      if (what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos)
        throw timeout_error(rank_, "gloo." + describe(task), what,
                            "a peer did not enter the same collective within " +
                                detail::format_duration(options_.timeout) +
                                ": it hangs, crashed, issued collectives in another order, or "
                                "passed another size or dtype (COHORT_DEBUG=1 names the calls)");
      throw error(rank_, "gloo." + describe(task), what,
                  "a peer closed its connection: it crashed or exited early, or sizes differ "
                  "across ranks");
    } catch (const std::exception& failure) {
      throw error(rank_, "gloo." + describe(task), failure.what(),
                  "sizes or dtypes may differ across ranks (set COHORT_DEBUG=1 to check)");
    }
  }

  void execute(detail::gloo_task& task) {
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

  template <class T>
  void execute_sized(detail::gloo_task& task) {
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

  // Gloo matches messages by slot, and a message larger than the receiver expects aborts
  // the process from Gloo's I/O thread. Deriving the tag from what the call moves (kind,
  // dtype, count, op, root) makes mismatched calls use different slots: they never match,
  // and the mismatch surfaces as a timeout error on every rank instead of a crash.
  static std::uint64_t signature(const detail::gloo_task& task) {
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
    return hash.value();
  }
  static std::uint32_t collective_tag(const detail::gloo_task& task) {
    return static_cast<std::uint32_t>(signature(task) & 0x7fffffffu);
  }

  [[noreturn]] void throw_timeout(const detail::gloo_task& task) const {
    throw timeout_error(rank_, "gloo." + describe(task),
                        "no matching peer operation within " + detail::format_duration(options_.timeout),
                        "the peer never posted the matching send/recv with the same tag, size and dtype");
  }

  // Point-to-point slots carry the user tag and the message size (see signature), in a
  // range of their own, away from the slots Gloo's collectives use.
  static std::uint64_t point_to_point_slot(const detail::gloo_task& task) {
    return (1ull << 63) | (signature(task) >> 1);
  }

  std::vector<std::byte>& scratch_bytes(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_;
  }

  int rank_;
  int size_;
  options options_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::Context> context_;
  std::vector<std::byte> scratch_;       // used by the worker thread only
  std::shared_ptr<worker_type> worker_;  // last: their threads run run(), which uses the above
  std::shared_ptr<worker_type> p2p_worker_;
  std::mutex p2p_mutex_;
  std::vector<std::weak_ptr<detail::gloo_p2p>> live_p2p_;
};

}  // namespace cohort::inline v0
