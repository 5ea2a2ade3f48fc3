"""megatron-core's import without torch's compiler: `torch.compile` deferred to first call.

megatron-core decorates ~40 fused functions with `torch.compile` at import
(`megatron.core.jit.jit_fuser`), and each decoration imports torch's dynamo and inductor:
1.6 of the 4.4 CPU-s it takes an actor rank to import our trainer (measured on the 2-core CPU
machine), paid by every rank and every spawned test rank, though a CPU run never calls one of
those functions and a GPU run calls them only with `*_fusion` options on.

`install()` puts an import hook in front of `sys.meta_path`: while any `megatron` module
executes, `torch.compile` applied to a plain function returns `DeferredCompile`, which calls
the real `torch.compile` with the same options on its first call. torch.compile itself compiles
on first call, so what runs is unchanged; only the import of the compiler moves to that call.
Modules, `torch.compile(mode=...)` factories and everything outside megatron's import go to
torch unchanged. This module imports neither torch nor megatron, so installing it is free.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
import types
from typing import Any, Callable

_lock = threading.RLock()
_depth = 0  # megatron modules executing right now (imports nest)
_real_compile: Callable | None = None


class DeferredCompile:
    """`torch.compile(fn, **options)` made on the first call instead of at decoration."""

    def __init__(self, real_compile: Callable, fn: Callable, options: dict[str, Any]):
        self._real_compile, self._fn, self._options = real_compile, fn, options
        self._compiled: Callable | None = None
        functools.update_wrapper(self, fn)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __get__(self, instance, owner=None):
        # a decorated method (megatron has a few) binds like the function torch.compile returns
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = self._real_compile(self._fn, **self._options)
        return self._compiled(*args, **kwargs)


def deferring(real_compile: Callable) -> Callable:
    """A `torch.compile` that defers plain functions (see the module doc)."""

    def compile_later(model=None, **options):
        if model is None:  # @torch.compile(mode=...): a decorator factory
            return lambda fn: compile_later(fn, **options)
        if isinstance(model, types.FunctionType):
            return DeferredCompile(real_compile, model, options)
        return real_compile(model, **options)

    compile_later._mcore_rl_deferring = True
    return compile_later


def _enter() -> None:
    global _depth, _real_compile
    import torch  # lazy: torch

    with _lock:
        if _depth == 0:
            _real_compile = torch.compile
            torch.compile = deferring(_real_compile)
        _depth += 1


def _exit() -> None:
    global _depth, _real_compile
    import torch  # lazy: torch

    with _lock:
        _depth -= 1
        if _depth == 0:
            torch.compile, _real_compile = _real_compile, None


class _DeferringLoader(importlib.abc.Loader):
    """Runs the wrapped loader's module with `torch.compile` deferring."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader  # resources, source and reloads see the real loader
        _enter()
        try:
            self._loader.exec_module(module)
        finally:
            _exit()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _MegatronFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron` modules as the rest of `sys.meta_path` does; wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron" and not fullname.startswith("megatron."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Put the hook in front of `sys.meta_path` (idempotent). False when it is already there
    or megatron-core was imported before it (nothing left to defer)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _MegatronFinder())
    return True


__all__ = ["DeferredCompile", "deferring", "install"]
