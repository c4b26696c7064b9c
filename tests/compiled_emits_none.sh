#!/bin/sh
# compiled_emits_none.sh CXX NM INCLUDE_DIR SOURCE TEXT...: compiled once (as the default
# targets compile a trainer's unit), SOURCE's object must define no symbol whose demangled name
# contains any TEXT: code the library holds, which the unit would otherwise compile again.
cxx=$1 nm=$2 include=$3 source=$4
shift 4
object=$(mktemp) || exit 2
trap 'rm -f "$object"' EXIT
"$cxx" -std=c++20 -O0 -I"$include" -DCOHORT_SEPARATE_COMPILATION=1 -c -x c++ "$source" -o "$object" || exit 2
symbols=$("$nm" -C --defined-only "$object") || exit 2
status=0
for text in "$@"; do
  found=$(printf '%s\n' "$symbols" | grep -F "$text")
  if [ -n "$found" ]; then
    echo "$source (compiled once) defines what the library holds ($text):"
    printf '%s\n' "$found" | head -5
    status=1
  fi
done
[ $status = 0 ] && echo "$source (compiled once) defines nothing of: $*"
exit $status
