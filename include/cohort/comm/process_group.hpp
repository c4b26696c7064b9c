#pragma once
// process_group<Backend>: who am I, how many are we, and the collectives, on any backend.
// Over 400 lines: one class, whose every collective repeats the same checks over span and
// range overloads; splitting it would split one interface.
//
//   auto env   = cohort::launch_env::detect();
//   auto store = cohort::connect_store(env);
//   cohort::process_group<cohort::gloo> pg{store, env};       // or cohort::nccl
//   pg.all_reduce(std::span<float>(grad), cohort::op::avg).wait();
//   pg.all_reduce(grad_vector).wait();                        // any contiguous range
//   pg.on(stream).all_reduce(grad, cohort::op::avg);          // ordered on the caller's stream
// (A few host values, such as a loss, go through cohort/comm/host_values.hpp.)
//
// Every collective is asynchronous and returns the backend's work handle (wait, test,
// wait_for); collectives on one group complete in issue order. The group checks what can
// be checked locally (sizes, roots, peers) and, with debug checks on (options or
// COHORT_DEBUG=1), compares every call's signature across ranks before it runs, so a
// mismatch is a clear error instead of a hang or silent corruption.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/comm/backend.hpp"
#include "cohort/comm/call_label.hpp"
#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {
// What the collectives' range overloads take (std::vector, std::array, C arrays, fixed-extent
// spans, a user's type with data() and size(); see contiguous_elements in types.hpp, which
// needs only <iterator>: <ranges> would add ~9% to this header's compile cost). A collective
// is asynchronous, so its buffer must outlive the call: an lvalue, or a span (a view of
// memory the caller keeps); a temporary container is refused at compile time.
template <class T>
inline constexpr bool is_span_v = false;
template <class T, std::size_t Extent>
inline constexpr bool is_span_v<std::span<T, Extent>> = true;
template <class T>
inline constexpr bool is_dynamic_span_v = false;
template <class T>
inline constexpr bool is_dynamic_span_v<std::span<T>> = true;
template <class R>
concept lasting_elements = contiguous_elements<std::remove_cvref_t<R>> &&
    (std::is_lvalue_reference_v<R> || is_span_v<std::remove_cvref_t<R>>);
// The range overloads leave std::span<T> (dynamic extent) to the span overloads, so no call
// has two equally good candidates.
template <class R>
concept lasting_input = lasting_elements<R> && !is_dynamic_span_v<std::remove_cvref_t<R>>;
template <class R>
concept lasting_output = lasting_input<R> && writable_contiguous_elements<std::remove_reference_t<R>>;
// An input beside an output: any span too (the output decides the overload), same elements.
template <class In, class Out>
concept lasting_input_for = lasting_elements<In> &&
    std::same_as<element_type_of<std::remove_cvref_t<In>>, element_type_of<std::remove_cvref_t<Out>>>;

template <class R>
auto as_span(R& range) noexcept {
  return std::span(std::data(range), std::size(range));
}
template <class R>
auto as_const_span(const R& range) noexcept {
  return std::span(std::data(range), std::size(range));
}
}  // namespace detail

template <class B>
class process_group {
 public:
  using backend_type = B;
  using work = typename B::work;
  using options = typename B::options;
  static constexpr memory_space space = B::space;

  // Collective: every rank of env constructs its group in the same order. `store` is the
  // rendezvous (see connect_store); the group keeps its keys under its own prefix.
  process_group(std::shared_ptr<store> rendezvous, const launch_env& env, options opts = {})
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

  process_group(process_group&&) noexcept = default;
  // Not defaulted: members are assigned in declaration order, so the engine would go before
  // the staging memory allocated through it is freed. Free that first, then take other's.
  process_group& operator=(process_group&& other) noexcept {
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

  int rank() const noexcept { return env_.rank; }
  int world_size() const noexcept { return env_.world_size; }
  int size() const noexcept { return env_.world_size; }  // world_size(), by its older name
  int local_rank() const noexcept { return env_.local_rank; }
  int local_size() const noexcept { return env_.local_world_size; }
  const launch_env& env() const noexcept { return env_; }
  B& backend() noexcept { return *backend_; }

  // Backend memory the group keeps for staging a few host values through its engine (cohort's
  // host-value helpers use it): at least `bytes`, reused by the next such call, grown when a
  // call needs more. One allocation per group, not one per call: on NCCL each cudaFree would
  // synchronise the whole device.
  void* value_staging(std::size_t bytes) {
    if (value_staging_.bytes() < bytes)
      value_staging_ = detail::backend_buffer<B>(*backend_, std::max<std::size_t>(bytes, 256));
    return value_staging_.data();
  }
  const std::shared_ptr<prefix_store>& group_store() const noexcept { return store_; }
  bool debug_checks() const noexcept { return debug_; }
  void set_debug_checks(bool on) noexcept {
    debug_ = on;
    pass_debug_checks_to_backend();
  }

  // --- collectives -----------------------------------------------------------------------
  template <element T>
  work all_reduce(std::span<T> data, op reduce = op::sum) {
    return all_reduce(std::span<const T>(data), data, reduce);
  }
  template <element T>
  work all_reduce(std::span<const std::type_identity_t<T>> in, std::span<T> out, op reduce = op::sum) {
    static_assert(!std::is_const_v<T>, "the output of a collective must be writable");
    enter("all_reduce", dtype_v<T>, in.size(), reduce);
    if (in.size() != out.size())
      fail("all_reduce", in.size(),
           detail::text("input has ", std::to_string(in.size()), " elements but output has ",
                        std::to_string(out.size())),
           "all_reduce keeps the size: pass spans of equal length");
    return backend_->all_reduce(in.data(), out.data(), in.size(), dtype_v<T>, reduce);
  }

  // in: size() chunks of out.size() elements; chunk r is reduced across ranks into rank r's out.
  template <element T>
  work reduce_scatter(std::span<const std::type_identity_t<T>> in, std::span<T> out, op reduce = op::sum) {
    enter("reduce_scatter", dtype_v<T>, in.size(), reduce);
    if (in.size() != out.size() * static_cast<std::size_t>(size()))
      fail("reduce_scatter", in.size(),
           detail::text("input has ", std::to_string(in.size()), " elements, expected output size ",
                        std::to_string(out.size()), " x world ", std::to_string(world_size())),
           "pad the input to a multiple of the world size (training_state's layout does this)");
    return backend_->reduce_scatter(in.data(), out.data(), out.size(), dtype_v<T>, reduce);
  }

  // out: size() chunks of in.size() elements, rank r's input in chunk r. `in` may be the
  // rank's own chunk of `out` (in place).
  template <element T>
  work all_gather(std::span<const std::type_identity_t<T>> in, std::span<T> out) {
    enter("all_gather", dtype_v<T>, in.size(), op::sum);
    if (out.size() != in.size() * static_cast<std::size_t>(size()))
      fail("all_gather", in.size(),
           detail::text("output has ", std::to_string(out.size()), " elements, expected input size ",
                        std::to_string(in.size()), " x world ", std::to_string(world_size())),
           "the output holds one input-sized chunk per rank");
    return backend_->all_gather(in.data(), out.data(), in.size(), dtype_v<T>);
  }

  template <element T>
  work broadcast(std::span<T> data, int root = 0) {
    enter("broadcast", dtype_v<T>, data.size(), op::sum, root);
    check_peer("broadcast", data.size(), root, "root");
    return backend_->broadcast(data.data(), data.size(), dtype_v<T>, root);
  }

  // in and out: world_size() chunks of equal length; chunk r of my input goes to rank r, chunk r
  // of my output comes from rank r.
  template <element T>
  work all_to_all(std::span<const std::type_identity_t<T>> in, std::span<T> out) {
    enter("all_to_all", dtype_v<T>, in.size(), op::sum);
    const auto world = static_cast<std::size_t>(world_size());
    if (in.size() != out.size() || in.size() % world != 0)
      fail("all_to_all", in.size(),
           detail::text("input ", std::to_string(in.size()), " and output ", std::to_string(out.size()),
                        " elements must be equal and divisible by world ", std::to_string(world_size())),
           "pad to a multiple of the world size");
    return backend_->all_to_all(in.data(), out.data(), in.size() / world, dtype_v<T>);
  }

  template <element T>
  work send(std::span<const std::type_identity_t<T>> data, int peer, std::uint64_t tag = 0) {
    check_main_only("send", data.size());
    check_peer("send", data.size(), peer, "peer");
    return backend_->send(data.data(), data.size(), dtype_v<T>, peer, tag);
  }
  template <element T>
  work send(std::span<T> data, int peer, std::uint64_t tag = 0) {
    return send<std::remove_const_t<T>>(std::span<const std::remove_const_t<T>>(data), peer, tag);
  }

  template <element T>
  work recv(std::span<T> data, int peer, std::uint64_t tag = 0) {
    check_main_only("recv", data.size());
    check_peer("recv", data.size(), peer, "peer");
    return backend_->recv(data.data(), data.size(), dtype_v<T>, peer, tag);
  }

  work barrier() {
    enter("barrier", dtype::uint8, 0, op::sum);
    return backend_->barrier();
  }

  // Any contiguous range of cohort elements, not only std::span: pg.all_reduce(grad) on a
  // std::vector<float>, a std::array, a C array, a fixed-extent span or a type of the user's
  // with data() and size(). Each is viewed as a std::span and takes the span overload above,
  // so checks, errors and the call are the same. The range must outlive the work (an
  // lvalue, or a span): a temporary container does not compile. Arguments that are
  // std::span<T> keep taking the span overloads (these leave them out), so no call is
  // ambiguous and existing calls resolve as before.
  template <detail::lasting_output R>
  work all_reduce(R&& data, op reduce = op::sum) {
    return all_reduce(detail::as_span(data), reduce);
  }
  template <detail::lasting_output Out, detail::lasting_input_for<Out> In>
  work all_reduce(In&& in, Out&& out, op reduce = op::sum) {
    return all_reduce(detail::as_const_span(in), detail::as_span(out), reduce);
  }
  template <detail::lasting_output Out, detail::lasting_input_for<Out> In>
  work reduce_scatter(In&& in, Out&& out, op reduce = op::sum) {
    return reduce_scatter(detail::as_const_span(in), detail::as_span(out), reduce);
  }
  template <detail::lasting_output Out, detail::lasting_input_for<Out> In>
  work all_gather(In&& in, Out&& out) {
    return all_gather(detail::as_const_span(in), detail::as_span(out));
  }
  template <detail::lasting_output R>
  work broadcast(R&& data, int root = 0) {
    return broadcast(detail::as_span(data), root);
  }
  template <detail::lasting_output Out, detail::lasting_input_for<Out> In>
  work all_to_all(In&& in, Out&& out) {
    return all_to_all(detail::as_const_span(in), detail::as_span(out));
  }
  template <detail::lasting_input R>
  work send(R&& data, int peer, std::uint64_t tag = 0) {
    return send(detail::as_const_span(data), peer, tag);
  }
  template <detail::lasting_output R>
  work recv(R&& data, int peer, std::uint64_t tag = 0) {
    return recv(detail::as_span(data), peer, tag);
  }

  // --- stream-ordered collectives ----------------------------------------------------------
  using stream_type = typename B::stream_type;

  // pg.on(stream).all_reduce(grad, op::avg): the same collective, ordered on the caller's
  // stream. It runs after the work queued on `stream` so far (the backend's wait_for_caller)
  // and later work queued on `stream` runs after it (work::make_stream_wait). On NCCL neither
  // blocks the host: the kernels the trainer queues on its stream next see the result. On
  // Gloo the caller's "stream" is its thread (stream_type is std::nullptr_t: pass nullptr):
  // what it queued is already done, and the call returns once the collective is complete
  // (a send once received: order point-to-point pairs as for blocking calls). The work is
  // returned too (wait(), test()). Not inside a grouped() scope on NCCL: there a
  // call's event exists only once the group ends, so the stream would wait for nothing.
  //
  // A view rather than a trailing argument (pg.all_reduce(grad, op::avg, on_stream(s))):
  // every collective has defaulted trailing parameters (op, root, tag) and both span and
  // range overloads; a stream parameter would double each overload set and sit beside those
  // defaults. The view forwards to the very same overloads, so what they accept or refuse is
  // the same with a stream, and a run of calls on one stream reads as one:
  // `auto s = pg.on(stream); s.all_reduce(a); s.broadcast(b);`. It points to the group: use it
  // while the group lives.
  class stream_ordered {
   public:
    stream_ordered(process_group& group, stream_type caller) noexcept : group_(&group), caller_(caller) {}
    stream_type stream() const noexcept { return caller_; }

    // Each collective of the group, with the same arguments (so the same overloads).
#define COHORT_STREAM_ORDERED(name)                                                                 \
  template <class... Args>                                                                          \
    requires requires(process_group & g, Args && ... args) { g.name(std::forward<Args>(args)...); } \
  work name(Args&&... args) {                                                                       \
    return ordered([&] { return group_->name(std::forward<Args>(args)...); });                      \
  }
    COHORT_STREAM_ORDERED(all_reduce)
    COHORT_STREAM_ORDERED(reduce_scatter)
    COHORT_STREAM_ORDERED(all_gather)
    COHORT_STREAM_ORDERED(broadcast)
    COHORT_STREAM_ORDERED(all_to_all)
    COHORT_STREAM_ORDERED(send)
    COHORT_STREAM_ORDERED(recv)
#undef COHORT_STREAM_ORDERED
    work barrier() {
      return ordered([&] { return group_->barrier(); });
    }

   private:
    template <class Call>
    work ordered(Call&& call) {
      group_->backend().wait_for_caller(caller_);
      work done = call();
      done.make_stream_wait(caller_);
      return done;
    }

    process_group* group_;
    stream_type caller_;
  };
  stream_ordered on(stream_type caller) noexcept { return stream_ordered(*this, caller); }

  // A barrier that names every rank that did not arrive within `timeout` (PyTorch's
  // monitored_barrier with wait_all_ranks): each rank checks in through the group's store,
  // rank 0 collects the arrivals and publishes who was missing, and every rank that arrived
  // throws the same timeout_error listing them. A store round trip per rank, through rank 0:
  // for start-up and debugging, not for every step. Blocks the caller; it does not order
  // against work queued on the backend.
  void monitored_barrier(std::chrono::milliseconds timeout) {
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

  // --- call context ------------------------------------------------------------------------
  // While the scope lives, every call this group issues is recorded with `what` (at most
  // 47 characters kept; no allocation per call) as its context, shown by errors, progress
  // lines, desync reports and traces: `all_gather #12 (float x 4096) [sample]`. Scopes nest
  // (the previous context returns when a scope ends); subgroups have their own. Set it on the
  // thread that issues the group's calls.
  //
  //   { auto scope = pg.call_context("sample"); auto layer = state.gather(0); ... }
  class context_scope {
   public:
    context_scope(B& engine, std::string_view what, bool within = false) noexcept : engine_(&engine) {
      if constexpr (labels_calls) {
        previous_ = engine.call_context();
        if (!within || previous_.empty()) {
          engine.set_call_context(call_label(what));
          return;
        }
        // "sample: gather of layer 3": the caller's context first, kept whole where it fits.
        char joined[call_label::capacity];
        const std::string_view outer = previous_.view();
        std::size_t size = outer.copy(joined, sizeof joined);
        size += std::string_view(": ").copy(joined + size, sizeof joined - size);
        size += what.copy(joined + size, sizeof joined - size);
        engine.set_call_context(call_label(std::string_view(joined, size)));
      }
    }
    context_scope(const context_scope&) = delete;
    context_scope& operator=(const context_scope&) = delete;
    ~context_scope() {
      if constexpr (labels_calls) engine_->set_call_context(previous_);
    }

   private:
    B* engine_;
    call_label previous_;
  };
  [[nodiscard]] context_scope call_context(std::string_view what) noexcept { return context_scope(*backend_, what); }
  // Inside the caller's context rather than in its place: "sample: gather of layer 3" (what a
  // library over the group, such as the training state, labels its own calls with).
  [[nodiscard]] context_scope call_context_within(std::string_view what) noexcept {
    return context_scope(*backend_, what, true);
  }

  // --- grouped calls -----------------------------------------------------------------------
  // Calls issued while the scope lives are launched together when it ends: on NCCL one
  // ncclGroupStart/End (many buffers in one launch, as a bucket made of several regions of
  // a flat buffer needs); on Gloo calls run one after another anyway. Every rank groups
  // the same calls. Do not wait on a call's work before its group ends (on NCCL nothing
  // has been launched yet). end() reports a failure to launch; the destructor ends a group
  // still open quietly (a failure then surfaces at the next wait, or to the watchdog).
  class group_scope {
   public:
    explicit group_scope(B& engine) : engine_(&engine) { start(engine); }
    group_scope(const group_scope&) = delete;
    group_scope& operator=(const group_scope&) = delete;
    ~group_scope() {
      try {
        end();
      } catch (...) {}
    }
    void end() {
      if (!engine_) return;
      B* engine = std::exchange(engine_, nullptr);
      if constexpr (requires { engine->group_end(); }) engine->group_end();
    }

   private:
    static void start(B& engine) {
      if constexpr (requires { engine.group_start(); }) engine.group_start();
    }
    B* engine_;
  };
  [[nodiscard]] group_scope grouped() { return group_scope(*backend_); }

  // --- subgroups ---------------------------------------------------------------------------
  // Collective over this group. Ranks with the same color form a new group, ordered by
  // (key, rank); a negative color joins no group (nullopt). Like MPI_Comm_split.
  std::optional<process_group> split(int color, int key) {
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

  // The ranks of this node (ranks placed node by node, as torchrun, mpirun by slot and srun
  // place them: the node's first global rank is rank - local_rank).
  process_group node_local() {
    auto group = split(rank() - local_rank(), local_rank());
    return std::move(*group);
  }

  // --- on_main support ---------------------------------------------------------------------
  // While a section is alive, a collective on this group is an error: only the main rank
  // runs the section, so the others would never join the collective (a deadlock).
  class main_only_scope {
   public:
    explicit main_only_scope(process_group& group) : group_(&group) { ++*group_->main_only_depth_; }
    main_only_scope(const main_only_scope&) = delete;
    main_only_scope& operator=(const main_only_scope&) = delete;
    ~main_only_scope() { --*group_->main_only_depth_; }

   private:
    process_group* group_;
  };
  main_only_scope main_only_section() { return main_only_scope(*this); }

 private:
  // A backend that records calls (cohort's two) keeps the context with each.
  static constexpr bool labels_calls = requires(B & engine, const call_label& label) {
    engine.set_call_context(label);
    { engine.call_context() } -> std::convertible_to<call_label>;
  };

  process_group(launch_env env, std::shared_ptr<prefix_store> group_store, std::unique_ptr<B> impl, bool debug)
      : env_(std::move(env)), store_(std::move(group_store)), backend_(std::move(impl)), debug_(debug) {
    pass_debug_checks_to_backend();
  }

  // A backend that checks calls of its own (Gloo's point-to-point pairs) follows the group.
  void pass_debug_checks_to_backend() noexcept {
    if constexpr (requires(B & engine) { engine.set_debug_checks(true); }) backend_->set_debug_checks(debug_);
  }

  // How this group's messages name its ranks: a subgroup's by world rank and its own, with the
  // group, as its backend's errors do; a backend that does not say numbers them by this group.
  detail::rank_naming rank_names() const {
    if constexpr (requires(const B& engine) { engine.names(); })
      return backend_->names();
    else
      return {};
  }
  // The rank this group's errors are said by: its world rank.
  int reported_rank() const { return rank_names().world_rank(rank()); }

  static void validate_env(const launch_env& env) {
    if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size)
      throw error(
          env.rank, "process_group",
          detail::text("rank ", std::to_string(env.rank), " is outside a world of ", std::to_string(env.world_size)),
          "check RANK and WORLD_SIZE");
  }

  [[noreturn]] void fail(const char* operation, std::size_t count, const std::string& detail,
                         const std::string& hint) const {
    throw error(reported_rank(), detail::text(B::name, ".", operation, "(", std::to_string(count), " elements)"),
                detail, hint);
  }

  void check_peer(const char* operation, std::size_t count, int peer, const char* role) const {
    if (peer < 0 || peer >= size())
      fail(operation, count,
           detail::text(role, " ", std::to_string(peer), " is outside a world of ", std::to_string(size())),
           "ranks are numbered 0 .. world-1 inside this group");
  }

  void check_main_only(const char* operation, std::size_t count) const {
    if (main_only_depth_->load(std::memory_order_relaxed) > 0)
      fail(operation, count,
           "collective issued inside on_main: only the main rank runs that code, so the other "
           "ranks never join and every rank would hang",
           "move the collective out of on_main, or use main_process_first");
  }

  // Local checks, then (debug) the cross-rank signature check.
  void enter(const char* operation, dtype type, std::size_t count, op reduce, int root = -1) {
    check_main_only(operation, count);
    if (debug_) check_signature(operation, type, count, reduce, root);
  }

  // Every rank publishes the call it is about to make; all must agree. Uses the store, so
  // it works for device backends too, and costs a store round trip per call (debug only).
  void check_signature(const char* operation, dtype type, std::size_t count, op reduce, int root) {
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

  launch_env env_;
  std::shared_ptr<prefix_store> store_;
  std::unique_ptr<B> backend_;
  detail::backend_buffer<B> value_staging_;  // after backend_: freed before the engine goes
  bool debug_ = false;
  std::uint64_t debug_calls_ = 0;
  std::uint64_t split_count_ = 0;
  std::uint64_t monitored_barriers_ = 0;
  // Behind a pointer so the group stays movable.
  std::unique_ptr<std::atomic<int>> main_only_depth_ = std::make_unique<std::atomic<int>>(0);
};

}  // namespace cohort::inline v0
