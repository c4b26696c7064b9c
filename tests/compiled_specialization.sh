#!/bin/sh
# compiled_specialization.sh CXX INCLUDE_DIR SOURCE: compiled once, SOURCE (a specialization the
# library does not hold) must fail to compile with the error that names COHORT_TEMPLATE_BODIES,
# never reach the linker; and compile with COHORT_TEMPLATE_BODIES defined.
cxx=$1 include=$2 source=$3
compile() {
  "$cxx" -std=c++20 -Wall -Wextra -Werror -I"$include" -DCOHORT_SEPARATE_COMPILATION=1 "$@" -fsyntax-only "$source" 2>&1
}
if output=$(compile); then
  echo "$source compiled without COHORT_TEMPLATE_BODIES: its users would meet a link error instead"
  exit 1
fi
if ! printf '%s\n' "$output" | grep -q "cohort: compiled once.*COHORT_TEMPLATE_BODIES"; then
  echo "$source failed to compile, but not with the error that names COHORT_TEMPLATE_BODIES:"
  printf '%s\n' "$output" | head -20
  exit 1
fi
if ! output=$(compile -DCOHORT_TEMPLATE_BODIES); then
  echo "$source fails to compile with COHORT_TEMPLATE_BODIES:"
  printf '%s\n' "$output" | head -20
  exit 1
fi
echo "$source: refused naming COHORT_TEMPLATE_BODIES, compiles with it"
