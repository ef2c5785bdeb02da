"""``python -m bench.memcheck [--device cuda]``: run one small case of every kernel once, for a memory checker.

``python -m bench --gpu --part memcheck`` runs this script under ``compute-sanitizer --tool memcheck`` (with
PyTorch's caching allocator off, so every tensor is its own ``cudaMalloc`` and a read past a tensor's end is
outside any allocation) and asserts the sanitizer reports 0 errors. Each case is forward + backward where the op
has a backward, once per backend that runs its own kernels on the device (``triton``; ``csrc`` for the
advantage ops), with odd sizes so the kernels' masked tails are exercised, plus out-of-range labels, which must
give NaN on a GPU and never be read as an index. On the CPU (``--dry-run``) the same cases run without the
sanitizer (Triton under its interpreter), which checks the script itself.

Prints one line per case (``ok <backend> <case>``) and exits non-zero if a case raised or gave a wrong kind of
result (a non-finite value where every input was valid, a finite log-prob for an out-of-range label).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import rlkernels
from bench.harness import env_set
from rlkernels import _extension
from rlkernels import advantages as A

V, H = 1000, 24  # odd vocabulary (not a multiple of any block) and hidden size
B, T = 3, 37  # [B, T] token layout; N = B * T rows


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


def _backward(outputs, leaves) -> list[torch.Tensor]:
    """Gradients of every output (random upstream gradients) with respect to ``leaves``."""
    outputs = [o for o in outputs if o is not None and o.requires_grad]
    grads = [torch.randn_like(o) for o in outputs]
    return list(torch.autograd.grad(outputs, leaves, grads, allow_unused=True))


def _finite(*tensors) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def cases(device: torch.device) -> dict[str, Callable[[], bool]]:
    """Name -> a call that runs the op once (forward + backward) and says whether its result is sane."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    N = B * T
    labels = torch.randint(0, V, (N,), generator=g).to(device)  # [N]
    labels[5] = -100  # one ignored row
    mask = (torch.rand(B, T, generator=g) > 0.2).to(device)  # [B, T]
    mask[1] = False  # an empty row

    def logprobs():
        logits = _leaf(rand(N, V, dtype=torch.bfloat16) * 3)  # [N, V]
        logp, ent = rlkernels.logprobs(logits, labels, temperature=0.7, return_entropy=True)  # [N] x2
        return _finite(logp, ent, *_backward([logp, ent], [logits]))

    def logprobs_out_of_range():
        logits = rand(N, V)  # [N, V]
        bad = labels.clone()  # [N]
        bad[0], bad[1] = V, V + 1000  # past the vocabulary
        try:
            logp = rlkernels.logprobs(logits, bad)  # [N]
        except (ValueError, IndexError, RuntimeError) as error:  # the CPU checks labels on the host and raises
            return device.type == "cpu" and "label" in str(error).lower()
        return bool(torch.isnan(logp[:2]).all()) and _finite(logp[2:])

    def linear_logprobs():
        hidden = _leaf(rand(N, H, dtype=torch.bfloat16))  # [N, H]
        weight = _leaf(rand(V, H, dtype=torch.bfloat16) * H**-0.5)  # [V, H]
        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, return_entropy=True)  # [N] x2
        return _finite(logp, ent, *_backward([logp, ent], [hidden, weight]))

    def linear_policy_loss():
        hidden = _leaf(rand(B, T, H))  # [B, T, H]
        weight = _leaf(rand(V, H) * H**-0.5)  # [V, H]
        old = -torch.rand(B, T, generator=g).to(device) * 2 - 6  # [B, T]
        loss, _ = rlkernels.linear_policy_loss(hidden, weight, labels.view(B, T), old, rand(B, T), mask,
                                               ref_logp=old + 0.1 * rand(B, T), kl_coef=0.04, entropy_coef=0.01)
        return _finite(loss, *_backward([loss], [hidden, weight]))

    def logits_policy_loss():
        logits = _leaf(rand(B, T, V))  # [B, T, V]
        old = -torch.rand(B, T, generator=g).to(device) * 2 - 6  # [B, T]
        loss, _ = rlkernels.logits_policy_loss(logits, labels.view(B, T), old, rand(B), mask, ratio="sequence",
                                               clip_low=3e-4, clip_high=4e-4)
        return _finite(loss, *_backward([loss], [logits]))

    def logits_policy_loss_token():
        logits = _leaf(rand(B, T + 1, V, dtype=torch.bfloat16) * 3)[:, :-1]  # [B, T, V] rows at two strides
        old = -torch.rand(B, T, generator=g).to(device) * 2 - 6  # [B, T]
        loss, _ = rlkernels.logits_policy_loss(logits, labels.view(B, T), old, rand(B, T), mask, dual_clip=3.0,
                                               ref_logp=old + 0.1 * rand(B, T), kl_coef=0.04, entropy_coef=0.01)
        return _finite(loss, *_backward([loss], [logits]))

    def logits_policy_loss_cluster():  # the csrc cluster kernel (RLKERNELS_LOGITS_POLICY=cluster)
        from bench.harness import env_set
        from rlkernels import fused_policy

        V2 = 49152  # 96 KB of bf16 a row: clusters of two blocks on Hopper (before it the pair runs)
        logits = _leaf(rand(B, T, V2, dtype=torch.bfloat16) * 3)  # [B, T, V2]
        tokens = torch.randint(0, V2, (B, T), generator=g).to(device)  # [B, T]
        old = -torch.rand(B, T, generator=g).to(device) * 2 - 6  # [B, T]
        with env_set(fused_policy.LOGITS_ROW_ENV, "cluster"):
            loss, _ = rlkernels.logits_policy_loss(logits, tokens, old, rand(B, T), mask, dual_clip=3.0,
                                                   ref_logp=old + 0.1 * rand(B, T), kl_coef=0.04, entropy_coef=0.01)
        return _finite(loss, *_backward([loss], [logits]))

    def policy_loss():
        logp = _leaf(-torch.rand(B, T, generator=g).to(device) * 3)  # [B, T]
        ref, ent = _leaf(logp.detach() + 0.2 * rand(B, T)), _leaf(rand(B, T).abs())  # [B, T] x2
        loss, _ = rlkernels.policy_loss(logp, logp.detach() + 0.3 * rand(B, T), rand(B, T), mask, ref_logp=ref,
                                        kl_coef=0.05, entropy=ent, entropy_coef=0.01, clip_high=0.28)
        return _finite(loss, *_backward([loss], [logp, ref, ent]))

    def value_loss():
        values = _leaf(rand(B, T))  # [B, T]
        loss, _ = rlkernels.value_loss(values, values.detach() + 0.3 * rand(B, T), rand(B, T), mask, clip=0.2)
        return _finite(loss, *_backward([loss], [values]))

    def kl_penalty():
        logp, ref = _leaf(-rand(N).abs()), _leaf(-rand(N).abs())  # [N] x2
        kl = rlkernels.kl_penalty(logp, ref, "k3")  # [N]
        return _finite(kl, *_backward([kl], [logp, ref]))

    def gae():
        adv, ret = rlkernels.gae(rand(B, T), rand(B, T), mask, gamma=0.99, lam=0.95)  # [B, T] x2
        return _finite(adv, ret)

    def group_advantages():
        return _finite(rlkernels.group_advantages(rand(16 * 37), 16))  # [592]

    def masked_whiten():
        return _finite(rlkernels.masked_whiten(rand(B, T), mask))  # [B, T]

    def masked_whiten_passes():  # the CUDA kernels' other path (the default is one cooperative kernel)
        with env_set(A.WHITEN_ENV, "passes"):
            return masked_whiten()

    return {
        "logprobs bf16 fwd+bwd": logprobs,
        "logprobs out-of-range labels -> NaN": logprobs_out_of_range,
        "linear_logprobs bf16 fwd+bwd": linear_logprobs,
        "linear_policy_loss fwd+bwd": linear_policy_loss,
        "logits_policy_loss GSPO fwd+bwd": logits_policy_loss,
        "logits_policy_loss PPO bf16 fwd+bwd": logits_policy_loss_token,
        "logits_policy_loss cluster bf16 fwd+bwd": logits_policy_loss_cluster,
        "policy_loss PPO fwd+bwd": policy_loss,
        "value_loss fwd+bwd": value_loss,
        "kl_penalty k3 fwd+bwd": kl_penalty,
        "gae": gae,
        "group_advantages": group_advantages,
        "masked_whiten": masked_whiten,
        "masked_whiten passes": masked_whiten_passes,
    }


CSRC_CASES = ("gae", "group_advantages", "masked_whiten", "masked_whiten passes")  # the ops with a csrc kernel


def backends(device: torch.device) -> list[str]:
    """The backends that run their own kernels on ``device`` (``torch`` and ``reference`` are PyTorch's)."""
    out = ["triton"]
    if _extension.load() is not None and (device.type == "cpu" or _extension.has_cuda_kernels()):
        out.append("csrc")
    return out


def run(device: torch.device, only: str = "") -> list[str]:
    """Run every case (or those whose name starts with one of the comma-separated ``only``) once per backend;
    returns the names of the cases that failed (printed as they run)."""
    from tests.helpers import forced_backend

    wanted = tuple(x.strip() for x in only.split(",") if x.strip())
    failed = []
    for backend in backends(device):
        for name, case in cases(device).items():
            if (backend == "csrc" and name not in CSRC_CASES) or (wanted and not name.startswith(wanted)):
                continue
            try:
                with forced_backend(backend):
                    ok = case()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                status = "ok" if ok else "WRONG"
            except Exception as error:  # reported per case: the other kernels still run under the sanitizer
                status = f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            print(f"{status} {backend} {name}", flush=True)
            if status != "ok":
                failed.append(f"{backend} {name}")
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="", help="comma-separated case name prefixes, e.g. gae,logprobs (default: all)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    failed = run(torch.device(args.device), args.only)
    print(f"memcheck cases: {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
