"""HF → dist checkpoint → HF is bit-exact on every tensor, for each family, in one process and
split over two ranks; the files around the tensors (configs, tokenizer, index, metadata) are
what transformers, vLLM and megatron expect."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.conversion.convert import METADATA_FILE, hf_to_mcore, mcore_to_hf
from mcore_rl.conversion.dcp_io import ChunkReader
from mcore_rl.conversion.layout import checkpoint_layout
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.spec import ModelSpec

from .helpers import FAMILIES, assert_bit_exact, hf_tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_mcore_hf_round_trip_is_bit_exact(family, hf_dirs, tmp_path):
    src = hf_dirs[family]
    mc, out = tmp_path / "mc", tmp_path / "hf"
    report = hf_to_mcore(src, mc, progress=False)
    back = mcore_to_hf(mc, out, max_shard_bytes=150_000, progress=False)
    n = assert_bit_exact(src, out)
    # one chunk per stored key: a MoE layer's MLP norm is stored under both specs' keys
    assert back.tensors == n and report.tensors == sum(
        len(t.keys) for t in checkpoint_layout(FAMILIES[family].with_(vocab=16)).tensors)
    spec = ModelSpec.from_hf_dir(src)
    assert ModelSpec.from_hf_dir(out) == spec == ModelSpec.from_hf_dir(mc / "hf_config")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    # Sharded like save_pretrained: capped files + an index naming every tensor.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and set(index["weight_map"]) == set(hf_tensors(src))
    assert all((out / f).stat().st_size <= 150_000 + 4096 for f in files)
    # The checkpoint: megatron's marker files, our metadata, exactly the layout's entries.
    assert json.loads((mc / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    meta = json.loads((mc / METADATA_FILE).read_text())
    assert meta["architecture"] == spec.architecture and meta["layer_keys"] == "stacked"
    layout = checkpoint_layout(spec)
    stored = ChunkReader(mc).metadata.state_dict_metadata
    assert set(stored) == set(layout.tensor_keys()) | set(layout.objects)
    assert all(tuple(stored[t.key].size) == t.global_shape for t in layout.tensors)


def test_dtype_conversion_and_back(hf_dirs, tmp_path):
    """--dtype bf16 stores bf16; converting back keeps bf16 and writes it into config.json."""
    src = hf_dirs["llama_gqa"]
    hf_to_mcore(src, tmp_path / "mc", dtype=torch.bfloat16, progress=False)
    stored = ChunkReader(tmp_path / "mc").metadata.state_dict_metadata
    assert {md.properties.dtype for md in stored.values() if hasattr(md, "properties")} == \
        {torch.bfloat16}
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", progress=False)
    got, want = hf_tensors(tmp_path / "hf"), hf_tensors(src)
    assert all(torch.equal(got[n], want[n].to(torch.bfloat16)) for n in want)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "hf" / "model.safetensors").is_file()   # one file: no index, as HF
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()


def _two_rank_round_trip(rank, world, src, mc, out):
    a = hf_to_mcore(src, mc, progress=False)
    b = mcore_to_hf(mc, out, max_shard_bytes=150_000, progress=False)
    return a.as_dict(), b.as_dict()


def test_two_ranks_convert_disjoint_shares(hf_dirs, tmp_path):
    """As under torchrun: every rank converts its share; rank 0 commits. Both directions."""
    src = hf_dirs["qwen2_tied_bias"]
    mc, out = tmp_path / "mc", tmp_path / "hf"
    reports = run_on_ranks(_two_rank_round_trip, 2, src, mc, out, timeout_s=180)
    assert_bit_exact(src, out)
    written_by = {p.name.split("_")[2] for p in mc.glob("__*_*.distcp")}
    assert written_by == {"0", "1"}                       # both ranks wrote chunks
    for rank0, rank1 in zip(*reports):                    # totals agreed over ranks
        assert {**rank0, "seconds": 0} == {**rank1, "seconds": 0} and rank0["ranks"] == 2
    assert not list(tmp_path.glob(".*partial*"))


def test_reads_checkpoints_with_per_layer_keys(hf_dirs, tmp_path):
    """megatron's non_homogeneous_layers=True form stores 'decoder.layers.<l>.<name>' without
    the layer axis; mcore-to-hf reads it too."""
    from mcore_rl.conversion.dcp_io import TensorChunk, save_chunks
    from mcore_rl.layouts import materialize_rank

    src = hf_dirs["llama_gqa"]
    layout = checkpoint_layout(ModelSpec.from_hf_dir(src))
    local = materialize_rank(layout.tp1, 0, hf_tensors(src).__getitem__)
    chunks = [TensorChunk(t.per_layer_key or t.key, t.local.shape, (0,) * len(t.local.shape),
                          t.local.shape, torch.float32, lambda k=t.local.key: local[k])
              for t in layout.tensors]
    save_chunks(tmp_path / "mc", chunks, {}, distributed=False)
    assert "decoder.layers.3.mlp.linear_fc1.weight" in \
        ChunkReader(tmp_path / "mc").metadata.state_dict_metadata
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", hf_config=src, progress=False)
    assert_bit_exact(src, tmp_path / "hf")
