"""Shared test helpers: tolerances (stated once, per dtype), truth comparisons, backends."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Relative error ‖out − truth‖ / ‖truth‖ allowed against the float64 reference,
# by the dtype of the inputs. Outputs are float32 whatever the input dtype, so
# the bound is set by how the inputs were rounded, not by the kernel.
REL_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# A kernel must be at least as close to the truth as eager PyTorch in the same
# dtype: its error may exceed eager's only by this factor (plus a float32 floor).
EAGER_SLACK = 1.5
FLOOR = 1e-6


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backends(device: str) -> list[str]:
    """Every backend the machine can run for tensors on ``device`` (triton on CPU = its interpreter); none for
    ``cuda`` without a GPU. Ops with a csrc kernel add ``csrc`` themselves (tests/test_advantages.py)."""
    if device == "cuda" and not torch.cuda.is_available():
        return []
    out = ["reference", "torch"]
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401

        out.append("triton")
    return out


@contextlib.contextmanager
def forced_backend(name: str | None):
    """Force ``RLKERNELS_BACKEND`` for the duration of a block."""
    old = os.environ.get("RLKERNELS_BACKEND")
    if name is None:
        os.environ.pop("RLKERNELS_BACKEND", None)
    else:
        os.environ["RLKERNELS_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RLKERNELS_BACKEND", None)
        else:
            os.environ["RLKERNELS_BACKEND"] = old


def rel_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    out, truth = out.detach().double().cpu(), truth.detach().double().cpu()
    if torch.isnan(out).any() or torch.isnan(truth).any():
        return float("inf") if not torch.equal(torch.isnan(out), torch.isnan(truth)) else rel_error(
            torch.nan_to_num(out), torch.nan_to_num(truth)
        )
    denom = truth.norm().item()
    num = (out - truth).norm().item()
    return num / denom if denom > 0 else num


def assert_close_to_truth(out, truth, dtype, *, eager=None, name="output", tol=None):
    """``out`` is within the dtype's tolerance of the float64 ``truth`` and, when
    ``eager`` (PyTorch in the same input dtype) is given, not meaningfully worse than it."""
    assert out.shape == truth.shape, f"{name}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    err = rel_error(out, truth)
    bound = REL_TOL[dtype] if tol is None else tol
    assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.1e} ({dtype})"
    if eager is not None:
        eager_err = rel_error(eager, truth)
        assert err <= EAGER_SLACK * eager_err + FLOOR, (
            f"{name}: relative error {err:.3e} is worse than eager PyTorch's {eager_err:.3e} ({dtype})"
        )
    return err


def noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x``, as a non-contiguous slice of a wider tensor."""
    wide = torch.empty(*x.shape[:-1], x.shape[-1] * 2 + 3, dtype=x.dtype, device=x.device)
    wide.normal_()
    view = wide[..., 1 : 1 + 2 * x.shape[-1] : 2]
    view.copy_(x)
    assert not view.is_contiguous()
    return view


def alias_bundled_trainer() -> None:
    """Make ``rlkernels.trainer`` importable from a plain checkout (run with ``PYTHONPATH=.`` and no
    ``pip install``, as on a GPU machine that cannot install): an installed package maps ``trainer/`` to
    ``rlkernels.trainer`` (pyproject's package-dir); without the install, the checkout's root is added to
    ``rlkernels.__path__`` so ``rlkernels.trainer`` is found as ``<root>/trainer``. No-op when it imports."""
    import importlib.util

    import rlkernels

    try:
        if importlib.util.find_spec("rlkernels.trainer") is not None:
            return
    except ImportError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "trainer", "__init__.py")) and root not in rlkernels.__path__:
        rlkernels.__path__.append(root)


def nvcc_or_skip() -> str:
    """The CUDA compiler's path (``PATH``, else ``/usr/local/bin/nvcc``); without one the calling test is skipped:
    the CUDA sources can only be compiled where the toolkit is installed (CI's machines have it)."""
    import shutil

    import pytest

    found = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
    if found is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed: the csrc CUDA sources cannot be compiled here")
    return found


def on_device(device, *tensors: torch.Tensor, keep_offset: bool = False) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` with their strides kept (``Tensor.to`` makes a sliced or strided view
    contiguous on another device, which would test another layout); the same objects when already there.
    ``keep_offset``: each also starts as far into a fresh storage as it does into its own (a slice ``x[1:]`` of
    float32 stays 4 bytes past a 16-byte boundary), for tests of the kernels' misaligned paths."""
    device = torch.device(device)

    def moved(t):
        if t.device == device:
            return t
        if not keep_offset or t.storage_offset() == 0 or t.numel() == 0:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)
        span = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1  # elements
        storage = torch.empty(span, dtype=t.dtype, device=device)  # [span]
        return storage.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(t)

    return tuple(moved(t) for t in tensors)


def recording_head(rows: list):
    """A ``linear_logprobs`` stand-in for ``rlkernels.hf.response_logprobs(..., linear_logprobs=)`` that appends the
    shape of every ``hidden`` [N, H] it is given to ``rows``, asserts no row is an ignored one, and computes the
    real op: so a test sees which rows reach the head."""
    import rlkernels

    def recording(hidden, weight, labels, **kwargs):  # hidden [N, H], labels [N]
        rows.append(tuple(hidden.shape))
        assert bool((labels != -100).all())
        return rlkernels.linear_logprobs(hidden, weight, labels, **kwargs)

    return recording


def in_gloo_group(rank: int | None, world: int | None, init_method: str | None, work, *args,
                  timeout_s: float | None = 120.0):
    """``work(*args)`` in a spawned test worker, inside a gloo process group (``init_method=None``: torchrun's
    environment gives rank and world size). One intra-op thread per process (the machine has few cores) and a
    ``timeout_s`` timeout (None: torch's 30 minutes): a rank that died fails its peers instead of holding them. When ``work``
    has returned, its objects are gone (its locals; then a collection, for cycles: DDP's reducer holds the group)
    and every rank meets at a barrier, so no rank tears the group down while a peer still talks on it; the group is
    destroyed whatever happened. Returns what ``work`` returned."""
    import datetime
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    where = {} if init_method is None else dict(init_method=init_method, rank=rank, world_size=world)
    if timeout_s is not None:
        where["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", **where)
    try:
        result = work(*args)
        gc.collect()
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
EMULATED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emulated")


def build_emulated(tmp_path_factory, main: str) -> str:
    """``tests/cuda_emulated/<main>`` (a CUDA kernel's own source from ``csrc/`` under the warp emulator,
    ``cuda_warp_emulator.h``) built by :func:`compile_emulated`; the executable's path."""
    exe = str(tmp_path_factory.mktemp("emulated") / main.removesuffix(".cpp"))
    compile_emulated(os.path.join(EMULATED_DIR, main), exe)
    return exe


def compile_emulated(source: str, exe: str) -> bool:
    """Build the C++ file ``source`` (which includes the warp emulator and kernels of ``csrc/``) into ``exe`` with the
    host compiler, with AddressSanitizer and UBSan's alignment check where the compiler has them; whether it has
    them. Skips the test where there is no C++ compiler."""
    import pytest

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    base = [cxx, "-std=c++20", "-O1", "-g", "-pthread", f"-I{CSRC_DIR}", f"-I{EMULATED_DIR}", source, "-o", exe]
    # AddressSanitizer, and UBSan's alignment check: a 16-byte vector access through a misaligned pointer aborts
    built = subprocess.run(base[:1] + ["-fsanitize=address,alignment", "-fno-sanitize-recover=alignment"] + base[1:],
                           capture_output=True, text=True)
    sanitized = built.returncode == 0
    if not sanitized:  # no AddressSanitizer runtime: the emulation still checks the values
        built = subprocess.run(base, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return sanitized
