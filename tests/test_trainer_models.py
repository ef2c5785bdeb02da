"""The trainer loading models from local directories: policy, PPO critic, reward model."""
from __future__ import annotations

import math

import pytest
import torch

from rlkernels.trainer.config import from_dict
from rlkernels.trainer.data import tiny_tokenizer
from rlkernels.trainer.loop import Trainer, read_metrics
from rlkernels.trainer.models import tiny_model
from rlkernels.trainer.rewards import REWARDS, RewardModel


def run_cfg(tmp_path, **over):
    base = dict(output_dir=str(tmp_path / "run"), progress=False, plot=False, steps=2, prompts_per_step=4, group_size=4,
                save_every=0, threads=1, losses="eager")
    return from_dict({**base, **over})


def distinct_in_group(prompts, completions, answers):
    """A test reward that differs within every contiguous group of 4 samples whatever was sampled, so the
    advantages (GRPO) and returns (PPO) are nonzero by design and the update has a real gradient."""
    return [float(i % 4) for i in range(len(completions))]


DISTINCT = f"{__name__}:distinct_in_group"


def _grads_nonzero(parameters) -> bool:
    return any(bool(p.grad.ne(0).any()) for p in parameters if p.grad is not None)


def _finite(rows):
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), (key, row)


def _same_state(module, reference):
    want = reference.state_dict()
    got = module.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def policy_dir(tmp_path):
    """A random 1-layer LlamaForCausalLM and the tiny digit tokenizer, saved with save_pretrained."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), hidden=32, layers=1, seed=7, tokenizer=tok)
    path = tmp_path / "policy"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


def test_policy_from_directory(tmp_path, policy_dir):
    path, saved = policy_dir
    tr = Trainer(run_cfg(tmp_path, model=str(path), reward=DISTINCT))
    _same_state(tr.policy, saved)  # the directory's weights, not a fresh tiny model
    assert tr.tokenizer.padding_side == "left" and tr.tokenizer.pad_token_id == 0
    tr.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    _finite(rows)
    assert rows[0]["policy/entropy"] > 0.5
    # the loaded weights are trained: a real gradient (nonzero advantages by design) and parameters that changed
    assert _grads_nonzero(tr.policy.parameters())
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(tr.policy.parameters(), saved.parameters()))


def test_ppo_critic_from_directory(tmp_path, policy_dir):
    from transformers import LlamaConfig, LlamaModel

    path, saved = policy_dir
    config = LlamaConfig(vocab_size=saved.config.vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(11)
    backbone = LlamaModel(config)  # an AutoModel backbone of another width than the policy's
    backbone.save_pretrained(tmp_path / "critic")
    tr = Trainer(run_cfg(tmp_path, model=str(path), algo="ppo", critic_model=str(tmp_path / "critic"), reward=DISTINCT))
    _same_state(tr.critic.backbone, backbone)
    assert tr.critic.value_head.in_features == 48
    tr.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    _finite(rows)
    assert all("loss/value" in r for r in rows)
    # the loaded backbone is trained: the value head starts at zero, so the backbone's gradient is zero at step 1
    # and real at step 2 (nonzero returns by design); its parameters changed
    assert _grads_nonzero(tr.critic.backbone.parameters())
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(tr.critic.backbone.parameters(), backbone.parameters()))


def _reward_dir(path, pad_in_config=True):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tok.pad_token_id if pad_in_config else None)
    torch.manual_seed(5)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores spread well beyond rounding
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval(), tok


def _score_one_by_one(model, tok, texts):
    """Each text alone (no padding), straight through transformers."""
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt")
            assert int((enc["input_ids"] == tok.unk_token_id).sum()) == 0, text  # every word is in the vocabulary
            out.append(float(model(**enc).logits[0, 0]))
    return out


def test_reward_model_directory(tmp_path):
    model, tok = _reward_dir(tmp_path / "rm")
    tr = Trainer(run_cfg(tmp_path, reward=str(tmp_path / "rm")))
    assert isinstance(tr.reward_fn, RewardModel)
    calls = []
    scorer = tr.reward_fn

    def recording(prompts, completions, answers):
        scores = scorer(prompts, completions, answers)
        calls.append((list(prompts), list(completions), list(answers), scores))
        return scores

    tr.reward_fn = recording
    tr.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and len(calls) == 2
    _finite(rows)
    for step, (prompts, completions, answers, scores) in enumerate(calls, 1):
        assert all(math.isfinite(s) for s in scores)
        texts = [f"{p} {c}" if c else p for p, c in zip(prompts, completions)]
        assert len({len(tok(t)["input_ids"]) for t in texts}) > 1  # the batch was padded
        assert scores == pytest.approx(_score_one_by_one(model, tok, texts), abs=1e-5)
        assert rows[step - 1]["reward/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
        assert len({round(s, 4) for s in scores}) > 1  # the score follows the completion
        assert scores != REWARDS["exact_format"](prompts, completions, answers)
        assert not set(scores) <= {0.0, 0.1, 0.5, 1.0}


def test_reward_model_without_pad_token_in_config(tmp_path):
    """A padded batch scores like each text alone even when the config names no pad token."""
    model, tok = _reward_dir(tmp_path / "rm", pad_in_config=False)
    rm = RewardModel(str(tmp_path / "rm"), "cpu")
    assert rm.model.config.pad_token_id == tok.pad_token_id
    prompts, completions = ["3 4 5 =", "1 + 2 =", "7 7 7 ="], ["3", "3 <eos>", ""]
    scores = rm(prompts, completions, ["3", "3", "7"])
    assert scores == pytest.approx(_score_one_by_one(model, tok, ["3 4 5 = 3", "1 + 2 = 3 <eos>", "7 7 7 ="]), abs=1e-5)
