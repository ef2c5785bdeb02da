"""The benchmark harness every ``bench/bench_<module>.py`` plugs into.

A module exposes ``cases(device: torch.device, quick: bool) -> list[Case]``. A
``Case`` states the fewest bytes the op must move and the FLOPs it must do
(its bound), builds its inputs once, and names its providers (eager
reference, torch.compile, rlkernels, peers). The harness times each provider
(median), measures its peak extra memory, and turns time into the fraction of
the device's measured ceiling: bytes / time against copy bandwidth, FLOPs /
time against the matmul rate, whichever bound the case names.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlkernels import _memory


@dataclass
class Case:
    op: str  # e.g. "logprobs fwd+bwd"
    shape: str  # e.g. "N=4096 V=32000 bf16"
    bytes_moved: int  # fewest bytes through device memory: each input read once, each output written once
    flops: int  # fewest floating-point operations
    bound: str  # "memory" or "compute": which ceiling the fraction is against
    make_inputs: Callable[[], tuple]  # fresh inputs (random, never zeros)
    providers: dict[str, Callable[..., object]]  # provider -> one full step on the inputs (fwd+bwd where it applies)
    baseline: str = "eager"  # the provider speedups are measured against


@dataclass
class Row:
    op: str
    shape: str
    provider: str
    median_ms: float
    rate: float  # GB/s (memory bound) or TFLOP/s (compute bound)
    rate_unit: str
    fraction_of_bound: float
    peak_mib: float
    speedup: float = float("nan")
    error: str = ""


@dataclass
class Ceilings:
    """Measured once per run: what the device can do at best."""

    copy_gbps: float  # bytes read + written per second, device-to-device copy
    matmul_tflops: float  # large matrix product in the device's fast dtype (bf16 on CUDA, fp32 on CPU)
    device_name: str
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25 * warmup, rep=25 * reps, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: torch.device, quick: bool) -> Ceilings:
    if device.type == "cuda":
        n = 1 << 30  # 1 GiB copy
        src = torch.empty(n, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        ms = time_median_ms(lambda: dst.copy_(src), device, warmup=3, reps=10)
        copy = 2 * n / ms / 1e6
        k = 8192
        a = torch.randn(k, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, k, device=device, dtype=torch.bfloat16)
        ms = time_median_ms(lambda: a @ b, device, warmup=3, reps=10)
        return Ceilings(copy, 2 * k**3 / ms / 1e9, torch.cuda.get_device_name(device))
    # A ceiling is the best the machine does: the fastest of several runs, not the median.
    n = (64 if quick else 256) << 20
    src = torch.empty(n, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = min(time_median_ms(lambda: dst.copy_(src), device, warmup=1, reps=1) for _ in range(7))
    copy = 2 * n / ms / 1e6
    k = 2048
    a, b = torch.randn(k, k), torch.randn(k, k)
    ms = min(time_median_ms(lambda: a @ b, device, warmup=1, reps=1) for _ in range(7))
    import platform

    return Ceilings(copy, 2 * k**3 / ms / 1e9, f"cpu-{platform.machine()}-{torch.get_num_threads()}t")


def run_case(case: Case, device: torch.device, ceilings: Ceilings, *, quick: bool) -> list[Row]:
    rows = []
    warmup, reps = (1, 3) if quick and device.type == "cpu" else (3, 10)
    for name, fn in case.providers.items():
        inputs = case.make_inputs()
        step = lambda: fn(*inputs)  # noqa: E731
        try:
            step()  # compile / warm caches outside the measurements
            _sync(device)
            peak = _memory.measure(step, device).peak_bytes
            ms = time_median_ms(step, device, warmup=warmup, reps=reps)
        except Exception as error:  # a provider that fails is reported, not fatal
            rows.append(Row(case.op, case.shape, name, float("nan"), float("nan"), "", float("nan"), float("nan"), error=repr(error)[:120]))
            continue
        finally:
            del inputs
        if case.bound == "memory":
            rate, unit, ceiling = case.bytes_moved / ms / 1e6, "GB/s", ceilings.copy_gbps
        else:
            rate, unit, ceiling = case.flops / ms / 1e9, "TFLOP/s", ceilings.matmul_tflops
        rows.append(Row(case.op, case.shape, name, ms, rate, unit, rate / ceiling, peak / 2**20))
    base = next((r for r in rows if r.provider == case.baseline and r.median_ms == r.median_ms), None)
    if base is not None:
        for r in rows:
            r.speedup = base.median_ms / r.median_ms
    return rows


def format_table(rows: list[Row]) -> str:
    header = f"{'op':<26} {'shape':<30} {'provider':<16} {'median ms':>10} {'rate':>14} {'of bound':>9} {'peak MiB':>10} {'speedup':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.error:
            lines.append(f"{r.op:<26} {r.shape:<30} {r.provider:<16} failed: {r.error}")
            continue
        rate = f"{r.rate:8.1f} {r.rate_unit}"
        lines.append(
            f"{r.op:<26} {r.shape:<30} {r.provider:<16} {r.median_ms:10.3f} {rate:>14} {r.fraction_of_bound:8.1%} {r.peak_mib:10.1f} {r.speedup:7.2f}x"
        )
    return "\n".join(lines)


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]
