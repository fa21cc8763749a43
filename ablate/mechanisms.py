"""Pictures of the mechanisms, not training curves: the clipped surrogate, the overlong ramp, the
three loss reductions and zero-advantage groups, each computed by the functions train.py runs.

Article sections: "Step 4: PPO Loss 计算" (panel 1, the clipped surrogate) and "DAPO：四项修正":
Clip-Higher (panel 1, eps_low 0.2 and eps_high 0.28 beside GRPO's symmetric 0.2), Overlong Reward
Shaping (panel 2, Eq. 13's soft punishment), Token-Level Loss (panel 3, each token's weight under
GRPO's, DAPO's and Dr. GRPO's reductions) and Dynamic Sampling (panel 4, the share of groups all
right or all wrong, whose advantages are zero, against the group's accuracy; and as measured).

The numbers come from grpo.clipped_surrogate and the gradient of grpo.ppo_loss,
dapo.overlong_penalty at train.py's defaults, grpo.token_weights, and grpo.constant_groups
(= ~dapo.keep_groups) on sampled rewards; the clip ranges and lengths are the ones train.py
resolves (harness/flags.py, parse_train_args). Writes RESULTS/mechanisms.png (needs matplotlib) and
RESULTS/mechanisms.md (a caption per panel and the key numbers, a table tests/test_mechanisms.py
checks against these functions). Panel 4's measured points are read from
RESULTS/mechanisms-measured.jsonl; --measure makes them anew (12 GRPO steps of train.py at G = 4
and at G = 8: 1.6 and 5.3 minutes on 2 busy CPU cores). Run from the repo root:

    python -m ablate.mechanisms                   # figure and table, from the committed data
    python -m ablate.mechanisms --measure         # first rerun the measured runs (G = 4, 8)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import textwrap

import torch

import dapo
import grpo
from harness import checkpoint
from harness.flags import parse_train_args

F64 = torch.float64
PAPER_OVERLONG = (20480, 4096)  # DAPO Sec. 5: L_max 20480 = 16384 expected + a 4096-token cache
LENGTHS = (5, 40)               # panel 3: one batch of G = 2 responses, a short and a long one
GROUP_SIZES = (4, 8, 16)        # panel 4's curves
MEASURED_SIZES = (4, 8)         # and its measured runs (--measure)
MEASURE_FLAGS = ["--algo", "grpo", "--steps", "12", "--eval-every", "12", "--eval-size", "32"]
MEASURED = "mechanisms-measured.jsonl"
MC_GROUPS = 20000               # panel 4: groups sampled per Monte-Carlo point


def clip_ranges() -> dict[str, tuple[float, float]]:
    """(eps_low, eps_high) of train.py --algo grpo and --algo dapo, as train.py resolves them."""
    return {algo: (a.eps_low, a.eps_high)
            for algo in ("grpo", "dapo") for a in [parse_train_args(["--algo", algo])]}


def overlong_defaults() -> tuple[int, int]:
    """(L_max, L_cache) of train.py --algo dapo on the built-in task: --max-new-tokens and
    --overlong-cache as resolved (40, 40 // 5)."""
    a = parse_train_args(["--algo", "dapo"])
    return a.max_new_tokens, a.overlong_cache


# ---- panel 1: the clipped surrogate per token (Step 4; Clip-Higher) ----

def clip_curve(rhos: list[float], adv: float, eps_low: float, eps_high: float) -> dict:
    """Per-token loss -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) at each ratio rho
    (grpo.clipped_surrogate) and its gradient d loss / d log pi (autograd through grpo.ppo_loss,
    one response of one token per rho, weight 1): {"rho", "loss", "grad"}, lists of floats."""
    rho = torch.tensor(rhos, dtype=F64)[:, None]                            # [N, 1]
    adv_t = torch.full((len(rhos),), float(adv), dtype=F64)                 # [N]
    ones = torch.ones_like(rho)                                             # [N, 1] mask = weights
    logp = rho.log().requires_grad_()                                       # [N, 1], old_logp = 0
    loss, _ = grpo.ppo_loss(logp, torch.zeros_like(rho), adv_t, ones, ones, eps_low, eps_high)
    loss.backward()
    per_token = grpo.clipped_surrogate(rho, adv_t[:, None], eps_low, eps_high)[0]  # [N, 1]
    return {"rho": list(rhos), "loss": per_token[:, 0].tolist(), "grad": logp.grad[:, 0].tolist()}


# ---- panel 2: Eq. 13's soft overlong punishment (Overlong Reward Shaping) ----

def overlong_ramp(lengths: list[int], max_len: int, cache: int) -> list[float]:
    """dapo.overlong_penalty at each response length: 0, then a ramp to -1 over the last `cache`
    tokens before max_len."""
    return dapo.overlong_penalty(torch.tensor(lengths), max_len, cache).tolist()


# ---- panel 3: each token's weight under the three reductions (Token-Level Loss) ----

def reduction_weights(lengths: tuple[int, ...] = LENGTHS) -> dict[str, list[list[float]]]:
    """grpo.token_weights of one batch of responses of these lengths (T = the longest), for each
    reduction: {reduction: per response, the weight of each of its valid tokens}."""
    lens = torch.tensor(lengths)                                            # [N]
    mask = (torch.arange(int(lens.max()))[None] < lens[:, None]).to(F64)    # [N, T]
    return {r: [row[:n].tolist() for row, n in zip(grpo.token_weights(mask, r), lengths)]
            for r in grpo.REDUCTIONS}


# ---- panel 4: zero-advantage groups against accuracy (Dynamic Sampling) ----

def zero_share(p: float, G: int) -> float:
    """The chance that G independent answers, each right with probability p, are all right or all
    wrong (a group with zero advantages): p^G + (1 - p)^G."""
    return p ** G + (1.0 - p) ** G


def zero_share_sampled(p: float, G: int, groups: int = MC_GROUPS,
                       seed: int = 0) -> tuple[float, float]:
    """The same share counted by the trainer's code: `groups` groups of G Bernoulli(p) answers
    through grpo.constant_groups (= ~dapo.keep_groups, checked): (share, its standard error)."""
    gen = torch.Generator().manual_seed(seed)
    correct = (torch.rand(groups, G, generator=gen, dtype=F64) < p).to(F64)  # [groups, G]
    constant = grpo.constant_groups(correct)                                  # [groups]
    if not torch.equal(constant, ~dapo.keep_groups(correct)):
        raise AssertionError("grpo.constant_groups is not ~dapo.keep_groups")
    share = float(constant.to(F64).mean())
    return share, math.sqrt(max(share * (1.0 - share), 1.0 / groups) / groups)


def read_measured(path: str) -> list[dict]:
    """The committed measured points: one row per training step of a GRPO run, {"group_size",
    "step", "groups" (per step), "reward/correct", "reward/frac_zero_std"}."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def collect(folders: list[str]) -> list[dict]:
    """The measured rows from finished train.py runs (OUT/config.json, OUT/metrics.jsonl)."""
    rows = []
    for out in folders:
        with open(os.path.join(out, "config.json")) as fh:
            config = json.load(fh)
        with open(os.path.join(out, "metrics.jsonl")) as fh:
            metrics = [json.loads(line) for line in fh if line.strip()]
        rows += [{"group_size": config["group_size"], "step": m["step"],
                  "groups": config["prompts_per_step"], "reward/correct": m["reward/correct"],
                  "reward/frac_zero_std": m["reward/frac_zero_std"]}
                 for m in metrics if "reward/frac_zero_std" in m]
    return rows


def measured_summary(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per group size: steps, mean accuracy, mean measured share, mean p^G + (1 - p)^G at each
    step's accuracy, and how many steps lie above that curve."""
    out = {}
    for G in sorted({r["group_size"] for r in rows}):
        rs = [r for r in rows if r["group_size"] == G]
        curve = [zero_share(r["reward/correct"], G) for r in rs]
        out[G] = {"steps": len(rs),
                  "accuracy": statistics.mean(r["reward/correct"] for r in rs),
                  "measured": statistics.mean(r["reward/frac_zero_std"] for r in rs),
                  "curve": statistics.mean(curve),
                  "above": sum(r["reward/frac_zero_std"] > c for r, c in zip(rs, curve))}
    return out


# ---- the key numbers, the table and captions ----

def key_numbers(measured: list[dict]) -> list[tuple[str, str, float]]:
    """(panel, quantity, value) rows of RESULTS/mechanisms.md's table, each from the functions above
    (tests/test_mechanisms.py checks the table against them)."""
    rng = clip_ranges()
    (g_low, g_high), (d_low, d_high) = rng["grpo"], rng["dapo"]
    sym = clip_curve([1.25], 1.0, g_low, g_high)
    dap = clip_curve([1.25], 1.0, d_low, d_high)
    neg = clip_curve([0.7, 1.25], -1.0, d_low, d_high)
    L, C = overlong_defaults()
    PL, PC = PAPER_OVERLONG
    p1, p2, p3, p4 = ("1 clip", "2 overlong", "3 reduction", "4 zero-adv")
    rows = [
        (p1, f"loss at rho 1.25, A = +1, eps {g_low}/{g_high} (clipped)", sym["loss"][0]),
        (p1, f"its gradient d loss / d log pi, eps {g_low}/{g_high}", sym["grad"][0]),
        (p1, f"loss at rho 1.25, A = +1, eps {d_low}/{d_high}", dap["loss"][0]),
        (p1, f"its gradient d loss / d log pi, eps {d_low}/{d_high}", dap["grad"][0]),
        (p1, f"loss at rho 0.7, A = -1, eps_low {d_low} (clipped)", neg["loss"][0]),
        (p1, "its gradient", neg["grad"][0]),
        (p1, "loss at rho 1.25, A = -1 (never clipped above)", neg["loss"][1]),
        (p1, "its gradient", neg["grad"][1]),
        (p2, f"train.py's L_max (--max-new-tokens), L_max = {L}", L),
        (p2, f"train.py's L_cache (--overlong-cache), L_cache = {C}", C),
        (p2, f"penalty at L_max - L_cache = {L - C}", overlong_ramp([L - C], L, C)[0]),
        (p2, f"penalty at L_max - L_cache / 2 = {L - C / 2:g}",
         overlong_ramp([L - C / 2], L, C)[0]),
        (p2, f"penalty at L_max = {L}", overlong_ramp([L], L, C)[0]),
        (p2, f"paper ({PL}, {PC}): penalty at {PL - PC // 2}",
         overlong_ramp([PL - PC // 2], PL, PC)[0]),
        (p2, "L_cache / L_max, train.py", C / L),
        (p2, "L_cache / L_max, paper", PC / PL),
    ]
    names = {"sequence": "sequence (GRPO)", "token": "token (DAPO Eq. 12)",
             "constant": "constant (Dr. GRPO)"}
    for r, per in reduction_weights().items():
        for n, ws in zip(LENGTHS, per):
            rows.append((p3, f"{names[r]}: weight of a token of the {n}-token response", ws[0]))
            rows.append((p3, f"{names[r]}: the {n}-token response's total weight", sum(ws)))
    for p in (0.5, 0.75):
        rows += [(p4, f"p^G + (1 - p)^G at p = {p}, G = {G}", zero_share(p, G))
                 for G in GROUP_SIZES]
    share, se = zero_share_sampled(0.5, 4)
    rows += [(p4, f"grpo.constant_groups on {MC_GROUPS} Bernoulli(0.5) groups of 4, seed 0", share),
             (p4, "its standard error", se)]
    for G, s in measured_summary(measured).items():
        m = f"measured G = {G}:"
        rows += [(p4, f"{m} mean reward/correct over {s['steps']} steps", s["accuracy"]),
                 (p4, f"{m} mean reward/frac_zero_std", s["measured"]),
                 (p4, f"{m} mean p^G + (1 - p)^G at each step's accuracy", s["curve"]),
                 (p4, f"{m} steps above the curve (of {s['steps']})", s["above"])]
    return rows


def table(rows: list[tuple[str, str, float]]) -> str:
    """The key numbers as a markdown table, 4 significant digits."""
    return "\n".join(["| panel | quantity | value |", "|---|---|---|",
                      *(f"| {p} | {q} | {v + 0.0:.4g} |" for p, q, v in rows)])  # no -0


def captions(measured: list[dict]) -> list[str]:
    """One caption per panel, its numbers from the functions above."""
    (g_low, g_high), (d_low, d_high) = clip_ranges().values()
    sym, dap = clip_curve([1.25], 1.0, g_low, g_high), clip_curve([1.25], 1.0, d_low, d_high)
    neg = clip_curve([0.7], -1.0, d_low, d_high)
    L, C = overlong_defaults()
    PL, PC = PAPER_OVERLONG
    w = reduction_weights()
    (short, long_), total = LENGTHS, sum(LENGTHS)
    summary = measured_summary(measured)
    each = "; ".join(
        f"G = {G}: mean accuracy {s['accuracy']:.3f}, measured share {s['measured']:.3f} vs "
        f"{s['curve']:.3f} on the curve at each step's accuracy, {s['above']} of {s['steps']} "
        f"steps above it" for G, s in summary.items())
    above = bool(summary) and all(s["measured"] > s["curve"] for s in summary.values())
    verdict = ("lies above the curve on average" if above else
               "does not lie above the curve on average for every G")
    why = ("Accuracy that varies across prompts predicts this: p^G + (1 - p)^G is convex, so its "
           "mean over the prompts is at least its value at their mean accuracy (Jensen); these "
           "runs log no per-prompt accuracy, so that it is the whole reason is not checked here."
           if above else "Jensen's inequality (accuracy varying across prompts) would put it "
           "above: here the noise of a short run wins for some G.")
    groups = measured[0]["groups"] if measured else "-"
    se = f"{math.sqrt(0.25 / groups):.2f}" if measured else "-"  # at a share of 0.5
    return [
        f"**Clipped surrogate (Step 4; Clip-Higher).** `grpo.clipped_surrogate`, the per-token "
        f"loss -min(rho A, clip(rho) A), and its gradient through `grpo.ppo_loss` (shaded: zero). "
        f"For A > 0 the loss stops falling at 1 + eps_high: GRPO's eps {g_high} gives "
        f"{sym['loss'][0]:.2f} at rho 1.25 with gradient {sym['grad'][0]:.0f}, DAPO's eps_high "
        f"{d_high} still {dap['loss'][0]:.2f} with gradient {dap['grad'][0]:.2f}, so a token whose "
        f"probability rose by 25% can rise further. For A < 0 both clip at 1 - eps_low = "
        f"{1 - d_low:.1f} (loss {neg['loss'][0]:.1f}, gradient {neg['grad'][0]:.0f} below it) and "
        f"never above: eps_high changes nothing for A < 0.",
        f"**Soft overlong punishment (Eq. 13; Overlong Reward Shaping).** `dapo.overlong_penalty` "
        f"at train.py's defaults, --max-new-tokens {L} and --overlong-cache {C}: 0 up to "
        f"L_max - L_cache = {L - C}, then a straight ramp to -1 at L_max = {L} "
        f"({overlong_ramp([L - C / 2], L, C)[0]:.1f} at {L - C / 2:g}). The paper's {PL} / {PC} "
        f"(top axis, scaled so that L_max lines up) has the same shape: L_cache / L_max is "
        f"{C / L:g} here and {PC / PL:g} there. "
        f"No response passes L_max: sampling stops there.",
        f"**Token weights (Token-Level Loss).** `grpo.token_weights` for one batch of a "
        f"{short}- and a {long_}-token response (G = 2). \"sequence\" (GRPO) gives each response "
        f"half the loss, so a token of the long one weighs 1/(2 x {long_}) = "
        f"{w['sequence'][1][0]:.4f} against {w['sequence'][0][0]:.4f} for the short one's; "
        f"\"token\" (DAPO) gives every token 1/{total} = {w['token'][0][0]:.4f}, so the long "
        f"response carries {sum(w['token'][1]):.3f} of the loss; \"constant\" (Dr. GRPO) "
        f"1/(G x T) = {w['constant'][0][0]:.4f} each (the weights sum to "
        f"{sum(map(sum, w['constant'])):.4f}, not 1).",
        f"**Zero-advantage groups (Dynamic Sampling).** G answers, each right with chance p, are "
        f"all right or all wrong with chance p^G + (1 - p)^G (lines); `grpo.constant_groups` on "
        f"sampled Bernoulli rewards lands on it (open squares, {MC_GROUPS} groups each). Such a "
        f"group has zero advantages and no gradient: {zero_share(0.5, 4):.3f} of groups at "
        f"p = 0.5, G = 4, many more as accuracy leaves 0.5 or G shrinks. The measured share of "
        f"real runs (dots; x: the step's `reward/correct`, y: its `reward/frac_zero_std`) "
        f"{verdict}: {each}. {why} One step counts {groups} groups, so a single dot is noisy "
        f"(standard error up to {se}); the means over steps are what to read.",
    ]


def markdown(measured: list[dict], results: str) -> str:
    """RESULTS/mechanisms.md: the commands, a caption per panel, the table."""
    sizes = ", ".join(str(G) for G in sorted({r["group_size"] for r in measured})) or "none yet"
    groups = measured[0]["groups"] if measured else "-"
    panels = "\n".join(textwrap.fill(c, 100, initial_indent=f"{i}. ", subsequent_indent="   ",
                                      break_on_hyphens=False)
                        for i, c in enumerate(captions(measured), 1))
    return f"""# The mechanisms, drawn from the project's own functions

![mechanisms](mechanisms.png)

`python -m ablate.mechanisms --results {results}` draws the figure and writes this page from
grpo.py, dapo.py and train.py's defaults, reading panel 4's measured points from
`{MEASURED}`. Those were made by `python -m ablate.mechanisms --measure`, which runs, for
G = {sizes} (the built-in task and model, GRPO, seed 0, {groups} groups per step),

    python train.py {' '.join(MEASURE_FLAGS)} --group-size $G --out runs/mech-G$G

and copies each step's `reward/correct` and `reward/frac_zero_std` from its metrics.jsonl.
tests/test_mechanisms.py checks the table below against the functions.

{panels}

{table(key_numbers(measured))}
"""


# ---- the figure ----

def _pyplot():
    """matplotlib.pyplot drawing to files, or None (with a line saying so) where it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
        return None
    return plt


def _style(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def draw_clip(ax) -> None:
    rng = clip_ranges()
    rhos = [0.5 + 0.005 * i for i in range(221)]                            # 0.5 .. 1.6
    for adv, color in ((1.0, "C0"), (-1.0, "C3")):
        for algo, style in (("dapo", "-"), ("grpo", "--")):
            lo, hi = rng[algo]
            c = clip_curve(rhos, adv, lo, hi)
            ax.plot(c["rho"], c["loss"], style, color=color, lw=1.5,
                    label=f"A = {adv:+.0f}, eps_low {lo}, eps_high {hi} ({algo})")
            flat = [v if g == 0.0 else math.nan for v, g in zip(c["loss"], c["grad"])]
            ax.plot(c["rho"], flat, color=color, lw=7, alpha=0.18, solid_capstyle="butt")
    ax.plot([], [], color="grey", lw=7, alpha=0.3, label="gradient 0 (clipped)")
    lo, hi = rng["dapo"]
    for x, text, style in ((1 - lo, f"1 - eps_low = {1 - lo:.2f}", ":"),
                           (1 + rng["grpo"][1], f"1 + eps = {1 + rng['grpo'][1]:.2f}", "--"),
                           (1 + hi, f"1 + eps_high = {1 + hi:.2f}", "-")):
        ax.axvline(x, color="black", lw=0.8, ls=style)
        ax.text(x - 0.005, 0.3, text, rotation=90, fontsize=6.5, ha="right", va="center")
    at = [clip_curve([1.25], 1.0, *rng[a]) for a in ("grpo", "dapo")]
    ax.plot([1.25, 1.25], [c["loss"][0] for c in at], "k.", ms=5)
    ax.text(1.3, -0.55, f"rho 1.25, A = +1:\nGRPO {at[0]['loss'][0]:.2f}, gradient "
            f"{at[0]['grad'][0] + 0.0:.0f}\nDAPO {at[1]['loss'][0]:.2f}, gradient "
            f"{at[1]['grad'][0]:.2f}", fontsize=6.5, va="center")
    ax.set_ylim(-1.7, 2.9)
    _style(ax, "Step 4 / Clip-Higher: grpo.clipped_surrogate per token",
           "ratio rho = pi_theta / pi_old (unitless)",
           "per-token loss -min(rho A, clip(rho) A) (units of A)")
    ax.legend(fontsize=6.5, loc="upper left")


def draw_overlong(ax) -> None:
    L, C = overlong_defaults()
    PL, PC = PAPER_OVERLONG
    lens = list(range(L + 1))
    ax.plot(lens, overlong_ramp(lens, L, C), "o-", color="C0", ms=3,
            label=f"train.py defaults: L_max {L}, L_cache {C} (bottom axis)")
    top = ax.twiny()
    plens = list(range(0, PL + 1, 64))
    top.plot(plens, overlong_ramp(plens, PL, PC), "--", color="C1", lw=1.5,
             label=f"DAPO paper: L_max {PL}, L_cache {PC} (top axis)")
    top.set_xlim(-0.02 * PL, 1.05 * PL)
    ax.set_xlim(-0.02 * L, 1.05 * L)
    top.set_xlabel("paper's response length (tokens)", fontsize=8)
    top.tick_params(labelsize=7)
    for x, text in ((L - C, f"L_max - L_cache = {L - C} | {PL - PC}"), (L, f"L_max = {L} | {PL}")):
        ax.axvline(x, color="black", lw=0.8, ls=":")
        ax.text(x, -0.35, text, rotation=90, fontsize=6.5, ha="right", va="center")
    ax.text(0.5, -0.45, f"same shape: L_cache / L_max = {C / L:g} (train.py) and "
            f"{PC / PL:g} (paper)", fontsize=6.5)
    ax.set_ylim(-1.1, 0.1)
    _style(ax, "Overlong Reward Shaping: dapo.overlong_penalty (Eq. 13)",
           "response length (tokens)", "reward added (a right answer scores +1)")
    handles = [h for a in (ax, top) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=6.5, loc="lower left")


def draw_weights(ax) -> None:
    w = reduction_weights()
    names = {"sequence": "sequence\n(GRPO)", "token": "token\n(DAPO Eq. 12)",
             "constant": "constant\n(Dr. GRPO)"}
    width = 0.36
    for i, (n, color) in enumerate(zip(LENGTHS, ("C2", "C4"))):
        xs = [j + (i - 0.5) * (width + 0.04) for j in range(len(w))]
        ys = [per[i][0] for per in w.values()]
        bars = ax.bar(xs, ys, width, color=color, label=f"a token of the {n}-token response")
        for bar, per in zip(bars, w.values()):
            ax.text(bar.get_x() + width / 2, bar.get_height(),
                    f"{per[i][0]:.4f}\nx{n} = {sum(per[i]):.3f}", ha="center", va="bottom",
                    fontsize=6.5)
    ax.set_xticks(range(len(w)), [names[r] for r in w], fontsize=7)
    ax.set_ylim(0, 0.135)
    _style(ax, f"Token-Level Loss: grpo.token_weights, G = 2 responses of {LENGTHS[0]} and "
               f"{LENGTHS[1]} tokens", "reduction (--reduction)",
           "weight per token (share of the loss sum)")
    ax.set_xlabel("reduction (--reduction); label: per-token weight x tokens = response total",
                  fontsize=8)
    ax.legend(fontsize=6.5, loc="upper right")


def draw_zero(ax, measured: list[dict]) -> None:
    ps = [i / 100 for i in range(101)]
    for G, color in zip(GROUP_SIZES, ("C0", "C1", "C2")):
        ax.plot(ps, [zero_share(p, G) for p in ps], color=color, lw=1.5,
                label=f"G = {G}: p^G + (1 - p)^G")
        mc = [zero_share_sampled(p, G, seed=G)[0] for p in (0.1, 0.3, 0.5, 0.7, 0.9)]
        ax.plot((0.1, 0.3, 0.5, 0.7, 0.9), mc, "s", mfc="none", color=color, ms=5)
        rs = [r for r in measured if r["group_size"] == G]
        if rs:
            ax.plot([r["reward/correct"] for r in rs], [r["reward/frac_zero_std"] for r in rs],
                    "o", color=color, ms=5, mec="black", mew=0.6,
                    label=f"G = {G}: measured, one dot per step")
    ax.plot([], [], "s", mfc="none", color="grey",
            label=f"grpo.constant_groups, {MC_GROUPS} groups")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.3)
    _style(ax, "Dynamic Sampling: groups all right or all wrong (zero advantage)",
           "accuracy p (share of right answers; measured: the step's reward/correct)",
           "share of groups with zero advantage")
    ax.legend(fontsize=6.5, loc="upper center", ncol=2)


def figure(measured: list[dict]):
    """The four panels as a matplotlib Figure, or None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.6), layout="constrained")
    draw_clip(axes[0, 0])
    draw_overlong(axes[0, 1])
    draw_weights(axes[1, 0])
    draw_zero(axes[1, 1], measured)
    fig.suptitle("python -m ablate.mechanisms: the loss of Step 4 and DAPO's four fixes, "
                 "computed by grpo.py and dapo.py", fontsize=10)
    return fig


def plot(measured: list[dict], path: str) -> bool:
    """Draw the figure to `path`; False without matplotlib."""
    fig = figure(measured)
    if fig is None:
        return False
    with checkpoint.atomic(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    _pyplot().close(fig)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ablate.mechanisms",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results", help="where the figure, table and data go")
    p.add_argument("--measure", action="store_true",
                   help=f"first rerun the measured GRPO runs (G = {MEASURED_SIZES}) and rewrite "
                        f"RESULTS/{MEASURED}")
    p.add_argument("--runs", default="runs", help="--measure: the runs' folder (RUNS/mech-G$G)")
    a = p.parse_args(argv)
    os.makedirs(a.results, exist_ok=True)
    data = os.path.join(a.results, MEASURED)
    if a.measure:
        import train  # here: drawing needs no trainer
        folders = [os.path.join(a.runs, f"mech-G{G}") for G in MEASURED_SIZES]
        for G, out in zip(MEASURED_SIZES, folders):
            if os.path.exists(os.path.join(out, "final", "config.json")):
                continue  # a finished run is kept, as python -m ablate does
            train.main([*MEASURE_FLAGS, "--out", out, "--group-size", str(G)])
        with open(data, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in collect(folders))
    measured = read_measured(data) if os.path.exists(data) else []
    with open(os.path.join(a.results, "mechanisms.md"), "w") as fh:
        fh.write(markdown(measured, a.results))
    print(f"table: {os.path.join(a.results, 'mechanisms.md')}")
    if plot(measured, os.path.join(a.results, "mechanisms.png")):
        print(f"figure: {os.path.join(a.results, 'mechanisms.png')}")


if __name__ == "__main__":
    main()
