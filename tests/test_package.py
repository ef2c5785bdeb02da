"""Package-level behaviour: cheap import, a clean namespace, backend selection, the CPU memory meter."""
import os
import subprocess
import sys

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from rlkernels import _backend
from rlkernels.testing import memory as _memory


def test_import_is_cheap():
    code = "import sys, rlkernels; bad = [m for m in ('transformers', 'triton') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import rlkernels imported {result.stdout.strip()}"


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (nothing imported yet), from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)


def test_lazy_submodules_are_attributes_after_a_bare_import():
    code = (
        "import sys, rlkernels\n"
        "assert 'transformers' not in sys.modules and 'rlkernels.hf' not in sys.modules\n"
        "assert callable(rlkernels.hf.response_logprobs) and callable(rlkernels.hf.smollm2_gguf)\n"
        "assert rlkernels.integrations.__name__ == 'rlkernels.integrations'\n"
        "assert 'trl' not in sys.modules  # the integrations package imports no trainer library\n"
        "assert rlkernels.trainer.__name__ == 'rlkernels.trainer'\n"
        "assert 'transformers' not in sys.modules  # rlkernels.hf uses the model duck-typed\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_namespace_is_the_public_api():
    code = "import rlkernels; print(' '.join(dir(rlkernels)))"
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    import rlkernels

    want = sorted([*rlkernels.__all__, "__version__", "hf", "integrations", "trainer"])
    assert result.stdout.split() == want  # no annotations, importlib, or other helpers
    assert sorted(dir(rlkernels)) == want  # the same after this process imported the op modules


def test_public_names_resolve():
    import rlkernels

    for name in rlkernels.__all__:
        assert callable(getattr(rlkernels, name)), name
    with pytest.raises(AttributeError):
        rlkernels.not_an_op  # noqa: B018


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("RLKERNELS_BACKEND", raising=False)
    assert _backend.select(torch.device("cpu")) == "torch"
    monkeypatch.setenv("RLKERNELS_BACKEND", "reference")
    assert _backend.select(torch.device("cpu")) == "reference"
    monkeypatch.setenv("RLKERNELS_BACKEND", "triton")
    assert _backend.select(torch.device("cpu")) == "triton"
    monkeypatch.setenv("RLKERNELS_BACKEND", "csrc")  # an op without a csrc kernel keeps its default
    assert _backend.select(torch.device("cpu"), supported=("reference", "torch", "triton")) == "torch"
    monkeypatch.setenv("RLKERNELS_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="RLKERNELS_BACKEND"):
        _backend.select(torch.device("cpu"))


def test_cpu_memory_meter_counts_what_is_allocated():
    x = torch.randn(256, 1000)
    one_copy = 256 * 1000 * 4
    report = _memory.measure_cpu(lambda: x * 2)
    assert report.largest_bytes == one_copy
    assert one_copy <= report.peak_bytes < 2 * one_copy

    def two_live():
        a = x * 2
        b = x * 3
        return a + b

    assert _memory.measure_cpu(two_live).peak_bytes >= 3 * one_copy

    def chained():
        for _ in range(4):
            y = x * 2  # each freed before the next is made
            del y

    assert _memory.measure_cpu(chained).peak_bytes < 2 * one_copy


def test_public_functions_survive_importing_their_modules():
    import importlib

    import rlkernels

    for name, module in rlkernels._EXPORTS.items():
        importlib.import_module(module)
        assert callable(getattr(rlkernels, name)) and not isinstance(getattr(rlkernels, name), type(rlkernels)), name


def test_fused_policy_losses_are_reached_where_the_contract_places_them():
    """DESIGN's layout puts the fused policy loss in fused_linear.py; it lives in fused_policy.py and is reached
    from both (the same functions), while a misspelt name still raises AttributeError."""
    import rlkernels
    from rlkernels import fused_linear, fused_policy

    assert fused_linear.linear_policy_loss is fused_policy.linear_policy_loss is rlkernels.linear_policy_loss
    assert fused_linear.logits_policy_loss is fused_policy.logits_policy_loss is rlkernels.logits_policy_loss
    from rlkernels.fused_linear import linear_policy_loss  # noqa: F401  (from-import goes through __getattr__)

    with pytest.raises(AttributeError, match="linear_policy_los"):
        fused_linear.linear_policy_los


def _options_classes():
    from rlkernels import fused_linear, fused_policy, losses, softmax

    return (softmax.LogprobsOptions, fused_linear.LinearLogprobsOptions, fused_policy.FusedPolicyOptions,
            losses.PolicyOptions, losses.ValueOptions, losses.KLOptions)


@pytest.mark.parametrize("options", _options_classes(), ids=lambda c: c.__name__)
def test_op_options_cross_torch_library_as_a_few_typed_lists(options):
    """An op's options dataclass crosses ``torch.library`` as at most four typed lists and comes back equal, every
    field in its place (distinct values in every field; an optional float both given and None). Why lists: torch's
    autograd wrapper runs ``fill_defaults`` on every call, quadratic in the schema's length."""
    import dataclasses

    from rlkernels._host import option_values, options_from

    for none_at in (0, 1):  # optional floats None in turn: one value each way per field
        values = []
        for i, f in enumerate(dataclasses.fields(options)):
            values.append({"float": 0.25 + i, "float | None": None if i % 2 == none_at else 1.5 + i, "int": -3 - i,
                           "bool": i % 2 == 0, "str": f"s{i}"}[str(f.type)])
        opt = options(*values)
        packed = option_values(opt)
        assert 1 <= len(packed) <= 4 and all(isinstance(p, list) for p in packed)
        assert options_from(options, packed) == opt


def test_op_options_lists_of_the_wrong_length_are_refused_naming_what_they_hold():
    """A caller of ``torch.ops.rlkernels.*`` who passes option lists by hand gets a ValueError naming the list and
    the fields it must hold, not a StopIteration or a silently shifted option."""
    import rlkernels  # noqa: F401  (registers the ops)

    logp = torch.zeros(3)
    with pytest.raises(ValueError, match=r"str_options must hold 1 values \(estimator\), got 2"):
        torch.ops.rlkernels.kl_penalty(logp, logp, [False], ["k3", "k1"])
    with pytest.raises(ValueError, match=r"float_options must hold 6 values \(clip_low, clip_high, dual_clip, kl_coef"):
        torch.ops.rlkernels.policy_loss(logp[None], logp[None], logp[None], logp[None], None, None, [0.2],
                                        ["token", "k3", "token-mean"])


def test_custom_ops_take_no_option_outside_the_lists():
    """Every op built from an options dataclass takes its non-tensor arguments as the typed lists only (an option
    added as its own schema argument would bring back the per-call cost those lists remove)."""
    import rlkernels  # noqa: F401

    lists = {"float_options", "int_options", "bool_options", "str_options"}
    names = ("kl_penalty", "policy_loss", "value_loss", "logprobs_fwd", "logprobs_bwd", "linear_logprobs",
             "linear_logprobs_backward", "linear_policy_loss", "logits_policy_loss")
    for name in names:
        schema = getattr(torch.ops.rlkernels, name).default._schema
        options = [a.name for a in schema.arguments if "Tensor" not in str(a.type)]
        assert options and set(options) <= lists, (name, options)


def test_aot_table_goes_to_a_file_and_one_line_names_it(tmp_path, monkeypatch):
    """`make test` ends with one summary line; the per-configuration table is in the file it names."""
    import types

    from tests import conftest

    def report(label, arch, spill):
        return types.SimpleNamespace(label=label, arch=arch, aligned=False, registers=64, spill_bytes=spill,
                                     shared_bytes=1024, widest_load_bytes=16)

    fake = types.SimpleNamespace(COMPILED=[report("softmax fwd", 90, 0), report("softmax fwd", 80, 0),
                                           report("linear bwd", 90, 8)])
    monkeypatch.setitem(sys.modules, "rlkernels.testing.aot", fake)
    path = tmp_path / "reports" / "aot.txt"
    monkeypatch.setenv("RLKERNELS_AOT_REPORT", str(path))

    class Reporter:
        def __init__(self):
            self.lines = []

        def write_line(self, line, **kw):
            self.lines.append(line)

        def section(self, title, **kw):
            self.lines.append(title)

    screen = Reporter()
    conftest.pytest_terminal_summary(screen)
    assert screen.lines == [f"3 Triton configurations compiled (sm_80/sm_90), 1 spill; table: {path}"]
    table = path.read_text().splitlines()
    assert len(table) == 5 and table[-1] == "1 of 3 spill"
    assert [line.split()[0] for line in table[1:4]] == ["sm_90", "sm_80", "sm_90"]  # sorted by label, then arch
    assert "8 B spilled" in table[1] and table[1].endswith("linear bwd")


# ---------------------------------------------------------------- the benchmark harness (bench/)


def test_bench_only_accepts_modules_and_public_op_names():
    import re

    import bench.__main__ as cli

    modules = cli.discover()
    assert set(modules) >= {"softmax", "fused_linear", "losses", "advantages", "trainer"}
    assert cli.resolve_only("logprobs,losses", modules) == ["softmax", "losses"]
    assert cli.resolve_only("policy_loss, value_loss,gae,linear_logprobs", modules) == [
        "losses", "advantages", "fused_linear"
    ]
    with pytest.raises(ValueError, match="logprob'"):
        cli.resolve_only("logprob", modules)
    for example in re.findall(r"--only (\S+?)[\]`\s]", cli.__doc__):  # the usage line's own example works
        assert cli.resolve_only(example, modules)


def test_bench_prints_small_rates_with_three_digits():
    from bench.harness import format_rate

    assert format_rate(0.0401, "TFLOP/s") == "40.1 GFLOP/s"
    assert format_rate(0.00031, "GB/s") == "310 kB/s"
    assert format_rate(7.3, "GB/s") == "7.30 GB/s"
    assert format_rate(1.5, "TFLOP/s") == "1.50 TFLOP/s"


def test_bench_adaptive_sampling_counts():
    import time

    from bench.harness import Timing, cpu_samples_ms

    fast = cpu_samples_ms(lambda: None, Timing(min_samples=3, samples=9, budget_s=60.0))
    assert len(fast) == 9  # stops at the sample count before the budget
    slow = cpu_samples_ms(lambda: time.sleep(0.02), Timing(min_samples=3, samples=50, budget_s=0.001))
    assert len(slow) == 3  # the budget is spent: only the minimum


def test_bench_interleaves_providers_on_the_cpu():
    from bench.harness import Timing, interleaved_samples_ms

    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    samples = interleaved_samples_ms(steps, Timing(min_samples=2, samples=4, budget_s=60.0))
    assert {n: len(v) for n, v in samples.items()} == {"a": 4, "b": 4, "c": 4}
    # after one calibration call each, every round samples every provider (k calls each), starting one later
    rounds = [n for i, n in enumerate(calls[3:]) if i == 0 or calls[3 + i - 1] != n]
    assert rounds == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_bench_memory_meter_drops_the_profilers_chatter_only():
    """The CPU peak-memory meter (torch.profiler) prints USDT/STAGE lines and an allocator warning from C++;
    the bench filters exactly those, and other stderr output still reaches the user."""
    code = (
        "import os, torch\n"
        "from bench.harness import measure_peak_bytes\n"
        "x = torch.randn(1000, 1000)\n"
        "older = [x * 5 for _ in range(3)]  # freed inside the meter: the allocator warns it cannot size them\n"
        "def step():\n"
        "    os.write(2, b'a real message\\n')\n"
        "    older.pop()\n"
        "    return x * 2\n"
        "for _ in range(3):\n"
        "    print(measure_peak_bytes(step, torch.device('cpu')))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    peaks = [int(v) for v in result.stdout.split()]
    assert len(peaks) == 3 and all(4_000_000 <= p < 8_000_000 for p in peaks)  # one [1000, 1000] float32
    assert "USDT" not in result.stderr and "STAGE" not in result.stderr and "CPUAllocator" not in result.stderr
    assert result.stderr.count("a real message") == 3


def test_bench_peers_that_cannot_run_get_a_row_saying_why():
    from bench import bench_fused_linear, bench_softmax, harness

    cpu = torch.device("cpu")
    missing = harness.peer("rlkernels_no_such_peer", "no-such-peer", cpu, lambda: pytest.fail("built"))
    assert missing == harness.Unavailable("not installed (pip install no-such-peer)")
    assert harness.peer("torch", "torch", cpu, lambda: pytest.fail("built")).reason.startswith("needs a CUDA")
    for module in (bench_softmax, bench_fused_linear):
        for case in module.cases(cpu, True):
            unavailable = [p for p in case.providers.values() if isinstance(p, harness.Unavailable)]
            assert len(unavailable) >= 2, case.op  # the peers, listed with their reason
    case = harness.Case("op", "shape", 8, 8, "memory", lambda: (), {"peer": missing})
    rows = harness.run_case(case, cpu, harness.Ceilings(1.0, 1.0, "cpu"), quick=True)
    assert rows[0].skipped and "peer" in harness.format_table(rows).splitlines()[-1]
    assert harness.format_table(rows).splitlines()[-1].endswith("not installed (pip install no-such-peer)")


def test_bench_every_module_sets_up_its_cpu_cases():
    import bench.__main__ as cli

    for name in cli.discover():
        module = __import__(f"bench.bench_{name}", fromlist=["cases"])
        cases = module.cases(torch.device("cpu"), True)
        assert cases, name
        for case in cases:
            assert case.bound in ("memory", "compute") and case.bytes_moved > 0 and case.flops > 0, case.op
            assert case.baseline in case.providers, case.op


def test_host_cost_bench_runs_every_op_and_both_schemas(capsys):
    """``python -m bench.cpu_host_cost`` (the losses' fixed cost per call, issue 14) prints a row per loss op, the
    in-process comparison of one argument per option, the option lists and the autograd.Function path for both
    options classes, and policy_loss's op through both autograd paths."""
    from bench import cpu_host_cost

    assert cpu_host_cost.main(["--rounds", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    for op in ("policy_loss", "value_loss", "kl_penalty", "logprobs", "linear_logprobs", "logits_policy_loss",
               "linear_policy_loss"):
        assert any(line.split()[:1] == [op] for line in out.splitlines()), op
    assert "PolicyOptions per option (15 arguments)" in out and "PolicyOptions lists (8 arguments)" in out
    assert "FusedPolicyOptions per option (21 arguments)" in out and "FusedPolicyOptions lists (10 arguments)" in out
    assert "PolicyOptions lists, autograd.Function (8 arguments)" in out
    assert "FusedPolicyOptions lists, autograd.Function (10 arguments)" in out
    assert "custom op's autograd (before)" in out and "autograd.Function (now)" in out


def test_chunk_rounding_bench_separates_the_two_sums():
    """``python -m bench.cpu_chunk_rounding`` (issue 12's trade): with one chunk the bf16 running sum is the float32
    accumulator rounded once (the same numbers), with 16 chunks its error is larger, and the float32 accumulator's
    error does not depend on the chunk count (deterministic seeds: a fixed computation, not a timing)."""
    from bench import cpu_chunk_rounding

    errors = cpu_chunk_rounding._errors((1024, 16, 128), seed=0, chunk_counts=(1, 16))
    assert errors["K= 1 bf16 running sum"] == errors["K= 1 float32 accumulator"]
    # the same float32 sums in another order: a few final bf16 roundings may flip under another BLAS (each moves
    # this 2048-entry error by ~3e-4); the bf16 running sum is ~3x worse (2.7-3.2x over seeds 0-7)
    assert errors["K=16 float32 accumulator"][1] == pytest.approx(errors["K= 1 float32 accumulator"][1], rel=0.02)
    assert errors["K=16 bf16 running sum"][1] > 1.5 * errors["K=16 float32 accumulator"][1]


def _differentiable_calls():
    """Every public op with a gradient, as ``(name, make)``: ``make(x)`` computes a scalar from the leaf ``x``
    ``[2, 3]`` through that op only (the fused losses on-policy: no ratio is clipped, the gradient is not 0)."""
    import rlkernels

    gen = torch.Generator().manual_seed(3)
    ref, old, adv = (-torch.rand(2, 3, generator=gen) for _ in range(3))  # [2, 3] each
    mask = torch.ones(2, 3)  # [2, 3]
    logits = torch.randn(2, 3, 7, generator=gen)  # [2, 3, 7]
    weight = torch.randn(7, 3, generator=gen)  # [V = 7, H = 3]
    labels = torch.randint(0, 7, (2, 3), generator=gen)  # [2, 3]
    return [
        ("kl_penalty", lambda x: rlkernels.kl_penalty(x, ref).sum()),
        ("policy_loss", lambda x: rlkernels.policy_loss(x, old, adv, mask)[0]),
        ("value_loss", lambda x: rlkernels.value_loss(x, old, adv, mask, clip=0.2)[0]),
        ("logprobs", lambda x: rlkernels.logprobs(logits * x[..., None], labels).sum()),
        ("linear_logprobs", lambda x: rlkernels.linear_logprobs(x, weight, labels[:, 0]).sum()),
        ("linear_policy_loss", lambda x: rlkernels.linear_policy_loss(x.view(2, 1, 3), weight, labels[:, :1],
                                                                       None, adv[:, :1], mask[:, :1])[0]),
        ("logits_policy_loss", lambda x: rlkernels.logits_policy_loss(logits * x[..., None], labels, None, adv,
                                                                       mask)[0]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_each_differentiable_op_passes_opcheck_with_gradients(case, monkeypatch):
    """The custom op behind each differentiable public function carries its autograd formula itself, so
    ``torch.library.opcheck`` passes every default check with inputs that need gradients, including
    test_aot_dispatch_dynamic, which differentiates the op as traced by AOTAutograd (it raised "no autograd formula
    was registered" while only the public functions' autograd.Functions knew the gradient)."""
    from rlkernels import _host

    name, make = _differentiable_calls()[case]
    calls = []  # (op, args) of every custom op the public function ran, in order
    run = _host.call
    monkeypatch.setattr(_host, "call", lambda op, *args: calls.append((op, args)) or run(op, *args))
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(5)).neg().requires_grad_()  # [2, 3]
    make(x)
    op, args = calls[0]  # the forward op
    args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    assert any(isinstance(a, torch.Tensor) and a.requires_grad for a in args), name
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", range(7))
def test_double_backward_raises_naming_the_op(backend, case):
    # The backwards scale gradients formed (or saved) in the forward, constants to autograd: kl_penalty's second
    # derivative came out as silent zeros, the others raised torch's internal "no autograd formula" message.
    # create_graph=True now raises naming the op; a plain backward still works.
    from tests.helpers import forced_backend

    name, make = _differentiable_calls()[case]
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(4)).neg().requires_grad_()  # [2, 3]
    with forced_backend(backend):
        (g,) = torch.autograd.grad(make(x), x)
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        with pytest.raises(RuntimeError, match=f"rlkernels.{name} does not support double backward"):
            torch.autograd.grad(make(x), x, create_graph=True)


@pytest.mark.parametrize("case", range(7))
def test_torch_func_grad_raises_naming_the_op_and_the_way_out(case):
    """torch.func.grad differentiates with create_graph semantics even for a first derivative, so the ops refuse it
    as a double backward; the message says so and names what gives first derivatives (it spoke only of
    create_graph=True, which a torch.func user never passed)."""
    name, make = _differentiable_calls()[case]
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(6)).neg()  # [2, 3]
    with pytest.raises(RuntimeError, match=rf"rlkernels\.{name} does not support double backward.*torch\.func.*"
                                           r"torch\.autograd\.grad"):
        torch.func.grad(make)(x)
    _, vjp = torch.func.vjp(make, x)  # its backward runs outside the transform, still with create_graph
    with pytest.raises(RuntimeError, match=rf"rlkernels\.{name} does not support double backward.*torch\.func"):
        vjp(torch.tensor(1.0))


@pytest.mark.parametrize("case", range(7))
def test_forward_mode_ad_raises_naming_the_op(case):
    """Forward-mode AD (dual tensors, torch.func.jvp) has no formula in the ops: it is refused in the name of the op
    the user called (torch's own message named only "custom autograd.Function"), and reverse mode still works."""
    import torch.autograd.forward_ad as fwad

    name, make = _differentiable_calls()[case]
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(7)).neg()  # [2, 3]
    with pytest.raises(NotImplementedError, match=rf"rlkernels\.{name} does not support forward-mode AD"):
        with fwad.dual_level():
            make(fwad.make_dual(x, torch.ones_like(x)))
    with pytest.raises(NotImplementedError, match=rf"rlkernels\.{name} does not support forward-mode AD"):
        torch.func.jvp(make, (x,), (torch.ones_like(x),))
    (g,) = torch.autograd.grad(make(x.requires_grad_()), x)
    assert torch.isfinite(g).all()


def _advantage_calls():
    """The public ops without a gradient, as ``(name, call)`` on small CPU inputs."""
    import rlkernels

    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)  # [2, 6] each
    mask = torch.rand(2, 6, generator=gen) > 0.2  # [2, 6]
    scores = torch.randn(8, generator=gen)  # [8]: two groups of 4
    steps, ends = torch.randn(4, 2, generator=gen), torch.tensor([[1, 4]] * 4)  # [4, 2] step rewards, their ends
    return [
        ("gae", lambda: rlkernels.gae(rewards, values, mask, gamma=0.9, lam=0.8)),
        ("group_advantages", lambda: rlkernels.group_advantages(scores, 4)),
        ("masked_whiten", lambda: rlkernels.masked_whiten(rewards, mask)),
        ("process_advantages", lambda: rlkernels.process_advantages(steps, ends, 6, group_size=2)),
    ]


class _EveryOpThroughTheDispatcher(TorchDispatchMode):
    """Runs every operator as called: under it (a dispatch mode), rlkernels' ops are called as custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _custom_op_events(run) -> set[str]:
    """The rlkernels custom ops that reached the dispatcher while ``run()`` ran (the csrc extension's C++ kernels,
    ``rlkernels_csrc::*``, are operators of their own and always do)."""
    with torch.autograd.profiler.profile() as prof:
        run()
    return {e.name for e in prof.function_events if e.name.startswith("rlkernels::")}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", range(7))
def test_eager_calls_skip_the_dispatcher_with_the_same_gradients(backend, case):
    """An eager fwd+bwd runs each op's body directly (no rlkernels custom op reaches the dispatcher: the profiler
    records none; through torch.library's autograd policy_loss's op cost ~75 us more on the CPU), and gives what
    the custom ops give when something makes the call go through them (a dispatch mode), bit for bit."""
    from tests.helpers import forced_backend

    name, make = _differentiable_calls()[case]
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(6)).neg().requires_grad_()  # [2, 3]
    with forced_backend(backend):
        assert _custom_op_events(lambda: make(x).backward()) == set()
        direct = torch.autograd.grad(make(x), x)[0]
        with _EveryOpThroughTheDispatcher():
            assert _custom_op_events(lambda: make(x)), name
            through_op = torch.autograd.grad(make(x), x)[0]
    torch.testing.assert_close(direct, through_op, rtol=0, atol=0)


@pytest.mark.parametrize("case", range(4))
def test_eager_advantage_calls_skip_the_dispatcher(case):
    """As for the differentiable ops: the body runs directly, with the custom op's results."""
    name, call = _advantage_calls()[case]
    direct = []
    assert _custom_op_events(lambda: direct.append(call())) == set()
    through_op = []
    with _EveryOpThroughTheDispatcher():
        assert _custom_op_events(lambda: through_op.append(call())) == {f"rlkernels::{name}"}
    direct, through_op = direct[0], through_op[0]
    for a, b in zip(direct if isinstance(direct, tuple) else (direct,),
                    through_op if isinstance(through_op, tuple) else (through_op,)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", range(7))
def test_ops_compile_whole_when_no_input_needs_a_gradient(case):
    """torch.compile(fullgraph=True) of each op on inputs that need no gradient: dynamo then calls the op's
    autograd.Function forward as plain code, passing ``ctx`` or not by forward's parameter count (the case that
    broke ``*args`` forwards)."""
    name, make = _differentiable_calls()[case]
    x = torch.rand(2, 3, generator=torch.Generator().manual_seed(7)).neg()  # [2, 3], no gradient
    torch._dynamo.reset()
    compiled = torch.compile(make, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), make(x))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's per-sample fallback for a custom op
@pytest.mark.parametrize("case", range(7))
def test_vmap_over_a_batch_of_inputs_equals_the_per_sample_loop(case):
    """torch.vmap over a batch of inputs gives each sample's result (the ops' autograd.Functions let vmap reach the
    custom op, which torch runs once per sample): what vmap of the ops gave before their autograd moved off
    torch.library."""
    name, make = _differentiable_calls()[case]
    xs = torch.rand(3, 2, 3, generator=torch.Generator().manual_seed(8)).neg()  # [3, 2, 3]: three samples
    torch.testing.assert_close(torch.vmap(make)(xs), torch.stack([make(x) for x in xs]), rtol=0, atol=0)


def test_ops_on_meta_tensors_give_meta_results_of_the_right_shapes():
    """Meta tensors (shape inference, deferred init) reach each op's fake implementation, not its body."""
    import rlkernels

    B, T, H, V = 2, 3, 4, 11
    meta = dict(device="meta")
    logp = torch.empty(B, T, **meta, requires_grad=True)  # [B, T]
    mask = torch.ones(B, T, dtype=torch.bool, **meta)  # [B, T]
    labels = torch.zeros(B, T, dtype=torch.long, **meta)  # [B, T]
    loss, metrics = rlkernels.policy_loss(logp, logp.detach(), logp.detach(), mask)
    assert loss.is_meta and loss.shape == () and all(v.is_meta for v in metrics.values())
    logp_v, ent = rlkernels.logprobs(torch.empty(B, T, V, **meta), labels, return_entropy=True)
    assert logp_v.is_meta and logp_v.shape == ent.shape == (B, T)
    out = rlkernels.linear_logprobs(torch.empty(B * T, H, **meta), torch.empty(V, H, **meta), labels.view(-1))
    assert out.is_meta and out.shape == (B * T,)
    adv, ret = rlkernels.gae(logp.detach(), logp.detach(), mask, gamma=0.9, lam=0.8)
    assert adv.is_meta and ret.is_meta and adv.shape == (B, T)


@pytest.mark.parametrize("value,disabled", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                            ("0", False), ("false", False), ("Off", False), ("", False)])
def test_no_ext_reads_the_usual_boolean_spellings(value, disabled, monkeypatch):
    """RLKERNELS_NO_EXT=true (or yes/on, any case) skips the extension like =1: it used to be read as "not 1", and
    the extension was built and used all the same; 0/false/no/off use it."""
    from rlkernels import _extension

    built = []
    monkeypatch.setattr(_extension, "_build", lambda: built.append(True))
    monkeypatch.setattr(_extension, "_state", {"tried": False, "ops": None, "error": None, "warned": True,
                                               "announced": False})
    monkeypatch.setenv("RLKERNELS_NO_EXT", value)
    _extension.load()
    assert bool(built) is not disabled
    if disabled:
        assert "RLKERNELS_NO_EXT" in _extension.error()


@pytest.mark.parametrize("value", ["2", "maybe", "disable", "-1"])
def test_no_ext_refuses_other_values_naming_the_variable(value, monkeypatch):
    from rlkernels import _extension

    monkeypatch.setattr(_extension, "_build", lambda: pytest.fail("built with an unreadable RLKERNELS_NO_EXT"))
    monkeypatch.setattr(_extension, "_state", {"tried": False, "ops": None, "error": None, "warned": True,
                                               "announced": False})
    monkeypatch.setenv("RLKERNELS_NO_EXT", value)
    with pytest.raises(ValueError, match="RLKERNELS_NO_EXT"):
        _extension.load()
    assert not _extension._state["tried"]  # nothing cached: the next call reads the variable again


def test_a_build_lock_left_by_a_dead_build_is_removed(tmp_path, monkeypatch):
    """torch's cpp_extension waits for its build lock (``<build dir>/lock``) to disappear, forever: a build killed
    midway (SIGKILL, the OOM killer) left it behind and every later process printed the build notice and hung.
    Under the package's own flock a lock found there is stale, and is removed before torch looks."""
    from torch.utils import cpp_extension

    from rlkernels import _extension

    monkeypatch.setenv("RLKERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(_extension, "_prebuilt", lambda: None)
    stale = os.path.join(_extension.build_directory(), "lock")
    open(stale, "w").close()
    seen = []

    def load(**kwargs):  # what torch does first: wait while the lock exists (here: record instead of hanging)
        seen.append(os.path.exists(os.path.join(kwargs["build_directory"], "lock")))

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setitem(_extension._state, "announced", True)
    _extension._build()
    assert seen == [False]


def test_cuda_kernels_are_built_only_with_a_target_and_a_toolkit(tmp_path, monkeypatch):
    """A CUDA torch on a machine with no GPU (and no TORCH_CUDA_ARCH_LIST) builds the CPU kernels alone (torch's
    build would otherwise fail choosing a target, taking them down too; seen with torch 2.11+cu130 here), and so
    does a toolkit without headers; with a target and a whole toolkit the CUDA kernels are built."""
    from torch.utils import cpp_extension

    from rlkernels import _extension

    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("RLKERNELS_CACHE", str(tmp_path / "cache"))

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU build" in _extension.cuda_build_blocker() and not _extension.cuda_build_possible()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "TORCH_CUDA_ARCH_LIST" in _extension.cuda_build_blocker()
    assert _extension.build_directory().endswith("_cpu")  # the CPU-only library has a cache folder of its own
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert "cuda_runtime.h" in _extension.cuda_build_blocker()  # nvcc but no headers: no CUDA kernels
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    assert _extension.cuda_build_blocker() is None and _extension.cuda_build_possible()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a visible GPU is a target too
    assert _extension.cuda_build_possible()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(_extension.shutil, "which", lambda name: None)
    assert "nvcc" in _extension.cuda_build_blocker()
