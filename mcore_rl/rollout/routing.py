"""The experts a rollout's MoE routers chose, as its samples carry them to the actor
(`algorithm.routing_replay: rollout`).

An engine started with `routed_experts` returns, per completion, int16 rows [positions, all
layers, top-k]: one per position of prompt + completion the engine forwarded, i.e. all but the
last sampled token (`Completion.routing`). A sample generated over several calls (the turns of
an episode, the chunks of a partial rollout) asks each later call for the positions it does not
hold yet (`routing_start`) and joins the rows; a position's row is the one of the call that
forwarded it, so each token keeps the routing it was sampled after. A row depends only on the
tokens up to its position, so cutting a sequence keeps the rows of the positions left.

In a batch (`batch_rows`) a row of tokens gets its sample's rows from position 0; the positions
without one (the last token, the padding) hold -1, and the actor's routers choose their own
experts there (`megatron.routing_replay`).
"""

from __future__ import annotations

from typing import Sequence

import torch


def joined_routing(held: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """A sample's rows followed by the next call's (which start where `held` ends)."""
    if new is None:
        return held
    return new if held is None else torch.cat([held, new])


def routing_start(held: Sequence[torch.Tensor | None]) -> dict[str, list[int]]:
    """The keyword a continuing generate call takes: per prompt, the positions whose rows the
    sample holds — nothing when no sample holds routing (engines that return none)."""
    if all(h is None for h in held):
        return {}
    return {"routing_start": [0 if h is None else int(h.shape[0]) for h in held]}


def cut_routing(rows: torch.Tensor | None, positions: int) -> torch.Tensor | None:
    """The rows of a sequence cut to its first `positions` tokens."""
    return None if rows is None else rows[:positions]


def batch_rows(routings: Sequence[torch.Tensor | None], length: int) -> torch.Tensor:
    """Per-row routing [n, length, layers, k] (int16, -1 where a position has no row) from each
    sample's rows; a sample without routing is an error naming it."""
    shapes = set()
    for i, rows in enumerate(routings):
        if rows is None:
            raise ValueError(f"sample {i}: the engines returned no routed experts "
                             "(algorithm.routing_replay=rollout needs every sample's)")
        if rows.ndim != 3 or rows.shape[0] > length:
            raise ValueError(f"sample {i}: routed experts of shape {tuple(rows.shape)}; "
                             f"expected [at most {length} positions, layers, top-k]")
        shapes.add(tuple(rows.shape[1:]))
    if len(shapes) != 1:
        raise ValueError(f"the samples' routed experts have different [layers, top-k]: "
                         f"{sorted(shapes)}")
    layers, k = shapes.pop()
    out = torch.full((len(routings), length, layers, k), -1, dtype=torch.int16)
    for i, rows in enumerate(routings):
        out[i, :rows.shape[0]] = rows.to(torch.int16)
    return out


__all__ = ["batch_rows", "cut_routing", "joined_routing", "routing_start"]
