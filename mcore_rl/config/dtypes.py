"""One dtype vocabulary for every config field and CLI flag: torch's names.

Each dtype has one name, torch's (`float32`, `bfloat16`, `float16`), which is also what HF
configs and vLLM use. The short spellings (`fp32`, `bf16`, `fp16`) are accepted on input
(YAML, `a.b=c` overrides, CLI flags) and normalized when the config is loaded, so code only ever
compares against the canonical name.
"""

from __future__ import annotations

from typing import Literal

from mcore_rl.config.loader import ConfigError

#: every dtype name any field accepts (canonical first, then the short spellings)
DtypeName = Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]

CANONICAL = ("float32", "bfloat16", "float16")
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(value: object, field: str, allowed: tuple[str, ...] = CANONICAL) -> str:
    """The canonical name of `value` (a name or short spelling), or a ConfigError naming
    `field` when it is not one of `allowed` (canonical names)."""
    name = ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in allowed:
        spellings = ", ".join(f"{a} ({short})" for short, a in ALIASES.items() if a in allowed)
        raise ConfigError(field, value, f"must be one of {spellings}")
    return name


def torch_dtype(name: str):
    """The torch dtype of a dtype name (canonical or short)."""
    import torch  # lazy: torch

    return getattr(torch, dtype_name(name, "dtype"))


def dtype_bytes(name: str) -> int:
    return BYTES[dtype_name(name, "dtype")]


def normalize_dtype_fields(
    config: object, *fields: str, allowed: tuple[str, ...] = CANONICAL
) -> None:
    """In a frozen dataclass's `__post_init__`: replace each named field's value with its
    canonical name (ConfigError naming the field otherwise)."""
    for field in fields:
        object.__setattr__(config, field, dtype_name(getattr(config, field), field, allowed))


__all__ = [
    "ALIASES",
    "BYTES",
    "CANONICAL",
    "DtypeName",
    "dtype_bytes",
    "dtype_name",
    "normalize_dtype_fields",
    "torch_dtype",
]
