"""What a run at the recipes' scale checks instead of quietly doing something else
(harness/rollout.py, harness/vllm_rollout.py, harness/data.py): the model's context against prompt +
--max-new-tokens in both commands and in the engine, duplicated evaluation rows.

    python -m pytest -q tests/test_scale.py
"""
from __future__ import annotations

import sys
import types

import pytest

from harness import rollout
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


def test_an_engines_rollout_is_refused_a_prompt_past_the_context():
    # Step 1 through an engine (--rollout vllm: a stand-in for Engine.sample_groups here) checks the
    # longest prompt + --max-new-tokens against the model's context as the built-in sampler does,
    # before the engine is asked (it would cap the responses, silently "truncated")
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         max_position_embeddings=64))
    asked = []
    engine = lambda model, prompts, G, T, *a, **k: asked.append((prompts, T)) or "rollout"  # noqa
    args = SimpleNamespace(max_new_tokens=40, max_num_seqs=None, bf16=False)
    for sample in (engine, None):
        with pytest.raises(InputError, match=r"\(30 tokens\) \+ --max-new-tokens 40 = 70"):
            rollout.sample_rollout(model, [[3] * 5, [3] * 30], 2, 1.0, 1.0, None, [1], 0, args,
                                   sample)
    assert asked == []
    assert rollout.sample_rollout(model, [[3] * 24], 2, 1.0, 1.0, None, [1], 0, args,
                                  engine) == "rollout" and asked == [([[3] * 24], 40)]


def test_the_vllm_engine_is_told_the_models_context(monkeypatch):
    # a stand-in for vllm.LLM records what the engine is built with: max_model_len is the model's
    # context (vLLM would otherwise cap the responses at its own limit, silently "truncated")
    from harness import vllm_rollout
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

    from harness import data

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


def test_eval_size_counts_distinct_rows_with_copies_interleaved(tmp_path):
    # DAPO-Math-17k's shape: each problem's copies interleaved with new problems (p0 p1 p0 p2 p1 p0
    # ...), not the distinct rows first. --eval-size 5 evaluates the first 5 distinct problems, in
    # order, however many rows that reads (here 10), not the distinct ones among the first 5 read
    import json

    from harness import data
    stream = [i - k for i in range(8) for k in range(min(i, 2) + 1)]      # 0 1 0 2 1 0 3 2 1 ...
    assert sorted(set(stream[:5])) == [0, 1, 2]                           # 5 read: 3 distinct
    path = tmp_path / "interleaved.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"problem {i}", "answer": str(i)}) + "\n"
                            for i in stream))
    said = []
    rows = data.load_rows(str(path), "eval", limit=5, say=said.append)
    assert [r["prompt"] for r in rows] == [f"problem {i}" for i in range(5)]
    read = stream.index(4) + 1
    assert said == [f"{path}: 5 of {read} rows read evaluated ({read - 5} repeat an earlier row's "
                    f"prompt and answer and are evaluated once, the first 5 (--eval-size))"]


def test_final_is_saved_in_the_dtype_the_model_came_in(tmp_path, tiny_run_inputs):
    # a hub model in bfloat16 trains in float32 masters; OUT/final was written in float32 (a 7B:
    # 30 GB instead of 15); now in the dtype it came in, config.json saying so
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from harness import models
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
    from harness import vllm_rollout
    from sampler import sample_groups
    made = []

    class Engine:
        def __init__(self, path, device, bf16, seed, util, max_num_seqs, max_model_len, tp,
                     fp32_head, sleep_mode):
            made.append({"path": path, "max_model_len": max_model_len, "calls": 0,
                         "closed": False, "max_num_seqs": max_num_seqs, "util": util, "tp": tp,
                         "sleep_mode": sleep_mode})

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
    assert (made[0]["util"], made[0]["tp"], made[0]["sleep_mode"]) == (
        vllm_rollout.CPU_MEMORY_UTILIZATION, 1, False)


def test_a_prompt_past_max_prompt_tokens_keeps_its_last_tokens_said_once(capsys, monkeypatch):
    # TRL's max_prompt_length: the end of the prompt (the question and the generation prompt)
    # stays; said on the first cut; the flag reaches both commands' encoders
    import evaluate
    from harness import builtin, data
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


def test_the_engines_memory_share_defaults_to_what_the_trainer_leaves(monkeypatch):
    # The engine sleeps through the update, so while it samples the trainer holds its weights,
    # AdamW's two moments, the reference and under DDP its gradient buckets (gradients freed): on
    # an 80 GiB GPU a 1.5B policy in float32 under DDP with a reference keeps 1.5e9 x (4 + 8 + 4 +
    # 4) B = 27.9 GiB, leaving the engine 1 - 27.9 / 80 - 0.1 = 0.55 of it (0.3, TRL's, was the
    # fixed default); under --fsdp on 8 ranks an eighth of all but the buckets (it has none); a GPU
    # the trainer nearly fills is refused in one line
    import torch

    from harness import vllm_rollout as vr
    GIB = 2**30
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10, bias=False))
    model[1].requires_grad_(False)                      # a frozen part: no AdamW moments
    n, trained = 100 * 100 + 100 + 1000, 100 * 100 + 100
    assert vr.trainer_resident_bytes(model) == 4 * n + 8 * trained
    assert vr.trainer_resident_bytes(model, 2, reference=True) == (8 * n + 8 * trained) // 2
    assert vr.trainer_resident_bytes(model, optimizer=False) == 4 * n      # evaluate.py
    # DDP's gradient buckets (one float32 gradient of the trained parameters) stay allocated
    assert vr.trainer_resident_bytes(model, ddp=True) == 4 * n + 12 * trained
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * GIB))
    ddp, fsdp = 1.5e9 * (4 + 8 + 4 + 4), 1.5e9 * (4 + 8 + 4) / 8
    assert vr.default_memory_utilization(ddp, "cuda:0") == pytest.approx(1 - ddp / 80 / GIB - 0.1)
    assert vr.default_memory_utilization(ddp, "cuda:0") == pytest.approx(0.551, abs=1e-3)
    assert vr.default_memory_utilization(fsdp, "cuda:3") == pytest.approx(0.865, abs=1e-3)
    assert vr.default_memory_utilization(0, "cuda") == 0.9
    assert vr.default_memory_utilization(ddp, "cpu") == vr.CPU_MEMORY_UTILIZATION
    with pytest.raises(InputError, match="leaves the engine no room"):
        vr.default_memory_utilization(7.6e9 * 12, "cuda:0")       # 7B unsharded: 85 GiB
    # engine_for hands the default to vLLM, or the flag where given
    seen = {}
    fake = types.SimpleNamespace(LLM=lambda **kw: seen.update(kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    args = types.SimpleNamespace(bf16=True, seed=0, vllm_gpu_memory_utilization=None,
                                 max_num_seqs=None, fp32_lm_head=False)
    vr.engine_for("some/model", model, args, "cuda:0", int(ddp))
    assert seen["gpu_memory_utilization"] == pytest.approx(0.551, abs=1e-3)
    args.vllm_gpu_memory_utilization = 0.45
    vr.engine_for("some/model", model, args, "cuda:0", int(ddp))
    assert seen["gpu_memory_utilization"] == 0.45


class _GroupLLM:
    """Stands in for vllm.LLM: records its construction and each generate call's requests; a
    request's response is a function of its prompt and seed alone, ended by id 2."""
    built, asked = {}, []

    def __init__(self, **kw):
        _GroupLLM.built = kw

    def generate(self, requests, params, use_tqdm=False):
        _GroupLLM.asked.append([(tuple(r["prompt_token_ids"]), p.seed)
                                for r, p in zip(requests, params)])
        outs = []
        for r, p in zip(requests, params):
            L = 1 + (sum(r["prompt_token_ids"]) + p.seed) % 4
            ids = [3 + (p.seed + k) % 5 for k in range(L - 1)] + [2]
            lps = [{t: types.SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(ids)]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids,
                                                                              logprobs=lps)]))
        return outs


def test_tensor_parallel_engines_sample_the_groups_prompts_together(monkeypatch):
    # --vllm-tensor-parallel-size 2 on 4 ranks: vLLM gets tensor_parallel_size=2, and the 2 ranks
    # of a group each ask the engine for the group's prompts, in rank order (a TP engine's ranks
    # must run the same requests); each keeps its own responses, which equal what an engine of its
    # own (TP 1) draws for its prompts with their seeds
    import torch

    from harness import vllm_rollout as vr
    fake = types.SimpleNamespace(LLM=_GroupLLM,
                                 SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("WORLD_SIZE", "4")
    prompts = {0: [[5, 6, 7], [9] * 130], 1: [[4, 4], [8, 1, 8], [6]]}     # unequal shares
    gens = lambda r: [torch.Generator().manual_seed(10 * r + j) for j in range(len(prompts[r]))]  # noqa: E731
    seeds = {r: vr._seeds(gens(r), len(prompts[r])) for r in prompts}
    items = {r: [(list(p), s) for p, s in zip(prompts[r], seeds[r])] for r in prompts}
    G, rolls = 3, {}
    for r in (0, 1):
        monkeypatch.setattr(vr, "_group_gather", lambda tp, r=r: (
            lambda mine: [mine if q == r else items[q] for q in (0, 1)], r))
        engine = vr.Engine("m", "cpu", bf16=False, seed=0, gpu_memory_utilization=0.3,
                           tensor_parallel_size=2)
        assert _GroupLLM.built["tensor_parallel_size"] == 2
        rolls[r] = engine.sample_groups(None, prompts[r], G, 6, 2, 0, generator=gens(r))
    group = [(tuple(p), s + i) for r in (0, 1) for p, s in items[r] for i in range(G)]
    assert _GroupLLM.asked[-2:] == [group, group]
    monkeypatch.setenv("WORLD_SIZE", "1")
    for r in (0, 1):
        alone = vr.Engine("m", "cpu", bf16=False, seed=0, gpu_memory_utilization=0.3)
        own = alone.sample_groups(None, prompts[r], G, 6, 2, 0, generator=gens(r))
        assert (torch.equal(own.response_ids, rolls[r].response_ids)
                and torch.equal(own.lengths, rolls[r].lengths)
                and torch.equal(own.logprobs, rolls[r].logprobs)), r
    # lengths differ across the group's responses: a wrong slice would show
    assert len(set(rolls[0].lengths.tolist() + rolls[1].lengths.tolist())) > 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InputError, match="does not divide the 3 ranks"):
        vr.Engine("m", "cpu", bf16=False, seed=0, gpu_memory_utilization=0.3,
                  tensor_parallel_size=2)


def test_train_hands_the_engine_its_tensor_parallel_size_and_the_trainers_share(monkeypatch):
    # the flags reach the engine: --vllm-tensor-parallel-size, and under --fsdp on 4 ranks with a
    # reference, a quarter of (weights + reference + AdamW) as what the trainer keeps
    import torch

    from harness import flags, setup, vllm_rollout
    seen = []
    monkeypatch.setattr(vllm_rollout, "engine_for", lambda *a: seen.append(a))
    args = flags.parse_train_args(["--rollout", "vllm", "--vllm-tensor-parallel-size", "2",
                                   "--fsdp", "--beta", "0.04"], "")
    model = torch.nn.Linear(10, 10)                                     # 110 float32 parameters
    setup.start_engine(args, "m", model, types.SimpleNamespace(world=4, device="cuda:1"))
    assert seen[0][3:] == ("cuda:1", 110 * (4 + 4 + 8) // 4, 2)
    # under DDP the whole of each, and DDP's gradient buckets
    args.fsdp = False
    setup.start_engine(args, "m", model, types.SimpleNamespace(world=4, device="cuda:1"))
    assert seen[1][3:] == ("cuda:1", 110 * (4 + 4 + 8 + 4), 2)
