"""Instruction budgets of the memory-bound Triton kernels, and (where nvcc is) of the csrc CUDA kernels, read from
their sm_90 SASS (no GPU needed).

An H100 SM issues 128 lane-instructions per clock while its share of HBM bandwidth is about 12.8 B per
clock, so a kernel that moves ``b`` bytes per element is memory-bound only below ``10·b`` SASS
instructions per element and thread. The budgets below keep about 2x headroom under that line for the
contract's sizes; each is counted on the main loop (or the whole kernel when it has no loop) of the aligned
specialization real launches get (``rlkernels.testing.aot``), per element one thread handles in one
iteration. Every memory-bound kernel must also keep at least 2 CTAs resident per SM, so one CTA's
reductions and barriers overlap another's loads.

A budget is listed here only once its kernel meets it; the report (``build/aot-report.txt``) prints the
figure of every kernel. Not yet listed (over budget today, sm_90 aligned): ``_group_kernel`` (now only
index-given groups of unequal sizes and groups larger than 4096: 68-239 per score against 40; groups of one size,
contiguous or index-given, take ``_group_tile_kernel``).
"""
import importlib

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from rlkernels.testing.aot import compile_config  # noqa: E402

MODULES = ("rlkernels.softmax", "rlkernels.advantages", "rlkernels.losses", "rlkernels.fused_policy")

# kernel name -> SASS instructions per element (token, score, logit) per thread of its main loop, at most.
# logprobs: 2-byte logits, ~10 B per element over fwd+bwd -> the forward must stay under 10, the backward (read
# 2 B, write 2 B) under 16. Group statistics: 8 B per score (read, write) -> 40 keeps 2x headroom.
BUDGETS: dict[str, float] = {
    "_logprobs_fwd_kernel": 10.0,
    "_logprobs_bwd_kernel": 16.0,
    # groups of one size <= 4096, contiguous: 8 B per score -> 40
    "_group_tile_kernel": 40.0,
    # the same, index-given: gathered and scattered through an int32 permutation, 12 B per score -> 60 (it met 40
    # until the kernel scaled groups past 2**32 by a power of two, against float32 overflow: 41.2 at 256 columns)
    "_group_tile_kernel[HAS_INDEX=True]": 60.0,
    # masked_whiten's statistics pass reads x and a uint8 mask: 3 B per element for bf16 x -> 30, 2x headroom
    "_whiten_partial_kernel": 15.0,
    # its apply pass reads x and writes float32: at least 6 B per element -> 60, 2x headroom
    "_whiten_apply_kernel": 30.0,
    # the losses' backward reads a float32 gradient and writes it in the input's dtype: >= 6 B per token -> 60
    "_scale_rows_kernel": 30.0,
    # GAE: reads 2 x (2 or 4) B + 1 B and writes 8 B per token (13-17 B): 48 is the budget (39-43 with
    # Triton 3.9, 40-45 with 3.6)
    "_gae_kernel": 48.0,
    # logits_policy_loss in one kernel: the two loops of the logprobs kernels (a read pass, then a read-and-write
    # pass) per element, so its figure is theirs summed (budget 10 + 16). 2-byte logits: 4 B of HBM per element
    # (the second read is of a row the program has just read, from L2), a 40-instruction line: 1.5x headroom.
    "_logits_policy_kernel": 26.0,
}


def _reports(module):
    return [compile_config(cfg, 90, aligned=True) for cfg in importlib.import_module(module).aot_configs() if cfg.elements]


@pytest.mark.parametrize("module", MODULES)
def test_memory_bound_kernels_keep_two_ctas_per_sm(module):
    reports = _reports(module)
    assert reports
    few = [str(r) for r in reports if r.ctas_per_sm < 2]
    assert not few, "fewer than 2 CTAs per SM:\n" + "\n".join(few)


@pytest.mark.parametrize("module", MODULES)
def test_memory_bound_kernels_meet_their_instruction_budgets(module):
    over = []
    for report in _reports(module):
        name = report.label.split("(")[0]
        budget = BUDGETS.get(f"{name}[HAS_INDEX=True]" if "HAS_INDEX=True" in report.label else name, BUDGETS.get(name))
        if budget is not None and report.instructions_per_element > budget:
            over.append(f"{report} (budget {budget})")
    assert not over, "over budget:\n" + "\n".join(over)


def test_the_sass_reader_finds_the_loop_and_counts_it():
    """A hand-written nvdisasm listing: a 4-instruction loop (backward branch to .L_x_1) and a trap after EXIT."""
    from rlkernels.testing.aot import ctas_per_sm, main_loop_instructions

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   FADD R0, R0, R4 ;
        /*0040*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
"""
    assert main_loop_instructions(sass) == 4
    assert main_loop_instructions(sass.replace("@!P0 BRA `(.L_x_1) ;", "NOP ;")) == 7  # no loop: the whole kernel
    # 128 registers x 8 warps: 4096 registers per warp, 16 warps of 64 K -> 2 CTAs
    assert ctas_per_sm(90, 128, 8, 0) == 2
    assert ctas_per_sm(90, 129, 8, 0) == 1  # 136 per thread once rounded to 8
    assert ctas_per_sm(90, 32, 4, 100 * 1024) == 2  # shared memory: 228 KiB / (100 + 1) KiB


def test_the_epilogue_reader_subtracts_the_k_loop_from_the_tile_loop():
    """A hand-written listing of a persistent GEMM kernel: a tile loop (.L_x_1, 8 instructions) around a K loop
    (.L_x_2, 3 instructions, one HGMMA): the tile's work outside the K loop is 5; without the tile loop, the
    whole kernel up to EXIT minus the K loop; without a tensor-core instruction, 0."""
    from rlkernels.testing.aot import epilogue_instructions

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
.L_x_2:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*0030*/                   UIADD3 UR5, UR5, 0x40, URZ ;
        /*0040*/              @P0 BRA `(.L_x_2) ;
        /*0050*/                   FMNMX R2, R24, R25, !PT ;
        /*0060*/                   MUFU.EX2 R3, R2 ;
        /*0070*/                   STG.E [R4.64], R3 ;
        /*0080*/              @P1 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3);
"""
    assert epilogue_instructions(sass) == 5  # 8 in the tile loop - 3 in the K loop
    flat = sass.replace("@P1 BRA `(.L_x_1) ;", "NOP ;")
    assert epilogue_instructions(flat) == 10 - 3  # the kernel up to EXIT (10) - the K loop
    assert epilogue_instructions(sass.replace("HGMMA.64x128x16.F32.BF16", "FFMA")) == 0


# ---------------------------------------------------------------- csrc CUDA kernels (nvcc, sm_90)
# The CUDA defaults of gae, group_advantages and masked_whiten (csrc/advantages_cuda.cu), held to the same rule: at
# most 5 instructions per byte an element moves (2x headroom under the 10·b line above), counted on the loop that
# handles the elements (the whitening statistics' chunk loop, 8 values a thread; the apply pass's grid-stride loop,
# kUnroll = 4 values a thread; GAE's tile loop, kItems = 8 tokens a thread; the fused whitening kernel's statistics and
# normalisation chunk loops together, 8 values a thread) or, for the group kernel (8 scores a lane, once), the whole
# kernel up to EXIT with every mode's branch. Bytes per element: whitening statistics x + mask (T + 1), apply x +
# float32 out (T + 4), fused whitening x + mask + float32 out (T + 5: its second read of x is the block's own share,
# from L1/L2), GAE rewards, values, mask and two float32 outputs (2T + 9), groups a float32 score in and out (8).
# Built as the extension builds them (rlkernels._extension.CUDA_FLAGS).
CSRC_KERNELS = {  # name in the mangled symbol -> (elements per counted block, bytes per element given T's size)
    "whiten_partial_kernel": (8, lambda t: t + 1),
    "whiten_apply_kernel": (4, lambda t: t + 4),
    "whiten_fused_kernel": (8, lambda t: t + 5),
    "gae_kernel": (8, lambda t: 2 * t + 9),
    "group_segment_kernel": (8, lambda t: 8),
}
# Over the rule today (sm_90, nvcc 13.0), by a fragment of the mangled name, each with its figure, tested not to grow:
# the group segment kernel's element-by-element variant (kVec false: a group size not a multiple of 4, or scores not
# 16-byte aligned) at 41.5 per score as the extension builds it (--use_fast_math; 40.0 with plain -O3, the flags this
# test used before 2026-11-28); its 16-byte variant, the one groups of 16 at offset 0 take, is within the rule.
# (Earlier: the 16-bit whitening statistics at 21.75 per value, the 16-bit GAE at 65.75 / 80.9 per token, the group
# segment kernel at 48.6 / 55.6 per score.)
CSRC_OVER: dict[str, float] = {"group_segment_kernelILb0E": 41.5}


def _csrc_facts():
    import os

    from rlkernels._extension import CUDA_FLAGS
    from rlkernels.testing.aot import nvcc_kernel_facts
    from tests.helpers import nvcc_or_skip

    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "advantages_cuda.cu")
    return nvcc_kernel_facts(source, 90, nvcc_or_skip(), flags=(*CUDA_FLAGS, "-std=c++17"))


def _fused_whiten_loops(k) -> tuple[int, int]:
    """The fused whitening kernel's two element loops, by what they hold (its merges, barriers and rescue make other,
    wider backward-branch ranges): the statistics chunk loop (the mask's 8-byte load and the chunk mean's MUFU.RCP)
    and the normalisation chunk loop (its 16-byte stores), neither holding a barrier."""
    bodies = [b for b in k.loop_bodies() if not any("BAR" in t for t in b)]
    stats = [len(b) for b in bodies if any("LDG.E.64" in t for t in b) and any("MUFU.RCP" in t for t in b)]
    apply = [len(b) for b in bodies if any("STG.E.128" in t for t in b)]
    assert stats and apply, k.name
    return max(stats), max(apply)


def _count(kind: str, k) -> int:
    if kind == "group_segment_kernel":
        return k.instructions_to_exit()
    if kind == "whiten_fused_kernel":
        return sum(_fused_whiten_loops(k))
    return k.largest_loop_instructions()


def _element_size(mangled: str) -> int:
    return 2 if ("__nv_bfloat16" in mangled or "6__half" in mangled) else 4


def test_csrc_memory_bound_kernels_meet_their_instruction_budgets():
    """Each memory-bound kernel of the CUDA extension on sm_90: instructions per element within 5 per byte moved,
    at least 2 CTAs per SM, no spills; the kernels listed in CSRC_OVER no worse than their recorded figure."""
    from rlkernels.testing.aot import ctas_per_sm

    seen, over, lines = set(), [], []
    for k in _csrc_facts():
        kind = next((name for name in CSRC_KERNELS if name + "I" in k.name), None)
        if kind is None:
            continue
        seen.add(kind)
        elements, bytes_of = CSRC_KERNELS[kind]
        size = _element_size(k.name)
        count = _count(kind, k)
        assert count > 0, k.name
        per_element = count / elements
        budget = 5.0 * bytes_of(size)
        ctas = ctas_per_sm(90, k.registers, 8, k.shared_bytes)  # every one of them runs 256-thread blocks
        lines.append(f"{k.name[-60:]}: {per_element:.2f} per element (budget {budget:.0f}), {k.registers} registers, "
                     f"{ctas} CTAs/SM")
        assert k.spill_bytes == 0 and ctas >= 2, lines[-1]
        known = next((figure for fragment, figure in CSRC_OVER.items() if fragment in k.name), None)
        if per_element > (known if known is not None else budget):
            over.append(lines[-1] + (f" (recorded {known})" if known is not None else ""))
    print("\n" + "\n".join(lines))
    assert seen == set(CSRC_KERNELS), seen
    assert not over, "over budget:\n" + "\n".join(over)


def test_csrc_logits_policy_cluster_kernel_meets_its_instruction_budget():
    """logits_policy_loss's cluster kernel (csrc/logits_policy_kernel.h) on sm_90, each dtype: its two element loops
    -- the copy of the row's chunk into shared memory with the online statistics (16-byte loads and shared stores,
    4 vectors a thread an iteration) and the d_logits loop (shared loads, 16-byte stores) -- within 5 instructions
    per byte an element moves (the logits read once, d_logits written once: 2·sizeof(T)), counted per element of
    each loop's vectors; no spills; at least 2 blocks an SM with the largest chunk's shared memory."""
    import os

    from rlkernels._extension import CUDA_FLAGS
    from rlkernels.testing.aot import ctas_per_sm, nvcc_kernel_facts
    from tests.helpers import nvcc_or_skip

    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "logits_policy_cuda.cu")
    kernels = [k for k in nvcc_kernel_facts(source, 90, nvcc_or_skip(), flags=(*CUDA_FLAGS, "-std=c++17"))
               if "logits_policy_kernelI" in k.name]
    assert len(kernels) == 3, [k.name for k in kernels]  # float, __half, __nv_bfloat16
    lines = []
    for k in kernels:
        size = _element_size(k.name)
        vec = 16 // size
        bodies = [b for b in k.loop_bodies() if not any("BAR" in t for t in b)]

        def per_element(load: str, store: str, counted: str) -> float:
            loops = [(len(b), sum(counted in t for t in b)) for b in bodies
                     if any(load in t for t in b) and any(store in t for t in b)]
            assert loops, (k.name, load, store)
            n, vectors = max(loops, key=lambda nv: nv[1])  # the unrolled main loop
            return n / (vectors * vec)

        copy = per_element("LDG.E.128", "STS.128", "LDG.E.128")
        grad = per_element("LDS.128", "STG.E.128", "STG.E.128")
        budget = 5.0 * 2 * size
        ctas = ctas_per_sm(90, k.registers, 8, k.shared_bytes + 80 * 1024 + 16)  # kLogitsMaxChunkBytes + 16
        lines.append(f"{k.name[-60:]}: copy {copy:.2f} + d_logits {grad:.2f} per element (budget {budget:.0f}), "
                     f"{k.registers} registers, {ctas} CTAs/SM")
        assert k.spill_bytes == 0 and ctas >= 2 and copy + grad <= budget, lines[-1]
    print("\n" + "\n".join(lines))
