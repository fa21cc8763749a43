"""A finished run and the measures read from it: a curve is Run -> [(x, value)], a measure Run ->
one value (None: none), and `fmt` writes a measure over seeds as 'mean ± sd'.

Not an article section: what the experiments (ablate/experiments.py) and the progressive ablation
(ablate/rows.py) read from each run's OUT/config.json, metrics.jsonl and completions.jsonl.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from harness.metrics import read_metrics


@dataclass
class Run:
    """One finished train.py run: its config.json, metrics.jsonl and completions.jsonl (every
    response trained on: the experiments pass --log-completions with room for all of them)."""
    config: dict
    metrics: list[dict]
    completions: list[dict]


def load_run(out: str) -> Run:
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    return Run(config, read_metrics(os.path.join(out, "metrics.jsonl")),
               read_metrics(os.path.join(out, "completions.jsonl")))


Curve = Callable[[Run], list[tuple[float, float]]]
Measure = Callable[[Run], float | None]


def logged(key: str) -> Curve:
    """A curve of a metric of metrics.jsonl over training steps (eval/* at the step it was
    taken)."""
    return lambda run: [(r["step"], r[key]) for r in run.metrics if key in r]


def by_step(fn: Callable[[list[dict]], float | None]) -> Curve:
    """A curve over training: (step, fn(the completions trained on at that step)) where fn gives a
    value."""
    def points(run: Run) -> list[tuple[int, float]]:
        steps = sorted({c["step"] for c in run.completions})
        return [(s, v) for s in steps
                if (v := fn([c for c in run.completions if c["step"] == s])) is not None]
    return points


def at_samples(points: Curve, samples: Callable[[Run], float]) -> Measure:
    """Run -> the curve's last value taken with at most samples(run) responses drawn (x: responses
    sampled)."""
    def value(run: Run) -> float | None:
        pts = [v for s, v in points(run) if s <= samples(run)]
        return pts[-1] if pts else None
    return value


def end(points: Curve, k: int = 5) -> Measure:
    """Run -> the mean of a curve's last k points (the end of training)."""
    return lambda run: statistics.mean(v for _, v in points(run)[-k:]) if points(run) else None


def over_run(points: Curve) -> Measure:
    """Run -> the mean of a curve over the whole run."""
    return lambda run: statistics.mean(v for _, v in points(run)) if points(run) else None


def final(key: str) -> Measure:
    """Run -> the last logged value of a metric (eval/accuracy: the evaluation after the last
    step)."""
    return lambda run: logged(key)(run)[-1][1] if logged(key)(run) else None


def fmt(values: list[float], digits: int | None = None) -> str:
    """'mean ± sd' of the values given (None dropped; '-' if none), with `digits` decimals (default:
    1 from 10 up, else 3)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    digits = (1 if abs(mean) >= 10 else 3) if digits is None else digits
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def difference(base: list[float], other: list[float]) -> tuple[float, float | None]:
    """mean(other) - mean(base) and its standard error (Welch: sqrt(s1^2/n1 + s2^2/n2); None with
    one seed)."""
    se = (math.sqrt(statistics.variance(base) / len(base) + statistics.variance(other) / len(other))
          if min(len(base), len(other)) > 1 else None)
    return statistics.mean(other) - statistics.mean(base), se


def fmt_difference(base: list[float], other: list[float]) -> str:
    """A table cell: mean(other) - mean(base) ± 2 SE and whether that is beyond noise ('-' where a
    side has no value)."""
    base, other = [v for v in base if v is not None], [v for v in other if v is not None]
    if not base or not other:
        return "-"
    d, se = difference(base, other)
    if se is None:
        return f"{d:+.3g} (one seed: no spread)"
    noise = "**beyond noise**" if abs(d) > 2 * se else "within noise"
    return f"{d:+.3g} ± {2 * se:.2g}: {noise}"
