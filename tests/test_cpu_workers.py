"""rlkernels._cpu_workers: single-threaded workers for the chunked torch paths."""
from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkernels import _cpu_workers


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _where(i):
    return i, threading.get_ident(), torch.get_num_threads()


def test_each_task_runs_on_its_own_single_threaded_worker(two_threads):
    out = _cpu_workers.run(_where, 2)
    assert [i for i, _, _ in out] == [0, 1]
    assert len({ident for _, ident, _ in out} | {threading.get_ident()}) == 3  # two workers, not the caller
    assert [n for _, _, n in out] == [1, 1]  # their ops take one thread each
    assert torch.get_num_threads() == 2  # the caller keeps its threads
    # a thread started afterwards starts with the caller's count, not the workers' one
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [2]


def test_tasks_run_without_grad_mode(two_threads):
    x = torch.ones(3, requires_grad=True)
    out = torch.empty(3)

    def write(i):
        torch.mul(x, 2.0, out=out)  # raises under grad mode (out= with an input requiring grad)
        return torch.is_grad_enabled()

    assert _cpu_workers.run(write, 2) == [False, False]


def test_an_exception_is_raised_after_every_task_ended(two_threads):
    done = []

    def task(i):
        if i == 0:
            raise ValueError("boom")
        done.append(i)

    with pytest.raises(ValueError, match="boom"):
        _cpu_workers.run(task, 2)
    assert done == [1]


def test_one_worker_or_a_dispatch_mode_runs_in_the_calling_thread(two_threads):
    me = threading.get_ident()
    assert [ident for _, ident, _ in _cpu_workers.run(_where, 1)] == [me]

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():  # modes are per thread: a worker would run outside it
        assert [ident for _, ident, _ in _cpu_workers.run(_where, 2)] == [me, me]
    with torch.profiler.profile():  # so is the profiler (and the memory measurement built on it)
        assert [ident for _, ident, _ in _cpu_workers.run(_where, 2)] == [me, me]


def test_workers_keep_no_reference_to_a_finished_task(two_threads):
    """A task's closure may hold the caller's outputs: a gradient still referenced elsewhere is copied by autograd
    instead of stolen (once a weight-sized copy). The workers drop each task before the caller resumes."""
    grad = torch.zeros(4)
    ref = weakref.ref(grad)

    def task(i, held=grad):
        return i

    assert _cpu_workers.run(task, 2) == [0, 1]
    del task, grad
    assert ref() is None
