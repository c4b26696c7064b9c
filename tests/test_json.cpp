// The small JSON value behind cohort-bench and cohort-plan files: round trips, escapes,
// numbers, and the errors a malformed or oversized file must produce.

#include <catch2/catch.hpp>

#include <limits>
#include <string>

#include "cohort/tools/detail/json.hpp"

using cohort::detail::json;
using cohort::detail::json_limits;
using cohort::detail::parse_json;

namespace {
std::string error_of(const std::string& text, json_limits limits = {}) {
  try {
    parse_json(text, limits);
  } catch (const cohort::error& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("json: a nested document survives a write and a read, compact and indented") {
  json document = json::make_object();
  document.set("tool", "cohort-bench");
  document.set("world", 4);
  document.set("ok", true);
  document.set("missing", nullptr);
  json rows = json::make_array();
  for (int i = 0; i < 3; ++i) {
    json row = json::make_object();
    row.set("bytes", 1 << (10 * i));
    row.set("time_us", 12.5 * (i + 1));
    rows.push_back(row);
  }
  document.set("rows", rows);
  document.set("empty_array", json::make_array());
  document.set("empty_object", json::make_object());

  for (int indent : {-1, 0, 2}) {
    const json back = parse_json(document.dump(indent));
    CHECK(back == document);
  }
  const json back = parse_json(document.dump());
  CHECK(back.at("tool").as_string() == "cohort-bench");
  CHECK(back.at("world").as_int64() == 4);
  CHECK(back.at("rows").size() == 3);
  CHECK(back.at("rows").at(2).at("bytes").as_number() == 1048576.0);
  CHECK(back.at("rows").at(1).at("time_us").as_number() == 25.0);
  CHECK(back.at("missing").is_null());
  // Keys keep the order they were written in.
  CHECK(back.as_object().front().first == "tool");
  CHECK(back.as_object().back().first == "empty_object");
}

TEST_CASE("json: set replaces an existing key instead of adding a second one") {
  json object = json::make_object();
  object.set("a", 1);
  object.set("a", 2);
  CHECK(object.size() == 1);
  CHECK(object.at("a").as_number() == 2);
}

TEST_CASE("json: strings with quotes, control characters and unicode escapes") {
  const std::string tricky = "quote \" backslash \\ newline \n tab \t bell \x07 end";
  json value(tricky);
  const std::string text = value.dump();
  CHECK(text.find('\n') == std::string::npos);  // escaped, not raw
  CHECK(text.find("\\u0007") != std::string::npos);
  CHECK(parse_json(text).as_string() == tricky);
  CHECK(parse_json(R"("caf\u00e9")").as_string() == "caf\xc3\xa9");
  CHECK(parse_json(R"("\ud83d\ude00")").as_string() == "\xf0\x9f\x98\x80");  // surrogate pair
  CHECK(parse_json(R"("a\/b")").as_string() == "a/b");
}

TEST_CASE("json: numbers keep their value through a round trip") {
  for (double number : {0.0, 1.0, -3.0, 0.1, 1e-7, 6.02214076e23, 123456789012345.0, 9007199254740992.0}) {
    const json back = parse_json(json(number).dump());
    CHECK(back.as_number() == number);
  }
  CHECK(parse_json("-0.5e+2").as_number() == -50.0);
  CHECK(parse_json("1E3").as_number() == 1000.0);
  CHECK(json(-0.0).dump() == "0");
  CHECK(json(42).dump() == "42");
  CHECK(json(1764600030000000.0).dump() == "1764600030000000");  // digits, not 1.76460003e+15
  CHECK(json(-1e15).dump() == "-1000000000000000");
  CHECK(json(1e300).dump() == "1e+300");
}

TEST_CASE("json: integers are checked, not truncated") {
  CHECK(parse_json("12").as_int64() == 12);
  CHECK_THROWS_WITH(parse_json("3.5").as_int64(), Catch::Contains("integer"));
  CHECK_THROWS_WITH(parse_json("1e300").as_int64(), Catch::Contains("integer"));
}

TEST_CASE("json: type mismatches and missing keys name what was wrong") {
  const json value = parse_json(R"({"a": [1, 2], "s": "x"})");
  CHECK_THROWS_WITH(value.at("nope"), Catch::Contains("\"nope\""));
  CHECK_THROWS_WITH(value.at("s").as_number(), Catch::Contains("expected a number, found a string"));
  CHECK_THROWS_WITH(value.at("a").at(5), Catch::Contains("index 5"));
  CHECK(value.find("nope") == nullptr);
}

TEST_CASE("json: malformed documents are rejected with line and column") {
  CHECK_THAT(error_of(""), Catch::Contains("empty document"));
  CHECK_THAT(error_of("{\"a\": 1,}"), Catch::Contains("expected a string key"));
  CHECK_THAT(error_of("[1, 2,]"), Catch::Contains("expected a value"));
  CHECK_THAT(error_of("[1 2]"), Catch::Contains("expected ',' or ']'"));
  CHECK_THAT(error_of("{\"a\" 1}"), Catch::Contains("expected ':'"));
  CHECK_THAT(error_of("\"open"), Catch::Contains("closing"));
  CHECK_THAT(error_of("\"bad \\q escape\""), Catch::Contains("valid escape"));
  CHECK_THAT(error_of("\"raw\nnewline\""), Catch::Contains("control character"));
  CHECK_THAT(error_of("012"), Catch::Contains("leading zeros"));
  CHECK_THAT(error_of("1."), Catch::Contains("after the decimal point"));
  CHECK_THAT(error_of("1e"), Catch::Contains("exponent"));
  CHECK_THAT(error_of("-"), Catch::Contains("digit"));
  CHECK_THAT(error_of("1e999"), Catch::Contains("double can hold"));
  CHECK_THAT(error_of("tru"), Catch::Contains("'true'"));
  CHECK_THAT(error_of("NaN"), Catch::Contains("expected a value"));
  CHECK_THAT(error_of("{} {}"), Catch::Contains("end of the input"));
  CHECK_THAT(error_of("{\"k\": 1, \"k\": 2}"), Catch::Contains("duplicate key \"k\""));
  CHECK_THAT(error_of("\"\\udc00\""), Catch::Contains("lone low surrogate"));
  CHECK_THAT(error_of("\"\\ud800x\""), Catch::Contains("low surrogate"));
  // Position: the bad token sits on line 3, column 8.
  CHECK_THAT(error_of("{\n  \"a\": 1,\n  \"b\": ?\n}"), Catch::Contains("line 3 column 8"));
  CHECK_THAT(error_of("[1, 2,]"), Catch::Contains("json parse"));
}

TEST_CASE("json: the reader is bounded in size and depth") {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  CHECK_THAT(error_of(deep), Catch::Contains("nesting deeper than 64"));
  json_limits generous;
  generous.max_depth = 200;
  CHECK_NOTHROW(parse_json(deep, generous));
  json_limits small;
  small.max_bytes = 8;
  CHECK_THAT(error_of("[1, 2, 3, 4, 5]", small), Catch::Contains("exceeds the limit of 8 bytes"));
}

TEST_CASE("json: non-finite numbers cannot be written") {
  CHECK_THROWS_WITH(json(std::numeric_limits<double>::infinity()).dump(), Catch::Contains("non-finite"));
  CHECK_THROWS_WITH(json(std::numeric_limits<double>::quiet_NaN()).dump(), Catch::Contains("non-finite"));
}

TEST_CASE("json: an object of 80,000 keys parses in one pass, a duplicate among them still found") {
  std::string text = "{";
  for (int k = 0; k < 80000; ++k) text += (k ? ",\"" : "\"") + std::to_string(k) + "\": " + std::to_string(k);
  CHECK(parse_json(text + "}").size() == 80000);
  CHECK_THAT(error_of(text + ", \"40000\": 1}"), Catch::Contains("duplicate key \"40000\""));
}

TEST_CASE("json_cursor: members in a fixed order, unsigned integers exact and strict") {
  using cohort::detail::json_cursor;
  json_cursor in(R"({"a": 18446744073709551615, "b": "x\ty"})");
  in.open('{');
  in.key("a");
  CHECK(in.unsigned_integer() == 18446744073709551615ull);
  in.comma();
  in.key("b");
  CHECK(in.string() == "x\ty");
  in.close('}');
  in.finish();
  const auto error = [](const std::string& text, const std::string& key) {
    try {
      json_cursor c(text);
      c.open('{');
      c.key(key);
      (void)c.unsigned_integer();
    } catch (const cohort::error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(error(R"({"b": 1})", "a"), Catch::Contains("expected the member \"a\""));
  CHECK_THAT(error(R"({"a": 18446744073709551616})", "a"), Catch::Contains("below 2^64"));
  CHECK_THAT(error(R"({"a": 012})", "a"), Catch::Contains("no leading zeros"));
  CHECK_THAT(error(R"({"a": 1.5})", "a"), Catch::Contains("whole number"));
  CHECK_THAT(error(R"({"a": -1})", "a"), Catch::Contains("unsigned integer"));
}
