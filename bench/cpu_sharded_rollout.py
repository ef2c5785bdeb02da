"""A sharded rollout's generation with each FSDP group gathered once (``trainer.distributed.gathered``, what the
trainer does) against gathering per decoding step, on this machine's CPU with gloo.

``python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.cpu_sharded_rollout [HIDDEN] [NEW_TOKENS]``
(from the repository's root; default 256 and 32): the bundled trainer's tiny Llama (2 blocks) under
``shard = fsdp``, 16 samples a rollout, three rounds of the two modes interleaved from the same seeds; rank 0
prints each rollout's seconds and the medians. No bound: per-token gathering costs one all-gather per block per
generated token, the gathered rollout one per block.
"""
from __future__ import annotations

import contextlib
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from trainer import distributed as sharding
    from trainer.config import from_dict
    from trainer.loop import Trainer

    hidden, new_tokens = (int(argv[0]) if argv else 256), (int(argv[1]) if len(argv) > 1 else 32)
    dist.init_process_group("gloo")
    try:
        cfg = dict(output_dir="build/cpu-sharded-rollout", progress=False, plot=False, steps=1, prompts_per_step=4,
                   group_size=4, tiny_hidden=hidden, losses="eager", max_new_tokens=new_tokens, algo="grpo",
                   shard="fsdp", save_every=0)
        tr = Trainer(from_dict(cfg))
        gathered = sharding.gathered
        times = {"gathered": [], "per token": []}
        for rep in range(3):
            for mode in times:
                if mode == "per token":
                    sharding.gathered = lambda root: contextlib.nullcontext(root)
                try:
                    dist.barrier()
                    start = time.perf_counter()
                    torch.manual_seed(rep)
                    tr.rollout(1)
                    dist.barrier()
                    times[mode].append(time.perf_counter() - start)
                finally:
                    sharding.gathered = gathered
        if dist.get_rank() == 0:
            print(f"tiny Llama, hidden {hidden}, 2 blocks, 16 samples of {new_tokens} new tokens, "
                  f"{dist.get_world_size()} processes (gloo, CPU), torch {torch.__version__}")
            for mode, seconds in times.items():
                print(f"  {mode:10} rollout s: {', '.join(f'{s:.3f}' for s in seconds)}; "
                      f"median {sorted(seconds)[len(seconds) // 2]:.3f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ".")
    raise SystemExit(main(sys.argv[1:]))
