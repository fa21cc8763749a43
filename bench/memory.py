"""GPU memory before renting GPUs: what an update holds at the recipes' shapes, worked out from
figures measured here at the models' real widths ("Step 4: PPO Loss 计算" as it runs at scale).

Three parts, each from one run (`python -m bench --only memory`):
1. Measured: one update's peak resident memory on a tiny Qwen2 with Qwen's vocabulary of 151,936,
   8 responses of 16 and of 512 tokens, the LM head fused with the log-softmax (infra/lm_head.py)
   and the plain head (the [n, T, V] logits; what main held before), each in a fresh process.
2. Measured: activation bytes saved for backward per token per decoder layer at the real widths
   of Qwen2.5-0.5B / 1.5B / 7B (two layers, a small vocabulary: the figure does not depend on it),
   under bf16 autocast, without and with gradient checkpointing (saved tensors counted exactly by
   torch.autograd.graph.saved_tensors_hooks, not read off a noisy RSS); and what a left-padded
   row saves more, whose attention bias grows with T^2 (padded_bias_bytes).
3. The model: per GPU, the training state (float32 weights, gradients and AdamW moments; under
   --fsdp divided by the ranks, plus the root's gathered embeddings and head and two layers in
   flight), the activations of one micro-batch (--micro-batch-tokens positions x layers x part 2's
   figure), the head's chunks, and in the rollout phase the engine's share; for each GPU recipe of
   the README and docs/real-models.md.
4. The model checked: the measured peaks of a fresh process's two updates (its optimizer step,
   its backward) at Qwen2.5-0.5B's widths with 4 layers and Qwen's vocabulary on the CPU, against
   part 3's figures for that configuration. On a GPU, bench/gpu_check.py's memory stage compares
   an update at Qwen2.5-1.5B's widths (allocated and reserved) with it.
"""
from __future__ import annotations

import torch

from bench.common import RSS_READABLE, in_fresh_process, rss_now, rss_peak, update_args
from harness.vllm_rollout import MARGIN
from sampler import Rollout

V_QWEN = 151_936
GIB = 2**30
# Qwen2.5 shapes from their config.json: layers, hidden, intermediate, heads, KV heads, params,
# tied embeddings, max_position_embeddings
SHAPES = {
    "Qwen2.5-0.5B": dict(layers=24, hidden=896, inter=4864, heads=14, kv=2, params=0.49e9,
                         tied=True),
    "Qwen2.5-1.5B": dict(layers=28, hidden=1536, inter=8960, heads=12, kv=2, params=1.54e9,
                         tied=True),
    "Qwen2.5-7B": dict(layers=28, hidden=3584, inter=18944, heads=28, kv=4, params=7.62e9,
                       tied=False),
}
# the GPU recipes the docs hand a user: (where, model, GPUs, fsdp, checkpointing, --micro-batch-
# tokens, prompt + response positions of the longest row, beta > 0, the vLLM engine's fraction of
# 80 GB (None: --vllm-gpu-memory-utilization's default; 0: the built-in sampler),
# --micro-batch-size)
RECIPES = [
    ("README, 8 GPUs DDP", "Qwen2.5-0.5B", 8, False, False, 8192, 512 + 1024, True, 0.0, 64),
    ("README, --fsdp --gradient-checkpointing", "Qwen2.5-7B", 8, True, True, 8192, 512 + 1024,
     True, 0.0, 64),
    ("GRPO on one GPU at the defaults", "Qwen2.5-1.5B", 1, False, False, 8192, 512 + 1024, True,
     0.0, 64),
    ("real-models.md GSM8K, vLLM", "Qwen2.5-1.5B", 8, False, False, 8192, 256 + 1024, False, None,
     16),
    ("real-models.md DAPO-Math, vLLM", "Qwen2.5-7B", 8, True, True, 8192, 512 + 20480, False,
     None, 4),
]
PLAIN_HEAD = 1.95  # part 1: the plain head's extra peak, in float32 [n, T, V] tensors (measured)
# bytes per element of the attention bias SDPA saves per layer for left-padded rows: [n, 1, T, T]
# in bf16 (measured on CPU by padded_bias_bytes: 2.0); HF's bool mask adds 1 byte, once a forward
MASK_BYTES = 2
# DDP's gradient buckets, float32 bytes per param: with gradient_as_bucket_view=True
# (infra/parallel.py) they are the gradients during the update (counted there once) and stay
# allocated between updates, through the rollout (vllm_rollout.trainer_resident_bytes counts them)
DDP_BUCKET_BYTES = 4
# not measured here (no GPU): NCCL's buffers per process at world > 1 (NCCL_BUFFSIZE 4 MiB x
# channels x peers, plus the communicator), and the caching allocator's reserved over allocated;
# bench/gpu_check.py's memory stage measures the second
NCCL_GIB = 0.5
RESERVED = 1.10


def tiny_qwen(V: int, softcap: float | None = None):
    """A 2-layer Qwen2 of hidden 16 with a vocabulary of V (Qwen's: 151,936), untied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    model = Qwen2ForCausalLM(cfg)
    if softcap:
        model.config.final_logit_softcapping = softcap
    return model


def rollout_of(V: int, n: int, T: int, G: int = 4) -> Rollout:
    """n random responses of T tokens (the first T // 2) to n // G prompts of 7 tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, V, (n, T), generator=g)
    lengths = torch.full((n,), T)
    lengths[0] = T // 2
    prompts = [torch.randint(2, V, (7,), generator=g).tolist() for _ in range(n // G)]
    return Rollout.from_lengths(prompts, G, 0, ids, torch.zeros(n, T), lengths,
                                torch.zeros(n, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# 1. one update's peak, fused head vs plain
# ---------------------------------------------------------------------------------------------

def update_child(T: int, fused: bool) -> None:
    """In a fresh process: prints the peak RSS bytes of one update_policy (first epoch: the entropy
    measured too) on 8 responses of T tokens, after a warm-up update at 8 tokens."""
    import contextlib as cl

    import update
    from infra import lm_head, parallel
    torch.set_num_threads(1)
    if not fused:
        lm_head.fusable = lambda model: "bench: the plain head"
    model = tiny_qwen(V_QWEN)
    args = update_args(T)
    learner = update.Learner(model, model, None, torch.optim.AdamW(model.parameters()),
                             cl.nullcontext)

    def step(roll):
        roll.index = torch.arange(roll.num_groups).repeat_interleave(roll.G)
        update.update_policy(learner, roll, torch.randn(8), roll.mask, args,
                             parallel.Dist("cpu"))
    import warnings
    warnings.simplefilter("ignore")
    step(rollout_of(V_QWEN, 8, 8))                                   # AdamW state, kernels warm
    roll = rollout_of(V_QWEN, 8, T)
    print(rss_peak(lambda: step(roll)))


def _update_args(T: int, budget: int):
    return update_args(T, micro_batch_size=64, micro_batch_tokens=budget)


def measured_update() -> None:
    if not RSS_READABLE:
        print("  (not measured: the peak is read from Linux's /proc/self)")
        return
    one = 8 * 512 * V_QWEN * 4
    print(f"\n## 1. One update's peak above its start: tiny Qwen2 (hidden 16, 2 layers), V = "
          f"{V_QWEN:,}, 8 responses, one micro-batch; one float32 [8, 512, V] = "
          f"{one / GIB:.2f} GiB")
    print(f"{'head':28s}{'16 tokens':>12s}{'512 tokens':>12s}{'512 - 16':>12s}{'x [8,512,V]':>13s}")
    for fused in (False, True):
        peaks = [in_fresh_process(f"from bench import memory as b; b.update_child({T}, {fused})")
                 for T in (16, 512)]
        extra = peaks[1] - peaks[0]
        print(f"{'fused (infra/lm_head.py)' if fused else 'plain ([n, T, V] logits)':28s}"
              f"{peaks[0] / GIB:>10.2f} G{peaks[1] / GIB:>10.2f} G{extra / GIB:>10.2f} G"
              f"{extra / one:>12.2f}x")


# ---------------------------------------------------------------------------------------------
# 2. activations per token per layer at real widths
# ---------------------------------------------------------------------------------------------

def saved_bytes(shape: dict, layers: int, T: int, checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward of a Qwen2 of `shape`'s widths with
    `layers` layers and a 1,000-token vocabulary over T tokens, under bf16 autocast (storages
    counted once)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infra import parallel
    cfg = Qwen2Config(vocab_size=1000, hidden_size=shape["hidden"],
                      intermediate_size=shape["inter"], num_hidden_layers=layers,
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                      max_position_embeddings=4096, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    if checkpointing:
        parallel.checkpoint_activations(model)
    model.train()
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    ids = torch.randint(0, 1000, (1, T))
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", torch.bfloat16)):
        model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.sum()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(b for ptr, b in seen.items() if ptr not in params)


def _layer_saved(shape: dict, T: int, padded: bool) -> int:
    """Bytes one more decoder layer saves for backward (2 layers minus 1) over one row of T tokens
    under bf16 autocast, the row left-padded by one column or not."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    out = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=1000, hidden_size=shape["hidden"], intermediate_size=shape["inter"],
            num_hidden_layers=layers, num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], max_position_embeddings=max(4096, T),
            attn_implementation="sdpa")).train()
        mask = torch.ones(1, T, dtype=torch.long)
        mask[0, 0] = 0 if padded else 1
        seen = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", torch.bfloat16)):
            model(input_ids=torch.randint(0, 1000, (1, T)), attention_mask=mask, use_cache=False,
                  logits_to_keep=1).logits.sum()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out.append(sum(b for ptr, b in seen.items() if ptr not in params))
    return out[1] - out[0]


def padded_bias_bytes(shape: dict, T1: int = 256, T2: int = 1024) -> tuple[float, float]:
    """(bytes per token, bytes per [T, T] element) that one layer saves more for a left-padded row
    (one padding column) than for an unpadded one, at T1 and T2 tokens: SDPA with a mask saves
    the bias [n, 1, T, T], which a per-token figure measured at 32..96 tokens cannot see (at 21k
    tokens, 0.9 GB a layer). extra(T) = a T + b T^2, solved from the two lengths."""
    e1, e2 = (_layer_saved(shape, T, True) - _layer_saved(shape, T, False) for T in (T1, T2))
    b = (e2 / T2 - e1 / T1) / (T2 - T1)
    return e1 / T1 - b * T1, b


def per_token_layer(shape: dict, checkpointing: bool, T1: int = 32, T2: int = 96) -> float:
    """Bytes per token per decoder layer: what one more layer saves, at T2 tokens less at T1, over
    T2 - T1 (the differences cancel what does not grow with tokens: autocast's bf16 copies of the
    weights, which a layer also saves, and the embedding's)."""
    layer = [saved_bytes(shape, 2, T, checkpointing) - saved_bytes(shape, 1, T, checkpointing)
             for T in (T1, T2)]
    return (layer[1] - layer[0]) / (T2 - T1)


def measured_activations() -> dict:
    print("\n## 2. Activations saved for backward, per token per decoder layer, bf16 autocast "
          "(2 layers minus 1, 96 tokens minus 32)")
    print(f"{'model widths':16s}{'plain':>12s}{'checkpointed':>14s}")
    out = {}
    for name, shape in SHAPES.items():
        out[name] = (per_token_layer(shape, False), per_token_layer(shape, True))
        print(f"{name:16s}{out[name][0] / 1024:>9.0f} KiB{out[name][1] / 1024:>11.1f} KiB")
    return out


# ---------------------------------------------------------------------------------------------
# 3. the model
# ---------------------------------------------------------------------------------------------

def per_gpu(shape: dict, act: tuple[float, float], world: int, fsdp: bool, checkpointing: bool,
            tokens: int, row: int, beta: bool, engine: float, gpu_gb: float = 80.0,
            chunk_bytes: int | None = None, before: int = 0, adam_temp: float | None = None,
            padded: bool = True, kv_gb: float = 8.0) -> dict:
    """GiB per GPU by part, and the peaks of the update and the rollout phases. The update's peak
    is the larger of its backward (the state, one micro-batch's activations, the head's four
    float32 chunks (`chunk_bytes` one; default: lm_head.head_chunk_rows on a GPU x V x 4) and its
    backward's bf16 copy of W, and with tied embeddings the embedding's dense gradient beside the
    head's before autograd sums them) and its optimizer step (the float32 state and AdamW's
    temporaries: `adam_temp` bytes, by default the CUDA foreach kernel's one list of sqrt(v), 4 B
    per parameter of the shard). padded: the micro-batch's rows are left-padded (prompts of
    different lengths), so SDPA saves a MASK_BYTES [rows, 1, row, row] bias per layer (one layer
    under checkpointing) beside HF's 1-byte mask. Under DDP (world > 1, no FSDP) its gradient
    buckets (the gradients, with gradient_as_bucket_view) stay allocated through the rollout, and
    at world > 1 NCCL's buffers live through both phases. The rollout phase with the built-in
    sampler (engine 0) holds `kv_gb` of bf16 KV (--max-num-seqs rows) and, without FSDP,
    autocast's bf16 copies of the weights (2 B/param; FSDP gathers bf16 weights instead).
    `reserved`: the update's peak as the caching allocator reserves it (x RESERVED).
    before=m: as the update ran before the fused head and the token budget, m responses per
    micro-batch padded to the longest row (`row`, its response all but 512 prompt positions) with
    the plain head's PLAIN_HEAD float32 [m, T, V] logits."""
    from infra.lm_head import head_chunk_rows
    P, L, H = shape["params"], shape["layers"], shape["hidden"]
    head = V_QWEN * H * (1 if shape["tied"] else 2)           # embedding (+ untied head) params
    share = world if fsdp else 1
    if chunk_bytes is None:
        chunk_bytes = head_chunk_rows(V_QWEN, H, "cuda") * V_QWEN * 4
    buckets = DDP_BUCKET_BYTES * P if world > 1 and not fsdp else 0   # the gradients' own memory
    fixed = NCCL_GIB * GIB if world > 1 else 0                          # NCCL's buffers
    states = P * (4 + 4 + 8) / share + (P * 4 / share if beta else 0)  # weights, grads, AdamW, ref
    states += 0 if fsdp else P * 2                   # --bf16 autocast's bf16 copies of the weights
    gathered = (head * 4 * 2 + 2 * (P - head) / L * 4) if fsdp else 0  # root + grads, 2 layers
    positions = max(tokens, row)                     # a row longer than the budget runs alone
    plain, ckpt = act
    if before:
        positions = before * row
    acts = positions * (L * ckpt + plain) if checkpointing else positions * L * plain
    if padded:                       # the [rows, 1, row, row] bias per layer, and HF's bool mask
        rows = max(1, positions // max(row, 1))
        acts += rows * row * row * (MASK_BYTES * (1 if checkpointing else L) + 1)
    head_bytes = (PLAIN_HEAD * before * (row - 512) * V_QWEN * 4 if before
                  else 4 * chunk_bytes + 2 * V_QWEN * H)        # chunks, backward's bf16 W
    tied = V_QWEN * H * 4 if shape["tied"] else 0
    backward = states + gathered + acts + head_bytes + tied + fixed
    step = P * 16 / share + (P * 4 / share if beta else 0) + (
        P * 4 / share if adam_temp is None else adam_temp) + fixed
    update_peak = max(backward, step)
    resident = P * (4 + 8) / share + (P * 4 / share if beta else 0) + buckets  # vllm_rollout's
    if engine is None:                      # what --vllm-gpu-memory-utilization defaults to
        engine = 1 - resident / (gpu_gb * GIB) - MARGIN
    rollout_peak = resident + engine * gpu_gb * GIB + fixed
    if not engine:       # the built-in sampler: FSDP's bf16 gather or autocast's copies, its KV
        rollout_peak += P * 2 + kv_gb * GIB
    return dict(states=states / GIB, gathered=gathered / GIB, acts=acts / GIB, engine=engine,
                backward=backward / GIB, step=step / GIB, update=update_peak / GIB,
                reserved=update_peak * RESERVED / GIB, rollout=rollout_peak / GIB)


def recipe_table(acts: dict) -> None:
    print("\n## 3. Per GPU (80 GB) at each recipe's settings, GiB (the model above)")
    print("| recipe | model | state | FSDP gathers | activations | update peak | vLLM share "
          "| rollout peak | update peak before |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for where, name, world, fsdp, ckpt, tokens, row, beta, engine, size in RECIPES:
        shape, act = SHAPES[name], acts[name]
        m = per_gpu(shape, act, world, fsdp, ckpt, tokens, row, beta, engine)
        old = per_gpu(shape, act, world, fsdp, ckpt, tokens, row, beta, engine, before=size)
        share = f"{m['engine']:.2f}" if m["engine"] else "-"
        print(f"| {where} | {name} | {m['states']:.1f} | {m['gathered']:.1f} | {m['acts']:.1f} | "
              f"{m['update']:.1f} | {share} | "
              f"{m['rollout']:.1f} | {old['update']:.0f} |")


# ---------------------------------------------------------------------------------------------
# 4. the model against a measured peak
# ---------------------------------------------------------------------------------------------

CHECK = dict(widths="Qwen2.5-0.5B", layers=4, n=4, T=505)   # 4 x (7 + 505) = 2,048 positions


def qwen_at(shape: dict, layers: int, V: int):
    """A Qwen2 with `shape`'s real widths, `layers` layers and a vocabulary of V, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=layers, num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"], tie_word_embeddings=shape["tied"],
        max_position_embeddings=4096, attn_implementation="sdpa", pad_token_id=0,
        eos_token_id=1))


def check_child() -> None:
    """In a fresh process: CHECK's model with Qwen's vocabulary built, then two updates under bf16
    autocast (one of 8 tokens, whose optimizer step makes AdamW's state, then one of CHECK's 2,048
    positions in one micro-batch), kernels warmed first on a small model. Prints each update's peak
    RSS bytes above the process before the model was built (what the allocator kept counts)."""
    import update
    from infra import parallel
    amp = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    c = CHECK

    def updates(model, rolls, say):
        learner = update.Learner(model, model, None, torch.optim.AdamW(model.parameters()), amp)
        for roll in rolls:
            roll.index = torch.arange(roll.num_groups).repeat_interleave(roll.G)
            args = _update_args(roll.response_ids.shape[1], 4096)
            start = rss_now()
            say(start + rss_peak(lambda roll=roll, args=args: update.update_policy(
                learner, roll, torch.randn(roll.lengths.numel()), roll.mask, args,
                parallel.Dist("cpu"))))
    import warnings
    warnings.simplefilter("ignore")
    updates(qwen_at(SHAPES[c["widths"]], 1, 1000), [rollout_of(1000, 4, 64)], lambda b: None)
    rolls = [rollout_of(V_QWEN, c["n"], 8), rollout_of(V_QWEN, c["n"], c["T"])]
    base = rss_now()
    updates(qwen_at(SHAPES[c["widths"]], c["layers"], V_QWEN), rolls, lambda b: print(b - base))


def checked_model(acts: dict) -> None:
    """Part 3's model for CHECK's configuration (world 1, no FSDP, CPU head chunks, the CPU AdamW's
    per-parameter temporaries) against the measured peaks of its first update (the optimizer step
    that makes AdamW's state) and its second (the backward of 2,048 positions)."""
    from infra.lm_head import CHUNK_ELEMENTS
    if not RSS_READABLE:
        return
    c, shape = CHECK, dict(SHAPES[CHECK["widths"]])
    model = qwen_at(shape, c["layers"], V_QWEN)
    largest = max(p.numel() for p in model.parameters()) * 4
    shape.update(layers=c["layers"], params=sum(p.numel() for p in model.parameters()))
    del model
    positions = c["n"] * (7 + c["T"])
    m = per_gpu(shape, acts[c["widths"]], 1, False, False, positions, 7 + c["T"], False, 0.0,
                chunk_bytes=4 * CHUNK_ELEMENTS["cpu"], adam_temp=2 * largest, padded=False)
    first, second = (b / GIB for b in in_fresh_process(
        "from bench import memory as b; b.check_child()", count=2))
    print(f"\n## 4. The model against measured peaks: {c['widths']} widths, {c['layers']} layers, "
          f"V = {V_QWEN:,} ({shape['params'] / 1e6:.0f}M parameters), bf16 autocast on CPU, "
          f"peak RSS above the process before the model")
    print(f"{'phase':44s}{'predicted':>11s}{'measured':>11s}{'ratio':>8s}")
    for name, want, got in (("optimizer step (AdamW's state made)", m["step"], first),
                            (f"backward of {positions:,} positions", m["backward"], second)):
        print(f"{name:44s}{want:>9.2f} G{got:>9.2f} G{got / want:>8.3f}")


def measured_padded_bias() -> None:
    print("\n## 2b. What a left-padded row saves more per layer, a T + b T^2 (256 and 1,024 "
          "tokens, bf16 autocast)")
    for name in ("Qwen2.5-0.5B",):
        a, b = padded_bias_bytes(SHAPES[name])
        print(f"{name:16s} a = {a:.0f} B/token, b = {b:.2f} B per [T, T] element "
              f"(21k tokens: {b * 21_000**2 / GIB:.2f} GiB a layer; the model: MASK_BYTES = "
              f"{MASK_BYTES})")


def bench_memory(device: str, repeats: int) -> None:
    measured_update()
    acts = measured_activations()
    measured_padded_bias()
    recipe_table(acts)
    checked_model(acts)
