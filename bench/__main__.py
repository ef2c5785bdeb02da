"""``python -m bench [--quick] [--only logprobs,policy_loss] [--json out.json] [--device cuda|cpu]``
``python -m bench --gpu [--part env,tests,memcheck,bench,trainer] [--dry-run]``: the whole GPU validation
(``make gpu``), see ``bench/gpu.py``.

Discovers ``bench/bench_*.py``, runs every case on the device, prints the table.
``--only`` takes module names (softmax, fused_linear, losses, advantages,
trainer) or the public op names they benchmark (logprobs, linear_logprobs,
policy_loss, gae, ...). With ``--json`` (default ``bench/results/<device>.json``
on a GPU) writes the rows with the date, the versions and the command that
produced them.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pkgutil
import platform
import sys
import traceback
from pathlib import Path

import torch

from bench import harness


def discover() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name[len("bench_") :] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def aliases(modules: list[str]) -> dict[str, str]:
    """Public op name -> the bench module that measures it (bench modules mirror the package's modules)."""
    import rlkernels

    out = {}
    for op, module in rlkernels._EXPORTS.items():
        name = module.rsplit(".", 1)[-1]
        if name in modules:
            out[op] = name
    return out


def resolve_only(only: str, modules: list[str]) -> list[str]:
    """The modules ``--only`` names, in the order given, each once; raises ValueError naming unknown ones."""
    table = aliases(modules)
    wanted, unknown = [], []
    for token in (t.strip() for t in only.split(",")):
        if not token:
            continue
        name = token if token in modules else table.get(token)
        if name is None:
            unknown.append(token)
        elif name not in wanted:
            wanted.append(name)
    if unknown or not wanted:
        raise ValueError(
            (f"unknown benchmark(s) {unknown}" if unknown else f"{only!r} names no benchmark")
            + f"; modules: {', '.join(modules)}; op names: {', '.join(sorted(table))}"
        )
    return wanted


def unwritable(path: Path) -> str:
    """Why ``path`` cannot be written (its folder created, the file opened for appending), or "" when it can: checked
    before measuring, so a bad ``--json`` fails in a second rather than after the whole run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        return error.strerror or repr(error)
    return ""


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--gpu" in args:  # the GPU validation has its own options
        from bench import gpu

        return gpu.main([a for a in args if a != "--gpu"])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer samples (CPU: a few minutes)")
    parser.add_argument("--only", default="",
                        help="comma-separated modules or op names, e.g. softmax,losses or logprobs,policy_loss "
                             "(default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--os-malloc", action="store_true",
                        help="CPU: keep glibc's default malloc (a fresh mmap, page faults, per large tensor) instead "
                             "of reusing freed memory; timings then depend on the kernel's memory state")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: not a device this bench runs on (cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu)")
    names = discover()
    if args.only:
        try:
            names = resolve_only(args.only, names)
        except ValueError as error:
            parser.error(f"--only: {error}")
    why = unwritable(Path(args.json)) if args.json else ""
    if why:
        parser.error(f"--json {args.json}: cannot write there ({why})")
    if device.type == "cpu" and not args.os_malloc and harness.keep_freed_memory():
        print("CPU allocator: freed memory is reused (no page faults per call; --os-malloc to turn off)", flush=True)
    ceilings = harness.measure_ceilings(device, args.quick)
    at = lambda key: f" ({ceilings.extra[key]})" if key in ceilings.extra else ""  # noqa: E731
    print(
        f"device: {ceilings.device_name}; measured ceilings: copy {harness.format_rate(ceilings.copy_gbps, 'GB/s')}"
        f"{at('copy_at')}, matmul {harness.format_rate(ceilings.matmul_tflops, 'TFLOP/s')}{at('matmul_at')}",
        flush=True,
    )
    cases = []
    failed_modules = []
    for name in names:
        try:
            module = importlib.import_module(f"bench.bench_{name}")
            cases.extend(module.cases(device, args.quick))
        except Exception as error:  # one module that cannot set up must not hide the others
            failed_modules.append(name)
            print(f"bench_{name}: could not set up its cases: {error!r}", file=sys.stderr, flush=True)
            traceback.print_exc(limit=3)
    passes = harness.default_passes(device)
    if passes > 1:
        print(f"{len(cases)} cases, {passes} passes over all of them (rows print as their last pass ends)", flush=True)
    rows = harness.run_cases(cases, device, ceilings, quick=args.quick, passes=passes,
                             progress=lambda r: print(harness.format_table(r).split("\n", 2)[-1], flush=True))
    print()
    print(harness.format_table(rows))
    if device.type == "cpu":
        busy = harness.OTHER_LOAD.warning()
        if busy:
            print(busy, file=sys.stderr, flush=True)
        else:
            print(f"other processes used {harness.OTHER_LOAD.fraction():.0%} of the CPU while samples were timed")
    out = args.json
    if out is None and device.type == "cuda":
        out = f"bench/results/{ceilings.device_name.replace(' ', '_')}.json"
    if out:
        versions = {"torch": torch.__version__, "python": platform.python_version()}
        try:
            import triton

            versions["triton"] = triton.__version__
        except ImportError:
            pass
        record = {
            "date": datetime.date.today().isoformat(),
            "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": ceilings.device_name,
            "ceilings": {"copy_gbps": ceilings.copy_gbps, "matmul_tflops": ceilings.matmul_tflops, **ceilings.extra},
            "versions": versions,
            "rows": harness.rows_as_dicts(rows),
        }
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1))
        print(f"wrote {out}")
    return 1 if failed_modules else 0


if __name__ == "__main__":
    sys.exit(main())
