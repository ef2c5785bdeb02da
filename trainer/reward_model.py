"""A reward model for the demo tasks, trained offline on a CPU (about five minutes on the loaded 2-core machine).

``python -m rlkernels.trainer.reward_model OUT_DIR [--task first_digit] [--rule exact_format] [--steps 600]``
(or ``python -m trainer.reward_model`` from a checkout) builds a small ``LlamaForSequenceClassification`` (one
score logit) over the demo policy's digit tokenizer (``trainer.data.tiny_tokenizer``, so its token ids are the
policy's and ``--critic-init reward`` can start the PPO critic from it), trains it by regression (MSE) on the
rule's score of (prompt, completion) pairs drawn from the task, and saves model and tokenizer with
``save_pretrained``. Then::

    rlkernels-train --algo ppo --reward OUT_DIR --rule-reward exact_format [--critic-init reward]

trains the policy on the model's scores while logging the rule's (the task's true score) as ``reward/rule``.

The completions it learns from are those the policy can sample: up to ``max_new_tokens`` words of the
tokenizer ('0'..'9', '+', '='; special tokens are dropped when a completion is decoded), half of them uniformly
random (an untrained policy) and half corrected toward the answer (the answer alone, the answer's words at a
random offset among random words, a random completion with each position set to the answer's word with
probability 1/2), so every level of the rule's score is seen. The text scored is
``RewardModel.join(prompt, completion)``, the trainer's. Everything is seeded: the same arguments give the
same weights. ``training.json`` in OUT_DIR records the arguments, wall time and the held-out fit.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from . import process
from .config import TINY_TASKS
from .data import TASKS, TINY_VOCAB, Example, tiny_tokenizer
from .rewards import REWARDS, RewardModel

WORDS = [w for w in TINY_VOCAB if not w.startswith("<")]  # what a decoded completion can hold


def _random_words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def sample_completion(rng: random.Random, answer: str, max_words: int) -> str:
    """One completion of at most ``max_words`` words: uniformly random half of the time, else corrected
    toward ``answer`` in one of three ways (see the module docstring)."""
    want = answer.split()[:max_words]
    kind = rng.random()
    if kind < 0.5:
        return " ".join(_random_words(rng, rng.randint(0, max_words)))
    if kind < 0.65:
        return " ".join(want)
    if kind < 0.85:
        extra = rng.randint(0, max_words - len(want))
        words = _random_words(rng, extra)
        at = rng.randint(0, extra)
        return " ".join(words[:at] + want + words[at:])
    words = _random_words(rng, len(want))
    return " ".join(w if rng.random() < 0.5 else r for w, r in zip(want, words))


def rule_scores(rule: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """[N] the rule's score of each completion: the outcome, or with step rewards their mean (as the trainer
    logs them)."""
    raw = REWARDS[rule](prompts, completions, answers)
    lengths = torch.tensor([max(len(c.split()), 1) for c in completions])  # [N] response words = tokens
    scores, _ = process.parse_rewards(raw, lengths)  # [N]
    return scores


def draw(task: str, rule: str, rng: random.Random, n: int, max_words: int):
    """``n`` (text, score) pairs: texts as the trainer's RewardModel joins them, scores [n] float32."""
    examples: list[Example] = [TASKS[task](rng) for _ in range(n)]
    completions = [sample_completion(rng, e.answer, max_words) for e in examples]
    prompts = [e.prompt for e in examples]
    texts = [RewardModel.join(p, c) for p, c in zip(prompts, completions)]
    return texts, rule_scores(rule, prompts, completions, [e.answer for e in examples])


def build(tok, hidden: int, layers: int, seed: int):
    """A random-init one-logit LlamaForSequenceClassification over ``tok``'s vocabulary, the demo policy's
    shape (trainer.models.tiny_model) by default."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**64)  # any Python int; torch takes 64 bits
        return LlamaForSequenceClassification(config)


def predict(model, tok, texts: list[str]) -> torch.Tensor:
    enc = tok(texts, return_tensors="pt", padding=True)
    return model(**enc).logits[:, 0].float()  # [N]


def train(out_dir: str, task: str = "first_digit", rule: str = "exact_format", steps: int = 600, batch: int = 256,
          lr: float = 2e-3, hidden: int = 64, layers: int = 2, max_words: int = 3, eval_size: int = 2000,
          seed: int = 0, log_every: int = 100, threads: int = 1) -> dict:
    """Train and save the reward model to ``out_dir``; returns what ``training.json`` records."""
    if task not in TINY_TASKS or rule not in REWARDS:
        raise ValueError(f"task must be one of {sorted(TINY_TASKS)} (the digit tokenizer's) and rule one of {sorted(REWARDS)}")
    if threads:
        torch.set_num_threads(threads)
    tok = tiny_tokenizer()
    model = build(tok, hidden, layers, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    eval_texts, eval_scores = draw(task, rule, random.Random(seed + 10_007), eval_size, max_words)  # held out

    def held_out_mse() -> float:
        model.eval()
        with torch.no_grad():
            mse = float(torch.nn.functional.mse_loss(predict(model, tok, eval_texts), eval_scores))
        model.train()
        return mse

    baseline = float(eval_scores.var(unbiased=False))  # the MSE of predicting the mean score
    start = time.perf_counter()
    for step in range(1, steps + 1):
        texts, scores = draw(task, rule, rng, batch, max_words)  # [batch]
        loss = torch.nn.functional.mse_loss(predict(model, tok, texts), scores)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step % log_every == 0 or step == steps):
            print(f"step {step}/{steps}  train mse {float(loss.detach()):.4f}  held-out mse {held_out_mse():.4f} "
                  f"(predicting the mean: {baseline:.4f})  {time.perf_counter() - start:.1f} s", flush=True)
    wall = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        pred = predict(model, tok, eval_texts)  # [eval_size]
    corr = float(torch.corrcoef(torch.stack([pred, eval_scores]))[0, 1])
    record = dict(task=task, rule=rule, steps=steps, batch=batch, lr=lr, hidden=hidden, layers=layers,
                  max_words=max_words, seed=seed, train_wall_s=round(wall, 1),
                  held_out_mse=float(torch.nn.functional.mse_loss(pred, eval_scores)),
                  held_out_mse_of_the_mean=baseline, held_out_corr=corr)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record, indent=2))
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkernels.trainer.reward_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to save the model and tokenizer to (use it as --reward)")
    parser.add_argument("--task", default="first_digit", choices=sorted(TINY_TASKS))
    parser.add_argument("--rule", default="exact_format", choices=sorted(REWARDS), help="the score it learns")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (fresh pairs each)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=64, help="width (a multiple of 4); the demo policy's is 64")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-words", type=int, default=3, help="longest completion (the trainer's max_new_tokens)")
    parser.add_argument("--eval-size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    record = train(**{k: v for k, v in vars(args).items()})
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
