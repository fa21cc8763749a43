"""A run's metrics and the files rank 0 writes them to.

Not an article section: what a run measures of the article's steps and writes down. Each step's
row (`drawn_sums` over every response drawn, `step_metrics` with update_policy's sums: the README's
glossary, docs/metrics.md), rank 0's warnings when a step trains nothing (`SignalCheck`), and the
run's files (`RunLog`): OUT/config.json, OUT/metrics.jsonl, a few completions per step in
OUT/completions.jsonl (`sampled_completions`), and live curves while it runs (`--report-to
wandb|tensorboard`, `LiveCurves`).

The logs are appended to line by line: a kill can cut their last line. `read_metrics` drops such
a line with a one-line notice (any other bad line is corruption: an error naming file:line), and
`trim_metrics` (--resume) rewrites a log through checkpoint.atomic.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpo
from harness import checkpoint
from infra.errors import CheckpointError, InputError
from sampler import Rollout

if TYPE_CHECKING:
    from harness.flags import TrainArgs
    from update import UpdateStats

# ---------------------------------------------------------------------------------------------
# A step's metrics row, and the warnings it calls for
# ---------------------------------------------------------------------------------------------

def drawn_sums(rolls: list[Rollout]) -> dict[str, float]:
    """This rank's sums over every response drawn in a step, kept by dynamic sampling or not."""
    s = dict.fromkeys(["samples", "reward", "correct", "length", "truncated", "groups",
                       "groups_zero_std", "groups_all_correct", "groups_all_wrong"], 0.0)
    for r in rolls:
        correct, rewards = r.correct.view(-1, r.G), r.rewards.view(-1, r.G)  # [b, G] each
        s["samples"] += correct.numel()
        s["reward"] += float(rewards.sum())
        s["correct"] += float(correct.sum())
        s["length"] += float(r.lengths.sum())
        s["truncated"] += float(r.truncated.sum())
        s["groups"] += correct.shape[0]
        s["groups_zero_std"] += float(grpo.constant_groups(rewards).sum())
        s["groups_all_correct"] += float((correct == 1).all(1).sum())
        s["groups_all_wrong"] += float((correct == 0).all(1).sum())
        for name, score in r.reward_parts.items():  # each --reward component: sum, count of scores
            k, scored = f"reward/{name}", ~score.isnan()                     # [N] bool
            s[k] = s.get(k, 0.0) + float(score[scored].sum())
            s["scored:" + k] = s.get("scored:" + k, 0.0) + float(scored.sum())
    return s


def _mean(total: float, count: float) -> float:
    """total / count of a sum over updates or loss tokens: 0 when none ran (count 0, total 0)."""
    return total / max(count, 1.0)


def step_metrics(d: dict[str, float], stats: UpdateStats, mu: int, clip_c: float,
                 corrections: tuple[bool, bool] = (False, False)) -> dict[str, float]:
    """The step's measured metrics (the README's glossary): drawn_sums `d` and update_policy's
    `stats`, both summed over ranks, turned into means. The clip and ratio metrics are the
    off-policy updates' (all but the first) once there are any, and absent when no token was in
    the loss. corrections: (--tis-cap, --off-policy-mask) on: the shares they acted on, over the
    loss tokens of every pass."""
    u = {k: stats.first[k] + stats.rest[k] for k in stats.first}  # the step's updates, summed
    off = stats.rest if stats.rest["tokens"] > 0 else stats.first
    row = {}
    row["loss"] = _mean(u["loss"], u["updates"])
    row["reward/mean"] = d["reward"] / d["samples"]
    row["reward/correct"] = d["correct"] / d["samples"]
    row["reward/frac_zero_std"] = d["groups_zero_std"] / d["groups"]
    row["groups/all_correct"] = d["groups_all_correct"] / d["groups"]
    row["groups/all_wrong"] = d["groups_all_wrong"] / d["groups"]
    for k in [k for k in d if k.startswith("reward/") and d["scored:" + k] > 0]:  # each --reward
        row[k] = d[k] / d["scored:" + k]
    row["kl"] = _mean(u["kl"], u["tokens"])
    row["entropy"] = _mean(u["entropy"], u["entropy_tokens"])
    row["mismatch/logp_abs_mean"] = _mean(u["mismatch/abs"], u["mismatch/tokens"])
    row["mismatch/logp_abs_max"] = stats.mismatch_max
    row["mismatch/kl"] = _mean(u["mismatch/kl"], u["mismatch/tokens"])
    if off["tokens"] > 0:  # something trained
        row["clip/low_frac"] = off["clip/low_frac"] / off["tokens"]
        row["clip/high_frac"] = off["clip/high_frac"] / off["tokens"]
        row["ratio/mean"] = off["ratio/mean"] / off["tokens"]
        if clip_c:
            row["clip/dual_frac"] = off["clip/dual_frac"] / off["tokens"]
    for on, name in zip(corrections, ("is/corrected", "offpolicy/masked")):
        if on:
            row[name + "_frac"] = _mean(u.get(name, 0.0), u["tokens"])
    row["len/mean"] = d["length"] / d["samples"]
    row["len/truncated_frac"] = d["truncated"] / d["samples"]
    row["tokens/in_loss"] = u["tokens"] / mu  # each pass counts the step's loss tokens once
    row["grad_norm"] = _mean(u["grad_norm"], u["updates"])
    row["updates"] = u["updates"]
    return row


NO_SIGNAL_STEPS = 3  # no sample of this many first steps scored above 0: the run is told so


@dataclass
class SignalCheck:
    """Rank 0's watch for steps that train nothing. Called with each step's metrics row, it returns
    the warnings to print, each kind once a run: every group's rewards equal (all advantages 0),
    dynamic sampling keeping no group in --max-rounds rounds, no sample right in the first
    NO_SIGNAL_STEPS steps; `silent` says whether this step trained nothing."""
    args: TrainArgs                  # train.py's flags
    steps: int = 0                   # steps checked (this process's: a resumed run counts anew)
    scored: float = 0.0              # reward/correct summed over them
    said: set[str] = field(default_factory=set)
    silent: bool = False

    def causes(self, row: dict) -> str:
        if row["reward/correct"] >= 1.0:
            return "every sample is right: the data is too easy for this model"
        if row["reward/correct"] > 0.0:
            return ("each group's answers are all right or all wrong: try a larger --group-size or "
                    "--temperature")
        a = self.args
        return ("likely causes: the answers are not in a form the reward reads (verifier: "
                "\\boxed{}, '####', 'Answer:', or the number alone; see OUT/completions.jsonl), a "
                "--prompt-template that does not ask for it, "
                f"--reward {' '.join(a.reward)}, or --max-new-tokens {a.max_new_tokens} cutting "
                f"answers off (len/truncated_frac {row['len/truncated_frac']:.2f})")

    def __call__(self, row: dict) -> list[str]:
        a, step = self.args, row["step"]
        self.steps, self.scored = self.steps + 1, self.scored + row["reward/correct"]
        found = {}
        if a.dynamic_sampling and row["sampling/groups_kept"] == 0:
            found["dynamic"] = (f"dynamic sampling kept no group in --max-rounds {a.max_rounds} "
                                "rounds: every group was all right or all wrong")
        elif not a.dynamic_sampling and row["reward/frac_zero_std"] == 1.0:
            found["zero_advantage"] = (f"every group's {a.group_size} rewards are equal, so every "
                                       "advantage is 0")
        self.silent = bool(found)
        if self.steps == NO_SIGNAL_STEPS and self.scored == 0.0:
            found["none_correct"] = (f"no sample of the first {NO_SIGNAL_STEPS} steps scored above "
                                     "0 (reward/correct 0)")
        new = [f"warning: no learning signal at step {step}: {m}; {self.causes(row)}"
               + (" (this step trained nothing)" if k != "none_correct" else "")
               for k, m in found.items() if k not in self.said]
        self.said |= set(found)
        return new


# ---------------------------------------------------------------------------------------------
# The run's files: written as it goes, read back (python -m ablate, --resume)
# ---------------------------------------------------------------------------------------------

class LiveCurves:
    """--report-to: every row train.py writes to metrics.jsonl (eval rows too) sent on, under the
    same keys at the row's `step`, to wandb (wandb.init(name=run_name, config=config, dir=out);
    WANDB_PROJECT, WANDB_MODE apply) or to tensorboard event files in OUT/tensorboard/<run_name>
    (the config as text). Rank 0 only. Each package is imported only here; a missing one is an
    InputError (one line, exit code 2)."""

    def __init__(self, kind: str, run_name: str, out: str, config: dict):
        self.kind, self.run, self.writer = kind, None, None
        try:
            if kind == "wandb":
                import wandb
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-dapo"),
                                      name=run_name, config=config, dir=out)
            else:  # torch's writer, which needs the tensorboard package
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(out, "tensorboard", run_name))
                as_code = "    " + json.dumps(config, indent=1).replace("\n", "\n    ")
                self.writer.add_text("config", as_code)
        except ImportError:
            raise InputError(f"--report-to {kind}: the {kind} package is not installed (pip "
                             f"install {kind})") from None

    def log(self, row: dict) -> None:
        scalars = {k: v for k, v in row.items() if k != "step"}
        if self.run is not None:
            self.run.log(scalars, step=row["step"])
        else:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, global_step=row["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        else:
            self.writer.close()


class RunLog:
    """Rank 0's record of a run as it goes: OUT/config.json (the resolved flags), OUT/metrics.jsonl
    (and --report-to's live curves: `LiveCurves`), OUT/completions.jsonl (--log-completions). A
    fresh run starts both files (an old run's lines in the folder are gone, its completions.jsonl
    too without --log-completions); a resumed run (resume_step: the checkpoint's step) cuts both
    back to that step and appends to them. config.json is replaced atomically, the logs lose at most
    a last line cut by a kill (`read_metrics`), and `sync` makes them durable up to a
    checkpoint."""

    def __init__(self, args: TrainArgs, config: dict, resume_step: int | None = None):
        os.makedirs(args.out, exist_ok=True)
        checkpoint.write_text(os.path.join(args.out, "config.json"), json.dumps(config, indent=1))
        self.live = None
        if args.report_to != "none":
            name = os.path.basename(os.path.abspath(args.out))      # the run's name: its folder's
            self.live = LiveCurves(args.report_to, name, args.out, config)
        self.metrics_path = os.path.join(args.out, "metrics.jsonl")
        completions_path = os.path.join(args.out, "completions.jsonl")
        if resume_step is not None:
            trim_metrics(self.metrics_path, resume_step)
            trim_metrics(completions_path, resume_step)
        elif not args.log_completions and os.path.exists(completions_path):
            os.remove(completions_path)  # an old run's: ablate.load_run would read it as ours
        mode = "w" if resume_step is None else "a"
        self.metrics_file = open(self.metrics_path, mode)
        self.completions_file = open(completions_path, mode) if args.log_completions else None

    def log(self, row: dict) -> None:
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.live:
            self.live.log(row)

    def completions(self, step: int, items: list[dict]) -> None:
        if self.completions_file:
            self.completions_file.writelines(json.dumps({"step": step, **c}) + "\n" for c in items)
            self.completions_file.flush()

    def sync(self) -> None:
        """fsync both logs (before a checkpoint: a power cut then cannot leave the checkpoint ahead
        of them; a kill loses nothing flushed)."""
        for fh in (self.metrics_file, self.completions_file):
            if fh:
                os.fsync(fh.fileno())

    def close(self) -> None:
        self.metrics_file.close()
        if self.live:
            self.live.close()
        if self.completions_file:
            self.completions_file.close()


def sampled_completions(roll: Rollout, tokenizer, k: int) -> list[dict]:
    """Up to k of a training batch's completions (prompt, response, reward), one per group first.
    The prompt is the text the model saw, special tokens kept (a chat template's turn markers)."""
    N, G = roll.response_ids.shape[0], roll.G
    order = [g * G for g in range(N // G)] + [i for i in range(N) if i % G]  # each group's first
    return [{"prompt": tokenizer.decode(roll.prompts[i // G]),
             "response": roll.response_text(i, tokenizer),
             "reward": float(roll.rewards[i]), "length": int(roll.lengths[i]),
             "truncated": bool(roll.truncated[i])}
            for i in order[:k]]


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's JSONL log (metrics.jsonl, completions.jsonl; what `python -m ablate`
    reads). A run killed while writing leaves its last line cut (no newline):
    that line is dropped with a one-line notice. Any other bad line is corruption, not a kill:
    CheckpointError naming file:line."""
    return [row for _, row in _jsonl_lines(path)]


def _jsonl_lines(path: str) -> list[tuple[str, dict]]:
    """(line, its row) for each line of a JSONL log; see `read_metrics`."""
    with open(path, "rb") as fh:
        return _parse_jsonl(fh.read(), path)


def _parse_jsonl(data: bytes, path: str) -> list[tuple[str, dict]]:
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" unless a write was cut short
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            out.append((line + "\n", json.loads(line)))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            why = str(e).splitlines()[0]
            msg = (f"{path}:{i}: not a JSON line ({why}): the file is corrupt (a kill can only "
                   "cut the last line)")
            raise CheckpointError(msg) from None
    if tail.strip():
        try:  # a whole object without its newline (a proper prefix of one never decodes)
            line = tail.decode("utf-8")
            out.append((line + "\n", json.loads(line)))
        except ValueError:
            print(f"note: {path}: dropped its last line, cut short ({len(tail)} bytes without a "
                  "newline: the run was stopped while writing it)", file=sys.stderr)
    return out


def trim_metrics(path: str, last_step: int) -> None:
    """Keep the lines of steps <= last_step (the checkpoint's own step included), so a resumed run
    logs each step exactly once; a cut last line goes too (`read_metrics`). The log is rewritten
    through `atomic`: a kill during the rewrite leaves the whole old one."""
    if not os.path.exists(path):
        return
    keep = []
    for line, row in _jsonl_lines(path):
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise CheckpointError(f"{path}: a line without an integer 'step': "
                                             f"{line.strip()[:80]}")
        if row["step"] <= last_step:
            keep.append(line)
    checkpoint.write_text(path, "".join(keep))
