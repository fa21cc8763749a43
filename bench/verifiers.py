"""Dev only: the rule-based verifier (`verifier.verify`) against math-verify (`--reward
math-verify`) on the hand-labelled cases: each one's agreement with the labels and false credit,
by kind of data, and every case where the two disagree (the tables of docs/verifier.md).

Not an article section, and never imported by train.py or evaluate.py. Needs `pip install
math-verify` (requirements-optional.txt):

    python -m bench.verifiers                                 # results/verifier_cases.jsonl
    python -m bench.verifiers CASES.jsonl
"""
from __future__ import annotations

import argparse
import json
import os

import verifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# sources whose references are integers (GSM8K, DAPO-Math-17k, AIME) and those written in LaTeX
INTEGERS, LATEX = ("gsm8k", "dapo", "aime"), ("math", "issue-56")


def score(rows: list[dict], fns: dict) -> dict[str, list[bool]]:
    """name -> whether fn credits each row (fn(response, reference) == 1)."""
    return {name: [fn(r["response"], r["reference"]) == 1.0 for r in rows]
            for name, fn in fns.items()}


def summary(rows: list[dict], got: dict[str, list[bool]], sources=None) -> dict[str, dict]:
    """name -> {n, agree, false_credit, missed} over the rows of `sources` (all when None)."""
    keep = [i for i, r in enumerate(rows) if sources is None or r["source"] in sources]
    out = {}
    for name, credited in got.items():
        out[name] = {"n": len(keep),
                     "agree": sum(credited[i] == rows[i]["correct"] for i in keep),
                     "false_credit": sum(credited[i] and not rows[i]["correct"] for i in keep),
                     "missed": sum(rows[i]["correct"] and not credited[i] for i in keep)}
    return out


def disagreements(rows: list[dict], got: dict[str, list[bool]]) -> list[int]:
    """Indices of the rows the verifiers score differently."""
    a, b = got.values()
    return [i for i in range(len(rows)) if a[i] != b[i]]


def markdown(rows: list[dict], got: dict[str, list[bool]]) -> str:
    """The figures table and the disagreements table, as docs/verifier.md shows them."""
    names = list(got)
    lines = ["| cases | " + " | ".join(f"{n}: agreement, false credit, missed" for n in names)
             + " |", "|---|" + "---|" * len(names)]
    for title, sources in (("all", None), ("integer answers (GSM8K, DAPO-Math, AIME)", INTEGERS),
                           ("LaTeX answers (MATH style, issue 56's forms)", LATEX)):
        s = summary(rows, got, sources)
        n = s[names[0]]["n"]
        lines.append(f"| {title}: {n} | " + " | ".join(
            f"{s[k]['agree'] / max(n, 1):.1%} ({s[k]['agree']}), {s[k]['false_credit']}, "
            f"{s[k]['missed']}" for k in names) + " |")
    lines += ["", "| line | source / kind | note | label | " + " | ".join(names) + " |",
              "|---|---|---|---|" + "---|" * len(names)]
    for i in disagreements(rows, got):
        r = rows[i]
        note = r.get("note", "").replace("|", "\\|")
        lines.append(f"| {i + 1} | {r['source']}{' / ' + r['kind'] if 'kind' in r else ''} | "
                     f"{note} | {'right' if r['correct'] else 'wrong'} | "
                     + " | ".join("1" if got[k][i] else "0" for k in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    cli = argparse.ArgumentParser(prog="python -m bench.verifiers", description=__doc__)
    cli.add_argument("cases", nargs="?",
                     default=os.path.join(ROOT, "results", "verifier_cases.jsonl"))
    args = cli.parse_args(argv)
    with open(args.cases, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    from harness.math_verify_reward import MathVerify
    checker = MathVerify()
    try:
        got = score(rows, {"verifier": verifier.verify, "math-verify": checker})
    finally:
        checker.close()
    print(markdown(rows, got))
    print(f"\nmath-verify: {checker.timeouts} responses past its {checker.timeout_s:g} s bound, "
          f"{checker.errors} failures")


if __name__ == "__main__":
    main()
