"""One trainer update step (backbone -> per-token log-probs + entropy -> clipped policy loss with KL -> backward).

Providers differ only in the op provider the trainer is given: ``eager``
(``rlkernels.reference``, which materializes the [N, V] logits, their
log-softmax and their gradient) and ``rlkernels`` (the fused ops, which never
hold [N, V]). The model is a 2-layer Llama with a real-size vocabulary, so the
LM head dominates, as it does in RL of small language models.

Bound: compute. FLOPs ~= 6·N·H·V for the LM head (forward logits, gradient of
hidden, gradient of weight), N the scored response tokens (only they go through the
head), + 6·B·(P + R)·M for the backbone's linear layers (M weights): every prompt
and response token runs through them, forward and backward. The input embedding
is a lookup, not a product: its V·H parameters do no FLOPs (nor do the norms'), and
attention's scores are left out (a lower bound). Bytes: every parameter read once
and its gradient written once (the logits never have to reach memory).
"""
from __future__ import annotations

import torch

from bench.harness import Case


def _model(V: int, H: int, layers: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(device)


def _case(device, B, P, R, V, H, layers, dtype):
    from rlkernels.trainer.models import TokenLogprobs, ops_provider

    model = _model(V, H, layers, device).to(dtype)
    # the backbone's matrix products: its nn.Linear weights (not the embedding, a lookup, nor the norms)
    linear_params = sum(m.weight.numel() for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    N = B * R - (R - R // 2)  # scored response tokens: make_inputs masks the second half of response 0
    flops = 6 * N * H * V + 6 * B * (P + R) * linear_params
    elt = torch.finfo(dtype).bits // 8
    bytes_moved = 2 * sum(p.numel() for p in model.parameters()) * elt  # read once, gradient written once

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(4, V, (B, P + R), generator=g).to(device)  # [B, L]
        attention = torch.ones_like(ids)  # [B, L]
        labels = ids[:, P:].clone()  # [B, R]
        labels[0, R // 2 :] = -100  # one short response
        mask = labels != -100  # [B, R]
        old_logp = (-torch.rand(B, R, generator=g) * 8).to(device)  # [B, R]
        ref_logp = old_logp + 0.05 * torch.randn(B, R, generator=g).to(device)  # [B, R]
        adv = torch.randn(B, generator=g).to(device)  # [B]
        return ids, attention, labels, mask, old_logp, ref_logp, adv

    def step_with(losses):
        ops = ops_provider(losses)
        module = TokenLogprobs(model, ops)

        def step(ids, attention, labels, mask, old_logp, ref_logp, adv):
            model.zero_grad(set_to_none=True)
            logp, entropy = module(ids, attention, labels)  # [B, R] x2
            loss, _ = ops.policy_loss(logp, old_logp, adv, mask, clip_high=0.28, ref_logp=ref_logp, kl_coef=0.01,
                                      entropy=entropy, entropy_coef=0.001)
            loss.backward()
            return loss

        return step

    return Case(
        op="trainer step fwd+bwd",
        shape=f"B={B} R={R} V={V} H={H} L={layers} {str(dtype).split('.')[-1]}",
        bytes_moved=bytes_moved,
        flops=flops,
        bound="compute",
        make_inputs=make_inputs,
        providers={"eager": step_with("eager"), "rlkernels": step_with("fused")},
    )


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type == "cpu":
        shapes = [dict(B=4, P=16, R=64, V=32000, H=64, layers=2)] if quick else [
            dict(B=8, P=16, R=64, V=32000, H=64, layers=2),
            dict(B=8, P=32, R=128, V=49152, H=128, layers=2),
        ]
        return [_case(device, dtype=torch.float32, **s) for s in shapes]
    shapes = [dict(B=8, P=64, R=512, V=49152, H=576, layers=4)] if quick else [
        dict(B=8, P=64, R=512, V=49152, H=576, layers=4),
        dict(B=16, P=128, R=1024, V=151936, H=896, layers=4),
    ]
    return [_case(device, dtype=torch.bfloat16, **s) for s in shapes]


def tiny_cases(device: torch.device) -> list[Case]:
    """``python -m bench --gpu --dry-run``: the same step at a tiny size (the code path, not a measurement)."""
    return [_case(device, dtype=torch.float32, B=2, P=4, R=8, V=1000, H=32, layers=1)]
