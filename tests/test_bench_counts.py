"""The bytes and FLOPs the bench cases state (their bound), against counts made by hand from what each op must do:
a wrong count makes every "of bound" and rate of its rows wrong."""
from __future__ import annotations

import torch

CPU = torch.device("cpu")


def test_trainer_step_counts_the_products_it_must_do():
    """The tiny trainer case (B=2 P=4 R=8 V=1000 H=32, 1 layer, float32), counted by hand: the head's three GEMMs
    over the 12 scored tokens (response 0 has only its first half scored), and each linear weight of the layer
    (q, k, v, o: 32x32; gate, up, down: 32x128) at 6 FLOPs per token over all B·(P + R) = 24 tokens. The embedding
    (a lookup) does none; before, its V·H parameters counted as 6·N·V·H more and the prompt tokens as none."""
    from bench import bench_trainer

    (case,) = bench_trainer.tiny_cases(CPU)
    B, P, R, V, H = 2, 4, 8, 1000, 32
    scored = B * R - R // 2
    layer = 4 * H * H + 3 * H * 4 * H
    assert case.bound == "compute"
    assert case.flops == 6 * scored * H * V + 6 * B * (P + R) * layer
    params = 2 * V * H + layer + 2 * H + H  # embedding, head, the layer's products and its two norms, final norm
    assert case.bytes_moved == 2 * params * 4


def test_linear_policy_loss_counts_three_gemms_and_its_shape_names_the_rows_left_out():
    """Three GEMMs (logits, d_hidden, d_weight); the quick CPU bf16 case measures the two rlkernels paths only, so
    its speedup is over the two-op path, not eager: its shape says which providers were left out."""
    from bench import bench_fused_policy

    N, H, V = 256, 576, 49152
    full = bench_fused_policy._case(N, H, V, torch.float32, CPU)
    assert full.flops == 3 * 2 * N * H * V and full.baseline == "eager"
    assert full.bytes_moved == 2 * (N * H + V * H) * 4
    assert full.shape == f"N={N} H={H} V={V} float32"
    part = bench_fused_policy._case(N, H, V, torch.bfloat16, CPU, only=("rlkernels two-op", "rlkernels"))
    assert part.baseline == "rlkernels two-op" and list(part.providers) == ["rlkernels two-op", "rlkernels"]
    assert part.shape == f"N={N} H={H} V={V} bfloat16 (not run: eager, torch.compile, liger GRPO loss)"


def test_logits_policy_loss_bound_is_two_passes_over_the_logits():
    from bench import bench_fused_policy

    case = bench_fused_policy._logits_case(512, 1000, torch.bfloat16, CPU)
    assert case.bound == "memory" and case.bytes_moved == 2 * 512 * 1000 * 2  # logits read, d_logits written
