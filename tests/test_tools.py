"""The tools' tests: bench/ (python -m bench) and ablate/ (python -m ablate): the ablation rows, the
experiments, the habit models and the tables they write from metrics.jsonl."""
from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

import builtin
import checkpoint
import curves
import data
import flags
from test_grpo import _tiny_flags
from verifier import verify

# ---------------------------------------------------------------------------------------------
# bench/ (python -m bench)
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_slots_section_measures_both_sides(capsys, monkeypatch):
    """python -m bench --only slots, shrunk: memory in fresh processes at N and all rows, continuous
    vs static batches."""
    from bench import rollouts
    monkeypatch.setattr(rollouts, "SLOTS_SETUP", dict(B=6, G=2, T=24, vocab=64, ends=8))
    rollouts.bench_slots("cpu", 1, small=4)
    out = capsys.readouterr().out
    assert "rollout memory, peak RSS of a fresh process" in out and "all 12 rows" in out
    assert "the same response ids at N = 4" in out and "continuous / static tokens/s" in out


@pytest.mark.slow
def test_bench_compile_section_prints_every_way_from_one_run(capsys, monkeypatch):
    """python -m bench --only compile, shrunk to a 2-layer Qwen2 and one config (one real compile,
    ~30 s): the eager loop, the static loop eager and compiled, generate, the vLLM line (skipped
    where vllm does not import), the matmuls alone, the compile time, the profile."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench import compiled
    if not shutil.which("g++"):
        pytest.skip("no C++ compiler for inductor")

    def tiny():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=1, pad_token_id=0))
    monkeypatch.setattr(compiled, "MODEL", tiny)
    monkeypatch.setattr(compiled, "CONFIGS", [dict(title="tiny", B=3, plens=[130, 140, 135], G=2,
                                                   T=12, ends=[1, 2, 3], S=4)])
    compiled.bench_compile("cpu", 1)
    out = capsys.readouterr().out
    for line in ("## --compile, tiny, float32, cpu", "sample_groups, eager loop (the default)",
                 "static loop, step eager", "static loop, compiled (--compile)",
                 "model.generate(num_return_sequences=G)", "vLLM engine (--rollout vllm)",
                 "matmuls alone, 4-row decode steps", "compiled decode forward / matmuls alone: ",
                 "C = 192 columns", "compile: ", "once per shape and run; ",
                 "profile of one compiled rollout"):
        assert line in out, line
    assert "6 of 6 rows the same ids" in out


# ---------------------------------------------------------------------------------------------
# ablate/ (python -m ablate): the rows, the experiments, the habit models, the tables from metrics
# ---------------------------------------------------------------------------------------------

def test_ablation_rows_add_one_fix_each_and_end_at_dapo():
    import ablate.rows
    first = flags.parse_train_args(ablate.rows.row_flags(0))
    assert (first.beta, first.eps_high, first.reduction, first.dynamic_sampling,
            first.overlong_filter,
            first.overlong_penalty) == (0.0, 0.2, "sequence", False, False, False)
    last = flags.parse_train_args(ablate.rows.row_flags(len(ablate.rows.ROWS) - 1))
    assert {**vars(last), "algo": None} == {**vars(flags.parse_train_args(["--algo", "dapo"])),
                                            "algo": None}
    parsed = [vars(flags.parse_train_args(ablate.rows.row_flags(i)))
              for i in range(len(ablate.rows.ROWS))]
    changed = [sum(parsed[i][k] != parsed[i - 1][k]
                   for k in vars(first) if k != "algo") for i in range(1, len(ablate.rows.ROWS))]
    assert changed == [1] * (len(ablate.rows.ROWS) - 1)
    # an --add-row row is DAPO plus its flags
    rows = ablate.rows.ROWS + [ablate.rows.extra_row("+ CISPO=--loss cispo --tis-cap 2")]
    v = flags.parse_train_args(ablate.rows.row_flags(len(rows) - 1, rows))
    assert ({**vars(v), "algo": None, "loss": None, "tis_cap": None, "eps_low": None,
             "eps_high": None}
            == {**vars(last), "algo": None, "loss": None, "tis_cap": None, "eps_low": None,
                "eps_high": None})
    # ROWS set --eps-high 0.28 on the command line
    assert (v.loss, v.tis_cap, v.eps_high) == ("cispo", 2.0, 0.28)
    with pytest.raises(SystemExit):
        ablate.rows.extra_row("--loss cispo")


def test_ablation_table_and_curves_from_metrics():
    import ablate.rows
    # one run: eval 0.5 at step 0, two steps of 100 samples, eval 0.95 at step 2
    run = [{"step": 0, "eval/accuracy": 0.5},
           {"step": 1, "loss": 0.0, "samples": 100, "entropy": 0.2, "len/mean": 10.0,
            "len/truncated_frac": 0.5, "clip/low_frac": 0.01, "clip/high_frac": 0.0},
           {"step": 2, "loss": 0.0, "samples": 200, "entropy": 0.1, "len/mean": 8.0,
            "len/truncated_frac": 0.0, "clip/low_frac": 0.03, "clip/high_frac": 0.001},
           {"step": 2, "eval/accuracy": 0.95}]
    assert curves.curve(run, "eval/accuracy") == [(0, 0.5), (200, 0.95)]
    assert (ablate.rows.samples_to_reach(run, 0.9) == 200
            and ablate.rows.samples_to_reach(run, 0.99) is None)
    md = ablate.rows.table({name: [run, run] for name, _, _ in ablate.rows.ROWS}, budget=200)
    first = md.splitlines()[2]
    assert first.startswith("| naive GRPO | 0.950 ± 0.000 | 0.500 ± 0.000 | 200 (2/2 seeds) | "
                            "0.1500 ± 0.0000 | 9.0 ± 0.0 |"
                            " 0.250 ± 0.000 | 2.00% / 0.05% | 2 |")


def test_experiment_arms_change_only_their_fix():
    """Each experiment's arms are the baseline plus the one fix they test (all flags parse)."""
    from ablate import experiments
    fixes = {"dynamic-sampling": [{"dynamic_sampling"}],
             "overlong-shaping": [{"overlong_filter"}, {"overlong_filter", "overlong_penalty"}],
             "token-level-loss": [{"reduction"}],
             "clip-higher": [{"eps_high"}], "clip-higher-random-reward": [{"eps_high"}]}
    assert [e.name for e in experiments.EXPERIMENTS] == list(fixes)
    for e in experiments.EXPERIMENTS:
        base = vars(flags.parse_train_args([*e.flags, *e.arms[0][1]]))
        assert (base["beta"], base["eps_high"], base["reduction"], base["dynamic_sampling"],
                base["overlong_filter"], # naive GRPO
                base["overlong_penalty"]) == (0.0, 0.2, "sequence", False, False, False)
        changed = [{k for k, v in vars(flags.parse_train_args([*e.flags, *arm])).items()
                    if v != base[k]} for _, arm in e.arms[1:]]
        assert changed == fixes[e.name], e.name
        data.Reward.load(base["reward"])  # a --reward module:function the experiment names imports


def test_experiment_measures_by_hand():
    from ablate import experiments, measures
    c = lambda resp, trunc=False, prompt="3x+5=x+9\n", step=1: {  # noqa: E731
        "prompt": prompt, "response": resp, "truncated": trunc, "length": len(resp), "step": step}
    assert experiments.solution("3x+5=x+9\n") == 2 and experiments.solution("2x-4=-10") == -3
    assert experiments.solution("4x+1=2x-5\n") == -3
    assert (experiments.right(c("3x-x=9-5\n2x=4\nx=4/2\nAnswer: 2"))
            and not experiments.right(c("x=9/3\nAnswer: 3")))
    # the verbose solution, cut
    assert experiments.on_the_way(c("3x-x=9-5\n2x=4\nx=4/2\nche", True))
    assert (experiments.on_the_way(c("3x-x=9-5\n2x=", True))
            and not experiments.on_the_way(c("3x-x=9-5\n2x=", False)))
    assert not experiments.on_the_way(c("3x-x=9-5\n2x=5", True))                     # a wrong step
    assert experiments.repeats(c("x=1\nx=2\nx=1")) and not experiments.repeats(c("x=1\n\nx=2"))
    cs = [c("Answer: 1"), c("Answer: 2"), c("Answer: 1"), c("Answer: 5", prompt="2x=4\n")]
    # 2 answers in one group, 1 in the other
    assert experiments.distinct_answers(cs) == 1.5
    assert experiments.share(experiments.right)(cs) == 0.25
    assert experiments.share(experiments.right, lambda c: False)(cs) is None
    assert experiments.mean_length(lambda c: c["prompt"] == "2x=4\n")(cs) == 9
    run = measures.Run({"prompts_per_step": 16, "steps": 2, "group_size": 4},
                       [{"step": 0, "eval/accuracy": 0.5},
                        {"step": 1, "loss": 0, "samples": 64, "reward/frac_zero_std": 0.25},
                        {"step": 2, "loss": 0, "samples": 192, "reward/frac_zero_std": 0.5,
                         "sampling/groups_kept": 16.0},
                        {"step": 2, "eval/accuracy": 0.75}], cs[:2] + [{**cs[3], "step": 2}])
    # 16 x (1 - 0.25), then what was kept
    assert experiments.informative_groups(run) == [(1, 12.0), (2, 16.0)]
    acc = lambda r: curves.curve(r.metrics, "eval/accuracy")  # noqa: E731
    assert (experiments.equal_budget(run) == 128
            and measures.at_samples(acc, experiments.equal_budget)(run) == 0.5)
    assert (measures.at_samples(acc, lambda r: 192)(run) == 0.75
            and measures.final("eval/accuracy")(run) == 0.75)
    assert measures.by_step(experiments.mean_length(lambda c: True))(run) == [(1, 9), (2, 9)]
    assert measures.end(measures.logged("reward/frac_zero_std"), k=1)(run) == 0.5
    assert measures.over_run(experiments.informative_groups)(run) == 14.0
    d, se = experiments.difference([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    # sd 1 on each side, 3 seeds
    assert d == 1.0 and se == pytest.approx(math.sqrt(1 / 3 + 1 / 3))
    assert experiments.difference([1.0], [2.0, 3.0]) == (1.5, None)
    random.seed(0)
    coins = [experiments.random_reward("x", "1") for _ in range(2000)]
    random.seed(0)
    assert (coins == [experiments.random_reward("y", "2") for _ in range(2000)]
            and 0.45 < sum(coins) / 2000 < 0.55)


def test_experiment_table_says_what_is_beyond_noise():
    from ablate import experiments
    from ablate.measures import Run
    exp = experiments.Experiment("x", "claim", (), (("off", ()), ("on", ("--dynamic-sampling",))),
                                 (("acc", lambda r: r.config["acc"]),
                                  ("len", lambda r: r.config["len"])), ())
    runs = {"off": [Run({"acc": a, "len": n}, [], []) for a,
                    n in ((0.5, 20), (0.6, 30), (0.7, 25))],
            "on": [Run({"acc": a, "len": n}, [], []) for a, n in ((0.9, 21), (0.8, 31), (1.0, 26))]}
    md = experiments.experiment_table(exp, runs).splitlines()
    assert md[0] == "| measure | off | on | on − off (± 2 SE) |"
    # 2 SE = 2 sqrt(.01/3 + .01/3)
    assert md[2] == "| acc | 0.600 ± 0.100 | 0.900 ± 0.100 | +0.3 ± 0.16: **beyond noise** |"
    assert md[3] == "| len | 25.0 ± 5.0 | 26.0 ± 5.0 | +1 ± 8.2: within noise |"
    assert md[-1] == "mean ± sd over 3 seeds per arm."
    one = {k: v[:1] for k, v in runs.items()}
    assert "one seed: no spread" in experiments.experiment_table(exp, one)


@pytest.mark.slow
def test_experiments_run_train_and_write_a_table_per_experiment(tiny_run_inputs, tmp_path,
                                                                monkeypatch, capsys):
    """python -m ablate's experiments drive train.main: each arm x seed a run, then RESULTS/NAME.md
    from their logs."""
    from ablate import __main__ as ablate_main
    from ablate import experiments, measures
    d = tiny_run_inputs
    monkeypatch.syspath_prepend(str(d))
    exp = experiments.Experiment(
        "tiny", "claim", experiments.NAIVE + tuple(_tiny_flags(d, "unused")[:-4])
        + ("--steps", "2", "--eval-every", "2", "--eval-size", "2", "--log-completions", "999"),
        (("off", ()), ("on: dynamic sampling", ("--dynamic-sampling",))),
        (("groups with a gradient", measures.over_run(experiments.informative_groups)),
         ("responses", lambda r: len(r.completions))),
         (("length", "step", measures.by_step(experiments.mean_length(lambda c: True))),))
    monkeypatch.setattr(experiments, "EXPERIMENTS", (exp,))  # read when main runs
    # new folder
    ablate_main.main(["--seeds", "0", "1", "--out", str(tmp_path / "runs"), "--results",
                      str(tmp_path / "res")])
    md = (tmp_path / "res" / "tiny.md").read_text()
    # 2 steps x 4 x 4, all logged
    assert ("| responses | 32.0 ± 0.0 | 32.0 ± 0.0 |" in md
            and "mean ± sd over 2 seeds per arm." in md)
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == \
        ["off-seed0", "off-seed1", "on-dynamic-sampling-seed0", "on-dynamic-sampling-seed1"]
    metrics = measures.load_run(
        str(tmp_path / "runs" / "tiny" / "on-dynamic-sampling-seed1")).metrics
    assert all("sampling/groups_kept" in r for r in metrics if "loss" in r)
    assert not any("sampling/groups_kept" in r for r in measures.load_run(
        str(tmp_path / "runs" / "tiny" / "off-seed1")).metrics)
    assert (("tiny.png" in os.listdir(tmp_path / "res"))
            == ("figure:" in capsys.readouterr().out))
    with pytest.raises(SystemExit):
        # a --rows flag without --rows
        ablate_main.main(["--train-flags", "--mu 2"])


def test_stuttered_demonstrations_repeat_steps_never_the_answer():
    """habits.stuttered (the token-level experiment's habit): each step line 1 + 0-3 times, the
    answer once."""
    from ablate import habits
    # 4 step lines, then 'Answer: 2'
    sol = builtin.solve_steps("3x+5=x+9", 2, verbose=True)
    assert habits.stuttered(sol, random.Random(0), 0.0) == sol
    for seed in range(20):
        out = habits.stuttered(sol, random.Random(seed), 1.0).split("\n")
        assert (out[-1] == "Answer: 2" and out.count("Answer: 2") == 1
                and verify("\n".join(out), "2") == 1.0)
        # runs of the same lines, in order
        assert [x for i, x in enumerate(out) if i == 0 or x != out[i - 1]] == sol.split("\n")
        assert all(2 <= out.count(x) <= 4 for x in sol.split("\n")[:-1])
    demos = habits.habit_demos(habits.Habit(steps=4, batch_size=50), builtin.BaseModelConfig())
    stutters = sum(len(set(r.split("\n"))) < len(r.split("\n")) for _, r in demos)
    # 1 - 0.7^k of k-step solutions (k 1-4)
    assert len(demos) == 200 and 0.4 < stutters / 200 < 0.9
    assert not any(builtin.is_heldout(p.strip()) for p, _ in demos)


def test_habit_key_and_build(tmp_path, monkeypatch):
    """A habit's key changes with its fields, its code (ablate/habits.py) and the base recipe (its
    config and builtin.py's recipe code); the habit code lives outside builtin.py, so editing it
    leaves the base model's key (and so the shipped weights) alone. habit_model builds once, then
    finds the folder."""
    from ablate import experiments, habits
    with open(habits.__file__, encoding="utf-8") as fh:
        src = fh.read()
    with open(builtin.__file__, encoding="utf-8") as fh:
        base_src = fh.read()
    h, cfg = habits.Habit(), builtin.BaseModelConfig()
    key = habits.habit_key(h, cfg, src)
    assert habits.habit_key(h) == key                     # the defaults: habits.py, builtin.py
    for f in dataclasses.fields(h):
        x = getattr(h, f.name)
        changed = {f.name: x + 1 if isinstance(x, int) else x / 2}
        assert habits.habit_key(dataclasses.replace(h, **changed), cfg, src) != key
    assert habits.habit_key(h, dataclasses.replace(cfg, seed=1), src) != key
    # stuttered
    for old, new in (("[line] * (1 + (rng.randint(1, 3)", "[line] * (1 + (rng.randint(1, 2)"),
                     # habit_demos
                     ("rng = random.Random(h.seed + 7)", "rng = random.Random(h.seed + 8)"),
                     ("lr=h.lr, weight_decay=0.0, betas=(0.9, 0.98))\n    model.train()\n    for k",
                      # fine_tune
                      "lr=h.lr, weight_decay=0.0, betas=(0.9, 0.99))\n    model.train()\n    for "
                      "k")):
        assert src.count(old) == 1, old
        assert habits.habit_key(h, cfg, src.replace(old, new)) != key, old
    # the base recipe's code: the demonstrations a habit model's base was warm-started on
    old = "rng = random.Random(cfg.seed + 1)"
    assert base_src.count(old) == 1
    edited = base_src.replace(old, "rng = random.Random(cfg.seed + 2)")
    assert habits.habit_key(h, cfg, src, edited) != key
    tiny = builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, sft_steps=2,
                                   sft_batch_size=8)
    small, logs = habits.Habit(steps=2, batch_size=4), []
    folder = habits.habit_model(small, tiny, str(tmp_path), log=lambda *a, **k: logs.append(a))
    # base (2 lines), habit
    assert folder == str(tmp_path / f"habit-{habits.habit_key(small, tiny)}") and len(logs) == 3
    _, _, base = checkpoint.load_model(str(tmp_path / f"base-{builtin.recipe_key(tiny)}"))
    _, tok, model = checkpoint.load_model(folder)
    assert (tok.eos_token_id == 1 and any(not torch.equal(p, q) for p,
                                          q in zip(base.parameters(), model.parameters())))
    assert (habits.habit_model(small, tiny, str(tmp_path), log=lambda *a,
                               **k: logs.append(a)) == folder and len(logs) == 3)
    # an experiment on a habit model runs train.py on its folder, the built-in task's learning rate
    monkeypatch.setattr(habits, "habit_model", lambda h: folder)
    exp = next(e for e in experiments.EXPERIMENTS if e.name == "token-level-loss")
    args = flags.parse_train_args([*exp.model_flags(), *exp.flags])
    assert ((args.model, args.lr, args.max_new_tokens, args.steps)
            == (folder, flags.BUILTIN_DEFAULTS["lr"], 96, 16))
    assert experiments.Experiment("x", "", ("--steps", "2"), (), (), ()).model_flags() == ()
