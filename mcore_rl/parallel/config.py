"""The training grid's shape: how the actor (and critic/reference) are split over ranks."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Megatron-Core parallelism of one training role.

    tp: tensor-parallel size (splits heads, FFN and vocab).
    pp: pipeline-parallel size (splits layers into stages).
    vpp: virtual pipeline chunks per stage (interleaved 1F1B), or None.
    dp: data-parallel size; world size = tp * pp * dp.
    sequence_parallel: shard activations along the sequence in TP regions (needs tp > 1).
    use_distributed_optimizer: shard optimizer state over DP (ZeRO-1 as in Megatron).
    first_stage_layers / last_stage_layers: uneven PP — layers on the first / last stage;
        the rest are spread evenly over the middle stages.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ConfigError("vpp", self.vpp, "virtual pipeline needs vpp >= 2 and pp >= 2 "
                                               "(use null to turn it off)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel", True, "needs tp > 1")
        uneven = (self.first_stage_layers, self.last_stage_layers)
        if any(v is not None for v in uneven):
            if self.pp < 2:
                raise ConfigError("first_stage_layers", self.first_stage_layers,
                                  "uneven stages need pp >= 2")
            if self.vpp is not None:
                raise ConfigError("vpp", self.vpp, "uneven stages and vpp cannot be combined")
            for name, value in zip(("first_stage_layers", "last_stage_layers"), uneven):
                if value is not None and value < 1:
                    raise ConfigError(name, value, "must be >= 1")

    def check_model(self, spec) -> None:
        """Raise ConfigError unless a model of `spec`'s shape splits on this grid: tp divides
        the attention heads, the key-value heads (Megatron splits whole query groups) and the
        FFN width, and the layers split over the pipeline stages (see stage_layer_counts)."""
        for what, count in (("num_attention_heads", spec.heads),
                            ("num_key_value_heads", spec.kv_heads),
                            ("intermediate_size", spec.ffn)):
            if count % self.tp:
                raise ConfigError("tp", self.tp, f"does not divide {what}={count}")
        self.stage_layer_counts(spec.layers)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage (before VPP chunking), validated against `num_layers`."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            per_chunk = self.pp * (self.vpp or 1)
            if num_layers % per_chunk:
                raise ConfigError("pp", self.pp, f"pp * vpp = {per_chunk} does not divide "
                                                 f"num_layers={num_layers}")
            return [num_layers // self.pp] * self.pp
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (
                middle_stages and (rest % middle_stages or rest == 0)):
            raise ConfigError("first_stage_layers", first,
                              f"with last_stage_layers={last} and pp={self.pp}, the remaining "
                              f"{rest} of num_layers={num_layers} do not split evenly over "
                              f"{middle_stages} middle stages")
        middle = [rest // middle_stages] * middle_stages if middle_stages else []
        return ([first] if first is not None else []) + middle + ([last] if last is not None
                                                                   else [])

    def layer_ranges(self, num_layers: int) -> dict[tuple[int, int], range]:
        """Global layer indices held by each (pp_rank, vpp_chunk), as Megatron assigns them.

        Without VPP there is one chunk (0) per stage. With VPP the model is cut into pp * vpp
        equal chunks and stage p holds chunks p, p + pp, p + 2·pp, ... (interleaved 1F1B).
        """
        counts = self.stage_layer_counts(num_layers)
        if self.vpp is None:
            starts = [sum(counts[:p]) for p in range(self.pp)]
            return {(p, 0): range(starts[p], starts[p] + counts[p]) for p in range(self.pp)}
        per_chunk = num_layers // (self.pp * self.vpp)
        return {(p, v): range((v * self.pp + p) * per_chunk, (v * self.pp + p + 1) * per_chunk)
                for p in range(self.pp) for v in range(self.vpp)}

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        """Global training rank of grid coordinates, in Megatron's default order tp-cp-ep-dp-pp
        (tp fastest, pp slowest; cp = ep = 1)."""
        return tp + self.tp * (dp + self.dp * pp)

    def coords_of(self, rank: int) -> dict[str, int]:
        """Inverse of `rank_of`: {"tp": ..., "pp": ..., "dp": ...}."""
        return {"tp": rank % self.tp, "dp": (rank // self.tp) % self.dp,
                "pp": rank // (self.tp * self.dp)}
