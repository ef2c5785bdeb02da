"""TRL adapter: GRPO whose loss comes from ``rlkernels.linear_logprobs`` + ``rlkernels.policy_loss``.

Two ways in::

    from rlkernels.integrations.trl import RLKernelsGRPOTrainer
    trainer = RLKernelsGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), ...)

    # or, on a trainer that already exists (any GRPOTrainer subclass):
    from rlkernels.integrations.trl import apply_rlkernels
    apply_rlkernels(trainer)

What changes: the policy's (and the reference model's) per-token log-probabilities and
entropies are computed by ``rlkernels.linear_logprobs`` straight from the backbone's last
hidden states and the LM head weight, so the ``[batch, completion, vocab]`` logits are never
built; the clipped surrogate, the two-sided clip (``delta``) and the KL term go through
``rlkernels.policy_loss`` / ``rlkernels.kl_penalty``. Everything else (generation, rewards,
advantages, logging, the optimizer) is TRL's own code.

Where the loss is a plain clipped surrogate (no ``use_bias_correction_kl`` with ``beta`` != 0, no
entropy bonus, no multimodal inputs), the policy's loss runs as ONE op from the hidden states:
``rlkernels.linear_policy_loss`` (three GEMMs, the head's gradient formed in the forward), with
``old_logp=None`` when TRL has no old log-probs (on-policy). The others (whose extra loss terms need
the log-probs' own gradient) run ``linear_logprobs`` then ``policy_loss``. Both give the same loss.

The loss reproduces TRL's ``GRPOTrainer._compute_loss`` (TRL 1.x) for ``loss_type`` in
``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, with ``epsilon``/``epsilon_high``, ``delta``,
``beta`` (TRL's k3 estimator, with or without ``use_bias_correction_kl``),
``importance_sampling_level`` token/sequence, ``temperature``, ``max_completion_length``,
``mask_truncated_completions``, tool masks and a static ``entropy_coef``; it logs the same
metric names. Options it cannot reproduce are refused when the trainer is built
(:class:`UnsupportedGRPOOption`), never silently ignored.
"""
from __future__ import annotations

import functools
import types

import torch

import rlkernels
from rlkernels import _checks, hf, reference

try:
    from trl import GRPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rlkernels.integrations.trl needs TRL: pip install 'rlkernels[trl]' (or pip install trl)"
    ) from exc

__all__ = ["RLKernelsGRPOTrainer", "RLKernelsGRPOMixin", "UnsupportedGRPOOption", "apply_rlkernels", "check_supported"]

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# TRL's loss_type -> rlkernels agg mode (the remaining rescaling to TRL's exact normalizer is in _scale)
_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm", "dapo": "token-mean"}


class UnsupportedGRPOOption(ValueError):
    """A GRPOConfig option (or model feature) the rlkernels loss cannot reproduce exactly."""


# ---------------------------------------------------------------- validation


def check_supported(args, model=None, ref_model=None, *, aux_loss_enabled: bool = False) -> None:
    """Raise :class:`UnsupportedGRPOOption` naming every option the fused loss cannot honour.

    Args:
        args: the trainer's ``GRPOConfig`` (``loss_type``, the clip ranges, ``delta`` and the refused options).
        model, ref_model: the policy and the reference model, or None to skip them: a head that soft-caps or
            scales its logits is refused, naming the config field (:func:`rlkernels.hf.lm_head`).
        aux_loss_enabled: the model adds a Mixture-of-Experts router auxiliary loss, which is refused.
    """
    problems = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        problems.append(
            f"loss_type={args.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)}; "
            "cispo/sapo/luspo/vespo are not clipped-surrogate losses that rlkernels.policy_loss computes)"
        )
    for name in ("epsilon", "epsilon_high"):  # rlkernels.policy_loss would refuse them at the first step, as clip_low
        value = getattr(args, name, None)
        if value is not None and not 0.0 <= value < float("inf"):  # NaN fails too
            problems.append(f"{name}={value} (a clip range must be a finite number >= 0)")
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.delta is not None and not args.delta > 1.0 + eps_high:
        # Only for delta > 1 + epsilon_high is TRL's `clamp(ratio, max=delta)` the dual clip of negative advantages;
        # below that it also cuts positive-advantage tokens, which policy_loss has no form for.
        problems.append(f"delta={args.delta} must be > 1 + epsilon_high = {1.0 + eps_high} (TRL recommends it)")
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        problems.append(f"top_entropy_quantile={args.top_entropy_quantile} (the high-entropy token mask)")
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        problems.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} (off-policy sequence masking)")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        problems.append(
            "use_vllm=True with vllm_importance_sampling_correction=True (set it to False to use rlkernels with vLLM)"
        )
    if getattr(args, "use_adaptive_entropy", False):
        problems.append("use_adaptive_entropy=True (a static entropy_coef is supported)")
    if aux_loss_enabled:
        problems.append("a Mixture-of-Experts router auxiliary loss (router_aux_loss_coef != 0)")
    for name, m in (("model", model), ("ref_model", ref_model)):
        if m is None:
            continue
        problem = _head_problem(m)
        if problem:
            problems.append(f"{name}: {problem}")
    if problems:
        raise UnsupportedGRPOOption(
            "rlkernels' GRPO loss cannot honour these settings (use trl.GRPOTrainer for them):\n  - "
            + "\n  - ".join(problems)
        )


def _head_problem(model) -> str | None:
    """Why ``rlkernels.hf.lm_head`` refuses the model's head (soft-capped or scaled logits, naming the config
    field), or None: the check lives in rlkernels.hf, shared with the bundled trainer."""
    try:
        hf.lm_head(model)
    except (NotImplementedError, TypeError) as error:
        return str(error)
    return None


# ---------------------------------------------------------------- the LM head


def add_rlkernels_lm_head(model, *, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                          entropy: bool = True) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` (TRL's call) use ``rlkernels.linear_logprobs``.

    Wraps whatever forward the model has now (TRL's own fused head, installed by GRPOTrainer): calls without
    ``fused_lm_head=True`` (generation) go to it unchanged. With it, the backbone runs, and only the positions
    whose next-token label is not -100 are scored, from the last hidden states and the LM head weight, by
    ``rlkernels.hf.label_logprobs`` (the path ``hf.response_logprobs`` and the bundled trainer take). With
    ``cast_lm_head_to_fp32`` the head is applied in float32.
    """
    model = hf.causal_lm(model)
    problem = _head_problem(model)
    if problem:
        raise UnsupportedGRPOOption(f"rlkernels' LM head cannot reproduce {problem}")
    temperature = _checks.temperature(temperature)  # now, naming it, not at the first training forward
    cast_lm_head_to_fp32 = _checks.flag(cast_lm_head_to_fp32, "cast_lm_head_to_fp32")
    entropy = _checks.flag(entropy, "entropy")
    inner_forward = model.forward
    head_dtype = torch.float32 if cast_lm_head_to_fp32 else None

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def _rlkernels_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                           num_items_in_batch=None, rlkernels_policy_loss=None, **kwargs):
        if not fused_lm_head:
            for key, value in (("labels", labels), ("shift_labels", shift_labels),
                               ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[key] = value
            return inner_forward(*args, **kwargs)
        if labels is None and shift_labels is None:  # the fused head scores labels; it returns no logits
            raise ValueError("fused_lm_head=True needs labels (or shift_labels): the positions to score")
        hidden = hf.final_hidden(hf.backbone(self), *args, **kwargs)  # [B, L, H]
        if rlkernels_policy_loss is not None:  # the loss itself, from the hidden states (_fused_policy_loss)
            return _head_policy_loss(self, hidden, labels, rlkernels_policy_loss, temperature, head_dtype)
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]  # [B, L-1, H], [B, L-1]: t-1 predicts token t
        else:
            labels = shift_labels  # [B, L] already aligned with the hidden states (context parallelism)
        out = hf.label_logprobs(self, hidden, labels, temperature=temperature, return_entropy=entropy,
                                dtype=head_dtype)  # [B, L-1] (x2)
        log_probs, ent = out if entropy else (out, None)
        mask = labels.to(log_probs.device) != -100  # [B, L-1]
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=ent, label_mask=mask)

    _rlkernels_forward._rlkernels_options = (temperature, cast_lm_head_to_fp32, entropy)
    model.forward = types.MethodType(_rlkernels_forward, model)
    model._rlkernels_lm_head = True


def _has_rlkernels_head(model, options) -> bool:
    """Whether ``model.forward`` is (on top) an rlkernels head installed with ``options``: a later GRPOTrainer on the
    same model wraps TRL's head over it (its fused calls never reach ours), so the flag alone does not say."""
    forward = getattr(model, "forward", None)
    return getattr(getattr(forward, "__func__", None), "_rlkernels_options", None) == options


def _head_policy_loss(model, hidden, labels, spec: dict, temperature: float, head_dtype):
    """``rlkernels.linear_policy_loss`` on the last ``T`` predicting positions: ``hidden`` ``[B, L, H]``, ``labels``
    ``[B, T]`` the completion tokens (-100 at padding), ``spec`` the op's per-token tensors and options. Returns
    a ``FusedCausalLMOutput`` whose ``loss`` is the policy loss, ``log_probs``/``entropy`` ``[B, T]`` detached."""
    T = labels.shape[1]
    weight, bias = hf.lm_head(model)  # [V, H], [V] or None
    dtype = weight.dtype if head_dtype is None else head_dtype
    h = hidden[:, -T - 1:-1].to(weight.device).to(dtype)  # [B, T, H]: position t-1 predicts token t
    b = None if bias is None else bias.to(dtype)  # [V] or None
    loss, metrics = rlkernels.linear_policy_loss(h, weight.to(dtype), labels.to(weight.device), bias=b,
                                                 temperature=temperature, return_entropy=True, **spec)
    mask = labels != -100  # [B, T]
    return FusedCausalLMOutput(loss=loss, log_probs=metrics["token_logp"], entropy=metrics["token_entropy"],
                               label_mask=mask)


# ---------------------------------------------------------------- the loss


class RLKernelsGRPOMixin:
    """Replaces ``GRPOTrainer._compute_loss``; mix in before ``GRPOTrainer`` (or any subclass of it)."""

    def _rlkernels_install(self) -> None:
        check_supported(self.args, self.model, self.ref_model, aux_loss_enabled=self.aux_loss_enabled)
        for m, ent in ((self.model, True), (self.ref_model, False)):
            options = (_checks.temperature(self.temperature),
                       _checks.flag(self.args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32"), ent)
            if m is not None and not _has_rlkernels_head(hf.causal_lm(m), options):
                add_rlkernels_lm_head(m, temperature=self.temperature,
                                      cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32, entropy=ent)

    def _rlkernels_aggregate(self, x, mask, mode, inputs):
        """TRL's normalization of per-token ``x`` [B, T] for this loss_type (eager; used for the IS-corrected KL),
        through rlkernels' one definition of the agg modes (``reference.aggregate``)."""
        norm_length = self.max_completion_length if self.loss_type == "dr_grpo" else None
        loss = reference.aggregate(x, mask, _AGG[self.loss_type], norm_length)
        if self.loss_type == "grpo":  # TRL's sequence mean counts the sequences with no token too
            return loss * (mask.sum(-1) > 0).sum() / max(x.size(0), 1)
        if self.loss_type == "dapo":  # a token sum: divided by its normalizer in _compute_loss
            return loss * mask.sum().clamp(min=1.0)
        return loss

    def _rlkernels_fused_head(self, inputs, extra) -> bool:
        """Whether the policy loss runs as one ``linear_policy_loss`` from the hidden states: not with the
        IS-corrected KL or TRL's entropy bonus (extra terms on the log-probs and entropies, which need their
        gradient), nor with multimodal inputs (TRL's helper slices those per sub-batch)."""
        bias_corrected = self.beta != 0.0 and self.args.use_bias_correction_kl
        return not bias_corrected and not self._entropy_bonus_enabled and all(v is None for v in extra.values())

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]  # [B, T]

        extra = {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                                            "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                                            "mm_token_type_ids", "image_position_ids")}
        advantages = inputs["advantages"]
        old_in = inputs.get("old_per_token_logps")  # [B, T] or None (on-policy)
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        m = mask.to(torch.float32)
        ratio_level = self.importance_sampling_level
        if ratio_level not in ("token", "sequence"):
            raise ValueError(f"Unknown importance sampling level: {ratio_level}. Possible values are 'token' and 'sequence'.")

        bias_corrected = self.beta != 0.0 and self.args.use_bias_correction_kl
        ref = inputs["ref_per_token_logps"] if self.beta != 0.0 else None
        options = dict(
            clip_low=self.epsilon_low, clip_high=self.epsilon_high, dual_clip=self.args.delta, ratio=ratio_level,
            ref_logp=None if bias_corrected else ref, kl_coef=0.0 if bias_corrected else self.beta,
            kl_estimator="k3", agg=_AGG[self.loss_type],
            norm_length=self.max_completion_length if self.loss_type == "dr_grpo" else None,
        )
        if self._rlkernels_fused_head(inputs, extra):
            # one op from the hidden states, called through the model (a DDP wrapper sees the forward)
            labels = completion_ids.masked_fill(completion_mask == 0, -100)  # [B, T]
            spec = dict(old_logp=old_in, advantages=advantages, mask=mask, **options)
            with self.accelerator.autocast():
                out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                            rlkernels_policy_loss=spec)
            loss, logp, entropies = out.loss, out.log_probs, out.entropy  # [], [B, T] x2 (detached)
        else:
            # TRL's own helper: it calls model(..., fused_lm_head=True), which the patch routes to linear_logprobs
            logp, entropies, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=True, **extra
            )  # [B, T], [B, T]
            old = logp.detach() if old_in is None else old_in  # [B, T]
            # entropy rides along with coef 0 (TRL's bonus is a separate token mean, added below)
            loss, _ = rlkernels.policy_loss(logp, old, advantages, mask, entropy=entropies, entropy_coef=0.0,
                                            **options)
        old = logp.detach() if old_in is None else old_in  # [B, T]

        # Ratios [B, T] or [B, 1], cheap; for the IS-corrected KL and the clip metrics TRL logs.
        log_ratio = logp - old
        if ratio_level == "token":
            coef_1 = torch.exp(log_ratio)
        else:
            coef_1 = torch.exp((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
        per_token_kl = None
        if ref is not None:
            per_token_kl = rlkernels.kl_penalty(logp, ref, "k3")  # [B, T]
            if bias_corrected:
                per_token_kl = per_token_kl * coef_1

        # From rlkernels' agg mode to TRL's exact normalization.
        if self.loss_type == "grpo":
            # TRL averages over all B sequences (an empty one counts as 0); seq-mean-token-mean over the non-empty.
            nonempty = (m.sum(-1) > 0).sum()
            loss = loss * nonempty / m.size(0)
        if bias_corrected:
            loss = loss + self.beta * self._rlkernels_aggregate(per_token_kl, m, mode, inputs) * (
                1.0 / m.sum().clamp(min=1.0) if self.loss_type == "dapo" else 1.0
            )
        if self.loss_type == "dapo":
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = loss * m.sum().clamp(min=1.0) / normalizer  # token-mean -> token-sum / TRL's normalizer
            policy_loss = loss.detach()
        else:
            policy_loss = loss.detach()
            loss = loss / accum

        if self._entropy_bonus_enabled:  # TRL: a token mean, scaled only for gradient accumulation
            entropy_loss = (entropies * m).sum() / m.sum().clamp(min=1.0) / accum
            loss = loss - self.entropy_coef * entropy_loss
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

        self._rlkernels_log(mode, m, entropies, per_token_kl, coef_1, advantages)
        return loss

    def _rlkernels_log(self, mode, mask, entropies, per_token_kl, coef_1, advantages):
        """The metric names and formulas of TRL's GRPOTrainer._compute_loss."""
        from trl.trainer.utils import nanmax, nanmin

        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        coef_1 = coef_1.detach()
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)

        def masked_seq_mean(x):
            if x.shape[1] == 1:
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)

        def global_masked_mean(x):
            if x.shape[1] == 1:
                local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                local_sum, local_count = (x * mask).sum(), mask.sum().float()
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        with torch.no_grad():
            if per_token_kl is not None:
                self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl.detach()))
            self._metrics[mode]["entropy"].append(global_masked_mean(entropies.detach()))
            low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
            high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
            region = ((low > 0) | (high > 0)).float()
            self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(low))
            self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(high))
            self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(region))
            self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
            self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())


class RLKernelsGRPOTrainer(RLKernelsGRPOMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with the rlkernels LM head and loss; same constructor, same GRPOConfig."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rlkernels_install()


@functools.lru_cache(maxsize=None)
def _with_mixin(cls):
    return type(f"RLKernels{cls.__name__}", (RLKernelsGRPOMixin, cls), {"__module__": __name__})


def apply_rlkernels(trainer):
    """Switch an existing ``GRPOTrainer`` (or subclass) instance to the rlkernels LM head and loss, in place.

    Refuses (:class:`UnsupportedGRPOOption`) what it cannot honour, before changing anything. Returns the trainer.
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"apply_rlkernels expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    if isinstance(trainer, RLKernelsGRPOMixin):
        return trainer
    check_supported(trainer.args, trainer.model, trainer.ref_model, aux_loss_enabled=trainer.aux_loss_enabled)
    trainer.__class__ = _with_mixin(type(trainer))
    trainer._rlkernels_install()
    return trainer
