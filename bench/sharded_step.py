"""One sharded GRPO run of the bundled trainer (``shard = fsdp``), each process's memory recorded.

``python -m torch.distributed.run --standalone --nproc-per-node P -m bench.sharded_step OUT '<config JSON>'``
(from the repository's root):
every process joins a gloo group, trains with the JSON's trainer settings plus ``shard = "fsdp"`` (each measured
step after the first, as ``bench.gpu._train`` measures the unsharded rows) and writes ``OUT/rank-R.json``: its
update-phase peak above what was live before it, what it held resident before its last update (its shards of
the parameters, gradients and optimizer state), its whole-run peak, and its median step time.
``make gpu PART=trainer`` (bench/gpu.py) runs it with 2 processes.

On a machine with fewer GPUs than processes (the one-GPU machines ``make gpu`` gets) the processes share the
GPUs, ``LOCAL_RANK`` modulo the device count: NCCL refuses two processes on one GPU, gloo's collectives stage CUDA
tensors through host memory (torch 2.11's gloo took FSDP2's CUDA all-gather and reduce-scatter on the H200 of
2026-11-27; bench/gpu.py records a failure with its output). Each process still has its own CUDA
context and caching allocator, so its memory figures are its own -- what the rank of a real P-GPU job would
hold -- while the step time (host-staged collectives, two processes taking turns on one GPU) says nothing about
a real multi-GPU node.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    out, values = Path(argv[0]), json.loads(argv[1])
    on_gpu = str(values.get("device", "cpu")).startswith("cuda")
    if on_gpu and torch.cuda.device_count() < int(os.environ.get("WORLD_SIZE", "1")):
        # the trainer puts process r on cuda:LOCAL_RANK; fewer GPUs than processes: they share them
        os.environ["LOCAL_RANK"] = str(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        from bench import gpu
        from tests.helpers import alias_bundled_trainer

        alias_bundled_trainer()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        # before each measured update (whose measurement resets the peak statistics): what is live, and the peak
        # since the last reset (sampling and scoring included)
        seen: list[tuple[int, int]] = []

        def before_update():
            if on_gpu:
                seen.append((torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))

        summary = gpu._train({**values, "shard": "fsdp"}, device, measure_steps=True, before_update=before_update)
        peaks = [p for _, p in seen] + ([torch.cuda.max_memory_allocated(device)] if on_gpu else [])
        result = {"rank": rank, "world": world, "device": str(device), "step_s": summary["step_s"],
                  "update_peak_mib": summary["update_peak_mib"],
                  "resident_mib": seen[-1][0] / 2**20 if seen else None,
                  "max_allocated_mib": max(peaks) / 2**20 if peaks else None}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
