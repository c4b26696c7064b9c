#!/bin/sh
# unit_defines_none.sh CXX NM INCLUDE_DIR UNIT FLAG... -- TEXT...: compiles UNIT (a source file,
# or <header> for a unit that includes that header and calls nothing) at -O0 with the FLAGs,
# and fails when its object defines a symbol whose demangled name contains any TEXT. Two uses
# (tests/CMakeLists.txt): compiled once (-DCOHORT_SEPARATE_COMPILATION=1), code the library
# holds, which the unit would otherwise compile again; header-only with g++'s
# -fkeep-inline-functions (it emits every inline function the unit defined), the bodies of cold
# functions (COHORT_COLD, cohort/config.hpp), which a unit that does not call them must not
# instantiate.
cxx=$1 nm=$2 include=$3 unit=$4
shift 4
flags=
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  flags="$flags $1"
  shift
done
[ "$1" = -- ] && shift
object=$(mktemp) || exit 2
trap 'rm -f "$object"' EXIT
# $flags is split into its words on purpose (each FLAG one argument; none holds a space).
# shellcheck disable=SC2086
case $unit in
  \<*\>) echo "#include $unit" | "$cxx" -std=c++20 -O0 -I"$include" $flags -c -x c++ - -o "$object" || exit 2 ;;
  *) "$cxx" -std=c++20 -O0 -I"$include" $flags -c -x c++ "$unit" -o "$object" || exit 2 ;;
esac
symbols=$("$nm" -C --defined-only "$object") || exit 2
# The unit defined inline functions of cohort's (its error type's, which both kinds of unit
# define: the header-only one only when -fkeep-inline-functions did its work), so that finding
# none of TEXT says something.
if ! printf '%s\n' "$symbols" | grep -q "cohort::v0::error::"; then
  echo "$unit ($flags): no function of cohort::error defined; the flags or the unit do not do what the test means"
  exit 2
fi
status=0
for text in "$@"; do
  found=$(printf '%s\n' "$symbols" | grep -F -- "$text")
  if [ -n "$found" ]; then
    echo "$unit ($flags) defines $text:"
    printf '%s\n' "$found" | head -5
    status=1
  fi
done
[ $status = 0 ] && echo "$unit ($flags) defines none of: $*"
exit $status
