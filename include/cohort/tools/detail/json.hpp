#pragma once
// A small JSON value, writer and reader: enough for cohort's own result files
// (cohort-bench output, cohort-plan --json), not a general-purpose library.
// Over 400 lines: a value, a writer and a reader that belong together; the tools' only.
//
// - Values: null, bool, number (double), string, array, object. Objects keep their keys in
//   insertion order so files written by cohort read the way they were written.
// - The reader is bounded: input size (default 64 MiB) and nesting depth (default 64) are
//   limited, so a corrupt or hostile file cannot exhaust memory or the stack; its tokens come
//   from json_cursor (json_cursor.hpp), and an object's keys are checked for duplicates by
//   sorting them once it is complete (n log n: 80,000 keys in 0.05 s, not 17 s).
// - Errors are cohort::error with operation "json parse" / "json", the line and column,
//   what was expected and what was found.
// - Numbers are doubles: integers are exact up to 2^53, which covers every byte count a
//   benchmark can produce. NaN and infinity have no JSON spelling; writing them throws.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/tools/detail/json_cursor.hpp"

namespace cohort::inline v0::detail {

class json {
 public:
  using array = std::vector<json>;
  using member = std::pair<std::string, json>;
  using object = std::vector<member>;

  json() = default;  // null
  json(std::nullptr_t) {}
  json(bool value) : value_(value) {}
  json(double value) : value_(value) {}
  json(int value) : value_(static_cast<double>(value)) {}
  json(long value) : value_(static_cast<double>(value)) {}
  json(long long value) : value_(static_cast<double>(value)) {}
  json(unsigned value) : value_(static_cast<double>(value)) {}
  json(unsigned long value) : value_(static_cast<double>(value)) {}
  json(unsigned long long value) : value_(static_cast<double>(value)) {}
  json(const char* value) : value_(std::string(value)) {}
  json(std::string value) : value_(std::move(value)) {}
  json(std::string_view value) : value_(std::string(value)) {}
  json(array value) : value_(std::move(value)) {}
  json(object value) : value_(std::move(value)) {}

  static json make_array() { return json(array{}); }
  static json make_object() { return json(object{}); }

  bool is_null() const noexcept { return std::holds_alternative<std::monostate>(value_); }
  bool is_bool() const noexcept { return std::holds_alternative<bool>(value_); }
  bool is_number() const noexcept { return std::holds_alternative<double>(value_); }
  bool is_string() const noexcept { return std::holds_alternative<std::string>(value_); }
  bool is_array() const noexcept { return std::holds_alternative<array>(value_); }
  bool is_object() const noexcept { return std::holds_alternative<object>(value_); }

  const char* type_name() const noexcept {
    switch (value_.index()) {
      case 0: return "null";
      case 1: return "bool";
      case 2: return "number";
      case 3: return "string";
      case 4: return "array";
      default: return "object";
    }
  }

  bool as_bool() const { return get<bool>("bool"); }
  double as_number() const { return get<double>("number"); }
  const std::string& as_string() const { return get<std::string>("string"); }
  const array& as_array() const { return get<array>("array"); }
  array& as_array() { return get<array>("array"); }
  const object& as_object() const { return get<object>("object"); }
  object& as_object() { return get<object>("object"); }

  // An integer-valued number, checked: 3.5 or 1e300 are errors, not silently truncated.
  std::int64_t as_int64() const {
    const double number = as_number();
    if (std::floor(number) != number || std::fabs(number) > 9007199254740992.0)
      throw cohort::error(-1, "json", "expected an integer, found " + format_number(number),
                          "integers must be whole numbers below 2^53");
    return static_cast<std::int64_t>(number);
  }

  // Object member by key; nullptr when absent (or when this is not an object).
  const json* find(std::string_view key) const {
    if (!is_object()) return nullptr;
    for (const auto& [name, value] : as_object())
      if (name == key) return &value;
    return nullptr;
  }
  const json& at(std::string_view key) const {
    if (!is_object())
      throw cohort::error(-1, "json",
                          "looked up key \"" + std::string(key) + "\" in a " + type_name() + ", not an object");
    if (const json* value = find(key)) return *value;
    throw cohort::error(-1, "json", "missing key \"" + std::string(key) + "\"",
                        "the file may come from another tool or an older version");
  }
  const json& at(std::size_t index) const {
    const array& items = as_array();
    if (index >= items.size())
      throw cohort::error(
          -1, "json",
          "index " + std::to_string(index) + " past the end of an array of " + std::to_string(items.size()));
    return items[index];
  }
  std::size_t size() const {
    if (is_array()) return as_array().size();
    if (is_object()) return as_object().size();
    return 0;
  }

  // Appends to an array, or sets (replacing) an object member; null becomes the container.
  json& push_back(json value) {
    if (is_null()) value_ = array{};
    as_array().push_back(std::move(value));
    return as_array().back();
  }
  json& set(std::string key, json value) {
    if (is_null()) value_ = object{};
    for (auto& [name, existing] : as_object())
      if (name == key) return existing = std::move(value);
    as_object().emplace_back(std::move(key), std::move(value));
    return as_object().back().second;
  }

  // Defined after the class: nvcc's front end instantiates a defaulted comparison while
  // json is still incomplete and rejects std::pair<std::string, json>.
  friend bool operator==(const json& a, const json& b);

  // indent < 0: one line; otherwise pretty-printed with that many spaces per level.
  std::string dump(int indent = -1) const {
    std::string out;
    write(out, indent, 0);
    return out;
  }

  static std::string format_number(double number) { return json_format_number(number); }
  static void write_string(std::string& out, std::string_view text) { json_write_string(out, text); }

 private:
  template <class T>
  const T& get(const char* wanted) const {
    if (const T* value = std::get_if<T>(&value_)) return *value;
    throw cohort::error(-1, "json", std::string("expected a ") + wanted + ", found a " + type_name());
  }
  template <class T>
  T& get(const char* wanted) {
    if (T* value = std::get_if<T>(&value_)) return *value;
    throw cohort::error(-1, "json", std::string("expected a ") + wanted + ", found a " + type_name());
  }

  static void newline(std::string& out, int indent, int depth) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(depth), ' ');
  }

  void write(std::string& out, int indent, int depth) const {
    switch (value_.index()) {
      case 0: out += "null"; break;
      case 1: out += std::get<bool>(value_) ? "true" : "false"; break;
      case 2: out += format_number(std::get<double>(value_)); break;
      case 3: write_string(out, std::get<std::string>(value_)); break;
      case 4: {
        const auto& items = std::get<array>(value_);
        out += '[';
        for (std::size_t i = 0; i < items.size(); ++i) {
          if (i) out += ',';
          newline(out, indent, depth + 1);
          items[i].write(out, indent, depth + 1);
        }
        if (!items.empty()) newline(out, indent, depth);
        out += ']';
        break;
      }
      default: {
        const auto& members = std::get<object>(value_);
        out += '{';
        for (std::size_t i = 0; i < members.size(); ++i) {
          if (i) out += ',';
          newline(out, indent, depth + 1);
          write_string(out, members[i].first);
          out += indent < 0 ? ":" : ": ";
          members[i].second.write(out, indent, depth + 1);
        }
        if (!members.empty()) newline(out, indent, depth);
        out += '}';
      }
    }
  }

  std::variant<std::monostate, bool, double, std::string, array, object> value_;
};

inline bool operator==(const json& a, const json& b) { return a.value_ == b.value_; }

// The tree reader: json_cursor's tokens, nested. Duplicate keys are found by sorting each
// object's keys once it is complete, so an object of n members costs n log n, not n^2.
class json_reader {
 public:
  json_reader(std::string_view text, json_limits limits) : in_(text, limits) {}

  json parse_document() {
    if (in_.next_char() == '\0') in_.fail("expected a value", "the end of the input (empty document)");
    json value = parse_value(0);
    in_.finish();
    return value;
  }

 private:
  json parse_value(int depth) {
    if (depth > in_.limits().max_depth)
      in_.fail(detail::text("nesting deeper than ", std::to_string(in_.limits().max_depth), " levels"), in_.found());
    switch (in_.next_char()) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return json(in_.string());
      case 't': in_.word("true"); return json(true);
      case 'f': in_.word("false"); return json(false);
      case 'n': in_.word("null"); return json();
      default: {
        const char c = in_.next_char();
        if (c == '-' || (c >= '0' && c <= '9')) return json(in_.number());
        in_.fail("expected a value", in_.found());
      }
    }
  }

  json parse_object(int depth) {
    in_.open('{');
    json::object members;
    for (bool first = true; in_.more('}', first); first = false) {
      if (in_.next_char() != '"') in_.fail("expected a string key", in_.found());
      std::string key = in_.string();
      in_.open(':');
      members.emplace_back(std::move(key), parse_value(depth + 1));
    }
    if (members.size() > 1) {
      std::vector<const std::string*> keys;
      keys.reserve(members.size());
      for (const auto& member : members) keys.push_back(&member.first);
      std::sort(keys.begin(), keys.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
      for (std::size_t k = 1; k < keys.size(); ++k)
        if (*keys[k] == *keys[k - 1]) in_.fail(detail::text("duplicate key \"", *keys[k], "\""), "it a second time");
    }
    return json(std::move(members));
  }

  json parse_array(int depth) {
    in_.open('[');
    json::array items;
    for (bool first = true; in_.more(']', first); first = false) items.push_back(parse_value(depth + 1));
    return json(std::move(items));
  }

  json_cursor in_;
};

inline json parse_json(std::string_view text, json_limits limits = {}) {
  return json_reader(text, limits).parse_document();
}

}  // namespace cohort::inline v0::detail
