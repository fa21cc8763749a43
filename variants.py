"""The GRPO-family objectives as diffs on grpo.ppo_loss, the surrogate of grpo.policy_loss.

Each is a small switch beside the article's GRPO loss ("GRPO Loss", "Step 4: PPO Loss 计算"),
written as plainly as `grpo.ppo_loss`, with its inputs (logp, old_logp, advantages, mask, weights;
weights from grpo.token_weights: the reduction and its global denominators, so micro-batches and
DDP ranks add up to the full-batch loss), ending like it in (per_token * weights).sum() and
returning (loss to minimise, metrics). grpo.policy_loss adds beta * KL (grpo.kl_term) to whichever
--loss runs.

- GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per response,
  s_i = exp(mean_t (logp - old_logp)), clipped per response with tiny bounds (paper: 3e-4 / 4e-4):
  `gspo_loss`. (The paper's GSPO-token, for per-token advantages, has GSPO's value and gradient
  with one advantage per response, which is all this project computes: not kept as a second name.)
- CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio)) * A * logp, so a clipped token keeps
  its gradient (only its weight is bounded): `cispo_loss`.
- DPPO (arXiv 2602.04879): the trust region on the probability difference pi - pi_old, not on
  the ratio (`dppo_loss`). SAPO (arXiv 2511.20347): a soft sigmoid gate on the ratio instead of a
  clip (`sapo_loss`).
- Entropy bonus: the mean entropy of the policy's next-token distribution, to subtract with a
  coefficient: `token_entropy` (logprobs.token_entropy: differentiable, block by block) and
  `entropy_bonus`.
- Rollout/train mismatch (Yao et al. 2025, "On the Rollout-Training Mismatch in Modern RL Systems"):
  the mismatch metrics (`mismatch_metrics`); the corrections that weight the surrogate for it
  (truncated importance sampling and its family) are correction.py's.

Shapes: N responses, T response tokens, V vocabulary; masks are 1.0 on valid response tokens.
"""
from __future__ import annotations

import torch

import grpo
from logprobs import token_entropy  # noqa: F401  (the bonus's entropy: differentiable, in blocks)

GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4  # GSPO paper, Sec. 5.1
# no lower bound (MiniMax-M1); the ratio capped at 5 (ScaleRL, arXiv 2510.13786)
CISPO_EPS_LOW, CISPO_EPS_HIGH = 1.0, 4.0
# DPPO-Binary-TV: the probability band (verl's dppo_tv default clip range) and the ratio's cap
# (verl's clip_ratio_c)
DPPO_DELTA, DPPO_RATIO_CAP = 0.2, 20.0
SAPO_TAU_POS, SAPO_TAU_NEG = 1.0, 1.05  # TRL's defaults: a sharper gate for A < 0, as the paper




def _seq_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log s_i, the mean over a response's valid tokens of logp - old_logp: [N, 1]."""
    lengths = mask.sum(-1, keepdim=True).clamp_min(1.0)                       # [N, 1]
    return ((logp - old_logp) * mask).sum(-1, keepdim=True) / lengths         # [N, 1]


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO's objective to minimise (arXiv 2507.18071), and its metrics.

    Per response: -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i), with the
    length-normalised sequence ratio s_i = (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean over
    valid tokens of (logp - old_logp)), spread over the response's tokens and weighted by `weights`
    (grpo.token_weights): "sequence" is the paper's (1/G) sum_i; "token" and "constant" weight each
    response's loss by its length, as verl's loss_agg_mode does.
    Inputs [N, T] except advantages [N].
    """
    adv = grpo.advantage_column(advantages, mask).to(logp.dtype)            # [N, 1]
    mask = mask.to(logp.dtype)                                                # [N, T]
    log_s = _seq_log_ratio(logp, old_logp, mask)                              # [N, 1]
    s = torch.exp(log_s.clamp(-grpo.LOG_RATIO_CLAMP, grpo.LOG_RATIO_CLAMP))   # [N, 1]
    per_seq, low, high = grpo.clipped_surrogate(s, adv, eps_low, eps_high)    # [N, 1] each
    per_token = per_seq.expand_as(mask)                                       # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        metrics = grpo.clip_metrics(s, low, high, mask)
    return loss, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = CISPO_EPS_LOW,
    eps_high: float = CISPO_EPS_HIGH,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO's objective to minimise (MiniMax-M1, arXiv 2506.13585), and its metrics.

    Per token: -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp, ratio = exp(logp - old_logp).
    Unlike PPO's clip, which drops the gradient of a clipped token, here every token keeps the
    gradient of its log-prob and only the weight is bounded. The bounds are verl's
    (1 - eps_low, 1 + eps_high); TRL caps the ratio at epsilon_high itself (an absolute cap: TRL's 5
    is eps_high = 4 here). The defaults follow the papers: no lower bound (eps_low = 1), ratio at
    most 5. MiniMax-M1 reduces with weights "token" (the sum over all tokens / their number). Inputs
    [N, T] except advantages [N] or [N, T]. clip/low_frac and clip/high_frac count tokens whose
    weight was bounded (they still get a gradient).
    """
    adv = grpo.advantage_column(advantages, mask, True).to(logp.dtype)  # [N, 1] or [N, T]
    mask = mask.to(logp.dtype)                                                # [N, T]
    log_ratio = (logp - old_logp).detach()                                    # [N, T], no gradient
    ratio = torch.exp(log_ratio.clamp(-grpo.LOG_RATIO_CLAMP, grpo.LOG_RATIO_CLAMP))  # [N, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)                      # [N, T] sg(clip)
    per_token = -clipped * adv * logp                                         # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        metrics = grpo.clip_metrics(ratio, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high, mask)
    return loss, metrics


def dppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = DPPO_DELTA,
    eps_high: float = DPPO_DELTA,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV's objective to minimise ("Rethinking the Trust Region in LLM RL", arXiv
    2602.04879; prime-rl's default, verl's dppo_tv), and its metrics.

    The trust region is on the probability, not the ratio: a token whose probability has moved
    past pi_old + eps_high (A > 0) or below pi_old - eps_low (A < 0) is masked; the others carry
    -A * sg(min(ratio, DPPO_RATIO_CAP)) * logp, whose gradient is PPO's unclipped -A * grad(ratio).
    A rare token's ratio may grow far while its probability stays within the band, which PPO's
    ratio clip would stop. Inputs [N, T] except advantages [N] or [N, T]; clip/high_frac and
    clip/low_frac count the masked tokens with A > 0 and A < 0.
    """
    adv = grpo.advantage_column(advantages, mask, True).to(logp.dtype)  # [N, 1] or [N, T]
    mask = mask.to(logp.dtype)                                                # [N, T]
    log_ratio = (logp - old_logp).detach()                                    # [N, T]
    ratio = torch.exp(log_ratio.clamp(-grpo.LOG_RATIO_CLAMP, grpo.LOG_RATIO_CLAMP))  # [N, T]
    diff = torch.exp(logp.detach()) - torch.exp(old_logp)                     # [N, T] p - p_old
    high = (adv > 0) & (diff > eps_high)                                      # [N, T]
    low = (adv <= 0) & (diff < -eps_low)
    keep = (~(high | low)).to(logp.dtype)                                     # [N, T]
    per_token = -adv * ratio.clamp(max=DPPO_RATIO_CAP) * logp * keep         # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        metrics = grpo.clip_metrics(ratio, low, high, mask)
    return loss, metrics


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    eps_low: float = 0.0,
    eps_high: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO's objective to minimise (Soft Adaptive Policy Optimization, arXiv 2511.20347), and its
    metrics.

    No clip: each token's ratio passes a soft gate, -A * f(ratio), f(r) = sigmoid(tau (r - 1)) *
    4 / tau, tau = SAPO_TAU_POS for A > 0 and SAPO_TAU_NEG otherwise. f'(1) = 1, so on-policy the
    gradient is the policy gradient; as r leaves 1 the gradient fades smoothly instead of
    stopping at a boundary. eps_low / eps_high are not read (the loss has no clip range).
    clip/low_frac and clip/high_frac stay 0.
    """
    adv = grpo.advantage_column(advantages, mask, True).to(logp.dtype)  # [N, 1] or [N, T]
    mask = mask.to(logp.dtype)                                                # [N, T]
    log_ratio = (logp - old_logp).clamp(-grpo.LOG_RATIO_CLAMP, grpo.LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)                                              # [N, T]
    tau = torch.where(adv > 0, SAPO_TAU_POS, SAPO_TAU_NEG).to(logp.dtype)     # [N, 1] or [N, T]
    per_token = -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)       # [N, T]
    loss = (per_token * weights).sum()
    with torch.no_grad():
        zero = torch.zeros_like(mask, dtype=torch.bool)
        metrics = grpo.clip_metrics(ratio.detach(), zero, zero, mask)
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The entropy term to subtract from the loss (loss - coef * bonus), and its metric.

    entropy [N, T]: per-token entropy of the policy's next-token distribution, differentiable
    (`token_entropy`). The bonus is (entropy * weights).sum() with the policy loss's weights
    (grpo.token_weights), so the bonus of micro-batches and ranks adds up like the loss. A positive
    coefficient pushes entropy up.
    """
    bonus = (entropy * weights).sum()
    with torch.no_grad():
        m = mask.to(entropy.dtype)                                            # [N, T]
        metrics = {"entropy": float((entropy * m).sum() / m.sum().clamp_min(1.0))}
    return bonus, metrics


@torch.no_grad()
def mismatch_metrics(old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's log-probs are from the training forward's, over valid tokens.

    mismatch/logp_abs_mean and mismatch/logp_abs_max: mean and max |old_logp - sampler_logp|;
    mismatch/kl: the k3 estimate of KL(pi_sampler || pi_old) (the tokens were drawn by the sampler).
    Inputs [N, T]; all 0 when no token is valid.
    """
    # float64: in float32 the k3 of a 1e-7 gap underflows
    old_logp, sampler_logp = old_logp.double(), sampler_logp.double()        # [N, T] each
    m, zero = mask.bool(), torch.zeros_like(old_logp)                         # [N, T] each
    valid = m.sum().clamp_min(1)
    delta = torch.where(m, (old_logp - sampler_logp).abs(), zero)             # [N, T]; padding: any
    k3 = torch.where(m, grpo.kl_k3(sampler_logp, old_logp), zero)            # [N, T]
    return {"mismatch/logp_abs_mean": float(delta.sum() / valid),
            "mismatch/logp_abs_max": float(delta.max()) if delta.numel() else 0.0,
            "mismatch/kl": float(k3.sum() / valid)}
