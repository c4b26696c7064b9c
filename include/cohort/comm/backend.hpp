#pragma once
// The engine interface: what a backend (cohort/comm/gloo.hpp, cohort/comm/nccl.hpp, or your
// own) provides so that process_group and the algorithms are written once over it, and the
// one owner of memory allocated through it.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// What an engine must provide for algorithms to be written once over it: collectives on
// type-erased buffers returning work handles; its ordering (record: a work that completes
// after everything queued so far; stream_type, the caller's order, which wait_for_caller
// makes later work wait for and work::make_stream_wait makes wait for a work; on a host
// engine the caller's thread, on a device engine a CUDA stream); memory in its own space
// (allocate, deallocate, copy); and subgroups. Element-wise work comes from its memory
// space (cohort/comm/ops.hpp): host engines also provide enqueue(fn), device engines stream().
template <class B>
concept backend = requires(B& b, const void* in, void* out, std::size_t n, dtype type, op reduce, int peer,
                           std::uint64_t tag, const typename B::work& w, typename B::stream_type caller) {
  typename B::options;
  typename B::stream_type;
  { B::space } -> std::convertible_to<memory_space>;
  { b.stream() } -> std::convertible_to<typename B::stream_type>;
  b.wait_for_caller(caller);
  w.make_stream_wait(caller);
  { b.rank() } -> std::convertible_to<int>;
  { b.size() } -> std::convertible_to<int>;
  { b.all_reduce(in, out, n, type, reduce) } -> std::same_as<typename B::work>;
  { b.reduce_scatter(in, out, n, type, reduce) } -> std::same_as<typename B::work>;
  { b.all_gather(in, out, n, type) } -> std::same_as<typename B::work>;
  { b.all_to_all(in, out, n, type) } -> std::same_as<typename B::work>;
  { b.broadcast(out, n, type, peer) } -> std::same_as<typename B::work>;
  { b.send(in, n, type, peer, tag) } -> std::same_as<typename B::work>;
  { b.recv(out, n, type, peer, tag) } -> std::same_as<typename B::work>;
  { b.barrier() } -> std::same_as<typename B::work>;
  { b.record() } -> std::same_as<typename B::work>;
  { b.copy(out, in, n) } -> std::same_as<typename B::work>;
  { b.allocate(n) } -> std::same_as<void*>;
  { B::split(b, std::shared_ptr<store>(), peer, peer, peer, std::vector<int>()) } -> std::same_as<std::unique_ptr<B>>;
  b.deallocate(out, n);
  w.wait();
  { w.test() } -> std::convertible_to<bool>;
  { w.wait_for(std::chrono::milliseconds(1)) } -> std::convertible_to<bool>;
};

namespace detail {
// Backend memory owned by a type: allocated through an engine, freed through it once, when
// the owner goes (no hand-written clean-up on error paths). Move-only.
template <class B>
class backend_buffer {
 public:
  backend_buffer() = default;
  backend_buffer(B& engine, std::size_t bytes) : engine_(&engine), data_(engine.allocate(bytes)), bytes_(bytes) {}
  backend_buffer(backend_buffer&& other) noexcept
      : engine_(other.engine_), data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  backend_buffer& operator=(backend_buffer&& other) noexcept {
    if (this != &other) {
      release();
      engine_ = other.engine_;
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~backend_buffer() { release(); }

  void* data() const noexcept { return data_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void release() noexcept {
    if (data_) engine_->deallocate(std::exchange(data_, nullptr), bytes_);
  }
  B* engine_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};
}  // namespace detail

}  // namespace cohort::inline v0
