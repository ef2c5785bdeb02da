"""Every Triton configuration also builds, spill-free, in the specialization real launches
get for 16-byte-aligned tensors and sizes divisible by 16 (typical vocabularies, hidden
sizes, batch shapes). The per-module tests compile the unaligned specialization."""
import importlib

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from rlkernels.testing.aot import compile_config  # noqa: E402

MODULES = ("rlkernels.softmax", "rlkernels.fused_linear", "rlkernels.losses", "rlkernels.advantages",
           "rlkernels.fused_policy")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("module", MODULES)
def test_aligned_specialization_builds_without_spills(module, arch):
    configs = [cfg for cfg in importlib.import_module(module).aot_configs() if arch in cfg.archs]
    reports = [compile_config(cfg, arch, aligned=True) for cfg in configs]
    spilling = [str(r) for r in reports if r.spill_bytes]
    assert not spilling, "spills:\n" + "\n".join(spilling)


@pytest.mark.parametrize("arch", [80, 90])
def test_logits_kernels_read_16_bytes_per_load_when_aligned(arch):
    """The [N, V] passes of logprobs are memory-bound: with aligned rows every thread
    must read (and the backward write) 16 bytes at a time, whatever the dtype."""
    from rlkernels import softmax

    for cfg in softmax.aot_configs():
        report = compile_config(cfg, arch, aligned=True)
        assert report.widest_load_bytes == 16, str(report)


@pytest.mark.parametrize("arch", [80, 90])
def test_linear_logprobs_matmuls_use_tensor_cores_and_pipelining(arch):
    """bf16/fp16 tiles go through the tensor cores (wgmma on sm_90, mma on sm_80) and, with
    aligned rows, their K loop stages tiles with cp.async (software pipelining)."""
    from rlkernels import fused_linear

    sixteen_bit = [c for c in fused_linear.aot_configs()
                   if c.signature.get("h_ptr") in ("*bf16", "*fp16") and arch in c.archs]
    assert sixteen_bit
    for cfg in sixteen_bit:
        report = compile_config(cfg, arch, aligned=True)
        assert report.tensor_core_ops > 0, str(report)
        assert report.async_copies > 0, str(report)
