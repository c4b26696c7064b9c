// What a start costs the store: requests per rank for a Gloo group plus one split, counted by
// each rank's own client, Gloo's connection of the mesh included. cohort connects the mesh
// itself (one key per rank, one multi_get), so the count must not grow with the world; Gloo's
// own rendezvous read every peer's key with a request or two each.
#include <catch2/catch.hpp>

#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cstdio>
#include <memory>
#include <numeric>
#include <vector>

#include "support.hpp"

namespace {

struct counted {
  double per_rank = 0;  // mean
  std::uint64_t most = 0;
};

// Every rank a thread with its own connection to one server, as launched ranks have.
counted start_requests(int world) {
  cohort::tcp_store_options served;
  served.host = "127.0.0.1";
  served.port = 0;
  served.is_server = true;
  auto server = std::make_shared<cohort::tcp_store>(served);
  std::vector<std::uint64_t> requests(static_cast<std::size_t>(world), 0);
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::tcp_store_options options;
    options.host = "127.0.0.1";
    options.port = server->port();
    options.rank = rank;
    auto mine = std::make_shared<cohort::tcp_store>(options);
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(30);
    cohort::process_group<cohort::gloo> pg(mine, cohort::launch_env::explicit_ranks(rank, world), opts);
    auto half = pg.split(rank % 2, rank);
    requests[static_cast<std::size_t>(rank)] = mine->requests_sent();  // the handshake included
    RANK_CHECK(half.has_value());
    half->barrier().wait();
    pg.barrier().wait();
  });
  counted out;
  out.per_rank = static_cast<double>(std::accumulate(requests.begin(), requests.end(), std::uint64_t{0})) / world;
  for (const auto count : requests) out.most = std::max(out.most, count);
  return out;
}

}  // namespace

TEST_CASE("a Gloo group and a split cost each rank the same store requests at any world size", "[rendezvous]") {
  const counted three = start_requests(3);
  const counted nine = start_requests(9);
  std::printf(
      "store requests per rank, group + split, Gloo's mesh included: 3 ranks %.1f (max %llu), "
      "9 ranks %.1f (max %llu)\n",
      three.per_rank, static_cast<unsigned long long>(three.most), nine.per_rank,
      static_cast<unsigned long long>(nine.most));
  CHECK(nine.most == three.most);
  CHECK(nine.most <= 20);
}
