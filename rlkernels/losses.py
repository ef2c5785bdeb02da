"""Fused RL losses: ``kl_penalty``, ``policy_loss`` (PPO/GRPO/GSPO clipped surrogate) and ``value_loss``.

One fused pass per call computes, for every token, the loss term *and* its
gradient, plus per-row partial sums (mask count, loss sum, metric sums). The
tiny reduction over rows (loss for the chosen ``agg`` mode, metrics, and the
per-row weight ``dloss/dx_bt = w_b · m_bt`` of ``rlkernels.reference.agg_weights``)
is one more launch (``_reduce_kernel``, one program). The backward pass only
scales the saved per-token gradients by ``upstream · w_b`` and rounds them to
their dtypes, all of them in one launch (``_scale_rows_kernel``): nothing is
recomputed. So on CUDA a ``policy_loss`` or ``value_loss`` call is 2 launches
forward (3 with a non-bool mask, which is compared with 0 first) and 1 backward
(tests/test_losses.py counts them).

Saved gradients are float32 (``m · dx/dinput``, before the agg weight), so the
gradient handed back is rounded to the input dtype exactly once, as eager
PyTorch does.

Gradients flow to ``logp``, ``ref_logp`` and ``entropy`` (policy), ``values``
(value loss), ``logp`` and ``ref_logp`` (KL). ``old_logp``, ``advantages``,
``old_values``, ``returns`` and ``mask`` are treated as constants (detached), as
they are in every PPO/GRPO trainer.

Backends: each op's implementations sit in a table (``_KL_IMPLS``, ``_POLICY_IMPLS``,
``_VALUE_IMPLS``) that the op indexes, at run time and inside the op, with
``rlkernels._backend.resolve``. Options travel as one frozen dataclass per op whose
field names are the public keyword arguments, down to the kernels.

Order: Triton kernels -> launchers (validate, allocate, launch) -> torch.library ops -> their autograd.Functions ->
public functions.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from rlkernels import _backend, _checks
from rlkernels import packing as _packing
from rlkernels import reference as _ref
from rlkernels._device import block_sum
from rlkernels._host import (
    autograd_function, call, custom_op, mask_u8, op_schema, option_dict, option_values, options_from,
    refuse_double_backward, unit_stride,
)
from rlkernels._triton import HAS_TRITON, cdiv, jit, tl
from rlkernels.reference import AGG_MODES, KL_ESTIMATORS, RATIO_MODES
from rlkernels.softmax import _bf16_round_bits


def _constexpr(value):
    """A module constant read by the kernels and the host alike: Triton's kernels read only ``tl.constexpr``
    globals, and the host indexes tensors with it through ``Tensor.select`` (which takes its ``__index__``)."""
    return tl.constexpr(value) if HAS_TRITON else value


# the KL estimator a kernel computes: its index in KL_ESTIMATORS (the KL_EST constexpr)
KL_K1, KL_K2, KL_K3, KL_ABS = (_constexpr(KL_ESTIMATORS.index(name)) for name in ("k1", "k2", "k3", "abs"))

# per-row partial sums written by the policy / value kernels: [B, C, NSLOTS]
NSLOTS = _constexpr(8)
SLOT_MASK, SLOT_LOSS, SLOT_CLIP, SLOT_APPROX_KL, SLOT_RATIO, SLOT_KL, SLOT_ENT, SLOT_VALUES = (
    _constexpr(i) for i in range(8)
)
POLICY_METRICS = ("clipfrac", "approx_kl", "ratio_mean", "kl", "entropy")  # order of the metrics vector
VALUE_METRICS = ("clipfrac", "values_mean")


def float32_result(loss: torch.Tensor, metrics: dict, keys: tuple[str, ...]):
    """A reference-backend ``(loss, metrics)`` as every other backend returns it: float32 also for float64 inputs
    (the loss's gradient still reaches them in their dtype), the metrics detached, in the order of ``keys``."""
    return loss.float(), {key: metrics[key].detach().float() for key in keys if key in metrics}
_POLICY_METRIC_SLOTS = [operator.index(s) for s in (SLOT_CLIP, SLOT_APPROX_KL, SLOT_RATIO, SLOT_KL, SLOT_ENT)]
_VALUE_METRIC_SLOTS = [operator.index(s) for s in (SLOT_CLIP, SLOT_VALUES)]  # clipfrac, values_mean

BLOCK_T = 1024  # tokens per block (one block per program in token mode; the row loops in blocks in sequence mode)
BLOCK_KL = 1024  # elements per program of the elementwise KL kernel
NUM_WARPS = 4  # KL and value kernels: 8 fp32 elements per thread, ~40-50 registers
POLICY_WARPS = 8  # the policy kernel keeps 8 block accumulators live: 4 warps would need ~150-195 registers

# k3 = e^-d + d - 1 (d = logp - ref) is d²/2 - d³/6 + ... near 0, where the direct float32 form cancels (its
# absolute error of ~6e-8 read as 0 below |d| ~ 1e-4). Below |d| = 1 the kernels take d²·Σ_k c_k d^k, c_k =
# (-1)^k / (k + 2)!, k = 0..8 (truncation 5e-8 relative at |d| = 1, where the direct form's own rounding error is
# ~3e-7 relative); the derivative 1 - e^-d is then d - k3. Against float64 (tests/test_losses.py::test_k3_*):
# <= 5e-7 relative for |d| in [1e-6, 10] on every backend (the direct form: 0 below |d| ~ 1e-4).
# GSPO's policy kernel forms and sums its KL in pass 3 (_seq_grad_pass), not in pass 2 beside eight block sums:
# with the series there, ptxas capped two configurations at 80 registers and spilled (triton 3.6 and 3.9).
_K3_COEFFS = tuple(float((-1) ** k / math.factorial(k + 2)) for k in range(9))  # c_0 .. c_8 (host)
_K3_BELOW = 1.0  # |d| below which the series is taken (host)
_K3_TAYLOR = _constexpr(_K3_COEFFS)  # the same, as the kernels read them
_K3_TERMS = _constexpr(len(_K3_COEFFS))
_K3_SERIES_BELOW = _constexpr(_K3_BELOW)

# ================================================================ Triton kernels


@jit
def _kl_and_grad(d, EST: tl.constexpr):
    """KL estimate of ``d = logp - ref`` [BLOCK] and its derivative in ``logp`` (that in ``ref`` is the negative)."""
    if EST == KL_K1:
        kl = d
        g = tl.full(d.shape, 1.0, tl.float32)
    elif EST == KL_K2:
        kl = 0.5 * d * d
        g = d
    elif EST == KL_K3:  # exp(ref - logp) - (ref - logp) - 1: _K3_TAYLOR's series below |d| = 1, else direct
        e = tl.exp(-d)
        small = tl.abs(d) < _K3_SERIES_BELOW
        t = _K3_TAYLOR[_K3_TERMS - 1]
        for k in tl.static_range(_K3_TERMS - 2, -1, -1):  # Horner: Σ_k c_k d^k
            t = t * d + _K3_TAYLOR[k]
        kl = tl.where(small, d * d * t, e + d - 1.0)
        g = tl.where(small, d - kl, 1.0 - e)  # 1 - e^-d = d - k3: no cancellation near 0
    else:  # KL_ABS; torch's sign(0) = 0 subgradient
        kl = tl.abs(d)
        g = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return kl, g


@jit
def _kl_kernel(
    logp_ptr,  # [N] any float
    ref_ptr,  # [N] any float
    kl_ptr,  # [N] fp32 out
    grad_ptr,  # [N] fp32 out: dkl/dlogp (only when WRITE_GRAD)
    N,
    EST: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inb = offs < N
    lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)  # [BLOCK]
    rf = tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32)  # [BLOCK]
    kl, g = _kl_and_grad(lp - rf, EST)
    tl.store(kl_ptr + offs, kl, mask=inb)
    if WRITE_GRAD:
        tl.store(grad_ptr + offs, g, mask=inb)


@jit
def _masked_load(row_ptr, t, inb, keep):
    """One row's block [BLOCK] at positions ``t`` in float32, 0 where masked out: nothing there (NaN, ±inf)
    reaches an output or a gradient, where a multiply by m would give 0·inf = NaN."""
    return tl.where(keep, tl.load(row_ptr + t, mask=inb, other=0.0).to(tl.float32), 0.0)


@jit
def _surrogate(r, adv, ratio_min, ratio_max, dual_clip):
    """Clipped surrogate per token and its derivative in the ratio ``r`` [BLOCK].

    ``max(-A·r, -A·clip(r, ratio_min, ratio_max))`` takes the unclipped branch on ties (inside the clip range
    both branches are the same function of r), so its derivative is ``-A`` unless clipping wins, where it is
    0. Dual clip: where ``A < 0`` and ``-A·c`` is smaller, the value is ``-A·c`` and the derivative 0
    (``dual_clip = inf`` disables it).
    """
    r_clipped = tl.minimum(tl.maximum(r, ratio_min), ratio_max)
    pg_unclipped = -adv * r
    pg_clipped = -adv * r_clipped
    clipped = pg_clipped > pg_unclipped
    pg = tl.where(clipped, pg_clipped, pg_unclipped)
    dpg = tl.where(clipped, 0.0, -adv)
    dual_bound = tl.where(adv < 0, -adv, 1.0) * dual_clip  # never 0·inf
    dual = (adv < 0) & (dual_bound < pg)
    pg = tl.where(dual, dual_bound, pg)
    dpg = tl.where(dual, 0.0, dpg)
    return pg, dpg, clipped.to(tl.float32)


@jit
def _ratio_grad(dpg, r):
    """``d pg / d log r = dpg · r``, exactly 0 where ``dpg`` is 0 (the clip or the dual clip set the value): there
    ``r`` may have overflowed to inf (log-ratio > 88.7 in float32), and 0·inf would be a NaN gradient."""
    return tl.where(dpg == 0.0, 0.0, dpg * r)


@jit
def _token_policy_terms(lp, old, adv, m, ref, r_seq, ratio_min, ratio_max, dual_clip, kl_coef,
                        HAS_REF: tl.constexpr, KL_EST: tl.constexpr, SEQ_RATIO: tl.constexpr):
    """One token's (or a block's) surrogate and KL terms, the per-token math every policy kernel shares
    (:func:`_policy_token_pass`, and :mod:`rlkernels.fused_policy`'s one-kernel logits loss per row), from inputs
    already 0 where ``m == 0`` (:func:`_masked_load`). Returns ``(x, g_pg, g_kl, dpg, log_ratio, r, clipped, kl)``:
    the loss term ``x = pg + kl_coef·kl`` (the caller subtracts ``entropy_coef·entropy``, whose gradient is
    ``-entropy_coef·m``: loaded after this, the entropy holds no registers through it); ``g_pg = m·dpg/dlogp`` and
    ``g_kl = m·kl_coef·dkl/dlogp`` (before the agg weight; their sum is the token's ``dx/dlogp``); ``dpg = dpg/dr``;
    the log-ratio, the ratio, the clipped flag and the KL estimate. ``ratio="token"``: ``r = exp(logp - old)``.
    ``SEQ_RATIO`` (GSPO): ``r = r_seq``, the sequence's ratio (0 at masked-out tokens), whose gradient reaches a
    token only through the sequence sum (``dpg``; ``g_pg`` is then unused), and no KL (its pass 3 forms it)."""
    log_ratio = lp - old
    if SEQ_RATIO:
        r = r_seq
    else:
        r = tl.exp(log_ratio)
    pg, dpg, clipped = _surrogate(r, adv, ratio_min, ratio_max, dual_clip)
    x = pg
    g_pg = _ratio_grad(dpg, r) * m
    kl = tl.full(lp.shape, 0.0, tl.float32)
    g_kl = tl.full(lp.shape, 0.0, tl.float32)
    if HAS_REF and not SEQ_RATIO:
        kl, dkl = _kl_and_grad(lp - ref, KL_EST)
        x += kl_coef * kl
        g_kl = kl_coef * dkl * m
    return x, g_pg, g_kl, dpg, log_ratio, r, clipped, kl


@jit
def _seq_ratio_pass(logp_row, old_row, mask_row, t_begin, t_end, BLOCK: tl.constexpr):
    """GSPO pass 1: the row's sequence ratio ``s_b = exp(Σ m·(logp - old) / n_b)`` and ``1 / n_b`` (n_b >= 1)."""
    acc_d = tl.full([BLOCK], 0.0, tl.float32)  # [BLOCK]
    acc_m = tl.full([BLOCK], 0.0, tl.float32)  # [BLOCK]
    for t0 in range(t_begin, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)  # [BLOCK]
        inb = t < t_end
        m = tl.load(mask_row + t, mask=inb, other=0).to(tl.float32)  # [BLOCK]
        keep = m != 0
        acc_d += (_masked_load(logp_row, t, inb, keep) - _masked_load(old_row, t, inb, keep)) * m
        acc_m += m
    inv_n = 1.0 / tl.maximum(block_sum(acc_m, 0), 1.0)
    return tl.exp(block_sum(acc_d, 0) * inv_n), inv_n


@jit
def _policy_token_pass(
    logp_row, old_row, adv_row, stride_adv_t, mask_row, ref_row, ent_row,  # one row's inputs
    g_logp_row, g_ref_row, g_ent_row,  # one row's fp32 gradient outputs
    t_begin, t_end, s_row, ratio_min, ratio_max, dual_clip, kl_coef, entropy_coef,
    HAS_REF: tl.constexpr, KL_EST: tl.constexpr, HAS_ENT: tl.constexpr, SEQ_RATIO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2: every token's loss term, its gradients (token ratio; GSPO's wait for pass 3) and the row's sums
    in slot order (mask, loss, clipped, -log-ratio, ratio, kl, entropy), then GSPO's ``Σ m·dpg/ds``."""
    acc_mask = tl.full([BLOCK], 0.0, tl.float32)  # [BLOCK] each
    acc_loss = tl.full([BLOCK], 0.0, tl.float32)
    acc_clip = tl.full([BLOCK], 0.0, tl.float32)
    acc_akl = tl.full([BLOCK], 0.0, tl.float32)
    acc_ratio = tl.full([BLOCK], 0.0, tl.float32)
    acc_kl = tl.full([BLOCK], 0.0, tl.float32)
    acc_ent = tl.full([BLOCK], 0.0, tl.float32)
    acc_ds = tl.full([BLOCK], 0.0, tl.float32)  # GSPO: Σ m · dpg/ds
    for t0 in range(t_begin, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)  # [BLOCK]
        inb = t < t_end
        m = tl.load(mask_row + t, mask=inb, other=0).to(tl.float32)  # [BLOCK]
        keep = m != 0
        lp = _masked_load(logp_row, t, inb, keep)  # [BLOCK]
        old = _masked_load(old_row, t, inb, keep)  # [BLOCK]
        adv = tl.where(keep, tl.load(adv_row + t * stride_adv_t, mask=inb, other=0.0).to(tl.float32), 0.0)
        ref = 0.0
        if HAS_REF and not SEQ_RATIO:  # GSPO sums its KL in pass 3, which forms it for the gradient anyway
            ref = _masked_load(ref_row, t, inb, keep)  # [BLOCK]
        # SEQ_RATIO: the row's ratio at its tokens, 0 elsewhere (s_b may be inf: no 0·inf at masked-out ones)
        x, g_pg, g_kl, dpg, log_ratio, r, clipped, kl = _token_policy_terms(
            lp, old, adv, m, ref, tl.where(keep, s_row, 0.0), ratio_min, ratio_max, dual_clip, kl_coef, HAS_REF,
            KL_EST, SEQ_RATIO)
        if HAS_REF and not SEQ_RATIO:
            acc_kl += kl * m
            tl.store(g_ref_row + t, -g_kl, mask=inb)
        if HAS_ENT:
            ent = _masked_load(ent_row, t, inb, keep)  # [BLOCK]
            x -= entropy_coef * ent
            acc_ent += ent * m
            if not SEQ_RATIO:
                tl.store(g_ent_row + t, -entropy_coef * m, mask=inb)
        if SEQ_RATIO:
            acc_ds += dpg * m
        elif HAS_REF:
            tl.store(g_logp_row + t, g_pg + g_kl, mask=inb)
        else:
            tl.store(g_logp_row + t, g_pg, mask=inb)
        acc_mask += m
        acc_loss += x * m
        acc_clip += clipped * m
        acc_akl += -log_ratio * m
        acc_ratio += r * m
    return (block_sum(acc_mask, 0), block_sum(acc_loss, 0), block_sum(acc_clip, 0), block_sum(acc_akl, 0),
            block_sum(acc_ratio, 0), block_sum(acc_kl, 0), block_sum(acc_ent, 0), block_sum(acc_ds, 0))


@jit
def _seq_grad_pass(
    logp_row, mask_row, ref_row, g_logp_row, g_ref_row, g_ent_row, t_begin, t_end, coef, kl_coef, entropy_coef,
    HAS_REF: tl.constexpr, KL_EST: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    """GSPO pass 3: every token's gradients; through ``s_b = exp(Σ m·(logp - old) / n_b)`` each token's
    ``dloss/dlogp`` is ``coef · m`` with ``coef = s_b · Σ m·dpg/ds / n_b``, plus its KL term. Returns the row's
    ``Σ m·kl`` (pass 2 leaves the KL to this pass: fewer registers held through pass 2's eight sums)."""
    acc_kl = tl.full([BLOCK], 0.0, tl.float32)  # [BLOCK]
    for t0 in range(t_begin, t_end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)  # [BLOCK]
        inb = t < t_end
        m = tl.load(mask_row + t, mask=inb, other=0).to(tl.float32)  # [BLOCK]
        g = coef * m
        if HAS_REF:
            keep = m != 0
            d = _masked_load(logp_row, t, inb, keep) - _masked_load(ref_row, t, inb, keep)  # [BLOCK]
            kl, dkl = _kl_and_grad(d, KL_EST)
            acc_kl += kl * m
            g_kl = kl_coef * dkl * m
            g += g_kl
            tl.store(g_ref_row + t, -g_kl, mask=inb)
        if HAS_ENT:
            tl.store(g_ent_row + t, -entropy_coef * m, mask=inb)
        tl.store(g_logp_row + t, g, mask=inb)
    return block_sum(acc_kl, 0)


@jit
def _store_partials(part_ptr, mask, loss, clip, approx_kl, ratio, kl, ent, values):
    """One (row, chunk)'s sums, each at its SLOT_* index of the [NSLOTS] at ``part_ptr``."""
    tl.store(part_ptr + SLOT_MASK, mask)
    tl.store(part_ptr + SLOT_LOSS, loss)
    tl.store(part_ptr + SLOT_CLIP, clip)
    tl.store(part_ptr + SLOT_APPROX_KL, approx_kl)
    tl.store(part_ptr + SLOT_RATIO, ratio)
    tl.store(part_ptr + SLOT_KL, kl)
    tl.store(part_ptr + SLOT_ENT, ent)
    tl.store(part_ptr + SLOT_VALUES, values)


@jit
def _policy_kernel(
    logp_ptr,  # [B, T] any float, unit stride along T
    old_ptr,  # [B, T]
    adv_ptr,  # [B, T] or [B] (stride_adv_t = 0)
    mask_ptr,  # [B, T] uint8 0/1
    ref_ptr,  # [B, T] (HAS_REF)
    ent_ptr,  # [B, T] (HAS_ENT)
    g_logp_ptr,  # [B, T] fp32 out: m · dx/dlogp (before the agg weight)
    g_ref_ptr,  # [B, T] fp32 out (HAS_REF)
    g_ent_ptr,  # [B, T] fp32 out (HAS_ENT)
    part_ptr,  # [B, C, NSLOTS] fp32 out: per-(row, chunk) partial sums
    T,
    CHUNK,  # tokens per program along T (= T in sequence mode)
    stride_logp,
    stride_old,
    stride_adv_b,
    stride_adv_t,
    stride_mask,
    stride_ref,
    stride_ent,
    clip_low: tl.float64,  # the ratio's clip range below 1 (float64: rounded to float32 once, below)
    clip_high: tl.float64,  # the ratio's clip range above 1
    dual_clip,  # inf when off
    kl_coef,
    entropy_coef,
    HAS_REF: tl.constexpr,
    KL_EST: tl.constexpr,
    HAS_ENT: tl.constexpr,
    SEQ_RATIO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t_begin = c * CHUNK
    t_end = tl.minimum(t_begin + CHUNK, T)
    logp_row, old_row, mask_row = logp_ptr + b * stride_logp, old_ptr + b * stride_old, mask_ptr + b * stride_mask
    adv_row, ref_row, ent_row = adv_ptr + b * stride_adv_b, ref_ptr + b * stride_ref, ent_ptr + b * stride_ent
    g_logp_row, g_ref_row, g_ent_row = g_logp_ptr + b * T, g_ref_ptr + b * T, g_ent_ptr + b * T
    # the clip bounds of r, rounded to float32 from the float64 1 ∓ clip exactly as PyTorch's clamp rounds them
    ratio_min = tl.cast(1.0 - clip_low, tl.float32)
    ratio_max = tl.cast(1.0 + clip_high, tl.float32)
    s_row = 1.0
    inv_n = 1.0
    if SEQ_RATIO:
        s_row, inv_n = _seq_ratio_pass(logp_row, old_row, mask_row, t_begin, t_end, BLOCK)
    n_mask, loss, clip, approx_kl, ratio, kl, ent, ds = _policy_token_pass(
        logp_row, old_row, adv_row, stride_adv_t, mask_row, ref_row, ent_row, g_logp_row, g_ref_row, g_ent_row,
        t_begin, t_end, s_row, ratio_min, ratio_max, dual_clip, kl_coef, entropy_coef,
        HAS_REF, KL_EST, HAS_ENT, SEQ_RATIO, BLOCK,
    )
    if SEQ_RATIO:
        kl = _seq_grad_pass(logp_row, mask_row, ref_row, g_logp_row, g_ref_row, g_ent_row, t_begin, t_end,
                            _ratio_grad(ds, s_row) * inv_n, kl_coef, entropy_coef, HAS_REF, KL_EST, HAS_ENT, BLOCK)
        if HAS_REF:
            loss += kl_coef * kl
    part = part_ptr + (b * tl.num_programs(1) + c) * NSLOTS
    _store_partials(part, n_mask, loss, clip, approx_kl, ratio, kl, ent, 0.0)


@jit
def _value_kernel(
    v_ptr,  # [B, T] any float
    old_ptr,  # [B, T] (HAS_CLIP)
    ret_ptr,  # [B, T]
    mask_ptr,  # [B, T] uint8 0/1
    g_v_ptr,  # [B, T] fp32 out: m · d(per-token loss)/dv
    part_ptr,  # [B, C, NSLOTS] fp32 out
    T,
    stride_v,
    stride_old,
    stride_ret,
    stride_mask,
    clip,
    HAS_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = c * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inb = t < T
    m = tl.load(mask_ptr + b * stride_mask + t, mask=inb, other=0).to(tl.float32)  # [BLOCK]
    keep = m != 0
    v = _masked_load(v_ptr + b * stride_v, t, inb, keep)  # [BLOCK]
    ret = _masked_load(ret_ptr + b * stride_ret, t, inb, keep)  # [BLOCK]
    err = v - ret
    per_token = 0.5 * err * err
    g = err
    clipped = tl.full([BLOCK], 0.0, tl.float32)
    if HAS_CLIP:
        old = _masked_load(old_ptr + b * stride_old, t, inb, keep)  # [BLOCK]
        # clamp(v, old ± clip) equals v exactly inside the range, so "clipped wins" implies v is
        # outside it, where the clamp passes no gradient
        # propagate_nan: tl.minimum/maximum default to fmin/fmax, which would drop a NaN old value
        err_c = tl.minimum(tl.maximum(v, old - clip, propagate_nan=tl.PropagateNan.ALL), old + clip,
                           propagate_nan=tl.PropagateNan.ALL) - ret
        loss_c = 0.5 * err_c * err_c
        clipped = (loss_c > per_token).to(tl.float32)
        # the max propagates NaN (a NaN old value at a kept token, as torch.maximum does): NaN loss and gradient
        use_c = (loss_c > per_token) | (loss_c != loss_c)
        per_token = tl.where(use_c, loss_c, per_token)
        g = tl.where(use_c, tl.where(loss_c != loss_c, loss_c, 0.0), g)
    tl.store(g_v_ptr + b * T + t, g * m, mask=inb)
    part = part_ptr + (b * tl.num_programs(1) + c) * NSLOTS
    _store_partials(part, block_sum(m, 0), block_sum(per_token * m, 0), block_sum(clipped * m, 0), 0.0, 0.0,
                    0.0, 0.0, block_sum(v * m, 0))


# the agg mode a reduction computes: its index in AGG_MODES (the AGG constexpr)
AGG_TOKEN_MEAN, AGG_SEQ_MEAN_TOKEN_MEAN = (_constexpr(AGG_MODES.index(n)) for n in ("token-mean", "seq-mean-token-mean"))
BLOCK_ROWS = 32  # rows per step of the reduction kernel: [32, NSLOTS] partial sums per tile
BLOCK_SCALE = 1024  # tokens per program of the backward's scaling kernel (8 fp32 per thread at 4 warps)


@jit
def _row_sums(part_ptr, b0, B, C, BLOCK_B: tl.constexpr):
    """Rows ``b0 .. b0 + BLOCK_B`` of ``part`` [B, C, NSLOTS] summed over their C chunks: [BLOCK_B, NSLOTS]
    (0 past B)."""
    rows = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    slots = tl.arange(0, NSLOTS)  # [NSLOTS]
    offs = rows.to(tl.int64)[:, None] * C * NSLOTS + slots[None, :]  # [BLOCK_B, NSLOTS] at chunk 0
    inb = (rows < B)[:, None] & (slots < NSLOTS)[None, :]
    acc = tl.full([BLOCK_B, NSLOTS], 0.0, tl.float32)
    for c in range(0, C):
        acc += tl.load(part_ptr + offs + c * NSLOTS, mask=inb, other=0.0)
    return acc


@jit
def _slot(tile, s: tl.constexpr):
    """Column ``s`` of a [BLOCK_B, NSLOTS] tile: [BLOCK_B]."""
    return block_sum(tl.where(tl.arange(0, NSLOTS)[None, :] == s, tile, 0.0), 1)


@jit
def _reduce_kernel(
    part_ptr,  # [B, C, NSLOTS] fp32: per-(row, chunk) sums in SLOT_* order
    w_ptr,  # [B] fp32 out: each row's agg weight w_b (dloss/dx_bt = w_b · m_bt)
    loss_ptr,  # [] fp32 out: Σ_b w_b · Σ_t m·x
    metrics_ptr,  # [N_METRICS] fp32 out: masked means of slots M_FIRST + j·M_STEP
    B,
    C,
    w_const,  # every row's weight in the token-sum modes (1 / B, 1 / (B·norm_length)), rounded to fp32 once
    AGG: tl.constexpr,
    M_FIRST: tl.constexpr,
    M_STEP: tl.constexpr,
    N_METRICS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The loss's epilogue in one program: every row's weight of ``rlkernels.reference.agg_weights``, the loss
    and the metrics, from the partial sums the loss kernel wrote. Two sweeps over the (small) partials: totals
    and the count of rows with a token first, as the token-mean and seq-mean weights need them."""
    totals = tl.full([NSLOTS], 0.0, tl.float32)  # [NSLOTS]
    nonempty = tl.full([BLOCK_B], 0.0, tl.float32)  # [BLOCK_B]
    for b0 in range(0, B, BLOCK_B):
        rows = _row_sums(part_ptr, b0, B, C, BLOCK_B)  # [BLOCK_B, NSLOTS]
        totals += block_sum(rows, 0)
        nonempty += (_slot(rows, SLOT_MASK) > 0).to(tl.float32)
    slots = tl.arange(0, NSLOTS)  # [NSLOTS]
    count = block_sum(tl.where(slots == SLOT_MASK, totals, 0.0), 0)  # Σ m over the batch
    n_seq = block_sum(nonempty, 0)  # rows that have a token
    acc = tl.full([BLOCK_B], 0.0, tl.float32)  # [BLOCK_B]
    for b0 in range(0, B, BLOCK_B):
        rows = _row_sums(part_ptr, b0, B, C, BLOCK_B)  # [BLOCK_B, NSLOTS]
        tokens = _slot(rows, SLOT_MASK)  # [BLOCK_B]
        if AGG == AGG_TOKEN_MEAN:
            w = tl.full([BLOCK_B], 0.0, tl.float32) + 1.0 / tl.maximum(count, 1.0)
        elif AGG == AGG_SEQ_MEAN_TOKEN_MEAN:  # has_tokens / max(tokens, 1) / max(rows with tokens, 1)
            w = (tokens > 0).to(tl.float32) / tl.maximum(tokens, 1.0) / tl.maximum(n_seq, 1.0)
        else:
            w = tl.full([BLOCK_B], 0.0, tl.float32) + w_const
        b = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        tl.store(w_ptr + b, w, mask=b < B)
        acc += w * _slot(rows, SLOT_LOSS)
    tl.store(loss_ptr, block_sum(acc, 0))
    means = totals / tl.maximum(count, 1.0)  # [NSLOTS]
    for j in tl.static_range(N_METRICS):  # metric j is the masked mean of slot M_FIRST + j·M_STEP
        tl.store(metrics_ptr + j, block_sum(tl.where(slots == M_FIRST + j * M_STEP, means, 0.0), 0))


@jit
def _scale_rows_kernel(
    d_ptr,  # [] fp32: the upstream gradient of the loss
    w_ptr,  # [B] fp32: each row's agg weight
    g0_ptr,  # [B, T] fp32: saved m · dx/dinput of the first input
    g1_ptr,  # [B, T] fp32 (HAS_1)
    g2_ptr,  # [B, T] fp32 (HAS_2)
    out0_ptr,  # [B, T] out, in the first input's dtype: g0 · upstream · w_b
    out1_ptr,  # [B, T] out (HAS_1)
    out2_ptr,  # [B, T] out (HAS_2)
    T,
    HAS_1: tl.constexpr,
    HAS_2: tl.constexpr,
    INTERPRETED: tl.constexpr,  # running under Triton's interpreter (CPU tensors)
    BLOCK: tl.constexpr,
):
    """The losses' backward in one launch: every saved per-token gradient times ``upstream · w_b``, rounded to
    its input's dtype once (as ``(g * scale).to(dtype)`` does)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    inb = t < T
    offs = b * T + t  # [BLOCK]
    scale = tl.load(d_ptr).to(tl.float32) * tl.load(w_ptr + b)
    _store_scaled(out0_ptr + offs, tl.load(g0_ptr + offs, mask=inb, other=0.0) * scale, inb, INTERPRETED)
    if HAS_1:
        _store_scaled(out1_ptr + offs, tl.load(g1_ptr + offs, mask=inb, other=0.0) * scale, inb, INTERPRETED)
    if HAS_2:
        _store_scaled(out2_ptr + offs, tl.load(g2_ptr + offs, mask=inb, other=0.0) * scale, inb, INTERPRETED)


@jit
def _store_scaled(ptrs, g, inb, INTERPRETED: tl.constexpr):
    """Store float32 ``g`` [BLOCK] rounded to nearest in the pointers' dtype (the interpreter's bf16 cast
    truncates: round the bits first there; compiled, the hardware rounds)."""
    if INTERPRETED and ptrs.dtype.element_ty == tl.bfloat16:
        g = _bf16_round_bits(g)
    tl.store(ptrs, g.to(ptrs.dtype.element_ty), mask=inb)


def aot_configs() -> list[KernelConfig]:
    """Every (kernel, constexpr, warps, stages) combination the launchers below can pick."""
    from rlkernels.testing.aot import KernelConfig

    kl_sig = {"logp_ptr": "*bf16", "ref_ptr": "*bf16", "kl_ptr": "*fp32", "grad_ptr": "*fp32", "N": "i32",
              "EST": "constexpr", "WRITE_GRAD": "constexpr", "BLOCK": "constexpr"}
    configs = [
        KernelConfig(_kl_kernel, kl_sig, {"EST": est, "WRITE_GRAD": write_grad, "BLOCK": BLOCK_KL}, num_warps=NUM_WARPS,
                     elements=BLOCK_KL)
        for est in range(len(KL_ESTIMATORS)) for write_grad in (False, True)
    ]
    policy_sig = {name: "*bf16" for name in ("logp_ptr", "old_ptr", "adv_ptr", "ref_ptr", "ent_ptr")}
    policy_sig.update({"mask_ptr": "*u8", "g_logp_ptr": "*fp32", "g_ref_ptr": "*fp32", "g_ent_ptr": "*fp32", "part_ptr": "*fp32"})
    policy_sig.update({name: "i32" for name in ("T", "CHUNK", "stride_logp", "stride_old", "stride_adv_b", "stride_adv_t",
                                                 "stride_mask", "stride_ref", "stride_ent")})
    policy_sig.update({"clip_low": "fp64", "clip_high": "fp64", "dual_clip": "fp32", "kl_coef": "fp32", "entropy_coef": "fp32"})
    policy_sig.update({name: "constexpr" for name in ("HAS_REF", "KL_EST", "HAS_ENT", "SEQ_RATIO", "BLOCK")})
    for has_ref, est in [(False, 0)] + [(True, e) for e in range(len(KL_ESTIMATORS))]:
        for has_ent in (False, True):
            for seq in (False, True):
                constexprs = {"HAS_REF": has_ref, "KL_EST": est, "HAS_ENT": has_ent, "SEQ_RATIO": seq, "BLOCK": BLOCK_T}
                configs.append(KernelConfig(_policy_kernel, policy_sig, constexprs, num_warps=POLICY_WARPS, elements=BLOCK_T))
    value_sig = {"v_ptr": "*bf16", "old_ptr": "*bf16", "ret_ptr": "*bf16", "mask_ptr": "*u8", "g_v_ptr": "*fp32",
                 "part_ptr": "*fp32", "T": "i32", "stride_v": "i32", "stride_old": "i32", "stride_ret": "i32",
                 "stride_mask": "i32", "clip": "fp32", "HAS_CLIP": "constexpr", "BLOCK": "constexpr"}
    for has_clip in (False, True):
        configs.append(KernelConfig(_value_kernel, value_sig, {"HAS_CLIP": has_clip, "BLOCK": BLOCK_T}, num_warps=NUM_WARPS,
                                    elements=BLOCK_T))
    reduce_sig = {"part_ptr": "*fp32", "w_ptr": "*fp32", "loss_ptr": "*fp32", "metrics_ptr": "*fp32", "B": "i32", "C": "i32",
                  "w_const": "fp32", "AGG": "constexpr", "M_FIRST": "constexpr", "M_STEP": "constexpr",
                  "N_METRICS": "constexpr", "BLOCK_B": "constexpr"}
    for slots in (_POLICY_METRIC_SLOTS, _VALUE_METRIC_SLOTS):
        first, step = _progression(slots)
        for agg in range(len(AGG_MODES)):  # one program over tiny partials: no per-element figure
            configs.append(KernelConfig(_reduce_kernel, reduce_sig, {"AGG": agg, "M_FIRST": first, "M_STEP": step,
                                                                     "N_METRICS": len(slots), "BLOCK_B": BLOCK_ROWS},
                                        num_warps=NUM_WARPS))
    scale_sig = {"d_ptr": "*fp32", "w_ptr": "*fp32", "g0_ptr": "*fp32", "g1_ptr": "*fp32", "g2_ptr": "*fp32",
                 "out0_ptr": "*bf16", "out1_ptr": "*bf16", "out2_ptr": "*bf16", "T": "i32", "HAS_1": "constexpr",
                 "HAS_2": "constexpr", "INTERPRETED": "constexpr", "BLOCK": "constexpr"}
    for n_grads in (1, 2, 3):
        configs.append(KernelConfig(_scale_rows_kernel, scale_sig, {"HAS_1": n_grads > 1, "HAS_2": n_grads > 2,
                                                                    "INTERPRETED": False, "BLOCK": BLOCK_SCALE},
                                    num_warps=NUM_WARPS, elements=BLOCK_SCALE))
    return configs


# ================================================================ launchers (validate, allocate, launch)


@dataclass(frozen=True)
class KLOptions:
    """Non-tensor options of :func:`kl_penalty`'s op."""

    estimator: str  # one of KL_ESTIMATORS
    need_grad: bool  # also write dkl/dlogp (saved for the backward)


@dataclass(frozen=True)
class PolicyOptions:
    """Non-tensor options of :func:`policy_loss`, validated. The fields are its keyword arguments (and
    :func:`rlkernels.reference.policy_loss`'s), with the same names and meanings down to the kernel; the
    defaults live in the public signature only."""

    clip_low: float
    clip_high: float  # clip_low when not given
    dual_clip: float | None  # None: no dual clip
    ratio: str  # one of RATIO_MODES
    kl_coef: float
    kl_estimator: str  # one of KL_ESTIMATORS
    entropy_coef: float
    agg: str  # one of AGG_MODES
    norm_length: float | None  # seq-mean-token-sum-norm divisor; None: T


@dataclass(frozen=True)
class ValueOptions:
    """Non-tensor options of :func:`value_loss`, validated (its keyword arguments)."""

    clip: float | None  # None: no clipping
    agg: str  # one of AGG_MODES


def _check_same_bt(logp: torch.Tensor, named: list[tuple[torch.Tensor | None, str]]) -> None:
    for t, name in named:
        if t is not None:
            _checks.tensor(t, name)
            _checks.same_shape(logp, "logp", t, name)


def _validate_kl(*, logp, ref_logp, estimator) -> KLOptions:
    _checks.floating(logp, "logp")
    _checks.floating(ref_logp, "ref_logp")
    _checks.same_shape(logp, "logp", ref_logp, "ref_logp")
    _checks.same_device((logp, "logp"), (ref_logp, "ref_logp"))
    _checks.choice(estimator, "estimator", KL_ESTIMATORS)
    need_grad = torch.is_grad_enabled() and (logp.requires_grad or ref_logp.requires_grad)
    return KLOptions(estimator=estimator, need_grad=need_grad)


def _validate_policy(*, logp, old_logp, advantages, mask, ref_logp, entropy, clip_low, clip_high, dual_clip, ratio,
                     kl_coef, kl_estimator, entropy_coef, agg, norm_length) -> PolicyOptions:
    _checks.floating(logp, "logp")
    _checks.rank(logp, "logp", 2)
    _checks.floating(old_logp, "old_logp")
    _checks.same_shape(logp, "logp", old_logp, "old_logp")
    _checks.floating(advantages, "advantages")
    B, T = logp.shape
    if tuple(advantages.shape) not in ((B, T), (B,)):
        raise ValueError(f"advantages must have shape [B, T] = {(B, T)} or [B] = {(B,)}, got {tuple(advantages.shape)}")
    _checks.mask(mask, "mask")
    _checks.same_shape(logp, "logp", mask, "mask")
    if ref_logp is not None:
        _checks.floating(ref_logp, "ref_logp")
    if entropy is not None:
        _checks.floating(entropy, "entropy")
    _check_same_bt(logp, [(ref_logp, "ref_logp"), (entropy, "entropy")])
    _checks.same_device((logp, "logp"), (old_logp, "old_logp"), (advantages, "advantages"), (mask, "mask"),
                        (ref_logp, "ref_logp"), (entropy, "entropy"))
    _checks.choice(ratio, "ratio", RATIO_MODES)
    _checks.choice(kl_estimator, "kl_estimator", KL_ESTIMATORS)
    _checks.choice(agg, "agg", AGG_MODES)
    clip_low = _checks.non_negative(clip_low, "clip_low")
    clip_high = clip_low if clip_high is None else _checks.non_negative(clip_high, "clip_high")
    if dual_clip is not None:
        # c <= 1 would cap every negative-advantage token at -A·c, a constant: no gradient from A < 0
        dual_clip = _checks.finite(dual_clip, "dual_clip")
        if not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}")
    kl_coef = _checks.finite(kl_coef, "kl_coef")
    entropy_coef = _checks.finite(entropy_coef, "entropy_coef")
    if kl_coef != 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (the reference policy's log-probs), got ref_logp=None")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy, got entropy=None")
    if norm_length is not None:
        norm_length = _checks.invertible(norm_length, "norm_length")  # the token weight is 1 / (B·norm_length)
    return PolicyOptions(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, norm_length=norm_length)


def _validate_value(*, values, old_values, returns, mask, clip, agg) -> ValueOptions:
    _checks.floating(values, "values")
    _checks.rank(values, "values", 2)
    _checks.floating(old_values, "old_values")
    _checks.same_shape(values, "values", old_values, "old_values")
    _checks.floating(returns, "returns")
    _checks.same_shape(values, "values", returns, "returns")
    _checks.mask(mask, "mask")
    _checks.same_shape(values, "values", mask, "mask")
    _checks.same_device((values, "values"), (old_values, "old_values"), (returns, "returns"), (mask, "mask"))
    _checks.choice(agg, "agg", AGG_MODES)
    if clip is not None:
        clip = _checks.non_negative(clip, "clip")
    return ValueOptions(clip=clip, agg=agg)


def _reduce(partials: torch.Tensor, agg: str, T: int, norm_length: float | None):
    """Rows' partial sums [B, C, NSLOTS] -> (per-row agg weight w_b [B], loss [], totals [NSLOTS]).

    Every agg mode is ``loss = Σ_b w_b · Σ_t x_bt·m_bt`` (``rlkernels.reference.agg_weights``), so
    ``dloss/dx_bt = w_b · m_bt``.
    """
    rows = partials.sum(1)  # [B, NSLOTS]
    w = _ref.agg_weights(rows.select(-1, SLOT_MASK), agg, T, norm_length)  # [B]
    loss = (w * rows.select(-1, SLOT_LOSS)).sum()
    return w.contiguous(), loss, rows.sum(0)


def _masked_means(totals: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """[NSLOTS] sums -> the masked means of ``slots`` (0 for an empty mask)."""
    return totals[slots] / totals.select(0, SLOT_MASK).clamp(min=1.0)


def _reduce_torch(partials: torch.Tensor, agg: str, T: int, norm_length: float | None, slots: list[int]):
    """Partial sums [B, C, NSLOTS] -> (w [B], loss [], masked means of ``slots`` [len(slots)]), in PyTorch."""
    w, loss, totals = _reduce(partials, agg, T, norm_length)
    return w, loss, _masked_means(totals, slots)


def _progression(slots: list[int]) -> tuple[int, int]:
    """``(first, step)`` of metric slots in arithmetic progression (how the reduction kernel addresses them)."""
    step = slots[1] - slots[0] if len(slots) > 1 else 1
    assert step > 0 and slots == list(range(slots[0], slots[0] + step * len(slots), step)), slots
    return slots[0], step


def _reduce_triton(partials: torch.Tensor, agg: str, T: int, norm_length: float | None, slots: list[int]):
    """The same outputs as :func:`_reduce_torch` from one launch of :func:`_reduce_kernel` (one program)."""
    B, C, _ = partials.shape
    f32 = dict(dtype=torch.float32, device=partials.device)
    w, loss, metrics = torch.empty(B, **f32), torch.empty((), **f32), torch.empty(len(slots), **f32)  # [B], [], [M]
    first, step = _progression(slots)
    w_const = _ref.token_sum_weight(agg, B, T, norm_length) if agg.startswith("seq-mean-token-sum") else 0.0
    _reduce_kernel.launch((1,), partials, w, loss, metrics, B, C, w_const, AGG=AGG_MODES.index(agg), M_FIRST=first,
                          M_STEP=step, N_METRICS=len(slots), BLOCK_B=BLOCK_ROWS, num_warps=NUM_WARPS)
    return w, loss, metrics


def _scale_rows_torch(d_loss, w, grads, dtypes):
    """Saved per-token gradients [B, T] fp32 each -> ``g · upstream · w_b`` in their dtypes."""
    scale = (d_loss * w).unsqueeze(-1)  # [B, 1]: upstream gradient times the agg weight
    return [(g * scale).to(dt) for g, dt in zip(grads, dtypes)]


def _scale_rows_triton(d_loss, w, grads, dtypes):
    """The same outputs as :func:`_scale_rows_torch` from one launch of :func:`_scale_rows_kernel`."""
    B, T = grads[0].shape
    outs = [torch.empty((B, T), dtype=dt, device=g.device) for g, dt in zip(grads, dtypes)]  # [B, T] each
    if B and T:
        g_in = grads + [grads[0]] * (3 - len(grads))  # placeholders, never read
        g_out = outs + [outs[0]] * (3 - len(outs))
        _scale_rows_kernel.launch((B, cdiv(T, BLOCK_SCALE)), d_loss, w, *g_in, *g_out, T, HAS_1=len(grads) > 1,
                                  HAS_2=len(grads) > 2, INTERPRETED=w.device.type == "cpu", BLOCK=BLOCK_SCALE,
                                  num_warps=NUM_WARPS)
    return outs


def _empty_like_rows(x: torch.Tensor, present: bool) -> torch.Tensor:
    return torch.empty(x.shape if present else (0,), dtype=torch.float32, device=x.device)


def _kl_triton(logp, ref_logp, opt: KLOptions):
    """Launch the elementwise KL kernel on flattened inputs; returns (kl, dkl/dlogp or [0]) fp32."""
    lp, rf = logp.reshape(-1).contiguous(), ref_logp.reshape(-1).contiguous()  # [N] unit stride, as the kernel reads them
    n = lp.numel()
    kl = torch.empty(logp.shape, dtype=torch.float32, device=logp.device)  # [...]
    grad = torch.empty(logp.shape if opt.need_grad else (0,), dtype=torch.float32, device=logp.device)  # [...] or [0]
    if n:
        _kl_kernel.launch(
            (cdiv(n, BLOCK_KL),), lp, rf, kl, grad if opt.need_grad else kl, n,
            EST=KL_ESTIMATORS.index(opt.estimator), WRITE_GRAD=opt.need_grad, BLOCK=BLOCK_KL, num_warps=NUM_WARPS,
        )
    return kl, grad


def _kl_terms(d: torch.Tensor, estimator: str):
    """KL estimate of ``d = logp - ref`` (fp32) [...] and its derivative in logp [...]."""
    if estimator == "k1":
        return d, torch.ones_like(d)
    if estimator == "k2":
        return 0.5 * d * d, d
    if estimator == "k3":  # the Triton kernel's form: _K3_TAYLOR's series below |d| = 1, else direct
        e = torch.exp(-d)
        small = d.abs() < _K3_BELOW
        t = torch.full_like(d, _K3_COEFFS[-1])
        for c in reversed(_K3_COEFFS[:-1]):
            t = t * d + c
        kl = torch.where(small, d * d * t, e + d - 1.0)
        return kl, torch.where(small, d - kl, 1.0 - e)
    return d.abs(), torch.sign(d)


def _kl_torch(logp, ref_logp, opt: KLOptions):
    """The same outputs as :func:`_kl_triton`, in PyTorch."""
    kl, grad = _kl_terms(logp.float() - ref_logp.float(), opt.estimator)  # [...] each
    return kl, (grad if opt.need_grad else kl.new_empty(0))


def _policy_triton(logp, old_logp, advantages, mask, ref_logp, entropy, opt: PolicyOptions):
    """Launch the fused policy kernel; returns (partials [B, C, NSLOTS], g_logp, g_ref, g_ent [B, T] fp32)."""
    B, T = logp.shape
    logp, old_logp, mask = unit_stride(logp), unit_stride(old_logp), unit_stride(mask_u8(mask))  # [B, T]
    if advantages.dim() == 1:
        adv_strides = (advantages.stride(0), 0)  # [B]: every token of a row reads its sequence's advantage
    else:
        advantages = unit_stride(advantages)  # [B, T]
        adv_strides = (advantages.stride(0), 1)
    has_ref, has_ent, seq_ratio = ref_logp is not None, entropy is not None, opt.ratio == "sequence"
    ref = unit_stride(ref_logp) if has_ref else logp  # [B, T] (placeholder when absent: never read)
    ent = unit_stride(entropy) if has_ent else logp  # [B, T]
    g_logp = torch.empty((B, T), dtype=torch.float32, device=logp.device)  # [B, T]
    g_ref = _empty_like_rows(logp, has_ref)  # [B, T] or [0]
    g_ent = _empty_like_rows(logp, has_ent)  # [B, T] or [0]
    chunk = max(T, 1) if seq_ratio else BLOCK_T  # one chunk per row in sequence mode (T = 0: nothing to do)
    n_chunks = max(1, cdiv(T, chunk))
    if B == 0 or T == 0:
        return torch.zeros((B, n_chunks, NSLOTS), dtype=torch.float32, device=logp.device), g_logp, g_ref, g_ent
    partials = torch.empty((B, n_chunks, NSLOTS), dtype=torch.float32, device=logp.device)  # [B, C, NSLOTS], all written
    _policy_kernel.launch(
        (B, n_chunks),
        logp, old_logp, advantages, mask, ref, ent,
        g_logp, g_ref if has_ref else g_logp, g_ent if has_ent else g_logp, partials,
        T, chunk, logp.stride(0), old_logp.stride(0), adv_strides[0], adv_strides[1], mask.stride(0),
        ref.stride(0), ent.stride(0),
        opt.clip_low, opt.clip_high, math.inf if opt.dual_clip is None else opt.dual_clip, opt.kl_coef,
        opt.entropy_coef,
        HAS_REF=has_ref, KL_EST=KL_ESTIMATORS.index(opt.kl_estimator) if has_ref else 0, HAS_ENT=has_ent,
        SEQ_RATIO=seq_ratio, BLOCK=BLOCK_T, num_warps=POLICY_WARPS,
    )
    return partials, g_logp, g_ref, g_ent


def _policy_torch(logp, old_logp, advantages, mask, ref_logp, entropy, opt: PolicyOptions):
    """The same outputs as :func:`_policy_triton`, vectorized PyTorch in float32 (partials [B, 1, NSLOTS])."""
    B, T = logp.shape
    # masked-out inputs become 0 before any arithmetic: NaN/±inf there never reach an output (0·inf)
    keep = mask != 0  # [B, T]
    lp = torch.where(keep, logp.float(), 0.0)  # [B, T]
    old = torch.where(keep, old_logp.float(), 0.0)  # [B, T]
    m = mask.float()  # [B, T]
    adv = advantages.float()
    adv = torch.where(keep, (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand(B, T), 0.0)  # [B, T]
    log_ratio = lp - old  # [B, T]
    tokens = m.sum(-1)  # [B]
    if opt.ratio == "sequence":
        inv_n = 1.0 / tokens.clamp(min=1.0)  # [B]
        s = torch.exp((log_ratio * m).sum(-1) * inv_n)  # [B]
        r = torch.where(keep, s.unsqueeze(-1), 0.0)  # [B, T] 0 at masked-out tokens (s may be inf: no 0·inf)
    else:
        r = torch.exp(log_ratio)  # [B, T]
    pg_unclipped = -adv * r
    pg_clipped = -adv * torch.clamp(r, 1.0 - opt.clip_low, 1.0 + opt.clip_high)
    clipped = pg_clipped > pg_unclipped  # [B, T]
    pg = torch.where(clipped, pg_clipped, pg_unclipped)
    dpg = torch.where(clipped, torch.zeros_like(adv), -adv)  # d pg / d r
    if opt.dual_clip is not None:
        dual_bound = torch.where(adv < 0, -adv, 1.0) * opt.dual_clip  # [B, T]
        dual = (adv < 0) & (dual_bound < pg)
        pg = torch.where(dual, dual_bound, pg)
        dpg = torch.where(dual, torch.zeros_like(dpg), dpg)
    x = pg
    zeros_b = torch.zeros(B, dtype=torch.float32, device=lp.device)
    # d pg / d log r = dpg · r, exactly 0 where dpg is (clip or dual clip decided): r may be inf there (0·inf)
    if opt.ratio == "sequence":
        ds = (dpg * m).sum(-1)  # [B]
        g_logp = (torch.where(ds == 0, 0.0, s * ds) * inv_n).unsqueeze(-1) * m  # [B, T]
    else:
        g_logp = torch.where(dpg == 0, 0.0, dpg * r) * m
    g_ref, g_ent = _empty_like_rows(lp, False), _empty_like_rows(lp, False)  # [0] each (outputs may not alias)
    kl_rows = ent_rows = zeros_b
    if ref_logp is not None:
        kl, dkl = _kl_terms(lp - torch.where(keep, ref_logp.float(), 0.0), opt.kl_estimator)  # [B, T]
        x = x + opt.kl_coef * kl
        g_kl = opt.kl_coef * dkl * m
        g_logp = g_logp + g_kl
        g_ref = -g_kl
        kl_rows = (kl * m).sum(-1)
    if entropy is not None:
        ent = torch.where(keep, entropy.float(), 0.0)  # [B, T]
        x = x - opt.entropy_coef * ent
        g_ent = (-opt.entropy_coef) * m
        ent_rows = (ent * m).sum(-1)
    partials = torch.stack(
        [tokens, (x * m).sum(-1), (clipped.float() * m).sum(-1), (-log_ratio * m).sum(-1), (r * m).sum(-1),
         kl_rows, ent_rows, zeros_b], dim=-1,
    ).unsqueeze(1)  # [B, 1, NSLOTS], in SLOT_* order
    return partials, g_logp.contiguous(), g_ref.contiguous(), g_ent.contiguous()


def _value_triton(values, old_values, returns, mask, opt: ValueOptions):
    """Launch the fused value kernel; returns (partials [B, C, NSLOTS], g_values [B, T] fp32)."""
    B, T = values.shape
    values, returns, mask = unit_stride(values), unit_stride(returns), unit_stride(mask_u8(mask))  # [B, T]
    has_clip = opt.clip is not None
    old = unit_stride(old_values) if has_clip else values  # [B, T] (not read without clip)
    g_v = torch.empty((B, T), dtype=torch.float32, device=values.device)  # [B, T]
    n_chunks = max(1, cdiv(T, BLOCK_T))
    if B == 0 or T == 0:
        return torch.zeros((B, n_chunks, NSLOTS), dtype=torch.float32, device=values.device), g_v
    partials = torch.empty((B, n_chunks, NSLOTS), dtype=torch.float32, device=values.device)  # [B, C, NSLOTS], all written
    _value_kernel.launch(
        (B, n_chunks), values, old, returns, mask, g_v, partials,
        T, values.stride(0), old.stride(0), returns.stride(0), mask.stride(0), opt.clip if has_clip else 0.0,
        HAS_CLIP=has_clip, BLOCK=BLOCK_T, num_warps=NUM_WARPS,
    )
    return partials, g_v


def _value_torch(values, old_values, returns, mask, opt: ValueOptions):
    """The same outputs as :func:`_value_triton` in vectorized PyTorch (partials [B, 1, NSLOTS])."""
    keep = mask != 0  # [B, T]: masked-out inputs become 0 first, so NaN/±inf there never reach an output
    v, ret = torch.where(keep, values.float(), 0.0), torch.where(keep, returns.float(), 0.0)  # [B, T]
    m = mask.float()  # [B, T]
    err = v - ret
    per_token = 0.5 * err * err
    g = err
    clipped = torch.zeros_like(v)
    if opt.clip is not None:
        old = torch.where(keep, old_values.float(), 0.0)  # [B, T]
        err_c = torch.clamp(v, old - opt.clip, old + opt.clip) - ret
        loss_c = 0.5 * err_c * err_c
        clipped = (loss_c > per_token).float()
        # the max propagates NaN (a NaN old value at a kept token, as torch.maximum does): NaN loss and gradient
        use_c = (loss_c > per_token) | loss_c.isnan()
        per_token = torch.where(use_c, loss_c, per_token)
        g = torch.where(use_c, torch.where(loss_c.isnan(), loss_c, 0.0), g)
    zeros_b = torch.zeros(v.shape[0], dtype=torch.float32, device=v.device)
    partials = torch.stack(
        [m.sum(-1), (per_token * m).sum(-1), (clipped * m).sum(-1), zeros_b, zeros_b, zeros_b, zeros_b, (v * m).sum(-1)],
        dim=-1,
    ).unsqueeze(1)  # [B, 1, NSLOTS], in SLOT_* order
    return partials, (g * m).contiguous()


# ================================================================ torch.library ops and their autograd.Functions

# Each op's backends: the implementation serving a call is chosen at run time, inside the op, by
# _backend.resolve over the table's keys (so torch.compile traces none of it).
_KL_IMPLS = {"torch": _kl_torch, "triton": _kl_triton}
_POLICY_IMPLS = {"torch": _policy_torch, "triton": _policy_triton}
_VALUE_IMPLS = {"torch": _value_torch, "triton": _value_triton}
_REDUCE_IMPLS = {"torch": _reduce_torch, "triton": _reduce_triton}  # the epilogue, by the loss's backend
_SCALE_IMPLS = {"torch": _scale_rows_torch, "triton": _scale_rows_triton}  # the backward

@custom_op("rlkernels::scale_rows",
           schema="(Tensor d_loss, Tensor w, Tensor g0, Tensor? g1, Tensor? g2, ScalarType dt0, "
                  "ScalarType? dt1, ScalarType? dt2) -> (Tensor, Tensor, Tensor)")
def _scale_rows_op(d_loss, w, g0, g1, g2, dt0, dt1, dt2):
    """The losses' backward: saved ``g0`` [B, T] fp32 (and ``g1``, ``g2`` when given) times ``d_loss · w_b``
    [B], each in its dtype ``dt*`` (an absent one comes back as [0]); one launch on the Triton backend."""
    present = [(g, dt) for g, dt in ((g0, dt0), (g1, dt1), (g2, dt2)) if g is not None]
    run = _SCALE_IMPLS[_backend.resolve(g0.device, tuple(_SCALE_IMPLS), dt0)]
    outs = run(d_loss, w, [g for g, _ in present], [dt for _, dt in present])
    outs = iter(outs)
    return tuple(next(outs) if g is not None else g0.new_empty(0) for g in (g0, g1, g2))


@_scale_rows_op.register_fake
def _(d_loss, w, g0, g1, g2, dt0, dt1, dt2):
    return tuple(g.new_empty(g.shape, dtype=dt) if g is not None else g0.new_empty(0)
                 for g, dt in ((g0, dt0), (g1, dt1), (g2, dt2)))


@custom_op("rlkernels::kl_penalty", schema=op_schema("Tensor logp, Tensor ref_logp", KLOptions, "(Tensor, Tensor)"))
def _kl_op(logp, ref_logp, *options):
    """-> (kl [...] fp32, dkl/dlogp [...] fp32, or [0] without need_grad)."""
    return _backend.implementation(_KL_IMPLS, logp)(logp, ref_logp, options_from(KLOptions, options))


@_kl_op.register_fake
def _(logp, ref_logp, *options):
    need_grad = options_from(KLOptions, options).need_grad
    return logp.new_empty(logp.shape, dtype=torch.float32), logp.new_empty(logp.shape if need_grad else (0,), dtype=torch.float32)


def _kl_setup(ctx, inputs, output):
    logp, ref_logp = inputs[:2]
    ctx.save_for_backward(output[1])
    ctx.dtypes = (logp.dtype, ref_logp.dtype)


def _kl_backward(ctx, d_kl, _d_grad):
    refuse_double_backward("kl_penalty")
    (grad,) = ctx.saved_tensors  # [...] fp32: dkl/dlogp
    g = grad * d_kl
    return g.to(ctx.dtypes[0]), (-g).to(ctx.dtypes[1])


_KLPenalty = autograd_function("_KLPenalty", _kl_op, _kl_setup, _kl_backward)

_POLICY_TENSORS = "Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, Tensor? ref_logp, Tensor? entropy"


@custom_op("rlkernels::policy_loss",
           schema=op_schema(_POLICY_TENSORS, PolicyOptions, "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _policy_op(logp, old_logp, advantages, mask, ref_logp, entropy, *options):
    """-> (loss [], metrics [5], g_logp [B, T], g_ref [B, T] or [0], g_ent [B, T] or [0], w [B])."""
    opt = options_from(PolicyOptions, options)
    name = _backend.resolve(logp.device, tuple(_POLICY_IMPLS), logp.dtype)
    partials, g_logp, g_ref, g_ent = _POLICY_IMPLS[name](logp, old_logp, advantages, mask, ref_logp, entropy, opt)
    w, loss, metrics = _REDUCE_IMPLS[name](partials, opt.agg, logp.shape[1], opt.norm_length, _POLICY_METRIC_SLOTS)
    return loss, metrics, g_logp, g_ref, g_ent, w


@_policy_op.register_fake
def _(logp, old_logp, advantages, mask, ref_logp, entropy, *options):
    f32 = dict(dtype=torch.float32)
    B, T = logp.shape
    return (
        logp.new_empty((), **f32),
        logp.new_empty((len(POLICY_METRICS),), **f32),
        logp.new_empty((B, T), **f32),
        logp.new_empty((B, T) if ref_logp is not None else (0,), **f32),
        logp.new_empty((B, T) if entropy is not None else (0,), **f32),
        logp.new_empty((B,), **f32),
    )


def _policy_setup(ctx, inputs, output):
    logp, ref_logp, entropy = inputs[0], inputs[4], inputs[5]
    _, _, g_logp, g_ref, g_ent, w = output
    ctx.save_for_backward(g_logp, g_ref, g_ent, w)
    ctx.set_materialize_grads(False)  # the outputs other than the loss get no gradient: no zeros to fill
    ctx.dtypes = (logp.dtype, None if ref_logp is None else ref_logp.dtype, None if entropy is None else entropy.dtype)


def _policy_backward(ctx, d_loss, *_unused):
    refuse_double_backward("policy_loss")
    if d_loss is None:  # only the (non-differentiable) metrics or saved outputs reached the backward
        return None
    g_logp, g_ref, g_ent, w = ctx.saved_tensors  # [B, T] fp32 (x3; [0] when absent), [B]
    dt_logp, dt_ref, dt_ent = ctx.dtypes
    grad_logp, grad_ref, grad_ent = call(_scale_rows_op, d_loss, w, g_logp, g_ref if dt_ref is not None else None,
                                         g_ent if dt_ent is not None else None, dt_logp, dt_ref, dt_ent)
    return (grad_logp, None, None, None, grad_ref if dt_ref is not None else None,
            grad_ent if dt_ent is not None else None)


_PolicyLoss = autograd_function("_PolicyLoss", _policy_op, _policy_setup, _policy_backward)


@custom_op("rlkernels::value_loss",
           schema=op_schema("Tensor values, Tensor old_values, Tensor returns, Tensor mask", ValueOptions,
                            "(Tensor, Tensor, Tensor, Tensor)"))
def _value_op(values, old_values, returns, mask, *options):
    """-> (loss [], metrics [2] (clipfrac, values_mean), g_values [B, T], w [B])."""
    opt = options_from(ValueOptions, options)
    name = _backend.resolve(values.device, tuple(_VALUE_IMPLS), values.dtype)
    partials, g_v = _VALUE_IMPLS[name](values, old_values, returns, mask, opt)
    w, loss, metrics = _REDUCE_IMPLS[name](partials, opt.agg, values.shape[1], None, _VALUE_METRIC_SLOTS)
    return loss, metrics, g_v, w


@_value_op.register_fake
def _(values, old_values, returns, mask, *options):
    f32 = dict(dtype=torch.float32)
    return (values.new_empty((), **f32), values.new_empty((2,), **f32), values.new_empty(values.shape, **f32),
            values.new_empty((values.shape[0],), **f32))


def _value_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3])
    ctx.set_materialize_grads(False)
    ctx.dtype = inputs[0].dtype


def _value_backward(ctx, d_loss, *_unused):
    refuse_double_backward("value_loss")
    if d_loss is None:
        return None
    g_v, w = ctx.saved_tensors  # [B, T] fp32, [B]
    grad, _, _ = call(_scale_rows_op, d_loss, w, g_v, None, None, ctx.dtype, None, None)
    return (grad,)


_ValueLoss = autograd_function("_ValueLoss", _value_op, _value_setup, _value_backward)


# ================================================================ public functions

# The reference backend (RLKERNELS_BACKEND=reference) is served before each op's autograd.Function (see
# _backend.serves_reference): its gradients are autograd's through the eager formulas, and autograd records nothing
# inside an op (its body runs with autograd off, as a custom op's implementation runs below the Autograd key).
def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of the policy against a reference policy.

    Args:
        logp: ``[...]`` float log-probabilities of the sampled tokens under the policy.
        ref_logp: ``[...]`` the same tokens' log-probabilities under the reference policy (same shape).
        estimator: ``"k1"`` (``logp - ref``), ``"k2"`` (``½(logp - ref)²``),
            ``"k3"`` (``exp(ref - logp) - (ref - logp) - 1``, unbiased and non-negative) or
            ``"abs"`` (``|logp - ref|``).

    k3 keeps float32's relative precision at every ``|logp - ref|`` (near 0 it is ~d²/2, which the direct form
    ``exp(-d) + d - 1`` would round to 0 below ~1e-4): a short series below ``|d| = 1``, the direct form above;
    within 1e-6 relative of the float64 value on every backend, its gradient too. Elementwise, so packed
    ``[1, total]`` inputs need no sequence boundaries (no ``cu_seqlens``).

    Returns:
        ``[...]`` float32. Differentiable in ``logp`` and ``ref_logp``; gradients come back in
        their dtypes. On CUDA one fused elementwise Triton kernel writes the value and its
        derivative together (the derivative only when a gradient is needed).
    """
    opt = _validate_kl(logp=logp, ref_logp=ref_logp, estimator=estimator)
    with _backend.float32_compute(logp.device):
        if _backend.serves_reference(_KL_IMPLS, logp):
            return _ref.kl_penalty(logp, ref_logp, opt.estimator).float()  # float32 also for float64 inputs
        kl, _ = _KLPenalty.apply(logp, ref_logp, *option_values(opt))  # [...] fp32
    return kl


def policy_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T] or [B]
    mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    ref_logp: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,  # [B, T]
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    norm_length: float | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,  # [S + 1]
):
    """PPO/GRPO clipped surrogate loss with optional dual clip, GSPO sequence ratio, KL and entropy terms.

    Per token, with ``r = exp(logp - old_logp)`` (``ratio="token"``) or, for
    ``ratio="sequence"`` (GSPO), ``r = exp(Σ_t m·(logp - old_logp) / Σ_t m)`` for
    every token of the sequence::

        pg = max(-A·r, -A·clip(r, 1 - clip_low, 1 + clip_high))
        pg = min(pg, -A·dual_clip)            where A < 0, when dual_clip is given
        x  = pg + kl_coef·kl_penalty(logp, ref_logp, kl_estimator) - entropy_coef·entropy

    and the loss is ``x`` aggregated over ``mask`` by ``agg`` (see ``rlkernels.reference.aggregate``).

    Args:
        logp: ``[B, T]`` log-probabilities of the sampled tokens under the current policy (fp32/bf16/fp16).
        old_logp: ``[B, T]`` the same under the policy that sampled them. Treated as a constant.
        advantages: ``[B, T]`` per token or ``[B]`` per sequence. Treated as a constant.
        mask: ``[B, T]`` bool or 0/1 float; 1 where a token counts. Empty rows, masks and batches (B = 0 or
            T = 0) give loss 0 and zero gradients. Whatever masked-out positions of any input hold (NaN,
            ±inf) never reaches the loss, the metrics or a gradient (theirs is exactly 0).
        clip_low: lower clip range ``ε_low >= 0``, finite.
        clip_high: upper clip range (DAPO's clip-higher); defaults to ``clip_low``.
        dual_clip: dual-clip bound ``c > 1`` (finite) for negative advantages (typically 3), or None.
        ratio: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO).
        ref_logp: ``[B, T]`` reference-policy log-probs, for the KL term and the ``kl`` metric.
        kl_coef: weight of the KL term, finite (needs ``ref_logp`` when nonzero).
        kl_estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        entropy: ``[B, T]`` per-token entropy, for the entropy bonus and the ``entropy`` metric.
        entropy_coef: weight of the entropy bonus, finite (needs ``entropy`` when nonzero).
        agg: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"``.
        norm_length: divisor per sequence for ``"seq-mean-token-sum-norm"`` (default ``T``), > 0 with a finite float32
            reciprocal; the other ``agg`` modes do not use it.
        cu_seqlens: ``[S + 1]`` int32/int64 sequence boundaries of *packed* inputs (``rlkernels.packing``):
            then ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``entropy`` (and per-token ``advantages``) are
            ``[1, total]`` with sequence ``s`` at ``[cu_seqlens[s], cu_seqlens[s+1])``, and ``advantages`` may
            be ``[S]``. The result is, by definition, the padded op's on the ``[S, Tmax]`` view
            (``Tmax`` the longest sequence, which is also ``norm_length``'s default): every ``agg`` mode and
            ``ratio="sequence"`` act per packed sequence. Validated (starts at 0, non-decreasing, ends at
            ``total``); read on the host once. A Python list of ints works too, and is what keeps
            ``torch.compile(fullgraph=True)`` free of data-dependent shapes (a tensor's values are not
            known while tracing).

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar, differentiable in ``logp``, ``ref_logp`` and
        ``entropy`` (gradients in their dtypes); ``metrics`` a dict of detached float32 scalars:
        ``clipfrac``, ``approx_kl`` (masked mean of ``old_logp - logp``), ``ratio_mean``, plus
        ``kl`` / ``entropy`` when those tensors are given. Where both branches of the max tie (inside
        the clip range they are the same function of ``r``) the gradient is ``-A·dr``.
    """
    if cu_seqlens is not None:  # packed [1, total] -> the padded [S, Tmax] view, then the one padded op
        views = _packing.padded_views(cu_seqlens, "logp", ("advantages",), logp=logp, old_logp=old_logp,
                                      advantages=advantages, mask=mask, ref_logp=ref_logp, entropy=entropy)
        return policy_loss(**views, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio,
                           kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg,
                           norm_length=norm_length)
    opt = _validate_policy(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp,
                           entropy=entropy, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio,
                           kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg,
                           norm_length=norm_length)
    # [B, T], [B, T] or [B], [B, T] bool
    constants = (old_logp.detach(), advantages.detach(), _checks.mask_as_bool(mask.detach()))
    with _backend.float32_compute(logp.device):
        if _backend.serves_reference(_POLICY_IMPLS, logp):
            return float32_result(*_ref.policy_loss(logp, *constants, ref_logp=ref_logp, entropy=entropy,
                                                    **option_dict(opt)), POLICY_METRICS)
        loss, metrics, *_ = _PolicyLoss.apply(logp, *constants, ref_logp, entropy, *option_values(opt))  # [], [5]
    metrics = dict(zip(POLICY_METRICS, metrics.detach()))
    if ref_logp is None:
        del metrics["kl"]
    if entropy is None:
        del metrics["entropy"]
    return loss, metrics


def value_loss(
    values: torch.Tensor,  # [B, T]
    old_values: torch.Tensor,  # [B, T]
    returns: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    clip: float | None = None,
    agg: str = "token-mean",
    cu_seqlens: torch.Tensor | list[int] | None = None,  # [S + 1]
):
    """PPO value loss: ``½·max((v - R)², (clamp(v, old ± clip) - R)²)``, or ``½(v - R)²`` without ``clip``.

    Args:
        values: ``[B, T]`` current value predictions (fp32/bf16/fp16).
        old_values: ``[B, T]`` value predictions at rollout time (the clip centre). Treated as a constant.
        returns: ``[B, T]`` value targets. Treated as a constant.
        mask: ``[B, T]`` bool or 0/1 float. Empty masks and batches give loss 0; masked-out positions (NaN,
            ±inf included) never reach the loss, the metrics or the gradient (exactly 0 there).
        clip: clip range ``>= 0`` and finite, or None for the plain squared error.
        agg: aggregation mode, as in :func:`policy_loss` (``seq-mean-token-sum-norm`` divides by ``B·T``).
        cu_seqlens: ``[S + 1]`` boundaries of packed ``[1, total]`` inputs, as in :func:`policy_loss` (the
            padded view's ``[S, Tmax]`` defines the result; ``seq-mean-token-sum-norm`` divides by ``S·Tmax``).

    Returns:
        ``(loss, metrics)``: float32 scalar loss differentiable in ``values`` (gradient in its dtype);
        ``metrics`` holds detached scalars ``clipfrac`` (share of tokens where the clipped error
        wins; 0 without ``clip``) and ``values_mean`` (masked mean of ``values``).
    """
    if cu_seqlens is not None:  # packed [1, total] -> the padded [S, Tmax] view
        views = _packing.padded_views(cu_seqlens, "values", values=values, old_values=old_values, returns=returns,
                                      mask=mask)
        return value_loss(**views, clip=clip, agg=agg)
    opt = _validate_value(values=values, old_values=old_values, returns=returns, mask=mask, clip=clip, agg=agg)
    constants = (old_values.detach(), returns.detach(), _checks.mask_as_bool(mask.detach()))  # [B, T] each
    with _backend.float32_compute(values.device):
        if _backend.serves_reference(_VALUE_IMPLS, values):
            return float32_result(*_ref.value_loss(values, *constants, **option_dict(opt)), VALUE_METRICS)
        loss, metrics, _, _ = _ValueLoss.apply(values, *constants, *option_values(opt))  # loss [], metrics [2]
    metrics = metrics.detach()
    return loss, dict(zip(VALUE_METRICS, metrics))
