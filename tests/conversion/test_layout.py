"""The dist-checkpoint form of the TE spec's grouped experts: TEGroupedMLP stores expert j of
its grouped linear (`mlp.experts.linear_fc1.weight<j>`) under the key and axes SequentialMLP
gives `mlp.experts.local_experts.<j>.linear_fc1.weight` (megatron-core's
TEGroupedMLP.sharded_state_dict: "interchangeable with SequentialMLP's"), so one checkpoint
serves both specs. The end-to-end check (convert, megatron loads and saves at EP grids) is
test_moe_grids.py."""

from __future__ import annotations

import pytest

from mcore_rl.conversion.layout import _stored_key, checkpoint_layout
from mcore_rl.layouts import megatron_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SPEC = get_preset("micro-moe")


def test_grouped_expert_names_store_under_sequential_keys():
    te = megatron_shards(SPEC, ParallelConfig(), layer_spec="te").ranks[0]
    local = megatron_shards(SPEC, ParallelConfig(), layer_spec="local").ranks[0]
    grouped = [k for k in te if ".experts.linear_fc" in k]
    sequential = [k for k in local if ".local_experts." in k]
    assert len(grouped) == len(sequential) == SPEC.layers * SPEC.num_experts * 2
    assert [_stored_key(k, SPEC) for k in grouped] == [_stored_key(k, SPEC) for k in sequential]
    key, axes = _stored_key("decoder.layers.3.mlp.experts.linear_fc2.weight5", SPEC)
    assert (key, axes) == ("decoder.layers.mlp.experts.experts.linear_fc2.weight", [3, 5])


def test_checkpoint_layout_has_one_tensor_per_layer_and_expert():
    layout = checkpoint_layout(SPEC)
    fc1 = [t for t in layout.tensors if t.key == "decoder.layers.mlp.experts.experts.linear_fc1"
           ".weight"]
    assert sorted((t.layer, t.expert) for t in fc1) == [
        (layer, e) for layer in range(SPEC.layers) for e in range(SPEC.num_experts)]
    expert_objects = [o for o in layout.objects if "experts.experts.linear_fc1._extra_state" in o]
    assert len(expert_objects) == SPEC.layers * SPEC.num_experts
