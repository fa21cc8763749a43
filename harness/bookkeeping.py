"""After each step's update: the metrics row, rank 0's files, held-out evaluation, checkpoints, the
progress bar, and the end of the run (the final model, the summary line).

Not an article section: what train.run does around Steps 1-4 (train.py reads as the article; this is
the bookkeeping a real run needs).
"""
from __future__ import annotations

import dataclasses
import sys

from tqdm import tqdm

import update
from harness import checkpoint, evaluation, flags, lora, metrics, models
from harness.rollout import StepDraw
from harness.setup import RunState, Setup
from infra import parallel


def progress_bar(args: flags.TrainArgs, ranks: parallel.Dist, first: int):
    """The steps first .. --steps - 1: rank 0's tqdm bar over them, the plain range elsewhere."""
    steps = range(first, args.steps)
    if ranks.master and len(steps):
        return tqdm(steps, desc=args.algo, initial=first, total=args.steps, dynamic_ncols=True)
    return steps


def step_row(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, step: int, draw: StepDraw,
             stats: update.UpdateStats, samples: int, t0: float) -> dict:
    """The step's metrics.jsonl row: the drawn rollouts' sums and the update's `stats` (both over
    all ranks) as metrics.step_metrics, the learning rate, the run's samples so far (`samples`
    before this step, plus its own), the sampling/*, time/*, memory/* and perf/* keys (Step 1's
    FLOPs over the rounds used and those drawn ahead and not used)."""
    roll, sstats, rounds, unused = draw.roll, draw.stats, draw.rounds, draw.unused
    drawn = [r for r, _ in rounds]
    d = ranks.sum_named({**metrics.drawn_sums(drawn),
                         **s.perf.flops(roll, drawn + unused, stats, args, ranks)})
    row = {"step": step + 1, **metrics.step_metrics(d, stats, args.mu, args.clip_c,
                                                     (args.tis_cap > 0, args.off_policy_mask > 0)),
           "lr": s.sched.get_last_lr()[0], "samples": samples + int(d["samples"]), **sstats,
           "time/sample_s": sum(t["time/sample_s"] for _, t in rounds),
           "time/reward_s": sum(t["time/reward_s"] for _, t in rounds),
           "time/logprob_s": stats.logprob_s, "time/update_s": stats.update_s,
           "time/step_s": parallel.clock() - t0}
    own_ref = None if s.ref is s.model else s.ref  # the bytes rank 0 holds (--fsdp: its shards)
    row["memory/state_bytes"] = parallel.state_bytes(s.model, s.learner.opt, own_ref)
    row.update(s.perf.metrics(d, row))           # MFU and tokens/s: d's FLOPs over the times
    return row


def log_step(s: Setup, args: flags.TrainArgs, step: int, row: dict, roll) -> None:
    """Rank 0: the row to metrics.jsonl, the no-signal warnings (once each, in plain words) and a
    few completions of the batch trained on, to read what the policy writes."""
    s.out.log(row)
    for warning in s.signal(row):
        tqdm.write(warning, file=sys.stderr)
    s.out.completions(step + 1,
                      metrics.sampled_completions(roll, s.tokenizer, args.log_completions))


def held_out(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, step: int) -> float | None:
    """Held-out metrics (harness/evaluation.py; split over ranks) logged; returns accuracy, or
    mean@n."""
    if not s.eval_rows:
        return None
    with parallel.unsharded(None if s.engine else s.model):  # --fsdp: gathered once for all
        m, _ = evaluation.evaluate_model(s.model, s.tokenizer, s.eval_rows, args, ranks,
                                       s.task.reward_fn, s.task.sample)
    if s.out:
        s.out.log({"step": step, **m})
    return m[evaluation.headline(args.eval_samples)]


def save_checkpoint(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist,
                    state: RunState) -> None:
    """--save-every: the logs synced to disk first (a checkpoint never runs ahead of them), then
    OUT/checkpoint.pt from rank 0, or with --fsdp every rank's shards under OUT/checkpoint/."""
    if s.out:
        s.out.sync()
    counters = dataclasses.asdict(state)
    if args.fsdp:
        checkpoint.save_sharded(s.ckpt_path, s.model, s.learner.opt, s.sched, counters, ranks)
    elif ranks.master:
        checkpoint.save(s.ckpt_path, s.model, s.learner.opt, s.sched,
                        {**counters, "world_size": ranks.world})


def show_progress(s: Setup, bar, row: dict, acc: float | None, done: bool = False) -> None:
    """Rank 0's progress bar: the step's reward and length, the last held-out accuracy, the MFU
    and tokens/s, and signal=none when the step trained nothing. done: the run's last step: the
    bar set to the steps run and closed (the loop breaks out of it, so tqdm would leave it one
    short)."""
    if not hasattr(bar, "set_postfix"):                           # not rank 0, or no steps left
        return
    bar.set_postfix(reward=f"{row['reward/correct']:.2f}", len=f"{row['len/mean']:.0f}",
                    **({"eval": f"{acc:.2f}"} if acc is not None else {}),
                    **({"mfu": f"{100 * row['perf/mfu']:.3g}%"} if "perf/mfu" in row else {}),
                    **{"tok/s": f"{row['perf/tokens_per_s']:.0f}"},
                    **({"signal": "none"} if s.signal.silent else {}))
    if done:                        # inside tqdm's loop its own count lags: set it, then close
        bar.n = row["step"]
        bar.close()


def finish(s: Setup, args: flags.TrainArgs, ranks: parallel.Dist, state: RunState,
           elapsed: float) -> dict:
    """The end: the whole model saved to OUT/final by rank 0 (FSDP2: gathered; LoRA's adapters
    merged, and OUT/adapter alone), and the summary line."""
    weights = lora.merged_state_dict(s.model) if args.lora_r else parallel.full_state_dict(s.model)
    if s.engine:
        s.engine.close()
    if ranks.master:
        adapter = None
        if args.lora_r:
            adapter = lambda tmp: lora.save_adapter(s.model, s.lora_config, tmp)  # noqa: E731
        final = models.save_final(args.out, s.model, s.tokenizer, weights, adapter)
        s.out.close()
        what = "greedy accuracy" if args.eval_samples == 1 else f"mean@{args.eval_samples}"
        acc = ""
        if s.eval_rows and state.acc_before is not None:
            acc = (f"held-out {what} {state.acc_before:.3f} -> {state.acc_after:.3f} "
                   f"({len(s.eval_rows)} problems); ")
        print(f"{acc}{state.step} steps, {state.samples} samples in {elapsed:.0f}s; "
              f"model saved to {final}")
    return {"acc_before": state.acc_before, "acc_after": state.acc_after, "seconds": elapsed}


