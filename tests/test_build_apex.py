"""scripts/build_apex.sh (N1): the build of apex's fused_weight_gradient_mlp_cuda, which
megatron-core's gradient_accumulation_fusion imports. The build itself needs CUDA; what runs
here is every refusal before it, each one line on stderr and exit 2, in the order apex's build
would fail — with nothing cloned or built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "build_apex.sh"


def _build(tmp_path: Path, cuda_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_HOME": str(cuda_home),
           "APEX_DIR": str(tmp_path / "apex"), "APEX_LOG": str(tmp_path / "apex.log")}
    env.pop("CUDA_PATH", None)
    env.pop("FORCE", None)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)


def _refusal(done: subprocess.CompletedProcess) -> str:
    """The one line the script refused with (torch may log warnings before it)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.startswith("build_apex: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _toolkit(root: Path, release: str, headers: bool) -> Path:
    """A CUDA toolkit's layout whose nvcc names `release` (with or without its headers)."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, "
                    f"V{release}.0'\n")
    nvcc.chmod(0o755)
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return root


def test_it_refuses_without_nvcc(tmp_path):
    refusal = _refusal(_build(tmp_path, tmp_path / "cuda"))
    assert refusal == (f"build_apex: no nvcc at {tmp_path}/cuda/bin/nvcc (CUDA_HOME="
                       f"{tmp_path}/cuda, from CUDA_HOME/CUDA_PATH): set CUDA_HOME to the CUDA "
                       "toolkit's root")
    assert not (tmp_path / "apex").exists() and not (tmp_path / "apex.log").exists()


def test_it_refuses_an_nvcc_without_the_toolkits_headers(tmp_path):
    """nvcc on PATH through a wrapper (/usr/local/bin/nvcc) makes torch's CUDA_HOME /usr/local,
    whose include/ has no CUDA headers: said before a long build fails on it."""
    home = _toolkit(tmp_path / "cuda", "12.8", headers=False)
    refusal = _refusal(_build(tmp_path, home))
    assert refusal == (f"build_apex: CUDA_HOME={home} (from CUDA_HOME/CUDA_PATH) has no "
                       "include/cuda_runtime.h: set CUDA_HOME to the CUDA toolkit's root "
                       "(e.g. /usr/local/cuda)")


def test_it_refuses_a_cpu_torch_or_a_cuda_release_unlike_torchs(tmp_path):
    """With a toolkit there: a CPU torch (this machine) is refused; a CUDA torch is refused
    when nvcc's release differs from the one torch was built with (apex's setup.py raises)."""
    home = _toolkit(tmp_path / "cuda", "0.1", headers=True)
    refusal = _refusal(_build(tmp_path, home))
    if torch.version.cuda is None:
        assert refusal == (f"build_apex: torch {torch.__version__} is a CPU build "
                           "(torch.version.cuda is None): apex's CUDA extensions need torch "
                           "built for CUDA")
    else:
        assert refusal.startswith(f"build_apex: nvcc at {home}/bin/nvcc is CUDA 0.1 but torch "
                                  f"{torch.__version__} was built with CUDA {torch.version.cuda}")
    assert not (tmp_path / "apex").exists()


def test_the_install_guide_runs_the_script():
    guide = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    assert "bash scripts/build_apex.sh" in guide
    assert os.access(SCRIPT, os.X_OK)
