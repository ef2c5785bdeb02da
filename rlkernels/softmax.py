"""Log-probabilities (and entropy) of chosen tokens from logits, without an ``[N, V]`` float32 copy.

``logprobs(logits, labels)`` is ``log_softmax(logits.float() / T).gather(-1, labels)``
(see :func:`rlkernels.reference.logprobs`). Eager PyTorch materializes the
float32 log-softmax (and, for the entropy, the probabilities) of every row;
here each row is reduced in vocabulary blocks:

- forward: one read of the row, an online log-sum-exp and an online
  ``Σ e^(z-m) (z-m)`` (both shifted by the running max ``m``; on a GPU each
  thread keeps its own running max and sums over its 16-byte chunks, merged
  across the block once per row, see ``_online_row_stats``), giving
  ``log p_y = (z_y - m) - log s`` and ``H = log s - w / s`` (``z = logits/T``).
  Each row's max logit ``x_max`` (``m = x_max/T``) and shifted sum
  ``s = Σ e^(z-m)`` (``stats`` ``[..., 2]``, the same layout and values in
  every backend) and ``H`` are kept for the backward: O(N).
- backward: one more read of the row, one write of ``dlogits`` in the logits
  dtype: ``dz_j = [g_logp (δ_jy - p_j) - g_H p_j (log p_j + H)] / T`` (the Triton
  kernel writes it as ``2^u (a + b u)`` with per-row ``a, b``, the label's entry
  formed once per row), with
  ``p_j = e^(z_j - m) / s`` (never ``e^(z_j - lse)`` from one float32 ``lse``,
  which loses ``ulp(|lse|)`` at large logits) and ``1 - p_y`` formed as
  ``-expm1(log p_y)``; ``p log p`` is 0 where ``p = 0`` (a -inf logit).

Returned values lie in their valid range (``log p <= 0``, ``H >= 0``; round-off
on confident rows could leave them a few ulps outside); the backward uses the
unclamped formulas. Ignored positions give 0 and zero gradient whatever their
logits hold; a label out of ``[0, V)`` raises on the CPU and gives NaN on a GPU.
Everything computes in float32 (float64 for float64 logits, whose outputs are still returned in float32)
under any autocast.

Backends: ``triton`` (CUDA; Triton's interpreter on CPU tensors), ``torch``
(chunked over rows so a chunk's float32 workspace stays small), ``reference``
(the eager formulas, through autograd). The ops pick ``triton`` or ``torch`` from
their tables (``_FWD_IMPLS``, ``_BWD_IMPLS``) through ``rlkernels._backend.resolve``,
at run time inside the op; the reference is served in one place before the op
(:func:`rlkernels._backend.serves_reference`). Options travel as one frozen :class:`LogprobsOptions`.

Order: Triton kernels -> launchers (validate, allocate, launch) -> torch.library ops
with autograd -> public function.

The ``torch`` backend is the CPU default, so its pass count is its speed: per
chunk of rows the forward is a max, a subtraction of it and a scale by
``log2(e)/T``, ``exp2`` (several times faster than ``exp`` in PyTorch's CPU
kernels), a sum, and for the entropy one multiply and a sum; the backward is the
same subtraction and scale, ``exp2``, and a multiply into ``dlogits`` (plus a
multiply-add for the entropy term, which it skips when the entropy's upstream
gradient is None or zero). It keeps each row's max and shifted sum rather than
their log-sum-exp, and the max is subtracted before anything rounds: the
exponent is exactly 0 at the max at any magnitude (a confident row's ``log p``
and ``H`` come out exactly 0, as eager's), and the label's ``log p`` is
``(x_y - max)/T - log s`` from its raw logit, as eager's ``log_softmax`` forms it.
(One fused multiply-add ``x·log2e/T - max·log2e/T`` saves a pass -- within the
noise of fwd+bwd at N = 256, V = 49152 -- but leaves its rounding residual in
every exponent: errors of ~1e-8 where eager's are 0, and ulp(|x·log2e/T|) in
``log p`` at large logits.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernels import _backend, _checks, reference
from rlkernels._device import block_max, block_sum, expm1
from rlkernels._host import (
    TRITON_DTYPE_NAMES, autograd_function, call, custom_op, float32_outputs, label_logp, op_schema, option_values,
    options_from, refuse_double_backward,
)
from rlkernels._triton import HAS_TRITON, jit, tl

# ---------------------------------------------------------------- Triton kernels


# the most negative finite float32: each tile row's shift before it has seen anything (a constexpr: a @jit global)
_FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38) if HAS_TRITON else -3.4028234663852886e38


@jit
def _tile_update(x, m_r, s_r, w_r, c):
    """Fold a ``[CHUNKS, ROWS, VEC]`` tile of logits ``x`` (float32) into the tile rows' running max ``m_r``,
    ``s_r = Σ 2^u`` and ``w_r = Σ 2^u u`` (``u = (x - m_r)·c``, ``c = log2(e)/T``), all ``[ROWS]``."""
    m_new = tl.maximum(m_r, block_max(block_max(x, 2), 0))  # [ROWS]; finite unless the row holds +inf (NaN follows)
    # m - m' <= 0; clamped at -1e4 (2^-1e4 is 0) so a row that saw nothing (m = lowest) never gives -inf·0
    step = tl.maximum((m_r - m_new) * c, -1.0e4)  # [ROWS]
    alpha = tl.math.exp2(step)  # [ROWS]
    # u clamped below at -1e4 (2^u is 0 there either way): 2^u·u is then 0·finite at a -inf logit, not
    # NaN; the clamp keeps NaN (a NaN logit poisons its row as everywhere else)
    u = tl.maximum((x - m_new[None, :, None]) * c, -1.0e4, propagate_nan=tl.PropagateNan.ALL)  # [CHUNKS, ROWS, VEC]
    e = tl.math.exp2(u)  # [CHUNKS, ROWS, VEC]
    # re-centre w on the new max: Σ 2^(u')(u') = α (w + (m - m')c s)
    w_r = alpha * (w_r + step * s_r) + block_sum(block_sum(e * u, 2), 0)
    s_r = alpha * s_r + block_sum(block_sum(e, 2), 0)
    return m_new, s_r, w_r


@jit
def _online_row_stats(row_ptr, V, v_end, inv_temp, BLOCK_V: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr):
    """One read of a row's first ``v_end`` logits (``V`` or 0) in blocks: ``(x_max, s, w)``, its max logit,
    ``s = Σ e^(z - m)`` and ``w = Σ e^(z - m) (z - m)`` with ``z = x/T``, ``m = x_max/T``.

    A block of ``BLOCK_V`` logits is a ``[CHUNKS, ROWS, VEC]`` tile: tile row ``r`` holds the ``VEC``
    consecutive logits (16 bytes) at ``r·VEC + k·ROWS·VEC`` for each chunk ``k`` (a warp's loads are
    contiguous). With ``ROWS`` = the program's threads, each thread owns one tile row and keeps its own
    running max, ``Σ 2^u`` and ``Σ 2^u u`` (an online log-sum-exp, base 2: ``u = (x - max)·log2(e)/T``), in
    registers. The tile rows are merged across the block once, after the loop: an iteration has no shuffle,
    barrier or shared memory. The full blocks are read without a mask, the last partial block (if any)
    after the loop."""
    CHUNKS: tl.constexpr = BLOCK_V // (ROWS * VEC)
    # Loaded as [CHUNKS, ROWS·VEC], ROWS·VEC consecutive logits per chunk, then reshaped: a 3-D offset tensor
    # shows Triton only VEC-long contiguity, and Triton 3.6 then spreads a warp's lanes over the chunks, which
    # turns the per-thread reduction into shuffles (sm_90: 10.8-13.9 SASS per logit instead of 8.3-9.3).
    offs0 = tl.arange(0, CHUNKS)[:, None] * (ROWS * VEC) + tl.arange(0, ROWS * VEC)[None, :]  # [CHUNKS, ROWS·VEC]
    # Everything is shifted by a max logit before the temperature scales it: z - max(z) = (x - x_max)/T is
    # then exactly 0 at the max and exact near it at any magnitude (x·inv_temp - m, which the compiler
    # contracts into one fma, would leave the product's rounding residual at the max: up to ulp(m)/2, which
    # e^(·) cannot absorb once |logits/T| passes ~1e9).
    c = inv_temp * 1.4426950408889634  # log2(e) / T
    m_r = tl.full([ROWS], _FLOAT32_LOWEST, tl.float32)  # running max logit of each tile row
    s_r = tl.full([ROWS], 0.0, tl.float32)  # Σ 2^u over the tile row's logits so far
    w_r = tl.full([ROWS], 0.0, tl.float32)  # Σ 2^u u
    v_full = v_end - v_end % BLOCK_V
    for start in range(0, v_full, BLOCK_V):
        x = tl.reshape(tl.load(row_ptr + start + offs0).to(tl.float32), [CHUNKS, ROWS, VEC])  # [CHUNKS, ROWS, VEC]
        m_r, s_r, w_r = _tile_update(x, m_r, s_r, w_r, c)
    if v_full < v_end:
        offs = v_full + offs0  # [CHUNKS, ROWS·VEC]
        x = tl.load(row_ptr + offs, mask=offs < v_end, other=float("-inf")).to(tl.float32)  # [CHUNKS, ROWS·VEC]
        x = tl.reshape(x, [CHUNKS, ROWS, VEC])  # [CHUNKS, ROWS, VEC]
        m_r, s_r, w_r = _tile_update(x, m_r, s_r, w_r, c)
    # merge the tile rows, each re-centred on the row's max x_max
    x_max = block_max(m_r, 0)
    step = tl.maximum((m_r - x_max) * c, -1.0e4)  # [ROWS]
    f = tl.math.exp2(step)  # [ROWS]
    s = block_sum(f * s_r, 0)
    w = block_sum(f * (w_r + step * s_r), 0) * 0.6931471805599453  # base 2 -> natural: Σ e^(z-m)(z-m)
    # a row of only -inf logits saw nothing (s = 0): its max is -inf, not the initial shift
    x_max = tl.where(s == 0.0, float("-inf"), x_max)
    return x_max, s, w


@jit
def _row_forward(row_ptr, label, V, inv_temp, ignore_index, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
                 VEC: tl.constexpr):
    """One row's forward from one read of its logits (:func:`_online_row_stats`): ``(valid, in_range, x_max, s,
    log_s, logp_raw, logp, entropy)``, scalars. ``x_max`` and ``s`` are the saved statistics (0 and 1 on ignored
    rows, NaN for a label out of range); ``logp_raw`` is ``log p_y`` as the backward forms it (before the clamp
    to <= 0); ``logp`` and ``entropy`` are the returned values (0 on ignored rows). Shared by the forward kernel
    and :mod:`rlkernels.fused_policy`'s one-kernel policy loss."""
    valid = label != ignore_index
    in_range = (label >= 0) & (label < V)
    # ignored rows run zero iterations: their logits are never read
    x_max, s, w = _online_row_stats(row_ptr, V, tl.where(valid, V, 0), inv_temp, BLOCK_V, ROWS, VEC)
    s = tl.where(valid, s, 1.0)  # an ignored row read nothing: keep its (discarded) values finite
    # the saved shift: 0 on ignored rows and on rows that are all -inf (as the torch backend's)
    x_max = tl.where(valid & (x_max != float("-inf")), x_max, 0.0)
    log_s = tl.log(s)
    entropy = log_s - w / s
    # the chosen logit, read in float32 from the row itself; never read out of bounds
    safe_label = tl.where(valid & in_range, label, 0)
    x_y = tl.load(row_ptr + safe_label, mask=valid & in_range, other=0.0).to(tl.float32)
    # (z_y - m) - log s, not z_y - lse: when y is the max, z_y - m is exactly 0 and logp
    # keeps the full relative precision of log s (the backward's 1 - p_y depends on it)
    logp_raw = (x_y - x_max) * inv_temp - log_s
    # round-off can leave log p a few ulps above 0 (or H below 0) on confident rows: return the
    # valid range; comparisons are false for NaN, so NaN stays NaN
    logp = tl.where(logp_raw > 0, 0.0, logp_raw)
    entropy = tl.where(entropy < 0, 0.0, entropy)
    bad = valid & (~in_range)  # a label out of [0, V) gives NaN, on the GPU nothing raises
    logp = tl.where(bad, float("nan"), logp)
    entropy = tl.where(bad, float("nan"), entropy)
    x_max = tl.where(bad, float("nan"), x_max)
    s = tl.where(bad, float("nan"), s)
    return valid, in_range, x_max, s, log_s, logp_raw, tl.where(valid, logp, 0.0), tl.where(valid, entropy, 0.0)


@jit
def _logprobs_fwd_kernel(
    logits_ptr,  # [O, I, V] rows at outer/inner strides, last stride 1; fp32/bf16/fp16
    labels_ptr,  # [N] int64, N = O * I
    logp_ptr,  # [N] fp32
    entropy_ptr,  # [N] fp32
    stats_ptr,  # [N, 2] fp32, saved for the backward: (max logit, Σ e^(z - max z)); (0, 1) on ignored rows
    stride_outer,
    stride_inner,
    inner,  # I: rows per outer index
    V,
    inv_temp,  # 1 / temperature
    ignore_index,
    BLOCK_V: tl.constexpr,
    ROWS: tl.constexpr,  # tile rows per block: the program's threads (see _online_row_stats)
    VEC: tl.constexpr,  # logits per 16 bytes
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
    label = tl.load(labels_ptr + row)
    _v, _r, x_max, s, _ls, _lr, logp, entropy = _row_forward(row_ptr, label, V, inv_temp, ignore_index, BLOCK_V,
                                                             ROWS, VEC)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(stats_ptr + 2 * row, x_max)
    tl.store(stats_ptr + 2 * row + 1, s)


@jit
def _bf16_round_bits(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), still as float32, so that a
    truncating cast to bf16 is exact: the interpreter's cast truncates (2x the GPU's error). A carry
    may reach inf, as the GPU's rounding does; NaN of any payload (the GPU's canonical 0x7FFFFFFF
    would carry into the sign bit and become -0.0) is returned as a NaN that truncates to NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, float("nan"), rounded)


@jit
def _logprobs_bwd_kernel(
    logits_ptr,  # [O, I, V] as in the forward
    labels_ptr,  # [N] int64
    stats_ptr,  # [N, 2] fp32 from the forward: (max logit, Σ e^(z - max z))
    entropy_ptr,  # [N] fp32
    g_logp_ptr,  # [N] fp32
    g_entropy_ptr,  # [N] fp32
    dlogits_ptr,  # [N, V] contiguous, the logits dtype
    stride_outer,
    stride_inner,
    inner,
    V,
    inv_temp,
    ignore_index,
    BLOCK_V: tl.constexpr,
    INTERPRETED: tl.constexpr,  # running under Triton's interpreter (CPU tensors)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    in_range = (label >= 0) & (label < V)
    x_max = tl.load(stats_ptr + 2 * row)  # the max logit
    s = tl.load(stats_ptr + 2 * row + 1)
    log_s = tl.log(s)
    ent = tl.load(entropy_ptr + row)
    g_logp = tl.where(valid, tl.load(g_logp_ptr + row), 0.0)
    g_ent = tl.where(valid, tl.load(g_entropy_ptr + row), 0.0)
    # log p_y as the forward formed it (before its clamp to <= 0)
    safe_label = tl.where(valid & in_range, label, 0)
    x_y = tl.load(row_ptr + safe_label, mask=valid & in_range, other=0.0).to(tl.float32)
    logp_y = (x_y - x_max) * inv_temp - log_s
    _row_dlogits(row_ptr, dlogits_ptr + row * V, valid, tl.where(valid & in_range, label, -1).to(tl.int32), V, x_max,
                 s, log_s, ent, logp_y, g_logp, g_ent, inv_temp, dlogits_ptr, BLOCK_V, INTERPRETED, False)


@jit
def _row_dlogits(row_ptr, out_ptr, compute, label32, V, x_max, s, log_s, ent, logp_y, g_logp, g_ent, inv_temp,
                 dlogits_ptr, BLOCK_V: tl.constexpr, INTERPRETED: tl.constexpr, REVERSE: tl.constexpr):
    """One row's ``dlogits`` (``V`` entries at ``out_ptr``, the logits dtype) from one more read of its logits,
    given the forward's statistics ``x_max``, ``s`` (``log_s = log s``), entropy ``ent`` and unclamped ``log p_y``
    and the row's upstream gradients ``g_logp``, ``g_ent``; zeros without reading the row where ``compute`` is
    false. ``label32``: the label's column, -1 when it has none. ``REVERSE``: the blocks last to first (the partial
    block, then the full ones backwards), for a caller that has just read the row front to back: the blocks it
    read last are the likeliest still in L2. Shared by the backward kernel and :mod:`rlkernels.fused_policy`'s
    one-kernel policy loss."""
    inv_s = 1.0 / s
    p_y = tl.exp(logp_y)
    # the label's entry: [g_logp (1 - p_y) - g_H p_y (log p_y + H)] / T, 1 - p_y without cancellation, its
    # entropy term 0 where p_y = 0
    g_y = (g_logp * -expm1(logp_y) - g_ent * tl.where(p_y > 0, p_y * (logp_y + ent), 0.0)) * inv_temp
    # every other entry: dz_j = -[g_logp + g_H (log p_j + H)] p_j / T with p_j = 2^u_j / s, u_j = (x_j - max)·log2(e)/T
    # and log p_j = u_j ln 2 - log s, i.e. dz_j = 2^u_j (a + b u_j)
    a = -(g_logp + g_ent * (ent - log_s)) * inv_temp * inv_s
    b = -g_ent * 0.6931471805599453 * inv_temp * inv_s
    c = inv_temp * 1.4426950408889634  # log2(e) / T
    cols = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    v_full = V - V % BLOCK_V
    if compute:
        if REVERSE and v_full < V:
            _dlogits_tail(row_ptr, out_ptr, v_full + cols, V, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED)
        for i in range(0, v_full, BLOCK_V):  # full blocks: no mask
            if REVERSE:
                # a multiple of BLOCK_V, said explicitly: Triton 3.6 cannot prove it through the subtraction and
                # would load the row one element at a time (32 loads per thread and block instead of 4)
                start = tl.multiple_of(v_full - BLOCK_V - i, BLOCK_V)
            else:
                start = i
            offs = start + cols  # [BLOCK_V]
            x = tl.load(row_ptr + offs).to(tl.float32)  # [BLOCK_V]
            g = _dlogits(x, offs, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED)  # [BLOCK_V]
            tl.store(out_ptr + offs, g)
        if not REVERSE and v_full < V:
            _dlogits_tail(row_ptr, out_ptr, v_full + cols, V, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED)
    else:  # an ignored row (or one with no gradient): zeros, whatever its logits hold (they are never read)
        zero = tl.zeros([BLOCK_V], dlogits_ptr.dtype.element_ty)  # [BLOCK_V]
        for start in range(0, V, BLOCK_V):
            offs = start + cols  # [BLOCK_V]
            tl.store(out_ptr + offs, zero, mask=offs < V)


@jit
def _dlogits_tail(row_ptr, out_ptr, offs, V, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED: tl.constexpr):
    """The last, partial block of a row's ``dlogits`` (columns ``offs`` [BLOCK_V], those < V exist)."""
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
    g = _dlogits(x, offs, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED)  # [BLOCK_V]
    tl.store(out_ptr + offs, g, mask=offs < V)


@jit
def _dlogits(x, offs, x_max, c, a, b, label32, g_y, dlogits_ptr, INTERPRETED: tl.constexpr):
    """One block of ``dlogits`` in its dtype: ``2^u a + (2^u u) b`` with ``u = (x - max)·c`` clamped below at -1e4
    (``2^u`` is 0 there either way, and ``p log p`` is then 0·finite at a -inf logit, not NaN; the clamp keeps
    NaN), ``g_y`` at the label's column. ``2^u u`` is formed before ``b`` (~g_H/T): at tiny temperatures ``b u``
    overflows, and ``2^u (a + b u)`` was 0·inf = NaN where p = 0."""
    # z - max, as the forward formed it: exact near the max, so p keeps eager's precision at any magnitude
    u = tl.maximum((x - x_max) * c, -1.0e4, propagate_nan=tl.PropagateNan.ALL)  # [BLOCK_V]
    p = tl.math.exp2(u)  # [BLOCK_V]
    g = p * a + (p * u) * b  # [BLOCK_V]
    g = tl.where(offs == label32, g_y, g)
    if INTERPRETED and dlogits_ptr.dtype.element_ty == tl.bfloat16:
        g = _bf16_round_bits(g)  # the interpreter's cast truncates; compiled, the hardware rounds
    return g.to(dlogits_ptr.dtype.element_ty)


# ---------------------------------------------------------------- launcher


@dataclass(frozen=True)
class LogprobsOptions:
    """The non-tensor options of one :func:`logprobs` call, validated: its keyword arguments under their own names
    and meanings, down to the kernels (which receive ``1 / temperature`` and ``ignore_index``). They cross each
    custom op as ``*option_values(opt)`` (typed lists) and come back through ``options_from``; the defaults live
    in the public signature only."""

    temperature: float  # > 0, divides the logits
    return_entropy: bool  # False: the entropy output is zeros and its gradient is ignored
    ignore_index: int  # label value whose rows give 0 and no gradient


def _validate(*, logits, labels, temperature, return_entropy, ignore_index) -> LogprobsOptions:
    """Checks :func:`logprobs`'s arguments (each error names its argument); returns the options."""
    _checks.floating(logits, "logits")
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dimension [..., V], got a 0-d tensor")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got V = 0")
    _checks.integer(labels, "labels")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    _checks.same_device((logits, "logits"), (labels, "labels"))
    return LogprobsOptions(temperature=_checks.temperature(temperature),
                           return_entropy=_checks.flag(return_entropy, "return_entropy"),
                           ignore_index=_checks.index(ignore_index, "ignore_index"))


@dataclass(frozen=True)
class _LaunchConfig:
    block_v: int
    num_warps: int
    num_stages: int


# The launcher picks from this fixed set only (by V); aot_configs() compiles each one.
_SMALL_V = _LaunchConfig(block_v=1024, num_warps=1, num_stages=2)  # V <= 1024: one block per row, 32 elements per thread
_LARGE_V = _LaunchConfig(block_v=8192, num_warps=8, num_stages=2)  # 32 elements per thread per block
_LAUNCH_CONFIGS = (_SMALL_V, _LARGE_V)

# Below this, exp() is exactly 0 in float32 and float64: clamping log p (or z - m) to it turns
# the 0 · -inf of a -inf logit into 0 · finite, and keeps b · log p finite. NaN stays NaN.
_LOG_P_FLOOR = -1.0e4

# Float32 workspace per chunk of rows in the torch backend: two [rows, V] buffers of this size,
# allocated once per call. Measured on a 2-core EPYC (1 MiB L2 per core, 32 MiB L3; N = 512,
# V = 32000, fwd+bwd): 128 KiB chunks pay per-op overhead, 8 MiB ones spill to memory, 1-4 MiB
# are flat within noise, 2 MiB fastest at 1 and 2 threads.
_CHUNK_BYTES = 2 << 20

# The torch backend works in base 2: exp2 is several times faster than exp in PyTorch's CPU
# kernels, and the conversion folds into the scale by 1/T.
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _launch_config(V: int) -> _LaunchConfig:
    return _SMALL_V if V <= _SMALL_V.block_v else _LARGE_V


def _fwd_signature(dtype: str) -> dict:
    return {
        "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "logp_ptr": "*fp32", "entropy_ptr": "*fp32",
        "stats_ptr": "*fp32", "stride_outer": "i64", "stride_inner": "i64", "inner": "i32", "V": "i32",
        "inv_temp": "fp32", "ignore_index": "i64", "BLOCK_V": "constexpr", "ROWS": "constexpr", "VEC": "constexpr",
    }  # fmt: skip


def _fwd_constexprs(cfg: _LaunchConfig, dtype: str) -> dict:
    """The forward's tile: one tile row per thread, 16 bytes of logits per chunk."""
    return {"BLOCK_V": cfg.block_v, "ROWS": 32 * cfg.num_warps, "VEC": 16 // (4 if dtype == "fp32" else 2)}


def _bwd_signature(dtype: str) -> dict:
    return {
        "logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "stats_ptr": "*fp32", "entropy_ptr": "*fp32",
        "g_logp_ptr": "*fp32", "g_entropy_ptr": "*fp32", "dlogits_ptr": f"*{dtype}", "stride_outer": "i64",
        "stride_inner": "i64", "inner": "i32", "V": "i32", "inv_temp": "fp32", "ignore_index": "i64",
        "BLOCK_V": "constexpr", "INTERPRETED": "constexpr",
    }  # fmt: skip


def aot_configs() -> list[KernelConfig]:
    """Every (kernel, dtype, BLOCK_V, warps, stages) the launcher can pick on a GPU (compiled, so the
    backward's ``INTERPRETED`` is False)."""
    from rlkernels.testing.aot import KernelConfig

    out = []
    for dtype in TRITON_DTYPE_NAMES.values():
        for cfg in _LAUNCH_CONFIGS:
            out.append(KernelConfig(_logprobs_fwd_kernel, _fwd_signature(dtype), _fwd_constexprs(cfg, dtype), cfg.num_warps, cfg.num_stages,
                                   elements=cfg.block_v))
            constexprs = {"BLOCK_V": cfg.block_v, "INTERPRETED": False}
            out.append(KernelConfig(_logprobs_bwd_kernel, _bwd_signature(dtype), constexprs, cfg.num_warps, cfg.num_stages,
                                   elements=cfg.block_v))
    return out


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] as a [O, I, V] view with last stride 1, copying only when the
    leading dims do not collapse into two strided dims (e.g. ``logits[:, :-1]`` needs no copy)."""
    V = logits.shape[-1]
    if logits.stride(-1) != 1 and V > 1:
        logits = logits.contiguous()
    merged: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        return _as_rows(logits.contiguous())
    while len(merged) < 2:
        merged.insert(0, [1, 0])
    (outer, s_outer), (inner, s_inner) = merged
    return torch.as_strided(logits, (outer, inner, V), (s_outer, s_inner, 1))  # [O, I, V]


def _row_chunks(rows: torch.Tensor, chunk: int):
    """Yield ``(first_row, x)`` with ``x`` a [c, V] view of ``rows`` [O, I, V], c <= chunk."""
    O, I, _ = rows.shape
    for o in range(O):
        for i in range(0, I, chunk):
            yield o * I + i, rows[o, i : i + chunk]  # [c, V]


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    return reference.compute_dtype(logits)


def _chunk_rows(V: int, dtype: torch.dtype) -> int:
    return max(1, _CHUNK_BYTES // (V * dtype.itemsize))


def _base2_exponents(x, m, temperature: float, out):
    """``out = (x - m)·log2(e)/T`` [c, V]: each logit's base-2 exponent ``u`` (``p = 2^u / s``), from the rows
    ``x`` [c, V] in the compute dtype (``out`` itself may hold them) and each row's max logit ``m`` [c, 1].

    The max is subtracted before the scale rounds anything: ``u`` is exactly 0 at the max and exact near it
    at any magnitude, as eager's ``z - max``, and a difference that overflows (bf16 logits reach ±3.4e38) is
    a probability that is exactly 0. The forward and the backward call this one function on the same chunks,
    so both see the same exponents bit for bit."""
    torch.sub(x, m, out=out)  # [c, V] <= 0
    scale = _LOG2E / temperature
    if scale > torch.finfo(out.dtype).max:  # T < log2(e)/FLT_MAX: inf, and 0·inf = NaN at the max; 1/T is finite
        return out.mul_(1.0 / temperature).mul_(_LOG2E)
    return out.mul_(scale)


def _label_logp(rows, safe, m, s, temperature: float):
    """``log p_y = (x_y - m)/T - log s`` [N] from each row's raw label logit, as an accurate ``log_softmax`` forms
    it (:func:`rlkernels._host.label_logp`: in float64, rounded once), never through the rounded base-2 exponent.
    ``rows`` [O, I, V] the logits, ``safe`` [N] a column per row, ``m`` [N] the rows' max (the saved shift), ``s``
    [N] their sums of exponentials. The forward and the backward both form it here, bit for bit."""
    O, I, _ = rows.shape
    x_y = rows.gather(-1, safe.view(O, I, 1)).reshape(-1).to(s.dtype)  # [N]
    return label_logp(x_y, m, s, temperature)


def _finish(logp, entropy, stats, valid, bad):
    """The values every backend returns: ``log p <= 0`` and ``H >= 0`` (round-off on confident rows can leave
    them a few ulps outside; ``clamp`` keeps NaN), NaN for a label out of range, 0 and statistics (0, 1) on
    ignored rows. ``logp``, ``entropy``, ``valid``, ``bad`` [N]; ``stats`` [N, 2]."""
    nan = torch.full_like(logp, float("nan"))  # [N]
    zero = torch.zeros_like(logp)  # [N]
    logp = torch.where(valid, torch.where(bad, nan, logp.clamp(max=0.0)), zero)  # [N]
    entropy = torch.where(valid, torch.where(bad, nan, entropy.clamp(min=0.0)), zero)  # [N]
    ignored_stats = torch.tensor([0.0, 1.0], dtype=stats.dtype, device=stats.device)  # [2]
    stats = torch.where(valid[:, None], torch.where(bad[:, None], nan[:, None], stats), ignored_stats)  # [N, 2]
    return logp, entropy, stats


def _torch_forward(logits, labels, opt: LogprobsOptions):
    """Chunked over rows; a chunk's workspace is two [c, V] buffers of <= _CHUNK_BYTES each,
    allocated once. Per chunk: max, shift and scale, exp2, sum (+ multiply, sum for H).

    Returns ``(logp, entropy, stats)``: ``stats`` [..., 2] holds each row's max logit ``m`` and shifted
    sum ``s = Σ e^((x - m)/T)``, which the backward uses as they are: it shifts by ``m`` and divides by
    ``s`` separately, so log p keeps the relative precision of ``z - max`` rather than the absolute one
    of a log-sum-exp. Without ``opt.return_entropy`` the entropy is zeros (not computed).
    """
    rows = _as_rows(logits)  # [O, I, V]
    O, I, V = rows.shape
    N = O * I
    cdt = _out_dtype(logits)
    dev = logits.device
    on_cpu = dev.type == "cpu"
    lab = labels.reshape(-1)  # [N]
    valid = lab != opt.ignore_index  # [N]
    in_range = (lab >= 0) & (lab < V)  # [N]
    safe = torch.where(valid & in_range, lab, torch.zeros_like(lab))  # [N]
    entropy = torch.empty(N, dtype=cdt, device=dev) if opt.return_entropy else torch.zeros(N, dtype=cdt, device=dev)  # [N]
    stats = torch.empty(N, 2, dtype=cdt, device=dev)  # [N, 2] (m, s)
    chunk = min(_chunk_rows(V, cdt), max(I, 1))
    z_ws = torch.empty(chunk, V, dtype=cdt, device=dev)  # [chunk, V]
    e_ws = torch.empty(chunk, V, dtype=cdt, device=dev)  # [chunk, V]
    for r0, x_in in _row_chunks(rows, chunk):  # x_in: [c, V]
        c = x_in.shape[0]
        r1 = r0 + c
        z, e = z_ws[:c], e_ws[:c]  # [c, V]
        x = x_in if x_in.dtype == cdt else z.copy_(x_in)  # [c, V] one upcast; everything below reads the compute dtype
        m = x.amax(dim=-1, keepdim=True)  # [c, 1] the max logit
        # the shift the backward will read from stats: 0 for an all -inf row (no -inf - -inf) and for an
        # ignored row (its values are discarded; its logits may be NaN or huge)
        m = torch.where((m == float("-inf")) | ~valid[r0:r1, None], torch.zeros_like(m), m)
        _base2_exponents(x, m, opt.temperature, z)  # [c, V] u = (x - m)·log2e/T, <= 0
        torch.exp2(z, out=e)  # [c, V] unnormalized probabilities
        s = e.sum(-1)  # [c]
        log_s = torch.log(s)  # [c]
        stats[r0:r1, 0] = m.squeeze(-1)
        stats[r0:r1, 1] = s
        if not opt.return_entropy:
            continue
        if not on_cpu:
            z.clamp_(min=_LOG_P_FLOOR)  # p (z - m) = 0 where p = 0; NaN stays NaN (no device sync to decide)
        w = torch.mul(e, z, out=e).sum(-1)  # [c] Σ 2^u u
        zero_p = torch.isnan(w)  # [c] a -inf logit gave 0 · -inf (or the row has a NaN: it stays NaN)
        if on_cpu and bool(zero_p.any()):
            zf = z[zero_p].clamp_(min=_LOG_P_FLOOR)  # [k, V] only the rows that need it, recomputed
            w[zero_p] = torch.exp2(zf).mul_(zf).sum(-1)
        entropy[r0:r1] = log_s - w.div_(s).mul_(_LN2)  # H = log s - Σ p (z - max)
    logp = _label_logp(rows, safe, stats[:, 0], stats[:, 1], opt.temperature)  # [N]
    logp, entropy, stats = _finish(logp, entropy, stats, valid, valid & ~in_range)
    shape = labels.shape
    return logp.view(shape), entropy.view(shape), stats.view(*shape, 2)


def _torch_backward(logits, labels, stats, entropy, g_logp, g_entropy, opt: LogprobsOptions):
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
    return _torch_backward_into(dlogits, logits, labels, stats, entropy, g_logp, g_entropy, opt)


def _torch_backward_into(dlogits, logits, labels, stats, entropy, g_logp, g_entropy, opt: LogprobsOptions):
    """Writes ``dlogits`` (contiguous, ``logits``' shape and dtype) and returns it.

    dz = p (a + b log p) per row with a = -(g_logp + g_H H)/T, b = -g_H/T (a = -g_logp/T, b = 0
    without an entropy gradient); the label's entry then replaced by
    [g_logp (1 - p_y) - g_H p_y (log p_y + H)]/T with 1 - p_y = -expm1(log p_y) (its entropy term 0 where p_y = 0).

    With u = (x - m)·log2e/T (the forward's :func:`_base2_exponents`), p = 2^u / s and log p = u ln 2 - log s,
    so dz = 2^u (a' + b' u) with a' = (a - b log s)/s, b' = b ln 2 / s. Per chunk: one fused
    shift and scale to u, exp2, (a clamp and two multiplies: b' (u 2^u)), one multiply-add into dlogits."""
    rows = _as_rows(logits)  # [O, I, V]
    O, I, V = rows.shape
    N = O * I
    cdt = stats.dtype
    dev = logits.device
    on_cpu = dev.type == "cpu"
    if N == 0:
        return dlogits
    d_rows = dlogits.view(N, V)  # [N, V]
    lab = labels.reshape(-1)  # [N]
    valid = lab != opt.ignore_index  # [N]
    safe = torch.where(valid & (lab >= 0) & (lab < V), lab, torch.zeros_like(lab))  # [N]
    zero = torch.zeros((), dtype=cdt, device=dev)
    g_l = torch.where(valid, g_logp.reshape(-1).to(cdt), zero)  # [N]
    g_h = None if g_entropy is None else torch.where(valid, g_entropy.reshape(-1).to(cdt), zero)  # [N]
    if g_h is not None and on_cpu and not bool(g_h.any()):
        g_h = None  # an all-zero entropy gradient (e.g. the entropy was unused): the cheaper formula
    stats, ent = stats.reshape(N, 2), entropy.reshape(-1).to(cdt)  # [N, 2], [N]
    m, s = stats[:, 0:1], stats[:, 1]  # [N, 1] max logit, [N] shifted sum
    log_s = torch.log(s)  # [N]
    if g_h is None:
        a = g_l / (-opt.temperature * s)  # [N] a'
        b = None
    else:
        a = (g_l + g_h * (ent - log_s)) / (-opt.temperature * s)  # [N] a' = (a - b log s)/s
        b = g_h * (_LN2 / -opt.temperature) / s  # [N] b'
    chunk = min(_chunk_rows(V, cdt), max(I, 1))
    z_ws = torch.empty(chunk, V, dtype=cdt, device=dev)  # [chunk, V]
    e_ws = torch.empty(chunk, V, dtype=cdt, device=dev) if dlogits.dtype != cdt and b is not None else None
    for r0, x_in in _row_chunks(rows, chunk):  # x_in: [c, V]
        c = x_in.shape[0]
        r1 = r0 + c
        out = d_rows[r0:r1]  # [c, V]
        z = z_ws[:c]  # [c, V]
        x = x_in if x_in.dtype == cdt else z.copy_(x_in)  # [c, V] as in the forward (a vectorized upcast)
        _base2_exponents(x, m[r0:r1], opt.temperature, z)  # [c, V] u
        if b is None:
            torch.mul(z.exp2_(), a[r0:r1, None], out=out)  # [c, V] -g p / T, cast once into dlogits
            continue
        e = out if e_ws is None else e_ws[:c]  # [c, V] 2^u, in dlogits itself when it has the compute dtype
        torch.exp2(z, out=e)
        z.clamp_(min=_LOG_P_FLOOR)  # p log p = 0 where p = 0 (a -inf logit); NaN stays NaN
        # [c, V] b' u 2^u: u 2^u first, 0 where p = 0, then b' (~g_H/T: b' u could overflow at tiny T, 0·inf = NaN)
        z.mul_(e).mul_(b[r0:r1, None])
        torch.addcmul(z, e, a[r0:r1, None], out=out)  # [c, V] a' 2^u + b' u 2^u, cast once into dlogits
    # the label entries: log p_y bit for bit as the forward formed it (before its clamp to <= 0)
    lp = _label_logp(rows, safe, m.squeeze(-1), s, opt.temperature)  # [N]
    d_y = g_l * -torch.expm1(lp)  # [N] g (1 - p_y), without cancellation when p_y ≈ 1
    if g_h is not None:
        p_y = torch.exp(lp)  # [N]
        # p_y (log p_y + H) is 0 where p_y = 0 (a -inf label logit), never 0 · -inf; NaN stays NaN
        d_y = d_y - g_h * torch.where(p_y == 0, zero, p_y * (lp + ent))
    d_y = d_y / opt.temperature  # [N]
    # the label entries, then the ignored rows (exactly 0, even where their logits are NaN): one indexed write each
    flat = torch.arange(N, device=dev) * V + safe  # [N]
    d_rows.view(-1).index_put_((flat,), torch.where(valid, d_y, zero).to(dlogits.dtype))
    if on_cpu:
        ignored = (~valid).nonzero().squeeze(-1)  # [k]
        if ignored.numel():
            d_rows.index_fill_(0, ignored, 0.0)
    else:
        d_rows.masked_fill_(~valid[:, None], 0.0)
    return dlogits


def _triton_forward(logits, labels, opt: LogprobsOptions):
    """The forward kernel; returns ``(logp, entropy, stats)`` as :func:`_torch_forward` does."""
    rows = _as_rows(logits)  # [O, I, V]
    O, I, V = rows.shape
    N = O * I
    lab = labels.reshape(-1).to(torch.int64).contiguous()  # [N]
    logp = torch.empty(N, dtype=torch.float32, device=logits.device)  # [N]
    entropy = torch.empty_like(logp)  # [N]
    stats = torch.empty(N, 2, dtype=torch.float32, device=logits.device)  # [N, 2] (m, s)
    if N:
        cfg = _launch_config(V)
        _logprobs_fwd_kernel.launch(
            (N,), rows, lab, logp, entropy, stats, rows.stride(0), rows.stride(1), I, V, 1.0 / opt.temperature, opt.ignore_index,
            **_fwd_constexprs(cfg, TRITON_DTYPE_NAMES[logits.dtype]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if not opt.return_entropy:
        entropy.zero_()  # as the torch backend: the op's outputs do not depend on the backend
    shape = labels.shape
    return logp.view(shape), entropy.view(shape), stats.view(*shape, 2)


def _triton_backward(logits, labels, stats, entropy, g_logp, g_entropy, opt: LogprobsOptions):
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]
    return _triton_backward_into(dlogits, logits, labels, stats, entropy, g_logp, g_entropy, opt)


def _triton_backward_into(dlogits, logits, labels, stats, entropy, g_logp, g_entropy, opt: LogprobsOptions):
    """The backward kernel writing ``dlogits`` (contiguous, ``logits``' shape and dtype); returns it."""
    rows = _as_rows(logits)  # [O, I, V]
    O, I, V = rows.shape
    N = O * I
    if N:
        lab = labels.reshape(-1).to(torch.int64).contiguous()  # [N]
        flat = lambda t: t.reshape(-1).to(torch.float32).contiguous()  # noqa: E731  [N]
        g_entropy = torch.zeros_like(g_logp) if g_entropy is None else g_entropy  # [...]
        cfg = _launch_config(V)
        _logprobs_bwd_kernel.launch(
            (N,), rows, lab, stats.reshape(N, 2).to(torch.float32).contiguous(), flat(entropy), flat(g_logp),
            flat(g_entropy), dlogits, rows.stride(0), rows.stride(1), I, V, 1.0 / opt.temperature, opt.ignore_index,
            BLOCK_V=cfg.block_v, INTERPRETED=logits.device.type == "cpu", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return dlogits


# ---------------------------------------------------------------- torch.library ops and their autograd.Functions

# Each op's backends: the implementation serving a call is chosen at run time, inside the op, by
# _backend.resolve over the table's keys (so torch.compile traces none of it; RLKERNELS_BACKEND is read at
# every call). Every row returns the same statistics (stats: max logit, shifted sum), so the backward may be
# served by another row than the forward. float64 logits never reach Triton (resolve keeps them on torch).
_FWD_IMPLS = {"torch": _torch_forward, "triton": _triton_forward}
_BWD_IMPLS = {"torch": _torch_backward, "triton": _triton_backward}


@custom_op("rlkernels::logprobs_fwd",
           schema=op_schema("Tensor logits, Tensor labels", LogprobsOptions, "(Tensor, Tensor, Tensor)"))
def _logprobs_fwd_op(logits, labels, *options):
    """``logits`` [..., V], int64 ``labels`` [...], then ``*option_values(LogprobsOptions)``. Returns ``(logp, entropy,
    stats)``: ``logp``, ``entropy`` [...] and ``stats`` [..., 2], each row's max logit and shifted sum
    ``Σ e^((x - max)/T)`` ((0, 1) on ignored rows, NaN for a label out of range), the same layout and values
    (to float32 rounding) for every backend; the backward needs only ``stats`` and ``entropy``. Without
    ``return_entropy`` the entropy is zeros and the backward ignores an entropy gradient. On the CPU a label
    out of ``[0, V)`` raises here (inside the op, so also when compiled)."""
    opt = options_from(LogprobsOptions, options)
    _checks.labels(labels, logits.shape[-1], opt.ignore_index)
    return _backend.implementation(_FWD_IMPLS, logits)(logits, labels, opt)


@_logprobs_fwd_op.register_fake
def _(logits, labels, *options):
    dtype = _out_dtype(logits)
    return (
        logits.new_empty(labels.shape, dtype=dtype),  # [...] logp
        logits.new_empty(labels.shape, dtype=dtype),  # [...] entropy
        logits.new_empty((*labels.shape, 2), dtype=dtype),  # [..., 2] stats
    )


_BWD_TENSORS = "Tensor logits, Tensor labels, Tensor stats, Tensor entropy, Tensor g_logp, Tensor? g_entropy"


@custom_op("rlkernels::logprobs_bwd", schema=op_schema(_BWD_TENSORS, LogprobsOptions, "Tensor"))
def _logprobs_bwd_op(logits, labels, stats, entropy, g_logp, g_entropy, *options):
    """``logits`` [..., V], ``labels`` [...] int64, ``stats`` [..., 2] and ``entropy`` [...] from the forward,
    upstream ``g_logp`` [...] and ``g_entropy`` [...] (None: no entropy gradient), then
    ``*option_values(LogprobsOptions)``. Returns ``dlogits`` [..., V] (contiguous, the dtype of ``logits``)."""
    opt = options_from(LogprobsOptions, options)
    if not opt.return_entropy:
        g_entropy = None  # the entropy output was zeros, not a function of the logits
    return _backend.implementation(_BWD_IMPLS, logits)(logits, labels, stats, entropy, g_logp, g_entropy, opt)


@_logprobs_bwd_op.register_fake
def _(logits, labels, stats, entropy, g_logp, g_entropy, *options):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [..., V]


def _setup_context(ctx, inputs, output):
    logits, labels, *options = inputs
    _logp, entropy, stats = output
    ctx.save_for_backward(logits, labels, stats, entropy)
    ctx.options = options  # the op's option lists, handed on to the backward's op


def _backward(ctx, g_logp, g_entropy, _g_stats):
    refuse_double_backward("logprobs")
    logits, labels, stats, entropy = ctx.saved_tensors  # [..., V], [...], [..., 2], [...]
    g_logp = torch.zeros_like(entropy) if g_logp is None else g_logp  # [...]
    with _backend.float32_compute(logits.device):
        dlogits = call(_logprobs_bwd_op, logits, labels, stats, entropy, g_logp, g_entropy, *ctx.options)
    return (dlogits,)


_Logprobs = autograd_function("_Logprobs", _logprobs_fwd_op, _setup_context, _backward)


# ---------------------------------------------------------------- public function

# The reference backend (RLKERNELS_BACKEND=reference) is served in ONE place, here, before the op's
# autograd.Function: its gradient is autograd's through rlkernels.reference's eager formulas, and autograd records
# nothing inside an op (its body runs with autograd off, as a custom op's implementation runs below the Autograd
# key), so it cannot be a row of the op's tables.
# (rlkernels.losses serves its reference backend the same way.)
def _reference_logprobs(logits, labels, opt: LogprobsOptions):
    """:func:`rlkernels.reference.logprobs` with the op's label check (on the CPU, when not compiled: compiled,
    a bad label gives NaN there, as on a GPU)."""
    if not _checks._tracing():
        _checks.labels(labels, logits.shape[-1], opt.ignore_index)
    return reference.logprobs(logits, labels, temperature=opt.temperature, return_entropy=opt.return_entropy,
                              ignore_index=opt.ignore_index)


def logprobs(
    logits: torch.Tensor,  # [..., V]
    labels: torch.Tensor,  # [...]
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """Log-probability of each label under ``softmax(logits / temperature)``, and optionally its entropy.

    Computes ``log_softmax(logits.float() / temperature).gather(-1, labels)`` without
    materializing the log-softmax: on CUDA a Triton kernel reads each row once
    forward and once backward; on the CPU a chunked PyTorch path keeps its float32
    workspace to a few MiB. Only O(N) values are saved for the backward.

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16 (float64 computes in
            float64, returned in float32). Any leading shape; rows may be strided (``logits[:, :-1]``
            costs no copy); a last dim with stride != 1 is copied first.
        labels: ``[...]`` integer token ids in ``[0, V)``, or ``ignore_index``; any integer dtype.
        temperature: divides the logits before the softmax; must be > 0.
        return_entropy: also return ``H = -Σ_j p_j log p_j`` of the same softmax.
        ignore_index: label value whose positions give 0 in both outputs and no gradient.

    Returns:
        ``logp`` ``[...]`` float32 (also for float64 logits), or ``(logp, entropy)``
        with ``return_entropy=True``. Both are differentiable in ``logits``; the
        gradient has the dtype of ``logits``.

    Raises:
        TypeError: ``logits`` is not a floating tensor, ``labels`` not an integer tensor.
        ValueError: ``logits`` is 0-d or has V = 0, ``labels`` does not have shape
            ``logits.shape[:-1]``, the tensors are on different devices,
            ``temperature <= 0``, or (CPU only) a label is out of ``[0, V)``.
            On a GPU an out-of-range label gives NaN for that token instead (no
            device sync, never an out-of-bounds read).

    Backend: ``RLKERNELS_BACKEND=triton|torch|reference`` forces one; by default
    Triton on CUDA, chunked PyTorch on the CPU. NaN in ``logits`` propagates (to that
    row only); ignored positions give 0 and zero gradient whatever their logits hold;
    ``log p <= 0`` and ``H >= 0`` always. Computes in float32 under any ``torch.autocast``.
    """
    opt = _validate(logits=logits, labels=labels, temperature=temperature, return_entropy=return_entropy,
                    ignore_index=ignore_index)
    with _backend.float32_compute(logits.device):
        if _backend.serves_reference(_FWD_IMPLS, logits):
            return float32_outputs(_reference_logprobs(logits, labels, opt))
        # int64 labels whatever their dtype (the op checks their range on the CPU, also when compiled)
        logp, entropy, _ = _Logprobs.apply(logits, labels.long(), *option_values(opt))  # [...] x2, [..., 2]
    return float32_outputs((logp, entropy) if opt.return_entropy else logp)
