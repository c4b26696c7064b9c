#!/bin/sh
# header_excludes.sh CXX INCLUDE_DIR HEADER TEXT...: fails when a header-only translation unit
# that includes HEADER alone includes a file whose path contains any TEXT (g++ -M's list).
cxx=$1 include=$2 header=$3
shift 3
files=$("$cxx" -std=c++20 -I"$include" -M -x c++ -include "$header" /dev/null) || exit 2
status=0
for text in "$@"; do
  found=$(printf '%s\n' "$files" | tr ' \\' '\n\n' | grep -F "$text")
  if [ -n "$found" ]; then
    echo "$header (header-only) includes what it should not ($text):"
    printf '%s\n' "$found"
    status=1
  fi
done
[ $status = 0 ] && echo "$header (header-only) includes nothing of: $*"
exit $status
