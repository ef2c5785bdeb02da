"""The PPO/GRPO loop: rollout -> score -> advantages -> update -> log, one step at a time.

Losses are the pure ``(loss, metrics)`` functions of the op provider
(``rlkernels`` fused ops, or ``rlkernels.reference`` with ``--losses eager``).
Under ``torchrun`` each process takes its share of the prompts (whole groups)
and gradients are averaged by ``DistributedDataParallel``; token means and PPO advantage
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

from . import checkpoint
from .config import ConfigError, TrainConfig
from .data import PromptSource
from .models import Critic, TokenLogprobs, frozen_copy, load_critic, load_policy, ops_provider
from .rewards import load_reward


class NonFiniteError(RuntimeError):
    """A reward or loss was NaN/inf; the message names the step and the batch."""


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
    kl_seq: torch.Tensor | None = None  # [B] PPO: the k1 KL to the reference summed over each response

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
    ``policy_head='fused'`` with ``losses='fused'``, and old log-probs from a separate pass (without them the
    update is on-policy, old = the log-probs being trained, which the fused op does not take; those updates
    run linear_logprobs then policy_loss). It reports the entropy only with ``entropy_coef`` > 0."""
    return cfg.policy_head == "fused" and cfg.losses == "fused" and mb.old_logp is not None


def minibatch_loss(cfg: TrainConfig, ops, policy, critic, mb: Rollout, token_scale: float = 1.0):
    """The loss of one minibatch and its metrics: ``(loss, metrics)``, no state read or written.

    ``policy`` is a :class:`TokenLogprobs` (or its DDP wrapper), ``critic`` a :class:`Critic` (PPO) or
    None, ``ops`` the op provider. The loss is ``ops.policy_loss`` (GRPO: with the KL to the reference;
    PPO: the KL is in the rewards) plus, for PPO, ``value_coef`` times ``ops.value_loss``. Token means
    are multiplied by ``token_scale`` (what makes DDP's gradient average a global token mean).
    ``metrics`` holds floats under namespaced keys: ``loss/policy``, ``policy/<policy_loss metric>``,
    and for PPO ``loss/value``, ``critic/<value_loss metric>``.
    """
    grpo_kl = cfg.algo == "grpo" and mb.ref_logp is not None  # PPO: the KL is in the rewards
    options = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, ratio=cfg.ratio,
                   ref_logp=mb.ref_logp if cfg.algo == "grpo" else None, kl_coef=cfg.kl_coef if grpo_kl else 0.0,
                   kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef, agg=cfg.agg)
    if uses_fused_head(cfg, mb):  # --- issue 12 ---
        hidden, weight, bias = policy(mb.ids, mb.attention_mask, mb.labels, head_inputs=True)  # [b, R, H], [V, H]
        loss, metrics = ops.linear_policy_loss(hidden, weight, mb.labels, mb.old_logp, mb.advantages, mb.mask,
                                               bias=bias, temperature=cfg.temperature, **options)
        metrics = {k: v for k, v in metrics.items() if not k.startswith("token_")}  # per-token tensors: not logged
    else:
        logp, entropy = policy(mb.ids, mb.attention_mask, mb.labels)  # [b, R] x2
        old = mb.old_logp if mb.old_logp is not None else logp.detach()  # [b, R]
        loss, metrics = ops.policy_loss(logp, old, mb.advantages, mb.mask, entropy=entropy, **options)
    logs = {"loss/policy": float(loss.detach()), **{f"policy/{k}": float(v) for k, v in metrics.items()}}
    total = loss * (token_scale if cfg.agg == "token-mean" else 1.0)  # sequence means need no rescaling
    if critic is not None:
        values = critic(mb.ids, mb.attention_mask, mb.labels)  # [b, R]
        vloss, vmetrics = ops.value_loss(values, mb.old_values, mb.returns, mb.mask, clip=cfg.value_clip)
        total = total + cfg.value_coef * token_scale * vloss  # the value loss is always a token mean
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
    if cfg.resume:
        path = checkpoint.latest(out / "checkpoints")
        if path is None:
            raise ConfigError(f"resume: no checkpoint under {out / 'checkpoints'} (start without --resume)")
        saved, now = checkpoint.saved_config(path), cfg.to_dict()
        for name in RESUME_FIXED:
            if name in saved and saved[name] != now[name]:
                raise ConfigError(f"{name}: {path} was trained with {saved[name]!r}; resume with that, or start a new "
                                  f"run in another output_dir (got {now[name]!r})")
        return [f"resume: {name} changed: {saved[name]!r} -> {value!r}" for name, value in now.items()
                if name in saved and name not in _NOT_HYPERPARAMETERS and saved[name] != value]
    used = checkpoint.run_files(out)
    if used and not cfg.overwrite:
        raise ConfigError(f"output_dir: {out} holds an earlier run ({', '.join(used)}); --resume continues it, "
                          "--overwrite deletes it, or choose another --output-dir")
    return []


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._resume_notes = check_output_dir(cfg)  # before anything is loaded: a config error, not a traceback
        self.ops = ops_provider(cfg.losses)
        if cfg.losses == "fused":
            # build (or load) the compiled extension now: a first build takes ~40 s, which inside the first
            # step would stall the progress bar at 0 with an ETA of hours
            from rlkernels import _extension

            _extension.load()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if cfg.prompts_per_step % self.world:
            raise ValueError(f"prompts_per_step: {cfg.prompts_per_step} does not divide over {self.world} processes")
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

        self.policy, self.tokenizer = load_policy(cfg)
        self.policy.to(self.device).train()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        need_ref = cfg.kl_coef > 0 or (cfg.algo == "ppo" and cfg.kl_target is not None)
        self.ref = TokenLogprobs(frozen_copy(self.policy), self.ops, cfg.temperature) if need_ref else None
        self.critic: Critic | None = load_critic(cfg, self.policy).to(self.device).train() if cfg.algo == "ppo" else None
        self.kl_coef = cfg.kl_coef

        self.policy_lp = TokenLogprobs(self.policy, self.ops, cfg.temperature)
        self.policy_ddp, self.critic_ddp = self.policy_lp, self.critic
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev_ids = [self.device.index] if self.device.type == "cuda" else None
            self.policy_ddp = DDP(self.policy_lp, device_ids=dev_ids)
            if self.critic is not None:
                self.critic_ddp = DDP(self.critic, device_ids=dev_ids)
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": cfg.lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": cfg.critic_lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
        self.step = 0
        self._resumed_from = 0  # the step run() started from (after a resume)
        self._stop_requested = False

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
        out = self.policy.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=cfg.temperature,
            top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
        )
        self.policy.train()
        response = out[:, prompt_ids.shape[1] :]  # [B, R]
        is_eos = response == self.eos_id
        mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # [B, R] up to and including the first EOS
        labels = response.masked_fill(~mask, -100)
        ids = torch.cat([prompt_ids, response.masked_fill(~mask, self.pad_id)], 1)  # [B, L]
        attention = torch.cat([prompt_mask, mask.long()], 1)  # [B, L]
        completions = self.tokenizer.batch_decode(response.masked_fill(~mask, self.pad_id), skip_special_tokens=True)
        return Rollout(ids, attention, labels, mask, [e.prompt for e in examples for _ in range(G)], completions,
                       [e.answer for e in examples for _ in range(G)])

    def score(self, batch: Rollout, step: int) -> Rollout:
        """Score phase, rewards: the batch with ``scores`` [B] from the reward function (finite, one each)."""
        raw = self.reward_fn(batch.prompts, batch.completions, batch.answers)
        scores = torch.as_tensor(raw, dtype=torch.float32, device=self.device)  # [B]
        if scores.shape != (batch.ids.shape[0],):
            raise ValueError(f"reward: returned {tuple(scores.shape)} scores for {batch.ids.shape[0]} completions")
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise NonFiniteError(
                f"non-finite reward at step {step}: {len(bad)} of {len(raw)} samples (batch indices {bad[:8]}); "
                f"first: reward={raw[i]!r} prompt={batch.prompts[i]!r} completion={batch.completions[i]!r}"
            )
        return dataclasses.replace(batch, scores=scores)

    @torch.no_grad()
    def score_tokens(self, batch: Rollout) -> Rollout:
        """Score phase, tokens: the batch with what the models before this step's update say of its responses.

        ``old_logp`` [B, R], the policy's log-probs, when the update needs them apart from its own forward
        (PPO, or several epochs or minibatches); ``ref_logp`` [B, R] when there is a reference model;
        ``old_values`` [B, R], the critic's values (PPO). Each is None otherwise.
        """
        cfg = self.cfg
        inputs = (batch.ids, batch.attention_mask, batch.labels)
        separate_pass = cfg.algo == "ppo" or cfg.epochs > 1 or cfg.minibatches > 1
        return dataclasses.replace(
            batch,
            old_logp=self.policy_lp(*inputs, return_entropy=False) if separate_pass else None,
            ref_logp=self.ref(*inputs, return_entropy=False) if self.ref is not None else None,
            old_values=self.critic(*inputs) if self.critic is not None else None,
        )

    @torch.no_grad()
    def advantages(self, batch: Rollout) -> Rollout:
        """Advantages phase: the batch with ``advantages`` (and, PPO, ``returns`` and ``kl_seq``).

        GRPO: ``group_advantages`` of the scores, [B]. PPO: per-token rewards ``-kl_coef * k1`` plus the
        score on each response's last token, GAE over the critic's ``old_values``, advantages whitened
        with the statistics of the global batch (every process's tokens), [B, R]; ``kl_seq`` [B] is the
        k1 KL of each response (0 without a reference model).
        """
        cfg, ops = self.cfg, self.ops
        if cfg.algo == "grpo":
            return dataclasses.replace(batch, advantages=ops.group_advantages(batch.scores, cfg.group_size,
                                                                              mode=cfg.advantage))  # [B]
        m = batch.mask.float()  # [B, R]
        kl = (batch.old_logp - batch.ref_logp) * m if batch.ref_logp is not None else torch.zeros_like(m)  # [B, R] k1
        rewards = -self.kl_coef * kl  # [B, R]
        last = batch.mask.long().sum(-1) - 1  # [B] index of the final response token
        rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += batch.scores
        adv, ret = ops.gae(rewards, batch.old_values, batch.mask, gamma=cfg.gamma, lam=cfg.lam)  # [B, R] x2
        # whitening statistics cover the global batch: each process's own would make N processes differ from one
        if self.distributed:
            adv = rlkernels.masked_whiten(adv, batch.mask, process_group=dist.group.WORLD)  # [B, R]
        else:
            adv = ops.masked_whiten(adv, batch.mask)  # [B, R]
        return dataclasses.replace(batch, advantages=adv, returns=ret, kl_seq=kl.sum(-1))

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
        returns the mean of the minibatches' metrics (plus ``policy/grad_norm`` when clipping)."""
        cfg = self.cfg
        B = batch.ids.shape[0]
        size = B // cfg.minibatches
        history = []
        for epoch in range(cfg.epochs):
            order = torch.randperm(B, device=self.device) if cfg.minibatches > 1 else torch.arange(B, device=self.device)
            for k in range(cfg.minibatches):
                mb = batch.select(order[k * size : (k + 1) * size])
                loss, logs = minibatch_loss(cfg, self.ops, self.policy_ddp, self.critic_ddp, mb, self._token_scale(mb))
                if not math.isfinite(float(loss.detach())):
                    raise NonFiniteError(
                        f"non-finite loss at step {step} (epoch {epoch}, minibatch {k}): {logs}; "
                        f"batch prompts {mb.prompts[:4]!r} completions {mb.completions[:4]!r}"
                    )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.max_grad_norm > 0:
                    logs["policy/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm))
                    if self.critic is not None:
                        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                history.append(logs)
        return {key: sum(logs[key] for logs in history) / len(history) for key in history[0]}

    def adapt_kl(self, seq_kl: float) -> None:
        """Adaptive KL controller (Ziegler et al. 2019): move kl_coef toward the target KL."""
        cfg = self.cfg
        if cfg.algo != "ppo" or cfg.kl_target is None:
            return
        error = max(-0.2, min(0.2, seq_kl / cfg.kl_target - 1.0))
        self.kl_coef *= 1.0 + error * cfg.prompts_per_step * cfg.group_size / cfg.kl_horizon

    def batch_metrics(self, batch: Rollout) -> dict:
        """Log phase: the rollout's reward and length, and for PPO the KL in its rewards and its coefficient."""
        metrics = {
            "reward/mean": float(batch.scores.mean()),
            "reward/std": float(batch.scores.std()) if batch.scores.numel() > 1 else 0.0,
            "reward/solved": float((batch.scores >= 1.0).float().mean()),
            "response/length": float(batch.mask.float().sum(-1).mean()),
        }
        if self.cfg.algo == "ppo":
            if self.ref is not None:  # without a reference model there is no KL to report (it is not 0)
                metrics["policy/kl_seq"] = float(batch.kl_seq.mean())
            metrics["policy/kl_coef"] = self.kl_coef
        return metrics

    def train_step(self, step: int) -> dict:
        """One step: rollout -> score -> advantages -> update -> log; returns the step's metrics (averaged
        over processes)."""
        cfg = self.cfg
        start = time.perf_counter()
        torch.manual_seed((cfg.seed * 1_000_003 + step) * 1009 + self.rank)
        batch = self.rollout(step)  # rollout
        batch = self.score_tokens(self.score(batch, step))  # score: rewards, then tokens
        batch = self.advantages(batch)  # advantages
        metrics = self.update(batch, step)  # update
        metrics.update(self.batch_metrics(batch))  # log
        if cfg.algo == "ppo":
            self.adapt_kl(float(batch.kl_seq.mean()))  # after logging the coefficient this step used
        if self.distributed:  # average the logged scalars over processes
            keys = sorted(metrics)
            t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            metrics = {k: float(v) / self.world for k, v in zip(keys, t)}
        tokens = float(batch.attention_mask.sum()) * self.world
        elapsed = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = tokens / elapsed
        metrics["perf/step_s"] = elapsed
        return metrics

    # ------------------------------------------------------------------ bookkeeping

    def _modules(self) -> dict:
        mods = {"policy": self.policy}
        if self.critic is not None:
            mods["critic"] = self.critic
        return mods

    def save(self) -> Path | None:
        path = None
        if self.rank == 0:
            path = checkpoint.save(self.out / "checkpoints", self.step, self._modules(), self.optimizer,
                                   {"kl_coef": self.kl_coef, "config": self.cfg.to_dict()})
        if self.distributed:
            dist.barrier()
        return path

    def maybe_resume(self) -> None:
        if not self.cfg.resume:
            return
        path = checkpoint.latest(self.out / "checkpoints")
        if path is None:
            raise ConfigError(f"resume: no checkpoint under {self.out / 'checkpoints'} (start without --resume)")
        state = checkpoint.load(path, self._modules(), self.optimizer)
        self.step = int(state["step"])
        self.kl_coef = float(state.get("kl_coef", self.kl_coef))
        if self.rank == 0:
            left = "" if self.step < self.cfg.steps else f": nothing left to run (steps = {self.cfg.steps})"
            print(f"resumed from step {self.step} ({path}){left}", file=sys.stderr, flush=True)
            for line in self._resume_notes:
                print(line, file=sys.stderr, flush=True)
        if self.rank == 0:  # drop metrics logged after the checkpoint
            log = self.out / "metrics.jsonl"
            if log.exists():
                kept = [ln for ln in log.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
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
        values["tok_s"] = f"{metrics['perf/tokens_per_s']:.0f}"
        return values

    def run(self, on_step=None) -> dict:
        """Train to ``cfg.steps``; returns the summary. ``on_step(step, metrics)`` is called after each step."""
        cfg = self.cfg
        if cfg.overwrite and self.rank == 0:
            checkpoint.clear_run(self.out)  # the earlier run's files: its checkpoints must not be resumed later
        if self.distributed:
            dist.barrier()
        self.out.mkdir(parents=True, exist_ok=True)
        self.maybe_resume()
        self._resumed_from = self.step
        if self.rank == 0:
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        previous = self._install_sigint()
        # a fresh run starts a fresh log; a resumed one appends after the checkpoint's step
        log = open(self.out / "metrics.jsonl", "a" if cfg.resume else "w") if self.rank == 0 else None
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress or self.rank != 0, desc=cfg.algo, dynamic_ncols=True)
        wall = time.perf_counter()
        interrupted = False
        try:
            while self.step < cfg.steps:
                metrics = self.train_step(self.step + 1)
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
            "output_dir": str(self.out),
        }
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            if self.cfg.plot and rows:
                plot(rows, self.out / "plot.png", self.cfg.kl_estimator)
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
    kl_label = {"policy/kl": f"KL per token ({kl_estimator})", "policy/kl_seq": "KL per sequence (k1)"}.get(kl_key, "KL")
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
