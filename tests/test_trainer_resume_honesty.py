"""What a resume keeps and what the user's new values change; options that would do nothing, refused by name;
the per-process minibatch check; one vocabulary rule for the reference and the critic; what --overwrite deletes."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from rlkernels.trainer import checkpoint
from rlkernels.trainer.config import ConfigError, from_dict
from rlkernels.trainer.data import tiny_tokenizer
from rlkernels.trainer.loop import Trainer, check_output_dir
from rlkernels.trainer.models import tiny_model
from rlkernels.trainer.recipes import RECIPES
from tests.helpers import in_gloo_group
from tests.test_trainer import DISTINCT, tiny


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the configuration was checked")


# ------------------------------------------------------------------ 1. lr / critic_lr / weight_decay on resume


def test_resume_applies_the_new_learning_rates_and_weight_decay(tmp_path):
    base = dict(losses="eager", algo="ppo", steps=1, reward=DISTINCT, lr=3e-3, critic_lr=2e-3, weight_decay=0.0)
    Trainer(tiny(tmp_path, **base)).run()
    saved = torch.load(checkpoint.latest(tmp_path / "checkpoints") / "optimizer.pt", weights_only=False)
    assert [(g["lr"], g["weight_decay"]) for g in saved["param_groups"]] == [(3e-3, 0.0), (2e-3, 0.0)]
    tr = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "lr": 1e-5, "critic_lr": 1e-4,
                                   "weight_decay": 0.1}))
    tr.maybe_resume()
    assert tr.step == 1
    assert [(g["lr"], g["weight_decay"]) for g in tr.optimizer.param_groups] == [(1e-5, 0.1), (1e-4, 0.1)]
    assert tr.optimizer.state  # the saved Adam moments are still loaded
    # and the resumed run's optimizer step uses them
    tr = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "lr": 1e-5, "critic_lr": 1e-4,
                                   "weight_decay": 0.1}))
    seen, step = [], tr.optimizer.step

    def spy(*args, **kwargs):
        seen.append([(g["lr"], g["weight_decay"]) for g in tr.optimizer.param_groups])
        return step(*args, **kwargs)

    tr.optimizer.step = spy
    tr.run()
    assert seen == [[(1e-5, 0.1), (1e-4, 0.1)]]


# ------------------------------------------------------------------ 2. kl_coef on resume


def test_resume_applies_a_changed_kl_coef_without_the_controller(tmp_path):
    base = dict(losses="eager", steps=1, kl_coef=0.05, reward=DISTINCT)
    Trainer(tiny(tmp_path, **base)).run()
    tr = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "kl_coef": 0.2}))
    tr.maybe_resume()
    assert tr.kl_coef == 0.2


def test_resume_continues_the_adaptive_kl_coef_unless_kl_coef_changed(tmp_path):
    base = dict(losses="eager", algo="ppo", steps=1, kl_coef=0.05, kl_target=0.01, reward=DISTINCT)
    Trainer(tiny(tmp_path, **base)).run()
    adapted = json.loads((checkpoint.latest(tmp_path / "checkpoints") / "state.json").read_text())["kl_coef"]
    assert adapted != 0.05  # the controller moved it
    same = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True}))
    same.maybe_resume()
    assert same.kl_coef == adapted  # the controller's state continues
    changed = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "kl_coef": 0.1}))
    changed.maybe_resume()
    assert changed.kl_coef == 0.1  # a new starting coefficient: the controller restarts from it


# ------------------------------------------------------------------ 3. clips with one epoch of one minibatch


@pytest.mark.parametrize("name, value", [("clip_low", 0.1), ("clip_high", 0.28), ("dual_clip", 3.0),
                                         ("clip_low", 0.2)])  # set explicitly, even to the default
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_clip_options_with_one_epoch_of_one_minibatch_are_refused(name, value, algo):
    with pytest.raises(ConfigError, match=f"^{name}: .*exactly 1"):
        from_dict({"algo": algo, name: value})
    assert getattr(from_dict({"algo": algo, name: value, "minibatches": 2}), name) == value
    assert getattr(from_dict({"algo": algo, name: value, "epochs": 2}), name) == value


def test_clip_high_flag_is_refused_on_the_command_line(tmp_path, capsys, monkeypatch):
    from rlkernels.trainer.__main__ import main

    monkeypatch.setattr("rlkernels.trainer.loop.load_policy", _no_model)
    assert main(["--clip-high", "0.28", "--output-dir", str(tmp_path)]) == 2
    assert "invalid configuration: clip_high:" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_still_validates(name):
    """A recipe's clip values are not the user's: they are accepted whatever epochs and minibatches are."""
    cfg = from_dict({"recipe": name})
    for field, value in RECIPES[name].items():
        assert getattr(cfg, field) == value, field


# ------------------------------------------------------------------ 4. ref_mix_alpha with ref_update_every 1


def test_ref_mix_alpha_with_a_copy_every_step_is_refused():
    with pytest.raises(ConfigError, match="^ref_mix_alpha: ref_update_every is 1"):
        from_dict({"ref_mix_alpha": 0.5, "ref_update_every": 1})
    # every other period leaves steps that mix
    assert from_dict({"ref_mix_alpha": 0.5, "ref_update_every": 2}).ref_mix_alpha == 0.5
    assert from_dict({"ref_mix_alpha": 0.5}).ref_mix_alpha == 0.5
    assert from_dict({"ref_update_every": 1}).ref_update_every == 1


# ------------------------------------------------------------------ 5. minibatches against each process's batch


@pytest.mark.parametrize("prompts, group, minibatches", [(2, 3, 6), (4, 3, 4)])
def test_minibatches_must_divide_each_process_batch(prompts, group, minibatches):
    cfg = from_dict({"prompts_per_step": prompts, "group_size": group, "minibatches": minibatches})
    cfg.check_world(1)  # the global batch divides
    with pytest.raises(ConfigError, match="^minibatches: must divide each process's batch"):
        cfg.check_world(2)
    with pytest.raises(ConfigError, match="^prompts_per_step:"):
        from_dict({"prompts_per_step": 3, "group_size": 2}).check_world(2)
    from_dict({"prompts_per_step": 4, "group_size": 3, "minibatches": 2}).check_world(2)  # 6 rows a process


def test_trainer_checks_minibatches_against_the_world_before_loading_a_model(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr("rlkernels.trainer.loop.load_policy", _no_model)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    with pytest.raises(ConfigError, match="^minibatches:"):
        Trainer(tiny(tmp_path, prompts_per_step=2, group_size=3, minibatches=6, losses="eager"))


def _world_worker(rank, world, init_file, out_dir, cfg_dict):
    in_gloo_group(rank, world, f"file://{init_file}", _world_work, rank, out_dir, cfg_dict)


def _world_work(rank, out_dir, cfg_dict):
    try:
        Trainer(from_dict(cfg_dict))
        message = "no error"
    except ConfigError as error:
        message = str(error)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
        fh.write(message)


def test_two_gloo_processes_refuse_minibatches_that_do_not_divide_their_share(tmp_path):
    cfg_dict = dict(output_dir=str(tmp_path / "run"), progress=False, plot=False, steps=1, prompts_per_step=2,
                    group_size=3, minibatches=6, tiny_hidden=32, losses="eager")
    torch.multiprocessing.spawn(_world_worker, args=(2, str(tmp_path / "init"), str(tmp_path), cfg_dict), nprocs=2,
                                join=True)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith("minibatches: must divide each process's batch")


# ------------------------------------------------------------------ 6. the critic's vocabulary


def _policy_dir(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), hidden=32, layers=1, seed=7, tokenizer=tok)
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    return tmp_path / "policy", len(tok)


def _backbone_dir(path, vocab, hidden=48):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(11)
    LlamaModel(config).save_pretrained(path)
    return str(path)


def _models_cfg(tmp_path, **over):
    base = dict(output_dir=str(tmp_path / "run"), progress=False, plot=False, steps=1, prompts_per_step=4,
                group_size=4, save_every=0, threads=1, losses="eager", reward=DISTINCT)
    return from_dict({**base, **over})


@pytest.mark.parametrize("delta", [-3, 3])
def test_critic_model_with_another_vocabulary_is_refused(tmp_path, delta):
    policy, vocab = _policy_dir(tmp_path)
    critic = _backbone_dir(tmp_path / "critic", vocab + delta)
    with pytest.raises(ConfigError, match=f"^critic_model: .* vocabulary of {vocab + delta} tokens .* the policy {vocab}"):
        Trainer(_models_cfg(tmp_path, model=str(policy), algo="ppo", critic_model=critic))


def test_critic_with_the_policy_vocabulary_and_another_width_is_accepted(tmp_path):
    policy, vocab = _policy_dir(tmp_path)
    tr = Trainer(_models_cfg(tmp_path, model=str(policy), algo="ppo", critic_model=_backbone_dir(tmp_path / "c", vocab)))
    assert tr.critic.value_head.in_features == 48
    tr.run()


def test_ref_model_follows_the_same_vocabulary_rule(tmp_path):
    tok = tiny_tokenizer()
    policy, vocab = _policy_dir(tmp_path)
    narrow = tiny_model(vocab - 2, hidden=32, layers=1, seed=3, tokenizer=tok)
    narrow.save_pretrained(tmp_path / "narrow")
    tok.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ConfigError, match=f"^ref_model: .* vocabulary of {vocab - 2} tokens"):
        Trainer(_models_cfg(tmp_path, model=str(policy), ref_model=str(tmp_path / "narrow")))


# ------------------------------------------------------------------ 7. --overwrite and the user's files


def test_overwrite_keeps_the_users_files_in_checkpoints(tmp_path):
    Trainer(tiny(tmp_path, losses="eager", steps=2)).run()
    (tmp_path / "checkpoints" / "README").write_text("mine")
    (tmp_path / "checkpoints" / "notes").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_000009-123").mkdir()  # a crashed save's leftovers: the trainer's
    with pytest.raises(ConfigError, match="^output_dir:"):
        check_output_dir(tiny(tmp_path, losses="eager", steps=1))
    Trainer(tiny(tmp_path, losses="eager", steps=1, overwrite=True)).run()
    assert (tmp_path / "checkpoints" / "README").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "notes").is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["README", "notes", "step_000001"]


def test_overwrite_removes_an_emptied_checkpoints_folder(tmp_path):
    Trainer(tiny(tmp_path, losses="eager", steps=1, kl_coef=0.0)).run()
    checkpoint.clear_run(tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not any(tmp_path.iterdir())


def test_a_users_file_in_checkpoints_alone_is_no_earlier_run(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "README").write_text("mine")
    assert checkpoint.run_files(tmp_path) == []
    assert check_output_dir(tiny(tmp_path, losses="eager")) == []  # a fresh run is accepted
    with pytest.raises(ConfigError, match="^resume: no checkpoint"):  # and resume agrees: nothing to continue
        check_output_dir(tiny(tmp_path, losses="eager", resume=True))
    cfg = tiny(tmp_path, losses="eager", steps=1, kl_coef=0.0)
    Trainer(cfg).run()
    assert (tmp_path / "checkpoints" / "README").read_text() == "mine"
    assert checkpoint.run_files(tmp_path)[-1] == "checkpoints/"
    resumed = Trainer(dataclasses.replace(cfg, steps=2, resume=True))
    resumed.maybe_resume()
    assert resumed.step == 1


def test_a_resume_with_another_seed_keeps_the_tiny_models_reference(tmp_path, capsys):
    """The tiny model's initial weights come from the seed, and the KL reference is a copy of them: a resume that
    samples with another seed still builds them from the run's own seed (it used to build another random
    reference, silently), and says so."""
    base = dict(losses="eager", steps=1, reward=DISTINCT, kl_coef=0.05)
    first = Trainer(tiny(tmp_path, **base, seed=3))
    initial = {k: v.clone() for k, v in first.ref.model.state_dict().items()}
    first.run()
    capsys.readouterr()
    again = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True, "seed": 8}))
    again.maybe_resume()
    assert "resume: seed changed: 3 -> 8 (prompts and sampling; the tiny model's initial weights" in capsys.readouterr().err
    for name, value in again.ref.model.state_dict().items():
        assert torch.equal(value, initial[name]), name
    fresh = Trainer(tiny(tmp_path / "other", **base, seed=8))  # a new run with that seed draws other weights
    assert not torch.equal(fresh.ref.model.state_dict()["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


# ------------------------------------------------------------------ 8. a stop at a later step keeps the steps trained

FAIL_AT = {"call": None, "calls": 0, "rank": None}  # the reward call that raises (1-based; None: never), and where


def fails_at_one_call(prompts, completions, answers):
    """DISTINCT's rewards, except that call ``FAIL_AT["call"]`` (in process ``FAIL_AT["rank"]``, or any) raises the
    user's own bug."""
    FAIL_AT["calls"] += 1
    if FAIL_AT["calls"] == FAIL_AT["call"]:
        import torch.distributed as dist

        if FAIL_AT["rank"] is None or dist.get_rank() == FAIL_AT["rank"]:
            raise KeyError("answer")
    return [float(i % 4) for i in range(len(completions))]


def _metrics(folder):
    from rlkernels.trainer.loop import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(folder / "metrics.jsonl")]


def test_a_reward_error_at_a_later_step_saves_the_steps_trained_and_resume_continues(tmp_path, capsys):
    """With save_every 0 a run used to keep nothing of the steps it trained when the reward function failed at a
    later step: now they are saved before the error is raised, and the resumed run is the uninterrupted one."""
    base = dict(losses="eager", algo="ppo", steps=4, epochs=2, minibatches=2, reward=f"{__name__}:fails_at_one_call")
    FAIL_AT.update(call=None, calls=0, rank=None)
    Trainer(tiny(tmp_path / "full", **base)).run()
    FAIL_AT.update(call=3, calls=0)
    with pytest.raises(KeyError, match="answer"):
        Trainer(tiny(tmp_path / "cut", **base)).run()
    assert "saved step 2 before the stop" in capsys.readouterr().err
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "cut" / "checkpoints")] == ["step_000002"]
    resumed = Trainer(tiny(tmp_path / "cut", **base, resume=True))  # call 4 onwards: the reward works again
    assert resumed.run()["steps"] == 4
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "full")


def test_a_save_that_fails_before_the_stop_is_reported_and_the_steps_error_raised(tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    FAIL_AT.update(call=3, calls=0, rank=None)
    tr = Trainer(tiny(tmp_path, losses="eager", steps=4, reward=f"{__name__}:fails_at_one_call"))
    monkeypatch.setattr(checkpoint, "save", disk_full)
    with pytest.raises(KeyError, match="answer"):
        tr.run()
    assert "could not save the 2 steps trained before the stop: OSError" in capsys.readouterr().err


def test_a_refusal_at_a_later_step_after_overwrite_keeps_the_steps_it_trained(tmp_path, capsys):
    """--overwrite deletes the earlier run when the first batch is accepted; step rewards a flag refuses, first
    returned at step 3, then stop the run -- with steps 1 and 2 saved (save_every 0), not lost with the earlier run."""
    from rlkernels.trainer.__main__ import main
    from tests.test_trainer import CLI

    out = ["--output-dir", str(tmp_path), "--steps", "3"]
    assert main(CLI + out + ["--reward", DISTINCT]) == 0
    FAIL_AT.update(calls=0)
    later = f"{__name__}:steps_from_the_third_call"
    assert main(CLI + out + ["--reward", later, "--advantage", "rloo", "--overwrite"]) == 2  # rloo: outcomes only
    err = capsys.readouterr().err
    assert "advantage:" in err and "saved step 2 before the stop" in err
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "checkpoints")] == ["step_000002"]
    assert [row["step"] for row in _metrics(tmp_path)] == [1, 2]


def steps_from_the_third_call(prompts, completions, answers, completion_tokens):
    """Outcome rewards at the first two calls, step rewards after them."""
    FAIL_AT["calls"] += 1
    if FAIL_AT["calls"] >= 3:
        return [[(1.0, len(t) - 1)] for t in completion_tokens]
    return [float(i % 4) for i in range(len(completions))]


def test_a_stop_outside_the_score_phase_saves_nothing(tmp_path, monkeypatch):
    """A non-finite loss stops an update that may have taken some of its optimizer steps: no checkpoint of that."""
    from rlkernels.trainer import loop

    tr = Trainer(tiny(tmp_path, losses="eager", steps=3, reward=DISTINCT, minibatches=2))
    real = loop.minibatch_loss
    calls = {"n": 0}

    def nan_at_the_fourth(*args, **kwargs):
        calls["n"] += 1
        loss, logs = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 4 else loss), logs  # step 2's second minibatch

    monkeypatch.setattr(loop, "minibatch_loss", nan_at_the_fourth)
    with pytest.raises(loop.NonFiniteError, match="non-finite loss at step 2"):
        tr.run()
    assert checkpoint.checkpoint_dirs(tmp_path / "checkpoints") == []


def _stop_worker(rank, world, init_file, cfg_dict):
    in_gloo_group(rank, world, f"file://{init_file}", _stop_work, rank, cfg_dict)


def _stop_work(rank, cfg_dict):
    FAIL_AT.update(call=2, calls=0, rank=1)
    try:
        Trainer(from_dict(cfg_dict)).run()
        said = "ran"
    except Exception as error:  # noqa: BLE001  (the class is what the test checks)
        said = type(error).__name__
    with open(os.path.join(cfg_dict["output_dir"], f"said{rank}.txt"), "w") as f:
        f.write(said)


def test_two_processes_stopped_in_a_later_score_phase_save_the_steps_trained(tmp_path):
    """Process 1's reward function fails at step 2: both processes stop there together, and the step they trained
    is saved (a collective save: no process waits for the other)."""
    cfg_dict = dict(output_dir=str(tmp_path), progress=False, plot=False, steps=3, prompts_per_step=4, group_size=2,
                    tiny_hidden=32, losses="eager", max_new_tokens=3, save_every=0,
                    reward=f"{__name__}:fails_at_one_call")
    torch.multiprocessing.spawn(_stop_worker, args=(2, str(tmp_path / "init"), cfg_dict), nprocs=2, join=True)
    assert [(tmp_path / f"said{rank}.txt").read_text() for rank in range(2)] == ["RewardError", "KeyError"]
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "checkpoints")] == ["step_000001"]


def test_a_resume_after_a_crash_that_cut_the_last_metrics_line_short_continues(tmp_path, capsys):
    """A run killed while writing a metrics line leaves it cut short; --resume then died on it in a JSONDecodeError
    traceback. The cut line (a step after the checkpoint's) is dropped with a note; a bad line before the last is
    named (exit 2)."""
    from rlkernels.trainer.__main__ import main

    base = dict(losses="eager", steps=1, reward=DISTINCT)
    Trainer(tiny(tmp_path, **base)).run()
    log = tmp_path / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 2, "reward/me')
    summary = Trainer(tiny(tmp_path, **{**base, "steps": 2, "resume": True})).run()
    assert summary["steps"] == 2 and "dropped the last line of" in capsys.readouterr().err
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [1, 2]
    log.write_text("not json\n" + log.read_text())
    cli = ["--output-dir", str(tmp_path), "--steps", "3", "--resume", "--losses", "eager", "--reward", DISTINCT,
           "--prompts-per-step", "4", "--group-size", "4", "--tiny-hidden", "32", "--save-every", "0",
           "--no-progress", "--no-plot"]
    assert main(cli) == 2
    assert f"resume: line 1 of {log} is not a metrics record" in capsys.readouterr().err


@pytest.mark.parametrize("knob", [dict(ref_update_every=1), dict(ref_mix_alpha=0.5)])
def test_a_ref_model_of_another_width_that_the_policy_would_be_copied_into_is_refused(tmp_path, knob):
    """A ref_model may be narrower or wider than the policy, but ref_update_every / ref_mix_alpha copy the policy
    into it: that used to fail after the first step's update (a RuntimeError traceback, nothing saved)."""
    tok = tiny_tokenizer()
    policy, vocab = _policy_dir(tmp_path)
    for name, hidden in (("wide", 48), ("same", 32)):
        tiny_model(vocab, hidden=hidden, layers=1, seed=3, tokenizer=tok).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    name = next(iter(knob))
    with pytest.raises(ConfigError, match=f"^{name}: .* ref_model {tmp_path / 'wide'} has another architecture"):
        Trainer(_models_cfg(tmp_path, model=str(policy), ref_model=str(tmp_path / "wide"), steps=2, **knob))
    assert Trainer(_models_cfg(tmp_path, model=str(policy), ref_model=str(tmp_path / "same"), steps=2,
                               **knob)).run()["steps"] == 2


def test_a_resume_accepts_another_spelling_of_the_same_model_folder(tmp_path, monkeypatch, capsys):
    """'policy', './policy/' and the folder's absolute path name one model: a resume used to refuse all but the
    spelling the checkpoint recorded ('model: ... was trained with 'policy''). Another folder is still refused,
    and so is a folder called 'tiny' for the built-in model."""
    import shutil

    monkeypatch.chdir(tmp_path)
    policy, _ = _policy_dir(tmp_path)
    Trainer(_models_cfg(tmp_path, model="policy", kl_coef=0.0)).run()
    capsys.readouterr()
    for spelling in ("./policy/", str(policy)):
        check_output_dir(_models_cfg(tmp_path, model=spelling, kl_coef=0.0, steps=2, resume=True))
    tr = Trainer(_models_cfg(tmp_path, model="./policy/", kl_coef=0.0, steps=2, resume=True))
    assert tr.run()["steps"] == 2 and "model changed" not in capsys.readouterr().err
    shutil.copytree(policy, tmp_path / "copy")
    with pytest.raises(ConfigError, match="^model: .* was trained with './policy/'"):
        check_output_dir(_models_cfg(tmp_path, model="copy", kl_coef=0.0, steps=3, resume=True))
    Trainer(_models_cfg(tmp_path / "t", tiny_hidden=32, kl_coef=0.0)).run()
    shutil.copytree(policy, tmp_path / "tiny")
    with pytest.raises(ConfigError, match="^model: .* was trained with 'tiny'"):
        check_output_dir(_models_cfg(tmp_path / "t", model="./tiny", kl_coef=0.0, steps=2, resume=True))


def test_a_resumed_run_that_stops_later_leaves_no_stale_summary(tmp_path, capsys):
    """A resumed run that stopped at a later step used to leave the earlier invocation's summary.json ("steps": 1)
    beside its own config, its longer log and a newer checkpoint; like a fresh run that stops, it now leaves none.
    A resume refused at its first batch still leaves the folder as it was, summary included."""
    base = dict(losses="eager", steps=1, reward=f"{__name__}:fails_at_one_call")
    FAIL_AT.update(call=None, calls=0, rank=None)
    Trainer(tiny(tmp_path, **base)).run()
    summary = (tmp_path / "summary.json").read_text()
    FAIL_AT.update(call=1, calls=0)
    with pytest.raises(KeyError, match="answer"):
        Trainer(tiny(tmp_path, **{**base, "steps": 3, "resume": True})).run()
    assert (tmp_path / "summary.json").read_text() == summary
    FAIL_AT.update(call=2, calls=0)
    with pytest.raises(KeyError, match="answer"):
        Trainer(tiny(tmp_path, **{**base, "steps": 3, "resume": True})).run()
    assert "saved step 2 before the stop" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists() and [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    FAIL_AT.update(call=None, calls=0)
    assert Trainer(tiny(tmp_path, **{**base, "steps": 3, "resume": True})).run()["steps"] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3


def test_a_model_folders_config_json_is_no_earlier_run_and_is_never_deleted(tmp_path, capsys):
    """A model folder as output_dir: its config.json used to count as an earlier run's, and --overwrite then deleted
    it (and wrote the run's own over it). Now the folder is refused, with or without --overwrite; a run's own
    config.json still makes an earlier run that --overwrite replaces."""
    from rlkernels.trainer.__main__ import main

    policy, _ = _policy_dir(tmp_path)
    before = (policy / "config.json").read_text()
    cli = ["--model", str(policy), "--output-dir", str(policy), "--steps", "1", "--prompts-per-step", "2",
           "--group-size", "2", "--save-every", "0", "--losses", "eager", "--no-progress", "--no-plot"]
    for extra in ([], ["--overwrite"]):
        assert main(cli + extra) == 2
        assert f"output_dir: {policy / 'config.json'} is not a run's config.json" in capsys.readouterr().err
        assert (policy / "config.json").read_text() == before
    run = tmp_path / "run"
    Trainer(tiny(run, losses="eager", steps=1)).run()
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl, summary.json, config.json"):
        check_output_dir(tiny(run, losses="eager", steps=1))
    check_output_dir(tiny(run, losses="eager", steps=1, overwrite=True))
