"""The trainer's user inputs that only show up at run time: what a reward function returns, the prompts file,
the output folder, the seed, the tokenizer (issue 15). Each bad input is a one-line error naming it, never a
traceback: exit status 2 ("invalid configuration") when it is found before training, 3 ("stopped") during it."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from rlkernels.trainer import process
from rlkernels.trainer.__main__ import main
from rlkernels.trainer.config import ConfigError, from_dict
from rlkernels.trainer.data import read_prompts
from rlkernels.trainer.loop import Trainer, check_output_dir
from rlkernels.trainer.rewards import check_reward_spec

CLI = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--tiny-hidden", "32", "--save-every", "0",
       "--losses", "eager", "--no-progress", "--no-plot"]
MODULE = sys.modules[__name__].__name__


def _error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"rlkernels-train: {prefix}") and err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------ what a reward function returns


def _parse(out, lengths=(3, 3)):
    """The trainer's reading of a reward function returning ``out`` for two completions."""
    raw = process.call_reward(lambda p, c, a: out, ["p"] * 2, ["c"] * 2, ["a"] * 2, torch.ones(2, dtype=torch.bool),
                              torch.zeros(2, 3, dtype=torch.long), tokenizer=None)
    return process.parse_rewards(raw, torch.tensor(lengths))


@pytest.mark.parametrize("out, why", [
    ({0: 1.0, 1: 0.0}, "got dict"),  # iterating a dict gives its keys, which look like rewards
    ("10", "got str"),
    (1.0, "got float"),
    (None, "got NoneType"),
    (torch.ones(2, 1), r"got Tensor of shape \(2, 1\)"),
    (np.ones((2, 1)), r"got ndarray of shape \(2, 1\)"),
    (torch.tensor(1.0), r"got Tensor of shape \(\)"),
    ([1.0], "returned 1 entries for 2 completions"),
    ([1.0, None], "entry 1 must be a float or a list"),
    ([1.0, "1.0"], "entry 1 must be a float or a list"),
    ([True, False], "entry 0 must be a float or a list"),  # a bool is not a reward
    (torch.tensor([True, False]), "entry 0 must be a float or a list"),  # nor is a bool tensor's element
    ([1.0, torch.tensor(False)], "entry 1 must be a float or a list"),
    (torch.tensor([1 + 1j, 0j]), "entry 0 must be a float or a list"),  # a complex number is not a reward
    (torch.tensor([1 + 0j, 0j]), "entry 0 must be a float or a list"),  # not even a real-valued one (as NumPy's)
    ([[(torch.tensor(1 + 1j), 0)], 1.0], r"entry 0 holds \(tensor\(1\.\+1\.j\), 0\); each step must be a"),
    ([1.0, 10**400], "entry 1 is 1000.*, too large for a float"),
    ([[(1.0, 0.0)], 1.0], r"entry 0 holds \(1.0, 0.0\); each step must be a \(reward, end_token_index\) pair"),
    ([[(1.0, 3)], 1.0], "entry 0 has a step ending at token 3, outside its 3 response tokens"),
    ([[(1.0, -1)], 1.0], "entry 0 has a step ending at token -1"),
    ([[(10**400, 0)], 1.0], "entry 0's step reward is 1000.*, too large for a float"),
])
def test_malformed_reward_returns_are_named(out, why):
    with pytest.raises(process.RewardError, match=r"^reward: .*" + why):
        _parse(out)


@pytest.mark.parametrize("out", [
    [1.0, 0.0], (1.0, 0.0), torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0], requires_grad=True),
    np.array([1.0, 0.0], dtype=np.float32), (x for x in [1.0, 0.0]), [1, 0], [np.float64(1.0), np.int64(0)],
])
def test_well_formed_reward_returns_are_read(out):
    scores, steps = _parse(out)
    assert steps is None and scores.tolist() == [1.0, 0.0] and scores.dtype == torch.float32


def test_step_rewards_accept_numpy_numbers():
    scores, (rewards, ends, mask) = _parse([[(np.float32(2.0), np.int64(1))], 0.5])
    assert scores.tolist() == [2.0, 0.5]
    assert rewards.tolist() == [[2.0], [0.5]] and ends.tolist() == [[1], [2]] and mask.all()


def dict_reward(prompts, completions, answers):
    return {i: 1.0 for i in range(len(completions))}


def test_a_malformed_reward_stops_the_run_with_exit_3(tmp_path, capsys):
    assert main(CLI + ["--output-dir", str(tmp_path), "--reward", f"{MODULE}:dict_reward"]) == 3
    err = _error_line(capsys, "stopped: reward: must return one entry per completion")
    assert "got dict" in err and f"reward '{MODULE}:dict_reward', step 1" in err


@pytest.mark.parametrize("spec", [":f", f"{MODULE}:", ".x:f", "a..b:f", f"{MODULE}:dict_reward:x"])
def test_reward_specs_that_are_not_module_function_are_refused(spec):
    assert "must be 'module:function'" in check_reward_spec(spec)
    with pytest.raises(ConfigError, match="^reward: "):
        from_dict({"reward": spec})


def test_a_reward_spec_of_an_importable_function_is_accepted():
    assert check_reward_spec(f"{MODULE}:dict_reward") == ""
    assert "No module named" in check_reward_spec("no_such_module_xyz:f")


def test_a_reward_module_beside_the_user_is_found(tmp_path, monkeypatch):
    """The installed rlkernels-train script has no current directory on sys.path; 'my_rewards:f' must still
    find my_rewards.py there, as `python -m` would."""
    from rlkernels.trainer.rewards import load_reward

    (tmp_path / "rlk_test_rewards_beside.py").write_text("def f(p, c, a):\n    return [0.5] * len(c)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert check_reward_spec("rlk_test_rewards_beside:f") == ""
    assert load_reward("rlk_test_rewards_beside:f")(["p"], ["c"], ["a"]) == [0.5]


@pytest.mark.parametrize("source, why", [
    ("x = (\n", "SyntaxError"),
    ("raise RuntimeError('module-level boom')\n", "RuntimeError: module-level boom"),
])
def test_a_reward_module_that_fails_to_import_exits_2_naming_reward(tmp_path, capsys, monkeypatch, source, why):
    name = f"rlk_test_rewards_broken_{why.split(':')[0].lower()}"
    (tmp_path / f"{name}.py").write_text(source + "def f(p, c, a):\n    return [0.0] * len(c)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert why in check_reward_spec(f"{name}:f")
    assert main(CLI + ["--output-dir", str(tmp_path / "run"), "--reward", f"{name}:f"]) == 2
    err = _error_line(capsys, f"invalid configuration: reward: cannot import callable '{name}:f'")
    assert why in err


# ------------------------------------------------------------------ the prompts file


@pytest.mark.parametrize("data, why", [
    (b'{"prompt": "a"}\n{bad\n', "line 2 of .* is not JSON"),
    (b'\xff\xfe{"prompt": "a"}\n', "line 1 of .* is not UTF-8 text"),
    (b'{"prompt": "a"}\n"just a string"\n', "line 2 of .* must be a JSON object with a 'prompt', got str"),
    (b'[1, 2]\n', "line 1 of .* must be a JSON object with a 'prompt', got list"),
    (b'{"answer": "1"}\n', "line 1 of .* must have a string 'prompt' \\(got none\\)"),
    (b'{"prompt": null}\n', "line 1 of .* must have a string 'prompt' \\(got NoneType\\)"),
    (b'{"prompt": 7}\n', "line 1 of .* must have a string 'prompt' \\(got int\\)"),
    (b'{"prompt": "a", "answer": null}\n', "line 1 of .*: 'answer' must be a string or a number \\(got NoneType\\)"),
    (b'{"prompt": "a", "answer": true}\n', "line 1 of .*: 'answer' must be a string or a number \\(got bool\\)"),
    (b'\n  \n', ".*prompts.jsonl holds no records"),
])
def test_bad_prompts_files_are_refused_before_training_naming_file_and_line(tmp_path, data, why):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="^prompts: " + why):
        read_prompts(str(path))
    with pytest.raises(ConfigError, match="^prompts: " + why):  # at configuration time, before any model loads
        from_dict({"prompts": str(path)})


def test_prompts_file_records_blank_lines_bom_and_numeric_answers(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "1 2 3 =", "answer": 1}), "", json.dumps({"prompt": "é ="}),
             json.dumps({"prompt": "x", "answer": "7", "extra": [1]})]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    records = read_prompts(str(path))
    assert [(r.prompt, r.answer) for r in records] == [("1 2 3 =", "1"), ("é =", ""), ("x", "7")]


def test_numeric_answers_are_the_numbers_the_integer_rules_compare(tmp_path):
    """JSON numbers as answers: 3.0 is the answer "3" (as str it was "3.0", which no integer rule can match: a
    completion "3" scored 0), -2.0 is "-2", 2.5 stays "2.5"; NaN and Infinity (JSON extensions Python reads) are
    refused naming the line."""
    from rlkernels.trainer import rewards

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in
                               (("a", 3.0), ("b", -2.0), ("c", 2.5), ("d", 12))))
    records = read_prompts(str(path))
    assert [r.answer for r in records] == ["3", "-2", "2.5", "12"]
    assert rewards.exact(["a", "b"], ["so 3", "-2"], [r.answer for r in records[:2]]) == [1.0, 1.0]
    for bad in ("NaN", "Infinity", "-Infinity"):
        path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": %s}\n' % bad)
        with pytest.raises(ValueError, match="^prompts: line 2 of .*: 'answer' must be a finite number"):
            read_prompts(str(path))


def test_a_bad_prompts_file_exits_2_before_training(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1 2 3 ="}\n{"prompt": 1 2}\n')
    assert main(CLI + ["--output-dir", str(tmp_path / "run"), "--prompts", str(path)]) == 2
    _error_line(capsys, "invalid configuration: prompts: line 2 of")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the output folder


def test_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "afile"
    path.write_text("mine")
    with pytest.raises(ConfigError, match="^output_dir: .* is a file, not a folder"):
        check_output_dir(from_dict({"output_dir": str(path)}))
    assert main(CLI + ["--output-dir", str(path / "sub")]) == 2
    _error_line(capsys, "invalid configuration: output_dir: cannot create")
    assert path.read_text() == "mine"


@pytest.mark.parametrize("name, kind", [("checkpoints", "file"), ("metrics.jsonl", "folder"),
                                        ("summary.json", "folder"), ("config.json", "folder")])
@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
def test_a_run_path_of_the_wrong_kind_is_refused_before_training(tmp_path, capsys, name, kind, flag):
    """A file named checkpoints/ used to fail the run's save after its last step (a traceback, no summary); a folder
    named metrics.jsonl, --overwrite's deletion of it."""
    path = tmp_path / name
    path.write_text("mine") if kind == "file" else path.mkdir()
    assert main(CLI + ["--output-dir", str(tmp_path)] + flag) == 2
    why = "a folder: the run saves its checkpoints there" if kind == "file" else "a file the run writes"
    assert f"{path} is not {why}" in _error_line(capsys, "invalid configuration: output_dir: ")
    assert path.exists() and path.is_dir() == (kind == "folder")


def test_output_dir_is_created_by_the_check(tmp_path):
    out = tmp_path / "a" / "b"
    assert check_output_dir(from_dict({"output_dir": str(out)})) == [] and out.is_dir()


# ------------------------------------------------------------------ seeds, clip ranges, tokenizers


def test_any_integer_seed_runs_and_a_working_seed_keeps_its_stream(tmp_path):
    """torch takes 64-bit seeds; the trainer's per-step seed is reduced modulo 2**64, which leaves every seed
    that fitted before unchanged (runs stay reproducible across this fix)."""
    for seed in (10**30, -5):
        cfg = from_dict(dict(output_dir=str(tmp_path / str(seed)), progress=False, plot=False, steps=1,
                             prompts_per_step=2, group_size=2, tiny_hidden=32, save_every=0, losses="eager", seed=seed))
        assert Trainer(cfg).run()["steps"] == 1
    torch.manual_seed((3 * 1_000_003 + 1) * 1009)
    before = torch.rand(4)
    torch.manual_seed(((3 * 1_000_003 + 1) * 1009) % 2**64)
    assert torch.equal(before, torch.rand(4))


def test_infinite_clip_high_is_refused_and_a_large_one_runs(tmp_path):
    with pytest.raises(ConfigError, match="^clip_high: must be finite"):
        from_dict({"clip_high": float("inf"), "epochs": 2})
    cfg = from_dict(dict(output_dir=str(tmp_path), progress=False, plot=False, steps=1, prompts_per_step=2,
                         group_size=2, tiny_hidden=32, save_every=0, epochs=2, clip_high=1e6))
    assert Trainer(cfg).run()["steps"] == 1


def test_chat_template_without_one_in_the_tokenizer_is_refused(tmp_path, capsys):
    assert main(CLI + ["--output-dir", str(tmp_path), "--chat-template"]) == 2
    _error_line(capsys, "invalid configuration: chat_template: the tokenizer of model 'tiny' has no chat template")


def test_model_directory_without_tokenizer_is_refused(tmp_path, capsys):
    from rlkernels.trainer.models import tiny_model
    from rlkernels.trainer.data import tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_model(len(tok), 32, 1, 0, tok).save_pretrained(tmp_path / "model")  # the weights, no tokenizer files
    capsys.readouterr()
    args = ["--steps", "1", "--save-every", "0", "--no-progress", "--no-plot", "--losses", "eager",
            "--prompts-per-step", "2", "--group-size", "2", "--task", "first_digit"]
    assert main(args + ["--output-dir", str(tmp_path / "run"), "--model", str(tmp_path / "model")]) == 2
    err = _error_line(capsys, "invalid configuration: model: cannot load a tokenizer from")
    assert "tokenizer.save_pretrained" in err


@pytest.mark.parametrize("field", ["model", "ref_model", "critic_model", "reward"])
@pytest.mark.parametrize("damage", ["no_weights", "unknown_model_type"])
def test_a_model_directory_whose_weights_cannot_load_is_refused(tmp_path, capsys, field, damage):
    """A folder with its tokenizer and config.json but no weights file (or a model_type transformers does not
    know) used to end in transformers' OSError / ValueError traceback (exit 1)."""
    from rlkernels.trainer.data import tiny_tokenizer
    from rlkernels.trainer.models import tiny_model

    tok = tiny_tokenizer()
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path in (good, bad):
        tiny_model(len(tok), 32, 1, 0, tok).save_pretrained(path)
        tok.save_pretrained(path)
    if damage == "no_weights":
        for weights in bad.glob("*.safetensors"):
            weights.unlink()
    else:
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    capsys.readouterr()
    args = ["--steps", "1", "--save-every", "0", "--no-progress", "--no-plot", "--losses", "eager",
            "--prompts-per-step", "2", "--group-size", "2", "--output-dir", str(tmp_path / "run")]
    args += {"model": ["--model", str(bad)], "ref_model": ["--model", str(good), "--ref-model", str(bad)],
             "critic_model": ["--model", str(good), "--algo", "ppo", "--critic-model", str(bad)],
             "reward": ["--reward", str(bad)]}[field]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own progress bars and warnings
    assert err.startswith(f"rlkernels-train: invalid configuration: {field}: cannot load the model's weights from "
                          f"{bad} ("), err


# ------------------------------------------------------------------ the config file


@pytest.mark.parametrize("name, data, why", [
    ("run.toml", b"\xff\xfesteps = 1\n", "as TOML .*codec can't decode"),
    ("run.toml", b"steps = [\n", "as TOML"),
    ("run.cfg", b"steps = 1\n", "as JSON \\(.toml files are read as TOML, others as JSON\\)"),
    ("run.json", b'{"steps": 1,}', "as JSON"),
])
def test_unreadable_config_files_are_named(tmp_path, capsys, name, data, why):
    path = tmp_path / name
    path.write_bytes(data)
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    err = _error_line(capsys, f"invalid configuration: config: cannot parse {str(path)!r} ")
    assert re.search(why, err), err


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    from rlkernels.trainer.config import parse_args

    path = tmp_path / "run.json"
    path.write_bytes(b'\xef\xbb\xbf{"steps": 3}')
    assert parse_args(["--config", str(path)]).steps == 3


# ------------------------------------------------------------------ a damaged checkpoint


@pytest.mark.parametrize("damaged", ["policy.safetensors", "optimizer.pt", "rng.pt", "state.json"])
def test_a_damaged_checkpoint_is_named_on_resume(tmp_path, capsys, damaged):
    out = ["--output-dir", str(tmp_path), "--save-every", "1"]
    assert main(CLI + out + ["--steps", "2"]) == 0
    path = tmp_path / "checkpoints" / "step_000002" / damaged
    path.write_bytes(path.read_bytes()[:40])  # cut short after it was written (a full disk, a partial copy)
    capsys.readouterr()
    assert main(CLI + out + ["--steps", "3", "--resume"]) == 2
    err = _error_line(capsys, f"invalid configuration: resume: cannot read {path} (")
    assert f"delete {path.parent} to resume from the one before it" in err
    import shutil

    shutil.rmtree(path.parent)
    assert main(CLI + out + ["--steps", "3", "--resume"]) == 0
    assert "resumed from step 1" in capsys.readouterr().err


def test_a_causal_lm_folder_as_reward_model_is_refused(tmp_path, capsys):
    """Loaded as a sequence classifier, a causal LM gets a freshly initialised score head: the policy would learn
    to please random numbers. Refused, naming the missing weights."""
    from rlkernels.trainer.data import tiny_tokenizer
    from rlkernels.trainer.models import tiny_model

    tok = tiny_tokenizer()
    tiny_model(len(tok), 32, 1, 0, tok).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    capsys.readouterr()
    assert main(CLI + ["--output-dir", str(tmp_path / "run"), "--reward", str(tmp_path / "lm")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rlkernels-train: invalid configuration: reward: {tmp_path / 'lm'} is not a "
                          "sequence-classification reward model: its weights lack score.weight"), err


def test_a_reward_model_folder_as_policy_or_reference_is_refused(tmp_path, capsys):
    """Loaded as a causal LM, a sequence classifier gets a freshly initialised LM head. Refused, naming the field."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlkernels.trainer.data import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    for name, cls in (("rm", LlamaForSequenceClassification), ("lm", LlamaForCausalLM)):
        cls(config).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    capsys.readouterr()
    args = ["--steps", "1", "--save-every", "0", "--no-progress", "--no-plot", "--losses", "eager",
            "--prompts-per-step", "2", "--group-size", "2", "--output-dir", str(tmp_path / "run")]
    for flags, field in (([f"--model={tmp_path / 'rm'}"], "model"),
                         ([f"--model={tmp_path / 'lm'}", f"--ref-model={tmp_path / 'rm'}"], "ref_model")):
        assert main(args + flags) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"rlkernels-train: invalid configuration: {field}: {tmp_path / 'rm'} is not a causal "
                              "language model: its weights lack lm_head.weight"), err


def test_ref_update_every_beyond_the_last_step_is_refused():
    with pytest.raises(ConfigError, match=r"^ref_update_every: it is larger than steps \(5\)"):
        from_dict({"steps": 5, "ref_update_every": 6})
    assert from_dict({"steps": 5, "ref_update_every": 5}).ref_update_every == 5


@pytest.mark.parametrize("damage", ["state_empty", "state_list", "state_step_text", "policy_other_names"])
def test_a_checkpoint_that_reads_back_but_does_not_fit_is_named_on_resume(tmp_path, capsys, damage):
    out = ["--output-dir", str(tmp_path), "--save-every", "1"]
    assert main(CLI + out + ["--steps", "2"]) == 0
    path = tmp_path / "checkpoints" / "step_000002"
    if damage == "policy_other_names":
        from safetensors.torch import save_file

        save_file({"foo": torch.zeros(2)}, str(path / "policy.safetensors"))
    else:
        state = json.loads((path / "state.json").read_text())
        text = {"state_empty": "{}", "state_list": "[]", "state_step_text": json.dumps({**state, "step": "2"})}[damage]
        (path / "state.json").write_text(text)
    capsys.readouterr()
    assert main(CLI + out + ["--steps", "3", "--resume"]) == 2
    err = _error_line(capsys, "invalid configuration: resume: ")
    assert f"delete {path} to resume from the one before it" in err


@pytest.mark.parametrize("values, name", [
    ({"output_dir": ""}, "output_dir"),
    ({"output_dir": "  "}, "output_dir"),
    ({"tiny_hidden": 12}, "tiny_hidden"),  # 4 heads of 3: rotary embeddings need an even head size
    ({"tiny_hidden": 20}, "tiny_hidden"),
    ({"lr": 1e39}, "lr"),  # AdamW takes it in float32: a RuntimeError traceback at the first optimizer step
    ({"algo": "ppo", "critic_lr": 1e39}, "critic_lr"),
])
def test_values_that_would_fail_later_are_refused_at_start_up(values, name):
    with pytest.raises(ConfigError, match=f"^{name}:"):
        from_dict(values)
    assert from_dict({"tiny_hidden": 24}).tiny_hidden == 24


@pytest.mark.parametrize("value", [["x", "y"], False, 3, {"a": 1}])
def test_a_text_field_of_another_type_in_a_config_file_is_refused(tmp_path, capsys, monkeypatch, value):
    monkeypatch.chdir(tmp_path)  # where str(value) used to become the output folder
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"output_dir": value}))
    assert main(["--config", str(path)]) == 2
    assert "output_dir: expected str" in _error_line(capsys, "invalid configuration: output_dir: ")


@pytest.mark.parametrize("field", ["preset", "recipe"])
@pytest.mark.parametrize("value", [["default"], {"a": 1}])
def test_a_preset_or_recipe_of_another_type_in_a_config_file_is_refused(tmp_path, capsys, field, value):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({field: value}))
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    assert "expected str" in _error_line(capsys, f"invalid configuration: {field}: ")


@pytest.mark.parametrize("field", ["lr", "clip_high", "missing_eos_penalty"])
@pytest.mark.parametrize("sign", ["", "-"])
def test_a_config_files_integer_beyond_the_float_range_is_refused(tmp_path, capsys, field, sign):
    path = tmp_path / "run.json"
    path.write_text(f'{{"{field}": {sign}1{"0" * 400}}}')  # JSON and TOML read it as a Python int
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    err = _error_line(capsys, f"invalid configuration: {field}: ")
    assert "an integer of 401 digits is too large for a float" in err


def test_a_learning_rate_beyond_float32_exits_2_and_a_large_finite_one_is_left_to_the_run(tmp_path, capsys):
    assert main(CLI + ["--output-dir", str(tmp_path / "a"), "--lr", "1e39"]) == 2
    assert "AdamW takes it in float32" in _error_line(capsys, "invalid configuration: lr: must be <= 3.4e+38")
    assert from_dict({"lr": 3e38, "algo": "ppo", "critic_lr": 3e38}).lr == 3e38  # exit 3 at the rollout it spoils


def test_weights_driven_to_non_finite_probabilities_stop_with_exit_3(tmp_path, capsys):
    """An absurd (finite) learning rate: the first update makes the policy's logits non-finite, and the next
    rollout's sampling cannot draw from them: the run stops as for a NaN loss (exit 3, named), not a traceback."""
    assert main(CLI + ["--output-dir", str(tmp_path), "--steps", "3", "--lr", "1e30"]) == 3
    err = _error_line(capsys, "stopped: the policy's next-token probabilities are not finite at step 2")
    assert "lr = 1e+30" in err


@pytest.mark.parametrize("setup", [[], ["--algo", "ppo"], ["--recipe", "dapo", "--minibatches", "2"],
                                   ["--algo", "ppo", "--epochs", "2", "--kl-target", "0.05"]], ids=str)
def test_a_runs_config_json_given_back_as_config_runs_the_same_configuration(tmp_path, capsys, setup):
    """config.json records every resolved value (defaults, the recipe's, clip_high = clip_low, the KL placement):
    given back as --config, none of them counts as an option the user set to no effect."""
    assert main(CLI + setup + ["--output-dir", str(tmp_path / "a")]) == 0
    assert main(["--config", str(tmp_path / "a" / "config.json"), "--output-dir", str(tmp_path / "b")]) == 0, \
        capsys.readouterr().err
    first, again = (json.loads((tmp_path / run / "config.json").read_text()) for run in ("a", "b"))
    assert {k: (v, again[k]) for k, v in first.items() if v != again[k]} == {
        "output_dir": (str(tmp_path / "a"), str(tmp_path / "b"))}
    # a key the user writes into a file still counts where it differs from what the run resolves
    (tmp_path / "own.json").write_text(json.dumps({"kl_horizon": 500}))
    assert main(["--config", str(tmp_path / "own.json"), "--output-dir", str(tmp_path / "c")]) == 2
