"""Speed and memory of the log-prob passes and the update of "Step 4: PPO Loss 计算"
(vocabulary-sized logits dominate memory): token_logprobs vs the naive form, the training forward
with each group's prompt once vs once per response, one training step split into its phases, and
gradient checkpointing. The training side of `python -m bench`, which runs these sections.

    python -m bench --only logprobs        # token_logprobs vs log_softmax(logits).gather(...)
    python -m bench --only forward         # the training forward: shared prefix vs per response
    python -m bench --only step            # one step of the built-in default, split into its phases
    python -m bench --only checkpointing   # one update on 512-token responses, with and without it
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile

import torch

import grpo
import logprobs
from bench.common import RSS_READABLE, cuda_peak, in_fresh_process, qwen_39m, rss_peak, timed
from sampler import Rollout, sample_groups

V_QWEN = 151_936  # Qwen2's vocabulary
LOGIT_SHAPE = (8, 64)  # 512 rows of logits for the log-prob comparison


# ---------------------------------------------------------------------------------------------
# token_logprobs vs log_softmax(logits).gather(...) at Qwen's vocabulary
# ---------------------------------------------------------------------------------------------

def _naive(logits, ids):
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


def _kernel(name):
    """The log-prob kernel by name: "naive" (log_softmax then gather), else token_logprobs."""
    return _naive if name == "naive" else logprobs.token_logprobs


def _inputs(dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(*LOGIT_SHAPE, V_QWEN, generator=g, device=device)
    logits = logits.to(dtype).requires_grad_(grad)                        # [8, 64, V]
    return logits, torch.randint(0, V_QWEN, LOGIT_SHAPE, generator=g, device=device)


def mem_child(kernel: str, dtype_name: str, backward: bool) -> None:
    """Run in a fresh process: print the peak resident memory the call adds above the inputs, in
    bytes."""
    fn, dtype = _kernel(kernel), getattr(torch, dtype_name)
    small = torch.randn(2, 3, 50, dtype=dtype, requires_grad=backward)   # load the kernels first
    out = fn(small, torch.zeros(2, 3, dtype=torch.long))
    if backward:
        out.sum().backward()
    print(rss_peak(_call(fn, *_inputs(dtype, "cpu", backward), backward)))


def _call(fn, logits, ids, backward: bool):
    """The measured call: the token log-probs of `ids` under `logits`, and their backward if
    asked."""
    def run():
        out = fn(logits, ids)
        if backward:
            out.float().sum().backward()
    return run


def peak_extra(kernel: str, dtype_name: str, backward: bool, device: str) -> int:
    """Bytes of peak memory the call adds above its inputs: CUDA's peak allocated, or on CPU the
    peak resident set of a fresh process (Linux's VmHWM, reset just before the call)."""
    if device.startswith("cuda"):
        inputs = _inputs(getattr(torch, dtype_name), device, backward)
        return cuda_peak(_call(_kernel(kernel), *inputs, backward))
    return in_fresh_process(f"from bench import training as b; "
                            f"b.mem_child({kernel!r}, {dtype_name!r}, {backward})")


def bench_logprobs(device: str, repeats: int) -> None:
    rows = LOGIT_SHAPE[0] * LOGIT_SHAPE[1]
    print(f"\n## token_logprobs vs log_softmax(logits).gather(...): {rows} rows x V = {V_QWEN:,}, "
          f"{device}")
    logits, ids = _inputs(torch.float32, device, True)
    with torch.no_grad():
        err = (logprobs.token_logprobs(logits, ids) - _naive(logits, ids)).abs().max().item()
    print(f"float32 logits {logits.numel() * 4 / 2**20:.0f} MB; max |difference| of the values "
          f"{err:.1e}")
    print(f"{'extra peak memory above the inputs':36s}{'naive':>10s}{'token_logprobs':>16s}"
          f"{'ratio':>8s}")
    cases = (("float32", False), ("bfloat16", False), ("float32", True))
    if device == "cpu" and not RSS_READABLE:
        print("  (not measured: on CPU the measurement reads Linux's /proc/self)")
        cases = ()
    for dtype_name, backward in cases:
        a, b = (peak_extra(k, dtype_name, backward, device) for k in ("naive", "ours"))
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
                dt = timed(lambda run=run, name=name: run(_kernel(name)), device)[0]
                times.setdefault((kind, name), []).append(dt)
    print(f"{'time, float32':36s}{'naive':>10s}{'token_logprobs':>16s}")
    for kind in ("forward", "forward + backward"):
        a, b = (statistics.median(times[(kind, n)]) for n in ("naive", "ours"))
        print(f"  {kind:34s}{a:8.3f} s{b:14.3f} s")


# ---------------------------------------------------------------------------------------------
# One training step of the built-in default, split into its phases
# ---------------------------------------------------------------------------------------------

def bench_step(device: str, steps: int) -> None:
    import train
    keys = ("time/sample_s", "time/reward_s", "time/logprob_s", "time/update_s", "time/step_s")
    print(f"\n## One training step of the built-in default (median of {steps} steps), seconds")
    print(f"{'':44s}{'sample':>8s}{'reward':>8s}{'old+ref':>8s}{'update':>8s}{'step':>8s}")
    runs = ((["--algo", "dapo"], "(mu 1, beta 0: no extra pass)"),
            (["--algo", "grpo"], "(beta 0.04: reference pass)"),
            (["--algo", "dapo", "--mu", "2"], "(old-policy pass)"))
    for flags, note in runs:
        with tempfile.TemporaryDirectory() as out:
            argv = [*flags, "--steps", str(steps), "--eval-size", "8", "--out", out,
                    "--device", device]
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                train.main(argv)
            with open(os.path.join(out, "metrics.jsonl")) as fh:
                rows = [r for r in map(json.loads, fh) if "time/step_s" in r]
        med = [statistics.median(r.get(k, 0.0) for r in rows) for k in keys]
        print(f"  {' '.join(flags) + ' ' + note:42s}" + "".join(f"{x:8.2f}" for x in med))


# ---------------------------------------------------------------------------------------------
# The training forward: each group's prompt once (logprobs.rollout_logprobs) vs once per response
# ---------------------------------------------------------------------------------------------

def forward_positions(roll, slices) -> dict:
    """Token positions of a pass over `slices`, computed and real (not padding), for both forms.
    Per response: every row is its prompt left-padded to the slice's longest + the rollout's width;
    shared: each group's prompt but its last token once, left-padded to the slice's longest, then
    every row as [last prompt token, response] right-padded to the longest of its length bucket
    (logprobs.length_buckets)."""
    n = {"per-response": [0, 0], "shared": [0, 0]}                        # [computed, real]
    for s in slices:
        rows = range(s.start, s.stop)
        plen = {i // roll.G: len(roll.prompts[i // roll.G]) for i in rows}  # group -> prompt length
        lengths = roll.lengths[s].tolist()
        n["per-response"][0] += len(rows) * (max(plen.values()) + roll.response_ids.shape[1])
        n["per-response"][1] += sum(plen[i // roll.G] for i in rows) + sum(lengths)
        n["shared"][0] += len(plen) * (max(plen.values()) - 1) + sum(
            len(r) * max(lengths[i] for i in r.tolist())
            for r in logprobs.length_buckets(roll.lengths[s]))
        n["shared"][1] += sum(p - 1 for p in plen.values()) + sum(lengths)
    return n


def _passes(fn, model, roll, mb: int, temperature: float, device: str) -> dict:
    """Seconds of a no-grad log-prob pass and of an update (forward, GRPO loss, backward) over
    micro-batches."""
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
            weights = grpo.token_weights(mask, num_seqs=N)
            grpo.policy_loss(logp, logp.detach(), adv[s], mask, weights)[0].backward()

    return {"log-prob pass": timed(logprob_pass, device)[0], "update": timed(update, device)[0]}


def bench_forward(device: str, repeats: int) -> None:
    from harness import builtin, data, models
    print("\n## The training forward: each group's prompt once (shared prefix) vs once per "
          "response, seconds")
    cases = []
    # the built-in task: the base model's own rollouts of the default step (32 prompts x 8, 40 new)
    _, tok, model = models.load_model("builtin")
    encode = data.PromptFormatter(tok, "{prompt}", None, True)
    prompts = [encode(r["prompt"]) for r in builtin.sample_problems(32, 0, False, distinct=False)]
    roll = sample_groups(model.to(device), prompts, 8, 40, models.end_ids(tok, model),
                         tok.pad_token_id,
                         generator=[torch.Generator().manual_seed(i) for i in range(32)])
    cases.append(("built-in task, 32 prompts x G=8, micro-batch 64", model, roll, 64))
    # a 38.9M-parameter Qwen2 (the rollout section's), one 256-token prompt, G random 64-token
    # responses
    qwen = qwen_39m().to(device)
    cfg = qwen.config
    for G in (8, 16):
        g = torch.Generator().manual_seed(G)
        resp = torch.randint(2, cfg.vocab_size, (G, 64), generator=g)
        prompt = torch.randint(2, cfg.vocab_size, (1, 256), generator=g).tolist()
        roll = Rollout(prompts=prompt, G=G, pad_token_id=0, response_ids=resp,
                       mask=torch.ones(G, 64), lengths=torch.full((G,), 64),
                       truncated=torch.ones(G, dtype=torch.bool), logprobs=torch.zeros(G, 64))
        cases.append((f"Qwen2 38.9M, 256-token prompt, G={G} x 64 tokens, micro-batch {G}", qwen,
                      roll, G))
    forms = (("shared", logprobs.rollout_logprobs),
             ("per-response", logprobs.per_response_logprobs))
    for label, model, roll, mb in cases:
        N = roll.response_ids.shape[0]
        pos = forward_positions(roll, [slice(k, min(k + mb, N)) for k in range(0, N, mb)])
        print(f"{label}\n  token positions a pass computes: " + ", ".join(
            f"{k} {c} ({1 - r / c:.0%} of them padding)" for k, (c, r) in pos.items())
            + f"; shared / per-response {pos['shared'][0] / pos['per-response'][0]:.2f}")
        _passes(logprobs.rollout_logprobs, model, roll, mb, 1.0, device)          # warm-up
        times = {}
        for _ in range(repeats):
            for name, fn in forms:
                for k, v in _passes(fn, model, roll, mb, 1.0, device).items():
                    times.setdefault((k, name), []).append(v)
        for kind in ("log-prob pass", "update"):
            a, b = (statistics.median(times[(kind, n)]) for n, _ in forms)
            print(f"  {kind:16s} shared {a:7.3f}   per-response {b:7.3f}   ratio {b / a:5.2f}x")


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing (--gradient-checkpointing): one update on long responses
# ---------------------------------------------------------------------------------------------

GC_SHAPE = dict(rows=4, prompt=32, response=512)  # 4 responses of 512 tokens after 32-token prompts


def _gc_setup(device: str, checkpointing: bool, response: int = GC_SHAPE["response"]):
    """A small random Qwen2 in train mode and a rollout of long responses (every token valid)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from infra import parallel
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device).train()
    if checkpointing:
        parallel.checkpoint_activations(model)
    g = torch.Generator().manual_seed(0)
    n, P = GC_SHAPE["rows"], GC_SHAPE["prompt"]
    roll = Rollout(prompts=torch.randint(2, cfg.vocab_size, (1, P), generator=g).tolist() * n, G=1,
                   pad_token_id=0,
                   response_ids=torch.randint(2, cfg.vocab_size, (n, response), generator=g),
                   mask=torch.ones(n, response), lengths=torch.full((n,), response),
                   truncated=torch.ones(n, dtype=torch.bool), logprobs=torch.zeros(n, response))
    return model, roll


def _gc_update(model, roll) -> None:
    """One micro-batch of update.update_policy: log-probs of the responses, the clipped surrogate,
    backward."""
    rows = slice(0, roll.response_ids.shape[0])
    logp, _, valid = logprobs.rollout_logprobs(model, roll, rows, 1.0)                 # [n, T]
    advantages = torch.linspace(-1, 1, logp.shape[0], device=logp.device)            # [n]
    weights = grpo.token_weights(valid, "token")
    loss, _ = grpo.policy_loss(logp, logp.detach(), advantages, valid, weights)
    loss.backward()


def gc_child(checkpointing: bool) -> None:
    """Run in a fresh process: print the peak resident memory of one update above what was there
    before it (weights, gradients from a short warm-up update, the rollout), in bytes."""
    torch.set_num_threads(1)
    model, roll = _gc_setup("cpu", checkpointing)
    _gc_update(model, _gc_setup("cpu", False, response=8)[1])   # load the kernels, allocate .grad
    print(rss_peak(lambda: _gc_update(model, roll)))


def gc_peak(checkpointing: bool, device: str) -> int:
    """Bytes of peak memory one update adds: CUDA's peak allocated, or on CPU a fresh process's peak
    RSS."""
    if device.startswith("cuda"):
        model, roll = _gc_setup(device, checkpointing)
        _gc_update(model, _gc_setup(device, False, response=8)[1])
        return cuda_peak(lambda: _gc_update(model, roll))
    return in_fresh_process(f"from bench import training as b; b.gc_child({checkpointing})")


def bench_checkpointing(device: str, repeats: int) -> None:
    n, P, T = GC_SHAPE["rows"], GC_SHAPE["prompt"], GC_SHAPE["response"]
    models = {flag: _gc_setup(device, flag) for flag in (False, True)}
    params = sum(p.numel() for p in models[False][0].parameters())
    print(f"\n## One update on long responses, without and with gradient checkpointing: {n} "
          f"responses of {T} tokens (prompts {P}), Qwen2 {params / 1e6:.1f}M parameters "
          f"(hidden 256, 8 layers, vocab 8000), {device}")
    if device == "cpu" and not RSS_READABLE:
        print("  (memory not measured: on CPU the measurement reads Linux's /proc/self)")
        peak = None
    else:
        peak = {flag: gc_peak(flag, device) for flag in (False, True)}
    times = {False: [], True: []}
    for _ in range(repeats):
        for flag in (False, True):
            model, roll = models[flag]
            times[flag].append(timed(lambda model=model, roll=roll: _gc_update(model, roll),
                                     device)[0])
            model.zero_grad(set_to_none=True)
    for model, roll in models.values():                       # one more update each: same grads?
        _gc_update(model, roll)
    diff = max((p.grad - q.grad).abs().max().item()
               for p, q in zip(models[False][0].parameters(), models[True][0].parameters()))
    how = ("CUDA peak allocated" if device.startswith("cuda")
           else "peak RSS of a fresh process (Linux VmHWM)")
    print(f"{'':34s}{'without':>10s}{'with':>10s}{'ratio':>8s}")
    if peak:
        print(f"  {'extra peak memory of the update':32s}{peak[False] / 2**20:7.0f} MB"
              f"{peak[True] / 2**20:7.0f} MB{peak[True] / peak[False]:8.2f}")
    a, b = (statistics.median(times[f]) for f in (False, True))
    print(f"  {'time of the update':32s}{a:8.2f} s{b:8.2f} s{b / a:8.2f}")
    print(f"  memory: {how}, above the weights, gradients and inputs; max |gradient difference| "
          f"{diff:.1e}")
