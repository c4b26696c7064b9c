#!/bin/sh
# Run where Debian's package registry is (this project's CI-like machines): unpacks what
# tools/gpu-check.sh needs on a GPU machine that has CMake, nvcc and NCCL but no registry,
# Debian's Gloo (with the libraries it links) and Catch2, into a folder (default .gpu-deps,
# ignored by git). Carry that folder to the GPU machine and pass it to gpu-check.sh.
#   sh tools/gpu-deps.sh [FOLDER]
set -eu
out=${1:-.gpu-deps}
packages="libgloo0 libgloo-dev libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200 catch2"
rm -rf "$out"
mkdir -p "$out/debs" "$out/root"
(cd "$out/debs" && apt-get download $packages)
for deb in "$out"/debs/*.deb; do dpkg -x "$deb" "$out/root"; done
rm -rf "$out/debs" "$out/root/usr/share/doc" "$out/root/usr/share/man"
# Debian's Gloo targets name /usr/lib/libgloo.so.0.5.0 by its absolute path; point them at
# the unpacked copy instead, relative to the config file, so the folder works anywhere.
for targets in "$out"/root/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
  sed -i 's|"/usr/lib/|"${_IMPORT_PREFIX}/lib/|g' "$targets"
done
echo "gpu-deps: $(du -sh "$out" | cut -f1) in $out ($packages)"
