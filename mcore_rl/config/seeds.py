"""One seed per run; every random stream is derived from it.

A run sets one top-level `seed`. Each consumer of randomness takes its own stream,
`derive_seed(seed, stream)`, instead of a seed field of its own, so two streams never need to be
kept in step by hand and changing `seed` changes them all:

  data     prompts, held-out and warm-up examples, per-request sampling seeds (the seed itself)
  model    the weights of a model built locally (the demo's random HF model)
  train    megatron's weight init and RNG tracker (actor, critic, reference; train-lm)
  engine   vLLM's engine seed (unseeded sampling only; RL requests carry their own seeds)

A stream is the seed plus a fixed offset. The offsets are chosen so that the default `seed: 0`
gives exactly the values the separate fields had as defaults before there was one seed
(model 0, train 1234, engine 0), so the demo's numbers did not move.
"""

from __future__ import annotations

from typing import Literal

Stream = Literal["data", "model", "train", "engine"]

OFFSETS: dict[str, int] = {"data": 0, "model": 0, "train": 1234, "engine": 0}


def derive_seed(seed: int, stream: Stream) -> int:
    """The seed of `stream` in a run seeded `seed`."""
    if stream not in OFFSETS:
        raise ValueError(f"unknown seed stream {stream!r}; known: {', '.join(OFFSETS)}")
    return seed + OFFSETS[stream]


#: what a removed per-component seed field says in its ConfigError (`MOVED` of its class)
USE_THE_RUN_SEED = "set the top-level seed; this stream is derive_seed(seed, {stream!r}) " \
                   "(mcore_rl/config/seeds.py)"

__all__ = ["OFFSETS", "Stream", "USE_THE_RUN_SEED", "derive_seed"]
