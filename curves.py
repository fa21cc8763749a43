"""A run's curves drawn (-> PNG): accuracy, entropy, length and truncation against the responses
sampled, for train.py --plot and `python -m ablate`'s figures (whose measures of a run are in
ablate/measures.py). The rows they are drawn from are metrics.py's (metrics.read_metrics).

Not an article section: the figures that show what the article's fixes do (accuracy, entropy, length
and truncation against the number of responses sampled).
"""
from __future__ import annotations

import os
import statistics

import checkpoint

CURVES = [("eval/accuracy", "held-out greedy accuracy"), ("entropy", "policy entropy (nats/token)"),
          ("len/mean", "mean response length (tokens)"),
          ("len/truncated_frac", "truncated fraction")]


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(samples drawn so far, value) points of `key`; eval lines take the
    sample count of their step."""
    samples_at = {0: 0, **{r["step"]: r["samples"] for r in rows if "samples" in r}}
    return [(samples_at[r["step"]], r[key]) for r in rows if key in r]


def mean_curve(runs: list[list[dict]], key: str) -> list[tuple[float, float]]:
    """Seeds averaged point by point (runs of one row log at the same steps, so points line up)."""
    curves = [curve(r, key) for r in runs]
    n = min(len(c) for c in curves)
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves))
            for i in range(n)]


def _pyplot():
    """matplotlib.pyplot drawing to files, or None (with a line saying so) where
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot_runs(runs: dict[str, list[list[dict]]], path: str) -> bool:
    """Four panels (CURVES) against samples drawn, one line per run name;
    False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for name, seeds in runs.items():
            pts = mean_curve(seeds, key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name,
                    marker="o" if key.startswith("eval") else None,
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


def plot_panels(panels: list[tuple[str, str, dict[str, list[list[tuple[float, float]]]]]],
                path: str, title: str) -> bool:
    """A row of panels (title, x label, {line label: one curve per seed}): each line is the mean
    over seeds (their points lined up by index) with a band from the lowest to the highest seed;
    False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (name, xlabel, lines) in zip(axes[0], panels):
        for label, seeds in lines.items():
            n = min(len(c) for c in seeds)
            xs = [statistics.mean(c[i][0] for c in seeds) for i in range(n)]
            ys = [[c[i][1] for c in seeds] for i in range(n)]
            (line,) = ax.plot(xs, [statistics.mean(y) for y in ys], label=label, marker="o",
                              markersize=2)
            if len(seeds) > 1:
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys],
                                color=line.get_color(), alpha=0.2)
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


