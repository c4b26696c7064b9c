#pragma once
// placeholder, replaced by the launch-environment work
#include <cstdint>
#include <string>
#include "cohort/error.hpp"
namespace cohort::inline v0 {
struct launch_env {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  static launch_env explicit_ranks(int rank, int world_size) {
    launch_env env;
    env.rank = rank;
    env.world_size = world_size;
    env.local_rank = rank;
    env.local_world_size = world_size;
    return env;
  }
};
}  // namespace cohort::inline v0
