"""process_advantages (GRPO with process supervision, DeepSeekMath §4.1.3) against the float64 reference and
a hand-computed case, on every backend the machine runs (reference, torch, triton interpreted on CPU)."""
from __future__ import annotations

import math

import pytest
import torch

import rlkernels
from rlkernels import advantages as adv_mod
from rlkernels import reference
from tests.helpers import REL_TOL, backends, devices, forced_backend, rel_error

BACKENDS = backends("cpu")
DEVICE_BACKENDS = [(d, b) for d in devices() for b in backends(d)]  # CUDA pairs where a GPU is present


def run(backend, *args, **kwargs):
    with forced_backend(backend):
        return rlkernels.process_advantages(*args, **kwargs)


def random_steps(B, S, T, gen, p_valid=0.7):
    """``[B, S]`` step rewards, ends in ``[0, T)`` and a step mask; padded steps hold NaN and an end past T
    (neither may reach an output)."""
    rewards = torch.randn(B, S, generator=gen) * 2 + 0.5  # [B, S]
    ends = torch.randint(0, T, (B, S), generator=gen)  # [B, S]
    mask = torch.rand(B, S, generator=gen) < p_valid  # [B, S]
    rewards = torch.where(mask, rewards, float("nan"))
    ends = torch.where(mask, ends, T + 5)
    return rewards, ends, mask


def check(backend, rewards, ends, T, dtype=torch.float32, **kwargs):
    truth = reference.process_advantages(rewards.double(), ends, T, **kwargs)  # [B, T] float64
    out = run(backend, rewards.to(dtype), ends, T, **kwargs)
    assert out.dtype == torch.float32 and out.shape == (rewards.shape[0], T)
    assert torch.equal(torch.isnan(out), torch.isnan(truth)), f"{backend}: NaN pattern differs"
    tol = REL_TOL[torch.float32]
    if dtype != torch.float32:  # the truth of the rounded inputs: only the op's own float32 arithmetic counts
        truth = reference.process_advantages(rewards.to(dtype).double(), ends, T, **kwargs)
    err = rel_error(out, truth)
    assert err <= tol, f"{backend} {dtype} {kwargs.get('mode', 'grpo')}: relative error {err:.2e}"
    return out, truth


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_matches_float64_reference(backend, mode):
    gen = torch.Generator().manual_seed(0)
    # S = 5 and S = 11 take the Triton launcher's two block shapes; T = 70 spans two token blocks of 64
    for B, S, T, group_size in ((8, 5, 70, 4), (6, 11, 20, 3), (4, 1, 3, 2)):
        rewards, ends, mask = random_steps(B, S, T, gen)
        rewards[:group_size] = torch.where(mask[:group_size], 0.1 + 0.2, float("nan"))  # a group whose steps are all equal
        mask[group_size, :] = False  # a row with no step
        out, _ = check(backend, rewards, ends, T, step_mask=mask, group_size=group_size, mode=mode)
        assert torch.all(out[:group_size] == 0), "a constant group gives exactly 0, whatever the rounding of its mean"
        assert torch.all(out[group_size] == 0), "a row with no step gives 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_groups_nan_and_low_precision(backend):
    gen = torch.Generator().manual_seed(1)
    B, S, T = 10, 4, 9
    rewards, ends, mask = random_steps(B, S, T, gen)
    index = torch.tensor([7, -3, 7, 500, -3, 7, 500, 500, 11, -3], dtype=torch.int32)  # arbitrary, scattered ids
    mask[8] = False
    rewards[8, 0], ends[8, 0], mask[8, 0] = 2.5, 3, True  # group 11 has one step: exactly 0
    out, _ = check(backend, rewards, ends, T, step_mask=mask, index=index)
    assert torch.all(out[8] == 0)
    rewards[1, 0], ends[1, 0], mask[1, 0] = float("nan"), 6, True  # a NaN step reward stays inside its group (-3)
    out, truth = check(backend, rewards, ends, T, step_mask=mask, index=index)
    assert torch.isnan(out[index == -3]).any() and not torch.isnan(out[index != -3]).any()
    if backend != "reference":
        mask[1, 0] = False
        check(backend, rewards, ends, T, dtype=torch.bfloat16, step_mask=mask, index=index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed(backend):
    # one group of two rows; its step rewards are {1, 0, 0}: mean 1/3, unbiased std sqrt(1/3)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # [2, 2]
    ends = torch.tensor([[1, 3], [2, 0]])  # [2, 2]
    mask = torch.tensor([[True, True], [True, False]])
    out = run(backend, rewards, ends, 5, step_mask=mask, group_size=2, eps=0.0)
    hi, lo = (2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3)  # the normalised rewards: 1.1547, -0.57735
    want = torch.tensor([[hi + lo, hi + lo, lo, lo, 0.0], [lo, lo, lo, 0.0, 0.0]])
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out = run(backend, rewards, ends, 5, step_mask=mask, group_size=2, mode="dr_grpo")
    torch.testing.assert_close(out, torch.tensor([[1 / 3, 1 / 3, -1 / 3, -1 / 3, 0.0], [-1 / 3, -1 / 3, -1 / 3, 0.0, 0.0]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_at_the_end_is_outcome_supervision(backend):
    """One step per row, ending at the row's last token: group_advantages of the scores on every token up to it."""
    gen = torch.Generator().manual_seed(2)
    B, T = 8, 6
    scores = torch.randn(B, generator=gen)  # [B]
    last = torch.randint(0, T, (B, 1), generator=gen)  # [B, 1]
    out = run(backend, scores[:, None], last, T, group_size=4)  # [B, T]
    want = reference.group_advantages(scores.double(), 4)[:, None] * (torch.arange(T)[None, :] <= last)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    for B, S, T in ((4, 0, 5), (0, 3, 5), (2, 3, 0)):
        rewards, ends = torch.randn(B, S), torch.zeros(B, S, dtype=torch.int64)  # [B, S] x2
        mask = torch.zeros(B, S, dtype=torch.bool) if T == 0 else None  # T = 0 leaves no token for any step
        out = run(backend, rewards, ends, T, step_mask=mask, group_size=2)
        assert out.shape == (B, T) and out.dtype == torch.float32 and not out.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_constant_groups_are_exactly_zero_whatever_their_values(backend, mode):
    """A group whose valid step rewards are all equal contributes exactly 0 on every backend, also when they are
    ±inf (where r - mean is NaN), and so does a group with fewer than two valid steps, even a NaN one; NaN in a group
    of two or more valid steps stays NaN there."""
    inf, nan = float("inf"), float("nan")
    rewards = torch.tensor([[inf, inf], [inf, inf],  # group 0: one value, +inf
                            [-inf, 0.0], [-inf, 0.0],  # group 1: -inf and 0 twice each: not constant (NaN)
                            [nan, 0.0], [0.0, 0.0],  # group 2: its second step masked out below: one NaN step
                            [1.0, 2.0], [3.0, nan]])  # group 3: a NaN among others: NaN
    ends = torch.tensor([[0, 2], [1, 2]] * 4)  # [8, 2]
    mask = torch.ones(8, 2, dtype=torch.bool)
    mask[4, 1] = mask[5] = False  # group 2 keeps one valid step, the NaN
    truth = reference.process_advantages(rewards.double(), ends, 3, step_mask=mask, group_size=2, mode=mode)
    out = run(backend, rewards, ends, 3, step_mask=mask, group_size=2, mode=mode)  # [8, 3]
    assert torch.equal(out[:2], torch.zeros(2, 3)) and torch.equal(out[4:6], torch.zeros(2, 3)), out
    assert torch.equal(torch.isnan(out), torch.isnan(truth)), (out, truth)
    assert torch.isnan(out[6:]).any()


def test_refuses_bad_inputs_naming_the_argument():
    r, e = torch.randn(4, 3), torch.randint(0, 5, (4, 3))  # [B, S] x2
    e[2, 1] = 5  # a valid step ending at T
    with pytest.raises(ValueError, match=r"step_ends.*row 2 step 1 ends at 5"):
        rlkernels.process_advantages(r, e, 5, group_size=2)
    e[2, 1] = -1
    with pytest.raises(ValueError, match="step_ends"):
        rlkernels.process_advantages(r, e, 5, group_size=2)
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[2, 1] = False  # ... which is fine once that step is padding
    assert rlkernels.process_advantages(r, e, 5, step_mask=mask, group_size=2).shape == (4, 5)
    e[2, 1] = 0
    cases = [
        ((r[0], e[0], 5), {"group_size": 1}, ValueError, "step_rewards"),  # 1-D
        ((r, e[:, :2], 5), {"group_size": 2}, ValueError, "step_ends"),
        ((r, e.float(), 5), {"group_size": 2}, TypeError, "step_ends"),
        ((r.long(), e, 5), {"group_size": 2}, TypeError, "step_rewards"),
        ((r, e, 5), {"group_size": 2, "step_mask": torch.ones(4, 2)}, ValueError, "step_mask"),
        ((r, e, 5), {"group_size": 3}, ValueError, "group_size"),
        ((r, e, 5), {}, ValueError, "group_size or index"),
        ((r, e, 5), {"group_size": 2, "index": torch.zeros(4, dtype=torch.int64)}, ValueError, "group_size or index"),
        ((r, e, 5), {"index": torch.zeros(3, dtype=torch.int64)}, ValueError, "index"),
        ((r, e, 5), {"index": [0, 0, 1, 1]}, TypeError, "index"),  # a list, not a tensor
        ((r, e, 5), {"index": torch.zeros(4)}, TypeError, "index"),  # float ids
        ((r, e, -1), {"group_size": 2}, ValueError, "T"),
        ((r, e, 5.0), {"group_size": 2}, TypeError, "T"),
        ((r, e, 5), {"group_size": 2, "mode": "rloo"}, ValueError, "mode"),
        ((r, e, 5), {"group_size": 2, "eps": float("nan")}, ValueError, "eps"),
    ]
    for args, kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            rlkernels.process_advantages(*args, **kwargs)


def test_no_gradient_and_documented():
    r = torch.randn(4, 2, requires_grad=True)  # [B, S]
    out = rlkernels.process_advantages(r, torch.zeros(4, 2, dtype=torch.int64), 3, group_size=2)
    assert not out.requires_grad
    doc = rlkernels.process_advantages.__doc__
    assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc and "[B, S]" in doc and "§4.1.3" in doc
    assert "process_advantages" in rlkernels.__all__
    assert any(c.kernel is adv_mod._process_kernel for c in adv_mod.aot_configs())


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_every_device_matches_float64(device, backend):
    """The same random case on each device (CUDA runs the compiled Triton kernel), larger than the CPU tests'."""
    gen = torch.Generator().manual_seed(5)
    B, S, T = (64, 40, 300) if device == "cuda" else (8, 3, 10)
    rewards, ends, mask = random_steps(B, S, T, gen)
    truth = reference.process_advantages(rewards.double(), ends, T, step_mask=mask, group_size=8)  # [B, T]
    out = run(backend, rewards.to(device), ends.to(device), T, step_mask=mask.to(device), group_size=8)
    assert out.device.type == device
    assert rel_error(out.cpu(), truth) <= REL_TOL[torch.float32]


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("index", [False, True])
def test_huge_finite_step_rewards(device, backend, mode, index):
    """Step rewards up to ±3e38: float32 sums and squared deviations overflow (the torch and Triton paths gave all
    zeros here). The torch path keeps its statistics in float64, the Triton kernel forms them on the rewards scaled
    by a power of two; both match the float64 truth, group by group at float32 rounding of the group's scale."""
    rewards = torch.tensor([[1e20, -2e20], [3e38, 5.0], [-3e38, 1e38], [2.0, 1e25], [7.0, -1.5], [3.0, 2.0]])  # [6, 2]
    ends = torch.tensor([[1, 3], [0, 3], [2, 3], [1, 2], [0, 3], [2, 3]])  # [6, 2]
    groups = {"index": torch.tensor([0, 0, 1, 1, 2, 2])} if index else {"group_size": 2}
    truth = reference.process_advantages(rewards.double(), ends, 4, mode=mode, **groups).float().double()  # [6, 4]
    out = run(backend, rewards.to(device), ends.to(device), 4, mode=mode,
              **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in groups.items()}).cpu()
    fin = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(out), fin), (out, truth)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        scale = truth[rows][fin[rows]].abs().max().clamp(min=1.0)
        assert ((out[rows] - truth[rows]).abs()[fin[rows]] <= 4e-7 * scale).all(), (out[rows], truth[rows])


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
@pytest.mark.parametrize("index", [False, True])
def test_tiny_step_rewards_without_eps(device, backend, index):
    """grpo with eps=0 is scale-free: step rewards near 1e-25 (or float32 denormals) give advantages of order 1. The
    Triton kernel squared deviations of that size in float32, which flush to 0: std 0 and ±inf/NaN outputs."""
    rewards = torch.tensor([[1e-25, -2e-25], [3e-25, 5e-26], [1e-40, 2e-40], [3e-40, 1e-45], [1.0, 2.0], [4.0, -1.5]])
    ends = torch.tensor([[1, 3], [0, 3], [2, 3], [1, 2], [0, 3], [2, 3]])  # [6, 2]
    groups = {"index": torch.tensor([0, 0, 1, 1, 2, 2])} if index else {"group_size": 2}
    truth = reference.process_advantages(rewards.double(), ends, 4, eps=0.0, **groups)  # [6, 4]
    out = run(backend, rewards.to(device), ends.to(device), 4, eps=0.0,
              **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in groups.items()}).cpu()
    assert torch.isfinite(out).all(), out
    assert rel_error(out, truth) <= REL_TOL[torch.float32]


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("index", [False, True])
def test_shifted_step_rewards(device, backend, mode, index):
    """Step rewards far from 0 with a spread of a few float32 ulps (1e4 + 1e-3 noise, exact float32 inputs): the
    Triton kernel subtracted the group's rounded float32 mean, off by up to half an ulp of 1e4, which is half the
    spread: 94 % relative error. Its statistics are now taken relative to a pivot (the group's largest reward)."""
    gen = torch.Generator().manual_seed(3)
    rewards = (torch.randn(8, 3, generator=gen, dtype=torch.float64) * 1e-3 + 1e4).float()  # [8, 3]
    ends = torch.randint(0, 6, (8, 3), generator=gen)  # [8, 3]
    mask = torch.rand(8, 3, generator=gen) < 0.8  # [8, 3]
    groups = {"index": torch.arange(8) % 4} if index else {"group_size": 2}
    truth = reference.process_advantages(rewards.double(), ends, 6, step_mask=mask, mode=mode, **groups)  # [8, 6]
    out = run(backend, rewards.to(device), ends.to(device), 6, step_mask=mask.to(device), mode=mode,
              **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in groups.items()}).cpu()
    assert rel_error(out, truth) <= REL_TOL[torch.float32], rel_error(out, truth)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64])
def test_step_ends_of_any_integer_dtype(backend, dtype):
    """step_ends may be any integer tensor (its docstring): uint16/32/64 ends crashed in the range check with torch's
    '"lt_cpu" not implemented for UInt16', naming no argument. An end outside [0, T) is still refused by name."""
    gen = torch.Generator().manual_seed(4)
    rewards, ends, mask = random_steps(6, 3, 7, gen)  # [B, S] x3: padded steps end at T + 5
    check(backend, rewards, ends.to(dtype), 7, step_mask=mask, group_size=2)
    bad = ends.clone()
    bad[~mask] = 3
    bad[0, 0] = 7
    with pytest.raises(ValueError, match="step_ends"):
        run(backend, rewards, bad.to(dtype), 7, group_size=2)


def test_custom_op_passes_opcheck_and_compiles():
    """The torch.library op: schema, fake tensor (shape [B, T]) and AOT dispatch checks, and a fullgraph compile."""
    gen = torch.Generator().manual_seed(6)
    rewards, ends, mask = random_steps(8, 3, 6, gen)
    for args in ((rewards, ends, mask, 6, 4, None, "grpo", 1e-6), (rewards, ends, mask, 6, None, torch.arange(8) % 3, "dr_grpo", 0.0)):
        result = torch.library.opcheck(adv_mod._process_op, args)
        assert all(v == "SUCCESS" for v in result.values()), result
    compiled = torch.compile(lambda r, e, m: adv_mod._process_op(r, e, m, 6, 4, None, "grpo", 1e-6) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(rewards, ends, mask), 2 * run("torch", rewards, ends, 6, step_mask=mask, group_size=4))
    # the public function too: its step_ends range check read the values (a data-dependent branch under fullgraph)
    torch._dynamo.reset()
    public = torch.compile(lambda r, e, m: rlkernels.process_advantages(r, e, 6, step_mask=m, group_size=4), fullgraph=True,
                           backend="aot_eager")
    torch.testing.assert_close(public(rewards, ends, mask), run("torch", rewards, ends, 6, step_mask=mask, group_size=4))
