"""Ahead-of-time compilation of Triton kernels for sm_80/sm_90, with no GPU.

Each op module lists, in ``aot_configs()``, every (kernel, constexpr, warps,
stages) combination its launcher can pick. ``compile_config`` builds one for a
target and reads its registers, spills and shared memory from the cubin, so a
test proves that every configuration builds and reports what it costs.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of one kernel, as the launcher can pick it."""

    kernel: object  # a DualJITFunction
    signature: dict  # argument name -> Triton type ("*fp32", "i32", "fp32", "constexpr", ...)
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def label(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        pointer = next((t for t in self.signature.values() if str(t).startswith("*")), "")
        return f"{self.kernel.__name__}({pointer})[{consts},w{self.num_warps},s{self.num_stages}]"


@dataclass(frozen=True)
class CompileReport:
    label: str
    arch: int
    registers: int
    spill_bytes: int  # local memory per thread: spills and stack-resident arrays
    shared_bytes: int
    ptx_bytes: int
    cubin_bytes: int

    def __str__(self) -> str:
        return (
            f"sm_{self.arch} {self.label}: {self.registers} regs, {self.spill_bytes} B spilled/local, "
            f"{self.shared_bytes} B shared"
        )


def _cuobjdump() -> str:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else "cuobjdump"


COMPILED: list[CompileReport] = []  # every report made in this process, for the test session's summary


def compile_config(config: KernelConfig, arch: int) -> CompileReport:
    """Compile ``config`` for ``sm_<arch>`` and report its resources (raises if it does not build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=config.kernel, signature=config.signature, constexprs=config.constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    report = CompileReport(
        label=config.label,
        arch=arch,
        registers=int(regs.group(1)) if regs else -1,
        spill_bytes=(int(stack.group(1)) if stack else 0) + (int(local.group(1)) if local else 0),
        shared_bytes=int(compiled.metadata.shared),
        ptx_bytes=len(compiled.asm["ptx"]),
        cubin_bytes=len(cubin),
    )
    COMPILED.append(report)
    return report
