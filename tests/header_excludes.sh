#!/bin/sh
# header_excludes.sh CXX INCLUDE_DIR [-DMACRO... -I<dir>...] HEADER TEXT...: fails when a translation unit
# that includes HEADER alone includes a file whose path contains any TEXT (g++ -M's list).
# Header-only, or as the default targets compile it with -DCOHORT_SEPARATE_COMPILATION=1.
cxx=$1 include=$2
shift 2
defines=""
mode="header-only"
while [ "${1#-}" != "$1" ]; do
  defines="$defines $1"
  [ "${1#-DCOHORT_SEPARATE_COMPILATION}" != "$1" ] && mode="compiled once"
  shift
done
header=$1
shift
# shellcheck disable=SC2086 # each define is one word
files=$("$cxx" -std=c++20 -I"$include" $defines -M -x c++ -include "$header" /dev/null) || exit 2
status=0
for text in "$@"; do
  found=$(printf '%s\n' "$files" | tr ' \\' '\n\n' | grep -F "$text")
  if [ -n "$found" ]; then
    echo "$header ($mode) includes what it should not ($text):"
    printf '%s\n' "$found"
    status=1
  fi
done
[ $status = 0 ] && echo "$header ($mode) includes nothing of: $*"
exit $status
