"""rlkernels.logprobs (rlkernels/softmax.py) against the float64 reference, for every backend the machine runs.

Triton kernels run under the interpreter on CPU tensors, so shapes stay small.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re

import pytest
import torch

import rlkernels
from rlkernels import reference
from rlkernels._host import option_values, options_from
from rlkernels.testing import memory as _memory
from tests.helpers import (DTYPES, EAGER_SLACK, REL_TOL, assert_close_to_truth, backends, devices, forced_backend,
                           noncontiguous, on_device)

from rlkernels import softmax as lp_module  # noqa: E402

IGNORE = -100
# every backend on every device: inputs are made on the CPU (one generator), moved with on_device (same
# layout), and the outputs compared on the CPU against the same float64 truth
DEVICE_BACKENDS = [pytest.param(d, b, id=f"{d}-{b}") for d in devices() for b in backends(d)]

# (V, leading shape, temperature, layout): odd and large vocabularies, every layout the launcher handles
CASES = [
    (1000, (3, 5), 0.7, "contiguous"),
    (4097, (2, 3), 1.3, "noncontiguous"),  # last-dim stride 2: copied before the kernel
    (32000, (2, 4), 1.0, "sliced"),  # logits[:, :-1]: strided rows, read in place
    (49152, (4,), 0.7, "contiguous"),
]


def _make_inputs(V, shape, dtype, layout, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    if layout == "sliced":
        full = torch.randn(shape[0], shape[1] + 1, V, generator=gen, dtype=torch.float64) * scale
        logits = full.to(dtype)[:, :-1]  # [B, T, V], row stride (T+1)·V
        assert not logits.is_contiguous() and logits.stride(-1) == 1
    else:
        logits = (torch.randn(*shape, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
        if layout == "noncontiguous":
            logits = noncontiguous(logits)
    labels = torch.randint(0, V, shape, generator=gen)
    flat = labels.view(-1)
    flat[0] = 0
    flat[-1] = V - 1
    if flat.numel() > 2:
        flat[1] = IGNORE
    g_logp = torch.randn(shape, generator=gen, dtype=torch.float64).float()  # float32 values, exact in float64
    g_ent = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    return logits, labels, g_logp, g_ent


def _run(fn, logits, labels, g_logp, g_ent, **kw):
    x = logits.detach().clone() if logits.is_contiguous() else logits.detach()
    x.requires_grad_(True)
    labels, g_logp, g_ent = on_device(x.device, labels, g_logp, g_ent)
    logp, ent = fn(x, labels, return_entropy=True, ignore_index=IGNORE, **kw)
    (grad,) = torch.autograd.grad([logp, ent], [x], [g_logp.to(logp.dtype), g_ent.to(ent.dtype)])
    return logp.detach().cpu(), ent.detach().cpu(), grad.cpu()


# the contract's vocabularies, on a GPU only (under the CPU's Triton interpreter they would take minutes)
CUDA_CASES = [(128256, (2, 3), 0.7, "sliced"), (151936, (5,), 1.0, "contiguous")]
MATCH_CASES = [pytest.param(d, b, *c, id=f"{d}-{b}-V{c[0]}-{c[3]}-T{c[2]}")
               for d in devices() for b in backends(d) for c in CASES + (CUDA_CASES if d == "cuda" else [])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device,backend,V,shape,temperature,layout", MATCH_CASES)
def test_matches_float64_reference(device, backend, dtype, V, shape, temperature, layout):
    logits, labels, g_logp, g_ent = _make_inputs(V, shape, dtype, layout, seed=V + len(shape))
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=temperature)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=temperature)
    logp, ent, grad = out
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert grad.dtype == dtype and grad.shape == logits.shape
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert_close_to_truth(o, t, dtype, eager=e, name=f"{backend} {name}")
    ignored = labels == IGNORE
    assert ignored.any()
    assert torch.equal(logp[ignored], torch.zeros_like(logp[ignored]))
    assert torch.equal(ent[ignored], torch.zeros_like(ent[ignored]))
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logp_only_and_int32_labels(backend):
    """return_entropy=False returns one tensor whose gradient needs no entropy gradient."""
    logits, labels, g_logp, _ = _make_inputs(777, (6,), torch.float32, "contiguous", seed=1)
    labels = labels.to(torch.int32)
    labels[1] = 3  # not ignored here: this test's ignore_index is -1
    labels[2] = -1
    x = logits.clone().requires_grad_(True)
    with forced_backend(backend):
        logp = rlkernels.logprobs(x, labels, temperature=1.3, ignore_index=-1)
    (grad,) = torch.autograd.grad(logp, x, g_logp)
    x64 = logits.double().requires_grad_(True)
    ref = reference.logprobs(x64, labels.long(), temperature=1.3, ignore_index=-1)
    (ref_grad,) = torch.autograd.grad(ref, x64, g_logp.double())
    assert isinstance(logp, torch.Tensor) and logp.shape == (6,)
    assert_close_to_truth(logp, ref, torch.float32, name="logp")
    assert_close_to_truth(grad, ref_grad, torch.float32, name="dlogits")
    assert logp[2].item() == 0.0 and torch.all(grad[2] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_float64_returns_float32_computed_in_float64(backend):
    """DESIGN: log-probabilities come back in float32 whatever the input dtype. float64 logits still compute in
    float64, so the outputs are the truth rounded once to float32 (far closer than a float32 computation), and
    the gradient keeps the logits' dtype, float64, exact up to the float32 upstream gradients it was given."""
    logits, labels, g_logp, g_ent = _make_inputs(513, (5,), torch.float64, "contiguous", seed=2)
    truth = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    for name, o, t, dtype in zip(("logp", "entropy", "dlogits"), out, truth,
                                 (torch.float32, torch.float32, torch.float64)):
        assert o.dtype == dtype, f"{name}: {o.dtype}"
        want = t.to(dtype) if dtype == torch.float32 else t
        assert_close_to_truth(o, want, torch.float64, name=name, tol=1e-7)  # g rounded to float32: ~6e-8
    with forced_backend(backend):
        assert rlkernels.logprobs(logits, labels).dtype == torch.float32  # without the entropy too


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("peak", [4.0, 8.0])
def test_peaked_distribution_label_gradient(device, backend, peak):
    """p_y close to 1 (1 - p_y ≈ 2e-4 and 5e-6): the label's gradient 1 - p_y is as precise
    as eager float32 PyTorch's (a naive 1 - exp(z_y - lse) is several times worse)."""
    V = 300
    logits = torch.full((2, V), -10.0)
    logits[:, 7] = peak
    logits += torch.linspace(0, 1e-3, V)  # never constant
    labels = torch.tensor([7, 7])
    with forced_backend(backend):
        x = logits.to(device).requires_grad_(True)
        (grad,) = torch.autograd.grad(rlkernels.logprobs(x, labels.to(device)).sum(), x)
    grad = grad.cpu()
    x64 = logits.double().requires_grad_(True)
    (truth,) = torch.autograd.grad(reference.logprobs(x64, labels).sum(), x64)
    x32 = logits.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(reference.logprobs(x32, labels).sum(), x32)
    rel = ((grad[:, 7].double() - truth[:, 7]) / truth[:, 7]).abs().max().item()
    eager_rel = ((eager[:, 7].double() - truth[:, 7]) / truth[:, 7]).abs().max().item()
    assert 0 < truth[0, 7].item() < 1e-3
    assert rel <= EAGER_SLACK * eager_rel, (rel, eager_rel)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_nan_propagates_and_empty_input(device, backend):
    logits, labels, _, _ = _make_inputs(600, (3,), torch.float32, "contiguous", seed=3)
    labels[1] = 5
    logits[1, 100] = float("nan")
    with forced_backend(backend):
        logp, ent = (t.cpu() for t in rlkernels.logprobs(*on_device(device, logits, labels), return_entropy=True))
        empty = rlkernels.logprobs(torch.randn(0, 7, device=device), torch.zeros(0, dtype=torch.long, device=device),
                                   return_entropy=True)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert torch.isfinite(logp[[0, 2]]).all() and torch.isfinite(ent[[0, 2]]).all()
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_masked_vocabulary_minus_inf(device, backend):
    """-inf logits (a masked vocabulary) are tokens of probability 0: finite entropy and gradient."""
    logits, labels, g_logp, _ = _make_inputs(5000, (3,), torch.float32, "contiguous", seed=4)
    logits[:, :4500] = float("-inf")  # the whole first block of the row is -inf
    labels = torch.tensor([4500, 4999, 4700])
    g_ent = torch.randn(3)
    with forced_backend(backend):
        x = logits.to(device).requires_grad_(True)
        logp, ent = rlkernels.logprobs(x, labels.to(device), return_entropy=True)
        (grad,) = torch.autograd.grad([logp, ent], x, on_device(device, g_logp, g_ent))
    logp, ent, grad = logp.detach().cpu(), ent.detach().cpu(), grad.cpu()
    # the truth over the unmasked vocabulary (the reference's p log p is NaN at p = 0)
    x64 = logits[:, 4500:].double().requires_grad_(True)
    ref, ref_ent = reference.logprobs(x64, labels - 4500, return_entropy=True)
    (ref_grad,) = torch.autograd.grad([ref, ref_ent], x64, [g_logp.double(), g_ent.double()])
    assert_close_to_truth(logp, ref, torch.float32, name="logp")
    assert_close_to_truth(ent, ref_ent, torch.float32, name="entropy")
    assert_close_to_truth(grad[:, 4500:], ref_grad, torch.float32, name="dlogits")
    assert torch.equal(grad[:, :4500], torch.zeros_like(grad[:, :4500]))


# ---------------------------------------------------------------- torch backend: chunks and shortcuts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_rows", [1, 3])
def test_torch_backend_many_chunks(monkeypatch, dtype, chunk_rows):
    """The other tests fit in one chunk; here chunks of 1 and 3 rows (the last one partial, restarting
    at each outer index of strided rows) carry every row's statistics, label and ignored row."""
    V = 1000
    monkeypatch.setattr(lp_module, "_CHUNK_BYTES", chunk_rows * V * 4)
    assert lp_module._chunk_rows(V, torch.float32) == chunk_rows
    logits, labels, g_logp, g_ent = _make_inputs(V, (3, 5), dtype, "sliced", seed=11)
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=0.8)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=0.8)
    with forced_backend("torch"):
        out = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent, temperature=0.8)
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert_close_to_truth(o, t, dtype, eager=e, name=f"torch {name}")
    ignored = labels == IGNORE
    assert torch.equal(out[2][ignored], torch.zeros_like(out[2][ignored]))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_masked_vocabulary_in_some_rows(monkeypatch, device, backend):
    """Rows with -inf logits share chunks with ordinary rows: the p log p = 0 guard applies to them
    (finite entropy and gradient) and the other rows stay as exact as eager's."""
    V = 700
    monkeypatch.setattr(lp_module, "_CHUNK_BYTES", 2 * V * 4)
    logits, labels, g_logp, g_ent = _make_inputs(V, (6,), torch.float32, "contiguous", seed=13)
    masked = torch.tensor([1, 4])
    logits[masked, :300] = float("-inf")
    labels[masked] = torch.tensor([300, 650])
    labels[1] = 300  # row 1 is masked, not ignored; row 2 is the ignored one here
    labels[2] = IGNORE
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent)

    def by_row(x):  # the reference row by row, over each row's finite logits (its gradient is NaN at -inf)
        logp, ent, grad = torch.zeros(6, dtype=x.dtype), torch.zeros(6, dtype=x.dtype), torch.zeros_like(x)
        for r in range(6):
            lo = 300 if r in masked else 0
            y = labels[r : r + 1] - lo if labels[r] != IGNORE else labels[r : r + 1]
            logp[r], ent[r], grad[r, lo:] = (t[0] for t in _run(reference.logprobs, x[r : r + 1, lo:], y, g_logp[r : r + 1], g_ent[r : r + 1]))
        return logp, ent, grad

    truth, eager = by_row(logits.double()), by_row(logits)
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert torch.isfinite(o).all(), name
        assert_close_to_truth(o, t, torch.float32, eager=e, name=f"{backend} {name}")
    assert torch.equal(out[2][masked, :300], torch.zeros(2, 300))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("unused", ["none", "zero"])
def test_entropy_returned_but_not_differentiated(device, backend, unused):
    """With return_entropy=True and the entropy left out of the loss (upstream gradient None) or
    weighted by 0, the gradient is the log-prob gradient alone (the torch backend skips the H term)."""
    logits, labels, g_logp, _ = _make_inputs(1000, (2, 3), torch.float32, "contiguous", seed=12)
    x = logits.to(device).requires_grad_(True)
    with forced_backend(backend):
        logp, ent = rlkernels.logprobs(x, labels.to(device), temperature=0.8, return_entropy=True, ignore_index=IGNORE)
    if unused == "none":
        (grad,) = torch.autograd.grad(logp, x, g_logp.to(device))
    else:
        (grad,) = torch.autograd.grad([logp, ent], x, [g_logp.to(device), torch.zeros_like(ent)])
    logp, ent, grad = logp.detach().cpu(), ent.detach().cpu(), grad.cpu()
    x64 = logits.double().requires_grad_(True)
    ref, ref_ent = reference.logprobs(x64, labels, temperature=0.8, return_entropy=True, ignore_index=IGNORE)
    (ref_grad,) = torch.autograd.grad(ref, x64, g_logp.double())
    assert_close_to_truth(logp, ref, torch.float32, name="logp")
    assert_close_to_truth(ent, ref_ent, torch.float32, name="entropy")
    assert_close_to_truth(grad, ref_grad, torch.float32, name="dlogits")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_ignored_row_with_nan_logits_is_exactly_zero(device, backend):
    logits, labels, g_logp, g_ent = _make_inputs(300, (4,), torch.float32, "contiguous", seed=14)
    logits[1] = float("nan")
    labels[1] = IGNORE
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent)
    assert logp[1].item() == 0.0 and ent[1].item() == 0.0
    assert torch.equal(grad[1], torch.zeros(300))
    assert torch.isfinite(grad).all() and torch.isfinite(logp).all() and torch.isfinite(ent).all()


def test_strided_rows_are_read_in_place():
    x = torch.randn(3, 6, 50)[:, :-1]  # [3, 5, 50]
    rows = lp_module._as_rows(x)
    assert rows.shape == (3, 5, 50) and rows.data_ptr() == x.data_ptr()
    assert torch.equal(rows.reshape(-1, 50), x.reshape(-1, 50))
    y = torch.randn(2, 3, 4, 10)[:, :, :-1]  # three leading dims that cannot collapse to two
    assert torch.equal(lp_module._as_rows(y).reshape(-1, 10), y.reshape(-1, 10))


# ---------------------------------------------------------------- hostile input: every backend agrees with the math


def _math(logits, labels, g_logp, g_ent, temperature=1.0, ignore_index=IGNORE):
    """``(logp, entropy, dlogits)`` in float64 from DESIGN.md's formulas, written out here rather than through
    any implementation: ``p = softmax(z/T)`` (exactly 0 where ``z = -inf``), ``H = -Σ_{p_j>0} p_j log p_j``,
    ``d logp_y/dz_j = (δ_jy - p_j)/T``, ``dH/dz_j = -p_j (log p_j + H)/T``; ignored rows give 0."""
    z = logits.double() / temperature  # [N, V]
    logp_all = z - torch.logsumexp(z, -1, keepdim=True)  # [N, V], -inf where z = -inf
    p = logp_all.exp()  # [N, V]
    pos = p > 0  # [N, V]
    H = -torch.where(pos, p * torch.where(pos, logp_all, 0.0), 0.0).sum(-1)  # [N]
    valid = labels != ignore_index  # [N]
    safe = torch.where(valid, labels, 0).long()  # [N]
    logp = logp_all.gather(-1, safe[:, None]).squeeze(-1)  # [N]
    onehot = torch.nn.functional.one_hot(safe, z.shape[-1]).double()  # [N, V]
    d_ent = torch.where(pos, p * (torch.where(pos, logp_all, 0.0) + H[:, None]), 0.0)  # [N, V]
    grad = (g_logp.double()[:, None] * (onehot - p) - g_ent.double()[:, None] * d_ent) / temperature  # [N, V]
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, logp, zero), torch.where(valid, H, zero), torch.where(valid[:, None], grad, zero)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits_with_large_entropy_gradient(device, backend, dtype):
    """-inf logits are tokens of probability 0, also the label's own logit, and also with entropy upstream
    gradients above 1 (the reference's clamp to finfo.min made the 0·(-inf) guard overflow there): finite
    gradients equal to the math; a -inf label logit gives log p = -inf and gradient g_logp/T at that entry."""
    V, T = 600, 0.8
    logits, _, g_logp, _ = _make_inputs(V, (5,), dtype, "contiguous", seed=20)
    logits[0, [5, 17, 300]] = float("-inf")  # row 0: its label (5) among them
    logits[1, :250] = float("-inf")  # row 1: a masked vocabulary, label outside it
    logits[3, 400:] = float("-inf")  # row 3: ignored, masked too
    labels = torch.tensor([5, 260, 9, IGNORE, 599])
    logits[4, 599] = float("-inf")  # row 4: label logit -inf at the last (partial-block) column
    g_ent = torch.tensor([3.0, -2.5, 1.5, 2.0, -4.0])
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=T)
    t_logp, t_ent, t_grad = _math(logits, labels, g_logp, g_ent, temperature=T)
    assert logp[0].item() == float("-inf") and logp[4].item() == float("-inf")
    finite = torch.tensor([1, 2, 3])
    assert_close_to_truth(logp[finite], t_logp[finite], dtype, name=f"{backend} logp")
    assert_close_to_truth(ent, t_ent, dtype, name=f"{backend} entropy")
    assert torch.isfinite(grad).all(), f"{backend}: non-finite dlogits at {(~torch.isfinite(grad)).nonzero().tolist()}"
    assert_close_to_truth(grad, t_grad, dtype, name=f"{backend} dlogits")
    assert grad[0, 5].item() == pytest.approx(g_logp[0].item() / T, rel=REL_TOL[dtype])
    assert torch.equal(grad[1, :250], torch.zeros(250, dtype=dtype)) and torch.equal(grad[3], torch.zeros(V, dtype=dtype))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_smallest_temperatures_give_finite_log_probabilities(device, backend):
    """A temperature just above the smallest one refused (1/T finite in float32) but below log2(e)/FLT_MAX: the
    torch path scaled x - max by log2(e)/T, which is inf in float32, so the max's exponent was 0·inf and every
    row NaN. log p is (x_y - max)/T (finite here), the entropy 0 where one logit leads, log V on an all-equal row."""
    logits = torch.tensor([[0.5, 0.1, -0.2, 0.3], [1.0, 1.0, 1.0, 1.0]])  # [2, 4]
    labels = torch.tensor([1, 2])
    for temperature in (3e-39, 4e-39):
        truth, t_ent = reference.logprobs(logits.double(), labels, temperature=temperature, return_entropy=True)
        with forced_backend(backend):
            logp, ent = rlkernels.logprobs(*on_device(device, logits, labels), temperature=temperature,
                                           return_entropy=True)
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all(), (temperature, logp, ent)
        assert_close_to_truth(logp.cpu(), truth, torch.float32, name=f"{backend} logp T={temperature}")
        assert_close_to_truth(ent.cpu(), t_ent, torch.float32, name=f"{backend} entropy T={temperature}")

@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_tiny_temperature_entropy_gradient_is_zero_where_p_is_zero(device, backend):
    """At T = 1e-36 every token below the row's max has p = 0 (exponents of -1e35), so its gradient is exactly 0:
    the kernels formed 2^u (a + b·u) with u clamped to -1e4 and b = -g_H ln2 / (T s) ~ 1e36, where b·u overflows
    float32 and 0·inf made those entries NaN."""
    logits = torch.tensor([[0.5, 0.1, -0.2, 0.3], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.1, 0.2]])  # [3, 4]
    labels = torch.tensor([1, 2, 0])
    g_logp, g_ent = torch.tensor([0.5, -1.0, 0.25]), torch.tensor([1.5, -2.0, 1.0])
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=1e-36)
    # (the float64 reference: _math's logsumexp of z = 1e36 loses log V to rounding)
    _, _, t_grad = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=1e-36)
    assert torch.isfinite(grad).all(), f"{backend}: non-finite dlogits at {(~torch.isfinite(grad)).nonzero().tolist()}"
    assert torch.equal(grad[0, [2, 3]], torch.zeros(2)) and torch.equal(grad[2, 2:], torch.zeros(2))
    assert_close_to_truth(grad, t_grad, torch.float32, name=f"{backend} dlogits")

@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])  # powers of two: eager's x/T is exact, so eager's error is its own
@pytest.mark.parametrize("offset,spread", [(1000.0, 2.0), (1.0e4, 2.0), (-1.0e4, 2.0), (1.1e7, 10.0), (1.0e8, 100.0), (-1.0e20, 1.0e14)])
def test_large_logit_offset_is_as_precise_as_eager(device, backend, temperature, offset, spread):
    """Logits far from 0 (offset + N(0, spread), float32): probabilities formed from the row maximum and shifted
    sum keep the relative precision of z - max, as eager's log_softmax does, at any magnitude. One float32
    log-sum-exp loses ulp(|lse|) (6e-5 at 1000) in every log p: 100x eager's error in dlogits, all of it
    at 1e8; a fused x·log2e/T - max·log2e leaves its rounding residual (up to ulp(max·log2e/T)) in every
    exponent, which 2^u cannot absorb past ~1e9."""
    V = 1000
    gen = torch.Generator().manual_seed(len(str(offset)) + int(10 * temperature))
    logits = (offset + spread * torch.randn(4, V, generator=gen, dtype=torch.float64)).float()  # [4, V]
    labels = torch.randint(0, V, (4,), generator=gen)
    g_logp = torch.randn(4, generator=gen, dtype=torch.float64).float()
    g_ent = torch.randn(4, generator=gen, dtype=torch.float64).float()
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=temperature)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=temperature)
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert_close_to_truth(o, t, torch.float32, eager=e, name=f"{backend} {name}")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 3.0e4), (torch.float16, 1.0e3)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_log_probs_are_as_exact_as_eager_per_token(device, backend, dtype, scale, temperature):
    """16-bit logits of large spread at a power-of-two temperature: eager's ``z/T - max`` is exact, so its log p
    is the truth rounded once. Every token's log p must be within eager's error (x1.5) plus the output's own
    rounding, 2^-24·|truth| (a norm over the batch would hide one token's error, and a relative tolerance a
    confident row's 1e-8 where the truth is ~1e-80: the torch backend's fused x·log2e/T - max·log2e once left
    its rounding residual there, and 1 ulp of |x·log2e/T| in the other rows). Where eager's log p or entropy
    is exactly 0 (a label that is the max by far more than the float32 range of e^x), so is ours."""
    V = 1000
    gen = torch.Generator().manual_seed(7)
    logits = (scale * torch.randn(6, V, generator=gen, dtype=torch.float64)).to(dtype)  # [6, V]
    labels = torch.randint(0, V, (6,), generator=gen)
    labels[:3] = logits[:3].float().argmax(-1)  # confident rows: the label is the max
    g_logp = torch.randn(6, generator=gen, dtype=torch.float64).float()
    g_ent = torch.randn(6, generator=gen, dtype=torch.float64).float()
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=temperature)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=temperature)
    err, eager_err = (out[0].double() - truth[0]).abs(), (eager[0].double() - truth[0]).abs()  # [6]
    bound = EAGER_SLACK * eager_err + 2.0**-24 * truth[0].abs()  # [6]
    assert bool((err <= bound).all()), f"{backend} logp: errors {err.tolist()} against eager's {eager_err.tolist()}"
    for name, o, e in zip(("logp", "entropy"), out, eager):
        exact = e == 0  # [6]
        assert bool(exact[:3].any()), "the case lost its point: no confident row where eager is exactly 0"
        assert torch.equal(o[exact], e[exact]), f"{backend} {name}: {o[exact].tolist()} where eager's is 0"


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("ignored_value", [float("nan"), 1.0e30])
def test_ignored_rows_do_not_change_how_their_neighbours_are_computed(device, backend, ignored_value):
    """An ignored row holding NaN or huge logits shares a chunk with rows of large logits (~1.1e7, where an
    exponent formed with any rounding before the max is subtracted is off by up to 1/2): the forward and the
    backward must still form the same exponents for the other rows (the torch backend's forward once chose its
    path from the ignored row's own max, the backward from its saved 0), so their gradients stay exact."""
    V = 1000
    gen = torch.Generator().manual_seed(30)
    logits = (1.1e7 + 10.0 * torch.randn(4, V, generator=gen, dtype=torch.float64)).float()  # [4, V]
    logits[1] = ignored_value
    labels = torch.tensor([5, IGNORE, 17, 999])
    g_logp, g_ent = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent)
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert_close_to_truth(o, t, torch.float32, eager=e, name=f"{backend} {name}")
    assert torch.equal(out[2][1], torch.zeros(V))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_huge_logits_match_eager(device, backend, temperature):
    """|logits/T| near float32's maximum (bf16 ±3e38): x·log2(e) overflows float32 there, while eager
    (log_softmax(x.float()/T)) is right; every backend must be too. A row of ordinary logits shares the chunk."""
    V = 64
    gen = torch.Generator().manual_seed(23)
    base = torch.tensor([3e38, -3e38, 2.5e38, -2.5e38], dtype=torch.float64)[:, None]  # [4, 1]
    huge = base * (1 - 0.02 * torch.rand(4, V, generator=gen, dtype=torch.float64))  # [4, V] |x| <= 3e38: x/0.9 stays finite
    logits = torch.cat([huge, 3 * torch.randn(1, V, generator=gen, dtype=torch.float64)]).bfloat16()  # [5, V]
    labels = logits.float().argmax(-1)  # the largest logits: log p = -log(#ties), a finite float32 value
    labels[4] = 11
    g_logp = torch.randn(5, generator=gen, dtype=torch.float64).float()
    g_ent = torch.randn(5, generator=gen, dtype=torch.float64).float()
    assert torch.isfinite(logits.float() / temperature).all()
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=temperature)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=temperature)
    for name, o, t, e in zip(("logp", "entropy", "dlogits"), out, truth, eager):
        assert torch.isfinite(o).all(), f"{backend} {name}: {o}"
        assert_close_to_truth(o, t, torch.bfloat16, eager=e, name=f"{backend} {name}")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_confident_rows_stay_in_the_valid_range(device, backend):
    """Rows whose label holds all but ~1e-10 of the mass: log p and H are within float32 rounding of 0, and no
    backend may return an impossible log p > 0 or H < 0. Clamping the returned values must leave the gradient
    alone (an autograd clamp would zero it where it bites)."""
    N, V, T = 64, 1000, 0.7
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=gen) * 3  # [N, V]
    logits[:, 0] = 20 + 40 * torch.rand(N, generator=gen)
    labels = torch.zeros(N, dtype=torch.long)
    g_logp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=T)
    assert logp.max().item() <= 0.0, f"{backend}: log p = {logp.max().item():.3e} > 0"
    assert ent.min().item() >= 0.0, f"{backend}: H = {ent.min().item():.3e} < 0"
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=T)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=T)
    # log p = -log s and H ≈ log s - Σ p (z - max) come from the shifted sum s = 1 + (1 - p_y)/p_y, a float32
    # sum of V terms one of which is 1: a pairwise (or lane-wise) sum rounds the partial sum holding the 1 at
    # most ceil(log2 V) times, by <= eps/2 each, and log s ≈ s - 1 passes that on: tol = ceil(log2 V)·eps/2.
    tol = math.ceil(math.log2(V)) * torch.finfo(torch.float32).eps / 2
    assert (logp.double() - truth[0]).abs().max().item() <= tol
    assert (ent.double() - truth[1]).abs().max().item() <= tol
    # the label's entry [g_logp (1 - p_y) - g_H p_y (log p_y + H)]/T has 1 - p_y < eps, below that rounding:
    # 1 - p_y = -expm1(log p_y) carries log p's error (tol), log p_y + H twice that: <= 2 tol (|g_logp| + |g_H|)/T
    assert ((grad[:, 0].double() - truth[2][:, 0]).abs() <= 2 * tol * (g_logp.abs() + g_ent.abs()) / T).all()
    # every other entry -p_j (g_logp + g_H (log p_j + H))/T is well conditioned: as close as eager's
    assert_close_to_truth(grad[:, 1:], truth[2][:, 1:], torch.float32, eager=eager[2][:, 1:], name=f"{backend} dlogits")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_logits_give_nan_gradients(device, backend, dtype):
    """NaN in a row's logits makes that row's outputs and its whole gradient NaN in every dtype (a compiled
    16-bit store must not turn NaN into 0), and touches no other row."""
    logits, labels, g_logp, g_ent = _make_inputs(700, (4,), dtype, "contiguous", seed=24)
    labels = torch.tensor([3, 5, IGNORE, 699])
    logits[1, 650] = float("nan")
    logits[2, 10] = float("nan")  # an ignored row: no trace anywhere
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert torch.isnan(grad[1]).all(), f"{backend}: {int((~torch.isnan(grad[1])).sum())} non-NaN gradients in the NaN row"
    others = torch.tensor([0, 2, 3])
    assert torch.isfinite(logp[others]).all() and torch.isfinite(ent[others]).all() and torch.isfinite(grad[others]).all()
    assert torch.equal(grad[2], torch.zeros(700, dtype=dtype))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_changes_nothing(device, backend, dtype, autocast_dtype):
    """Under torch.autocast every op computes in float32 (DESIGN.md): outputs and gradients equal those without it."""
    logits, labels, g_logp, g_ent = _make_inputs(500, (2, 3), dtype, "contiguous", seed=25)
    with forced_backend(backend):
        plain = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=0.7)
        with torch.autocast(device, dtype=autocast_dtype):
            cast = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent, temperature=0.7)
    for name, a, b in zip(("logp", "entropy", "dlogits"), plain, cast):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{backend} {name} differs under autocast"


def test_reference_linear_logprobs_ignores_autocast():
    """The reference's matmul must not drop to bf16 under autocast (it defines the float32 meaning): inside
    autocast it runs in float64 (which autocast leaves alone, in the backward too), so its float32 results are as
    close to the float64 truth as outside autocast, forward and backward with the backward inside the region."""
    gen = torch.Generator().manual_seed(26)
    hidden, weight = torch.randn(6, 32, generator=gen), torch.randn(300, 32, generator=gen)
    labels = torch.randint(0, 300, (6,), generator=gen)
    g_logp, g_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)

    def run(cast, autocast):
        h, w = cast(hidden).requires_grad_(), cast(weight).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, ent = reference.linear_logprobs(h, w, labels, return_entropy=True)
            grads = torch.autograd.grad((logp * g_logp.to(logp)).sum() + (ent * g_ent.to(ent)).sum(), (h, w))
        return (logp, ent, *grads)

    truth = run(lambda t: t.double(), False)
    plain = run(lambda t: t.clone(), False)
    for name, a, b, t in zip(("logp", "entropy", "d_hidden", "d_weight"), plain, run(lambda t: t.clone(), True), truth):
        assert b.dtype == torch.float32, name
        assert_close_to_truth(b, t, torch.float32, eager=a, name=name)


def test_reference_out_of_range_label_gives_nan_like_the_kernels():
    """Called directly (as under torch.compile, or on a GPU where nothing is checked), the reference gives NaN
    for a label outside [0, V) instead of gather's raw error, like the kernels; every other row is unchanged."""
    V = 50
    logits, _, g_logp, g_ent = _make_inputs(V, (4,), torch.float32, "contiguous", seed=27)
    labels = torch.tensor([3, V, IGNORE, -7])
    good = torch.tensor([0, 2])
    logp, ent, grad = _run(reference.logprobs, logits, labels, g_logp, g_ent)
    for out in (logp, ent):
        assert torch.isnan(out[[1, 3]]).all() and torch.isfinite(out[good]).all()
    assert torch.isnan(grad[[1, 3]]).all() and torch.isfinite(grad[good]).all()
    t_logp, t_ent, t_grad = _math(logits, torch.tensor([3, 0, IGNORE, 0]), g_logp, g_ent)
    assert_close_to_truth(logp[good], t_logp[good], torch.float32, name="logp")
    assert_close_to_truth(ent[good], t_ent[good], torch.float32, name="entropy")
    assert_close_to_truth(grad[good], t_grad[good], torch.float32, name="dlogits")
    # the kernels' own forwards (the public function reaches them only after the CPU check) give the same
    kernels = [lp_module._torch_forward] + ([lp_module._triton_forward] if "triton" in backends("cpu") else [])
    for forward in kernels:
        k_logp, k_ent, _ = forward(logits, labels, lp_module.LogprobsOptions(temperature=1.0, return_entropy=True, ignore_index=IGNORE))
        assert torch.isnan(k_logp[[1, 3]]).all() and torch.isnan(k_ent[[1, 3]]).all()
        assert_close_to_truth(k_logp[good], t_logp[good], torch.float32, name=f"{forward.__name__} logp")
        assert_close_to_truth(k_ent[good], t_ent[good], torch.float32, name=f"{forward.__name__} entropy")


def test_saved_statistics_do_not_depend_on_the_backend():
    """The forward op's outputs (log p, H and the saved row statistics: the max logit and the shifted sum
    Σ exp((x - max)/T)) have one layout and the same values in every backend that has them, ignored rows included."""
    logits, labels, _, _ = _make_inputs(1000, (2, 3), torch.bfloat16, "contiguous", seed=28)
    x = logits.double()  # [2, 3, V]
    m = x.amax(-1)  # [2, 3]
    s = ((x - m[..., None]) / 0.7).exp().sum(-1)  # [2, 3]
    valid = labels != IGNORE  # [2, 3]
    truth = torch.stack([torch.where(valid, m, 0.0), torch.where(valid, s, 1.0)], -1)  # [2, 3, 2]
    t_logp, t_ent = reference.logprobs(logits.double(), labels, temperature=0.7, return_entropy=True)
    opt = lp_module.LogprobsOptions(temperature=0.7, return_entropy=True, ignore_index=IGNORE)
    for device, backend in [(d, b) for d in devices() for b in backends(d) if b != "reference"]:  # reference: no statistics
        with forced_backend(backend):
            logp, ent, stats = (t.cpu() for t in torch.ops.rlkernels.logprobs_fwd(*on_device(device, logits, labels),
                                                                                   *option_values(opt)))
        assert stats.shape == (2, 3, 2) and stats.dtype == torch.float32, backend
        assert_close_to_truth(stats, truth, torch.float32, name=f"{backend} stats")
        assert_close_to_truth(logp, t_logp, torch.float32, name=f"{backend} logp")
        assert_close_to_truth(ent, t_ent, torch.float32, name=f"{backend} entropy")


# ---------------------------------------------------------------- one path per concern


def _kwonly(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _option_args(op) -> list[str]:
    """The op's non-tensor schema arguments, in order."""
    return [a.name for a in op.default._schema.arguments if "Tensor" not in str(a.type)]


def test_options_keep_their_names_down_to_the_kernel():
    """LogprobsOptions holds the public keyword arguments under their own names, in order; both ops take exactly
    those (as typed lists, *option_values(opt)), no backend string; the kernels receive 1/temperature and
    ignore_index."""
    fields = [f.name for f in dataclasses.fields(lp_module.LogprobsOptions)]
    assert fields == _kwonly(rlkernels.logprobs) == _kwonly(reference.logprobs)
    assert fields == _kwonly(lp_module._validate)[2:]  # after the tensors logits, labels
    assert _option_args(torch.ops.rlkernels.logprobs_fwd) == ["float_options", "int_options", "bool_options"]
    assert _option_args(torch.ops.rlkernels.logprobs_bwd) == ["float_options", "int_options", "bool_options"]
    opt = lp_module.LogprobsOptions(temperature=0.7, return_entropy=True, ignore_index=-5)
    assert options_from(lp_module.LogprobsOptions, option_values(opt)) == opt
    pytest.importorskip("triton")
    for kernel in (lp_module._logprobs_fwd_kernel, lp_module._logprobs_bwd_kernel):
        assert {"inv_temp", "ignore_index"} <= set(kernel.arg_names), kernel.arg_names


def test_backend_is_resolved_at_run_time_inside_the_op(monkeypatch):
    """Forward and backward choose their row of _FWD_IMPLS/_BWD_IMPLS through _backend.resolve at every call, also
    when compiled code calls them (RLKERNELS_BACKEND read at run time), and float64 logits, which the Triton
    kernels do not load, stay on torch."""
    pytest.importorskip("triton")
    calls = []
    for table in (lp_module._FWD_IMPLS, lp_module._BWD_IMPLS):
        for name, fn in list(table.items()):
            monkeypatch.setitem(table, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    logits, labels, g_logp, g_ent = _make_inputs(300, (2, 3), torch.float32, "contiguous", seed=31)

    def step(x):
        logp, ent = rlkernels.logprobs(x, labels, temperature=0.9, return_entropy=True)
        return (logp * g_logp).sum() + (ent * g_ent).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for backend in ("torch", "triton"):
        with forced_backend(backend):
            x = logits.clone().requires_grad_(True)
            torch.autograd.grad(compiled(x), x)
    with forced_backend("triton"):
        x = logits.double().requires_grad_(True)
        torch.autograd.grad(step(x), x)
    assert calls == ["torch"] * 2 + ["triton"] * 2 + ["torch"] * 2


def test_kernels_are_defined_at_module_level_and_short():
    """Every jitted function of softmax.py is a module-level def (not indented under ``if HAS_TRITON:``), and no
    function in the module is over 80 lines."""
    tree = ast.parse(inspect.getsource(lp_module))
    jitted = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "jit" for d in n.decorator_list)}
    assert {"_logprobs_fwd_kernel", "_logprobs_bwd_kernel", "_bf16_round_bits"} <= jitted, jitted
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80}
    assert not long, long


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", backends("cpu"))
def test_label_out_of_range_raises_on_cpu(backend):
    logits = torch.randn(4, 10)
    with forced_backend(backend):
        for bad in (10, -3):
            labels = torch.tensor([0, 1, bad, IGNORE])
            with pytest.raises(ValueError, match="labels"):
                rlkernels.logprobs(logits, labels)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32], ids=str)
def test_every_integer_label_dtype(device, backend, dtype):
    """Narrow label dtypes are valid token ids: V = 300 > 256, so a range check against V cast to the label
    dtype (300 -> 44 in uint8/int8) rejects them, and a gather on int16 labels fails without naming labels."""
    V = 300
    logits, _, g_logp, g_ent = _make_inputs(V, (4,), torch.float32, "contiguous", seed=21)
    labels = torch.tensor([100, 7, 120, 3 if dtype == torch.uint8 else IGNORE])  # uint8 cannot hold -100
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, *on_device(device, logits), labels.to(dtype), g_logp, g_ent)
        as_int64 = _run(rlkernels.logprobs, *on_device(device, logits), labels, g_logp, g_ent)
    for name, o, t, o64 in zip(("logp", "entropy", "dlogits"), out, truth, as_int64):
        assert_close_to_truth(o, t, torch.float32, name=f"{backend} {name}")
        assert torch.equal(o, o64), name


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype,bad", [(torch.uint8, 250), (torch.int8, -3), (torch.int16, 300), (torch.int32, 200)], ids=str)
def test_narrow_label_out_of_range_names_labels(backend, dtype, bad):
    logits = torch.randn(3, 200)
    labels = torch.tensor([0, bad, 5]).to(dtype)
    with forced_backend(backend), pytest.raises(ValueError, match=rf"labels must lie in \[0, 200\).*found {bad}"):
        rlkernels.logprobs(logits, labels)


def test_logits_not_a_tensor():
    with pytest.raises(TypeError, match="logits"):
        rlkernels.logprobs([[0.1, 0.2]], torch.tensor([0]))


def test_logits_integer_dtype():
    with pytest.raises(TypeError, match="logits"):
        rlkernels.logprobs(torch.ones(2, 5, dtype=torch.int64), torch.tensor([0, 1]))


def test_logits_rank_zero():
    with pytest.raises(ValueError, match="logits"):
        rlkernels.logprobs(torch.tensor(1.5), torch.tensor(0))


def test_labels_shape_mismatch():
    with pytest.raises(ValueError, match="labels"):
        rlkernels.logprobs(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_labels_not_integer():
    with pytest.raises(TypeError, match="labels"):
        rlkernels.logprobs(torch.randn(2, 5), torch.zeros(2))


def test_devices_differ():
    with pytest.raises(ValueError, match="labels"):
        rlkernels.logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_temperature_not_positive(temperature):
    with pytest.raises(ValueError, match="temperature"):
        rlkernels.logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=temperature)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    logits, labels, g_logp, g_ent = _make_inputs(300, (2, 3), torch.bfloat16, "contiguous", seed=5)

    def step(x, y):
        logp, ent = rlkernels.logprobs(x, y, temperature=0.9, return_entropy=True)
        return (logp * g_logp).sum() + (ent * g_ent).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with forced_backend(backend):
        x1 = logits.clone().requires_grad_(True)
        loss1 = compiled(x1, labels)
        (g1,) = torch.autograd.grad(loss1, x1)
        x2 = logits.clone().requires_grad_(True)
        loss2 = step(x2, labels)
        (g2,) = torch.autograd.grad(loss2, x2)
    assert torch.equal(loss1, loss2)
    assert g1.dtype == torch.bfloat16 and torch.equal(g1, g2)


# ---------------------------------------------------------------- memory (deterministic, CPU)


def test_cpu_memory_forward_is_a_fraction_of_eager():
    N, V = 4096, 32000
    logits = torch.empty(N, V).uniform_(-4, 4)  # random, never zeros; faster to draw than randn
    labels = torch.randint(0, V, (N,))

    def eager():
        logp_all = torch.log_softmax(logits.float(), -1)  # [N, V]
        return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    def fused():
        with forced_backend("torch"):
            return rlkernels.logprobs(logits, labels, return_entropy=True)

    eager_mem = _memory.measure_cpu(eager)
    ours = _memory.measure_cpu(fused)
    print(f"\nforward [N={N}, V={V}] fp32: eager peak {eager_mem.peak_bytes / 2**20:.1f} MiB, rlkernels peak {ours.peak_bytes / 2**20:.1f} MiB, largest {ours.largest_bytes / 2**20:.1f} MiB")
    assert eager_mem.peak_bytes >= N * V * 4
    assert ours.peak_bytes <= eager_mem.peak_bytes / 8
    assert ours.largest_bytes < N * V * 4


def test_cpu_memory_backward_holds_only_dlogits_and_a_chunk():
    N, V = 1024, 32000
    logits = torch.empty(N, V).uniform_(-4, 4)  # random, never zeros; faster to draw than randn
    labels = torch.randint(0, V, (N,))
    g = torch.randn(N)

    def eager():
        x = logits.clone().requires_grad_(True)  # both sides pay this copy
        logp_all = torch.log_softmax(x.float(), -1)
        logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return torch.autograd.grad([logp, ent], x, [g, g])

    def fused():
        x = logits.clone().requires_grad_(True)
        with forced_backend("torch"):
            logp, ent = rlkernels.logprobs(x, labels, return_entropy=True)
        return torch.autograd.grad([logp, ent], x, [g, g])

    eager_mem = _memory.measure_cpu(eager)
    ours = _memory.measure_cpu(fused)
    nv = N * V * 4
    print(f"\nfwd+bwd [N={N}, V={V}] fp32: eager peak {eager_mem.peak_bytes / 2**20:.1f} MiB, rlkernels peak {ours.peak_bytes / 2**20:.1f} MiB")
    # the input copy and dlogits are the only [N, V] tensors; the rest is a chunk's workspace
    assert ours.peak_bytes <= 2 * nv + (40 << 20)
    assert eager_mem.peak_bytes >= 4 * nv


# ---------------------------------------------------------------- ahead-of-time compile


def test_aot_every_config_compiles_for_sm80_and_sm90():
    from rlkernels.testing.aot import compile_config

    configs = lp_module.aot_configs()
    assert len(configs) == 2 * 3 * len(lp_module._LAUNCH_CONFIGS)
    # every config the launcher picks is in the list
    for V in (1000, 4097, 32000, 151936):
        cfg = lp_module._launch_config(V)
        assert any(c.constexprs["BLOCK_V"] == cfg.block_v and c.num_warps == cfg.num_warps for c in configs)
    print()
    for config in configs:
        for arch in (80, 90):
            report = compile_config(config, arch)
            print(f"{config.signature['logits_ptr']:>6} {report}")
            assert report.registers > 0
            assert report.spill_bytes == 0, str(report)


def _ptx(config, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=config.kernel, signature=config.signature, constexprs=config.constexprs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("dtype,cvt", [("bf16", "cvt.rn.bf16.f32"), ("fp16", "cvt.rn.f16.f32")])
def test_aot_16_bit_backward_stores_through_the_hardware_conversion(dtype, cvt):
    """The compiled backward rounds dlogits with the GPU's own conversion (NaN stays NaN). A manual
    round-to-nearest in the bits (x + 0x7FFF + lsb, then & 0xFFFF0000) turns the GPU's canonical NaN
    0x7FFFFFFF into -0.0: NaN gradients would silently become zeros. That path is for the interpreter only."""
    pytest.importorskip("triton")
    configs = [c for c in lp_module.aot_configs() if c.kernel is lp_module._logprobs_bwd_kernel and c.signature["logits_ptr"] == f"*{dtype}"]
    assert configs
    for arch in (80, 90):
        ptx = _ptx(configs[0], arch)
        assert cvt in ptx, f"sm_{arch} {dtype} backward has no {cvt}"
        assert not re.search(r"and\.b32\s[^;]*-65536;", ptx), f"sm_{arch} {dtype} backward masks float bits by hand"


def test_interpreter_bf16_rounding_is_nearest_even_and_keeps_nan():
    """Under the interpreter (whose own float32 -> bf16 cast truncates) the backward rounds in the bits:
    to nearest even like the GPU and torch, NaN of any payload (the GPU's 0x7FFFFFFF too) staying NaN."""
    pytest.importorskip("triton")
    from rlkernels._triton import jit, tl

    @jit
    def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(y_ptr + offs, lp_module._bf16_round_bits(x).to(tl.bfloat16), mask=offs < n)

    bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000,
            0x3F808001, 0x00000001, 0x80000000, 0x3F7FFFFF]  # NaN payloads, ±inf, max (rounds to inf), ties, subnormal
    gen = torch.Generator().manual_seed(29)
    x = torch.cat([torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32), torch.randn(500, generator=gen) * 1e3])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _round_kernel.launch((1,), x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)  # torch rounds to nearest even; NaN stays NaN
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(y[~torch.isnan(x)], expected[~torch.isnan(x)])


@pytest.mark.parametrize("bad, error, words", [
    (float("inf"), ValueError, "temperature"), (float("nan"), ValueError, "temperature"),
    (1e-40, ValueError, "temperature"), ("1", TypeError, "temperature"), (None, TypeError, "temperature"),
])
def test_temperature_must_be_a_finite_positive_number(bad, error, words):
    # inf gave a uniform distribution on the CPU and NaN on Triton; 1e-40 an infinite 1 / T
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    h, w = torch.randn(4, 5), torch.randn(7, 5)
    with pytest.raises(error, match=words):
        rlkernels.logprobs(logits, labels, temperature=bad)
    with pytest.raises(error, match=words):
        rlkernels.linear_logprobs(h, w, labels.view(-1)[:4], temperature=bad)
    with pytest.raises(error, match=words):
        rlkernels.logits_policy_loss(logits, labels, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), temperature=bad)


def test_integer_and_flag_options_are_not_coerced():
    # ignore_index=1.5 used to become 1 (so label 1 was ignored); return_entropy="no" was true
    logits, labels = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    for bad, error in ((1.5, TypeError), ("a", TypeError), (True, TypeError)):
        with pytest.raises(error, match="ignore_index"):
            rlkernels.logprobs(logits, labels, ignore_index=bad)
        with pytest.raises(error, match="ignore_index"):
            rlkernels.linear_logprobs(torch.randn(4, 5), torch.randn(7, 5), labels.view(-1)[:4], ignore_index=bad)
    with pytest.raises(TypeError, match="return_entropy"):
        rlkernels.logprobs(logits, labels, return_entropy="no")
    with pytest.raises(TypeError, match="shift_mean"):
        rlkernels.masked_whiten(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.bool), shift_mean="no")
    # what is accepted: NumPy and tensor integers, 0/1 and NumPy booleans
    np = pytest.importorskip("numpy", reason="NumPy scalars are tested where NumPy is installed (rlkernels itself does not need it)")
    out = rlkernels.logprobs(logits, labels, ignore_index=np.int64(-1), return_entropy=np.bool_(True))
    assert len(out) == 2
    assert rlkernels.logprobs(logits, labels, ignore_index=torch.tensor(-100), return_entropy=0).shape == (2, 3)
