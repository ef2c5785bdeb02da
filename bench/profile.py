"""``python -m bench.profile --case NAME [--device cuda] [--tiny]``: one call of one op at the contract's size,
between ``cudaProfilerStart`` and ``cudaProfilerStop``, for Nsight Compute.

``python -m bench --gpu --part profile`` runs it once per case under
``ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy --csv`` and
records, per kernel launch of the profiled call, its duration, compute (SM) and DRAM throughput as a percentage of
the device's peak, registers per thread and achieved occupancy: the "why" behind a bench row that misses its
target (a GEMM phase at low SM throughput, a memory-bound kernel far from DRAM peak, a launch-bound op made of many
short kernels). A warm-up call runs first, outside the profiled range, so Triton's compiles are not profiled.

``--tiny`` (the dry run on a CPU) runs the same code at small sizes without a profiler: it checks the script.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import rlkernels
from bench import harness
from rlkernels import advantages as A


# The linear heads' cases run at a quarter of the bench's tokens and one vocabulary chunk (N=4096 H=4096 V=32768
# bf16): under ncu every GEMM-sized kernel is replayed for each section, and at N=8192 V=128256 the case outlasted
# its 66 s share twice on the H200. Their kernels' tiles and persistent grids are those of the full size (32 token
# blocks x 256 vocabulary tiles fill every SM), so their SM and DRAM throughputs still say what limits them.
LINEAR_PROFILE_SIZE = (4096, 4096, 32768)


def _linear(device: torch.device, tiny: bool) -> Callable[[], object]:
    N, H, V = (16, 24, 1000) if tiny else LINEAR_PROFILE_SIZE
    hidden = torch.randn(N, H, device=device, dtype=torch.bfloat16).requires_grad_()  # [N, H]
    weight = (torch.randn(V, H, device=device, dtype=torch.bfloat16) * H**-0.5).requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (N,), device=device)  # [N]

    def step():
        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, return_entropy=True)
        return torch.autograd.grad([logp, ent], [hidden, weight], [torch.ones_like(logp), torch.ones_like(ent)])

    return step


def _linear_policy(device: torch.device, tiny: bool) -> Callable[[], object]:
    """linear_policy_loss fwd+bwd with the bench's options (bench_fused_policy): kernel 1 (GEMM 1, statistics, the
    float32 tile stored), kernel 2 (dz), the two gradient GEMMs; at LINEAR_PROFILE_SIZE the tokens take one chunk."""
    from bench.bench_fused_policy import OPTIONS, T_SEQ, policy_inputs

    N, H, V = (32, 24, 1000) if tiny else LINEAR_PROFILE_SIZE
    B, T = max(1, N // T_SEQ), min(N, T_SEQ)
    hidden = torch.randn(B, T, H, device=device, dtype=torch.bfloat16).requires_grad_()  # [B, T, H]
    weight = (torch.randn(V, H, device=device, dtype=torch.bfloat16) * H**-0.5).requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (B, T), device=device)  # [B, T]
    old, adv, mask, ref_logp = policy_inputs(B, T, device)  # [B, T] each

    def step():
        loss = rlkernels.linear_policy_loss(hidden, weight, labels, old, adv, mask, ref_logp=ref_logp, **OPTIONS)[0]
        return torch.autograd.grad(loss, [hidden, weight])

    return step


def _logprobs(device: torch.device, tiny: bool) -> Callable[[], object]:
    N, V = (16, 1000) if tiny else (8192, 151936)
    logits = torch.randn(N, V, device=device, dtype=torch.bfloat16).requires_grad_()  # [N, V]
    labels = torch.randint(0, V, (N,), device=device)  # [N]

    def step():
        logp, ent = rlkernels.logprobs(logits, labels, return_entropy=True)
        return torch.autograd.grad([logp, ent], [logits], [torch.ones_like(logp), torch.ones_like(ent)])

    return step


def _logits_policy(two_op: bool, row: str = "pair"):
    """logits_policy_loss fwd+bwd at the bench's size and options (bench_fused_policy: N=8192 V=151936 bf16), in
    its CUDA row ``row`` (RLKERNELS_LOGITS_POLICY: "cluster" is the csrc kernel that reads the logits once), or
    with ``two_op`` logprobs + policy_loss: on the H100 the op took 5.0 ms against the two ops' 2.6 ms with the
    same logprobs kernels, so the kernels' own times say whether the difference is on the GPU or the host."""

    def make(device: torch.device, tiny: bool) -> Callable[[], object]:
        from bench.bench_fused_policy import OPTIONS, policy_inputs

        B, T, V = (2, 16, 1000) if tiny else (32, 256, 151936)
        logits = (torch.randn(B, T, V, device=device, dtype=torch.bfloat16) * 2).requires_grad_()  # [B, T, V]
        labels = torch.randint(0, V, (B, T), device=device)  # [B, T]
        old, adv, mask, ref_logp = policy_inputs(B, T, device)  # [B, T] each

        def step():
            if two_op:
                logp, ent = rlkernels.logprobs(logits, labels, return_entropy=True)
                loss = rlkernels.policy_loss(logp, old, adv, mask, ref_logp=ref_logp, entropy=ent, **OPTIONS)[0]
            else:
                loss = rlkernels.logits_policy_loss(logits, labels, old, adv, mask, ref_logp=ref_logp, **OPTIONS)[0]
            return torch.autograd.grad(loss, [logits])

        from rlkernels import fused_policy

        return harness.with_env(fused_policy.LOGITS_ROW_ENV, row, step)

    return make


def _gae(backend: str):
    def make(device: torch.device, tiny: bool) -> Callable[[], object]:
        B, T = (4, 64) if tiny else (1024, 4096)
        r = torch.randn(B, T, device=device, dtype=torch.bfloat16)  # [B, T]
        v = torch.randn(B, T, device=device, dtype=torch.bfloat16)  # [B, T]
        m = torch.ones(B, T, device=device, dtype=torch.bool)  # [B, T]
        impl = A._gae_csrc if backend == "csrc" else A._gae_triton
        return lambda: impl(r, v, m, 0.99, 0.95)

    return make


def _group(backend: str):
    def make(device: torch.device, tiny: bool) -> Callable[[], object]:
        s = torch.randn(256 if tiny else 1 << 20, device=device)  # [N]
        impl = A._group_csrc if backend == "csrc" else A._group_triton
        return lambda: impl(s, 16, None, "grpo", 1e-6)

    return make


def _whiten(path: str):
    """masked_whiten's CUDA kernels at B=1024 T=4096 float32, one path (RLKERNELS_WHITEN): "fused", the one
    cooperative kernel, or "passes" (partial moments, merge, apply: an H200 measured 10.3 + 4.2 + 9.9 us under ncu,
    NVIDIA_H200-2026-11-27-lease2.json)."""

    def make(device: torch.device, tiny: bool) -> Callable[[], object]:
        B, T = (4, 64) if tiny else (1024, 4096)
        x = torch.randn(B, T, device=device)  # [B, T]
        m = torch.rand(B, T, device=device) > 0.1  # [B, T]
        return harness.with_env(A.WHITEN_ENV, path, lambda: A._whiten_csrc(x, m, True, 1e-8))

    return make


def _policy(device: torch.device, tiny: bool) -> Callable[[], object]:
    B, T = (2, 37) if tiny else (256, 4096)
    logp = torch.randn(B, T, device=device).requires_grad_()  # [B, T]
    old = (logp.detach() + 0.1 * torch.randn(B, T, device=device))  # [B, T]
    adv = torch.randn(B, device=device)  # [B]
    mask = torch.rand(B, T, device=device) > 0.1  # [B, T]

    def step():
        loss, _ = rlkernels.policy_loss(logp, old, adv, mask, clip_high=0.28)
        return torch.autograd.grad(loss, [logp])

    return step


CASES = {
    "logprobs": _logprobs,  # fwd+bwd with entropy, N=8192 V=151936 bf16
    "logits_policy_loss": _logits_policy(False), "logits two-op": _logits_policy(True),  # N=8192 V=151936 bf16
    "logits cluster": _logits_policy(False, "cluster"),  # the csrc cluster kernel, the same size
    "gae csrc": _gae("csrc"), "gae triton": _gae("triton"),  # B=1024 T=4096 bf16
    "group csrc": _group("csrc"),  # 2^20 scores, groups of 16
    "whiten csrc": _whiten("fused"), "whiten csrc passes": _whiten("passes"),  # B=1024 T=4096 float32
    "policy_loss": _policy,  # PPO fwd+bwd, B=256 T=4096 float32
    "group triton": _group("triton"),  # late: under ncu it outlasted the part's share on the H100
    # last: their GEMM-sized kernels are replayed per section under ncu (see LINEAR_PROFILE_SIZE)
    "linear_logprobs": _linear,  # fwd+bwd with entropy, N=4096 H=4096 V=32768 bf16
    "linear_policy_loss": _linear_policy,  # fwd+bwd, the bench's options, N=4096 H=4096 V=32768 bf16
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small sizes, no profiler (the CPU dry run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    step = CASES[args.case](device, args.tiny)
    step()  # warm-up: compiles and the extension's build stay outside the profiled range
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled {args.case}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
