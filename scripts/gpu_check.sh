#!/usr/bin/env bash
# The GPU check suite in one command, for a bare machine with one GPU, Python 3.12 and torch
# (CUDA) but no network, vLLM, TransformerEngine or Ray (shared/FINDINGS.md, "The GPU machine
# we can sometimes check on"):
#   bash scripts/gpu_wheels.sh      # once, on a machine with network: fills .whl/
#   bash scripts/gpu_check.sh       # on the GPU machine, from the checkout carrying .whl/
# It installs from .whl/ what the selected tests import and the GPU image may lack: megatron-core,
# and pytest-timeout and hypothesis, which pytest needs to collect the test modules at all (the
# `timeout` marker under --strict-markers; module-level hypothesis imports) — each only when
# missing (nothing outside the repo is created besides that pip install into $PYTHON's
# environment). vLLM, TransformerEngine, Ray and the mcore-rl install are not needed: every
# check that needs one skips naming it. It prints the environment, runs `pytest -m gpu -rs`
# then, with CUDA present, the device twins on the GPU (`MCORE_RL_TWIN_DEVICE=cuda pytest -m
# device_twin`; the normal suite runs them on `meta`), and exits non-zero on any failure.
# PYTHON picks the interpreter (default python3); on a CPU machine
# `PYTHON=.venv/bin/python bash scripts/gpu_check.sh` shows every GPU check skipping with the
# name of its CPU twin.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

missing=()
for need in megatron.core=megatron-core pytest_timeout=pytest-timeout hypothesis=hypothesis; do
    "$PYTHON" -c "import ${need%%=*}" 2>/dev/null || missing+=("${need#*=}")
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: ${missing[*]} not installed and .whl/ has no wheels;" \
             "run scripts/gpu_wheels.sh on a machine with network and carry .whl/" >&2
        exit 2
    fi
    "$PYTHON" -m pip install --no-index --find-links .whl "${missing[@]}"
fi

"$PYTHON" - <<'PY'
import platform

import torch

print(f"python {platform.python_version()}  torch {torch.__version__}  "
      f"cuda {torch.version.cuda}  cuda available: {torch.cuda.is_available()}")
for i in range(torch.cuda.device_count()):
    print(f"gpu {i}: {torch.cuda.get_device_name(i)}")
import megatron.core

print(f"megatron-core {megatron.core.__version__}")
for name in ("transformer_engine", "vllm", "ray"):
    try:
        __import__(name)
        print(f"{name}: importable")
    except Exception:
        print(f"{name}: not importable")
PY

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0
"$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider "$@" || status=$?
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    MCORE_RL_TWIN_DEVICE=cuda "$PYTHON" -m pytest -m device_twin -rs -p no:cacheprovider "$@" \
        || status=$?
else
    echo "gpu_check: no CUDA device: the device twins ran on meta in the normal suite"
fi
exit "$status"
