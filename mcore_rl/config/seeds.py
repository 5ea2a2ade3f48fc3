"""One seed per run; every random stream is derived from it.

A run sets one top-level `seed`. Each consumer of randomness takes its own stream,
`derive_seed(seed, stream, *keys)`, instead of a seed field of its own, so two streams never
need to be kept in step by hand and changing `seed` changes them all:

  data     the prompts of each step and draw (keys: step, attempt)
  heldout  which held-out examples an evaluation uses
  warmup   each warm-up step's supervised batch (key: step)
  sample   each RL generation call (keys: step, attempt); each sample of the call then gets
           `sample_seed(call seed, prompt index, sample index)`
  eval     the sampling of an evaluation during RL or the warm-up (key: step)
  model    the weights of a model built locally (the demo's random HF model)
  train    megatron's weight init and RNG tracker (actor, critic, reference; train-lm)
  engine   vLLM's engine seed (unseeded sampling only; RL requests carry their own seeds)

Seeds are mixed, never added: `derive_seed` hashes (seed, stream, keys) with BLAKE2b, so two
different key tuples give unrelated seeds. Adding small integers (`seed + step + i*n + j`)
made step k+1's sample j-1 reuse step k's sample j stream: consecutive steps' exploration
noise was correlated. Hashing keeps each draw a pure function of its keys, so a resumed run
draws what an uninterrupted one would, and the seed of a prompt depends on its index in the
batch, not on which engine generates it.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Stream = Literal["data", "heldout", "warmup", "sample", "eval", "model", "train", "engine"]
STREAMS: tuple[str, ...] = (
    "data",
    "heldout",
    "warmup",
    "sample",
    "eval",
    "model",
    "train",
    "engine",
)

# numpy's legacy seeding (vLLM's engine seed, megatron's) takes seeds below 2**32: streams are
# 31-bit. Per-sample seeds go to torch generators alone and take 63 bits, so that the millions
# of samples of a long run do not collide by chance.
STREAM_BITS = 31
SAMPLE_BITS = 63


def mix(*keys: int | str, bits: int) -> int:
    """A `bits`-bit integer hashed from `keys` (BLAKE2b): equal keys give equal values, any
    other keys an unrelated value."""
    if not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in keys):
        raise TypeError(f"seed keys must be ints or strings, got {keys!r}")
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def derive_seed(seed: int, stream: Stream, *keys: int, bits: int = STREAM_BITS) -> int:
    """The seed of `stream` (at `keys`, e.g. step and attempt) in a run seeded `seed`."""
    if stream not in STREAMS:
        raise ValueError(f"unknown seed stream {stream!r}; known: {', '.join(STREAMS)}")
    return mix(seed, stream, *keys, bits=bits)


def sample_seed(call_seed: int, prompt: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt` (its index in the batch) in a generation
    call seeded `call_seed`."""
    return mix(call_seed, prompt, sample, bits=SAMPLE_BITS)


#: what a removed per-component seed field says in its ConfigError (`MOVED` of its class)
USE_THE_RUN_SEED = (
    "set the top-level seed; this stream is derive_seed(seed, {stream!r}) "
    "(mcore_rl/config/seeds.py)"
)

__all__ = [
    "SAMPLE_BITS",
    "STREAMS",
    "STREAM_BITS",
    "Stream",
    "USE_THE_RUN_SEED",
    "derive_seed",
    "mix",
    "sample_seed",
]
