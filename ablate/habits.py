"""Habits: base models for the experiments whose problem the shipped base model is too tidy to show,
each a short supervised fine-tune of builtin.py's base model on its own kind of demonstrations with
one habit added (`Habit`; so far a stutter: lines written again).

Article section: "DAPO：四项修正", token-level loss (问题: long wrong responses, rambling and
repetition, are diluted by the per-response mean): the shipped model's wrong answers are all short
shortcuts.

A habit model is built into builtin.py's cache on first use (`habit_model`, seconds) and keyed by
`habit_key`: the base recipe's key, the Habit's fields and the code a build runs here (HABIT_ROOTS,
canonical as builtin.recipe_code makes it). This code is outside the base recipe, so editing it
leaves the base model's key and the shipped weights as they are.
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

from builtin import (
    CACHE_DIR,
    BaseModelConfig,
    base_model,
    demonstration,
    is_heldout,
    make_problem,
    prompt_text,
    recipe_code,
    recipe_key,
)


@dataclass(frozen=True)
class Habit:
    """A short supervised fine-tune of the base model on its own kind of demonstrations with one
    habit added, for an experiment whose problem the base model is too tidy to show."""
    stutter: float = 0.3       # chance a line (careful or shortcut) is written again, 1-3 times
    steps: int = 60            # supervised steps, each on fresh demonstrations
    batch_size: int = 32       # demonstrations per step
    lr: float = 1e-3           # AdamW learning rate, constant
    seed: int = 0              # seeds the demonstrations


HABIT_ROOTS = ("habit_demos", "fine_tune")  # what a habit's build runs on top of the base model
SHIPPED = BaseModelConfig()  # the settings of the shipped base model, the habits' default base


def stuttered(solution: str, rng: random.Random, p: float) -> str:
    """solution with each line but the answer written again 1-3 more times with chance p (a solver
    that loses its place): the length of a response, right or wrong, no longer follows from its
    method."""
    *steps, answer = solution.split("\n")
    out = []
    for line in steps:
        out += [line] * (1 + (rng.randint(1, 3) if rng.random() < p else 0))
    return "\n".join(out + [answer])


def habit_demos(h: Habit, cfg: BaseModelConfig) -> list[tuple[str, str]]:
    """h.steps * h.batch_size (prompt, solution) of training problems: the base model's
    demonstrations (builtin.demonstration, same mix), stuttered (`stuttered`)."""
    rng = random.Random(h.seed + 7)
    demos = []
    while len(demos) < h.steps * h.batch_size:
        eq, x = make_problem(rng)
        if not is_heldout(eq):
            solution = demonstration(eq, x, rng, cfg)
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
    and base_source, builtin.py's text by default), h, and what fine_tune runs (HABIT_ROOTS in
    source, this file's text by default)."""
    code = recipe_code(_source() if source is None else source, HABIT_ROOTS)
    recipe = {"base": recipe_key(cfg, base_source), "habit": asdict(h), "code": code}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def habit_model(h: Habit, cfg: BaseModelConfig = SHIPPED, cache_dir: str = CACHE_DIR,
                log=print) -> str:
    """The folder of a habit model (h fine-tuned onto the base model of cfg), built into the cache
    on first use (seconds: h.steps small steps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.join(cache_dir, f"habit-{habit_key(h, cfg)}")
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
