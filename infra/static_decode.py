"""--compile: sample_groups' decode loop in static shapes for torch.compile (CUDA graphs on CUDA).

Article section: "Step 1: Rollout 采样" (the G answers per prompt of sampler.sample_groups; this is
the same rollout, decoded another way).

The eager loop (sampler.sample_groups) decodes n <= S rows over the first L columns of its KV
buffer, both of which change at every step, and drops a finished row from the batch. Here every
shape is fixed for the whole rollout, as gpt-fast does:
- S slots (--max-num-seqs) decode at every step; a free slot recomputes its stale token and its
  output is dropped, so a finished row's slot still goes to the next group as in the eager loop;
- the KV buffer is S x C positions, C = P + T rounded up to STATIC_ROUND, written in place, slot i
  at its own column at[i]; attention reads the whole buffer under a [S, 1, 1, C] mask of the
  columns each slot has written (its prompt, left-padded at [0, P), then its tokens at P + t);
- positions are given per slot, counted from its prompt's first token.
So torch.compile traces HF's forward once per (S, C) (`fullgraph`, no graph breaks) and on CUDA
captures it as a graph (`mode="reduce-overhead"`, untested on hardware here). The rollout is the
eager loop's up to float rounding: the same uniforms per row, the same sampler.sample_token.

`can_compile` says whether it runs (else a one-line warning and the eager loop); `StaticSteps` is
the batch sample_groups' one loop drives in these shapes; `compiled_step` the compiled forward. On
CPU it pays little (1.05x the eager loop at the bench config, 1.17x with a long tail of lengths, a
compile of 18-32 s per shape: docs/speed.md, `python -m bench --only compile`), so --compile is off
by default.
"""
from __future__ import annotations

import shutil
import sys
import time
import warnings

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer

from infra import kv_cache

STATIC_ROUND = 64   # C = P + T rounded up to this: prompts of nearby lengths share one compile


class StaticLayer(DynamicLayer):
    """The KV of S slots in buffers of S x C positions, allocated once. A decode step writes one
    column per slot, slot i at column at[i] (`at` is one tensor shared by the layers, written in
    place between steps), and attention reads the whole buffer [S, H, C, D]: the shapes never
    change, the mask hides the columns a slot has not written."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, at: torch.Tensor):
        super().__init__()
        self.kbuf, self.vbuf, self.at = kbuf, vbuf, at                       # [S, H, C, D], [S]
        self.is_initialized, self.dtype, self.device = True, kbuf.dtype, kbuf.device

    def get_seq_length(self) -> int:
        return 0                                   # never read: positions and the mask are given

    def update(self, key_states, value_states, *args, **kwargs):
        rows = torch.arange(key_states.shape[0], device=self.kbuf.device)    # [S]
        # [S, H, D] into column at[i] of slot i; autocast: the prefill's dtype
        self.kbuf[rows, :, self.at] = key_states[:, :, 0].to(self.kbuf.dtype)
        self.vbuf[rows, :, self.at] = value_states[:, :, 0].to(self.vbuf.dtype)
        return self.kbuf, self.vbuf

    def put(self, slots: torch.Tensor, prompt, G: int, P: int) -> None:
        """Slots [k*G] take the KV of k prefilled prompts (a kv_cache.BufferedLayer, the last
        columns of [0, P): kv_cache.prefill_prompts), each prompt's for its G slots."""
        p = prompt.seen
        for buf, src in ((self.kbuf, prompt.kbuf), (self.vbuf, prompt.vbuf)):
            buf[slots, :, P - p:P] = src[:, :, :p].repeat_interleave(G, 0).to(buf.dtype)


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """Attention of one query token per slot over the whole buffer, the query heads of a KV head
    stacked as its queries, so no K/V is copied per query head (HF's sdpa repeats them when a mask
    is given): query [S, Hq, 1, D], key and value [S, Hk, C, D], attention_mask [S, 1, 1, C] bool.
    Returns [S, 1, Hq, D], as HF's attention functions do."""
    S, Hq, _, D = query.shape
    Hk = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(S, Hk, Hq // Hk, D), key, value, attn_mask=attention_mask,
        scale=scaling)                                                        # [S, Hk, Hq/Hk, D]
    return out.reshape(S, Hq, 1, D).transpose(1, 2).contiguous(), None


ATTENTION = "sampler_static_decode"          # the name decode_attention is registered under
AttentionInterface.register(ATTENTION, decode_attention)
_COMPILED: dict = {}                         # mode -> the compiled decode_step
_SEEN: set = set()                           # the (S, C, model, autocast) compiled: printed


def decode_step(model, cache, tok, pos, mask):
    """One decode forward over every slot: tok, pos [S, 1], mask [S, 1, 1, C] -> logits [S, V]."""
    return model(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True,
                 logits_to_keep=1, **{kv_cache.cache_kwarg(model): cache}).logits[:, -1]


def compile_mode(device: torch.device) -> str | None:
    """torch.compile's mode: a CUDA graph on CUDA (reduce-overhead), inductor's default on CPU."""
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_step(device: torch.device):
    """decode_step through torch.compile (one graph, static shapes), made once per mode."""
    mode = compile_mode(device)
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(decode_step, mode=mode, dynamic=False, fullgraph=True)
    return _COMPILED[mode]


def uses_graphs(device: torch.device) -> bool:
    """Whether the step is a CUDA graph: its inputs then live at fixed addresses and its output is
    overwritten by the next replay."""
    return compile_mode(device) == "reduce-overhead"


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def can_compile(model, device: torch.device, window: int | None, span: int) -> bool:
    """Whether the compiled static step runs this model here; if not, a one-line warning (the
    caller decodes eagerly). span: P + T, the columns a row needs."""
    c = model.config.get_text_config()
    why = None
    if not hasattr(torch, "compile"):
        why = "this torch has no torch.compile"
    elif device.type == "cpu" and not any(shutil.which(x) for x in ("g++", "c++", "clang++")):
        why = "no C++ compiler (g++) for inductor on CPU"
    elif device.type == "cuda" and not _has_triton():
        why = "no triton for inductor on CUDA"
    elif device.type not in ("cpu", "cuda"):
        why = f"device {device.type!r} (the static step is built for cpu and cuda)"
    elif getattr(c, "_attn_implementation", None) not in ("sdpa", "eager", None):
        why = f"attention {c._attn_implementation!r} (the static step replaces sdpa or eager)"
    elif getattr(c, "attn_logit_softcapping", None) or getattr(c, "final_logit_softcapping", None):
        why = "logit soft-capping (the static step's attention has none)"
    elif window is not None and span > window:
        why = f"a sliding window ({window}) shorter than P + T ({span})"
    if why:
        warnings.warn(f"--compile: {why}; decoding eagerly", stacklevel=3)
    return why is None


def run_step(step, model, cache, tok, pos, mask, graphs: bool) -> torch.Tensor:
    """step(...) -> logits [S, V] with decode_attention swapped in for the call (the model's own
    attention is back for the prefill and the training forward)."""
    c = model.config
    old, c._attn_implementation = c._attn_implementation, ATTENTION
    try:
        if graphs:                      # a new replay: the previous output was cloned already
            torch.compiler.cudagraph_mark_step_begin()
        out = step(model, cache, tok, pos, mask)                              # [S, V]
    finally:
        c._attn_implementation = old
    return out.clone() if graphs else out


class StaticSteps:
    """sample_groups' batch held in static shapes (the module docstring), the other way than
    sampler.EagerSteps and with its methods: S slots at fixed places, a free slot taken by the next
    group, every forward over all S slots and the whole C-column buffer. The step is
    compiled_step's (the tests and the bench swap decode_step in: the loop alone, eager)."""

    def __init__(self, model, cache, ids, pmask, G: int, S: int, T: int):
        device, P = ids.device, ids.shape[1]
        self.model, self.cache, self.ids, self.pmask = model, cache, ids, pmask
        self.G, self.S = G, S
        self.P, self.C, self.plen = P, -(-(P + T) // STATIC_ROUND) * STATIC_ROUND, pmask.sum(-1)
        self.step = compiled_step(device)
        self.compiled = self.step is not decode_step
        self.graphs = self.compiled and uses_graphs(device)
        zeros = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.at, self.tok, self.pos = zeros(S), zeros(S, 1), zeros(S, 1)  # [S] write column, [S, 1]
        self.mask = zeros(S, 1, 1, self.C, dtype=torch.bool)                  # [S, 1, 1, C]
        self.mask[..., 0] = True                 # a slot never used attends to something (no NaN)
        self.row, self.t = zeros(S), zeros(S)                    # [S] its response row, tokens
        if self.graphs:                          # the graph's inputs, at fixed addresses
            for x in (self.at, self.tok, self.pos, self.mask):
                torch._dynamo.mark_static_address(x)
        self.busy, self.idle = [], list(range(S))                   # slots in use (sorted), free
        self.logits, self.act = None, None                                   # [S, V], [n]

    def free(self) -> int:
        return len(self.idle)

    def admit(self, g: slice) -> None:
        """Prompts g (whole groups) prefilled once each into the first free k*G slots."""
        G, k, device = self.G, g.stop - g.start, self.ids.device
        new, self.idle = self.idle[:k * G], self.idle[k * G:]
        slots = torch.tensor(new, device=device)                             # [k*G]
        first, prompt = kv_cache.prefill_prompts(self.model, self.ids[g], self.pmask[g])  # [k, V]
        if not isinstance(self.cache.layers[0], StaticLayer):                # the first admission
            self.cache.layers = [StaticLayer(*_static_buffers(la, self.S, self.C, self.graphs),
                                             self.at) for la in prompt.layers]
        for layer, pl in zip(self.cache.layers, prompt.layers):
            layer.put(slots, pl, G, self.P)
        self.mask[slots, 0, 0] = torch.nn.functional.pad(
            self.pmask[g].bool(), (0, self.C - self.P)).repeat_interleave(G, 0)  # [k*G, C]
        self.row[slots] = torch.arange(g.start * G, g.stop * G, device=device)
        self.t[slots] = 0
        if self.logits is None:
            self.logits = first.new_zeros(self.S, first.shape[-1])           # [S, V]
        self.logits[slots] = first.repeat_interleave(G, 0)
        self.busy = sorted(self.busy + new)

    def active(self):
        self.act = torch.tensor(self.busy, device=self.ids.device, dtype=torch.long)  # [n]
        z = self.logits if len(self.busy) == self.S else self.logits[self.act]  # all busy: no copy
        return self.row[self.act], self.t[self.act], z

    def advance(self, tok: torch.Tensor, keep: list[bool]) -> None:
        """Slots where keep is False go free; the others' tokens tok [n] go through one forward of
        every slot (a free slot recomputes its stale token, its output unread)."""
        self.t[self.act] += 1
        self.idle += [s for s, k_ in zip(self.busy, keep) if not k_]
        self.busy = [s for s, k_ in zip(self.busy, keep) if k_]
        if not self.busy:
            return
        act = torch.tensor(self.busy, device=tok.device)                    # [n'] still decoding
        a = self.P + self.t[act] - 1                                         # [n'] the new column
        self.at[act], self.tok[act, 0] = a, tok[torch.tensor(keep, device=tok.device)]
        self.pos[act, 0] = self.plen[self.row[act] // self.G] + self.t[act] - 1  # from 1st token
        self.mask[act, 0, 0, a] = True
        key = (self.S, self.C, id(self.model), torch.is_autocast_enabled(tok.device.type))
        t0 = time.perf_counter()
        self.logits = run_step(self.step, self.model, self.cache, self.tok, self.pos, self.mask,
                               self.graphs)                                   # [S, V]
        if self.compiled and key not in _SEEN:                               # a compile each
            _SEEN.add(key)
            print(f"sampler: compiled the decode step ({self.S} slots x {self.C} positions) in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _static_buffers(prompt_layer, S: int, C: int, graphs: bool):
    """Zeroed K and V buffers [S, H, C, D] in the prefill's dtype and device (zeros: a masked
    column is multiplied by 0, and 0 x NaN garbage would be NaN)."""
    kb = prompt_layer.kbuf
    bufs = [kb.new_zeros(S, kb.shape[1], C, kb.shape[-1]) for _ in "kv"]
    if graphs:                                   # written in place by the captured graph
        for b in bufs:
            torch._dynamo.mark_static_address(b)
    return bufs
