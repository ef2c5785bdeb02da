"""Rewards: rule-based registry, user callables ('module:function'), reward models.

Every reward is called as ``fn(prompts, completions, answers) -> list[float]``
with one float per completion, or (process supervision) one list of ``(reward, end_token_index)``
steps per completion; keywords ``eos`` and ``completion_tokens`` are passed to functions that accept
them (see trainer/process.py).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Callable

_INT = re.compile(r"-?\d+")


def _norm(text: str) -> str:
    return text.strip()


def exact(prompts, completions, answers):
    """1 when the last integer in the completion equals the answer."""
    out = []
    for c, a in zip(completions, answers):
        nums = _INT.findall(c.replace(" ", "")) if _is_spaced_digits(c) else _INT.findall(c)
        out.append(1.0 if nums and nums[-1] == a.strip() else 0.0)
    return out


def _is_spaced_digits(text: str) -> bool:
    return bool(re.fullmatch(r"[\d\s+=-]*", text))


def format_(prompts, completions, answers):
    """1 when the completion is just one integer (and nothing else)."""
    return [1.0 if _INT.fullmatch(_norm(c)) else 0.0 for c in completions]


def exact_format(prompts, completions, answers):
    """1 for exactly the answer and nothing else; 0.5 for the answer among other text; 0.1 for a lone wrong integer."""
    out = []
    for c, a in zip(completions, answers):
        text = _norm(c)
        if text == a.strip():
            out.append(1.0)
        elif _INT.fullmatch(text):
            out.append(0.1)
        elif a.strip() in _INT.findall(text):
            out.append(0.5)
        else:
            out.append(0.0)
    return out


def steps(prompts, completions, answers, completion_tokens=None):
    """Process supervision: one step per token of the answer (``"3 7 2"``: three steps), step ``i`` ending at
    response token ``i`` with reward 1 when that token is the expected one, else 0. A completion shorter than
    the answer gets reward 0 for each missing step, ending at its last token. Token ``i`` is read from
    ``completion_tokens`` (the trainer passes them); without them, from the completion's whitespace-split words."""
    out = []
    for i, (c, a) in enumerate(zip(completions, answers)):
        tokens = completion_tokens[i] if completion_tokens is not None else c.split()
        last = max(len(tokens) - 1, 0)
        out.append([(1.0 if k < len(tokens) and tokens[k] == want else 0.0, min(k, last))
                    for k, want in enumerate(a.split())])
    return out


REWARDS: dict[str, Callable] = {"exact": exact, "format": format_, "exact_format": exact_format, "steps": steps}
OUTCOME_RULES = ("exact", "format", "exact_format")  # the rules that return one float per completion ('steps': steps)


def check_reward_spec(spec: str) -> str:
    """Why ``spec`` cannot be a reward, or '' if it can (no model is loaded here)."""
    if spec in REWARDS:
        return ""
    if os.path.isdir(spec):
        return ""
    if ":" in spec:
        module, _, name = spec.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not name.isidentifier():
            return f"{spec!r} must be 'module:function' (a module name, a colon, a function name)"
        try:
            fn = _import_callable(spec)
        except (ImportError, AttributeError) as error:
            return f"cannot import callable {spec!r}: {error}"
        except Exception as error:  # the module itself fails as it runs (a SyntaxError, a module-level raise)
            return f"cannot import callable {spec!r}: importing it raised {type(error).__name__}: {error}"
        if not callable(fn):
            return f"{spec!r} is not callable"
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (some builtins): found out at the first call
            return ""
        from .process import reward_keywords

        # the trainer calls fn(prompts, completions, answers, **the extra keywords it accepts)
        extra = {k: [] for k in reward_keywords(fn)}
        try:
            signature.bind([], [], [], **extra)
        except TypeError as error:
            return f"{spec!r} must accept (prompts, completions, answers): {error}"
        return ""
    return f"must be one of {sorted(REWARDS)}, 'module:function' or a reward-model directory"


class RewardModel:
    """A sequence-classification model scoring prompt + completion; the score is logit 0.

    The text scored is the prompt and the completion joined by one space unless either
    side already has whitespace there (a word-level tokenizer would otherwise read
    "... =" + "3" as one unknown word "=3"). Batches are padded; the model finds each
    sequence's last real token through ``config.pad_token_id``, set from the
    tokenizer when the directory's config leaves it out.
    """

    def __init__(self, path: str, device):
        import torch
        from transformers import AutoModelForSequenceClassification

        from .models import load_tokenizer, load_weights

        self.tok = load_tokenizer("reward", path)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        model, info = load_weights("reward", path, AutoModelForSequenceClassification.from_pretrained, path,
                                   output_loading_info=True)
        if info.get("missing_keys"):  # e.g. a causal LM's folder: its score head would be random numbers
            from .config import ConfigError

            missing = sorted(info["missing_keys"])
            raise ConfigError(f"reward: {path} is not a sequence-classification reward model: its weights lack "
                              f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which would start "
                              f"random (a causal LM's folder?)")
        self.model = model.to(device).eval()
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tok.pad_token_id
        self.device = device
        self._torch = torch

    @staticmethod
    def join(prompt: str, completion: str) -> str:
        if not prompt or not completion or prompt[-1].isspace() or completion[0].isspace():
            return prompt + completion
        return prompt + " " + completion

    def __call__(self, prompts, completions, answers):
        texts = [self.join(p, c) for p, c in zip(prompts, completions)]
        enc = self.tok(texts, return_tensors="pt", padding=True).to(self.device)
        with self._torch.no_grad():
            logits = self.model(**enc).logits  # [N, labels]
        return logits[:, 0].float().tolist()


def _import_callable(spec: str):
    """The attribute ``function`` of module ``module`` for ``spec`` 'module:function'. The module is looked up
    in the current directory first, then on the path, as ``python -m`` does (the ``rlkernels-train`` script
    alone would not see a ``my_rewards.py`` beside the user)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def load_reward(spec: str, device="cpu") -> Callable:
    """The reward function ``spec`` names (see :func:`check_reward_spec`, which validated it)."""
    if spec in REWARDS:
        return REWARDS[spec]
    if os.path.isdir(spec):
        return RewardModel(spec, device)
    return _import_callable(spec)
