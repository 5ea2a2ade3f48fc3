"""Typed, frozen config dataclasses loaded from YAML with `a.b.c=value` CLI overrides."""

from mcore_rl.config.checks import require_above, require_at_least, require_in_range, require_one_of
from mcore_rl.config.loader import (
    CONFIG_ERROR_EXIT,
    ConfigError,
    ConfigErrors,
    ConfigFileError,
    check_config,
    from_dict,
    load_config,
    parse_overrides,
    raise_errors,
    run_checks,
    to_dict,
    write_config,
)

__all__ = [
    "CONFIG_ERROR_EXIT",
    "ConfigError",
    "ConfigErrors",
    "ConfigFileError",
    "check_config",
    "from_dict",
    "load_config",
    "parse_overrides",
    "raise_errors",
    "require_above",
    "require_at_least",
    "require_in_range",
    "require_one_of",
    "run_checks",
    "to_dict",
    "write_config",
]
