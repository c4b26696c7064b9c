#pragma once
// Rendezvous key-value stores: how ranks find each other before any collective exists.
//
// `store` is the interface every algorithm and backend uses (Gloo's rendezvous, NCCL's
// unique-id exchange, subgroups, guards). Implementations:
//   memory_store  one process, ranks as threads (tests, single-process programs);
//   prefix_store  a namespace inside another store (subgroups, restarts);
//   tcp_store     PyTorch c10d TCPStore wire protocol, server and client (tcp_store.hpp);
//   file_store    a shared filesystem directory, scoped by run id (file_store.hpp).
// Every wait is bounded by a timeout and a timeout names the keys, the rank and the time.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

using bytes = std::vector<std::uint8_t>;

// Out of line, as the conveniences of `store` below: compiled once, a unit that includes the
// header instantiates none of the containers' copies they use (cohort/config.hpp).
COHORT_DECL bytes to_bytes(std::string_view text);
COHORT_DECL std::string to_string(std::span<const std::uint8_t> data);

class store {
 public:
  static constexpr std::chrono::milliseconds default_timeout{std::chrono::seconds(300)};

  virtual ~store() = default;

  virtual void set(std::string_view key, std::span<const std::uint8_t> value) = 0;
  // Waits until the key exists (at most `timeout`), then returns its value.
  virtual bytes get(std::string_view key, std::chrono::milliseconds timeout) = 0;
  // Atomically adds delta to the integer stored under key (absent counts as 0) and returns
  // the new value. The stored form is the decimal text, as c10d stores it.
  virtual std::int64_t add(std::string_view key, std::int64_t delta) = 0;
  // Sets key to desired when its current value equals expected (an absent key matches an
  // empty expected). Returns the value held afterwards.
  virtual bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                            std::span<const std::uint8_t> desired) = 0;
  // True when every key exists right now.
  virtual bool check(std::span<const std::string> keys) = 0;
  // Waits until every key exists; throws timeout_error naming the missing keys.
  virtual void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) = 0;
  // True when the key existed.
  virtual bool delete_key(std::string_view key) = 0;
  virtual std::int64_t num_keys() = 0;
  // Waits until every key exists (at most `timeout`), then returns their values in order.
  // What a rank calls to read every other rank's key: a store that batches does it in a
  // constant number of requests (tcp_store: one WAIT, one MULTI_GET), so a start of N ranks
  // costs O(N) requests in all instead of O(N^2). This default waits, then gets key by key.
  COHORT_DECL virtual std::vector<bytes> multi_get(std::span<const std::string> keys,
                                                   std::chrono::milliseconds timeout);
  // set and add that wait at most `timeout` for the server's answer (or the store's own
  // timeout, if shorter): a group's requests are bounded by the group's timeout, so a store
  // cut off from this host (a partition) ends them as soon as the group's waits would end,
  // not after the store's own minutes. This default ignores it: in-process and file stores
  // do not wait on a peer.
  virtual void set_within(std::string_view key, std::span<const std::uint8_t> value,
                          std::chrono::milliseconds /*timeout*/) {
    set(key, value);
  }
  virtual std::int64_t add_within(std::string_view key, std::int64_t delta, std::chrono::milliseconds /*timeout*/) {
    return add(key, delta);
  }

  // A new handle to the same store whose every operation, connecting included, is bounded by
  // `timeout`, or null where this handle's operations are bounded already (in-process and
  // file stores: use this one). Failure reports use it, so that a store gone silent (a
  // partition) holds them for the group's timeout, not for the store's own minutes, and
  // a stuck request of another thread on this handle cannot hold them either.
  virtual std::shared_ptr<store> bounded(std::chrono::milliseconds /*timeout*/) const { return nullptr; }
  // Where the store lives, for errors ("10.0.0.1:29500"); empty for an in-process store.
  virtual std::string location() const { return {}; }
  // The address of this host at which ranks of other hosts reached the store's server (the
  // local address of the first connection it accepted on an address that is not loopback),
  // waiting at most `limit` for one; empty when none came or the store cannot tell. This
  // default (in-process and file stores, torchrun's agent store) cannot. A virtual call, so
  // that the Gloo backend asks it without compiling the TCP store (header-only, every
  // translation unit that includes the backend would).
  virtual std::string reached_from_other_hosts(std::chrono::milliseconds /*limit*/) { return {}; }

  COHORT_DECL void set(std::string_view key, std::string_view value);
  // Waits at most timeout().
  bytes get(std::string_view key) { return get(key, timeout()); }
  COHORT_DECL std::string get_string(std::string_view key);
  void wait(std::span<const std::string> keys) { wait(keys, timeout()); }
  COHORT_DECL void wait(std::initializer_list<std::string> keys);
  // Waits at most timeout().
  COHORT_DECL std::vector<bytes> multi_get(std::span<const std::string> keys);

  // The bound of this handle's waits. A handle shared by threads may be read while one of
  // them changes it, so both settings are atomic; views (prefix_store) keep their own.
  std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  void set_timeout(std::chrono::milliseconds timeout) noexcept {
    timeout_ms_.store(timeout.count(), std::memory_order_relaxed);
  }
  // The rank that owns this handle, used only in error messages (-1 when unknown).
  int rank() const noexcept { return rank_.load(std::memory_order_relaxed); }
  void set_rank(int rank) noexcept { rank_.store(rank, std::memory_order_relaxed); }

 protected:
  [[gnu::cold]] [[noreturn]] void throw_timeout(std::string_view operation, std::span<const std::string> keys,
                                                std::chrono::milliseconds waited) const {
    std::string names;
    for (const auto& key : keys) names += detail::text((names.empty() ? "'" : ", '"), key, "'");
    throw timeout_error(rank(), detail::text("store.", operation),
                        detail::text("waited ", detail::format_duration(waited), " for key(s) ", names),
                        "a peer has not arrived or crashed before publishing; check that every "
                        "rank was started with the same world size and master address");
  }

 private:
  std::atomic<std::chrono::milliseconds::rep> timeout_ms_{default_timeout.count()};
  std::atomic<int> rank_{-1};
};

namespace detail {

// What a rank throws when a key that cohort itself writes (a rank's address, device or split
// color) holds something cohort never writes: another program, a stray or hostile client, or
// a rank of another job sharing the store wrote it. Names the key, shows the start of the
// value (escaped) and what was expected, and points at the store token (SECURITY.md).
[[gnu::cold]] COHORT_DECL error malformed_store_value(int rank, std::string_view operation, std::string_view key,
                                                      std::span<const std::uint8_t> value, std::string_view expected);
inline error malformed_store_value(int rank, std::string_view operation, std::string_view key, std::string_view value,
                                   std::string_view expected) {
  return malformed_store_value(
      rank, operation, key,
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(value.data()), value.size()), expected);
}

// Parses exactly `count` decimal integers separated by `separator` (no spaces, no signs other
// than a leading '-'); false when the text is anything else.
COHORT_DECL bool parse_int_fields(std::string_view text, char separator, std::span<int> out);

}  // namespace detail

// A namespace inside another store: every key is stored as prefix + key. Its waits use its
// own timeout(), passed to the inner store with each call; the inner store's settings are
// never changed (several groups share one store, each with its own timeout).
class prefix_store final : public store {
 public:
  COHORT_DECL prefix_store(std::shared_ptr<store> inner, std::string prefix);

  // Its set and add too wait at most its own timeout() (the group's, for a group's store).
  COHORT_DECL void set(std::string_view key, std::span<const std::uint8_t> value) override;
  using store::set;
  COHORT_DECL void set_within(std::string_view key, std::span<const std::uint8_t> value,
                              std::chrono::milliseconds timeout) override;
  COHORT_DECL bytes get(std::string_view key, std::chrono::milliseconds timeout) override;
  using store::get;
  COHORT_DECL std::int64_t add(std::string_view key, std::int64_t delta) override;
  COHORT_DECL std::int64_t add_within(std::string_view key, std::int64_t delta,
                                      std::chrono::milliseconds timeout) override;
  COHORT_DECL bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                std::span<const std::uint8_t> desired) override;
  COHORT_DECL bool check(std::span<const std::string> keys) override;
  COHORT_DECL void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override;
  using store::wait;
  COHORT_DECL bool delete_key(std::string_view key) override;
  // Counts the inner store's keys: c10d has no per-prefix count either.
  COHORT_DECL std::int64_t num_keys() override;
  COHORT_DECL std::vector<bytes> multi_get(std::span<const std::string> keys,
                                           std::chrono::milliseconds timeout) override;
  using store::multi_get;
  // The inner store's bounded handle under the same prefix (null when the inner has none).
  COHORT_DECL std::shared_ptr<store> bounded(std::chrono::milliseconds timeout) const override;
  COHORT_DECL std::string location() const override;
  COHORT_DECL std::string reached_from_other_hosts(std::chrono::milliseconds limit) override;

  const std::string& prefix() const noexcept { return prefix_; }
  const std::shared_ptr<store>& inner() const noexcept { return inner_; }

 private:
  COHORT_DECL std::string full(std::string_view key) const;
  COHORT_DECL std::vector<std::string> full(std::span<const std::string> keys) const;
  std::shared_ptr<store> inner_;
  std::string prefix_;
};

// All ranks in one process: threads share one memory_store (hold it by shared_ptr).
class memory_store final : public store {
 public:
  COHORT_DECL void set(std::string_view key, std::span<const std::uint8_t> value) override;
  using store::set;

  COHORT_DECL bytes get(std::string_view key, std::chrono::milliseconds timeout) override;
  using store::get;

  COHORT_DECL std::int64_t add(std::string_view key, std::int64_t delta) override;

  COHORT_DECL bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                std::span<const std::uint8_t> desired) override;

  COHORT_DECL bool check(std::span<const std::string> keys) override;

  COHORT_DECL void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override;
  using store::wait;

  COHORT_DECL bool delete_key(std::string_view key) override;

  COHORT_DECL std::int64_t num_keys() override;

  COHORT_DECL std::vector<bytes> multi_get(std::span<const std::string> keys,
                                           std::chrono::milliseconds timeout) override;
  using store::multi_get;

 private:
  bool all_present(std::span<const std::string> keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) { return data_.count(key) > 0; });
  }
  COHORT_DECL void wait_locked(std::unique_lock<std::mutex>& lock, std::span<const std::string> keys,
                               std::chrono::milliseconds timeout, std::string_view operation);

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, bytes, std::less<>> data_;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/store.ipp"
#endif
