"""rlkernels: fused kernels for the per-token quantities of PPO/GRPO.

Public functions (see README's table and ``rlkernels.reference`` for their exact meaning):
``logprobs``, ``linear_logprobs``, ``linear_policy_loss``, ``logits_policy_loss``, ``kl_penalty``,
``policy_loss``, ``value_loss``, ``gae``, ``group_advantages``, ``masked_whiten``, ``process_advantages``.

Submodules reachable as attributes, imported on first access: ``rlkernels.hf`` (Hugging Face
models: ``response_logprobs``, the bundled SmolLM2), ``rlkernels.integrations`` (TRL, verl),
``rlkernels.trainer`` (the bundled PPO/GRPO trainer).

Importing the package is cheap: each op family loads on first use, and nothing here imports
transformers, trl or triton.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "logprobs": "rlkernels.softmax",
    "linear_logprobs": "rlkernels.fused_linear",
    "linear_policy_loss": "rlkernels.fused_policy",
    "logits_policy_loss": "rlkernels.fused_policy",
    "kl_penalty": "rlkernels.losses",
    "policy_loss": "rlkernels.losses",
    "value_loss": "rlkernels.losses",
    "gae": "rlkernels.advantages",
    "group_advantages": "rlkernels.advantages",
    "masked_whiten": "rlkernels.advantages",
    "process_advantages": "rlkernels.advantages",
}

# submodules a user reaches as ``rlkernels.<name>`` after a bare ``import rlkernels``
_LAZY_SUBMODULES = ("hf", "integrations", "trainer")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    import importlib  # here, not at module level: the namespace holds only the public API

    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import also binds it here
    raise AttributeError(f"module 'rlkernels' has no attribute {name!r}")


def __dir__():
    return sorted([*__all__, "__version__", *_LAZY_SUBMODULES])
