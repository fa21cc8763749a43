"""A run's curves drawn (-> PNG): accuracy, entropy, length and truncation against the responses
sampled, for train.py --plot and ablate.py's figures; with the measures ablate.py reads from a run.
The rows they are drawn from are metrics.py's (metrics.read_metrics).

Not an article section: the figures that show what the article's fixes do (accuracy, entropy, length and
truncation against the number of responses sampled).
"""
from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import checkpoint
from metrics import read_metrics

CURVES = [("eval/accuracy", "held-out greedy accuracy"), ("entropy", "policy entropy (nats/token)"),
          ("len/mean", "mean response length (tokens)"), ("len/truncated_frac", "truncated fraction")]


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(samples drawn so far, value) points of `key`; eval lines take the sample count of their step."""
    samples_at = {0: 0, **{r["step"]: r["samples"] for r in rows if "samples" in r}}
    return [(samples_at[r["step"]], r[key]) for r in rows if key in r]


# A run's measures for ablate.py: a curve is Run -> [(x, value)], a measure Run -> one value (None: none)

@dataclass
class Run:
    """One finished train.py run: its config.json, metrics.jsonl and completions.jsonl (every response
    trained on: the experiments pass --log-completions with room for all of them)."""
    config: dict
    metrics: list[dict]
    completions: list[dict]


def load_run(out: str) -> Run:
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    return Run(config, read_metrics(os.path.join(out, "metrics.jsonl")), read_metrics(os.path.join(out, "completions.jsonl")))


def logged(key: str) -> Callable[[Run], list[tuple[int, float]]]:
    """A curve of a metric of metrics.jsonl over training steps (eval/* at the step it was taken)."""
    return lambda run: [(r["step"], r[key]) for r in run.metrics if key in r]


def by_step(fn: Callable[[list[dict]], float | None]) -> Callable[[Run], list[tuple[int, float]]]:
    """A curve over training: (step, fn(the completions trained on at that step)) where fn gives a value."""
    def points(run: Run) -> list[tuple[int, float]]:
        steps = sorted({c["step"] for c in run.completions})
        return [(s, v) for s in steps if (v := fn([c for c in run.completions if c["step"] == s])) is not None]
    return points


def at_samples(points: Callable[[Run], list[tuple[float, float]]], samples: Callable[[Run], float]) -> Callable[[Run], float | None]:
    """Run -> the curve's last value taken with at most samples(run) responses drawn (x: responses sampled)."""
    return lambda run: pts[-1] if (pts := [v for s, v in points(run) if s <= samples(run)]) else None


def end(points: Callable[[Run], list[tuple[float, float]]], k: int = 5) -> Callable[[Run], float | None]:
    """Run -> the mean of a curve's last k points (the end of training)."""
    return lambda run: statistics.mean(v for _, v in points(run)[-k:]) if points(run) else None


def over_run(points: Callable[[Run], list[tuple[float, float]]]) -> Callable[[Run], float | None]:
    """Run -> the mean of a curve over the whole run."""
    return lambda run: statistics.mean(v for _, v in points(run)) if points(run) else None


def final(key: str) -> Callable[[Run], float | None]:
    """Run -> the last logged value of a metric (eval/accuracy: the evaluation after the last step)."""
    return lambda run: logged(key)(run)[-1][1] if logged(key)(run) else None


def mean_curve(runs: list[list[dict]], key: str) -> list[tuple[float, float]]:
    """Seeds averaged point by point (runs of one row log at the same steps, so points line up)."""
    curves = [curve(r, key) for r in runs]
    n = min(len(c) for c in curves)
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves)) for i in range(n)]


def _pyplot():
    """matplotlib.pyplot drawing to files, or None (with a line saying so) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot_runs(runs: dict[str, list[list[dict]]], path: str) -> bool:
    """Four panels (CURVES) against samples drawn, one line per run name; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for name, seeds in runs.items():
            pts = mean_curve(seeds, key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="o" if key.startswith("eval") else None,
                    markersize=3)
        ax.set_title(title)
        ax.set_xlabel("responses sampled")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
    return True


def plot_panels(panels: list[tuple[str, str, dict[str, list[list[tuple[float, float]]]]]], path: str, title: str) -> bool:
    """A row of panels (title, x label, {line label: one curve per seed}): each line is the mean over
    seeds (their points lined up by index) with a band from the lowest to the highest seed; False
    without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (name, xlabel, lines) in zip(axes[0], panels):
        for label, seeds in lines.items():
            n = min(len(c) for c in seeds)
            xs = [statistics.mean(c[i][0] for c in seeds) for i in range(n)]
            ys = [[c[i][1] for c in seeds] for i in range(n)]
            (line,) = ax.plot(xs, [statistics.mean(y) for y in ys], label=label, marker="o", markersize=2)
            if len(seeds) > 1:
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
    return True


