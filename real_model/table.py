"""Per-step tables (and a figure) of train.py runs' metrics.jsonl, for
docs/real-model-on-a-laptop.md.

Development only, like real_model/build.py.

    python -m real_model.table runs/real-sums          # one run: a markdown table per step
    python -m real_model.table verifier=runs/fmt-verifier format=runs/fmt-format --out results/x.png
    python -m real_model.table a=runs/a --also mismatch/kl   # and more of the logged metrics
    python -m real_model.table per-problem.jsonl       # evaluate.py --out's records, tallied

Each row is a training step: the sampled responses' mean of every reward component train.py logs
(`reward/<function>`: a component passed with weight 0 is logged and not trained on), the truncated
share, the mean length and the entropy (nats/token at the sampling temperature), and the held-out
greedy accuracy where the step was evaluated (step 0: before training). `--out` draws the same
columns, one panel each, the runs side by side (needs matplotlib).

A file of evaluate.py's per-problem records (`--out`) is tallied instead: per model, the share of
its responses that the verifier scores right, that state `Answer: <number>` (`sums.answer_marker`),
that state any answer the verifier reads (`sums.states_answer`), whose last number is the answer
(`sums.last_number`), and that were truncated.
"""
from __future__ import annotations

import argparse
import json
import os

import verifier
from real_model import sums

SKIP = ("reward/mean", "reward/frac_zero_std")


def read(folder: str) -> tuple[list[dict], dict[int, float]]:
    """(training rows in step order, {step: eval/accuracy}) of a run folder (or its
    metrics.jsonl)."""
    path = folder if folder.endswith(".jsonl") else os.path.join(folder, "metrics.jsonl")
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r for r in rows if "loss" in r], {r["step"]: r["eval/accuracy"] for r in rows
                                              if "eval/accuracy" in r}


def columns(steps: list[dict], also: tuple[str, ...] = ()) -> list[str]:
    keys = [k for k in steps[0] if k.startswith("reward/") and k not in SKIP]
    same = [k for k in keys if k != "reward/correct"
            and all(r[k] == r["reward/correct"] for r in steps)]
    # the one component trained on: once
    keys = [k for k in keys if k != "reward/correct" or not same]
    missing = [k for k in also if k not in steps[0]]
    if missing:
        raise SystemExit(f"--also: {missing} not in the run's metrics (it has "
                         f"{sorted(steps[0])})")
    return [*keys, "len/truncated_frac", "len/mean", "entropy", *also]


def table(steps: list[dict], evals: dict[int, float], also: tuple[str, ...] = ()) -> str:
    cols = columns(steps, also)
    head = ["step", *cols, "eval/accuracy"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    if 0 in evals:
        lines.append("| 0 |" + " |" * len(cols) + f" {evals[0]:.3f} |")
    for r in steps:
        cells = [f"{r[c]:.1f}" if c == "len/mean" else f"{r[c]:.4g}" if c in also
                 else f"{r[c]:.3f}" for c in cols]
        acc = f"{evals[r['step']]:.3f}" if r["step"] in evals else ""
        lines.append(f"| {r['step']} | " + " | ".join(cells) + f" | {acc} |")
    return "\n".join(lines)


def ylabel(column: str) -> str:
    """A panel's y label with its unit: a reward component (0 or 1 a response) is a share."""
    return {"len/truncated_frac": "share of responses truncated", "len/mean": "length (tokens)",
            "entropy": "entropy (nats/token)",
            "eval/accuracy": "accuracy (share right, greedy)"}.get(
                column, "share of sampled responses")


CAPTION = ("one line per run (one seed each); per step the sampled responses' mean (T = 1), "
           "held-out: greedy, at the evaluated steps")


def figure(runs: dict[str, tuple[list[dict], dict[int, float]]]):
    """The matplotlib figure of `plot`: a panel per column, each with its x and y labels, one
    legend, the caption under the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = list(dict.fromkeys(c for steps, _ in runs.values() for c in columns(steps)))
    cols.append("eval/accuracy")
    ncols = min(4, len(cols))
    nrows = -(-len(cols) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 2.9 * nrows + 0.6),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[len(cols):]:
        ax.remove()
    for ax, c in zip(axes.flat, cols):
        for label, (steps, evals) in runs.items():
            if c == "eval/accuracy":
                xs = sorted(evals)
                ax.plot(xs, [evals[x] for x in xs], marker="o", label=label)
            elif c in steps[0]:
                ax.plot([r["step"] for r in steps], [r[c] for r in steps], label=label)
        ax.set_title(c, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel(c), fontsize=8)
        ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(f"{', '.join(runs)}\n{CAPTION}", fontsize=9)
    return fig


def plot(runs: dict[str, tuple[list[dict], dict[int, float]]], out: str) -> None:
    figure(runs).savefig(out, dpi=110)


def tally(path: str) -> str:
    """A markdown table of evaluate.py's per-problem records: per model, what its responses
    state."""
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    scorers = {"verifier": verifier.verify, "answer_marker": sums.answer_marker,
               "states_answer": sums.states_answer, "last_number": sums.last_number}
    lines = ["| model | responses | " + " | ".join(scorers) + " | truncated |",
             "|" + " --- |" * (len(scorers) + 3)]
    for model in dict.fromkeys(r["model"] for r in records):
        got = [(s, r["reference"]) for r in records if r["model"] == model for s in r["samples"]]
        cells = [sum(fn(s["response"], ref) for s, ref in got) / len(got) for fn
                 in scorers.values()]
        trunc = sum(s["truncated"] for s, _ in got) / len(got)
        lines.append(f"| {model} | {len(got)} | " + " | ".join(f"{c:.3f}" for c
                                                               in cells) + f" | {trunc:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders, or label=folder")
    ap.add_argument("--out", help="also draw the columns to this PNG")
    ap.add_argument("--also", nargs="+", default=[], metavar="KEY",
                    help="more metrics.jsonl keys as columns of the tables (e.g. "
                         "mismatch/logp_abs_mean mismatch/kl)")
    args = ap.parse_args(argv)
    if len(args.runs) == 1 and os.path.isfile(args.runs[0]):
        with open(args.runs[0], encoding="utf-8") as fh:
            if "samples" in json.loads(fh.readline()):
                print(tally(args.runs[0]))
                return
    runs = {}
    for spec in args.runs:
        label, _, folder = spec.rpartition("=")
        runs[label or folder] = read(folder)
    for label, (steps, evals) in runs.items():
        print(f"{label}\n\n{table(steps, evals, tuple(args.also))}\n")
    if args.out:
        plot(runs, args.out)
        print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
