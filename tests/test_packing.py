"""Packed sequences: ``cu_seqlens`` validation, the per-token losses on packed ``[1, total]`` inputs (every agg
mode, GSPO), ``hf.response_logprobs`` on a packed batch (tiny Llama and Qwen2), and the trainer's ``--pack``.

The truth for a packed batch is each sequence computed on its own, in float64: the losses from
``rlkernels.reference`` on one sequence at a time combined by the agg modes' definitions, the log-probs from
the model's own logits on one sequence at a time (no padding, no packing, no rlkernels).
"""
from __future__ import annotations

import pytest
import torch

import rlkernels
from rlkernels import packing
from rlkernels import reference as ref
from tests.helpers import assert_close_to_truth, forced_backend, recording_head

LENGTHS = [5, 1, 0, 9, 4]  # an empty sequence and a one-token one among them
CU = torch.tensor([0, 5, 6, 6, 15, 19])  # [S + 1]
S, TMAX, TOTAL = len(LENGTHS), max(LENGTHS), sum(LENGTHS)


def _packed_policy_inputs(seed=0, adv_per_seq=False):
    """Packed [1, total] policy-loss inputs whose log-ratios make both token and sequence ratios clip."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(1, TOTAL, generator=g) * 3 - 0.05  # [1, total]
    # sequence ratios exp(-shift): sequence 0 above 1 + clip with A > 0, sequence 3 below 1 - clip with A < 0
    shift = torch.repeat_interleave(torch.tensor([-0.5, 0.3, 0.0, 0.5, -0.1]), torch.tensor(LENGTHS))  # [total]
    old = logp + 0.3 * torch.randn(1, TOTAL, generator=g) + shift  # [1, total]
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9]) if adv_per_seq else torch.randn(1, TOTAL, generator=g)  # [S] or [1, total]
    mask = torch.rand(1, TOTAL, generator=g) > 0.2  # [1, total]
    mask[0, :5] = True  # the first sequence is full
    return {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask,
            "ref_logp": logp + 0.2 * torch.randn(1, TOTAL, generator=g), "entropy": torch.rand(1, TOTAL, generator=g) * 2}


def _sequence(inputs: dict, s: int, per_seq: tuple[str, ...]) -> dict:
    """Sequence ``s`` of packed inputs on its own: [1, n_s] (per-sequence values: [1])."""
    a, b = int(CU[s]), int(CU[s + 1])
    return {k: (v[s : s + 1] if k in per_seq and v.dim() == 1 else v[:, a:b]) for k, v in inputs.items()}


def _with_grad(inputs: dict, names, cast):
    out = {k: cast(v) if v.dtype.is_floating_point else v for k, v in inputs.items()}
    for k in names:
        out[k] = out[k].detach().requires_grad_()
    return out


AGGS = [(agg, None) for agg in ref.AGG_MODES] + [("seq-mean-token-sum-norm", 7.0)]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("agg, norm_length", AGGS)
def test_policy_loss_packed_equals_each_sequence_alone(backend, ratio, agg, norm_length):
    """Packed policy_loss (cu_seqlens) = the agg mode's definition over the sequences each computed alone in
    float64 (loss and gradients), and = the padded op on the [S, Tmax] layout built by hand."""
    adv_per_seq = ratio == "sequence"
    inputs = _packed_policy_inputs(adv_per_seq=adv_per_seq)
    grads = ("logp", "ref_logp", "entropy")
    options = dict(clip_low=0.2, clip_high=0.28, ratio=ratio, kl_coef=0.1, entropy_coef=0.01)

    x64 = _with_grad(inputs, grads, torch.Tensor.double)
    order = ("logp", "old_logp", "advantages", "mask")
    # the truth: the float64 reference on each sequence alone (B = 1, seq-mean-token-sum: its token sum),
    # combined by the agg mode's definition
    sums, counts = [], []
    for s in range(S):
        if not LENGTHS[s]:
            continue
        one = _sequence({k: x64[k] for k in (*order, "ref_logp", "entropy")}, s, ("advantages",))
        loss_s, _ = ref.policy_loss(*(one[k] for k in order), ref_logp=one["ref_logp"], entropy=one["entropy"],
                                    agg="seq-mean-token-sum", **options)
        sums.append(loss_s)
        counts.append(float(one["mask"].sum()))
    sums = torch.stack(sums)  # [non-empty S]
    if agg == "token-mean":
        want = sums.sum() / sum(counts)
    elif agg == "seq-mean-token-mean":
        want = sum(t / c for t, c in zip(sums, counts) if c > 0) / sum(c > 0 for c in counts)
    elif agg == "seq-mean-token-sum":
        want = sums.sum() / S  # the empty sequence counts as a sequence
    else:
        want = sums.sum() / (S * (TMAX if norm_length is None else norm_length))
    want_grads = torch.autograd.grad(want, [x64[k] for k in grads])

    x = _with_grad(inputs, grads, lambda t: t)
    fn = ref.policy_loss if backend == "reference" else rlkernels.policy_loss  # each module's own packed entry
    with forced_backend(backend):
        loss, metrics = fn(*(x[k] for k in order), ref_logp=x["ref_logp"], entropy=x["entropy"],
                                              agg=agg, norm_length=norm_length, cu_seqlens=CU, **options)
    got_grads = torch.autograd.grad(loss, [x[k] for k in grads])
    assert float(metrics["clipfrac"]) > 0  # the clip is exercised
    assert_close_to_truth(loss.detach(), want.detach(), torch.float32, name="loss")
    for name, gr, truth in zip(grads, got_grads, want_grads):
        assert gr.shape == (1, TOTAL)
        assert_close_to_truth(gr, truth, torch.float32, name=f"grad {name}")

    # the padded [S, Tmax] layout, built by hand with NaN at the padding: the same op, the same numbers
    def padded(t):  # [1, total] -> [S, Tmax]
        out = torch.full((S, TMAX), float("nan")) if t.dtype.is_floating_point else torch.zeros(S, TMAX, dtype=t.dtype)
        for s in range(S):
            out[s, : LENGTHS[s]] = t[0, int(CU[s]) : int(CU[s + 1])]
        return out

    p = {k: (v if k == "advantages" and v.dim() == 1 else padded(v)) for k, v in inputs.items()}
    with forced_backend(backend):
        pad_loss, pad_metrics = fn(*(p[k] for k in order), ref_logp=p["ref_logp"],
                                                      entropy=p["entropy"], agg=agg, norm_length=norm_length, **options)
    assert torch.equal(loss.detach(), pad_loss) and metrics.keys() == pad_metrics.keys()
    assert all(torch.equal(metrics[k], pad_metrics[k]) for k in metrics)


@pytest.mark.parametrize("agg, norm_length", AGGS[:4])
@pytest.mark.parametrize("clip", [None, 0.1])
def test_value_loss_packed_equals_each_sequence_alone(agg, norm_length, clip):
    g = torch.Generator().manual_seed(3)
    values = torch.randn(1, TOTAL, generator=g)  # [1, total]
    old = values + 0.3 * torch.randn(1, TOTAL, generator=g)  # [1, total]
    returns = torch.randn(1, TOTAL, generator=g)  # [1, total]
    mask = torch.rand(1, TOTAL, generator=g) > 0.2  # [1, total]
    v64 = values.double().requires_grad_()
    sums, counts = [], []
    for s in range(S):
        a, b = int(CU[s]), int(CU[s + 1])
        if a == b:
            continue
        loss_s, _ = ref.value_loss(v64[:, a:b], old[:, a:b].double(), returns[:, a:b].double(), mask[:, a:b],
                                   clip=clip, agg="seq-mean-token-sum")
        sums.append(loss_s)
        counts.append(float(mask[:, a:b].sum()))
    sums = torch.stack(sums)
    want = {"token-mean": sums.sum() / sum(counts), "seq-mean-token-sum": sums.sum() / S,
            "seq-mean-token-sum-norm": sums.sum() / (S * TMAX),
            "seq-mean-token-mean": sum(t / c for t, c in zip(sums, counts) if c > 0) / sum(c > 0 for c in counts)}[agg]
    (want_grad,) = torch.autograd.grad(want, [v64])
    for fn in (rlkernels.value_loss, ref.value_loss):
        v = values.clone().requires_grad_()
        with forced_backend("torch"):
            loss, _ = fn(v, old, returns, mask, clip=clip, agg=agg, cu_seqlens=CU.int())
        (grad,) = torch.autograd.grad(loss, [v])
        assert_close_to_truth(loss.detach(), want.detach(), torch.float32, name="loss")
        assert_close_to_truth(grad, want_grad, torch.float32, name="grad values")


@pytest.mark.parametrize("fn", [rlkernels.policy_loss, ref.policy_loss], ids=["fused", "reference"])
@pytest.mark.parametrize("cu, error, match", [
    (CU.float(), TypeError, "cu_seqlens must be an integer tensor"),
    (CU[None], ValueError, r"cu_seqlens must be 1-D"),
    (CU + 1, ValueError, r"cu_seqlens must start at 0, got cu_seqlens\[0\] = 1"),
    (torch.tensor([0, 6, 5, 15, 19]), ValueError, r"non-decreasing, got cu_seqlens\[1\] = 6 > cu_seqlens\[2\] = 5"),
    (torch.tensor([0, 5, 18]), ValueError, r"cu_seqlens must end at the packed length 19, got cu_seqlens\[-1\] = 18"),
])
def test_cu_seqlens_is_validated(fn, cu, error, match):
    x = _packed_policy_inputs()
    with pytest.raises(error, match=match):
        fn(x["logp"], x["old_logp"], x["advantages"], x["mask"], cu_seqlens=cu)


def test_packed_shapes_are_validated():
    x = _packed_policy_inputs()
    with pytest.raises(ValueError, match=r"logp must be packed \[1, total\]"):
        rlkernels.policy_loss(x["logp"][0], x["old_logp"], x["advantages"], x["mask"], cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"packed old_logp must have shape \[1, total\] = \[1, 19\]"):
        rlkernels.policy_loss(x["logp"], x["old_logp"][:, :-1], x["advantages"], x["mask"], cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"per-sequence advantages must have shape \[S\] = \[5\]"):
        rlkernels.policy_loss(x["logp"], x["old_logp"], torch.zeros(4), x["mask"], cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"values must be packed"):
        rlkernels.value_loss(x["logp"][0], x["logp"][0], x["logp"][0], x["mask"][0], cu_seqlens=CU)


def test_pack_padded_names_a_non_tensor_attention_mask():
    # a nested list raised AttributeError "'list' object has no attribute 'dim'"
    with pytest.raises(TypeError, match="attention_mask"):
        packing.pack_padded([[1, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="attention_mask"):
        packing.pack_padded(torch.ones(3))


@pytest.mark.parametrize("bad", [float("nan"), 0.5])
def test_pack_padded_refuses_a_mask_that_is_not_zero_one(bad):
    # a NaN (or 0.5) at a padded position counted as a real token (!= 0) and was packed, silently; the padded
    # response_logprobs refuses that attention_mask by name
    am = torch.tensor([[1.0, 1.0, bad], [1.0, 0.0, 0.0]])  # [B, T]
    with pytest.raises(ValueError, match="attention_mask"):
        packing.pack_padded(am)


def test_index_maps_round_trip():
    index, s, tmax = packing.padded_index(CU, TOTAL)  # [total]
    assert (s, tmax) == (S, TMAX)
    x = torch.arange(TOTAL, dtype=torch.float32)[None]  # [1, total]
    view = packing.unpack(x, index, S, TMAX)  # [S, Tmax]
    for seq in range(S):
        assert view[seq, : LENGTHS[seq]].tolist() == list(range(int(CU[seq]), int(CU[seq + 1])))
        assert not view[seq, LENGTHS[seq] :].any()
    assert torch.equal(packing.pack(view, index), x)
    assert packing.positions(CU, TOTAL).tolist() == [[*range(5), 0, *range(9), *range(4)]]
    assert packing.cu_seqlens_from_positions(packing.positions(CU, TOTAL)).tolist() == [0, 5, 6, 15, 19]
    with pytest.raises(ValueError, match=r"position_ids\[0, 3\] = 4 follows 2"):
        packing.cu_seqlens_from_positions(torch.tensor([[0, 1, 2, 4]]))
    am = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # [3, 4]: left + right padding, an empty row
    flat, cu = packing.pack_padded(am)
    assert flat.tolist() == [1, 2, 4, 5, 6, 7] and cu.tolist() == [0, 2, 6, 6]


@pytest.mark.parametrize("boundaries", ["tensor", "list"])
def test_packed_losses_ignore_a_meta_default_device(boundaries):
    """torch.set_default_device("meta") (left on after building a model on meta) does not reach the index map of
    CPU inputs: it was built on meta and the move to the inputs' device failed with "Cannot copy out of meta"."""
    gen = torch.Generator().manual_seed(41)
    logp, old, adv = (torch.randn(1, TOTAL, generator=gen) for _ in range(3))  # [1, total] x3
    mask = torch.ones(1, TOTAL)  # [1, total]
    cu = CU if boundaries == "tensor" else CU.tolist()
    want = rlkernels.policy_loss(logp, old, adv, mask, cu_seqlens=cu, agg="seq-mean-token-mean")[0]
    torch.set_default_device("meta")
    try:
        got = rlkernels.policy_loss(logp, old, adv, mask, cu_seqlens=cu, agg="seq-mean-token-mean")[0]
        index, _, _ = packing.padded_index(cu, TOTAL)  # [total]
    finally:
        torch.set_default_device(None)
    assert index.device.type == "cpu" and torch.equal(got, want)


# ------------------------------------------------------------------ response_logprobs on a packed batch

transformers = pytest.importorskip("transformers")
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_boundaries_as_a_list_compile_with_fullgraph(backend):
    # A cu_seqlens tensor sizes the padded view from its values: a data-dependent shape under torch.compile. The
    # same boundaries as a list of ints are static: the packed losses compile whole and equal the eager ones.
    gen = torch.Generator().manual_seed(12)
    bounds = [0, 3, 3, 8, 9]
    logp = (-torch.rand(1, 9, generator=gen)).requires_grad_()  # [1, total]
    old, adv = -torch.rand(1, 9, generator=gen), torch.randn(1, 9, generator=gen)  # [1, total] each
    mask = torch.ones(1, 9)  # [1, total]

    def step(lp):
        pg, _ = rlkernels.policy_loss(lp, old, adv, mask, cu_seqlens=bounds, agg="seq-mean-token-mean", ratio="sequence")
        vf, _ = rlkernels.value_loss(lp, old, adv, mask, cu_seqlens=bounds, clip=0.2)
        return pg + vf

    with forced_backend(backend):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        got = compiled(logp)
        (g_got,) = torch.autograd.grad(got, logp)
        want = step(logp)
        (g_want,) = torch.autograd.grad(want, logp)
        as_tensor = rlkernels.policy_loss(logp, old, adv, mask, cu_seqlens=torch.tensor(bounds),
                                          agg="seq-mean-token-mean", ratio="sequence")[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    torch.testing.assert_close(as_tensor + rlkernels.value_loss(logp, old, adv, mask, cu_seqlens=bounds, clip=0.2)[0],
                               want)
    with pytest.raises(TypeError, match="cu_seqlens"):
        rlkernels.policy_loss(logp, old, adv, mask, cu_seqlens=[0, 3.0, 9])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_boundaries_that_change_per_batch_compile_with_fullgraph(backend):
    """A training loop passes each batch's boundaries as a list to one compiled step: once they change, dynamo's
    automatic dynamic shapes trace the list's ints as symbols (the padded view's S and Tmax then symbolic); every
    batch still compiles whole and equals the eager losses and gradients, the number of sequences changing too."""
    gen = torch.Generator().manual_seed(13)
    total = 9

    def step(lp, old, adv, mask, bounds):
        pg, _ = rlkernels.policy_loss(lp, old, adv, mask, cu_seqlens=bounds, agg="seq-mean-token-mean")
        vf, _ = rlkernels.value_loss(lp, old, adv, mask, cu_seqlens=bounds, clip=0.2)
        return pg + vf

    with forced_backend(backend):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for bounds in ([0, 3, 9], [0, 5, 9], [0, 2, 4, 9], [0, 1, 1, 8, 9], [0, 9]):
            logp = (-torch.rand(1, total, generator=gen)).requires_grad_()  # [1, total]
            old, adv = -torch.rand(1, total, generator=gen), torch.randn(1, total, generator=gen)  # [1, total] each
            mask = torch.rand(1, total, generator=gen) < 0.8  # [1, total]
            got = compiled(logp, old, adv, mask, bounds)
            (g_got,) = torch.autograd.grad(got, logp)
            want = step(logp, old, adv, mask, bounds)
            (g_want,) = torch.autograd.grad(want, logp)
            torch.testing.assert_close(got, want, msg=str(bounds))
            torch.testing.assert_close(g_got, g_want, msg=str(bounds))


from rlkernels import hf  # noqa: E402
from tests.test_hf import V, _tiny  # noqa: E402

PROMPTS, RESPONSES = [3, 5, 2], [4, 1, 6]  # per sequence


def _sequences(seed=7):
    """Token ids and response masks of three prompt + response sequences of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, V, (p + r,), generator=g) for p, r in zip(PROMPTS, RESPONSES)]  # [n_s] each
    rms = [torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(r, dtype=torch.long)]) for p, r in zip(PROMPTS, RESPONSES)]
    return ids, rms


def _scored(logits, x, rm):
    """One sequence's float64 log-probs and entropies from its logits [n-1, V] predicting x[1:]: [n] each, 0 at
    its first token (nothing predicts it) and wherever the response mask rm [n] is 0."""
    logp_all = torch.log_softmax(logits, -1)  # [n-1, V]
    lp = logp_all.gather(-1, x[1:, None]).squeeze(-1)  # [n-1]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [n-1]
    keep = rm[1:].bool()  # [n-1]
    return (torch.cat([lp.new_zeros(1), torch.where(keep, lp, 0.0)]),
            torch.cat([ent.new_zeros(1), torch.where(keep, ent, 0.0)]))


def _alone_truth(model, ids, rms):
    """Each sequence alone through the float64 model's own logits: [total] log-probs and entropies."""
    m64 = __import__("copy").deepcopy(model).double()
    logps, ents = [], []
    with torch.no_grad():
        for x, rm in zip(ids, rms):
            lp, ent = _scored(m64(input_ids=x[None]).logits[0, :-1], x, rm)  # [n] each
            logps.append(lp)
            ents.append(ent)
    return torch.cat(logps)[None], torch.cat(ents)[None]  # [1, total] x2


def _alone_head_truth(model, ids, rms):
    """Each sequence alone through the model's float32 backbone, then its head in float64: [total] log-probs and
    entropies (for a model too large to copy to float64 in a test; the backbone's rounding is then in the
    truth, the same size for the packed and the padded layouts)."""
    weight = model.get_output_embeddings().weight.double()  # [V, H]
    logps, ents = [], []
    with torch.no_grad():
        for x, rm in zip(ids, rms):
            h = model.base_model(input_ids=x[None], use_cache=False).last_hidden_state[0, :-1].double()  # [n-1, H]
            lp, ent = _scored(h @ weight.T, x, rm)  # [n] each
            logps.append(lp)
            ents.append(ent)
    return torch.cat(logps)[None], torch.cat(ents)[None]  # [1, total] x2


def _padded(ids, rms, prompts=PROMPTS):
    """Left-padded prompts and right-padded responses, as the trainer batches them: (ids, am, rm, pos) [B, T]."""
    P, R = max(prompts), max(x.numel() - p for x, p in zip(ids, prompts))
    B = len(ids)
    out = [torch.zeros(B, P + R, dtype=torch.long) for _ in range(3)]
    for b, (x, rm, p) in enumerate(zip(ids, rms, prompts)):
        sl = slice(P - p, P - p + x.numel())
        out[0][b, sl], out[1][b, sl], out[2][b, sl] = x, 1, rm
    am = out[1]
    return out[0], am, out[2], (am.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids"])
def test_response_logprobs_packed_equals_padded(kind, boundaries):
    """Packed log-probs and entropies = each sequence alone (float64 truth) to float32 rounding, no worse than the
    padded batch's; gradients reach the parameters the same way as padded."""
    model = _tiny(kind, False)
    ids, rms = _sequences()
    cu = torch.tensor([0, *torch.tensor([x.numel() for x in ids]).cumsum(0).tolist()])  # [S + 1]
    packed_ids, packed_rm = torch.cat(ids)[None], torch.cat(rms)[None]  # [1, total]
    where = {"cu_seqlens": cu} if boundaries == "cu_seqlens" else {"position_ids": packing.positions(cu, packed_ids.shape[1])}
    want_lp, want_ent = _alone_truth(model, ids, rms)
    pid, am, prm, pos = _padded(ids, rms)
    flat, _ = packing.pack_padded(am)
    with forced_backend("torch"):
        logp, ent = hf.response_logprobs(model, packed_ids, None, packed_rm, return_entropy=True, **where)
        pad_lp, pad_ent = hf.response_logprobs(model, pid, am, prm, position_ids=pos, return_entropy=True)
    pad_lp, pad_ent = packing.pack(pad_lp, flat), packing.pack(pad_ent, flat)  # [1, total]
    assert logp.shape == packed_ids.shape and int((logp != 0).sum()) == sum(RESPONSES)
    assert_close_to_truth(logp.detach(), want_lp, torch.float32, eager=pad_lp.detach(), name="logp")
    assert_close_to_truth(ent.detach(), want_ent, torch.float32, eager=pad_ent.detach(), name="entropy")
    # gradients: the same loss through both layouts gives the same parameter gradients
    weight = torch.randn(packed_ids.shape, generator=torch.Generator().manual_seed(1))  # [1, total]
    g_packed = torch.autograd.grad((logp * weight).sum() + ent.sum(), list(model.parameters()), allow_unused=True)
    g_padded = torch.autograd.grad((pad_lp * weight).sum() + pad_ent.sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g_packed, g_padded):
        if a is not None:
            torch.testing.assert_close(a, b)


def test_only_response_rows_reach_the_head_packed():
    """Packed: the head's kernel sees the scored rows only, never a sequence's first token (nothing in its own
    sequence predicts it, even when response_mask covers it), and the values are each sequence's own."""
    model = _tiny("llama", True)
    ids, _ = _sequences(seed=9)
    rms = [torch.ones_like(x) for x in ids]  # everything "response", first tokens included
    cu = torch.tensor([0, *torch.tensor([x.numel() for x in ids]).cumsum(0).tolist()])  # [S + 1]
    rows = []
    recording = recording_head(rows)
    with torch.no_grad(), forced_backend("torch"):
        logp = hf.response_logprobs(model, torch.cat(ids)[None], None, torch.cat(rms)[None], cu_seqlens=cu,
                                    linear_logprobs=recording)  # [1, total]
    total = int(cu[-1])
    assert rows == [(total - len(ids), model.config.hidden_size)]
    assert logp[0, cu[:-1]].eq(0).all()  # the sequences' first tokens
    want, _ = _alone_truth(model, ids, rms)
    assert_close_to_truth(logp, want, torch.float32, name="logp")


def test_packed_arguments_are_validated():
    model = _tiny("llama", False)
    ids = torch.zeros(1, 6, dtype=torch.long)
    rm = torch.ones_like(ids)
    cu = torch.tensor([0, 3, 6])
    with pytest.raises(ValueError, match="exactly one of cu_seqlens or position_ids"):
        hf.response_logprobs(model, ids, None, rm)
    with pytest.raises(ValueError, match="pass attention_mask=None with it"):
        hf.response_logprobs(model, ids, torch.ones_like(ids), rm, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"with cu_seqlens, input_ids must be \[1, total\]"):
        hf.response_logprobs(model, ids.view(2, 3), None, rm.view(2, 3), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"position_ids must restart at 0 at the start of every row"):
        hf.response_logprobs(model, ids.view(2, 3), None, rm.view(2, 3), position_ids=torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length 6"):
        hf.response_logprobs(model, ids, None, rm, cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match=r"position_ids must restart at 0"):
        hf.response_logprobs(model, ids, None, rm, position_ids=torch.tensor([[1, 2, 3, 0, 1, 2]]))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_supports_packing_is_a_check(kind, monkeypatch):
    """True for these models; False once transformers stops recognising packed position_ids (the probe sees
    the second sequence attend to the first)."""
    import transformers.masking_utils as masking_utils

    model = _tiny(kind, False).train()
    assert hf.supports_packing(model) and model.training  # the mode is restored
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    assert not hf.supports_packing(model)



def test_packed_logprobs_probe_again_after_the_attention_implementation_changes():
    """The packing verdict was remembered per backbone whatever attention it ran: probed under sdpa (which keeps
    packed sequences apart), then switched with set_attn_implementation to a kernel that ignores the packed mask,
    the model's packed log-probs came back with the second sequence attending to the first, silently (-5.53
    against -7.35 on this case)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):  # one causal mask over the packed row
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("rlkernels_test_causal_only", causal_only)
    model = _tiny("llama", False).eval()
    ids = torch.tensor([[1, 5, 6, 2, 7, 8]])  # [1, 6]: two sequences of 3
    rm = torch.tensor([[0, 1, 1, 0, 1, 1]])  # [1, 6]
    assert hf.supports_packing(model)
    packed = hf.response_logprobs(model, ids, None, rm, cu_seqlens=[0, 3, 6])  # [1, 6]
    padded = hf.response_logprobs(model, ids.view(2, 3), torch.ones(2, 3), rm.view(2, 3))  # [2, 3]
    torch.testing.assert_close(packed.view(2, 3), padded)
    model.set_attn_implementation("rlkernels_test_causal_only")
    with pytest.raises(ValueError, match=r"^attention_mask=None \(a packed batch\): LlamaForCausalLM "
                                         r"\(rlkernels_test_causal_only attention\) does not keep"):
        hf.response_logprobs(model, ids, None, rm, cu_seqlens=[0, 3, 6])
    model.set_attn_implementation("eager")  # keeps them apart again: probed again, and packed equals padded
    torch.testing.assert_close(hf.response_logprobs(model, ids, None, rm, cu_seqlens=[0, 3, 6]), packed)


def test_supports_packing_sees_through_a_compiled_backbone():
    """torch.compile's wrapper has the signature (*args, **kwargs): the position_ids check reads the module it wraps
    (reading the wrapper refused every compiled backbone)."""
    model = _tiny("llama", False)
    model.model = torch.compile(model.model)
    assert hf.supports_packing(model)

# ------------------------------------------------------------------ the trainer's --pack

@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trainer_pack_equals_padded(tmp_path, algo):
    """Two steps with --pack give the padded run's metrics and parameters (to float32 rounding), and it did pack."""
    from rlkernels.trainer.loop import Trainer, read_metrics
    from tests.test_trainer import tiny

    runs = {}
    for pack in (False, True):
        tr = Trainer(tiny(tmp_path / str(pack), algo=algo, pack=pack, kl_coef=0.05))
        assert tr.policy_lp.pack is pack and (tr.critic is None or tr.critic.pack is pack)
        tr.run()
        runs[pack] = tr, read_metrics(tmp_path / str(pack) / "metrics.jsonl")
    (padded, rows), (packed, packed_rows) = runs[False], runs[True]
    for row, packed_row in zip(rows, packed_rows, strict=True):
        for key, value in row.items():
            if not key.startswith("perf/"):
                assert packed_row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(padded.policy.named_parameters(), packed.policy.parameters()):
        torch.testing.assert_close(q, p, msg=name)


def test_trainer_pack_falls_back_when_unsupported(tmp_path, monkeypatch, capsys):
    from rlkernels.trainer.loop import Trainer
    from tests.test_trainer import tiny

    monkeypatch.setattr(hf, "supports_packing", lambda model: False)
    tr = Trainer(tiny(tmp_path, pack=True))
    assert not tr.policy_lp.pack
    assert "does not keep packed sequences apart; running padded" in capsys.readouterr().out


@pytest.mark.parametrize("pack", [False, True])
def test_trainer_head_sees_only_response_rows(pack):
    """The trainer's TokenLogprobs (padded or --pack) sends the response tokens only through the head: no
    prompt, no padding (issue 13 item 3), and gives the same log-probs either way."""
    import types

    from rlkernels.trainer.models import TokenLogprobs

    model = _tiny("qwen2", False)
    ids, rms = _sequences(seed=11)
    pid, am, prm, _ = _padded(ids, rms)
    R = max(RESPONSES)
    labels = pid[:, -R:].masked_fill(prm[:, -R:] == 0, -100)  # [B, R]
    rows = []

    def recording(hidden, weight, labels, **kwargs):  # hidden [N, H]
        rows.append(hidden.shape[0])
        assert bool((labels != -100).all())
        return rlkernels.linear_logprobs(hidden, weight, labels, **kwargs)

    with torch.no_grad(), forced_backend("torch"):
        logp, _ = TokenLogprobs(model, types.SimpleNamespace(linear_logprobs=recording), pack=pack)(pid, am, labels)
        want, _ = TokenLogprobs(model, rlkernels)(pid, am, labels)  # [B, R]
    assert rows == [sum(RESPONSES)]
    torch.testing.assert_close(logp, want)


def test_trainer_rows_share_sequences_and_equal_padded():
    """trainer.packing puts several sequences in one row of the padded width (first-fit decreasing, filler
    after), and the log-probs, entropies and hidden states equal each sequence alone / the padded batch."""
    from rlkernels.trainer import packing as trainer_packing

    model = _tiny("llama", False)
    prompts, responses = [2, 4, 1, 3], [3, 5, 2, 2]  # lengths 5, 9, 3, 5 in rows of 9
    g = torch.Generator().manual_seed(13)
    ids = [torch.randint(0, V, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    rms = [torch.cat([torch.zeros(p, dtype=torch.long), torch.ones(r, dtype=torch.long)]) for p, r in zip(prompts, responses)]
    pid, am, prm, pos = _padded(ids, rms, prompts)  # [4, 9]
    padded_index, packed_index, position_ids = trainer_packing._layout(am)
    assert position_ids.tolist() == [list(range(9)), [0, 1, 2, 3, 4, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3]]
    flat, _ = packing.pack_padded(am)
    want_lp, want_ent = _alone_truth(model, ids, rms)  # [1, total] x2
    with torch.no_grad(), forced_backend("torch"):
        lp, ent = trainer_packing.response_logprobs(model, pid, am, prm.bool(), temperature=1.0, return_entropy=True,
                                                    linear_logprobs=rlkernels.linear_logprobs)  # [B, L] x2
        pad_lp, pad_ent = hf.response_logprobs(model, pid, am, prm, position_ids=pos, return_entropy=True)
        hidden = trainer_packing.final_hidden(model.base_model, pid, am)  # [B, L, H]
        pad_hidden = hf.final_hidden(model.base_model, input_ids=pid, attention_mask=am, position_ids=pos)
    assert lp.shape == pid.shape and not lp[am == 0].any() and not hidden[am == 0].any()
    assert_close_to_truth(packing.pack(lp, flat), want_lp, torch.float32, eager=packing.pack(pad_lp, flat), name="logp")
    assert_close_to_truth(packing.pack(ent, flat), want_ent, torch.float32, eager=packing.pack(pad_ent, flat), name="entropy")
    torch.testing.assert_close(hidden[am != 0], pad_hidden[am != 0])


def test_packed_logprobs_refuse_a_model_that_does_not_keep_sequences_apart(monkeypatch):
    """A model whose attention ignores restarting positions (OPT; here Llama with transformers' packed-sequence
    detection switched off) would let packed sequences attend to each other: refused, not a wrong number. The
    probe runs once per model; a model that packs gives the per-sequence values."""
    import transformers.masking_utils as masking_utils

    ids = torch.tensor([[1, 5, 6, 2, 7, 8]])  # [1, 6]: two sequences of 3
    rm = torch.tensor([[0, 1, 1, 0, 1, 1]])  # [1, 6]
    cu = torch.tensor([0, 3, 6])
    probes = []
    probe = hf._probe_packing
    monkeypatch.setattr(hf, "_probe_packing", lambda *a: probes.append(1) or probe(*a))
    model = _tiny("llama", False).eval()
    packed = hf.response_logprobs(model, ids, None, rm, cu_seqlens=cu)  # [1, 6]
    alone = torch.cat([hf.response_logprobs(model, ids[:, :3], torch.ones(1, 3), rm[:, :3]),
                       hf.response_logprobs(model, ids[:, 3:], torch.ones(1, 3), rm[:, 3:])], dim=1)  # [1, 6]
    torch.testing.assert_close(packed, alone)
    torch.testing.assert_close(hf.response_logprobs(model, ids, None, rm, cu_seqlens=cu), packed)
    assert len(probes) == 1  # once per model
    other = _tiny("llama", False).eval()
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ValueError, match=r"^attention_mask=None \(a packed batch\): LlamaForCausalLM .* does not keep "
                                         r"packed sequences apart"):
        hf.response_logprobs(other, ids, None, rm, cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_logprobs_refuse_bloom_which_ignores_position_ids(dtype):
    """BLOOM's backbone takes no position_ids (its **kwargs swallow them) and lets packed sequences attend to each
    other, but at initialisation that moved its states by 1.4% of their scale, under the probe's 2e-2: it passed
    supports_packing, and packed log-probs were 2.6e-2 from the padded ones, silently."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=97, hidden_size=48, n_layer=2,
                                                                   n_head=4)).eval().to(dtype)
    assert not hf.supports_packing(model)
    ids = torch.tensor([[1, 5, 6, 2, 7, 8]])  # [1, 6]: two sequences of 3
    rm = torch.tensor([[0, 1, 1, 0, 1, 1]])  # [1, 6]
    with pytest.raises(ValueError, match=r"^attention_mask=None \(a packed batch\): BloomForCausalLM"):
        hf.response_logprobs(model, ids, None, rm, cu_seqlens=[0, 3, 6])


def test_packed_logprobs_under_torch_compile_still_refuse_a_model_that_does_not_keep_sequences_apart():
    """Under torch.compile the packing check was skipped altogether (it reads the model's states): a compiled call let
    OPT's packed sequences attend to each other, silently, even after an eager call had found it does not pack."""
    import transformers

    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=97, hidden_size=48, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=48)).eval()
    ids = torch.tensor([[1, 5, 6, 2, 7, 8]])  # [1, 6]: two sequences of 3
    rm = torch.tensor([[0, 1, 1, 0, 1, 1]])  # [1, 6]
    compiled = torch.compile(hf.response_logprobs, backend="aot_eager")
    for _ in range(2):  # probed from inside the compiled call (outside its graph), then the verdict remembered
        with pytest.raises(ValueError, match="does not keep packed sequences apart"):
            compiled(model, ids, None, rm, cu_seqlens=[0, 3, 6])
    assert hf._remembered_packing(model.model) is False
    llama = _tiny("llama", False)  # a model that packs: compiled equals eager, probed from inside the compiled call
    torch.testing.assert_close(compiled(llama, ids, None, rm, cu_seqlens=[0, 3, 6]),
                               hf.response_logprobs(llama, ids, None, rm, cu_seqlens=[0, 3, 6]))
