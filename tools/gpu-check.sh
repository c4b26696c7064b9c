#!/usr/bin/env bash
# The device tier CI cannot run: on a machine with an NVIDIA GPU (and no package registry)
# it builds cohort's CUDA parts and runs, within about 8 minutes,
#   - every CUDA test (ctest -L cuda),
#   - the .cu examples (each must end with "match"),
#   - cohort-bench over NCCL at world size 1, every collective, 8 B .. 1 GiB, with its
#     cohort/raw column,
# and writes OUT/gpu-check.json (pass/fail per case, the figures) beside the logs.
#   bash tools/gpu-check.sh OUT [DEPS]
# DEPS is the folder tools/gpu-deps.sh made on a machine with Debian's registry (default
# .gpu-deps): Gloo and Catch2. NCCL comes from the CUDA toolkit, or else from the Python
# wheel (nvidia-nccl-*) beside PyTorch. Exit status 0 only when every case passed.
set -uo pipefail
out=${1:?usage: tools/gpu-check.sh OUT [DEPS]}
deps=$(realpath -m "${2:-.gpu-deps}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(realpath "$out")
build=${COHORT_GPU_BUILD:-build-gpu}
steps="$out/steps.tsv"
: > "$steps"
begin=$SECONDS

# step NAME LIMIT_SECONDS COMMAND...: runs it with its output in OUT/NAME.log, records
# name, status and seconds.
step() {
  local name=$1 limit=$2 started=$SECONDS status=pass
  shift 2
  echo "gpu-check: $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || status=fail
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$steps"
  [ "$status" = pass ] || tail -20 "$out/$name.log"
  [ "$status" = pass ]
}

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nccl_root=
for candidate in "${NCCL_ROOT:-}" /usr/local/cuda /usr; do
  if [ -n "$candidate" ] && [ -f "$candidate/include/nccl.h" ]; then nccl_root=$candidate; break; fi
done
if [ -z "$nccl_root" ]; then
  nccl_root=$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
fi
export LD_LIBRARY_PATH="$deps/root/usr/lib:$deps/root/usr/lib/x86_64-linux-gnu:${nccl_root:+$nccl_root/lib:}${LD_LIBRARY_PATH:-}"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
  echo "gpu-check: no NVIDIA GPU is visible (nvidia-smi found none); this tier needs one" >&2
  gpu="none visible"
fi
{
  echo "gpu: $gpu"
  echo "nvcc: $("$nvcc" --version 2>&1 | tail -1)"
  echo "nccl: ${nccl_root:-not found}"
  echo "deps: $deps"
  echo "cores: $(nproc)"
} | tee "$out/machine.txt"

cuda_targets="cohort-bench consumer_nvcc"
for source in tests/test_*.cu examples/*.cu; do
  name=$(basename "$source" .cu)
  cuda_targets="$cuda_targets ${name}_cuda"
done
ok=1
step configure 240 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOHORT_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
  -DCMAKE_PREFIX_PATH="$deps/root/usr" || ok=0
[ $ok = 1 ] && { step build 300 cmake --build "$build" -j "$(nproc)" --target $cuda_targets || ok=0; }
if [ $ok = 1 ]; then
  step ctest_cuda 240 ctest --test-dir "$build" -L cuda -j 4 --timeout 120 --output-on-failure \
    --output-junit "$out/ctest-cuda.xml"
  for source in examples/*.cu; do
    name=$(basename "$source" .cu)_cuda
    step "example_$name" 120 sh -c "'$build/examples/$name' && '$build/examples/$name' | tail -1 | grep -q match"
  done
  for stage in 0 1; do  # zero_cuda's default is --zero 2
    step "example_zero_cuda_$stage" 60 sh -c "'$build/examples/zero_cuda' --zero $stage | tail -1 | grep -q match"
  done
  for operation in all_reduce all_gather reduce_scatter broadcast alltoall; do
    step "bench_$operation" 120 "$build/bench/cohort-bench" "$operation" --backend nccl --ranks 1 -b 8 -e 1G -f 2 \
      --json "$out/bench-$operation.json"
  done
  # What the flight recorder costs on NCCL's small calls: the same sweep with it off.
  step bench_all_reduce_unrecorded 60 "$build/bench/cohort-bench" all_reduce --backend nccl --ranks 1 -b 8 -e 1M \
    -f 4 --recorder 0 --json "$out/bench-all_reduce-unrecorded.json"
fi

python3 - "$out" "$((SECONDS - begin))" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out, seconds = sys.argv[1], int(sys.argv[2])
summary = {"machine": {}, "steps": [], "tests": [], "bench": {}, "seconds": seconds}
for line in open(os.path.join(out, "machine.txt")):
    key, _, value = line.partition(": ")
    summary["machine"][key] = value.strip()
for line in open(os.path.join(out, "steps.tsv")):
    name, status, took = line.rstrip("\n").split("\t")
    summary["steps"].append({"name": name, "status": status, "seconds": int(took)})
junit = os.path.join(out, "ctest-cuda.xml")
if os.path.exists(junit):
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = case.get("status") or ("fail" if case.find("failure") is not None else "run")
        summary["tests"].append({"name": case.get("name"), "status": status, "seconds": float(case.get("time", 0))})
for name in sorted(os.listdir(out)):
    if name.startswith("bench-") and name.endswith(".json"):
        data = json.load(open(os.path.join(out, name)))
        rows = [{k: row.get(k) for k in ("bytes", "time_us", "busbw_GBps", "inplace_time_us", "inplace_busbw_GBps",
                                          "raw_time_us", "cohort_over_raw", "wrong", "inplace_wrong")} for row in data["rows"]]
        summary["bench"][name[len("bench-"):-len(".json")]] = {  # all_reduce, all_reduce-unrecorded, ...
            "min_cohort_over_raw": data.get("min_cohort_over_raw"), "mean_cohort_over_raw": data.get("mean_cohort_over_raw"),
            "wrong_total": data.get("wrong_total"), "rows": rows}
# On a GPU machine a CUDA test that skips is a failure too: every one must run and pass.
summary["passed"] = bool(summary["steps"]) and all(s["status"] == "pass" for s in summary["steps"]) \
    and bool(summary["tests"]) and all(t["status"] == "run" for t in summary["tests"])
json.dump(summary, open(os.path.join(out, "gpu-check.json"), "w"), indent=1)
print(f"gpu-check: {'PASSED' if summary['passed'] else 'FAILED'} in {seconds} s; summary in {out}/gpu-check.json")
for s in summary["steps"]:
    print(f"  {s['status']:4}  {s['seconds']:4d} s  {s['name']}")
for op, b in summary["bench"].items():
    print(f"  bench {op}: cohort/raw min {b['min_cohort_over_raw']}, mean {b['mean_cohort_over_raw']}, wrong {b['wrong_total']}")
sys.exit(0 if summary["passed"] else 1)
PY
