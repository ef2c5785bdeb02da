"""Advantage estimation: GAE by a parallel reverse scan, group-relative advantages and masked whitening.

Every op has four implementations, picked per call (see :func:`_backend`):

- ``reference``: :mod:`rlkernels.reference` (a Python loop over tokens / groups);
- ``torch``: vectorized PyTorch, no Python loop over tokens (GAE in chunks of
  ``_TORCH_CHUNK`` tokens: a weight matrix inside each chunk, a short carry
  across chunks);
- ``triton``: Triton kernels (interpreted on CPU tensors);
- ``csrc``: the compiled extension (``csrc/``), C++ on CPU, CUDA on GPUs.

Defaults: CPU tensors -> ``csrc`` when the extension loads, else ``torch``;
CUDA tensors -> ``triton`` (the csrc CUDA kernels are an alternative, not
measured against Triton yet). ``RLKERNELS_BACKEND`` forces one.

GAE as a scan. Walking backwards, the state is ``(A, V)``: the advantage and
the value of the next valid token. A valid token t maps it to
``(r_t - v_t + γ·V + γλ·A, v_t)``; a masked token is the identity (it is
transparent). Both are affine maps ``A' = αA + βV + c, V' = ζV + e``, closed
under composition, so the advantages are an associative scan of 5-tuples
``(α, β, c, ζ, e)`` applied to the state ``(0, 0)`` past the end.

The outputs are constants: no op here has a gradient. Inputs that require grad
are detached. All ops return float32.
"""
from __future__ import annotations

import functools

import torch

from rlkernels import _backend as backends
from rlkernels import _checks, _extension, reference
from rlkernels._triton import HAS_TRITON, cdiv, jit, tl

GROUP_MODES = ("grpo", "dr_grpo", "rloo")
_MODE_ID = {m: i for i, m in enumerate(GROUP_MODES)}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# ---------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    # Only builtins of triton.language plus our own @jit helpers: the library's
    # @jit functions (tl.sum, tl.zeros, ...) cannot run under the interpreter
    # when it is entered per call (see rlkernels._triton), so reductions go
    # through tl.reduce with a local combine function.

    @jit
    def _add(a, b):
        return a + b

    @jit
    def _compose(a1, b1, c1, z1, e1, a2, b2, c2, z2, e2):
        # (a1..e1) is applied first (the later tokens), then (a2..e2):
        # A'' = a2(a1 A + b1 V + c1) + b2(z1 V + e1) + c2,  V'' = z2(z1 V + e1) + e2
        return a2 * a1, a2 * b1 + b2 * z1, a2 * c1 + b2 * e1 + c2, z2 * z1, z2 * e1 + e2

    @jit
    def _gae_kernel(
        r_ptr, v_ptr, m_ptr,  # [B, T] inputs (strided), m: uint8
        adv_ptr, ret_ptr,  # [B, T] float32 outputs (contiguous)
        B, T,
        stride_rb, stride_rt, stride_vb, stride_vt, stride_mb, stride_mt,
        gamma, lam,
        BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        row_ok = rows < B
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_T)  # [BLOCK_T]; column j of a block is token (end - 1 - j)
        gl = gamma * lam
        carry_a = tl.full([BLOCK_B], 0.0, tl.float32)  # A of the next valid token (0 past the end)
        carry_v = tl.full([BLOCK_B], 0.0, tl.float32)  # V of the next valid token (0 past the end)
        for start in range(0, T, BLOCK_T):
            t = T - 1 - start - cols  # [BLOCK_T], descending: a forward scan walks backwards in time
            inb = row_ok[:, None] & (t >= 0)[None, :]  # [BLOCK_B, BLOCK_T]
            t64 = t.to(tl.int64)
            r = tl.load(r_ptr + rows64[:, None] * stride_rb + t64[None, :] * stride_rt, mask=inb, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + rows64[:, None] * stride_vb + t64[None, :] * stride_vt, mask=inb, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + rows64[:, None] * stride_mb + t64[None, :] * stride_mt, mask=inb, other=0)
            valid = inb & (m != 0)
            one = tl.full([BLOCK_B, BLOCK_T], 1.0, tl.float32)
            zero = tl.full([BLOCK_B, BLOCK_T], 0.0, tl.float32)
            # a masked or out-of-range token is the identity map (1, 0, 0, 1, 0)
            al = tl.where(valid, one * gl, one)
            be = tl.where(valid, one * gamma, zero)
            c = tl.where(valid, r - v, zero)
            ze = tl.where(valid, zero, one)
            e = tl.where(valid, v, zero)
            al, be, c, ze, e = tl.associative_scan((al, be, c, ze, e), 1, _compose)
            a_out = al * carry_a[:, None] + be * carry_v[:, None] + c  # [BLOCK_B, BLOCK_T]
            v_out = ze * carry_v[:, None] + e
            adv = tl.where(valid, a_out, zero)
            offs = rows64[:, None] * T + t64[None, :]
            tl.store(adv_ptr + offs, adv, mask=inb)
            tl.store(ret_ptr + offs, adv + v, mask=inb)
            # the last column composes the whole block (out-of-range columns are identities)
            last = (cols == BLOCK_T - 1)[None, :]
            carry_a = tl.reduce(tl.where(last, a_out, zero), 1, _add)
            carry_v = tl.reduce(tl.where(last, v_out, zero), 1, _add)

    @jit
    def _group_kernel(
        s_ptr, out_ptr,  # [N] float32
        perm_ptr, starts_ptr,  # [N], [G + 1] int64 (read only with HAS_INDEX)
        group_size, eps,
        MODE: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr,
    ):
        g = tl.program_id(0)
        if HAS_INDEX:  # int32 positions (the launcher checks N < 2**31): int64 loop state spills
            lo = tl.load(starts_ptr + g).to(tl.int32)
            hi = tl.load(starts_ptr + g + 1).to(tl.int32)
            first = tl.load(s_ptr + tl.load(perm_ptr + lo))
        else:
            lo = g * group_size
            hi = lo + group_size
            first = tl.load(s_ptr + lo)
        n = (hi - lo).to(tl.float32)
        offs = tl.arange(0, BLOCK)
        acc = tl.full([BLOCK], 0.0, tl.float32)
        differ = tl.full([BLOCK], 0, tl.int32)
        for off in range(lo, hi, BLOCK):  # pass 1: sum, and whether every member equals the first
            i = off + offs
            ok = i < hi
            src = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int32) if HAS_INDEX else i
            x = tl.load(s_ptr + src, mask=ok, other=0.0)
            acc += x
            differ += tl.where(ok & (x != first), 1, 0)  # NaN != NaN: a group with NaN is never constant
        mean = tl.reduce(acc, 0, _add) / n
        constant = (tl.reduce(differ, 0, _add) == 0) | (n < 2.0)
        ssq = tl.full([BLOCK], 0.0, tl.float32)
        for off in range(lo, hi, BLOCK):  # pass 2: Σ(s - mean)², exact where Σs² - n·mean² is not
            i = off + offs
            ok = i < hi
            src = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int32) if HAS_INDEX else i
            x = tl.load(s_ptr + src, mask=ok, other=0.0)
            d = x - mean
            ssq += tl.where(ok, d * d, 0.0)
        if MODE == 0:
            scale = 1.0 / (tl.sqrt(tl.reduce(ssq, 0, _add) / tl.maximum(n - 1.0, 1.0)) + eps)
        elif MODE == 1:
            scale = n * 0.0 + 1.0
        else:
            scale = n / tl.maximum(n - 1.0, 1.0)  # s - (Σs - s)/(n-1) = n/(n-1)·(s - mean)
        for off in range(lo, hi, BLOCK):  # pass 3: write
            i = off + offs
            ok = i < hi
            src = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int32) if HAS_INDEX else i
            x = tl.load(s_ptr + src, mask=ok, other=0.0)
            y = tl.where(constant, 0.0, (x - mean) * scale)
            tl.store(out_ptr + src, y, mask=ok)

    @jit
    def _add2(a1, b1, a2, b2):
        return a1 + a2, b1 + b2

    @jit
    def _min(a, b):
        return tl.minimum(a, b)

    @jit
    def _whiten_partial_kernel(
        x_ptr, m_ptr,  # [N] (x any float dtype, m uint8)
        part_ptr,  # [P, 4] float32: count, pivot K, mean of (x - K), M2 of each program's share
        N,
        BLOCK: tl.constexpr,
    ):
        # Shifted data: a float32 mean of values near 1e6 is only known to ~0.03, so deviations
        # around it (and Chan merges of such means) carry that error into M2 and the output.
        # Everything is therefore kept relative to a pivot K, the program's first masked-in
        # value: x - K is exact (Sterbenz) for data near K, the mean is K + mean(x - K) with
        # no rounding of K + ..., and a shift of all data only shifts K.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)  # [BLOCK]
        cnt = 0.0
        piv = 0.0
        mean = 0.0  # of (x - piv)
        m2 = 0.0
        for start in range(pid * BLOCK, N, nprog * BLOCK):
            i = start + offs  # [BLOCK]
            ok = i < N
            x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
            w = ok & (tl.load(m_ptr + i, mask=ok, other=0) != 0)  # [BLOCK]
            if cnt == 0.0:  # no pivot yet: take this block's first masked-in value (if any)
                first = tl.reduce(tl.where(w, offs, BLOCK), 0, _min)
                piv = tl.load(x_ptr + start + first, mask=first < BLOCK, other=0.0).to(tl.float32)
            y = tl.where(w, x - piv, 0.0)  # [BLOCK]; where, not a product: masked-out NaN/inf stay out
            c_b, s_b = tl.reduce((w.to(tl.float32), y), 0, _add2)
            mean_b = s_b / tl.maximum(c_b, 1.0)
            d = tl.where(w, y - mean_b, 0.0)  # [BLOCK]
            sd, sdd = tl.reduce((d, d * d), 0, _add2)
            # corrected two-pass: Σd² - (Σd)²/c removes what the rounding of mean_b adds to M2
            m2_b = sdd - sd * sd / tl.maximum(c_b, 1.0)
            # Chan et al.'s merge of (cnt, mean, m2) with the block's (c_b, mean_b, m2_b), same pivot
            total = cnt + c_b
            delta = mean_b - mean
            frac = c_b / tl.maximum(total, 1.0)
            mean = mean + delta * frac
            m2 = m2 + m2_b + delta * delta * cnt * frac
            cnt = total
        tl.store(part_ptr + pid * 4 + 0, cnt)
        tl.store(part_ptr + pid * 4 + 1, piv)
        tl.store(part_ptr + pid * 4 + 2, mean)
        tl.store(part_ptr + pid * 4 + 3, m2)

    @jit
    def _whiten_apply_kernel(
        x_ptr, out_ptr,  # [N] in, [N] float32 out
        part_ptr,  # [P, 4]
        N, P, eps,
        SHIFT_MEAN: tl.constexpr, BLOCK: tl.constexpr, P_BLOCK: tl.constexpr,
    ):
        # Every program merges the P partial moments itself: P is small, and it saves a launch.
        # The partials have their own pivots; all are re-expressed relative to K0, the pivot of
        # the first non-empty partial (K_j - K0 is a difference of two data values: exact
        # or nearly so), so the global mean is K0 + mean and is never rounded to float32.
        j = tl.arange(0, P_BLOCK)  # [P_BLOCK]
        pj = j < P
        cnt_j = tl.load(part_ptr + j * 4 + 0, mask=pj, other=0.0)  # [P_BLOCK]
        piv_j = tl.load(part_ptr + j * 4 + 1, mask=pj, other=0.0)
        mean_j = tl.load(part_ptr + j * 4 + 2, mask=pj, other=0.0)
        m2_j = tl.load(part_ptr + j * 4 + 3, mask=pj, other=0.0)
        has = cnt_j > 0
        j0 = tl.reduce(tl.where(has, j, P_BLOCK), 0, _min)
        k0 = tl.reduce(tl.where(j == j0, piv_j, 0.0), 0, _add)  # 0 when no entry is masked in
        off_j = tl.where(has, (piv_j - k0) + mean_j, 0.0)  # [P_BLOCK]: each share's mean - K0
        cnt, s = tl.reduce((cnt_j, cnt_j * off_j), 0, _add2)
        mean = s / tl.maximum(cnt, 1.0)
        dm = tl.where(has, off_j - mean, 0.0)
        m2a, m2b = tl.reduce((m2_j, cnt_j * dm * dm), 0, _add2)
        var = (m2a + m2b) / tl.maximum(cnt - 1.0, 1.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        for start in range(pid * BLOCK, N, nprog * BLOCK):
            i = start + offs
            ok = i < N
            x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
            y = ((x - k0) - mean) * rstd
            if not SHIFT_MEAN:
                y = y + (k0 + mean)
            tl.store(out_ptr + i, y, mask=ok)


# ---------------------------------------------------------------- launchers

# (BLOCK_B, BLOCK_T, num_warps) by T: short rows share a program, long rows loop over blocks.
_GAE_CONFIGS = ((16, 64, 8), (4, 256, 8), (1, 2048, 8))
_GROUP_BLOCKS = ((32, 1), (256, 4))  # (BLOCK, num_warps)
_WHITEN_BLOCK, _WHITEN_WARPS, _WHITEN_P_BLOCK = 2048, 8, 1024


def _gae_config(T: int) -> tuple[int, int, int]:
    if T <= 64:
        return _GAE_CONFIGS[0]
    if T <= 256:
        return _GAE_CONFIGS[1]
    return _GAE_CONFIGS[2]


def _group_block(group_size: int | None) -> tuple[int, int]:
    return _GROUP_BLOCKS[0] if group_size is not None and group_size <= 32 else _GROUP_BLOCKS[1]


def _mask_u8(mask: torch.Tensor) -> torch.Tensor:  # bool -> uint8 view (no copy); numeric -> != 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    if mask.dtype == torch.uint8:
        return mask
    return (mask != 0).view(torch.uint8)


def _kernel_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One dtype the kernels read natively (float32/bf16/fp16); anything else goes to float32."""
    dtypes = {x.dtype for x in xs}
    if len(dtypes) == 1 and xs[0].dtype in _KERNEL_DTYPES:
        return xs
    return tuple(x.float() for x in xs)


def _gae_triton(rewards, values, mask, gamma, lam):
    r, v = _kernel_inputs(rewards, values)  # [B, T]
    m = _mask_u8(mask)  # [B, T]
    B, T = r.shape
    adv = torch.empty(B, T, dtype=torch.float32, device=r.device)
    ret = torch.empty_like(adv)
    if B * T == 0:
        return adv, ret
    block_b, block_t, warps = _gae_config(T)
    kwargs = {"num_warps": warps} if r.is_cuda else {}
    _gae_kernel.launch(
        (cdiv(B, block_b),), r, v, m, adv, ret, B, T,
        r.stride(0), r.stride(1), v.stride(0), v.stride(1), m.stride(0), m.stride(1),
        float(gamma), float(lam), BLOCK_B=block_b, BLOCK_T=block_t, **kwargs,
    )
    return adv, ret



def _group_layout(scores: torch.Tensor, group_size: int | None, index: torch.Tensor | None):
    """``(perm, starts)`` describing the groups: group g holds ``perm[starts[g]:starts[g+1]]``.

    Contiguous groups need no permutation (``perm`` is empty). Arbitrary ids are
    mapped to 0..G-1 (``torch.unique``) and sorted stably, so each group is one
    contiguous run of ``perm``.
    """
    N = scores.shape[0]
    device = scores.device
    if index is None:
        G = N // group_size
        starts = torch.arange(G + 1, device=device, dtype=torch.int64) * group_size  # [G + 1]
        return torch.empty(0, dtype=torch.int64, device=device), starts
    _, inverse, counts = torch.unique(index, return_inverse=True, return_counts=True)  # [N], [G]
    perm = torch.argsort(inverse, stable=True)  # [N]
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=device)  # [G + 1]
    torch.cumsum(counts, 0, out=starts[1:])
    return perm, starts


def _group_triton(scores, group_size, index, mode, eps):
    s = scores.float().contiguous()  # [N]: sequence scores are tiny, one float32 copy is free
    N = s.shape[0]
    if N >= 2**31:
        raise ValueError(f"scores has {N} entries; the Triton kernel indexes with int32 (fewer than 2**31)")
    out = torch.empty_like(s)
    if N == 0:
        return out
    perm, starts = _group_layout(s, group_size, index)
    block, warps = _group_block(group_size if index is None else None)
    kwargs = {"num_warps": warps} if s.is_cuda else {}
    G = starts.numel() - 1
    _group_kernel.launch(
        (G,), s, out, perm if index is not None else starts, starts, group_size or 0, float(eps),
        MODE=_MODE_ID[mode], HAS_INDEX=index is not None, BLOCK=block, **kwargs,
    )
    return out


def _whiten_triton(x, mask, shift_mean, eps):
    (xf,) = _kernel_inputs(x)
    xf = xf.reshape(-1)  # [N]
    m = _mask_u8(mask).reshape(-1)  # [N]
    N = xf.numel()
    out = torch.empty(N, dtype=torch.float32, device=x.device)
    if N == 0:
        return out.view(x.shape)
    blocks = cdiv(N, _WHITEN_BLOCK)
    # a few programs on the CPU (the interpreter runs them one by one), enough to fill a GPU there
    P = min(blocks, _WHITEN_P_BLOCK if x.is_cuda else 4)
    part = torch.empty(P, 4, dtype=torch.float32, device=x.device)  # [P, 4]: count, pivot, mean - pivot, M2
    kwargs = {"num_warps": _WHITEN_WARPS} if x.is_cuda else {}
    _whiten_partial_kernel.launch((P,), xf, m, part, N, BLOCK=_WHITEN_BLOCK, **kwargs)
    _whiten_apply_kernel.launch(
        (P,), xf, out, part, N, P, float(eps),
        SHIFT_MEAN=bool(shift_mean), BLOCK=_WHITEN_BLOCK, P_BLOCK=_WHITEN_P_BLOCK, **kwargs,
    )
    return out.view(x.shape)


def aot_configs():
    """Every (kernel, constexprs, warps) the Triton launchers above can pick, for AOT compile tests."""
    from rlkernels._aot import KernelConfig

    configs = []
    for dtype in _KERNEL_DTYPES:
        ty = "*" + _TRITON_TYPE[dtype]
        for block_b, block_t, warps in _GAE_CONFIGS:
            sig = {
                "r_ptr": ty, "v_ptr": ty, "m_ptr": "*u8", "adv_ptr": "*fp32", "ret_ptr": "*fp32", "B": "i32", "T": "i32",
                "stride_rb": "i32", "stride_rt": "i32", "stride_vb": "i32", "stride_vt": "i32",
                "stride_mb": "i32", "stride_mt": "i32", "gamma": "fp32", "lam": "fp32",
                "BLOCK_B": "constexpr", "BLOCK_T": "constexpr",
            }
            configs.append(KernelConfig(_gae_kernel, sig, {"BLOCK_B": block_b, "BLOCK_T": block_t}, num_warps=warps))
        sig = {"x_ptr": ty, "m_ptr": "*u8", "part_ptr": "*fp32", "N": "i32", "BLOCK": "constexpr"}
        configs.append(KernelConfig(_whiten_partial_kernel, sig, {"BLOCK": _WHITEN_BLOCK}, num_warps=_WHITEN_WARPS))
        for shift in (True, False):
            sig = {
                "x_ptr": ty, "out_ptr": "*fp32", "part_ptr": "*fp32", "N": "i32", "P": "i32", "eps": "fp32",
                "SHIFT_MEAN": "constexpr", "BLOCK": "constexpr", "P_BLOCK": "constexpr",
            }
            consts = {"SHIFT_MEAN": shift, "BLOCK": _WHITEN_BLOCK, "P_BLOCK": _WHITEN_P_BLOCK}
            configs.append(KernelConfig(_whiten_apply_kernel, sig, consts, num_warps=_WHITEN_WARPS))
    for mode in GROUP_MODES:
        for has_index, (block, warps) in ((False, _GROUP_BLOCKS[0]), (False, _GROUP_BLOCKS[1]), (True, _GROUP_BLOCKS[1])):
            sig = {
                "s_ptr": "*fp32", "out_ptr": "*fp32", "perm_ptr": "*i64", "starts_ptr": "*i64", "group_size": "i32",
                "eps": "fp32", "MODE": "constexpr", "HAS_INDEX": "constexpr", "BLOCK": "constexpr",
            }
            consts = {"MODE": _MODE_ID[mode], "HAS_INDEX": has_index, "BLOCK": block}
            configs.append(KernelConfig(_group_kernel, sig, consts, num_warps=warps))
    return configs


# ---------------------------------------------------------------- vectorized PyTorch

_TORCH_CHUNK = 32


def _gae_torch(rewards, values, mask, gamma, lam):
    """Loop-free inside chunks of C tokens, a loop of T/C steps across them.

    Inside a chunk, ``S_t = Σ_{valid s ≥ t} (γλ)^{k(t,s)} δ_s`` with ``k(t,s)`` the
    number of valid tokens in ``[t, s)``: one small batched matmul. Across chunks
    the state carries as ``S_t += (γλ)^{k(t, end)} · S_end``.
    """
    r, v = rewards.float(), values.float()  # [B, T]
    valid = mask.bool()  # [B, T]
    B, T = r.shape
    if B * T == 0:
        return torch.zeros_like(r), torch.zeros_like(r)
    dev = r.device
    pos = torch.arange(T, device=dev)
    # index of the next valid token strictly after t (T if none): V_next = v[that], 0 past the end
    idx = torch.where(valid, pos, torch.full_like(pos, T))  # [B, T]
    first_at_or_after = torch.flip(torch.cummin(torch.flip(idx, [1]), 1).values, [1])  # [B, T]
    nxt = torch.cat([first_at_or_after[:, 1:], torch.full((B, 1), T, device=dev, dtype=idx.dtype)], 1)  # [B, T]
    v_pad = torch.cat([torch.where(valid, v, torch.zeros_like(v)), torch.zeros(B, 1, device=dev)], 1)  # [B, T + 1]
    v_next = v_pad.gather(1, nxt)  # [B, T]
    delta = torch.where(valid, r + gamma * v_next - v, torch.zeros_like(r))  # [B, T]
    C = _TORCH_CHUNK
    nc = (T + C - 1) // C
    pad = nc * C - T
    d = torch.nn.functional.pad(delta, (0, pad)).view(B, nc, C)  # [B, nc, C]
    w = torch.nn.functional.pad(valid.to(torch.float32), (0, pad)).view(B, nc, C)  # [B, nc, C]
    k = torch.flip(torch.cumsum(torch.flip(w, [2]), 2), [2])  # [B, nc, C]: valid tokens in [t, end of chunk)
    gl = torch.tensor(gamma * lam, dtype=torch.float32, device=dev)
    expo = k.unsqueeze(-1) - k.unsqueeze(-2)  # [B, nc, C(t), C(s)]: k(t) - k(s) = valid tokens in [t, s)
    upper = torch.ones(C, C, dtype=torch.bool, device=dev).triu()  # s >= t
    weights = torch.where(upper, torch.pow(gl, expo.clamp(min=0)), torch.zeros((), device=dev))  # [B, nc, C, C]
    local = (weights @ d.unsqueeze(-1)).squeeze(-1)  # [B, nc, C]
    decay = torch.pow(gl, k)  # [B, nc, C]
    carry = torch.zeros(B, device=dev)  # [B]: S at the start of the chunk after
    carries = torch.empty(B, nc, device=dev)  # [B, nc]
    for c in range(nc - 1, -1, -1):
        carries[:, c] = carry
        carry = local[:, c, 0] + decay[:, c, 0] * carry
    state = local + decay * carries.unsqueeze(-1)  # [B, nc, C]
    adv = torch.where(valid, state.reshape(B, nc * C)[:, :T], torch.zeros_like(r))
    return adv, adv + v


def _group_torch(scores, group_size, index, mode, eps):
    s = scores.float()  # [N]
    N = s.shape[0]
    if N == 0:
        return s.clone()
    if index is None:
        ids = torch.arange(N, device=s.device) // group_size  # [N]
        G = N // group_size
    else:
        _, ids = torch.unique(index, return_inverse=True)  # [N] in 0..G-1
        G = int(ids.max()) + 1
    zeros = torch.zeros(G, device=s.device)
    n = torch.bincount(ids, minlength=G).float()  # [G]
    mean = zeros.index_add(0, ids, s) / n  # [G]
    dev_ = s - mean[ids]  # [N]
    ssq = zeros.index_add(0, ids, dev_ * dev_)  # [G]
    first = torch.full((G,), float("nan"), device=s.device).scatter_reduce(0, ids, s, "amin", include_self=False)
    last = torch.full((G,), float("nan"), device=s.device).scatter_reduce(0, ids, s, "amax", include_self=False)
    has_nan = zeros.index_add(0, ids, torch.isnan(s).float()) > 0
    constant = ((first == last) & ~has_nan) | (n < 2)  # [G]
    if mode == "grpo":
        scale = 1.0 / (torch.sqrt(ssq / (n - 1).clamp(min=1)) + eps)
    elif mode == "dr_grpo":
        scale = torch.ones_like(n)
    else:
        scale = n / (n - 1).clamp(min=1)
    out = dev_ * scale[ids]
    return torch.where(constant[ids], torch.zeros_like(out), out)


def _whiten_torch(x, mask, shift_mean, eps):
    """Statistics of ``x - K`` with ``K`` the first masked-in value (found without a device
    sync): exact for shifted data (``1e6 + noise``), where a float32 mean of ``x`` itself is
    only known to ~ulp(1e6) and the output inherits that error. The mean is never rounded
    to float32 as ``K + mean``: the output is ``((x - K) - mean)·rstd``."""
    xf = x.float().reshape(-1)  # [N]
    m = mask.bool().reshape(-1)  # [N]
    if xf.numel() == 0:
        return xf.view(x.shape).clone()
    n = m.sum().float()
    first = m.to(torch.uint8).argmax().view(1)  # [1]: the first masked-in position (0 if none)
    zero = torch.zeros((), device=xf.device)
    piv = torch.where(n > 0, xf.gather(0, first).squeeze(0), zero)  # where: a NaN at position 0 stays out
    y = torch.where(m, xf - piv, zero)  # [N]
    mean = y.sum() / n.clamp(min=1.0)
    d = torch.where(m, y - mean, zero)  # [N]
    var = (d * d).sum() / (n - 1.0).clamp(min=1.0)
    out = ((xf - piv) - mean) * torch.rsqrt(var + eps)  # [N]
    out = out if shift_mean else out + (piv + mean)
    return out.view(x.shape)


# ---------------------------------------------------------------- csrc


def _csrc_ops():
    ops = _extension.load()
    if ops is None:
        raise RuntimeError(f"the csrc extension is unavailable: {_extension.error()}")
    return ops


def _csrc_supports(device: torch.device) -> bool:
    if device.type == "cpu":
        return _extension.available()
    return device.type == "cuda" and _extension.has_cuda_kernels()


def _gae_csrc(rewards, values, mask, gamma, lam):
    r, v = _kernel_inputs(rewards, values)
    if r.is_cuda:
        r, v = r.contiguous(), v.contiguous()
        m = mask.bool().contiguous()
    else:
        m = mask.bool()
    return tuple(_csrc_ops().gae(r, v, m, float(gamma), float(lam)))


def _group_csrc(scores, group_size, index, mode, eps):
    s = scores.float().contiguous()
    perm, starts = _group_layout(s, group_size, index)
    return _csrc_ops().group_advantages(s, perm, starts, _MODE_ID[mode], float(eps))


def _whiten_csrc(x, mask, shift_mean, eps):
    (xf,) = _kernel_inputs(x)
    out = _csrc_ops().masked_whiten(xf.contiguous(), mask.bool().contiguous(), bool(shift_mean), float(eps))
    return out.view(x.shape)


# ---------------------------------------------------------------- dispatch and custom ops


def _pick_backend(device: torch.device) -> str:
    """The forced backend if any (csrc falls back when it cannot serve ``device``); else csrc on
    CPU when the extension loads, torch otherwise; triton on CUDA."""
    forced = backends.forced_backend()
    if forced is not None and (forced != "csrc" or _csrc_supports(device)):
        return backends.select(device, supported=("reference", "torch", "triton", "csrc"))
    if device.type == "cuda" and HAS_TRITON:
        return "triton"
    if _csrc_supports(device):
        return "csrc"
    return "torch"


_GAE_IMPLS = {
    "reference": lambda r, v, m, g, l: reference.gae(r, v, m, gamma=g, lam=l),
    "torch": _gae_torch,
    "triton": _gae_triton,
    "csrc": _gae_csrc,
}
_GROUP_IMPLS = {
    "reference": lambda s, gs, idx, mode, eps: reference.group_advantages(s, gs, index=idx, mode=mode, eps=eps),
    "torch": _group_torch,
    "triton": _group_triton,
    "csrc": _group_csrc,
}
_WHITEN_IMPLS = {
    "reference": lambda x, m, shift, eps: reference.masked_whiten(x, m, shift_mean=shift, eps=eps),
    "torch": _whiten_torch,
    "triton": _whiten_triton,
    "csrc": _whiten_csrc,
}


# The public functions pass backend="auto": the choice (which may build the csrc
# extension on first use) is made inside the op, where torch.compile does not trace.
def _resolve(backend: str, device: torch.device) -> str:
    return _pick_backend(device) if backend == "auto" else backend


# Every op body runs with autocast off for its device: under torch.autocast("cpu", bfloat16)
# the torch backend's chunk matmul would otherwise run in bf16 (advantages off by ~0.05).
@torch.library.custom_op("rlkernels::gae", mutates_args=())
def _gae_op(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    with backends.float32_compute(rewards.device):
        adv, ret = _GAE_IMPLS[_resolve(backend, rewards.device)](rewards, values, mask, gamma, lam)  # [B, T] x2
        return adv.float().contiguous(), ret.float().contiguous()


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam, backend):
    return rewards.new_empty(rewards.shape, dtype=torch.float32), rewards.new_empty(rewards.shape, dtype=torch.float32)


@torch.library.custom_op("rlkernels::group_advantages", mutates_args=())
def _group_op(scores: torch.Tensor, group_size: int, index: torch.Tensor | None, mode: str, eps: float, backend: str) -> torch.Tensor:
    with backends.float32_compute(scores.device):
        impl = _GROUP_IMPLS[_resolve(backend, scores.device)]
        return impl(scores, group_size if index is None else None, index, mode, eps).float().contiguous()  # [N]


@_group_op.register_fake
def _(scores, group_size, index, mode, eps, backend):
    return scores.new_empty(scores.shape, dtype=torch.float32)


@torch.library.custom_op("rlkernels::masked_whiten", mutates_args=())
def _whiten_op(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float, backend: str) -> torch.Tensor:
    with backends.float32_compute(x.device):
        return _WHITEN_IMPLS[_resolve(backend, x.device)](x, mask, shift_mean, eps).float().contiguous()  # [...]


@_whiten_op.register_fake
def _(x, mask, shift_mean, eps, backend):
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
    _checks.floating(rewards, "rewards")
    _checks.floating(values, "values")
    _checks.mask(mask, "mask")
    _checks.rank(rewards, "rewards", 2)
    _checks.same_shape(rewards, "rewards", values, "values")
    _checks.same_shape(rewards, "rewards", mask, "mask")
    _checks.same_device((rewards, "rewards"), (values, "values"), (mask, "mask"))
    gamma = _checks.unit_interval(gamma, "gamma")
    lam = _checks.unit_interval(lam, "lam")
    return _gae_op(rewards.detach(), values.detach(), mask.detach(), gamma, lam, "auto")


def group_advantages(
    scores: torch.Tensor,  # [N]
    group_size: int | None = None,
    *,
    index: torch.Tensor | None = None,  # [N] integer group ids
    mode: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages of per-sequence scores, float32 ``[N]``.

    Groups are contiguous blocks of ``group_size`` or share an integer id in
    ``index`` (exactly one of the two). ``grpo``: ``(s - mean)/(std + eps)``
    (unbiased std); ``dr_grpo``: ``s - mean``; ``rloo``: ``s - mean of the
    others``. A group of one, and every member of a group whose scores are all
    equal, gets exactly 0. NaN stays inside its group. No gradient.

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
    _checks.floating(scores, "scores")
    _checks.rank(scores, "scores", 1)
    _checks.choice(mode, "mode", GROUP_MODES)
    eps = _checks.non_negative(eps, "eps")
    N = scores.shape[0]
    if (group_size is None) == (index is None):
        raise ValueError("give exactly one of group_size or index")
    if index is not None:
        _checks.integer(index, "index")
        if index.shape != scores.shape:
            raise ValueError(f"index must have the shape of scores {tuple(scores.shape)}, got {tuple(index.shape)}")
        _checks.same_device((scores, "scores"), (index, "index"))
        group_size_arg = 0
        index = index.detach()
    else:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {group_size}")
        if N % group_size != 0:
            raise ValueError(f"group_size {group_size} does not divide the number of scores {N}")
        group_size_arg = group_size
    return _group_op(scores.detach(), group_size_arg, index, mode, eps, "auto")


def masked_whiten(
    x: torch.Tensor,  # [...]
    mask: torch.Tensor,  # [...] bool or 0/1
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(x - μ)·rsqrt(var + eps)`` with the masked mean and unbiased masked variance, float32.

    Every position is transformed; only masked-in ones (``mask != 0``) enter the
    statistics (values elsewhere, even NaN, are ignored by them). With
    ``shift_mean=False`` the mean is added back. With fewer than two masked entries
    the variance is taken as 0. No gradient.

    Args:
        x: float tensor of any shape ``[...]`` (e.g. ``[B, T]`` advantages).
        mask: bool or 0/1 numeric tensor of the shape and device of ``x``; nonzero
            marks the entries that enter the mean and variance.
        shift_mean: keep the whitened values centred (``True``) or add ``μ`` back.
        eps: added to the variance; finite and ``>= 0``.

    Returns:
        float32 tensor of the shape of ``x``.

    Raises:
        TypeError: non-float ``x``, a mask of another dtype, non-number ``eps``.
        ValueError: mismatched shapes or devices, a negative, NaN or infinite ``eps``.
    """
    _checks.floating(x, "x")
    _checks.mask(mask, "mask")
    _checks.same_shape(x, "x", mask, "mask")
    _checks.same_device((x, "x"), (mask, "mask"))
    eps = _checks.non_negative(eps, "eps")
    return _whiten_op(x.detach(), mask.detach(), bool(shift_mean), eps, "auto")
