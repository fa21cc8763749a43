"""bf16 on the CPU: --bf16 autocast against float32 for Step 1 (sampler.sample_groups, as
harness/rollout.py runs it) and one Step 4 update (update.update_policy) on a real model, with the
matmul probe in both dtypes and what the CPU says it has (AVX512-BF16, AMX).

Not an article section: how fast the loop of "GRPO 训练过程拆解" runs on a laptop's CPU, and whether
bf16 pays there. The model is the real one of docs/real-model-on-a-laptop.md (SmolLM2-135M-Instruct,
built offline: $REAL_MODEL, else ~/.cache/grpo-dapo/smollm2-135m); without it the section says so
and skips.

    python -m bench --only bf16              # one torch thread
    python -m bench --only bf16 --threads 0  # all cores
"""
from __future__ import annotations

import os
import statistics

import torch

import update
from bench.common import timed, update_args
from harness import perf
from infra import parallel
from sampler import sample_groups

DEFAULT_MODEL = os.path.expanduser("~/.cache/grpo-dapo/smollm2-135m")
B, G, T = 8, 4, 32  # prompts, responses per prompt, new tokens (no end id: every row runs T)


def cpu_bf16() -> dict[str, bool]:
    """What the CPU reports for bf16 arithmetic: /proc/cpuinfo's avx512_bf16 (bf16 dot products in
    AVX-512) and amx_bf16 (AMX tiles), and torch's own CPU capability string."""
    try:
        with open("/proc/cpuinfo") as fh:
            words = set(fh.read().split())
    except OSError:
        words = set()
    return {"avx512_bf16": "avx512_bf16" in words, "amx_bf16": "amx_bf16" in words,
            "torch capability": torch.backends.cpu.get_cpu_capability()}


def bench_bf16(device: str, repeats: int) -> None:
    from transformers import AutoModelForCausalLM
    print("\n== bf16 autocast vs float32 on the CPU (SmolLM2-135M) ==")
    print("CPU: " + ", ".join(f"{k} {v}" for k, v in cpu_bf16().items()))
    path = os.environ.get("REAL_MODEL", DEFAULT_MODEL)
    if device != "cpu" or not os.path.isdir(path):
        print(f"skipped: needs the CPU and the real model at {path} (python -m real_model.build)")
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(min(100, V // 2), V, (24,), generator=g).tolist() for _ in range(B)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(B)]  # noqa: E731
    amp = {bf16: (lambda on=bf16: torch.autocast("cpu", torch.bfloat16, enabled=on))
           for bf16 in (False, True)}
    probe = {bf16: perf.probe_flops(torch.bfloat16 if bf16 else torch.float32)
             for bf16 in (False, True)}

    def rollout(bf16: bool):
        with amp[bf16](), torch.no_grad():
            return sample_groups(model, prompts, G, T, -1, 0, 1.0, generator=gens())

    rolls = {bf16: rollout(bf16) for bf16 in (False, True)}             # warm-up, and the rollouts
    roll = rolls[False]
    roll.index = torch.arange(B).repeat_interleave(G)
    adv = torch.randn(B * G, generator=torch.Generator().manual_seed(1))

    def one_update(bf16: bool):
        learner = update.Learner(model, model, None, torch.optim.SGD(model.parameters(), lr=0.0),
                                 amp[bf16])
        model.train()
        update.update_policy(learner, roll, adv, roll.mask,
                             update_args(T, grad_clip=0.0, lr=0.0), parallel.Dist("cpu"))
        model.eval()
        model.zero_grad(set_to_none=True)

    times = {(what, bf16): [] for what in ("rollout", "update") for bf16 in (False, True)}
    for _ in range(repeats):                                  # interleaved: fp32, bf16, fp32, ...
        for bf16 in (False, True):
            times[("rollout", bf16)].append(timed(lambda b=bf16: rollout(b), device)[0])
            times[("update", bf16)].append(timed(lambda b=bf16: one_update(b), device)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = B * G * T
    print(f"{B} prompts of 24 tokens x G = {G}, {T} new tokens each ({tokens} tokens), one "
          f"on-policy update of them; {torch.get_num_threads()} thread(s), medians of {repeats}")
    print("| | float32 | bf16 autocast | bf16 / float32 speed |\n| --- | --- | --- | --- |")
    print(f"| matmul probe [1024, 1024], GFLOP/s | {probe[False] / 1e9:.0f} | "
          f"{probe[True] / 1e9:.0f} | {probe[True] / probe[False]:.2f}x |")
    for what in ("rollout", "update"):
        f, b = med[(what, False)], med[(what, True)]
        print(f"| {what} (Step {'1' if what == 'rollout' else '4'}), s | {f:.2f} | {b:.2f} | "
              f"{f / b:.2f}x |")
    # the same uniforms: each row draws float32's tokens until a rounding flips one draw
    agree = (rolls[True].response_ids == rolls[False].response_ids).long().cumprod(-1)  # [N, T]
    diff = (rolls[True].logprobs - rolls[False].logprobs)[agree.bool()].abs()
    print(f"bf16's rollout: {agree.all(-1).float().mean():.2f} of the rows are float32's tokens "
          f"(the same uniforms), {agree.sum(-1).float().mean():.1f} of {T} tokens on average "
          f"before the first that differs; on those, the sampled tokens' log-probs differ by "
          f"{diff.mean():.2e} on average, {diff.max():.2e} at most")
