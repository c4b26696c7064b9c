#pragma once
// Buffers in a backend's memory reused across operations (training_state's gathered layers
// and bucket gradients): take() hands out the smallest pooled buffer that fits, or allocates;
// trim_while() frees pooled buffers oldest first. Each buffer remembers the work that last
// used it and is freed only after that work completes; reuse needs no wait where every later
// use is queued in the same backend order (a device stream). A host caller that writes into a
// reused buffer itself waits for its last use first: take(bytes, true) prefers a buffer whose
// last use is done, larger if need be, to the smallest that fits, and the owner may allocate
// another (take_new) rather than wait, so that a backward asking for the next bucket's buffer
// does not wait for the reductions in flight.
// Not thread-safe: the owner locks.

#include <cstddef>
#include <optional>
#include <vector>

namespace cohort::inline v0::detail {

template <class B>
class buffer_pool {
 public:
  using work = typename B::work;
  struct buffer {
    void* data = nullptr;
    std::size_t capacity = 0;
    work last_use{};
  };

  explicit buffer_pool(B& engine) : engine_(&engine) {}
  buffer_pool(const buffer_pool&) = delete;
  buffer_pool& operator=(const buffer_pool&) = delete;
  ~buffer_pool() { clear(); }

  // The capacity take(bytes) would hand out from the pool, if any buffer fits.
  std::optional<std::size_t> fit(std::size_t bytes, bool prefer_idle = false) const {
    if (const auto i = best_fit(bytes, prefer_idle)) return free_[*i].capacity;
    return std::nullopt;
  }
  // Whether a pooled buffer of at least `bytes` is free to write now (its last use is done).
  bool idle_fits(std::size_t bytes) const {
    const auto i = best_fit(bytes, true);
    return i && idle(free_[*i]);
  }

  // A pooled buffer of at least `bytes` (the smallest; with `prefer_idle` the smallest whose
  // last use is done, if any), else a new allocation.
  buffer take(std::size_t bytes, bool prefer_idle = false) {
    if (const auto i = best_fit(bytes, prefer_idle)) {
      buffer b = std::move(free_[*i]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(*i));
      pooled_ -= b.capacity;
      return b;
    }
    return take_new(bytes);
  }
  // A new allocation, whatever the pool holds (counted in allocations()).
  buffer take_new(std::size_t bytes) {
    buffer b;
    b.data = engine_->allocate(bytes);
    b.capacity = bytes;
    ++allocations_;
    return b;
  }

  void put(buffer b) {
    pooled_ += b.capacity;
    free_.push_back(std::move(b));
  }

  // Frees pooled buffers, oldest first, while over() says the budget is exceeded.
  template <class Predicate>
  void trim_while(Predicate over) {
    while (!free_.empty() && over()) {
      pooled_ -= free_.front().capacity;
      release(free_.front());
      free_.erase(free_.begin());
    }
  }

  // Frees a buffer that is not pooled (once its last use is done).
  void release(buffer& b) noexcept {
    try {
      b.last_use.wait();
    } catch (...) {
      // A failed operation: the group is unusable, but the memory is still ours to free.
    }
    engine_->deallocate(b.data, b.capacity);
    b.data = nullptr;
  }

  void clear() noexcept {
    for (auto& b : free_) release(b);
    free_.clear();
    pooled_ = 0;
  }

  std::size_t pooled_bytes() const noexcept { return pooled_; }
  std::size_t allocations() const noexcept { return allocations_; }

 private:
  std::optional<std::size_t> best_fit(std::size_t bytes, bool prefer_idle) const {
    std::optional<std::size_t> best, best_idle;
    for (std::size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].capacity < bytes) continue;
      if (!best || free_[i].capacity < free_[*best].capacity) best = i;
      if (prefer_idle && idle(free_[i]) && (!best_idle || free_[i].capacity < free_[*best_idle].capacity))
        best_idle = i;
    }
    return best_idle ? best_idle : best;
  }
  // Its last use is done (or failed: the failure is the group's, reported where it is waited for).
  static bool idle(const buffer& b) noexcept {
    try {
      return b.last_use.test();
    } catch (...) {
      return true;
    }
  }

  B* engine_;
  std::vector<buffer> free_;
  std::size_t pooled_ = 0;
  std::size_t allocations_ = 0;
};

}  // namespace cohort::inline v0::detail
