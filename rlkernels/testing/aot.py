"""Ahead-of-time compilation of Triton kernels for sm_80/sm_90, with no GPU.

Each op module lists, in ``aot_configs()``, every (kernel, constexpr, warps,
stages) combination its launcher can pick. ``compile_config`` builds one for a
target and reads its registers, spills and shared memory from the cubin, so a
test proves that every configuration builds and reports what it costs.

At launch, Triton also specializes on alignment: pointers aligned to 16 bytes
and integer arguments divisible by 16 (row strides of vocabularies such as
128256 or 151936) are marked ``tt.divisibility=16``, which is what lets it emit
16-byte vector loads. ``aligned=True`` compiles that specialization; the
default compiles the unaligned one (odd sizes such as V = 4097).
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
    aligned: bool  # compiled with the divisible-by-16 specialization of pointers and integers
    registers: int
    spill_bytes: int  # local memory per thread: spills and stack-resident arrays
    shared_bytes: int
    ptx_bytes: int
    cubin_bytes: int
    widest_load_bytes: int  # the widest global load per thread in the PTX (16 = fully vectorized)
    async_copies: int  # cp.async instructions in the PTX: tiles staged asynchronously (software pipelining)
    tensor_core_ops: int  # wgmma (sm_90) or mma.sync (sm_80) instructions in the PTX

    def __str__(self) -> str:
        return (
            f"sm_{self.arch} {self.label}{' aligned' if self.aligned else ''}: {self.registers} regs, "
            f"{self.spill_bytes} B spilled/local, {self.shared_bytes} B shared, loads up to {self.widest_load_bytes} B"
        )


def _cuobjdump() -> str:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else "cuobjdump"


COMPILED: list[CompileReport] = []  # every report made in this process, for the test session's summary


def _widest_load_bytes(ptx: str) -> int:
    widest = 0
    for vec, bits in re.findall(r"ld\.global[.\w:]*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        widest = max(widest, int(vec or 1) * int(bits) // 8)
    return widest


def _alignment_attrs(config: KernelConfig) -> dict:
    """``tt.divisibility=16`` on every pointer and integer argument, as Triton's launcher
    specializes them when the tensors are 16-byte aligned and the sizes divisible by 16."""
    attrs = {}
    for i, (name, ty) in enumerate(config.signature.items()):
        ty = str(ty)
        if ty.startswith("*") or ty in ("i32", "i64", "u32", "u64"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_config(config: KernelConfig, arch: int, *, aligned: bool = False) -> CompileReport:
    """Compile ``config`` for ``sm_<arch>`` and report its resources (raises if it does not build)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = _alignment_attrs(config) if aligned else None
    source = ASTSource(fn=config.kernel, signature=config.signature, constexprs=config.constexprs, attrs=attrs)
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
        aligned=aligned,
        registers=int(regs.group(1)) if regs else -1,
        spill_bytes=(int(stack.group(1)) if stack else 0) + (int(local.group(1)) if local else 0),
        shared_bytes=int(compiled.metadata.shared),
        ptx_bytes=len(compiled.asm["ptx"]),
        cubin_bytes=len(cubin),
        widest_load_bytes=_widest_load_bytes(compiled.asm["ptx"]),
        async_copies=len(re.findall(r"\bcp\.async\b", compiled.asm["ptx"])),
        tensor_core_ops=len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", compiled.asm["ptx"])),
    )
    COMPILED.append(report)
    return report
