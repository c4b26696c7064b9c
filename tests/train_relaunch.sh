#!/bin/sh
# A crashed job relaunched until it completes, as a plain relaunch loop or torchrun's agent
# does: `train` saves every EVERY steps, rank 1 SIGKILLs itself after step KILL in the first
# launch, and the same command line is launched again (--resume finds the newest complete
# checkpoint) until it exits 0. Its final parameters must equal, bit for bit, those of the
# uninterrupted run at the same world size and strategy (the reduction order is the same).
# The steps re-run after the restart are counted. A save commits as soon as every rank's file
# is durable (rank 0's writer thread, no collective of the trainer's), so the bound is
#   lost <= EVERY - 1                      when the newest save begun before the kill had
#                                          finished writing by then (it is committed), and
#   lost <= EVERY + W, W = kill - last      when the kill came while it was being written (W:
#                                          the steps trained during that write; the resume
#                                          then starts after the save before it, EVERY steps
#                                          earlier),
# and lost is at most the steps since the newest committed checkpoint in any case.
#   train_relaunch.sh threads|mpirun|torchrun TRAIN DIR
# Exit 77 (skipped) with the reason when the launcher is absent.
mode=$1 train=$2 dir=$3
ranks=4 steps=20 every=4 kill=10 strategy=zero2
here=$(dirname "$0")
case "$mode" in
  threads) launch() { "$train" --ranks "$ranks" "$@"; } ;;
  mpirun) launch() { sh "$here/run_launcher.sh" mpirun "$ranks" "$train" "$@"; } ;;
  torchrun)
    # torchrun itself relaunches: --max-restarts 1 is the loop, so one launch must complete.
    python3 -c "import torch, sys; sys.exit(int(torch.__version__.split('.')[0]) < 2)" 2>/dev/null ||
      { echo "SKIPPED: torchrun --max-restarts needs PyTorch 2.x (python3 -m torch.distributed.run); not installed"; exit 77; }
    launch() { python3 -m torch.distributed.run --nproc-per-node "$ranks" --max-restarts 1 --master-port "${MASTER_PORT:-29500}" --no-python "$train" "$@"; } ;;
  *) echo "usage: train_relaunch.sh threads|mpirun|torchrun TRAIN DIR"; exit 2 ;;
esac
[ "$mode" = mpirun ] && ! command -v mpirun >/dev/null 2>&1 &&
  { echo "SKIPPED: mpirun not found (apt-get install openmpi-bin)"; exit 77; }
fail() { echo "FAILED: $*"; exit 1; }
rm -rf "$dir" && mkdir -p "$dir" || fail "cannot make $dir"
log=$dir/log
args="--strategy $strategy --steps $steps"

launch $args > "$log.reference" 2>&1 || { cat "$log.reference"; fail "the uninterrupted run failed"; }
expected=$(grep '^final parameters: sum' "$log.reference")
[ -n "$expected" ] || { cat "$log.reference"; fail "no final parameters line in the uninterrupted run"; }
echo "uninterrupted:        $expected"

attempt=0 status=1 killed_at= committed= resumed_at=
while [ $attempt -lt 4 ]; do
  attempt=$((attempt + 1))
  launch $args --checkpoint "$dir/ckpt" --save-every $every --resume --kill-at-step $kill > "$log.$attempt" 2>&1
  status=$?
  echo "launch $attempt: exit status $status"
  at=$(sed -n 's/.*killed (SIGKILL) after step \([0-9]*\).*/\1/p' "$log.$attempt" | head -n 1)
  [ -n "$at" ] && killed_at=$at &&
    committed=$(ls "$dir/ckpt" | sed -n 's/^step-\([0-9]*\)$/\1/p' | sort -n | tail -n 1)
  # Under torchrun the restart is inside the launch: the checkpoint it resumed from is the
  # newest committed at the kill (resume takes the newest).
  [ "$mode" = torchrun ] && committed=$(sed -n 's/.*resumed from .*step-\([0-9]*\) .*/\1/p' "$log.$attempt" | head -n 1)
  from=$(sed -n 's/.*continuing at step \([0-9]*\).*/\1/p' "$log.$attempt" | head -n 1)
  [ -n "$from" ] && resumed_at=$from
  [ $status -eq 0 ] && break
done
[ $status -eq 0 ] || { cat "$log.$attempt"; fail "no launch completed in $attempt"; }
[ -n "$killed_at" ] && { [ $attempt -ge 2 ] || [ "$mode" = torchrun ]; } || fail "no launch was killed: the relaunch was not exercised"
[ -n "$committed" ] || fail "no checkpoint was committed before the kill at step $killed_at"
[ -n "$resumed_at" ] || fail "the relaunch did not resume"
got=$(grep '^final parameters: sum' "$log.$attempt")
echo "killed and relaunched: $got"
# Steps completed before the kill (0..killed_at) that the relaunch trained again.
lost=$((killed_at + 1 - resumed_at))
since=$((killed_at - committed))
last_save=$(( (killed_at + 1) / every * every - 1 ))
if [ "$committed" -ge "$last_save" ]; then
  in_write=0 bound=$((every - 1))
else
  in_write=$((killed_at - last_save)) bound=$((every + killed_at - last_save))
fi
echo "killed after step $killed_at; newest save begun after step $last_save;" \
  "newest committed checkpoint step-$committed; resumed at step $resumed_at;" \
  "steps lost $lost (bound $bound: every $every - 1 with the newest save committed, else every + the $in_write steps trained while it was written)"
[ "$lost" -le "$since" ] || fail "lost $lost steps, more than the $since since the last checkpoint"
[ "$lost" -le "$bound" ] || fail "lost $lost steps, more than the bound $bound"
[ "$got" = "$expected" ] || fail "final parameters differ from the uninterrupted run"
echo "relaunch: bit-exact ($strategy at $ranks ranks, $mode)"
