"""LoRA adapters on Megatron's TP shards (mcore_rl/megatron/lora.py) against one process:
the micro Llama with HF weights and adapters on QKV, attention output, FC1, FC2 and the output
layer (its rows the padded vocabulary), at TP1,
at TP2, and at TP2 with sequence parallelism. Every grid gives TP1's logits and loss, and
adapter gradients equal to TP1's shard for shard; W + scale·B·A merged on each rank's own shard
is TP1's merged weight's shard, bit for bit. A fresh adapter (B = 0) and disabled adapters leave
the base model's logits exactly; only the adapters train.

B is made non-zero before the forward (a fresh B is zero, which would hide a wrong split):
a column linear's B from its own weight rows (so every grid holds the rows of TP1's B that
match its rows of W: linear_fc1's [gate_t; up_t] are no contiguous slice of TP1's rows), a row
linear's whole B from a seeded generator. Rows are matched between grids by W's rows (random
HF weights: unique)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.config import ConfigError
from mcore_rl.megatron.config import LORA_HEAD, LORA_TARGETS, LoRAConfig

LORA = LoRAConfig(rank=4, alpha=8.0, targets=(*LORA_TARGETS, LORA_HEAD))
TOKENS = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(3))
# per-token advantages: the step's loss is a plain policy gradient, -mean(A · log π(label))
ADVANTAGES = torch.randn(2, 16, generator=torch.Generator().manual_seed(5))


def _lora_step(rank: int, world: int, sequence_parallel: bool) -> dict:
    from hf_weights import random_hf_weights
    from megatron.core import tensor_parallel

    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron.lora import adapters_disabled, attach_lora, lora_linears, \
        merged_weight
    from mcore_rl.megatron.train import token_logprobs
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import Axis, init_training_groups

    spec = get_preset("micro")
    parallel = ParallelConfig(tp=world, sequence_parallel=sequence_parallel)
    groups = init_training_groups(parallel)
    tp_group = groups.group(Axis.TP)
    weights = random_hf_weights(spec)
    chunks = build_gpt_model(spec, parallel, groups)
    load_chunks(chunks, materialize_rank(megatron_shards(spec, parallel), rank,
                                         weights.__getitem__), None)
    (model,) = chunks
    tokens, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def logits_and_loss():
        local = model(tokens, positions, None)
        logp = token_logprobs(local, labels, spec.vocab, groups.rank_in(Axis.TP))
        loss = -(ADVANTAGES * logp).mean()
        full = tensor_parallel.gather_from_tensor_model_parallel_region(local, group=tp_group)
        return full[..., :spec.vocab], loss

    with torch.no_grad():
        base, _ = logits_and_loss()
    adapters = attach_lora(chunks, LORA)
    with torch.no_grad():
        fresh, _ = logits_and_loss()
        gen = torch.Generator().manual_seed(11)
        for _, linear in lora_linears(chunks):
            b = linear.lora.lora_b
            b.copy_(0.5 * linear.weight[:, :LORA.rank] if linear.lora.kind == "column"
                    else 0.05 * torch.randn(b.shape, generator=gen))
    logits, loss = logits_and_loss()
    loss.backward()
    if sequence_parallel:  # what megatron's finalize_model_grads does for such parameters
        for adapter in adapters:
            for p in adapter.parameters():
                if getattr(p, "sequence_parallel", False):
                    torch.distributed.all_reduce(p.grad, group=tp_group)
    with torch.no_grad(), adapters_disabled(chunks):
        disabled, _ = logits_and_loss()
    linears = {}
    for name, linear in lora_linears(chunks):
        a = linear.lora
        linears[name] = {"kind": a.kind, "w": linear.weight.detach().clone(),
                         "a": a.lora_a.detach().clone(), "b": a.lora_b.detach().clone(),
                         "da": a.lora_a.grad.clone(), "db": a.lora_b.grad.clone(),
                         "merged": merged_weight(linear).detach().clone(),
                         "tp_split": [getattr(p, "tensor_model_parallel", False)
                                      for p in (a.lora_a, a.lora_b)]}
    return _as_numpy({
        "logits": logits.detach(), "loss": float(loss), "base": base, "fresh": fresh,
        "disabled": disabled, "linears": linears,
        "adapter_keys": sorted(k for k in model.state_dict() if ".lora." in k),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)})


def _as_numpy(obj):
    """Tensors leave a rank as numpy arrays (torch's own pickling shares them by fd)."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _as_numpy(v) for k, v in obj.items()}
    return obj


def _as_torch(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _as_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_torch(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def runs():
    return {grid: _as_torch(run_on_ranks(_lora_step, world, sp, timeout_s=240))
            for grid, world, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2-sp", 2, True))}


def _row_index(reference_w: torch.Tensor, w: torch.Tensor) -> list[int]:
    """For each row of a shard `w`, its row in the TP1 weight."""
    where = {tuple(row.tolist()): i for i, row in enumerate(reference_w)}
    return [where[tuple(row.tolist())] for row in w]


@pytest.mark.parametrize("grid", ["tp2", "tp2-sp"])
def test_adapters_on_tp_shards_equal_one_process(runs, grid):
    (ref,) = runs["tp1"]
    for out in runs[grid]:
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert out["linears"].keys() == ref["linears"].keys()
        for name, mine in out["linears"].items():
            full = ref["linears"][name]
            if mine["kind"] == "column":  # A whole; B (and W) rows a subset of TP1's
                rows = _row_index(full["w"], mine["w"])
                torch.testing.assert_close(mine["da"], full["da"], rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(mine["db"], full["db"][rows], rtol=1e-4, atol=1e-6)
                assert torch.equal(mine["merged"], full["merged"][rows]), name
                assert mine["tp_split"] == [False, True]
            else:  # A's columns the rank's slice of TP1's; B whole
                cols = mine["a"].shape[1]
                start = [i for i in range(0, full["a"].shape[1], cols)
                         if torch.equal(full["w"][:, i:i + cols], mine["w"])]
                assert len(start) == 1, name
                sl = slice(start[0], start[0] + cols)
                assert torch.equal(mine["a"], full["a"][:, sl])
                torch.testing.assert_close(mine["da"], full["da"][:, sl], rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(mine["db"], full["db"], rtol=1e-4, atol=1e-6)
                assert torch.equal(mine["merged"], full["merged"][:, sl]), name
                assert mine["tp_split"] == [True, False]


def test_fresh_and_disabled_adapters_leave_the_base_model(runs):
    for grid in runs.values():
        for out in grid:
            assert torch.equal(out["fresh"], out["base"])
            assert torch.equal(out["disabled"], out["base"])
            assert not torch.equal(out["logits"], out["base"])  # the adapters do act


def test_only_the_adapters_train(runs):
    (ref,) = runs["tp1"]
    assert len(ref["trainable"]) == 2 * 4 * 4 + 2  # A and B, 4 linears, 4 layers; the head
    assert all(n.endswith((".lora.lora_a", ".lora.lora_b")) for n in ref["trainable"])


def test_bad_lora_configs_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="rank=-1: must be >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(ConfigError, match=r"targets=\['q_proj'\]: each one of linear_qkv, "):
        LoRAConfig(rank=4, targets=("q_proj",))
    with pytest.raises(ConfigError, match=r"alpha=0.0: must be > 0"):
        LoRAConfig(rank=4, alpha=0.0)


def _lora_trainer(rank: int, parallel, moe: bool = False):
    """The micro Llama (`moe`: a micro Qwen3-MoE, adapters on attention: routed experts carry
    none) with HF weights (frozen) and LORA adapters on `parallel`, and four micro batches of
    the fixed policy batch. Returns (trainer, batches, base shards)."""
    from hf_weights import random_hf_weights

    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
    from mcore_rl.megatron.policy import PolicyBatch
    from mcore_rl.megatron.train import setup_trainer
    from mcore_rl.models.gpt import load_chunks
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.groups import init_training_groups
    from tests.support.batches import fixed_batch

    spec, lora = get_preset("micro"), LORA
    if moe:
        spec = spec.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                          num_experts=4, moe_ffn=64, experts_per_token=2, norm_topk_prob=True)
        lora = LoRAConfig(rank=LORA.rank, alpha=LORA.alpha,
                          targets=("linear_qkv", "linear_proj"))
    groups = init_training_groups(parallel)
    weights = random_hf_weights(spec)
    base = materialize_rank(megatron_shards(spec, parallel), rank, weights.__getitem__)
    train = TrainConfig(micro_batch_size=2, num_micro_batches=4, seq_len=12,
                        optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=1e9))
    trainer = setup_trainer(spec, groups, train, lambda c: load_chunks(c, base, parallel.vpp),
                            lora=lora)
    tokens, labels, mask, adv = fixed_batch(spec)
    batches = [PolicyBatch(tokens[r], labels[r], mask[r], torch.zeros(2, 12), adv[r])
               for r in (slice(i, i + 2) for i in range(0, 8, 2))]
    return trainer, batches, base


def _lora_updates(rank: int, world: int, grid: dict | None = None, moe: bool = False) -> dict:
    """Two policy updates of the micro Llama with adapters (and frozen HF weights) on a
    grid (default PP `world`; DP ranks all train the same micro batches): grad norms, every
    adapter afterwards by global name, and whether the base weights moved."""
    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.megatron.lora import named_adapters
    from mcore_rl.megatron.policy import policy_update
    from mcore_rl.parallel import ParallelConfig

    parallel = ParallelConfig(**(grid or {"pp": world}))
    trainer, batches, base = _lora_trainer(rank, parallel, moe)
    norms = [policy_update(trainer, batches, AlgorithmConfig(clip_c=None))["grad_norm"]
             for _ in range(2)]
    chunks = trainer.unwrapped()
    prefix = "model{v}." if parallel.vpp is not None else ""
    state = {prefix.format(v=v) + k: t.detach() for v, c in enumerate(chunks)
             for k, t in c.state_dict().items()
             if ".lora." not in k and not k.endswith("_extra_state")}
    return _as_numpy({
        "grad_norm": norms,
        "adapters": {f"{name}.{p}": getattr(a, p).detach().clone()
                     for name, a in named_adapters(chunks) for p in ("lora_a", "lora_b")},
        "base_moved": sorted(k for k, v in state.items() if not torch.equal(v, base[k])),
        "optimized": sum(p.numel() for g in trainer.optimizer.param_groups
                         for p in g["params"])})


@pytest.fixture(scope="module")
def one_process_updates():
    """`_lora_updates` in one process, launched once per `moe` value (every grid's reference:
    the same run each time)."""
    runs = {}

    def of(moe: bool) -> dict:
        if moe not in runs:
            (runs[moe],) = _as_torch(run_on_ranks(_lora_updates, 1, None, moe, timeout_s=240))
        return runs[moe]

    return of


@pytest.mark.parametrize("grid,moe", [({"pp": 2}, False), ({"pp": 2, "vpp": 2}, False),
                                      ({"dp": 2}, False), ({"dp": 2, "ep": 2}, True)],
                         ids=["pp2", "pp2-vpp2", "dp2", "moe-ep2"])
def test_lora_updates_on_pp_vpp_dp_ep_grids_equal_one_process_and_leave_the_base(
        one_process_updates, grid, moe):
    ref = one_process_updates(moe)
    pp2 = _as_torch(run_on_ranks(_lora_updates, 2, grid, moe, timeout_s=240))
    assert ref["grad_norm"][0] > 0 and ref["grad_norm"][1] > 0
    merged = {}
    for out in pp2:
        assert out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert out["base_moved"] == []  # frozen
        merged.update(out["adapters"])
    assert ref["base_moved"] == []
    # a MoE layer's MLP is routed experts: attention only; the dense model's head too
    adapted = 2 * 4 * 2 if moe else 2 * 4 * 4 + 2
    assert merged.keys() == ref["adapters"].keys() and len(merged) == adapted
    for name, tensor in ref["adapters"].items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6)
    assert any(t.abs().max() > 0 for k, t in ref["adapters"].items() if k.endswith("lora_b"))
    # the optimizer holds the adapters only: r·(in + out) per linear
    assert ref["optimized"] == sum(t.numel() for t in ref["adapters"].values())


def test_tp2_adapters_export_as_a_peft_adapter_that_gives_the_actors_logits(runs, tmp_path):
    """The TP2 ranks' adapter shards → PEFT adapter directory (assembled through the layouts
    derived from the weights') → PEFT loads it onto the HF base (the same HF weights) → HF's
    logits equal the TP2 actor's."""
    from hf_weights import random_hf_weights
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.conversion.peft_adapter import peft_tensors, write_peft_adapter
    from mcore_rl.layouts import megatron_shards
    from mcore_rl.layouts.lora import lora_shards
    from mcore_rl.models.hf_factory import hf_config_from_spec
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel import ParallelConfig

    spec = get_preset("micro")
    adapters = lora_shards(megatron_shards(spec, ParallelConfig(tp=2)), LORA.rank, LORA.targets)
    local = {rank: {f"{name}.lora.lora_{m}": out["linears"][name][m] for name in out["linears"]
                    for m in ("a", "b")} for rank, out in enumerate(runs["tp2"])}
    for rank, out in enumerate(runs["tp2"]):  # the layouts name the modules' own parameters
        assert out["adapter_keys"] == sorted(adapters.ranks[rank])
    tensors = peft_tensors(adapters, local)
    assert len(tensors) == 2 * 7 * spec.layers + 2  # A, B of q, k, v, o, gate, up, down; lm_head
    dst = write_peft_adapter(tmp_path / "adapter", tensors, rank=LORA.rank, alpha=LORA.alpha)
    assert sorted(p.name for p in dst.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32)
    base.load_state_dict(random_hf_weights(spec), strict=False)
    model = PeftModel.from_pretrained(base, str(dst))
    with torch.no_grad():
        logits = model(TOKENS[:, :-1]).logits
    torch.testing.assert_close(logits, runs["tp2"][0]["logits"], rtol=1e-4, atol=1e-4)
    with torch.no_grad(), model.disable_adapter():  # and the base is the base
        torch.testing.assert_close(model(TOKENS[:, :-1]).logits, runs["tp2"][0]["base"],
                                   rtol=1e-4, atol=1e-4)


def _shared_a(peft_name: str) -> str:
    """The megatron adapter whose A a PEFT module's lora_A is: q/k/v_proj share linear_qkv's,
    gate/up_proj share linear_fc1's; o_proj and down_proj have their own."""
    for shared, parts in (("qkv", ("q_proj", "k_proj", "v_proj")),
                          ("gate_up", ("gate_proj", "up_proj"))):
        for part in parts:
            peft_name = peft_name.replace(f".{part}.", f".{shared}.")
    return peft_name


@pytest.mark.parametrize("grid", ["tp1", "tp2"])
def test_adapter_gradients_equal_pefts_on_hf_for_a_policy_gradient_step(runs, grid, tmp_path):
    """#48: PEFT's adapters on the HF model, with our adapters' values, and the same
    policy-gradient loss on the same batch give our adapter gradients: every lora_B's
    gradient is our B's rows for that module (assembled over the TP ranks); a lora_A shared
    in megatron (linear_qkv's by q/k/v, linear_fc1's by gate/up) gets the sum of the PEFT
    modules' lora_A gradients, each unshared one its own."""
    from collections import defaultdict

    from hf_weights import random_hf_weights
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.conversion.peft_adapter import peft_tensors, write_peft_adapter
    from mcore_rl.layouts import megatron_shards
    from mcore_rl.layouts.lora import lora_shards
    from mcore_rl.models.hf_factory import hf_config_from_spec
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel import ParallelConfig

    spec, outs = get_preset("micro"), runs[grid]
    adapters = lora_shards(megatron_shards(spec, ParallelConfig(tp=len(outs))), LORA.rank,
                           LORA.targets)

    def assembled(prefix: str) -> dict[str, torch.Tensor]:  # values ("") or gradients ("d")
        return peft_tensors(adapters, {
            rank: {f"{name}.lora.lora_{m}": out["linears"][name][prefix + m]
                   for name in out["linears"] for m in ("a", "b")}
            for rank, out in enumerate(outs)})

    dst = write_peft_adapter(tmp_path / "adapter", assembled(""), rank=LORA.rank,
                             alpha=LORA.alpha)
    base = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32)
    base.load_state_dict(random_hf_weights(spec), strict=False)
    model = PeftModel.from_pretrained(base, str(dst), is_trainable=True)
    logits = model(TOKENS[:, :-1]).logits
    logp = torch.log_softmax(logits, -1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
    loss = -(ADVANTAGES * logp).mean()
    loss.backward()
    assert float(loss) == pytest.approx(outs[0]["loss"], rel=1e-5)
    peft = {n.replace(".default.", "."): p.grad for n, p in model.named_parameters()
            if p.requires_grad}
    ours = assembled("d")
    assert peft.keys() == ours.keys() and len(ours) == 2 * 7 * spec.layers + 2
    a_sums: dict[str, torch.Tensor] = defaultdict(lambda: 0)
    for name, grad in peft.items():
        if ".lora_A." in name:
            a_sums[_shared_a(name)] = a_sums[_shared_a(name)] + grad
    for name, grad in ours.items():
        want = a_sums[_shared_a(name)] if ".lora_A." in name else peft[name]
        assert want.abs().max() > 0, name
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=name)


def _lora_checkpoint(rank: int, world: int, ckpt_dir: str, mode: str) -> dict:
    """mode "save": two updates at TP `world`, save the role, then a third update; "resume":
    a fresh trainer at TP `world` loads it and takes the third update. Returns the adapters
    (this rank's shards) right after saving / loading and after the third update."""
    from pathlib import Path

    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.megatron.policy import policy_update
    from mcore_rl.megatron.role_checkpoint import load_role, save_role
    from mcore_rl.parallel import ParallelConfig

    trainer, batches, _ = _lora_trainer(rank, ParallelConfig(tp=world))

    def update():
        return policy_update(trainer, batches, AlgorithmConfig(clip_c=None))["grad_norm"]

    def adapters():
        return {k: v.detach().clone() for k, v in trainer.unwrapped()[0].state_dict().items()
                if ".lora." in k}

    if mode == "save":
        update(), update()
        save_role(trainer, Path(ckpt_dir), rank)
    else:
        load_role(trainer, Path(ckpt_dir), rank)
    at_checkpoint = adapters()
    norm = update()
    return _as_numpy({"at_checkpoint": at_checkpoint, "grad_norm": norm, "after": adapters()})


def test_lora_checkpoint_resumes_exactly_and_loads_on_another_grid(tmp_path, capsys):
    """Adapters are stored as their weights are (TP axis, fc1's B as [gate; up]): a TP2
    checkpoint resumes exactly at TP2 and loads at TP1 with the same PEFT tensors."""
    from mcore_rl.layouts import megatron_shards
    from mcore_rl.layouts.lora import lora_shards
    from mcore_rl.conversion.peft_adapter import peft_tensors
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel import ParallelConfig

    ckpt = str(tmp_path / "ckpt")
    saved = _as_torch(run_on_ranks(_lora_checkpoint, 2, ckpt, "save", timeout_s=240))
    resumed = _as_torch(run_on_ranks(_lora_checkpoint, 2, ckpt, "resume", timeout_s=240))
    for s, r in zip(saved, resumed):
        assert r["grad_norm"] == s["grad_norm"]
        for key in s["after"]:
            assert torch.equal(r["at_checkpoint"][key], s["at_checkpoint"][key]), key
            assert torch.equal(r["after"][key], s["after"][key]), key
    (tp1,) = _as_torch(run_on_ranks(_lora_checkpoint, 1, ckpt, "resume", timeout_s=240))

    def peft(grid, outs):
        adapters = lora_shards(megatron_shards(get_preset("micro"), grid), LORA.rank,
                               LORA.targets)
        return peft_tensors(adapters, {r: o["at_checkpoint"] for r, o in enumerate(outs)})

    two, one = peft(ParallelConfig(tp=2), saved), peft(ParallelConfig(), [tp1])
    assert two.keys() == one.keys()
    assert all(torch.equal(two[k], one[k]) for k in two)
    assert any(two[k].abs().max() > 0 for k in two if "lora_B" in k)
    assert tp1["grad_norm"] == pytest.approx(saved[0]["grad_norm"], rel=1e-5)
    # `convert mcore-to-peft`: the checkpoint's adapters as a PEFT adapter — PEFT's tensors
    from safetensors.torch import load_file

    from mcore_rl.conversion.peft_adapter import ADAPTER_WEIGHTS, mcore_to_peft
    from mcore_rl.models.hf_factory import hf_config_from_spec

    hf_config_from_spec(get_preset("micro")).save_pretrained(tmp_path / "base")
    peft_dir = mcore_to_peft(ckpt, tmp_path / "peft", hf_config=tmp_path / "base")
    exported = load_file(peft_dir / ADAPTER_WEIGHTS)
    assert exported.keys() == two.keys() and all(torch.equal(exported[k], two[k]) for k in two)
    from mcore_rl.cli import main

    argv = ["convert", "mcore-to-peft", ckpt, str(tmp_path / "peft"), "--hf-config",
            str(tmp_path / "base")]
    assert main(argv) == 2  # DST exists
    assert "already exists (pass --force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    # `convert mcore-to-hf`: the merged model, as PEFT merges the base and that adapter
    _merged_export_equals_peft_merge(ckpt, tmp_path)
    (tmp_path / "ckpt" / "lora.json").unlink()
    assert main(argv + ["--force"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("no lora.json (not a LoRA checkpoint: a run with actor.lora.rank > 0 "
                         "writes one beside its actor checkpoint)")
    # without lora.json the adapters' scale is unknown: refused, naming them
    from mcore_rl.conversion.convert import mcore_to_hf
    from mcore_rl.conversion.errors import ConversionError

    with pytest.raises(ConversionError, match=r": 10 LoRA adapter tensors \(e\.g\. decoder\."
                                              r"layers\.mlp\.linear_fc1\.lora\.lora_a\) but "
                                              r"no lora\.json"):
        mcore_to_hf(ckpt, tmp_path / "hf2", hf_config=tmp_path / "base", progress=False)
    assert not (tmp_path / "hf2").exists()


def _merged_export_equals_peft_merge(ckpt: str, tmp_path) -> None:
    """mcore-to-hf of the checkpoint = PEFT's merge_and_unload of the HF base (the weights the
    run started from) with the adapter mcore-to-peft wrote at tmp_path/peft."""
    from hf_weights import random_hf_weights
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.conversion.convert import mcore_to_hf
    from mcore_rl.models.hf_factory import hf_config_from_spec
    from mcore_rl.models.hf_weights import SafetensorsWeights
    from mcore_rl.models.presets import get_preset

    spec = get_preset("micro")
    report = mcore_to_hf(ckpt, tmp_path / "hf", hf_config=tmp_path / "base", progress=False)
    assert report.merged == 7 * spec.layers + 1  # and lm_head
    base = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32)
    base.load_state_dict(random_hf_weights(spec), strict=False)
    reference = PeftModel.from_pretrained(base, str(tmp_path / "peft")).merge_and_unload()
    want = {k: v.detach() for k, v in reference.state_dict().items()}
    merged = SafetensorsWeights(tmp_path / "hf")
    assert sorted(merged.names()) == sorted(want)
    for name in want:
        torch.testing.assert_close(merged.tensor(name), want[name], rtol=1e-6, atol=1e-6,
                                   msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.tensor(q), random_hf_weights(spec)[q])  # adapted


def test_the_rl_optimizer_takes_the_adapters_learning_rate():
    from mcore_rl.megatron.config import OptimizerConfig, TrainConfig

    train = TrainConfig(optimizer=OptimizerConfig(lr=1e-6, clip_grad=0.5))
    on = LoRAConfig(rank=4, lr=3e-3).rl_train(train)
    assert (on.optimizer.lr, on.optimizer.clip_grad) == (3e-3, 0.5)
    assert LoRAConfig().rl_train(train) is train  # off: the full fine-tune's
    assert LoRAConfig().lr == 1e-5


def test_a_layernorm_fused_linear_adapts_the_norms_output():
    """The te spec's linear_qkv / linear_fc1 (TE's LayerNormLinear) take the layer's input
    before their fused norm; their adapter multiplies what their weight does — the RMSNorm's
    output (HF's LlamaRMSNorm as the reference), with the model config megatron gets. A
    local-spec linear's input is already normalized. (The TE module itself needs a GPU.)"""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from mcore_rl.megatron.lora import adapter_input
    from mcore_rl.models.gpt import transformer_config_from_spec
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel import ParallelConfig

    spec = get_preset("micro")
    config = transformer_config_from_spec(spec, ParallelConfig(), device="cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, spec.hidden, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(spec.hidden, generator=gen)
    hf = LlamaRMSNorm(spec.hidden, eps=spec.norm_eps)
    hf.weight.data.copy_(weight)
    fused = SimpleNamespace(layer_norm_weight=weight, config=config)  # TE's attributes
    with torch.no_grad():
        torch.testing.assert_close(adapter_input(fused, x), hf(x), rtol=1e-6, atol=1e-6)
    assert adapter_input(SimpleNamespace(), x) is x
    with pytest.raises(ValueError, match="only RMSNorm"):
        adapter_input(SimpleNamespace(layer_norm_weight=weight, config=SimpleNamespace(
            normalization="LayerNorm", layernorm_zero_centered_gamma=False)), x)
