"""Speed and memory: sample_groups vs HF generate, its memory and continuous batching at max_num_seqs,
token_logprobs vs the naive form, one training step,
the shared-prefix training forward, a GRPO step vs TRL, one update on long responses with and without
gradient checkpointing, the built-in warm start packed vs padded, and the two rollout engines (sample_groups vs vLLM).

Article sections it measures: "Step 1: Rollout 采样" (generation is most of an RL step's time) and the
log-prob passes of "Step 4: PPO Loss 计算" (vocabulary-sized logits dominate memory).

    python bench.py               # every section: roughly 9 minutes on 2 CPU cores (one torch thread); CUDA if available
    python bench.py --threads 0   # torch's default thread count

Every time is the median of --repeats repeats, interleaved (A, B, A, B, ...) so that load from other
processes falls on both sides alike; ratios are of those medians.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import grpo
import logprobs
from sampler import Rollout, sample_groups

V_QWEN = 151_936  # Qwen2's vocabulary
LOGIT_SHAPE = (8, 64)  # 512 rows of logits for the log-prob comparison


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def matmul_flops(device: str, dtype=torch.float32, seconds: float = 1.0) -> float:
    """FLOP/s of a large matmul on this device: the hardware limit the rollout is compared with."""
    n = 4096 if device.startswith("cuda") else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b
    _sync(device)
    k, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ b
        k += 1
        if device.startswith("cuda") and k % 50 == 0:
            _sync(device)
    _sync(device)
    return 2 * n ** 3 * k / (time.perf_counter() - t)


# ---------------------------------------------------------------------------------------------
# 1. Rollouts: sample_groups vs model.generate(num_return_sequences=G)
# ---------------------------------------------------------------------------------------------

class ForwardClock:
    """Seconds spent inside model.forward (hooks on the top module): the part of a rollout that any sampler
    calling the model pays; the rest is the sampler's own (sampling, cache bookkeeping)."""

    def __init__(self, model, device: str):
        self.device, self.seconds, self._t0 = device, 0.0, 0.0
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def _start(self, module, args):
        _sync(self.device)
        self._t0 = time.perf_counter()

    def _stop(self, module, args, out):
        _sync(self.device)
        self.seconds += time.perf_counter() - self._t0


def decode_matmuls(model, rows: int, device: str, steps: int = 10) -> float:
    """Seconds of one decode step's matrix multiplies alone: `rows` tokens through every nn.Linear weight of
    the model (vocabulary projection included), each weight once, as a step reads them."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(rows, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    times = []
    with torch.no_grad():
        for _ in range(steps + 1):
            times.append(_timed(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for w in weights], device)[0])
    return statistics.median(times[1:])


def bench_rollouts(device: str, repeats: int, B=8, P=32, G=8, T=64) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=512, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device).eval()
    clock = ForwardClock(model, device)
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(2, cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(0)).tolist()

    def ours():
        roll = sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0,
                             generator=[torch.Generator().manual_seed(i) for i in range(B)])
        return int(roll.lengths.sum())

    def hf():
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=G,
                                 max_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=1, pad_token_id=0)
        resp = out[:, P:]                                                     # [N, <= T]
        ended = (resp == 1).long().cumsum(-1) - (resp == 1).long()            # EOS already seen before this token
        return int((ended == 0).sum())                                        # tokens up to and including EOS

    print(f"\n## Rollouts: B={B} prompts of {P} tokens, G={G}, {T} new tokens, temperature 1, {device}")
    print(f"Qwen2, random init, {params / 1e6:.1f}M parameters (hidden 512, 8 layers, 8 heads / 2 KV heads, "
          f"MLP 1408, vocab 32000, tied embeddings)")
    print("'in forward': seconds inside model.forward, which any sampler that calls the model pays; "
          "'ceiling': generate's time / sample_groups' forward time, the ratio if sampling cost nothing")
    print(f"{'':46s}{'tokens/s':>9s}{'s / rollout':>12s}{'in forward':>11s}{'of ideal':>9s}")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        ours(), hf()                                                          # warm-up
        times, fwd, tokens, flops = {"ours": [], "hf": []}, {"ours": [], "hf": []}, {}, []
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("hf", hf)):
                clock.seconds = 0.0
                dt, tokens[name] = _timed(fn, device)
                times[name].append(dt)
                fwd[name].append(clock.seconds)
            flops.append(matmul_flops(device, dtype))
        step = decode_matmuls(model, B * G, device)
        med = {k: statistics.median(v) for k, v in times.items()}
        fmed = {k: statistics.median(v) for k, v in fwd.items()}
        ideal = statistics.median(flops) / (2 * params)                      # tokens/s if only matmuls at peak
        short = str(dtype).removeprefix("torch.")
        for name, label in (("ours", "sample_groups"), ("hf", "model.generate(num_return_sequences=G)")):
            tps = tokens[name] / med[name]
            print(f"{short + ' ' + label:46s}{tps:9.0f}{med[name]:12.2f}{fmed[name]:11.2f}{tps / ideal:9.0%}")
        ratio = (tokens["ours"] / med["ours"]) / (tokens["hf"] / med["hf"])
        print(f"{short + ' ratio sample_groups / generate':46s}{ratio:8.2f}x   (ceiling {med['hf'] / fmed['ours']:.2f}x)")
        print(f"{short + ' ideal: matmul FLOP/s / (2 x params)':46s}{ideal:9.0f}   "
              f"(a large {short} matmul runs at {statistics.median(flops) / 1e9:.0f} GFLOP/s here)")
        print(f"{short + f' matmuls alone, {B * G}-row decode steps':46s}{B * G / step:9.0f}   "
              f"({2 * params * B * G / step / 1e9:.0f} GFLOP/s: the model's matrix multiplies at the decode shape)")


# ---------------------------------------------------------------------------------------------
# 1b. max_num_seqs: the rollout's peak memory at a few slots vs all rows, continuous vs static batches
# ---------------------------------------------------------------------------------------------

SLOTS_SETUP = dict(B=32, G=4, T=512, vocab=512, ends=16)  # 16 of 512 ids end a response: lengths ~ geometric, mean ~32


def _slots_rollout(device: str, max_num_seqs, continuous: bool = True):
    """The long-tailed rollout of SLOTS_SETUP on a random Qwen2 (hidden 256, 4 layers, 2 KV heads of 64):
    the model, the prompts, and a function that samples them and returns the Rollout."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    c = SLOTS_SETUP
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=c["vocab"], hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(c["ends"] + 1, c["vocab"], (int(n),), generator=g).tolist()
               for n in torch.randint(16, 49, (c["B"],), generator=g)]                # 16 to 48 tokens
    return model, prompts, lambda n=max_num_seqs, cont=continuous: sample_groups(
        model, prompts, c["G"], c["T"], list(range(1, c["ends"] + 1)), 0,
        generator=[torch.Generator().manual_seed(i) for i in range(c["B"])], max_num_seqs=n, continuous=cont)


def slots_child(n: str) -> None:
    """Run in a fresh process: print the peak resident memory one rollout adds above the model, in bytes."""
    _, _, run = _slots_rollout("cpu", None if n == "all" else int(n))
    run(8) if n == "all" else run(None)                                      # load the kernels first, at the other size
    with open("/proc/self/clear_refs", "w") as fh:                           # peak RSS := current RSS (Linux)
        fh.write("5")
    before = _status_kib("VmRSS")
    run()
    print((_status_kib("VmHWM") - before) * 1024)


def bench_slots(device: str, repeats: int, small: int = 16) -> None:
    c = SLOTS_SETUP
    rows = c["B"] * c["G"]
    print(f"\n## max_num_seqs: B={c['B']} prompts of 16-48 tokens, G={c['G']}, T={c['T']}, {c['ends']} of {c['vocab']} ids end "
          f"a response (lengths ~ geometric), random Qwen2 (hidden 256, 4 layers, 2 KV heads), {device}")
    model, prompts, run = _slots_rollout(device, None)
    kv = 4 * 2 * 64 * 2 * next(model.parameters()).element_size()           # bytes per position: layers x KV heads x dim x 2 x 4
    P = max(len(p) for p in prompts)
    print(f"KV cache: {kv} bytes per position x N x (P + T), P = {P}: N = {rows} (all rows) "
          f"{kv * rows * (P + c['T']) / 2**20:.0f} MB, N = {small}: {kv * small * (P + c['T']) / 2**20:.0f} MB")
    if device.startswith("cuda"):
        peak = {}
        for n in (small, None):
            run(n)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run(n)
            torch.cuda.synchronize()
            peak[n] = torch.cuda.max_memory_allocated() - base
        how = "peak allocated above the model"
    elif os.path.exists("/proc/self/clear_refs"):
        here = os.path.abspath(__file__)
        child = lambda n: int(subprocess.run(  # noqa: E731
            [sys.executable, here, "--slots-child", str(n or "all"), json.dumps(SLOTS_SETUP)], check=True,
            capture_output=True, text=True, cwd=os.path.dirname(here)).stdout.split()[-1])
        peak = {n: statistics.median(child(n) for _ in range(repeats)) for n in (small, None)}
        how = "peak RSS of a fresh process above the model"
    else:
        peak, how = None, "(not measured: on CPU the measurement reads Linux's /proc/self)"
    if peak:
        print(f"rollout memory, {how}: N = {small}: {peak[small] / 2**20:.0f} MB, all {rows} rows: {peak[None] / 2**20:.0f} MB "
              f"(ratio {peak[None] / max(peak[small], 1):.1f}x)")
    else:
        print(how)
    ref = run(None)
    times, tokens = {True: [], False: []}, int(ref.lengths.sum())
    for _ in range(repeats):
        for cont in (True, False):                                           # interleaved
            dt, roll = _timed(lambda cont=cont: run(small, cont), device)
            times[cont].append(dt)
            assert torch.equal(roll.response_ids, ref.response_ids)         # the same rollout, whatever the schedule
    lens = ref.lengths.float()
    print(f"{tokens} tokens, lengths mean {lens.mean():.0f}, median {lens.median():.0f}, max {lens.max():.0f}; "
          f"the same response ids at N = {small} (both modes) and N = all")
    med = {k: statistics.median(v) for k, v in times.items()}
    for cont, name in ((False, "static batches (admit N, wait for all, admit the next)"), (True, "continuous batching")):
        print(f"  N = {small}, {name:52s} {tokens / med[cont]:7.0f} tokens/s {med[cont]:7.2f} s")
    print(f"  continuous / static tokens/s: {med[False] / med[True]:.2f}x")


# ---------------------------------------------------------------------------------------------
# 2. token_logprobs vs log_softmax(logits).gather(...) at Qwen's vocabulary
# ---------------------------------------------------------------------------------------------

def _naive(logits, ids):
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


def _variant(name):
    return _naive if name == "naive" else logprobs.token_logprobs


def _inputs(dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(*LOGIT_SHAPE, V_QWEN, generator=g, device=device).to(dtype).requires_grad_(grad)
    return logits, torch.randint(0, V_QWEN, LOGIT_SHAPE, generator=g, device=device)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def mem_child(variant: str, dtype_name: str, backward: bool) -> None:
    """Run in a fresh process: print the peak resident memory the call adds above the inputs, in bytes."""
    fn, dtype = _variant(variant), getattr(torch, dtype_name)
    small = torch.randn(2, 3, 50, dtype=dtype, requires_grad=backward)      # load the kernels first
    out = fn(small, torch.zeros(2, 3, dtype=torch.long))
    if backward:
        out.sum().backward()
    logits, ids = _inputs(dtype, "cpu", backward)
    with open("/proc/self/clear_refs", "w") as fh:                           # peak RSS := current RSS (Linux)
        fh.write("5")
    before = _status_kib("VmRSS")
    out = fn(logits, ids)
    if backward:
        out.float().sum().backward()
    print((_status_kib("VmHWM") - before) * 1024)


def peak_extra(variant: str, dtype_name: str, backward: bool, device: str) -> int:
    """Bytes of peak memory the call adds above its inputs: CUDA's peak allocated, or on CPU the peak
    resident set of a fresh process (Linux's VmHWM, reset just before the call)."""
    if device.startswith("cuda"):
        logits, ids = _inputs(getattr(torch, dtype_name), device, backward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = _variant(variant)(logits, ids)
        if backward:
            out.float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    here = os.path.abspath(__file__)
    res = subprocess.run([sys.executable, here, "--mem-child", variant, dtype_name, str(int(backward))],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(here))
    return int(res.stdout.strip().splitlines()[-1])


def bench_logprobs(device: str, repeats: int) -> None:
    rows = LOGIT_SHAPE[0] * LOGIT_SHAPE[1]
    print(f"\n## token_logprobs vs log_softmax(logits).gather(...): {rows} rows x V = {V_QWEN:,}, {device}")
    logits, ids = _inputs(torch.float32, device, True)
    with torch.no_grad():
        err = (logprobs.token_logprobs(logits, ids) - _naive(logits, ids)).abs().max().item()
    print(f"float32 logits {logits.numel() * 4 / 2**20:.0f} MB; max |difference| of the values {err:.1e}")
    print(f"{'extra peak memory above the inputs':36s}{'naive':>10s}{'token_logprobs':>16s}{'ratio':>8s}")
    cases = (("float32", False), ("bfloat16", False), ("float32", True))
    if device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        print("  (not measured: on CPU the measurement reads Linux's /proc/self)")
        cases = ()
    for dtype_name, backward in cases:
        a, b = (peak_extra(v, dtype_name, backward, device) for v in ("naive", "ours"))
        label = f"{'forward + backward' if backward else 'forward'}, {dtype_name}"
        print(f"  {label:34s}{a / 2**20:7.0f} MB{b / 2**20:13.0f} MB{b / a:8.2f}")

    def fwd(fn):
        with torch.no_grad():
            return fn(logits, ids)

    def fwd_bwd(fn):
        fn(logits, ids).sum().backward()
        logits.grad = None

    times = {}
    for _ in range(repeats):
        for kind, run in (("forward", fwd), ("forward + backward", fwd_bwd)):
            for name in ("naive", "ours"):
                times.setdefault((kind, name), []).append(_timed(lambda run=run, name=name: run(_variant(name)), device)[0])
    print(f"{'time, float32':36s}{'naive':>10s}{'token_logprobs':>16s}")
    for kind in ("forward", "forward + backward"):
        a, b = (statistics.median(times[(kind, n)]) for n in ("naive", "ours"))
        print(f"  {kind:34s}{a:8.3f} s{b:14.3f} s")


# ---------------------------------------------------------------------------------------------
# 3. One training step of the built-in default, split into its phases
# ---------------------------------------------------------------------------------------------

def bench_step(device: str, steps: int) -> None:
    import train
    keys = ("time/sample_s", "time/reward_s", "time/logprob_s", "time/update_s", "time/step_s")
    print(f"\n## One training step of the built-in default (median of {steps} steps), seconds")
    print(f"{'':44s}{'sample':>8s}{'reward':>8s}{'old+ref':>8s}{'update':>8s}{'step':>8s}")
    runs = ((["--algo", "dapo"], "(mu 1, beta 0: no extra pass)"), (["--algo", "grpo"], "(beta 0.04: reference pass)"),
            (["--algo", "dapo", "--mu", "2"], "(old-policy pass)"))
    for flags, note in runs:
        with tempfile.TemporaryDirectory() as out:
            argv = [*flags, "--steps", str(steps), "--eval-size", "8", "--out", out, "--device", device]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                train.main(argv)
            with open(os.path.join(out, "metrics.jsonl")) as fh:
                rows = [r for r in map(json.loads, fh) if "time/step_s" in r]
        med = [statistics.median(r.get(k, 0.0) for r in rows) for k in keys]
        print(f"  {' '.join(flags) + ' ' + note:42s}" + "".join(f"{x:8.2f}" for x in med))


# ---------------------------------------------------------------------------------------------
# 4. The training forward: each group's prompt once (logprobs.rollout_logprobs) vs once per response
# ---------------------------------------------------------------------------------------------

def forward_positions(roll, slices) -> dict:
    """Token positions of a pass over `slices`, computed and real (not padding), for both forms.
    Per response: every row is its prompt left-padded to the slice's longest + the rollout's width; shared: each
    group's prompt but its last token once, left-padded to the slice's longest, then every row as [last prompt
    token, response] right-padded to the longest of its length bucket (logprobs._length_buckets)."""
    n = {"per-response": [0, 0], "shared": [0, 0]}                              # [computed, real]
    for s in slices:
        rows = range(s.start, s.stop)
        plen = {i // roll.G: len(roll.prompts[i // roll.G]) for i in rows}       # group -> prompt length
        lengths = roll.lengths[s].tolist()
        n["per-response"][0] += len(rows) * (max(plen.values()) + roll.response_ids.shape[1])
        n["per-response"][1] += sum(plen[i // roll.G] for i in rows) + sum(lengths)
        n["shared"][0] += len(plen) * (max(plen.values()) - 1) + sum(
            len(r) * max(lengths[i] for i in r.tolist()) for r in logprobs._length_buckets(roll.lengths[s]))
        n["shared"][1] += sum(p - 1 for p in plen.values()) + sum(lengths)
    return n


def _passes(fn, model, roll, mb: int, temperature: float, device: str) -> dict:
    """Seconds of a no-grad log-prob pass and of an update (forward, GRPO loss, backward) over micro-batches."""
    N = roll.response_ids.shape[0]
    slices = [slice(k, min(k + mb, N)) for k in range(0, N, mb)]
    adv = torch.randn(N, generator=torch.Generator().manual_seed(0)).to(device)

    def logprob_pass():
        with torch.no_grad():
            for s in slices:
                fn(model, roll, s, temperature)

    def update():
        model.zero_grad(set_to_none=True)
        for s in slices:
            logp, ent, mask = fn(model, roll, s, temperature, with_entropy=True)
            grpo.policy_loss(logp, logp.detach(), adv[s], mask, grpo.token_weights(mask, num_seqs=N))[0].backward()

    return {"log-prob pass": _timed(logprob_pass, device)[0], "update": _timed(update, device)[0]}


def bench_forward(device: str, repeats: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import builtin
    import data
    print("\n## The training forward: each group's prompt once (shared prefix) vs once per response, seconds")
    cases = []
    # the built-in task: the base model's own rollouts of the default step (32 prompts x 8, 40 new tokens)
    _, tok, model = data.load_model("builtin")
    encode = data.PromptFormatter(tok, "{prompt}", None, True)
    prompts = [encode(r["prompt"]) for r in builtin.sample_problems(32, 0, False, distinct=False)]
    roll = sample_groups(model.to(device), prompts, 8, 40, data.end_ids(tok, model), tok.pad_token_id,
                         generator=[torch.Generator().manual_seed(i) for i in range(32)])
    cases.append(("built-in task, 32 prompts x G=8, micro-batch 64", model, roll, 64))
    # a 38.9M-parameter Qwen2 (the rollout section's), one 256-token prompt, G random 64-token responses
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(cfg).to(device)
    for G in (8, 16):
        g = torch.Generator().manual_seed(G)
        resp = torch.randint(2, cfg.vocab_size, (G, 64), generator=g)
        roll = Rollout(prompts=torch.randint(2, cfg.vocab_size, (1, 256), generator=g).tolist(), G=G, pad_token_id=0,
                       response_ids=resp, mask=torch.ones(G, 64), lengths=torch.full((G,), 64), truncated=torch.ones(G, dtype=torch.bool),
                       logprobs=torch.zeros(G, 64))
        cases.append((f"Qwen2 38.9M, 256-token prompt, G={G} x 64 tokens, micro-batch {G}", qwen, roll, G))
    forms = (("shared", logprobs.rollout_logprobs), ("per-response", logprobs.per_response_logprobs))
    for label, model, roll, mb in cases:
        N = roll.response_ids.shape[0]
        pos = forward_positions(roll, [slice(k, min(k + mb, N)) for k in range(0, N, mb)])
        print(f"{label}\n  token positions a pass computes: " + ", ".join(
            f"{k} {c} ({1 - r / c:.0%} of them padding)" for k, (c, r) in pos.items())
            + f"; shared / per-response {pos['shared'][0] / pos['per-response'][0]:.2f}")
        _passes(logprobs.rollout_logprobs, model, roll, mb, 1.0, device)                 # warm-up
        times = {}
        for _ in range(repeats):
            for name, fn in forms:
                for k, v in _passes(fn, model, roll, mb, 1.0, device).items():
                    times.setdefault((k, name), []).append(v)
        for kind in ("log-prob pass", "update"):
            a, b = (statistics.median(times[(kind, n)]) for n, _ in forms)
            print(f"  {kind:16s} shared {a:7.3f}   per-response {b:7.3f}   ratio {b / a:5.2f}x")


# ---------------------------------------------------------------------------------------------
# 5. A GRPO step of train.py vs TRL's GRPOTrainer (run with a Python that has trl installed)
# ---------------------------------------------------------------------------------------------

VS_TRL = dict(prompts=16, G=8, new_tokens=4, beta=0.04)  # the short-answer configuration of issue 16


def trl_child(folder: str, steps: int) -> None:
    """In a fresh process: `steps` GRPOTrainer steps on folder/model and folder/train.jsonl; prints seconds per step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import verifier
    rows = [json.loads(line) for line in open(os.path.join(folder, "train.jsonl"))]
    tok = AutoTokenizer.from_pretrained(os.path.join(folder, "model"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"), dtype=torch.float32)
    ends = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    def reward(completions, answer, **_):
        return [verifier.verify(c, a) for c, a in zip(completions, answer)]

    n = VS_TRL["prompts"] * VS_TRL["G"]
    cfg = GRPOConfig(output_dir=os.path.join(folder, "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
                     num_generations=VS_TRL["G"], max_completion_length=VS_TRL["new_tokens"], beta=VS_TRL["beta"],
                     loss_type="grpo", scale_rewards="group", temperature=1.0, learning_rate=1e-6, max_steps=steps,
                     use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"step_s": [b - a for a, b in zip(ends, ends[1:])]}))


def bench_vs_trl(steps: int, repeats: int, init: str = "base") -> None:
    """Both trainers on the built-in base model (init="random": the same architecture, randomly initialised, so
    nothing is built first) and the same 512 training prompts, each in its own process with one thread,
    interleaved; seconds per step, the first step of each run left out (warm-up)."""
    import builtin
    flags = ["--algo", "grpo", "--beta", str(VS_TRL["beta"]), "--prompts-per-step", str(VS_TRL["prompts"]),
             "--group-size", str(VS_TRL["G"]), "--max-new-tokens", str(VS_TRL["new_tokens"]),
             "--micro-batch-size", str(VS_TRL["prompts"] * VS_TRL["G"]), "--lr", "1e-6", "--steps", str(steps), "--device", "cpu"]
    print(f"\n## A GRPO step, train.py vs TRL's GRPOTrainer: {VS_TRL['prompts']} prompts x {VS_TRL['G']} samples, "
          f"{VS_TRL['new_tokens']} new tokens, beta {VS_TRL['beta']}, the built-in {'base' if init == 'base' else 'random-init'} "
          f"model, CPU, one thread")
    here, env = os.path.dirname(os.path.abspath(__file__)), {**os.environ, "OMP_NUM_THREADS": "1"}
    times = {"train.py": [], "TRL GRPOTrainer": []}
    with tempfile.TemporaryDirectory() as d:
        if init == "base":
            shutil.copytree(builtin.base_model(), os.path.join(d, "model"))
        else:
            tok = builtin.make_tokenizer()
            torch.manual_seed(0)
            builtin.make_model(builtin.BaseModelConfig(), len(tok)).save_pretrained(os.path.join(d, "model"))
            tok.save_pretrained(os.path.join(d, "model"))
        with open(os.path.join(d, "train.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in builtin.sample_problems(512, 0, False))
        for r in range(repeats):
            out = os.path.join(d, f"ours{r}")
            subprocess.run([sys.executable, os.path.join(here, "train.py"), "--model", os.path.join(d, "model"),
                            "--data", os.path.join(d, "train.jsonl"), "--out", out, *flags],
                           check=True, capture_output=True, cwd=here, env=env)
            with open(os.path.join(out, "metrics.jsonl")) as fh:
                times["train.py"] += [r["time/step_s"] for r in map(json.loads, fh) if "time/step_s" in r][1:]
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-child", d, str(steps)],
                                 capture_output=True, text=True, cwd=here, env=env)
            if res.returncode:
                raise RuntimeError(f"the TRL run failed (is trl installed for {sys.executable}?):\n{res.stderr[-2000:]}")
            line = next(x for x in reversed(res.stdout.splitlines()) if x.startswith('{"step_s"'))
            times["TRL GRPOTrainer"] += json.loads(line)["step_s"][1:]
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:18s} {v:7.3f} s / step (median of {len(times[k])} steps)")
    print(f"  train.py / TRL: {med['train.py'] / med['TRL GRPOTrainer']:.2f} (target <= 0.5)")


# ---------------------------------------------------------------------------------------------
# 6. Gradient checkpointing (--gradient-checkpointing): one update on long responses
# ---------------------------------------------------------------------------------------------

GC_SHAPE = dict(rows=4, prompt=32, response=512)   # 4 responses of 512 tokens after 32-token prompts


def _gc_setup(device: str, checkpointing: bool, response: int = GC_SHAPE["response"]):
    """A small random Qwen2 in train mode and a rollout of long responses (every token valid)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    import parallel
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device).train()
    if checkpointing:
        parallel.checkpoint_activations(model)
    g = torch.Generator().manual_seed(0)
    n, P = GC_SHAPE["rows"], GC_SHAPE["prompt"]
    roll = Rollout(prompts=torch.randint(2, cfg.vocab_size, (1, P), generator=g).tolist() * n, G=1, pad_token_id=0,
                   response_ids=torch.randint(2, cfg.vocab_size, (n, response), generator=g), mask=torch.ones(n, response),
                   lengths=torch.full((n,), response), truncated=torch.ones(n, dtype=torch.bool),
                   logprobs=torch.zeros(n, response))
    return model, roll


def _gc_update(model, roll) -> None:
    """One micro-batch of update.update_policy: log-probs of the responses, the clipped surrogate, backward."""
    logp, _, valid = logprobs.rollout_logprobs(model, roll, slice(0, roll.response_ids.shape[0]), 1.0)   # [n, T]
    advantages = torch.linspace(-1, 1, logp.shape[0], device=logp.device)                      # [n]
    loss, _ = grpo.policy_loss(logp, logp.detach(), advantages, valid, grpo.token_weights(valid, "token"))
    loss.backward()


def gc_child(checkpointing: bool) -> None:
    """Run in a fresh process: print the peak resident memory of one update above what was there before it
    (weights, gradients from a short warm-up update, the rollout), in bytes."""
    model, roll = _gc_setup("cpu", checkpointing)
    _gc_update(model, _gc_setup("cpu", False, response=8)[1])               # load the kernels, allocate .grad
    with open("/proc/self/clear_refs", "w") as fh:                           # peak RSS := current RSS (Linux)
        fh.write("5")
    before = _status_kib("VmRSS")
    _gc_update(model, roll)
    print((_status_kib("VmHWM") - before) * 1024)


def gc_peak(checkpointing: bool, device: str) -> int:
    """Bytes of peak memory one update adds: CUDA's peak allocated, or on CPU a fresh process's peak RSS."""
    if device.startswith("cuda"):
        model, roll = _gc_setup(device, checkpointing)
        _gc_update(model, _gc_setup(device, False, response=8)[1])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _gc_update(model, roll)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    here = os.path.abspath(__file__)
    res = subprocess.run([sys.executable, here, "--gc-child", str(int(checkpointing))],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(here))
    return int(res.stdout.strip().splitlines()[-1])


def bench_checkpointing(device: str, repeats: int) -> None:
    n, P, T = GC_SHAPE["rows"], GC_SHAPE["prompt"], GC_SHAPE["response"]
    models = {flag: _gc_setup(device, flag) for flag in (False, True)}
    params = sum(p.numel() for p in models[False][0].parameters())
    print(f"\n## One update on long responses, without and with gradient checkpointing: {n} responses of {T} tokens "
          f"(prompts {P}), Qwen2 {params / 1e6:.1f}M parameters (hidden 256, 8 layers, vocab 8000), {device}")
    if device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        print("  (memory not measured: on CPU the measurement reads Linux's /proc/self)")
        peak = None
    else:
        peak = {flag: gc_peak(flag, device) for flag in (False, True)}
    times = {False: [], True: []}
    for _ in range(repeats):
        for flag in (False, True):
            model, roll = models[flag]
            times[flag].append(_timed(lambda model=model, roll=roll: _gc_update(model, roll), device)[0])
            model.zero_grad(set_to_none=True)
    for model, roll in models.values():                                       # one more update each: same gradients?
        _gc_update(model, roll)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(models[False][0].parameters(), models[True][0].parameters()))
    how = "CUDA peak allocated" if device.startswith("cuda") else "peak RSS of a fresh process (Linux VmHWM)"
    print(f"{'':34s}{'without':>10s}{'with':>10s}{'ratio':>8s}")
    if peak:
        print(f"  {'extra peak memory of the update':32s}{peak[False] / 2**20:7.0f} MB{peak[True] / 2**20:7.0f} MB"
              f"{peak[True] / peak[False]:8.2f}")
    a, b = (statistics.median(times[f]) for f in (False, True))
    print(f"  {'time of the update':32s}{a:8.2f} s{b:8.2f} s{b / a:8.2f}")
    print(f"  memory: {how}, above the weights, gradients and inputs; max |gradient difference| {diff:.1e}")


# ---------------------------------------------------------------------------------------------
# 7. The built-in base model's warm start: demonstrations packed into rows vs padded to the longest
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


# ---------------------------------------------------------------------------------------------
# 8. The two rollout engines (--rollout hf, --rollout vllm) on the same model and rollout
# ---------------------------------------------------------------------------------------------

def bench_engines(device: str, repeats: int, B=8, P=32, G=8, T=64) -> None:
    """sample_groups vs a colocated vLLM engine (vllm_rollout.Engine, float32) drawing the same rollout shape
    from the same weights (section 1's model, saved to a folder for vLLM to load) in this process."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return print(f"\n## Rollout engines: skipped, vllm cannot be imported ({e}); see the README's --rollout vllm")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import vllm_rollout
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=None,
        eos_token_id=1, pad_token_id=0)).eval()
    prompts = torch.randint(2, 32000, (B, P), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")                  # GiB on CPU; plenty for B * G * (P + T)
        t0 = time.perf_counter()
        engine = vllm_rollout.Engine(folder, device, bf16=False, seed=0, gpu_memory_utilization=0.3)
        start = time.perf_counter() - t0
    model.to(device)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(B)]      # noqa: E731
    fns = {"hf": lambda: sample_groups(model, prompts, G, T, 1, 0, generator=gens()),
           "vllm": lambda: engine.sample_groups(model, prompts, G, T, 1, 0, generator=gens())}
    times, tokens = {k: [] for k in fns}, {}
    for fn in fns.values():                                                   # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            dt, roll = _timed(fn, device)
            times[name].append(dt)
            tokens[name] = int(roll.lengths.sum())
    print(f"\n## Rollout engines: B={B} prompts of {P} tokens, G={G}, {T} new tokens, temperature 1, float32, {device}")
    print(f"section 1's Qwen2 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters); vLLM {vllm.__version__}, "
          f"in this process, started in {start:.0f} s; {torch.get_num_threads()} torch threads after its start")
    print(f"{'':34s}{'tokens/s':>9s}{'s / rollout':>12s}")
    for name, label in (("hf", "--rollout hf (sample_groups)"), ("vllm", "--rollout vllm (vLLM engine)")):
        med = statistics.median(times[name])
        print(f"{label:34s}{tokens[name] / med:9.0f}{med:12.2f}")
    ratio = (tokens["vllm"] / statistics.median(times["vllm"])) / (tokens["hf"] / statistics.median(times["hf"]))
    print(f"{'ratio vllm / hf':34s}{ratio:8.2f}x")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per timing (median reported)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run in the step split")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU, 0 = torch's default. 1 by default: on cores shared with other "
                        "jobs, threads spin-waiting for a busy core make times vary tenfold")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--only", choices=["rollouts", "slots", "logprobs", "step", "forward", "checkpointing", "warmstart", "engines"],
                   default=None,
                   help="run one section")
    p.add_argument("--vs-trl", action="store_true",
                   help="only the GRPO step of train.py vs TRL's GRPOTrainer (needs trl installed for this Python)")
    p.add_argument("--vs-trl-init", choices=["base", "random"], default="base",
                   help="--vs-trl on the built-in base model, or on the same architecture randomly initialised (no build)")
    p.add_argument("--mem-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--gc-child", help=argparse.SUPPRESS)
    p.add_argument("--slots-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mem_child:
        variant, dtype_name, backward = args.mem_child
        return mem_child(variant, dtype_name, backward == "1")
    if args.trl_child:
        return trl_child(args.trl_child[0], int(args.trl_child[1]))
    if args.slots_child:
        torch.set_num_threads(1)
        SLOTS_SETUP.update(json.loads(args.slots_child[1]))
        return slots_child(args.slots_child[0])
    if args.gc_child:
        torch.set_num_threads(1)
        return gc_child(args.gc_child == "1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads and device == "cpu":
        torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"# bench.py: torch {torch.__version__}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else
             f", {os.cpu_count()} cores ({cpu}), {torch.get_num_threads()} torch threads")
          + f", load average {os.getloadavg()[0]:.1f}; medians of {args.repeats} interleaved repeats")
    t0 = time.perf_counter()
    if args.vs_trl:
        bench_vs_trl(max(args.steps, 4), args.repeats, args.vs_trl_init)
        return print(f"\n({time.perf_counter() - t0:.0f} s in all)")
    if args.only in (None, "rollouts"):
        bench_rollouts(device, args.repeats)
    if args.only in (None, "slots"):
        bench_slots(device, args.repeats)
    if args.only in (None, "logprobs"):
        bench_logprobs(device, args.repeats)
    if args.only in (None, "forward"):
        bench_forward(device, args.repeats)
    if args.only in (None, "step"):
        bench_step(device, args.steps)
    if args.only in (None, "checkpointing"):
        bench_checkpointing(device, args.repeats)
    if args.only in (None, "warmstart"):
        bench_warm_start(device, args.repeats)
    if args.only in (None, "engines"):
        bench_engines(device, args.repeats)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
