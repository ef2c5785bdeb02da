"""linear_policy_loss (the PPO/GRPO loss from hidden states, head gradient formed in the forward), forward + backward.

Bound (compute): THREE GEMMs of ``2 · N · H · V`` FLOPs each — the logits ``hidden @ W.T`` (1), ``d_hidden =
dz @ W`` (2) and ``d_weight = dz.T @ hidden`` (3): ``flops = 6 · N · H · V``. The two-op path
(``linear_logprobs`` then ``policy_loss``) does four (its backward recomputes the logits), eager does three but
holds ``[N, V]`` float32 logits and their gradient. Bytes: hidden and weight read, their gradients written.

Providers: ``eager`` (the two reference formulas as a user writes them: logits, log_softmax in float32, gather,
entropy, the clipped surrogate with a k3 KL and an entropy bonus, autograd), ``torch.compile`` of the same,
``rlkernels two-op`` (``linear_logprobs`` + ``policy_loss``), ``rlkernels`` (``linear_policy_loss``), and Liger's
``LigerFusedLinearGRPOLoss`` on CUDA where installed.
The CPU target: ``rlkernels`` >= 1.25x faster than ``rlkernels two-op`` at SmolLM2's head (H = 576, V = 49152).

logits_policy_loss (the same loss from ``[B, T, V]`` logits a caller holds, ``d_logits`` formed in the forward),
forward + backward. Bound (memory): TWO passes over ``[N, V]`` -- the logits read once, ``d_logits`` written once:
``bytes_moved = 2 · N · V · itemsize`` (the Triton row re-reads each row from L2 for pass 2; the two-op path
``logprobs`` then ``policy_loss`` makes three passes: read, read again in its backward, write). Issue 12's GPU
target: within 1.1x of that bound. Providers: ``eager`` (log_softmax in float32, gather, entropy, the reference
policy loss, autograd), ``torch.compile`` of it, ``rlkernels two-op`` (the baseline) and ``rlkernels``.
"""
from __future__ import annotations

import torch

import rlkernels
from bench import harness
from bench.bench_fused_linear import gemm_then_label_residuals
from bench.harness import Case, env_set
from rlkernels import reference

T_SEQ = 256  # tokens per sequence: N = B · T_SEQ
OPTIONS = dict(clip_low=0.2, kl_coef=0.04, kl_estimator="k3", entropy_coef=0.01, agg="token-mean")


def _eager(hidden, weight, labels, old, adv, mask, ref_logp):
    logits = hidden @ weight.T  # [B, T, V]
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    loss, _ = reference.policy_loss(logp, old, adv, mask, ref_logp=ref_logp, entropy=entropy, **OPTIONS)
    return loss


def _compiled_at_first_call(fn):
    """``torch.compile(fn)``, built when first called (a bench that never runs this provider compiles nothing)."""
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(torch.compile(fn))
        return compiled[0](*args)

    return call


_compiled_fn = _compiled_at_first_call(_eager)


def _two_op(hidden, weight, labels, old, adv, mask, ref_logp):
    logp, entropy = rlkernels.linear_logprobs(hidden, weight, labels, return_entropy=True)
    return rlkernels.policy_loss(logp, old, adv, mask, ref_logp=ref_logp, entropy=entropy, **OPTIONS)[0]


def _fused(hidden, weight, labels, old, adv, mask, ref_logp):
    return rlkernels.linear_policy_loss(hidden, weight, labels, old, adv, mask, ref_logp=ref_logp, **OPTIONS)[0]


def _step(fn):
    def step(hidden, weight, *rest):  # hidden [B, T, H], weight [V, H] leaves
        return torch.autograd.grad(fn(hidden, weight, *rest), [hidden, weight])

    return step


def _peers(device: torch.device) -> dict:
    def liger():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=OPTIONS["kl_coef"], epsilon_low=0.2, epsilon_high=0.2)

        def step(hidden, weight, labels, old, adv, mask, ref_logp):
            out = loss_fn(hidden, weight, labels, mask, adv[:, 0], ref_per_token_logps=ref_logp, old_per_token_logps=old)
            return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, [hidden, weight])

        return step

    return {"liger GRPO loss": harness.peer("liger_kernel.chunked_loss", "liger-kernel", device, liger)}


def policy_inputs(B: int, T: int, device: torch.device) -> tuple:
    """The per-token inputs of the policy-loss cases: ``(old_logp, advantages, mask, ref_logp)``, each [B, T]: old
    log-probs near log(1/V) (ratios around 1), one advantage per sequence, 10 % of the tokens masked out, a
    reference near the old policy."""
    old = -torch.rand(B, T, device=device) * 4 - 8  # [B, T]
    adv = torch.randn(B, 1, device=device).expand(B, T).contiguous()  # [B, T] one per sequence
    mask = torch.rand(B, T, device=device) > 0.1  # [B, T]
    ref_logp = old + 0.1 * torch.randn(B, T, device=device)  # [B, T]
    return old, adv, mask, ref_logp


def _case(N: int, H: int, V: int, dtype: torch.dtype, device: torch.device, only: tuple[str, ...] = ()) -> Case:
    B, T = max(1, N // T_SEQ), min(N, T_SEQ)

    def make_inputs():
        hidden = torch.randn(B, T, H, device=device, dtype=dtype).requires_grad_(True)  # [B, T, H]
        weight = (torch.randn(V, H, device=device, dtype=dtype) * H**-0.5).requires_grad_(True)  # [V, H]
        labels = torch.randint(0, V, (B, T), device=device)  # [B, T]
        old, adv, mask, ref_logp = policy_inputs(B, T, device)  # [B, T] each
        return hidden, weight, labels, old, adv, mask, ref_logp

    itemsize = torch.empty((), dtype=dtype).element_size()
    providers = {
        "eager": _step(_eager),
        "torch.compile": _step(_compiled_fn),
        "rlkernels two-op": _step(_two_op),
        "rlkernels": _step(_fused),
    }
    if device.type == "cuda":  # the three-GEMM op with its kernel 1 named (the default on sm_90: "tma", storing
        # the tile by TMA; else "split", _fwd_kernel): RLKERNELS_LINEAR_FWD held through the step
        for name in ("split", "tma", "cublas"):  # cublas: a cuBLAS GEMM into the tile, then the statistics kernel
            providers[f"rlkernels kernel 1 {name}"] = harness.with_env("RLKERNELS_LINEAR_FWD", name,
                                                                          providers["rlkernels"])
    providers.update(_peers(device))
    left_out = [k for k in providers if only and k not in only]
    if only:  # a case that measures some providers only (its shape says which were left out)
        providers = {k: v for k, v in providers.items() if k in only}
    return Case(
        op="linear_policy_loss fwd+bwd",
        shape=f"N={B * T} H={H} V={V} {str(dtype).removeprefix('torch.')}"
              + (f" (not run: {', '.join(left_out)})" if left_out else ""),
        bytes_moved=2 * (B * T * H + V * H) * itemsize,
        flops=3 * 2 * B * T * H * V,
        bound="compute",
        make_inputs=make_inputs,
        providers=providers,
        baseline="eager" if "eager" in providers else "rlkernels two-op",
    )


def _phase_case(N: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    """``linear_policy_loss``'s Triton row phase by phase at ``_case``'s shapes (``T_SEQ`` tokens a sequence, token
    ratio), in its held layout (fused_policy._triton_layout: 16-bit inputs, N <= 2H or one chunk, as at the contract's
    and the tiny dry-run sizes), each phase against one cuBLAS GEMM of the head's size (each row's "of bound" and
    ratio read as "GEMMs' worth of time"): kernel 1 over every chunk (GEMM 1, the row statistics, the float32
    ``[chunk, V]`` logits tile stored), kernel 2 over every chunk (``dz`` from the tile into the held ``[N, V]``),
    both again as ``RLKERNELS_LINEAR_FWD=cublas`` runs them (a cuBLAS GEMM writing the raw logits into the tile, then
    rlkernels.softmax's forward kernel for the statistics; kernel 2 dividing the raw tile by T), and kernel 2 at
    its candidate tiles (fused_linear._TILE_DZ_WIDE), GEMM 2 once (``d_hidden``, float32 result), GEMM 3 once
    (``d_weight`` in its dtype, the label residuals inside it), and GEMM 3's pieces: plain, plain with cuBLAS's
    16-bit split-K reductions off (as the op runs it), beta = 1 over a zeroed ``d_weight``, the residuals added
    after a plain GEMM. Where the whole op's time goes beyond its three GEMMs."""
    from bench.bench_fused_linear import _against_one_gemm
    from rlkernels import fused_linear as fl
    from rlkernels import fused_policy as fp

    B, T = max(1, N // T_SEQ), min(N, T_SEQ)
    N = B * T
    opt = fp.FusedPolicyOptions(temperature=1.0, ignore_index=-100, return_entropy=True, clip_low=0.2, clip_high=0.2,
                                dual_clip=None, ratio="token", kl_coef=0.04, kl_estimator="k3", entropy_coef=0.01,
                                agg="token-mean", norm_length=None, grad_input=True, grad_weight=True,
                                grad_bias=False)
    assert fp._triton_layout(B, T, H, V, "token", dtype, True) == "held", "the phases of the held layout only"
    chunks = fp._triton_chunks(B, T, V, "token", dtype, held=True)
    n_max = max(t1 - t0 for t0, t1 in chunks)

    def make_inputs():
        hidden = torch.randn(N, H, device=device, dtype=dtype)  # [N, H]
        weight = torch.randn(V, H, device=device, dtype=dtype) * H**-0.5  # [V, H]
        labels = torch.randint(0, V, (N,), device=device)  # [N]
        dz_all = torch.empty(N, V, device=device, dtype=dtype)  # [N, V] the held dz
        tile = fp._TritonTile(n_max, hidden, weight, None, opt, dz_all=dz_all)
        t0, t1 = chunks[0]
        stats = tile.stats(t0, t1, None, labels[t0:t1], True, opt)  # (row_max, log_s, logp, entropy) [n] each
        coef = torch.randn(t1 - t0, device=device) * 1e-4  # [n] stand-in loss coefficients dL/dlogp
        dz = next(tile.dz_blocks(coef, coef, labels[t0:t1], *stats, opt))[2]  # [n, V]
        for c0 in range(t1 - t0, N, t1 - t0):  # every chunk's rows of the held dz: the first chunk's, repeated
            dz_all[c0:c0 + t1 - t0] = dz[: N - c0]
        resid = torch.randn(N, device=device)  # [N] stand-in label residuals
        with env_set(fl.FWD_KERNEL_ENV, "cublas"):  # kernel 1 as "cublas" (and kernel 2 reading its raw tile)
            tile_c = fp._TritonTile(n_max, hidden, weight, None, opt, dz_all=dz_all)
        return hidden, weight, labels, tile, stats, coef, dz_all, resid, tile_c

    def kernel_1(hidden, weight, labels, tile, *rest):
        for t0, t1 in chunks:
            tile.stats(t0, t1, None, labels[t0:t1], True, opt)

    def kernel_2(hidden, weight, labels, tile, stats, coef, *rest):
        n = coef.numel()
        for t0, _ in chunks:  # every chunk at the first chunk's size (the last may be shorter)
            tile.t0 = min(t0, N - n)
            next(tile.dz_blocks(coef, coef, labels[:n], *stats, opt))

    def kernel_1_cublas(hidden, weight, labels, tile, stats, coef, dz_all, resid, tile_c):
        kernel_1(hidden, weight, labels, tile_c)

    def kernel_2_raw(hidden, weight, labels, tile, stats, coef, dz_all, resid, tile_c):
        kernel_2(hidden, weight, labels, tile_c, stats, coef)

    def gemm_2(hidden, weight, labels, tile, stats, coef, dz_all, resid, *rest):
        fl._mm_f32(dz_all, weight)  # [N, H] float32

    def gemm_3_with(d_weight_gemm):
        # as the op: the label runs of every token (one group), d_weight written once by d_weight_gemm --
        # fl._gemm_with_label_residuals (the residuals inside the GEMM) or bench_fused_linear's
        # gemm_then_label_residuals (plain GEMM, then the residual rows)
        def gemm_3(hidden, weight, labels, tile, stats, coef, dz_all, resid, *rest):
            tok = torch.arange(N, device=device)  # [N] every token has a label
            run = fl._label_runs(torch.zeros_like(tok), labels, tok, 1, V)[0]
            d_weight = torch.empty(V, H, device=device, dtype=dtype)  # [V, H]
            d_weight_gemm(d_weight, 0, V, dz_all, hidden, run, resid[run[0]])
        return gemm_3

    def gemm_3_plain(hidden, weight, labels, tile, stats, coef, dz_all, resid, *rest):
        dz_all.T @ hidden  # [V, H] no residuals: the GEMM's own time

    # where "label residuals inside" spends its time over the plain GEMM: the flags alone, beta = 1 alone
    def gemm_3_plain_f32_reductions(hidden, weight, labels, tile, stats, coef, dz_all, resid, *rest):
        with fl._float32_reductions(hidden.device):  # cuBLAS's 16-bit split-K reductions off, as the op runs it
            dz_all.T @ hidden  # [V, H]

    def gemm_3_beta_1(hidden, weight, labels, tile, stats, coef, dz_all, resid, *rest):
        d_weight = torch.zeros(V, H, device=device, dtype=dtype)  # [V, H] (its memset timed with it)
        d_weight.addmm_(dz_all.T, hidden)  # beta = 1: C read by the GEMM's epilogue

    providers = {"kernel 1 (GEMM 1, statistics, float32 tile)": kernel_1, "kernel 2 (dz from the tile)": kernel_2,
                 "kernel 1 cublas (cuBLAS GEMM 1 into the tile, statistics)": kernel_1_cublas,
                 "kernel 2 after cublas (dz from the raw tile)": kernel_2_raw,
                 "kernel 2, 16x256 tiles on 4 warps": harness.with_attr(fl, "_TILE_DZ", fl._TILE_DZ_WIDE, kernel_2),
                 "GEMM 2 (d_hidden, one GEMM, float32 out)": gemm_2,
                 "GEMM 3 (d_weight, one GEMM, label residuals inside)": gemm_3_with(fl._gemm_with_label_residuals),
                 "GEMM 3, label residuals after": gemm_3_with(gemm_then_label_residuals),
                 "GEMM 3 plain (no residuals)": gemm_3_plain,
                 "GEMM 3 plain, float32 split-K reductions": gemm_3_plain_f32_reductions,
                 "GEMM 3 plain, beta = 1 over a memset": gemm_3_beta_1}
    return _against_one_gemm("linear_policy_loss phases", N, H, V, dtype,
                             f" (held dz, {len(chunks)} chunks of {n_max})", make_inputs, providers)


def _logits_eager(logits, labels, old, adv, mask, ref_logp):
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    return reference.policy_loss(logp, old, adv, mask, ref_logp=ref_logp, entropy=entropy, **OPTIONS)[0]


_logits_compiled = _compiled_at_first_call(_logits_eager)


def _logits_two_op(logits, labels, old, adv, mask, ref_logp):
    logp, entropy = rlkernels.logprobs(logits, labels, return_entropy=True)
    return rlkernels.policy_loss(logp, old, adv, mask, ref_logp=ref_logp, entropy=entropy, **OPTIONS)[0]


def _logits_fused(logits, labels, old, adv, mask, ref_logp):
    return rlkernels.logits_policy_loss(logits, labels, old, adv, mask, ref_logp=ref_logp, **OPTIONS)[0]


def _logits_one_kernel(logits, labels, old, adv, mask, ref_logp):
    """logits_policy_loss with RLKERNELS_LOGITS_POLICY=one-kernel for the call (its forward; the backward only
    scales the d_logits the forward wrote)."""
    from rlkernels import fused_policy

    with env_set(fused_policy.LOGITS_ROW_ENV, "one-kernel"):
        return _logits_fused(logits, labels, old, adv, mask, ref_logp)


def _logits_cluster(logits, labels, old, adv, mask, ref_logp):
    """logits_policy_loss with RLKERNELS_LOGITS_POLICY=cluster for the call: the csrc cluster kernel (the logits read
    from DRAM once), or the pair where it cannot take the call."""
    from rlkernels import fused_policy

    with env_set(fused_policy.LOGITS_ROW_ENV, "cluster"):
        return _logits_fused(logits, labels, old, adv, mask, ref_logp)


def _logits_step(fn):
    def step(logits, *rest):  # logits [B, T, V], the leaf
        return torch.autograd.grad(fn(logits, *rest), [logits])

    return step


def _logits_case(N: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    B, T = max(1, N // T_SEQ), min(N, T_SEQ)

    def make_inputs():
        logits = (torch.randn(B, T, V, device=device, dtype=dtype) * 2).requires_grad_(True)  # [B, T, V]
        labels = torch.randint(0, V, (B, T), device=device)  # [B, T]
        old, adv, mask, ref_logp = policy_inputs(B, T, device)  # [B, T] each
        return logits, labels, old, adv, mask, ref_logp

    itemsize = torch.empty((), dtype=dtype).element_size()
    return Case(
        op="logits_policy_loss fwd+bwd",
        shape=f"N={B * T} V={V} {str(dtype).removeprefix('torch.')}",
        bytes_moved=2 * B * T * V * itemsize,  # the two-pass bound: logits read once, d_logits written once
        flops=14 * B * T * V,
        bound="memory",
        make_inputs=make_inputs,
        providers={"eager": _logits_step(_logits_eager), "torch.compile": _logits_step(_logits_compiled),
                   "rlkernels two-op": _logits_step(_logits_two_op), "rlkernels": _logits_step(_logits_fused),
                   "rlkernels one-kernel": _logits_step(_logits_one_kernel),
                   "rlkernels cluster": _logits_step(_logits_cluster)},
        baseline="rlkernels two-op",
    )


def cases(device: torch.device, quick: bool) -> list[Case]:
    return _linear_cases(device, quick) + _logits_cases(device, quick)


def tiny_cases(device: torch.device) -> list[Case]:
    """``python -m bench --gpu --dry-run``: the quick cases and the phase case at a tiny, odd size (the code path,
    not a measurement)."""
    return cases(device, True) + [_phase_case(64, 24, 1000, torch.bfloat16, device)]


def _logits_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        return [_logits_case(8192, 151936, torch.bfloat16, device)]
    if quick:
        return [_logits_case(512, 32000, torch.float32, device), _logits_case(512, 32000, torch.bfloat16, device)]
    return [_logits_case(2048, 32000, torch.float32, device), _logits_case(2048, 32000, torch.bfloat16, device)]


def _linear_cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        return [_case(8192, 4096, 151936, torch.bfloat16, device), _phase_case(8192, 4096, 151936, torch.bfloat16,
                                                                               device)]
    if quick:  # bf16 eager on CPU (a bf16 [N, H] x [H, V] GEMM without fast bf16 units) takes ~35 s at N=512,
        # so the quick run measures one sequence of tokens (N = 256), and in bfloat16 only the two rlkernels paths
        # (both widen each weight block to float32 for the GEMMs)
        return [_case(256, 576, 49152, torch.float32, device),
                _case(256, 576, 49152, torch.bfloat16, device, only=("rlkernels two-op", "rlkernels"))]
    return [_case(4096, 576, 49152, torch.float32, device), _case(4096, 576, 49152, torch.bfloat16, device)]
