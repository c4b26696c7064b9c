#pragma once
// The ordering primitive of host backends: one worker thread runs submitted tasks strictly
// in submission order, and a work handle is just (queue, sequence number). Completion is a
// single monotonically increasing counter, so waiting costs no lock and a handle costs no
// allocation; failures are rare and kept in a small side table.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "cohort/error.hpp"

namespace cohort::inline v0::detail {

template <class Task>
class fifo_worker {
 public:
  // run(task) executes one task on the worker thread; it may throw. After the first
  // failure every later task fails too without running (the group is considered aborted,
  // as a collective engine cannot recover from a half-finished collective).
  using runner = std::function<void(Task&)>;

  explicit fifo_worker(runner run) : run_(std::move(run)), thread_([this] { loop(); }) {}

  fifo_worker(const fifo_worker&) = delete;
  fifo_worker& operator=(const fifo_worker&) = delete;

  ~fifo_worker() { shutdown(); }

  // Runs everything already submitted, then stops the thread. Work handles that outlive
  // the owner stay valid: their tasks have completed by then.
  void shutdown() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  // Returns the task's sequence number (1-based).
  std::uint64_t submit(Task task) {
    std::uint64_t seq;
    bool sleeping;
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      seq = ++submitted_;
      queued_.store(tasks_.size(), std::memory_order_release);
      sleeping = worker_sleeping_;
    }
    // Waking a sleeping thread is a system call; a worker that is still polling (it just
    // finished the previous task) picks the task up without one.
    if (sleeping) ready_.notify_one();
    return seq;
  }

  bool done(std::uint64_t seq) const noexcept {
    return completed_.load(std::memory_order_acquire) >= seq;
  }

  // Waits until task seq has run; true when it did within the timeout.
  bool wait_until_done(std::uint64_t seq, std::chrono::steady_clock::time_point deadline) const {
    // A short spin first: most waits follow a collective that is about to finish, and a
    // futex sleep/wake costs more than the spin.
    for (int spin = 0; spin < 2000; ++spin)
      if (done(seq)) return true;
    std::uint64_t seen = completed_.load(std::memory_order_acquire);
    while (seen < seq) {
      if (deadline == std::chrono::steady_clock::time_point::max()) {
        completed_.wait(seen, std::memory_order_acquire);
      } else {
        std::unique_lock lock(mutex_);
        if (!completed_cv_.wait_until(lock, deadline, [&] { return done(seq); })) return false;
      }
      seen = completed_.load(std::memory_order_acquire);
    }
    return true;
  }

  // The failure of task seq, if it failed.
  std::exception_ptr failure(std::uint64_t seq) const {
    std::lock_guard lock(mutex_);
    auto it = failures_.find(seq);
    return it == failures_.end() ? nullptr : it->second;
  }

  std::exception_ptr first_failure() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }

 private:
  void loop() {
    for (;;) {
      // Poll briefly before sleeping: collectives are usually issued back to back, and a
      // futex wake-up costs more than the next call's arrival. Yielding keeps the poll
      // harmless when threads outnumber cores.
      const auto poll_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      while (queued_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < poll_until)
        std::this_thread::yield();
      Task task;
      {
        std::unique_lock lock(mutex_);
        if (tasks_.empty() && !stopping_) {
          worker_sleeping_ = true;
          ready_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
          worker_sleeping_ = false;
        }
        if (tasks_.empty()) return;  // stopping, and everything submitted has run
        task = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.store(tasks_.size(), std::memory_order_release);
      }
      const std::uint64_t seq = completed_.load(std::memory_order_relaxed) + 1;
      std::exception_ptr failed = first_failure_snapshot();
      if (!failed) {
        try {
          run_(task);
        } catch (...) {
          failed = std::current_exception();
          std::lock_guard lock(mutex_);
          first_failure_ = failed;
        }
      }
      {
        std::lock_guard lock(mutex_);
        if (failed) failures_.emplace(seq, failed);
        completed_.store(seq, std::memory_order_release);
      }
      completed_.notify_all();
      completed_cv_.notify_all();
    }
  }

  std::exception_ptr first_failure_snapshot() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }

  runner run_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  mutable std::condition_variable completed_cv_;
  std::deque<Task> tasks_;
  std::uint64_t submitted_ = 0;
  std::atomic<std::size_t> queued_{0};
  bool worker_sleeping_ = false;
  std::atomic<std::uint64_t> completed_{0};
  std::map<std::uint64_t, std::exception_ptr> failures_;
  std::exception_ptr first_failure_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace cohort::inline v0::detail
