"""``python -m bench [--quick] [--only logprobs,losses] [--json out.json] [--device cuda]``

Discovers ``bench/bench_*.py``, runs every case on the device, prints the table.
With ``--json`` (default ``bench/results/<device>.json`` on a GPU) writes the rows
with the date, the versions and the command that produced them.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pkgutil
import platform
import sys
from pathlib import Path

import torch

from bench import harness


def discover() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name[len("bench_") :] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions (CPU: under 3 minutes)")
    parser.add_argument("--only", default="", help="comma-separated modules, e.g. logprobs,losses (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    names = discover()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown benchmark module(s) {unknown}; have {names}")
        names = wanted
    ceilings = harness.measure_ceilings(device, args.quick)
    print(f"device: {ceilings.device_name}; measured copy {ceilings.copy_gbps:.1f} GB/s, matmul {ceilings.matmul_tflops:.2f} TFLOP/s", flush=True)
    rows = []
    for name in names:
        module = importlib.import_module(f"bench.bench_{name}")
        for case in module.cases(device, args.quick):
            case_rows = harness.run_case(case, device, ceilings, quick=args.quick)
            rows.extend(case_rows)
            print(harness.format_table(case_rows).split("\n", 2)[-1], flush=True)
    print()
    print(harness.format_table(rows))
    out = args.json
    if out is None and device.type == "cuda":
        out = f"bench/results/{ceilings.device_name.replace(' ', '_')}.json"
    if out:
        import triton

        record = {
            "date": datetime.date.today().isoformat(),
            "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": ceilings.device_name,
            "ceilings": {"copy_gbps": ceilings.copy_gbps, "matmul_tflops": ceilings.matmul_tflops},
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
            "rows": harness.rows_as_dicts(rows),
        }
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
