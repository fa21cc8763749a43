"""Single-digit sums for a real chat model, and the rewards of docs/real-model-on-a-laptop.md.

Development only, like real_model/build.py: train.py reaches these rewards by their --reward specs
alone (`--reward real_model.sums:last_number`, imported through data.load_reward), never by an
import of its own.

    python -m real_model.sums --out .cache/sums     # train.jsonl (49 rows), test.jsonl (32 rows)

The 81 sums a + b with a, b in 1..9, as chat prompts ("What is 4 + 2?", answer "6"), shuffled with a
fixed seed and split 49 for training, 32 held out. SmolLM2-135M-Instruct answers them as "4 + 2 =
6." with no answer marker, which the verifier scores 0 by design (the last number of a reasoning
trace is not its answer), so:
- `last_number` scores the last number of the response, the task's reward for that model;
- `answer_marker` is a format term: 1 when the response states `Answer: <number>`, whatever the
number
  (the format lesson: the verifier alone, or the verifier plus a format term, with a prompt asking
  for it);
- `states_answer` is `verifier.format_reward` (any final answer the verifier reads) with the
signature of a
  --reward function, so that a run can log it with weight 0 beside the reward it trains on.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re

import verifier

TRAIN, HELD_OUT, SEED = 49, 32, 0
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_MARKER = re.compile(r"Answer:\s*\**\s*-?\d")


def rows() -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows {"prompt", "answer"}: the 81 sums of two digits 1..9, split 49 /
    32."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(SEED).shuffle(pairs)
    out = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    return out[:TRAIN], out[TRAIN:TRAIN + HELD_OUT]


def last_number(response: str, answer: str) -> float:
    """1.0 if the last number written in the response equals the answer, else 0.0."""
    found = _NUMBER.findall(response) if isinstance(response, str) else []
    if not found:
        return 0.0
    try:
        return float(float(found[-1]) == float(answer))
    except (TypeError, ValueError):
        return float(found[-1] == str(answer).strip())


def answer_marker(response: str, answer: str) -> float:
    """1.0 if the response states `Answer: <number>` (right or wrong), else 0.0: a format term."""
    return float(isinstance(response, str) and _MARKER.search(response) is not None)


def states_answer(response: str, answer: str) -> float:
    """verifier.format_reward as a --reward function: 1.0 if the verifier reads a final answer in
    the
    response (`Answer: 6`, `the answer is 6`, a box, a bare number), right or wrong; what
    --format-weight adds."""
    return verifier.format_reward(response)


def write(out: str) -> tuple[str, str]:
    """OUT/train.jsonl and OUT/test.jsonl; their paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, part in zip(("train.jsonl", "test.jsonl"), rows()):
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in part))
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".cache/sums", help="folder to write (default: .cache/sums)")
    print(*write(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
