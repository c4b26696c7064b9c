#!/bin/sh
# objects_place_cold.sh OBJDUMP OBJECT... --cold TEXT... --hot TEXT...: fails unless every
# function of the OBJECTs (object files or static libraries) whose demangled name contains a
# --cold TEXT is in .text.unlikely (g++ -O2 and above put a [[gnu::cold]] function there,
# optimized for size and with little inlined into it: less for the compiler to do), and no
# function whose name contains a --hot TEXT is (its outlined "[clone .cold]" parts and its
# lambdas aside). The --hot list is what a cold attribute in the wrong place drags along: g++
# takes a block that calls a cold function as never run, and a function that calls one on every
# path as cold itself, up the callers, so a setup function marked cold would put a trainer's
# own function, loop and all, among them. Each TEXT must name at least one function.
objdump=${1:?usage: objects_place_cold.sh OBJDUMP OBJECT... --cold TEXT... --hot TEXT...}
shift
objects=
while [ $# -gt 0 ] && [ "$1" != --cold ]; do
  objects="$objects $1"
  shift
done
[ "$1" = --cold ] && shift
# One line per function: its section, a tab, its demangled name. $objects is split into its
# words on purpose (no path holds a space).
# shellcheck disable=SC2086
functions=$("$objdump" -t -C $objects | awk -F '\t' '/ F / { n = split($1, left, " "); name = $2; sub(/^[0-9a-f]+ /, "", name); print left[n] "\t" name }') || exit 2
status=0
want=cold
for text in "$@"; do
  if [ "$text" = --hot ]; then
    want=hot
    continue
  fi
  matching=$(printf '%s\n' "$functions" | grep -F -- "$text" | grep -v -F -e '[clone .cold]' -e '{lambda')
  if [ -z "$matching" ]; then
    echo "no function named $text in$objects; the code or the name no longer says what the test means"
    status=1
    continue
  fi
  if [ $want = cold ]; then
    misplaced=$(printf '%s\n' "$matching" | grep -v '^\.text\.unlikely')
  else
    misplaced=$(printf '%s\n' "$matching" | grep '^\.text\.unlikely')
  fi
  if [ -n "$misplaced" ]; then
    echo "$text is not $want:"
    printf '%s\n' "$misplaced" | head -3 | cut -c1-240
    status=1
  fi
done
[ $status = 0 ] && echo "the cold functions are in .text.unlikely, the hot ones are not"
exit $status
