#!/usr/bin/env python3
"""How much cohort costs its users' builds: compile CPU times as ratios to a translation
unit of twenty standard headers (bench/compile/std_headers.cpp) compiled in the same run.

  python3 bench/compile_time.py [--cxx g++] [--nvcc nvcc] [--runs 5] [--no-nvcc]
                                [--no-headers] [--only TEXT] [--against DIR] [--json FILE]
  python3 bench/compile_time.py --code-by-file     where the trainer TU's code comes from
  python3 bench/compile_time.py --check docs/benchmarks.md --runs 3
                                                   CI: fail on a regression against the baseline

Rows:
  - the umbrella header <cohort/cohort.hpp>, -fsyntax-only;
  - every public header alone, -fsyntax-only (that each compiles alone is a test as well);
  - a trainer TU on Gloo (bench/compile/trainer.cpp): -fsyntax-only (the floor of the
    next two: everything but making code), compiled at -O0 and at -O2; and the trainer's
    other TU (bench/compile/step.cpp: the step over a state main's TU built), -O2;
  - a CUDA trainer TU on NCCL (bench/compile/trainer.cu) with nvcc, and how many kernels
    it instantiates (ptxas -v names each);
  - "default targets (compiled once)": the umbrella header and both trainer TUs again as
    cohort::gloo and cohort::nccl compile them, with COHORT_SEPARATE_COMPILATION (the CUDA
    one seeing the kernels' launchers only, the kernels compiled once, in cohort/src.cu),
    and the translation units that library adds (cohort/src.hpp, -O2, and cohort/src.cu
    with nvcc), compiled once however many TUs the program has.
Times are CPU seconds (user + system) of the compiler: on a shared VM the wall clock also
counts time other guests held the core. The yardstick runs right before every run of every
row, each run is divided by that yardstick run, and the median ratio of --runs is printed
beside the row's fastest seconds: a VM whose speed drifts during the run slows both sides of
a ratio together, where a ratio to the yardstick's fastest run of the whole run charges the
drift to whichever rows met the slow minutes, and the median keeps one odd yardstick run
from setting a row's ratio. On a noisy VM use --runs 5 or more; differences under about 5%
are noise there.

--check FILE measures only the rows of FILE's baseline (the fenced block marked
compile-baseline, one "ratio  row name" a line) and fails when a row's median ratio exceeds
its baseline by more than --tolerance (15%): .ci/run runs it against docs/benchmarks.md.

--against DIR measures a second checkout of cohort (its include/ and bench/compile/, for
example a `git worktree` of an older commit) in the same run, each of its runs right after
the same run here, and prints both with their ratio: what a change did to compile time.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA = "/usr/local/cuda"


def cuda_includes():
    flags = []
    for path in (os.path.join(CUDA, "include"), os.path.join(CUDA, "include", "cccl")):
        if os.path.isdir(path):
            flags += ["-isystem", path]
    return flags


def cpu_seconds(command, output=None):
    """CPU time (user + system, the compiler and what it runs) of one run of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}")
    if output is not None:
        output[:] = [done.stdout]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def public_headers(include):
    """Public headers: under cohort/ and its subsystem folders, not detail/ or impl/ (nor the
    compiled-once entry src.hpp), in either layout (cohort/backend/ before the folders)."""
    headers = []
    root = os.path.join(include, "cohort")
    for directory, folders, names in os.walk(root):
        folders[:] = sorted(f for f in folders if f not in ("detail", "impl"))
        for name in sorted(names):
            if name.endswith(".hpp") and name != "src.hpp":
                headers.append(os.path.relpath(os.path.join(directory, name), include))
    return sorted(headers)


def header_flags(header):
    """What a consumer of this header passes: CUDA's headers for the NCCL backend, Thrust's
    host system for the Thrust sampler."""
    flags = []
    if header.endswith("nccl.hpp"):
        flags += cuda_includes() + ["-DCOHORT_HAS_NCCL=1"]
    if header.endswith("sampler_thrust.hpp"):
        flags += cuda_includes() + ["-DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP"]
    return flags


class Tree:
    """One checkout of cohort: the commands of each row, built from its include/ and bench/compile/."""

    def __init__(self, root, args, work):
        self.root = os.path.abspath(root)
        self.include = os.path.join(self.root, "include")
        self.sources = os.path.join(self.root, "bench", "compile")
        self.args = args
        self.work = tempfile.mkdtemp(dir=work)

    def base(self):
        return [self.args.cxx, "-std=c++20", f"-I{self.include}"]

    def rows(self):
        """(name, command, wants_output) for every row this tree can build."""
        rows = [("<cohort/cohort.hpp>, -fsyntax-only",
                 self.base() + ["-fsyntax-only", os.path.join(self.sources, "umbrella.cpp")], False)]
        if not self.args.no_headers:
            for header in public_headers(self.include):
                source = os.path.join(self.work, header.replace("/", "_") + ".cpp")
                with open(source, "w") as f:
                    f.write(f"#include <{header}>\n")
                rows.append((f"<{header}> alone, -fsyntax-only",
                             self.base() + header_flags(header) + ["-fsyntax-only", source], False))
        # The floor of the rows below: parsing and instantiating the trainer, with no code made.
        rows.append(("trainer TU on Gloo, -fsyntax-only", self.base() + [
            "-fsyntax-only", os.path.join(self.sources, "trainer.cpp")], False))
        for level in ("-O0", "-O2"):
            rows.append((f"trainer TU on Gloo, {level} -c", self.base() + [
                level, "-c", os.path.join(self.sources, "trainer.cpp"), "-o", os.path.join(self.work, "trainer.o")], False))
        step = os.path.join(self.sources, "step.cpp")
        if os.path.exists(step):  # a trainer's other TU: the step over a state main's TU built
            rows.append(("trainer's step TU on Gloo, -O2 -c", self.base() + [
                "-O2", "-c", step, "-o", os.path.join(self.work, "step.o")], False))
        nvcc = not self.args.no_nvcc and os.path.exists(self.args.nvcc)
        if nvcc:
            rows.append(("CUDA trainer TU on NCCL, nvcc -O2 -c", self.nvcc_command([]), True))
        # The compiled-once entry files: cohort/src.hpp and src.cu now; cohort/impl/src.hpp and
        # impl/device_src.cuh (with COHORT_SEPARATE_DEVICE_CODE) in trees before the folders.
        old_layout = os.path.exists(os.path.join(self.include, "cohort", "impl", "src.hpp"))
        src_hpp = "cohort/impl/src.hpp" if old_layout else "cohort/src.hpp"
        src_cu = "cohort/impl/device_src.cuh" if old_layout else "cohort/src.cu"
        if os.path.exists(os.path.join(self.include, src_hpp)):
            separate = ["-DCOHORT_SEPARATE_COMPILATION=1"]
            rows.append(("default targets (compiled once): <cohort/cohort.hpp>, -fsyntax-only",
                         self.base() + separate + ["-fsyntax-only", os.path.join(self.sources, "umbrella.cpp")], False))
            rows.append(("default targets (compiled once): trainer TU on Gloo, -O2 -c", self.base() + separate + [
                "-O2", "-c", os.path.join(self.sources, "trainer.cpp"), "-o", os.path.join(self.work, "trainer.o")], False))
            if os.path.exists(step):
                rows.append(("default targets (compiled once): trainer's step TU on Gloo, -O2 -c", self.base() + separate + [
                    "-O2", "-c", step, "-o", os.path.join(self.work, "step.o")], False))
            # A library with NCCL compiles the kernels too (src.cu), and the trainer's TUs see
            # their launchers' declarations only.
            device_src = os.path.exists(os.path.join(self.include, src_cu))
            device = ["-DCOHORT_SEPARATE_DEVICE_CODE=1"] if device_src and old_layout else []
            if nvcc:
                rows.append(("default targets (compiled once): CUDA trainer TU, nvcc -O2 -c",
                             self.nvcc_command(separate + device), True))
            source = os.path.join(self.work, "src.cpp")
            with open(source, "w") as f:
                f.write(f"#include <{src_hpp}>\n")
            rows.append(("default targets (compiled once): src.hpp, -O2 -c (once per program)",
                         self.base() + separate + ["-O2", "-c", source, "-o", os.path.join(self.work, "src.o")], False))
            if nvcc and device_src:
                source = os.path.join(self.work, "device_src.cu")
                with open(source, "w") as f:
                    f.write(f"#include <{src_cu}>\n")
                rows.append(("default targets (compiled once): src.cu, nvcc -O2 -c (once per program)",
                             self.nvcc_command(separate + device, source), True))
        return rows

    def nvcc_command(self, extra, source=None):
        source = source or os.path.join(self.sources, "trainer.cu")
        return [self.args.nvcc, "-std=c++20", "-O2", "-arch=sm_90", "-Xptxas=-v", f"-I{self.include}",
                "-DCOHORT_HAS_NCCL=1"] + extra + ["-c", source, "-o", os.path.join(self.work, "nvcc.o")]


def kernels_in(output):
    return sum(1 for line in output.splitlines() if "Compiling entry function" in line)


def code_by_file(args):
    """Bytes of the header-only trainer TU's -O2 code by the file that defines each function
    (nm -l on a -g build): what a TU that uses cohort compiles, and so where its time goes."""
    include = os.path.join(os.path.dirname(HERE), "include")
    with tempfile.TemporaryDirectory() as work:
        obj = os.path.join(work, "trainer.o")
        subprocess.run([args.cxx, "-std=c++20", f"-I{include}", "-O2", "-g", "-c",
                        os.path.join(HERE, "compile", "trainer.cpp"), "-o", obj], check=True)
        listing = subprocess.run(["nm", "-l", "-S", "--size-sort", obj], stdout=subprocess.PIPE, text=True,
                                 check=True).stdout
    sizes = {}
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where = fields[-1].rsplit(":", 1)[0] if ":" in fields[-1] and fields[-1].startswith("/") else "?"
        where = where.replace(include + "/", "").replace(os.path.dirname(HERE) + "/", "").replace("/usr/include/c++/", "std ")
        sizes[where] = sizes.get(where, 0) + int(fields[1], 16)
    total = sum(sizes.values())
    print(f"{'bytes':>8s} {'share':>6s}  file   (header-only trainer TU, {args.cxx} -O2: {total} bytes of code)")
    for where, size in sorted(sizes.items(), key=lambda item: -item[1])[:30]:
        print(f"{size:8d} {100 * size / total:5.1f}%  {where}")
    return 0


BASELINE_FENCE = "```compile-baseline"


def read_baseline(path):
    """{row name: ratio} from the fenced compile-baseline block of `path`, in its order."""
    baseline = {}
    inside = False
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not inside:
                inside = line == BASELINE_FENCE
                continue
            if line.startswith("```"):
                break
            if not line or line.startswith("#"):
                continue
            ratio, _, name = line.partition(" ")
            try:
                baseline[name.strip()] = float(ratio.rstrip("x"))
            except ValueError:
                raise SystemExit(f"{path}:{number}: a baseline line is 'ratio  row name', not {line!r}")
    if not baseline:
        raise SystemExit(f"{path} has no {BASELINE_FENCE} block with 'ratio  row name' lines")
    return baseline


def check(baseline, path, measured, tolerance):
    """Each measured row against its baseline; the exit status: 1 when any regressed."""
    print(f"against the baseline in {path} (a regression is a ratio over baseline x {1 + tolerance:.2f}):")
    regressed = []
    for name, allowed in baseline.items():
        if name not in measured and "nvcc" in name:
            print(f"  {name:58s} {'':8s} baseline {allowed:5.2f}x  not measured here (no nvcc)")
            continue
        if name not in measured:  # a renamed row must not leave its baseline unchecked
            print(f"  {name:58s} no such row: rename it in {path} with the script's row")
            regressed.append(name)
            continue
        ratio = measured[name]
        verdict = "REGRESSED" if ratio > allowed * (1 + tolerance) else "ok"
        print(f"  {name:58s} {ratio:6.2f}x baseline {allowed:5.2f}x  {ratio / allowed:5.2f}  {verdict}")
        if verdict != "ok":
            regressed.append(name)
    if regressed:
        print(f"compile-time check failed (over {tolerance:.0%} above the baseline, or no such row): "
              f"{', '.join(regressed)}.\n"
              f"Find the change (--against a worktree of the last good commit, --code-by-file); "
              f"move the baseline in {path} only with a sentence there saying why.")
        return 1
    print("compile time: no regression")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or os.path.join(CUDA, "bin", "nvcc"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-nvcc", action="store_true")
    parser.add_argument("--no-headers", action="store_true", help="skip the per-header rows")
    parser.add_argument("--against", default="", help="a second checkout of cohort to measure beside this one")
    parser.add_argument("--only", default="", help="measure only the rows whose name contains this text")
    parser.add_argument("--json", default="")
    parser.add_argument("--check", default="", metavar="FILE",
                        help="measure the rows of FILE's compile-baseline block; fail on a regression")
    parser.add_argument("--tolerance", type=float, default=0.15,
                        help="with --check, the ratio's allowed excess over its baseline (0.15: 15%%)")
    parser.add_argument("--code-by-file", action="store_true",
                        help="print where the header-only trainer TU's -O2 code comes from, by source file, and exit")
    args = parser.parse_args()
    if args.code_by_file:
        return code_by_file(args)

    work = tempfile.mkdtemp(prefix="cohort-compile-")
    try:
        trees = [Tree(os.path.dirname(HERE), args, work)]
        if args.against:
            trees.append(Tree(args.against, args, work))
        yardstick_command = [args.cxx, "-std=c++20", "-fsyntax-only", os.path.join(HERE, "compile", "std_headers.cpp")]
        yardstick = None
        baseline = read_baseline(args.check) if args.check else None
        plans = [[row for row in tree.rows() if args.only in row[0] and (baseline is None or row[0] in baseline)]
                 for tree in trees]
        names = [name for name, _, _ in plans[0]]
        best = {}  # (tree index, row name) -> (fastest seconds, kernels)
        ratios = {}  # (tree index, row name) -> every run's ratio to the yardstick run before it
        print(f"measuring with {args.cxx}, fastest of {args.runs} runs (CPU seconds) ...", flush=True)
        for name in names:
            for _ in range(args.runs):
                for index, plan in enumerate(plans):
                    if not any(row[0] == name for row in plan):
                        continue  # a row the other tree cannot build (a newer header, say)
                    stick = cpu_seconds(yardstick_command)
                    yardstick = stick if yardstick is None else min(yardstick, stick)
                    _, command, wants_output = next(row for row in plan if row[0] == name)
                    output = [""]
                    seconds = cpu_seconds(command, output)
                    kernels = kernels_in(output[0]) if wants_output else None
                    ratios.setdefault((index, name), []).append(seconds / stick)
                    fastest = best.get((index, name), (seconds, kernels))[0]
                    if seconds <= fastest:
                        best[(index, name)] = (seconds, kernels)
        print("compile CPU time as ratios to the standard-headers TU:")
        header = f"  {'':58s} {'seconds':>8s} {'ratio':>7s}"
        if len(trees) > 1:
            header += f" {'against':>9s} {'ratio':>7s} {'this/against':>13s}"
        print(header)
        print(f"  {'20 standard headers, -fsyntax-only (the yardstick)':58s} {yardstick:8.2f} {1.0:6.2f}x")
        rows = []
        def median(values):
            ordered = sorted(values)
            middle = len(ordered) // 2
            return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

        for name in names:
            seconds, kernels = best[(0, name)]
            ratio = median(ratios[(0, name)])
            row = {"what": name, "seconds": round(seconds, 3), "ratio": round(ratio, 2)}
            line = f"  {name:58s} {seconds:8.2f} {ratio:6.2f}x"
            if len(trees) > 1 and (1, name) in best:
                other, other_kernels = best[(1, name)]
                other_ratio = median(ratios[(1, name)])
                row.update({"against_seconds": round(other, 3), "against_ratio": round(other_ratio, 2),
                            "this_over_against": round(ratio / other_ratio, 2)})
                line += f" {other:9.2f} {other_ratio:6.2f}x {ratio / other_ratio:12.2f}x"
                if other_kernels is not None:
                    row["against_kernels"] = other_kernels
            if kernels is not None:
                row["kernels"] = kernels
                line += f"  kernels {kernels}" + (f" (against {best[(1, name)][1]})" if (1, name) in best else "")
            rows.append(row)
            print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compiler": args.cxx, "runs": args.runs, "yardstick_seconds": round(yardstick, 3), "rows": rows},
                      f, indent=1)
        print(f"wrote {args.json}")
    if baseline is not None:
        return check(baseline, args.check, {row["what"]: row["ratio"] for row in rows}, args.tolerance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
