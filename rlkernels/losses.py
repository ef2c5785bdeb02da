"""Fused RL losses: ``kl_penalty``, ``policy_loss`` (PPO/GRPO/GSPO clipped surrogate) and ``value_loss``.

One fused pass per call computes, for every token, the loss term *and* its
gradient, plus per-row partial sums (mask count, loss sum, metric sums). The
tiny reduction over rows (loss for the chosen ``agg`` mode, metrics, and the
per-row weight ``dloss/dx_bt = w_b · m_bt``) is PyTorch. The backward pass only
scales the saved per-token gradients by ``upstream · w_b``: nothing is
recomputed.

Saved gradients are float32 (``m · dx/dinput``, before the agg weight), so the
gradient handed back is rounded to the input dtype exactly once, as eager
PyTorch does.

Gradients flow to ``logp``, ``ref_logp`` and ``entropy`` (policy), ``values``
(value loss), ``logp`` and ``ref_logp`` (KL). ``old_logp``, ``advantages``,
``old_values``, ``returns`` and ``mask`` are treated as constants (detached), as
they are in every PPO/GRPO trainer.

Order: Triton kernels -> launchers -> torch.library ops with autograd -> public functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlkernels import _backend, _checks
from rlkernels import reference as _ref
from rlkernels._aot import KernelConfig
from rlkernels._triton import HAS_TRITON, cdiv, jit, tl

KL_ESTIMATORS = _ref.KL_ESTIMATORS  # ("k1", "k2", "k3", "abs"): index = kernel constexpr
AGG_MODES = _ref.AGG_MODES
RATIO_MODES = ("token", "sequence")

# per-row partial sums written by the policy / value kernels: [B, C, NSLOTS]
NSLOTS = 8
SLOT_MASK, SLOT_LOSS, SLOT_CLIP, SLOT_APPROX_KL, SLOT_RATIO, SLOT_KL, SLOT_ENT, SLOT_VALUES = range(8)
POLICY_METRICS = ("clipfrac", "approx_kl", "ratio_mean", "kl", "entropy")  # order of the metrics vector

BLOCK_T = 1024  # tokens per block (one block per program in token mode; the row loops in blocks in sequence mode)
BLOCK_KL = 1024  # elements per program of the elementwise KL kernel
NUM_WARPS = 4  # KL and value kernels: 8 fp32 elements per thread, ~40-50 registers
POLICY_WARPS = 8  # the policy kernel keeps 8 block accumulators live: 4 warps would need ~150-195 registers

# ================================================================ Triton kernels

if HAS_TRITON:
    # tl.sum / tl.zeros are @triton.jit library functions that only run compiled (or under
    # TRITON_INTERPRET=1 at import); the builtin tl.reduce with this combine function runs in
    # both modes, and the interpreter reduces it with numpy.
    _add = tl.standard._sum_combine

    @jit
    def _total(x):
        """Sum of a block [BLOCK] -> scalar."""
        return tl.reduce(x, 0, _add)

    @jit
    def _kl_and_grad(d, EST: tl.constexpr):
        """KL estimate of ``d = logp - ref`` [BLOCK] and its derivative in ``logp`` (that in ``ref`` is the negative)."""
        if EST == 0:  # k1
            kl = d
            g = tl.full(d.shape, 1.0, tl.float32)
        elif EST == 1:  # k2
            kl = 0.5 * d * d
            g = d
        elif EST == 2:  # k3 = exp(ref - logp) - (ref - logp) - 1
            e = tl.exp(-d)
            kl = e + d - 1.0
            g = 1.0 - e
        else:  # abs; torch's sign(0) = 0 subgradient
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
        lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        rf = tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        kl, g = _kl_and_grad(lp - rf, EST)
        tl.store(kl_ptr + offs, kl, mask=inb)
        if WRITE_GRAD:
            tl.store(grad_ptr + offs, g, mask=inb)

    @jit
    def _surrogate(r, adv, clip_lo, clip_hi, dual_clip):
        """Clipped surrogate per token and its derivative in the ratio ``r`` [BLOCK].

        ``max(-A·r, -A·clip(r))`` takes the unclipped branch on ties (inside the
        clip range both branches are the same function of r), so its derivative
        is ``-A`` unless clipping wins, where it is 0. Dual clip: where ``A < 0``
        and ``-A·c`` is smaller, the value is ``-A·c`` and the derivative 0
        (``dual_clip = inf`` disables it).
        """
        r_clipped = tl.minimum(tl.maximum(r, clip_lo), clip_hi)
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
    def _policy_kernel(
        logp_ptr,  # [B, T] any float, unit stride along T
        old_ptr,  # [B, T]
        adv_ptr,  # [B, T] or [B] (stride_adv_t = 0)
        mask_ptr,  # [B, T] uint8 (bool) or float
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
        clip_lo,  # 1 - clip_low
        clip_hi,  # 1 + clip_high
        dual_clip,  # inf when off
        kl_coef,
        ent_coef,
        HAS_REF: tl.constexpr,
        KL_EST: tl.constexpr,
        HAS_ENT: tl.constexpr,
        SEQ_RATIO: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        n_chunks = tl.num_programs(1)
        t_begin = c * CHUNK
        t_end = tl.minimum(t_begin + CHUNK, T)
        cols = tl.arange(0, BLOCK)  # [BLOCK]

        # pass 1 (GSPO only): the row's masked mean log-ratio -> sequence ratio s_b
        s_row = 1.0
        inv_n = 1.0
        if SEQ_RATIO:
            acc_d = tl.full([BLOCK], 0.0, tl.float32)
            acc_m = tl.full([BLOCK], 0.0, tl.float32)
            for t0 in range(t_begin, t_end, BLOCK):
                t = t0 + cols
                inb = t < t_end
                lp = tl.load(logp_ptr + b * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
                old = tl.load(old_ptr + b * stride_old + t, mask=inb, other=0.0).to(tl.float32)
                m = tl.load(mask_ptr + b * stride_mask + t, mask=inb, other=0).to(tl.float32)
                acc_d += tl.where(m != 0, lp - old, 0.0) * m  # never 0·inf: padding may hold -inf
                acc_m += m
            inv_n = 1.0 / tl.maximum(_total(acc_m), 1.0)
            s_row = tl.exp(_total(acc_d) * inv_n)

        # pass 2: per-token loss, gradients (token mode) and the row's partial sums
        acc_mask = tl.full([BLOCK], 0.0, tl.float32)
        acc_loss = tl.full([BLOCK], 0.0, tl.float32)
        acc_clip = tl.full([BLOCK], 0.0, tl.float32)
        acc_akl = tl.full([BLOCK], 0.0, tl.float32)
        acc_ratio = tl.full([BLOCK], 0.0, tl.float32)
        acc_kl = tl.full([BLOCK], 0.0, tl.float32)
        acc_ent = tl.full([BLOCK], 0.0, tl.float32)
        acc_ds = tl.full([BLOCK], 0.0, tl.float32)  # GSPO: Σ m · dpg/ds
        for t0 in range(t_begin, t_end, BLOCK):
            t = t0 + cols
            inb = t < t_end
            lp = tl.load(logp_ptr + b * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
            old = tl.load(old_ptr + b * stride_old + t, mask=inb, other=0.0).to(tl.float32)
            adv = tl.load(adv_ptr + b * stride_adv_b + t * stride_adv_t, mask=inb, other=0.0).to(tl.float32)
            m = tl.load(mask_ptr + b * stride_mask + t, mask=inb, other=0).to(tl.float32)
            # masked-out inputs become 0 before any arithmetic: nothing there (NaN, ±inf) reaches an output
            # or a gradient, where a multiply by m would give 0·inf = NaN
            keep = m != 0
            lp = tl.where(keep, lp, 0.0)
            old = tl.where(keep, old, 0.0)
            adv = tl.where(keep, adv, 0.0)
            log_ratio = lp - old
            if SEQ_RATIO:
                r = tl.full([BLOCK], 0.0, tl.float32) + s_row
            else:
                r = tl.exp(log_ratio)
            pg, dpg, clipped = _surrogate(r, adv, clip_lo, clip_hi, dual_clip)
            x = pg
            g = dpg * r  # d pg / d logp (token ratio)
            if HAS_REF:
                rf = tl.where(keep, tl.load(ref_ptr + b * stride_ref + t, mask=inb, other=0.0).to(tl.float32), 0.0)
                kl, dkl = _kl_and_grad(lp - rf, KL_EST)
                x += kl_coef * kl
                g_kl = kl_coef * dkl * m
                acc_kl += kl * m
                if not SEQ_RATIO:
                    tl.store(g_ref_ptr + b * T + t, -g_kl, mask=inb)
            if HAS_ENT:
                ent = tl.where(keep, tl.load(ent_ptr + b * stride_ent + t, mask=inb, other=0.0).to(tl.float32), 0.0)
                x -= ent_coef * ent
                acc_ent += ent * m
                if not SEQ_RATIO:
                    tl.store(g_ent_ptr + b * T + t, -ent_coef * m, mask=inb)
            if SEQ_RATIO:
                acc_ds += dpg * m
            else:
                g = g * m
                if HAS_REF:
                    g += g_kl
                tl.store(g_logp_ptr + b * T + t, g, mask=inb)
            acc_mask += m
            acc_loss += x * m
            acc_clip += clipped * m
            acc_akl += -log_ratio * m
            acc_ratio += r * m

        # pass 3 (GSPO only): every token's gradient through s_b = exp(Σ m·(logp - old) / n_b)
        if SEQ_RATIO:
            coef = s_row * _total(acc_ds) * inv_n
            for t0 in range(t_begin, t_end, BLOCK):
                t = t0 + cols
                inb = t < t_end
                m = tl.load(mask_ptr + b * stride_mask + t, mask=inb, other=0).to(tl.float32)
                g = coef * m
                if HAS_REF:
                    lp = tl.load(logp_ptr + b * stride_logp + t, mask=inb, other=0.0).to(tl.float32)
                    rf = tl.load(ref_ptr + b * stride_ref + t, mask=inb, other=0.0).to(tl.float32)
                    kl, dkl = _kl_and_grad(tl.where(m != 0, lp - rf, 0.0), KL_EST)
                    g_kl = kl_coef * dkl * m
                    g += g_kl
                    tl.store(g_ref_ptr + b * T + t, -g_kl, mask=inb)
                if HAS_ENT:
                    tl.store(g_ent_ptr + b * T + t, -ent_coef * m, mask=inb)
                tl.store(g_logp_ptr + b * T + t, g, mask=inb)

        part = part_ptr + (b * n_chunks + c) * 8
        tl.store(part + 0, _total(acc_mask))
        tl.store(part + 1, _total(acc_loss))
        tl.store(part + 2, _total(acc_clip))
        tl.store(part + 3, _total(acc_akl))
        tl.store(part + 4, _total(acc_ratio))
        tl.store(part + 5, _total(acc_kl))
        tl.store(part + 6, _total(acc_ent))
        tl.store(part + 7, 0.0)

    @jit
    def _value_kernel(
        v_ptr,  # [B, T] any float
        old_ptr,  # [B, T] (HAS_CLIP)
        ret_ptr,  # [B, T]
        mask_ptr,  # [B, T] uint8 (bool) or float
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
        v = tl.load(v_ptr + b * stride_v + t, mask=inb, other=0.0).to(tl.float32)
        ret = tl.load(ret_ptr + b * stride_ret + t, mask=inb, other=0.0).to(tl.float32)
        m = tl.load(mask_ptr + b * stride_mask + t, mask=inb, other=0).to(tl.float32)
        keep = m != 0  # masked-out inputs become 0 first: NaN/±inf there never reach an output (0·inf)
        v = tl.where(keep, v, 0.0)
        ret = tl.where(keep, ret, 0.0)
        err = v - ret
        per_token = 0.5 * err * err
        g = err
        clipped = tl.full([BLOCK], 0.0, tl.float32)
        if HAS_CLIP:
            old = tl.where(keep, tl.load(old_ptr + b * stride_old + t, mask=inb, other=0.0).to(tl.float32), 0.0)
            # clamp(v, old ± clip) equals v exactly inside the range, so "clipped wins" implies v is
            # outside it, where the clamp passes no gradient
            err_c = tl.minimum(tl.maximum(v, old - clip), old + clip) - ret
            loss_c = 0.5 * err_c * err_c
            use_c = loss_c > per_token
            per_token = tl.where(use_c, loss_c, per_token)
            g = tl.where(use_c, 0.0, g)
            clipped = use_c.to(tl.float32)
        tl.store(g_v_ptr + b * T + t, g * m, mask=inb)
        part = part_ptr + (b * tl.num_programs(1) + c) * 8
        tl.store(part + 0, _total(m))
        tl.store(part + 1, _total(per_token * m))
        tl.store(part + 2, _total(clipped * m))
        tl.store(part + 3, 0.0)
        tl.store(part + 4, 0.0)
        tl.store(part + 5, 0.0)
        tl.store(part + 6, 0.0)
        tl.store(part + 7, _total(v * m))


def aot_configs() -> list[KernelConfig]:
    """Every (kernel, constexpr, warps, stages) combination the launchers below can pick."""
    configs = []
    for est in range(len(KL_ESTIMATORS)):
        for write_grad in (False, True):
            configs.append(
                KernelConfig(
                    _kl_kernel,
                    {"logp_ptr": "*bf16", "ref_ptr": "*bf16", "kl_ptr": "*fp32", "grad_ptr": "*fp32", "N": "i32",
                     "EST": "constexpr", "WRITE_GRAD": "constexpr", "BLOCK": "constexpr"},
                    {"EST": est, "WRITE_GRAD": write_grad, "BLOCK": BLOCK_KL},
                    num_warps=NUM_WARPS,
                )
            )
    policy_sig = {name: "*bf16" for name in ("logp_ptr", "old_ptr", "adv_ptr", "ref_ptr", "ent_ptr")}
    policy_sig.update({"mask_ptr": "*u8", "g_logp_ptr": "*fp32", "g_ref_ptr": "*fp32", "g_ent_ptr": "*fp32", "part_ptr": "*fp32"})
    policy_sig.update({name: "i32" for name in ("T", "CHUNK", "stride_logp", "stride_old", "stride_adv_b", "stride_adv_t",
                                                 "stride_mask", "stride_ref", "stride_ent")})
    policy_sig.update({name: "fp32" for name in ("clip_lo", "clip_hi", "dual_clip", "kl_coef", "ent_coef")})
    policy_sig.update({name: "constexpr" for name in ("HAS_REF", "KL_EST", "HAS_ENT", "SEQ_RATIO", "BLOCK")})
    for has_ref, est in [(False, 0)] + [(True, e) for e in range(len(KL_ESTIMATORS))]:
        for has_ent in (False, True):
            for seq in (False, True):
                configs.append(
                    KernelConfig(
                        _policy_kernel,
                        policy_sig,
                        {"HAS_REF": has_ref, "KL_EST": est, "HAS_ENT": has_ent, "SEQ_RATIO": seq, "BLOCK": BLOCK_T},
                        num_warps=POLICY_WARPS,
                    )
                )
    value_sig = {"v_ptr": "*bf16", "old_ptr": "*bf16", "ret_ptr": "*bf16", "mask_ptr": "*u8", "g_v_ptr": "*fp32",
                 "part_ptr": "*fp32", "T": "i32", "stride_v": "i32", "stride_old": "i32", "stride_ret": "i32",
                 "stride_mask": "i32", "clip": "fp32", "HAS_CLIP": "constexpr", "BLOCK": "constexpr"}
    for has_clip in (False, True):
        configs.append(KernelConfig(_value_kernel, value_sig, {"HAS_CLIP": has_clip, "BLOCK": BLOCK_T}, num_warps=NUM_WARPS))
    return configs


# ================================================================ launchers (validate, allocate, launch)


@dataclass(frozen=True)
class PolicyOptions:
    """Non-tensor options of :func:`policy_loss`, normalized (estimator/agg as indices, no Nones)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = math.inf  # inf: no dual clip
    seq_ratio: bool = False
    kl_coef: float = 0.0
    kl_est: int = 2  # index into KL_ESTIMATORS
    entropy_coef: float = 0.0
    agg: int = 0  # index into AGG_MODES
    norm_length: float = 0.0  # seq-mean-token-sum-norm divisor; 0: T


@dataclass(frozen=True)
class ValueOptions:
    """Non-tensor options of :func:`value_loss`."""

    clip: float = math.inf  # inf: no clipping
    agg: int = 0  # index into AGG_MODES


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T] with unit stride along T (a copy only when it has none)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _mask_arg(mask: torch.Tensor) -> torch.Tensor:
    """Bool masks travel as uint8 (same bytes, no copy); numeric masks as they are."""
    mask = _unit_stride(mask)
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _check_same_bt(logp: torch.Tensor, named: list[tuple[torch.Tensor | None, str]]) -> None:
    for t, name in named:
        if t is not None:
            _checks.tensor(t, name)
            _checks.same_shape(logp, "logp", t, name)


def _validate_policy(logp, old_logp, advantages, mask, ref_logp, entropy, clip_low, clip_high, dual_clip, ratio,
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
    high = clip_low if clip_high is None else _checks.non_negative(clip_high, "clip_high")
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
        _checks.positive(_checks.finite(norm_length, "norm_length"), "norm_length")
    return PolicyOptions(
        clip_low=float(clip_low),
        clip_high=float(high),
        dual_clip=math.inf if dual_clip is None else float(dual_clip),
        seq_ratio=ratio == "sequence",
        kl_coef=float(kl_coef),
        kl_est=KL_ESTIMATORS.index(kl_estimator),
        entropy_coef=float(entropy_coef),
        agg=AGG_MODES.index(agg),
        norm_length=0.0 if norm_length is None else float(norm_length),
    )


def _validate_value(values, old_values, returns, mask, clip, agg) -> ValueOptions:
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
    return ValueOptions(clip=math.inf if clip is None else float(clip), agg=AGG_MODES.index(agg))


def _reduce(partials: torch.Tensor, agg: int, T: int, norm_length: float):
    """Rows' partial sums [B, C, NSLOTS] -> (per-row agg weight w_b [B], loss [], totals [NSLOTS]).

    Every agg mode is ``loss = Σ_b w_b · Σ_t x_bt·m_bt``, so ``dloss/dx_bt = w_b · m_bt``.
    """
    rows = partials.sum(1)  # [B, NSLOTS]
    B = rows.shape[0]
    tokens = rows[:, SLOT_MASK]  # [B]
    mode = AGG_MODES[agg]
    if mode == "token-mean":
        w = (1.0 / tokens.sum().clamp(min=1.0)).expand(B)
    elif mode == "seq-mean-token-mean":
        has = (tokens > 0).float()  # [B]
        w = has / tokens.clamp(min=1.0) / has.sum().clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        w = torch.full((B,), 1.0 / max(B, 1), dtype=torch.float32, device=partials.device)
    else:
        length = T if norm_length == 0 else norm_length
        denom = B * length  # 0 only for an empty batch (B = 0 or T = 0), whose sums are all 0
        w = torch.full((B,), 1.0 / (denom if denom > 0 else 1), dtype=torch.float32, device=partials.device)
    loss = (w * rows[:, SLOT_LOSS]).sum()
    return w.contiguous(), loss, rows.sum(0)


def _policy_metrics(totals: torch.Tensor) -> torch.Tensor:
    """[NSLOTS] sums -> [5] masked means in POLICY_METRICS order (0 for an empty mask)."""
    n = totals[SLOT_MASK].clamp(min=1.0)
    return totals[[SLOT_CLIP, SLOT_APPROX_KL, SLOT_RATIO, SLOT_KL, SLOT_ENT]] / n


def _empty_like_rows(x: torch.Tensor, present: bool) -> torch.Tensor:
    return torch.empty(x.shape if present else (0,), dtype=torch.float32, device=x.device)


def _policy_triton(logp, old_logp, advantages, mask, ref_logp, entropy, opt: PolicyOptions):
    """Launch the fused policy kernel; returns (partials [B, C, NSLOTS], g_logp, g_ref, g_ent [B, T] fp32)."""
    B, T = logp.shape
    logp, old_logp, mask = _unit_stride(logp), _unit_stride(old_logp), _mask_arg(mask)  # [B, T]
    if advantages.dim() == 1:
        adv_strides = (advantages.stride(0), 0)  # [B]: every token of a row reads its sequence's advantage
    else:
        advantages = _unit_stride(advantages)  # [B, T]
        adv_strides = (advantages.stride(0), 1)
    has_ref, has_ent = ref_logp is not None, entropy is not None
    ref = _unit_stride(ref_logp) if has_ref else logp  # [B, T] (placeholder when absent: never read)
    ent = _unit_stride(entropy) if has_ent else logp  # [B, T]
    g_logp = torch.empty((B, T), dtype=torch.float32, device=logp.device)  # [B, T]
    g_ref = _empty_like_rows(logp, has_ref)  # [B, T] or [0]
    g_ent = _empty_like_rows(logp, has_ent)  # [B, T] or [0]
    chunk = max(T, 1) if opt.seq_ratio else BLOCK_T  # one chunk per row in sequence mode (T = 0: nothing to do)
    n_chunks = max(1, cdiv(T, chunk))
    partials = torch.zeros((B, n_chunks, NSLOTS), dtype=torch.float32, device=logp.device)  # [B, C, NSLOTS]
    if B == 0 or T == 0:
        return partials, g_logp, g_ref, g_ent
    _policy_kernel.launch(
        (B, n_chunks),
        logp, old_logp, advantages, mask, ref, ent,
        g_logp, g_ref if has_ref else g_logp, g_ent if has_ent else g_logp, partials,
        T, chunk, logp.stride(0), old_logp.stride(0), adv_strides[0], adv_strides[1], mask.stride(0),
        ref.stride(0), ent.stride(0),
        1.0 - opt.clip_low, 1.0 + opt.clip_high, opt.dual_clip, opt.kl_coef, opt.entropy_coef,
        HAS_REF=has_ref, KL_EST=opt.kl_est if has_ref else 0, HAS_ENT=has_ent, SEQ_RATIO=opt.seq_ratio,
        BLOCK=BLOCK_T, num_warps=POLICY_WARPS,
    )
    return partials, g_logp, g_ref, g_ent


def _kl_torch(d: torch.Tensor, est: int):
    """KL estimate of ``d = logp - ref`` (fp32) and its derivative in logp."""
    if est == 0:
        return d, torch.ones_like(d)
    if est == 1:
        return 0.5 * d * d, d
    if est == 2:
        e = torch.exp(-d)
        return e + d - 1.0, 1.0 - e
    return d.abs(), torch.sign(d)


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
    if opt.seq_ratio:
        inv_n = 1.0 / tokens.clamp(min=1.0)  # [B]
        s = torch.exp((log_ratio * m).sum(-1) * inv_n)  # [B]
        r = s.unsqueeze(-1).expand(B, T)  # [B, T]
    else:
        r = torch.exp(log_ratio)  # [B, T]
    pg_unclipped = -adv * r
    pg_clipped = -adv * torch.clamp(r, 1.0 - opt.clip_low, 1.0 + opt.clip_high)
    clipped = pg_clipped > pg_unclipped  # [B, T]
    pg = torch.where(clipped, pg_clipped, pg_unclipped)
    dpg = torch.where(clipped, torch.zeros_like(adv), -adv)  # d pg / d r
    dual_bound = torch.where(adv < 0, -adv, 1.0) * opt.dual_clip  # [B, T]; never 0·inf
    dual = (adv < 0) & (dual_bound < pg)
    pg = torch.where(dual, dual_bound, pg)
    dpg = torch.where(dual, torch.zeros_like(dpg), dpg)
    x = pg
    zeros_b = torch.zeros(B, dtype=torch.float32, device=lp.device)
    if opt.seq_ratio:
        g_logp = (s * (dpg * m).sum(-1) * inv_n).unsqueeze(-1) * m  # [B, T]
    else:
        g_logp = dpg * r * m
    g_ref, g_ent = _empty_like_rows(lp, False), _empty_like_rows(lp, False)  # [0] each (outputs may not alias)
    kl_rows = ent_rows = zeros_b
    if ref_logp is not None:
        kl, dkl = _kl_torch(lp - torch.where(keep, ref_logp.float(), 0.0), opt.kl_est)  # [B, T]
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
    ).unsqueeze(1)  # [B, 1, NSLOTS]
    return partials, g_logp.contiguous(), g_ref.contiguous(), g_ent.contiguous()


def _value_triton(values, old_values, returns, mask, opt: ValueOptions):
    """Launch the fused value kernel; returns (partials [B, C, NSLOTS], g_values [B, T] fp32)."""
    B, T = values.shape
    values, returns, mask = _unit_stride(values), _unit_stride(returns), _mask_arg(mask)  # [B, T]
    has_clip = opt.clip != math.inf
    old = _unit_stride(old_values) if has_clip else values  # [B, T] (not read without clip)
    g_v = torch.empty((B, T), dtype=torch.float32, device=values.device)  # [B, T]
    n_chunks = max(1, cdiv(T, BLOCK_T))
    partials = torch.zeros((B, n_chunks, NSLOTS), dtype=torch.float32, device=values.device)  # [B, C, NSLOTS]
    if B == 0 or T == 0:
        return partials, g_v
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
    if opt.clip != math.inf:
        old = torch.where(keep, old_values.float(), 0.0)  # [B, T]
        err_c = torch.clamp(v, old - opt.clip, old + opt.clip) - ret
        loss_c = 0.5 * err_c * err_c
        use_c = loss_c > per_token
        per_token = torch.where(use_c, loss_c, per_token)
        g = torch.where(use_c, torch.zeros_like(g), g)
        clipped = use_c.float()
    zeros_b = torch.zeros(v.shape[0], dtype=torch.float32, device=v.device)
    partials = torch.stack(
        [m.sum(-1), (per_token * m).sum(-1), (clipped * m).sum(-1), zeros_b, zeros_b, zeros_b, zeros_b, (v * m).sum(-1)],
        dim=-1,
    ).unsqueeze(1)  # [B, 1, NSLOTS]
    return partials, (g * m).contiguous()


def _kl_triton(logp, ref_logp, est: int, need_grad: bool):
    """Launch the elementwise KL kernel on flattened inputs; returns (kl, dkl/dlogp or [0]) fp32."""
    lp, rf = logp.reshape(-1), ref_logp.reshape(-1)  # [N] (a copy only when not viewable)
    n = lp.numel()
    kl = torch.empty(logp.shape, dtype=torch.float32, device=logp.device)  # [...]
    grad = torch.empty(logp.shape if need_grad else (0,), dtype=torch.float32, device=logp.device)  # [...] or [0]
    if n:
        _kl_kernel.launch(
            (cdiv(n, BLOCK_KL),), lp, rf, kl, grad if need_grad else kl, n,
            EST=est, WRITE_GRAD=need_grad, BLOCK=BLOCK_KL, num_warps=NUM_WARPS,
        )
    return kl, grad


def _use_triton(device: torch.device) -> bool:
    return _backend.select(device, ("torch", "triton")) == "triton"


# ================================================================ torch.library ops with autograd


@torch.library.custom_op("rlkernels::kl_penalty", mutates_args=())
def _kl_op(logp: torch.Tensor, ref_logp: torch.Tensor, est: int, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(logp.device):
        return _kl_triton(logp, ref_logp, est, need_grad)
    kl, grad = _kl_torch(logp.float() - ref_logp.float(), est)
    return kl, (grad if need_grad else kl.new_empty(0))


@_kl_op.register_fake
def _(logp, ref_logp, est, need_grad):
    return logp.new_empty(logp.shape, dtype=torch.float32), logp.new_empty(logp.shape if need_grad else (0,), dtype=torch.float32)


def _kl_setup(ctx, inputs, output):
    logp, ref_logp, _, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.dtypes = (logp.dtype, ref_logp.dtype)


def _kl_backward(ctx, d_kl, _d_grad):
    (grad,) = ctx.saved_tensors  # [...] fp32: dkl/dlogp
    g = grad * d_kl
    return g.to(ctx.dtypes[0]), (-g).to(ctx.dtypes[1]), None, None


_kl_op.register_autograd(_kl_backward, setup_context=_kl_setup)


@torch.library.custom_op("rlkernels::policy_loss", mutates_args=())
def _policy_op(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float,
    seq_ratio: bool,
    kl_coef: float,
    kl_est: int,
    entropy_coef: float,
    agg: int,
    norm_length: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss [], metrics [5], g_logp [B, T], g_ref [B, T] or [0], g_ent [B, T] or [0], w [B])."""
    opt = PolicyOptions(clip_low, clip_high, dual_clip, seq_ratio, kl_coef, kl_est, entropy_coef, agg, norm_length)
    run = _policy_triton if _use_triton(logp.device) else _policy_torch
    partials, g_logp, g_ref, g_ent = run(logp, old_logp, advantages, mask, ref_logp, entropy, opt)
    w, loss, totals = _reduce(partials, agg, logp.shape[1], norm_length)
    return loss, _policy_metrics(totals), g_logp, g_ref, g_ent, w


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
    ctx.dtypes = (logp.dtype, None if ref_logp is None else ref_logp.dtype, None if entropy is None else entropy.dtype)


def _policy_backward(ctx, d_loss, *_unused):
    g_logp, g_ref, g_ent, w = ctx.saved_tensors  # [B, T] fp32 (x3), [B]
    scale = (d_loss * w).unsqueeze(-1)  # [B, 1]: upstream gradient times the agg weight
    dt_logp, dt_ref, dt_ent = ctx.dtypes
    grad_ref = (g_ref * scale).to(dt_ref) if dt_ref is not None else None
    grad_ent = (g_ent * scale).to(dt_ent) if dt_ent is not None else None
    return ((g_logp * scale).to(dt_logp), None, None, None, grad_ref, grad_ent) + (None,) * 9


_policy_op.register_autograd(_policy_backward, setup_context=_policy_setup)


@torch.library.custom_op("rlkernels::value_loss", mutates_args=())
def _value_op(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float, agg: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss [], metrics [2] (clipfrac, values_mean), g_values [B, T], w [B])."""
    opt = ValueOptions(clip, agg)
    run = _value_triton if _use_triton(values.device) else _value_torch
    partials, g_v = run(values, old_values, returns, mask, opt)
    w, loss, totals = _reduce(partials, agg, values.shape[1], 0.0)
    metrics = totals[[SLOT_CLIP, SLOT_VALUES]] / totals[SLOT_MASK].clamp(min=1.0)  # [2]
    return loss, metrics, g_v, w


@_value_op.register_fake
def _(values, old_values, returns, mask, clip, agg):
    f32 = dict(dtype=torch.float32)
    return (values.new_empty((), **f32), values.new_empty((2,), **f32), values.new_empty(values.shape, **f32),
            values.new_empty((values.shape[0],), **f32))


def _value_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3])
    ctx.dtype = inputs[0].dtype


def _value_backward(ctx, d_loss, *_unused):
    g_v, w = ctx.saved_tensors  # [B, T] fp32, [B]
    return (g_v * (d_loss * w).unsqueeze(-1)).to(ctx.dtype), None, None, None, None, None


_value_op.register_autograd(_value_backward, setup_context=_value_setup)


# ================================================================ public functions


def _reference_backend() -> bool:
    return _backend.forced_backend() == "reference"


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of the policy against a reference policy.

    Args:
        logp: ``[...]`` float log-probabilities of the sampled tokens under the policy.
        ref_logp: ``[...]`` the same tokens' log-probabilities under the reference policy (same shape).
        estimator: ``"k1"`` (``logp - ref``), ``"k2"`` (``½(logp - ref)²``),
            ``"k3"`` (``exp(ref - logp) - (ref - logp) - 1``, unbiased and non-negative) or
            ``"abs"`` (``|logp - ref|``).

    Returns:
        ``[...]`` float32. Differentiable in ``logp`` and ``ref_logp``; gradients come back in
        their dtypes. On CUDA one fused elementwise Triton kernel writes the value and its
        derivative together (the derivative only when a gradient is needed).
    """
    _checks.floating(logp, "logp")
    _checks.floating(ref_logp, "ref_logp")
    _checks.same_shape(logp, "logp", ref_logp, "ref_logp")
    _checks.same_device((logp, "logp"), (ref_logp, "ref_logp"))
    _checks.choice(estimator, "estimator", KL_ESTIMATORS)
    with _backend.float32_compute(logp.device):
        if _reference_backend():
            return _ref.kl_penalty(logp, ref_logp, estimator)
        need_grad = torch.is_grad_enabled() and (logp.requires_grad or ref_logp.requires_grad)
        kl, _ = _kl_op(logp, ref_logp, KL_ESTIMATORS.index(estimator), need_grad)  # [...] fp32
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
    norm_length: int | None = None,
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
        norm_length: divisor per sequence for ``"seq-mean-token-sum-norm"`` (default ``T``), finite and > 0.

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar, differentiable in ``logp``, ``ref_logp`` and
        ``entropy`` (gradients in their dtypes); ``metrics`` a dict of detached float32 scalars:
        ``clipfrac``, ``approx_kl`` (masked mean of ``old_logp - logp``), ``ratio_mean``, plus
        ``kl`` / ``entropy`` when those tensors are given. Where both branches of the max tie (inside
        the clip range they are the same function of ``r``) the gradient is ``-A·dr``.
    """
    opt = _validate_policy(logp, old_logp, advantages, mask, ref_logp, entropy, clip_low, clip_high, dual_clip, ratio,
                           kl_coef, kl_estimator, entropy_coef, agg, norm_length)
    with _backend.float32_compute(logp.device):
        if _reference_backend():
            return _ref.policy_loss(logp, old_logp.detach(), advantages.detach(), mask, clip_low=opt.clip_low,
                                    clip_high=opt.clip_high, dual_clip=dual_clip, ratio=ratio, ref_logp=ref_logp,
                                    kl_coef=opt.kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                                    entropy_coef=opt.entropy_coef, agg=agg, norm_length=norm_length)
        loss, metrics, *_ = _policy_op(
            logp, old_logp.detach(), advantages.detach(), mask.detach(), ref_logp, entropy,
            opt.clip_low, opt.clip_high, opt.dual_clip, opt.seq_ratio, opt.kl_coef, opt.kl_est, opt.entropy_coef,
            opt.agg, opt.norm_length,
        )  # loss [], metrics [5]
    metrics = metrics.detach()
    out = {"clipfrac": metrics[0], "approx_kl": metrics[1], "ratio_mean": metrics[2]}
    if ref_logp is not None:
        out["kl"] = metrics[3]
    if entropy is not None:
        out["entropy"] = metrics[4]
    return loss, out


def value_loss(
    values: torch.Tensor,  # [B, T]
    old_values: torch.Tensor,  # [B, T]
    returns: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    clip: float | None = None,
    agg: str = "token-mean",
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

    Returns:
        ``(loss, metrics)``: float32 scalar loss differentiable in ``values`` (gradient in its dtype);
        ``metrics`` holds detached scalars ``clipfrac`` (share of tokens where the clipped error
        wins; 0 without ``clip``) and ``values_mean`` (masked mean of ``values``).
    """
    opt = _validate_value(values, old_values, returns, mask, clip, agg)
    with _backend.float32_compute(values.device):
        if _reference_backend():
            return _ref.value_loss(values, old_values.detach(), returns.detach(), mask, clip=clip, agg=agg)
        loss, metrics, _, _ = _value_op(values, old_values.detach(), returns.detach(), mask.detach(), opt.clip,
                                        opt.agg)  # loss [], metrics [2]
    metrics = metrics.detach()
    return loss, {"clipfrac": metrics[0], "values_mean": metrics[1]}
