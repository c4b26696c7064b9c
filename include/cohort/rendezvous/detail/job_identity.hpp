#pragma once
// A job's identity at the rendezvous: rank 0 publishes it under the store key cohort/job (its
// own server holds it from its start, before any client can connect), and every rank compares
// its own job id with it when it connects (connect_store), so a rank of another job that
// reaches this job's store is refused before it touches a key, naming both jobs. Jobs without
// an id cannot be told apart that way: each rank claims its rank number with a compare-and-set,
// a second claimant marks the job collided (job_collided_key), and every rank checks that mark
// when its first group is connected, before any collective.

#include <charconv>
#include <string>
#include <string_view>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0::detail {

struct job_identity {
  // TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's job id, COHORT_JOB_ID; empty for a rank
  // that has none (torchrun's default `none` included): it joins only a job without one.
  std::string id;
  // Random, made by each process: in the record, the store host's (the job's keys live under
  // job/<id or nonce>/); in a rank claim, the claimant's.
  std::string nonce;
  std::string host;  // of the rank that wrote it
  long pid = 0;
  int rank = 0;
  int world = 0;
};

inline constexpr std::string_view job_key = "cohort/job";
inline constexpr std::string_view job_format = "cohort-job-2";
// Under the job's prefix: what the second claimant of a rank found (the job is not one job).
inline constexpr std::string_view job_collided_key = "cohort/collided";

inline std::string encode_job(const job_identity& job) {
  return detail::text(job_format, "\n", job.id, "\n", job.nonce, "\n", job.host, "\n", std::to_string(job.pid), "\n",
                      std::to_string(job.rank), "\n", std::to_string(job.world));
}

// False when `text` is not what encode_job writes.
inline bool decode_job(std::string_view text, job_identity& out) {
  constexpr int fields = 7;
  std::string_view field[fields];
  for (int k = 0; k < fields; ++k) {
    const auto end = k < fields - 1 ? text.find('\n') : text.size();
    if (end == std::string_view::npos) return false;
    field[k] = text.substr(0, end);
    text.remove_prefix(k < fields - 1 ? end + 1 : end);
  }
  if (field[0] != job_format) return false;
  job_identity job;
  const auto number = [](std::string_view digits, auto& value) {
    const auto [stop, status] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    return status == std::errc() && stop == digits.data() + digits.size();
  };
  if (!number(field[4], job.pid) || !number(field[5], job.rank) || !number(field[6], job.world)) return false;
  job.id = std::string(field[1]);
  job.nonce = std::string(field[2]);
  job.host = std::string(field[3]);
  out = std::move(job);
  return true;
}

// "job 4242 (rank 0 on node0, pid 812, world of 4)"; a job without an id is named by its
// store host's nonce: "job without an id, cohort-1f2e... (rank 0 on ...)".
inline std::string describe_job(const job_identity& job) {
  return detail::text("job ", (job.id.empty() ? detail::text("without an id, ", job.nonce) : job.id), " (rank ",
                      std::to_string(job.rank), " on ", job.host, ", pid ", std::to_string(job.pid), ", world of ",
                      std::to_string(job.world), ")");
}

// Whether another process also claimed a rank of this job (the mark join_job's second claimant
// writes). `job_store` is the job's store (connect_store's); one request.
inline bool job_marked_collided(store& job_store) {
  const std::string key(job_collided_key);
  return job_store.check(std::span<const std::string>(&key, 1));
}

// The error of a job found marked collided: what the mark says, and `consequence` (what stops).
inline error job_collision_error(store& job_store, int rank, std::string_view operation, std::string_view consequence) {
  std::string what;
  try {
    what = to_string(job_store.get(std::string(job_collided_key), std::chrono::seconds(2)));
  } catch (const error& failure) {
    what = detail::text("(the mark could not be read: ", failure.detail(), ")");
  }
  return error(rank, operation, detail::text("job collision at ", job_store.location(), ": ", what, "; ", consequence),
               "give each job its own MASTER_PORT (or MASTER_ADDR), or a distinct job id (COHORT_JOB_ID, "
               "TORCHELASTIC_RUN_ID other than `none`, SLURM_JOB_ID); then start the job again");
}

// Before a rank's first collective (its first group is connected, so every rank of the job
// has claimed its rank): a job that another process also claimed a rank of is two jobs mixed,
// and no rank of it computes. A claimant that comes later is caught by the first group's
// watchdog and by run_ranks' verdict (both read the same mark).
inline void check_not_collided(store& job_store, int rank, std::string_view group) {
  if (!job_marked_collided(job_store)) return;
  throw job_collision_error(job_store, rank, "process_group",
                            detail::text(group, " stops on every rank before its first collective"));
}

}  // namespace cohort::inline v0::detail
