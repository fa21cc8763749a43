"""Speed and memory: the command that runs every benchmark (run it from the repo root).

The sections (each prints both sides of its comparison from one run):
- bench/rollouts.py, "Step 1: Rollout 采样" (generation is most of an RL step's time):
  sample_groups vs HF generate, its memory and continuous batching at max_num_seqs, the two rollout
  engines (sample_groups vs vLLM);
- bench/training.py, the log-prob passes and the update of "Step 4: PPO Loss 计算" (vocabulary-sized
  logits dominate memory): token_logprobs vs the naive form, the shared-prefix training forward, one
  training step split into its phases, gradient checkpointing;
- bench/ranks.py, Step 4's updates over 2 gloo ranks: --mini-batches 4 against 1, with the
  step's prompts spread every W-th (train.py) and in blocks (before);
- bench/memory.py, GPU memory at the recipes' shapes: one update's peak with the fused and the
  plain LM head, activations per token per layer at real widths, the per-GPU model of each recipe;
- bench/bf16.py, --bf16 autocast against float32 on the CPU for a rollout and an update of a real
  model, where the CPU has bf16 units or not;
- bench/warm_start.py, the warm start: one supervised step of demonstrations packed into rows vs
  padded to the longest;
- bench/vs_trl.py, its own command (`python -m bench.vs_trl`): a GRPO step of train.py vs TRL's
  GRPOTrainer (TRL in its own venv).
- bench/verifiers.py, its own command (`python -m bench.verifiers`): the rule-based verifier vs
  math-verify on the hand-labelled cases (docs/verifier.md; needs math-verify).
The shared timers and memory probes are in bench/common.py.

    python -m bench               # every section: ~10 min on 2 CPU cores, or CUDA
    python -m bench --threads 0   # torch's default thread count
    python -m bench --only slots  # one section
    python -m bench --only warmstart --threads 0   # the warm start on all cores
    (harness/builtin.py)

Every time is the median of --repeats repeats, interleaved (A, B, A, B, ...) so that load from other
processes falls on both sides alike; ratios are of those medians.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench import bf16, memory, ranks, rollouts, training, warm_start
from bench.common import header

SECTIONS = {"rollouts": rollouts.bench_rollouts, "slots": rollouts.bench_slots,
            "logprobs": training.bench_logprobs, "forward": training.bench_forward,
            "step": training.bench_step, "checkpointing": training.bench_checkpointing,
            "warmstart": warm_start.bench_warm_start, "engines": rollouts.bench_engines,
            "ranks": ranks.bench_ranks,
            "memory": memory.bench_memory, "bf16": bf16.bench_bf16}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repeats per timing (median reported)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run in the step split")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU, 0 = torch's default. 1 by default: on "
                        "cores shared with other jobs, threads spin-waiting for a busy core make "
                        "times vary tenfold")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--only", choices=list(SECTIONS), default=None, help="run one section")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads and device == "cpu":
        torch.set_num_threads(args.threads)
    print(header("python -m bench", device, args.repeats))
    t0 = time.perf_counter()
    for name, section in SECTIONS.items():
        if args.only in (None, name):
            section(device, args.steps if name == "step" else args.repeats)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
