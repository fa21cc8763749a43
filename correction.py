"""Rollout correction: the tokens were drawn by the sampler, the loss treats pi_old as the
behaviour policy.

Not an article section: the article samples and trains with one model, so pi_sampler = pi_old. With
another engine's kernels (--rollout vllm), or bf16 on one side, they differ token by token
(mismatch/* measures it), and the surrogate's gradient is off-policy by the ratio
w = pi_old / pi_sampler. These weights multiply each token's surrogate weight
(grpo.policy_loss(is_weights=...), never the KL's), as the anchors do:

- `is_weights` (--tis-cap C with --is-level, --is-mode, --is-low): the ratio per token
  (log w_t = old_logp_t - sampler_logp_t), or one per sequence, the product over its tokens
  (exp sum_t log w_t, TRL's sequence modes) or their geometric mean (exp mean_t log w_t, verl's
  "geometric"), broadcast over its tokens. Then:
    truncate  min(w, C), and max(w, low) with --is-low (TIS, Yao et al. 2025; TRL's *_truncate with
              vllm_importance_sampling_clip_min / _max, verl's rollout_is="token"/"sequence")
    mask      w where low <= w <= C, else 0 (TRL's *_mask; IcePop, Ring-1T: token level,
              [alpha, beta] = [0.5, 5])
    reject    1 where low <= w <= C, else 0 (verl's rejection sampling, rollout_rs: the response
              or token dropped, the rest unweighted)
- `off_policy_mask` (--off-policy-mask delta, DeepSeek-V3.2's Off-Policy Sequence Masking, TRL's
  off_policy_mask_threshold): a response with a negative advantage whose mean over its tokens of
  sampler_logp - logp (the KL from the sampler to the current policy) exceeds delta is dropped
  from the surrogate; kept otherwise.

Each returns its [N, T] weights (0 on padding) and the share it acted on: of the valid tokens for
`is_weights` (is/corrected_frac), of the responses for `off_policy_mask` (offpolicy/masked_frac).

- `nucleus_sizes` (--top-p < 1 with --rollout vllm): DeepSeek-V3.2's Keep Sampling Mask, as
  sizes. sampler.py records the nucleus each token was drawn from (Rollout.kept) and the trainer's
  log-probs are under it; vLLM returns the token's log-prob under its nucleus
  ("processed_logprobs") but not the nucleus. So the policy that sampled (the trainer's copy of
  pi_old) finds it once per step before the update: the smallest set of most probable tokens whose
  mass reaches top-p, widened to hold the token drawn. Where the two engines' kernels put the edge
  of the nucleus differently, the set is ours, not vLLM's; the ratio to the engine's log-prob
  (mismatch/*, --tis-cap) carries that.
"""
from __future__ import annotations

import torch

import logprobs
from infra import lm_head

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "reject")


@torch.no_grad()
def log_ratio(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
              level: str = "token") -> torch.Tensor:
    """log w: [N, T] per token, or [N, 1] per sequence (the sum, or the mean, over valid
    tokens)."""
    m = mask.to(old_logp.dtype)                                               # [N, T]
    log_w = (old_logp - sampler_logp) * m                                     # [N, T]
    if level == "token":
        return log_w
    if level == "sequence":
        return log_w.sum(-1, keepdim=True)                                    # [N, 1]
    if level == "geometric":
        return log_w.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
    raise ValueError(f"unknown importance-sampling level {level!r} (one of {LEVELS})")


@torch.no_grad()
def is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
               cap: float, level: str = "token", mode: str = "truncate",
               low: float = 0.0) -> tuple[torch.Tensor, float]:
    """(weights [N, T], share of valid tokens whose w lies outside [low, cap]: truncated, masked
    or rejected) for the rollout correction above, detached; 0 on padding. w = 1 where sampler
    and trainer agree."""
    if not cap > 0 or not 0 <= low < cap:
        raise ValueError(f"the bounds need 0 <= low < cap, got low {low}, cap {cap}")
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r} (one of {MODES})")
    valid = mask.bool()                                                       # [N, T]
    w = torch.exp(log_ratio(old_logp, sampler_logp, mask, level)).expand_as(old_logp)
    inside = (w <= cap) & (w >= low)                                          # [N, T]
    if mode == "truncate":
        out = w.clamp(min=low, max=cap)
    elif mode == "mask":
        out = torch.where(inside, w, torch.zeros_like(w))
    else:                                                                     # reject
        out = inside.to(w.dtype)
    out = torch.where(valid, out, torch.zeros_like(out))                      # [N, T]
    return out, float((valid & ~inside).sum()) / max(int(valid.sum()), 1)


@torch.no_grad()
def off_policy_mask(logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, delta: float) -> tuple[torch.Tensor, float]:
    """(keep [N, T], share of responses with a valid token that are dropped): DeepSeek-V3.2's
    mask, 0 on the tokens of a response with advantage < 0 and
    mean_t (sampler_logp - logp) > delta (logp: the current policy's, detached), 1 elsewhere on
    valid tokens. advantages [N] (or [N, T]: a response's first column decides)."""
    m = mask.to(logp.dtype)                                                   # [N, T]
    n = m.sum(-1)                                                             # [N]
    kl = ((sampler_logp - logp.detach()) * m).sum(-1) / n.clamp_min(1.0)      # [N]
    adv = advantages if advantages.dim() == 1 else advantages[:, 0]           # [N]
    drop = (adv < 0) & (kl > delta) & (n > 0)                                 # [N]
    keep = m * (~drop).to(m.dtype)[:, None]                                   # [N, T]
    return keep, float(drop.sum()) / max(int((n > 0).sum()), 1)


@torch.no_grad()
def nucleus_sizes(model, roll, slices: list[slice], temperature: float,
                  top_p: float) -> torch.Tensor:
    """Rollout.kept for an engine's rollout: [N, T] long, each token's nucleus at top_p under
    `model` (0 past the responses), from one no-grad forward per slice (each response after its own
    prompt); the output layer yields sizes, not logits (lm_head.sizes_head), where it is fusable."""
    dev = next(model.parameters()).device
    kept = torch.zeros(roll.response_ids.shape, dtype=torch.long, device=dev)  # [N, T_all]
    fused = lm_head.fusable(model) is None
    for s in slices:
        ids, attn, pos, resp = logprobs.own_prompt_inputs(roll, s.start, s.stop, dev)  # [n, T]
        T = resp.shape[1]
        run = dict(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                   logits_to_keep=T + 1)
        if fused:
            with lm_head.sizes_head(model, torch.nn.functional.pad(resp, (0, 1)), temperature,
                                    top_p):
                k = model(**run).logits[:, :-1, 0]                            # [n, T]
        else:
            z = model(**run).logits[:, :-1]                                   # [n, T, V]
            k = torch.stack([lm_head.nucleus_size(torch.log_softmax(z[i].float() / temperature, -1),
                                                  resp[i], top_p) for i in range(len(resp))])
        kept[s, :T] = k.long() * roll.mask[s, :T].to(dev).long()
    return kept
