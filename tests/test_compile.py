"""torch.compile(fullgraph=True) of the public ops: a whole RL step with the default (inductor)
backend in a fresh process (first use of every op, including the csrc extension's load, happens
while Dynamo traces); numeric options that change between calls and dynamic=True (traced as
symbols); masks whose values are not checked while tracing."""
import subprocess
import sys
import textwrap

STEP = textwrap.dedent(
    """
    import torch, rlkernels
    torch.manual_seed(0)
    B, T, V, H = 2, 8, 1000, 32
    hidden = torch.randn(B * T, H, requires_grad=True)  # [N, H]
    weight = torch.randn(V, H, requires_grad=True)  # [V, H]
    labels = torch.randint(0, V, (B * T,))  # [N]
    old = torch.randn(B, T) - 3  # [B, T]
    mask = torch.rand(B, T) > 0.2  # [B, T]
    scores = torch.randn(B * 2)  # [2B]: two samples per prompt

    def step(hidden, weight, values):
        logp, ent = rlkernels.linear_logprobs(hidden, weight, labels, return_entropy=True)  # [N]
        logp2 = rlkernels.logprobs(hidden @ weight.T, labels)  # [N]
        adv_seq = rlkernels.group_advantages(scores, 2)[:B]  # [B]
        rewards = rlkernels.kl_penalty(logp.view(B, T), old).detach()  # [B, T]
        adv, ret = rlkernels.gae(rewards, values.detach(), mask, gamma=0.99, lam=0.95)  # [B, T]
        adv = rlkernels.masked_whiten(adv, mask)
        pg, metrics = rlkernels.policy_loss(logp.view(B, T), old, adv + adv_seq[:, None], mask,
                                            ref_logp=logp2.view(B, T).detach(), kl_coef=0.1,
                                            entropy=ent.view(B, T), entropy_coef=0.01)
        vf, _ = rlkernels.value_loss(values, values.detach() + 0.1, ret, mask, clip=0.2)
        return pg + vf, metrics["clipfrac"]

    values = torch.randn(B, T, requires_grad=True)
    compiled = torch.compile(step, fullgraph=True)
    loss_c, _ = compiled(hidden, weight, values)
    grads_c = torch.autograd.grad(loss_c, (hidden, weight, values))
    loss_e, _ = step(hidden, weight, values)
    grads_e = torch.autograd.grad(loss_e, (hidden, weight, values))
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    print("compiled step matches eager")
    """
)


def test_whole_step_compiles_with_inductor_in_a_fresh_process():
    result = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled step matches eager" in result.stdout


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import rlkernels  # noqa: E402
from tests.helpers import forced_backend  # noqa: E402

_G = torch.Generator().manual_seed(5)
_B, _T, _H, _V = 3, 7, 8, 11
_LOGP = (-torch.rand(_B, _T, generator=_G) * 3).requires_grad_()  # [B, T]
_OLD = _LOGP.detach() + 0.3 * torch.randn(_B, _T, generator=_G)  # [B, T]
_ADV = torch.randn(_B, _T, generator=_G)  # [B, T]
_MASK = torch.rand(_B, _T, generator=_G) > 0.3  # [B, T]
_HIDDEN = torch.randn(_B, _T, _H, generator=_G).requires_grad_()  # [B, T, H]
_WEIGHT = torch.randn(_V, _H, generator=_G).requires_grad_()  # [V, H]
_LABELS = torch.randint(0, _V, (_B, _T), generator=_G)  # [B, T]
_LOGITS = torch.randn(_B, _T, _V, generator=_G).requires_grad_()  # [B, T, V]

# (name, f(option) -> tensor or (tensor, ...), three values of the option)
_CHANGING_OPTIONS = [
    ("policy_loss kl_coef", lambda k: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, ref_logp=_OLD, kl_coef=k),
     (0.1, 0.2, 0.3)),
    ("policy_loss clip_low", lambda c: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, clip_low=c), (0.1, 0.2, 0.3)),
    ("policy_loss dual_clip", lambda c: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, dual_clip=c), (2.0, 3.0, 4.0)),
    ("policy_loss norm_length", lambda n: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, agg="seq-mean-token-sum-norm",
                                                                norm_length=n), (10, 20, 30)),
    ("value_loss clip", lambda c: rlkernels.value_loss(_LOGP, _OLD, _ADV, _MASK, clip=c), (0.1, 0.2, 0.3)),
    ("kl_penalty", lambda k: rlkernels.kl_penalty(_LOGP * k, _OLD), (1.0, 2.0, 3.0)),
    ("gae gamma", lambda g: rlkernels.gae(_ADV, _OLD, _MASK, gamma=g, lam=0.95), (0.9, 0.95, 0.99)),
    ("gae lam", lambda g: rlkernels.gae(_ADV, _OLD, _MASK, gamma=0.99, lam=g), (0.9, 0.95, 0.99)),
    ("masked_whiten eps", lambda e: rlkernels.masked_whiten(_ADV, _MASK, eps=e), (1e-8, 1e-6, 1e-5)),
    ("group_advantages eps", lambda e: rlkernels.group_advantages(_ADV.reshape(-1), 3, eps=e), (1e-6, 1e-5, 1e-4)),
    ("logprobs temperature", lambda t: rlkernels.logprobs(_LOGITS, _LABELS, temperature=t), (0.7, 0.8, 0.9)),
    ("linear_logprobs temperature", lambda t: rlkernels.linear_logprobs(_HIDDEN, _WEIGHT, _LABELS, temperature=t),
     (0.7, 0.8, 0.9)),
    ("linear_policy_loss entropy_coef", lambda k: rlkernels.linear_policy_loss(_HIDDEN, _WEIGHT, _LABELS, _OLD, _ADV,
                                                                               _MASK, entropy_coef=k), (0.01, 0.02, 0.03)),
    ("logits_policy_loss temperature", lambda t: rlkernels.logits_policy_loss(_LOGITS, _LABELS, _OLD, _ADV, _MASK,
                                                                              temperature=t), (0.7, 0.8, 0.9)),
]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("name,fn,values", _CHANGING_OPTIONS, ids=[c[0] for c in _CHANGING_OPTIONS])
def test_an_option_that_changes_between_calls_stays_in_one_graph(backend, name, fn, values):
    """A compiled function that passes a numeric option through (an adaptive KL coefficient, a schedule) is traced
    again with the option as a symbol once it changes: every op, its option checks included, traces that without
    a graph break, and each call matches eager."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with forced_backend(backend):
        for value in values:
            torch.testing.assert_close(_first(compiled(value)), _first(fn(value)), msg=f"{name}={value}")


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_dynamic_shapes_and_options_compile(backend):
    """torch.compile(dynamic=True): shapes and numeric options symbolic from the first call."""
    for fn in (lambda: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK), lambda: rlkernels.value_loss(_LOGP, _OLD, _ADV, _MASK),
               lambda: rlkernels.gae(_ADV, _OLD, _MASK), lambda: rlkernels.masked_whiten(_ADV, _MASK),
               lambda: rlkernels.group_advantages(_ADV.reshape(-1), 3)):
        torch._dynamo.reset()
        with forced_backend(backend):
            torch.testing.assert_close(_first(torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")()),
                                       _first(fn()))


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_unchecked_mask_values_count_as_one_on_every_backend(backend):
    """A float mask holding 0.5 is refused eagerly on the CPU; while torch.compile traces, that check is skipped
    (data-dependent), and every nonzero entry counts as 1 on every backend: the result of the bool mask."""
    half = _MASK.float()  # [B, T]
    half[1, :3] = 0.5
    as_bool = half != 0  # [B, T]
    for op, args in ((rlkernels.policy_loss, (_LOGP, _OLD, _ADV)), (rlkernels.value_loss, (_LOGP, _OLD, _ADV)),
                     (rlkernels.logits_policy_loss, (_LOGITS, _LABELS, _OLD, _ADV))):
        torch._dynamo.reset()
        with forced_backend(backend):
            with pytest.raises(ValueError, match="mask"):
                op(*args, half)
            loss, metrics = torch.compile(lambda m: op(*args, m), fullgraph=True, backend="aot_eager")(half)
            want, want_metrics = op(*args, as_bool)
        torch.testing.assert_close(loss, want, msg=op.__name__)
        for key in want_metrics:
            torch.testing.assert_close(metrics[key], want_metrics[key], msg=f"{op.__name__} {key}")


_TENSOR_OPTIONS = [
    ("logprobs temperature", lambda t: rlkernels.logprobs(_LOGITS, _LABELS, temperature=t), torch.tensor(0.7)),
    ("logprobs return_entropy", lambda f: rlkernels.logprobs(_LOGITS, _LABELS, return_entropy=f)[0],
     torch.tensor(True)),
    ("policy_loss clip_low", lambda c: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, clip_low=c), torch.tensor(0.3)),
    ("policy_loss kl_coef", lambda k: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, ref_logp=_OLD, kl_coef=k),
     torch.tensor(0.1)),
    ("value_loss clip", lambda c: rlkernels.value_loss(_LOGP, _OLD, _ADV, _MASK, clip=c), torch.tensor(0.2)),
    ("linear_policy_loss temperature", lambda t: rlkernels.linear_policy_loss(_HIDDEN, _WEIGHT, _LABELS, _OLD, _ADV,
                                                                              _MASK, temperature=t), torch.tensor(0.7)),
]


@pytest.mark.parametrize("name,fn,value", _TENSOR_OPTIONS, ids=[c[0] for c in _TENSOR_OPTIONS])
def test_a_tensor_option_under_fullgraph_is_refused_naming_it(name, fn, value):
    """A one-element tensor option (accepted eagerly, read on the host) has no value while torch.compile traces:
    with fullgraph=True the call fails with an error naming the option (not Dynamo's 'sympy expression is NaN'
    from comparing an unknown float), and without fullgraph the frame falls back to eager and matches it."""
    option = name.split()[-1]
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"{option} must be a Python (number|bool) inside torch.compile"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(value)
    torch._dynamo.reset()
    torch.testing.assert_close(_first(torch.compile(fn, backend="aot_eager")(value)), _first(fn(value)))


_NUMPY_FLOAT64_OPTIONS = [
    ("policy_loss kl_coef", lambda k: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, ref_logp=_OLD, kl_coef=k)),
    ("policy_loss clip_low", lambda c: rlkernels.policy_loss(_LOGP, _OLD, _ADV, _MASK, clip_low=c)),
    ("logprobs temperature", lambda t: rlkernels.logprobs(_LOGITS, _LABELS, temperature=t)),
    ("value_loss clip", lambda c: rlkernels.value_loss(_LOGP, _OLD, _ADV, _MASK, clip=c)),
]


@pytest.mark.parametrize("name,fn", _NUMPY_FLOAT64_OPTIONS, ids=[c[0] for c in _NUMPY_FLOAT64_OPTIONS])
def test_numpy_float64_options_compile_with_fullgraph(name, fn):
    """An np.float64 option (an adaptive KL controller's coefficient), accepted eagerly, also works under
    torch.compile(fullgraph=True), where Dynamo hands it over as a 0-d array: each call matches eager."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for value in (np.float64(0.3), np.float64(0.7)):
        torch.testing.assert_close(_first(compiled(value)), _first(fn(value)), msg=f"{name}={value!r}")
