"""Which compiled variants of each Triton kernel a sequence of calls would need on a GPU, with no GPU.

Triton compiles a kernel once per *specialization*: its arguments' types, each integer's "is 1" / "divisible by
16" class, each pointer's 16-byte alignment, and the ``constexpr`` values. A call whose token count, chunk size or
buffer offsets change those classes compiles the kernel again (seconds for a Hopper GEMM kernel), so an RL
trainer, whose batch shapes change every step, pays compiles in later steps (tests/test_specializations.py).
Run the calls on CPU tensors with the Triton backend forced (the kernels run under the interpreter) inside
:class:`record_specializations`: every launch's key is computed by Triton's own binder for an sm_90 target, the
key its JIT cache would use there."""
from __future__ import annotations

import collections
import contextlib

from rlkernels import _triton


def _binder(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


@contextlib.contextmanager
def record_specializations():
    """Inside the block, every :class:`rlkernels._triton.CompiledOrInterpreted` launch also records its sm_90
    specialization key; yields a dict kernel name -> set of keys (the variants a GPU would compile)."""
    seen: dict[str, set] = collections.defaultdict(set)
    binders = {}
    original = _triton.CompiledOrInterpreted.launch

    def launch(self, grid, *args, **kwargs):
        binder = binders.get(id(self))
        if binder is None:
            binder = binders[id(self)] = _binder(self)
        _, specialization, options = binder(*args, **kwargs)
        seen[self.fn.__name__].add((_hashable(specialization), _hashable(options)))
        return original(self, grid, *args, **kwargs)

    _triton.CompiledOrInterpreted.launch = launch
    try:
        yield seen
    finally:
        _triton.CompiledOrInterpreted.launch = original
