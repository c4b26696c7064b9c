#pragma once
// cohort/rendezvous/store.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <atomic>
#include <charconv>
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
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

#include "cohort/config.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0 {

COHORT_DECL auto memory_store::set(std::string_view key, std::span<const std::uint8_t> value) -> void {
  {
    std::lock_guard lock(mutex_);
    data_[std::string(key)] = bytes(value.begin(), value.end());
  }
  changed_.notify_all();
}

COHORT_DECL auto memory_store::get(std::string_view key, std::chrono::milliseconds timeout) -> bytes {
  const std::string name(key);
  std::unique_lock lock(mutex_);
  wait_locked(lock, std::span<const std::string>(&name, 1), timeout, "get");
  return data_.at(name);
}

COHORT_DECL auto memory_store::add(std::string_view key, std::int64_t delta) -> std::int64_t {
  std::int64_t value = 0;
  {
    std::lock_guard lock(mutex_);
    auto& slot = data_[std::string(key)];
    if (!slot.empty()) value = std::stoll(to_string(slot));
    value += delta;
    slot = to_bytes(std::to_string(value));
  }
  changed_.notify_all();
  return value;
}

COHORT_DECL auto memory_store::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                           std::span<const std::uint8_t> desired) -> bytes {
  bytes result;
  {
    std::lock_guard lock(mutex_);
    auto it = data_.find(std::string(key));
    if (it == data_.end()) {
      if (!expected.empty()) return bytes(expected.begin(), expected.end());
      it = data_.emplace(std::string(key), bytes(desired.begin(), desired.end())).first;
    } else if (std::equal(it->second.begin(), it->second.end(), expected.begin(), expected.end())) {
      it->second.assign(desired.begin(), desired.end());
    }
    result = it->second;
  }
  changed_.notify_all();
  return result;
}

COHORT_DECL auto memory_store::check(std::span<const std::string> keys) -> bool {
  std::lock_guard lock(mutex_);
  return all_present(keys);
}

COHORT_DECL auto memory_store::wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) -> void {
  std::unique_lock lock(mutex_);
  wait_locked(lock, keys, timeout, "wait");
}

COHORT_DECL auto memory_store::delete_key(std::string_view key) -> bool {
  std::lock_guard lock(mutex_);
  return data_.erase(std::string(key)) > 0;
}

COHORT_DECL auto memory_store::num_keys() -> std::int64_t {
  std::lock_guard lock(mutex_);
  return static_cast<std::int64_t>(data_.size());
}

COHORT_DECL auto memory_store::wait_locked(std::unique_lock<std::mutex>& lock, std::span<const std::string> keys,
                                           std::chrono::milliseconds timeout, std::string_view operation) -> void {
  if (!changed_.wait_for(lock, timeout, [&] { return all_present(keys); })) {
    std::vector<std::string> missing;
    for (const auto& key : keys)
      if (!data_.count(key)) missing.push_back(key);
    throw_timeout(operation, missing, timeout);
  }
}
COHORT_DECL bytes to_bytes(std::string_view text) { return bytes(text.begin(), text.end()); }

COHORT_DECL std::string to_string(std::span<const std::uint8_t> data) { return std::string(data.begin(), data.end()); }

COHORT_DECL auto store::set(std::string_view key, std::string_view value) -> void {
  const bytes data = to_bytes(value);
  set(key, std::span<const std::uint8_t>(data));
}

COHORT_DECL auto store::get_string(std::string_view key) -> std::string { return to_string(get(key)); }

COHORT_DECL auto store::wait(std::initializer_list<std::string> keys) -> void {
  std::vector<std::string> list(keys);
  wait(std::span<const std::string>(list), timeout());
}

COHORT_DECL auto store::multi_get(std::span<const std::string> keys) -> std::vector<bytes> {
  return multi_get(keys, timeout());
}

COHORT_DECL auto store::multi_get(std::span<const std::string> keys, std::chrono::milliseconds timeout)
    -> std::vector<bytes> {
  const auto start = std::chrono::steady_clock::now();
  wait(keys, timeout);
  std::vector<bytes> values;
  values.reserve(keys.size());
  for (const auto& key : keys) {
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    values.push_back(get(key, std::max(timeout - spent, std::chrono::milliseconds(1))));
  }
  return values;
}

COHORT_DECL auto memory_store::multi_get(std::span<const std::string> keys, std::chrono::milliseconds timeout)
    -> std::vector<bytes> {
  std::unique_lock lock(mutex_);
  wait_locked(lock, keys, timeout, "multi_get");
  std::vector<bytes> values;
  values.reserve(keys.size());
  for (const auto& key : keys) values.push_back(data_.find(key)->second);
  return values;
}

COHORT_DECL prefix_store::prefix_store(std::shared_ptr<store> inner, std::string prefix)
    : inner_(std::move(inner)), prefix_(std::move(prefix)) {
  set_timeout(inner_->timeout());
  set_rank(inner_->rank());
}

COHORT_DECL auto prefix_store::set(std::string_view key, std::span<const std::uint8_t> value) -> void {
  inner_->set_within(full(key), value, timeout());
}

COHORT_DECL auto prefix_store::set_within(std::string_view key, std::span<const std::uint8_t> value,
                                          std::chrono::milliseconds timeout) -> void {
  inner_->set_within(full(key), value, std::min(timeout, this->timeout()));
}

COHORT_DECL auto prefix_store::get(std::string_view key, std::chrono::milliseconds timeout) -> bytes {
  return inner_->get(full(key), timeout);
}

COHORT_DECL auto prefix_store::add(std::string_view key, std::int64_t delta) -> std::int64_t {
  return inner_->add_within(full(key), delta, timeout());
}

COHORT_DECL auto prefix_store::add_within(std::string_view key, std::int64_t delta, std::chrono::milliseconds timeout)
    -> std::int64_t {
  return inner_->add_within(full(key), delta, std::min(timeout, this->timeout()));
}

COHORT_DECL auto prefix_store::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                           std::span<const std::uint8_t> desired) -> bytes {
  return inner_->compare_set(full(key), expected, desired);
}

COHORT_DECL auto prefix_store::check(std::span<const std::string> keys) -> bool { return inner_->check(full(keys)); }

COHORT_DECL auto prefix_store::delete_key(std::string_view key) -> bool { return inner_->delete_key(full(key)); }

COHORT_DECL auto prefix_store::num_keys() -> std::int64_t { return inner_->num_keys(); }

COHORT_DECL auto prefix_store::multi_get(std::span<const std::string> keys, std::chrono::milliseconds timeout)
    -> std::vector<bytes> {
  return inner_->multi_get(full(keys), timeout);
}

COHORT_DECL auto prefix_store::location() const -> std::string { return inner_->location(); }

COHORT_DECL auto prefix_store::reached_from_other_hosts(std::chrono::milliseconds limit) -> std::string {
  return inner_->reached_from_other_hosts(limit);
}

COHORT_DECL auto prefix_store::full(std::string_view key) const -> std::string { return prefix_ + std::string(key); }

COHORT_DECL auto prefix_store::bounded(std::chrono::milliseconds timeout) const -> std::shared_ptr<store> {
  auto inner = inner_->bounded(timeout);
  if (!inner) return nullptr;
  auto view = std::make_shared<prefix_store>(std::move(inner), prefix_);
  view->set_timeout(timeout);
  view->set_rank(rank());
  return view;
}

COHORT_DECL auto prefix_store::wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) -> void {
  const auto names = full(keys);
  inner_->wait(std::span<const std::string>(names), timeout);
}

COHORT_DECL auto prefix_store::full(std::span<const std::string> keys) const -> std::vector<std::string> {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(full(key));
  return out;
}

namespace detail {

COHORT_DECL error malformed_store_value(int rank, std::string_view operation, std::string_view key,
                                        std::span<const std::uint8_t> value, std::string_view expected) {
  constexpr std::size_t shown = 48;
  std::string text;
  for (std::size_t i = 0; i < std::min(value.size(), shown); ++i) {
    const unsigned char c = value[i];
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      text += static_cast<char>(c);
    } else {
      static constexpr char digits[] = "0123456789abcdef";
      text += "\\x";
      text += digits[c >> 4];
      text += digits[c & 15];
    }
  }
  if (value.size() > shown) text += "...";
  return error(rank, operation,
               detail::text("key '", key, "' holds malformed data written by someone else: '", text, "' (",
                            std::to_string(value.size()), " bytes; cohort writes ", expected, ")"),
               "another program, a stray client or another job wrote into this job's rendezvous store; give each "
               "job its own MASTER_PORT, and set the same COHORT_STORE_TOKEN on every rank so the store serves only "
               "the job's ranks (SECURITY.md)");
}

COHORT_DECL bool parse_int_fields(std::string_view text, char separator, std::span<int> out) {
  std::size_t position = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::size_t end = i + 1 < out.size() ? text.find(separator, position) : text.size();
    if (end == std::string_view::npos) return false;
    const char* first = text.data() + position;
    const char* last = text.data() + end;
    if (first == last) return false;
    const auto [stop, status] = std::from_chars(first, last, out[i]);
    if (status != std::errc() || stop != last) return false;
    position = end + 1;
  }
  return true;
}

}  // namespace detail

}  // namespace cohort::inline v0
