"""Triton device functions shared by the kernels of every op family: block reductions and ``expm1``.

Reductions go through ``tl.reduce`` with the standard library's combine functions, never ``tl.sum`` /
``tl.max``: those are ``@triton.jit`` library functions, which a kernel that rlkernels interprets per call
(``RLKERNELS_BACKEND=triton`` on CPU tensors, see ``rlkernels._triton``) cannot call, while ``tl.reduce`` with
these combiners is exactly what ``tl.sum`` / ``tl.max`` expand to when compiled and takes numpy's fast path
when interpreted.
"""
from __future__ import annotations

from rlkernels._triton import HAS_TRITON, jit, tl

_sum_combine = tl.standard._sum_combine if HAS_TRITON else None
_max_combine = tl.standard._elementwise_max if HAS_TRITON else None


@jit
def block_sum(x, axis: tl.constexpr):
    """Sum of ``x`` along ``axis`` (float32 in, float32 out)."""
    return tl.reduce(x, axis, _sum_combine)


@jit
def block_max(x, axis: tl.constexpr):
    """Maximum of ``x`` along ``axis`` (NaN propagates as in ``tl.maximum``)."""
    return tl.reduce(x, axis, _max_combine)


@jit
def expm1(x):
    """``exp(x) - 1`` without cancellation near 0: a degree-9 Taylor polynomial for |x| < 0.5 (truncation error
    below 1e-9 relative), ``exp(x) - 1`` elsewhere (no cancellation there)."""
    small = tl.abs(x) < 0.5
    xs = tl.where(small, x, 0.0)
    poly = 1.0 + xs / 9.0
    poly = 1.0 + xs / 8.0 * poly
    poly = 1.0 + xs / 7.0 * poly
    poly = 1.0 + xs / 6.0 * poly
    poly = 1.0 + xs / 5.0 * poly
    poly = 1.0 + xs / 4.0 * poly
    poly = 1.0 + xs / 3.0 * poly
    poly = 1.0 + xs / 2.0 * poly
    return tl.where(small, xs * poly, tl.exp(x) - 1.0)
