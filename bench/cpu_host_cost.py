"""The fixed host cost of one call of each loss op, on the CPU at tiny shapes (issue 14: the losses are launch-bound).

``python -m bench.cpu_host_cost [--rounds 7] [--calls 500] [--device cpu]``

Written for the CPU machine; ``--device cuda`` runs the same on a GPU machine's host (``make gpu PART=profile``
does, into the record's ``host_cost``), each call then ending with a ``torch.cuda.synchronize()``.

At ``B = 2, T = 8`` (``H = 16, V = 64`` for the ops with a head) the arithmetic is negligible and a fwd+bwd call
measures what every call pays on any device before and after its kernels: validation, the op's
``torch.autograd.Function``, the Python around its body. Each op's fwd+bwd is timed round-robin with the others
(``harness.interleaved_samples_ms``), median per call; beside it the time spent inside torch's
``torch._library.utils.fill_defaults``, which torch.library's autograd wrapper (``register_autograd``) runs on every
call and which grows with the square of the op's schema length (0 now that eager calls skip the dispatcher; measured
by wrapping the function with a ``perf_counter`` accumulator for ``--calls`` further calls of each op).

Timings of separate processes on this machine differ by up to 1.5x (the same code measured 1263 and 1822 us per
policy_loss call in two runs), more than the changes being measured, so two more tables compare paths inside one
process, round-robin: a trivial op (a sum and a copy, saved for a backward) per options class, with torch.library's
autograd and one schema argument per option (as before 2026-11-27), with the typed lists of ``op_schema``, and as the
package calls its ops now (``rlkernels._host.autograd_function``: a Function over the body); and policy_loss's own op
through torch.library's autograd (its path before) against its autograd.Function.

No bound is printed: the floor is zero host time, and the GPU-side figure (the call's wall time on the device) is
what ``make gpu`` measures. Run it against another checkout with ``PYTHONPATH=<tree>`` to compare two versions.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench import harness


def _cases():
    import rlkernels

    torch.manual_seed(0)
    B, T, H, V = 2, 8, 16, 64
    logp = torch.randn(B, T, requires_grad=True)  # [B, T]
    old, adv, ref = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)  # [B, T] x3
    mask = torch.ones(B, T)  # [B, T]
    hidden = torch.randn(B, T, H, requires_grad=True)  # [B, T, H]
    weight = torch.randn(V, H, requires_grad=True)  # [V, H]
    labels = torch.randint(0, V, (B, T))  # [B, T]
    logits = torch.randn(B, T, V, requires_grad=True)  # [B, T, V]
    policy = dict(ref_logp=ref, kl_coef=0.1)
    return {
        "policy_loss": lambda: rlkernels.policy_loss(logp, old, adv, mask, **policy)[0].backward(),
        "value_loss": lambda: rlkernels.value_loss(logp, old, adv, mask, clip=0.2)[0].backward(),
        "kl_penalty": lambda: rlkernels.kl_penalty(logp, ref).sum().backward(),
        "logprobs": lambda: rlkernels.logprobs(logits, labels)[0].sum().backward(),
        "linear_logprobs": lambda: rlkernels.linear_logprobs(hidden.view(-1, H), weight,
                                                             labels.view(-1))[0].sum().backward(),
        "logits_policy_loss": lambda: rlkernels.logits_policy_loss(logits, labels, old, adv, mask,
                                                                   **policy)[0].backward(),
        "linear_policy_loss": lambda: rlkernels.linear_policy_loss(hidden, weight, labels, old, adv, mask,
                                                                   **policy)[0].backward(),
    }


def _fill_defaults_us(step, calls: int = 500) -> float:
    """Microseconds per call of ``step`` spent in torch's ``fill_defaults`` (looked up by the autograd wrapper at
    call time, so replacing the module attribute reaches it)."""
    import torch._library.utils as library_utils

    spent = [0.0]
    original = library_utils.fill_defaults

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    library_utils.fill_defaults = timed
    try:
        for _ in range(calls):
            step()
    finally:
        library_utils.fill_defaults = original
    return spent[0] / calls * 1e6


_WIDE_TYPES = {"float": "float", "float | None": "float?", "int": "int", "bool": "bool", "str": "str"}


_PAIRS: dict = {}


def _schema_pairs(tensors: int = 6):
    """For policy_loss's and linear_policy_loss's options: the same trivial autograd op with ``tensors`` tensor
    arguments and its options either one schema argument per field ("per option") or as ``op_schema``'s lists.
    Built once per process (an op name registers once)."""
    if _PAIRS:
        return _PAIRS
    import dataclasses

    from rlkernels import _host
    from rlkernels._host import op_schema, option_values
    from rlkernels.fused_policy import FusedPolicyOptions
    from rlkernels.losses import PolicyOptions

    x = torch.randn(2, 8, requires_grad=True)  # [2, 8]
    others = [torch.randn(2, 8) for _ in range(tensors - 1)]  # [2, 8] each
    head = ", ".join(f"Tensor t{i}" for i in range(tensors))
    steps = {}
    for opt in (PolicyOptions(0.2, 0.2, None, "token", 0.1, "k3", 0.0, "token-mean", None),
                FusedPolicyOptions(1.0, -100, False, 0.2, 0.2, None, "token", 0.1, "k3", 0.0, "token-mean", None,
                                   True, True, False)):
        fields = dataclasses.fields(opt)
        wide = ", ".join(f"{_WIDE_TYPES[str(f.type)]} {f.name}" for f in fields)
        for kind, schema, args in (
                ("per option", f"({head}, {wide}) -> (Tensor, Tensor)", [getattr(opt, f.name) for f in fields]),
                ("lists", op_schema(head, type(opt), "(Tensor, Tensor)"), list(option_values(opt)))):
            name = f"rlkernels_bench::{type(opt).__name__.lower()}_{kind.replace(' ', '_')}"
            op = torch.library.custom_op(name, lambda t0, *rest: (t0.sum(), t0.clone()), mutates_args=(),
                                         schema=schema)
            op.register_fake(lambda t0, *rest: (t0.new_empty(()), torch.empty_like(t0)))
            n_inputs = tensors + len(args)

            def setup(ctx, inputs, output):
                ctx.save_for_backward(output[1])

            def backward(ctx, g, _unused, n_inputs=n_inputs):
                return (ctx.saved_tensors[0] * g,) + (None,) * (n_inputs - 1)

            op.register_autograd(backward, setup_context=setup)
            steps[f"{type(opt).__name__} {kind} ({n_inputs} arguments)"] = (
                lambda op=op, args=args: op(x, *others, *args)[0].backward())
        # the package's path since 2026-11-27 (second stop): the same op's autograd as a torch.autograd.Function
        # whose forward calls the body directly in eager mode (rlkernels._host.call)
        name = f"rlkernels_bench::{type(opt).__name__.lower()}_function"
        op = _host.custom_op(name, schema=op_schema(head, type(opt), "(Tensor, Tensor)"))(
            lambda t0, *rest: (t0.sum(), t0.clone()))
        op.register_fake(lambda t0, *rest: (t0.new_empty(()), torch.empty_like(t0)))
        function = _host.autograd_function("Trivial", op, lambda ctx, inputs, output: ctx.save_for_backward(output[1]),
                                           lambda ctx, g, _unused: (ctx.saved_tensors[0] * g,))
        args = list(option_values(opt))
        steps[f"{type(opt).__name__} lists, autograd.Function ({tensors + len(args)} arguments)"] = (
            lambda function=function, args=args: function.apply(x, *others, *args)[0].backward())
    _PAIRS.update(steps)
    return steps


def _policy_loss_paths():
    """policy_loss's fwd+bwd at tiny shapes through the package's path (``_PolicyLoss``, a torch.autograd.Function
    over the op's body) and through the path it had before: a custom op with the same schema and body whose
    autograd is torch.library's (``register_autograd``, the same setup and backward, the backward calling
    ``scale_rows`` through the dispatcher). Registered under ``rlkernels_bench::`` once per process (eager calls
    only: no fake implementation), leaving the package's own ops as they are."""
    from rlkernels import _host, losses
    from rlkernels._host import option_values

    if "policy" not in _PATHS:
        schema = str(torch.ops.rlkernels.policy_loss.default._schema)
        op = torch.library.custom_op("rlkernels_bench::policy_loss_dispatcher", _host._BODIES[losses._policy_op],
                                     mutates_args=(), schema=schema[schema.index("("):])

        def dispatcher_backward(ctx, d_loss, *_unused):
            g_logp, g_ref, _g_ent, w = ctx.saved_tensors  # [B, T] fp32 x2, [0], [B]
            grad_logp, grad_ref, _ = losses._scale_rows_op(d_loss, w, g_logp, g_ref, None, *ctx.dtypes)
            return (grad_logp, None, None, None, grad_ref, None) + (None,) * ctx.n_lists

        def setup(ctx, inputs, output):
            ctx.n_lists = len(inputs) - 6
            losses._policy_setup(ctx, inputs, output)

        op.register_autograd(dispatcher_backward, setup_context=setup)
        _PATHS["policy"] = op
    op = _PATHS["policy"]
    torch.manual_seed(0)
    B, T = 2, 8
    logp = torch.randn(B, T, requires_grad=True)  # [B, T]
    old, adv, ref = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)  # [B, T] x3
    mask = torch.ones(B, T, dtype=torch.bool)  # [B, T]
    opt = losses.PolicyOptions(0.2, 0.2, None, "token", 0.1, "k3", 0.0, "token-mean", None)
    args = (logp, old, adv, mask, ref, None, *option_values(opt))
    return {"custom op's autograd (before)": lambda: op(*args)[0].backward(),
            "autograd.Function (now)": lambda: losses._PolicyLoss.apply(*args)[0].backward()}


_PATHS: dict = {}


def _print_row(name: str, width: int, samples_ms: list[float], fill_defaults_us: float) -> None:
    us = sorted(m * 1e3 for m in samples_ms)  # per-call microseconds, one per round
    print(f"{name:{width}s} {us[len(us) // 2]:10.1f} {us[0]:8.1f} {us[-1]:8.1f} {fill_defaults_us:20.1f}")


def _synced(steps: dict, device: torch.device) -> dict:
    """On CUDA each call ends with ``torch.cuda.synchronize()``: a call's time then holds its kernels and one sync
    (the same few microseconds on every row), and no queue of launches builds up ahead of the device."""
    if device.type != "cuda":
        return steps
    return {name: (lambda step=step: (step(), torch.cuda.synchronize())) for name, step in steps.items()}


def _table(title: str, head: str, width: int, steps: dict, timing, calls: int) -> None:
    for step in steps.values():  # warm-up: first-call costs (imports, caches, compiles) out of the samples
        for _ in range(min(20, calls)):
            step()
    samples = harness.interleaved_samples_ms(steps, timing)
    print(title)
    print(f"{head:{width}s} {'median us':>10s} {'min us':>8s} {'max us':>8s} {'in fill_defaults us':>20s}")
    for name, step in steps.items():
        _print_row(name, width, samples[name], _fill_defaults_us(step, calls))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_host_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="timed rounds of every op (default 7)")
    p.add_argument("--calls", type=int, default=500, help="calls of each op timed for the fill_defaults column")
    p.add_argument("--device", default="cpu", help="where the tensors live (default cpu; `make gpu PART=profile` "
                                                    "runs it with cuda: the GPU machine's host)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    with torch.device(device):  # the inputs only: no device context while timed
        steps, pairs, paths = _cases(), _schema_pairs(), _policy_loss_paths()
    timing = harness.Timing(samples=args.rounds, min_samples=args.rounds, budget_s=0.0)
    on = f"{device.type} tensors" + (f" ({torch.cuda.get_device_name(device)}, each call synchronized)"
                                     if device.type == "cuda" else "")
    _table(f"fwd+bwd per call at tiny shapes on {on}, {torch.get_num_threads()} threads, torch {torch.__version__}",
           "op", 20, _synced(steps, device), timing, args.calls)
    print(f"(other processes used {harness.OTHER_LOAD.fraction():.0%} of the CPU while timed)")
    _table("\nthe dispatch alone: a trivial autograd op (6 tensors) with each options class, in this process, "
           "round-robin", "op", 58, _synced(pairs, device), timing, args.calls)
    _table("\npolicy_loss's op (B=2, T=8, ref_logp, kl_coef) fwd+bwd through each autograd path, round-robin", "path",
           48, _synced(paths, device), timing, args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
