"""MoE routing replay on the Megatron actor: forwards that record which experts each token's
router chose, and forwards that use given choices instead of the router's own top-k — so the
update passes run the experts the π_old pass (or the rollout) used (`algorithm.routing_replay`).

megatron-core's routers call a `RouterReplay` (transformer/moe/router_replay.py) around their
top-k (`moe_utils.topk_routing_with_score_function`, whose `router_replay` argument is the
router's `router_replay` attribute, read at every forward). Replaying gathers the router's
current scores at the given experts, so the gate values still train and only the choice of
experts is fixed. `RouterReplay` keeps every instance in one process-wide list for its static
setters, which would mix the actor's routers with the reference model's; each of our routers
gets its own `LayerReplay` instead, reached through the model.

Token order: a router sees its rank's tokens as megatron holds them, [s, b] flattened
sequence-major (a packed row [1, T] in its order). Routing travels per row, [b, s, layers, k]
(`router_order` / `row_order`).

Full activation recompute (`train.recompute: full`): a checkpointed layer's forward runs under
no_grad and again, with grad, during the micro batch's backward — after later micro batches
set their own choices. So in a training pass (`replaying(..., training=True)`) a replaying
forward under no_grad queues the experts it used, and a forward with grad while the queue holds
some takes the oldest: backward passes run in their forwards' order (megatron-core's own
REPLAY_BACKWARD list does the same).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay


class LayerReplay(RouterReplay):
    """One MoE layer's router hook: off, "record" (keep the top-k it computes) or "replay"
    (use `target`; a token whose target row is -1 keeps its own top-k). Counts: `flips`, the
    replayed tokens whose own top-k set differs, of `replayed`; `seen`, every token routed
    while installed. flips and replayed stay on the router's device until `flip_counts` reads
    them, so a replaying forward never waits for the device."""

    def __init__(self, layer: int):
        # not RouterReplay.__init__: that registers the instance in the process-wide list
        self.layer = layer
        self.mode: str | None = None
        self.recorded: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.flips: torch.Tensor | int = 0
        self.replayed: torch.Tensor | int = 0
        self.seen = 0
        self.queued: list[torch.Tensor] = []  # for recomputed forwards (module doc)
        self.training = False  # the replay is a training pass's, which may recompute

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                          group_topk=group_topk)
        if self.queued and torch.is_grad_enabled():  # a recomputed forward in backward
            target = self.queued.pop(0).to(device=scores.device, dtype=own.dtype)
            return scores.gather(1, target), target
        self.seen += own.shape[0]
        if self.mode == "record":
            self.recorded = own.detach()
            return probs, own
        if self.mode != "replay":
            return probs, own
        target = self.target
        if target is None or tuple(target.shape) != tuple(own.shape):
            raise ValueError(f"routing replay, layer {self.layer}: the router has "
                             f"{tuple(own.shape)} top-k choices to replace, the replay gives "
                             f"{None if target is None else tuple(target.shape)}")
        target = target.to(device=scores.device, dtype=own.dtype)
        given = target[:, :1] >= 0  # -1: no routing to replay (a rollout's last token, padding)
        used = torch.where(given, target, own)
        differs = (own.sort(-1).values != used.sort(-1).values).any(-1)
        self.flips = self.flips + differs.sum()
        self.replayed = self.replayed + given.sum()
        if self.training and not torch.is_grad_enabled():
            self.queued.append(used)  # its recomputation replays it too
        return scores.gather(1, used), used


def moe_routers(chunks: list[torch.nn.Module]) -> Iterator[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of this rank's chunks, in layer order."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                yield layer.layer_number - 1, router


def install_replay(chunks: list[torch.nn.Module]) -> list[LayerReplay]:
    """A `LayerReplay` on every MoE router of `chunks` (off until `recording` / `replaying`)."""
    hooks = []
    for layer, router in moe_routers(chunks):
        router.router_replay = LayerReplay(layer)
        hooks.append(router.router_replay)
    if not hooks:
        raise ValueError("routing replay: the model has no MoE layer")
    return hooks


def _hooks(chunk: torch.nn.Module) -> list[LayerReplay]:
    hooks = [router.router_replay for _, router in moe_routers([unwrapped(chunk)])]
    if not all(isinstance(h, LayerReplay) for h in hooks):
        raise RuntimeError("routing replay: install_replay was not called on this model")
    return hooks


@contextlib.contextmanager
def recording(chunk: torch.nn.Module):
    """Inside the block every forward of `chunk` records its routing; `recorded(chunk)` reads
    the last forward's."""
    hooks = _hooks(chunk)
    for h in hooks:
        h.mode, h.recorded = "record", None
    try:
        yield
    finally:
        for h in hooks:
            h.mode = None


def recorded(chunk: torch.nn.Module) -> torch.Tensor:
    """The routing of `chunk`'s last recorded forward: [layers of the chunk, tokens, k]."""
    hooks = _hooks(chunk)
    if any(h.recorded is None for h in hooks):
        raise RuntimeError("routing replay: no forward was recorded")
    return torch.stack([h.recorded for h in hooks])


@contextlib.contextmanager
def replaying(chunk: torch.nn.Module, routing: torch.Tensor, training: bool = False):
    """Inside the block `chunk`'s forwards use `routing` ([layers of the chunk, tokens, k],
    in router order) instead of their routers' top-k. training: a pass whose backward may
    recompute the forward (module doc)."""
    hooks = _hooks(chunk)
    if routing.shape[0] != len(hooks):
        raise ValueError(f"routing replay: {routing.shape[0]} layers of routing for a chunk "
                         f"with {len(hooks)} MoE layers")
    for h, target in zip(hooks, routing):
        h.mode, h.target, h.training = "replay", target, training
    try:
        yield
    finally:
        for h in hooks:
            h.mode, h.target, h.training = None, None, False


def flip_counts(chunks: list[torch.nn.Module], reset: bool = True) -> tuple[int, int, int]:
    """(token-layer choices that differed from the replayed ones, choices replayed, choices
    made) since the last reset, over this rank's routers."""
    hooks = [h for chunk in chunks for h in _hooks(chunk)]
    counts = (int(sum(h.flips for h in hooks)), int(sum(h.replayed for h in hooks)),
              sum(h.seen for h in hooks))
    if reset:
        for h in hooks:
            h.flips = h.replayed = h.seen = 0
    return counts


def chunk_layers(chunk: torch.nn.Module) -> list[int]:
    """Global indices of `chunk`'s MoE layers (megatron wrappers unwrapped)."""
    return [layer for layer, _ in moe_routers([unwrapped(chunk)])]


def unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@contextlib.contextmanager
def replaying_rows(chunk: torch.nn.Module, rows: torch.Tensor | None, tp_group=None,
                   training: bool = False):
    """`replaying` a micro batch's per-row routing `rows` [b, s, all layers, k] on `chunk`
    (its layers taken; with sequence parallelism, `tp_group`: this TP rank's 1/tp of the
    positions). rows None: the routers route."""
    if rows is None:
        yield
        return
    model = unwrapped(chunk)
    mine = rows[:, :, chunk_layers(model)]
    if tp_group is not None:
        per = mine.shape[1] // tp_group.size()
        start = tp_group.rank() * per
        mine = mine[:, start:start + per]
    with replaying(model, router_order(mine), training):
        yield


def recorded_rows(chunk: torch.nn.Module, b: int, num_layers: int,
                  tp_group=None) -> torch.Tensor:
    """`chunk`'s last recorded routing as per-row routing [b, s, num_layers, k] (int16; -1 in
    the layers other chunks and stages hold); with sequence parallelism the TP ranks' positions
    gathered over `tp_group`."""
    model = unwrapped(chunk)
    rows = row_order(recorded(model), b)  # [b, s_local, chunk's MoE layers, k]
    if tp_group is not None and tp_group.size() > 1:
        parts = [torch.empty_like(rows) for _ in range(tp_group.size())]
        torch.distributed.all_gather(parts, rows.contiguous(), group=tp_group)
        rows = torch.cat(parts, dim=1)
    out = rows.new_full((b, rows.shape[1], num_layers, rows.shape[-1]), -1)
    out[:, :, chunk_layers(model)] = rows
    return out.to(torch.int16)


def router_order(rows: torch.Tensor) -> torch.Tensor:
    """Per-row routing [b, s, layers, k] → the routers' order [layers, s·b, k]."""
    b, s, layers, k = rows.shape
    return rows.permute(2, 1, 0, 3).reshape(layers, s * b, k)


def row_order(tokens: torch.Tensor, b: int) -> torch.Tensor:
    """The routers' order [layers, s·b, k] → per row [b, s, layers, k]."""
    layers, n, k = tokens.shape
    return tokens.reshape(layers, n // b, b, k).permute(2, 1, 0, 3)


__all__ = ["LayerReplay", "chunk_layers", "flip_counts", "install_replay", "moe_routers",
           "recorded", "recorded_rows", "recording", "replaying", "replaying_rows",
           "router_order", "row_order", "unwrapped"]
