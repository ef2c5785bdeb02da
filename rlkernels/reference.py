"""The eager PyTorch formulas that define what every rlkernels op means.

Written the way a user would write them, materializing whatever they need.
Every function is dtype-generic: float64 inputs compute in float64 (that is
how the tests get the truth); any other float dtype computes in float32, as
the fused ops do. Shapes: ``B`` sequences, ``T`` tokens, ``V`` vocabulary,
``H`` hidden size, ``N`` sequences or tokens, ``...`` any leading shape.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
RATIO_MODES = ("token", "sequence")  # policy_loss: per-token ratio (PPO/GRPO) or per-sequence (GSPO)
GROUP_MODES = ("grpo", "dr_grpo", "rloo")
PROCESS_MODES = ("grpo", "dr_grpo")  # process_advantages: z-score of the group's step rewards, or mean-centred only


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (for the truth); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _up(x: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in the compute dtype of ``like`` (default ``x`` itself): a loss computes in its differentiable
    input's dtype, so float64 constants next to a float32/16-bit ``logp`` do not make a float64 result."""
    return x.to(compute_dtype(x if like is None else like))


# ---------------------------------------------------------------- log-probs


def logprobs(
    logits: torch.Tensor,  # [..., V]
    labels: torch.Tensor,  # [...] int
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """``log_softmax(logits / T)[labels]`` (and the entropy of that softmax); 0 where ``labels == ignore_index``.

    - Positions with ``labels == ignore_index`` give 0 in both outputs and exactly zero gradient, whatever
      their logits hold (NaN, ±inf).
    - A ``-inf`` logit is a token of probability 0: its ``p log p`` is 0 (never ``0 · -inf``), in the value
      and in the gradient.
    - A label outside ``[0, V)`` gives NaN for that position (outputs and its row's gradient), as the kernels
      do on a GPU, where nothing can raise; ``rlkernels.logprobs`` raises for it on the CPU.
    - Labels of any integer dtype; computes in float32 (float64 for float64 logits) under any autocast.
    """
    from rlkernels._backend import float32_compute

    with float32_compute(logits.device):
        labels = labels.long()  # [...]: gather reads int64; widening first keeps narrow dtypes' values
        valid = labels != ignore_index  # [...]
        in_range = (labels >= 0) & (labels < logits.shape[-1])  # [...]
        # an ignored position's logits are replaced before any arithmetic: nothing there reaches an output or a gradient
        z = torch.where(valid.unsqueeze(-1), _up(logits) / temperature, 0.0)  # [..., V]
        # a label out of range adds NaN to its row: NaN outputs and NaN gradients for that row only
        z = z + torch.where(valid & ~in_range, float("nan"), 0.0).unsqueeze(-1).to(z.dtype)  # [..., V]
        logp_all = torch.log_softmax(z, dim=-1)  # [..., V]
        safe = torch.where(valid & in_range, labels, 0)  # [...]
        logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # [...]
        logp = torch.where(valid, logp, 0.0)  # [...]
        if not return_entropy:
            return logp
        p = logp_all.exp()  # [..., V]
        # p log p = 0 where p = 0 (a -inf logit). Both wheres are needed: the inner one keeps -inf out of the
        # product, so its gradient is never 0 · -inf either. NaN compares != 0, so NaN propagates.
        nonzero = p != 0  # [..., V]
        p_log_p = torch.where(nonzero, p * torch.where(nonzero, logp_all, 0.0), 0.0)  # [..., V]
        entropy = torch.where(valid, -p_log_p.sum(-1), 0.0)  # [...]
        return logp, entropy


def linear_logprobs(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [...]
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """:func:`logprobs` of ``hidden @ weight.T + bias``, with the product accumulated in the compute dtype,
    or in float64 inside ``torch.autocast``: autocast would run the matmul in 16 bits, and the backward's two
    matmuls too when the backward runs inside it (turning autocast off around the forward does not reach them),
    while it leaves float64 alone."""
    dtype = compute_dtype(hidden)
    gemm = torch.float64 if torch.is_autocast_enabled(hidden.device.type) else dtype
    # an ignored token's row never meets the weight: its gradient is 0 even where its hidden state is NaN/inf
    # (a product with it would put 0 * NaN into d_weight)
    # (labels in int64: a narrow dtype's comparison wraps ignore_index, e.g. uint8 -100 == 156)
    h = torch.where((labels.long() == ignore_index)[..., None], torch.zeros((), dtype=gemm, device=hidden.device),
                    hidden.to(gemm))
    logits = h @ weight.to(gemm).T  # [..., V]
    if bias is not None:
        logits = logits + bias.to(gemm)  # [..., V]
    return logprobs(logits.to(dtype), labels, temperature=temperature, return_entropy=return_entropy,
                    ignore_index=ignore_index)


# ---------------------------------------------------------------- losses


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference (Schulman's k1/k2/k3, or |logp - ref|)."""
    logp, ref_logp = _up(logp), _up(ref_logp, like=logp)
    diff = logp - ref_logp  # [...]
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        # exp(ref - logp) - (ref - logp) - 1, in float64 with expm1: in float32 the terms cancel near diff = 0
        d = diff.double()  # [...]
        return (torch.expm1(-d) + d).to(diff.dtype)
    if estimator == "abs":
        return diff.abs()
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ x·m / Σ m``; 0 when the mask is empty. Masked-out entries of ``x`` (NaN, ±inf) never reach it."""
    m = mask.to(x.dtype)  # like mask
    xm = torch.where(mask != 0, x * m, 0.0)  # broadcast shape: exactly 0 where m = 0, never 0·inf
    return xm.sum() / m.sum().clamp(min=1.0)


def agg_weights(tokens: torch.Tensor, agg: str, T: int, norm_length: float | None = None) -> torch.Tensor:
    """Per-sequence weights ``w`` [B] that define every ``agg`` mode: ``loss = Σ_b w_b · Σ_t m_bt·x_bt``.

    ``tokens`` [B] holds each sequence's ``Σ_t m`` and ``T`` the padded length (the default ``norm_length``).
    The one place the modes' formulas live: :func:`aggregate`, the fused losses (``dloss/dx_bt = w_b·m_bt``)
    and the integrations' adapters use them. Empty masks and batches give weights that turn an empty sum
    into 0, never NaN: ``token-mean`` divides by ``max(Σ m, 1)``, ``seq-mean-token-mean`` averages only the
    sequences that have a token, and the token-sum modes divide by 1 when ``B`` (or ``B·norm_length``) is 0.
    """
    B = tokens.shape[0]
    if agg == "token-mean":
        return (1.0 / tokens.sum().clamp(min=1.0)).expand(B)
    if agg == "seq-mean-token-mean":
        has_tokens = (tokens > 0).to(tokens.dtype)  # [B]
        return has_tokens / tokens.clamp(min=1.0) / has_tokens.sum().clamp(min=1.0)
    if agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return torch.full_like(tokens, token_sum_weight(agg, B, T, norm_length))
    raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")


def token_sum_weight(agg: str, B: int, T: int, norm_length: float | None = None) -> float:
    """Every sequence's weight in the token-sum modes (a constant of the batch's shape): ``1 / B`` for
    ``seq-mean-token-sum``, ``1 / (B·norm_length)`` (``norm_length`` defaults to ``T``) for
    ``seq-mean-token-sum-norm``; a zero divisor (an empty batch, whose sum is 0) divides by 1."""
    if agg == "seq-mean-token-sum":
        return 1.0 / max(B, 1)
    denom = B * (T if norm_length is None else norm_length)
    return 1.0 / (denom if denom > 0 else 1)


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", norm_length: float | None = None) -> torch.Tensor:
    """Reduce per-token ``x`` [B, T] to a scalar ``Σ_b w_b · Σ_t m·x`` with :func:`agg_weights`; see README's
    table of ``agg`` modes.

    Empty masks and empty batches (B = 0 or T = 0) give 0, never NaN. Masked-out entries of ``x`` (NaN, ±inf)
    never reach it.
    """
    m = mask.to(x.dtype)  # [B, T]
    xm = torch.where(mask != 0, x * m, 0.0)  # [B, T]: exactly 0 where m = 0, never 0·inf
    w = agg_weights(m.sum(-1), agg, x.shape[-1], norm_length)  # [B]
    return (w * xm.sum(-1)).sum()


def policy_loss(
    logp: torch.Tensor,  # [B, T]
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T] or [B]
    mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    ref_logp: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,  # [B, T]
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    norm_length: float | None = None,
    cu_seqlens: torch.Tensor | None = None,  # [S + 1]
):
    """PPO/GRPO clipped surrogate with optional dual clip, GSPO sequence ratio, KL and entropy terms.

    With ``cu_seqlens`` the inputs are packed ``[1, total]`` (``advantages`` ``[1, total]`` or ``[S]``) and the
    loss is this one on their padded ``[S, Tmax]`` view (``rlkernels.packing.padded_views``).
    Returns ``(loss, metrics)``; metrics are detached 0-d tensors.
    """
    if cu_seqlens is not None:
        from rlkernels.packing import padded_views

        views = padded_views(cu_seqlens, "logp", ("advantages",), logp=logp, old_logp=old_logp,
                             advantages=advantages, mask=mask, ref_logp=ref_logp, entropy=entropy)
        return policy_loss(**views, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio,
                           kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg,
                           norm_length=norm_length)
    # Masked-out positions are replaced by 0 before any arithmetic, so nothing there (NaN, ±inf) reaches
    # an output or a gradient (a mask multiply alone would give 0·inf = NaN, e.g. GSPO's masked sum).
    keep = mask != 0  # [B, T]
    given = logp
    logp = torch.where(keep, _up(logp), 0.0)  # [B, T]
    old_logp = torch.where(keep, _up(old_logp, like=given), 0.0)  # [B, T]
    m = mask.to(logp.dtype)  # [B, T]
    adv = _up(advantages, like=given)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # [B, 1]
    adv = torch.where(keep, adv.expand_as(logp), 0.0)  # [B, T]
    log_ratio = logp - old_logp  # [B, T]
    if ratio == "token":
        lr = log_ratio  # [B, T] the log of each token's ratio
    elif ratio == "sequence":
        seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
        lr = seq_log_ratio.unsqueeze(-1).expand_as(logp)  # [B, T]
    else:
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    high = clip_low if clip_high is None else clip_high

    def surrogate(lr):
        r = torch.exp(lr)  # [B, T]
        pg_unclipped = -adv * r  # [B, T]
        pg_clipped = -adv * torch.clamp(r, 1.0 - clip_low, 1.0 + high)  # [B, T]
        pg = torch.maximum(pg_unclipped, pg_clipped)  # [B, T]
        if dual_clip is not None:
            # the cap only where strictly smaller: on a tie pg keeps its gradient (torch.minimum would halve it)
            cap = -adv * dual_clip  # [B, T]
            pg = torch.where((adv < 0) & ~(pg <= cap), torch.minimum(pg, cap), pg)
        return r, pg_unclipped, pg_clipped, pg

    r, pg_unclipped, pg_clipped, pg = surrogate(lr)
    # Where the clip or the dual clip sets the value, the ratio gets no gradient, but exp's backward multiplies
    # that 0 by r, inf where the log-ratio overflowed float32 (0·inf = NaN): those ratios (GSPO: rows whose every
    # token is so decided) are recomputed from the detached log-ratio.
    with torch.no_grad():
        decided = (pg != pg_unclipped) & ~torch.isnan(pg)  # [B, T]
        if ratio == "sequence":
            decided = (decided | ~keep).all(-1, keepdim=True).expand_as(decided)  # [B, T]
    if lr.requires_grad:  # no data-dependent branch: this compiles with torch.compile(fullgraph=True)
        r, pg_unclipped, pg_clipped, pg = surrogate(torch.where(decided, lr.detach(), lr))
    x = pg
    metrics = {}
    if ref_logp is not None:
        kl = kl_penalty(logp, torch.where(keep, _up(ref_logp, like=given), 0.0), kl_estimator)  # [B, T]
        x = x + kl_coef * kl
        metrics["kl"] = masked_mean(kl, m)
    if entropy is not None:
        ent = torch.where(keep, _up(entropy, like=given), 0.0)  # [B, T]
        x = x - entropy_coef * ent
        metrics["entropy"] = masked_mean(ent, m)
    loss = aggregate(x, m, agg, norm_length)
    metrics["clipfrac"] = masked_mean((pg_clipped > pg_unclipped).to(x.dtype), m)
    metrics["approx_kl"] = masked_mean(old_logp - logp, m)
    metrics["ratio_mean"] = masked_mean(r, m)
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(
    values: torch.Tensor,  # [B, T]
    old_values: torch.Tensor,  # [B, T]
    returns: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    clip: float | None = None,
    agg: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,  # [S + 1]
):
    """Clipped (or plain) squared-error value loss. Returns ``(loss, metrics)``. With ``cu_seqlens``: packed
    ``[1, total]`` inputs, the loss of their padded ``[S, Tmax]`` view, as in :func:`policy_loss`."""
    if cu_seqlens is not None:
        from rlkernels.packing import padded_views

        views = padded_views(cu_seqlens, "values", values=values, old_values=old_values, returns=returns, mask=mask)
        return value_loss(**views, clip=clip, agg=agg)
    keep = mask != 0  # [B, T]: masked-out entries become 0 before any arithmetic (NaN/±inf never reach outputs)
    v, old, ret = (torch.where(keep, _up(t, like=values), 0.0) for t in (values, old_values, returns))  # [B, T] each
    m = mask.to(v.dtype)  # [B, T]
    unclipped = (v - ret).square()  # [B, T]
    metrics = {}
    if clip is None:
        per_token = 0.5 * unclipped
        metrics["clipfrac"] = torch.zeros((), dtype=v.dtype, device=v.device)
    else:
        # clamp(v, old ± clip) is v exactly inside the range; old + clamp(v - old) is not (rounding),
        # which made clipfrac count unclipped tokens
        v_clipped = torch.clamp(v, old - clip, old + clip)  # [B, T]
        clipped = (v_clipped - ret).square()  # [B, T]
        # unclipped on a tie, as the kernels (torch.maximum would halve its gradient); NaN propagates
        per_token = 0.5 * torch.where(unclipped >= clipped, unclipped, torch.maximum(unclipped, clipped))
        metrics["clipfrac"] = masked_mean((clipped > unclipped).to(v.dtype), m)
    loss = aggregate(per_token, m, agg)
    metrics["values_mean"] = masked_mean(v, m)
    return loss, {k: t.detach() for k, t in metrics.items()}


# ---------------------------------------------------------------- advantages


def gae(
    rewards: torch.Tensor,  # [B, T]
    values: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
):
    """Generalized advantage estimation by the reverse recursion, one Python step per token.

    Masked positions are transparent: the chain skips them. Past the last valid
    token the next value is 0. Returns ``(advantages, returns)``; only positions
    with ``mask = 1`` are specified (the reference writes 0 advantage elsewhere).
    """
    r, v = _up(rewards), _up(values)
    valid = mask.bool()  # [B, T]
    B, T = r.shape
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)  # [B]
    next_adv = torch.zeros(B, dtype=r.dtype, device=r.device)  # [B]
    advantages = torch.zeros_like(r)  # [B, T]
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        adv_t = delta + gamma * lam * next_adv  # [B]
        m = valid[:, t]
        advantages[:, t] = torch.where(m, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    return advantages, advantages + v


def group_advantages(
    scores: torch.Tensor,  # [N]
    group_size: int | None = None,
    *,
    index: torch.Tensor | None = None,  # [N] int group ids
    mode: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages of sequence scores: one group at a time.

    ``grpo``: ``(s - mean) / (std + eps)`` (unbiased std); ``dr_grpo``: ``s - mean``;
    ``rloo``: ``s - mean of the other members``. A group of one sample, and every
    member of a group whose scores are all equal, gets exactly 0.
    """
    if mode not in GROUP_MODES:  # checked up front: a batch of constant groups never reaches the mode branch
        raise ValueError(f"mode must be one of {GROUP_MODES}, got {mode!r}")
    s = scores.double()  # [N] statistics in float64: a float32 sum overflows at 3e38 and loses digits of 1e6 + x
    N = s.shape[0]
    if (group_size is None) == (index is None):
        raise ValueError("give exactly one of group_size or index")
    if index is None:
        ids = torch.arange(N, device=s.device) // group_size  # [N]
    else:
        ids = index
    out = torch.zeros_like(s)  # [N]
    for gid in torch.unique(ids).tolist():
        members = (ids == gid).nonzero().squeeze(-1)  # [n]
        g = s[members]  # [n]
        n = g.numel()
        if n == 1 or bool((g == g[0]).all()):
            continue  # exactly 0
        mean = g.mean()
        if mode == "grpo":
            out[members] = (g - mean) / (g.std(unbiased=True) + eps)
        elif mode == "dr_grpo":
            out[members] = g - mean
        else:  # rloo
            out[members] = g - (g.sum() - g) / (n - 1)
    return out.to(compute_dtype(scores))  # [N]


def masked_whiten(
    x: torch.Tensor,  # [...]
    mask: torch.Tensor,  # [...]
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(x - μ) · rsqrt(var + eps)`` with the masked mean and unbiased masked variance.

    All positions are transformed; only the masked ones enter the statistics.
    With fewer than two masked entries the variance is taken as 0. With
    ``shift_mean=False`` the mean is added back.
    """
    xf = x.double()  # [...] statistics and output in float64, returned in the compute dtype
    m = mask.bool()
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    count = m.sum().to(xf.dtype)
    # where, not multiply by the mask: a NaN/inf at a masked-out position must not enter the statistics
    mean = torch.where(m, xf, zero).sum() / count.clamp(min=1.0)
    var = torch.where(m, (xf - mean).square(), zero).sum() / (count - 1.0).clamp(min=1.0)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out.to(compute_dtype(x))


def process_advantages(
    step_rewards: torch.Tensor,  # [B, S]
    step_ends: torch.Tensor,  # [B, S] int
    T: int,
    *,
    step_mask: torch.Tensor | None = None,  # [B, S]
    group_size: int | None = None,
    index: torch.Tensor | None = None,  # [B] int group ids
    mode: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Process-supervision advantages (DeepSeekMath §4.1.3), one group and one step at a time; ``[B, T]``.

    Every step reward (``step_mask`` nonzero, all when None) is normalised with the mean and the unbiased std of
    ALL valid step rewards of its group (the rows of the group, as in :func:`group_advantages`): ``grpo``:
    ``(r - mean)/(std + eps)``; ``dr_grpo``: ``r - mean``. A group with fewer than two valid steps, or whose
    valid step rewards are all equal, gives exactly 0. Token ``t`` of row ``b`` gets the sum of the normalised
    rewards of row ``b``'s valid steps that end at or after ``t`` (``step_ends[b, s] >= t``).
    """
    if mode not in PROCESS_MODES:
        raise ValueError(f"mode must be one of {PROCESS_MODES}, got {mode!r}")
    if (group_size is None) == (index is None):
        raise ValueError("give exactly one of group_size or index")
    r = step_rewards.double()  # [B, S] in float64 (see group_advantages), returned in the compute dtype
    B, S = r.shape
    valid = torch.ones(B, S, dtype=torch.bool, device=r.device) if step_mask is None else step_mask.bool()  # [B, S]
    ids = torch.arange(B, device=r.device) // group_size if index is None else index  # [B]
    norm = torch.zeros_like(r)  # [B, S]
    for gid in torch.unique(ids).tolist():
        steps = valid & (ids == gid)[:, None]  # [B, S]
        g = r[steps]  # [n]
        if g.numel() < 2 or bool((g == g[0]).all()):
            continue  # exactly 0
        centred = g - g.mean()
        norm[steps] = centred / (g.std(unbiased=True) + eps) if mode == "grpo" else centred
    out = torch.zeros(B, T, dtype=r.dtype, device=r.device)  # [B, T]
    for b in range(B):
        for s in range(S):
            if valid[b, s]:
                out[b, : int(step_ends[b, s]) + 1] += norm[b, s]
    return out.to(compute_dtype(step_rewards))
