"""`null = derived` fields: a value the config's owner decides from other fields when the user
leaves it null (max_new_tokens from the model's context, seq_len from the sample's tokens, a
micro batch size from the rows each rank gets).

Such a field is typed as the value it holds once derived — `seq_len: Derived[int] = DERIVED` —
because every reader sees the config after its owner derived it (the loader returns
`cfg.derived()` for a class that has that method), as Hydra's `MISSING` fields are typed as
their value. The loader accepts null for it; only the owner's derivation reads the null.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, get_args, get_origin

T = TypeVar("T")

NULL_IS_DERIVED = "null = derived"

# a field the config's owner derives when it is null (see the module docstring)
Derived = Annotated[T, NULL_IS_DERIVED]

# the default of a Derived field: null until its owner derives it
DERIVED: Any = None


def derived_field_type(hint: Any) -> Any | None:
    """The value type of a `Derived[X]` type hint (X), or None for any other hint. Needs the
    hint with its annotations (`typing.get_type_hints(cls, include_extras=True)`)."""
    if get_origin(hint) is Annotated and NULL_IS_DERIVED in get_args(hint)[1:]:
        return get_args(hint)[0]
    return None
