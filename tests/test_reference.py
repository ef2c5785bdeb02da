"""The reference formulas on small cases worked out by hand (independent of the formulas' code)."""
import math

import pytest
import torch

from rlkernels import reference as ref


def test_logprobs_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]], dtype=torch.float64)  # p = [1/4, 3/4], [1/2, 1/2]
    labels = torch.tensor([1, -100])
    logp, ent = ref.logprobs(logits, labels, return_entropy=True)
    assert logp[0].item() == pytest.approx(math.log(0.75))
    assert ent[0].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert logp[1].item() == 0.0 and ent[1].item() == 0.0  # ignore_index
    # temperature divides the logits
    logp_t = ref.logprobs(logits[:1], labels[:1], temperature=2.0)
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert logp_t[0].item() == pytest.approx(math.log(p))


def test_logprobs_computes_in_float32_for_low_precision():
    logits = torch.randn(3, 7).to(torch.bfloat16)
    out = ref.logprobs(logits, torch.tensor([0, 3, 6]))
    assert out.dtype == torch.float32


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0], dtype=torch.float64)
    ref_logp = torch.tensor([-2.0], dtype=torch.float64)
    assert ref.kl_penalty(logp, ref_logp, "k1").item() == pytest.approx(1.0)
    assert ref.kl_penalty(logp, ref_logp, "k2").item() == pytest.approx(0.5)
    assert ref.kl_penalty(logp, ref_logp, "k3").item() == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)
    assert ref.kl_penalty(logp, ref_logp, "abs").item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="estimator"):
        ref.kl_penalty(logp, ref_logp, "k4")


def test_aggregate_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert ref.aggregate(x, m, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert ref.aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)  # empty row excluded
    assert ref.aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx((3 + 4 + 0) / 3)
    assert ref.aggregate(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(7 / (3 * 3))
    assert ref.aggregate(x, m, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(7 / 30)
    empty = torch.zeros_like(m)
    for agg in ref.AGG_MODES:
        assert ref.aggregate(x, empty, agg).item() == 0.0


def test_policy_loss_clipping_by_hand():
    # one token each: ratio 1.5 with A = +1 (clipped at 1.2), ratio 0.5 with A = -1 (clipped at 0.8), ratio 1.1 with A = +1 (not clipped)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, metrics = ref.policy_loss(logp, old, adv, mask)
    # pg = max(-A r, -A clip(r)): [-1.2, 0.8, -1.1]
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1) / 3)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 3)
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # dual clip c=3 caps the loss of A<0 tokens at 3|A|: ratio 5 with A = -1 gives 3, not 5
    loss_dc, _ = ref.policy_loss(torch.log(torch.tensor([[5.0]], dtype=torch.float64)), torch.zeros(1, 1, dtype=torch.float64),
                                 torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1), dual_clip=3.0)
    assert loss_dc.item() == pytest.approx(3.0)


def test_policy_loss_sequence_ratio_by_hand():
    logp = torch.tensor([[0.2, 0.4, 9.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = ref.policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, ratio="sequence", clip_low=10.0)
    assert metrics["ratio_mean"].item() == pytest.approx(math.exp(0.3))  # masked mean log-ratio, masked token ignored


def test_value_loss_by_hand():
    v = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 2)
    loss, _ = ref.value_loss(v, old, ret, m)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    # clip 0.5: token 0 clipped value 0.5 -> (0.5-1)^2 = 0.25 < 1, max keeps 1; token 1 unchanged
    loss_c, metrics = ref.value_loss(v, old, ret, m, clip=0.5)
    assert loss_c.item() == pytest.approx(0.5)
    assert metrics["clipfrac"].item() == 0.0


def test_gae_by_hand_with_interior_gap():
    # tokens 0, 2, 3 valid; token 1 masked (e.g. an environment turn) and transparent
    r = torch.tensor([[1.0, 100.0, 0.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 100.0, 0.25, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1, 1]])
    g, lam = 0.9, 0.8
    a3 = 2.0 + g * 0.0 - 1.0
    a2 = 0.0 + g * 1.0 - 0.25 + g * lam * a3
    a0 = 1.0 + g * 0.25 - 0.5 + g * lam * a2  # the chain skips token 1
    adv, ret = ref.gae(r, v, m, gamma=g, lam=lam)
    valid = m.bool()
    torch.testing.assert_close(adv[valid], torch.tensor([a0, a2, a3], dtype=torch.float64))
    torch.testing.assert_close(ret[valid], torch.tensor([a0 + 0.5, a2 + 0.25, a3 + 1.0], dtype=torch.float64))


def test_group_advantages_by_hand():
    s = torch.tensor([1.0, 3.0, 5.0, 5.0, 7.0], dtype=torch.float64)
    index = torch.tensor([4, 4, 9, 9, 2])  # groups {1,3}, {5,5} (constant), {7} (single)
    out = ref.group_advantages(s, index=index, mode="grpo", eps=0.0)
    std = math.sqrt(2.0)  # unbiased std of {1, 3}
    torch.testing.assert_close(out, torch.tensor([-1 / std, 1 / std, 0, 0, 0], dtype=torch.float64))
    out = ref.group_advantages(s[:4], 2, mode="rloo")
    torch.testing.assert_close(out, torch.tensor([-2.0, 2.0, 0.0, 0.0], dtype=torch.float64))
    out = ref.group_advantages(s[:4], 2, mode="dr_grpo")
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    # constant group whose float mean is not exact still gives exactly 0
    c = torch.full((3,), 0.1, dtype=torch.float32)
    assert torch.equal(ref.group_advantages(c, 3), torch.zeros(3))


def test_masked_whiten_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=torch.float64)
    m = torch.tensor([1, 1, 1, 0])
    out = ref.masked_whiten(x, m, eps=0.0)  # mean 2, unbiased var 1
    torch.testing.assert_close(out[:3], torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64))
    out = ref.masked_whiten(x, m, shift_mean=False, eps=0.0)
    torch.testing.assert_close(out[:3], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def test_logprobs_entropy_with_masked_vocabulary_is_finite():
    logits = torch.tensor([[0.0, float("-inf"), math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    logp, ent = ref.logprobs(logits, torch.tensor([2]), return_entropy=True)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0


def test_reference_statistics_hold_float32_extremes():
    """The eager reference (RLKERNELS_BACKEND=reference, the trainer's --losses eager) forms its group and
    whitening statistics in float64: finite float32 scores near the top of the range, and a large offset,
    give the true values rounded to float32, not NaN or digits lost to a float32 sum."""
    # mean 1e38, deviations (2, 2, -4, 0)e38, unbiased variance 24e76 / 3 = 8e76, std 2·sqrt(2)e38
    got = ref.group_advantages(torch.tensor([3e38, 3e38, -3e38, 1e38]), 4)
    r2 = math.sqrt(2)
    assert got.dtype == torch.float32 and torch.allclose(got, torch.tensor([1 / r2, 1 / r2, -r2, 0.0]), atol=1e-6), got
    gen = torch.Generator().manual_seed(3)
    x, m = 1e6 + torch.randn(4, 250, generator=gen), torch.rand(4, 250, generator=gen) < 0.8  # [B, T] x2
    xs = x.double()[m]  # the masked entries, in float64
    truth = (x.double() - xs.mean()) / math.sqrt(float(xs.var(unbiased=True)) + 1e-8)  # [B, T]
    got = ref.masked_whiten(x, m)
    assert got.dtype == torch.float32 and (got.double() - truth).abs().max() < 1e-5
    # one group of the four step rewards (3, -3, 1, 2)e38: mean 0.75e38; token t sums its row's steps ending >= t
    r = torch.tensor([[3e38, -3e38], [1e38, 2e38]])  # [B, S]
    ends = torch.tensor([[0, 1], [1, 1]])  # [B, S]
    vals = [3.0, -3.0, 1.0, 2.0]
    mean, std = sum(vals) / 4, math.sqrt(sum((v - sum(vals) / 4) ** 2 for v in vals) / 3)
    n = [(v - mean) / std for v in vals]  # the normalised steps (the 1e38 scale cancels)
    got = ref.process_advantages(r, ends, 2, group_size=2)
    truth = torch.tensor([[n[0] + n[1], n[1]], [n[2] + n[3], n[2] + n[3]]])
    assert got.dtype == torch.float32 and torch.allclose(got, truth, atol=1e-6), got


def test_linear_logprobs_reads_narrow_labels_as_their_values():
    """uint8 labels: ignore_index=-100 compared in uint8 wraps to 156, and linear_logprobs zeroed the hidden row of
    a token labelled 156 (its log-prob then that of a zero row, 1/V's). The labels compare in int64, as logprobs
    reads them."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, generator=g, dtype=torch.float64)  # [N, H]
    weight = torch.randn(200, 4, generator=g, dtype=torch.float64)  # [V, H]
    labels = torch.tensor([156, 3, 156])  # [N]
    want = ref.linear_logprobs(hidden, weight, labels)  # [N]
    assert torch.equal(ref.linear_logprobs(hidden, weight, labels.to(torch.uint8)), want)
    assert want[0].item() != pytest.approx(-math.log(200))
