"""The article's progressive ablation, rerun in miniature (`python -m ablate --rows`): ROWS, each
adding one fix to the row above, the last exactly `train.py --algo dapo`, and the table built from
their runs.

Article section: "DAPO 递进增益" (Qwen2.5-32B, AIME 2024: naive GRPO 30, + overlong filtering 36,
+ clip-higher 38, + soft overlong punishment 41, + token-level loss 42, + dynamic sampling 50).
"""
from __future__ import annotations

import shlex
import statistics

import dapo
from ablate.measures import fmt
from curves import curve

ROWS = [  # (name, flags added by this row, the paper's AIME24 avg@32 for the row)
    ("naive GRPO", ["--algo", "grpo", "--beta", "0", "--wrong-reward", "-1"], 30),
    ("+ overlong filtering", ["--overlong-filter"], 36),
    ("+ clip-higher", ["--eps-high", str(dapo.EPS_HIGH)], 38),
    ("+ soft overlong punishment", ["--overlong-penalty"], 41),
    ("+ token-level loss", ["--reduction", "token"], 42),
    ("+ dynamic sampling (= DAPO)", ["--dynamic-sampling"], 50),
]


def row_flags(i: int, rows: list[tuple] = ROWS) -> list[str]:
    """The flags of row i of rows: a row of ROWS has everything of the rows above it plus its own;
    an --add-row row after them has all of ROWS (= DAPO) plus its own."""
    own = rows[i][1] if i >= len(ROWS) else []
    return [f for _, flags, _ in ROWS[: i + 1] for f in flags] + own


def extra_row(spec: str) -> tuple[str, list[str], None]:
    """--add-row 'NAME=FLAGS' -> (NAME, FLAGS split as a shell would, no paper figure)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"error: --add-row needs NAME=FLAGS, got {spec!r}")
    return name.strip(), shlex.split(flags), None


def samples_to_reach(rows: list[dict], target: float) -> float | None:
    hits = [s for s, v in curve(rows, "eval/accuracy") if v >= target]
    return hits[0] if hits else None


def table(runs: dict[str, list[list[dict]]], budget: int, rows: list[tuple] = ROWS) -> str:
    """--rows: one line per row, from each seed's metrics.jsonl rows."""
    lines = ["| row | held-out acc. at end | acc. at 1/4 budget | samples to 90% | "
             "entropy (last 5 steps) | length (last 5) | truncated (last 5) | "
             "tokens clipped low / high | steps | paper AIME24 |", "|" + " --- |" * 10]
    for (name, _, paper), seeds in zip(rows, runs.values()):
        quarter = [max((v for s, v in curve(r, "eval/accuracy") if s <= budget / 4), default=None)
                   for r in seeds]
        reach = [samples_to_reach(r, 0.9) for r in seeds]

        def tail(key, seeds=seeds):
            return [statistics.mean(v for _, v in curve(r, key)[-5:]) for r in seeds]

        def clip(key, seeds=seeds):
            return statistics.mean(statistics.mean(v for _, v in curve(r, key)) for r in seeds)

        steps = [max(r["step"] for r in rs if "loss" in r) for rs in seeds]
        hit = [x for x in reach if x is not None]
        reached = (f"{statistics.mean(hit):.0f} ({len(hit)}/{len(reach)} seeds)" if hit
                   else f"never (0/{len(reach)})")
        at_end = [curve(r, "eval/accuracy")[-1][1] for r in seeds]
        lines.append(f"| {name} | {fmt(at_end, 3)} | {fmt(quarter, 3)} | {reached} | "
                     f"{fmt(tail('entropy'), 4)} | {fmt(tail('len/mean'), 1)} | "
                     f"{fmt(tail('len/truncated_frac'), 3)} | "
                     f"{clip('clip/low_frac'):.2%} / {clip('clip/high_frac'):.2%} | "
                     f"{statistics.mean(steps):.0f} | {'-' if paper is None else paper} |")
    return "\n".join(lines)
