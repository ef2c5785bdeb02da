"""Microbenchmarks: rlkernels against eager PyTorch, torch.compile and peers. Run ``python -m bench``."""
