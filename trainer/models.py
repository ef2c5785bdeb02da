"""Models: loading (built-in tiny Llama, directory, GGUF), the per-token log-prob module, the critic.

Training never forms logits over the sequence: the backbone's final hidden
states at the response positions go to ``linear_logprobs`` together with the
output-embedding weight.
"""
from __future__ import annotations

import copy
import os
import types

import torch
from torch import nn


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
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def load_policy(cfg):
    """(model, tokenizer) for ``cfg.model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    if cfg.model == "tiny":
        from .data import tiny_tokenizer

        tok = tiny_tokenizer()
        model = tiny_model(len(tok), cfg.tiny_hidden, cfg.tiny_layers, cfg.seed, tok)
    elif os.path.isfile(cfg.model):  # .gguf (validated)
        directory, name = os.path.split(os.path.abspath(cfg.model))
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    else:
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model.to(dtype)
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (``model.model`` for Llama-like models)."""
    base = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, base, None)
    if inner is None or inner is model:
        raise ValueError(f"cannot find the backbone of {type(model).__name__}")
    return inner


def _final_hidden(backbone, ids, attention_mask, prompt_len):
    """Final hidden states at the positions that predict the response tokens: [B, R, H]."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
    out = backbone(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, L, H]
    return hidden[:, prompt_len - 1 : -1]  # [B, R, H]


class TokenLogprobs(nn.Module):
    """Per-token response log-probs (and entropies) of a causal LM, via ``linear_logprobs``.

    ``forward(ids [B, L], attention_mask [B, L], labels [B, R])`` where the last R
    positions of ``ids`` are the response; ``labels`` is the response with
    ``-100`` at padding. Returns ``(logp [B, R], entropy [B, R])`` in float32.
    Wrapped in DistributedDataParallel under torchrun.
    """

    def __init__(self, model: nn.Module, ops, temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.ops = ops
        self.temperature = temperature

    def forward(self, ids, attention_mask, labels, return_entropy: bool = True):
        prompt_len = ids.shape[1] - labels.shape[1]
        hidden = _final_hidden(backbone_of(self.model), ids, attention_mask, prompt_len)  # [B, R, H]
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return self.ops.linear_logprobs(
            hidden, head.weight, labels, bias=bias, temperature=self.temperature,
            return_entropy=return_entropy, ignore_index=-100,
        )


class Critic(nn.Module):
    """A transformers backbone with a scalar value head: ``forward(...) -> values [B, R]`` (float32)."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, ids, attention_mask, labels):
        prompt_len = ids.shape[1] - labels.shape[1]
        hidden = _final_hidden(self.backbone, ids, attention_mask, prompt_len)  # [B, R, H]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # [B, R]


def load_critic(cfg, policy: nn.Module) -> Critic:
    """The critic starts from the policy's backbone, or from ``cfg.critic_model``."""
    if not cfg.critic_model:
        backbone = copy.deepcopy(backbone_of(policy))
    else:
        from transformers import AutoModel

        dtype = getattr(torch, cfg.dtype)
        if os.path.isfile(cfg.critic_model):
            directory, name = os.path.split(os.path.abspath(cfg.critic_model))
            backbone = AutoModel.from_pretrained(directory, gguf_file=name, dtype=dtype)
        else:
            backbone = AutoModel.from_pretrained(cfg.critic_model, dtype=dtype)
    for p in backbone.parameters():
        p.requires_grad_(True)
    hidden = backbone.config.hidden_size
    critic = Critic(backbone, hidden)
    critic.value_head.to(torch.float32)
    return critic
