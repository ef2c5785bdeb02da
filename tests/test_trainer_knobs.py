"""Issue 15's trainer knobs, each against a hand-computed or float64 reference on the tiny model:
reference updates, where the KL goes, KL early stop, dropout off, score normalisation, advantage and value
options, the critic from the reward model, the ratio-outside metric, and the refusal of ignored flags."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import types
from pathlib import Path

import pytest
import torch

from rlkernels import reference
from rlkernels.trainer import checkpoint, knobs, loop, process
from rlkernels.trainer.__main__ import main
from rlkernels.trainer.config import ConfigError, TrainConfig, from_dict
from rlkernels.trainer.data import tiny_tokenizer
from rlkernels.trainer.loop import Trainer, read_metrics
from rlkernels.trainer.models import tiny_model
from tests.helpers import in_gloo_group
from tests.test_trainer import CLI, DISTINCT, _designed_batch, _one_line_error, tiny
from tests.test_trainer_process import TWO_STEPS


def _state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_state(module, want: dict, exact: bool = True):
    got = module.state_dict()
    for name, w in want.items():
        if exact:
            assert torch.equal(got[name], w), name
        else:
            torch.testing.assert_close(got[name].double(), w.double(), rtol=1e-6, atol=1e-7, msg=name)


def _perturb(module, seed: int, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------ 2. reference updates


def test_mix_into_is_the_convex_combination():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    want = {k: 0.3 * b.state_dict()[k].double() + 0.7 * v.double() for k, v in a.state_dict().items()}
    knobs.mix_into(a, b, 0.3)
    _assert_state(a, want, exact=False)
    knobs.mix_into(a, b, 1.0)
    _assert_state(a, _state(b))


def test_mix_into_mixes_tied_weights_once():
    """A model whose head is tied to its embeddings (GPT-2, Qwen2.5-0.5B) lists that one tensor under two state-dict
    names; ref_mix_alpha must give alpha * policy + (1 - alpha) * reference there too, not mix it twice."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    a, b = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    assert a.lm_head.weight is a.transformer.wte.weight
    want = {k: 0.3 * b.state_dict()[k].double() + 0.7 * v.double() for k, v in a.state_dict().items()}
    knobs.mix_into(a, b, 0.3)
    _assert_state(a, want, exact=False)


@pytest.mark.parametrize("every, alpha", [(2, 0.0), (0, 0.25)])
def test_reference_update_and_mix_in_the_loop(tmp_path, every, alpha):
    """ref_update_every copies the policy after every k-th step only; ref_mix_alpha mixes after every step."""
    cfg = tiny(tmp_path, losses="eager", kl_coef=0.05, ref_update_every=every, ref_mix_alpha=alpha, steps=2,
               reward=DISTINCT)
    tr = Trainer(cfg)
    ref0 = _state(tr.ref.model)
    seen = []

    def record(step, metrics):
        seen.append((_state(tr.policy), _state(tr.ref.model)))

    tr.run(on_step=record)
    (pol1, ref1), (pol2, ref2) = seen
    if every:
        for name in ref0:  # after step 1 (not a multiple of 2) the reference is untouched
            assert torch.equal(ref1[name], ref0[name]), name
        assert any(not torch.equal(pol1[n], ref0[n]) for n in ref0)  # the policy did move
        for name in ref0:  # after step 2: an exact copy
            assert torch.equal(ref2[name], pol2[name]), name
    else:
        for name in ref0:
            want1 = alpha * pol1[name].double() + (1 - alpha) * ref0[name].double()
            torch.testing.assert_close(ref1[name].double(), want1, rtol=1e-6, atol=1e-7)
            want2 = alpha * pol2[name].double() + (1 - alpha) * ref1[name].double()
            torch.testing.assert_close(ref2[name].double(), want2, rtol=1e-6, atol=1e-7)
    assert "reference" in tr._modules()  # a moving reference is checkpointed


def test_resume_restores_a_moving_reference(tmp_path):
    cfg = tiny(tmp_path, losses="eager", kl_coef=0.05, ref_mix_alpha=0.5, steps=1, reward=DISTINCT)
    tr = Trainer(cfg)
    initial = _state(tr.ref.model)
    tr.run()
    moved = _state(tr.ref.model)
    assert any(not torch.equal(moved[n], initial[n]) for n in initial)
    resumed = Trainer(dataclasses.replace(cfg, resume=True))
    _assert_state(resumed.ref.model, initial)  # before the checkpoint is read: the initial reference
    resumed.maybe_resume()
    _assert_state(resumed.ref.model, moved)


def test_ref_model_loads_another_reference(tmp_path):
    tok = tiny_tokenizer()
    other = tiny_model(len(tok), hidden=32, layers=2, seed=123, tokenizer=tok)
    other.save_pretrained(tmp_path / "ref")
    tok.save_pretrained(tmp_path / "ref")
    tr = Trainer(tiny(tmp_path / "run", losses="eager", ref_model=str(tmp_path / "ref")))
    _assert_state(tr.ref.model, _state(other))
    assert any(not torch.equal(tr.policy.state_dict()[n], v) for n, v in other.state_dict().items())
    wide = tiny_model(len(tok) + 3, hidden=32, layers=2, seed=1, tokenizer=tok)
    wide.save_pretrained(tmp_path / "wide")
    tok.save_pretrained(tmp_path / "wide")
    with pytest.raises(ConfigError, match="^ref_model:"):
        Trainer(tiny(tmp_path / "run2", losses="eager", ref_model=str(tmp_path / "wide")))


# ------------------------------------------------------------------ 3. where the KL goes


def _scored(tr, seed=11):
    """The designed batch, scored, with the reference moved off the policy so the KL is nonzero."""
    _perturb(tr.ref.model, seed)
    return tr.score_tokens(tr.score(_designed_batch(tr), 1))


def _kl64(batch, estimator):
    return reference.kl_penalty(batch.old_logp.double(), batch.ref_logp.double(), estimator) * batch.mask.double()


def test_grpo_kl_in_reward_is_the_kl_return_to_go(tmp_path):
    tr = Trainer(tiny(tmp_path, losses="eager", kl_coef=0.1, kl_in="reward", kl_estimator="k3"))
    batch = _scored(tr)
    assert batch.old_logp is not None  # the KL at rollout needs the old log-probs even with one minibatch
    done = tr.advantages(batch)
    kl = _kl64(batch, "k3")  # [B, R]
    group = reference.group_advantages(batch.scores.double(), tr.cfg.group_size)  # [B]
    B, R = kl.shape
    want = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):  # by hand: A_t = A - c * sum of kl from t to the end
        for t in range(R):
            want[b, t] = group[b] - 0.1 * kl[b, t:].sum() if batch.mask[b, t] else 0.0
    assert float(kl.abs().sum()) > 0
    torch.testing.assert_close(done.advantages.double() * batch.mask, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(done.kl_seq.double(), kl.sum(-1), rtol=1e-5, atol=1e-6)
    # and the loss carries no KL term
    loss, logs = loop.minibatch_loss(tr.cfg, tr.ops, tr.policy_lp, None, done)
    assert "policy/kl" not in logs


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_ppo_kl_placement(tmp_path, kl_in):
    """PPO: with kl_in 'reward' the k2 KL is in GAE's per-token rewards; with 'loss' the rewards hold only the
    score and the policy loss carries kl_coef * k2 (float64 hand computation of GAE and the loss)."""
    tr = Trainer(tiny(tmp_path, losses="eager", algo="ppo", kl_coef=0.2, kl_in=kl_in, kl_estimator="k2",
                      whiten_advantages=False))
    batch = _scored(tr)
    done = tr.advantages(batch)
    m = batch.mask.double()  # [B, R]
    rewards = -0.2 * _kl64(batch, "k2") if kl_in == "reward" else torch.zeros_like(m)  # [B, R]
    last = batch.mask.long().sum(-1) - 1
    rewards[torch.arange(len(last)), last] += batch.scores.double()
    adv, ret = reference.gae(rewards, batch.old_values.double(), batch.mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(done.advantages.double() * m, adv * m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(done.returns.double() * m, ret * m, rtol=1e-5, atol=1e-6)
    _, logs = loop.minibatch_loss(tr.cfg, tr.ops, tr.policy_lp, tr.critic, done)
    with torch.no_grad():
        logp, _ = tr.policy_lp(batch.ids, batch.attention_mask, batch.labels)
    want_kl = reference.masked_mean(reference.kl_penalty(logp.double(), batch.ref_logp.double(), "k2"), m)
    if kl_in == "loss":
        assert logs["policy/kl"] == pytest.approx(float(want_kl), rel=1e-5, abs=1e-8) and float(want_kl) > 0
    else:
        assert "policy/kl" not in logs


@pytest.mark.parametrize("algo, kl_in", [("grpo", "loss"), ("grpo", "reward"), ("ppo", "loss")])
def test_adaptive_kl_controller_for_every_placement(tmp_path, algo, kl_in):
    """kl_coef_{n+1} = kl_coef_n * (1 + clip(kl_seq / target - 1, ±0.2) * batch / horizon), kl_seq being the
    logged mean per-sequence KL at rollout."""
    cfg = tiny(tmp_path, losses="eager", algo=algo, kl_in=kl_in, kl_coef=0.05, kl_target=0.5, kl_horizon=20,
               steps=2, reward=DISTINCT)
    Trainer(cfg).run()
    r1, r2 = read_metrics(tmp_path / "metrics.jsonl")
    error = max(-0.2, min(0.2, r1["policy/kl_seq"] / 0.5 - 1.0))
    assert r1["policy/kl_coef"] == 0.05
    assert r2["policy/kl_coef"] == pytest.approx(0.05 * (1 + error * 16 / 20), rel=1e-9)
    assert r2["policy/kl_coef"] != 0.05


def _adaptive_kl_worker(rank, world, init_file, out_dir, cfg_dict):
    in_gloo_group(rank, world, f"file://{init_file}", _adaptive_kl_work, rank, out_dir, cfg_dict)


def _adaptive_kl_work(rank, out_dir, cfg_dict):
    """One process of a 2-process run: kl_target set just above the global mean per-sequence KL of step 1 (so the
    controller's error is not clipped there), one step; writes ``kl<rank>.txt``: kl_coef after the step, the
    process's own mean KL and the global one."""
    import torch.distributed as dist

    tr = Trainer(from_dict(cfg_dict))
    _perturb(tr.ref.model, 11)  # the same in both processes: the KL at step 1 is nonzero
    batch, _ = tr.rollout_and_score(1)
    batch = tr.advantages(tr.score_tokens(tr.normalize_scores(batch)))
    local = float(batch.kl_seq.mean())
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    tr.cfg.kl_target = float(total) / 2 * 1.05
    tr.train_step(1)  # the same rollout again (seeded by step and rank)
    (Path(out_dir) / f"kl{rank}.txt").write_text(f"{tr.kl_coef!r} {local!r} {float(total) / 2!r}")


def test_adaptive_kl_controller_moves_kl_coef_alike_in_every_process(tmp_path):
    """Under torchrun the controller reads the global batch's mean per-sequence KL (what policy/kl_seq logs), so
    every process keeps the same kl_coef (each one's own mean made them drift apart: another KL weight per
    process, and the checkpoint kept rank 0's)."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=4, save_every=0, reward=DISTINCT, kl_coef=0.05,
                    kl_target=1.0, kl_horizon=20)
    torch.multiprocessing.spawn(_adaptive_kl_worker, args=(2, str(tmp_path / "init"), str(tmp_path), cfg_dict),
                                nprocs=2, join=True)
    rows = [[float(x) for x in (tmp_path / f"kl{rank}.txt").read_text().split()] for rank in range(2)]
    locals_ = [row[1] for row in rows]
    glob = rows[0][2]
    assert locals_[0] != locals_[1]  # the processes' own means differ (else the test could not fail)
    want = 0.05 * (1 + (1 / 1.05 - 1) * 8 / 20)
    for coef, _, _ in rows:
        assert coef == pytest.approx(want, rel=1e-9)
    assert glob == pytest.approx(sum(locals_) / 2, rel=1e-12)


# ------------------------------------------------------------------ 4. KL early stop


def test_target_kl_stops_at_the_right_minibatch(tmp_path, monkeypatch):
    """The first minibatch whose approx KL exceeds 1.5 * target_kl is not applied, nor any later one."""
    calls = []
    real = loop.minibatch_loss

    def recording(*args, **kwargs):
        loss, logs = real(*args, **kwargs)
        calls.append(logs["policy/approx_kl"])
        return loss, logs

    monkeypatch.setattr(loop, "minibatch_loss", recording)
    over = dict(losses="eager", epochs=2, minibatches=2, lr=0.05, steps=1, reward=DISTINCT)
    Trainer(tiny(tmp_path / "free", target_kl=1e9, **over)).run()
    free, calls[:] = list(calls), []
    assert len(free) == 4 and free[0] == 0.0  # same weights at the first minibatch
    # a target the second minibatch exceeds but not 1.5 times: a stop at KL > target would come one minibatch early
    target = free[1] / 1.2
    j = next(i for i in range(4) if free[i] > 1.5 * target)
    assert j >= 2 and free[1] > target
    Trainer(tiny(tmp_path / "stop", target_kl=target, **over)).run()
    assert calls == free[: j + 1]  # the same updates up to the stop, then none
    row = read_metrics(tmp_path / "stop" / "metrics.jsonl")[0]
    assert row["policy/early_stop"] == 1.0 and row["policy/updates"] == j
    assert read_metrics(tmp_path / "free" / "metrics.jsonl")[0]["policy/early_stop"] == 0.0


# ------------------------------------------------------------------ 5. dropout off


def _dropout_gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(3)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)


def test_dropout_off_gives_ratio_one_at_the_first_minibatch(tmp_path, monkeypatch):
    _dropout_gpt2(tmp_path / "gpt2")
    calls = []
    real = loop.minibatch_loss

    def recording(*args, **kwargs):
        loss, logs = real(*args, **kwargs)
        calls.append(logs)
        return loss, logs

    monkeypatch.setattr(loop, "minibatch_loss", recording)
    over = dict(model=str(tmp_path / "gpt2"), losses="eager", minibatches=2, steps=1, algo="ppo", kl_coef=0.05,
                progress=False, plot=False, prompts_per_step=4, group_size=4, save_every=0)
    tr = Trainer(from_dict(dict(output_dir=str(tmp_path / "run"), **over)))
    for model in (tr.policy, tr.critic, tr.ref.model):
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert tr.policy.config.resid_pdrop == tr.policy.config.attn_pdrop == tr.policy.config.embd_pdrop == 0.0
    assert tr.policy.training  # train mode is kept
    tr.run()
    assert calls[0]["policy/ratio_mean"] == 1.0 and calls[0]["policy/approx_kl"] == 0.0  # exactly
    # without it the same run's ratios are off 1 (so the assertion above can fail)
    monkeypatch.setattr(knobs, "disable_dropout", lambda model: model)
    calls.clear()
    Trainer(from_dict(dict(output_dir=str(tmp_path / "run2"), **over))).run()
    assert calls[0]["policy/approx_kl"] != 0.0


def test_disable_dropout_also_stops_the_moe_router_jitter():
    """Mixtral's (MiniMax's, Switch's) router multiplies its input by uniform noise in train mode when
    router_jitter_noise > 0 (DBRX: moe_jitter_eps): two train-mode forwards of the same tokens differed after
    disable_dropout, so the update's log-probs were not the old ones' function. The jitter is 0 too now."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.1)
    torch.manual_seed(0)
    model = knobs.disable_dropout(MixtralForCausalLM(config)).train()
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)


# ------------------------------------------------------------------ 7. score normalisation


def test_score_normalizer_against_float64():
    torch.manual_seed(0)
    batches = [torch.randn(5) * 3 + 1, torch.randn(7) * 2 - 4, torch.randn(4)]
    run = knobs.ScoreNormalizer("running")
    noshift = knobs.ScoreNormalizer("running", shift=False, clip=0.7)
    seen = []
    for x in batches:
        seen.append(x.double())
        pool = torch.cat(seen)
        mean, var = pool.mean(), pool.var(unbiased=True)
        torch.testing.assert_close(run(x).double(), (x.double() - mean) / torch.sqrt(var + 1e-8), rtol=1e-5, atol=1e-6)
        want = (x.double() / torch.sqrt(var + 1e-8)).clamp(-0.7, 0.7)
        torch.testing.assert_close(noshift(x).double(), want, rtol=1e-5, atol=1e-6)
    assert run.count == 16 and run.mean == pytest.approx(float(pool.mean()), rel=1e-12)
    x = batches[1]
    want = (x.double() - x.double().mean()) / torch.sqrt(x.double().var() + 1e-8)
    torch.testing.assert_close(knobs.ScoreNormalizer("batch")(x).double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(knobs.ScoreNormalizer("none", clip=0.5)(torch.tensor([2.0, -0.2, -3.0])),
                       torch.tensor([0.5, -0.2, -0.5]))
    assert torch.equal(knobs.ScoreNormalizer("running")(torch.tensor([3.0])), torch.tensor([0.0]))  # one score: scale 1


def test_sharded_checkpoint_keeps_the_running_reward_statistics(tmp_path, monkeypatch):
    """shard='fsdp' writes its checkpoints with trainer.distributed.save: they must carry reward_norm 'running''s
    statistics (restored on --resume) as the whole checkpoints do, in state.json (JSON)."""
    import json

    tr = Trainer(tiny(tmp_path, losses="eager", reward=DISTINCT, reward_norm="running", reward_clip=1.0))
    tr.score_norm.update(torch.tensor([1.0, 2.0, 4.0]))
    written = {}
    monkeypatch.setattr(loop.sharding, "save", lambda root, step, modules, optimizer, extra: written.update(extra))
    tr.cfg.shard = "fsdp"  # (a 2-process run is not needed to see what the sharded save is handed)
    tr.save()
    assert json.loads(json.dumps(written["reward_norm"])) == tr.score_norm.state_dict()


def test_reward_norm_in_the_loop_and_resume(tmp_path):
    """The advantages see the normalised scores, reward/mean logs the raw ones, and resume restores the running
    statistics from the checkpoint."""
    cfg = tiny(tmp_path, losses="eager", reward=DISTINCT, reward_norm="running", reward_clip=1.0, steps=2, save_every=1)
    tr = Trainer(cfg)
    raw = torch.tensor([float(i % 4) for i in range(16)], dtype=torch.float64)  # DISTINCT's scores
    batch = tr.normalize_scores(tr.score(_designed_batch(tr), 1))
    want = ((raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)).clamp(-1, 1)
    torch.testing.assert_close(batch.scores.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.raw_scores, raw.float())
    tr = Trainer(cfg)
    tr.run()
    state = tr.score_norm.state_dict()
    assert state["count"] == 32
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/mean"] == pytest.approx(1.5)
    resumed = Trainer(dataclasses.replace(cfg, resume=True, steps=2))
    resumed.maybe_resume()
    assert resumed.score_norm.state_dict() == state


# ------------------------------------------------------------------ 8. advantage and value options


def test_ppo_whitening_switch_and_value_agg(tmp_path):
    tr = Trainer(tiny(tmp_path, losses="eager", algo="ppo", kl_coef=0.0, whiten_advantages=False,
                      value_agg="seq-mean-token-sum"))
    batch = tr.score_tokens(tr.score(_designed_batch(tr), 1))
    done = tr.advantages(batch)
    rewards = torch.zeros(batch.mask.shape, dtype=torch.float64)
    last = batch.mask.long().sum(-1) - 1
    rewards[torch.arange(len(last)), last] += batch.scores.double()
    adv, ret = reference.gae(rewards, batch.old_values.double(), batch.mask, gamma=1.0, lam=0.95)
    m = batch.mask.double()
    torch.testing.assert_close(done.advantages.double() * m, adv * m, rtol=1e-5, atol=1e-6)  # not whitened
    _, logs = loop.minibatch_loss(tr.cfg, tr.ops, tr.policy_lp, tr.critic, done)
    with torch.no_grad():
        values = tr.critic(batch.ids, batch.attention_mask, batch.labels)
    want, _ = reference.value_loss(values.double(), done.old_values.double(), done.returns.double(), batch.mask,
                                   clip=0.2, agg="seq-mean-token-sum")
    assert logs["loss/value"] == pytest.approx(float(want), rel=1e-5)
    token_mean, _ = reference.value_loss(values.double(), done.old_values.double(), done.returns.double(), batch.mask,
                                         clip=0.2)
    assert float(want) != pytest.approx(float(token_mean), rel=1e-3)  # the choice matters here


def test_critic_init_from_the_reward_model(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(5)
    rm = LlamaForSequenceClassification(config)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    tr = Trainer(tiny(tmp_path / "run", losses="eager", algo="ppo", reward=str(tmp_path / "rm"), critic_init="reward",
                      kl_coef=0.0))
    _assert_state(tr.critic.backbone, _state(rm.model))
    assert torch.equal(tr.critic.value_head.weight, rm.score.weight) and float(tr.critic.value_head.bias.detach()) == 0.0
    batch = tr.score(_designed_batch(tr), 1)
    with torch.no_grad():  # the critic's value at each sequence's last token is the reward model's score there
        values = tr.critic(batch.ids, batch.attention_mask, batch.labels)  # [B, R]
        hidden = rm.model(input_ids=batch.ids, attention_mask=batch.attention_mask,
                          position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        want = rm.score(hidden)[..., 0][:, -batch.mask.shape[1] - 1 : -1]  # [B, R]
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ metrics


def test_ratio_outside_by_hand():
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.7, 1.1], [1.25, 0.85, 1.0, 9.0]]))  # ratios (old_logp = 0)
    old = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    # [0.8, 1.2]: outside are 1.5, 0.7, 1.25 (9.0 is masked out) -> 3 of 7
    assert knobs.ratio_outside(logp, old, mask, "token", 0.2, 0.2) == pytest.approx(3 / 7)
    # sequence ratios: exp(mean log r) = (1*1.5*0.7*1.1)^(1/4) = 1.0367, (1.25*0.85*1)^(1/3) = 1.0204
    assert knobs.ratio_outside(logp, old, mask, "sequence", 0.2, 0.03) == pytest.approx(4 / 7)
    assert knobs.ratio_outside(logp, old, mask, "sequence", 0.2, 0.02) == pytest.approx(7 / 7)
    assert knobs.ratio_outside(logp, old, mask, "sequence", 0.2, 0.2) == 0.0


# ------------------------------------------------------------------ honesty


@pytest.mark.parametrize("over, flag", [
    (dict(kl_coef=0.0, kl_estimator="k2"), "kl_estimator"),
    (dict(kl_coef=0.0, kl_target=0.1), "kl_target"),
    (dict(kl_coef=0.0, kl_in="reward"), "kl_in"),
    (dict(kl_coef=0.0, ref_update_every=3), "ref_update_every"),
    (dict(kl_coef=0.0, ref_mix_alpha=0.5), "ref_mix_alpha"),
    (dict(kl_horizon=500), "kl_horizon"),
    (dict(gamma=0.99), "gamma"),
    (dict(lam=0.9), "lam"),
    (dict(value_clip=None), "value_clip"),
    (dict(value_coef=0.5), "value_coef"),  # set explicitly, even to its default
    (dict(value_agg="seq-mean-token-mean"), "value_agg"),
    (dict(critic_lr=1e-4), "critic_lr"),
    (dict(whiten_advantages=False), "whiten_advantages"),
    (dict(algo="ppo", advantage="rloo"), "advantage"),
    (dict(target_kl=0.01), "target_kl"),
    (dict(reward_norm_shift=False), "reward_norm_shift"),
    (dict(algo="ppo", critic_init="reward"), "critic_init"),
    (dict(tiny_layers=3, model="MODEL_DIR"), "tiny_layers"),  # another model: a directory with a config.json
])
def test_ignored_flags_are_refused(tmp_path, over, flag):
    if over.get("model") == "MODEL_DIR":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        over = {**over, "model": str(tmp_path / "model")}
    with pytest.raises(ConfigError, match=f"^{flag}:"):
        from_dict(dict(output_dir=str(tmp_path), **over))


def test_defaults_and_presets_are_not_refused(tmp_path):
    cfg = from_dict(dict(output_dir=str(tmp_path)))
    assert (cfg.clip_high, cfg.kl_in, cfg.kl_estimator) == (0.2, "loss", "k3")  # clip_high follows clip_low
    assert from_dict(dict(output_dir=str(tmp_path), clip_low=0.1, epochs=2)).clip_high == 0.1
    ppo = from_dict(dict(output_dir=str(tmp_path), algo="ppo", kl_target=0.1, kl_horizon=500, target_kl=0.02, epochs=2))
    assert (ppo.kl_in, ppo.kl_estimator) == ("reward", "k1")
    assert from_dict(dict(output_dir=str(tmp_path), kl_coef=0.0)).kl_estimator is None  # no KL anywhere
    TrainConfig(output_dir=str(tmp_path)).validate()  # built directly: compared with the defaults
    with pytest.raises(ConfigError, match="^gamma:"):
        TrainConfig(output_dir=str(tmp_path), gamma=0.9).validate()


# ------------------------------------------------------------------ start-up refusals found by hostile use


@pytest.mark.parametrize("name", ["lr", "critic_lr", "temperature", "kl_coef", "entropy_coef", "weight_decay",
                                  "value_coef", "dual_clip", "kl_target"])
def test_an_infinite_value_is_refused_at_start_up(name):
    # inf used to pass the range checks and fail later, deep in generate() or the loss, without naming the flag
    with pytest.raises(ConfigError, match=f"^{name}: must be finite"):
        from_dict({name: float("inf")})


@pytest.mark.parametrize("values, name", [
    ({"losses": "eager", "policy_head": "two-op"}, "policy_head"),
    ({"losses": "eager", "policy_head": "fused"}, "policy_head"),
    ({"shard": "fsdp", "policy_head": "fused"}, "policy_head"),
    ({"shard": "fsdp", "fsdp_offload_ref": True, "kl_coef": 0.0}, "fsdp_offload_ref"),
    ({"recipe": "dapo", "algo": "ppo", "group_size": 1}, "algo"),
    ({"recipe": "instructgpt", "algo": "grpo", "group_size": 4}, "algo"),
    ({"recipe": "instructgpt", "algo": "grpo"}, "algo"),  # not group_size: the 1 is the recipe's, not the user's
    ({"algo": "ppo", "value_clip": 0.2}, "value_clip"),  # one epoch of one minibatch: the values are the old ones
    ({"algo": "ppo", "value_coef": 0.0, "critic_lr": 1e-3, "epochs": 2}, "critic_lr"),
    ({"algo": "ppo", "value_coef": 0.0, "value_agg": "seq-mean-token-sum"}, "value_agg"),
    ({"algo": "ppo", "value_coef": 0.0, "value_clip": 0.2, "epochs": 2}, "value_clip"),
    ({"algo": "ppo", "gamma": 0.0, "lam": 0.5}, "lam"),
    ({"algo": "ppo", "gamma": 0.0, "truncation": "bootstrap"}, "truncation"),
    ({"steps": 3, "save_every": 3}, "save_every"),
    ({"reward_norm": "batch"}, "reward_norm"),  # group z-scores undo any shift and scale of the scores
    ({"reward_norm": "running", "kl_coef": 0.0}, "reward_norm"),
    ({"reward_norm": "batch", "kl_in": "reward"}, "reward_norm"),  # the KL is subtracted after the z-scores
    ({"reward_norm": "batch", "reward_norm_shift": False, "advantage": "dr_grpo"}, "reward_norm_shift"),
    ({"reward_norm": "running", "reward_norm_shift": False, "advantage": "rloo"}, "reward_norm_shift"),
    ({"kl_coef": 0.1, "ref_update_every": 2, "ref_mix_alpha": 1.0}, "ref_update_every"),  # alpha 1 copies anyway
    ({"kl_coef": 1e39}, "kl_coef"),  # past float32: the losses would refuse it inside step 1
    ({"epochs": 2, "clip_high": 1e39}, "clip_high"),
    ({"entropy_coef": -1e39}, "entropy_coef"),
    ({"algo": "ppo", "epochs": 2, "value_clip": 1e39}, "value_clip"),
    ({"temperature": 1e-40}, "temperature"),  # 1 / temperature overflows float32
])
def test_a_flag_that_would_do_nothing_is_refused(values, name):
    with pytest.raises(ConfigError, match=f"^{name}:"):
        from_dict(values)


def test_what_those_refusals_still_accept():
    assert from_dict({"recipe": "dapo", "algo": "grpo"}).algo == "grpo"
    assert from_dict({"shard": "fsdp", "policy_head": "two-op"}).policy_head == "two-op"
    assert from_dict({"shard": "fsdp", "fsdp_offload_ref": True, "kl_coef": 0.01}).fsdp_offload_ref
    assert from_dict({"max_grad_norm": float("inf")}).max_grad_norm == float("inf")  # no clipping: meaningful
    assert from_dict({"algo": "ppo", "value_clip": 0.2, "epochs": 2}).value_clip == 0.2
    assert from_dict({"algo": "ppo", "gamma": 0.5, "lam": 0.5, "truncation": "bootstrap"}).truncation == "bootstrap"
    assert from_dict({"algo": "ppo", "value_coef": 0.0}).value_coef == 0.0  # the critic still gives GAE its values
    assert from_dict({"steps": 3, "save_every": 2}).save_every == 2
    assert from_dict({"steps": 3, "save_every": 0}).save_every == 0
    for values in ({"reward_norm": "batch", "reward_clip": 1.0}, {"reward_norm": "batch", "advantage": "dr_grpo"},
                   {"reward_norm": "running", "advantage": "rloo"},
                   {"reward_norm": "batch", "reward_norm_shift": False, "reward_clip": 2.0},
                   {"algo": "ppo", "reward_norm": "batch", "reward_norm_shift": False}):
        assert from_dict(values).reward_norm == values["reward_norm"], values
    assert from_dict({"kl_coef": 0.1, "ref_mix_alpha": 1.0}).ref_mix_alpha == 1.0
    for recipe in ("deepseek-grpo", "instructgpt"):  # a recipe's KL placement is not recorded once kl_coef is 0
        cfg = from_dict({"recipe": recipe, "kl_coef": 0.0})
        assert (cfg.kl_in, cfg.kl_estimator) == (None, None), recipe


# ------------------------------------------------------------------ ratio 'sequence' where it changes nothing


@pytest.mark.parametrize("agg", reference.AGG_MODES)
def test_sequence_ratio_is_the_token_ratio_at_ratio_one_with_outcome_advantages(tmp_path, agg):
    """Why ratio 'sequence' is refused under GRPO with one epoch of one minibatch: every ratio is then exactly 1
    (old = the update's own log-probs, detached), and with one advantage per sequence GSPO's gradient, -A / n on
    each of a sequence's n tokens, summed over them, is the token ratio's -A, in every agg mode (KL in the loss
    included). With advantages that differ along a sequence (step rewards, a KL in the reward) it is not."""
    cfg = tiny(tmp_path, losses="eager", reward=DISTINCT, agg=agg, kl_coef=0.05)  # ratio 'token'; KL in the loss
    tr = Trainer(cfg)
    _perturb(tr.ref.model, 3)
    batch = tr.advantages(tr.score_tokens(_designed_batch(tr)))
    assert batch.old_logp is None and batch.advantages.dim() == 1  # on-policy; one advantage per sequence

    def grads(ratio, advantages):
        tr.policy.zero_grad(set_to_none=True)
        mb = dataclasses.replace(batch, advantages=advantages)
        loss, logs = loop.minibatch_loss(dataclasses.replace(cfg, ratio=ratio), tr.ops, tr.policy_lp, None, mb)
        assert logs["policy/ratio_mean"] == 1.0 and logs["policy/kl"] > 0
        loss.backward()
        return [p.grad.clone() for p in tr.policy.parameters() if p.grad is not None]

    for token, sequence in zip(grads("token", batch.advantages), grads("sequence", batch.advantages), strict=True):
        torch.testing.assert_close(sequence, token, rtol=1e-5, atol=1e-7)
    R = batch.mask.shape[1]
    along = batch.advantages[:, None] * torch.linspace(0.2, 1.8, R)  # [B, R] advantages that change along a sequence
    token, sequence = grads("token", along), grads("sequence", along)
    assert max(float((s - t).abs().max()) for s, t in zip(sequence, token)) > 1e-3


@pytest.mark.parametrize("values", [
    {"ratio": "sequence"},  # the default: GRPO, reward 'exact_format', KL in the loss
    {"ratio": "sequence", "kl_coef": 0.0, "reward": "exact", "agg": "seq-mean-token-sum"},
    {"ratio": "sequence", "reward": "format", "kl_in": "loss", "entropy_coef": 0.01},
    {"ratio": "sequence", "epochs": 1, "minibatches": 1, "reward": "exact_format", "advantage": "rloo"},
    {"recipe": "gspo", "ratio": "sequence", "minibatches": 1},  # set again by the user: the recipe's 4 undone
    {"recipe": "gspo", "minibatches": 1},  # the recipe's ratio is the user's choice too
])
def test_sequence_ratio_with_an_outcome_rule_is_refused_at_start_up(values):
    with pytest.raises(ConfigError, match=r"^ratio: reward '\w+' gives outcome rewards .* exactly 1"):
        from_dict(values)


def test_sequence_ratio_with_a_reward_model_is_refused_at_start_up(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    with pytest.raises(ConfigError, match="^ratio: reward .* gives outcome rewards"):
        from_dict({"ratio": "sequence", "reward": str(tmp_path / "rm")})
    assert from_dict({"ratio": "sequence", "reward": str(tmp_path / "rm"), "epochs": 2}).ratio == "sequence"


@pytest.mark.parametrize("over", [dict(kl_coef=0.0), dict(kl_coef=0.05, agg="seq-mean-token-sum-norm")])
def test_sequence_ratio_refused_at_the_first_outcome_batch_before_any_update(tmp_path, monkeypatch, over):
    """A 'module:function' says what it returns only when called: refused at the first batch, naming ratio,
    before any loss or optimizer step, and the fresh run leaves nothing behind."""
    cfg = tiny(tmp_path, losses="eager", reward=DISTINCT, ratio="sequence", **over)  # accepted at start-up
    tr = Trainer(cfg)
    losses, steps = [], []
    monkeypatch.setattr(loop, "minibatch_loss", lambda *args, **kwargs: losses.append(1))
    monkeypatch.setattr(tr.optimizer, "step", lambda *args, **kwargs: steps.append(1))
    before = _state(tr.policy)
    with pytest.raises(ConfigError, match="^ratio: the reward .*distinct_in_group' returned outcome rewards"):
        tr.run()
    assert losses == [] and steps == [] and tr.step == 0
    _assert_state(tr.policy, before)
    assert checkpoint.run_files(tmp_path) == []  # no config.json, metrics or checkpoint: the folder takes a rerun


def test_sequence_ratio_refused_at_the_first_batch_from_the_command_line(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path), "--reward", DISTINCT]
    assert main(CLI + out + ["--ratio", "sequence"]) == 2
    err = _one_line_error(capsys, "ratio: the reward")
    assert "outcome rewards" in err and "epochs or minibatches above 1" in err
    assert main(CLI + out + ["--ratio", "sequence", "--epochs", "2", "--steps", "1"]) == 0  # same folder, no overwrite


def test_steps_that_all_end_at_the_last_token_act_as_outcome_rewards():
    lengths = torch.tensor([3, 1, 4])  # [B]
    ends = torch.tensor([[2, 0], [0, 0], [3, 1]])  # [B, S]
    mask = torch.tensor([[True, False], [True, True], [True, False]])  # [B, S]
    assert process.steps_all_end_last((torch.zeros(3, 2), ends, mask), lengths)
    mask[2, 1] = True  # a step of the third completion ends at its token 1 of 4
    assert not process.steps_all_end_last((torch.zeros(3, 2), ends, mask), lengths)


def one_step_at_the_end(prompts, completions, answers, completion_tokens):
    return [[(float(i % 3), len(t) - 1)] for i, t in enumerate(completion_tokens)]


def steps_first_then_outcomes(prompts, completions, answers, completion_tokens):
    """Step rewards at the first call in this process, outcome rewards after it."""
    CALLS["n"] += 1
    if CALLS["n"] == 1:
        return [[(float(i % 3), 0), (1.0, len(t) - 1)] for i, t in enumerate(completion_tokens)]
    return [float(i % 4) for i in range(len(completions))]


CALLS = {"n": 0}


def test_sequence_ratio_refused_for_step_rewards_that_act_as_outcome_rewards(tmp_path):
    """One step per completion ending at its last token gives every token the same advantage: refused as outcome
    rewards are."""
    tr = Trainer(tiny(tmp_path, losses="eager", reward=f"{__name__}:one_step_at_the_end", ratio="sequence",
                      kl_coef=0.0))
    with pytest.raises(ConfigError, match="^ratio: the reward .* or step rewards that all end at a completion's last"):
        tr.run()
    assert tr.step == 0 and checkpoint.run_files(tmp_path) == []


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_first_batch_leaves_an_earlier_run_as_it_was(tmp_path):
    """The first batch is scored before the folder changes: a refusal there leaves the run that --overwrite would
    have deleted, and the config and log of a run that --resume would have continued, as they were."""
    base = dict(losses="eager", reward=DISTINCT, steps=1)
    Trainer(tiny(tmp_path, **base)).run()
    before = _files(tmp_path)
    assert {"config.json", "metrics.jsonl"} <= set(before) and any(n.startswith("checkpoints") for n in before)
    with pytest.raises(ConfigError, match="^ratio: the reward"):
        Trainer(tiny(tmp_path, **base, ratio="sequence", overwrite=True)).run()
    assert _files(tmp_path) == before
    with pytest.raises(ConfigError, match="^ratio: the reward"):  # ratio changed on resume: decided again
        Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "ratio": "sequence"})).run()
    assert _files(tmp_path) == before


def test_a_resume_keeps_the_first_batchs_acceptance(tmp_path):
    """A run accepted at its first batch (step rewards) is not refused when its resumed first batch happens to hold
    outcome rewards; a resume that changes a field the decision depends on is decided again."""
    CALLS["n"] = 0
    base = dict(losses="eager", reward=f"{__name__}:steps_first_then_outcomes", ratio="sequence", kl_coef=0.0)
    assert Trainer(tiny(tmp_path, **base, steps=1)).run()["steps"] == 1
    assert Trainer(tiny(tmp_path, **base, steps=2, resume=True)).run()["steps"] == 2  # outcome rewards at step 2
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(ConfigError, match="^ratio: the reward"):  # kl_coef changed: step 3's outcome rewards decide
        Trainer(tiny(tmp_path, **{**base, "steps": 3, "resume": True, "kl_coef": 0.05})).run()


@pytest.mark.parametrize("over", [
    dict(epochs=2),
    dict(minibatches=2),
    dict(reward=TWO_STEPS, kl_coef=0.0),  # process supervision: per-token advantages
    dict(reward=TWO_STEPS, kl_coef=0.05, advantage="dr_grpo"),
    dict(kl_coef=0.05, kl_in="reward"),  # the KL's return to go makes the advantages per token
    dict(algo="ppo"),  # GAE: per-token advantages (the KL in the reward by default)
    dict(algo="ppo", kl_coef=0.0),
])
def test_sequence_ratio_still_runs_where_it_matters(tmp_path, over):
    cfg = tiny(tmp_path, losses="eager", reward=over.pop("reward", DISTINCT), ratio="sequence", steps=1, **over)
    tr = Trainer(cfg)
    before = _state(tr.policy)
    assert tr.run()["steps"] == 1
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 1
    assert any(not torch.equal(tr.policy.state_dict()[n], w) for n, w in before.items())  # an update was applied


RANK_STEPS = {"rank": None}  # the process whose reward function returns step rewards (set in the worker)


def steps_in_one_rank(prompts, completions, answers, completion_tokens):
    import torch.distributed as dist

    if dist.get_rank() == RANK_STEPS["rank"]:  # two steps per completion: its first token, its last
        return [[(float(i % 3), 0), (1.0, len(t) - 1)] for i, t in enumerate(completion_tokens)]
    return [float(i % 4) for i in range(len(completions))]


def _score_worker(rank, world, init_file, out_dir, cfg_dict, knob):
    in_gloo_group(rank, world, f"file://{init_file}", _score_work, rank, out_dir, cfg_dict, knob)


def _score_work(rank, out_dir, cfg_dict, knob):
    """One process's score phase of a 2-process run; writes ``score<rank>.txt``: "scored", or the error's class and
    message ("ConfigError|ratio: ..."). ``knob``: (a global dict of this module, key, value) set first."""
    table, key, value = knob
    globals()[table][key] = value
    tr = Trainer(from_dict(cfg_dict))
    try:
        tr.score(tr.rollout(1), 1)
        said = "scored"
    except (Exception, SystemExit) as error:  # noqa: BLE001  (the class is what the tests check)
        said = f"{type(error).__name__}|{error}"
    (Path(out_dir) / f"score{rank}.txt").write_text(said)


def _score_in_two_processes(tmp_path, cfg_dict, knob) -> list[str]:
    torch.multiprocessing.spawn(_score_worker, args=(2, str(tmp_path / "init"), str(tmp_path), cfg_dict, knob),
                                nprocs=2, join=True)
    return [(tmp_path / f"score{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.parametrize("steps_rank", [None, 1])
def test_sequence_ratio_first_batch_decided_by_every_process(tmp_path, steps_rank):
    """Under torchrun each process scores its own share: the refusal is taken together (one process's step
    rewards make the ratio matter), so no process stops while the others wait for it."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, save_every=0, ratio="sequence",
                    reward=f"{__name__}:steps_in_one_rank")
    said = _score_in_two_processes(tmp_path, cfg_dict, ("RANK_STEPS", "rank", steps_rank))
    if steps_rank is None:
        assert all(s.startswith("ConfigError|ratio: the reward") for s in said), said
    else:
        assert said == ["scored", "scored"]


STOPPING = {"rank": 1, "how": None}  # the process whose reward function misbehaves, and how (set in the worker)


def misbehaves_in_one_rank(prompts, completions, answers, completion_tokens):
    import torch.distributed as dist

    if dist.get_rank() == STOPPING["rank"]:
        if STOPPING["how"] == "nan":
            return [float("nan")] + [0.0] * (len(completions) - 1)
        if STOPPING["how"] == "malformed":
            return [0.0] * (len(completions) - 1)  # one reward short
        if STOPPING["how"] in ("steps", "mixed"):  # step rewards, which advantage 'rloo' refuses
            return [[(1.0, len(t) - 1)] for t in completion_tokens]
        if STOPPING["how"] == "raises":  # the user's own bug
            return [answers[i]["missing"] for i in range(len(completions))]
        if STOPPING["how"] == "exits":  # the user's code (or a library it calls) gives up with sys.exit
            raise SystemExit(3)
    elif STOPPING["how"] == "mixed":  # process 0 stops too, with another kind of error
        return [float("nan")] * len(completions)
    return [float(i % 4) for i in range(len(completions))]


@pytest.mark.parametrize("how, kind, starts", [("nan", "NonFiniteError", "non-finite reward"),
                                               ("malformed", "RewardError", "reward:"),
                                               ("steps", "ConfigError", "advantage:"),
                                               (None, None, None)])
def test_a_process_that_stops_in_the_score_phase_stops_them_all(tmp_path, how, kind, starts):
    """Under torchrun each process runs the reward function on its own share: when one of them stops there (a NaN
    reward, a malformed return, step rewards a flag refuses), every process stops with the same kind of error --
    the one that stopped with its own, the others with its message (a ConfigError's still starting with the
    field) -- instead of the others waiting for it in the next collective; the CLI's exit status is then the same
    everywhere. Without a misbehaving process both score their batches."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, save_every=0, advantage="rloo",
                    reward=f"{__name__}:misbehaves_in_one_rank")
    said = _score_in_two_processes(tmp_path, cfg_dict, ("STOPPING", "how", how))
    if how is None:
        assert said == ["scored", "scored"]
        return
    kinds = [s.split("|", 1)[0] for s in said]
    messages = [s.split("|", 1)[1] for s in said]
    assert kinds == [kind, kind], said
    assert messages[1].startswith(starts), said
    if kind == "ConfigError":
        assert messages[0] == messages[1], said
    else:
        assert messages[0] == f"process 1 stopped: {messages[1]}", said


@pytest.mark.parametrize("how", ["raises", "mixed"])
def test_any_error_of_one_process_in_the_score_phase_stops_them_all_with_the_first_ones_kind(tmp_path, how):
    """An exception of the reward function itself (here a TypeError in the user's code) in one process stops the
    other too: the one that raised it keeps its traceback, the other stops with a RewardError naming it. Two
    processes stopping with different kinds of error (a NaN in process 0, refused step rewards in process 1)
    both stop with the first process's kind, so the CLI's exit status is the same everywhere."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, save_every=0, advantage="rloo",
                    reward=f"{__name__}:misbehaves_in_one_rank")
    said = _score_in_two_processes(tmp_path, cfg_dict, ("STOPPING", "how", how))
    kinds, messages = zip(*(s.split("|", 1) for s in said))
    if how == "raises":
        assert kinds == ("RewardError", "TypeError"), said
        assert messages[0] == f"process 1 stopped: TypeError: {messages[1]}", said
    else:
        assert kinds == ("NonFiniteError", "NonFiniteError"), said
        assert messages[0].startswith("non-finite reward"), said
        assert messages[1] == f"process 0 stopped: {messages[0]}", said


def test_sequence_ratio_accepted_at_start_up_where_it_may_matter(tmp_path):
    for values in ({"ratio": "sequence", "epochs": 2}, {"ratio": "sequence", "minibatches": 2},
                   {"ratio": "sequence", "reward": "steps", "task": "prefix_sums"},
                   {"ratio": "sequence", "kl_in": "reward"}, {"ratio": "sequence", "algo": "ppo"},
                   {"ratio": "sequence", "reward": DISTINCT},  # a callable: decided at its first batch
                   {"recipe": "gspo"}, {"recipe": "gspo", "minibatches": 1, "reward": DISTINCT},
                   {"ratio": "token"}):
        assert from_dict(values).ratio == values.get("ratio", "sequence"), values


def test_model_directory_and_reward_callable_are_checked_at_start_up(tmp_path):
    # a directory that is no saved model, and a reward callable with the wrong signature, used to fail later
    # inside transformers or at the first scoring, without naming the flag
    with pytest.raises(ConfigError, match="^model: a model directory holds a config.json"):
        from_dict({"model": str(tmp_path)})
    with pytest.raises(ConfigError, match="^reward: 'math:sqrt' must accept"):
        from_dict({"reward": "math:sqrt"})
    assert from_dict({"reward": "os.path:join"}).reward == "os.path:join"  # (*paths) binds three lists


# ------------------------------------------------------------------ activation checkpointing


@pytest.mark.parametrize("algo, losses", [("grpo", "fused"), ("ppo", "eager")])
def test_gradient_checkpointing_recomputes_blocks_and_keeps_the_update(tmp_path, algo, losses):
    """gradient_checkpointing: every decoder block of the policy (and of the PPO critic's backbone) runs its
    forward (seen from its MLP) a second time in the backward -- twice as many forwards with grad on as
    without -- and two steps end at the same parameters, bit for bit (dropout is off: the recomputation repeats
    the forward exactly)."""
    runs = {}
    for ckpt in (False, True):
        tr = Trainer(tiny(tmp_path / str(ckpt), algo=algo, losses=losses, steps=2, reward=DISTINCT,
                          gradient_checkpointing=ckpt))
        models = {"policy": tr.policy.model} | ({"critic": tr.critic.backbone} if tr.critic is not None else {})
        with_grad = {name: 0 for name in models}
        for name, model in models.items():
            for layer in model.layers:
                # counted inside each block: transformers checkpoints the block's forward (not its __call__), and
                # the recomputation runs no module hooks, so its MLP's forward itself is wrapped
                def counted(*args, _forward=layer.mlp.forward, _name=name, **kwargs):
                    with_grad[_name] += torch.is_grad_enabled()
                    return _forward(*args, **kwargs)

                layer.mlp.forward = counted
        tr.run()
        runs[ckpt] = with_grad, _state(tr.policy), None if tr.critic is None else _state(tr.critic)
    (plain, pol, crit), (ckpt, pol_c, crit_c) = runs[False], runs[True]
    assert all(n > 0 for n in plain.values()), plain
    assert ckpt == {name: 2 * n for name, n in plain.items()}
    for got, want in ((pol_c, pol), (crit_c, crit)):
        for key in want or {}:
            assert torch.equal(got[key], want[key]), key


def test_gradient_checkpointing_refused_for_a_model_without_it():
    """A policy that is not a transformers model with checkpointing support is refused by the field's name."""
    with pytest.raises(ConfigError, match="^gradient_checkpointing: the policy"):
        knobs.enable_gradient_checkpointing(torch.nn.Linear(2, 2))


CTRL_C = {"sent": False}


def ctrl_c_at_first_scoring(prompts, completions, answers):
    """A test reward that presses Ctrl-C (SIGINT to this process) the first time it is called."""
    if not CTRL_C["sent"]:
        CTRL_C["sent"] = True
        os.kill(os.getpid(), signal.SIGINT)
    return [float(i % 4) for i in range(len(completions))]


def test_ctrl_c_while_the_first_batch_is_scored_finishes_the_step(tmp_path):
    """The first step's batch is scored before the folder changes, but Ctrl-C there still means what it means at
    any other step: finish the step, save, stop (not a KeyboardInterrupt that loses the step); and a refused first
    batch leaves the SIGINT handler as it was."""
    CTRL_C["sent"] = False
    before = signal.getsignal(signal.SIGINT)
    cfg = tiny(tmp_path, losses="eager", reward=f"{__name__}:ctrl_c_at_first_scoring", steps=3)
    summary = Trainer(cfg).run()
    assert CTRL_C["sent"] and summary["interrupted"] and summary["steps"] == 1
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step_000001"
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(ConfigError, match="^ratio: the reward"):
        Trainer(tiny(tmp_path / "refused", losses="eager", reward=DISTINCT, ratio="sequence")).run()
    assert signal.getsignal(signal.SIGINT) is before


def test_the_first_steps_time_leaves_out_the_folders_set_up(tmp_path, monkeypatch):
    """perf/step_s (and perf/tokens_per_s) of the first step count its rollout, scoring and update, not the set-up
    of the output folder that now comes between its scoring and its update (deleting an --overwrite'd run)."""
    base = dict(losses="eager", reward=DISTINCT, steps=1)
    Trainer(tiny(tmp_path, **base)).run()
    clear_run, later = checkpoint.clear_run, [0.0]

    def slow_clear_run(out):
        later[0] += 1000.0  # a large earlier run's checkpoints: the loop's clock moves on 1000 s while they go
        clear_run(out)

    # the loop's clock, 1000 s ahead once the earlier run is deleted: no real wait, and no load makes a step that long
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + later[0]))
    monkeypatch.setattr(loop.checkpoint, "clear_run", slow_clear_run)
    Trainer(tiny(tmp_path, **base, overwrite=True)).run()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert later == [1000.0] and row["perf/step_s"] < 1000.0, row


def test_a_sys_exit_in_one_processs_reward_function_stops_them_all(tmp_path):
    """SystemExit is no Exception, but a reward function (or a library it calls) that gives up with sys.exit in one
    process must stop the other too with a RewardError naming it -- not leave it waiting in the score phase's
    collective until the transport notices the process is gone (gloo: "Connection closed by peer", which names
    nothing; NCCL: a hang until its timeout). The process that exited keeps its SystemExit."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, save_every=0,
                    reward=f"{__name__}:misbehaves_in_one_rank")
    said = _score_in_two_processes(tmp_path, cfg_dict, ("STOPPING", "how", "exits"))
    assert said == ["RewardError|process 1 stopped: SystemExit: 3", "SystemExit|3"], said
