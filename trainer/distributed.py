"""Sharded training with FSDP2 (``--shard fsdp``): wrapping, generation, and sharded checkpoints (DCP).

Built on PyTorch's own engines: ``torch.distributed.fsdp.fully_shard`` shards every parameter (and its
gradient and AdamW state) over the processes of a ``torchrun`` job, and ``torch.distributed.checkpoint``
writes and reads those shards. Nothing here re-implements either.

How the models are wrapped (:func:`fsdp_wrap`): each transformer block is its own ``fully_shard``
group, and a :class:`ShardedRoot` around the trainer's wrapper (``TokenLogprobs``, ``Critic``) is the
root group, which holds everything outside the blocks (embeddings, final norm, LM head, value head; a module
of another dtype than the rest, such as a float32 value head on a bfloat16 critic, gets a group of its own).

The LM head and ``rlkernels.linear_logprobs``: the op needs the whole ``[V, H]`` weight. FSDP2 gathers a
group's parameters in that group's forward pre-hook and, until the group reshards, registers the full
(plain ``torch.Tensor``) parameter on the module in place of the sharded ``DTensor``. The trainer never
calls the causal LM's own ``forward`` for training (that would form ``[B, T, V]`` logits); it runs the
backbone and then hands the head's weight to ``linear_logprobs`` (``rlkernels.hf.response_logprobs``).
Both happen inside ``TokenLogprobs.forward``, so making the root group's module the one whose forward
runs them is all it takes: inside that forward ``lm_head.weight`` is the gathered ``[V, H]`` tensor
(gathered by the root's forward, released after the backward that follows), and its gradient is
reduce-scattered back to the shards by FSDP's post-backward hook like every other root parameter. We chose this over calling
``DTensor.full_tensor()`` in a forward hook: the root group gathers the head anyway (it is one of its
parameters), so that would be a second all-gather outside FSDP's schedule, and the gradient would reach the
shard through DTensor's autograd instead of FSDP's reduce-scatter.

Generation (``model.generate``) calls the causal LM's forward, not the root's: outside the root's forward
the root group's parameters stay sharded, and FSDP2 refuses a block's forward before the root's first one. :class:`ShardedRoot` therefore takes ``call=``: ``root(call=fn, ...)`` runs
``fn(...)`` inside the root's forward, so the root group is gathered and every block gathers its own.
``generate`` gets ``synced_gpus=True`` there: the processes keep stepping until all have finished, since
each decoding step is a collective (a process that stopped early would leave the others waiting). The trainer
runs it inside :func:`gathered`, so each group is gathered once for the whole rollout rather than once per token.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint

_DCP_METADATA = ".metadata"  # the file torch.distributed.checkpoint writes next to its shards


class ShardedRoot(nn.Module):
    """The FSDP root group around ``inner`` (a ``TokenLogprobs``, a ``Critic``, a reward model).

    ``root(*args, **kwargs)`` is ``inner(*args, **kwargs)``; ``root(*args, call=fn, **kwargs)`` is
    ``fn(*args, **kwargs)`` (e.g. ``policy.generate``) run inside the root's forward, where the root
    group's parameters are gathered. Tensor outputs that are views are returned as copies: FSDP attaches
    its pre-backward hook to the outputs, and an in-place op on a view would drop it.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, call=None, **kwargs):
        out = (self.inner if call is None else call)(*args, **kwargs)
        return _not_views(out)


def unwrap(module: nn.Module) -> nn.Module:
    """The trainer's module inside a :class:`ShardedRoot` (``module`` itself when it is not one)."""
    return module.inner if isinstance(module, ShardedRoot) else module


def _not_views(out):
    if isinstance(out, torch.Tensor):
        return out.clone() if out._base is not None else out
    if isinstance(out, tuple):
        return tuple(_not_views(x) for x in out)
    return out


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the ``transformers`` models inside ``module``: the submodules whose class
    a model lists in ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...). Empty for a
    model that lists none: it is then sharded as one group (the root)."""
    names = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if type(sub).__name__ in names]


def _other_dtype_modules(inner: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules outside ``blocks`` holding parameters of another dtype than most of the rest (the critic's
    float32 value head on a bfloat16 backbone): FSDP2 needs one dtype per group, so each gets its own."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    owners = [(m, p) for m in inner.modules() for p in m.parameters(recurse=False) if id(p) not in in_blocks]
    numel: dict[torch.dtype, int] = {}
    for _, p in owners:
        numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    if len(numel) < 2:
        return []
    main = max(numel, key=numel.get)
    found = []
    for m, p in owners:
        if p.dtype != main and all(m is not f for f in found):
            found.append(m)
    return found


def fsdp_wrap(inner: nn.Module, *, frozen: bool = False, offload: bool = False) -> ShardedRoot:
    """Shard ``inner`` over the default process group with FSDP2; returns its :class:`ShardedRoot`.

    One ``fully_shard`` group per transformer block (:func:`transformer_blocks`), one per module outside
    them whose parameters have another dtype than the rest, then the root around everything else. ``frozen`` (the reference policy, a reward model; their parameters need no gradient):
    the root reshards after each forward too, since no backward will free its gathered parameters.
    ``offload``: shards live in CPU memory and are copied to the device for each group's forward
    (``CPUOffloadPolicy``; on a CPU-only job the copy is a no-op). ``inner`` must already be on its device.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    blocks = transformer_blocks(inner)
    groups = blocks + _other_dtype_modules(inner, blocks)  # found before sharding changes the parameters' sizes
    for group in groups:
        fully_shard(group, **extra)
    root = ShardedRoot(inner)
    # the root's default keeps its parameters gathered after forward, for the backward that follows. torch 2.13
    # honours an explicit True on the root (a version that keeps the root gathered regardless costs memory, not results)
    fully_shard(root, **({"reshard_after_forward": True} if frozen else {}), **extra)
    # each group's reshard-after-forward as wrapped here (FSDP2's defaults: True but for the root), for gathered()
    root.reshard_after_forward = [(group, True) for group in groups] + [(root, frozen)]
    return root


@contextlib.contextmanager
def gathered(root: ShardedRoot):
    """Every FSDP group of ``root`` (:func:`fsdp_wrap`) kept gathered from its first forward in the block to the
    block's end, then resharded. For generation: each decoding step runs every block's forward, which gathers the
    block's parameters and reshards them after it -- one all-gather per block per generated token (the H200 run
    of 2026-11-27: 16.1 s a sharded step where one process took 0.4-0.9 s); inside the block, one per block for
    the whole rollout. Meanwhile every process holds the whole model, as under DDP. Afterwards each group's
    setting is what :func:`fsdp_wrap` gave it. Every process must enter it (the gathers are collectives)."""
    groups = root.reshard_after_forward  # [(FSDP module, reshard after forward)]
    for module, _ in groups:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield root
    finally:
        for module, after in groups:
            module.set_reshard_after_forward(after, recurse=False)
            module.reshard()


def full_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter of ``module`` as a whole tensor (sharded ``DTensor`` ones gathered; a collective
    under FSDP: every process must call it)."""
    from torch.distributed.tensor import DTensor

    return [p.full_tensor() if isinstance(p, DTensor) else p for p in module.parameters()]


# ------------------------------------------------------------------ checkpoints


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ``path`` was written by :func:`save` (DCP shards)."""
    return (Path(path) / _DCP_METADATA).exists()


def _state(modules: dict[str, nn.Module], optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(nn.ModuleDict(modules), optimizer)  # (model, optimizer) state, FQNs "policy.inner..."


def save(root: str | os.PathLike, step: int, modules: dict[str, nn.Module], optimizer, extra: dict) -> Path:
    """Write a sharded checkpoint ``root/step_NNNNNN`` with ``torch.distributed.checkpoint`` (every process
    calls it; each writes its own shards of the ``modules`` and of the optimizer state).

    The same layout as :func:`trainer.checkpoint.save` where it can be: ``state.json`` (step and
    ``extra``) and ``rng.pt`` from rank 0, written by rank 0 into a temporary directory that is renamed
    into place once every process's shards are on disk; the weights and optimizer state are DCP files
    (``.metadata`` and one ``__R_0.distcp`` per rank) instead of safetensors and ``optimizer.pt``.
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    tmp, final = checkpoint.staging_dirs(root, step, "sharded")  # the same names in every process
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = _state(modules, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))  # ends with a barrier
    if rank == 0:
        torch.save(checkpoint.rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2))
        checkpoint.publish(tmp, final)
    dist.barrier()
    return final


def load(path: str | os.PathLike, modules: dict[str, nn.Module], optimizer) -> dict:
    """Read a checkpoint written by :func:`save` into the (sharded) ``modules`` and ``optimizer``; the
    saved rank-0 RNG state is restored in every process. Returns ``state.json``. DCP reshards on load,
    so the job may have another number of processes than the one that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    model_state, optim_state = _state(modules, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))  # in place, into this process's shards
    set_state_dict(nn.ModuleDict(modules), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    checkpoint.set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())
