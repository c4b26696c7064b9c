#pragma once
// sharded_parameters<Backend, T>: parameters of a model too large for one device (the
// ZeRO-3 / FSDP job). Each rank keeps 1/N of every unit (typically a layer); a unit's full
// weights exist only while a gather guard for it lives.
//
//   cohort::sharded_parameters<cohort::gloo, float> params{pg, {{w0, b0}, {w1, b1}}, {.prefetch = 1}};
//   params.scatter_from(0, full_parameters);           // or init_from_full, init_with
//   {
//     auto layer = params.gather(0);                   // all-gather into a pooled buffer
//     use(layer.param(0), layer.param(1));             // waits for the gather on first use
//   }                                                  // released: the buffer goes back to the pool
//   params.reduce_scatter_grad(0, full_gradient);      // each rank keeps its shard's average
//
// Everything the container issues runs in the backend's own order (Gloo: its FIFO worker;
// NCCL: the group's stream), so gathers, reductions and optimizer steps never race. On a
// device backend the caller's stream (set_stream) waits for a gather before using it, and
// the communication stream waits for the caller's stream before a released buffer is
// reused or a gradient is read.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cohort/detail/buffer_pool.hpp"
#include "cohort/detail/sharded_checkpoint.hpp"
#include "cohort/error.hpp"
#include "cohort/guards.hpp"
#include "cohort/ops.hpp"
#include "cohort/process_group.hpp"
#include "cohort/straggler.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// Which units a gather prefetches: the next ones in forward (u+1, u+2, ...) or backward
// (u-1, u-2, ...) order.
enum class prefetch_order { forward, backward };

struct sharded_options {
  // Gathers issued ahead of use, in the current prefetch_order.
  int prefetch = 0;
  // Bound on the bytes of gathered buffers alive at once (in use or prefetched). Prefetches
  // never exceed it: one that would waits (is issued later) until a release makes room.
  // 0: the (prefetch + 1) largest gathered units together, which gathers the caller asks for may
  // exceed; when set explicitly, a caller's gather past it waits for another thread to
  // release (up to limit_wait), then fails.
  std::size_t max_gathered_bytes = 0;
  std::chrono::milliseconds limit_wait{std::chrono::seconds(60)};
  // Gathered parameters' dtype (bfloat16 or half for mixed precision); default: master's.
  std::optional<dtype> gather_type{};
  // dtype gradients are reduced in; default: master's.
  std::optional<dtype> reduce_type{};
  // Units with fewer elements than this are replicated on every rank, not sharded: their
  // gathers would be latency-bound. Their gradients are all-reduced.
  std::size_t replicate_below = 0;
  // Straggler report (cohort/straggler.hpp; it must outlive the container): a gather
  // guard's wait() counts as waiting for communication (steps end elsewhere: the reducer's
  // finish() or the report's end_step()).
  straggler_report* straggler = nullptr;
};

// Bytes held by a sharded_parameters (and the optimizer state registered with it).
struct sharded_memory {
  std::size_t shards = 0;     // fp32 (master) parameter shards
  std::size_t gradients = 0;  // gradient shards
  std::size_t gathered = 0;   // gathered buffers alive (in use or prefetched)
  std::size_t pool = 0;       // released buffers kept for reuse, and reduction scratch
  std::size_t optimizer = 0;  // optimizer state shards
  std::size_t total() const noexcept { return shards + gradients + gathered + pool + optimizer; }
};

// What the container put on the wire, per rank, in the nccl-tests "bus bytes" convention:
// (n-1)/n of a unit for an all-gather or reduce-scatter, 2(n-1)/n for an all-reduce.
struct sharded_traffic {
  std::size_t gather_bytes = 0;
  std::size_t reduce_bytes = 0;
  std::size_t gathers = 0;
  std::size_t reductions = 0;
  std::size_t total() const noexcept { return gather_bytes + reduce_bytes; }
};

// Optimizer state that sharded checkpoints save and load with the parameters: per unit,
// state_count() shards of the unit's shard size in the master dtype.
template <class T>
class sharded_optimizer_state {
 public:
  virtual ~sharded_optimizer_state() = default;
  virtual std::string kind() const = 0;
  virtual std::size_t state_count() const = 0;
  virtual T* state(std::size_t unit, std::size_t index) = 0;
  virtual std::uint64_t steps() const = 0;
  virtual void set_steps(std::uint64_t steps) = 0;
};

template <backend B, class T = float>
class sharded_parameters {
 public:
  static_assert(std::is_floating_point_v<T>, "master parameters are float or double");
  using backend_type = B;
  using group_type = process_group<B>;
  using work = typename B::work;
  using stream_type = typename B::stream_type;

  // A unit's full parameters while alive. Movable, not copyable; the buffer goes back to
  // the pool when the last guard of the unit dies (or reset() is called).
  class gathered {
   public:
    gathered() = default;
    gathered(gathered&& other) noexcept { *this = std::move(other); }
    gathered& operator=(gathered&& other) noexcept {
      if (this != &other) {
        reset();
        owner_ = std::exchange(other.owner_, nullptr);
        unit_ = other.unit_;
        data_ = other.data_;
        ready_ = other.ready_;
        waited_ = other.waited_;
      }
      return *this;
    }
    gathered(const gathered&) = delete;
    gathered& operator=(const gathered&) = delete;
    ~gathered() { reset(); }

    explicit operator bool() const noexcept { return owner_ != nullptr; }
    std::size_t unit() const noexcept { return unit_; }
    std::size_t size() const { return layout().sizes.size(); }

    // The caller's order waits for the gather (host: the calling thread blocks; device:
    // the caller's stream waits). The accessors call it on first use.
    void wait() {
      check_alive("wait");
      if (waited_) return;
      if (straggler_report* report = owner_->options_.straggler; report && report->enabled()) {
        const auto start = straggler_report::clock::now();
        ready_.make_stream_wait(owner_->stream_);
        report->add_wait(wait_kind::gather, straggler_report::clock::now() - start);
      } else {
        ready_.make_stream_wait(owner_->stream_);
      }
      waited_ = true;
    }
    const work& ready() const noexcept { return ready_; }

    // Parameter i of the unit (E must be the gathered dtype).
    template <class E = T>
    std::span<E> param(std::size_t i) {
      check_type<E>();
      const auto& info = layout();
      if (i >= info.sizes.size())
        throw error(owner_->rank(), "sharded_parameters.gathered.param",
                    "parameter " + std::to_string(i) + " of unit " + std::to_string(unit_) + ", which has " +
                        std::to_string(info.sizes.size()),
                    "parameters are numbered in the order the unit listed their sizes");
      wait();
      return std::span<E>(static_cast<E*>(data_) + info.offsets[i], info.sizes[i]);
    }
    template <class E = T>
    std::vector<std::span<E>> params() {
      std::vector<std::span<E>> all;
      for (std::size_t i = 0; i < size(); ++i) all.push_back(param<E>(i));
      return all;
    }
    // The unit's parameters back to back (without padding).
    template <class E = T>
    std::span<E> flat() {
      check_type<E>();
      wait();
      return std::span<E>(static_cast<E*>(data_), layout().elements);
    }

    // Releases now (idempotent).
    void reset() noexcept {
      if (!owner_) return;
      auto* owner = std::exchange(owner_, nullptr);
      owner->release(unit_);
    }

   private:
    friend class sharded_parameters;
    gathered(sharded_parameters* owner, std::size_t unit, void* data, work ready)
        : owner_(owner), unit_(unit), data_(data), ready_(std::move(ready)) {}

    void check_alive(const char* what) const {
      if (!owner_)
        throw error(-1, std::string("sharded_parameters.gathered.") + what, "the guard was released or moved from",
                    "gather the unit again");
    }
    const auto& layout() const {
      check_alive("layout");
      return owner_->units_[unit_];
    }
    template <class E>
    void check_type() const {
      check_alive("param");
      if (dtype_v<E> != owner_->gather_type_)
        throw error(owner_->rank(), "sharded_parameters.gathered.param",
                    "asked for " + std::string(to_string(dtype_v<E>)) + " but unit " + std::to_string(unit_) +
                        " was gathered as " + std::string(to_string(owner_->gather_type_)),
                    "use param<E>() with E matching options.gather_type");
    }

    sharded_parameters* owner_ = nullptr;
    std::size_t unit_ = 0;
    void* data_ = nullptr;
    work ready_{};
    bool waited_ = false;
  };

  // Collective over `group` (and `replicas`, for hybrid sharding: shard inside `group`,
  // replicate across `replicas`, whose members hold the same shard index). `units`: each
  // unit's parameter sizes, in elements.
  sharded_parameters(group_type& group, std::vector<std::vector<std::size_t>> units, sharded_options opts = {},
                     group_type* replicas = nullptr);

  sharded_parameters(const sharded_parameters&) = delete;
  sharded_parameters& operator=(const sharded_parameters&) = delete;

  // Waits for everything queued, then frees every buffer. Guards must be gone by then.
  ~sharded_parameters();

  // --- layout ------------------------------------------------------------------------------
  int rank() const noexcept { return group_->rank(); }
  // The ranks the parameters are sharded over (the group's size).
  int world_size() const noexcept { return group_->world_size(); }
  group_type& group() noexcept { return *group_; }
  group_type* replicas() noexcept { return replicas_; }
  const sharded_options& options() const noexcept { return options_; }
  dtype gather_type() const noexcept { return gather_type_; }
  dtype reduce_type() const noexcept { return reduce_type_; }
  std::size_t unit_count() const noexcept { return units_.size(); }
  std::size_t parameters(std::size_t unit) const { return info(unit, "parameters").sizes.size(); }
  const std::vector<std::size_t>& parameter_sizes(std::size_t unit) const {
    return info(unit, "parameter_sizes").sizes;
  }
  std::size_t unit_elements(std::size_t unit) const { return info(unit, "unit_elements").elements; }
  std::size_t padded_elements(std::size_t unit) const { return info(unit, "padded_elements").padded; }
  std::size_t shard_elements(std::size_t unit) const { return info(unit, "shard_elements").shard; }
  bool replicated(std::size_t unit) const { return info(unit, "replicated").replicated; }
  // First element of the flattened unit this rank owns.
  std::size_t shard_offset(std::size_t unit) const {
    const auto& u = info(unit, "shard_offset");
    return u.replicated ? 0 : u.shard * static_cast<std::size_t>(rank());
  }
  // This rank's master shard and gradient shard (backend memory: host on Gloo, device on NCCL).
  std::span<T> shard(std::size_t unit) { return {info(unit, "shard").master, units_[unit].shard}; }
  std::span<T> grad_shard(std::size_t unit) { return {info(unit, "grad_shard").grad, units_[unit].shard}; }

  // The caller's stream on a device backend: gathers are ready on it, released buffers are
  // reused after what it queued, gradients are read after what it queued.
  void set_stream(stream_type stream) noexcept { stream_ = stream; }
  stream_type stream() const noexcept { return stream_; }

  void set_order(prefetch_order order) {
    std::lock_guard lock(mutex_);
    order_ = order;
    deferred_.clear();
  }
  prefetch_order order() const noexcept { return order_; }

  // --- initialisation (collective; each returns when the shards hold their values) --------
  // `parameters`: every parameter of every unit, unit after unit, full size, on every rank
  // (memory the backend's copy reads: host, or on NCCL host or device).
  template <class Range>
  void init_from_full(const Range& parameters) {
    auto all = spans_of(parameters, "init_from_full");
    check_parameter_list(all, "init_from_full");
    auto& engine = group_->backend();
    std::size_t next = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& info = units_[u];
      const std::size_t first = shard_offset(u);
      const std::size_t last = std::min(first + info.shard, info.elements);
      for (std::size_t p = 0; p < info.sizes.size(); ++p, ++next) {
        const std::size_t begin = std::max(first, info.offsets[p]);
        const std::size_t end = std::min(last, info.offsets[p] + info.sizes[p]);
        if (begin >= end) continue;
        engine.copy(info.master + (begin - first), all[next].data() + (begin - info.offsets[p]),
                    (end - begin) * sizeof(T));
      }
    }
    engine.record().wait();
  }

  // Rank `root` passes every parameter (as for init_from_full); the others pass nothing.
  // One unit at a time is broadcast into a pooled buffer and each rank keeps its shard, so
  // no rank but the root ever holds more than one full unit.
  template <class Range>
  void scatter_from(int root, const Range& parameters) {
    if (root < 0 || root >= world_size())
      throw error(rank(), "sharded_parameters.scatter_from",
                  "root " + std::to_string(root) + " in a world of " + std::to_string(world_size()));
    std::vector<std::span<const T>> all;
    if (rank() == root) {
      all = spans_of(parameters, "scatter_from");
      check_parameter_list(all, "scatter_from");
    }
    auto& engine = group_->backend();
    std::size_t next = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& info = units_[u];
      buffer staging = take_buffer(std::max<std::size_t>(info.padded, 1) * sizeof(T), true);
      T* flat = static_cast<T*>(staging.data);
      if (rank() == root) {
        for (std::size_t p = 0; p < info.sizes.size(); ++p, ++next)
          engine.copy(flat + info.offsets[p], all[next].data(), info.sizes[p] * sizeof(T));
        fill(engine, flat + info.elements, info.padded - info.elements, dtype_v<T>, 0.0);
      }
      group_->broadcast(std::span<T>(flat, info.padded), root);
      engine.copy(info.master, flat + shard_offset(u), info.shard * sizeof(T));
      staging.last_use = engine.record();
      staging.last_use.wait();
      give_back(staging);
    }
  }

  // fill(unit, parameter, first, values): write parameter elements [first, first +
  // values.size()) into values (host memory). Called only for the ranges this rank owns,
  // so no rank ever materialises the full model.
  void init_with(const std::function<void(std::size_t, std::size_t, std::size_t, std::span<T>)>& fill_range) {
    auto& engine = group_->backend();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& info = units_[u];
      std::vector<T> staging(info.shard, T(0));
      const std::size_t first = shard_offset(u);
      const std::size_t last = std::min(first + info.shard, info.elements);
      for (std::size_t p = 0; p < info.sizes.size(); ++p) {
        const std::size_t begin = std::max(first, info.offsets[p]);
        const std::size_t end = std::min(last, info.offsets[p] + info.sizes[p]);
        if (begin >= end) continue;
        fill_range(u, p, begin - info.offsets[p], std::span<T>(staging.data() + (begin - first), end - begin));
      }
      engine.copy(info.master, staging.data(), info.shard * sizeof(T)).wait();
    }
  }

  // --- gather ------------------------------------------------------------------------------
  // Collective. All ranks gather the same units in the same order.
  gathered gather(std::size_t unit);

  // Drops prefetched gathers nobody has used yet (their buffers go back to the pool).
  void drop_prefetched();

  // --- gradients ---------------------------------------------------------------------------
  // Collective. Averages the unit's full gradient across ranks (every replica too) and
  // leaves this rank its shard's part in grad_shard(unit); accumulate adds to what is there
  // (micro-steps). `gradient`: the unit's parameters back to back, or a list with one range
  // per parameter. It must stay unchanged until the returned work completes (on a device
  // backend: the caller's stream waits on it before reusing the buffer).
  template <contiguous_elements Gradient>
  work reduce_scatter_grad(std::size_t unit, const Gradient& gradient, bool accumulate = false) {
    using E = element_type_of<Gradient>;
    const E* data = std::data(gradient);
    const std::size_t size = std::size(gradient);
    if (size != info(unit, "reduce_scatter_grad").elements)
      throw error(rank(), "sharded_parameters.reduce_scatter_grad",
                  "unit " + std::to_string(unit) + " has " + std::to_string(units_[unit].elements) +
                      " elements but the gradient has " + std::to_string(size),
                  "pass the unit's full gradient (its parameters back to back)");
    std::vector<region> regions{{data, size}};
    return reduce_regions(unit, dtype_v<E>, regions, accumulate);
  }

  template <list_of_contiguous_elements Gradients>
  work reduce_scatter_grad(std::size_t unit, const Gradients& per_parameter, bool accumulate = false) {
    using E = element_type_of<std::remove_cvref_t<decltype(*std::begin(per_parameter))>>;
    const auto& u = info(unit, "reduce_scatter_grad");
    std::vector<region> regions;
    for (const auto& part : per_parameter) {
      const std::size_t p = regions.size();
      if (p >= u.sizes.size() || std::size(part) != u.sizes[p])
        throw error(rank(), "sharded_parameters.reduce_scatter_grad",
                    "gradient " + std::to_string(p) + " of unit " + std::to_string(unit) + " has " +
                        std::to_string(std::size(part)) + " elements; the unit's parameters have " +
                        describe_sizes(u.sizes),
                    "pass one gradient per parameter, in the unit's order");
      regions.push_back({static_cast<const void*>(std::data(part)), std::size(part)});
    }
    if (regions.size() != u.sizes.size())
      throw error(rank(), "sharded_parameters.reduce_scatter_grad",
                  std::to_string(regions.size()) + " gradients for unit " + std::to_string(unit) + " of " +
                      std::to_string(u.sizes.size()) + " parameters",
                  "pass one gradient per parameter");
    return reduce_regions(unit, dtype_v<E>, regions, accumulate);
  }

  // Sets every gradient shard to zero (queued in the backend's order).
  work zero_grad();

  // Completes when everything the container queued so far has.
  work record() { return group_->backend().record(); }

  // --- checkpoints -------------------------------------------------------------------------
  // Collective over the shard group: every parameter in full, on shard rank `root` (empty
  // elsewhere), in unit order. One unit is materialised at a time.
  std::vector<std::vector<T>> gather_full_state(int root = 0);

  // Collective: each rank writes its shards (and the optimizer's, if given) to
  // directory/shard-<rank>-of-<world>.bin atomically. Under hybrid sharding replica 0 writes.
  // directory may be a std::filesystem::path (it converts).
  void save_sharded(const std::string& directory, sharded_optimizer_state<T>* optimizer = nullptr);

  // Collective: loads what save_sharded wrote, from any world size (every rank reads the
  // ranges it now owns from the old shard files; the directory must be visible to all).
  void load_sharded(const std::string& directory, sharded_optimizer_state<T>* optimizer = nullptr);

  // --- accounting --------------------------------------------------------------------------
  sharded_memory memory() const {
    std::lock_guard lock(mutex_);
    return memory_;
  }
  // Each field's peak, and the peak of the total (peak_total; not the sum of the fields).
  sharded_memory peak_memory() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  std::size_t peak_total() const {
    std::lock_guard lock(mutex_);
    return peak_total_;
  }
  void reset_peak() {
    std::lock_guard lock(mutex_);
    peak_ = memory_;
    peak_total_ = memory_.total();
  }
  sharded_traffic traffic() const {
    std::lock_guard lock(mutex_);
    return traffic_;
  }
  void reset_traffic() {
    std::lock_guard lock(mutex_);
    traffic_ = {};
  }
  // Allocations the pool made (a reused buffer is not one).
  std::size_t allocations() const {
    std::lock_guard lock(mutex_);
    return pool_.allocations();
  }
  std::size_t largest_gather_bytes() const noexcept { return largest_gather_bytes_; }
  std::size_t gather_limit() const noexcept { return limit_; }

  // Optimizers register their state here so memory() counts it.
  void account_optimizer(std::ptrdiff_t bytes) {
    std::lock_guard lock(mutex_);
    memory_.optimizer = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(memory_.optimizer) + bytes);
    note_peak();
  }

 private:
  struct unit_layout {
    std::vector<std::size_t> sizes;
    std::vector<std::size_t> offsets;
    std::size_t elements = 0;
    std::size_t padded = 0;
    std::size_t shard = 0;
    bool replicated = false;
    T* master = nullptr;  // in shard_buffers_
    T* grad = nullptr;
  };
  using buffer = typename detail::buffer_pool<B>::buffer;
  struct live_gather {
    buffer buf;
    work ready;
    int users = 0;
    bool prefetched = true;
  };
  struct region {
    const void* data;
    std::size_t count;
  };

  const unit_layout& info(std::size_t unit, const char* operation) const {
    if (unit >= units_.size())
      throw error(rank(), std::string("sharded_parameters.") + operation,
                  "unit " + std::to_string(unit) + " of " + std::to_string(units_.size()),
                  "units are numbered in the order they were given to the constructor");
    return units_[unit];
  }

  static std::string describe_sizes(const std::vector<std::size_t>& sizes) {
    std::string text = "[";
    for (std::size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
    return text + "]";
  }

  template <class Range>
  std::vector<std::span<const T>> spans_of(const Range& parameters, const char*) const {
    std::vector<std::span<const T>> all;
    for (const auto& p : parameters) all.emplace_back(std::data(p), std::size(p));
    return all;
  }

  void check_parameter_list(const std::vector<std::span<const T>>& all, const char* operation) const {
    std::size_t next = 0;
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (std::size_t p = 0; p < units_[u].sizes.size(); ++p, ++next)
        if (next >= all.size() || all[next].size() != units_[u].sizes[p])
          throw error(rank(), std::string("sharded_parameters.") + operation,
                      "parameter " + std::to_string(next) + " (unit " + std::to_string(u) + ", #" + std::to_string(p) +
                          ") expects " + std::to_string(units_[u].sizes[p]) + " elements, got " +
                          (next < all.size() ? std::to_string(all[next].size()) : std::string("none")),
                      "pass every parameter of every unit, unit after unit, at full size");
    if (next != all.size())
      throw error(rank(), std::string("sharded_parameters.") + operation,
                  std::to_string(all.size()) + " parameters given, the units hold " + std::to_string(next));
  }

  // --- pool (mutex_ held by callers, except the checkpoint helpers which take it) --------
  void note_peak() {
    peak_.shards = std::max(peak_.shards, memory_.shards);
    peak_.gradients = std::max(peak_.gradients, memory_.gradients);
    peak_.gathered = std::max(peak_.gathered, memory_.gathered);
    peak_.pool = std::max(peak_.pool, memory_.pool);
    peak_.optimizer = std::max(peak_.optimizer, memory_.optimizer);
    peak_total_ = std::max(peak_total_, memory_.total());
  }

  // Frees pooled buffers while gathered + pooled bytes exceed the limit (plus `incoming`).
  void trim_pool(std::size_t incoming = 0) {
    pool_.trim_while([&] { return memory_.gathered + pool_.pooled_bytes() + incoming > limit_; });
    memory_.pool = pool_.pooled_bytes();
  }

  // A buffer of at least `bytes` from the pool or newly allocated (after trimming the pool
  // to make room). Scratch is counted under gathered while it is out.
  buffer take_buffer(std::size_t bytes, bool lock_needed) {
    std::unique_lock lock(mutex_, std::defer_lock);
    if (lock_needed) lock.lock();
    if (!pool_.fit(bytes)) trim_pool(bytes);
    buffer b = pool_.take(bytes);
    memory_.pool = pool_.pooled_bytes();
    memory_.gathered += b.capacity;
    note_peak();
    return b;
  }

  void give_back(buffer& b, bool lock_needed = true) {
    std::unique_lock lock(mutex_, std::defer_lock);
    if (lock_needed) lock.lock();
    memory_.gathered -= b.capacity;
    pool_.put(std::move(b));
    memory_.pool = pool_.pooled_bytes();
    trim_pool();
    note_peak();
  }

  std::size_t gather_bytes(std::size_t unit) const { return units_[unit].padded * size_of(gather_type_); }

  // Issues unit's gather into a pooled buffer (mutex_ held).
  typename std::map<std::size_t, live_gather>::iterator issue_gather(std::size_t unit, bool demanded,
                                                                     std::unique_lock<std::mutex>& lock) {
    const std::size_t bytes = std::max<std::size_t>(gather_bytes(unit), 1);
    if (demanded && memory_.gathered + bytes > limit_) {
      // Unused prefetches give way to what the caller needs now.
      for (auto it = live_.begin(); it != live_.end();) it = it->second.users == 0 ? retire(it) : std::next(it);
      if (options_.max_gathered_bytes && memory_.gathered > 0 && memory_.gathered + bytes > limit_) {
        const bool fits = released_.wait_for(
            lock, options_.limit_wait, [&] { return memory_.gathered == 0 || memory_.gathered + bytes <= limit_; });
        if (!fits)
          throw error(rank(), "sharded_parameters.gather(" + std::to_string(unit) + ")",
                      std::to_string(memory_.gathered) + " bytes of gathered units are alive and unit " +
                          std::to_string(unit) + " needs " + std::to_string(bytes) + " more, past the limit of " +
                          std::to_string(limit_) + " bytes",
                      "release guards sooner, or raise options.max_gathered_bytes");
      }
    }
    buffer buf = take_buffer(bytes, false);
    auto& engine = group_->backend();
    const auto& u = units_[unit];
    work ready;
    if (u.replicated) {
      ready = gather_type_ == dtype_v<T> ? engine.copy(buf.data, u.master, u.elements * sizeof(T))
                                         : cast(engine, u.master, dtype_v<T>, buf.data, gather_type_, u.elements);
    } else if (gather_type_ == dtype_v<T>) {
      ready =
          group_->all_gather(std::span<const T>(u.master, u.shard), std::span<T>(static_cast<T*>(buf.data), u.padded));
    } else {
      const std::size_t element_bytes = size_of(gather_type_);
      void* own = static_cast<char*>(buf.data) + static_cast<std::size_t>(rank()) * u.shard * element_bytes;
      cast(engine, u.master, dtype_v<T>, own, gather_type_, u.shard);
      visit_dtype(gather_type_, [&](auto sample) {
        using G = decltype(sample);
        G* full = static_cast<G*>(buf.data);
        ready = group_->all_gather(std::span<const G>(full + static_cast<std::size_t>(rank()) * u.shard, u.shard),
                                   std::span<G>(full, u.padded));
      });
    }
    if (!u.replicated) {
      traffic_.gather_bytes += (static_cast<std::size_t>(world_size()) - 1) * u.shard * size_of(gather_type_);
      ++traffic_.gathers;
    }
    buf.last_use = ready;
    live_gather entry;
    entry.buf = std::move(buf);
    entry.ready = ready;
    note_peak();
    return live_.emplace(unit, std::move(entry)).first;
  }

  void schedule_prefetch(std::size_t unit) {
    if (options_.prefetch == 0) return;
    deferred_.clear();
    for (int k = 1; k <= options_.prefetch; ++k) {
      const auto step = static_cast<std::size_t>(k);
      if (order_ == prefetch_order::forward) {
        if (unit + step >= units_.size()) break;
        deferred_.push_back(unit + step);
      } else {
        if (step > unit) break;
        deferred_.push_back(unit - step);
      }
    }
    // Prefetches of another order or depth nobody will use: give their memory back.
    for (auto it = live_.begin(); it != live_.end();) {
      const bool wanted = std::find(deferred_.begin(), deferred_.end(), it->first) != deferred_.end();
      it = it->second.users == 0 && !wanted ? retire(it) : std::next(it);
    }
    std::erase_if(deferred_, [&](std::size_t u) { return live_.count(u) > 0; });
    issue_deferred();
  }

  // Issues waiting prefetches, in order, while they fit under the limit (mutex_ held).
  void issue_deferred() {
    std::unique_lock<std::mutex> unused;
    while (!deferred_.empty()) {
      const std::size_t next = deferred_.front();
      const std::size_t bytes = std::max<std::size_t>(gather_bytes(next), 1);
      const std::size_t cost = pool_.fit(bytes).value_or(bytes);
      if (memory_.gathered + cost > limit_) break;
      deferred_.erase(deferred_.begin());
      issue_gather(next, false, unused);
    }
  }

  // Returns a live gather's buffer to the pool (mutex_ held).
  typename std::map<std::size_t, live_gather>::iterator retire(
      typename std::map<std::size_t, live_gather>::iterator it) {
    auto& entry = it->second;
    // The next user of this buffer waits for what the caller queued so far, which includes
    // every read of these weights (a stream on a device backend; nothing left on the host).
    group_->backend().wait_for_caller(stream_);
    give_back(entry.buf, false);
    return live_.erase(it);
  }

  void release(std::size_t unit) noexcept {
    try {
      std::lock_guard lock(mutex_);
      auto it = live_.find(unit);
      if (it == live_.end()) return;
      if (--it->second.users > 0) return;
      retire(it);
      trim_pool();
      issue_deferred();
    } catch (...) {
      // Releasing must not throw (guards die during unwinding); a failed group reports
      // its error on the next wait.
    }
    released_.notify_all();
  }

  // Orders the backend `engine` after `w` (host: block; device: its stream waits).
  template <class Engine, class Work>
  static void order_after(Engine& engine, const Work& w) {
    w.make_stream_wait(engine.stream());
  }

  template <class Fn>
  static void typed(dtype type, Fn&& fn) {
    visit_dtype(type, [&](auto sample) { fn(sample); });
  }

  work reduce_regions(std::size_t unit, dtype from, const std::vector<region>& regions, bool accumulate) {
    auto& engine = group_->backend();
    auto& u = units_[unit];
    engine.wait_for_caller(stream_);
    const std::size_t reduce_bytes = size_of(reduce_type_);
    std::vector<buffer> scratch;
    auto take_scratch = [&](std::size_t bytes) {
      scratch.push_back(take_buffer(std::max<std::size_t>(bytes, 1), true));
      return scratch.back().data;
    };

    // The input to reduce: the caller's buffer when it already is one flat, padded run of
    // the reduce dtype, else a scratch copy (cast, padded with zeros).
    const void* input = nullptr;
    const std::size_t reduced = u.padded;
    if (regions.size() == 1 && from == reduce_type_ && reduced == u.elements) {
      input = regions[0].data;
    } else {
      void* flat = take_scratch(reduced * reduce_bytes);
      std::size_t offset = 0;
      std::vector<copy_region> copies;
      for (const auto& r : regions) {
        void* target = static_cast<char*>(flat) + offset * reduce_bytes;
        if (from == reduce_type_)
          copies.push_back({target, r.data, r.count * reduce_bytes});
        else
          cast(engine, r.data, from, target, reduce_type_, r.count);
        offset += r.count;
      }
      if (!copies.empty()) batched_copy(engine, std::span<const copy_region>(copies));
      fill(engine, static_cast<char*>(flat) + u.elements * reduce_bytes, reduced - u.elements, reduce_type_, 0.0);
      input = flat;
    }

    // The reduced shard: straight into the gradient shard when dtypes allow, else scratch.
    const bool direct = reduce_type_ == dtype_v<T> && !accumulate;
    void* output = direct ? static_cast<void*>(u.grad) : take_scratch(u.shard * reduce_bytes);
    work done;
    const std::size_t n = static_cast<std::size_t>(world_size());
    typed(reduce_type_, [&](auto sample) {
      using R = decltype(sample);
      if (u.replicated)
        done = group_->all_reduce(std::span<const R>(static_cast<const R*>(input), u.elements),
                                  std::span<R>(static_cast<R*>(output), u.elements), op::avg);
      else
        done = group_->reduce_scatter(std::span<const R>(static_cast<const R*>(input), u.padded),
                                      std::span<R>(static_cast<R*>(output), u.shard), op::avg);
    });
    if (n > 1) {
      traffic_add_reduce(u.replicated ? 2 * (n - 1) * u.elements * reduce_bytes / n : (n - 1) * u.shard * reduce_bytes);
    }
    if (replicas_ && replicas_->world_size() > 1) {
      auto& other = replicas_->backend();
      order_after(other, done);
      typed(reduce_type_, [&](auto sample) {
        using R = decltype(sample);
        done = replicas_->all_reduce(std::span<R>(static_cast<R*>(output), u.shard), op::avg);
      });
      const std::size_t m = static_cast<std::size_t>(replicas_->world_size());
      traffic_add_reduce(2 * (m - 1) * u.shard * reduce_bytes / m);
      order_after(engine, done);
    }
    if (!direct) done = cohort::accumulate(engine, output, reduce_type_, u.grad, dtype_v<T>, u.shard, accumulate);
    if (!direct || (replicas_ && replicas_->world_size() > 1)) done = engine.record();
    for (auto& b : scratch) {
      b.last_use = done;
      give_back(b);
    }
    return done;
  }

  void traffic_add_reduce(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    traffic_.reduce_bytes += bytes;
    ++traffic_.reductions;
  }

  void free_all() noexcept {
    for (auto& [unit, entry] : live_) pool_.release(entry.buf);
    live_.clear();
    pool_.clear();
    memory_.pool = 0;
    for (auto& u : units_) u.master = u.grad = nullptr;
    shard_buffers_.clear();
  }

  void check_checkpoint(const detail::checkpoint_header& header, sharded_optimizer_state<T>* optimizer,
                        const std::string& directory) const {
    auto fail = [&](const std::string& what, const std::string& hint) {
      throw error(rank(), "sharded_parameters.load_sharded", directory + ": " + what, hint);
    };
    if (header.type != static_cast<std::uint32_t>(dtype_v<T>))
      fail("saved as " + std::string(to_string(static_cast<dtype>(header.type))) + ", loading into " +
               std::string(to_string(dtype_v<T>)),
           "load with the master dtype the checkpoint was saved with");
    if (header.units.size() != units_.size())
      fail(std::to_string(header.units.size()) + " units saved, " + std::to_string(units_.size()) + " here",
           "build the container from the same model");
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (header.units[u].sizes != units_[u].sizes)
        fail("unit " + std::to_string(u) + " saved with sizes " + describe_sizes(header.units[u].sizes) + ", here " +
                 describe_sizes(units_[u].sizes),
             "build the container from the same model");
    if (optimizer) {
      if (header.optimizer != optimizer->kind() || header.states != optimizer->state_count())
        fail("optimizer state saved for '" + header.optimizer + "' (" + std::to_string(header.states) +
                 " tensors per unit), loading into '" + optimizer->kind() + "' (" +
                 std::to_string(optimizer->state_count()) + ")",
             "load with the optimizer (and options) the checkpoint was saved with, or without one");
    }
  }

  group_type* group_;
  group_type* replicas_;
  sharded_options options_;
  dtype gather_type_;
  dtype reduce_type_;
  std::vector<unit_layout> units_;
  std::size_t largest_gather_bytes_ = 0;
  std::size_t limit_ = 0;
  stream_type stream_{};
  prefetch_order order_ = prefetch_order::forward;

  mutable std::mutex mutex_;
  std::condition_variable released_;
  std::map<std::size_t, live_gather> live_;
  detail::buffer_pool<B> pool_;
  std::vector<detail::backend_buffer<B>> shard_buffers_;  // own every unit's master and gradient shard
  std::vector<std::size_t> deferred_;                     // a handful of units: a vector is the queue
  sharded_memory memory_;
  sharded_memory peak_;
  std::size_t peak_total_ = 0;
  sharded_traffic traffic_;
};

template <backend B, class T>
sharded_parameters<B, T>::sharded_parameters(group_type& group, std::vector<std::vector<std::size_t>> units,
                                             sharded_options opts, group_type* replicas)
    : group_(&group),
      replicas_(replicas),
      options_(opts),
      gather_type_(opts.gather_type.value_or(dtype_v<T>)),
      reduce_type_(opts.reduce_type.value_or(dtype_v<T>)),
      pool_(group.backend()) {
  if (opts.prefetch < 0)
    throw error(rank(), "sharded_parameters", "prefetch depth " + std::to_string(opts.prefetch),
                "use 0 (no prefetch) or a positive depth");
  for (dtype type : {gather_type_, reduce_type_})
    if (type != dtype::float32 && type != dtype::float64 && type != dtype::float16 && type != dtype::bfloat16)
      throw error(rank(), "sharded_parameters", "gather/reduce dtype " + std::string(to_string(type)),
                  "use a floating-point dtype (float, double, half, bfloat16)");
  const std::size_t world = static_cast<std::size_t>(group.world_size());
  for (auto& sizes : units) {
    unit_layout info;
    info.sizes = std::move(sizes);
    for (std::size_t size : info.sizes) {
      info.offsets.push_back(info.elements);
      info.elements += size;
    }
    info.replicated = world == 1 || info.elements < opts.replicate_below;
    info.padded = info.replicated ? info.elements : (info.elements + world - 1) / world * world;
    info.shard = info.replicated ? info.elements : info.padded / world;
    units_.push_back(std::move(info));
  }
  // Automatic limit: the prefetch + 1 largest units, so gathered and pooled buffers
  // together never exceed what depth `prefetch` needs at its worst.
  std::vector<std::size_t> sizes;
  for (std::size_t u = 0; u < units_.size(); ++u) sizes.push_back(std::max<std::size_t>(gather_bytes(u), 1));
  std::sort(sizes.rbegin(), sizes.rend());
  largest_gather_bytes_ = sizes.empty() ? 0 : sizes.front();
  std::size_t automatic = 0;
  for (std::size_t i = 0; i < sizes.size() && i <= static_cast<std::size_t>(opts.prefetch); ++i) automatic += sizes[i];
  limit_ = opts.max_gathered_bytes ? opts.max_gathered_bytes : automatic;
  auto& engine = group.backend();
  shard_buffers_.reserve(2 * units_.size());
  for (auto& info : units_) {
    const std::size_t bytes = std::max<std::size_t>(info.shard, 1) * sizeof(T);
    info.master = shard_buffers_.emplace_back(engine, bytes).template as<T>();
    info.grad = shard_buffers_.emplace_back(engine, bytes).template as<T>();
    memory_.shards += bytes;
    memory_.gradients += bytes;
    fill(engine, info.master, info.shard, dtype_v<T>, 0.0);
    fill(engine, info.grad, info.shard, dtype_v<T>, 0.0);
  }
  engine.record().wait();
  note_peak();
}

template <backend B, class T>
sharded_parameters<B, T>::~sharded_parameters() {
  try {
    group_->backend().record().wait();
  } catch (...) {
    // The group failed; the buffers are freed regardless.
  }
  free_all();
}

template <backend B, class T>
auto sharded_parameters<B, T>::gather(std::size_t unit) -> gathered {
  info(unit, "gather");
  std::unique_lock lock(mutex_);
  auto it = live_.find(unit);
  if (it == live_.end()) {
    std::erase(deferred_, unit);
    it = issue_gather(unit, true, lock);
  }
  it->second.users += 1;
  it->second.prefetched = false;
  gathered guard(this, unit, it->second.buf.data, it->second.ready);
  schedule_prefetch(unit);
  return guard;
}

template <backend B, class T>
auto sharded_parameters<B, T>::drop_prefetched() -> void {
  std::lock_guard lock(mutex_);
  deferred_.clear();
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->second.users == 0)
      it = retire(it);
    else
      ++it;
  }
  trim_pool();
}

template <backend B, class T>
auto sharded_parameters<B, T>::zero_grad() -> work {
  auto& engine = group_->backend();
  for (auto& u : units_) fill(engine, u.grad, u.shard, dtype_v<T>, 0.0);
  return engine.record();
}

template <backend B, class T>
auto sharded_parameters<B, T>::gather_full_state(int root) -> std::vector<std::vector<T>> {
  std::vector<std::vector<T>> out;
  auto& engine = group_->backend();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    auto& info = units_[u];
    buffer full = take_buffer(std::max<std::size_t>(info.padded, 1) * sizeof(T), true);
    work done = info.replicated ? engine.copy(full.data, info.master, info.elements * sizeof(T))
                                : group_->all_gather(std::span<const T>(info.master, info.shard),
                                                     std::span<T>(static_cast<T*>(full.data), info.padded));
    done.wait();
    if (rank() == root) {
      for (std::size_t p = 0; p < info.sizes.size(); ++p) {
        out.emplace_back(info.sizes[p]);
        engine.copy(out.back().data(), static_cast<T*>(full.data) + info.offsets[p], info.sizes[p] * sizeof(T));
      }
    }
    full.last_use = engine.record();
    full.last_use.wait();
    give_back(full);
  }
  return out;
}

template <backend B, class T>
auto sharded_parameters<B, T>::save_sharded(const std::string& directory, sharded_optimizer_state<T>* optimizer)
    -> void {
  auto& engine = group_->backend();
  engine.record().wait();
  const bool writer = !replicas_ || replicas_->rank() == 0;
  if (writer) {
    detail::create_checkpoint_directory(directory, rank());
    const std::size_t states = optimizer ? optimizer->state_count() : 0;
    detail::checkpoint_header header;
    header.world = static_cast<std::uint32_t>(world_size());
    header.rank = static_cast<std::uint32_t>(rank());
    header.type = static_cast<std::uint32_t>(dtype_v<T>);
    header.optimizer = optimizer ? optimizer->kind() : std::string();
    header.steps = optimizer ? optimizer->steps() : 0;
    header.states = static_cast<std::uint32_t>(states);
    for (auto& u : units_) header.units.push_back({u.replicated, u.elements, u.padded, u.shard, u.sizes});
    std::vector<T> staging;
    atomic_write_file(
        detail::join_path(directory, detail::shard_file_name(rank(), world_size())),
        [&](std::ostream& out) {
          header.write(out);
          for (std::size_t u = 0; u < units_.size(); ++u) {
            const std::size_t n = units_[u].shard;
            staging.resize(n);
            for (std::size_t k = 0; k <= states; ++k) {
              const T* source = k == 0 ? units_[u].master : optimizer->state(u, k - 1);
              engine.copy(staging.data(), source, n * sizeof(T)).wait();
              out.write(reinterpret_cast<const char*>(staging.data()), static_cast<std::streamsize>(n * sizeof(T)));
            }
          }
        },
        rank());
  }
  group_->barrier().wait();
  if (replicas_) replicas_->barrier().wait();
}

template <backend B, class T>
auto sharded_parameters<B, T>::load_sharded(const std::string& directory, sharded_optimizer_state<T>* optimizer)
    -> void {
  detail::checkpoint_reader files(directory, rank());
  const auto& header = files.headers()[0];
  check_checkpoint(header, optimizer, directory);
  const std::size_t states = optimizer ? optimizer->state_count() : 0;
  // Where unit u's data starts in every file (all files share the layout).
  std::vector<std::uint64_t> unit_start(units_.size());
  std::uint64_t position = header.data_offset;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    unit_start[u] = position;
    position += (1 + header.states) * header.units[u].shard * sizeof(T);
  }
  auto& engine = group_->backend();
  std::vector<T> staging;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const auto& saved = header.units[u];
    const auto& now = units_[u];
    const std::size_t first = shard_offset(u);
    for (std::size_t k = 0; k <= states; ++k) {
      staging.assign(now.shard, T(0));
      const std::size_t end = std::min(first + now.shard, now.elements);
      for (std::size_t begin = first; begin < end;) {
        // The old file holding element `begin`, and how far it goes.
        const std::uint32_t source = saved.replicated ? 0u : static_cast<std::uint32_t>(begin / saved.shard);
        const std::size_t source_first = saved.replicated ? 0 : source * saved.shard;
        const std::size_t stop = std::min(end, source_first + saved.shard);
        files.read(source, unit_start[u] + (k * saved.shard + (begin - source_first)) * sizeof(T),
                   staging.data() + (begin - first), (stop - begin) * sizeof(T), u);
        begin = stop;
      }
      T* target = k == 0 ? now.master : optimizer->state(u, k - 1);
      engine.copy(target, staging.data(), now.shard * sizeof(T)).wait();
    }
  }
  if (optimizer) optimizer->set_steps(header.steps);
  group_->barrier().wait();
}

}  // namespace cohort::inline v0
