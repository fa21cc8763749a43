"""Habits: base models for the experiments whose problem the shipped base model is too tidy to show,
each a short supervised fine-tune of harness/builtin.py's base model on its own kind of
demonstrations
with one habit added (`Habit`): a stutter (lines written again, `stuttered`), or several equally
valid paths to each answer (`path_solution`).

Article section: "DAPO：四项修正", token-level loss (问题: long wrong responses, rambling and
repetition, are diluted by the per-response mean): the shipped model's wrong answers are all short
shortcuts (STUTTER); clip-higher (问题: entropy collapses): the shipped model writes one path to
each answer, with ~0.05 nats/token of entropy at T = 1, so there is little to collapse (PATHS).

A habit model is keyed by `habit_key`: the base recipe's key, the Habit's fields and the code a
build runs here (HABIT_ROOTS, canonical as builtin.recipe_code makes it). This code is outside the
base recipe, so editing it leaves the base model's key and the shipped weights as they are. Builds
differ slightly from one CPU to another, so the experiments' habits (SHIPPED_HABITS) ship their
weights as base_model/ does: ablate/habit_models/NAME/ with recipe.json, whose key is the habit_key
that built them. `habit_model` returns a shipped folder whose key matches, else builds into
harness/builtin.py's cache on first use (seconds); a test fails while a shipped key is stale.

    python -m ablate.habits          # find (shipped or cached) or build each shipped habit
    python -m ablate.habits --ship   # build if needed and write them to ablate/habit_models/
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

import torch

from harness.builtin import (
    CACHE_DIR,
    BaseModelConfig,
    base_model,
    demonstration,
    is_heldout,
    make_problem,
    prompt_text,
    recipe_code,
    recipe_key,
    shipped_key,
    shortcut_steps,
    write_shipped,
)
from harness.builtin import (
    signed as _signed,
)
from harness.builtin import (
    split_linear as _split_linear,
)


@dataclass(frozen=True)
class Habit:
    """A short supervised fine-tune of the base model on its own kind of demonstrations with one
    habit added, for an experiment whose problem the base model is too tidy to show."""
    stutter: float = 0.3       # chance a line (careful or shortcut) is written again, 1-3 times
    paths: bool = False        # careful solutions along one of several valid paths (path_solution)
    steps: int = 60            # supervised steps, each on fresh demonstrations
    batch_size: int = 32       # demonstrations per step
    lr: float = 1e-3           # AdamW learning rate, constant
    seed: int = 0              # seeds the demonstrations


HABIT_ROOTS = ("habit_demos", "fine_tune")  # what a habit's build runs on top of the base model
SHIPPED = BaseModelConfig()  # the settings of the shipped base model, the habits' default base
SHIP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "habit_models")
STUTTER = Habit()  # the token-level loss experiment's
# the clip-higher-paths experiment's: no stutter; 10x the steps at half the rate (of 300 x 1e-3,
# 600 x 1e-3, 600 x 5e-4: the most entropy, 0.32 nats/token at T = 1, and the most accuracy)
PATHS = Habit(stutter=0.0, paths=True, steps=600, lr=5e-4)
SHIPPED_HABITS = {"stutter": STUTTER, "paths": PATHS}  # SHIP_DIR/NAME


def stuttered(solution: str, rng: random.Random, p: float) -> str:
    """solution with each line but the answer written again 1-3 more times with chance p (a solver
    that loses its place): the length of a response, right or wrong, no longer follows from its
    method."""
    *steps, answer = solution.split("\n")
    out = []
    for line in steps:
        out += [line] * (1 + (rng.randint(1, 3) if rng.random() < p else 0))
    return "\n".join(out + [answer])


def _xs(k: int) -> str:
    """'3x', 'x' or '-x': the term k*x."""
    return {1: "x", -1: "-x"}.get(k, f"{k}x")


def spaced(line: str, rng: random.Random) -> str:
    """line with each '=' and each operator between two terms (+, -, /) written with a space on
    either side or without, at random: the same line in another hand."""
    out = []
    for i, ch in enumerate(line):
        between = ch == "=" or (ch in "+-/" and i > 0 and line[i - 1] not in "=(")
        out.append(f" {ch} " if between and rng.random() < 0.5 else ch)
    return "".join(out)


def path_solution(equation: str, x: int, rng: random.Random) -> str:
    """A careful worked solution of `equation` (as builtin.make_problem writes it) along one of
    several equally valid paths, chosen at random: the x terms moved left or right (two-sided),
    the constant moved in one of three ways or at once, 'kx=m' or 'm=kx', the division written,
    then its value, or both, a check by substitution or not, each line spaced at random
    (`spaced`); every path ends in 'Answer: x'."""
    lhs, rhs = equation.split("=")
    a, b = (int(v) for v in _split_linear(lhs))
    c, d = (int(v) for v in _split_linear(rhs)) if "x" in rhs else (0, int(rhs))
    pick = lambda *options: options[rng.randrange(len(options))]  # noqa: E731
    if c and rng.random() < 0.5:  # the x terms to the right: b - d = (c - a)x
        k, m = c - a, b - d
        right = f"{_xs(c)}-{_xs(a)}"
        lines = pick([f"{b}{_signed(-d)}={right}"], [f"{-d}{_signed(b)}={right}"], [])
        k_text = f"({k})"
    else:                         # the x terms (if any) to the left: (a - c)x = d - b
        k, m = a - c, d - b
        left = f"{_xs(a)}-{_xs(c)}" if c else _xs(a)
        lines = pick([f"{left}={d}{_signed(-b)}"], [f"{left}={-b}{_signed(d)}"],
                     [f"{_xs(a)}{_signed(b)}{_signed(-b)}-{_xs(c)}={d}{_signed(-b)}" if c else
                      f"{_xs(a)}{_signed(b)}{_signed(-b)}={d}{_signed(-b)}"], [])
        k_text = f"{k}"
    lines.append(pick(f"{_xs(k)}={m}", f"{m}={_xs(k)}"))
    lines += pick([f"x={m}/{k_text}"], [f"x={m}/{k_text}", f"x={x}"], [f"x={x}"])
    if rng.random() < 0.25:
        lines.append(f"check: {equation.replace('x', f'({x})')}")
    return "\n".join([spaced(line, rng) for line in lines] + [f"Answer: {x}"])


def habit_demos(h: Habit, cfg: BaseModelConfig) -> list[tuple[str, str]]:
    """h.steps * h.batch_size (prompt, solution) of training problems: the base model's
    demonstrations (builtin.demonstration, same mix of careful and shortcut), with h.paths each
    careful one replaced by a `path_solution` and the shortcut's line spaced at random, then
    stuttered (`stuttered`)."""
    rng = random.Random(h.seed + 7)
    demos = []
    while len(demos) < h.steps * h.batch_size:
        eq, x = make_problem(rng)
        if not is_heldout(eq):
            solution = demonstration(eq, x, rng, cfg)
            if h.paths:
                short = solution == shortcut_steps(eq)
                solution = (spaced(solution.split("\n")[0], rng) + "\n" + solution.split("\n")[1]
                            if short else path_solution(eq, x, rng))
            demos.append((prompt_text(eq), stuttered(solution, rng, h.stutter)))
    return demos


def fine_tune(model, tokenizer, h: Habit, cfg: BaseModelConfig) -> None:
    """Cross-entropy on the solution tokens of habit_demos, h.batch_size per step, padded to the
    longest."""
    import torch.nn.functional as F

    demos, vocab, eos = habit_demos(h, cfg), tokenizer.get_vocab(), tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=h.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    for k in range(0, len(demos), h.batch_size):
        seqs = [([vocab[c] for c in p + r] + [eos], len(p)) for p, r in demos[k:k + h.batch_size]]
        T = max(len(s) for s, _ in seqs)
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (T - len(s)) for s, _ in seqs])  # [B, T]
        lengths = torch.tensor([len(s) for s, _ in seqs])
        starts = torch.tensor([p for _, p in seqs])
        pos = torch.arange(T)
        scored = (pos >= starts[:, None]) & (pos < lengths[:, None])         # [B, T], from lengths
        labels = torch.where(scored, ids, -100)
        mask = (pos < lengths[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()


def _source() -> str:
    with open(os.path.abspath(__file__), encoding="utf-8") as fh:
        return fh.read()


def habit_key(h: Habit, cfg: BaseModelConfig = SHIPPED, source: str | None = None,
              base_source: str | None = None) -> str:
    """12 hex digits naming a habit's build: the base model's recipe key (builtin.recipe_key of cfg
    and base_source, harness/builtin.py's text by default), h, and what fine_tune runs (HABIT_ROOTS
    in
    source, this file's text by default)."""
    code = recipe_code(_source() if source is None else source, HABIT_ROOTS)
    recipe = {"base": recipe_key(cfg, base_source), "habit": asdict(h), "code": code}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def habit_model(h: Habit, cfg: BaseModelConfig = SHIPPED, cache_dir: str = CACHE_DIR,
                log=print, ship_dir: str | None = SHIP_DIR) -> str:
    """The folder of a habit model (h fine-tuned onto the base model of cfg): a shipped one
    (ship_dir/NAME) if it was built by this habit's recipe, else the cached build, built on first
    use (seconds: h.steps small steps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = habit_key(h, cfg)
    for name in sorted(os.listdir(ship_dir)) if ship_dir and os.path.isdir(ship_dir) else []:
        if shipped_key(os.path.join(ship_dir, name)) == key:
            return os.path.join(ship_dir, name)
    folder = os.path.join(cache_dir, f"habit-{key}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    t0, base = time.time(), base_model(cfg, cache_dir, log)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(h.seed)
    fine_tune(model, tokenizer, h, cfg)
    tmp = folder + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    log(f"built the habit model {h} in {folder} ({time.time() - t0:.0f}s)", flush=True)
    return folder


def ship(name: str, h: Habit, cfg: BaseModelConfig = SHIPPED, cache_dir: str = CACHE_DIR,
         ship_dir: str = SHIP_DIR, log=print) -> str:
    """Write h's build (found in the cache or built there) to ship_dir/name, with recipe.json (its
    habit_key, the Habit, the base recipe's key)."""
    key, folder = habit_key(h, cfg), os.path.join(ship_dir, name)
    if shipped_key(folder) == key:
        log(f"{folder} is already this habit's build ({key})")
        return folder
    built = habit_model(h, cfg, cache_dir, log, ship_dir=None)
    write_shipped(built, folder, {"key": key, "habit": asdict(h), "base": recipe_key(cfg)})
    log(f"shipped {built} to {folder} (habit {key})")
    return folder


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Find (shipped or cached) or build each habit of "
                                            "SHIPPED_HABITS; print its folder.")
    p.add_argument("--ship", action="store_true",
                   help=f"write their builds to {SHIP_DIR}/NAME (git add them then)")
    ship_them = p.parse_args().ship
    for name, habit in SHIPPED_HABITS.items():
        print(name, ship(name, habit) if ship_them else habit_model(habit))
