"""Host-side helpers shared by every op family: dtype names, strides, masks; how an op's options cross
``torch.library`` (``op_schema``, ``option_values``, ``options_from``); how an op is registered and called
(``custom_op``, ``call``: eager calls run the body without the dispatcher) and given its gradient
(``autograd_function``).

(Validation lives in ``rlkernels._checks``, backend choice in ``rlkernels._backend``.)
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers  # Function.apply's step

# Triton's names for the tensor dtypes the kernels load (ahead-of-time signatures use them).
TRITON_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with stride 1 along its last dimension (a copy only when it has none): kernels then read
    contiguous runs (vector loads, ``cp.async`` staging)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def mask_u8(mask: torch.Tensor) -> torch.Tensor:
    """A mask as uint8 0/1 for a kernel: a bool mask is reinterpreted (no copy), a numeric one is
    compared with 0 (any nonzero value counts as 1)."""
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return (mask != 0).view(torch.uint8)


# ---------------------------------------------------------------- an op's options across torch.library
# A custom op takes its options dataclass's fields as at most four typed lists, one per kind of field, in this order
# (a kind without fields has no list): one schema argument per field made every call pay torch's
# ``torch._library.utils.fill_defaults``, which the autograd wrapper of an op with a ``setup_context`` runs on each
# call and which is quadratic in the schema's length (it reads ``schema.arguments``, rebuilt at every access, once
# per argument): measured alone (timeit, 2000 calls, torch 2.13, CPU) 95 us for policy_loss's 15 arguments and
# 215 us for linear_policy_loss's 23, against 21 us and 43 us for the 8 and 12 they have with the lists. A trivial
# autograd op's fwd+bwd, both schemas round-robin in one process (``python -m bench.cpu_host_cost``,
# bench/results/cpu-host-cost-2026-11-27.txt): 367 -> 288 us with policy_loss's options, 498 -> 311 us with
# linear_policy_loss's (medians of 9, one thread). (Upstream, pytorch/pytorch PR 195110, open since 2026-08, makes
# fill_defaults linear.) Since the ops' autograd moved to torch.autograd.Function (:func:`autograd_function`, below)
# an eager call no longer runs fill_defaults; calls through the dispatcher (compiled graphs, dispatch modes) still
# parse the schema, and a short one is also what a reader of ``torch.ops.rlkernels.*`` sees.
_OPTION_LISTS = (("float", "float?[] float_options"), ("int", "int[] int_options"), ("bool", "bool[] bool_options"),
                 ("str", "str[] str_options"))
# the list that carries a field, by the field's annotation (a string under ``from __future__ import annotations``)
_LIST_OF_TYPE = {"float": 0, "float | None": 0, "int": 1, "bool": 2, "str": 3}


def _field_lists(options: type) -> tuple[int, ...]:
    """Per field of the options dataclass ``options``, in field order: the index in ``_OPTION_LISTS`` of its list."""
    try:
        return tuple(_LIST_OF_TYPE[str(f.type)] for f in dataclasses.fields(options))
    except KeyError as e:
        raise TypeError(f"{options.__name__}: an op option must be annotated float, float | None, int, bool or str, "
                        f"got {e.args[0]}") from None


def op_schema(tensors: str, options: type, returns: str) -> str:
    """A ``torch.library.custom_op`` schema: the op's tensor arguments (``"Tensor x, Tensor? y"``), then the fields
    of the frozen dataclass ``options`` as typed lists (``float?[] float_options, int[] int_options,
    bool[] bool_options, str[] str_options``, each only where ``options`` has a field of that kind; see
    ``_OPTION_LISTS`` for why lists): the op receives them as ``*option_values(opt)`` and rebuilds the dataclass
    with :func:`options_from`; ``returns`` as in a schema."""
    kinds = sorted(set(_field_lists(options)))
    return f"({tensors}, {', '.join(_OPTION_LISTS[k][1] for k in kinds)}) -> {returns}"


def option_values(opt) -> tuple[list, ...]:
    """The fields of the frozen options dataclass ``opt`` as its custom op's trailing arguments (see
    :func:`op_schema`): one list per kind of field present, each holding that kind's fields in field order."""
    packed = ([], [], [], [])
    for f in dataclasses.fields(opt):
        packed[_LIST_OF_TYPE[str(f.type)]].append(getattr(opt, f.name))
    return tuple(values for values in packed if values)  # a kind is present or absent for the class, not the call


def _unpack_layout(options: type) -> tuple:
    """For the options dataclass ``options``, computed once: (per field, the position of its list among the op's
    option arguments; the ``_OPTION_LISTS`` indices present, in order; the field names each list holds). Read by
    :func:`options_from` in the op's body, which runs eagerly or opaque to dynamo, never traced."""
    layout = _UNPACK_LAYOUTS.get(options)
    if layout is None:
        lists = _field_lists(options)
        names = [f.name for f in dataclasses.fields(options)]
        kinds = sorted(set(lists))
        held = [[n for n, i in zip(names, lists) if i == k] for k in kinds]
        layout = _UNPACK_LAYOUTS[options] = ([kinds.index(i) for i in lists], kinds, held)
    return layout


_UNPACK_LAYOUTS: dict[type, tuple] = {}


def options_from(options: type, packed: tuple) -> object:
    """The dataclass ``options`` rebuilt from an op's trailing list arguments ``packed`` (made by
    :func:`option_values`). A direct caller of ``torch.ops.rlkernels.*`` that passes lists of the wrong length
    gets a ValueError naming the fields each list must hold."""
    slots, kinds, held = _unpack_layout(options)
    for k, values, want in zip(kinds, packed, held):  # (the schema fixes how many lists arrive)
        if len(values) != len(want):
            raise ValueError(f"{_OPTION_LISTS[k][1].split()[1]} must hold {len(want)} values "
                             f"({', '.join(want)}), got {len(values)}")
    iters = [iter(values) for values in packed]
    return options(*[next(iters[j]) for j in slots])


def field_values(opt) -> tuple:
    """The fields of the frozen options dataclass ``opt``, in field order. Not ``dataclasses.astuple``, which
    deep-copies every value: torch 2.11's dynamo cannot trace ``copy.deepcopy``, so every
    ``torch.compile(fullgraph=True)`` of an op failed there."""
    return tuple(getattr(opt, f.name) for f in dataclasses.fields(opt))


def option_dict(opt) -> dict:
    """The fields of the frozen options dataclass ``opt`` by name (``dataclasses.asdict`` without its deep copy,
    for the reason given at :func:`field_values`)."""
    return {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}


def label_logp(z_y, shift, s, temperature: float = 1.0):
    """``log p_y = (z_y - shift)/T - log s`` [N], each row's label log-probability from its label logit ``z_y``,
    the shift its exponentials were taken against (the row max) and ``s = Σ exp((z - shift)/T)``, all [N] in the
    compute dtype (the logits' float32, or float64): formed in float64 and rounded once to that dtype, as an
    accurate ``log_softmax`` would give it. In float32 its roundings (the difference, ``log s``, the
    subtraction) leave up to ~1 ulp of ``log p`` (about 1e-6 at ``|log p|`` near 10), where the float32 logits
    alone leave about half that; a loss that amplifies the error of ``log p`` carries it into every gradient (the
    k3 KL's ``exp(ref - log p)``: with the float32 formation the torch backend's ``linear_policy_loss`` gradients
    were 4.5x eager's error on an H200, tests/test_fused_policy.py). Every backend's host-side ``log p`` comes
    from here; the forward and a backward that needs it again get the same bits."""
    return ((z_y.double() - shift.double()) / temperature - s.double().log()).to(s.dtype)


def lse_merge(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor | None = None):
    """Merges online log-sum-exp partials of the same rows, taken over disjoint chunks of their columns (vocabulary
    chunks, Triton vocabulary splits), along dim 0: ``(m_all [N], s_all [N], u_all [N] or None)``.

    Partial ``k`` holds, for the columns ``z`` of its chunk, ``m[k]`` (their max, or any finite floor where the chunk
    saw nothing finite: then ``s[k] = u[k] = 0`` and no ``0 · inf`` arises), ``s[k] = Σ exp(z - m[k])`` and,
    optionally, ``u[k] = Σ exp(z - m[k]) (z - m[k])`` (the entropy's numerator). Each is re-centred on the row max
    ``m_all``: ``s_all = Σ_k e^(m[k] - m_all) s[k]``, ``u_all = Σ_k e^(m[k] - m_all) (u[k] + s[k] (m[k] - m_all))``.
    The row max and ``s_all`` stay apart (``log p = (z - m_all) - log s_all``): one rounded ``lse`` would carry
    ``ulp(m_all)`` into every ``log p``. ``m``, ``s``, ``u``: ``[S, N]``."""
    m_all = m.amax(0)  # [N]
    scale = torch.exp(m - m_all)  # [S, N]
    s_all = (s * scale).sum(0)  # [N]
    u_all = None if u is None else (scale * (u + s * (m - m_all))).sum(0)  # [N]
    return m_all, s_all, u_all


def refuse_double_backward(op: str) -> None:
    """Raise in an op's backward when it runs with ``create_graph=True`` (grad mode on): the backward scales
    gradients formed in the forward (or saved there), which are constants to autograd, so a second derivative
    through them would come out as silent zeros. Called first in every registered backward."""
    import torch

    if torch.is_grad_enabled():
        raise RuntimeError(f"rlkernels.{op} does not support double backward (create_graph=True; torch.func's grad, "
                           "vjp and jacrev differentiate so even for a first derivative): its backward uses "
                           "gradients formed as constants; take first derivatives with torch.autograd.grad or "
                           ".backward(), higher ones with rlkernels.reference's eager formulas")


# ---------------------------------------------------------------- calling an op: eager calls skip the dispatcher
# Every op is a torch.library custom op, so that torch.compile keeps it one opaque node with a fake implementation
# (DESIGN: no graph break). In eager mode nothing needs the dispatcher, and it costs: measured round-robin in one
# process (`python -m bench.cpu_host_cost`, torch 2.13 CPU, one thread, medians of 9;
# bench/results/cpu-host-cost-2026-11-27-function.txt), a trivial op's fwd+bwd took 120 us through the custom op
# with torch.library's autograd and 81 us through a torch.autograd.Function calling the same body; policy_loss's op
# 529 us and 454 us. So every op's autograd is a torch.autograd.Function (:func:`autograd_function`; DESIGN's
# layering: launcher -> Function -> public function), and :func:`call` runs an op's body directly unless something
# must see the op itself.
_BODIES: dict = {}  # custom op (and its OpOverload) -> the Python function registered as its implementation
_OVERLOADS: dict = {}  # custom op -> its OpOverload (torch.ops.<ns>.<name>.default), which dynamo can trace
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def custom_op(name: str, schema: str | None = None):
    """Decorator: ``torch.library.custom_op(name, mutates_args=(), schema=schema)`` (``schema=None``: inferred from
    the type hints) that also records the body for :func:`call`."""

    def register(body):
        op = torch.library.custom_op(name, body, mutates_args=(), schema=schema)
        namespace, short = name.split("::")
        overload = _OVERLOADS[op] = getattr(getattr(torch.ops, namespace), short).default
        _BODIES[op] = _BODIES[overload] = body
        return op

    return register


def needs_dispatcher(args) -> bool:
    """Whether a call with ``args`` must go through the custom op rather than its body: while torch.compile traces
    (the op is the graph's node), under a dispatch mode (fake tensors, ``rlkernels.testing.count_launches``), or
    when a tensor argument is a subclass, a meta tensor or a torch.func wrapper (each served by its own dispatch
    key: the op's fake implementation for meta)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return any(isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS or a.is_meta
                                                or torch._C._functorch.is_functorch_wrapped_tensor(a))
               for a in args)


def call(op, *args):
    """Run the custom op ``op`` (made by :func:`custom_op`, or its OpOverload) on ``args``: its body directly in
    eager mode, the op where :func:`needs_dispatcher`. Either way the body runs with autograd off, as below the
    dispatcher's Autograd key: gradients are the business of the op's :func:`autograd_function`."""
    if needs_dispatcher(args):
        return op(*args)
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _BODIES[op](*args)
    return _BODIES[op](*args)


def autograd_function(name: str, op, setup_context, backward) -> type:
    """A ``torch.autograd.Function`` named ``name`` whose forward is :func:`call` of ``op``, with the given
    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grad_outputs)``. The backward returns the gradients
    of the op's leading tensor arguments, as far as any is given (or None for no gradient at all); the arguments
    after them (option lists) get None here. Its ``apply`` takes the op's arguments and returns the op's outputs;
    torch.compile traces it (forward, setup and backward) down to the custom ops it calls. The same setup and
    backward are registered as the op's own autograd formula (``torch.library.register_autograd``)."""
    overload = _OVERLOADS[op]  # not the CustomOpDef: dynamo cannot wrap one held by a closure

    def forward(*args):
        return call(overload, *args)

    # Dynamo traces a Function whose inputs need no gradient by calling forward with or without ``ctx`` according to
    # forward's parameter count (torch 2.11-2.13, variables/misc.py call_apply): ``*args`` would get ``ctx``. The
    # schema's argument names give the count.
    forward.__signature__ = inspect.Signature([inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_ONLY)
                                               for a in overload._schema.arguments])

    n_inputs = len(overload._schema.arguments)

    def backward_every_input(ctx, *grad_outputs):
        grads = backward(ctx, *grad_outputs) or ()
        return tuple(grads) + (None,) * (n_inputs - len(grads))

    # the op itself differentiable too, with the same formulas (torch.ops.rlkernels.* called directly, or traced by
    # torch.library.opcheck's test_aot_dispatch_dynamic); the Function stays the eager path (its apply is cheaper)
    torch.library.register_autograd(overload._schema.name, backward_every_input, setup_context=setup_context)

    public = overload._schema.name.split("::")[1].removesuffix("_fwd")  # the public function's name

    def apply(cls, *args):
        # torch.autograd.Function.apply binds the arguments to forward's signature with inspect on every call (for
        # the defaults of a forward that has any; 20 us of the 184 us of policy_loss's fwd+bwd host path on the CPU
        # machine, kernels stubbed). Every argument is given here, positionally: the base apply takes them as they
        # are. Traced by torch.compile, or inside a torch.func transform, Function.apply's own path.
        try:
            if len(args) != n_inputs or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
                return torch.autograd.Function.apply.__func__(cls, *args)
            return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))  # the C base's apply
        except NotImplementedError as e:
            # forward-mode AD (dual tensors, torch.func.jvp) calls the Function's jvp, which the ops do not have:
            # torch's message ("You must implement the jvp function for custom autograd.Function") names no op. Not
            # a jvp that raises: dynamo refuses to trace a Function that defines one
            if "jvp" not in str(e):
                raise
            raise NotImplementedError(f"rlkernels.{public} does not support forward-mode AD (torch.autograd."
                                      "forward_ad, torch.func.jvp, jacfwd, hessian); use reverse mode (.backward(), "
                                      "torch.autograd.grad), or rlkernels.reference's eager formulas") from e

    # generate_vmap_rule: under torch.vmap forward sees batched tensors, so `call` goes through the custom op, whose
    # fallback runs the body per sample (as vmap of the op did when torch.library carried its autograd)
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "setup_context": staticmethod(setup_context),
                                                   "backward": staticmethod(backward_every_input),
                                                   "generate_vmap_rule": True, "apply": classmethod(apply)})


def float32_outputs(out):
    """What ``logprobs`` and ``linear_logprobs`` return, ``out`` (``logp`` or ``(logp, entropy)``, [...] each) in
    float32 whatever the input dtype: float64 inputs compute in float64 and are rounded once here (autograd carries
    the cast, so their gradients stay float64); a no-op for float32."""
    return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
