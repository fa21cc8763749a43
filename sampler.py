"""Rollouts: G sampled answers per prompt, decoded with the Hugging Face KV cache.

Article section: "Step 1: Rollout 采样" (one prompt, G = 4 answers from the old policy) and
"Rollout 与 Advantage 计算" (B prompts x G answers -> [B*G, T_resp]).

`sample_groups` does not call `model.generate`, and is faster (`python -m bench` measures it):
- each prompt is prefilled once and its KV cache repeated for its G samples (generate prefills G
  copies);
- the cache is preallocated for the whole rollout and written in place (DynamicCache re-copies it
  with torch.cat at every step);
- finished rows leave the batch and the cache, so they stop costing compute, and with max_num_seqs
  (continuous batching) their slots go to waiting groups, so at most that many rows decode at once;
- sampling is inverse-CDF on uniforms drawn up front, walking block masses then one block (no
  vocabulary-sized running sum), where generate draws a vocabulary of exponentials per row
  (torch.multinomial); only top-p sorts.
Prompts of different lengths are left-padded with position ids counted from each prompt's first real
token. One generator per prompt if a list is given, so a prompt's samples depend only on its own
seed, never on which other prompts share the batch (this is what makes 1 rank and N ranks draw the
same).

infra/rollout.py's `sample_rollout` is Step 1 as train.py and evaluate.py call it: sample_groups
under --bf16 autocast with --max-num-seqs slots, or a vLLM engine's sample_groups (--rollout vllm).
"""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


@dataclass
class Rollout:
    """B prompts x G responses; response rows of one prompt are contiguous (row i belongs to prompt
    i // G).

    The sampler fills the fields up to `logprobs`; Step 2's fields are the trainer's
    (train.reward), None until it scores the rollout. `select_groups` and `cat` carry every
    field."""
    prompts: list[list[int]]            # B token-id lists, unpadded
    G: int                              # responses per prompt
    pad_token_id: int                   # fills response_ids after each response's end
    response_ids: torch.Tensor          # [N, T] long, pad after each response's end
    mask: torch.Tensor                  # [N, T] float, 1 on response tokens up to and including EOS
    lengths: torch.Tensor               # [N] long, response tokens (EOS included)
    truncated: torch.Tensor             # [N] bool, no EOS within max_new_tokens
    logprobs: torch.Tensor  # [N, T] float, log-prob of each sampled token under the sampling policy
    # Step 2: the rewards (train.reward)
    # the shaped reward the advantages compare (DAPO: +-1, penalty)
    rewards: torch.Tensor | None = None  # [N] float
    # the --reward score (dynamic sampling's filter reads it)
    correct: torch.Tensor | None = None  # [N] float
    # the position of the row's prompt in the data stream
    index: torch.Tensor | None = None    # [N] long
    # --reward name -> [N] (NaN: no score)
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def empty(G: int, pad_token_id: int) -> Rollout:
        """No rows (a rank that dynamic sampling left without a group): every per-row field [0]
        or [0, 0]."""
        rows, grid = torch.zeros(0), torch.zeros(0, 0)
        return Rollout(prompts=[], G=G, pad_token_id=pad_token_id, response_ids=grid.long(),
                       mask=grid,
                       lengths=rows.long(), truncated=rows.bool(), logprobs=grid, rewards=rows,
                       correct=rows, index=rows.long())

    @staticmethod
    def from_lengths(prompts: list[list[int]], G: int, pad_token_id: int, response: torch.Tensor,
                     logprobs: torch.Tensor, lengths: torch.Tensor,
                     truncated: torch.Tensor) -> Rollout:
        """The sampled rollout from its [N, T_max] buffers, trimmed to the longest response, the
        mask built from lengths (never from token values); the one builder every sampler uses."""
        T = int(lengths.max()) if lengths.numel() else 0
        mask = (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]).float()  # N, T
        return Rollout(prompts=[list(p) for p in prompts], G=G, pad_token_id=pad_token_id,
                       response_ids=response[:, :T], mask=mask, lengths=lengths,
                       truncated=truncated, logprobs=logprobs[:, :T] * mask)

    def response_text(self, i: int, tokenizer) -> str:
        """Row i's response as text: its tokens up to its length, special tokens (EOS) dropped."""
        return tokenizer.decode(self.response_ids[i, : self.lengths[i]], skip_special_tokens=True)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def select_groups(self, keep: torch.Tensor) -> Rollout:
        """The rollout restricted to the groups where keep [B] is True."""
        rows = keep.to(torch.bool).repeat_interleave(self.G)                  # [N]
        take = lambda x: None if x is None else x[rows]  # noqa: E731
        return replace(
            self, prompts=[p for p, k in zip(self.prompts, keep.tolist()) if k],
            response_ids=self.response_ids[rows], mask=self.mask[rows], lengths=self.lengths[rows],
            truncated=self.truncated[rows], logprobs=self.logprobs[rows],
            rewards=take(self.rewards),
            correct=take(self.correct), index=take(self.index),
            reward_parts={k: v[rows] for k, v in self.reward_parts.items()})

    @staticmethod
    def cat(rollouts: list[Rollout]) -> Rollout:
        """Concatenate rollouts with the same G along the group axis, padding T to the longest."""
        if len(rollouts) == 1:
            return rollouts[0]
        T, first = max(r.response_ids.shape[1] for r in rollouts), rollouts[0]
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731

        def join(name: str) -> torch.Tensor | None:                  # a [N] field, None if unscored
            parts = [getattr(r, name) for r in rollouts]
            return None if parts[0] is None else torch.cat(parts)

        return Rollout(
            prompts=[p for r in rollouts for p in r.prompts], G=first.G,
            pad_token_id=first.pad_token_id,
            response_ids=torch.cat([pad(r.response_ids, first.pad_token_id) for r in rollouts]),
            mask=torch.cat([pad(r.mask, 0.0) for r in rollouts]),
            lengths=join("lengths"), truncated=join("truncated"),
            logprobs=torch.cat([pad(r.logprobs, 0.0) for r in rollouts]),
            rewards=join("rewards"), correct=join("correct"), index=join("index"),
            reward_parts={k: torch.cat([r.reward_parts[k] for r in rollouts])
                          for k in first.reward_parts})


class _BufferedLayer(DynamicLayer):
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

    def _alloc(self, like: torch.Tensor, n: int) -> None:
        self.is_initialized, self.dtype, self.device = True, like.dtype, like.device
        # zeros, not empty: a column a row never wrote is masked, and 0 x NaN garbage would still
        # be NaN
        self.kbuf, self.vbuf = (like.new_zeros(self.rows or n, like.shape[1], self.capacity,
                                               like.shape[-1]) for _ in "kv")

    def update(self, key_states, value_states, *args, **kwargs):
        n, t = key_states.shape[0], key_states.shape[-2]                      # [n, H, t, D]
        if self.kbuf is None:
            self._alloc(key_states, n)
        if self.seen + t > self.capacity:
            raise RuntimeError(f"the KV buffer holds {self.capacity} positions, {self.seen + t} "
                               f"were written")
        if self.at is None:                                              # a prefill: columns [0, t)
            self.kbuf[:n, :, :t], self.vbuf[:n, :, :t] = key_states, value_states
        else:                                                 # a decode step: row i at column at[i]
            rows = torch.arange(n, device=self.kbuf.device)
            # autocast: prefill's dtype
            k, v = (x[:, :, 0].to(self.kbuf.dtype) for x in (key_states, value_states))
            self.kbuf[rows, :, self.at], self.vbuf[rows, :, self.at] = k, v
        self.seen += t
        # [n, H, seen, D] views
        self.keys, self.values = self.kbuf[:n, :, :self.seen], self.vbuf[:n, :, :self.seen]
        return self.keys, self.values

    def put(self, start: int, prompt: _BufferedLayer, G: int) -> None:
        """Rows [start, start + k*G) take the KV of k prefilled prompts (columns [0, P)), each for
        its G rows."""
        k, H, P, D = prompt.kbuf.shape[0], prompt.kbuf.shape[1], prompt.seen, prompt.kbuf.shape[-1]
        if self.kbuf is None:
            self._alloc(prompt.kbuf, k * G)
        for buf, src in ((self.kbuf, prompt.kbuf),
                         (self.vbuf, prompt.vbuf)):  # [k, G, H, P, D] <- [k, 1, H, P, D]
            buf[start:start + k * G].view(k, G, H, self.capacity, D)[:, :, :, :P] = (
                src[:, None, :, :P])
        self.seen = max(self.seen, P)                            # keep_rows copies what was written

    def keep_rows(self, indices: torch.Tensor) -> None:
        n, L = indices.shape[0], self.seen                      # kept rows move to [0, n), in place
        self.kbuf[:n, :, :L], self.vbuf[:n, :, :L] = (self.kbuf[indices, :, :L],
                                                      self.vbuf[indices, :, :L])


def make_cache(model, capacity: int, rows: int | None = None) -> tuple[DynamicCache, int | None]:
    """The cache generate would build, every attention layer made a _BufferedLayer, and its smallest
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
    cache.layers = [_BufferedLayer(capacity, rows) for _ in cache.layers]
    return cache, window


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


def _uniforms(B: int, G: int, T: int, generator) -> torch.Tensor:
    """[B*G, T] uniforms: from one generator, or G x T from each prompt's own generator."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != B:
            raise ValueError(f"got {len(generator)} generators for {B} prompts")
        return (torch.cat([torch.rand(G, T, generator=g) for g in generator]) if B
                else torch.zeros(0, T))
    return torch.rand(B * G, T, generator=generator)


SAMPLE_BLOCK = 256  # tokens per block of the two-level inverse CDF in sample_token


def sample_workspace(n: int, V: int, device=None) -> torch.Tensor:
    """The zeroed float32 [n, V rounded up to SAMPLE_BLOCK] buffer sample_token works in; reuse it
    across steps."""
    return torch.zeros(n, -(-V // SAMPLE_BLOCK) * SAMPLE_BLOCK, device=device)


def sample_token(logits: torch.Tensor, u: torch.Tensor, temperature: float,
                 top_p: float, work=None):
    """One token per row from logits [n, V] given uniforms u [n]; returns (tokens [n], logprobs
    [n]).

    Inverse CDF: the first token whose running mass exceeds u * (the kept mass). The log-prob is
    that of the tempered distribution softmax(logits / temperature) (before top-p), the distribution
    train.py recomputes; temperature 0 is greedy and reports the plain log-softmax. Without top-p
    the walk has two levels, so no vocabulary-sized running sum is built: the mass of each block of
    SAMPLE_BLOCK tokens, a running sum over blocks to find the block where u lands, then a running
    sum inside that block only. `work` (sample_workspace(>= n, V)), zero beyond V, holds the
    probabilities and is reused across steps (on CPU a fresh vocabulary-sized tensor per step costs
    more in page faults than the arithmetic). Only top-p sorts.
    """
    n, V = logits.shape
    if temperature == 0:
        z = logits.float()                                                    # [n, V]
        tok = z.argmax(-1)                                                    # [n]
        return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    if work is None:
        work = sample_workspace(n, V, logits.device)
    w = work[:n]                                                              # [n, nb * BLOCK]
    nb = w.shape[1] // SAMPLE_BLOCK                               # blocks, the last one zero-padded
    p = w[:, :V].copy_(logits)                                               # [n, V] float32 logits
    p.sub_(p.amax(-1, keepdim=True))
    if temperature != 1.0:
        p.div_(temperature)
    p.exp_()                                                        # probabilities x a row constant
    u = u.to(w)[:, None]                                                      # [n, 1]
    if top_p < 1.0:
        p, order = p.sort(dim=-1, descending=True)                            # [n, V]
        cdf = p.cumsum(-1)                                                    # [n, V] running mass
        # the nucleus ends at the first sorted token where the running mass reaches top_p of the
        # total
        last = torch.searchsorted(cdf, top_p * cdf[:, -1:]).clamp_max(V - 1)  # [n, 1]
        idx = torch.minimum(torch.searchsorted(cdf, u * cdf.gather(-1, last), side="right"), last)
        return (order.gather(-1, idx).squeeze(-1),
                p.gather(-1, idx).squeeze(-1).log() - cdf[:, -1].log())
    blocks = w.view(n, nb, SAMPLE_BLOCK)                                      # [n, nb, BLOCK]
    bcdf = blocks.sum(-1).cumsum(-1)                      # [n, nb] running mass at each block's end
    total = bcdf[:, -1:].contiguous()                                         # [n, 1]
    # a walk never ends on a zero-mass token: clamp to the first block (then token) where the
    # mass is complete
    b = torch.minimum(torch.searchsorted(bcdf, u * total, side="right"),
                      torch.searchsorted(bcdf, total))  # [n, 1]
    # mass of the blocks before b
    before = torch.nn.functional.pad(bcdf, (1, 0)).gather(-1, b)              # [n, 1]
    # block b's probabilities
    inner = blocks[torch.arange(n, device=w.device), b.squeeze(-1)]  # [n, BLOCK]
    icdf = inner.cumsum(-1)                                                   # [n, BLOCK]
    i = torch.minimum(torch.searchsorted(icdf, u * total - before, side="right"),
                      torch.searchsorted(icdf, icdf[:, -1:].contiguous()))    # [n, 1]
    return ((b * SAMPLE_BLOCK + i).squeeze(-1),
            inner.gather(-1, i).squeeze(-1).log() - total.squeeze(-1).log())


def num_seqs_within(model, prompts: list[list[int]], G: int, max_new_tokens: int,
                    budget_gb: float) -> int:
    """The most rows (a multiple of G, at least G) whose KV cache, rows x (P + T) positions, fits in
    budget_gb: one position of one row takes layers x KV heads x head_dim x 2 (K and V) x bytes
    (autocast's dtype if on)."""
    c, device = model.config.get_text_config(), next(model.parameters()).device
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    amp = torch.is_autocast_enabled(device.type)
    nbytes = (torch.get_autocast_dtype(device.type) if amp
              else next(model.parameters()).dtype).itemsize
    per_row = (c.num_hidden_layers * heads * head_dim * 2 * nbytes
               * (max(map(len, prompts), default=0) + max_new_tokens))
    return max(G, int(budget_gb * 2**30 // per_row) // G * G)


def check_sampling(prompts: list[list[int]], G: int, max_new_tokens: int,
                   max_num_seqs: int | None = None) -> None:
    """The arguments every sample_groups (this one, a vLLM engine's) refuses: ValueError."""
    if G < 1 or max_new_tokens < 1:
        raise ValueError(f"need G >= 1 and max_new_tokens >= 1, got G={G}, "
                         f"max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_num_seqs is not None and max_num_seqs < G:
        raise ValueError(f"max_num_seqs={max_num_seqs} < G={G}: a group's G rows decode together")


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], G: int, max_new_tokens: int,
                  eos_token_id: int | list[int],
                  pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, generator=None,
                  max_num_seqs: int | None = None, continuous: bool = True,
                  static=None) -> Rollout:
    """Sample G responses for each prompt (token-id lists of any lengths) with the KV cache ->
    Rollout.

    eos_token_id: one id or several (chat models end a turn with one token and a document with
    another); a response ends at the first of them, which it keeps. max_num_seqs: at most this many
    rows decode at once (None: all B*G), so the KV cache holds max_num_seqs x (P + T) positions, P
    the longest prompt. A group is admitted whole (its prompt prefilled once for its G rows) when G
    slots are free, so max_num_seqs must be >= G. continuous=False: static batches (admit what fits,
    wait until all of it has ended, admit the next), the baseline bench/ measures; a model whose
    sliding window is shorter than P + T always gets it (below). The rollout is the same for every
    max_num_seqs and either mode: each row's uniforms are drawn up front. static (--compile:
    the module infra.static_decode): the decode step with static shapes through torch.compile (the
    same rollout up to float rounding), or a one-line warning and this loop where it cannot run.
    """
    check_sampling(prompts, G, max_new_tokens, max_num_seqs)
    device = next(model.parameters()).device
    B, N, T = len(prompts), len(prompts) * G, max_new_tokens
    eos = torch.tensor(eos_token_id, device=device).reshape(-1)              # [E]
    u = _uniforms(B, G, T, generator).to(device)                              # [N, T]
    response = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, T, device=device)
    lengths = torch.full((N,), T, dtype=torch.long, device=device)
    truncated = torch.ones(N, dtype=torch.bool, device=device)
    if B == 0:
        return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths,
                                   truncated)

    was_training = model.training
    model.eval()
    ids, pmask = left_padded(prompts, pad_token_id, device)                  # [B, P] each
    P, plen = ids.shape[1], pmask.sum(-1)                                     # plen [B]
    S = N if max_num_seqs is None else min(max_num_seqs, N)           # slots: rows decoding at once
    cache, window = make_cache(model, P + T, rows=S)
    # the model's mask applies a sliding window at one query column for all rows: exact only when
    # the rows are aligned, as in a static batch (or when the window never bites)
    continuous = continuous and (window is None or P + T <= window)
    if static is not None and static.can_compile(model, device, window, P + T):
        static.decode(model, ids, pmask, plen, G, S, T, u, eos, temperature, top_p, continuous,
                      response, logprobs, lengths, truncated)
        model.train(was_training)
        return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths,
                                   truncated)
    kw = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    attn = torch.zeros(S, P + T,
                       dtype=torch.long, device=device)  # [S, P + T] the columns each slot sees
    rows = torch.zeros(0, dtype=torch.long, device=device)       # [n] the response row in each slot
    t = torch.zeros_like(rows)                                           # [n] tokens it has sampled
    born, admitted, logits, work = [], 0, None, None        # born: the step each slot's row came in

    # Continuous batching: a slot whose row has ended goes at once to the next waiting group (when G
    # slots are free), instead of the batch shrinking until its longest row ends. With long-tailed
    # lengths (most answers short, a few at max_new_tokens) a static batch spends its last steps on
    # a handful of rows; here every step decodes up to S rows, and the cache stays S x (P + T)
    # whatever the number of prompts. Slot i's row writes its token t at column P + t (its prompt,
    # left-padded, at [0, P)), and sees only the columns of its own prompt and tokens (attn), so
    # what an earlier row left in the slot is never read.
    for step in itertools.count():
        n = rows.shape[0]
        # whole groups that fit now
        k = min(B - admitted, (S - n) // G) if continuous or n == 0 else 0
        if k:
            g = slice(admitted, admitted + k)
            new = _prefill(model, cache, ids[g], pmask[g], n, G).repeat_interleave(G, 0)  # [k*G, V]
            attn[n:n + k * G] = torch.nn.functional.pad(pmask[g], (0, T)).repeat_interleave(G, 0)
            rows = torch.cat([rows, torch.arange(admitted * G, (admitted + k) * G, device=device)])
            t, born = torch.cat([t, t.new_zeros(k * G)]), born + [step] * (k * G)
            logits = new if logits is None else torch.cat([logits, new])
            admitted, n = admitted + k, n + k * G
        if n == 0:
            break
        # reused each step
        work = sample_workspace(S, logits.shape[-1], device) if work is None else work
        tok, lp = sample_token(logits, u[rows, t], temperature, top_p, work)  # [n], [n]
        response[rows, t], logprobs[rows, t] = tok, lp
        hit = torch.isin(tok, eos)                                            # [n]
        lengths[rows] = torch.where(hit, t + 1, lengths[rows])
        truncated[rows] &= ~hit
        t = t + 1
        keep = (~hit & (t < T)).tolist()                                  # the step's one host sync
        if not all(keep):                                             # compact: finished rows leave
            idx = [i for i, k_ in enumerate(keep) if k_]
            keep_i = torch.tensor(idx, dtype=torch.long, device=device)
            for layer in cache.layers:
                layer.keep_rows(keep_i)
            attn[:len(idx)] = attn[keep_i]
            rows, t, tok, born = rows[keep_i], t[keep_i], tok[keep_i], [born[i] for i in idx]
            n, logits = len(idx), logits[:0]
        if n == 0:
            continue
        at = P + t - 1                                      # [n] the column of each row's new token
        attn[torch.arange(n, device=device), at] = 1
        # columns in use: the oldest row's (rows keep their admission order)
        L = P + step + 1 - born[0]
        for layer in cache.layers:
            layer.at, layer.seen = at, L - 1                       # write at `at`, attend to [0, L)
        pos = plen[rows // G] + t - 1                    # [n] counted from the prompt's first token
        logits = model(input_ids=tok[:, None], attention_mask=attn[:n, :L],
                       position_ids=pos[:, None],
                       **kw).logits[:, -1]                                    # [n, V]
    model.train(was_training)
    return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths, truncated)


def prefill_prompts(model, ids: torch.Tensor, pmask: torch.Tensor):
    """One forward over k left-padded prompts [k, P] -> (the logits at each prompt's last position
    [k, V], their cache of _BufferedLayers, columns [0, P))."""
    prompt_cache, _ = make_cache(model, ids.shape[1])
    pos = (pmask.cumsum(-1) - 1).clamp_min(0)             # [k, P] counted from the first real token
    logits = model(input_ids=ids, attention_mask=pmask, position_ids=pos, use_cache=True,
                   logits_to_keep=1,
                   **{cache_kwarg(model): prompt_cache}).logits[:, -1]      # [k, V]
    return logits, prompt_cache


def _prefill(model, cache, ids: torch.Tensor, pmask: torch.Tensor,
             start: int, G: int) -> torch.Tensor:
    """One forward over k left-padded prompts ([k, P]); their KV go to the cache's rows
    [start, start + k*G), each prompt's to its G rows. Returns the logits at each prompt's
    last position, [k, V]."""
    logits, prompt_cache = prefill_prompts(model, ids, pmask)
    for layer, prompt in zip(cache.layers, prompt_cache.layers):
        layer.put(start, prompt, G)
    return logits
