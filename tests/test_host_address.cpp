// Which address a Gloo rank listens on and publishes (cohort/comm/detail/host_address.hpp): the
// choice as a plain function (one node, nodes on loopback, MASTER_ADDR on this host, names
// that do not resolve, loopback interfaces across nodes), then groups that use it.
#include <catch2/catch.hpp>

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cohort/comm/detail/host_address.hpp>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "support.hpp"

using Catch::Matchers::Contains;
using cohort::detail::choose_listen_address;
using cohort::detail::listen_request;

namespace {

listen_request across_nodes(std::string master) {
  listen_request request;
  request.rank = 3;
  request.master_addr = std::move(master);
  request.world_size = 4;
  request.local_world_size = 2;
  return request;
}

// A non-loopback address of this host, or skip: the cases across nodes need one.
std::string this_host_address() {
  std::string seen;
  const std::string address = cohort::detail::interface_address("", seen);
  if (address.empty()) cohort_test::skip("no interface other than loopback is up (interfaces: " + seen + ")");
  return address;
}

}  // namespace

TEST_CASE("loopback addresses are recognised", "[address]") {
  using cohort::detail::is_loopback_address;
  CHECK(is_loopback_address("127.0.0.1"));
  CHECK(is_loopback_address("127.0.1.1"));
  CHECK(is_loopback_address("::1"));
  CHECK(is_loopback_address("::ffff:127.0.0.1"));
  CHECK(is_loopback_address("localhost"));
  CHECK_FALSE(is_loopback_address("10.0.0.1"));
  CHECK_FALSE(is_loopback_address("fd00::2"));
  CHECK_FALSE(is_loopback_address("node127"));
}

TEST_CASE("one node, or nodes simulated on loopback, listen on 127.0.0.1", "[address]") {
  listen_request one_node = across_nodes("10.231.0.1");
  one_node.local_world_size = one_node.world_size;
  CHECK_FALSE(cohort::detail::world_spans_nodes(one_node));
  CHECK(choose_listen_address(one_node).address == "127.0.0.1");

  const listen_request simulated = across_nodes("127.0.0.1");
  CHECK_FALSE(cohort::detail::world_spans_nodes(simulated));
  CHECK(choose_listen_address(simulated).address == "127.0.0.1");
}

TEST_CASE("across nodes a rank listens on the address that routes to MASTER_ADDR", "[address]") {
  const std::string mine = this_host_address();
  const listen_request request = across_nodes(mine);  // MASTER_ADDR is this host: rank 0's node
  REQUIRE(cohort::detail::world_spans_nodes(request));
  const auto choice = choose_listen_address(request);
  INFO(choice.reason);
  CHECK(choice.address == mine);
  CHECK_THAT(choice.reason, Contains("routes to MASTER_ADDR " + mine));
}

TEST_CASE("a MASTER_ADDR that does not resolve is an error naming it, not a crash", "[address]") {
  CHECK_THROWS_WITH(choose_listen_address(across_nodes("no-such-host.invalid")),
                    Contains("[rank 3]") && Contains("cannot resolve 'no-such-host.invalid'"));
}

TEST_CASE("a loopback address is never published when the world spans nodes", "[address]") {
  const std::string mine = this_host_address();
  SECTION("a hostname option that is loopback (Debian's 127.0.1.1)") {
    listen_request request = across_nodes(mine);
    request.hostname = "127.0.1.1";
    CHECK_THROWS_WITH(choose_listen_address(request),
                      Contains("127.0.1.1, a loopback address, but the world spans nodes (2 of 4 ranks"));
  }
  SECTION("GLOO_SOCKET_IFNAME=lo") {
    listen_request request = across_nodes(mine);
    request.env_interface = "lo";
    CHECK_THROWS_WITH(choose_listen_address(request), Contains("GLOO_SOCKET_IFNAME lo gives 127.0.0.1"));
  }
  SECTION("a MASTER_ADDR whose name resolves to loopback (this host's name, on many hosts)") {
    // "localhost" says "one host" by itself; a name that resolves to loopback does not.
    char name[256] = {};
    REQUIRE(::gethostname(name, sizeof name - 1) == 0);
    const std::string numeric = cohort::detail::resolve_numeric(name, 0, "test");
    if (!cohort::detail::is_loopback_address(numeric)) {
      WARN("this host's name resolves to " << numeric << ": nothing to check");
      return;
    }
    CHECK_THROWS_WITH(
        choose_listen_address(across_nodes(name)),
        Contains("MASTER_ADDR " + std::string(name) + " resolves to " + numeric + ", a loopback address"));
  }
}

TEST_CASE("an interface without an address is an error listing the interfaces", "[address]") {
  listen_request request = across_nodes("127.0.0.1");
  request.interface = "no-such-if0";
  CHECK_THROWS_WITH(
      choose_listen_address(request),
      Contains("options.interface names interface 'no-such-if0', which has no address") && Contains("lo"));
}

TEST_CASE("a Gloo group given a hostname that does not resolve throws instead of crashing", "[address]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort::gloo::options opts;
  opts.timeout = std::chrono::seconds(5);
  opts.hostname = "no-such-host.invalid";
  // Resolved by cohort: the error names the option's value and says which rank it is.
  CHECK_THROWS_WITH(cohort::process_group<cohort::gloo>(store, cohort::launch_env::explicit_ranks(0, 2), opts),
                    Contains("cannot resolve 'no-such-host.invalid'"));
}

namespace {

// Two ranks as threads, one per "node" of this host, MASTER_ADDR this host's address, no
// interface or hostname given; throws on failure.
void two_nodes_on_this_host(const std::string& mine) {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(10);
    // One rank per node, MASTER_ADDR this host's address: no interface or hostname given.
    // Gloo alone would have used this host's name, which here may resolve to loopback.
    cohort::process_group<cohort::gloo> pg(store, cohort::launch_env::explicit_values(rank, 2, 0, 1, mine), opts);
    RANK_CHECK(pg.backend().address() == mine, "listening on " << pg.backend().address());
    std::vector<int> value{rank + 1};
    pg.all_reduce(std::span<int>(value)).wait();
    RANK_CHECK(value[0] == 3);
  });
}

}  // namespace

TEST_CASE("ranks on two 'nodes' of this host connect over the address that routes to MASTER_ADDR", "[address]") {
  two_nodes_on_this_host(this_host_address());
}

// Gloo's default device (no hostname, no interface) looks up this host's own name: where the
// name does not resolve there was no group (Debian's libgloo throws; others died with SIGSEGV
// and no message). The child below gets a host name of its own (a UTS namespace: needs root)
// that resolves nowhere; cohort never asks Gloo to look a name up.
TEST_CASE("a host whose own name does not resolve still joins a world across nodes", "[address]") {
  const std::string mine = this_host_address();
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWUTS) != 0) ::_exit(77);
    const std::string name = "cohort-unresolvable-host.invalid";
    if (::sethostname(name.c_str(), name.size()) != 0) ::_exit(77);
    int code = 0;
    try {
      two_nodes_on_this_host(mine);
    } catch (const std::exception& failure) {
      std::fprintf(stderr, "child: %s\n", failure.what());
      code = 3;
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) cohort_test::skip("no UTS namespace here (needs root)");
  INFO("child " << (WIFEXITED(status) ? "exit status " : "killed by signal ")
                << (WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status)));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}
