#!/bin/sh
# Counts the lines a conversion changed between two files, blank lines and comment-only lines
# aside: the lines removed from the first plus the lines added in the second (git's count),
# and fails when they are more than LIMIT.
#   conversion_lines.sh BEFORE AFTER LIMIT
before=$1 after=$2 limit=$3
code() { grep -v -E '^[[:space:]]*(//.*)?$' "$1"; }
code "$before" >/tmp/conversion_before.$$ && code "$after" >/tmp/conversion_after.$$ || exit 2
changed=$(diff /tmp/conversion_before.$$ /tmp/conversion_after.$$ | grep -c '^[<>]')
rm -f /tmp/conversion_before.$$ /tmp/conversion_after.$$
echo "conversion: $changed changed lines ($(basename "$before") -> $(basename "$after")), limit $limit"
[ "$changed" -le "$limit" ]
