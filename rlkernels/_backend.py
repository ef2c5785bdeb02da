"""Which implementation serves a call: by the tensors' device, or forced by RLKERNELS_BACKEND.

- ``reference``: the eager formulas of ``rlkernels.reference`` (materialize everything).
- ``torch``: chunked PyTorch with the fused kernels' memory behaviour.
- ``triton``: the Triton kernels; on CPU tensors they run under Triton's interpreter.
- ``csrc``: the compiled C++/CUDA extension (scans and segmented reductions only).

The variable is read at every call, so tests and users can switch it at run time.
"""
from __future__ import annotations

import contextlib
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


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The kernel variant the environment variable ``name`` picks (one of ``choices``, case and blanks ignored), or
    ``""`` when it is unset or empty (the op's default). Anything else is refused by name. Read at every call, like
    ``RLKERNELS_BACKEND``: the switches between an op's kernels (``RLKERNELS_LINEAR_FWD``,
    ``RLKERNELS_LOGITS_POLICY``, ``RLKERNELS_WHITEN``) that the benchmarks time side by side."""
    value = os.environ.get(name, "").strip().lower()
    if value and value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
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
    inputs' own dtype where a kernel says so) whatever autocast context the caller is in. Outside autocast (or
    for a device without it, e.g. meta tensors while tracing) there is nothing to turn off: a null context, which
    costs a small op's call ~5 us less than entering and leaving ``torch.autocast``. The availability check is
    skipped while torch.compile traces (its tensors are on real devices), since dynamo of torch 2.11 cannot
    trace ``torch.amp.is_autocast_available`` (every fullgraph compile of an op failed there)."""
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


# what the Triton and csrc kernels load; float64 stays on torch, which computes in float64 (the kernels would round
# it to float32 first: masked_whiten of 1e6 + 1e-4·noise then loses all of the noise)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def csrc_available(device: torch.device) -> bool:
    """The compiled extension can serve tensors on ``device`` (building it at first use)."""
    from rlkernels import _extension

    if device.type == "cpu":
        return _extension.available()
    return device.type == "cuda" and _extension.has_cuda_kernels()


def resolve(device: torch.device, supported: tuple[str, ...], dtype: torch.dtype | None = None, *,
            cuda_default: str = "triton") -> str:
    """The one place a backend is chosen: the name of the implementation that serves tensors of ``dtype`` on
    ``device``, for an op implementing the backends in ``supported``.

    ``RLKERNELS_BACKEND`` wins when the op implements it and it can run here (csrc needs the extension for
    that device, triton needs triton; both a 16/32-bit float ``dtype``: float64 stays on torch); otherwise the
    default: on CUDA the op's ``cuda_default`` ("csrc" where a GPU measurement chose the CUDA kernel, when the
    extension has CUDA kernels), else Triton; the csrc extension on the CPU for the ops that have one; chunked
    PyTorch elsewhere. Ops call this at run time, inside their custom op, so ``torch.compile`` never traces the
    extension's first build.
    """
    kernel_dtype = dtype is None or dtype in TRITON_DTYPES
    triton_ok = "triton" in supported and has_triton() and kernel_dtype
    csrc_ok = "csrc" in supported and kernel_dtype  # and csrc_available(device), asked last: it builds the extension
    forced = forced_backend()
    if forced is not None and forced in supported:
        if forced == "triton" and not has_triton():
            raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported")
        if forced == "triton" and triton_ok or forced == "csrc" and csrc_ok and csrc_available(device) \
                or forced in ("torch", "reference"):
            return forced
    if device.type == "cuda" and cuda_default == "csrc" and csrc_ok and csrc_available(device):
        return "csrc"
    if device.type == "cuda" and triton_ok:
        return "triton"
    if csrc_ok and device.type == "cpu" and csrc_available(device):
        return "csrc"
    return "torch"


def implementation(impls: dict, x: torch.Tensor):
    """The entry of an op's table ``impls`` (backend name -> function) that serves tensors like ``x``."""
    return impls[resolve(x.device, tuple(impls), x.dtype)]


def serves_reference(impls: dict, x: torch.Tensor) -> bool:
    """Whether tensors like ``x`` go to ``rlkernels.reference``'s eager formulas rather than to ``impls``.

    The reference backend is served before an autograd op, never as an entry of its table: its gradients
    are autograd's through the eager formulas, and autograd records nothing inside a custom op."""
    return resolve(x.device, ("reference", *impls), x.dtype) == "reference"
