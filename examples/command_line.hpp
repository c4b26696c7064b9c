#pragma once
// The examples' command lines (and bench_checkpoint's): flags in any order, each with a value
// or without, and the usage text for anything else. One reader instead of a loop per program.
//
//   for (cohort_examples::command_line args(argc, argv); args.next();)
//     if (args.is("--ranks")) cfg.ranks = std::stoi(args.value());
//     else args.usage("usage: train [--ranks N]\n");
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cohort_examples {

class command_line {
 public:
  command_line(int argc, char** argv) : argc_(argc), argv_(argv) {}

  // Moves to the next flag; false past the last.
  bool next() {
    if (++at_ >= argc_) return false;
    flag_ = argv_[at_];
    return true;
  }
  const std::string& flag() const noexcept { return flag_; }
  bool is(const char* name) const { return flag_ == name; }
  // The current flag's value: the argument after it.
  std::string value() {
    if (at_ + 1 >= argc_) throw std::runtime_error(flag_ + " needs a value");
    return argv_[++at_];
  }
  // The current flag's value as a comma-separated list ("a,b,c"), empty items left out.
  std::vector<std::string> list() {
    std::vector<std::string> items;
    std::stringstream in(value());
    for (std::string item; std::getline(in, item, ',');)
      if (!item.empty()) items.push_back(item);
    return items;
  }
  // Prints `text` and ends the program: status 0 when the flag asked for help, else 2.
  [[noreturn]] void usage(const char* text) const {
    std::printf("%s", text);
    std::exit(flag_ == "--help" || flag_ == "-h" ? 0 : 2);
  }

 private:
  int argc_;
  char** argv_;
  int at_ = 0;
  std::string flag_;
};

}  // namespace cohort_examples
