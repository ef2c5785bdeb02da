"""How many PyTorch ops and kernel launches one fwd+bwd call makes on the host (issue 14: on a GPU machine's host
each costs tens of microseconds, and logits_policy_loss measured host-bound there).

``python -m bench.cpu_op_count [--B 4] [--T 64] [--V 1000]``

On the CPU, with the Triton backend forced and every Triton launch replaced by a counter (nothing is computed: the
count is the point, and it does not depend on the values), ``torch.profiler`` records one warm fwd+bwd call of each
case; printed are the top-level ``aten::`` ops (those not called from inside another aten op: what Python issues,
each a dispatcher round trip and, on a GPU, a kernel launch unless it is a view) and the Triton launches by kernel.
The CPU-only label check (``labels`` in ``[0, V)``, which reads the values and costs no sync there) is among the
ops; on a GPU it is skipped. The cases: ``logits_policy_loss`` (its Triton row), and ``logprobs`` then
``policy_loss`` called as two ops (the same kernels).

No bound is printed: the floor is the kernels alone.
"""
from __future__ import annotations

import argparse
import collections
import contextlib

import torch


@contextlib.contextmanager
def counted_triton_launches(counts: collections.Counter):
    """Every Triton kernel launch in the block counted by kernel name, none run (outputs hold garbage)."""
    from rlkernels import _triton

    def launch(self, grid, *args, **kwargs):
        counts[self.fn.__name__] += 1

    saved = _triton.CompiledOrInterpreted.launch
    _triton.CompiledOrInterpreted.launch = launch
    try:
        yield counts
    finally:
        _triton.CompiledOrInterpreted.launch = saved


def cases(B: int, T: int, V: int) -> dict:
    import rlkernels

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g).to(torch.bfloat16).requires_grad_()  # [B, T, V]
    labels = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    old, adv, ref = (torch.randn(B, T, generator=g) for _ in range(3))  # [B, T] each
    mask = torch.ones(B, T, dtype=torch.bool)  # [B, T]

    def fused():
        loss, _ = rlkernels.logits_policy_loss(logits, labels, old, adv, mask, ref_logp=ref, kl_coef=0.05)
        loss.backward()

    def two_ops():
        logp = rlkernels.logprobs(logits, labels)  # [B, T]
        loss, _ = rlkernels.policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.05)
        loss.backward()

    return {"logits_policy_loss": fused, "logprobs + policy_loss": two_ops}


def count(fn) -> tuple[collections.Counter, collections.Counter]:
    """``(top-level aten ops by name, Triton launches by kernel)`` of one call of ``fn`` after a warm-up call."""
    from torch.profiler import ProfilerActivity, profile

    from rlkernels._backend import ENV_VAR
    from bench.harness import env_set

    launches = collections.Counter()
    with env_set(ENV_VAR, "triton"), counted_triton_launches(launches):
        fn()
        launches.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                              and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return ops, launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_op_count", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--V", type=int, default=1000)
    args = parser.parse_args(argv)
    print(f"fwd+bwd, B={args.B} T={args.T} V={args.V} bf16, Triton backend (launches counted, not run), torch "
          f"{torch.__version__}")
    print(f"{'case':<24} {'aten ops':>8} {'launches':>8}  kernels; most frequent ops")
    for name, fn in cases(args.B, args.T, args.V).items():
        ops, launches = count(fn)
        common = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in ops.most_common(6))
        print(f"{name:<24} {sum(ops.values()):>8} {sum(launches.values()):>8}  {', '.join(sorted(launches))}; {common}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
