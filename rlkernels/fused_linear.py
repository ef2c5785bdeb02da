"""Log-probabilities (and entropy) of labels under ``softmax((hidden @ weight.T + bias) / T)``
without ever holding an ``[N, V]`` tensor, forward or backward.

Design (the work is ~4 GEMMs of ``2·N·H·V`` FLOPs each):

- Forward, 1 GEMM: ``_fwd_kernel`` tiles tokens x vocab. Each program owns
  ``BLOCK_N`` tokens and one *vocab split* (a run of ``SPLIT_TILES`` tiles of
  ``BLOCK_V``), accumulates each ``[BLOCK_N, BLOCK_V]`` logits tile in float32
  with ``tl.dot`` over a masked ``BLOCK_K`` loop on ``H`` (tensor cores for
  bf16/fp16), and folds it into online accumulators per token: running max
  ``m``, ``s = Σ exp(z - m)``, ``u = Σ exp(z - m)(z - m)`` and the chosen
  token's logit ``z_y``, read from the float32 accumulator. Splitting the
  vocabulary gives ``N/BLOCK_N × V/(SPLIT_TILES·BLOCK_V)`` programs, enough to
  fill the GPU at RL batch sizes; the splits' partials (``[S, N]`` float32, O(N))
  are merged by a log-sum-exp in PyTorch (:func:`rlkernels._host.lse_merge`). The row max ``m``, ``log s`` (kept
  apart: one float32 ``lse = m + log s`` would carry ulp(m) into every log p)
  and ``entropy = log s - u/s`` are the only tensors saved for backward (O(N)).
  ``p log p`` counts 0 where ``p = 0`` (a ``-inf`` logit, e.g. a masked bias entry).
- Backward, 3 GEMMs, over chunks: ``_dz_kernel`` recomputes each logits
  tile (GEMM 2) with the forward's ``BLOCK_K`` (so bit for bit the forward's logits),
  forms ``log p = (z - m) - log s`` and writes ``dz = dL/dz`` for the chunk, formed in float32 as
  ``(g_logp (onehot - p) - g_H p (log p + H)) / T`` with ``1 - p_y = -expm1(logp_y)``,
  into a ``[chunk, V]`` workspace in the input dtype (so the next two GEMMs run
  on tensor cores). A row of dz is dominated by the label's entry
  ``g_logp (1 - p_y)``; what rounding that entry to 16 bits loses is written in
  float32 (``[chunk]``) and added back after the GEMMs as ``r · W[y]`` and
  ``r · hidden`` (O(N·H); into ``d_weight`` as a sorted segment sum per label, no atomics, so
  the gradients are the same bits run to run), which keeps the gradients as close to the float64
  truth as an all-float32 eager computation. Then cuBLAS does GEMM 3 (``dz @ W``) and GEMM 4 (``dz.T @ hidden``),
  in one of two orders (:func:`_vocab_outer`), whichever keeps the float32 accumulator the smaller of ``[N, H]``
  and ``[V, H]``. With fewer tokens than vocabulary entries (RL batches against 128k-256k vocabularies) the
  vocabulary is the outer loop: per vocabulary chunk, ``dz`` of all the tokens, ``d_hidden += dz @ W[chunk]``
  into a float32 ``[N, H]`` accumulator and ``d_weight[chunk] = dz.T @ hidden`` written by the GEMM in the
  weight's dtype (float32 accumulation inside it, rounded once, the 16-bit label entries' residuals added inside
  it), so no weight-sized float32 buffer exists (2.1 GB at V = 128256, H = 4096), nor a float32 slice
  of one. Otherwise the tokens are: per chunk of tokens, ``d_hidden[chunk] = dz @ W`` and ``d_weight += dz.T @
  hidden[chunk]`` into a float32 ``[V, H]`` accumulator (no larger than ``[N, H]`` then), cast once at the end;
  ``d_bias`` likewise. The workspace (``dz``) is sized to a fixed byte budget (``_DZ_BUDGET_BYTES``), never
  ``N × V``. No atomics in either order: the gradients are the same bits run to run. A single fused backward
  kernel would need atomics on ``d_weight`` (nondeterministic) or recompute the logits once per ``H`` tile; the
  chunked split keeps both GEMMs at cuBLAS speed.
- ``torch`` backend (CPU, or forced): the same algorithm in chunked PyTorch, over
  tokens and, when one row block of the vocabulary would still be large, over
  vocabulary chunks with the same online log-sum-exp; all math in float32
  (float64 for float64 inputs), recomputing logits in backward (the same GEMM
  call on the same tiles, so the same bits). The tiles are shared out to
  ``torch.get_num_threads()`` single-threaded workers (``rlkernels._cpu_workers``):
  thousands of small two-thread ops each waited for a descheduled thread on a
  loaded machine (2.8x slower beside one busy process); the workers meet once.

Labels of any integer dtype are checked (CPU) and widened to int64 before any
backend runs; tokens labelled ``ignore_index`` are dropped before any backend runs (both ops
run it on the kept rows; the dropped rows' outputs and gradients are exact zeros); every path computes in float32 under ``torch.autocast``; kernel row
offsets are 64-bit. Under Triton's interpreter (CPU tensors) the kernels sum each
K chunk's products with an explicit float32 reduction instead of ``np.matmul``,
whose summation order changes with the tile's shape, so there too the backward's
logits are the forward's bits.

Backends: the two custom ops (``rlkernels::linear_logprobs`` and its backward, so
``torch.compile(fullgraph=True)`` runs them) pick ``triton`` or ``torch`` from their
tables (``_FWD_IMPLS``, ``_BWD_IMPLS``) through ``rlkernels._backend.resolve``, at run
time inside the op; every row returns the same saved statistics, so the backward may
be served by another row than the forward. ``reference``
(:func:`rlkernels.reference.linear_logprobs`, through autograd) is served in one
place before the ops (:func:`rlkernels._backend.serves_reference`). Options travel as one frozen
:class:`LinearLogprobsOptions`.

Vocabulary-parallel calls (``process_group=``, ``vocab_start=``) leave before the ops, for
:mod:`rlkernels.vocab_parallel`, which runs the forwards' first half on the rank's weight slice
(``_PARTIALS_IMPLS``: the merged partials ``(m, s, u, z_y)`` per token), merges the ranks' partials, finishes
with :func:`_from_partials` as every backend does, and takes its gradients from the backward op with the merged
statistics (a label in another rank's slice: the row's gradient without the label's entry).

Order: Triton kernels -> launchers (validate, allocate, launch) -> torch.library ops
with autograd -> public function.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

import torch

from rlkernels import _backend, _checks, _cpu_workers, reference
from rlkernels._device import block_max, block_sum, expm1
from rlkernels._host import (
    TRITON_DTYPE_NAMES, autograd_function, call, custom_op, float32_outputs, label_logp, lse_merge, op_schema,
    option_values, options_from, refuse_double_backward, unit_stride,
)
from rlkernels._triton import cdiv, jit, tl

# ---------------------------------------------------------------- Triton kernels


@jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr,  # hidden [N, H], weight [V, H], bias [V]
    rows, cols, row_ok, col_ok,  # [BLOCK_N], [BLOCK_V]
    H, stride_hn, stride_wv, temperature,  # the H dimension has unit stride (the launcher ensures it)
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``(hidden[rows] @ weight[cols].T + bias[cols]) / T`` accumulated in float32.

    The forward and the backward both call this with the same ``BLOCK_K`` and flags, so a
    logit comes out bit for bit the same in both (the K chunks are summed in the same order)."""
    acc = tl.full((BLOCK_N, BLOCK_V), 0.0, dtype=tl.float32)  # [BLOCK_N, BLOCK_V]
    ks = tl.arange(0, BLOCK_K)
    # 64-bit row offsets: row * stride passes 2^31 elements at N >= 524288 for H = 4096
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_hn  # [BLOCK_N, 1] pointers
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wv  # [BLOCK_V, 1] pointers
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks  # [BLOCK_K]
        k_ok = k < H  # H need not be a multiple of BLOCK_K
        a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_V, BLOCK_K]
        if DOT_F32:
            # Interpreter only (CPU tensors): a float32 dot as products summed over K. Triton's
            # interpreter multiplies bf16 as raw uint16 bits, and its np.matmul sums K in an
            # order that depends on the tile's shape (BLAS kernels), so the forward's 128x128
            # tile and the backward's 64x128 one would round a logit differently; a GPU MMA
            # sums each element's K chunk the same way whatever the tile shape.
            prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_N, BLOCK_V, BLOCK_K]
            acc = acc + block_sum(prod, 2)
        elif IEEE:  # float32 inputs: no silent TF32 rounding
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_V]
        acc = acc + b[None, :]
    return acc / temperature


@jit
def _online_update(z, cols, col_ok, label, m, s, u, zy):
    """Folds one float32 logits tile ``z`` [BLOCK_N, BLOCK_V] (vocabulary ids ``cols`` [BLOCK_V]; a column past V,
    ``col_ok`` False, counts as a -inf logit) into each row's online statistics, [BLOCK_N] float32 each: running max
    ``m``, ``s = Σ exp(z - m)``, ``u = Σ exp(z - m)(z - m)`` and ``zy``, the logit of the row's ``label`` (read from
    the float32 tile). Returns the updated ``(m, s, u, zy)``. ``linear_logprobs``' forward and ``fused_policy``'s
    statistics kernel both fold their tiles with it (Triton inlines it)."""
    z = tl.where(col_ok[None, :], z, float("-inf"))
    m_new = tl.maximum(m, block_max(z, 1))  # [BLOCK_N]
    alpha = tl.exp(m - m_new)
    d = z - m_new[:, None]  # [BLOCK_N, BLOCK_V]
    e = tl.exp(d)
    # p log p counts 0 where p = 0: a -inf logit (a masked vocabulary entry, or a column
    # past V) adds nothing, never 0 * -inf = NaN; NaN logits still propagate
    ed = e * tl.where(d == float("-inf"), 0.0, d)
    u = alpha * (u + s * (m - m_new)) + block_sum(ed, 1)
    s = alpha * s + block_sum(e, 1)
    zy += block_sum(tl.where(cols[None, :] == label[:, None], z, 0.0), 1)
    return m_new, s, u, zy


@jit
def _grouped_item(item, n_blocks, n_cols, GROUP_N: tl.constexpr):
    """Work item -> ``(token block, column)`` (a column: a vocabulary split of ``_fwd_kernel`` and
    ``_fwd_kernel_tma``, a vocabulary tile of ``_dz_kernel``): items run over ``GROUP_N`` token blocks fastest, then
    over the columns, then over groups of token blocks. The GPU starts programs in the order of their ids, so the
    items in flight at once (a wave of about one per SM, or one per program of a persistent grid) cover few token
    blocks -- their hidden rows stay in L2 (``GROUP_N`` x 0.5-1 MiB at H = 4096) -- times several columns, and the
    programs of one column read the same weight tiles at about the same time: the weight is streamed from HBM once
    per group, hidden about once. Walking token blocks fastest instead (a ``(token block, column)`` grid), one wave
    spans every token block of an 8192-token batch (64 MiB of hidden rows, more than the 50 MB L2 of an H100), and
    every vocabulary tile re-reads them from HBM."""
    group = item // (GROUP_N * n_cols)
    first = group * GROUP_N
    size = tl.minimum(n_blocks - first, GROUP_N)  # the last group may hold fewer token blocks
    within = item - group * (GROUP_N * n_cols)
    return first + within % size, within // size


# The token count N of the GEMM kernels below (and fused_policy's kernel 2) is not specialized: Triton would compile
# one variant for N divisible by 16, one for N == 1 and one for any other N, and an RL trainer's token count (and a
# last chunk's) changes every step, so each new class cost a compile of a Hopper GEMM kernel (seconds) inside some
# later step. N only bounds the rows here (masks, tile counts; the TMA descriptors hold it on the host), so its
# divisibility buys no vector width: the loads and stores run along H and V, whose strides keep theirs. (The
# memory-bound kernels keep their sizes specialized: their loads run along those sizes and vectorize only with
# them; tests/test_specializations.py.)
UNSPECIALIZED_ROWS = ("N",)


@jit(do_not_specialize=UNSPECIALIZED_ROWS)
def _fwd_kernel(
    h_ptr, w_ptr, b_ptr, labels_ptr,  # [N, H], [V, H], [V], [N]
    z_ptr,  # [N, V] float32: the logits / T, written with STORE_Z (rlkernels.fused_policy's kernel 1); else unused
    m_ptr, s_ptr, u_ptr, zy_ptr,  # partials, each [S, N] float32
    N, V, H, stride_hn, stride_wv, temperature,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    STORE_Z: tl.constexpr, GROUP_N: tl.constexpr,
):
    # a 1-D grid of (token block, vocabulary split) items, GROUP_N token blocks fastest (_grouped_item)
    pid_n, split = _grouped_item(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, SPLIT_TILES * BLOCK_V), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < N
    label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)  # [BLOCK_N] int64
    # finite start: keeps the first rescale free of 0 * inf
    m = tl.full((BLOCK_N,), -1.0e30, dtype=tl.float32)  # running max of z
    s = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # Σ exp(z - m)
    u = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # Σ exp(z - m)(z - m)
    zy = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # z of the label, from the float32 accumulator
    v_start = split * SPLIT_TILES * BLOCK_V
    for t in range(0, SPLIT_TILES):
        v0 = v_start + t * BLOCK_V
        if v0 < V:
            cols = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            col_ok = cols < V
            z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H,
                             stride_hn, stride_wv, temperature,
                             HAS_BIAS, IEEE, DOT_F32, BLOCK_N, BLOCK_V, BLOCK_K)  # [BLOCK_N, BLOCK_V]
            if STORE_Z:  # 64-bit row offsets
                tl.store(z_ptr + rows[:, None].to(tl.int64) * V + cols[None, :], z,
                         mask=row_ok[:, None] & col_ok[None, :])
            m, s, u, zy = _online_update(z, cols, col_ok, label, m, s, u, zy)
    out = split.to(tl.int64) * N + rows  # [BLOCK_N]
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(u_ptr + out, u, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)




@jit
def _logits_tile_tma(h_desc, w_desc, b_ptr, row0, col0, V, H, HAS_BIAS: tl.constexpr,
                     DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The Hopper kernels' logits tile ``hidden[row0:] @ weight[col0:].T + bias[col0:]`` (not yet divided by T),
    float32 [BLOCK_N, BLOCK_V]: a K loop of TMA loads (zero-filled past the tensors' ends) and wgmma. The forward and
    the backward both call it with the same ``BLOCK_K``, so a logit comes out the same bits in both. (The callers
    form their row and column indices after it: live through the K loop, they cost Triton 3.6's sm_90 build of the
    dz kernel 200 B of spills.)"""
    acc = tl.full((BLOCK_N, BLOCK_V), 0.0, dtype=tl.float32)  # [BLOCK_N, BLOCK_V]
    for k0 in range(0, H, BLOCK_K):
        a = h_desc.load([row0, k0])  # [BLOCK_N, BLOCK_K]
        w = w_desc.load([col0, k0])  # [BLOCK_V, BLOCK_K]
        if DOT_F32:  # interpreter only: see _logits_tile
            prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_N, BLOCK_V, BLOCK_K]
            acc = acc + block_sum(prod, 2)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        cols = col0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        acc = acc + tl.load(b_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
    return acc


@jit(do_not_specialize=UNSPECIALIZED_ROWS)
def _fwd_kernel_tma(
    h_desc, w_desc,  # TMA descriptors: hidden [N, H] in [BLOCK_N, BLOCK_K] boxes, weight [V, H] in [BLOCK_V, BLOCK_K]
    b_ptr, labels_ptr,  # [V], [N] int64
    z_desc,  # STORE_Z: TMA descriptor of the [N, V] float32 logits / T in [BLOCK_N, BLOCK_V] boxes; else unused
    m_ptr, s_ptr, u_ptr, zy_ptr,  # partials, each [S, N] float32, as _fwd_kernel writes them
    N, V, H, temperature,  # divides the logits, as in _logits_tile (see below)
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    GROUP_N: tl.constexpr, FLATTEN: tl.constexpr, STORE_Z: tl.constexpr,
):
    """The Hopper forward: ``_fwd_kernel``'s math and partials over a persistent grid (``P`` programs, about one
    per SM).

    Program ``pid`` takes the work items ``pid, pid + P, ...`` (:func:`_grouped_item`); an item is one token block x
    one split of ``SPLIT_TILES`` vocabulary tiles, walked tile by tile, each tile a K loop of TMA loads and wgmma.
    ``FLATTEN``: the compiler flattens the (tile, K step) loops into one pipelined loop, so the next tile's first
    TMA loads (``num_stages - 1`` steps ahead) are in flight during this tile's log-sum-exp epilogue; the price (sm_90
    SASS, triton 3.9) is a wgmma wait(0) every K step instead of one group kept in flight. Without it each tile's K
    loop keeps a wgmma group in flight and drains (and refills its loads) at the tile's end. A split past ``V``
    (only the last one) reads zero-filled boxes whose columns are masked to -inf: it adds nothing (at most
    ``SPLIT_TILES - 1`` tiles of wasted work per token block). Rows past ``N`` and K past ``H`` read zeros.

    The logits are divided by ``T``, not multiplied by ``1/T`` (issue 13 asks for the multiply): the backward's
    recomputation (``_logits_tile``) divides, and a logit one float32 ulp away from the backward's moved the
    gradients at T = 1e-3 to twice eager's error (bf16, d_hidden 4.9e-3 against eager's 2.3e-3, under the
    interpreter). Multiply here once ``_logits_tile`` multiplies too: both, or neither.

    ``STORE_Z`` (rlkernels.fused_policy's kernel 1 on sm_90): each tile of logits / T also goes to the float32
    ``[N, V]`` tile through ``z_desc`` (a TMA store from shared memory; the descriptor clips rows past ``N`` and
    columns past ``V``)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    n_splits = tl.cdiv(V, SPLIT_TILES * BLOCK_V)
    my_items = tl.cdiv(n_blocks * n_splits - pid, P)
    m = tl.full((BLOCK_N,), -1.0e30, dtype=tl.float32)  # running max of z (finite start: no 0 * inf)
    s = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # Σ exp(z - m)
    u = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # Σ exp(z - m)(z - m)
    zy = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)  # z of the label
    for step in tl.range(0, my_items * SPLIT_TILES, flatten=FLATTEN):
        j = step // SPLIT_TILES  # this program's j-th item
        t = step - j * SPLIT_TILES  # vocabulary tile within the split
        blk_n, split = _grouped_item(pid + j * P, n_blocks, n_splits, GROUP_N)
        row0 = blk_n * BLOCK_N
        col0 = (split * SPLIT_TILES + t) * BLOCK_V
        acc = _logits_tile_tma(h_desc, w_desc, b_ptr, row0, col0, V, H, HAS_BIAS, DOT_F32, BLOCK_N, BLOCK_V,
                               BLOCK_K)  # [BLOCK_N, BLOCK_V]
        rows = row0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        cols = col0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        col_ok = cols < V
        z = acc / temperature  # [BLOCK_N, BLOCK_V]
        if STORE_Z:
            z_desc.store([row0, col0], z)
        label = tl.load(labels_ptr + rows, mask=rows < N, other=-1)  # [BLOCK_N] int64
        m, s, u, zy = _online_update(z, cols, col_ok, label, m, s, u, zy)
        if t == SPLIT_TILES - 1:  # the item is complete: its partials, then fresh statistics
            out = split.to(tl.int64) * N + rows  # [BLOCK_N]
            row_ok = rows < N
            tl.store(m_ptr + out, m, mask=row_ok)
            tl.store(s_ptr + out, s, mask=row_ok)
            tl.store(u_ptr + out, u, mask=row_ok)
            tl.store(zy_ptr + out, zy, mask=row_ok)
            # s and u restart by themselves: the next tile's alpha = exp(-1e30 - m_new) is 0
            m = tl.full((BLOCK_N,), -1.0e30, dtype=tl.float32)
            zy = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)


@jit(do_not_specialize=UNSPECIALIZED_ROWS)
def _dz_kernel(
    h_ptr, w_ptr, b_ptr, labels_ptr,  # [n, H], [V, H], [V], [n] (a chunk of tokens; a chunk of the vocabulary)
    m_ptr, logs_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [n] float32 each: row max, log Σ exp(z - max), entropy, upstream grads
    dz_ptr,  # [n, V] input dtype, contiguous
    resid_ptr,  # [n] float32: dz at the label minus its rounded stored value (written only where the label is a column)
    N, V, H, stride_hn, stride_wv, temperature, ignore_index,
    col0,  # the vocabulary id of w_ptr's first row: a label y is column y - col0 of this chunk
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    # a 1-D grid of (token block, vocabulary tile) items, GROUP_N token blocks fastest (_grouped_item)
    pid_n, pid_v = _grouped_item(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    row_ok = rows < N
    col_ok = cols < V
    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H,
                     stride_hn, stride_wv, temperature,
                     HAS_BIAS, IEEE, DOT_F32, BLOCK_N, BLOCK_V, BLOCK_K)  # [BLOCK_N, BLOCK_V]
    label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)  # [BLOCK_N]
    # the label's column in this vocabulary chunk (outside [0, V): another chunk's)
    _dz_store(z, rows, cols, row_ok, col_ok, label - col0, label != ignore_index, m_ptr, logs_ptr, ent_ptr, glogp_ptr,
              gent_ptr, dz_ptr, resid_ptr, V, temperature, pid_v * BLOCK_V, BLOCK_V)


@jit(do_not_specialize=UNSPECIALIZED_ROWS)
def _dz_kernel_tma(
    h_desc, w_desc,  # TMA descriptors: hidden [n, H] in [BLOCK_N, BLOCK_K] boxes, weight [V, H] in [BLOCK_V, BLOCK_K]
    b_ptr, labels_ptr,  # [V], [n] (a chunk of tokens; a chunk of the vocabulary, as _dz_kernel's)
    m_ptr, logs_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [n] float32 each, as _dz_kernel's
    dz_ptr,  # [n, V] input dtype, contiguous
    resid_ptr,  # [n] float32
    N, V, H, temperature, ignore_index,
    col0,  # the vocabulary id of the weight chunk's first row
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    """The Hopper dz kernel (after ``_fwd_kernel_tma``): ``_dz_kernel``'s work over a persistent grid, each logits
    tile a K loop of TMA loads and wgmma with N = BLOCK_V (``_fwd_kernel_tma``'s main loop, K in its blocks, so the
    logits are the forward's bits), then ``_dz_store``. Program ``pid`` takes the items ``pid, pid + P, ...`` of
    the (token block, vocabulary tile) items, grouped (:func:`_grouped_item`). Rows past ``N``, columns past ``V``
    and K past ``H`` read zero-filled boxes and are masked in the store."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    n_cols = tl.cdiv(V, BLOCK_V)
    my_items = tl.cdiv(n_blocks * n_cols - pid, P)
    for j in range(0, my_items):
        blk_n, blk_v = _grouped_item(pid + j * P, n_blocks, n_cols, GROUP_N)
        row0 = blk_n * BLOCK_N
        v_first = blk_v * BLOCK_V
        acc = _logits_tile_tma(h_desc, w_desc, b_ptr, row0, v_first, V, H, HAS_BIAS, DOT_F32, BLOCK_N, BLOCK_V,
                               BLOCK_K)  # [BLOCK_N, BLOCK_V]
        rows = row0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        cols = v_first + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        row_ok = rows < N
        col_ok = cols < V
        label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)  # [BLOCK_N]
        _dz_store(acc / temperature, rows, cols, row_ok, col_ok, label - col0, label != ignore_index, m_ptr,
                  logs_ptr, ent_ptr, glogp_ptr, gent_ptr, dz_ptr, resid_ptr, V, temperature, v_first, BLOCK_V)


@jit
def _dz_store(z, rows, cols, row_ok, col_ok, y, valid, m_ptr, logs_ptr, ent_ptr, glogp_ptr, gent_ptr, dz_ptr, resid_ptr,
              V, temperature, v_first, BLOCK_V: tl.constexpr):
    """dL/dz of a ``[BLOCK_N, BLOCK_V]`` tile of logits / T ``z`` (columns ``cols`` of the rows ``rows``), stored in
    ``dz_ptr``'s dtype at ``rows x cols`` of the ``[n, V]`` buffer, and the label entry's 16-bit rounding loss in
    ``resid_ptr`` [n] float32 (only where the label's column ``y`` [BLOCK_N] lies in this tile, whose first column
    is ``v_first``; ``valid``: not ignored). The one place the backward's ``dz`` formula is written: ``_dz_kernel``
    (logits recomputed) and :mod:`rlkernels.fused_policy`'s kernel 2 (logits read back from the forward's tile)
    call it. Per row it reads the forward's row max, log Σ exp, entropy and the upstream gradients of log p and
    the entropy, each [n] float32."""
    m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)  # [BLOCK_N]
    log_s = tl.load(logs_ptr + rows, mask=row_ok, other=0.0)  # [BLOCK_N]
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)  # [BLOCK_N]
    g_lp = tl.where(valid, tl.load(glogp_ptr + rows, mask=row_ok, other=0.0), 0.0)  # [BLOCK_N] dL/dlogp
    g_h = tl.where(valid, tl.load(gent_ptr + rows, mask=row_ok, other=0.0), 0.0)  # [BLOCK_N] dL/dentropy
    # log p = (z - max) - log s, as eager's log_softmax forms it: one float32 lse = max + log s
    # would carry an absolute error of ulp(max) (6e-5 at logits ~1000) into every log p
    logp = (z - m[:, None]) - log_s[:, None]  # [BLOCK_N, BLOCK_V]
    p = tl.exp(logp)
    is_y = cols[None, :] == y[:, None]  # [BLOCK_N, BLOCK_V]
    # The label's entry, per row, from its log p (the one entry of the row this tile may hold; rows whose label is
    # elsewhere compute a value nobody uses): g (1 - p_y) - g_H p_y (log p_y + H), 1 - p_y without cancellation
    # where p_y ~ 1 (expm1's polynomial over the whole tile cost ~12 more PTX instructions per element). Formed on
    # [BLOCK_N] rows, so its 16-bit rounding loss below needs no tile-sized temporaries (registers: the Hopper dz
    # kernel's 64x128 tiles on one warpgroup fit only so).
    logp_y = block_sum(tl.where(is_y, logp, 0.0), 1)  # [BLOCK_N]
    p_y = tl.exp(logp_y)
    dz_y = (g_lp * -expm1(logp_y) - g_h * p_y * (tl.where(logp_y == float("-inf"), 0.0, logp_y) + ent)) / temperature
    dz_y = tl.where(valid, dz_y, 0.0)  # [BLOCK_N]
    # every other entry: -g p - g_H p (log p + H); p (log p + H) is 0 where p = 0 (a -inf logit), never 0 * -inf
    dz = -g_lp[:, None] * p - g_h[:, None] * p * (tl.where(logp == float("-inf"), 0.0, logp) + ent[:, None])
    dz = tl.where(is_y, dz_y[:, None], tl.where(valid[:, None], dz / temperature, 0.0))
    offs = rows[:, None].to(tl.int64) * V + cols[None, :]
    tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    # The label's entry dominates a row of dz (g_logp (1 - p_y)); what rounding it to
    # 16 bits lost is kept in float32 and added back after the GEMMs (O(N·H) work).
    lost = dz_y - dz_y.to(dz_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_N]
    # the label is a column of this tile and of the chunk (a last tile reaching past V holds no label column there)
    has_y = (y >= v_first) & (y < tl.minimum(v_first + BLOCK_V, V)) & valid & row_ok
    tl.store(resid_ptr + rows, lost, mask=has_y)


@jit(do_not_specialize=UNSPECIALIZED_ROWS)  # the chunk's token count: see there
def _dz_from_tile_kernel(
    z_ptr,  # [n, V] float32: a stored tile of logits (RAW) or logits / T
    labels_ptr, m_ptr, logs_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [n] each (float32 but the labels), as _dz_kernel's
    dz_ptr,  # [n, V] inputs' dtype (float32: may be the same memory as z_ptr, written in place)
    resid_ptr,  # [n] float32: dz at the label minus its rounded stored value
    N, V, temperature, ignore_index,
    col0,  # the vocabulary id of the tile's first column: a label y is column y - col0 of it
    RAW: tl.constexpr,  # the tile holds the logits themselves (cuBLAS's), divided by T here as _dz_kernel does
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """``_dz_kernel``'s work on logits already in memory (no GEMM): a ``[BLOCK_N, BLOCK_V]`` block of the stored
    tile read once, ``_dz_store`` writing its dz. :mod:`rlkernels.fused_policy`'s kernel 2 reads back the tile its
    kernel 1 stored (logits / T, the forward's bits); the "cublas" backward (:func:`_dz_launcher`) a tile of logits
    that cuBLAS has just recomputed (``RAW``)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] columns of the tile
    row_ok = rows < N
    col_ok = cols < V
    offs = rows[:, None].to(tl.int64) * V + cols[None, :]  # [BLOCK_N, BLOCK_V]
    io_ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + offs, mask=io_ok, other=0.0)  # [BLOCK_N, BLOCK_V]
    if RAW:
        z = z / temperature
    label = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)  # [BLOCK_N]
    _dz_store(z, rows, cols, row_ok, col_ok, label - col0, label != ignore_index, m_ptr, logs_ptr, ent_ptr, glogp_ptr,
              gent_ptr, dz_ptr, resid_ptr, V, temperature, pid_v * BLOCK_V, BLOCK_V)


# ---------------------------------------------------------------- launchers


@dataclass(frozen=True)
class LinearLogprobsOptions:
    """The validated non-tensor arguments of one :func:`linear_logprobs` call, under the public keyword names and
    meanings, down to the kernels (which receive ``temperature`` and ``ignore_index`` as they are). Both custom ops
    take them as ``*option_values(opt)`` (typed lists) and rebuild them with ``options_from``; defaults live only
    in the public signature."""

    temperature: float  # > 0: divides the logits
    return_entropy: bool  # False: the entropy output is zeros (the torch backend skips its work) with no gradient
    ignore_index: int  # the label value whose tokens give 0 in both outputs and no gradient


@dataclass(frozen=True)
class LinearLogprobsBackwardOptions:
    """The backward op's options: :class:`LinearLogprobsOptions`' fields, then whether ``weight``'s gradient is
    wanted (False for a frozen head: no ``d_weight`` GEMM and no ``[V, H]`` buffer) and whether ``hidden``'s is
    (False when only the head trains: no ``d_hidden`` GEMM and no ``[N, H]`` buffer); the op returns ``[0]`` for a
    gradient not wanted."""

    temperature: float
    return_entropy: bool
    ignore_index: int
    grad_weight: bool
    grad_input: bool


def _validate(*, hidden, weight, labels, bias, temperature, return_entropy, ignore_index) -> LinearLogprobsOptions:
    """Checks :func:`linear_logprobs`'s arguments (each error names its argument); returns the options. The labels'
    range is checked where they are read (the op, or the reference path), on the CPU."""
    _checks.floating(hidden, "hidden")
    _checks.integer(labels, "labels")
    if hidden.dim() < 1:
        raise ValueError(f"hidden must have at least one dimension [..., H], got shape {tuple(hidden.shape)}")
    _checks.lm_head(hidden, weight, bias)
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}")
    _checks.same_device((hidden, "hidden"), (weight, "weight"), (labels, "labels"), (bias, "bias"))
    return LinearLogprobsOptions(temperature=_checks.temperature(temperature),
                                 return_entropy=_checks.flag(return_entropy, "return_entropy"),
                                 ignore_index=_checks.index(ignore_index, "ignore_index"))


@dataclass(frozen=True)
class _Tiles:
    block_n: int
    block_v: int
    block_k: int
    split_tiles: int
    num_warps: int
    num_stages: int
    # token blocks the grid runs over fastest (_grouped_item): 16 keeps a wave's hidden rows (8-16 MiB at H = 4096)
    # in L2 while the weight streams once per group (N / (16·BLOCK_N) times: 4-8 x at N = 8192)
    group_n: int = 16


# Tile shapes, per kernel and input dtype: the largest that compile with no register spills
# (0 B local memory) for sm_80 and sm_90 (tests/test_fused_linear.py::test_aot_compiles_every_config
# asserts it), all on tensor cores (tl.dot). The float32 [BLOCK_N, BLOCK_V] accumulator and the
# softmax temporaries of the same shape live in registers; a 128x128 tile leaves room for them
# only with BLOCK_K=32 in the forward (BLOCK_K=64: 255 registers and ~300 B spilled), and the
# backward, which holds more temporaries per element (p, log p, dz, its rounded copy), gets
# 64x128 (128x128 spilled 24-80 B). float32 (ieee dot, 4-byte operands) takes 64-row tiles.
# The backward recomputes the forward's logits, so it takes the forward's BLOCK_K: the same K
# chunks summed in the same order give the same logit bit for bit (a different K blocking
# moved a logit by an ulp, which at T = 1e-3 moved p by 1e-4 and the gradients by far more
# than eager's error). Tile rows and columns do not change a logit's accumulation order.
# The forward runs its 128x128 tile with 16 warps: at 8 warps it needed all 255 registers and
# spilled 8 B on sm_90 once the launcher's divisible-by-16 specialization applied (aligned rows,
# the common case); 16 warps split the same tile (same arithmetic intensity, still one CTA per
# SM) at 112-128 registers with no spill on sm_80/sm_90, aligned or not.
_FWD_TILES_16 = _Tiles(block_n=128, block_v=128, block_k=32, split_tiles=32, num_warps=16, num_stages=3)
# Before Hopper (sm_80, sm_86, sm_89) the 16-warp tile is capped at 128 registers too, and triton 3.6 (the GPU
# machines' version) spills 32 B there (3.9: none); 64x128 on 8 warps compiles with no spill on sm_80 with both
# (158-216 registers with 3.6). Same BLOCK_K, so the backward's recomputed logits stay the forward's bits.
_FWD_TILES_16_PRE_HOPPER = _Tiles(block_n=64, block_v=128, block_k=32, split_tiles=32, num_warps=8, num_stages=3)
_BWD_TILES_16 = _Tiles(block_n=64, block_v=128, block_k=_FWD_TILES_16.block_k, split_tiles=1, num_warps=8, num_stages=3)
# float32 forward: K steps of 16 (32 spilled 40 B on sm_80 once the K loop read unit-stride rows); 3 stages: with 2,
# triton 3.6's sm_80 build was held to 128 registers and spilled 8 B (3 stages: 184-188 unaligned, 128 aligned, none)
_FWD_TILES_32 = _Tiles(block_n=64, block_v=64, block_k=16, split_tiles=64, num_warps=8, num_stages=3)
_BWD_TILES_32 = _Tiles(block_n=64, block_v=128, block_k=_FWD_TILES_32.block_k, split_tiles=1, num_warps=8, num_stages=2)


@dataclass(frozen=True)
class _PersistentTiles(_Tiles):
    flatten: bool = False  # True: one flattened (tile, K) loop, the loads overlapping the epilogue (_fwd_kernel_tma)
    ctas_per_sm: int = 1  # persistent programs per SM (the grid is SMs x this), as many as fit


# The Hopper forward (_fwd_kernel_tma, 16-bit inputs): 128x128 tiles on 8 warps, so each of the two warpgroups issues
# wgmma m64n128k16 (N >= 128: per 128x128x16 step the warpgroups read 12 KiB of shared-memory operands, against 16
# KiB for the 16-warp kernel's four m64n64 pieces), K steps of 64 (one 128-byte TMA box row, the widest swizzle),
# 4 stages of (16 + 16) KiB in flight. Splits of 16 tiles (2048 columns: 63 splits at V = 128256) give 64 x 63
# items at N = 8192 (31 per SM on 132 SMs: < 4 % tail); groups of 16 token blocks keep 16 MiB of hidden rows in L2
# (50 MB on H100) while a wave of 132 items covers ~8 splits, so the weight is streamed from HBM once per group:
# N / 2048 times (4 x 1.05 GB at N = 8192, against ~8.6 TFLOP).
# Schedule: tile by tile (flatten=False), read off the sm_90 SASS: 150-228 registers with triton 3.9 (this machine),
# 161-206 with triton 3.6 (the GPU machines'; compiled here from its wheel), no spill, 1 CTA per SM (131 KB
# shared), HGMMA 64x128x16 and 8 UTMALDG with both, a wgmma group kept in flight through the K loop
# (WARPGROUP.DEPBAR.LE gsb0, 0x1), the pipeline drained and refilled at each tile's end. flatten=True (issue 13's
# "next tile's loads overlap the epilogue") compiles with triton 3.9 to one loop that does overlap them, but waits
# for every K step's wgmma (DEPBAR.LE gsb0, 0x0) and needs 254-255 registers (8 B spilled without bias in the
# unaligned specialization, and as launched since the token count is unspecialized: UNSPECIALIZED_ROWS); triton
# 3.6 does not compile it at all (TritonGPUFuseNestedLoops: "'scf.if' op region control flow edge ... source has 5
# operands, but target successor needs 9"). So not the default: `make gpu` measures it where it builds
# (bench_fused_linear: "rlkernels fwd tma" / "tma flat"; bench/model.py predicts the tile-by-tile schedule ~4 % faster
# at the contract's sizes). tests/test_fused_linear.py asserts the SASS facts.
_TMA_TILES = _PersistentTiles(block_n=128, block_v=128, block_k=64, split_tiles=16, num_warps=8, num_stages=4,
                              group_n=16, flatten=False)
# The other way to overlap the epilogue with the tensor cores: 64x128 tiles on 4 warps (one warpgroup, still wgmma
# m64n128k16), two CTAs per SM (sm_90 SASS: 154-228 registers with triton 3.9, 160-214 with 3.6, no spill, 98 KB
# shared, 8 UTMALDG, HGMMA 64x128x16), so one CTA's softmax epilogue runs while the other's wgmma does (the warp
# scheduler's ping-pong: triton PR 9279 found a persistent Hopper matmul with two CTAs per SM faster unflattened, on
# H200, and gave this overlap as the likely reason). The same kernel; bench_fused_linear's "rlkernels fwd tma 2cta"
# row measures it against _TMA_TILES; not selected by the launcher until measured.
_TMA_TILES_2CTA = _PersistentTiles(block_n=64, block_v=128, block_k=64, split_tiles=16, num_warps=4, num_stages=4,
                                   group_n=32, flatten=False, ctas_per_sm=2)
# The Hopper dz kernel (_dz_kernel_tma, after the Hopper forward, 16-bit inputs): 64x128 tiles on 4 warps (one
# warpgroup: wgmma m64n128k16, against _dz_kernel's m64n64 from 8 warps), K steps of the forward's 64, 4 stages,
# two CTAs per SM so one's dz epilogue overlaps the other's main loop; a persistent grid, items grouped as the
# forward's. sm_90 SASS: 167-230 registers with triton 3.9, 203-255 with 3.6, no spill, 98 KB shared, UTMALDG,
# HGMMA 64x128x16 (tests/test_fused_linear.py asserts it). 128x128 on 8 warps also fits (194-249 / 250-255
# registers, 1 CTA per SM). Not measured: bench_fused_linear's "dz kernel tma" row measures it against _dz_kernel.
_TMA_DZ_TILES = _PersistentTiles(block_n=64, block_v=128, block_k=_TMA_TILES.block_k, split_tiles=1, num_warps=4,
                                 num_stages=4, group_n=16, flatten=False, ctas_per_sm=2)


@dataclass(frozen=True)
class _ElementwiseTiles:
    """A memory-bound kernel's ``[block_n, block_v]`` block, one per program, on ``num_warps`` warps."""

    block_n: int
    block_v: int
    num_warps: int


# _dz_from_tile_kernel (elementwise over a stored float32 tile, no GEMM): 32 x 128 on 8 warps (32 x 256 spilled
# 40-112 B unaligned). With triton 3.6 (the GPU machines') its sm_90 build holds 232-236 registers: one CTA of 256
# threads per SM, 16 KiB of the tile's loads in flight per SM, and linear_policy_loss's kernel 2 moved its 7.5 GB at
# 3.0 TB/s on the H200 (2.5 ms; bench/results/NVIDIA_H200-2026-11-27.md), 71 % of the copy rate.
_TILE_DZ = _ElementwiseTiles(block_n=32, block_v=128, num_warps=8)
# The candidate, not the default until measured: 16 x 256 on 4 warps, 32 elements a thread (twice as many), 2 CTAs per
# SM (214-225 registers with triton 3.6, 168-194 with 3.9, no spill on sm_80/sm_90): 32 KiB of loads in flight per
# SM, about what Little's law asks of an H200 SM (4.8 TB/s / 132 SMs x ~0.8 us). Prediction, not a measurement:
# kernel 2 ~2.0 ms instead of 2.5 (3.8 TB/s, the softmax kernels' rate there). The bench's "kernel 2, 16x256 tiles"
# and "dz kernel cublas, 16x256 tiles" rows time it (8 x 256 on 4 warps: 5 CTAs, 40 KiB, but 8 B spilled with
# triton 3.6's sm_90 raw-tile build; 8 x 128: 5-6 CTAs, 20-24 KiB).
_TILE_DZ_WIDE = _ElementwiseTiles(block_n=16, block_v=256, num_warps=4)


@dataclass(frozen=True)
class _CublasTiles(_Tiles):
    """The "cublas" backward (after the cuBLAS forward, 16-bit inputs): cuBLAS recomputes each block of logits into
    a float32 tile and ``_dz_from_tile_kernel`` turns it into ``dz`` (:func:`_dz_launcher`). ``block_n`` x
    ``block_v`` are that kernel's tiles; the chunks end on them and hold the float32 tile beside ``dz``."""


_CUBLAS_DZ_TILES = _CublasTiles(block_n=_TILE_DZ.block_n, block_v=_TILE_DZ.block_v, block_k=0, split_tiles=1,
                                num_warps=_TILE_DZ.num_warps, num_stages=1)
_INTERPRETER_PROGRAMS = 3  # persistent programs under the interpreter (CPU): several items per program, tested
# The backward's dz workspace ([N, vc] vocabulary outer, [chunk, V] tokens outer) stays under this. With d_hidden's
# float32 [N, H] beside it, the backward's extra memory at N = 8192, H = 4096 is ~0.7 GiB (dz 512 MiB in 4-5 chunks
# of 32768 columns, d_hidden 128 MiB, the label residuals' [k, H] float32 sums), inside the contract's N·H·4 bytes
# + 1 GiB. (It was 1 GiB, with a float32 [vc, H] slice of d_weight beside dz: the H100 run of 2026-11-26 measured 2285 /
# 2452 MiB of peak at V = 128256 / 151936, ~1.2 GiB beyond the gradients.)
_DZ_BUDGET_BYTES = 1 << 29
_TORCH_BUDGET_ELEMS = 1 << 19  # elements of one [rows, vchunk] tile in the torch backend (2 MiB float32: L2-sized)
_TORCH_VCHUNK = 2048  # widest vocabulary chunk of that tile
_TORCH_PARTIAL_ELEMS = 1 << 22  # the torch forward's per-(vocabulary chunk, row) partials of a group of rows


def _tiles(dtype: torch.dtype, backward: bool = False, hopper: bool = True) -> _Tiles:
    """The tiles of ``_fwd_kernel`` (or, with ``backward``, ``_dz_kernel``) for this input dtype; ``hopper=False``:
    a GPU before sm_90 (the interpreter takes the Hopper tiles)."""
    if dtype == torch.float32:
        return _BWD_TILES_32 if backward else _FWD_TILES_32
    if backward:
        return _BWD_TILES_16
    return _FWD_TILES_16 if hopper else _FWD_TILES_16_PRE_HOPPER


def _bwd_tiles(hidden: torch.Tensor, weight: torch.Tensor) -> _Tiles:
    """The dz kernel and its tiles for these inputs (``hidden`` [N, H], ``weight`` [V, H]), after the forward kernel
    that ran (:func:`_fwd_kernel_choice`, asked again: the same inputs and switch): after ``_fwd_kernel``,
    ``_dz_kernel`` with ``_BWD_TILES_16`` (or its float32 sibling); after the Hopper forward, ``_dz_kernel_tma``
    with ``_TMA_DZ_TILES`` (a ``_PersistentTiles``). Either way ``BLOCK_K`` is the forward's, so the recomputed
    logits sum K in the forward's chunks and are its bits -- the Hopper forward (``_TMA_TILES``) steps K by 64
    where ``_fwd_kernel`` steps by 32. A low temperature magnifies any difference between the forward's logits and
    the backward's (see the note above ``FWD_KERNEL_ENV``)."""
    choice = _fwd_kernel_choice(hidden, weight)
    if choice == "tma":  # 16-bit inputs, aligned rows, sm_90 (or the interpreter)
        return replace(_TMA_DZ_TILES, block_k=_TMA_TILES.block_k)
    if choice == "cublas":  # 16-bit inputs: the logits recomputed by cuBLAS too, in float32
        return _CUBLAS_DZ_TILES
    return _tiles(hidden.dtype, backward=True)


def _dz_bytes_per_element(dtype: torch.dtype, t: _Tiles) -> int:
    """Workspace bytes per ``dz`` element of a backward chunk: ``dz`` in the inputs' dtype, and with the "cublas"
    backward (``_CublasTiles``) the float32 logits tile beside it."""
    return torch.empty((), dtype=dtype).element_size() + (4 if isinstance(t, _CublasTiles) else 0)


def _hopper(t: torch.Tensor) -> bool:
    """Whether ``t``'s device takes the Hopper tiles: sm_90 or later, or a CPU tensor (the interpreter)."""
    return t.device.type != "cuda" or torch.cuda.get_device_capability(t.device)[0] >= 9


def _dot_f32(hidden: torch.Tensor) -> bool:
    """Under the interpreter (CPU tensors) the kernels take their float32, tile-shape-independent dot."""
    return hidden.device.type == "cpu"


def _kernel_flags(dtype: torch.dtype, has_bias: bool, dot_f32: bool, t: _Tiles) -> dict:
    """The constexprs ``_fwd_kernel`` and ``_dz_kernel`` share: the backward's logits are the forward's only with
    the same ones (``GROUP_N`` orders the grid and changes no value)."""
    return {"HAS_BIAS": has_bias, "IEEE": dtype == torch.float32, "DOT_F32": dot_f32,
            "BLOCK_N": t.block_n, "BLOCK_V": t.block_v, "BLOCK_K": t.block_k, "GROUP_N": t.group_n}


_SIZES = {"N": "i32", "V": "i32", "H": "i32", "stride_hn": "i32", "stride_wv": "i32", "temperature": "fp32"}


def _fwd_signature(ty: str) -> dict:
    inputs = {"h_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}", "labels_ptr": "*i64", "z_ptr": "*fp32"}
    partials = {"m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32", "zy_ptr": "*fp32"}
    return {**inputs, **partials, **_SIZES}


def _dz_signature(ty: str) -> dict:
    inputs = {"h_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}", "labels_ptr": "*i64"}
    rows = {"m_ptr": "*fp32", "logs_ptr": "*fp32", "ent_ptr": "*fp32", "glogp_ptr": "*fp32", "gent_ptr": "*fp32"}
    return {**inputs, **rows, "dz_ptr": f"*{ty}", "resid_ptr": "*fp32", **_SIZES, "ignore_index": "i64", "col0": "i64"}


def _dz_from_tile_signature(ty: str) -> dict:
    rows = {"labels_ptr": "*i64", "m_ptr": "*fp32", "logs_ptr": "*fp32", "ent_ptr": "*fp32", "glogp_ptr": "*fp32",
            "gent_ptr": "*fp32"}
    return {"z_ptr": "*fp32", **rows, "dz_ptr": f"*{ty}", "resid_ptr": "*fp32", "N": "i32", "V": "i32",
            "temperature": "fp32", "ignore_index": "i64", "col0": "i64"}


def dz_from_tile_configs(ty: str) -> list[KernelConfig]:
    """``_dz_from_tile_kernel``'s configurations for ``ty`` ("fp32"/"bf16"/"fp16") outputs: reading a stored tile
    of logits / T (rlkernels.fused_policy's kernel 2) and of raw logits (the "cublas" kernels: the backward's
    dz here for 16-bit inputs, and fused_policy's kernel 2 after its cuBLAS kernel 1)."""
    from rlkernels.testing.aot import KernelConfig

    configs = []
    for raw in (False, True) if ty != "fp32" else (False,):  # "cublas" takes 16-bit inputs only
        for t in (_TILE_DZ, _TILE_DZ_WIDE):  # the default and the candidate the bench times
            consts = {"RAW": raw, "BLOCK_N": t.block_n, "BLOCK_V": t.block_v}
            configs.append(KernelConfig(_dz_from_tile_kernel, {**_dz_from_tile_signature(ty),
                                                               **dict.fromkeys(consts, "constexpr")},
                                        consts, t.num_warps, 1))
    return configs


def aot_configs() -> list[KernelConfig]:
    """Every (kernel, constexprs, warps, stages) the launcher can pick on a GPU (compiled, so ``DOT_F32`` is False),
    for the AOT compile test."""
    from rlkernels.testing.aot import KernelConfig

    configs = []
    for dtype, ty in TRITON_DTYPE_NAMES.items():
        tb = _tiles(dtype, backward=True)
        for has_bias in (False, True):
            for arch in (80, 90):
                t = _tiles(dtype, hopper=arch >= 90)
                fwd_consts = {**_kernel_flags(dtype, has_bias, False, t), "SPLIT_TILES": t.split_tiles,
                              "STORE_Z": False}
                fwd_sig = {**_fwd_signature(ty), **dict.fromkeys(fwd_consts, "constexpr")}
                configs.append(KernelConfig(_fwd_kernel, fwd_sig, fwd_consts, t.num_warps, t.num_stages,
                                            archs=(arch,)))
            # the dz kernel after _fwd_kernel (after the Hopper forward: _dz_kernel_tma, _tma_aot_configs)
            dz_consts = _kernel_flags(dtype, has_bias, False, tb)
            dz_sig = {**_dz_signature(ty), **dict.fromkeys(dz_consts, "constexpr")}
            configs.append(KernelConfig(_dz_kernel, dz_sig, dz_consts, tb.num_warps, tb.num_stages))
    configs.extend(_tma_aot_configs())
    return configs


def fwd_tma_config(ty: str, has_bias: bool, store_z: bool) -> KernelConfig:
    """``_fwd_kernel_tma``'s configuration for ``ty`` ("bf16"/"fp16") inputs with ``_TMA_TILES``; ``store_z``: the
    float32 logits stored too (rlkernels.fused_policy's kernel 1)."""
    from rlkernels.testing.aot import KernelConfig

    t = _TMA_TILES
    consts = {"HAS_BIAS": has_bias, "DOT_F32": False, "BLOCK_N": t.block_n, "BLOCK_V": t.block_v,
              "BLOCK_K": t.block_k, "SPLIT_TILES": t.split_tiles, "GROUP_N": t.group_n, "FLATTEN": t.flatten,
              "STORE_Z": store_z}
    sig = {"h_desc": f"tensordesc<{ty}[{t.block_n}, {t.block_k}]>",
           "w_desc": f"tensordesc<{ty}[{t.block_v}, {t.block_k}]>",
           "b_ptr": f"*{ty}", "labels_ptr": "*i64",
           "z_desc": f"tensordesc<fp32[{t.block_n}, {t.block_v}]>" if store_z else "constexpr",
           "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp32", "zy_ptr": "*fp32",
           "N": "i32", "V": "i32", "H": "i32", "temperature": "fp32", **dict.fromkeys(consts, "constexpr")}
    if not store_z:
        consts = {**consts, "z_desc": None}
    return KernelConfig(_fwd_kernel_tma, sig, consts, t.num_warps, t.num_stages, archs=(90,))


def _tma_aot_configs() -> list[KernelConfig]:
    """The Hopper kernels' configurations, ``_fwd_kernel_tma`` and ``_dz_kernel_tma`` (16-bit inputs, bias or not),
    for sm_90 only: the launcher never picks them elsewhere (:func:`_tma_ok`)."""
    from rlkernels.testing.aot import KernelConfig

    t = _TMA_TILES
    configs = []
    for ty in ("bf16", "fp16"):
        for has_bias in (False, True):
            configs.append(fwd_tma_config(ty, has_bias, store_z=False))
            td = _TMA_DZ_TILES
            dz_consts = {"HAS_BIAS": has_bias, "DOT_F32": False, "BLOCK_N": td.block_n, "BLOCK_V": td.block_v,
                         "BLOCK_K": td.block_k, "GROUP_N": td.group_n}
            dz_sig = {"h_desc": f"tensordesc<{ty}[{td.block_n}, {td.block_k}]>",
                      "w_desc": f"tensordesc<{ty}[{td.block_v}, {td.block_k}]>",
                      **{k: v for k, v in _dz_signature(ty).items() if k not in ("h_ptr", "w_ptr", "stride_hn",
                                                                                  "stride_wv")},
                      **dict.fromkeys(dz_consts, "constexpr")}
            configs.append(KernelConfig(_dz_kernel_tma, dz_sig, dz_consts, td.num_warps, td.num_stages, archs=(90,)))
    return configs


# ---- which forward kernel (the triton backend)
#
# RLKERNELS_LINEAR_FWD picks the forward of the triton backend on a GPU (unset: "tma" where it can run, else "split"):
# - "split": _fwd_kernel (cp.async + mma.sync on sm_80, wgmma m64n64 on sm_90; every GPU);
# - "tma": _fwd_kernel_tma (TMA descriptors + wgmma m64n128, persistent grid): sm_90 only, 16-bit inputs whose rows
#   are 16-byte aligned (H * 2 % 16 == 0); anywhere else it falls back to "split" (sm_80 keeps cp.async + mma). The
#   backward then takes the Hopper dz kernel, _dz_kernel_tma (_bwd_tiles). The default on sm_90 CUDA tensors;
#   under the interpreter (CPU tensors) only when asked for by name, so the tests run both;
# - "cublas": the plain baseline, a cuBLAS GEMM into a bounded float32 [rows, V] chunk, then the memory-bound
#   log-sum-exp/entropy kernel of rlkernels.softmax (_forward_cublas; the vocabulary-parallel path's per-slice
#   partials from the same two: _partials_cublas); the backward then recomputes each chunk's logits with cuBLAS too,
#   into a float32 tile that _dz_from_tile_kernel turns into dz (_CublasTiles: the tile shares the dz budget, so
#   its chunks are a third as wide), and rlkernels.fused_policy's kernel 1 is a cuBLAS GEMM into its tile followed
#   by the same softmax kernel. Float32 inputs run "split": with large logits or a low temperature the
#   backward's recomputed logits (_logits_tile) must be the forward's bits, and cuBLAS sums K in another order
#   (under the interpreter the cuBLAS path's float32 gradients were 10-10^4 x eager's error in
#   test_large_logits_no_worse_than_eager / test_low_temperature_no_worse_than_eager; 16-bit inputs passed them).
# Measured on an H200 (bench/results/NVIDIA_H200-2026-11-27-lease1.md; torch 2.11, triton 3.6; N=8192 H=4096 bf16,
# V=128256 / 151936; one cuBLAS GEMM 12.35 / 14.62 ms): forward alone split 29.8 / 34.2 ms, tma 14.4 / 17.4, tma 2cta
# 19.9 / 23.7, cublas 13.9 / 16.8 (and 1 GiB more memory); tma flat does not compile with triton 3.6 (see
# _TMA_TILES). The backward's dz kernel alone (V=128256, 4 chunks of 32768): _dz_kernel 48.5 ms, _dz_kernel_tma
# 16.7 ms; the backward's other phases 29.6 ms (dh and dW GEMMs 12.4 + 12.7, label rows 4.5). "tma"'s CUDA tests
# passed there, forward and backward (tests/test_fused_linear.py::test_forward_kernels_match_float64_truth,
# ::test_tma_forward_low_temperature_no_worse_than_eager: the backward recomputes the logits with the forward's K
# blocks, _bwd_tiles). So "tma" became the default on sm_90 after that run. Its fwd+bwd was not measured as such
# there: the bench's "rlkernels fwd tma" row (91.4 ms at V=128256) ran the tma forward with the default backward
# of the time, _dz_kernel; the phases above add up to a prediction of ~61 ms (the "rlkernels" row: 108.2 ms).
# Measured as the default on an H200 at commit 14fe024 (bench/results/NVIDIA_H200-2026-11-27.md, matmul ceiling
# 671 TFLOP/s): fwd+bwd 61.8 / 73.3 ms, 1.20x four GEMMs at that rate (forward 14.7 / 17.7 ms; backward phases at
# V=128256: dz 17.0, dh 12.5, dW 12.9, label rows 3.7 ms); split with _dz_kernel 105.0 / 122.4 ms. The label rows
# (each labelled row of d_weight formed again in float32 from a gathered column of dz, so as to add its residuals
# before the one rounding) are since added inside the dW GEMM (_gemm_with_label_residuals: a memset of each slice
# and cuBLAS's beta = 1). Prediction, not measured: ~0.5 ms instead of 3.7 (1 GiB memset + 1 GiB more read by the
# GEMMs' epilogue at ~4 TB/s, the [k, H] float32 sums ~0.15 ms): fwd+bwd ~58.6 ms, 1.14x four GEMMs.
# Measured on an H100 80GB HBM3 the day before (bench/results/NVIDIA_H100_80GB_HBM3-2026-11-26*.json): split 32.5 /
# 37.2 ms (an ungrouped grid then), tma 15.5 / 18.4.
# The "cublas" backward (cuBLAS logits into a float32 tile, then _dz_from_tile_kernel) is not measured yet: a
# prediction composed from that H200 run's rows at V=128256 (NVIDIA_H200-2026-11-27.md): the forward "cublas" 14.24
# ms is a float32-output GEMM plus one read of its 4.2 GB of logits (~1.05 ms at the 3.99 TB/s of the softmax rows),
# so ~13.2 ms of GEMM; the tile pass reads 4.2 GB and writes 2.1 GB (~2.1 ms at the 3.0 TB/s that
# linear_policy_loss's kernel 2, the same tile kernel, reached there: 7.5 GB in 2.5 ms): dz ~15.3 ms against
# _dz_kernel_tma's 17.4; its 12 chunks (of 10880 columns, against 4 of 32768) read and write dh's float32 [N, H]
# accumulator 8 more times (+2.1 GB, ~0.5 ms): fwd+bwd ~14.2 + 15.3 + 13.3 + 14.7 = 57.5 ms, 1.13x four GEMMs (50.9)
# against tma's 60.5 (1.19x). The extra memory stays in the contract's bound: the forward's 1 GiB chunk, the
# backward's dz plus its tile within _DZ_BUDGET_BYTES. bench_fused_linear's "rlkernels fwd cublas", "backward (all
# phases), cublas" and "dz kernel cublas" rows measure it; the default moves only on those numbers.
FWD_KERNEL_ENV = "RLKERNELS_LINEAR_FWD"
FWD_KERNELS = ("split", "tma", "cublas")
_CUBLAS_CHUNK_BYTES = 1 << 30  # the baseline's float32 [rows, V] logits chunk stays under this


def _fwd_kernel_choice(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """The forward kernel for these inputs (``hidden`` [N, H], ``weight`` [V, H], unit stride along H):
    ``$RLKERNELS_LINEAR_FWD`` if set, "tma" only where it can run (sm_90 on CUDA; the interpreter on CPU tensors,
    which is how the tests check it) and "cublas" only for 16-bit inputs, else "split". Unset: "tma" on CUDA
    tensors where it can run, else "split"."""
    name = _backend.env_choice(FWD_KERNEL_ENV, FWD_KERNELS)
    if not name:
        return "tma" if hidden.device.type == "cuda" and _tma_ok(hidden, weight) else "split"
    if name == "tma" and not _tma_ok(hidden, weight):
        return "split"
    if name == "cublas" and hidden.dtype == torch.float32:
        return "split"  # float32: the backward must recompute the forward's logits bit for bit (see the comment above)
    return name


def _tma_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides; wgmma m64n128 needs 16-bit inputs; the kernel
    is built and tuned for sm_90 only (other GPUs keep ``_fwd_kernel``)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (hidden, weight))
    if not aligned:
        return False
    return hidden.device.type == "cpu" or torch.cuda.get_device_capability(hidden.device)[0] == 9


def _persistent_launch(hidden: torch.Tensor, weight: torch.Tensor, items: int, t: _PersistentTiles):
    """``(grid, h_desc, w_desc)`` for a Hopper kernel of ``items`` work items: a persistent grid of ``ctas_per_sm``
    programs per SM (a few under the interpreter), at most one per item, and the TMA descriptors of ``hidden``
    [N, H] in ``[BLOCK_N, BLOCK_K]`` boxes and ``weight`` [V, H] in ``[BLOCK_V, BLOCK_K]`` boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if hidden.device.type == "cpu":
        programs = _INTERPRETER_PROGRAMS
    else:
        programs = torch.cuda.get_device_properties(hidden.device).multi_processor_count * t.ctas_per_sm
    h_desc = TensorDescriptor.from_tensor(hidden, [t.block_n, t.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [t.block_v, t.block_k])
    return (min(items, programs),), h_desc, w_desc


def _launch_fwd_tma(hidden, weight, labels, bias, part, temperature: float, z: torch.Tensor | None = None) -> None:
    """``_fwd_kernel_tma`` with ``_TMA_TILES`` on a persistent grid (``ctas_per_sm`` programs per SM, at most one
    per work item), writing the partials ``part`` (four contiguous ``[S, N]``: :func:`_partials_views`) as
    ``_fwd_kernel`` does, and with ``z`` (a contiguous float32 ``[N, V]``, 16-byte aligned rows:
    :func:`_tma_store_ok`) the logits / T there too.
    ``hidden`` [N, H], ``weight`` [V, H] (16-byte aligned rows), ``labels`` [N] int64, ``bias`` [V] or None."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = _TMA_TILES
    N, V = hidden.shape[0], weight.shape[0]
    items = cdiv(N, t.block_n) * cdiv(V, t.split_tiles * t.block_v)
    grid, h_desc, w_desc = _persistent_launch(hidden, weight, items, t)
    z_desc = None if z is None else TensorDescriptor.from_tensor(z, [t.block_n, t.block_v])
    _fwd_kernel_tma.launch(
        grid, h_desc, w_desc, bias if bias is not None else weight, labels, z_desc,
        part[0], part[1], part[2], part[3], N, V, hidden.shape[1], temperature,
        HAS_BIAS=bias is not None, DOT_F32=_dot_f32(hidden), BLOCK_N=t.block_n, BLOCK_V=t.block_v,
        BLOCK_K=t.block_k, SPLIT_TILES=t.split_tiles, GROUP_N=t.group_n, FLATTEN=t.flatten, STORE_Z=z is not None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )


def _partials_buffer(S: int, n_max: int, device) -> torch.Tensor:
    """A float32 buffer for the forward kernels' four partials (``m, s, u, z_y``) of ``S`` vocabulary splits over up
    to ``n_max`` tokens: four slots of ``S·n_max`` elements rounded up to 16 bytes, so that each slot starts
    16-byte aligned whatever ``S·n`` is (one specialization of the kernels' pointers: Triton would compile another
    variant for an unaligned one). Viewed per call by :func:`_partials_views`."""
    slot = cdiv(S * n_max, 4) * 4  # float32 elements: a multiple of 16 bytes
    return torch.empty(4 * slot, dtype=torch.float32, device=device)  # [4 · slot]


def _partials_views(buf: torch.Tensor, S: int, n: int) -> list[torch.Tensor]:
    """``[m, s, u, z_y]``, each a contiguous ``[S, n]`` in its slot of ``buf`` (:func:`_partials_buffer`): the
    kernels write split ``j``'s row at ``j · n``. (A ``[:, :, :n]`` view of a ``[4, S, n_max]`` buffer keeps rows
    ``n_max`` apart: read so, a chunk shorter than ``n_max`` merged other rows' partials.)"""
    slot = buf.numel() // 4
    return [buf[j * slot:j * slot + S * n].view(S, n) for j in range(4)]


def _tma_store_ok(z: torch.Tensor) -> bool:
    """A TMA store needs a 16-byte aligned base and row stride: a float32 ``[n, V]`` tile with ``V % 4 == 0``."""
    return z.data_ptr() % 16 == 0 and (z.stride(0) * z.element_size()) % 16 == 0


def _partials_triton(hidden, weight, labels, bias, opt: LinearLogprobsOptions) -> torch.Tensor:
    """``_fwd_kernel`` (or ``_fwd_kernel_tma``: :func:`_fwd_kernel_choice`) over (token blocks, vocabulary splits),
    the splits' partials merged on the host (:func:`lse_merge`): ``[4, N]`` float32 rows ``(m, s, u, z_y)`` over this
    ``weight``'s columns, as :func:`_partials_torch` returns them (``z_y`` is 0 for a negative label: no column
    matches; the callers pass no label past ``V`` -- the kernels would match it to a masked column of the last
    tile, -inf)."""
    # hidden [N, H], weight [V, H], labels [N] int64, bias [V] or None; the K loop reads unit-stride rows
    hidden, weight, labels = unit_stride(hidden), unit_stride(weight), labels.contiguous()
    bias = None if bias is None else bias.contiguous()  # [V] read at unit stride
    N, H = hidden.shape
    V = weight.shape[0]
    choice = _fwd_kernel_choice(hidden, weight)
    if choice == "cublas":  # the backward recomputes these logits with cuBLAS (_bwd_tiles): so does the forward
        return _partials_cublas(hidden, weight, labels, bias, opt)
    tma = choice == "tma"
    t = _TMA_TILES if tma else _tiles(hidden.dtype, hopper=_hopper(hidden))
    split_cols = t.split_tiles * t.block_v
    S = cdiv(V, split_cols)
    part = _partials_views(_partials_buffer(S, N, hidden.device), S, N)  # m, s, u, zy per split: [S, N] each
    if N > 0 and tma:
        _launch_fwd_tma(hidden, weight, labels, bias, part, opt.temperature)
    elif N > 0:
        grid = (cdiv(N, t.block_n) * S,)  # (token block, split) items, grouped in the kernel
        _fwd_kernel.launch(
            grid, hidden, weight, bias if bias is not None else weight, labels, part[0],  # z_ptr, unused here
            part[0], part[1], part[2], part[3],
            N, V, H, hidden.stride(0), weight.stride(0), opt.temperature,
            **_kernel_flags(hidden.dtype, bias is not None, _dot_f32(hidden), t), SPLIT_TILES=t.split_tiles,
            STORE_Z=False, num_warps=t.num_warps, num_stages=t.num_stages,
        )
    m, s, u, zy = part  # each [S, N]
    m_all, s_all, u_all = lse_merge(m, s, u)  # [N] each
    return torch.stack((m_all, s_all, u_all, zy.sum(0)))  # [4, N]


def _cublas_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden @ weight.T + bias`` (``hidden`` [n, H], ``weight`` [vc, H] 16-bit, ``bias`` [vc] or None) by cuBLAS
    into float32 [n, vc] (``out``, contiguous, when given): the logits of the "cublas" kernels, not yet divided by
    T."""
    if out is None:
        z = _mm_f32(hidden, weight.T)  # [n, vc] float32
    elif out.device.type == "cuda" and _HAS_MM_OUT_DTYPE:
        z = torch.mm(hidden, weight.T, out_dtype=torch.float32, out=out)
    else:
        z = out.zero_()
        _addmm_f32(z, hidden, weight.T)
    if bias is not None:
        z += bias.float()
    return z


def _cublas_rows(N: int, V: int) -> int:
    """Rows of the "cublas" forward's float32 ``[rows, V]`` logits chunk: within ``_CUBLAS_CHUNK_BYTES``."""
    return max(1, min(N, _CUBLAS_CHUNK_BYTES // (4 * max(V, 1))))


def _partials_cublas(hidden, weight, labels, bias, opt: LinearLogprobsOptions) -> torch.Tensor:
    """:func:`_partials_triton`'s ``[4, N]`` rows ``(m, s, u, z_y)`` (of logits / T over this ``weight``'s columns)
    from the "cublas" kernels: per chunk of rows, :func:`_cublas_logits`, then rlkernels.softmax's forward kernel
    (max, Σ exp, entropy; ``u`` = s·(log s - entropy)) and ``z_y`` gathered from the tile (0 where the label is not
    a column). The vocabulary-parallel forward runs it under ``RLKERNELS_LINEAR_FWD=cublas``, so that its backward,
    which recomputes the logits with cuBLAS (:func:`_bwd_tiles`), sees the same ones."""
    from rlkernels import softmax

    N, V = hidden.shape[0], weight.shape[0]
    part = torch.zeros(4, N, dtype=torch.float32, device=hidden.device)  # [4, N]
    in_range = (labels >= 0) & (labels < V)  # [N] the label is a column here
    sm_opt = softmax.LogprobsOptions(temperature=opt.temperature, return_entropy=True, ignore_index=-1)
    rows = _cublas_rows(N, V)
    for r0 in range(0, N if V else 0, rows):
        r1 = min(N, r0 + rows)
        z = _cublas_logits(hidden[r0:r1], weight, bias)  # [n, V] float32
        col = torch.where(in_range[r0:r1], labels[r0:r1], torch.zeros_like(labels[r0:r1]))  # [n] a valid column
        _, ent, st = softmax._triton_forward(z, col, sm_opt)  # [n], [n], [n, 2] = (max z, Σ exp((z - max) / T))
        s = st[:, 1]  # [n]
        part[0, r0:r1] = st[:, 0] / opt.temperature  # the max of z / T (division by T > 0 keeps the max)
        part[1, r0:r1] = s
        part[2, r0:r1] = s * (torch.log(s) - ent)  # Σ exp(z/T - m)(z/T - m), from H = log s - u / s
        zy = z.gather(1, col[:, None]).squeeze(1) / opt.temperature  # [n]
        part[3, r0:r1] = torch.where(in_range[r0:r1], zy, torch.zeros_like(zy))
        del z
    return part


def _forward_cublas(hidden, weight, labels, bias, opt: LinearLogprobsOptions):
    """The plain baseline: per chunk of rows, ``hidden @ weight.T`` (+ bias) by cuBLAS into a float32 ``[rows, V]``
    chunk (at most ``_CUBLAS_CHUNK_BYTES``), then rlkernels.softmax's memory-bound forward kernel (one read of the
    chunk: online max, Σ exp, entropy, the label's log p). Returns ``(logp [N], entropy [N], stats [2, N])`` as
    :func:`_forward_triton` does: stats = (row max of ``z / T``, ``log Σ exp(z / T - max)``)."""
    from rlkernels import softmax

    # hidden [N, H], weight [V, H], labels [N] int64, bias [V] or None
    N, V = hidden.shape[0], weight.shape[0]
    rows = _cublas_rows(N, V)
    sm_opt = softmax.LogprobsOptions(temperature=opt.temperature, return_entropy=True, ignore_index=opt.ignore_index)
    logp = torch.empty(N, dtype=torch.float32, device=hidden.device)  # [N]
    entropy = torch.empty_like(logp)  # [N]
    stats = torch.empty(2, N, dtype=torch.float32, device=hidden.device)  # [2, N]
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        z = _cublas_logits(hidden[r0:r1], weight, bias)  # [n, V] float32, unscaled
        lp, ent, st = softmax._triton_forward(z, labels[r0:r1], sm_opt)  # [n], [n], [n, 2] = (max z, Σ exp((z-max)/T))
        logp[r0:r1], entropy[r0:r1] = lp, ent
        stats[0, r0:r1] = st[:, 0] / opt.temperature  # max of z / T (division by T > 0 keeps the max)
        stats[1, r0:r1] = torch.log(st[:, 1])
        del z
    if not opt.return_entropy:
        entropy.zero_()
    return _finish(logp, entropy, stats, labels, V, opt)


def _forward_triton(hidden, weight, labels, bias, opt: LinearLogprobsOptions):
    """:func:`_partials_triton`, then :func:`_from_partials` (or the plain baseline :func:`_forward_cublas` when
    chosen). Returns ``(logp [N], entropy [N], stats [2, N])`` as :func:`_forward_torch` does (float32)."""
    if _fwd_kernel_choice(hidden, weight) == "cublas":
        return _forward_cublas(unit_stride(hidden), unit_stride(weight), labels.contiguous(), bias, opt)
    part = _partials_triton(hidden, weight, labels, bias, opt)  # [4, N]
    return _from_partials(part, labels, weight.shape[0], opt)


def _from_partials(part: torch.Tensor, labels: torch.Tensor, V: int, opt: LinearLogprobsOptions):
    """The outputs from a row's merged partials ``part`` [4, N] = ``(m, s, u, z_y)`` (row max, ``Σ exp(z - m)``,
    ``Σ exp(z - m)(z - m)``, the label's logit): ``(logp [N], entropy [N], stats [2, N])`` through :func:`_finish`.
    Every backend ends here, and so does the vocabulary-parallel path once the ranks' partials are merged."""
    m_all, s_all, u_all, zy = part.unbind(0)  # [N] each
    log_s = torch.log(s_all)  # [N]
    # without return_entropy the entropy is zeros, as the torch backend returns it: outputs never depend on the backend
    entropy = log_s - u_all / s_all if opt.return_entropy else torch.zeros_like(log_s)  # [N]
    logp = label_logp(zy, m_all, s_all)  # [N] as an accurate log_softmax forms it (never z - one rounded lse)
    return _finish(logp, entropy, torch.stack((m_all, log_s)), labels, V, opt)


def _finish(logp, entropy, stats, labels, V, opt: LinearLogprobsOptions):
    """What every backend returns: 0 in both outputs at ignored tokens, NaN log p for a label out of ``[0, V)``
    (reachable on a GPU only: the CPU raises). ``logp``, ``entropy``, ``labels`` (int64) [N]; ``stats`` [2, N]:
    row max, log Σ exp(z - max)."""
    valid = labels != opt.ignore_index
    in_range = (labels >= 0) & (labels < V)
    logp = torch.where(in_range, logp, torch.full_like(logp, float("nan")))  # GPU: a bad label is NaN
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero), stats


def _vocab_outer(N: int, V: int) -> bool:
    """The Triton backward's loop order: vocabulary outer when there are fewer tokens than vocabulary entries (its
    float32 accumulator is then ``d_hidden``'s ``[N, H]``, the smaller one), tokens outer otherwise (``d_weight``'s
    ``[V, H]``). The torch backend picks the same way."""
    return N < V


def _dz_launcher(g_logp, g_ent, hidden, weight, labels, bias, stats, entropy, opt: LinearLogprobsOptions, t: _Tiles):
    """``dz_into(dz, resid, r0, r1, v0, v1)``: ``_dz_kernel`` (``_dz_kernel_tma`` when ``t`` is a
    ``_PersistentTiles``: :func:`_bwd_tiles`) over the tokens ``r0..r1`` against the vocabulary ``v0..v1`` (the
    backward's first phase; bench_fused_linear times it alone). ``hidden`` [N, H] and ``weight``
    [V, H] at unit stride along H, ``labels`` [N] contiguous, ``bias`` [V] contiguous or None, ``stats`` [2, N],
    ``entropy``, ``g_logp``, ``g_ent`` [N]."""
    flags = _kernel_flags(hidden.dtype, bias is not None, _dot_f32(hidden), t)
    g_logp = g_logp.float().contiguous()  # [N]
    g_ent = g_ent.float().contiguous()  # [N]
    # [N] each, each in an allocation of its own: stats' second row starts N·4 bytes in, 16-byte aligned or not
    # with N, and every change of that class would be another compiled variant of the dz kernels
    row_max, log_s = (row.clone() for row in stats.float().unbind(0))
    b = bias if bias is not None else weight  # [V] or an unread stand-in

    def dz_into(dz, resid, r0, r1, v0, v1):
        # dz [r1 - r0, v1 - v0] contiguous in the input dtype <- the tokens r0..r1 against the vocabulary v0..v1;
        # resid [r1 - r0] float32 <- the label residual, at the rows whose label is one of these columns
        if r1 == r0:
            return
        if isinstance(t, _CublasTiles):  # after the cuBLAS forward: the logits by cuBLAS again, then dz from them
            z = _cublas_logits(hidden[r0:r1], weight[v0:v1], None if bias is None else bias[v0:v1])  # [n, vc]
            launch_dz_from_tile(z, labels[r0:r1], row_max[r0:r1], log_s[r0:r1], entropy[r0:r1], g_logp[r0:r1],
                                g_ent[r0:r1], dz, resid, opt.temperature, opt.ignore_index, col0=v0, raw=True)
            return
        items = cdiv(r1 - r0, t.block_n) * cdiv(v1 - v0, t.block_v)  # (token block, vocabulary tile) items
        if isinstance(t, _PersistentTiles):  # after the Hopper forward (_bwd_tiles)
            _launch_dz_tma(hidden[r0:r1], weight[v0:v1], b[v0:v1], labels[r0:r1], row_max[r0:r1], log_s[r0:r1],
                           entropy[r0:r1], g_logp[r0:r1], g_ent[r0:r1], dz, resid, v0, items, bias is not None,
                           opt, t)
            return
        _dz_kernel.launch(
            (items,), hidden[r0:r1], weight[v0:v1], b[v0:v1], labels[r0:r1],
            row_max[r0:r1], log_s[r0:r1], entropy[r0:r1], g_logp[r0:r1], g_ent[r0:r1], dz, resid,
            r1 - r0, v1 - v0, hidden.shape[1], hidden.stride(0), weight.stride(0), opt.temperature, opt.ignore_index,
            v0, **flags, num_warps=t.num_warps, num_stages=t.num_stages,
        )

    return dz_into


def launch_dz_from_tile(z, labels, row_max, log_s, entropy, g_logp, g_ent, dz, resid, temperature: float,
                        ignore_index: int, col0: int, raw: bool) -> None:
    """``_dz_from_tile_kernel`` over a stored ``[n, vc]`` float32 tile ``z`` (contiguous; ``raw``: the logits
    themselves, else logits / T), the columns ``col0..col0 + vc`` of the vocabulary: writes ``dz`` ([n, vc] rows at
    unit stride, rows ``vc`` apart) and, where a row's label is one of these columns, its residual in ``resid``
    [n]. ``labels``, ``row_max`` and ``log_s`` (the forward's, of logits / T), ``entropy``, ``g_logp`` and ``g_ent``
    (the upstream gradients) are [n]."""
    n, vc = z.shape
    if n == 0:
        return
    f32 = lambda x: x.float().contiguous()  # noqa: E731  [n]
    t = _TILE_DZ
    _dz_from_tile_kernel.launch(
        (cdiv(n, t.block_n), cdiv(vc, t.block_v)), z, labels, f32(row_max), f32(log_s), f32(entropy),
        f32(g_logp), f32(g_ent), dz, resid, n, vc, temperature, ignore_index, col0, RAW=raw,
        BLOCK_N=t.block_n, BLOCK_V=t.block_v, num_warps=t.num_warps, num_stages=1)


def _launch_dz_tma(h, w, b, labels, row_max, log_s, entropy, g_logp, g_ent, dz, resid, col0: int, items: int,
                   has_bias: bool, opt: LinearLogprobsOptions, t: _PersistentTiles) -> None:
    """``_dz_kernel_tma`` over one chunk: ``h`` [n, H] and ``w`` [vc, H] (16-byte aligned rows: the Hopper forward
    ran on them), ``b`` [vc] (or an unread stand-in), ``labels`` and the per-row inputs [n], ``dz`` [n, vc] and
    ``resid`` [n] written; a persistent grid of ``ctas_per_sm`` programs per SM (the interpreter: a few), at most one
    per item."""
    grid, h_desc, w_desc = _persistent_launch(h, w, items, t)
    _dz_kernel_tma.launch(
        grid, h_desc, w_desc, b, labels, row_max, log_s, entropy, g_logp, g_ent, dz, resid,
        h.shape[0], w.shape[0], h.shape[1], opt.temperature, opt.ignore_index, col0,
        HAS_BIAS=has_bias, DOT_F32=_dot_f32(h), BLOCK_N=t.block_n, BLOCK_V=t.block_v, BLOCK_K=t.block_k,
        GROUP_N=t.group_n, num_warps=t.num_warps, num_stages=t.num_stages,
    )


def _backward_triton(g_logp, g_ent, hidden, weight, labels, bias, stats, entropy, logp,
                     opt: LinearLogprobsBackwardOptions):
    """``_dz_kernel`` writes ``dz`` (the input dtype) of a block of tokens x vocabulary entries and its label
    residuals; cuBLAS does the two GEMMs, in the order :func:`_vocab_outer` picks (:func:`_bwd_vocab_outer`,
    :func:`_bwd_tokens_outer`). Returns ``(d_hidden [N, H], d_weight [V, H], d_bias [V] or None)`` in the inputs'
    dtypes."""
    # g_logp, g_ent, labels, entropy: [N]; stats [2, N] (row max, log-sum); hidden [N, H]; weight [V, H]; bias [V] or None
    del logp  # the kernel forms log p at the label from the recomputed logits tile itself
    hidden, weight, labels = unit_stride(hidden), unit_stride(weight), labels.contiguous()
    bias = None if bias is None else bias.contiguous()  # [V] read at unit stride
    N, V = hidden.shape[0], weight.shape[0]
    t = _bwd_tiles(hidden, weight)
    dz_into = _dz_launcher(g_logp, g_ent, hidden, weight, labels, bias, stats, entropy, opt, t)
    valid = (labels != opt.ignore_index) & (labels >= 0) & (labels < V)  # [N] the label is a column of weight
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [N]
    order = _bwd_vocab_outer if _vocab_outer(N, V) else _bwd_tokens_outer
    d_hidden, d_weight, d_bias32 = order(dz_into, hidden, weight, bias is not None, valid, safe, t, opt.grad_weight,
                                         opt.grad_input)
    return d_hidden, d_weight, None if bias is None else d_bias32.to(bias.dtype)


def _vocab_chunk(N: int, V: int, dtype: torch.dtype, t: _Tiles) -> int:
    """The vocabulary-outer backward's chunk width: its ``[N, vc]`` dz within ``_DZ_BUDGET_BYTES``, ending on the dz
    kernel's tiles."""
    col_bytes = max(1, N * _dz_bytes_per_element(dtype, t))
    return min(V, max(t.block_v, _DZ_BUDGET_BYTES // col_bytes // t.block_v * t.block_v))


def _bwd_vocab_outer(dz_into, hidden, weight, has_bias, valid, safe, t: _Tiles, grad_weight: bool = True,
                     grad_input: bool = True):
    """Vocabulary outer (N < V): per chunk ``j`` of the vocabulary, ``dz`` of all the tokens against it
    (``[N, vc]``), then ``dh += dz @ W_j`` into a float32 ``[N, H]`` accumulator and ``d_weight[j] = dz.T @ hidden``
    written by the GEMM itself in the weight's dtype (float32 accumulation inside it, one rounding), 16-bit ones
    with the label residuals added inside that GEMM (:func:`_gemm_with_label_residuals`, planned for every chunk at
    once by :func:`_label_runs`: no host read inside the loop). No weight-sized float32
    buffer and no float32 slice of one: beyond the outputs, ``[N, H]`` float32 and the ``dz`` chunk, sized to
    ``_DZ_BUDGET_BYTES``. Returns ``(d_hidden, d_weight, d_bias32 float32 or None)``; without ``grad_weight`` (a
    frozen head) no ``d_weight`` GEMM, and ``d_weight`` is None; without ``grad_input`` no ``d_hidden`` GEMM and
    no ``[N, H]`` buffer, and ``d_hidden`` is None."""
    # hidden [N, H], weight [V, H] (unit stride in H); valid, safe [N]
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    low = hidden.dtype != torch.float32  # 16-bit dz: the label entries' rounding is carried in float32
    vc = _vocab_chunk(N, V, hidden.dtype, t)
    S = cdiv(V, vc)
    dz_buf = torch.empty(N * vc, dtype=hidden.dtype, device=dev)  # one [N, vc] chunk, reused
    resid = torch.zeros(N, dtype=torch.float32, device=dev)  # [N] written by the chunk holding the token's label
    dh = torch.zeros(N, H, dtype=torch.float32, device=dev) if grad_input else None  # [N, H] (float32: d_hidden)
    d_weight = torch.empty(V, H, dtype=weight.dtype, device=dev) if grad_weight else None  # [V, H]
    d_bias32 = torch.zeros(V, dtype=torch.float32, device=dev) if has_bias else None  # [V]
    # the valid tokens grouped by the chunk holding their label, with its column there (the values are unused);
    # 16-bit: per chunk, those tokens' runs of equal labels (the label rows' sums, planned here once)
    runs = None
    if low:
        tok = valid.nonzero().squeeze(1)  # [k] the tokens with a label
        y = safe[tok]  # [k]
        runs = _label_runs(torch.div(y, vc, rounding_mode="floor"), y, tok, S, V)
    for j in range(S):
        v0, v1 = j * vc, min(V, (j + 1) * vc)
        dz = dz_buf[: N * (v1 - v0)].view(N, v1 - v0)  # [N, vc]
        dz_into(dz, resid, 0, N, v0, v1)
        w_j = weight[v0:v1]  # [vc, H]
        # d_weight's slice straight from the GEMM: float32 accumulation inside it (cuBLAS's compute type for 16-bit
        # GEMMs, its split-K partial sums too: _float32_reductions), rounded once to its dtype; 16-bit: with the
        # label residuals added inside the same GEMM
        if d_weight is not None and low and runs[j][1].numel():  # labels in this chunk (a size known on the host)
            _gemm_with_label_residuals(d_weight, v0, v1, dz, hidden, runs[j], resid[runs[j][0]])
        elif d_weight is not None:
            with _float32_reductions(dz.device):
                torch.mm(dz.T, hidden, out=d_weight[v0:v1])
        if dh is not None and low:
            _addmm_f32(dh, dz, w_j)
        elif dh is not None:
            dh.addmm_(dz, w_j)
        if d_bias32 is not None:
            d_bias32[v0:v1] += dz.sum(0, dtype=torch.float32)
            if low:  # the label residuals summed per label in token order (no host read)
                _add_run(d_bias32, runs[j], resid[runs[j][0]])
    if not low or dh is None:
        return dh, d_weight, d_bias32
    r = torch.where(valid, resid, torch.zeros_like(resid))  # [N]
    dh += r[:, None] * weight[safe].float()
    return dh.to(hidden.dtype), d_weight, d_bias32


def _bwd_tokens_outer(dz_into, hidden, weight, has_bias, valid, safe, t: _Tiles, grad_weight: bool = True,
                      grad_input: bool = True):
    """Tokens outer (N >= V): per chunk of tokens (``[chunk, V]`` of ``dz``, sized to ``_DZ_BUDGET_BYTES``),
    ``d_hidden[chunk] = dz @ W`` (the whole vocabulary in one GEMM) and ``d_weight += dz.T @ hidden[chunk]`` into a
    float32 ``[V, H]`` accumulator, here no larger than the tokens' ``[N, H]``, cast once at the end. Returns
    ``(d_hidden, d_weight, d_bias32 float32 or None)``; without ``grad_weight`` (a frozen head) no ``d_weight``
    GEMM, and ``d_weight`` is None; without ``grad_input`` no ``d_hidden`` GEMM, and ``d_hidden`` is None."""
    # hidden [N, H], weight [V, H] (unit stride in H); valid, safe [N]
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    low = hidden.dtype != torch.float32  # 16-bit dz workspace: carry the label residual in float32
    chunk = max(t.block_n, (_DZ_BUDGET_BYTES // (V * _dz_bytes_per_element(hidden.dtype, t))) // t.block_n * t.block_n)
    chunk = min(chunk, max(N, 1))
    d_hidden = torch.empty(N, H, dtype=hidden.dtype, device=dev) if grad_input else None  # [N, H]
    d_weight32 = None  # [V, H] float32 accumulator, cast once at the end
    d_bias32 = torch.zeros(V, dtype=torch.float32, device=dev) if has_bias else None  # [V]
    dz = torch.empty(chunk, V, dtype=hidden.dtype, device=dev)  # [chunk, V] workspace
    resid = torch.zeros(chunk, dtype=torch.float32, device=dev)  # [chunk]
    runs = None
    if low:  # per chunk of tokens, its runs of equal labels, planned once (no host read inside the loop)
        tok = valid.nonzero().squeeze(1)  # [k]
        runs = _label_runs(torch.div(tok, chunk, rounding_mode="floor"), safe[tok], tok, cdiv(N, chunk), V)
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        n = c1 - c0
        h_c = hidden[c0:c1]  # [n, H]
        dz_c = dz[:n]  # [n, V]
        r_c = resid[:n]  # [n]
        r_c.zero_()
        dz_into(dz_c, r_c, c0, c1, 0, V)
        y_c = safe[c0:c1]  # [n]
        if not low:
            if d_hidden is not None:
                torch.mm(dz_c, weight, out=d_hidden[c0:c1])  # the whole V reduction in one float32 GEMM
            if grad_weight and d_weight32 is None:
                d_weight32 = dz_c.T @ h_c  # [V, H]; float32 inputs: this is the accumulator
            elif grad_weight:
                d_weight32.addmm_(dz_c.T, h_c)
        else:
            r_c = torch.where(valid[c0:c1], r_c, torch.zeros_like(r_c))  # [n]
            if d_hidden is not None:
                dh = _mm_f32(dz_c, weight)  # [n, H] float32
                dh += r_c[:, None] * weight[y_c].float()
                d_hidden[c0:c1] = dh
                del dh
            if grad_weight:
                if d_weight32 is None:
                    d_weight32 = _mm_f32(dz_c.T, h_c)  # [V, H] float32
                else:
                    _addmm_f32(d_weight32, dz_c.T, h_c)
                t_c = runs[c0 // chunk][0] - c0  # [k] the chunk's tokens with a label, by label, as rows of it
                _add_run(d_weight32, runs[c0 // chunk], r_c[t_c, None] * h_c[t_c].float())
        if d_bias32 is not None:
            d_bias32 += dz_c.sum(0, dtype=torch.float32)
            if low:
                _add_run(d_bias32, runs[c0 // chunk], r_c[runs[c0 // chunk][0] - c0])
    if not grad_weight:
        return d_hidden, None, d_bias32
    if d_weight32 is None:  # N == 0
        d_weight32 = torch.zeros(V, H, dtype=torch.float32, device=dev)
    d_weight = d_weight32 if weight.dtype == torch.float32 else d_weight32.to(weight.dtype)
    return d_hidden, d_weight, d_bias32


def _label_runs(group: torch.Tensor, labels: torch.Tensor, tok: torch.Tensor, n_groups: int, V: int) -> list[tuple]:
    """Per-label sums planned for every group of tokens at once (a backward's chunks): per group ``g``, ``(its
    tokens [k_g] sorted by label -- token order within a label --, its distinct labels [u_g] ascending, tokens per
    label [u_g])``: the tokens sorted by label (stable), so each label's run is summed in token order, the same
    sums whatever the GPU's scheduling (``index_add_`` adds with atomics). Two host reads in all, where group by
    group took one per group: each waits for the device to finish everything queued (the chunk's kernels and
    GEMMs), and the next chunk's work is queued only after it. ``tok``
    [k] the tokens, ``group`` [k] each one's group in ``[0, n_groups)``, ``labels`` [k] each one's label in
    ``[0, V)``."""
    key = group * V + labels  # [k]: group-major, then label
    order = torch.argsort(key, stable=True)  # [k]
    tok, key = tok[order], key[order]
    uniq, counts = torch.unique_consecutive(key, return_counts=True)  # [u] (a host read: its size)
    sizes = torch.stack((torch.bincount(group, minlength=n_groups),  # tokens per group
                         torch.bincount(torch.div(uniq, V, rounding_mode="floor"), minlength=n_groups))).tolist()
    runs, k0, u0 = [], 0, 0
    for g, (k, u) in enumerate(zip(*sizes)):
        runs.append((tok[k0:k0 + k], uniq[u0:u0 + u] - g * V, counts[u0:u0 + u]))
        k0, u0 = k0 + k, u0 + u
    return runs


def _add_run(acc: torch.Tensor, run: tuple, rows: torch.Tensor) -> None:
    """``acc[label] += rows[i]`` for the tokens of one group's ``run`` (:func:`_label_runs`), ``rows``
    [k, ...] float32 in the run's token order, each label's rows summed in token order first (one write per
    label, deterministic, no host read). ``acc`` [labels, ...] float32 (or a zeroed 16-bit block: each sum rounded
    once)."""
    _, uniq, counts = run
    if uniq.numel():
        acc[uniq] += torch.segment_reduce(rows, "sum", lengths=counts, axis=0, unsafe=True)


_REDUCTION_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def _float32_reductions(device: torch.device):
    """cuBLAS's 16-bit-output GEMMs inside keep every partial sum in float32. torch lets cuBLAS (by default) reduce
    split-K partials in the output's 16-bit type -- a scheme its heuristics pick where the output has few tiles for
    the SMs (a ``[V, H]`` gradient at a small H, say) -- and then also add ``beta · C`` in 16 bits: the H200 run of
    2026-11-27 measured a ``d_weight`` of 8304 x 16 with the label residuals inside its GEMM at 1.7x eager's
    error, where one rounding is eager's. The flags are restored on exit (torch's split-K setting too, where it
    has one); a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    saved = [(name, getattr(m, name), getattr(m, name + "_split_k", None)) for name in _REDUCTION_FLAGS]
    try:
        for name, _, _ in saved:
            setattr(m, name, False)
        yield
    finally:
        for name, allow, split_k in saved:
            setattr(m, name, allow if split_k is None else (allow, split_k))  # torch >= 2.10: (allow, split-K)


def _gemm_with_label_residuals(d_weight: torch.Tensor, v0: int, v1: int, dz: torch.Tensor, hidden: torch.Tensor,
                               run: tuple, resid: torch.Tensor) -> None:
    """``d_weight[v0:v1] = dz.T @ hidden`` plus the label residuals, rounded once. A 16-bit ``dz`` [n, v1 - v0]
    holds each token's label entry rounded; what the rounding lost, ``resid`` [k] float32 for the tokens of ``run``
    (:func:`_label_runs`: tokens by label [k], rows of ``hidden`` [n, H]; their labels in ``[v0, v1)`` [u]; counts
    [u]), times the token's hidden row, belongs to the row of ``d_weight`` [V, H] that its label points at. The
    slice is zeroed, each labelled row set to those products summed in token order, then the GEMM adds ``dz.T @
    hidden`` to it with beta = 1: cuBLAS (and the CPU's GEMM) take that operand into the float32 accumulation and
    round once, so a labelled row is its float32 dot products plus its residuals, rounded once -- never twice. The
    sums enter rounded to 16 bits, but they are rounding losses (within 2^-9 of the label entries), so that costs
    ~2^-18 of the row. Beyond the GEMM: a memset of the slice and the per-label sums ([k, H] float32); no host
    read. cuBLAS's 16-bit split-K reductions are off for it (:func:`_float32_reductions`): one rounding."""
    dw = d_weight[v0:v1]  # [vc, H]
    dw.zero_()
    _add_run(d_weight, run, resid[:, None] * hidden[run[0]].float())  # [k, H] summed per label
    with _float32_reductions(dw.device):
        dw.addmm_(dz.T, hidden)


# torch builds with cuBLAS's "16-bit inputs, float32 output" matmul (aten::mm.dtype, torch >= 2.8)
_HAS_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()


# Elements of the two operand pieces widened to float32 at a time where the GEMM cannot take 16-bit inputs with a
# float32 result (the CPU, under the interpreter; torch < 2.8): 1 MiB, so the fallback holds no float32 copy of a
# whole operand (a [vc, H] slice of the weight, say) that the GPU path does not hold either
_WIDEN_ELEMS = 1 << 18


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit inputs (``a`` [M, K], ``b`` [K, N]) as a float32 ``[M, N]`` result (float32 accumulation,
    no 16-bit rounding)."""
    if a.device.type == "cuda" and _HAS_MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)  # tensor cores, float32 result
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)  # [M, N]
    _addmm_f32(out, a, b)
    return out


def _addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 [M, N] and ``a`` [M, K], ``b`` [K, N] 16-bit, accumulating in float32.
    Without a float32-output GEMM: K in blocks, each block of ``a`` and ``b`` widened exactly (``_WIDEN_ELEMS``)."""
    if acc.device.type == "cuda" and _HAS_MM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return
    kb = max(1, _WIDEN_ELEMS // max(1, a.shape[0] + b.shape[1]))  # [M, kb] and [kb, N] pieces
    for k0 in range(0, a.shape[1], kb):
        acc.addmm_(a[:, k0:k0 + kb].float(), b[k0:k0 + kb].float())


# ---- chunked PyTorch
#
# On a CPU the GEMMs are cheap next to the elementwise passes over each [rows, vchunk]
# tile when H is small, so the tile is sized to stay in a core's L2 cache across those
# passes (about 2 MiB of float32), every temporary is written into a buffer allocated once
# per call (``out=`` / in place: no fresh pages to fault in per tile), and the passes are
# the fewest the math needs: forward, GEMM -> max -> subtract -> exp -> sum (-> dot for the
# entropy); backward, the same GEMM -> subtract the row max -> exp -> (entropy terms) -> scale.
# The backward's GEMM is the forward's call on the same tile (same shapes, same scaling), so
# it reproduces the forward's logits bit for bit; it then forms p from the row max and the
# shifted sum s kept apart (p = exp(z - max) / s, as log_softmax does), never from one
# rounded lse = max + log s, whose ulp at logits ~1000 (6e-5) would move every p by as much.

# exp(x) is exactly 0 below this in float32 (x < -104) and float64 (x < -746): clamping z - max
# there changes no p, and keeps p·(a + c·(z - max)) at 0 where a logit is -inf (never 0·inf).
_EXP_ZERO_BELOW = -1000.0


def _torch_chunks(N: int, V: int) -> tuple[int, int]:
    """``(rows, vchunk)``: a tile of about ``_TORCH_BUDGET_ELEMS`` elements, at most
    ``_TORCH_VCHUNK`` vocabulary columns wide; a small vocabulary takes more rows instead."""
    vchunk = min(V, max(256, min(_TORCH_VCHUNK, _TORCH_BUDGET_ELEMS // 16)))
    rows = min(max(N, 1), max(16, _TORCH_BUDGET_ELEMS // vchunk))
    return rows, vchunk


def _logits_into(z, h_c, w_c, b_c, temperature: float):
    # z [n, vc] <- (h_c @ w_c.T + b_c) / temperature: the GEMM with the bias added inside it, then one division
    # (none at temperature 1), as eager divides; h_c [n, H], w_c [vc, H], b_c [vc] (the raw bias) or None. Forward
    # and backward both call this, identically. Not one GEMM scaled by alpha = 1/T (and a bias scaled by it): on
    # the CPU its gradients ranged from 0.4x to 1.8x eager's error over temperatures 0.7 and 1.3 and five inputs
    # (0.92e-6 against 0.50e-6 in d_hidden on python -m bench.k3_accuracy's, k3 off); this way 0.9x to 1.14x
    if b_c is None:
        torch.addmm(z, h_c, w_c.T, beta=0, out=z)  # beta=0: z's old contents are ignored
    else:
        torch.addmm(b_c, h_c, w_c.T, out=z)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _partials_torch(hidden, weight, labels, bias, opt: LinearLogprobsOptions) -> torch.Tensor:
    """Tiled over tokens and vocabulary; per tile: GEMM, max, subtract, exp, sum (and Σ e·d for the entropy), the
    vocabulary chunks' partials merged by :func:`lse_merge`. The tiles are shared out to single-threaded workers
    (:mod:`rlkernels._cpu_workers`) as they come free: each tile's partials have their own slot, so the result does
    not depend on which worker took it. Returns ``[4, N]`` rows ``(m, s, u, z_y)`` in the compute dtype: row max,
    ``Σ exp(z - m)``, ``Σ exp(z - m)(z - m)`` (zeros without ``opt.return_entropy``: not computed) and the label's
    logit (0 for a label outside ``[0, V)``)."""
    # hidden [N, H], weight [V, H], labels [N] int64, bias [V] or None
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    cdt = reference.compute_dtype(hidden)
    lowest = torch.finfo(cdt).min
    b = bias.to(cdt) if bias is not None else None  # [V]
    rows, vchunk = _torch_chunks(N, V)
    S = cdiv(V, vchunk)
    h = hidden.to(cdt)  # [N, H] (a view for float32)
    in_range = (labels >= 0) & (labels < V)  # [N]
    safe = torch.where(in_range, labels, torch.zeros_like(labels))  # [N]
    chunk_of_y = torch.div(safe, vchunk, rounding_mode="floor")  # [N] the label's vocabulary chunk
    col = (safe - chunk_of_y * vchunk)[:, None]  # [N, 1] its column within that chunk
    out = torch.zeros(4, N, dtype=cdt, device=dev)  # [4, N] m, s, u, z_y
    # the partials of a group of rows: per vocabulary chunk max, Σ e, Σ e·d, z at the label's column
    group = min(max(N, 1), max(rows, _TORCH_PARTIAL_ELEMS // (4 * S) // rows * rows))
    part = torch.zeros(4, S, group, dtype=cdt, device=dev)  # [4, S, group]
    for g0 in range(0, N, group):
        g1 = min(N, g0 + group)
        starts = range(g0, g1, rows)
        tiles = itertools.count()  # tile t: vocabulary chunk t // len(starts), rows starts[t % len(starts)]

        def work(_worker):
            zbuf = torch.empty(rows * vchunk, dtype=cdt, device=dev)  # this worker's tile, reused
            ebuf = torch.empty(rows * vchunk, dtype=cdt, device=dev) if opt.return_entropy else None
            j_held, w_j = -1, None
            while (t := next(tiles)) < S * len(starts):
                j, k = divmod(t, len(starts))
                r0 = starts[k]
                r1 = min(g1, r0 + rows)
                v0, v1 = j * vchunk, min(V, (j + 1) * vchunk)
                if j != j_held:  # a 16-bit weight is widened one chunk at a time; float32: a view
                    j_held, w_j = j, weight[v0:v1].to(cdt)  # [vc, H]
                p_m, p_s, p_u, p_z = (x[j, r0 - g0:r1 - g0] for x in part.unbind(0))  # [n] each
                z = _logits_into(zbuf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0), h[r0:r1], w_j,
                                 None if b is None else b[v0:v1], opt.temperature)  # [n, vc]
                torch.gather(z, 1, col[r0:r1].clamp(max=v1 - v0 - 1), out=p_z.unsqueeze(1))  # used where j holds y
                torch.amax(z, 1, out=p_m)
                # a chunk whose logits are all -inf (a masked block of the vocabulary) gets a finite
                # max, so that z - max is -inf (p = 0) rather than -inf - -inf = NaN; NaN stays NaN
                torch.clamp(p_m, min=lowest, out=p_m)
                z.sub_(p_m.unsqueeze(1))  # d = z - max
                if opt.return_entropy:
                    e = torch.exp(z, out=ebuf[: z.numel()].view_as(z))  # [n, vc]
                    torch.sum(e, 1, out=p_s)
                    # Σ e·d (in place: vecdot would allocate the product). e·d is NaN only where
                    # d = -inf (e = 0: p log p counts 0 there); a NaN logit already makes the row's
                    # max and Σ e NaN, so skipping NaN here hides nothing
                    torch.nansum(e.mul_(z), 1, out=p_u)
                else:
                    torch.sum(z.exp_(), 1, out=p_s)

        _cpu_workers.run(work, min(_cpu_workers.workers(), S * len(starts)))
        n = g1 - g0
        p_m, p_s, p_u, p_z = (x[:, :n] for x in part.unbind(0))  # [S, n] each
        m_all, s_all, u_all = lse_merge(p_m, p_s, p_u if opt.return_entropy else None)  # [n] each, O(S·n)
        out[0, g0:g1], out[1, g0:g1] = m_all, s_all
        if u_all is not None:
            out[2, g0:g1] = u_all
        out[3, g0:g1] = p_z.gather(0, chunk_of_y[None, g0:g1]).squeeze(0)
    out[3] = torch.where(in_range, out[3], torch.zeros_like(out[3]))  # no column of this weight is the label
    return out


def _forward_torch(hidden, weight, labels, bias, opt: LinearLogprobsOptions):
    """:func:`_partials_torch`, then :func:`_from_partials`. Returns ``(logp, entropy, stats)`` ([N], [N], [2, N]:
    row max, log Σ exp(z - max)) in float32 (float64 for float64 inputs); without ``opt.return_entropy`` the
    entropy is zeros (not computed)."""
    part = _partials_torch(hidden, weight, labels, bias, opt)  # [4, N]
    out = _from_partials(part, labels, weight.shape[0], opt)
    return tuple(x.float() if x.dtype != torch.float64 else x for x in out)


def _dz_coefficients(g_logp, g_ent, labels, stats, entropy, logp, V: int, cdt: torch.dtype, opt: LinearLogprobsOptions):
    """Per token, what the torch backward's ``dz`` needs besides the logits: ``(row_max, a2, c2, a_s, at_y, valid,
    use_ent)``, each tensor [N] in ``cdt`` (``valid`` bool).

    Off the label, ``dz_j = p_j (a + c log p_j)`` with ``a = -(g_logp + g_H H)/T``, ``c = -g_H/T``. With
    ``d_j = z_j - max``, ``p_j = e^{d_j}/s`` and ``log p_j = d_j - log s``, that is ``dz_j = e^{d_j} (a2 + c2 d_j)``
    (``a2 = (a - c log s)/s``, ``c2 = c/s``), or ``e^{d_j} a_s`` (``a_s = a/s``) where the entropy has no gradient
    (``use_ent`` False). At the label ``dz_y = at_y``, formed without cancellation.

    A label outside ``[0, V)`` that is not ``ignore_index`` keeps its row's gradient and only has no label entry
    (``valid`` False), as in ``_dz_kernel``: the vocabulary-parallel path passes the labels of other ranks' slices
    so (a single-process call never gets here with one: the CPU raises, a GPU's log p is NaN)."""
    counted = labels != opt.ignore_index  # [N]
    valid = counted & (labels >= 0) & (labels < V)  # [N] the label's column is in this weight
    zero = torch.zeros((), dtype=cdt, device=labels.device)
    g_lp = torch.where(counted, g_logp.to(cdt), zero)  # [N]
    g_h = torch.where(counted, g_ent.to(cdt), zero)  # [N]
    # The entropy's terms cost two passes per tile: skip them when its gradient is zero (not
    # requested, unused, or a zero coefficient). Checking is free on the CPU; elsewhere assume used.
    use_ent = labels.device.type != "cpu" or bool(g_h.ne(0).any())
    ent = entropy.to(cdt)  # [N]
    row_max, log_s = stats.to(cdt).unbind(0)  # [N] each
    inv_s = torch.exp(-log_s)  # [N] 1/s
    inv_t = 1.0 / opt.temperature
    a = -(g_lp + g_h * ent) * inv_t  # [N]
    c = -g_h * inv_t  # [N]
    # at the label, 1 - p_y = -expm1(log p_y) (no cancellation); p_y log p_y is 0 where p_y = 0 (a -inf
    # logit), never 0 * -inf
    lp_y = torch.where(valid, logp.to(cdt), zero)  # [N]
    lp_y_finite = torch.where(lp_y == float("-inf"), zero, lp_y)  # [N]
    at_y = (g_lp * -torch.expm1(lp_y) - g_h * torch.exp(lp_y) * (lp_y_finite + ent)) * inv_t  # [N]
    return row_max, (a - c * log_s) * inv_s, c * inv_s, a * inv_s, at_y, valid, use_ent


def _labels_by_chunk(valid, labels, at_y, vchunk: int, S: int):
    """The valid tokens of one chunk of rows grouped by the vocabulary chunk holding their label, so that each tile
    writes its label entries in one ``index_put_``: ``(tok, cols, vals, starts)``, tokens ``tok`` [k] (row in the
    chunk), their label's column ``cols`` [k] within its vocabulary chunk and ``dz_y`` values ``vals`` [k]; chunk
    ``j``'s entries are ``[starts[j], starts[j + 1])``. ``valid``, ``labels`` (in range where valid), ``at_y``: [n]."""
    tok = valid.nonzero().squeeze(1)  # [k]
    chunk_of_y = torch.div(labels[tok], vchunk, rounding_mode="floor")  # [k]
    order = torch.argsort(chunk_of_y, stable=True)
    tok, chunk_of_y = tok[order], chunk_of_y[order]
    cols, vals = labels[tok] - chunk_of_y * vchunk, at_y[tok]  # [k]
    starts = [0]
    for count in torch.bincount(chunk_of_y, minlength=S).tolist():
        starts.append(starts[-1] + count)
    return tok, cols, vals, starts


def _dz_tile(z, m_c, coef, labels_of_tile, use_ent):
    """``dz`` in place of the logits tile ``z`` [n, vc]: ``e^d (a2 + c2 d)`` (``e^d a_s`` without the entropy's
    gradient), ``d = z - max``, then the label entries ``labels_of_tile = (tok, cols, vals)`` written exactly.
    ``m_c`` [n, 1] row max; ``coef = (a2, c2, a_s, pbuf)``: [n, 1] each and a scratch buffer (None without use_ent)."""
    a2_c, c2_c, a_s_c, pbuf = coef
    d = z.sub_(m_c)  # [n, vc] z - max
    if use_ent:
        d.clamp_(min=_EXP_ZERO_BELOW)
        e = torch.exp(d, out=pbuf[: d.numel()].view_as(d))  # [n, vc]
        dz = e.mul_(torch.addcmul(a2_c, d, c2_c, out=d))  # e^d (a' + c' d)
    else:
        dz = d.exp_().mul_(a_s_c)  # e^d a / s
    tok, cols, vals = labels_of_tile
    if tok.numel():
        dz.index_put_((tok, cols), vals)  # one entry per token: no accumulation
    return dz


def _dz_tiler(g_logp, g_ent, labels, stats, entropy, logp, b, V: int, rows: int, vchunk: int, cdt,
              opt: LinearLogprobsOptions):
    """The torch backward's tile: ``(tile, use_ent)``; ``tile(r0, j, h_c, w_j, zbuf, pbuf)`` is the ``dz`` [n, vc] of
    rows ``r0..`` and vocabulary chunk ``j``: the forward's logits recomputed into ``zbuf``, then :func:`_dz_tile`
    in place (``pbuf`` its scratch, None without ``use_ent``). ``h_c`` [n, H], ``w_j`` [vc, H] in ``cdt``; ``b``
    [V] the bias (raw: :func:`_logits_into` divides by the temperature), or None; the other tensors as the backward
    gets them."""
    row_max, a2, c2, a_s, at_y, valid, use_ent = _dz_coefficients(g_logp, g_ent, labels, stats, entropy, logp, V, cdt, opt)
    safe = torch.where(valid, labels, torch.zeros_like(labels))  # [N]
    S = cdiv(V, vchunk)
    # per chunk of rows, its label entries grouped by vocabulary chunk (O(N) in all)
    by_chunk = [_labels_by_chunk(valid[r0:r0 + rows], safe[r0:r0 + rows], at_y[r0:r0 + rows], vchunk, S)
                for r0 in range(0, labels.shape[0], rows)]

    def tile(r0, j, h_c, w_j, zbuf, pbuf):
        n, vc = h_c.shape[0], w_j.shape[0]
        z = _logits_into(zbuf[: n * vc].view(n, vc), h_c, w_j, None if b is None else b[j * vchunk:j * vchunk + vc],
                         opt.temperature)  # [n, vc]
        tok, cols, vals, starts = by_chunk[r0 // rows]
        k0, k1 = starts[j], starts[j + 1]
        r1 = r0 + n
        coef = (a2[r0:r1, None], c2[r0:r1, None], a_s[r0:r1, None], pbuf)
        return _dz_tile(z, row_max[r0:r1, None], coef, (tok[k0:k1], cols[k0:k1], vals[k0:k1]), use_ent)

    return tile, use_ent


def _backward_torch(g_logp, g_ent, hidden, weight, labels, bias, stats, entropy, logp,
                    opt: LinearLogprobsBackwardOptions):
    """Tiled like :func:`_partials_torch`, recomputing each logits tile with the forward's GEMM call; per tile ``dz``
    (:func:`_dz_coefficients`, :func:`_dz_tile`), then ``d_hidden += dz @ W``, ``d_weight += dz.T @ hidden``.

    The outer loop runs over the smaller of the two gradients' axes, split into one contiguous share per
    single-threaded worker (:mod:`rlkernels._cpu_workers`): with fewer tokens than vocabulary entries, the
    vocabulary chunks: each ``d_weight`` slice is accumulated over the tokens in float32 and written once, and each
    worker sums its chunks' ``d_hidden`` terms in its own float32 ``[N, H]`` buffer (no weight-sized float32 buffer,
    no float32 copy of a 16-bit weight); otherwise the token chunks, each worker summing ``d_weight`` in a float32
    ``[V, H]`` buffer. The workers' buffers are added in worker order: the same bits at the same thread count.
    Returns ``(d_hidden [N, H], d_weight [V, H], d_bias [V] or None)`` in the inputs' dtypes; ``d_weight`` None
    without ``opt.grad_weight`` (a frozen head: no ``d_weight`` GEMM, no ``[V, H]`` buffer), ``d_hidden`` None
    without ``opt.grad_input`` (no ``d_hidden`` GEMM, no ``[N, H]`` buffer)."""
    # g_logp, g_ent, labels, entropy, logp: [N]; stats [2, N]; hidden [N, H]; weight [V, H]; bias [V] or None
    (N, H), V = hidden.shape, weight.shape[0]
    dev = hidden.device
    cdt = reference.compute_dtype(hidden)
    b = bias.to(cdt) if bias is not None else None  # [V]
    rows, vchunk = _torch_chunks(N, V)
    S = cdiv(V, vchunk)
    row_starts = list(range(0, N, rows))
    tile, use_ent = _dz_tiler(g_logp, g_ent, labels, stats, entropy, logp, b, V, rows, vchunk, cdt, opt)
    vocab_outer = N < V
    outer = S if vocab_outer else len(row_starts)  # the items split over the workers
    n_workers = max(1, min(_cpu_workers.workers(), outer))
    d_hidden = torch.empty(N, H, dtype=hidden.dtype, device=dev) if opt.grad_input else None  # [N, H]
    d_weight = torch.empty(V, H, dtype=weight.dtype, device=dev) if opt.grad_weight else None  # [V, H]
    d_bias = torch.zeros(V, dtype=cdt, device=dev) if bias is not None and vocab_outer else None  # [V]
    h_all = hidden.to(cdt) if vocab_outer else None  # [N, H] (token-sized; a view for float32)
    w_all = None if vocab_outer else weight.to(cdt)  # [V, H] (smaller than the tokens; a view for float32)

    def work(worker):
        zbuf = torch.empty(rows * vchunk, dtype=cdt, device=dev)  # this worker's tile, reused
        pbuf = torch.empty(rows * vchunk, dtype=cdt, device=dev) if use_ent else None
        # [N or V, H] this worker's share of the gradient over the outer loop: d_hidden (vocabulary outer) or d_weight
        wanted = opt.grad_input if vocab_outer else opt.grad_weight
        acc = torch.zeros(N if vocab_outer else V, H, dtype=cdt, device=dev) if wanted else None
        acc_b = torch.zeros(V, dtype=cdt, device=dev) if b is not None and not vocab_outer else None  # [V]
        for o in range(outer * worker // n_workers, outer * (worker + 1) // n_workers):
            if vocab_outer:  # chunk o of the vocabulary against every token: its d_weight slice, written once
                v0, v1 = o * vchunk, min(V, (o + 1) * vchunk)
                w_j = weight[v0:v1].to(cdt)  # [vc, H]
                direct = d_weight is None or d_weight.dtype == cdt  # float32 sums straight into d_weight
                dw_j = None if d_weight is None else d_weight[v0:v1].zero_() if direct else \
                    torch.zeros(v1 - v0, H, dtype=cdt, device=dev)  # [vc, H]
                for r0 in row_starts:
                    h_c = h_all[r0:r0 + rows]  # [n, H]
                    dz = tile(r0, o, h_c, w_j, zbuf, pbuf)  # [n, vc]
                    if acc is not None:
                        acc[r0:r0 + rows].addmm_(dz, w_j)
                    if dw_j is not None:
                        dw_j.addmm_(dz.T, h_c)
                    if b is not None:
                        d_bias[v0:v1] += dz.sum(0)
                if not direct:
                    d_weight[v0:v1] = dw_j
            else:  # rows o against the whole vocabulary: their d_hidden, written once
                r0 = row_starts[o]
                h_c = hidden[r0:r0 + rows].to(cdt)  # [n, H]
                dh_c = torch.zeros(h_c.shape[0], H, dtype=cdt, device=dev) if opt.grad_input else None  # [n, H]
                for j in range(S):
                    v0, v1 = j * vchunk, min(V, (j + 1) * vchunk)
                    dz = tile(r0, j, h_c, w_all[v0:v1], zbuf, pbuf)  # [n, vc]
                    if dh_c is not None:
                        dh_c.addmm_(dz, w_all[v0:v1])
                    if acc is not None:
                        acc[v0:v1].addmm_(dz.T, h_c)
                    if acc_b is not None:
                        acc_b[v0:v1] += dz.sum(0)
                if dh_c is not None:
                    d_hidden[r0:r0 + rows] = dh_c
        return acc, acc_b

    acc, acc_b = _sum_in_worker_order(_cpu_workers.run(work, n_workers))
    if acc is not None:
        (d_hidden if vocab_outer else d_weight).copy_(acc)
    d_bias = d_bias if acc_b is None else acc_b
    return d_hidden, d_weight, None if d_bias is None else d_bias.to(bias.dtype)


def _sum_in_worker_order(parts: list) -> tuple:
    """The workers' ``(acc, acc_b)`` of :func:`_backward_torch` added in worker order, so the same bits at the same
    thread count (None stays None)."""
    acc, acc_b = parts[0]
    for more, more_b in parts[1:]:
        acc = None if acc is None else acc.add_(more)
        acc_b = None if acc_b is None else acc_b.add_(more_b)
    return acc, acc_b


# ---------------------------------------------------------------- torch.library ops and their autograd.Functions

# Each op's backends: the row serving a call is chosen at run time, inside the op, by _backend.resolve over the
# table's keys (torch.compile traces none of it; RLKERNELS_BACKEND is read at every call). Every row returns the
# same saved statistics (stats: row max, log Σ exp(z - max); the entropy), so the backward may be served by another
# row than the forward. float64 inputs never reach Triton (resolve keeps them on torch).
_FWD_IMPLS = {"torch": _forward_torch, "triton": _forward_triton}
# the forwards' first half, for the vocabulary-parallel path (rlkernels.vocab_parallel), which merges it across ranks
_PARTIALS_IMPLS = {"torch": _partials_torch, "triton": _partials_triton}
_BWD_IMPLS = {"torch": _backward_torch, "triton": _backward_triton}


_FWD_TENSORS = "Tensor hidden, Tensor weight, Tensor labels, Tensor? bias"
_BWD_TENSORS = (
    "Tensor g_logp, Tensor g_entropy, Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, "
    "Tensor stats, Tensor entropy, Tensor logp"
)


def _kept_rows(labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """Token compaction: the rows whose label is not ``ignore_index`` (``[k]`` int64), or None when every row is kept.
    Both ops run their backend on the kept rows only (no GEMM sees an ignored token) and give the others exact
    zeros: log p, entropy, statistics and d_hidden."""
    valid = labels != ignore_index  # [N]
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)  # [k]


@custom_op("rlkernels::linear_logprobs",
           schema=op_schema(_FWD_TENSORS, LinearLogprobsOptions, "(Tensor, Tensor, Tensor)"))
def _linear_logprobs_op(hidden, weight, labels, bias, *options):
    """``hidden`` [N, H], ``weight`` [V, H], int64 ``labels`` [N], ``bias`` [V] or None, then
    ``*option_values(LinearLogprobsOptions)``. Returns ``(logp [N], entropy [N], stats [2, N])``; ``stats`` holds each
    row's max logit ``z/T`` and ``log Σ exp(z/T - max)``, kept apart for the backward (never summed into one lse),
    the same layout and values (to float32 rounding) for every backend; at rows labelled ``ignore_index`` all three
    are exact zeros (:func:`_kept_rows`: no backend sees those rows). Without ``return_entropy`` the entropy is
    zeros (the caller never exposes it, so it gets no gradient)."""
    opt = options_from(LinearLogprobsOptions, options)
    # on the CPU a label out of [0, V) raises here, inside the op, so also when compiled (a data-dependent
    # check cannot be traced: the op runs opaque)
    labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)  # [N] int64
    impl = _backend.implementation(_FWD_IMPLS, hidden)
    keep = _kept_rows(labels, opt.ignore_index)  # [k] or None: every row kept
    with _backend.float32_compute(hidden.device):
        if keep is None:
            return impl(hidden, weight, labels, bias, opt)
        N = labels.shape[0]
        dt = reference.compute_dtype(hidden)
        logp, entropy, stats = (hidden.new_zeros(*shape, dtype=dt) for shape in ((N,), (N,), (2, N)))  # [N], [N], [2, N]
        if keep.numel():
            logp[keep], entropy[keep], stats[:, keep] = impl(hidden[keep], weight, labels[keep], bias, opt)
        return logp, entropy, stats


@_linear_logprobs_op.register_fake
def _(hidden, weight, labels, bias, *options):
    N = hidden.shape[0]
    dt = reference.compute_dtype(hidden)
    return hidden.new_empty(N, dtype=dt), hidden.new_empty(N, dtype=dt), hidden.new_empty(2, N, dtype=dt)  # [N], [N], [2, N]


@custom_op("rlkernels::linear_logprobs_backward",
           schema=op_schema(_BWD_TENSORS, LinearLogprobsBackwardOptions, "(Tensor, Tensor, Tensor)"))
def _linear_logprobs_backward_op(g_logp, g_entropy, hidden, weight, labels, bias, stats, entropy, logp, *options):
    """Upstream ``g_logp``, ``g_entropy`` [N]; the forward's inputs; its ``stats`` [2, N], ``entropy`` [N] and
    ``logp`` [N] (log p of the label, exact, for its dz entry); then ``*option_values(LinearLogprobsBackwardOptions)``.
    Returns ``(d_hidden [N, H] or [0] without grad_input, d_weight [V, H] or [0] without grad_weight, d_bias [V]
    or [0])``."""
    opt = options_from(LinearLogprobsBackwardOptions, options)
    if not opt.return_entropy:
        g_entropy = torch.zeros_like(g_logp)  # [N] the entropy output was zeros, not a function of the inputs
    impl = _backend.implementation(_BWD_IMPLS, hidden)
    keep = _kept_rows(labels, opt.ignore_index)  # [k] or None: every row kept
    with _backend.float32_compute(hidden.device):  # backward may run inside the caller's autocast region
        if keep is None:
            dh, dw, db = impl(g_logp, g_entropy, hidden, weight, labels, bias, stats, entropy, logp, opt)
        else:
            dh = hidden.new_zeros(hidden.shape) if opt.grad_input else None  # [N, H] exact zeros at ignored rows
            dw = weight.new_zeros(weight.shape) if opt.grad_weight else None  # [V, H]
            db = None if bias is None else bias.new_zeros(bias.shape)  # [V]
            if keep.numel():
                dh_kept, dw, db = impl(g_logp[keep], g_entropy[keep], hidden[keep], weight, labels[keep], bias,
                                       stats[:, keep], entropy[keep], logp[keep], opt)
                if dh is not None:
                    dh[keep] = dh_kept
    # [0] for a gradient not computed (one tensor each: a custom op's outputs may not alias each other)
    return tuple(hidden.new_empty(0) if g is None else g for g in (dh, dw, db))


@_linear_logprobs_backward_op.register_fake
def _(g_logp, g_entropy, hidden, weight, labels, bias, stats, entropy, logp, *options):
    opt = options_from(LinearLogprobsBackwardOptions, options)
    db = torch.empty_like(bias) if bias is not None else hidden.new_empty(0)  # [V] or [0]
    dense = torch.contiguous_format
    dw = torch.empty_like(weight, memory_format=dense) if opt.grad_weight else hidden.new_empty(0)  # [V, H] or [0]
    dh = torch.empty_like(hidden, memory_format=dense) if opt.grad_input else hidden.new_empty(0)  # [N, H] or [0]
    return dh, dw, db


# where LinearLogprobsBackwardOptions' two extra fields, grad_weight and grad_input (bools, its last fields), sit
# in its lists
_BOOL_LIST = [type(values[0]) for values in option_values(LinearLogprobsOptions(1.0, True, 0))].index(bool)


def _backward_option_lists(options: tuple, grad_weight: bool, grad_input: bool) -> tuple:
    """The backward op's option lists (:class:`LinearLogprobsBackwardOptions`) from the forward op's ``options``
    (:class:`LinearLogprobsOptions`' lists): ``grad_weight`` and ``grad_input`` appended to the bool list. Plain
    list work, which torch.compile traces in the backward (a dataclass rebuilt there, with ``options_from``, it
    cannot)."""
    return tuple([*values, grad_weight, grad_input] if k == _BOOL_LIST else values for k, values in enumerate(options))


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, *options = inputs
    logp, entropy, stats = output  # [N], [N], [2, N]
    ctx.save_for_backward(hidden, weight, labels, bias, stats, entropy, logp)
    ctx.options = options  # the op's option lists, handed on to the backward's op
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(stats)


def _backward(ctx, g_logp, g_entropy, _g_stats):
    refuse_double_backward("linear_logprobs")
    hidden, weight, labels, bias, stats, entropy, logp = ctx.saved_tensors
    g_logp = torch.zeros_like(logp) if g_logp is None else g_logp  # [N]
    g_entropy = torch.zeros_like(logp) if g_entropy is None else g_entropy  # [N]
    grad_input, grad_weight = ctx.needs_input_grad[:2]  # each gradient not wanted: no GEMM and no buffer for it
    dh, dw, db = call(_linear_logprobs_backward_op, g_logp, g_entropy, hidden, weight, labels, bias, stats, entropy,
                      logp, *_backward_option_lists(ctx.options, grad_weight, grad_input))
    return dh if grad_input else None, dw if grad_weight else None, None, db if ctx.has_bias else None


_LinearLogprobs = autograd_function("_LinearLogprobs", _linear_logprobs_op, _setup_context, _backward)


# ---------------------------------------------------------------- public function

# The reference backend (RLKERNELS_BACKEND=reference) is served in ONE place, here, before the op's
# autograd.Function: its gradient is autograd's through rlkernels.reference's eager formulas, and autograd records
# nothing inside an op (its body runs with autograd off, as a custom op's implementation runs below the Autograd
# key), so it cannot be a row of the ops' tables.
# (rlkernels.softmax and rlkernels.losses serve their reference backends the same way.)
def _reference_linear_logprobs(hidden, weight, labels, bias, opt: LinearLogprobsOptions):
    """:func:`rlkernels.reference.linear_logprobs` behind the op's label check (on the CPU, when not compiled:
    compiled, a bad label gives NaN there, as on a GPU)."""
    if not _checks._tracing():
        labels = _checks.labels(labels, weight.shape[0], opt.ignore_index)  # [...] int64
    return reference.linear_logprobs(hidden, weight, labels, bias=bias, temperature=opt.temperature,
                                     return_entropy=opt.return_entropy, ignore_index=opt.ignore_index)


def linear_logprobs(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [...] int
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
):
    """Log-probability of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    The fused language-model head: equal to
    ``rlkernels.logprobs(hidden @ weight.T + bias, labels, ...)`` but never holds the
    ``[N, V]`` logits (nor their gradient): the product is tiled over tokens and
    vocabulary, reduced on the fly with an online log-sum-exp, and recomputed in
    backward. Extra memory is O(N) forward and O(N·H + chunk) backward beyond the
    gradients themselves (the chunk is a bounded workspace; with at least as many
    tokens as vocabulary entries the Triton backward accumulates ``weight``'s
    gradient in a float32 ``[V, H]`` buffer, then no larger than O(N·H); on the CPU,
    one float32 ``[min(N, V), H]`` buffer per worker thread).

    Args:
        hidden: ``[..., H]`` float16/bfloat16/float32/float64 final hidden states.
        weight: ``[V, H]`` output embedding (``lm_head.weight``), same dtype and device.
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.
        bias: optional ``[V]`` output bias, same dtype.
        temperature: divides the logits (> 0).
        return_entropy: also return the entropy of the same softmax.
        ignore_index: label value whose position gives 0 in both outputs and no gradient.
        process_group: a ``torch.distributed`` process group over which the vocabulary is split (tensor
            parallelism): ``weight`` (and ``bias``) are then this rank's slice ``[V_r, H]`` of the head, holding
            the global token ids ``[vocab_start, vocab_start + V_r)``; ``hidden`` and ``labels`` (global ids) are
            the same on every rank. The ranks' partial statistics are merged by one collective per call
            (:mod:`rlkernels.vocab_parallel`); ``d_weight`` is the rank's slice, ``d_hidden`` is all-reduced over
            the group in the backward. Not traced by ``torch.compile`` (runs eagerly).
        vocab_start: with ``process_group``, the global id of ``weight``'s first row (required then, refused
            without it).

    Returns:
        ``logp`` ``[...]`` float32 (also for float64 inputs, which compute in float64), and with
        ``return_entropy`` also ``entropy`` of the same shape. Differentiable in
        ``hidden``, ``weight`` and ``bias``; their gradients keep their dtypes. A frozen head
        (``weight.requires_grad=False``) costs no ``d_weight`` GEMM and no ``[V, H]`` buffer in the backward.

    Labels of any integer dtype are accepted (compared in int64). A label outside ``[0, V)``
    raises on the CPU, whatever the backend; on a GPU that token's ``logp`` is NaN. Under
    ``torch.autocast`` it still computes in float32.

    Backend: ``RLKERNELS_BACKEND=triton|torch|reference`` forces one; by default Triton on CUDA,
    chunked PyTorch elsewhere (and for float64 inputs).
    """
    opt = _validate(hidden=hidden, weight=weight, labels=labels, bias=bias, temperature=temperature,
                    return_entropy=return_entropy, ignore_index=ignore_index)
    if process_group is not None or vocab_start is not None:  # the vocabulary split over a process group
        from rlkernels import vocab_parallel

        vocab_start = vocab_parallel.check_group(process_group, vocab_start, weight.shape[0])
        logp, entropy = vocab_parallel.linear_logprobs(hidden, weight, labels, bias, opt, process_group, vocab_start)
        return float32_outputs((logp, entropy) if opt.return_entropy else logp)
    if _backend.serves_reference(_FWD_IMPLS, hidden):  # outside float32_compute: it sees the caller's autocast
        return float32_outputs(_reference_linear_logprobs(hidden, weight, labels, bias, opt))
    with _backend.float32_compute(hidden.device):
        lead = hidden.shape[:-1]
        h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        # int64 labels whatever their dtype (the op checks their range on the CPU, also when compiled)
        y = labels.reshape(-1).long()  # [N]
        logp, entropy, _ = _LinearLogprobs.apply(h2, weight, y, bias, *option_values(opt))  # [N], [N], [2, N]
    logp = logp.reshape(lead)  # [...]
    return float32_outputs((logp, entropy.reshape(lead)) if opt.return_entropy else logp)


def __getattr__(name: str):
    """``rlkernels.fused_linear.linear_policy_loss`` / ``logits_policy_loss``: the fused policy losses, which the
    design contract places in this module, live in :mod:`rlkernels.fused_policy` (they build on this module's
    kernels, so they import it; here they are reached lazily, without an import cycle)."""
    if name in ("linear_policy_loss", "logits_policy_loss"):
        from rlkernels import fused_policy

        return getattr(fused_policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
