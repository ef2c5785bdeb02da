"""Adapters that put rlkernels into other trainers.

- ``rlkernels.integrations.trl``: ``RLKernelsGRPOTrainer`` / ``apply_rlkernels(trainer)`` for TRL's GRPO
  (needs ``pip install 'rlkernels[trl]'``).
- ``rlkernels.integrations.verl``: ``register()`` puts rlkernels' policy losses and advantage estimators into
  verl's registries; drop-ins for ``logprobs_from_logits`` and ``FusedLinearForPPO``.

Nothing is imported here: importing this package never imports trl, verl or transformers.
"""
