"""Tools for rlkernels' own tests and benchmarks, not needed to run the ops.

- :mod:`rlkernels.testing.aot`: compiles every Triton configuration the launchers can pick for sm_80/sm_90
  with no GPU and reads registers, spills and shared memory from the cubin.
- :mod:`rlkernels.testing.memory`: peak extra memory of a call (CPU allocator events, CUDA peak stats).
- :mod:`rlkernels.testing.specializations`: the Triton specializations (compiled variants) a sequence of calls
  would need on an sm_90 GPU, from Triton's own binder, with the kernels run under the interpreter.
"""
