"""The bundled trainer: smoke runs, learning, resume, DDP equivalence, config errors, NaN stops."""
from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from rlkernels.trainer import checkpoint
from rlkernels.trainer.__main__ import main
from rlkernels.trainer.config import ConfigError, from_dict, parse_args
from rlkernels.trainer.loop import NonFiniteError, Rollout, Trainer, read_metrics
from tests.helpers import in_gloo_group

LOSSES = ["fused", "eager"]


def tiny(tmp_path, **over):
    base = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=2, prompts_per_step=4, group_size=4,
                tiny_hidden=32, save_every=0)
    return from_dict({**base, **over})


def distinct_in_group(prompts, completions, answers):
    """A test reward that differs within every contiguous group of up to 4 samples whatever was sampled, so
    advantages and returns are nonzero by design (a rule-based reward can give a whole batch the same score)."""
    return [float(i % 4) for i in range(len(completions))]


DISTINCT = f"{__name__}:distinct_in_group"


def _finite(rows):
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), (key, row)


# ------------------------------------------------------------------ smoke runs


@pytest.mark.parametrize("losses", LOSSES)
def test_grpo_smoke(tmp_path, losses):
    cfg = tiny(tmp_path, losses=losses, epochs=2, minibatches=2, ratio="sequence", entropy_coef=0.01, plot=True)
    summary = Trainer(cfg).run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for key in ("reward/mean", "loss/policy", "policy/clipfrac", "policy/kl", "policy/entropy", "perf/tokens_per_s"):
        assert key in rows[0], key
    _finite(rows)
    assert all(0 < r["perf/update_s"] < r["perf/step_s"] for r in rows)  # the update is one phase of the step
    assert rows[0]["policy/entropy"] > 0.5  # random init: near-uniform over the 16-token vocabulary
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step_000002"


@pytest.mark.parametrize("losses", LOSSES)
def test_ppo_smoke(tmp_path, losses):
    cfg = tiny(tmp_path, losses=losses, algo="ppo", epochs=2, minibatches=2, kl_target=0.01, kl_coef=0.05,
               reward=DISTINCT)
    tr = Trainer(cfg)
    assert tr.critic is not None and tr.ref is not None
    before = [p.detach().clone() for p in tr.critic.parameters()]
    tr.run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    _finite(rows)
    for key in ("loss/value", "critic/clipfrac", "critic/values_mean", "policy/kl_coef", "policy/kl_seq"):
        assert key in rows[0], key
    assert rows[1]["policy/kl_coef"] != rows[0]["policy/kl_coef"]  # the adaptive controller moved it
    # returns are nonzero by design (the reward differs within each group), so the value loss has a gradient
    assert any(bool(p.grad.ne(0).any()) for p in tr.critic.parameters() if p.grad is not None)
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.critic.parameters()))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_no_reference_model_without_kl(tmp_path, algo):
    tr = Trainer(tiny(tmp_path, losses="eager", kl_coef=0.0, algo=algo, steps=1))
    assert tr.ref is None
    tr.run()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert "policy/kl" not in row and "policy/kl_seq" not in row  # no reference, no KL (rather than a false 0)


def test_fused_and_eager_agree(tmp_path):
    """The same step with fused and eager ops gives the same metrics."""
    rows = {}
    for losses in LOSSES:
        Trainer(tiny(tmp_path / losses, losses=losses, steps=1, algo="ppo")).run()
        rows[losses] = read_metrics(tmp_path / losses / "metrics.jsonl")[0]
    for key, value in rows["eager"].items():
        if not key.startswith("perf/"):
            assert rows["fused"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


# ------------------------------------------------------------------ learning


def _expected_group_reward(tr, batch) -> torch.Tensor:
    """[prompts] the reward expected when drawing among each group's completions in proportion to their
    probability under the policy: exact (sums of token log-probs), no sampling involved."""
    with torch.no_grad():
        logp, _ = tr.policy_lp(batch.ids, batch.attention_mask, batch.labels)  # [B, R]
    seq = (logp * batch.mask).sum(-1).view(-1, tr.cfg.group_size)  # [prompts, G]
    return (seq.softmax(-1) * batch.scores.view_as(seq)).sum(-1)  # [prompts]


@pytest.mark.parametrize("losses", LOSSES)
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_updates_prefer_rewarded_completions(tmp_path, algo, losses):
    """The loop's advantages + update phases, repeated on one designed batch (no sampling, so no luck): in every
    group the policy moves probability toward the completions the reward prefers. A sign error, a misaligned
    label or mask, or advantages that ignore the rewards would lower or not move it. (How fast the embedded
    default learns with sampling is measured by its demo run, not asserted here.)"""
    tr = Trainer(tiny(tmp_path, algo=algo, losses=losses))
    batch = _designed_batch(tr)
    before = _expected_group_reward(tr, batch)  # [prompts]
    for step in range(1, 9):
        tr.update(tr.advantages(tr.score_tokens(batch)), step)
    after = _expected_group_reward(tr, batch)  # [prompts]
    assert bool((after > before).all()), (before, after)


# ------------------------------------------------------------------ phases and the minibatch loss


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_phases_return_what_they_compute(tmp_path, algo):
    """Each phase returns a new batch with its own fields filled; nothing is stashed on the trainer (a run
    leaves the same attributes __init__ created)."""
    import dataclasses

    tr = Trainer(tiny(tmp_path, losses="eager", algo=algo, epochs=2, kl_coef=0.05))
    attributes = set(vars(tr))
    rollout = tr.rollout(1)
    scored = tr.score(rollout, 1)
    tokens = tr.score_tokens(scored)
    done = tr.advantages(tokens)
    def filled(batch):
        return {f.name for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None}

    inputs = {"ids", "attention_mask", "labels", "mask", "prompts", "completions", "answers", "eos"}
    assert filled(rollout) == inputs
    assert filled(scored) == inputs | {"scores"}
    token_fields = {"old_logp", "ref_logp"} | ({"old_values"} if algo == "ppo" else set())
    assert filled(tokens) == filled(scored) | token_fields
    # kl_seq: the KL at rollout, measured whenever there are a reference and separate old log-probs (epochs = 2)
    assert filled(done) == filled(tokens) | ({"advantages", "returns", "kl_seq"} if algo == "ppo" else {"advantages", "kl_seq"})
    tr.run()
    assert set(vars(tr)) == attributes


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_minibatch_loss_is_the_reference_loss(tmp_path, algo):
    """minibatch_loss is a function of its arguments returning (loss, metrics) under namespaced keys: the fused
    loss equals rlkernels.reference's policy_loss (+ value_coef * value_loss for PPO) evaluated in float64 on
    the same per-token log-probs, entropies and values; token_scale multiplies the token means only."""
    from rlkernels import reference
    from rlkernels.trainer.loop import minibatch_loss
    from tests.helpers import assert_close_to_truth

    import dataclasses

    tr = Trainer(tiny(tmp_path, losses="fused", algo=algo, epochs=2, kl_coef=0.05, entropy_coef=0.01, max_new_tokens=3))
    cfg = tr.cfg
    batch = tr.advantages(tr.score_tokens(_designed_batch(tr)))
    noise = 0.3 * torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(5))  # [B, R]
    batch = dataclasses.replace(batch, old_logp=batch.old_logp + noise * batch.mask)  # ratios off 1: clipping acts
    before = [p.detach().clone() for p in _trained(tr)]
    loss, metrics = minibatch_loss(cfg, tr.ops, tr.policy_lp, tr.critic, batch)
    again, metrics_again = minibatch_loss(cfg, tr.ops, tr.policy_lp, tr.critic, batch)
    assert torch.equal(loss, again) and metrics == metrics_again
    assert all(torch.equal(p, q) for p, q in zip(_trained(tr), before)) and all(p.grad is None for p in _trained(tr))

    with torch.no_grad():
        logp, entropy = tr.policy_lp(batch.ids, batch.attention_mask, batch.labels)  # [B, R] x2
    f64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    grpo = algo == "grpo"
    want, want_policy = reference.policy_loss(
        f64(logp), f64(batch.old_logp), f64(batch.advantages), batch.mask, clip_low=cfg.clip_low,
        clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, ratio=cfg.ratio, ref_logp=f64(batch.ref_logp) if grpo else None,
        kl_coef=cfg.kl_coef if grpo else 0.0, kl_estimator=cfg.kl_estimator, entropy=f64(entropy),
        entropy_coef=cfg.entropy_coef, agg=cfg.agg,
    )
    want_metrics = {"loss/policy": want, **{f"policy/{k}": v for k, v in want_policy.items()}}
    r = torch.exp(f64(logp) - f64(batch.old_logp))  # [B, R] token ratios
    outside = ((r < 1 - cfg.clip_low) | (r > 1 + cfg.clip_high)) & batch.mask
    want_metrics["policy/ratio_outside"] = outside.double().sum() / batch.mask.double().sum()
    assert float(want_metrics["policy/ratio_outside"]) > float(want_policy["clipfrac"])  # a different count
    if not grpo:
        with torch.no_grad():
            values = tr.critic(batch.ids, batch.attention_mask, batch.labels)  # [B, R]
        value, want_value = reference.value_loss(f64(values), f64(batch.old_values), f64(batch.returns), batch.mask,
                                                 clip=cfg.value_clip)
        want = want + cfg.value_coef * value
        want_metrics.update({"loss/value": value, **{f"critic/{k}": v for k, v in want_value.items()}})
    assert float(want_metrics["policy/clipfrac"]) > 0  # the clip is exercised
    assert_close_to_truth(loss.detach(), want, torch.float32, name="loss")
    assert set(metrics) == set(want_metrics)
    for key, value in want_metrics.items():
        assert_close_to_truth(torch.tensor(metrics[key]), value, torch.float32, name=key)
    scaled, scaled_metrics = minibatch_loss(cfg, tr.ops, tr.policy_lp, tr.critic, batch, token_scale=2.0)
    assert scaled_metrics == metrics  # the metrics are this process's own
    # agg = token-mean: the policy loss and the value loss (always a token mean) both double
    assert_close_to_truth(scaled.detach(), 2 * want, torch.float32, name="scaled loss")


# ------------------------------------------------------------------ resume


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_resume_equals_uninterrupted(tmp_path):
    over = dict(losses="eager", algo="ppo", steps=5, save_every=2, epochs=2, minibatches=2, kl_target=0.02)
    Trainer(tiny(tmp_path / "full", **over)).run()
    full = _strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))

    def ctrl_c(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: the handler finishes the step, saves, stops

    summary = Trainer(tiny(tmp_path / "cut", **over)).run(on_step=ctrl_c)
    assert summary["interrupted"] and summary["steps"] == 3
    assert checkpoint.latest(tmp_path / "cut" / "checkpoints").name == "step_000003"
    (tmp_path / "cut" / "checkpoints" / ".tmp-step_000004-1").mkdir()  # a crash's leftovers are ignored
    resumed = Trainer(tiny(tmp_path / "cut", resume=True, **over))
    resumed.run()
    assert resumed.step == 5
    assert _strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == full


# ------------------------------------------------------------------ two processes (gloo) == one


def _designed_batch(tr, step: int = 1):
    """A rollout built by design, not sampled: the same in every process and on every machine.

    The step's real prompts (left-padded by the tokenizer) with four kinds of completion: the
    answer then EOS (exact_format reward 1), a wrong digit then EOS (0.1), the answer amid other
    tokens with no EOS (0.5), no digit (0). The first half of the batch cycles over all four, the
    second half over the first two only. Every group of 2 or 4 therefore holds different rewards
    (nonzero GRPO advantages, nonzero PPO returns), and the two halves (the two processes' shards)
    hold different numbers of tokens, whatever sampling would have given.
    """
    cfg, tok = tr.cfg, tr.tokenizer
    R = 3
    assert cfg.max_new_tokens >= R and cfg.group_size in (2, 4)
    examples = tr.prompts.batch(step, cfg.prompts_per_step)
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True)
    G = cfg.group_size
    prompt_ids = enc["input_ids"].repeat_interleave(G, 0)  # [B, P]
    prompt_mask = enc["attention_mask"].repeat_interleave(G, 0)  # [B, P]
    answers = [e.answer for e in examples for _ in range(G)]
    ids_of = tok.convert_tokens_to_ids
    rows, lengths = [], []
    for i, a in enumerate(answers):
        wrong = str((int(a) + 1) % 10)
        k = i % 4 if i < len(answers) // 2 else i % 2
        rows.append(ids_of([[a, "<eos>", "<pad>"], [wrong, "<eos>", "<pad>"], [a, "+", "="], ["+", "=", "+"]][k]))
        lengths.append(2 if k < 2 else 3)
    response = torch.tensor(rows)  # [B, R]
    mask = torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]  # [B, R]
    batch = Rollout(
        torch.cat([prompt_ids, response.masked_fill(~mask, tr.pad_id)], 1), torch.cat([prompt_mask, mask.long()], 1),
        response.masked_fill(~mask, -100), mask, [e.prompt for e in examples for _ in range(G)],
        tok.batch_decode(response.masked_fill(~mask, tr.pad_id), skip_special_tokens=True), answers,
    )
    batch = tr.score(batch, step)  # the configured reward on the designed completions
    groups = batch.scores.view(-1, G)  # [prompts, G]
    assert bool((groups.max(1).values > groups.min(1).values).all()), batch.scores  # by design, not by luck
    return batch


def _global_batch(tr, advantages=True):
    """The same designed 8-sequence batch in every process, with advantages computed as if alone."""
    rank, world, distributed = tr.rank, tr.world, tr.distributed
    tr.rank, tr.world, tr.distributed = 0, 1, False
    batch = _designed_batch(tr)
    if advantages:
        batch = tr.advantages(tr.score_tokens(batch))
    tr.rank, tr.world, tr.distributed = rank, world, distributed
    return batch


def _trained(tr):
    """Policy then critic parameters."""
    return [p for m in (tr.policy, tr.critic) if m is not None for p in m.parameters()]


def _params_and_grads(tr):
    params = _trained(tr)
    return [p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]


# AdamW's first step in float32 against its formula in float64: the parameter's final rounding (one ulp, rtol
# 2**-23) plus ~10 float32 roundings (6e-8 each) of a step no larger than lr = 3e-3 (about 2e-9; atol 5e-9)
ADAM_STEP_TOL = dict(rtol=2.0**-23, atol=5e-9)


def _adam_first_step(start, grads, lrs):
    """Parameters after AdamW's first step without weight decay: p - lr * g / (|g| + eps); bias corrections cancel."""
    out = []
    for p, g, lr in zip(start, grads, lrs):
        g64 = g.double()
        out.append((p.double() - lr * g64 / (g64.abs() + 1e-8)).float())
    return out


def _whiten_case():
    """x [2, 2, 5] with NaN at masked-out positions; rank 1's half has one masked entry, one row none."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 5, generator=g) * 3 + 1
    mask = torch.rand(2, 2, 5, generator=g) > 0.4
    mask[1] = False
    mask[1, 0, 2] = True
    return x.masked_fill(~mask, float("nan")), mask


def _ddp_worker(rank, world, init_file, out_dir, cfg_dict):
    in_gloo_group(rank, world, f"file://{init_file}", _ddp_work, rank, world, out_dir, cfg_dict)


def _ddp_work(rank, world, out_dir, cfg_dict):
    import torch.distributed as dist

    import rlkernels

    tr = Trainer(from_dict(cfg_dict))
    ppo = tr.cfg.algo == "ppo"
    # PPO: each process computes its shard's advantages itself, so whitening must be global
    batch = _global_batch(tr, advantages=not ppo)
    B = batch.ids.shape[0]
    shard = batch.select(torch.arange(rank * B // world, (rank + 1) * B // world))
    if ppo:
        shard = tr.advantages(tr.score_tokens(shard))
    tr.update(shard, 1)
    x, mask = _whiten_case()
    result = {"state": _params_and_grads(tr), "advantages": shard.advantages,
              "whiten": rlkernels.masked_whiten(x[rank], mask[rank], process_group=dist.group.WORLD)}
    torch.save(result, os.path.join(out_dir, f"ddp{rank}.pt"))


def _ddp_matches_single(tmp_path, **over):
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, **over)
    single = Trainer(from_dict(cfg_dict))
    start = [p.detach().clone() for p in _trained(single)]
    batch = _global_batch(single)
    half = batch.ids.shape[0] // 2
    # the processes hold different numbers of tokens (by design): the global token-mean rescaling matters
    assert int(batch.mask[:half].sum()) != int(batch.mask[half:].sum())
    single.update(batch, 1)
    want, want_grads = _params_and_grads(single)
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), cfg_dict), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"ddp{r}.pt") for r in range(2)]
    # the update is real, not rounding noise: the designed batch has nonzero advantages, so the gradient is nonzero
    # and Adam moves the parameters (both are exact statements about this fixed batch, no threshold)
    assert any(bool(g.ne(0).any()) for g in want_grads[: len(list(single.policy.parameters()))])
    assert any(not torch.equal(w, s) for w, s in zip(want, start))
    lrs = [group["lr"] for group in single.optimizer.param_groups for _ in group["params"]]
    assert len(lrs) == len(want)
    torch.testing.assert_close(want, _adam_first_step(start, want_grads, lrs), **ADAM_STEP_TOL)
    for got in ranks:
        got_params, got_grads = got["state"]
        assert len(got_params) == len(want)
        # gradients as DDP averaged and clipped them: each entry sums ~24 token terms through two layers in float32
        # in another order than one process; ~100 roundings of 6e-8 on terms below 1e-2 stay far below atol
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        # parameters: one AdamW step from those gradients, the same in both processes. Compared with the step's
        # formula rather than with one process's parameters: the step g / (|g| + 1e-8) turns the rounding of a
        # near-zero gradient entry into a change of up to lr, which no fixed tolerance on parameters can absorb
        torch.testing.assert_close(got_params, _adam_first_step(start, got_grads, lrs), **ADAM_STEP_TOL)
    for a, b in zip(ranks[0]["state"][0], ranks[1]["state"][0]):
        assert torch.equal(a, b)  # DDP: every process holds the same parameters
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), batch.advantages, rtol=1e-5, atol=1e-6)
    # the shared whitening equals rlkernels.masked_whiten over both halves, NaN outside the mask ignored
    x, mask = _whiten_case()
    import rlkernels

    torch.testing.assert_close(torch.stack([r["whiten"] for r in ranks]), rlkernels.masked_whiten(x, mask), equal_nan=True)
    return single, batch


def test_two_process_gloo_matches_one(tmp_path):
    _ddp_matches_single(tmp_path)


def test_two_process_gloo_ppo_matches_one(tmp_path):
    """PPO: policy and critic after a step, and the whitened advantages, equal one process on the global batch."""
    single, batch = _ddp_matches_single(tmp_path, algo="ppo", agg="seq-mean-token-mean")  # the value loss stays a token mean
    assert single.critic is not None
    # whitening each half with its own statistics would give other advantages: the test can tell
    half = batch.ids.shape[0] // 2
    own = single.ops.masked_whiten(batch.advantages[:half], batch.mask[:half])
    assert float((own - batch.advantages[:half])[batch.mask[:half]].abs().max()) > 1e-2


# ------------------------------------------------------------------ config errors


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--lr", "-1"], "lr"),
        (["--steps", "abc"], "steps"),
        (["--algo", "dpo"], "algo"),
        (["--clip-low", "1.5"], "clip_low"),
        (["--group-size", "1"], "group_size"),
        (["--model", "/no/such/model"], "model"),
        (["--reward", "nosuchmodule_xyz:fn"], "reward"),
        (["--minibatches", "3"], "minibatches"),
        (["--device", "cuda:99"], "device"),
        (["--device", "cuda:x"], "device"),
        (["--resume", "--overwrite"], "overwrite"),
        (["--resume"], "resume"),  # an empty folder: nothing to resume
    ],
)
def test_bad_config_names_field_before_compute(argv, field, monkeypatch, capsys, tmp_path):
    def no_compute(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr("rlkernels.trainer.models.load_policy", no_compute)
    monkeypatch.setattr("rlkernels.trainer.loop.load_policy", no_compute)
    assert main(argv + ["--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid configuration: {field}:" in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cuda_device_without_cuda_is_a_config_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("rlkernels.trainer.loop.load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["--device", "cuda", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlkernels-train: invalid configuration: device:") and err.count("\n") == 1, err


# ------------------------------------------------------------------ output folders: fresh, overwrite, resume

CLI = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--tiny-hidden", "32", "--save-every", "0",
       "--losses", "eager", "--no-progress", "--no-plot"]


def _one_line_error(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"rlkernels-train: invalid configuration: {prefix}") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_fresh_run_refuses_a_used_folder_unless_overwrite(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path)]
    assert main(CLI + out) == 0
    capsys.readouterr()
    before = (tmp_path / "metrics.jsonl").read_text()
    assert main(CLI + out + ["--steps", "1"]) == 2  # a fresh run would mix with the old one's files
    err = _one_line_error(capsys, "output_dir:")
    assert "--overwrite" in err and "--resume" in err
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step_000002"
    assert main(CLI + out + ["--steps", "1", "--overwrite"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # the old run's are gone
    (tmp_path / "notes.txt").write_text("mine")
    assert main(CLI + out + ["--steps", "1", "--overwrite"]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the run's own files are cleared
    assert main(CLI + ["--output-dir", str(tmp_path / "other")]) == 0  # a folder with only unrelated files is fine
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "notes.txt").write_text("mine")
    assert main(CLI + ["--output-dir", str(tmp_path / "fresh")]) == 0


def test_resume_reports_its_step_and_changed_fields(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path)]
    assert main(CLI + out) == 0
    capsys.readouterr()
    assert main(CLI + out + ["--resume", "--steps", "3", "--lr", "0.001"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "resumed from step 2" in lines[0], lines
    assert "resume: steps changed: 2 -> 3" in lines and "resume: lr changed: 0.003 -> 0.001" in lines, lines
    assert len([ln for ln in lines if " changed: " in ln]) == 2, lines
    summary = json.loads(captured.out)
    assert summary["steps"] == 3 and summary["resumed_from"] == 2 and summary["steps_run"] == 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert main(CLI + out + ["--resume", "--steps", "3", "--lr", "0.001"]) == 0  # nothing left: says so, runs 0
    captured = capsys.readouterr()
    assert "resumed from step 3" in captured.err and json.loads(captured.out)["steps_run"] == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_resume_with_another_algo_or_model_is_a_config_error(tmp_path, capsys, monkeypatch):
    out = ["--output-dir", str(tmp_path)]
    assert main(CLI + out) == 0
    capsys.readouterr()
    monkeypatch.setattr("rlkernels.trainer.loop.load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(CLI + out + ["--resume", "--algo", "ppo"]) == 2
    assert "'grpo'" in _one_line_error(capsys, "algo:")
    assert main(CLI + out + ["--resume", "--tiny-hidden", "64"]) == 2
    _one_line_error(capsys, "tiny_hidden:")
    assert main(CLI + ["--output-dir", str(tmp_path / "empty"), "--resume"]) == 2
    _one_line_error(capsys, "resume:")


def test_config_file_and_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('algo = "ppo"\nsteps = 7\nkl_target = 0.05\nlosses = "eager"\n')
    cfg = parse_args(["--config", str(toml), "--steps", "9"])
    assert (cfg.algo, cfg.steps, cfg.kl_target, cfg.losses) == ("ppo", 9, 0.05, "eager")
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"entropy_coef": "lots"}))
    with pytest.raises(ConfigError, match="^entropy_coef:"):
        parse_args(["--config", str(js)])
    js.write_text(json.dumps({"learning_rate": 1.0}))
    with pytest.raises(ConfigError, match="^learning_rate: unknown field"):
        parse_args(["--config", str(js)])
    assert parse_args(["--preset", "smollm2"]).task == "arithmetic"


def test_every_field_documented():
    from rlkernels.trainer.config import TrainConfig, build_parser, field_docs
    import dataclasses

    docs = field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    for f in dataclasses.fields(TrainConfig):
        assert docs[f.name], f.name
        assert f"--{f.name.replace('_', '-')}" in text, f.name
        assert " ".join(docs[f.name].split()[:6]) in text, f.name  # its documentation, not just the flag
    assert "--overwrite" in text and "--no-overwrite" in text


# ------------------------------------------------------------------ NaN guard


def nan_on_second_call(prompts, completions, answers):
    nan_on_second_call.calls = getattr(nan_on_second_call, "calls", 0) + 1
    out = [1.0] * len(completions)
    if nan_on_second_call.calls == 2:
        out[5] = float("nan")
    return out


def test_nan_reward_stops_with_step_named(tmp_path, capsys):
    import sys

    mod = sys.modules[__name__].__name__
    cfg = tiny(tmp_path, losses="eager", steps=4, reward=f"{mod}:nan_on_second_call")
    nan_on_second_call.calls = 0
    with pytest.raises(NonFiniteError, match=r"non-finite reward at step 2: 1 of 16 samples \(batch indices \[5\]\)"):
        Trainer(cfg).run()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


# ------------------------------------------------------------------ the extension's first build


def test_extension_build_is_announced_only_when_it_compiles(tmp_path, monkeypatch, capsys):
    """A JIT build (~40 s) says so on stderr before it starts; a cached library loads silently."""
    import shutil
    import time

    from torch.utils import cpp_extension

    from rlkernels import _extension

    csrc = tmp_path / "csrc"
    shutil.copytree(_extension.CSRC_DIR, csrc)  # a private copy: others editing csrc/ cannot touch it mid-test
    calls = []

    def fake_load(name, sources, build_directory, **kwargs):  # what ninja leaves behind, without compiling
        calls.append(name)
        open(os.path.join(build_directory, f"{name}.so"), "wb").close()

    monkeypatch.setenv("RLKERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_extension, "CSRC_DIR", str(csrc))
    monkeypatch.setattr(_extension, "_state", {"tried": False, "ops": None, "error": None, "warned": False})
    monkeypatch.setattr(_extension, "_prebuilt", lambda: None)
    monkeypatch.setattr(_extension, "cuda_build_possible", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    notice = "building the rlkernels extension (once, ~40 s)..."

    _extension._build()  # empty cache: a real build
    assert capsys.readouterr().err.count(notice) == 1
    _extension._build()  # the library is newer than every source: ninja has nothing to do
    assert notice not in capsys.readouterr().err
    future = time.time() + 3600  # later than the library just written
    for cuda_only in ("advantages_cuda.cu", "gae_kernel.h"):  # read only by a CUDA build: ninja leaves a CPU one
        os.utime(csrc / cuda_only, (future, future))
    monkeypatch.setitem(_extension._state, "announced", False)
    _extension._build()
    assert notice not in capsys.readouterr().err
    os.utime(csrc / "gae_tile.h", (future, future))  # a header advantages.cpp includes (through gae_tile_sse.h too)
    _extension._build()  # ninja recompiles
    assert capsys.readouterr().err.count(notice) == 1
    _extension._build()  # still older than the header: ninja would recompile again...
    assert notice not in capsys.readouterr().err  # ...but the notice is printed once per process
    monkeypatch.setitem(_extension._state, "announced", False)
    _extension._build()
    assert capsys.readouterr().err.count(notice) == 1
    assert len(calls) == 6  # ninja itself always runs: it decides what to rebuild


def test_fused_trainer_loads_the_extension_before_the_loop(tmp_path, monkeypatch):
    """The first step's time (and the progress bar's ETA) must not include building the extension."""
    from rlkernels import _extension

    loaded = []
    monkeypatch.setattr(_extension, "load", lambda: loaded.append(True))
    Trainer(tiny(tmp_path, losses="fused"))
    assert loaded
    loaded.clear()
    Trainer(tiny(tmp_path / "eager", losses="eager"))
    assert not loaded  # eager ops never use it


# ------------------------------------------------------------------ progress bar


def _bar_frames(err: str, steps: int) -> list[tuple[int, str]]:
    """(count, text) of every frame tqdm drew."""
    import re

    frames = []
    for text in err.replace("\n", "\r").split("\r"):
        found = re.search(rf"\b(\d+)/{steps}\b", text)
        if found:
            frames.append((int(found.group(1)), text))
    return frames


@pytest.mark.parametrize("algo, epochs", [("grpo", 1), ("ppo", 1), ("grpo", 2)])
def test_progress_bar_shows_the_current_step(tmp_path, monkeypatch, capsys, algo, epochs):
    import tqdm.auto

    class EveryUpdate(tqdm.auto.tqdm):  # draw at every update, not at most every 0.1 s
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(tqdm.auto, "tqdm", EveryUpdate)
    seen = {}
    tr = Trainer(tiny(tmp_path, losses="eager", steps=3, progress=True, algo=algo, epochs=epochs))
    tr.run(on_step=lambda step, metrics: seen.setdefault(step, metrics))
    frames = [(n, text) for n, text in _bar_frames(capsys.readouterr().err, 3) if n > 0]
    assert {n for n, _ in frames} == {1, 2, 3}
    for n, text in frames:  # every frame shows the values of the step it counts
        want = tr.progress_values(seen[n])
        for key in ("reward", "kl", "ent"):
            assert f"{key}={want[key]}" in text, (n, key, text)
        # one epoch of one minibatch: every ratio is exactly 1, so a clip fraction would always read 0
        assert ("clip=" in text) == (epochs > 1), text
    if epochs == 1:
        assert all(seen[n]["policy/clipfrac"] == 0.0 for n in seen)  # structurally zero, as the bar assumes


# ------------------------------------------------------------------ plot


def test_centred_smoothing_does_not_lag():
    from rlkernels.trainer.loop import smooth_centred

    ramp = [float(i) for i in range(60)]
    assert smooth_centred(ramp, 7) == pytest.approx(ramp)  # a trailing mean of 7 would sit 3 steps behind
    assert smooth_centred([1.0, float("nan"), 3.0, 5.0], 3) == pytest.approx([1.0, 2.0, 4.0, 5.0])
    assert math.isnan(smooth_centred([float("nan")] * 3, 3)[1])


@pytest.mark.parametrize("algo, kl_key", [("grpo", "policy/kl"), ("ppo", "policy/kl_seq")])
def test_plot_panels_have_data_labels_and_legends(tmp_path, algo, kl_key):
    from rlkernels.trainer.loop import figure

    Trainer(tiny(tmp_path, losses="eager", algo=algo, steps=3, plot=True)).run()
    assert (tmp_path / "plot.png").stat().st_size > 1000
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert kl_key in rows[0]
    fig = figure(rows)
    for ax, key in zip(fig.axes, ("reward/mean", kl_key, "policy/entropy")):
        raw = ax.get_lines()[0].get_ydata()
        assert [float(y) for y in raw] == pytest.approx([r[key] for r in rows]), key  # this run's logged values
        assert ax.get_ylabel() and ax.get_xlabel() == "step"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[0] == "raw" and "centred" in labels[1], labels
    # no reference model: the KL panel says so instead of staying empty
    fig = figure([{k: v for k, v in r.items() if not k.startswith("policy/kl")} for r in rows])
    assert "no reference" in " ".join(t.get_text() for t in fig.axes[1].texts)


# ------------------------------------------------------------------ issue 12: the fused policy head


@pytest.mark.parametrize("algo, epochs", [("grpo", 2), ("ppo", 2), ("grpo", 1)])
def test_fused_policy_head_equals_two_op(tmp_path, algo, epochs):
    """policy_head='fused' (rlkernels.linear_policy_loss from the hidden states) against 'two-op'
    (linear_logprobs then policy_loss) on the tiny model: the same loss, metrics and gradients of one minibatch,
    and the same parameters after one update (``epochs`` AdamW steps), to float32 rounding. epochs=1 is the
    on-policy GRPO update (no old log-probs: the op takes old_logp=None)."""
    import dataclasses

    from rlkernels.trainer.loop import minibatch_loss, uses_fused_head

    out = {}
    for head in ("fused", "two-op"):
        tr = Trainer(tiny(tmp_path / head, losses="fused", algo=algo, epochs=epochs, kl_coef=0.05,
                          entropy_coef=0.01 if epochs > 1 else 0.0,  # on-policy: the entropy logged, not in the loss
                          agg="seq-mean-token-mean", policy_head=head,
                          **({"clip_high": 0.28} if epochs > 1 else {})))  # refused with one epoch: ratio 1
        batch = tr.advantages(tr.score_tokens(_designed_batch(tr)))
        assert (batch.old_logp is None) == (epochs == 1)  # on-policy: no separate log-prob pass
        if batch.old_logp is not None:
            noise = 0.3 * torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(5))  # [B, R]
            batch = dataclasses.replace(batch, old_logp=batch.old_logp + noise * batch.mask)  # ratios off 1: clipping
        assert uses_fused_head(tr.cfg, batch) == (head == "fused")
        loss, metrics = minibatch_loss(tr.cfg, tr.ops, tr.policy_lp, tr.critic, batch)
        loss.backward()
        grads = [p.grad.detach().clone() for p in _trained(tr)]
        for p in _trained(tr):
            p.grad = None
        tr.update(batch, 1)
        out[head] = (loss.detach(), metrics, grads, [p.detach().clone() for p in _trained(tr)])
    (f_loss, f_metrics, f_grads, f_params), (t_loss, t_metrics, t_grads, t_params) = out["fused"], out["two-op"]
    if epochs > 1:
        assert f_metrics["policy/clipfrac"] > 0  # the clip is exercised
    else:
        assert f_metrics["policy/ratio_mean"] == 1.0 and f_metrics["policy/clipfrac"] == 0.0  # on-policy: ratio 1
    torch.testing.assert_close(f_loss, t_loss, rtol=1e-5, atol=1e-7)
    assert set(f_metrics) == set(t_metrics) and "policy/entropy" in f_metrics
    for key in t_metrics:
        torch.testing.assert_close(torch.tensor(f_metrics[key]), torch.tensor(t_metrics[key]), rtol=1e-5, atol=1e-7,
                                   msg=key)
    for g, t in zip(f_grads, t_grads):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-7)
    for p, t in zip(f_params, t_params):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
