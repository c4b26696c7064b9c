#!/usr/bin/env bash
# Builds here, where nvcc and NCCL compile and link, every program that needs a GPU, and packs
# them with what a GPU machine without a package registry lacks into one relocatable folder:
#   bin/            the CUDA tests, the .cu examples, consumer_nvcc, cohort-bench (the list
#                   CMake writes, BUILD/gpu-programs.tsv: a CUDA program cannot be left out)
#   lib/            the shared libraries they load beyond the C and C++ runtimes, NCCL and the
#                   driver: Debian's Gloo and what it links, the CUDA runtime they were built with
#   programs.tsv    kind, name, bin/NAME for each program; gpu-check.sh runs every one
#   gpu-check.sh    the runner (tools/gpu-check.sh)
#   bundle.txt      the commit, nvcc, and the NCCL version the programs were built against
#   fallback/       Debian's Gloo and Catch2 unpacked (with --fallback-deps), so that gpu-check.sh
#                   can build from source on the GPU machine if the bundle does not load there
# NCCL itself is not carried: the GPU machine's own (its nvidia-nccl-cu13 wheel, or a toolkit's)
# is found by gpu-check.sh and loaded through LD_LIBRARY_PATH.
#
#   bash tools/gpu-bundle.sh [--build DIR] [--out DIR] [--no-build] [--fallback-deps]
#
# --build: a build folder configured with CUDA (default: build, configured Release with
# COHORT_CUDA=ON when it does not exist yet); --out: the bundle (default: gpu-bundle, ignored
# by git); --no-build: pack what is built, failing if a program is missing.
# Then, on the GPU machine, from a checkout with the bundle beside it (docs/design.md):
#   bash gpu-bundle/gpu-check.sh gpu-bundle OUT
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
out=gpu-bundle
do_build=1
fallback_deps=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --fallback-deps) fallback_deps=1; shift ;;
    *) echo "gpu-bundle: unknown argument '$1' (see the comment at the top of $0)" >&2; exit 2 ;;
  esac
done
limit_mib=60

if [ "$do_build" = 1 ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOHORT_CUDA=ON
  fi
  cmake --build "$build" --target cohort_gpu_programs
fi
manifest="$build/gpu-programs.tsv"
if [ ! -f "$manifest" ]; then
  echo "gpu-bundle: $manifest is missing: $build was not configured with CUDA and NCCL (COHORT_CUDA=ON)" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
: > "$out/programs.tsv"
missing=0
while IFS=$'\t' read -r kind name path; do
  [ -n "$kind" ] || continue
  if [ ! -x "$path" ]; then
    echo "gpu-bundle: $kind program $name is not built ($path)" >&2
    missing=1
    continue
  fi
  cp "$path" "$out/bin/$name"
  printf '%s\t%s\tbin/%s\n' "$kind" "$name" "$name" >> "$out/programs.tsv"
done < "$manifest"
[ "$missing" = 0 ] || { echo "gpu-bundle: build the missing programs first (drop --no-build)" >&2; exit 1; }

# The libraries to carry: everything a program resolves here except the C/C++ runtimes, which
# every Linux has (a newer glibc and libstdc++ run these programs), and NCCL and the driver,
# which must be the GPU machine's own.
system_library='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnccl\.so)'
for program in "$out"/bin/*; do
  ldd "$program" | awk '/=>/ && $3 ~ /^\// { print $1, $3 }' | while read -r soname resolved; do
    [[ $soname =~ $system_library ]] && continue
    [ -f "$out/lib/$soname" ] || cp -L "$resolved" "$out/lib/$soname"
  done
done
chmod u+w "$out"/lib/* 2>/dev/null || true
strip --strip-unneeded "$out"/bin/* "$out"/lib/* 2>/dev/null || true

if [ "$fallback_deps" = 1 ]; then
  # What building from source needs there and has no registry to fetch: Gloo's headers and
  # CMake package, Catch2. Debian's Gloo names /usr/lib by absolute path; make it relative.
  packages="libgloo0 libgloo-dev libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200 catch2"
  mkdir -p "$out/fallback/debs" "$out/fallback/root"
  (cd "$out/fallback/debs" && apt-get download $packages > /dev/null)
  for deb in "$out"/fallback/debs/*.deb; do dpkg -x "$deb" "$out/fallback/root"; done
  rm -rf "$out/fallback/debs" "$out/fallback/root/usr/share/doc" "$out/fallback/root/usr/share/man"
  for targets in "$out"/fallback/root/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
    sed -i 's|"/usr/lib/|"${_IMPORT_PREFIX}/lib/|g' "$targets"
  done
fi

cp tools/gpu-check.sh "$out/gpu-check.sh"
nccl_header=$(awk -F= '/^NCCL_INCLUDE_DIR:/ { print $2 }' "$build/CMakeCache.txt")/nccl.h
{
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "nvcc: $("$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" --version | tail -1)"
  echo "nccl built against: $(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) / { printf "%s%s", sep, $3; sep="." }' "$nccl_header" 2>/dev/null) ($nccl_header)"
  echo "device code: $(grep -ohE -- '-arch=sm_[0-9a-z]+|--generate-code=arch=[^ ]+' "$build"/build.ninja "$build"/Makefile 2>/dev/null | sort -u | xargs)"
  echo "made: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
} > "$out/bundle.txt"

size_kib=$(du -sk "$out" | cut -f1)
echo "gpu-bundle: $(wc -l < "$out/programs.tsv") programs, $(ls "$out/lib" | wc -l) libraries, $((size_kib / 1024)) MiB in $out"
cat "$out/bundle.txt"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
  echo "gpu-bundle: $out is over $limit_mib MiB; the device tool carries at most 64 MiB with the tree" >&2
  exit 1
fi
