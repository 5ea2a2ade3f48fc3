"""A TP=2 engine (in-process engine core, one worker process per rank through vLLM's mp
executor) synced shard-to-shard through the worker extension and the real sync group: each
rank receives only its own shard. Also: failures come back named and the engine stays usable
(a worker RPC never raises, so vLLM's reply queues stay in step) — a plan one rank cannot
take fails every rank at once, an update vLLM cannot send leaves no update session open, a
corrupted install fails the sync's digest check, a plan that leaves a parameter unwritten is
refused as the engine joins — and a torn-down sync group can be re-formed."""

from __future__ import annotations

import time
from dataclasses import fields, replace

import pytest
import torch

from mcore_rl.layouts import hf_shards, vllm_shards
from mcore_rl.models.hf_reference import greedy_generate
from mcore_rl.resharding import Plan, SyncError, build_plan
from mcore_rl.rollout import RolloutConfig, RolloutEngine, RolloutError, SamplingConfig

from .helpers import MAX_MODEL_LEN, SPEC, Trainer, hf_model_with, hf_state, perturbed, prompts

GREEDY = SamplingConfig(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def engine(micro_dir):
    eng = RolloutEngine(micro_dir, RolloutConfig(tp=2, max_model_len=MAX_MODEL_LEN,
                                                 kv_cache_gib=0.25, block_size=32),
                        call_timeout_s=600.0)
    print(f"TP=2 (mp executor) start-up: {eng.startup_s:.1f} s")
    yield eng
    start = time.perf_counter()
    eng.shutdown()
    print(f"TP=2 shutdown: {time.perf_counter() - start:.1f} s")


def _backend(worker):
    engine = worker.weight_transfer_engine
    return type(engine).__name__, str(engine.device)


def greedy_tokens(engine, ps):
    return [list(samples[0].token_ids) for samples in engine.generate(ps, GREEDY)]


def hf_greedy(model_dir, state, ps):
    return greedy_generate(hf_model_with(model_dir, state), ps, max_new_tokens=10)


def test_tp2_sync_gives_each_rank_only_its_shard(engine, micro_dir):
    ps = prompts(4, 40, seed=5)
    w0 = hf_state(micro_dir)
    w1 = perturbed(w0, seed=3)
    g0 = greedy_tokens(engine, ps)
    assert g0 == hf_greedy(micro_dir, w0, ps)

    trainer = Trainer(tp=2)
    engine.check_shapes([trainer.plan.dst_shapes[1 + r] for r in range(2)])
    # Each worker process (spawned by vLLM) built mcore-rl's backend through the entry point,
    # on the device vLLM gave it.
    assert engine.llm.collective_rpc(_backend) == [("ShardTransferEngine", "cpu")] * 2
    start = time.perf_counter()
    trainer.connect(engine)
    joined = time.perf_counter() - start
    report, stats = trainer.sync(engine, w1)
    print(f"TP=2 join {joined * 1e3:.0f} ms; sync: {report.as_dict()}; trainer: "
          f"{stats}")
    model_bytes = sum(t.numel() * 4 for t in w1.values())
    for rank in report.ranks:
        assert set(rank.names) == trainer.plan.expected_names(rank.sync_rank)
        # Half of attention / MLP / padded vocab plus the replicated norms: ~52 %, not 100 %.
        assert 0.45 * model_bytes < rank.bytes_received < 0.6 * model_bytes
    assert greedy_tokens(engine, ps) == hf_greedy(micro_dir, w1, ps)  # cached prompts too

    trainer.sync(engine, w0)
    assert greedy_tokens(engine, ps) == g0  # = the engine as loaded from the folder
    trainer.disconnect(engine)


class _Unsendable(Plan):
    """A plan vLLM's multiprocess executor cannot pickle to its workers: `update_weights`
    raises in the caller, before any worker sees it."""

    def __reduce_ex__(self, protocol):
        raise TypeError("this plan cannot be pickled")


def test_failures_are_named_and_the_group_can_be_re_formed(engine, micro_dir):
    ps = prompts(2, 12, seed=6)
    w1 = perturbed(hf_state(micro_dir), seed=4)
    trainer = Trainer(tp=2, timeout_s=3.0)  # group/recv deadline: 3 s
    trainer.connect(engine)

    # N6: a plan whose shapes fit TP rank 0 but not TP rank 1 (sync rank 2). Rank 1 still
    # joins the group's plan check, carrying its verdict: every rank — the trainer, the
    # healthy rank 0 — fails at once naming rank 1 and the tensor, not at the 3 s deadline.
    shapes = {r: dict(s) for r, s in trainer.plan.dst_shapes.items()}
    shapes[2]["model.norm.weight"] = (64,)
    wrong = replace(trainer.plan, dst_shapes=shapes)
    refused = (r"the plan does not fit inference rank 1 \(engine0 tp1\): the plan does not "
               r"match this rank's parameters: \['model.norm.weight: plan \(64,\) vs vLLM "
               r"\(128,\)'\]")
    start = time.perf_counter()
    engine.begin_sync(wrong)
    with pytest.raises(SyncError, match=r"^sync rank 0: " + refused):
        trainer.channels.verify(wrong)
    assert time.perf_counter() - start < 3.0
    with pytest.raises(RolloutError, match=r"rollout engine 0 tp rank 0, sync: update_weights "
                                           r"failed: SyncError: sync rank 1: " + refused):
        engine.finish_sync()
    # Replies are still in step: the next RPC gets its own answers.
    assert engine.describe_shards()[1]["model.norm.weight"] == (128,)

    # The trainer never sends: the workers' deadline fires and the error names the phase.
    start = time.perf_counter()
    engine.begin_sync(trainer.plan, timeout_s=3.0)
    with pytest.raises(RolloutError, match=r"tp rank 0, sync: update_weights failed: SyncError"):
        engine.finish_sync()
    assert time.perf_counter() - start < 15.0

    # Tear the group down, form a new one (new prefix), and sync for real.
    trainer.disconnect(engine)
    trainer.connect(engine)

    # N7: vLLM cannot send this update to its workers (update_weights raises before any
    # worker sees it). The engine ends the workers' update sessions, so the next one starts.
    engine.begin_sync(_Unsendable(**{f.name: getattr(trainer.plan, f.name)
                                     for f in fields(Plan)}))
    with pytest.raises(RolloutError, match="weight update failed: TypeError: this plan cannot "
                                           "be pickled"):
        engine.finish_sync()

    # Every sync is verified: one bit of one tensor installed wrong on TP rank 1 fails the
    # sync on every rank, in one line naming the tensor and the ranks.
    corrupted = "model.layers.1.self_attn.o_proj.weight"
    mismatch = (rf"weight sync verification failed: {corrupted} as installed on inference "
                r"rank 1 \(engine0 tp1\) differs from what training rank 0 \(hf\) sent$")
    engine.begin_sync(trainer.plan, corrupt=(2, corrupted))
    with pytest.raises(SyncError, match=r"^" + mismatch):
        trainer.channels.verify(trainer.plan)
        trainer.channels.send(trainer.plan, w1, dtype=torch.float32, timeout_s=3.0)
    with pytest.raises(RolloutError, match=r"tp rank 0, sync: update_weights failed: SyncError: "
                                           + mismatch) as failed:
        engine.finish_sync()
    assert "\n" not in str(failed.value)

    # The group is intact (every rank compared): the next sync installs exactly.
    report, stats = trainer.sync(engine, w1)
    assert greedy_tokens(engine, ps) == hf_greedy(micro_dir, w1, ps)
    assert stats["digest_seconds"] > 0 and all(r.digest_seconds > 0 for r in report.ranks)
    trainer.disconnect(engine)

    # N8: a plan that never writes one of vLLM's parameters is refused as the engine joins,
    # in one line naming it (at a level-2 wake it would hold garbage).
    dst = vllm_shards(SPEC, 2)
    for rank in dst.ranks.values():
        del rank["model.norm.weight"]
    uncovered = Trainer(tp=2, timeout_s=3.0, coverage=build_plan(hf_shards(SPEC), dst))
    with pytest.raises(RolloutError, match=r"^rollout engine 0 tp rank 0, sync: "
                                           r"init_weight_transfer_engine failed: ValueError: "
                                           r"sync rank 1: the sync plan never writes 1 vLLM "
                                           r"parameters \(stale weights; garbage after a "
                                           r"level-2 wake\): \['model.norm.weight'\]$"):
        uncovered.connect(engine)
    uncovered.disconnect(engine)


def test_tp2_ipc_refit_installs_exactly(engine, micro_dir):
    """The colocated path: each worker maps the trainer's shared staging buffer and copies
    its shard out of it, round by round; the install is the same code as for p2p."""
    ps = prompts(3, 20, seed=8)
    w2 = perturbed(hf_state(micro_dir), seed=9)
    trainer = Trainer(tp=2, transport="ipc")
    trainer.connect(engine)
    try:
        report, stats = trainer.sync(engine, w2)
        assert stats["bytes_sent_ipc"] == stats["bytes_sent"] > 0
        assert 0 < stats["peak_extra_bytes"] <= trainer.plan.bucket_bytes  # one buffer
        for rank in report.ranks:
            assert set(rank.names) == trainer.plan.expected_names(rank.sync_rank)
            assert rank.peak_extra_bytes == 0  # copied straight into the shards
        assert greedy_tokens(engine, ps) == hf_greedy(micro_dir, w2, ps)
        trainer.sync(engine, hf_state(micro_dir))  # the staging buffer is reused
        assert greedy_tokens(engine, ps) == hf_greedy(micro_dir, hf_state(micro_dir), ps)
    finally:
        trainer.disconnect(engine)
