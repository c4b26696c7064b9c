#pragma once
// The ordering primitive of host backends: submitted tasks run strictly in submission
// order, one at a time, and a work handle is just (queue, sequence number).
//
// A worker thread gives asynchronous progress (a bucket's all-reduce runs while the
// backward pass computes). A thread that waits for a task that has not started yet runs
// the queued tasks up to it itself instead of handing them to the worker and sleeping:
// issue-then-wait then costs no thread hand-off at all, which is what keeps the wrapper
// free next to the raw engine call. Completion is one monotonically increasing counter,
// so checking a handle takes no lock; failures are rare and kept in a side table.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "cohort/comm/detail/fifo_queue.hpp"

namespace cohort::inline v0::detail {

template <class Task>
class fifo_worker {
 public:
  // run(task) executes one task; it may throw. After the first failure every later task
  // fails with that error without running (the group is considered aborted, as a collective
  // engine cannot recover from a half-finished collective).
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
    ready_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Returns the task's sequence number (1-based).
  std::uint64_t submit(Task task) {
    std::uint64_t seq;
    bool sleeping;
    {
      std::lock_guard lock(mutex_);
      seq = ++submitted_;
      tasks_.push_back(queued{seq, std::move(task)});
      sleeping = worker_sleeping_;
    }
    // Waking a sleeping thread is a system call; a worker that is awake (running a task)
    // finds the next one without it.
    if (sleeping) ready_.notify_one();
    return seq;
  }

  bool done(std::uint64_t seq) const noexcept { return completed_.load(std::memory_order_acquire) >= seq; }

  // Waits until task seq has run, running queued tasks up to it on this thread when no
  // one else is running one. True when done by the deadline.
  bool wait_until_done(std::uint64_t seq, std::chrono::steady_clock::time_point deadline) {
    if (done(seq)) return true;
    std::unique_lock lock(mutex_);
    while (!done(seq)) {
      if (!executing_ && !tasks_.empty() && tasks_.front().seq <= seq) {
        run_front(lock);
        continue;
      }
      if (deadline == std::chrono::steady_clock::time_point::max()) {
        completed_cv_.wait(lock);
      } else if (completed_cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return done(seq);
      }
    }
    return true;
  }

  // The failure of task seq, if it failed. Every wait asks, so the common case (nothing
  // ever failed) is one atomic load, not a lock.
  std::exception_ptr failure(std::uint64_t seq) const {
    if (!any_failure_.load(std::memory_order_acquire)) return nullptr;
    std::lock_guard lock(mutex_);
    auto it = failures_.find(seq);
    if (it == failures_.end()) return nullptr;
    failure_reported_ = true;
    return it->second;
  }

  // The first failure, when no one has asked for any failure (failure() returning one) in
  // the `grace` since it happened: a failure that no wait or test will report in time.
  std::exception_ptr unreported_failure(std::chrono::steady_clock::duration grace) const {
    if (!any_failure_.load(std::memory_order_acquire)) return nullptr;
    std::lock_guard lock(mutex_);
    if (failure_reported_ || std::chrono::steady_clock::now() - first_failure_at_ < grace) return nullptr;
    return first_failure_;
  }

 private:
  struct queued {
    std::uint64_t seq;
    Task task;
  };

  // Pops and runs the front task. The lock is held on entry and on return, and released
  // while the task runs; `executing_` keeps every other thread from starting the next one.
  void run_front(std::unique_lock<std::mutex>& lock) {
    queued next = std::move(tasks_.front());
    tasks_.pop_front();
    executing_ = true;
    std::exception_ptr failed = first_failure_;
    lock.unlock();
    if (!failed) {
      try {
        run_(next.task);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    lock.lock();
    if (failed) {
      if (!first_failure_) {
        first_failure_ = failed;
        first_failure_at_ = std::chrono::steady_clock::now();
      }
      failures_.emplace(next.seq, failed);
      any_failure_.store(true, std::memory_order_release);
    }
    executing_ = false;
    completed_.store(next.seq, std::memory_order_release);
    completed_cv_.notify_all();
    // Wake a sleeping worker only for work it can take: a needless wake-up after every
    // caller-run task puts a thread on the cores just as the caller's next call starts.
    if (worker_sleeping_ && (!tasks_.empty() || stopping_)) ready_.notify_one();
  }

  void loop() {
    for (;;) {
      // No polling before sleeping: a thread that waits runs the work itself (see
      // wait_until_done), so the worker matters only for progress in the background, where
      // a futex wake-up is small next to a collective, and a polling thread would take the
      // core from the ranks on machines with few cores.
      std::unique_lock lock(mutex_);
      const auto can_run = [&] { return !tasks_.empty() && !executing_; };
      if (!can_run() && !(stopping_ && tasks_.empty())) {
        worker_sleeping_ = true;
        ready_.wait(lock, [&] { return can_run() || (stopping_ && tasks_.empty()); });
        worker_sleeping_ = false;
      }
      if (can_run()) {
        run_front(lock);
      } else if (stopping_ && tasks_.empty()) {
        return;  // everything submitted has been taken; a waiter may still be finishing one
      }
    }
  }

  runner run_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;         // wakes the worker
  std::condition_variable completed_cv_;  // wakes waiters
  fifo_queue<queued> tasks_;
  std::uint64_t submitted_ = 0;
  bool executing_ = false;
  bool worker_sleeping_ = false;
  bool stopping_ = false;
  std::atomic<std::uint64_t> completed_{0};
  std::map<std::uint64_t, std::exception_ptr> failures_;
  std::exception_ptr first_failure_;
  std::chrono::steady_clock::time_point first_failure_at_;
  mutable bool failure_reported_ = false;  // guarded by mutex_
  std::atomic<bool> any_failure_{false};
  std::thread thread_;  // last: starts after every member above exists
};

}  // namespace cohort::inline v0::detail
