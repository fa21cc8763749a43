"""Speed and memory of "Step 1: Rollout 采样" (generation is most of an RL step's time):
sample_groups vs HF generate, the rollout's memory and continuous batching at max_num_seqs, and the
two rollout engines (sample_groups vs vLLM). The rollout side of `python -m bench`, which runs these
sections.

    python -m bench --only rollouts   # sample_groups vs model.generate(num_return_sequences=G)
    python -m bench --only slots      # --max-num-seqs: 16 slots vs all rows, continuous vs static
    .venv-vllm/bin/python -m bench --only engines   # --rollout hf vs --rollout vllm
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from bench.common import RSS_READABLE, cuda_peak, in_fresh_process, qwen_39m, rss_peak, sync, timed
from infra.kv_cache import left_padded
from infra.packed import can_pack, packed_linears
from sampler import sample_groups


def matmul_flops(device: str, dtype=torch.float32, seconds: float = 1.0) -> float:
    """FLOP/s of a large matmul on this device: the hardware limit the rollout is compared with."""
    n = 4096 if device.startswith("cuda") else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    a @ b
    sync(device)
    k, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ b
        k += 1
        if device.startswith("cuda") and k % 50 == 0:
            sync(device)
    sync(device)
    return 2 * n ** 3 * k / (time.perf_counter() - t)


# ---------------------------------------------------------------------------------------------
# Rollouts: sample_groups vs model.generate(num_return_sequences=G)
# ---------------------------------------------------------------------------------------------

class ForwardClock:
    """Seconds spent inside model.forward (hooks on the top module): the part of a rollout that any
    sampler calling the model pays; the rest is the sampler's own (sampling, cache bookkeeping)."""

    def __init__(self, model, device: str):
        self.device, self.seconds, self._t0 = device, 0.0, 0.0
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def _start(self, module, args):
        sync(self.device)
        self._t0 = time.perf_counter()

    def _stop(self, module, args, out):
        sync(self.device)
        self.seconds += time.perf_counter() - self._t0


def decode_matmuls(model, rows: int, device: str, steps: int = 10, packed: bool = False) -> float:
    """Seconds of one decode step's matrix multiplies alone: `rows` tokens through every nn.Linear
    of the model (vocabulary projection included), each once, as a step reads them; packed: through
    the weights sample_groups packs on CPU (infra/packed.py: those of its MIN_WEIGHT)."""
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {m.in_features: torch.randn(rows, m.in_features, device=device, dtype=m.weight.dtype)
         for m in mods}
    times = []
    with torch.no_grad(), packed_linears(model, rows, enabled=packed):
        for _ in range(steps + 1):
            times.append(timed(lambda: [m(x[m.in_features]) for m in mods], device)[0])
    return statistics.median(times[1:])


def generate_tokens(model, prompts: list[list[int]], G: int, T: int, ends: list[int],
                    device: str) -> int:
    """model.generate(num_return_sequences=G) on the prompts, left-padded with id 0, sampling at
    temperature 1 (no top-k, no top-p): the tokens it drew, each response's up to and with its
    first id of `ends` (what sample_groups' lengths count)."""
    ids, am = left_padded(prompts, 0, device)                                # [B, P]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, do_sample=True, num_return_sequences=G,
                             max_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=ends, pad_token_id=0)
    resp = out[:, ids.shape[1]:]                                              # [N, <= T]
    e = torch.isin(resp, torch.tensor(ends, device=resp.device)).long()      # [N, <= T]
    return int(((e.cumsum(-1) - e) == 0).sum())          # no end id before it: up to and with one


def bench_rollouts(device: str, repeats: int, B=8, P=32, G=8, T=64) -> None:
    model = qwen_39m().to(device).eval()
    cfg = model.config
    clock = ForwardClock(model, device)
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(2, cfg.vocab_size, (B, P),
                            generator=torch.Generator().manual_seed(0)).tolist()

    def ours():
        roll = sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0,
                             generator=[torch.Generator().manual_seed(i) for i in range(B)])
        return int(roll.lengths.sum())

    def hf():
        return generate_tokens(model, prompts, G, T, [1], device)

    print(f"\n## Rollouts: B={B} prompts of {P} tokens, G={G}, {T} new tokens, temperature 1, "
          f"{device}")
    print(f"Qwen2, random init, {params / 1e6:.1f}M parameters (hidden 512, 8 layers, 8 heads / 2 "
          f"KV heads, MLP 1408, vocab 32000, tied embeddings)")
    print("'in forward': seconds inside model.forward, which any sampler that calls the model "
          "pays; 'ceiling': generate's time / sample_groups' forward time, the ratio if sampling "
          "cost nothing")
    print(f"{'':46s}{'tokens/s':>9s}{'s / rollout':>12s}{'in forward':>11s}{'of ideal':>9s}")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        ours(), hf()                                                      # warm-up
        times, fwd, tokens, flops = {"ours": [], "hf": []}, {"ours": [], "hf": []}, {}, []
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("hf", hf)):
                clock.seconds = 0.0
                dt, tokens[name] = timed(fn, device)
                times[name].append(dt)
                fwd[name].append(clock.seconds)
            flops.append(matmul_flops(device, dtype))
        step = decode_matmuls(model, B * G, device)
        packed = (decode_matmuls(model, B * G, device, packed=True)  # what sample_groups runs
                  if can_pack(model) else None)
        med = {k: statistics.median(v) for k, v in times.items()}
        fmed = {k: statistics.median(v) for k, v in fwd.items()}
        ideal = statistics.median(flops) / (2 * params)                  # tokens/s: matmuls at peak
        short = str(dtype).removeprefix("torch.")
        for name, label in (("ours", "sample_groups"),
                            ("hf", "model.generate(num_return_sequences=G)")):
            tps = tokens[name] / med[name]
            print(f"{short + ' ' + label:46s}{tps:9.0f}{med[name]:12.2f}{fmed[name]:11.2f}"
                  f"{tps / ideal:9.0%}")
        ratio = (tokens["ours"] / med["ours"]) / (tokens["hf"] / med["hf"])
        print(f"{short + ' ratio sample_groups / generate':46s}{ratio:8.2f}x   "
              f"(ceiling {med['hf'] / fmed['ours']:.2f}x)")
        print(f"{short + ' ideal: matmul FLOP/s / (2 x params)':46s}{ideal:9.0f}   "
              f"(a large {short} matmul runs at {statistics.median(flops) / 1e9:.0f} GFLOP/s here)")
        print(f"{short + f' matmuls alone, {B * G}-row decode steps':46s}{B * G / step:9.0f}   "
              f"({2 * params * B * G / step / 1e9:.0f} GFLOP/s: the model's matrix multiplies at "
              f"the decode shape)")
        if packed is not None:
            print(f"{short + ' the same, packed weights':46s}"
                  f"{B * G / packed:9.0f}   (infra/packed.py: what sample_groups multiplies by "
                  f"in {short})")


# ---------------------------------------------------------------------------------------------
# max_num_seqs: the rollout's peak memory at a few slots vs all rows, continuous vs static batches
# ---------------------------------------------------------------------------------------------

# 16 of 512 ids end a response: lengths ~ geometric, mean ~32
SLOTS_SETUP = dict(B=32, G=4, T=512, vocab=512, ends=16)


def _slots_rollout(device: str, max_num_seqs, continuous: bool = True):
    """The long-tailed rollout of SLOTS_SETUP on a random Qwen2 (hidden 256, 4 layers, 2 KV heads of
    64): the model, the prompts, and a function that samples them and returns the Rollout."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    c = SLOTS_SETUP
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=c["vocab"], hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=1,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(c["ends"] + 1, c["vocab"], (int(n),), generator=g).tolist()
               for n in torch.randint(16, 49, (c["B"],), generator=g)]     # 16 to 48 tokens
    return model, prompts, lambda n=max_num_seqs, cont=continuous: sample_groups(
        model, prompts, c["G"], c["T"], list(range(1, c["ends"] + 1)), 0,
        generator=[torch.Generator().manual_seed(i) for i in range(c["B"])], max_num_seqs=n,
        continuous=cont)


def slots_child(n, setup: dict) -> None:
    """Run in a fresh process: print the peak resident memory one rollout adds above the model, in
    bytes."""
    torch.set_num_threads(1)
    SLOTS_SETUP.update(setup)
    _, _, run = _slots_rollout("cpu", n)
    run(None) if n else run(8)                         # load the kernels first, at the other size
    print(rss_peak(run))


def bench_slots(device: str, repeats: int, small: int = 16) -> None:
    c = SLOTS_SETUP
    rows = c["B"] * c["G"]
    print(f"\n## max_num_seqs: B={c['B']} prompts of 16-48 tokens, G={c['G']}, T={c['T']}, "
          f"{c['ends']} of {c['vocab']} ids end a response (lengths ~ geometric), random Qwen2 "
          f"(hidden 256, 4 layers, 2 KV heads), {device}")
    model, prompts, run = _slots_rollout(device, None)
    # bytes per position: layers x KV heads x dim x 2 (K and V) x element size
    kv = 4 * 2 * 64 * 2 * next(model.parameters()).element_size()
    P = max(len(p) for p in prompts)
    print(f"KV cache: {kv} bytes per position x N x (P + T), P = {P}: N = {rows} (all rows) "
          f"{kv * rows * (P + c['T']) / 2**20:.0f} MB, "
          f"N = {small}: {kv * small * (P + c['T']) / 2**20:.0f} MB")
    if device.startswith("cuda"):
        peak = {}
        for n in (small, None):
            run(n)                                                        # warm-up
            peak[n] = cuda_peak(lambda n=n: run(n))
        how = "peak allocated above the model"
    elif RSS_READABLE:
        def child(n):
            return in_fresh_process(
                f"from bench import rollouts as b; b.slots_child({n}, {SLOTS_SETUP!r})")
        peak = {n: statistics.median(child(n) for _ in range(repeats)) for n in (small, None)}
        how = "peak RSS of a fresh process above the model"
    else:
        peak, how = None, "(not measured: on CPU the measurement reads Linux's /proc/self)"
    if peak:
        print(f"rollout memory, {how}: N = {small}: {peak[small] / 2**20:.0f} MB, "
              f"all {rows} rows: {peak[None] / 2**20:.0f} MB "
              f"(ratio {peak[None] / max(peak[small], 1):.1f}x)")
    else:
        print(how)
    ref = run(None)
    times, tokens = {True: [], False: []}, int(ref.lengths.sum())
    for _ in range(repeats):
        for cont in (True, False):                                        # interleaved
            dt, roll = timed(lambda cont=cont: run(small, cont), device)
            times[cont].append(dt)
            # the same rollout, whatever the schedule
            assert torch.equal(roll.response_ids, ref.response_ids)
    lens = ref.lengths.float()
    print(f"{tokens} tokens, lengths mean {lens.mean():.0f}, median {lens.median():.0f}, "
          f"max {lens.max():.0f}; the same response ids at N = {small} (both modes) and N = all")
    med = {k: statistics.median(v) for k, v in times.items()}
    for cont, name in ((False, "static batches (admit N, wait for all, admit the next)"),
                       (True, "continuous batching")):
        print(f"  N = {small}, {name:52s} {tokens / med[cont]:7.0f} tokens/s {med[cont]:7.2f} s")
    print(f"  continuous / static tokens/s: {med[False] / med[True]:.2f}x")


# ---------------------------------------------------------------------------------------------
# The two rollout engines (--rollout hf, --rollout vllm) on the same model and rollout
# ---------------------------------------------------------------------------------------------

def bench_engines(device: str, repeats: int, B=8, P=32, G=8, T=64) -> None:
    """sample_groups vs a colocated vLLM engine (vllm_rollout.Engine, float32) drawing the same
    rollout shape from the same weights (the rollouts section's model, saved to a folder for vLLM to
    load) in this process."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return print(f"\n## Rollout engines: skipped, vllm cannot be imported ({e}); see the "
                     f"README's --rollout vllm")
    from harness import vllm_rollout
    model = qwen_39m().eval()
    prompts = torch.randint(2, 32000, (B, P), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")         # GiB on CPU; B * G * (P + T)
        t0 = time.perf_counter()
        engine = vllm_rollout.Engine(folder, device, bf16=False, seed=0, gpu_memory_utilization=0.3)
        start = time.perf_counter() - t0
    model.to(device)

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(B)]

    fns = {"hf": lambda: sample_groups(model, prompts, G, T, 1, 0, generator=gens()),
           "vllm": lambda: engine.sample_groups(model, prompts, G, T, 1, 0, generator=gens())}
    times, tokens = {k: [] for k in fns}, {}
    for fn in fns.values():                                               # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            dt, roll = timed(fn, device)
            times[name].append(dt)
            tokens[name] = int(roll.lengths.sum())
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## Rollout engines: B={B} prompts of {P} tokens, G={G}, {T} new tokens, "
          f"temperature 1, float32, {device}")
    print(f"section 1's Qwen2 ({params / 1e6:.1f}M parameters); vLLM {vllm.__version__}, in this "
          f"process, started in {start:.0f} s; {torch.get_num_threads()} torch threads after its "
          f"start")
    print(f"{'':34s}{'tokens/s':>9s}{'s / rollout':>12s}")
    for name, label in (("hf", "--rollout hf (sample_groups)"),
                        ("vllm", "--rollout vllm (vLLM engine)")):
        med = statistics.median(times[name])
        print(f"{label:34s}{tokens[name] / med:9.0f}{med:12.2f}")
    ratio = ((tokens["vllm"] / statistics.median(times["vllm"]))
             / (tokens["hf"] / statistics.median(times["hf"])))
    print(f"{'ratio vllm / hf':34s}{ratio:8.2f}x")
