"""Random-weight HF model folders: config round-trip, offline loading, sharding, and one
check that vLLM (CPU, in-process) loads them and greedy-generates what HF transformers does."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from mcore_rl.models.hf_factory import (hf_config_from_spec, make_hf_model_dir,
                                        read_safetensors_index)
from mcore_rl.models.hf_reference import (greedy_generate, load_hf_model, token_logprobs,
                                          top2_margin)
from mcore_rl.models.presets import PRESETS, get_preset
from mcore_rl.models.spec import ModelSpec, UnsupportedModelError
from mcore_rl.tasks import tokenizer as tk
from mcore_rl.tasks.addition import AdditionTask

MICRO = get_preset("micro")
# Qwen2 flavour of micro: q/k/v biases, tied embeddings, other rope/eps.
MICRO_QWEN2 = MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                          tied_embeddings=True, rope_theta=1e6, norm_eps=1e-6, layers=2)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tk.build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory, tok_dir):
    # 200 kB shards: micro (4 layers, 16-token vocab) spreads over many files + an index.
    return make_hf_model_dir(MICRO, tmp_path_factory.mktemp("micro"), seed=0,
                             tokenizer_dir_or_obj=tok_dir, max_shard_bytes=200_000)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tok_dir):
    return make_hf_model_dir(MICRO_QWEN2, tmp_path_factory.mktemp("qwen2"), seed=1,
                             tokenizer_dir_or_obj=tk.load_tokenizer(tok_dir))


@pytest.mark.parametrize("spec", [
    *PRESETS.values(),
    MICRO_QWEN2,
    MICRO.with_(tied_embeddings=True, rope_theta=500000.0, norm_eps=1e-6),
    MICRO.with_(head_dim=64),                                   # head_dim != hidden / heads
    MICRO.with_(architecture="MistralForCausalLM"),            # Mistral is llama-family
    PRESETS["llama3-8b"].with_(rope_scaling=LLAMA3_SCALING, max_positions=131072),
    MICRO.with_(family="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=48),
    PRESETS["micro-moe"].with_(norm_topk_prob=False),
    MICRO.with_(family="mixtral", architecture="MixtralForCausalLM", num_experts=4,
                moe_ffn=256, experts_per_token=2),
], ids=lambda s: f"{s.architecture}-h{s.hidden}-L{s.layers}")
def test_config_round_trip(spec):
    config = hf_config_from_spec(spec)
    assert type(config).__name__.removesuffix("Config") in spec.architecture
    assert ModelSpec.from_hf_config(config) == spec
    assert ModelSpec.from_hf_config(json.loads(config.to_json_string())) == spec


@pytest.mark.parametrize("spec,problem", [
    (MICRO.with_(qkv_bias=True), "o_proj"),                     # HF attention_bias is q/k/v/o
    (MICRO_QWEN2.with_(qkv_bias=False), "always has"),
    (MICRO_QWEN2.with_(head_dim=64), "head_dim"),
    (MICRO.with_(architecture="Qwen2ForCausalLM"), "family"),
])
def test_config_rejects_what_hf_cannot_express(spec, problem):
    with pytest.raises(UnsupportedModelError, match=problem):
        hf_config_from_spec(spec)


def test_dir_loads_offline_with_auto_classes(micro_dir, tok_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(micro_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(micro_dir, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok) == 16
    assert (model.config.bos_token_id, model.config.eos_token_id,
            model.config.pad_token_id) == (tk.BOS_ID, tk.EOS_ID, tk.PAD_ID)
    assert ModelSpec.from_hf_dir(micro_dir) == MICRO.with_(vocab=16)
    assert (micro_dir / "tokenizer.model").read_bytes() == (tok_dir / "tokenizer.model").read_bytes()
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == MICRO.with_(vocab=16).num_params()
    assert params["model.embed_tokens.weight"].dtype == torch.float32
    norm = params["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))             # randomized, not all 1


def test_sharded_index_is_valid(micro_dir):
    weight_map = read_safetensors_index(micro_dir)
    assert weight_map is not None and len(set(weight_map.values())) > 4
    model = load_hf_model(micro_dir)
    state = model.state_dict()
    assert set(weight_map) == set(state)
    seen = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(micro_dir / shard), "pt") as f:
            for name in f.keys():
                assert weight_map[name] == shard and name not in seen
                seen[name] = f.get_tensor(name)
    assert set(seen) == set(state)
    assert all(torch.equal(seen[n], state[n]) for n in state)
    index = json.loads((micro_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in seen.values())


def test_same_seed_same_weights_and_tied_qwen2(tmp_path, qwen2_dir):
    again = make_hf_model_dir(MICRO_QWEN2, tmp_path, seed=1,
                              tokenizer_dir_or_obj=qwen2_dir)
    a, b = load_hf_model(qwen2_dir).state_dict(), load_hf_model(again).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_hf_model(make_hf_model_dir(MICRO_QWEN2, tmp_path / "other", seed=2))
    assert other.config.vocab_size == MICRO_QWEN2.vocab          # no tokenizer: spec's vocab
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(other.state_dict()[name], a[name])
    with safe_open(str(qwen2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names                        # tied: stored once
    assert "model.layers.0.self_attn.q_proj.bias" in names
    bias = a["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().sum() > 0                                  # randomized, not all 0
    model = load_hf_model(qwen2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_reference_logprobs_match_generation(micro_dir):
    model = load_hf_model(micro_dir)
    tok = tk.load_tokenizer(micro_dir)
    prompt = tk.encode_prompt(tok, "37+05=")
    [new] = greedy_generate(model, [prompt], max_new_tokens=4)
    [lp] = token_logprobs(model, [prompt + new])
    assert lp.shape == (len(prompt) + len(new) - 1,)
    logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(lp[len(prompt) - 1], torch.log_softmax(logits, -1)[new[0]])
    assert new[0] == int(logits.argmax())


_VLLM_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
result = {"import_s": time.perf_counter() - t0}
for name, job in args.items():
    t = time.perf_counter()
    llm = LLM(model=job["dir"], dtype="float32", enforce_eager=True, seed=0,
              distributed_executor_backend="uni", max_model_len=64, max_num_seqs=8)
    load_s = time.perf_counter() - t
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new"], ignore_eos=True)
    by_ids = llm.generate([{"prompt_token_ids": p} for p in job["prompt_ids"]], greedy,
                          use_tqdm=False)
    by_text = llm.generate(job["prompts"], greedy, use_tqdm=False)
    result[name] = {"load_s": load_s,
                    "ids": [list(o.outputs[0].token_ids) for o in by_ids],
                    "text_prompt_ids": [list(o.prompt_token_ids) for o in by_text],
                    "text_ids": [list(o.outputs[0].token_ids) for o in by_text]}
    del llm
print("RESULT " + json.dumps(result))
"""


@pytest.mark.timeout(240)
def test_vllm_loads_dir_and_matches_hf_greedy(micro_dir, qwen2_dir):
    """vLLM CPU in-process (own subprocess: it reads env vars at import) loads a sharded
    Llama folder and a tied Qwen2 folder and greedy-generates what HF does, token for token.
    Also: vLLM tokenizes text prompts exactly as `encode_prompt` (BOS + one id per char)."""
    prompts = AdditionTask().heldout_prompts(4)
    max_new = 6
    jobs, expected = {}, {}
    for name, d in (("llama", micro_dir), ("qwen2", qwen2_dir)):
        tok, model = tk.load_tokenizer(d), load_hf_model(d)
        prompt_ids = [tk.encode_prompt(tok, p) for p in prompts]
        expected[name] = (prompt_ids, greedy_generate(model, prompt_ids, max_new_tokens=max_new))
        # The comparison is only meaningful where HF's argmax is not a near-tie.
        margins = [top2_margin(model, p + out[:i]) for p, out in zip(*expected[name])
                   for i in range(max_new)]
        assert min(margins) > 1e-4, f"{name}: near-tie in HF greedy, pick another seed"
        jobs[name] = {"dir": str(d), "prompts": prompts, "prompt_ids": prompt_ids,
                      "max_new": max_new}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, json.dumps(jobs)], env=env,
                          capture_output=True, text=True, timeout=220)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"vLLM import {got['import_s']:.1f}s, load " +
          ", ".join(f"{n} {got[n]['load_s']:.1f}s" for n in jobs))
    for name, (prompt_ids, hf_out) in expected.items():
        assert got[name]["ids"] == hf_out, name
        assert got[name]["text_prompt_ids"] == prompt_ids, name
        assert got[name]["text_ids"] == hf_out, name


def test_released_qwen3_moe_config_reads_num_experts_and_rejects_dense_layers():
    # Qwen/Qwen3-30B-A3B config.json fields (released checkpoints say num_experts)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "num_hidden_layers": 48, "vocab_size": 151936, "num_experts": 128,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
           "max_position_embeddings": 40960, "tie_word_embeddings": False,
           "attention_bias": False, "use_sliding_window": False, "hidden_act": "silu"}
    assert ModelSpec.from_hf_config(cfg) == PRESETS["qwen3-30b-a3b"]
    assert abs(PRESETS["qwen3-30b-a3b"].num_params() / 1e9 - 30.53) < 0.01   # "30.5B"
    assert abs(PRESETS["qwen3-235b-a22b"].num_params() / 1e9 - 235.09) < 0.01
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers=\\[0\\]"):
        ModelSpec.from_hf_config({**cfg, "mlp_only_layers": [0]})
