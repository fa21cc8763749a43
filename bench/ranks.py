"""Every rank busy in the update: a 2-rank gloo step's update time at --mini-batches 4 against 1.

Not an article section: how Step 4's optimizer updates ("Step 4: PPO Loss 计算", --mini-batches K)
spread over the ranks. train.draw_round gives each rank every W-th prompt of the step, so each
mini-batch (a K-th of the step's prompt order) holds rows on every rank. Before, a rank drew one
block of the step's prompts, so at K >= W each mini-batch sat on one rank and the others ran
zero-weight passes. This section runs both layouts from one command, the old one by a driver that
gives train.py's data.prompt_rows back the block each rank used to draw:

    python -m bench --only ranks     # 2 gloo ranks of one thread each, the built-in default
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import ROOT
from harness import builtin

# the built-in default at 16 prompts x G 8, 3 steps, a small held-out set (the update is measured)
RANKS_FLAGS = ["--prompts-per-step", "16", "--group-size", "8", "--steps", "3", "--eval-every", "3"]

DRIVER = """
import os, sys
sys.path.insert(0, os.getcwd())
import train
from harness import data
if os.environ["BENCH_LAYOUT"] == "blocks":     # before: rank r drew prompts first + r*b .. + b - 1
    every_wth = data.prompt_rows
    def blocks(rows, seed, start, count, stride=1):
        rank = int(os.environ["RANK"])
        return every_wth(rows, seed, start - rank + rank * count, count)
    data.prompt_rows = blocks
train.main(sys.argv[1:])
"""


def _update_seconds(d: str, layout: str, K: int) -> list[float]:
    """time/update_s of each step but the first of one 2-rank run."""
    out = os.path.join(d, f"{layout}-{K}")
    driver = os.path.join(d, "driver.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           driver, *RANKS_FLAGS, "--eval-data", os.path.join(d, "eval.jsonl"),
           "--mini-batches", str(K), "--out", out, "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_LAYOUT": layout}
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=env)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [r["time/update_s"] for r in rows if "time/update_s" in r and r["step"] > 1]


def bench_ranks(device: str, repeats: int) -> None:
    print("\n## Every rank busy in the update: 2 gloo ranks (one thread each), 16 prompts x G 8, "
          "update seconds per step (median)")
    if device != "cpu":
        print("(runs on CPU ranks; skipped on", device + ")")
        return
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "driver.py"), "w") as fh:
            fh.write(DRIVER)
        with open(os.path.join(d, "eval.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in builtin.sample_problems(4, 2, True))
        times = {(layout, K): [] for layout in ("blocks", "every-wth") for K in (1, 4)}
        for _ in range(repeats):                   # interleaved, so load falls on every cell alike
            for layout, K in times:
                times[layout, K] += _update_seconds(d, layout, K)
    print("| ranks hold | K = 1 | K = 4 | K = 4 / K = 1 |")
    print("| --- | --- | --- | --- |")
    for layout, name in (("blocks", "a block of prompts (before)"),
                         ("every-wth", "every W-th prompt (train.py)")):
        one, four = (statistics.median(times[layout, K]) for K in (1, 4))
        print(f"| {name} | {one:.3f} | {four:.3f} | {four / one:.2f}x |")
