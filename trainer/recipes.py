"""``--recipe``: each paper's PPO/GRPO hyperparameters as one switch (issue 15, item 9).

A recipe is a set of field values applied over the preset and under any config file or flag
(defaults < preset < recipe < config file < flags), so ``--recipe dapo --lr 3e-6`` is DAPO with another
learning rate. The run's ``config.json`` records the resolved values (and the recipe's name).

Values are the papers' own; a value a paper does not state is not set (the trainer's default stays).
Sizes the tiny CPU demo cannot afford (DeepSeekMath's 1024-sample batches, DAPO's 512 prompts) are
left out: group sizes and epochs/minibatch splits are set, batch and prompt counts are not.

InstructGPT started its value function from the reward model: the recipe leaves that to
``--critic-init reward`` (it needs a reward-model directory as ``--reward``; the rule rewards have no weights).
"""
from __future__ import annotations

# Each recipe: {field: value}, with the source of every value in the comment above it.
RECIPES: dict[str, dict] = {
    # InstructGPT, Ouyang et al. 2022 (arXiv:2203.02155), §3.5 and Appendix C.4: PPO with a value function
    # (initialised from the reward model), a per-token KL penalty in the reward with β = 0.02 against the SFT
    # policy (the KL term is the log-ratio: k1), clip ratio 0.2, γ = 1, λ = 0.95, learning rate 9.65e-6
    # for the 1.3B/6B policies; one sample per prompt; batches of 512 episodes in minibatches of 64 (8 minibatches),
    # one PPO epoch; advantages whitened per batch (as in the lm-human-preferences code InstructGPT builds on,
    # Ziegler et al. 2019). The critic's learning rate is not given apart: the policy's.
    "instructgpt": {
        "algo": "ppo", "group_size": 1, "kl_coef": 0.02, "kl_in": "reward", "kl_estimator": "k1",
        "clip_low": 0.2, "clip_high": 0.2, "gamma": 1.0, "lam": 0.95, "lr": 9.65e-6, "critic_lr": 9.65e-6,
        "epochs": 1, "minibatches": 8, "whiten_advantages": True, "agg": "token-mean", "ratio": "token",
    },
    # DeepSeekMath GRPO, Shao et al. 2024 (arXiv:2402.03300), §4.1 eq. (3)-(4) and §4.2: KL in the loss with the
    # unbiased k3 estimator, β = 0.04, policy learning rate 1e-6, 64 samples per question, a single update per
    # exploration stage (1 epoch, 1 minibatch), loss 1/G Σ_i 1/|o_i| Σ_t (seq-mean-token-mean), advantages z-scored
    # in the group (grpo). ε is not stated: PPO's 0.2, symmetric.
    "deepseek-grpo": {
        "algo": "grpo", "kl_in": "loss", "kl_estimator": "k3", "kl_coef": 0.04, "lr": 1e-6, "group_size": 64,
        "epochs": 1, "minibatches": 1, "agg": "seq-mean-token-mean", "advantage": "grpo",
        "clip_low": 0.2, "clip_high": 0.2, "ratio": "token",
    },
    # Dr. GRPO, Liu et al. 2025 ("Understanding R1-Zero-Like Training", arXiv:2503.20783), §3.2 and the
    # minimal recipe of §4: advantages R - mean without the std (dr_grpo), loss summed over tokens and divided
    # by a constant (the generation budget: seq-mean-token-sum-norm, normalised by the padded length), no KL
    # term (β = 0), learning rate 1e-6, 8 samples per question, clip 0.2.
    "dr-grpo": {
        "algo": "grpo", "advantage": "dr_grpo", "agg": "seq-mean-token-sum-norm", "kl_coef": 0.0, "lr": 1e-6,
        "group_size": 8, "clip_low": 0.2, "clip_high": 0.2, "ratio": "token",
    },
    # DAPO, Yu et al. 2025 (arXiv:2503.14476), §3.1 (clip-higher: ε_low = 0.2, ε_high = 0.28), §3.3 (token-level
    # policy-gradient loss: token-mean), §2.3 (KL term removed), §4.1 (learning rate 1e-6, 16 samples per prompt,
    # 512 prompts per rollout split into minibatches of 32 prompts: 16 gradient updates per rollout step).
    # Dynamic sampling and overlong reward shaping are not in this trainer (missing_eos_penalty is the nearest).
    "dapo": {
        "algo": "grpo", "clip_low": 0.2, "clip_high": 0.28, "agg": "token-mean", "kl_coef": 0.0, "lr": 1e-6,
        "group_size": 16, "minibatches": 16, "advantage": "grpo", "ratio": "token",
    },
    # GSPO, Zheng et al. 2025 (arXiv:2507.18071), §4 eq. (5)-(7) and §5.1: the sequence-level, length-normalised
    # importance ratio (ratio='sequence'), clipped at 3e-4 below and 4e-4 above, the objective a mean over the
    # group's sequences (seq-mean-token-mean), group-normalised advantages (grpo), each rollout batch split into
    # 4 minibatches; no KL term. Learning rate and group size are not stated (left as they are).
    "gspo": {
        "algo": "grpo", "ratio": "sequence", "clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean",
        "advantage": "grpo", "minibatches": 4, "kl_coef": 0.0,
    },
}


def recipe_values(name: str) -> dict:
    """The field values recipe ``name`` sets ({} for '' or an unknown name, which
    :meth:`TrainConfig.validate` then refuses naming ``recipe``)."""
    return dict(RECIPES.get(name, {}))


def help_text() -> str:
    """What each recipe sets, for ``--help``."""
    parts = []
    for name in RECIPES:
        sets = ", ".join(f"{k}={v}" for k, v in recipe_values(name).items())
        parts.append(f"'{name}': {sets}")
    return " Recipes set: " + ". ".join(parts) + "."
