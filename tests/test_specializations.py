"""The compiled variants a GPU would build for each Triton kernel, across the shapes an RL trainer's steps bring.

Triton compiles a kernel once per specialization of its arguments (each integer's "is 1" / "divisible by 16"
class, each pointer's 16-byte alignment, the constexpr values), and a new variant of a Hopper GEMM kernel costs
seconds in whatever step first needs it. The ops' own workspaces (the forward kernels' per-split partials, the
backward's per-row statistics) start 16-byte aligned whatever the token count, so over many shapes with freshly
allocated inputs each kernel's pointers keep one alignment class. The GEMM kernels of the linear heads (seconds
to compile) do not specialize their token count (fused_linear.UNSPECIALIZED_ROWS: it only bounds their rows), so
they compile once per use whatever the shapes. (The memory-bound kernels keep their sizes' divisibility
specialization: their masked loads vectorize only with it -- marking them unspecialized made the logprobs and
whitening kernels' loads scalar in the sm_90 AOT build, 2026-11-27 -- so a token count turning divisible by 16
may still compile one more variant of those, each a fraction of a second.) The keys are Triton's own
(rlkernels.testing.specializations: its binder for an sm_90 target); the kernels run under the interpreter."""
from __future__ import annotations

import pytest
import torch

import rlkernels
from tests.helpers import forced_backend

pytest.importorskip("triton")
from rlkernels.testing.specializations import record_specializations  # noqa: E402

# (B, T): B = 1, T = 1, sizes divisible by 16 and not, odd offsets of the chunks in between
SHAPES = [(2, 19), (3, 16), (1, 37), (4, 12), (2, 33), (1, 1), (5, 32)]


def _calls(B, T, H, V, w, g):
    h = torch.randn(B, T, H, generator=g, dtype=torch.bfloat16).requires_grad_()  # [B, T, H]
    labels = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    old = -torch.rand(B, T, generator=g) * 4 - 6  # [B, T]
    adv = torch.randn(B, T, generator=g)  # [B, T]
    mask = torch.rand(B, T, generator=g) > 0.2  # [B, T]
    ref = old + 0.1  # [B, T]
    rlkernels.linear_policy_loss(h, w, labels, old, adv, mask, ref_logp=ref, kl_coef=0.05)[0].backward()
    rlkernels.linear_policy_loss(h, w, labels, old, adv[:, 0], mask, ratio="sequence", entropy_coef=0.01)[0].backward()
    logp, ent = rlkernels.linear_logprobs(h, w, labels, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    logits = torch.randn(B, T, V, generator=g, dtype=torch.bfloat16).requires_grad_()  # [B, T, V]
    logp, ent = rlkernels.logprobs(logits, labels, return_entropy=True)
    loss = rlkernels.policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.05, entropy=ent)[0]
    loss = loss + rlkernels.value_loss(logp, old, adv, mask)[0] + rlkernels.kl_penalty(logp, ref).sum()
    loss.backward()
    rlkernels.logits_policy_loss(logits.detach().requires_grad_(), labels, old, adv, mask, ref_logp=ref)[0].backward()
    if V % 16 == 0:
        # a causal LM's logits shifted by one ([:, :-1]): sequences (T + 1)·V apart. The kernels keep that stride
        # specialized (with the row stride V, it makes rows 16-byte aligned: vector loads); it varies with T only
        # where V is not a multiple of 16 (rows never aligned: two variants there, accepted)
        shifted = torch.randn(B, T + 1, V, generator=g, dtype=torch.bfloat16).requires_grad_()  # [B, T + 1, V]
        rlkernels.logprobs(shifted[:, :-1], labels).sum().backward()
        rlkernels.logits_policy_loss(shifted.detach()[:, :-1].requires_grad_(), labels, old, adv, mask)[0].backward()
    rlkernels.masked_whiten(adv, mask)
    rlkernels.group_advantages(torch.randn(B * 4, generator=g), 4)


def _gemm_kernels() -> dict:
    """The GEMM kernels by name: their token count is not specialized (fused_linear.UNSPECIALIZED_ROWS)."""
    from rlkernels import fused_linear

    kernels = (fused_linear._fwd_kernel, fused_linear._fwd_kernel_tma, fused_linear._dz_kernel,
               fused_linear._dz_kernel_tma, fused_linear._dz_from_tile_kernel)
    return {k.fn.__name__: k for k in kernels}


# the linear heads' forward kernel (tma: sm_90's default; cublas: cuBLAS GEMMs, the logprobs and tile kernels)
@pytest.mark.parametrize("forward", ["split", "tma", "cublas"])
@pytest.mark.parametrize("V", [1000, 1024])  # one model's vocabulary: a multiple of 16 or not
def test_new_shapes_need_no_new_compiled_variant(V, forward, monkeypatch):
    from rlkernels import fused_linear

    monkeypatch.setenv(fused_linear.FWD_KERNEL_ENV, forward)
    g = torch.Generator().manual_seed(0)
    H = 24
    w = (torch.randn(V, H, generator=g) * H**-0.5).to(torch.bfloat16).requires_grad_()  # [V, H]
    with forced_backend("triton"), record_specializations() as seen:
        for B, T in SHAPES:
            _calls(B, T, H, V, w, g)
    expected = {"_fwd_kernel", "_dz_kernel", "_dz_from_tile_kernel", "_logprobs_fwd_kernel", "_logprobs_bwd_kernel",
                "_policy_kernel", "_reduce_kernel", "_scale_rows_kernel", "_value_kernel", "_kl_kernel",
                "_whiten_partial_kernel", "_whiten_merge_kernel", "_whiten_apply_kernel"}
    if forward == "tma":  # the Hopper pair in place of _fwd_kernel and _dz_kernel
        expected = expected - {"_fwd_kernel", "_dz_kernel"} | {"_fwd_kernel_tma", "_dz_kernel_tma"}
    if forward == "cublas":  # cuBLAS GEMMs; the logprobs forward and the tile dz kernel read their float32 tiles
        expected = expected - {"_fwd_kernel", "_dz_kernel"}
    assert expected <= set(seen), f"kernels not launched: {sorted(expected - set(seen))}"
    varying = {}
    for kernel, keys in seen.items():
        # the pointers' part of each key: their types and 16-byte alignment classes, per set of pointer types (a
        # kernel may serve two dtypes: "cublas" runs the logprobs forward on its float32 tile besides the bf16
        # logits of the logprobs op; each is one compiled variant)
        by_types = {}
        for spec, _options in keys:
            pointers = tuple(entry for entry in spec if str(entry[0]).startswith("*"))
            by_types.setdefault(tuple(entry[0] for entry in pointers), set()).add(pointers)
        if any(len(classes) > 1 for classes in by_types.values()):
            varying[kernel] = sorted(p for classes in by_types.values() for p in classes)
    assert not varying, varying
    # the GEMM kernels: no argument but their constexprs (tiles, flags: the call sites' own) varies across the
    # shapes (N = 1 included), so each compiles once per use; an optional argument is a descriptor or None (the
    # forward's logits tile: stored by fused_policy's kernel 1 only)
    gemm = _gemm_kernels()
    assert set(gemm) & set(seen)
    for name in set(gemm) & set(seen):
        specs = [spec for spec, _options in seen[name]]
        params = gemm[name].params
        assert len(specs[0]) == len(params)
        for i, param in enumerate(params):
            values = {spec[i] for spec in specs}
            given = values - {("constexpr", None)}
            assert param.is_constexpr or len(given) == 1, (name, param.name, sorted(values, key=str))
