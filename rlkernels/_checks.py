"""Input validation shared by the public functions: clear errors that name the argument.

Every check here is a host-side look at shapes, dtypes and devices: none syncs the GPU.
"""
from __future__ import annotations

import math
import numbers
import sys

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def process_group(group, name: str = "process_group"):
    """``group`` when it is a ``torch.distributed.ProcessGroup`` (the caller handles None); else TypeError naming it
    (a rank, a backend name or ``"world"`` is not a group: pass ``torch.distributed.group.WORLD``)."""
    dist = torch.distributed
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group


def floating(x, name: str) -> torch.Tensor:
    tensor(x, name)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    return x


def integer(x, name: str) -> torch.Tensor:
    tensor(x, name)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    return x


def mask(x, name: str = "mask") -> torch.Tensor:
    tensor(x, name)
    if x.dtype != torch.bool and not x.dtype.is_floating_point and x.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"{name} must be a bool, floating-point, int8/16/32/64 or uint8 tensor holding 0/1, "
                        f"got {x.dtype}")
    # a numeric mask must hold 0 and 1 only (a weight such as 0.5 would be read as 1 by some kernels and as 0.5 by
    # others): checked where it costs no device sync, and not while a trace runs (_tracing)
    if x.dtype != torch.bool and x.device.type == "cpu" and x.numel() and not _tracing() \
            and not bool(((x == 0) | (x == 1)).all()):
        bad = x[(x != 0) & (x != 1)]  # NaN included
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool), found {bad[0].item()}")
    return x


def mask_as_bool(x: torch.Tensor) -> torch.Tensor:
    """A validated mask as bool, every nonzero entry counting as 1 (the kernels' rule): values other than 0 and 1,
    which :func:`mask` refuses where it can look (on the CPU, not while tracing), then mean the same on every
    backend rather than a weight on some and 1 on others."""
    return x if x.dtype == torch.bool else x != 0


def _tracing() -> bool:
    """Whether the call is being traced rather than run: ``torch.compile``, or a Python dispatch mode (fake tensors,
    rlkernels.testing's launch counter, which models a CUDA run, where a CPU-only check issues nothing). A check that
    reads tensor values is skipped then: its branch would depend on data."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")


def same_device(*named: tuple[torch.Tensor | None, str]) -> torch.device:
    present = [(tensor(t, n), n) for t, n in named if t is not None]  # a non-tensor: TypeError naming it, not later
    first, first_name = present[0]
    for t, n in present[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}: all tensors must share one device")
    return first.device


def positive(value: float, name: str) -> float:
    """A finite number > 0 (NaN, inf and non-numbers are rejected naming ``name``)."""
    value = finite(value, name)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


_FLOAT32_MAX = torch.finfo(torch.float32).max
# the kernels multiply by 1 / value in float32: below this it overflows to inf
_SMALLEST_INVERTIBLE = 1.0 / _FLOAT32_MAX


def invertible(value, name: str) -> float:
    """A finite number > 0 with a finite float32 reciprocal (the kernels multiply by ``1 / value``)."""
    value = positive(value, name)
    if value < _SMALLEST_INVERTIBLE:
        raise ValueError(f"{name} must be >= {_SMALLEST_INVERTIBLE:.3g} (1 / {name} overflows float32), got {value}")
    return value


def temperature(value) -> float:
    """The softmax temperature (every backend scales the logits by ``1 / temperature``): see :func:`invertible`."""
    return invertible(value, "temperature")


def index(value, name: str) -> int:
    """An integer option such as ``ignore_index``: a Python, NumPy or one-element integer tensor value; a float
    (even 1.0), a bool or a string is refused rather than truncated."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point \
            and not value.dtype.is_complex and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not -(2**63) <= int(value) < 2**63:  # what an op's int64 argument holds
        raise ValueError(f"{name} must fit in 64 bits, got {int(value)!r:.40}")
    return int(value)


def _traced_numpy(value) -> bool:
    """Whether ``value`` is a NumPy scalar as torch.compile traces it: Dynamo turns NumPy values into 0-d arrays,
    which are no ``numbers.Real`` there, though ``float`` of them traces."""
    np = sys.modules.get("numpy")  # not imported: no NumPy value can reach here
    return np is not None and torch.compiler.is_compiling() and isinstance(value, np.ndarray) and value.ndim == 0


def _host_item(value: torch.Tensor, name: str, kind: str):
    """A one-element tensor option's value, read on the host. While torch.compile traces, the value is unknown (an
    unbacked symbol that the range checks cannot compare, and no op option can hold): refused naming the option, so
    fullgraph=True fails with that message; without fullgraph Dynamo then runs the frame eagerly, which reads it."""
    if torch.compiler.is_compiling():
        raise TypeError(f"{name} must be a Python {kind} inside torch.compile, got a tensor (its value is not known "
                        f"while tracing): pass {name}.item() from outside the compiled function")
    return value.item()


def flag(value, name: str) -> bool:
    """A boolean option (``return_entropy``, ``shift_mean``): ``True``/``False`` (NumPy's too) or 0/1; anything
    else, e.g. the string ``"no"``, is refused rather than read as true."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        value = bool(_host_item(value, name, "bool"))
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value in (0, 1):
        value = bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):  # not a numbers.Integral
        value = bool(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def choice(value: str, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def rank(x: torch.Tensor, name: str, dims: int) -> torch.Tensor:
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    return x


def finite(value, name: str) -> float:
    """A real, finite Python number (coefficients: ``kl_coef``, ``entropy_coef``...)."""
    # any real number: Python and NumPy scalars, and one-element tensors (read once on the host)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
        value = _host_item(value, name, "number")
    if _traced_numpy(value):  # e.g. an np.float64 coefficient, which float() of traces as a constant
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:  # an integer (or fraction) beyond float range
        as_float = math.inf
    # comparisons rather than math.isfinite: torch.compile traces a number that changed between calls as a symbol,
    # on which comparisons trace (each adds a guard) and math.isfinite does not; NaN fails both of them
    if not -math.inf < as_float < math.inf:
        raise ValueError(f"{name} must be finite, got {value!r:.40}")
    if abs(as_float) > _FLOAT32_MAX:  # the kernels compute in float32: it would be inf there (then 0·inf = NaN)
        raise ValueError(f"{name} must be finite in float32, the kernels' precision (|{name}| <= {_FLOAT32_MAX:.3g}), "
                         f"got {value!r:.40}")
    return as_float


def non_negative(value, name: str) -> float:
    """A finite number >= 0 (``eps``, clip ranges); NaN and inf are rejected."""
    value = finite(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def unit_interval(value, name: str) -> float:
    """A finite number in [0, 1] (``gamma``, ``lam``)."""
    value = finite(value, name)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def labels(x, V: int, ignore_index: int | None, name: str = "labels") -> torch.Tensor:
    """Integer ``labels`` of any width as int64; on the CPU a label outside ``[0, V)`` that is not
    ``ignore_index`` raises (checking costs no device sync there); on a GPU the kernels give NaN instead.
    ``ignore_index=None``: no value is exempt (token ids fed to an embedding).

    The comparison runs in int64, so narrow dtypes (uint8, int8, int16) are checked against the true ``V``.
    """
    integer(x, name)
    x = x.long()  # no copy for int64; kernels and gather read int64
    if x.device.type == "cpu" and x.numel() > 0:
        bad = (x < 0) | (x >= V)
        if ignore_index is not None:
            bad &= x != ignore_index
        if bool(bad.any()):
            allowed = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
            raise ValueError(f"{name} must lie in [0, {V}){allowed}; found {int(x[bad][0])}")
    return x


def lm_head(hidden: torch.Tensor, weight, bias) -> None:
    """An LM head's ``weight`` ``[V, H]`` (V >= 1, H = ``hidden.shape[-1]``) and optional ``bias`` ``[V]``, both
    floating and of ``hidden``'s dtype (``hidden`` itself checked by the caller); each error names its argument."""
    floating(weight, "weight")
    rank(weight, "weight", 2)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got weight of shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if weight.shape[1] == 0:
        raise ValueError("hidden and weight must have a hidden size H >= 1, got H = 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        floating(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have the dtype of hidden ({hidden.dtype}), got {bias.dtype}")
