"""What is measured (harness/perf.py, harness/metrics.py) and the optional integrations
(harness/lora.py):
model FLOPs and MFU, the no-signal warning, --report-to, LoRA.

    python -m pytest -q tests/test_metrics.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import pytest
import torch

import sampler
import update
from harness import builtin, data, flags, metrics, models
from helpers import INSTRUCTION, LONG_PROMPTS, one_step, read_file, spy_on, tiny_flags, weights_of
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

# ---------------------------------------------------------------------------------------------
# harness/perf.py: model FLOPs by hand and as torch's FLOP counter sees the code run, the peak, MFU
# rows
# ---------------------------------------------------------------------------------------------

def _tiny_qwen2(**kw):
    """2 layers, d_model 16, 4 query heads of 4 over 2 KV heads (GQA), MLP 24, V 50, tied."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, **kw)).eval()


def _hand_rollout() -> Rollout:
    """2 prompts of 3 and 5 tokens, G = 2, responses of 2, 4 and 1, 3 tokens padded to 4."""
    lengths = torch.tensor([2, 4, 1, 3])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()                 # [4, 4]
    return Rollout(prompts=[[5, 6, 7], [8, 9, 10, 11, 12]], G=2, pad_token_id=0,
                   response_ids=torch.where(mask > 0, 3, 0), mask=mask, lengths=lengths,
                   truncated=torch.zeros(4, dtype=torch.bool), logprobs=torch.zeros(4, 4))


def test_flops_of_a_tiny_qwen2_with_gqa_and_lora_by_hand():
    from harness import perf
    sh = perf.model_shape(_tiny_qwen2())
    # a layer's matmuls (multiply-accumulates a token): q 16x16, k and v 16x(2 KV heads x 4), o,
    # gate, up, down 16x24; the LM head is the tied embedding, 16 x 50; d_attn 4 heads x 4
    layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 3 * 16 * 24
    assert sh == perf.Shape(body=2 * layer, trained=2 * layer, adapters=0, head=16 * 50,
                            head_trained=True, layers=2, d_attn=16)
    roll = _hand_rollout()
    # Step 1: each prompt prefilled once (contexts 1..3, 1..5), then every response token but the
    # last fed at contexts p+1.. (L = 2: 4; L = 4: 4, 5, 6; L = 1: none; L = 3: 6, 7); a logit per
    # prefill and per fed token
    tokens, context, logits = 3 + 5 + 1 + 3 + 0 + 2, 6 + 15 + 4 + 15 + 0 + 13, 2 + 1 + 3 + 0 + 2
    assert perf.forward_flops(sh, perf.rollout_work(roll)) == (
        2 * 2 * layer * tokens + 4 * 2 * 16 * context + 2 * 16 * 50 * logits)
    # the training forward, one micro-batch: the prompts but their last token once (contexts 1..2,
    # 1..4), each response from that token on (contexts 3..4, 3..6, 5, 5..7); a logit per response
    # token. Split after row 0, group 0's prompt runs twice; per response, each its own prompt.
    one, split, own = [slice(0, 4)], [slice(0, 1), slice(1, 4)], [slice(0, 4)]
    assert perf.forward_work(roll, one, True) == perf.Work(2 + 4 + 2 + 4 + 1 + 3,
                                                           3 + 10 + 7 + 18 + 5 + 18, 10)
    assert perf.forward_work(roll, split, True) == perf.Work(2 + 2 + (2 + 4 + 4 + 1 + 3),
                                                             3 + 7 + (3 + 10 + 18 + 5 + 18), 10)
    assert perf.forward_work(roll, own, False) == perf.Work(4 + 6 + 5 + 7, 10 + 21 + 15 + 28, 10)
    # full fine-tuning: the backward is 2x the forward, the update 3x
    w = perf.forward_work(roll, one, True)
    assert perf.train_flops(sh, w) == 3 * perf.forward_flops(sh, w)
    # LoRA r = 2 on q and v: A [2, 16] and B [16, 2] on q, B [8, 2] on v, a layer; the base weights
    # and the tied head frozen: 2x their forward (activation gradients), the adapters and attention
    # 3x; the reference pass runs without the adapters
    pytest.importorskip("peft", reason="LoRA needs peft")
    from harness import lora
    model = _tiny_qwen2()
    lora.add_adapters(model, 2, 4.0, "q_proj,v_proj", "tiny")
    ad = 2 * (16 * 2 + 2 * 16 + 16 * 2 + 2 * 8)
    sl = perf.model_shape(model)
    assert sl == perf.Shape(2 * layer + ad, ad, ad, 16 * 50, False, 2, 16)
    assert perf.train_flops(sl, w) == (2 * (2 * layer + ad) * 16 + 2 * (2 * layer + ad) * 16
                                       + 2 * ad * 16 + 3 * 4 * 2 * 16 * 61 + 2 * 2 * 800 * 10)
    assert perf.forward_flops(sl, w, adapters=False) == perf.forward_flops(sh, w)


def test_flop_count_is_what_the_sampler_and_the_training_forward_run():
    # torch's FLOP counter on the code itself (eager attention: QK^T and AV as bmm), prompts of 143
    # tokens sharing 140 (equal lengths: no left-padding): Step 1's matmuls are exactly the count
    # (finished rows leave the batch; a decode step's rows attend exactly their own context), but
    # for the prefill, whose causal mask hides half of the p x p scores it computes
    from torch.utils.flop_counter import FlopCounterMode

    from harness import perf
    model = _tiny_qwen2(attn_implementation="eager")
    sh, p = perf.model_shape(model), len(LONG_PROMPTS[0])
    prompts = [INSTRUCTION + [5, 6, 7], INSTRUCTION + [8, 9, 10]]

    linear = {f"{type(model).__name__}.{n}" for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear)}

    def counted(fn) -> tuple[float, float]:
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            out = fn()
        counts = {mod: {str(k): v for k, v in c.items()} for mod, c in fc.get_flop_counts().items()}
        total = sum(counts["Global"].values())
        # attention: the bmm outside the Linear modules (a Linear on a 3-D input may run as a bmm:
        # the prefill's last position through the head does, under the sampler's inference mode)
        attn = counts["Global"].get("aten.bmm", 0) - sum(counts[m].get("aten.bmm", 0)
                                                          for m in linear & counts.keys())
        return out, attn, total - attn                                # attention, the weights'

    # packed=False: the same matmuls on the plain weights (torch's counter skips oneDNN's op)
    roll, attn, weights = counted(lambda: sample_groups(
        model, prompts, 4, 6, 1, 0, generator=torch.Generator().manual_seed(0), packed=False))
    w = perf.rollout_work(roll)
    assert roll.lengths.unique().numel() > 1 and p == 143
    assert weights == 2 * sh.body * w.tokens + 2 * sh.head * w.logits
    assert attn == 4 * sh.layers * sh.d_attn * (w.context + 2 * (p * p - p * (p + 1) // 2))
    # the training forward on 8 responses of 5 tokens (no padding) in micro-batches of 3 and 5 rows:
    # the weights' matmuls are the count plus what the code computes and drops: one logit per group
    # and micro-batch at the prompt's end (3), or per response (8) its last token and one logit
    T, g = 5, torch.Generator().manual_seed(1)
    full = Rollout(prompts=prompts, G=4, pad_token_id=0,
                   response_ids=torch.randint(2, 50, (8, T), generator=g), mask=torch.ones(8, T),
                   lengths=torch.full((8,), T), truncated=torch.ones(8, dtype=torch.bool),
                   logprobs=torch.zeros(8, T))
    micro = [slice(0, 3), slice(3, 8)]
    for shared, dropped in ((True, 3 * 2 * sh.head), (False, 8 * (2 * sh.body + 2 * sh.head))):
        _, _, weights = counted(lambda shared=shared: [
            rollout_logprobs(model, full, s, 1.0, shared_prefix=shared) for s in micro])
        w = perf.forward_work(full, micro, shared)
        assert weights == 2 * sh.body * w.tokens + 2 * sh.head * w.logits + dropped, shared


def test_peak_from_the_device_name_a_cpu_probe_or_peak_tflops():
    from harness import perf
    assert [perf.peak_tflops_of(n) for n in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100 80GB PCIe", "NVIDIA A10", "NVIDIA L40S")] == [989.4, 756.5, 989.4, 312.0,
                                                                   312.0, 125.0, 362.0]
    said = []
    # an unknown GPU (A10G is not an A10): one line said, no peak, so no MFU; --peak-tflops wins
    assert perf.peak_tflops_of("NVIDIA A10G") is None
    assert perf.peak_flops("cuda", torch.bfloat16, None, "NVIDIA A10G", said.append) is None
    assert len(said) == 1 and "NVIDIA A10G" in said[0] and "--peak-tflops" in said[0]
    assert perf.peak_flops("cuda", torch.bfloat16, 2.5, "NVIDIA A10G", said.append) == 2.5e12
    assert perf.peak_flops("cuda:0", torch.bfloat16, None, "NVIDIA H100 PCIe") == 756.5e12
    t0 = time.time()
    probe = perf.peak_flops("cpu", torch.float32, None)
    assert 1e8 < probe < 1e13 and time.time() - t0 < 5 and len(said) == 1
    assert perf.peak_flops("cpu", torch.float32, 0.01) == 1e10                 # no probe
    with pytest.raises(SystemExit) as e:
        flags.parse_train_args(["--peak-tflops", "0"])
    assert e.value.code == 2
    # no FLOPs in a phase (no old or reference pass: one update, beta 0): no MFU for it
    m = perf.Meter(perf.model_shape(_tiny_qwen2()), 1e9, world=2)
    d = {"length": 30.0, "perf:rollout": 4e9, "perf:logprob": 0.0, "perf:update": 8e9}
    row = {"time/sample_s": 1.0, "time/logprob_s": 1e-4, "time/update_s": 2.0, "time/step_s": 4.0}
    assert m.metrics(d, row) == {"perf/tokens_per_s": 7.5, "perf/flops": 12e9,
                                 "perf/mfu_rollout": 2.0, "perf/mfu_update": 2.0,
                                 "perf/mfu": 1.5}


def test_a_run_logs_mfu_per_phase_and_tokens_per_s(tiny_run_inputs, tmp_path, monkeypatch,
                                                   capsys):
    # one step of train.py in this process, with an old-policy pass (--mu 2), a reference pass
    # (beta), 2 mini-batches in micro-batches of 3 rows (groups of 4 split) and --peak-tflops: the
    # row's FLOPs are the step's counts, its MFU those over the phase's seconds and that peak
    from harness import perf
    updates = spy_on(monkeypatch, update, "update_policy")
    peak = 0.02e12
    row = one_step(tiny_run_inputs, tmp_path / "run", "--peak-tflops", "0.02", "--mu", "2",
                    "--beta", "0.04", "--mini-batches", "2", "--micro-batch-size", "3")
    (_, roll, *_), stats = updates.pop()
    sh = perf.model_shape(models.load_model(str(tiny_run_inputs / "model"))[2])
    assert stats.micro == [slice(a, b) for a, b in ((0, 3), (3, 6), (6, 8), (8, 11), (11, 14),
                                                    (14, 16))]       # 2 mini-batches of 8 rows
    nograd = perf.forward_flops(sh, perf.forward_work(roll, stats.micro, True))
    flops = {"rollout": perf.forward_flops(sh, perf.rollout_work(roll)),  # one round, all kept
             "logprob": 2 * nograd,                                       # old and reference
             "update": 2 * perf.train_flops(sh, perf.forward_work(roll, stats.micro, True))}
    assert row["perf/flops"] == pytest.approx(sum(flops.values()), rel=1e-6)
    for phase, t in (("rollout", "sample"), ("logprob", "logprob"), ("update", "update")):
        assert row[f"perf/mfu_{phase}"] == pytest.approx(flops[phase] / row[f"time/{t}_s"] / peak,
                                                         rel=1e-6)
    assert 0 < row["perf/mfu"] == pytest.approx(row["perf/flops"] / row["time/step_s"] / peak)
    # tokens/s: the step's sampled response tokens (4 prompts x G 4) over the step's seconds
    assert row["perf/tokens_per_s"] * row["time/step_s"] == pytest.approx(row["len/mean"] * 16)
    assert f"mfu={100 * row['perf/mfu']:.3g}%" in capsys.readouterr().err  # the progress bar
    glossary = read_file(os.path.join(HERE, "docs", "metrics.md"))
    assert all(f"`{k}`" in glossary for k in row if k.startswith("perf/"))


def test_the_progress_bar_ends_at_the_last_step(tiny_run_inputs, tmp_path, capsys):
    """The loop breaks out of tqdm's iteration at its last step, before tqdm counts it: the bar
    counts it itself and closes, so a finished run's bar reads N/N (it read N-1/N), and a run
    --max-samples stops early reads the steps it ran."""
    import train
    train.main([*tiny_flags(tiny_run_inputs, tmp_path / "a"), "--steps", "2", "--eval-every", "5"])
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "2/2 [" in err and "100%" in err, err[-400:]
    train.main([*tiny_flags(tiny_run_inputs, tmp_path / "b"), "--steps", "5", "--eval-every", "5",
                "--no-dynamic-sampling", "--max-samples", "16"])      # one step: 4 prompts x G 4
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()
    assert any("1/5 [" in x for x in last) and not any("2/5 [" in x for x in last), last[-3:]


def x_if_even(response: str, answer: str) -> float:
    """has_x where the answer is even, else 0: groups of odd answers all wrong (dynamic sampling
    drops them and draws again), the others mixed."""
    return float("x" in response) if int(answer) % 2 == 0 else 0.0


def test_mfu_counts_every_round_drawn_and_the_reference_without_adapters(tiny_run_inputs,
                                                                          tmp_path, monkeypatch):
    # Step 1's FLOPs are those of every rollout dynamic sampling drew, kept or dropped (odd answers'
    # groups are all wrong under x_if_even: dropped, and more drawn); with LoRA and beta > 0 the
    # reference pass runs with the adapters off, and perf:logprob counts it so. Each count differs
    # from the other one (the kept rows alone; the adapters in), so the check can fail.
    from harness import perf
    draws = spy_on(monkeypatch, sampler, "sample_groups")
    counted = spy_on(monkeypatch, perf.Meter, "flops")
    import train
    run = tiny_flags(tiny_run_inputs, tmp_path / "ds")
    run[run.index("test_grpo:has_x")] = "test_metrics:x_if_even"    # --reward takes several
    train.main([*run, "--steps", "1", "--eval-every", "5", "--algo", "dapo", "--max-rounds", "6"])
    (meter, roll, *_), got = counted.pop()
    drawn = [r for a, r in draws if a[2] > 1]          # G > 1: the training rounds, not evaluation
    rows = sum(r.response_ids.shape[0] for r in drawn)
    assert len(drawn) > 1 and rows > roll.response_ids.shape[0], (len(drawn), rows)
    every = sum(perf.forward_flops(meter.shape, perf.rollout_work(r)) for r in drawn)
    assert got["perf:rollout"] == pytest.approx(every, rel=1e-9)
    assert got["perf:rollout"] > 1.01 * perf.forward_flops(meter.shape, perf.rollout_work(roll))
    pytest.importorskip("peft", reason="--lora-r needs peft")
    one_step(tiny_run_inputs, tmp_path / "lora", "--lora-r", "2", "--beta", "0.04")
    (meter, roll, _, stats, *_), got = counted.pop()
    assert meter.shape.adapters > 0
    nograd = perf.forward_work(roll, stats.micro, True)                 # one update: no old pass
    assert got["perf:logprob"] == pytest.approx(
        perf.forward_flops(meter.shape, nograd, adapters=False), rel=1e-9)
    assert got["perf:logprob"] < perf.forward_flops(meter.shape, nograd, adapters=True)


# ---------------------------------------------------------------------------------------------
# harness/metrics.py, harness/lora.py and the optional integrations: the no-signal warning,
# --report-to,
# LoRA
# ---------------------------------------------------------------------------------------------

def _signal_row(step, correct, zero_std, kept=None, truncated=0.0):
    row = {"step": step, "reward/correct": correct, "reward/frac_zero_std": zero_std,
           "len/truncated_frac": truncated}
    return row if kept is None else {**row, "sampling/groups_kept": kept, "sampling/rounds": 4.0}


def test_no_learning_signal_is_said_once_with_its_likely_causes():
    grpo_args, dapo_args = (flags.parse_train_args(["--algo", "grpo"]),
                            flags.parse_train_args(["--algo", "dapo", "--max-rounds", "4"]))
    # GRPO: every group's rewards equal (all advantages 0) at steps 1 and 2: said once; nothing
    # right in 3 steps
    check = metrics.SignalCheck(grpo_args)
    said = [check(_signal_row(s, 0.0, 1.0, truncated=1.0)) for s in (1, 2)]
    assert len(said[0]) == 1 and said[1] == [] and check.silent
    msg = said[0][0]
    assert (msg.startswith("warning: no learning signal at step 1: every group's 8 rewards are "
                           "equal") and "\n" not in msg)
    for cause in ("Answer:", "--prompt-template", "--reward verifier", "--max-new-tokens 40",
                  "len/truncated_frac 1.00"):
        assert cause in msg, cause
    third = check(_signal_row(3, 0.0, 1.0))
    assert (len(third) == 1 and "no sample of the first 3 steps scored above 0" in third[0]
            and check(_signal_row(4, 0, 1)) == [])
    # DAPO: dynamic sampling kept nothing in --max-rounds rounds; a step that kept groups trains
    # (not silent)
    check = metrics.SignalCheck(dapo_args)
    assert check(_signal_row(1, 0.25, 0.5, kept=3.0)) == [] and not check.silent
    said = check(_signal_row(2, 1.0, 1.0, kept=0.0))
    assert (len(said) == 1 and "dynamic sampling kept no group in --max-rounds 4 rounds" in said[0]
            and check.silent)
    assert "every sample is right" in said[0]
    # once a run; and some samples scored: no "none right"
    assert check(_signal_row(3, 0.5, 1.0, kept=0.0)) == []
    mixed = metrics.SignalCheck(grpo_args)(_signal_row(1, 0.5, 1.0))
    # groups all right or all wrong, half of them right
    assert len(mixed) == 1 and "--group-size" in mixed[0]


def test_none_right_in_three_steps_is_no_silent_step_when_rewards_differ():
    # GRPO + --format-weight: no answer is right (reward/correct 0) but half the groups' rewards
    # differ, so the steps train (advantages != 0). Step 3 says "none right", and is still not a
    # step that trained nothing (train.py's bar shows signal=none for those only); a step whose
    # groups are all equal is one, after it.
    check = metrics.SignalCheck(flags.parse_train_args(["--algo", "grpo", "--format-weight",
                                                        "0.5"]))
    said, silent = [], []
    for step in (1, 2, 3, 4):
        said.append(check(_signal_row(step, 0.0, 0.5)))
        silent.append(check.silent)
    assert said[:2] == [[], []] and said[3] == [] and silent == [False] * 4
    assert len(said[2]) == 1
    assert said[2][0].startswith("warning: no learning signal at step 3: no sample of the first 3")
    assert "(this step trained nothing)" not in said[2][0]
    assert check(_signal_row(5, 0.0, 1.0)) != [] and check.silent     # every group equal: silent
    assert check(_signal_row(6, 0.0, 0.5)) == [] and not check.silent  # the next step trains again


def test_report_to_wandb_logs_each_row_at_its_step(tiny_run_inputs, tmp_path, monkeypatch):
    # a stand-in wandb module records what LiveCurves calls; one step of train.py in this process:
    # wandb gets every metrics.jsonl row (eval rows too: step 1 holds two, the update's and the
    # eval's) at its step, the config once, and the run is finished
    import types
    calls = []

    class Run:
        def log(self, scalars, step=None, **kw):
            calls.append(("log", dict(scalars), step, kw))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    out = tmp_path / "w"                              # the run is named after its folder
    one_step(tiny_run_inputs, out, "--report-to", "wandb")
    (_, kw), *logs, finish = calls
    assert kw == {"project": "grpo-dapo", "name": "w", "dir": str(out),
                  "config": json.loads((out / "config.json").read_text())} and finish == ("finish",)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [c[0] for c in logs] == ["log"] * len(rows) and all(c[3] == {} for c in logs)
    assert [(c[2], c[1]) for c in logs] == [(r["step"], {k: v for k, v in r.items() if k != "step"})
                                            for r in rows]
    assert [c[2] for c in logs] == [0, 1, 1]


def test_report_to_a_missing_package_is_one_line(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    import train
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as e:
        train.main([*tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1", "--report-to",
                    "wandb"])
    err = capsys.readouterr().err.strip()
    assert (e.value.code == 2 and err == "error: --report-to wandb: the wandb package is not "
            "installed (pip install wandb)")


def _lora_model(d, r=4):
    """The tiny model with rank-r adapters whose B is random (peft starts B at 0: the adapters would
    be a no-op)."""
    from harness import lora
    path, tok, model = models.load_model(str(d / "model"))
    config = lora.add_adapters(model, r, 2.0 * r, lora.TARGETS, path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tok, model, config


def test_lora_trains_only_adapters_and_its_reference_is_the_base_model(tiny_run_inputs):
    pytest.importorskip("peft", reason="--lora-r needs peft")
    from harness import lora
    tok, model, _ = _lora_model(tiny_run_inputs)
    _, _, base = models.load_model(str(tiny_run_inputs / "model"))
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    # A and B of 7 projections in 2 layers
    assert len(adapters) == 2 * 7 * 2
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in builtin.sample_problems(3, 2, True)],
                         2, 8, eos, tok.pad_token_id, temperature=1.0,
                         generator=torch.Generator().manual_seed(1))
    rows = slice(0, 6)
    logp, _, mask = rollout_logprobs(model, roll, rows, 1.0)
    (logp * mask).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None
             and p.grad.abs().sum() > 0}
    # every adapter, nothing else
    assert grads == adapters
    with torch.no_grad():
        with lora.adapters_off(model):
            ref = rollout_logprobs(model, roll, rows, 1.0)[0]
        again = rollout_logprobs(model, roll, rows, 1.0)[0]
        want = rollout_logprobs(base, roll, rows, 1.0)[0]
    # the reference is the base model
    assert torch.allclose(ref, want, atol=1e-6)
    # which the adapted policy is not
    assert (logp.detach() - want).abs().max() > 1e-3
    assert (torch.equal(again, logp.detach())
            and {n for n, p in model.named_parameters() if p.requires_grad} == adapters)


def test_lora_freezes_the_base_itself_and_an_update_moves_only_the_adapters(tiny_run_inputs,
                                                                            monkeypatch):
    # peft.inject_adapter_in_model documents the injection only (peft 0.21 also freezes the rest, as
    # get_peft_model does); add_adapters freezes every base weight itself, so here peft leaves all
    # trainable. Then one update as train.py builds it (AdamW over the parameters that require grad,
    # weight decay on, beta > 0 with the adapters off as the reference; the step's 3 groups in 2
    # mini-batches): every base weight is bit-for-bit unchanged, every A and B has moved.
    import contextlib
    from types import SimpleNamespace

    from harness import lora
    from infra import parallel
    peft = pytest.importorskip("peft", reason="--lora-r needs peft")
    inject = peft.inject_adapter_in_model

    def leaves_all_trainable(config, model, adapter_name="default"):
        out = inject(config, model, adapter_name=adapter_name)
        model.requires_grad_(True)
        return out
    monkeypatch.setattr(peft, "inject_adapter_in_model", leaves_all_trainable)
    tok, model, _ = _lora_model(tiny_run_inputs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = {n for n in before if ".lora_" not in n}
    assert len(base) == len(before) - 28                          # A and B of 14 projections
    assert not any(model.get_parameter(n).requires_grad for n in base)
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    prompts = [encode(r["prompt"]) for r in builtin.sample_problems(3, 2, True)]
    roll = sample_groups(model, prompts, 4, 8, eos, tok.pad_token_id, temperature=1.0,
                         generator=torch.Generator().manual_seed(1))
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    args = SimpleNamespace(micro_batch_size=5,
                           micro_batch_tokens=10**6, mini_batches=2, mu=1, temperature=1.0,
                           reduction="token", loss="ppo", fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=8, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                           off_policy_mask=0.0, top_p=1.0,
                           entropy_coef=0.0, beta=0.04, kl="k3", grad_clip=1.0)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    learner = update.Learner(model, model, model, opt, contextlib.nullcontext,
                             lambda: lora.adapters_off(model))
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(2))
    update.update_policy(learner, roll, advantages, roll.mask, args, parallel.Dist("cpu"))
    after = dict(model.named_parameters())
    assert [n for n in base if not torch.equal(after[n], before[n])] == []            # untouched
    assert [n for n in before if n not in base and torch.equal(after[n], before[n])] == []  # moved
    assert not any(after[n].requires_grad for n in base)                              # still frozen


def test_lora_merged_final_is_base_plus_adapter_and_the_adapter_loads_alone(tiny_run_inputs,
                                                                            tmp_path):
    peft = pytest.importorskip("peft", reason="--lora-r needs peft")
    from transformers import AutoModelForCausalLM

    from harness import lora
    tok, model, config = _lora_model(tiny_run_inputs)
    model.save_pretrained(tmp_path / "final", state_dict=lora.merged_state_dict(model))
    lora.save_adapter(model, config, str(tmp_path / "adapter"))
    merged, base = weights_of(tmp_path / "final"), weights_of(tiny_run_inputs / "model")
    sd, adapted = model.state_dict(), 0
    for k in base:
        prefix = k.removesuffix(".weight")
        # W + alpha / r * B A, by hand
        if f"{prefix}.lora_A.default.weight" in sd:
            A, B = sd[f"{prefix}.lora_A.default.weight"], sd[f"{prefix}.lora_B.default.weight"]
            assert torch.allclose(merged[k], base[k] + 2.0 * B @ A, atol=1e-6), k
            assert (merged[k] - base[k]).abs().max() > 1e-3
            adapted += 1
        else:
            assert torch.equal(merged[k], base[k]), k
    assert adapted == 14
    ids = torch.tensor([tok("2x+4=10\n")["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")(input_ids=ids).logits
        alone = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_run_inputs / "model"),
            tmp_path / "adapter")(input_ids=ids).logits
    assert torch.allclose(plain, want, atol=1e-5) and torch.allclose(alone, want, atol=1e-5)


def test_lora_flags_fail_with_one_line(tiny_run_inputs, tmp_path, capsys, monkeypatch):
    import importlib.util

    import train
    run = [*tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1"]
    for extra, message in ((["--lora-r", "4", "--fsdp"], "--lora-r with --fsdp is not supported"),
                           (["--lora-r", "-1"], "--lora-r must be >= 0"),
                           (["--lora-r", "4", "--lora-target-modules", "wq,wk"],
                            "--lora-target-modules wq,wk: ")):
        if "wq,wk" in extra and importlib.util.find_spec("peft") is None:  # the others need no peft
            continue
        with pytest.raises(SystemExit) as e:
            train.main([*run, *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(SystemExit) as e:
        train.main([*run, "--lora-r", "4"])
    assert (capsys.readouterr().err.strip()
            == "error: --lora-r: the peft package is not installed (pip install peft)")
    assert (flags.parse_train_args(["--lora-r", "8"]).lora_alpha == 16
            and flags.parse_train_args(["--lora-r", "8"]).lr == 2e-3)


def _update_stats(first: dict, rest: dict, mismatch_max: float = 0.0):
    zero = dict.fromkeys(update.UPDATE_SUMS, 0.0)
    return update.UpdateStats({**zero, **first}, {**zero, **rest}, mismatch_max, logprob_s=0.0,
                              update_s=0.0)


def test_step_metrics_worked_by_hand():
    # one step, summed over ranks: 2 groups of G = 4 drawn (8 samples), 2 optimizer updates (--mu 2,
    # one mini-batch), 10 loss tokens a pass; a --reward component "fmt" scored 6 of the 8 samples,
    # "len" none
    d = {"samples": 8.0, "reward": 2.0, "correct": 3.0, "length": 40.0, "truncated": 2.0,
         "groups": 2.0, "groups_zero_std": 1.0, "groups_all_correct": 0.0, "groups_all_wrong": 1.0,
         "reward/fmt": 1.5, "scored:reward/fmt": 6.0, "reward/len": 0.0, "scored:reward/len": 0.0}
    first = {"loss": 0.5, "kl": 0.2, "tokens": 10.0, "entropy": 6.0, "entropy_tokens": 12.0,
             "grad_norm": 3.0,
             "updates": 1.0, "mismatch/abs": 0.6, "mismatch/kl": 0.12, "mismatch/tokens": 12.0,
             # the first update: ratio 1
             "clip/low_frac": 0.0, "clip/high_frac": 0.0, "ratio/mean": 10.0}
    rest = {"loss": 0.3, "kl": 0.4, "tokens": 10.0, "grad_norm": 1.0, "updates": 1.0,
            "clip/low_frac": 1.0, "clip/high_frac": 2.0, "clip/dual_frac": 0.5, "ratio/mean": 10.5}
    row = metrics.step_metrics(d, _update_stats(first, rest, 0.25), mu=2, clip_c=3.0)
    assert row == pytest.approx({
        "loss": 0.4,                     # (0.5 + 0.3) / 2 updates
        "reward/mean": 0.25,             # 2 / 8 samples
        "reward/correct": 0.375,         # 3 / 8
        "reward/frac_zero_std": 0.5,     # 1 / 2 groups
        "groups/all_correct": 0.0,       # 0 / 2
        "groups/all_wrong": 0.5,         # 1 / 2
        "reward/fmt": 0.25,              # 1.5 / the 6 samples it scored ("len" scored none: no key)
        "kl": 0.03,                      # (0.2 + 0.4) / 20 loss tokens of both updates
        "entropy": 0.5,                  # 6 / 12 tokens, counted in the first pass only
        "mismatch/logp_abs_mean": 0.05,  # 0.6 / 12
        "mismatch/logp_abs_max": 0.25,   # as update_policy gave it
        "mismatch/kl": 0.01,             # 0.12 / 12
        # 1 / the 10 tokens of the off-policy update (the first is left out)
        "clip/low_frac": 0.1,
        "clip/high_frac": 0.2,           # 2 / 10
        "ratio/mean": 1.05,              # 10.5 / 10
        "clip/dual_frac": 0.05,          # 0.5 / 10 (--clip-c is on)
        "len/mean": 5.0,                 # 40 / 8
        "len/truncated_frac": 0.25,      # 2 / 8
        "tokens/in_loss": 10.0,          # 20 / --mu 2: the step's loss tokens once
        "grad_norm": 2.0,                # (3 + 1) / 2 updates
        "updates": 2.0,
    })
    # one update only (--mu 1): the clip and ratio keys are the first update's; no --clip-c, no dual
    # key
    row = metrics.step_metrics(d, _update_stats(first, {}), mu=1, clip_c=0.0)
    assert (row["ratio/mean"], row["clip/high_frac"], row["loss"],
            row["kl"]) == pytest.approx((1.0, 0.0, 0.5, 0.02))
    assert "clip/dual_frac" not in row
    # nothing trained (dynamic sampling kept no group): means over updates and tokens are 0, no clip
    # keys
    row = metrics.step_metrics(d, _update_stats({}, {}), mu=1, clip_c=3.0)
    assert ((row["loss"], row["kl"], row["entropy"], row["grad_norm"], row["updates"])
            == (0.0, 0.0, 0.0, 0.0, 0.0))
    assert not {"clip/low_frac", "clip/high_frac", "ratio/mean", "clip/dual_frac"} & set(row)


def test_rounds_drawn_ahead_train_what_round_by_round_drawing_trains(tiny_run_inputs, tmp_path,
                                                                     monkeypatch):
    # dynamic sampling draws a step's first rounds together, as many as the step before used
    # (train.draw_step): 3 steps where odd answers' groups are all wrong (x_if_even), so steps take
    # several rounds, against the same run with every round drawn alone. The same kept groups, so
    # the same rows, the same metrics (time and perf aside) and the same weights; a merged draw
    # did happen, and a round drawn ahead and not needed is counted and its prompts come next.
    import train
    from helpers import weights_of
    real, merged = train.draw_rounds, []

    def ahead(*a):
        merged.append(a[-1])
        return real(*a)
    rows = {}
    # alone: asked for k rounds, it draws the first only (draw_step then draws the next when needed)
    for name, draw in (("ahead", ahead), ("alone", lambda *a: real(*a[:-1], 1))):
        with monkeypatch.context() as m:
            m.setattr(train, "draw_rounds", draw)
            run = tiny_flags(tiny_run_inputs, tmp_path / name)
            run[run.index("test_grpo:has_x")] = "test_metrics:x_if_even"
            train.main([*run, "--steps", "3", "--eval-every", "5", "--algo", "dapo",
                        "--max-rounds", "6"])
        rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                      .splitlines() if '"loss"' in x]
    assert max(merged) > 1                                   # the run drew several rounds at once
    assert sum(r["sampling/rounds_unused"] for r in rows["ahead"]) > 0, rows["ahead"]
    same = lambda r: {k: v for k, v in r.items()  # noqa: E731
                      if not k.startswith(("time/", "perf/", "sampling/rounds_unused"))}
    for a, b in zip(rows["ahead"], rows["alone"], strict=True):
        assert same(a) == pytest.approx(same(b), rel=1e-5, abs=1e-6)
        # Step 1's FLOPs: a round drawn ahead and not used is counted (the update's are the same)
        more = a["perf/flops"] > b["perf/flops"] * (1 + 1e-6)
        assert more == (a["sampling/rounds_unused"] > 0), (a, b)
    assert [r["sampling/rounds_unused"] for r in rows["alone"]] == [0.0] * 3
    wa, wb = weights_of(tmp_path / "ahead" / "final"), weights_of(tmp_path / "alone" / "final")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)


# infra/parallel.py's clock: the phase timings (time/*_s, and so perf/mfu_*) read after a sync

def test_sync_waits_for_cuda_only_where_cuda_is_in_use(monkeypatch):
    from infra import parallel
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)     # CUDA there, unused
    parallel.sync()
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    t = parallel.clock()
    assert calls == [()] and t <= time.perf_counter()


class _HostReads(torch.Tensor):
    """A stand-in for a CUDA tensor on the CPU: counts the reads that would wait for the device
    (item, tolist, int/float/bool/index of one element); .cpu() gives a plain tensor."""
    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
            _HostReads.reads += 1
        if name == "cpu":
            return args[0].as_subclass(torch.Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs)


def test_a_step_syncs_once_per_phase_and_reads_the_rollout_on_the_cpu(tiny_run_inputs, tmp_path,
                                                                      monkeypatch):
    # Phase timings read without a CUDA synchronize charge one phase's queued kernels to the next
    # (time/sample_s, time/logprob_s, time/update_s, time/step_s and perf/mfu_*). Each boundary
    # now reads parallel.clock, which syncs once: the step's start and end, Step 1's start and
    # end, Step 2's end, the log-prob passes' start and end, the update's end -> 8 syncs in a step.
    # Step 2 read the rollout on its device, row by row (a host sync per response, x3: decode,
    # the ids, lengths); the rollout now comes to the CPU once after sampling: a rollout of
    # stand-in device tensors sees no host read after the sampler returns.
    from infra import parallel
    syncs = []
    monkeypatch.setattr(parallel, "sync", lambda: syncs.append(1))
    draw = sampler.sample_groups

    def on_device(*a, **k):
        roll = draw(*a, **k)
        if a[2] == 1:                                          # G = 1: evaluation, not Step 1
            return roll
        return dataclasses.replace(roll, **{
            f.name: getattr(roll, f.name).as_subclass(_HostReads)
            for f in dataclasses.fields(roll) if isinstance(getattr(roll, f.name), torch.Tensor)})
    monkeypatch.setattr(sampler, "sample_groups", on_device)
    _HostReads.reads = 0
    row = one_step(tiny_run_inputs, tmp_path / "run")
    assert len(syncs) == 8 and row["time/sample_s"] > 0 and row["time/update_s"] > 0
    assert _HostReads.reads == 0
