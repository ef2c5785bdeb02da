"""rlkernels.integrations.verl.

The registration tests always run, against a fake ``verl.trainer.ppo.core_algos`` injected into
sys.modules (verl's registry semantics: policy losses overwrite, an advantage estimator name
taken by a different function is refused). The parity tests compare with verl's own
``core_algos`` on random inputs and run only where verl is installed: verl pins its own
transformers range, so they run in a separate environment (``make test-integrations``).
"""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import rlkernels.integrations.verl as rkv
from tests.helpers import assert_close_to_truth


# ---------------------------------------------------------------- registration (always runs)


def _fake_core_algos():
    mod = types.ModuleType("verl.trainer.ppo.core_algos")
    mod.POLICY_LOSS_REGISTRY, mod.ADV_ESTIMATOR_REGISTRY = {}, {}

    def register_policy_loss(name):
        def deco(fn):
            mod.POLICY_LOSS_REGISTRY[name] = fn
            return fn
        return deco

    def register_adv_est(name):
        def deco(fn):
            if name in mod.ADV_ESTIMATOR_REGISTRY and mod.ADV_ESTIMATOR_REGISTRY[name] != fn:
                raise ValueError(f"Adv estimator {name} has already been registered")
            mod.ADV_ESTIMATOR_REGISTRY[name] = fn
            return fn
        return deco

    mod.register_policy_loss, mod.register_adv_est = register_policy_loss, register_adv_est
    return mod


@pytest.fixture
def fake_verl(monkeypatch):
    core = _fake_core_algos()
    pkgs = {name: types.ModuleType(name) for name in ("verl", "verl.trainer", "verl.trainer.ppo")}
    pkgs["verl"].trainer, pkgs["verl.trainer"].ppo, pkgs["verl.trainer.ppo"].core_algos = (
        pkgs["verl.trainer"], pkgs["verl.trainer.ppo"], core)
    for name, m in {**pkgs, "verl.trainer.ppo.core_algos": core}.items():
        monkeypatch.setitem(sys.modules, name, m)
    return core


def test_import_is_light():
    """Importing the integrations package (or the verl adapter) does not import verl or trl."""
    import subprocess

    code = ("import sys, rlkernels.integrations, rlkernels.integrations.verl; "
            "bad = [m for m in ('verl', 'trl', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_into_fake_registry(fake_verl):
    names = rkv.register()
    assert names["policy_loss"] == ["rlkernels_vanilla", "rlkernels_gspo"]
    assert names["adv_estimator"] == ["rlkernels_grpo", "rlkernels_rloo"]
    assert fake_verl.POLICY_LOSS_REGISTRY == {"rlkernels_vanilla": rkv.compute_policy_loss_vanilla,
                                              "rlkernels_gspo": rkv.compute_policy_loss_gspo}
    assert fake_verl.ADV_ESTIMATOR_REGISTRY == {"rlkernels_grpo": rkv.compute_grpo_outcome_advantage,
                                                "rlkernels_rloo": rkv.compute_rloo_outcome_advantage}
    rkv.register()  # idempotent: the same functions under the same names
    assert len(fake_verl.ADV_ESTIMATOR_REGISTRY) == 2


def test_register_refuses_a_taken_name(fake_verl):
    fake_verl.register_adv_est("rlkernels_grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="already been registered"):
        rkv.register()


def test_register_explicit_module_and_old_verl():
    core = _fake_core_algos()
    rkv.register(core_algos=core)
    assert "rlkernels_gspo" in core.POLICY_LOSS_REGISTRY
    old = types.SimpleNamespace(register_adv_est=core.register_adv_est)  # no register_policy_loss
    with pytest.raises(ImportError, match="register_policy_loss"):
        rkv.register(core_algos=old)


def test_registered_loss_follows_verl_agg_loss_formulas(fake_verl):
    """The registered vanilla loss with the agg modes verl defines, written out by hand here."""
    rkv.register()
    fn = fake_verl.POLICY_LOSS_REGISTRY["rlkernels_vanilla"]
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old = torch.randn(B, T, generator=g) - 2
    logp = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0  # a fully masked sequence
    r = torch.exp(logp - old)
    pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.3))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    nonempty = (mask.sum(-1) > 0).float()
    expected = {
        "token-mean": (pg * mask).sum() / 11.0 * 2,  # batch_num_tokens=11, dp_size=2
        "token-sum": (pg * mask).sum() * 2,
        "seq-mean-token-mean": ((pg * mask).sum(-1) / mask.sum(-1).clamp(min=1) * nonempty).sum() / 6.0 * 2,
        "seq-mean-token-sum": (pg * mask).sum() / 6.0 * 2,
        "seq-mean-token-sum-norm": (pg * mask).sum() / 6.0 * 2 / 16.0,
    }
    info = dict(dp_size=2, batch_num_tokens=11, global_batch_size=6, loss_scale_factor=16)
    cfg = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.3, clip_ratio_c=3.0,
                                global_batch_info=info)
    for mode, want in expected.items():
        loss, metrics = fn(old, logp, adv, mask, mode, cfg)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=mode)
        assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    with pytest.raises(NotImplementedError, match="rollout_is_weights"):
        fn(old, logp, adv, mask, "token-mean", cfg, rollout_is_weights=torch.ones(B, T))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, logp, adv, mask, "bogus", cfg)


VERL_INFO = dict(dp_size=2, batch_num_tokens=11, global_batch_size=6, loss_scale_factor=16)


@pytest.mark.parametrize("global_info", [False, True], ids=["local", "global_batch_info"])
def test_agg_loss_follows_verl_formulas_and_ignores_masked_entries(global_info):
    """agg_loss (rlkernels' one aggregation, reference.aggregate, times verl's factor) is verl's formula of each
    mode, written out here; NaN/±inf at masked-out positions never reach it (x·m made it NaN) and get exactly
    zero gradient."""
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    # positive per-token terms (like a KL or an entropy): no cancellation, so the float32 result is within
    # n·2^-24 ≈ 2e-6 (n = 35 terms) of the float64 truth, inside REL_TOL[float32]
    x = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5  # [B, T]
    mask = (torch.rand(B, T, generator=g) > 0.3).float()  # [B, T]
    mask[0], mask[2] = 1.0, 0.0  # a full and an empty sequence
    sums, tokens = (x * mask).sum(-1), mask.sum(-1)  # [B] each
    nonempty = tokens > 0  # [B]
    seq_mean = (sums[nonempty] / tokens[nonempty]).sum()
    info = VERL_INFO if global_info else {}
    n_tok = info.get("batch_num_tokens", tokens.sum())
    n_seq = info.get("global_batch_size", nonempty.sum())
    dp = info.get("dp_size", 1)
    expected = {
        "token-mean": sums.sum() / n_tok * dp,
        "token-sum": sums.sum() * dp,
        "seq-mean-token-mean": seq_mean / n_seq * dp,
        "seq-mean-token-sum": sums.sum() / n_seq * dp,
        "seq-mean-token-sum-norm": sums.sum() / n_seq * dp / info.get("loss_scale_factor", T),
    }
    hostile = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=x.dtype)[torch.arange(B * T) % 3]
    poisoned = torch.where(mask != 0, x, hostile.view(B, T))  # [B, T]
    for mode, want in expected.items():
        out = rkv.agg_loss(x, mask, mode, **info)
        assert_close_to_truth(out, want, torch.float32, name=mode)
        leaf = poisoned.clone().requires_grad_()
        bad = rkv.agg_loss(leaf, mask, mode, **info)
        assert torch.equal(bad, out), mode
        (grad,) = torch.autograd.grad(bad, [leaf])
        assert torch.isfinite(grad).all() and torch.count_nonzero(grad[mask == 0]) == 0, mode


# ---------------------------------------------------------------- parity with verl (where installed)


@pytest.fixture(scope="module")
def verl_core():
    try:
        core = importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as exc:
        pytest.skip(f"verl is not installed ({exc}); run `make test-integrations` (separate venv)")
    if getattr(core, "__file__", None) is None:
        pytest.skip("verl.trainer.ppo.core_algos is a stand-in, not the real verl")
    return core


def _actor_config(**kw):
    from verl.workers.config import ActorConfig

    base = dict(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    base.update(kw)
    return ActorConfig(**base)


def _batch(seed, B=6, T=9, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) - 2.0
    logp = (old + spread * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[1] = 0.0
    mask[3, :] = 1.0
    return old, logp, adv, mask


MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", MODES)
def test_policy_loss_matches_verl(verl_core, loss_mode, agg):
    cfg = _actor_config(global_batch_info={"loss_scale_factor": 12} if agg == "seq-mean-token-sum-norm" else {})
    ours_fn = rkv.POLICY_LOSSES[f"rlkernels_{loss_mode}"]
    theirs_fn = verl_core.get_policy_loss_fn(loss_mode)
    old, logp, adv, mask = _batch(1)
    if loss_mode == "gspo":
        adv = adv[:, :1].expand_as(adv).contiguous()  # GSPO: one advantage per sequence
    lp1 = logp.detach().clone().requires_grad_(True)
    lp2 = logp.detach().clone().requires_grad_(True)
    ours, om = ours_fn(old, lp1, adv, mask, agg, cfg)
    theirs, tm = theirs_fn(old, lp2, adv, mask, agg, cfg)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-5, atol=1e-7)
    assert om.keys() == tm.keys()
    for k in tm:
        assert om[k] == pytest.approx(tm[k], rel=1e-5, abs=1e-6), k


def test_dual_clip_and_extreme_ratios_match_verl(verl_core):
    cfg = _actor_config(clip_ratio_c=2.0)
    old, logp, adv, mask = _batch(2, spread=3.0)  # ratios far outside the clip range, some beyond exp(±20)
    with torch.no_grad():
        logp[0, :3] += torch.tensor([25.0, -25.0, 30.0])
    lp1 = logp.detach().clone().requires_grad_(True)
    lp2 = logp.detach().clone().requires_grad_(True)
    ours, om = rkv.compute_policy_loss_vanilla(old, lp1, adv, mask, "token-mean", cfg)
    theirs, tm = verl_core.compute_policy_loss_vanilla(old, lp2, adv, mask, "token-mean", cfg)
    ours.backward()
    theirs.backward()
    assert tm["actor/pg_clipfrac_lower"] > 0  # the dual clip is active on this batch
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-5, atol=1e-7)
    for k in tm:
        assert om[k] == pytest.approx(tm[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"])
def test_kl_penalty_matches_verl(verl_core, name):
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(4, 8, generator=g) * 4).requires_grad_(True)  # some k3 values beyond verl's clamp at 10
    ref = torch.randn(4, 8, generator=g) * 4
    lp2 = logp.detach().clone().requires_grad_(True)
    ours = rkv.kl_penalty(logp, ref, name)
    theirs = verl_core.kl_penalty(lp2, ref, name)
    up = torch.randn(4, 8, generator=g)
    (ours * up).sum().backward()
    (theirs * up).sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, lp2.grad, rtol=1e-5, atol=1e-6)


def _rewards(seed, scores_override=None):
    g = torch.Generator().manual_seed(seed)
    B, T = 11, 6
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    scores = torch.randn(B, generator=g) if scores_override is None else scores_override
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), T - 1] = scores  # outcome reward on the last position
    # groups: 3 of size 3 (uids as verl passes them: an object array of strings), one of 1, one of 1
    index = np.array(["a", "b", "a", "c", "b", "a", "c", "d", "b", "c", "e"], dtype=object)
    return rewards, mask, index


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_matches_verl(verl_core, norm):
    rewards, mask, index = _rewards(4)
    ours, _ = rkv.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    theirs, _ = verl_core.compute_grpo_outcome_advantage(rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # through verl's registry, with norm_adv_by_std_in_grpo read from the algorithm config
    rkv.register()
    from verl.trainer.config import AlgoConfig

    fn = verl_core.get_adv_estimator_fn("rlkernels_grpo")
    via, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index,
                config=AlgoConfig(norm_adv_by_std_in_grpo=norm))
    torch.testing.assert_close(via, theirs, rtol=1e-5, atol=1e-6)


def test_grpo_all_equal_group_is_exactly_zero(verl_core):
    scores = torch.tensor([1.0, 0.0, 1.0, 2.0, 0.5, 1.0, 3.0, 4.0, 0.25, 0.0, 1.0])  # group "a" all equal to 1.0
    rewards, mask, index = _rewards(5, scores)
    ours, _ = rkv.compute_grpo_outcome_advantage(rewards, mask, index)
    theirs, _ = verl_core.compute_grpo_outcome_advantage(rewards.clone(), mask, index)
    assert (ours[[0, 2, 5]] == 0).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_rloo_advantage_matches_verl(verl_core):
    rewards, mask, index = _rewards(6)
    ours, _ = rkv.compute_rloo_outcome_advantage(rewards, mask, index)
    theirs, _ = verl_core.compute_rloo_outcome_advantage(rewards.clone(), mask, index)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_gae_matches_verl(verl_core):
    g = torch.Generator().manual_seed(7)
    B, T = 5, 13
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()  # holes: verl's multi-turn observation tokens
    mask[:, 0] = 1.0
    ours_a, ours_r = rkv.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    theirs_a, theirs_r = verl_core.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    m = mask.bool()
    torch.testing.assert_close(ours_a[m], theirs_a[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_r[m], theirs_r[m], rtol=1e-5, atol=1e-5)


def test_logprobs_and_fused_linear_match_verl(verl_core):
    import verl.utils.torch_functional as verl_F
    from verl.utils.experimental.torch_functional import FusedLinearForPPO as VerlFused

    g = torch.Generator().manual_seed(8)
    B, T, H, V = 2, 5, 16, 1000
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    ours = rkv.logprobs_from_logits(logits, ids)
    theirs = verl_F.logprobs_from_logits(logits, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    lp, ent = rkv.FusedLinearForPPO()(hidden, weight, ids, temperature=0.8)
    lp_v, ent_v = VerlFused()(h2, w2, ids, temperature=0.8)
    torch.testing.assert_close(lp, lp_v.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_v.float(), rtol=1e-5, atol=1e-5)
    up1, up2 = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    (lp * up1 + ent * up2).sum().backward()
    (lp_v * up1 + ent_v * up2).sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_patch_fused_kernels(verl_core):
    import verl.utils.experimental.torch_functional as exp
    import verl.utils.torch_functional as verl_F

    saved = exp.FusedLinearForPPO, verl_F.logprobs_from_logits
    try:
        out = rkv.register(patch_fused_kernels=True)
        assert exp.FusedLinearForPPO is rkv.FusedLinearForPPO
        assert verl_F.logprobs_from_logits is rkv.logprobs_from_logits
        assert len(out["patched"]) == 2
        assert verl_core.get_policy_loss_fn("rlkernels_vanilla") is rkv.compute_policy_loss_vanilla
    finally:
        exp.FusedLinearForPPO, verl_F.logprobs_from_logits = saved


def test_patch_fused_kernels_reaches_modules_that_imported_the_name(verl_core, monkeypatch):
    """verl's engines and rollouts bind ``from verl.utils.torch_functional import logprobs_from_logits`` at import:
    a module imported before register(patch_fused_kernels=True) must get the rlkernels one too, not keep verl's
    while register() reports it patched (it lists the rebound names)."""
    import verl.utils.experimental.torch_functional as exp
    import verl.utils.torch_functional as verl_F

    import verl.workers.rollout.naive.naive_rollout as naive
    original = verl_F.logprobs_from_logits
    assert naive.logprobs_from_logits is original
    for module, name in ((exp, "FusedLinearForPPO"), (verl_F, "logprobs_from_logits"),
                         (naive, "logprobs_from_logits")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    out = rkv.register(patch_fused_kernels=True)
    assert naive.logprobs_from_logits is rkv.logprobs_from_logits
    assert "verl.workers.rollout.naive.naive_rollout.logprobs_from_logits" in out["rebound"]


@pytest.mark.parametrize("loss_mode, agg", [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-sum-norm"),
                                            ("gspo", "seq-mean-token-mean")])
def test_policy_loss_from_hidden_equals_the_two_op_loss(loss_mode, agg):
    """A minimal actor that holds hidden states: policy_loss_from_hidden (rlkernels.linear_policy_loss) against the
    adapter's own two-op loss (FusedLinearForPPO's log-probs, then compute_policy_loss_<mode>): loss and gradients
    of hidden and weight, with clipping and the dual clip exercised (verl itself not needed)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 6, 16, 97
    hidden = torch.randn(B, T, H, generator=g)  # [B, T, H]
    weight = torch.randn(V, H, generator=g) / H**0.5 * 2  # [V, H]
    ids = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    with torch.no_grad():
        lp = rkv.FusedLinearForPPO()(hidden, weight, ids, temperature=0.9)[0]  # [B, T]
    old = lp + 0.5 * torch.randn(B, T, generator=g)  # [B, T] ratios off 1: clipped on both sides
    adv = torch.randn(B, T, generator=g)  # [B, T]
    mask = torch.rand(B, T, generator=g) > 0.2  # [B, T]
    config = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=1.5)
    if loss_mode == "gspo":  # GSPO's tiny clip range: sequence ratios get clipped
        config = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    two_op = rkv.compute_policy_loss_vanilla if loss_mode == "vanilla" else rkv.compute_policy_loss_gspo

    def run(fused):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, _ = rkv.policy_loss_from_hidden(h, w, ids, old, adv, mask, loss_agg_mode=agg, config=config,
                                                  temperature=0.9, loss_mode=loss_mode)
        else:
            logp = rkv.FusedLinearForPPO()(h, w, ids, temperature=0.9)[0]  # [B, T]
            loss, _ = two_op(old, logp, adv, mask, loss_agg_mode=agg, config=config)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    _, metrics = rkv.policy_loss_from_hidden(hidden, weight, ids, old, adv, mask, loss_agg_mode=agg, config=config,
                                             temperature=0.9, loss_mode=loss_mode)
    assert metrics["clipfrac"] > 0  # the clip acts
    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", MODES)
def test_policy_loss_empty_mask_and_masked_out_nan(loss_mode, agg):
    """An empty mask (or an empty batch) gives loss 0, zero gradients and 0 metrics (the local counts divided 0 by
    0: NaN); NaN/inf at masked-out positions reach neither the loss nor the metrics (actor/ppo_kl was NaN, and GSPO's
    clipfrac read the poisoned sequence ratio). Metrics are masked means (float64 truth on the same inputs)."""
    fn = rkv.compute_policy_loss_vanilla if loss_mode == "vanilla" else rkv.compute_policy_loss_gspo
    cfg = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0)
    old, logp, adv, mask = _batch(5)
    for m, o, lp, a in ((torch.zeros_like(mask), old, logp, adv), (mask[:0], old[:0], logp[:0], adv[:0])):
        leaf = lp.detach().clone().requires_grad_()
        loss, metrics = fn(o, leaf, a, m, agg, cfg)
        (grad,) = torch.autograd.grad(loss, [leaf])
        assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0, agg
        assert all(v == 0.0 for v in metrics.values()), metrics
    clean_loss, clean = fn(old, logp, adv, mask, agg, cfg)
    poisoned = logp.detach().clone()
    poisoned[mask == 0] = float("nan")
    old_poisoned = torch.where(mask != 0, old, torch.tensor(float("inf")))
    loss, metrics = fn(old_poisoned, poisoned.requires_grad_(), adv, mask, agg, cfg)
    assert torch.equal(loss, clean_loss.detach()), agg
    assert metrics == clean, (metrics, clean)
    d = (logp.detach() - old).double().clamp(-20.0, 20.0)  # [B, T]
    m = mask.double()
    torch.testing.assert_close(clean["actor/ppo_kl"], ((-d * m).sum() / m.sum()).item(), rtol=1e-5, atol=1e-7)
    for x, m in ((adv, torch.zeros_like(mask)), (adv[:0], mask[:0])):  # agg_loss shares the aggregation plan
        assert rkv.agg_loss(x, m, agg).item() == 0.0, agg


@pytest.mark.parametrize("field, value", [("clip_ratio", -0.1), ("clip_ratio", float("nan")),
                                          ("clip_ratio_low", float("inf")), ("clip_ratio_high", -5.0)])
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "from_hidden"])
def test_a_bad_clip_range_is_named_by_its_verl_field(field, value, loss_mode):
    """Named as the verl config calls it, not as rlkernels.policy_loss's clip_low/clip_high."""
    cfg = types.SimpleNamespace(**{"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
                                   "clip_ratio_c": 3.0, field: value})
    old, logp, adv, mask = _batch(5)
    with pytest.raises(ValueError, match=f"^{field} must"):
        if loss_mode == "from_hidden":
            B, T = mask.shape
            rkv.policy_loss_from_hidden(torch.randn(B, T, 8), torch.randn(11, 8), torch.zeros(B, T, dtype=torch.long),
                                        old, adv, mask, config=cfg)
        else:
            fn = rkv.compute_policy_loss_vanilla if loss_mode == "vanilla" else rkv.compute_policy_loss_gspo
            fn(old, logp, adv, mask, "token-mean", cfg)


def test_float_token_ids_are_refused_not_truncated():
    # FusedLinearForPPO, linear_cross_entropy and policy_loss_from_hidden cast the ids with .to(int64): float ids
    # 3.7 became 3 and gave another token's log p, with no error
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 4, 8, generator=g), torch.randn(11, 8, generator=g)  # [B, T, H], [V, H]
    ids = torch.randint(0, 11, (2, 4), generator=g).float() + 0.7  # [B, T]
    cfg = types.SimpleNamespace(clip_ratio=0.2, clip_ratio_c=3.0)
    with pytest.raises(TypeError, match="input_ids"):
        rkv.FusedLinearForPPO()(hidden, weight, ids)
    with pytest.raises(TypeError, match="labels"):
        rkv.linear_cross_entropy(hidden, weight, ids)
    with pytest.raises(TypeError, match="input_ids"):
        rkv.policy_loss_from_hidden(hidden, weight, ids, torch.zeros(2, 4), torch.ones(2, 4), torch.ones(2, 4),
                                    config=cfg)


@pytest.mark.parametrize("not_a_group", ["world", 0, object()])
def test_tensor_parallel_functions_name_a_process_group_that_is_not_one(not_a_group):
    # dist.get_rank(not_a_group) ran first: "Default process group has not been initialized", naming no argument
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))  # [B, T, V_r], [B, T]
    with pytest.raises(TypeError, match="process_group"):
        rkv.vocab_parallel_log_probs_from_logits(logits, labels, process_group=not_a_group)
    with pytest.raises(TypeError, match="process_group"):
        rkv.vocab_parallel_entropy(logits, process_group=not_a_group)
    with pytest.raises(TypeError, match="process_group"):
        rkv.linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(5, 4), labels, 1.0, "none", not_a_group)


def test_agg_loss_refuses_a_mask_of_another_shape_by_name():
    # a [2, 4] mask with a [2, 3] loss_mat raised "The size of tensor a (3) must match the size of tensor b (4)", 1-D
    # inputs "not enough values to unpack", naming no argument; a 0.5 mask was taken as a weight
    x = torch.rand(2, 3)  # [B, T]
    with pytest.raises(ValueError, match="loss_mask"):
        rkv.agg_loss(x, torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="loss_mat"):
        rkv.agg_loss(x[0], torch.ones(3), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="loss_mask"):
        rkv.agg_loss(x, torch.full((2, 3), 0.5), "token-mean")


_RAY_WORKER_PROBE = """
import sys, ray
hook = sys.argv[1] or None
ray.init(num_cpus=1, include_dashboard=False, runtime_env={"worker_process_setup_hook": hook} if hook else None)

@ray.remote
def loss_module():
    from verl.trainer.ppo import core_algos
    try:
        return core_algos.get_policy_loss_fn("rlkernels_vanilla").__module__
    except ValueError as error:
        return f"refused: {error}"

print("worker:", ray.get(loss_module.remote()))
ray.shutdown()
"""


def test_ray_workers_register_through_the_setup_hook_readme_names():
    """verl runs its actor as Ray worker processes: register() in the driver alone does not reach them (their
    loss-mode lookup refuses 'rlkernels_vanilla'), and README's runtime_env hook does (verl + Ray in one process
    each: a subprocess, so this test's process starts no Ray)."""
    pytest.importorskip("verl")
    pytest.importorskip("ray")
    import os
    import subprocess

    root = str(Path(__file__).resolve().parents[1])  # this checkout's rlkernels in the workers too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0")

    def worker_sees(hook: str) -> str:
        run = subprocess.run([sys.executable, "-c", _RAY_WORKER_PROBE, hook], capture_output=True, text=True,
                             env=env, timeout=300)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("worker:")]
        assert lines, run.stderr[-2000:]
        return lines[0]

    assert worker_sees("rlkernels.integrations.verl.register") == "worker: rlkernels.integrations.verl"
    assert "refused: Unsupported loss mode: rlkernels_vanilla" in worker_sees("")
