#!/bin/sh
# Issue 42's targets for the examples' --reproducible mode: one digest (the last line,
# `parameters sha256 <hex>`) whatever the world size, the strategy, hybrid sharding, the launcher
# or a resume at another world size, for the same micro-batches. In parts, each its own ctest
# test (seconds each, side by side under ctest -j), each against its own one-rank reference:
#   m8-1, m8-2, m8-4   train, 8 micro-batches at 1, 2 and 4 ranks under ddp, zero1, zero2 and
#                      zero3 (a part per world size: about 13 s a run in an ASan build here);
#   m6-1, m6-3, m6-6   the same with 6 micro-batches at 1, 3 and 6 ranks;
#   hybrid   8 micro-batches, hybrid 2 x 2 (--ranks 4 --nodes 2) under every strategy, and
#            mpirun -np 2 and 4 (when installed);
#   resume   saved at 4 ranks zero3 after step 9 and resumed at 2 ranks ddp; and a world the
#            rule refuses (6 or 12 micro-batches over 4 ranks) exits non-zero naming it;
#   stacked  the stacked example (the trainer's own buffers and AdamW) at 1, 2 and 4 ranks.
# train runs 20 steps, clipping every step, and must end with its match line against one
# process (its exit status) too.
#   reproducible_examples.sh m8-1|m8-2|m8-4|m6-1|m6-3|m6-6|hybrid|resume|stacked TRAIN STACKED DIR
# shellcheck disable=SC2086 # $common is meant to split into its flags
part=${1:?usage: reproducible_examples.sh PART TRAIN STACKED DIR} train=${2:?} stacked=${3:?}
dir=${4:?}
here=$(dirname "$0")
status=0
fail() {
  echo "FAILED: $*"
  status=1
}
if ! rm -rf "$dir" || ! mkdir -p "$dir"; then
  echo "FAILED: cannot make $dir"
  exit 1
fi

# run NAME COMMAND...: the digest of a run that exits 0 (empty, and a failure, otherwise).
run() {
  name=$1
  shift
  log="$dir/$(echo "$name" | tr ' /' '__').log"
  if ! "$@" >"$log" 2>&1; then
    cat "$log"
    fail "$name exited non-zero"
  fi
  digest=$(sed -n 's/^parameters sha256 \([0-9a-f]\{64\}\)$/\1/p' "$log" | tail -n 1)
  [ -n "$digest" ] || fail "$name printed no parameters sha256 line"
  echo "$name: ${digest:-none}"
}
# same REFERENCE NAME COMMAND...: the run's digest must be the reference's.
same() {
  reference=$1
  shift
  run "$@"
  [ "$digest" = "$reference" ] || fail "$1: digest differs from the reference's $reference"
}

# The norm is about 0.15 to 0.5 here: 0.1 clips every step, so the clip factor is exercised too.
common="--reproducible --steps 20 --max-grad-norm 0.1"
# reference M: the one-rank run every other run of the part must equal.
reference() {
  run "train M=$1 1 rank ddp" "$train" $common --micro-batches $1 --ranks 1 --strategy ddp
  grep -q "(clipped)" "$log" || fail "train M=$1: no step clipped (lower --max-grad-norm)"
  expected=$digest
}

case "$part" in
  m8-1 | m8-2 | m8-4 | m6-1 | m6-3 | m6-6)
    micro=${part%-*}
    micro=${micro#m}
    world=${part#*-}
    reference $micro
    for strategy in ddp zero1 zero2 zero3; do
      [ "$world" = 1 ] && [ "$strategy" = ddp ] && continue
      same "$expected" "train M=$micro $world ranks $strategy" "$train" $common --micro-batches $micro \
        --ranks $world --strategy $strategy
    done
    ;;
  hybrid)
    reference 8
    for strategy in ddp zero1 zero2 zero3; do
      same "$expected" "train M=8 hybrid 2x2 $strategy" "$train" $common --micro-batches 8 --ranks 4 --nodes 2 \
        --strategy $strategy
    done
    if command -v mpirun >/dev/null 2>&1; then
      same "$expected" "train M=8 mpirun -np 2 ddp" sh "$here/run_launcher.sh" mpirun 2 "$train" $common \
        --micro-batches 8 --strategy ddp
      same "$expected" "train M=8 mpirun -np 4 zero3" sh "$here/run_launcher.sh" mpirun 4 "$train" $common \
        --micro-batches 8 --strategy zero3
    else
      echo "mpirun not installed: its runs skipped"
    fi
    ;;
  resume)
    # Saved at 4 ranks under zero3 after step 9, resumed at 2 ranks under ddp: the uninterrupted run's bits.
    reference 8
    run "train M=8 4 ranks zero3 stopped after step 9" "$train" $common --micro-batches 8 --ranks 4 \
      --strategy zero3 --checkpoint "$dir/ckpt" --save-every 5 --stop-after 9
    same "$expected" "train M=8 resumed at 2 ranks ddp" "$train" $common --micro-batches 8 --ranks 2 \
      --strategy ddp --checkpoint "$dir/ckpt" --resume
    grep -q "continuing at step 10" "$log" || fail "the resumed run did not continue at step 10"
    # Worlds the rule refuses: a run of micro-batches per rank that is no power of two, or no run at all.
    for micro in 6 12; do
      log="$dir/refused_$micro.log"
      if "$train" $common --micro-batches $micro --ranks 4 >"$log" 2>&1; then
        fail "$micro micro-batches over 4 ranks ran: the rule must refuse them"
      elif ! grep -q "$micro micro-batches over 4 ranks" "$log" || ! grep -q "power of two" "$log"; then
        cat "$log"
        fail "$micro micro-batches over 4 ranks: refused without naming the rule"
      else
        echo "$micro micro-batches over 4 ranks: refused, naming the rule"
      fi
    done
    ;;
  stacked)
    # The trainer's own buffers and optimizer.
    run "stacked M=8 1 rank ddp" "$stacked" --reproducible --micro-batches 8 --ranks 1 --strategy ddp
    expected=$digest
    same "$expected" "stacked M=8 2 ranks ddp" "$stacked" --reproducible --micro-batches 8 --ranks 2 --strategy ddp
    same "$expected" "stacked M=8 4 ranks ddp" "$stacked" --reproducible --micro-batches 8 --ranks 4 --strategy ddp
    same "$expected" "stacked M=8 4 ranks zero3" "$stacked" --reproducible --micro-batches 8 --ranks 4 \
      --strategy zero3
    ;;
  *)
    echo "FAILED: unknown part $part (m8-1, m8-2, m8-4, m6-1, m6-3, m6-6, hybrid, resume or stacked)"
    exit 2
    ;;
esac

[ $status -eq 0 ] && echo "reproducible examples ($part): every digest equal ($expected)"
exit $status
