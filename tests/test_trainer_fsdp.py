"""``--shard fsdp`` (FSDP2): 2 processes under torchrun (gloo, CPU) take the steps 1 process takes, the LM head
reaches ``linear_logprobs`` whole, and a sharded (DCP) save + resume equals an uninterrupted run.

One ``torchrun --nproc_per_node=2`` launch of this file (``python -m torch.distributed.run ... this_file OUT``)
runs every 2-process scenario and saves what each process saw under OUT; the tests compare those files with
one process run here. The batches are designed (``tests.test_trainer._designed_batch``), not sampled, so
both sides see the same global batch: each process updates on its half, as the trainer splits prompts
(whole groups, rank r takes the r-th slice).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a torchrun script, not under pytest
    sys.path.insert(0, str(ROOT))

from tests.test_trainer import ADAM_STEP_TOL, _adam_first_step, _designed_batch, _strip  # noqa: E402
from trainer import distributed as sharding  # noqa: E402
from trainer.config import ConfigError, from_dict  # noqa: E402
from trainer.loop import Trainer, read_metrics  # noqa: E402

STEPS = 3  # updates compared between runs
WORLD = 2
ALGOS = ("grpo", "ppo")


def _cfg(out, algo: str, shard: str, **over) -> dict:
    # PPO: sequence means for the policy loss, so that the value loss is the one token mean (as in test_trainer)
    agg = "seq-mean-token-mean" if algo == "ppo" else "token-mean"
    base = dict(output_dir=str(out), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                tiny_hidden=32, losses="eager", max_new_tokens=3, algo=algo, agg=agg, shard=shard, save_every=0)
    return {**base, **over}


def _update_steps(tr, rank: int, world: int) -> dict:
    """``STEPS`` updates, each on the designed global batch of that step, this process taking its slice.

    Returns per step this process's metrics and its numbers of tokens and sequences (to form the global
    loss); after step 1 the whole gradients and parameters, the learning rates and the largest advantage;
    the whole parameters after the last step.
    """
    distributed = (tr.rank, tr.world, tr.distributed)
    record = {"logs": [], "tokens": [], "seqs": []}
    for step in range(1, STEPS + 1):
        tr.rank, tr.world, tr.distributed = 0, 1, False  # the global batch, scored as one process would
        batch = _designed_batch(tr, step)
        if tr.cfg.algo == "grpo":  # group advantages need whole groups, which every slice holds
            batch = tr.advantages(tr.score_tokens(batch))
        tr.rank, tr.world, tr.distributed = distributed
        B = batch.ids.shape[0]
        mine = batch.select(torch.arange(rank * B // world, (rank + 1) * B // world))
        if tr.cfg.algo == "ppo":  # each process whitens its slice's advantages with the global statistics
            mine = tr.advantages(tr.score_tokens(mine))
        record["logs"].append(tr.update(mine, step))
        record["tokens"].append(int(mine.mask.sum()))
        record["seqs"].append(mine.ids.shape[0])
        models = [m for m in (tr.policy_lp, tr.critic) if m is not None]
        if step == 1:
            from torch.distributed.tensor import DTensor

            grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for m in models for p in m.parameters()]
            record["grads1"] = [g.detach().clone() for g in grads]
            record["params1"] = [p.detach().clone() for m in models for p in sharding.full_parameters(m)]
            record["lrs"] = [g["lr"] for g in tr.optimizer.param_groups for _ in g["params"]]
            record["adv_max"] = float(mine.advantages.abs().max())
    record["params"] = [p.detach().clone() for m in models for p in sharding.full_parameters(m)]
    return record


def _head_seen_by_linear_logprobs(tr) -> dict:
    """What ``linear_logprobs`` receives as the head's weight inside the sharded forward, and what the
    module holds outside it."""
    from torch.distributed.tensor import DTensor

    seen = []  # (a DTensor?, shape) per call
    inner = tr.policy_lp.inner  # the TokenLogprobs inside the sharded root
    ops = inner.ops

    def recording(hidden, weight, labels, **kw):
        seen.append((isinstance(weight, DTensor), tuple(weight.shape)))
        return ops.linear_logprobs(hidden, weight, labels, **kw)

    inner.ops = types.SimpleNamespace(linear_logprobs=recording)
    batch = _designed_batch(tr)
    with torch.no_grad():
        tr.policy_lp(batch.ids, batch.attention_mask, batch.labels)
    inner.ops = ops
    tr.policy_lp.reshard()
    head = tr.policy.lm_head.weight
    with torch.no_grad():
        tr.ref(batch.ids, batch.attention_mask, batch.labels)
    from torch.distributed.fsdp import FSDPModule

    return {"inside": seen, "outside": (isinstance(head, DTensor), tuple(head.shape), tuple(head.to_local().shape)),
            "groups": {name: sum(isinstance(m, FSDPModule) for m in root.modules())
                       for name, root in (("policy", tr.policy_lp), ("ref", tr.ref))},
            "ref_resharded": isinstance(tr.ref.inner.model.lm_head.weight, DTensor),
            "local_numel": sum(p.to_local().numel() for p in tr.policy_lp.parameters()),
            "numel": sum(p.numel() for p in tr.policy_lp.parameters())}


RESUME = dict(algo="ppo", steps=3, epochs=2, minibatches=2, kl_target=0.02, kl_coef=0.05, fsdp_offload_ref=True,
              prompts_per_step=4, group_size=4)


def _value_half(tr) -> None:
    """The critic's value head says 0.5 everywhere (it starts at 0, which would make any bootstrap term 0)."""
    with torch.no_grad():
        sharding.unwrap(tr.critic).value_head.bias.fill_(0.5)  # a DTensor's local shard under FSDP


def _worker(out: Path) -> None:
    """Every 2-process scenario, in one torchrun launch (each process saves what it saw under ``out``)."""
    from tests.helpers import in_gloo_group

    in_gloo_group(None, None, None, _work, out, timeout_s=None)  # ranks wait on each other's long steps here


def _work(out: Path) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for algo in ALGOS:
        for shard in ("fsdp", "ddp"):
            tr = Trainer(from_dict(_cfg(out / f"{algo}-{shard}", algo, shard)))
            result = _update_steps(tr, rank, world)
            if shard == "fsdp" and algo == "grpo":
                result["head"] = _head_seen_by_linear_logprobs(tr)
            torch.save(result, out / f"{algo}-{shard}-{rank}.pt")
    # a reward model, sharded and offloaded like the reference: each process scores its own completions
    from tests.test_trainer_models import _reward_dir, _score_one_by_one

    if rank == 0:  # transformers' save_pretrained writes from the main process only
        model, tok = _reward_dir(out / "rm-model")
    dist.barrier()
    tr = Trainer(from_dict(_cfg(out / "rm", "grpo", "fsdp", reward=str(out / "rm-model"), fsdp_offload_ref=True)))
    batch = _designed_batch(tr)  # scored by the sharded reward model
    B = batch.ids.shape[0]
    rows = range(rank * B // world, (rank + 1) * B // world)
    mine = tr.score(batch.select(torch.tensor(list(rows))), 1).scores
    result = {"sharded": isinstance(tr.reward_fn.model, sharding.ShardedRoot), "scores": mine.tolist()}
    if rank == 0:  # the whole model, unsharded, on every text of the global batch
        result["want"] = _score_one_by_one(model, tok, [f"{p} {c}" if c else p
                                                        for p, c in zip(batch.prompts, batch.completions)])
    torch.save(result, out / f"reward-{rank}.pt")
    # bfloat16 PPO: the critic's float32 value head on a bfloat16 backbone gets its own group (one dtype per group)
    from torch.distributed.fsdp import FSDPModule

    tr = Trainer(from_dict(_cfg(out / "bf16", "ppo", "fsdp", dtype="bfloat16")))
    tr.run()
    torch.save({"value_head_group": isinstance(tr.critic.inner.value_head, FSDPModule),
                "dtypes": sorted({str(p.dtype) for p in tr.critic.parameters()}),
                "metrics": read_metrics(out / "bf16" / "metrics.jsonl")}, out / f"bf16-{rank}.pt")
    # PPO with truncation='bootstrap': the critic's value after each truncated completion, sharded
    tr = Trainer(from_dict(_cfg(out / "boot", "ppo", "fsdp", truncation="bootstrap")))
    _value_half(tr)
    batch = _designed_batch(tr)
    B = batch.ids.shape[0]
    mine = batch.select(torch.arange(rank * B // world, (rank + 1) * B // world))
    mine = tr.advantages(tr.score_tokens(mine))
    torch.save({"returns": mine.returns, "eos": mine.eos}, out / f"boot-{rank}.pt")
    # a moving reference (ref_mix_alpha): mixed shard by shard into the sharded reference after the step
    tr = Trainer(from_dict(_cfg(out / "mix", "grpo", "fsdp", ref_mix_alpha=0.5)))
    start = [p.detach().clone() for p in sharding.full_parameters(tr.policy)]
    tr.run()
    torch.save({"start": start, "policy": [p.detach().clone() for p in sharding.full_parameters(tr.policy)],
                "ref": [p.detach().clone() for p in sharding.full_parameters(sharding.unwrap(tr.ref).model)]},
               out / f"mix-{rank}.pt")
    # the rollout keeps every group gathered through generation (one gather per group, not one per token), and
    # samples what per-token gathering samples
    torch.save(_rollout_gathering(out), out / f"gen-{rank}.pt")
    # sharded save + resume: the real loop (sampling through the sharded generate), cut at step 2
    full = Trainer(from_dict(_cfg(out / "full", **RESUME, shard="fsdp")))
    full.run()
    cut = _cfg(out / "cut", **{**RESUME, "steps": 2}, shard="fsdp")
    Trainer(from_dict(cut)).run()
    resumed = Trainer(from_dict({**cut, "steps": RESUME["steps"], "resume": True}))
    resumed.run()
    torch.save({"full": [p.detach().clone() for m in full._modules().values() for p in sharding.full_parameters(m)],
                "resumed": [p.detach().clone() for m in resumed._modules().values() for p in sharding.full_parameters(m)],
                "kl_coef": (full.kl_coef, resumed.kl_coef)}, out / f"resume-{rank}.pt")


def _rollout_gathering(out: Path) -> dict:
    """One rollout with the trainer's :func:`sharding.gathered` and one without it (per-token gathering), from
    the same seed: per decoding step, whether the first block's parameters were still sharded (``DTensor``) after
    its forward; the sampled ids; whether every group is sharded again afterwards."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    tr = Trainer(from_dict(_cfg(out / "gen", "grpo", "fsdp", max_new_tokens=4)))
    block = next(m for m in tr.policy_lp.modules() if isinstance(m, FSDPModule) and m is not tr.policy_lp)
    result = {}
    for mode in ("gathered", "per token"):
        seen = []
        hook = block.register_forward_hook(lambda m, a, o: seen.append(isinstance(next(m.parameters()), DTensor)))
        saved = sharding.gathered
        if mode == "per token":
            sharding.gathered = lambda root: contextlib.nullcontext(root)
        try:
            torch.manual_seed(1234 + dist.get_rank())
            batch = tr.rollout(1)
        finally:
            sharding.gathered = saved
            hook.remove()
        resharded = all(isinstance(p, DTensor) for p in tr.policy_lp.parameters())
        result[mode] = {"sharded_after_forward": seen, "ids": batch.ids, "resharded": resharded}
    return result


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Run :func:`_worker` under ``torchrun --nproc_per_node=2`` once; the folder of its results."""
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


def _load(out, name):
    return [torch.load(out / f"{name}-{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("algo", ALGOS)
def test_fsdp_two_processes_take_the_one_process_step(two_processes, tmp_path, algo):
    """Step 1: the global loss, the gradients and the parameters of 2 sharded processes equal 1 process."""
    single = Trainer(from_dict(_cfg(tmp_path, algo, "ddp")))  # one process: no wrapper
    start = [p.detach().clone() for m in (single.policy_lp, single.critic) if m is not None for p in m.parameters()]
    want = _update_steps(single, 0, 1)
    ranks = _load(two_processes, f"{algo}-fsdp")
    # the loss each process logs is its slice's mean; weighted by its share of the global batch (tokens for a
    # token mean, sequences for a sequence mean) they make the one-process loss
    policy_weights = "tokens" if algo == "grpo" else "seqs"
    # GRPO: the same group advantages on both sides, the loss's float32 rounding. PPO: each process whitens its
    # advantages with all-reduced statistics, which agree with one process's to rtol 1e-5, atol 1e-6 (test_trainer);
    # at step 1 the ratio is 1, so the policy loss, a mean of advantages, moves by at most that much
    adv_tol = 1e-6 + 1e-5 * want["adv_max"] if algo == "ppo" else 1e-7
    for key, weights, tol in (("loss/policy", policy_weights, adv_tol), ("loss/value", "tokens", 1e-7)):
        if key not in want["logs"][0]:
            continue
        total = sum(r[weights][0] for r in ranks)
        got = sum(r["logs"][0][key] * r[weights][0] / total for r in ranks)
        assert got == pytest.approx(want["logs"][0][key], rel=1e-6, abs=tol), key
    assert ranks[0]["tokens"][0] != ranks[1]["tokens"][0]  # by design: the global-token-mean rescaling matters
    for got in ranks:
        assert len(got["grads1"]) == len(want["grads1"]) == len(start)
        # the same tolerances as the DDP test (test_trainer): sums of ~24 token terms in another order
        for g, w in zip(got["grads1"], want["grads1"]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        assert got["lrs"] == want["lrs"]
        # one AdamW step from those gradients (see test_trainer: the step's formula, not one process's parameters)
        torch.testing.assert_close(got["params1"], _adam_first_step(start, got["grads1"], got["lrs"]), **ADAM_STEP_TOL)
    assert any(bool(g.ne(0).any()) for g in want["grads1"])  # a real update, not rounding noise
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)  # gathered shards: both processes see the same whole parameters


@pytest.mark.parametrize("algo", ALGOS)
def test_fsdp_steps_equal_ddp_steps(two_processes, algo):
    """Three steps: 2 sharded processes log the losses and reach the parameters of 2 DDP processes.

    Each process computes its slice's gradient from the same whole parameters in both modes (FSDP gathers
    them exactly), and both average the two slices' gradients; what differs is the gradient norm for
    clipping (FSDP sums squares shard by shard), a float32 rounding that scales every entry alike. So the
    runs agree to float32 rounding step after step, without the sign flips of near-zero AdamW steps that
    set one process apart from two (see test_trainer).
    """
    fsdp, ddp = _load(two_processes, f"{algo}-fsdp"), _load(two_processes, f"{algo}-ddp")
    for f, d in zip(fsdp, ddp):
        for step in range(STEPS):
            for key, value in d["logs"][step].items():
                assert f["logs"][step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
        torch.testing.assert_close(f["params"], d["params"], rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(a, b) for a, b in zip(f["params"], f["params1"]))  # steps 2-3 moved them


def test_fsdp_shards_and_gathers_the_head_for_linear_logprobs(two_processes):
    """Each process holds half of the policy; ``linear_logprobs`` gets the whole [V, H] head as a plain tensor;
    one FSDP group per transformer block plus the root; the reference reshards after its forward."""
    heads = [r["head"] for r in _load(two_processes, "grpo-fsdp")]
    for head in heads:
        V, H = 16, 32  # the tiny model's vocabulary and tiny_hidden
        assert head["inside"] and all(seen == (False, (V, H)) for seen in head["inside"]), head["inside"]
        assert head["outside"] == (True, (V, H), (V // WORLD, H))  # a DTensor of dim-0 shards outside the forward
    assert sum(h["local_numel"] for h in heads) == heads[0]["numel"]  # every parameter in exactly one process
    for head in heads:
        assert head["groups"] == {"policy": 2 + 1, "ref": 2 + 1}  # one group per block of the 2-layer model, the root
        assert head["ref_resharded"]  # the reference (no backward) gives its gathered root back after its forward


def test_fsdp_rollout_gathers_each_group_once(two_processes):
    """Generation under ``--shard fsdp`` keeps each block gathered from its first decoding step to the end (one
    all-gather per group for the rollout; before, each step's forward gathered the block and resharded it after:
    16.1 s a sharded step on the H200 against 0.4-0.9 s in one process), samples the same ids as per-token
    gathering from the same seed, and leaves every parameter sharded again for the update (the root group, which
    holds the embeddings and the head, stayed gathered after a rollout before)."""
    for r in _load(two_processes, "gen"):
        gathered, per_token = r["gathered"], r["per token"]
        assert len(gathered["sharded_after_forward"]) >= 2  # the prompt's forward and at least one decoding step
        assert not any(gathered["sharded_after_forward"]), gathered["sharded_after_forward"]
        assert all(per_token["sharded_after_forward"]), per_token["sharded_after_forward"]
        assert torch.equal(gathered["ids"], per_token["ids"])
        assert gathered["resharded"]  # per-token gathering left the root group (embeddings, head) gathered


def test_fsdp_resume_equals_uninterrupted(two_processes):
    """PPO with a CPU-offloaded reference, 2 epochs of 2 minibatches, adaptive KL: saved (DCP) at step 2 and
    resumed to 3, it logs and ends exactly as a run of 3 steps."""
    full, cut = two_processes / "full", two_processes / "cut"
    assert sharding.is_sharded_checkpoint(cut / "checkpoints" / "step_000002")
    assert sorted(p.name for p in (cut / "checkpoints" / "step_000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rng.pt", "state.json"]
    want = _strip(read_metrics(full / "metrics.jsonl"))
    assert [r["step"] for r in want] == [1, 2, 3]
    assert _strip(read_metrics(cut / "metrics.jsonl")) == want
    for r in _load(two_processes, "resume"):
        assert r["kl_coef"][0] == r["kl_coef"][1]
        assert len(r["full"]) == len(r["resumed"])
        for a, b in zip(r["full"], r["resumed"]):
            assert torch.equal(a, b)


def test_fsdp_reward_model_scores_as_the_whole_model(two_processes):
    """A sequence-classification reward model, sharded (and offloaded): each process's scores of its own
    completions equal the unsharded model's, text by text."""
    ranks = _load(two_processes, "reward")
    want = ranks[0]["want"]  # [8] texts of the global batch, in order
    for rank, r in enumerate(ranks):
        assert r["sharded"] and len(r["scores"]) == 4
        assert r["scores"] == pytest.approx(want[4 * rank : 4 * rank + 4], abs=1e-5)  # the tolerance of test_trainer_models


def test_fsdp_bfloat16_ppo_shards_the_float32_value_head_apart(two_processes):
    """FSDP2 needs one dtype per group: the critic's float32 value head is its own group, and a bfloat16 PPO
    step runs to finite metrics (it raised before)."""
    for r in _load(two_processes, "bf16"):
        assert r["value_head_group"] and r["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert [m["step"] for m in r["metrics"]] == [1]
        assert all(math.isfinite(v) for v in r["metrics"][0].values())


def test_other_dtype_modules_are_found_outside_the_blocks():
    """Without torch.distributed: which modules :func:`fsdp_wrap` shards apart for their dtype."""
    from trainer.data import tiny_tokenizer
    from trainer.models import Critic, tiny_model

    model = tiny_model(len(tiny_tokenizer()), 32, 2, 0, tiny_tokenizer()).to(torch.bfloat16)
    critic = Critic(model.model, 32)  # the value head stays float32, as load_critic leaves it
    blocks = sharding.transformer_blocks(critic)
    assert blocks == list(model.model.layers)
    assert sharding._other_dtype_modules(critic, blocks) == [critic.value_head]
    assert sharding._other_dtype_modules(critic.to(torch.bfloat16), blocks) == []


def test_fsdp_bootstrap_returns_equal_one_process(two_processes, tmp_path):
    """truncation='bootstrap' under FSDP: every process runs the critic's extra forward (on all its rows, the
    truncated ones kept), also one without truncated completions, and the returns equal one process's on the
    same global batch."""
    single = Trainer(from_dict(_cfg(tmp_path, "ppo", "ddp", truncation="bootstrap")))
    _value_half(single)
    want = single.advantages(single.score_tokens(_designed_batch(single)))
    ranks = _load(two_processes, "boot")
    # by design rank 0 holds truncated completions and rank 1 none: a forward run only where there are some would hang
    assert bool((~ranks[0]["eos"]).any()) and not bool((~ranks[1]["eos"]).any())
    # GAE over the same rewards and values, which come from forwards over other row sets (float32 rounding)
    torch.testing.assert_close(torch.cat([r["returns"] for r in ranks]), want.returns, rtol=1e-5, atol=1e-6)
    # the bootstrap term is real: without it the truncated rows' returns differ
    plain = Trainer(from_dict(_cfg(tmp_path / "plain", "ppo", "ddp")))
    _value_half(plain)
    other = plain.advantages(plain.score_tokens(_designed_batch(plain)))
    assert not torch.allclose(other.returns, want.returns, rtol=1e-5, atol=1e-6)


def test_fsdp_moving_reference_mixes_the_shards(two_processes):
    """ref_mix_alpha=0.5 under FSDP: after one step the reference is 0.5 * policy + 0.5 * the initial policy."""
    for r in _load(two_processes, "mix"):
        assert len(r["ref"]) == len(r["policy"]) == len(r["start"])
        assert any(not torch.equal(p, s) for p, s in zip(r["policy"], r["start"]))  # the step moved the policy
        # the mix in float32: t * 0.5 + s * 0.5, each product exact, one rounding of the sum
        torch.testing.assert_close(r["ref"], [0.5 * p + 0.5 * s for p, s in zip(r["policy"], r["start"])],
                                   rtol=0, atol=0)


def test_fsdp_in_one_process_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="^shard: 'fsdp'"):
        Trainer(from_dict(_cfg(tmp_path, "grpo", "fsdp")))
    with pytest.raises(ConfigError, match="^fsdp_offload_ref:"):
        from_dict(_cfg(tmp_path, "grpo", "ddp", fsdp_offload_ref=True))


def test_resume_with_another_checkpoint_format_is_a_config_error(tmp_path):
    """A whole (safetensors) checkpoint cannot be resumed as shards, nor a DCP one as whole weights."""
    Trainer(from_dict(_cfg(tmp_path, "grpo", "ddp"))).run()
    with pytest.raises(ConfigError, match="^shard: .* whole"):
        Trainer(from_dict(_cfg(tmp_path, "grpo", "fsdp", resume=True)))
    (tmp_path / "checkpoints" / "step_000001" / ".metadata").write_bytes(b"")  # as DCP marks its checkpoints
    with pytest.raises(ConfigError, match="^shard: .* sharded"):
        Trainer(from_dict(_cfg(tmp_path, "grpo", "ddp", resume=True)))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
