"""rlkernels.logprobs (rlkernels/softmax.py) against the float64 reference, for every backend the machine runs.

Triton kernels run under the interpreter on CPU tensors, so shapes stay small.
"""
from __future__ import annotations


import pytest
import torch

import rlkernels
from rlkernels import _memory, reference
from tests.helpers import DTYPES, EAGER_SLACK, assert_close_to_truth, backends, forced_backend, noncontiguous

from rlkernels import softmax as lp_module  # noqa: E402

IGNORE = -100

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
    logp, ent = fn(x, labels, return_entropy=True, ignore_index=IGNORE, **kw)
    (grad,) = torch.autograd.grad([logp, ent], [x], [g_logp.to(logp.dtype), g_ent.to(ent.dtype)])
    return logp.detach(), ent.detach(), grad


@pytest.mark.parametrize("backend", backends("cpu"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V,shape,temperature,layout", CASES, ids=[f"V{c[0]}-{c[3]}-T{c[2]}" for c in CASES])
def test_matches_float64_reference(backend, dtype, V, shape, temperature, layout):
    logits, labels, g_logp, g_ent = _make_inputs(V, shape, dtype, layout, seed=V + len(shape))
    truth = _run(reference.logprobs, logits.double(), labels, g_logp, g_ent, temperature=temperature)
    eager = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent, temperature=temperature)
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float64_computes_in_float64(backend):
    logits, labels, g_logp, g_ent = _make_inputs(513, (5,), torch.float64, "contiguous", seed=2)
    truth = _run(reference.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    with forced_backend(backend):
        out = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    for name, o, t in zip(("logp", "entropy", "dlogits"), out, truth):
        assert o.dtype == torch.float64
        assert_close_to_truth(o, t, torch.float64, name=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("peak", [4.0, 8.0])
def test_peaked_distribution_label_gradient(backend, peak):
    """p_y close to 1 (1 - p_y ≈ 2e-4 and 5e-6): the label's gradient 1 - p_y is as precise
    as eager float32 PyTorch's (a naive 1 - exp(z_y - lse) is several times worse)."""
    V = 300
    logits = torch.full((2, V), -10.0)
    logits[:, 7] = peak
    logits += torch.linspace(0, 1e-3, V)  # never constant
    labels = torch.tensor([7, 7])
    with forced_backend(backend):
        x = logits.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(rlkernels.logprobs(x, labels).sum(), x)
    x64 = logits.double().requires_grad_(True)
    (truth,) = torch.autograd.grad(reference.logprobs(x64, labels).sum(), x64)
    x32 = logits.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(reference.logprobs(x32, labels).sum(), x32)
    rel = ((grad[:, 7].double() - truth[:, 7]) / truth[:, 7]).abs().max().item()
    eager_rel = ((eager[:, 7].double() - truth[:, 7]) / truth[:, 7]).abs().max().item()
    assert 0 < truth[0, 7].item() < 1e-3
    assert rel <= EAGER_SLACK * eager_rel, (rel, eager_rel)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_propagates_and_empty_input(backend):
    logits, labels, _, _ = _make_inputs(600, (3,), torch.float32, "contiguous", seed=3)
    labels[1] = 5
    logits[1, 100] = float("nan")
    with forced_backend(backend):
        logp, ent = rlkernels.logprobs(logits, labels, return_entropy=True)
        empty = rlkernels.logprobs(torch.randn(0, 7), torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert torch.isfinite(logp[[0, 2]]).all() and torch.isfinite(ent[[0, 2]]).all()
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_vocabulary_minus_inf(backend):
    """-inf logits (a masked vocabulary) are tokens of probability 0: finite entropy and gradient."""
    logits, labels, g_logp, _ = _make_inputs(5000, (3,), torch.float32, "contiguous", seed=4)
    logits[:, :4500] = float("-inf")  # the whole first block of the row is -inf
    labels = torch.tensor([4500, 4999, 4700])
    g_ent = torch.randn(3)
    with forced_backend(backend):
        x = logits.clone().requires_grad_(True)
        logp, ent = rlkernels.logprobs(x, labels, return_entropy=True)
        (grad,) = torch.autograd.grad([logp, ent], x, [g_logp, g_ent])
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masked_vocabulary_in_some_rows(monkeypatch, backend):
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
        out = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent)

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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("unused", ["none", "zero"])
def test_entropy_returned_but_not_differentiated(backend, unused):
    """With return_entropy=True and the entropy left out of the loss (upstream gradient None) or
    weighted by 0, the gradient is the log-prob gradient alone (the torch backend skips the H term)."""
    logits, labels, g_logp, _ = _make_inputs(1000, (2, 3), torch.float32, "contiguous", seed=12)
    x = logits.clone().requires_grad_(True)
    with forced_backend(backend):
        logp, ent = rlkernels.logprobs(x, labels, temperature=0.8, return_entropy=True, ignore_index=IGNORE)
    if unused == "none":
        (grad,) = torch.autograd.grad(logp, x, g_logp)
    else:
        (grad,) = torch.autograd.grad([logp, ent], x, [g_logp, torch.zeros_like(ent)])
    x64 = logits.double().requires_grad_(True)
    ref, ref_ent = reference.logprobs(x64, labels, temperature=0.8, return_entropy=True, ignore_index=IGNORE)
    (ref_grad,) = torch.autograd.grad(ref, x64, g_logp.double())
    assert_close_to_truth(logp, ref, torch.float32, name="logp")
    assert_close_to_truth(ent, ref_ent, torch.float32, name="entropy")
    assert_close_to_truth(grad, ref_grad, torch.float32, name="dlogits")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ignored_row_with_nan_logits_is_exactly_zero(backend):
    logits, labels, g_logp, g_ent = _make_inputs(300, (4,), torch.float32, "contiguous", seed=14)
    logits[1] = float("nan")
    labels[1] = IGNORE
    with forced_backend(backend):
        logp, ent, grad = _run(rlkernels.logprobs, logits, labels, g_logp, g_ent)
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


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", backends("cpu"))
def test_label_out_of_range_raises_on_cpu(backend):
    logits = torch.randn(4, 10)
    with forced_backend(backend):
        for bad in (10, -3):
            labels = torch.tensor([0, 1, bad, IGNORE])
            with pytest.raises(ValueError, match="labels"):
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
    from rlkernels._aot import compile_config

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
