"""Rewards for RL tests on untrained models."""

from __future__ import annotations

import zlib


def spread_reward(prompt: str, response: str, answer: str | None = None) -> float:
    """A checksum of the response text in [0, 1]: any two different responses almost surely
    score differently, so every group of an untrained model's samples carries a gradient. A
    task reward cannot promise that: even `addition:digit_reward`'s partial credit scores a
    whole batch of random responses 0 now and then (one batch in ~20 at 16 samples), and a
    test that needs the actor to move then depends on the seed's luck."""
    return (zlib.crc32(response.encode()) % 1001) / 1000
