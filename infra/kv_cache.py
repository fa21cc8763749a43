"""The KV cache sampler.sample_groups decodes with: Hugging Face's DynamicCache, every layer a
buffer allocated once and written in place, and the prefill and prompt helpers the training forward
(logprobs.py) shares with it.

Article section: "Step 1: Rollout 采样" (the old policy's G answers are decoded with a KV cache;
this is how the cache is held, not what is sampled).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers of `rows` x `capacity` positions,
    allocated once.

    DynamicLayer grows by torch.cat, so every step copies the whole cache into a fresh tensor
    (O(T^2) copying per rollout). Here a prefill writes columns [0, P) and a decode step writes one
    column per row, row i at its own column at[i] (rows admitted at different steps have different
    lengths); attention reads a view of the first `seen` columns, and the attention mask hides the
    columns a row has not written.
    """

    def __init__(self, capacity: int, rows: int | None = None):
        super().__init__()
        self.capacity, self.rows, self.seen, self.kbuf, self.at = capacity, rows, 0, None, None

    def get_seq_length(self) -> int:                                     # the masks' query position
        return self.seen

    def alloc(self, like: torch.Tensor, n: int) -> None:
        # under autocast (--bf16) the compute dtype, not K's: K leaves RoPE in float32 (float32
        # master weights' cos/sin), V in bf16; a float32 cache is twice the memory, and attention
        # would cast the whole cache to bf16 at every layer of every decode step
        dev = like.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else like.dtype
        self.is_initialized, self.dtype, self.device = True, dtype, like.device
        # zeros, not empty: a column a row never wrote is masked, and 0 x NaN garbage would still be
        # NaN
        self.kbuf, self.vbuf = (like.new_zeros(self.rows or n, like.shape[1], self.capacity,
                                               like.shape[-1], dtype=dtype) for _ in "kv")
        self.row_ids = torch.arange(self.kbuf.shape[0], device=like.device)   # a decode's rows

    def update(self, key_states, value_states, *args, **kwargs):
        n, t = key_states.shape[0], key_states.shape[-2]                      # [n, H, t, D]
        if self.kbuf is None:
            self.alloc(key_states, n)
        if self.seen + t > self.capacity:
            raise RuntimeError(f"the KV buffer holds {self.capacity} positions, {self.seen + t} "
                               f"were written")
        if self.at is None:                                              # a prefill: columns [0, t)
            self.kbuf[:n, :, :t], self.vbuf[:n, :, :t] = key_states, value_states
        else:                                                 # a decode step: row i at column at[i]
            rows = self.row_ids[:n]
            # the buffers' dtype (autocast's)
            k, v = (x[:, :, 0].to(self.kbuf.dtype) for x in (key_states, value_states))
            self.kbuf[rows, :, self.at], self.vbuf[rows, :, self.at] = k, v
        self.seen += t
        # [n, H, seen, D] views
        self.keys, self.values = self.kbuf[:n, :, :self.seen], self.vbuf[:n, :, :self.seen]
        return self.keys, self.values

    def put(self, start: int, prompt: BufferedLayer, G: int, P: int) -> None:
        """Rows [start, start + k*G) take the KV of k prefilled prompts, each for its G rows: the
        prompt cache's columns (prefill_prompts' trimmed width) go to the last of [0, P), where the
        rows' prompts end; the columns before are left padding, masked."""
        k, H, p, D = prompt.kbuf.shape[0], prompt.kbuf.shape[1], prompt.seen, prompt.kbuf.shape[-1]
        if self.kbuf is None:
            self.alloc(prompt.kbuf, k * G)
        for buf, src in ((self.kbuf, prompt.kbuf),
                         (self.vbuf, prompt.vbuf)):  # [k, G, H, p, D] <- [k, 1, H, p, D]
            buf[start:start + k * G].view(k, G, H, self.capacity, D)[:, :, :, P - p:P] = (
                src[:, None, :, :p])
        self.seen = max(self.seen, P)                            # move_rows copies what was written

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows src [m] move to rows dst [m] (the written columns only), in place."""
        L = self.seen
        self.kbuf[dst, :, :L], self.vbuf[dst, :, :L] = (self.kbuf[src, :, :L],
                                                        self.vbuf[src, :, :L])


def make_cache(model, capacity: int, rows: int | None = None) -> tuple[DynamicCache, int | None]:
    """The cache generate would build, every attention layer made a BufferedLayer, and its smallest
    sliding window.

    A sliding-window layer keeps all positions here: the model's mask applies the window (by
    column index)."""
    cache = DynamicCache(config=model.config)                 # one layer per decoder layer, by type
    other = {type(la).__name__ for la in cache.layers} - {"DynamicLayer",
                                                          "DynamicSlidingWindowLayer"}
    if other:
        raise ValueError(f"sample_groups handles full and sliding-window attention caches, not "
                         f"{sorted(other)}")
    window = min((la.sliding_window for la in cache.layers
                  if isinstance(la, DynamicSlidingWindowLayer)), default=None)
    cache.layers = [BufferedLayer(capacity, rows) for _ in cache.layers]
    return cache, window


def _decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 **kwargs):
    """SDPA for a decode step (one query column) of a GQA model without repeating the cache: the
    g query heads sharing a KV head become g query rows of that head, q [n, H, 1, D] ->
    [n, Hkv, g, D], and the mask [n, 1, 1, L] broadcasts over them. HF's SDPA path before
    transformers 5.23 repeats K and V per query head ([n, H, L, D] copies, per layer per step)
    whenever a mask is passed, as left-padded rows always do. Anything else: HF's own."""
    g = getattr(module, "num_key_value_groups", 1)
    n, H, q, D = query.shape
    if q != 1 or g == 1 or kwargs.get("position_bias") is not None or (
            attention_mask is not None and attention_mask.shape[1] != 1):
        return _HF_SDPA(module, query, key, value, attention_mask, dropout=dropout,
                        scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(n, H // g, g, D), key, value, attn_mask=attention_mask,
        scale=scaling)                                                      # [n, Hkv, g, D]
    return out.reshape(n, 1, H, value.shape[-1]), None                       # [n, 1, H, D]


_HF_SDPA = None


@contextmanager
def gqa_decode():
    """Within it, the models' "sdpa" attention is _decode_sdpa (decode steps without a per-step
    copy of the cache); the HF function again after."""
    global _HF_SDPA
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    table = ALL_ATTENTION_FUNCTIONS._global_mapping
    if _HF_SDPA is not None or "sdpa" not in table:                  # nested, or no SDPA to wrap
        yield
        return
    _HF_SDPA = table["sdpa"]
    table["sdpa"] = _decode_sdpa
    try:
        yield
    finally:
        table["sdpa"], _HF_SDPA = _HF_SDPA, None


def left_padded(prompts: list[list[int]], pad_token_id: int, device=None):
    """Prompts left-padded to the longest, P: ids [n, P] and attention mask [n, P], built from the
    lengths. sample_groups and the training forward (logprobs.py) both use it, so sampling and
    training see the same positions."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (P - len(p)) + list(p) for p in prompts],
                       device=device)  # [n, P]
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts],
                        device=device)  # [n, P]
    return ids, mask


def cache_kwarg(model) -> str:
    """transformers 5 names the cache argument `cache`; earlier releases call it
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill_prompts(model, ids: torch.Tensor, pmask: torch.Tensor):
    """One forward over k left-padded prompts [k, P], less the columns that are padding in all k
    (a group of short prompts is not computed at the batch's longest) -> (the logits at each
    prompt's last position [k, V], their cache of BufferedLayers, of the columns computed: the last
    of [0, P), as `put` places them)."""
    lead = ids.shape[1] - int(pmask.sum(-1).max())                  # all-padding columns
    ids, pmask = ids[:, lead:], pmask[:, lead:]
    prompt_cache, _ = make_cache(model, ids.shape[1])
    pos = (pmask.cumsum(-1) - 1).clamp_min(0)             # [k, p] counted from the first real token
    logits = model(input_ids=ids, attention_mask=pmask, position_ids=pos, use_cache=True,
                   logits_to_keep=1,
                   **{cache_kwarg(model): prompt_cache}).logits[:, -1]      # [k, V]
    return logits, prompt_cache


def prefill_into(model, cache, ids: torch.Tensor, pmask: torch.Tensor,
             start: int, G: int) -> torch.Tensor:
    """One forward over k left-padded prompts ([k, P]); their KV go to the cache's rows
    [start, start + k*G), each prompt's to its G rows, columns [0, P). Returns the logits at each
    prompt's last position, [k, V]."""
    logits, prompt_cache = prefill_prompts(model, ids, pmask)
    for layer, prompt in zip(cache.layers, prompt_cache.layers):
        layer.put(start, prompt, G, ids.shape[1])
    return logits
