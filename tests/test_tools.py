"""The tools' tests: bench/ (python -m bench) and ablate/ (python -m ablate): the ablation rows, the
experiments, the habit models and the tables they write from metrics.jsonl."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re

import pytest
import torch

from ablate import curves
from harness import builtin, data, flags, models
from helpers import HERE, tiny_flags
from verifier import verify

# ---------------------------------------------------------------------------------------------
# bench/ (python -m bench)
# ---------------------------------------------------------------------------------------------

# bench/gpu_check.py: the prepared GPU check's runner and its stages' cores, on the CPU

def test_gpu_check_parses_its_stages_and_refuses_an_unknown_one(capsys):
    from bench import gpu_check
    a = gpu_check.parse(["out"])
    assert (a.out, a.stage, a.device, a.child) == ("out", None, "cuda", False)
    assert gpu_check.parse(["o", "--stage", "head", "--stage", "env"]).stage == ["head", "env"]
    with pytest.raises(SystemExit) as e:
        gpu_check.parse(["o", "--stage", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    # every stage has a function and a box, and the boxes sum to the 9 minutes promised
    assert set(gpu_check.STAGES) == set(gpu_check.STAGE_FN) and sum(
        gpu_check.STAGES.values()) <= 9 * 60


@pytest.mark.slow
def test_gpu_check_boxes_each_stage_and_writes_its_json(tmp_path, monkeypatch):
    # a stage past its box: killed, its JSON says so; one that dies without writing: its exit and
    # last line; a real child (env on the CPU): its own JSON, and summary.json lists it
    import json
    import sys

    from bench import gpu_check
    slow = gpu_check.run_stage(str(tmp_path), "train", 1,
                               [sys.executable, "-c", "import time; time.sleep(60)"])
    assert slow["timed_out"] and not slow["ok"] and slow["wall_s"] < 30
    dead = gpu_check.run_stage(str(tmp_path), "head", 30,
                               [sys.executable, "-c", "import sys; sys.exit('no GPU here')"])
    assert dead == {"stage": "head", "ok": False, "error": "exit 1: ['no GPU here']",
                    "wall_s": dead["wall_s"]}
    assert json.loads((tmp_path / "head.json").read_text()) == dead
    monkeypatch.setitem(gpu_check.STAGES, "env", 600)            # shared CPUs: imports are slow
    summary = gpu_check.main([str(tmp_path), "--stage", "env", "--device", "cpu"])
    env = json.loads((tmp_path / "env.json").read_text())
    assert summary["env"]["ok"] and env["ok"] and env["result"]["torch"] == torch.__version__
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_gpu_check_stage_cores_at_toy_size_on_the_cpu(monkeypatch):
    from bench import gpu_check
    from helpers import tiny
    # the fused head against the plain one: the same values, gradients to bf16 rounding
    h = gpu_check.head_compare(300, 16, 24, "cpu")
    assert h["logp_max_diff"] < 1e-4 and h["grad_h_rel"] < 2e-2 and h["grad_W_rel"] < 2e-2
    # the sampler under bf16 autocast: a bf16 cache, a mismatch the trainer's forward measures
    s = gpu_check.sampler_check(tiny("qwen2", torch.float32), [[5, 6, 7], [8, 9, 10, 11]], 2, 8,
                                "cpu")
    assert s["kv_dtype"] == "torch.bfloat16" and s["decode_steps"] >= 1
    assert 0 <= s["mismatch_abs_mean"] <= s["mismatch_abs_max"] < 0.1
    # the determinism probe: the CPU repeats itself bitwise
    d = gpu_check.determinism_check("cpu", layers=1, T=16)
    assert d["grads_bitwise_equal"] and d["index_add_bitwise_equal"]
    # the memory stage's two updates and the model's prediction, at toy widths with Qwen's V
    from bench import memory
    monkeypatch.setitem(memory.SHAPES, "toy", dict(layers=1, hidden=32, inter=64, heads=2, kv=1,
                                                   params=0, tied=True))
    m = gpu_check.memory_check("toy", 1, 4, 16, "cpu")
    assert m["params"] > memory.V_QWEN * 32 and m["predicted_update_gib"] > 0
    # CUDA's peak probe, with torch.cuda stubbed: the allocated peak above the start
    mem = iter([100, 350])
    for name, fn in (("synchronize", lambda: None), ("reset_peak_memory_stats", lambda: None),
                     ("memory_allocated", lambda: next(mem)),
                     ("max_memory_allocated", lambda: next(mem))):
        monkeypatch.setattr(torch.cuda, name, fn)
    assert gpu_check._peak("cuda", lambda: "done")[:2] == ("done", 250)


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


def test_bench_bf16_section_times_both_dtypes_and_skips_without_the_model(tiny_run_inputs, capsys,
                                                                          monkeypatch):
    """python -m bench --only bf16, shrunk, on a tiny model folder given as REAL_MODEL: the CPU's
    bf16 flags, the probe, the rollout and the update in both dtypes; without the model, a line."""
    from bench import bf16
    monkeypatch.setattr(bf16, "B", 2)
    monkeypatch.setattr(bf16, "T", 4)
    monkeypatch.setenv("REAL_MODEL", str(tiny_run_inputs / "model"))
    bf16.bench_bf16("cpu", 1)
    out = capsys.readouterr().out
    assert "CPU: avx512_bf16" in out and "| matmul probe" in out
    assert "| rollout (Step 1), s |" in out and "| update (Step 4), s |" in out
    assert "of the rows are float32's tokens" in out and "before the first that differs" in out
    monkeypatch.setenv("REAL_MODEL", str(tiny_run_inputs / "no-such-model"))
    bf16.bench_bf16("cpu", 1)
    assert "skipped: needs the CPU and the real model" in capsys.readouterr().out


def test_bench_generate_tokens_counts_each_response_up_to_its_first_end_id():
    """bench.rollouts.generate_tokens (the `generate` line of the rollouts section):
    generate gets the prompts left-padded with their mask, and each response counts up to and with
    its first end id, none after it."""
    from bench.rollouts import generate_tokens

    class Fake:
        def generate(self, ids, attention_mask, num_return_sequences, **kw):
            assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]                       # left-padded
            assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
            assert num_return_sequences == 2 and kw["eos_token_id"] == [1, 2]
            resp = [[3, 1, 4, 1], [2, 0, 0, 0], [3, 3, 3, 3], [4, 4, 2, 1]]       # [N, T]
            return torch.cat([ids.repeat_interleave(2, 0), torch.tensor(resp)], dim=1)

    assert generate_tokens(Fake(), [[5, 6, 7], [8]], 2, 4, [1, 2], "cpu") == 2 + 1 + 4 + 3


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
    # exactly DAPO under the run length `python -m ablate --rows` gives every row (--steps with
    # --max-samples): the built-in defaults' steps differ by --algo (GRPO 40, DAPO 30)
    budget = ["--steps", "1000", "--max-samples", "10240"]
    assert ({**vars(flags.parse_train_args(ablate.rows.row_flags(len(ablate.rows.ROWS) - 1)
                                           + budget)), "algo": None}
            == {**vars(flags.parse_train_args(["--algo", "dapo", *budget])), "algo": None})
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
    # one run: eval 0.5 at step 0, two steps of 100 samples (eval 0.7, 0.6 at step 1), eval 0.95 at
    # step 2
    run = [{"step": 0, "eval/accuracy": 0.5},
           {"step": 1, "loss": 0.0, "samples": 100, "entropy": 0.2, "len/mean": 10.0,
            "len/truncated_frac": 0.5, "clip/low_frac": 0.01, "clip/high_frac": 0.0},
           {"step": 1, "eval/accuracy": 0.7}, {"step": 1, "eval/accuracy": 0.6},
           {"step": 2, "loss": 0.0, "samples": 200, "entropy": 0.1, "len/mean": 8.0,
            "len/truncated_frac": 0.0, "clip/low_frac": 0.03, "clip/high_frac": 0.001},
           {"step": 2, "eval/accuracy": 0.95}]
    assert curves.curve(run, "eval/accuracy") == [(0, 0.5), (100, 0.7), (100, 0.6), (200, 0.95)]
    # a quarter of 400: the last evaluation within 100 responses
    md = ablate.rows.table({name: [run, run] for name, _, _ in ablate.rows.ROWS}, budget=400)
    first = md.splitlines()[2]
    # clipped tokens as a share of the tokens (0.02 and 0.0005 over the run), as the experiments'
    # tables give them
    assert first == ("| naive GRPO | 0.950 ± 0.000 | 0.600 ± 0.000 | 0.1500 ± 0.0000 | 9.0 ± 0.0 |"
                     " 0.250 ± 0.000 | 0.0200 ± 0.0000 | 0.0005 ± 0.0000 | 2 ± 0 | 30 |")
    # the figure: the four curves, then the held-out accuracy at the end, one point per row
    panels = ablate.rows.figure_panels({"a": [run, run], "b": [run]})
    assert [p[0] for p in panels] == [c[1] for c in curves.CURVES] + [
        "held-out greedy accuracy at the end"]
    assert panels[-1][2] == {"a": [[(0, 0.95)], [(0, 0.95)]], "b": [[(1, 0.95)]]}
    # the differences: DAPO's seeds end at 0.97 and 0.99 (2 SE 0.02), the others' at 0.95 twice
    low, high = ([*r[:-1], {**r[-1], "eval/accuracy": a}] for r, a in ((run, 0.97), (run, 0.99)))
    runs = {name: [run, run] for name, _, _ in ablate.rows.ROWS[:-1]}
    md = ablate.rows.table({**runs, "dapo": [low, high], "+ X": [run, run]}, 200,
                           ablate.rows.ROWS + [("+ X", [], None)]).splitlines()
    assert md[7].startswith("| + dynamic sampling (= DAPO) | 0.980 ± 0.014 |")
    diffs = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in md if "(−" in line
             or line.startswith("| DAPO −")}
    beyond = "+0.03 ± 0.02: **beyond noise**"
    assert diffs == {"+ overlong filtering (− the row above)": "+0 ± 0: within noise",
                     "+ clip-higher (− the row above)": "+0 ± 0: within noise",
                     "+ soft overlong punishment (− the row above)": "+0 ± 0: within noise",
                     "+ token-level loss (− the row above)": "+0 ± 0: within noise",
                     "+ dynamic sampling (= DAPO) (− the row above)": beyond,
                     "+ X (− DAPO)": "-0.03 ± 0.02: **beyond noise**",
                     "DAPO − naive GRPO": beyond}
    assert md[-1] == "mean ± sd over 2 seeds per row."
    # rows cut short (the first two): the one difference there is, no DAPO line
    md = ablate.rows.table(dict(list(runs.items())[:2]), 200, ablate.rows.ROWS[:2]).splitlines()
    assert [line[:25] for line in md if "(−" in line or "DAPO −" in line] == [
        "| + overlong filtering (−"]


def test_figures_read_alone(tmp_path):
    """Every figure has x and y labels in each panel, one shared legend, and a caption that gives
    the seeds per line and the band (lowest to highest seed); a line of two points (an evaluation
    before and after) is drawn as its points with bars; every experiment's figure ends with the
    held-out accuracy."""
    pytest.importorskip("matplotlib")
    from ablate import experiments, measures
    seeds = [[(s, 0.1 * s + k) for s in range(6)] for k in (0.0, 0.2, 0.4)]        # 3 seeds
    two = [[(0, 0.5), (16, 0.9)], [(0, 0.5), (16, 0.8)], [(0, 0.5), (16, 0.7)]]
    panels = [("truncated", "step", {"off": seeds, "on": seeds[:2]}, "share of responses"),
              ("held-out", "step", {"off": two, "on": two})]
    fig = curves.panels_figure(panels, "name")
    assert [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes] == [
        ("step", "share of responses"), ("step", "held-out")]                # default: the title
    assert ([t.get_text() for t in fig.legends[0].get_texts()] == ["off", "on"]
            and len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes))
    assert fig.get_suptitle() == ("name\nline: mean over 2-3 seeds; band (dashed with 3+ lines): "
                                  "lowest to highest seed at each point")
    band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]                # off's band
    assert (band.min(), band.max()) == pytest.approx((0.0, 0.9))
    bars = fig.axes[1].containers[0]                                  # off: points with bars
    assert list(bars.lines[0].get_ydata()) == pytest.approx([0.5, 0.8])
    assert bars.lines[0].get_linestyle() == "None"                    # two points: no line between
    assert [y for s in bars.lines[2][0].get_segments() for y in s[:, 1]] == pytest.approx(
        [0.5, 0.5, 0.7, 0.9])                                           # min to max of the seeds
    # three lines or more: each band as its two dashed edges, no filled band to blend
    fig = curves.panels_figure([("t", "step", {"a": seeds, "b": seeds, "c": seeds})], "name")
    ax = fig.axes[0]
    assert not ax.collections and len(ax.lines) == 9
    assert sorted(tuple(ln.get_ydata()[:1]) for ln in ax.lines if ln.get_linestyle() == "--") == \
        pytest.approx([(0.0,)] * 3 + [(0.4,)] * 3)
    # one run's figure: the four CURVES with their units
    run = [{"step": 0, "eval/accuracy": 0.5},
           *({"step": s, "loss": 0, "samples": 64 * s, "entropy": 0.1, "len/mean": 30.0,
              "len/truncated_frac": 0.1} for s in range(1, 6)), {"step": 5, "eval/accuracy": 0.9}]
    fig = curves.panels_figure(curves.runs_panels({"dapo": [run]}), "dapo")
    assert [ax.get_ylabel() for ax in fig.axes] == [y for _, _, y in curves.CURVES]
    assert (fig.get_suptitle() == "dapo\none seed per line: no band"
            and {ax.get_xlabel() for ax in fig.axes} == {"responses sampled"})
    assert curves.plot_runs({"dapo": [run]}, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # an experiment's figure: its panels, then the held-out accuracy before and after
    exp = next(e for e in experiments.EXPERIMENTS if e.name == "overlong-shaping")
    r = measures.Run({}, run, [])
    drawn = experiments.figure_panels(exp, {"hard": [r, r]})
    assert [p[0] for p in drawn] == [p[0] for p in exp.panels] + [experiments.HELD_OUT_PANEL[0]]
    assert drawn[-1][2] == {"hard": [[(0, 0.5), (5, 0.9)]] * 2}
    # the random-reward control evaluates with its coin: no held-out panel
    coin = next(e for e in experiments.EXPERIMENTS if e.name == "clip-higher-random-reward")
    assert [p[0] for p in experiments.figure_panels(coin, {"x": [r]})] == [
        p[0] for p in coin.panels]


def test_experiment_arms_change_only_their_fix():
    """Each experiment's arms are the baseline plus the one fix they test (all flags parse)."""
    from ablate import experiments
    fixes = {"dynamic-sampling": [{"dynamic_sampling"}],
             "overlong-shaping": [{"overlong_filter"}, {"overlong_filter", "overlong_penalty"},
                                  {"overlong_penalty"}],
             "token-level-loss": [{"reduction"}],
             "clip-higher": [{"eps_high"}], "clip-higher-random-reward": [{"eps_high"}],
             "clip-higher-paths": [{"eps_high"}]}
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
    # the same path in another spacing is one path; another path to the same answer is two
    paths = [c("2x=4\nAnswer: 2"), c("2x = 4\nAnswer: 2"), c("4=2x\nAnswer: 2"),
             c("x=1", prompt="")]
    assert experiments.distinct_paths(paths) == 1.5 and experiments.distinct_answers(paths) == 1
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
    assert experiments.first(measures.logged("reward/frac_zero_std"))(run) == 0.25
    assert measures.over_run(experiments.informative_groups)(run) == 14.0
    d, se = measures.difference([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    # sd 1 on each side, 3 seeds
    assert d == 1.0 and se == pytest.approx(math.sqrt(1 / 3 + 1 / 3))
    assert measures.difference([1.0], [2.0, 3.0]) == (1.5, None)
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
        "tiny", "claim", experiments.NAIVE + tuple(tiny_flags(d, "unused")[:-4])
        + ("--steps", "2", "--eval-every", "2", "--eval-size", "2", "--log-completions", "999"),
        (("off", ()), ("on: dynamic sampling", ("--dynamic-sampling",))),
        (("groups with a gradient", measures.over_run(experiments.informative_groups)),
         ("responses", lambda r: len(r.completions))),
         (("length", "step", measures.by_step(experiments.mean_length(lambda c: True))),),
        seeds=2)
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
    # without --seeds, the experiment's own count (seeds=2): the finished runs are read, none added
    ablate_main.main(["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "again")])
    assert (tmp_path / "again" / "tiny.md").read_text() == md and len(os.listdir(
        tmp_path / "runs" / "tiny")) == 4
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
    config and harness/builtin.py's recipe code); the habit code lives outside harness/builtin.py,
    so
    editing it leaves the base model's key (and so the shipped weights) alone. habit_model builds
    once, then
    finds the folder."""
    from ablate import experiments, habits
    with open(habits.__file__, encoding="utf-8") as fh:
        src = fh.read()
    with open(builtin.__file__, encoding="utf-8") as fh:
        base_src = fh.read()
    h, cfg = habits.Habit(), builtin.BaseModelConfig()
    key = habits.habit_key(h, cfg, src)
    assert habits.habit_key(h) == key            # the defaults: habits.py, harness/builtin.py
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
    _, _, base = models.load_model(str(tmp_path / f"base-{builtin.recipe_key(tiny)}"))
    _, tok, model = models.load_model(folder)
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


def test_shipped_habit_models_are_their_recipes_builds():
    """ablate/habit_models/NAME holds the weights habits.SHIPPED_HABITS[NAME] builds, and the
    experiments run on them: after changing a habit (its fields, ablate/habits.py's build code, the
    base recipe) `python -m ablate.habits --ship` rebuilds them."""
    import json

    from ablate import experiments, habits
    assert sorted(os.listdir(habits.SHIP_DIR)) == sorted(habits.SHIPPED_HABITS)
    for name, h in habits.SHIPPED_HABITS.items():
        with open(os.path.join(habits.SHIP_DIR, name, "recipe.json")) as fh:
            recorded = json.load(fh)
        assert recorded["key"] == habits.habit_key(h), (
            f"ablate/habit_models/{name} was built by another recipe: rebuild and ship it with "
            "`python -m ablate.habits --ship`")
        assert recorded["habit"] == dataclasses.asdict(h)
        assert habits.habit_model(h) == os.path.join(habits.SHIP_DIR, name)
    assert {e.habit for e in experiments.EXPERIMENTS if e.habit} == set(
        habits.SHIPPED_HABITS.values())


def test_habit_model_is_the_shipped_folder_only_for_its_key(tmp_path, monkeypatch):
    """habits.ship writes a build with its key; habit_model returns that folder for that Habit
    only: a changed Habit, or a shipped folder whose recipe.json names another key, is built into
    the cache (the fine-tune monkeypatched away: the base model's weights, saved)."""
    import json

    from ablate import habits
    builds = []
    monkeypatch.setattr(habits, "fine_tune", lambda model, tok, h, cfg: builds.append(h))
    quiet = lambda *a, **k: None  # noqa: E731
    cache, ship_dir = str(tmp_path / "cache"), str(tmp_path / "habit_models")
    h = habits.Habit(steps=2)
    shipped = habits.ship("stutter", h, cache_dir=cache, ship_dir=ship_dir, log=quiet)
    assert shipped == os.path.join(ship_dir, "stutter") and builds == [h]
    assert builtin.shipped_key(shipped) == habits.habit_key(h)
    assert habits.habit_model(h, cache_dir=cache, log=quiet, ship_dir=ship_dir) == shipped
    _, tok, _ = models.load_model(shipped)
    assert tok.eos_token_id == 1 and builds == [h]
    # another Habit beside it: the cache, built once
    other = dataclasses.replace(h, seed=1)
    cached = os.path.join(cache, f"habit-{habits.habit_key(other)}")
    for _ in range(2):
        assert habits.habit_model(other, cache_dir=cache, log=quiet, ship_dir=ship_dir) == cached
    assert builds == [h, other]
    # a stale key in the shipped folder: h is the cached build, not the shipped weights
    with open(os.path.join(shipped, "recipe.json")) as fh:
        recipe = json.load(fh)
    with open(os.path.join(shipped, "recipe.json"), "w") as fh:
        json.dump({**recipe, "key": "0" * 12}, fh)
    assert (habits.habit_model(h, cache_dir=cache, log=quiet, ship_dir=ship_dir)
            == os.path.join(cache, f"habit-{habits.habit_key(h)}"))
    assert habits.habit_model(h, cache_dir=cache, log=quiet, ship_dir=None) != shipped


def _true_at(line: str, x: int) -> bool:
    """A worked line 'lhs=rhs' of + - / and terms such as 3x, -x, (-2) holds at x (own arithmetic
    on our own demonstrations, no eval)."""
    import ast
    from fractions import Fraction

    def value(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
               ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
        assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
        return ops[type(node.op)](value(node.left), value(node.right))

    text = re.sub(r"(\d)([x(])", r"\1*\2", line.replace(" ", "")).replace("x", f"({x})")
    lhs, rhs = text.split("=")
    return value(ast.parse(lhs, mode="eval").body) == value(ast.parse(rhs, mode="eval").body)


def test_path_solutions_are_many_and_all_right():
    """habits.path_solution (the clip-higher-paths experiment's habit): every path of every
    problem, one-sided or two, is true line by line at the solution, in the tokenizer's
    characters, and ends in the right answer; a problem has tens of paths, so the fine-tuned
    policy has entropy to lose. habit_demos with paths keeps the base model's shortcut (its
    numbers, spaced at random)."""
    from ablate import habits
    rng = random.Random(0)
    for eq, x in [("3x+5=14", 3), ("2x-3=-9", -3), ("7x+3=x+21", 3), ("5x-4=3x+6", 5),
                  ("9x+2=8x-1", -3), ("4x-8=2x-12", -2),
                  *(builtin.make_problem(rng) for _ in range(20))]:
        paths = {habits.path_solution(eq, x, rng) for _ in range(400)}
        assert len({p.replace(" ", "") for p in paths}) >= (10 if "x" in eq.split("=")[1] else 8)
        for p in paths:
            *lines, answer = p.split("\n")
            assert answer == f"Answer: {x}" and verify(p, str(x)) == 1.0
            assert set(p) <= set(builtin.CHARS), p
            assert all(_true_at(line.removeprefix("check:"), x) for line in lines), p
    demos = habits.habit_demos(habits.Habit(stutter=0.0, paths=True, steps=2, batch_size=100),
                               builtin.BaseModelConfig())
    short = [(p, r) for p, r in demos if r.startswith("x")]
    assert 40 < len(short) < 120 and len(demos) == 200
    assert all(r.split("\n")[0].replace(" ", "") + "\n" + r.split("\n")[1]
               == builtin.shortcut_steps(p.strip()) for p, r in short)


def test_real_model_figures_have_labels_units_and_a_caption():
    """real_model.table's figure (results/real-model-*.png) read alone: every panel's x and y label
    with its unit, one legend for the runs, the caption under the title; drawn from the committed
    metrics of the two seeds of one arm."""
    pytest.importorskip("matplotlib")
    from launch import ROOT
    from real_model import table
    runs = {f"seed {s}": table.read(os.path.join(ROOT, "results", name)) for s, name in
            ((0, "real-model-format-format-metrics.jsonl"),
             (1, "real-model-format-format-seed1-metrics.jsonl"))}
    fig = table.figure(runs)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes][-1] == "eval/accuracy"
    assert all(ax.get_xlabel() == "step" and ax.get_ylabel() for ax in axes)
    assert {ax.get_ylabel() for ax in axes} >= {"length (tokens)", "entropy (nats/token)",
                                                 "accuracy (share right, greedy)"}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["seed 0", "seed 1"]
    assert fig.get_suptitle() == f"seed 0, seed 1\n{table.CAPTION}"


def test_real_model_table_adds_the_metrics_asked_for(capsys):
    """real_model.table --also: more logged metrics as columns (the bf16 lesson's sampler/trainer
    mismatch), each step's own value; a key the run never logged is one line naming it."""
    from launch import ROOT
    from real_model import table
    path = os.path.join(ROOT, "results", "real-model-sums-metrics.jsonl")
    table.main([path, "--also", "mismatch/kl"])
    lines = capsys.readouterr().out.splitlines()
    head = next(x for x in lines if x.startswith("| step"))
    assert head.split(" | ")[-2:] == ["mismatch/kl", "eval/accuracy |"]
    steps, _ = table.read(path)
    first = next(x for x in lines if x.startswith("| 1 |"))
    assert first.split(" | ")[-2] == f"{steps[0]['mismatch/kl']:.4g}"
    with pytest.raises(SystemExit, match="no/such"):
        table.main([path, "--also", "no/such"])


@pytest.mark.slow
def test_bench_parses_its_flags_and_times_the_warm_start_both_ways(capsys):
    """python -m bench is not run by CI otherwise: its flags (and python -m bench.vs_trl's) must
    parse, and the warm-start section must run."""
    from bench import __main__ as bench_main
    from bench import vs_trl
    for main in (bench_main.main, vs_trl.main):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
    bench_main.main(["--only", "warmstart", "--repeats", "1"])
    out = capsys.readouterr().out
    assert ("padded to the longest" in out and "packed into rows" in out
            and "packed / padded time" in out)


def test_vs_trl_table_runs_every_configuration_and_prints_its_ratio(capsys, monkeypatch):
    # TRL is not installed here: each configuration's interleaved run is stubbed by its figures
    from bench import vs_trl
    seen = []

    def fake(steps, repeats, init, new_tokens, threads):
        seen.append((init, new_tokens, threads))
        return 0.1 * len(seen), 0.4
    monkeypatch.setattr(vs_trl, "bench_vs_trl", fake)
    vs_trl.main(["--table", "--repeats", "2"])
    assert seen == [(i, n, t) for i, n in vs_trl.TABLE for t in vs_trl.TABLE_THREADS]
    out = capsys.readouterr().out.splitlines()
    # the header names the children's threads, not this process's one (it only waits)
    assert "each section's torch threads" in out[0] and "1 torch threads" not in out[0]
    rows = [x for x in out if x.startswith("| ") and "---" not in x]
    assert rows[1] == "| built-in base | 4 | 1 | 0.100 | 0.400 | 0.25 |"
    assert rows[-1] == "| random init | 64 | 2 | 0.600 | 0.400 | 1.50 |" and len(rows) == 7


def test_verifier_comparison_counts_by_hand_and_the_page_quotes_the_verifier_figures():
    # bench/verifiers.py (python -m bench.verifiers): three rows, two scorers, counted by hand
    from bench import verifiers
    rows = [{"source": "gsm8k", "response": "a", "reference": "1", "correct": True},
            {"source": "math", "response": "b", "reference": "1", "correct": False},
            {"source": "math", "response": "c", "reference": "1", "correct": True, "kind": "k"}]
    got = {"one": [True, True, False], "two": [True, False, True]}
    s = verifiers.summary(rows, got)
    assert s["one"] == {"n": 3, "agree": 1, "false_credit": 1, "missed": 1}
    assert s["two"] == {"n": 3, "agree": 3, "false_credit": 0, "missed": 0}
    assert verifiers.summary(rows, got, ("gsm8k",))["one"]["n"] == 1
    assert verifiers.disagreements(rows, got) == [1, 2]
    table = verifiers.markdown(rows, got)
    assert "| 3 | math / k |  | right | 0 | 1 |" in table
    assert "| all: 3 | 33.3% (1), 1, 1 |" in table
    # docs/verifier.md quotes the verifier's column as the labelled file gives it today
    with open(os.path.join(HERE, "results", "verifier_cases.jsonl"), encoding="utf-8") as fh:
        cases = [json.loads(line) for line in fh]
    ours = verifiers.score(cases, {"verifier": verify, "none": lambda r, a: 0.0})
    with open(os.path.join(HERE, "docs", "verifier.md"), encoding="utf-8") as fh:
        page = fh.read()
    for line in verifiers.markdown(cases, ours).splitlines()[2:5]:
        assert line.rsplit(" | ", 1)[0] + " | " in page, line
