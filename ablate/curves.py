"""A run's curves drawn (-> PNG): accuracy, entropy, length and truncation against the responses
sampled, for `python -m ablate`'s figures (whose measures of a run are in
ablate/measures.py). The rows they are drawn from are harness/metrics.py's (metrics.read_metrics).

Every figure reads alone: each panel has its x and y labels (with units), one legend is shared by
all panels, and the caption under the title says how many seeds each line averages and what its band
is (the lowest to the highest seed at each point).

Not an article section: the figures that show what the article's fixes do (accuracy, entropy, length
and truncation against the number of responses sampled).
"""
from __future__ import annotations

import math
import os
import statistics

from harness import checkpoint

# (metrics.jsonl key, panel title, y label with its unit)
CURVES = [("eval/accuracy", "held-out greedy accuracy", "accuracy (share right, greedy)"),
          ("entropy", "policy entropy", "entropy (nats/token)"),
          ("len/mean", "mean response length", "length (tokens)"),
          ("len/truncated_frac", "truncated responses", "share of responses truncated")]
BAND = "band (dashed with 3+ lines): lowest to highest seed at each point"
FEW = 3  # a line of at most this many points is drawn as its points, with bars for the band


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(samples drawn so far, value) points of `key`; eval lines take the
    sample count of their step."""
    samples_at = {0: 0, **{r["step"]: r["samples"] for r in rows if "samples" in r}}
    return [(samples_at[r["step"]], r[key]) for r in rows if key in r]


def caption(lines: list[dict[str, list[list[tuple[float, float]]]]]) -> str:
    """What a figure's lines are: the number of seeds each averages, and what the band is."""
    seeds = sorted({len(c) for ls in lines for c in ls.values()})
    if seeds == [1]:
        return "one seed per line: no band"
    n = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
    return f"line: mean over {n} seeds; {BAND}"


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


def _draw(ax, label: str, seeds: list[list[tuple[float, float]]], color, shift: float,
          fill: bool = True) -> None:
    """One line: the mean over seeds (points lined up by index) and its band from the lowest to the
    highest seed; a line of at most FEW points (an evaluation before and after) as its points with
    bars and no line between them (two evaluations are not a curve), shifted by `shift` along x
    so that lines at the same x stay apart. fill False: the band as two thin dashed lines of the
    line's colour (overlapping filled bands of three or more lines blend into one colour)."""
    n = min(len(c) for c in seeds)
    xs = [statistics.mean(c[i][0] for c in seeds) for i in range(n)]
    ys = [[c[i][1] for c in seeds] for i in range(n)]                       # [points][seeds]
    mean = [statistics.mean(y) for y in ys]
    if n <= FEW:
        ax.errorbar([x + shift for x in xs], mean, color=color, label=label, marker="o",
                    markersize=5, linestyle="none", capsize=3,
                    yerr=[[m - min(y) for m, y in zip(mean, ys)],
                          [max(y) - m for m, y in zip(mean, ys)]])
        return
    ax.plot(xs, mean, color=color, label=label, marker="o", markersize=2)
    if len(seeds) > 1 and fill:
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.2)
    elif len(seeds) > 1:
        for edge in (min, max):
            ax.plot(xs, [edge(y) for y in ys], color=color, linestyle="--", linewidth=0.7,
                    alpha=0.7)


def panels_figure(panels: list[tuple], title: str):
    """The figure of plot_panels (a matplotlib Figure, to save or to inspect), or None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    cols = len(panels) if len(panels) <= 3 else 2 if len(panels) == 4 else 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.3 * rows + 0.9), squeeze=False,
                             layout="constrained")
    labels = list(dict.fromkeys(label for p in panels for label in p[2]))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for ax, (name, xlabel, lines, *ylabel) in zip(axes.flat, panels):
        spans = [c[-1][0] - c[0][0] for cs in lines.values() for c in cs if c]
        step = 0.012 * max(spans, default=0.0)
        for i, (label, seeds) in enumerate(lines.items()):
            if seeds and min(len(c) for c in seeds):
                _draw(ax, label, seeds, colors[label], (i - (len(lines) - 1) / 2) * step,
                      fill=len(lines) <= 2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel[0] if ylabel else name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    handles = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend([handles[x] for x in labels if x in handles], [x for x in labels if x in handles],
               loc="outside lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(f"{title}\n{caption([p[2] for p in panels])}", fontsize=10)
    return fig


def plot_panels(panels: list[tuple], path: str, title: str) -> bool:
    """Panels (title, x label, {line label: one curve per seed}[, y label (default: the title)]),
    one color per line label in every panel, one legend for all, the caption (seeds, band) under
    `title`; False without matplotlib."""
    fig = panels_figure(panels, title)
    if fig is None:
        return False
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:] or "png")
    _pyplot().close(fig)
    return True


def runs_panels(runs: dict[str, list[list[dict]]]) -> list[tuple]:
    """CURVES as panels against the responses sampled: {run name: each seed's metrics rows}."""
    return [(name, "responses sampled", {x: [curve(r, key) for r in seeds]
                                         for x, seeds in runs.items()}, ylabel)
            for key, name, ylabel in CURVES]


def plot_runs(runs: dict[str, list[list[dict]]], path: str, title: str = "") -> bool:
    """Four panels (CURVES) against responses sampled, one line per run name (the mean over its
    seeds, with their band); False without matplotlib."""
    return plot_panels(runs_panels(runs), path, title or ", ".join(runs))
