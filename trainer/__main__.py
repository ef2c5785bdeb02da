"""``rlkernels-train [--preset smollm2] [--algo ppo] [--losses eager] [--config run.toml] ...``

With no arguments: the embedded default (a tiny Llama built in code learns a digit
task with GRPO on a CPU in under a minute: 400 steps, ~40 s on 2 cores). Under ``torchrun --nproc_per_node=N``
each process joins a torch.distributed group (gloo on CPU, nccl on CUDA).
"""
from __future__ import annotations

import json
import os
import sys


def _init_distributed(cfg) -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    if cfg.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return True


def main(argv=None) -> int:
    from .config import ConfigError, parse_args

    try:
        cfg = parse_args(argv)  # validates everything before any model is loaded
    except ConfigError as error:
        print(f"rlkernels-train: invalid configuration: {error}", file=sys.stderr)
        return 2
    from .loop import NonFiniteError, Trainer
    from .process import RewardError

    distributed = _init_distributed(cfg)
    try:
        summary = Trainer(cfg).run()  # checks the output folder (fresh, overwrite, resume) before loading models
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"rlkernels-train: invalid configuration: {error}", file=sys.stderr)
        return 2
    except (NonFiniteError, RewardError) as error:  # a NaN/inf reward or loss; a reward function's malformed return
        print(f"rlkernels-train: stopped: {error}", file=sys.stderr)
        return 3
    finally:
        if distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    if summary.get("steps") is not None and (not distributed or int(os.environ.get("RANK", "0")) == 0):
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
