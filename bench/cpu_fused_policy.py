"""linear_policy_loss against linear_logprobs + policy_loss on the CPU, side by side, at any shape (issue 12).

``python -m bench.cpu_fused_policy [--N 4096 --H 576 --V 49152] [--dtype float32] [--rounds 3] [--chunks 32,100]``

fwd+bwd of the two steps of ``bench/bench_fused_policy.py`` ("rlkernels two-op" and "rlkernels": the clipped
surrogate with a k3 KL and an entropy bonus), timed round-robin (``harness.interleaved_samples_ms``), each with its
peak memory (``harness.measure_peak_bytes``: freed memory kept for reuse, as in ``python -m bench``). The op runs
the layout ``rlkernels.fused_policy._torch_layout`` picks for the shape; ``--chunks 32,100`` adds rows that force
its three-GEMM "chunks" layout with a tile budget of that many MiB, to show what three GEMMs would cost in time and
memory where the rule declines them. Bound: three GEMMs, ``6·N·H·V`` FLOPs (the two-op path does four).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench import harness
from bench.bench_fused_policy import _case
from rlkernels import fused_policy


def _forced_chunks(step, budget_mib: int):
    def run():
        layout, budget = fused_policy._torch_layout, fused_policy._CHUNK_BYTES
        fused_policy._torch_layout = lambda *a: "chunks"
        fused_policy._CHUNK_BYTES = budget_mib << 20
        try:
            return step()
        finally:
            fused_policy._torch_layout, fused_policy._CHUNK_BYTES = layout, budget

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_fused_policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--H", type=int, default=576)
    p.add_argument("--V", type=int, default=49152)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3, help="timed samples per step (at least)")
    p.add_argument("--chunks", default="", help="comma-separated MiB budgets of forced three-GEMM chunk rows")
    args = p.parse_args(argv)
    harness.keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    case = _case(args.N, args.H, args.V, dtype, cpu, only=("rlkernels two-op", "rlkernels"))
    inputs = case.make_inputs()
    steps = {name: (lambda f=f: f(*inputs)) for name, f in case.providers.items()}
    for mib in filter(None, args.chunks.split(",")):
        steps[f"rlkernels chunks {mib} MiB"] = _forced_chunks(steps["rlkernels"], int(mib))
    hidden, weight = inputs[0], inputs[1]
    opt_layout = fused_policy._torch_layout(hidden, weight, fused_policy._validate(
        head_input=hidden, head_name="hidden", weight=weight, labels=inputs[2], bias=None, old_logp=inputs[3],
        advantages=inputs[4], mask=inputs[5], ref_logp=inputs[6], temperature=1.0, ignore_index=-100,
        return_entropy=False, policy_kwargs=dict(clip_low=0.2, clip_high=None, dual_clip=None, ratio="token",
                                                 kl_coef=0.04, kl_estimator="k3", entropy_coef=0.01,
                                                 agg="token-mean", norm_length=None), grads=(True, True, False)))
    peaks = {name: harness.measure_peak_bytes(step, cpu) for name, step in steps.items()}
    timing = harness.Timing(min_samples=args.rounds, samples=args.rounds, budget_s=0.0)
    samples = harness.interleaved_samples_ms(steps, timing)
    print(f"linear_policy_loss fwd+bwd, {case.shape}, {torch.get_num_threads()} threads, layout {opt_layout!r}; "
          f"other processes used {harness.OTHER_LOAD.fraction():.0%} of the CPU while timed")
    base = statistics.median(samples["rlkernels two-op"])
    flops = case.flops
    for name, ms in samples.items():
        med = statistics.median(ms)
        print(f"  {name:24s} median {med:9.1f} ms  {flops / med / 1e6:6.0f} GFLOP/s (three-GEMM FLOPs)  "
              f"peak {peaks[name] / 2**20:7.1f} MiB  {base / med:.2f}x the two-op path  "
              f"samples {' '.join(f'{x:.0f}' for x in ms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
