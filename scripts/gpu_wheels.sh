#!/usr/bin/env bash
# Fill .whl/ (in the repo, git-ignored) with the wheels scripts/gpu_check.sh installs on the
# GPU check machine, which has Python 3.12, torch and CUDA but no network. Run this on a machine
# WITH network, then carry the checkout (with .whl/) over.
#
# Only what the GPU image lacks (/work/.library/device/KINDS.md lists its packages):
# megatron-core (2.6 MB cp312 wheel; its own requirements torch, numpy and packaging are in the
# image, as are PyYAML, rich, safetensors, transformers, sentencepiece, psutil, pytest,
# pytest-timeout and hypothesis). pytest-timeout comes along in case an image lacks it (pytest
# needs it to collect the suite). vLLM, TransformerEngine and Ray are neither carried nor
# needed: the GPU checks that need them skip naming them.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-"python3 -m pip"}  # any pip works: it only downloads
mkdir -p .whl
$PIP download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --dest .whl megatron-core==0.16.1 pytest-timeout==2.4.0
ls -l .whl
