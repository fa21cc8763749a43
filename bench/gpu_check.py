"""One prepared GPU check: what a first GPU should run, stage by stage, each writing OUT/NAME.json.

Not an article section: the check that the loop of train.py, its sampler, its fused LM head, FSDP2
and the memory model (bench/memory.py) hold on CUDA, in <= 9 minutes on one H100, with nothing
downloaded (the built-in model and random Qwen2s at real widths). Every stage runs in its own
process under a time box (STAGES: seconds), so a hang or a crash costs one stage, and any stage
can be run again alone:

    python -m bench.gpu_check OUT                  # every stage; OUT/summary.json lists them
    python -m bench.gpu_check OUT --stage head     # one stage again (repeat --stage for more)
    python -m bench.gpu_check OUT --device cpu --stage env   # the CPU-runnable cores, toy sizes

Stages: env (versions, device, what the installed transformers does); train (train.py end to end:
--bf16, --gradient-checkpointing, then --lora-r if peft is there); fsdp (torchrun, 1 rank over
NCCL, --fsdp with a DCP checkpoint at step 2 and --resume to step 3, against an unbroken 3-step
run); head (the fused head against the plain one at V = 151,936, H = 1,536: values, gradients,
time, peak memory); sampler (the KV cache's dtype under --bf16, decode step time, the
sampler/trainer log-prob mismatch); memory (an update at Qwen2.5-1.5B's widths after a warm-up
update: allocated and reserved peaks against bench/memory.per_gpu); determinism (the same backward
twice, bitwise, and index_add_ with repeated indices). Each JSON: {"stage", "ok", "seconds",
"result"} or {"ok": false, "error"} or {"ok": false, "timed_out": true}. docs/distributed.md says
how to run it on a lent GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

from bench.common import ROOT

# stage -> its time box in seconds (each includes its process' start); the sum is 9 minutes
STAGES = {"env": 45, "train": 150, "fsdp": 120, "head": 60, "sampler": 60, "memory": 75,
          "determinism": 30}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for the stages' JSON files")
    p.add_argument("--stage", action="append", choices=list(STAGES),
                   help="run this stage only (repeatable; default: all)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the toy-size cores")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # inside the box
    return p.parse_args(argv)


def run_stage(out: str, name: str, box: float, cmd: list[str]) -> dict:
    """cmd (a child writing OUT/NAME.json) under a time box of `box` seconds: its JSON, or one
    saying it timed out or died without writing it."""
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        os.remove(path)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=box, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        rec = {"stage": name, "ok": False, "timed_out": True, "box_s": box}
    else:
        if os.path.exists(path):
            with open(path) as fh:
                rec = json.load(fh)
        else:
            rec = {"stage": name, "ok": False, "error": f"exit {proc.returncode}: "
                   f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ''}"}
    rec["wall_s"] = round(time.perf_counter() - t, 1)
    with open(path, "w") as fh:
        json.dump(rec, fh, indent=1)
    return rec


def main(argv=None) -> dict:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    names = args.stage or list(STAGES)
    if args.child:
        (name,) = names
        t = time.perf_counter()
        try:
            rec = {"stage": name, "ok": True, "result": STAGE_FN[name](args.out, args.device)}
        except Exception as e:                          # the stage's failure is its JSON's
            rec = {"stage": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-2000:]}
        rec["seconds"] = round(time.perf_counter() - t, 2)
        with open(os.path.join(args.out, f"{name}.json"), "w") as fh:
            json.dump(rec, fh, indent=1, default=str)
        return rec
    summary = {}
    for name in names:
        cmd = [sys.executable, "-m", "bench.gpu_check", args.out, "--stage", name, "--device",
               args.device, "--child"]
        rec = run_stage(args.out, name, STAGES[name], cmd)
        summary[name] = {k: rec.get(k) for k in ("ok", "timed_out", "wall_s", "error")}
        print(f"{name:12s} {'ok' if rec['ok'] else 'FAILED'} {rec['wall_s']:.0f}s "
              f"{rec.get('error') or ('timed out' if rec.get('timed_out') else '')}", flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary


# ---------------------------------------------------------------------------------------------
# the stages: each f(out, device) -> a JSON-able dict; the cores take sizes, for the CPU tests
# ---------------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str, run):
    """(run(), the peak allocated bytes above the start or None on CPU, seconds)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = run()
    _sync(device)
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else None
    return out, peak, seconds


def env(out: str, device: str) -> dict:
    import platform

    import transformers
    from transformers.integrations import sdpa_attention
    floor = next(line.split(">=")[1].split()[0] for line in
                 open(os.path.join(ROOT, "requirements.txt")) if line.startswith("transformers"))
    rec = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "requirements_floor": floor,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           # transformers >= 5.23 packs a decode step's GQA heads itself; kv_cache.gqa_decode
           # does it on every version
           "hf_packs_gqa_decode": hasattr(sdpa_attention, "pack_gqa")}
    for mod in ("peft", "vllm", "datasets"):
        try:
            rec[mod] = __import__(mod).__version__
        except ImportError:
            rec[mod] = None
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        rec.update(device=p.name, capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1),
                   bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return rec


def _train(out: str, device: str, name: str, *extra: str, torchrun: bool = False) -> dict:
    """train.py on the built-in task for a few steps: its last metrics row's finite check, the
    held-out accuracy before/after, and whether the saved weights moved."""
    run = os.path.join(out, name)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "1"] if torchrun else [sys.executable])
    cmd = [*launch, "train.py", "--device", device, "--out", run, "--prompts-per-step", "16",
           "--group-size", "8", "--eval-size", "64", "--eval-every", "100", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"train.py {' '.join(extra)}: exit {proc.returncode}: "
                           f"{proc.stderr.strip().splitlines()[-3:]}")
    from safetensors.torch import load_file
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if '"loss"' in x]
    last = rows[-1]
    start, end = (load_file(os.path.join(d, "model.safetensors"))
                  for d in (os.path.join(ROOT, "base_model"), os.path.join(run, "final")))
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "finite": all(math.isfinite(v) for r in rows for v in r.values()
                          if isinstance(v, float)),
            "weights_moved": max(float((end[k].float() - v.float()).abs().max())
                                 for k, v in start.items() if k in end),
            "time_step_s": last.get("time/step_s"), "mfu": last.get("perf/mfu"),
            "last": {k: v for k, v in last.items() if k.startswith(("time/", "memory/", "perf/"))}}


def train(out: str, device: str) -> dict:
    rec = {"bf16_ckpt": _train(out, device, "train_bf16", "--steps", "3", "--bf16",
                               "--gradient-checkpointing")}
    try:
        import peft  # noqa: F401
        rec["lora"] = _train(out, device, "train_lora", "--steps", "2", "--bf16", "--lora-r", "8",
                             "--gradient-checkpointing")
    except ImportError:
        rec["lora"] = "skipped: peft is not installed"
    return rec


def fsdp(out: str, device: str) -> dict:
    """1 rank over NCCL (gloo on CPU): 2 steps with a DCP checkpoint, --resume to 3, against an
    unbroken 3 steps; the losses of step 3 compared."""
    common = ("--fsdp", "--beta", "0.04", "--bf16")
    whole = _train(out, device, "fsdp_whole", "--steps", "3", *common, torchrun=True)
    _train(out, device, "fsdp_resumed", "--steps", "2", "--save-every", "2", *common,
           torchrun=True)
    resumed = _train(out, device, "fsdp_resumed", "--steps", "3", "--save-every", "2", "--resume",
                     *common, torchrun=True)
    return {"whole": whole, "resumed": resumed,
            "step3_loss_diff": abs(whole["loss"][-1] - resumed["loss"][-1])}


def head_compare(V: int, H: int, rows: int, device: str, seed: int = 0) -> dict:
    """The fused head (infra/lm_head.py) against the plain one (logits, log-softmax, gather,
    entropy) on `rows` random hidden states under bf16 autocast: the values' and gradients' largest
    differences, each one's seconds and peak memory (CUDA)."""
    from infra import lm_head
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(1, rows, H, generator=g).to(device)
    W = (torch.randn(V, H, generator=g) / H**0.5).to(device).requires_grad_(True)
    ids = torch.randint(0, V, (1, rows), generator=g).to(device)
    amp = lambda: torch.autocast(torch.device(device).type, torch.bfloat16)  # noqa: E731

    def fused():
        h = h0.clone().requires_grad_(True)
        with amp():
            out = lm_head._FusedHead.apply(h, W, None, ids, None, 1.0, True, False, False)
        grads = torch.autograd.grad(out[..., 0].sum(), (h, W))
        return out[..., 0].detach(), out[..., 1].detach(), grads

    def plain():
        h = h0.clone().requires_grad_(True)
        with amp():
            z = torch.nn.functional.linear(h, W)                               # [1, rows, V]
        logp = torch.log_softmax(z.float(), -1)
        lp = logp.gather(-1, ids[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        grads = torch.autograd.grad(lp.sum(), (h, W))
        return lp.detach(), ent.detach(), grads

    rec = {"V": V, "H": H, "rows": rows}
    res = {}
    for name, fn in (("fused", fused), ("plain", plain)):
        fn()                                                                 # warm-up
        res[name], rec[f"{name}_peak_bytes"], rec[f"{name}_s"] = _peak(device, fn)
    (a_lp, a_ent, (a_h, a_W)), (b_lp, b_ent, (b_h, b_W)) = res["fused"], res["plain"]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))  # noqa: E731
    rec.update(logp_max_diff=float((a_lp - b_lp).abs().max()),
               entropy_max_diff=float((a_ent - b_ent).abs().max()),
               grad_h_rel=rel(a_h, b_h), grad_W_rel=rel(a_W, b_W))
    return rec


def head(out: str, device: str) -> dict:
    return head_compare(151_936, 1_536, 4_096, device)


def sampler_check(model, prompts: list[list[int]], G: int, T: int, device: str) -> dict:
    """sample_groups under bf16 autocast on float32 weights: the KV buffers' dtype, the decode
    steps' mean seconds, and the trainer's log-probs of the rollout (logprobs.rollout_logprobs,
    same autocast) against the sampler's."""
    import sampler
    from logprobs import rollout_logprobs
    seen, steps, advance = {}, [], sampler.Slots.advance

    def recorded(self, tok, keep):
        _sync(device)
        t = time.perf_counter()
        advance(self, tok, keep)
        _sync(device)
        steps.append(time.perf_counter() - t)
        seen["kv"] = str(self.cache.layers[0].kbuf.dtype)
    sampler.Slots.advance = recorded
    try:
        with torch.autocast(torch.device(device).type, torch.bfloat16):
            roll = sampler.sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0,
                                         generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logp, _, valid = rollout_logprobs(model, roll, slice(0, roll.lengths.numel()),
                                                  1.0)
    finally:
        sampler.Slots.advance = advance
    d = (logp - roll.logprobs.to(logp.device)).abs()[valid.bool()]
    return {"kv_dtype": seen.get("kv"), "decode_steps": len(steps),
            "decode_step_s": sum(steps) / max(len(steps), 1),
            "tokens": int(roll.lengths.sum()), "mismatch_abs_mean": float(d.mean()),
            "mismatch_abs_max": float(d.max())}


def qwen(widths: str, layers: int, V: int, device: str):
    """A random Qwen2 at bench/memory.SHAPES[widths] with `layers` layers, built on `device`."""
    from bench import memory
    with torch.device(device):
        return memory.qwen_at(memory.SHAPES[widths], layers, V)


def sampler_stage(out: str, device: str) -> dict:
    model = qwen("Qwen2.5-1.5B", 4, 151_936, device)
    prompts = [[2 + (7 * j + i) % 1000 for i in range(64 + 8 * j)] for j in range(8)]
    return sampler_check(model, prompts, 4, 256, device)


def memory_check(widths: str, layers: int, n: int, T: int, device: str) -> dict:
    """Two updates of a random Qwen2 at `widths` (float32 weights, AdamW, bf16 autocast): a
    warm-up of 8 tokens (AdamW's state made), then n responses of T tokens; the second's peak
    allocated and reserved bytes against bench/memory.per_gpu's update peak for it."""
    import update
    from bench import memory
    from bench.common import update_args
    from infra import parallel
    model = qwen(widths, layers, memory.V_QWEN, device)
    shape = dict(memory.SHAPES[widths], layers=layers,
                 params=sum(p.numel() for p in model.parameters()))
    amp = lambda: torch.autocast(torch.device(device).type, torch.bfloat16)  # noqa: E731
    learner = update.Learner(model, model, None, torch.optim.AdamW(model.parameters()), amp)
    cuda = device.startswith("cuda")
    rec = {"widths": widths, "layers": layers, "params": shape["params"], "positions": n * (7 + T)}
    for i, roll in enumerate((memory.rollout_of(memory.V_QWEN, 4, 8),
                              memory.rollout_of(memory.V_QWEN, n, T))):
        roll.index = torch.arange(roll.num_groups).repeat_interleave(roll.G)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        update.update_policy(learner, roll, torch.randn(roll.lengths.numel()), roll.mask,
                             update_args(roll.response_ids.shape[1], micro_batch_size=n),
                             parallel.Dist(device))
        if cuda:
            rec[f"update{i}"] = {"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                                 "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    act = (memory.per_token_layer(shape, False), memory.per_token_layer(shape, True))
    want = memory.per_gpu(shape, act, 1, False, False, n * (7 + T), 7 + T, False, 0.0,
                          padded=False)                          # rollout_of's prompts: 7 tokens
    rec["predicted_update_gib"], rec["predicted_reserved_gib"] = want["update"], want["reserved"]
    return rec


def memory_stage(out: str, device: str) -> dict:
    return memory_check("Qwen2.5-1.5B", 28, 4, 2048, device)


def determinism_check(device: str, layers: int = 2, T: int = 256) -> dict:
    """The same forward and backward of a Qwen2 at Qwen2.5-0.5B's widths twice: are the gradients
    bitwise equal (and how far apart), and is index_add_ with repeated indices (the embedding's
    backward, the shared-prefix forward's scatter) bitwise repeatable."""
    model = qwen("Qwen2.5-0.5B", layers, 4096, device)
    ids = torch.randint(2, 4096, (4, T), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :T // 3] = 0                                                   # a left-padded row

    def grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, torch.bfloat16):
            model(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    a, b = grads(), grads()
    src = torch.randn(1 << 16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    idx = torch.randint(0, 32, (1 << 16,), generator=torch.Generator().manual_seed(2)).to(device)
    adds = [torch.zeros(32, 64, device=device).index_add_(0, idx, src) for _ in range(2)]
    return {"grads_bitwise_equal": all(torch.equal(x, y) for x, y in zip(a, b)),
            "grads_max_rel_diff": max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                                      for x, y in zip(a, b)),
            "index_add_bitwise_equal": torch.equal(*adds),
            "index_add_max_diff": float((adds[0] - adds[1]).abs().max())}


def determinism(out: str, device: str) -> dict:
    return determinism_check(device)


STAGE_FN = {"env": env, "train": train, "fsdp": fsdp, "head": head, "sampler": sampler_stage,
            "memory": memory_stage, "determinism": determinism}

if __name__ == "__main__":
    main()
