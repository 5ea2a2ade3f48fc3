"""Tied embeddings (Qwen2 with q/k/v biases): vLLM's LM head is the embedding, and on CPU it
computes from its own packed copy — installing new embedding shards must re-pack it, or the
engine keeps scoring with the old head."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from mcore_rl.layouts import materialize_rank, vllm_shards
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.models.hf_reference import greedy_generate, load_hf_model
from mcore_rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig

from .helpers import MAX_MODEL_LEN, SPEC, perturbed, prompts

TIED = SPEC.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                  tied_embeddings=True)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    out = make_hf_model_dir(TIED, tmp_path_factory.mktemp("tied"), seed=1)
    path = out / "model.safetensors"
    # peaked next-token distributions (see conftest.micro_dir), so greedy checks mean something
    state = {k: (v * 8 if v.ndim == 2 else v).contiguous() for k, v in load_file(path).items()}
    save_file(state, path, metadata={"format": "pt"})
    return out


def test_installing_a_tied_embedding_repacks_the_lm_head(tied_dir):
    # (imported here: weight_transfer imports vLLM, and the GPU check collects this module
    # on a machine without it — tests/test_gpu_check.py)
    from mcore_rl.rollout.weight_transfer import coverage_problem

    engine = RolloutEngine(tied_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN,
                                                   kv_cache_gib=0.25),
                           call_timeout_s=600.0)
    try:
        w0 = load_file(tied_dir / "model.safetensors")
        assert "lm_head.weight" not in w0
        w1 = perturbed(w0, seed=2, scale=0.5)
        ps = prompts(4, 12, seed=5)
        greedy = SamplingConfig(temperature=0.0, max_tokens=8)
        before = [list(o[0].token_ids) for o in engine.generate(ps, greedy)]
        dst = vllm_shards(TIED, 1)
        # the layout writes exactly the engine's parameters: the check every engine rank
        # makes as it joins a run's sync group (the LM head is no parameter of its own)
        assert coverage_problem({k: t.shape for k, t in dst.ranks[0].items()},
                                engine.describe_shards()[0]) is None
        items = list(materialize_rank(dst, 0, w1.__getitem__).items())
        names = engine.install_tensors(items)
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        after = [list(o[0].token_ids) for o in engine.generate(ps, greedy)]
    finally:
        engine.shutdown()
    model = load_hf_model(tied_dir)
    missing, unexpected = model.load_state_dict(w1, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: it *is* the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_after = greedy_generate(model, ps, max_new_tokens=8)
    assert after == hf_after and after != before
