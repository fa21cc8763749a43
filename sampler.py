"""Rollouts: G sampled answers per prompt, decoded with the Hugging Face KV cache.

Article section: "Step 1: Rollout 采样" (one prompt, G = 4 answers from the old policy) and
"Rollout 与 Advantage 计算" (B prompts x G answers -> [B*G, T_resp]).

`sample_groups` does not call `model.generate`, and is faster (`python -m bench` measures it):
- each prompt is prefilled once and its KV cache repeated for its G samples (generate prefills G
  copies);
- the cache is preallocated for the whole rollout and written in place (DynamicCache re-copies it
  with torch.cat at every step);
- every decode step is the model's own HF forward (`model(input_ids=..., past_key_values=...)`) over
  the rows still decoding;
- finished rows leave the batch and the cache, so they stop costing compute, and with max_num_seqs
  (continuous batching) their slots go to waiting groups, so at most that many rows decode at once;
- sampling is inverse-CDF on uniforms drawn up front, walking block masses then one block (no
  vocabulary-sized running sum), where generate draws a vocabulary of exponentials per row
  (torch.multinomial); only top-p sorts.
With top-p < 1 a token's log-prob is that of the nucleus it was drawn from, renormalised, and the
nucleus' size is kept (Rollout.kept, one count per token, not a [T, V] mask), so that the trainer's
old, reference and new log-probs are of the same truncated distribution (logprobs.py;
DeepSeek-V3.2's "keep sampling mask", as sizes; an engine's rollout: correction.py).
Prompts of different lengths are left-padded with position ids counted from each prompt's first real
token. One generator per prompt if a list is given, so a prompt's samples depend only on its own
seed, never on which other prompts share the batch (this is what makes 1 rank and N ranks draw the
same).

train.rollout calls sample_groups (or a vLLM engine's, --rollout vllm) inside harness/rollout.py's
`sampling`: --bf16 autocast and the --max-num-seqs slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from infra import kv_cache
from infra.lm_head import nucleus_last
from infra.packed import packed_linears


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
    # [N, T] long: the nucleus each token was drawn from, as its size (its kept most probable
    # tokens; --top-p < 1), 0 past the response; None: drawn from the full distribution
    kept: torch.Tensor | None = None
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
                     truncated: torch.Tensor, kept: torch.Tensor | None = None) -> Rollout:
        """The sampled rollout from its [N, T_max] buffers, trimmed to the longest response, the
        mask built from lengths (never from token values); the one builder every sampler uses."""
        T = int(lengths.max()) if lengths.numel() else 0
        mask = (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]).float()  # N, T
        return Rollout(prompts=[list(p) for p in prompts], G=G, pad_token_id=pad_token_id,
                       response_ids=response[:, :T], mask=mask, lengths=lengths,
                       truncated=truncated, logprobs=logprobs[:, :T] * mask,
                       kept=None if kept is None else kept[:, :T] * mask.long())

    def response_text(self, i: int, tokenizer) -> str:
        """Row i's response as text: its tokens up to its length, special tokens (EOS) dropped."""
        return tokenizer.decode(self.response_ids[i, : self.lengths[i]], skip_special_tokens=True)

    def cpu(self) -> Rollout:
        """Every tensor field (and reward part) on the CPU, one copy each (a rollout sampled on a
        GPU is read row by row after: one host sync, not one per row)."""
        return replace(self, **{k: v.cpu() for k, v in vars(self).items()
                                if isinstance(v, torch.Tensor)},
                       reward_parts={k: v.cpu() for k, v in self.reward_parts.items()})

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
            truncated=self.truncated[rows], logprobs=self.logprobs[rows], kept=take(self.kept),
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
            kept=None if all(r.kept is None for r in rollouts) else torch.cat(
                [pad(torch.zeros_like(r.response_ids) if r.kept is None else r.kept, 0)
                 for r in rollouts]),
            rewards=join("rewards"), correct=join("correct"), index=join("index"),
            reward_parts={k: torch.cat([r.reward_parts[k] for r in rollouts])
                          for k in first.reward_parts})


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
    [n], kept [n] or None).

    Inverse CDF: the first token whose running mass exceeds u * (the kept mass). The log-prob is
    that of the distribution the token was drawn from: softmax(logits / temperature), and with
    top_p < 1 its nucleus renormalised, whose size `kept` is returned (None without top-p) so that
    train.py recomputes the same distribution (Rollout.kept); temperature 0 is greedy and reports
    the plain log-softmax. Without top-p
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
        return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, -1), None
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
        last = nucleus_last(cdf, top_p)                                       # [n, 1]
        idx = torch.minimum(torch.searchsorted(cdf, u * cdf.gather(-1, last), side="right"), last)
        return (order.gather(-1, idx).squeeze(-1),          # under the nucleus: over its mass
                p.gather(-1, idx).squeeze(-1).log() - cdf.gather(-1, last).squeeze(-1).log(),
                last.squeeze(-1) + 1)
    blocks = w.view(n, nb, SAMPLE_BLOCK)                                      # [n, nb, BLOCK]
    bcdf = blocks.sum(-1).cumsum(-1)                      # [n, nb] running mass at each block's end
    total = bcdf[:, -1:].contiguous()                                         # [n, 1]
    # a walk never ends on a zero-mass token: clamp to the first block (then token) where the mass
    # is complete
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
            inner.gather(-1, i).squeeze(-1).log() - total.squeeze(-1).log(), None)


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
@kv_cache.gqa_decode()              # decode steps of a GQA model attend without copying the cache
def sample_groups(model, prompts: list[list[int]], G: int, max_new_tokens: int,
                  eos_token_id: int | list[int],
                  pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, generator=None,
                  max_num_seqs: int | None = None, continuous: bool = True,
                  packed: bool = True) -> Rollout:
    """Sample G responses for each prompt (token-id lists of any lengths) with the KV cache ->
    Rollout.

    eos_token_id: one id or several (chat models end a turn with one token and a document with
    another); a response ends at the first of them, which it keeps. max_num_seqs: at most this many
    rows decode at once (None: all B*G), so the KV cache holds max_num_seqs x (P + T) positions, P
    the longest prompt. A group is admitted whole (its prompt prefilled once for its G rows) when G
    slots are free, so max_num_seqs must be >= G. continuous=False: static batches (admit what fits,
    wait until all of it has ended, admit the next), the baseline bench/ measures; a model whose
    sliding window is shorter than P + T always gets it (below). The rollout is the same for every
    max_num_seqs and either mode: each row's uniforms are drawn up front. packed: the loop's
    matmuls on weights packed by oneDNN for the rollout (infra/packed.py: CPU, float32; the same
    rollout up to float rounding). Every step is the model's own HF forward.
    """
    check_sampling(prompts, G, max_new_tokens, max_num_seqs)
    device = next(model.parameters()).device
    B, N, T = len(prompts), len(prompts) * G, max_new_tokens
    eos = torch.tensor(eos_token_id, device=device).reshape(-1)              # [E]
    u = _uniforms(B, G, T, generator).to(device)                              # [N, T]
    response = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, T, device=device)
    # the nucleus sizes, only where top-p cuts
    kept = (torch.zeros(N, T, dtype=torch.long, device=device) if top_p < 1 and temperature != 0
            else None)
    lengths = torch.full((N,), T, dtype=torch.long, device=device)
    truncated = torch.ones(N, dtype=torch.bool, device=device)
    if B == 0:
        return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths,
                                   truncated, kept)

    was_training = model.training
    model.eval()
    ids, pmask = kv_cache.left_padded(prompts, pad_token_id, device)                  # [B, P] each
    S = N if max_num_seqs is None else min(max_num_seqs, N)           # slots: rows decoding at once
    cache, window = kv_cache.make_cache(model, ids.shape[1] + T, rows=S)
    # the model's mask applies a sliding window at one query column for all rows: exact only when
    # the rows are aligned, as in a static batch (or when the window never bites)
    continuous = continuous and (window is None or ids.shape[1] + T <= window)
    steps = Slots(model, cache, ids, pmask, G, S, T)
    admitted, work = 0, None
    # Continuous batching: a slot whose row has ended goes at once to the next waiting group (when G
    # slots are free), instead of the batch shrinking until its longest row ends. With long-tailed
    # lengths (most answers short, a few at max_new_tokens) a static batch spends its last steps on
    # a handful of rows; here every step decodes up to S rows, and the cache stays S x (P + T)
    # whatever the number of prompts.
    # packed: the matmuls on oneDNN-packed weights for the rollout (infra/packed.py)
    with packed_linears(model, S, enabled=packed):
        while True:
            idle = steps.free() == S
            k = min(B - admitted, steps.free() // G) if continuous or idle else 0  # whole groups
            if k:
                steps.admit(slice(admitted, admitted + k))
                admitted += k
            rows, t, logits = steps.active()                # [n] response rows, tokens, [n, V]
            if rows.numel() == 0:
                break
            if work is None:                                             # reused across steps
                work = sample_workspace(S, logits.shape[-1], device)
            tok, lp, k = sample_token(logits, u[rows, t], temperature, top_p, work)  # [n] each
            response[rows, t], logprobs[rows, t] = tok, lp
            if kept is not None:
                kept[rows, t] = k
            hit = torch.isin(tok, eos)                                        # [n]
            lengths[rows] = torch.where(hit, t + 1, lengths[rows])
            truncated[rows] &= ~hit
            steps.advance(tok, (~hit & (t + 1 < T)).tolist())      # the step's one host sync
    model.train(was_training)
    return Rollout.from_lengths(prompts, G, pad_token_id, response, logprobs, lengths, truncated,
                                kept)


class Slots:
    """sample_groups' batch: the n decoding rows in slots [0, n) of the cache (a finished row
    leaves, the last rows move into its slot), each step's HF forward over those n rows and the
    first L columns in use. Slot i's row writes its token t at column P + t (its prompt,
    left-padded, at [0, P)), and sees only the columns of its own prompt and tokens (attn), so what
    an earlier row left in the slot is never read."""

    def __init__(self, model, cache, ids, pmask, G: int, S: int, T: int):
        self.model, self.cache, self.ids, self.pmask = model, cache, ids, pmask
        self.G, self.S = G, S
        device, self.P = ids.device, ids.shape[1]
        self.plen = pmask.sum(-1)                                            # [B] prompt lengths
        self.kw = {kv_cache.cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
        self.attn = torch.zeros(S, self.P + T, dtype=torch.long,
                                device=device)  # [S, P + T] the columns each slot sees
        self.rows = torch.zeros(0, dtype=torch.long, device=device)  # [n] the row in each slot
        self.t = torch.zeros_like(self.rows)                             # [n] tokens it has sampled
        self.logits = None                                               # [n, V] the next tokens'
        self.born, self.step = [], 0                # born: the step each slot's row came in

    def free(self) -> int:
        return self.S - self.rows.shape[0]

    def admit(self, g: slice) -> None:
        """Prompts g (whole groups) prefilled once each into the next k*G slots."""
        n, G, k = self.rows.shape[0], self.G, g.stop - g.start
        new = kv_cache.prefill_into(self.model, self.cache, self.ids[g], self.pmask[g], n,
                                    G)  # [k, V]
        self.attn[n:n + k * G] = torch.nn.functional.pad(
            self.pmask[g], (0, self.attn.shape[1] - self.P)).repeat_interleave(G, 0)
        self.rows = torch.cat([self.rows, torch.arange(g.start * G, g.stop * G,
                                                       device=self.rows.device)])
        self.t = torch.cat([self.t, self.t.new_zeros(k * G)])
        self.born += [self.step] * (k * G)
        new = new.repeat_interleave(G, 0)                                     # [k*G, V]
        self.logits = new if self.logits is None else torch.cat([self.logits, new])

    def active(self):
        return self.rows, self.t, self.logits

    def advance(self, tok: torch.Tensor, keep: list[bool]) -> None:
        """Rows where keep is False leave; the others' tokens tok [n] go through one forward."""
        self.t, self.step = self.t + 1, self.step + 1
        if not all(keep):    # finished rows leave: the last kept rows move into their slots
            n = sum(keep)
            holes = [i for i in range(n) if not keep[i]]
            movers = [i for i in range(n, len(keep)) if keep[i]]         # as many as holes
            order = list(range(n))
            for h, m in zip(holes, movers):
                order[h] = m
            if movers:
                src, dst = (torch.tensor(x, device=tok.device) for x in (movers, holes))
                for layer in self.cache.layers:
                    layer.move_rows(src, dst)
                self.attn[dst] = self.attn[src]
            idx = torch.tensor(order, dtype=torch.long, device=tok.device)    # [n]
            self.rows, self.t, tok = self.rows[idx], self.t[idx], tok[idx]
            self.born, self.logits = [self.born[i] for i in order], self.logits[:0]
        n = self.rows.shape[0]
        if n == 0:
            return
        at = self.P + self.t - 1                            # [n] the column of each row's new token
        self.attn[torch.arange(n, device=tok.device), at] = 1
        L = self.P + self.step - min(self.born)           # columns in use: the oldest row's
        for layer in self.cache.layers:
            layer.at, layer.seen = at, L - 1                       # write at `at`, attend to [0, L)
        pos = self.plen[self.rows // self.G] + self.t - 1         # [n] from the prompt's 1st token
        self.logits = self.model(input_ids=tok[:, None], attention_mask=self.attn[:n, :L],
                                 position_ids=pos[:, None], **self.kw).logits[:, -1]  # [n, V]
