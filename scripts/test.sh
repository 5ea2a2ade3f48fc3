#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU.
# The test files run on MCORE_RL_TEST_WORKERS parallel pytest workers (default 2; 1 runs them in
# this process): a file's tests stay on one worker, in the groups and order
# tests/support/scheduling.py gives.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
workers="${MCORE_RL_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" "$@"
