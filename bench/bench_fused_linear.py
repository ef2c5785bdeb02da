"""linear_logprobs (fused LM head + log-softmax gather + entropy), forward + backward.

Bound (compute): four GEMMs of ``2 · N · H · V`` FLOPs each — the forward's
``hidden @ W.T`` (1), and in the backward the logits' recomputation (2),
``d_hidden = dz @ W`` (3) and ``d_weight = dz.T @ hidden`` (4), so
``flops = 8 · N · H · V``. (Eager, which keeps the logits, needs only three; the
bound counts the four a memory-bounded fused kernel must do.) Bytes: hidden and
weight read, their gradients written (``2 · (N·H + V·H) · itemsize``), far below
what the FLOPs take: the op is compute bound.

Providers: ``eager`` (``hidden @ W.T`` then ``log_softmax`` in float32, ``gather``
and the entropy, then autograd: materializes ``[N, V]`` logits and their
gradient), ``torch.compile`` of that same function, ``rlkernels`` (Triton on
CUDA, the chunked PyTorch path on the CPU), and Liger-Kernel's fused linear
cross-entropy / cut-cross-entropy (with its default gradient filter, and with
``filter_eps=None``) on CUDA where installed (log-prob only: neither returns the
entropy; summed, so their backward gets one scalar).
"""
from __future__ import annotations

import torch

import rlkernels
from bench import harness
from bench.harness import Case

TEMPERATURE = 1.0


def eager_linear_logprobs(hidden, weight, labels):
    logits = hidden @ weight.T  # [N, V]
    logp_all = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # [N, V]
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [N]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


_compiled = None


def _compiled_fn(hidden, weight, labels):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(eager_linear_logprobs)
    return _compiled(hidden, weight, labels)


def _rlkernels(hidden, weight, labels):
    return rlkernels.linear_logprobs(hidden, weight, labels, temperature=TEMPERATURE, return_entropy=True)


def _step(fn):
    def step(hidden, weight, labels, g_logp, g_ent):  # hidden [N, H], weight [V, H] leaves; labels, g_* [N]
        logp, entropy = fn(hidden, weight, labels)
        return torch.autograd.grad([logp, entropy], [hidden, weight], [g_logp, g_ent])

    return step


def _peers(device: torch.device) -> dict:
    """Log-prob-only peers (they compute the cross-entropy -logp, summed, so the backward gets a scalar);
    rows say "not installed" / "needs a CUDA device" where they cannot run."""

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def step(hidden, weight, labels, g_logp, g_ent):
            return torch.autograd.grad(loss_fn(weight, hidden, labels), [hidden, weight])

        return step

    def cce(**options):
        def build():
            from cut_cross_entropy import linear_cross_entropy

            def step(hidden, weight, labels, g_logp, g_ent):
                loss = linear_cross_entropy(hidden, weight, labels, reduction="sum", **options)
                return torch.autograd.grad(loss, [hidden, weight])

            return step

        return build

    return {
        "liger (logp only)": harness.peer("liger_kernel.transformers", "liger-kernel", device, liger),
        # CCE's default gradient filter skips vocabulary blocks whose softmax is below a threshold: with random
        # logits it drops almost every block, so the full computation (filter_eps=None) is the fair comparison
        "cut-cross-entropy (logp only)": harness.peer("cut_cross_entropy", "cut-cross-entropy", device, cce()),
        "cut-cross-entropy filter_eps=None": harness.peer("cut_cross_entropy", "cut-cross-entropy", device,
                                                          cce(filter_eps=None)),
    }


def _case(N: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    def make_inputs():
        hidden = (torch.randn(N, H, device=device, dtype=dtype)).requires_grad_(True)  # [N, H]
        weight = (torch.randn(V, H, device=device, dtype=dtype) * H**-0.5).requires_grad_(True)  # [V, H]
        labels = torch.randint(0, V, (N,), device=device)  # [N]
        g_logp = torch.randn(N, device=device)  # [N]
        g_ent = torch.randn(N, device=device)  # [N]
        return hidden, weight, labels, g_logp, g_ent

    itemsize = torch.empty((), dtype=dtype).element_size()
    providers = {
        "eager": _step(eager_linear_logprobs),
        "torch.compile": _step(_compiled_fn),
        "rlkernels": _step(_rlkernels),
    }
    if device.type == "cuda":  # the whole step (forward and backward) with each forward kernel named (the default:
        # "tma" on sm_90, else "split"); the backward takes the dz kernel that pairs with it (fused_linear._bwd_tiles)
        from rlkernels.fused_linear import FWD_KERNEL_ENV

        for name in ("split", "tma", "cublas"):  # cublas: cuBLAS for every GEMM, the logits' backward included
            providers[f"rlkernels fwd {name}"] = harness.with_env(FWD_KERNEL_ENV, name, _step(_rlkernels))
    providers.update(_peers(device))
    return Case(
        op="linear_logprobs fwd+bwd",
        shape=f"N={N} H={H} V={V} {str(dtype).removeprefix('torch.')}",
        bytes_moved=2 * (N * H + V * H) * itemsize,
        flops=4 * 2 * N * H * V,
        bound="compute",
        make_inputs=make_inputs,
        providers=providers,
    )


def _forward_kernel(name: str):
    """rlkernels' forward alone with the forward kernel ``name`` (fused_linear.FWD_KERNELS, or "tma flat": the
    Hopper kernel's flattened schedule, which triton 3.6 fails to compile: its row then says so; "tma 2cta": its
    64x128 tiles, two CTAs per SM), set for the call only."""
    import dataclasses

    from bench.harness import env_set
    from rlkernels import fused_linear

    def step(hidden, weight, labels, g_logp, g_ent):
        old_tiles = fused_linear._TMA_TILES
        if name == "tma flat":
            fused_linear._TMA_TILES = dataclasses.replace(old_tiles, flatten=True)
        elif name == "tma 2cta":
            fused_linear._TMA_TILES = fused_linear._TMA_TILES_2CTA
        try:
            with env_set(fused_linear.FWD_KERNEL_ENV, name.split()[0]):
                return _rlkernels(hidden, weight, labels)
        finally:
            fused_linear._TMA_TILES = old_tiles

    return step


def _forward_case(N: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    """The forward alone, per forward kernel, against one cuBLAS GEMM of the same shape (the baseline column is
    then "GEMM time / this time"): the measurement that picks fused_linear's default forward kernel."""

    def make_inputs():
        hidden = torch.randn(N, H, device=device, dtype=dtype)  # [N, H]
        weight = torch.randn(V, H, device=device, dtype=dtype) * H**-0.5  # [V, H]
        labels = torch.randint(0, V, (N,), device=device)  # [N]
        return hidden, weight, labels, None, None

    providers = {f"rlkernels fwd {name}": _forward_kernel(name) for name in ("split", "tma", "tma flat", "tma 2cta", "cublas")}
    return _against_one_gemm("linear_logprobs fwd", N, H, V, dtype, "", make_inputs, providers)


def _against_one_gemm(op, N, H, V, dtype, note, make_inputs, providers) -> Case:
    """A case whose baseline is one cuBLAS GEMM ``hidden @ weight.T`` of the shape (the inputs' first two), each
    row's FLOPs counted as that GEMM's: its ratio and fraction read as "GEMMs' worth of time"."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Case(
        op=op,
        shape=f"N={N} H={H} V={V} {str(dtype).removeprefix('torch.')}{note}",
        bytes_moved=(N * H + V * H) * itemsize,
        flops=2 * N * H * V,
        bound="compute",
        make_inputs=make_inputs,
        providers={"one GEMM (cuBLAS)": lambda hidden, weight, *rest: hidden @ weight.T, **providers},
        baseline="one GEMM (cuBLAS)",
    )


def gemm_then_label_residuals(d_weight: torch.Tensor, v0: int, v1: int, dz: torch.Tensor, hidden: torch.Tensor,
                              run: tuple, resid: torch.Tensor) -> None:
    """The alternative to ``fl._gemm_with_label_residuals`` that these benches time (not used by the package):
    ``d_weight[v0:v1] = dz.T @ hidden`` by a plain 16-bit-output GEMM (beta = 0, no memset), then the label
    residuals' per-label sums added to their rows, which rounds those rows twice instead of once. On the CPU
    (bf16, linear_logprobs at N=64-200, V=300-4097, three seeds) that put d_weight at 0.17-0.47x eager's error
    against 0.15-0.39x with the residuals inside the GEMM and 0.20-0.61x with none; the rows the residuals
    touch are no longer correctly rounded, which tests/test_fused_linear.py asks of the package. The H200 run
    of 2026-11-27 measured the residuals inside at 1.7 ms over the plain GEMM (14.7 against 13.0 ms): this row
    says how much of that the alternative would save."""
    from rlkernels import fused_linear as fl

    dw = d_weight[v0:v1]  # [vc, H]
    torch.mm(dz.T, hidden, out=dw)
    fl._add_run(d_weight, run, resid[:, None] * hidden[run[0]].float())  # [k, H] summed per label, rows += sums


def _backward_phase_case(N: int, H: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    """The Triton backward (vocabulary outer: N < V) whole and phase by phase, each against one cuBLAS GEMM of the
    same size (so each row's "of bound" and ratio read as "GEMMs' worth of time"): the dz kernel over every
    vocabulary chunk (it recomputes the logits: one GEMM and the softmax epilogue), and on sm_90 the Hopper dz
    kernel (``_dz_kernel_tma``, which follows the ``tma`` forward; here with K blocks of 64 after a split forward's
    statistics: the time is the same), for 16-bit inputs the "cublas" backward whole and its dz (each chunk's logits
    by cuBLAS into a float32 tile, then ``_dz_from_tile_kernel``; narrower chunks: the tile shares the dz budget),
    dh += dz @ W_j with a float32
    result and d_weight's slices dz.T @ hidden with 16-bit results (the two GEMMs as the backward calls them, chunk
    by chunk), the same two with the other output dtype (what the output dtype costs), and the dW GEMMs as the
    16-bit backward runs them, with the label residuals added inside (fl._label_runs once, then
    fl._gemm_with_label_residuals per chunk, N random labels)."""
    from rlkernels import fused_linear as fl

    opt = fl.LinearLogprobsOptions(temperature=1.0, return_entropy=True, ignore_index=-100)
    bwd_opt = fl.LinearLogprobsBackwardOptions(temperature=1.0, return_entropy=True, ignore_index=-100,
                                              grad_weight=True, grad_input=True)
    t = fl._tiles(dtype, backward=True)
    vc = fl._vocab_chunk(N, V, dtype, t)
    chunks = [(v0, min(V, v0 + vc)) for v0 in range(0, V, vc)]

    def make_inputs():
        hidden = torch.randn(N, H, device=device, dtype=dtype)  # [N, H]
        weight = torch.randn(V, H, device=device, dtype=dtype) * H**-0.5  # [V, H]
        labels = torch.randint(0, V, (N,), device=device)  # [N]
        logp, entropy, stats = fl._forward_triton(hidden, weight, labels, None, opt)  # [N], [N], [2, N]
        g_logp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)  # [N] each
        dz = torch.randn(N, vc, device=device).to(dtype)  # [N, vc] a chunk of dz, for the GEMM rows
        return hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz

    def whole(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        return fl._backward_triton(g_logp, g_ent, hidden, weight, labels, None, stats, entropy, logp, bwd_opt)

    def dz_kernel(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        dz_into = fl._dz_launcher(g_logp, g_ent, hidden, weight, labels, None, stats, entropy, opt, t)
        resid = torch.zeros(N, device=device)  # [N]
        for v0, v1 in chunks:
            dz_into(dz[:, : v1 - v0], resid, 0, N, v0, v1)

    def dz_kernel_tma(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        dz_into = fl._dz_launcher(g_logp, g_ent, hidden, weight, labels, None, stats, entropy, opt, fl._TMA_DZ_TILES)
        resid = torch.zeros(N, device=device)  # [N]
        for v0, v1 in chunks:
            dz_into(dz[:, : v1 - v0], resid, 0, N, v0, v1)

    cublas_vc = fl._vocab_chunk(N, V, dtype, fl._CUBLAS_DZ_TILES)  # <= vc: its float32 tile shares the budget
    cublas_chunks = [(v0, min(V, v0 + cublas_vc)) for v0 in range(0, V, cublas_vc)]

    def dz_cublas(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        # the "cublas" backward's dz: each chunk's logits by cuBLAS into a float32 tile, then _dz_from_tile_kernel
        dz_into = fl._dz_launcher(g_logp, g_ent, hidden, weight, labels, None, stats, entropy, opt,
                                  fl._CUBLAS_DZ_TILES)
        resid = torch.zeros(N, device=device)  # [N]
        for v0, v1 in cublas_chunks:
            dz_into(dz[:, : v1 - v0], resid, 0, N, v0, v1)

    def dh_f32(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        dh = torch.zeros(N, H, device=device)  # [N, H] float32
        for v0, v1 in chunks:
            fl._addmm_f32(dh, dz[:, : v1 - v0], weight[v0:v1])

    def dw_f32(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        for v0, v1 in chunks:
            fl._mm_f32(dz[:, : v1 - v0].T, hidden)  # [vc, H] float32

    def dh_16(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        dh = torch.zeros(N, H, device=device, dtype=dtype)  # [N, H]
        for v0, v1 in chunks:
            dh.addmm_(dz[:, : v1 - v0], weight[v0:v1])

    def dw_16(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
        for v0, v1 in chunks:
            dz[:, : v1 - v0].T @ hidden  # [vc, H]

    def dw_with(d_weight_gemm):
        # as the backward does it: the label runs planned once for every chunk, then chunk by chunk each slice of
        # d_weight from d_weight_gemm -- fl._gemm_with_label_residuals (the residuals inside the GEMM: against "dW
        # GEMMs 16-bit out", their cost) or gemm_then_label_residuals (added after it: two roundings)
        def dw_residuals(hidden, weight, labels, logp, entropy, stats, g_logp, g_ent, dz):
            dw = torch.empty(V, H, device=device, dtype=dtype)  # [V, H] d_weight
            tok = torch.arange(N, device=device)  # [N] every token has a label
            runs = fl._label_runs(torch.div(labels, vc, rounding_mode="floor"), labels, tok, len(chunks), V)
            for j, (v0, v1) in enumerate(chunks):  # g_logp [N]: stand-in label residuals
                d_weight_gemm(dw, v0, v1, dz[:, : v1 - v0], hidden, runs[j], g_logp[runs[j][0]])
        return dw_residuals

    hopper = device.type == "cpu" or torch.cuda.get_device_capability(device)[0] == 9  # TMA: sm_90 (or interpreted)
    providers = {
        "backward (all phases)": whole, "dz kernel": dz_kernel,
        **({"dz kernel tma": dz_kernel_tma} if hopper and dtype != torch.float32 and H * 2 % 16 == 0 else {}),
        **({"backward (all phases), cublas": harness.with_env(fl.FWD_KERNEL_ENV, "cublas", whole),
            "dz kernel cublas": dz_cublas,
            "dz kernel cublas, 16x256 tiles on 4 warps": harness.with_attr(fl, "_TILE_DZ", fl._TILE_DZ_WIDE, dz_cublas),
            } if dtype != torch.float32 else {}),
        "dh GEMMs float32 out": dh_f32,
        "dW GEMMs 16-bit out": dw_16, "dW GEMMs with label residuals": dw_with(fl._gemm_with_label_residuals),
        "dW GEMMs, label residuals after": dw_with(gemm_then_label_residuals), "dh GEMMs 16-bit out": dh_16,
        "dW GEMMs float32 out": dw_f32,
    }
    return _against_one_gemm("linear_logprobs bwd phases", N, H, V, dtype, f" ({len(chunks)} chunks of {vc})",
                             make_inputs, providers)


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cuda":
        if quick:
            return [_case(4096, 4096, 128256, torch.bfloat16, device)]
        sizes = [(8192, 4096, V) for V in (128256, 151936)]
        return ([_case(*size, torch.bfloat16, device) for size in sizes]
                + [_forward_case(*size, torch.bfloat16, device) for size in sizes]
                + [_backward_phase_case(*sizes[0], torch.bfloat16, device)])
    # H=64 (the trainer demo's head): the time is in the elementwise passes over [N, V], not the GEMMs
    if quick:
        return [_case(256, 256, 8192, torch.float32, device), _case(256, 64, 32000, torch.float32, device)]
    return [_case(1024, 512, 50257, torch.float32, device), _case(1024, 64, 32000, torch.float32, device)]


def tiny_cases(device: torch.device) -> list[Case]:
    """``python -m bench --gpu --dry-run``: the same case at a tiny, odd size (the code path, not a measurement)."""
    return [_case(16, 24, 1000, torch.bfloat16, device), _forward_case(16, 24, 1000, torch.bfloat16, device),
            _backward_phase_case(16, 24, 1000, torch.bfloat16, device)]
