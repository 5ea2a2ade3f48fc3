#!/usr/bin/env bash
# The GPU check in one command, for the machine a session is sometimes lent for about 15
# minutes: one GPU, Python 3.12 and torch (CUDA), no network, no vLLM, TransformerEngine, Ray or
# apex:
#   bash scripts/gpu_wheels.sh      # once, on a machine with network: fills .whl/
#   bash scripts/gpu_check.sh       # on the GPU machine, from the checkout carrying .whl/
# It installs from .whl/ what the image lacks (megatron-core; pytest-timeout and hypothesis,
# which pytest needs to collect the suite, where missing), prints the environment, then runs,
# each step in its own process under its own deadline (8 minutes in all):
#   actor   the policy update of a ~1B Llama at TP1 bf16: memory planned vs measured over
#           three updates, tokens/s and MFU (mcore_rl/bench/gpu.py, configs/bench/gpu_actor.yaml)
#   refit   the colocated CUDA-IPC refit between two processes, bit-exact, its bandwidth as a
#           ratio of a device-to-device copy; the sync digest's cost
#   pytest -m gpu                    the GPU checks (each beside its CPU twin)
#   pytest -m device_twin on cuda    the device twins (the normal suite runs them on meta)
# and writes gpu_check.json and gpu_check.md (the table docs/benchmarks.md's GPU section takes)
# to $OUT (or a temporary directory it names). Exits non-zero when any step fails. Arguments
# go to both pytest runs. On a machine without CUDA it runs `pytest -m gpu` (every check skips
# naming its CPU twin), says nothing ran on a GPU, and exits 0.
# PYTHON picks the interpreter (default python3).
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

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=${OUT:-$(mktemp -d)}    # gpu_check.json and gpu_check.md
parts=$(mktemp -d)          # each part's JSON, pytest's junit files
"$PYTHON" -m mcore_rl.bench.gpu env --out "$parts" >/dev/null
"$PYTHON" - "$parts/env.json" <<'PY'
import importlib.util
import json
import sys

env = json.load(open(sys.argv[1]))
print(f"python {env['python']}  torch {env['torch']}  cuda {env['cuda']}  "
      f"cuda available: {env['cuda_available']}  gpu: {env.get('gpu', 'none')}")
print(f"megatron-core {env['megatron_core']}")
for name in ("transformer_engine", "vllm", "ray"):
    try:
        there = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        there = False
    print(f"{name}: {'importable' if there else 'not importable'}")
PY

status=0
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider "$@" || status=$?
    echo "gpu_check: no CUDA device: nothing ran on a GPU (every GPU check skipped naming its" \
         "CPU twin; the device twins run on meta in the normal suite)"
    exit "$status"
fi

# Each step in its own process under its own deadline (the whole check: at most 8 minutes),
# in the order of what only a GPU can tell us; a step that fails or runs out of time is
# reported and the next one still runs.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== gpu_check: $name (at most ${limit} s)"
    local start=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" || rc=$?
    echo "== gpu_check: $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
step "actor: memory planned vs measured, update tokens/s and MFU" 150 \
    "$PYTHON" -m mcore_rl.bench.gpu actor --out "$parts"
step "colocated refit over CUDA IPC vs a device-to-device copy; sync digest cost" 120 \
    "$PYTHON" -m mcore_rl.bench.gpu refit --out "$parts"
step "GPU checks (pytest -m gpu)" 180 \
    "$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider "$@" --junitxml="$parts/gpu.xml"
step "device twins on cuda" 90 env MCORE_RL_TWIN_DEVICE=cuda \
    "$PYTHON" -m pytest -m device_twin -rs -p no:cacheprovider "$@" --junitxml="$parts/twins.xml"
"$PYTHON" -m mcore_rl.bench.gpu summary --parts "$parts" --out "$out" \
    --junit gpu="$parts/gpu.xml" --junit device_twins="$parts/twins.xml" || status=1
echo "gpu_check: summary in $out/gpu_check.json and $out/gpu_check.md"
exit "$status"
