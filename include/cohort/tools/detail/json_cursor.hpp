#pragma once
// A forward-only JSON reader and the writer's escaping: the lexer under json.hpp's tree, and
// on its own the reader of formats whose members come in a fixed order (a checkpoint's index),
// which builds no tree: memory is what the caller keeps, time is one pass over the text.
//
//   json_cursor in(text);
//   in.open('{');
//   in.key("step");          // "step": (the next member must be this one)
//   const auto step = in.unsigned_integer();
//   in.comma();
//   ...
//   in.close('}');
//   in.finish();             // nothing but space left
//
// Errors are cohort::error with operation "json parse": what was expected, the line and
// column, and what was found. The line and column are counted only when an error is raised.

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

#include "cohort/detail/scalar_math.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0::detail {

struct json_limits {
  std::size_t max_bytes = std::size_t{64} << 20;
  int max_depth = 64;
};

// JSON's spelling of a string (quotes and escapes appended to `out`).
inline void json_write_string(std::string& out, std::string_view text) {
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

// The shortest text that reads back as `number` exactly; whole numbers an int64 holds exactly
// as digits (1764600030000000, not 1.76460003e+15). NaN and infinity have no JSON spelling.
inline std::string json_format_number(double number) {
  if (!is_finite(number))
    throw cohort::error(-1, "json", "cannot write a non-finite number (NaN or infinity)",
                        "JSON has no spelling for it; write null or a string instead");
  if (number == 0) return "0";  // also turns -0 into 0
  if (round_down(number) == number && absolute(number) < 9007199254740992.0)
    return std::to_string(static_cast<long long>(number));
  char buffer[32];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, number);
  (void)ec;  // 32 characters always hold the shortest round-trip form of a double
  return std::string(buffer, end);
}

class json_cursor {
 public:
  explicit json_cursor(std::string_view text, json_limits limits = {}) : text_(text), limits_(limits) {
    if (text_.size() > limits_.max_bytes)
      throw cohort::error(-1, "json parse",
                          detail::text("input of ", std::to_string(text_.size()), " bytes exceeds the limit of ",
                                       std::to_string(limits_.max_bytes), " bytes"),
                          "raise json_limits::max_bytes if the file is genuine");
  }

  const json_limits& limits() const noexcept { return limits_; }
  std::size_t position() const noexcept { return position_; }
  std::size_t remaining() const noexcept { return text_.size() - position_; }

  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++position_;
  }
  bool at_end() const noexcept { return position_ >= text_.size(); }
  char peek() const noexcept { return text_[position_]; }
  // The next character after space, not consumed ('\0' at the end).
  char next_char() {
    skip_space();
    return at_end() ? '\0' : peek();
  }

  // Space, then `c`.
  void open(char c) {
    if (next_char() != c) fail(detail::text("expected '", std::string(1, c), "'"), found());
    ++position_;
  }
  void close(char c) { open(c); }
  void comma() { open(','); }
  // Inside an array or object: true when another item follows (its ',' consumed, or the first
  // item's start seen), false when `close` ends it (consumed). `first` says whether any item
  // came before.
  bool more(char close_char, bool first) {
    const char c = next_char();
    if (c == close_char) {
      ++position_;
      return false;
    }
    if (first) return true;
    if (c != ',') fail(detail::text("expected ',' or '", std::string(1, close_char), "'"), found());
    ++position_;
    return true;
  }
  // "name": the next member must be this one.
  void key(std::string_view name) {
    if (next_char() != '"') fail(detail::text("expected the member \"", name, "\""), found());
    const std::size_t at = position_;
    if (string() != name) {
      position_ = at;
      fail(detail::text("expected the member \"", name, "\""), found_token());
    }
    open(':');
  }
  // Consumes `null` if it comes next.
  bool null() {
    if (next_char() != 'n') return false;
    word("null");
    return true;
  }
  void word(std::string_view expected) {
    skip_space();
    if (text_.substr(position_, expected.size()) != expected) fail(detail::text("expected '", expected, "'"), found());
    position_ += expected.size();
  }
  void finish() {
    skip_space();
    if (!at_end()) fail("expected the end of the input after the top-level value", found());
  }

  // A string value, unescaped.
  std::string string() {
    if (next_char() != '"') fail("expected a string", found());
    ++position_;
    std::string out;
    for (;;) {
      // A run without escapes in one append: long strings cost one copy.
      const std::size_t start = position_;
      while (!at_end() && peek() != '"' && peek() != '\\' && static_cast<unsigned char>(peek()) >= 0x20) ++position_;
      out.append(text_.data() + start, position_ - start);
      if (at_end()) fail("expected a closing '\"'", found());
      const char c = peek();
      if (c == '"') {
        ++position_;
        return out;
      }
      if (c != '\\') fail("expected an escaped control character in a string", found());
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
          unsigned code = hex4();
          if (code >= 0xd800 && code < 0xdc00) {  // high surrogate: a low one must follow
            if (text_.substr(position_, 2) != "\\u") fail("expected a low surrogate \\uDC00-\\uDFFF", found());
            position_ += 2;
            const unsigned low = hex4();
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

  // A number as JSON spells it, as the nearest double.
  double number() {
    skip_space();
    const std::size_t start = position_;
    const auto digits = [&] {
      const std::size_t first = position_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
      return position_ - first;
    };
    if (!at_end() && peek() == '-') ++position_;
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
    double value = 0;
    const char* first = text_.data() + start;
    const char* last = text_.data() + position_;
    auto [end, ec] = std::from_chars(first, last, value);
    if (ec == std::errc::result_out_of_range || !is_finite(value)) {
      position_ = start;
      fail("expected a number a double can hold", detail::text("'", std::string_view(first, last - first), "'"));
    }
    if (ec != std::errc{} || end != last) {
      position_ = start;
      fail("expected a number", detail::text("'", std::string_view(first, last - first), "'"));
    }
    return value;
  }

  // Digits only (no sign, fraction or exponent, no leading zeros), exact up to 2^64 - 1.
  std::uint64_t unsigned_integer() {
    skip_space();
    const std::size_t start = position_;
    while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
    if (position_ == start) fail("expected an unsigned integer", found());
    if (text_[start] == '0' && position_ - start > 1) {
      position_ = start;
      fail("expected no leading zeros in an integer", found_token());
    }
    if (!at_end() && (peek() == '.' || peek() == 'e' || peek() == 'E')) fail("expected a whole number", found());
    std::uint64_t value = 0;
    const auto [end, ec] = std::from_chars(text_.data() + start, text_.data() + position_, value);
    (void)end;
    if (ec != std::errc{}) {
      position_ = start;
      fail("expected an integer below 2^64", found_token());
    }
    return value;
  }

  // What the next token is, for messages.
  std::string found() const {
    if (at_end()) return "the end of the input";
    const char c = peek();
    if (static_cast<unsigned char>(c) < 0x20) return detail::text("control character ", std::to_string(int(c)));
    return detail::text("'", std::string(1, c), "'");
  }
  std::string found_token() const {
    if (at_end()) return "the end of the input";
    std::size_t end = position_;
    if (peek() == '"') {
      for (++end; end < text_.size() && text_[end] != '"' && end - position_ < 40; ++end)
        if (text_[end] == '\\') ++end;
      ++end;
    } else {
      while (end < text_.size() && end - position_ < 40 &&
             std::string_view(" \t\r\n,]}:").find(text_[end]) == std::string_view::npos)
        ++end;
    }
    return detail::text("'", text_.substr(position_, std::min(end, text_.size()) - position_), "'");
  }

  [[noreturn]] void fail(std::string_view expected, std::string_view what) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < position_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw cohort::error(-1, "json parse",
                        detail::text(expected, " at line ", std::to_string(line), " column ", std::to_string(column),
                                     ", found ", what));
  }

 private:
  unsigned hex4() {
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

  std::string_view text_;
  json_limits limits_;
  std::size_t position_ = 0;
};

}  // namespace cohort::inline v0::detail
