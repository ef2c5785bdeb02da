"""Packed sequences: ``S`` sequences of lengths ``n_s`` laid end to end in one ``[1, total]`` row, with the
boundaries in ``cu_seqlens`` ``[S + 1]`` (``0 = c_0 <= c_1 <= ... <= c_S = total``, sequence ``s`` at
``[c_s, c_{s+1})``), the layout of flash-attention's varlen kernels, verl's and OpenRLHF's "remove padding".

The per-token losses take packed inputs through one map computed here: :func:`padded_index` gives, for each
packed token, its place in the padded view ``[S, Tmax]`` (``Tmax = max n_s``), and :func:`unpack` /
:func:`pack` move tensors between the two layouts (differentiable; padding reads as 0). A packed op is then
*defined* as the padded op on that view, so every ``agg`` mode and GSPO's sequence ratio mean exactly what they
mean on ``[S, Tmax]`` (``seq-mean-token-sum-norm``'s default ``norm_length`` is that view's ``Tmax``).

:func:`pack_padded` goes the other way for a trainer: it packs the real tokens of a padded batch (attention
mask 1) and returns the ``cu_seqlens`` and the index that scatters the packed results back.

Every function here reads ``cu_seqlens`` on the host once (the view's size depends on its values): one device
synchronisation on a GPU, the cost of any varlen layout.
"""
from __future__ import annotations

import numbers

import torch

from rlkernels import _checks


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate sequence boundaries and return them as Python ints.

    Args:
        cu_seqlens: ``[S + 1]`` int32/int64 cumulative lengths, a tensor or a Python sequence of ints (static:
            under ``torch.compile`` a list keeps every shape known, where a tensor's values would not be).
        total: the packed length the boundaries must end at (``inputs.shape[-1]``).
        name: the argument's name, for the error messages.

    Raises:
        TypeError: not an integer tensor. ValueError: not 1-D with at least one entry, not starting at 0, decreasing,
        or not ending at ``total``.
    """
    if isinstance(cu_seqlens, (list, tuple)):
        if not cu_seqlens or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in cu_seqlens):
            raise TypeError(f"{name} given as a sequence must hold at least one integer, got {cu_seqlens!r:.200}")
        bounds = [int(c) for c in cu_seqlens]  # Python ints (NumPy integers converted)
    else:
        _checks.integer(cu_seqlens, name)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"{name} must be 1-D [S + 1] with at least one entry, got shape {tuple(cu_seqlens.shape)}")
        bounds = [int(c) for c in cu_seqlens.tolist()]  # the host read (one sync on a GPU)
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {bounds[0]}")
    for s in range(1, len(bounds)):
        if bounds[s] < bounds[s - 1]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{s - 1}] = {bounds[s - 1]} > "
                             f"{name}[{s}] = {bounds[s]}")
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {name}[-1] = {bounds[-1]}")
    return bounds


def padded_index(cu_seqlens: torch.Tensor | list[int], total: int, name: str = "cu_seqlens",
                 device: torch.device | None = None) -> tuple[torch.Tensor, int, int]:
    """``(index [total] int64, S, Tmax)``: packed token ``i`` of sequence ``s`` at offset ``j`` sits at
    ``index[i] = s·Tmax + j`` of the flattened padded view ``[S, Tmax]`` (validated as :func:`check_cu_seqlens`).
    ``index`` lives on ``cu_seqlens``' device, or on ``device`` (default CPU) when the boundaries are a list."""
    bounds = check_cu_seqlens(cu_seqlens, total, name)
    # sizes from the Python ints (static while torch.compile traces a list of boundaries)
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    # (not max(..., default=0): once a compiled step's boundaries change, dynamo traces them as symbols and cannot
    # trace that keyword)
    S, Tmax = len(sizes), (max(sizes) if sizes else 0)
    # built on the CPU by name, then moved: under a caller's torch.set_default_device("meta") (a model built on meta)
    # the map would otherwise hold no data and the move fail
    host = torch.device("cpu")
    lengths = torch.tensor(sizes, dtype=torch.long, device=host)  # [S]
    # [total]: each token's sequence
    seq = torch.repeat_interleave(torch.arange(S, device=host), lengths, output_size=total)
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=host)  # [S]
    offset = torch.arange(total, device=host) - starts[seq]  # [total]: position inside its sequence
    where = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else (device or torch.device("cpu"))
    return (seq * Tmax + offset).to(where), S, Tmax  # [total]


def positions(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> torch.Tensor:
    """``[1, total]`` int64 position ids restarting at 0 at every sequence start (what the model sees)."""
    index, _, Tmax = padded_index(cu_seqlens, total, name)
    return (index % max(Tmax, 1)).unsqueeze(0)  # [1, total]


def cu_seqlens_from_positions(position_ids: torch.Tensor, name: str = "position_ids") -> torch.Tensor:
    """``cu_seqlens`` ``[S + 1]`` int64 of packed ``position_ids`` ``[1, total]`` that count ``0, 1, 2, ...``
    within each sequence: a sequence starts at every 0.

    Raises:
        ValueError: not ``[1, total]``, or positions that do not start at 0 or do not step by 1 inside a
            sequence (transformers would split the sequences elsewhere: it starts one wherever the step is not 1).
    """
    _checks.integer(position_ids, name)
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"packed {name} must have shape [1, total], got {tuple(position_ids.shape)}")
    pos = position_ids[0].long()  # [total]
    total = pos.numel()
    if total == 0:
        return torch.zeros(1, dtype=torch.long, device=pos.device)
    start = pos == 0  # [total]
    step_ok = torch.cat([start[:1], (pos[1:] == pos[:-1] + 1) | start[1:]])  # [total]
    if not bool(step_ok.all()):
        t = int((~step_ok).nonzero()[0])
        raise ValueError(f"packed {name} must restart at 0 for every sequence and step by 1 inside it; "
                         f"{name}[0, {t}] = {int(pos[t])}" + (f" follows {int(pos[t - 1])}" if t else ""))
    starts = start.nonzero().squeeze(-1)  # [S]
    return torch.cat([starts, starts.new_tensor([total])])  # [S + 1]


def unpack(x: torch.Tensor, index: torch.Tensor, S: int, Tmax: int, name: str = "x") -> torch.Tensor:
    """Packed ``x`` ``[1, total]`` (or ``[total]``) -> padded ``[S, Tmax]``, 0 at padding; differentiable
    (the gradient of a padded entry is dropped, a packed entry gets its own)."""
    flat = x.reshape(-1) if x.dim() == 1 or (x.dim() == 2 and x.shape[0] == 1) else None  # [total]
    if flat is None or flat.numel() != index.numel():
        raise ValueError(f"packed {name} must have shape [1, total] = [1, {index.numel()}], got {tuple(x.shape)}")
    out = flat.new_zeros(S * Tmax)  # [S*Tmax]
    return out.index_put((index,), flat).view(S, Tmax)  # [S, Tmax]: out-of-place, so autograd sees it


def pack(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Padded ``y`` ``[S, Tmax]`` -> packed ``[1, total]`` (the inverse of :func:`unpack` on real tokens)."""
    return y.reshape(-1)[index].unsqueeze(0)  # [1, total]


def pack_padded(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the real tokens (``attention_mask`` 1; bool or 0/1, refused otherwise) of a padded batch, row after row.

    Returns ``(flat_index [total] int64, cu_seqlens [B + 1] int64)``: ``x.reshape(-1)[flat_index]`` packs any
    ``[B, T]`` tensor (``[1, total]`` after ``unsqueeze(0)``), ``out.new_zeros(B * T).index_put((flat_index,),
    packed)`` scatters a result back. A row with no real token is an empty sequence.
    """
    _checks.rank(_checks.mask(attention_mask, "attention_mask"), "attention_mask", 2)  # 0/1: a NaN is no real token
    real = attention_mask.reshape(-1) != 0  # [B*T]
    flat_index = real.nonzero().squeeze(-1)  # [total]
    lengths = (attention_mask != 0).sum(-1)  # [B]
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # [B + 1]
    return flat_index, cu_seqlens


def padded_views(cu_seqlens: torch.Tensor, first: str, per_sequence: tuple[str, ...] = (),
                 **tensors: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The padded ``[S, Tmax]`` views of a per-token op's packed ``[1, total]`` arguments (None stays None).

    The adapter every packed loss entry uses: ``total`` is read from the argument named ``first``; the names in
    ``per_sequence`` may instead hold one value per sequence, ``[S]`` (e.g. ``advantages``), and pass unchanged.
    Errors name the offending argument.
    """
    x = _checks.tensor(tensors[first], first)
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"with cu_seqlens, {first} must be packed [1, total], got shape {tuple(x.shape)}")
    index, S, Tmax = padded_index(cu_seqlens, x.shape[1], device=x.device)
    views = {}
    for name, t in tensors.items():
        if t is None:
            views[name] = None
            continue
        _checks.tensor(t, name)
        if t.device != index.device:
            raise ValueError(f"{name} is on {t.device} but cu_seqlens is on {index.device}")
        if name in per_sequence and t.dim() == 1:
            if t.shape[0] != S:
                raise ValueError(f"per-sequence {name} must have shape [S] = [{S}] (S from cu_seqlens), "
                                 f"got {tuple(t.shape)}")
            views[name] = t  # [S]
        else:
            views[name] = unpack(t, index, S, Tmax, name)  # [S, Tmax]
    return views
