"""The article's DAPO fixes, each shown on the problem it names; and its ablation, rerun in miniature.

Article section: "DAPO：四项修正" (each fix a 问题 and its DAPO 修正) and "DAPO 递进增益" (Qwen2.5-32B,
AIME 2024: naive GRPO 30, + overlong filtering 36, + clip-higher 38, + soft overlong punishment 41,
+ token-level loss 42, + dynamic sampling 50).

`python ablate.py` runs EXPERIMENTS, one per fix in a regime where its problem should appear (a group
size, a token budget, off-policy updates, a base model variant of builtin.py): naive GRPO with the fix off
vs on, several seeds, each arm a run of train.py. It writes RESULTS/NAME.md (mean ± sd over seeds, each
difference with 2 standard errors) and RESULTS/NAME.png (needs matplotlib); results/README.md reads them.

    python ablate.py                              # every experiment, 3 seeds per arm
    python ablate.py --quick                      # one seed per arm: a look, no spread
    python ablate.py --only dynamic-sampling      # one experiment

`python ablate.py --rows` is the progressive ablation instead: ROWS, each adding one fix to the row above,
the last exactly `train.py --algo dapo`, all at beta 0 and +-1 rewards and one budget of sampled responses
(`--max-samples`: dynamic sampling's extra draws count). Writes OUT/ablation.md and OUT/ablation.png.

    python ablate.py --rows --seeds 0 --budget 2560  # a quick look
    python ablate.py --rows --train-flags "--mini-batches 4" --variant "+ GSPO=--loss gspo --eps-high 4e-4" \
        --variant "+ CISPO=--loss cispo --eps-high 4"   # DAPO + another objective, off-policy updates

A --variant NAME=FLAGS row is DAPO plus FLAGS (the clip-higher row passes --eps-high, so give your own).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import re
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import builtin
import dapo
import train
import verifier
from curves import Run, at_samples, by_step, curve, end, final, load_run, logged, over_run, plot_panels, plot_runs

ROWS = [  # (name, flags added by this row, the paper's AIME24 avg@32 for the row)
    ("naive GRPO", ["--algo", "grpo", "--beta", "0", "--wrong-reward", "-1"], 30),
    ("+ overlong filtering", ["--overlong-filter"], 36),
    ("+ clip-higher", ["--eps-high", str(dapo.EPS_HIGH)], 38),
    ("+ soft overlong punishment", ["--overlong-penalty"], 41),
    ("+ token-level loss", ["--reduction", "token"], 42),
    ("+ dynamic sampling (= DAPO)", ["--dynamic-sampling"], 50),
]


def row_flags(i: int, rows: list[tuple] = ROWS) -> list[str]:
    """The flags of row i of rows: a row of ROWS has everything of the rows above it plus its own; a
    --variant row after them has all of ROWS (= DAPO) plus its own."""
    return [f for _, flags, _ in ROWS[: i + 1] for f in flags] + (rows[i][1] if i >= len(ROWS) else [])


def variant_row(spec: str) -> tuple[str, list[str], None]:
    """--variant 'NAME=FLAGS' -> (NAME, FLAGS split as a shell would, no paper figure)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"error: --variant needs NAME=FLAGS, got {spec!r}")
    return name.strip(), shlex.split(flags), None


def samples_to_reach(rows: list[dict], target: float) -> float | None:
    hits = [s for s, v in curve(rows, "eval/accuracy") if v >= target]
    return hits[0] if hits else None


def fmt(values: list[float], digits: int | None = None) -> str:
    """'mean ± sd' of the values given (None dropped; '-' if none), with `digits` decimals (default: 1
    from 10 up, else 3)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    digits = (1 if abs(mean) >= 10 else 3) if digits is None else digits
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def table(runs: dict[str, list[list[dict]]], budget: int, rows: list[tuple] = ROWS) -> str:
    """--rows: one line per row, from each seed's metrics.jsonl rows."""
    lines = ["| row | held-out acc. at end | acc. at 1/4 budget | samples to 90% | entropy (last 5 steps) | "
             "length (last 5) | truncated (last 5) | tokens clipped low / high | steps | paper AIME24 |", "|" + " --- |" * 10]
    for (name, _, paper), seeds in zip(rows, runs.values()):
        quarter = [max((v for s, v in curve(r, "eval/accuracy") if s <= budget / 4), default=None) for r in seeds]
        reach = [samples_to_reach(r, 0.9) for r in seeds]
        tail = lambda key, seeds=seeds: [statistics.mean(v for _, v in curve(r, key)[-5:]) for r in seeds]  # noqa: E731
        steps = [max(r["step"] for r in rs if "loss" in r) for rs in seeds]
        clip = lambda key, seeds=seeds: statistics.mean(statistics.mean(v for _, v in curve(r, key)) for r in seeds)  # noqa: E731
        reached = f"{statistics.mean([x for x in reach if x is not None]):.0f} ({sum(x is not None for x in reach)}/{len(reach)} seeds)" \
            if any(x is not None for x in reach) else f"never (0/{len(reach)})"
        lines.append(f"| {name} | {fmt([curve(r, 'eval/accuracy')[-1][1] for r in seeds], 3)} | {fmt(quarter, 3)} | {reached} | "
                     f"{fmt(tail('entropy'), 4)} | {fmt(tail('len/mean'), 1)} | {fmt(tail('len/truncated_frac'), 3)} | "
                     f"{clip('clip/low_frac'):.2%} / {clip('clip/high_frac'):.2%} | {statistics.mean(steps):.0f} | "
                     f"{'-' if paper is None else paper} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Runs, and the measures read from them: a measure is Run -> value, a curve Run -> [(x, value)]
# ---------------------------------------------------------------------------------------------

def run_arms(name: str, arms: list[tuple[str, list[str]]], seeds: list[int], out: str) -> dict[str, list[Run]]:
    """Every arm (label, train.py flags) x seed as a run in OUT/NAME/LABEL-seedN; a finished run is kept,
    so rerunning resumes. Seed after seed, so that a stop leaves as many seeds in each arm."""
    runs: dict[str, list[Run]] = {label: [] for label, _ in arms}
    for seed in seeds:
        for label, flags in arms:
            folder = os.path.join(out, name, f"{re.sub(r'[^a-z0-9.]+', '-', label.lower()).strip('-')}-seed{seed}")
            if not os.path.exists(os.path.join(folder, "final", "config.json")):
                print(f"{name}: {label}, seed {seed}", flush=True)
                random.seed(seed)  # random_reward's coin
                train.main([*flags, "--seed", str(seed), "--out", folder])
            runs[label].append(load_run(folder))
    return runs


def solution(prompt: str) -> int:
    """x of a built-in equation, 'ax+b=c' or 'ax+b=cx+d' (a prompt as builtin.make_problem writes it)."""
    lhs, rhs = prompt.strip().split("=")
    a, b = (int(v) for v in builtin._split_linear(lhs))
    c, d = (int(v) for v in builtin._split_linear(rhs)) if "x" in rhs else (0, int(rhs))
    return (d - b) // (a - c)


def right(c: dict) -> bool:
    """A logged completion answers its prompt right (the verifier's score, whatever the run's reward)."""
    return verifier.verify(c["response"], str(solution(c["prompt"]))) == 1.0


def on_the_way(c: dict) -> bool:
    """A truncated completion that is the start of a right worked solution (plain, or with its check line)."""
    eq, x = c["prompt"].strip(), solution(c["prompt"])
    return c["truncated"] and any(builtin.solve_steps(eq, x, v).startswith(c["response"]) for v in (False, True))


def repeats(c: dict) -> bool:
    """A response that writes some line twice."""
    lines = [x for x in c["response"].split("\n") if x.strip()]
    return len(set(lines)) < len(lines)


def distinct_answers(cs: list[dict]) -> float:
    """The mean number of distinct final answers in a step's groups (its completions grouped by prompt)."""
    return statistics.mean(len({verifier.extract_answer(c["response"]) for c in cs if c["prompt"] == p}) for p in {c["prompt"] for c in cs})


def share(pred: Callable[[dict], bool], among: Callable[[dict], bool] = lambda c: True):
    """completions -> the share of those `among` that `pred` holds for (None if there are none)."""
    return lambda cs: sum(pool) / len(pool) if (pool := [pred(c) for c in cs if among(c)]) else None


def mean_length(among: Callable[[dict], bool]):
    """completions -> the mean length in tokens of those `among` (None if there are none)."""
    return lambda cs: statistics.mean(pool) if (pool := [c["length"] for c in cs if among(c)]) else None


def informative_groups(run: Run) -> list[tuple[int, float]]:
    """Groups with unequal rewards (a gradient) in what each step trains on: all the groups dynamic
    sampling kept, else the step's groups less its zero-std ones."""
    return [(r["step"], r.get("sampling/groups_kept", run.config["prompts_per_step"] * (1 - r["reward/frac_zero_std"])))
            for r in run.metrics if "loss" in r]


def equal_budget(run: Run) -> float:
    """The responses a run without dynamic sampling draws in its steps: steps x prompts x G."""
    return run.config["steps"] * run.config["prompts_per_step"] * run.config["group_size"]


def random_reward(response: str, answer: str) -> float:
    """The random-reward control (--reward ablate:random_reward): 1 or 0 by a fair coin, whatever the
    response. Python's global RNG, which nothing else in a run draws from; run_arms seeds it per run."""
    return float(random.random() < 0.5)


# ---------------------------------------------------------------------------------------------
# One experiment per fix, in the regime where its problem appears: the fix off vs on, several seeds
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Experiment:
    name: str                                      # results/NAME.md and results/NAME.png
    claim: str                                     # the article's problem and its fix, in a sentence
    flags: tuple[str, ...]                         # train.py flags of every arm: the regime
    arms: tuple[tuple[str, tuple[str, ...]], ...]  # (label, flags); the first is the baseline (the fix off)
    measures: tuple[tuple[str, Callable[[Run], float | None]], ...]  # the table: one value per run
    panels: tuple[tuple[str, str, Callable[[Run], list[tuple[float, float]]]], ...]  # the figure: (title, x, curve)
    variant: builtin.Variant | None = None         # the base model: this variant of builtin.py's (None: the shipped one)

    def model_flags(self) -> tuple[str, ...]:
        """--model and the built-in task's defaults a model folder does not get (train.BUILTIN_DEFAULTS, 40 tokens)."""
        return () if self.variant is None else ("--model", builtin.variant_model(self.variant), "--lr",
                                                str(train.BUILTIN_DEFAULTS["lr"]), "--max-new-tokens", "40")


def difference(base: list[float], other: list[float]) -> tuple[float, float | None]:
    """mean(other) - mean(base) and its standard error (Welch: sqrt(s1^2/n1 + s2^2/n2); None with one seed)."""
    se = math.sqrt(statistics.variance(base) / len(base) + statistics.variance(other) / len(other)) \
        if min(len(base), len(other)) > 1 else None
    return statistics.mean(other) - statistics.mean(base), se


def experiment_table(exp: Experiment, runs: dict[str, list[Run]]) -> str:
    """Each measure: mean ± sd over seeds per arm, and each arm's difference from the baseline with 2 SE."""
    labels = [label for label, _ in exp.arms]
    lines = ["| measure | " + " | ".join(labels) + " | " + " | ".join(f"{x} − {labels[0]} (± 2 SE)" for x in labels[1:]) + " |",
             "|" + " --- |" * (2 * len(labels))]
    for name, fn in exp.measures:
        values = {x: [v for v in map(fn, runs[x]) if v is not None] for x in labels}
        cells = [fmt(v) for v in values.values()]
        for x in labels[1:]:
            if not values[x] or not values[labels[0]]:
                cells.append("-")
                continue
            d, se = difference(values[labels[0]], values[x])
            cells.append(f"{d:+.3g} (one seed: no spread)" if se is None else
                         f"{d:+.3g} ± {2 * se:.2g}: {'**beyond noise**' if abs(d) > 2 * se else 'within noise'}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seeds = {len(v) for v in runs.values()}
    return "\n".join(lines) + f"\n\nmean ± sd over {'/'.join(map(str, sorted(seeds)))} seeds per arm."


NAIVE = ("--algo", "grpo", "--beta", "0", "--wrong-reward", "-1")  # naive GRPO with DAPO's +-1 rewards (ROWS[0])
SMALL = ("--prompts-per-step", "16", "--steps", "16", "--eval-every", "16", "--eval-size", "128",  # held-out: before, after
         "--log-completions", "100000")                                                           # every response trained on
WRONG = lambda c: not right(c)  # noqa: E731
SAMPLED = (("accuracy of the sampled responses", "step", logged("reward/correct")),)
HELD_OUT = (("held-out greedy accuracy at the end", final("eval/accuracy")),)
ENTROPY = (("entropy, last 5 steps", end(logged("entropy"))),
           ("distinct answers per group, last 5 steps", end(by_step(distinct_answers))),
           ("tokens clipped at the upper bound", over_run(logged("clip/high_frac"))))
ENTROPY_PANELS = (("entropy (nats/token)", "step", logged("entropy")),
                  ("distinct answers per group", "step", by_step(distinct_answers)),
                  ("tokens clipped high", "step", logged("clip/high_frac")))
CLIP_ARMS = (("eps_high 0.2", ()), ("eps_high 0.28", ("--eps-high", str(dapo.EPS_HIGH))))
CLIP_REGIME = ("--mini-batches", "4", "--temperature", "1.5")  # off-policy updates; a sampling temperature with spread
G4 = ("--group-size", "4")

EXPERIMENTS = (
    Experiment(
        "dynamic-sampling",
        "问题: a group whose answers are all right (or all wrong) has zero advantages and gives no gradient, and "
        "such groups grow as accuracy rises. DAPO 修正: resample until every group in the batch is mixed (Eq. 11).",
        NAIVE + SMALL + G4, (("off", ()), ("on: dynamic sampling", ("--dynamic-sampling",))),
        (("sampled groups all right or all wrong, last 5 steps", end(logged("reward/frac_zero_std"))),
         ("groups with a gradient per update (of 16)", over_run(informative_groups)),
         ("accuracy of the sampled responses, last 5 updates", end(logged("reward/correct"))),
         ("accuracy of the sampled responses at 16 x 16 x 4 = 1,024 responses",
          at_samples(lambda r: curve(r.metrics, "reward/correct"), equal_budget)),
         ("responses sampled in 16 updates", final("samples")),
         ("held-out greedy accuracy after 16 updates", final("eval/accuracy"))),
        (("sampled groups all right / all wrong", "step", logged("reward/frac_zero_std")),
         ("groups with a gradient per update", "step", informative_groups),
         ("sampled accuracy per update", "optimizer update", logged("reward/correct")),
         ("sampled accuracy per sampled response", "responses sampled", lambda r: curve(r.metrics, "reward/correct")))),
    Experiment(
        "overlong-shaping",
        "问题: a truncated response gets the reward of a wrong one, though its reasoning may be sound, which "
        "confuses training. DAPO 修正: mask truncated responses out of the loss (overlong filtering), and punish "
        "length softly over the last L_cache tokens (Eq. 13).",
        NAIVE + SMALL + G4 + ("--max-new-tokens", "40"),
        (("hard: truncated = wrong", ()), ("filter", ("--overlong-filter",)),
         ("filter + soft penalty", ("--overlong-filter", "--overlong-penalty"))),
        (("truncated responses, last 5 steps", end(logged("len/truncated_frac"))),
         ("truncated on the way to a right answer, share of the truncated",
          over_run(by_step(share(on_the_way, lambda c: c["truncated"])))),
         ("accuracy of the sampled responses, last 5 steps", end(logged("reward/correct"))), *HELD_OUT),
        (("truncated responses", "step", logged("len/truncated_frac")),
         ("truncated on the way to right (of all)", "step", by_step(share(on_the_way))), *SAMPLED)),
    Experiment(
        "token-level-loss",
        "问题: the per-response mean gives each token of a long response less weight, so long wrong responses "
        "(rambling, repetition) are pushed down less. DAPO 修正: average over all tokens of the batch (Eq. 12).",
        NAIVE + SMALL + G4 + ("--max-new-tokens", "96"), (("sequence", ()), ("token", ("--reduction", "token"))),
        (("length of wrong responses, last 5 steps", end(by_step(mean_length(WRONG)))),
         ("wrong responses that repeat a line, last 5 steps", end(by_step(share(repeats, WRONG)))),
         ("length of right responses, last 5 steps", end(by_step(mean_length(right)))),
         ("length of all responses, last 5 steps", end(logged("len/mean"))), *HELD_OUT),
        (("length of wrong responses", "step", by_step(mean_length(WRONG))),
         ("wrong responses that repeat a line", "step", by_step(share(repeats, WRONG))),
         ("length of right responses", "step", by_step(mean_length(right))), *SAMPLED),
        builtin.Variant()),  # the shipped model's wrong answers are all ~15-token shortcuts: nothing to dilute
    Experiment(
        "clip-higher",
        "问题: with symmetric clipping a low-probability token's ratio is capped at 1 + eps early, so exploration "
        "dies: entropy collapses. DAPO 修正: decouple the bounds and raise the upper one (eps_high 0.28, Eq. 10).",
        NAIVE + SMALL + CLIP_REGIME, CLIP_ARMS, ENTROPY + HELD_OUT, ENTROPY_PANELS + SAMPLED),
    Experiment(
        "clip-higher-random-reward",
        "The control: a fair coin for reward leaves nothing to learn, and symmetric clipping alone is published to "
        "lower entropy (arXiv 2509.26114); clip-higher should lower it less.",
        NAIVE + SMALL + CLIP_REGIME + ("--reward", "ablate:random_reward"), CLIP_ARMS, ENTROPY, ENTROPY_PANELS),
)


def rows_main(a) -> None:
    """--rows: the progressive ablation (ROWS, each adding one fix) at an equal sample budget."""
    rows = ROWS + [variant_row(v) for v in a.variant]
    budget = ["--max-samples", str(a.budget), "--steps", "1000", "--eval-every", str(a.eval_every)]
    arms = [(name, [*row_flags(i, rows), *shlex.split(a.train_flags), *budget]) for i, (name, _, _) in enumerate(rows)]
    runs = {name: [r.metrics for r in rs] for name, rs in run_arms("rows", arms, a.seeds, a.out).items()}
    md = table(runs, a.budget, rows)
    with open(os.path.join(a.out, "ablation.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    if plot_runs(runs, os.path.join(a.out, "ablation.png")):
        print(f"plots: {os.path.join(a.out, 'ablation.png')}")


def experiments_main(a) -> None:
    """The experiments (EXPERIMENTS, or --only some): runs, then results/NAME.md and results/NAME.png each."""
    seeds = [0] if a.quick else a.seeds
    for exp in (e for e in EXPERIMENTS if not a.only or e.name in a.only):
        runs = run_arms(exp.name, [(label, [*exp.model_flags(), *exp.flags, *f]) for label, f in exp.arms], seeds, a.out)
        model = "" if exp.variant is None else f" on the base model variant builtin.{exp.variant} (`--model` its folder)"
        md = (f"# {exp.name}\n\n{exp.claim}\n\n`python ablate.py --only {exp.name}`: train.py "
              f"{' '.join(exp.flags)}{model}, then per arm: " + "; ".join(f"{x}: `{' '.join(f) or '(nothing)'}`" for x, f in exp.arms)
              + f"; seeds {' '.join(map(str, seeds))}.\n\n{experiment_table(exp, runs)}\n")
        os.makedirs(a.results, exist_ok=True)  # --results may name a new folder: the runs' tables must not be lost
        with open(os.path.join(a.results, f"{exp.name}.md"), "w") as fh:
            fh.write(md)
        print(md)
        panels = [(title, x, {label: [points(r) for r in rs] for label, rs in runs.items()}) for title, x, points in exp.panels]
        if plot_panels(panels, os.path.join(a.results, f"{exp.name}.png"), exp.name):
            print(f"figure: {os.path.join(a.results, exp.name + '.png')}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=[e.name for e in EXPERIMENTS], help="run these experiments (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per arm (or per row)")
    p.add_argument("--quick", action="store_true", help="one seed (seed 0): a look at each experiment, no spread")
    p.add_argument("--results", default="results", help="where the experiments' tables and figures go")
    p.add_argument("--out", default=None, help="the runs' folder (default: runs/experiments, with --rows runs/ablation)")
    p.add_argument("--rows", action="store_true", help="the progressive ablation instead: ROWS, one fix added per row")
    p.add_argument("--budget", type=int, default=10240, help="--rows: responses sampled per run (40 steps of 32 x 8 without "
                   "dynamic sampling)")
    p.add_argument("--eval-every", type=int, default=5, help="--rows: held-out evaluation every this many steps")
    p.add_argument("--train-flags", default="", help="--rows: train.py flags added to every run, e.g. '--mu 4' (with --mu 1, "
                   "the default, the ratio is exactly 1 and clip-higher cannot act)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="--rows: add a row: DAPO (the last row) plus FLAGS, e.g. '+ CISPO=--loss cispo' (repeatable)")
    a = p.parse_args(argv)
    rows_only = [f"--{k.replace('_', '-')}" for k in ("budget", "eval_every", "train_flags", "variant")
                 if getattr(a, k) != p.get_default(k)]
    if rows_only and not a.rows:
        p.error(f"{', '.join(rows_only)}: for --rows only")
    a.out = a.out or ("runs/ablation" if a.rows else "runs/experiments")
    rows_main(a) if a.rows else experiments_main(a)


if __name__ == "__main__":
    main()
