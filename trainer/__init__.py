"""The bundled PPO/GRPO trainer, installed as ``rlkernels.trainer``."""
