"""Models: loading (built-in tiny Llama, directory, GGUF), the per-token log-prob module, the critic.

Training never forms logits over the sequence: the log-probs come from
``rlkernels.hf.response_logprobs`` (the backbone's final hidden states at the
response positions through ``linear_logprobs`` with the output-embedding weight),
the one path the TRL adapter and users take too.
"""
from __future__ import annotations

import copy
import os
import types

import torch
from torch import nn

from rlkernels import hf

from . import packing


def ops_provider(name: str) -> types.ModuleType:
    """'fused' -> the public rlkernels ops; 'eager' -> rlkernels.reference (same signatures)."""
    if name == "eager":
        import rlkernels.reference as ops

        return ops
    import rlkernels

    return rlkernels


def tiny_model(vocab_size: int, hidden: int, layers: int, seed: int, tokenizer):
    """A random-init Llama small enough to train from scratch on a CPU in minutes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2**64)  # any Python int; torch takes 64 bits
        return LlamaForCausalLM(config)


def load_tokenizer(field: str, path: str, **kwargs):
    """``AutoTokenizer.from_pretrained(path, **kwargs)``; ConfigError naming ``field`` when ``path`` holds no
    tokenizer it can load (a model directory saved without ``tokenizer.save_pretrained``, say)."""
    from transformers import AutoTokenizer

    from .config import ConfigError

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError) as error:
        first = " ".join(str(error).split())[:300] or type(error).__name__  # one line
        raise ConfigError(f"{field}: cannot load a tokenizer from {path} ({first}); save the tokenizer beside the "
                          f"model (tokenizer.save_pretrained)") from None


def load_weights(field: str, path: str, loader, *args, **kwargs):
    """``loader(*args, **kwargs)`` (a transformers ``from_pretrained``); ConfigError naming ``field`` when ``path``
    holds no model it can load (a folder without weights, an unknown ``model_type``, a GGUF of an architecture
    transformers does not read), instead of transformers' traceback."""
    from .config import ConfigError

    try:
        return loader(*args, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        first = " ".join(str(error).split())[:300] or type(error).__name__  # one line
        raise ConfigError(f"{field}: cannot load the model's weights from {path} ({first})") from None


def load_policy(cfg, field: str = "model"):
    """(model, tokenizer) for ``cfg.model`` (the config field ``field`` gave it: 'model', or 'ref_model' for a
    reference). ConfigError naming ``field`` when the tokenizer cannot be loaded or, with ``chat_template``, has
    no chat template (both before the weights load), or when a folder's weights lack part of the causal LM
    (a reward model's folder has no LM head: it would start random)."""
    from transformers import AutoModelForCausalLM

    from .config import ConfigError

    dtype = getattr(torch, cfg.dtype)
    if cfg.model == "tiny":
        from .data import tiny_tokenizer

        tok = tiny_tokenizer()
    elif os.path.isfile(cfg.model):  # .gguf (validated)
        directory, name = os.path.split(os.path.abspath(cfg.model))
        tok = load_tokenizer(field, directory, gguf_file=name)
    else:
        tok = load_tokenizer(field, cfg.model)
    if cfg.chat_template and field == "model" and not getattr(tok, "chat_template", None):
        raise ConfigError(f"chat_template: the tokenizer of model {cfg.model!r} has no chat template; leave "
                          f"chat_template off to feed the prompts as they are")
    if cfg.model == "tiny":
        model = tiny_model(len(tok), cfg.tiny_hidden, cfg.tiny_layers, cfg.seed, tok)
    elif os.path.isfile(cfg.model):
        model = load_weights(field, cfg.model, AutoModelForCausalLM.from_pretrained, directory, gguf_file=name,
                             dtype=dtype)
    else:
        model, info = load_weights(field, cfg.model, AutoModelForCausalLM.from_pretrained, cfg.model, dtype=dtype,
                                   output_loading_info=True)
        if info.get("missing_keys"):
            missing = sorted(info["missing_keys"])
            raise ConfigError(f"{field}: {cfg.model} is not a causal language model: its weights lack "
                              f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which would start "
                              f"random (a reward model's folder?)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.to(dtype)
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def check_vocabulary(field: str, path: str, policy: nn.Module, model: nn.Module) -> None:
    """Raise ``ConfigError`` naming ``field`` unless ``model`` (loaded from ``path``: the reference or the critic)
    has the policy's vocabulary: its token embedding has as many rows as the policy's output layer (the ids the
    policy samples), and so does its own output layer if it has one (a reference scores the policy's tokens).
    The one vocabulary rule for every model that reads the policy's token ids besides the policy itself."""
    from .config import ConfigError

    want = policy.get_output_embeddings().weight.shape[0]
    rows = {"token embedding": model.get_input_embeddings().weight.shape[0]}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        rows["output layer"] = head.weight.shape[0]
    for what, got in rows.items():
        if got != want:
            raise ConfigError(f"{field}: {path} has a vocabulary of {got} tokens ({what}), the policy {want}; it must "
                              f"read and score the policy's tokens")


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode without gradients (the reference policy)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] position ids counted from each row's first real token, as ``generate`` numbered the left-padded
    prompts when sampling (0 on the padding before it)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


class TokenLogprobs(nn.Module):
    """Per-token response log-probs (and entropies) of a causal LM, via ``rlkernels.hf.response_logprobs``.

    ``forward(ids [B, L], attention_mask [B, L], labels [B, R])`` where the last R
    positions of ``ids`` are the response; ``labels`` is that response with
    ``-100`` at padding (the scored tokens are read from ``ids``). Returns ``(logp [B, R], entropy [B, R])`` in float32 (``logp``
    alone with ``return_entropy=False``); with ``head_inputs=True`` instead ``(hidden [B, R, H], weight [V, H],
    bias [V] or None)``, the final hidden states that predict the response and the head, for
    ``rlkernels.linear_policy_loss`` (called through this module so that DDP sees the forward). Only the response tokens go through the head,
    through the op provider's ``linear_logprobs``. Wrapped in DistributedDataParallel
    under torchrun. With ``pack`` the real tokens run packed (``trainer.packing``), same outputs.
    """

    def __init__(self, model: nn.Module, ops, temperature: float = 1.0, pack: bool = False):
        super().__init__()
        self.model = model
        self.ops = ops
        self.temperature = temperature
        self.pack = pack

    def forward(self, ids, attention_mask, labels, return_entropy: bool = True, head_inputs: bool = False):
        R = labels.shape[1]
        if head_inputs:  # issue 12: what rlkernels.linear_policy_loss takes, instead of the log-probs
            weight, bias = hf.lm_head(self.model)  # [V, H], [V] or None
            hidden = hf.final_hidden(hf.backbone(self.model), input_ids=ids, attention_mask=attention_mask,
                                     position_ids=left_padded_positions(attention_mask))  # [B, L, H]
            hidden = hidden[:, -R - 1 : -1].to(weight.device, weight.dtype)  # [B, R, H]: predict the response
            return hidden, weight, bias
        scored = torch.cat([torch.zeros_like(ids[:, :-R], dtype=torch.bool), labels != -100], 1)  # [B, L]
        options = dict(temperature=self.temperature, return_entropy=return_entropy,
                       linear_logprobs=self.ops.linear_logprobs)
        if self.pack:
            out = packing.response_logprobs(self.model, ids, attention_mask, scored, **options)  # [B, L] (x2)
        else:
            out = hf.response_logprobs(self.model, ids, attention_mask, scored,
                                       position_ids=left_padded_positions(attention_mask), **options)  # [B, L] (x2)
        return tuple(x[:, -R:] for x in out) if return_entropy else out[:, -R:]  # [B, R]


class Critic(nn.Module):
    """A transformers backbone with a scalar value head: ``forward(...) -> values [B, R]`` (float32). With
    ``pack`` the backbone runs on the packed real tokens (``trainer.packing``), same values."""

    def __init__(self, backbone: nn.Module, hidden_size: int, pack: bool = False):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.pack = pack

    def forward(self, ids, attention_mask, labels):
        R = labels.shape[1]
        if self.pack:
            hidden = packing.final_hidden(self.backbone, ids, attention_mask)  # [B, L, H]
        else:
            hidden = hf.final_hidden(self.backbone, input_ids=ids, attention_mask=attention_mask,
                                     position_ids=left_padded_positions(attention_mask))  # [B, L, H]
        hidden = hidden[:, -R - 1 : -1]  # [B, R, H]: the states that predict the response tokens
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # [B, R]


def load_critic(cfg, policy: nn.Module) -> Critic:
    """The critic starts from the policy's backbone, or from ``cfg.critic_model``, with a zero value head; with
    ``cfg.critic_init == 'reward'`` it is the reward model ``cfg.reward`` whole (backbone and score head)."""
    if getattr(cfg, "critic_init", "policy") == "reward":
        from .knobs import critic_from_reward_model

        critic = critic_from_reward_model(cfg.reward, Critic, getattr(torch, cfg.dtype), policy.config.vocab_size)
        for p in critic.parameters():
            p.requires_grad_(True)
        return critic
    if not cfg.critic_model:
        backbone = copy.deepcopy(hf.backbone(policy))
    else:
        from transformers import AutoModel

        dtype = getattr(torch, cfg.dtype)
        if os.path.isfile(cfg.critic_model):
            directory, name = os.path.split(os.path.abspath(cfg.critic_model))
            backbone = load_weights("critic_model", cfg.critic_model, AutoModel.from_pretrained, directory,
                                    gguf_file=name, dtype=dtype)
        else:
            backbone = load_weights("critic_model", cfg.critic_model, AutoModel.from_pretrained, cfg.critic_model,
                                    dtype=dtype)
        check_vocabulary("critic_model", cfg.critic_model, policy, backbone)
    for p in backbone.parameters():
        p.requires_grad_(True)
    hidden = backbone.config.hidden_size
    critic = Critic(backbone, hidden)
    critic.value_head.to(torch.float32)
    return critic
