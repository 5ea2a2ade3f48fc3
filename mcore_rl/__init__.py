"""mcore-rl: RL post-training on Megatron-Core actors and vLLM engines (README.md)."""

from mcore_rl.compat import lazy_compile

# before any megatron import in this process: its fused functions are compiled on first call,
# so importing it does not import torch's compiler (mcore_rl/compat/lazy_compile.py)
lazy_compile.install()
