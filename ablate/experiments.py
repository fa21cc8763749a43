"""The article's DAPO fixes, each shown on the problem it names: EXPERIMENTS, one per fix in a
regime where its problem should appear (a group size, a token budget, off-policy updates, a habit
model of ablate/habits.py), naive GRPO with the fix off vs on; the measures of responses they read,
and the table of differences with their noise.

Article section: "DAPO：四项修正" (each fix a 问题 and its DAPO 修正).
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import dapo
import verifier
from ablate import habits
from ablate.curves import CURVES, curve
from ablate.measures import (
    Run,
    at_samples,
    by_step,
    end,
    final,
    fmt,
    fmt_difference,
    logged,
    over_run,
)
from harness import builtin, flags


def solution(prompt: str) -> int:
    """x of a built-in equation, 'ax+b=c' or 'ax+b=cx+d' (a prompt as builtin.make_problem writes
    it)."""
    lhs, rhs = prompt.strip().split("=")
    a, b = (int(v) for v in builtin.split_linear(lhs))
    c, d = (int(v) for v in builtin.split_linear(rhs)) if "x" in rhs else (0, int(rhs))
    return (d - b) // (a - c)


def right(c: dict) -> bool:
    """A logged completion answers its prompt right (the verifier's score, whatever the run's
    reward)."""
    return verifier.verify(c["response"], str(solution(c["prompt"]))) == 1.0


def on_the_way(c: dict) -> bool:
    """A truncated completion that is the start of a right worked solution (plain, or with its check
    line)."""
    eq, x = c["prompt"].strip(), solution(c["prompt"])
    return c["truncated"] and any(builtin.solve_steps(eq, x, v).startswith(c["response"])
                                  for v in (False, True))


def repeats(c: dict) -> bool:
    """A response that writes some line twice."""
    lines = [x for x in c["response"].split("\n") if x.strip()]
    return len(set(lines)) < len(lines)


def distinct_answers(cs: list[dict]) -> float:
    """The mean number of distinct final answers in a step's groups (its completions grouped by
    prompt)."""
    return statistics.mean(
        len({verifier.extract_answer(c["response"]) for c in cs if c["prompt"] == p})
        for p in {c["prompt"] for c in cs})


def distinct_paths(cs: list[dict]) -> float:
    """The mean number of distinct responses in a step's groups, spaces dropped: the paths taken,
    whatever their spacing."""
    return statistics.mean(
        len({c["response"].replace(" ", "") for c in cs if c["prompt"] == p})
        for p in {c["prompt"] for c in cs})


def first(points: Callable[[Run], list[tuple[float, float]]]) -> Callable[[Run], float | None]:
    """Run -> a curve's first point (step 1: the model before training, as far as its rollout)."""
    return lambda run: points(run)[0][1] if points(run) else None


def share(pred: Callable[[dict], bool], among: Callable[[dict], bool] = lambda c: True):
    """completions -> the share of those `among` that `pred` holds for (None if there are none)."""
    return lambda cs: sum(pool) / len(pool) if (pool := [pred(c) for c in cs if among(c)]) else None


def mean_length(among: Callable[[dict], bool]):
    """completions -> the mean length in tokens of those `among` (None if there are none)."""
    return lambda cs: (statistics.mean(pool) if (pool := [c["length"] for c in cs if among(c)])
                       else None)


def informative_groups(run: Run) -> list[tuple[int, float]]:
    """Groups with unequal rewards (a gradient) in what each step trains on: all the groups dynamic
    sampling kept, else the step's groups less its zero-std ones."""
    groups = run.config["prompts_per_step"]
    return [(r["step"], r.get("sampling/groups_kept", groups * (1 - r["reward/frac_zero_std"])))
            for r in run.metrics if "loss" in r]


def equal_budget(run: Run) -> float:
    """The responses a run without dynamic sampling draws in its steps: steps x prompts x G."""
    return run.config["steps"] * run.config["prompts_per_step"] * run.config["group_size"]


def random_reward(response: str, answer: str) -> float:
    """The random-reward control (--reward ablate.experiments:random_reward): 1 or 0 by a fair coin,
    whatever the response. Python's global RNG, which nothing else in a run draws from; run_arms
    (ablate/__main__.py) seeds it per run."""
    return float(random.random() < 0.5)


# ---------------------------------------------------------------------------------------------
# One experiment per fix, in the regime where its problem appears: the fix off vs on, several seeds
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Experiment:
    name: str                     # results/NAME.md and results/NAME.png
    claim: str                    # the article's problem and its fix, in a sentence
    flags: tuple[str, ...]        # train.py flags of every arm: the regime
    arms: tuple[tuple[str, tuple[str, ...]], ...]  # (label, flags); the first: the fix off
    # the table: (name, one value per run[, decimals (default: fmt's)])
    measures: tuple[tuple, ...]
    # the figure: (title, x label, curve[, y label with its unit (default: the title)]); a held-out
    # accuracy panel is added to every figure (figure_panels)
    panels: tuple[tuple, ...]
    habit: habits.Habit | None = None  # the base model: this habit model (None: the shipped one)
    # the held-out greedy accuracy panel (False where --reward is not the verifier: evaluation
    # scores with the run's reward, so a coin's "accuracy" is noise)
    held_out: bool = True
    seeds: int = 3          # seeds per arm, 0 .. seeds - 1 (--seeds gives others, --quick one)

    def model_flags(self) -> tuple[str, ...]:
        """--model and the built-in task's defaults a model folder does not get
        (flags.BUILTIN_DEFAULTS, 40 tokens)."""
        if self.habit is None:
            return ()
        return ("--model", habits.habit_model(self.habit),
                "--lr", str(flags.BUILTIN_DEFAULTS["lr"]), "--max-new-tokens", "40")


def experiment_table(exp: Experiment, runs: dict[str, list[Run]]) -> str:
    """Each measure: mean ± sd over seeds per arm, and each arm's difference from the baseline with
    2 SE."""
    labels = [label for label, _ in exp.arms]
    lines = ["| measure | " + " | ".join(labels) + " | "
             + " | ".join(f"{x} − {labels[0]} (± 2 SE)" for x in labels[1:]) + " |",
             "|" + " --- |" * (2 * len(labels))]
    for name, fn, *digits in exp.measures:
        values = {x: [v for v in map(fn, runs[x]) if v is not None] for x in labels}
        cells = [fmt(v, *digits) for v in values.values()]
        cells += [fmt_difference(values[labels[0]], values[x]) for x in labels[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seeds = {len(v) for v in runs.values()}
    per_arm = "/".join(map(str, sorted(seeds)))
    return "\n".join(lines) + f"\n\nmean ± sd over {per_arm} seeds per arm."


# naive GRPO with DAPO's +-1 rewards (ROWS[0])
NAIVE = ("--algo", "grpo", "--beta", "0", "--wrong-reward", "-1")
SMALL = ("--prompts-per-step", "16", "--steps", "16",
         "--eval-every", "16", "--eval-size", "128",   # held-out: before, after
         "--log-completions", "100000")                # every response trained on


WRONG = lambda c: not right(c)  # noqa: E731
ACCURACY = "accuracy (share right)"
SAMPLED = (("accuracy of the sampled responses", "step", logged("reward/correct"), ACCURACY),)
HELD_OUT_PANEL = ("held-out greedy accuracy", "step", logged("eval/accuracy"),
                  "accuracy (share right, greedy)")
HELD_OUT = (("held-out greedy accuracy at the end", final("eval/accuracy")),)
ENTROPY = (("entropy, last 5 steps", end(logged("entropy"))),
           ("distinct answers per group, last 5 steps", end(by_step(distinct_answers))),
           ("tokens clipped at the upper bound", over_run(logged("clip/high_frac"))))
ENTROPY_PANELS = (("entropy (nats/token)", "step", logged("entropy")),
                  ("distinct answers per group", "step", by_step(distinct_answers)),
                  ("tokens clipped high", "step", logged("clip/high_frac")))
CLIP_ARMS = (("eps_high 0.2", ()), ("eps_high 0.28", ("--eps-high", str(dapo.EPS_HIGH))))
# off-policy updates; a sampling temperature with spread
CLIP_REGIME = ("--mini-batches", "4", "--temperature", "1.5")
# the habit model with several paths per answer: 16 off-policy updates per rollout step, T = 1
PATHS_REGIME = ("--mini-batches", "16", "--temperature", "1.0", "--max-new-tokens", "64")
G4 = ("--group-size", "4")


EXPERIMENTS = (
    Experiment(
        "dynamic-sampling",
        "问题: a group whose answers are all right (or all wrong) has zero advantages and gives no "
        "gradient, and such groups grow as accuracy rises. DAPO 修正: resample until every group "
        "in the batch is mixed (Eq. 11).",
        NAIVE + SMALL + G4, (("off", ()), ("on: dynamic sampling", ("--dynamic-sampling",))),
        (("sampled groups all right or all wrong, last 5 steps",
          end(logged("reward/frac_zero_std"))),
         ("groups with a gradient per update (of 16)", over_run(informative_groups)),
         ("accuracy of the sampled responses, last 5 updates", end(logged("reward/correct"))),
         ("accuracy of the sampled responses at 16 x 16 x 4 = 1,024 responses",
          at_samples(lambda r: curve(r.metrics, "reward/correct"), equal_budget)),
         ("responses sampled in 16 updates", final("samples")),
         ("held-out greedy accuracy after 16 updates", final("eval/accuracy"))),
        (("sampled groups all right / all wrong", "step", logged("reward/frac_zero_std"),
          "share of the step's groups"),
         ("groups with a gradient per update", "step", informative_groups, "groups (of 16)"),
         ("sampled accuracy per update", "optimizer update", logged("reward/correct"), ACCURACY),
         ("sampled accuracy per sampled response", "responses sampled",
          lambda r: curve(r.metrics, "reward/correct"), ACCURACY))),
    Experiment(
        "overlong-shaping",
        "问题: a truncated response gets the reward of a wrong one, though its reasoning may be "
        "sound, which confuses training. DAPO 修正: mask truncated responses out of the loss "
        "(overlong filtering), and punish length softly over the last L_cache tokens (Eq. 13).",
        NAIVE + SMALL + G4 + ("--max-new-tokens", "40"),
        (("hard: truncated = wrong", ()), ("filter", ("--overlong-filter",)),
         ("filter + soft penalty", ("--overlong-filter", "--overlong-penalty")),
         # the article's soft punishment alone: truncated responses stay in the loss
         ("soft penalty alone", ("--overlong-penalty",))),
        (("truncated responses, last 5 steps", end(logged("len/truncated_frac"))),
         ("truncated on the way to a right answer, share of the truncated",
          over_run(by_step(share(on_the_way, lambda c: c["truncated"])))),
         ("accuracy of the sampled responses, last 5 steps", end(logged("reward/correct"))),
         *HELD_OUT),
        (("truncated responses", "step", logged("len/truncated_frac"),
          "share of sampled responses"),
         ("truncated on the way to a right answer", "step",
          by_step(share(on_the_way, lambda c: c["truncated"])), "share of the truncated"),
         *SAMPLED)),
    Experiment(
        "token-level-loss",
        "问题: the per-response mean gives each token of a long response less weight, so long "
        "wrong responses (rambling, repetition) are pushed down less. DAPO 修正: average over all "
        "tokens of the batch (Eq. 12).",
        NAIVE + SMALL + G4 + ("--max-new-tokens", "96"),
        (("sequence", ()), ("token", ("--reduction", "token"))),
        (("length of wrong responses, last 5 steps", end(by_step(mean_length(WRONG)))),
         ("wrong responses that repeat a line, last 5 steps", end(by_step(share(repeats, WRONG)))),
         ("length of right responses, last 5 steps", end(by_step(mean_length(right)))),
         ("length of all responses, last 5 steps", end(logged("len/mean"))), *HELD_OUT),
        (("length of wrong responses", "step", by_step(mean_length(WRONG))),
         ("wrong responses that repeat a line", "step", by_step(share(repeats, WRONG))),
         ("length of right responses", "step", by_step(mean_length(right))), *SAMPLED),
        # the shipped model's wrong answers are all ~15-token shortcuts: nothing to dilute
        habits.STUTTER),
    Experiment(
        "clip-higher",
        "问题: with symmetric clipping a low-probability token's ratio is capped at 1 + eps early, "
        "so exploration dies: entropy collapses. DAPO 修正: decouple the bounds and raise the "
        "upper one (eps_high 0.28, Eq. 10).",
        NAIVE + SMALL + CLIP_REGIME, CLIP_ARMS, ENTROPY + HELD_OUT, ENTROPY_PANELS + SAMPLED),
    Experiment(
        "clip-higher-random-reward",
        "The control: a fair coin for reward leaves nothing to learn, and symmetric clipping alone "
        "is published to lower entropy (arXiv 2509.26114); clip-higher should lower it less.",
        NAIVE + SMALL + CLIP_REGIME + ("--reward", "ablate.experiments:random_reward"), CLIP_ARMS,
        ENTROPY, ENTROPY_PANELS, held_out=False),
    Experiment(
        "clip-higher-paths",
        "问题 as clip-higher's, on a policy with entropy to lose: a habit model that writes each "
        "answer along one of several equally valid paths (~0.3 nats/token at T = 1), 16 "
        "off-policy updates per rollout step, where symmetric clipping should bite.",
        NAIVE + SMALL + PATHS_REGIME, CLIP_ARMS,
        (("entropy at step 1", first(logged("entropy"))), *ENTROPY[:2],
         ("distinct paths per group (spaces dropped), last 5 steps", end(by_step(distinct_paths))),
         ENTROPY[2], ("tokens clipped at the lower bound", over_run(logged("clip/low_frac"))),
         ("accuracy of the sampled responses, last 5 steps", end(logged("reward/correct"))),
         *HELD_OUT),
        ENTROPY_PANELS + (("distinct paths per group", "step", by_step(distinct_paths)),
                          *SAMPLED),
        # 3 seeds left the gap (+0.06 nats/token) within a spread as wide: 12 halve the SE
        habits.PATHS, seeds=12),
)


# The two built-in default runs (`python -m ablate --defaults`): not a fix but the whole of each
DEFAULTS = Experiment(
    "default-dapo-vs-grpo",
    "The built-in default runs of each algorithm, `train.py --algo grpo` and `--algo dapo`, "
    "both at 40 steps (GRPO's default; DAPO's is 30, the first 30 of these) of 32 prompts x 8 on "
    "the shipped base model (DAPO's dynamic sampling draws more responses per step), nothing else "
    "changed; and `--algo dapo` with 4 optimizer updates per rollout step (`--mini-batches 4`), "
    "where clip-higher can act.",
    ("--steps", "40"), (("grpo", ("--algo", "grpo")), ("dapo", ("--algo", "dapo")),
         # DAPO's several updates per rollout step: from the second on the ratio leaves 1 and
         # clip-higher can act (with one update it cannot, by construction)
         ("dapo, 4 mini-batches", ("--algo", "dapo", "--mini-batches", "4"))),
    (("held-out greedy accuracy before", lambda r: logged("eval/accuracy")(r)[0][1]),
     ("held-out greedy accuracy at step 20", lambda r: dict(logged("eval/accuracy")(r)).get(20)),
     ("held-out greedy accuracy at the end", final("eval/accuracy")),
     ("accuracy of the sampled responses, last 5 steps", end(logged("reward/correct"))),
     ("entropy (nats/token), last 5 steps", end(logged("entropy")), 4),
     ("length of the sampled responses (tokens), last 5 steps", end(logged("len/mean"))),
     ("truncated responses, last 5 steps", end(logged("len/truncated_frac"))),
     ("responses sampled", final("samples")),
     ("tokens clipped at the upper bound", over_run(logged("clip/high_frac")), 4),
     ("training time (s, the steps' time/step_s summed)",
      lambda r: sum(v for _, v in logged("time/step_s")(r)), 0)),
    (("accuracy of the sampled responses", "responses sampled",
      lambda r: curve(r.metrics, "reward/correct"), ACCURACY),
     *((title, "responses sampled", lambda r, k=key: curve(r.metrics, k), ylabel)
       for key, title, ylabel in CURVES[1:])))


def figure_panels(exp: Experiment, runs: dict[str, list[Run]]) -> list[tuple]:
    """An experiment's figure: its panels, each {arm: one curve per seed}, then (exp.held_out) the
    held-out greedy accuracy at each evaluation (the experiments' runs evaluate before and after:
    two points)."""
    return [(title, x, {label: [points(r) for r in rs] for label, rs in runs.items()}, *ylabel)
            for title, x, points, *ylabel in (*exp.panels, *[HELD_OUT_PANEL] * exp.held_out)]
