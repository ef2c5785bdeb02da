"""logprobs (+ entropy) from logits, forward + backward.

Bound (memory): three passes over the [N, V] logits — read them in the forward,
read them again in the backward, write dlogits — so
``bytes_moved = 3 · N · V · itemsize`` (plus O(N): labels, outputs, lse, entropy,
upstream gradients, which the count ignores). FLOPs ≈ 14 · N · V (forward:
scale, max, subtract, exp, sum, the entropy's multiply-add; backward: scale,
subtract, exp, two multiply-adds, the cast), far below any compute ceiling:
the op is memory bound.

Providers: ``eager`` (the reference formulas as a user writes them:
``log_softmax(logits.float() / T)``, ``gather``, ``-(p · logp).sum``, then
autograd), ``torch.compile`` of that same function, ``rlkernels``
(Triton on CUDA, the chunked PyTorch path on the CPU), and on CUDA where installed
Liger-Kernel's and flash-attn's Triton cross-entropy and TRL's ``selective_log_softmax`` (log-prob only).
"""
from __future__ import annotations

import torch

import rlkernels
from bench import harness
from bench.harness import Case

TEMPERATURE = 0.7


def eager_logprobs(logits, labels, temperature: float = TEMPERATURE):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [N]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


_compiled = None


def _compiled_logprobs():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(eager_logprobs)
    return _compiled


def _step(fn):
    def step(logits, labels, g_logp, g_ent):  # logits [N, V] leaf, labels [N], g_* [N]
        logp, entropy = fn(logits, labels)
        return torch.autograd.grad([logp, entropy], [logits], [g_logp, g_ent])

    return step


def _rlkernels(logits, labels):
    return rlkernels.logprobs(logits, labels, temperature=TEMPERATURE, return_entropy=True)


def _peers(device: torch.device) -> dict:
    """Cross-entropy kernels from logits (log-prob only: no entropy, no temperature; summed, so the backward
    gets one scalar); rows say "not installed" / "needs a CUDA device" where they cannot run."""

    def liger():
        from liger_kernel.transformers import LigerCrossEntropyLoss

        loss_fn = LigerCrossEntropyLoss(reduction="sum")

        def step(logits, labels, g_logp, g_ent):
            return torch.autograd.grad(loss_fn(logits, labels), [logits])

        return step

    def flash_attn():
        from flash_attn.losses.cross_entropy import CrossEntropyLoss

        loss_fn = CrossEntropyLoss(reduction="sum")

        def step(logits, labels, g_logp, g_ent):
            return torch.autograd.grad(loss_fn(logits, labels), [logits])

        return step

    def trl():
        from trl.trainer.utils import selective_log_softmax  # TRL's memory-saving log-prob gather (eager, no entropy)

        def step(logits, labels, g_logp, g_ent):
            logp = selective_log_softmax(logits.float() / TEMPERATURE, labels)  # [N]
            return torch.autograd.grad(logp, [logits], g_logp)

        return step

    return {
        "liger CE (logp only)": harness.peer("liger_kernel.transformers", "liger-kernel", device, liger),
        "flash-attn CE (logp only)": harness.peer("flash_attn.losses.cross_entropy", "flash-attn", device, flash_attn),
        "trl selective_log_softmax (logp only)": harness.peer("trl.trainer.utils", "trl", device, trl),
    }


def _case(N: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    def make_inputs():
        logits = (torch.randn(N, V, device=device, dtype=dtype) * 2).requires_grad_(True)  # [N, V]
        labels = torch.randint(0, V, (N,), device=device)  # [N]
        g_logp = torch.randn(N, device=device)  # [N]
        g_ent = torch.randn(N, device=device)  # [N]
        return logits, labels, g_logp, g_ent

    itemsize = torch.empty((), dtype=dtype).element_size()
    return Case(
        op="logprobs+entropy fwd+bwd",
        shape=f"N={N} V={V} {str(dtype).removeprefix('torch.')}",
        bytes_moved=3 * N * V * itemsize,
        flops=14 * N * V,
        bound="memory",
        make_inputs=make_inputs,
        providers={
            "eager": _step(eager_logprobs),
            "torch.compile": _step(lambda x, y: _compiled_logprobs()(x, y)),
            "rlkernels": _step(_rlkernels),
            **_peers(device),
        },
    )


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        shapes = [(8192, 128256, torch.bfloat16), (8192, 151936, torch.bfloat16)]
        if quick:
            shapes = shapes[:1]
    elif quick:
        shapes = [(512, 32000, torch.float32), (512, 32000, torch.bfloat16)]
    else:
        shapes = [(2048, 32000, torch.float32), (2048, 32000, torch.bfloat16), (1024, 128256, torch.bfloat16)]
    return [_case(N, V, dtype, device) for N, V, dtype in shapes]


def tiny_cases(device: torch.device) -> list[Case]:
    """``python -m bench --gpu --dry-run``: the same case at a tiny, odd size (the code path, not a measurement)."""
    return [_case(16, 1000, torch.bfloat16, device)]
