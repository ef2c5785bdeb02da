"""linear_logprobs' CPU (torch) path against eager, side by side, quiet and loaded (issue 13, item 6).

``python -m bench.cpu_linear_logprobs [--N 2048 --H 576 --V 49152] [--dtype float32] [--rounds 5] [--load]``

float32 forward+backward with the entropy at SmolLM2's head by default. Both steps are the ones of
``bench/bench_fused_linear.py`` (eager: ``hidden @ W.T``, ``log_softmax``, gather, entropy, autograd), timed
round-robin (``harness.interleaved_samples_ms``: the starting step rotates each round) with freed memory kept for
reuse as in ``python -m bench``. ``--load`` starts one busy-looping process (``while True: pass``) for the whole
measurement, so another process holds one core; the other processes' share of the CPU while samples were timed is
printed either way (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

from bench import harness
from bench.bench_fused_linear import _rlkernels, _step, eager_linear_logprobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_linear_logprobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--N", type=int, default=2048)
    p.add_argument("--H", type=int, default=576)
    p.add_argument("--V", type=int, default=49152)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5, help="timed samples per step (at least)")
    p.add_argument("--load", action="store_true", help="a busy-looping process runs meanwhile")
    args = p.parse_args(argv)
    harness.keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    N, H, V = args.N, args.H, args.V
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()  # [N, H]
    weight = (torch.randn(V, H, generator=g) * H**-0.5).to(dtype).requires_grad_()  # [V, H]
    labels = torch.randint(0, V, (N,), generator=g)  # [N]
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)  # [N] each
    inputs = (hidden, weight, labels, g_logp, g_ent)
    steps = {"eager": lambda: _step(eager_linear_logprobs)(*inputs), "rlkernels": lambda: _step(_rlkernels)(*inputs)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    try:
        timing = harness.Timing(min_samples=args.rounds, samples=args.rounds, budget_s=0.0)
        samples = harness.interleaved_samples_ms(steps, timing)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    load = os.getloadavg()
    print(f"linear_logprobs fwd+bwd with entropy, N={N} H={H} V={V} {args.dtype}, {torch.get_num_threads()} threads, "
          f"{'loaded (one busy-looping process)' if args.load else 'no added load'}; "
          f"other processes used {harness.OTHER_LOAD.fraction():.0%} of the CPU while timed; "
          f"load average after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name, ms in samples.items():
        print(f"  {name:10s} median {statistics.median(ms):9.1f} ms   samples {' '.join(f'{x:.0f}' for x in ms)}")
    ratio = statistics.median(samples["eager"]) / statistics.median(samples["rlkernels"])
    pairs = statistics.median(e / r for e, r in zip(samples["eager"], samples["rlkernels"]))
    print(f"  rlkernels speed vs eager: {ratio:.2f}x (medians), {pairs:.2f}x (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
