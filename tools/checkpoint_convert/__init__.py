"""Checkpoint conversion HF <-> megatron-core dist checkpoint: the `convert` CLI (cli.py) over
mcore_rl.conversion."""
