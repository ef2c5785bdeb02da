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

SASS instruction budgets. The report also reads the cubin's SASS (``nvdisasm``): the
main loop is the range of each outermost backward branch (a loop the compiler kept; a
branch to itself, the trap after ``EXIT``, is not one), and its instruction count per
element each thread handles in one iteration is the proxy for the issue cost of a
memory-bound kernel. Why it matters: an H100 SM issues 128 lane-instructions per clock
and its share of HBM bandwidth is about 12.8 B per clock, so a kernel moving ``b`` bytes
per element stays memory-bound only below ``128·b/12.8 = 10·b`` instructions per element.
A kernel without a loop (one tile per program) is counted whole, from its first
instruction to its last ``EXIT``. ``KernelConfig.elements`` says how many elements one
program handles per loop iteration (per program when there is no loop); configurations
without it get no per-element figure. CTAs per SM follow from registers, warps and
shared memory (:func:`ctas_per_sm`).
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
    # elements (tokens, scores, logits) one program handles per iteration of its main loop, or per program
    # when the kernel has no loop; 0: no per-element instruction count for this configuration
    elements: int = 0
    archs: tuple = (80, 90)  # the targets the launcher may run it on (a Hopper-only kernel lists 90 only)

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
    num_warps: int = 4
    loop_instructions: int = 0  # SASS instructions in the main loop body (all outermost loops), or the whole kernel
    elements_per_thread: float = 0.0  # elements one thread handles per loop iteration (0: not given)
    ctas_per_sm: int = 0  # resident CTAs per SM (registers, warps, shared memory)
    num_stages: int = 0  # the software-pipelining depth the configuration asked for (Triton's num_stages)
    wgmma_shapes: tuple = ()  # distinct HGMMA shapes in the SASS, "MxNxK" (sm_90 wgmma; empty: none)
    tma_loads: int = 0  # UTMALDG (TMA tensor loads) in the SASS
    epilogue_instructions: int = 0  # SASS of one tile's work outside its K loop (epilogue_instructions(); 0: none)

    @property
    def wgmma_n(self) -> int:
        """The widest wgmma N in the SASS (0: no HGMMA)."""
        return max((int(shape.split("x")[1]) for shape in self.wgmma_shapes), default=0)

    @property
    def instructions_per_element(self) -> float:
        """SASS instructions of the main loop per element per thread (0 when the elements are not given)."""
        return self.loop_instructions / self.elements_per_thread if self.elements_per_thread else 0.0

    def __str__(self) -> str:
        per_element = f", {self.instructions_per_element:.1f} SASS/element" if self.elements_per_thread else ""
        return (
            f"sm_{self.arch} {self.label}{' aligned' if self.aligned else ''}: {self.registers} regs, "
            f"{self.spill_bytes} B spilled/local, {self.shared_bytes} B shared, loads up to {self.widest_load_bytes} B, "
            f"{self.ctas_per_sm} CTAs/SM{per_element}, {self.num_stages} stages"
            + (f", HGMMA {'/'.join(self.wgmma_shapes)}" if self.wgmma_shapes else "")
            + (f", {self.tma_loads} UTMALDG" if self.tma_loads else "")
        )


def _nvidia_tool(name: str) -> str:
    """Triton's bundled ``cuobjdump``/``nvdisasm``, else the one on ``PATH``."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else name


def _cuobjdump() -> str:
    return _nvidia_tool("cuobjdump")


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_x_\d+)\)")


def sass_instructions(sass: str) -> list[tuple[int, str, int | None]]:
    """``nvdisasm`` text -> ``[(address, instruction, branch target address or None)]`` in address order."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    rows: list[tuple[int, str, str | None]] = []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
        found = _SASS_LINE.search(line)
        if found:
            address = int(found.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            branch = _BRANCH.search(found.group(2))
            rows.append((address, found.group(2).strip(), branch.group(1) if branch else None))
    return [(a, text, labels.get(t) if t else None) for a, text, t in rows]


def main_loop_instructions(sass: str) -> int:
    """Instructions inside the outermost loops (backward branches' ranges, a branch to itself excluded),
    summed; the whole kernel up to its last ``EXIT`` when it has no loop."""
    rows = sass_instructions(sass)
    loops = sorted(_loops(rows), key=lambda r: (r[0], -r[1]))
    outer: list[tuple[int, int]] = []
    for lo, hi in loops:
        if not outer or lo > outer[-1][1]:
            outer.append((lo, hi))
    if outer:
        return sum(sum(1 for a, _, _ in rows if lo <= a <= hi) for lo, hi in outer)
    return sum(1 for a, _, _ in rows if a <= _last_exit(rows))


def _last_exit(rows) -> int:
    """The address of the kernel's last ``EXIT`` (-1 without one): what follows is padding and traps."""
    return max((a for a, text, _ in rows if re.search(r"\bEXIT\b", text)), default=-1)


def _loops(rows) -> list[tuple[int, int]]:
    """The address ranges ``(first, last)`` of the loops (backward branches, a branch to itself excluded)."""
    return sorted({(t, a) for a, _, t in rows if t is not None and t < a})


def epilogue_instructions(sass: str) -> int:
    """SASS instructions of one tile's work outside its K loop: the innermost loop holding the tensor-core
    instructions (HGMMA or HMMA: the K loop) subtracted from the loop around it (a kernel's loop over its tiles)
    or, without one, from the whole kernel up to its last ``EXIT``. What a fused GEMM kernel issues per tile
    besides its main loop -- the epilogue (softmax statistics, dz), the K pipeline's prologue and the tile's
    addressing. 0 when no loop holds a tensor-core instruction."""
    rows = sass_instructions(sass)
    mma = [a for a, text, _ in rows if re.match(r"(?:@!?U?P\w+\s+)?(?:HGMMA|HMMA)\b", text)]
    loops = _loops(rows)
    k_loops = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi for a in mma)]
    if not k_loops:
        return 0
    k_lo, k_hi = min(k_loops, key=lambda r: r[1] - r[0])
    around = [(lo, hi) for lo, hi in loops if lo <= k_lo and k_hi <= hi and (lo, hi) != (k_lo, k_hi)]
    if around:
        lo, hi = min(around, key=lambda r: r[1] - r[0])
    else:
        lo, hi = 0, _last_exit(rows)
    count = lambda a0, a1: sum(1 for a, _, _ in rows if a0 <= a <= a1)  # noqa: E731
    return count(lo, hi) - count(k_lo, k_hi)


_HGMMA = re.compile(r"\bHGMMA\.(\d+x\d+x\d+)")


def wgmma_shapes(sass: str) -> tuple[str, ...]:
    """The distinct ``HGMMA`` (wgmma) shapes of an ``nvdisasm`` listing, ``"MxNxK"``, sorted by N then M."""
    shapes = set(_HGMMA.findall(sass))
    return tuple(sorted(shapes, key=lambda s: tuple(int(x) for x in s.split("x"))[1::-1]))


def ctas_per_sm(arch: int, registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident CTAs per SM on sm_80/sm_90: 64 K registers allocated per warp in units of 256 (8 per
    thread), at most 64 warps and 32 CTAs, and shared memory (164 KiB on sm_80, 228 KiB on sm_90, of
    which 1 KiB per CTA is reserved)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = (65536 // per_warp) // num_warps
    by_warps = 64 // num_warps
    smem = (228 if arch >= 90 else 164) * 1024
    by_shared = smem // (shared_bytes + 1024)
    return max(0, min(by_registers, by_warps, 32, by_shared))


COMPILED: list[CompileReport] = []  # every report made in this process, for the test session's summary


def _widest_load_bytes(ptx: str) -> int:
    widest = 0
    for vec, bits in re.findall(r"ld\.global[.\w:]*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx):
        widest = max(widest, int(vec or 1) * int(bits) // 8)
    return widest


def _alignment_attrs(config: KernelConfig) -> dict:
    """``tt.divisibility=16`` on every pointer and integer argument, as Triton's launcher
    specializes them when the tensors are 16-byte aligned and the sizes divisible by 16 --
    but the arguments the kernel marks ``do_not_specialize`` (or not on alignment), which
    real launches never specialize."""
    unspecialized = {p.name for p in getattr(config.kernel, "params", [])
                     if p.do_not_specialize or p.do_not_specialize_on_alignment}
    attrs = {}
    for i, (name, ty) in enumerate(config.signature.items()):
        ty = str(ty)
        if name not in unspecialized and (ty.startswith("*") or ty in ("i32", "i64", "u32", "u64")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


_REPORTS: dict[tuple, CompileReport] = {}  # (kernel, label, signature, arch, aligned) -> its report, once per process


def compile_config(config: KernelConfig, arch: int, *, aligned: bool = False) -> CompileReport:
    """Compile ``config`` for ``sm_<arch>`` and report its resources (raises if it does not build). A configuration
    compiled before in this process is reported from memory (several tests read the same configurations)."""
    key = (config.kernel, config.label, tuple(config.signature.items()), config.elements, arch, aligned)
    if key not in _REPORTS:
        _REPORTS[key] = _compile(config, arch, aligned)
        COMPILED.append(_REPORTS[key])
    return _REPORTS[key]


def _compile(config: KernelConfig, arch: int, aligned: bool) -> CompileReport:
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
        sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    registers = int(regs.group(1)) if regs else -1
    shared = int(compiled.metadata.shared)
    report = CompileReport(
        label=config.label,
        arch=arch,
        aligned=aligned,
        registers=registers,
        spill_bytes=(int(stack.group(1)) if stack else 0) + (int(local.group(1)) if local else 0),
        shared_bytes=shared,
        ptx_bytes=len(compiled.asm["ptx"]),
        cubin_bytes=len(cubin),
        widest_load_bytes=_widest_load_bytes(compiled.asm["ptx"]),
        async_copies=len(re.findall(r"\bcp\.async\b", compiled.asm["ptx"])),
        tensor_core_ops=len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", compiled.asm["ptx"])),
        num_warps=config.num_warps,
        loop_instructions=main_loop_instructions(sass),
        elements_per_thread=config.elements / (32 * config.num_warps),
        ctas_per_sm=ctas_per_sm(arch, registers, config.num_warps, shared),
        num_stages=config.num_stages,
        wgmma_shapes=wgmma_shapes(sass),
        tma_loads=len(re.findall(r"\bUTMALDG\b", sass)),
        epilogue_instructions=epilogue_instructions(sass),
    )
    return report


# ---------------------------------------------------------------- csrc CUDA kernels (nvcc)


@dataclass(frozen=True)
class CudaKernelFacts:
    """One kernel of an nvcc-built cubin: its (mangled) name, registers, static shared memory and spills in
    bytes, and its SASS (``nvdisasm -c``)."""

    name: str
    registers: int
    shared_bytes: int
    spill_bytes: int
    sass: str

    def largest_loop_instructions(self) -> int:
        """SASS instructions of the kernel's largest loop (by instruction count; 0 without a loop): the
        unrolled grid-stride or tile loop of a memory-bound kernel, whose remainder and reduction loops are
        smaller."""
        rows = sass_instructions(self.sass)
        counts = [sum(1 for a, _, _ in rows if lo <= a <= hi) for lo, hi in _loops(rows)]
        return max(counts, default=0)

    def loop_bodies(self) -> list[list[str]]:
        """Every loop's instructions (a backward branch's range, in address order), nested loops separately: for a
        kernel whose element loops are told apart by what they hold."""
        rows = sass_instructions(self.sass)
        return [[text for a, text, _ in rows if lo <= a <= hi] for lo, hi in _loops(rows)]

    def instructions_to_exit(self) -> int:
        """SASS instructions from the first to the kernel's last ``EXIT``: a kernel whose threads each handle a
        fixed number of elements once, every branch's code counted."""
        rows = sass_instructions(self.sass)
        return sum(1 for a, _, _ in rows if a <= _last_exit(rows))


def nvcc_kernel_facts(source: str, arch: int, nvcc: str, *, flags: tuple[str, ...] = ("-O3", "-std=c++17")) -> list[CudaKernelFacts]:
    """Every kernel of ``source`` (a ``.cu`` file) built by ``nvcc`` into an ``sm_<arch>`` cubin, with no GPU:
    registers and memory from ``cuobjdump --dump-resource-usage``, SASS from ``nvdisasm -c``, split per
    kernel at its ``.text`` section. Raises if it does not build."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernels.cubin")
        subprocess.run([nvcc, "-cubin", *flags, f"-gencode=arch=compute_{arch},code=sm_{arch}", source, "-o", cubin],
                       capture_output=True, text=True, check=True)
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        text = subprocess.run([_nvidia_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    resources = {
        name: (int(reg), int(stack) + int(local), int(shared))
        for name, reg, stack, shared, local in re.findall(
            r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    }
    pieces = re.split(r"//-+ \.text\.(\S+) -+\n", text)
    facts = []
    for name, sass in zip(pieces[1::2], pieces[2::2]):
        registers, spills, shared = resources[name]
        facts.append(CudaKernelFacts(name=name, registers=registers, shared_bytes=shared, spill_bytes=spills, sass=sass))
    return facts
