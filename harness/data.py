"""A run's inputs: prompts and reference answers (the built-in task or a JSONL file, formatted for
the model, in a seeded order), and the reward that scores the answers (`--reward`).

Article section: the `prompts` / `batch_prompts` fed to Step 1 ("Rollout 采样"); the answers
are what Step 2's verifier compares against.

A JSONL file has one JSON object per line (a .json file may hold one array of them instead); Parquet
and Arrow files, folders and Hugging Face hub ids are read through `datasets` (imported only for
them). `--prompt-field` / `--answer-field` name the columns (defaults `prompt`, `answer`), a dotted
path naming a nested one (`reward_model.ground_truth`); GSM8K's rows work as they are with
`--prompt-field question`, since its `answer` ends in `#### N` and the verifier reads the number
after `####` in the reference too.

A prompt is a text, or a list of chat messages {"role", "content"}: TRL's conversational format, and
verl's (DAPO-Math-17k's rows are {"data_source", "prompt": [{"role": "user", ...}], "ability",
"reward_model": {"ground_truth", "style"}, "extra_info"}, read with
`--answer-field reward_model.ground_truth`). The messages go through the chat template as they are
(PromptFormatter), and reward functions with TRL's signature get them, and the completions, in
TRL's conversational form (Reward).
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import os
import sys
import zlib

import torch

from infra.errors import InputError

# read through `datasets` (a folder or a hub id too); JSONL and .json here
DATASETS_FILES = (".parquet", ".arrow")


def say_line(line: str) -> None:
    """A line for the user, on stderr (the default `say` of load_rows)."""
    print(line, file=sys.stderr, flush=True)


def load_rows(path: str, split: str, prompt_field: str = "prompt", answer_field: str = "answer",
              limit: int | None = None, hf_split: str = "train", say=say_line) -> list[dict]:
    """Rows {"prompt", "answer", "columns"} from 'builtin' (split 'train' or 'eval'); a JSONL file,
    or a .json file holding one array of objects; a Parquet or Arrow file, a folder (data files, or
    a save_to_disk folder) or a Hugging Face hub id, split `hf_split`, through `datasets`. The
    fields are names, or dotted paths into nested columns; "prompt" is a text or a list of chat
    messages, as the row holds it, "answer" a text. "columns" keeps every top-level field but the
    prompt's, for reward functions with TRL's signature.

    Rows that repeat an earlier row's prompt and answer (verl's aime-2024.parquet is 30 problems
    copied 32 times; DAPO-Math-17k holds each prompt ~100 times) are said, in one line to `say`:
    held-out ("eval") rows are evaluated once each (copies stand for avg@n, which --eval-samples
    computes), `limit` counting distinct rows; training rows are kept, each copy drawn as often as
    it appears."""
    if path == "builtin":
        from harness import builtin
        # a stream drawn from the task's distribution (repeats allowed), never held-out problems
        if split == "train":
            return builtin.sample_problems(limit or 20000, seed=1, heldout=False, distinct=False)
        return builtin.sample_problems(limit or 256, seed=2, heldout=True)
    if (os.path.isdir(path) or path.endswith(DATASETS_FILES)
            or not os.path.exists(path) and _hub_id(path)):
        records = enumerate(_dataset(path, hf_split), 1)
    elif not os.path.isfile(path):
        raise InputError(f"{path}: no such data file")
    else:
        records = _json_records(path)
    rows, seen, read, repeats = [], set(), 0, 0
    for i, row in records:
        if not isinstance(row, dict):
            raise InputError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        where = f"{path}:{i}"
        prompt = _prompt(_field(row, prompt_field, where), f"{where}: field {prompt_field!r}")
        answer = str(_field(row, answer_field, where))
        read, key = read + 1, json.dumps([prompt, answer], sort_keys=True)
        repeats += key in seen
        if key in seen and split == "eval":
            continue
        seen.add(key)
        rows.append({"prompt": prompt, "answer": answer,  # columns: for TRL-style rewards
                     "columns": {k: v for k, v in row.items() if k != prompt_field}})
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise InputError(f"{path}: no rows")
    cut = f", the first {limit} (--eval-size)" if split == "eval" and len(rows) == limit else ""
    if split == "eval" and (repeats or cut):
        say(f"{path}: {len(rows)} of {read} rows read evaluated ({repeats} repeat an earlier "
            f"row's prompt and answer and are evaluated once{cut})")
    elif repeats:
        say(f"{path}: {repeats} of {read} rows repeat an earlier row's prompt and answer; kept, "
            f"each copy drawn as often as it appears")
    return rows


def _field(row: dict, name: str, where: str):
    """row[name], or for a dotted path the nested value (`reward_model.ground_truth`:
    row["reward_model"]["ground_truth"]); a key that holds the dots itself comes first."""
    if name in row:
        return row[name]
    node, seen = row, []
    for part in name.split("."):
        if not isinstance(node, dict):
            raise InputError(f"{where}: no field {name!r} ({'.'.join(seen)} is a "
                             f"{type(node).__name__}, not an object)")
        if part not in node:
            inside = f"{'.'.join(seen)}'s " if seen else ""
            raise InputError(f"{where}: no field {name!r} ({inside}fields: "
                             f"{', '.join(sorted(node)) or 'none'})")
        node = node[part]
        seen.append(part)
    return node


def _prompt(value, where: str) -> str | list[dict]:
    """A row's prompt as it is: a text, or a list of chat messages, each {"role": text, "content":
    text} (other keys kept); anything else is one line naming the row."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        return value
    got = f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"
    raise InputError(f"{where} is neither a text nor a list of chat messages "
                     f'[{{"role": ..., "content": text}}, ...] (got {got})')


def _json_records(path: str):
    """(line number, object) of a JSONL file, or of a .json file that holds one JSON array."""
    with open(path, encoding="utf-8") as fh:
        if path.endswith(".json") and fh.read(4096).lstrip().startswith("["):
            fh.seek(0)
            try:
                yield from enumerate(json.load(fh), 1)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            return
        fh.seek(0)
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i}: not valid JSON ({e.msg})") from None


def _hub_id(path: str) -> bool:
    """'name' or 'owner/name': not a path that was meant to be a local file."""
    return (not path.startswith((".", "/", "~")) and path.count("/") <= 1
            and not path.endswith((".jsonl", ".json")))


def _dataset(path: str, split: str):
    """A `datasets` Dataset (imported only here): a Parquet/Arrow file, a save_to_disk folder, a
    folder of data files or a hub id ('owner/name', or 'owner/name:config'; cached by `datasets`),
    split `split` (a single file's rows are its 'train' split)."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"--data {path}: Parquet, Arrow, folders and hub data sets are read "
                         "through the datasets package, which is not installed (pip install "
                         "datasets)") from None
    datasets.disable_progress_bars()
    try:
        if os.path.isfile(path):
            return datasets.load_dataset(path.rsplit(".", 1)[1], data_files=path, split="train")
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                       for f in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(path)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        # a hub id, 'openai/gsm8k:main' with a config name
        name, _, config = path.partition(":")
        return datasets.load_dataset(name, config or None, split=split)
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetsError) as e:
        raise InputError(f"--data {path}: could not be loaded (split {split!r}: "
                         f"{str(e).strip().splitlines()[0]})") from None


def load_reward(spec: str):
    """verifier.verify; 'math-verify': the symbolic checker, bounded per response
    (harness/math_verify_reward.py, imported only here); or the function named by 'module:function'
    (imported, never evaluated)."""
    if spec == "verifier":
        import verifier
        return verifier.verify
    if spec == "math-verify":
        from harness import math_verify_reward
        return math_verify_reward.MathVerify()
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"--reward {spec}: expected module:function ({e})") from None
    if not callable(fn):
        raise InputError(f"--reward {spec}: {name} is not callable")
    return fn


# reward/<name> keys train.py logs for the combined reward
RESERVED = ("mean", "correct", "frac_zero_std")


def is_batch_reward(fn) -> bool:
    """TRL's signature f(prompts, completions, **columns) -> list[float | None] (a parameter named
    prompts or completions, or **kwargs); otherwise f(response, answer) -> float,
    called once per response."""
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is p.VAR_KEYWORD or p.name in ("prompts", "completions") for p in params)


class Reward:
    """The score of each response: the --reward functions,
    each times its --reward-weights weight, summed.

    A function with TRL's batch signature gets, by name, `prompts` (the rows' prompts before any
    template: texts, or for a conversational row a copy of its messages), `completions` (the
    response texts; for a conversational row TRL's form, one assistant message [{"role":
    "assistant", "content": text}]), `completion_ids` (token ids) and every other column of the rows
    (the data set's fields but the prompt field, the answer field among them, under their own names:
    the keys of all the rows, None where a row lacks one); one without **kwargs gets only the names
    it declares. It returns one float or None per response; None is no score: that component leaves
    the response's sum, as TRL sums with nansum (a response no component scores gets 0). `__call__`
    returns the sums [N] and each component [N] (NaN where it gave no score). A function f(response,
    answer) gets the response text, whatever the prompt.
    """

    def __init__(self, fns: list[tuple[str, object]], weights: list[float] | None = None):
        self.names, self.fns = [n for n, _ in fns], [f for _, f in fns]
        self.weights = list(weights) if weights is not None else [1.0] * len(fns)
        self.batch = [is_batch_reward(f) for f in self.fns]
        if len(self.weights) != len(fns):
            raise InputError(f"--reward-weights: {len(self.weights)} weights for {len(fns)} "
                             f"--reward functions")
        for n in self.names:
            if n in RESERVED or self.names.count(n) > 1:
                raise InputError(f"--reward: two rewards, or a reserved metric, named reward/{n}: "
                                 f"rename the function")

    @classmethod
    def load(cls, specs: list[str], weights: list[float] | None = None) -> Reward:
        """From --reward specs ('verifier' or module:function),
        named after the function (verifier: 'verifier')."""
        return cls([(s.partition(":")[2] or s, load_reward(s)) for s in specs], weights)

    def __call__(self, prompts: list[str], completions: list[str], rows: list[dict],
                 completion_ids=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts = {}
        for name, fn, batch in zip(self.names, self.fns, self.batch):
            if batch:
                vals = self._batch(name, fn, prompts, completions, rows, completion_ids)
            else:
                vals = [fn(c, r["answer"]) for c, r in zip(completions, rows)]
            parts[name] = torch.tensor([math.nan if v is None else float(v) for v in vals],
                                       dtype=torch.float32)  # [N]
        total = sum(w * p.nan_to_num(0.0) for w, p in zip(self.weights, parts.values()))  # [N]
        return total, parts

    @staticmethod
    def _batch(name, fn, prompts, completions, rows, completion_ids) -> list:
        columns = {k: [r.get("columns", {"answer": r["answer"]}).get(k) for r in rows]
                   for k in dict.fromkeys(k for r in rows
                                          for k in r.get("columns", {"answer": None}))}
        chat = [isinstance(p, list) for p in prompts]  # TRL's conversational format: a message list
        kw = {**columns,
              "prompts": [[dict(m) for m in p] if c else p for p, c in zip(prompts, chat)],
              "completions": [[{"role": "assistant", "content": t}] if c else t
                              for t, c in zip(completions, chat)]}
        params = inspect.signature(fn).parameters
        if "completion_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kw["completion_ids"] = completion_ids() if completion_ids else None
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            missing = [p for p, v in params.items()
                       if p not in kw and v.default is v.empty and v.kind is not v.VAR_POSITIONAL]
            if missing:
                raise InputError(f"--reward {name}: needs {missing}, the rows have "
                                 f"{sorted(columns)}")
            kw = {k: v for k, v in kw.items() if k in params}
        vals = fn(**kw)
        if not isinstance(vals, (list, tuple)) or len(vals) != len(completions) or \
                any(v is not None and not isinstance(v, numbers.Real) for v in vals):
            raise InputError(f"--reward {name}: expected a list of {len(completions)} floats or "
                             f"None, got {type(vals).__name__}"
                             f"{f' of {len(vals)}' if hasattr(vals, '__len__') else ''}")
        return vals


def as_reward(fn) -> Reward:
    """A Reward as it is, or one function (either signature) as a Reward of weight 1."""
    return fn if isinstance(fn, Reward) else Reward([(getattr(fn, "__name__", "score"), fn)])


class PromptFormatter:
    """Turns a row's prompt into token ids.

    A text: --prompt-template ({prompt} replaced by the text), then, where the tokenizer has a chat
    template, that template over a user turn of it (after a system turn of --system-prompt), else
    the text itself (the system prompt a line before it). A list of chat messages (TRL's
    conversational format, verl's): the chat template over the messages as they are, with the
    generation prompt, as TRL renders them; the row's own system turn is kept, and --system-prompt
    is put first only where the messages have none; --prompt-template rewrites the content of the
    last user turn. Messages need the chat template: --no-chat-template, or a tokenizer without one,
    is an error (`check` names the first such row).
    """

    def __init__(self, tokenizer, template: str = "{prompt}", system: str | None = None,
                 chat: bool = True, max_tokens: int = 0):
        self.max_tokens, self.cut = max_tokens, 0       # --max-prompt-tokens; prompts cut so far
        if "{prompt}" not in template:
            raise InputError(f"--prompt-template must contain {{prompt}}, got {template!r}")
        self.tokenizer, self.template, self.system = tokenizer, template, system
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None
        self.why_not = None if self.chat else (  # why a list of messages cannot be sent
            "--no-chat-template sends raw text, and a list of messages is not one (drop the flag)"
            if not chat else "the tokenizer has no chat template to render a list of messages with")

    def __call__(self, prompt: str | list[dict]) -> list[int]:
        """The prompt's token ids; with max_tokens, a longer one keeps its last max_tokens (as TRL's
        max_prompt_length cuts: the question's end and the chat's generation prompt stay), said
        on the first cut."""
        ids = self._encode(prompt)
        if self.max_tokens and len(ids) > self.max_tokens:
            if not self.cut:
                say_line(f"--max-prompt-tokens {self.max_tokens}: a prompt of {len(ids)} tokens "
                         f"keeps its last {self.max_tokens} (the first one cut; none is "
                         f"dropped, later cuts are not said)")
            self.cut += 1
            ids = ids[-self.max_tokens:]
        return ids

    def _encode(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, list):
            if not self.chat:
                raise InputError(f"a prompt is a list of chat messages: {self.why_not}")
            return self._render(self.messages(prompt))
        if self.chat:
            return self._render(self.messages([{"role": "user", "content": prompt}]))
        text = self.template.replace("{prompt}", prompt)
        return self.tokenizer(f"{self.system}\n{text}" if self.system else text)["input_ids"]

    def messages(self, prompt: list[dict]) -> list[dict]:
        """The messages the chat template renders for a row's messages (a new list: the row's stays
        as it is)."""
        messages = [dict(m) for m in prompt]
        last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
        if last_user is not None:
            last_user["content"] = self.template.replace("{prompt}", last_user["content"])
        if self.system and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system})
        return messages

    def _render(self, messages: list[dict]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def check(self, rows: list[dict], source: str) -> None:
        """One line naming the first row whose prompt is a list of messages, where there is no chat
        template to render it (before any sampling, rather than at the row's turn)."""
        if self.why_not:
            k = next((k for k, r in enumerate(rows, 1) if isinstance(r["prompt"], list)), None)
            if k is not None:
                raise InputError(f"{source}: row {k}: its prompt is a list of chat messages: "
                                 f"{self.why_not}")


def prompt_rows(rows: list[dict], seed: int, start: int, count: int,
                stride: int = 1) -> list[tuple[int, dict]]:
    """Items start, start + stride, ... (count of them) of the endless stream of epochs, each epoch
    a fresh seeded shuffle."""
    out, perms = [], {}
    for j in range(start, start + count * stride, stride):
        epoch = j // len(rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(
                len(rows), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append((j, rows[int(perms[epoch][j % len(rows)])]))
    return out


def prompt_generator(seed: int, j: int) -> torch.Generator:
    """Sampling randomness of the j-th prompt of the run:
    a function of (seed, j) alone, never of the rank."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{j}".encode()))
