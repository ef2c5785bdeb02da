"""Packed forward passes for the trainer (``--pack``): the real tokens of a padded ``[B, L]`` batch (left-padded
prompt + response, ``attention_mask`` 1 on real tokens) run as one packed ``[1, total]`` sequence with
restarting ``position_ids`` and no attention mask, so no padding is ever computed; the results are scattered
back into the padded layout that the losses and the rest of the trainer use.

Exactly the padded computation: the padded path numbers each row's real tokens ``0..n-1`` (``left_padded_positions``)
and masks the padding out of attention; the packed path gives the same positions and keeps each sequence apart
with the block-diagonal causal mask ``transformers`` builds from restarting ``position_ids`` (eager and SDPA
attention), or flash-attention's varlen kernels (``attn_implementation="flash_attention_2"`` on a GPU where
``flash-attn`` is installed: the same call, not tested here, since this machine has neither).

Cost on a CPU: eager/SDPA attention over the packed row materializes a ``total × total`` mask and computes
every block of it, ``(Σ n)²`` scores against ``B·L²`` padded: packing saves the MLP and projection work on the
padding but multiplies attention work by about ``B`` (see README, "Packed sequences", for measured numbers).
That is why ``--pack`` is off by default; with flash-attention's varlen kernels attention costs ``Σ n²``.
"""
from __future__ import annotations

import torch

from rlkernels import hf
from rlkernels.packing import pack_padded


def _pack(attention_mask: torch.Tensor, *tensors: torch.Tensor):
    """``(flat_index [total], cu_seqlens [B+1], packed tensors [1, total] ...)`` of the real tokens."""
    flat_index, cu_seqlens = pack_padded(attention_mask)  # [total], [B + 1]
    return flat_index, cu_seqlens, *(t.reshape(-1)[flat_index].unsqueeze(0) for t in tensors)  # [1, total] each


def _unpack(packed: torch.Tensor, flat_index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Packed ``[1, total, ...]`` -> padded ``[B, L, ...]``, zeros at padding (differentiable)."""
    rest = packed.shape[2:]
    out = packed.new_zeros(shape[0] * shape[1], *rest)  # [B*L, ...]
    return out.index_put((flat_index,), packed[0]).view(*shape, *rest)  # [B, L, ...]


def response_logprobs(model, ids, attention_mask, scored, *, temperature, return_entropy, linear_logprobs):
    """``hf.response_logprobs`` of the padded batch ``ids`` ``[B, L]`` computed packed: same outputs ``[B, L]``."""
    flat_index, cu_seqlens, packed_ids, packed_scored = _pack(attention_mask, ids, scored)  # [total], [B+1], [1, total] x2
    out = hf.response_logprobs(model, packed_ids, None, packed_scored, cu_seqlens=cu_seqlens, temperature=temperature,
                               return_entropy=return_entropy, linear_logprobs=linear_logprobs)  # [1, total] (x2)
    if return_entropy:
        return tuple(_unpack(x, flat_index, ids.shape) for x in out)  # [B, L] x2
    return _unpack(out, flat_index, ids.shape)  # [B, L]


def final_hidden(backbone, ids, attention_mask) -> torch.Tensor:
    """The backbone's ``last_hidden_state`` ``[B, L, H]`` of the padded batch computed packed (zeros at padding)."""
    from rlkernels.packing import positions

    flat_index, cu_seqlens, packed_ids = _pack(attention_mask, ids)  # [total], [B+1], [1, total]
    position_ids = positions(cu_seqlens, packed_ids.shape[1]).to(ids.device)  # [1, total]
    hidden = hf.final_hidden(backbone, input_ids=packed_ids, position_ids=position_ids)  # [1, total, H]
    return _unpack(hidden, flat_index, ids.shape)  # [B, L, H]
