#!/usr/bin/env python3
"""What each public header pulls in: the cohort files `g++ -M` lists for the header alone,
header-only and with COHORT_SEPARATE_COMPILATION, and the header's own length in lines; the
table of docs/design.md "What each header pulls in".

  python3 bench/include_counts.py [--cxx g++]
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(os.path.dirname(HERE), "include")
sys.path.insert(0, HERE)
from compile_time import header_flags, public_headers  # noqa: E402


def cohort_files(cxx, header, extra):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as source:
        source.write(f"#include <{header}>\n")
    try:
        done = subprocess.run([cxx, "-std=c++20", f"-I{INCLUDE}", "-M"] + header_flags(header) + extra + [source.name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True)
    finally:
        os.unlink(source.name)
    paths = done.stdout.replace("\\\n", " ").split()[1:]
    root = os.path.join(INCLUDE, "cohort") + os.sep
    return {os.path.normpath(p) for p in paths if os.path.normpath(p).startswith(root)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    args = parser.parse_args()
    print("| header | lines | cohort files (header-only / compiled) |")
    print("|---|---:|---:|")
    for header in public_headers(INCLUDE):
        with open(os.path.join(INCLUDE, header)) as f:
            lines = sum(1 for _ in f)
        header_only = cohort_files(args.cxx, header, [])
        compiled = cohort_files(args.cxx, header, ["-DCOHORT_SEPARATE_COMPILATION"])
        print(f"| `{header}` | {lines} | {len(header_only)} / {len(compiled)} |")


if __name__ == "__main__":
    main()
