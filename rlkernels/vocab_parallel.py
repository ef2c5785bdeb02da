"""Vocabulary-parallel log-probabilities, entropy and policy loss: the LM head split over the ranks of a process
group (tensor parallelism, as in Megatron), each rank holding a contiguous slice of the vocabulary.

Reached through ``process_group=`` and ``vocab_start=`` of :func:`rlkernels.linear_logprobs` and
:func:`rlkernels.linear_policy_loss` (and :func:`logprobs_from_logits` here, for logits that are already split).
Every rank passes the same ``hidden`` ``[..., H]`` and ``labels`` (replicated, as Megatron's tensor-parallel
region has them) and its own weight slice ``[V_r, H]`` holding the global token ids
``[vocab_start_r, vocab_start_r + V_r)``. The slices must tile ``[0, V)`` without gaps or overlaps, in any rank
order and of any sizes (an odd ``V`` split unevenly is fine).

The merge (Megatron's vocabulary-parallel cross-entropy, extended to the entropy and kept exact). Each rank runs
the single-process op's own forward backend on its slice (:data:`rlkernels.fused_linear._PARTIALS_IMPLS`), which
yields per token its slice's partials ``m_r`` (max logit), ``s_r = Σ exp(z - m_r)``, ``u_r = Σ exp(z - m_r)(z - m_r)``
(the entropy's numerator) and ``z_y`` (the label's logit, on the rank that owns the label; exactly 0 elsewhere), plus
an ownership flag. ONE collective merges them: an ``all_gather`` of these 5 float32 values per token (and the
rank's ``(vocab_start, V_r)``), after which every rank merges the ``P`` partials with the same log-sum-exp merge the
op uses for its own vocabulary chunks (:func:`rlkernels._host.lse_merge`):
``M = max_r m_r``, ``S = Σ_r e^(m_r - M) s_r``, ``U = Σ_r e^(m_r - M)(u_r + s_r (m_r - M))``,
``log p_y = (z_y - M) - log S``, ``H = log S - U/S``. The merge is exact (each partial is re-centred once on the
global max, as the op re-centres its chunks) and identical on every rank (same inputs, same order). An all-reduce
would need two collectives (MAX of ``m``, then SUM of the re-centred ``s``, ``u``, ``z_y``); the all-gather needs
one, at ``5·P`` instead of 5 floats received per token, which is small next to the GEMMs at tensor-parallel sizes.

Gradients. The backward is the single-process op's backward on the rank's slice with the merged statistics
(global ``M``, ``log S``, ``H``, ``log p_y``): each rank forms ``dz`` for its own columns (the one-hot term only on
the rank that owns the label), so ``d_weight`` (and ``d_bias``) are the rank's slice of the full gradient, computed
locally. ``d_hidden = Σ_r dz_r W_r`` needs every rank's part: the autograd backward all-reduces it (SUM) over the
group. The upstream gradients must be the same on every rank (the loss computed redundantly on each rank from the
replicated log-probs, Megatron's convention). For 16-bit inputs each rank's ``d_hidden`` part is rounded to the
input dtype before that sum (as in Megatron).

:func:`rlkernels.linear_policy_loss` with a process group is ``policy_loss(linear_logprobs(..., process_group))``:
the per-token loss coefficients need the merged log p and entropy, so the statistics are merged first, the policy
loss (and its per-token coefficients, in its backward) run on the replicated ``[B, T]`` values, and each rank's
``dz`` then comes from the same local backward. That path costs four GEMMs (the backward recomputes the local
logits) rather than the single-process fused op's three: forming ``dz`` in the forward would need the collective
inside the op's chunk loop, one per chunk.

Checks: ``vocab_start`` and ``process_group`` go together (each without the other raises). On the CPU the slices'
layout is checked after the collective (gaps, overlaps) and a label outside ``[0, V)`` raises, as the op does; on
a GPU (no device sync) a label that no rank owns, or two ranks own, gives NaN. The slice bounds travel in the
(float32) collective: exact while ``vocab_start + V_r`` stays below 2^24 (16.7M), which is checked.

Backends: the op's ``torch`` and ``triton`` rows (by device, or ``RLKERNELS_BACKEND``); ``reference`` is served
by ``torch`` here. The collective is from ``torch.distributed`` (gloo on CPU, NCCL on GPU); these functions run
eagerly under ``torch.compile`` (they are excluded from tracing: a graph break).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rlkernels import _backend, _checks, fused_linear, fused_policy, reference
from rlkernels._host import call, lse_merge, option_values, refuse_double_backward

_OTHER_RANK = -1  # the local label of a token whose label lies in another rank's slice
# The ignore_index the backends see: ignored tokens are dropped before any backend runs, and local labels are
# >= _OTHER_RANK, so no local label equals it (a user's ignore_index = -1 would otherwise hide _OTHER_RANK rows).
_NO_IGNORE = -2
_ROWS = 5  # gathered per token: m, s, u, z_y, owned


def check_group(process_group, vocab_start, V_local: int, name: str = "weight") -> int | None:
    """Validates the vocabulary-parallel arguments: both or neither given, ``vocab_start`` an integer >= 0, the
    default process group initialised. Returns ``vocab_start`` as an int (None without a group)."""
    if process_group is None:
        if vocab_start is not None:
            raise ValueError("vocab_start is given without process_group: vocab_start (the global id of "
                             f"{name}'s first row) only means something for a vocabulary-parallel call")
        return None
    if vocab_start is None:
        raise ValueError(f"process_group is given without vocab_start: pass the global token id of {name}'s first "
                         "row (rank r of an even split holds [r·V/P, (r+1)·V/P))")
    vocab_start = _checks.index(vocab_start, "vocab_start")  # a NumPy or one-element tensor integer too
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be an int >= 0, got {vocab_start!r}")
    _checks.process_group(process_group)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group needs torch.distributed initialised (dist.init_process_group)")
    if V_local + vocab_start >= 1 << 24:
        raise ValueError(f"vocab_start + {name}.shape[0] = {vocab_start + V_local} passes 2^24: the slice bounds "
                         "travel through the float32 collective, exact only below it")
    return int(vocab_start)


class _Gather(torch.autograd.Function):
    """``all_gather`` of a 1-D tensor over the group: ``[P, K]``. Backward: this rank's row of the gradient (the
    quantities merged from the gathered tensor are replicated, so each rank's upstream gradient already is the whole
    gradient of its own part)."""

    @staticmethod
    def forward(ctx, x, group):  # x [K]
        P = dist.get_world_size(group)
        out = x.new_empty(P, x.shape[0])  # [P, K]
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
        ctx.rank = dist.get_rank(group)
        return out

    @staticmethod
    def backward(ctx, g):  # g [P, K]
        return g[ctx.rank], None


def _local_labels(labels: torch.Tensor, vocab_start: int, V_local: int):
    """``(local [n] int64, owned [n] bool)``: a label's column in this rank's slice, or ``_OTHER_RANK``."""
    local = labels - vocab_start  # [n]
    owned = (local >= 0) & (local < V_local)  # [n]
    return torch.where(owned, local, torch.full_like(local, _OTHER_RANK)), owned


def _merge(part: torch.Tensor, owned: torch.Tensor, labels: torch.Tensor, group, vocab_start: int, V_local: int,
           ignore_index: int):
    """The one collective and the merge. ``part`` [4, n] this rank's ``(m, s, u, z_y)`` (``z_y`` 0 where not
    ``owned`` [n]); ``labels`` [n] the global ids (None: no labels, the entropy only). Returns
    ``(merged [4, n], ok [n] bool)``: the group's partials merged, and whether exactly one rank owns each label.
    On the CPU a bad layout or label raises here (every rank sees the same gathered values, so every rank raises)."""
    n = part.shape[1]
    header = part.new_tensor([vocab_start, V_local])  # [2] this rank's slice
    mine = torch.cat((part, owned.to(part.dtype)[None]), 0).reshape(-1)  # [5·n]
    gathered = _Gather.apply(torch.cat((mine, header)), group)  # [P, 5·n + 2]
    slices = gathered[:, _ROWS * n:]  # [P, 2]
    m, s, u, zy, own = gathered[:, :_ROWS * n].reshape(gathered.shape[0], _ROWS, n).unbind(1)  # [P, n] each
    if part.device.type == "cpu":
        V = _check_layout(slices.detach().long().tolist())
        if labels is not None:
            _checks.labels(labels, V, ignore_index)
    m_all, s_all, u_all = lse_merge(m, s, u)  # [n] each
    # the label's logit is exactly 0 on every rank but its owner: the sum is exact
    return torch.stack((m_all, s_all, u_all, zy.sum(0))), own.sum(0) == 1


def _check_layout(slices: list[list[int]]) -> int:
    """The ranks' ``[vocab_start, V_r]`` tile ``[0, V)``; returns ``V``."""
    end = 0
    for start, size in sorted(slices):
        if start != end:
            raise ValueError(f"vocab_start: the ranks' slices [vocab_start, vocab_start + weight.shape[0]) must tile "
                             f"[0, V) without gaps or overlaps; got (vocab_start, rows) = {sorted(slices)}")
        end = start + size
    return end


def _outputs(merged: torch.Tensor, ok: torch.Tensor, opt):
    """``(logp, entropy, stats)`` from the merged partials through the op's own finishing
    (:func:`rlkernels.fused_linear._from_partials`), NaN log p where no rank or two ranks own the label."""
    # _from_partials NaNs log p for a label outside [0, V): here "exactly one rank owns it" plays that part
    proxy = torch.where(ok, 0, _OTHER_RANK)  # [n] in [0, 1) exactly where ok
    return fused_linear._from_partials(merged, proxy, 1, dataclasses.replace(opt, ignore_index=_NO_IGNORE))


class _LinearLogprobs(torch.autograd.Function):
    """Forward: local partials (the op's backend), one collective, merge. Backward: the op's backward on the local
    slice with the merged statistics; ``d_hidden`` all-reduced over the group."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, group, vocab_start, opt):
        # hidden [N, H], weight [V_r, H], bias [V_r] or None, labels [N] int64 (global ids)
        N = hidden.shape[0]
        V_local = weight.shape[0]
        keep = fused_linear._kept_rows(labels, opt.ignore_index)  # [k] or None: every row kept
        h, y = (hidden, labels) if keep is None else (hidden[keep], labels[keep])  # [n, H], [n]
        y_local, owned = _local_labels(y, vocab_start, V_local)  # [n], [n]
        local_opt = dataclasses.replace(opt, ignore_index=_NO_IGNORE)
        with _backend.float32_compute(hidden.device):
            partials = _backend.implementation(fused_linear._PARTIALS_IMPLS, h)
            part = partials(h, weight, y_local, bias, local_opt)  # [4, n] m, s, u, z_y over this slice
            merged, ok = _merge(part, owned, y, group, vocab_start, V_local, opt.ignore_index)  # [4, n], [n]
            logp, entropy, stats = _outputs(merged, ok, opt)  # [n], [n], [2, n]
        dt = reference.compute_dtype(hidden)
        logp, entropy, stats = logp.to(dt), entropy.to(dt), stats.to(dt)
        ctx.save_for_backward(h, weight, bias, y_local, stats, entropy, logp)
        ctx.keep, ctx.N, ctx.group, ctx.opt = keep, N, group, local_opt
        if keep is None:
            return logp, entropy
        out_lp, out_ent = (logp.new_zeros(N) for _ in range(2))  # [N] exact zeros at ignored rows
        out_lp[keep], out_ent[keep] = logp, entropy
        return out_lp, out_ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        refuse_double_backward("linear_logprobs")
        h, weight, bias, y_local, stats, entropy, logp = ctx.saved_tensors
        keep = ctx.keep
        g_logp = torch.zeros(ctx.N, dtype=logp.dtype, device=logp.device) if g_logp is None else g_logp  # [N]
        g_ent = torch.zeros(ctx.N, dtype=logp.dtype, device=logp.device) if g_ent is None else g_ent  # [N]
        if keep is not None:
            g_logp, g_ent = g_logp[keep], g_ent[keep]  # [n]
        dh, dw, db = call(fused_linear._linear_logprobs_backward_op, g_logp.contiguous(), g_ent.contiguous(), h,
                          weight, y_local, bias, stats, entropy, logp,
                          *fused_linear._backward_option_lists(option_values(ctx.opt), ctx.needs_input_grad[1],
                                                              ctx.needs_input_grad[0]))
        # dh [n, H] or [0] (only the head trains), dw [V_r, H] or [0] (a frozen head), db [V_r] or [0]
        if ctx.needs_input_grad[0]:
            dist.all_reduce(dh, group=ctx.group)  # d_hidden = Σ_r dz_r W_r
            if keep is not None:
                full = dh.new_zeros(ctx.N, dh.shape[1])  # [N, H]
                full[keep] = dh
                dh = full
        else:
            dh = None
        return dh, (dw if ctx.needs_input_grad[1] else None), (db if bias is not None else None), None, None, None, None


@torch.compiler.disable
def linear_logprobs(hidden, weight, labels, bias, opt, process_group, vocab_start: int):
    """:func:`rlkernels.linear_logprobs` with the vocabulary split over ``process_group`` (validated arguments,
    ``opt`` its :class:`~rlkernels.fused_linear.LinearLogprobsOptions`). Returns ``(logp [...], entropy [...])``."""
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    y = labels.reshape(-1).long()  # [N]
    logp, entropy = _LinearLogprobs.apply(h2, weight, bias, y, process_group, vocab_start, opt)  # [N] each
    return logp.reshape(lead), entropy.reshape(lead)


def linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt, process_group,
                       vocab_start: int):
    """:func:`rlkernels.linear_policy_loss` with the vocabulary split over ``process_group`` (validated arguments,
    ``opt`` its :class:`~rlkernels.fused_policy.FusedPolicyOptions`): the merged log-probs (and entropy), then
    :func:`rlkernels.policy_loss` on them, replicated on every rank. Returns ``(loss, metrics)``."""
    lp_opt = fused_linear.LinearLogprobsOptions(opt.temperature, opt.with_entropy, opt.ignore_index)
    # as the single-process op: NaN/inf in the rows of masked-out or ignored tokens reaches no gradient
    hidden = fused_policy._finite_unused_rows(hidden, labels, mask, opt)  # [B, T, H]
    logp, entropy = linear_logprobs(hidden, weight, labels, bias, lp_opt, process_group, vocab_start)  # [B, T] each
    loss, metrics = fused_policy._policy_on_logprobs(logp, entropy, old_logp, advantages, mask, ref_logp, opt)
    return fused_policy._ComposedLoss.apply(loss), metrics


@torch.compiler.disable
def logprobs_from_logits(
    logits: torch.Tensor,  # [..., V_r]
    labels: torch.Tensor | None,  # [...] int, global ids; None: the entropy only
    *,
    process_group,
    vocab_start: int,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """Log-probabilities (and entropy) of ``labels`` from vocabulary-parallel logits: this rank's ``logits``
    ``[..., V_r]`` are the columns ``[vocab_start, vocab_start + V_r)`` of the full ``[..., V]`` logits
    (Megatron's ``ColumnParallelLinear`` output without gather). Equal to
    ``rlkernels.logprobs(full_logits, labels, ...)`` to float32 rounding, with the same one-collective merge as
    :func:`linear_logprobs` (the partials here are eager PyTorch on the ``[N, V_r]`` slice, which is already held;
    the gradient is autograd's through them and the merge, whose collective's backward keeps each rank's own part).

    Args:
        logits: ``[..., V_r]`` this rank's columns of the logits, any float dtype.
        labels: ``[...]`` integer token ids in the FULL vocabulary ``[0, V)`` (each rank reads the ones in its
            slice), or None for the entropy alone.
        process_group: the group the vocabulary is split over (every rank holds one contiguous slice).
        vocab_start: this rank's first column in the full vocabulary (an int >= 0).
        temperature: divides the logits (> 0), as in :func:`rlkernels.logprobs`.
        return_entropy: also return the entropy of the full softmax.
        ignore_index: tokens with this label give 0 in both outputs and no gradient.

    Returns ``logp`` ``[...]`` float32 (float64 logits compute in float64), and with ``return_entropy`` also
    ``entropy``; with ``labels=None`` only the entropy. Differentiable in ``logits``; every rank must call it
    (the same ``labels``, the same upstream gradients).
    """
    _checks.floating(logits, "logits")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V_r] with V_r >= 1, got shape {tuple(logits.shape)}")
    entropy_only = labels is None
    if entropy_only:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)  # [...] (never read)
    _checks.integer(labels, "labels")
    _checks.same_device((logits, "logits"), (labels, "labels"))
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    V_local = logits.shape[-1]
    if process_group is None:
        raise ValueError("process_group is required (rlkernels.logprobs serves logits that are not split)")
    vocab_start = check_group(process_group, vocab_start, V_local, "logits' last dimension")
    opt = fused_linear.LinearLogprobsOptions(_checks.temperature(temperature),
                                             _checks.flag(return_entropy, "return_entropy")
                                             or _checks.flag(entropy_only, "entropy_only"),
                                             _checks.index(ignore_index, "ignore_index"))
    lead = logits.shape[:-1]
    cdt = reference.compute_dtype(logits)
    y = labels.reshape(-1).long()  # [N]
    keep = None if entropy_only else fused_linear._kept_rows(y, opt.ignore_index)  # [k] or None
    z = logits.reshape(-1, V_local)  # [N, V_r]
    y_kept = y if keep is None else y[keep]  # [n]
    if keep is not None:
        z = z[keep]  # [n, V_r]
    with _backend.float32_compute(logits.device):
        z = z.to(cdt) / opt.temperature  # [n, V_r]
        y_local, owned = _local_labels(y_kept, vocab_start, V_local)  # [n]
        if entropy_only:
            owned = torch.zeros_like(owned)  # no rank owns a label: log p is NaN and dropped
        m = z.detach().amax(1).clamp(min=torch.finfo(cdt).min)  # [n]; a constant shift (log p, H do not depend on it)
        d = z - m[:, None]  # [n, V_r]
        e = torch.exp(d)  # [n, V_r]
        zero = torch.zeros((), dtype=cdt, device=z.device)
        # p log p counts 0 where p = 0 (a -inf logit), never 0 · -inf
        u = torch.where(e > 0, e * d, zero).sum(1) if opt.return_entropy else torch.zeros_like(m)  # [n]
        zy = torch.where(owned, z.gather(1, y_local.clamp(min=0)[:, None]).squeeze(1), zero)  # [n]
        part = torch.stack((m, e.sum(1), u, zy))  # [4, n]
        merged, ok = _merge(part, owned, None if entropy_only else y_kept, process_group, vocab_start, V_local,
                            opt.ignore_index)  # [4, n], [n]
        logp, entropy, _ = _outputs(merged, ok, opt)  # [n] each
    if keep is not None:
        logp = torch.zeros(y.shape[0], dtype=cdt, device=logits.device).index_put((keep,), logp)  # [N]
        entropy = torch.zeros(y.shape[0], dtype=cdt, device=logits.device).index_put((keep,), entropy)  # [N]
    logp, entropy = logp.reshape(lead).float(), entropy.reshape(lead).float()  # float32 also for float64 logits
    if entropy_only:
        return entropy
    return (logp, entropy) if return_entropy else logp
