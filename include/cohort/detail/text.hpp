#pragma once
// detail::text("rank ", std::to_string(rank), " waited for ", name): one string from its
// parts, sized once. cohort builds its messages this way rather than with `+`: a chain of
// std::string operator+ expands at every call site into a temporary, a move and a clean-up
// path per operator, and cohort's plain code is mostly messages that name rank, call, sizes
// and the fix. A part must be text (a view, a string, a literal): a number or a char does not
// compile, so nothing is appended as a pointer offset or a character code by mistake
// (tests/test_launch.cpp pins that).
//
// Variadic rather than text({...}): nvcc's front end wraps a braced list passed as an
// argument inside a template in parentheses, which GCC then reads as a statement expression.
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

namespace cohort::inline v0::detail {

inline std::string join_text(std::initializer_list<std::string_view> parts) {
  std::size_t size = 0;
  for (const std::string_view part : parts) size += part.size();
  std::string joined;
  joined.reserve(size);
  for (const std::string_view part : parts) joined.append(part);
  return joined;
}

template <class... Parts>
  requires(std::is_constructible_v<std::string_view, const Parts&>&&...)
std::string text(const Parts&... parts) { return join_text({std::string_view(parts)...}); }

}  // namespace cohort::inline v0::detail
