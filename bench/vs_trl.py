"""A whole GRPO step (the article's "Step 1: Rollout 采样" to "Step 4: PPO Loss 计算"), train.py vs
TRL's GRPOTrainer on the same model, prompts and settings. A command of its own: an external
comparison, with its own venv (TRL is never a dependency of this project) and its own child process,
apart from `python -m bench`'s sections.

Run from the repo root:

    python -m venv --system-site-packages venv-trl && venv-trl/bin/pip install trl torch==2.13.0
    venv-trl/bin/python -m bench.vs_trl --table     # docs/speed.md's table: every configuration
    venv-trl/bin/python -m bench.vs_trl --init random --new-tokens 64 --threads 2   # one of them

Both trainers run in their own processes with the same torch threads, interleaved; seconds per step
are medians.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import ROOT, header

VS_TRL = dict(prompts=16, G=8, beta=0.04)  # 16 prompts x 8 samples, as in issue 16
# docs/speed.md's table: (model, new tokens) at each thread count; 4 new tokens is the built-in
# task's short answers, 64 a random-init model's long-tailed ones (its end token drawn now and then)
TABLE = [("base", 4), ("random", 4), ("random", 64)]
TABLE_THREADS = (1, 2)
# where train.py's step goes: its metrics' time/* (docs/metrics.md); the rest is bookkeeping
PHASES = {"time/sample_s": "sampling", "time/reward_s": "reward",
          "time/logprob_s": "no-grad log-probs", "time/update_s": "update"}


def trl_child(folder: str, steps: int, new_tokens: int) -> None:
    """In a fresh process: `steps` GRPOTrainer steps on folder/model and folder/train.jsonl; prints
    seconds per step, and of them in model.generate."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import verifier
    with open(os.path.join(folder, "train.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    tok = AutoTokenizer.from_pretrained(os.path.join(folder, "model"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32)
    ends, gens, spent = [], [], [0.0]              # clock and generate's running total at each
    plain_generate = model.generate                # GRPOTrainer calls the (unwrapped) model's

    def generate(*a, **k):
        t = time.perf_counter()
        try:
            return plain_generate(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t
    model.generate = generate

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())
            gens.append(spent[0])

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            gens.append(spent[0])

    def reward(completions, answer, **_):
        return [verifier.verify(c, a) for c, a in zip(completions, answer)]

    n = VS_TRL["prompts"] * VS_TRL["G"]
    cfg = GRPOConfig(output_dir=os.path.join(folder, "trl"), per_device_train_batch_size=n,
                     gradient_accumulation_steps=1, num_generations=VS_TRL["G"],
                     max_completion_length=new_tokens, beta=VS_TRL["beta"],
                     loss_type="grpo", scale_rewards="group", temperature=1.0, learning_rate=1e-6,
                     max_steps=steps, use_cpu=True, bf16=False, report_to="none",
                     save_strategy="no", logging_steps=1, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"step_s": [b - a for a, b in zip(ends, ends[1:])],
                      "sample_s": [b - a for a, b in zip(gens, gens[1:])]}))


def write_model(folder: str, init: str) -> None:
    """folder/model: the built-in base model, or (init="random") its architecture randomly
    initialised; folder/train.jsonl: 512 training prompts of the built-in task."""
    from transformers.utils import logging as hf_logging

    from harness import builtin
    hf_logging.disable_progress_bar()                      # no "Writing model shards" bar per run
    if init == "base":
        shutil.copytree(builtin.base_model(), os.path.join(folder, "model"))
    else:
        tok = builtin.make_tokenizer()
        torch.manual_seed(0)
        model = builtin.make_model(builtin.BaseModelConfig(), len(tok))
        model.save_pretrained(os.path.join(folder, "model"))
        tok.save_pretrained(os.path.join(folder, "model"))
    with open(os.path.join(folder, "train.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in builtin.sample_problems(512, 0, False))


def bench_vs_trl(steps: int, repeats: int, init: str = "base", new_tokens: int = 4,
                 threads: int = 1) -> tuple[float, float]:
    """Both trainers on the built-in base model (init="random": the same architecture, randomly
    initialised, so nothing is built first) and the same 512 training prompts, each in its own
    process with `threads` torch threads, interleaved; seconds per step, the first step of each run
    left out (warm-up). Prints and returns the two medians (train.py, TRL)."""
    flags = ["--algo", "grpo", "--beta", str(VS_TRL["beta"]),
             "--prompts-per-step", str(VS_TRL["prompts"]), "--group-size", str(VS_TRL["G"]),
             "--max-new-tokens", str(new_tokens),
             "--micro-batch-size", str(VS_TRL["prompts"] * VS_TRL["G"]), "--lr", "1e-6",
             "--steps", str(steps), "--device", "cpu"]
    model_name = "base" if init == "base" else "random-init"
    print(f"\n## A GRPO step, train.py vs TRL's GRPOTrainer: {VS_TRL['prompts']} prompts x "
          f"{VS_TRL['G']} samples, {new_tokens} new tokens, beta {VS_TRL['beta']}, the "
          f"built-in {model_name} model, CPU, {threads} thread{'s' * (threads > 1)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    times = {"train.py": [], "TRL GRPOTrainer": []}
    sampling = {"train.py": [], "TRL GRPOTrainer": []}     # of them: sample_groups / generate
    phases = {k: [] for k in PHASES}                       # train.py's step, phase by phase
    with tempfile.TemporaryDirectory() as d:
        write_model(d, init)
        for r in range(repeats):
            out = os.path.join(d, f"ours{r}")
            subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                            "--model", os.path.join(d, "model"),
                            "--data", os.path.join(d, "train.jsonl"), "--out", out, *flags],
                           check=True, capture_output=True, cwd=ROOT, env=env)
            with open(os.path.join(out, "metrics.jsonl")) as fh:
                rows = [r for r in map(json.loads, fh) if "time/step_s" in r]
            times["train.py"] += [r["time/step_s"] for r in rows[1:]]
            sampling["train.py"] += [r["time/sample_s"] for r in rows[1:]]
            for k in PHASES:
                phases[k] += [r[k] for r in rows[1:]]
            child = f"from bench import vs_trl; vs_trl.trl_child({d!r}, {steps}, {new_tokens})"
            res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                 cwd=ROOT, env=env)
            if res.returncode:
                raise RuntimeError(f"the TRL run failed (is trl installed for {sys.executable}?):\n"
                                   f"{res.stderr[-2000:]}")
            line = next(x for x in reversed(res.stdout.splitlines()) if x.startswith('{"step_s"'))
            times["TRL GRPOTrainer"] += json.loads(line)["step_s"][1:]
            sampling["TRL GRPOTrainer"] += json.loads(line)["sample_s"][1:]
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:18s} {v:7.3f} s / step (median of {len(times[k])} steps), of which "
              f"sampling {statistics.median(sampling[k]):.3f} s (its median)")
    print("  train.py's step, phase by phase (medians): " + ", ".join(
        f"{name} {statistics.median(phases[k]):.3f} s" for k, name in PHASES.items()))
    print(f"  train.py / TRL: {med['train.py'] / med['TRL GRPOTrainer']:.2f} (target <= 0.5)",
          flush=True)
    return med["train.py"], med["TRL GRPOTrainer"]


def bench_table(steps: int, repeats: int) -> None:
    """Every configuration of TABLE at every thread count of TABLE_THREADS, each its own
    interleaved run; then docs/speed.md's table."""
    rows = [(init, n, t, *bench_vs_trl(steps, repeats, init, n, t))
            for init, n in TABLE for t in TABLE_THREADS]
    print("\n| model | new tokens | threads | train.py s / step | TRL s / step | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for init, n, t, ours, trl in rows:
        name = "built-in base" if init == "base" else "random init"
        print(f"| {name} | {n} | {t} | {ours:.3f} | {trl:.3f} | {ours / trl:.2f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved runs of each trainer (median of their steps)")
    p.add_argument("--steps", type=int, default=4,
                   help="training steps per run (at least 4), the first left out")
    p.add_argument("--init", choices=["base", "random"], default="base",
                   help="the built-in base model, or the same architecture randomly initialised "
                        "(no build)")
    p.add_argument("--new-tokens", type=int, default=4,
                   help="tokens each answer may have (max_completion_length, --max-new-tokens)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each trainer")
    p.add_argument("--table", action="store_true",
                   help="every configuration of docs/speed.md's table (ignores --init, "
                        "--new-tokens and --threads)")
    args = p.parse_args(argv)
    if args.steps < 4 or args.repeats < 1 or args.new_tokens < 1 or args.threads < 1:
        p.error("--steps must be >= 4, --repeats, --new-tokens and --threads >= 1")
    torch.set_num_threads(1)  # this parent only waits; each section names its children's threads
    print(header("python -m bench.vs_trl", "cpu", args.repeats,
                 threads="each section's torch threads in its title (both trainers' processes)"))
    t0 = time.perf_counter()
    if args.table:
        bench_table(args.steps, args.repeats)
    else:
        bench_vs_trl(args.steps, args.repeats, args.init, args.new_tokens, args.threads)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
