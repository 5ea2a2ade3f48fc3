"""Checkpoints: HF safetensors ↔ megatron-core dist checkpoints, streamed tensor by tensor.

`hf_to_mcore` / `mcore_to_hf` convert (one process or a rank's share under torchrun/srun);
`load_dist_checkpoint` loads a dist checkpoint into Megatron model chunks at any grid;
`verify_conversion` compares HF transformers and Megatron logits. `checkpoint_layout` is the
grid-independent checkpoint form, derived from `mcore_rl.layouts`. CLI: `mcore-rl convert`.
"""

from mcore_rl.checkpoint.convert import ConvertReport, hf_to_mcore, mcore_to_hf
from mcore_rl.checkpoint.errors import ConversionError
from mcore_rl.checkpoint.layout import CkptLayout, CkptTensor, checkpoint_layout
from mcore_rl.checkpoint.megatron_io import load_dist_checkpoint, megatron_sharded_state_dict
from mcore_rl.checkpoint.verify import VerifyReport, verify_conversion

__all__ = ["CkptLayout", "CkptTensor", "ConversionError", "ConvertReport", "VerifyReport",
           "checkpoint_layout", "hf_to_mcore", "load_dist_checkpoint", "mcore_to_hf",
           "megatron_sharded_state_dict", "verify_conversion"]
