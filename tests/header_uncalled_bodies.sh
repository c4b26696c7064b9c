#!/bin/sh
# header_uncalled_bodies.sh CXX INCLUDE_DIR HEADER NAME...: fails when a header-only translation
# unit that includes HEADER and calls nothing compiles the body of a function whose qualified
# name contains any NAME. g++'s -fkeep-inline-functions emits every inline function the unit
# defined: an inline body is analysed (and what it uses instantiated) wherever it is included,
# where a cold one (COHORT_COLD, cohort/config.hpp) is a template only a call instantiates.
cxx=$1 include=$2 header=$3
shift 3
object=$(mktemp) || exit 2
trap 'rm -f "$object"' EXIT
echo "#include <$header>" | "$cxx" -std=c++20 -I"$include" -O0 -fkeep-inline-functions -c -x c++ - -o "$object" || exit 2
symbols=$(nm -C "$object") || exit 2
# The flag did its work: the unit's inline functions are there (cohort's error type, at least).
if ! printf '%s\n' "$symbols" | grep -q "cohort::v0::error::"; then
  echo "$header: no inline function of cohort emitted; -fkeep-inline-functions not honoured by $cxx"
  exit 2
fi
status=0
for name in "$@"; do
  found=$(printf '%s\n' "$symbols" | grep -F -- "$name")
  if [ -n "$found" ]; then
    echo "$header compiles a body it does not call ($name):"
    printf '%s\n' "$found" | head -5
    status=1
  fi
done
[ $status = 0 ] && echo "$header compiles none of: $*"
exit $status
