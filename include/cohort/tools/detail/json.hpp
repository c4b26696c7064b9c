#pragma once
// A small JSON value, writer and reader: enough for cohort's own result files
// (cohort-bench output, cohort-plan --json), not a general-purpose library.
// Over 400 lines: a value, a writer and a reader that belong together; the tools' only.
//
// - Values: null, bool, number (double), string, array, object. Objects keep their keys in
//   insertion order so files written by cohort read the way they were written.
// - The reader is bounded: input size (default 64 MiB) and nesting depth (default 64) are
//   limited, so a corrupt or hostile file cannot exhaust memory or the stack.
// - Errors are cohort::error with operation "json parse" / "json", the line and column,
//   what was expected and what was found.
// - Numbers are doubles: integers are exact up to 2^53, which covers every byte count a
//   benchmark can produce. NaN and infinity have no JSON spelling; writing them throws.

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "cohort/error.hpp"

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

  static std::string format_number(double number) {
    if (!std::isfinite(number))
      throw cohort::error(-1, "json", "cannot write a non-finite number (NaN or infinity)",
                          "JSON has no spelling for it; write null or a string instead");
    if (number == 0) return "0";  // also turns -0 into 0
    // Whole numbers an int64 holds exactly print as digits: 1764600030000000, not the
    // shorter 1.76460003e+15 that to_chars picks (timestamps, byte counts).
    if (std::floor(number) == number && std::fabs(number) < 9007199254740992.0)
      return std::to_string(static_cast<long long>(number));
    char buffer[32];
    auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, number);
    (void)ec;  // 32 characters always hold the shortest round-trip form of a double
    return std::string(buffer, end);
  }

  static void write_string(std::string& out, std::string_view text) {
    out += '"';
    for (const char c : text) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            static constexpr char hex[] = "0123456789abcdef";
            out += "\\u00";
            out += hex[(c >> 4) & 0xf];
            out += hex[c & 0xf];
          } else {
            out += c;
          }
      }
    }
    out += '"';
  }

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

struct json_limits {
  std::size_t max_bytes = std::size_t{64} << 20;
  int max_depth = 64;
};

class json_reader {
 public:
  json_reader(std::string_view text, json_limits limits) : text_(text), limits_(limits) {}

  json parse_document() {
    if (text_.size() > limits_.max_bytes)
      throw cohort::error(-1, "json parse",
                          "input of " + std::to_string(text_.size()) + " bytes exceeds the limit of " +
                              std::to_string(limits_.max_bytes) + " bytes",
                          "raise json_limits::max_bytes if the file is genuine");
    skip_space();
    if (at_end()) fail("expected a value", "the end of the input (empty document)");
    json value = parse_value(0);
    skip_space();
    if (!at_end()) fail("expected the end of the input after the top-level value", found());
    return value;
  }

 private:
  bool at_end() const { return position_ >= text_.size(); }
  char peek() const { return text_[position_]; }

  std::string found() const {
    if (at_end()) return "the end of the input";
    const char c = peek();
    if (static_cast<unsigned char>(c) < 0x20) return "control character " + std::to_string(int(c));
    return std::string("'") + c + "'";
  }

  [[noreturn]] void fail(const std::string& expected, const std::string& what) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < position_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw cohort::error(
        -1, "json parse",
        expected + " at line " + std::to_string(line) + " column " + std::to_string(column) + ", found " + what);
  }

  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++position_;
  }

  void expect_word(std::string_view word) {
    if (text_.substr(position_, word.size()) != word) fail("expected '" + std::string(word) + "'", found());
    position_ += word.size();
  }

  json parse_value(int depth) {
    if (depth > limits_.max_depth)
      fail("nesting deeper than " + std::to_string(limits_.max_depth) + " levels", found());
    if (at_end()) fail("expected a value", found());
    switch (peek()) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return json(parse_string());
      case 't': expect_word("true"); return json(true);
      case 'f': expect_word("false"); return json(false);
      case 'n': expect_word("null"); return json();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return json(parse_number());
        fail("expected a value", found());
    }
  }

  json parse_object(int depth) {
    ++position_;  // '{'
    json::object members;
    skip_space();
    if (!at_end() && peek() == '}') {
      ++position_;
      return json(std::move(members));
    }
    for (;;) {
      skip_space();
      if (at_end() || peek() != '"') fail("expected a string key", found());
      std::string key = parse_string();
      for (const auto& member : members)
        if (member.first == key) fail("duplicate key \"" + key + "\"", "it a second time");
      skip_space();
      if (at_end() || peek() != ':') fail("expected ':' after a key", found());
      ++position_;
      skip_space();
      json value = parse_value(depth + 1);
      members.emplace_back(std::move(key), std::move(value));
      skip_space();
      if (!at_end() && peek() == ',') {
        ++position_;
        continue;
      }
      if (!at_end() && peek() == '}') {
        ++position_;
        return json(std::move(members));
      }
      fail("expected ',' or '}' in an object", found());
    }
  }

  json parse_array(int depth) {
    ++position_;  // '['
    json::array items;
    skip_space();
    if (!at_end() && peek() == ']') {
      ++position_;
      return json(std::move(items));
    }
    for (;;) {
      skip_space();
      items.push_back(parse_value(depth + 1));
      skip_space();
      if (!at_end() && peek() == ',') {
        ++position_;
        continue;
      }
      if (!at_end() && peek() == ']') {
        ++position_;
        return json(std::move(items));
      }
      fail("expected ',' or ']' in an array", found());
    }
  }

  unsigned parse_hex4() {
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      if (at_end()) fail("expected four hex digits after \\u", found());
      const char c = peek();
      code <<= 4;
      if (c >= '0' && c <= '9')
        code |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f')
        code |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        code |= unsigned(c - 'A' + 10);
      else
        fail("expected four hex digits after \\u", found());
      ++position_;
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += char(code);
    } else if (code < 0x800) {
      out += char(0xc0 | (code >> 6));
      out += char(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += char(0xe0 | (code >> 12));
      out += char(0x80 | ((code >> 6) & 0x3f));
      out += char(0x80 | (code & 0x3f));
    } else {
      out += char(0xf0 | (code >> 18));
      out += char(0x80 | ((code >> 12) & 0x3f));
      out += char(0x80 | ((code >> 6) & 0x3f));
      out += char(0x80 | (code & 0x3f));
    }
  }

  std::string parse_string() {
    ++position_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("expected a closing '\"'", found());
      const char c = peek();
      if (c == '"') {
        ++position_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("expected an escaped control character in a string", found());
      if (c != '\\') {
        out += c;
        ++position_;
        continue;
      }
      ++position_;
      if (at_end()) fail("expected an escape character after '\\'", found());
      const char escaped = peek();
      ++position_;
      switch (escaped) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = parse_hex4();
          if (code >= 0xd800 && code < 0xdc00) {  // high surrogate: a low one must follow
            if (text_.substr(position_, 2) != "\\u") fail("expected a low surrogate \\uDC00-\\uDFFF", found());
            position_ += 2;
            const unsigned low = parse_hex4();
            if (low < 0xdc00 || low >= 0xe000) fail("expected a low surrogate \\uDC00-\\uDFFF", "another code");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          } else if (code >= 0xdc00 && code < 0xe000) {
            fail("expected a high surrogate before a low one", "a lone low surrogate");
          }
          append_utf8(out, code);
          break;
        }
        default: --position_; fail("expected a valid escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)", found());
      }
    }
  }

  double parse_number() {
    const std::size_t start = position_;
    auto digits = [&] {
      const std::size_t first = position_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
      return position_ - first;
    };
    if (peek() == '-') ++position_;
    if (!at_end() && peek() == '0') {
      ++position_;
      if (!at_end() && peek() >= '0' && peek() <= '9') fail("expected no leading zeros in a number", found());
    } else if (digits() == 0) {
      fail("expected a digit", found());
    }
    if (!at_end() && peek() == '.') {
      ++position_;
      if (digits() == 0) fail("expected a digit after the decimal point", found());
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++position_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++position_;
      if (digits() == 0) fail("expected a digit in the exponent", found());
    }
    double number = 0;
    const char* first = text_.data() + start;
    const char* last = text_.data() + position_;
    auto [end, ec] = std::from_chars(first, last, number);
    if (ec == std::errc::result_out_of_range || !std::isfinite(number)) {
      position_ = start;
      fail("expected a number a double can hold", "'" + std::string(first, last) + "'");
    }
    if (ec != std::errc{} || end != last) {
      position_ = start;
      fail("expected a number", "'" + std::string(first, last) + "'");
    }
    return number;
  }

  std::string_view text_;
  json_limits limits_;
  std::size_t position_ = 0;
};

inline json parse_json(std::string_view text, json_limits limits = {}) {
  return json_reader(text, limits).parse_document();
}

}  // namespace cohort::inline v0::detail
