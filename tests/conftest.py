import os
import sys

# the repository root, so tests can import bench helpers and the package from a plain checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def pytest_terminal_summary(terminalreporter):
    """Print what every Triton configuration compiled ahead of time costs (registers, spills)."""
    from rlkernels import _aot

    if not _aot.COMPILED:
        return
    reports = sorted(_aot.COMPILED, key=lambda r: (r.label, r.aligned, r.arch))
    terminalreporter.section(f"Triton kernels compiled ahead of time: {len(reports)} (configuration x arch)")
    for r in reports:
        terminalreporter.write_line(
            f"sm_{r.arch}  {r.registers:3d} regs  {r.spill_bytes:4d} B spilled  {r.shared_bytes:6d} B shared  "
            f"loads {r.widest_load_bytes:2d} B  {'aligned  ' if r.aligned else 'unaligned'}  {r.label}"
        )
    spilling = [r for r in reports if r.spill_bytes]
    terminalreporter.write_line(f"{len(spilling)} of {len(reports)} spill")
