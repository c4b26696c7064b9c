#pragma once
// A first-in first-out queue over one std::vector: what the work queues need of std::deque
// (push at the back, pop at the front, look at the front) without <deque>, which would cost
// every translation unit that includes the umbrella header.

#include <cstddef>
#include <utility>
#include <vector>

namespace cohort::inline v0::detail {

template <class T>
class fifo_queue {
 public:
  bool empty() const noexcept { return head_ == items_.size(); }
  std::size_t size() const noexcept { return items_.size() - head_; }

  T& front() { return items_[head_]; }
  const T& front() const { return items_[head_]; }

  void push_back(T value) { items_.push_back(std::move(value)); }

  // Front to back.
  auto begin() const noexcept { return items_.begin() + static_cast<std::ptrdiff_t>(head_); }
  auto end() const noexcept { return items_.end(); }

  // The popped element is destroyed at once (a task's captures, an event's handle), and the
  // vector is compacted once its dead front is half of it: amortised O(1) per element.
  void pop_front() {
    items_[head_] = T{};
    if (++head_ == items_.size()) {
      clear();
    } else if (head_ >= compact_after && 2 * head_ >= items_.size()) {
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

  void clear() noexcept {
    items_.clear();
    head_ = 0;
  }

  void swap(fifo_queue& other) noexcept {
    items_.swap(other.items_);
    std::swap(head_, other.head_);
  }

 private:
  static constexpr std::size_t compact_after = 32;
  std::vector<T> items_;
  std::size_t head_ = 0;
};

}  // namespace cohort::inline v0::detail
