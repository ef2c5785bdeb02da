"""Prompts: built-in generators of verifiable tasks, JSONL loading, and the tiny digit tokenizer."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


# ------------------------------------------------------------------ tasks
# Each task draws one example from a random.Random. Digit tasks are written with
# spaces between characters so the tiny word-level tokenizer sees one token per digit.


def _digits(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10) for _ in range(n)]


def max_digit(rng: random.Random) -> Example:
    d = _digits(rng, 3)
    return Example(" ".join(map(str, d)) + " =", str(max(d)))


def sum_mod10(rng: random.Random) -> Example:
    d = _digits(rng, 2)
    return Example(f"{d[0]} + {d[1]} =", str(sum(d) % 10))


def first_digit(rng: random.Random) -> Example:
    d = _digits(rng, 3)
    return Example(" ".join(map(str, d)) + " =", str(d[0]))


def arithmetic(rng: random.Random) -> Example:
    a, b = rng.randrange(1, 20), rng.randrange(1, 20)
    return Example(f"What is {a} + {b}? Answer with just the number.", str(a + b))


def prefix_sums(rng: random.Random) -> Example:
    """Multi-step arithmetic for process supervision: the running totals (mod 10) of three digits, one per
    step, e.g. ``3 + 4 + 5 =`` -> ``3 7 2``; the 'steps' reward checks each intermediate total."""
    d = _digits(rng, 3)
    totals = [sum(d[: i + 1]) % 10 for i in range(3)]
    return Example(" + ".join(map(str, d)) + " =", " ".join(map(str, totals)))


def prefix_max(rng: random.Random) -> Example:
    """Multi-step, every step checkable: the running maxima of three digits, e.g. ``3 7 2 =`` -> ``3 7 7``."""
    d = _digits(rng, 3)
    return Example(" ".join(map(str, d)) + " =", " ".join(str(max(d[: i + 1])) for i in range(3)))


TASKS = {"max_digit": max_digit, "sum_mod10": sum_mod10, "first_digit": first_digit, "arithmetic": arithmetic,
         "prefix_sums": prefix_sums, "prefix_max": prefix_max}


def read_prompts(path: str) -> list[Example]:
    """The records of a JSONL prompts file: one JSON object per non-blank line, UTF-8, with a string ``prompt``
    and an optional ``answer`` (a string or a number; '' when absent). Raises ValueError starting with
    'prompts:' and naming the file and line for anything else, or for a file without records."""
    records = []
    try:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                where = f"prompts: line {lineno} of {path}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark may open the file
                except UnicodeDecodeError as error:
                    raise ValueError(f"{where} is not UTF-8 text ({error.reason} at byte {error.start})") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where} is not JSON ({error.msg} at column {error.colno})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{where} must be a JSON object with a 'prompt', got {type(rec).__name__}")
                if not isinstance(rec.get("prompt"), str):
                    got = "none" if "prompt" not in rec else type(rec["prompt"]).__name__
                    raise ValueError(f"{where} must have a string 'prompt' (got {got})")
                answer = rec.get("answer", "")
                if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                    raise ValueError(f"{where}: 'answer' must be a string or a number (got {type(answer).__name__})")
                records.append(Example(rec["prompt"], _answer_text(answer, where)))
    except OSError as error:
        raise ValueError(f"prompts: cannot read {path}: {error.strerror or error}") from None
    if not records:
        raise ValueError(f"prompts: {path} holds no records")
    return records


def _answer_text(answer: str | int | float, where: str) -> str:
    """A record's answer as the rules compare it: a string as given; a number as written in digits, an integral
    float as the integer (JSON's ``3.0`` is the answer ``"3"``, which the integer rules can match; ``str`` gave
    ``"3.0"``, which none can). NaN and infinities (JSON extensions Python reads) are refused."""
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"{where}: 'answer' must be a finite number (got {answer})")
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer)


class PromptSource:
    """The prompts of step ``s`` depend only on (seed, s): resuming needs no data-loader state."""

    def __init__(self, task: str = "first_digit", path: str = "", seed: int = 0):
        self.seed = seed
        self.task = TASKS.get(task)
        self.records: list[Example] = read_prompts(path) if path else []

    def batch(self, step: int, n: int) -> list[Example]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if self.records:
            return [self.records[rng.randrange(len(self.records))] for _ in range(n)]
        return [self.task(rng) for _ in range(n)]


# ------------------------------------------------------------------ tiny tokenizer

TINY_VOCAB = ["<pad>", "<bos>", "<eos>", "<unk>"] + [str(i) for i in range(10)] + ["+", "="]


def tiny_tokenizer():
    """A word-level tokenizer over digits, '+', '=' (space separated), with <bos> prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    return tok
