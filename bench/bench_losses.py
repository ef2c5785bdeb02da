"""Fused RL losses, forward + backward: ``policy_loss`` (PPO with KL and entropy; GSPO), ``value_loss``, ``kl_penalty``.

All three are memory bound: a few FLOPs per token against 10-20 bytes per token.
The fewest bytes each must move (stated per case below) are its inputs read once
and its gradients written once, in the input dtype (bool mask: 1 byte/token):

- policy PPO  (adv [B, T], ref_logp, entropy): read logp, old_logp, adv, ref_logp, entropy, mask;
  write d logp, d ref_logp, d entropy  -> B·T·(8·s + 1) bytes, s = bytes per element
- policy GSPO (adv [B], no ref / entropy):       read logp, old_logp, mask, adv[B]; write d logp
  -> B·T·(3·s + 1) + B·s bytes
- value (clipped):                              read values, old_values, returns, mask; write d values
  -> B·T·(4·s + 1) bytes
- kl_penalty (k3):                              read logp, ref_logp; write kl (fp32), d logp, d ref_logp
  -> N·(4·s + 4) bytes

FLOPs (~20 per token for the policy loss, ~10 for value / KL) are negligible against the bytes.

Providers: ``eager`` (the formulas of ``rlkernels.reference``, as a user writes them),
``torch.compile`` of the same formulas, and ``rlkernels``.
"""
from __future__ import annotations

import torch

import rlkernels
from bench.harness import Case
from rlkernels import reference


def _grad_step(fn, grad_names):
    """One forward + backward of ``fn(**inputs)`` (loss or tensor) w.r.t. the named inputs."""

    def step(inputs):
        out = fn(**inputs)
        loss = out[0] if isinstance(out, tuple) else out.sum()
        return torch.autograd.grad(loss, [inputs[k] for k in grad_names])

    return step


def _providers(fn_ref, fn_fast, grad_names):
    compiled = torch.compile(fn_ref)
    return {
        "eager": _grad_step(fn_ref, grad_names),
        "torch.compile": _grad_step(compiled, grad_names),
        "rlkernels": _grad_step(fn_fast, grad_names),
    }


def _policy_inputs(B, T, dtype, device, *, per_seq_adv, with_extra):
    def make():
        g = torch.Generator(device=device).manual_seed(0)
        logp = -torch.rand(B, T, generator=g, device=device) * 3  # [B, T]
        old = logp + 0.3 * torch.randn(B, T, generator=g, device=device)  # [B, T]
        adv_shape = (B,) if per_seq_adv else (B, T)
        inputs = {
            "logp": logp.to(dtype).requires_grad_(),
            "old_logp": old.to(dtype),
            "advantages": torch.randn(*adv_shape, generator=g, device=device).to(dtype),  # [B] or [B, T]
            "mask": torch.rand(B, T, generator=g, device=device) > 0.1,  # [B, T]
        }
        if with_extra:
            inputs["ref_logp"] = (logp + 0.2 * torch.randn(B, T, generator=g, device=device)).to(dtype).requires_grad_()
            inputs["entropy"] = torch.rand(B, T, generator=g, device=device).to(dtype).requires_grad_()
        return (inputs,)

    return make


def cases(device: torch.device, quick: bool, shapes: list[tuple[int, int]] | None = None) -> list[Case]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    s = torch.finfo(dtype).bits // 8
    dname = str(dtype).replace("torch.", "")
    if shapes is not None:
        pass
    elif gpu:
        shapes = [(256, 4096)] if quick else [(256, 4096), (1024, 8192)]
    else:
        shapes = [(64, 1024)]
    out = []
    for B, T in shapes:
        n = B * T

        def ppo(fn):
            def call(logp, old_logp, advantages, mask, ref_logp, entropy):
                return fn(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy, kl_coef=0.05,
                          entropy_coef=0.01, clip_high=0.28)

            return call

        def gspo(fn):
            def call(logp, old_logp, advantages, mask):
                return fn(logp, old_logp, advantages, mask, ratio="sequence", clip_low=3e-4, clip_high=4e-4,
                          agg="seq-mean-token-mean")

            return call

        for name, wrap, per_seq, extra, grads, nbytes in [
            ("policy_loss PPO fwd+bwd", ppo, False, True, ("logp", "ref_logp", "entropy"), n * (8 * s + 1)),
            ("policy_loss GSPO fwd+bwd", gspo, True, False, ("logp",), n * (3 * s + 1) + B * s),
        ]:
            providers = _providers(wrap(reference.policy_loss), wrap(rlkernels.policy_loss), grads)
            out.append(Case(
                op=name, shape=f"B={B} T={T} {dname}", bytes_moved=nbytes, flops=20 * n, bound="memory",
                make_inputs=_policy_inputs(B, T, dtype, device, per_seq_adv=per_seq, with_extra=extra),
                providers=providers,
            ))

        def value_inputs(B=B, T=T):
            g = torch.Generator(device=device).manual_seed(1)
            v = torch.randn(B, T, generator=g, device=device)  # [B, T]
            return ({
                "values": v.to(dtype).requires_grad_(),
                "old_values": (v + 0.3 * torch.randn(B, T, generator=g, device=device)).to(dtype),
                "returns": (v + torch.randn(B, T, generator=g, device=device)).to(dtype),
                "mask": torch.rand(B, T, generator=g, device=device) > 0.1,
            },)

        def value(fn):
            return lambda values, old_values, returns, mask: fn(values, old_values, returns, mask, clip=0.2)

        providers = _providers(value(reference.value_loss), value(rlkernels.value_loss), ("values",))
        out.append(Case(
            op="value_loss fwd+bwd", shape=f"B={B} T={T} {dname}", bytes_moved=n * (4 * s + 1), flops=10 * n,
            bound="memory", make_inputs=value_inputs,
            providers=providers,
        ))

        def kl_inputs(B=B, T=T):
            g = torch.Generator(device=device).manual_seed(2)
            lp = -torch.rand(B, T, generator=g, device=device) * 3  # [B, T]
            return ({
                "logp": lp.to(dtype).requires_grad_(),
                "ref_logp": (lp + 0.2 * torch.randn(B, T, generator=g, device=device)).to(dtype).requires_grad_(),
            },)

        def kl(fn):
            return lambda logp, ref_logp: fn(logp, ref_logp, "k3")

        providers = _providers(kl(reference.kl_penalty), kl(rlkernels.kl_penalty), ("logp", "ref_logp"))
        out.append(Case(
            op="kl_penalty k3 fwd+bwd", shape=f"N={n} {dname}", bytes_moved=n * (4 * s + 4), flops=10 * n,
            bound="memory", make_inputs=kl_inputs,
            providers=providers,
        ))
    return out


def tiny_cases(device: torch.device) -> list[Case]:
    """``python -m bench --gpu --dry-run``: the same cases at a tiny, odd size (the code path, not a measurement)."""
    return cases(device, True, shapes=[(2, 37)])
