"""trainer/reward_model.py (a reward model for the demo tasks, trained on a CPU) and the trainer's rule_reward
(the task's rule logged as reward/rule beside the reward it trains on)."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rlkernels.trainer import reward_model
from rlkernels.trainer.config import ConfigError, from_dict
from rlkernels.trainer.data import TASKS, tiny_tokenizer
from rlkernels.trainer.loop import Trainer, read_metrics
from rlkernels.trainer.rewards import REWARDS, RewardModel

TINY_RM = ["--hidden", "16", "--layers", "1", "--batch", "32", "--eval-size", "64", "--log-every", "0"]


def run_cfg(tmp_path, **over):
    base = dict(output_dir=str(tmp_path / "run"), progress=False, plot=False, steps=2, prompts_per_step=4, group_size=4,
                save_every=0, threads=1, losses="eager")
    return from_dict({**base, **over})


def distinct_in_group(prompts, completions, answers):
    """A reward unrelated to the task's rule: differs within every group of 4 whatever was sampled."""
    return [float(i % 4) for i in range(len(completions))]


DISTINCT = f"{__name__}:distinct_in_group"


@pytest.mark.parametrize("task, rule, levels", [
    ("first_digit", "exact_format", {0.0, 0.1, 0.5, 1.0}),
    ("prefix_max", "steps", {0.0, 1 / 3, 2 / 3, 1.0}),
])
def test_the_pairs_cover_every_score_level_with_completions_the_policy_can_sample(task, rule, levels):
    texts, scores = reward_model.draw(task, rule, random.Random(3), 3000, max_words=3)  # [3000]
    assert len(texts) == scores.shape[0] == 3000
    assert {round(float(s), 4) for s in scores} == {round(x, 4) for x in levels}
    tok = tiny_tokenizer()
    rng = random.Random(3)
    for _ in range(3000):
        example = TASKS[task](rng)
        completion = reward_model.sample_completion(rng, example.answer, 3)
        assert len(completion.split()) <= 3 and set(completion.split()) <= set(reward_model.WORDS)
    ids = tok(texts)["input_ids"]
    assert all(tok.unk_token_id not in row for row in ids)  # every word is in the policy's vocabulary
    # the scores are the rule's, on the texts the trainer's RewardModel would score
    rng = random.Random(3)
    examples = [TASKS[task](rng) for _ in range(3000)]
    completions = [reward_model.sample_completion(rng, e.answer, 3) for e in examples]
    assert texts == [RewardModel.join(e.prompt, c) for e, c in zip(examples, completions)]
    if rule == "exact_format":
        assert scores.tolist() == pytest.approx(REWARDS[rule]([e.prompt for e in examples], completions,
                                                              [e.answer for e in examples]))


def test_the_script_saves_a_model_the_trainer_loads_as_reward_and_critic(tmp_path):
    rm_dir = tmp_path / "rm"
    assert reward_model.main([str(rm_dir), "--steps", "3", *TINY_RM]) == 0
    record = json.loads((rm_dir / "training.json").read_text())
    assert record["steps"] == 3 and record["hidden"] == 16 and math.isfinite(record["held_out_mse"])
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tr = Trainer(run_cfg(tmp_path, algo="ppo", reward=str(rm_dir), critic_init="reward", rule_reward="exact_format"))
    assert isinstance(tr.reward_fn, RewardModel)
    assert torch.equal(tr.critic.value_head.weight.detach(), saved.score.weight.detach())  # the critic is the RM
    prompts, completions = ["3 4 5 =", "1 2 9 ="], ["3", "9 + 1"]
    with torch.no_grad():
        want = [float(saved(**tr.reward_fn.tok(t, return_tensors="pt")).logits[0, 0])
                for t in ("3 4 5 = 3", "1 2 9 = 9 + 1")]
    assert tr.reward_fn(prompts, completions, ["3", "1"]) == pytest.approx(want, abs=1e-5)
    tr.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["reward/mean"]) and 0 <= r["reward/rule"] <= 1 for r in rows)


def test_training_fits_the_rule_far_better_than_its_mean(tmp_path):
    record = reward_model.train(str(tmp_path / "rm"), steps=60, batch=128, hidden=32, layers=1, eval_size=500,
                                log_every=0)
    assert record["held_out_mse"] < 0.5 * record["held_out_mse_of_the_mean"]
    assert record["held_out_corr"] > 0.7


def test_rule_reward_is_logged_and_changes_nothing_else(tmp_path):
    seen = []
    with_rule = Trainer(run_cfg(tmp_path / "a", reward=DISTINCT, rule_reward="exact_format"))
    scorer = with_rule.reward_fn

    def recording(prompts, completions, answers):
        seen.append((list(prompts), list(completions), list(answers)))
        return scorer(prompts, completions, answers)

    with_rule.reward_fn = recording
    summary = with_rule.run()
    plain = Trainer(run_cfg(tmp_path / "b", reward=DISTINCT))
    plain.run()
    rows = read_metrics(tmp_path / "a" / "run" / "metrics.jsonl")
    rows_plain = read_metrics(tmp_path / "b" / "run" / "metrics.jsonl")
    assert len(seen) == len(rows) == 2
    for row, (prompts, completions, answers) in zip(rows, seen):
        rule = REWARDS["exact_format"](prompts, completions, answers)
        assert row["reward/rule"] == pytest.approx(sum(rule) / len(rule), abs=1e-6)
        assert row["reward/rule_solved"] == pytest.approx(sum(r == 1.0 for r in rule) / len(rule), abs=1e-6)
        assert row["reward/mean"] == pytest.approx(1.5)  # the trained reward is still DISTINCT's
    assert summary["reward_rule_first_fifth"] == pytest.approx(rows[0]["reward/rule"])
    assert summary["reward_rule_last_fifth"] == pytest.approx(rows[-1]["reward/rule"])
    for row, other in zip(rows, rows_plain):  # the update is the same without the rule
        assert "reward/rule" not in other
        for key in other:
            if key.startswith(("loss/", "policy/", "reward/")) and key != "policy/step_s":
                assert row[key] == pytest.approx(other[key], rel=1e-6, abs=1e-9), key


def test_rule_reward_steps_logs_the_mean_step_reward(tmp_path):
    tr = Trainer(run_cfg(tmp_path, reward=DISTINCT, rule_reward="steps", task="prefix_max"))
    seen = []
    scorer = tr.reward_fn

    def recording(prompts, completions, answers, completion_tokens=None):
        seen.append((list(completion_tokens), list(answers)))  # each response's tokens, as the trainer reads them
        return scorer(prompts, completions, answers)

    tr.reward_fn = recording
    tr.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(seen) == len(rows) == 2
    for row, (tokens, answers) in zip(rows, seen):
        per = [sum(k < len(t) and t[k] == w for k, w in enumerate(a.split())) / 3 for t, a in zip(tokens, answers)]
        assert row["reward/rule"] == pytest.approx(sum(per) / len(per), abs=1e-6)


def test_rule_reward_must_be_a_registered_rule(tmp_path):
    with pytest.raises(ConfigError, match="^rule_reward"):
        run_cfg(tmp_path, rule_reward="exactly")
