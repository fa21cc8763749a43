"""Speed and memory: the command that runs every benchmark, the timers and memory probes they share, and the
built-in base model's warm start packed vs padded (here, not in builtin.py: it measures the build, not the loop).

The sections (each prints both sides of its comparison from one run):
- bench_rollout.py, "Step 1: Rollout 采样" (generation is most of an RL step's time): sample_groups vs HF
  generate, its memory and continuous batching at max_num_seqs, the two rollout engines (sample_groups vs vLLM);
- bench_train.py, the log-prob passes and the update of "Step 4: PPO Loss 计算" (vocabulary-sized logits
  dominate memory): token_logprobs vs the naive form, the shared-prefix training forward, one training step
  split into its phases, gradient checkpointing;
- below, the warm start: one supervised step of demonstrations packed into rows vs padded to the longest;
- bench_trl.py, its own command: a GRPO step of train.py vs TRL's GRPOTrainer (TRL in its own venv).

    python bench.py               # every section: roughly 9 minutes on 2 CPU cores (one torch thread); CUDA if available
    python bench.py --threads 0   # torch's default thread count
    python bench.py --only slots  # one section
    python bench.py --only warmstart --threads 0   # the warm start on all cores, as builtin.py builds

Every time is the median of --repeats repeats, interleaved (A, B, A, B, ...) so that load from other
processes falls on both sides alike; ratios are of those medians.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


RSS_READABLE = os.path.exists("/proc/self/clear_refs")  # on CPU, memory is read from Linux's /proc/self


def rss_peak(run) -> int:
    """Bytes this process's resident set peaks at above where it is now while `run()` runs (Linux's VmHWM,
    reset just before): run it in a fresh process (`in_fresh_process`), after warming up the kernels."""
    with open("/proc/self/clear_refs", "w") as fh:                           # peak RSS := current RSS (Linux)
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


def in_fresh_process(call: str) -> int:
    """Run the Python statement `call` (it prints a number of bytes) in a fresh interpreter in this folder;
    return the last number it printed."""
    res = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, check=True, cwd=HERE)
    return int(res.stdout.split()[-1])


def header(script: str, device: str, repeats: int) -> str:
    """The first line of a benchmark's output: versions, the machine, its load."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return (f"# {script}: torch {torch.__version__}, {device}"
            + (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else
               f", {os.cpu_count()} cores ({cpu}), {torch.get_num_threads()} torch threads")
            + f", load average {os.getloadavg()[0]:.1f}; medians of {repeats} interleaved repeats")


# ---------------------------------------------------------------------------------------------
# The built-in base model's warm start: demonstrations packed into rows vs padded to the longest
# ---------------------------------------------------------------------------------------------

def _padded(ids, pos, labels):
    """The same demonstrations as a packed batch, one per row, padded to the longest (the unpacked form)."""
    seqs = []
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        seqs += [(ids[r, a:b], labels[r, a:b]) for a, b in zip(starts, starts[1:]) if (labels[r, a:b] != -100).any()]
    T = max(len(s) for s, _ in seqs)
    out = torch.zeros(len(seqs), T, dtype=torch.long), torch.full((len(seqs), T), -100), torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        out[0][i, :len(s)], out[1][i, :len(s)], out[2][i, :len(s)] = s, lab, 1
    return out  # input_ids, labels, attention_mask: [B, T] each


def bench_warm_start(device: str, repeats: int, steps: int = 6) -> None:
    import dataclasses

    import builtin
    cfg = dataclasses.replace(builtin.BaseModelConfig(), sft_steps=steps * repeats + 2)
    tok = builtin.make_tokenizer()
    model = builtin.make_model(cfg, len(tok)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = builtin.warm_start_batches(tok, cfg)

    def step(b, packed: bool):
        ids, pos, labels = b
        if packed:
            logits = model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False).logits
        else:
            ids, labels, attn = _padded(ids, pos, labels)
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return ids.numel()

    step(batches[0], True), step(batches[1], False)  # warm-up
    times, tokens = {True: [], False: []}, {True: [], False: []}
    for b in batches[2:]:
        for packed in (True, False):  # interleaved, on the same batch
            t0 = time.perf_counter()
            tokens[packed].append(step(b, packed))
            _sync(device)
            times[packed].append(time.perf_counter() - t0)
    real = statistics.mean(int((b[0] != tok.pad_token_id).sum()) for b in batches[2:])  # demonstrations hold no <pad>
    print(f"\n## The built-in warm start: one step of {cfg.sft_batch_size} demonstrations, packed vs padded "
          f"(median of {len(batches) - 2} steps, interleaved)")
    for packed, name in ((False, "padded to the longest (attention mask)"), (True, f"packed into rows of <= {cfg.sft_pack_len} tokens")):
        med = statistics.median(times[packed])
        print(f"  {name:44s} {med * 1e3:7.1f} ms/step   {statistics.mean(tokens[packed]):6.0f} positions "
              f"({real:.0f} real)   x {builtin.BaseModelConfig().sft_steps} steps = {med * builtin.BaseModelConfig().sft_steps:5.0f} s")
    print(f"  packed / padded time: {statistics.median(times[True]) / statistics.median(times[False]):.2f}")


def main(argv=None) -> None:
    import bench_rollout
    import bench_train
    sections = {"rollouts": bench_rollout.bench_rollouts, "slots": bench_rollout.bench_slots,
                "logprobs": bench_train.bench_logprobs, "forward": bench_train.bench_forward,
                "step": bench_train.bench_step, "checkpointing": bench_train.bench_checkpointing,
                "warmstart": bench_warm_start, "engines": bench_rollout.bench_engines}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per timing (median reported)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run in the step split")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU, 0 = torch's default. 1 by default: on cores shared with other "
                        "jobs, threads spin-waiting for a busy core make times vary tenfold")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--only", choices=list(sections), default=None, help="run one section")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads and device == "cpu":
        torch.set_num_threads(args.threads)
    print(header("bench.py", device, args.repeats))
    t0 = time.perf_counter()
    for name, section in sections.items():
        if args.only in (None, name):
            section(device, args.steps if name == "step" else args.repeats)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
