"""What a run at the recipes' scale checks instead of quietly doing something else
(infra/rollout.py, infra/vllm_rollout.py, infra/data.py): the model's context against prompt +
--max-new-tokens in both commands and in the engine, duplicated evaluation rows.

    python -m pytest -q tests/test_scale.py
"""
from __future__ import annotations

import sys
import types

import pytest

from infra import rollout
from infra.errors import InputError


def _one_line_exit(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_both_commands_refuse_a_budget_past_the_models_context(tmp_path, capsys):
    # the shipped base model was trained on 256 positions: 400 new tokens was exit 0 and garbage
    import evaluate
    import train
    err = _one_line_exit(train.main, ["--max-new-tokens", "400", "--out", str(tmp_path / "t")],
                         capsys)
    assert "context of 256" in err and "--max-new-tokens 400" in err
    # a budget that fits alone, but not after the longest prompt (its prompts: 10-30 tokens)
    err = _one_line_exit(evaluate.main, ["--max-new-tokens", "250", "--eval-size", "4"], capsys)
    assert "context of 256" in err and "+ --max-new-tokens 250 =" in err


def test_context_check_counts_the_longest_prompt_and_warns_where_rope_is_scaled():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    assert rollout.context_limit(model) == (64, False)
    rollout.check_context(model, [[1] * 10, [1] * 24], 40)                    # 24 + 40 = 64: fits
    with pytest.raises(InputError, match=r"\(25 tokens\) \+ --max-new-tokens 40 = 65 positions"):
        rollout.check_context(model, [[1] * 25], 40)
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    assert rollout.context_limit(model) == (64, True)
    with pytest.warns(UserWarning, match="scales RoPE"):
        rollout.check_context(model, [[1] * 25], 40)


def test_the_vllm_engine_is_told_the_models_context(monkeypatch):
    # a stand-in for vllm.LLM records what the engine is built with: max_model_len is the model's
    # context (vLLM would otherwise cap the responses at its own limit, silently "truncated")
    from infra import vllm_rollout
    seen = {}
    fake = types.SimpleNamespace(LLM=lambda **kw: seen.update(kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    vllm_rollout.Engine("some/model", "cpu", bf16=False, seed=0, gpu_memory_utilization=0.3,
                        max_num_seqs=8, max_model_len=4096)
    assert seen["max_model_len"] == 4096 and seen["max_num_seqs"] == 8


def test_duplicated_evaluation_rows_are_said_and_evaluated_once(tmp_path):
    # verl's aime-2024.parquet: 30 problems copied 32 times, read with --eval-size 256 (which kept
    # the first 256 copies, nothing said); then 300 distinct problems cut to 256; and training
    # data with repeats (kept, said once); a file without repeats says nothing
    import json

    from infra import data

    def rows_file(name, rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)
    aime = [{"prompt": f"problem {i}", "answer": str(i)} for i in range(30)] * 32
    said = []
    rows = data.load_rows(rows_file("aime.jsonl", aime), "eval", limit=256, say=said.append)
    assert [r["prompt"] for r in rows] == [f"problem {i}" for i in range(30)]
    assert said == [f"{tmp_path}/aime.jsonl: 30 of 960 rows read evaluated (930 repeat an earlier "
                    f"row's prompt and answer and are evaluated once)"]
    said.clear()
    many = [{"prompt": f"p{i}", "answer": "1"} for i in range(300)]
    assert len(data.load_rows(rows_file("many.jsonl", many), "eval", limit=256,
                              say=said.append)) == 256
    assert said == [f"{tmp_path}/many.jsonl: 256 of 256 rows read evaluated (0 repeat an earlier "
                    f"row's prompt and answer and are evaluated once, the first 256 "
                    f"(--eval-size))"]
    said.clear()
    train = data.load_rows(rows_file("train.jsonl", aime[:90]), "train", say=said.append)
    assert len(train) == 90 and said == [f"{tmp_path}/train.jsonl: 60 of 90 rows repeat an "
                                         f"earlier row's prompt and answer; kept, each copy drawn "
                                         f"as often as it appears"]
    said.clear()
    # the same prompt with another answer is another row
    other = [{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": "2"}]
    assert len(data.load_rows(rows_file("o.jsonl", other), "eval", say=said.append)) == 2
    assert said == []


def test_final_is_saved_in_the_dtype_the_model_came_in(tmp_path, tiny_run_inputs):
    # a hub model in bfloat16 trains in float32 masters; OUT/final was written in float32 (a 7B:
    # 30 GB instead of 15); now in the dtype it came in, config.json saying so
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from infra import models
    _, tok, fp32 = models.load_model(str(tiny_run_inputs / "model"))
    src = tmp_path / "bf16"
    fp32.to(torch.bfloat16).save_pretrained(src)
    tok.save_pretrained(src)
    _, tok, model = models.load_model(str(src))
    assert next(model.parameters()).dtype == torch.float32 and model.source_dtype == torch.bfloat16
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)                                              # "trained" float32 masters
    final = models.save_final(str(tmp_path / "out"), model, tok, model.state_dict())
    assert json.load(open(f"{final}/config.json"))["dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(final)
    for (name, p), q in zip(model.state_dict().items(), back.state_dict().values()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16)), name


def test_evaluate_samples_with_a_vllm_engine_per_model(monkeypatch, capsys):
    # evaluate.py --rollout vllm: one engine per --model, built from the model's folder with its
    # context and --max-num-seqs, drawing every response, closed after; a stand-in engine here
    # (the real one: tests/test_vllm.py) draws with the built-in sampler, so the scores equal the
    # hf path's
    import evaluate
    from infra import vllm_rollout
    from sampler import sample_groups
    made = []

    class Engine:
        def __init__(self, path, device, bf16, seed, util, max_num_seqs, max_model_len):
            made.append({"path": path, "max_model_len": max_model_len, "calls": 0,
                         "closed": False, "max_num_seqs": max_num_seqs})

        def sample_groups(self, model, *a, **kw):
            made[-1]["calls"] += 1
            return sample_groups(model, *a, **kw)

        def close(self):
            made[-1]["closed"] = True
    monkeypatch.setattr(vllm_rollout, "Engine", Engine)
    argv = ["--model", "builtin", "--eval-size", "8", "--max-num-seqs", "8"]
    hf = evaluate.main(argv)
    vllm = evaluate.main([*argv, "--rollout", "vllm"])
    assert vllm == hf and len(made) == 1
    assert made[0]["calls"] >= 1 and made[0]["closed"] and made[0]["max_model_len"] == 256
    assert made[0]["max_num_seqs"] == 8 and made[0]["path"].endswith("base_model")


def test_a_prompt_past_max_prompt_tokens_keeps_its_last_tokens_said_once(capsys, monkeypatch):
    # TRL's max_prompt_length: the end of the prompt (the question and the generation prompt)
    # stays; said on the first cut; the flag reaches both commands' encoders
    import evaluate
    from infra import builtin, data
    tok = builtin.make_tokenizer()
    fmt = data.PromptFormatter(tok, max_tokens=5)
    full = data.PromptFormatter(tok)("2x + 3 = 11")
    assert fmt("2x + 3 = 11") == full[-5:] and fmt("1") == data.PromptFormatter(tok)("1")
    fmt("4x + 3 = 11")
    err = capsys.readouterr().err
    assert err.count("--max-prompt-tokens 5") == 1 and fmt.cut == 2
    seen = []
    real = data.PromptFormatter.__call__
    monkeypatch.setattr(data.PromptFormatter, "__call__",
                        lambda self, p: seen.append(self.max_tokens) or real(self, p))
    evaluate.main(["--eval-size", "2", "--max-prompt-tokens", "7"])
    assert seen and set(seen) == {7}
