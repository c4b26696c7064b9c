#pragma once
// cohort/detail/tcp_store_protocol.hpp's definitions: inline there when header-only, compiled once by
// <cohort/impl/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/detail/config.hpp).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/detail/config.hpp"
#include "cohort/detail/tcp_store_protocol.hpp"

namespace cohort::inline v0::detail::tcp_store_protocol {

COHORT_DECL const char* command_name(command c) noexcept {
  switch (c) {
    case command::validate: return "VALIDATE";
    case command::set: return "SET";
    case command::compare_set: return "COMPARE_SET";
    case command::get: return "GET";
    case command::add: return "ADD";
    case command::check: return "CHECK";
    case command::wait: return "WAIT";
    case command::num_keys: return "GETNUMKEYS";
    case command::delete_key: return "DELETE_KEY";
    case command::append: return "APPEND";
    case command::multi_get: return "MULTI_GET";
    case command::multi_set: return "MULTI_SET";
    case command::cancel_wait: return "CANCEL_WAIT";
    case command::ping: return "PING";
  }
  return "unknown";
}

}  // namespace cohort::inline v0::detail::tcp_store_protocol

namespace cohort::inline v0::detail::tcp_store_protocol {
namespace parsing {

COHORT_DECL bool key_list(cursor& in, request& out) {
  std::uint64_t count = 0;
  if (!in.count(count, "key")) return false;
  out.keys.resize(count);
  for (auto& key : out.keys)
    if (!in.string(key, max_key_bytes, "key")) return false;
  return true;
}

}  // namespace parsing
}  // namespace cohort::inline v0::detail::tcp_store_protocol

namespace cohort::inline v0::detail::tcp_store_protocol {

COHORT_DECL parse_result parse_request(std::span<const std::uint8_t> input, request& out) {
  parsing::cursor in(input);
  out = request{};
  std::uint8_t code = 0;
  if (!in.fixed(code)) return in.result();
  if (code > last_command) return {parse_status::malformed, 0, "unknown command " + std::to_string(code)};
  out.command = static_cast<command>(code);

  auto key = [&] {
    out.keys.emplace_back();
    return in.string(out.keys.back(), max_key_bytes, "key");
  };
  auto value = [&] {
    out.values.emplace_back();
    return in.data(out.values.back(), max_value_bytes, "value");
  };

  switch (out.command) {
    case command::validate:
    case command::ping: in.fixed(out.word); break;
    case command::set:
    case command::append: key() && value(); break;
    case command::compare_set: key() && value() && value(); break;
    case command::get:
    case command::delete_key: key(); break;
    case command::add: key() && in.fixed(out.delta); break;
    case command::check:
    case command::wait:
    case command::multi_get: parsing::key_list(in, out); break;
    case command::multi_set: {
      std::uint64_t count = 0;
      if (!in.count(count, "key")) break;
      for (std::uint64_t i = 0; i < count; ++i)
        if (!(key() && value())) break;
      break;
    }
    case command::num_keys:
    case command::cancel_wait: break;
  }
  return in.result();
}

}  // namespace cohort::inline v0::detail::tcp_store_protocol
