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
from ablate.curves import curve, runs_panels
from ablate.measures import at_samples, fmt, fmt_difference

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


def row_measures(seeds: list[list[dict]], budget: int) -> dict[str, list[float | None]]:
    """A row's measures, one value per seed (from its metrics.jsonl rows): the columns of table."""
    def tail(key):
        return [statistics.mean(v for _, v in curve(r, key)[-5:]) for r in seeds]

    def over_run(key):
        return [statistics.mean(v for _, v in curve(r, key)) for r in seeds]

    return {AT_END: [curve(r, "eval/accuracy")[-1][1] for r in seeds],
            # the last evaluation within a quarter of the budget (the best one, before)
            "acc. at 1/4 budget": [at_samples(lambda r: curve(r, "eval/accuracy"),
                                              lambda r: budget / 4)(r) for r in seeds],
            "entropy (last 5 steps)": tail("entropy"), "length (last 5)": tail("len/mean"),
            "truncated (last 5)": tail("len/truncated_frac"),
            "tokens clipped low": over_run("clip/low_frac"),
            "tokens clipped high": over_run("clip/high_frac"),
            "steps": [max(x["step"] for x in r if "loss" in x) for r in seeds]}


AT_END = "held-out acc. at end"
# clipped tokens are a share of the tokens (as in the experiments' tables), not a percent
DIGITS = {"entropy (last 5 steps)": 4, "length (last 5)": 1, "tokens clipped low": 4,
          "tokens clipped high": 4, "steps": 0}


def table(runs: dict[str, list[list[dict]]], budget: int, rows: list[tuple] = ROWS) -> str:
    """--rows: one line per row (each measure's mean ± sd over seeds), then each row's difference
    from the row above (an --add-row row's from DAPO) and DAPO's from naive GRPO, with 2 SE."""
    values = [row_measures(seeds, budget) for seeds in runs.values()]
    names = list(values[0])
    lines = ["| row | " + " | ".join(names) + " | paper AIME24 |",
             "|" + " --- |" * (len(names) + 2)]
    for (name, _, paper), v in zip(rows, values):
        cells = [fmt(v[k], DIGITS.get(k, 3)) for k in names]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if paper is None else paper} |")
    dapo_row = len(ROWS) - 1
    pairs = [(f"{rows[i][0]} (− the row above)", i, i - 1)
             for i in range(1, min(len(ROWS), len(values)))]
    if dapo_row < len(values):  # all of ROWS
        pairs += [(f"{rows[i][0]} (− DAPO)", i, dapo_row) for i in range(len(ROWS), len(values))]
        pairs.append(("DAPO − naive GRPO", dapo_row, 0))
    lines += ["", "Each row's difference from the row above (an added row's: from DAPO), and "
              "DAPO's from naive GRPO: mean difference ± 2 SE (Welch), beyond noise when it "
              "exceeds 2 SE.", "", "| difference | " + " | ".join(names) + " |",
              "|" + " --- |" * (len(names) + 1)]
    for label, i, j in pairs:
        lines.append(f"| {label} | "
                     + " | ".join(fmt_difference(values[j][k], values[i][k]) for k in names) + " |")
    seeds = sorted({len(s) for s in runs.values()})
    return "\n".join(lines) + f"\n\nmean ± sd over {'/'.join(map(str, seeds))} seeds per row."


def figure_panels(runs: dict[str, list[list[dict]]]) -> list[tuple]:
    """The --rows figure: curves.runs_panels' four curves against the responses sampled, then the
    held-out accuracy at the end as one point per row with bars from the lowest to the highest
    seed (the rows' curves crowd into a few hundredths at the end)."""
    end = {name: [[(i, curve(r, "eval/accuracy")[-1][1])] for r in seeds]
           for i, (name, seeds) in enumerate(runs.items())}
    return [*runs_panels(runs), ("held-out greedy accuracy at the end", "row (the table's order)",
                                 end, "accuracy (share right, greedy)")]
