"""bench/model.py: the roofline model of linear_logprobs runs, its numbers are self-consistent, and its kernel facts
are the launcher's."""
import dataclasses
import math

import pytest
import torch

from bench import model


def test_prints_every_device_and_size(capsys):
    assert model.main([]) == 0
    out = capsys.readouterr().out
    for device in model.DEVICES.values():
        for V in model.VOCABS:
            assert f"{device.name}  N={model.N_TOKENS} H={model.HIDDEN} V={V} bf16" in out
    assert out.count("  forward ") == 5 * len(model.DEVICES) * len(model.VOCABS)  # split, tma (3 ways), cublas


@pytest.mark.parametrize("p", model.predictions(), ids=lambda p: f"{p['device']}-V{p['V']}")
def test_predictions_are_self_consistent(p):
    device = next(d for d in model.DEVICES.values() if d.name == p["device"])
    one = model.one_gemm_s(p["N"], p["H"], p["V"], device) * 1e3
    assert p["one_gemm_ms"] == pytest.approx(one) and p["four_gemms_ms"] == pytest.approx(4 * one)
    # one GEMM: 2 N H V FLOPs at cuBLAS's measured fraction of the peak
    assert one == pytest.approx(2 * p["N"] * p["H"] * p["V"] / (device.peak_tflops * 1e12 * device.gemm_efficiency) * 1e3)
    assert p["backward_ms"] == p["backward_by_dz_ms"]["dz"]  # the default forward (split) is followed by it
    for kind, fwd in p["forward_ms"].items():
        bwd = p["backward_by_dz_ms"][model.DZ_AFTER[kind]]
        # rlkernels.fused_linear._bwd_tiles: the Hopper dz kernel after the Hopper forwards, cuBLAS after cuBLAS
        assert model.DZ_AFTER[kind] == ("dz tma" if kind.startswith("tma") else "dz cublas" if kind == "cublas"
                                        else "dz")
        assert p["fwd_bwd_ms"][kind] == pytest.approx(fwd + sum(bwd.values()))
        assert p["fwd_bwd_vs_four_gemms"][kind] == pytest.approx(p["fwd_bwd_ms"][kind] / p["four_gemms_ms"])
        assert fwd >= one  # nothing beats one GEMM at cuBLAS's rate
        # every input read at least once
        assert p["forward_gb"][kind] * 1e9 >= (p["N"] + p["V"]) * p["H"] * 2
    for bwd in p["backward_by_dz_ms"].values():
        assert bwd["dz"] >= one and bwd["dh"] >= one and bwd["dW"] >= one
    # grouped grids read hidden once and the weight once per group of token blocks, not hidden per vocabulary tile
    ungrouped = model.Kernel("split, token blocks fastest", 128, 128, 32, 64, 27.0, True, False)
    reread = model.tiled_hbm_bytes(ungrouped, p["N"], p["H"], p["V"], device)
    for kind in ("split", "tma"):
        k = model.KERNELS[kind]
        groups = math.ceil(p["N"] / (k.group_n * k.block_n))
        assert p["forward_gb"][kind] * 1e9 == pytest.approx((p["N"] + groups * p["V"]) * p["H"] * 2)
        assert p["forward_gb"][kind] < reread / 4


def test_wider_wgmma_is_no_slower_and_capped_at_cublas():
    d = model.DEVICES["H100"]
    assert model.wgmma_efficiency(64, d) == pytest.approx(model.TRITON_EFF_N64)
    effs = [model.wgmma_efficiency(n, d) for n in (64, 128, 256)]
    assert effs == sorted(effs) and effs[-1] <= d.gemm_efficiency


def test_faster_memory_never_predicts_a_slower_forward():
    h100, h200 = model.DEVICES["H100"], model.DEVICES["H200"]
    same_tensor_rate = model.Device("H200 at H100's GEMM rate", h200.peak_tflops, h200.hbm_tbps, h200.l2_mb,
                                    gemm_efficiency=h100.gemm_efficiency, copy_efficiency=h200.copy_efficiency)
    for kind in ("split", "tma", "cublas"):
        assert model.forward_s(kind, 8192, 4096, 128256, same_tensor_rate) <= model.forward_s(kind, 8192, 4096, 128256, h100)


def test_measured_ceilings_make_a_device():
    d = model.device_from_ceilings("H100 measured", matmul_tflops=798.0, copy_gbps=3000.0)
    assert d.gemm_efficiency == pytest.approx(798 / 989) and d.hbm_bps == pytest.approx(3.0e12)
    assert math.isclose(model.predict(d)["one_gemm_ms"], model.predict(model.DEVICES["H100"])["one_gemm_ms"])


def test_kernel_facts_are_the_launchers():
    """The model's tiles are the ones rlkernels.fused_linear launches (a change there must be carried here)."""
    from rlkernels import fused_linear as fl

    t, tb, tma = fl._tiles(torch.bfloat16), fl._tiles(torch.bfloat16, backward=True), fl._TMA_TILES
    # the Hopper dz kernel runs with the Hopper forward's K blocks (fl._bwd_tiles)
    dz_tma = dataclasses.replace(fl._TMA_DZ_TILES, block_k=tma.block_k)
    for key, tiles in (("split", t), ("dz", tb), ("tma", tma), ("tma flat", tma), ("tma 2cta", fl._TMA_TILES_2CTA),
                       ("dz tma", dz_tma)):
        k = model.KERNELS[key]
        assert (k.block_n, k.block_v, k.block_k) == (tiles.block_n, tiles.block_v, tiles.block_k), key
        assert k.group_n == tiles.group_n, key
    assert model.KERNELS["tma"].wait_per_k_step == tma.flatten
    assert model.KERNELS["tma 2cta"].ctas_per_sm == fl._TMA_TILES_2CTA.ctas_per_sm
    assert model.KERNELS["dz tma"].ctas_per_sm == fl._TMA_DZ_TILES.ctas_per_sm
    assert model.DZ_BUDGET_BYTES == fl._DZ_BUDGET_BYTES
    assert model.CUBLAS_DZ_BLOCK_V == fl._CUBLAS_DZ_TILES.block_v == fl._TILE_DZ.block_v


def test_cublas_dz_chunks_hold_the_float32_tile():
    """The "cublas" backward's dz phase: its chunks narrower than the Triton dz kernels' (the float32 tile shares the
    budget: 6 bytes a column entry against 2), its time the GEMM's plus a pass over the tile and dz (two kernels,
    added), so never under one GEMM and never under that memory pass."""
    d = model.DEVICES["H200"]
    N, H, V = model.N_TOKENS, model.HIDDEN, model.VOCABS[0]
    dz = model.backward_s(N, H, V, d, "dz cublas")["dz"]
    tile_pass = N * V * (model.BYTES_F32 + model.BYTES_BF16) / d.hbm_bps
    assert dz >= model.one_gemm_s(N, H, V, d) + tile_pass * 0.999
    # more chunks: dh's float32 accumulator read and written per chunk, hidden re-read per chunk by dW
    assert model.backward_s(N, H, V, d, "dz cublas")["dh"] >= model.backward_s(N, H, V, d, "dz")["dh"]


def test_gpu_record_puts_the_prediction_next_to_the_measurement():
    """bench/gpu.py: the model at a run's measured ceilings, rendered beside the measured rows of the same shape."""
    from bench import gpu

    preds = gpu.model_at_ceilings({"device": "NVIDIA H200", "matmul_tflops": 788.0, "copy_gbps": 4300.0})
    assert [p["V"] for p in preds] == list(model.VOCABS) and "H200" in preds[0]["device"]
    shape = f"N={model.N_TOKENS} H={model.HIDDEN} V={model.VOCABS[0]} bfloat16"
    rows = [{"op": "linear_logprobs fwd", "shape": shape, "provider": "rlkernels fwd tma", "median_ms": 12.345},
            {"op": "linear_logprobs fwd+bwd", "shape": shape, "provider": "rlkernels", "median_ms": 54.321},
            {"op": "linear_logprobs bwd phases", "shape": shape + " (4 chunks of 32768)", "provider": "dz kernel tma",
             "median_ms": 11.111}]
    lines = gpu._model_lines({"model": preds, "bench": {"rows": rows}})
    dz_tma = next(line for line in lines if line.startswith(f"| {shape} | backward dz tma |"))
    assert dz_tma.endswith(f"| {preds[0]['backward_by_dz_ms']['dz tma']['dz']:.2f} | 11.11 |")
    assert next(line for line in lines if line.startswith(f"| {shape} | backward dz |")).endswith("|  |")
    tma = next(line for line in lines if line.startswith(f"| {shape} | forward tma |"))
    assert tma.endswith(f"| {preds[0]['forward_ms']['tma']:.2f} | 12.35 |")
    both = next(line for line in lines if line.startswith(f"| {shape} | fwd+bwd (forward: split)"))
    assert both.endswith("| 54.32 |")
    assert gpu._model_lines({}) == []


def test_epilogue_figures_are_the_kernels_sass():
    """The model's epilogue costs (SASS instructions per logit) are what the kernels compile to now: each within
    2 % of ``epilogue_instructions`` of its aligned bf16 sm_90 build without bias (the launcher's configuration),
    divided by the logits one thread handles per tile -- a kernel change that moves its epilogue must be carried
    into the model."""
    pytest.importorskip("triton", reason="triton is not installed")
    from rlkernels import fused_linear as fl
    from rlkernels.testing.aot import compile_config

    kernels = {"split": fl._fwd_kernel, "tma": fl._fwd_kernel_tma, "dz": fl._dz_kernel, "dz tma": fl._dz_kernel_tma}
    for key, kernel in kernels.items():
        config = next(c for c in fl.aot_configs() if c.kernel is kernel and 90 in c.archs and "bf16" in str(c.signature)
                      and not c.constexprs.get("HAS_BIAS") and not c.constexprs.get("FLATTEN")
                      and not c.constexprs.get("STORE_Z") and c.constexprs.get("BLOCK_N") == model.KERNELS[key].block_n)
        report = compile_config(config, 90, aligned=True)
        per_thread = config.constexprs["BLOCK_N"] * config.constexprs["BLOCK_V"] / (32 * config.num_warps)
        assert report.epilogue_instructions > 0, key
        measured = report.epilogue_instructions / per_thread
        assert model.KERNELS[key].epilogue_sass == pytest.approx(measured, rel=0.02), (key, measured)
