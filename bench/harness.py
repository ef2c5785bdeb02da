"""The benchmark harness every ``bench/bench_<module>.py`` plugs into.

A module exposes ``cases(device: torch.device, quick: bool) -> list[Case]``. A
``Case`` states the fewest bytes the op must move and the FLOPs it must do
(its bound), builds its inputs once, and names its providers (eager
reference, torch.compile, rlkernels, peers). The harness times each provider
(median of adaptively many samples), measures its peak extra memory, and turns
time into the fraction of the device's measured ceiling: bytes / time against
copy bandwidth, FLOPs / time against the matmul rate, whichever bound the case
names.

A ceiling is the best the device does: on the CPU, the fastest copy and matmul
over several sizes (cache-resident included) and thread counts, so no op can
exceed it (a fraction above 100% would mean the ceiling is wrong).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlkernels.testing import memory as _memory


@dataclass(frozen=True)
class Unavailable:
    """A provider that cannot run here; its row says why instead of a time."""

    reason: str  # e.g. "not installed (pip install liger-kernel)"


@dataclass
class Case:
    op: str  # e.g. "logprobs fwd+bwd"
    shape: str  # e.g. "N=4096 V=32000 bf16"
    bytes_moved: int  # fewest bytes through device memory: each input read once, each output written once
    flops: int  # fewest floating-point operations
    bound: str  # "memory" or "compute": which ceiling the fraction is against
    make_inputs: Callable[[], tuple]  # fresh inputs (random, never zeros)
    providers: dict[str, Callable[..., object] | Unavailable]  # provider -> one full step on the inputs
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
    speedup: float = float("nan")  # baseline's time / this provider's time
    vs_best_peer: float = float("nan")  # fastest peer's time / this provider's time (nan: no peer ran)
    error: str = ""  # the provider failed
    skipped: str = ""  # the provider cannot run here (not installed, needs CUDA)
    samples: int = 0  # timed samples the median is over


@dataclass
class Ceilings:
    """Measured once per run: what the device can do at best."""

    copy_gbps: float  # bytes read + written per second, device-to-device copy
    matmul_tflops: float  # large matrix product in the device's fast dtype (bf16 on CUDA, fp32 on CPU)
    device_name: str
    extra: dict = field(default_factory=dict)  # where each ceiling was reached (size, threads)


@dataclass(frozen=True)
class Timing:
    """How many samples to take: at least ``min_samples``, then until ``samples`` or ``budget_s``."""

    min_samples: int
    samples: int
    budget_s: float


QUICK = Timing(min_samples=6, samples=30, budget_s=3.0)
FULL = Timing(min_samples=7, samples=41, budget_s=8.0)
SAMPLE_S = 2e-3  # a sample repeats the call until it lasts this long: timer overhead < 0.1%


def peer(module: str, pip_name: str, device: torch.device, build: Callable[[], Callable]):
    """A peer provider: ``build()`` (which imports what it needs) when ``module`` imports and the device is
    CUDA; otherwise an :class:`Unavailable` row saying why (never an exception). The step returned is marked
    as a peer's (:func:`is_peer`), so each row can state its ratio to the fastest peer."""
    try:  # located, not imported (importing trl or liger on a CPU run costs seconds for a row that cannot run)
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return Unavailable(f"not installed (pip install {pip_name})")
    if device.type != "cuda":
        return Unavailable("needs a CUDA device (Triton kernels)")
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a broken install (a missing CUDA extension raises other errors)
        return Unavailable(f"not installed (pip install {pip_name})")
    try:
        step = build()
    except Exception as error:  # an API this bench does not know: reported, not fatal
        return Unavailable(f"unsupported version: {error!r}"[:100])

    def peer_step(*inputs):
        return step(*inputs)

    peer_step.is_peer = True
    return peer_step


def is_peer(provider) -> bool:
    """Whether a provider was made by :func:`peer` (another project's kernel, not eager/compile/rlkernels)."""
    return bool(getattr(provider, "is_peer", False))


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (no ``mmap`` per large block, no trimming), as a caching
    allocator does. PyTorch's CPU allocator does not cache: by default every large tensor is a fresh ``mmap``
    whose pages fault in on first touch, and that cost, which depends on the kernel's memory state rather
    than on the op, dominated memory-bound rows and moved them 2-4x between runs. Returns whether it applied
    (glibc only)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # <malloc.h>
    return bool(mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(M_TOP_PAD, 64 << 20))


class OtherLoad:
    """How much CPU time other processes took while samples were being timed: the machine's busy time
    (``/proc/stat``) less this process's own (``os.times``), as a fraction of all cores over the timed wall
    time. On a shared machine multi-threaded ops wait for descheduled threads, so timings taken beside other
    work are not reliable. (Only the timed windows count: compiling, which may use helper processes, does not.)"""

    def __init__(self):
        self.other_s = 0.0  # CPU-seconds others used inside the windows
        self.window_s = 0.0  # wall-seconds x cores of the windows

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):  # not Linux
            return None
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        return busy, sum(os.times()[:2]), time.monotonic()  # machine busy s, own user+system s, wall s

    @contextlib.contextmanager
    def window(self):
        start = self._read()
        try:
            yield
        finally:
            end = self._read()
            if start is not None and end is not None:
                self.other_s += max(0.0, (end[0] - start[0]) - (end[1] - start[1]))
                self.window_s += (end[2] - start[2]) * (os.cpu_count() or 1)

    def fraction(self) -> float:
        return self.other_s / self.window_s if self.window_s > 0 else 0.0

    def warning(self, threshold: float = 0.05) -> str:
        share = self.fraction()
        if share <= threshold:
            return ""
        return (f"warning: other processes used {share:.0%} of the CPU while samples were timed: CPU timings "
                "are not reliable; re-run on a quiet machine")


OTHER_LOAD = OtherLoad()  # accumulated over every timed sample of this process


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _gc_paused():
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # a collection inside a sample is noise, not the op's cost
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cpu_samples_ms(fn: Callable[[], object], timing: Timing) -> list[float]:
    """Per-call times (ms) of ``fn``: after one warm-up call, samples of ``k`` back-to-back calls (``k`` so a
    sample lasts ``SAMPLE_S``), at least ``min_samples``, then more until ``samples`` or ``budget_s``."""
    with _gc_paused():
        start = time.perf_counter()
        fn()
        once = time.perf_counter() - start
        k = max(1, math.ceil(SAMPLE_S / max(once, 1e-9)))
        out: list[float] = []
        began = time.perf_counter()
        with OTHER_LOAD.window():
            _sample_until(fn, k, timing, began, out)
        return out


def _sample_until(fn, k: int, timing: Timing, began: float, out: list[float]) -> None:
    while len(out) < timing.samples:
        start = time.perf_counter()
        for _ in range(k):
            fn()
        out.append((time.perf_counter() - start) * 1e3 / k)
        if len(out) >= timing.min_samples and time.perf_counter() - began >= timing.budget_s:
            break


def time_median_ms(fn: Callable[[], object], device: torch.device, timing: Timing) -> tuple[float, int]:
    """(median ms, number of samples)."""
    if device.type == "cuda":
        import triton.testing

        # do_bench repeats for `rep` ms and returns the median of its samples
        ms = triton.testing.do_bench(fn, warmup=100, rep=int(timing.budget_s * 1000), return_mode="median")
        return float(ms), -1
    samples = cpu_samples_ms(fn, timing)
    return statistics.median(samples), len(samples)


@contextlib.contextmanager
def env_set(name: str, value: str):
    """``os.environ[name] = value`` for the block, then as it was (unset if it was): a provider that times one
    setting of an environment switch (RLKERNELS_LINEAR_FWD, RLKERNELS_LOGITS_POLICY) without changing the others."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def with_env(name: str, value: str, step: Callable) -> Callable:
    """``step`` with the environment variable ``name`` set to ``value`` for each call (:func:`env_set`)."""

    def run(*args):
        with env_set(name, value):
            return step(*args)

    return run


def with_attr(obj, name: str, value, step: Callable) -> Callable:
    """``step`` with ``obj.name`` set to ``value`` for each call, then as it was: a provider that times one setting
    of a module constant (a tile configuration the launcher reads at each call) without changing the others."""

    def run(*args):
        old = getattr(obj, name)
        setattr(obj, name, value)
        try:
            return step(*args)
        finally:
            setattr(obj, name, old)

    return run


@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _thread_counts() -> list[int]:
    n = torch.get_num_threads()
    return sorted({1, n, *(2**k for k in range(1, n.bit_length()) if 2**k <= n)})


def measure_ceilings(device: torch.device, quick: bool, *, tiny: bool = False) -> Ceilings:
    """The device's copy bandwidth (bytes read + written per second) and matmul rate. CUDA: a 1 GiB
    device-to-device copy and a bf16 8192^3 product. CPU: the best over sizes and thread counts. ``tiny``
    (``python -m bench --gpu --dry-run``): one small copy and one small product, the same code path in
    well under a second."""
    if device.type == "cuda" or tiny:
        timing = Timing(3, 10, 1.0) if not tiny else Timing(3, 5, 0.0)
        n = 1 << 30 if not tiny else 1 << 20  # bytes copied
        src = torch.empty(n, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        ms, _ = time_median_ms(lambda: dst.copy_(src), device, timing)
        copy = 2 * n / ms / 1e6
        k = 8192 if not tiny else 128
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        a = torch.randn(k, k, device=device, dtype=dtype)  # [k, k] random: zeros multiply faster
        b = torch.randn(k, k, device=device, dtype=dtype)  # [k, k]
        ms, _ = time_median_ms(lambda: a @ b, device, timing)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{_machine()}"
        return Ceilings(copy, 2 * k**3 / ms / 1e9, name,
                        extra={"copy_at": _bytes(n), "matmul_at": f"{k}x{k} {str(dtype).removeprefix('torch.')}"})
    # The best of every size and thread count, each timed by its fastest sample: a ceiling, not a typical rate.
    timing = Timing(min_samples=5, samples=15, budget_s=0.15 if quick else 0.5)
    best_copy, best_mm = (0.0, ""), (0.0, "")
    copy_sizes = [1 << s for s in range(14, (27 if quick else 29), 2)]  # 16 KiB (L1) .. 64 MiB / 256 MiB (DRAM)
    for threads in _thread_counts():
        with _threads(threads):
            for n in copy_sizes:
                src = torch.empty(n, dtype=torch.uint8).random_()
                dst = torch.empty_like(src)
                ms = min(cpu_samples_ms(lambda: dst.copy_(src), timing))
                rate = 2 * n / ms / 1e6  # GB/s: n bytes read + n written
                if rate > best_copy[0]:
                    best_copy = (rate, f"{_bytes(n)}, {threads} thread{'s' * (threads > 1)}")
            for k in (256, 512, 1024) if quick else (256, 512, 1024, 2048):
                a, b = torch.randn(k, k), torch.randn(k, k)
                ms = min(cpu_samples_ms(lambda: a @ b, timing))
                rate = 2 * k**3 / ms / 1e9  # TFLOP/s
                if rate > best_mm[0]:
                    best_mm = (rate, f"{k}x{k} float32, {threads} thread{'s' * (threads > 1)}")
    return Ceilings(best_copy[0], best_mm[0], f"cpu-{_machine()}",
                    extra={"copy_at": best_copy[1], "matmul_at": best_mm[1]})


def _machine() -> str:
    import platform

    return f"{platform.machine()}-{torch.get_num_threads()}t"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# torch.profiler (the CPU memory meter) prints these from C++ on every start/stop: USDT/STAGE lines from Kineto
# and a once-per-process allocator warning. They say nothing about the benchmark.
_PROFILER_NOISE = re.compile(
    r"^(?:(?:USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\]"
    r"|\[W\S* \S+(?: \d+)? CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling)"
)


@contextlib.contextmanager
def profiler_output_filtered():
    """Run a block with the process's stderr (file descriptor 2: C++ writes there directly) captured, then
    replay every captured line except the profiler's own chatter."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [ln for ln in sink.read().decode(errors="replace").splitlines(True) if not _PROFILER_NOISE.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def measure_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak memory allocated during one call above what was live before (deterministic on the CPU)."""
    if device.type == "cuda":
        return _memory.measure(step, device).peak_bytes
    with profiler_output_filtered():
        return _memory.measure(step, device).peak_bytes


def interleaved_samples_ms(steps: dict[str, Callable[[], object]], timing: Timing) -> dict[str, list[float]]:
    """Per-call times (ms) of several CPU steps, sampled round-robin (the starting step rotates each round), so
    a slow drift of the machine's speed affects every provider alike. Each sample repeats its step ``k`` times
    (``k`` so a sample lasts ``SAMPLE_S``); rounds go on until every step has ``min_samples`` and the case's
    budget (``budget_s`` per step) is spent, or until ``samples`` rounds."""
    names = list(steps)
    out: dict[str, list[float]] = {n: [] for n in names}
    with _gc_paused():
        reps = {}
        for n in names:
            start = time.perf_counter()
            steps[n]()
            reps[n] = max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - start, 1e-9)))
        began = time.perf_counter()
        with OTHER_LOAD.window():
            for round_ in range(timing.samples):
                for i in range(len(names)):
                    n = names[(round_ + i) % len(names)]
                    start = time.perf_counter()
                    for _ in range(reps[n]):
                        steps[n]()
                    out[n].append((time.perf_counter() - start) * 1e3 / reps[n])
                if round_ + 1 >= timing.min_samples and time.perf_counter() - began >= timing.budget_s * len(names):
                    break
    return out


@dataclass
class _Measured:
    """What the passes over one provider collected."""

    samples: list[float] = field(default_factory=list)  # ms per call
    peak: int | None = None  # bytes, from the first pass
    error: str = ""
    skipped: str = ""


def _measure_case(case: Case, device: torch.device, timing: Timing, out: dict[str, _Measured]) -> None:
    """One pass over ``case``: warm each provider on fresh inputs, measure its peak memory (first pass only),
    then time it (CPU: all providers interleaved, each keeping its inputs meanwhile), appending to ``out``."""
    ready: dict[str, tuple[Callable[[], object], tuple]] = {}  # CPU: name -> (step, its inputs)
    for name, fn in case.providers.items():
        got = out.setdefault(name, _Measured())
        if isinstance(fn, Unavailable):
            got.skipped = fn.reason
            continue
        if got.error:
            continue
        inputs = case.make_inputs()
        step = (lambda fn, inputs: lambda: fn(*inputs))(fn, inputs)
        try:
            step()  # compile / warm caches outside the measurements
            synchronize(device)
            if got.peak is None:
                got.peak = measure_peak_bytes(step, device)
            if device.type == "cpu":
                ready[name] = (step, inputs)
                continue
            ms, _ = time_median_ms(step, device, timing)
            got.samples.append(ms)
        except Exception as error:  # a provider that fails is reported, not fatal
            got.error = repr(error)[:600]
        finally:
            del inputs, step
    if ready:
        try:
            for name, times in interleaved_samples_ms({n: v[0] for n, v in ready.items()}, timing).items():
                out[name].samples.extend(times)
        except Exception as error:
            for name in ready:
                out[name].error = repr(error)[:600]
        ready.clear()


def _rows(case: Case, measured: dict[str, _Measured], ceilings: Ceilings) -> list[Row]:
    nan = float("nan")
    rows = []
    for name in case.providers:
        got = measured[name]
        if got.skipped or got.error or not got.samples:
            error = "" if got.skipped else (got.error or "no samples")
            rows.append(Row(case.op, case.shape, name, nan, nan, "", nan, nan, error=error, skipped=got.skipped))
        else:
            rows.append(_timed_row(case, name, statistics.median(got.samples), len(got.samples), got.peak, ceilings))
    base = next((r for r in rows if r.provider == case.baseline), None)
    if base is not None and base.median_ms == base.median_ms:
        for r in rows:
            r.speedup = base.median_ms / r.median_ms
    peer_ms = [r.median_ms for r in rows if is_peer(case.providers[r.provider]) and r.median_ms == r.median_ms]
    if peer_ms:
        for r in rows:
            r.vs_best_peer = min(peer_ms) / r.median_ms
    return rows


def default_passes(device: torch.device) -> int:
    """CPU: three passes over all cases, so each row's median mixes three time windows and a slow spell of the
    machine (which moves every op alike for seconds at a time) shifts at most a third of its samples."""
    return 3 if device.type == "cpu" else 1


def run_cases(cases: list[Case], device: torch.device, ceilings: Ceilings, *, quick: bool, passes: int | None = None,
              progress: Callable[[list[Row]], None] | None = None, timing: Timing | None = None) -> list[Row]:
    """Rows for every case: median time over ``passes`` passes (each taking ``1/passes`` of the case's samples
    and budget), rate, fraction of the ceiling, peak memory, speedup over the baseline and ratio to the fastest
    peer. ``progress`` gets each case's rows as its last pass finishes. ``timing`` overrides the sampling
    (default: ``QUICK`` or ``FULL``)."""
    timing = timing or (QUICK if quick else FULL)
    passes = passes or default_passes(device)
    share = Timing(max(1, math.ceil(timing.min_samples / passes)), max(1, math.ceil(timing.samples / passes)),
                   timing.budget_s / passes)
    measured: list[dict[str, _Measured]] = [{} for _ in cases]
    rows: list[Row] = []
    for p in range(passes):
        for case, got in zip(cases, measured):
            _measure_case(case, device, share, got)
            if p == passes - 1:
                case_rows = _rows(case, got, ceilings)
                rows.extend(case_rows)
                if progress is not None:
                    progress(case_rows)
    return rows


def run_cases_in_sweeps(cases: list[Case], device: torch.device, ceilings: Ceilings, timing: Timing,
                        sweeps: list[Callable[[str], bool]], time_left: Callable[[], float],
                        progress: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Rows for every case, measured in sweeps over all cases: sweep ``k`` measures the providers whose name
    ``sweeps[k]`` accepts, one pass each. Once ``time_left()`` is negative, what is still to measure becomes a
    row skipped with "not run: time budget spent". Under a short time budget the cheap providers of every case
    come first (e.g. torch.compile, which compiles for tens of seconds per function, in the last sweep).
    ``progress`` gets the rows measured in each (case, sweep) as they finish."""
    measured: list[dict[str, _Measured]] = [{} for _ in cases]
    for accept in sweeps:
        for case, got in zip(cases, measured):
            names = [n for n in case.providers if accept(n) and n not in got]
            if not names:
                continue
            if time_left() < 0:
                for n in names:
                    got[n] = _Measured(skipped="not run: time budget spent")
                continue
            part = dataclasses.replace(case, providers={n: case.providers[n] for n in names})
            _measure_case(part, device, timing, got)
            if progress is not None:
                progress(_rows(part, got, ceilings))
    rows: list[Row] = []
    for case, got in zip(cases, measured):
        for n in case.providers:
            got.setdefault(n, _Measured(skipped="not run: no sweep measures it"))
        rows.extend(_rows(case, got, ceilings))
    return rows


def run_case(case: Case, device: torch.device, ceilings: Ceilings, *, quick: bool, passes: int = 1) -> list[Row]:
    """The rows of one case (see :func:`run_cases`)."""
    return run_cases([case], device, ceilings, quick=quick, passes=passes)


def _timed_row(case: Case, name: str, ms: float, n: int, peak: int, ceilings: Ceilings) -> Row:
    if case.bound == "memory":
        rate, unit, ceiling = case.bytes_moved / ms / 1e6, "GB/s", ceilings.copy_gbps
    else:
        rate, unit, ceiling = case.flops / ms / 1e9, "TFLOP/s", ceilings.matmul_tflops
    return Row(case.op, case.shape, name, ms, rate, unit, rate / ceiling, peak / 2**20, samples=n)


_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0))


def format_rate(rate: float, unit: str) -> str:
    """A rate with three significant digits, its SI prefix chosen so the number is >= 1: ``0.041 TFLOP/s``
    prints as ``41.0 GFLOP/s``, ``0.0031 GB/s`` as ``3.10 MB/s``."""
    if not math.isfinite(rate) or not unit:
        return ""
    base = {"T": 1e12, "G": 1e9, "M": 1e6}.get(unit[0], 1.0)
    quantity = unit[1:] if unit[0] in "TGM" else unit  # "FLOP/s", "B/s"
    value = rate * base
    for prefix, scale in _PREFIXES:
        if abs(value) >= scale or prefix == "":
            v = value / scale
            digits = 2 if abs(v) < 10 else 1 if abs(v) < 100 else 0
            return f"{v:.{digits}f} {prefix}{quantity}"
    return ""


def _ms(ms: float) -> str:
    """Four significant digits without an exponent: 0.07634, 1.234, 1448."""
    if ms >= 1000:
        return f"{ms:.0f}"
    return f"{ms:.{max(0, 3 - math.floor(math.log10(ms)))}f}" if ms > 0 else f"{ms:g}"


def _fraction(x: float) -> str:
    return f"{x:.2%}" if x < 0.1 else f"{x:.1%}"


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table (header, rule, one line per row)."""
    w_op = max([26, *(len(r.op) for r in rows)])
    w_shape = max([30, *(len(r.shape) for r in rows)])
    w_prov = max([16, *(len(r.provider) for r in rows)])
    header = (f"{'op':<{w_op}} {'shape':<{w_shape}} {'provider':<{w_prov}} {'median ms':>10} {'rate':>14} "
              f"{'of bound':>9} {'peak MiB':>10} {'speedup':>8} {'vs peer':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        head = f"{r.op:<{w_op}} {r.shape:<{w_shape}} {r.provider:<{w_prov}}"
        if r.skipped:
            lines.append(f"{head} {r.skipped}")
        elif r.error:
            lines.append(f"{head} failed: {r.error}")
        else:
            lines.append(
                f"{head} {_ms(r.median_ms):>10} {format_rate(r.rate, r.rate_unit):>14} "
                f"{_fraction(r.fraction_of_bound):>9} {r.peak_mib:10.1f} {r.speedup:7.2f}x"
                + (f" {r.vs_best_peer:7.2f}x" if r.vs_best_peer == r.vs_best_peer else "")
            )
    return "\n".join(lines)


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]
