"""The task and its data (harness/builtin.py, harness/data.py): the built-in task and tokenizer,
data
formats, chat templates, pluggable and TRL-style rewards, clear errors for bad input.

    python -m pytest -q tests/test_data.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

import pytest
import torch

import dapo
from harness import builtin, data, flags, models
from helpers import one_step, read_file, spy_on, tiny_flags
from infra import errors
from test_grpo import has_x, trl_length
from verifier import (
    verify,
)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

# ---------------------------------------------------------------------------------------------
# harness/builtin.py: the task and the tokenizer round trip
# ---------------------------------------------------------------------------------------------

def test_builtin_task_solutions_verify_and_split_is_disjoint():
    rng = random.Random(0)
    for _ in range(300):
        eq, x = builtin.make_problem(rng)
        assert verify(builtin.solve_steps(eq, x, verbose=rng.random() < 0.5), str(x)) == 1.0
        lhs, rhs = eq.split("=")
        a, b = (int(v) for v in builtin.split_linear(lhs))
        c, d = (int(v) for v in builtin.split_linear(rhs)) if "x" in rhs else (0, int(rhs))
        assert a * x + b == c * x + d
    train = {r["prompt"] for r in builtin.sample_problems(2000, seed=1, heldout=False)}
    held = {r["prompt"] for r in builtin.sample_problems(200, seed=2, heldout=True)}
    assert len(held) == 200 and not train & held


def test_builtin_tokenizer_round_trips_through_save_pretrained(tmp_path):
    from transformers import AutoTokenizer
    tok = builtin.make_tokenizer()
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=16, intermediate_size=32,
                                                       num_layers=1), len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "3x-5=x+7\ncheck: 3(6)-5=(6)+7\nAnswer: 6"
    assert (back(text)["input_ids"] == tok(text)["input_ids"]
            and len(back(text)["input_ids"]) == len(text))
    # spaces survive (a qwen2 config would drop them)
    assert back.decode(back(text)["input_ids"]) == text
    assert back.eos_token_id == 1 and back.pad_token_id == 0


def test_packed_warm_start_is_exact():
    """A packed row (positions restarting per demonstration) gives each demonstration the logits it
    gets
    alone, and the labels score exactly its solution tokens: packing changes the cost, not the
    training."""
    tok = builtin.make_tokenizer()
    cfg = builtin.BaseModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, sft_steps=2,
                                  sft_batch_size=12, sft_pack_len=80)
    model = builtin.make_model(cfg, len(tok)).eval()
    batches = builtin.warm_start_batches(tok, cfg)
    assert len(batches) == cfg.sft_steps
    # encoded as a user would
    demos = [(tok(p)["input_ids"], tok(r)["input_ids"]) for p, r in builtin.warm_start_demos(cfg)]
    for k, (ids, pos, labels) in enumerate(batches):
        # packed: fewer rows than demos
        assert ids.shape[1] <= cfg.sft_pack_len and ids.shape[0] < cfg.sft_batch_size
        with torch.no_grad():
            # [R, T, V]
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        found = []
        for r in range(ids.shape[0]):
            starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for a, b in zip(starts, starts[1:]):
                seq = ids[r, a:b]
                # the row's padding
                if (labels[r, a:b] == -100).all():
                    assert (seq == tok.pad_token_id).all()
                    continue
                with torch.no_grad():
                    # [n, V]
                    alone = model(input_ids=seq[None]).logits[0]
                torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-5)
                # prompt tokens unscored
                p = int((labels[r, a:b] == -100).sum())
                assert (labels[r, a + p:b].tolist() == seq[p:].tolist()
                        and seq[-1] == tok.eos_token_id)
                found.append((seq.tolist(), p))
        want = demos[k * cfg.sft_batch_size:(k + 1) * cfg.sft_batch_size]
        # each once, its prompt unscored
        assert sorted(found) == sorted((p + r + [tok.eos_token_id], len(p)) for p, r in want)


def test_shipped_base_model_is_this_recipes_build():
    """base_model/ holds the weights the current recipe builds: after changing the recipe
    (BaseModelConfig,
    the task, the demonstrations, the tokenizer, the warm start), `python -m harness.builtin --ship`
    rebuilds it."""
    with open(os.path.join(builtin.SHIP_DIR, "recipe.json")) as fh:
        recorded = json.load(fh)
    assert recorded["key"] == builtin.recipe_key(), (
        "base_model/ was built by another recipe: rebuild and ship it with "
        "`python -m harness.builtin --ship`")
    assert recorded["config"] == dataclasses.asdict(builtin.BaseModelConfig())
    assert builtin.base_model() == builtin.SHIP_DIR


def test_recipe_key_changes_with_every_part_of_the_recipe_and_only_with_it():
    """The key changes with each config field and each edit of the code a build runs; comments,
    docstrings and the RL data (sample_problems, not part of the build) leave it alone."""
    with open(builtin.__file__) as fh:
        src = fh.read()
    cfg = builtin.BaseModelConfig()
    key = builtin.recipe_key(cfg, src)
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        changed = {f.name: v + 1 if isinstance(v, int) else v / 2}
        assert builtin.recipe_key(dataclasses.replace(cfg, **changed), src) != key, f.name
    # the verbose demonstration's text
    changes = [('"check: {', '"check:{'),
               # the shortcut
               ("return f\"x={m}/{a}\\nAnswer: {int(m / a)}\"",
                "return f\"x={m}/{a}\\nAnswer: {m // a}\""),
               ("verbose=rng.random() < cfg.verbose_frac",
                "verbose=rng.random() <= cfg.verbose_frac"),
               ("rng.randint(-9, 9)", "rng.randint(-8, 9)"),                  # the problems
               ("% 8 == 0", "% 7 == 0"),                                      # the held-out split
               # the tokenizer's vocabulary
               ('CHARS = "0123456789', 'CHARS = "9876543210'),
               ('behavior="isolated"', 'behavior="merged_with_previous"'),   # and its pre-tokenizer
               ("rms_norm_eps=1e-5", "rms_norm_eps=1e-6"),                    # the model
               # the optimiser
               ("sft_lr, weight_decay=0.0, betas=(0.9, 0.98)",
                "sft_lr, weight_decay=0.0, betas=(0.9, 0.99)"),
               ("pos += range(len(s))", "pos += range(1, len(s) + 1)")]       # the packing
    same = [("# every character the task's prompts and solutions use", "# the characters"),
            ('"""\'+5\' or \'-5\', for a constant written after another term."""',
             '"""A signed constant."""'),
            # sample_problems: the RL data
            ("for _ in range(200 * n):", "for _ in range(300 * n):"),
            ("\n\n\ndef make_model(", "\n\n\n\ndef make_model(")]
    for old, new in changes + same:
        assert src.count(old) == 1, old
        changed = builtin.recipe_key(cfg, src.replace(old, new)) != key
        assert changed == ((old, new) in changes), (old, new)


def test_base_model_is_the_shipped_folder_only_for_its_recipe(tmp_path):
    """ship() writes a cached build with its key; base_model() returns it for that recipe only."""
    cfg = builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, sft_steps=2,
                                  sft_batch_size=8)
    cache, shipped = str(tmp_path / "cache"), str(tmp_path / "base_model")
    quiet = lambda *a, **k: None  # noqa: E731
    assert (builtin.base_model(cfg, cache, quiet, ship_dir=shipped)
            == os.path.join(cache, f"base-{builtin.recipe_key(cfg)}"))
    assert builtin.ship(cfg, cache, shipped, log=quiet) == shipped
    assert (builtin.shipped_key(shipped) == builtin.recipe_key(cfg)
            and os.path.exists(os.path.join(shipped, "model.safetensors")))
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) == shipped
    # another recipe: built into the cache
    other = dataclasses.replace(cfg, seed=1)
    assert (builtin.base_model(other, cache, quiet, ship_dir=shipped)
            == os.path.join(cache, f"base-{builtin.recipe_key(other)}"))
    assert (builtin.ship(other, cache, shipped, log=quiet) == shipped
            and builtin.shipped_key(shipped) == builtin.recipe_key(other))
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) != shipped
    _, tok, model = models.load_model(shipped)
    assert model.config.hidden_size == 16 and tok.eos_token_id == 1


# ---------------------------------------------------------------------------------------------
# harness/data.py: data formats, chat template, pluggable and TRL-style rewards, clear errors for
# bad input
# ---------------------------------------------------------------------------------------------

def test_gsm8k_fields_chat_template_and_reward_plugin(tiny_run_inputs, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Half of 4?", "answer": "4/2 = 2\n#### 2"}) + "\n")
    rows = data.load_rows(str(gsm), "train", prompt_field="question", answer_field="answer")
    assert rows == [{"prompt": "Half of 4?", "answer": "4/2 = 2\n#### 2",
                     "columns": {"answer": "4/2 = 2\n#### 2"}}]
    assert verify("so \\boxed{2}", rows[0]["answer"]) == 1.0
    tok = builtin.make_tokenizer()
    assert (data.PromptFormatter(tok, "{prompt}\nAnswer:")("2x=4")
            == tok("2x=4\nAnswer:")["input_ids"])
    # a chat template written in the built-in vocabulary's characters: system 's', user 'r',
    # assistant 'A'
    tok.chat_template = ("{% for m in messages %}{{ {'system': 's', 'user': 'r'}[m['role']] }}: {{ "
                         "m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    fmt = data.PromptFormatter(tok, "{prompt}", system="x")
    assert tok.decode(fmt("2x=4")) == "s: x\nr: 2x=4\nA: "
    assert data.PromptFormatter(tok, "{prompt}", chat=False)("2x=4") == tok("2x=4")["input_ids"]
    (tmp_path / "myreward.py").write_text("def half(response, answer):\n    return 0.5\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert data.load_reward("myreward:half")("anything", "1") == 0.5
        with pytest.raises(errors.InputError):
            data.load_reward("myreward:nothere")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("content,flags,message", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n', [], "bad.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1"}\n', [], "bad.jsonl:1: no field 'answer'"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--model", "/nonexistent/model"],
     "--model /nonexistent/model: no such folder"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--resume"], "--resume: no checkpoint"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--reward", "nosuchmodule:f"],
     "--reward nosuchmodule:f"),
])
def test_bad_input_gets_one_clear_line(tmp_path, capsys, content, flags, message):
    import train
    (tmp_path / "bad.jsonl").write_text(content)
    argv = ["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out"), "--model",
            str(tmp_path), *flags]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()




def trl_level_match(prompts, completions, level, answer):
    """TRL's signature with data set columns by name and no **kwargs; None (no score) where `level`
    is missing."""
    return [None if lv is None else float(a in c) * lv for c, lv,
            a in zip(completions, level, answer)]


def test_trl_rewards_get_columns_by_name_are_weighted_and_none_is_no_score():
    rows = [{"prompt": "p0", "answer": "4", "columns": {"answer": "4", "level": 2}},
            # no level: None
            {"prompt": "p1", "answer": "5", "columns": {"answer": "5"}}]
    completions = ["x = 4", "12345678"]
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(prompts=prompts, ids=completion_ids, columns=columns)
        return [1.0, None]

    reward = data.Reward([("len", trl_length), ("level", trl_level_match), ("x", has_x),
                          ("spy", spy)], [1.0, 0.5, 2.0, 1.0])
    assert reward.batch == [True, True, False, True]
    total, parts = reward(["p0", "p1"], completions, rows, lambda: [[1, 2], [3]])
    assert seen == {"prompts": ["p0", "p1"], "ids": [[1, 2], [3]],
                    "columns": {"answer": ["4", "5"], "level": [2, None]}}
    assert parts["len"].tolist() == [-3 / 8, 0.0] and parts["x"].tolist() == [1.0, 0.0]
    assert parts["level"][0] == 2.0 and parts["level"][1].isnan() and parts["spy"][1].isnan()
    # None leaves the sum
    assert total.tolist() == pytest.approx([-3 / 8 + 0.5 * 2.0 + 2.0 + 1.0, 0.0])
    for bad, message in (([("f", lambda completions: [1.0])],
                          "expected a list of 2 floats or None, got list of 1"),
                         ([("f", lambda completions: "yes")],
                          "expected a list of 2 floats or None, got str"),
                         ([("f", lambda completions, solution: [1.0, 1.0])], "needs ['solution']"),
                         ([("f", has_x), ("f", has_x)],
                          "two rewards, or a reserved metric, named reward/f"),
                         ([("mean", has_x)], "reward/mean")):
        pattern = message.replace("[", r"\[").replace("]", r"\]")
        with pytest.raises(errors.InputError, match=pattern):
            data.Reward(bad)(["p0", "p1"], completions, rows)
    with pytest.raises(errors.InputError, match="2 weights for 1"):
        data.Reward([("x", has_x)], [1.0, 2.0])


def test_reward_weights_weigh_the_rewards_train_py_trains_on(tiny_run_inputs, tmp_path,
                                                              monkeypatch):
    # one step of train.py in this process with --reward has_x --reward trl_length and
    # --reward-weights 1 0.5: each drawn response's score (Rollout.correct, what DAPO's +-1 reward
    # and the filter read) is has_x + 0.5 trl_length, row by row; the row logs the same mean
    import train
    drawn = spy_on(monkeypatch, train, "draw_round")
    row = one_step(tiny_run_inputs, tmp_path / "run", "--reward", "test_grpo:trl_length",
                    "--reward-weights", "1", "0.5")
    (_, (roll, _)), = drawn
    x, length = roll.reward_parts["has_x"], roll.reward_parts["trl_length"]          # [N] each
    assert (length < 0).any() and 0 < x.sum() < x.numel()
    assert torch.allclose(roll.correct, x + 0.5 * length, atol=1e-6)
    penalty = dapo.overlong_penalty(roll.lengths, 12, 2)                  # --algo dapo: +-1, Eq. 13
    assert torch.allclose(roll.rewards, 2 * roll.correct - 1 + penalty, atol=1e-6)
    assert row["reward/correct"] == pytest.approx(float(roll.correct.mean()), abs=1e-6)


def test_data_json_array_file_keeps_every_column(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"q": "1+1", "sol": 2, "level": 1},
                                                    {"q": "2+2", "sol": 4}]))
    rows = data.load_rows(str(tmp_path / "rows.json"), "train", "q", "sol")
    assert rows == [{"prompt": "1+1", "answer": "2", "columns": {"sol": 2, "level": 1}},
                    {"prompt": "2+2", "answer": "4", "columns": {"sol": 4}}]
    (tmp_path / "bad.json").write_text('[{"q": "1+1", "sol": 2},\n {"q": ]')
    with pytest.raises(errors.InputError, match=r"bad.json:2: not valid JSON"):
        data.load_rows(str(tmp_path / "bad.json"), "train", "q", "sol")


def test_data_parquet_file_folder_splits_and_saved_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets",
                                   reason="--data with Parquet/Arrow/folders/hub ids needs "
                                   "`datasets`")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    train = [{"question": f"{i}x=0", "solution": str(i), "level": i % 3} for i in range(5)]
    test = [{"question": "9x=0", "solution": "9", "level": 0}]
    (tmp_path / "splits").mkdir()
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "splits" / "train.parquet"))
    datasets.Dataset.from_list(test).to_parquet(str(tmp_path / "splits" / "test.parquet"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                         test=datasets.Dataset.from_list(test)).save_to_disk(
        str(tmp_path / "saved"))
    want = [{"prompt": r["question"], "answer": r["solution"],
             "columns": {"solution": r["solution"], "level": r["level"]}}
            for r in train]
    load = lambda path, **kw: data.load_rows(  # noqa: E731
        str(tmp_path / path), "train", "question", "solution", **kw)
    assert load("train.parquet") == want and load("train.parquet", limit=2) == want[:2]
    assert load("splits") == want and load("splits", hf_split="test")[0]["prompt"] == "9x=0"
    assert load("saved") == want and load("saved", hf_split="test")[0]["answer"] == "9"
    with pytest.raises(errors.InputError, match=r"train.parquet:1: no field 'answer' \(fields: "
                       r"level, question, solution\)"):
        data.load_rows(str(tmp_path / "train.parquet"), "train", "question", "answer")
    with pytest.raises(errors.InputError, match=r"--data .*splits: could not be loaded \(split "
                       r"'validation': "):
        load("splits", hf_split="validation")
    # as if not installed: one line that says what to install
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(errors.InputError, match=r"pip install datasets"):
        load("train.parquet")


# Hub data sets as they are: a few rows of each real schema, read by the docs' recipes. The schemas
# (field names, nesting, types) are those of openai/gsm8k (main), BytedTsinghua-SIA/DAPO-Math-17k
# (verl's format) and trl-lib/DeepMath-103K (TRL's conversational prompt-only format); the problems
# are made up.
DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response "
                    "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                    "answer to the problem.\n\n{}\n\n"
                    "Remember to put your answer on its own line after \"Answer:\".")


SCHEMA_PROBLEMS = [("Let $f(x) = 3x + 2$. Find $f(f(1))$.", "17"),
                   ("How many positive divisors does $36$ have?", "9"),
                   ("What is the remainder when $2^{10}$ is divided by $7$?", "2")]


RECIPE_SCHEMAS = {"openai/gsm8k:main": "gsm8k", "BytedTsinghua-SIA/DAPO-Math-17k": "dapo",
                  "trl-lib/DeepMath-103K": "trl"}  # a docs recipe's --data: the schema of its rows


def _schema_rows(schema: str) -> list[dict]:
    """Rows of a real schema: gsm8k, dapo (verl's), trl (conversational; one row with a system
    turn), text (a plain JSONL)."""
    if schema == "gsm8k":
        return [{"question": q, "answer": f"It takes a few steps.\n#### {a}"}
                for q, a in SCHEMA_PROBLEMS]
    if schema == "dapo":
        return [{"data_source": "math_dapo",
                 "prompt": [{"content": DAPO_INSTRUCTION.format(q), "role": "user"}],
                 "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lean"},
                 "extra_info": {"index": f"0f3c9a52-77e1-4d0b-9c1e-5b2a8d4e{i:04d}"}}
                for i, (q, a) in enumerate(SCHEMA_PROBLEMS)]
    if schema == "trl":
        rows = [{"prompt": [{"content": q, "role": "user"}], "solution": a}
                for q, a in SCHEMA_PROBLEMS]
        rows[1]["prompt"].insert(0, {"content": "You are a careful mathematician.",
                                     "role": "system"})
        return rows
    return [{"prompt": q, "answer": a} for q, a in SCHEMA_PROBLEMS]


def _chat_tokenizer():
    """A byte-level tokenizer (any text round-trips) with a ChatML chat template, as Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def _chatml(messages: list[dict]) -> str:
    """What _chat_tokenizer's template renders for these messages (generation prompt on), written
    out by hand."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _doc_commands(page: str, script: str) -> list[list[str]]:
    """The `script` commands of a docs page's bash blocks, each as the words after `script`
    (comments dropped, continuation lines joined, a quoted text may span lines: as bash reads
    them)."""
    import re
    import shlex
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", read_file(os.path.join(HERE, page)), re.S):
        text = ""
        for line in block.splitlines(keepends=True):
            text += line
            if text.endswith("\\\n"):
                continue
            try:
                words = shlex.split(text.replace("\\\n", " "), comments=True)
            except ValueError:  # an open quote: the text goes on on the next line
                continue
            text = ""
            at = [i for i, w in enumerate(words) if w.endswith(script)]
            if at:
                commands.append(words[at[0] + 1:])
    return commands




def _recipe_flags(schema: str, data_path, model) -> list[str]:
    """The docs recipe of this schema with --data / --eval-data on the test's file and --model on
    the test's folder, every other flag as the page gives it (text rows: train.py's defaults)."""
    pages = ("docs/real-models.md", "docs/from-trl.md")
    recipes = {RECIPE_SCHEMAS[f[f.index("--data") + 1]]: f
               for page in pages for f in _doc_commands(page, "train.py")}
    assert set(recipes) == {"gsm8k", "dapo", "trl"}, "a recipe without its schema in RECIPE_SCHEMAS"
    flags = list(recipes.get(schema, ["--data", "x", "--eval-data", "x"]))
    for name, value in (("--data", data_path), ("--eval-data", data_path), ("--model", model)):
        if name in flags:
            flags[flags.index(name) + 1] = str(value)
        else:
            flags += [name, str(value)]
    if "trl.rewards:accuracy_reward" in flags:  # TRL's own, where TRL and math-verify are installed
        try:
            import math_verify  # noqa: F401
            import trl.rewards  # noqa: F401
        except ImportError:
            flags[flags.index("trl.rewards:accuracy_reward")] = "test_grpo:_trl_accuracy"
    return flags


@pytest.mark.parametrize("schema", ["gsm8k", "dapo", "trl", "text"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_docs_recipes_read_the_real_rows_of_their_data_sets(tmp_path, schema, fmt):
    raw = _schema_rows(schema)
    path = tmp_path / f"rows.{fmt}"
    if fmt == "parquet":
        datasets = pytest.importorskip("datasets", reason="Parquet is read through `datasets`")
        datasets.Dataset.from_list(raw).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    args = flags.parse_train_args(_recipe_flags(schema, path, tmp_path))
    fields = args.prompt_field, args.answer_field
    rows = data.load_rows(args.data, "train", *fields, hf_split=args.data_split)
    eval_rows = data.load_rows(args.eval_data, "eval", *fields, args.eval_size, args.eval_split)
    assert len(rows) == len(eval_rows) == 3
    tok = _chat_tokenizer()
    encode = data.PromptFormatter(tok, args.prompt_template, args.system_prompt, args.chat_template)
    encode.check(rows, "--data")
    answers = [a for _, a in SCHEMA_PROBLEMS]
    for r, raw_row, (question, answer) in zip(rows, raw, SCHEMA_PROBLEMS):
        if schema == "gsm8k":  # the text through --prompt-template, as one user turn
            want = [{"role": "user", "content": args.prompt_template.replace("{prompt}", question)}]
            assert want[0]["content"].endswith("within \\boxed{}.")
            assert r["answer"] == raw_row["answer"]
        elif schema == "text":
            want = [{"role": "user", "content": question}]
            assert r["answer"] == answer
        else:  # the row's messages as they are (a system turn kept); the answer: the nested one
            want = raw_row["prompt"]
            assert r["prompt"] == want and r["answer"] == answer
        ids = encode(r["prompt"])
        assert tok.decode(ids) == _chatml(want), tok.decode(ids)
        if schema == "dapo":  # the real instruction: prompts over a 128-token KV block, one prefix
            assert len(ids) > 128 and ids[:100] == encode(rows[0]["prompt"])[:100]
    # the recipe's reward: a right final answer scores 1, a wrong one 0 (DAPO asks for "Answer: N")
    right = [f"So the answer line is\nAnswer: {a}" if schema == "dapo" else f"\\boxed{{{a}}}"
             for a in answers]
    prompts, completions = [r["prompt"] for r in rows] * 2, right + ["\\boxed{1000}"] * 3
    total, _ = data.Reward.load(args.reward, args.reward_weights)(prompts, completions, rows * 2)
    assert total.tolist() == [1.0] * 3 + [0.0] * 3
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):  # what GRPOTrainer passes
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [0.0] * len(completions)

    data.Reward([("spy", spy)])(prompts[:3], completions[:3], rows)
    chat = schema in ("dapo", "trl")  # TRL's conversational format: one assistant message each
    assert seen["completions"] == ([[{"role": "assistant", "content": c}] for c in right] if chat
                                   else right)
    assert seen["prompts"] == [r.get("prompt", r.get("question")) for r in raw]
    others = {k: [r[k] for r in raw] for k in raw[0] if k != args.prompt_field}
    assert seen["columns"] == others  # dapo: reward_model, extra_info, ... as the rows hold them
    if schema == "dapo":
        assert seen["columns"]["reward_model"][0] == {"ground_truth": "17", "style": "rule-lean"}


def test_message_prompts_keep_their_system_turn_and_bad_prompts_name_their_row(tiny_run_inputs,
                                                                               tmp_path, capsys):
    import train
    tok = _chat_tokenizer()
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
           {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    fmt = data.PromptFormatter(tok, "{prompt} (think first)", system="You are a tutor.")
    # the row's own system turn wins over --system-prompt; the template rewrites the last user turn
    want = [*own[:3], {"role": "user", "content": "Q2 (think first)"}]
    assert tok.decode(fmt(own)) == _chatml(want)
    assert own[3]["content"] == "Q2"                                     # the row is left as it was
    assert tok.decode(fmt(own[1:2])) == _chatml([{"role": "system", "content": "You are a tutor."},
                                                 {"role": "user", "content": "Q1 (think first)"}])
    assert fmt(own[1:2]) == fmt("Q1")  # a text prompt: the one-user-turn message list it stands for
    # a message list has no raw-text form: --no-chat-template, or a tokenizer without a chat
    # template, is one line naming the first such row, before any sampling
    rows = [{"prompt": "2x=4", "answer": "2"}, {"prompt": own, "answer": "2"}]
    for formatter, why in ((data.PromptFormatter(tok, chat=False), "--no-chat-template sends raw"),
                           (data.PromptFormatter(builtin.make_tokenizer()),
                            "the tokenizer has no chat template")):
        formatter.check(rows[:1], "--data x")
        message = rf"^--data x: row 2: its prompt is a list of chat messages: {why}"
        with pytest.raises(errors.InputError, match=message):
            formatter.check(rows, "--data x")
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for extra, why in (([], "the tokenizer has no chat template"),
                       (["--no-chat-template"], "--no-chat-template")):
        with pytest.raises(SystemExit) as e:
            train.main([*tiny_flags(tiny_run_inputs, tmp_path / "out"), "--data", str(jsonl),
                        *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"--data {jsonl}: row 2: " in err and why in err
    # a prompt that is neither text nor messages, a dotted field that is not there: file and line
    bad = tmp_path / "bad.jsonl"
    for prompt, got in ((7, "int 7"), ({"role": "user"}, 'dict {"role": "user"}'),
                        (["a", "b"], 'list ["a", "b"]'), ([], "list []"),
                        ([{"role": "user", "content": None}], "list"),
                        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "list"),
                        (None, "NoneType null")):
        bad.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                               for p in ("ok", prompt)))
        with pytest.raises(errors.InputError) as e:
            data.load_rows(str(bad), "train")
        message = f"{bad}:2: field 'prompt' is neither a text nor a list of chat messages"
        assert str(e.value).startswith(message) and f"(got {got}" in str(e.value)
        assert "\n" not in str(e.value)
    verl = tmp_path / "verl.jsonl"
    for reward_model, message in (({"style": "rule"}, r"\(reward_model's fields: style\)"),
                                  ("34", r"\(reward_model is a str, not an object\)")):
        verl.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}],
                                    "reward_model": reward_model}) + "\n")
        with pytest.raises(errors.InputError,
                           match=rf"^{verl}:1: no field 'reward_model.ground_truth' {message}$"):
            data.load_rows(str(verl), "train", answer_field="reward_model.ground_truth")
    verl.write_text(json.dumps({"prompt": "1+1", "a.b": "2", "a": {"b": "3"}}) + "\n")
    assert data.load_rows(str(verl), "train", answer_field="a.b")[0]["answer"] == "2"  # a key wins


def test_trl_reward_columns_are_the_keys_of_every_row():
    # JSONL rows need not share their keys (a Dataset's always do): a column only later rows hold
    # still reaches the reward, None for the rows without it, whichever row comes first
    rows = [{"prompt": "p0", "answer": "1", "columns": {"answer": "1"}},
            {"prompt": "p1", "answer": "2", "columns": {"answer": "2", "level": 3}},
            {"prompt": "p2", "answer": "3", "columns": {"answer": "3", "hint": "odd"}}]
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns)
        return [1.0] * len(completions)

    data.Reward([("spy", spy)])(["p0", "p1", "p2"], ["a", "b", "c"], rows)
    assert seen == {"answer": ["1", "2", "3"], "level": [None, 3, None],
                    "hint": [None, None, "odd"]}
    total, parts = data.Reward([("level", trl_level_match)])(["p0", "p1", "p2"], ["2"] * 3, rows)
    assert parts["level"][1] == 3.0 and parts["level"][0].isnan()
    assert total.tolist() == [0.0, 3.0, 0.0]
