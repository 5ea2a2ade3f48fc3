"""The config reference, generated from the config dataclasses themselves.

A config class documents its fields in its docstring as `name: text` entries (several names
may share one: `temperature / max_new_tokens: sampling.`); an entry runs until the next entry,
a blank line, or an unindented line that starts a new sentence. A field with no entry gets
its base class's text (a subclass that changes a default, e.g. `CriticOptimizerConfig`,
documents only that field), else the first sentence that names it.
`render_reference(RLConfig)` walks the class and every nested config dataclass and writes one
Markdown table row per dotted key: its type, its default (a nested section's defaults are
those of the parent's default instance) and its text. `scripts/gen_config_reference.py` writes
docs/reference/config.md with it; tests/config/test_reference.py checks the file is current.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

# An entry's names: `name`, `a / b`, optionally followed by ` null` / ` set` (a case of it),
# then a colon. It starts a line (after an optional `- ` bullet) or follows a sentence's end.
_ENTRY = re.compile(
    r"(?:(?<=^)|(?<=\n)|(?<=\n- )|(?<=^- )|(?<=\. )|(?<=\.  ))"
    r"(?P<names>[a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*)(?: null| set)?:(?=\s)"
)

HEADER = """# Config reference

Generated from the config dataclasses' docstrings by `python scripts/gen_config_reference.py`
(do not edit by hand; `tests/config/test_reference.py` fails when it is out of date). Every
key can be set in the YAML or on the command line as `a.b.c=value`; a value the class refuses
is reported at load with the key named. A default of `null` that the run derives (lengths,
micro batch sizes) is filled in in `RUN_DIR/config.yaml`.
"""


def field_docs(cls: type) -> dict[str, str]:
    """Each field of `cls` → the text its class docstring gives it, else its nearest base
    config class's, else the first sentence of its own docstring that names it ("" when
    none)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    names = {f.name for f in dataclasses.fields(cls)}
    entries = [
        m
        for m in _ENTRY.finditer(doc)
        if any(n.strip() in names for n in m.group("names").split("/"))
    ]
    out: dict[str, str] = {}
    for i, m in enumerate(entries):
        end = entries[i + 1].start() if i + 1 < len(entries) else len(doc)
        text = doc[m.end() : end]
        text = re.split(r"\n\n|\n(?=[A-Z])", text)[0]  # a blank line or a new paragraph
        text = " ".join(text.split()).removesuffix(" -").strip()
        for name in (n.strip() for n in m.group("names").split("/")):
            if name in names and name not in out:
                out[name] = text
    for base in cls.__mro__[1:]:  # a field a subclass inherits: the base's text
        if dataclasses.is_dataclass(base):
            for name, text in field_docs(base).items():
                if name in names and name not in out and text:
                    out[name] = text
    # A field with no entry of its own: the first sentence of the docstring that names it.
    flat = " ".join(doc.split())
    sentences = re.split(r"(?<=\.)\s+(?=[A-Z`(a-z])", flat)
    for name in names - out.keys():
        hit = next((s for s in sentences if re.search(rf"(?<![\w.]){name}(?!\w)", s)), "")
        out[name] = hit.removeprefix("- ")
    return out


def _first_sentence(cls: type) -> str:
    doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
    m = re.match(r"(.+?\.)(\s|$)", doc)
    return m.group(1) if m else doc


def _config_class(hint: Any) -> type | None:
    """The dataclass in a field's type (`X`, `X | None`), or None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(f: dataclasses.Field) -> str:
    """The field's annotation as written; a `Derived[X]` one as `X | None` (null = derived)."""
    text = str(f.type)
    if text.startswith("Derived[") and text.endswith("]"):
        return f"{text[len('Derived[') : -1]} | None"
    return text


def rows(cls: type, default: Any = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field of `cls` and, recursively,
    of its nested config dataclasses; `default` is the instance whose values are the
    defaults (None: the class's own defaults)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if default is not None:
            value = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        key = prefix + f.name
        sub = _config_class(hints[f.name])
        type_name = _cell(_type_name(f))
        if sub is not None and dataclasses.is_dataclass(value):
            text = docs.get(f.name) or _first_sentence(sub)
            out.append((key, type_name, "(section)", _cell(text)))
            out += rows(sub, value, key + ".")
            continue
        shown = "(required)" if value is dataclasses.MISSING else _value(value)
        out.append((key, type_name, f"`{_cell(shown)}`", _cell(docs.get(f.name, ""))))
        if sub is not None:  # an optional section, null by default: its keys when set
            out += [(k, t, d, x) for k, t, d, x in rows(sub, None, key + ".")]
    return out


def render_reference(cls: type) -> str:
    """The Markdown reference of config class `cls`: one table per top-level section."""
    lines = [HEADER]
    top: list[tuple[str, str, str, str]] = []
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in rows(cls):
        head = row[0].split(".")[0]
        if "." in row[0] or row[2] == "(section)":
            sections.setdefault(head, []).append(row)
        else:
            top.append(row)
    table = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"## Top level ({cls.__name__})", "", _cell(_first_sentence(cls)), "", *table]
    lines += [f"| `{k}` | `{t}` | {d} | {x} |" for k, t, d, x in top]
    for head, section in sections.items():
        lines += ["", f"## {head}", "", *table]
        lines += [f"| `{k}` | `{t}` | {d} | {x} |" for k, t, d, x in section]
    return "\n".join(lines) + "\n"
