"""Triton kernels that run compiled on CUDA tensors and interpreted on CPU tensors, in one process.

Triton picks interpreter or compiler once, when ``@triton.jit`` runs
(``TRITON_INTERPRET`` at import time). rlkernels needs both in one process:
compiled kernels for CUDA tensors and for the ahead-of-time compile tests,
the interpreter for ``RLKERNELS_BACKEND=triton`` on CPU tensors. :func:`jit`
returns a :class:`CompiledOrInterpreted`: a ``JITFunction`` (so the compiler and
``triton.compile`` accept it) that also knows how to run under the interpreter.

Without triton the package still imports: :func:`jit` then returns a stub that
raises when launched, so the kernels can be defined at module level either way.
"""
from __future__ import annotations

import contextlib
import functools

import torch

try:  # triton is optional at import time: the package works without it on CPU
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as _error:  # pragma: no cover - exercised only where triton is missing (tests run it in a subprocess)
    triton = tl = InterpretedFunction = _patch_lang = JITFunction = None
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = _error


def _interpreter_scalar_index() -> None:
    """Make the interpreter turn a scalar tensor into a Python int the way Triton 3.7+ does.

    The interpreter holds a scalar as a NumPy array of shape ``(1,)``. Triton 3.6 converts it with
    ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"), so every interpreted
    kernel whose loop bound is computed (``range(0, v_end, ...)``) fails there; later Triton squeezes the array
    first. The GPU machines run Triton 3.6, and their CPU test cases use the interpreter: wrap the function
    that patches ``tl.tensor`` so ``__index__`` squeezes, as upstream does now. A no-op where that function is
    gone or already squeezes."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or "squeeze" in inspect.getsource(original):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if HAS_TRITON:
    _interpreter_scalar_index()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grid and chunk counts (no triton needed)."""
    return (a + b - 1) // b


class CompiledOrInterpreted(JITFunction if HAS_TRITON else object):
    """A ``@triton.jit`` function that runs compiled on CUDA tensors and interpreted on CPU tensors, in the same
    process.

    It is a ``JITFunction``: ``kernel[grid](...)``, ``triton.compile`` and the ahead-of-time tests see an ordinary
    compiled kernel, and compiled kernels inline it as a device function. :meth:`launch` picks by the tensors'
    device: CUDA tensors launch the compiled kernel, CPU tensors run it under Triton's interpreter (that is how
    ``RLKERNELS_BACKEND=triton`` tests the kernels without a GPU); an interpreted kernel calling it as a device
    function runs it interpreted too. (Only defined over ``JITFunction`` when triton imports; :func:`jit` never
    builds one otherwise.)
    """

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self._interpreted = None

    @property
    def interpreted(self) -> InterpretedFunction:
        """The same function under Triton's interpreter (built at first use)."""
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def __call__(self, *args, **kwargs):
        # Reached only when an interpreted kernel calls this as a device
        # function; compiled kernels inline it without calling Python.
        return _device_call(self.interpreted, *args, **kwargs)

    def launch(self, grid, *args, **kwargs):
        """Launch on ``grid``: compiled when the first tensor argument is on
        CUDA, interpreted when it is on the CPU."""
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:
            device = next(a.device for a in kwargs.values() if isinstance(a, torch.Tensor))
        if device.type == "cpu":
            with _library_functions_interpreted():
                return self.interpreted[grid](*args, **kwargs)
        return self[grid](*args, **kwargs)


def _device_call(function: InterpretedFunction, *args, **kwargs):
    """Call an interpreted device function, undoing its patch of triton.language
    afterwards (Triton's own device call leaves it patched, which breaks any
    later compilation in the same process)."""
    scope = _patch_lang(function.fn)
    try:
        return function.rewrite()(*args, **kwargs)
    finally:
        scope.restore()


_interpreted_library: dict = {}  # Triton library function -> its InterpretedFunction


def _call_interpreted(self, *args, **kwargs):
    """``JITFunction.__call__`` while an interpreted kernel runs: the library function ``self``, interpreted."""
    function = _interpreted_library.get(self.fn)
    if function is None:
        function = _interpreted_library[self.fn] = InterpretedFunction(self.fn)
    return _device_call(function, *args, **kwargs)


@contextlib.contextmanager
def _library_functions_interpreted():
    """Triton's own ``@triton.jit`` library functions (``tl.sum``, ``tl.zeros``,
    ``tl.max``...) were made compiled-only when triton was imported without
    ``TRITON_INTERPRET``; while an interpreted kernel runs, calls to them run
    interpreted too."""
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original


def _missing_triton(fn):
    """Without triton: a stand-in for the jitted ``fn`` that says why it cannot run, called or launched."""

    @functools.wraps(fn)
    def missing(*args, **kwargs):
        raise RuntimeError(f"triton is not installed ({TRITON_IMPORT_ERROR}); use RLKERNELS_BACKEND=torch")

    missing.launch = missing
    return missing


def jit(fn=None, **kwargs):
    """Drop-in for ``triton.jit`` returning a :class:`CompiledOrInterpreted` (a stub that raises when triton is
    not installed)."""

    def wrap(f):
        return CompiledOrInterpreted(f, **kwargs) if HAS_TRITON else _missing_triton(f)

    return wrap if fn is None else wrap(fn)
