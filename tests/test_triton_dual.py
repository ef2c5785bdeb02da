"""rlkernels._triton: one kernel object runs interpreted on CPU tensors and compiles for sm_80/sm_90."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from rlkernels._aot import KernelConfig, compile_config  # noqa: E402
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
