"""Rollouts: G sampled answers per prompt, decoded with the Hugging Face KV cache.

Article section: "Step 1: Rollout 采样" (one prompt, G = 4 answers from the old policy) and
"Rollout 与 Advantage 计算" (B prompts x G answers -> [B*G, T_resp]).

`sample_groups` does not call `model.generate`: it prefills each prompt once, repeats the prompt's KV
cache for its G samples, and decodes token by token, dropping finished rows from the batch and the cache
so they stop costing compute. Prompts of different lengths are left-padded with position ids counted
from each prompt's first real token. Sampling is inverse-CDF (cumsum + searchsorted) on uniforms drawn up
front, one generator per prompt if a list is given, so a prompt's samples depend only on its own seed,
never on which other prompts share the batch (this is what makes 1 rank and N ranks draw the same).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache


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

    def select_groups(self, keep: torch.Tensor) -> "Rollout":
        """The rollout restricted to the groups where keep [B] is True."""
        rows = keep.to(torch.bool).repeat_interleave(self.G)                  # [N]
        return replace(
            self, prompts=[p for p, k in zip(self.prompts, keep.tolist()) if k],
            response_ids=self.response_ids[rows], mask=self.mask[rows], lengths=self.lengths[rows],
            truncated=self.truncated[rows], logprobs=self.logprobs[rows],
            extra={k: v[rows] for k, v in self.extra.items()})

    @staticmethod
    def cat(rollouts: list["Rollout"]) -> "Rollout":
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


def sample_token(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float):
    """One token per row from logits [n, V] given uniforms u [n]; returns (tokens [n], logprobs [n]).

    The log-prob is that of the tempered distribution softmax(logits / temperature) (before top-p), the
    distribution train.py recomputes; temperature 0 is greedy and reports the plain log-softmax.
    """
    logits = logits.float()
    if temperature == 0:
        tok = logits.argmax(-1)                                               # [n]
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)                    # [n, V]
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)                 # [n, V]
        before = sorted_p.cumsum(-1) - sorted_p                               # mass strictly ahead of each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)                 # keeps at least the top token
        cdf = sorted_p.cumsum(-1)                                             # [n, V]
        idx = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1])[:, None]).clamp_max(cdf.shape[-1] - 1)
        tok = order.gather(-1, idx).squeeze(-1)                               # [n]
    else:
        cdf = probs.cumsum(-1)                                                # [n, V]
        tok = torch.searchsorted(cdf, (u.to(cdf) * cdf[:, -1])[:, None]).clamp_max(cdf.shape[-1] - 1).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], G: int, max_new_tokens: int, eos_token_id: int,
                  pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, generator=None) -> Rollout:
    """Sample G responses for each prompt (token-id lists of any lengths) with the KV cache -> Rollout."""
    if G < 1 or max_new_tokens < 1:
        raise ValueError(f"need G >= 1 and max_new_tokens >= 1, got G={G}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    B, N, T = len(prompts), len(prompts) * G, max_new_tokens
    u = _uniforms(B, G, T, generator).to(device)                              # [N, T]
    response = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, T, device=device)
    lengths = torch.full((N,), T, dtype=torch.long, device=device)
    truncated = torch.ones(N, dtype=torch.bool, device=device)
    if B == 0:
        return _finish(prompts, G, pad_token_id, response, logprobs, lengths, truncated)

    was_training = model.training
    model.eval()
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (P - len(p)) + list(p) for p in prompts], device=device)  # [B, P]
    attn = (torch.arange(P, device=device)[None, :] >= torch.tensor([P - len(p) for p in prompts], device=device)[:, None]).long()  # [B, P]
    pos = (attn.cumsum(-1) - 1).clamp_min(0)                                  # [B, P]
    cache = DynamicCache()
    kw = {_cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, **kw).logits[:, -1]  # [B, V]: one prefill per prompt
    cache.batch_repeat_interleave(G)                                          # prompt KV shared by its G rows
    logits = logits.repeat_interleave(G, dim=0)                               # [N, V]
    attn = attn.repeat_interleave(G, dim=0)                                   # [N, P]
    next_pos = attn.sum(-1)                                                   # [N]
    active = torch.arange(N, device=device)                                   # rows still decoding

    for t in range(T):
        tok, lp = sample_token(logits, u[active, t], temperature, top_p)      # [n], [n]
        response[active, t] = tok
        logprobs[active, t] = lp
        done = tok == eos_token_id                                            # [n]
        lengths[active[done]] = t + 1
        truncated[active[done]] = False
        if t == T - 1 or bool(done.all()):
            break
        if bool(done.any()):                                                  # compact: finished rows leave
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)     # [n, P + t + 1]
        logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
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
