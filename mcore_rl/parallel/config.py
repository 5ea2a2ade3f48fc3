"""The training grid's shape: how the actor (and critic/reference) are split over ranks."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config import ConfigError, require_at_least


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
    ep: expert-parallel size (mixture-of-experts models): each EP rank holds experts/ep of
        every layer's experts. As in megatron-core, the expert grid (etp · ep · expert-DP) is
        laid over the same ranks as the dense tp · dp ranks of a stage: etp · ep must divide
        tp · dp (EP2 with tp=1 needs dp=2; TP2·EP2 fits on 2 ranks with etp=1).
    etp: expert tensor-parallel size: each expert's MLP is split over etp ranks; None = tp
        (megatron-core's default). Training a MoE model at tp > 1 needs sequence_parallel
        (megatron-core 0.16.1's MoELayer refuses to train without it; forward-only runs).
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        require_at_least(self, 1, "tp", "pp", "dp", "ep")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ConfigError(
                "vpp",
                self.vpp,
                "virtual pipeline needs vpp >= 2 and pp >= 2 (use null to turn it off)",
            )
        require_at_least(self, 1, "etp", optional=True, note="or null: the same as tp")
        if (self.tp * self.dp) % (self.expert_tp * self.ep):
            raise ConfigError(
                "ep",
                self.ep,
                f"etp * ep = {self.expert_tp}*{self.ep} must divide "
                f"tp * dp = {self.tp}*{self.dp} (the expert grid "
                "lies on the ranks of one pipeline stage)",
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel", True, "needs tp > 1")
        uneven = (self.first_stage_layers, self.last_stage_layers)
        if any(v is not None for v in uneven):
            if self.pp < 2:
                raise ConfigError(
                    "first_stage_layers", self.first_stage_layers, "uneven stages need pp >= 2"
                )
            if self.vpp is not None:
                raise ConfigError("vpp", self.vpp, "uneven stages and vpp cannot be combined")
            require_at_least(self, 1, "first_stage_layers", "last_stage_layers", optional=True)

    def check_model(self, spec) -> None:
        """Raise ConfigError unless a model of `spec`'s shape splits on this grid: tp divides
        the attention heads, the key-value heads (Megatron splits whole query groups) and the
        FFN width, and the layers split over the pipeline stages (see stage_layer_counts)."""
        for what, count in (
            ("num_attention_heads", spec.heads),
            ("num_key_value_heads", spec.kv_heads),
            ("intermediate_size", spec.ffn),
        ):
            if count % self.tp and not (what == "intermediate_size" and spec.is_moe):
                raise ConfigError("tp", self.tp, f"does not divide {what}={count}")
        self._check_experts(spec)
        self.stage_layer_counts(spec.layers)

    def _check_experts(self, spec) -> None:
        """EP must split the experts evenly and expert-TP each expert's MLP; EP needs experts."""
        if not spec.is_moe:
            if self.ep > 1:
                raise ConfigError(
                    "ep",
                    self.ep,
                    f"needs a mixture-of-experts model ({spec.architecture} has no experts)",
                )
            return
        if spec.num_experts % self.ep:
            raise ConfigError("ep", self.ep, f"does not divide num_experts={spec.num_experts}")
        if spec.moe_ffn % self.expert_tp:
            raise ConfigError(
                "etp", self.expert_tp, f"does not divide moe_intermediate_size={spec.moe_ffn}"
            )

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (etp, defaulting to tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: replicas of each expert within a stage."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage (before VPP chunking), validated against `num_layers`."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            per_chunk = self.pp * (self.vpp or 1)
            if num_layers % per_chunk:
                raise ConfigError(
                    "pp", self.pp, f"pp * vpp = {per_chunk} does not divide num_layers={num_layers}"
                )
            return [num_layers // self.pp] * self.pp
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if (
            rest < 0
            or (middle_stages == 0 and rest != 0)
            or (middle_stages and (rest % middle_stages or rest == 0))
        ):
            raise ConfigError(
                "first_stage_layers",
                first,
                f"with last_stage_layers={last} and pp={self.pp}, the remaining "
                f"{rest} of num_layers={num_layers} do not split evenly over "
                f"{middle_stages} middle stages",
            )
        middle = [rest // middle_stages] * middle_stages if middle_stages else []
        return (
            ([first] if first is not None else []) + middle + ([last] if last is not None else [])
        )

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
        return {
            (p, v): range((v * self.pp + p) * per_chunk, (v * self.pp + p + 1) * per_chunk)
            for p in range(self.pp)
            for v in range(self.vpp)
        }

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        """Global training rank of grid coordinates, in Megatron's default order tp-cp-ep-dp-pp
        (tp fastest, pp slowest; cp = ep = 1)."""
        return tp + self.tp * (dp + self.dp * pp)

    def coords_of(self, rank: int) -> dict[str, int]:
        """Inverse of `rank_of`: {"tp": ..., "pp": ..., "dp": ...}."""
        return {
            "tp": rank % self.tp,
            "dp": (rank // self.tp) % self.dp,
            "pp": rank // (self.tp * self.dp),
        }

    def expert_coords_of(self, rank: int) -> dict[str, int]:
        """A rank's place on the expert grid, in megatron-core's expert order tp-ep-dp-pp (over
        the same ranks of a stage as the dense tp-dp order): {"etp", "ep", "edp", "pp"}."""
        within = rank % (self.tp * self.dp)
        return {
            "etp": within % self.expert_tp,
            "ep": (within // self.expert_tp) % self.ep,
            "edp": within // (self.expert_tp * self.ep),
            "pp": rank // (self.tp * self.dp),
        }
