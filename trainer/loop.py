"""The PPO/GRPO loop: rollout -> score -> advantages -> update -> log, one step at a time.

Losses are the pure ``(loss, metrics)`` functions of the op provider
(``rlkernels`` fused ops, or ``rlkernels.reference`` with ``--losses eager``).
Under ``torchrun`` each process takes its share of the prompts (whole groups)
and gradients are averaged by ``DistributedDataParallel`` (``shard='ddp'``) or the models are
sharded with FSDP2 (``shard='fsdp'``, :mod:`trainer.distributed`); token means and PPO advantage
whitening use global statistics, so N processes take the step one process would.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import rlkernels
from rlkernels import hf

from . import checkpoint, knobs, process
from . import distributed as sharding
from .config import ConfigError, TrainConfig
from .data import PromptSource
from .models import Critic, TokenLogprobs, check_vocabulary, frozen_copy, load_critic, load_policy, ops_provider
from .rewards import REWARDS, RewardModel, load_reward


class NonFiniteError(RuntimeError):
    """A reward or loss was NaN/inf; the message names the step and the batch."""


# The errors a process may stop with in the score phase while the others would go on (Trainer._stop_together), in the
# order of their codes there; ConfigError first (its message starts with the field's name)
STOP_TOGETHER = (ConfigError, process.RewardError, NonFiniteError)
# the fields that decide whether the run's first batch must show step rewards for ratio 'sequence'
# (TrainConfig.sequence_ratio_needs_steps, Trainer._check_outcome_ratio): a resume keeps that decision while they hold
SEQUENCE_RATIO_FIELDS = ("ratio", "recipe", "algo", "epochs", "minibatches", "kl_coef", "kl_in", "reward")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare by
class Rollout:
    """One step's batch, all tensors [B, ...] on the training device. Each phase returns a copy with the
    fields it computed filled in (``dataclasses.replace``): rollout, then score (``scores``) and
    score_tokens (``old_logp``, ``ref_logp``, ``old_values``), then advantages (``advantages``,
    ``returns``, ``kl_seq``)."""

    ids: torch.Tensor  # [B, L] prompt (left-padded) + response
    attention_mask: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, R] response ids, -100 after the first EOS
    mask: torch.Tensor  # [B, R] bool, response tokens up to and including EOS
    prompts: list
    completions: list
    answers: list
    scores: torch.Tensor | None = None  # [B]
    old_logp: torch.Tensor | None = None  # [B, R]
    ref_logp: torch.Tensor | None = None  # [B, R]
    old_values: torch.Tensor | None = None  # [B, R]
    advantages: torch.Tensor | None = None  # [B] (GRPO) or [B, R] (PPO)
    returns: torch.Tensor | None = None  # [B, R]
    kl_seq: torch.Tensor | None = None  # [B] the kl_estimator KL to the reference at rollout summed over each response
    raw_scores: torch.Tensor | None = None  # [B] the reward function's scores when reward_norm/reward_clip changed them
    eos: torch.Tensor | None = None  # [B] bool: the response ended with EOS (False: truncated at max_new_tokens)
    step_rewards: torch.Tensor | None = None  # [B, S] process supervision (trainer/process.py), else None
    step_ends: torch.Tensor | None = None  # [B, S] int64 response-token index ending each step
    step_mask: torch.Tensor | None = None  # [B, S] bool: real steps

    @property
    def steps(self):
        """``(step_rewards, step_ends, step_mask)`` of a process-supervised batch, None for outcome rewards."""
        return None if self.step_rewards is None else (self.step_rewards, self.step_ends, self.step_mask)

    def select(self, idx: torch.Tensor) -> "Rollout":
        """The rows ``idx`` [b] of every field."""
        rows = idx.tolist()

        def pick(value):
            if value is None:
                return None
            return value[idx] if isinstance(value, torch.Tensor) else [value[i] for i in rows]

        return Rollout(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})


def uses_fused_head(cfg: TrainConfig, mb: Rollout) -> bool:
    """Whether the policy loss comes from the hidden states through ``rlkernels.linear_policy_loss`` (issue 12):
    ``policy_head='fused'`` with ``losses='fused'``, on- or off-policy (``mb.old_logp`` None, the on-policy update
    of epochs = minibatches = 1, is passed as ``old_logp=None``: old = the op's own log-probs detached), and not
    under ``shard='fsdp'`` (the gathered head weight lives only inside the sharded root's forward; the op runs
    after it). It reports the entropy as the two-op path does, also with ``entropy_coef`` 0 (``return_entropy``)."""
    return cfg.policy_head == "fused" and cfg.losses == "fused" and cfg.shard != "fsdp"


def minibatch_loss(cfg: TrainConfig, ops, policy, critic, mb: Rollout, token_scale: float = 1.0,
                   kl_coef: float | None = None):
    """The loss of one minibatch and its metrics: ``(loss, metrics)``, no state read or written.

    ``policy`` is a :class:`TokenLogprobs` (or its DDP wrapper), ``critic`` a :class:`Critic` (PPO) or
    None, ``ops`` the op provider. The loss is ``ops.policy_loss`` (with ``kl_coef`` (default
    ``cfg.kl_coef``) times the ``kl_estimator`` KL to the reference when ``kl_in`` is 'loss'; with
    'reward' the KL is in the advantages) plus, for PPO, ``value_coef`` times ``ops.value_loss``
    aggregated by ``value_agg``. Token means are multiplied by ``token_scale`` (what makes DDP's
    gradient average a global token mean). ``metrics`` holds floats under namespaced keys:
    ``loss/policy``, ``policy/<policy_loss metric>``, ``policy/ratio_outside``, and for PPO
    ``loss/value``, ``critic/<value_loss metric>``.
    """
    kl_in_loss = cfg.kl_in == "loss" and mb.ref_logp is not None
    options = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, ratio=cfg.ratio,
                   ref_logp=mb.ref_logp if kl_in_loss else None,
                   kl_coef=(cfg.kl_coef if kl_coef is None else kl_coef) if kl_in_loss else 0.0,
                   kl_estimator=cfg.kl_estimator or "k3", entropy_coef=cfg.entropy_coef, agg=cfg.agg)
    if uses_fused_head(cfg, mb):  # --- issue 12 ---
        hidden, weight, bias = policy(mb.ids, mb.attention_mask, mb.labels, head_inputs=True)  # [b, R, H], [V, H]
        loss, metrics = ops.linear_policy_loss(hidden, weight, mb.labels, mb.old_logp, mb.advantages, mb.mask,
                                               bias=bias, temperature=cfg.temperature, return_entropy=True, **options)
        logp = metrics["token_logp"]  # [b, R] (detached)
        old = mb.old_logp if mb.old_logp is not None else logp  # [b, R]
        metrics = {k: v for k, v in metrics.items() if not k.startswith("token_")}  # per-token tensors: not logged
    else:
        logp, entropy = policy(mb.ids, mb.attention_mask, mb.labels)  # [b, R] x2
        old = mb.old_logp if mb.old_logp is not None else logp.detach()  # [b, R]
        loss, metrics = ops.policy_loss(logp, old, mb.advantages, mb.mask, entropy=entropy, **options)
    logs = {"loss/policy": float(loss.detach()), **{f"policy/{k}": float(v) for k, v in metrics.items()}}
    high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    logs["policy/ratio_outside"] = knobs.ratio_outside(logp, old, mb.mask, cfg.ratio, cfg.clip_low, high)
    total = loss * (token_scale if cfg.agg == "token-mean" else 1.0)  # sequence means need no rescaling
    if critic is not None:
        values = critic(mb.ids, mb.attention_mask, mb.labels)  # [b, R]
        vloss, vmetrics = ops.value_loss(values, mb.old_values, mb.returns, mb.mask, clip=cfg.value_clip,
                                         agg=cfg.value_agg)
        total = total + cfg.value_coef * (token_scale if cfg.value_agg == "token-mean" else 1.0) * vloss
        logs["loss/value"] = float(vloss.detach())
        logs.update({f"critic/{k}": float(v) for k, v in vmetrics.items()})
    return total, logs


# fields a checkpoint cannot be resumed under once changed: other models, another optimizer layout
RESUME_FIXED = ("algo", "model", "critic_model", "tiny_hidden", "tiny_layers")
# fields whose change on resume is not worth a line: how this invocation starts and displays, not what it trains
_NOT_HYPERPARAMETERS = ("resume", "overwrite", "progress", "plot")


def check_output_dir(cfg: TrainConfig) -> list[str]:
    """Check ``cfg.output_dir`` against ``resume``/``overwrite`` before anything is loaded.

    Raises :class:`ConfigError` (naming the field) for a fresh run into a folder that holds an
    earlier run without ``overwrite``, a resume with no checkpoint, or a resume whose checkpoint
    was trained with another value of a field in :data:`RESUME_FIXED`. Returns, for a resume,
    one line per other field that changed since the checkpoint was written.
    """
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} is a file, not a folder")
    for name in (*checkpoint.RUN_FILES, "checkpoints"):  # else the run (or --overwrite's deletion) fails midway
        path = out / name
        if path.exists() and path.is_dir() != (name == "checkpoints"):
            want = "a folder: the run saves its checkpoints there" if name == "checkpoints" else "a file the run writes"
            raise ConfigError(f"output_dir: {path} is not {want}; move it away or choose another --output-dir")
    if not cfg.resume and (out / "config.json").is_file() and not _is_run_config(out / "config.json"):
        raise ConfigError(f"output_dir: {out / 'config.json'} is not a run's config.json (a model folder's?): the run "
                          "writes its own there, and --overwrite would delete it; choose another --output-dir")
    if cfg.resume:
        path = checkpoint.latest(out / "checkpoints")
        if path is None:
            raise ConfigError(f"resume: no checkpoint under {out / 'checkpoints'} (start without --resume)")
        saved, now = checkpoint.saved_config(path), cfg.to_dict()
        for name in RESUME_FIXED:
            if name in saved and not _same_value(name, saved[name], now[name]):
                raise ConfigError(f"{name}: {path} was trained with {saved[name]!r}; resume with that, or start a new "
                                  f"run in another output_dir (got {now[name]!r})")
        if sharding.is_sharded_checkpoint(path) != (cfg.shard == "fsdp"):  # DCP shards or whole safetensors
            was = "sharded (shard='fsdp')" if sharding.is_sharded_checkpoint(path) else "whole (shard='ddp' or 'none')"
            raise ConfigError(f"shard: {path} holds a {was} checkpoint; resume with that shard mode (got {cfg.shard!r})")
        _check_writable(out)
        notes = {"seed": " (prompts and sampling; the tiny model's initial weights, which the KL reference copies, "
                         "keep the run's)"} if cfg.model == "tiny" else {}
        return [f"resume: {name} changed: {saved[name]!r} -> {value!r}{notes.get(name, '')}"
                for name, value in now.items()
                if name in saved and name not in _NOT_HYPERPARAMETERS and not _same_value(name, saved[name], value)]
    used = checkpoint.run_files(out)
    if used and not cfg.overwrite:
        raise ConfigError(f"output_dir: {out} holds an earlier run ({', '.join(used)}); --resume continues it, "
                          "--overwrite deletes it, or choose another --output-dir")
    _check_writable(out)
    return []


_PATH_FIELDS = ("model", "critic_model", "ref_model", "prompts")  # a model or file named by its path (or 'tiny', '')


def _same_value(name: str, saved, now) -> bool:
    """Whether a field's value in a checkpoint and now are the same: equal, or for a path field two spellings of
    one existing file or folder ('pol', './pol/', its absolute path; a relative one read from where we run now)."""
    if saved == now:
        return True
    if name not in _PATH_FIELDS or not (isinstance(saved, str) and isinstance(now, str) and saved and now):
        return False
    if name == "model" and "tiny" in (saved, now):  # the built-in model, whatever folder is called 'tiny'
        return False
    try:
        return os.path.samefile(saved, now)
    except OSError:  # either does not exist (here)
        return False


def _is_run_config(path: Path) -> bool:
    """Whether ``path`` (a config.json) is one the trainer wrote: a JSON object with its 'algo' and 'output_dir'
    (text that is not JSON counts as a write a crash cut short; a user's or a model folder's config.json is JSON)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return isinstance(data, dict) and "algo" in data and "output_dir" in data


def _check_writable(out: Path) -> None:
    """Create the folder ``out`` (a run writes there from its first step) or raise ConfigError naming output_dir."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"output_dir: cannot create {out}: {error.strerror or error}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir: {out} is not writable")


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._resume_notes = check_output_dir(cfg)  # before anything is loaded: a config error, not a traceback
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if cfg.shard == "fsdp" and not self.distributed:
            raise ConfigError("shard: 'fsdp' shards over the processes of a torchrun job and needs at least 2 "
                              "(torchrun --nproc_per_node=N); in one process use 'ddp' or 'none'")
        if cfg.shard == "none" and self.world > 1:
            raise ConfigError(f"shard: 'none' leaves {self.world} processes training apart; use 'ddp' or 'fsdp'")
        cfg.check_world(self.world)  # prompts_per_step and minibatches against each process's share (ConfigError)
        self.ops = ops_provider(cfg.losses)
        if cfg.losses == "fused":
            # build (or load) the compiled extension now: a first build takes ~40 s, which inside the first
            # step would stall the progress bar at 0 with an ETA of hours
            from rlkernels import _extension

            _extension.load()
        if cfg.device.startswith("cuda") and self.distributed:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        else:
            self.device = torch.device(cfg.device)
        threads = cfg.threads or (1 if cfg.model == "tiny" else 0)
        if threads:  # the tiny model is all small ops: one thread beats several fighting over them
            torch.set_num_threads(threads)
        self.out = Path(cfg.output_dir)
        self.prompts = PromptSource(cfg.task, cfg.prompts, cfg.seed)
        self.reward_fn = load_reward(cfg.reward, self.device)

        if hasattr(self.reward_fn, "model"):  # a reward model: dropout off (issue 15)
            knobs.disable_dropout(self.reward_fn.model)

        self.policy, self.tokenizer = load_policy(self._initial_model_config())
        knobs.disable_dropout(self.policy)  # old log-probs and the update's must come from the same function
        self.policy.to(self.device).train()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.ref = self._load_reference() if cfg.kl_coef > 0 else None
        self.critic: Critic | None = load_critic(cfg, self.policy).to(self.device).train() if cfg.algo == "ppo" else None
        if self.critic is not None:
            knobs.disable_dropout(self.critic)
        if cfg.gradient_checkpointing:
            knobs.enable_gradient_checkpointing(self.policy, self.critic)
        self.kl_coef = cfg.kl_coef
        self.score_norm = knobs.ScoreNormalizer(cfg.reward_norm, cfg.reward_norm_shift, cfg.reward_clip)

        self.policy_lp = TokenLogprobs(self.policy, self.ops, cfg.temperature)
        if cfg.pack:
            self._enable_packing()
        self.policy_ddp, self.critic_ddp = self.policy_lp, self.critic
        if cfg.shard == "fsdp":  # the sharded roots replace the modules everywhere they are called
            self.policy_lp = self.policy_ddp = sharding.fsdp_wrap(self.policy_lp)
            if self.ref is not None:
                self.ref = sharding.fsdp_wrap(self.ref, frozen=True, offload=cfg.fsdp_offload_ref)
            if self.critic is not None:
                self.critic = self.critic_ddp = sharding.fsdp_wrap(self.critic)
            if isinstance(self.reward_fn, RewardModel):
                self.reward_fn.model = sharding.fsdp_wrap(self.reward_fn.model, frozen=True, offload=cfg.fsdp_offload_ref)
        elif self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev_ids = [self.device.index] if self.device.type == "cuda" else None
            self.policy_ddp = DDP(self.policy_lp, device_ids=dev_ids)
            if self.critic is not None:
                self.critic_ddp = DDP(self.critic, device_ids=dev_ids)
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad]}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters())})
        self.optimizer = torch.optim.AdamW(groups)
        self._apply_optimizer_settings()
        self.step = 0
        self._resumed_from = 0  # the step run() started from (after a resume)
        self._stop_requested = False
        self._first_batch_scored = False  # the first batch says whether the reward function gives step rewards
        self._saved_step = 0  # the step of the newest checkpoint this run wrote or resumed from
        self._stopped_in_score = False  # every process stopped together in a score phase (Trainer.score)

    def _initial_model_config(self) -> TrainConfig:
        """The config the policy is first built from: ``cfg``, but on a resume of the tiny model (random weights
        drawn from the seed) with the checkpoint's seed, so that its initial weights, and the KL reference copied
        from them, are the run's own whatever seed the resume samples with."""
        cfg = self.cfg
        if not (cfg.resume and cfg.model == "tiny"):
            return cfg
        saved = checkpoint.saved_config(checkpoint.latest(Path(cfg.output_dir) / "checkpoints"))
        return dataclasses.replace(cfg, seed=saved.get("seed", cfg.seed))

    def _check_reference_takes_the_policy(self, ref: torch.nn.Module) -> None:
        """ConfigError naming ref_update_every / ref_mix_alpha unless ``ref`` (from ref_model) has the policy's
        parameter and buffer names and shapes: else the first copy or mix would fail after a step's update."""
        mine = {name: tuple(t.shape) for name, t in self.policy.state_dict().items()}
        theirs = {name: tuple(t.shape) for name, t in ref.state_dict().items()}
        if mine == theirs:
            return
        name = "ref_update_every" if self.cfg.ref_update_every else "ref_mix_alpha"
        what = "copies" if name == "ref_update_every" else "mixes"
        key = next(k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k))
        raise ConfigError(f"{name}: {what} the policy into the reference, but ref_model {self.cfg.ref_model} has "
                          f"another architecture ({key}: {theirs.get(key, 'absent')} there, "
                          f"{mine.get(key, 'absent')} in the policy); give a reference of the policy's architecture "
                          f"or leave ref_model empty (got {getattr(self.cfg, name)!r})")

    def _load_reference(self) -> TokenLogprobs:
        """The frozen reference policy: a copy of the initial policy, or ``ref_model`` (dropout off)."""
        cfg = self.cfg
        if not cfg.ref_model:
            model = frozen_copy(self.policy)
        else:
            model, _ = load_policy(dataclasses.replace(cfg, model=cfg.ref_model), field="ref_model")
            check_vocabulary("ref_model", cfg.ref_model, self.policy, model)
            if cfg.ref_update_every or cfg.ref_mix_alpha:  # knobs.mix_into needs the policy's names and shapes
                self._check_reference_takes_the_policy(model)
            model = frozen_copy(model.to(self.device))
        knobs.disable_dropout(model)
        return TokenLogprobs(model, self.ops, cfg.temperature)

    def _enable_packing(self) -> None:
        """``--pack``: run the policy, reference and critic forwards packed when the model keeps packed
        sequences apart (``rlkernels.hf.supports_packing``); otherwise say so and stay padded. The reference is a
        copy of the policy; a reference from ``ref_model`` or a critic from another model (``critic_model``) stays
        padded (not probed)."""
        if not hf.supports_packing(self.policy):
            if self.rank == 0:
                attention = getattr(self.policy.config, "_attn_implementation", "?")
                print(f"pack: {type(self.policy).__name__} ({attention} attention) "
                      "does not keep packed sequences apart; running padded")
            return
        for module in (self.policy_lp, None if self.cfg.ref_model else self.ref, None if self.cfg.critic_model else self.critic):
            if module is not None:
                module.pack = True
        if self.ref is not None and not self.cfg.ref_model:  # the copy's verdict now, before any wrapping or forward
            hf.supports_packing(self.ref.model)  # (hf.response_logprobs would otherwise probe it at its first call)

    # ------------------------------------------------------------------ phases

    @torch.no_grad()
    def rollout(self, step: int) -> Rollout:
        """Rollout phase: this process's share of the step's prompts, ``group_size`` sampled responses each."""
        cfg = self.cfg
        local = cfg.prompts_per_step // self.world
        examples = self.prompts.batch(step, cfg.prompts_per_step)[self.rank * local : (self.rank + 1) * local]
        if cfg.chat_template:
            texts = [
                self.tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}], tokenize=False, add_generation_prompt=True)
                for e in examples
            ]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        else:
            texts = [e.prompt for e in examples]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        G = cfg.group_size
        prompt_ids = enc["input_ids"].repeat_interleave(G, 0).to(self.device)  # [B, P]
        prompt_mask = enc["attention_mask"].repeat_interleave(G, 0).to(self.device)  # [B, P]
        self.policy.eval()
        sampling = dict(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=cfg.temperature,
            top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
        )
        try:
            if cfg.shard == "fsdp":  # inside the sharded root's forward, every process stepping until all are done;
                with sharding.gathered(self.policy_lp):  # each group gathered once for the rollout, not once a token
                    out = self.policy_lp(call=self.policy.generate, synced_gpus=True, **sampling)
            else:
                out = self.policy.generate(**sampling)
        except RuntimeError as error:  # torch.multinomial refuses NaN/inf probabilities (on the CPU; a GPU asserts)
            if "inf" not in str(error) or "nan" not in str(error):
                raise
            raise NonFiniteError(f"the policy's next-token probabilities are not finite at step {step}'s rollout "
                                 f"(after {step - 1} updates; lr = {cfg.lr}): {' '.join(str(error).split())[:120]}"
                                 ) from None
        self.policy.train()
        response = out[:, prompt_ids.shape[1] :]  # [B, R]
        is_eos = response == self.eos_id
        mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # [B, R] up to and including the first EOS
        labels = response.masked_fill(~mask, -100)
        ids = torch.cat([prompt_ids, response.masked_fill(~mask, self.pad_id)], 1)  # [B, L]
        attention = torch.cat([prompt_mask, mask.long()], 1)  # [B, L]
        completions = self.tokenizer.batch_decode(response.masked_fill(~mask, self.pad_id), skip_special_tokens=True)
        return Rollout(ids, attention, labels, mask, [e.prompt for e in examples for _ in range(G)], completions,
                       [e.answer for e in examples for _ in range(G)], eos=is_eos.any(-1))

    def score(self, batch: Rollout, step: int) -> Rollout:
        """Score phase, rewards: the batch with ``scores`` [B] from the reward function (finite, one each) and,
        when it returned step rewards, the steps (see trainer/process.py); ``missing_eos_penalty`` applied. Each
        process scores its own share with the user's reward function, so any process may stop here (a malformed or
        non-finite reward, step rewards a flag refuses): under torchrun every process then stops with it
        (:meth:`_stop_together`) instead of waiting for it in the next collective -- also when the reward function
        itself raised (a KeyError in the user's code). The first batch scored decides
        the refusals that depend on whether the rewards are step rewards (:func:`process.check_outcome_ratio`;
        every batch: :func:`process.check_process_advantage` and ``reward_norm``/``reward_clip``)."""
        error, scored, outcome = None, batch, True
        try:
            scored, outcome = self._score_here(batch, step)
        # any error of the user's reward function stops every process; so does its sys.exit (SystemExit is no
        # Exception). Not KeyboardInterrupt: a second Ctrl-C reaches every process, wherever each one is.
        except (Exception, SystemExit) as caught:  # noqa: BLE001
            error = caught
        try:
            self._stop_together(error)
            if not self._first_batch_scored:
                self._check_outcome_ratio(outcome)
                self._first_batch_scored = True
        except BaseException:
            self._stopped_in_score = True  # in every process alike, before this step changed any weight
            raise
        return scored

    def _score_here(self, batch: Rollout, step: int) -> tuple[Rollout, bool]:
        """:meth:`score` in this process alone (no collective): the scored batch, and whether its rewards act as
        outcome rewards (one float per completion, or steps that all end at the completion's last token: every
        token then gets the same advantage)."""
        if batch.eos is None:  # a batch built by hand: its labels say which responses hold the EOS token
            batch = dataclasses.replace(batch, eos=(batch.labels == self.eos_id).any(-1))  # [B]
        lengths = batch.mask.long().sum(-1)  # [B] response tokens
        try:
            raw = process.call_reward(self.reward_fn, batch.prompts, batch.completions, batch.answers, batch.eos,
                                      batch.labels, self.tokenizer)
            scores, steps = process.parse_rewards(raw, lengths)  # [B], steps or None
        except process.RewardError as error:
            raise process.RewardError(f"{error} (reward {self.cfg.reward!r}, step {step})") from None
        if steps is not None:
            process.check_process_advantage(self.cfg)
            if self.score_norm.active:
                self._refuse_score_norm_of_steps()
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise NonFiniteError(
                f"non-finite reward at step {step}: {len(bad)} of {len(raw)} samples (batch indices {bad[:8]}); "
                f"first: reward={raw[i]!r} prompt={batch.prompts[i]!r} completion={batch.completions[i]!r}"
            )
        scores, steps = process.eos_penalty(scores, steps, batch.eos, self.cfg.missing_eos_penalty, lengths)
        fields = dict(zip(("step_rewards", "step_ends", "step_mask"), steps)) if steps is not None else {}
        outcome = steps is None or process.steps_all_end_last(steps, lengths)  # step rewards that act as outcomes
        return dataclasses.replace(batch, scores=scores, **fields), outcome

    def _stop_together(self, error: BaseException | None) -> None:
        """Raise ``error`` (this process's, or None) -- and under torchrun make every process stop when any one
        does: one all-reduce finds the first process (by rank) that stopped and the kind of its error (one of
        :data:`STOP_TOGETHER`, or any other exception, such as one raised inside the user's reward function). The
        first process raises its own error; every other one raises the first one's kind (a RewardError for an
        exception of another kind) with its message, broadcast, chained to its own error if it had one -- so that
        every process exits with the same status, and rank 0 says what happened wherever it happened."""
        kinds = len(STOP_TOGETHER) + 1  # the last code: an exception of another kind
        if not self.distributed:
            if error is not None:
                raise error
            return
        kind = None if error is None else next(
            (i for i, known in enumerate(STOP_TOGETHER) if isinstance(error, known)), len(STOP_TOGETHER))
        code = self.world * kinds if error is None else self.rank * kinds + kind
        flag = torch.tensor([code], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first, kind = divmod(int(flag), kinds)
        if first == self.world:
            return
        message = [None]
        if self.rank == first:
            message = [str(error) if kind < len(STOP_TOGETHER) else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=first)
        if self.rank == first:
            raise error
        if kind == 0:  # a ConfigError: its message starts with the field
            raise ConfigError(message[0]) from error
        known = STOP_TOGETHER[kind] if kind < len(STOP_TOGETHER) else process.RewardError
        raise known(f"process {first} stopped: {message[0]}") from error

    def _refuse_score_norm_of_steps(self) -> None:
        flag = "reward_norm" if self.cfg.reward_norm != "none" else "reward_clip"
        raise ConfigError(f"{flag}: normalises outcome scores, but the reward function returned step rewards "
                          "(process supervision); run without it")

    def _check_outcome_ratio(self, outcome: bool) -> None:
        """At the first batch scored, before any update: refuse ``ratio`` 'sequence' where it changes nothing with
        outcome rewards (:func:`process.check_outcome_ratio`) when ``outcome`` (the batch's rewards are outcome
        rewards) holds in every process (one process's step rewards make it matter; all refuse, or none)."""
        if not self.cfg.sequence_ratio_needs_steps():  # the same in every process: no collective otherwise
            return
        if self.distributed:
            flag = torch.tensor([int(outcome)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            outcome = bool(flag)
        if outcome:
            process.check_outcome_ratio(self.cfg)

    @torch.no_grad()
    def score_tokens(self, batch: Rollout) -> Rollout:
        """Score phase, tokens: the batch with what the models before this step's update say of its responses.

        ``old_logp`` [B, R], the policy's log-probs, when the update needs them apart from its own forward
        (PPO, or several epochs or minibatches); ``ref_logp`` [B, R] when there is a reference model;
        ``old_values`` [B, R], the critic's values (PPO). Each is None otherwise.
        """
        cfg = self.cfg
        inputs = (batch.ids, batch.attention_mask, batch.labels)
        # the KL at rollout (kl_in 'reward', the adaptive controller's measure) needs the old log-probs too
        kl_at_rollout = self.ref is not None and (cfg.kl_in == "reward" or cfg.kl_target is not None)
        separate_pass = cfg.algo == "ppo" or cfg.epochs > 1 or cfg.minibatches > 1 or kl_at_rollout
        return dataclasses.replace(
            batch,
            old_logp=self.policy_lp(*inputs, return_entropy=False) if separate_pass else None,
            ref_logp=self.ref(*inputs, return_entropy=False) if self.ref is not None else None,
            old_values=self.critic(*inputs) if self.critic is not None else None,
        )

    @torch.no_grad()
    def advantages(self, batch: Rollout) -> Rollout:
        """Advantages phase: the batch with ``advantages`` (and, PPO, ``returns``; ``kl_seq`` when measured).

        ``kl_t`` [B, R] is ``kl_estimator(old_logp, ref_logp)`` at rollout when there is a reference and
        the old log-probs were taken apart (``kl_seq`` [B] its sum over each response), else 0.
        GRPO: ``group_advantages`` of the scores, [B], or with step rewards ``process_advantages`` of the
        steps, [B, R]; with ``kl_in`` 'reward' ``A_t = A - kl_coef * Σ_{t'>=t} kl_t'`` [B, R]
        (:func:`knobs.grpo_token_advantages`).
        PPO: per-token rewards (``-kl_coef * kl_t`` with ``kl_in`` 'reward') plus the score on each
        response's last token (with step rewards: each on its end token; with ``truncation='bootstrap'``: plus
        γ·V after a truncated response), GAE over the critic's ``old_values``; with ``whiten_advantages`` the
        advantages are whitened with the statistics of the global batch (every process's tokens), [B, R].
        """
        cfg, ops = self.cfg, self.ops
        m = batch.mask.float()  # [B, R]
        measured = batch.ref_logp is not None and batch.old_logp is not None
        kl = ops.kl_penalty(batch.old_logp, batch.ref_logp, cfg.kl_estimator) * m if measured else torch.zeros_like(m)  # [B, R]
        kl_seq = kl.sum(-1) if measured else None  # [B]
        in_reward = measured and cfg.kl_in == "reward"
        if cfg.algo == "grpo":
            if batch.steps is not None:  # process supervision: per-token advantages
                adv = ops.process_advantages(batch.step_rewards, batch.step_ends, batch.mask.shape[1],
                                             step_mask=batch.step_mask, group_size=cfg.group_size,
                                             mode=cfg.advantage)  # [B, R]
                if in_reward:
                    adv = adv - self.kl_coef * knobs.kl_reward_to_go(kl, batch.mask)  # [B, R]
            else:
                adv = ops.group_advantages(batch.scores, cfg.group_size, mode=cfg.advantage)  # [B]
                if in_reward:
                    adv = knobs.grpo_token_advantages(adv, kl, batch.mask, self.kl_coef)  # [B, R]
            return dataclasses.replace(batch, advantages=adv, kl_seq=kl_seq)
        rewards = -self.kl_coef * kl if in_reward else torch.zeros_like(m)  # [B, R]
        rewards = rewards + process.token_rewards(batch.scores, batch.steps, batch.mask)  # [B, R]
        if cfg.truncation == "bootstrap":  # truncated responses continue past their last token: + γ·V(after it)
            if cfg.shard == "fsdp":  # a sharded forward needs every process: all rows, inside the critic's root
                every = dataclasses.replace(batch, eos=torch.zeros_like(batch.eos))  # [B] all "truncated"
                boot = self.critic(sharding.unwrap(self.critic), every, cfg.gamma, call=process.bootstrap_rewards)
                rewards = rewards + boot * (~batch.eos)[:, None]  # [B, R] the truncated rows only
            else:
                rewards = rewards + process.bootstrap_rewards(self.critic, batch, cfg.gamma)  # [B, R]
        adv, ret = ops.gae(rewards, batch.old_values, batch.mask, gamma=cfg.gamma, lam=cfg.lam)  # [B, R] x2
        # whitening statistics cover the global batch: each process's own would make N processes differ from one
        if cfg.whiten_advantages and self.distributed:
            adv = rlkernels.masked_whiten(adv, batch.mask, process_group=dist.group.WORLD)  # [B, R]
        elif cfg.whiten_advantages:
            adv = ops.masked_whiten(adv, batch.mask)  # [B, R]
        return dataclasses.replace(batch, advantages=adv, returns=ret, kl_seq=kl_seq)

    def normalize_scores(self, batch: Rollout) -> Rollout:
        """``reward_norm`` / ``reward_clip``: the batch with normalised ``scores`` and the reward function's in
        ``raw_scores``; unchanged when both are off. The statistics cover every process's scores."""
        if not self.score_norm.active:
            return batch
        if batch.steps is not None:  # refused, not ignored: step rewards are z-scored per group or enter GAE as given
            self._refuse_score_norm_of_steps()  # (the trainer's score() has refused it already, in every process)
        pool = batch.scores  # [B]
        if self.distributed:
            parts = [torch.empty_like(batch.scores) for _ in range(self.world)]
            dist.all_gather(parts, batch.scores.contiguous())
            pool = torch.cat(parts)  # [B * world]
        return dataclasses.replace(batch, scores=self.score_norm(batch.scores, pool), raw_scores=batch.scores)

    def _token_scale(self, mb: Rollout) -> float:
        """DDP averages gradients over processes; a token mean is multiplied by this so that the result is
        the global token mean (local tokens * processes / global tokens; 1 in one process)."""
        if not self.distributed:
            return 1.0
        local = float(mb.mask.sum())
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return local * self.world / float(total)

    def update(self, batch: Rollout, step: int) -> dict:
        """Update phase: ``epochs`` passes of ``minibatches`` optimizer steps on :func:`minibatch_loss`;
        returns the mean of the applied minibatches' metrics (plus ``policy/grad_norm`` when clipping).

        With ``target_kl``: once a minibatch's approx KL to the old policy (averaged over processes)
        exceeds ``1.5 * target_kl``, its optimizer step and all later ones of this step are skipped;
        ``policy/early_stop`` (1/0) and ``policy/updates`` (optimizer steps taken) say where."""
        cfg = self.cfg
        B = batch.ids.shape[0]
        size = B // cfg.minibatches
        history = []
        stopped, updates = False, 0
        for epoch in range(cfg.epochs):
            order = torch.randperm(B, device=self.device) if cfg.minibatches > 1 else torch.arange(B, device=self.device)
            for k in range(cfg.minibatches):
                mb = batch.select(order[k * size : (k + 1) * size])
                loss, logs = minibatch_loss(cfg, self.ops, self.policy_ddp, self.critic_ddp, mb, self._token_scale(mb),
                                            kl_coef=self.kl_coef)
                if not math.isfinite(float(loss.detach())):
                    raise NonFiniteError(
                        f"non-finite loss at step {step} (epoch {epoch}, minibatch {k}): {logs}; "
                        f"batch prompts {mb.prompts[:4]!r} completions {mb.completions[:4]!r}"
                    )
                if cfg.target_kl is not None and knobs.should_stop_early(self._global_mean(logs["policy/approx_kl"]),
                                                                         cfg.target_kl):
                    stopped = True  # this minibatch's step and every later one are skipped
                    if not history:
                        history.append(logs)  # the metrics of what was measured, though nothing was applied
                    break
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.max_grad_norm > 0:
                    logs["policy/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm))
                    if self.critic is not None:
                        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                updates += 1
                history.append(logs)
            if stopped:
                break
        keys = [key for key in history[0] if all(key in logs for logs in history)]
        out = {key: sum(logs[key] for logs in history) / len(history) for key in keys}
        if cfg.target_kl is not None:
            out["policy/early_stop"] = float(stopped)
            out["policy/updates"] = float(updates)
        return out

    def _global_mean(self, value: float) -> float:
        """``value`` averaged over processes (every process must take the same early-stop decision)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def adapt_kl(self, seq_kl: float) -> None:
        """Adaptive KL controller (Ziegler et al. 2019): move kl_coef toward the target KL.

        ``seq_kl`` is the batch's mean per-sequence KL at rollout (``policy/kl_seq``), whichever algo and
        ``kl_in``: ``kl_coef *= 1 + clip(seq_kl / kl_target - 1, ±0.2) * batch / kl_horizon``."""
        cfg = self.cfg
        if cfg.kl_target is None:
            return
        error = max(-0.2, min(0.2, seq_kl / cfg.kl_target - 1.0))
        self.kl_coef *= 1.0 + error * cfg.prompts_per_step * cfg.group_size / cfg.kl_horizon

    def batch_metrics(self, batch: Rollout) -> dict:
        """Log phase: the rollout's raw reward and length; the per-sequence KL at rollout when it was measured,
        and the KL coefficient (PPO, or whenever the adaptive controller moves it); the normalised scores'
        mean with reward_norm/reward_clip."""
        raw = batch.scores if batch.raw_scores is None else batch.raw_scores  # [B]
        metrics = {
            "reward/mean": float(raw.mean()),
            "reward/std": float(raw.std()) if raw.numel() > 1 else 0.0,
            "reward/solved": float(process.solved(raw, batch.steps).float().mean()),
            "response/eos": float(batch.eos.float().mean()),
            "response/length": float(batch.mask.float().sum(-1).mean()),
        }
        if batch.raw_scores is not None:
            metrics["reward/normalized_mean"] = float(batch.scores.mean())
        if self.cfg.rule_reward:  # the task's rule, logged only (e.g. the true score under a reward model)
            raw_rule = process.call_reward(REWARDS[self.cfg.rule_reward], batch.prompts, batch.completions,
                                           batch.answers, batch.eos, batch.labels, self.tokenizer)
            rule, rule_steps = process.parse_rewards(raw_rule, batch.mask.long().sum(-1))  # [B]: mean step reward with steps
            metrics["reward/rule"] = float(rule.mean())
            metrics["reward/rule_solved"] = float(process.solved(rule, rule_steps).float().mean())
        if batch.kl_seq is not None:  # without a reference model there is no KL to report (it is not 0)
            metrics["policy/kl_seq"] = float(batch.kl_seq.mean())
        if self.cfg.algo == "ppo" or self.cfg.kl_target is not None:
            metrics["policy/kl_coef"] = self.kl_coef
        return metrics

    def rollout_and_score(self, step: int) -> tuple[Rollout, float]:
        """Step ``step``'s first phases: seeded rollout, then the rewards (:meth:`score`); returns the scored batch
        and the step's start time (``time.perf_counter``). :meth:`run` calls it for its first step before it
        touches the output folder, since that batch may refuse the run (:meth:`_check_outcome_ratio`)."""
        start = time.perf_counter()
        torch.manual_seed(((self.cfg.seed * 1_000_003 + step) * 1009 + self.rank) % 2**64)  # torch takes 64 bits
        batch = self.rollout(step)  # rollout
        return self.score(batch, step), start

    def train_step(self, step: int, scored: tuple[Rollout, float] | None = None) -> dict:
        """One step: rollout -> score -> advantages -> update -> log; returns the step's metrics (averaged
        over processes). ``scored``: what :meth:`rollout_and_score` already returned for this step."""
        cfg = self.cfg
        batch, start = scored if scored is not None else self.rollout_and_score(step)
        batch = self.score_tokens(self.normalize_scores(batch))  # score: the tokens
        batch = self.advantages(batch)  # advantages
        before_update = self._clock()
        metrics = self.update(batch, step)  # update
        update_s = self._clock() - before_update
        metrics.update(self.batch_metrics(batch))  # log
        if cfg.kl_target is not None:
            # after logging the coefficient this step used; the global batch's mean (every process holds as many
            # sequences), what policy/kl_seq logs, so that every process keeps the same kl_coef
            self.adapt_kl(self._global_mean(float(batch.kl_seq.mean())))
        if self.ref is not None:  # after the update: ref_update_every / ref_mix_alpha
            knobs.update_reference(sharding.unwrap(self.ref).model, self.policy, step, cfg.ref_update_every, cfg.ref_mix_alpha)
        if self.distributed:  # average the logged scalars over processes
            keys = sorted(metrics)
            t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            metrics = {k: float(v) / self.world for k, v in zip(keys, t)}
        tokens = float(batch.attention_mask.sum()) * self.world
        elapsed = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = tokens / elapsed
        metrics["perf/step_s"] = elapsed
        # the update phase alone (the losses' forward and backward, the optimizer; on this process): the step time
        # also holds generation, scoring, and any kernel compilation a new batch shape brings to those phases
        metrics["perf/update_s"] = update_s
        return metrics

    def _clock(self) -> float:
        """Seconds (``time.perf_counter``) once the device's queued work has finished (a GPU runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ bookkeeping

    def _modules(self) -> dict:
        mods = {"policy": self.policy}
        if self.critic is not None:
            mods["critic"] = self.critic
        if self.ref is not None and (self.cfg.ref_update_every or self.cfg.ref_mix_alpha):  # it moves: save it
            mods["reference"] = sharding.unwrap(self.ref).model
        return mods

    def save(self) -> Path | None:
        if self.cfg.shard == "fsdp":  # every process writes its shards
            path = sharding.save(self.out / "checkpoints", self.step, self._modules(), self.optimizer,
                                 {"kl_coef": self.kl_coef, "reward_norm": self.score_norm.state_dict(),
                                  "config": self.cfg.to_dict()})
            self._saved_step = self.step
            return path
        path = None
        if self.rank == 0:
            path = checkpoint.save(self.out / "checkpoints", self.step, self._modules(), self.optimizer,
                                   {"kl_coef": self.kl_coef, "reward_norm": self.score_norm.state_dict(),
                                    "config": self.cfg.to_dict()})
        if self.distributed:
            dist.barrier()
        self._saved_step = self.step  # once written (a failed save leaves the steps counted as unsaved)
        return path

    def _apply_optimizer_settings(self) -> None:
        """Set the config's learning rates and weight decay on the optimizer's param groups: group 0 the policy
        (``lr``), group 1 the critic (``critic_lr``, PPO); ``weight_decay`` on both. At construction, and again
        after a resume has loaded the checkpoint's optimizer state (which carries the saved run's values)."""
        cfg = self.cfg
        for group, lr in zip(self.optimizer.param_groups, (cfg.lr, cfg.critic_lr)):
            group["lr"] = lr
            group["weight_decay"] = cfg.weight_decay

    def maybe_resume(self, trim_log: bool = True) -> None:
        """Load the newest checkpoint (weights, optimizer moments, RNG, step, running reward statistics). The
        config given now wins over the checkpoint's where they differ: ``lr``, ``critic_lr`` and ``weight_decay``
        are set on the loaded optimizer; ``kl_coef`` is the config's, except that with ``kl_target`` the adapted
        coefficient continues from the checkpoint as long as ``kl_coef`` itself is unchanged. The run's first
        batch accepted its ``ratio`` (:meth:`_check_outcome_ratio`): that stands while none of
        :data:`SEQUENCE_RATIO_FIELDS` changed. ``trim_log``: drop the lines of ``metrics.jsonl`` logged after the
        checkpoint now (:meth:`run` does it later, once the resumed first batch is scored)."""
        if not self.cfg.resume:
            return
        path = checkpoint.latest(self.out / "checkpoints")
        if path is None:
            raise ConfigError(f"resume: no checkpoint under {self.out / 'checkpoints'} (start without --resume)")
        modules = self._modules()
        if self.cfg.shard == "fsdp":
            state = sharding.load(path, modules, self.optimizer)
        else:
            if "reference" in modules and not (path / "reference.safetensors").exists():
                # written before the reference moved: it was then still the initial one, which self.ref holds now
                del modules["reference"]
            state = checkpoint.load(path, modules, self.optimizer)
        self.step = int(state["step"])
        self._apply_optimizer_settings()  # the loaded state holds the saved lr / weight decay
        saved_coef = (state.get("config") or {}).get("kl_coef", self.cfg.kl_coef)  # the run's starting coefficient
        if self.cfg.kl_target is not None and "kl_coef" in state and saved_coef == self.cfg.kl_coef:
            self.kl_coef = float(state["kl_coef"])  # the adaptive controller's state: it continues
        if "reward_norm" in state:
            self.score_norm.load_state_dict(state["reward_norm"])
        saved, now = state.get("config") or {}, self.cfg.to_dict()
        if all(name in saved and saved[name] == now[name] for name in SEQUENCE_RATIO_FIELDS):
            self._first_batch_scored = True  # decided at the run's own first batch
        if self.rank == 0:
            left = "" if self.step < self.cfg.steps else f": nothing left to run (steps = {self.cfg.steps})"
            print(f"resumed from step {self.step} ({path}){left}", file=sys.stderr, flush=True)
            for line in self._resume_notes:
                print(line, file=sys.stderr, flush=True)
        if trim_log:
            self._trim_log()

    def _trim_log(self) -> None:
        """Drop the lines of ``metrics.jsonl`` logged after the step resumed from (rank 0)."""
        log = self.out / "metrics.jsonl"
        if self.rank == 0 and log.exists():
            lines = [(number, ln) for number, ln in enumerate(log.read_text().splitlines(), 1) if ln.strip()]
            kept = []
            for number, ln in lines:
                try:
                    step = json.loads(ln)["step"]
                    keep = step <= self.step
                except (ValueError, KeyError, TypeError):
                    if number == lines[-1][0]:  # the write a crash cut short: a step after the checkpoint's
                        print(f"resume: dropped the last line of {log}, cut short (not a metrics record)",
                              file=sys.stderr, flush=True)
                        continue
                    raise ConfigError(f"resume: line {number} of {log} is not a metrics record (a JSON object with "
                                      f"a 'step'); repair or remove that line") from None
                if keep:
                    kept.append(ln)
            log.write_text("".join(ln + "\n" for ln in kept))

    def _install_sigint(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self._stop_requested:  # second Ctrl-C: stop now
                raise KeyboardInterrupt
            self._stop_requested = True

        return signal.signal(signal.SIGINT, handler)

    def _should_stop(self) -> bool:
        flag = self._stop_requested
        if self.distributed:
            t = torch.tensor([int(flag)], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t)
        return flag

    def progress_values(self, metrics: dict) -> dict[str, str]:
        """The progress bar's values for one step's ``metrics``.

        The KL to the reference (per token for GRPO, per sequence in the PPO rewards) when there is a
        reference model, and the entropy. The clip fraction only when it can be nonzero: with one epoch
        of one minibatch every ratio is exactly 1 (GRPO takes the old log-probs from the same forward,
        PPO from a pass with the same weights), so it would always read 0.
        """
        values = {"reward": f"{metrics['reward/mean']:.3f}"}
        kl_key = "policy/kl" if "policy/kl" in metrics else "policy/kl_seq" if self.ref is not None else None
        if kl_key is not None and kl_key in metrics:
            values["kl"] = f"{metrics[kl_key]:.4f}"
        if "policy/entropy" in metrics:
            values["ent"] = f"{metrics['policy/entropy']:.3f}"
        if self.cfg.epochs * self.cfg.minibatches > 1 and "policy/clipfrac" in metrics:
            values["clip"] = f"{metrics['policy/clipfrac']:.3f}"
            values["out"] = f"{metrics['policy/ratio_outside']:.3f}"
        if metrics.get("policy/early_stop"):
            values["stop"] = f"{metrics['policy/updates']:.0f}"
        values["tok_s"] = f"{metrics['perf/tokens_per_s']:.0f}"
        return values

    def run(self, on_step=None) -> dict:
        """Train to ``cfg.steps``; returns the summary. ``on_step(step, metrics)`` is called after each step."""
        cfg = self.cfg
        self.maybe_resume(trim_log=False)  # reads the checkpoint; the folder is not changed yet
        self._resumed_from = self._saved_step = self.step
        wall = time.perf_counter()
        # Ctrl-C while the first batch is rolled out and scored finishes that step too (then saves and stops)
        previous = self._install_sigint()
        try:
            # the first step's batch is scored before the folder changes: it may refuse the run (a ConfigError), and
            # a refused command must leave an earlier run (--overwrite) and a resumed one's config and log as they were
            first = self.rollout_and_score(self.step + 1) if self.step < cfg.steps else None
            set_up = time.perf_counter()
            if cfg.overwrite and self.rank == 0:
                checkpoint.clear_run(self.out)  # the earlier run's files: its checkpoints must not be resumed later
            if self.distributed:
                dist.barrier()
            self.out.mkdir(parents=True, exist_ok=True)
            if cfg.resume:
                self._trim_log()
                if self.rank == 0:  # the earlier invocation's: a stop from here on must not leave it describing
                    (self.out / "summary.json").unlink(missing_ok=True)  # the changed log and checkpoints
            if self.rank == 0:
                (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        except BaseException:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            raise
        if first is not None:  # the folder's set-up (an --overwrite'd run's deletion) is no part of the step's time
            first = (first[0], first[1] + time.perf_counter() - set_up)
        # a fresh run starts a fresh log; a resumed one appends after the checkpoint's step
        log = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w") if self.rank == 0 else None
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress or self.rank != 0, desc=cfg.algo, dynamic_ncols=True)
        interrupted = False
        try:
            while self.step < cfg.steps:
                try:
                    scored = first if first is not None else self.rollout_and_score(self.step + 1)
                except BaseException:
                    self._save_before_stop()
                    raise
                metrics = self.train_step(self.step + 1, scored)
                first = None
                self.step += 1
                metrics = {"step": self.step, **metrics}
                if log is not None and (self.step % cfg.log_every == 0 or self.step == cfg.steps):
                    log.write(json.dumps(metrics) + "\n")
                    log.flush()
                # the values first, then the count: update() draws the bar, so both belong to this step
                bar.set_postfix(self.progress_values(metrics), refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(self.step, metrics)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                if self._should_stop():
                    interrupted = True
                    break
            if self.step > self._resumed_from:  # a resume with nothing left to run keeps its checkpoint as is
                self.save()
        finally:
            bar.close()
            if log is not None:
                log.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        summary = self.summarize(time.perf_counter() - wall, interrupted)
        return summary

    def _save_before_stop(self) -> None:
        """When a step stops in its score phase (a reward function's error or malformed return, a NaN reward, step
        rewards a flag refuses: under torchrun every process stops there together, before the step changed any
        weight), save the steps trained since the last checkpoint, so that ``--resume`` continues after them instead
        of losing them (with ``save_every 0`` all of them). A stop elsewhere saves nothing: a rollout that found the
        probabilities non-finite, or an update stopped between two optimizer steps, has no state worth keeping.
        A save that fails itself is reported and the step's own error raised."""
        if not self._stopped_in_score or self.step <= self._saved_step:
            return
        try:
            path = self.save()
        except Exception as error:  # noqa: BLE001 -- the step's error is the one to raise
            print(f"could not save the {self.step - self._saved_step} steps trained before the stop: "
                  f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return
        if self.rank == 0:
            where = path if path is not None else self.out / "checkpoints"
            print(f"saved step {self.step} before the stop ({where}): --resume continues from it", file=sys.stderr,
                  flush=True)

    def summarize(self, wall_s: float, interrupted: bool) -> dict:
        rows = read_metrics(self.out / "metrics.jsonl") if self.rank == 0 else []
        rewards = [r["reward/mean"] for r in rows]
        fifth = max(1, len(rewards) // 5)
        summary = {
            "algo": self.cfg.algo,
            "losses": self.cfg.losses,
            "steps": self.step,
            "resumed_from": self._resumed_from,
            "steps_run": self.step - self._resumed_from,
            "interrupted": interrupted,
            "wall_s": round(wall_s, 2),
            "reward_first_fifth": sum(rewards[:fifth]) / fifth if rewards else float("nan"),
            "reward_last_fifth": sum(rewards[-fifth:]) / fifth if rewards else float("nan"),
            "solved_last_fifth": sum(r["reward/solved"] for r in rows[-fifth:]) / fifth if rows else float("nan"),
            **({"reward_rule_first_fifth": sum(r["reward/rule"] for r in rows[:fifth]) / fifth,
                "reward_rule_last_fifth": sum(r["reward/rule"] for r in rows[-fifth:]) / fifth}
               if rows and "reward/rule" in rows[0] else {}),
            "output_dir": str(self.out),
        }
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            if self.cfg.plot and rows:
                plot(rows, self.out / "plot.png", self.cfg.kl_estimator or "k3")
        return summary


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def smooth_centred(ys: list[float], window: int) -> list[float]:
    """Centred moving mean of the finite values: point i averages ``ys[i-h : i+h+1]`` with
    ``h = min(window // 2, i, n-1-i)``, so the window stays symmetric at the ends and a trend
    is not shifted (a trailing mean lags by half its window). NaN where a window has no finite value."""
    n, half = len(ys), max(0, window // 2)
    out = []
    for i in range(n):
        h = min(half, i, n - 1 - i)
        vals = [y for y in ys[i - h : i + h + 1] if math.isfinite(y)]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def figure(rows: list[dict], kl_estimator: str = "k3"):
    """The run's figure: reward, KL to the reference, entropy per step, raw and smoothed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    # GRPO logs the per-token KL of its loss; PPO the per-sequence k1 KL it puts into the rewards
    kl_key = next((k for k in ("policy/kl", "policy/kl_seq") if any(k in r for r in rows)), None)
    kl_label = {"policy/kl": f"KL per token ({kl_estimator})", "policy/kl_seq": f"KL per sequence ({kl_estimator})"}.get(kl_key, "KL")
    panels = [("reward/mean", "reward", "mean reward"), (kl_key, "KL to reference", kl_label),
              ("policy/entropy", "entropy", "entropy per token (nats)")]
    window = 2 * max(1, len(rows) // 40) + 1  # 21 steps for 400
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title, ylabel) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if key is None:
            ax.text(0.5, 0.5, "no reference model (kl_coef = 0)", ha="center", va="center", transform=ax.transAxes)
            continue
        ys = [float(r.get(key, float("nan"))) for r in rows]
        ax.plot(steps, ys, lw=0.8, alpha=0.45, color="tab:blue", label="raw")
        ax.plot(steps, smooth_centred(ys, window), lw=1.8, color="tab:orange", label=f"centred mean of {window} steps")
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path, kl_estimator: str = "k3") -> None:
    """Write :func:`figure` of ``rows`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(rows, kl_estimator)
    fig.savefig(path, dpi=110)
    plt.close(fig)
