"""mcore_rl.compat.lazy_compile: importing megatron-core does not import torch's compiler, its
fused functions still compile on first call with megatron's options, and nothing outside
megatron's import sees a different `torch.compile`.

Each probe runs in a spawned process: whether torch's dynamo is imported is process state, and
the pytest process may have imported megatron already.
"""

from __future__ import annotations

import sys

from mcore_rl.launch.spawn import run_on_ranks


def _import_megatron_trainer(rank, world):
    import torch

    import mcore_rl.megatron.train  # noqa: F401 — imports megatron-core's fusions
    from megatron.core.fusions import fused_bias_gelu

    from mcore_rl.compat.lazy_compile import DeferredCompile

    fused = fused_bias_gelu.bias_gelu
    return {"dynamo_imported": "torch._dynamo" in sys.modules,
            "inductor_imported": "torch._inductor" in sys.modules,
            "fused_is_deferred": isinstance(fused, DeferredCompile),
            "fused_compiled": isinstance(fused, DeferredCompile) and fused.compiled,
            "fused_name": fused.__name__,
            "torch_compile_restored": not hasattr(torch.compile, "_mcore_rl_deferring")}


def test_importing_megatron_leaves_torch_compiler_out_and_torch_compile_as_it_was():
    seen = run_on_ranks(_import_megatron_trainer, 1, timeout_s=240,
                        fresh_processes=True)[0]  # megatron's first import (module doc)
    assert seen == {"dynamo_imported": False, "inductor_imported": False,
                    "fused_is_deferred": True, "fused_compiled": False,
                    "fused_name": "bias_gelu", "torch_compile_restored": True}


def _scale_and_shift(x, y):
    return x * 3.0 + y


class _Scaler:
    def __init__(self, factor):
        self.factor = factor

    def scale(self, x):
        return x * self.factor


def _compile_on_first_call(rank, world):
    import torch

    from mcore_rl.compat.lazy_compile import DeferredCompile, deferring

    calls = []

    def counting_compile(model, **options):
        calls.append(options)
        return torch.compile(model, **options)

    compile_later = deferring(counting_compile)
    direct = compile_later(_scale_and_shift, backend="eager")
    factory = compile_later(backend="eager", dynamic=False)(_scale_and_shift)
    before = {"calls": len(calls), "dynamo": "torch._dynamo" in sys.modules,
              "deferred": all(isinstance(f, DeferredCompile) for f in (direct, factory))}
    x, y = torch.arange(4.0), torch.ones(4)
    outputs = [direct(x, y), direct(x, y), factory(x, y)]
    _Scaler.deferred_scale = compile_later(_Scaler.scale, backend="eager")  # like megatron's
    method_ok = torch.equal(_Scaler(2.0).deferred_scale(x), x * 2.0)
    module = compile_later(torch.nn.Linear(2, 2), backend="eager")  # modules: compiled at once
    return {"before": before, "calls": calls[:2], "calls_total": len(calls),
            "compiled": direct.compiled and factory.compiled,
            "dynamo_after": "torch._dynamo" in sys.modules,
            "outputs_equal": all(torch.equal(o, x * 3.0 + y) for o in outputs),
            "method_ok": method_ok,
            "module_is_compiled_module": type(module).__name__ == "OptimizedModule"}


def test_a_deferred_function_compiles_once_on_first_call_with_its_options():
    seen = run_on_ranks(_compile_on_first_call, 1, timeout_s=240,
                        fresh_processes=True)[0]  # dynamo not yet imported (module doc)
    assert seen["before"] == {"calls": 0, "dynamo": False, "deferred": True}
    assert seen["calls"] == [{"backend": "eager"}, {"backend": "eager", "dynamic": False}]
    # the two functions and the method once each (not per call), the module at once
    assert seen["calls_total"] == 4
    assert seen["compiled"] and seen["dynamo_after"] and seen["outputs_equal"]
    assert seen["method_ok"]  # a deferred method binds its instance
    assert seen["module_is_compiled_module"]


def test_install_is_idempotent_and_a_no_op_once_megatron_is_imported(monkeypatch):
    from mcore_rl.compat import lazy_compile

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    hooks = [f for f in sys.meta_path if isinstance(f, lazy_compile._MegatronFinder)]
    assert len(hooks) == 1  # `import mcore_rl` installed it
    assert lazy_compile.install() is False
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f not in hooks])
    monkeypatch.setitem(sys.modules, "megatron.core", object())
    assert lazy_compile.install() is False  # megatron already imported: nothing to defer
    monkeypatch.delitem(sys.modules, "megatron.core")
    assert lazy_compile.install() is True
    assert isinstance(sys.meta_path[0], lazy_compile._MegatronFinder)
