"""rlkernels: fused kernels for the per-token quantities of PPO/GRPO.

Public functions (see README's table and ``rlkernels.reference`` for their exact meaning):
``logprobs``, ``linear_logprobs``, ``kl_penalty``, ``policy_loss``, ``value_loss``,
``gae``, ``group_advantages``, ``masked_whiten``.

Importing the package is cheap: each op family loads on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "logprobs": "rlkernels.softmax",
    "linear_logprobs": "rlkernels.fused_linear",
    "kl_penalty": "rlkernels.losses",
    "policy_loss": "rlkernels.losses",
    "value_loss": "rlkernels.losses",
    "gae": "rlkernels.advantages",
    "group_advantages": "rlkernels.advantages",
    "masked_whiten": "rlkernels.advantages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlkernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
