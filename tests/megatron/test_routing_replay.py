"""MoE routing replay on a Megatron Qwen3-MoE (megatron/routing_replay.py): a forward records
each token's experts; after the router weights move, a forward that replays the recording
gives HF's logits computed with those experts forced (and differs from the free forward, whose
routing flipped); the flips are counted. Both of megatron's softmax orders (HF's
norm_topk_prob false and true)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_twins import gpu_marks, join_world, spawn_env
from hf_weights import random_hf_weights
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.gpt import te_importable
from mcore_rl.models.presets import get_preset

MICRO = get_preset("micro")
QWEN3_MOE = MICRO.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                        rope_theta=1e6, norm_eps=1e-6, num_experts=4, moe_ffn=64,
                        experts_per_token=2, norm_topk_prob=False)
TOKENS = torch.randint(0, MICRO.vocab, (2, 24), generator=torch.Generator().manual_seed(3))


def perturbed_routers(weights: dict[str, torch.Tensor], scale: float = 0.5):
    gen = torch.Generator().manual_seed(7)
    return {k: v + scale * torch.randn(v.shape, generator=gen) if k.endswith("mlp.gate.weight")
            else v for k, v in weights.items()}


def _megatron_runs(rank, world, spec, weights, moved, device="cpu", layer_spec="local"):
    """Record on `weights`; then on `moved` (the routers perturbed): the free forward, its
    routing, and the forward replaying the first recording. Routing per row [b, s, L, k]. On
    `device` with megatron's `layer_spec`; results on the host."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron import routing_replay as rr
    from mcore_rl.megatron.train import MicroBatch, forward_logits
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups

    on = join_world(rank, world, device)
    parallel = ParallelConfig()
    groups = init_training_groups(parallel, device=str(on))
    (chunk,) = build_gpt_model(spec, parallel, groups, layer_spec=layer_spec)
    chunk.eval()
    rr.install_replay([chunk])
    tokens = TOKENS.to(on)
    batch = MicroBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones(TOKENS.shape, device=on))
    shards = megatron_shards(spec, parallel, layer_spec=layer_spec)

    def forward(state):
        load_chunks([chunk], materialize_rank(shards, rank, lambda n: torch.from_numpy(state[n])),
                    None)
        return forward_logits([chunk], [batch], vocab=spec.vocab, groups=groups)[0].cpu()

    with rr.recording(chunk):
        forward(weights)
    old = rr.recorded(chunk).cpu()
    with rr.recording(chunk):
        free = forward(moved)
    fresh = rr.recorded(chunk).cpu()
    rr.flip_counts([chunk])  # counts from here on
    with rr.replaying(chunk, old):
        replayed = forward(moved)
    first_layer_flips = int(chunk.decoder.layers[0].mlp.router.router_replay.flips)
    flips, tokens, seen = rr.flip_counts([chunk])
    b = TOKENS.shape[0]
    # a rollout's routing has no row for some positions (-1): their routers choose
    given = rr.row_order(old, b).clone()
    given[1, -6:] = -1
    with rr.replaying(chunk, rr.router_order(given)):
        partly = forward(moved)
    return {"old": rr.row_order(old, b).numpy(), "fresh": rr.row_order(fresh, b).numpy(),
            "free": free.numpy(), "replayed": replayed.numpy(), "flips": flips,
            "tokens": tokens, "seen": seen, "first_layer_flips": first_layer_flips,
            "given": given.numpy(), "partly": partly.numpy(),
            "partly_counts": rr.flip_counts([chunk])}


def _hf_logits(spec, weights, tmp, forced: np.ndarray | None = None) -> np.ndarray:
    """HF's logits; `forced` [b, s, L, k]: every layer's router takes those experts (its
    softmax still computed from its own logits)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.hf_factory import hf_config_from_spec

    hf_config_from_spec(spec).save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    if forced is not None:
        for index, layer in enumerate(model.model.layers):
            layer.mlp.gate.forward = _forced_router(layer.mlp.gate, forced[:, :, index])
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _forced_router(gate, experts: np.ndarray):
    """HF's router taking `experts` [b, s, k] (a token's -1 row: its own top-k)."""
    chosen = torch.from_numpy(experts).reshape(-1, experts.shape[-1]).long()  # batch-major

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.weight.shape[1]),
                                            gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = probs.topk(chosen.shape[-1], dim=-1).indices
        top = probs.gather(1, torch.where(chosen >= 0, chosen, own))
        if gate.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), torch.where(chosen >= 0, chosen, own)

    return forward


TWIN = ("tests/megatron/test_routing_replay.py::"
        "test_replayed_routing_gives_hf_logits_with_the_recorded_experts[cpu-False]")
DEVICES = [
    pytest.param("cpu", "local", id="cpu"),
    pytest.param("cuda", "local", id="cuda", marks=gpu_marks(TWIN)),
    pytest.param("cuda", "te", id="cuda-te", marks=[*gpu_marks(TWIN), pytest.mark.skipif(
        not te_importable(), reason="TransformerEngine is not importable here: the TE spec's "
        "router is megatron-core's TopKRouter, as in the local spec")]),
]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("device,layer_spec", DEVICES)
def test_replayed_routing_gives_hf_logits_with_the_recorded_experts(tmp_path, norm_topk_prob,
                                                                    device, layer_spec):
    spec = QWEN3_MOE.with_(norm_topk_prob=norm_topk_prob)
    weights = random_hf_weights(spec, seed=11)
    moved = perturbed_routers(weights)
    (run,) = run_on_ranks(_megatron_runs, 1, spec, {k: v.numpy() for k, v in weights.items()},
                          {k: v.numpy() for k, v in moved.items()}, device, layer_spec,
                          init_default_group=False, env=spawn_env(device), timeout_s=300)
    # the recorded routing is HF's on the original weights, the fresh one HF's on the moved
    hf_old = _hf_logits(spec, weights, tmp_path / "old", forced=run["old"])
    np.testing.assert_allclose(hf_old, _hf_logits(spec, weights, tmp_path / "base"), atol=1e-5)
    differs = (np.sort(run["old"], -1) != np.sort(run["fresh"], -1)).any(-1)
    assert differs.any()  # moving the routers flipped some tokens' experts
    # the replaying forward counts the tokens whose own choice differs from the replayed one:
    # at the first layer (same input as the free forward) exactly those that flipped; later
    # layers see the replayed layers' outputs
    assert run["first_layer_flips"] == int(differs[:, :, 0].sum()) > 0
    assert run["tokens"] == differs.size and 0 < run["flips"] <= differs.size
    assert run["seen"] == differs.size  # the counts were reset before the replaying forward
    np.testing.assert_allclose(run["free"], _hf_logits(spec, moved, tmp_path / "free"),
                               atol=1e-4)
    np.testing.assert_allclose(run["replayed"],
                               _hf_logits(spec, moved, tmp_path / "forced", forced=run["old"]),
                               atol=1e-4)
    assert np.abs(run["replayed"] - run["free"]).max() > 1e-3
    # positions without a row route themselves; the others are replayed and counted
    np.testing.assert_allclose(run["partly"],
                               _hf_logits(spec, moved, tmp_path / "partly", forced=run["given"]),
                               atol=1e-4)
    flips, replayed, seen = run["partly_counts"]
    assert replayed == int((run["given"][..., 0] >= 0).sum()) == differs.size - 6 * differs.shape[2]
    assert seen == differs.size and 0 < flips <= replayed


def test_token_orders_round_trip():
    from mcore_rl.megatron.routing_replay import router_order, row_order

    rows = torch.arange(2 * 5 * 3 * 2).reshape(2, 5, 3, 2)
    tokens = router_order(rows)
    assert tokens.shape == (3, 10, 2)
    assert torch.equal(tokens[1, 1], rows[1, 0, 1])  # sequence-major: token (s=0, b=1)
    assert torch.equal(row_order(tokens, 2), rows)


# --- the passes on training grids -------------------------------------------------------------

ROWS, SEQ = 4, 16
GRID_TOKENS = torch.randint(0, MICRO.vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
GRID_MASK = (torch.arange(SEQ) < torch.tensor([[16], [11], [13], [8]])).float()  # valid prefixes


def _grid_passes(rank, world, spec, parallel_kw, weights, moved, dispatcher, packed,
                 recompute="none"):
    """On a grid: record routing in the π_old pass (`compute_logprobs(routing_out=...)`) on
    `weights`; then on `moved`, the free and the replayed log-probs. This DP slice's rows (last
    stage, TP rank 0), routing [rows, s, layers, k] and the replay's flip counts."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron import routing_replay as rr
    from mcore_rl.megatron.config import TrainConfig
    from mcore_rl.megatron.packing import pack, plan_packing, unpack
    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.megatron.policy import PolicyBatch, compute_logprobs, policy_update
    from mcore_rl.megatron.train import MicroBatch, setup_trainer
    from mcore_rl.models.gpt import load_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import Axis, init_training_groups

    parallel = ParallelConfig(**parallel_kw)
    groups = init_training_groups(parallel)
    shards = megatron_shards(spec, parallel)

    def load(chunks, state):
        load_chunks(chunks, materialize_rank(shards, rank, lambda n: torch.from_numpy(state[n])),
                    parallel.vpp)

    train = TrainConfig(micro_batch_size=1, seq_len=SEQ, moe_dispatcher=dispatcher,
                        recompute=recompute)
    trainer = setup_trainer(spec, groups, train, load_weights=lambda c: load(c, weights))
    rr.install_replay(trainer.unwrapped())
    per = ROWS // parallel.dp
    mine = slice(groups.rank_in(Axis.DP) * per, (groups.rank_in(Axis.DP) + 1) * per)
    rows = {"tokens": GRID_TOKENS[mine], "labels": GRID_TOKENS[mine],
            "loss_mask": GRID_MASK[mine]}
    plan = plan_packing([int(m.sum()) for m in GRID_MASK[mine]], 2 * SEQ, seq_len=SEQ,
                        multiple=parallel.tp) if packed else None

    def passes(tensors, routing_out=None):
        if plan is None:
            batches = [MicroBatch(**{k: v[i:i + 1] for k, v in tensors.items()})
                       for i in range(per)]
        else:
            batches = [MicroBatch(**p) for p in pack(tensors, plan)]
        out = compute_logprobs(trainer, batches, routing_out=routing_out)
        if routing_out is not None:
            routing_out[:] = [unpack(routing_out, plan) if plan else torch.cat(routing_out)]
        if out is None:
            return None
        return unpack(out, plan) if plan else torch.cat(out)

    recorded = []
    old = passes(rows, recorded)
    load(trainer.unwrapped(), moved)
    free = passes(rows)
    rr.flip_counts(trainer.unwrapped())  # counts from here on
    replayed = passes({**rows, "routing": recorded[0]})
    flips = rr.flip_counts(trainer.unwrapped())
    # an update replaying the routing: its forward reproduces the replayed log-probs (π_old
    # here), so nothing moved before the step
    old_logp = replayed if replayed is not None else torch.zeros(per, SEQ)
    adv = torch.linspace(-1, 1, ROWS)[mine, None].expand(per, SEQ)
    update = policy_update(trainer, [PolicyBatch(
        GRID_TOKENS[mine][i:i + 1], GRID_TOKENS[mine][i:i + 1], GRID_MASK[mine][i:i + 1],
        old_logp[i:i + 1], adv[i:i + 1], routing=recorded[0][i:i + 1]) for i in range(per)],
        AlgorithmConfig(clip_c=None))
    last = groups.is_last_stage and groups.rank_in(Axis.TP) == 0
    return {"dp": groups.rank_in(Axis.DP), "stage": groups.rank_in(Axis.PP),
            "tp": groups.rank_in(Axis.TP), "routing": recorded[0].numpy(),
            "old": old.numpy() if last else None, "free": free.numpy() if last else None,
            "replayed": replayed.numpy() if last else None, "flips": flips,
            "update": {k: update[k] for k in ("pg_loss", "grad_norm")},
            "moved_before_step": update["logp_moved_local"] if last else None}


def _assembled(results, key):
    """The rows of every DP slice, in order (from the ranks that return them)."""
    by_dp = {r["dp"]: r[key] for r in results if r[key] is not None}
    return np.concatenate([by_dp[d] for d in sorted(by_dp)])


def _routing(results):
    """Every DP slice's routing, all layers (each stage records its own, -1 elsewhere)."""
    out = {}
    for r in results:
        if r["tp"] == 0:
            part = out.setdefault(r["dp"], np.full_like(r["routing"], -1))
            np.maximum(part, r["routing"], out=part)
    return np.concatenate([out[d] for d in sorted(out)])


@pytest.fixture(scope="module")
def grid_runs():
    spec = QWEN3_MOE.with_(norm_topk_prob=True)
    weights = random_hf_weights(spec, seed=12)
    moved = perturbed_routers(weights)
    args = (spec, {k: v.numpy() for k, v in weights.items()},
            {k: v.numpy() for k, v in moved.items()})
    runs = {"one": run_on_ranks(_grid_passes, 1, args[0], {}, *args[1:], "allgather", False,
                                timeout_s=300),
            "packed": run_on_ranks(_grid_passes, 1, args[0], {}, *args[1:], "allgather", True,
                                   timeout_s=300),
            # alltoall at tp > 1 gathers uneven token counts, which gloo cannot
            "tp2ep2": run_on_ranks(_grid_passes, 4, args[0],
                                   dict(tp=2, dp=2, ep=2, sequence_parallel=True), *args[1:],
                                   "allgather", False, timeout_s=600),
            "ep2_alltoall": run_on_ranks(_grid_passes, 2, args[0], dict(dp=2, ep=2), *args[1:],
                                         "alltoall", False, timeout_s=300),
            "pp2": run_on_ranks(_grid_passes, 2, args[0], dict(pp=2), *args[1:], "allgather",
                                False, timeout_s=300),
            # a recomputed layer's forward runs again in backward: it replays the same experts
            "recompute": run_on_ranks(_grid_passes, 1, args[0], {}, *args[1:], "allgather",
                                      False, "full", timeout_s=300)}
    return runs


def test_one_process_replay_fixes_the_recorded_experts(grid_runs):
    (one,) = grid_runs["one"]
    valid = GRID_MASK.numpy() > 0
    assert np.abs(one["old"] - one["free"])[valid].max() > 1e-3  # the moved routers matter
    assert np.abs(one["replayed"] - one["free"])[valid].max() > 1e-3
    flips, tokens, seen = one["flips"]
    assert 0 < flips < tokens == seen == ROWS * SEQ * QWEN3_MOE.layers
    assert one["moved_before_step"] < 1e-5  # the update's forward replayed the routing


@pytest.mark.parametrize("grid", ["packed", "tp2ep2", "ep2_alltoall", "pp2", "recompute"])
def test_grids_and_packing_record_and_replay_as_one_process(grid_runs, grid):
    """Routing recorded on the grid (every stage's layers, SP positions gathered over TP) and
    log-probs with it replayed equal one process's; packed rows equal padded ones."""
    (one,), runs = grid_runs["one"], grid_runs[grid]
    valid = GRID_MASK.numpy() > 0
    routing, want = _routing(runs), _routing([one])
    # every valid token's experts agree (a packed row's padding carries no routing)
    assert (np.sort(routing, -1) == np.sort(want, -1))[valid].all()
    for key in ("old", "free", "replayed"):
        np.testing.assert_allclose(_assembled(runs, key)[valid], _assembled([one], key)[valid],
                                   atol=2e-5, err_msg=key)
    if grid != "packed":  # the update with the routing replayed: the same step
        for run in runs:
            assert run["update"] == pytest.approx(one["update"], rel=1e-4, abs=1e-6)
            assert run["moved_before_step"] is None or run["moved_before_step"] < 1e-5
