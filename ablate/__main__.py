"""The article's DAPO fixes, each shown on the problem it names; and its ablation, rerun in
miniature.

Article section: "DAPO：四项修正" (each fix a 问题 and its DAPO 修正) and "DAPO 递进增益"
(Qwen2.5-32B, AIME 2024: naive GRPO 30, + overlong filtering 36, + clip-higher 38, + soft overlong
punishment 41, + token-level loss 42, + dynamic sampling 50).

`python -m ablate` runs the experiments (ablate/experiments.py), one per fix in a regime where its
problem should appear (a group size, a token budget, off-policy updates, a habit model of
ablate/habits.py): naive GRPO with the fix off vs on, several seeds, each arm a run of train.py. It
writes RESULTS/NAME.md (mean ± sd over seeds, each difference with 2 standard errors) and
RESULTS/NAME.png (needs matplotlib); results/README.md reads them. Run from the repo root:

    python -m ablate                              # every experiment, 3 seeds per arm
    python -m ablate --quick                      # one seed per arm: a look, no spread
    python -m ablate --only dynamic-sampling      # one experiment
    python -m ablate --defaults                   # train.py --algo grpo vs --algo dapo, as they are

`python -m ablate --rows` is the progressive ablation instead (ablate/rows.py): ROWS, each adding
one fix to the row above, the last exactly `train.py --algo dapo`, all at beta 0 and +-1 rewards and
one budget of sampled responses (`--max-samples`: dynamic sampling's extra draws count). Writes
OUT/ablation.md and OUT/ablation.png.

    python -m ablate --rows --seeds 0 --budget 2560  # a quick look
    python -m ablate --rows --train-flags "--mini-batches 4" \\
        --add-row "+ GSPO=--loss gspo --eps-high 4e-4" \\
        --add-row "+ CISPO=--loss cispo --eps-high 4"   # DAPO + another objective, off-policy

An --add-row NAME=FLAGS row is DAPO plus FLAGS (the clip-higher row passes --eps-high, so give your
own).
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shlex

import train
from ablate import experiments, rows
from ablate.curves import plot_panels
from ablate.measures import Run, load_run


def run_arms(name: str, arms: list[tuple[str, list[str]]], seeds: list[int],
             out: str) -> dict[str, list[Run]]:
    """Every arm (label, train.py flags) x seed as a run in OUT/NAME/LABEL-seedN; a finished run is
    kept, so rerunning resumes. Seed after seed, so that a stop leaves as many seeds in each arm."""
    runs: dict[str, list[Run]] = {label: [] for label, _ in arms}
    for seed in seeds:
        for label, flags in arms:
            slug = re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-")
            folder = os.path.join(out, name, f"{slug}-seed{seed}")
            if not os.path.exists(os.path.join(folder, "final", "config.json")):
                print(f"{name}: {label}, seed {seed}", flush=True)
                random.seed(seed)  # experiments.random_reward's coin
                train.main([*flags, "--seed", str(seed), "--out", folder])
            runs[label].append(load_run(folder))
    return runs


def rows_main(a) -> None:
    """--rows: the progressive ablation (ROWS, each adding one fix) at an equal sample budget."""
    table_rows = rows.ROWS + [rows.extra_row(spec) for spec in a.add_row]
    budget = ["--max-samples", str(a.budget), "--steps", "1000", "--eval-every", str(a.eval_every)]
    arms = [(name, [*rows.row_flags(i, table_rows), *shlex.split(a.train_flags), *budget])
            for i, (name, _, _) in enumerate(table_rows)]
    runs = {name: [r.metrics for r in rs]
            for name, rs in run_arms("rows", arms, a.seeds or [0, 1, 2], a.out).items()}
    md = rows.table(runs, a.budget, table_rows)
    with open(os.path.join(a.out, "ablation.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    extra = f" --train-flags {shlex.quote(a.train_flags)}" if a.train_flags else ""
    title = (f"python -m ablate --rows{extra}: each row adds one fix to the row above, "
             f"{a.budget} responses per run")
    if plot_panels(rows.figure_panels(runs), os.path.join(a.out, "ablation.png"), title):
        print(f"plots: {os.path.join(a.out, 'ablation.png')}")


def experiments_main(a) -> None:
    """The experiments (EXPERIMENTS, or --only some; --defaults: DEFAULTS): runs, then
    results/NAME.md and results/NAME.png each."""
    chosen = ([experiments.DEFAULTS] if a.defaults else
              [e for e in experiments.EXPERIMENTS if not a.only or e.name in a.only])
    for exp in chosen:
        seeds = [0] if a.quick else a.seeds or list(range(exp.seeds))
        arms = [(label, [*exp.model_flags(), *exp.flags, *f]) for label, f in exp.arms]
        runs = run_arms(exp.name, arms, seeds, a.out)
        model = ("" if exp.habit is None else
                 f" on the habit model ablate.habits.{exp.habit} (`--model` its folder)")
        per_arm = "; ".join(f"{x}: `{' '.join(f) or '(nothing)'}`" for x, f in exp.arms)
        command = "--defaults" if a.defaults else f"--only {exp.name}"
        md = (f"# {exp.name}\n\n{exp.claim}\n\n`python -m ablate {command}`: "
              f"{' '.join(('train.py', *exp.flags))}{model}, then per arm: {per_arm}"
              f"; seeds {' '.join(map(str, seeds))}.\n\n"
              f"{experiments.experiment_table(exp, runs)}\n")
        os.makedirs(a.results, exist_ok=True)  # --results may name a new folder: keep the tables
        with open(os.path.join(a.results, f"{exp.name}.md"), "w") as fh:
            fh.write(md)
        print(md)
        panels = experiments.figure_panels(exp, runs)
        if plot_panels(panels, os.path.join(a.results, f"{exp.name}.png"), exp.name):
            print(f"figure: {os.path.join(a.results, exp.name + '.png')}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ablate", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=[e.name for e in experiments.EXPERIMENTS],
                   help="run these experiments (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="seeds per arm (or per row); default: the experiment's own (3, 12 for "
                        "clip-higher-paths), 0 1 2 for --rows")
    p.add_argument("--quick", action="store_true",
                   help="one seed (seed 0): a look at each experiment, no spread")
    p.add_argument("--results", default="results",
                   help="where the experiments' tables and figures go")
    p.add_argument("--out", default=None,
                   help="the runs' folder (default: runs/experiments, with --rows runs/ablation)")
    p.add_argument("--defaults", action="store_true",
                   help="the built-in default runs instead, train.py --algo grpo vs --algo dapo: "
                        "RESULTS/default-dapo-vs-grpo.md and .png")
    p.add_argument("--rows", action="store_true",
                   help="the progressive ablation instead: ROWS, one fix added per row")
    p.add_argument("--budget", type=int, default=10240,
                   help="--rows: responses sampled per run (40 steps of 32 x 8 without dynamic "
                        "sampling)")
    p.add_argument("--eval-every", type=int, default=5,
                   help="--rows: held-out evaluation every this many steps")
    p.add_argument("--train-flags", default="",
                   help="--rows: train.py flags added to every run, e.g. '--mu 4' (with --mu 1, "
                        "the default, the ratio is exactly 1 and clip-higher cannot act)")
    p.add_argument("--add-row", action="append", default=[], metavar="NAME=FLAGS",
                   help="--rows: add a row: DAPO (the last row) plus FLAGS, e.g. "
                        "'+ CISPO=--loss cispo' (repeatable)")
    a = p.parse_args(argv)
    rows_only = [f"--{k.replace('_', '-')}"
                 for k in ("budget", "eval_every", "train_flags", "add_row")
                 if getattr(a, k) != p.get_default(k)]
    if rows_only and not a.rows:
        p.error(f"{', '.join(rows_only)}: for --rows only")
    if a.rows and (a.defaults or a.only) or a.defaults and a.only:
        p.error("--rows, --defaults and --only are one each")
    a.out = a.out or ("runs/ablation" if a.rows else "runs/defaults" if a.defaults
                      else "runs/experiments")
    rows_main(a) if a.rows else experiments_main(a)


if __name__ == "__main__":
    main()
