#!/bin/sh
# Runs a cohort program under a real launcher, or reports the test skipped (exit 77) with
# the reason when that launcher is not installed.
#   run_launcher.sh mpirun|torchrun RANKS PROGRAM [ARGS...]
launcher=$1 ranks=$2
shift 2
case "$launcher" in
  mpirun)
    command -v mpirun >/dev/null 2>&1 || { echo "SKIPPED: mpirun not found (apt-get install openmpi-bin)"; exit 77; }
    # Open MPI refuses root without these; --oversubscribe lets N ranks share fewer cores.
    if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
      exec mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$@"
    fi
    exec mpirun -np "$ranks" "$@"
    ;;
  torchrun)
    command -v torchrun >/dev/null 2>&1 || { echo "SKIPPED: torchrun not found (pip install torch)"; exit 77; }
    # torchrun of torch 1.x (Debian's python3-torch) crashes on Python 3.11; 2.x is needed.
    version=$(python3 -c "import torch; print(torch.__version__.split('.')[0])" 2>/dev/null)
    [ "${version:-0}" -ge 2 ] 2>/dev/null || { echo "SKIPPED: torchrun needs torch >= 2 (found '${version:-none}')"; exit 77; }
    exec torchrun --nproc-per-node "$ranks" --master-port "${MASTER_PORT:-29500}" --no-python "$@"
    ;;
  *) echo "unknown launcher $launcher"; exit 2 ;;
esac
