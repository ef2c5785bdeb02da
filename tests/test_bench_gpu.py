"""``python -m bench --gpu`` (make gpu) on the CPU with ``--dry-run``, and README's generated performance section."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu
from bench import profile as gpu_profile
from tools import readme_perf

ROOT = Path(__file__).resolve().parent.parent


def _fake_record(date: str, device: str, *, dry_run: bool = False, median_ms: float = 1.25) -> dict:
    """A results record as bench/gpu.py writes it, with one benchmark row and one trainer step."""
    row = dict(op="logprobs+entropy fwd+bwd", shape="N=8192 V=128256 bfloat16", provider="rlkernels",
               median_ms=median_ms, rate=2400.0, rate_unit="GB/s", fraction_of_bound=0.8, peak_mib=0.5, speedup=12.5,
               vs_best_peer=1.75, error="", skipped="", samples=-1)
    missing = dict(row, provider="flash-attn CE (logp only)", median_ms=float("nan"), skipped="not installed (pip install flash-attn)")
    return {
        "date": date, "device": device, "dry_run": dry_run, "git_commit": "0123456789abcdef", "command": "python -m bench --gpu",
        "env": {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "driver": "580.159.04"},
        "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 798.0, "copy_at": "1 GiB", "matmul_at": "8192x8192 bfloat16"},
        "bench": {"rows": [row, missing], "failed_modules": [], "ok": True},
        "trainer": {"steps": [{"algo": "grpo", "losses": "fused", "step_s": 0.5, "update_peak_mib": 812.0}],
                    "run": {"steps": 60, "wall_s": 90.0, "reward_first_fifth": 0.125, "reward_last_fifth": 0.375,
                            "solved_last_fifth": 0.3}},
    }


def test_readme_section_round_trips_from_the_newest_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "NVIDIA_H100-2026-11-20.json").write_text(json.dumps(_fake_record("2026-11-20", "NVIDIA H100", median_ms=9.5)))
    (results / "NVIDIA_H200-2026-11-21.json").write_text(json.dumps(_fake_record("2026-11-21", "NVIDIA H200")))
    (results / "cpu-2026-11-22.json").write_text(json.dumps(_fake_record("2026-11-22", "cpu", dry_run=True)))
    readme = tmp_path / "README.md"
    before, after = "# title\n\nintro text\n\n", "\n## Layout\nrest\n"
    readme.write_text(before + readme_perf.BEGIN + "\nstale numbers\n" + readme_perf.END + after)
    argv = ["--results", str(results), "--readme", str(readme)]

    assert readme_perf.main(argv + ["--check"]) == 1  # stale
    assert readme_perf.main(argv) == 0
    text = readme.read_text()
    assert text.startswith(before + readme_perf.BEGIN) and text.endswith(readme_perf.END + after)
    body = text[text.index(readme_perf.BEGIN) + len(readme_perf.BEGIN): text.index(readme_perf.END)]
    # the newest real run (H200, 2026-11-21), not the older H100 one nor the newer dry run
    assert "NVIDIA_H200-2026-11-21.json" in body and "### NVIDIA H200, 2026-11-21" in body
    assert "9.5" not in body and "DRY RUN" not in body
    assert "| logprobs+entropy fwd+bwd | N=8192 V=128256 bfloat16 | rlkernels | 1.25 | 2.40 TB/s | 80.0% | 0.5 | 12.50x | 1.75x |" in body
    assert "not installed (pip install flash-attn)" in body
    assert "copy 3.00 TB/s (1 GiB), matmul 798 TFLOP/s (8192x8192 bfloat16)" in body
    assert "| grpo | fused | no | 0.500 |  | 812.0 |" in body  # a record from before update_s: its cell empty
    assert "mean reward 0.125 in the first fifth, 0.375 in the last" in body
    # the section is the .md that bench/gpu.py writes beside the JSON
    assert gpu.render_markdown(_fake_record("2026-11-21", "NVIDIA H200")) in body
    assert readme_perf.main(argv + ["--check"]) == 0
    readme_perf.main(argv)
    assert readme.read_text() == text  # a second run changes nothing


def test_readme_section_without_results_and_without_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{readme_perf.BEGIN}\nold\n{readme_perf.END}\nb\n")
    assert readme_perf.main(["--results", str(tmp_path / "none"), "--readme", str(readme)]) == 0
    assert readme.read_text() == f"a\n{readme_perf.BEGIN}\n{readme_perf.NO_RESULTS}{readme_perf.END}\nb\n"
    with pytest.raises(ValueError, match="begin marker"):
        readme_perf.regenerate("no markers here", "x")


def test_repository_readme_is_up_to_date():
    assert readme_perf.main(["--check"]) == 0, "run: python tools/readme_perf.py"


def test_pytest_summary_counts():
    out = "....s\n=== 12 passed, 3 skipped, 40 deselected, 1 warning in 2.50s ===\n"
    got = gpu.parse_pytest_summary(out)
    assert (got["passed"], got["skipped"], got["deselected"], got["failed"], got["seconds"]) == (12, 3, 40, 0, 2.5)
    got = gpu.parse_pytest_summary("FF.\n2 failed, 1 passed, 1 error in 0.31s\n")
    assert (got["failed"], got["passed"], got["errors"]) == (2, 1, 1)
    assert gpu.parse_pytest_summary("57 deselected in 1.20s")["deselected"] == 57
    assert gpu.parse_pytest_summary("crashed")["summary"] == ""


def test_every_part_runs_with_dry_run_on_the_cpu(tmp_path):
    """All five parts in one call, at tiny sizes (some narrowed further to keep the suite fast): each part says
    ok, the JSON holds what each part measured, the markdown table is beside it."""
    cmd = [sys.executable, "-m", "bench", "--gpu", "--dry-run", "--part", "all", "--out-dir", str(tmp_path),
           "--wheels", str(tmp_path / "no-wheels"), "--test-files", "tests/test_reference.py",
           "--only", "softmax,losses", "--memcheck-only", "kl_penalty,gae,logprobs out-of-range",
           "--profile-only", "gae csrc,policy"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["dry_run"] is True and set(record["seconds"]) == set(gpu.PARTS)
    assert record["env"]["torch"] and record["ceilings"]["copy_gbps"] > 0 and record["ceilings"]["matmul_tflops"] > 0
    (tests,) = record["tests"]["files"]
    run = record["tests"]["run"]
    assert tests["file"] == "tests/test_reference.py" and run["returncode"] == 5 and run["deselected"] > 0
    assert (tests["passed"], tests["failed"]) == (0, 0) and not run["interrupted"]
    probe = record["tests"]["k3_accuracy"]  # the float32 k3 case's errors by provider, on the device
    assert probe["ok"] and "--device cpu" in probe["command"] and "the failing case   torch" in probe["output"]
    assert "The float32 k3 case's errors by provider" in gpu.render_markdown(record)
    assert record["memcheck"]["ok"] and record["memcheck"]["cases"] >= 3 and not record["memcheck"]["failed_cases"]
    rows = record["bench"]["rows"]
    ops = {r["op"] for r in rows}
    assert "logprobs+entropy fwd+bwd" in ops and "kl_penalty k3 fwd+bwd" in ops
    timed = [r for r in rows if r["provider"] in ("eager", "rlkernels")]
    assert timed and all(r["median_ms"] > 0 and r["peak_mib"] >= 0 and not r["error"] for r in timed)
    assert all(r["skipped"].startswith("skipped by --dry-run") for r in rows if r["provider"] == "torch.compile")
    steps = record["trainer"]["steps"]
    assert [(s["algo"], s["losses"], s["gradient_checkpointing"]) for s in steps] == [
        ("grpo", "fused", True), ("grpo", "eager", True), ("grpo", "fused", False), ("grpo", "eager", False),
        ("ppo", "fused", False), ("ppo", "eager", False)]
    assert all(s["step_s"] > 0 and s["update_peak_mib"] > 0 for s in steps)
    # the update phase timed apart from generation: one measured step of the two, inside its step's time
    assert all(len(s["update_s"]) == 1 and 0 < s["update_s"][0] < s["step_s"] for s in steps)
    run = record["trainer"]["run"]
    assert run["steps"] == 3 and len(run["update_s_by_step"]) == len(run["step_s_by_step"]) == 3
    control = record["trainer"]["control"]  # the same run with the weights held (lr 1e-30)
    assert control["steps"] == 3 and control["lr"] == 1e-30 and len(control["reward_by_step"]) == 3
    assert "GRPO steps of the control (lr 1e-30: the weights held)" in gpu.render_markdown(record)
    assert all(0 < u < t for u, t in zip(run["update_s_by_step"], run["step_s_by_step"]))
    sharded = record["trainer"]["sharded"]  # issue 16: 2 processes under torchrun, shard = fsdp, each measured
    assert sharded["ok"] and sorted(r["rank"] for r in sharded["ranks"]) == [0, 1]
    assert all(r["world"] == 2 and r["step_s"] > 0 and r["update_peak_mib"] > 0 for r in sharded["ranks"])
    assert [c["case"] for c in record["profile"]["cases"]] == ["gae csrc", "policy_loss"]
    assert all(c["returncode"] == 0 for c in record["profile"]["cases"])
    host = record["host_cost"]  # issue 14: each op's fixed cost per call, on the device's tensors
    assert host["ok"] and "--device cpu" in host["command"] and "autograd.Function (now)" in host["output"]
    assert "The fixed host cost per call" in gpu.render_markdown(record)
    assert path.with_suffix(".md").read_text() == gpu.render_markdown(record)
    assert "Sharded GRPO (`shard = fsdp`, 2 processes" in gpu.render_markdown(record)
    assert "== trainer: ok" in done.stdout


def test_a_call_with_only_the_sharded_and_learning_pieces_renders_them():
    """``--trainer-only sharded,run`` leaves no step rows: the sharded ranks and the learning run still show
    (the 2026-11-27 H200 record rendered an empty "Trainer:" line instead)."""
    record = _fake_record("2026-11-27", "NVIDIA H200")
    record["trainer"]["steps"] = []
    record["trainer"]["sharded"] = {"processes": 2, "ok": True, "ranks": [
        {"rank": r, "world": 2, "step_s": 16.083, "update_peak_mib": 5544.6, "resident_mib": 761.7,
         "max_allocated_mib": 6306.3} for r in (0, 1)]}
    record["trainer"]["run"].update(step_s_by_step=[3.985, 0.671], update_s_by_step=[1.667, 0.153])
    text = gpu.render_markdown(record)
    assert "| trainer step |" not in text and "Trainer: " not in text
    assert "| 1 | 16.083 | 5544.6 | 761.7 | 6306.3 |" in text
    assert "mean reward 0.125 in the first fifth, 0.375 in the last" in text
    assert "Update phase per step (s): 1.667, 0.153; whole steps (s): 3.985, 0.671." in text


def test_rows_state_the_ratio_to_the_fastest_peer():
    """vs_best_peer = the fastest peer's median / the row's median; peers are the providers harness.peer made."""
    from bench import harness

    def peer_step(*inputs):
        return None

    def slower_peer(*inputs):
        return None

    peer_step.is_peer = slower_peer.is_peer = True
    providers = {"eager": lambda: None, "rlkernels": lambda: None, "peer a": slower_peer, "peer b": peer_step,
                 "peer c": harness.Unavailable("not installed (pip install c)")}
    case = harness.Case("op", "shape", 1000, 10, "memory", lambda: (), providers)
    measured = {name: harness._Measured(samples=[ms], peak=0) for name, ms in
                [("eager", 10.0), ("rlkernels", 1.0), ("peer a", 4.0), ("peer b", 2.0)]}
    measured["peer c"] = harness._Measured(skipped="not installed (pip install c)")
    rows = {r.provider: r for r in harness._rows(case, measured, harness.Ceilings(1.0, 1.0, "cpu"))}
    assert {k: r.vs_best_peer for k, r in rows.items() if k != "peer c"} == {"eager": 0.2, "rlkernels": 2.0, "peer a": 0.5, "peer b": 1.0}
    assert rows["rlkernels"].speedup == 10.0 and rows["peer c"].skipped
    assert harness.format_table(list(rows.values())).splitlines()[2].rstrip().endswith("0.20x")


def test_parts_share_the_time_of_one_call():
    """--total-s: each part gets the time left times its weight over the parts still to run, so parts that use all
    of their share end the call at its deadline, a larger weight gets more, and --budget-s still caps a part."""
    import argparse

    for parts in (list(gpu.PARTS), ["env", "tests", "bench"], ["bench"]):
        left, shares = 480.0, {}
        for i, name in enumerate(parts):
            shares[name] = left * gpu.part_share(parts[i:])
            left -= shares[name]
        assert left == pytest.approx(0.0, abs=1e-9) and sum(shares.values()) == pytest.approx(480.0)
    assert shares == {"bench": pytest.approx(480.0)}
    weights = gpu.PART_WEIGHTS
    assert set(weights) == set(gpu.PARTS) and all(w > 0 for w in weights.values())
    args = argparse.Namespace(dry_run=True, budget_s=60.0)
    cpu = torch.device("cpu")
    assert 55.0 < gpu.Part(args, cpu, 500.0).time_left() <= 60.0  # the part's own budget caps its share
    assert 5.0 < gpu.Part(args, cpu, 10.0).time_left() <= 10.0
    assert 55.0 < gpu.Part(args, cpu).time_left() <= 60.0  # no --total-s: the part's budget


@pytest.mark.parametrize("flags", [["--total-s", "0"], ["--total-s", "-5"], ["--budget-s", "0"]])
def test_time_flags_must_be_positive(flags, capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--part", "env", *flags])
    assert "must be > 0" in capsys.readouterr().err


def test_trainer_only_names_its_pieces(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--part", "env", "--trainer-only", "rows,learning"])
    assert "--trainer-only: unknown ['learning']" in capsys.readouterr().err


def test_trainer_part_runs_only_the_pieces_named(tmp_path, monkeypatch):
    """--trainer-only rows: the per-step rows and nothing else (no sharded run, no learning run), and the part
    says ok without the learning run it was not asked for."""
    trained = []
    monkeypatch.setattr(gpu, "_train", lambda values, device, measure_steps, before_update=None: trained.append(values)
                        or {"step_s": 0.1, "update_s": [0.05], "update_peak_mib": 1.0})
    monkeypatch.setattr(gpu, "sharded_run", lambda *a: pytest.fail("sharded run not asked for"))
    args = gpu.argparse.Namespace(dry_run=True, trainer_only="rows", budget_s=60.0, wheels=str(tmp_path))
    got = gpu.part_trainer(gpu.Part(args, torch.device("cpu")))["trainer"]
    assert len(got["steps"]) == 6 and len(trained) == 6 and "run" not in got and "sharded" not in got
    assert got["ok"]
    args.trainer_only = "run"
    trained.clear()
    monkeypatch.setattr(gpu, "_train", lambda values, device, measure_steps, before_update=None: trained.append(values)
                        or {k: 1 for k in ("steps", "wall_s", "reward_first_fifth", "reward_last_fifth",
                                           "solved_last_fifth", "step_s_by_step", "update_s_by_step",
                                           "reward_by_step")})
    got = gpu.part_trainer(gpu.Part(args, torch.device("cpu")))["trainer"]
    assert got["steps"] == [] and got["run"]["steps"] == 1 and len(trained) == 1 and got["ok"]
    assert "control" not in got and "lr" not in trained[0]
    args.trainer_only = "run,control"  # the learning run and its control: the same run with the weights held
    trained.clear()
    got = gpu.part_trainer(gpu.Part(args, torch.device("cpu")))["trainer"]
    assert len(trained) == 2 and trained[1] == {**trained[0], "lr": 1e-30} and got["ok"]
    assert got["run"]["lr"] is None and got["control"]["lr"] == 1e-30


def test_pytest_workers_default_and_override():
    """As many xdist workers as cores (at most 16) on a GPU machine that has pytest-xdist, none in a dry run or
    without xdist; the flag wins."""
    import argparse
    import importlib.util

    cpu = torch.device("cpu")
    part = gpu.Part(argparse.Namespace(dry_run=True, budget_s=60.0, pytest_workers=None), cpu)
    assert gpu.pytest_workers(part) == 0
    part = gpu.Part(argparse.Namespace(dry_run=False, budget_s=60.0, pytest_workers=None), cpu)
    assert gpu.pytest_workers(part) == (min(os.cpu_count() or 8, 16) if importlib.util.find_spec("xdist") else 0)
    part = gpu.Part(argparse.Namespace(dry_run=False, budget_s=60.0, pytest_workers=3), cpu)
    assert gpu.pytest_workers(part) == 3
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--part", "env", "--pytest-workers", "-1"])


def test_junit_counts_per_file(tmp_path):
    """The tests part's per-file counts from one pytest run's JUnit report: failures, errors, skips and passes
    go to the file of each test's module (classes included); a file with no test reported gets zeros; a missing
    report (pytest killed) gives zeros, not an exception."""
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="0.5"/>'
        '<testcase classname="tests.test_a.TestK" name="t2" time="0.25"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_ab" name="t3" time="1"><skipped message="s"/></testcase>'
        '<testcase classname="tests.test_ab" name="t4" time="1"><error message="e"/></testcase>'
        '</testsuite></testsuites>')
    files = ["tests/test_a.py", "tests/test_ab.py", "tests/test_c.py"]
    got = {r["file"]: (r["passed"], r["failed"], r["skipped"], r["errors"], r["seconds"]) for r in gpu.junit_counts(junit, files)}
    assert got == {"tests/test_a.py": (1, 1, 0, 0, 0.75), "tests/test_ab.py": (0, 0, 1, 1, 2.0),
                   "tests/test_c.py": (0, 0, 0, 0, 0.0)}
    assert all(r["passed"] == 0 for r in gpu.junit_counts(tmp_path / "missing.xml", files))


# the layout ncu 2025 writes (seen on the H100): the header and the rule rows carry the rule columns, a
# metric row stops after "Metric Value" with a trailing comma; the anonymous namespace is spelt <unnamed>
_NCU_HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
_GAE = '"0","123","python3","h","void rlkernels_cuda::<unnamed>::gae_kernel<__nv_bfloat16, 8>(const T1 *, int)",'
_GROUP = '"1","123","python3","h","_group_tile_kernel",'
_LAUNCH = '"1","7","(256, 1, 1)","(1024, 1, 1)","0","9.0",'
NCU_CSV = f"""==PROF== Connected to process 123
profiled gae csrc
{_NCU_HEAD}"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"
{_GAE}{_LAUNCH}"GPU Speed Of Light Throughput","DRAM Throughput","%","74.51",
{_GAE}{_LAUNCH}"GPU Speed Of Light Throughput","Duration","usecond","24.32",
{_GAE}{_LAUNCH}"GPU Speed Of Light Throughput","","","","SOLBottleneck","OPT","Memory is more heavily utilized","global","20.5"
{_GAE}{_LAUNCH}"Launch Statistics","Registers Per Thread","register/thread","40",
{_GROUP}{_LAUNCH}"GPU Speed Of Light Throughput","Duration","msecond","1,250.5",
{_GROUP}{_LAUNCH}"GPU Speed Of Light Throughput","Compute (SM) Throughput","%","12.5",
{_GROUP}{_LAUNCH}"Occupancy","Achieved Occupancy","%","n/a",
{_GROUP}{_LAUNCH}"Occupancy","","","","AchievedOccupancy","OPT","The difference between ...","local","63.23"
"2","123","python3","h","short_row","1"
==PROF== Disconnected from process 123
"""


def test_ncu_csv_parsed_per_kernel_launch():
    """The profile part's reading of ncu's --page details CSV: one entry per launch ID in order, short kernel
    names (no namespace, template arguments or parameters), durations in microseconds whatever ncu's unit,
    thousands separators read, values that are not numbers and rule rows skipped, rows too short to hold a
    metric and other lines ignored."""
    got = gpu.parse_ncu_csv(NCU_CSV)
    assert got == [{"kernel": "gae_kernel", "dram_pct": 74.51, "us": 24.32, "registers": 40.0},
                   {"kernel": "_group_tile_kernel", "us": 1250500.0, "sm_pct": 12.5}]
    assert gpu.parse_ncu_csv("no csv here\n") == []


@pytest.mark.parametrize("case", sorted(gpu_profile.CASES))
def test_every_profile_case_runs_tiny_on_the_cpu(case, capsys):
    """Each case of ``make gpu PART=profile`` (bench/profile.py) runs at small sizes without a profiler: a case
    that cannot set up would otherwise be found only under ncu on a GPU lease."""
    assert gpu_profile.main(["--case", case, "--tiny", "--device", "cpu"]) == 0
    assert f"profiled {case}" in capsys.readouterr().out


def test_a_new_lease_does_not_merge_into_an_earlier_leases_record(tmp_path):
    """Parts of one lease's calls merge (the staged copy a warm machine keeps); a fresh machine's record starts
    empty even where a committed record for the same device and day exists; a dry run merges into its own file."""
    committed, staged = tmp_path / "results" / "GPU-2026-01-01.json", tmp_path / "build" / "GPU-2026-01-01.json"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"git_commit": "old", "bench": {"rows": [1]}}))
    assert gpu.starting_record(staged, committed, dry_run=False) == {}
    assert gpu.starting_record(staged, committed, dry_run=True)["git_commit"] == "old"
    staged.parent.mkdir()
    staged.write_text(json.dumps({"git_commit": "this lease", "tests": {}}))
    assert gpu.starting_record(staged, committed, dry_run=False)["git_commit"] == "this lease"


def test_markdown_speedup_column_names_the_baseline_not_eager():
    """Each row's speedup is over its case's baseline, which is eager for some cases only (gae: the Python loop,
    logits_policy_loss: the two-op path, the phase rows: one cuBLAS GEMM): a "vs eager" column showed eager itself
    at 0.05x."""
    record = _fake_record("2026-11-21", "NVIDIA H200")
    row = dict(record["bench"]["rows"][0], op="logits_policy_loss fwd+bwd", provider="eager", speedup=0.05)
    record["bench"]["rows"] = [row]
    text = gpu.render_markdown(record)
    header = next(line for line in text.splitlines() if line.startswith("| op |"))
    assert "vs eager" not in header and "vs baseline" in header
    assert "| logits_policy_loss fwd+bwd | N=8192 V=128256 bfloat16 | eager |" in text
