"""``python -m bench`` and ``python -m bench --gpu`` refuse bad arguments up front, naming the flag: nothing is
measured (minutes on a CPU, device time on a GPU) before a typo or an unwritable output is found."""
from __future__ import annotations

import pytest

import bench.__main__ as cli
from bench import gpu, harness


@pytest.fixture
def nothing_measured(monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(harness, "keep_freed_memory", lambda: False)
    monkeypatch.setattr(harness, "measure_ceilings", measured)
    monkeypatch.setattr(gpu, "PART_FUNCTIONS", {name: measured for name in gpu.PARTS})


def _error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_bench_device_not_a_torch_device(nothing_measured, capsys):
    assert "--device tpu" in _error(cli.main, ["--device", "tpu"], capsys)
    assert "--device meta" in _error(cli.main, ["--device", "meta"], capsys)


def test_bench_only_naming_nothing(nothing_measured, capsys):
    assert "--only" in _error(cli.main, ["--only", ","], capsys)
    assert "--only: unknown benchmark(s) ['nosuch']" in _error(cli.main, ["--only", "gae,nosuch"], capsys)


def test_bench_json_unwritable(nothing_measured, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "rows.json"  # under a regular file: no folder can be made there
    message = _error(cli.main, ["--quick", "--only", "gae", "--json", str(out)], capsys)
    assert f"--json {out}: cannot write there" in message
    fine = tmp_path / "new" / "rows.json"
    assert not cli.unwritable(fine) and not fine.exists()  # the check leaves nothing behind


def test_gpu_only_unknown_before_any_part(nothing_measured, tmp_path, capsys):
    err = _error(gpu.main, ["--dry-run", "--only", "nosuch", "--out-dir", str(tmp_path)], capsys)
    assert "--only: unknown bench modules ['nosuch']" in err


def test_gpu_out_dir_unwritable_before_any_part(nothing_measured, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "results"
    err = _error(gpu.main, ["--dry-run", "--part", "bench", "--out-dir", str(out), "--wheels", str(tmp_path)], capsys)
    assert f"--out-dir {out}: cannot write there" in err
