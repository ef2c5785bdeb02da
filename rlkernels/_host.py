"""Host-side helpers shared by the launchers of every op family: dtype names, strides, masks.

(Validation lives in ``rlkernels._checks``, backend choice in ``rlkernels._backend``.)
"""
from __future__ import annotations

import dataclasses

import torch

# Triton's names for the tensor dtypes the kernels load (ahead-of-time signatures use them).
TRITON_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with stride 1 along its last dimension (a copy only when it has none): kernels then read
    contiguous runs (vector loads, ``cp.async`` staging)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def mask_u8(mask: torch.Tensor) -> torch.Tensor:
    """A mask as uint8 0/1 for a kernel: a bool mask is reinterpreted (no copy), a numeric one is
    compared with 0 (any nonzero value counts as 1)."""
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return (mask != 0).view(torch.uint8)


# torch.library schema types of the option fields' annotations (strings under ``from __future__ import annotations``)
_SCHEMA_TYPES = {"float": "float", "float | None": "float?", "int": "int", "int | None": "int?", "bool": "bool", "str": "str"}


def op_schema(tensors: str, options: type, returns: str) -> str:
    """A ``torch.library.custom_op`` schema: the op's tensor arguments (``"Tensor x, Tensor? y"``), then one typed
    argument per field of the frozen dataclass ``options``, in field order and under the field's name: the op
    receives them as ``*option_values(opt)`` and rebuilds ``options(*args)``; ``returns`` as in a schema."""
    fields = ", ".join(f"{_SCHEMA_TYPES[str(f.type)]} {f.name}" for f in dataclasses.fields(options))
    return f"({tensors}, {fields}) -> {returns}"


def option_values(opt) -> tuple:
    """The fields of the frozen options dataclass ``opt``, in field order: a custom op's trailing arguments (see
    :func:`op_schema`). Not ``dataclasses.astuple``, which deep-copies every value: torch 2.11's dynamo cannot
    trace ``copy.deepcopy``, so every ``torch.compile(fullgraph=True)`` of an op failed there."""
    return tuple(getattr(opt, f.name) for f in dataclasses.fields(opt))


def option_dict(opt) -> dict:
    """The fields of the frozen options dataclass ``opt`` by name (``dataclasses.asdict`` without its deep copy,
    for the reason given at :func:`option_values`)."""
    return {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}


def lse_merge(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor | None = None):
    """Merges online log-sum-exp partials of the same rows, taken over disjoint chunks of their columns (vocabulary
    chunks, Triton vocabulary splits), along dim 0: ``(m_all [N], s_all [N], u_all [N] or None)``.

    Partial ``k`` holds, for the columns ``z`` of its chunk, ``m[k]`` (their max, or any finite floor where the chunk
    saw nothing finite: then ``s[k] = u[k] = 0`` and no ``0 · inf`` arises), ``s[k] = Σ exp(z - m[k])`` and,
    optionally, ``u[k] = Σ exp(z - m[k]) (z - m[k])`` (the entropy's numerator). Each is re-centred on the row max
    ``m_all``: ``s_all = Σ_k e^(m[k] - m_all) s[k]``, ``u_all = Σ_k e^(m[k] - m_all) (u[k] + s[k] (m[k] - m_all))``.
    The row max and ``s_all`` stay apart (``log p = (z - m_all) - log s_all``): one rounded ``lse`` would carry
    ``ulp(m_all)`` into every ``log p``. ``m``, ``s``, ``u``: ``[S, N]``."""
    m_all = m.amax(0)  # [N]
    scale = torch.exp(m - m_all)  # [S, N]
    s_all = (s * scale).sum(0)  # [N]
    u_all = None if u is None else (scale * (u + s * (m - m_all))).sum(0)  # [N]
    return m_all, s_all, u_all


def refuse_double_backward(op: str) -> None:
    """Raise in an op's backward when it runs with ``create_graph=True`` (grad mode on): the backward scales
    gradients formed in the forward (or saved there), which are constants to autograd, so a second derivative
    through them would come out as silent zeros. Called first in every registered backward."""
    import torch

    if torch.is_grad_enabled():
        raise RuntimeError(f"rlkernels.{op} does not support double backward (create_graph=True): its backward "
                           "uses gradients formed as constants; use rlkernels.reference's eager formulas for "
                           "higher derivatives")


def no_grads(options: type) -> tuple[None, ...]:
    """An autograd op's gradients for its option arguments: one None per field of the ``options`` dataclass."""
    import dataclasses

    return (None,) * len(dataclasses.fields(options))
