"""GRPO's math as pure tensor functions: group advantages, the clipped surrogate, KL to a reference.

Article sections: "GRPO 推导" (group z-score instead of a critic), "GRPO Loss" (the clipped
surrogate plus a KL penalty), "Step 3: Advantage 估计" and "Step 4: PPO Loss 计算" (the worked
numbers). Step 4 is `policy_loss` = surrogate + beta * KL (`ppo_loss`, `kl_term`), the function
update.py runs; every term is (per_token * weights).sum() with the weights of `token_weights`.
`python grpo.py` prints the article's G = 4 example worked through these functions, step by step
(`article_example`, at the bottom).

Two places where this file follows the papers rather than the article's snippets:
- KL: the article writes `beta * (exp(new - ref) - 1)`, which is not a KL estimate (it is negative
  whenever the policy gives a token less mass than the reference). DeepSeekMath (Eq. 4) uses
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
# infra/variants.py
Surrogate = Callable[..., tuple[torch.Tensor, dict[str, float]]]
Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # kl_k1, kl_k2, kl_k3


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> torch.Tensor:
    """Advantages from rewards [B, G] -> [B, G] (the article's Step 3).

    scale="group": (r - mean_g) / (std_g + eps), std Bessel-corrected as torch.std (DeepSeekMath);
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
    file and of infra/variants.py is `(per_token * weights).sum()`, zero on padding.
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
    Inputs [N, T] except advantages [N]; mask is 1.0 on valid response tokens (for the metrics).
    """
    adv = advantages.to(logp.dtype)[:, None]                                # [N, 1]
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
    DAPO) or an objective of infra/variants.py (--loss), its clip range bound by the caller
    (functools.partial). weights [N, T]: `token_weights` (the reduction and its global
    denominators), shared by both terms; is_weights [N, T] (optional, detached: the rollout
    correction of infra/correction.py) multiply the surrogate's, not the KL's. The KL term
    (`kl_term`, estimator `kl`) is added when ref_logp is given; beta != 0 needs it. Inputs
    [N, T] except advantages [N] (or [N, T] where the surrogate takes per-token advantages).
    """
    pg_weights = weights if is_weights is None else weights * is_weights.detach()  # [N, T]
    loss, metrics = surrogate(logp, old_logp, advantages, mask, pg_weights)
    if ref_logp is None:
        if beta != 0.0:
            raise ValueError("beta != 0 needs ref_logp")
        return loss, metrics
    kl_loss, kl_metrics = kl_term(logp, ref_logp, mask, weights, kl)
    return loss + beta * kl_loss, {**metrics, **kl_metrics}



# ---- The article's worked example, printed (`python grpo.py`) ----

def article_example() -> list[str]:
    """The article's G = 4 group ("GRPO 训练过程拆解", "单 Prompt 数值示例"), one line per quantity.

    Each line is "article step | quantity | values [| where the article differs]", every value
    computed by the functions train.py and update.py run (verifier.verify, group_advantages,
    constant_groups, token_weights, clipped_surrogate, ppo_loss, kl_k3, kl_term, policy_loss). The
    article gives no token lengths, ratios or reference probabilities for its four answers, so those
    are chosen here: one ratio and one pi_ref / pi_theta per response, on each of its tokens.
    """
    import verifier  # here, not at the top: grpo.py itself needs only torch

    f64 = torch.float64
    vals = lambda t: " ".join(  # noqa: E731
        f"{float(x):.4f}" for x in torch.as_tensor(t).detach().flatten())
    s1, s2, s3, s4 = ("Step 1: Rollout 采样", "Step 2: Reward 计算", "Step 3: Advantage 估计",
                      "Step 4: PPO Loss 计算")
    ch, tl, ds = "Clip-Higher", "Token-Level Loss", "Dynamic Sampling"
    responses = ["2x = 13 - 5 = 8, so x = 8 / 2 = \\boxed{4}", "x = 4",
                 "Subtract 5: 2x = 8. Divide by 2: x = 4. The answer is 4.",
                 "2x = 13 + 5 = 18, x = \\boxed{9}"]
    lengths = torch.tensor([3, 2, 4, 6])                                    # [G] |o_i|, chosen
    G, T = len(responses), int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).to(f64)               # [G, T]
    rewards = torch.tensor([[verifier.verify(o, "4") for o in responses]])  # [1, G]
    pm1 = -1.0 + 2.0 * rewards       # train.py's rewards at --wrong-reward -1: [1, G]
    adv = group_advantages(rewards)[0].to(f64)                              # [G]
    rho = torch.tensor([1.10, 1.04, 1.25, 0.90], dtype=f64)                 # [G], chosen
    r_ref = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=f64)                   # [G] pi_ref / pi_theta
    logp = (rho.log()[:, None] * mask).requires_grad_()                     # [G, T], old = 0
    old, ref = torch.zeros_like(mask), (logp + r_ref.log()[:, None] * mask).detach()  # [G, T]
    w = {k: token_weights(mask, k, max_len=T) for k in REDUCTIONS}          # [G, T] each
    surr = lambda k, eps_high=0.2: ppo_loss(  # noqa: E731
        logp, old, adv, mask, w[k], 0.2, eps_high)[0]
    per_resp, _, high = clipped_surrogate(rho, adv, 0.2, 0.2)               # [G] each
    surr("sequence").backward()                                             # logp.grad [G, T]
    kl = kl_k3(logp, ref)[:, 0]                                             # [G]
    kl_mean = kl_term(logp, ref, mask, w["sequence"])[0]
    total = policy_loss(logp, old, adv, mask, w["sequence"], ref_logp=ref, beta=0.04)[0]
    rows = [
        (s1, "prompt", "求解方程：2x + 5 = 13 (answer 4), G = 4 responses"),
        *((s1, f"o_{i + 1}", o) for i, o in enumerate(responses)),
        (s1, "|o_i|, tokens (chosen: the article gives none)",
         " ".join(map(str, lengths.tolist()))),
        (s2, 'r_i = verifier.verify(o_i, "4")', vals(rewards)),
        (s2, "r_i with DAPO's -1 for a wrong answer (--wrong-reward -1)", vals(pm1)),
        (s3, "mean(r)", vals(rewards.mean())),
        (s3, "std(r), Bessel (/ (G - 1)), as torch.std", vals(rewards.std()),
         f"article's hand formula divides by G: {float(rewards.std(correction=0)):.4f}; "
         "its advantages use 0.5"),
        (s3, "A_i = grpo.group_advantages(r)", vals(adv)),
        (s3, "A_i of the -1 rewards (a z-score: the same)", vals(group_advantages(pm1))),
        (s4, "rho_i = pi_theta / pi_old, one per response (chosen)", vals(rho)),
        (s4, "clip(rho_i, 1 - eps, 1 + eps), eps 0.2", vals(rho.clamp(0.8, 1.2)),
         'article (单 Prompt 数值示例): o_3 "被 clip 到 1.15"; eps 0.2 clips it to 1.2'),
        (s4, "clipped above 1 + eps, no gradient (grpo.clipped_surrogate)", vals(high)),
        (s4, "-min(rho_i A_i, clip(rho_i) A_i), eps 0.2", vals(per_resp)),
        (s4, "each token's weight, GRPO: 1 / (G |o_i|) (grpo.token_weights)",
         vals(w["sequence"][:, 0])),
        (s4, "surrogate, GRPO (--reduction sequence)", vals(surr("sequence"))),
        (s4, "surrogate, the article's .sum() / (B * G * T_resp) (--reduction constant)",
         vals(surr("constant")), 'article: "Token-level loss (DAPO: 全局平均)"; it is Dr. '
         "GRPO's constant normaliser, and Step 4's .mean() counts padding too"),
        (s4, "pi_ref / pi_theta, one per response (chosen)", vals(r_ref)),
        (s4, "KL k3 = pi_ref / pi - log(pi_ref / pi) - 1 (grpo.kl_k3)", vals(kl)),
        (s4, "the article's KL, exp(new - ref) - 1", vals(1.0 / r_ref - 1.0),
         "negative for o_3: not a KL estimate (Step 4's snippet drops the - 1)"),
        (s4, "KL, GRPO's mean (grpo.kl_term)", vals(kl_mean)),
        (s4, "loss = surrogate + 0.04 * KL (grpo.policy_loss)", vals(total)),
        (s4, "训练效果: d surrogate / d log pi(o_i), summed over o_i's tokens",
         vals(logp.grad.sum(-1)), "descent raises o_1, o_2, lowers o_4; clipped o_3: no push"),
        (ch, "-min(rho_i A_i, clip(rho_i) A_i), eps_low 0.2, eps_high 0.28",
         vals(clipped_surrogate(rho, adv, 0.2, 0.28)[0])),
        (tl, "each token's weight, DAPO: 1 / sum |o_i|", vals(w["token"][:, 0])),
        (tl, "surrogate, eps 0.2 (--reduction token)", vals(surr("token"))),
        (tl, "surrogate, eps_high 0.28 (DAPO's loss)", vals(surr("token", 0.28))),
        (ds, "all right or all wrong? (grpo.constant_groups = ~dapo.keep_groups)",
         vals(constant_groups(rewards))),
        (ds, "A_i of an all-right group", vals(group_advantages(torch.ones(1, G))),
         "no gradient: dropped, and more prompts drawn to refill the batch"),
    ]
    return [" | ".join(row) for row in rows]


if __name__ == "__main__":
    print("\n".join(article_example()))
