"""A TP=2 engine serving the policy's LoRA adapter, synced through the real sync group: every
rank receives the adapter whole (vLLM's LoRA layers cut their own slices) and the engine then
samples with HF + PEFT's log-probs."""

from __future__ import annotations

import pytest

from mcore_rl.layouts import megatron_shards
from mcore_rl.layouts.lora import lora_shards, whole_adapters
from mcore_rl.megatron.config import LORA_TARGETS
from mcore_rl.models.hf_reference import load_hf_model
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.rollout import RolloutConfig, RolloutEngine

from .helpers import MAX_MODEL_LEN, SPEC, Trainer
from .test_engine_lora import LORA, adapter_tensors, peft_model, worst_gap


@pytest.fixture(scope="module")
def engine(micro_dir):
    eng = RolloutEngine(micro_dir, RolloutConfig(tp=2, max_model_len=MAX_MODEL_LEN,
                                                 kv_cache_gib=0.25),
                        call_timeout_s=600.0, lora=LORA)
    yield eng
    eng.shutdown()


def adapter_plan(tp: int):
    """One trainer rank holding every adapter whole → every engine rank, whole."""
    adapters = lora_shards(megatron_shards(SPEC, ParallelConfig()), LORA.rank, LORA_TARGETS)
    return build_plan(whole_adapters(adapters, 1), whole_adapters(adapters, tp))


def test_tp2_engine_applies_the_adapter_each_rank_received_whole(engine, micro_dir):
    trainer = Trainer(tp=2, plan=adapter_plan(2))
    trainer.connect(engine)
    try:
        for seed in (1, 2):  # the second adapter replaces the first
            model = peft_model(load_hf_model(micro_dir), seed=seed)
            tensors = adapter_tensors(model)
            report, _ = trainer.sync(engine, tensors, adapter=True)
            nbytes = sum(t.numel() * 4 for t in tensors.values())
            assert [r.bytes_received for r in report.ranks] == [nbytes, nbytes]
            assert worst_gap(engine, model) < 1e-4
        assert worst_gap(engine, load_hf_model(micro_dir)) > 1e-2
    finally:
        trainer.disconnect(engine)
