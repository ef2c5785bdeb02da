"""Package-level behaviour: cheap import, a clean namespace, backend selection, the CPU memory meter."""
import os
import subprocess
import sys

import pytest
import torch

from rlkernels import _backend, _memory


def test_import_is_cheap():
    code = "import sys, rlkernels; bad = [m for m in ('transformers', 'triton') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import rlkernels imported {result.stdout.strip()}"


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (nothing imported yet), from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)


def test_lazy_submodules_are_attributes_after_a_bare_import():
    code = (
        "import sys, rlkernels\n"
        "assert 'transformers' not in sys.modules and 'rlkernels.hf' not in sys.modules\n"
        "assert callable(rlkernels.hf.response_logprobs) and callable(rlkernels.hf.smollm2_gguf)\n"
        "assert rlkernels.integrations.__name__ == 'rlkernels.integrations'\n"
        "assert 'trl' not in sys.modules  # the integrations package imports no trainer library\n"
        "assert rlkernels.trainer.__name__ == 'rlkernels.trainer'\n"
        "assert 'transformers' not in sys.modules  # rlkernels.hf uses the model duck-typed\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_namespace_is_the_public_api():
    code = "import rlkernels; print(' '.join(dir(rlkernels)))"
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    import rlkernels

    want = sorted([*rlkernels.__all__, "__version__", "hf", "integrations", "trainer"])
    assert result.stdout.split() == want  # no annotations, importlib, or other helpers
    assert sorted(dir(rlkernels)) == want  # the same after this process imported the op modules


def test_public_names_resolve():
    import rlkernels

    for name in rlkernels.__all__:
        assert callable(getattr(rlkernels, name)), name
    with pytest.raises(AttributeError):
        rlkernels.not_an_op  # noqa: B018


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("RLKERNELS_BACKEND", raising=False)
    assert _backend.select(torch.device("cpu")) == "torch"
    monkeypatch.setenv("RLKERNELS_BACKEND", "reference")
    assert _backend.select(torch.device("cpu")) == "reference"
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    assert _backend.select(torch.device("cpu")) == "triton"
    monkeypatch.setenv("RLKERNELS_BACKEND", "csrc")  # an op without a csrc kernel keeps its default
    assert _backend.select(torch.device("cpu"), supported=("reference", "torch", "triton")) == "torch"
    monkeypatch.setenv("RLKERNELS_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="RLKERNELS_BACKEND"):
        _backend.select(torch.device("cpu"))


def test_cpu_memory_meter_counts_what_is_allocated():
    x = torch.randn(256, 1000)
    one_copy = 256 * 1000 * 4
    report = _memory.measure_cpu(lambda: x * 2)
    assert report.largest_bytes == one_copy
    assert one_copy <= report.peak_bytes < 2 * one_copy

    def two_live():
        a = x * 2
        b = x * 3
        return a + b

    assert _memory.measure_cpu(two_live).peak_bytes >= 3 * one_copy

    def chained():
        for _ in range(4):
            y = x * 2  # each freed before the next is made
            del y

    assert _memory.measure_cpu(chained).peak_bytes < 2 * one_copy


def test_public_functions_survive_importing_their_modules():
    import importlib

    import rlkernels

    for name, module in rlkernels._EXPORTS.items():
        importlib.import_module(module)
        assert callable(getattr(rlkernels, name)) and not isinstance(getattr(rlkernels, name), type(rlkernels)), name


def test_aot_table_goes_to_a_file_and_one_line_names_it(tmp_path, monkeypatch):
    """`make test` ends with one summary line; the per-configuration table is in the file it names."""
    import types

    import rlkernels
    from tests import conftest

    def report(label, arch, spill):
        return types.SimpleNamespace(label=label, arch=arch, aligned=False, registers=64, spill_bytes=spill,
                                     shared_bytes=1024, widest_load_bytes=16)

    fake = types.SimpleNamespace(COMPILED=[report("softmax fwd", 90, 0), report("softmax fwd", 80, 0),
                                           report("linear bwd", 90, 8)])
    monkeypatch.setitem(sys.modules, "rlkernels._aot", fake)
    monkeypatch.setattr(rlkernels, "_aot", fake, raising=False)
    path = tmp_path / "reports" / "aot.txt"
    monkeypatch.setenv("RLKERNELS_AOT_REPORT", str(path))

    class Reporter:
        def __init__(self):
            self.lines = []

        def write_line(self, line, **kw):
            self.lines.append(line)

        def section(self, title, **kw):
            self.lines.append(title)

    screen = Reporter()
    conftest.pytest_terminal_summary(screen)
    assert screen.lines == [f"3 Triton configurations compiled (sm_80/sm_90), 1 spill; table: {path}"]
    table = path.read_text().splitlines()
    assert len(table) == 5 and table[-1] == "1 of 3 spill"
    assert [line.split()[0] for line in table[1:4]] == ["sm_90", "sm_80", "sm_90"]  # sorted by label, then arch
    assert "8 B spilled" in table[1] and table[1].endswith("linear bwd")
