"""End-to-end runs (@slow): train.py and evaluate.py through subprocess, torchrun (DDP, FSDP, LoRA
on
two ranks), resume and SIGKILL, --report-to, and the long in-process runs of the data, evaluate,
train, checkpoint/parallel, metrics and lora sections of test_grpo.py (whose unit tests stay there);
and, fast, the launcher's clean-up after a timeout.

    python -m pytest -q tests/test_runs.py
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from harness import builtin, checkpoint, data, flags, models
from helpers import one_step, tiny_flags, weights_of
from launch import (
    KILL_DRIVER,
    ROOT,
    run_record,
    run_train,
    run_tree,
    thread_counting_driver,
    torchrun,
)
from test_data import SCHEMA_PROBLEMS, _chat_tokenizer, _chatml, _doc_commands, _schema_rows
from verifier import verify

# ---------------------------------------------------------------------------------------------
# harness/data.py: data formats, chat template, pluggable and TRL-style rewards, clear errors for
# bad
# input
# ---------------------------------------------------------------------------------------------

_SPAWNER = """
import os, subprocess, sys, time
with open(sys.argv[1], "a") as fh:
    fh.write(f"{os.getpid()}\\n")
depth, me = int(sys.argv[2]), [sys.executable, __file__, sys.argv[1]]
if depth == 2:  # torchrun's shape: a child in its group, workers in sessions of their own
    kids = [subprocess.Popen(me + ["0"]), subprocess.Popen(me + ["0"], start_new_session=True),
            subprocess.Popen(me + ["1"], start_new_session=True)]
elif depth == 1:  # a worker's own child
    kids = [subprocess.Popen(me + ["0"], start_new_session=True)]
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """pid runs (a zombie not yet reaped by whoever inherited it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_launch_that_times_out_leaves_no_process_behind(tmp_path):
    # tests/launch.py's run_tree, as torchrun() and run_train() call it, on a script that starts
    # a child in its process group, one in a session of its own (as torchrun starts its workers)
    # and one in its own session with a child of its own, all sleeping: at the timeout, all five
    # are gone (subprocess.run's timeout ended only the script: the workers kept running, holding
    # their ports)
    script, pids = tmp_path / "spawner.py", tmp_path / "pids"
    script.write_text(_SPAWNER)
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, str(script), str(pids), "2"], 3)
    started = [int(x) for x in pids.read_text().split()]
    deadline = time.time() + 10
    while any(map(_alive, started)) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in started if _alive(p)]
    for p in left:                                      # not left to the machine: ours to end
        os.kill(p, 9)
    assert len(started) == 5 and left == [], (started, left)
    res = run_tree([sys.executable, "-c", "print('done')"], 60)          # a run that ends
    assert res.returncode == 0 and res.stdout == "done\n"


@pytest.mark.slow
def test_several_rewards_train_and_log_each_component(tiny_run_inputs, tmp_path, capsys):
    row = one_step(tiny_run_inputs, tmp_path / "run", "--reward", "test_grpo:trl_length",
                    "--reward-weights", "1", "0.5")
    # --reward test_grpo:has_x (from tiny_flags) and trl_length: the score is has_x + 0.5 *
    # trl_length
    assert row["reward/correct"] == pytest.approx(
        row["reward/has_x"] + 0.5 * row["reward/trl_length"], abs=1e-6)
    assert (row["reward/trl_length"] < 0
            and json.loads((tmp_path / "run" / "config.json").read_text())["reward"]
            == ["test_grpo:has_x", "test_grpo:trl_length"])
    with pytest.raises(SystemExit) as e:
        flags.parse_train_args(["--reward", "a:b", "--reward", "c:d", "--reward-weights", "1"])
    assert e.value.code == 2 and "one weight per --reward" in capsys.readouterr().err


@pytest.mark.slow
def test_train_and_evaluate_run_on_dapo_math_rows(tmp_path):
    import importlib

    from transformers import LlamaConfig, LlamaForCausalLM

    import evaluate
    import train
    tok = _chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    raw = _schema_rows("dapo")
    rows_file = tmp_path / "dapo.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in raw))
    seen = importlib.import_module("test_grpo").TRL_SEEN  # the module --reward imports
    seen.clear()
    train.main(["--model", str(tmp_path / "model"), "--data", str(rows_file),
                "--eval-data", str(rows_file), "--answer-field", "reward_model.ground_truth",
                "--reward", "test_grpo:trl_spy_reward", "--reward", "verifier",
                "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
                "--steps", "1", "--eval-samples", "2", "--log-completions", "4", "--algo", "grpo",
                "--out", str(tmp_path / "run"), "--device", "cpu"])
    rendered = {_chatml(r["prompt"]) for r in raw}
    logged = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    logged = [json.loads(x) for x in logged]
    assert len(logged) == 4 and all(c["prompt"] in rendered for c in logged)  # what the model saw
    # the reward's calls: evaluation before the step (3 problems x 2), the step (2 x 2), after
    assert [len(c["prompts"]) for c in seen] == [2, 2, 2, 4, 2, 2, 2]
    assert [c["prompts"] for c in seen[:3]] == [[r["prompt"]] * 2 for r in raw]  # the messages
    step = seen[3]
    assert all(p in [r["prompt"] for r in raw] for p in step["prompts"])
    assert all(isinstance(c, list) and len(c) == 1 and set(c[0]) == {"role", "content"} and
               c[0]["role"] == "assistant" for c in step["completions"])
    assert [m["ground_truth"] for m in step["reward_model"]] == \
        [r["reward_model"]["ground_truth"] for p in step["prompts"] for r in raw
         if r["prompt"] == p]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/maj@2" in logged[0] and "reward/trl_spy_reward" in logged[1]
    # evaluate.py with evaluation.md's recipe (its budget cut to a tiny run): the per-problem lines
    # keep each row's messages as they are, and its nested reference
    recipe = _doc_commands("docs/evaluation.md", "evaluate.py")[0]
    flags = recipe[recipe.index("--data"):]  # after its --model list: the tiny model instead
    flags[flags.index("--data") + 1] = str(rows_file)
    flags[flags.index("--out") + 1] = str(tmp_path / "per-problem.jsonl")
    # (its --rollout vllm is the recipe's engine; here the built-in sampler: tests/test_scale.py
    # runs evaluate.py through a stand-in engine)
    evaluate.main(["--model", str(tmp_path / "model"), *flags, "--max-new-tokens", "4",
                   "--eval-samples", "2", "--max-num-seqs", "2", "--device", "cpu", "--no-bf16",
                   "--rollout", "hf"])
    records = [json.loads(x) for x in (tmp_path / "per-problem.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [r["prompt"] for r in raw]
    assert [r["reference"] for r in records] == [a for _, a in SCHEMA_PROBLEMS]


# ---------------------------------------------------------------------------------------------
# evaluate.py: pass@k, maj@n, mean@n over ranks, the command
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_evaluate_command_writes_the_table_and_per_problem_lines(tiny_run_inputs, tmp_path, capsys):
    import evaluate
    from harness import evaluation
    model, out = str(tiny_run_inputs / "model"), tmp_path / "per-problem.jsonl"
    res = evaluate.main(["--model", model, model, "--data", "builtin", "--eval-size", "5",
                         "--eval-samples", "2",
                         "--max-new-tokens", "6", "--device", "cpu", "--out", str(out)])
    table = capsys.readouterr().out
    assert ("| model | mean@2 | mean@2_std | pass@1 | pass@2 | maj@2 | truncated_frac | len_mean |"
            in table)
    assert (table.count(f"| {model} |") == 2 and [r[0] for r in res] == [model, model]
            and res[0][1] == res[1][1])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert ([x["index"] for x in lines] == [0, 1, 2, 3, 4] * 2
            and {x["model"] for x in lines} == {model})
    heldout = builtin.sample_problems(5, 2, True)
    for x in lines:
        assert (x["prompt"], x["reference"]) == (heldout[x["index"]]["prompt"],
                                                 heldout[x["index"]]["answer"])
        assert (len(x["samples"]) == 2 and set(x["samples"][0]) == {"response", "answer", "score",
                                                                    "length", "truncated"})
        assert all(s["score"] == verify(s["response"], x["reference"]) for s in x["samples"])
        assert all(s["answer"] == evaluation.canonical_answer(s["response"]) for s in x["samples"])
    assert lines[:5] == lines[5:]  # the same model evaluated twice draws the same samples


# ---------------------------------------------------------------------------------------------
# train.py, harness/flags.py: flags, the step's metrics, end-to-end runs through subprocess, the
# loss
# flags reach the update
# ---------------------------------------------------------------------------------------------

METRIC_KEYS = {"step", "loss", "reward/mean", "reward/correct", "reward/frac_zero_std", "kl",
               "entropy",
               "clip/low_frac", "clip/high_frac", "ratio/mean", "len/mean", "len/truncated_frac",
               "grad_norm", "lr", "samples", "sampling/rounds", "time/step_s", "time/sample_s",
               "memory/state_bytes",
               "mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl"}


@pytest.mark.slow
def test_end_to_end_changes_weights_and_writes_metrics(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    res = run_train(d, tmp_path / "run", "--algo", "dapo")
    assert "held-out greedy accuracy" in res.stdout and "no learning signal" not in res.stderr
    rows = [json.loads(line)
            for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and [r["step"] for r in evals] == [0, 1, 2]
    for r in train_rows:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        # the split python -m bench.vs_trl prints (its PHASES)
        assert {"time/sample_s", "time/reward_s", "time/logprob_s", "time/update_s"} <= set(r)
        assert all(math.isfinite(v) for v in r.values())
        assert 0.0 <= r["entropy"] <= math.log(len(builtin.CHARS) + 3) + 1e-4
        assert 0.0 <= r["len/truncated_frac"] <= 1.0 and 1.0 <= r["len/mean"] <= 12.0
        # beta 0: no reference; mu 1: ratio 1
        assert r["kl"] == 0.0 and abs(r["ratio/mean"] - 1.0) < 1e-5
        # float32: the sampler's log-probs and the training forward's agree (the sampled tokens' own
        # log-probs)
        assert (0.0 <= r["mismatch/logp_abs_mean"] <= r["mismatch/logp_abs_max"] < 1e-4
                and 0 <= r["mismatch/kl"] < 1e-6)
    # AdamW (no decay) moves an element by lr * |m / sqrt(v)| an update, <= 1.0014 lr in the first
    # two: the largest moves are those of steady gradients (lr each time), and every weight tensor
    # moved
    before, after = weights_of(d / "model"), weights_of(tmp_path / "run" / "final")
    moved, lr_sum = {k: (after[k] - before[k]).abs() for k in before}, sum(r["lr"] * r["updates"]
                                                                           for r in train_rows)
    assert 0.99 * lr_sum <= max(float(m.max()) for m in moved.values()) <= 1.01 * lr_sum
    assert all(float(m.median()) > lr_sum / 4 for m in moved.values()), {k: float(m.median()) for k,
                                                                         m in moved.items()}
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["eps_high"] == 0.28 and config["reduction"] == "token" and config["beta"] == 0.0


@pytest.mark.slow
def test_end_to_end_overlong_filter_grad_norm_and_schedule(tiny_run_inputs, tmp_path):
    # 3 new tokens: most responses are truncated. The same samples with the filter on and off (the
    # filter changes only the loss mask): on, only the untruncated responses' tokens are in the
    # loss.
    flags = ["--algo", "dapo", "--max-new-tokens", "3", "--overlong-cache", "1",
             "--no-dynamic-sampling",
             "--steps", "2", "--grad-clip", "0", "--mini-batches", "2", "--mu", "2",
             "--warmup-steps", "4"]
    rows = {}
    for name, extra in (("on", []), ("off", ["--no-overlong-filter"])):
        run_train(tiny_run_inputs, tmp_path / name, *flags, *extra)
        rows[name] = [json.loads(x)
                      for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                      if "loss" in x]
    on, off = rows["on"][0], rows["off"][0]
    n = 4 * 4                                                     # prompts x G
    assert off["tokens/in_loss"] == pytest.approx(off["len/mean"] * n)
    assert on["tokens/in_loss"] < off["tokens/in_loss"] and on["len/truncated_frac"] > 0
    assert on["tokens/in_loss"] <= 3 * n * (1 - on["len/truncated_frac"]) + 1e-6
    assert off["grad_norm"] > 0                                   # logged with --grad-clip 0 too
    # 2 mini-batches x 2 passes = 4 optimizer updates, and the schedule counts rollout steps: 2/4,
    # then 3/4 of lr
    assert [r["updates"] for r in rows["off"]] == [4, 4]
    assert [r["lr"] for r in rows["off"]] == pytest.approx([1e-2 * 2 / 4, 1e-2 * 3 / 4])


@pytest.mark.slow
def test_end_to_end_dapo_with_fixes_off_equals_grpo(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    # --mu 2 takes the old-policy pass and beta 0.04 the reference pass: both paths are compared too
    run_train(d, tmp_path / "grpo", "--algo", "grpo", "--mu", "2", "--reward", "tinyreward:has_x")
    run_train(d, tmp_path / "dapo", "--algo", "dapo", "--eps-high", "0.2", "--reduction",
               "sequence", "--beta", "0.04",
               "--wrong-reward", "0", "--no-dynamic-sampling", "--no-overlong-filter",
               "--no-overlong-penalty", "--mu", "2",
               "--reward", "tinyreward:has_x", "--log-completions", "0")
    a, b = weights_of(tmp_path / "grpo" / "final"), weights_of(tmp_path / "dapo" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = weights_of(d / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a)  # the runs did learn something
    ka = [json.loads(x)["loss"]
          for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    kb = [json.loads(x)["loss"]
          for x in (tmp_path / "dapo" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert ka == kb
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
            if "loss" in x]
    # the second update has moved away from the reference
    assert all(r["kl"] > 0 for r in rows)
    assert any(r["ratio/mean"] != 1.0 for r in rows)    # and from the sampling policy
    # --log-completions 2 (the default): two completions per step, one from each of the first two
    # groups
    comps = [json.loads(x)
             for x in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert [c["step"] for c in comps] == [1, 1, 2, 2] and comps[0]["prompt"] != comps[1]["prompt"]
    prompts = {r["prompt"] for r in data.load_rows(str(d / "train.jsonl"), "train")}
    for c in comps:
        assert (c["prompt"] in prompts and c["reward"] == float("x" in c["response"])
                and 1 <= c["length"] <= 12)
    assert not (tmp_path / "dapo" / "completions.jsonl").exists()  # --log-completions 0


@pytest.mark.slow
def test_bf16_flag_autocasts_on_cpu_too(tiny_run_inputs, tmp_path):
    # --bf16 asks for bfloat16 autocast on the run's device; a CUDA-only autocast would leave a CPU
    # run in float32
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        run_train(tiny_run_inputs, tmp_path / name, "--steps", "1", *extra)
    fp32, bf16 = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()
                   if "loss" in x][0]
                  for n in ("fp32", "bf16"))
    # bfloat16 logits round differently: the entropy and the gradient move, within bfloat16's 8
    # significant bits
    for k in ("entropy", "grad_norm"):
        assert 0 < abs(bf16[k] - fp32[k]) <= 2 ** -8 * fp32[k], (k, bf16[k], fp32[k])
    # the sampler (KV cache, one token at a time) and the training forward round differently in
    # bfloat16: the mismatch metrics see it, and it is far larger than float32's
    assert (bf16["mismatch/logp_abs_max"] > 100 * fp32["mismatch/logp_abs_max"]
            and bf16["mismatch/kl"] > 0)
    # weights stay float32
    assert all(v.dtype == torch.float32 for v in weights_of(tmp_path / "bf16" / "final").values())


@pytest.mark.slow
def test_bf16_checkpoint_trains_with_float32_weights_and_adam(tiny_run_inputs, tmp_path):
    # hub models are mostly saved in bfloat16; transformers 5 keeps a checkpoint's dtype unless told
    # otherwise, and AdamW updates of ~lr 1e-6 on bf16 weights mostly round away: load float32
    # master weights always
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = tiny_run_inputs / "model"
    AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "bf16")
    # the trap is real
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    _, _, model = models.load_model(str(tmp_path / "bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    run_train(tiny_run_inputs, tmp_path / "run", "--model", str(tmp_path / "bf16"), "--steps", "1",
               "--save-every", "1")
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert {v.dtype for v in ckpt["model"].values()} == {torch.float32}
    moments = [t for s in ckpt["optimizer"]["state"].values() for k, t in s.items()
               if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {t.dtype for t in moments} == {torch.float32}


@pytest.mark.slow
def test_loss_flags_reach_the_update(tiny_run_inputs, tmp_path):
    # The same samples each time (same seed); each flag must change the update as its math says.
    d = tiny_run_inputs
    base = one_step(d, tmp_path / "base")
    # float32: pi_old and the sampler agree to ~1e-7, so a cap of 0.5 makes every weight 0.5: half
    # the gradient
    tis = one_step(d, tmp_path / "tis", "--tis-cap", "0.5")
    assert tis["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-4)
    assert tis["loss"] == pytest.approx(0.5 * base["loss"], rel=1e-4, abs=1e-7)

    # grad norms at c = 0, 0.5, 1, 2 (one update): the gradient is g + c h for one h != 0
    def g_plus_c_h(norms):
        # |g + c h|^2, a quadratic in c: through c = 0, 0.5, 1 it predicts c = 2
        f = [x ** 2 for x in norms]
        assert (f[3] == pytest.approx(3 * f[0] - 8 * f[1] + 6 * f[2], rel=1e-4)
                and f[2] - 2 * f[1] + f[0] > 1e-4 * f[0])

    # entropy bonus: loss - c * H, H the token mean of the entropy over the loss's tokens (all of
    # them without the overlong filter: the metric "entropy"); gradient g - c grad H
    ent = {c: one_step(d, tmp_path / f"ent{c}", "--entropy-coef", str(c), "--no-overlong-filter")
           for c in (0, 0.5, 1, 2)}
    g_plus_c_h([r["grad_norm"] for r in ent.values()])
    assert all(r["loss"] == pytest.approx(ent[0]["loss"] - c * r["entropy"], abs=1e-5) for c,
               r in ent.items())
    # GSPO: on-policy (one update) its gradient is the policy gradient, as PPO's; off-policy (a
    # second pass, where the paper's 3e-4 / 4e-4 clip most responses) it is not
    gspo = one_step(d, tmp_path / "gspo", "--loss", "gspo")
    assert gspo["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
    # (the same weights after the first, on-policy update): in the second, GSPO's ratio is per
    # response, the geometric mean of its tokens' ratios, so its mean is below PPO's (Jensen; equal
    # only if all are 1)
    tiny = ["--mu", "2", "--eps-low", "3e-4", "--eps-high", "4e-4"]  # GSPO's clip range for both
    ppo2, gspo2 = one_step(d, tmp_path / "ppo2", *tiny), one_step(d, tmp_path / "gspo2", "--loss",
                                                                    "gspo", *tiny)
    assert gspo2["ratio/mean"] < ppo2["ratio/mean"] - 1e-4
    # CISPO: off-policy, a clipped token keeps a gradient where PPO's is zero (same clip range for
    # both)
    narrow = ["--mu", "2", "--eps-low", "0.01", "--eps-high", "0.01"]
    ppo3, cispo3 = one_step(d, tmp_path / "ppo3", *narrow), one_step(d, tmp_path / "cispo3",
                                                                       "--loss", "cispo", *narrow)
    assert (cispo3["grad_norm"] > ppo3["grad_norm"]
            and ppo3["clip/low_frac"] + ppo3["clip/high_frac"] > 0)
    # the KL estimator reaches the loss. On-policy (pi = pi_ref) every estimator is 0, and so is
    # k3's gradient ((1 - pi_ref / pi) grad log pi), not k1's (grad log pi): k1's gradient is g +
    # beta h, h != 0
    k3_on = one_step(d, tmp_path / "k3on", "--beta", "0.5")
    assert k3_on["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6) and k3_on["kl"] < 1e-10
    k1_on = [one_step(d, tmp_path / f"k1on{b}", "--beta", b, "--kl", "k1")
             for b in ("0.5", "1", "2")]
    g_plus_c_h([base["grad_norm"]] + [r["grad_norm"] for r in k1_on])
    assert all(r["loss"] == pytest.approx(base["loss"], abs=1e-6) and r["kl"] < 1e-10
               for r in k1_on)
    # in the second pass the policy has left the reference
    k3 = one_step(d, tmp_path / "k3", "--beta", "0.5", "--mu", "2")
    assert k3["kl"] > 0


# ---------------------------------------------------------------------------------------------
# harness/checkpoint.py, infra/parallel.py: resume, atomic saves, the run lock; DDP, FSDP and
# gradient
# checkpointing
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp_two_ranks_agree_with_one_process_shard_the_state_and_resume_exactly(tiny_run_inputs,
                                                                                  tmp_path):
    """FSDP2 on 2 gloo ranks against one plain process (same seed and global batch), 3 steps: the
    same rewards
    at every step and final weights within 1e-3, with half the per-rank bytes of weights, gradients
    and AdamW state; then 3 steps + --resume to 6 equals 6 straight steps, bit for bit. The flags
    take every FSDP path: the reference model (beta > 0, sharded too), the old-policy pass (--mu 2,
    --mini-batches 2), ranks with different numbers of groups and micro-batches (dynamic sampling,
    --micro-batch-size
    3), gradient checkpointing."""
    d = tiny_run_inputs
    flags = [*tiny_flags(d, tmp_path / "unused"), "--overlong-cache", "12", "--micro-batch-size",
             "3", "--eval-every", "3",
             "--algo", "dapo", "--beta", "0.04", "--mu", "2", "--mini-batches", "2"]
    fsdp = ["--fsdp", "--gradient-checkpointing", "--save-every", "3"]

    def step_rows(out):
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(x)]
    run_train(d, tmp_path / "one", *flags[flags.index("--overlong-cache"):], "--steps", "3")
    torchrun(2, os.path.join(ROOT, "train.py"), *flags, "--out", str(tmp_path / "two"), *fsdp,
              "--steps", "3")
    (m1, w1), (m2, w2) = ((step_rows(tmp_path / n), weights_of(tmp_path / n / "final"))
                          for n in ("one", "two"))
    assert len(m1) == len(m2) == 3
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "sampling/groups_kept"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
        assert (a["loss"] == pytest.approx(b["loss"], abs=1e-4)
                and a["kl"] == pytest.approx(b["kl"], abs=1e-4))
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert sum(r["sampling/groups_kept"] for r in m1) > 0 and all(r["kl"] > 0 for r in m1[1:])
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-3
    assert any(not torch.equal(weights_of(d / "model")[k], w1[k]) for k in w1)
    ratio = m2[-1]["memory/state_bytes"] / m1[-1]["memory/state_bytes"]
    print(f"per-rank bytes of weights + gradients + AdamW state + reference: 1 process "
          f"{m1[-1]['memory/state_bytes']}, "
          f"FSDP rank 0 of 2 {m2[-1]['memory/state_bytes']} ({ratio:.3f}x)")
    assert ratio <= 0.55
    # resume: the 3-step run's sharded checkpoint, continued to 6, against 6 straight steps
    torchrun(2, os.path.join(ROOT, "train.py"), *flags, "--out", str(tmp_path / "two"), *fsdp,
              "--steps", "6", "--resume")
    torchrun(2, os.path.join(ROOT, "train.py"), *flags, "--out", str(tmp_path / "six"), *fsdp,
              "--steps", "6")
    a, b = weights_of(tmp_path / "two" / "final"), weights_of(tmp_path / "six" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], w2[k]) for k in a)
    assert ([r["loss"] for r in step_rows(tmp_path / "two")]
            == [r["loss"] for r in step_rows(tmp_path / "six")])
    assert sorted(os.listdir(tmp_path / "six" / "checkpoint")) == ["latest", "step-000006"]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_resume_onto_another_rank_count_equals_the_unbroken_run(tiny_run_inputs, tmp_path, fsdp):
    """Preempted on N ranks, resumed on M: 3 steps on 2 gloo ranks + --resume to 6 on 1 rank, and 3
    on 1 + --resume to 6 on 2, each against 6 straight steps on 1 rank: the same rewards, lengths
    and samples at every step, losses within 1e-4 and final weights within 1e-3 (the 1-vs-2-ranks
    tolerance of the test above; per-prompt seeds and global denominators make it the same run).
    DDP resumes rank 0's file, --fsdp reshards the DCP checkpoint to the new rank count."""
    d = tiny_run_inputs
    flags = [*tiny_flags(d, tmp_path / "unused"), "--overlong-cache", "12", "--micro-batch-size",
             "3", "--eval-every", "3", "--algo", "dapo", "--beta", "0.04", "--mu", "2",
             "--mini-batches", "2", "--save-every", "3", *(["--fsdp"] if fsdp else [])]
    script = os.path.join(ROOT, "train.py")

    def rows(out):
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(x)]
    torchrun(1, script, *flags, "--out", str(tmp_path / "straight"), "--steps", "6")
    for first, then in ((2, 1), (1, 2)):
        out = tmp_path / f"{first}to{then}"
        torchrun(first, script, *flags, "--out", str(out), "--steps", "3")
        torchrun(then, script, *flags, "--out", str(out), "--steps", "6", "--resume")
        m1, m2 = rows(tmp_path / "straight"), rows(out)
        assert [r["step"] for r in m2] == list(range(1, 7))
        for a, b in zip(m1, m2):
            for k in ("reward/mean", "len/mean", "samples", "sampling/groups_kept"):
                assert a[k] == pytest.approx(b[k], abs=1e-6), (first, then, a["step"], k)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), (first, then, a["step"])
        w1, w2 = weights_of(tmp_path / "straight" / "final"), weights_of(out / "final")
        assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-3, (first, then)
        assert json.loads((out / "config.json").read_text())["world_size"] == then
    assert any(not torch.equal(weights_of(d / "model")[k], w1[k]) for k in w1)


@pytest.mark.slow
@pytest.mark.parametrize("adv_scale,extra", [
    ("group", ["--mini-batches", "2", "--mu", "2"]),
    ("group", ["--mini-batches", "4"]),  # more mini-batches than ranks: each update a group or two
    # the objectives of variants.py: GSPO off-policy, the KL term with k2, the entropy bonus,
    # truncated IS
    ("batch", ["--loss", "gspo", "--mu", "2", "--beta", "0.04", "--kl", "k2", "--entropy-coef",
               "0.01", "--tis-cap", "2"]),
])
@pytest.mark.slow
def test_torchrun_one_and_two_ranks_agree(tiny_run_inputs, tmp_path, adv_scale, extra):
    """1 rank and 2 ranks (gloo) with the same seed and global batch draw the same responses and
    rewards
    at every step, compute the same gradients and end with the same weights, up to floating-point
    reduction order (with --adv-scale batch, the std is that of the global batch, not of each rank's
    share; with mini-batches, each update holds the same groups). AdamW normalises a gradient's
    scale away, so the gradient norms are compared directly.

    And after train.main returns, each rank's process group is gone with its gloo threads: a process
    group that outlives destroy_process_group keeps them running into interpreter exit, where a rank
    can abort. Evaluation with 2 samples per problem, split over the ranks, logs the same
    numbers."""
    d = tiny_run_inputs
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        torchrun(n, thread_counting_driver(tmp_path) if n == 2
                  else os.path.join(ROOT, "train.py"), *tiny_flags(d, out),
                  "--steps", "3", "--overlong-cache", "12", "--micro-batch-size", "3",
                  "--eval-every", "3", "--algo", "dapo",
                  "--adv-scale", adv_scale, "--grad-clip", "0", "--eval-samples", "2", *extra)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[n] = ([r for r in rows if "loss" in r], weights_of(out / "final"),
                   [r for r in rows if "eval/mean@2" in r])
    (m1, w1, e1), (m2, w2, e2) = runs[1], runs[2]
    assert len(m1) == len(m2) == 3
    assert [e["step"] for e in e1] == [e["step"] for e in e2] == [0, 3]
    # the eval lines: mean@2 and its std, pass@1, pass@2, maj@2, truncation, length
    for a, b in zip(e1, e2):
        assert ({"eval/mean@2_std", "eval/pass@2", "eval/maj@2", "eval/len_mean"} <= set(a)
                and "eval/accuracy" not in a)
        assert a == pytest.approx(b, abs=1e-9)
    # the trained model samples other responses
    assert e1[0]["eval/len_mean"] != e1[1]["eval/len_mean"]
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "sampling/groups_kept", "updates",
                  "tokens/in_loss"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k  # float32 sums in another order
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert sum(r["sampling/groups_kept"] for r in m1) > 0       # something was trained on
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-3
    start = weights_of(d / "model")
    assert any(not torch.equal(start[k], w1[k]) for k in w1)
    if os.path.isdir("/proc/self/task"):                      # Linux: gloo threads left per rank
        assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == ["0", "0"]


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_folder_is_refused_and_a_killed_run_leaves_no_lock(
        tiny_run_inputs, tmp_path, capsys):
    import train
    from infra import parallel
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                               *tiny_flags(tiny_run_inputs, out),
                               "--steps", "100000", "--eval-data", "", "--log-completions", "0"],
                              cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # it has taken the lock once it writes its config
            if (out / "config.json").exists() and (out / "config.json").stat().st_size > 0:
                break
            assert holder.poll() is None, "the first run ended early"
            time.sleep(0.1)
        with pytest.raises(SystemExit) as e:
            train.main(tiny_flags(tiny_run_inputs, out) + ["--steps", "1", "--resume"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: --out {out} is in use by another run (pid {holder.pid} "
                              f"holds"), err
    finally:
        holder.kill()  # SIGKILL: no cleanup ran, the kernel released the lock
        holder.wait()
    # the refused run wrote nothing
    assert json.loads((out / "config.json").read_text())["steps"] == 100000
    lock = checkpoint.lock_folder(str(out), parallel.Dist("cpu"))
    assert lock is not None
    lock.close()


@pytest.mark.slow
def test_finished_fsdp_runs_exit_0_every_time_with_no_gloo_thread_left(tiny_run_inputs, tmp_path):
    """A finished 2-rank --fsdp run aborted at teardown now and then (rank 1, "terminate called
    without an
    active exception"): DTensor's caches kept the process group alive past destroy_process_group,
    and its gloo threads ran on into interpreter exit. Now the group is freed when train.main
    returns (no gloo thread on either rank: what decides the race, checked every time) and each of 3
    runs exits 0 (torchrun)."""
    d = tiny_run_inputs
    for i in range(3):
        for r in (0, 1):
            (tmp_path / f"threads{r}").unlink(missing_ok=True)
        torchrun(2, thread_counting_driver(tmp_path), "--model", str(d / "model"), "--data",
                  str(d / "train.jsonl"),
                  "--eval-data", "", "--prompts-per-step", "2", "--group-size", "2",
                  "--max-new-tokens", "4", "--steps", "1",
                  "--fsdp", "--log-completions", "0", "--device", "cpu", "--out",
                  str(tmp_path / f"run{i}"))
        assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == ["0", "0"], i
        assert (tmp_path / f"run{i}" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_resume_gives_the_same_weights_as_an_unbroken_run(tiny_run_inputs, tmp_path):
    run_train(tiny_run_inputs, tmp_path / "full", "--steps", "6", "--save-every", "3")
    run_train(tiny_run_inputs, tmp_path / "part", "--steps", "3", "--save-every", "3")
    run_train(tiny_run_inputs, tmp_path / "part", "--steps", "6", "--save-every", "3", "--resume")
    a, b = weights_of(tmp_path / "full" / "final"), weights_of(tmp_path / "part" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = weights_of(tiny_run_inputs / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a)
    steps = [json.loads(x)["step"]
             for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_sigkill_then_resume_logs_each_step_once(tiny_run_inputs, tmp_path):
    import signal
    d, out = tiny_run_inputs, tmp_path / "killed"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", str(d / "model"), "--data",
           str(d / "train.jsonl"),
           "--steps", "400", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens",
           "12", "--save-every", "2", "--out", str(out), "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint.pt").exists():
        time.sleep(0.2)
    time.sleep(1.0)  # let it run on past the checkpoint, into a step or a save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    target = ckpt["step"] + 2
    subprocess.run(cmd[:cmd.index("--steps") + 1] + [str(target)] + cmd[cmd.index("--steps") + 2:]
                   + ["--resume"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in x]
    assert steps == list(range(1, target + 1))


@pytest.mark.slow
def test_final_model_loads_and_generates(tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run_train(tiny_run_inputs, tmp_path / "run", "--steps", "1", "--save-every", "1")
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    # the policy as the loop held it after its last step (checkpoint.pt's weights), and the base
    # model it started from
    base, policy = (AutoModelForCausalLM.from_pretrained(tiny_run_inputs / "model")
                    for _ in range(2))
    policy.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt",
                                      weights_only=True)["model"])
    ids = torch.tensor([tok("2x+4=10\n")["input_ids"]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out, policy.generate(ids, max_new_tokens=5, do_sample=False,
                                            pad_token_id=tok.pad_token_id))
    # the log-probs of that output: the trained policy's, not the base model's
    with torch.no_grad():
        logp = [torch.log_softmax(m(out).logits[0, :-1], -1).gather(-1, out[0, 1:, None])
                for m in (model, policy, base)]
    assert (torch.allclose(logp[0], logp[1], atol=1e-6)
            and not torch.allclose(logp[0], logp[2], atol=1e-3))


@pytest.mark.slow
def test_sigkill_at_random_moments_and_bytes_then_resume_equals_an_unbroken_run(
        tiny_run_inputs, tmp_path):
    """train.py runs (6 steps, a checkpoint every 2, evaluation every 3, 16 completions a step, a
    reward drawing from the global RNGs: flip_x) SIGKILLed over and over: half at a random moment of
    the run (startup, steps, checkpoints, the final save, exit), half once a random number of bytes
    went to the files it writes under OUT (its logs mid-line, config.json, the rewrites of --resume,
    the tokenizer of final/), each then resumed with --resume (or started again where no checkpoint
    was written yet), the resumed run perhaps killed again, until one finishes. Every finished run
    equals the unbroken one: the same final/ byte for byte, the same metrics.jsonl and
    completions.jsonl rows (all keys but those read off the clock: time/*, perf/mfu*,
    perf/tokens_per_s), the same config, and no file more (no temporary, no aside copy). Each run
    is a fork of one process that imported train.py once (a fresh interpreter per run would spend
    4 s importing), then runs train.main as `python train.py` would:
    44 tries, about 35 kills, in 30-40 s on 2 cores."""
    d = tiny_run_inputs
    flags = tiny_flags(d, "OUT")
    flags[flags.index("test_grpo:has_x")] = "test_grpo:flip_x"
    flags += ["--steps", "6", "--save-every", "2", "--eval-every", "3", "--log-completions", "16"]
    with open(tmp_path / "driver.err", "w") as err:
        driver = subprocess.Popen([sys.executable, "-c", KILL_DRIVER, str(d / "model")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                  text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    runs = [0]

    def run(out, **kill):
        runs[0] += 1
        argv = [str(out) if f == "OUT" else f for f in flags]
        if (out / "checkpoint.pt").exists():
            argv.append("--resume")
        log = tmp_path / f"run{runs[0]}.log"
        cmd = {"argv": argv, "out": str(out), "log": str(log), **kill}
        driver.stdin.write(json.dumps(cmd) + "\n")
        driver.stdin.flush()
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.err").read_text()[-3000:]
        res = json.loads(line)
        assert res["killed"] or res["code"] == 0, log.read_text()[-3000:]
        return res, log

    def finished_like_the_unbroken_one(out, attempt):
        got = run_record(out)
        for key in want:
            assert got[key] == want[key], (key, out, attempt)

    try:
        res, log = run(tmp_path / "unbroken")
        assert not res["killed"]
        seconds, written = res["seconds"], int((tmp_path / (log.name + ".bytes")).read_text())
        want = run_record(tmp_path / "unbroken")
        assert [r["step"] for r in want["metrics"] if "loss" in r] == [1, 2, 3, 4, 5, 6]
        assert written > 15000 and len(want["completions"]) == 96
        rng = random.Random(0)
        kills = cut_lines = debris = finished = 0
        chain = tmp_path / "chain0"
        for attempt in range(44):
            kill = {"kill_after_s": rng.uniform(0, seconds)} if attempt % 2 else \
                {"kill_after_bytes": rng.randrange(written)}
            res, log = run(chain, **kill)
            if res["killed"]:
                kills += 1
                logs = [chain / n for n in ("metrics.jsonl", "completions.jsonl")]
                cut_lines += any(p.exists() and p.read_bytes()[-1:] not in b"\n" for p in logs)
                debris += any(n.endswith((".tmp", ".old")) for n in os.listdir(chain))
                continue
            finished_like_the_unbroken_one(chain, attempt)
            finished += 1
            chain = tmp_path / f"chain{finished}"
        if chain.exists():                                       # the last chain, to its end
            assert not run(chain)[0]["killed"]
            finished_like_the_unbroken_one(chain, "end")
            finished += 1
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
    print(f"unbroken: {seconds:.2f} s, {written} bytes; {kills} kills (a log line cut: "
          f"{cut_lines}, a temporary or aside copy left: {debris}), {finished} runs to the end")
    assert kills >= 25 and cut_lines >= 5 and debris >= 3 and finished >= 3


# ---------------------------------------------------------------------------------------------
# harness/metrics.py, harness/lora.py and the optional integrations: the no-signal warning,
# --report-to,
# LoRA
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_without_learning_signal_says_so_on_stderr(tiny_run_inputs, tmp_path, capsys):
    # the verifier never credits the random model: every group all wrong, dynamic sampling keeps
    # none, 3 steps (test_end_to_end_changes_weights_and_writes_metrics: a run that learns prints
    # none of this)
    import train
    d = tiny_run_inputs
    train.main(["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--prompts-per-step",
                "2", "--group-size", "2",
                "--max-new-tokens", "4", "--steps", "3", "--max-rounds", "1", "--out",
                str(tmp_path), "--device", "cpu", "--log-completions", "0"])
    lines = [x for x in capsys.readouterr().err.splitlines() if "no learning signal" in x]
    said = ["step 1: dynamic sampling kept no group",
            "step 3: no sample of the first 3 steps scored"]
    assert len(lines) == 2 and all(s in x for s, x in zip(said, lines)), lines


def _logged_scalars(out):
    """{(key, step): value} of every metrics.jsonl row, eval rows too: what --report-to must send
    on."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r for r in rows) and any("loss" in r for r in rows)
    return {(k, r["step"]): v for r in rows for k, v in r.items() if k != "step"}


def _wandb_history(run_file):
    """{(key, step): value} of an offline run's history, read from its .wandb file: W&B's
    leveldb-style log
    (a 7-byte file header, records of 4-byte crc, 2-byte length, 1-byte type in 32 KiB blocks) of
    protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb
    buf, pos, part, out, config = run_file.read_bytes(), 7, b"", {}, {"exit": False}
    while pos + 7 <= len(buf):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        n, kind = int.from_bytes(buf[pos + 4:pos + 6], "little"), buf[pos + 6]
        if pos + 7 + n > len(buf):  # a record still being written
            break
        part, pos = part + buf[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item}
                out.update({(k, rec.history.step.num): v for k, v in items.items()
                            if not k.startswith("_")})
            if rec.WhichOneof("record_type") == "run":
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            config["exit"] |= rec.WhichOneof("record_type") == "exit"  # the run's last record
    return out, config


@pytest.mark.slow
def test_report_to_tensorboard_holds_the_metrics_rows(tiny_run_inputs, tmp_path):
    pytest.importorskip("tensorboard", reason="--report-to tensorboard needs the tensorboard "
                        "package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    one_step(tiny_run_inputs, tmp_path / "tb", "--report-to", "tensorboard")
    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard" / "tb"))
    acc.Reload()
    got = {(k, e.step): e.value for k in acc.Tags()["scalars"] for e in acc.Scalars(k)}
    want = _logged_scalars(tmp_path / "tb")
    # float32 there
    assert (got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-6)
                                              for k in want))
    assert '"out": "' + str(tmp_path / "tb") + '"' in (
        acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode())


@pytest.mark.slow
def test_report_to_wandb_offline_holds_the_metrics_rows_and_config(tiny_run_inputs, tmp_path,
                                                                   monkeypatch):
    pytest.importorskip("wandb", reason="--report-to wandb needs the wandb package")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    one_step(tiny_run_inputs, tmp_path / "run", "--report-to", "wandb")
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.time() + 60
    while not (history := _wandb_history(run_file))[1]["exit"] and time.time() < deadline:
        # wandb's service process may still be writing the file after run.finish() returns
        time.sleep(0.2)
    got, config = history
    assert got == _logged_scalars(tmp_path / "run")
    assert (config["out"].endswith("run") and config["reward"] == ["test_grpo:has_x"]
            and config["world_size"] == 1)


@pytest.mark.slow
def test_lora_run_saves_state_resumes_exactly_and_two_ranks_agree(tiny_run_inputs, tmp_path):
    import importlib.util
    pytest.importorskip("peft", reason="--lora-r needs peft")
    from transformers import AutoModelForCausalLM
    d = tiny_run_inputs
    lora_flags = ["--lora-r", "4", "--beta", "0.04", "--algo", "grpo", "--save-every", "1",
                  "--eval-every", "5"]
    run_train(d, tmp_path / "full", *lora_flags, "--steps", "2")
    run_train(d, tmp_path / "part", *lora_flags, "--steps", "1")
    run_train(d, tmp_path / "part", *lora_flags, "--steps", "2", "--resume")
    a, b = weights_of(tmp_path / "full" / "final"), weights_of(tmp_path / "part" / "final")
    # merged finals of resumed and straight runs
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = weights_of(d / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a) and a.keys() == start.keys()
    assert (tmp_path / "full" / "adapter" / "adapter_model.safetensors").exists()
    # AdamW holds the adapters alone; memory/state_bytes: all weights once, the adapters' two
    # moments (their gradients are freed after each update)
    ckpt = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    # lm_head is tied to the embeddings
    n_base = sum(v.numel() for k, v in start.items() if k != "lm_head.weight")
    n_adapter = sum(v.numel() for k, v in ckpt["model"].items() if ".lora_" in k)
    assert (len(ckpt["optimizer"]["state"]) == len(ckpt["optimizer"]["param_groups"][0]["params"])
            == 2 * 14)
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x]
    # + AdamW's step counts
    assert rows[-1]["memory/state_bytes"] == 4 * (n_base + n_adapter) + 8 * n_adapter + 4 * 28
    # full fine-tuning + a reference copy: 20 B each
    assert rows[-1]["memory/state_bytes"] < 0.4 * 20 * n_base
    assert rows[-1]["kl"] > 0
    # 2 gloo ranks (DDP over the adapters) end where one process does; rank 0 alone reports to
    # tensorboard
    tb = ["--report-to", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    torchrun(2, os.path.join(ROOT, "train.py"), *tiny_flags(d, tmp_path / "w2"), *lora_flags,
              "--steps", "2", *tb)
    w2 = weights_of(tmp_path / "w2" / "final")
    assert max((a[k] - w2[k]).abs().max().item() for k in a) <= 1e-4
    events = (tmp_path / "w2" / "tensorboard" / "w2").glob("events.out.tfevents.*")
    assert len(list(events)) == (1 if tb else 0)
    assert (AutoModelForCausalLM.from_pretrained(tmp_path / "w2" / "final")
            .config.num_hidden_layers == 2)
