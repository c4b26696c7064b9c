#!/bin/sh
# Runs cohort's main example, data-parallel training of a small MLP through training_state
# (strategy ddp): on the GPUs with NCCL when there are any (one rank per GPU, up to 2, under
# mpirun), else on 2 CPU ranks with Gloo.
#   sh examples/run_main_example.sh [BUILD_DIR]
build=${1:-build}
here=$(dirname "$0")
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${gpus:-0}" -gt 0 ] && [ -x "$build/examples/train_cuda" ]; then
  ranks=1
  [ "$gpus" -ge 2 ] && ranks=2
  echo "cohort: $gpus GPU(s) found: train_cuda on $ranks rank(s) with NCCL"
  if [ "$ranks" -eq 1 ]; then exec "$build/examples/train_cuda" --strategy ddp; fi
  exec sh "$here/../tests/run_launcher.sh" mpirun "$ranks" "$build/examples/train_cuda" --strategy ddp
fi
echo "cohort: no GPU found: train on 2 CPU ranks with Gloo"
exec "$build/examples/train" --strategy ddp --ranks 2
