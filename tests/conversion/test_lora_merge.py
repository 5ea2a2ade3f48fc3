"""mcore-to-hf on a LoRA checkpoint writes the merged model: W + (alpha / rank)·B·A for every
adapted weight, equal to what PEFT's own merge makes of the base plus the adapter
mcore-to-peft exports, and giving the base-plus-adapter logits. Bad LoRA metadata is refused
in one line. (A checkpoint megatron saved from a LoRA run: tests/megatron/test_lora.py.)

The checkpoints here are written as `save_role` stores them: the HF weights as the frozen base,
random adapters (B non-zero: a fresh B is zero and would merge to the base), and lora.json
naming the HF folder as the base."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from mcore_rl.conversion.convert import mcore_to_hf
from mcore_rl.conversion.dcp_io import TensorChunk, save_chunks
from mcore_rl.conversion.layout import CkptTensor, adapter_layout, checkpoint_layout
from mcore_rl.conversion.peft_adapter import ADAPTER_WEIGHTS, mcore_to_peft, peft_tensors
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.layouts import materialize_rank
from mcore_rl.megatron.config import LoRAConfig
from mcore_rl.models.spec import ModelSpec
from tools.checkpoint_convert.cli import main

from .helpers import MICRO, hf_tensors

LORA = LoRAConfig(rank=4, alpha=8.0)
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_checkpoint(hf_dir: Path, out: Path, lora: LoRAConfig = LORA, *,
                          per_layer: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint (module docstring); returns the adapters by TP1 Megatron key.
    per_layer: megatron's non_homogeneous_layers=True keys instead of stacked layers."""
    layout = checkpoint_layout(ModelSpec.from_hf_dir(hf_dir))
    adapters = adapter_layout(layout, lora.rank, lora.targets)
    gen = torch.Generator().manual_seed(5)
    values = materialize_rank(layout.tp1, 0, hf_tensors(hf_dir).__getitem__)
    written = {t.local.key: 0.1 * torch.randn(t.local.shape, generator=gen)
               for t in adapters.tensors}
    values.update(written)
    save_chunks(out, [_chunk(t, values[t.local.key], per_layer)
                      for t in (*layout.tensors, *adapters.tensors)], {}, distributed=False)
    (out / "lora.json").write_text(json.dumps({**dataclasses.asdict(lora),
                                               "base_model": str(hf_dir)}))
    return written


def _chunk(t: CkptTensor, value: torch.Tensor, per_layer: bool) -> TensorChunk:
    if per_layer and t.per_layer_key is not None:
        shape, zeros = t.local.shape, (0,) * len(t.local.shape)
        return TensorChunk(t.per_layer_key, shape, zeros, shape, value.dtype, lambda: value)
    return TensorChunk(t.key, t.global_shape, t.chunk_offsets, t.chunk_sizes, value.dtype,
                       lambda: value.view(t.chunk_sizes))


@pytest.fixture(scope="module")
def base(hf_dirs):
    return hf_dirs["llama_gqa"]


@pytest.fixture(scope="module")
def lora_ckpt(base, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("lora") / "actor"
    written = write_lora_checkpoint(base, ckpt)
    return ckpt, written


@pytest.fixture(scope="module")
def merged(lora_ckpt, tmp_path_factory):
    """(report, merged HF folder, PEFT adapter folder) of the LoRA checkpoint."""
    ckpt, _ = lora_ckpt
    root = tmp_path_factory.mktemp("merged")
    report = mcore_to_hf(ckpt, root / "hf", progress=False)
    return report, root / "hf", mcore_to_peft(ckpt, root / "peft")


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                local_files_only=True).eval()


def test_merged_weights_equal_peft_merge_and_unload(base, lora_ckpt, merged):
    from peft import PeftModel
    from safetensors.torch import load_file

    ckpt, written = lora_ckpt
    report, hf_dir, peft_dir = merged
    adapted = {f"model.layers.{layer}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight"
               for layer in range(MICRO.layers) for m in ADAPTED}
    assert report.merged == len(adapted) == 7 * MICRO.layers and report.lora_scale == 2.0
    assert f"{len(adapted)} of them merged with their LoRA adapters (W + 2·B·A)" \
        in report.summary()
    # the exported adapter holds what the checkpoint holds
    layout = checkpoint_layout(ModelSpec.from_hf_dir(base))
    expected = peft_tensors(adapter_layout(layout, LORA.rank, LORA.targets).tp1, {0: written})
    exported = load_file(peft_dir / ADAPTER_WEIGHTS)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)

    reference = PeftModel.from_pretrained(_hf_model(base), str(peft_dir)).merge_and_unload()
    want = {k: v.detach() for k, v in reference.state_dict().items()}
    got, before = hf_tensors(hf_dir), hf_tensors(base)
    assert got.keys() == want.keys() == before.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)
        if name in adapted:
            assert (tensor - before[name]).abs().max() > 1e-2, name  # the merge happened
        else:
            assert torch.equal(tensor, before[name]), name


def test_merged_model_gives_the_base_plus_adapter_logits(base, merged):
    from peft import PeftModel

    _, hf_dir, peft_dir = merged
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    base_model = _hf_model(base)
    with torch.no_grad():
        base_logits = base_model(tokens).logits
        want = PeftModel.from_pretrained(base_model, str(peft_dir)).eval()(tokens).logits
        got = _hf_model(hf_dir)(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - base_logits).abs().max() > 1e-2  # the adapters do act


def test_bf16_output_is_the_float32_merge_rounded_once(lora_ckpt, merged, tmp_path):
    ckpt, _ = lora_ckpt
    mcore_to_hf(ckpt, tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    got, fp32 = hf_tensors(tmp_path / "bf16"), hf_tensors(merged[1])
    assert all(torch.equal(got[n], fp32[n].to(torch.bfloat16)) for n in fp32)


def test_per_layer_adapter_keys_merge_the_same(base, merged, tmp_path):
    write_lora_checkpoint(base, tmp_path / "ckpt", per_layer=True)
    report = mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    assert report.merged == merged[0].merged
    got, want = hf_tensors(tmp_path / "hf"), hf_tensors(merged[1])
    assert all(torch.equal(got[n], want[n]) for n in want)


def _two_rank_merge(rank, world, ckpt, out):
    return mcore_to_hf(ckpt, out, progress=False).as_dict()


def test_two_ranks_each_merge_their_share(lora_ckpt, merged, tmp_path):
    ckpt, _ = lora_ckpt
    reports = run_on_ranks(_two_rank_merge, 2, ckpt, tmp_path / "hf", timeout_s=180)
    assert all(r["merged"] == merged[0].merged and r["ranks"] == 2 for r in reports)
    got, want = hf_tensors(tmp_path / "hf"), hf_tensors(merged[1])
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_cli_reports_the_merge_and_finds_the_base_in_lora_json(lora_ckpt, tmp_path, capsys):
    ckpt, _ = lora_ckpt
    assert not (ckpt / "hf_config").exists()  # config.json comes from lora.json's base
    assert main(["mcore-to-hf", str(ckpt), str(tmp_path / "hf"), "--no-progress"]) == 0
    *_, summary, last = capsys.readouterr().out.strip().splitlines()
    assert "28 of them merged with their LoRA adapters (W + 2·B·A)" in summary
    assert json.loads(last)["merged"] == 28 and json.loads(last)["lora_scale"] == 2.0


def _lora_json(change):
    def mutate(ckpt: Path) -> None:
        path = ckpt / "lora.json"
        if change is None:
            path.unlink()
        elif isinstance(change, str):
            path.write_text(change)
        else:
            path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return mutate


@pytest.mark.parametrize("mutate, expected", [
    (_lora_json(None), "adapter tensors (e.g. decoder.layers.mlp.linear_fc1.lora.lora_a) but "
                       "no lora.json (their rank and alpha)"),
    (_lora_json("{rank: 4"), "lora.json: unreadable (JSONDecodeError"),
    (_lora_json({"rank": 8}), "adapter tensor decoder.layers.self_attention.linear_qkv.lora."
                              "lora_a has shape (4, 4, 128), expected (4, 8, 128) (lora.json's "
                              "rank 8)"),
    (_lora_json({"targets": ["linear_qkv", "linear_proj"]}),
     "adapter tensor decoder.layers.mlp.linear_fc1.lora.lora_a is on no weight that "
     "lora.json's targets ['linear_qkv', 'linear_proj'] adapt in this model (and 3 more)"),
], ids=["no_lora_json", "unreadable_lora_json", "wrong_rank", "unknown_adapter"])
def test_bad_lora_metadata_is_refused_in_one_line(lora_ckpt, tmp_path, capsys, mutate,
                                                 expected):
    bad = tmp_path / "actor"
    shutil.copytree(lora_ckpt[0], bad)
    mutate(bad)
    dst = tmp_path / "hf"
    assert main(["mcore-to-hf", str(bad), str(dst), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert expected in line, line
    assert not dst.exists() and not list(tmp_path.glob(".hf*"))


def test_verify_is_refused_for_a_lora_checkpoint(lora_ckpt, tmp_path, capsys):
    dst = tmp_path / "hf"
    assert main(["mcore-to-hf", str(lora_ckpt[0]), str(dst), "--verify", "--no-progress"]) == 2
    assert "a LoRA checkpoint; --verify runs its Megatron model without the adapters" \
        in capsys.readouterr().err
    assert not dst.exists()
