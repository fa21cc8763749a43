"""GRPO's math as pure tensor functions: group advantages, the clipped surrogate, KL to the reference.

Article sections: "GRPO 推导" (group z-score instead of a critic), "GRPO Loss" (the clipped surrogate
plus a KL penalty), "Step 3: Advantage 估计" and "Step 4: PPO Loss 计算" (the worked numbers).

Two places where this file follows the papers rather than the article's snippets:
- KL: the article writes `beta * (exp(new - ref) - 1)`, which is not a KL estimate (it is negative
  whenever the policy gives a token less mass than the reference). DeepSeekMath (Eq. 4) uses Schulman's
  unbiased, always non-negative "k3" estimator exp(ref - logp) - (ref - logp) - 1: `kl_k3`.
- Token mean: the article's `.sum() / (B * G * T_resp)` divides by padding too. Here every reduction
  counts only valid tokens, from a mask built from response lengths: `policy_loss(reduction=...)`.

Shapes: N = B * G responses (a prompt's G samples are contiguous), T response tokens, V vocabulary.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> torch.Tensor:
    """Advantages from rewards [B, G] -> [B, G] (the article's Step 3).

    scale="group": (r - mean_g) / (std_g + eps), std Bessel-corrected as torch.std (DeepSeekMath);
    scale="batch": the same with the std of the whole batch, or batch_std if given (the batch spread over
    ranks: train.py passes the std of all ranks' rewards); scale="none": r - mean_g (Dr. GRPO).
    A group whose rewards are all equal gets exactly zero advantages (never NaN, never a float leftover
    inflated by a tiny std).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)                  # [B, G]
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(centred[:, :1])
        adv = centred / (std + eps)                                         # [B, G]
    elif scale == "batch":
        std = rewards.new_tensor(batch_std) if batch_std is not None else \
            rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        adv = centred / (std + eps)                                         # [B, G]
    elif scale == "none":
        adv = centred                                                       # [B, G]
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return adv.masked_fill(constant_groups(rewards)[:, None], 0.0)


def constant_groups(rewards: torch.Tensor) -> torch.Tensor:
    """bool [B]: groups of rewards [B, G] whose G rewards are all equal, hence all-zero advantages."""
    return (rewards == rewards[:, :1]).all(dim=1)                             # [B]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate, k3 = exp(ref - logp) - (ref - logp) - 1 >= 0.

    Schulman, "Approximating KL divergence" (2020); DeepSeekMath Eq. 4. Unbiased for tokens sampled from
    pi_theta, zero where the two log-probs agree, and never negative (e^u >= 1 + u).
    """
    delta = ref_logp - logp                                                   # [N, T]
    return torch.exp(delta) - delta - 1.0                                     # [N, T]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    reduction: str = "sequence",
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate (+ beta * k3 KL) to minimise, and its metrics (the article's Step 4).

    Per token: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * k3, with
    ratio = exp(logp - old_logp) and A the response's advantage broadcast over its tokens.
    reduction="sequence": mean over responses of each response's token mean (GRPO, DeepSeekMath Eq. 3);
    reduction="token": sum over valid tokens / num_tokens (DAPO Eq. 8; num_tokens defaults to mask.sum()
        and is passed explicitly so gradient accumulation and DDP divide by the step's global count);
    reduction="constant": sum / (num_seqs * max_len), max_len defaulting to T (Dr. GRPO).
    num_seqs (default N) is likewise the step's global number of responses for "sequence"/"constant".
    Inputs [N, T] except advantages [N]; mask is 1.0 on valid response tokens.
    """
    if reduction not in ("sequence", "token", "constant"):
        raise ValueError(f"reduction must be 'sequence', 'token' or 'constant', got {reduction!r}")
    mask = mask.to(logp.dtype)                                                # [N, T]
    adv = advantages.to(logp.dtype)[:, None]                                  # [N, 1]
    ratio = torch.exp(logp - old_logp)                                        # [N, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)                      # [N, T]
    per_token = -torch.minimum(ratio * adv, clipped * adv)                    # [N, T]
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)  # [N, T]
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        per_token = per_token + beta * kl                                     # [N, T]

    n = logp.shape[0] if num_seqs is None else num_seqs
    if reduction == "sequence":
        seq_mean = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)   # [N]
        loss = seq_mean.sum() / n
    elif reduction == "token":
        denom = mask.sum() if num_tokens is None else num_tokens
        loss = (per_token * mask).sum() / (denom.clamp_min(1.0) if torch.is_tensor(denom) else max(denom, 1.0))
    else:
        loss = (per_token * mask).sum() / (n * (logp.shape[1] if max_len is None else max_len))

    with torch.no_grad():
        valid = mask.sum().clamp_min(1.0)
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype)          # clipped from below: no gradient
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype)        # clipped from above: no gradient
        metrics = {
            "clip/low_frac": ((low * mask).sum() / valid).item(),
            "clip/high_frac": ((high * mask).sum() / valid).item(),
            "ratio/mean": ((ratio * mask).sum() / valid).item(),
            "kl": ((kl * mask).sum() / valid).item(),
        }
    return loss, metrics
