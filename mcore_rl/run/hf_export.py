"""The actor's current weights as a Hugging Face checkpoint directory.

After the warm-up the demo writes one (`OUT/warmup_hf`), so another run — ours with
`model.hf_dir=OUT/warmup_hf warmup.max_steps=0`, or a peer framework such as TRL
(`bench step baseline=trl`) — can start from exactly the same weights. Each rank returns
its own shards (`ActorWorker.export_weights`); `layouts.assemble_hf` puts the HF tensors back
together on the driver (small models: the whole model passes through the driver once). The
config and tokenizer files are copied from the directory the run started from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# files of the starting directory that are weights (replaced) rather than config/tokenizer
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def export_actor_hf(controller, source_dir: Path, out: Path) -> Path:
    """Write the controller's actor weights as an HF directory at `out` (config and tokenizer
    from `source_dir`, weights in one model.safetensors). Written to a temporary sibling and
    renamed, so `out` is complete or absent; an existing `out` is replaced."""
    from safetensors.torch import save_file  # lazy: torch

    from mcore_rl.layouts import assemble_hf, megatron_shards  # lazy: torch

    shards = megatron_shards(controller.spec, controller.cfg.actor,
                             layer_spec=controller.run.layer_spec)
    local = dict(enumerate(controller.actor_weights()))
    tensors = {name: t.contiguous() for name, t in assemble_hf(shards, local).items()}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    weights = {p for pattern in _WEIGHT_FILES for p in Path(source_dir).glob(pattern)}
    shutil.copytree(source_dir, tmp, ignore=lambda d, names: [
        n for n in names if Path(d) / n in weights])
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
