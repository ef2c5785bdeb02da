"""Process supervision, EOS and truncation for the trainer (issue 15).

Reward functions. A reward function is called as ``fn(prompts, completions, answers, **extra)`` and returns one
entry per completion, either

- a float: the completion's outcome reward (outcome supervision), or
- a list of ``(reward, end)`` pairs, one per reasoning step: ``end`` is the index, in the completion's response
  tokens (0-based; the EOS token, when there is one, is the last), of the token that ends the step (process
  supervision).

``extra`` holds the keywords the function accepts (by name, or all of them with ``**kwargs``):
``eos`` (``list[bool]``: the completion ended with the EOS token; False means it was truncated at
``max_new_tokens``) and ``completion_tokens`` (``list[list[str]]``: each completion's response tokens, EOS
included, so a step's ``end`` can be found by counting tokens).

Routing. When every entry is a float the batch is outcome-supervised (GRPO: ``group_advantages``; PPO: the
score on the last token). As soon as one entry is a list, the batch is process-supervised: a float entry
becomes one step ending at the completion's last token, GRPO takes ``rlkernels.process_advantages`` of the
steps (``advantage`` must then be 'grpo' or 'dr_grpo') and PPO puts each step reward on its end token before GAE.
The logged ``reward/mean`` of a process-supervised completion is the mean of its step rewards (0 without steps),
and ``reward/solved`` counts completions whose every step scored >= 1.

EOS and truncation. ``missing_eos_penalty`` is added to the score of every completion without EOS (process
supervision: to the reward of its last step, or as a step on its last token when it has none).
``truncation='bootstrap'`` (PPO) adds ``gamma`` times the critic's value of the state after the last token
to the last reward of a completion without EOS (the episode did not end there: its return continues past
it); 'terminal' treats it as ended.
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Mapping

import torch

from rlkernels import _checks

REWARD_KEYWORDS = ("eos", "completion_tokens")  # what a reward function may ask for, by name


class RewardError(ValueError):
    """The reward function returned something that is not one reward entry per completion; the message starts
    with 'reward:' and names the entry (the trainer stops with it, exit status 3)."""


def reward_keywords(fn) -> tuple[str, ...]:
    """The names in :data:`REWARD_KEYWORDS` that ``fn`` accepts (all of them when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C callable: the classic three arguments only
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return REWARD_KEYWORDS
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return tuple(k for k in REWARD_KEYWORDS if k in names)


def call_reward(fn, prompts, completions, answers, eos: torch.Tensor, labels: torch.Tensor, tokenizer) -> list:
    """``fn(prompts, completions, answers, **extra)`` with the extra keywords it accepts. ``eos`` [B] bool,
    ``labels`` [B, R] the response ids with -100 after the first EOS."""
    extra = {}
    wanted = reward_keywords(fn)
    if "eos" in wanted:
        extra["eos"] = [bool(e) for e in eos.tolist()]
    if "completion_tokens" in wanted:
        extra["completion_tokens"] = [tokenizer.convert_ids_to_tokens(row[row != -100].tolist()) for row in labels.cpu()]
    out = fn(prompts, completions, answers, **extra)
    # a dict iterates over its keys and a string over its characters: neither is one entry per completion
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Iterable) or getattr(out, "ndim", 1) != 1:
        shape = f" of shape {tuple(out.shape)}" if hasattr(out, "shape") else ""
        raise RewardError(f"reward: must return one entry per completion (a list, a tuple or a 1-D tensor or array), "
                          f"got {type(out).__name__}{shape}")
    return list(out)


def _is_number(x) -> bool:
    # a one-element tensor of a real dtype: a bool tensor is no more a reward than a bool, a complex one no more
    # than a complex number (float() of one with an imaginary part raised a RuntimeError, not a RewardError)
    real_tensor = isinstance(x, torch.Tensor) and not x.dtype.is_complex and x.dtype != torch.bool
    return isinstance(x, numbers.Real) and not isinstance(x, bool) or (real_tensor and x.numel() == 1)


def _float(x, where: str) -> float:
    """``x`` (a number) as a Python float; RewardError naming ``where`` when it is too large for one."""
    try:
        return float(x.detach() if isinstance(x, torch.Tensor) else x)
    except OverflowError:
        raise RewardError(f"reward: {where} is {x!r:.40}, too large for a float") from None


def parse_rewards(raw: list, lengths: torch.Tensor):
    """The reward function's entries as ``(scores [B], steps)``.

    ``lengths`` [B] is each completion's number of response tokens. ``steps`` is None for an outcome batch, else
    ``(step_rewards [B, S] float32, step_ends [B, S] int64, step_mask [B, S] bool)``. Raises RewardError
    (naming ``reward``) for a wrong count, an entry that is neither a number nor a list of ``(reward, end)``
    pairs, or an ``end`` outside the completion's tokens."""
    B = lengths.shape[0]
    device = lengths.device
    if len(raw) != B:
        raise RewardError(f"reward: returned {len(raw)} entries for {B} completions")
    if all(_is_number(x) for x in raw):
        values = [_float(x, f"entry {i}") for i, x in enumerate(raw)]
        return torch.as_tensor(values, dtype=torch.float32, device=device), None
    n = lengths.tolist()
    rows = []
    for i, entry in enumerate(raw):
        if _is_number(entry):
            rows.append([(_float(entry, f"entry {i}"), n[i] - 1)])
            continue
        if not isinstance(entry, (list, tuple)):
            raise RewardError(f"reward: entry {i} must be a float or a list of (reward, end_token_index) pairs, got "
                              f"{type(entry).__name__} {entry!r:.80}")
        steps = []
        for pair in entry:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and _is_number(pair[0])
                    and isinstance(pair[1], numbers.Integral) and not isinstance(pair[1], bool)):
                raise RewardError(f"reward: entry {i} holds {pair!r:.80}; each step must be a (reward, end_token_index) pair")
            if not 0 <= pair[1] < n[i]:
                raise RewardError(f"reward: entry {i} has a step ending at token {pair[1]}, outside its {n[i]} response tokens")
            steps.append((_float(pair[0], f"entry {i}'s step reward"), int(pair[1])))
        rows.append(steps)
    S = max((len(r) for r in rows), default=0)
    step_rewards = torch.zeros(B, S, dtype=torch.float32)  # [B, S]
    step_ends = torch.zeros(B, S, dtype=torch.int64)  # [B, S]
    step_mask = torch.zeros(B, S, dtype=torch.bool)  # [B, S]
    for i, steps in enumerate(rows):
        for s, (r, e) in enumerate(steps):
            step_rewards[i, s], step_ends[i, s], step_mask[i, s] = r, e, True
    counts = step_mask.sum(-1)  # [B]
    scores = torch.where(counts > 0, step_rewards.sum(-1) / counts.clamp(min=1), 0.0)  # [B] mean step reward (NaN/inf carry)
    return scores.to(device), (step_rewards.to(device), step_ends.to(device), step_mask.to(device))


def steps_all_end_last(steps, lengths: torch.Tensor) -> bool:
    """Whether every step of ``steps`` (as from :func:`parse_rewards`) ends at its completion's last response token
    (``lengths`` [B] - 1): then every token of a completion gets the same advantage (the sum of the normalised
    rewards of the steps ending at or after it), as with outcome rewards."""
    _, ends, mask = steps
    return bool((~mask | (ends == (lengths - 1)[:, None])).all())


def solved(scores: torch.Tensor, steps) -> torch.Tensor:
    """[B] bool: the completion scored >= 1 (outcome) or every one of its steps did (process; none without steps)."""
    if steps is None:
        return scores >= 1.0
    rewards, _, mask = steps
    return (mask & (rewards >= 1.0) | ~mask).all(-1) & mask.any(-1)


def eos_penalty(scores: torch.Tensor, steps, eos: torch.Tensor, penalty: float | None, lengths: torch.Tensor):
    """``(scores, steps)`` with ``penalty`` added where ``eos`` [B] is False: to the score and, with steps, to the
    reward of the row's last-ending step (a new step on its last token, ``lengths - 1``, when it has none)."""
    if penalty is None:
        return scores, steps
    add = torch.where(eos, 0.0, float(penalty)).to(scores.dtype)  # [B]
    scores = scores + add
    if steps is None:
        return scores, None
    rewards, ends, mask = steps
    B = rewards.shape[0]
    has = mask.any(-1)  # [B]
    if rewards.shape[1]:
        last = torch.where(mask, ends, -1).argmax(-1)  # [B] the step that ends last
        rewards = rewards.clone()
        rewards[torch.arange(B, device=rewards.device), last] += torch.where(has, add, 0.0)
    new = ~has & ~eos  # [B] penalised rows without a step get one
    if bool(new.any()):
        rewards = torch.cat([rewards, add[:, None]], 1)  # [B, S + 1]
        ends = torch.cat([ends, (lengths - 1).clamp(min=0)[:, None]], 1)  # [B, S + 1]
        mask = torch.cat([mask, new[:, None]], 1)  # [B, S + 1]
    return scores, (rewards, ends, mask)


def token_rewards(scores: torch.Tensor, steps, mask: torch.Tensor) -> torch.Tensor:
    """PPO's task rewards per token [B, R]: each step reward on its end token (process), or the score on the
    last response token (outcome). ``mask`` [B, R] marks the response tokens."""
    B, R = mask.shape
    out = torch.zeros(B, R, dtype=torch.float32, device=mask.device)  # [B, R]
    if steps is None:
        last = (mask.long().sum(-1) - 1).clamp(min=0)  # [B]
        out[torch.arange(B, device=mask.device), last] += scores
        return out
    rewards, ends, smask = steps
    return out.scatter_add(1, torch.where(smask, ends, 0), torch.where(smask, rewards, 0.0))


@torch.no_grad()
def final_values(critic, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b] the critic's value of the state after the last position of ``ids`` [b, L] (the whole sequence read):
    the bootstrap value of a completion truncated there. One extra critic forward over those rows."""
    from rlkernels import hf

    from .models import left_padded_positions

    hidden = hf.final_hidden(critic.backbone, input_ids=ids, attention_mask=attention_mask,
                             position_ids=left_padded_positions(attention_mask))  # [b, L, H]
    head = critic.value_head
    return head(hidden[:, -1].to(head.weight.dtype)).squeeze(-1).float()  # [b]


def bootstrap_rewards(critic, batch, gamma: float) -> torch.Tensor:
    """[B, R]: ``gamma · V(after the last token)`` on the last response token of every completion without EOS
    (truncated at ``max_new_tokens``: its last token sits at the last position of ``ids``), 0 elsewhere."""
    B, R = batch.mask.shape
    out = torch.zeros(B, R, dtype=torch.float32, device=batch.mask.device)  # [B, R]
    rows = (~batch.eos).nonzero().flatten()  # [b]
    if rows.numel():
        values = final_values(critic, batch.ids[rows], batch.attention_mask[rows])  # [b]
        last = batch.mask[rows].long().sum(-1) - 1  # [b]
        out[rows, last] = gamma * values
    return out


def check_config(cfg) -> None:
    """The issue-15 fields: raise ConfigError naming the field."""
    if cfg.truncation not in ("terminal", "bootstrap"):
        cfg._bad("truncation", "must be one of ['terminal', 'bootstrap']")
    if cfg.truncation == "bootstrap" and cfg.algo != "ppo":
        cfg._bad("truncation", "'bootstrap' needs a critic's value: PPO only (GRPO has no critic); use 'terminal'")
    penalty = cfg.missing_eos_penalty  # added to the float32 scores: beyond float32 it would not convert
    if penalty is not None and not (math.isfinite(penalty) and abs(penalty) <= _checks._FLOAT32_MAX):
        cfg._bad("missing_eos_penalty", f"must be finite in float32 (|x| <= {_checks._FLOAT32_MAX:.3g}) or None")
    from .recipes import RECIPES

    if cfg.recipe and cfg.recipe not in RECIPES:
        cfg._bad("recipe", f"must be '' or one of {sorted(RECIPES)}")


def check_process_advantage(cfg) -> None:
    """GRPO with process supervision normalises step rewards: 'grpo' or 'dr_grpo' (raised at the first
    process-supervised batch, since only the reward function's output says it is one)."""
    from rlkernels.reference import PROCESS_MODES

    from .config import ConfigError

    if cfg.algo == "grpo" and cfg.advantage not in PROCESS_MODES:
        raise ConfigError(f"advantage: the reward returned step rewards (process supervision), which take "
                          f"{list(PROCESS_MODES)} (got {cfg.advantage!r})")


def check_outcome_ratio(cfg) -> None:
    """GRPO's ratio 'sequence' with one epoch of one minibatch and no KL in the reward changes nothing with outcome
    rewards (:meth:`TrainConfig.sequence_ratio_needs_steps`): raised at the first batch when its rewards are
    outcome rewards, since only the reward function's output says so (rules and reward models are refused at
    start-up). The trainer calls it before any update."""
    from .config import SEQUENCE_RATIO_WHY

    if cfg.sequence_ratio_needs_steps():
        cfg._refuse("ratio", f"the reward {cfg.reward!r} returned outcome rewards (one float per completion, or step "
                             f"rewards that all end at a completion's last token) at the "
                             f"first batch, {SEQUENCE_RATIO_WHY}{cfg.ratio_source()}")
