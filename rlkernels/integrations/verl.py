"""verl adapter: rlkernels' losses and advantage estimators in verl's own registries.

::

    import rlkernels.integrations.verl as rkv
    rkv.register()            # in every process that builds verl's actor/trainer (see below)

then in the verl config::

    actor_rollout_ref.actor.policy_loss.loss_mode=rlkernels_vanilla   # or rlkernels_gspo
    algorithm.adv_estimator=rlkernels_grpo                              # or rlkernels_rloo

``register()`` changes only the process it runs in. verl's actor, rollout and reference workers are Ray processes,
so a call in the driver (your ``main_ppo`` entry) alone does not reach them: give Ray the hook where your launcher
calls ``ray.init``, ``runtime_env={"worker_process_setup_hook": "rlkernels.integrations.verl.register"}``, or call
it at the top of a module every worker imports (README, "verl"; a Ray worker is tested in
``tests/test_integrations_verl.py``).

Everything here follows verl's semantics (checked against ``verl.trainer.ppo.core_algos`` in
``tests/test_integrations_verl.py``): its ``agg_loss`` modes including ``global_batch_info``
(``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``), the
``clip_ratio_c`` dual clip that verl's vanilla loss always applies, the ±20 log-ratio clamp,
its KL estimator names (``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3`` clamped to
±10, and the ``+`` straight-through variants), and its GRPO/RLOO conventions for groups of one.

Tensor parallelism (verl's Megatron backend): :func:`vocab_parallel_log_probs_from_logits` and
:func:`vocab_parallel_entropy` (the signatures of ``verl.utils.megatron.tensor_parallel``'s, which verl's Megatron
actor calls on the vocabulary-parallel logits, plus the tensor-parallel group as ``process_group=``), and
:func:`linear_cross_entropy` (``verl.utils.kernel.linear_cross_entropy``'s signature: hidden states and this rank's
slice of the output weight, ``dist_process_group`` the tensor-parallel group), all on
:mod:`rlkernels.vocab_parallel` (one collective per call merges the ranks' statistics; no Megatron import: pass
``megatron.core.parallel_state.get_tensor_model_parallel_group()``).

Also here: :func:`logprobs_from_logits` (signature of ``verl.utils.torch_functional.logprobs_from_logits``)
and :class:`FusedLinearForPPO` (the interface of verl's fused-kernel backend
``verl.utils.experimental.torch_functional.FusedLinearForPPO``: ``(hidden, weight, input_ids,
temperature) -> (log_probs, entropy)`` without ``[tokens, vocab]`` logits).
``register(patch_fused_kernels=True)`` swaps them into verl's modules.

This module imports verl only inside :func:`register` and the registered functions'
first call, so it can be imported (and its registration tested) where verl is absent.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

import rlkernels
from rlkernels import _checks
from rlkernels.reference import aggregate, masked_mean

__all__ = [
    "register", "POLICY_LOSSES", "ADV_ESTIMATORS", "compute_policy_loss_vanilla", "compute_policy_loss_gspo",
    "kl_penalty", "agg_loss", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_gae_advantage_return", "logprobs_from_logits", "FusedLinearForPPO", "policy_loss_from_hidden",
    "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy", "linear_cross_entropy",
]

_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


# ---------------------------------------------------------------- aggregation: rlkernels' agg modes -> verl's agg_loss


def _agg_plan(mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1, batch_num_tokens=None,
              global_batch_size=None, loss_scale_factor=None):
    """(rlkernels agg, norm_length, factor) such that ``factor · rlkernels_aggregate == verl.agg_loss``."""
    if loss_agg_mode not in _AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} (verl's modes: {_AGG_MODES})")
    if dp_size > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if dp_size > 1 and loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
        raise ValueError("global_batch_size is required when dp_size > 1")
    m = mask.to(torch.float32)  # [B, T]
    B, T = m.shape
    n_tok = m.sum()
    n_seq = (m.sum(-1) > 0).sum().to(torch.float32)  # verl's seq-means skip fully masked sequences
    # the local counts clamped at 1, as the rlkernels aggregation's own denominators: an empty mask gives 0, not 0/0
    if loss_agg_mode == "token-mean":
        denom = n_tok.clamp(min=1.0) if batch_num_tokens is None else batch_num_tokens
        return "token-mean", None, n_tok.clamp(min=1.0) / denom * dp_size
    if loss_agg_mode == "token-sum":
        return "token-mean", None, n_tok.clamp(min=1.0) * dp_size
    gbs = n_seq.clamp(min=1.0) if global_batch_size is None else global_batch_size
    if loss_agg_mode == "seq-mean-token-mean":
        return "seq-mean-token-mean", None, n_seq.clamp(min=1.0) / gbs * dp_size
    if loss_agg_mode == "seq-mean-token-sum":
        return "seq-mean-token-sum", None, B / gbs * dp_size
    scale = T if loss_scale_factor is None else loss_scale_factor
    return "seq-mean-token-sum-norm", scale, B / gbs * dp_size


def _batch_info(config) -> dict:
    info = getattr(config, "global_batch_info", None) if config is not None else None
    return dict(info or {})


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    """verl's ``agg_loss`` (same signature), for per-token terms that are not a policy loss (e.g. KL, entropy).

    ``factor · rlkernels.reference.aggregate`` (see :func:`_agg_plan`): whatever masked-out entries of
    ``loss_mat`` hold (NaN, ±inf) never reaches the result or its gradient.
    """
    _checks.floating(loss_mat, "loss_mat")
    _checks.rank(loss_mat, "loss_mat", 2)
    _checks.same_shape(loss_mat, "loss_mat", _checks.mask(loss_mask, "loss_mask"), "loss_mask")
    agg, norm, factor = _agg_plan(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                                  loss_scale_factor)
    # rlkernels' aggregation (its agg modes' weights are written once, in reference.agg_weights), then verl's factor
    return aggregate(loss_mat.float(), loss_mask, agg, norm) * factor


# ---------------------------------------------------------------- policy losses


def _cfg(config, name, default=None):
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(name, default)
    return getattr(config, name, default)


def _clip_range(config):
    """``(low, high)`` from verl's ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high``, each checked under
    its own name (rlkernels.policy_loss would name ``clip_low``/``clip_high``, which a verl config does not have)."""
    clip = _checks.non_negative(_cfg(config, "clip_ratio", 0.2), "clip_ratio")
    low = _cfg(config, "clip_ratio_low")
    high = _cfg(config, "clip_ratio_high")
    low = clip if low is None else _checks.non_negative(low, "clip_ratio_low")
    high = clip if high is None else _checks.non_negative(high, "clip_ratio_high")
    return low, high


def _refuse_rollout_weights(rollout_is_weights, name):
    if rollout_is_weights is not None:
        raise NotImplementedError(
            f"{name}: rollout_is_weights (verl's rollout correction) multiplies each token's loss, which "
            "rlkernels.policy_loss does not take; disable rollout correction or use verl's own loss_mode"
        )


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """verl's ``vanilla`` PPO loss (clip, ``clip_ratio_c`` dual clip, ±20 log-ratio clamp) via ``rlkernels.policy_loss``."""
    if config is None:
        raise ValueError("compute_policy_loss_vanilla needs verl's actor config (clip_ratio, ...)")
    _refuse_rollout_weights(rollout_is_weights, "rlkernels_vanilla")
    low, high = _clip_range(config)
    clip_c = _cfg(config, "clip_ratio_c", 3.0)
    if not clip_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_c}")
    old = old_log_prob.detach()
    diff = log_prob - old  # [B, T]
    # verl clamps the log-ratio to [-20, 20]: same value and (zero) gradient there, untouched elsewhere
    log_prob = torch.where(diff.abs() > 20.0, old + diff.clamp(-20.0, 20.0), log_prob)
    agg, norm, factor = _agg_plan(response_mask, loss_agg_mode, **_batch_info(config))
    loss, _ = rlkernels.policy_loss(log_prob, old, advantages, response_mask, clip_low=low, clip_high=high,
                                    dual_clip=clip_c, ratio="token", agg=agg, norm_length=norm)
    with torch.no_grad():
        m = response_mask.to(torch.float32)
        d = (log_prob - old).float().clamp(-20.0, 20.0)
        ratio = torch.exp(d)
        adv = advantages.float()
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1 - low, 1 + high)
        clip1 = torch.maximum(pg1, pg2)
        lower = (clip1 > -adv * clip_c).float() * (adv < 0).float()
        metrics = {  # masked means: 0 for an empty mask, nothing from a masked-out entry (NaN, inf)
            "actor/pg_clipfrac": masked_mean((pg2 > pg1).float(), m).item(),
            "actor/ppo_kl": masked_mean(-d, m).item(),
            "actor/pg_clipfrac_lower": masked_mean(lower, m).item(),
        }
    return loss * factor, metrics


def policy_loss_from_hidden(hidden_states, vocab_weights, input_ids, old_log_prob, advantages, response_mask,
                            loss_agg_mode="token-mean", config=None, temperature: float = 1.0, loss_mode="vanilla"):
    """The policy loss of ``loss_mode`` (``"vanilla"`` or ``"gspo"``) straight from the actor's final hidden states,
    through ``rlkernels.linear_policy_loss`` (three GEMMs: the head's gradient formed in the forward), for an actor
    that computes its loss from hidden states (verl's fused-kernel path, where ``FusedLinearForPPO`` gives the
    log-probs): equals ``compute_policy_loss_<loss_mode>(old_log_prob, FusedLinearForPPO()(hidden_states,
    vocab_weights, input_ids, temperature)[0], ...)``'s loss, except that verl's ±20 log-ratio clamp (vanilla) is not
    applied (it changes only tokens whose log-ratio passes ±20). ``hidden_states`` ``[B, T, H]``, ``vocab_weights``
    ``[V, H]``, ``input_ids`` / ``old_log_prob`` / ``advantages`` / ``response_mask`` ``[B, T]``. Returns
    ``(loss, metrics)``, ``metrics`` rlkernels' (``clipfrac``, ``approx_kl``, ``ratio_mean``, ``token_logp``)."""
    if config is None:
        raise ValueError("policy_loss_from_hidden needs verl's actor config (clip_ratio, ...)")
    if loss_mode not in ("vanilla", "gspo"):
        raise ValueError(f"loss_mode must be 'vanilla' or 'gspo', got {loss_mode!r}")
    low, high = _clip_range(config)
    dual = None
    if loss_mode == "vanilla":
        dual = _cfg(config, "clip_ratio_c", 3.0)
        if not dual > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {dual}")
    agg, norm, factor = _agg_plan(response_mask, loss_agg_mode, **_batch_info(config))
    loss, metrics = rlkernels.linear_policy_loss(
        hidden_states, vocab_weights, _token_ids(input_ids, "input_ids"), old_log_prob.detach(), advantages,
        response_mask, temperature=temperature, clip_low=low, clip_high=high, dual_clip=dual,
        ratio="token" if loss_mode == "vanilla" else "sequence", agg=agg, norm_length=norm)
    return loss * factor, metrics


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_is_weights=None):
    """verl's ``gspo`` loss via ``rlkernels.policy_loss(ratio="sequence")``.

    verl's token-level straight-through ratio ``sg[s_i]·π_t/sg[π_t]`` has, for every agg mode
    (their per-token weights are constant within a sequence), the same value and gradient as
    differentiating the sequence ratio ``s_i`` itself. Not reproduced: verl's clamp of the
    sequence log-ratio at 10 (a sequence whose mean log-ratio exceeds 10).
    """
    if config is None:
        raise ValueError("compute_policy_loss_gspo needs verl's actor config (clip_ratio, ...)")
    _refuse_rollout_weights(rollout_is_weights, "rlkernels_gspo")
    low, high = _clip_range(config)
    old = old_log_prob.detach()
    agg, norm, factor = _agg_plan(response_mask, loss_agg_mode, **_batch_info(config))
    loss, _ = rlkernels.policy_loss(log_prob, old, advantages, response_mask, clip_low=low, clip_high=high,
                                    ratio="sequence", agg=agg, norm_length=norm)
    with torch.no_grad():
        m = response_mask.to(torch.float32)
        d = (log_prob - old).float()
        dm = torch.where(m != 0, d * m, 0.0)  # [B, T]: a masked-out NaN/inf stays out of its sequence's ratio
        s = torch.exp((dm.sum(-1) / m.sum(-1).clamp(min=1.0)).clamp(max=10.0)).unsqueeze(-1)  # [B, 1]
        adv = advantages.float()
        pg1, pg2 = -adv * s, -adv * s.clamp(1 - low, 1 + high)
        metrics = {  # as the vanilla loss's
            "actor/pg_clipfrac": masked_mean((pg2 > pg1).float(), m).item(),
            "actor/ppo_kl": masked_mean(-d, m).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss * factor, metrics


def kl_penalty(logprob, ref_logprob, kl_penalty):
    """verl's ``core_algos.kl_penalty`` (same names and clamps) via ``rlkernels.kl_penalty``."""
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    names = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
    if base not in names:
        raise NotImplementedError(f"kl_penalty={kl_penalty!r} (rlkernels supports {sorted(names)}, optionally with '+')")
    est = names[base]
    forward = rlkernels.kl_penalty(logprob, ref_logprob, est)
    if est == "k3":
        forward = forward.clamp(min=-10.0, max=10.0)  # verl's clamp for numerical stability (and its zero gradient)
    if not straight_through or est == "k2":
        return forward
    backward = rlkernels.kl_penalty(logprob, ref_logprob, "k2")
    return backward - backward.detach() + forward.detach()


# ---------------------------------------------------------------- advantage estimators


def _group_ids(index, device):
    import numpy as np

    _, inverse = np.unique(np.asarray(index), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                   norm_adv_by_std_in_grpo: bool | None = None, config=None, **kwargs):
    """verl's GRPO outcome advantage (``norm_adv_by_std_in_grpo=False``: Dr. GRPO) via ``rlkernels.group_advantages``.

    As verl: a group of one keeps ``score / (1 + eps)`` (``score`` without std normalization). Unlike verl, a
    group whose scores are all equal gets exactly 0 (verl divides its rounding residue by ``eps``).
    """
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(_cfg(config, "norm_adv_by_std_in_grpo", True))
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        ids = _group_ids(index, scores.device)  # [B]
        mode = "grpo" if norm_adv_by_std_in_grpo else "dr_grpo"
        adv = rlkernels.group_advantages(scores, index=ids, mode=mode, eps=epsilon).to(scores.dtype)  # [B]
        single = torch.bincount(ids)[ids] == 1  # [B]
        alone = scores / (1.0 + epsilon) if norm_adv_by_std_in_grpo else scores
        adv = torch.where(single, alone, adv)
        adv = adv.unsqueeze(-1) * response_mask  # [B, T]
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6, config=None,
                                   **kwargs):
    """verl's RLOO outcome advantage via ``rlkernels.group_advantages(mode="rloo")``; a group of one keeps its score."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        ids = _group_ids(index, scores.device)
        adv = rlkernels.group_advantages(scores, index=ids, mode="rloo").to(scores.dtype)
        single = torch.bincount(ids)[ids] == 1
        adv = torch.where(single, scores, adv)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl's ``compute_gae_advantage_return`` (same signature; advantages whitened over the mask) via ``rlkernels.gae``.

    Only positions with ``response_mask = 1`` are specified (verl's loss never reads the others).
    Not registered: verl's trainer calls GAE directly, with the critic's values, not through the registry.
    """
    with torch.no_grad():
        adv, returns = rlkernels.gae(token_level_rewards, values, response_mask, gamma=float(gamma), lam=float(lam))
        adv = rlkernels.masked_whiten(adv, response_mask)
    return adv.to(values.dtype), returns.to(values.dtype)


# ---------------------------------------------------------------- log-probs (+ entropy) without logits


def _token_ids(ids, name: str) -> torch.Tensor:
    """Integer token ids as int64; float ids are refused naming ``name`` (``.to(int64)`` truncated 3.7 to 3)."""
    return _checks.integer(ids, name).to(torch.int64)


def logprobs_from_logits(logits, labels, inplace_backward=True):
    """``verl.utils.torch_functional.logprobs_from_logits`` (same signature) via ``rlkernels.logprobs``.

    ``inplace_backward`` is accepted for signature compatibility; rlkernels' backward never keeps a
    second ``[N, V]`` buffer anyway.
    """
    return rlkernels.logprobs(logits, labels)


class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for ``verl.utils.experimental.torch_functional.FusedLinearForPPO``.

    ``forward(hidden_states [B, T, H] or [N, H], vocab_weights [V, H], input_ids, temperature)``
    returns ``(log_probs, entropy)`` (float32) via ``rlkernels.linear_logprobs``; no ``[N, V]`` tensor.
    ``chunk_size``/``impl_backend`` are accepted for compatibility: rlkernels picks its own tiling.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        if hidden_states.ndim not in (2, 3):
            raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
        if input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape "
                             f"{tuple(hidden_states.shape[:-1])}")
        return rlkernels.linear_logprobs(hidden_states, vocab_weights, _token_ids(input_ids, "input_ids"),
                                         temperature=temperature, return_entropy=True)


# ---------------------------------------------------------------- tensor parallelism (verl's Megatron backend)


def _megatron_vocab_start(V_local: int, process_group, vocab_start):
    """Megatron's layout (``VocabUtility``): rank ``r`` of the tensor-parallel group holds ``[r·V_r, (r+1)·V_r)``
    (its vocabulary padded to a multiple of the group size), unless ``vocab_start`` says otherwise."""
    import torch.distributed as dist

    if process_group is None:
        raise ValueError("process_group is required: the tensor-parallel group "
                         "(megatron.core.parallel_state.get_tensor_model_parallel_group())")
    _checks.process_group(process_group)  # before dist.get_rank reads it (its errors name no argument)
    return dist.get_rank(process_group) * V_local if vocab_start is None else vocab_start


def vocab_parallel_log_probs_from_logits(logits, labels, *, process_group, vocab_start=None):
    """``verl.utils.megatron.tensor_parallel.vocab_parallel_log_probs_from_logits`` (log p of ``labels`` from this
    tensor-parallel rank's logits ``[..., V/TP]``; verl's Megatron actor calls it in its ``logits_processor``) via
    :func:`rlkernels.vocab_parallel.logprobs_from_logits`. ``process_group``: the tensor-parallel group;
    ``vocab_start``: the global id of this rank's first column (default: Megatron's equal slices in rank order).
    Returns float32 ``[...]`` (verl's returns the logits' dtype)."""
    from rlkernels import vocab_parallel

    start = _megatron_vocab_start(logits.shape[-1], process_group, vocab_start)
    return vocab_parallel.logprobs_from_logits(logits, labels, process_group=process_group, vocab_start=start)


def vocab_parallel_entropy(vocab_parallel_logits, *, process_group, vocab_start=None):
    """``verl.utils.megatron.tensor_parallel.vocab_parallel_entropy`` (the softmax's entropy from this rank's
    logits ``[..., V/TP]``) via :func:`rlkernels.vocab_parallel.logprobs_from_logits`; float32 ``[...]``."""
    from rlkernels import vocab_parallel

    start = _megatron_vocab_start(vocab_parallel_logits.shape[-1], process_group, vocab_start)
    return vocab_parallel.logprobs_from_logits(vocab_parallel_logits, None, process_group=process_group,
                                               vocab_start=start)


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None, *,
                         vocab_start=None, impl_backend=None):
    """``verl.utils.kernel.linear_cross_entropy`` (verl's fused-kernel path for Megatron: hidden states and the
    output layer's weight, without ``[N, V]`` logits): returns ``(log_probs, entropy)`` (float32, shaped like
    ``labels``) via :func:`rlkernels.linear_logprobs`. With ``dist_process_group`` (the tensor-parallel group)
    ``weight`` is this rank's vocabulary slice ``[V/TP, H]`` (``vocab_start`` as in
    :func:`vocab_parallel_log_probs_from_logits`). Only ``reduction="none"`` (what verl's actor uses);
    ``impl_backend`` is accepted for compatibility (rlkernels picks its backend)."""
    if reduction != "none":
        raise ValueError(f"reduction must be 'none' (per-token log-probs and entropy), got {reduction!r}")
    kw = {}
    if dist_process_group is not None:
        kw = dict(process_group=dist_process_group,
                  vocab_start=_megatron_vocab_start(weight.shape[0], dist_process_group, vocab_start))
    return rlkernels.linear_logprobs(hidden, weight, _token_ids(labels, "labels"), temperature=float(temperature),
                                     return_entropy=True, **kw)


# ---------------------------------------------------------------- registration

POLICY_LOSSES = {"rlkernels_vanilla": compute_policy_loss_vanilla, "rlkernels_gspo": compute_policy_loss_gspo}
ADV_ESTIMATORS = {"rlkernels_grpo": compute_grpo_outcome_advantage, "rlkernels_rloo": compute_rloo_outcome_advantage}


def register(*, patch_fused_kernels: bool = False, core_algos: Any = None) -> dict[str, list[str]]:
    """Register rlkernels' policy losses and advantage estimators with verl's registries.

    Uses ``verl.trainer.ppo.core_algos.register_policy_loss`` / ``register_adv_est`` (or the module
    passed as ``core_algos``). Idempotent. With ``patch_fused_kernels=True`` it also replaces verl's
    ``FusedLinearForPPO`` (its fused-kernel backend, ``use_fused_kernels=True``) and
    ``logprobs_from_logits`` with the rlkernels ones, also in the verl modules already imported that bound verl's
    function by name (``rebound``: e.g. ``verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits``); modules
    imported later read the patched one. Returns the registered names.
    """
    if core_algos is None:
        try:
            from verl.trainer.ppo import core_algos
        except ImportError as exc:
            raise ImportError("rlkernels.integrations.verl.register() needs verl installed (pip install verl)") from exc
    for attr in ("register_policy_loss", "register_adv_est"):
        if not callable(getattr(core_algos, attr, None)):
            raise ImportError(f"this verl's core_algos has no {attr}(); rlkernels needs verl >= 0.5")
    for name, fn in POLICY_LOSSES.items():
        core_algos.register_policy_loss(name)(fn)
    for name, fn in ADV_ESTIMATORS.items():
        core_algos.register_adv_est(name)(fn)  # verl refuses a *different* fn under a taken name
    patched, rebound = [], []
    if patch_fused_kernels:
        exp = sys.modules.get("verl.utils.experimental.torch_functional")
        if exp is None:
            import verl.utils.experimental.torch_functional as exp
        import verl.utils.torch_functional as verl_F

        originals = {"FusedLinearForPPO": (exp.FusedLinearForPPO, FusedLinearForPPO),
                     "logprobs_from_logits": (verl_F.logprobs_from_logits, logprobs_from_logits)}
        exp.FusedLinearForPPO = FusedLinearForPPO
        verl_F.logprobs_from_logits = logprobs_from_logits
        patched = ["verl.utils.experimental.torch_functional.FusedLinearForPPO",
                   "verl.utils.torch_functional.logprobs_from_logits"]
        # verl's engines and rollouts bind `from verl.utils.torch_functional import logprobs_from_logits` when
        # imported: rebind the name in every verl module already imported that holds verl's own function
        for mod_name, module in list(sys.modules.items()):
            if module is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
                continue
            for attr, (original, ours) in originals.items():
                if original is not ours and getattr(module, attr, None) is original:
                    setattr(module, attr, ours)
                    rebound.append(f"{mod_name}.{attr}")
    return {"policy_loss": list(POLICY_LOSSES), "adv_estimator": list(ADV_ESTIMATORS), "patched": patched,
            "rebound": rebound}
