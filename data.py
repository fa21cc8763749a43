"""A run's inputs: prompts and reference answers (the built-in task or a JSONL file, formatted for the model,
in a seeded order), and the model with its tokenizer and end tokens.

Article section: the `prompts` / `batch_prompts` fed to Step 1 ("Rollout 采样"); the answers are what
Step 2's verifier compares against.

A JSONL file has one JSON object per line. `--prompt-field` / `--answer-field` name the columns
(defaults `prompt`, `answer`); GSM8K's rows work as they are with `--prompt-field question`, since its
`answer` ends in `#### N` and the verifier reads the number after `####` in the reference too.
"""
from __future__ import annotations

import importlib
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


def load_reward(spec: str):
    """verifier.verify, or the function named by 'module:function' (imported, never evaluated)."""
    if spec == "verifier":
        import verifier
        return verifier.verify
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"--reward {spec}: expected module:function ({e})") from None
    if not callable(fn):
        raise InputError(f"--reward {spec}: {name} is not callable")
    return fn


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


def load_model(spec: str, trust_remote_code: bool = False):
    """(folder, tokenizer, model) for --model: 'builtin' (built and cached on first use), a folder or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    path = spec
    if spec == "builtin":
        import builtin
        path = builtin.base_model()
    elif not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):  # not a hub id
        raise InputError(f"--model {path}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # float32 master weights whatever the checkpoint's dtype (most hub models are saved in bfloat16, and
        # transformers 5 keeps that dtype: AdamW updates of lr ~1e-6 would then mostly round away); bf16 is
        # the compute path, through autocast (--bf16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"--model {path}: could not be loaded ({str(e).splitlines()[0]})") from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"--model {path}: the tokenizer has no EOS token, so responses could never end")
    return path, tokenizer, model


def end_ids(tokenizer, model) -> list[int]:
    """The tokenizer's EOS, then any other end ids the model's generation config lists (as generate stops on
    them): some chat models end a turn with a token that is not the tokenizer's eos_token."""
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([tokenizer.eos_token_id, *extra]))
