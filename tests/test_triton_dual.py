"""rlkernels._triton: one kernel object runs interpreted on CPU tensors and compiles for sm_80/sm_90."""
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from rlkernels.testing.aot import KernelConfig, compile_config  # noqa: E402
from rlkernels._triton import jit, tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


@jit
def _affine(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@jit
def _double(x):
    return x * 2.0


@jit
def _kernel(x_ptr, y_ptr, total_ptr, n, decay, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)  # [BLOCK]
    a = tl.zeros([BLOCK], dtype=tl.float32) + decay  # a library function (tl.zeros)
    _, suffix = tl.associative_scan((a, x), 0, _affine, reverse=True)  # y_t = x_t + decay * y_{t+1}
    tl.store(y_ptr + offs, _double(suffix), mask=offs < n)  # a nested @jit helper
    tl.store(total_ptr, tl.sum(x, 0))  # a library reduction


def test_interpreted_on_cpu_matches_python():
    n, decay = 50, 0.5
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    total = torch.full((1,), float("nan"))
    _kernel.launch((1,), x, y, total, n, decay, BLOCK=64)
    expected = torch.empty(n)
    acc = 0.0
    for t in reversed(range(n)):
        acc = x[t].item() + decay * acc
        expected[t] = 2 * acc
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, x.sum().reshape(1), rtol=1e-5, atol=1e-5)
    assert JITFunction.__call__ is not type(_kernel).__call__  # the library patch is undone after the launch


@pytest.mark.parametrize("arch", [80, 90])
def test_same_kernel_compiles_ahead_of_time(arch):
    config = KernelConfig(_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "total_ptr": "*fp32", "n": "i32", "decay": "fp32", "BLOCK": "constexpr"}, {"BLOCK": 64})
    report = compile_config(config, arch)
    print(report)
    assert report.registers > 0 and report.cubin_bytes > 0


def test_jit_returns_a_compiled_or_interpreted_jit_function():
    """``jit`` builds one kind of object, named for what it does: a JITFunction (the compiler and the AOT tests
    take it) that runs compiled on CUDA tensors and interpreted on CPU tensors."""
    from rlkernels._triton import CompiledOrInterpreted

    assert isinstance(_kernel, CompiledOrInterpreted) and isinstance(_kernel, JITFunction)
    assert "compiled" in CompiledOrInterpreted.__doc__ and "interpreted" in CompiledOrInterpreted.__doc__


NO_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # import triton now fails, as where it is not installed
    import os, torch, rlkernels
    from rlkernels import _triton, reference, softmax
    from tests.helpers import assert_close_to_truth

    assert not _triton.HAS_TRITON
    torch.manual_seed(0)
    x = torch.randn(5, 50) * 3  # [N, V]
    labels = torch.tensor([1, 7, -100, 49, 0])  # [N]
    g = torch.randn(2, 5)  # upstream gradients of logp and entropy
    leaf = x.clone().requires_grad_(True)
    logp, ent = rlkernels.logprobs(leaf, labels, temperature=0.8, return_entropy=True)  # the CPU default: torch
    (grad,) = torch.autograd.grad((logp * g[0]).sum() + (ent * g[1]).sum(), leaf)
    leaf64 = x.double().requires_grad_(True)
    t_logp, t_ent = reference.logprobs(leaf64, labels, temperature=0.8, return_entropy=True)
    (t_grad,) = torch.autograd.grad((t_logp * g[0]).sum() + (t_ent * g[1]).sum(), leaf64)
    for name, out, truth in (("logp", logp, t_logp), ("entropy", ent, t_ent), ("dlogits", grad, t_grad)):
        assert_close_to_truth(out, truth, torch.float32, name=name)  # the float32 tolerance of tests/helpers.py
    # the kernels exist at module level as stubs that say why they cannot run
    for kernel in (softmax._logprobs_fwd_kernel, softmax._logprobs_bwd_kernel):
        try:
            kernel.launch((1,), x)
        except RuntimeError as error:
            assert "triton is not installed" in str(error), error
        else:
            raise AssertionError("a kernel launched without triton")
    os.environ["RLKERNELS_BACKEND"] = "triton"
    try:
        rlkernels.logprobs(x, labels)
    except RuntimeError as error:
        assert "triton" in str(error), error
    else:
        raise AssertionError("RLKERNELS_BACKEND=triton ran without triton")
    print("logprobs works without triton")
    """
)


def test_without_triton_the_package_imports_and_logprobs_runs_on_cpu():
    """With triton unimportable (a fresh process), ``import rlkernels`` works, ``logprobs`` computes on the CPU
    (forward and backward against the float64 reference), the kernels are module-level stubs, and forcing the
    triton backend says why it cannot."""
    root = pathlib.Path(__file__).resolve().parents[1]  # tests.helpers is imported from the checkout
    result = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "logprobs works without triton" in result.stdout
