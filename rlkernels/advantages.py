"""Advantage estimation: GAE by a parallel reverse scan, group-relative advantages and masked whitening.

Every op has four implementations, one entry each in its ``_*_IMPLS`` table:

- ``reference``: :mod:`rlkernels.reference` (a Python loop over tokens / groups);
- ``torch``: vectorized PyTorch (GAE in chunks of ``_TORCH_CHUNK`` tokens: one loop of
  ``_TORCH_CHUNK`` steps runs the recursion inside every chunk at once, a short carry
  across chunks);
- ``triton``: Triton kernels (interpreted on CPU tensors); groups of one size up to 4096,
  contiguous or given by an index (sorted into equal runs once on the host), take
  ``_group_tile_kernel`` (many groups per program, one register-resident pass); index-given
  groups of unequal sizes and larger groups ``_group_kernel`` (one program per group, three passes);
- ``csrc``: the compiled extension (``csrc/``), C++ on CPU, CUDA on GPUs.

Which one serves a call is chosen by :func:`rlkernels._backend.resolve` alone, at run
time inside each custom op (so ``torch.compile`` never traces the extension's first
build): ``RLKERNELS_BACKEND`` when it can run here, else csrc when the extension loads (on
CUDA when it has its CUDA kernels: measured faster than Triton for gae, group_advantages and
masked_whiten on an H100 and an H200; process_advantages has no csrc kernel and takes Triton there),
Triton on CUDA without them, torch otherwise. The Triton kernels load 16/32-bit
floats, so float64 inputs are served by csrc or torch. No op here has a gradient, so
``reference`` is an ordinary entry of each table (nothing to derive a backward from).

Options cross each ``torch.library`` boundary as the op's own typed scalar arguments,
under the names of the public keywords (``gamma``, ``lam``, ``group_size``, ``mode``,
``eps``, ``shift_mean``), and reach every implementation and kernel as those names. No
options dataclass: an op has at most three scalars, the implementations take them
positionally (as the benchmarks call them), and a dataclass would only be unpacked
again at both ends.

GAE as a scan. Walking backwards, the state is ``(A, V)``: the advantage and
the value of the next valid token. A valid token t maps it to
``(r_t - v_t + γ·V + γλ·A, v_t)``; a masked token is the identity (it is
transparent). Both are affine maps ``A' = αA + βV + c, V' = ζV + e``, closed
under composition, so the advantages are an associative scan of 5-tuples
``(α, β, c, ζ, e)`` applied to the state ``(0, 0)`` past the end (the Triton kernel).
The CUDA kernel (``csrc/gae_kernel.h``) splits it in two cheaper steps: each valid
token's V (the next valid token's value) by a warp ballot and one shuffle, which
gives its TD error ``δ_t``; then ``A_t = δ_t + γλ·A_next`` as a scan of 2-tuples.

:func:`masked_whiten` also has a process-group variant (``process_group=``): the
statistics of every rank's masked entries, all-reduced in float64.

The outputs are constants: no op here has a gradient. Inputs that require grad
are detached. All ops return float32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlkernels import _backend as backends
from rlkernels import _checks, _extension, _host, reference
from rlkernels._device import block_max, block_sum
from rlkernels._triton import HAS_TRITON, cdiv, jit, tl
from rlkernels.reference import GROUP_MODES

_SUPPORTED = ("reference", "torch", "triton", "csrc")  # the backends every op of this module implements


def _constexpr(value: int):
    """A module constant a ``@jit`` function may read (Triton accepts only ``tl.constexpr`` globals)."""
    return tl.constexpr(value) if HAS_TRITON else value


# _group_kernel's MODE: the position of the mode in reference.GROUP_MODES (the csrc kernels number them alike)
GRPO = _constexpr(GROUP_MODES.index("grpo"))
DR_GRPO = _constexpr(GROUP_MODES.index("dr_grpo"))
RLOO = _constexpr(GROUP_MODES.index("rloo"))

# ---------------------------------------------------------------- Triton kernels
# Reductions go through rlkernels._device (block_sum/block_max; why not tl.sum is said there).


@jit
def _compose(a1, b1, c1, z1, e1, a2, b2, c2, z2, e2):
    # (a1..e1) is applied first (the later tokens), then (a2..e2):
    # A'' = a2(a1 A + b1 V + c1) + b2(z1 V + e1) + c2,  V'' = z2(z1 V + e1) + e2
    return a2 * a1, a2 * b1 + b2 * z1, a2 * c1 + b2 * e1 + c2, z2 * z1, z2 * e1 + e2


@jit
def _xor(a, b):
    return a ^ b


@jit
def _flip_vec(x, BLOCK_B: tl.constexpr, NCH: tl.constexpr):
    """``x`` ``[BLOCK_B, NCH, 16]`` (float32 or 8-bit) with its last axis reversed (``tl.flip``'s xor swaps,
    written out: a kernel interpreted per call cannot call Triton's library ``@jit`` functions). The axis lies in
    one thread, so the compiled swaps are register renames (no instruction)."""
    bits = x.to(tl.int32, bitcast=True) if x.dtype.primitive_bitwidth == 32 else x.to(tl.int8, bitcast=True)
    y = tl.reshape(bits, [BLOCK_B, NCH, 2, 2, 2, 2])
    y = y ^ tl.reduce(y, 2, _xor, keep_dims=True)
    y = y ^ tl.reduce(y, 3, _xor, keep_dims=True)
    y = y ^ tl.reduce(y, 4, _xor, keep_dims=True)
    y = y ^ tl.reduce(y, 5, _xor, keep_dims=True)
    return tl.reshape(y, [BLOCK_B, NCH, 16]).to(x.dtype, bitcast=True)


@jit
def _gae_kernel(
    r_ptr, v_ptr, m_ptr,  # [B, T] inputs (strided), m: uint8
    adv_ptr, ret_ptr,  # [B, T] float32 outputs (contiguous)
    B, T,
    stride_rb, stride_rt, stride_vb, stride_vt, stride_mb, stride_mt,
    gamma, lam,
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr,
):
    # Each thread owns a chunk of VEC consecutive tokens, read time ascending (vector loads), flipped in
    # registers. Scan order: chunk 0 is the last chunk of the block, and inside a chunk the last token comes
    # first, so forward scans walk backwards in time (no reverse=True: triton issue #4362).
    # 1. in-thread scan of each chunk's token maps; its last element is the chunk's whole map;
    # 2. a scan over the chunks of [identity, chunk map] pairs: the even entries are the exclusive prefixes, the
    #    maps of every later token of the block; applied to the carry they give each chunk's incoming state;
    # 3. each token's A from its in-chunk prefix and the chunk's incoming state.
    tl.static_assert(VEC == 16, "_flip_vec is written for 16 tokens per thread")
    NCH: tl.constexpr = BLOCK_T // VEC
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    row_ok = (rows < B)[:, None, None]  # [BLOCK_B, 1, 1]
    rows64 = rows.to(tl.int64)[:, None, None]  # [BLOCK_B, 1, 1]
    r_row = r_ptr + rows64 * stride_rb  # [BLOCK_B, 1, 1] row starts
    v_row = v_ptr + rows64 * stride_vb
    m_row = m_ptr + rows64 * stride_mb
    adv_row = adv_ptr + rows64 * T
    ret_row = ret_ptr + rows64 * T
    ch = tl.arange(0, NCH)  # [NCH] chunks in scan order
    rel = (((NCH - 1 - ch) * VEC)[:, None] + tl.arange(0, VEC)[None, :])[None, :, :]  # [1, NCH, VEC] ascending
    # float32 scalars (a no-op compiled, where they are float32 arguments): the interpreter passes Python floats,
    # and a product below float32's normal range (1e-30 * 1e-30) would become a float64 constant there
    gamma = tl.full([], gamma, tl.float32)
    lam = tl.full([], lam, tl.float32)
    gl = gamma * lam
    last_tok = (tl.arange(0, VEC) == VEC - 1)[None, None, :]  # [1, 1, VEC]: a chunk's last token in scan order
    one = tl.full([BLOCK_B, NCH], 1.0, tl.float32)
    zero = tl.full([BLOCK_B, NCH], 0.0, tl.float32)
    carry_a = tl.full([BLOCK_B], 0.0, tl.float32)  # A of the next valid token (0 past the end)
    carry_v = tl.full([BLOCK_B], 0.0, tl.float32)  # V of the next valid token (0 past the end)
    nb = (T + BLOCK_T - 1) // BLOCK_T
    for i in range(0, nb):
        t = (nb - 1 - i) * BLOCK_T + rel  # [1, NCH, VEC] int32 tokens (T < 2**31)
        inb = row_ok & (t < T)  # [BLOCK_B, NCH, VEC]
        r = tl.load(r_row + t * stride_rt, mask=inb, other=0.0).to(tl.float32)  # [BLOCK_B, NCH, VEC]
        v = tl.load(v_row + t * stride_vt, mask=inb, other=0.0).to(tl.float32)
        m = tl.load(m_row + t * stride_mt, mask=inb, other=0)  # out of range: 0, not valid
        fv = _flip_vec(v, BLOCK_B, NCH)  # [BLOCK_B, NCH, VEC] in scan order
        fd = _flip_vec(r, BLOCK_B, NCH) - fv
        valid = _flip_vec(m, BLOCK_B, NCH) != 0
        # a token's map: valid (γλ, γ, r - v, 0, v), masked or out of range the identity (1, 0, 0, 1, 0)
        al = tl.where(valid, gl, 1.0)
        be = tl.where(valid, gamma, 0.0)
        c = tl.where(valid, fd, 0.0)
        ze = tl.where(valid, 0.0, 1.0)
        e = tl.where(valid, fv, 0.0)
        al, be, c, ze, e = tl.associative_scan((al, be, c, ze, e), 2, _compose)  # in-chunk prefixes
        # each chunk's whole map: its scan's last element, picked by a masked sum (exact: one nonzero term).
        # Not tl.reduce with a keep-the-last combine: compiled reductions swap operands between lanes (they
        # assume a commutative combine), which on an H100 gave GAE errors of 2-75 % (the interpreter keeps order)
        sa = block_sum(tl.where(last_tok, al, 0.0), 2)  # [BLOCK_B, NCH] chunk maps
        sb = block_sum(tl.where(last_tok, be, 0.0), 2)
        sc = block_sum(tl.where(last_tok, c, 0.0), 2)
        sz = block_sum(tl.where(last_tok, ze, 0.0), 2)
        se = block_sum(tl.where(last_tok, e, 0.0), 2)
        pa = _exclusive_pairs(one, sa, BLOCK_B, NCH)  # [BLOCK_B, 2 NCH]
        pb = _exclusive_pairs(zero, sb, BLOCK_B, NCH)
        pc = _exclusive_pairs(zero, sc, BLOCK_B, NCH)
        pz = _exclusive_pairs(one, sz, BLOCK_B, NCH)
        pe = _exclusive_pairs(zero, se, BLOCK_B, NCH)
        pa, pb, pc, pz, pe = tl.associative_scan((pa, pb, pc, pz, pe), 1, _compose)  # [BLOCK_B, 2 NCH]
        ea, sa = _split_pairs(pa, BLOCK_B, NCH)  # [BLOCK_B, NCH]: later chunks of the block, and those and this
        eb, sb = _split_pairs(pb, BLOCK_B, NCH)
        ec, sc = _split_pairs(pc, BLOCK_B, NCH)
        ez, sz = _split_pairs(pz, BLOCK_B, NCH)
        ee, se = _split_pairs(pe, BLOCK_B, NCH)
        a_in = ea * carry_a[:, None] + eb * carry_v[:, None] + ec  # [BLOCK_B, NCH]: state entering each chunk
        v_in = ez * carry_v[:, None] + ee
        a_tok = al * a_in[:, :, None] + be * v_in[:, :, None] + c  # [BLOCK_B, NCH, VEC]
        adv = _flip_vec(tl.where(valid, a_tok, 0.0), BLOCK_B, NCH)  # [BLOCK_B, NCH, VEC] time ascending
        tl.store(adv_row + t, adv, mask=inb)
        tl.store(ret_row + t, adv + v, mask=inb)
        # the block's first chunk (the last in scan order) composes the whole block: the next block's carry
        last = (ch == NCH - 1)[None, :]  # [1, NCH]
        a_out = tl.where(last, sa * carry_a[:, None] + sb * carry_v[:, None] + sc, 0.0)  # [BLOCK_B, NCH]
        v_out = tl.where(last, sz * carry_v[:, None] + se, 0.0)
        carry_a, carry_v = tl.split(block_sum(tl.join(a_out, v_out), 1))  # [BLOCK_B] x2


@jit
def _exclusive_pairs(first, second, BLOCK_B: tl.constexpr, NCH: tl.constexpr):
    """``[BLOCK_B, NCH]`` x2 -> ``[BLOCK_B, 2 NCH]`` interleaved ``(first, second)`` per chunk: with ``first`` the
    identity, entry ``2k`` of an inclusive scan is the exclusive prefix of chunk ``k``."""
    return tl.reshape(tl.join(first, second), [BLOCK_B, 2 * NCH])


@jit
def _split_pairs(x, BLOCK_B: tl.constexpr, NCH: tl.constexpr):
    """Inverse of :func:`_exclusive_pairs`: ``(x[:, 0::2], x[:, 1::2])``."""
    return tl.split(tl.reshape(x, [BLOCK_B, NCH, 2]))


@jit
def _group_block(s_ptr, run_ptr, i, count, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    """The group members ``[i, i + BLOCK)`` of a run of ``count``: where each lives relative to ``s_ptr``
    (``[BLOCK]``: read through ``run_ptr``, the group's slice of ``perm``, with ``HAS_INDEX``), which are inside
    the group, and their scores."""
    j = i + tl.arange(0, BLOCK)  # [BLOCK]
    ok = j < count
    src = tl.load(run_ptr + j, mask=ok, other=0).to(tl.int32) if HAS_INDEX else j  # [BLOCK]
    x = tl.load(s_ptr + src, mask=ok, other=0.0)  # [BLOCK]
    return src, ok, x


@jit
def _pow2(biased_exponent):
    """``2 ** (biased_exponent - 127)`` as float32 (``biased_exponent`` in ``[1, 254]``), from its bits."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@jit
def _group_scales(amax):
    """Power-of-two factors ``(down, up)``, ``down * up == 1``, for a group whose largest ``|score|`` is ``amax``:
    beyond 2**32, ``down`` brings it into ``[2, 4)``, so the group's sum and its sum of squared deviations stay far
    from float32's 3.4e38 (scores of 1e20 squared overflow) while every score keeps its bits but the exponent;
    below 2**-32 it brings it up into ``[2, 4)`` (``[1, 2)`` from float32's smallest normals; denormals below), so
    squared deviations do not flush to 0 (grpo with ``eps=0`` of scores of 1e-25 gave ±inf); otherwise (and for
    inf/NaN, or all zeros) ``(1, 1)``. The statistics are then formed on ``score * down``: exact scaling (a
    deviation of ``amax * 2**-24``, float32's resolution, is still ``2**-23`` there: squares stay normal)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of amax >= 0 (255: inf or NaN)
    big = (e >= 127 + 32) & (e < 255)
    small = (e < 127 - 32) & (amax > 0.0)
    # 2**(128 - e) and 2**(e - 128): 1 where neither; at most 2**126 up (its inverse 2**-126 is still normal)
    e = tl.where(big, e, tl.where(small, tl.maximum(e, 2), 128))
    return _pow2(255 - e), _pow2(e - 1)


@jit
def _mean_error(dev_sum, n):
    """The rounding error of a group's float32 mean, ``Σ(s - mean)/n`` from the sum of its deviations; 0 where that
    is not finite (a group with ±inf, whose outputs stay those of ``s - mean``; a NaN group is NaN anyway)."""
    err = dev_sum / n
    return tl.where(tl.abs(err) < float("inf"), err, 0.0)


@jit
def _group_kernel(
    s_ptr, out_ptr,  # [N] float32
    perm_ptr, starts_ptr,  # [N], [G + 1] int64 (read only with HAS_INDEX)
    group_size, eps,
    MODE: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr,
):
    # The group is a base pointer and a count (its slice of perm with HAS_INDEX, else its slice of s and out):
    # loops from lo to hi kept both bounds and the loop guard alive across the three passes, and ptxas (the one
    # triton 3.6 ships, and 3.9's on 3.6's PTX) spilled 8 bytes of them at its 32-register choice.
    g = tl.program_id(0)
    if HAS_INDEX:  # int32 positions (the launcher checks N < 2**31)
        lo = tl.load(starts_ptr + g)
        count = (tl.load(starts_ptr + g + 1) - lo).to(tl.int32)
        run_ptr = perm_ptr + lo
        first = tl.load(s_ptr + tl.load(run_ptr))
        s_run = s_ptr
        out_run = out_ptr
    else:
        lo = g.to(tl.int64) * group_size
        count = group_size
        run_ptr = perm_ptr  # not read
        s_run = s_ptr + lo
        out_run = out_ptr + lo
        first = tl.load(s_run)
    n = count.to(tl.float32)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    amax = tl.full([BLOCK], 0.0, tl.float32)
    differ = tl.full([BLOCK], 0, tl.int32)
    for i in range(0, count, BLOCK):  # pass 1: sum, largest |s|, and whether every member equals the first
        src, ok, x = _group_block(s_run, run_ptr, i, count, HAS_INDEX, BLOCK)
        acc += x
        amax = tl.maximum(amax, tl.abs(x))
        differ += tl.where(ok & (x != first), 1, 0)  # NaN != NaN: a group with NaN is never constant
    down, up = _group_scales(block_max(amax, 0))
    mean = block_sum(acc, 0) / n  # the mean of s·down: for a scaled group, summed again below
    if down != 1.0:  # scores past 2**32 (the sum above may have overflowed): pass 1b, the sum of s·down
        acc = tl.full([BLOCK], 0.0, tl.float32)
        for i in range(0, count, BLOCK):
            src, ok, x = _group_block(s_run, run_ptr, i, count, HAS_INDEX, BLOCK)
            acc += x * down
        mean = block_sum(acc, 0) / n
    constant = (block_sum(differ, 0) == 0) | (n < 2.0)
    ssq = tl.full([BLOCK], 0.0, tl.float32)
    dev = tl.full([BLOCK], 0.0, tl.float32)
    for i in range(0, count, BLOCK):  # pass 2: Σ(s·down - mean)² (exact where Σs² - n·mean² is not), Σ(s·down - mean)
        src, ok, x = _group_block(s_run, run_ptr, i, count, HAS_INDEX, BLOCK)
        d = tl.where(ok, x * down - mean, 0.0)
        ssq += d * d
        dev += d
    # corrected two-pass: a float32 mean of scores far from 0 is off by up to half their ulp, all of the spread of
    # 1e4 + 1e-3 noise; Σ(s·down - mean)/n is that error (the tile kernel, with its group in registers, pivots)
    dev_sum = block_sum(dev, 0)
    err = _mean_error(dev_sum, n)
    ssq = block_sum(ssq, 0) - err * dev_sum  # Σ(s·down - mean - err)²
    ssq = tl.where(ssq < 0.0, 0.0, ssq)  # rounding below 0 clamped; NaN (a group with inf or NaN) kept
    if MODE == GRPO:  # (s - mean)/(std + eps) = (s·down - mean·down)/(std·down + eps·down)
        scale = 1.0 / (tl.sqrt(ssq / tl.maximum(n - 1.0, 1.0)) + eps * down)
    elif MODE == DR_GRPO:
        scale = up
    else:  # RLOO
        scale = n / tl.maximum(n - 1.0, 1.0) * up  # s - (Σs - s)/(n-1) = n/(n-1)·(s - mean)
    for i in range(0, count, BLOCK):  # pass 3: write
        src, ok, x = _group_block(s_run, run_ptr, i, count, HAS_INDEX, BLOCK)
        y = tl.where(constant, 0.0, (x * down - mean - err) * scale)
        tl.store(out_run + src, y, mask=ok)


@jit
def _group_tile_kernel(
    s_ptr, out_ptr,  # [N] float32, N = G * group_size
    perm_ptr,  # [N] int32 (read with HAS_INDEX): group g holds s[perm[g·group_size : (g + 1)·group_size]]
    G, group_size, eps,
    MODE,  # the position of the mode in GROUP_MODES (a run-time value: one compiled kernel serves every mode)
    HAS_INDEX: tl.constexpr,  # groups given by an index (sorted into equal runs of perm), else contiguous
    GS: tl.constexpr,  # a power of two >= group_size: the columns of the tile
    GROUPS: tl.constexpr,  # groups per program: the rows of the tile
):
    """Groups of one size, ``GROUPS`` of them per program in one ``[GROUPS, GS]`` tile held in registers: one
    read (gathered through ``perm`` for index-given groups), each group's mean and Σ(s - mean)² from the
    registers (two passes over registers, none over memory), one write (scattered back through ``perm``)."""
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    j = tl.arange(0, GS)  # [GS]
    ok = (g < G)[:, None] & (j < group_size)[None, :]  # [GROUPS, GS]
    idx = g[:, None] * group_size + j[None, :]  # [GROUPS, GS] (the launcher checks N < 2**31)
    if HAS_INDEX:
        idx = tl.load(perm_ptr + idx, mask=ok, other=0)  # [GROUPS, GS]
    n = tl.full([], 1.0, tl.float32) * group_size  # a float32 scalar (not .to(): Triton passes a group_size of 1 as a constant)
    x = tl.load(s_ptr + idx, mask=ok, other=0.0)  # [GROUPS, GS]
    # every member equal: max == min over the group, and no NaN (which makes the mean NaN and is never constant)
    top = block_max(tl.where(ok, x, float("-inf")), 1)  # [GROUPS]
    bottom = -block_max(tl.where(ok, -x, float("-inf")), 1)  # [GROUPS]
    down, _ = _group_scales(tl.maximum(top, -bottom))  # [GROUPS]: 1 unless |s| is beyond 2**±32
    same = top == bottom  # [GROUPS]
    # relative to a pivot, the group's largest score (0 where that is ±inf: a group with inf keeps s - mean's
    # infinities): a float32 mean of scores far from 0 is off by up to half their ulp, which is all of the spread of
    # 1e4 + 1e-3 noise; the mean of s - pivot is exact to float32 rounding of the spread, and so is each deviation
    pivot = tl.where(tl.abs(top) < float("inf"), top, 0.0) * down  # [GROUPS]
    x = tl.where(ok, x * down[:, None] - pivot[:, None], 0.0)  # [GROUPS, GS]: the statistics of s·down - pivot
    mean = block_sum(x, 1) / n  # [GROUPS]
    one_member = (n < 2.0).to(tl.int32)  # (a scalar; or-ed through int32: the interpreter cannot or a scalar bool)
    constant = ((same & (mean == mean)).to(tl.int32) + one_member) > 0  # [GROUPS]
    d = tl.where(ok, x - mean[:, None], 0.0)  # [GROUPS, GS]
    ssq = block_sum(d * d, 1)  # [GROUPS]: Σ(s - mean)², exact where Σs² - n·mean² is not
    # (s - mean)/(std + eps) = (s·down - mean·down)/(std·down + eps·down)
    grpo = 1.0 / (tl.sqrt(ssq / tl.maximum(n - 1.0, 1.0)) + eps * down)  # [GROUPS]
    up = 1.0 / down  # [GROUPS]: exact (a power of two), formed here rather than held across the tile (registers)
    rloo = n / tl.maximum(n - 1.0, 1.0) * up  # s - (Σs - s)/(n-1) = n/(n-1)·(s - mean)
    scale = tl.where(MODE == GRPO, grpo, tl.where(MODE == DR_GRPO, up, rloo))  # [GROUPS]
    y = tl.where(constant[:, None], 0.0, d * scale[:, None])  # [GROUPS, GS]
    tl.store(out_ptr + idx, y, mask=ok)


@jit
def _sum2(a, b):
    """``(block_sum(a, 0), block_sum(b, 0))`` of two 1-D blocks in ONE reduction: the pair travels
    joined (``[BLOCK, 2]``), so the shuffles and barriers are paid once (two reductions of 8 warps cost
    two more barriers per block in the whitening loop). Belongs in ``rlkernels._device`` beside
    ``block_sum``; it is used only here so far."""
    return tl.split(block_sum(tl.join(a, b), 0))


@jit
def _first_set(flags, SIZE: tl.constexpr):
    """The position of the first set entry of ``flags`` ``[SIZE]``, ``SIZE`` when none is set."""
    return SIZE - block_max(tl.where(flags, SIZE - tl.arange(0, SIZE), 0), 0)


@jit
def _chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Chan et al.'s merge of two shares' (count, mean, M2) into the union's; a share may be empty (count 0).
    Elementwise, and a ``tl.reduce`` combine function."""
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / tl.maximum(n, 1.0)
    return n, mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac


@jit
def _chan_pivoted(n_a, k_a, mean_a, m2_a, n_b, k_b, mean_b, m2_b):
    """:func:`_chan` of two shares whose means are relative to their own pivots ``k``: the union keeps the
    first non-empty share's pivot (``k_b - k_a`` is a difference of two values near the data: exact or nearly
    so). A ``tl.reduce`` combine function over ``(count, pivot, mean - pivot, M2)``."""
    k = tl.where(n_a > 0, k_a, k_b)
    mean_b = tl.where(n_b > 0, (k_b - k) + mean_b, 0.0)
    n, mean, m2 = _chan(n_a, tl.where(n_a > 0, mean_a, 0.0), m2_a, n_b, mean_b, m2_b)
    return n, k, mean, m2


# 2**-100: the rescue's scale (see _whiten_merge_kernel); 2**100 undoes it
_RESCUE_DOWN = _constexpr(7.888609052210118e-31)
_RESCUE_UP = _constexpr(1.2676506002282294e30)


@jit
def _share_moments(x_ptr, m_ptr, N, first, step, RESCUED: tl.constexpr, ROWS: tl.constexpr, THREADS: tl.constexpr,
                   VEC: tl.constexpr):
    """(count, pivot K, mean of (x - K), M2) of the masked entries of the tiles of ``ROWS·THREADS·VEC``
    contiguous elements starting at ``first``, ``first + step``, ... below ``N``, read as ``[ROWS, THREADS,
    VEC]``: each thread's ``ROWS·VEC`` elements of a tile give their count, mean and centred M2 from its
    registers, merged (Chan) into the thread's running statistics; the threads merge once, at the end
    (``tl.reduce`` with :func:`_chan_pivoted`): no block-wide reduction per tile, no division per element.
    ``RESCUED``: the statistics of ``x·2**-100``.

    Shifted data: a float32 mean of values near 1e6 is only known to ~0.03, so deviations around it (and
    merges of such means) would carry that error into M2 and the output. Each thread keeps its statistics
    relative to a pivot K near its data: the float32 mean of the first tile where it has a masked-in value
    (before that K = 0). Then x - K is exact (Sterbenz) for data near K, the mean is K + mean(x - K) with no
    rounding of K + ..., and a shift of all data only shifts K. A tile's M2 is centred on the tile's own mean
    (corrected two-pass: Σd² - (Σd)²/c), never Σy² - (Σy)²/n, so a pivot far from the data costs no
    cancellation either."""
    TILE: tl.constexpr = ROWS * THREADS * VEC
    # offsets [ROWS, THREADS·VEC], each row contiguous, and the loads reshaped to [ROWS, THREADS, VEC]: a 3-D
    # offset tensor shows Triton only VEC-long contiguity (Triton 3.6 then costs 14.0-15.1 SASS per element on
    # sm_90 instead of 12.1-13.2; 3.9 is unchanged at 12.5-13.7)
    offs = tl.arange(0, ROWS)[:, None] * (THREADS * VEC) + tl.arange(0, THREADS * VEC)[None, :]  # [ROWS, THREADS·VEC]
    cnt = tl.full([THREADS], 0.0, tl.float32)  # [THREADS] per thread: count, pivot K, mean of (x - K), M2
    piv = tl.full([THREADS], 0.0, tl.float32)
    mean = tl.full([THREADS], 0.0, tl.float32)
    m2 = tl.full([THREADS], 0.0, tl.float32)
    for start in range(first, N, step):
        i = start + offs  # [ROWS, THREADS·VEC]
        ok = i < N
        x = tl.reshape(tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32), [ROWS, THREADS, VEC])  # [ROWS, THREADS, VEC]
        if RESCUED:
            x = x * _RESCUE_DOWN
        keep = tl.reshape(tl.load(m_ptr + i, mask=ok, other=0) != 0, [ROWS, THREADS, VEC])  # [ROWS, THREADS, VEC]
        w = tl.where(keep, 1.0, 0.0)  # [ROWS, THREADS, VEC]
        y = tl.where(keep, x - piv[None, :, None], 0.0)  # where, not a product: masked-out NaN/inf stay out
        c_t = block_sum(block_sum(w, 2), 0)  # [THREADS]: in-thread sums
        inv_c = 1.0 / tl.maximum(c_t, 1.0)  # [THREADS]
        mean_t = block_sum(block_sum(y, 2), 0) * inv_c  # [THREADS]
        d = y - mean_t[None, :, None] * w  # [ROWS, THREADS, VEC]: 0 where masked out
        s_d = block_sum(block_sum(d, 2), 0)  # [THREADS]: what the rounding of mean_t left
        m2_t = block_sum(block_sum(d * d, 2), 0) - s_d * s_d * inv_c  # [THREADS]
        new_piv = (cnt == 0.0) & (c_t > 0.0)  # [THREADS]: the thread's first data: its pivot is their mean
        piv = tl.where(new_piv, mean_t, piv)
        mean_t = tl.where(new_piv, 0.0, mean_t) + s_d * inv_c
        cnt, mean, m2 = _chan(cnt, mean, m2, c_t, mean_t, m2_t)
    return tl.reduce((cnt, piv, mean, m2), 0, _chan_pivoted)


@jit
def _whiten_partial_kernel(
    x_ptr, m_ptr,  # [N] (x any float dtype, m uint8 0/1)
    part_ptr,  # [P, 4] float32: count, pivot K, mean of (x - K), M2 of each program's share
    N,
    ROWS: tl.constexpr,  # rows of a tile
    THREADS: tl.constexpr,  # threads of a program (32 · warps): one run of VEC elements each per row
    VEC: tl.constexpr,  # contiguous elements per thread per row (16: one 16-byte load of the uint8 mask)
):
    """One pass over the program's tiles (tile i, i + P, ...): :func:`_share_moments`."""
    pid = tl.program_id(0)
    TILE: tl.constexpr = ROWS * THREADS * VEC
    cnt, piv, mean, m2 = _share_moments(x_ptr, m_ptr, N, pid * TILE, tl.num_programs(0) * TILE, False,
                                        ROWS, THREADS, VEC)
    tl.store(part_ptr + pid * 4 + 0, cnt)
    tl.store(part_ptr + pid * 4 + 1, piv)
    tl.store(part_ptr + pid * 4 + 2, mean)
    tl.store(part_ptr + pid * 4 + 3, m2)


@jit
def _whiten_merge_kernel(
    x_ptr, m_ptr,  # [N] as _whiten_partial_kernel read them (for the rescue)
    part_ptr,  # [P, 4] its partial moments
    stats_ptr,  # [5] float32 out: count, K, mean - K, M2, and the scale s they are the statistics of x·s for
    N, P,
    P_BLOCK: tl.constexpr, ROWS: tl.constexpr, THREADS: tl.constexpr, VEC: tl.constexpr,
):
    """One program: the P partial moments merged into the whole's (so the apply programs read 5 numbers).

    The partials have their own pivots; all are re-expressed relative to K0, the pivot of the first non-empty
    partial (K_j - K0 is a difference of two data values: exact or nearly so), so the global mean is K0 + mean
    and is never rounded to float32.

    Rescue: float32 squares overflow once deviations pass ~1.8e19 (and merges of means ~1e15 apart over ~1e9
    entries), leaving M2 or the mean inf or NaN. Then this program alone reads all of x once more and forms the
    statistics of x·2**-100 (exact scaling; deviations of the data that overflowed are still >= 2**-52 there,
    so no square underflows that matters), and s = 2**-100 tells the apply kernel. Finite data never takes it
    (the loop runs zero times); masked-in NaN/inf do (slowly, one program) and give NaN as before."""
    j = tl.arange(0, P_BLOCK)  # [P_BLOCK]
    pj = j < P
    cnt_j = tl.load(part_ptr + j * 4 + 0, mask=pj, other=0.0)  # [P_BLOCK]
    piv_j = tl.load(part_ptr + j * 4 + 1, mask=pj, other=0.0)  # [P_BLOCK]
    mean_j = tl.load(part_ptr + j * 4 + 2, mask=pj, other=0.0)  # [P_BLOCK]
    m2_j = tl.load(part_ptr + j * 4 + 3, mask=pj, other=0.0)  # [P_BLOCK]
    has = cnt_j > 0
    j0 = _first_set(has, P_BLOCK)
    k0 = block_sum(tl.where(j == j0, piv_j, 0.0), 0)  # 0 when no entry is masked in
    off_j = tl.where(has, (piv_j - k0) + mean_j, 0.0)  # [P_BLOCK]: each share's mean - K0
    cnt, s = _sum2(cnt_j, cnt_j * off_j)
    mean = s / tl.maximum(cnt, 1.0)
    dm = tl.where(has, off_j - mean, 0.0)  # [P_BLOCK]
    m2a, m2b = _sum2(m2_j, cnt_j * dm * dm)
    m2 = m2a + m2b
    finite = (tl.abs(k0 + mean) < float("inf")) & (tl.abs(m2) < float("inf"))  # False for NaN too
    TILE: tl.constexpr = ROWS * THREADS * VEC
    stop = tl.where(finite, 0, N)
    r_cnt, r_piv, r_mean, r_m2 = _share_moments(x_ptr, m_ptr, stop, 0, TILE, True, ROWS, THREADS, VEC)
    tl.store(stats_ptr + 0, cnt)
    tl.store(stats_ptr + 1, tl.where(finite, k0, r_piv))
    tl.store(stats_ptr + 2, tl.where(finite, mean, r_mean))
    tl.store(stats_ptr + 3, tl.where(finite, m2, r_m2))
    tl.store(stats_ptr + 4, tl.where(finite, 1.0, _RESCUE_DOWN))


@jit
def _whiten_apply_kernel(
    x_ptr, out_ptr,  # [N] in, [N] float32 out
    stats_ptr,  # [5] from _whiten_merge_kernel
    N, eps,
    SHIFT_MEAN: tl.constexpr, BLOCK: tl.constexpr,
):
    cnt = tl.load(stats_ptr + 0)
    k0 = tl.load(stats_ptr + 1)
    mean = tl.load(stats_ptr + 2)
    var = tl.load(stats_ptr + 3) / tl.maximum(cnt - 1.0, 1.0)
    sc = tl.load(stats_ptr + 4)  # 1, or the rescue's 2**-100 (then eps·sc² is 0: negligible beside a var > 0)
    # var = 0 (equal values, e.g. ones whose sum overflowed into the rescue): eps alone scales, by rsqrt(eps)/sc
    # applied in two steps (eps·sc² flushes to 0 in float32: rsqrt(0)·0 was NaN); with sc = 1 the same rsqrt(eps)
    flat = var == 0.0
    pre = tl.where(flat, 1.0 / sc, 1.0)
    rstd = tl.where(flat, 1.0 / tl.sqrt(eps), 1.0 / tl.sqrt(var + eps * sc * sc))
    back = (k0 + mean) * (1.0 / sc)  # the mean of x, added back without SHIFT_MEAN
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    for start in range(pid * BLOCK, N, nprog * BLOCK):
        i = start + offs  # [BLOCK]
        ok = i < N
        x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        y = (((x * sc - k0) - mean) * pre) * rstd  # [BLOCK]
        if not SHIFT_MEAN:
            y = y + back
        tl.store(out_ptr + i, y, mask=ok)


# ---------------------------------------------------------------- launchers: validation

# Validation precedes dispatch: every backend rejects the same inputs with the same message.


def _validate_gae(*, rewards, values, mask, gamma, lam) -> tuple[float, float]:
    """Check :func:`gae`'s arguments; returns its options ``(gamma, lam)`` as floats."""
    _checks.floating(rewards, "rewards")
    _checks.floating(values, "values")
    _checks.mask(mask, "mask")
    _checks.rank(rewards, "rewards", 2)
    _checks.same_shape(rewards, "rewards", values, "values")
    _checks.same_shape(rewards, "rewards", mask, "mask")
    _checks.same_device((rewards, "rewards"), (values, "values"), (mask, "mask"))
    return _checks.unit_interval(gamma, "gamma"), _checks.unit_interval(lam, "lam")


def _validate_group(*, scores, group_size, index, mode, eps) -> tuple[int | None, str, float]:
    """Check :func:`group_advantages`'s arguments; returns its options ``(group_size, mode, eps)``
    (``group_size`` None when the groups come from ``index``)."""
    _checks.floating(scores, "scores")
    _checks.rank(scores, "scores", 1)
    _checks.choice(mode, "mode", GROUP_MODES)
    eps = _checks.non_negative(eps, "eps")
    if (group_size is None) == (index is None):
        raise ValueError("give exactly one of group_size or index")
    if index is not None:
        _checks.integer(index, "index")
        if index.shape != scores.shape:
            raise ValueError(f"index must have the shape of scores {tuple(scores.shape)}, got {tuple(index.shape)}")
        _checks.same_device((scores, "scores"), (index, "index"))
        return None, mode, eps
    group_size = _checks.index(group_size, "group_size")  # a Python or NumPy integer
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide the number of scores {scores.shape[0]}")
    return group_size, mode, eps


def _validate_whiten(*, x, mask, shift_mean, eps, process_group) -> tuple[bool, float]:
    """Check :func:`masked_whiten`'s arguments; returns its options ``(shift_mean, eps)``."""
    _checks.floating(x, "x")
    _checks.mask(mask, "mask")
    _checks.same_shape(x, "x", mask, "mask")
    _checks.same_device((x, "x"), (mask, "mask"))
    eps = _checks.non_negative(eps, "eps")
    if process_group is not None:
        _checks.process_group(process_group)
    return _checks.flag(shift_mean, "shift_mean"), eps


# ---------------------------------------------------------------- launchers: Triton

# (BLOCK_B, BLOCK_T, num_warps) by T: short rows share a program, long rows loop over blocks. VEC = 16 tokens per
# thread (more per thread amortise the scan across chunks; 32 would not fit the registers). Up to 256 tokens a
# row lies inside one warp (no cross-warp step in its scans); longer rows take 512-token blocks, two rows per
# program of 2 warps. sm_90 aligned, SASS per token: 39-41 (4 x 256) and 41-43 (2 x 512) with Triton 3.9,
# 40-43 and 42-45 with 3.6; 7-8 CTAs per SM. One row per program is out: with BLOCK_B = 1, Triton 3.6 lays the
# in-chunk scan's [1, NCH, 16] operands across 16 lanes instead of one thread's registers (1 x 1024 in 2 warps:
# 130-134 per token with 3.6, 676 shuffles per iteration, against 44-45 with 3.9; 1 x 512 in 1 warp: 122.5).
# Rejected too: 32 x 64 and 8 x 256 in 4 warps (36-40 aligned, but the unaligned specialisation spills),
# 1 x 2048 in 4 warps (45.5-47.1 with 3.9), 4 x 512 in 4 warps (40.8-42.6, half the programs; `make gpu` may
# prefer it).
_GAE_CONFIGS = ((4, 256, 2), (2, 512, 2))
_GAE_VEC = 16  # _gae_kernel's VEC: consecutive tokens per thread (its in-register flip is written for 16)
# _group_kernel (one program per group): index-given groups of unequal sizes, groups of > 4096
# 8 warps: one score per thread per block. With 4 warps (two each) triton 3.6's sm_90 build of the index-given grpo
# kernel, held to 32 registers, spilled 8 B once the kernel also tracked the largest |score| (_group_scales)
_GROUP_BLOCK, _GROUP_WARPS = 256, 8
# _group_tile_kernel: groups of one size padded to GS columns (the powers of two it is compiled for, so the AOT
# set stays small), max(GS, _GROUP_TILE) scores per program: 16 per thread (4 warps up to GS = 2048, 8 above)
_GROUP_TILE_GS = (16, 64, 256, 1024, 2048, 4096)
_GROUP_TILE = 2048


def _group_tile_config(gs: int, has_index: bool) -> tuple[int, int]:
    """``(groups per program, warps)`` of the tile kernel for groups padded to ``gs`` columns: 16 scores per
    thread, 32 for index-given groups (their gather and scatter cost more per program, less per score).
    Contiguous groups of 1024 take one per program (8 scores per thread): two of them on 4 warps spilled 8 bytes
    in the unaligned sm_80 build of triton 3.6 (the GPU machines' version), at ~6 % fewer instructions per score."""
    tile, per_thread = (2 * _GROUP_TILE, 32) if has_index else (_GROUP_TILE, 16)
    groups = 1 if gs >= 1024 and not has_index else max(1, tile // gs)
    return groups, max(4, groups * gs // (32 * per_thread))


_WHITEN_BLOCK, _WHITEN_WARPS, _WHITEN_P_BLOCK = 2048, 8, 1024
# _whiten_partial_kernel's tile: _WHITEN_ROWS rows of 16 contiguous elements per thread (one 16-byte mask load;
# the same layout for the x load), 4 warps: a thread's share of a tile stays in its registers
_WHITEN_ROWS, _WHITEN_VEC, _WHITEN_PARTIAL_WARPS = 2, 16, 4
# _whiten_merge_kernel's rescue loop (a cold path: one program, only where float32 statistics overflowed) reads
# 4 elements per thread: with the partial kernel's 2 x 16 its unaligned sm_90 build needed 255 registers and
# spilled 160 B (1 x 4: 53-64 registers, none)
_WHITEN_RESCUE_ROWS, _WHITEN_RESCUE_VEC = 1, 4


def _gae_config(T: int) -> tuple[int, int, int]:
    return _GAE_CONFIGS[0] if T <= 256 else _GAE_CONFIGS[1]


def _kernel_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs in one dtype the Triton and CUDA kernels load (float32/bf16/fp16): their common dtype,
    float32 when that is another one (bfloat16 with float16, or float64 in a mix: float64 alone stays on torch)."""
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    dtype = dtype if dtype in backends.TRITON_DTYPES else torch.float32
    return tuple(x.to(dtype) for x in xs)


def _gae_triton(rewards, values, mask, gamma, lam):
    r, v = _kernel_inputs(rewards, values)  # [B, T] x2
    m = _host.mask_u8(mask)  # [B, T]
    B, T = r.shape
    adv = torch.empty(B, T, dtype=torch.float32, device=r.device)  # [B, T]
    ret = torch.empty_like(adv)  # [B, T]
    if B * T == 0:
        return adv, ret
    block_b, block_t, warps = _gae_config(T)
    kwargs = {"num_warps": warps} if r.is_cuda else {}
    _gae_kernel.launch(
        (cdiv(B, block_b),), r, v, m, adv, ret, B, T,
        r.stride(0), r.stride(1), v.stride(0), v.stride(1), m.stride(0), m.stride(1),
        float(gamma), float(lam), BLOCK_B=block_b, BLOCK_T=block_t, VEC=_GAE_VEC, **kwargs,
    )
    return adv, ret


def _group_layout(scores: torch.Tensor, group_size: int | None, index: torch.Tensor | None):
    """``(perm, starts, counts)`` describing the groups: group g holds ``perm[starts[g]:starts[g+1]]``, ``counts``
    [G] members (None for contiguous groups: all have ``group_size``).

    Contiguous groups need no permutation (``perm`` is empty). Arbitrary ids are
    mapped to 0..G-1 (``torch.unique``) and sorted stably, so each group is one
    contiguous run of ``perm``.
    """
    N = scores.shape[0]
    device = scores.device
    if index is None:
        G = N // group_size
        starts = torch.arange(G + 1, device=device, dtype=torch.int64) * group_size  # [G + 1]
        return torch.empty(0, dtype=torch.int64, device=device), starts, None
    _, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)  # [N], [G]
    perm = torch.argsort(inverse, stable=True)  # [N]
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=device)  # [G + 1]
    torch.cumsum(counts, 0, out=starts[1:])
    return perm, starts, counts


def _group_triton(scores, group_size, index, mode, eps):
    s = scores.float().contiguous()  # [N]: sequence scores are tiny, one float32 copy is free
    N = s.shape[0]
    if N >= 2**31:
        raise ValueError(f"scores has {N} entries; the Triton kernel indexes with int32 (fewer than 2**31)")
    out = torch.empty_like(s)  # [N]
    if N == 0:
        return out
    if index is None:  # contiguous groups: no permutation or starts to build (the kernels compute the positions)
        G = N // group_size
        perm = starts = torch.empty(1, dtype=torch.int64, device=s.device)  # [1]: placeholders, never read
        smallest = largest = group_size
    else:  # one read of both on the host (torch.unique has synchronised already)
        perm, starts, counts = _group_layout(s, group_size, index)  # [N], [G + 1], [G]
        G = starts.numel() - 1
        smallest, largest = (int(c) for c in torch.stack(torch.aminmax(counts)).tolist())
    if smallest == largest <= _GROUP_TILE_GS[-1]:  # groups of one size: contiguous, or equal runs of perm
        gs = next(c for c in _GROUP_TILE_GS if c >= largest)
        groups, warps = _group_tile_config(gs, index is not None)
        # int32 positions: the same 16-byte layout as the scores' (an int64 load would go through shared memory)
        perm32 = perm.to(torch.int32) if index is not None else s  # [N] (never read without an index)
        _group_tile_kernel.launch(
            (cdiv(G, groups),), s, out, perm32, G, largest, float(eps), GROUP_MODES.index(mode),
            HAS_INDEX=index is not None, GS=gs, GROUPS=groups, **({"num_warps": warps} if s.is_cuda else {}),
        )
        return out
    kwargs = {"num_warps": _GROUP_WARPS} if s.is_cuda else {}
    _group_kernel.launch(
        (G,), s, out, perm, starts, group_size or 0, float(eps),
        MODE=GROUP_MODES.index(mode), HAS_INDEX=index is not None, BLOCK=_GROUP_BLOCK, **kwargs,
    )
    return out


def _whiten_triton(x, mask, shift_mean, eps):
    (xf,) = _kernel_inputs(x)
    xf = xf.reshape(-1).contiguous()  # [N] (reshape alone may keep a stride: a [:, ::2] slice, an expanded x)
    m = _host.mask_u8(mask).reshape(-1).contiguous()  # [N]
    N = xf.numel()
    out = torch.empty(N, dtype=torch.float32, device=x.device)  # [N]
    if N == 0:
        return out.view(x.shape)
    threads = 32 * _WHITEN_PARTIAL_WARPS
    tiles = cdiv(N, _WHITEN_ROWS * threads * _WHITEN_VEC)
    # a few programs on the CPU (the interpreter runs them one by one), enough to fill a GPU there
    P = min(tiles, _WHITEN_P_BLOCK if x.is_cuda else 4)
    # [P, 4] per program: count, pivot, mean - pivot, M2; then [5] the whole's, and the scale (see the merge kernel)
    part = torch.empty(P * 4 + 5, dtype=torch.float32, device=x.device)
    tile = {"ROWS": _WHITEN_ROWS, "THREADS": threads, "VEC": _WHITEN_VEC}
    warps = {"num_warps": _WHITEN_PARTIAL_WARPS} if x.is_cuda else {}
    _whiten_partial_kernel.launch((P,), xf, m, part, N, **tile, **warps)
    stats = part[P * 4:]  # [5]
    _whiten_merge_kernel.launch((1,), xf, m, part, stats, N, P, P_BLOCK=_WHITEN_P_BLOCK, ROWS=_WHITEN_RESCUE_ROWS,
                                THREADS=threads, VEC=_WHITEN_RESCUE_VEC, **warps)
    kwargs = {"num_warps": _WHITEN_WARPS} if x.is_cuda else {}
    _whiten_apply_kernel.launch((P,), xf, out, stats, N, float(eps), SHIFT_MEAN=bool(shift_mean),
                                BLOCK=_WHITEN_BLOCK, **kwargs)
    return out.view(x.shape)


def aot_configs():
    """Every (kernel, constexprs, warps) the Triton launchers above can pick, for AOT compile tests."""
    from rlkernels.testing.aot import KernelConfig

    configs = []
    for name in _host.TRITON_DTYPE_NAMES.values():
        ty = "*" + name
        for block_b, block_t, warps in _GAE_CONFIGS:
            # the token strides as real launches of contiguous rows get them: specialised to the constant 1
            sig = {
                "r_ptr": ty, "v_ptr": ty, "m_ptr": "*u8", "adv_ptr": "*fp32", "ret_ptr": "*fp32", "B": "i32", "T": "i32",
                "stride_rb": "i32", "stride_rt": "constexpr", "stride_vb": "i32", "stride_vt": "constexpr",
                "stride_mb": "i32", "stride_mt": "constexpr", "gamma": "fp32", "lam": "fp32",
                "BLOCK_B": "constexpr", "BLOCK_T": "constexpr", "VEC": "constexpr",
            }
            consts = {"BLOCK_B": block_b, "BLOCK_T": block_t, "VEC": _GAE_VEC, "stride_rt": 1, "stride_vt": 1, "stride_mt": 1}
            configs.append(KernelConfig(_gae_kernel, sig, consts, num_warps=warps, elements=block_b * block_t))
        sig = {"x_ptr": ty, "m_ptr": "*u8", "part_ptr": "*fp32", "N": "i32", "ROWS": "constexpr", "THREADS": "constexpr",
               "VEC": "constexpr"}
        threads = 32 * _WHITEN_PARTIAL_WARPS
        consts = {"ROWS": _WHITEN_ROWS, "THREADS": threads, "VEC": _WHITEN_VEC}
        configs.append(KernelConfig(_whiten_partial_kernel, sig, consts, num_warps=_WHITEN_PARTIAL_WARPS,
                                    elements=_WHITEN_ROWS * threads * _WHITEN_VEC))
        sig = {"x_ptr": ty, "m_ptr": "*u8", "part_ptr": "*fp32", "stats_ptr": "*fp32", "N": "i32", "P": "i32",
               "P_BLOCK": "constexpr", "ROWS": "constexpr", "THREADS": "constexpr", "VEC": "constexpr"}
        # one program; its loop is the rescue, which finite data never runs: no per-element figure
        rescue = {"ROWS": _WHITEN_RESCUE_ROWS, "THREADS": threads, "VEC": _WHITEN_RESCUE_VEC, "P_BLOCK": _WHITEN_P_BLOCK}
        configs.append(KernelConfig(_whiten_merge_kernel, sig, rescue, num_warps=_WHITEN_PARTIAL_WARPS))
        for shift in (True, False):
            sig = {"x_ptr": ty, "out_ptr": "*fp32", "stats_ptr": "*fp32", "N": "i32", "eps": "fp32",
                   "SHIFT_MEAN": "constexpr", "BLOCK": "constexpr"}
            consts = {"SHIFT_MEAN": shift, "BLOCK": _WHITEN_BLOCK}
            configs.append(KernelConfig(_whiten_apply_kernel, sig, consts, num_warps=_WHITEN_WARPS, elements=_WHITEN_BLOCK))
    for gs in _GROUP_TILE_GS:
        for has_index in (False, True):
            sig = {"s_ptr": "*fp32", "out_ptr": "*fp32", "perm_ptr": "*i32", "G": "i32", "group_size": "i32",
                   "eps": "fp32", "MODE": "i32", "HAS_INDEX": "constexpr", "GS": "constexpr", "GROUPS": "constexpr"}
            groups, warps = _group_tile_config(gs, has_index)
            consts = {"HAS_INDEX": has_index, "GS": gs, "GROUPS": groups}
            configs.append(KernelConfig(_group_tile_kernel, sig, consts, num_warps=warps, elements=groups * gs))
            if gs == _GROUP_TILE_GS[0]:  # groups of one: Triton passes an int argument equal to 1 as a constant
                ones = {**sig, "group_size": "constexpr"}
                configs.append(KernelConfig(_group_tile_kernel, ones, {**consts, "group_size": 1}, num_warps=warps))
    for mode in GROUP_MODES:
        for has_index in (False, True):
            sig = {
                "s_ptr": "*fp32", "out_ptr": "*fp32", "perm_ptr": "*i64", "starts_ptr": "*i64", "group_size": "i32",
                "eps": "fp32", "MODE": "constexpr", "HAS_INDEX": "constexpr", "BLOCK": "constexpr",
            }
            consts = {"MODE": GROUP_MODES.index(mode), "HAS_INDEX": has_index, "BLOCK": _GROUP_BLOCK}
            configs.append(KernelConfig(_group_kernel, sig, consts, num_warps=_GROUP_WARPS, elements=_GROUP_BLOCK))
    configs.extend(_process_aot_configs())
    return configs


# ---------------------------------------------------------------- launchers: vectorized PyTorch

_TORCH_CHUNK = 32


def _gae_torch(rewards, values, mask, gamma, lam):
    """Chunks of C tokens: a loop of C steps runs every chunk's recursion at once, a loop of T/C steps carries the
    state across chunks.

    Inside a chunk, ``S_t = δ_t + f_t S_{t+1}`` with ``f_t = γλ`` at a valid token and 1 at a masked one (which adds
    no δ: transparent), the recursion itself, so a NaN or inf reaches only the tokens before it, as in the
    reference (a matmul with the chunk's weights would multiply it by the zeros above the diagonal: 0 · NaN).
    Across chunks the state carries as ``S_t += (γλ)^{k(t, end)} · S_end``, ``k`` the valid tokens in ``[t, end)``.
    """
    r, v = rewards.float(), values.float()  # [B, T]
    valid = mask.bool()  # [B, T]
    B, T = r.shape
    if B * T == 0:
        return torch.zeros_like(r), torch.zeros_like(r)
    dev = r.device
    # every buffer float32 by name: a caller's torch.set_default_dtype (bfloat16 carries, float64 steps) would
    # otherwise reach the scan
    f32 = {"dtype": torch.float32, "device": dev}
    pos = torch.arange(T, device=dev)
    # index of the next valid token strictly after t (T if none): V_next = v[that], 0 past the end
    idx = torch.where(valid, pos, torch.full_like(pos, T))  # [B, T]
    first_at_or_after = torch.flip(torch.cummin(torch.flip(idx, [1]), 1).values, [1])  # [B, T]
    nxt = torch.cat([first_at_or_after[:, 1:], torch.full((B, 1), T, device=dev, dtype=idx.dtype)], 1)  # [B, T]
    v_pad = torch.cat([torch.where(valid, v, torch.zeros_like(v)), torch.zeros(B, 1, **f32)], 1)  # [B, T + 1]
    v_next = v_pad.gather(1, nxt)  # [B, T]
    delta = torch.where(valid, r + gamma * v_next - v, torch.zeros_like(r))  # [B, T]
    C = _TORCH_CHUNK
    nc = (T + C - 1) // C
    pad = nc * C - T
    d = torch.nn.functional.pad(delta, (0, pad)).view(B, nc, C)  # [B, nc, C]
    w = torch.nn.functional.pad(valid.to(torch.float32), (0, pad)).view(B, nc, C)  # [B, nc, C]
    k = torch.flip(torch.cumsum(torch.flip(w, [2]), 2), [2])  # [B, nc, C]: valid tokens in [t, end of chunk)
    gl = torch.tensor(gamma * lam, dtype=torch.float32, device=dev)
    f = torch.where(w > 0, gl, torch.ones((), **f32))  # [B, nc, C]: γλ at a valid token, 1 at a masked one
    local = torch.empty_like(d)  # [B, nc, C]: the state inside each chunk, as if nothing followed it
    acc = torch.zeros(B, nc, **f32)  # [B, nc]
    for t in range(C - 1, -1, -1):
        acc = torch.addcmul(d[:, :, t], f[:, :, t], acc)
        local[:, :, t] = acc
    decay = torch.pow(gl, k)  # [B, nc, C]
    carry = torch.zeros(B, **f32)  # [B]: S at the start of the chunk after
    carries = torch.empty(B, nc, **f32)  # [B, nc]
    for c in range(nc - 1, -1, -1):
        carries[:, c] = carry
        carry = local[:, c, 0] + decay[:, c, 0] * carry
    state = local + decay * carries.unsqueeze(-1)  # [B, nc, C]
    adv = torch.where(valid, state.reshape(B, nc * C)[:, :T], torch.zeros_like(r))
    return adv, adv + v


def _group_torch(scores, group_size, index, mode, eps):
    s = scores if scores.dtype == torch.float64 else scores.float()  # [N]: float64 kept (not rounded to float32)
    N = s.shape[0]
    if N == 0:
        return s.float()
    if index is None:
        ids = torch.arange(N, device=s.device) // group_size  # [N]
        G = N // group_size
    else:
        _, ids = torch.unique(index, return_inverse=True)  # [N] in 0..G-1
        G = int(ids.max()) + 1
    # the statistics in float64: a float32 square overflows once |s - mean| passes ~1.8e19, a float32 sum near 3e38
    s64 = s.double()  # [N]
    zeros = torch.zeros(G, dtype=torch.float64, device=s.device)
    n = torch.bincount(ids, minlength=G).double()  # [G]
    mean = zeros.index_add(0, ids, s64) / n  # [G]
    dev_ = s64 - mean[ids]  # [N]
    ssq = zeros.index_add(0, ids, dev_ * dev_)  # [G]
    first = torch.full((G,), float("nan"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, "amin",
                                                                                         include_self=False)
    last = torch.full((G,), float("nan"), dtype=s.dtype, device=s.device).scatter_reduce(0, ids, s, "amax",
                                                                                        include_self=False)
    has_nan = zeros.index_add(0, ids, torch.isnan(s64).double()) > 0
    constant = ((first == last) & ~has_nan) | (n < 2)  # [G]
    if mode == "grpo":
        scale = 1.0 / (torch.sqrt(ssq / (n - 1).clamp(min=1)) + eps)
    elif mode == "dr_grpo":
        scale = torch.ones_like(n)
    else:
        scale = n / (n - 1).clamp(min=1)
    out = (dev_ * scale[ids]).float()  # [N]
    return torch.where(constant[ids], torch.zeros_like(out), out)


def _whiten_torch(x, mask, shift_mean, eps):
    """The statistics in float64, rounded once at the output: float32 data shifted far from 0 (``1e6 + noise``)
    keep their precision, and no sum or square overflows for any float32 input (values near ±3.4e38 included:
    float32 sums, differences and squares of those overflow). ``x`` is ``[B, T]``-sized, not vocabulary-sized:
    the float64 copy is small."""
    x64 = x.double().reshape(-1)  # [N]
    m = mask.bool().reshape(-1)  # [N]
    if x64.numel() == 0:
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    n = m.sum().double()
    # where, not a product with the mask: a NaN/inf at a masked-out position stays out of the statistics
    mean = torch.where(m, x64, zero).sum() / n.clamp(min=1.0)
    d = torch.where(m, x64 - mean, zero)  # [N]
    var = d.square().sum() / (n - 1.0).clamp(min=1.0)
    out = (x64 - mean) * torch.rsqrt(var + eps)  # [N]
    out = out if shift_mean else out + mean
    return out.float().view(x.shape)


# ---------------------------------------------------------------- launchers: process-group statistics


def _whiten_global(x, mask, shift_mean, eps, process_group):
    """:func:`masked_whiten` with the statistics of the masked entries of every rank of ``process_group``.

    The count and sum, then the sum of squared deviations from the global mean, are all-reduced in
    float64 (two passes: no cancellation from a sum of squares, and data far from 0, e.g. ``1e6 +
    noise``, keeps its precision); the output is formed in float64 and rounded once to float32. Every
    rank must call it (two collectives each), also a rank with no entries."""
    with backends.float32_compute(x.device):  # autocast off: float64 stays float64
        x64 = x.double()  # [...]
        m = mask.bool()  # [...]
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        # where, not a product with the mask: a NaN/inf at a masked-out position must not enter the statistics
        stats = torch.stack([m.sum().double(), torch.where(m, x64, zero).sum()])  # [2]: count, sum
        dist.all_reduce(stats, group=process_group)
        count = stats[0]
        mean = stats[1] / count.clamp(min=1.0)
        sq = torch.where(m, (x64 - mean).square(), zero).sum().reshape(1)  # [1]: Σ (x - mean)² over this rank
        dist.all_reduce(sq, group=process_group)
        var = sq[0] / (count - 1.0).clamp(min=1.0)  # 0 below two entries: Σ (x - mean)² is then exactly 0
        out = (x64 - mean) * torch.rsqrt(var + eps)  # [...]
        return (out if shift_mean else out + mean).float()


# ---------------------------------------------------------------- launchers: csrc


def _csrc_ops():
    ops = _extension.load()
    if ops is None:
        raise RuntimeError(f"the csrc extension is unavailable: {_extension.error()}")
    return ops


def _gae_csrc(rewards, values, mask, gamma, lam):
    r, v = _kernel_inputs(rewards, values)  # [B, T] x2
    if r.is_cuda:
        r, v = r.contiguous(), v.contiguous()
        m = mask.bool().contiguous()  # [B, T]
    else:
        m = mask.bool()  # [B, T]
    return tuple(_csrc_ops().gae(r, v, m, float(gamma), float(lam)))


def _group_csrc(scores, group_size, index, mode, eps):
    s = scores.float().contiguous()  # [N]
    if index is None:  # contiguous groups: the kernels take the size itself (no [G + 1] starts to build and read)
        none = torch.empty(0, dtype=torch.int64, device=s.device)  # [0]
        return _csrc_ops().group_advantages(s, none, none, group_size, GROUP_MODES.index(mode), float(eps))
    perm, starts, _ = _group_layout(s, group_size, index)  # [N], [G + 1]
    return _csrc_ops().group_advantages(s, perm, starts, 0, GROUP_MODES.index(mode), float(eps))


# masked_whiten's CUDA kernels (csrc/whiten_kernels.h; RLKERNELS_WHITEN picks, the CPU kernel has one path):
# - "fused" (the default): one cooperative kernel -- partial moments per block, a grid barrier, every block merging
#   them and normalising its own share -- where the memory is aligned (contiguous tensors at offset 0) and the device
#   runs cooperative launches, else the passes. Reads x and the mask from DRAM once and writes once: predicted (not
#   yet measured) ~13-16 us at B=1024 T=4096 float32 on an H200, against the passes' 26.6 (2.97x the 8.96 us bound);
# - "passes": statistics, a one-block merge, normalisation: three launches, x read twice (the default until then;
#   bench/results/NVIDIA_H200-2026-11-27.md).
WHITEN_ENV = "RLKERNELS_WHITEN"
WHITEN_PATHS = ("fused", "passes")


def _whiten_csrc(x, mask, shift_mean, eps):
    fused = (backends.env_choice(WHITEN_ENV, WHITEN_PATHS) or "fused") == "fused"
    (xf,) = _kernel_inputs(x)
    out = _csrc_ops().masked_whiten(xf.contiguous(), mask.bool().contiguous(), bool(shift_mean), float(eps), fused)
    return out.view(x.shape)


# ---------------------------------------------------------------- custom ops: one table per op, resolved inside


_GAE_IMPLS = {
    "reference": lambda r, v, m, gamma, lam: reference.gae(r, v, m, gamma=gamma, lam=lam),
    "torch": _gae_torch,
    "triton": _gae_triton,
    "csrc": _gae_csrc,
}
_GROUP_IMPLS = {
    "reference": lambda s, group_size, index, mode, eps: reference.group_advantages(s, group_size, index=index, mode=mode, eps=eps),
    "torch": _group_torch,
    "triton": _group_triton,
    "csrc": _group_csrc,
}
_WHITEN_IMPLS = {
    "reference": lambda x, m, shift_mean, eps: reference.masked_whiten(x, m, shift_mean=shift_mean, eps=eps),
    "torch": _whiten_torch,
    "triton": _whiten_triton,
    "csrc": _whiten_csrc,
}


# The backend is resolved here, at run time inside the op (the csrc extension's first build is never
# traced by torch.compile), from the inputs' device and dtype. Every op body runs with autocast off for
# its device: under torch.autocast("cpu", bfloat16) the torch backend's chunk matmul would otherwise run
# in bf16 (advantages off by ~0.05).
@_host.custom_op("rlkernels::gae")
def _gae_op(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    # CUDA: the csrc kernel by default (measured on an H100, B=1024 T=4096 bf16: 25.1 us against the fixed Triton
    # kernel's 33.3; bench/results/NVIDIA_H100_80GB_HBM3-2026-11-26.md), Triton where the extension has no CUDA kernels
    backend = backends.resolve(rewards.device, _SUPPORTED, torch.promote_types(rewards.dtype, values.dtype),
                               cuda_default="csrc")
    with backends.float32_compute(rewards.device):
        adv, ret = _GAE_IMPLS[backend](rewards, values, mask, gamma, lam)  # [B, T] x2
        return adv.float().contiguous(), ret.float().contiguous()


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam):
    return rewards.new_empty(rewards.shape, dtype=torch.float32), rewards.new_empty(rewards.shape, dtype=torch.float32)


@_host.custom_op("rlkernels::group_advantages")
def _group_op(scores: torch.Tensor, group_size: int | None, index: torch.Tensor | None, mode: str, eps: float) -> torch.Tensor:
    # CUDA: the csrc kernels by default, measured faster on both GPUs (2^20 scores in groups of 16: H100 33.0 us
    # against Triton's 49.3, H200 15.2 against 25.9; bench/results/NVIDIA_H*.md), Triton without them
    backend = backends.resolve(scores.device, _SUPPORTED, scores.dtype, cuda_default="csrc")
    with backends.float32_compute(scores.device):
        return _GROUP_IMPLS[backend](scores, group_size, index, mode, eps).float().contiguous()  # [N]


@_group_op.register_fake
def _(scores, group_size, index, mode, eps):
    return scores.new_empty(scores.shape, dtype=torch.float32)


@_host.custom_op("rlkernels::masked_whiten")
def _whiten_op(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    # CUDA: the csrc kernels by default, measured faster on both GPUs (B=1024 T=4096 float32: H100 31.2 us against
    # Triton's 109.3, H200 27.6 against 101.1; bench/results/NVIDIA_H*.md), Triton without them
    backend = backends.resolve(x.device, _SUPPORTED, x.dtype, cuda_default="csrc")
    with backends.float32_compute(x.device):
        return _WHITEN_IMPLS[backend](x, mask, shift_mean, eps).float().contiguous()  # [...]


@_whiten_op.register_fake
def _(x, mask, shift_mean, eps):
    return x.new_empty(x.shape, dtype=torch.float32)


# ---------------------------------------------------------------- public functions


def gae(
    rewards: torch.Tensor,  # [B, T]
    values: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] bool or 0/1
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns ``(advantages, returns)``, float32 ``[B, T]``.

    ``δ_t = r_t + γ·V_next - V_t``, ``A_t = δ_t + γλ·A_next``, walking backwards.
    Masked tokens are transparent (``V_next``/``A_next`` carry across them; past
    the last valid token ``V_next = 0``); they get advantage 0 and return
    ``values``, but only masked-in positions are specified. ``returns = advantages + values``.
    Computed in float32 for any float input dtype (and under any ``torch.autocast``
    context), as a parallel scan over ``T`` (Triton/CUDA) or a per-row loop (C++ on
    CPU). No gradient: the outputs are constants (inputs are detached).

    Args:
        rewards: ``[B, T]`` float tensor (float16/bfloat16/float32/float64), the
            per-token rewards (e.g. a score at the last valid token plus per-token
            KL penalties). Values at masked-out positions are never read into an output.
        values: ``[B, T]`` float tensor, the critic's value of each token, same shape
            and device as ``rewards``.
        mask: ``[B, T]``, bool or 0/1 numeric (float or integer); nonzero marks a
            valid (response) token. A row with no valid token gets all-zero advantages.
        gamma: discount ``γ`` in ``[0, 1]``.
        lam: GAE ``λ`` in ``[0, 1]``. The default ``1.0`` (with ``gamma=1.0``) is the
            contract's default: the unbiased Monte-Carlo advantage ``Σ_{s≥t} r_s - V_t``,
            which needs no trust in the critic. The bundled trainer passes
            ``lam=0.95``, the usual PPO choice that trades a little bias (it leans on
            the critic's values) for much lower variance on long responses.

    Returns:
        ``(advantages, returns)``, both float32 ``[B, T]`` on the device of ``rewards``;
        ``returns = advantages + values`` (the critic's regression target).

    Raises:
        TypeError: a non-tensor or non-float ``rewards``/``values``, a mask of another
            dtype, a non-number ``gamma``/``lam``.
        ValueError: mismatched shapes or devices, ``rewards`` not 2-D, ``gamma`` or
            ``lam`` outside ``[0, 1]`` or NaN/inf.
    """
    gamma, lam = _validate_gae(rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam)
    return _host.call(_gae_op, rewards.detach(), values.detach(), mask.detach(), gamma, lam)


def group_advantages(
    scores: torch.Tensor,  # [N]
    group_size: int | None = None,
    *,
    index: torch.Tensor | None = None,  # [N] integer group ids
    mode: str = "grpo", eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages of per-sequence scores, float32 ``[N]``.

    Groups are contiguous blocks of ``group_size`` or share an integer id in
    ``index`` (exactly one of the two). ``grpo``: ``(s - mean)/(std + eps)``
    (unbiased std); ``dr_grpo``: ``s - mean``; ``rloo``: ``s - mean of the
    others``. A group of one, and every member of a group whose scores are all
    equal, gets exactly 0. NaN stays inside its group. Any finite float32 score
    (up to ±3.4e38) is handled on every backend: the statistics never overflow
    (a result beyond float32, e.g. ``dr_grpo`` of 3e38 and -3e38, is ±inf). No
    gradient.

    Args:
        scores: ``[N]`` float tensor, one score (reward) per sequence.
        group_size: the number of samples per prompt: sequences ``[g·group_size,
            (g+1)·group_size)`` form group ``g``. Must be a positive int that divides
            ``N``. Give it or ``index``, not both.
        index: ``[N]`` integer tensor (any integer dtype) of group ids, e.g. the
            prompt id of each sequence: sequences with equal ids form a group,
            wherever they sit; ids need not be contiguous, sorted or small.
        mode: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
        eps: added to the std in ``grpo`` mode; finite and ``>= 0`` (checked in
            every mode).

    Returns:
        float32 ``[N]`` advantages on the device of ``scores``.

    Raises:
        TypeError: non-float ``scores``, non-integer ``index``, non-int ``group_size``,
            non-number ``eps``.
        ValueError: both or neither of ``group_size``/``index``, ``group_size`` <= 0 or
            not dividing ``N``, ``index`` of another shape or device, an unknown
            ``mode``, a negative, NaN or infinite ``eps``.
    """
    group_size, mode, eps = _validate_group(scores=scores, group_size=group_size, index=index, mode=mode, eps=eps)
    return _host.call(_group_op, scores.detach(), group_size, None if index is None else index.detach(), mode, eps)


def masked_whiten(
    x: torch.Tensor,  # [...]
    mask: torch.Tensor,  # [...] bool or 0/1
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``(x - μ)·rsqrt(var + eps)`` with the masked mean and unbiased masked variance, float32.

    Every position is transformed; only masked-in ones (``mask != 0``) enter the
    statistics (values elsewhere, even NaN, are ignored by them). With
    ``shift_mean=False`` the mean is added back. With fewer than two masked entries
    the variance is taken as 0. Any finite float32 values (up to ±3.4e38) are handled
    on every backend: the statistics never overflow. No gradient.

    Precision: the torch backend and the csrc CPU kernel (the CPU default) form the
    statistics in float64 (float64 ``x`` always runs on torch: the kernels would round it
    to float32 first); the Triton and CUDA kernels in float32 (relative to a pivot, so shifted data such as
    1e6 + noise keeps its variance), where ``μ`` carries an absolute error of order
    1e-7 of the standard deviation. With ``shift_mean=False`` and a mean far smaller
    than the spread (|μ| ≈ 1e-3·σ) that is ~1e-4 of ``μ`` itself, so the re-added
    mean is the output's least exact part there.

    On CUDA the default is the csrc extension's one cooperative kernel (statistics, a
    grid barrier, normalisation: x read from memory once, one launch) where the
    memory is aligned (contiguous tensors), else its three passes;
    ``RLKERNELS_WHITEN=passes`` forces those.

    With ``process_group``, ``μ`` and the variance are those of the masked entries of
    every rank of the group together: each rank gets its own part of
    ``masked_whiten`` over the concatenation of all ranks' entries (a data-parallel
    trainer whitens the global batch, so N processes agree with one). Every rank of
    the group must call it (it runs two all-reduces of a few float64 values); the
    count, the sum and then the squared deviations are reduced in float64 and the
    output is formed in float64, whatever ``RLKERNELS_BACKEND`` says (the kernels'
    statistics are per process).

    Args:
        x: float tensor of any shape ``[...]`` (e.g. ``[B, T]`` advantages); with
            ``process_group`` the shapes may differ between ranks.
        mask: bool or 0/1 numeric tensor of the shape and device of ``x``; nonzero
            marks the entries that enter the mean and variance.
        shift_mean: keep the whitened values centred (``True``) or add ``μ`` back.
        eps: added to the variance; finite and ``>= 0``.
        process_group: ``None`` (default): the statistics of this call's entries only.
            A ``torch.distributed`` process group: the statistics of all its ranks'
            entries; pass ``torch.distributed.group.WORLD`` for every rank of the job
            (before ``init_process_group`` that is ``None``: one process, local
            statistics, which are then the global ones). The tensors must be on a
            device the group's backend serves (CPU for gloo, CUDA for NCCL).

    Returns:
        float32 tensor of the shape of ``x``.

    Raises:
        TypeError: non-float ``x``, a mask of another dtype, non-number ``eps``, a
            ``process_group`` that is not a ``torch.distributed.ProcessGroup``.
        ValueError: mismatched shapes or devices, a negative, NaN or infinite ``eps``.
    """
    shift_mean, eps = _validate_whiten(x=x, mask=mask, shift_mean=shift_mean, eps=eps, process_group=process_group)
    if process_group is not None:
        return _whiten_global(x.detach(), mask.detach(), shift_mean, eps, process_group)
    return _host.call(_whiten_op, x.detach(), mask.detach(), shift_mean, eps)


# ================================================================ process supervision (issue 15)
# process_advantages: GRPO with process supervision (DeepSeekMath §4.1.3). Self-contained below (its own
# validation, kernel, launchers, table and custom op) so the kernels above can change independently.

from rlkernels.reference import PROCESS_MODES  # noqa: E402

_PROCESS_SUPPORTED = ("reference", "torch", "triton")  # no csrc kernel: the torch path is already loop-free


def _validate_process(*, step_rewards, step_ends, T, step_mask, group_size, index, mode, eps):
    """Check :func:`process_advantages`'s arguments; returns ``(T, group_size, mode, eps)`` (``group_size``
    None when the groups come from ``index``). Checks that every valid step ends inside ``[0, T)``: one look at
    ``step_ends`` (a device sync on a GPU; the inputs are ``[B, S]``, tiny), skipped while ``torch.compile`` traces
    the call, as the other value checks are."""
    _checks.floating(step_rewards, "step_rewards")
    _checks.rank(step_rewards, "step_rewards", 2)
    _checks.integer(step_ends, "step_ends")
    _checks.same_shape(step_rewards, "step_rewards", step_ends, "step_ends")
    if step_mask is not None:
        _checks.mask(step_mask, "step_mask")
        _checks.same_shape(step_rewards, "step_rewards", step_mask, "step_mask")
    _checks.same_device((step_rewards, "step_rewards"), (step_ends, "step_ends"), (step_mask, "step_mask"), (index, "index"))
    T = _checks.index(T, "T")  # a Python or NumPy integer
    if T < 0:
        raise ValueError(f"T must be >= 0, got {T}")
    mode = _checks.choice(mode, "mode", PROCESS_MODES)
    eps = _checks.non_negative(eps, "eps")
    B = step_rewards.shape[0]
    if (group_size is None) == (index is None):
        raise ValueError("give exactly one of group_size or index")
    if index is not None:
        _checks.integer(index, "index")
        if index.shape != (B,):
            raise ValueError(f"index must have shape [B] = {(B,)} (one group id per row of step_rewards), got {tuple(index.shape)}")
    else:
        group_size = _checks.index(group_size, "group_size")  # a Python or NumPy integer
        if group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {group_size}")
        if B % group_size:
            raise ValueError(f"group_size {group_size} does not divide the number of rows of step_rewards {B}")
    if step_ends.numel() and not _checks._tracing():  # traced (torch.compile): a data-dependent branch, skipped
        valid = torch.ones_like(step_ends, dtype=torch.bool) if step_mask is None else step_mask != 0  # [B, S]
        ends = step_ends.long()  # [B, S]: torch compares no uint16/32/64 tensor on the CPU (and a uint64 past 2**63
        # wraps negative here: refused, as it lies outside [0, T) anyway)
        bad = (valid & ((ends < 0) | (ends >= T))).nonzero()  # [k, 2]
        if bad.numel():
            b, s = bad[0].tolist()
            raise ValueError(f"step_ends must lie in [0, T) = [0, {T}) at every valid step; row {b} step {s} ends at "
                             f"{int(ends[b, s])} ({bad.shape[0]} such steps)")
    return T, group_size, mode, eps


def _process_torch(step_rewards, step_ends, step_mask, T, group_size, index, mode, eps):
    """Group statistics by ``index_add`` over the flattened steps, then each normalised step reward is
    scattered onto its end token and summed from the right (a reversed cumulative sum over ``T``). In float64
    (``[B, S]`` and ``[B, T]``: small), rounded once: float32 sums and squares of rewards past ~1e19 overflow."""
    r = step_rewards.double()  # [B, S]
    B, S = r.shape
    if B * S * T == 0:
        return torch.zeros(B, T, device=r.device)
    valid = torch.ones(B, S, dtype=torch.bool, device=r.device) if step_mask is None else step_mask.bool()  # [B, S]
    if index is None:
        ids, G = torch.arange(B, device=r.device) // group_size, B // group_size  # [B]
    else:
        _, ids = torch.unique(index, return_inverse=True)  # [B] in 0..G-1
        G = int(ids.max()) + 1
    flat = ids[:, None].expand(B, S).reshape(-1)  # [B·S]: the group of each step
    v = valid.reshape(-1)  # [B·S]
    x = torch.where(v, r.reshape(-1), 0.0)  # [B·S]; where, not a product: an invalid NaN stays out
    zeros = torch.zeros(G, dtype=torch.float64, device=r.device)  # [G]
    n = zeros.index_add(0, flat, v.double())  # [G] valid steps per group
    mean = zeros.index_add(0, flat, x) / n.clamp(min=1.0)  # [G]
    d = torch.where(v, x - mean[flat], 0.0)  # [B·S]
    ssq = zeros.index_add(0, flat, d * d)  # [G]
    hi = torch.full_like(zeros, -float("inf")).scatter_reduce(0, flat, torch.where(v, x, -float("inf")), "amax")
    lo = torch.full_like(zeros, float("inf")).scatter_reduce(0, flat, torch.where(v, x, float("inf")), "amin")
    has_nan = zeros.index_add(0, flat, (v & torch.isnan(x)).double()) > 0  # [G]
    constant = ((hi == lo) & ~has_nan) | (n < 2)  # [G]: exactly 0, whatever the rounding of the mean
    scale = 1.0 / (torch.sqrt(ssq / (n - 1).clamp(min=1)) + eps) if mode == "grpo" else torch.ones_like(n)  # [G]
    norm = torch.where(v & ~constant[flat], d * scale[flat], 0.0).view(B, S)  # [B, S]
    at_end = torch.zeros(B, T, dtype=torch.float64, device=r.device).scatter_add(
        1, torch.where(valid, step_ends, 0).long(), norm)  # [B, T]
    return at_end.flip(1).cumsum(1).flip(1).float()  # [B, T]: Σ of the steps ending at or after t


@jit
def _process_steps(r_ptr, m_ptr, row, row_ok, s0, S, stride_rb, stride_rs, stride_mb, stride_ms, BLOCK_S: tl.constexpr):
    """The steps ``[s0, s0 + BLOCK_S)`` of rows ``row`` (``[BLOCK_R]``, in range where ``row_ok``): their indices
    ``[BLOCK_S]``, which are valid (``[BLOCK_R, BLOCK_S]``) and their rewards in float32 (0 where not valid)."""
    s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    inb = row_ok[:, None] & (s < S)[None, :]  # [BLOCK_R, BLOCK_S]
    row64, s64 = row.to(tl.int64), s.to(tl.int64)
    x = tl.load(r_ptr + row64[:, None] * stride_rb + s64[None, :] * stride_rs, mask=inb, other=0.0).to(tl.float32)
    w = inb & (tl.load(m_ptr + row64[:, None] * stride_mb + s64[None, :] * stride_ms, mask=inb, other=0) != 0)
    return s, w, tl.where(w, x, 0.0)


@jit
def _process_rows(perm_ptr, off, hi, HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr):
    """The group's rows at positions ``[off, off + BLOCK_R)`` of its run (``[BLOCK_R]``) and which exist."""
    i = off + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    ok = i < hi
    row = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int32) if HAS_INDEX else i
    return row, ok


@jit
def _process_kernel(
    r_ptr, e_ptr, m_ptr,  # [B, S] step rewards (float), step ends (int64), step mask (uint8), strided
    out_ptr,  # [B, T] float32, contiguous
    perm_ptr, starts_ptr,  # [B], [G + 1] int64 (read only with HAS_INDEX)
    S, T, group_size, eps,
    stride_rb, stride_rs, stride_eb, stride_es, stride_mb, stride_ms,
    STD: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # program (g, j): group g's statistics (recomputed by every j: they are group_size·S loads, cached), then
    # tokens [j·BLOCK_T, (j+1)·BLOCK_T) of each of the group's rows
    g = tl.program_id(0)
    j = tl.program_id(1)
    if HAS_INDEX:
        lo = tl.load(starts_ptr + g).to(tl.int32)
        hi = tl.load(starts_ptr + g + 1).to(tl.int32)
    else:
        lo = g * group_size
        hi = lo + group_size
    cnt = tl.full([BLOCK_R, BLOCK_S], 0.0, tl.float32)
    nan = tl.full([BLOCK_R, BLOCK_S], 0.0, tl.float32)
    big = tl.full([BLOCK_R, BLOCK_S], float("inf"), tl.float32)
    top = -big  # running max of the valid rewards
    neg = -big  # running max of their negations (-min)
    for off in range(lo, hi, BLOCK_R):  # pass 1: count, max, min, NaNs
        row, row_ok = _process_rows(perm_ptr, off, hi, HAS_INDEX, BLOCK_R)
        for s0 in range(0, S, BLOCK_S):
            s, w, x = _process_steps(r_ptr, m_ptr, row, row_ok, s0, S, stride_rb, stride_rs, stride_mb, stride_ms, BLOCK_S)
            cnt += w.to(tl.float32)
            nan += tl.where(w & (x != x), 1.0, 0.0)
            top = tl.maximum(top, tl.where(w, x, -big))
            neg = tl.maximum(neg, tl.where(w, -x, -big))
    n = block_sum(block_sum(cnt, 1), 0)
    top_g = block_max(block_max(top, 1), 0)
    min_g = -block_max(block_max(neg, 1), 0)
    # the statistics of r·down (see _group_scales: 1 unless |r| passes 2**32 or is below 2**-32), scaled back by up
    down, up = _group_scales(tl.maximum(top_g, -min_g))
    # relative to a pivot, the group's largest valid reward (0 where that is ±inf, or where there is none): a float32
    # mean of rewards far from 0 is off by up to half their ulp, all of the spread of 1e4 + 1e-3 noise; the mean of
    # r·down - pivot is exact to float32 rounding of the spread (and never overflows: |r·down| < 4 past 2**32)
    pivot = tl.where(tl.abs(top_g) < float("inf"), top_g, 0.0) * down
    acc = tl.full([BLOCK_R, BLOCK_S], 0.0, tl.float32)
    for off in range(lo, hi, BLOCK_R):  # pass 1b: Σ(r·down - pivot)
        row, row_ok = _process_rows(perm_ptr, off, hi, HAS_INDEX, BLOCK_R)
        for s0 in range(0, S, BLOCK_S):
            s, w, x = _process_steps(r_ptr, m_ptr, row, row_ok, s0, S, stride_rb, stride_rs, stride_mb, stride_ms,
                                     BLOCK_S)
            acc += tl.where(w, x * down - pivot, 0.0)
    mean = block_sum(block_sum(acc, 1), 0) / tl.maximum(n, 1.0)  # the mean of r·down - pivot
    constant = ((top_g == min_g) & (block_sum(block_sum(nan, 1), 0) == 0.0)) | (n < 2.0)
    ssq = tl.full([BLOCK_R, BLOCK_S], 0.0, tl.float32)
    if STD:
        for off in range(lo, hi, BLOCK_R):  # pass 2: Σ(r - mean)², exact where Σr² - n·mean² is not
            row, row_ok = _process_rows(perm_ptr, off, hi, HAS_INDEX, BLOCK_R)
            for s0 in range(0, S, BLOCK_S):
                s, w, x = _process_steps(r_ptr, m_ptr, row, row_ok, s0, S, stride_rb, stride_rs, stride_mb, stride_ms, BLOCK_S)
                d = tl.where(w, x * down - pivot - mean, 0.0)
                ssq += d * d
        # (r - mean)/(std + eps) = (r·down - mean·down)/(std·down + eps·down)
        scale = 1.0 / (tl.sqrt(block_sum(block_sum(ssq, 1), 0) / tl.maximum(n - 1.0, 1.0)) + eps * down)
    else:
        scale = up
    scale = tl.where(constant, 0.0, scale)  # a constant group: every normalised reward is exactly 0
    t = j * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_ok = t < T
    for off in range(lo, hi, BLOCK_R):  # pass 3: token t sums the normalised rewards of its row's steps ending >= t
        row, row_ok = _process_rows(perm_ptr, off, hi, HAS_INDEX, BLOCK_R)
        adv = tl.full([BLOCK_R, BLOCK_T], 0.0, tl.float32)
        for s0 in range(0, S, BLOCK_S):
            s, w, x = _process_steps(r_ptr, m_ptr, row, row_ok, s0, S, stride_rb, stride_rs, stride_mb, stride_ms, BLOCK_S)
            end = tl.load(e_ptr + row.to(tl.int64)[:, None] * stride_eb + s.to(tl.int64)[None, :] * stride_es, mask=w, other=-1)
            # [BLOCK_R, BLOCK_S]; a constant group's steps exactly 0 (its inf or lone NaN too, as in the reference:
            # scale 0 alone made (inf - inf)·0 NaN); elsewhere NaN stays NaN
            z = tl.where(w & (constant == 0), (x * down - pivot - mean) * scale, 0.0)
            covers = end[:, None, :] >= t[None, :, None]  # [BLOCK_R, BLOCK_T, BLOCK_S]
            adv += block_sum(tl.where(covers, z[:, None, :], 0.0), 2)
        offs = row.to(tl.int64)[:, None] * T + t[None, :]
        tl.store(out_ptr + offs, adv, mask=row_ok[:, None] & t_ok[None, :])


# (BLOCK_R, BLOCK_S, BLOCK_T, num_warps) by the number of steps: few steps, a longer token block
# (the first on 8 warps: on 4, triton 3.6's sm_80 build of the index-given kernel, held to 128 registers, spilled
# 8 B once the kernel gained its scaled pass for rewards past 2**32)
_PROCESS_CONFIGS = ((8, 8, 64, 8), (8, 32, 16, 4))


def _process_config(S: int) -> tuple[int, int, int, int]:
    return _PROCESS_CONFIGS[0] if S <= 8 else _PROCESS_CONFIGS[1]


def _process_triton(step_rewards, step_ends, step_mask, T, group_size, index, mode, eps):
    r = step_rewards.float()  # [B, S]: step rewards are tiny, one float32 copy is free (and one kernel dtype to build)
    B, S = r.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=r.device)  # [B, T]
    if B * S * T == 0:
        return out
    if B >= 2**31:
        raise ValueError(f"step_rewards has {B} rows; the Triton kernel indexes rows with int32 (fewer than 2**31)")
    e = step_ends.long()  # [B, S]
    m = _host.mask_u8(step_mask) if step_mask is not None else torch.ones(B, S, dtype=torch.uint8, device=r.device)  # [B, S]
    perm, starts, _ = _group_layout(r[:, 0], group_size, index)  # [B] or [0], [G + 1]
    block_r, block_s, block_t, warps = _process_config(S)
    kwargs = {"num_warps": warps} if r.is_cuda else {}
    _process_kernel.launch(
        (starts.numel() - 1, cdiv(T, block_t)), r, e, m, out, perm if index is not None else starts, starts,
        S, T, group_size or 0, float(eps), r.stride(0), r.stride(1), e.stride(0), e.stride(1), m.stride(0), m.stride(1),
        STD=mode == "grpo", HAS_INDEX=index is not None, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_T=block_t, **kwargs,
    )
    return out


def _process_aot_configs():
    """Every (kernel, constexprs, warps) :func:`_process_triton` can pick (part of :func:`aot_configs`)."""
    from rlkernels.testing.aot import KernelConfig

    configs = []
    for name in ("fp32",):  # the launcher widens the step rewards to float32
        sig = {
            "r_ptr": "*" + name, "e_ptr": "*i64", "m_ptr": "*u8", "out_ptr": "*fp32", "perm_ptr": "*i64", "starts_ptr": "*i64",
            "S": "i32", "T": "i32", "group_size": "i32", "eps": "fp32", "stride_rb": "i32", "stride_rs": "i32",
            "stride_eb": "i32", "stride_es": "i32", "stride_mb": "i32", "stride_ms": "i32", "STD": "constexpr",
            "HAS_INDEX": "constexpr", "BLOCK_R": "constexpr", "BLOCK_S": "constexpr", "BLOCK_T": "constexpr",
        }
        for block_r, block_s, block_t, warps in _PROCESS_CONFIGS:
            for std in (True, False):
                for has_index in (False, True):
                    consts = {"STD": std, "HAS_INDEX": has_index, "BLOCK_R": block_r, "BLOCK_S": block_s, "BLOCK_T": block_t}
                    configs.append(KernelConfig(_process_kernel, sig, consts, num_warps=warps))
    return configs


_PROCESS_IMPLS = {
    "reference": lambda r, e, m, T, group_size, index, mode, eps: reference.process_advantages(
        r, e, T, step_mask=m, group_size=group_size, index=index, mode=mode, eps=eps),
    "torch": _process_torch,
    "triton": _process_triton,
}


@_host.custom_op("rlkernels::process_advantages")
def _process_op(step_rewards: torch.Tensor, step_ends: torch.Tensor, step_mask: torch.Tensor | None, T: int,
                group_size: int | None, index: torch.Tensor | None, mode: str, eps: float) -> torch.Tensor:
    backend = backends.resolve(step_rewards.device, _PROCESS_SUPPORTED, step_rewards.dtype)
    with backends.float32_compute(step_rewards.device):
        out = _PROCESS_IMPLS[backend](step_rewards, step_ends, step_mask, T, group_size, index, mode, eps)  # [B, T]
        return out.float().contiguous()


@_process_op.register_fake
def _(step_rewards, step_ends, step_mask, T, group_size, index, mode, eps):
    return step_rewards.new_empty((step_rewards.shape[0], T), dtype=torch.float32)


def process_advantages(
    step_rewards: torch.Tensor,  # [B, S]
    step_ends: torch.Tensor,  # [B, S] integer
    T: int,
    *,
    step_mask: torch.Tensor | None = None,  # [B, S] bool or 0/1
    group_size: int | None = None,
    index: torch.Tensor | None = None,  # [B] integer group ids
    mode: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages under process supervision (DeepSeekMath §4.1.3), float32 ``[B, T]``.

    Each of the ``B`` completions (rows) has up to ``S`` reasoning steps, padded: step ``s`` of row ``b`` has
    reward ``step_rewards[b, s]`` and ends at response token ``step_ends[b, s]`` (0-based, ``< T``); steps
    where ``step_mask`` is 0 are padding. Every valid step reward is normalised with the mean and the
    unbiased std of ALL valid step rewards of its group (the rows of one prompt): ``grpo``:
    ``(r - mean)/(std + eps)`` (the convention and ``eps`` of :func:`group_advantages`); ``dr_grpo``:
    ``r - mean``. Token ``t`` of row ``b`` then gets the sum of the normalised rewards of row ``b``'s steps
    that end at or after ``t``: ``A[b, t] = Σ_{s valid, step_ends[b, s] >= t} r̃[b, s]``. Tokens after a row's
    last step end get 0. A group with fewer than two valid steps, and every step of a group whose valid step
    rewards are all equal, contributes exactly 0; NaN stays inside its group. With one step per row ending at
    its last token this is :func:`group_advantages` broadcast over the tokens up to that end. Computed in
    float32 for any float input dtype; no gradient (inputs are detached).

    Args:
        step_rewards: ``[B, S]`` float tensor, the reward of each step (any float dtype; padded entries are
            never read into an output, even NaN).
        step_ends: ``[B, S]`` integer tensor, the response-token index at which each step ends. Every valid
            step's end must lie in ``[0, T)``; ends need not be sorted, and several steps may end at one token.
        T: the response length of the output ``[B, T]`` (e.g. the trainer's padded response length).
        step_mask: ``[B, S]`` bool or 0/1 numeric tensor, nonzero at real steps; ``None``: every step is real.
        group_size: rows ``[g·group_size, (g+1)·group_size)`` form group ``g``; a positive int dividing ``B``.
            Give it or ``index``, not both.
        index: ``[B]`` integer tensor of group ids (e.g. the prompt id of each row); rows with equal ids form
            a group, wherever they sit.
        mode: ``"grpo"`` (z-score, DeepSeekMath) or ``"dr_grpo"`` (mean-centred only).
        eps: added to the std in ``grpo`` mode; finite and ``>= 0``.

    Returns:
        float32 ``[B, T]`` token advantages on the device of ``step_rewards``.

    Raises:
        TypeError: non-float ``step_rewards``, non-integer ``step_ends``/``index``, a ``step_mask`` of another
            dtype, non-int ``T``/``group_size``, non-number ``eps``.
        ValueError: ``step_rewards`` not 2-D, mismatched shapes or devices, both or neither of
            ``group_size``/``index``, ``group_size`` <= 0 or not dividing ``B``, a negative ``T``, a valid step
            ending outside ``[0, T)`` (named ``step_ends``, with its row and step), an unknown ``mode``, a
            negative, NaN or infinite ``eps``.
    """
    T, group_size, mode, eps = _validate_process(step_rewards=step_rewards, step_ends=step_ends, T=T, step_mask=step_mask,
                                                 group_size=group_size, index=index, mode=mode, eps=eps)
    detach = lambda x: None if x is None else x.detach()  # noqa: E731
    # step_ends as int64: any integer dtype is accepted, and the backends index and compare with it
    return _host.call(_process_op, step_rewards.detach(), step_ends.detach().long(), detach(step_mask), T, group_size,
                      detach(index), mode, eps)
