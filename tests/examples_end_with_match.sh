#!/bin/sh
# Every .cu example ends on a line the GPU check can read: it prints "match" (or MISMATCH)
# against a host reference, in its own source or in an example header it includes.
#   sh tests/examples_end_with_match.sh EXAMPLES_DIR
dir=${1:?usage: examples_end_with_match.sh EXAMPLES_DIR}
status=0
for source in "$dir"/*.cu; do
  files=$source
  for header in $(sed -n 's/^#include "\(.*\)"$/\1/p' "$source"); do
    [ -f "$dir/$header" ] && files="$files $dir/$header"
  done
  # shellcheck disable=SC2086
  if ! grep -qF '? "match" :' $files; then
    echo "$source prints no match line (looked in: $files)"
    status=1
  fi
done
exit $status
