#pragma once
// A job's identity at the rendezvous: rank 0 publishes it under the store key cohort/job (its
// own server holds it from its start, before any client can connect), and every rank compares
// its own job id with it when it connects (connect_store), so a rank of another job that
// reaches this job's store is refused before it touches a key, naming both jobs.

#include <charconv>
#include <string>
#include <string_view>

#include "cohort/detail/text.hpp"

namespace cohort::inline v0::detail {

struct job_identity {
  // TORCHELASTIC_RUN_ID, SLURM_JOB_ID, Open MPI's job id, COHORT_JOB_ID; empty for a rank
  // that has none (it joins whatever job serves the store), or rank 0's random one.
  std::string id;
  std::string host;  // of the rank that wrote it
  long pid = 0;
  int rank = 0;
  int world = 0;
};

inline constexpr std::string_view job_key = "cohort/job";
inline constexpr std::string_view job_format = "cohort-job-1";

inline std::string encode_job(const job_identity& job) {
  return detail::text(job_format, "\n", job.id, "\n", job.host, "\n", std::to_string(job.pid), "\n",
                      std::to_string(job.rank), "\n", std::to_string(job.world));
}

// False when `text` is not what encode_job writes.
inline bool decode_job(std::string_view text, job_identity& out) {
  std::string_view field[6];
  for (int k = 0; k < 6; ++k) {
    const auto end = k < 5 ? text.find('\n') : text.size();
    if (end == std::string_view::npos) return false;
    field[k] = text.substr(0, end);
    text.remove_prefix(k < 5 ? end + 1 : end);
  }
  if (field[0] != job_format) return false;
  job_identity job;
  const auto number = [](std::string_view digits, auto& value) {
    const auto [stop, status] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    return status == std::errc() && stop == digits.data() + digits.size();
  };
  if (!number(field[3], job.pid) || !number(field[4], job.rank) || !number(field[5], job.world)) return false;
  job.id = std::string(field[1]);
  job.host = std::string(field[2]);
  out = std::move(job);
  return true;
}

// "job 4242 (rank 0 on node0, pid 812, world of 4)".
inline std::string describe_job(const job_identity& job) {
  return detail::text("job ", (job.id.empty() ? std::string_view("(no id)") : std::string_view(job.id)), " (rank ",
                      std::to_string(job.rank), " on ", job.host, ", pid ", std::to_string(job.pid), ", world of ",
                      std::to_string(job.world), ")");
}

}  // namespace cohort::inline v0::detail
