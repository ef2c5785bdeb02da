"""Issue 15's trainer knobs as small functions: dropout off, reference updates, the KL in the rewards,
score normalisation, the ratio-outside metric, KL early stop, the critic from the reward model, activation
checkpointing.

Each is a pure function (or a small state object) the loop calls; see the fields of the same names in
:class:`trainer.config.TrainConfig` for the options and README's trainer section for the conventions.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

# config / module attribute names that hold a dropout probability in transformers models
_DROPOUT_NAME = re.compile(r"(dropout|pdrop)(_prob|_rate|_p)?$|^dropout_\w+$|layerdrop$")
# module attributes of MoE routers that scale their input by uniform noise in train mode only (Mixtral, MiniMax,
# Switch: jitter_noise; PhiMoE: input_jitter_noise; DBRX: moe_jitter_eps); PhiMoE's router_jitter_noise is a
# threshold used in eval too, so it is left alone
_JITTER_NAME = re.compile(r"^(input_)?jitter_noise$|^moe_jitter_eps$")


def enable_gradient_checkpointing(policy: nn.Module, critic: nn.Module | None = None) -> None:
    """Turn on transformers' activation checkpointing (``activation_checkpointing_enable``, formerly
    ``gradient_checkpointing_enable``; non-reentrant ``torch.utils.checkpoint``: no input needs
    ``requires_grad``) in ``policy`` and in ``critic``'s backbone. It acts in train mode only, so generation and
    the eval-mode passes run as before. ConfigError naming ``gradient_checkpointing`` for a model that does not
    support it."""
    from .config import ConfigError

    for name, model in (("policy", policy), ("critic", getattr(critic, "backbone", critic))):
        if model is None:
            continue
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"gradient_checkpointing: the {name} ({type(model).__name__}) does not support "
                              f"transformers' gradient checkpointing")
        non_reentrant = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.22 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability of ``model`` to 0, in place; returns ``model``.

    ``nn.Dropout`` (and its siblings) get ``p = 0``; float attributes named like a dropout probability
    (``attention_dropout``, ``hidden_dropout``, ``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``,
    ``hidden_dropout_prob``, ...) on ``model.config`` and on every submodule (attention layers copy
    ``config.attention_dropout`` at init and pass it to the attention kernel in train mode) become 0.0, and so
    does an MoE router's train-mode input jitter (``jitter_noise``, ``input_jitter_noise``, ``moe_jitter_eps``).
    Train mode stays as it is: nothing else in these models differs between train and eval (except PhiMoE's
    sparsemixer routing, which samples in train mode).
    """
    configs = []
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and not isinstance(value, bool) and _DROPOUT_NAME.search(name):
                setattr(module, name, 0.0)
            elif isinstance(value, float) and _JITTER_NAME.search(name):  # MoE router noise, train mode only
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and all(config is not c for c in configs):
            configs.append(config)
    for config in configs:
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and _DROPOUT_NAME.search(name):
                setattr(config, name, 0.0)
    return model


@torch.no_grad()
def mix_into(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """``target <- alpha * source + (1 - alpha) * target`` for every parameter and floating buffer
    (``alpha = 1`` copies exactly). Both modules must have the same state-dict names and shapes. A tensor listed
    under several names (a head tied to the embeddings) is mixed once."""
    src = source.state_dict()
    seen = set()
    for name, t in target.state_dict(keep_vars=True).items():
        if id(t) in seen:  # tied weights: mixing again would give (1 - alpha)^2 of the old reference
            continue
        seen.add(id(t))
        t, s = t.detach(), src[name]
        if not t.is_floating_point():
            t.copy_(s)
        elif alpha == 1.0:
            t.copy_(s)
        else:
            t.mul_(1.0 - alpha).add_(s.to(t.dtype), alpha=alpha)


def update_reference(ref_model: nn.Module, policy_model: nn.Module, step: int, every: int, alpha: float) -> str:
    """After ``step``: copy the policy into the reference when ``every`` divides it (``every > 0``), else mix
    with ``alpha`` when ``alpha > 0``. Returns what was done: 'copy', 'mix' or ''."""
    if every and step % every == 0:
        mix_into(ref_model, policy_model, 1.0)
        return "copy"
    if alpha > 0:
        mix_into(ref_model, policy_model, alpha)
        return "mix"
    return ""


def kl_reward_to_go(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_{t' >= t} kl_t'`` over each row's masked tokens: ``[B, R]`` (0 at masked-out positions)."""
    k = torch.where(mask.bool(), kl, 0.0)  # [B, R]
    return torch.where(mask.bool(), k.flip(-1).cumsum(-1).flip(-1), 0.0)  # [B, R]


def grpo_token_advantages(group_adv: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """GRPO with the KL in the per-token reward: ``A_t = group_adv - kl_coef * Σ_{t' >= t} kl_t'``.

    The per-token rewards are ``-kl_coef * kl_t`` plus the score on the last token; with gamma 1 and no critic the
    return from token t is ``score - kl_coef * Σ_{t' >= t} kl_t'``, and GRPO's baseline replaces the score by its
    group advantage ``group_adv`` [B]. ``kl`` [B, R] (no gradient), ``mask`` [B, R]; returns [B, R]."""
    return group_adv.unsqueeze(-1) - kl_coef * kl_reward_to_go(kl, mask)  # [B, R]


class ScoreNormalizer:
    """``reward_norm`` and ``reward_clip`` on the scores of each step.

    ``mode`` 'none' | 'batch' | 'running'. 'running' keeps the count, mean and sum of squared deviations of every
    score seen (Welford, float64), updated with a step's scores before they are normalised. The normalised score is
    ``(s - mean) / sqrt(var + eps)`` (``shift=False``: ``s / sqrt(var + eps)``), ``var`` unbiased; with fewer than 2
    scores seen the divisor is 1. Then, with ``clip``, clamped to ``[-clip, clip]``.
    """

    def __init__(self, mode: str = "none", shift: bool = True, clip: float | None = None, eps: float = 1e-8):
        self.mode, self.shift, self.clip, self.eps = mode, shift, clip, eps
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def active(self) -> bool:
        return self.mode != "none" or self.clip is not None

    def update(self, scores: torch.Tensor) -> None:
        """Welford's update with every score of ``scores`` [N] (batched: Chan et al.'s parallel merge)."""
        x = scores.detach().double().flatten()  # [N]
        n = x.numel()
        if n == 0:
            return
        b_mean = float(x.mean())
        b_m2 = float((x - b_mean).square().sum())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def __call__(self, scores: torch.Tensor, all_scores: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised (and clipped) ``scores`` [N]; ``all_scores`` [M] are the step's scores over every process
        (the statistics' input; default ``scores``). 'running' updates the statistics first."""
        s = scores.double()  # [N]
        pool = (scores if all_scores is None else all_scores).detach().double()  # [M]
        if self.mode == "running":
            self.update(pool)
            count, mean, m2 = self.count, self.mean, self.m2
        elif self.mode == "batch":
            count, mean = pool.numel(), float(pool.mean())
            m2 = float((pool - mean).square().sum())
        else:
            count, mean, m2 = 0, 0.0, 0.0
        if self.mode != "none":
            scale = math.sqrt(m2 / (count - 1) + self.eps) if count >= 2 else 1.0
            s = ((s - mean) if self.shift else s) / scale
        if self.clip is not None:
            s = s.clamp(-self.clip, self.clip)
        return s.to(scores.dtype)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def ratio_outside(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, ratio: str, clip_low: float,
                  clip_high: float) -> float:
    """Share of masked tokens whose importance ratio lies outside ``[1 - clip_low, 1 + clip_high]``, whatever the
    advantage's sign (``policy/clipfrac`` counts only those where the clip is active). ``ratio`` 'token' or
    'sequence' (GSPO: each token carries its sequence's ratio). ``logp``, ``old_logp``, ``mask``: [B, R]."""
    keep = mask.bool()  # [B, R]
    m = keep.double()  # [B, R]
    log_r = torch.where(keep, logp.detach().double() - old_logp.detach().double(), 0.0)  # [B, R]
    if ratio == "sequence":
        log_r = ((log_r * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(log_r)  # [B, R]
    r = torch.exp(log_r)  # [B, R]
    outside = (r < 1.0 - clip_low) | (r > 1.0 + clip_high)  # [B, R]
    return float((outside & keep).double().sum() / m.sum().clamp(min=1.0))


def should_stop_early(approx_kl: float, target_kl: float | None) -> bool:
    """KL early stop: the update stops once a minibatch's approx KL to the old policy exceeds 1.5 * target_kl."""
    return target_kl is not None and approx_kl > 1.5 * target_kl


def critic_from_reward_model(path: str, critic_cls, dtype: torch.dtype, vocab_size: int):
    """A ``critic_cls(backbone, hidden)`` holding the full weights of the sequence-classification reward model at
    ``path``: its backbone, and its score head's row 0 (the reward logit) as the value head (bias 0 when the head
    has none). Raises :class:`ConfigError` naming ``critic_init`` when its vocabulary is not the policy's."""
    from transformers import AutoModelForSequenceClassification

    from .config import ConfigError

    from .models import load_weights

    rm = load_weights("critic_init", path, AutoModelForSequenceClassification.from_pretrained, path, dtype=dtype)
    if rm.config.vocab_size != vocab_size:
        raise ConfigError(f"critic_init: the reward model at {path!r} has vocabulary {rm.config.vocab_size}, the policy "
                         f"{vocab_size}; the critic reads the policy's token ids")
    head = next((getattr(rm, n) for n in ("score", "classifier", "v_head") if isinstance(getattr(rm, n, None), nn.Linear)),
                None)
    if head is None:
        raise ConfigError(f"critic_init: the reward model at {path!r} has no linear score head (score/classifier)")
    backbone = rm.base_model
    critic = critic_cls(backbone, rm.config.hidden_size)
    with torch.no_grad():
        critic.value_head.weight.copy_(head.weight[:1].float())  # [1, H]
        critic.value_head.bias.copy_(head.bias[:1].float() if head.bias is not None else torch.zeros(1))
    return critic
