"""Count the kernel launches a call would issue on CUDA, on CPU tensors, with no GPU.

Run a call on CPU tensors with the Triton backend forced (``RLKERNELS_BACKEND=triton``: the kernels run under
Triton's interpreter) inside :class:`count_launches`: it records every Triton kernel launch and every ATen
operator that would be a CUDA kernel (or a device-to-host copy), and skips what launches nothing there: views,
metadata, and uninitialised allocations (``torch.empty`` and kin). rlkernels' own custom ops are entered, not
counted: their implementations' operators and launches are what runs. What the interpreter does inside a
Triton launch (moving tensors to numpy) is not recorded.
"""
from __future__ import annotations

import torch
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from rlkernels import _triton

# ATen operators that allocate without writing or only read metadata: no kernel on CUDA
_NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::detach", "aten::lift_fresh", "aten::alias", "aten::_reshape_alias", "aten::sym_size", "aten::sym_stride",
    "aten::sym_numel", "aten::sym_storage_offset", "aten::size", "aten::stride", "aten::dim", "aten::is_contiguous",
}


def launches_kernel(func) -> bool:
    """Whether the ATen overload ``func`` runs a kernel (or a copy) on CUDA."""
    if func._schema.name in _NO_KERNEL:
        return False
    # a view: every output aliases an input (view, select, slice, unsqueeze, expand, unbind, as_strided, ...)
    return not (func.is_view or func._schema.name in ("aten::unbind", "aten::split", "aten::chunk"))


class count_launches(TorchDispatchMode):
    """Context manager; ``.launches`` lists what ran, in order: ``"triton:<kernel>"`` or the ATen overload."""

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []
        self._launch = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "rlkernels":  # enter the custom op: count what its implementation issues
            with self:
                return custom_ops.OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if launches_kernel(func):
            self.launches.append(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        if self._launch is None:  # the outermost entry patches the Triton launcher
            original = self._launch = _triton.CompiledOrInterpreted.launch
            launches = self.launches

            def launch(kernel, grid, *args, **kwargs):
                launches.append(f"triton:{kernel.fn.__name__}")
                with _disable_current_modes():  # the interpreter's own tensor work is not a launch
                    return original(kernel, grid, *args, **kwargs)

            _triton.CompiledOrInterpreted.launch = launch
            self._depth = 0
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            _triton.CompiledOrInterpreted.launch = self._launch
            self._launch = None
        return out
