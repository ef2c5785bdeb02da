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
