"""``python -m bench.model``: a roofline model of ``linear_logprobs`` (fwd+bwd with entropy, bf16) at the contract's
sizes on H100 and H200, phase by phase, from bytes, FLOPs and the kernels' ahead-of-time facts. A prediction, not
a measurement: ``make gpu`` (bench/gpu.py) measures, and writes this model's numbers next to what it measured.

Each phase takes ``max(FLOPs / tensor rate, HBM bytes / bandwidth) + epilogue``: the main loop is bound by the
tensor cores or by HBM, whichever is slower, and the softmax epilogue of a fused kernel runs on the same warps with
the one accumulator (1 CTA per SM, no warp specialization), so it adds. The phases (issue 13):

- forward: one GEMM ``2·N·H·V`` fused with the online log-sum-exp / entropy epilogue, for each forward kernel:
  ``split`` (_fwd_kernel: wgmma m64n64 on 16 warps, its grid grouped like ``tma``'s: hidden read once, the weight
  once per group of 16 token blocks), ``tma`` (_fwd_kernel_tma: m64n128, persistent grouped
  grid: hidden read once, the weight once per group of token blocks), ``cublas`` (the plain baseline: a cuBLAS GEMM
  writing float32 logits, then a memory-bound pass reading them back);
- backward ``dz``: the logits recomputed (GEMM 2) and ``dz`` written in bf16 ``[N, V]``, by the dz kernel that
  follows the forward (rlkernels.fused_linear._bwd_tiles): ``dz`` (_dz_kernel: m64n64, its grid grouped the same
  way) after ``split`` and ``cublas``, ``dz tma`` (_dz_kernel_tma: TMA, m64n128 on one warpgroup, two CTAs per SM,
  persistent grouped grid) after the Hopper forwards;
- backward ``dh`` and ``dW``: cuBLAS GEMMs reading ``dz``, vocabulary outer at the contract's sizes (``dh`` in a
  float32 ``[N, H]`` accumulator, each ``dW`` slice written once in bf16; see ``backward_s``).

Against the H100 (2026-11-26, torch 2.11, triton 3.6; before the split and dz grids were grouped): the model then
predicted (at the measured ceilings) split 14.4 / 17.1 ms and dz 15.7 ms at V = 128256, the H100 measured 32.5 /
37.2 ms and 59.8 ms; tma 12.4 / 14.7 against 15.5 / 18.4. The model then already counted the ungrouped split's
35 GB of hidden re-reads (11.6 ms at 3 TB/s) but took ``max(compute, HBM)``; the dz kernel's re-reads (~67 GB: a
wave of 132 programs of 64 rows spans all 128 token blocks, 64 MiB, re-read per vocabulary tile) it did not count.
Compute and those misses adding rather than overlapping comes closer (split ~26 ms, dz ~38 ms), so the grouped
grids are predicted to save more than this model says; how much is for ``make gpu`` to measure.

Assumptions (sources; each a constant below):
- peak dense bf16 tensor rate 989 TFLOP/s on both (NVIDIA H100 SXM5 and H200 SXM datasheets: the same GH100 SM
  count and clocks), HBM3 3.35 TB/s (H100 SXM5) and HBM3e 4.8 TB/s (H200), L2 50 MB (H100) and 60 MB (H200, as
  PyTorch reported it on this workplace's machine, device/KINDS.md);
- a cuBLAS GEMM reaches 0.81 of that peak: 798 TFLOP/s (H100) and 788 (H200) measured for a bf16 8192^3 product on
  random data on this workplace's machines (device/KINDS.md); a copy reaches 0.90 (H100: 3.0 of 3.35 TB/s) and 0.90
  (H200: 4.3 of 4.8 TB/s), same source;
- a Triton kernel whose wgmma reads both operands from shared memory reaches, with N = 64, 0.67 of peak (issue 13's
  reading of the forward's sm_90 SASS); its rate scales with the FLOPs per shared-memory operand byte of one
  ``m64nNk16``, ``64·N / (64 + N)`` (32 at N = 64, 42.7 at N = 128), capped at cuBLAS's 0.81;
- an epilogue costs its SASS instructions per logit, read off the aligned bf16 sm_90 SASS without bias (triton
  3.9, this repository's AOT compile, ``rlkernels.testing.aot.epilogue_instructions``: the kernel's loop over
  tiles, or the whole kernel, minus its K loop; the GPU machines run triton 3.6) divided by the logits one thread
  handles per tile: 26.8 for _fwd_kernel (858 instructions, 32 logits per thread), 31.2 for _fwd_kernel_tma (the
  default FLATTEN=False: 1996, 64 per thread), 46.5 for _dz_kernel (1489, 32 per thread), 44.8 for _dz_kernel_tma
  (2867, 64 per thread); tests/test_bench_model.py recompiles them and holds these figures to within 2 %; issued
  at 4 warp-instructions per clock per SM, at the clock where 132 SMs of 4096 dense bf16 FLOP per clock give the
  peak (1.83 GHz);
- a tile's K-loop overhead: a kernel that drains its K pipeline at every tile (``split``, ``dz``, ``tma``)
  pays a refill, assumed 2000 clocks (~1.1 µs: TMA / cp.async latency times the stages); the flattened ``tma flat``
  keeps the next tile's loads in flight during the epilogue, but its sm_90 SASS waits for each wgmma group
  (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) at every K step, assumed 64 clocks per step. Guesses until ``make gpu``
  measures;
- two CTAs per SM (``tma 2cta``, ``dz tma``: 64x128 tiles on 4 warps) could hide one CTA's epilogue behind the
  other's wgmma; this model assumed so until the H100 measured ``tma 2cta`` at 22.0 / 27.6 ms, slower than the
  one-CTA ``tma`` (15.5 / 18.4) and twice the 10.8 / 12.8 ms it predicted (one GEMM's time). No overlap is assumed
  now: epilogue and refill add, as for one CTA per SM.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

BYTES_BF16 = 2
BYTES_F32 = 4


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense bf16 tensor-core peak (datasheet)
    hbm_tbps: float  # HBM bandwidth (datasheet)
    l2_mb: float
    sms: int = 132
    gemm_efficiency: float = 0.81  # a cuBLAS bf16 GEMM's fraction of peak (measured here, see the module docstring)
    copy_efficiency: float = 0.90  # a device-to-device copy's fraction of the HBM bandwidth (measured here)

    @property
    def clock_hz(self) -> float:
        """The clock at which ``sms`` SMs of 4096 dense bf16 FLOP per clock give ``peak_tflops``."""
        return self.peak_tflops * 1e12 / (self.sms * 4096)

    @property
    def hbm_bps(self) -> float:
        return self.hbm_tbps * 1e12 * self.copy_efficiency

    def tensor_flops(self, efficiency: float) -> float:
        return self.peak_tflops * 1e12 * efficiency


DEVICES = {
    "H100": Device("H100 SXM5", peak_tflops=989.0, hbm_tbps=3.35, l2_mb=50.0, gemm_efficiency=798 / 989,
                   copy_efficiency=3.0 / 3.35),
    "H200": Device("H200 SXM", peak_tflops=989.0, hbm_tbps=4.8, l2_mb=60.0, gemm_efficiency=788 / 989,
                   copy_efficiency=4.3 / 4.8),
}

# The contract's sizes (issue 13): N tokens, H hidden, V vocabulary, bf16.
N_TOKENS, HIDDEN = 8192, 4096
VOCABS = (128256, 151936)

TRITON_EFF_N64 = 0.67  # a Triton wgmma m64n64 (both operands from shared memory) kernel's fraction of peak (issue 13)
# SASS instructions per logit of each kernel's epilogue (aligned bf16 sm_90 SASS, triton 3.9; see the docstring)
EPILOGUE_SASS_SPLIT, EPILOGUE_SASS_TMA, EPILOGUE_SASS_DZ, EPILOGUE_SASS_DZ_TMA = 26.8, 31.2, 46.5, 44.8
WARP_ISSUE_PER_CLOCK = 4  # warp-instructions issued per clock per SM (4 schedulers)
REFILL_CLOCKS = 2000  # a K pipeline drained at a tile's end and refilled (assumption)
WGMMA_WAIT_CLOCKS = 64  # a wgmma group waited for every K step instead of kept in flight (assumption)
DZ_BUDGET_BYTES = 1 << 29  # the backward's bf16 dz workspace (rlkernels.fused_linear._DZ_BUDGET_BYTES)


@dataclass(frozen=True)
class Kernel:
    """A fused GEMM + epilogue kernel, as its AOT facts describe it."""

    name: str
    block_n: int  # tile rows (tokens)
    block_v: int  # tile columns (vocabulary)
    block_k: int
    wgmma_n: int  # the HGMMA N in its sm_90 SASS
    epilogue_sass: float  # SASS instructions per logit of its epilogue
    refill_per_tile: bool  # the K pipeline drains and refills at every tile
    wait_per_k_step: bool  # its wgmma is waited for at every K step (flattened loop)
    ctas_per_sm: int = 1  # resident CTAs per SM: with 2, one CTA's epilogue overlaps the other's main loop
    group_n: int = 0  # token blocks its grid runs over fastest (the weight is read once per group); 0: not grouped


KERNELS = {
    "split": Kernel("_fwd_kernel", 128, 128, 32, 64, EPILOGUE_SASS_SPLIT, True, False, group_n=16),
    "tma": Kernel("_fwd_kernel_tma", 128, 128, 64, 128, EPILOGUE_SASS_TMA, True, False, group_n=16),
    "tma flat": Kernel("_fwd_kernel_tma FLATTEN=True", 128, 128, 64, 128, EPILOGUE_SASS_TMA, False, True, group_n=16),
    "tma 2cta": Kernel("_fwd_kernel_tma 64x128 w4", 64, 128, 64, 128, EPILOGUE_SASS_TMA, True, False, ctas_per_sm=2,
                       group_n=32),
    "dz": Kernel("_dz_kernel", 64, 128, 32, 64, EPILOGUE_SASS_DZ, True, False, group_n=16),
    "dz tma": Kernel("_dz_kernel_tma", 64, 128, 64, 128, EPILOGUE_SASS_DZ_TMA, True, False, ctas_per_sm=2, group_n=16),
}


FORWARDS = ("split", "tma", "tma flat", "tma 2cta", "cublas")
DZ_KERNELS = ("dz", "dz tma", "dz cublas")
# the dz kernel each forward is followed by (rlkernels.fused_linear._bwd_tiles: the Hopper dz kernel after the Hopper
# forward, whose K blocks of 64 it repeats; after the cuBLAS forward, cuBLAS again into a float32 tile and the tile
# dz kernel; the pointer dz kernel after the others)
DZ_AFTER = {"split": "dz", "tma": "dz tma", "tma flat": "dz tma", "tma 2cta": "dz tma", "cublas": "dz cublas"}
# the tile dz kernel's columns (rlkernels.fused_linear._TILE_DZ.block_v): the cuBLAS dz's chunks end on them
CUBLAS_DZ_BLOCK_V = 128


def wgmma_efficiency(n: int, device: Device) -> float:
    """Fraction of peak of a Triton kernel issuing ``m64nNk16`` with both operands in shared memory: scaled from
    ``TRITON_EFF_N64`` by the FLOPs per operand byte ``64·N / (64 + N)``, capped at cuBLAS's fraction."""
    per_byte = 64 * n / (64 + n)
    return min(device.gemm_efficiency, TRITON_EFF_N64 * per_byte / (64 * 64 / (64 + 64)))


def gemm_flops(N: int, H: int, V: int) -> float:
    return 2.0 * N * H * V


def one_gemm_s(N: int, H: int, V: int, device: Device) -> float:
    """One ``[N, H] x [H, V]`` bf16 GEMM at cuBLAS's rate (the yardstick: the op is four of them)."""
    return gemm_flops(N, H, V) / device.tensor_flops(device.gemm_efficiency)


def _tiles(N: int, V: int, k: Kernel) -> int:
    return math.ceil(N / k.block_n) * math.ceil(V / k.block_v)


def _epilogue_and_overheads_s(N: int, H: int, V: int, k: Kernel, device: Device) -> float:
    """Per tile, on one SM: the epilogue's instructions, plus the K pipeline's refill or the per-step wgmma waits;
    the tiles spread over all SMs."""
    warps_instr = k.block_n * k.block_v * k.epilogue_sass / 32
    clocks = warps_instr / WARP_ISSUE_PER_CLOCK
    if k.refill_per_tile:
        clocks += REFILL_CLOCKS
    if k.wait_per_k_step:
        clocks += WGMMA_WAIT_CLOCKS * math.ceil(H / k.block_k)
    return _tiles(N, V, k) / device.sms * clocks / device.clock_hz


def forward_hbm_bytes(kind: str, N: int, H: int, V: int, device: Device) -> float:
    """HBM bytes the forward moves: :func:`tiled_hbm_bytes` of its kernel, or for ``cublas`` hidden and weight once
    per GEMM, the float32 logits written and read back."""
    if kind == "cublas":
        return (N * H + V * H) * BYTES_BF16 + 2 * N * V * BYTES_F32
    return tiled_hbm_bytes(KERNELS[kind], N, H, V, device)


def tiled_hbm_bytes(k: Kernel, N: int, H: int, V: int, device: Device) -> float:
    """HBM bytes a tiled GEMM kernel reads for its operands. Grid grouped (``group_n``: every Triton forward since
    2026-11-26): hidden once, the weight once per group of token blocks. Ungrouped (``group_n = 0``; ``split`` as the
    H100 measured it on 2026-11-26): the grid walks token blocks fastest, so a wave of one program per SM spans
    ``min(blocks, SMs)`` token blocks; when their hidden rows exceed L2 each vocabulary tile re-reads them (programs
    of one token block in the same wave share a read)."""
    hidden, weight = N * H * BYTES_BF16, V * H * BYTES_BF16
    if k.group_n:
        groups = math.ceil(N / (k.group_n * k.block_n))
        return hidden + groups * weight
    blocks = math.ceil(N / k.block_n)
    wave_blocks = min(blocks, device.sms)
    if wave_blocks * k.block_n * H * BYTES_BF16 <= device.l2_mb * 1e6:
        return hidden + math.ceil(blocks / wave_blocks) * weight
    splits_per_wave = max(1, device.sms // blocks)
    vocab_tiles = math.ceil(V / k.block_v)
    return hidden * vocab_tiles / splits_per_wave + weight * math.ceil(blocks / wave_blocks)


def _fused_s(k: Kernel, main: float, N: int, H: int, V: int, device: Device) -> float:
    """A fused kernel's time from its main loop's (``max(compute, HBM)``, seconds) and its per-tile overheads,
    added -- also with two CTAs per SM, where one's epilogue could run under the other's wgmma: the H100 did not
    show it (see the docstring's ``tma 2cta``)."""
    return main + _epilogue_and_overheads_s(N, H, V, k, device)


def forward_s(kind: str, N: int, H: int, V: int, device: Device) -> float:
    """The forward's predicted time (seconds) with the forward kernel ``kind``."""
    hbm = forward_hbm_bytes(kind, N, H, V, device) / device.hbm_bps
    if kind == "cublas":  # two kernels one after the other: the GEMM (writing float32), then the softmax pass
        gemm = max(one_gemm_s(N, H, V, device), (N * H + V * H) * BYTES_BF16 / device.hbm_bps + N * V * BYTES_F32 / device.hbm_bps)
        return gemm + N * V * BYTES_F32 / device.hbm_bps
    k = KERNELS[kind]
    main = max(gemm_flops(N, H, V) / device.tensor_flops(wgmma_efficiency(k.wgmma_n, device)), hbm)
    return _fused_s(k, main, N, H, V, device)


def backward_s(N: int, H: int, V: int, device: Device, dz_kernel: str = "dz") -> dict[str, float]:
    """The backward's phases (seconds): ``dz`` (GEMM 2 + dz written), ``dh`` (dz @ W), ``dW`` (dz.T @ hidden), in
    the loop order rlkernels.fused_linear._vocab_outer picks. Vocabulary outer (N < V, the contract's sizes): per
    chunk of ``vc`` columns (dz ``[N, vc]`` within DZ_BUDGET_BYTES) the dz kernel reads hidden once (its grid runs
    a group of token blocks fastest, so a group's hidden rows stay in L2) and the chunk's weight once per group,
    ``dh += dz @ W_j`` reads and writes the float32 ``[N, H]`` accumulator, and ``d_weight[j]`` is written once in
    bf16 by its GEMM, which reads the slice too (beta = 1: the label residuals added inside it), after a memset of
    the slice and the residuals' per-label sums (a ``[N, H]`` float32 product written, read, summed; neither
    overlaps a GEMM: added). Tokens outer: per token chunk the whole weight, and ``dW`` accumulated in a float32
    ``[V, H]`` buffer read and written per chunk, then cast. ``dz_kernel``: one of ``DZ_KERNELS``; ``dz cublas``
    (after the cuBLAS forward, vocabulary outer only): per chunk a cuBLAS GEMM writing the float32 logits tile (at
    cuBLAS's rate, or its bytes' time if slower), then the tile dz kernel reading it and writing dz (memory-bound,
    added: two kernels one after the other); its float32 tile shares the dz budget, so its chunks are narrower."""
    cublas = dz_kernel == "dz cublas"
    k = KERNELS["dz" if cublas else dz_kernel]
    hidden, weight = N * H * BYTES_BF16, V * H * BYTES_BF16
    dz_bytes = N * V * BYTES_BF16
    gemm = one_gemm_s(N, H, V, device)
    groups = math.ceil(N / (k.group_n * k.block_n))
    if N < V:
        per_col = N * (BYTES_BF16 + (BYTES_F32 if cublas else 0))  # dz's bytes (and the float32 tile's) per column
        block_v = CUBLAS_DZ_BLOCK_V if cublas else k.block_v
        vc = min(V, max(block_v, DZ_BUDGET_BYTES // per_col // block_v * block_v))
        chunks = math.ceil(V / vc)
        dz_hbm = chunks * hidden + groups * weight + dz_bytes
        dh_hbm = dz_bytes + weight + chunks * 2 * N * H * BYTES_F32
        dw_hbm = dz_bytes + chunks * hidden + 2 * weight
        dw_extra = (weight + 3 * N * H * BYTES_F32) / device.hbm_bps  # the slices' memsets, the residual sums
    else:
        assert not cublas, "the cuBLAS dz is modelled vocabulary outer (N < V) only"
        chunk = max(k.block_n, DZ_BUDGET_BYTES // (V * BYTES_BF16) // k.block_n * k.block_n)
        chunks = math.ceil(N / chunk)
        acc = V * H * BYTES_F32
        dz_hbm = chunks * weight + hidden + dz_bytes
        dh_hbm = dz_bytes + chunks * weight + N * H * BYTES_BF16
        # the first chunk writes the accumulator, every later one reads and writes it, the cast reads it once more
        # and writes dW in bf16: acc * (1 + 2 (chunks - 1) + 1) = 2 chunks acc
        dw_hbm = dz_bytes + hidden + 2 * chunks * acc + weight
        dw_extra = 0.0
    if cublas:  # the GEMMs write the float32 tiles; the tile kernel reads them and writes dz
        tile_bytes = N * V * BYTES_F32
        dz = max(gemm, (chunks * hidden + weight + tile_bytes) / device.hbm_bps)
        dz += (tile_bytes + dz_bytes) / device.hbm_bps
    else:
        dz = max(gemm_flops(N, H, V) / device.tensor_flops(wgmma_efficiency(k.wgmma_n, device)),
                 dz_hbm / device.hbm_bps)
        dz = _fused_s(k, dz, N, H, V, device)
    return {"dz": dz, "dh": max(gemm, dh_hbm / device.hbm_bps), "dW": max(gemm, dw_hbm / device.hbm_bps) + dw_extra}


def predict(device: Device, N: int = N_TOKENS, H: int = HIDDEN, V: int = VOCABS[0]) -> dict:
    """Every phase's predicted time (ms) at one size, each forward kernel, and the ratios to four GEMMs.
    ``backward_ms``: the backward's phases after the default forward (``split``: the pointer dz kernel);
    ``backward_by_dz_ms``: the same for each dz kernel; ``fwd_bwd_ms[kind]``: the forward ``kind`` and the backward
    with the dz kernel that follows it (``DZ_AFTER``)."""
    gemm_ms = one_gemm_s(N, H, V, device) * 1e3
    by_dz = {dz: {k: v * 1e3 for k, v in backward_s(N, H, V, device, dz).items()} for dz in DZ_KERNELS}
    fwd = {kind: forward_s(kind, N, H, V, device) * 1e3 for kind in FORWARDS}
    total = {kind: t + sum(by_dz[DZ_AFTER[kind]].values()) for kind, t in fwd.items()}
    return {
        "device": device.name, "N": N, "H": H, "V": V,
        "one_gemm_ms": gemm_ms, "four_gemms_ms": 4 * gemm_ms,
        "forward_ms": fwd, "forward_gb": {k: forward_hbm_bytes(k, N, H, V, device) / 1e9 for k in fwd},
        "backward_ms": by_dz[DZ_AFTER["split"]], "backward_by_dz_ms": by_dz, "fwd_bwd_ms": total,
        "fwd_bwd_vs_four_gemms": {k: t / (4 * gemm_ms) for k, t in total.items()},
        "fwd_vs_one_gemm": {k: t / gemm_ms for k, t in fwd.items()},
    }


def predictions(devices=None) -> list[dict]:
    """The model at every contract size on every device (``DEVICES`` by default)."""
    return [predict(d, N_TOKENS, HIDDEN, V) for d in (devices or DEVICES.values()) for V in VOCABS]


def device_from_ceilings(name: str, matmul_tflops: float, copy_gbps: float, like: str = "H100") -> Device:
    """A :class:`Device` whose cuBLAS rate and copy bandwidth are the ones measured in a ``make gpu`` run (``copy_gbps``
    counts bytes read and written, as bench.harness measures it) and whose peak and L2 are ``like``'s datasheet
    figures."""
    base = DEVICES[like]
    return Device(name, base.peak_tflops, base.hbm_tbps, base.l2_mb, base.sms,
                  gemm_efficiency=matmul_tflops / base.peak_tflops, copy_efficiency=copy_gbps / 1e3 / base.hbm_tbps)


def format_prediction(p: dict) -> str:
    dz_tma, dz_cublas = (p["backward_by_dz_ms"][k]["dz"] for k in ("dz tma", "dz cublas"))
    lines = [f"{p['device']}  N={p['N']} H={p['H']} V={p['V']} bf16: one GEMM {p['one_gemm_ms']:.2f} ms, "
             f"four {p['four_gemms_ms']:.2f} ms; backward dz {p['backward_ms']['dz']:.2f} (after the Hopper forward "
             f"{dz_tma:.2f}, after cublas {dz_cublas:.2f}) + dh {p['backward_ms']['dh']:.2f} "
             f"+ dW {p['backward_ms']['dW']:.2f} ms"]
    for kind, t in p["forward_ms"].items():
        lines.append(f"  forward {kind:<11} {t:6.2f} ms ({p['fwd_vs_one_gemm'][kind]:.2f}x one GEMM, "
                     f"{p['forward_gb'][kind]:5.1f} GB HBM)   fwd+bwd {p['fwd_bwd_ms'][kind]:6.2f} ms "
                     f"({p['fwd_bwd_vs_four_gemms'][kind]:.2f}x four GEMMs)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print("Roofline model of linear_logprobs fwd+bwd (a prediction; `make gpu` measures). Assumptions: bench/model.py")
    for p in predictions():
        print(format_prediction(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
