"""Adapters that put rlkernels into other trainers.

- ``rlkernels.integrations.trl``: ``RLKernelsGRPOTrainer`` / ``apply_rlkernels(trainer)`` for TRL's GRPO
  (needs ``pip install 'rlkernels[trl]'``).
- ``rlkernels.integrations.verl``: ``register()`` puts rlkernels' policy losses and advantage estimators into
  verl's registries; drop-ins for ``logprobs_from_logits`` and ``FusedLinearForPPO``.

Nothing is imported here: importing this package never imports trl, verl or transformers.
"""

_ADAPTERS = ("trl", "verl")


def __getattr__(name: str):
    """``rlkernels.integrations.trl`` / ``.verl`` without an explicit import (imported on first access)."""
    if name in _ADAPTERS:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(_ADAPTERS)
