"""Atomic checkpoints: safetensors weights, optimizer state, RNG states, step.

A checkpoint is a directory ``checkpoints/step_000123``. It is written under a
temporary name in the same directory and renamed into place only once every
file is on disk, so a crash leaves either the whole checkpoint or none of it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

_PREFIX = "step_"


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # clone: safetensors refuses tensors that share storage (tied embeddings)
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in module.state_dict().items()}


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: str | os.PathLike, step: int, modules: dict[str, torch.nn.Module], optimizer, extra: dict) -> Path:
    from safetensors.torch import save_file

    tmp, final = staging_dirs(root, step, os.getpid())
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name, module in modules.items():
        save_file(_weights(module), str(tmp / f"{name}.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **extra}, indent=2))
    publish(tmp, final)
    return final


def staging_dirs(root: str | os.PathLike, step: int, writer) -> tuple[Path, Path]:
    """``(tmp, final)``: the directory a checkpoint of ``step`` is written into by ``writer`` (a process id,
    or a name every process of a sharded save shares) and the name :func:`publish` gives it."""
    root = Path(root)
    return root / f".tmp-{_PREFIX}{step:06d}-{writer}", root / f"{_PREFIX}{step:06d}"


def publish(tmp: Path, final: Path) -> None:
    """Flush every file of the written checkpoint ``tmp`` to disk, then rename it to ``final`` (replacing
    an older one): until the rename no reader sees it, so a crash leaves the whole checkpoint or none."""
    for f in tmp.iterdir():  # flush file contents before the rename makes them visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def latest(root: str | os.PathLike) -> Path | None:
    root = Path(root)
    if not root.is_dir():
        return None
    done = checkpoint_dirs(root)
    return done[-1] if done else None


# what a run writes into its output_dir besides checkpoints/ (other files there are the user's)
RUN_FILES = ("metrics.jsonl", "summary.json", "config.json", "plot.png")


def checkpoint_dirs(root: str | os.PathLike, staging: bool = False) -> list[Path]:
    """The checkpoint directories the trainer wrote under ``root`` (``step_NNNNNN`` holding a ``state.json``, as
    :func:`latest` reads them); with ``staging`` also the unfinished ``.tmp-step_...`` ones a crash left. Other
    entries of ``root`` are not the trainer's."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "state.json").exists()]
    tmp = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(f".tmp-{_PREFIX}")] if staging else []
    return sorted(done) + sorted(tmp)


def run_files(out: str | os.PathLike) -> list[str]:
    """Names of an earlier run's files in ``out``: its metrics, plot, summary, config, and ``checkpoints/`` when it
    holds a checkpoint the trainer wrote (a user's own files there do not make a run)."""
    out = Path(out)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if checkpoint_dirs(out / "checkpoints"):
        found.append("checkpoints/")
    return found


def clear_run(out: str | os.PathLike) -> None:
    """Delete an earlier run's files from ``out``: :data:`RUN_FILES` and the checkpoint directories under
    ``checkpoints/`` (finished and unfinished), then ``checkpoints/`` itself if nothing else is left in it.
    Nothing else: other files, in ``out`` or in ``checkpoints/``, stay."""
    out = Path(out)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    ckpt = out / "checkpoints"
    for path in checkpoint_dirs(ckpt, staging=True):
        shutil.rmtree(path)
    if ckpt.is_dir() and not any(ckpt.iterdir()):
        ckpt.rmdir()


def _read(path: Path, name: str, reader):
    """``reader(path / name)``; a file that is missing or cannot be read back (damaged after it was written: the
    trainer writes checkpoints whole or not at all) is a ConfigError naming ``resume`` and the file."""
    from .config import ConfigError

    try:
        return reader(Path(path) / name)
    except Exception as error:  # safetensors, torch.load and json each raise their own kinds
        why = " ".join(str(error).split())[:200] or type(error).__name__
        raise ConfigError(f"resume: cannot read {Path(path) / name} ({why}); the checkpoint is damaged: delete "
                          f"{path} to resume from the one before it") from None


def _state(file: Path) -> dict:
    """state.json as the trainer writes it: an object with an integer ``step`` (and a ``config`` object)."""
    state = json.loads(file.read_text())
    if not isinstance(state, dict) or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int) \
            or not isinstance(state.get("config", {}), dict):
        raise ValueError("it holds no step number and config the trainer wrote")
    return state


def saved_config(path: Path) -> dict:
    """The configuration a checkpoint was written with ({} if it predates that record)."""
    return _read(path, "state.json", _state).get("config", {})


def load(path: Path, modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """Load the checkpoint ``path`` into ``modules`` and ``optimizer`` and set the RNG states; returns its
    state.json. Every file is read before anything is changed."""
    from safetensors.torch import load_file

    weights = {name: _read(path, f"{name}.safetensors", lambda f: load_file(str(f))) for name in modules}
    optim = _read(path, "optimizer.pt", lambda f: torch.load(f, weights_only=False))
    rng = _read(path, "rng.pt", lambda f: torch.load(f, weights_only=False))
    state = _read(path, "state.json", _state)
    from .config import ConfigError

    try:
        for name, module in modules.items():
            module.load_state_dict(weights[name])
        optimizer.load_state_dict(optim)
        set_rng_state(rng)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:  # readable files that do not fit this run
        why = " ".join(str(error).split())[:200] or type(error).__name__
        raise ConfigError(f"resume: {path} does not fit this run's models ({why}); the checkpoint is damaged or "
                          f"from another run: delete {path} to resume from the one before it") from None
    return state
