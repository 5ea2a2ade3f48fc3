"""Fixtures: one tokenizer and one tiny HF model per family for the whole session."""

from __future__ import annotations

import pytest

from mcore_rl.models.hf_factory import make_hf_model_dir

from .helpers import FAMILIES


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from mcore_rl.tasks.tokenizer import build_tokenizer_dir

    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory, tok_dir):
    """family → HF folder (tokenizer vocab of 16, so every vocab padding path is exercised;
    100 kB shards, so the source is sharded with an index)."""
    return {name: make_hf_model_dir(spec, tmp_path_factory.mktemp(name), seed=i,
                                    tokenizer_dir_or_obj=tok_dir, max_shard_bytes=100_000)
            for i, (name, spec) in enumerate(FAMILIES.items())}
