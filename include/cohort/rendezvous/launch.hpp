#pragma once
// Launch-environment discovery: who am I, how many are we, who is on my node, and where is
// the rendezvous master — read from whichever launcher started this process.
//
// Precedence (the first family with any of its variables set decides; the others are ignored):
//   1. cohort's own overrides   COHORT_RANK, COHORT_WORLD_SIZE [, COHORT_LOCAL_RANK,
//                               COHORT_LOCAL_WORLD_SIZE]  (without the local pair: one node,
//                               local == global). Reported as launcher::explicit_values.
//   2. torchrun                 RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (all four),
//                               GROUP_RANK (node index, optional), TORCHELASTIC_USE_AGENT_STORE
//                               ("True"/"False"), TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID
//   3. Open MPI (mpirun)        OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (all four);
//                               run id from OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE
//   4. MPICH / Hydra / Intel MPI  PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS.
//                               When only PMI_RANK/PMI_SIZE are set and Slurm's variables are
//                               present (srun --mpi=pmi2 sets exactly that), Slurm is read instead.
//   5. Slurm (srun)             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the local size from
//                               SLURM_TASKS_PER_NODE (exact per node, e.g. "2(x3),1", indexed by
//                               SLURM_NODEID, or by SLURM_PROCID under block distribution when
//                               SLURM_NODEID is absent) or else SLURM_NTASKS_PER_NODE;
//                               hosts from SLURM_JOB_NODELIST (else SLURM_NODELIST); run id from
//                               SLURM_JOB_ID (else SLURM_JOBID).
//   6. nothing set              a single process: rank 0 of 1.
// A more specific launcher wins over a more general one: srun inside mpirun, or torchrun
// started by srun, is read as mpirun's or torchrun's ranks, which are the ones that talk.
// But RANK/WORLD_SIZE without any of torchrun's own variables (TORCHELASTIC_RUN_ID,
// TORCHELASTIC_RESTART_COUNT, GROUP_RANK, ROLE_RANK) were set by hand or left in the shell:
// when an MPI launcher or srun also started this process and their rank or world size
// disagree, detection refuses, naming both sets (`RANK=0 WORLD_SIZE=1` left over, then
// `mpirun -np 2`, would otherwise make two processes rank 0 of a world of one).
//
// MASTER_ADDR and MASTER_PORT (default 29500, valid 1..65535) are read for every launcher, and
// COHORT_JOB_ID, which names the job (run_id) whatever the launcher says: connect_store refuses
// a rank whose job id is not the one of the job that serves the store (torchrun's default
// TORCHELASTIC_RUN_ID, `none`, is no id).
// Without MASTER_ADDR: Slurm uses the first host of its node list; the others use 127.0.0.1
// only when every rank is on this node (local world size == world size) and fail otherwise,
// since no address guess is safe across nodes.
//
// A variable set to the empty string counts as unset. Partial or inconsistent environments
// (a family's variable missing, a non-integer, rank >= world size, local rank >= local world
// size, a non-positive size, a port out of range) throw cohort::error naming the variables,
// the launcher, and a hint.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

enum class launcher { explicit_values, torchrun, open_mpi, mpich, slurm };

inline std::string_view to_string(launcher source) {
  switch (source) {
    case launcher::explicit_values: return "explicit";
    case launcher::torchrun: return "torchrun";
    case launcher::open_mpi: return "Open MPI";
    case launcher::mpich: return "MPICH/Hydra/Intel MPI";
    case launcher::slurm: return "Slurm";
  }
  return "unknown launcher";
}

COHORT_DECL std::vector<std::string> expand_slurm_nodelist(std::string_view nodelist);
COHORT_DECL std::vector<int> expand_slurm_tasks_per_node(std::string_view tasks_per_node);

struct launch_env {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  launcher source = launcher::explicit_values;
  // torchrun: the elastic agent already serves a TCPStore on MASTER_PORT; workers must connect
  // to it (not host their own) and put their keys under store_prefix().
  bool use_agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT; 0 elsewhere
  std::string run_id;     // COHORT_JOB_ID, else TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's job id; may be empty
  std::vector<std::string> hosts;  // Slurm's expanded node list; empty for other launchers
  // The node's index when the launcher states it (torchrun GROUP_RANK, SLURM_NODEID, or Slurm's
  // per-node task counts); -1 when it does not.
  int node_index = -1;

  // The index of this process's node: node_index when known, else rank / local_world_size,
  // which is right when every node runs local_world_size ranks placed in blocks (the default
  // of torchrun, mpirun --map-by slot and srun).
  int node_rank() const { return node_index >= 0 ? node_index : rank / std::max(local_world_size, 1); }
  bool is_main() const { return rank == 0; }
  bool is_local_main() const { return local_rank == 0; }

  // torch's env:// rendezvous wraps the agent's store in a PrefixStore named
  // "/worker/attempt_<restart>"; keys of this attempt live under this prefix.
  std::string store_prefix() const {
    if (!use_agent_store) return {};
    return detail::text("/worker/attempt_", std::to_string(restart_count), "/");
  }

  std::string describe() const {
    std::string text{to_string(source)};
    text += detail::text(": rank ", std::to_string(rank), "/", std::to_string(world_size));
    text += detail::text(", local rank ", std::to_string(local_rank), "/", std::to_string(local_world_size));
    text += detail::text(", node ", std::to_string(node_rank()));
    text += detail::text(", master ", master_addr, ":", std::to_string(master_port));
    if (use_agent_store) text += detail::text(", agent store ", store_prefix());
    if (!run_id.empty()) text += detail::text(", run ", run_id);
    return text;
  }

  using getenv_fn = std::function<std::optional<std::string>(std::string_view)>;

  COHORT_DECL static launch_env detect();
  COHORT_DECL static launch_env detect(const getenv_fn& getenv);

  // One node: local rank == rank, local world size == world size.
  static launch_env explicit_ranks(int rank, int world_size) {
    return explicit_values(rank, world_size, rank, world_size);
  }
  COHORT_DECL static launch_env explicit_values(int rank, int world_size, int local_rank, int local_world_size,
                                                std::string master_addr = "127.0.0.1",
                                                std::uint16_t master_port = 29500);
};

// Under torchrun, which names a file per worker in TORCHELASTIC_ERROR_FILE, writes `failure`
// there in the JSON that torchrun's agent reads, so its "Root Cause" shows this rank's
// message instead of "To enable traceback see ...". The first error wins: a file already
// there is kept. Returns true when the file was written; false without the variable, when
// the file exists, or when it cannot be written. run_ranks calls it for a launched rank
// whose function threw; a trainer with its own main calls it from its catch.
[[gnu::cold]] COHORT_DECL bool record_error_for_launcher(const std::exception& failure);
[[gnu::cold]] COHORT_DECL bool record_error_for_launcher(std::string_view type_name, std::string_view message);

namespace detail {
// `text` as the contents of a JSON string (quotes, backslashes and control characters escaped).
[[gnu::cold]] COHORT_DECL std::string json_escape(std::string_view text);
}  // namespace detail

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/rendezvous/impl/launch.ipp"
#endif
