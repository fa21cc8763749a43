"""The article's DAPO ablation ("DAPO 递进增益"), rerun in miniature on the built-in task.

Article section: "DAPO 递进增益" (Qwen2.5-32B, AIME 2024: naive GRPO 30, + overlong filtering 36,
+ clip-higher 38, + soft overlong punishment 41, + token-level loss 42, + dynamic sampling 50).

Six rows, each adding one fix to the row above, the last being exactly `train.py --algo dapo`. Every run
gets the same budget of sampled responses (`--max-samples`): dynamic sampling's extra samples count
against it, so that row takes fewer optimizer steps. All rows use beta = 0 and +-1 rewards, as DAPO does, so
that only the four fixes differ. Writes OUT/ablation.md (the table) and OUT/ablation.png (the curves; needs matplotlib).

    python ablate.py                          # 6 rows x 3 seeds: 18 runs of a few minutes each on 2 CPU cores
    python ablate.py --seeds 0 --budget 2560  # a quick look
    python ablate.py --train-flags "--mu 4" --out runs/ablation-mu4  # each batch reused for 4 updates
    python ablate.py --train-flags "--mini-batches 4" --variant "+ GSPO=--loss gspo --eps-high 4e-4" \
        --variant "+ CISPO=--loss cispo --eps-high 4"   # DAPO + another objective, off-policy updates

A --variant NAME=FLAGS row is the last row (DAPO) plus FLAGS: any objective of variants.py, or any flag.
The clip-higher row passes --eps-high 0.28 on the command line, so a variant row gives its own.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics

import dapo
import train
from curves import curve, plot_runs, read_metrics

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


def fmt(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def table(runs: dict[str, list[list[dict]]], budget: int, rows: list[tuple] = ROWS) -> str:
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
        lines.append(f"| {name} | {fmt([curve(r, 'eval/accuracy')[-1][1] for r in seeds])} | {fmt(quarter)} | {reached} | "
                     f"{fmt(tail('entropy'), 4)} | {fmt(tail('len/mean'), 1)} | {fmt(tail('len/truncated_frac'))} | "
                     f"{clip('clip/low_frac'):.2%} / {clip('clip/high_frac'):.2%} | {statistics.mean(steps):.0f} | "
                     f"{'-' if paper is None else paper} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per row")
    p.add_argument("--budget", type=int, default=10240, help="responses sampled per run (40 steps of 32 x 8 without dynamic sampling)")
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every this many steps")
    p.add_argument("--out", default="runs/ablation", help="output folder")
    p.add_argument("--train-flags", default="", help="train.py flags added to every run, e.g. '--mu 4' (with --mu 1, "
                   "the default, the ratio is exactly 1 and clip-higher cannot act)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="add a row: DAPO (the last row) plus FLAGS, e.g. '+ CISPO=--loss cispo' (repeatable)")
    a = p.parse_args()
    rows = ROWS + [variant_row(v) for v in a.variant]
    runs: dict[str, list[list[dict]]] = {}
    for i, (name, _, _) in enumerate(rows):
        for seed in a.seeds:
            out = os.path.join(a.out, f"row{i}-seed{seed}")
            if not os.path.exists(os.path.join(out, "final", "config.json")):  # finished runs are kept: rerun resumes the table
                print(f"{name}, seed {seed}")
                train.main([*row_flags(i, rows), *shlex.split(a.train_flags), "--seed", str(seed), "--max-samples", str(a.budget),
                            "--steps", "1000", "--eval-every", str(a.eval_every), "--out", out])
            runs.setdefault(name, []).append(read_metrics(os.path.join(out, "metrics.jsonl")))
    md = table(runs, a.budget, rows)
    with open(os.path.join(a.out, "ablation.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    if plot_runs(runs, os.path.join(a.out, "ablation.png")):
        print(f"plots: {os.path.join(a.out, 'ablation.png')}")


if __name__ == "__main__":
    main()
