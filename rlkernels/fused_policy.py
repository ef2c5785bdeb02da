"""The PPO/GRPO policy loss straight from hidden states (or logits), with the head's gradient formed in the forward.

``linear_policy_loss(hidden, weight, labels, old_logp, advantages, mask, ...)`` equals
``policy_loss(linear_logprobs(hidden, weight, labels, ...), old_logp, advantages, mask, ...)`` (with the entropy
when ``entropy_coef`` is set), but costs three GEMMs instead of four. The two-op path cannot know the loss when its
forward runs, so its backward recomputes the logits (GEMM 2) before ``dz·W`` and ``dzᵀ·h``. In an RL update the
loss *is* known in the forward: old log-probs, advantages, mask and the aggregation weights are all given. So for
each chunk of tokens this op

1. computes the logits tile ``z = h·Wᵀ (+ b)`` in float32 (GEMM 1) and from it each token's row max, log-sum-exp,
   entropy and the label's logit (read from the float32 tile, never from a rounded one);
2. runs the policy loss's own implementation (:mod:`rlkernels.losses`) on the chunk, which returns the per-token
   gradients of the chunk's loss terms, and scales them by the aggregation weights of the *whole* batch
   (:func:`rlkernels.reference.agg_weights`, which depend only on the mask, so they are known up front);
3. turns the tile into ``dz = dL/dz`` in place and runs ``d_hidden = dz·W`` (GEMM 2) and ``d_weight += dzᵀ·h``
   (GEMM 3), each only when that input needs a gradient (a frozen head costs two GEMMs).

Autograd's backward then only multiplies the stored gradients by the upstream scalar.

Chunks. With ``ratio="token"`` every token's loss term depends on that token alone (given the whole-batch
weights), so chunks are runs of tokens of any length, sized to a byte budget (``_CHUNK_BYTES``), and the policy
implementation sees each token as a row of one. With ``ratio="sequence"`` (GSPO) a token's gradient depends on its
whole sequence's ratio, so chunks are whole sequences (as many as fit the budget, at least one: a single sequence
longer than the budget still takes one chunk, ``T·V`` floats).

Memory: beyond the gradients, two float32 ``[chunk, V]`` tiles (a third while the entropy is summed) (the logits' shifted values and their exponentials)
and O(N) per-token vectors. For 16-bit weights the torch path (CPU) computes in float32 like
:func:`rlkernels.linear_logprobs`'s torch path does today: a float32 copy of the weight and a float32 ``d_weight``
accumulator, cast once at the end (the same memory as the two-op path; removing them is the LM-head issue's
V-chunked backward, which will apply to both).

``logits_policy_loss(logits, labels, old_logp, advantages, mask, ...)`` is the same for users who already hold
``[B, T, V]`` logits: it reads them once (the statistics and the loss) and writes ``d_logits`` once, in the forward.

Backends: ``torch`` (chunked PyTorch, every device) and ``reference`` (:mod:`rlkernels.reference`'s formulas
through autograd, served before the ops). There is no Triton row yet: on CUDA the torch row runs cuBLAS GEMMs and
PyTorch's elementwise kernels over the chunk.

Order: launchers (validate, chunk, compute) -> torch.library ops with autograd -> public functions.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch

from rlkernels import _backend, _checks, losses, reference
from rlkernels._host import no_grads, op_schema

# Budget of one chunk's float32 tiles (two [chunk, V] buffers); at V = 49152 a chunk is ~340 tokens, at
# V = 151936 ~110: each GEMM still has hundreds of rows, and the tiles stay far below the [N, V] logits.
_CHUNK_BYTES = 128 << 20
# exp(x) is exactly 0 below this in float32 and float64; clamping z - max there keeps (a + c·d) finite where a
# logit is -inf, so p·(a + c·d) is 0 there, never 0·inf.
_EXP_ZERO_BELOW = -1000.0


@dataclass(frozen=True)
class FusedPolicyOptions:
    """The validated non-tensor arguments of :func:`linear_policy_loss` / :func:`logits_policy_loss`, under their
    public names, plus which inputs need a gradient. The ops take them as ``*dataclasses.astuple(opt)``."""

    temperature: float  # > 0: divides the logits
    ignore_index: int  # labels equal to it give logp = entropy = 0 and no gradient (as in linear_logprobs)
    clip_low: float
    clip_high: float
    dual_clip: float | None
    ratio: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    agg: str
    norm_length: float | None
    grad_input: bool  # compute d_hidden (linear) or d_logits (logits)
    grad_weight: bool  # compute d_weight (linear only)
    grad_bias: bool  # compute d_bias (linear only)

    @property
    def policy(self) -> losses.PolicyOptions:
        return losses.PolicyOptions(self.clip_low, self.clip_high, self.dual_clip, self.ratio, self.kl_coef,
                                    self.kl_estimator, self.entropy_coef, self.agg, self.norm_length)

    @property
    def with_entropy(self) -> bool:
        return self.entropy_coef != 0


# ---------------------------------------------------------------- validation


def _validate(*, head_input, head_name, weight, labels, bias, old_logp, advantages, mask, ref_logp, temperature,
              ignore_index, policy_kwargs, grads) -> FusedPolicyOptions:
    """Checks the arguments of either op (each error names its argument); returns the options."""
    _checks.floating(head_input, head_name)
    _checks.rank(head_input, head_name, 3)
    B, T = head_input.shape[:2]
    _checks.integer(labels, "labels")
    if tuple(labels.shape) != (B, T):
        raise ValueError(f"labels must have shape {head_name}.shape[:2] = {(B, T)}, got {tuple(labels.shape)}")
    _checks.floating(old_logp, "old_logp")
    if tuple(old_logp.shape) != (B, T):
        raise ValueError(f"old_logp must have shape {head_name}.shape[:2] = {(B, T)}, got {tuple(old_logp.shape)}")
    if weight is not None:
        _checks.floating(weight, "weight")
        _checks.rank(weight, "weight", 2)
        if weight.shape[1] != head_input.shape[-1]:
            raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {head_input.shape[-1]}, "
                             f"got weight of shape {tuple(weight.shape)}")
        if weight.shape[0] == 0:
            raise ValueError("weight must have at least one row (V >= 1)")
        if weight.dtype != head_input.dtype:
            raise TypeError(f"weight must have the dtype of hidden ({head_input.dtype}), got {weight.dtype}")
        if bias is not None:
            _checks.floating(bias, "bias")
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
            if bias.dtype != head_input.dtype:
                raise TypeError(f"bias must have the dtype of hidden ({head_input.dtype}), got {bias.dtype}")
    elif head_input.shape[-1] == 0:
        raise ValueError("logits must have at least one entry per token (V >= 1)")
    _checks.same_device((head_input, head_name), (weight, "weight"), (labels, "labels"), (bias, "bias"),
                        (old_logp, "old_logp"))
    # the policy options and the per-token tensors are checked by policy_loss's own validation; old_logp stands
    # in for the log-probs this op computes (same shape) and, when the entropy bonus is on, for the entropy
    entropy_stand_in = old_logp if policy_kwargs["entropy_coef"] != 0 else None
    popt = losses._validate_policy(logp=old_logp, old_logp=old_logp, advantages=advantages, mask=mask,
                                   ref_logp=ref_logp, entropy=entropy_stand_in, **policy_kwargs)
    return FusedPolicyOptions(_checks.positive(temperature, "temperature"), int(ignore_index),
                              *dataclasses.astuple(popt), *grads)


# ---------------------------------------------------------------- chunked computation (torch)


def _chunks(B: int, T: int, V: int, ratio: str) -> list[tuple[int, int]]:
    """Token ranges ``[t0, t1)`` of the flattened ``[B·T]`` tokens: runs of any length for ``ratio="token"``,
    whole sequences for ``"sequence"``, each within ``_CHUNK_BYTES`` of float32 tiles where possible."""
    per_token = 3 * 4 * max(V, 1)  # two float32 tiles, and a third while the entropy's Σ p·d is formed
    budget_tokens = max(1, _CHUNK_BYTES // per_token)
    N = B * T
    if ratio == "sequence":
        step = max(1, budget_tokens // max(T, 1)) * T
    else:
        step = budget_tokens
    return [(t0, min(N, t0 + step)) for t0 in range(0, N, max(step, 1))]


def _policy_chunk(lp, ent, old, adv, m, ref, unit_w, opt: FusedPolicyOptions):
    """The policy loss's own implementation on one chunk laid out as ``[U, L]`` units (one token per unit for
    ``ratio="token"``, whole sequences for ``"sequence"``): returns ``(partials [U, C, NSLOTS], coef_logp [U, L],
    coef_ent [U, L] or None)``, the coefficients being dL/dlogp and dL/dentropy of the whole batch's loss (the
    chunk's per-unit gradients times the unit's aggregation weight ``unit_w`` [U])."""
    run = _backend.implementation(losses._POLICY_IMPLS, lp)
    partials, g_logp, _g_ref, g_ent = run(lp, old, adv, m, ref, ent if opt.with_entropy else None, opt.policy)
    w = unit_w.unsqueeze(-1)  # [U, 1]
    return partials, g_logp * w, (g_ent * w if opt.with_entropy else None)


def _tile_stats(z: torch.Tensor, labels: torch.Tensor, opt: FusedPolicyOptions):
    """On a float32 logits tile ``z`` [n, V] (already divided by the temperature), in place: ``z`` becomes
    ``d = z - max`` and a second tile ``e = exp(d)``. Returns ``(d, e, s [n], log_s [n], logp [n],
    entropy [n], valid [n])`` (``s = Σ e``) with logp/entropy 0 at ignored labels (as linear_logprobs gives)."""
    lowest = torch.finfo(z.dtype).min
    V = z.shape[1]
    row_max = z.amax(1).clamp(min=lowest)  # [n]; an all -inf row gets a finite max (p = 0, not NaN)
    d = z.sub_(row_max.unsqueeze(1))  # [n, V]
    e = torch.exp(d)  # [n, V]
    s = e.sum(1)  # [n]
    log_s = torch.log(s)  # [n]
    valid = labels != opt.ignore_index  # [n]
    safe = torch.where(valid & (labels >= 0) & (labels < V), labels, torch.zeros_like(labels))  # [n]
    logp = d.gather(1, safe.unsqueeze(1)).squeeze(1) - log_s  # [n]
    # Σ e·d; e·d is NaN only where d = -inf (e = 0, p log p counts 0 there)
    entropy = log_s - torch.nansum(e * d, 1) / s if opt.with_entropy else torch.zeros_like(logp)  # [n]
    zero = torch.zeros_like(logp)
    return d, e, s, log_s, torch.where(valid, logp, zero), torch.where(valid, entropy, zero), valid


def _dz_in_place(d, e, labels, valid, s, log_s, logp, entropy, coef_logp, coef_ent, inv_t: float):
    """``dL/dz`` for the tile (``z`` the raw logits before the temperature), written into ``e``: off the label
    ``p_j (a + c log p_j)`` with ``a = -(g + g_H·H)/T``, ``c = -g_H/T``; at the label
    ``(g (1 - p_y) - g_H p_y (log p_y + H))/T``, with ``1 - p_y = -expm1(log p_y)`` (no cancellation).
    ``coef_logp`` / ``coef_ent`` [n] are dL/dlogp and dL/dentropy (None: no entropy term)."""
    zero = torch.zeros((), dtype=e.dtype, device=e.device)
    g = torch.where(valid, coef_logp, zero)  # [n]
    inv_s = s.reciprocal().unsqueeze(1)  # [n, 1] 1/s (exp(-log s) would carry ulp(log s) into every p)
    if coef_ent is None:
        dz = e.mul_(inv_s * (-g * inv_t).unsqueeze(1))  # [n, V] -p_j g / T
        at_y = g * -torch.expm1(logp) * inv_t  # [n]
    else:
        gh = torch.where(valid, coef_ent, zero)  # [n]
        a = (-(g + gh * entropy) * inv_t).unsqueeze(1)  # [n, 1]
        c = (-gh * inv_t).unsqueeze(1)  # [n, 1]
        log_p = d.clamp_(min=_EXP_ZERO_BELOW).sub_(log_s.unsqueeze(1))  # [n, V], in place of d
        dz = e.mul_(inv_s).mul_(log_p.mul_(c).add_(a))  # [n, V] p (a + c log p)
        lp_finite = torch.where(logp == float("-inf"), zero, logp)  # p_y log p_y is 0 where p_y = 0
        at_y = (g * -torch.expm1(logp) - gh * torch.exp(logp) * (lp_finite + entropy)) * inv_t  # [n]
    rows = valid.nonzero().squeeze(1)  # [k]
    dz[rows, labels[rows]] = at_y[rows]
    return dz


def _unit_layout(t0: int, t1: int, T: int, opt: FusedPolicyOptions):
    """``[U, L]`` shape of a chunk's units: a row of one per token (token ratio) or whole sequences."""
    n = t1 - t0
    return (n // T, T) if opt.ratio == "sequence" else (n, 1)


def _run_chunks(tile_fn, apply_fn, cdt, B, T, V, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """The driver both ops share: per chunk, ``tile_fn(t0, t1)`` gives the float32 logits tile [n, V] (divided by
    the temperature), the statistics and the policy coefficients are formed, the tile becomes ``dz`` and
    ``apply_fn(t0, t1, dz)`` consumes it. Returns ``(loss [], metrics [5], logp [N], entropy [N])``."""
    N = B * T
    dev = labels.device
    m_bt = mask != 0  # [B, T]
    tokens = m_bt.sum(-1, dtype=torch.float32)  # [B]
    w_b = reference.agg_weights(tokens, opt.agg, T, opt.norm_length).to(torch.float32)  # [B]
    w_tok = w_b.repeat_interleave(T)  # [N]: each token's sequence weight
    flat = lambda x: x.reshape(N) if x is not None else None  # noqa: E731
    y, old, m = labels.reshape(N), flat(old_logp).float(), flat(mask)
    adv = advantages.float()
    adv = (adv.unsqueeze(-1).expand(B, T) if adv.dim() == 1 else adv).reshape(N)  # [N]
    ref = None if ref_logp is None else flat(ref_logp).float()
    logp_all = torch.zeros(N, dtype=cdt, device=dev)  # [N] (float64 for float64 inputs, as linear_logprobs)
    ent_all = torch.zeros(N, dtype=cdt, device=dev)  # [N]
    parts = []
    inv_t = 1.0 / opt.temperature
    for t0, t1 in _chunks(B, T, V, opt.ratio):
        U, L = _unit_layout(t0, t1, T, opt)
        unit = lambda x: x[t0:t1].reshape(U, L)  # noqa: E731  (a batch-wide [N] tensor's part in this chunk)
        z = tile_fn(t0, t1)  # [n, V] float32
        d, e, s, log_s, lp, ent, valid = _tile_stats(z, y[t0:t1], opt)
        logp_all[t0:t1], ent_all[t0:t1] = lp, ent
        unit_w = w_tok[t0:t1].reshape(U, L)[:, 0]  # [U]
        partials, c_lp, c_ent = _policy_chunk(lp.reshape(U, L), ent.reshape(U, L), unit(old), unit(adv), unit(m),
                                              None if ref is None else unit(ref), unit_w, opt)
        parts.append((partials.sum(1) * unit_w.unsqueeze(-1), partials.sum(1)))  # weighted and raw [U, NSLOTS]
        if opt.grad_input or opt.grad_weight or opt.grad_bias:
            dz = _dz_in_place(d, e, y[t0:t1], valid, s, log_s, lp, ent, c_lp.reshape(-1),
                              None if c_ent is None else c_ent.reshape(-1), inv_t)  # [n, V]
            apply_fn(t0, t1, dz)
    if parts:
        weighted = torch.cat([p[0] for p in parts])  # [units, NSLOTS]
        raw = torch.cat([p[1] for p in parts])  # [units, NSLOTS]
        loss = weighted[:, operator.index(losses.SLOT_LOSS)].sum()
        totals = raw.sum(0)  # [NSLOTS]
    else:
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        totals = torch.zeros(operator.index(losses.NSLOTS), dtype=torch.float32, device=dev)
    return loss, losses._masked_means(totals, losses._POLICY_METRIC_SLOTS), logp_all, ent_all


def _linear_torch(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    """Three GEMMs over chunks; returns ``(loss, metrics [5], logp [B, T], entropy [B, T], d_hidden [B, T, H]
    or [0], d_weight [V, H] or [0], d_bias [V] or [0])``."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    N = B * T
    cdt = reference.compute_dtype(hidden)  # float32 (float64 for float64 inputs)
    h = hidden.reshape(N, H)  # [N, H]
    w = weight.to(cdt)  # [V, H]; no copy for float32
    inv_t = 1.0 / opt.temperature
    b = None if bias is None else bias.to(cdt) * inv_t  # [V]
    # the gradients stay in float32 until the backward has scaled them by the upstream gradient (one rounding to
    # a 16-bit dtype, not two); d_hidden is O(N·H) float32, d_weight the float32 accumulator described above
    d_hidden = torch.empty(N, H, dtype=cdt, device=hidden.device) if opt.grad_input else None  # [N, H]
    d_weight = torch.zeros(V, H, dtype=cdt, device=hidden.device) if opt.grad_weight else None  # [V, H]
    d_bias = torch.zeros(V, dtype=cdt, device=hidden.device) if opt.grad_bias else None  # [V]

    def tile(t0, t1):
        h_c = h[t0:t1].to(cdt)  # [n, H]
        if b is None:
            return torch.mm(h_c, w.T).mul_(inv_t)  # [n, V] GEMM 1
        return torch.addmm(b, h_c, w.T, alpha=inv_t)

    def apply(t0, t1, dz):  # dz [n, V] = dL/dz of the raw logits (the 1/T is inside)
        if d_hidden is not None:
            d_hidden[t0:t1] = dz @ w  # GEMM 2
        if d_weight is not None:
            d_weight.addmm_(dz.T, h[t0:t1].to(cdt))  # GEMM 3
        if d_bias is not None:
            d_bias.add_(dz.sum(0))

    loss, metrics, logp, ent = _run_chunks(tile, apply, cdt, B, T, V, labels, old_logp, advantages, mask, ref_logp, opt)
    empty = lambda: hidden.new_empty(0)  # noqa: E731  (a fresh [0] per output: outputs may not alias)
    return (loss, metrics, logp.reshape(B, T), ent.reshape(B, T),
            empty() if d_hidden is None else d_hidden.reshape(B, T, H),
            empty() if d_weight is None else d_weight,
            empty() if d_bias is None else d_bias)


def _logits_torch(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """Two passes over the logits; returns ``(loss, metrics [5], logp [B, T], entropy [B, T], d_logits [B, T, V]
    or [0])``."""
    B, T, V = logits.shape
    N = B * T
    cdt = reference.compute_dtype(logits)
    z_all = logits.reshape(N, V)  # [N, V]
    inv_t = 1.0 / opt.temperature
    d_logits = torch.empty(N, V, dtype=logits.dtype, device=logits.device) if opt.grad_input else None  # [N, V]

    def tile(t0, t1):
        return z_all[t0:t1].to(cdt) * inv_t  # [n, V] (a copy: the caller's logits are never written)

    def apply(t0, t1, dz):
        d_logits[t0:t1] = dz

    loss, metrics, logp, ent = _run_chunks(tile, apply, cdt, B, T, V, labels, old_logp, advantages, mask, ref_logp, opt)
    empty = logits.new_empty(0)
    return (loss, metrics, logp.reshape(B, T), ent.reshape(B, T),
            empty if d_logits is None else d_logits.reshape(B, T, V))


_LINEAR_IMPLS = {"torch": _linear_torch}
_LOGITS_IMPLS = {"torch": _logits_torch}


# ---------------------------------------------------------------- torch.library ops with autograd

_LINEAR_TENSORS = ("Tensor hidden, Tensor weight, Tensor labels, Tensor old_logp, Tensor advantages, Tensor mask, "
                   "Tensor? ref_logp, Tensor? bias")
_LOGITS_TENSORS = "Tensor logits, Tensor labels, Tensor old_logp, Tensor advantages, Tensor mask, Tensor? ref_logp"


@torch.library.custom_op("rlkernels::linear_policy_loss", mutates_args=(),
                         schema=op_schema(_LINEAR_TENSORS, FusedPolicyOptions,
                                          "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _linear_op(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, *options):
    """-> (loss [], metrics [5], logp [B, T], entropy [B, T], d_hidden [B, T, H] or [0], d_weight [V, H] or [0],
    d_bias [V] or [0]): the gradients of the loss itself (upstream 1)."""
    opt = FusedPolicyOptions(*options)
    labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)  # [B, T] int64 (CPU: range checked)
    with _backend.float32_compute(hidden.device):
        return _backend.implementation(_LINEAR_IMPLS, hidden)(hidden, weight, labels, old_logp, advantages, mask,
                                                               ref_logp, bias, opt)


@_linear_op.register_fake
def _(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, *options):
    opt = FusedPolicyOptions(*options)
    B, T, H = hidden.shape
    f32 = dict(dtype=torch.float32)
    cdt = reference.compute_dtype(hidden)
    return (hidden.new_empty((), **f32), hidden.new_empty((len(losses.POLICY_METRICS),), **f32),
            hidden.new_empty((B, T), **f32), hidden.new_empty((B, T), **f32),
            hidden.new_empty((B, T, H), dtype=cdt) if opt.grad_input else hidden.new_empty(0),
            weight.new_empty(weight.shape, dtype=cdt) if opt.grad_weight else hidden.new_empty(0),
            hidden.new_empty(bias.shape, dtype=cdt) if opt.grad_bias and bias is not None else hidden.new_empty(0))


@torch.library.custom_op("rlkernels::logits_policy_loss", mutates_args=(),
                         schema=op_schema(_LOGITS_TENSORS, FusedPolicyOptions, "(Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _logits_op(logits, labels, old_logp, advantages, mask, ref_logp, *options):
    """-> (loss [], metrics [5], logp [B, T], entropy [B, T], d_logits [B, T, V] or [0])."""
    opt = FusedPolicyOptions(*options)
    labels = _checks.labels(labels, logits.shape[-1], opt.ignore_index)  # [B, T] int64
    with _backend.float32_compute(logits.device):
        return _backend.implementation(_LOGITS_IMPLS, logits)(logits, labels, old_logp, advantages, mask, ref_logp, opt)


@_logits_op.register_fake
def _(logits, labels, old_logp, advantages, mask, ref_logp, *options):
    opt = FusedPolicyOptions(*options)
    B, T, _V = logits.shape
    f32 = dict(dtype=torch.float32)
    return (logits.new_empty((), **f32), logits.new_empty((len(losses.POLICY_METRICS),), **f32),
            logits.new_empty((B, T), **f32), logits.new_empty((B, T), **f32),
            torch.empty_like(logits, memory_format=torch.contiguous_format) if opt.grad_input else logits.new_empty(0))


def _no_double_backward():
    if torch.is_grad_enabled():  # create_graph=True: the stored gradients are constants, not functions of inputs
        raise RuntimeError("linear_policy_loss / logits_policy_loss do not support double backward "
                           "(create_graph=True): their gradients are formed in the forward as constants")


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[4:7])
    ctx.has_bias = inputs[7] is not None
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype, None if inputs[7] is None else inputs[7].dtype)
    ctx.mark_non_differentiable(*output[1:7])


def _linear_backward(ctx, d_loss, *_unused):
    _no_double_backward()
    d_hidden, d_weight, d_bias = ctx.saved_tensors  # compute dtype (float32; float64 for float64 inputs)
    dt_hidden, dt_weight, dt_bias = ctx.dtypes

    def scale(g, dtype):  # [0]: not computed (the input needs no gradient)
        return None if g.numel() == 0 and g.dim() == 1 else (g * d_loss.to(g.dtype)).to(dtype)

    grads = (scale(d_hidden, dt_hidden), scale(d_weight, dt_weight), None, None, None, None, None,
             scale(d_bias, dt_bias) if ctx.has_bias else None)
    return grads + no_grads(FusedPolicyOptions)


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def _logits_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.mark_non_differentiable(*output[1:5])


def _logits_backward(ctx, d_loss, *_unused):
    _no_double_backward()
    (d_logits,) = ctx.saved_tensors
    if d_logits.numel() == 0 and d_logits.dim() == 1:  # not computed
        return (None,) * 6 + no_grads(FusedPolicyOptions)
    # scaled in float32; for 16-bit logits the stored gradient was rounded once already, so an upstream gradient
    # other than 1 (loss.backward() passes 1) rounds it a second time
    grad = (d_logits.to(torch.promote_types(d_logits.dtype, torch.float32)) * d_loss).to(d_logits.dtype)
    return (grad, None, None, None, None, None) + no_grads(FusedPolicyOptions)


_logits_op.register_autograd(_logits_backward, setup_context=_logits_setup)


# ---------------------------------------------------------------- public functions


def _metrics_dict(metrics, logp, entropy, opt: FusedPolicyOptions, has_ref: bool) -> dict:
    out = dict(zip(losses.POLICY_METRICS, metrics.detach()))
    if not has_ref:
        del out["kl"]
    if not opt.with_entropy:
        del out["entropy"]
    out["token_logp"] = logp.detach()
    if opt.with_entropy:
        out["token_entropy"] = entropy.detach()
    return out


def _reference_linear(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    if not torch.compiler.is_compiling():
        labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)
    out = reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=opt.temperature,
                                    return_entropy=opt.with_entropy, ignore_index=opt.ignore_index)
    return _reference_policy(out, old_logp, advantages, mask, ref_logp, opt)


def _reference_logits(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    if not torch.compiler.is_compiling():
        labels = _checks.labels(labels, logits.shape[-1], opt.ignore_index)
    out = reference.logprobs(logits, labels, temperature=opt.temperature, return_entropy=opt.with_entropy,
                             ignore_index=opt.ignore_index)
    return _reference_policy(out, old_logp, advantages, mask, ref_logp, opt)


def _reference_policy(out, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    logp, entropy = out if opt.with_entropy else (out, None)
    loss, metrics = reference.policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy,
                                          **dataclasses.asdict(opt.policy))
    metrics = dict(metrics)
    metrics["token_logp"] = logp.detach().float()
    if entropy is not None:
        metrics["token_entropy"] = entropy.detach().float()
    return loss, metrics


_POLICY_DOC_ARGS = """
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the policy that sampled them (a constant).
        advantages: ``[B, T]`` or ``[B]`` (a constant).
        mask: ``[B, T]`` bool or 0/1 float; 1 where a token counts.
        temperature: divides the logits (> 0).
        clip_low, clip_high, dual_clip, ratio, ref_logp, kl_coef, kl_estimator, entropy_coef, agg, norm_length:
            as in :func:`rlkernels.policy_loss` (``ref_logp`` ``[B, T]`` is a constant). With ``entropy_coef``
            set, the entropy of the same softmax enters the loss (as ``policy_loss(..., entropy=...)``).
        ignore_index: a label equal to it gives log-prob 0 and entropy 0 and no gradient, as in
            :func:`rlkernels.linear_logprobs` (mask such tokens out as well unless a log-prob of 0 is meant).
"""

_RETURNS_DOC = """
    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar; ``metrics`` what :func:`rlkernels.policy_loss` reports
        (``clipfrac``, ``approx_kl``, ``ratio_mean``, ``kl`` with ``ref_logp``, ``entropy`` with
        ``entropy_coef``) plus ``token_logp`` ``[B, T]`` float32, the detached per-token log-probs (and
        ``token_entropy`` ``[B, T]`` with ``entropy_coef``), so logging needs no second pass.

    The backward only multiplies the gradients formed in the forward by the upstream scalar: a second
    backward (``retain_graph=True``) gives the same gradients; double backward (``create_graph=True``)
    raises. Gradients are computed only for inputs that require them (with grad mode on).
"""


def linear_policy_loss(
    hidden: torch.Tensor,  # [B, T, H]
    weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [B, T] int
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T] or [B]
    mask: torch.Tensor,  # [B, T]
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    ref_logp: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    norm_length: float | None = None,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
):
    """The PPO/GRPO policy loss from final hidden states through the LM head, in three GEMMs.

    Equal (to float32 rounding, forward and backward) to::

        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                                              return_entropy=True)
        rlkernels.policy_loss(logp, old_logp, advantages, mask, ..., entropy=ent if entropy_coef else None)

    but the head's gradient is formed during the forward (the loss is known then), which saves the backward's
    logits recomputation: three GEMMs instead of four, and never an ``[N, V]`` tensor (chunks of tokens;
    whole sequences with ``ratio="sequence"``).

    Args:
        hidden: ``[B, T, H]`` final hidden states at the positions that predict ``labels`` (float32/bf16/fp16).
        weight: ``[V, H]`` output embedding (``lm_head.weight``), same dtype and device.
        labels: ``[B, T]`` integer token ids in ``[0, V)`` (or ``ignore_index``).
        bias: optional ``[V]`` output bias.""" + _POLICY_DOC_ARGS + """
        process_group, vocab_start: the vocabulary split over a process group, as in
            :func:`rlkernels.linear_logprobs` (``weight``/``bias`` the rank's slice, ``hidden``, ``labels`` and the
            per-token tensors the same on every rank): the log-probs and entropy are merged across ranks first
            (one collective), then the policy loss runs on them, replicated on every rank
            (:mod:`rlkernels.vocab_parallel`; four GEMMs there, not three). ``d_hidden`` is all-reduced over
            the group in the backward.
""" + _RETURNS_DOC
    policy_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, norm_length=norm_length)
    grad_on = torch.is_grad_enabled()
    grads = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    opt = _validate(head_input=hidden, head_name="hidden", weight=weight, labels=labels, bias=bias,
                    old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp, temperature=temperature,
                    ignore_index=ignore_index, policy_kwargs=policy_kwargs, grads=grads)
    constants = (old_logp.detach(), advantages.detach(), mask.detach(), None if ref_logp is None else ref_logp.detach())
    if process_group is not None or vocab_start is not None:  # the vocabulary split over a process group
        from rlkernels import vocab_parallel

        vocab_start = vocab_parallel.check_group(process_group, vocab_start, weight.shape[0])
        return vocab_parallel.linear_policy_loss(hidden, weight, labels, *constants, bias, opt, process_group,
                                                 vocab_start)
    with _backend.float32_compute(hidden.device):
        if _backend.serves_reference(_LINEAR_IMPLS, hidden):
            return _reference_linear(hidden, weight, labels, *constants, bias, opt)
        loss, metrics, logp, ent, *_ = _linear_op(hidden, weight, labels.long(), *constants, bias,
                                                   *dataclasses.astuple(opt))
    return loss, _metrics_dict(metrics, logp, ent, opt, ref_logp is not None)


def logits_policy_loss(
    logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T] int
    old_logp: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, T] or [B]
    mask: torch.Tensor,  # [B, T]
    *,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    ref_logp: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    norm_length: float | None = None,
    ignore_index: int = -100,
):
    """The PPO/GRPO policy loss from logits a caller already holds, with ``d_logits`` written in the forward.

    Equal (to float32 rounding, forward and backward) to
    ``rlkernels.policy_loss(rlkernels.logprobs(logits, labels, temperature=..., return_entropy=...), ...)``,
    but the logits are read once (statistics and loss, chunk by chunk) and their gradient written once, in the
    forward: two passes over ``[B, T, V]`` instead of three. The gradient has the dtype of ``logits`` and is
    held from the forward to the backward (a ``[B, T, V]`` tensor, as the two-op path's backward would allocate).
    For 16-bit logits it is rounded to their dtype in the forward, so an upstream gradient other than 1
    (``loss.backward()`` passes 1) rounds it a second time when the backward scales it.

    Args:
        logits: ``[B, T, V]`` float32/bf16/fp16 logits (not divided by the temperature).
        labels: ``[B, T]`` integer token ids in ``[0, V)`` (or ``ignore_index``).""" + _POLICY_DOC_ARGS + _RETURNS_DOC
    policy_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, norm_length=norm_length)
    grads = (torch.is_grad_enabled() and logits.requires_grad, False, False)
    opt = _validate(head_input=logits, head_name="logits", weight=None, labels=labels, bias=None, old_logp=old_logp,
                    advantages=advantages, mask=mask, ref_logp=ref_logp, temperature=temperature,
                    ignore_index=ignore_index, policy_kwargs=policy_kwargs, grads=grads)
    constants = (old_logp.detach(), advantages.detach(), mask.detach(), None if ref_logp is None else ref_logp.detach())
    with _backend.float32_compute(logits.device):
        if _backend.serves_reference(_LOGITS_IMPLS, logits):
            return _reference_logits(logits, labels, *constants, opt)
        loss, metrics, logp, ent, _ = _logits_op(logits, labels.long(), *constants, *dataclasses.astuple(opt))
    return loss, _metrics_dict(metrics, logp, ent, opt, ref_logp is not None)
