#pragma once
// cohort/rendezvous/detail/tcp_store_protocol.hpp's definitions: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"
#include "cohort/rendezvous/detail/tcp_store_protocol.hpp"

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
    case command::auth_hello: return "AUTH_HELLO";
    case command::auth_proof: return "AUTH_PROOF";
  }
  return "unknown";
}

namespace auth_labels {
inline constexpr std::string_view server_label = "cohort-store-v1 server";
inline constexpr std::string_view client_label = "cohort-store-v1 client";

inline std::span<const std::uint8_t> as_bytes_of(std::string_view text) noexcept {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}
}  // namespace auth_labels

COHORT_DECL sha256_digest server_proof(std::string_view token, const nonce& client, const nonce& server) noexcept {
  using namespace auth_labels;
  return hmac_sha256(as_bytes_of(token), {as_bytes_of(server_label), client, server});
}

COHORT_DECL sha256_digest client_proof(std::string_view token, const nonce& client, const nonce& server) noexcept {
  using namespace auth_labels;
  return hmac_sha256(as_bytes_of(token), {as_bytes_of(client_label), server, client});
}

}  // namespace cohort::inline v0::detail::tcp_store_protocol

namespace cohort::inline v0::detail::tcp_store_protocol {
namespace parsing {

COHORT_DECL bool key_list(cursor& in, request& out) {
  std::uint64_t count = 0;
  if (!in.count(count, "key")) return false;
  out.keys.resize(count);
  for (auto& key : out.keys)
    if (!in.string(key, in.bounds().max_key_bytes, "key")) return false;
  return true;
}

}  // namespace parsing
}  // namespace cohort::inline v0::detail::tcp_store_protocol

namespace cohort::inline v0::detail::tcp_store_protocol {

COHORT_DECL parse_result parse_request(std::span<const std::uint8_t> input, request& out, const limits& bounds) {
  parsing::cursor in(input, bounds);
  out = request{};
  std::uint8_t code = 0;
  if (!in.fixed(code)) return in.result();
  if (!known_command(code)) return {parse_status::malformed, 0, detail::text("unknown command ", std::to_string(code))};
  out.command = static_cast<command>(code);

  auto key = [&] {
    out.keys.emplace_back();
    return in.string(out.keys.back(), bounds.max_key_bytes, "key");
  };
  auto value = [&] {
    out.values.emplace_back();
    return in.data(out.values.back(), bounds.max_value_bytes, "value");
  };

  switch (out.command) {
    case command::auth_hello: {
      std::uint8_t version = 0;
      if (in.fixed(version) && in.fixed(out.token)) out.word = version;
      break;
    }
    case command::auth_proof: in.fixed(out.token); break;
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
