#!/usr/bin/env bash
# Build the apex piece mcore-rl uses into $PYTHON's environment: fused_weight_gradient_mlp_cuda,
# which megatron-core's gradient_accumulation_fusion imports (megatron/core/tensor_parallel/
# layers.py; each actor rank turns the fusion on only where it imports: mcore_rl/models/
# kernels.py). apex is not on PyPI (the PyPI `apex` is another project): this builds NVIDIA's.
#
#   bash scripts/build_apex.sh                          # clones NVIDIA/apex at APEX_REF
#   APEX_SRC=/path/to/apex bash scripts/build_apex.sh   # an apex checkout (no network)
#
# apex's setup.py builds that module only among its core CUDA extensions (APEX_CPP_EXT=1
# APEX_CUDA_EXT=1; it has no narrower switch): apex_C, amp_C, syncbn, fused_layer_norm_cuda,
# mlp_cuda, fused_dense_cuda, the masked-softmax kernels and fused_weight_gradient_mlp_cuda — no
# contrib extension. It runs `pip install --no-build-isolation` in the checkout, against this
# torch, and takes tens of minutes (MAX_JOBS, APEX_PARALLEL_BUILD and
# NVCC_APPEND_FLAGS="--threads 4" are apex's knobs for that).
#
# Before building anything it refuses, in one line and exit 2, what would fail apex's build:
#   - no CUDA toolkit where torch's cpp_extension looks (CUDA_HOME / CUDA_PATH, else nvcc on
#     PATH (its bin/'s parent), else /usr/local/cuda), no nvcc or no include/cuda_runtime.h there;
#   - torch without CUDA (a CPU wheel);
#   - nvcc's CUDA release unlike torch's (apex's setup.py raises on any difference);
#   - no pip, setuptools, wheel, packaging or Python headers (Python.h) for this interpreter;
#   - no apex source (no APEX_SRC, and the clone fails: no git or no network).
# With the module importable already it says so and exits 0 (FORCE=1 rebuilds). After the
# build it checks what megatron-core sees (tensor_parallel.layers._grad_accum_fusion_available).
#
# Environment (defaults): PYTHON (.venv/bin/python if present, else python3), APEX_SRC,
# APEX_REF (the commit cloned: below), APEX_DIR (where it is cloned: build/apex), APEX_LOG
# (the build's output: build/apex-build.log),
# TORCH_CUDA_ARCH_LIST (torch's default: the visible GPUs' architectures; with no GPU visible,
# apex's own list of every architecture, slower: "9.0" builds for H100/H200 only), FORCE.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# NVIDIA/apex master of 2026-07-08 (its setup.py: the APEX_CPP_EXT / APEX_CUDA_EXT switches)
APEX_REF=${APEX_REF:-6424da3b4faa6c8f062da4a48c424fff3f02d42d}
APEX_URL=${APEX_URL:-https://github.com/NVIDIA/apex}

refuse() { echo "build_apex: $*" >&2; exit 2; }

PYTHON=$(command -v "$PYTHON") || refuse "no Python interpreter ${PYTHON} (set PYTHON)"
case $PYTHON in /*) ;; *) PYTHON="$PWD/$PYTHON" ;; esac  # pip runs it from the apex checkout
if [ "${FORCE:-0}" != 1 ] && "$PYTHON" -c "import fused_weight_gradient_mlp_cuda" 2>/dev/null
then
    echo "build_apex: fused_weight_gradient_mlp_cuda already imports in $PYTHON; nothing to" \
         "build (FORCE=1 rebuilds)"
    exit 0
fi

# What apex's build needs, checked in the order it would fail; prints CUDA_HOME when all is
# there. Mirrors torch.utils.cpp_extension._find_cuda_home, which apex's setup.py uses.
CUDA_HOME=$("$PYTHON" - <<'PY'
import os, re, shutil, subprocess, sys, sysconfig


def refuse(why):
    print(f"build_apex: {why}", file=sys.stderr)
    sys.exit(2)


try:
    import torch
except Exception as err:
    refuse(f"torch does not import in {sys.executable} ({type(err).__name__}: {err})")
home, how = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), "CUDA_HOME/CUDA_PATH"
if home is None and shutil.which("nvcc"):
    home, how = os.path.dirname(os.path.dirname(shutil.which("nvcc"))), "nvcc on PATH"
if home is None:
    home, how = "/usr/local/cuda", "the default"
    if not os.path.exists(home):
        refuse("no CUDA toolkit: nvcc is not on PATH, CUDA_HOME and CUDA_PATH are unset and "
               "/usr/local/cuda does not exist (install the CUDA toolkit matching torch's "
               f"CUDA {torch.version.cuda}, or set CUDA_HOME)")
nvcc = os.path.join(home, "bin", "nvcc")
try:
    out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, timeout=60).stdout
except OSError:
    refuse(f"no nvcc at {nvcc} (CUDA_HOME={home}, from {how}): set CUDA_HOME to the CUDA "
           "toolkit's root")
release = re.search(r"release (\d+\.\d+)", out)
if release is None:
    refuse(f"{nvcc} -V names no CUDA release")
if not os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
    refuse(f"CUDA_HOME={home} (from {how}) has no include/cuda_runtime.h: set CUDA_HOME to "
           "the CUDA toolkit's root (e.g. /usr/local/cuda)")
if torch.version.cuda is None:
    refuse(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): apex's CUDA "
           "extensions need torch built for CUDA")
from packaging.version import parse  # apex's own comparison (setup.py)

if parse(release.group(1)) != parse(torch.version.cuda):
    refuse(f"nvcc at {nvcc} is CUDA {release.group(1)} but torch {torch.__version__} was built "
           f"with CUDA {torch.version.cuda}: apex's setup.py refuses the difference; set "
           f"CUDA_HOME to a CUDA {torch.version.cuda} toolkit")
import importlib.util

missing = [m for m in ("pip", "setuptools", "wheel", "packaging")
           if importlib.util.find_spec(m) is None]
if missing:
    refuse(f"{', '.join(missing)} not installed in {sys.executable} (apex builds with "
           "--no-build-isolation: pip install " + " ".join(missing) + ")")
headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
if not os.path.isfile(headers):
    refuse(f"no Python headers ({headers}): install python{sys.version_info.major}."
           f"{sys.version_info.minor}-dev")
print(home)
PY
)

if [ -n "${APEX_SRC:-}" ]; then
    [ -f "$APEX_SRC/setup.py" ] \
        || refuse "APEX_SRC=$APEX_SRC has no setup.py (an NVIDIA/apex checkout)"
    SRC=$APEX_SRC
else
    SRC=${APEX_DIR:-build/apex}
    if [ ! -f "$SRC/setup.py" ]; then
        command -v git >/dev/null 2>&1 || refuse "no apex source: set APEX_SRC to an" \
            "NVIDIA/apex checkout (git is not installed to clone $APEX_URL)"
        mkdir -p "$(dirname "$SRC")"
        git clone --quiet "$APEX_URL" "$SRC" 2>/dev/null || refuse "no apex source: cloning" \
            "$APEX_URL failed (no network?); set APEX_SRC to an NVIDIA/apex checkout"
    fi
    git -C "$SRC" checkout --quiet "$APEX_REF" 2>/dev/null \
        || refuse "$SRC has no commit $APEX_REF (set APEX_REF, or APEX_SRC to a checkout)"
fi

LOG=${APEX_LOG:-$PWD/build/apex-build.log}
mkdir -p "$(dirname "$LOG")"
echo "build_apex: building apex's C++/CUDA extensions from $SRC with CUDA_HOME=$CUDA_HOME" \
     "into $PYTHON (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-those of the visible GPUs});" \
     "full output: $LOG"
(cd "$SRC" && CUDA_HOME="$CUDA_HOME" APEX_CPP_EXT=1 APEX_CUDA_EXT=1 \
    "$PYTHON" -m pip install -v --no-build-isolation --no-deps \
    --disable-pip-version-check --no-cache-dir .) >"$LOG" 2>&1 \
    || { tail -n 40 "$LOG" >&2; echo "build_apex: apex's build failed (above; all of it:" \
         "$LOG)" >&2; exit 1; }
"$PYTHON" - <<'PY'
import sys

from megatron.core.tensor_parallel import layers

if not layers._grad_accum_fusion_available:
    print("build_apex: apex built, but megatron-core still cannot import "
          "fused_weight_gradient_mlp_cuda (see the build output above)", file=sys.stderr)
    sys.exit(1)
print("build_apex: fused_weight_gradient_mlp_cuda imports: megatron-core's "
      "gradient_accumulation_fusion can run here")
PY
