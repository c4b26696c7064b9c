#!/usr/bin/env bash
# The device tier CI cannot run. On a machine with an NVIDIA GPU it runs, within a budget of
# about 5 minutes (COHORT_GPU_CHECK_BUDGET seconds, default 280), what tools/gpu-bundle.sh built
# elsewhere:
#   - every CUDA test program, all its cases in one process (a case that skips fails here),
#   - consumer_nvcc,
#   - the .cu examples, each of which must end with a line saying "match" (train_cuda under
#     each --strategy),
#   - cohort-bench over NCCL at world size 1: the five collectives 8 B .. 1 GiB with the raw
#     engine beside them, then all_reduce again with the flight recorder off,
# and writes OUT/gpu-check.json after every step, so a run cut short still says what ran.
#
#   bash gpu-bundle/gpu-check.sh gpu-bundle OUT             on the GPU machine
#   bash tools/gpu-check.sh --verify gpu-bundle OUT         anywhere: every program loads from
#        the bundle (nothing missing but the driver and NCCL) and, finding no GPU, says so
#
# NCCL is the machine's own: NCCL_ROOT, else the Python wheel nvidia-nccl-cu13 (found through
# python3), else the system's. If the bundle's programs cannot load there, the summary says
# why and the script builds them from the checkout it is run in (the current directory, or
# COHORT_SOURCE_DIR) with BUNDLE/fallback (gpu-bundle.sh --fallback-deps), then runs the same
# steps. Exit status 0 only when every step passed.
set -uo pipefail
verify=0
if [ "${1:-}" = --verify ]; then
  verify=1
  shift
fi
bundle=${1:?usage: gpu-check.sh [--verify] BUNDLE OUT}
out=${2:?usage: gpu-check.sh [--verify] BUNDLE OUT}
bundle=$(realpath "$bundle")
mkdir -p "$out"
out=$(realpath "$out")
budget=${COHORT_GPU_CHECK_BUDGET:-280}
begin=$SECONDS
steps="$out/steps.tsv"
: > "$steps"

# --- NCCL and the libraries ---------------------------------------------------------------
nccl_lib=
if [ -n "${NCCL_ROOT:-}" ] && [ -e "$NCCL_ROOT/lib/libnccl.so.2" ]; then
  nccl_lib=$NCCL_ROOT/lib
else
  wheel=$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(list(s.submodule_search_locations)[0])' 2>/dev/null)
  if [ -n "$wheel" ] && [ -e "$wheel/lib/libnccl.so.2" ]; then nccl_lib=$wheel/lib; fi
fi
nccl_root=${nccl_lib%/lib}
export LD_LIBRARY_PATH="$bundle/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
system_nccl=$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 / { print $NF; exit }')
mode=run
[ "$verify" = 1 ] && mode=verify
{
  echo "gpu: ${gpu:-none visible}"
  echo "mode: $mode"
  echo "nccl: ${nccl_lib:-from the system: ${system_nccl:-none found}}"
  echo "cores: $(nproc)"
  sed 's/^/bundle /' "$bundle/bundle.txt" 2>/dev/null
} > "$out/machine.txt"
cat "$out/machine.txt"

summarize() {
  python3 - "$out" "$((SECONDS - begin))" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out, seconds = sys.argv[1], int(sys.argv[2])
summary = {"machine": {}, "steps": [], "tests": [], "bench": {}, "seconds": seconds}
for line in open(os.path.join(out, "machine.txt")):
    key, _, value = line.partition(": ")
    summary["machine"][key] = value.strip()
for line in open(os.path.join(out, "steps.tsv")):
    name, status, took, note = (line.rstrip("\n").split("\t") + [""])[:4]
    summary["steps"].append({"name": name, "status": status, "seconds": int(took), "note": note})
for name in sorted(os.listdir(out)):
    if name.startswith("junit-") and name.endswith(".xml"):
        try:
            root = ET.parse(os.path.join(out, name)).getroot()
        except ET.ParseError:
            continue  # a program killed while writing it; its step says so
        for case in root.iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            summary["tests"].append({"program": name[6:-4], "name": case.get("name"),
                                     "status": "fail" if failed else "pass", "seconds": float(case.get("time", 0))})
    if name.startswith("bench-") and name.endswith(".json"):
        try:
            data = json.load(open(os.path.join(out, name)))
        except ValueError:
            continue
        rows = [{k: row.get(k) for k in ("bytes", "time_us", "busbw_GBps", "inplace_time_us", "inplace_busbw_GBps",
                                          "raw_time_us", "cohort_over_raw", "wrong", "inplace_wrong")} for row in data["rows"]]
        summary["bench"][name[len("bench-"):-len(".json")]] = {
            "min_cohort_over_raw": data.get("min_cohort_over_raw"), "mean_cohort_over_raw": data.get("mean_cohort_over_raw"),
            "wrong_total": data.get("wrong_total"), "rows": rows}
summary["passed"] = bool(summary["steps"]) and all(s["status"] == "pass" for s in summary["steps"]) \
    and all(t["status"] == "pass" for t in summary["tests"])
json.dump(summary, open(os.path.join(out, "gpu-check.json.tmp"), "w"), indent=1)
os.replace(os.path.join(out, "gpu-check.json.tmp"), os.path.join(out, "gpu-check.json"))
PY
}

# step NAME LIMIT COMMAND: runs the shell COMMAND with its output in OUT/NAME.log, within
# LIMIT seconds and what is left of the budget; records name, status, seconds and a note.
step() {
  local name=$1 limit=$2 command=$3 started=$SECONDS status=pass note= rc left
  left=$((budget - (SECONDS - begin)))
  if [ "$left" -lt 5 ]; then
    printf '%s\tnot-run\t0\tthe budget of %s s was spent\n' "$name" "$budget" >> "$steps"
    summarize
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "gpu-check: $name (at most $limit s)"
  timeout -k 5 "$limit" bash -c "$command" > "$out/$name.log" 2>&1
  rc=$?
  case $rc in
    0) ;;
    124 | 137) status=fail note="killed after $limit s" ;;
    77) status=fail note="skipped (exit 77): $(grep -m1 SKIPPED "$out/$name.log")" ;;
    *) status=fail note="exit status $rc" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" "$note" >> "$steps"
  [ "$status" = pass ] || tail -15 "$out/$name.log"
  summarize
  [ "$status" = pass ]
}

# The programs: kind, name, path (relative to the bundle unless absolute).
programs=()
read_programs() {
  programs=()
  while IFS=$'\t' read -r kind name path; do
    [ -n "$kind" ] || continue
    case $path in /*) ;; *) path=$bundle/$path ;; esac
    programs+=("$kind"$'\t'"$name"$'\t'"$path")
  done < "$1"
}
read_programs "$bundle/programs.tsv"

# Libraries each program resolves outside the bundle that a GPU machine need not have: none
# but the C/C++ runtimes, the driver and NCCL. Prints the problems; fails if there are any.
check_libraries() {
  local problems=0 kind name path
  for entry in "${programs[@]}"; do
    IFS=$'\t' read -r kind name path <<< "$entry"
    if [ ! -x "$path" ]; then
      echo "$name: missing ($path)"
      problems=1
      continue
    fi
    while read -r soname arrow resolved _; do
      case $soname in libcuda.so* | libnccl.so*) continue ;; esac
      if [ "$resolved" = "not" ]; then
        echo "$name: $soname not found"
        problems=1
      elif [[ ! $resolved == "$bundle"/* ]] &&
        [[ ! $soname =~ ^(ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so) ]]; then
        echo "$name: $soname comes from $resolved, outside the bundle"
        problems=1
      fi
    done < <(ldd "$path" 2>&1 | awk '$2 == "=>" { print $1, $2, $3 }')
  done
  return $problems
}

if [ "$verify" = 1 ]; then
  step libraries 60 "$(declare -p bundle programs); $(declare -f check_libraries); check_libraries"
  for entry in "${programs[@]}"; do
    IFS=$'\t' read -r kind name path <<< "$entry"
    case $kind in
      test) expect='SKIPPED: no CUDA device' command="'$path'" ;;
      example) expect='no CUDA device' command="'$path'" ;;
      tool) expect='none is visible' command="'$path' all_reduce --backend nccl --ranks 1 -b 8 -e 8" ;;
      consumer) expect='(ok)' command="'$path'" ;;
      *) expect='no CUDA device' command="'$path'" ;;
    esac
    # Exit 0, 1 or 77 with its no-GPU words: not the loader's 127, not a crash.
    step "no_gpu_$name" 60 "$command > '$out/$name.out' 2>&1; rc=\$?; cat '$out/$name.out';
      [ \$rc -le 1 ] || [ \$rc -eq 77 ] || { echo \"exit status \$rc\"; exit 1; }
      grep -qF -- '$expect' '$out/$name.out' || { echo \"no '$expect' in its output\"; exit 1; }"
  done
else
  if [ -z "$gpu" ]; then
    echo "gpu-check: no NVIDIA GPU is visible (nvidia-smi found none); this tier needs one (--verify checks a bundle without)" >&2
  fi
  if ! check_libraries > "$out/libraries.log" 2>&1; then
    cat "$out/libraries.log"
    printf 'bundle\tfail\t0\tits programs cannot load here (libraries.log); building from source\n' >> "$steps"
    source_dir=${COHORT_SOURCE_DIR:-$(pwd)}
    deps=$bundle/fallback/root/usr
    export LD_LIBRARY_PATH="$deps/lib:$deps/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
    step fallback_configure 120 "cmake -S '$source_dir' -B '$out/build' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCOHORT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCOHORT_BUILD_BENCH=ON ${nccl_root:+-DNCCL_ROOT='$nccl_root'} \
      -DCMAKE_PREFIX_PATH='$deps'" &&
      step fallback_build 240 "cmake --build '$out/build' -j $(nproc) --target cohort_gpu_programs" &&
      read_programs "$out/build/gpu-programs.tsv"
  fi
  for entry in "${programs[@]}"; do
    IFS=$'\t' read -r kind name path <<< "$entry"
    case $kind in
      test) step "$name" 90 "'$path' -r junit -o '$out/junit-$name.xml'" ;;
      consumer) step "$name" 30 "'$path'" ;;
      example)
        runs=("")
        [ "$name" = train_cuda ] && runs=("--strategy ddp" "--strategy zero1" "--strategy zero2" "--strategy zero3")
        for arguments in "${runs[@]}"; do
          label=example_$name${arguments:+_${arguments##* }}
          step "$label" 60 "'$path' $arguments > '$out/$label.out' 2>&1; rc=\$?; cat '$out/$label.out';
            [ \$rc -eq 0 ] && tail -1 '$out/$label.out' | grep -q match"
        done
        ;;
      tool)
        for operation in all_reduce all_gather reduce_scatter broadcast alltoall; do
          step "bench_$operation" 60 "'$path' $operation --backend nccl --ranks 1 -b 8 -e 1G -f 2 \
            --json '$out/bench-$operation.json'"
        done
        # What the flight recorder costs on NCCL's small calls: the same sweep with it off.
        step bench_all_reduce_unrecorded 30 "'$path' all_reduce --backend nccl --ranks 1 -b 8 -e 1M -f 4 \
          --recorder 0 --json '$out/bench-all_reduce-unrecorded.json'"
        ;;
    esac
  done
fi

summarize
python3 - "$out" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1] + "/gpu-check.json"))
print(f"gpu-check: {'PASSED' if summary['passed'] else 'FAILED'} in {summary['seconds']} s; summary in {sys.argv[1]}/gpu-check.json")
for s in summary["steps"]:
    print(f"  {s['status']:7}  {s['seconds']:4d} s  {s['name']}  {s['note']}")
failed = [t for t in summary["tests"] if t["status"] != "pass"]
print(f"  test cases: {len(summary['tests'])}, failed: {len(failed)}" + "".join(f"\n    {t['program']}: {t['name']}" for t in failed))
for op, b in summary["bench"].items():
    print(f"  bench {op}: cohort/raw min {b['min_cohort_over_raw']}, mean {b['mean_cohort_over_raw']}, wrong {b['wrong_total']}")
sys.exit(0 if summary["passed"] else 1)
PY
