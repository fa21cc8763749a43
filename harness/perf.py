"""Throughput accounting: a step's model FLOPs by phase, the accelerator's peak, MFU and tokens/s.

Beside the article (it has no section on it): how fast the loop of "GRPO 训练过程拆解" runs, as
nanoGPT, nanochat and verl print it. MFU (model FLOPs utilisation, PaLM's appendix B) is the FLOPs
the model's matmuls need for the tokens a phase ran, over its seconds times the peak FLOP/s.

What is counted, per token run (`forward_flops`, `train_flops`):
- the weight matmuls, 2 FLOPs a multiply-accumulate: every nn.Linear of the model but the LM head,
  in x out each, counted from the model's modules (not its config: GQA's narrower k/v projections
  and LoRA's adapters are there as they are); the embedding lookup is no matmul, and biases,
  norms, activations and softmaxes (elementwise) are not counted;
- the LM head (the output embedding, tied or not: a real d_model x V matmul) at each position
  whose logits are used: one per sampled token (a group's first token is drawn G times from one
  prefill logit), one per response token in the training forward;
- attention, QK^T and AV: 2 c d_attn FLOPs each per layer for a token that attends c positions
  (itself included, pads not), d_attn = query heads x head_dim: 4 n_layer c d_attn. For a causal
  sequence of T tokens this sums to 2 n_layer d_attn T (T + 1), 2 n_layer (T + 1) d_attn a token
  on average (Kaplan's 2 n_layer n_ctx d_attn); PaLM, nanoGPT and nanochat count 4 n_layer T
  d_attn for every token (their 12 L H Q T with the backward), about twice this: the positions
  the causal mask hides included. Full attention is assumed (a sliding window's layers are
  overcounted past it).
- the backward: 2x the forward for each matmul whose weight trains (activation and weight
  gradients), 1x for a frozen one (LoRA's base weights, a frozen LM head: the activation gradient
  only), 2x for attention; full fine-tuning is the usual 3x forward (6N per token).
Tokens are the ones each phase runs, padding not: Step 1 (sampler.sample_groups) prefills each
prompt once for its G rows and feeds each response's tokens but the last (`rollout_work`); the
training forward (logprobs.rollout_logprobs) runs each group's prompt once per micro-batch that
meets it and each response after it, or with FSDP2 / gradient checkpointing each response with its
own prompt (`forward_work`). Not counted: gradient checkpointing's recompute (model FLOPs, not
hardware FLOPs), the log-prob and entropy kernels, the optimizer, DDP's zero-weight passes. A vLLM
engine's rollout is counted as sampler.py's. A mixture of experts is not counted (no MFU).

The peak (`peak_flops`): --peak-tflops; on CUDA the bf16 dense peak of the GPU by name
(PEAK_TFLOPS, whatever --bf16 is, as nanoGPT); on CPU a matmul probe at start (`probe_flops`);
else none, said once, and no MFU. Over ranks MFU is global: all ranks' FLOPs over rank 0's seconds
times world x peak; tokens/s likewise all ranks' tokens.
"""
from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import update
from sampler import Rollout

# bf16 dense tensor peak, TFLOP/s, by the words of the device name (vendors' data sheets)
PEAK_TFLOPS = {
    ("H100",): 989.4, ("H100", "PCIe"): 756.5, ("H100", "NVL"): 835.5, ("H800",): 989.4,
    ("H200",): 989.4, ("H200", "NVL"): 835.5, ("GH200",): 989.4,
    ("A100",): 312.0, ("A800",): 312.0, ("A10",): 125.0,
    ("L4",): 121.0, ("L40",): 181.0, ("L40S",): 362.0,
    ("MI250X",): 383.0, ("MI300X",): 1307.4,
}
PROBE_N, PROBE_REPS = 1024, 3  # the CPU probe: median of 3 timed [1024, 1024] matmuls


@dataclass(frozen=True)
class Shape:
    """Multiply-accumulates per token of a model's matmuls, and its attention's size."""
    body: int           # every nn.Linear but the LM head: sum of in x out
    trained: int        # of body, those whose weight trains (full fine-tuning: all; LoRA: adapters)
    adapters: int       # of body, LoRA's adapters (off in the reference pass)
    head: int           # the LM head, d_model x V
    head_trained: bool  # the LM head's weight trains (tied: the embedding's)
    layers: int
    d_attn: int         # query heads x head_dim


@dataclass
class Work:
    """What a forward runs: tokens through the layers, the positions they attend, logits used."""
    tokens: float = 0.0
    context: float = 0.0  # sum over the tokens of the positions each attends (itself included)
    logits: float = 0.0

    def __add__(self, o: Work) -> Work:
        return Work(self.tokens + o.tokens, self.context + o.context, self.logits + o.logits)


def model_shape(model) -> Shape | None:
    """The model's Shape, from its nn.Linear modules and its config's layers and attention heads;
    None for a mixture of experts (its Linear modules are not all run for a token)."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "num_local_experts", None):
        return None
    out = model.get_output_embeddings()
    body = trained = adapters = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not out:
            macs = m.in_features * m.out_features
            body += macs
            trained += macs * m.weight.requires_grad
            adapters += macs * (".lora_" in f".{name}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Shape(body, trained, adapters, out.in_features * out.out_features,
                 out.weight.requires_grad, cfg.num_hidden_layers,
                 cfg.num_attention_heads * head_dim)


def _span(n: torch.Tensor, c0: torch.Tensor | float) -> Work:
    """n [k] new tokens after c0 [k] positions already in the cache: the j-th attends c0 + j."""
    return Work(float(n.sum()), float((n * c0 + n * (n + 1) / 2).sum()))


def _prompt_lengths(roll: Rollout) -> torch.Tensor:
    return torch.tensor([len(p) for p in roll.prompts], dtype=torch.float64)  # [B]


def rollout_work(roll: Rollout) -> Work:
    """Step 1 as sampler.sample_groups runs it: each prompt prefilled once (its last logits drawing
    its G first tokens), then every response token but the last fed back, one logit each."""
    p, L = _prompt_lengths(roll), roll.lengths.cpu().double()                 # [B], [B*G]
    decoded = _span(L - 1, p.repeat_interleave(roll.G))
    return _span(p, 0.0) + decoded + Work(logits=p.numel() + float((L - 1).sum()))


def forward_work(roll: Rollout, micro: list[slice], shared_prefix: bool) -> Work:
    """The training forward (logprobs.rollout_logprobs) over the micro-batches `micro` of `roll`:
    shared_prefix, each group's prompt but its last token once per micro-batch that meets it, then
    each response from that token on; else each response with its own prompt. One logit per
    response token."""
    p, L, G = _prompt_lengths(roll), roll.lengths.cpu().double(), roll.G     # [B], [B*G]
    w = Work()
    for s in micro:
        rows = torch.arange(s.start, s.stop)                                  # [n]
        pr, Lr = p[rows // G], L[rows]                                        # [n] each
        if shared_prefix:
            w += _span(p[s.start // G:(s.stop - 1) // G + 1] - 1, 0.0) + _span(Lr, pr - 1)
        else:
            w += _span(pr + Lr - 1, 0.0)
        w += Work(logits=float(Lr.sum()))
    return w


def forward_flops(shape: Shape, w: Work, adapters: bool = True) -> float:
    """Forward FLOPs of `w`: 2 per multiply-accumulate of the body at each token (LoRA's adapters
    left out with adapters=False: the reference pass) and of the LM head at each logit, attention's
    4 n_layer c d_attn."""
    body = shape.body - (0 if adapters else shape.adapters)
    return (2 * body * w.tokens + 4 * shape.layers * shape.d_attn * w.context
            + 2 * shape.head * w.logits)


def train_flops(shape: Shape, w: Work) -> float:
    """Forward and backward FLOPs of `w`: a matmul 3x its forward if its weight trains, 2x if it is
    frozen (activation gradients only); attention 3x."""
    return ((4 * shape.body + 2 * shape.trained) * w.tokens
            + 12 * shape.layers * shape.d_attn * w.context
            + (4 + 2 * shape.head_trained) * shape.head * w.logits)


def peak_tflops_of(name: str) -> float | None:
    """PEAK_TFLOPS of the entry whose words are all in the device name, the most specific one
    ("NVIDIA H100 PCIe": 756.5); None if none is."""
    words = {w.upper() for w in re.findall(r"[A-Za-z0-9]+", name)}
    hits = [k for k in PEAK_TFLOPS if {w.upper() for w in k} <= words]
    return PEAK_TFLOPS[max(hits, key=len)] if hits else None


def probe_flops(dtype: torch.dtype, n: int = PROBE_N, reps: int = PROBE_REPS) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul at `dtype` on the CPU, the median of `reps` after one
    warm-up, on the threads the run has; its own generator leaves the run's RNG as it was."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.rand(n, n, generator=g).to(dtype) for _ in "ab")
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def peak_flops(device: str, dtype: torch.dtype, peak_tflops: float | None, name: str = "",
               warn=print) -> float | None:
    """The FLOP/s MFU divides by: --peak-tflops if given; CUDA: the GPU `name`'s bf16 dense peak
    (PEAK_TFLOPS); CPU: probe_flops at the run's dtype. None (warn(one line)) if not known."""
    if peak_tflops:
        return peak_tflops * 1e12
    kind = torch.device(device).type
    if kind == "cpu":
        return probe_flops(dtype)
    tflops = peak_tflops_of(name) if kind == "cuda" else None
    if tflops is None:
        warn(f"warning: no bf16 peak known for {kind} device {name!r}: perf/mfu is not logged "
             f"(give --peak-tflops)")
        return None
    return tflops * 1e12


@dataclass
class Meter:
    """A run's throughput accounting: the policy's Shape and the peak, made once (`start`)."""
    shape: Shape | None   # None: a mixture of experts, not counted
    peak: float | None    # FLOP/s of one device; None: no MFU
    world: int

    @staticmethod
    def start(model, args, ranks) -> Meter:
        """The Meter of the policy `model` (LoRA's adapters in, --peak-tflops, the run's device and
        dtype); rank 0 says why if there is no MFU."""
        say = (lambda m: print(m, file=sys.stderr)) if ranks.master else (lambda m: None)
        shape = model_shape(model)
        if shape is None:
            say("warning: a mixture-of-experts model: perf/mfu and perf/flops are not logged")
        device = torch.device(ranks.device)
        dtype = torch.bfloat16 if args.bf16 else next(model.parameters()).dtype
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        peak = peak_flops(ranks.device, dtype, args.peak_tflops, name, say) if shape else None
        return Meter(shape, peak, ranks.world)

    def flops(self, roll: Rollout, drawn: list[Rollout], stats: update.UpdateStats, args,
              ranks) -> dict[str, float]:
        """This rank's model FLOPs of the step, by phase, for ranks.sum_named: Step 1 over every
        rollout `drawn` (kept or not); the no-grad passes (the old policy's when there are several
        updates, the reference's with beta > 0) and --mu passes of the update over the trained
        `roll`'s micro-batches (stats.micro)."""
        if self.shape is None:
            return {}
        sh = self.shape
        several = stats.first["updates"] + stats.rest["updates"] > 1
        run = lambda grad: forward_work(  # noqa: E731 - the forward as update.py runs it
            roll, stats.micro, update.forward_options(args, ranks, grad)["shared_prefix"])
        nograd = run(False)
        return {"perf:rollout": sum(forward_flops(sh, rollout_work(r)) for r in drawn),
                "perf:logprob": (several * forward_flops(sh, nograd)
                                 + (args.beta > 0) * forward_flops(sh, nograd, adapters=False)),
                "perf:update": args.mu * train_flops(sh, run(True))}

    def metrics(self, d: dict[str, float], row: dict) -> dict[str, float]:
        """The row's perf/* keys from the step's sums `d` over all ranks (drawn_sums' response
        tokens, `flops`) and its time/* keys."""
        out = {"perf/tokens_per_s": d["length"] / row["time/step_s"]}
        if self.shape is None:
            return out
        phases = {"rollout": "time/sample_s", "logprob": "time/logprob_s",
                  "update": "time/update_s"}
        total = sum(d[f"perf:{p}"] for p in phases)
        out["perf/flops"] = total
        if self.peak is None:
            return out
        cap = self.peak * self.world                                 # FLOP/s of all ranks
        for p, t in phases.items():
            if d[f"perf:{p}"] > 0 and row[t] > 0:
                out[f"perf/mfu_{p}"] = d[f"perf:{p}"] / row[t] / cap
        out["perf/mfu"] = total / row["time/step_s"] / cap
        return out
