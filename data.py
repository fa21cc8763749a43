"""Prompts and reference answers: the built-in task or a JSONL file, formatted for the model, in a seeded order.

Article section: the `prompts` / `batch_prompts` fed to Step 1 ("Rollout 采样"); the answers are what
Step 2's verifier compares against.

A JSONL file has one JSON object per line. `--prompt-field` / `--answer-field` name the columns
(defaults `prompt`, `answer`); GSM8K's rows work as they are with `--prompt-field question`, since its
`answer` ends in `#### N` and the verifier reads the number after `####` in the reference too.
"""
from __future__ import annotations

import json
import os
import zlib

import torch


class InputError(ValueError):
    """Bad input to a run (a data file, model, reward or checkpoint): reported as one line, exit code 2."""


def load_rows(path: str, split: str, prompt_field: str = "prompt", answer_field: str = "answer",
              limit: int | None = None) -> list[dict]:
    """Rows {"prompt", "answer"} from 'builtin' (split 'train' or 'eval') or a JSONL file."""
    if path == "builtin":
        import builtin
        if split == "train":  # a stream drawn from the task's distribution (repeats allowed), never held-out problems
            return builtin.sample_problems(limit or 20000, seed=1, heldout=False, distinct=False)
        return builtin.sample_problems(limit or 256, seed=2, heldout=True)
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such data file")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            for f in (prompt_field, answer_field):
                if f not in row:
                    raise InputError(f"{path}:{i}: no field {f!r} (fields: {', '.join(sorted(row)) or 'none'})")
            rows.append({"prompt": str(row[prompt_field]), "answer": str(row[answer_field])})
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


class PromptFormatter:
    """Turns a row's prompt text into token ids: an optional template, then the chat template if any."""

    def __init__(self, tokenizer, template: str = "{prompt}", system: str | None = None, chat: bool = True):
        if "{prompt}" not in template:
            raise InputError(f"--prompt-template must contain {{prompt}}, got {template!r}")
        self.tokenizer, self.template, self.system = tokenizer, template, system
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None

    def __call__(self, prompt: str) -> list[int]:
        text = self.template.replace("{prompt}", prompt)
        if not self.chat:
            return self.tokenizer(f"{self.system}\n{text}" if self.system else text)["input_ids"]
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def prompt_rows(rows: list[dict], seed: int, start: int, count: int) -> list[tuple[int, dict]]:
    """Items start..start+count-1 of the endless stream of epochs, each epoch a fresh seeded shuffle."""
    out, perms = [], {}
    for j in range(start, start + count):
        epoch = j // len(rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append((j, rows[int(perms[epoch][j % len(rows)])]))
    return out


def prompt_generator(seed: int, j: int) -> torch.Generator:
    """Sampling randomness of the j-th prompt of the run: a function of (seed, j) alone, never of the rank."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{j}".encode()))
