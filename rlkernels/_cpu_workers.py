"""Coarse-grained CPU parallelism for the chunked torch paths: a few long single-threaded tasks instead of many
short two-thread ops.

A chunked CPU path issues thousands of small ops (a GEMM and a few elementwise passes per L2-sized tile). Run with
PyTorch's intra-op threads, every one of them ends in a barrier across all threads; when another process takes a
core, each barrier waits for a descheduled thread (up to a scheduler time slice) and the op runs several times
slower than one big op would. Here the caller's ``torch.get_num_threads()`` threads each run a share of the tiles
with single-threaded ops, and meet once at the end: the scheduler's fairness evens out over the whole call, not
per op. The ops release the GIL, so the threads overlap.

:func:`run` hands each worker its own index; the worker decides what it computes from it (a static split keeps the
results bit-for-bit reproducible at a given thread count; a shared counter balances load where the order of work
cannot change the result).
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future, wait
from typing import Callable

import torch

_lock = threading.Lock()
_pools: dict[tuple[int, int], list[queue.SimpleQueue]] = {}  # (process id, workers) -> each worker's inbox


def _worker(inbox: queue.SimpleQueue, started: threading.Barrier) -> None:
    # get_num_threads first: it runs PyTorch's once-per-thread lazy initialisation, which would otherwise later
    # reset this thread to the process-wide count; then one thread for this thread's OpenMP and MKL calls
    torch.get_num_threads()
    torch.set_num_threads(1)
    started.wait()
    while True:
        task, i, future = inbox.get()
        if future.set_running_or_notify_cancel():
            try:
                with torch.no_grad():  # a new thread starts with grad mode on; the tasks write with out=
                    result, error = task(i), None
            except BaseException as raised:  # handed to the caller
                result, error = None, raised
            # drop the task before the caller resumes: its closure may hold the caller's outputs (a gradient
            # still referenced here would be copied, not stolen, by autograd's AccumulateGrad)
            del task
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
            del result, error
        del future


def _pool(workers: int) -> list[queue.SimpleQueue]:
    key = (os.getpid(), workers)  # a forked child starts its own threads
    with _lock:
        inboxes = _pools.get(key)
        if inboxes is None:
            caller = torch.get_num_threads()
            started = threading.Barrier(workers + 1)
            inboxes = [queue.SimpleQueue() for _ in range(workers)]
            for k, inbox in enumerate(inboxes):
                threading.Thread(target=_worker, args=(inbox, started), name=f"rlkernels-cpu-{k}", daemon=True).start()
            started.wait()
            # set_num_threads(1) in a worker also set the count new threads start with: give it back
            torch.set_num_threads(caller)
            _pools[key] = inboxes
    return inboxes


def workers() -> int:
    """How many workers :func:`run` uses: the caller's intra-op thread count."""
    return max(1, torch.get_num_threads())


def run(task: Callable[[int], object], count: int) -> list:
    """``[task(0), ..., task(count - 1)]``, task ``i`` on worker ``i`` (each its own single-threaded thread); the
    first exception raised by a task is raised here, after every task has ended. In the calling thread, one task
    after another, when ``count`` is 1, or a Python dispatch mode or the profiler is active: both observe the thread
    that enabled them only, so the workers' ops would go unseen (a memory measurement would miss their buffers; run
    one after another, the tasks' own scratch buffers are counted once, not ``count`` times)."""
    if count <= 1 or torch._C._len_torch_dispatch_stack() > 0 or torch._C._autograd._profiler_enabled():
        return [task(i) for i in range(count)]
    futures = []
    for i, inbox in enumerate(_pool(count)):
        futures.append(Future())
        inbox.put((task, i, futures[-1]))
    wait(futures)
    return [f.result() for f in futures]
