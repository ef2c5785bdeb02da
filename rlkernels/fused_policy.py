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
longer than the budget still takes one chunk, ``T·V`` floats). The torch row's one-chunk layout (below) takes every
token at once, so every sequence is whole there.

Torch row, per chunk (CPU): ONE compute-dtype ``[chunk, V]`` logits tile, held as vocabulary blocks (:class:`_Tile`).
Pass 1 fills each block (GEMM 1; a 16-bit weight widened ``_WIDEN_ROWS`` rows at a time, never a float32 copy of
the weight) and reduces it while it is in cache; pass 2 re-centres each block on the row max, turns it into ``dz``
(``exp`` recomputed rather than stored) and runs GEMMs 2 and 3 on it right away. Three layouts on the CPU
(:func:`_torch_layout`):

- one chunk (CPU, ``d_weight`` wanted, ``N <= H`` for float32, ``N <= H/2`` for 16-bit weights -- a GRPO
  minibatch of a few sequences on a small model): all ``N`` tokens at once, the tile held in the tail of
  ``d_weight``'s own buffer, which pass 2 overwrites from the front block by block (each block's ``d_weight`` rows
  formed over every token and written once: rounded once to a 16-bit weight's dtype, so no float32 ``[V, H]``
  buffer exists). Memory beyond the gradients: one scratch block (8 MiB float32) and ``[_WIDEN_ROWS, H]`` float32
  buffers for 16-bit weights; the GEMMs run at ``M = N`` (not a 42-token chunk);
- chunks of tokens with a tile of their own (``_CHUNK_BYTES``, or the float32 ``[N, H]`` size when larger) in
  ~2 MiB blocks, ``d_weight`` accumulated over the chunks in float32 ``[V, H]``: the gradient itself for a float32
  weight. Taken for float32 weights when the chunks hold at least ``_MIN_CHUNK_TOKENS`` tokens, and wherever no
  ``d_weight`` is wanted (a frozen head: two GEMMs);
- the two-op path itself (:func:`_two_op`: ``linear_logprobs`` + ``policy_loss``, four GEMMs, the head's gradient
  formed in the backward) for 16-bit weights beyond the one-chunk tile and for float32 weights whose chunks would
  be smaller. Why three GEMMs cannot go further here: no ``dz`` exists before a token's whole vocabulary row has
  been reduced, so between GEMM 1 and GEMM 3 either every token's logits are held (``N·V`` float32) or ``d_weight``
  is summed over chunks of tokens -- in float32, which for 16-bit weights is a float32 ``[V, H]`` buffer beside the
  gradient (the package never holds one; the two-op path runs its backward vocabulary-outer instead), and for small
  chunks means small-M GEMMs that read the weight and read-modify-write ``d_weight`` once per chunk (measured slower
  than four GEMMs; see ``_MIN_CHUNK_TOKENS``). So the three-GEMM saving on the CPU is for ``N <= H`` (or larger
  ``N`` with float32 weights and a large ``N·H``), with no more memory than the two-op path.

The Triton row (CUDA) runs kernels 1 and 2 over chunks of tokens sized to ``_TRITON_CHUNK_BYTES``, in one of three
layouts for 16-bit inputs whose ``d_weight`` is wanted (:func:`_triton_layout`):

- held (``N <= 2H``, or every token within the budget in one chunk): kernel 2 writes each chunk's ``dz`` into one
  ``[N, V]`` buffer in the inputs' dtype, so the chunks hold only the float32 tile; after the last chunk GEMM 2
  (``d_hidden = dz·W``) and GEMM 3 (``d_weight = dzᵀ·h``) each run ONCE over all the tokens, GEMM 3 writing
  ``d_weight`` in the weight's dtype (float32 accumulation inside it, the label entries' residuals added inside
  it, rounded once: ``fused_linear._gemm_with_label_residuals``). The held ``dz`` is ``N·V`` 16-bit values, no
  larger than a float32 ``[V, H]`` buffer (``N·V·2 <= V·H·4``) and not a float32 buffer: the contract's N = 8192,
  H = 4096 takes it (2.5 GB at V = 151936); two full-size GEMMs instead of one small-M GEMM pair per chunk;
- chunks (``N >= V``): a float32 tile and a 16-bit ``dz`` of ``[chunk, V]`` per chunk, GEMM 2 per chunk, and
  ``d_weight`` summed over the chunks in a float32 ``[V, H]`` buffer -- with at least as many tokens as vocabulary
  entries no larger than the float32 ``[N, H]`` ``d_hidden`` (DESIGN: "chunk over V when N < V");
- two-op (``2H < N < V`` beyond one chunk, e.g. N = 16384 tokens at H = 4096, V = 151936): :func:`_two_op`, four
  GEMMs with ``linear_logprobs``' vocabulary-outer backward (beyond the gradients, ``[N, H]`` float32 and a
  bounded ``dz`` chunk). Three GEMMs there would hold, between GEMM 1 and GEMM 3, either every token's ``dz``
  (``N·V`` 16-bit values, more than a float32 ``[V, H]``) or ``d_weight`` summed over chunks of tokens -- in a
  float32 ``[V, H]`` buffer beside the 16-bit gradient, which DESIGN's numerics rule out (and which this layout
  held until 2026-11-28), or in 16 bits, one rounding per chunk, whose error grows as ``sqrt((K + 1) / 2)`` with
  the chunk count K (emulated in float64, ``python -m bench.cpu_chunk_rounding``,
  bench/results/cpu-chunk-rounding-2026-11-27.txt: 0.71x eager's relative error with the float32 accumulator,
  1.11x at 4 chunks, 1.42x at 7, 2.07x at 16). Not built: holding the ``dz`` of the first ``2H`` tokens and
  recomputing the rest's vocabulary-outer (``3 + (N - 2H)/N`` GEMMs with the held layout's memory).

Float32 inputs (and a frozen head) take the chunks, ``dz`` written over the tile; a float32 ``d_weight`` summed
over the chunks is the gradient itself.

``d_hidden`` is float32 ``[N, H]``. The gradients stay in float32 until the backward scales them (one rounding to
a 16-bit dtype), except a 16-bit ``d_weight`` of the held layout (or the torch row's one chunk), rounded in the
forward (an upstream gradient that is not a power of two rounds it a second time); with an upstream gradient of
exactly 1 the backward hands them out without a copy.

``old_logp=None`` is the on-policy update (one epoch, one minibatch): each chunk's old log-probs are its own
log-probs, so the loss equals ``policy_loss(logp, logp.detach(), ...)`` with no separate log-prob pass.

``logits_policy_loss(logits, labels, old_logp, advantages, mask, ...)`` is the same for users who already hold
``[B, T, V]`` logits: ``d_logits`` is written in the forward. Its Triton row (CUDA) reads the logits once and writes
``d_logits`` once; its torch row runs the logprobs op's torch forward (one read), the policy loss, then its torch
backward (a second read, one write) -- see ``_logits_torch`` for why not per chunk.

Backends: ``triton`` (CUDA default for ``linear_policy_loss``; see the Triton kernels section: kernel 1 stores the
chunk's float32 logits tile while reducing it, kernel 2 forms dz from the stored tile, cuBLAS runs GEMMs 2 and 3),
``torch`` (chunked PyTorch, every device; the CPU layouts above) and ``reference`` (:mod:`rlkernels.reference`'s formulas through autograd,
served before the ops). ``logits_policy_loss``'s Triton row (its CUDA default; see the section "Triton row of
logits_policy_loss") is ONE kernel for ``ratio="token"``: each program reads its token's row for the statistics, forms
the loss coefficients in registers and re-reads the row (from L2) to write ``d_logits`` -- the logits read once from
memory, the gradient written once; GSPO runs the logprobs kernels around the policy loss's own implementation.

Order: launchers (validate, chunk, compute) -> torch.library ops -> their autograd.Functions -> public functions.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from rlkernels import _backend, _checks, _extension, losses, reference
from rlkernels import packing as _packing
from rlkernels import fused_linear as _fl
from rlkernels import softmax as _sm
from rlkernels._device import block_sum, expm1
from rlkernels._host import (
    TRITON_DTYPE_NAMES, autograd_function, custom_op, field_values, label_logp, lse_merge, mask_u8, op_schema,
    option_dict, option_values, options_from, refuse_double_backward, unit_stride,
)
from rlkernels._triton import cdiv, jit, tl

# Budget of one chunk's float32 [chunk, V] logits tile (the only chunk-sized buffer): this floor, or the size of
# the float32 [N, H] d_hidden when that is larger (the op holds O(N·H) float32 anyway). At V = 49152 the floor is
# 42 tokens: the tile stays in L3 between its two passes, and the peak stays at the two-op path's (which holds a
# float32 [N, H] d_hidden and a [N, H] copy besides the gradients).
_CHUNK_BYTES = 8 << 20
# Elements of one vocabulary block of the tile (2 MiB float32, as linear_logprobs' torch tile), at least _VBLOCK_MIN wide:
# under load, 512 KiB blocks (the L2 here) cost 2x in the quick CPU bench (4x the small two-thread ops); 2 MiB ones
# matched the two-op path there.
_BLOCK_ELEMS = 1 << 19
_VBLOCK_MIN = 256
# The one-chunk row (_torch_layout: no tile of its own, the scratch block its only block-sized buffer) takes
# blocks this many times wider (8 MiB float32: 8192 columns at N = 256): fewer, larger ops. Side by side at N = 256
# fp32 under load 12 (two threads on 2 cores): 2 MiB blocks 10.1 s, 8 MiB 4.5 s per fwd+bwd (1 MiB: 16.9 s).
_ONE_CHUNK_BLOCK_SCALE = 4
# The "chunks" layout's smallest worthwhile chunk, in tokens (_torch_layout takes "two-op" below it, float32
# weights). Side by side on 2 cores at SmolLM2's head (N = 4096, H = 576, V = 49152, float32, fwd+bwd vs the
# two-op path): chunks of 48 tokens (the 8 MiB / 4·N·H budget) 0.75x, of ~170 tokens 1.12x, of ~530 tokens 1.23x
# (the latter two with 32 / 100 MiB tiles, more memory than the two-op path's); small chunks run small-M GEMMs and
# read the weight and read-modify-write d_weight once per chunk.
_MIN_CHUNK_TOKENS = 128
# Rows of a 16-bit weight widened to float32 at a time (and of d_weight formed in float32 before its one rounding)
# by the torch row's GEMMs: [_WIDEN_ROWS, H] float32 buffers, whatever the block width
_WIDEN_ROWS = 1024


@dataclass(frozen=True)
class FusedPolicyOptions:
    """The validated non-tensor arguments of :func:`linear_policy_loss` / :func:`logits_policy_loss`, under their
    public names, plus which inputs need a gradient. The ops take them as ``*option_values(opt)``."""

    temperature: float  # > 0: divides the logits
    ignore_index: int  # labels equal to it give logp = entropy = 0 and no gradient (as in linear_logprobs)
    return_entropy: bool  # the entropy (metric and token_entropy) also with entropy_coef 0, for logging
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
        """Whether the entropy is computed (and reported): in the loss, or asked for with ``return_entropy``."""
        return self.entropy_coef != 0 or self.return_entropy


# ---------------------------------------------------------------- validation


def _validate(*, head_input, head_name, weight, labels, bias, old_logp, advantages, mask, ref_logp, temperature,
              ignore_index, return_entropy, policy_kwargs, grads) -> FusedPolicyOptions:
    """Checks the arguments of either op (each error names its argument); returns the options."""
    _checks.floating(head_input, head_name)
    _checks.rank(head_input, head_name, 3)
    B, T = head_input.shape[:2]
    _checks.integer(labels, "labels")
    if tuple(labels.shape) != (B, T):
        raise ValueError(f"labels must have shape {head_name}.shape[:2] = {(B, T)}, got {tuple(labels.shape)}")
    if old_logp is not None:
        _checks.floating(old_logp, "old_logp")
        if tuple(old_logp.shape) != (B, T):
            raise ValueError(f"old_logp must have shape {head_name}.shape[:2] = {(B, T)}, "
                             f"got {tuple(old_logp.shape)}")
    if weight is not None:
        _checks.lm_head(head_input, weight, bias)
    elif head_input.shape[-1] == 0:
        raise ValueError("logits must have at least one entry per token (V >= 1)")
    # every tensor against the op's own input: policy_loss's check below would name the log-probs' stand-in,
    # "logp", which the caller never passed
    _checks.same_device((head_input, head_name), (weight, "weight"), (labels, "labels"), (bias, "bias"),
                        (old_logp, "old_logp"), (advantages, "advantages"), (mask, "mask"), (ref_logp, "ref_logp"))
    for t, name in ((mask, "mask"), (ref_logp, "ref_logp")):  # named against the op's own input (no logp is given)
        if isinstance(t, torch.Tensor) and tuple(t.shape) != (B, T):
            raise ValueError(f"{name} must have shape {head_name}.shape[:2] = {(B, T)}, got {tuple(t.shape)}")
    # the policy options and the per-token tensors are checked by policy_loss's own validation; a [B, T] stand-in
    # takes the place of the log-probs this op computes, of old_logp when it is None (on-policy: old = the op's
    # own log-probs) and, when the entropy bonus is on, of the entropy
    stand_in = old_logp if old_logp is not None else head_input.new_empty((B, T), dtype=torch.float32)  # [B, T]
    entropy_stand_in = stand_in if policy_kwargs["entropy_coef"] != 0 else None
    popt = losses._validate_policy(logp=stand_in, old_logp=stand_in, advantages=advantages, mask=mask,
                                   ref_logp=ref_logp, entropy=entropy_stand_in, **policy_kwargs)
    return FusedPolicyOptions(_checks.temperature(temperature), _checks.index(ignore_index, "ignore_index"),
                              _checks.flag(return_entropy, "return_entropy"),
                              *field_values(popt), *grads)


# ---------------------------------------------------------------- chunked computation (torch)


def _chunks(B: int, T: int, V: int, ratio: str, H: int = 0, budget: int | None = None) -> list[tuple[int, int]]:
    """Token ranges ``[t0, t1)`` of the flattened ``[B·T]`` tokens: runs of any length for ``ratio="token"``,
    whole sequences for ``"sequence"``, each with a float32 ``[chunk, V]`` tile within ``budget`` bytes
    (default ``max(_CHUNK_BYTES, 4·N·H)``) where possible (a sequence longer than that still takes one chunk)."""
    N = B * T
    step = _chunk_tokens(B, T, V, ratio, H, budget)
    return [(t0, min(N, t0 + step)) for t0 in range(0, N, step)]


def _chunk_tokens(B: int, T: int, V: int, ratio: str, H: int = 0, budget: int | None = None) -> int:
    """Tokens of every chunk of :func:`_chunks` but the last (at least 1)."""
    budget = max(_CHUNK_BYTES, 4 * B * T * H) if budget is None else budget
    budget_tokens = max(1, budget // (4 * max(V, 1)))
    return max(1, budget_tokens // max(T, 1)) * max(T, 1) if ratio == "sequence" else budget_tokens


def _vblock(n: int, V: int, scale: int = 1) -> int:
    """Width of one vocabulary block of an ``n``-token tile: about ``_BLOCK_ELEMS`` elements (a core's L2), so
    each pass over a block (and the GEMMs that read it right after) finds it in cache."""
    return min(V, max(_VBLOCK_MIN, scale * _BLOCK_ELEMS // max(n, 1)))


def _policy_chunk(lp, ent, old, adv, m, ref, unit_w, opt: FusedPolicyOptions):
    """The policy loss's own implementation on one chunk laid out as ``[U, L]`` units (one token per unit for
    ``ratio="token"``, whole sequences for ``"sequence"``): returns ``(partials [U, C, NSLOTS], coef_logp [U, L],
    coef_ent [U, L] or None)``, the coefficients being dL/dlogp and dL/dentropy of the whole batch's loss (the
    chunk's per-unit gradients times the unit's aggregation weight ``unit_w`` [U])."""
    run = _backend.implementation(losses._POLICY_IMPLS, lp)
    partials, g_logp, _g_ref, g_ent = run(lp, old, adv, m, ref, ent if opt.with_entropy else None, opt.policy)
    w = unit_w.unsqueeze(-1)  # [U, 1]
    return partials, g_logp * w, (g_ent * w if opt.entropy_coef != 0 else None)  # no entropy term: no dz work


def _unit_layout(t0: int, t1: int, T: int, opt: FusedPolicyOptions):
    """``[U, L]`` shape of a chunk's units: a row of one per token (token ratio) or whole sequences."""
    n = t1 - t0
    return (n // T, T) if opt.ratio == "sequence" else (n, 1)


class _Tile:
    """One chunk's float32 logits tile, held as contiguous ``[n, vb]`` vocabulary blocks (block ``j`` covers
    columns ``spans[j]``) in one buffer allocated per call, plus one block-sized scratch buffer.

    Pass 1 (:meth:`stats`) fills each block from ``block_fn`` and, while it is in cache, takes the block's row
    max, ``Σ exp(z - max)``, ``Σ exp(z - max)(z - max)`` and the label's logit (``exp`` goes to the scratch
    buffer; the block keeps ``z - max_block``); the blocks' partials merge by :func:`lse_merge`. Pass 2
    (:meth:`dz_blocks`) re-centres each block on the row max and turns it into ``dz`` in place
    (:func:`rlkernels.fused_linear._dz_tile`, recomputing ``exp`` rather than storing it), block by block, each
    handed to the caller's GEMMs while it is in cache. So the chunk holds ONE float32 ``[n, V]`` tile."""

    def __init__(self, n_max: int, V: int, cdt: torch.dtype, device, buf: torch.Tensor | None = None):
        self.V = V
        self.vb = _vblock(n_max, V, _ONE_CHUNK_BLOCK_SCALE if buf is not None else 1)
        self.spans = [(v0, min(V, v0 + self.vb)) for v0 in range(0, V, self.vb)]
        S = len(self.spans)
        # the tile, [n, V] in blocks; ``buf`` (n_max·V elements of cdt): memory the caller lends, which it may
        # overwrite from the front while pass 2 runs (:func:`_torch_layout`'s one chunk), so pass 2 then hands out
        # every dz from the scratch buffer, never from the tile
        self.lent = buf is not None
        self.buf = torch.empty(n_max * V, dtype=cdt, device=device) if buf is None else buf
        self.scratch = torch.empty(n_max * self.vb, dtype=cdt, device=device)  # one block's exp
        self.part = torch.empty(4, S, n_max, dtype=cdt, device=device)  # per block: max, Σ e, Σ e·d, label's z

    def blocks(self, n: int):
        return [self.buf[n * v0:n * v1].view(n, v1 - v0) for v0, v1 in self.spans]  # each [n, vb_j]

    def stats(self, t0, t1, block_fn, labels, with_entropy: bool, opt: FusedPolicyOptions):
        """Pass 1 over the chunk's ``n`` tokens; returns ``(row_max, log_s, logp, entropy)`` [n] each (logp and
        entropy 0 at ignored labels, entropy 0 without ``with_entropy``)."""
        n, V, vb = labels.shape[0], self.V, self.vb
        lowest = torch.finfo(self.buf.dtype).min
        safe = torch.where((labels >= 0) & (labels < V), labels, torch.zeros_like(labels))  # [n]
        block_of_y = torch.div(safe, vb, rounding_mode="floor")  # [n]
        col = (safe - block_of_y * vb)[:, None]  # [n, 1] the label's column within its block
        last = self.spans[-1][1] - self.spans[-1][0]
        col_last = col.clamp(max=last - 1)  # stays inside the narrower last block
        p_m, p_s, p_u, p_z = (x[:, :n] for x in self.part.unbind(0))  # each [S, n]
        S = len(self.spans)
        for j, ((v0, v1), z) in enumerate(zip(self.spans, self.blocks(n))):
            block_fn(v0, v1, z)  # z [n, vb_j] <- logits / T
            torch.gather(z, 1, col if j < S - 1 else col_last, out=p_z[j].unsqueeze(1))
            torch.amax(z, 1, out=p_m[j])
            torch.clamp(p_m[j], min=lowest, out=p_m[j])  # an all -inf block: finite max, p = 0 (not NaN)
            z.sub_(p_m[j].unsqueeze(1))  # d = z - max_block, kept for pass 2
            e = torch.exp(z, out=self.scratch[:z.numel()].view_as(z))  # [n, vb_j]
            torch.sum(e, 1, out=p_s[j])
            if with_entropy:  # Σ e·d; NaN only where d = -inf (e = 0: p log p counts 0 there)
                torch.nansum(e.mul_(z), 1, out=p_u[j])
        m_all, s_all, u_all = lse_merge(p_m, p_s, p_u if with_entropy else None)  # [n] each
        log_s = torch.log(s_all)  # [n]
        entropy = log_s - u_all / s_all if with_entropy else torch.zeros_like(log_s)  # [n]
        zy = p_z.gather(0, block_of_y[None]).squeeze(0)  # [n]
        logp = label_logp(zy, m_all, s_all)  # [n] as an accurate log_softmax forms it (never z - one rounded lse)
        logp, entropy, _ = _fl._finish(logp, entropy, None, labels, V, opt)
        self._m_blocks = p_m
        return m_all, log_s, logp, entropy

    def dz_blocks(self, coef_logp, coef_ent, labels, row_max, log_s, logp, entropy, opt: FusedPolicyOptions):
        """Pass 2: yields ``(v0, v1, dz, None)`` per block, ``dz`` [n, vb_j] = dL/dz of the raw logits written in place
        of the block (off the label ``p (a + c log p)``, the label's entry exact; see :func:`_dz_coefficients`)."""
        n, V, vb = labels.shape[0], self.V, self.vb
        stats = torch.stack((row_max, log_s))  # [2, n]
        g_ent = coef_ent if coef_ent is not None else torch.zeros_like(coef_logp)  # [n]
        row_max, a2, c2, a_s, at_y, valid, use_ent = _fl._dz_coefficients(coef_logp, g_ent, labels, stats, entropy,
                                                                          logp, V, self.buf.dtype, opt)
        safe = torch.where(valid, labels, torch.zeros_like(labels))  # [n]
        tok, cols, vals, starts = _fl._labels_by_chunk(valid, safe, at_y, vb, len(self.spans))
        coef = (a2[:, None], c2[:, None], a_s[:, None], self.scratch)
        for j, ((v0, v1), d) in enumerate(zip(self.spans, self.blocks(n))):
            shift = (row_max - self._m_blocks[j]).unsqueeze(1)  # [n, 1]: d_block - shift = z - row max
            k0, k1 = starts[j], starts[j + 1]
            dz = _fl._dz_tile(d, shift, coef, (tok[k0:k1], cols[k0:k1], vals[k0:k1]), use_ent)  # [n, vb_j]
            if self.lent and dz.data_ptr() != self.scratch.data_ptr():  # without the entropy term dz is in d
                dz = self.scratch[:dz.numel()].view_as(dz).copy_(dz)
            yield v0, v1, dz, None


def _run_chunks(chunk_fn, tile, cdt, B, T, V, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions,
                chunks):
    """The driver every backend shares, over the token ranges ``chunks`` (:func:`_chunks`). Per chunk
    ``chunk_fn(t0, t1)`` gives ``(block_fn, apply_fn)``; ``tile`` (:class:`_Tile`, or :class:`_TritonTile`)
    forms the statistics (pass 1; the torch tile calls ``block_fn(v0, v1, out)`` to write the float32 logits,
    divided by the temperature, of vocabulary columns ``[v0, v1)`` into ``out`` [n, v1 - v0]); the policy
    coefficients are formed; then the tile yields ``dz`` block by block and ``apply_fn(v0, v1, dz, resid)``
    consumes each (pass 2; ``resid`` [n]: the Triton row's float32 label residual for 16-bit inputs, else
    None). ``old_logp`` None (on-policy): each chunk's old log-probs are its own log-probs (ratio 1, gradient the
    policy gradient). Returns ``(loss [], metrics [5], logp [N], entropy [N])``."""
    N = B * T
    dev = labels.device
    m_bt = mask != 0  # [B, T]
    tokens = m_bt.sum(-1, dtype=torch.float32)  # [B]
    w_b = reference.agg_weights(tokens, opt.agg, T, opt.norm_length).to(torch.float32)  # [B]
    w_tok = w_b.repeat_interleave(T)  # [N]: each token's sequence weight
    flat = lambda x: x.reshape(N) if x is not None else None  # noqa: E731
    y, m = labels.reshape(N), flat(mask)  # [N] each
    old = None if old_logp is None else flat(old_logp).float()  # [N] or None (on-policy)
    adv = advantages.float()
    adv = (adv.unsqueeze(-1).expand(B, T) if adv.dim() == 1 else adv).reshape(N)  # [N]
    ref = None if ref_logp is None else flat(ref_logp).float()
    logp_all = torch.zeros(N, dtype=cdt, device=dev)  # [N] (float64 for float64 inputs, as linear_logprobs)
    ent_all = torch.zeros(N, dtype=cdt, device=dev)  # [N]
    parts = []
    for t0, t1 in chunks:
        U, L = _unit_layout(t0, t1, T, opt)
        unit = lambda x: x[t0:t1].reshape(U, L)  # noqa: E731  (a batch-wide [N] tensor's part in this chunk)
        block_fn, apply_fn = chunk_fn(t0, t1)
        y_c = y[t0:t1]  # [n]
        row_max, log_s, lp, ent = tile.stats(t0, t1, block_fn, y_c, opt.with_entropy, opt)  # [n] each
        logp_all[t0:t1], ent_all[t0:t1] = lp, ent
        unit_w = w_tok[t0:t1].reshape(U, L)[:, 0]  # [U]
        old_c = lp.reshape(U, L) if old is None else unit(old)  # [U, L]: on-policy, old = this chunk's own logp
        partials, c_lp, c_ent = _policy_chunk(lp.reshape(U, L), ent.reshape(U, L), old_c, unit(adv), unit(m),
                                              None if ref is None else unit(ref), unit_w, opt)
        parts.append((partials.sum(1) * unit_w.unsqueeze(-1), partials.sum(1)))  # weighted and raw [U, NSLOTS]
        if opt.grad_input or opt.grad_weight or opt.grad_bias:
            for v0, v1, dz, resid in tile.dz_blocks(c_lp.reshape(-1), None if c_ent is None else c_ent.reshape(-1),
                                                    y_c, row_max, log_s, lp, ent, opt):
                apply_fn(v0, v1, dz, resid)  # dz [n, v1 - v0]
    if parts:
        weighted = torch.cat([p[0] for p in parts])  # [units, NSLOTS]
        raw = torch.cat([p[1] for p in parts])  # [units, NSLOTS]
        loss = weighted[:, operator.index(losses.SLOT_LOSS)].sum()
        totals = raw.sum(0)  # [NSLOTS]
    else:
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        totals = torch.zeros(operator.index(losses.NSLOTS), dtype=torch.float32, device=dev)
    return loss, losses._masked_means(totals, losses._POLICY_METRIC_SLOTS), logp_all, ent_all


def _torch_layout(hidden: torch.Tensor, weight: torch.Tensor, opt: FusedPolicyOptions) -> str:
    """How the torch row runs on the CPU with ``d_weight`` wanted (``"chunks"`` everywhere else):

    - ``"one-chunk"``: all ``N`` tokens as ONE chunk whose compute-dtype ``[N, V]`` logits tile lives in the tail of
      ``d_weight``'s own ``[V, H]`` buffer, when it fits there: ``N·c <= H·w`` bytes (``c``/``w`` the compute and
      weight itemsizes: ``N <= H`` for float32, ``N <= H/2`` for 16-bit weights). No tile is allocated, GEMMs 1
      and 2 run over all ``N`` tokens at once, and each ``d_weight`` block is written once (``dzᵀ·h`` over every
      token, in the compute dtype, rounded once to the weight's dtype: no float32 ``[V, H]`` accumulator). Pass 2
      writes ``d_weight``'s block ``[v0, v1)`` over bytes ``[v0·H·w, v1·H·w)``; the tile's blocks not yet read
      start at ``V·H·w - N·V·c + v1·N·c``, which is past that since ``(V - v1)(H·w - N·c) >= 0`` (the block being
      read is first moved to the scratch buffer, :class:`_Tile`). Where ``V·H`` is odd (16-bit weights: ``H`` odd,
      so ``H·w - N·c = 2(H - 2N) >= 2`` bytes) the tile starts one weight element earlier, at a whole float32, and
      ``(V - v1)(H·w - N·c) >= 2`` bytes still holds for every block before the last.
    - ``"two-op"``: no three-GEMM op at all, but :func:`_two_op` (``linear_logprobs`` then ``policy_loss``: four
      GEMMs, the two-op path's memory, the head's gradient formed in the backward). Taken (a) for 16-bit weights
      that the tile does not fit: three GEMMs then need either a tile of every token (``N·V`` float32, larger than
      the weight) or a float32 ``[V, H]`` accumulator beside the 16-bit gradient, which the package never holds;
      (b) for float32 weights when the chunks would hold fewer than ``_MIN_CHUNK_TOKENS`` tokens (see there:
      small chunks made three GEMMs slower than four).
    - ``"chunks"``: chunks of tokens, each with a tile of its own, ``d_weight`` (float32) accumulated over them.

    On a GPU (the torch row forced there by ``RLKERNELS_BACKEND=torch``) no one-chunk layout: ``"two-op"`` for
    16-bit weights with fewer tokens than vocabulary entries (as :func:`_triton_layout`), else ``"chunks"``.

    The register_fake row follows it for ``d_weight``'s dtype (the weight's for ``"one-chunk"``, float32
    otherwise; :func:`_d_weight_dtype`, which has the Triton row's rule too)."""
    N, H = hidden.shape[0] * hidden.shape[1], hidden.shape[2]  # hidden [B, T, H]
    if not opt.grad_weight or N == 0:
        return "chunks"
    if hidden.device.type != "cpu":  # (the torch row forced on a GPU) the Triton row's rule without its held dz
        return "two-op" if weight.dtype.itemsize < 4 and N < weight.shape[0] else "chunks"
    c = reference.compute_dtype(hidden).itemsize
    if N * c <= H * weight.dtype.itemsize:
        return "one-chunk"
    if weight.dtype.itemsize < c:
        return "two-op"
    tokens = _chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0], opt.ratio, H)
    return "two-op" if tokens < _MIN_CHUNK_TOKENS else "chunks"


def _policy_on_logprobs(logp, entropy, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """The two-op path's second half, with this op's metrics: :func:`rlkernels.policy_loss` on differentiable
    ``logp`` and ``entropy`` [B, T] (from :func:`rlkernels.linear_logprobs`, single-process or vocabulary-parallel),
    the entropy used only when ``opt.with_entropy``. Returns ``(loss, metrics)``."""
    ent = entropy if opt.with_entropy else None  # [B, T] or None
    old_logp = logp.detach() if old_logp is None else old_logp  # on-policy (old_logp=None): ratio 1
    loss, metrics = losses.policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=ent,
                                       **option_dict(opt.policy))
    metrics = dict(metrics, token_logp=logp.detach().float())  # what the three-GEMM op reports
    if ent is not None:
        metrics["token_entropy"] = ent.detach().float()
    return loss, metrics


def _two_op(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    """The ``"two-op"`` layout (:func:`_torch_layout`): :func:`rlkernels.linear_logprobs` (its torch row: the
    vocabulary-outer backward, each ``d_weight`` slice summed over the tokens in float32 and written once, at
    backward time, so a 16-bit gradient is rounded once whatever the upstream gradient) then the policy loss."""
    hidden = _finite_unused_rows(hidden, labels, mask, opt)  # [B, T, H]: as the three-GEMM op cleans it
    # linear_logprobs saves hidden, which autograd refuses for an inference tensor; the three-GEMM op saves no
    # input, so it takes one: so does this layout (not while traced: dynamo cannot trace is_inference)
    if not _checks._tracing() and hidden.is_inference():
        hidden = hidden.clone()  # [B, T, H]
    out = _fl.linear_logprobs(hidden, weight, labels, bias=bias, temperature=opt.temperature,
                              return_entropy=opt.with_entropy, ignore_index=opt.ignore_index)
    logp, entropy = out if opt.with_entropy else (out, None)  # [B, T] each
    loss, metrics = _policy_on_logprobs(logp, entropy, old_logp, advantages, mask, ref_logp, opt)
    return _ComposedLoss.apply(loss), metrics


class _ComposedLoss(torch.autograd.Function):
    """The loss of a ``linear_policy_loss`` composed of other ops (:func:`_two_op`, the vocabulary-parallel
    route), passed through: its backward runs first, so a double backward is refused in the name of the op the
    user called, not of the ``policy_loss`` it is made of."""

    @staticmethod
    def forward(loss):  # [] float32
        return loss.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):  # [] float32
        refuse_double_backward("linear_policy_loss")
        return grad


def _linear_torch(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    """Three GEMMs over chunks of tokens, each chunk over vocabulary blocks (:class:`_Tile`); returns ``(loss,
    metrics [5], logp [B, T], entropy [B, T], d_hidden [B, T, H] or [0], d_weight [V, H] or [0], d_bias [V] or
    [0])``, the gradients in float32 (float64 for float64 inputs), but ``d_weight`` in the weight's dtype in the
    ``"one-chunk"`` layout (:func:`_torch_layout`)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    N = B * T
    dev = hidden.device
    cdt = reference.compute_dtype(hidden)  # float32 (float64 for float64 inputs)
    h = hidden.reshape(N, H)  # [N, H]
    b = None if bias is None else bias.to(cdt)  # [V]
    in_grad = _torch_layout(hidden, weight, opt) == "one-chunk"
    # the gradients stay in float32 until the backward has scaled them by the upstream gradient (one rounding to
    # a 16-bit dtype, not two), but for a one-chunk d_weight (in_grad: written once, in the weight's dtype);
    # d_hidden is O(N·H) float32; d_weight is written by the first chunk (no zero fill), then accumulated
    d_hidden = torch.empty(N, H, dtype=cdt, device=dev) if opt.grad_input else None  # [N, H]
    d_weight = (torch.empty(V, H, dtype=weight.dtype if in_grad else cdt, device=dev)
                if opt.grad_weight else None)  # [V, H]
    d_bias = torch.zeros(V, dtype=cdt, device=dev) if opt.grad_bias else None  # [V]
    chunks = [(0, N)] if in_grad else _chunks(B, T, V, opt.ratio, H)
    n_max = max((t1 - t0 for t0, t1 in chunks), default=0)
    tile_buf = None
    if in_grad:  # the tile: the last N·V compute-dtype elements' worth of d_weight's buffer
        flat = d_weight.view(-1)  # [V·H]
        per = cdt.itemsize // weight.dtype.itemsize  # weight elements per compute-dtype element
        start = flat.numel() - N * V * per
        start -= start % per  # a whole compute-dtype element in (V·H odd with 16-bit weights: one element earlier)
        tile_buf = flat[start:start + N * V * per].view(cdt)  # [N·V]
    tile = _Tile(n_max, V, cdt, dev, buf=tile_buf)
    # a 16-bit weight is widened _WIDEN_ROWS rows at a time (never a float32 copy of the weight; a view for
    # float32), and a one-chunk 16-bit d_weight formed that many rows at a time in float32, then rounded once
    wide = weight.dtype != cdt
    dw_buf = (torch.empty(_WIDEN_ROWS * H, dtype=cdt, device=dev)
              if d_weight is not None and d_weight.dtype != cdt else None)  # [_WIDEN_ROWS·H]

    def rows(v0, v1):  # yields (c0, c1, weight rows [c1 - c0, H] in cdt) covering the block [v0, v1), one at a time
        step = _WIDEN_ROWS if wide else v1 - v0
        for c0 in range(v0, v1, step):
            c1 = min(v1, c0 + step)
            yield c0, c1, weight[c0:c1].to(cdt)

    def chunk(t0, t1):
        h_c = h[t0:t1].to(cdt)  # [n, H]
        dh_c = None if d_hidden is None else d_hidden[t0:t1]  # [n, H], summed over the blocks
        first_chunk = t0 == chunks[0][0]

        def block(v0, v1, out):  # GEMM 1 into out [n, v1 - v0]
            for c0, c1, w_c in rows(v0, v1):
                _fl._logits_into(out[:, c0 - v0:c1 - v0], h_c, w_c, None if b is None else b[c0:c1], opt.temperature)

        def apply(v0, v1, dz, _resid):  # dz [n, vb] = dL/dz of the raw logits (the 1/T is inside)
            for c0, c1, w_c in rows(v0, v1):
                dz_c = dz[:, c0 - v0:c1 - v0]  # [n, c1 - c0]
                if dh_c is not None:  # GEMM 2; the first block writes (no zero fill)
                    torch.addmm(dh_c, dz_c, w_c, beta=0 if c0 == 0 else 1, out=dh_c)
                if d_weight is not None:  # GEMM 3; the first chunk writes (no zero fill)
                    dw = d_weight[c0:c1]  # [c1 - c0, H]
                    if dw_buf is not None:  # one chunk, 16-bit: the rows over all tokens, rounded once
                        dw.copy_(torch.mm(dz_c.T, h_c, out=dw_buf[:dw.numel()].view(dw.shape)))
                    else:
                        torch.addmm(dw, dz_c.T, h_c, beta=0 if first_chunk else 1, out=dw)
            if d_bias is not None:
                d_bias[v0:v1] += dz.sum(0)

        return block, apply

    loss, metrics, logp, ent = _run_chunks(chunk, tile, cdt, B, T, V, labels, old_logp, advantages, mask, ref_logp,
                                           opt, chunks)
    empty = lambda: hidden.new_empty(0)  # noqa: E731  (a fresh [0] per output: outputs may not alias)
    if d_weight is not None and not chunks:  # no tokens: no chunk wrote it
        d_weight.zero_()
    return (loss, metrics, logp.reshape(B, T), ent.reshape(B, T),
            empty() if d_hidden is None else d_hidden.reshape(B, T, H),
            empty() if d_weight is None else d_weight,
            empty() if d_bias is None else d_bias)


class _LogprobsTile:
    """The engine of ``logits_policy_loss`` for :func:`_run_chunks` (its torch row), over ONE chunk of all ``N``
    tokens: the logprobs op's own forward (:mod:`rlkernels.softmax`, ``forward``) gives the statistics, and its
    backward (``backward_into``) writes ``d_logits`` in place, so :func:`_run_chunks`' apply step has nothing to do.
    The logits go in as their ``[O, I, V]`` view (:func:`rlkernels.softmax._as_rows`: no copy unless their strides
    need one)."""

    def __init__(self, logits, d_logits, opt: FusedPolicyOptions, forward, backward_into):
        self.rows = _sm._as_rows(logits)  # [O, I, V]
        self.d_rows = None if d_logits is None else d_logits.view(self.rows.shape)  # [O, I, V] (contiguous)
        self.sopt = _sm.LogprobsOptions(opt.temperature, opt.with_entropy, opt.ignore_index)
        self.forward, self.backward_into = forward, backward_into

    def stats(self, t0, t1, _block_fn, labels, with_entropy: bool, opt: FusedPolicyOptions):
        assert (t0, t1) == (0, labels.shape[0])
        logp, ent, st = self.forward(self.rows, labels.view(self.rows.shape[:2]), self.sopt)  # [O, I] each
        self.st = st  # [O, I, 2] (max logit, shifted sum)
        flat = st.reshape(-1, 2)  # [N, 2]
        return flat[:, 0], torch.log(flat[:, 1]), logp.reshape(-1), ent.reshape(-1)

    def dz_blocks(self, coef_logp, coef_ent, labels, row_max, log_s, logp, entropy, opt: FusedPolicyOptions):
        g_ent = torch.zeros_like(coef_logp) if coef_ent is None else coef_ent  # [N]
        shape = self.rows.shape[:2]
        # a token without gradient (masked out) is passed as ignored: its d_logits row is then exactly 0 without
        # its logits being read, where 0 · (their NaN/inf) would reach the gradient
        quiet = (coef_logp == 0) & (g_ent == 0)  # [N]
        labels = torch.where(quiet, torch.full_like(labels, opt.ignore_index), labels)  # [N]
        self.backward_into(self.d_rows, self.rows, labels.view(shape), self.st, entropy.view(shape),
                           coef_logp.view(shape), g_ent.view(shape), self.sopt)
        yield 0, self.rows.shape[-1], self.d_rows, None


def _logits_with(forward, backward_into):
    """A row of ``logits_policy_loss`` from a logprobs forward/backward pair (:class:`_LogprobsTile`)."""

    def run(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
        B, T, V = logits.shape
        d_logits = (torch.empty(B, T, V, dtype=logits.dtype, device=logits.device)
                    if opt.grad_input else None)  # [B, T, V]
        tile = _LogprobsTile(logits, d_logits, opt, forward, backward_into)
        chunks = [(0, B * T)] if B * T else []
        loss, metrics, logp, ent = _run_chunks(lambda t0, t1: (None, lambda *_: None), tile,
                                               reference.compute_dtype(logits), B, T, V, labels.reshape(-1),
                                               old_logp, advantages, mask, ref_logp, opt, chunks)
        empty = logits.new_empty(0)
        return loss, metrics, logp.reshape(B, T), ent.reshape(B, T), empty if d_logits is None else d_logits

    return run


# The torch row of logits_policy_loss: the logprobs op's torch forward over all tokens (one read of the logits), the
# policy loss once, then its torch backward writing d_logits (a second read, one write). Interleaving the two per
# chunk of tokens, so that a chunk is read once while in cache, measured slower here (2 cores, 32 MiB L3, N = 512
# and 2048, V = 32000, float32: 0.59x / 0.57x the two-op path with 2 MiB chunks, 0.79x / 0.73x with 8 MiB ones,
# 1.09x / 1.03x with this one chunk): each chunk costs about a millisecond of small ops (the policy loss, the
# statistics' bookkeeping), more than the memory pass it saves.
_logits_torch = _logits_with(_sm._torch_forward, _sm._torch_backward_into)


# ---------------------------------------------------------------- Triton kernels
#
# The Triton row keeps the three-GEMM structure with the logits tile in global memory: kernel 1 is
# linear_logprobs' own forward kernel (fused_linear._fwd_kernel with STORE_Z: GEMM 1 in the same float32
# accumulation, each [BLOCK_N, BLOCK_V] tile folded into online statistics -- row max, Σ exp, Σ exp·d, the label's
# logit) which also stores the float32 tile in a [chunk, V] workspace; the host merges the vocabulary splits'
# partials and runs the policy loss's own implementation for the per-token coefficients; kernel 2
# (_dz_from_tile_kernel) reads the stored tile back (no GEMM: this is where the two-op path recomputes the logits)
# and writes dz in the inputs' dtype through fused_linear's _dz_store, the backward's one dz formula (the label
# entry's 16-bit rounding error kept in float32). GEMMs 2 and 3 are cuBLAS
# (torch.mm on the dz chunk, float32 output for 16-bit inputs), as in linear_logprobs' Triton backward.
# Kernel 1 follows linear_logprobs' forward choice (RLKERNELS_LINEAR_FWD, fused_linear._fwd_kernel_choice): the Hopper
# forward storing the tile by TMA ("tma", sm_90's default), _fwd_kernel ("split"), or for 16-bit inputs "cublas": a
# cuBLAS GEMM writing the raw logits into the tile, then rlkernels.softmax's forward kernel reading it (kernel 2
# divides that tile by T itself). Prediction for "cublas", not a measurement: kernel 1 ~17.3 ms at N=8192 H=4096
# V=151936 bf16 on an H200 (linear_logprobs' "cublas" forward, the same GEMM and pass: 17.31 ms in
# bench/results/NVIDIA_H200-2026-11-27.md) against the Hopper kernel 1's 19.5, fwd+bwd ~53.6 ms (1.19x three GEMMs)
# against 55.8 (1.24x); bench_fused_policy's "rlkernels kernel 1 cublas" and phase rows measure it.


# Tiles, the largest found to compile with no register spills (0 B local memory) on sm_80 and sm_90, aligned and
# unaligned (tests/test_fused_policy.py::test_aot_compiles_every_config_without_spills, tests/test_aot_aligned.py).
# Kernel 2 is elementwise over the stored tile (no GEMM): fused_linear's _dz_from_tile_kernel and its tiles
# (_TILE_DZ). Kernel 1 holds the float32 accumulator while it stores it: linear_logprobs' forward tiles
# (128 x 128 x 32 on 16 warps for 16-bit, 64 x 64 x 16 for float32) spilled 88-272 B and 32 B with the store;
# 64 x 128 x 32 on 8 warps fits for 16-bit, float32 below (its BLOCK_K need not match anything: the tile is
# stored, never recomputed).
_STATS_TILES_16 = _fl._Tiles(block_n=64, block_v=128, block_k=32, split_tiles=64, num_warps=8, num_stages=3)
# float32: K = 16 (Triton 3.6, on the GPU machines, refuses a dot with K < 16) on 32-token blocks: 64-token blocks
# with K = 16 spill on sm_90 (Triton 3.9: 8-32 B, aligned or not); 32 x 64 x 16 on 8 warps. 3 stages: with 2 it held
# 80-134 registers with no spill until the grid was grouped (_fl._grouped_item: the split is a computed value held
# through the loop, no longer re-read from a special register), when sm_90's unaligned build with a bias was held
# to 128 registers for 2 CTAs per SM and spilled 8 B (Triton 3.9); with 3 stages ptxas builds it for 1 CTA per SM
_STATS_TILES = {torch.float32: _fl._Tiles(block_n=32, block_v=64, block_k=16, split_tiles=64, num_warps=8,
                                          num_stages=3),
                torch.bfloat16: _STATS_TILES_16, torch.float16: _STATS_TILES_16}
# Before Hopper, 16-bit: 64 x 64 x 32 on 8 warps (213-221 registers unaligned, 126-127 aligned, no spill; Triton 3.6
# and 3.9). 64 x 128 sat at 255 registers there, and once the grid was grouped Triton 3.6's unaligned build with a
# bias spilled 8 B (64 x 128 on 16 warps: 40-64 B).
_STATS_TILES_16_PRE_HOPPER = _fl._Tiles(block_n=64, block_v=64, block_k=32, split_tiles=128, num_warps=8,
                                        num_stages=3)


def _stats_tiles(dtype: torch.dtype, hopper: bool = True) -> _fl._Tiles:
    """Kernel 1's tiles for this input dtype; ``hopper=False``: a GPU before sm_90 (the interpreter takes Hopper's)."""
    if dtype != torch.float32 and not hopper:
        return _STATS_TILES_16_PRE_HOPPER
    return _STATS_TILES[dtype]
# the Triton row's [chunk, V] workspaces (the float32 tile, and a 16-bit dz beside it) stay under this
_TRITON_CHUNK_BYTES = 1 << 30


def aot_configs() -> list:
    """Every (kernel, constexprs, warps, stages) the Triton row can launch on a GPU, for the AOT compile tests.
    Kernel 1 takes linear_logprobs' forward tiles (the same GEMM and online statistics, plus the tile's store)."""
    from rlkernels.testing.aot import KernelConfig

    configs = []
    for dtype, ty in TRITON_DTYPE_NAMES.items():
        for has_bias in (False, True):
            for arch in (80, 90):
                t = _stats_tiles(dtype, hopper=arch >= 90)
                consts = {**_fl._kernel_flags(dtype, has_bias, False, t), "SPLIT_TILES": t.split_tiles,
                          "STORE_Z": True}
                configs.append(KernelConfig(_fl._fwd_kernel,
                                            {**_fl._fwd_signature(ty), **dict.fromkeys(consts, "constexpr")},
                                            consts, t.num_warps, t.num_stages, archs=(arch,)))
            if dtype != torch.float32:  # sm_90's kernel 1 (_TritonTile): the Hopper forward storing the tile
                configs.append(_fl.fwd_tma_config(ty, has_bias, store_z=True))
        configs.extend(_fl.dz_from_tile_configs(ty))  # kernel 2 (the raw tile: after the cuBLAS kernel 1)
        scale = {"BLOCK": _SCALE_BLOCK, "INTERPRETED": False}  # the backward's upstream gradient (_scale_in_place)
        configs.append(KernelConfig(_scale_unless_one_kernel, {"x_ptr": f"*{ty}", "scale_ptr": "*fp32", "numel": "i64",
                                                               "iters": "i32", **dict.fromkeys(scale, "constexpr")},
                                    scale, 8, 3))
    return configs + _logits_aot_configs()


# logits_policy_loss's one kernel: its flag sets that bound the register use (the most terms: a KL estimator, the
# entropy bonus and d_logits; the fewest; the forward only, on-policy), at the logprobs kernels' tiles. Its loops
# are the two passes over a row, BLOCK_V logits per iteration each, so its per-element SASS figure is the sum of
# the two (tests/test_aot_budgets.py).
_LOGITS_FLAG_SETS = (
    dict(ON_POLICY=False, HAS_REF=True, KL_EST=reference.KL_ESTIMATORS.index("k3"), HAS_ENT=True, ENT_GRAD=True,
         WRITE_GRAD=True),
    dict(ON_POLICY=False, HAS_REF=False, KL_EST=0, HAS_ENT=False, ENT_GRAD=False, WRITE_GRAD=True),
    dict(ON_POLICY=True, HAS_REF=True, KL_EST=0, HAS_ENT=True, ENT_GRAD=False, WRITE_GRAD=False),
)


def _logits_aot_configs() -> list:
    from rlkernels.testing.aot import KernelConfig

    return [KernelConfig(_logits_policy_kernel, _logits_kernel_signature(ty),
                         {**flags, **_sm._fwd_constexprs(cfg, ty), "INTERPRETED": False}, cfg.num_warps, cfg.num_stages,
                         elements=cfg.block_v)
            for ty in TRITON_DTYPE_NAMES.values() for cfg in _sm._LAUNCH_CONFIGS for flags in _LOGITS_FLAG_SETS]


class _TritonTile:
    """The Triton row's chunk engine (same interface as :class:`_Tile`): kernel 1 fills the float32 ``[n, V]``
    tile and the per-split statistics, kernel 2 turns it into ``dz`` (one block: the whole vocabulary), in the
    inputs' dtype with the label residual for 16-bit inputs: into a ``[n_max, V]`` buffer of its own, or with
    ``dz_all`` (``[N, V]``, the held layout) into the chunk's rows of that."""

    def __init__(self, n_max: int, hidden, weight, bias, opt: FusedPolicyOptions, dz_all=None):
        # [N, H] (unit stride), [V, H], [V] (unit stride, as the kernels read it) or None
        self.h, self.w, self.b = hidden, weight, None if bias is None else bias.contiguous()
        self.dz_all = dz_all  # [N, V] inputs' dtype or None
        self.t0 = 0  # the first token of the chunk whose statistics were formed last (stats)
        V = weight.shape[0]
        self.V = V
        # kernel 1 (fused_linear's forward choice, _fl._fwd_kernel_choice): on sm_90 with 16-bit inputs ("tma") the
        # Hopper forward with STORE_Z (TMA loads, wgmma m64n128, the tile stored by TMA: its rows of V float32 must
        # be 16-byte aligned, V % 4 == 0); "cublas" (16-bit): cuBLAS writes the raw logits into the tile and
        # rlkernels.softmax's forward kernel reads it for the statistics (kernel 2 then divides by T itself); else
        # _fwd_kernel with STORE_Z
        choice = _fl._fwd_kernel_choice(hidden, weight)
        self.kernel_1 = "split" if choice == "tma" and V % 4 else choice
        self.t = _fl._TMA_TILES if self.kernel_1 == "tma" else _stats_tiles(hidden.dtype, hopper=_fl._hopper(hidden))
        self.S = cdiv(V, self.t.split_tiles * self.t.block_v)
        dev = hidden.device
        self.low = hidden.dtype != torch.float32
        self.z = torch.empty(n_max * V, dtype=torch.float32, device=dev)  # the tile, [n, V]
        own_dz = self.low and dz_all is None
        self.dz = torch.empty(n_max * V, dtype=hidden.dtype, device=dev) if own_dz else self.z  # [n, V]
        self.resid = torch.zeros(n_max, dtype=torch.float32, device=dev)  # [n]
        self.part = _fl._partials_buffer(self.S, n_max, dev)  # m, s, u, zy per split (_fl._partials_views)
        self.flags = None if self.kernel_1 != "split" else _fl._kernel_flags(
            hidden.dtype, bias is not None, _fl._dot_f32(hidden), self.t)  # _fwd_kernel's
        self.opt = opt

    def stats(self, t0, t1, _block_fn, labels, with_entropy: bool, opt: FusedPolicyOptions):
        n, V, t = t1 - t0, self.V, self.t
        self.t0 = t0
        h_c = self.h[t0:t1]  # [n, H]
        if self.kernel_1 == "cublas":
            return self._cublas_stats(h_c, labels, with_entropy, opt)
        part = _fl._partials_views(self.part, self.S, n)  # [S, n] each, contiguous for this chunk's n
        if self.kernel_1 == "tma":
            _fl._launch_fwd_tma(h_c, self.w, labels, self.b, part, opt.temperature, z=self.z[:n * V].view(n, V))
        else:
            _fl._fwd_kernel.launch(
                (cdiv(n, t.block_n) * self.S,), h_c, self.w, self.b if self.b is not None else self.w, labels,
                self.z, part[0], part[1], part[2], part[3], n, V, h_c.shape[1], h_c.stride(0), self.w.stride(0),
                opt.temperature, **self.flags, SPLIT_TILES=t.split_tiles, STORE_Z=True, num_warps=t.num_warps,
                num_stages=t.num_stages)
        m, s, u, zy = part  # [S, n] each
        m_all, s_all, u_all = lse_merge(m, s, u)  # [n] each
        log_s = torch.log(s_all)  # [n]
        entropy = log_s - u_all / s_all if with_entropy else torch.zeros_like(log_s)  # [n]
        logp = label_logp(zy.sum(0), m_all, s_all)  # [n]
        logp, entropy, _ = _fl._finish(logp, entropy, None, labels, V, opt)
        return m_all, log_s, logp, entropy

    def _cublas_stats(self, h_c, labels, with_entropy: bool, opt: FusedPolicyOptions):
        """Kernel 1 as "cublas": the chunk's raw logits into the tile (float32, cuBLAS), then rlkernels.softmax's
        forward kernel over it (one read); returns :meth:`stats`' four [n] rows."""
        from rlkernels import softmax

        n, V = h_c.shape[0], self.V
        z = self.z[:n * V].view(n, V)  # [n, V] float32
        _fl._cublas_logits(h_c, self.w, self.b, out=z)
        sm_opt = softmax.LogprobsOptions(temperature=opt.temperature, return_entropy=with_entropy,
                                         ignore_index=opt.ignore_index)
        logp, entropy, st = softmax._triton_forward(z, labels, sm_opt)  # [n], [n], [n, 2] = (max z, Σ exp)
        row_max = st[:, 0] / opt.temperature  # [n] the max of z / T
        logp, entropy, _ = _fl._finish(logp, entropy, None, labels, V, opt)
        return row_max, torch.log(st[:, 1]), logp, entropy

    def dz_blocks(self, coef_logp, coef_ent, labels, row_max, log_s, logp, entropy, opt: FusedPolicyOptions):
        n, V = labels.shape[0], self.V
        g_ent = coef_ent if coef_ent is not None else torch.zeros_like(coef_logp)  # [n]
        resid = self.resid[:n].zero_()  # [n]
        # [n, V]: the chunk's rows of the held dz (its pointer 16-byte aligned where t0·V is a multiple of 8, as at
        # every vocabulary that is; another V may build a second variant of kernel 2 for some chunks), or our own
        dz = self.dz[:n * V].view(n, V) if self.dz_all is None else self.dz_all[self.t0:self.t0 + n]
        _fl.launch_dz_from_tile(self.z[:n * V].view(n, V), labels, row_max, log_s, entropy, coef_logp, g_ent, dz,
                                resid, opt.temperature, opt.ignore_index, col0=0, raw=self.kernel_1 == "cublas")
        yield 0, V, dz, (resid if self.low else None)


def _triton_chunks(B: int, T: int, V: int, ratio: str, dtype: torch.dtype, held: bool) -> list[tuple[int, int]]:
    """The Triton row's token chunks: the float32 ``[chunk, V]`` tile, and for 16-bit inputs outside the held
    layout (:func:`_holds_dz`) a ``dz`` of their dtype beside it, within ``_TRITON_CHUNK_BYTES``."""
    per_token = V * (4 + (dtype.itemsize if dtype != torch.float32 and not held else 0))
    return _chunks(B, T, V, ratio, budget=_TRITON_CHUNK_BYTES // per_token * 4 * V)


def _holds_dz(B: int, T: int, H: int, V: int, ratio: str, dtype: torch.dtype, grad_weight: bool) -> bool:
    """Whether the Triton row holds every token's ``dz`` (``[B·T, V]`` in the 16-bit inputs' dtype) and runs GEMMs
    2 and 3 once after the chunks, ``d_weight`` written in the weight's dtype (the module docstring's held layout):
    for 16-bit inputs whose ``d_weight`` is wanted, when that ``dz`` is no larger than the float32 ``[V, H]``
    accumulator it replaces (``N <= 2H``), or when the tokens' tile and ``dz`` fit the chunk budget at once (one
    chunk: the same memory as before it was held)."""
    if dtype == torch.float32 or not grad_weight:
        return False
    N = B * T
    return N * V * dtype.itemsize <= V * H * 4 or len(_triton_chunks(B, T, V, ratio, dtype, held=False)) <= 1


def _triton_layout(B: int, T: int, H: int, V: int, ratio: str, dtype: torch.dtype, grad_weight: bool) -> str:
    """How the Triton row runs (the module docstring's layouts): ``"held"`` (:func:`_holds_dz`); ``"chunks"`` for
    float32 inputs (the float32 ``d_weight`` summed over the chunks is the gradient itself), a frozen head (no
    ``d_weight``), and 16-bit inputs with at least as many tokens as vocabulary entries (``N >= V``: the float32
    ``[V, H]`` accumulator is then no larger than the float32 ``[N, H]`` ``d_hidden``, DESIGN's "chunk over V when
    N < V"); ``"two-op"`` for 16-bit inputs with ``2H < N < V`` beyond one chunk: :func:`_two_op`
    (``linear_logprobs`` + ``policy_loss``, four GEMMs, the vocabulary-outer backward), since three GEMMs there
    would hold a float32 ``[V, H]`` accumulator beside the 16-bit gradient, or a held ``dz`` larger than it."""
    if dtype == torch.float32 or not grad_weight:
        return "chunks"
    if _holds_dz(B, T, H, V, ratio, dtype, grad_weight):
        return "held"
    return "chunks" if B * T >= V else "two-op"


def _layout(hidden: torch.Tensor, weight: torch.Tensor, opt: FusedPolicyOptions) -> str:
    """The layout of the backend that serves ``hidden`` (``[B, T, H]``): :func:`_triton_layout` or
    :func:`_torch_layout`; ``"two-op"`` is served by :func:`_two_op` instead of the three-GEMM op."""
    if _backend.resolve(hidden.device, tuple(_LINEAR_IMPLS), hidden.dtype) == "triton":
        B, T, H = hidden.shape
        return _triton_layout(B, T, H, weight.shape[0], opt.ratio, hidden.dtype, opt.grad_weight)
    return _torch_layout(hidden, weight, opt)


def _d_weight_dtype(hidden: torch.Tensor, weight: torch.Tensor, opt: FusedPolicyOptions) -> torch.dtype:
    """The dtype of the op's stored ``d_weight`` (``hidden`` [B, T, H], ``weight`` [V, H]): the weight's where it is
    written once -- the torch row's ``"one-chunk"`` layout (:func:`_torch_layout`), and the Triton row's held layout
    (:func:`_triton_layout`: GEMM 3 writes it in the weight's dtype, float32 accumulation inside, the label residuals
    added inside it) -- else the compute dtype (float32 summed over the chunks, rounded once in the backward). The
    rows and the fake follow it."""
    return weight.dtype if _layout(hidden, weight, opt) in ("held", "one-chunk") else reference.compute_dtype(hidden)


def _linear_triton(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    """Kernels 1 and 2 (above) per chunk of tokens, cuBLAS for GEMMs 2 and 3; the same outputs as
    :func:`_linear_torch`. The module docstring's layouts (:func:`_triton_layout`): held -- every chunk's ``dz``
    kept, GEMMs 2 and 3 once after the chunks, ``d_weight`` written once in the weight's dtype -- or chunks --
    GEMMs 2 and 3 per chunk, ``d_weight`` summed in float32 (for 16-bit weights only at ``N >= V``; the public op
    sends ``2H < N < V`` to :func:`_two_op` instead of here)."""
    B, T, H = hidden.shape
    V = weight.shape[0]
    N = B * T
    dev = hidden.device
    h = unit_stride(hidden.reshape(N, H))  # [N, H]
    weight = unit_stride(weight)  # [V, H]
    labels = labels.contiguous()
    low = hidden.dtype != torch.float32
    held = _triton_layout(B, T, H, V, opt.ratio, hidden.dtype, opt.grad_weight) == "held"
    chunks = _triton_chunks(B, T, V, opt.ratio, hidden.dtype, held)
    dz_all = torch.empty(N, V, dtype=hidden.dtype, device=dev) if held else None  # [N, V] every token's dz
    resid_all = torch.zeros(N, dtype=torch.float32, device=dev) if held else None  # [N] their label residuals
    d_hidden = None  # [N, H] float32 (held: formed after the chunks)
    if opt.grad_input and not held:
        d_hidden = torch.empty(N, H, dtype=torch.float32, device=dev)
    # chunks: a float32 accumulator (the gradient itself for float32 weights); held: written after the chunks
    d_weight = torch.zeros(V, H, dtype=torch.float32, device=dev) if opt.grad_weight and not held else None
    d_bias = torch.zeros(V, dtype=torch.float32, device=dev) if opt.grad_bias else None  # [V]
    tile = _TritonTile(max((t1 - t0 for t0, t1 in chunks), default=0), h, weight, bias, opt, dz_all=dz_all)
    y_all = labels.reshape(N)  # [N]
    labelled = (y_all != opt.ignore_index) & (y_all >= 0) & (y_all < V)  # [N]
    safe_all = torch.where(labelled, y_all, torch.zeros_like(y_all))  # [N] a column of weight for every token
    # 16-bit: the labelled tokens' runs of equal labels, planned once -- held: of every token (one group, for the
    # GEMM after the chunks); chunks: per chunk (by its first token)
    run_all, run_of = None, {}
    if low and chunks:
        tok = labelled.nonzero().squeeze(1)  # [k] labelled tokens
        if held:
            run_all = _fl._label_runs(torch.zeros_like(tok), y_all[tok], tok, 1, V)[0]
        else:
            ends = torch.tensor([t1 for _, t1 in chunks], device=dev)  # [chunks]
            runs = _fl._label_runs(torch.bucketize(tok, ends, right=True), y_all[tok], tok, len(chunks), V)
            run_of = {t0: run for (t0, _), run in zip(chunks, runs)}

    def chunk(t0, t1):
        h_c = h[t0:t1]  # [n, H]
        safe = safe_all[t0:t1]  # [n]

        def apply(v0, v1, dz, resid):  # dz [n, V] in the inputs' dtype; resid [n] float32 (16-bit) or None
            if held:  # dz is already in dz_all; the GEMMs and the bias's sums run after the chunks
                resid_all[t0:t1] = resid
                return
            if not low:
                if d_hidden is not None:
                    torch.mm(dz, weight, out=d_hidden[t0:t1])  # GEMM 2
                if d_weight is not None:
                    d_weight.addmm_(dz.T, h_c)  # GEMM 3
            else:
                if d_hidden is not None:
                    dh = _fl._mm_f32(dz, weight)  # [n, H] float32
                    dh += resid[:, None] * weight[safe].float()
                    d_hidden[t0:t1] = dh
                if d_weight is not None:
                    t_c = run_of[t0][0] - t0  # [k] the chunk's tokens with a label, by label, as rows of the chunk
                    _fl._addmm_f32(d_weight, dz.T, h_c)
                    _fl._add_run(d_weight, run_of[t0], resid[t_c, None] * h_c[t_c].float())
            if d_bias is not None:
                d_bias.add_(dz.sum(0, dtype=torch.float32))
                if low:
                    _fl._add_run(d_bias, run_of[t0], resid[run_of[t0][0] - t0])

        return None, apply

    loss, metrics, logp, ent = _run_chunks(chunk, tile, torch.float32, B, T, V, labels, old_logp, advantages, mask,
                                           ref_logp, opt, chunks)
    if held:
        del tile  # the float32 tile: not needed by the GEMMs
        if opt.grad_input:  # GEMM 2 over every token, float32 out, the label residuals added
            d_hidden = _fl._mm_f32(dz_all, weight)  # [N, H]
            d_hidden += resid_all[:, None] * weight[safe_all].float()
        alloc = torch.zeros if run_all is None else torch.empty  # no tokens: zeros; else the GEMM sets every entry
        d_weight = alloc(V, H, dtype=weight.dtype, device=dev)  # [V, H]
        if run_all is not None:  # GEMM 3 over every token: d_weight written once, the residuals inside it
            _fl._gemm_with_label_residuals(d_weight, 0, V, dz_all, h, run_all, resid_all[run_all[0]])
        if d_bias is not None:
            d_bias.add_(dz_all.sum(0, dtype=torch.float32))
            if run_all is not None:
                _fl._add_run(d_bias, run_all, resid_all[run_all[0]])
    empty = lambda: hidden.new_empty(0)  # noqa: E731
    return (loss, metrics, logp.reshape(B, T), ent.reshape(B, T),
            empty() if d_hidden is None else d_hidden.reshape(B, T, H),
            empty() if d_weight is None else d_weight,
            empty() if d_bias is None else d_bias)


# ---------------------------------------------------------------- Triton row of logits_policy_loss
#
# ratio="token": ONE kernel, one program per token row. Every token's loss coefficients dL/dlogp and dL/dentropy
# depend only on its own logp and entropy, its per-token inputs (old_logp, advantage, mask, ref_logp) and its
# sequence's aggregation weight (reference.agg_weights, a function of the mask alone, formed on the host first).
# So a program reads its row once for the statistics (softmax._row_forward: max, Σ exp, entropy, the label's
# logit), forms the loss term and the coefficients in registers (losses._token_policy_terms: the policy kernel's
# own per-token math), stores its partial sums, and reads the row a second time -- from L2 on a GPU, the row was
# just read -- to write d_logits (softmax._row_dlogits: the logprobs backward's loop). HBM traffic: the logits once
# and d_logits once, the two-pass memory bound. ratio="sequence" (GSPO): a token's coefficient needs its whole
# sequence's ratio, so the logprobs forward kernel writes the statistics, the policy loss's own implementation
# forms the coefficients, and the logprobs backward kernel writes d_logits (the logits read twice).


@jit
def _logits_policy_kernel(
    logits_ptr,  # [O, I, V] rows at outer/inner strides, last stride 1; fp32/bf16/fp16
    labels_ptr,  # [N] int64
    old_ptr, adv_ptr, ref_ptr,  # [N] fp32 each (old: not read when ON_POLICY; ref: only with HAS_REF)
    mask_ptr,  # [N] uint8 0/1
    w_ptr,  # [B] fp32: each sequence's aggregation weight (N = B·T)
    logp_ptr, ent_ptr,  # [N] fp32 out
    part_ptr,  # [N, NSLOTS] fp32 out: the token's sums in SLOT_* order, the loss already times its weight
    dlogits_ptr,  # [N, V] out, the logits dtype (only with WRITE_GRAD)
    stride_outer, stride_inner, inner, T, V, inv_temp, ignore_index,
    clip_low: tl.float64, clip_high: tl.float64,  # rounded to float32 as the policy kernel rounds them
    dual_clip, kl_coef, entropy_coef,  # dual_clip inf when off
    ON_POLICY: tl.constexpr, HAS_REF: tl.constexpr, KL_EST: tl.constexpr, HAS_ENT: tl.constexpr,
    ENT_GRAD: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
    label = tl.load(labels_ptr + row)
    # pass 1 over the row: the logprobs forward's statistics
    valid, in_range, x_max, s, log_s, logp_raw, logp, ent = _sm._row_forward(row_ptr, label, V, inv_temp,
                                                                            ignore_index, BLOCK_V, ROWS, VEC)
    tl.store(logp_ptr + row, logp)
    tl.store(ent_ptr + row, ent)
    # the token's policy terms, its inputs 0 where masked out (as the policy kernel's _masked_load)
    m = tl.load(mask_ptr + row).to(tl.float32)
    keep = m != 0
    lp = tl.where(keep, logp, 0.0)
    if ON_POLICY:
        old = lp  # old = the token's own log-prob: ratio exactly 1
    else:
        old = tl.where(keep, tl.load(old_ptr + row), 0.0)
    adv = tl.where(keep, tl.load(adv_ptr + row), 0.0)
    ref = 0.0
    if HAS_REF:
        ref = tl.where(keep, tl.load(ref_ptr + row), 0.0)
    e = tl.where(keep, ent, 0.0)
    x, g_pg, g_kl, _dpg, log_ratio, r, clipped, kl = losses._token_policy_terms(
        lp, old, adv, m, ref, 0.0, tl.cast(1.0 - clip_low, tl.float32), tl.cast(1.0 + clip_high, tl.float32),
        dual_clip, kl_coef, HAS_REF, KL_EST, False)
    if HAS_ENT:
        x -= entropy_coef * e
    g = g_pg  # dx/dlogp
    if HAS_REF:
        g += g_kl
    w = tl.load(w_ptr + row // T)
    losses._store_partials(part_ptr + row * losses.NSLOTS, m, w * (x * m), clipped * m, -log_ratio * m, r * m,
                            kl * m, e * m, 0.0)
    if WRITE_GRAD:
        # pass 2 over the row, last block first (pass 1 read it most recently: with hundreds of rows in flight,
        # each ~300 KB at V = 151936 bf16, L2 holds only the latest part of each): d_logits from the whole batch's
        # coefficients w·g (zeros, the row unread, where they are 0: masked-out and ignored tokens)
        c_lp = tl.where(valid, w * g, 0.0)
        c_ent = 0.0
        if ENT_GRAD:
            c_ent = tl.where(valid, w * (-entropy_coef * m), 0.0)  # dx/dentropy
        label32 = tl.where(valid & in_range, label, -1).to(tl.int32)
        _sm._row_dlogits(row_ptr, dlogits_ptr + row * V, valid & ((c_lp != 0) | (c_ent != 0)), label32, V, x_max,
                         s, log_s, ent, logp_raw, c_lp, c_ent, inv_temp, dlogits_ptr, BLOCK_V, INTERPRETED, True)


def _logits_kernel_signature(ty: str) -> dict:
    ptrs = {"logits_ptr": f"*{ty}", "labels_ptr": "*i64", "old_ptr": "*fp32", "adv_ptr": "*fp32", "ref_ptr": "*fp32",
            "mask_ptr": "*u8", "w_ptr": "*fp32", "logp_ptr": "*fp32", "ent_ptr": "*fp32", "part_ptr": "*fp32",
            "dlogits_ptr": f"*{ty}"}
    sizes = {"stride_outer": "i64", "stride_inner": "i64", "inner": "i32", "T": "i32", "V": "i32", "inv_temp": "fp32",
             "ignore_index": "i64", "clip_low": "fp64", "clip_high": "fp64", "dual_clip": "fp32", "kl_coef": "fp32",
             "entropy_coef": "fp32"}
    flags = ("ON_POLICY", "HAS_REF", "KL_EST", "HAS_ENT", "ENT_GRAD", "WRITE_GRAD", "BLOCK_V", "ROWS", "VEC",
             "INTERPRETED")
    return {**ptrs, **sizes, **dict.fromkeys(flags, "constexpr")}


def _logits_token_row(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions, launch):
    """ratio="token" in ONE kernel launch, ``launch(rows, labels, old, adv, ref, mask, w, logp, ent, part, d_logits,
    T, opt, on_policy, has_ref)`` -> whether it ran (the Triton kernel always runs; the CUDA cluster kernel may
    refuse a call, then this returns None and nothing was written). The host work around it is the same for both:
    the aggregation weights ``w`` [B] from the mask, the per-token inputs as flat float32, then the loss and the
    metrics from the kernel's per-token partial sums. Same outputs as :func:`_logits_torch`."""
    B, T, V = logits.shape
    N = B * T
    dev = logits.device
    rows = _sm._as_rows(logits)  # [O, I, V] (a copy only when the rows do not collapse to two strided dims)
    tokens = (mask != 0).sum(-1, dtype=torch.float32)  # [B]
    w_b = reference.agg_weights(tokens, opt.agg, T, opt.norm_length).to(torch.float32).contiguous()  # [B]
    flat = lambda t: t.reshape(N).to(torch.float32).contiguous()  # noqa: E731  [B, T] -> [N] fp32
    adv = flat(advantages.unsqueeze(-1).expand(B, T) if advantages.dim() == 1 else advantages)  # [N]
    old = adv if old_logp is None else flat(old_logp)  # [N] (a placeholder when on-policy: never read)
    ref = adv if ref_logp is None else flat(ref_logp)  # [N] (placeholder without ref_logp)
    m = mask_u8(mask).reshape(N).contiguous()  # [N] uint8
    logp = torch.empty(N, dtype=torch.float32, device=dev)  # [N]
    ent = torch.empty(N, dtype=torch.float32, device=dev)  # [N]
    part = torch.empty(N, operator.index(losses.NSLOTS), dtype=torch.float32, device=dev)  # [N, NSLOTS]
    d_logits = torch.empty(N, V, dtype=logits.dtype, device=dev) if opt.grad_input else None  # [N, V]
    if N and not launch(rows, labels.reshape(N).contiguous(), old, adv, ref, m, w_b, logp, ent, part, d_logits, T, opt,
                        old_logp is None, ref_logp is not None):
        return None
    totals = part.sum(0)  # [NSLOTS]
    if not opt.with_entropy:
        ent.zero_()  # as the torch row: no entropy asked, zeros
    loss = totals[operator.index(losses.SLOT_LOSS)]
    empty = logits.new_empty(0)
    return (loss, losses._masked_means(totals, losses._POLICY_METRIC_SLOTS), logp.reshape(B, T), ent.reshape(B, T),
            empty if d_logits is None else d_logits.reshape(B, T, V))


def _launch_triton_token(rows, labels, old, adv, ref, m, w_b, logp, ent, part, d_logits, T, opt, on_policy, has_ref):
    """:func:`_logits_policy_kernel`, a program per token row; always runs."""
    V = rows.shape[2]
    cfg = _sm._launch_config(V)
    _logits_policy_kernel.launch(
        (labels.numel(),), rows, labels, old, adv, ref, m, w_b, logp, ent, part,
        d_logits if d_logits is not None else logp, rows.stride(0), rows.stride(1), rows.shape[1], T, V,
        1.0 / opt.temperature, opt.ignore_index, opt.clip_low, opt.clip_high,
        math.inf if opt.dual_clip is None else opt.dual_clip, opt.kl_coef, opt.entropy_coef,
        ON_POLICY=on_policy, HAS_REF=has_ref, KL_EST=reference.KL_ESTIMATORS.index(opt.kl_estimator) if has_ref else 0,
        HAS_ENT=opt.with_entropy, ENT_GRAD=opt.entropy_coef != 0, WRITE_GRAD=d_logits is not None,
        **_sm._fwd_constexprs(cfg, TRITON_DTYPE_NAMES[rows.dtype]), INTERPRETED=rows.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return True


def _logits_triton_token(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """ratio="token": :func:`_logits_policy_kernel`, one launch; the same outputs as :func:`_logits_torch`."""
    return _logits_token_row(logits, labels, old_logp, advantages, mask, ref_logp, opt, _launch_triton_token)


def _launch_cluster_token(rows, labels, old, adv, ref, m, w_b, logp, ent, part, d_logits, T, opt, on_policy, has_ref):
    """The csrc extension's cluster kernel (csrc/logits_policy_kernel.h): a cluster of blocks per token row holding
    the row in their shared memory; False where it cannot take the call (V not a multiple of 16 bytes' elements, a
    row longer than 8 blocks' chunks, misaligned rows, a GPU without clusters and a row over one block's chunk)."""
    return bool(_extension.load().logits_policy(
        rows, labels, old, adv, ref, m, w_b, logp, ent, part, d_logits if d_logits is not None else logp, T,
        1.0 / opt.temperature, opt.ignore_index, 1.0 - opt.clip_low, 1.0 + opt.clip_high,
        math.inf if opt.dual_clip is None else opt.dual_clip, opt.kl_coef, opt.entropy_coef, on_policy, has_ref,
        reference.KL_ESTIMATORS.index(opt.kl_estimator) if has_ref else 0, opt.with_entropy, opt.entropy_coef != 0,
        d_logits is not None))


def _logits_cluster_token(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """ratio="token" in the csrc cluster kernel, or None where it cannot run (see :func:`_launch_cluster_token`)."""
    if not (logits.is_cuda and _extension.has_cuda_kernels("logits_policy")):
        return None
    return _logits_token_row(logits, labels, old_logp, advantages, mask, ref_logp, opt, _launch_cluster_token)


def _logits_triton_pair(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """The "pair" Triton row: the logprobs forward kernel over all ``N = B·T`` tokens (the statistics: one read of
    the logits), the policy loss's own kernels on the ``[B, T]`` log-probs (its per-token terms and coefficients,
    then its reduction with the aggregation weights ``w`` [B]), then the logprobs backward kernel writing
    ``d_logits`` with the coefficients ``dL/dlogp = g_logp·w`` (a second read, one write). The same calls, in
    the same layout, as ``logprobs`` then ``policy_loss`` called separately: five kernels and a few small ops.
    (Through the shared chunk driver, :func:`_logits_with`, the same kernels took ~40 small ops more per call
    and the policy kernel a row per token; on an H200's host one call's host work was 2.5 ms.) A masked-out
    token is passed to the backward kernel as ignored: its ``d_logits`` row is exactly 0 without its logits being
    read, where 0 times their NaN/inf would reach the gradient. Same outputs as :func:`_logits_torch`."""
    B, T, V = logits.shape
    sopt = _sm.LogprobsOptions(opt.temperature, opt.with_entropy, opt.ignore_index)
    logp, ent, stats = _sm._triton_forward(logits, labels, sopt)  # [B, T] float32 each (entropy 0 unless asked), [B, T, 2]
    old = logp if old_logp is None else old_logp  # on-policy: the ratio is 1
    partials, g_logp, _g_ref, g_ent = losses._policy_triton(logp, old, advantages, mask, ref_logp,
                                                            ent if opt.with_entropy else None, opt.policy)
    w, loss, metrics = losses._reduce_triton(partials, opt.agg, T, opt.norm_length, losses._POLICY_METRIC_SLOTS)
    d_logits = None
    if opt.grad_input:
        w_col = w.unsqueeze(1)  # [B, 1]
        coef_ent = g_ent * w_col if opt.entropy_coef != 0 else None  # [B, T] dL/dentropy, or none
        quiet = labels.masked_fill(mask == 0, opt.ignore_index)  # [B, T]
        d_logits = torch.empty(B, T, V, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        _sm._triton_backward_into(d_logits, logits, quiet, stats, ent, g_logp * w_col, coef_ent, sopt)
    return loss, metrics, logp, ent, logits.new_empty(0) if d_logits is None else d_logits


# Which CUDA row serves ratio="token" (RLKERNELS_LOGITS_POLICY; GSPO always takes the pair):
# - "pair" (the default): the logprobs kernels around the policy loss (_logits_triton_pair): a read pass for the
#   statistics, the policy loss over [B, T], then a read-and-write pass for d_logits -- three passes over [N, V];
# - "one-kernel": _logits_policy_kernel, a program per token that reads its row, forms the token's loss
#   coefficients in registers and re-reads the row to write d_logits (two passes when the re-read hits L2);
# - "cluster": the csrc extension's kernel (csrc/logits_policy_kernel.h): a cluster of blocks per token row holds the
#   row in shared memory (at most 80 KB a block: 4 blocks at V = 151936 bf16, on Hopper; one block before it), so
#   the logits are read from DRAM once and d_logits written once -- the two-pass bound by construction. Where it
#   cannot take a call (see _launch_cluster_token) the pair runs. Not yet measured on a GPU (checked on the CPU
#   under tests/cuda_emulated/); the default moves to it only if `make gpu` measures it faster.
# Measured on an H100 (bench/results/NVIDIA_H100_80GB_HBM3-2026-11-26-lease1.md, N=8192 V=151936 bf16, fwd+bwd): the
# one kernel 4.46 ms (1.12 TB/s of its two-pass bytes), logprobs + policy_loss called separately 2.56 ms: the
# re-read of each ~300 KB row does not stay in L2 there, so the one kernel pays three passes at a program-per-row's
# lower bandwidth. The pair became the default then. Measured as itself it took 5.04 ms on the H100 and 3.996 ms on
# an H200 (NVIDIA_H200-2026-11-27-lease1.md; the two ops 1.851 ms, the one kernel 3.826 ms): under Nsight Compute its
# kernels took 2.0 ms (the two ops' 1.84 ms), but the backward read the upstream gradient on the host (a device sync)
# and the host's work per call was 2.5 ms, so the two added up. Since then the upstream gradient is applied on the
# device (_handed_out) and the pair makes the two ops' calls (bench/results/cpu-op-count-2026-11-27.txt): on the
# next H200 run (NVIDIA_H200-2026-11-27-lease2.md, commit 14fe024) the pair took 1.821 ms, the two ops 1.884, the
# one kernel 3.517; on the day's third (NVIDIA_H200-2026-11-27.md, e8bcb85) 1.866 (1.58x the two-pass bound), 1.915
# and 3.499.
LOGITS_ROW_ENV = "RLKERNELS_LOGITS_POLICY"
LOGITS_ROWS = ("pair", "one-kernel", "cluster")


def _logits_row() -> str:
    """``$RLKERNELS_LOGITS_POLICY`` or "pair"; anything else is refused by name."""
    return _backend.env_choice(LOGITS_ROW_ENV, LOGITS_ROWS) or "pair"


def _logits_triton(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    """The CUDA (Triton backend) row of logits_policy_loss: the logprobs kernels around the policy loss's own
    implementation (:func:`_logits_triton_pair`), or for ``ratio="token"`` with ``RLKERNELS_LOGITS_POLICY=one-kernel``
    the one Triton kernel, with ``=cluster`` the csrc cluster kernel where it takes the call (see the note above).
    Same outputs as :func:`_logits_torch`."""
    row = _logits_row() if opt.ratio != "sequence" else "pair"
    if row == "cluster":
        out = _logits_cluster_token(logits, labels, old_logp, advantages, mask, ref_logp, opt)
        if out is not None:
            return out
    run = _logits_triton_token if row == "one-kernel" else _logits_triton_pair
    return run(logits, labels, old_logp, advantages, mask, ref_logp, opt)


# Each op's backends, chosen at run time inside the op (rlkernels._backend.resolve); float64 never reaches Triton.
_LINEAR_IMPLS = {"torch": _linear_torch, "triton": _linear_triton}
_LOGITS_IMPLS = {"torch": _logits_torch, "triton": _logits_triton}


# ---------------------------------------------------------------- torch.library ops and their autograd.Functions

_LINEAR_TENSORS = ("Tensor hidden, Tensor weight, Tensor labels, Tensor? old_logp, Tensor advantages, Tensor mask, "
                   "Tensor? ref_logp, Tensor? bias")
_LOGITS_TENSORS = "Tensor logits, Tensor labels, Tensor? old_logp, Tensor advantages, Tensor mask, Tensor? ref_logp"


def _finite_unused_rows(hidden: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                        opt: FusedPolicyOptions) -> torch.Tensor:
    """``hidden`` [B, T, H] (or logits [B, T, V], for the reference path) with its NaN/±inf entries set to 0 in
    the rows the loss never reads (masked-out or ignored tokens; padding after a fully masked attention row can
    hold NaN). Those rows get a zero ``dz`` row, but every row meets the weight's gradient GEMM, where 0 · NaN
    would turn the whole ``d_weight`` into NaN. Their per-token log-probs (a metric) then come from the cleaned
    row. A copy only where such an entry exists (checked on the CPU, where it costs no sync; on a GPU, and while
    torch.compile traces, always: three elementwise passes over ``hidden``)."""
    # in int64, as the ops read labels: a narrow dtype's comparison wraps ignore_index (uint8: -100 == 156)
    unused = (mask == 0) | (labels.long() == opt.ignore_index)  # [B, T]
    if (hidden.device.type == "cpu" and not _checks._tracing()  # traced: no data-dependent branch
            and (not bool(unused.any()) or bool(torch.isfinite(hidden[unused]).all()))):
        return hidden
    bad = unused[..., None] & ~torch.isfinite(hidden)  # [B, T, H]
    return torch.where(bad, torch.zeros((), dtype=hidden.dtype, device=hidden.device), hidden)


@custom_op("rlkernels::linear_policy_loss",
           schema=op_schema(_LINEAR_TENSORS, FusedPolicyOptions,
                            "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _linear_op(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, *options):
    """-> (loss [], metrics [5], logp [B, T], entropy [B, T], d_hidden [B, T, H] or [0], d_weight [V, H] or [0],
    d_bias [V] or [0]): the gradients of the loss itself (upstream 1)."""
    opt = options_from(FusedPolicyOptions, options)
    labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)  # [B, T] int64 (CPU: range checked)
    hidden = _finite_unused_rows(hidden, labels, mask, opt)  # [B, T, H]
    with _backend.float32_compute(hidden.device):
        return _backend.implementation(_LINEAR_IMPLS, hidden)(hidden, weight, labels, old_logp, advantages, mask,
                                                               ref_logp, bias, opt)


@_linear_op.register_fake
def _(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, *options):
    opt = options_from(FusedPolicyOptions, options)
    B, T, H = hidden.shape
    f32 = dict(dtype=torch.float32)
    cdt = reference.compute_dtype(hidden)
    return (hidden.new_empty((), **f32), hidden.new_empty((len(losses.POLICY_METRICS),), **f32),
            hidden.new_empty((B, T), **f32), hidden.new_empty((B, T), **f32),
            hidden.new_empty((B, T, H), dtype=cdt) if opt.grad_input else hidden.new_empty(0),
            weight.new_empty(weight.shape, dtype=_d_weight_dtype(hidden, weight, opt)) if opt.grad_weight
            else hidden.new_empty(0),
            hidden.new_empty(bias.shape, dtype=cdt) if opt.grad_bias and bias is not None else hidden.new_empty(0))


@custom_op("rlkernels::logits_policy_loss",
           schema=op_schema(_LOGITS_TENSORS, FusedPolicyOptions, "(Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _logits_op(logits, labels, old_logp, advantages, mask, ref_logp, *options):
    """-> (loss [], metrics [5], logp [B, T], entropy [B, T], d_logits [B, T, V] or [0])."""
    opt = options_from(FusedPolicyOptions, options)
    labels = _checks.labels(labels, logits.shape[-1], opt.ignore_index)  # [B, T] int64
    with _backend.float32_compute(logits.device):
        loss, metrics, logp, entropy, d_logits = _backend.implementation(_LOGITS_IMPLS, logits)(
            logits, labels, old_logp, advantages, mask, ref_logp, opt)
    # the per-token metrics of a masked-out token whose logits hold NaN/inf: 0, as linear_policy_loss reports the
    # log-prob of such a row with its non-finite entries set to 0 (nothing at a masked-out position reaches an output)
    unused = mask == 0  # [B, T]
    logp = torch.where(unused, logp.nan_to_num(0.0, 0.0, 0.0), logp)  # [B, T]
    entropy = torch.where(unused, entropy.nan_to_num(0.0, 0.0, 0.0), entropy)  # [B, T]
    return loss, metrics, logp, entropy, d_logits


@_logits_op.register_fake
def _(logits, labels, old_logp, advantages, mask, ref_logp, *options):
    opt = options_from(FusedPolicyOptions, options)
    B, T, _V = logits.shape
    f32 = dict(dtype=torch.float32)
    return (logits.new_empty((), **f32), logits.new_empty((len(losses.POLICY_METRICS),), **f32),
            logits.new_empty((B, T), **f32), logits.new_empty((B, T), **f32),
            torch.empty_like(logits, memory_format=torch.contiguous_format) if opt.grad_input else logits.new_empty(0))


# ---- the upstream gradient
#
# Both ops form their gradients in the forward and hand them out in the backward times the upstream gradient d_loss
# (a 0-dim float32 tensor; 1 for loss.backward()). Reading d_loss on the host, to hand a gradient out as it is when
# d_loss is 1, synchronizes the device at every backward: the host then waits for the whole forward before it can
# queue anything after it, and a CUDA graph cannot capture the step. Measured on an H200 (bench/results/
# NVIDIA_H200-2026-11-27-lease1.md, N=8192 V=151936 bf16, fwd+bwd): logits_policy_loss 3.996 ms, its kernels 2.0 ms
# under Nsight Compute and the host's work 2.5 ms per call (bench.cpu_host_cost there): with the sync the two add up,
# where the same kernels called as two ops (no sync) took 1.851 ms. So a stored gradient already in its output
# dtype is scaled in place on the device (_scale_unless_one_kernel: every program loads d_loss and returns at once
# when it is 1; else x = x * d_loss formed in float32, rounded once) and the same buffer is handed out; one that
# must be cast anyway (a float32 d_hidden for a 16-bit hidden) is multiplied into the cast (x * 1 is x: the cast's
# own bits when d_loss is 1). A second backward through a retained graph finds the buffer scaled by the first one's
# d_loss (ctx.applied): the same d_loss hands it out again; another one rescales it by the ratio (a host read, this
# rare path only; for 16-bit gradients one more rounding), and after a d_loss of 0 it cannot and says so. float64
# gradients (the torch backend) and CPU tensors keep the host's check, which costs no sync there.


@jit
def _scale_unless_one_kernel(x_ptr, scale_ptr, numel, iters, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    # x [numel] in place: x * scale (float32 product, rounded once to x's dtype), nothing at all when scale == 1;
    # program pid takes the blocks pid, pid + P, ... (iters of them)
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        pid = tl.program_id(0).to(tl.int64)
        P = tl.num_programs(0).to(tl.int64)
        for it in range(0, iters):
            offs = (it * P + pid) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] int64
            ok = offs < numel
            x = tl.load(x_ptr + offs, mask=ok, other=0.0)
            losses._store_scaled(x_ptr + offs, x.to(tl.float32) * scale, ok, INTERPRETED)  # rounded to nearest


_SCALE_BLOCK = 4096
_SCALE_PROGRAMS_PER_SM = 4
_DEVICE_SCALE_ON_CPU = False  # the tests set it: the device path on CPU tensors, under the interpreter


def _device_scale(g: torch.Tensor) -> bool:
    """Whether ``g`` (a stored gradient) takes the in-place device scaling: CUDA (or, for the tests, the interpreter),
    16-bit or float32, contiguous, not traced (torch.compile and dispatch modes take the arithmetic path)."""
    if _checks._tracing() or g.dtype not in TRITON_DTYPE_NAMES or not g.is_contiguous() or not _backend.has_triton():
        return False
    return g.device.type == "cuda" or (g.device.type == "cpu" and _DEVICE_SCALE_ON_CPU)


def _scale_in_place(g: torch.Tensor, scale: torch.Tensor) -> None:
    """``g`` (contiguous, any shape) times the 0-dim ``scale``, in place, unless ``scale`` is 1; no host read."""
    n = g.numel()
    if n == 0:
        return
    sms = torch.cuda.get_device_properties(g.device).multi_processor_count if g.device.type == "cuda" else 1
    programs = min(sms * _SCALE_PROGRAMS_PER_SM, cdiv(n, _SCALE_BLOCK))
    _scale_unless_one_kernel.launch((programs,), g, scale.float().reshape(1), n, cdiv(n, programs * _SCALE_BLOCK),
                                    BLOCK=_SCALE_BLOCK, INTERPRETED=g.device.type == "cpu", num_warps=8)


def _handed_out(ctx, key: str, g: torch.Tensor, d_loss: torch.Tensor, dtype: torch.dtype):
    """The stored gradient ``g`` (``key`` names it in ``ctx.applied``) times the upstream ``d_loss``, in ``dtype``
    (see the note above). ``[0]``: not computed -> None."""
    if g.numel() == 0 and g.dim() == 1:
        return None
    if g.dtype != dtype:  # d_loss a float32 0-dim tensor: the product formed in g's dtype, rounded once into dtype
        return torch.mul(g, d_loss, out=torch.empty(g.shape, dtype=dtype, device=g.device))
    if not _device_scale(g):
        # the host's check only where it costs no device sync (the CPU; a meta tensor has no value to read)
        if g.device.type == "cpu" and not _checks._tracing() and bool(d_loss == 1):
            return g
        return (g.to(torch.promote_types(g.dtype, torch.float32)) * d_loss).to(dtype)
    applied = ctx.applied.get(key)  # the d_loss a first backward scaled g by, in place
    if applied is None:
        _scale_in_place(g, d_loss)
    else:  # a second backward through a retained graph
        before, now = float(applied), float(d_loss)  # host reads: this rare path only
        if before == 0.0 and now != 0.0:
            raise RuntimeError(
                f"{ctx.op_name}: a second backward through a retained graph after one whose upstream gradient was 0: "
                "the op hands out its stored gradient scaled in place, and a gradient scaled by 0 cannot be "
                "rescaled; call the op again for another backward")
        if before != now:
            _scale_in_place(g, d_loss.float() / applied)
    ctx.applied[key] = d_loss.detach().float().clone()
    return g


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[4:7])
    ctx.op_name, ctx.applied = "linear_policy_loss", {}
    ctx.has_bias = inputs[7] is not None
    ctx.dtypes = (inputs[0].dtype, inputs[1].dtype, None if inputs[7] is None else inputs[7].dtype)
    ctx.mark_non_differentiable(*output[1:7])
    # the non-differentiable outputs get no gradient tensors: materialized, the stored d_weight's would be a
    # weight-sized [V, H] tensor of zeros (and d_logits' an [N, V] one)
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, d_loss, *_unused):
    refuse_double_backward("linear_policy_loss")
    if d_loss is None:  # the loss reaches no output that needs a gradient
        return None
    d_hidden, d_weight, d_bias = ctx.saved_tensors  # compute dtype (float32; float64 for float64 inputs)
    dt_hidden, dt_weight, dt_bias = ctx.dtypes
    return (_handed_out(ctx, "hidden", d_hidden, d_loss, dt_hidden),
            _handed_out(ctx, "weight", d_weight, d_loss, dt_weight), None, None, None, None, None,
            _handed_out(ctx, "bias", d_bias, d_loss, dt_bias) if ctx.has_bias else None)


_LinearPolicyLoss = autograd_function("_LinearPolicyLoss", _linear_op, _linear_setup, _linear_backward)


def _logits_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.op_name, ctx.applied = "logits_policy_loss", {}
    ctx.mark_non_differentiable(*output[1:5])
    ctx.set_materialize_grads(False)  # as in _linear_setup: no [N, V] zeros for d_logits' gradient


def _logits_backward(ctx, d_loss, *_unused):
    refuse_double_backward("logits_policy_loss")
    (d_logits,) = ctx.saved_tensors
    if d_loss is None:  # the loss reaches no output that needs a gradient
        return None
    # handed out without a [B, T, V] copy (see _RETURNS_DOC); for 16-bit logits an upstream gradient other than 1
    # rounds the stored (once rounded) gradient a second time
    return (_handed_out(ctx, "logits", d_logits, d_loss, d_logits.dtype),)


_LogitsPolicyLoss = autograd_function("_LogitsPolicyLoss", _logits_op, _logits_setup, _logits_backward)


# ---------------------------------------------------------------- public functions


def _metrics_dict(metrics, logp, entropy, opt: FusedPolicyOptions, has_ref: bool) -> dict:
    out = dict(zip(losses.POLICY_METRICS, metrics.detach()))
    if not has_ref:
        del out["kl"]
    if not opt.with_entropy:
        del out["entropy"]
    out["token_logp"] = logp.detach().float()  # float32 also for float64 inputs, as the reference backend's
    if opt.with_entropy:
        out["token_entropy"] = entropy.detach().float()
    return out


def _reference_linear(hidden, weight, labels, old_logp, advantages, mask, ref_logp, bias, opt: FusedPolicyOptions):
    if not _checks._tracing():
        labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)
    hidden = _finite_unused_rows(hidden, labels, mask, opt)  # [B, T, H]: as the three-GEMM op cleans it
    out = reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=opt.temperature,
                                    return_entropy=opt.with_entropy, ignore_index=opt.ignore_index)
    return _reference_policy(out, old_logp, advantages, mask, ref_logp, opt)


def _reference_logits(logits, labels, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    if not _checks._tracing():
        labels = _checks.labels(labels, logits.shape[-1], opt.ignore_index)
    # the loss from logits whose unused rows hold no NaN/inf (0 · NaN in the softmax's backward would reach
    # d_logits); the per-token metrics from the logits as given, 0 where non-finite at a masked-out token, as
    # _logits_op reports them
    clean = _finite_unused_rows(logits, labels, mask, opt)  # [B, T, V]
    out = reference.logprobs(clean, labels, temperature=opt.temperature, return_entropy=opt.with_entropy,
                             ignore_index=opt.ignore_index)
    loss, metrics = _reference_policy(out, old_logp, advantages, mask, ref_logp, opt)
    if clean is not logits:
        with torch.no_grad():
            given = reference.logprobs(logits, labels, temperature=opt.temperature, return_entropy=True,
                                       ignore_index=opt.ignore_index)  # (logp [B, T], entropy [B, T])
        for key, value in zip(("token_logp", "token_entropy"), given):
            if key in metrics:
                metrics[key] = torch.where((mask == 0) & ~torch.isfinite(value), 0.0, value).float()
    return loss, metrics


def _reference_policy(out, old_logp, advantages, mask, ref_logp, opt: FusedPolicyOptions):
    logp, entropy = out if opt.with_entropy else (out, None)
    old_logp = logp.detach() if old_logp is None else old_logp  # on-policy: old = the log-probs themselves
    loss, metrics = reference.policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy,
                                          **option_dict(opt.policy))
    loss, metrics = losses.float32_result(loss, metrics, losses.POLICY_METRICS)
    metrics["token_logp"] = logp.detach().float()
    if entropy is not None:
        metrics["token_entropy"] = entropy.detach().float()
    return loss, metrics


_POLICY_DOC_ARGS = """
        old_logp: ``[B, T]`` log-probs of the sampled tokens under the policy that sampled them (a constant), or
            ``None`` for an on-policy update (one epoch, one minibatch): old = the op's own log-probs, detached,
            as ``policy_loss(logp, logp.detach(), ...)`` -- every ratio is exactly 1 in value (nothing clipped)
            and the gradient of ``exp(logp - sg(logp))`` is the policy gradient ``A·∇logp``; no separate
            log-prob pass needed.
        advantages: ``[B, T]`` or ``[B]`` (a constant).
        mask: ``[B, T]`` bool or 0/1 float; 1 where a token counts.
        temperature: divides the logits (> 0).
        clip_low, clip_high, dual_clip, ratio, ref_logp, kl_coef, kl_estimator, entropy_coef, agg, norm_length:
            as in :func:`rlkernels.policy_loss` (``ref_logp`` ``[B, T]`` is a constant). With ``entropy_coef``
            set, the entropy of the same softmax enters the loss (as ``policy_loss(..., entropy=...)``).
        ignore_index: a label equal to it gives log-prob 0 and entropy 0 and no gradient, as in
            :func:`rlkernels.linear_logprobs` (mask such tokens out as well unless a log-prob of 0 is meant).
        return_entropy: compute the entropy also when ``entropy_coef`` is 0, for logging only (the ``entropy``
            metric and ``token_entropy``, as ``policy_loss(..., entropy=ent)`` reports it; no gradient term): one
            more reduction in the pass over the logits (over each logits tile of the linear head: no extra GEMM).
        cu_seqlens: ``[S + 1]`` boundaries of *packed* inputs, as in :func:`rlkernels.policy_loss`: the head input
            is ``[1, total, X]`` and the per-token tensors ``[1, total]`` (``advantages`` may be ``[S]``); the
            result is the op's on the padded ``[S, Tmax]`` view (every ``agg`` mode and ``ratio="sequence"`` act
            per packed sequence, padding gets ``ignore_index`` labels and mask 0), with ``token_logp`` /
            ``token_entropy`` packed back to ``[1, total]``. A Python list keeps ``torch.compile`` free of
            data-dependent shapes.
"""

_RETURNS_DOC = """
    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar; ``metrics`` what :func:`rlkernels.policy_loss` reports
        (``clipfrac``, ``approx_kl``, ``ratio_mean``, ``kl`` with ``ref_logp``, ``entropy`` with
        ``entropy_coef`` or ``return_entropy``) plus ``token_logp`` ``[B, T]`` float32, the detached per-token log-probs
        (and ``token_entropy`` ``[B, T]`` with ``entropy_coef`` or ``return_entropy``), so logging needs no second
        pass.

    The backward only multiplies the gradients formed in the forward by the upstream scalar: a second
    backward (``retain_graph=True``) gives the same gradients; double backward (``create_graph=True``)
    raises. Gradients are computed only for inputs that require them (with grad mode on). A stored gradient
    already in its input's dtype is handed out without a copy: on the CPU as it is when the upstream gradient is
    exactly 1 (``loss.backward()``), else scaled into a new tensor; on a GPU scaled in place by a kernel that
    reads the upstream on the device and does nothing where it is 1 (no host read of it: no device sync, and a
    CUDA graph can capture the step). Under ``torch.autograd.grad(..., retain_graph=True)`` the returned tensors
    are the ones a second backward hands out again, so do not modify them in place (``.grad`` accumulation copies
    them while the graph is retained). On a GPU a second backward with another upstream rescales the stored
    gradient (for 16-bit gradients one more rounding), and after an upstream of 0 it raises.
"""


def _padded_from_packed(cu_seqlens, head_name: str, head: torch.Tensor, labels, old_logp, advantages, mask,
                        ref_logp, ignore_index: int):
    """Packed ``[1, total, X]`` ``head`` (hidden or logits) and ``[1, total]`` per-token tensors -> their padded
    ``[S, Tmax, X]`` / ``[S, Tmax]`` views (``advantages`` may be ``[S]``), as :func:`rlkernels.policy_loss` does
    with ``cu_seqlens``; padded positions get ``ignore_index`` labels (no GEMM work for them) and mask 0. Returns
    ``(views, index [total])``, ``views`` the keyword arguments of the padded call."""
    _checks.tensor(head, head_name)
    if head.dim() != 3 or head.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, {head_name} must be packed [1, total, {head_name[0].upper()}], got shape "
                         f"{tuple(head.shape)}")
    views = _packing.padded_views(cu_seqlens, "labels", ("advantages",), labels=labels, old_logp=old_logp,
                                  advantages=advantages, mask=mask, ref_logp=ref_logp)
    index, S, Tmax = _packing.padded_index(cu_seqlens, labels.shape[-1], device=head.device)  # [total]
    if head.shape[1] != index.numel():
        raise ValueError(f"packed {head_name} must have {index.numel()} tokens (labels'), got {head.shape[1]}")
    if head.device != index.device:
        raise ValueError(f"{head_name} is on {head.device} but cu_seqlens is on {index.device}")
    X = head.shape[2]
    padded = head.new_zeros(S * Tmax, X).index_put((index,), head[0]).view(S, Tmax, X)  # [S, Tmax, X]
    real = torch.zeros(S * Tmax, dtype=torch.bool, device=index.device)  # [S*Tmax]
    real[index] = True
    views["labels"] = torch.where(real.view(S, Tmax), views["labels"], ignore_index)  # [S, Tmax]
    views[head_name] = padded
    return views, index


def _packed_metrics(metrics: dict, index: torch.Tensor) -> dict:
    """The per-token metrics (``token_logp``, ``token_entropy``) of a padded call, packed back to ``[1, total]``."""
    return {k: _packing.pack(v, index) if k.startswith("token_") else v for k, v in metrics.items()}


def linear_policy_loss(
    hidden: torch.Tensor,  # [B, T, H]
    weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [B, T] int
    old_logp: torch.Tensor | None,  # [B, T], or None: on-policy (old = the op's own log-probs, detached)
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
    return_entropy: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,  # [S + 1]
):
    if cu_seqlens is not None:  # packed [1, total] -> the padded [S, Tmax] view, then the one padded op
        views, index = _padded_from_packed(cu_seqlens, "hidden", hidden, labels, old_logp, advantages, mask,
                                           ref_logp, ignore_index)
        loss, metrics = linear_policy_loss(
            views["hidden"], weight, views["labels"], views["old_logp"], views["advantages"], views["mask"],
            bias=bias, temperature=temperature, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
            ratio=ratio, ref_logp=views["ref_logp"], kl_coef=kl_coef, kl_estimator=kl_estimator,
            entropy_coef=entropy_coef, agg=agg, norm_length=norm_length, ignore_index=ignore_index,
            return_entropy=return_entropy, process_group=process_group, vocab_start=vocab_start)
        return loss, _packed_metrics(metrics, index)
    policy_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, norm_length=norm_length)
    grad_on = torch.is_grad_enabled()
    # a non-tensor (None, an nn.Linear for its weight, bias=True) named here, before .requires_grad is read
    head = (_checks.tensor(hidden, "hidden"), _checks.tensor(weight, "weight"),
            None if bias is None else _checks.tensor(bias, "bias"))
    grads = tuple(grad_on and t is not None and t.requires_grad for t in head)
    opt = _validate(head_input=hidden, head_name="hidden", weight=weight, labels=labels, bias=bias,
                    old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp, temperature=temperature,
                    ignore_index=ignore_index, return_entropy=return_entropy, policy_kwargs=policy_kwargs, grads=grads)
    constants = tuple(None if t is None else t.detach()
                      for t in (old_logp, advantages, _checks.mask_as_bool(mask), ref_logp))
    if process_group is not None or vocab_start is not None:  # the vocabulary split over a process group
        from rlkernels import vocab_parallel

        vocab_start = vocab_parallel.check_group(process_group, vocab_start, weight.shape[0])
        return vocab_parallel.linear_policy_loss(hidden, weight, labels, *constants, bias, opt, process_group,
                                                 vocab_start)
    if _backend.serves_reference(_LINEAR_IMPLS, hidden):  # outside float32_compute: it sees the caller's autocast
        return _reference_linear(hidden, weight, labels, *constants, bias, opt)
    with _backend.float32_compute(hidden.device):
        if _layout(hidden, weight, opt) == "two-op":
            return _two_op(hidden, weight, labels, *constants, bias, opt)
        loss, metrics, logp, ent, *_ = _LinearPolicyLoss.apply(hidden, weight, labels.long(), *constants, bias,
                                                               *option_values(opt))
    return loss, _metrics_dict(metrics, logp, ent, opt, ref_logp is not None)


# The docstrings are assembled from the shared pieces above; a concatenation in a function's body is an
# expression, not a docstring, so they are assigned here.
linear_policy_loss.__doc__ = (
    """The PPO/GRPO policy loss from final hidden states through the LM head, in three GEMMs.

    Equal (to float32 rounding, forward and backward) to::

        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                                              return_entropy=True)
        rlkernels.policy_loss(logp, old_logp, advantages, mask, ..., entropy=ent if entropy_coef else None)

    but the head's gradient is formed during the forward (the loss is known then), which saves the backward's
    logits recomputation: three GEMMs instead of four, and never an ``[N, V]`` tensor (chunks of tokens;
    whole sequences with ``ratio="sequence"``). On the CPU, where three GEMMs would need a float32 ``[V, H]``
    buffer beside a 16-bit weight's gradient (more than ``H/2`` tokens) or chunks of fewer than 128 tokens
    (float32), it runs exactly that two-op composition itself -- four GEMMs, the two-op path's memory, the same
    outputs and metrics (the module docstring says why).

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
)


def logits_policy_loss(
    logits: torch.Tensor,  # [B, T, V]
    labels: torch.Tensor,  # [B, T] int
    old_logp: torch.Tensor | None,  # [B, T], or None: on-policy (old = the op's own log-probs, detached)
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
    return_entropy: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,  # [S + 1]
):
    if cu_seqlens is not None:  # packed [1, total] -> the padded [S, Tmax] view, then the one padded op
        views, index = _padded_from_packed(cu_seqlens, "logits", logits, labels, old_logp, advantages, mask,
                                           ref_logp, ignore_index)
        loss, metrics = logits_policy_loss(
            views["logits"], views["labels"], views["old_logp"], views["advantages"], views["mask"],
            temperature=temperature, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio,
            ref_logp=views["ref_logp"], kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
            agg=agg, norm_length=norm_length, ignore_index=ignore_index, return_entropy=return_entropy)
        return loss, _packed_metrics(metrics, index)
    policy_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, agg=agg, norm_length=norm_length)
    grads = (torch.is_grad_enabled() and _checks.tensor(logits, "logits").requires_grad, False, False)
    opt = _validate(head_input=logits, head_name="logits", weight=None, labels=labels, bias=None, old_logp=old_logp,
                    advantages=advantages, mask=mask, ref_logp=ref_logp, temperature=temperature,
                    ignore_index=ignore_index, return_entropy=return_entropy, policy_kwargs=policy_kwargs, grads=grads)
    constants = tuple(None if t is None else t.detach()
                      for t in (old_logp, advantages, _checks.mask_as_bool(mask), ref_logp))
    with _backend.float32_compute(logits.device):
        if _backend.serves_reference(_LOGITS_IMPLS, logits):
            return _reference_logits(logits, labels, *constants, opt)
        loss, metrics, logp, ent, _ = _LogitsPolicyLoss.apply(logits, labels.long(), *constants, *option_values(opt))
    return loss, _metrics_dict(metrics, logp, ent, opt, ref_logp is not None)


logits_policy_loss.__doc__ = (
    """The PPO/GRPO policy loss from logits a caller already holds, with ``d_logits`` written in the forward.

    Equal (to float32 rounding, forward and backward) to
    ``rlkernels.policy_loss(rlkernels.logprobs(logits, labels, temperature=..., return_entropy=...), ...)``,
    but with ``d_logits`` written in the forward, so the backward only scales it. How often the logits are read
    depends on the row: on CUDA by default (``RLKERNELS_LOGITS_POLICY=pair``) twice (statistics, then ``d_logits``:
    three passes over ``[B, T, V]`` with its write, as the two ops); with ``RLKERNELS_LOGITS_POLICY=cluster`` and
    ``ratio="token"`` once where the csrc cluster kernel takes the call (two passes, the memory bound); on the CPU
    three passes (the logprobs op's torch forward and backward). The gradient has the dtype of ``logits`` and is
    held from the forward to the backward (a ``[B, T, V]`` tensor, as the two-op path's backward would allocate).
    For 16-bit logits it is rounded to their dtype in the forward, so an upstream gradient other than 1
    (``loss.backward()`` passes 1) rounds it a second time when the backward scales it.

    Args:
        logits: ``[B, T, V]`` float32/bf16/fp16 logits (not divided by the temperature).
        labels: ``[B, T]`` integer token ids in ``[0, V)`` (or ``ignore_index``).""" + _POLICY_DOC_ARGS + _RETURNS_DOC
)
