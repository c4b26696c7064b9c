#pragma once
// process_group<Backend>: who am I, how many are we, and the collectives, on any backend.
// Over 400 lines: one class, whose every collective has span and range overloads; splitting it
// would split one interface. Its members' bodies are in comm/impl/process_group.hpp.
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
#include "cohort/config.hpp"
#include "cohort/detail/compiled_specializations.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
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
#if defined(COHORT_SEPARATE_COMPILATION) && !defined(COHORT_TEMPLATE_BODIES)
  // Otherwise the unit would compile against members nobody defines: a link error, far from here.
  static_assert(detail::compiled_backend<B>,
                "cohort: compiled once (COHORT_SEPARATE_COMPILATION), the library holds process_group for gloo "
                "and nccl only; for a backend of your own #define COHORT_TEMPLATE_BODIES before including cohort "
                "(or add it to the target's compile definitions) so that this unit compiles the bodies itself");
#endif

  // Collective: every rank of env constructs its group in the same order. `store` is the
  // rendezvous (see connect_store); the group keeps its keys under its own prefix.
  process_group(std::shared_ptr<store> rendezvous, const launch_env& env, options opts = {});

  process_group(process_group&&) noexcept = default;
  // Not defaulted: members are assigned in declaration order, so the engine would go before
  // the staging memory allocated through it is freed. Free that first, then take other's.
  process_group& operator=(process_group&& other) noexcept;

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
  void* value_staging(std::size_t bytes);
  const std::shared_ptr<prefix_store>& group_store() const noexcept { return store_; }
  bool debug_checks() const noexcept { return debug_; }
  void set_debug_checks(bool on) noexcept {
    debug_ = on;
    pass_debug_checks_to_backend();
  }

  // --- collectives -----------------------------------------------------------------------
  // Each typed overload names its element type and forwards to one untyped body (below, with
  // the checks and the errors): compiled once, that body is in the library, and a unit's
  // collectives over any element type instantiate no more than these one-line forwarders.
  template <element T>
  work all_reduce(std::span<T> data, op reduce = op::sum) {
    return all_reduce(std::span<const T>(data), data, reduce);
  }
  template <element T>
  work all_reduce(std::span<const std::type_identity_t<T>> in, std::span<T> out, op reduce = op::sum) {
    static_assert(!std::is_const_v<T>, "the output of a collective must be writable");
    return untyped_all_reduce(in.data(), in.size(), out.data(), out.size(), dtype_v<T>, reduce);
  }

  // in: size() chunks of out.size() elements; chunk r is reduced across ranks into rank r's out.
  template <element T>
  work reduce_scatter(std::span<const std::type_identity_t<T>> in, std::span<T> out, op reduce = op::sum) {
    return untyped_reduce_scatter(in.data(), in.size(), out.data(), out.size(), dtype_v<T>, reduce);
  }

  // out: size() chunks of in.size() elements, rank r's input in chunk r. `in` may be the
  // rank's own chunk of `out` (in place).
  template <element T>
  work all_gather(std::span<const std::type_identity_t<T>> in, std::span<T> out) {
    return untyped_all_gather(in.data(), in.size(), out.data(), out.size(), dtype_v<T>);
  }

  template <element T>
  work broadcast(std::span<T> data, int root = 0) {
    return untyped_broadcast(data.data(), data.size(), dtype_v<T>, root);
  }

  // in and out: world_size() chunks of equal length; chunk r of my input goes to rank r, chunk r
  // of my output comes from rank r.
  template <element T>
  work all_to_all(std::span<const std::type_identity_t<T>> in, std::span<T> out) {
    return untyped_all_to_all(in.data(), in.size(), out.data(), out.size(), dtype_v<T>);
  }

  template <element T>
  work send(std::span<const std::type_identity_t<T>> data, int peer, std::uint64_t tag = 0) {
    return untyped_send(data.data(), data.size(), dtype_v<T>, peer, tag);
  }
  template <element T>
  work send(std::span<T> data, int peer, std::uint64_t tag = 0) {
    return send<std::remove_const_t<T>>(std::span<const std::remove_const_t<T>>(data), peer, tag);
  }

  template <element T>
  work recv(std::span<T> data, int peer, std::uint64_t tag = 0) {
    return untyped_recv(data.data(), data.size(), dtype_v<T>, peer, tag);
  }

  work barrier();

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
  void monitored_barrier(std::chrono::milliseconds timeout);

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
  std::optional<process_group> split(int color, int key);

  // The ranks of this node (ranks placed node by node, as torchrun, mpirun by slot and srun
  // place them: the node's first global rank is rank - local_rank).
  process_group node_local();

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

  process_group(launch_env env, std::shared_ptr<prefix_store> group_store, std::unique_ptr<B> impl, bool debug);

  // A backend that checks calls of its own (Gloo's point-to-point pairs) follows the group.
  void pass_debug_checks_to_backend() noexcept;

  // How this group's messages name its ranks: a subgroup's by world rank and its own, with the
  // group, as its backend's errors do; a backend that does not say numbers them by this group.
  detail::rank_naming rank_names() const;
  // The rank this group's errors are said by: its world rank.
  int reported_rank() const;

  // The collectives' bodies over untyped memory (counts in elements of `type`): the local
  // checks, the debug signature check, then the engine's call.
  work untyped_all_reduce(const void* in, std::size_t in_count, void* out, std::size_t out_count, dtype type,
                          op reduce);
  work untyped_reduce_scatter(const void* in, std::size_t in_count, void* out, std::size_t out_count, dtype type,
                              op reduce);
  work untyped_all_gather(const void* in, std::size_t in_count, void* out, std::size_t out_count, dtype type);
  work untyped_broadcast(void* data, std::size_t count, dtype type, int root);
  work untyped_all_to_all(const void* in, std::size_t in_count, void* out, std::size_t out_count, dtype type);
  work untyped_send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t tag);
  work untyped_recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t tag);

  static void validate_env(const launch_env& env);

  [[noreturn]] void fail(const char* operation, std::size_t count, const std::string& detail,
                         const std::string& hint) const;

  void check_peer(const char* operation, std::size_t count, int peer, const char* role) const;

  void check_main_only(const char* operation, std::size_t count) const;

  // Local checks, then (debug) the cross-rank signature check.
  void enter(const char* operation, dtype type, std::size_t count, op reduce, int root = -1);

  // Every rank publishes the call it is about to make; all must agree. Uses the store, so
  // it works for device backends too, and costs a store round trip per call (debug only).
  [[gnu::cold]] void check_signature(const char* operation, dtype type, std::size_t count, op reduce, int root);

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

#if !defined(COHORT_SEPARATE_COMPILATION) || defined(COHORT_TEMPLATE_BODIES)
#include "cohort/comm/impl/process_group.hpp"
#endif
