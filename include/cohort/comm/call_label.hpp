#pragma once
// call_label: the context of a group's calls (process_group::call_context), kept with each
// call in the flight recorder and named by errors, progress lines and traces. In a header of
// its own so that process_group.hpp takes it without the recorder.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace cohort::inline v0 {

// A call's context, as process_group::call_context sets it ("sample", "step 12 backward"):
// at most 47 characters, kept in place (a call copies it and allocates nothing). A line
// break becomes a space, so reports and status keys stay one line per call.
struct call_label {
  static constexpr std::size_t capacity = 47;

  call_label() = default;
  explicit call_label(std::string_view text) noexcept { assign(text); }
  void assign(std::string_view text) noexcept {
    size_ = static_cast<std::uint8_t>(std::min(text.size(), capacity));
    if (size_ != 0) std::memcpy(text_, text.data(), size_);
    for (std::size_t k = 0; k < size_; ++k)
      if (text_[k] == '\n' || text_[k] == '\r') text_[k] = ' ';
  }
  std::string_view view() const noexcept { return {text_, size_}; }
  bool empty() const noexcept { return size_ == 0; }
  friend bool operator==(const call_label& a, const call_label& b) noexcept { return a.view() == b.view(); }

 private:
  char text_[capacity] = {};
  std::uint8_t size_ = 0;
};

}  // namespace cohort::inline v0
