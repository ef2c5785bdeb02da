"""How much error a 16-bit ``d_weight`` summed over chunks of tokens would add (issue 12's open trade), emulated on the CPU.

``python -m bench.cpu_chunk_rounding [--shapes 4096x64x512,8192x32x1024] [--seeds 3]``

``linear_policy_loss``'s Triton row sums ``d_weight`` over chunks of tokens in a float32 ``[V, H]`` buffer when the
tokens take more than one chunk (7 at the contract's N = 8192, V = 151936); for 16-bit weights that buffer sits
beside the gradient, which DESIGN's numerics rule out. The way out that keeps three GEMMs and no extra memory sums
in the weight's own dtype instead: each chunk's GEMM accumulates in float32 and the running sum is rounded to bf16
after every chunk. This script measures what that costs in accuracy, in float64 arithmetic around the same
roundings, at shapes small enough for the CPU (the error of a running sum depends on the number of chunks K and on
the rounding unit, not on V or H):

- truth: ``d_weight = dzᵀ h`` in float64, with ``dz = coef · (softmax(h Wᵀ) - onehot(y))`` (per-token coefficients
  like a policy loss's, bf16 ``h`` and ``W``);
- eager: what ``linear_logprobs`` + autograd does in bf16 -- dz rounded to bf16, one GEMM with float32
  accumulation, one rounding of the result;
- float32 accumulator: each chunk's float32 GEMM summed in float32, rounded once (today's Triton row);
- bf16 running sum: each chunk's float32 GEMM added to a bf16 running sum, rounded after every chunk.

Printed per variant: the largest error over ``max |truth|`` and the relative Frobenius error (medians over seeds),
and the Frobenius error as a multiple of eager's (the tests hold the op's gradients to at most 1.5x eager's error).
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch


def _errors(shape: tuple[int, int, int], seed: int, chunk_counts: tuple[int, ...]) -> dict[str, tuple[float, float]]:
    N, H, V = shape
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).bfloat16()  # [N, H]
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).bfloat16()  # [V, H]
    y = torch.randint(0, V, (N,), generator=g)  # [N]
    coef = torch.randn(N, generator=g, dtype=torch.float64) / N  # [N] a mean-aggregated loss's per-token weight
    dz = torch.softmax(h.double() @ w.double().T, -1)  # [N, V] float64
    dz[torch.arange(N), y] -= 1
    dz *= coef[:, None]
    truth = dz.T @ h.double()  # [V, H] float64

    def error(x: torch.Tensor) -> tuple[float, float]:
        diff = x.double() - truth  # [V, H]
        return (diff.abs().max() / truth.abs().max()).item(), (diff.norm() / truth.norm()).item()

    dz32 = dz.float()  # [N, V] what the kernels form
    out = {"eager (dz in bf16, one GEMM)": error((dz32.bfloat16().float().T @ h.float()).bfloat16())}
    for K in chunk_counts:
        bounds = [round(i * N / K) for i in range(K + 1)]
        acc32 = torch.zeros(V, H)  # [V, H] float32
        acc16 = torch.zeros(V, H, dtype=torch.bfloat16)  # [V, H] bf16
        for a, b in zip(bounds, bounds[1:]):
            part = dz32[a:b].T @ h[a:b].float()  # [V, H] one chunk's GEMM, float32 accumulation
            acc32 += part
            acc16 = (acc16.float() + part).bfloat16()
        out[f"K={K:2d} float32 accumulator"] = error(acc32.bfloat16())
        out[f"K={K:2d} bf16 running sum"] = error(acc16)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_chunk_rounding", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x64x512,8192x32x1024", help="N x H x V, comma-separated")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--chunks", default="1,2,4,7,8,16", help="chunk counts K")
    args = p.parse_args(argv)
    chunk_counts = tuple(int(k) for k in args.chunks.split(","))
    for text in args.shapes.split(","):
        shape = tuple(int(d) for d in text.split("x"))
        runs = [_errors(shape, seed, chunk_counts) for seed in range(args.seeds)]
        eager = statistics.median(r["eager (dz in bf16, one GEMM)"][1] for r in runs)
        print(f"N={shape[0]} H={shape[1]} V={shape[2]}, bf16, medians over {args.seeds} seeds")
        print(f"  {'variant':32s} {'max err / max|truth|':>21s} {'Frobenius rel.':>15s} {'x eager':>8s}")
        for name in runs[0]:
            largest = statistics.median(r[name][0] for r in runs)
            frobenius = statistics.median(r[name][1] for r in runs)
            print(f"  {name:32s} {largest:21.3e} {frobenius:15.3e} {frobenius / eager:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
