"""Config fields that name a file relative to the config file that sets them.

A field declares it in its metadata (`field(default=None, metadata=relative_to_config(code_ref))`):
the loader (`check_config`) then rewrites the value a YAML file gives against that file's
directory, and the value an `a.b.c=value` override gives against the working directory, so the
config it builds holds an absolute path. Written back (`write_config`), it loads again from
anywhere; a dataclass built in code (`from_dict`) is left as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_type_hints

RELATIVE_TO_CONFIG = "relative_to_config"


def relative_to_config(resolve: Callable[[str, Path], str]) -> dict:
    """The field metadata saying how to make the field's value absolute: `resolve(value,
    directory)`."""
    return {RELATIVE_TO_CONFIG: resolve}


def code_ref(value: str, base: Path) -> str:
    """ "path/to/file.py:function" relative → "<base>/path/to/file.py:function" (absolute,
    normalized); "package.module:function" and absolute paths are left as they are."""
    module, sep, name = value.rpartition(":")
    if not sep or not (module.endswith(".py") or "/" in module):
        return value
    path = Path(module).expanduser()
    if path.is_absolute():
        return value
    return f"{(base / path).resolve()}:{name}"


def resolve_relative(cls: type, data: Any, base: Path) -> Any:
    """`data` (a mapping for dataclass `cls`, as read from YAML or overrides) with every field
    that is relative to its config rewritten against `base`; anything it does not recognise
    is left for the loader to judge."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data
    hints = get_type_hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        if f.name not in out:
            continue
        value = out[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = resolve_relative(hints[f.name], value, base)
        elif RELATIVE_TO_CONFIG in f.metadata and isinstance(value, str):
            out[f.name] = f.metadata[RELATIVE_TO_CONFIG](value, base)
    return out


__all__ = ["RELATIVE_TO_CONFIG", "code_ref", "relative_to_config", "resolve_relative"]
