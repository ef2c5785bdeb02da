"""kl_penalty, policy_loss and value_loss against the float64 reference, forward and backward, every backend."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import rlkernels
from rlkernels import losses
from rlkernels import reference as ref
from rlkernels._host import option_values, options_from
from tests.helpers import DTYPES, assert_close_to_truth, backends, devices, forced_backend, noncontiguous, on_device

BACKENDS = backends("cpu")
DEVICE_BACKENDS = [(d, b) for d in devices() for b in backends(d)]  # the float64 comparisons run on every device
SHAPES = [(5, 37), (3, 1100)]  # odd sizes; T = 1100 spans two blocks of the Triton kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mask(B: int, T: int, g: torch.Generator, kind: str = "bool") -> torch.Tensor:
    """Random mask [B, T] with one empty row (when B > 1) and one full row."""
    m = torch.rand(B, T, generator=g) > 0.25  # [B, T]
    if B > 1:
        m[1] = False
    m[0] = True
    return m if kind == "bool" else m.float()


def _policy_inputs(B, T, dtype, *, seed=0, adv_per_seq=False, with_ref=True, with_ent=True, mask_kind="bool"):
    """Fresh random policy-loss inputs; log-ratios ~ N(0, 0.3) per token plus a per-row shift so that both
    token and sequence ratios get clipped."""
    g = _gen(seed)
    logp = -torch.rand(B, T, generator=g) * 3 - 0.05  # [B, T]
    shift = 0.5 * torch.randn(B, 1, generator=g)  # [B, 1]
    old = logp + 0.3 * torch.randn(B, T, generator=g) + shift  # [B, T]
    adv = torch.randn(B, generator=g) if adv_per_seq else torch.randn(B, T, generator=g)  # [B] or [B, T]
    inputs = {
        "logp": logp.to(dtype),
        "old_logp": old.to(dtype),
        "advantages": adv.to(dtype),
        "mask": _mask(B, T, g, mask_kind),
        "ref_logp": (logp + 0.2 * torch.randn(B, T, generator=g)).to(dtype) if with_ref else None,
        "entropy": (torch.rand(B, T, generator=g) * 2).to(dtype) if with_ent else None,
    }
    return inputs


GRAD_NAMES = ("logp", "ref_logp", "entropy")

# Scalars (loss, metrics) are float32 sums over the exact input values whatever the input dtype, so
# they are held to float32-level accuracy; their relative error against eager's is rounding noise
# amplified by cancellation, so the eager comparison is made on the per-token gradients only.
SCALAR_RTOL, SCALAR_ATOL = 1e-4, 1e-6


def assert_scalar_close(out, truth, name):
    torch.testing.assert_close(out.double(), truth.double(), rtol=SCALAR_RTOL, atol=SCALAR_ATOL, msg=lambda m: f"{name}: {m}")


def _run_policy(fn, inputs, cast, upstream, **options):
    """Loss, metrics and gradients (w.r.t. logp/ref_logp/entropy) of ``fn`` on ``inputs`` cast by ``cast``."""
    leaves = {k: (None if v is None else cast(v)) for k, v in inputs.items()}
    for k in GRAD_NAMES:
        if leaves[k] is not None:
            leaves[k] = leaves[k].detach().requires_grad_()
    loss, metrics = fn(leaves["logp"], leaves["old_logp"], leaves["advantages"], leaves["mask"],
                       ref_logp=leaves["ref_logp"], entropy=leaves["entropy"], **options)
    wrt = [leaves[k] for k in GRAD_NAMES if leaves[k] is not None]
    grads = torch.autograd.grad(loss * upstream, wrt)
    return loss, metrics, dict(zip([k for k in GRAD_NAMES if leaves[k] is not None], grads))


def check_policy(backend, dtype, inputs, *, check_clipping=True, device="cpu", **options):
    """rlkernels.policy_loss on ``device`` against the float64 truth and eager (both on the CPU)."""
    upstream = torch.randn((), generator=_gen(123)).item() + 2.0  # random upstream gradient of the loss
    truth_loss, truth_metrics, truth_grads = _run_policy(ref.policy_loss, inputs, lambda t: t.double(), upstream, **options)
    eager_loss, eager_metrics, eager_grads = _run_policy(ref.policy_loss, inputs, lambda t: t, upstream, **options)
    with forced_backend(backend):
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, inputs, lambda t: on_device(device, t)[0], upstream, **options)
    loss, metrics, grads = loss.cpu(), {k: v.cpu() for k, v in metrics.items()}, {k: g.cpu() for k, g in grads.items()}
    if check_clipping:
        assert truth_metrics["clipfrac"] > 0, "test inputs must make clipping happen"
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_scalar_close(loss, truth_loss, "loss")
    assert set(metrics) == set(truth_metrics)
    for k, v in metrics.items():
        assert v.dim() == 0 and not v.requires_grad and v.dtype == torch.float32, k
        assert_scalar_close(v, truth_metrics[k], f"metric {k}")
    assert set(grads) == set(truth_grads)
    for k, gr in grads.items():
        assert gr.dtype == dtype, f"grad {k} dtype {gr.dtype}"
        assert_close_to_truth(gr, truth_grads[k], dtype, eager=eager_grads[k], name=f"grad {k}")
    return truth_loss


# ---------------------------------------------------------------- policy_loss


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("adv_per_seq", [False, True], ids=["adv[B,T]", "adv[B]"])
def test_policy_dtypes_shapes_advantages(device, backend, dtype, shape, adv_per_seq):
    inputs = _policy_inputs(*shape, dtype, seed=1, adv_per_seq=adv_per_seq)
    check_policy(backend, dtype, inputs, kl_coef=0.1, entropy_coef=0.01, device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize(
    "agg,norm_length",
    [("token-mean", None), ("seq-mean-token-mean", None), ("seq-mean-token-sum", None),
     ("seq-mean-token-sum-norm", None), ("seq-mean-token-sum-norm", 512)],
)
def test_policy_agg_modes(device, backend, ratio, agg, norm_length):
    inputs = _policy_inputs(7, 37, torch.float32, seed=2, mask_kind="float")
    check_policy(backend, torch.float32, inputs, ratio=ratio, agg=agg, norm_length=norm_length, kl_coef=0.05,
                 entropy_coef=0.02, device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_policy_kl_estimators(device, backend, estimator, ratio):
    inputs = _policy_inputs(5, 37, torch.float32, seed=3, with_ent=False)
    check_policy(backend, torch.float32, inputs, ratio=ratio, kl_coef=0.3, kl_estimator=estimator, device=device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_policy_asymmetric_and_dual_clip(device, backend, ratio):
    inputs = _policy_inputs(9, 37, torch.float32, seed=4, with_ref=False, with_ent=False)
    options = dict(ratio=ratio, clip_low=0.2, clip_high=0.28, dual_clip=1.3)
    with_dual = check_policy(backend, torch.float32, inputs, device=device, **options)
    # the dual clip and the asymmetric range must both change the loss on these inputs
    no_dual, _ = ref.policy_loss(*(inputs[k].double() for k in ("logp", "old_logp", "advantages")), inputs["mask"],
                                 ratio=ratio, clip_low=0.2, clip_high=0.28)
    symmetric, _ = ref.policy_loss(*(inputs[k].double() for k in ("logp", "old_logp", "advantages")), inputs["mask"],
                                   ratio=ratio, clip_low=0.2, dual_clip=1.3)
    assert not torch.isclose(with_dual, no_dual) and not torch.isclose(with_dual, symmetric)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_policy_entropy_only_noncontiguous(device, backend):
    inputs = _policy_inputs(5, 37, torch.bfloat16, seed=5, with_ref=False)
    for k in ("logp", "old_logp", "advantages", "entropy"):
        inputs[k] = noncontiguous(inputs[k])
    check_policy(backend, torch.bfloat16, inputs, entropy_coef=0.05, agg="seq-mean-token-mean", device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_policy_fully_empty_mask(backend, ratio, agg):
    inputs = _policy_inputs(4, 37, torch.float32, seed=6)
    inputs["mask"] = torch.zeros(4, 37, dtype=torch.bool)
    with forced_backend(backend):
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, inputs, lambda t: t, 1.0, ratio=ratio, agg=agg,
                                           kl_coef=0.1, entropy_coef=0.01)
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values()), metrics
    for k, g in grads.items():
        assert torch.count_nonzero(g) == 0, k


HOSTILE = (float("nan"), float("inf"), float("-inf"))


def _poison(x: torch.Tensor | None, keep: torch.Tensor, offset: int) -> torch.Tensor | None:
    """``x`` with every position where ``keep`` is False replaced by NaN, +inf or -inf in turn."""
    if x is None:
        return None
    cycle = (torch.arange(x.numel()) + offset) % len(HOSTILE)  # [numel]
    bad = torch.tensor(HOSTILE, dtype=x.dtype)[cycle].view(x.shape)  # like x
    return torch.where(keep, x, bad)


def _poison_policy(inputs: dict) -> dict:
    """The same inputs with NaN/±inf at every masked-out position of every tensor (per-sequence advantages
    of fully masked rows included)."""
    keep = inputs["mask"] != 0  # [B, T]
    out = dict(inputs)
    for offset, k in enumerate(("logp", "old_logp", "advantages", "ref_logp", "entropy")):
        row_keep = keep.any(-1) if k == "advantages" and inputs[k].dim() == 1 else keep  # [B] or [B, T]
        out[k] = _poison(inputs[k], row_keep, offset)
    return out


def _assert_masked_grads_zero(grads: dict, keep: torch.Tensor) -> None:
    for k, g in grads.items():
        assert torch.isfinite(g).all(), f"grad {k} not finite"
        assert torch.count_nonzero(g[~keep]) == 0, f"grad {k} nonzero at masked-out positions"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
@pytest.mark.parametrize("variant", ["bool-mask/adv[B,T]", "float-mask/adv[B]"])
def test_policy_masked_positions_never_reach_outputs(backend, ratio, agg, variant):
    """NaN/±inf at masked-out positions (logp = -inf in GSPO's masked sum was a NaN loss): loss, metrics and
    gradients equal the float64 truth of the clean inputs, and masked positions get exactly 0 gradient."""
    mask_kind, adv_kind = variant.split("/")
    inputs = _policy_inputs(6, 37, torch.float32, seed=16, adv_per_seq=adv_kind == "adv[B]",
                            mask_kind=mask_kind.removesuffix("-mask"))
    hostile = _poison_policy(inputs)
    options = dict(ratio=ratio, agg=agg, kl_coef=0.1, entropy_coef=0.01, dual_clip=2.0)
    upstream = 1.5
    truth_loss, truth_metrics, truth_grads = _run_policy(ref.policy_loss, inputs, lambda t: t.double(), upstream, **options)
    with forced_backend(backend):
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, hostile, lambda t: t, upstream, **options)
    assert_scalar_close(loss, truth_loss, "loss")
    for k, v in metrics.items():
        assert_scalar_close(v, truth_metrics[k], f"metric {k}")
    _assert_masked_grads_zero(grads, inputs["mask"] != 0)
    for k, gr in grads.items():
        assert_close_to_truth(gr, truth_grads[k], torch.float32, name=f"grad {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_policy_hostile_masked_positions_without_terms(backend, ratio):
    """Only logp/old_logp/advantages, -inf log-probs at padding (the GSPO report): finite and exact."""
    inputs = _policy_inputs(4, 37, torch.bfloat16, seed=17, with_ref=False, with_ent=False)
    keep = inputs["mask"] != 0  # [B, T]
    hostile = dict(inputs, logp=inputs["logp"].masked_fill(~keep, float("-inf")),
                   old_logp=inputs["old_logp"].masked_fill(~keep, float("-inf")))
    truth_loss, truth_metrics, truth_grads = _run_policy(ref.policy_loss, inputs, lambda t: t.double(), 1.0, ratio=ratio)
    with forced_backend(backend):
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, hostile, lambda t: t, 1.0, ratio=ratio)
    assert_scalar_close(loss, truth_loss, "loss")
    for k, v in metrics.items():
        assert_scalar_close(v, truth_metrics[k], f"metric {k}")
    _assert_masked_grads_zero(grads, keep)
    assert_close_to_truth(grads["logp"], truth_grads["logp"], torch.bfloat16, name="grad logp")


EMPTY_SHAPES = [(0, 37), (4, 0), (0, 0)]
AGG_CASES = [(a, None) for a in losses.AGG_MODES] + [("seq-mean-token-sum-norm", 16)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("agg,norm_length", AGG_CASES)
@pytest.mark.parametrize("terms", ["plain", "kl+entropy"])
def test_policy_empty_batch(backend, shape, ratio, agg, norm_length, terms):
    """B = 0 or T = 0: loss 0, zero gradients, metrics 0 (was NaN on the reference path for B = 0 and
    ZeroDivisionError for T = 0 with seq-mean-token-sum-norm, and in Triton with ratio="sequence")."""
    B, T = shape
    full = terms == "kl+entropy"
    inputs = {
        "logp": -torch.rand(B, T), "old_logp": -torch.rand(B, T),
        "advantages": torch.randn(B) if full else torch.randn(B, T),
        "mask": torch.ones(B, T, dtype=torch.bool),
        "ref_logp": -torch.rand(B, T) if full else None, "entropy": torch.rand(B, T) if full else None,
    }
    options = dict(ratio=ratio, agg=agg, norm_length=norm_length)
    if full:
        options.update(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0)
    with forced_backend(backend):
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, inputs, lambda t: t, 1.0, **options)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.item() == 0.0
    expected = {"clipfrac", "approx_kl", "ratio_mean"} | ({"kl", "entropy"} if full else set())
    assert set(metrics) == expected
    for k, v in metrics.items():
        assert v.dtype == torch.float32 and v.dim() == 0 and v.item() == 0.0, (k, v)
    for k, g in grads.items():
        assert g.shape == (B, T) and torch.count_nonzero(g) == 0, k


# ---------------------------------------------------------------- value_loss


def _value_inputs(B, T, dtype, seed):
    g = _gen(seed)
    values = torch.randn(B, T, generator=g)  # [B, T]
    old = values + 0.3 * torch.randn(B, T, generator=g)  # [B, T]
    returns = values + torch.randn(B, T, generator=g)  # [B, T]
    return values.to(dtype), old.to(dtype), returns.to(dtype), _mask(B, T, g)


def _run_value(fn, inputs, cast, upstream, device="cpu", **options):
    """Loss, metrics and gradient of ``fn`` with its inputs cast and on ``device``; outputs on the CPU."""
    v, old, ret, m = on_device(device, *inputs)
    leaf = cast(v).detach().requires_grad_()
    loss, metrics = fn(leaf, cast(old), cast(ret), m, **options)
    (grad,) = torch.autograd.grad(loss * upstream, [leaf])
    return loss.cpu(), {k: x.cpu() for k, x in metrics.items()}, grad.cpu()


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss(device, backend, dtype, shape, clip, agg):
    inputs = _value_inputs(*shape, dtype, seed=7)
    upstream = 0.7
    truth = _run_value(ref.value_loss, inputs, lambda t: t.double(), upstream, clip=clip, agg=agg)
    eager = _run_value(ref.value_loss, inputs, lambda t: t, upstream, clip=clip, agg=agg)
    with forced_backend(backend):
        loss, metrics, grad = _run_value(rlkernels.value_loss, inputs, lambda t: t, upstream, device=device, clip=clip,
                                         agg=agg)
    if clip is not None:
        assert truth[1]["clipfrac"] > 0
    assert loss.dtype == torch.float32
    assert_scalar_close(loss, truth[0], "loss")
    assert set(metrics) == {"clipfrac", "values_mean"}
    for k in metrics:
        assert not metrics[k].requires_grad
        assert_scalar_close(metrics[k], truth[1][k], k)
    assert grad.dtype == dtype
    assert_close_to_truth(grad, truth[2], dtype, eager=eager[2], name="grad values")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_value_loss_sum_aggs_and_empty(backend, agg):
    inputs = _value_inputs(6, 37, torch.float32, seed=8)
    truth = _run_value(ref.value_loss, inputs, lambda t: t.double(), 1.0, clip=0.1, agg=agg)
    with forced_backend(backend):
        out = _run_value(rlkernels.value_loss, inputs, lambda t: t, 1.0, clip=0.1, agg=agg)
        empty = _run_value(rlkernels.value_loss, inputs[:3] + (torch.zeros(6, 37),), lambda t: t, 1.0, clip=0.1, agg=agg)
    assert_scalar_close(out[0], truth[0], "loss")
    assert_close_to_truth(out[2], truth[2], torch.float32, name="grad values")
    assert empty[0].item() == 0.0 and torch.count_nonzero(empty[2]) == 0
    assert all(v.item() == 0.0 for v in empty[1].values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_value_masked_positions_never_reach_outputs(backend, clip, agg):
    """NaN/±inf in values/old_values/returns at masked-out positions: the float64 truth of the clean inputs,
    exactly 0 gradient there."""
    inputs = _value_inputs(5, 37, torch.float32, seed=18)
    keep = inputs[3] != 0  # [B, T]
    hostile = tuple(_poison(x, keep, i) for i, x in enumerate(inputs[:3])) + (inputs[3].float(),)
    truth = _run_value(ref.value_loss, inputs, lambda t: t.double(), 0.8, clip=clip, agg=agg)
    with forced_backend(backend):
        loss, metrics, grad = _run_value(rlkernels.value_loss, hostile, lambda t: t, 0.8, clip=clip, agg=agg)
    assert_scalar_close(loss, truth[0], "loss")
    for k in metrics:
        assert_scalar_close(metrics[k], truth[1][k], k)
    _assert_masked_grads_zero({"values": grad}, keep)
    assert_close_to_truth(grad, truth[2], torch.float32, name="grad values")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_value_empty_batch(backend, shape, clip, agg):
    """B = 0 or T = 0: loss 0, zero gradient, metrics 0 (T = 0 with seq-mean-token-sum-norm divided by zero)."""
    inputs = (torch.randn(shape), torch.randn(shape), torch.randn(shape), torch.ones(shape, dtype=torch.bool))
    with forced_backend(backend):
        loss, metrics, grad = _run_value(rlkernels.value_loss, inputs, lambda t: t, 1.0, clip=clip, agg=agg)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.item() == 0.0
    assert set(metrics) == {"clipfrac", "values_mean"}
    for k, v in metrics.items():
        assert v.dtype == torch.float32 and v.dim() == 0 and v.item() == 0.0, (k, v)
    assert grad.shape == shape and torch.count_nonzero(grad) == 0


def test_reference_value_clipfrac_counts_only_clipped_tokens():
    """The reference's clipfrac is 0 when the clip range is wider than any change (no rounding noise)."""
    v, old, ret, m = _value_inputs(8, 100, torch.float64, seed=9)
    _, metrics = ref.value_loss(v, old, ret, m, clip=100.0)
    assert metrics["clipfrac"].item() == 0.0


# ---------------------------------------------------------------- kl_penalty


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_kl_penalty(device, backend, dtype, estimator):
    g = _gen(10)
    logp = (-torch.rand(3, 5, 171, generator=g) * 3).to(dtype)  # [3, 5, 171]: 2565 elements, 3 blocks
    ref_lp = (logp.float() + 0.5 * torch.randn(3, 5, 171, generator=g)).to(dtype)  # [3, 5, 171]
    upstream = torch.randn(3, 5, 171, generator=g)  # [3, 5, 171]

    def run(fn, cast, device="cpu"):
        a, b = (cast(t).to(device).detach().requires_grad_() for t in (logp, ref_lp))
        out = fn(a, b, estimator)
        return tuple(t.cpu() for t in (out, *torch.autograd.grad(out, [a, b], upstream.to(out))))

    truth = run(ref.kl_penalty, lambda t: t.double())
    eager = run(ref.kl_penalty, lambda t: t)
    with forced_backend(backend):
        out = run(rlkernels.kl_penalty, lambda t: t, device)
        no_grad_out = rlkernels.kl_penalty(*on_device(device, logp, ref_lp), estimator).cpu()  # no gradient written
    assert out[0].dtype == torch.float32 and out[1].dtype == dtype and out[2].dtype == dtype
    assert torch.equal(no_grad_out, out[0].detach())
    for name, o, t, e in zip(("kl", "grad logp", "grad ref_logp"), out, truth, eager):
        assert_close_to_truth(o, t, dtype, eager=e, name=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty_noncontiguous_and_empty(backend):
    g = _gen(11)
    logp = noncontiguous(-torch.rand(4, 33, generator=g))  # [4, 33]
    ref_lp = noncontiguous(-torch.rand(4, 33, generator=g))  # [4, 33]
    with forced_backend(backend):
        out = rlkernels.kl_penalty(logp, ref_lp, "k3")
        empty = rlkernels.kl_penalty(torch.empty(0, 3), torch.empty(0, 3))
    assert_close_to_truth(out, ref.kl_penalty(logp.double(), ref_lp.double(), "k3"), torch.float32)
    assert empty.shape == (0, 3) and empty.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_inputs_give_float32_results(backend):
    """float64 inputs: the losses, their metrics (in one order) and the per-token KL come back float32 on every
    backend, as for any other dtype; the values are the float64 truth to float32 rounding, the gradients keep
    float64."""
    B, T = 4, 37
    x = _policy_inputs(B, T, torch.float64, seed=12)
    logp = x["logp"].double().requires_grad_()  # [B, T]
    args = tuple(x[k].double() for k in ("old_logp", "advantages")) + (x["mask"],)
    kw = dict(ref_logp=x["ref_logp"].double(), entropy=x["entropy"].double(), kl_coef=0.1, entropy_coef=0.01)
    t_loss, t_metrics = ref.policy_loss(logp, *args, **kw)
    t_value, t_vmetrics = ref.value_loss(logp, *args, clip=0.2)
    t_kl = ref.kl_penalty(logp, kw["ref_logp"])
    with forced_backend(backend):
        results = [("policy_loss", *rlkernels.policy_loss(logp, *args, **kw), t_loss, t_metrics, losses.POLICY_METRICS),
                   ("value_loss", *rlkernels.value_loss(logp, *args, clip=0.2), t_value, t_vmetrics,
                    ("clipfrac", "values_mean"))]
        kl = rlkernels.kl_penalty(logp, kw["ref_logp"])
    for name, loss, metrics, truth, t_metrics, keys in results:
        assert loss.dtype == torch.float32 and loss.dim() == 0, name
        torch.testing.assert_close(loss.double(), truth, rtol=1e-6, atol=1e-7, msg=name)
        assert list(metrics) == list(keys), name
        for k in keys:
            assert metrics[k].dtype == torch.float32 and not metrics[k].requires_grad, f"{name} {k}"
            torch.testing.assert_close(metrics[k].double(), t_metrics[k], rtol=1e-6, atol=1e-7, msg=f"{name} {k}")
        (grad,) = torch.autograd.grad(loss, logp)
        (t_grad,) = torch.autograd.grad(truth, logp)
        assert grad.dtype == torch.float64, name
        torch.testing.assert_close(grad, t_grad, rtol=1e-5, atol=1e-7, msg=name)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl.double(), t_kl, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- autocast

@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_autocast_computes_in_float32(device, backend, dtype, ratio):
    """Under torch.autocast(bfloat16) every op returns exactly what it returns without autocast."""
    inputs = {k: (None if v is None else v.to(device)) for k, v in _policy_inputs(5, 37, dtype, seed=19).items()}
    vin = tuple(x.to(device) for x in _value_inputs(5, 37, dtype, seed=20))
    options = dict(ratio=ratio, kl_coef=0.1, entropy_coef=0.01, dual_clip=2.0, agg="seq-mean-token-mean")

    def run_all():
        loss, metrics, grads = _run_policy(rlkernels.policy_loss, inputs, lambda t: t, 1.3, **options)
        v_loss, v_metrics, v_grad = _run_value(rlkernels.value_loss, vin, lambda t: t, 0.7, clip=0.2)
        lp = inputs["logp"].detach().requires_grad_()
        kl = rlkernels.kl_penalty(lp, inputs["ref_logp"], "k3")
        (kl_grad,) = torch.autograd.grad(kl, [lp], torch.ones_like(kl))
        return [loss, *metrics.values(), *grads.values(), v_loss, *v_metrics.values(), v_grad, kl, kl_grad]

    with forced_backend(backend):
        plain = run_all()
        with torch.autocast(device, dtype=torch.bfloat16):
            autocast = run_all()
    for i, (a, b) in enumerate(zip(plain, autocast)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs under autocast"


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    inputs = _policy_inputs(5, 37, torch.float32, seed=12)
    vin = _value_inputs(5, 37, torch.float32, seed=13)
    options = dict(ratio="sequence", kl_coef=0.1, entropy_coef=0.01, dual_clip=1.5, agg="seq-mean-token-mean")

    def policy(lp, old, adv, m, ref_logp, entropy):
        loss, metrics = rlkernels.policy_loss(lp, old, adv, m, ref_logp=ref_logp, entropy=entropy, **options)
        return loss, metrics["clipfrac"], metrics["kl"]

    def value(v, old, ret, m):
        loss, metrics = rlkernels.value_loss(v, old, ret, m, clip=0.2)
        return loss, metrics["clipfrac"]

    def kl(lp, rf):
        return rlkernels.kl_penalty(lp, rf, "k2")

    with forced_backend(backend):
        for fn, args, grad_idx in [
            (policy, [inputs[k] for k in ("logp", "old_logp", "advantages", "mask", "ref_logp", "entropy")], (0, 4, 5)),
            (value, list(vin), (0,)),
            (kl, [inputs["logp"], inputs["ref_logp"]], (0, 1)),
        ]:
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            results = []
            for f in (fn, compiled):
                leaves = [a.detach().requires_grad_() if i in grad_idx else a for i, a in enumerate(args)]
                out = f(*leaves)
                first = out[0] if isinstance(out, tuple) else out
                grads = torch.autograd.grad(first.sum(), [leaves[i] for i in grad_idx])
                results.append((out, grads))
            (eager_out, eager_grads), (comp_out, comp_grads) = results
            for a, b in zip(eager_out if isinstance(eager_out, tuple) else (eager_out,),
                            comp_out if isinstance(comp_out, tuple) else (comp_out,)):
                torch.testing.assert_close(b, a)
            for a, b in zip(eager_grads, comp_grads):
                torch.testing.assert_close(b, a)


# ---------------------------------------------------------------- validation


NAN, INF = float("nan"), float("inf")


def _valid():
    inputs = _policy_inputs(3, 8, torch.float32, seed=14)
    return inputs


def _change_id(x):
    """Test id of a validation case: the changed arguments, with their value when it is not a tensor."""
    if not isinstance(x, dict):
        return str(x)[:40]
    return ",".join(k if isinstance(v, torch.Tensor) or v is None else f"{k}={v}" for k, v in x.items())


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(old_logp=torch.zeros(3, 7)), ValueError, "old_logp"),
        (dict(advantages=torch.zeros(4)), ValueError, "advantages"),
        (dict(advantages=torch.zeros(3, 7)), ValueError, "advantages"),
        (dict(advantages=torch.zeros(3, 8, 1)), ValueError, "advantages"),
        (dict(mask=torch.ones(3, 9, dtype=torch.bool)), ValueError, "mask"),
        (dict(ref_logp=torch.zeros(2, 8)), ValueError, "ref_logp"),
        (dict(entropy=torch.zeros(3, 1)), ValueError, "entropy"),
        (dict(logp=torch.zeros(3, 8, dtype=torch.int64)), TypeError, "logp"),
        (dict(logp=torch.zeros(24)), ValueError, "logp"),
        (dict(old_logp=torch.zeros(3, 8, device="meta")), ValueError, "old_logp"),
        (dict(kl_estimator="k4"), ValueError, "kl_estimator"),
        (dict(agg="mean"), ValueError, "agg"),
        (dict(ratio="group"), ValueError, "ratio"),
        (dict(ref_logp=None, kl_coef=0.1), ValueError, "ref_logp"),
        (dict(entropy=None, entropy_coef=0.1), ValueError, "entropy"),
        (dict(clip_low=-0.1), ValueError, "clip_low"),
        (dict(clip_high=-0.1), ValueError, "clip_high"),
        (dict(dual_clip=-3.0), ValueError, "dual_clip"),
        (dict(norm_length=0, agg="seq-mean-token-sum-norm"), ValueError, "norm_length"),
        (dict(norm_length=-5), ValueError, "norm_length"),
        # dual_clip <= 1 made every negative-advantage token's loss a constant (no gradient)
        (dict(dual_clip=0.0), ValueError, "dual_clip must be > 1"),
        (dict(dual_clip=0.5), ValueError, "dual_clip must be > 1"),
        (dict(dual_clip=1.0), ValueError, "dual_clip must be > 1"),
        (dict(dual_clip=NAN), ValueError, "dual_clip"),
        (dict(dual_clip=INF), ValueError, "dual_clip"),
        (dict(clip_low=NAN), ValueError, "clip_low"),
        (dict(clip_low=INF), ValueError, "clip_low"),
        (dict(clip_high=NAN), ValueError, "clip_high"),
        (dict(clip_high=INF), ValueError, "clip_high"),
        (dict(kl_coef=NAN), ValueError, "kl_coef"),
        (dict(kl_coef=INF), ValueError, "kl_coef"),
        (dict(kl_coef=-INF), ValueError, "kl_coef"),
        (dict(entropy_coef=NAN), ValueError, "entropy_coef"),
        (dict(entropy_coef=INF), ValueError, "entropy_coef"),
        (dict(norm_length=NAN, agg="seq-mean-token-sum-norm"), ValueError, "norm_length"),
        (dict(norm_length=INF, agg="seq-mean-token-sum-norm"), ValueError, "norm_length"),
        (dict(kl_coef="0.1"), TypeError, "kl_coef"),
    ],
    ids=_change_id,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_validation(change, error, match, backend):
    kwargs = {**_valid(), **change}
    positional = [kwargs.pop(k) for k in ("logp", "old_logp", "advantages", "mask")]
    with forced_backend(backend), pytest.raises(error, match=match):
        rlkernels.policy_loss(*positional, **kwargs)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(old_values=torch.zeros(3, 7)), ValueError, "old_values"),
        (dict(returns=torch.zeros(3)), ValueError, "returns"),
        (dict(mask=torch.ones(2, 8)), ValueError, "mask"),
        (dict(values=torch.zeros(3, 8, dtype=torch.int32)), TypeError, "values"),
        (dict(returns=torch.zeros(3, 8, device="meta")), ValueError, "returns"),
        (dict(clip=-0.2), ValueError, "clip"),
        (dict(agg="sum"), ValueError, "agg"),
        (dict(clip=NAN), ValueError, "clip"),
        (dict(clip=INF), ValueError, "clip"),
    ],
    ids=_change_id,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_value_validation(change, error, match, backend):
    v, old, ret, m = _value_inputs(3, 8, torch.float32, seed=15)
    kwargs = {"values": v, "old_values": old, "returns": ret, "mask": m, **change}
    with forced_backend(backend), pytest.raises(error, match=match):
        rlkernels.value_loss(**kwargs)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((torch.zeros(3, 4), torch.zeros(3, 5), "k3"), ValueError, "ref_logp"),
        ((torch.zeros(3, 4), torch.zeros(3, 4), "k5"), ValueError, "estimator"),
        ((torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4), "k3"), TypeError, "logp"),
        ((torch.zeros(3, 4), torch.zeros(3, 4, device="meta"), "k3"), ValueError, "ref_logp"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_validation(args, error, match, backend):
    with forced_backend(backend), pytest.raises(error, match=match):
        rlkernels.kl_penalty(*args)


# ---------------------------------------------------------------- ahead-of-time compilation


@pytest.mark.parametrize("arch", [80, 90])
def test_aot_compile_every_config(arch):
    pytest.importorskip("triton")
    from rlkernels.testing.aot import compile_config

    configs = losses.aot_configs()
    labels = {c.label for c in configs}
    assert len(labels) == len(configs) == 4 * 2 + 5 * 2 * 2 + 2 + 2 * 4 + 3  # kl, policy, value, reduce, scale
    for config in configs:
        report = compile_config(config, arch)
        print(report)
        assert report.registers > 0
        assert report.spill_bytes == 0, f"{report.label} spills on sm_{arch}"


# ---------------------------------------------------------------- one path per concern


def _kwonly(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _option_args(op) -> list[str]:
    """The op's non-tensor schema arguments, in order."""
    return [a.name for a in op.default._schema.arguments if "Tensor" not in str(a.type)]


def test_options_keep_their_names_down_to_the_kernel():
    """Each op's options dataclass holds its public keyword arguments under their own names and meanings, across the
    op (as typed lists: rlkernels._host.op_schema) and in the kernel (clip_low reached the kernel as
    clip_lo = 1 - clip_low; the KL estimator, the agg mode and the ratio mode crossed the op as indices and a flag)."""
    tensors = {"ref_logp", "entropy", "cu_seqlens"}  # cu_seqlens: packed inputs, unpacked before the op
    policy_fields = [f.name for f in dataclasses.fields(losses.PolicyOptions)]
    assert policy_fields == [n for n in _kwonly(rlkernels.policy_loss) if n not in tensors]
    assert policy_fields == [n for n in _kwonly(ref.policy_loss) if n not in tensors]
    assert _option_args(torch.ops.rlkernels.policy_loss) == ["float_options", "str_options"]
    policy = losses.PolicyOptions(0.1, 0.3, 3.0, "sequence", 0.05, "k2", 0.01, "seq-mean-token-sum-norm", None)
    assert options_from(losses.PolicyOptions, option_values(policy)) == policy
    value_fields = [f.name for f in dataclasses.fields(losses.ValueOptions)]
    assert value_fields == [n for n in _kwonly(rlkernels.value_loss) if n not in tensors]
    assert value_fields == [n for n in _kwonly(ref.value_loss) if n not in tensors]
    assert _option_args(torch.ops.rlkernels.value_loss) == ["float_options", "str_options"]
    assert options_from(losses.ValueOptions, option_values(losses.ValueOptions(None, "token-sum"))) == \
        losses.ValueOptions(None, "token-sum")
    assert _option_args(torch.ops.rlkernels.kl_penalty) == ["bool_options", "str_options"]
    assert options_from(losses.KLOptions, option_values(losses.KLOptions("k2", True))) == losses.KLOptions("k2", True)
    pytest.importorskip("triton")
    kernel_params = {p.name: p.annotation_type for p in losses._policy_kernel.params}
    # float64 scalars: the kernel rounds 1 ∓ clip to float32 once, as the host rounds them for PyTorch's clamp
    assert kernel_params["clip_low"] == kernel_params["clip_high"] == "fp64"
    assert not {"clip_lo", "clip_hi"} & set(kernel_params)


@pytest.mark.parametrize("agg,norm_length", AGG_CASES)
def test_agg_weights_are_the_agg_modes(agg, norm_length):
    """reference.agg_weights, the one definition of the agg modes: Σ_b w_b Σ_t m·x is the contract's formula of
    each mode (written out here), and the gradient of reference.aggregate in x is w_b·m."""
    g = _gen(23)
    B, T = 5, 9
    x = torch.randn(B, T, generator=g, dtype=torch.float64)  # [B, T]
    m = _mask(B, T, g)  # [B, T]: one empty row, one full row
    mf = m.double()  # [B, T]
    sums, tokens = (x * mf).sum(-1), mf.sum(-1)  # [B] each
    by_hand = {
        "token-mean": sums.sum() / tokens.sum(),
        "seq-mean-token-mean": (sums[tokens > 0] / tokens[tokens > 0]).mean(),
        "seq-mean-token-sum": sums.mean(),
        "seq-mean-token-sum-norm": sums.sum() / (B * (T if norm_length is None else norm_length)),
    }[agg]
    w = ref.agg_weights(tokens, agg, T, norm_length)  # [B]
    assert w.shape == (B,) and w.dtype == torch.float64
    assert_close_to_truth((w * sums).sum(), by_hand, torch.float64, name="Σ w·Σ m x")
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(ref.aggregate(leaf, m, agg, norm_length), [leaf])
    assert_close_to_truth(grad, w.unsqueeze(-1) * mf, torch.float64, name="d aggregate / dx")


OP_BACKENDS = [b for b in BACKENDS if b != "reference"]


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("ratio", ref.RATIO_MODES)
@pytest.mark.parametrize("agg,norm_length", AGG_CASES)
def test_policy_op_outputs_mean_the_same_on_every_backend(backend, ratio, agg, norm_length):
    """Every output of the policy op, including what the backward keeps (per-token gradients before the agg
    weight, and the weights), is the float64 truth of what it means, on every backend of the op's table."""
    inputs = _policy_inputs(6, 37, torch.float32, seed=21, adv_per_seq=True, mask_kind="float")
    tensors = [inputs[k] for k in ("logp", "old_logp", "advantages", "mask", "ref_logp", "entropy")]
    options = dict(clip_low=0.2, clip_high=0.3, dual_clip=2.0, ratio=ratio, kl_coef=0.1, kl_estimator="k2",
                   entropy_coef=0.01, agg=agg, norm_length=norm_length)
    opt = losses.PolicyOptions(**options)
    with forced_backend(backend):
        loss, metrics, g_logp, g_ref, g_ent, w = torch.ops.rlkernels.policy_loss(*tensors, *option_values(opt))
    truth_loss, truth_metrics, truth_grads = _run_policy(ref.policy_loss, inputs, lambda t: t.double(), 1.0, **options)
    assert_scalar_close(loss, truth_loss, "loss")
    for name, value in zip(losses.POLICY_METRICS, metrics):
        assert_scalar_close(value, truth_metrics[name], f"metric {name}")
    tokens = inputs["mask"].double().sum(-1)  # [B]
    assert_close_to_truth(w, ref.agg_weights(tokens, agg, 37, norm_length), torch.float32, name="agg weights")
    for name, g in (("logp", g_logp), ("ref_logp", g_ref), ("entropy", g_ent)):
        assert_close_to_truth(g * w.unsqueeze(-1), truth_grads[name], torch.float32, name=f"saved grad {name}")


def test_backend_is_resolved_at_run_time_inside_the_op(monkeypatch):
    """The ops choose their row through _backend.resolve at every call, also when compiled code calls them
    (RLKERNELS_BACKEND read at run time), and float64 inputs, which the Triton kernels do not load, stay on torch."""
    pytest.importorskip("triton")
    calls = []
    for table in (losses._POLICY_IMPLS, losses._VALUE_IMPLS, losses._KL_IMPLS):
        for name, fn in list(table.items()):
            monkeypatch.setitem(table, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    inputs = _policy_inputs(3, 8, torch.float32, seed=22)
    args = [inputs[k] for k in ("logp", "old_logp", "advantages", "mask")]  # [B, T] x3, [B, T] bool

    def step(lp, old, adv, m):
        return rlkernels.policy_loss(lp, old, adv, m)[0] + rlkernels.value_loss(lp, old, adv, m)[0] + \
            rlkernels.kl_penalty(lp, old).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for backend in ("torch", "triton"):
        with forced_backend(backend):
            compiled(*args)
    with forced_backend("triton"):
        step(*[a.double() if a.is_floating_point() else a for a in args])
    assert calls == ["torch"] * 3 + ["triton"] * 3 + ["torch"] * 3


# ---------------------------------------------------------------- launches on CUDA


def test_launch_counter_counts_kernels_not_views():
    """The counter sees an elementwise op, a reduction and a fill, and no view, select or allocation."""
    from rlkernels.testing.launches import count_launches

    x = torch.randn(4, 6)
    with count_launches() as counted:
        y = x.view(24)[3:].unsqueeze(0).expand(2, 21)  # views only
        z = torch.empty(5)  # no kernel on CUDA
        s = (y + 1.0).sum()  # 2 kernels
        zeros = torch.zeros(3)  # a fill
    assert z.shape == (5,) and s.dim() == 0 and zeros.shape == (3,)
    assert counted.launches == ["aten.add.Tensor", "aten.sum.default", "aten.zero_.default"] or \
        counted.launches == ["aten.add.Tensor", "aten.sum.default", "aten.zeros.default"], counted.launches


LAUNCH_CASES = [(agg, ratio, mask_kind) for agg in losses.AGG_MODES for ratio in ref.RATIO_MODES
                for mask_kind in ("bool", "float")]


@pytest.mark.parametrize("agg,ratio,mask_kind", LAUNCH_CASES)
def test_policy_loss_launches_at_most_3_forward_1_backward(agg, ratio, mask_kind):
    """One policy_loss call with every term (KL, entropy, dual clip) is at most 3 kernel launches forward
    (the loss kernel, the reduction epilogue, and the comparison of a non-bool mask with 0) and exactly one
    backward, counted on the Triton path (interpreted on CPU tensors) as CUDA would launch them."""
    pytest.importorskip("triton")
    from rlkernels.testing.launches import count_launches

    inputs = _policy_inputs(4, 1100, torch.float32, seed=31, mask_kind=mask_kind)  # two token blocks per row
    leaves = {k: inputs[k].detach().requires_grad_() for k in GRAD_NAMES}
    upstream = torch.full((), 1.5)
    with forced_backend("triton"):
        with count_launches() as fwd:
            loss, metrics = rlkernels.policy_loss(
                leaves["logp"], inputs["old_logp"], inputs["advantages"], inputs["mask"], ref_logp=leaves["ref_logp"],
                entropy=leaves["entropy"], clip_low=0.2, clip_high=0.28, dual_clip=3.0, ratio=ratio, kl_coef=0.1,
                entropy_coef=0.01, agg=agg)
        with count_launches() as bwd:
            grads = torch.autograd.grad(loss, [leaves[k] for k in GRAD_NAMES], upstream)
    assert len(fwd.launches) <= 3, fwd.launches
    assert len(bwd.launches) == 1, bwd.launches
    assert all(g.shape == (4, 1100) for g in grads) and set(metrics) == set(losses.POLICY_METRICS)
    if mask_kind == "bool":
        assert len(fwd.launches) == 2, fwd.launches


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_value_loss_launches_2_forward_1_backward(agg):
    pytest.importorskip("triton")
    from rlkernels.testing.launches import count_launches

    v, old, ret, m = _value_inputs(4, 1100, torch.float32, seed=32)
    leaf = v.detach().requires_grad_()
    upstream = torch.full((), 1.5)
    with forced_backend("triton"):
        with count_launches() as fwd:
            loss, _ = rlkernels.value_loss(leaf, old, ret, m.bool(), clip=0.2, agg=agg)
        with count_launches() as bwd:
            torch.autograd.grad(loss, [leaf], upstream)
    assert len(fwd.launches) == 2, fwd.launches
    assert len(bwd.launches) == 1, bwd.launches


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_value_loss_clip_propagates_a_nan_old_value_at_a_kept_token(backend):
    # max(unclipped, clipped) with a NaN old value is NaN (torch.maximum); a comparison that is false for NaN
    # used to pick the unclipped loss and drop it silently. Masked out, the same NaN reaches nothing.
    v = torch.tensor([[0.5, 1.0]], requires_grad=True)  # [1, 2]
    old = torch.tensor([[0.4, float("nan")]])  # [1, 2]
    ret = torch.zeros(1, 2)  # [1, 2]
    with forced_backend(backend):
        loss, _ = rlkernels.value_loss(v, old, ret, torch.ones(1, 2, dtype=torch.bool), clip=0.2)
        assert loss.isnan()
        loss, _ = rlkernels.value_loss(v, old, ret, torch.tensor([[True, False]]), clip=0.2)
        (g,) = torch.autograd.grad(loss, [v])
    assert loss.item() == pytest.approx(0.125) and g.tolist() == [[0.5, 0.0]]


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, float("nan")])
def test_a_mask_that_is_not_zero_one_is_refused(value):
    # the kernels read a numeric mask as "nonzero counts" and the torch rows as a weight: refused instead
    mask = torch.tensor([[1.0, value, 0.0]])  # [1, 3]
    x = torch.zeros(1, 3)  # [1, 3]
    with pytest.raises(ValueError, match="mask"):
        rlkernels.policy_loss(x, x, x, mask)
    with pytest.raises(ValueError, match="mask"):
        rlkernels.value_loss(x, x, x, mask)
    with pytest.raises(ValueError, match="mask"):
        rlkernels.masked_whiten(x, mask)
    loss, _ = rlkernels.policy_loss(x, x, x, torch.tensor([[1, 0, 1]], dtype=torch.int64))  # 0/1 integers are fine
    assert loss.item() == 0.0


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_float64_constants_next_to_a_16_bit_logp_give_float32(backend):
    # the reference backend promoted to float64 when only old_logp/advantages/returns were float64; the loss and
    # metrics follow the differentiable input's compute dtype on every backend
    gen = torch.Generator().manual_seed(8)
    logp = (-torch.rand(2, 3, generator=gen)).bfloat16().requires_grad_()  # [2, 3]
    old, adv = -torch.rand(2, 3, generator=gen, dtype=torch.float64), torch.randn(2, 3, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)  # [2, 3]
    with forced_backend(backend):
        loss, metrics = rlkernels.policy_loss(logp, old, adv, mask, ref_logp=old, kl_coef=0.1)
        v_loss, v_metrics = rlkernels.value_loss(logp, old, adv, mask, clip=0.2)
        kl = rlkernels.kl_penalty(logp, old)
    for t in (loss, v_loss, kl, *metrics.values(), *v_metrics.values()):
        assert t.dtype == torch.float32
    assert torch.autograd.grad(loss + v_loss, logp)[0].dtype == torch.bfloat16


# ---------------------------------------------------------------- a ratio beyond float32


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("op", ["policy_loss", "logits_policy_loss", "linear_policy_loss"])
def test_clipped_token_with_overflowing_ratio_has_zero_gradient(device, backend, op):
    """logp - old = 100: r = e^100 is inf in float32. With A > 0 the clip sets the value (-A·(1 + clip_high)), with
    A < 0 and a dual clip the bound does (-A·c): a constant, gradient exactly 0 (float64 knows r; float32 gives
    0·inf = NaN unless the kernel keeps the zero). The other token keeps its ordinary gradient."""
    old = (torch.tensor([[-100.0, -1.1]])).to(device)  # [B, T]
    mask = (torch.ones(1, 2, dtype=torch.bool)).to(device)  # [B, T]
    for adv, opts, value in ((1.0, {}, -1.2), (-1.0, {"dual_clip": 3.0}, 3.0)):
        advantages = (torch.tensor([[adv, 1.0]])).to(device)  # [B, T]
        with forced_backend(backend):
            if op == "policy_loss":
                leaf = (torch.tensor([[0.0, -1.0]])).to(device).requires_grad_()  # [B, T] logp
                loss, _ = rlkernels.policy_loss(leaf, old, advantages, mask, **opts)
                loss.backward()
                grad = leaf.grad  # [B, T]
                assert grad[0, 0].item() == 0.0, grad
                # token 1: unclipped, d/dlogp of -A·exp(logp - old) / 2 = -exp(0.1) / 2
                assert abs(grad[0, 1].item() + torch.tensor(0.1).exp().item() / 2) < 1e-6, grad
            else:
                # token 0 puts logp = log_softmax([5, -5, -5])[0] ~ -9e-5 on label 0: still about 100 above old
                logits = (torch.tensor([[[5.0, -5.0, -5.0], [0.0, 0.0, 0.0]]])).to(device)  # [B, T, V]
                labels = (torch.tensor([[0, 1]])).to(device)  # [B, T]
                if op == "logits_policy_loss":
                    leaves = [logits.requires_grad_()]
                    loss, _ = rlkernels.logits_policy_loss(logits, labels, old, advantages, mask, **opts)
                else:
                    hidden = (torch.tensor([[[5.0, 0.0], [0.0, 0.0]]])).to(device).requires_grad_()  # [B, T, H]
                    weight = (torch.tensor([[1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])).to(device).requires_grad_()
                    leaves = [hidden, weight]  # [B, T, H], [V, H]
                    loss, _ = rlkernels.linear_policy_loss(hidden, weight, labels, old, advantages, mask, **opts)
                loss.backward()
                for leaf in leaves:
                    assert torch.isfinite(leaf.grad).all(), (op, leaf.grad)
                assert torch.equal(leaves[0].grad[0, 0], torch.zeros_like(leaves[0].grad[0, 0]))  # the clipped token
        assert torch.isfinite(loss)
        # token 0 contributes the constant; token 1 is unclipped: -exp(0.1) (logp -1 vs old -1.1) for the two
        # plain-logp cases; the logits ops' token 1 has logp = -log 3 against old -1.1
        lp1 = -1.0 if op == "policy_loss" else -torch.tensor(3.0).log().item()
        assert abs(loss.item() - (value - torch.tensor(lp1 + 1.1).exp().item()) / 2) < 1e-5, (op, loss.item())


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_sequence_ratio_beyond_float32_stays_finite_at_masked_tokens(device, backend, agg):
    """GSPO: row 0's mean log-ratio is 100, s_0 = inf in float32. Its tokens are clipped (A > 0): value
    -1.2 each, gradient 0; its masked-out token must not turn that inf into NaN (0·inf) in the loss or the
    ratio metric (inf: the true mean ratio overflows)."""
    logp = (torch.tensor([[0.0, 0.0, 0.0], [-1.0, -2.0, 0.0]])).to(device).requires_grad_()  # [B, T]
    old = (torch.tensor([[-100.0, -100.0, 0.0], [-1.1, -2.2, 0.0]])).to(device)  # [B, T]
    mask = (torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)).to(device)  # [B, T]
    with forced_backend(backend):
        loss, metrics = rlkernels.policy_loss(logp, old, (torch.tensor([1.0, 1.0])).to(device), mask,
                                              ratio="sequence", agg=agg)
        loss.backward()
    s1 = torch.tensor(0.15).exp().item()  # row 1: mean log-ratio 0.15, inside the clip range
    assert abs(loss.item() - (-1.2 - s1) / 2) < 1e-5, loss.item()
    assert metrics["ratio_mean"].item() == float("inf")
    assert logp.grad[0].abs().sum().item() == 0.0 and torch.isfinite(logp.grad).all(), logp.grad
    # both modes: row 1 contributes -s1·(its 2 tokens)/4 to the loss; d s1 / d logp_t = s1 / 2
    assert torch.allclose(logp.grad[1].cpu(), torch.tensor([-s1 / 4, -s1 / 4, 0.0]), atol=1e-6), logp.grad


@pytest.mark.parametrize("kwargs, name", [
    ({"kl_coef": 1e39}, "kl_coef"), ({"entropy_coef": -1e39}, "entropy_coef"), ({"clip_low": 1e39}, "clip_low"),
    ({"clip_high": 1e39}, "clip_high"), ({"dual_clip": 1e39}, "dual_clip"),
])
def test_coefficients_beyond_float32_are_refused_naming_them(kwargs, name):
    """Finite in Python, inf in the kernels' float32 (where kl_coef·0 would be NaN): refused, named."""
    lp = torch.zeros(1, 2)  # [B, T]
    with pytest.raises(ValueError, match=f"^{name} must be finite in float32"):
        rlkernels.policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2), ref_logp=lp, entropy=lp, **kwargs)


def test_norm_length_whose_reciprocal_overflows_is_refused():
    lp = torch.zeros(1, 2)  # [B, T]
    with pytest.raises(ValueError, match=r"^norm_length must be >= 2.94e-39 \(1 / norm_length overflows float32\)"):
        rlkernels.policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2), agg="seq-mean-token-sum-norm", norm_length=1e-40)
    loss, _ = rlkernels.policy_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2), agg="seq-mean-token-sum-norm",
                                    norm_length=1e-30)
    assert loss.item() == pytest.approx(-2e30, rel=1e-6)  # Σ x·m / (B·norm_length) = -2 / 1e-30


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_k3_near_the_reference(device, backend):
    """k3 = e^-d + d - 1 (d = logp - ref) is ~d²/2 near 0, where the direct float32 form reads 0 (below |d| ~ 1e-4)
    or a few 1e-8 off. Every backend keeps float32's relative precision: value and gradient (1 - e^-d) within 2e-6
    relative of the float64 truth for |d| from 1e-6 to 10 (both signs; the series/direct switch at |d| = 1
    included)."""
    gen = _gen(41)
    logp = -torch.rand(4000, generator=gen) * 5  # [N]
    ref = logp + torch.randn(4000, generator=gen) * torch.logspace(-6, 1, 4000)  # [N]
    ref[:8] = logp[:8] + torch.tensor([1.0, -1.0, 0.9999, -0.9999, 1.0001, -1.0001, 1e-30, -1e-30])  # the switch
    d = logp.double() - ref.double()  # [N] the float32 inputs' exact difference
    keep = (logp - ref).double() == d  # [N] where float32 forms d exactly (else d's own rounding is the error)
    assert keep.float().mean() > 0.95
    truth, truth_grad = torch.expm1(-d) + d, -torch.expm1(-d)  # [N] x2
    leaf = logp.to(device).requires_grad_()
    with forced_backend(backend):
        kl = rlkernels.kl_penalty(leaf, ref.to(device), "k3")
        kl.sum().backward()
    kl, grad = kl.detach().cpu().double(), leaf.grad.cpu().double()  # [N] x2
    nonzero = keep & (d != 0)
    rel = ((kl - truth) / truth)[nonzero].abs().max().item()
    rel_grad = ((grad - truth_grad) / truth_grad)[nonzero].abs().max().item()
    assert rel < 2e-6 and rel_grad < 2e-6, (rel, rel_grad)
    assert torch.equal(kl[d == 0], torch.zeros_like(kl[d == 0]))


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_k3_in_the_policy_loss_near_the_reference(device, backend, ratio):
    """The policy kernels' k3 term (kl metric, loss and gradient) has the same relative precision when the
    policy is within 1e-5 of the reference: the direct form gave a kl of 0 there."""
    gen = _gen(43)
    B, T = 3, 50
    logp = -torch.rand(B, T, generator=gen) * 3  # [B, T]
    ref = logp + torch.randn(B, T, generator=gen) * 1e-5  # [B, T]
    d = logp.double() - ref.double()  # [B, T]
    mask = torch.ones(B, T)
    adv = torch.zeros(B)  # only the KL term moves the loss
    truth = (torch.expm1(-d) + d).mean()  # token-mean of k3
    truth_grad = -torch.expm1(-d) / (B * T) * 0.5  # kl_coef · d(k3)/d(logp) / N
    leaf = logp.to(device).requires_grad_()
    with forced_backend(backend):
        loss, metrics = rlkernels.policy_loss(leaf, logp.to(device), adv.to(device), mask.to(device), ratio=ratio,
                                              ref_logp=ref.to(device), kl_coef=0.5, kl_estimator="k3")
        loss.backward()
    assert metrics["kl"].item() == pytest.approx(truth.item(), rel=2e-5)
    assert loss.item() == pytest.approx(0.5 * truth.item(), rel=2e-5)
    torch.testing.assert_close(leaf.grad.cpu().double(), truth_grad, rtol=2e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_take_the_unclipped_branch_on_every_backend(backend):
    """Where the unclipped term ties with the clipped one (value loss: (v-R)² = (clamp(v, old ± clip)-R)²; dual
    clip: pg = -A·c), every backend takes the unclipped branch's gradient, as the kernels and policy_loss's
    docstring do for the max; the reference split it in half there (torch.maximum/minimum), so
    RLKERNELS_BACKEND=reference gave half the gradient of the torch and triton rows."""
    mask = torch.ones(2, 3, dtype=torch.bool)  # [B, T]
    # (v - R)² = 0.0625 = (clamp(v, -0.25, 0.25) - R)² exactly: gradient (v - R)/N = 0.25/6
    values = torch.full((2, 3), 0.75, requires_grad=True)  # [B, T]
    with forced_backend(backend):
        loss, _ = rlkernels.value_loss(values, torch.zeros(2, 3), torch.full((2, 3), 0.5), mask, clip=0.25)
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad, torch.full((2, 3), 0.25 / 6))
    # r = exp(log 2) = 2 exactly = dual_clip with A = -1: pg = r = 2 = -A·c; gradient -A·r/N = 2/6
    logp = torch.full((2, 3), 2.0).log().requires_grad_()  # [B, T]
    with forced_backend(backend):
        loss, _ = rlkernels.policy_loss(logp, torch.zeros(2, 3), -torch.ones(2, 3), mask, dual_clip=2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.full((2, 3), 2.0 / 6))
