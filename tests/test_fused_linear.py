"""linear_logprobs against the float64 reference, for every backend the machine runs."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from unittest import mock

import pytest
import torch

from rlkernels import fused_linear as fl_module
from rlkernels import reference
from rlkernels._backend import TRITON_DTYPES
from rlkernels._host import lse_merge, option_values, options_from
from rlkernels.testing.memory import measure_cpu
from rlkernels.fused_linear import aot_configs, linear_logprobs
from tests.helpers import REL_TOL, assert_close_to_truth, backends, devices, forced_backend, noncontiguous

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(N, H, V, *, bias, seed, ignore=True, lead=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)  # [N, H]
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (1.5 / H**0.5)  # [V, H]
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if bias else None  # [V]
    labels = torch.randint(0, V, (N,), generator=g)  # [N]
    if ignore:
        labels[::5] = -100
    g_logp = torch.randn(N, generator=g, dtype=torch.float64)  # [N]
    g_ent = torch.randn(N, generator=g, dtype=torch.float64)  # [N]
    if lead is not None:
        hidden, labels = hidden.reshape(*lead, H), labels.reshape(lead)
        g_logp, g_ent = g_logp.reshape(lead), g_ent.reshape(lead)
    return hidden, weight, b, labels, g_logp, g_ent


def _run(fn, hidden, weight, bias, labels, g_logp, g_ent, temperature):
    """Forward with entropy, then gradients of Σ g_logp·logp + g_ent·H w.r.t. hidden, weight, bias."""
    leaves = [hidden, weight] + ([bias] if bias is not None else [])
    logp, ent = fn(hidden, weight, labels, bias=bias, temperature=temperature, return_entropy=True)
    loss = (logp * g_logp.to(logp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return logp, ent, grads


def _leaf(x, dtype, noncontig=False, device="cpu"):
    if x is None:
        return None
    y = x.detach().to(dtype).to(device)
    if noncontig:
        y = noncontiguous(y)
    return y.requires_grad_()


CASES = [
    # N, H, V, bias, temperature, dtype, noncontiguous hidden
    (37, 48, 1000, False, 1.0, torch.float32, False),
    (29, 100, 4097, True, 0.7, torch.float32, True),
    (33, 100, 1000, True, 1.3, torch.bfloat16, False),
    (21, 48, 4097, False, 0.7, torch.bfloat16, True),
    (40, 48, 1000, True, 1.0, torch.float16, False),
    (19, 100, 1000, False, 1.3, torch.float16, True),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_float64_returns_float32_computed_in_float64(backend):
    """DESIGN: log-probabilities come back in float32 whatever the input dtype. float64 inputs still compute in
    float64 (the chunked torch row serves them on every backend that can), so the outputs are the truth rounded
    once to float32, and the gradients keep their leaves' dtype, float64."""
    hidden, weight, b, labels, g_logp, g_ent = _inputs(23, 40, 1000, bias=True, seed=5)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, b)]
    truth = _run(reference.linear_logprobs, *leaves[:2], leaves[2], labels, g_logp, g_ent, 0.7)
    with forced_backend(backend):
        out = _run(linear_logprobs, *leaves[:2], leaves[2], labels, g_logp, g_ent, 0.7)
        assert linear_logprobs(hidden, weight, labels).dtype == torch.float32  # without the entropy too
    for name, o, t in zip(("logp", "entropy"), out[:2], truth[:2]):
        assert o.dtype == torch.float32, f"{name}: {o.dtype}"
        assert_close_to_truth(o, t.float(), torch.float64, name=name, tol=1e-7)
    for name, o, t in zip(("d_hidden", "d_weight", "d_bias"), out[2], truth[2]):
        assert o.dtype == torch.float64, f"{name}: {o.dtype}"
        assert_close_to_truth(o, t, torch.float64, name=name, tol=1e-7)  # the upstream gradients went through float32


@pytest.mark.parametrize("device,backend", [pytest.param(d, b, id=f"{d}-{b}") for d in devices() for b in backends(d)])
@pytest.mark.parametrize("N,H,V,bias,temperature,dtype,noncontig", CASES)
def test_matches_float64_truth(device, backend, N, H, V, bias, temperature, dtype, noncontig):
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=bias, seed=N * V + H)
    truth = _run(reference.linear_logprobs, *(x.requires_grad_() if x is not None else None for x in (hidden, weight, b)),
                 labels, g_logp, g_ent, temperature)
    eager = _run(reference.linear_logprobs, _leaf(hidden, dtype), _leaf(weight, dtype), _leaf(b, dtype),
                 labels, g_logp, g_ent, temperature)
    h, w, bb = _leaf(hidden, dtype, noncontig, device), _leaf(weight, dtype, device=device), _leaf(b, dtype, device=device)
    with forced_backend(backend):
        out = _run(linear_logprobs, h, w, bb, labels.to(device), g_logp.to(device), g_ent.to(device), temperature)
    logp, ent, grads = out[0].cpu(), out[1].cpu(), [g.cpu() for g in out[2]]  # compared on the CPU
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ignored = labels == -100
    assert torch.all(logp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert_close_to_truth(logp, truth[0], dtype, eager=eager[0], name="logp")
    assert_close_to_truth(ent, truth[1], dtype, eager=eager[1], name="entropy")
    names = ["d_hidden", "d_weight", "d_bias"]
    for name, got, want, ref_eager, leaf in zip(names, grads, truth[2], eager[2], (h, w, bb)):
        assert got.dtype == dtype and got.shape == leaf.shape, name
        assert_close_to_truth(got, want, dtype, eager=ref_eager, name=name)
    # ignored tokens get no gradient
    assert torch.all(grads[0][ignored] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_leading_dims_and_only_logp(backend):
    """[B, T, H] hidden, logp alone (the entropy output gets no gradient), one output through autograd."""
    if backend == "triton" and "triton" not in backends("cpu"):
        pytest.skip("triton is not installed")
    hidden, weight, _, labels, g_logp, _ = _inputs(12, 64, 300, bias=False, seed=3, lead=(3, 4))
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    truth = reference.linear_logprobs(h64, w64, labels)
    t_grads = torch.autograd.grad((truth * g_logp).sum(), [h64, w64])
    h, w = _leaf(hidden, torch.float32), _leaf(weight, torch.float32)
    with forced_backend(backend):
        logp = linear_logprobs(h, w, labels)
    assert logp.shape == (3, 4)
    grads = torch.autograd.grad((logp * g_logp.float()).sum(), [h, w])
    assert_close_to_truth(logp, truth, torch.float32, name="logp")
    for got, want in zip(grads, t_grads):
        assert_close_to_truth(got, want, torch.float32)


def test_torch_backend_chunks_over_vocabulary(monkeypatch):
    """Force tiny chunks so the torch path takes several token and vocabulary chunks (online LSE)."""
    import rlkernels.fused_linear as mod

    monkeypatch.setattr(mod, "_TORCH_BUDGET_ELEMS", 64)
    rows, vchunk = mod._torch_chunks(50, 3001)
    assert rows < 50 and vchunk < 3001
    hidden, weight, b, labels, g_logp, g_ent = _inputs(50, 32, 3001, bias=True, seed=11)
    leaves64 = [x.clone().requires_grad_() for x in (hidden, weight, b)]
    truth = _run(reference.linear_logprobs, *leaves64, labels, g_logp, g_ent, 0.9)
    leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend("torch"):
        out = _run(linear_logprobs, *leaves, labels, g_logp, g_ent, 0.9)
    for got, want in zip((out[0], out[1], *out[2]), (truth[0], truth[1], *truth[2])):
        assert_close_to_truth(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(50, 3001), (70, 40)])  # fewer tokens than vocabulary (vocabulary outer), and more
def test_torch_backend_on_two_workers(monkeypatch, dtype, N, V):
    """With two threads the torch path shares its tiles out to two single-threaded workers: every backward share
    runs on its own thread, the result matches the float64 truth and is the same bits run after run."""
    import threading

    import rlkernels.fused_linear as mod

    monkeypatch.setattr(mod, "_TORCH_BUDGET_ELEMS", 64)  # several token and vocabulary chunks
    where = []
    original = mod._logits_into

    def spy(*args):
        where.append((threading.get_ident(), torch.get_num_threads()))
        return original(*args)

    monkeypatch.setattr(mod, "_logits_into", spy)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, 32, V, bias=True, seed=N + V)
    truth = _run(reference.linear_logprobs, *[x.clone().requires_grad_() for x in (hidden, weight, b)], labels,
                 g_logp, g_ent, 0.9)
    leaves = [_leaf(x, dtype) for x in (hidden, weight, b)]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with forced_backend("torch"):
            logp, ent = linear_logprobs(leaves[0], leaves[1], labels, bias=leaves[2], temperature=0.9,
                                        return_entropy=True)
            where.clear()
            loss = (logp * g_logp.float()).sum() + (ent * g_ent.float()).sum()
            grads = torch.autograd.grad(loss, leaves)
            backward_threads = {ident for ident, _ in where}
            again = _run(linear_logprobs, *leaves, labels, g_logp, g_ent, 0.9)
    finally:
        torch.set_num_threads(old)
    assert len(backward_threads) == 2 and threading.get_ident() not in backward_threads
    assert {n for _, n in where} == {1}  # each worker's ops run on one thread
    for name, got, want in zip(["logp", "entropy", "d_hidden", "d_weight", "d_bias"], (logp, ent, *grads),
                               (truth[0], truth[1], *truth[2])):
        assert_close_to_truth(got, want, dtype, name=name)
    for a, b_ in zip((logp, ent, *grads), (again[0], again[1], *again[2])):
        assert torch.equal(a, b_)


def _record_dz_launches(monkeypatch) -> list[tuple[int, int, int]]:
    """Spy on the Triton backward's ``_dz_kernel`` launches: ``(rows, vocabulary columns, col0)`` per launch."""
    launches = []
    launch = fl_module._dz_kernel.launch

    def spy(grid, *args, **kwargs):
        launches.append((args[11], args[12], args[18]))  # N, V, col0 of the launch
        return launch(grid, *args, **kwargs)

    monkeypatch.setattr(fl_module._dz_kernel, "launch", spy)
    return launches


# (N, V, chunks the backward must take): N < V runs vocabulary outer, N >= V tokens outer; a small _DZ_BUDGET_BYTES
# forces several chunks either way (at least one tile of 64 tokens or 128 vocabulary entries each)
ORDERS = {"vocabulary": (40, 1000, 8), "tokens": (300, 200, 4)}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backward_orders_match_float64_truth(order, dtype, monkeypatch):
    """Both loop orders of the Triton backward, each over several chunks (a small workspace budget), forward and
    backward against the float64 truth and no worse than eager in the same dtype; two runs give the same bits.
    Vocabulary outer (N < V): every launch covers all the tokens and one chunk of the vocabulary (col0 its first
    id), d_weight written slice by slice; tokens outer (N >= V): every launch covers a chunk of tokens and the whole
    vocabulary, d_weight accumulated over the chunks."""
    if "triton" not in backends("cpu"):
        pytest.skip("triton is not installed")
    N, V, chunks = ORDERS[order]
    monkeypatch.setattr(fl_module, "_DZ_BUDGET_BYTES", 64 * 128)  # below one tile: the smallest chunks
    launches = _record_dz_launches(monkeypatch)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, 40, V, bias=True, seed=5)
    truth = _run(reference.linear_logprobs, *(x.clone().requires_grad_() for x in (hidden, weight, b)), labels,
                 g_logp, g_ent, 0.9)
    eager = _run(reference.linear_logprobs, *(_leaf(x, dtype) for x in (hidden, weight, b)), labels, g_logp, g_ent, 0.9)
    with forced_backend("triton"):
        runs = [_run(linear_logprobs, *(_leaf(x, dtype) for x in (hidden, weight, b)), labels, g_logp, g_ent, 0.9)
                for _ in range(2)]
    kept = int((labels != -100).sum())  # the op hands the backend the kept rows only
    if order == "vocabulary":
        want = [(kept, min(128, V - v0), v0) for v0 in range(0, V, 128)]
    else:
        want = [(min(64, kept - r0), V, 0) for r0 in range(0, kept, 64)]
    assert len(want) == chunks and launches == want * 2
    out = runs[0]
    names = ["logp", "entropy", "d_hidden", "d_weight", "d_bias"]
    for name, got, want_, e in zip(names, (out[0], out[1], *out[2]), (truth[0], truth[1], *truth[2]),
                                   (eager[0], eager[1], *eager[2])):
        assert_close_to_truth(got, want_, dtype, eager=e, name=name)
    for a, b_ in zip((runs[0][0], runs[0][1], *runs[0][2]), (runs[1][0], runs[1][1], *runs[1][2])):
        assert torch.equal(a, b_)


def _record_backward_kernels(monkeypatch) -> dict:
    """Spy on the three ways the Triton backward forms dz: ``_dz_kernel`` and ``_dz_kernel_tma`` launches counted,
    the "cublas" backward's tile launches recorded as ``(rows, columns, col0, raw)``."""
    seen = {"split": 0, "tma": 0, "tile": []}
    launch, launch_tma = fl_module._dz_kernel.launch, fl_module._launch_dz_tma
    launch_tile = fl_module.launch_dz_from_tile

    def split(*args, **kwargs):
        seen["split"] += 1
        return launch(*args, **kwargs)

    def tma(*args, **kwargs):
        seen["tma"] += 1
        return launch_tma(*args, **kwargs)

    def tile(z, *args, col0, raw):
        seen["tile"].append((*z.shape, col0, raw))
        return launch_tile(z, *args, col0=col0, raw=raw)

    monkeypatch.setattr(fl_module._dz_kernel, "launch", split)
    monkeypatch.setattr(fl_module, "_launch_dz_tma", tma)
    monkeypatch.setattr(fl_module, "launch_dz_from_tile", tile)
    return seen


def _cublas_case(device, dtype, hidden, weight, b, labels, g_logp, g_ent, temperature):
    """``(out, truth, eager)``: linear_logprobs on the Triton backend under RLKERNELS_LINEAR_FWD=cublas (set by the
    caller) on ``device``, the float64 truth (CPU) and eager in ``dtype`` on ``device``."""
    truth = _run(reference.linear_logprobs, *(x.clone().requires_grad_() for x in (hidden, weight, b)), labels,
                 g_logp, g_ent, temperature)
    labels, g_logp, g_ent = labels.to(device), g_logp.to(device), g_ent.to(device)
    leaves = lambda: [_leaf(x, dtype, device=device) for x in (hidden, weight, b)]  # noqa: E731
    eager = _run(reference.linear_logprobs, *leaves(), labels, g_logp, g_ent, temperature)
    with forced_backend("triton"):
        out = _run(linear_logprobs, *leaves(), labels, g_logp, g_ent, temperature)
    return out, truth, eager


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cublas_backward_recomputes_the_logits_with_cublas(device, order, dtype, monkeypatch):
    """RLKERNELS_LINEAR_FWD=cublas, 16-bit inputs: the backward recomputes each chunk's logits with the forward's
    cuBLAS GEMM into a float32 tile (on the CPU the float32 GEMM stands in) and _dz_from_tile_kernel turns the raw
    tile into dz (dividing by T itself) -- no _dz_kernel, no Hopper dz kernel. In both loop orders, over several
    chunks, each sized with the float32 tile counted (6 bytes per dz entry): forward and backward against the
    float64 truth and no worse than eager."""
    if "triton" not in backends(device):
        pytest.skip("triton is not installed")
    N, V, _ = ORDERS[order]
    budget = 64 * 128 * 6
    monkeypatch.setattr(fl_module, "_DZ_BUDGET_BYTES", budget)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "cublas")
    seen = _record_backward_kernels(monkeypatch)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, 40, V, bias=True, seed=5)
    out, truth, eager = _cublas_case(device, dtype, hidden, weight, b, labels, g_logp, g_ent, 0.9)
    assert seen["split"] == 0 and seen["tma"] == 0
    kept = int((labels != -100).sum())  # the op hands the backend the kept rows only
    if order == "vocabulary":
        vc = max(128, budget // (kept * 6) // 128 * 128)
        want = [(kept, min(vc, V - v0), v0, True) for v0 in range(0, V, vc)]
    else:
        rows = max(32, budget // (V * 6) // 32 * 32)
        want = [(min(rows, kept - r0), V, 0, True) for r0 in range(0, kept, rows)]
    assert len(want) >= 2 and seen["tile"] == want
    assert all(r * c * 6 <= max(budget, 6 * r * 128, 6 * 32 * c) for r, c, _, _ in want)
    _check_all(out, truth, eager, dtype)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cublas_kernels_low_temperature_no_worse_than_eager(device, dtype, monkeypatch):
    """RLKERNELS_LINEAR_FWD=cublas at T = 1e-3: the backward's logits come from the same kind of GEMM as the
    forward's (cuBLAS, over other shapes -- a chunk of rows against the whole vocabulary, every row against a chunk
    of it; the CPU's float32 GEMM under the interpreter) and the tile kernel divides them by T as the other dz
    kernels do, so the gradients are no worse than eager's (test_low_temperature_no_worse_than_eager)."""
    if "triton" not in backends(device):
        pytest.skip("triton is not installed")
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "cublas")
    seen = _record_backward_kernels(monkeypatch)
    hidden, weight, b, labels, g_logp, g_ent, zmax = _large_logits_case(24, 64, 300, seed=61, scale=1.0)
    out, truth, eager = _cublas_case(device, dtype, hidden, weight, b, labels, g_logp, g_ent, 1e-3)
    assert seen["tile"] and seen["split"] == 0 and seen["tma"] == 0
    _check_all(out, truth, eager, dtype, tol=_magnitude_tol(dtype, zmax / 1e-3),
               vs_eager=("d_hidden", "d_weight", "d_bias"))


def test_cublas_partials_are_the_split_kernels(monkeypatch):
    """The vocabulary-parallel forward reads per-slice partials (m, s, u, z_y); under RLKERNELS_LINEAR_FWD=cublas
    they come from cuBLAS logits and rlkernels.softmax's forward (_partials_cublas, so that the backward, which
    recomputes with cuBLAS, sees the same logits): equal to the split kernel's to float32 rounding, z_y 0 for a
    negative label (ignored, or vocab_parallel's "another rank's" -1), over several row chunks."""
    monkeypatch.setattr(fl_module, "_CUBLAS_CHUNK_BYTES", 4 * 300 * 16)  # 16 rows a chunk
    hidden, weight, b, labels, _, _ = _inputs(45, 40, 300, bias=True, seed=17)
    labels[:3] = torch.tensor([-100, -1, 299])  # ignored, another rank's (vocab_parallel._OTHER_RANK), the last
    h, w, bb = (x.to(torch.bfloat16) for x in (hidden, weight, b))
    opt = fl_module.LinearLogprobsOptions(temperature=0.7, return_entropy=True, ignore_index=-100)
    got = {}
    for kernel in ("cublas", "split"):
        monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, kernel)
        got[kernel] = fl_module._partials_triton(h, w, labels, bb, opt)  # [4, N]
    assert torch.all(got["cublas"][3, :2] == 0) and got["cublas"][3, 2] != 0
    torch.testing.assert_close(got["cublas"], got["split"], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_backward_carries_the_label_entries_in_float32(order, dtype):
    """16-bit dz workspace: a token's label entry g (1 - p_y) dominates its row of dz, and what rounding it to 16 bits
    loses is added back in float32 (the residual), in both loop orders. Four labels shared by all the tokens (p_y
    ~ 1/V), so the label rows of d_weight are sums of label entries: with the residual they are the float64 truth
    (from the same 16-bit inputs) correctly rounded in >= 90% of their entries (measured 95-100%); without it,
    38-77%."""
    if "triton" not in backends("cpu"):
        pytest.skip("triton is not installed")
    N, V, _ = ORDERS[order]
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, 48, V, bias=True, seed=7, ignore=False)
    labels = labels % 4  # [N]
    g_logp, g_ent = torch.ones_like(g_logp), torch.zeros_like(g_ent)  # [N] each
    leaves = [_leaf(x, dtype) for x in (hidden, weight, b)]
    truth = _run(reference.linear_logprobs, *(x.detach().double().requires_grad_() for x in leaves), labels, g_logp,
                 g_ent, 1.0)
    with forced_backend("triton"):
        out = _run(linear_logprobs, *leaves, labels, g_logp, g_ent, 1.0)
    d_weight, want = out[2][1][:4], truth[2][1][:4].to(dtype)  # [4, H] the label rows
    assert (d_weight == want).float().mean().item() >= 0.9


def test_vocab_outer_backward_holds_no_float32_weight_slice(monkeypatch):
    """The vocabulary-outer backward (16-bit inputs, N < V) writes each d_weight slice from its GEMM in the weight's
    dtype: beyond the gradients it holds one dz chunk and O(N·H) float32 (d_hidden's accumulator, the label rows),
    never a float32 [vc, H] slice of d_weight (at these sizes 1 MiB, against a 32 KiB dz chunk). The labelled rows
    are still correct: the same gradients as the float64 truth to the 16-bit rounding the other tests hold them to.
    dz comes from a stand-in (pure PyTorch: the interpreter's own buffers are not the backward's); the CPU's float32
    GEMM fallback widens operand pieces of at most _WIDEN_ELEMS elements, counted in the bound."""
    N, H, V, vc = 16, 256, 4096, 1024
    monkeypatch.setattr(fl_module, "_DZ_BUDGET_BYTES", N * vc * 2)  # chunks of vc columns
    monkeypatch.setattr(fl_module, "_WIDEN_ELEMS", 1 << 14)  # 64 KiB pieces: a small share of the bound
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(N, H, generator=g).to(torch.bfloat16)  # [N, H]
    weight = (torch.randn(V, H, generator=g) * H**-0.5).to(torch.bfloat16)  # [V, H]
    labels = torch.randint(0, V, (N,), generator=g)  # [N]
    dz_full = torch.randn(N, V, generator=g, dtype=torch.float64) * 1e-3  # [N, V] a stand-in dL/dz
    dz_full[torch.arange(N), labels] = -0.7  # the label entries dominate, as g (p_y - 1) does
    valid = torch.ones(N, dtype=torch.bool)  # [N]

    def dz_into(dz, resid, r0, r1, v0, v1):  # as _dz_kernel: dz rounded to 16 bits, the label's loss in resid
        exact = dz_full[r0:r1, v0:v1]  # [n, vc]
        dz.copy_(exact)
        at = (labels[r0:r1] >= v0) & (labels[r0:r1] < v1)  # [n]
        rows = torch.arange(r0, r1)[at]
        resid[rows] = (exact[rows - r0, labels[rows] - v0] - dz[rows - r0, labels[rows] - v0].double()).float()

    t = fl_module._tiles(torch.bfloat16, backward=True)
    out = {}
    report = measure_cpu(lambda: out.update(r=fl_module._bwd_vocab_outer(dz_into, hidden, weight, False, valid,
                                                                          labels, t)))
    d_hidden, d_weight, _ = out["r"]
    gradients = d_hidden.numel() * 2 + d_weight.numel() * 2
    nh32 = N * H * 4
    assert report.peak_bytes <= gradients + N * vc * 2 + 4 * nh32 + 2 * (1 << 14) * 4 + 64 * 1024, report
    # the truth from what the backward holds: dz rounded to 16 bits but at the labels, carried whole by the residual
    dz_held = dz_full.to(torch.bfloat16).double()  # [N, V]
    dz_held[torch.arange(N), labels] = dz_full[torch.arange(N), labels]
    want_w = (dz_held.T @ hidden.double()).to(torch.bfloat16)  # [V, H] rounded once
    want_h = (dz_held @ weight.double()).to(torch.bfloat16)  # [N, H]
    assert (d_weight == want_w).float().mean().item() >= 0.99
    assert (d_weight[labels] == want_w[labels]).float().mean().item() >= 0.9  # the rows carrying a residual
    assert (d_hidden == want_h).float().mean().item() >= 0.9


@pytest.mark.parametrize("n_blocks,n_cols,group", [(5, 3, 2), (37, 4, 16), (16, 7, 16), (1, 9, 16), (33, 1, 8)])
def test_grouped_grid_visits_every_item_once_token_blocks_fastest(n_blocks, n_cols, group):
    """The forward and backward kernels' 1-D grids (_grouped_item): program ``i`` gets one (token block, column)
    pair, every pair exactly once; consecutive programs run over ``group`` token blocks, then the next column, then
    the next group of token blocks (so a wave of programs shares few hidden rows, kept in L2)."""
    if "triton" not in backends("cpu"):
        pytest.skip("triton is not installed")
    from rlkernels._triton import jit, tl

    @jit
    def items(out_ptr, n_blocks, n_cols, GROUP_N: tl.constexpr):
        item = tl.program_id(0)
        blk, col = fl_module._grouped_item(item, n_blocks, n_cols, GROUP_N)
        tl.store(out_ptr + 2 * item, blk)
        tl.store(out_ptr + 2 * item + 1, col)

    out = torch.full((n_blocks * n_cols, 2), -1, dtype=torch.int32)  # [items, 2]
    items.launch((n_blocks * n_cols,), out, n_blocks, n_cols, GROUP_N=group)
    got = [tuple(r) for r in out.tolist()]
    want = [(b, c) for g0 in range(0, n_blocks, group) for c in range(n_cols)
            for b in range(g0, min(n_blocks, g0 + group))]
    assert got == want
    assert sorted(got) == sorted((b, c) for b in range(n_blocks) for c in range(n_cols))


@pytest.mark.parametrize("backend", backends("cpu"))
def test_label_out_of_range_raises_on_cpu(backend):
    """Every backend, the reference included, raises the same error naming ``labels`` (no raw gather error)."""
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with forced_backend(backend):
        with pytest.raises(ValueError, match="labels"):
            linear_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]))
        with pytest.raises(ValueError, match="labels"):
            linear_logprobs(hidden, weight, torch.tensor([0, -1, 3, 2]))
        # ignore_index is not a bad label
        out = linear_logprobs(hidden, weight, torch.tensor([0, -7, 3, 2]), ignore_index=-7)
        assert out[1] == 0


@pytest.mark.parametrize("device,backend", [(d, b) for d in devices() for b in backends(d)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates(device, backend, dtype):
    """A NaN in one token's hidden state gives that token NaN log-prob and entropy and NaN gradient rows, and
    leaves the other tokens finite (on a GPU too, in every dtype)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 8, generator=g)  # [3, 8]
    hidden[1, 2] = float("nan")
    hidden = hidden.to(dtype).to(device).requires_grad_()
    weight = torch.randn(10, 8, generator=g).to(dtype).to(device).requires_grad_()  # [10, 8]
    with forced_backend(backend):
        logp, ent = linear_logprobs(hidden, weight, torch.tensor([1, 2, 3], device=device), return_entropy=True)
        (d_hidden,) = torch.autograd.grad((logp + ent).sum(), [hidden])
    nan = torch.isnan(logp.float().cpu())
    assert nan.tolist() == [False, True, False] and torch.isnan(ent.float().cpu()).tolist() == [False, True, False]
    rows_nan = torch.isnan(d_hidden.float().cpu()).any(1)
    assert rows_nan[1] and not rows_nan[0] and not rows_nan[2]


# ---------------------------------------------------------------- hostile input


def _magnitude_tol(dtype, scale):
    """Tolerance against the float64 truth for logits ``z/T`` of magnitude ``scale``.

    ``REL_TOL`` is stated for logits of order 1. Rounding an input to ``dtype`` moves a logit
    by about eps·|z/T|, and ``p = exp(z/T - lse)`` moves by that much *relatively*, so every
    output (and eager PyTorch's too) carries an error proportional to the logits' magnitude:
    the dtype's tolerance scales with it. The binding check in these tests is the comparison
    with eager PyTorch in the same dtype (``EAGER_SLACK``)."""
    return REL_TOL[dtype] * max(1.0, scale)


def _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, temperature, dtype):
    truth = _run(reference.linear_logprobs, *(None if x is None else x.clone().requires_grad_() for x in (hidden, weight, b)),
                 labels, g_logp, g_ent, temperature)
    eager = _run(reference.linear_logprobs, _leaf(hidden, dtype), _leaf(weight, dtype), _leaf(b, dtype),
                 labels, g_logp, g_ent, temperature)
    return truth, eager


def _check_all(out, truth, eager, dtype, tol=None, vs_eager=("logp", "entropy", "d_hidden", "d_weight", "d_bias")):
    """Every output finite and within ``tol`` of the float64 truth; those named in ``vs_eager``
    also no worse than eager PyTorch in the same dtype."""
    names = ["logp", "entropy", "d_hidden", "d_weight", "d_bias"]
    for name, got, want, e in zip(names, (out[0], out[1], *out[2]), (truth[0], truth[1], *truth[2]),
                                  (eager[0], eager[1], *eager[2])):
        assert torch.isfinite(got).all(), f"{name} is not finite"
        assert_close_to_truth(got, want, dtype, eager=e if name in vs_eager else None, name=name, tol=tol)


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_infinite_logits(backend, dtype):
    """A bias with -inf entries (a masked vocabulary): p log p counts 0 where p = 0, so the entropy
    and every gradient stay finite and correct. Masked entries are scattered, fill a whole vocabulary
    chunk of the torch path (2048 wide) and the whole last Triton split (splits are 4096 columns
    wide, so column 4096 alone: that split's running max never sees a finite logit), and one label
    sits on a masked column (its logp is -inf, its gradients are still finite)."""
    N, H, V, T = 14, 16, 4097, 0.8
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=True, seed=21)
    b[1::3] = float("-inf")
    b[2048:4096] = float("-inf")
    b[4096] = float("-inf")
    finite_cols = torch.isfinite(b).nonzero().squeeze(1)  # [k]
    g = torch.Generator().manual_seed(22)
    labels = finite_cols[torch.randint(0, finite_cols.numel(), (N,), generator=g)]  # [N]
    labels[::5] = -100
    labels[3] = 1  # b[1] = -inf: logp = -inf there
    truth, eager = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, T, dtype)
    with forced_backend(backend):
        out = _run(linear_logprobs, _leaf(hidden, dtype), _leaf(weight, dtype), _leaf(b, dtype), labels, g_logp, g_ent, T)
    logp, ent, grads = out
    assert logp[3] == float("-inf") and truth[0][3] == float("-inf")
    keep = torch.arange(N) != 3  # [N]
    assert torch.isfinite(logp[keep]).all()
    assert_close_to_truth(logp[keep], truth[0][keep], dtype, eager=eager[0][keep], name="logp")
    for name, got, want, e in zip(["entropy", "d_hidden", "d_weight", "d_bias"], (ent, *grads), (truth[1], *truth[2]),
                                  (eager[1], *eager[2])):
        assert torch.isfinite(got).all(), f"{name} is not finite"
        assert_close_to_truth(got, want, dtype, eager=e, name=name)
    masked = ~torch.isfinite(b)  # [V]
    masked[1] = False  # a label's own column: d logp_y / d b_y = (1 - p_y)/T = 1/T even at b_y = -inf
    assert torch.all(grads[2][masked] == 0)  # masked entries get no bias gradient


def _large_logits_case(N, H, V, seed, scale):
    """Logits of magnitude ~``scale`` with half of the labels on the row's argmax (logp near 0, where an
    absolute error of ulp(scale) in log p is a large relative error)."""
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=True, seed=seed)
    hidden = hidden * scale  # weight rows have norm ~1.5: z ~ scale
    z = hidden @ weight.T + b  # [N, V]
    labels[1::2] = z[1::2].argmax(-1)
    return hidden, weight, b, labels, g_logp, g_ent, z.abs().max().item()


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("seed", [52, 54])  # draws where one rounded lse cost the torch and Triton paths 3-50x eager's error
def test_large_logits_no_worse_than_eager(backend, dtype, seed):
    """float32 logits around 1000: the backward forms p from the row max and the shifted sum (as
    eager's log_softmax does), never from one rounded lse (whose ulp, 6e-5, moved every p), so
    every output stays within eager's error. (16-bit inputs add a separate, known effect: the
    Triton backward's dz workspace is 16-bit and only the label's entry is carried in float32, so
    in a peaked row whose label is not the top token the top token's entry keeps its rounding.)"""
    hidden, weight, b, labels, g_logp, g_ent, zmax = _large_logits_case(24, 32, 300, seed=seed, scale=600.0)
    assert zmax > 500
    truth, eager = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, 1.0, dtype)
    with forced_backend(backend):
        out = _run(linear_logprobs, _leaf(hidden, dtype), _leaf(weight, dtype), _leaf(b, dtype), labels, g_logp, g_ent, 1.0)
    _check_all(out, truth, eager, dtype, tol=_magnitude_tol(dtype, zmax))


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-3, 1e-2])
def test_low_temperature_no_worse_than_eager(backend, dtype, temperature):
    """At T = 1e-3 a logit's last bit moves p by ~1e-4: the backward must recompute the forward's
    logits bit for bit (same K blocking) and form p from the row max and shifted sum, so the
    gradients are no worse than eager's. (logp and the entropy are checked against the truth
    only: at T = 1e-3 these rows' entropies are ~1e-16, sums of terms exp(-40) whose relative
    error is the rounding of one logit/T, ~ulp(1000): which of two float32 computations rounds
    closer is luck, not accuracy.)"""
    hidden, weight, b, labels, g_logp, g_ent, zmax = _large_logits_case(24, 64, 300, seed=61, scale=1.0)
    truth, eager = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, temperature, dtype)
    with forced_backend(backend):
        out = _run(linear_logprobs, _leaf(hidden, dtype), _leaf(weight, dtype), _leaf(b, dtype), labels, g_logp, g_ent,
                   temperature)
    _check_all(out, truth, eager, dtype, tol=_magnitude_tol(dtype, zmax / temperature),
               vs_eager=("d_hidden", "d_weight", "d_bias"))


def test_backward_recomputes_the_forward_logits_bit_for_bit(monkeypatch):
    """torch backend: every logits tile the backward recomputes equals the forward's, bit for bit."""
    import rlkernels.fused_linear as mod

    monkeypatch.setattr(mod, "_TORCH_BUDGET_ELEMS", 64)  # several token and vocabulary chunks
    seen = {"forward": [], "backward": []}
    original = mod._logits_into
    phase = ["forward"]

    def spy(z, *args):
        out = original(z, *args)
        seen[phase[0]].append(out.clone())
        return out

    monkeypatch.setattr(mod, "_logits_into", spy)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(40, 24, 700, bias=True, seed=71)
    leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend("torch"):
        logp, ent = linear_logprobs(leaves[0], leaves[1], labels, bias=leaves[2], temperature=0.3, return_entropy=True)
        phase[0] = "backward"
        torch.autograd.grad((logp * g_logp.float()).sum() + (ent * g_ent.float()).sum(), leaves)
    assert len(seen["forward"]) == len(seen["backward"]) > 1
    # the backward may visit the tiles in another order (vocabulary outer when N < V): match each to its own
    unmatched = list(seen["forward"])
    for bwd in seen["backward"]:
        hit = next(i for i, f in enumerate(unmatched) if f.shape == bwd.shape and torch.equal(f, bwd))
        unmatched.pop(hit)


def test_triton_backward_uses_the_forward_k_blocking():
    """The Triton backward recomputes each logit with the forward's accumulation order: same BLOCK_K
    (hence the same K chunks summed in the same order) and the same dot precision flags."""
    import rlkernels.fused_linear as mod

    for dtype in TRITON_DTYPES:
        for hopper in (True, False):
            assert mod._tiles(dtype, hopper=hopper).block_k == mod._tiles(dtype, backward=True).block_k, dtype
    configs = mod.aot_configs()
    for forward, backward in ((mod._fwd_kernel, mod._dz_kernel), (mod._fwd_kernel_tma, mod._dz_kernel_tma)):
        fwd = [c for c in configs if c.kernel is forward]
        assert fwd
        for f in fwd:
            # the backward that follows it, compiled for the same input dtype (b_ptr's type: every signature has
            # it), bias and architecture, with the same K blocking (the Hopper forward's: its own dz kernel)
            same = [d for d in configs if d.kernel is backward and d.signature["b_ptr"] == f.signature["b_ptr"]
                    and d.constexprs["HAS_BIAS"] == f.constexprs["HAS_BIAS"] and set(f.archs) <= set(d.archs)
                    and d.constexprs["BLOCK_K"] == f.constexprs["BLOCK_K"]]
            assert len(same) == 1, (forward.__name__, f.constexprs)
            for key in ("IEEE", "DOT_F32"):  # the dot's precision flags, where the kernels take them
                assert f.constexprs.get(key) == same[0].constexprs.get(key), key
    # and the launcher pairs them so (_bwd_tiles: the Hopper dz kernel takes the Hopper forward's K blocks)
    assert mod._TMA_DZ_TILES.block_k == mod._TMA_TILES.block_k


_NARROW_LABELS = {
    # V = 300. uint8 156 is -100 (ignore_index) mod 256 and 44 is V mod 256: both are valid labels,
    # never ignored or rejected by a comparison done in the narrow dtype; 200 > 44 is valid too.
    torch.uint8: [0, 5, 156, 255, 200, 44],
    torch.int8: [0, 5, 99, 127, -100, 64],
    torch.int16: [0, 5, 299, -100, 200, 156],
    torch.int32: [0, 5, 299, -100, 200, 156],
}


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype", list(_NARROW_LABELS))
def test_every_integer_label_dtype(backend, dtype):
    V = 300
    hidden, weight, _, _, g_logp, g_ent = _inputs(6, 16, V, bias=False, seed=31)
    labels64 = torch.tensor(_NARROW_LABELS[dtype])  # [6]
    truth = _run(reference.linear_logprobs, hidden.clone().requires_grad_(), weight.clone().requires_grad_(), None,
                 labels64, g_logp, g_ent, 1.0)
    with forced_backend(backend):
        out = _run(linear_logprobs, _leaf(hidden, torch.float32), _leaf(weight, torch.float32), None,
                   labels64.to(dtype), g_logp, g_ent, 1.0)
    for name, got, want in zip(["logp", "entropy", "d_hidden", "d_weight"], (out[0], out[1], *out[2]),
                               (truth[0], truth[1], *truth[2])):
        assert_close_to_truth(got, want, torch.float32, name=name)
    assert torch.all((out[0] == 0) == (labels64 == -100))  # only ignore_index itself is ignored


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype,bad", [(torch.uint8, 200), (torch.int8, -1), (torch.int16, 100), (torch.int32, 1000)])
def test_narrow_label_out_of_range_raises(backend, dtype, bad):
    hidden, weight = torch.randn(3, 8), torch.randn(100, 8)
    with forced_backend(backend):
        with pytest.raises(ValueError, match="labels"):
            linear_logprobs(hidden, weight, torch.tensor([0, bad, 3]).to(dtype))


@pytest.mark.parametrize("backend", backends("cpu"))
def test_autocast_computes_in_float32(backend):
    """Under torch.autocast (bfloat16 on the CPU) the op still computes in float32: the forward
    (in the autocast region) and the backward (after it, as a training step runs it) are as close
    to the float64 truth as without autocast."""
    hidden, weight, b, labels, g_logp, g_ent = _inputs(20, 48, 500, bias=True, seed=41)
    truth, eager = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, 0.9, torch.float32)
    leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend(backend):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, ent = linear_logprobs(leaves[0], leaves[1], labels, bias=leaves[2], temperature=0.9, return_entropy=True)
        grads = torch.autograd.grad((logp * g_logp.float()).sum() + (ent * g_ent.float()).sum(), leaves)
    assert logp.dtype == torch.float32 and all(gr.dtype == torch.float32 for gr in grads)
    _check_all((logp, ent, grads), truth, eager, torch.float32)


@pytest.mark.parametrize("backend", backends("cpu"))
def test_autocast_backward_inside_the_region(backend):
    """The backward also computes in float32 when it runs inside the autocast region (autograd then
    runs with autocast on): the fused backends' backward turns autocast off; the reference backend's
    eager matmuls, whose backward autocast would run in bfloat16, run in float64 under autocast."""
    hidden, weight, b, labels, g_logp, g_ent = _inputs(20, 48, 500, bias=True, seed=42)
    truth, eager = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, 0.9, torch.float32)
    leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
        out = _run(linear_logprobs, *leaves, labels, g_logp, g_ent, 0.9)
    _check_all(out, truth, eager, torch.float32)


@pytest.mark.parametrize("device,backend", [(d, b) for d in devices() for b in backends(d)])
def test_row_offsets_past_2_31_elements(device, backend):
    """``row * stride`` past 2^31 elements: hidden and weight are views whose row stride s < 2^31
    (an int32 kernel argument) puts row 2 at 2s > 2^31. Their storage spans ~2^32 bfloat16
    elements (8 GiB of address space): on the CPU only the few pages holding the rows are ever touched,
    so resident memory stays small; on a GPU it is 8 GiB of device memory. With 32-bit offsets, row 2's
    offset wraps to B0 - 2^21 (inside the storage, so a wrong read rather than a crash): its logp and
    gradients come out wrong."""
    N = V = 3
    H = 16
    s = 2**31 - 2**20  # row stride: fits int32; 2s does not
    B0 = 2**21  # first row: a wrapped offset 2s - 2^32 = -2^21 stays inside the storage
    store = torch.empty(B0 + 2 * s + 2 * H, dtype=torch.bfloat16, device=device)  # CPU: untouched pages cost nothing
    hidden = torch.as_strided(store, (N, H), (s, 1), B0)  # [N, H] rows at B0 + r·s
    weight = torch.as_strided(store, (V, H), (s, 1), B0 + H)  # [V, H] rows right after hidden's
    g = torch.Generator().manual_seed(81)
    hidden.copy_(torch.randn(N, H, generator=g))
    weight.copy_(torch.randn(V, H, generator=g) * 0.4)
    labels = torch.tensor([1, 0, 2], device=device)  # [N]
    g_logp, g_ent = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    compact = [hidden.double().cpu().clone().requires_grad_(), weight.double().cpu().clone().requires_grad_()]
    truth = _run(reference.linear_logprobs, *compact, None, labels.cpu(), g_logp, g_ent, 1.0)
    with forced_backend(backend):
        out = _run(linear_logprobs, hidden.detach().requires_grad_(), weight.detach().requires_grad_(), None,
                   labels, g_logp.to(device), g_ent.to(device), 1.0)
    del store, hidden, weight
    for name, got, want in zip(["logp", "entropy", "d_hidden", "d_weight"], (out[0], out[1], *out[2]),
                               (truth[0], truth[1], *truth[2])):
        assert_close_to_truth(got, want, torch.bfloat16, name=name)


def _repeated_label_inputs(device, dtype):
    """Few vocabulary entries, many tokens on each label (every label's d_weight row sums several tokens), a bias,
    some ignored tokens."""
    hidden, weight, bias, labels, g_logp, g_ent = _inputs(48, 40, 300, bias=True, seed=91)
    labels = torch.where(labels == -100, labels, labels % 5)  # [N] 5 distinct labels, ~8 tokens each
    leaves = [_leaf(x, dtype, device=device) for x in (hidden, weight, bias)]
    return leaves, labels.to(device), g_logp.to(device), g_ent.to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_bitwise_deterministic(device, dtype):
    """Two backward runs under torch.use_deterministic_algorithms(True) give the same bits, for every backend on
    every device (none raises for lack of a deterministic implementation)."""
    leaves, labels, g_logp, g_ent = _repeated_label_inputs(device, dtype)
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for backend in backends(device):
            with forced_backend(backend):
                runs = [_run(linear_logprobs, *leaves, labels, g_logp, g_ent, 0.8) for _ in range(2)]
            for a, b in zip((runs[0][0], runs[0][1], *runs[0][2]), (runs[1][0], runs[1][1], *runs[1][2])):
                assert torch.equal(a, b), backend
    finally:
        torch.use_deterministic_algorithms(old)


_ATOMIC_OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_reduce", "index_reduce_",
               "scatter_reduce", "scatter_reduce_", "_index_put_impl_", "embedding_dense_backward"}


@pytest.mark.parametrize("backend", [b for b in backends("cpu") if b != "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_adds_no_gradient_by_scatter(backend, dtype):
    """The backward forms d_weight and d_bias without any scatter-add (index_add_, scatter_add_, index_put_ with
    accumulate=True): on a GPU those add with atomics, in an order that changes from run to run. The ops are
    recorded on the CPU (the same host code launches the GPU's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in ("index_put", "index_put_") and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
                name += "(accumulate)"
            seen.append(name)
            return func(*args, **kwargs)

    leaves, labels, g_logp, g_ent = _repeated_label_inputs("cpu", dtype)
    hidden, weight, bias = (x.detach() for x in leaves)
    opt = fl_module.LinearLogprobsBackwardOptions(temperature=0.8, return_entropy=True, ignore_index=-100,
                                                  grad_weight=True, grad_input=True)
    # the backward's implementation called directly: a dispatch mode sees a custom op's call, not the ops inside it
    with forced_backend(backend):
        logp, ent, stats = fl_module._FWD_IMPLS[backend](hidden, weight, labels, bias, opt)  # [N], [N], [2, N]
        with Record():
            fl_module._BWD_IMPLS[backend](g_logp.float(), g_ent.float(), hidden, weight, labels, bias, stats, ent,
                                          logp, opt)
    assert seen, "the recorder saw no op"
    bad = sorted({n for n in seen if n in _ATOMIC_OPS or n.endswith("(accumulate)")})
    assert not bad, bad


@pytest.mark.parametrize("backend", [b for b in backends("cpu") if b != "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_tokens_are_dropped_before_any_gemm(backend, dtype, monkeypatch):
    """Token compaction: both ops hand their backend only the rows whose label is not ignore_index; the ignored
    rows' log p, entropy and d_hidden are exact zeros, and the rest matches the float64 truth."""
    hidden, weight, bias, labels, g_logp, g_ent = _inputs(40, 48, 1000, bias=True, seed=93)
    labels[1::3] = -100  # with _inputs' labels[::5]: 19 of 40 ignored
    seen = []

    def recording(table, key):
        impl = table[key]

        def run(*args):
            seen.append((table is fl_module._FWD_IMPLS, args[0 if table is fl_module._FWD_IMPLS else 2].shape[0]))
            return impl(*args)
        return run

    for table in (fl_module._FWD_IMPLS, fl_module._BWD_IMPLS):
        monkeypatch.setitem(table, backend, recording(table, backend))
    leaves = [_leaf(x, dtype) for x in (hidden, weight, bias)]
    with forced_backend(backend):
        out = _run(linear_logprobs, *leaves, labels, g_logp, g_ent, 1.0)
    kept = int((labels != -100).sum())
    assert seen == [(True, kept), (False, kept)]
    ignored = labels == -100
    for x in (out[0], out[1], out[2][0]):
        assert torch.equal(x[ignored], torch.zeros_like(x[ignored]))
    truth = _run(reference.linear_logprobs, *[_leaf(x, torch.float64) for x in (hidden, weight, bias)], labels,
                 g_logp, g_ent, 1.0)
    for name, got, want in zip(["logp", "entropy", "d_hidden", "d_weight", "d_bias"], (out[0], out[1], *out[2]),
                               (truth[0], truth[1], *truth[2])):
        assert_close_to_truth(got, want, dtype, name=name)

    # every token ignored: no backend runs at all, everything is zero
    seen.clear()
    with forced_backend(backend):
        out = _run(linear_logprobs, *leaves, torch.full_like(labels, -100), g_logp, g_ent, 1.0)
    assert seen == []
    for x in (out[0], out[1], *out[2]):
        assert torch.equal(x, torch.zeros_like(x))


# ---------------------------------------------------------------- one path per concern


def _kwonly(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _schema_options(op) -> list[str]:
    """The names of an op's non-tensor schema arguments, in order."""
    return [a.name for a in op.default._schema.arguments if "Tensor" not in str(a.type)]


def test_options_keep_the_public_names_down_to_the_kernels():
    """LinearLogprobsOptions holds linear_logprobs's non-tensor keyword arguments under their own names, in order;
    _validate takes them keyword-only and both ops take exactly them (as typed lists, *option_values(opt), no
    backend string);
    the kernels receive temperature and ignore_index under those names. (process_group and vocab_start, last, route
    a call to rlkernels.vocab_parallel before any op: they are no option of the ops.)"""
    fields = [f.name for f in dataclasses.fields(fl_module.LinearLogprobsOptions)]
    assert ["bias", *fields] == _kwonly(linear_logprobs)[:-2] == _kwonly(reference.linear_logprobs)
    assert _kwonly(linear_logprobs)[-2:] == ["process_group", "vocab_start"]
    assert _kwonly(fl_module._validate) == ["hidden", "weight", "labels", "bias", *fields]
    lists = ["float_options", "int_options", "bool_options"]
    assert _schema_options(torch.ops.rlkernels.linear_logprobs) == _schema_options(
        torch.ops.rlkernels.linear_logprobs_backward) == lists
    opt = fl_module.LinearLogprobsOptions(temperature=0.7, return_entropy=True, ignore_index=-5)
    assert options_from(fl_module.LinearLogprobsOptions, option_values(opt)) == opt
    pytest.importorskip("triton")
    assert "temperature" in fl_module._fwd_kernel.arg_names
    assert {"temperature", "ignore_index"} <= set(fl_module._dz_kernel.arg_names)


def test_backend_is_resolved_at_run_time_inside_the_ops(monkeypatch):
    """Forward and backward take their row of _FWD_IMPLS/_BWD_IMPLS through _backend.resolve at every call, also
    when compiled code calls them (RLKERNELS_BACKEND read at run time, no recompile), and float64 inputs, which the
    Triton kernels do not load, stay on torch."""
    pytest.importorskip("triton")
    calls = []
    for table in (fl_module._FWD_IMPLS, fl_module._BWD_IMPLS):
        for name, fn in list(table.items()):
            monkeypatch.setitem(table, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    hidden, weight, b, labels, g_logp, g_ent = _inputs(10, 16, 200, bias=True, seed=91)

    def step(h, w, bb):
        logp, ent = linear_logprobs(h, w, labels, bias=bb, temperature=0.9, return_entropy=True)
        return (logp * g_logp.to(logp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for backend in ("torch", "triton"):
        leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
        with forced_backend(backend):
            torch.autograd.grad(compiled(*leaves), leaves)
    with forced_backend("triton"):
        leaves = [_leaf(x, torch.float64) for x in (hidden, weight, b)]
        torch.autograd.grad(step(*leaves), leaves)
    assert calls == ["torch"] * 2 + ["triton"] * 2 + ["torch"] * 2


def test_kernels_are_defined_at_module_level_and_short():
    """Every jitted function of fused_linear.py is a module-level def (not indented under ``if HAS_TRITON:``), and
    no function in the module is over 80 lines."""
    tree = ast.parse(inspect.getsource(fl_module))
    jitted = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(  # @jit or @jit(...)
        isinstance(getattr(d, "func", d), ast.Name) and getattr(d, "func", d).id == "jit" for d in n.decorator_list)}
    assert {"_logits_tile", "_fwd_kernel", "_dz_kernel"} <= jitted, jitted
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80}
    assert not long, long


@pytest.mark.parametrize("return_entropy", [False, True])
def test_op_outputs_do_not_depend_on_the_backend(return_entropy):
    """The forward op's outputs, the saved statistics included, are the same on every backend (to float32
    rounding: each within the float32 tolerance of the float64 truth): logp, the entropy (zeros without
    return_entropy, on Triton too: it returned the entropy there), each kept row's max logit and log Σ exp(z - max)
    (zeros at ignored rows)."""
    hidden, weight, b, labels, _, _ = _inputs(23, 40, 700, bias=True, seed=95)
    z = (hidden @ weight.T + b) / 0.8  # [N, V] float64
    row_max = z.amax(-1)  # [N]
    log_s = torch.logsumexp(z - row_max[:, None], -1)  # [N]
    t_logp, t_ent = reference.linear_logprobs(hidden, weight, labels, bias=b, temperature=0.8, return_entropy=True)
    opt = fl_module.LinearLogprobsOptions(temperature=0.8, return_entropy=return_entropy, ignore_index=-100)
    for backend in [x for x in backends("cpu") if x != "reference"]:
        with forced_backend(backend):
            logp, ent, stats = fl_module._linear_logprobs_op(hidden.float(), weight.float(), labels, b.float(),
                                                             *option_values(opt))
        assert_close_to_truth(logp, t_logp, torch.float32, name=f"{backend} logp")
        if return_entropy:
            assert_close_to_truth(ent, t_ent, torch.float32, name=f"{backend} entropy")
        else:
            assert torch.all(ent == 0), backend
        kept = labels != -100  # compaction: an ignored token's statistics are exact zeros (never computed)
        assert torch.equal(stats[:, ~kept], torch.zeros_like(stats[:, ~kept])), backend
        assert_close_to_truth(stats[0, kept], row_max[kept], torch.float32, name=f"{backend} row max")
        assert_close_to_truth(stats[1, kept], log_s[kept], torch.float32, name=f"{backend} log-sum")


def test_lse_merge_of_chunk_partials_is_the_whole_row():
    """_host.lse_merge: the partials of column chunks (one chunk all -inf, with a finite floor as its max) merge
    into the row's max, Σ exp(z - max) and Σ exp(z - max)(z - max), checked in float64 against the whole row."""
    g = torch.Generator().manual_seed(97)
    N, V, chunk = 7, 50, 8
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 4  # [N, V]
    z[:, 16:24] = float("-inf")  # a whole chunk
    z[:, 3::7] = float("-inf")
    floor = torch.finfo(torch.float64).min
    parts = []
    for v0 in range(0, V, chunk):
        zc = z[:, v0:v0 + chunk]  # [N, c]
        m = zc.amax(1).clamp(min=floor)  # [N]
        d = zc - m[:, None]  # [N, c]
        e = torch.exp(d)  # [N, c]
        parts.append((m, e.sum(1), torch.where(e > 0, e * d, 0.0).sum(1)))
    m, s, u = (torch.stack(x) for x in zip(*parts))  # [S, N] each
    m_all, s_all, u_all = lse_merge(m, s, u)
    row_max = z.amax(1)  # [N]
    d = z - row_max[:, None]  # [N, V]
    e = torch.exp(d)  # [N, V]
    assert torch.equal(m_all, row_max)
    assert_close_to_truth(s_all, e.sum(1), torch.float64, name="s")
    assert_close_to_truth(u_all, torch.where(e > 0, e * d, 0.0).sum(1), torch.float64, name="u")
    assert lse_merge(m, s)[2] is None



# ---------------------------------------------------------------- bad input


def test_bad_input_hidden_size_mismatch():
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))


def test_bad_input_weight_not_2d():
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(torch.randn(4, 8), torch.randn(2, 10, 8), torch.zeros(4, dtype=torch.long))


def test_bad_input_labels_shape():
    with pytest.raises(ValueError, match="labels"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


def test_bad_input_labels_dtype():
    with pytest.raises(TypeError, match="labels"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_bad_input_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), temperature=temperature)


def test_bad_input_weight_dtype_mismatch():
    with pytest.raises(TypeError, match="weight"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long))


def test_bad_input_bias_dtype_mismatch():
    with pytest.raises(TypeError, match="bias"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), bias=torch.randn(10, dtype=torch.float16))


def test_bad_input_bias_shape():
    with pytest.raises(ValueError, match="bias"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), bias=torch.randn(11))


def test_bad_input_device_mismatch():
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(torch.randn(4, 8), torch.randn(10, 8, device="meta"), torch.zeros(4, dtype=torch.long))


def test_bad_input_integer_hidden():
    with pytest.raises(TypeError, match="hidden"):
        linear_logprobs(torch.zeros(4, 8, dtype=torch.long), torch.randn(10, 8), torch.zeros(4, dtype=torch.long))


# ---------------------------------------------------------------- torch.compile


def test_torch_compile_fullgraph():
    hidden, weight, b, labels, g_logp, g_ent = _inputs(16, 32, 200, bias=True, seed=9)

    def step(h, w, bb, y):
        logp, ent = linear_logprobs(h, w, y, bias=bb, temperature=0.8, return_entropy=True)
        return (logp * g_logp.float()).sum() + (ent * g_ent.float()).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend("torch"):
        loss = compiled(*leaves, labels)
        grads = torch.autograd.grad(loss, leaves)
    leaves2 = [_leaf(x, torch.float32) for x in (hidden, weight, b)]
    with forced_backend("reference"):
        loss2 = step(*leaves2, labels)
        grads2 = torch.autograd.grad(loss2, leaves2)
    assert torch.allclose(loss, loss2, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads2):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_opcheck():
    import rlkernels.fused_linear as mod

    hidden, weight, b, labels, _, _ = _inputs(8, 16, 50, bias=True, seed=1)
    opt = mod.LinearLogprobsOptions(temperature=1.0, return_entropy=True, ignore_index=-100)
    args = (hidden.float().requires_grad_(), weight.float().requires_grad_(), labels, b.float().requires_grad_(),
            *option_values(opt))
    with forced_backend("torch"):
        torch.library.opcheck(mod._linear_logprobs_op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ---------------------------------------------------------------- memory


def test_cpu_memory_is_a_fraction_of_eager():
    """N=4096, H=512, V=50257 float32: forward+backward peak at most 1/8 of eager's, no [N, V] allocation."""
    N, H, V = 4096, 512, 50257
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g) * 0.05  # [N, H]
    weight = torch.randn(V, H, generator=g) * 0.05  # [V, H]
    labels = torch.randint(0, V, (N,), generator=g)  # [N]
    nv_bytes = N * V * 4

    def fused():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with forced_backend("torch"):
            logp = linear_logprobs(h, w, labels)
        logp.sum().backward()

    # Eager's peak, counted rather than measured (measuring doubles this test's time): at
    # log_softmax's backward, its saved [N, V] output, the [N, V] gradient scattered by
    # gather's backward and the [N, V] gradient it returns are all live. Measured once
    # on this machine: 2462 MiB, i.e. 3.1 x N·V·4 bytes; the lower bound is the stricter test.
    eager_peak = 3 * nv_bytes
    ours = measure_cpu(fused)
    print(f"\nfused peak {ours.peak_bytes / 2**20:.1f} MiB (largest {ours.largest_bytes / 2**20:.1f} MiB); "
          f"eager peak >= {eager_peak / 2**20:.1f} MiB; [N, V] float32 = {nv_bytes / 2**20:.1f} MiB")
    assert ours.largest_bytes < nv_bytes
    assert ours.peak_bytes * 8 <= eager_peak


def _bf16_fwd_bwd_memory(backend: str, N: int, H: int, V: int):
    """``linear_logprobs`` forward + backward on random bfloat16 hidden [N, H] and weight [V, H] with ``backend``
    forced, measured on the CPU: ``(measurement, bytes of d_hidden + d_weight in bfloat16)``."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(N, H, generator=g) * 0.05).bfloat16().requires_grad_()  # [N, H]
    weight = (torch.randn(V, H, generator=g) * 0.05).bfloat16().requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (N,), generator=g)  # [N]

    def fused():
        with forced_backend(backend):  # the backward op resolves its backend when it runs: inside the block
            logp = linear_logprobs(hidden, weight, labels)
            return torch.autograd.grad(logp.sum(), [hidden, weight])

    return measure_cpu(fused), (V * H + N * H) * 2


def test_cpu_memory_16bit_weight_needs_no_float32_weight_copy():
    """N=4096, H=512, V=50257 bfloat16, torch backend: forward+backward peak above the inputs at most
    1.25 x (d_weight + d_hidden in bfloat16) + 64 MiB. No float32 copy of the weight (the forward widens one
    vocabulary chunk at a time) and no float32 [V, H] gradient accumulator (with N < V the backward runs over
    vocabulary chunks, each d_weight slice accumulated in float32 and written once)."""
    N, H, V = 4096, 512, 50257
    ours, grads_bytes = _bf16_fwd_bwd_memory("torch", N, H, V)
    print(f"\nfused peak {ours.peak_bytes / 2**20:.1f} MiB (largest {ours.largest_bytes / 2**20:.1f} MiB); "
          f"gradients {grads_bytes / 2**20:.1f} MiB")
    assert ours.largest_bytes < V * H * 4  # no weight-sized float32 tensor
    assert ours.peak_bytes <= 1.25 * grads_bytes + 64 * 2**20


def test_triton_16bit_backward_holds_no_float32_weight_sized_buffer(monkeypatch):
    """bfloat16, N=64 < V=8192, H=64, Triton (interpreter, CPU tensors), forward and backward with a 1 MiB workspace
    budget: the backward runs vocabulary outer, so no float32 [V, H] tensor is ever allocated (the largest allocation
    is below V·H·4 bytes) and the peak above the inputs is at most the gradients in bfloat16 + the float32 [N, H]
    d_hidden accumulator + the budget (one dz chunk; d_weight's slices are written by their GEMM in bfloat16) + the
    CPU fallback's float32 operand pieces (_WIDEN_ELEMS) + 64 KiB of [N] vectors. Measured: 3.02 MiB, largest 1.0
    MiB; tokens outer (the order before): 5.0 MiB, largest 2.0 MiB (the float32 [V, H] accumulator)."""
    if "triton" not in backends("cpu"):
        pytest.skip("triton is not installed")
    N, H, V = 64, 64, 8192
    budget = 1 << 20
    monkeypatch.setattr(fl_module, "_DZ_BUDGET_BYTES", budget)
    ours, grads_bytes = _bf16_fwd_bwd_memory("triton", N, H, V)
    print(f"\nTriton fused peak {ours.peak_bytes / 2**20:.2f} MiB (largest {ours.largest_bytes / 2**20:.2f} MiB); "
          f"gradients {grads_bytes / 2**20:.2f} MiB")
    assert ours.largest_bytes < V * H * 4  # no weight-sized float32 tensor
    assert ours.peak_bytes <= grads_bytes + N * H * 4 + budget + fl_module._WIDEN_ELEMS * 4 + 64 * 1024


# ---------------------------------------------------------------- ahead-of-time compile


@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compiles_every_config(arch):
    pytest.importorskip("triton")
    from rlkernels.testing.aot import compile_config

    configs = [c for c in aot_configs() if arch in c.archs]
    # 2 kernels x 3 dtypes x bias on/off, and on sm_90 the Hopper forward and the Hopper dz kernel, each x 2 16-bit
    # dtypes x bias on/off
    assert len(configs) == (20 if arch == 90 else 12)
    spilled = []
    for config in configs:
        report = compile_config(config, arch)
        print(report)
        assert report.registers > 0
        if report.spill_bytes != 0:  # local memory in the hot loop: the tiles are too large for the registers
            spilled.append(str(report))
    assert not spilled, "configs that spill registers:\n" + "\n".join(spilled)


def test_float32_output_matmul_signatures_hold_for_cuda():
    """The CUDA-only branch (cuBLAS bf16 x bf16 -> float32) cannot run here; check on the meta
    device that the calls it makes exist with these arguments and give float32."""
    import rlkernels.fused_linear as mod

    if not mod._HAS_MM_OUT_DTYPE:
        pytest.skip("this torch has no float32-output matmul; the exact float32 fallback runs everywhere")
    a = torch.empty(64, 128, dtype=torch.bfloat16, device="meta")  # [n, V]
    b = torch.empty(128, 32, dtype=torch.bfloat16, device="meta")  # [V, H]
    assert torch.mm(a, b, out_dtype=torch.float32).dtype == torch.float32
    # addmm's float32-output overload: its schema (torch 2.11's meta kernel for it is a decomposition that takes
    # out_dtype for beta, so a meta call fails there; CUDA runs ATen's kernel, checked by the cuda tests)
    args = {x.name: str(x.type) for x in torch.ops.aten.addmm.dtype_out._schema.arguments}
    assert list(args)[:4] == ["self", "mat1", "mat2", "out_dtype"]
    assert args["self"] == args["mat1"] == args["mat2"] == args["out"] == "Tensor"


# ---------------------------------------------------------------- the Hopper forward and the plain baseline

# _fwd_kernel_tma's tiles shrunk for the interpreter: several token blocks (the last one partial), vocabulary splits
# (the last one past V), K steps (the last one past H) and work items per persistent program, a partial item group
_SMALL_TMA_TILES = fl_module._PersistentTiles(block_n=16, block_v=32, block_k=16, split_tiles=2, num_warps=8,
                                              num_stages=4, group_n=2)


def _spy_launches(monkeypatch):
    """Which forward ran: counts the launches of the two Triton forward kernels and of the cuBLAS baseline."""
    calls = {"tma": 0, "split": 0, "cublas": 0}
    for key, attr in (("tma", "_launch_fwd_tma"), ("cublas", "_forward_cublas")):
        original = getattr(fl_module, attr)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(fl_module, attr, counted)
    original_launch = fl_module._fwd_kernel.launch

    def split_launch(*args, **kwargs):
        calls["split"] += 1
        return original_launch(*args, **kwargs)

    monkeypatch.setattr(fl_module._fwd_kernel, "launch", split_launch)
    return calls


_FORWARD_CASES = [
    (45, 40, 301, True, 0.7, torch.bfloat16),  # odd V, H not a multiple of BLOCK_K
    (38, 48, 257, False, 1.3, torch.float16),
    (29, 40, 301, True, 0.7, torch.float32),  # float32: both fall back to _fwd_kernel (see _fwd_kernel_choice)
]
# on a GPU also several of the launcher's 128x128 tiles and 2048-wide splits (the interpreter would take minutes)
_FORWARD_CASES_GPU = [(300, 264, 5000, True, 0.9, torch.bfloat16)]


@pytest.mark.parametrize("kernel", ["tma", "cublas"])
@pytest.mark.parametrize("device,N,H,V,bias,temperature,dtype",
                         [(d, *c) for d in devices() for c in _FORWARD_CASES + (_FORWARD_CASES_GPU if d == "cuda" else [])])
def test_forward_kernels_match_float64_truth(device, kernel, N, H, V, bias, temperature, dtype, monkeypatch):
    """RLKERNELS_LINEAR_FWD=tma|cublas (under the interpreter on the CPU, with shrunk TMA tiles; compiled on a GPU,
    with the launcher's own, where "tma" runs only on sm_90): outputs and (through the unchanged backward)
    gradients against the float64 truth and no worse than eager, ignored tokens exactly 0; the chosen kernel is
    the one that ran."""
    if device == "cpu":
        monkeypatch.setattr(fl_module, "_TMA_TILES", _SMALL_TMA_TILES)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, kernel)
    calls = _spy_launches(monkeypatch)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=bias, seed=N + V)
    truth = _run(reference.linear_logprobs, *(x.requires_grad_() if x is not None else None for x in (hidden, weight, b)),
                 labels, g_logp, g_ent, temperature)
    leaves = [_leaf(x, dtype, device=device) for x in (hidden, weight, b)]
    labels, g_logp, g_ent = labels.to(device), g_logp.to(device), g_ent.to(device)
    eager = _run(reference.linear_logprobs, *leaves, labels, g_logp, g_ent, temperature)
    with forced_backend("triton"):
        out = _run(linear_logprobs, *[_leaf(x, dtype, device=device) for x in (hidden, weight, b)], labels, g_logp,
                   g_ent, temperature)
    runs_tma = device == "cpu" or torch.cuda.get_device_capability()[0] == 9
    expected = "split" if dtype == torch.float32 or (kernel == "tma" and not runs_tma) else kernel
    assert calls[expected] == 1 and sum(calls.values()) == 1, calls
    ignored = labels == -100
    assert torch.all(out[0][ignored] == 0) and torch.all(out[1][ignored] == 0)
    _check_all(out, truth, eager, dtype)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_tma_kernel_writes_every_split_partial(programs, monkeypatch):
    """``_fwd_kernel_tma`` alone, its partials buffer filled with NaN first: every (split, row) entry is written,
    with that split's own statistics (max, Σ exp(z - max), Σ exp(z - max)(z - max), the label's logit), against
    float64 sums over the split's columns, whether a program takes one work item or many."""
    monkeypatch.setattr(fl_module, "_TMA_TILES", _SMALL_TMA_TILES)
    monkeypatch.setattr(fl_module, "_INTERPRETER_PROGRAMS", programs)
    N, H, V, T = 45, 40, 301, 0.7
    hidden, weight, b, labels, _, _ = _inputs(N, H, V, bias=True, seed=7)
    h, w, bb = (x.to(torch.bfloat16) for x in (hidden, weight, b))
    y = labels.clamp(min=0)  # [N]
    t = _SMALL_TMA_TILES
    cols = t.split_tiles * t.block_v
    S = -(-V // cols)
    part = torch.full((4, S, N), float("nan"))  # [4, S, N]
    opt = fl_module.LinearLogprobsOptions(temperature=T, return_entropy=True, ignore_index=-100)
    fl_module._launch_fwd_tma(h, w, y, bb, part, opt.temperature)
    z = (h.double() @ w.double().T + bb.double()) / T  # [N, V] float64
    for j in range(S):
        zj = z[:, j * cols:(j + 1) * cols]  # [N, c]
        m = zj.amax(1)  # [N]
        e = torch.exp(zj - m[:, None])  # [N, c]
        in_split = (y >= j * cols) & (y < (j + 1) * cols)  # [N]
        zy = torch.where(in_split, z.gather(1, y[:, None]).squeeze(1), torch.zeros_like(m))  # [N]
        want = torch.stack((m, e.sum(1), (e * (zj - m[:, None])).sum(1), zy)).float()  # [4, N]
        torch.testing.assert_close(part[:, j], want, rtol=1e-5, atol=1e-5, msg=f"split {j}")


@pytest.mark.parametrize("tiles", ["_TMA_TILES", "_TMA_TILES_2CTA"])
def test_tma_forward_with_its_own_tiles_matches_the_split_kernel(tiles, monkeypatch):
    """The launcher's 128x128x64 tiles, and the 64x128x64 two-CTA ones, (one work item, a split mostly past V) under
    the interpreter: the partials, merged, are the split kernel's to float32 rounding (logits summed over K in other
    chunks)."""
    monkeypatch.setattr(fl_module, "_TMA_TILES", getattr(fl_module, tiles))
    hidden, weight, b, labels, _, _ = _inputs(37, 96, 300, bias=True, seed=131)
    h, w, bb = (x.to(torch.bfloat16) for x in (hidden, weight, b))
    y = labels.clamp(min=0)
    opt = fl_module.LinearLogprobsOptions(temperature=0.6, return_entropy=True, ignore_index=-100)
    got = {}
    for kernel in ("tma", "split"):
        monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, kernel)
        assert fl_module._fwd_kernel_choice(h, w) == kernel
        got[kernel] = fl_module._partials_triton(h, w, y, bb, opt)  # [4, N]
    torch.testing.assert_close(got["tma"], got["split"], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_forward_low_temperature_no_worse_than_eager(device, dtype, monkeypatch):
    """At T = 1e-3 the backward must see the forward's logits bit for bit (test_low_temperature_no_worse_than_eager):
    after the Hopper forward the backward sums K in the forward's blocks (64 with the launcher's tiles, against the
    backward's usual 32: under the interpreter float16's d_weight was 1.5x eager's error with 32; dividing by T, not
    multiplying by 1/T: that failed too, d_hidden 2.2x eager's error in bf16). On the CPU with small tiles whose K
    blocks (64) differ from the backward's usual ones; on a GPU with the launcher's (sm_90 only)."""
    if device == "cpu":
        tiles = dataclasses.replace(_SMALL_TMA_TILES, block_k=64)
        assert tiles.block_k != fl_module._tiles(dtype, backward=True).block_k
        monkeypatch.setattr(fl_module, "_TMA_TILES", tiles)
    elif torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward runs on sm_90 only")
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "tma")
    calls = _spy_launches(monkeypatch)
    temperature = 1e-3
    hidden, weight, b, labels, g_logp, g_ent, zmax = _large_logits_case(24, 64, 300, seed=61, scale=1.0)
    truth, _ = _truth_and_eager(hidden, weight, b, labels, g_logp, g_ent, temperature, dtype)
    labels, g_logp, g_ent = labels.to(device), g_logp.to(device), g_ent.to(device)
    eager = _run(reference.linear_logprobs, *[_leaf(x, dtype, device=device) for x in (hidden, weight, b)], labels,
                 g_logp, g_ent, temperature)  # on the device: its own float32 rounding
    with forced_backend("triton"):
        out = _run(linear_logprobs, *[_leaf(x, dtype, device=device) for x in (hidden, weight, b)], labels, g_logp,
                   g_ent, temperature)
    assert calls["tma"] == 1
    _check_all(out, truth, eager, dtype, tol=_magnitude_tol(dtype, zmax / temperature),
               vs_eager=("d_hidden", "d_weight", "d_bias"))


# _dz_kernel_tma's tiles shrunk for the interpreter: several token blocks and vocabulary tiles (the last ones
# partial), K steps (the last one past H), several items per persistent program, a partial item group
_SMALL_TMA_DZ_TILES = fl_module._PersistentTiles(block_n=16, block_v=32, block_k=16, split_tiles=1, num_warps=4,
                                                 num_stages=4, group_n=2, ctas_per_sm=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("col0", [0, 100])
def test_tma_dz_kernel_is_the_dz_kernel_bit_for_bit(dtype, col0, monkeypatch):
    """``_dz_kernel_tma`` (the backward's dz after the Hopper forward) under the interpreter writes the same dz and
    label residuals, bit for bit, as ``_dz_kernel`` with the same K blocks: the same logits (K summed in the same
    blocks) through the one ``_dz_store``. A chunk of the vocabulary starting at ``col0`` (labels inside it and
    outside it), bias, ignored tokens, ``N``, ``V`` and ``H`` not multiples of the tiles."""
    N, H, V = 45, 40, 150
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, col0 + V, bias=True, seed=17)
    h, w, bb = (x.to(dtype) for x in (hidden, weight, b))
    opt = fl_module.LinearLogprobsOptions(temperature=0.7, return_entropy=True, ignore_index=-100)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "split")
    logp, ent, stats = fl_module._forward_triton(h, w, labels, bb, opt)  # [N], [N], [2, N]
    t_tma = _SMALL_TMA_DZ_TILES
    t_ptr = fl_module._Tiles(block_n=16, block_v=32, block_k=t_tma.block_k, split_tiles=1, num_warps=4,
                             num_stages=2, group_n=2)
    out = {}
    for name, t in (("tma", t_tma), ("pointer", t_ptr)):
        dz_into = fl_module._dz_launcher(g_logp.float(), g_ent.float(), h, w, labels, bb, stats, ent, opt, t)
        dz = torch.full((N, V), float("nan"), dtype=dtype)  # [N, V] every entry must be written
        resid = torch.zeros(N)  # [N]
        dz_into(dz, resid, 0, N, col0, col0 + V)
        out[name] = dz, resid
    assert not torch.isnan(out["tma"][0]).any()
    assert torch.equal(out["tma"][0], out["pointer"][0]) and torch.equal(out["tma"][1], out["pointer"][1])
    in_chunk = (labels >= col0) & (labels < col0 + V)  # [N] the rows whose label entry is in this chunk
    assert torch.all(out["tma"][1][~in_chunk] == 0) and torch.any(out["tma"][1][in_chunk] != 0)


def test_tma_dz_kernel_follows_the_hopper_forward(monkeypatch):
    """After the Hopper forward the backward runs ``_dz_kernel_tma`` (its tiles, the forward's K blocks); after
    ``_fwd_kernel``, ``_dz_kernel``; after the cuBLAS forward, the cuBLAS tile backward; the gradients of the first match the float64 truth (also
    test_forward_kernels_match_float64_truth and the low-temperature test, which take this path)."""
    monkeypatch.setattr(fl_module, "_TMA_TILES", _SMALL_TMA_TILES)
    monkeypatch.setattr(fl_module, "_TMA_DZ_TILES", _SMALL_TMA_DZ_TILES)
    seen = _record_backward_kernels(monkeypatch)
    h = torch.zeros(4, 64, dtype=torch.bfloat16)  # [N, H]
    w = torch.zeros(8, 64, dtype=torch.bfloat16)  # [V, H]
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "tma")
    t = fl_module._bwd_tiles(h, w)
    assert isinstance(t, fl_module._PersistentTiles) and t.block_k == _SMALL_TMA_TILES.block_k
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "split")
    assert fl_module._bwd_tiles(h, w) == fl_module._tiles(torch.bfloat16, backward=True)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "cublas")  # the cuBLAS tile backward (16-bit inputs only)
    assert fl_module._bwd_tiles(h, w) is fl_module._CUBLAS_DZ_TILES
    assert fl_module._bwd_tiles(h.float(), w.float()) == fl_module._tiles(torch.float32, backward=True)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "tma")
    hidden, weight, b, labels, g_logp, g_ent = _inputs(37, 48, 300, bias=True, seed=3)
    truth = _run(reference.linear_logprobs, *(x.clone().requires_grad_() for x in (hidden, weight, b)), labels,
                 g_logp, g_ent, 0.8)
    eager = _run(reference.linear_logprobs, *(_leaf(x, torch.bfloat16) for x in (hidden, weight, b)), labels, g_logp,
                 g_ent, 0.8)
    with forced_backend("triton"):
        out = _run(linear_logprobs, *(_leaf(x, torch.bfloat16) for x in (hidden, weight, b)), labels, g_logp, g_ent,
                   0.8)
    assert seen == {"tma": 1, "split": 0, "tile": []}, seen
    _check_all(out, truth, eager, torch.bfloat16)


def test_forward_kernel_choice(monkeypatch):
    """Unset, the switch takes "tma" on CUDA tensors where it can run (sm_90, 16-bit inputs with 16-byte aligned
    rows: measured 2x faster than "split" on an H200, its dz kernel 2.9x) and "split" anywhere else, the
    interpreter's CPU tensors included; named, "tma" needs 16-bit inputs with 16-byte aligned rows, "cublas" 16-bit
    inputs; anything else is refused by name."""
    h = torch.zeros(4, 64, dtype=torch.bfloat16)  # [N, H]
    w = torch.zeros(8, 64, dtype=torch.bfloat16)  # [V, H]
    monkeypatch.delenv(fl_module.FWD_KERNEL_ENV, raising=False)
    assert fl_module._fwd_kernel_choice(h, w) == "split"  # CPU tensors: the interpreter runs "split" unless asked
    assert fl_module._bwd_tiles(h, w) == fl_module._tiles(torch.bfloat16, backward=True)
    # CUDA tensors (stand-ins: only the device, the alignment checks and the capability are read)
    cuda_like = lambda t: mock.Mock(wraps=t, device=torch.device("cuda", 0), dtype=t.dtype,  # noqa: E731
                                    data_ptr=lambda: 0, stride=t.stride, element_size=t.element_size)
    for capability, want in (((9, 0), "tma"), ((8, 0), "split"), ((10, 0), "split")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fl_module._fwd_kernel_choice(cuda_like(h), cuda_like(w)) == want, capability
        assert fl_module._fwd_kernel_choice(cuda_like(h.float()), cuda_like(w.float())) == "split"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    h60, w60 = torch.zeros(4, 60, dtype=torch.bfloat16), torch.zeros(8, 60, dtype=torch.bfloat16)  # 120-byte rows
    assert fl_module._fwd_kernel_choice(cuda_like(h60), cuda_like(w60)) == "split"
    assert isinstance(fl_module._bwd_tiles(cuda_like(h), cuda_like(w)), fl_module._PersistentTiles)
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "split")  # named: what it says, on sm_90 too
    assert fl_module._fwd_kernel_choice(cuda_like(h), cuda_like(w)) == "split"
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "tma")
    assert fl_module._fwd_kernel_choice(h, w) == "tma"
    assert fl_module._fwd_kernel_choice(h.float(), w.float()) == "split"  # float32: no TMA kernel
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "cublas")
    assert fl_module._fwd_kernel_choice(h, w) == "cublas"
    assert fl_module._fwd_kernel_choice(h.float(), w.float()) == "split"  # float32: the backward's logits bits
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "tma")
    h_odd = torch.zeros(4, 60, dtype=torch.bfloat16)  # 120-byte rows: not a TMA stride
    assert fl_module._fwd_kernel_choice(h_odd, torch.zeros(8, 60, dtype=torch.bfloat16)) == "split"
    monkeypatch.setenv(fl_module.FWD_KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="RLKERNELS_LINEAR_FWD"):
        fl_module._fwd_kernel_choice(h, w)


def test_tma_forward_sass_has_tma_and_wide_wgmma():
    """The Hopper forward's sm_90 SASS (both specializations, bf16, with and without bias): TMA tensor loads
    (UTMALDG), wgmma (HGMMA) with N >= 128 and nothing narrower, no spill in any configuration the launcher picks
    (the flattened alternative: see below); the report carries the pipelining depth."""
    pytest.importorskip("triton")
    from rlkernels.testing.aot import compile_config

    configs = [c for c in aot_configs() if c.kernel is fl_module._fwd_kernel_tma]
    assert len(configs) == 4 and all(c.archs == (90,) for c in configs)
    bf16 = [c for c in configs if c.signature["h_desc"].startswith("tensordesc<bf16")]  # fp16: the same code
    # the alternatives `make gpu` measures against the launcher's (aligned, as measured): FLATTEN flipped, and the
    # 64x128 tiles on 4 warps that must fit two CTAs per SM
    other = dataclasses.replace(bf16[0], constexprs={**bf16[0].constexprs, "FLATTEN": not bf16[0].constexprs["FLATTEN"]})
    t2 = fl_module._TMA_TILES_2CTA
    two = dataclasses.replace(
        bf16[0], signature={**bf16[0].signature, "h_desc": f"tensordesc<bf16[{t2.block_n}, {t2.block_k}]>",
                            "w_desc": f"tensordesc<bf16[{t2.block_v}, {t2.block_k}]>"},
        constexprs={**bf16[0].constexprs, "BLOCK_N": t2.block_n, "BLOCK_V": t2.block_v, "BLOCK_K": t2.block_k,
                    "GROUP_N": t2.group_n, "FLATTEN": t2.flatten},
        num_warps=t2.num_warps, num_stages=t2.num_stages)
    assert compile_config(two, 90, aligned=True).ctas_per_sm >= t2.ctas_per_sm
    import triton

    if triton.__version__.startswith("3.6."):  # the oldest triton admitted: its TritonGPUFuseNestedLoops pass fails
        with pytest.raises(Exception, match="PassManager|FuseNestedLoops"):  # on the flattened schedule
            compile_config(other, 90, aligned=True)
        alternatives = (two,)  # bench_fused_linear's "tma flat" row then reports that it does not build
    else:
        alternatives = (other, two)
    for config in (*bf16, *alternatives):
        for aligned in ((False, True) if config in bf16 else (True,)):
            report = compile_config(config, 90, aligned=aligned)
            # the flattened schedule (never the launcher's) needs 254-255 registers: 8 B spilled without bias once
            # the token count is unspecialized, as it is launched (fused_linear.UNSPECIALIZED_ROWS) -- one reason it
            # is not the default (see fused_linear._TMA_TILES); every configuration the launcher picks: no spill
            flat_without_bias = config.constexprs["FLATTEN"] and not config.constexprs["HAS_BIAS"]
            assert report.spill_bytes == 0 or flat_without_bias, str(report)
            assert report.tma_loads > 0, str(report)
            assert report.wgmma_shapes and min(int(s.split("x")[1]) for s in report.wgmma_shapes) >= 128, str(report)
            assert report.num_stages == config.num_stages, str(report)


def test_tma_dz_kernel_sass_has_tma_and_wide_wgmma():
    """The Hopper dz kernel's sm_90 SASS (bf16 and fp16, bias or not, both specializations): TMA tensor loads, wgmma
    with N >= 128 and nothing narrower, no spill, and the two CTAs per SM its tiles are chosen for (one CTA's dz
    epilogue runs while the other's wgmma does). Triton 3.6 spilled 48-184 B here until the label entry's rounding
    loss was formed per row (_dz_store)."""
    pytest.importorskip("triton")
    from rlkernels.testing.aot import compile_config

    configs = [c for c in aot_configs() if c.kernel is fl_module._dz_kernel_tma]
    assert len(configs) == 4 and all(c.archs == (90,) for c in configs)
    for config in configs:
        for aligned in (False, True):
            report = compile_config(config, 90, aligned=aligned)
            assert report.spill_bytes == 0, str(report)
            assert report.tma_loads > 0, str(report)
            assert report.wgmma_shapes and min(int(x.split("x")[1]) for x in report.wgmma_shapes) >= 128, str(report)
            assert report.ctas_per_sm >= fl_module._TMA_DZ_TILES.ctas_per_sm, str(report)


def test_the_sass_reader_reads_wgmma_shapes():
    """HGMMA shapes from a hand-written nvdisasm listing: distinct, ordered by N; the widest N."""
    from rlkernels.testing.aot import wgmma_shapes

    sass = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88, gsb0 ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0130*/                   UTMALDG.2D [UR8], [UR4] ;
"""
    assert wgmma_shapes(sass) == ("64x64x16", "64x128x16")
    assert wgmma_shapes("HMMA.16816.F32.BF16 R4, R8, R12, R4 ;") == ()


@pytest.mark.parametrize("backend", backends("cpu"))
def test_strided_and_expanded_bias(backend):
    # Triton read the bias at unit stride: a [::2] slice gave wrong log-probs and a stride-0 (expanded) bias read
    # past its one-element storage
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, generator=gen)  # [N, H]
    w = torch.randn(29, 8, generator=gen) * 0.5  # [V, H]
    labels = torch.randint(0, 29, (6,), generator=gen)  # [N]
    for bias in (torch.randn(58, generator=gen)[::2], torch.tensor(0.3).expand(29)):  # [V] float32, stride 2 / 0
        assert bias.stride() != (1,)
        truth = reference.linear_logprobs(h.double(), w.double(), labels, bias=bias.double(), return_entropy=True)
        with forced_backend(backend):
            out = linear_logprobs(h, w, labels, bias=bias, return_entropy=True)  # ([N], [N])
        for o, t in zip(out, truth):
            assert_close_to_truth(o, t, torch.float32)


def test_reference_ignored_rows_give_no_gradient_even_when_nan():
    # the float64 truth itself: an ignored token's NaN hidden state used to reach d_weight through 0 * NaN
    h = torch.randn(3, 4, dtype=torch.float64)
    h[1] = float("nan")
    h.requires_grad_()
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    logp = reference.linear_logprobs(h, w, torch.tensor([1, -100, 2]))  # [3]
    g_h, g_w = torch.autograd.grad(logp.sum(), [h, w])
    assert torch.isfinite(logp).all() and torch.isfinite(g_w).all()
    assert torch.equal(g_h[1], torch.zeros(4, dtype=torch.float64))


def test_zero_hidden_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="H >= 1"):
        linear_logprobs(torch.randn(3, 0), torch.randn(7, 0), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("order", ["vocabulary", "tokens"])
def test_backward_reads_the_device_a_fixed_number_of_times(order, monkeypatch):
    """On a GPU every read of a device result by the host (a size that depends on the data, a value) waits for
    everything queued before it. The 16-bit backward (with a bias) plans its label sums for every chunk at once,
    in both loop orders: the host reads of a backward over several chunks are those over two (counted here on the
    CPU: nonzero, unique_consecutive, tolist, item, and segment_reduce without unsafe=True, which checks its
    lengths)."""
    pytest.importorskip("triton")
    reads = []

    def counted(name, fn):
        def run(*args, **kwargs):
            if name != "segment_reduce" or not kwargs.get("unsafe", False):
                reads.append(name)
            return fn(*args, **kwargs)
        return run

    for name in ("nonzero", "unique_consecutive", "segment_reduce"):
        monkeypatch.setattr(torch, name, counted(name, getattr(torch, name)))
    for name in ("nonzero", "tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    N, V = (40, 1024) if order == "vocabulary" else (320, 200)
    hidden, weight, b, labels, g_logp, g_ent = _inputs(N, 32, V, bias=True, seed=9)
    launches = _record_dz_launches(monkeypatch)
    counts, chunks = {}, {}
    for parts in (2, 5):  # a dz workspace of about 1 / parts of [N, V] in bf16 (the chunks end on whole tiles)
        monkeypatch.setattr(fl_module, "_DZ_BUDGET_BYTES", N * V * 2 // parts)
        h, w, bb = (_leaf(x, torch.bfloat16) for x in (hidden, weight, b))
        with forced_backend("triton"):
            logp, ent = linear_logprobs(h, w, labels, bias=bb, return_entropy=True)
            loss = (logp * g_logp).sum() + (ent * g_ent).sum()
            reads.clear()
            launches.clear()
            torch.autograd.grad(loss, (h, w, bb))
        chunks[parts], counts[parts] = len(launches), sorted(reads)
    assert 2 <= chunks[2] < chunks[5], chunks  # more chunks, ...
    assert counts[5] == counts[2], counts  # ... the same host reads


def test_float32_reductions_turn_off_16_bit_split_k_sums_and_restore_the_flags():
    """The 16-bit-output gradient GEMMs run with cuBLAS's reduced-precision (16-bit) split-K reductions off: on the
    H200 (2026-11-27) an 8304 x 16 d_weight with the label residuals inside its GEMM came out at 1.7x eager's
    error with them on (its CUDA test, test_fused_policy.py's last-chunk test, held layout). Inside: both flags
    off; after, even after an exception: the user's settings as they were; off CUDA: untouched."""
    matmul = torch.backends.cuda.matmul
    names = fl_module._REDUCTION_FLAGS
    before = {n: getattr(matmul, n) for n in names}
    try:
        for n in names:
            setattr(matmul, n, True)
        with fl_module._float32_reductions(torch.device("cpu")):
            assert all(getattr(matmul, n) for n in names)
        with fl_module._float32_reductions(torch.device("cuda")):
            assert not any(getattr(matmul, n) for n in names)
        assert all(getattr(matmul, n) for n in names)
        setattr(matmul, names[1], False)  # a user's own choice survives
        with pytest.raises(RuntimeError, match="inside"):
            with fl_module._float32_reductions(torch.device("cuda")):
                raise RuntimeError("inside")
        assert getattr(matmul, names[0]) and not getattr(matmul, names[1])
        if hasattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction"):
            try:
                matmul.allow_bf16_reduced_precision_reduction = (True, False)  # torch >= 2.10: split-K off
            except (TypeError, ValueError, RuntimeError):
                return  # this torch takes a bool only
            with fl_module._float32_reductions(torch.device("cuda")):
                pass
            assert matmul.allow_bf16_reduced_precision_reduction
            assert not matmul.allow_bf16_reduced_precision_reduction_split_k
    finally:
        for n, v in before.items():
            setattr(matmul, n, v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_head_backward_allocates_no_weight_sized_gradient(backend, dtype):
    """A frozen head (weight.requires_grad=False: LoRA, a frozen lm_head) gets no d_weight: the backward neither
    runs the d_weight GEMM nor allocates a [V, H] buffer nobody receives (it did, then dropped it): its peak is
    below the trainable head's by at least that gradient, and d_hidden and d_bias are those of the same call with a
    trainable head. N < V (vocabulary outer) for the memory; N >= V (tokens outer) for the gradients."""
    if backend == "triton":
        pytest.importorskip("triton")
    for N, H, V in ((8, 64, 2000), (50, 16, 40)):
        hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=True, seed=5)
        frozen = weight.to(dtype)  # [V, H] no gradient wanted
        h, bb = _leaf(hidden, dtype), _leaf(b, dtype)  # [N, H], [V]

        def grads(w):  # d_hidden, d_bias of Σ g_logp·logp + g_ent·H
            logp, ent = linear_logprobs(h, w, labels, bias=bb, temperature=0.9, return_entropy=True)  # [N] each
            loss = (logp * g_logp.float()).sum() + (ent * g_ent.float()).sum()
            return torch.autograd.grad(loss, (h, bb))

        with forced_backend(backend):
            want = grads(_leaf(weight, dtype))
            got = grads(frozen)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if N < V:  # the [V, H] gradient (and its float32 slices) gone from the peak
                w = _leaf(weight, dtype)  # [V, H]
                trainable = measure_cpu(lambda: grads(w)).peak_bytes
                peak = measure_cpu(lambda: grads(frozen)).peak_bytes
                assert peak <= trainable - V * H * frozen.element_size(), (backend, dtype, peak, trainable)


@pytest.mark.parametrize("backend", [b for b in backends("cpu") if b != "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_hidden_backward_allocates_no_hidden_sized_gradient(backend, dtype):
    """Only the head trains (hidden.requires_grad=False: features computed without grad): the backward neither
    runs the d_hidden GEMM nor allocates an [N, H] buffer nobody receives: the backward's peak is below the one
    with a trainable hidden by at least d_hidden (and its float32 accumulator for 16-bit), and d_weight and d_bias
    are those of the same call with a trainable hidden (bit for bit). Both orders (N >= V tokens outer, N < V
    vocabulary outer), with ignored tokens (the compacted rows). The mirror of the frozen-head test above."""
    if backend == "triton":
        pytest.importorskip("triton")
    for N, H, V in ((400, 96, 40), (8, 64, 2000)):
        hidden, weight, b, labels, g_logp, g_ent = _inputs(N, H, V, bias=True, seed=6)
        frozen = hidden.to(dtype)  # [N, H] no gradient wanted
        w, bb = _leaf(weight, dtype), _leaf(b, dtype)  # [V, H], [V]

        def backward(h):  # the backward alone: d_weight, d_bias of Σ g_logp·logp + g_ent·H
            logp, ent = linear_logprobs(h, w, labels, bias=bb, temperature=0.9, return_entropy=True)  # [N] each
            loss = (logp * g_logp.float()).sum() + (ent * g_ent.float()).sum()
            return lambda: torch.autograd.grad(loss, (w, bb), retain_graph=True)

        with forced_backend(backend):
            trainable, only_head = backward(_leaf(hidden, dtype)), backward(frozen)
            want, got = trainable(), only_head()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (backend, dtype, N, V)
            with_dh = measure_cpu(trainable).peak_bytes
            peak = measure_cpu(only_head).peak_bytes
            # d_hidden, and for 16-bit its float32 accumulator (all N tokens in one chunk at these sizes)
            saved = N * H * (frozen.element_size() + (4 if dtype != torch.float32 else 0))
            assert peak <= with_dh - saved, (backend, dtype, N, V, peak, with_dh)


def test_bench_label_residuals_after_is_the_same_gradient_rounded_twice():
    """bench_fused_linear.gemm_then_label_residuals, the alternative the GPU benches time beside
    fl._gemm_with_label_residuals (a plain 16-bit GEMM, then the residual rows added): the same d_weight, the
    rows without a label bit for bit, the labelled rows within two 16-bit roundings of the truth where the
    package's are within one; and its residuals are really added (without them the labelled rows are off by
    far more)."""
    from bench.bench_fused_linear import gemm_then_label_residuals

    N, H, V = 64, 32, 300
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g).to(torch.bfloat16)  # [N, H]
    labels = torch.randint(0, 4, (N,), generator=g)  # [N] four labels: their rows carry every residual
    exact = torch.randn(N, V, generator=g, dtype=torch.float64) * 1e-3  # [N, V] a stand-in dL/dz
    exact[torch.arange(N), labels] = -0.7 + torch.rand(N, generator=g, dtype=torch.float64) * 0.1  # dominant
    dz = exact.to(torch.bfloat16)  # [N, V] as the kernels hold it
    resid = (exact[torch.arange(N), labels] - dz[torch.arange(N), labels].double()).float()  # [N] what it lost
    tok = torch.arange(N)  # [N]
    (run,) = fl_module._label_runs(torch.zeros_like(tok), labels, tok, 1, V)
    inside, after = (torch.empty(V, H, dtype=torch.bfloat16) for _ in range(2))  # [V, H] each
    fl_module._gemm_with_label_residuals(inside, 0, V, dz, hidden, run, resid[run[0]])
    gemm_then_label_residuals(after, 0, V, dz, hidden, run, resid[run[0]])
    assert torch.equal(after[4:], inside[4:])
    held = dz.double()  # [N, V] with the label entries whole, as the residuals carry them
    held[torch.arange(N), labels] = exact[torch.arange(N), labels]
    truth = (held.T @ hidden.double())[:4]  # [4, H] the labelled rows
    half_step = truth.abs() * 2.0**-8  # [4, H] one bf16 rounding's bound
    assert ((inside[:4].double() - truth).abs() <= 1.01 * half_step).all()
    assert ((after[:4].double() - truth).abs() <= 2.02 * half_step).all()
    plain = (dz.double().T @ hidden.double())[:4].to(torch.bfloat16)  # [4, H] the GEMM without the residuals
    err = lambda x: ((x.double() - truth).norm() / truth.norm()).item()  # noqa: E731
    # measured: 1.43e-3 inside, 1.64e-3 after, 2.17e-3 without the residuals (both ways round the output too)
    assert err(inside[:4]) <= err(after[:4]) and err(plain) > 1.2 * err(after[:4])
