#pragma once
// process_group's member bodies (cohort/comm/process_group.hpp): always included header-only;
// compiled once, only by the library's unit (cohort/src.hpp) and by units that define
// COHORT_TEMPLATE_BODIES (see cohort/detail/compiled_specializations.hpp), as training_state's.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0 {

template <class B>
process_group<B>::process_group(std::shared_ptr<store> rendezvous, const launch_env& env, options opts)
    : env_(env), debug_(opts.debug_checks || detail::debug_from_environment()) {
  validate_env(env);
  // The n-th group a rank creates on a store gets prefix n, so several groups (say one
  // Gloo and one NCCL) can share one store as long as every rank creates them in order.
  // Bounded by the group's timeout, as the rendezvous after it: a store cut off from this
  // host ends the group's creation then, not after the store's own (longer) timeout.
  const auto index =
      rendezvous->add_within(detail::text("cohort/groups_created/", std::to_string(env.rank)), 1, opts.timeout);
  store_ = std::make_shared<prefix_store>(rendezvous, detail::text("cohort/pg", std::to_string(index), "/"));
  store_->set_rank(env.rank);
  store_->set_timeout(opts.timeout);
  backend_ = std::make_unique<B>(store_, env, opts);
  pass_debug_checks_to_backend();
  if (index == 1) detail::check_not_collided(*rendezvous, env.rank, "the job's first group");
}

template <class B>
process_group<B>& process_group<B>::operator=(process_group&& other) noexcept {
  if (this == &other) return *this;
  value_staging_ = {};
  env_ = std::move(other.env_);
  store_ = std::move(other.store_);
  backend_ = std::move(other.backend_);
  value_staging_ = std::move(other.value_staging_);
  debug_ = other.debug_;
  debug_calls_ = other.debug_calls_;
  split_count_ = other.split_count_;
  monitored_barriers_ = other.monitored_barriers_;
  main_only_depth_ = std::move(other.main_only_depth_);
  return *this;
}

template <class B>
void* process_group<B>::value_staging(std::size_t bytes) {
  if (value_staging_.bytes() < bytes)
    value_staging_ = detail::backend_buffer<B>(*backend_, std::max<std::size_t>(bytes, 256));
  return value_staging_.data();
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_all_reduce(const void* in, std::size_t in_count, void* out,
                                                                     std::size_t out_count, dtype type, op reduce) {
  enter("all_reduce", type, in_count, reduce);
  if (in_count != out_count)
    fail("all_reduce", in_count,
         detail::text("input has ", std::to_string(in_count), " elements but output has ", std::to_string(out_count)),
         "all_reduce keeps the size: pass spans of equal length");
  return backend_->all_reduce(in, out, in_count, type, reduce);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_reduce_scatter(const void* in, std::size_t in_count,
                                                                         void* out, std::size_t out_count, dtype type,
                                                                         op reduce) {
  enter("reduce_scatter", type, in_count, reduce);
  if (in_count != out_count * static_cast<std::size_t>(size()))
    fail("reduce_scatter", in_count,
         detail::text("input has ", std::to_string(in_count), " elements, expected output size ",
                      std::to_string(out_count), " x world ", std::to_string(world_size())),
         "pad the input to a multiple of the world size (training_state's layout does this)");
  return backend_->reduce_scatter(in, out, out_count, type, reduce);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_all_gather(const void* in, std::size_t in_count, void* out,
                                                                     std::size_t out_count, dtype type) {
  enter("all_gather", type, in_count, op::sum);
  if (out_count != in_count * static_cast<std::size_t>(size()))
    fail("all_gather", in_count,
         detail::text("output has ", std::to_string(out_count), " elements, expected input size ",
                      std::to_string(in_count), " x world ", std::to_string(world_size())),
         "the output holds one input-sized chunk per rank");
  return backend_->all_gather(in, out, in_count, type);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_broadcast(void* data, std::size_t count, dtype type,
                                                                    int root) {
  enter("broadcast", type, count, op::sum, root);
  check_peer("broadcast", count, root, "root");
  return backend_->broadcast(data, count, type, root);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_all_to_all(const void* in, std::size_t in_count, void* out,
                                                                     std::size_t out_count, dtype type) {
  enter("all_to_all", type, in_count, op::sum);
  const auto world = static_cast<std::size_t>(world_size());
  if (in_count != out_count || in_count % world != 0)
    fail("all_to_all", in_count,
         detail::text("input ", std::to_string(in_count), " and output ", std::to_string(out_count),
                      " elements must be equal and divisible by world ", std::to_string(world_size())),
         "pad to a multiple of the world size");
  return backend_->all_to_all(in, out, in_count / world, type);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_send(const void* data, std::size_t count, dtype type,
                                                               int peer, std::uint64_t tag) {
  check_main_only("send", count);
  check_peer("send", count, peer, "peer");
  return backend_->send(data, count, type, peer, tag);
}

template <class B>
typename process_group<B>::work process_group<B>::untyped_recv(void* data, std::size_t count, dtype type, int peer,
                                                               std::uint64_t tag) {
  check_main_only("recv", count);
  check_peer("recv", count, peer, "peer");
  return backend_->recv(data, count, type, peer, tag);
}

template <class B>
typename process_group<B>::work process_group<B>::barrier() {
  enter("barrier", dtype::uint8, 0, op::sum);
  return backend_->barrier();
}

template <class B>
void process_group<B>::monitored_barrier(std::chrono::milliseconds timeout) {
  check_main_only("monitored_barrier", 0);
  const std::string call = detail::text("monitored_barrier #", std::to_string(++monitored_barriers_));
  const std::string base = detail::text("monitored_barrier/", std::to_string(monitored_barriers_), "/");
  const auto names = rank_names();
  store_->set(base + std::to_string(rank()), "arrived");
  const auto hint = std::string("the missing ranks are still computing, blocked in another call, stopped or dead");
  if (rank() != 0) {
    std::string missing;
    try {
      // Rank 0 answers within its own timeout of arriving; allow it that long to arrive.
      missing = to_string(store_->get(detail::text(base, "missing"), 2 * timeout));
    } catch (const timeout_error&) {
      throw timeout_error(reported_rank(), detail::text(B::name, ".", call),
                          detail::text(names.lead(), names(0), " did not arrive within ",
                                       detail::format_duration(2 * timeout), " (it collects the barrier)"),
                          hint);
    }
    if (!missing.empty())
      throw timeout_error(
          reported_rank(), detail::text(B::name, ".", call),
          detail::text(names.lead(), missing, " did not arrive within ", detail::format_duration(timeout)), hint);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> absent;
  for (int r = 1; r < world_size(); ++r) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      store_->get(base + std::to_string(r), std::max(left, std::chrono::milliseconds(1)));
    } catch (const timeout_error&) {
      absent.push_back(r);
    }
  }
  const std::string missing = absent.empty() ? std::string() : names(absent);
  store_->set(detail::text(base, "missing"), missing);
  if (!missing.empty())
    throw timeout_error(
        reported_rank(), detail::text(B::name, ".", call),
        detail::text(names.lead(), missing, " did not arrive within ", detail::format_duration(timeout)), hint);
}

template <class B>
std::optional<process_group<B>> process_group<B>::split(int color, int key) {
  const auto index = split_count_++;
  const std::string base = detail::text("split", std::to_string(index), "/");
  const int my_node = rank() - local_rank();
  store_->set(base + std::to_string(rank()),
              detail::text(std::to_string(color), ",", std::to_string(key), ",", std::to_string(my_node)));
  struct member {
    int color, key, node, rank;
  };
  // One batched read of every rank's entry (O(1) requests per rank on a tcp_store).
  std::vector<std::string> keys;
  for (int r = 0; r < world_size(); ++r) keys.push_back(base + std::to_string(r));
  const auto entries = store_->multi_get(keys);
  std::vector<member> mine;
  for (int r = 0; r < world_size(); ++r) {
    const std::string text = to_string(entries[static_cast<std::size_t>(r)]);
    int fields[3] = {};
    if (!detail::parse_int_fields(text, ',', fields))
      throw detail::malformed_store_value(reported_rank(), "split",
                                          store_->prefix() + keys[static_cast<std::size_t>(r)], text,
                                          "'color,key,node' as three decimal integers");
    const member m{fields[0], fields[1], fields[2], r};
    if (color >= 0 && m.color == color) mine.push_back(m);
  }
  std::sort(mine.begin(), mine.end(),
            [](const member& a, const member& b) { return a.key != b.key ? a.key < b.key : a.rank < b.rank; });
  std::vector<int> members;  // this group's rank of each of the new group's ranks
  for (const member& m : mine) members.push_back(m.rank);
  launch_env sub_env = env_;
  sub_env.rank = -1;
  sub_env.world_size = static_cast<int>(mine.size());
  sub_env.local_rank = 0;
  sub_env.local_world_size = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].rank == rank()) {
      sub_env.rank = static_cast<int>(i);
      sub_env.local_rank = sub_env.local_world_size;
    }
    if (mine[i].node == my_node) ++sub_env.local_world_size;
  }
  auto sub_store = std::make_shared<prefix_store>(store_, detail::text(base, "color", std::to_string(color), "/"));
  auto sub_backend = B::split(*backend_, sub_store, color, key, sub_env.rank, members);
  if (color < 0 || !sub_backend) return std::nullopt;
  return process_group(std::move(sub_env), std::move(sub_store), std::move(sub_backend), debug_);
}

template <class B>
process_group<B> process_group<B>::node_local() {
  auto group = split(rank() - local_rank(), local_rank());
  return std::move(*group);
}

template <class B>
process_group<B>::process_group(launch_env env, std::shared_ptr<prefix_store> group_store, std::unique_ptr<B> impl,
                                bool debug)
    : env_(std::move(env)), store_(std::move(group_store)), backend_(std::move(impl)), debug_(debug) {
  pass_debug_checks_to_backend();
}

template <class B>
void process_group<B>::pass_debug_checks_to_backend() noexcept {
  if constexpr (requires(B & engine) { engine.set_debug_checks(true); }) backend_->set_debug_checks(debug_);
}

template <class B>
detail::rank_naming process_group<B>::rank_names() const {
  if constexpr (requires(const B& engine) { engine.names(); })
    return backend_->names();
  else
    return {};
}

template <class B>
int process_group<B>::reported_rank() const {
  return rank_names().world_rank(rank());
}

template <class B>
void process_group<B>::validate_env(const launch_env& env) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
    throw error(
        env.rank, "process_group",
        detail::text("rank ", std::to_string(env.rank), " is outside a world of ", std::to_string(env.world_size)),
        "check RANK and WORLD_SIZE");
}

template <class B>
void process_group<B>::fail(const char* operation, std::size_t count, const std::string& detail,
                            const std::string& hint) const {
  throw error(reported_rank(), detail::text(B::name, ".", operation, "(", std::to_string(count), " elements)"), detail,
              hint);
}

template <class B>
void process_group<B>::check_peer(const char* operation, std::size_t count, int peer, const char* role) const {
  if (peer < 0 || peer >= size())
    fail(operation, count,
         detail::text(role, " ", std::to_string(peer), " is outside a world of ", std::to_string(size())),
         "ranks are numbered 0 .. world-1 inside this group");
}

template <class B>
void process_group<B>::check_main_only(const char* operation, std::size_t count) const {
  if (main_only_depth_->load(std::memory_order_relaxed) > 0)
    fail(operation, count,
         "collective issued inside on_main: only the main rank runs that code, so the other "
         "ranks never join and every rank would hang",
         "move the collective out of on_main, or use main_process_first");
}

template <class B>
void process_group<B>::enter(const char* operation, dtype type, std::size_t count, op reduce, int root) {
  check_main_only(operation, count);
  if (debug_) check_signature(operation, type, count, reduce, root);
}

template <class B>
void process_group<B>::check_signature(const char* operation, dtype type, std::size_t count, op reduce, int root) {
  const auto seq = debug_calls_++;
  const std::string signature =
      detail::text(operation, "(", to_string(type), " x ", std::to_string(count), ", ", to_string(reduce),
                   (root >= 0 ? detail::text(", root ", std::to_string(root)) : ""), ")");
  const std::string base = detail::text("debug/", std::to_string(seq), "/");
  store_->set(base + std::to_string(rank()), signature);
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    const std::string theirs = store_->get_string(base + std::to_string(r));
    if (theirs != signature)
      throw error(reported_rank(), detail::text(B::name, ".", operation),
                  detail::text(rank_names().lead(), "call #", std::to_string(seq),
                               " differs across ranks: ", rank_names()(rank()), " issued ", signature, " but ",
                               rank_names()(r), " issued ", theirs),
                  "every rank must issue the same collectives, in the same order, with the same "
                  "sizes and dtypes");
  }
}

}  // namespace cohort::inline v0
