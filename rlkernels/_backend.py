"""Which implementation serves a call: by the tensors' device, or forced by RLKERNELS_BACKEND.

- ``reference``: the eager formulas of ``rlkernels.reference`` (materialize everything).
- ``torch``: chunked PyTorch with the fused kernels' memory behaviour.
- ``triton``: the Triton kernels; on CPU tensors they run under Triton's interpreter.
- ``csrc``: the compiled C++/CUDA extension (scans and segmented reductions only).

The variable is read at every call, so tests and users can switch it at run time.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("reference", "torch", "triton", "csrc")
ENV_VAR = "RLKERNELS_BACKEND"


def forced_backend() -> str | None:
    """The backend named by ``RLKERNELS_BACKEND``, or None when unset/empty."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def has_triton() -> bool:
    from rlkernels._triton import HAS_TRITON

    return HAS_TRITON


def default_backend(device: torch.device) -> str:
    """Triton on CUDA (when importable), chunked PyTorch elsewhere."""
    if device.type == "cuda" and has_triton():
        return "triton"
    return "torch"


def select(device: torch.device, supported: tuple[str, ...] = ("reference", "torch", "triton")) -> str:
    """The backend for tensors on ``device``; ``supported`` lists what the op implements.

    A forced backend the op does not implement falls back to the default one, so
    ``RLKERNELS_BACKEND=csrc`` affects only the ops that have a csrc kernel.
    """
    forced = forced_backend()
    if forced is not None and forced in supported:
        if forced == "triton" and not has_triton():
            raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported")
        return forced
    return default_backend(device)


def float32_compute(device: torch.device):
    """A context in which autocast is off for ``device``: every op computes in float32 (or the
    inputs' own dtype where a kernel says so) whatever autocast context the caller is in."""
    return torch.autocast(device_type=device.type, enabled=False)
