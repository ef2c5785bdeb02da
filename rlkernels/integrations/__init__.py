"""Adapters that put rlkernels into other trainers (TRL, verl)."""
