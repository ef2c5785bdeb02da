"""gae, group_advantages and masked_whiten against the float64 reference, for every backend
the machine can run (reference, torch, triton interpreted on CPU, csrc C++), plus the
ahead-of-time Triton and nvcc builds, the fallback without the extension, and torch.compile."""
from __future__ import annotations

import os
import subprocess
import warnings
import zlib

import numpy as np
import pytest
import torch

import rlkernels
from rlkernels import _backend, _extension, reference
from rlkernels import advantages as adv_mod
from tests.helpers import (REL_TOL, assert_close_to_truth, backends, build_emulated, devices, forced_backend,
                           in_gloo_group, nvcc_or_skip, on_device, rel_error)

CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


@pytest.fixture(scope="session")
def csrc_ops():
    """The extension, built once per session (ninja reuses ~/.cache/rlkernels across sessions)."""
    ops = _extension.load()
    assert ops is not None, f"the csrc extension failed to build: {_extension.error()}"
    return ops


def test_csrc_cpu_kernels_are_compiled_for_openmp(csrc_ops):
    """at::parallel_for's OpenMP pragma runs only in code compiled with -fopenmp: without the flag every CPU kernel
    of the extension ran on one thread (the GAE bench at B=64, T=2048: 0.17-0.24 ms without, 0.12-0.14 ms with).
    Where torch itself runs on OpenMP (Linux), the built library calls the OpenMP runtime."""
    import os
    import sys

    if not (torch._C.has_openmp and sys.platform.startswith("linux")):
        pytest.skip("torch's CPU parallelism is not OpenMP here")
    library = _extension._prebuilt() or os.path.join(_extension.build_directory(), _extension.NAMESPACE + ".so")
    with open(library, "rb") as f:
        assert b"GOMP_parallel" in f.read(), f"{library} makes no OpenMP call: built without -fopenmp"


def all_backends(device="cpu"):
    return backends(device) + ["csrc"]


# every backend on every device (csrc: its C++ kernels on the CPU, its CUDA kernels on a GPU)
DEVICE_BACKENDS = [pytest.param(d, b, id=f"{d}-{b}") for d in devices() for b in all_backends(d)]


def backend_for(device, dtype=torch.float32):
    """The backend the ops of rlkernels.advantages resolve to for inputs of ``dtype`` on ``device``."""
    return _backend.resolve(device, adv_mod._SUPPORTED, dtype)


def run(backend, fn, *args, **kwargs):
    with forced_backend(backend):
        return fn(*args, **kwargs)


def run_on(device, backend, fn, *args, **kwargs):
    """``run`` with every tensor argument moved to ``device`` (strides and storage offsets kept) and the outputs
    brought back to the CPU, where the tests compare them with the float64 truth."""
    args = [on_device(device, a, keep_offset=True)[0] if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: on_device(device, v, keep_offset=True)[0] if isinstance(v, torch.Tensor) else v
              for k, v in kwargs.items()}
    out = run(backend, fn, *args, **kwargs)
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def make_mask(B, T, kind, gen):
    if kind == "right-padded":
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        mask = torch.arange(T)[None, :] < lengths[:, None]
    elif kind == "gaps":  # multi-turn: interior runs of masked (environment) tokens
        mask = torch.rand(B, T, generator=gen) < 0.6
    else:
        raise ValueError(kind)
    if B > 1:
        mask[1] = False  # a row with no valid token
    return mask


def gae_inputs(B, T, kind, rewards_kind, dtype, gen):
    values = torch.randn(B, T, generator=gen)
    if rewards_kind == "per-token":
        rewards = torch.randn(B, T, generator=gen)
    else:  # one score at the last valid token, as in RLHF with end-only rewards
        rewards = torch.zeros(B, T)
    mask = make_mask(B, T, kind, gen)
    if rewards_kind == "end-only":
        last = (mask.float() * torch.arange(1, T + 1)).argmax(1)
        rewards[torch.arange(B), last] = torch.randn(B, generator=gen)
    rewards[~mask] = float("nan")  # masked positions are transparent: their content must not matter
    return rewards.to(dtype), values.to(dtype), mask


def check_gae(backend, rewards, values, mask, gamma, lam, tol, device="cpu"):
    truth_a, truth_r = reference.gae(rewards.double(), values.double(), mask, gamma=gamma, lam=lam)
    a, r = run_on(device, backend, rlkernels.gae, rewards, values, mask, gamma=gamma, lam=lam)
    assert a.dtype == torch.float32 and r.dtype == torch.float32 and a.shape == rewards.shape
    valid = mask.bool()
    # only positions with mask = 1 are specified
    err_a = rel_error(a[valid], truth_a[valid])
    err_r = rel_error(r[valid], truth_r[valid])
    assert err_a <= tol, f"{backend}: advantages rel. error {err_a:.2e} > {tol:.1e}"
    assert err_r <= tol, f"{backend}: returns rel. error {err_r:.2e} > {tol:.1e}"


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("kind", ["right-padded", "gaps"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.0, 0.9), (0.9, 0.0), (1.0, 0.9)])
def test_gae_matches_reference(device, backend, kind, gamma, lam, csrc_ops):
    # a seed per case that is the same in every process (hash() of a str is salted per process, which made the
    # inputs, and so the float32 rounding of the 300-token recursion, differ from run to run)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((backend, kind, gamma, lam)).encode()))
    for B, T, rewards_kind in ((5, 37, "per-token"), (3, 300, "end-only")):
        r, v, m = gae_inputs(B, T, kind, rewards_kind, torch.float32, gen)
        check_gae(backend, r, v, m, gamma, lam, REL_TOL[torch.float32], device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gae_low_precision_inputs(device, backend, dtype, csrc_ops):
    # Inputs are read in their dtype and computed in float32, so against the float64
    # truth *of the rounded inputs* the float32 tolerance applies.
    gen = torch.Generator().manual_seed(3)
    r, v, m = gae_inputs(4, 70, "gaps", "per-token", dtype, gen)
    check_gae(backend, r, v, m, 0.95, 0.9, REL_TOL[torch.float32], device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_gae_single_token_and_noncontiguous(device, backend, csrc_ops):
    gen = torch.Generator().manual_seed(4)
    r, v, m = gae_inputs(6, 1, "gaps", "per-token", torch.float32, gen)
    m[0] = True
    check_gae(backend, r, v, m, 0.9, 0.95, REL_TOL[torch.float32], device=device)
    wide_r, wide_v = torch.randn(4, 2 * 90, generator=gen), torch.randn(4, 2 * 90, generator=gen)
    m = make_mask(4, 90, "gaps", gen).float()  # 0/1 float mask
    check_gae(backend, wide_r[:, ::2], wide_v[:, 1::2], m, 0.99, 0.95, REL_TOL[torch.float32], device=device)


@pytest.mark.parametrize("backend", ["torch", "triton", "csrc"])
def test_gae_long_rows(backend, csrc_ops):
    # T = 8192 with γ = λ = 1: every advantage is a sum of up to 8192 terms of size ~1.
    # A float32 scan (any order: sequential in C++, tree-shaped in Triton, chunked in
    # torch) has a relative error of at most ~ log2(T)·2⁻²⁴ per pairwise level and
    # ~ T·2⁻²⁴ ≈ 5e-4 worst case sequentially; random signs make it ~ sqrt(T)·2⁻²⁴ ≈ 5e-6
    # in practice. 1e-4 leaves room for the worst case of rounding without hiding a bug
    # (a wrong carry between blocks gives errors of order 1).
    gen = torch.Generator().manual_seed(5)
    B = 1 if backend == "triton" else 2  # the interpreter runs one block at a time
    r, v, m = gae_inputs(B, 8192, "gaps", "per-token", torch.float32, gen)
    m[0, -5:] = False
    check_gae(backend, r, v, m, 1.0, 1.0, 1e-4)
    check_gae(backend, r, v, m, 0.999, 0.95, 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton", "csrc"])
def test_gae_masked_runs_across_chunks_and_blocks(backend, csrc_ops):
    # The Triton kernel scans 16-token chunks inside 512-token blocks (several rows per program), the CUDA
    # kernel 8-token items inside 2048-token tiles: masked runs that cover whole chunks and cross block
    # boundaries (512, 1024, 1536 and 2048 here) must carry (A, V) through unchanged, and so must a block with
    # no valid token.
    gen = torch.Generator().manual_seed(11)
    B, T = 2, 2048 + 48
    r, v = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    m = torch.zeros(B, T, dtype=torch.bool)
    m[0, :11] = m[0, 2080:] = True  # row 0: a hole from token 11 across the block boundary at 2048 to 2080
    m[1, :40] = True  # row 1: the last block has no valid token at all
    m[1, 1000:1003] = True
    r[~m] = float("nan")
    check_gae(backend, r, v, m, 0.99, 0.95, REL_TOL[torch.float32])
    # several rows per program: 9 rows of 200 tokens, runs of 17-40 masked tokens
    B, T = 9, 200
    r, v = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    m = ((torch.arange(T)[None, :] + 7 * torch.arange(B)[:, None]) // 17 % 3 != 1) | (torch.arange(T) < 3)
    r[~m] = float("nan")
    check_gae(backend, r, v, m, 0.9, 0.8, REL_TOL[torch.float32])


@pytest.mark.parametrize("T", [1024, 1040, 2040, 2056, 2064])
def test_gae_rows_at_every_tile_skew(T, csrc_ops):
    # The CPU kernel walks 4 rows at once, row i some tokens behind row 0, the lag chosen from the row stride
    # (csrc/gae_row_skew.h: 16 tokens at T = 1024, 8 at 2040, 24 at 2056, none at 1040 or 2064). Every lag, and
    # the 9th row walked alone, must give the recursion of each row by itself.
    gen = torch.Generator().manual_seed(T)
    r, v, m = gae_inputs(9, T, "gaps", "per-token", torch.float32, gen)
    check_gae("csrc", r, v, m, 0.99, 0.95, REL_TOL[torch.float32])
    a, ret = run("csrc", rlkernels.gae, r, v, m, gamma=0.99, lam=0.95)
    for b in (0, 3, 8):  # each row as a batch of one: no tile, no lag
        a1, ret1 = run("csrc", rlkernels.gae, r[b:b + 1], v[b:b + 1], m[b:b + 1], gamma=0.99, lam=0.95)
        assert torch.equal(a[b], a1[0]) and torch.equal(ret[b][m[b]], ret1[0][m[b]])


@pytest.mark.parametrize("T", [1, 2, 3, 5, 7, 47, 50, 53, 1027])
@pytest.mark.parametrize("layout", ["contiguous", "row-slice", "mask-strided"])
def test_gae_float32_tiles_equal_single_rows(T, layout, csrc_ops):
    # float32 rows with contiguous tokens run 4 to a vector tile (csrc/gae_tile_sse.h) whose lanes start and end
    # at different tokens (a head and a tail walked per row, whole rows walked per row when T is short); other
    # layouts run the scalar tile. Each row must be the recursion of that row alone, bit for bit, and the truth.
    gen = torch.Generator().manual_seed(1000 + T)
    B = 11  # two tiles of 4 and 3 rows alone
    r, v, m = gae_inputs(B, T, "gaps", "per-token", torch.float32, gen)
    if layout == "row-slice":  # rows T + 5 elements apart, tokens at a 12-byte offset: unaligned vector loads
        wide_r, wide_v = torch.randn(B, T + 5, generator=gen), torch.randn(B, T + 5, generator=gen)
        wide_r[:, 3:3 + T], wide_v[:, 3:3 + T] = r, v
        r, v = wide_r[:, 3:3 + T], wide_v[:, 3:3 + T]
    elif layout == "mask-strided":
        m = m.t().contiguous().t()
    check_gae("csrc", r, v, m, 0.99, 0.95, REL_TOL[torch.float32])
    a, ret = run("csrc", rlkernels.gae, r, v, m, gamma=0.99, lam=0.95)
    for b in range(B):
        a1, ret1 = run("csrc", rlkernels.gae, r[b:b + 1].clone(), v[b:b + 1].clone(), m[b:b + 1].clone(), gamma=0.99,
                       lam=0.95)
        assert torch.equal(a[b], a1[0]), (b, T, layout)
        assert torch.equal(ret[b][m[b]], ret1[0][m[b]]), (b, T, layout)


def test_gae_transparency_and_zero_rows(csrc_ops):
    # inserting masked tokens anywhere must not change the advantages of the valid ones
    gen = torch.Generator().manual_seed(6)
    r, v = torch.randn(1, 20, generator=gen), torch.randn(1, 20, generator=gen)
    dense_a, _ = rlkernels.gae(r, v, torch.ones(1, 20, dtype=torch.bool), gamma=0.9, lam=0.8)
    R, V = torch.randn(1, 45, generator=gen), torch.randn(1, 45, generator=gen)
    slots = torch.sort(torch.randperm(45, generator=gen)[:20]).values
    M = torch.zeros(1, 45, dtype=torch.bool)
    M[0, slots], R[0, slots], V[0, slots] = True, r[0], v[0]
    for backend in all_backends():
        a, ret = run(backend, rlkernels.gae, R, V, M, gamma=0.9, lam=0.8)
        torch.testing.assert_close(a[0, slots], dense_a[0], rtol=1e-5, atol=1e-5, msg=backend)
        empty_a, empty_r = run(backend, rlkernels.gae, R, V, torch.zeros_like(M), gamma=0.9, lam=0.8)
        assert torch.equal(empty_a, torch.zeros_like(empty_a)), backend


# ---------------------------------------------------------------- group advantages


def check_group(backend, scores, group_size=None, index=None, mode="grpo", device="cpu"):
    truth = reference.group_advantages(scores.double(), group_size, index=index, mode=mode)
    out = run_on(device, backend, rlkernels.group_advantages, scores, group_size, index=index, mode=mode)
    assert out.dtype == torch.float32 and out.shape == scores.shape
    assert torch.equal(torch.isnan(out), torch.isnan(truth)), f"{backend}: NaN pattern differs"
    err = rel_error(out, truth)
    assert err <= REL_TOL[torch.float32], f"{backend} {mode} group_size={group_size}: rel. error {err:.2e}"
    return out


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_contiguous(device, backend, mode, csrc_ops):
    gen = torch.Generator().manual_seed(7)
    # 1-1100: Triton's tile kernel (many groups per program, padded columns, a partial last tile; one group of
    # 1100 per program); 5000: one program per group, in a loop. CUDA kernel: up to 256 a warp's lane segments of
    # 1-32 lanes holding 8 scores each -- 16-byte loads where the size is a multiple of 4 (12, 16, 32, 64, 100, 256;
    # 100: a lane half-full), scalar ones otherwise (3, 5, 31, 33, 129, 255: lanes and segments with idle slots) --,
    # past 256 a warp per group (257); 3 x 1000 groups span many blocks. `offset`: the scores start one float into
    # their storage, so the CUDA kernel's 16-byte path is refused for a misaligned pointer
    for group_size, groups, offset in ((1, 6, 0), (2, 6, 0), (3, 1000, 0), (5, 6, 0), (12, 6, 0), (12, 6, 1),
                                       (16, 6, 0), (16, 300, 1), (31, 6, 0), (32, 6, 0), (33, 6, 0), (64, 6, 0),
                                       (100, 6, 0), (129, 6, 0), (255, 6, 0), (256, 6, 0), (257, 6, 0), (1100, 6, 0),
                                       (5000, 6, 0)):
        scores = (torch.randn(offset + group_size * groups, generator=gen) * 3 + 1)[offset:]  # [group_size * groups]
        scores[group_size : 2 * group_size] = 0.7  # a constant group
        out = check_group(backend, scores, group_size, mode=mode, device=device)
        assert torch.all(out[group_size : 2 * group_size] == 0)
        if group_size == 1:
            assert torch.all(out == 0)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_group_index_of_equal_groups(device, backend, mode, csrc_ops):
    """Index-given groups of one size in shuffled order (GRPO's prompt ids): Triton's tile kernel gathers them
    through the sorted permutation; a constant group gives 0, a NaN stays in its group."""
    gen = torch.Generator().manual_seed(16)
    for group_size, G in ((1, 7), (5, 300), (16, 9), (300, 5)):  # (5, 300): several programs and a partial tile
        index = (torch.arange(G) * 7 - 3).repeat_interleave(group_size)[torch.randperm(G * group_size, generator=gen)]
        scores = torch.randn(G * group_size, generator=gen) * 2 + 1  # [N]
        const = index == index[0]
        scores[const] = 0.7  # a constant group
        out = check_group(backend, scores, index=index, mode=mode, device=device)
        assert torch.all(out[const] == 0)
        bad = index[-1].item()
        if group_size > 1 and bad != index[0].item():
            scores[-1] = float("nan")  # NaN in one group stays in that group
            out = check_group(backend, scores, index=index, mode=mode, device=device)
            assert torch.isnan(out[index == bad]).all() and not torch.isnan(out[index != bad]).any()


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "rloo"])
def test_group_index_and_nan(device, backend, mode, csrc_ops):
    gen = torch.Generator().manual_seed(8)
    N = 300  # more than one 256-wide block per group in the Triton kernel's loop
    index = torch.randint(0, 4, (N,), generator=gen) * 1000 - 7  # arbitrary, non-contiguous ids
    index[:3] = 12345  # a group of three ...
    index[3] = 999  # ... and a group of one
    scores = torch.randn(N, generator=gen)
    scores[:3] = 0.1 + 0.2  # constant: exactly 0 whatever the rounding of its mean
    out = check_group(backend, scores, index=index.to(torch.int32), mode=mode, device=device)
    assert torch.all(out[:4] == 0)
    bad = index[10].item()
    scores[10] = float("nan")  # NaN in one group stays in that group
    out = check_group(backend, scores, index=index, mode=mode, device=device)
    assert torch.isnan(out[index == bad]).all()
    assert not torch.isnan(out[index != bad]).any()


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_group_nan_contiguous(device, backend, csrc_ops):
    scores = torch.randn(32, generator=torch.Generator().manual_seed(9))
    scores[5] = float("nan")
    out = check_group(backend, scores, 8, device=device)
    assert torch.isnan(out[:8]).all() and not torch.isnan(out[8:]).any()


# ---------------------------------------------------------------- masked whitening


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(device, backend, dtype, shift_mean, csrc_ops):
    gen = torch.Generator().manual_seed(10)
    for shape in ((7, 333), (3000, 10)):
        x = (torch.randn(*shape, generator=gen) * 4 + 100).to(dtype)  # large mean: tests cancellation
        mask = torch.rand(*shape, generator=gen) < 0.7
        x[~mask] = float("nan")  # masked-out entries do not enter the statistics
        truth = reference.masked_whiten(x.double(), mask, shift_mean=shift_mean)
        out = run_on(device, backend, rlkernels.masked_whiten, x, mask, shift_mean=shift_mean)
        assert out.dtype == torch.float32 and out.shape == x.shape
        err = rel_error(out[mask], truth[mask])
        assert err <= REL_TOL[torch.float32] * (1 if shift_mean else 0.1), f"{backend}: rel. error {err:.2e}"


@pytest.mark.parametrize("device,backend", [p for p in DEVICE_BACKENDS if p.values[1] != "reference"])
@pytest.mark.parametrize("case", ["offset 1e6", "offset -3e5, empty prefix", "outlier first"])
def test_masked_whiten_shifted_data_over_many_tiles(device, backend, case, csrc_ops):
    """Float32 data far from 0 relative to its spread (1e6 + N(0, 1): a float32 mean is only known to ~0.03):
    every backend whitens it as the float64 truth does, over enough elements for several tiles and programs
    (and their merge); also with the first rows masked out (the first tiles hold no data) and with a masked-in
    outlier first (a pivot far from the rest of the data). (Not the reference backend: its eager formulas in
    float32 are off by ~5% at an offset of 1e6, which is why the kernels keep a pivot.)"""
    gen = torch.Generator().manual_seed(15)
    B, T = 40, 700  # 28000 elements: 7 tiles of the Triton whitening kernel, merged across 4 programs on CPU
    noise = torch.randn(B, T, generator=gen, dtype=torch.float64)  # [B, T]
    mask = torch.rand(B, T, generator=gen) < 0.8  # [B, T]
    if case == "offset 1e6":
        x = (1e6 + noise).float()
    elif case == "offset -3e5, empty prefix":
        x = (-3e5 + 0.5 * noise).float()
        mask[:12] = False  # the first 8400 elements: two whole tiles
    else:
        x = (5.0 + noise).float()
        x[0, 0], mask[0, 0] = 1e6, True
    x[~mask] = float("nan")  # masked-out entries do not enter the statistics
    # (with the outlier, shift_mean=False adds back a mean of ~45 to values that vary by ~1e-4: float32 output
    # rounding, not the statistics, sets the error there)
    for shift_mean in (True, False) if case != "outlier first" else (True,):
        truth = reference.masked_whiten(x.double(), mask, shift_mean=shift_mean)  # [B, T]
        out = run_on(device, backend, rlkernels.masked_whiten, x, mask, shift_mean=shift_mean)  # [B, T]
        err = rel_error(out[mask], truth[mask])
        assert err <= REL_TOL[torch.float32], f"{backend} {case} shift_mean={shift_mean}: rel. error {err:.2e}"


def _cuda_kernels_of(fn) -> list[str]:
    """The names of the CUDA kernels ``fn()`` launches (torch.profiler, CUPTI)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("path", adv_mod.WHITEN_PATHS)
def test_csrc_whiten_paths_match_float64_truth(device, path, monkeypatch, csrc_ops):
    """RLKERNELS_WHITEN picks masked_whiten's CUDA kernels: the fused cooperative kernel (contiguous memory; a grid
    barrier between every block's statistics and its normalisation) or the three passes; either matches the float64
    truth on float32 and bfloat16 x (128000 elements: 125 blocks on a GPU; 2^20: a full one-wave grid, more partials
    than a block has threads), with masked-out NaN, on a view whose memory the fused kernel cannot take (one element
    in: the passes serve it), with deviations whose float32 squares overflow (the rescue, over the grid or in one
    block; also in the first block's share alone), and with a masked-in NaN (NaN throughout). On CUDA the profiler
    shows which kernels ran, and a captured CUDA graph replays them. The CPU kernel has one path and takes both
    settings."""
    monkeypatch.setenv(adv_mod.WHITEN_ENV, path)
    gen = torch.Generator().manual_seed(31)
    for B, T in ((64, 2000), (1024, 1024)):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(B, T, generator=gen) * 3 - 40).to(dtype)  # [B, T]
            mask = torch.rand(B, T, generator=gen) < 0.75  # [B, T]
            x[~mask] = float("nan")
            flat_x = torch.cat([x.new_zeros(1), x.flatten()])  # [1 + B*T]
            flat_mask = torch.cat([mask.new_ones(1), mask.flatten()])  # [1 + B*T]
            cases = {"contiguous": (x, mask), "one element in": (flat_x[1:], flat_mask[1:])}
            for name, (xs, ms) in cases.items():
                for shift_mean in (True, False):
                    truth = reference.masked_whiten(xs.double(), ms, shift_mean=shift_mean)
                    out = run_on(device, "csrc", rlkernels.masked_whiten, xs, ms, shift_mean=shift_mean)
                    err = rel_error(out[ms], truth[ms])
                    assert err <= REL_TOL[torch.float32], (path, B, dtype, name, shift_mean, err)
                if device == "cuda":
                    xd, md = on_device(device, xs, keep_offset=True)[0], on_device(device, ms, keep_offset=True)[0]
                    with forced_backend("csrc"):
                        names = _cuda_kernels_of(lambda: rlkernels.masked_whiten(xd, md))
                    fused_ran = any("whiten_fused_kernel" in n for n in names)
                    assert fused_ran == (path == "fused" and name == "contiguous"), (path, name, names)
                    assert fused_ran or any("whiten_partial_kernel" in n for n in names), (path, name, names)
        huge = torch.randn(B, T, generator=gen) * 3e37  # [B, T]
        mask = torch.rand(B, T, generator=gen) < 0.75  # [B, T]
        lopsided = torch.randn(B, T, generator=gen)  # [B, T]
        lopsided.view(-1)[:2048] = torch.randn(2048, generator=gen) * 3e37  # the first block's share alone
        for name, xs in (("huge", huge), ("huge in the first block's share", lopsided)):
            truth = reference.masked_whiten(xs.double(), mask, shift_mean=False)
            out = run_on(device, "csrc", rlkernels.masked_whiten, xs, mask, shift_mean=False)
            assert torch.isfinite(out).all() and rel_error(out, truth) <= REL_TOL[torch.float32], (path, B, name)
        huge[5, 7], mask[5, 7] = float("nan"), True
        assert torch.isnan(run_on(device, "csrc", rlkernels.masked_whiten, huge, mask)).all(), (path, B)
    if device == "cuda":
        _whiten_in_a_cuda_graph(gen)


def _whiten_in_a_cuda_graph(gen):
    """masked_whiten's CUDA kernels inside a captured CUDA graph (torch.cuda.graph, as torch.compile's
    reduce-overhead mode captures): while the stream captures the passes run (a refused cooperative launch would
    invalidate the capture); replays with new inputs match the float64 truth."""
    x = torch.randn(512, 999, generator=gen).cuda()  # [B, T] the graph's static input
    mask = (torch.rand(512, 999, generator=gen) < 0.7).cuda()  # [B, T]
    with forced_backend("csrc"):
        rlkernels.masked_whiten(x, mask)  # warm-up outside the capture (extension load, caches)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rlkernels.masked_whiten(x, mask)  # [B, T]
    for scale in (1.0, 5.0, 1e6):
        fresh = torch.randn(512, 999, generator=gen) * scale + 3  # [B, T]
        x.copy_(fresh)
        graph.replay()
        truth = reference.masked_whiten(fresh.double(), mask.cpu())
        assert rel_error(out.cpu(), truth) <= REL_TOL[torch.float32], scale


def test_whiten_path_switch_refuses_what_it_does_not_know(monkeypatch, csrc_ops):
    monkeypatch.setenv(adv_mod.WHITEN_ENV, "one-pass")
    with pytest.raises(ValueError, match="RLKERNELS_WHITEN"):
        with forced_backend("csrc"):
            rlkernels.masked_whiten(torch.randn(3, 4), torch.ones(3, 4))
    monkeypatch.setenv(adv_mod.WHITEN_ENV, " Passes ")  # case and blanks ignored, as for RLKERNELS_BACKEND
    with forced_backend("csrc"):
        rlkernels.masked_whiten(torch.randn(3, 4), torch.ones(3, 4))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_masked_whiten_degenerate(device, backend, csrc_ops):
    x = torch.randn(4, 5)
    one = torch.zeros(4, 5, dtype=torch.bool)
    one[2, 3] = True
    for mask in (torch.zeros(4, 5, dtype=torch.bool), one):  # no masked entry, one masked entry: var = 0
        truth = reference.masked_whiten(x.double(), mask)
        out = run_on(device, backend, rlkernels.masked_whiten, x, mask)
        assert rel_error(out, truth) <= REL_TOL[torch.float32]


# ---------------------------------------------------------------- masked whitening over a process group


def _global_whiten_cases():
    """Per case: (name, [x of rank 0, x of rank 1], [mask of rank 0, mask of rank 1], compare_all).

    The ranks hold different shapes and numbers of entries; masked-out positions hold NaN and
    huge values (they must stay out of the statistics). ``compare_all``: the degenerate cases
    (fewer than two entries over all ranks, var = 0) compare every position, the others the
    masked-in ones (the masked-out -1e30 would swamp a norm)."""
    gen = torch.Generator().manual_seed(17)
    cases = []
    for shift in (0.5, 1e6, -3.0e5):  # 1e6 + N(0, 3): a float32 mean of such data is off by ~0.03
        xs = [(torch.randn(*shape, generator=gen, dtype=torch.float64) * 3 + shift).float() for shape in ((3, 40), (5, 17))]
        ms = [torch.rand(x.shape, generator=gen) < 0.7 for x in xs]
        xs[0][~ms[0]] = float("nan")
        xs[1][~ms[1]] = -1e30
        cases.append((f"shift={shift}", xs, ms, False))
    x0, x1 = torch.randn(4, 9, generator=gen) + 2, torch.randn(2, 9, generator=gen)  # [B, T] x2
    m0 = torch.rand(4, 9, generator=gen) < 0.8
    cases.append(("rank 1 has no entry", [x0, x1], [m0, torch.zeros(2, 9, dtype=torch.bool)], False))
    m1 = torch.zeros(2, 9, dtype=torch.bool)
    m1[1, 4] = True
    cases.append(("one entry in all", [x0, x1], [torch.zeros(4, 9, dtype=torch.bool), m1], True))
    cases.append(("no entry at all", [x0, x1], [torch.zeros(4, 9, dtype=torch.bool), torch.zeros(2, 9, dtype=torch.bool)], True))
    nan_x1 = x1.clone()
    nan_x1[0, 0] = float("nan")  # masked in: NaN propagates to every output of every rank
    cases.append(("masked-in NaN", [x0, nan_x1], [m0, torch.ones(2, 9, dtype=torch.bool)], False))
    bf = [x.to(torch.bfloat16) for x in (x0 * 100 + 1000, x1 * 100 + 1000)]
    cases.append(("bfloat16", bf, [m0, torch.rand(2, 9, generator=gen) < 0.5], False))
    return cases


def _global_whiten_worker(rank, world, init_file, out_dir):
    in_gloo_group(rank, world, f"file://{init_file}", _global_whiten_work, rank, out_dir)


def _global_whiten_work(rank, out_dir):
    import torch.distributed as dist

    outs = {}
    for name, xs, ms, _ in _global_whiten_cases():
        for shift_mean in (True, False):
            outs[name, shift_mean] = rlkernels.masked_whiten(
                xs[rank], ms[rank], shift_mean=shift_mean, process_group=dist.group.WORLD
            )
    torch.save(outs, os.path.join(out_dir, f"whiten{rank}.pt"))


def test_masked_whiten_process_group_matches_concatenation(tmp_path, csrc_ops):
    """Two gloo processes: each rank's output is its part of masked_whiten over the concatenation of
    both ranks' entries (the single-process op, default backend) and of the float64 reference there."""
    torch.multiprocessing.spawn(_global_whiten_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"whiten{r}.pt") for r in range(2)]
    for name, xs, ms, compare_all in _global_whiten_cases():
        x = torch.cat([t.reshape(-1) for t in xs])  # [N0 + N1]
        m = torch.cat([t.reshape(-1) for t in ms])  # [N0 + N1]
        check = torch.ones_like(m) if compare_all else m  # [N0 + N1]
        for shift_mean in (True, False):
            parts = [ranks[r][name, shift_mean] for r in range(2)]
            assert [p.shape for p in parts] == [t.shape for t in xs] and all(p.dtype == torch.float32 for p in parts)
            got = torch.cat([p.reshape(-1) for p in parts])  # [N0 + N1]
            want = rlkernels.masked_whiten(x, m, shift_mean=shift_mean)  # [N0 + N1]
            truth = reference.masked_whiten(x.double(), m, shift_mean=shift_mean)  # [N0 + N1]
            eager = reference.masked_whiten(x, m, shift_mean=shift_mean)  # [N0 + N1]
            label = f"{name} shift_mean={shift_mean}"
            assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{label}: NaN pattern differs"
            assert_close_to_truth(got[check], truth[check], torch.float32, eager=eager[check], name=label)
            # both are within REL_TOL of the truth (masked_whiten by its own tests), so within twice that of each other
            assert rel_error(got[check], want[check]) <= 2 * REL_TOL[torch.float32], label


def test_masked_whiten_process_group_type():
    with pytest.raises(TypeError, match="process_group"):
        rlkernels.masked_whiten(torch.randn(3, 4), torch.ones(3, 4), process_group="world")


# ---------------------------------------------------------------- API behaviour


def test_validation_errors():
    r, v, m = torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="values"):
        rlkernels.gae(r, torch.randn(2, 4), m)
    with pytest.raises(ValueError, match="mask"):
        rlkernels.gae(r, v, torch.ones(3, 2))
    with pytest.raises(ValueError, match="rewards must be 2-D"):
        rlkernels.gae(torch.randn(6), torch.randn(6), torch.ones(6))
    with pytest.raises(TypeError, match="rewards"):
        rlkernels.gae(torch.ones(2, 3, dtype=torch.int64), v, m)
    with pytest.raises(TypeError, match="values"):
        rlkernels.gae(r, torch.ones(2, 3, dtype=torch.int32), m)
    s = torch.randn(12)
    with pytest.raises(ValueError, match="group_size"):
        rlkernels.group_advantages(s, 5)
    with pytest.raises(ValueError, match="group_size"):
        rlkernels.group_advantages(s, 0)
    with pytest.raises(ValueError, match="exactly one of group_size or index"):
        rlkernels.group_advantages(s)
    with pytest.raises(ValueError, match="exactly one of group_size or index"):
        rlkernels.group_advantages(s, 4, index=torch.zeros(12, dtype=torch.int64))
    with pytest.raises(ValueError, match="index"):
        rlkernels.group_advantages(s, index=torch.zeros(11, dtype=torch.int64))
    with pytest.raises(TypeError, match="index"):
        rlkernels.group_advantages(s, index=torch.zeros(12))
    with pytest.raises(TypeError, match="scores"):
        rlkernels.group_advantages(torch.arange(12), 4)
    with pytest.raises(ValueError, match="mode"):
        rlkernels.group_advantages(s, 4, mode="ppo")
    with pytest.raises(ValueError, match="mask"):
        rlkernels.masked_whiten(torch.randn(3, 4), torch.ones(4, 3))


def test_requires_grad_inputs_are_constants(csrc_ops):
    r, v = torch.randn(2, 9, requires_grad=True), torch.randn(2, 9, requires_grad=True)
    m = torch.ones(2, 9)
    for backend in all_backends():
        a, ret = run(backend, rlkernels.gae, r, v, m, gamma=0.9, lam=0.9)
        assert not a.requires_grad and not ret.requires_grad
        g = run(backend, rlkernels.group_advantages, r.view(-1), 6)
        w = run(backend, rlkernels.masked_whiten, v, m)
        assert not g.requires_grad and not w.requires_grad


def test_cpu_default_is_csrc(csrc_ops):
    with forced_backend(None):
        assert backend_for(torch.device("cpu")) == "csrc"


def test_torch_compile_fullgraph(csrc_ops):
    def step(r, v, m, s):
        a, ret = rlkernels.gae(r, v, m, gamma=0.9, lam=0.95)
        return rlkernels.masked_whiten(a, m), ret, rlkernels.group_advantages(s, 4, mode="rloo")

    gen = torch.Generator().manual_seed(11)
    r, v, m = gae_inputs(4, 16, "gaps", "per-token", torch.float32, gen)
    r = torch.nan_to_num(r)
    s = torch.randn(8, generator=gen)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for backend in ("torch", "csrc"):
        with forced_backend(backend):
            got = compiled(r, v, m, s)
            want = step(r, v, m, s)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16, torch.float16])
def test_gae_torch_ignores_the_default_dtype(default):
    """A caller's torch.set_default_dtype does not reach the torch scan's buffers: under bfloat16 its chunk carries
    were stored in bfloat16 (advantages off by ~1e-2), under float64 part of the scan ran in float64 (other bits)."""
    gen = torch.Generator().manual_seed(31)
    r, v, m = gae_inputs(3, 100, "gaps", "per-token", torch.float32, gen)  # [B, T] x3: several chunks of the scan
    with forced_backend("torch"):
        want = rlkernels.gae(r, v, m, gamma=0.99, lam=0.95)
        saved = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            got = rlkernels.gae(r, v, m, gamma=0.99, lam=0.95)
        finally:
            torch.set_default_dtype(saved)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.equal(g, w)


def test_fallback_without_extension(monkeypatch, csrc_ops):
    """With the extension unavailable the ops still work (torch on CPU) and warn exactly once."""
    saved = dict(_extension._state)

    def fail():
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(_extension, "_build", fail)
    _extension._state.update(tried=False, ops=None, error=None, warned=False)
    try:
        r, v, m = torch.randn(2, 6), torch.randn(2, 6), torch.ones(2, 6)
        with forced_backend(None):
            with pytest.warns(RuntimeWarning, match=r"simulated: no C\+\+ compiler"):
                a, _ = rlkernels.gae(r, v, m)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a second call does not warn again
                b = rlkernels.group_advantages(torch.randn(6), 3)
                assert backend_for(torch.device("cpu")) == "torch"
        with forced_backend("csrc"):  # forcing csrc falls back instead of failing
            c, _ = rlkernels.gae(r, v, m)
        truth, _ = reference.gae(r.double(), v.double(), m)
        assert rel_error(a, truth) <= REL_TOL[torch.float32] and rel_error(c, truth) <= REL_TOL[torch.float32]
        assert b.shape == (6,)
    finally:
        _extension._state.clear()
        _extension._state.update(saved)


# ---------------------------------------------------------------- hostile inputs


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("name", ["gamma", "lam"])
@pytest.mark.parametrize("bad", [-0.1, 1.5, -1, 2, float("nan"), float("inf"), -float("inf"), 10**400, -10**400])
def test_gae_rejects_gamma_lam_outside_unit_interval(device, backend, name, bad, csrc_ops):
    r, v, m = torch.randn(2, 5), torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)  # [B, T] x3
    kwargs = {"gamma": 0.9, "lam": 0.95, name: bad}
    with pytest.raises(ValueError, match=name):
        run_on(device, backend, rlkernels.gae, r, v, m, **kwargs)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_gae_accepts_unit_interval_ends(device, backend, csrc_ops):
    # 0 and 1 are legal for both (γ = 0: one-step TD; λ = 0: TD(0); λ = 1: Monte Carlo)
    gen = torch.Generator().manual_seed(12)
    r, v, m = gae_inputs(3, 9, "gaps", "per-token", torch.float32, gen)  # [B, T] x3
    for gamma, lam in ((0, 0), (1, 1), (0.0, 1.0), (1.0, 0.0)):
        check_gae(backend, r, v, m, gamma, lam, REL_TOL[torch.float32], device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_gae_accepts_tiny_gamma_lam(device, backend, csrc_ops):
    """gamma/lam of any size in [0, 1], and products γλ below float32's normal range (1e-30 · 1e-30), are legal.
    The Triton kernel reads them as float32 arguments; under the interpreter they arrived as Python floats, so
    γλ = 1e-60 became a float64 constant and the launch crashed (numpy data 64 bits for a float32 tensor)."""
    gen = torch.Generator().manual_seed(14)
    r, v, m = gae_inputs(3, 9, "gaps", "per-token", torch.float32, gen)  # [B, T] x3
    for gamma, lam in ((1e-30, 1e-30), (1e-40, 1.0), (1.0, 1e-46), (0.5, 1e-40)):
        check_gae(backend, r, v, m, gamma, lam, REL_TOL[torch.float32], device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("bad", [-1e-3, -1.0, float("nan"), float("inf"), -float("inf"), 10**400])
def test_eps_must_be_finite_and_non_negative(device, backend, bad, csrc_ops):
    s = torch.randn(8)  # [N]
    for mode in adv_mod.GROUP_MODES:  # checked in every mode, also those that do not use it
        with pytest.raises(ValueError, match="eps"):
            run_on(device, backend, rlkernels.group_advantages, s, 4, mode=mode, eps=bad)
        with pytest.raises(ValueError, match="eps"):
            run_on(device, backend, rlkernels.group_advantages, s, index=torch.arange(8) % 3, mode=mode, eps=bad)
    for shift_mean in (True, False):
        with pytest.raises(ValueError, match="eps"):
            run_on(device, backend, rlkernels.masked_whiten, torch.randn(3, 4), torch.ones(3, 4), shift_mean=shift_mean, eps=bad)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_eps_zero_allowed(device, backend, csrc_ops):
    gen = torch.Generator().manual_seed(13)
    s = torch.randn(12, generator=gen)  # [N]
    truth = reference.group_advantages(s.double(), 4, eps=0.0)  # [N]
    assert rel_error(run_on(device, backend, rlkernels.group_advantages, s, 4, eps=0), truth) <= REL_TOL[torch.float32]
    x, m = torch.randn(3, 7, generator=gen), torch.rand(3, 7, generator=gen) < 0.7  # [B, T] x2
    truth = reference.masked_whiten(x.double(), m, eps=0.0)  # [B, T]
    assert rel_error(run_on(device, backend, rlkernels.masked_whiten, x, m, eps=0.0), truth) <= REL_TOL[torch.float32]


def test_integer_options_beyond_64_bits_and_unsupported_mask_dtypes_are_named():
    """Past int64 an option cannot reach the op's schema (torch's own type error would not name it); an
    unsigned mask other than uint8 is refused by a message that lists what is accepted."""
    with pytest.raises(ValueError, match="^group_size must fit in 64 bits"):
        rlkernels.group_advantages(torch.zeros(0), 2**63)  # any size divides an empty batch
    with pytest.raises(ValueError, match="^group_size must fit in 64 bits"):
        rlkernels.process_advantages(torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), 3, group_size=2**63)
    r = torch.zeros(1, 2)  # [B, T]
    with pytest.raises(TypeError, match=r"^mask must be a bool, floating-point, int8/16/32/64 or uint8 tensor"):
        rlkernels.gae(r, r, torch.ones(1, 2, dtype=torch.uint16))
    out = rlkernels.process_advantages(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), np.int64(3), group_size=2)
    assert out.shape == (2, 3)  # T as a NumPy integer, like group_size


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_bad_input_list_raises_naming_the_argument(device, backend, csrc_ops):
    """DESIGN.md's bad-input list for these ops, on every backend (validation precedes dispatch)."""
    s = torch.randn(12)  # [N]
    for gs in (5, 7, 24):  # does not divide N = 12
        with pytest.raises(ValueError, match="group_size"):
            run_on(device, backend, rlkernels.group_advantages, s, gs)
    for mode in ("ppo", "GRPO", ""):
        with pytest.raises(ValueError, match="mode"):
            run_on(device, backend, rlkernels.group_advantages, s, 4, mode=mode)
        with pytest.raises(ValueError, match="mode"):
            run_on(device, backend, rlkernels.group_advantages, s, index=torch.zeros(12, dtype=torch.int64), mode=mode)
    with pytest.raises(ValueError, match="eps"):
        run_on(device, backend, rlkernels.group_advantages, s, 4, eps=-1e-6)
    with pytest.raises(ValueError, match="eps"):
        run_on(device, backend, rlkernels.masked_whiten, s, torch.ones(12), eps=float("nan"))
    r, v, m = torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)  # [B, T] x3
    with pytest.raises(ValueError, match="gamma"):
        run_on(device, backend, rlkernels.gae, r, v, m, gamma=1.01)
    with pytest.raises(ValueError, match="lam"):
        run_on(device, backend, rlkernels.gae, r, v, m, lam=-0.5)
    with pytest.raises(TypeError, match="gamma"):
        run_on(device, backend, rlkernels.gae, r, v, m, gamma="0.9")


def test_reference_group_advantages_checks_mode_up_front():
    # every group constant: the per-group loop never reaches a mode branch, yet the mode is wrong
    with pytest.raises(ValueError, match="mode"):
        reference.group_advantages(torch.ones(6, dtype=torch.float64), 3, mode="ppo")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_empty_batches(device, backend, mask_dtype, csrc_ops):
    for B, T in ((0, 5), (3, 0), (0, 0)):
        r, v, m = torch.randn(B, T), torch.randn(B, T), torch.ones(B, T, dtype=mask_dtype)  # [B, T] x3
        a, ret = run_on(device, backend, rlkernels.gae, r, v, m, gamma=0.9, lam=0.95)
        assert a.shape == (B, T) and ret.shape == (B, T) and a.dtype == ret.dtype == torch.float32
        for shift_mean in (True, False):
            w = run_on(device, backend, rlkernels.masked_whiten, r, m, shift_mean=shift_mean)
            assert w.shape == (B, T) and w.dtype == torch.float32
    for mode in adv_mod.GROUP_MODES:
        for kwargs in ({"group_size": 4}, {"index": torch.zeros(0, dtype=torch.int64)}):
            g = run_on(device, backend, rlkernels.group_advantages, torch.randn(0), mode=mode, **kwargs)
            assert g.shape == (0,) and g.dtype == torch.float32


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_ops_compute_in_float32_under_autocast(device, backend, autocast_dtype, csrc_ops):
    """Every op gives the no-autocast result inside torch.autocast (values near 8.7: a bf16
    matmul in the torch GAE path was off by ~0.05 there)."""
    gen = torch.Generator().manual_seed(14)
    r, v, m = gae_inputs(4, 70, "gaps", "per-token", torch.float32, gen)  # [B, T] x3
    v = v + 8.7  # [B, T]
    s = torch.randn(16, generator=gen) + 8.7  # [N]
    x = torch.randn(4, 70, generator=gen) + 8.7  # [B, T]

    def ops():
        rd, vd, md, sd, xd = on_device(device, r, v, m, s, x)
        a, ret = rlkernels.gae(rd, vd, md, gamma=0.99, lam=0.95)
        return tuple(t.cpu() for t in (a, ret, rlkernels.group_advantages(sd, 4), rlkernels.masked_whiten(xd, md)))

    with forced_backend(backend):
        plain = ops()
        with torch.autocast(device, dtype=autocast_dtype):
            autocast = ops()
    for name, p, q in zip(("advantages", "returns", "group_advantages", "masked_whiten"), plain, autocast):
        assert q.dtype == torch.float32, name
        assert torch.equal(torch.nan_to_num(p), torch.nan_to_num(q)), f"{backend} {name}: max diff {(p - q).abs().max()}"
    truth_a, _ = reference.gae(r.double(), v.double(), m, gamma=0.99, lam=0.95)
    assert rel_error(autocast[0][m], truth_a[m]) <= REL_TOL[torch.float32]


@pytest.mark.parametrize("backend", ["torch", "triton", "csrc"])
@pytest.mark.parametrize("shift", [1e6, -3.0e5, 0.0])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_shifted_data(backend, shift, shift_mean, csrc_ops):
    """1e6 + N(0, 3): float32 inputs near 1e6 are exact, but a float32 mean of them is only
    known to ~ulp(1e6)/2 = 0.03, i.e. 1% of the spread. Eager PyTorch (the reference in the
    inputs' dtype) pays that; the kernels shift by a pivot (or keep the mean in double) and must
    stay within the ordinary float32 tolerance of the float64 truth, and no worse than eager.
    N = 20000 gives the Triton launcher several programs of several blocks each; the first
    blocks are all masked out (they must not leave a bad pivot) and hold huge values."""
    gen = torch.Generator().manual_seed(15)
    N = 20000
    x = (torch.randn(N, generator=gen, dtype=torch.float64) * 3 + shift).float()  # [N]: exact in float32
    mask = torch.rand(N, generator=gen) < 0.8  # [N]
    mask[:5000] = False
    x[:2500] = -1e30
    x[2500:5000] = float("nan")
    x = x.view(40, 500)  # [40, 500]
    mask = mask.view(40, 500)
    truth = reference.masked_whiten(x.double(), mask, shift_mean=shift_mean)  # float64 truth of the float32 inputs
    eager = reference.masked_whiten(x, mask, shift_mean=shift_mean)  # eager PyTorch in float32
    out = run(backend, rlkernels.masked_whiten, x, mask, shift_mean=shift_mean)
    assert_close_to_truth(out[mask], truth[mask], torch.float32, eager=eager[mask], name=f"{backend} masked_whiten")


def test_masked_whiten_shifted_data_is_hard_for_eager():
    """The data above is a real test: eager float32 misses the truth by far more than float32 tolerance."""
    gen = torch.Generator().manual_seed(16)
    x = (torch.randn(20000, generator=gen, dtype=torch.float64) * 3 + 1e6).float()  # [N]
    mask = torch.ones(20000, dtype=torch.bool)
    eager = (x - x.mean()) * torch.rsqrt(x.var() + 1e-8)  # [N] the formula in float32, as eager PyTorch runs it
    err = rel_error(eager, reference.masked_whiten(x.double(), mask))
    assert err > 10 * REL_TOL[torch.float32]


def test_public_docstrings_document_arguments():
    for fn in (rlkernels.gae, rlkernels.group_advantages, rlkernels.masked_whiten):
        doc = fn.__doc__
        assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc, fn.__name__
        assert "mask" in doc or "group_size" in doc
    doc = rlkernels.gae.__doc__
    assert "bool or 0/1" in doc and "[B, T]" in doc and "0.95" in doc and "Monte-Carlo" in doc
    doc = rlkernels.group_advantages.__doc__
    assert "divides" in doc and "index" in doc and "[N]" in doc
    assert "bool or 0/1" in rlkernels.masked_whiten.__doc__


# ---------------------------------------------------------------- ahead-of-time builds


@pytest.mark.parametrize("arch", [80, 90])
def test_triton_aot_compile(arch):
    from rlkernels.testing.aot import compile_config

    configs = adv_mod.aot_configs()
    assert len(configs) == len({c.label + str(c.signature) for c in configs})
    for config in configs:
        report = compile_config(config, arch)
        print(report, f"[{config.signature.get('r_ptr', config.signature.get('x_ptr', config.signature.get('s_ptr')))}]")
        assert report.registers > 0
        assert report.spill_bytes == 0, f"{report}: spills"


@pytest.mark.parametrize("arch", [80, 90])
def test_nvcc_compiles_cuda_sources(arch, tmp_path):
    """Every CUDA source compiles for sm_80 and sm_90 with the extension's own flags (_extension.CUDA_FLAGS), every
    kernel without a spill."""
    nvcc = nvcc_or_skip()
    sources = sorted(f for f in os.listdir(CSRC_DIR) if f.endswith(".cu"))
    assert sources
    for src in sources:
        result = subprocess.run(
            [nvcc, "-c", *_extension.CUDA_FLAGS, "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
             "-Xptxas", "-v",
             os.path.join(CSRC_DIR, src), "-o", str(tmp_path / f"{src}.{arch}.o")],
            capture_output=True, text=True,
        )
        assert result.returncode == 0, result.stderr
        usage = [line for line in result.stderr.splitlines() if "registers" in line or "spill" in line]
        print(f"sm_{arch} {src}:", *usage, sep="\n  ")
        assert not any(" 0 bytes spill" not in line for line in usage if "spill" in line), usage


def test_group_kernels_triton_picks():
    """Groups of one size, contiguous (up to 4096) or index-given, take the tile kernel (many groups per
    program, one pass); unequal index-given groups and larger ones the per-group loop."""
    pytest.importorskip("triton")
    from rlkernels.testing.launches import count_launches

    gen = torch.Generator().manual_seed(17)
    cases = [
        (dict(group_size=2048), 2 * 2048, "_group_tile_kernel"),
        (dict(index=torch.arange(40).repeat_interleave(8)[torch.randperm(320, generator=gen)]), 320, "_group_tile_kernel"),
        (dict(index=torch.arange(30) % 7), 30, "_group_kernel"),
        (dict(group_size=5000), 2 * 5000, "_group_kernel"),
    ]
    for kwargs, N, kernel in cases:
        with forced_backend("triton"), count_launches() as counted:
            rlkernels.group_advantages(torch.randn(N, generator=gen), **kwargs)
        assert [k for k in counted.launches if k.startswith("triton:")] == [f"triton:{kernel}"], (kwargs.keys(), counted.launches)


@pytest.mark.parametrize("backend", ["torch", "triton", "csrc"])
def test_masked_whiten_strided_and_expanded_inputs(backend, csrc_ops):
    # Triton flattened x with reshape, which keeps a stride (a [:, ::2] slice) or stride 0 (expand), and read it
    # at unit stride
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 12, generator=gen)[:, ::2]  # [3, 6] strided
    m = torch.rand(3, 6, generator=gen) < 0.8  # [3, 6]
    truth = reference.masked_whiten(x.double().contiguous(), m)
    with forced_backend(backend):
        out = rlkernels.masked_whiten(x, m)
        constant = rlkernels.masked_whiten(torch.tensor(-0.7).expand(3, 6), (torch.arange(6) % 2 == 0).expand(3, 6))
    assert_close_to_truth(out, truth, torch.float32)
    assert torch.equal(constant, torch.zeros(3, 6))  # one value repeated: whitened to 0


@pytest.mark.parametrize("backend", ["torch", "triton", "csrc"])
def test_gae_nan_or_inf_reaches_only_earlier_tokens(backend, csrc_ops):
    # The reverse recursion carries a non-finite δ_t to the tokens before t only; the torch backend's chunk matmul
    # used to spread it over its whole 32-token chunk (0 · NaN above the diagonal)
    for bad in (float("nan"), float("inf")):
        r = torch.ones(2, 300)  # [B, T]
        r[0, 2] = bad
        r[1, 205] = bad
        v, m = torch.zeros(2, 300), torch.ones(2, 300)  # [B, T] each
        truth, _ = reference.gae(r.double(), v.double(), m)
        with forced_backend(backend):
            adv, _ = rlkernels.gae(r, v, m, gamma=1.0, lam=1.0)
        finite = torch.isfinite(truth)
        assert torch.equal(torch.isfinite(adv), finite) and torch.equal(adv.isnan(), truth.isnan())
        assert torch.allclose(adv[finite].double(), truth[finite], rtol=1e-6)


_HUGE_SCORES = [1e20, 0.0, 0.0, 0.0, 3e38, 3e38, 3e38, 1e38, -3e38, 3e38, -1e38, 2e38, 1e25, -2e25, 3e25, 5.0]


def _huge_close(out, truth):
    """Each group's outputs within float32 rounding of its own scale (an entry next to 3e38 is only known to ~1e31)."""
    scale = truth.abs().reshape(-1, 4).amax(1, keepdim=True).clamp(min=1.0).expand(-1, 4).reshape(-1)
    finite = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(out), finite)
    assert ((out.double() - truth).abs()[finite] <= 4e-7 * scale[finite]).all(), (out, truth)


@pytest.mark.parametrize("device,backend", [p for p in DEVICE_BACKENDS if p.values[1] != "reference"])
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("groups", ["contiguous", "index", "index-unequal", "large"])
def test_group_advantages_of_huge_finite_scores(device, backend, mode, groups, csrc_ops):
    # float32 squares of deviations past ~1.8e19 overflow (and sums near 3.4e38): the torch and csrc backends keep
    # their statistics in float64, the Triton kernels form them on scores scaled by a power of two (they gave NaN
    # and zeros here). dr_grpo / rloo legitimately overflow to -inf where 3e38 - (-3e38) does.
    s = torch.tensor(_HUGE_SCORES)  # [16]
    kwargs = {"group_size": 4}
    if groups == "index":  # groups of one size, interleaved: the tile kernel's gather
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))  # [16]
        index = torch.empty(16, dtype=torch.int64)
        index[perm] = torch.arange(16) // 4
        s, kwargs = s[torch.argsort(perm)], {"index": index}
    if groups == "index-unequal":  # unequal groups: the three-pass kernel
        index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4])  # [16]
        kwargs = {"index": index}
    if groups == "large":  # groups beyond the tile kernel's 4096: the three-pass kernel, contiguous
        s = torch.tensor(_HUGE_SCORES[:4]).repeat_interleave(1500)  # [6000]: 1500 copies of each
        kwargs = {"group_size": 6000}
    truth = reference.group_advantages(s.double(), mode=mode, **kwargs).float().double()  # as float32 holds it
    out = run_on(device, backend, rlkernels.group_advantages, s, mode=mode, **kwargs)
    if groups == "large":
        scale = truth.abs().max().clamp(min=1.0)
        assert torch.equal(torch.isfinite(out), torch.isfinite(truth))
        fin = torch.isfinite(truth)
        assert ((out.double() - truth).abs()[fin] <= 4e-7 * scale).all()
    elif groups == "index-unequal":
        fin = torch.isfinite(truth)
        assert torch.equal(torch.isfinite(out), fin)
        for g in range(5):
            sel = index == g
            scale = truth[sel].abs().max().clamp(min=1.0)
            assert ((out.double() - truth).abs()[sel & fin] <= 4e-7 * scale).all(), (g, out[sel], truth[sel])
    else:
        if groups == "index":  # compare in the groups' order
            out, truth = out[perm], truth[perm]
        _huge_close(out, truth)


@pytest.mark.parametrize("device", devices())
def test_group_advantages_scaling_keeps_ordinary_scores_bitwise(device):
    """The Triton kernels scale a group only past 2**32, and then by a power of two: scores below it give the same
    bits as before, and a group of large scores the same bits as the group divided by a power of two (up to eps)."""
    g = torch.Generator().manual_seed(5)
    s = torch.randn(64, generator=g) * 3.0  # [64]
    small = run_on(device, "triton", rlkernels.group_advantages, s, 8, eps=0.0)
    big = run_on(device, "triton", rlkernels.group_advantages, s * 2.0**80, 8, eps=0.0)
    # index-given groups take another kernel (a gather through the sort), whose sums may round otherwise (compiled:
    # on a GPU they differed in the last bit): its own small-score result is what its scaled one must equal
    index = torch.arange(64) // 8  # [64]
    small_index = run_on(device, "triton", rlkernels.group_advantages, s, index=index, eps=0.0)
    big_index = run_on(device, "triton", rlkernels.group_advantages, s * 2.0**80, index=index, eps=0.0)
    assert torch.equal(small, big) and torch.equal(small_index, big_index)
    torch.testing.assert_close(small_index, small, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("groups", ["contiguous", "index", "index-unequal", "large"])
def test_group_advantages_of_shifted_scores(device, backend, mode, groups, csrc_ops):
    """Scores far from 0 with a spread of a few float32 ulps (1e4 + 1e-3 noise) are exact float32 inputs, so the
    float64 truth of them is what every backend must give to float32 rounding. The Triton kernels rounded the
    group's float32 mean (half an ulp of 1e4 is half the spread) and subtracted it: up to 100 % error, zeros where
    the truth is not; the torch and csrc backends, in float64, were exact. A corrected two-pass mean fixes it."""
    gen = torch.Generator().manual_seed(21)
    n = {"contiguous": 64, "index": 64, "index-unequal": 65, "large": 2 * 4500}[groups]
    s = (torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3 + 1e4).float()  # [n]
    if groups in ("contiguous", "large"):
        kwargs = {"group_size": {"contiguous": 2, "large": 4500}[groups]}
    elif groups == "index":  # pairs, interleaved: the tile kernel's gather
        kwargs = {"index": torch.randperm(n, generator=gen) % (n // 2)}
    else:  # groups of 2 and 3: the three-pass kernel
        kwargs = {"index": torch.arange(n) * 2 // 5}
    truth = reference.group_advantages(s.double(), mode=mode, **kwargs)  # [n]
    out = run_on(device, backend, rlkernels.group_advantages, s, mode=mode, **kwargs)
    assert rel_error(out, truth) <= REL_TOL[torch.float32], (backend, rel_error(out, truth))
    assert torch.equal(out == 0, truth == 0)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("groups", ["contiguous", "index-unequal", "large"])
def test_group_advantages_of_groups_with_inf(device, backend, mode, groups, csrc_ops):
    """A group holding ±inf gives what s - mean gives in float64 (NaN at the inf, ±inf elsewhere; grpo: NaN, its
    std being NaN), on every kernel, whatever the correction of the mean's rounding does to finite groups."""
    inf = float("inf")
    if groups == "large":  # the three-pass kernel, contiguous
        s, kwargs = torch.tensor([inf, 1.0, 2.0]).repeat_interleave(1500), {"group_size": 4500}  # [4500]
    else:
        s = torch.tensor([inf, 1.0, 2.0, -inf, 3.0, 4.0, 4.0, 4.0, 1.0, 5.0, 5.0, 5.0])  # [12]
        kwargs = {"group_size": 3} if groups == "contiguous" else {
            "index": torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4])}
    truth = reference.group_advantages(s.double(), mode=mode, **kwargs)  # [N]
    out = run_on(device, backend, rlkernels.group_advantages, s, mode=mode, **kwargs)
    assert torch.equal(out.isnan(), truth.isnan()) and torch.equal(out.isinf(), truth.isinf())
    fin = torch.isfinite(truth)
    assert torch.equal(out[~fin & ~truth.isnan()], truth[~fin & ~truth.isnan()].float())
    assert rel_error(out[fin], truth[fin]) <= REL_TOL[torch.float32]


# groups of tiny scores (1e-25, float32 denormals down to 1e-45) and one of ordinary ones
_TINY_SCORES = [1e-25, 3e-25, -2e-25, 5e-26, 1e-40, 2e-40, 3e-40, 1e-45, 1.0, 2.0, 3.0, 4.0, -3e-30, 0.0, 1e-31, 2e-30]


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("groups", ["contiguous", "index-unequal", "large"])
def test_group_advantages_of_tiny_scores_without_eps(device, backend, groups, csrc_ops):
    """grpo with eps=0 is scale-free: a group of scores near 1e-25 (or denormals) gets advantages of order 1. The
    Triton kernels squared deviations of that size in float32, which flush to 0: std 0 and every output ±inf/NaN
    (the torch and csrc backends keep float64 statistics)."""
    s = torch.tensor(_TINY_SCORES)  # [16]
    kwargs = {"group_size": 4}
    if groups == "index-unequal":  # unequal groups: the three-pass kernel
        kwargs = {"index": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4])}  # [16]
    if groups == "large":  # a group beyond the tile kernel's 4096: the three-pass kernel, contiguous
        s = s[:4].repeat(1500)  # [6000]
        kwargs = {"group_size": 6000}
    truth = reference.group_advantages(s.double(), mode="grpo", eps=0.0, **kwargs)  # [N]
    out = run_on(device, backend, rlkernels.group_advantages, s, mode="grpo", eps=0.0, **kwargs)
    assert torch.isfinite(out).all(), out
    assert rel_error(out, truth) <= REL_TOL[torch.float32]

@pytest.mark.parametrize("device,backend", [p for p in DEVICE_BACKENDS if p.values[1] != "reference"])
@pytest.mark.parametrize("scale", [1e19, 1e30])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_huge_finite_values(device, backend, scale, shift_mean, csrc_ops):
    # float32 squares overflow above 1.8e19: the torch path's variance became inf and every output 0 (csrc sums
    # float64 squares; the Triton merge kernel then recomputes the statistics of x·2**-100: it gave all zeros).
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]) * scale  # [1, 5]
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)  # [1, 5]
    truth = reference.masked_whiten(x.double(), mask, shift_mean=shift_mean)  # [1, 5]
    got = run_on(device, backend, rlkernels.masked_whiten, x, mask, shift_mean=shift_mean)
    assert torch.isfinite(got).all()
    assert rel_error(got[mask], truth[mask]) <= REL_TOL[torch.float32]


@pytest.mark.parametrize("device,backend", [p for p in DEVICE_BACKENDS if p.values[1] != "reference"])
def test_whiten_extreme_values_over_many_tiles(device, backend, csrc_ops):
    """Values up to ±3e38 spread over several programs' shares (their means ~1e38 apart: the merge overflows too),
    with masked-out infinities and NaN, in bfloat16 and float32; a masked-in NaN still gives NaN everywhere."""
    g = torch.Generator().manual_seed(11)
    n = 3 * 4096 + 77
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, generator=g) * 1e37  # [n]
        x[: n // 3] += 1e38
        x[-100:] = 3e38
        mask = torch.rand(n, generator=g) < 0.8  # [n]
        x[~mask & (torch.arange(n) % 3 == 0)] = float("inf")
        x[~mask & (torch.arange(n) % 3 == 1)] = float("nan")
        x = x.to(dtype)
        truth = reference.masked_whiten(x.double(), mask)  # [n]
        got = run_on(device, backend, rlkernels.masked_whiten, x, mask)
        assert rel_error(got[mask], truth[mask]) <= REL_TOL[torch.float32], dtype
        x[5] = float("nan")
        mask[5] = True
        got = run_on(device, backend, rlkernels.masked_whiten, x, mask)
        assert got[mask].isnan().all(), dtype


# all equal and so large that their float32 sum overflows: the Triton kernels' rescue (the statistics of x·2**-100),
# with a masked-out entry near them (its output finite: -2.4e32 · rsqrt(1e-8))
_EQUAL_HUGE = torch.tensor([3e38, 3e38, 3e38, 3e38, 3e38 - 2.4e32])
_EQUAL_HUGE_MASK = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_equal_values_whose_sum_overflows(device, backend, shift_mean, csrc_ops):
    """Masked-in values all equal (variance exactly 0) whose float32 sum overflows: the Triton rescue's scale made
    eps's share of the variance eps·2**-200, which flushes to 0 in float32, so rsqrt gave inf and every output
    0·inf = NaN. The outputs are the deviations times rsqrt(eps): 0 at the masked-in entries."""
    x, mask = _EQUAL_HUGE[None], _EQUAL_HUGE_MASK[None]  # [1, 5] each
    truth = reference.masked_whiten(x.double(), mask, shift_mean=shift_mean)  # [1, 5]
    got = run_on(device, backend, rlkernels.masked_whiten, x, mask, shift_mean=shift_mean)
    assert torch.isfinite(got).all(), got
    assert rel_error(got, truth) <= REL_TOL[torch.float32]
    assert torch.equal(got[mask], truth[mask].float())  # exactly 0, or the mean itself with shift_mean=False


def test_group_size_takes_numpy_integers_and_int16_masks_are_masks():
    np = pytest.importorskip("numpy", reason="the NumPy integer case needs numpy")
    scores = torch.randn(6, generator=torch.Generator().manual_seed(2))  # [6]
    torch.testing.assert_close(rlkernels.group_advantages(scores, np.int64(3)), rlkernels.group_advantages(scores, 3))
    with pytest.raises(TypeError, match="group_size"):
        rlkernels.group_advantages(scores, 3.0)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))  # [2, 5]
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])  # [2, 5]
    torch.testing.assert_close(rlkernels.masked_whiten(x, mask.to(torch.int16)), rlkernels.masked_whiten(x, mask.bool()))


def test_cuda_default_is_the_measured_kernel(monkeypatch):
    """On CUDA, gae, group_advantages and masked_whiten default to their csrc kernels when the extension has CUDA
    kernels (the H100 and H200 measurements chose them), to Triton otherwise; process_advantages (no csrc kernel)
    to Triton; RLKERNELS_BACKEND still wins. (The device is only named: the choice is made before any tensor
    exists.)"""
    cuda = torch.device("cuda")
    monkeypatch.delenv("RLKERNELS_BACKEND", raising=False)
    for has_kernels in (True, False):
        monkeypatch.setattr(_backend, "csrc_available", lambda device, ok=has_kernels: ok)
        gae_default = _backend.resolve(cuda, adv_mod._SUPPORTED, torch.float32, cuda_default="csrc")
        assert gae_default == ("csrc" if has_kernels else "triton")
        assert _backend.resolve(cuda, adv_mod._SUPPORTED, torch.float32) == "triton"
        with forced_backend("torch"):
            assert _backend.resolve(cuda, adv_mod._SUPPORTED, torch.float32, cuda_default="csrc") == "torch"
    # each op asks for it: its own resolution goes through cuda_default="csrc" (process_advantages: "triton")
    seen = []
    real = _backend.resolve

    def spy(device, supported, dtype=None, **kwargs):
        seen.append(kwargs.get("cuda_default", "triton"))
        return real(device, supported, dtype, **kwargs)

    monkeypatch.setattr(adv_mod.backends, "resolve", spy)
    mask = torch.ones(2, 5, dtype=torch.bool)
    rlkernels.gae(torch.randn(2, 5), torch.randn(2, 5), mask)
    rlkernels.group_advantages(torch.randn(8), 4)
    rlkernels.masked_whiten(torch.randn(2, 5), mask)
    assert seen == ["csrc"] * 3
    rlkernels.process_advantages(torch.randn(2, 1), torch.full((2, 1), 4), 5, group_size=2)
    assert seen[3:] == ["triton"]


# ---------------------------------------------------------------- the CUDA group kernel's source, emulated on the CPU

@pytest.fixture(scope="module")
def emulated_group_kernel(tmp_path_factory):
    """``csrc/group_segment_kernel.h`` (the CUDA kernel for contiguous groups of up to 256 scores and its launch
    plan) under ``tests/cuda_emulated/cuda_warp_emulator.h`` (a block's threads as host threads, shuffles and
    __syncthreads through barriers): a runner ``(scores, group_size, mode, offset) -> (outputs, plan)``."""
    exe = build_emulated(tmp_path_factory, "group_segment_main.cpp")

    def run(scores: torch.Tensor, group_size: int, mode: str, offset: int = 0):
        G = scores.numel() // group_size
        done = subprocess.run([exe, str(G), str(group_size), str(reference.GROUP_MODES.index(mode)), "1e-6", str(offset)],
                              input=scores.float().numpy().tobytes(), capture_output=True)
        assert done.returncode in (0, 4), done.stderr.decode()[-3000:]  # 4: the plan refused the group size
        usable, vec, width, blocks = (int(v) for v in done.stderr.decode().split()[:4])
        plan = dict(usable=usable, vec=vec, width=width, blocks=blocks)
        if done.returncode == 4:
            return None, plan
        return torch.from_numpy(np.frombuffer(done.stdout, dtype=np.float32).copy()), plan  # [N]

    return run


@pytest.mark.parametrize("mode", reference.GROUP_MODES)
def test_csrc_group_kernel_source_runs_on_the_cpu_under_a_warp_emulator(emulated_group_kernel, mode):
    """The CUDA kernel's own source on the CPU: every group size it takes (1..256: segments of 1-32 lanes of 8
    scores, idle lanes and slots, the 16-byte path for sizes that are multiples of 4 on aligned memory and the scalar
    one otherwise or when misaligned), group counts that leave the last block part-filled, a constant group (exactly
    0), a NaN group (NaN there only) and scores near 3e38 (the float64 statistics). AddressSanitizer fails the run on
    any access outside the scores and outputs."""
    gen = torch.Generator().manual_seed(21)
    for group_size in (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 63, 64, 100, 127, 128, 129, 200, 255, 256):
        G = 37 if group_size <= 64 else 11
        scores = torch.randn(G * group_size, generator=gen) * 3 + 1  # [N]
        scores[group_size:2 * group_size] = 0.7  # a constant group
        if group_size > 1:
            scores[5 * group_size + 1] = float("nan")  # group 5 is NaN throughout
        scores[-group_size:] *= 1e38 / scores[-group_size:].abs().max()  # the last group near float32's largest
        truth = reference.group_advantages(scores.double(), group_size, mode=mode)  # [N]
        for offset in (0, 1):
            out, plan = emulated_group_kernel(scores, group_size, mode, offset)
            assert plan["usable"] == 1 and plan["vec"] == (group_size % 4 == 0 and offset == 0), (group_size, offset, plan)
            assert plan["width"] == 1 << max(0, (group_size + 7) // 8 - 1).bit_length(), (group_size, plan)
            assert torch.equal(torch.isnan(out), torch.isnan(truth)), (group_size, offset)
            assert torch.all(out[group_size:2 * group_size] == 0), (group_size, offset)
            finite = torch.isfinite(truth)
            assert torch.equal(torch.isfinite(out), finite), (group_size, offset)
            body = slice(0, (G - 1) * group_size)  # all but the huge group: the float32 tolerance
            assert rel_error(out[body][finite[body]], truth[body][finite[body]]) <= REL_TOL[torch.float32], (group_size, offset)
            last = slice((G - 1) * group_size, None)  # the huge group: within float32 rounding of its own scale
            scale = truth[last].abs().max().clamp(min=1.0)
            assert ((out[last].double() - truth[last]).abs() <= 4e-7 * scale).all(), (group_size, offset)


def test_csrc_group_kernel_plan_refuses_what_it_cannot_take(emulated_group_kernel):
    """Past 256 scores per group the plan refuses (group_advantages then takes the one-warp-per-group kernel)."""
    for group_size in (257, 300):
        out, plan = emulated_group_kernel(torch.randn(2 * group_size), group_size, "grpo")
        assert out is None and plan["usable"] == 0, plan
    out, plan = emulated_group_kernel(torch.randn(2 * 256), 256, "grpo")
    assert out is not None and plan == dict(usable=1, vec=1, width=32, blocks=1)


@pytest.fixture(scope="module")
def emulated_whiten_kernels(tmp_path_factory):
    """``csrc/whiten_kernels.h`` (masked_whiten's CUDA kernels) under the warp emulator, chosen as the extension
    chooses them: a runner ``(x, mask, shift_mean, x_offset, mask_offset, resident, fused) -> (outputs, blocks, vec,
    head, ran_fused)`` for float32, bfloat16 or float16 x (its own dtype's bytes go in). ``fused``: the cooperative
    kernel where it takes the memory (``ran_fused`` 1; ``vec`` then -1), else and with ``fused=False`` the three
    passes (``vec``: their statistics kernel's 16-byte variant)."""
    exe = build_emulated(tmp_path_factory, "whiten_main.cpp")
    names = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

    def run(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, x_offset: int = 0, mask_offset: int | None = None,
            resident: int | None = None, fused: bool = True):
        raw = x.view(torch.int32 if x.dtype == torch.float32 else torch.int16).numpy().tobytes()
        data = raw + mask.numpy().astype(np.uint8).tobytes()
        mask_offset = x_offset if mask_offset is None else mask_offset
        wave = -1 if resident is None else resident
        done = subprocess.run([exe, names[x.dtype], str(x.numel()), str(int(shift_mean)), "1e-8", str(x_offset),
                               str(mask_offset), str(wave), str(int(fused))], input=data, capture_output=True,
                              timeout=600)  # a grid barrier the blocks do not all reach must fail, not hang
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        blocks, vec, head, ran_fused = (int(v) for v in done.stderr.split()[:4])
        return torch.from_numpy(np.frombuffer(done.stdout, dtype=np.float32).copy()), blocks, vec, head, ran_fused

    return run


def test_csrc_whiten_kernels_source_run_on_the_cpu_under_a_warp_emulator(emulated_whiten_kernels):
    """masked_whiten's CUDA kernels from their own source on the CPU, the fused cooperative kernel (several blocks
    meeting at its grid barriers) and the three passes: sizes from one element to far past the block cap (8 in the
    driver, 1024 in the extension; the pivot search, whole chunks of 8 and the partial chunks at both ends), shifted
    data (1e6 + noise: the pivots), an empty and a one-entry mask, scores whose squares overflow float32 (the rescue:
    the fused kernel's over the grid, the merge kernel's in one block), a masked-in NaN (NaN throughout) and
    masked-out NaN/inf (reaching no other output), memory offset alike (the 16-byte paths after a head: the fused
    kernel where the output's chunks are aligned too) and differently (x element by element: the passes), and
    bfloat16 / float16 x (their 16-byte widening). AddressSanitizer fails the run on any access outside x, the mask
    and the outputs."""
    gen = torch.Generator().manual_seed(23)
    cases = []
    for N in (1, 2, 5, 1023, 1025, 4099, 70001):
        x = torch.randn(N, generator=gen) * 3 + 1  # [N]
        cases.append((f"N={N}", x, torch.rand(N, generator=gen) < 0.7))
    x = 1e6 + torch.randn(5000, generator=gen)  # shifted data
    cases.append(("shifted", x, torch.rand(5000, generator=gen) < 0.7))
    cases.append(("empty mask", torch.randn(300, generator=gen), torch.zeros(300, dtype=torch.bool)))
    one = torch.zeros(300, dtype=torch.bool)
    one[17] = True
    cases.append(("one entry", torch.randn(300, generator=gen), one))
    huge = torch.randn(3000, generator=gen) * 3e37  # deviations whose float32 squares overflow
    cases.append(("huge", huge, torch.rand(3000, generator=gen) < 0.7))
    bad = torch.randn(2000, generator=gen)
    bad_mask = torch.rand(2000, generator=gen) < 0.7
    bad[~bad_mask] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(2000)[: int((~bad_mask).sum())]
    cases.append(("masked-out NaN/inf", bad, bad_mask))
    nan_in = torch.randn(2000, generator=gen)
    nan_in[3] = float("nan")
    cases.append(("masked-in NaN", nan_in, torch.ones(2000, dtype=torch.bool)))
    late = torch.zeros(3000, dtype=torch.bool)
    late[2500:] = torch.rand(500, generator=gen) < 0.5  # most threads find no pivot; the rest find it late
    cases.append(("late pivots", torch.randn(3000, generator=gen) * 5 + 40, late))
    cases.append(("N=9", torch.randn(9, generator=gen), torch.rand(9, generator=gen) < 0.7))  # head and tail only
    # mask bytes other than 0/1 (a uint8 mask; the extension passes bool): nonzero is masked in, counted once
    byte_values = torch.tensor([0, 0, 1, 2, 127, 128, 255], dtype=torch.uint8)
    byte_mask = byte_values[torch.randint(0, 7, (2000,), generator=gen)]  # [2000]
    cases.append(("mask bytes", torch.randn(2000, generator=gen), byte_mask))
    # (x offset, mask offset) in elements -> (16-byte loads of x, head): the driver's allocations are 16-byte aligned;
    # the fused kernel takes the layouts whose x and output chunks are both 16-byte aligned (here: those with
    # 16-byte loads of x, the output offset as x is)
    layouts = {torch.float32: {(0, 0): (1, 0), (1, 1): (1, 7), (3, 1): (0, 7)},
               torch.bfloat16: {(0, 0): (1, 0), (3, 3): (1, 5), (2, 1): (0, 7)}}
    ran = set()
    for name, x, mask in cases:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)  # [N]
            for shift_mean, fused in ((True, True), (False, True), (False, False)):
                truth = reference.masked_whiten(xd.double(), mask, shift_mean=shift_mean)  # [N]
                for (x_offset, mask_offset), (want_vec, want_head) in layouts[dtype].items():
                    out, blocks, vec, head, ran_fused = emulated_whiten_kernels(xd, mask, shift_mean, x_offset,
                                                                                mask_offset, fused=fused)
                    where = (name, dtype, shift_mean, x_offset, mask_offset, fused)
                    assert blocks == min(8, max(1, -(-x.numel() // 1024))), (where, blocks)  # the driver's cap: 8
                    assert ran_fused == (fused and want_vec == 1), where
                    assert (vec, head) == ((-1 if ran_fused else want_vec), want_head), where
                    ran.add((ran_fused, blocks > 1))
                    assert torch.equal(torch.isnan(out), torch.isnan(truth)), where
                    fin = torch.isfinite(truth)
                    assert torch.equal(torch.isfinite(out), fin), where
                    if fin.any():
                        err = rel_error(out[fin], truth[fin])
                        assert err <= REL_TOL[torch.float32], (where, err)
    assert ran == {(True, True), (True, False), (False, True), (False, False)}  # each path with one and many blocks
    half = (torch.randn(3001, generator=gen) * 4 - 2).half()  # float16's widening (no 16-byte path differs)
    half_mask = torch.rand(3001, generator=gen) < 0.6
    for fused in (True, False):
        for x_offset, mask_offset in ((0, 0), (5, 5), (1, 6)):
            out, *_, ran_fused = emulated_whiten_kernels(half, half_mask, False, x_offset, mask_offset, fused=fused)
            assert ran_fused == (fused and x_offset == mask_offset)  # (5, 5): head 3, x + 3 + 5 elements aligned
            truth = reference.masked_whiten(half.double(), half_mask, shift_mean=False)  # [3001]
            assert rel_error(out, truth) <= REL_TOL[torch.float32], (x_offset, mask_offset, fused)
    # far past the cap: 8 blocks, ~20 chunks per thread
    N = 40003
    x = torch.randn(N, generator=gen) * 2 - 5
    mask = torch.rand(N, generator=gen) < 0.6
    for fused in (True, False):
        out, blocks, _, _, ran_fused = emulated_whiten_kernels(x, mask, True, fused=fused)
        assert blocks == 8 and ran_fused == fused
        assert rel_error(out, reference.masked_whiten(x.double(), mask)) <= REL_TOL[torch.float32]
    # squares that overflow in block 0's share alone (elements 0..2047: its threads' first chunks): only that
    # block's partial moments are inf, so every block must see them before block 0 replaces them with the rescue's
    # (the fused kernel's grid barrier between its merge and the rescue's first pass)
    lopsided = x.clone()
    lopsided[:2048] = torch.randn(2048, generator=gen) * 3e37
    for fused in (True, False):
        out, blocks, _, _, ran_fused = emulated_whiten_kernels(lopsided, mask, False, fused=fused)
        assert blocks == 8 and ran_fused == fused
        truth = reference.masked_whiten(lopsided.double(), mask, shift_mean=False)  # [N]
        assert rel_error(out, truth) <= REL_TOL[torch.float32], fused
    # a device that holds fewer blocks than the cap (the extension passes SMs x blocks per SM): the grid is one wave
    # of them, each thread taking more chunks; nonsense (0) still gives one block
    for resident, want in ((3, 3), (1, 1), (0, 1), (100, 8)):
        for fused in (True, False):
            out, blocks, *_ = emulated_whiten_kernels(x, mask, False, resident=resident, fused=fused)
            assert blocks == want, (resident, blocks)
            truth = reference.masked_whiten(x.double(), mask, shift_mean=False)  # [N]
            assert rel_error(out, truth) <= REL_TOL[torch.float32], (resident, fused)


@pytest.fixture(scope="module")
def emulated_gae_kernel(tmp_path_factory):
    """``csrc/gae_kernel.h`` (gae's CUDA kernel, float32 inputs, launched by its own ``gae_passes``) under the warp
    emulator: a runner ``(rewards, values, mask, gamma, lam, offset) -> (advantages, returns, vec)``."""
    exe = build_emulated(tmp_path_factory, "gae_main.cpp")

    def run(rewards, values, mask, gamma, lam, offset=0):
        B, T = rewards.shape
        data = rewards.float().numpy().tobytes() + values.float().numpy().tobytes() + mask.numpy().astype(np.uint8).tobytes()
        done = subprocess.run([exe, str(B), str(T), repr(gamma), repr(lam), str(offset)], input=data, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        out = torch.from_numpy(np.frombuffer(done.stdout, dtype=np.float32).copy()).view(2, B, T)  # [2, B, T]
        return out[0], out[1], int(done.stderr.split()[0])

    return run


def test_csrc_gae_kernel_source_runs_on_the_cpu_under_a_warp_emulator(emulated_gae_kernel):
    """gae's CUDA kernel from its own source on the CPU: rows shorter than a tile, of exactly one and two tiles (2048
    tokens each), a partial last tile, right padding, interior gaps (multi-turn), an all-masked row, gamma and lam
    below 1, the 16-byte path (rows of a multiple of 8 tokens, aligned) and the scalar one (odd lengths, misaligned
    memory). AddressSanitizer fails the run on any access outside the inputs and outputs."""
    gen = torch.Generator().manual_seed(29)
    for T in (1, 7, 8, 300, 2048, 2049, 4096, 4100):
        B = 3
        rewards = torch.randn(B, T, generator=gen)  # [B, T]
        values = torch.randn(B, T, generator=gen)  # [B, T]
        mask = torch.rand(B, T, generator=gen) < 0.6  # [B, T]: gaps
        mask[0] = torch.arange(T) < max(1, T - 5)  # right-padded
        mask[2] = False  # nothing valid
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
            adv_t, ret_t = reference.gae(rewards.double(), values.double(), mask, gamma=gamma, lam=lam)
            for offset in (0, 1):
                adv, ret, vec = emulated_gae_kernel(rewards, values, mask, gamma, lam, offset)
                assert vec == (T % 8 == 0 and offset == 0), (T, offset)
                assert rel_error(adv, adv_t) <= REL_TOL[torch.float32], (T, gamma, offset)
                assert rel_error(ret, ret_t) <= REL_TOL[torch.float32], (T, gamma, offset)
                assert torch.all(adv[~mask] == 0), (T, offset)
    # NaN and inf: at masked-out positions they reach no advantage (returns there are the values themselves, as in
    # the truth); a NaN reward at a valid token makes it and the valid tokens before it NaN, no later one
    T = 2100  # two tiles: the NaN crosses the tile boundary and the warps
    rewards = torch.randn(2, T, generator=gen)  # [2, T]
    values = torch.randn(2, T, generator=gen)  # [2, T]
    mask = torch.rand(2, T, generator=gen) < 0.7  # [2, T]
    out_pos = (~mask).nonzero()
    rewards[out_pos[::2, 0], out_pos[::2, 1]] = float("nan")
    values[out_pos[1::2, 0], out_pos[1::2, 1]] = float("inf")
    valid1 = mask[1].nonzero().flatten()
    rewards[1, valid1[len(valid1) // 2]] = float("nan")  # a valid NaN in row 1 only
    adv_t, ret_t = reference.gae(rewards.double(), values.double(), mask, gamma=0.99, lam=0.95)
    assert adv_t[0].isfinite().all() and adv_t[1].isnan().any()
    for offset in (0, 1):
        adv, ret, _ = emulated_gae_kernel(rewards, values, mask, 0.99, 0.95, offset)
        for got, want in ((adv, adv_t), (ret, ret_t)):
            assert torch.equal(got.isnan(), want.isnan()), offset
            assert torch.equal(got.isinf(), want.isinf()), offset
            fin = want.isfinite()
            assert rel_error(got[fin], want[fin]) <= REL_TOL[torch.float32], offset


@pytest.mark.parametrize("backend", [None, *all_backends()])
def test_float64_whiten_keeps_what_float32_would_round_away(backend, csrc_ops):
    """float64 x = 1e6 + 1e-4·noise: the kernels (csrc, the CPU default, and Triton) would round x to float32
    first (ulp 0.0625: all of the noise gone, outputs off by their whole scale); float64 stays on torch, which
    computes in float64, whichever backend is asked for (None: the default), so every backend gives the float64
    truth to float32 rounding of the output."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 300, generator=gen, dtype=torch.float64) * 1e-4 + 1e6  # [B, T] float64
    mask = torch.rand(4, 300, generator=gen) > 0.3  # [B, T]
    assert backend_for(torch.device("cpu"), torch.float64) == "torch"
    with forced_backend(backend):
        got = rlkernels.masked_whiten(x, mask)  # [B, T] float32
    truth = reference.masked_whiten(x, mask)  # [B, T] float64
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [None, *all_backends()])
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_float64_scores_are_not_rounded_to_float32_first(backend, mode, csrc_ops):
    """float64 scores 1 and 1 + 1e-12 differ; rounded to float32 first (as every backend did) they are one value,
    the group constant, and its advantages 0 where the float64 truth is ±5e-7 (grpo). float64 stays on torch,
    whose statistics are float64, for a group_size and for index ids."""
    s = torch.tensor([1.0, 1.0 + 1e-12, 1e4 + 1e-9, 1e4, 3.0, 3.0], dtype=torch.float64)  # [N]
    ids = torch.tensor([0, 0, 1, 1, 2, 2])  # [N]
    truth = reference.group_advantages(s, 2, mode=mode)  # [N] float64
    with forced_backend(backend):
        by_size = rlkernels.group_advantages(s, 2, mode=mode)  # [N] float32
        by_index = rlkernels.group_advantages(s, index=ids, mode=mode)  # [N] float32
    for got in (by_size, by_index):
        assert got.dtype == torch.float32
        assert torch.count_nonzero(got[:4]) == 4 and torch.count_nonzero(got[4:]) == 0
        torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=0.0)
