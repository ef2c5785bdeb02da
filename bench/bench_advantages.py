"""GAE: the per-timestep Python loop peers write vs. the vectorized PyTorch path, Triton and csrc.

Bytes (the memory bound): read rewards and values (B·T·s each, s = bytes per
element of the input dtype), read the mask (B·T bytes, bool), write advantages and
returns (B·T·4 each, float32): B·T·(2s + 1 + 8). FLOPs: ~6 per token (δ and the
recursion), negligible: the op is memory bound.
"""
from __future__ import annotations

import torch

from bench import harness
from bench.harness import Case, Unavailable
from rlkernels import _extension
from rlkernels import advantages as A


def python_loop(rewards, values, mask, gamma=0.99, lam=0.95):
    """GAE as TRL/verl/OpenRLHF write it: one step per token, with the mask applied in the loop."""
    B, T = rewards.shape
    next_value = torch.zeros(B, device=rewards.device)
    last_gae = torch.zeros(B, device=rewards.device)
    adv = torch.zeros(B, T, device=rewards.device)
    m = mask.float()
    r, v = rewards.float(), values.float()
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae_t = delta + gamma * lam * last_gae
        adv[:, t] = gae_t * m[:, t]
        next_value = torch.where(mask[:, t], v[:, t], next_value)
        last_gae = torch.where(mask[:, t], gae_t, last_gae)
    return adv, adv + v


def _provider(impl):
    return lambda r, v, m: impl(r, v, m, 0.99, 0.95)


def cases(device: torch.device, quick: bool) -> list[Case]:
    shapes = [(64, 512)] if device.type == "cpu" else [(256, 1024), (1024, 4096)]
    if device.type == "cpu" and not quick:
        shapes += [(64, 2048), (256, 2048)]  # B=64, T=2048: the CPU target (csrc >= 600x the Python loop)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    out = []
    for B, T in shapes:
        def make_inputs(B=B, T=T):
            r = torch.randn(B, T, device=device, dtype=dtype)
            v = torch.randn(B, T, device=device, dtype=dtype)
            lengths = torch.randint(T // 2, T + 1, (B,), device=device)
            m = torch.arange(T, device=device)[None, :] < lengths[:, None]  # right-padded
            return r, v, m

        providers = {"python-loop": python_loop, "eager-vectorized": _provider(A._gae_torch)}
        if device.type == "cuda":
            providers["triton"] = _provider(A._gae_triton)
        if _extension.load() is not None and (device.type == "cpu" or _extension.has_cuda_kernels()):
            providers["csrc"] = _provider(A._gae_csrc)
        s = torch.empty((), dtype=dtype).element_size()
        out.append(
            Case(
                op="gae",
                shape=f"B={B} T={T} {str(dtype).replace('torch.', '')}",
                bytes_moved=B * T * (2 * s + 1 + 8),
                flops=6 * B * T,
                bound="memory",
                make_inputs=make_inputs,
                providers=providers,
                baseline="python-loop",
            )
        )
    # group_advantages, GRPO with 16 samples per prompt: read N scores, write N float32
    # advantages: 8·N bytes (tiny: a launch-bound op whose baseline is the per-group loop).
    for N in [4096] if device.type == "cpu" else [16384, 1 << 20]:
        def make_scores(N=N):
            return (torch.randn(N, device=device),)

        # one group at a time: at 2^20 scores (65536 groups, two host syncs each) one call takes many seconds on a
        # GPU, and the timing repeats it; the vectorized eager code is the baseline there
        loop_ok = N <= 16384
        providers = {
            "python-loop": (lambda s: A.reference.group_advantages(s, 16)) if loop_ok else
            Unavailable("65536 groups one at a time: seconds per call (baseline: eager-vectorized)"),
            "eager-vectorized": lambda s: A._group_torch(s, 16, None, "grpo", 1e-6),
        }
        if device.type == "cuda":
            providers["triton"] = lambda s: A._group_triton(s, 16, None, "grpo", 1e-6)
        if _extension.load() is not None and (device.type == "cpu" or _extension.has_cuda_kernels()):
            providers["csrc"] = lambda s: A._group_csrc(s, 16, None, "grpo", 1e-6)
        out.append(Case("group_advantages grpo", f"N={N} G=16 float32", 8 * N, 5 * N, "memory", make_scores, providers,
                        baseline="python-loop" if loop_ok else "eager-vectorized"))
    return out + whiten_cases(device) + process_cases(device, quick)


def eager_whiten(x, mask, eps=1e-8):
    """masked_whiten as trainers write it (TRL's masked_mean / masked_var): float32 sums of x times the mask."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    var = ((x - mean) ** 2 * m).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps)


def whiten_cases(device: torch.device) -> list[Case]:
    """masked_whiten of float32 advantages: read x (4 bytes) and the mask (1), write float32 (4): 9 bytes per
    element; the statistics come before any output, so x is read twice, but the bound counts one read from DRAM (the
    fused CUDA kernel's second read is the block's own share, from L1/L2). On CUDA the csrc row is the default
    (RLKERNELS_WHITEN unset: the fused cooperative kernel) and "csrc passes" the three passes it replaces."""
    B, T = (64, 512) if device.type == "cpu" else (1024, 4096)

    def make_inputs():
        x = torch.randn(B, T, device=device) * 3.0 + 1.0  # [B, T]
        lengths = torch.randint(T // 2, T + 1, (B,), device=device)
        return x, torch.arange(T, device=device)[None, :] < lengths[:, None]  # [B, T] right-padded

    providers = {"eager": eager_whiten, "torch": lambda x, m: A._whiten_torch(x, m, True, 1e-8)}
    if device.type == "cuda":
        providers["triton"] = lambda x, m: A._whiten_triton(x, m, True, 1e-8)
    if _extension.load() is not None and (device.type == "cpu" or _extension.has_cuda_kernels()):
        providers["csrc"] = lambda x, m: A._whiten_csrc(x, m, True, 1e-8)
        if device.type == "cuda":
            providers["csrc passes"] = harness.with_env(A.WHITEN_ENV, "passes",
                                                        lambda x, m: A._whiten_csrc(x, m, True, 1e-8))
    return [Case("masked_whiten", f"B={B} T={T} float32", 9 * B * T, 6 * B * T, "memory", make_inputs, providers)]


def process_cases(device: torch.device, quick: bool) -> list[Case]:
    """process_advantages (GRPO process supervision), groups of 16, S steps per completion, T tokens.

    Bytes: read the step rewards (float32), ends (int64) and mask (bool): B·S·13, write the float32
    advantages: B·T·4. FLOPs: ~B·S·T compares-and-adds in the Triton kernel (each token sums its row's
    steps); the torch path scatters and scans, ~B·T. Memory bound at the sizes of a trainer."""
    shapes = [(256, 8, 256)] if device.type == "cpu" else [(1024, 16, 1024), (4096, 32, 4096)]
    out = []
    for B, S, T in shapes:
        def make_inputs(B=B, S=S, T=T):
            r = torch.randn(B, S, device=device)  # [B, S]
            e = torch.sort(torch.randint(0, T, (B, S), device=device), dim=1).values  # [B, S]
            m = torch.rand(B, S, device=device) < 0.8  # [B, S]
            return r, e, m

        loop_ok = device.type == "cpu"  # B*S steps one at a time with host syncs: seconds per call on a GPU
        providers = {
            "python-loop": (lambda r, e, m, T=T: A.reference.process_advantages(r, e, T, step_mask=m, group_size=16))
            if loop_ok else Unavailable("B*S steps one at a time: seconds per call on a GPU (baseline: eager-vectorized)"),
            "eager-vectorized": lambda r, e, m, T=T: A._process_torch(r, e, m, T, 16, None, "grpo", 1e-6),
        }
        if device.type == "cuda":
            providers["triton"] = lambda r, e, m, T=T: A._process_triton(r, e, m, T, 16, None, "grpo", 1e-6)
        out.append(Case("process_advantages grpo", f"B={B} S={S} T={T} G=16 float32", B * S * 13 + B * T * 4,
                        2 * B * S * T, "memory", make_inputs, providers,
                        baseline="python-loop" if loop_ok else "eager-vectorized"))
    return out
