"""GRPO's math as pure tensor functions: group advantages, the clipped surrogate, KL to a reference.

Article sections: "GRPO 推导" (group z-score instead of a critic), "GRPO Loss" (the clipped
surrogate plus a KL penalty), "Step 3: Advantage 估计" and "Step 4: PPO Loss 计算" (the worked
numbers). Step 4 is `policy_loss` = surrogate + beta * KL (`ppo_loss`, `kl_term`), the function
update.py runs; every term is (per_token * weights).sum() with the weights of `token_weights`.
`python grpo.py` prints the article's G = 4 example worked through these functions, step by step
(worked_example.py).

Two places where this file follows the papers rather than the article's snippets:
- KL: the article writes `beta * (exp(new - ref) - 1)`, which is not a KL estimate: per token it is
  pi_theta / pi_ref - 1 (negative wherever the policy gives a token less mass than the reference),
  its mean over tokens from pi_theta is chi^2(pi_theta || pi_ref) and its expected gradient half
  that of chi^2 (test_article_kl_snippet_is_half_the_gradient_of_chi2). DeepSeekMath (Eq. 4) uses
  Schulman's unbiased, always non-negative "k3" estimator exp(ref - logp) - (ref - logp) - 1:
  `kl_k3`.
- Token mean: the article's `.sum() / (B * G * T_resp)` divides by padding too. Here every
  reduction counts only valid tokens, from a mask built from response lengths: `token_weights`.

Shapes: N = B * G responses (a prompt's G samples are contiguous), T response tokens, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

LOG_RATIO_CLAMP = 20.0  # |logp - old_logp| clamped before exp (as verl does): no inf, no NaN grad
# a surrogate: (logp, old_logp, advantages, mask, weights) -> (loss, metrics); ppo_loss,
# variants.py
Surrogate = Callable[..., tuple[torch.Tensor, dict[str, float]]]
Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # kl_k1, kl_k2, kl_k3


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> torch.Tensor:
    """Advantages from rewards [B, G] -> [B, G] (the article's Step 3).

    scale="group": (r - mean_g) / (std_g + eps), std Bessel-corrected, which gives the article's
    numbers (torch.std's default, as TRL and verl compute it; DeepSeekMath's paper writes std(r) and
    released no RL code);
    scale="batch": the same with the std of the whole batch, or batch_std if given (the batch spread
    over ranks: train.py passes the std of all ranks' rewards); scale="none": r - mean_g (Dr. GRPO).
    A group whose rewards are all equal gets exactly zero advantages (never NaN, never a float
    leftover inflated by a tiny std).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)                  # [B, G]
    if scale == "group":
        none = rewards.shape[1] == 1 or rewards.numel() == 0  # G = 1, or a rank with no group
        std = torch.zeros_like(centred[:, :1]) if none else rewards.std(dim=1, keepdim=True)
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
    """bool [B]: groups of rewards [B, G] whose G rewards are all equal (all-zero advantages)."""
    return (rewards == rewards[:, :1]).all(dim=1)                           # [B]


REDUCTIONS = ("sequence", "token", "constant")  # --reduction: GRPO, DAPO Eq. 12, Dr. GRPO


def token_weights(
    mask: torch.Tensor,
    reduction: str = "sequence",
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's weight in the loss [N, T], from mask [N, T] (1.0 on valid tokens), a reduction.

    The one place where a reduction and its denominators become numbers: every objective of this
    file and of variants.py is `(per_token * weights).sum()`, zero on padding.
    "sequence" (GRPO, DeepSeekMath Eq. 3): 1 / (|o_i| * num_seqs), the mean over responses of each
        response's token mean; num_seqs defaults to the rows with at least one valid token, so
        responses masked out whole (overlong filtering) are not counted (as verl; TRL counts them);
    "token" (DAPO Eq. 12): 1 / num_tokens, num_tokens defaulting to mask.sum();
    "constant" (Dr. GRPO): 1 / (num_seqs * max_len), max_len defaulting to T.
    Passing the step's global counts (update.py: all micro-batches and ranks of an optimizer update)
    makes the micro-batches' losses and gradients add up to the full batch's.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    mask = mask if mask.is_floating_point() else mask.float()              # [N, T]
    n = (mask.sum(-1) > 0).to(mask.dtype).sum() if num_seqs is None else num_seqs
    n = n.clamp_min(1.0) if torch.is_tensor(n) else max(n, 1.0)
    if reduction == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp_min(1.0)                 # [N, 1]
        return mask * (1.0 / n / lengths)                                   # [N, T]
    if reduction == "token":
        d = mask.sum() if num_tokens is None else num_tokens
        d = d.clamp_min(1.0) if torch.is_tensor(d) else max(d, 1.0)
        return mask / d                                                     # [N, T]
    return mask / (n * (mask.shape[1] if max_len is None else max_len))    # [N, T]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate, k1 = logp - ref: [N, T], [N, T] -> [N, T].

    Schulman (2020): unbiased for tokens sampled from pi_theta but high-variance and negative for
    about half the tokens. As a loss its expected gradient is zero on-policy (the score function has
    mean 0).
    """
    return logp - ref_logp                                                    # [N, T]


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL estimate, k2 = 0.5 (logp - ref)^2 >= 0: [N, T], [N, T] -> [N, T].

    Schulman (2020): biased as a value (low variance, close for nearby policies), but as a loss its
    on-policy expected gradient is exactly the gradient of KL(pi_theta || pi_ref) (Liu et al., arXiv
    2510.01555).
    """
    return 0.5 * (logp - ref_logp) ** 2                                       # [N, T]


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate, k3 = exp(ref - logp) - (ref - logp) - 1 >= 0.

    Schulman, "Approximating KL divergence" (2020); DeepSeekMath Eq. 4. Unbiased for tokens sampled
    from pi_theta, zero where the two log-probs agree, and never negative (e^u >= 1 + u).
    """
    delta = ref_logp - logp                                                   # [N, T]
    return torch.exp(delta) - delta - 1.0                                     # [N, T]


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """PPO's clipped surrogate to minimise, -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high)
    * A), and where the clip acts (no gradient there): (per-token loss, clipped below, above).
    ratio [N, T] (or [N, 1] per response), adv broadcastable to it."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    low = (ratio < 1.0 - eps_low) & (adv < 0)                               # clipped below: no grad
    high = (ratio > 1.0 + eps_high) & (adv > 0)                             # clipped above: no grad
    return -torch.minimum(ratio * adv, clipped * adv), low, high


def clip_metrics(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """Fractions of valid tokens clipped from below / above and the mean ratio (all broadcastable
    to mask [N, T])."""
    valid = mask.sum().clamp_min(1.0)
    return {"clip/low_frac": float((low.to(mask.dtype) * mask).sum() / valid),
            "clip/high_frac": float((high.to(mask.dtype) * mask).sum() / valid),
            "ratio/mean": float((ratio * mask).sum() / valid)}


def advantage_column(advantages: torch.Tensor, mask: torch.Tensor,
                     per_token_ok: bool = False) -> torch.Tensor:
    """One advantage per response as a column [N, 1] to broadcast over its tokens, from [N] (as
    train.py passes them) or [N, 1] (the article's `adv.reshape(B * G, 1)`); with per_token_ok
    also [N, T] as it is. Any other shape is refused in one line: a [N, 1] indexed with [:, None]
    is [N, 1, 1] and broadcasts the loss to [N, N, T] without an error."""
    N = mask.shape[0]
    if advantages.shape in ((N,), (N, 1)):
        return advantages.reshape(N, 1)                                     # [N, 1]
    if per_token_ok and advantages.shape == mask.shape:
        return advantages                                                   # [N, T]
    want = "[N], [N, 1] or [N, T]" if per_token_ok else "[N] or [N, 1]"
    raise ValueError(f"advantages must be {want} for mask {tuple(mask.shape)}, "
                     f"got {tuple(advantages.shape)}")


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The article's `ppo_loss` reduced: the clipped surrogate to minimise, and its metrics.

    Per token: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), with
    ratio = exp(logp - old_logp) and A the response's advantage broadcast over its tokens; the loss
    is (per_token * weights).sum(), weights from `token_weights` (times the truncated IS weights).
    clip_c > 1: dual-clip (Ye et al. 2020) for A < 0, the per-token loss is at most -clip_c * A, so
    a huge ratio on a token the policy should avoid cannot blow the loss up (verl's default 3).
    0: off.
    The log-ratio is clamped to +-LOG_RATIO_CLAMP before exp: a stale old_logp gives no inf or NaN.
    Inputs [N, T] except advantages [N] or [N, 1] (`advantage_column`); mask is 1.0 on valid
    response tokens (for the metrics).
    """
    adv = advantage_column(advantages, mask).to(logp.dtype)                 # [N, 1]
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    ratio = torch.exp(log_ratio)                                            # [N, T]
    per_token, low, high = clipped_surrogate(ratio, adv, eps_low, eps_high)  # [N, T] each
    if clip_c:
        if clip_c <= 1.0:
            raise ValueError(f"dual-clip needs clip_c > 1, got {clip_c}")
        dual = (adv < 0) & (per_token > -clip_c * adv)                      # [N, T] at most -c * A
        per_token = torch.where(dual, -clip_c * adv, per_token)             # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        mask = mask.to(logp.dtype)                                          # [N, T]
        metrics = clip_metrics(ratio, low, high, mask)
        if clip_c:
            dual_tokens = (dual.to(mask.dtype) * mask).sum()
            metrics["clip/dual_frac"] = float(dual_tokens / mask.sum().clamp_min(1.0))
    return loss, metrics


def kl_term(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    estimator: Estimator = kl_k3,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The KL penalty KL(pi_theta || pi_ref) before its beta: (per_token * weights).sum(), metrics.

    estimator: kl_k1, kl_k2 or kl_k3 (per token [N, T], [N, T] -> [N, T]; --kl). The metric "kl" is
    always the k3 mean over valid tokens (an unbiased, non-negative estimate), whichever estimator
    the loss uses. With several updates per batch the tokens come from pi_old, not pi_theta; no
    importance ratio corrects for that here (DeepSeek-V3.2 applies one).
    """
    per_token = estimator(logp, ref_logp)                                   # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        m = mask.to(logp.dtype)                                             # [N, T]
        k3 = kl_k3(logp, ref_logp)                                          # [N, T]
        metrics = {"kl": float((k3 * m).sum() / m.sum().clamp_min(1.0))}
    return loss, metrics


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    surrogate: Surrogate = ppo_loss,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl: Estimator = kl_k3,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The article's Step 4 loss, "surrogate + beta * KL", as update.py runs it, and its metrics.

    surrogate(logp, old_logp, advantages, mask, weights) -> (loss, metrics): `ppo_loss` (GRPO,
    DAPO) or an objective of variants.py (--loss), its clip range bound by the caller
    (functools.partial). weights [N, T]: `token_weights` (the reduction and its global
    denominators), shared by both terms; is_weights [N, T] (optional, detached: the rollout
    correction of correction.py) multiply the surrogate's, not the KL's. The KL term
    (`kl_term`, estimator `kl`) is added when ref_logp is given; beta != 0 needs it. Inputs
    [N, T] except advantages: one per response, [N] or [N, 1]; `ppo_loss` refuses any other
    shape, and only a surrogate of variants.py that says so takes per-token [N, T].
    """
    pg_weights = weights if is_weights is None else weights * is_weights.detach()  # [N, T]
    loss, metrics = surrogate(logp, old_logp, advantages, mask, pg_weights)
    if ref_logp is None:
        if beta != 0.0:
            raise ValueError("beta != 0 needs ref_logp")
        return loss, metrics
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, weights, kl)
    return loss + beta * kl_loss, {**metrics, **kl_metrics}


if __name__ == "__main__":  # the article's worked example (worked_example.py)
    import worked_example

    print("\n".join(worked_example.article_example()))
