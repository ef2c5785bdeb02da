"""Packed forward passes for the trainer (``--pack``): the real tokens of a padded ``[B, L]`` batch (left-padded
prompt + response, ``attention_mask`` 1 on real tokens) are packed end to end into as few rows of ``L`` tokens as
first-fit decreasing finds (``[P, L]``, ``P <= B``), each sequence's positions restarting at 0 and no attention
mask; the results are scattered back into the padded layout the losses and the rest of the trainer use. The
unused tail of a row is one more sequence of filler tokens (positions restarting at 0, never scored, its
outputs dropped).

Exactly the padded computation: the padded path numbers each row's real tokens ``0..n-1`` (``left_padded_positions``)
and masks the padding out of attention; the packed path gives the same positions and keeps each sequence apart
with the block-diagonal causal mask ``transformers`` builds from restarting ``position_ids`` (eager and SDPA
attention), or flash-attention's varlen kernels (``attn_implementation="flash_attention_2"`` on a GPU where
``flash-attn`` is installed: the same call, not tested here, since this machine has neither).

Cost: rows of the padded width ``L`` keep attention's work per row at the padded ``L²`` (eager/SDPA compute the
whole masked ``L × L`` block) while the MLP and projections skip the padding, so packing saves about the
padding's share of the batch and little else on a CPU. The default run's batches are ~98% real tokens: there
``--pack`` saves nothing, which is why it is off by default (README, "Packed sequences", has the numbers).
"""
from __future__ import annotations

import torch

from rlkernels import hf


def _rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the sequences (indices into ``lengths``) of each packed row, at most ``capacity``
    tokens per row."""
    rows, free = [], []
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[b] <= room:
                rows[r].append(b)
                free[r] -= lengths[b]
                break
        else:
            rows.append([b])
            free.append(capacity - lengths[b])
    return rows


def _layout(attention_mask: torch.Tensor):
    """``(padded_index [total], packed_index [total], position_ids [P, L])``: real token ``i`` sits at
    ``padded_index[i]`` of the flattened ``[B, L]`` batch and at ``packed_index[i]`` of the flattened ``[P, L]``
    rows; ``position_ids`` restart at 0 for every sequence and for each row's filler tail."""
    B, L = attention_mask.shape
    real = attention_mask != 0  # [B, L]
    lengths = real.sum(-1).tolist()  # [B]
    rows = _rows(lengths, L)
    position_ids = torch.zeros(len(rows), L, dtype=torch.long)  # [P, L]
    padded_index, packed_index = [], []
    for r, members in enumerate(rows):
        col = 0
        for b in members:
            n = lengths[b]
            padded_index.append(real[b].nonzero().squeeze(-1).cpu() + b * L)  # [n]
            packed_index.append(torch.arange(col, col + n) + r * L)  # [n]
            position_ids[r, col : col + n] = torch.arange(n)
            col += n
        position_ids[r, col:] = torch.arange(L - col)  # the filler tail: a sequence of its own
    device = attention_mask.device
    return (torch.cat(padded_index).to(device), torch.cat(packed_index).to(device),  # [total] x2
            position_ids.to(device))  # [P, L]


def _pack(x: torch.Tensor, padded_index, packed_index, shape) -> torch.Tensor:
    """Padded ``[B, L]`` -> packed rows ``shape`` = ``[P, L]`` (filler 0)."""
    return x.new_zeros(shape[0] * shape[1]).index_put((packed_index,), x.reshape(-1)[padded_index]).view(shape)


def _unpack(packed: torch.Tensor, padded_index, packed_index, shape) -> torch.Tensor:
    """Packed rows ``[P, L, ...]`` -> padded ``shape`` = ``[B, L]`` (``[B, L, ...]``), zeros at padding
    (differentiable)."""
    rest = packed.shape[2:]
    flat = packed.reshape(-1, *rest)[packed_index]  # [total, ...]
    return flat.new_zeros(shape[0] * shape[1], *rest).index_put((padded_index,), flat).view(*shape, *rest)


def response_logprobs(model, ids, attention_mask, scored, *, temperature, return_entropy, linear_logprobs):
    """``hf.response_logprobs`` of the padded batch ``ids`` ``[B, L]`` computed packed: same outputs ``[B, L]``."""
    padded_index, packed_index, position_ids = _layout(attention_mask)  # [total] x2, [P, L]
    rows = lambda x: _pack(x, padded_index, packed_index, position_ids.shape)  # noqa: E731  [B, L] -> [P, L]
    out = hf.response_logprobs(model, rows(ids), None, rows(scored), position_ids=position_ids,
                               temperature=temperature, return_entropy=return_entropy,
                               linear_logprobs=linear_logprobs)  # [P, L] (x2)
    back = lambda x: _unpack(x, padded_index, packed_index, ids.shape)  # noqa: E731  [P, L] -> [B, L]
    return tuple(back(x) for x in out) if return_entropy else back(out)


def final_hidden(backbone, ids, attention_mask) -> torch.Tensor:
    """The backbone's ``last_hidden_state`` ``[B, L, H]`` of the padded batch computed packed (zeros at padding)."""
    padded_index, packed_index, position_ids = _layout(attention_mask)  # [total] x2, [P, L]
    packed_ids = _pack(ids, padded_index, packed_index, position_ids.shape)  # [P, L]
    hidden = hf.final_hidden(backbone, input_ids=packed_ids, position_ids=position_ids)  # [P, L, H]
    return _unpack(hidden, padded_index, packed_index, ids.shape)  # [B, L, H]
