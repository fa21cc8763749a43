"""A run's metrics: each step's row (`drawn_sums` and `step_metrics`, the README's glossary) and rank 0's
warnings when a step trains nothing (`SignalCheck`), for train.py; reading OUT/metrics.jsonl and drawing its
curves (-> PNG), for train.py --plot and ablate.py, with the measures ablate.py reads from a run; live curves
while it runs (`--report-to wandb|tensorboard`, `LiveCurves`).

Not an article section: the figures that show what the article's fixes do (accuracy, entropy, length and
truncation against the number of responses sampled).
"""
from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import checkpoint
import grpo
import update
from data import InputError
from sampler import Rollout

if TYPE_CHECKING:
    from flags import TrainArgs

CURVES = [("eval/accuracy", "held-out greedy accuracy"), ("entropy", "policy entropy (nats/token)"),
          ("len/mean", "mean response length (tokens)"), ("len/truncated_frac", "truncated fraction")]


def read_metrics(path: str) -> list[dict]:
    """The rows of metrics.jsonl (or completions.jsonl); a last line cut by a kill is dropped with a
    notice (checkpoint.read_jsonl)."""
    return checkpoint.read_jsonl(path)


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(samples drawn so far, value) points of `key`; eval lines take the sample count of their step."""
    samples_at = {0: 0, **{r["step"]: r["samples"] for r in rows if "samples" in r}}
    return [(samples_at[r["step"]], r[key]) for r in rows if key in r]


# A run's measures for ablate.py: a curve is Run -> [(x, value)], a measure Run -> one value (None: none)

@dataclass
class Run:
    """One finished train.py run: its config.json, metrics.jsonl and completions.jsonl (every response
    trained on: the experiments pass --log-completions with room for all of them)."""
    config: dict
    metrics: list[dict]
    completions: list[dict]


def load_run(out: str) -> Run:
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    return Run(config, read_metrics(os.path.join(out, "metrics.jsonl")), read_metrics(os.path.join(out, "completions.jsonl")))


def logged(key: str) -> Callable[[Run], list[tuple[int, float]]]:
    """A curve of a metric of metrics.jsonl over training steps (eval/* at the step it was taken)."""
    return lambda run: [(r["step"], r[key]) for r in run.metrics if key in r]


def by_step(fn: Callable[[list[dict]], float | None]) -> Callable[[Run], list[tuple[int, float]]]:
    """A curve over training: (step, fn(the completions trained on at that step)) where fn gives a value."""
    def points(run: Run) -> list[tuple[int, float]]:
        steps = sorted({c["step"] for c in run.completions})
        return [(s, v) for s in steps if (v := fn([c for c in run.completions if c["step"] == s])) is not None]
    return points


def at_samples(points: Callable[[Run], list[tuple[float, float]]], samples: Callable[[Run], float]) -> Callable[[Run], float | None]:
    """Run -> the curve's last value taken with at most samples(run) responses drawn (x: responses sampled)."""
    return lambda run: pts[-1] if (pts := [v for s, v in points(run) if s <= samples(run)]) else None


def end(points: Callable[[Run], list[tuple[float, float]]], k: int = 5) -> Callable[[Run], float | None]:
    """Run -> the mean of a curve's last k points (the end of training)."""
    return lambda run: statistics.mean(v for _, v in points(run)[-k:]) if points(run) else None


def over_run(points: Callable[[Run], list[tuple[float, float]]]) -> Callable[[Run], float | None]:
    """Run -> the mean of a curve over the whole run."""
    return lambda run: statistics.mean(v for _, v in points(run)) if points(run) else None


def final(key: str) -> Callable[[Run], float | None]:
    """Run -> the last logged value of a metric (eval/accuracy: the evaluation after the last step)."""
    return lambda run: logged(key)(run)[-1][1] if logged(key)(run) else None


def mean_curve(runs: list[list[dict]], key: str) -> list[tuple[float, float]]:
    """Seeds averaged point by point (runs of one row log at the same steps, so points line up)."""
    curves = [curve(r, key) for r in runs]
    n = min(len(c) for c in curves)
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves)) for i in range(n)]


def _pyplot():
    """matplotlib.pyplot drawing to files, or None (with a line saying so) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot_runs(runs: dict[str, list[list[dict]]], path: str) -> bool:
    """Four panels (CURVES) against samples drawn, one line per run name; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for name, seeds in runs.items():
            pts = mean_curve(seeds, key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="o" if key.startswith("eval") else None,
                    markersize=3)
        ax.set_title(title)
        ax.set_xlabel("responses sampled")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
    return True


def plot_panels(panels: list[tuple[str, str, dict[str, list[list[tuple[float, float]]]]]], path: str, title: str) -> bool:
    """A row of panels (title, x label, {line label: one curve per seed}): each line is the mean over
    seeds (their points lined up by index) with a band from the lowest to the highest seed; False
    without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (name, xlabel, lines) in zip(axes[0], panels):
        for label, seeds in lines.items():
            n = min(len(c) for c in seeds)
            xs = [statistics.mean(c[i][0] for c in seeds) for i in range(n)]
            ys = [[c[i][1] for c in seeds] for i in range(n)]
            (line,) = ax.plot(xs, [statistics.mean(y) for y in ys], label=label, marker="o", markersize=2)
            if len(seeds) > 1:
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
    return True


class LiveCurves:
    """--report-to: every row train.py writes to metrics.jsonl (eval rows too) sent on, under the same keys at
    the row's `step`, to wandb (wandb.init(name=run_name, config=config, dir=out); WANDB_PROJECT, WANDB_MODE
    apply) or to tensorboard event files in OUT/tensorboard/<run_name> (the config as text). Rank 0 only.
    Each package is imported only here; a missing one is an InputError (one line, exit code 2)."""

    def __init__(self, kind: str, run_name: str, out: str, config: dict):
        self.kind, self.run, self.writer = kind, None, None
        try:
            if kind == "wandb":
                import wandb
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-dapo"), name=run_name, config=config,
                                      dir=out)
            else:
                from torch.utils.tensorboard import SummaryWriter  # torch's writer, needs the tensorboard package
                self.writer = SummaryWriter(os.path.join(out, "tensorboard", run_name))
                self.writer.add_text("config", "    " + json.dumps(config, indent=1).replace("\n", "\n    "))  # as code
        except ImportError:
            raise InputError(f"--report-to {kind}: the {kind} package is not installed (pip install {kind})") from None

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
    a last line cut by a kill (checkpoint.read_jsonl), and `sync` makes them durable up to a
    checkpoint."""

    def __init__(self, args: TrainArgs, config: dict, resume_step: int | None = None):
        os.makedirs(args.out, exist_ok=True)
        checkpoint.write_text(os.path.join(args.out, "config.json"), json.dumps(config, indent=1))
        self.live = LiveCurves(args.report_to, args.run_name, args.out, config) if args.report_to != "none" else None
        self.metrics_path = os.path.join(args.out, "metrics.jsonl")
        completions_path = os.path.join(args.out, "completions.jsonl")
        if resume_step is not None:
            checkpoint.trim_metrics(self.metrics_path, resume_step)
            checkpoint.trim_metrics(completions_path, resume_step)
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


# ---------------------------------------------------------------------------------------------
# A step's metrics row, and the warnings it calls for
# ---------------------------------------------------------------------------------------------

def drawn_sums(rolls: list[Rollout]) -> dict[str, float]:
    """This rank's sums over every response drawn in a step, kept by dynamic sampling or not."""
    s = dict.fromkeys(["samples", "reward", "correct", "length", "truncated", "groups", "groups_zero_std",
                       "groups_all_correct", "groups_all_wrong"], 0.0)
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
        for name, score in r.reward_parts.items():  # each --reward component: sum and count of its scores
            k, scored = f"reward/{name}", ~score.isnan()                     # [N] bool
            s[k] = s.get(k, 0.0) + float(score[scored].sum())
            s["scored:" + k] = s.get("scored:" + k, 0.0) + float(scored.sum())
    return s


def _mean(total: float, count: float) -> float:
    """total / count of a sum over updates or loss tokens: 0 when none ran (count 0, total 0)."""
    return total / max(count, 1.0)


def step_metrics(d: dict[str, float], stats: update.UpdateStats, mu: int, clip_c: float) -> dict[str, float]:
    """The step's measured metrics (the README's glossary): drawn_sums `d` and update_policy's `stats`,
    both summed over ranks, turned into means. The clip and ratio metrics are the off-policy updates' (all
    but the first) once there are any, and absent when no token was in the loss."""
    u = {k: stats.first[k] + stats.rest[k] for k in update.UPDATE_SUMS}  # all updates of the step
    off = stats.rest if stats.rest["tokens"] > 0 else stats.first
    row = {}
    row["loss"] = _mean(u["loss"], u["updates"])
    row["reward/mean"] = d["reward"] / d["samples"]
    row["reward/correct"] = d["correct"] / d["samples"]
    row["reward/frac_zero_std"] = d["groups_zero_std"] / d["groups"]
    row["groups/all_correct"] = d["groups_all_correct"] / d["groups"]
    row["groups/all_wrong"] = d["groups_all_wrong"] / d["groups"]
    for k in [k for k in d if k.startswith("reward/") and d["scored:" + k] > 0]:  # each --reward component
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
    row["len/mean"] = d["length"] / d["samples"]
    row["len/truncated_frac"] = d["truncated"] / d["samples"]
    row["tokens/in_loss"] = u["tokens"] / mu  # each pass counts the step's loss tokens once
    row["grad_norm"] = _mean(u["grad_norm"], u["updates"])
    row["updates"] = u["updates"]
    return row


NO_SIGNAL_STEPS = 3  # no sample of this many first steps scored above 0: the run is told so


@dataclass
class SignalCheck:
    """Rank 0's watch for steps that train nothing. Called with each step's metrics row, it returns the
    warnings to print, each kind once a run: every group's rewards equal (all advantages 0), dynamic sampling
    keeping no group in --max-rounds rounds, no sample right in the first NO_SIGNAL_STEPS steps; `silent`
    says whether this step trained nothing."""
    args: TrainArgs                  # train.py's flags
    steps: int = 0                   # steps checked (of this process: a resumed run counts from its resume)
    scored: float = 0.0              # reward/correct summed over them
    said: set[str] = field(default_factory=set)
    silent: bool = False

    def causes(self, row: dict) -> str:
        if row["reward/correct"] >= 1.0:
            return "every sample is right: the data is too easy for this model"
        if row["reward/correct"] > 0.0:
            return "each group's answers are all right or all wrong: try a larger --group-size or --temperature"
        a = self.args
        return ("likely causes: the answers are not in a form the reward reads (verifier: \\boxed{}, '####', "
                "'Answer:', or the number alone; see OUT/completions.jsonl), a --prompt-template that does not ask "
                f"for it, --reward {' '.join(a.reward)}, or --max-new-tokens {a.max_new_tokens} cutting answers off "
                f"(len/truncated_frac {row['len/truncated_frac']:.2f})")

    def __call__(self, row: dict) -> list[str]:
        a, step = self.args, row["step"]
        self.steps, self.scored = self.steps + 1, self.scored + row["reward/correct"]
        found = {}
        if a.dynamic_sampling and row["sampling/groups_kept"] == 0:
            found["dynamic"] = (f"dynamic sampling kept no group in --max-rounds {a.max_rounds} rounds: every group "
                                "was all right or all wrong")
        elif not a.dynamic_sampling and row["reward/frac_zero_std"] == 1.0:
            found["zero_advantage"] = f"every group's {a.group_size} rewards are equal, so every advantage is 0"
        self.silent = bool(found)
        if self.steps == NO_SIGNAL_STEPS and self.scored == 0.0:
            found["none_correct"] = f"no sample of the first {NO_SIGNAL_STEPS} steps scored above 0 (reward/correct 0)"
        new = [f"warning: no learning signal at step {step}: {m}; {self.causes(row)}"
               + (" (this step trained nothing)" if k != "none_correct" else "")
               for k, m in found.items() if k not in self.said]
        self.said |= set(found)
        return new
