"""What the benchmarks share: the repo root, timers, memory probes, the header line, and the 38.9M
Qwen2 of the rollout and training sections.

Not an article section: the measuring tools of `python -m bench` (bench/__main__.py) and
`python -m bench.vs_trl`.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root: children's cwd


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a timer reads finished work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    """(seconds, fn()) with the device synchronised on both sides."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


RSS_READABLE = os.path.exists("/proc/self/clear_refs")  # CPU memory is read from Linux's /proc/self


def rss_now() -> int:
    """This process's resident bytes now (Linux's VmRSS)."""
    return _status_kib("VmRSS") * 1024


def rss_peak(run) -> int:
    """Bytes this process's resident set peaks at above where it is now while `run()` runs (Linux's
    VmHWM, reset just before): run it in a fresh process (`in_fresh_process`), after warming up the
    kernels."""
    with open("/proc/self/clear_refs", "w") as fh:              # peak RSS := current RSS (Linux)
        fh.write("5")
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) * 1024


def cuda_peak(run) -> int:
    """Bytes of CUDA memory allocated at the peak of `run()` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def in_fresh_process(call: str, count: int = 1) -> int | list[int]:
    """Run the Python statement `call` (it prints numbers of bytes) in a fresh interpreter at the
    repo root (so `from bench import rollouts` and the project's modules import); return the last
    number it printed, or with count > 1 the last `count`."""
    res = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    numbers = [int(x) for x in res.stdout.split()[-count:]]
    return numbers[0] if count == 1 else numbers


def header(script: str, device: str, repeats: int, threads: str | None = None) -> str:
    """The first line of a benchmark's output: versions, the machine, its load. threads: what to
    say of the torch threads where the work runs in child processes (default: this process's)."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)
    where = (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else
             f", {os.cpu_count()} cores ({cpu}), "
             f"{threads or f'{torch.get_num_threads()} torch threads'}")
    return (f"# {script}: torch {torch.__version__}, {device}{where}"
            f", load average {os.getloadavg()[0]:.1f}; medians of {repeats} interleaved repeats")


def update_args(T: int, **given):
    """update.update_policy's flags.TrainArgs fields for one on-policy DAPO-style update of
    T-token responses (token mean, clip 0.2 / 0.28, beta 0), `given` fields overriding."""
    from types import SimpleNamespace
    return SimpleNamespace(**{
        **dict(micro_batch_size=8, micro_batch_tokens=10**6, mini_batches=1, mu=1,
               temperature=1.0, top_p=1.0, reduction="token", loss="ppo", fsdp=False,
               gradient_checkpointing=False, max_new_tokens=T, eps_low=0.2, eps_high=0.28,
               clip_c=0.0, tis_cap=0.0, off_policy_mask=0.0, entropy_coef=0.0, beta=0.0,
               kl="k3", grad_clip=1.0), **given})


def qwen_39m():
    """The 38.9M-parameter Qwen2 of the rollout sections (and the training forward), random init
    from seed 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=1, pad_token_id=0))
