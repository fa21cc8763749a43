"""Speed of --compile (infra/static_decode.py) in "Step 1: Rollout 采样": the same rollout decoded
by sample_groups' eager loop, by the static-shape loop with its step eager and compiled, by HF
generate, and by vLLM (where it is installed, in a process of its own), beside the model's matmuls
alone at the slots' rows, at the rollouts section's config and at a long-tail one. A section of
`python -m bench`, which runs it.

    python -m bench --only compile                          # vLLM skipped where it cannot import
    .venv-vllm/bin/python -m bench --only compile   # with vLLM's line (the README's vLLM venv)

Each config prints, from one run: tokens/s and seconds per rollout of each way, the decode forward
per step of the static loop (eager and compiled) against the matmuls alone, the compile time and the
decode steps it takes to pay it back, and a profile of one compiled rollout (its top ops).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import ROOT, qwen_39m, sync, timed
from bench.rollouts import decode_matmuls, generate_tokens
from infra import static_decode
from sampler import sample_groups


def _configs() -> list[dict]:
    """The rollouts section's config (an id that rarely comes: nearly every row runs to T) and a
    long tail (long prompts of varied length, 1 in 32 ids ends a response: lengths ~ geometric,
    mean ~32, the longest several times that), each with its slots (--max-num-seqs)."""
    g = torch.Generator().manual_seed(0)
    return [dict(title="bench config: B=8 prompts of 32 tokens, G=8, T=64, 1 of 32,000 ids ends a "
                       "response, 64 slots", B=8, plens=[32] * 8, G=8, T=64, ends=[1], S=64),
            dict(title="long tail: B=16 prompts of 64-192 tokens, G=4, T=256, 1,000 of 32,000 ids "
                       "end a response, 16 slots", B=16,
                 plens=torch.randint(64, 193, (16,), generator=g).tolist(), G=4, T=256,
                 ends=list(range(1, 1001)), S=16)]


CONFIGS = _configs()
MODEL = qwen_39m  # the rollouts section's 38.9M Qwen2 (the tests put a small one here)


class StepClock:
    """Seconds and calls of static_decode's decode forwards (its run_step), the rest of the loop
    (prefill, sampling, bookkeeping) left out."""

    def __init__(self, device: str):
        self.device, self.seconds, self.calls = device, 0.0, 0

    @contextlib.contextmanager
    def on(self):
        run = static_decode.run_step

        def timed_run(*a, **kw):
            sync(self.device)
            t0 = time.perf_counter()
            out = run(*a, **kw)
            sync(self.device)
            self.seconds, self.calls = self.seconds + time.perf_counter() - t0, self.calls + 1
            return out
        static_decode.run_step = timed_run
        try:
            yield self
        finally:
            static_decode.run_step = run


@contextlib.contextmanager
def eager_step():
    """The static loop with its step left eager (no compile): what the static shapes cost alone."""
    compiled = static_decode.compiled_step
    static_decode.compiled_step = lambda device: static_decode.decode_step
    try:
        yield
    finally:
        static_decode.compiled_step = compiled


def _prompts(c: dict, V: int) -> list[list[int]]:
    """A config's prompts: random ids that never end a response, of its lengths."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(len(c["ends"]) + 1, V, (n,), generator=g).tolist() for n in c["plens"]]


def vllm_child(c: dict, device: str) -> None:
    """Run in a fresh process (vLLM binds the threads of the process it starts in): a vLLM engine
    (vllm_rollout.Engine, float32, the config's slots as its max_num_seqs) on MODEL's weights,
    warmed up on the config's rollout, then prints 'ready START_SECONDS TORCH_THREADS' and, for
    each line 'run' it reads, draws the rollout once and prints 'vllm TOKENS SECONDS'; so the
    parent interleaves its repeats with the others' (VllmChild)."""
    from infra import vllm_rollout
    model = MODEL().eval()
    prompts = _prompts(c, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        t0 = time.perf_counter()
        engine = vllm_rollout.Engine(folder, device, bf16=False, seed=0,
                                     gpu_memory_utilization=0.3, max_num_seqs=c["S"])
        start = time.perf_counter() - t0

    def run():
        return engine.sample_groups(model, prompts, c["G"], c["T"], c["ends"], 0,
                                    generator=[torch.Generator().manual_seed(i)
                                               for i in range(c["B"])])
    run()                                                                     # warm-up
    print(f"ready {start} {torch.get_num_threads()}", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        dt, roll = timed(run, device)
        print(f"vllm {int(roll.lengths.sum())} {dt}", flush=True)


class VllmChild:
    """vllm_child in a process of its own, asked for one rollout at a time (`run`), so that its
    repeats interleave with the rest of the bench's; `note` says why there is no figure where it
    did not start."""

    def __init__(self, c: dict, device: str):
        self.proc = None
        if importlib.util.find_spec("vllm") is None:
            self.note = "skipped: vllm is not installed here (it runs in the vLLM venv)"
            return
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")                        # GiB on CPU
        self.err = tempfile.TemporaryFile(mode="w+")                    # its logs, not a pipe
        call = f"from bench import compiled; compiled.vllm_child({c!r}, {device!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", call], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     cwd=ROOT, env=env)
        ready = self._line("ready ")
        if ready is None:
            return
        start, threads = ready
        self.note = (f"a process of its own, started in {float(start):.0f} s, max_num_seqs "
                     f"{c['S']}, {threads} torch threads, its repeats interleaved with the others'")

    def _line(self, prefix: str) -> list[str] | None:
        """The fields after `prefix` of the child's next line starting with it; None (and a note)
        where it exits first."""
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.split()[1:]
        self.err.seek(0)
        last = (self.err.read().strip().splitlines() or ["no output"])[-1]
        self.note = f"failed in its process (exit {self.proc.wait()}): {last}"
        self.proc = None
        return None

    def run(self) -> tuple[int, float] | None:
        """(tokens, seconds) of one vLLM rollout, or None where the child is not running."""
        if self.proc is None:
            return None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        got = self._line("vllm ")
        return None if got is None else (int(got[0]), float(got[1]))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


def bench_compile(device: str, repeats: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    model = MODEL().to(device).eval()
    V = model.config.vocab_size
    for c in CONFIGS:
        B, G, T, ends, S = c["B"], c["G"], c["T"], c["ends"], c["S"]
        prompts = _prompts(c, V)
        gens = lambda B=B: [torch.Generator().manual_seed(i) for i in range(B)]  # noqa: E731
        clock = StepClock(device)

        def ours(compile, prompts=prompts, G=G, T=T, ends=ends, S=S, gens=gens, packed=True):
            return sample_groups(model, prompts, G, T, ends, 0, generator=gens(), max_num_seqs=S,
                                 static=static_decode if compile else None, packed=packed)

        def static_eager():
            with eager_step():
                return ours(True)

        def hf(prompts=prompts, G=G, T=T, ends=ends):
            return generate_tokens(model, prompts, G, T, ends, device)

        ref, plain = ours(False), ours(False, packed=False)
        psame = (plain.response_ids == ref.response_ids).all(-1)              # [N]
        pdlp = float((plain.logprobs - ref.logprobs)[psame].abs().max())
        with clock.on():
            t0 = time.perf_counter()
            comp = ours(True)                                          # compiles at this shape
            first = time.perf_counter() - t0
        nsteps = clock.calls
        same = (comp.response_ids == ref.response_ids).all(-1)                # [N] rows identical
        dlp = float((comp.logprobs - ref.logprobs)[same].abs().max())
        fns = {"eager": lambda: ours(False), "plain": lambda: ours(False, packed=False),
               "static": static_eager, "compiled": lambda: ours(True), "generate": hf}
        times, tokens, fwd = {k: [] for k in fns}, {}, {"static": [], "compiled": []}
        mms, pmms = [], []                             # s per step of the matmuls, every slot busy
        vllm, vtimes = VllmChild(c, device), []                           # its own process
        for _ in range(repeats):
            mms.append(decode_matmuls(model, S, device, steps=5))
            pmms.append(decode_matmuls(model, S, device, steps=5, packed=True))
            got = vllm.run()
            if got is not None:
                tokens["vllm"] = got[0]
                vtimes.append(got[1])
            for name, fn in fns.items():                                      # interleaved
                clock.seconds, clock.calls = 0.0, 0
                with clock.on():
                    dt, out = timed(fn, device)
                times[name].append(dt)
                tokens[name] = out if isinstance(out, int) else int(out.lengths.sum())
                if name in fwd:
                    fwd[name].append(clock.seconds / max(clock.calls, 1))
        vllm.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        if vtimes:
            med["vllm"] = statistics.median(vtimes)
        vllm_note = vllm.note
        tps = {k: tokens[k] / med[k] for k in med}
        mm, pmm = statistics.median(mms), statistics.median(pmms)
        step = {k: statistics.median(v) for k, v in fwd.items()}
        lens, R = ref.lengths.float(), static_decode.STATIC_ROUND
        print(f"\n## --compile, {c['title']}, float32, {device}")
        print(f"{int(lens.sum())} tokens, lengths mean {lens.mean():.0f}, max {lens.max():.0f}; "
              f"C = {-(-(max(c['plens']) + T) // R) * R} columns; "
              f"{nsteps} decode steps per static rollout; compiled vs eager loop: "
              f"{int(same.sum())} of {len(same)} rows the same ids, max |log-prob difference| "
              f"on those {dlp:.1e}; packed (the default) vs plain weights: {int(psame.sum())} "
              f"of {len(psame)} rows the same ids, max |log-prob difference| {pdlp:.1e}")
        print(f"{'':44s}{'tokens/s':>9s}{'s / rollout':>12s}{'/ generate':>11s}"
              f"{'fwd ms/step':>12s}")
        labels = {"eager": "sample_groups, eager loop (the default)",
                  "plain": "eager loop, plain weights (no packing)",
                  "static": "static loop, step eager",
                  "compiled": "static loop, compiled (--compile)",
                  "generate": "model.generate(num_return_sequences=G)",
                  "vllm": "vLLM engine (--rollout vllm)"}
        for name in med:
            f = f"{step[name] * 1e3:12.1f}" if name in step else ""
            print(f"{labels[name]:44s}{tps[name]:9.0f}{med[name]:12.2f}"
                  f"{tps[name] / tps['generate']:10.2f}x{f}")
        print(f"{labels['vllm'] if 'vllm' not in med else '  (vLLM)':44s}{vllm_note}")
        print(f"{f'matmuls alone, {S}-row decode steps':44s}{S / mm:9.0f}{'':23s}{mm * 1e3:12.1f}"
              f"   (every slot busy)")
        print(f"{'  the same, weights packed (infra/packed.py)':44s}{S / pmm:9.0f}{'':23s}"
              f"{pmm * 1e3:12.1f}")
        print("eager loop (the default) / vLLM: "
              + (f"{tps['eager'] / tps['vllm']:.2f}x" if "vllm" in tps else "no vLLM line")
              + f"; of the matmuls alone: {tps['eager'] / (S / pmm):.2f} packed, "
              f"{tps['eager'] / (S / mm):.2f} plain; packing {tps['eager'] / tps['plain']:.2f}x "
              f"the plain eager loop")
        print(f"compiled decode forward / matmuls alone: {mm / step['compiled']:.2f} (eager step "
              f"{mm / step['static']:.2f}); compiled rollout / generate "
              f"{tps['compiled'] / tps['generate']:.2f}x, / eager loop "
              f"{tps['compiled'] / tps['eager']:.2f}x")
        compile_s = first - med["compiled"]
        gain = (med["eager"] - med["compiled"]) / max(nsteps, 1)          # s saved per decode step
        pays = (f"break-even after {compile_s / gain:.0f} decode steps "
                f"({compile_s / gain / max(nsteps, 1):.1f} rollouts), {gain * 1e3:.1f} ms saved "
                f"per step" if gain > 0 else
                "never: the compiled rollout is not faster than the eager loop")
        print(f"compile: {compile_s:.0f} s (the first compiled rollout minus a later one), once "
              f"per shape and run; {pays}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours(True)
        print("profile of one compiled rollout, top ops by self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
