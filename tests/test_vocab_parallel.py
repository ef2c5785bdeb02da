"""Vocabulary-parallel linear_logprobs / linear_policy_loss / logits (rlkernels.vocab_parallel) on 2 and 3 gloo
processes on the CPU: every rank holds an uneven slice of an odd vocabulary (V = 1001 = 600 + 401, and
400 + 101 + 500 with the ranks in permuted order), and the merged results equal the single-process op on the full
weight to float32 rounding, forward and backward (d_hidden summed over the ranks, d_weight / d_bias the rank's
slice); in float64 the gradients equal the float64 reference to 1e-12 (the merge is exact) and log p and H,
returned in float32, its rounding; bfloat16 stays within its
tolerance of the float64 truth. Also ignore_index rows,
temperature != 1, the verl adapter's tensor-parallel functions, and the errors.

One forked process group per world size runs every scenario (forked: the children reuse the imported modules, so a
test costs seconds, not an import of torch per rank; a forkserver, immune to a lock some thread of the test process
might hold at the fork, cost ~20 s more per session on the loaded 2-core test machine). Except with a CUDA build of
torch (torch 2.11+cu130 here, the GPU machines' torch): once the test process has run a backward, a forked child's
backward raises "Unable to handle autograd's threading in combination with fork-based multiprocessing", so the
group starts from a forkserver there. A rank that hangs turns into a failure after the gloo timeout (120 s), never
a stalled suite."""
from __future__ import annotations

import contextlib
import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rlkernels
from rlkernels import reference as ref
from rlkernels.fused_linear import LinearLogprobsOptions
from rlkernels import _backend, vocab_parallel
from rlkernels.integrations import verl as rkv
from tests.helpers import assert_close_to_truth, forced_backend, in_gloo_group

V = 1001
H = 24
# (vocab_start, rows) of each rank: uneven slices of the odd V; with 3 ranks in permuted order (rank 0 holds the
# last slice), which the op allows (slices tile [0, V) in any order)
LAYOUTS = {2: [(0, 600), (600, 401)], 3: [(501, 500), (0, 400), (400, 101)]}
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding (outputs and gradients are O(1))


def _spawn(fn, world_size: int, *args):
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` forked processes (see above) joined in one gloo group; an
    exception in any rank fails the test (with its traceback)."""
    fd, path = tempfile.mkstemp(prefix="rlkernels-gloo-")
    os.close(fd)
    os.unlink(path)  # the file store creates it
    try:
        mp.start_processes(_run, args=(world_size, fn, "file://" + path, args), nprocs=world_size,
                           start_method="fork" if torch.version.cuda is None else "forkserver")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _run(rank, world_size, fn, init, args):
    # one intra-op thread in each forked child: no OpenMP pool inherited mid-state; the machine has few cores
    in_gloo_group(rank, world_size, init, fn, rank, world_size, *args)


def _close(a, b, name):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _inputs(dtype, seed=0, B=2, T=7):
    """Random inputs, the same on every rank: logits of O(1..3); labels at the slices' edges; two ignored rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)  # [B, T, H]
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5 * 2  # [V, H]
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5  # [V]
    labels = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    edges = torch.tensor([0, 399, 400, 500, 501, 599, 600, 1000])
    labels.view(-1)[: edges.numel()] = edges
    labels[1, 3] = labels[0, 6] = -100
    # upstream gradients, float32 values: the ops' outputs are float32 (also for float64 inputs), so autograd hands
    # them the upstream rounded to float32; values that round exactly keep the float64 gradients exact
    g_logp = torch.randn(B, T, generator=g).double()  # [B, T]
    g_ent = torch.randn(B, T, generator=g).double()  # [B, T]
    return [x.to(dtype) if x.is_floating_point() else x for x in (hidden, weight, bias, labels, g_logp, g_ent)]


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _grads(fn, inputs, *upstream):
    """Outputs of ``fn(*leaves)`` and the gradients of ``Σ out·upstream`` w.r.t. each leaf."""
    leaves = [_leaf(x) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = sum((o * u).sum() for o, u in zip(outs, upstream))
    return [o.detach() for o in outs], torch.autograd.grad(total, leaves)


def _check_linear_logprobs(rank, P, dtype, backend):
    start, rows = LAYOUTS[P][rank]
    sl = slice(start, start + rows)
    hidden, weight, bias, labels, g_logp, g_ent = _inputs(dtype)
    group = dist.group.WORLD
    kw = dict(temperature=0.7, return_entropy=True)

    def vp(h, w, b):
        return rlkernels.linear_logprobs(h, w, labels, bias=b, process_group=group, vocab_start=start, **kw)

    with forced_backend(backend):
        (lp, ent), (dh, dw, db) = _grads(vp, (hidden, weight[sl], bias[sl]), g_logp, g_ent)
        (lp1, ent1), (dh1, dw1, db1) = _grads(
            lambda h, w, b: rlkernels.linear_logprobs(h, w, labels, bias=b, **kw), (hidden, weight, bias), g_logp,
            g_ent)
    with forced_backend("reference"):  # the float64 truth
        (lp64, ent64), (dh64, dw64, db64) = _grads(
            lambda h, w, b: ref.linear_logprobs(h, w, labels, bias=b, **kw),
            (hidden.double(), weight.double(), bias.double()), g_logp.double(), g_ent.double())
    got = dict(logp=lp, entropy=ent, d_hidden=dh, d_weight=dw, d_bias=db)
    single = dict(logp=lp1, entropy=ent1, d_hidden=dh1, d_weight=dw1[sl], d_bias=db1[sl])
    truth = dict(logp=lp64, entropy=ent64, d_hidden=dh64, d_weight=dw64[sl], d_bias=db64[sl])
    for name, value in got.items():
        if dtype == torch.float64:  # the merge is exact: float64 agrees with the float64 truth to its rounding
            if value.dtype == torch.float32:  # log p and H come back in float32: the truth rounded once (1 ulp)
                torch.testing.assert_close(value.double(), truth[name], rtol=2.0**-23, atol=1e-30,
                                           msg=lambda m: f"{name}: {m}")
            else:
                torch.testing.assert_close(value, truth[name], rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
        elif dtype == torch.bfloat16:  # 16-bit gradients: the dtype's tolerance against the float64 truth
            assert_close_to_truth(value, truth[name], dtype, name=name)
        else:
            _close(value, single[name], name)
            _close(value.double(), truth[name], name + " vs float64")
    ignored = labels == -100  # [B, T]
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all() and (dh[ignored] == 0).all()
    assert lp.dtype == ent.dtype == torch.float32  # whatever the input dtype

    if dtype != torch.float32:
        return
    # without the entropy: log p only, and its gradient alone
    (lp_only,), (dh_only, dw_only) = _grads(
        lambda h, w: rlkernels.linear_logprobs(h, w, labels, temperature=0.7, process_group=group,
                                               vocab_start=start), (hidden, weight[sl]), g_logp)
    (lp_only1,), (dh_only1, dw_only1) = _grads(
        lambda h, w: rlkernels.linear_logprobs(h, w, labels, temperature=0.7), (hidden, weight), g_logp)
    _close(lp_only, lp_only1, "logp (no entropy)")
    _close(dh_only, dh_only1, "d_hidden (no entropy)")
    _close(dw_only, dw_only1[sl], "d_weight (no entropy)")


def _policy_inputs(seed=1, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)  # [B, T, H]
    weight = torch.randn(V, H, generator=g) / H**0.5 * 2  # [V, H]
    bias = torch.randn(V, generator=g) * 0.5  # [V]
    labels = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    labels[0, 0], labels[1, 4], labels[2, 2] = 0, 1000, 600
    labels[2, 4] = -100
    mask = torch.rand(B, T, generator=g) > 0.2  # [B, T]
    mask[2, 4] = False
    # old log-probs near the current ones (ratios on both sides of the clip range)
    with torch.no_grad():
        lp = rlkernels.linear_logprobs(hidden, weight, labels, bias=bias)
    old = lp + torch.randn(B, T, generator=g) * 0.3  # [B, T]
    ref_lp = lp + torch.randn(B, T, generator=g) * 0.2  # [B, T]
    adv = torch.randn(B, T, generator=g)  # [B, T]
    return hidden, weight, bias, labels, old, adv, mask, ref_lp


def _check_policy_loss(rank, P):
    start, rows = LAYOUTS[P][rank]
    sl = slice(start, start + rows)
    hidden, weight, bias, labels, old, adv, mask, ref_lp = _policy_inputs()
    group = dist.group.WORLD
    cases = [dict(entropy_coef=0.01, ref_logp=ref_lp, kl_coef=0.1, agg="seq-mean-token-mean", temperature=0.8,
                  dual_clip=3.0),
             dict(ratio="sequence", agg="token-mean", clip_low=0.1),
             dict(old_logp=None, agg="seq-mean-token-sum", entropy_coef=0.01)]  # on-policy: old = own logp
    for kw in cases:
        kw = dict(kw)
        old_c = kw.pop("old_logp", old)  # [B, T] or None
        h, w, b = _leaf(hidden), _leaf(weight[sl]), _leaf(bias[sl])
        loss, metrics = rlkernels.linear_policy_loss(h, w, labels, old_c, adv, mask, bias=b, process_group=group,
                                                     vocab_start=start, **kw)
        loss.backward()
        h1, w1, b1 = _leaf(hidden), _leaf(weight), _leaf(bias)
        with forced_backend("torch"):
            loss1, metrics1 = rlkernels.linear_policy_loss(h1, w1, labels, old_c, adv, mask, bias=b1, **kw)
        loss1.backward()
        _close(loss.detach(), loss1.detach(), f"loss {kw}")
        assert metrics.keys() == metrics1.keys(), (sorted(metrics), sorted(metrics1))
        for key in metrics:
            _close(metrics[key], metrics1[key], f"metric {key} {kw}")
        _close(h.grad, h1.grad, f"d_hidden {kw}")
        _close(w.grad, w1.grad[sl], f"d_weight {kw}")
        _close(b.grad, b1.grad[sl], f"d_bias {kw}")
    # NaN hidden states at the masked-out tokens (padding after a fully masked attention row) reach no gradient
    dirty = hidden.clone()
    dirty[~mask] = float("nan")
    h, w = _leaf(dirty), _leaf(weight[sl])
    loss, _ = rlkernels.linear_policy_loss(h, w, labels, old, adv, mask, process_group=group, vocab_start=start)
    loss.backward()
    h1, w1 = _leaf(hidden), _leaf(weight)
    with forced_backend("torch"):
        loss1, _ = rlkernels.linear_policy_loss(h1, w1, labels, old, adv, mask)  # the clean rows
    loss1.backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()
    _close(loss.detach(), loss1.detach(), "loss, NaN at masked-out rows")
    _close(w.grad, w1.grad[sl], "d_weight, NaN at masked-out rows")
    _close(h.grad[mask], h1.grad[mask], "d_hidden, NaN at masked-out rows")
    # a double backward is refused in the name of the op called, not of the policy_loss it is made of
    h, w = _leaf(hidden), _leaf(weight[sl])
    loss, _ = rlkernels.linear_policy_loss(h, w, labels, old, adv, mask, process_group=group, vocab_start=start)
    with pytest.raises(RuntimeError, match=r"rlkernels\.linear_policy_loss does not support double backward"):
        torch.autograd.grad(loss, (h, w), create_graph=True)


def _check_verl(rank, P):
    """The verl adapter's tensor-parallel functions, in Megatron's layout (equal slices in rank order)."""
    group = dist.group.WORLD
    hidden, weight, _bias, labels, g_logp, g_ent = _inputs(torch.float32, seed=3)
    Ve = 333 * P  # divisible by P, as Megatron pads its vocabulary
    # every label counted: verl's entropy has no labels (every row), rlkernels.logprobs gives 0 at ignored rows
    weight, labels = weight[:Ve], labels.clamp(min=0) % Ve
    rows = Ve // P
    sl = slice(rank * rows, (rank + 1) * rows)
    logits = hidden @ weight.T  # [B, T, Ve]
    # from this rank's logits: log p, entropy and the gradient of both w.r.t. the logits' slice
    (lp, ent), (dz,) = _grads(
        lambda z: (rkv.vocab_parallel_log_probs_from_logits(z, labels, process_group=group),
                   rkv.vocab_parallel_entropy(z, process_group=group)), (logits[..., sl],), g_logp, g_ent)
    (lp1, ent1), (dz1,) = _grads(lambda z: rlkernels.logprobs(z, labels, return_entropy=True), (logits,), g_logp,
                                 g_ent)
    _close(lp, lp1, "verl logits: logp")
    _close(ent, ent1, "verl logits: entropy")
    _close(dz, dz1[..., sl], "verl logits: d_logits")
    # from hidden and this rank's weight slice
    (lp, ent), (dh, dw) = _grads(
        lambda h, w: rkv.linear_cross_entropy(h, w, labels, 0.9, "none", group), (hidden, weight[sl]), g_logp, g_ent)
    (lp1, ent1), (dh1, dw1) = _grads(
        lambda h, w: rlkernels.linear_logprobs(h, w, labels, temperature=0.9, return_entropy=True),
        (hidden, weight), g_logp, g_ent)
    for name, a, b in (("logp", lp, lp1), ("entropy", ent, ent1), ("d_hidden", dh, dh1), ("d_weight", dw, dw1[sl])):
        _close(a, b, "verl linear_cross_entropy: " + name)


def _check_errors(rank, P):
    """Refused after the collective, on every rank alike: slices that overlap, a label no slice holds."""
    start, rows = LAYOUTS[P][rank]
    hidden, weight, _bias, labels, _g, _e = _inputs(torch.float32)
    group = dist.group.WORLD
    with pytest.raises(ValueError, match="vocab_start"):  # every rank claims to start at 0
        rlkernels.linear_logprobs(hidden, weight[start:start + rows], labels, process_group=group, vocab_start=0)
    bad = labels.clone()
    bad[0, 1] = V  # one past the global vocabulary
    with pytest.raises(ValueError, match="labels"):
        rlkernels.linear_logprobs(hidden, weight[start:start + rows], bad, process_group=group, vocab_start=start)


def _check_all_ignored(rank, P):
    """Every token ignored: zeros and zero gradients, the collectives still matched on every rank."""
    start, rows = LAYOUTS[P][rank]
    hidden, weight, _bias, labels, g_logp, g_ent = _inputs(torch.float32)
    (lp, ent), (dh, dw) = _grads(
        lambda h, w: rlkernels.linear_logprobs(h, w, torch.full_like(labels, -100), return_entropy=True,
                                               process_group=dist.group.WORLD, vocab_start=start),
        (hidden, weight[start:start + rows]), g_logp, g_ent)
    for name, x in (("logp", lp), ("entropy", ent), ("d_hidden", dh), ("d_weight", dw)):
        assert (x == 0).all(), name


def _check_cublas(rank, P):
    """RLKERNELS_LINEAR_FWD=cublas, bf16, the Triton backend: each slice's partials from cuBLAS logits and the
    softmax kernel (fused_linear._partials_cublas), the backward recomputing them the same way: forward and
    gradients against the float64 truth."""
    from rlkernels import fused_linear

    with mock.patch.dict(os.environ, {fused_linear.FWD_KERNEL_ENV: "cublas"}):
        _check_linear_logprobs(rank, P, torch.bfloat16, "triton")


def _all_checks(rank, P, backends):
    for backend in backends:
        _check_linear_logprobs(rank, P, torch.float32, backend)
    if "triton" in backends:
        _check_cublas(rank, P)
    _check_linear_logprobs(rank, P, torch.float64, "torch")
    _check_linear_logprobs(rank, P, torch.bfloat16, "torch")  # 16-bit: d_hidden's all-reduce in bfloat16
    _check_policy_loss(rank, P)
    _check_verl(rank, P)
    _check_errors(rank, P)
    _check_all_ignored(rank, P)


def _backends(P):
    out = ["torch"]
    # the Triton kernels under the interpreter on 2 ranks (slow on a CPU: one world size is enough)
    if P == 2 and _backend.has_triton():
        out.append("triton")
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_equals_single_process(world_size):
    """linear_logprobs (forward, backward, with and without the entropy, float32 per backend, float64, bfloat16),
    linear_policy_loss (loss, metrics, gradients; token and sequence ratio) and the verl adapter on
    ``world_size`` gloo ranks equal the single-process ops (and the float64 truth)."""
    _spawn(_all_checks, world_size, _backends(world_size))


def test_arguments_are_refused_by_name():
    """vocab_start and process_group go together; the logits path needs a group."""
    hidden, weight, _bias, labels, _g, _e = _inputs(torch.float32)
    with pytest.raises(ValueError, match="vocab_start is given without process_group"):
        rlkernels.linear_logprobs(hidden, weight, labels, vocab_start=0)
    with pytest.raises(ValueError, match="process_group is given without vocab_start"):
        rlkernels.linear_logprobs(hidden, weight, labels, process_group=object())
    with pytest.raises(ValueError, match="vocab_start must be an int >= 0"):
        rlkernels.linear_logprobs(hidden, weight, labels, process_group=object(), vocab_start=-3)
    for not_a_group in ("world", 0, object()):  # a backend name, a rank: not a ProcessGroup
        with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
            rlkernels.linear_logprobs(hidden, weight, labels, process_group=not_a_group, vocab_start=0)
        with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
            rlkernels.linear_policy_loss(hidden.view(2, 7, -1), weight, labels.view(2, 7), torch.zeros(2, 7),
                                         torch.zeros(2, 7), torch.ones(2, 7), process_group=not_a_group,
                                         vocab_start=0)
    with pytest.raises(ValueError, match="vocab_start is given without process_group"):
        rlkernels.linear_policy_loss(hidden, weight, labels, torch.zeros(2, 7), torch.zeros(2, 7),
                                     torch.ones(2, 7), vocab_start=5)
    with pytest.raises(ValueError, match="process_group is required"):
        vocab_parallel.logprobs_from_logits(hidden @ weight.T, labels, process_group=None, vocab_start=0)
    with pytest.raises(ValueError, match="reduction must be 'none'"):
        rkv.linear_cross_entropy(hidden, weight, labels, 1.0, "mean")


def test_a_label_no_rank_owns_gives_nan_log_p():
    """What a GPU gives (no device sync, so no raise) for a label that no rank, or two ranks, own: NaN log p; the
    entropy is still the merged one. The merged partials here are one row's, hand-made: z = (0, log 3) over 2 ranks
    gives m = log 3, s = 1 + 1/3, and log p of the label (z_y = 0) = -log 4."""
    m, s = torch.log(torch.tensor(3.0)), torch.tensor(4.0 / 3.0)
    u = -torch.log(torch.tensor(3.0)) / 3  # Σ e^(z - m)(z - m)
    merged = torch.stack([torch.stack([m, s, u, torch.tensor(0.0)])] * 2, 1)  # [4, 2]: the same row twice
    opt = LinearLogprobsOptions(1.0, True, -100)
    logp, entropy, _ = vocab_parallel._outputs(merged, torch.tensor([True, False]), opt)
    torch.testing.assert_close(logp[0], -torch.log(torch.tensor(4.0)))
    assert torch.isnan(logp[1])
    p = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(entropy, -(p * p.log()).sum().expand(2))


def _check_integer_vocab_start(rank, P):
    """vocab_start as a NumPy or one-element tensor integer (e.g. computed from a NumPy split) means its value."""
    import numpy as np

    start, rows = LAYOUTS[P][rank]
    hidden, weight, _bias, labels, _g, _e = _inputs(torch.float32)
    want = rlkernels.linear_logprobs(hidden, weight, labels)  # [B, T] the single-process op on the full weight
    for as_given in (np.int64(start), torch.tensor(start)):
        got = rlkernels.linear_logprobs(hidden, weight[start:start + rows], labels, process_group=dist.group.WORLD,
                                        vocab_start=as_given)
        _close(got, want, f"logp with vocab_start {type(as_given).__name__}")
    with pytest.raises(TypeError, match="vocab_start"):  # a float is refused, not truncated
        rlkernels.linear_logprobs(hidden, weight[start:start + rows], labels, process_group=dist.group.WORLD,
                                  vocab_start=float(start))


def test_vocab_start_may_be_a_numpy_or_tensor_integer():
    # np.int64(600) was refused with "vocab_start must be an int >= 0, got np.int64(600)"
    _spawn(_check_integer_vocab_start, 2)


def _check_labels_on_another_device(rank, P):
    """logprobs_from_logits with labels on another device than the logits (meta stands in for a GPU)."""
    start, rows = LAYOUTS[P][rank]
    hidden, weight, _bias, labels, _g, _e = _inputs(torch.float32)
    logits = hidden @ weight[start:start + rows].T  # [B, T, V_r]
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel.logprobs_from_logits(logits, labels.to("meta"), process_group=dist.group.WORLD,
                                            vocab_start=start)


def test_logits_path_refuses_labels_on_another_device_by_name():
    # labels on another device than the logits failed inside torch ("Tensor.item() cannot be called on meta
    # tensors"), naming no argument; linear_logprobs' process_group path already named them
    _spawn(_check_labels_on_another_device, 2)
