"""Deterministic peak-memory measurement on the CPU (and CUDA), for tests and benchmarks.

CUDA has ``torch.cuda.max_memory_allocated``; the CPU allocator keeps no such
counter, so on the CPU we replay the allocator's own events as recorded by
``torch.profiler`` (``profile_memory=True``): every allocation and free in
order, summed to a running total. The result depends only on what was
allocated, never on timing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class MemoryReport:
    peak_bytes: int  # highest sum of live bytes allocated inside the call, above what was live before
    largest_bytes: int  # the largest single allocation inside the call


def _allocation_events(prof) -> list[tuple[int, int]]:
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if str(node.tag).endswith("Allocation"):
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, int(fields.alloc_size)))
    events.sort()
    return events


def measure_cpu(fn: Callable[[], object]) -> MemoryReport:
    """Run ``fn`` once and report the CPU memory it allocated (peak above the start)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = largest = 0
    for _, size in _allocation_events(prof):
        current += size
        peak = max(peak, current)
        largest = max(largest, size)
    return MemoryReport(peak_bytes=peak, largest_bytes=largest)


def measure_cuda(fn: Callable[[], object], device=None) -> MemoryReport:
    """Run ``fn`` once and report the CUDA memory it allocated above what was live before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return MemoryReport(peak_bytes=peak, largest_bytes=-1)  # CUDA keeps no per-allocation record


def measure(fn: Callable[[], object], device: torch.device | str = "cpu") -> MemoryReport:
    device = torch.device(device)
    return measure_cuda(fn, device) if device.type == "cuda" else measure_cpu(fn)
