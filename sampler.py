"""Rollouts: G sampled answers per prompt, decoded with the Hugging Face KV cache.

Article section: "Step 1: Rollout 采样" (one prompt, G = 4 answers from the old policy) and
"Rollout 与 Advantage 计算" (B prompts x G answers -> [B*G, T_resp]).

`sample_groups` does not call `model.generate`, and is faster (`python bench.py` measures it):
- each prompt is prefilled once and its KV cache repeated for its G samples (generate prefills G copies);
- the cache is preallocated for the whole rollout and written in place (DynamicCache re-copies it with
  torch.cat at every step);
- finished rows leave the batch and the cache, so they stop costing compute;
- sampling is inverse-CDF on uniforms drawn up front, walking block masses then one block (no
  vocabulary-sized running sum), where generate draws a vocabulary of exponentials per row
  (torch.multinomial); only top-p sorts.
Prompts of different lengths are left-padded with position ids counted from each prompt's first real
token. One generator per prompt if a list is given, so a prompt's samples depend only on its own seed,
never on which other prompts share the batch (this is what makes 1 rank and N ranks draw the same).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass
class Rollout:
    """B prompts x G responses; response rows of one prompt are contiguous (row i belongs to prompt i // G)."""
    prompts: list[list[int]]            # B token-id lists, unpadded
    G: int                              # responses per prompt
    pad_token_id: int                   # fills response_ids after each response's end
    response_ids: torch.Tensor          # [N, T] long, pad after each response's end
    mask: torch.Tensor                  # [N, T] float, 1 on response tokens up to and including EOS
    lengths: torch.Tensor               # [N] long, response tokens (EOS included)
    truncated: torch.Tensor             # [N] bool, no EOS within max_new_tokens
    logprobs: torch.Tensor              # [N, T] float, log-prob of each sampled token under the sampling policy
    extra: dict = field(default_factory=dict)  # per-response [N] tensors the trainer attaches (rewards, ...)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def select_groups(self, keep: torch.Tensor) -> Rollout:
        """The rollout restricted to the groups where keep [B] is True."""
        rows = keep.to(torch.bool).repeat_interleave(self.G)                  # [N]
        return replace(
            self, prompts=[p for p, k in zip(self.prompts, keep.tolist()) if k],
            response_ids=self.response_ids[rows], mask=self.mask[rows], lengths=self.lengths[rows],
            truncated=self.truncated[rows], logprobs=self.logprobs[rows],
            extra={k: v[rows] for k, v in self.extra.items()})

    @staticmethod
    def cat(rollouts: list[Rollout]) -> Rollout:
        """Concatenate rollouts with the same G along the group axis, padding T to the longest."""
        T = max(r.response_ids.shape[1] for r in rollouts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        keys, first = rollouts[0].extra.keys(), rollouts[0]
        return Rollout(
            prompts=[p for r in rollouts for p in r.prompts], G=first.G, pad_token_id=first.pad_token_id,
            response_ids=torch.cat([pad(r.response_ids, first.pad_token_id) for r in rollouts]),
            mask=torch.cat([pad(r.mask, 0.0) for r in rollouts]),
            lengths=torch.cat([r.lengths for r in rollouts]),
            truncated=torch.cat([r.truncated for r in rollouts]),
            logprobs=torch.cat([pad(r.logprobs, 0.0) for r in rollouts]),
            extra={k: torch.cat([r.extra[k] for r in rollouts]) for k in keys})


class _BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers of `capacity` positions, allocated once.

    DynamicLayer grows by torch.cat, so every step copies the whole cache into a fresh tensor (O(T^2)
    copying per rollout). Here a step writes its position in place and attention reads a view.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length, self.kbuf = capacity, 0, None

    def _use(self, kbuf: torch.Tensor, vbuf: torch.Tensor) -> None:
        self.kbuf, self.vbuf = kbuf, vbuf                                     # [n, H, capacity, D]
        self.keys, self.values = kbuf[:, :, :self.length], vbuf[:, :, :self.length]  # [n, H, length, D] views

    def update(self, key_states, value_states, *args, **kwargs):
        if self.kbuf is None:                                                 # the prefill
            self.is_initialized, self.dtype, self.device = True, key_states.dtype, key_states.device
            self._use(*(x.new_empty(*x.shape[:2], self.capacity, x.shape[-1]) for x in (key_states, value_states)))
        start, self.length = self.length, self.length + key_states.shape[-2]
        if self.length > self.capacity:
            raise RuntimeError(f"the KV buffer holds {self.capacity} positions, {self.length} were written")
        self.kbuf[:, :, start:self.length] = key_states                       # [n, H, t, D]
        self.vbuf[:, :, start:self.length] = value_states
        self._use(self.kbuf, self.vbuf)
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._use(self.kbuf.repeat_interleave(repeats, 0), self.vbuf.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        n, L = indices.shape[0], self.length                                  # kept rows move to [0, n), in place
        self.kbuf[:n, :, :L], self.vbuf[:n, :, :L] = self.kbuf[indices, :, :L], self.vbuf[indices, :, :L]
        self._use(self.kbuf[:n], self.vbuf[:n])


def _make_cache(model, capacity: int) -> DynamicCache:
    """The cache generate would build (sliding-window layers and all), plain layers made _BufferedLayer."""
    with_config = "config" in inspect.signature(DynamicCache).parameters     # transformers >= 4.56
    cache = DynamicCache(config=model.config) if with_config else DynamicCache()  # lazy plain layers if no types
    cache.layers = [_BufferedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _left_padded(prompts: list[list[int]], pad_token_id: int, device=None):
    """Prompts left-padded to the longest, P: ids [n, P] and attention mask [n, P], built from the lengths.
    sample_groups and the training forward (logprobs.py) both use it, so sampling and training see the same positions."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (P - len(p)) + list(p) for p in prompts], device=device)  # [n, P]
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)       # [n, P]
    return ids, mask


def _cache_kwarg(model) -> str:
    """transformers 5 names the cache argument `cache`; earlier releases call it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _uniforms(B: int, G: int, T: int, generator) -> torch.Tensor:
    """[B*G, T] uniforms: from one generator, or G x T from each prompt's own generator."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"got {len(generator)} generators for {B} prompts")
        return torch.cat([torch.rand(G, T, generator=g) for g in generator]) if B else torch.zeros(0, T)
    return torch.rand(B * G, T, generator=generator)


SAMPLE_BLOCK = 256  # tokens per block of the two-level inverse CDF in sample_token


def sample_workspace(n: int, V: int, device=None) -> torch.Tensor:
    """The zeroed float32 [n, V rounded up to SAMPLE_BLOCK] buffer sample_token works in; reuse it across steps."""
    return torch.zeros(n, -(-V // SAMPLE_BLOCK) * SAMPLE_BLOCK, device=device)


def sample_token(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float, work=None):
    """One token per row from logits [n, V] given uniforms u [n]; returns (tokens [n], logprobs [n]).

    Inverse CDF: the first token whose running mass exceeds u * (the kept mass). The log-prob is that of
    the tempered distribution softmax(logits / temperature) (before top-p), the distribution train.py
    recomputes; temperature 0 is greedy and reports the plain log-softmax.
    Without top-p the walk has two levels, so no vocabulary-sized running sum is built: the mass of each
    block of SAMPLE_BLOCK tokens, a running sum over blocks to find the block where u lands, then a running
    sum inside that block only. `work` (sample_workspace(>= n, V)), zero beyond V, holds the
    probabilities and is reused across steps (on CPU a fresh vocabulary-sized tensor per step costs more in
    page faults than the arithmetic). Only top-p sorts.
    """
    n, V = logits.shape
    if temperature == 0:
        z = logits.float()                                                    # [n, V]
        tok = z.argmax(-1)                                                    # [n]
        return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    if work is None:
        work = sample_workspace(n, V, logits.device)
    w = work[:n]                                                              # [n, nb * BLOCK]
    nb = w.shape[1] // SAMPLE_BLOCK                                           # blocks, the last one zero-padded
    p = w[:, :V].copy_(logits)                                                # [n, V] float32 logits
    p.sub_(p.amax(-1, keepdim=True))
    if temperature != 1.0:
        p.div_(temperature)
    p.exp_()                                                                  # probabilities x a row constant
    u = u.to(w)[:, None]                                                      # [n, 1]
    if top_p < 1.0:
        p, order = p.sort(dim=-1, descending=True)                            # [n, V]
        cdf = p.cumsum(-1)                                                    # [n, V] running mass
        # the nucleus ends at the first sorted token where the running mass reaches top_p of the total
        last = torch.searchsorted(cdf, top_p * cdf[:, -1:]).clamp_max(V - 1)  # [n, 1]
        idx = torch.minimum(torch.searchsorted(cdf, u * cdf.gather(-1, last), side="right"), last)
        return order.gather(-1, idx).squeeze(-1), p.gather(-1, idx).squeeze(-1).log() - cdf[:, -1].log()
    blocks = w.view(n, nb, SAMPLE_BLOCK)                                      # [n, nb, BLOCK]
    bcdf = blocks.sum(-1).cumsum(-1)                                          # [n, nb] running mass at each block's end
    total = bcdf[:, -1:].contiguous()                                         # [n, 1]
    # a walk never ends on a zero-mass token: clamp to the first block (then token) where the mass is complete
    b = torch.minimum(torch.searchsorted(bcdf, u * total, side="right"), torch.searchsorted(bcdf, total))  # [n, 1]
    before = torch.nn.functional.pad(bcdf, (1, 0)).gather(-1, b)              # [n, 1] mass of the blocks before b
    inner = blocks[torch.arange(n, device=w.device), b.squeeze(-1)]           # [n, BLOCK] block b's probabilities
    icdf = inner.cumsum(-1)                                                   # [n, BLOCK]
    i = torch.minimum(torch.searchsorted(icdf, u * total - before, side="right"),
                      torch.searchsorted(icdf, icdf[:, -1:].contiguous()))    # [n, 1]
    return (b * SAMPLE_BLOCK + i).squeeze(-1), inner.gather(-1, i).squeeze(-1).log() - total.squeeze(-1).log()


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], G: int, max_new_tokens: int, eos_token_id: int | list[int],
                  pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, generator=None) -> Rollout:
    """Sample G responses for each prompt (token-id lists of any lengths) with the KV cache -> Rollout.

    eos_token_id: one id or several (chat models end a turn with one token and a document with another);
    a response ends at the first of them, which it keeps.
    """
    if G < 1 or max_new_tokens < 1:
        raise ValueError(f"need G >= 1 and max_new_tokens >= 1, got G={G}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    B, N, T = len(prompts), len(prompts) * G, max_new_tokens
    eos = torch.tensor(eos_token_id, device=device).reshape(-1)              # [E]
    u = _uniforms(B, G, T, generator).to(device)                              # [N, T]
    response = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, T, device=device)
    lengths = torch.full((N,), T, dtype=torch.long, device=device)
    truncated = torch.ones(N, dtype=torch.bool, device=device)
    if B == 0:
        return _finish(prompts, G, pad_token_id, response, logprobs, lengths, truncated)

    was_training = model.training
    model.eval()
    ids, pmask = _left_padded(prompts, pad_token_id, device)                 # [B, P] each
    P = ids.shape[1]
    attn = torch.cat([pmask, pmask.new_ones(B, T)], 1)                        # [B, P + T]
    pos = (pmask.cumsum(-1) - 1).clamp_min(0)                                 # [B, P] counted from the first real token
    cache = _make_cache(model, P + T)
    kw = {_cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    logits = model(input_ids=ids, attention_mask=pmask, position_ids=pos, **kw).logits[:, -1]  # [B, V]: one prefill per prompt
    cache.batch_repeat_interleave(G)                                          # prompt KV shared by its G rows
    logits = logits.repeat_interleave(G, dim=0)                               # [N, V]
    attn = attn.repeat_interleave(G, dim=0)                                   # [N, P + T]
    next_pos = attn[:, :P].sum(-1)                                            # [N]
    active = torch.arange(N, device=device)                                   # rows still decoding
    work = sample_workspace(N, logits.shape[-1], device)                      # [N, V up to a block], reused each step

    for t in range(T):
        tok, lp = sample_token(logits, u[active, t], temperature, top_p, work)  # [n], [n]
        response[active, t] = tok
        logprobs[active, t] = lp
        done = torch.isin(tok, eos)                                           # [n]
        n_done = int(done.sum())                                              # the step's one host sync
        if n_done:
            lengths[active[done]] = t + 1
            truncated[active[done]] = False
        if t == T - 1 or n_done == active.shape[0]:
            break
        if n_done:                                                            # compact: finished rows leave
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
        logits = model(input_ids=tok[:, None], attention_mask=attn[:, :P + t + 1], position_ids=next_pos[:, None],
                       **kw).logits[:, -1]                                   # [n, V]
        next_pos = next_pos + 1
    model.train(was_training)
    return _finish(prompts, G, pad_token_id, response, logprobs, lengths, truncated)


def _finish(prompts, G, pad_token_id, response, logprobs, lengths, truncated) -> Rollout:
    """Trim to the longest response and build the mask from lengths (never from token values)."""
    T = int(lengths.max()) if lengths.numel() else 0
    mask = (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]).float()  # [N, T]
    return Rollout(prompts=[list(p) for p in prompts], G=G, pad_token_id=pad_token_id, response_ids=response[:, :T], mask=mask,
                   lengths=lengths, truncated=truncated, logprobs=logprobs[:, :T] * mask)
