#!/usr/bin/env python3
"""How much cohort costs its users' builds: compile times as ratios to a translation unit of
twenty standard headers (bench/compile/std_headers.cpp) compiled in the same run.

  python3 bench/compile_time.py [--cxx g++] [--nvcc nvcc] [--runs 3] [--no-nvcc] [--json FILE]

Each row is timed --runs times, each time right after the yardstick, and its ratio is its
fastest time over the yardstick's fastest among those same runs: a machine whose speed
drifts during the run (a VM's does) moves both. Rows:
  - std headers, -fsyntax-only: the yardstick;
  - the umbrella header <cohort/cohort.hpp>, -fsyntax-only;
  - every public header alone, -fsyntax-only (that each compiles alone is a test as well);
  - a trainer TU on Gloo (bench/compile/trainer.cpp), compiled and optimised, -O0 and -O2;
  - a CUDA trainer TU on NCCL (bench/compile/trainer.cu) with nvcc, and how many kernels
    it instantiates (cuobjdump).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INCLUDE = os.path.join(ROOT, "include")
CUDA = "/usr/local/cuda"


def cuda_includes():
    flags = []
    for path in (os.path.join(CUDA, "include"), os.path.join(CUDA, "include", "cccl")):
        if os.path.isdir(path):
            flags += ["-isystem", path]
    return flags


def timed(command, runs, output=None):
    """Minimum wall time of `command` over `runs`; its last output goes to output[0]."""
    best = None
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        took = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}")
        best = took if best is None else min(best, took)
        if output is not None:
            output[:] = [done.stdout]
    return best


def public_headers():
    headers = []
    for folder in ("cohort", os.path.join("cohort", "backend")):
        directory = os.path.join(INCLUDE, folder)
        for name in sorted(os.listdir(directory)):
            if name.endswith(".hpp"):
                headers.append(f"{folder}/{name}".replace(os.sep, "/"))
    return headers


def header_flags(header):
    """What a consumer of this header passes: CUDA's headers for the NCCL backend, Thrust's
    host system for the Thrust sampler."""
    flags = []
    if header.endswith("nccl.hpp"):
        flags += cuda_includes() + ["-DCOHORT_HAS_NCCL=1"]
    if header.endswith("sampler_thrust.hpp"):
        flags += cuda_includes() + ["-DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP"]
    return flags


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or os.path.join(CUDA, "bin", "nvcc"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-nvcc", action="store_true")
    parser.add_argument("--no-headers", action="store_true", help="skip the per-header rows")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    base = [args.cxx, "-std=c++20", f"-I{INCLUDE}"]
    rows = []
    work = tempfile.mkdtemp(prefix="cohort-compile-")
    try:
        yardstick_command = base + ["-fsyntax-only", os.path.join(HERE, "compile", "std_headers.cpp")]

        def measure(command, output=None):
            """(row seconds, yardstick seconds): each run of the row follows a yardstick run."""
            best, stick = None, None
            for _ in range(args.runs):
                s = timed(yardstick_command, 1)
                r = timed(command, 1, output)
                best = r if best is None else min(best, r)
                stick = s if stick is None else min(stick, s)
            return best, stick

        def add(what, measured, **extra):
            seconds, stick = measured
            row = {"what": what, "seconds": round(seconds, 3), "yardstick_seconds": round(stick, 3),
                   "ratio": round(seconds / stick, 2)}
            row.update(extra)
            rows.append(row)
            print(f"  {what:58s} {seconds:7.2f} s {seconds / stick:6.2f}x" +
                  "".join(f"  {k} {v}" for k, v in extra.items()), flush=True)

        print(f"compile times with {args.cxx}, fastest of {args.runs}, as ratios to the standard-headers TU "
              f"timed beside each:")
        add("20 standard headers, -fsyntax-only", measure(yardstick_command))
        add("<cohort/cohort.hpp>, -fsyntax-only", measure(base + ["-fsyntax-only", os.path.join(HERE, "compile", "umbrella.cpp")]))
        if not args.no_headers:
            for header in public_headers():
                source = os.path.join(work, header.replace("/", "_") + ".cpp")
                with open(source, "w") as f:
                    f.write(f"#include <{header}>\n")
                add(f"<{header}> alone, -fsyntax-only", measure(base + header_flags(header) + ["-fsyntax-only", source]))
        trainer = os.path.join(HERE, "compile", "trainer.cpp")
        for level in ("-O0", "-O2"):
            add(f"trainer TU on Gloo, {level} -c", measure(base + [level, "-c", trainer, "-o", os.path.join(work, "trainer.o")]))
        if not args.no_nvcc and os.path.exists(args.nvcc):
            obj = os.path.join(work, "trainer_cu.o")
            # ptxas -v names every kernel it compiles: that is the count of instantiated kernels.
            command = [args.nvcc, "-std=c++20", "-O2", "-arch=sm_90", "-Xptxas=-v", f"-I{INCLUDE}",
                       "-DCOHORT_HAS_NCCL=1", "-c", os.path.join(HERE, "compile", "trainer.cu"), "-o", obj]
            output = [""]
            measured = measure(command, output)
            kernels = sum(1 for line in output[0].splitlines() if "Compiling entry function" in line)
            add("CUDA trainer TU on NCCL, nvcc -O2 -c", measured, kernels=kernels)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiler": args.cxx, "runs": args.runs, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
