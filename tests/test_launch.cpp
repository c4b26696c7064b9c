// Launch-environment discovery: each launcher's variables, the precedence between launchers,
// Slurm's compressed lists, and the error every partial or inconsistent environment raises.

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/rendezvous/launch.hpp"

using Catch::Matchers::Contains;
using cohort::launch_env;
using cohort::launcher;

namespace {

using variables = std::map<std::string, std::string, std::less<>>;

launch_env::getenv_fn from(variables vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    const auto found = vars.find(name);
    if (found == vars.end()) return std::nullopt;
    return found->second;
  };
}

launch_env detect(const variables& vars) { return launch_env::detect(from(vars)); }

// The message of the cohort::error that detection raises; fails the test when none is raised.
std::string detection_error(const variables& vars) {
  try {
    const auto env = detect(vars);
    FAIL("expected cohort::error, detected " << env.describe());
  } catch (const cohort::error& raised) {
    CHECK(raised.rank() == -1);
    CHECK_FALSE(raised.hint().empty());
    return raised.what();
  }
  return {};
}

variables merged(variables base, const variables& extra) {
  for (const auto& [name, value] : extra) base[name] = value;
  return base;
}

const variables torchrun_vars{{"RANK", "5"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "4"},
                              {"MASTER_ADDR", "10.0.0.7"},
                              {"MASTER_PORT", "29600"}};
const variables open_mpi_vars{{"OMPI_COMM_WORLD_RANK", "3"},
                              {"OMPI_COMM_WORLD_SIZE", "6"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                              {"MASTER_ADDR", "node-a"}};
const variables mpich_vars{{"PMI_RANK", "2"},
                           {"PMI_SIZE", "4"},
                           {"MPI_LOCALRANKID", "0"},
                           {"MPI_LOCALNRANKS", "2"},
                           {"MASTER_ADDR", "node-b"}};
const variables slurm_vars{{"SLURM_PROCID", "6"},
                           {"SLURM_NTASKS", "7"},
                           {"SLURM_LOCALID", "0"},
                           {"SLURM_NODEID", "3"},
                           {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                           {"SLURM_JOB_NODELIST", "gpu[01-03,07]"},
                           {"SLURM_JOB_ID", "4242"}};

std::string padded(const char* prefix, int value, int width) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%0*d", width, value);
  return prefix + std::string(digits);
}

}  // namespace

TEST_CASE("an empty environment is one process talking to itself", "[launch]") {
  const auto env = detect({});
  CHECK(env.source == launcher::explicit_values);
  CHECK(env.rank == 0);
  CHECK(env.world_size == 1);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);
  CHECK(env.master_addr == "127.0.0.1");
  CHECK(env.master_port == 29500);
  CHECK(env.is_main());
  CHECK(env.is_local_main());
  CHECK(env.node_rank() == 0);
  CHECK(env.store_prefix().empty());
  CHECK(env.hosts.empty());
  CHECK(env.run_id.empty());
}

TEST_CASE("COHORT_JOB_ID names the job for every launcher", "[launch]") {
  CHECK(detect({{"COHORT_JOB_ID", "mine"}}).run_id == "mine");
  CHECK(detect(merged(torchrun_vars, {{"TORCHELASTIC_RUN_ID", "job-17"}, {"COHORT_JOB_ID", "mine"}})).run_id == "mine");
  CHECK(detect(merged(torchrun_vars, {{"TORCHELASTIC_RUN_ID", "job-17"}, {"COHORT_JOB_ID", ""}})).run_id ==
        "job-17");  // empty counts as unset
  // torchrun's default --rdzv-id: every job started without one has it, so it names no job.
  CHECK(detect(merged(torchrun_vars, {{"TORCHELASTIC_RUN_ID", "none"}})).run_id.empty());
}

TEST_CASE("torchrun's variables, with and without the agent store", "[launch]") {
  auto vars = merged(torchrun_vars, {{"TORCHELASTIC_RUN_ID", "job-17"}, {"GROUP_RANK", "1"}});
  auto env = detect(vars);
  CHECK(env.source == launcher::torchrun);
  CHECK(env.rank == 5);
  CHECK(env.world_size == 8);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 4);
  CHECK(env.master_addr == "10.0.0.7");
  CHECK(env.master_port == 29600);
  CHECK(env.run_id == "job-17");
  CHECK(env.node_rank() == 1);
  CHECK_FALSE(env.is_main());
  CHECK_FALSE(env.is_local_main());
  CHECK_FALSE(env.use_agent_store);
  CHECK(env.store_prefix().empty());

  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  vars["TORCHELASTIC_RESTART_COUNT"] = "3";
  env = detect(vars);
  CHECK(env.use_agent_store);
  CHECK(env.restart_count == 3);
  CHECK(env.store_prefix() == "/worker/attempt_" + std::to_string(3) + "/");

  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  env = detect(vars);
  CHECK_FALSE(env.use_agent_store);
  CHECK(env.restart_count == 3);
  CHECK(env.store_prefix().empty());
}

TEST_CASE("torchrun without GROUP_RANK derives the node from rank and local size", "[launch]") {
  const auto env = detect(torchrun_vars);
  CHECK(env.node_index == -1);
  CHECK(env.node_rank() == 5 / 4);
}

TEST_CASE("Open MPI's variables", "[launch]") {
  const auto env = detect(merged(open_mpi_vars, {{"OMPI_MCA_ess_base_jobid", "123456"}}));
  CHECK(env.source == launcher::open_mpi);
  CHECK(env.rank == 3);
  CHECK(env.world_size == 6);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 3);
  CHECK(env.master_addr == "node-a");
  CHECK(env.master_port == 29500);
  CHECK(env.run_id == "123456");
  CHECK(env.node_rank() == 3 / 3);
  CHECK(env.is_local_main());
  CHECK_FALSE(env.use_agent_store);
}

TEST_CASE("MPICH / Hydra / Intel MPI's variables", "[launch]") {
  const auto env = detect(mpich_vars);
  CHECK(env.source == launcher::mpich);
  CHECK(env.rank == 2);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr == "node-b");
}

TEST_CASE("Slurm's variables with uneven tasks per node", "[launch]") {
  const auto env = detect(slurm_vars);
  CHECK(env.source == launcher::slurm);
  CHECK(env.rank == 6);
  CHECK(env.world_size == 7);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 1);  // the fourth node of "2(x3),1"
  CHECK(env.node_rank() == 3);
  CHECK(env.hosts == std::vector<std::string>{"gpu01", "gpu02", "gpu03", "gpu07"});
  CHECK(env.master_addr == "gpu01");  // first host, since MASTER_ADDR is absent
  CHECK(env.run_id == "4242");
}

TEST_CASE("Slurm without SLURM_NODEID finds the node by block distribution", "[launch]") {
  auto vars = slurm_vars;
  vars.erase("SLURM_NODEID");
  const std::vector<int> counts{2, 2, 2, 1};
  for (int rank = 0; rank < 7; ++rank) {
    // Independent expectation: walk the nodes, subtracting each node's tasks.
    int node = 0;
    int first = 0;
    while (rank >= first + counts[static_cast<std::size_t>(node)]) first += counts[static_cast<std::size_t>(node++)];
    vars["SLURM_PROCID"] = std::to_string(rank);
    vars["SLURM_LOCALID"] = std::to_string(rank - first);
    const auto env = detect(vars);
    CHECK(env.node_rank() == node);
    CHECK(env.local_world_size == counts[static_cast<std::size_t>(node)]);
  }
}

TEST_CASE("Slurm reads SLURM_NTASKS_PER_NODE when SLURM_TASKS_PER_NODE is absent", "[launch]") {
  const auto env = detect({{"SLURM_PROCID", "5"},
                           {"SLURM_NTASKS", "8"},
                           {"SLURM_LOCALID", "1"},
                           {"SLURM_NTASKS_PER_NODE", "4"},
                           {"SLURM_NODELIST", "a[7-8]"},
                           {"MASTER_ADDR", "explicit-master"},
                           {"MASTER_PORT", "1234"}});
  CHECK(env.source == launcher::slurm);
  CHECK(env.local_world_size == 4);
  CHECK(env.node_rank() == 5 / 4);
  CHECK(env.hosts == std::vector<std::string>{"a7", "a8"});
  CHECK(env.master_addr == "explicit-master");  // MASTER_ADDR beats the node list
  CHECK(env.master_port == 1234);
}

TEST_CASE("cohort's own variables override every launcher", "[launch]") {
  const auto all = merged(merged(merged(merged(torchrun_vars, open_mpi_vars), mpich_vars), slurm_vars),
                          {{"COHORT_RANK", "1"},
                           {"COHORT_WORLD_SIZE", "2"},
                           {"COHORT_LOCAL_RANK", "1"},
                           {"COHORT_LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "override-host"}});
  const auto env = detect(all);
  CHECK(env.source == launcher::explicit_values);
  CHECK(env.rank == 1);
  CHECK(env.world_size == 2);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr == "override-host");
  CHECK(env.hosts.empty());

  // Without the local pair, one node: local == global.
  const auto single = detect({{"COHORT_RANK", "3"}, {"COHORT_WORLD_SIZE", "4"}});
  CHECK(single.local_rank == 3);
  CHECK(single.local_world_size == 4);
  CHECK(single.master_addr == "127.0.0.1");
}

TEST_CASE("precedence: torchrun > Open MPI > MPICH > Slurm", "[launch]") {
  // torchrun started by mpirun or srun: torchrun's own variables mark RANK as its.
  const auto real_torchrun = merged(torchrun_vars, {{"TORCHELASTIC_RUN_ID", "job-7"}});
  CHECK(detect(merged(merged(merged(slurm_vars, mpich_vars), open_mpi_vars), real_torchrun)).source ==
        launcher::torchrun);
  CHECK(detect(merged(slurm_vars, merged(torchrun_vars, {{"GROUP_RANK", "1"}}))).rank == 5);
  CHECK(detect(merged(merged(slurm_vars, mpich_vars), open_mpi_vars)).source == launcher::open_mpi);
  CHECK(detect(merged(slurm_vars, mpich_vars)).source == launcher::mpich);
  const auto inside_mpirun = detect(merged(slurm_vars, open_mpi_vars));
  CHECK(inside_mpirun.source == launcher::open_mpi);
  CHECK(inside_mpirun.rank == 3);      // mpirun's rank, not srun's
  CHECK(inside_mpirun.hosts.empty());  // hosts belong to a Slurm launch only
}

TEST_CASE("RANK and WORLD_SIZE left in the shell are refused when a launcher disagrees", "[launch]") {
  // `RANK=0 WORLD_SIZE=1 ...` left over, then `mpirun -np 2`: this is mpirun's rank 1 of 2.
  const variables stale{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}};
  const variables mpirun_rank1{{"OMPI_COMM_WORLD_RANK", "1"},
                               {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  const auto text = detection_error(merged(stale, mpirun_rank1));
  CHECK_THAT(text, Contains("RANK=0 WORLD_SIZE=1"));
  CHECK_THAT(text, Contains("Open MPI's OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THAT(text, Contains("unset them"));
  // Rank 0 of that mpirun agrees on the rank but not on the world size: refused as well.
  CHECK_THAT(detection_error(merged(stale, {{"OMPI_COMM_WORLD_RANK", "0"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})),
             Contains("OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THAT(detection_error(merged(stale, {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}})), Contains("PMI_SIZE=2"));
  CHECK_THAT(detection_error(merged(stale, slurm_vars)), Contains("Slurm's SLURM_PROCID=6 SLURM_NTASKS=7"));
  // Set by hand to agree with the launcher (a wrapper script): accepted.
  const auto agreeing = detect(
      merged(mpirun_rank1, {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}}));
  CHECK(agreeing.rank == 1);
  CHECK(agreeing.world_size == 2);
}

TEST_CASE("stale torchrun variables under mpirun or srun: the refusal names both launchers' variables", "[launch]") {
  const variables mpirun_rank1{{"OMPI_COMM_WORLD_RANK", "1"},
                               {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  // Only part of torchrun's set left in the shell: named beside mpirun's, not as a partial launch.
  const auto partial = detection_error(merged({{"RANK", "0"}, {"LOCAL_RANK", "0"}}, mpirun_rank1));
  CHECK_THAT(partial, Contains("torchrun's RANK=0 LOCAL_RANK=0"));
  CHECK_THAT(partial, Contains("Open MPI's OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 "
                               "OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=2"));
  CHECK_THAT(partial, Contains("unset RANK LOCAL_RANK"));
  const auto slurm = detection_error(merged({{"WORLD_SIZE", "1"}}, slurm_vars));
  CHECK_THAT(slurm, Contains("torchrun's WORLD_SIZE=1"));
  CHECK_THAT(slurm, Contains("Slurm's SLURM_PROCID=6 SLURM_NTASKS=7"));
  CHECK_THAT(slurm, Contains("unset WORLD_SIZE"));
  // The whole set, disagreeing: every variable of both, and which to unset.
  const auto whole = detection_error(
      merged({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}}, mpirun_rank1));
  CHECK_THAT(whole, Contains("torchrun's RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1"));
  CHECK_THAT(whole, Contains("OMPI_COMM_WORLD_LOCAL_SIZE=2"));
  CHECK_THAT(whole, Contains("unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE"));
  // A partial set alone (no other launcher) is still torchrun's partial launch.
  CHECK_THAT(detection_error({{"RANK", "0"}}), Contains("partial environment"));
}

TEST_CASE("srun's PMI plugin alone (PMI_RANK, PMI_SIZE, no MPI_LOCAL*) is read as Slurm", "[launch]") {
  const auto env = detect(merged(slurm_vars, {{"PMI_RANK", "6"}, {"PMI_SIZE", "7"}}));
  CHECK(env.source == launcher::slurm);
  CHECK(env.local_world_size == 1);
}

TEST_CASE("master address defaults for MPI launchers", "[launch]") {
  SECTION("all ranks on one node: loopback") {
    auto vars = open_mpi_vars;
    vars.erase("MASTER_ADDR");
    vars["OMPI_COMM_WORLD_LOCAL_SIZE"] = vars["OMPI_COMM_WORLD_SIZE"];
    CHECK(detect(vars).master_addr == "127.0.0.1");
  }
  SECTION("several nodes: an error naming MASTER_ADDR") {
    for (auto vars : {open_mpi_vars, mpich_vars}) {
      vars.erase("MASTER_ADDR");
      const auto message = detection_error(vars);
      CHECK_THAT(message, Contains("MASTER_ADDR"));
      CHECK_THAT(message, Contains("MPI"));
    }
  }
  SECTION("Slurm with several nodes and no node list") {
    auto vars = slurm_vars;
    vars.erase("SLURM_JOB_NODELIST");
    const auto message = detection_error(vars);
    CHECK_THAT(message, Contains("MASTER_ADDR") && Contains("SLURM_JOB_NODELIST") && Contains("Slurm"));
  }
}

TEST_CASE("partial environments name the missing variables", "[launch]") {
  SECTION("torchrun: RANK without WORLD_SIZE") {
    auto vars = torchrun_vars;
    vars.erase("WORLD_SIZE");
    const auto message = detection_error(vars);
    CHECK_THAT(message, Contains("WORLD_SIZE") && Contains("RANK") && Contains("torchrun"));
  }
  SECTION("torchrun: LOCAL_RANK alone") {
    const auto message = detection_error({{"LOCAL_RANK", "0"}});
    CHECK_THAT(message, Contains("LOCAL_WORLD_SIZE") && Contains("WORLD_SIZE") && Contains("torchrun"));
  }
  SECTION("torchrun: agent store without a restart count") {
    const auto message = detection_error(merged(torchrun_vars, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
    CHECK_THAT(message, Contains("TORCHELASTIC_RESTART_COUNT") && Contains("TORCHELASTIC_USE_AGENT_STORE"));
  }
  SECTION("Open MPI: local size missing") {
    auto vars = open_mpi_vars;
    vars.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
    const auto message = detection_error(vars);
    CHECK_THAT(message, Contains("OMPI_COMM_WORLD_LOCAL_SIZE") && Contains("Open MPI"));
  }
  SECTION("MPICH: no local variables and no Slurm") {
    const auto message = detection_error({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}});
    CHECK_THAT(message, Contains("MPI_LOCALRANKID") && Contains("MPI_LOCALNRANKS") && Contains("MPICH"));
  }
  SECTION("MPICH: PMI_SIZE missing") {
    auto vars = mpich_vars;
    vars.erase("PMI_SIZE");
    CHECK_THAT(detection_error(vars), Contains("PMI_SIZE"));
  }
  SECTION("Slurm: SLURM_LOCALID missing") {
    auto vars = slurm_vars;
    vars.erase("SLURM_LOCALID");
    CHECK_THAT(detection_error(vars), Contains("SLURM_LOCALID") && Contains("Slurm"));
  }
  SECTION("Slurm: no tasks-per-node variable") {
    auto vars = slurm_vars;
    vars.erase("SLURM_TASKS_PER_NODE");
    CHECK_THAT(detection_error(vars), Contains("SLURM_TASKS_PER_NODE") && Contains("SLURM_NTASKS_PER_NODE"));
  }
  SECTION("cohort: COHORT_RANK without COHORT_WORLD_SIZE") {
    CHECK_THAT(detection_error({{"COHORT_RANK", "0"}}), Contains("COHORT_WORLD_SIZE"));
  }
  SECTION("cohort: local rank without local world size") {
    CHECK_THAT(detection_error({{"COHORT_RANK", "0"}, {"COHORT_WORLD_SIZE", "2"}, {"COHORT_LOCAL_RANK", "0"}}),
               Contains("COHORT_LOCAL_WORLD_SIZE"));
  }
  SECTION("an empty value counts as unset") {
    auto vars = torchrun_vars;
    vars["WORLD_SIZE"] = "";
    CHECK_THAT(detection_error(vars), Contains("WORLD_SIZE"));
  }
}

TEST_CASE("non-integer values name the variable and its value", "[launch]") {
  struct bad_value {
    variables base;
    std::string name;
    std::string value;
    std::string launcher_name;
  };
  const std::vector<bad_value> cases{
      {torchrun_vars, "RANK", "five", "torchrun"},
      {torchrun_vars, "LOCAL_WORLD_SIZE", "4x", "torchrun"},
      {torchrun_vars, "TORCHELASTIC_RESTART_COUNT", "1.5", "torchrun"},
      {torchrun_vars, "GROUP_RANK", "first", "torchrun"},
      {open_mpi_vars, "OMPI_COMM_WORLD_SIZE", "99999999999", "Open MPI"},
      {mpich_vars, "MPI_LOCALRANKID", "-", "MPICH"},
      {slurm_vars, "SLURM_NTASKS", "seven", "Slurm"},
      {slurm_vars, "SLURM_NODEID", "3a", "Slurm"},
  };
  for (const auto& bad : cases) {
    INFO(bad.name << "=" << bad.value);
    const auto message = detection_error(merged(bad.base, {{bad.name, bad.value}}));
    CHECK_THAT(message, Contains(bad.name) && Contains(bad.value) && Contains(bad.launcher_name));
  }
  CHECK_THAT(detection_error(merged(torchrun_vars, {{"TORCHELASTIC_USE_AGENT_STORE", "maybe"}})),
             Contains("TORCHELASTIC_USE_AGENT_STORE") && Contains("maybe"));
  CHECK_THAT(detection_error(merged(slurm_vars, {{"SLURM_TASKS_PER_NODE", "2(3)"}})), Contains("SLURM_TASKS_PER_NODE"));
  CHECK_THAT(detection_error(merged(slurm_vars, {{"SLURM_JOB_NODELIST", "gpu[01-03"}})),
             Contains("SLURM_JOB_NODELIST"));
}

TEST_CASE("inconsistent values name the variables involved", "[launch]") {
  SECTION("rank >= world size") {
    const auto message = detection_error(merged(torchrun_vars, {{"RANK", "8"}}));
    CHECK_THAT(message, Contains("RANK=8") && Contains("WORLD_SIZE=8") && Contains("torchrun"));
  }
  SECTION("negative rank") {
    CHECK_THAT(detection_error(merged(open_mpi_vars, {{"OMPI_COMM_WORLD_RANK", "-1"}})),
               Contains("OMPI_COMM_WORLD_RANK=-1"));
  }
  SECTION("local rank >= local world size") {
    const auto message = detection_error(merged(mpich_vars, {{"MPI_LOCALRANKID", "2"}}));
    CHECK_THAT(message, Contains("MPI_LOCALRANKID=2") && Contains("MPI_LOCALNRANKS=2") && Contains("MPICH"));
  }
  SECTION("world size not positive") {
    const auto message = detection_error(
        {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "1"}});
    CHECK_THAT(message, Contains("SLURM_NTASKS=0") && Contains("Slurm"));
  }
  SECTION("local world size above world size") {
    const auto message = detection_error(merged(torchrun_vars, {{"LOCAL_WORLD_SIZE", "9"}}));
    CHECK_THAT(message, Contains("LOCAL_WORLD_SIZE=9") && Contains("WORLD_SIZE=8"));
  }
  SECTION("Slurm node index beyond the tasks-per-node list") {
    const auto message = detection_error(merged(slurm_vars, {{"SLURM_NODEID", "4"}}));
    CHECK_THAT(message, Contains("SLURM_NODEID=4") && Contains("SLURM_TASKS_PER_NODE"));
  }
  SECTION("Slurm local id beyond this node's task count") {
    const auto message = detection_error(merged(slurm_vars, {{"SLURM_LOCALID", "1"}}));
    CHECK_THAT(message, Contains("SLURM_LOCALID=1") && Contains("SLURM_TASKS_PER_NODE=1"));
  }
  SECTION("port out of range or not a number") {
    for (const char* port : {"0", "65536", "-5", "http"}) {
      INFO("MASTER_PORT=" << port);
      CHECK_THAT(detection_error(merged(torchrun_vars, {{"MASTER_PORT", port}})),
                 Contains("MASTER_PORT") && Contains(port));
    }
    CHECK(detect(merged(torchrun_vars, {{"MASTER_PORT", "65535"}})).master_port == 65535);
  }
}

TEST_CASE("explicit values are validated like the environment", "[launch]") {
  const auto env = launch_env::explicit_values(3, 8, 1, 2, "10.1.1.1", 4000);
  CHECK(env.source == launcher::explicit_values);
  CHECK(env.node_rank() == 3 / 2);
  CHECK(env.master_addr == "10.1.1.1");
  CHECK(env.master_port == 4000);
  const auto single = launch_env::explicit_ranks(2, 4);
  CHECK(single.local_rank == 2);
  CHECK(single.local_world_size == 4);
  CHECK(single.node_rank() == 0);
  CHECK_THROWS_WITH(launch_env::explicit_ranks(4, 4), Contains("rank=4") && Contains("world_size=4"));
  CHECK_THROWS_WITH(launch_env::explicit_values(0, 4, 2, 2), Contains("local_rank=2"));
  CHECK_THROWS_AS(launch_env::explicit_ranks(0, 0), cohort::error);
}

TEST_CASE("describe() is one line with launcher, ranks and master", "[launch]") {
  const auto text =
      detect(merged(torchrun_vars, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}}))
          .describe();
  CHECK(text.find('\n') == std::string::npos);
  CHECK_THAT(text, Contains("torchrun") && Contains("5/8") && Contains("1/4") && Contains("10.0.0.7:29600") &&
                       Contains("/worker/attempt_2/"));
  for (auto source :
       {launcher::explicit_values, launcher::torchrun, launcher::open_mpi, launcher::mpich, launcher::slurm})
    CHECK_FALSE(cohort::to_string(source).empty());
}

TEST_CASE("Slurm node lists expand like Slurm's hostlist", "[launch][slurm]") {
  using cohort::expand_slurm_nodelist;
  using list = std::vector<std::string>;
  CHECK(expand_slurm_nodelist("gpu[01-03,07],cpu1") == list{"gpu01", "gpu02", "gpu03", "gpu07", "cpu1"});
  CHECK(expand_slurm_nodelist("node1") == list{"node1"});
  CHECK(expand_slurm_nodelist("a,b,c") == list{"a", "b", "c"});
  CHECK(expand_slurm_nodelist("") == list{});
  CHECK(expand_slurm_nodelist("n[8-11]") == list{"n8", "n9", "n10", "n11"});
  CHECK(expand_slurm_nodelist("n[098-101]") == list{"n098", "n099", "n100", "n101"});
  CHECK(expand_slurm_nodelist("gpu[1-2],cpu[10-11]") == list{"gpu1", "gpu2", "cpu10", "cpu11"});
  CHECK(expand_slurm_nodelist("rack[1-2]-n[01-02]") == list{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"});
  CHECK(expand_slurm_nodelist("a[1,3-4]b") == list{"a1b", "a3b", "a4b"});
  CHECK(expand_slurm_nodelist("x-[5]") == list{"x-5"});

  list expected;
  for (int i = 1; i <= 128; ++i) expected.push_back(padded("n", i, 3));
  CHECK(expand_slurm_nodelist("n[001-128]") == expected);
}

TEST_CASE("malformed Slurm node lists are errors", "[launch][slurm]") {
  for (const char* bad :
       {"gpu[01-03", "gpu01]", "gpu[03-01]", "gpu[a-b]", "gpu[]", "gpu[1-]", "a,,b", "n[[1-2]]", "n[0-999999999]"}) {
    INFO(bad);
    CHECK_THROWS_WITH(cohort::expand_slurm_nodelist(bad), Contains(bad) && Contains("SLURM_JOB_NODELIST"));
  }
}

TEST_CASE("Slurm tasks-per-node lists expand their repeats", "[launch][slurm]") {
  using cohort::expand_slurm_tasks_per_node;
  using counts = std::vector<int>;
  CHECK(expand_slurm_tasks_per_node("2(x3),1") == counts{2, 2, 2, 1});
  CHECK(expand_slurm_tasks_per_node("4") == counts{4});
  CHECK(expand_slurm_tasks_per_node("8(x2)") == counts{8, 8});
  CHECK(expand_slurm_tasks_per_node("1,2(x2),3") == counts{1, 2, 2, 3});
  for (const char* bad : {"", "x", "2(3)", "2(x)", "2(x0)", "2(x3", ",1", "1,", "-1"}) {
    INFO(bad);
    CHECK_THROWS_WITH(expand_slurm_tasks_per_node(bad), Contains("SLURM_TASKS_PER_NODE"));
  }
}

namespace {
// Sets variables for the scope and restores what the process had before, set or unset.
class scoped_environment {
 public:
  explicit scoped_environment(const variables& vars) {
    for (const auto& [name, value] : vars) {
      const char* before = std::getenv(name.c_str());
      saved_.emplace_back(name, before ? std::optional<std::string>{before} : std::nullopt);
      ::setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~scoped_environment() {
    for (const auto& [name, before] : saved_) {
      if (before)
        ::setenv(name.c_str(), before->c_str(), 1);
      else
        ::unsetenv(name.c_str());
    }
  }
  scoped_environment(const scoped_environment&) = delete;
  scoped_environment& operator=(const scoped_environment&) = delete;

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};
}  // namespace

TEST_CASE("detect() reads the real process environment", "[launch]") {
  // cohort's variables outrank whatever launcher runs this test; MASTER_* are pinned too.
  const scoped_environment scope{{{"COHORT_RANK", "2"},
                                  {"COHORT_WORLD_SIZE", "4"},
                                  {"COHORT_LOCAL_RANK", "0"},
                                  {"COHORT_LOCAL_WORLD_SIZE", "2"},
                                  {"MASTER_ADDR", "real-env-host"},
                                  {"MASTER_PORT", "31337"}}};
  const auto env = launch_env::detect();
  CHECK(env.source == launcher::explicit_values);
  CHECK(env.rank == 2);
  CHECK(env.world_size == 4);
  CHECK(env.local_rank == 0);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr == "real-env-host");
  CHECK(env.master_port == 31337);
}

// Every message cohort raises (launch errors included) is joined by detail::text: a part that
// is not text must not compile, so a number or a char is never appended as a pointer offset
// or a character code, as `"rank " + 2` or `std::string + 'c'` would.
template <class... Parts>
concept joinable = requires(const Parts&... parts) {
  cohort::detail::text(parts...);
};
static_assert(joinable<const char*, std::string, std::string_view>);
static_assert(!joinable<const char*, int>);
static_assert(!joinable<std::string, char>);
static_assert(!joinable<std::size_t>);

TEST_CASE("messages: detail::text joins its parts in order, once", "[launch]") {
  const std::string rank = "3";
  CHECK(cohort::detail::text("rank ", rank, std::string_view(" of 4"), "") == "rank 3 of 4");
  CHECK(cohort::detail::text().empty());
}
