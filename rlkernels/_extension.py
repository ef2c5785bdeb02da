"""The compiled ``csrc/`` extension: found prebuilt, or built with ninja at first use.

The extension registers its kernels as ``torch.ops.rlkernels_csrc.*`` through
``TORCH_LIBRARY`` (CPU kernels always; CUDA kernels when torch has CUDA and
``nvcc`` exists), so it is loaded with ``torch.ops.load_library`` rather than
imported. Order of attempts:

1. ``rlkernels/_C*.so`` built ahead of time by ``RLKERNELS_BUILD_EXT=1 pip install .``;
2. a JIT build of ``csrc/`` with ``torch.utils.cpp_extension.load`` into
   ``$RLKERNELS_CACHE`` or ``~/.cache/rlkernels/<torch version>/`` (reused
   across processes: ninja rebuilds only when a source changed).

A build that will compile (no library in the cache, or a source newer than it)
first prints one line to stderr, since it takes ~40 s. If both fail (no
compiler, no sources, a build error), :func:`load` returns
None, warns once with the reason, and the ops fall back to Triton or PyTorch.
``RLKERNELS_NO_EXT=1`` (or ``true``/``yes``/``on``) skips the extension altogether; ``0``/``false``/``no``/``off``
or unset uses it, and any other value is refused by name. Read once, at the first load.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import sys
import threading
import warnings

import torch

try:
    import fcntl
except ImportError:  # Windows: no stale-lock recovery (below)
    fcntl = None

NAMESPACE = "rlkernels_csrc"
# nvcc's optimisation flags for the CUDA kernels (setup.py's ahead-of-time build passes the same); the AOT budget
# tests (tests/test_aot_budgets.py) read the SASS of this build
CUDA_FLAGS = ("-O3", "--use_fast_math")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# csrc/ beside the package in a source checkout; rlkernels/csrc/ inside an installed wheel
CSRC_DIR = next(
    (d for d in (os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc"), os.path.join(_PACKAGE_DIR, "csrc")) if os.path.isdir(d)),
    os.path.join(os.path.dirname(_PACKAGE_DIR), "csrc"),
)
CPU_SOURCES = ("advantages.cpp",)
CUDA_SOURCES = ("advantages_cuda.cu", "advantages_cuda_binding.cpp", "logits_policy_cuda.cu", "logits_policy_binding.cpp")

_lock = threading.Lock()
_state: dict = {"tried": False, "ops": None, "error": None, "warned": False, "announced": False}
BUILD_NOTICE = "building the rlkernels extension (once, ~40 s)..."


class ExtensionUnavailable(RuntimeError):
    pass


def cuda_build_possible() -> bool:
    """Whether the build includes the CUDA kernels (see :func:`cuda_build_blocker`)."""
    return cuda_build_blocker() is None


def cuda_build_blocker() -> str | None:
    """Why the CUDA kernels are not built, or None when they are: torch must have CUDA, there must be an
    architecture to build for -- a visible GPU (torch's build targets its compute capability) or
    ``TORCH_CUDA_ARCH_LIST`` -- and the toolkit torch will use (``CUDA_HOME``, or its guess from the ``nvcc`` on the
    PATH) must hold ``bin/nvcc`` and ``include/cuda_runtime.h``. A CUDA torch on a machine without a GPU (a login
    node, a CPU CI runner) has no target: torch's build would stop with an IndexError while choosing one, taking
    the CPU kernels down with it; a guessed toolkit without headers (an ``nvcc`` wrapper script outside the
    toolkit) fails to compile. In those cases the CPU kernels are built alone."""
    if torch.version.cuda is None:
        return "torch is a CPU build"
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        return "no GPU is visible and TORCH_CUDA_ARCH_LIST is not set"
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home or not (os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc")):
        return "nvcc was not found (set CUDA_HOME to the CUDA toolkit)"
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return f"the CUDA toolkit at CUDA_HOME={home} has no include/cuda_runtime.h (set CUDA_HOME to the toolkit)"
    return None


def openmp_flags() -> list[str]:
    """``-fopenmp`` where torch's own CPU parallelism is OpenMP (Linux builds): ``at::parallel_for`` is a header
    template whose ``#pragma omp parallel`` runs only in code compiled with it -- without the flag every CPU kernel
    of the extension runs on one thread."""
    return ["-fopenmp"] if torch._C.has_openmp and sys.platform.startswith("linux") else []


def build_directory() -> str:
    root = os.environ.get("RLKERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlkernels")
    flavour = f"torch{torch.__version__}".replace("+", "_") + (f"_cu{torch.version.cuda}" if cuda_build_possible() else "_cpu")
    path = os.path.join(root, flavour)
    os.makedirs(path, exist_ok=True)
    return path


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _build_inputs(sources: list[str]) -> set[str]:
    """``sources`` and the ``csrc/`` headers they include (``#include "..."``, followed through headers)."""
    seen, todo = set(), list(sources)
    while todo:
        path = todo.pop()
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            todo += [os.path.join(os.path.dirname(path), name) for name in _INCLUDE.findall(f.read())]
    return seen


def _needs_compile(directory: str, sources: list[str]) -> bool:
    """Whether the JIT build will compile (ninja's own rule): no library in ``directory`` yet, or one of the
    build's inputs (``sources`` and the headers they include) newer than it. Files the build does not read (the
    CUDA sources of a CPU-only build) do not count: ninja leaves the library alone for them."""
    library = os.path.join(directory, f"{NAMESPACE}{'.pyd' if os.name == 'nt' else '.so'}")
    if not os.path.exists(library):
        return True
    built = os.path.getmtime(library)
    return any(os.path.getmtime(f) > built for f in _build_inputs(sources))


def _prebuilt() -> str | None:
    found = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_C*.so")) + glob.glob(os.path.join(_PACKAGE_DIR, "_C*.pyd")))
    return found[0] if found else None


@contextlib.contextmanager
def _build_lock(directory: str):
    """Holds an exclusive ``flock`` on ``directory``'s ``rlkernels.lock`` for the block, then removes torch's own
    build lock (``directory/lock``, the file ``cpp_extension.load`` waits on while it exists) if one is there.
    Every process of this package builds under the flock, so torch's lock found while holding it was left by a
    build that died (SIGKILL, the OOM killer, a preempted job): torch would wait on it forever -- every later
    process printed the build notice and hung. The kernel drops a dead process's flock, so the flock itself
    never goes stale."""
    if fcntl is None:
        yield
        return
    with open(os.path.join(directory, f"{NAMESPACE}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits for a live build by another process, which then loads it
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> None:
    """Load the prebuilt library or JIT-build ``csrc/``; raises with the reason on failure."""
    prebuilt = _prebuilt()
    if prebuilt is not None:
        torch.ops.load_library(prebuilt)
        return
    sources = [os.path.join(CSRC_DIR, s) for s in CPU_SOURCES]
    blocker = cuda_build_blocker()
    with_cuda = blocker is None
    if with_cuda:
        sources += [os.path.join(CSRC_DIR, s) for s in CUDA_SOURCES]
    elif torch.version.cuda is not None and torch.cuda.is_available():  # a GPU that will run Triton only: say why
        warnings.warn(f"rlkernels: building the csrc extension without its CUDA kernels: {blocker}", RuntimeWarning,
                      stacklevel=3)
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise ExtensionUnavailable(f"sources not found: {missing} (install from a source checkout or build with RLKERNELS_BUILD_EXT=1)")
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and not cpp_extension.is_ninja_available():
        raise ExtensionUnavailable("ninja is not installed (pip install ninja)")
    directory = build_directory()
    if _needs_compile(directory, sources) and not _state.get("announced"):
        # a silent ~40 s compile looks like a hang (a progress bar at 0 with an ETA of hours): say it once
        _state["announced"] = True
        print(BUILD_NOTICE, file=sys.stderr, flush=True)
    with _build_lock(directory):
        cpp_extension.load(
            name=NAMESPACE,
            sources=sources,
            extra_cflags=["-O3", *openmp_flags()] + (["-DRLKERNELS_WITH_CUDA"] if with_cuda else []),
            extra_ldflags=openmp_flags(),
            extra_cuda_cflags=list(CUDA_FLAGS) if with_cuda else None,
            build_directory=directory,
            is_python_module=False,
            verbose=os.environ.get("RLKERNELS_VERBOSE_BUILD") == "1",
        )


NO_EXT_ENV = "RLKERNELS_NO_EXT"
_NO_EXT_VALUES = {"1": True, "true": True, "yes": True, "on": True, "": False, "0": False, "false": False, "no": False,
                  "off": False}


def disabled_by_env() -> bool:
    """Whether ``RLKERNELS_NO_EXT`` turns the extension off (case and blanks ignored). Any other value than the
    usual boolean spellings is refused by name: ``RLKERNELS_NO_EXT=true`` used to be read as "not 1" and the
    extension was built and used all the same."""
    value = os.environ.get(NO_EXT_ENV, "").strip().lower()
    if value not in _NO_EXT_VALUES:
        raise ValueError(f"{NO_EXT_ENV} must be one of 1, true, yes, on (skip the extension) or 0, false, no, off "
                         f"(use it), got {os.environ[NO_EXT_ENV]!r}")
    return _NO_EXT_VALUES[value]


def load():
    """``torch.ops.rlkernels_csrc`` when the extension is usable, else None (after one warning)."""
    if _state["tried"]:
        return _state["ops"]
    disabled = disabled_by_env()  # a bad value raises here, before anything is decided or cached
    with _lock:
        if not _state["tried"]:
            try:
                if disabled:
                    raise ExtensionUnavailable(f"{NO_EXT_ENV}={os.environ[NO_EXT_ENV].strip()}")
                _build()
                ops = getattr(torch.ops, NAMESPACE)
                ops.gae  # noqa: B018  (raises if the library registered nothing)
                _state["ops"] = ops
            except Exception as error:  # any failure: no compiler, build error, missing sources
                _state["ops"] = None
                _state["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            _state["tried"] = True
    if _state["ops"] is None and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            f"rlkernels: the compiled csrc extension is unavailable ({_state['error']}); "
            "falling back to the Triton/PyTorch implementations",
            RuntimeWarning,
            stacklevel=3,
        )
    return _state["ops"]


def available() -> bool:
    return load() is not None


def error() -> str | None:
    """Why the extension is unavailable (None when it loaded or was not tried)."""
    return _state["error"]


def has_cuda_kernels(op: str = "gae") -> bool:
    """Whether the loaded extension has a CUDA kernel for ``op`` (a prebuilt library older than an op has none)."""
    ops = load()
    if ops is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CUDA")
