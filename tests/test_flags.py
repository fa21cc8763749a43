"""The flags (harness/flags.py): a bad flag in one line, --help's groups, the --max-num-seqs checks.

    python -m pytest -q tests/test_flags.py
"""
from __future__ import annotations

import pytest

from harness import flags


def test_bad_flags_exit_with_one_line(capsys):
    for bad in (["--group-size", "1"], ["--max-new-tokens", "0"], ["--algo", "ppo"],
                ["--reduction", "mean"],
                ["--top-p", "0"], ["--overlong-cache", "999"], ["--steps", "x"],
                ["--loss", "reinforce"],
                ["--kl", "k4"], ["--loss", "gspo", "--clip-c", "3"], ["--tis-cap", "-1"],
                ["--beta", "-0.1"]):
        with pytest.raises(SystemExit) as e:
            flags.parse_train_args(bad)
        err = capsys.readouterr().err
        assert (e.value.code == 2 and err.startswith("error: ")
                and len(err.strip().splitlines()) == 1), err


def test_train_help_shows_args_sections_as_groups_with_every_flag_once(capsys, monkeypatch):
    import dataclasses as dc
    import re

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        flags.parse_train_args(["--help"])
    assert e.value.code == 0
    groups, where = {}, None                   # group title -> the flags listed under it, in order
    for line in capsys.readouterr().out.splitlines():
        if re.fullmatch(r"\S.*:", line):       # a group's heading: "how much:"
            where = groups.setdefault(line[:-1], [])
        elif m := re.match(r"  (?:-h, )?(--[\w-]+)", line):
            where.append(m.group(1))
    titles = ["options", "the model and data", "how much", "optimisation",
              "the loss: GRPO's settings, and DAPO's four fixes one by one", "the run"]
    assert list(groups) == titles and groups["options"] == ["--help"]
    # EvalArgs' flags (flags.TrainArgs inherits them) come first in their sections
    assert [group[0] for group in list(groups.values())[1:]] == ["--model", "--max-new-tokens",
                                                                 "--lr", "--beta", "--seed"]
    assert "--algo" in groups["the model and data"] and "--mini-batches" in groups["optimisation"]
    assert "--eval-samples" in groups["how much"] and "--bf16" in groups["the run"]
    assert "--dynamic-sampling" in groups[titles[4]] and "--resume" in groups["the run"]
    listed = [f for group in list(groups.values())[1:] for f in group]
    # each once
    assert sorted(listed) == sorted("--" + f.name.replace("_", "-")
                                    for f in dc.fields(flags.TrainArgs))


def test_max_num_seqs_flags_are_checked(capsys):
    import evaluate
    assert (flags.parse_train_args(["--max-num-seqs", "8"]).max_num_seqs == 8
            and flags.parse_train_args([]).max_num_seqs is None)
    for parse, bad in ((flags.parse_train_args, ["--max-num-seqs", "4"]),
                       (evaluate.main, ["--eval-samples", "4", "--max-num-seqs", "2"])):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        err = capsys.readouterr().err
        assert (e.value.code == 2 and err.startswith("error: --")
                and len(err.strip().splitlines()) == 1), err


def test_eval_flags_are_shared_and_checked(capsys):
    import dataclasses as dc

    import evaluate
    mine = {f.name: f for f in dc.fields(flags.TrainArgs)}
    for f in dc.fields(flags.EvalArgs):  # one definition: same type, default and help in train.py
        assert ((mine[f.name].type, mine[f.name].default, mine[f.name].metadata)
                == (f.type, f.default, f.metadata)), f.name
    for parse in (flags.parse_train_args, evaluate.main):
        for bad in (["--eval-samples", "0"], ["--eval-temperature", "0"], ["--eval-top-p", "1.5"],
                    ["--max-new-tokens", "0"]):
            with pytest.raises(SystemExit) as e:
                parse(bad)
            err = capsys.readouterr().err
            assert (e.value.code == 2 and err.startswith("error: ")
                    and len(err.strip().splitlines()) == 1), err


def test_the_builtin_task_runs_dapo_30_steps_and_grpo_40_a_model_500():
    """The steps each command runs when --steps is not given (flags.BUILTIN_ALGO_DEFAULTS); a
    --steps given wins, and the other built-in defaults are the same for both algorithms."""
    steps = lambda *argv: flags.parse_train_args(list(argv)).steps  # noqa: E731
    assert steps("--algo", "dapo") == 30
    assert steps("--algo", "grpo") == 40
    assert steps("--algo", "dapo", "--steps", "40") == 40
    assert steps("--algo", "dapo", "--model", "some/model") == 500
    dapo, grpo = (flags.parse_train_args(["--algo", a]) for a in ("dapo", "grpo"))
    assert (dapo.prompts_per_step, dapo.lr) == (grpo.prompts_per_step, grpo.lr) == (32, 2e-4)
