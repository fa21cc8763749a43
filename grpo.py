"""GRPO's math as pure tensor functions: group advantages, the clipped surrogate, KL to a reference.

Article sections: "GRPO 推导" (group z-score instead of a critic), "GRPO Loss" (the clipped
surrogate plus a KL penalty), "Step 3: Advantage 估计" and "Step 4: PPO Loss 计算" (the worked
numbers). Step 4 is `policy_loss` = surrogate + beta * KL (`ppo_loss`, `kl_term`), the function
update.py runs; every term is (per_token * weights).sum() with the weights of `token_weights`.
`python grpo.py` prints the article's G = 4 example worked through these functions, step by step
(`article_example`, at the bottom).

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
# infra/variants.py
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
    DAPO) or an objective of infra/variants.py (--loss), its clip range bound by the caller
    (functools.partial). weights [N, T]: `token_weights` (the reduction and its global
    denominators), shared by both terms; is_weights [N, T] (optional, detached: the rollout
    correction of infra/correction.py) multiply the surrogate's, not the KL's. The KL term
    (`kl_term`, estimator `kl`) is added when ref_logp is given; beta != 0 needs it. Inputs
    [N, T] except advantages: one per response, [N] or [N, 1]; `ppo_loss` refuses any other
    shape, and only a surrogate of infra/variants.py that says so takes per-token [N, T].
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

S1, S2, S3, S4 = ("Step 1: Rollout 采样", "Step 2: Reward 计算", "Step 3: Advantage 估计",
                  "Step 4: PPO Loss 计算")
NEXT, NUMERIC = "Step 4, the next update", "单 Prompt 数值示例"
CH, DS, TL, OL = ("Clip-Higher", "Dynamic Sampling", "Token-Level Loss",
                  "Overlong Reward Shaping")  # DAPO's fixes, in the article's order
EXAMPLE_HEADER = ("article step | quantity | o_1 o_2 o_3 o_4, one column per response (a single "
                  "value is the group's) | what the article's snippet or text says, where it "
                  "differs")
NEXT_LR = 4.0             # the next update's example: one SGD step on each token's log pi
OVERLONG = (7, 4)         # (L_max, L_cache) of the example's Eq. 13: free up to 3 tokens


def _vals(t) -> str:
    """Numbers, 4 decimals, space-separated."""
    return " ".join(f"{float(x):.4f}" for x in torch.as_tensor(t).detach().flatten())


def _yes_no(t) -> str:
    """Booleans as yes / no, space-separated."""
    return " ".join("yes" if bool(x) else "no" for x in torch.as_tensor(t).flatten())


def _example_group():
    """The G = 4 group as tensors. The article gives no token lengths, ratios or reference
    probabilities for its four answers, so those are chosen here: one ratio pi_theta / pi_old and
    one pi_ref / pi_theta per response, on each of its tokens (float64)."""
    import types

    import verifier  # here, not at the top: grpo.py itself needs only torch

    f64 = torch.float64
    responses = ["2x = 13 - 5 = 8, so x = 8 / 2 = \\boxed{4}", "x = 4",
                 "Subtract 5: 2x = 8. Divide by 2: x = 4. The answer is 4.",
                 "2x = 13 + 5 = 18, x = \\boxed{9}"]
    lengths = torch.tensor([3, 2, 4, 6])                                    # [G] |o_i|, chosen
    T = int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).to(f64)               # [G, T]
    rewards = torch.tensor([[verifier.verify(o, "4") for o in responses]])  # [1, G]
    rho = torch.tensor([1.10, 1.04, 1.25, 0.90], dtype=f64)                 # [G], chosen
    r_ref = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=f64)                   # [G] pi_ref / pi_theta
    logp = (rho.log()[:, None] * mask).requires_grad_()       # [G, T], old = 0; padding: ratio 1
    return types.SimpleNamespace(
        responses=responses, lengths=lengths, mask=mask, rewards=rewards, rho=rho, r_ref=r_ref,
        G=len(responses), T=T, pm1=-1.0 + 2.0 * rewards,  # the --wrong-reward -1 rewards [1, G]
        adv=group_advantages(rewards)[0].to(f64), logp=logp, old=torch.zeros_like(mask),  # [G]
        ref=(logp + r_ref.log()[:, None] * mask).detach(),                  # [G, T]
        w={k: token_weights(mask, k, max_len=T) for k in REDUCTIONS})       # [G, T] each


def _steps_1_to_3(ex) -> list[tuple[str, ...]]:
    """Steps 1-3: the prompt, the four answers, their rewards and advantages."""
    r = ex.rewards
    return [
        (S1, "prompt", "求解方程：2x + 5 = 13 (answer 4), G = 4 responses"),
        *((S1, f"o_{i + 1}", o) for i, o in enumerate(ex.responses)),
        (S1, "|o_i|, tokens (chosen: the article gives none)",
         " ".join(map(str, ex.lengths.tolist()))),
        (S2, 'r_i = verifier.verify(o_i, "4")', _vals(r)),
        (S2, "r_i with DAPO's -1 for a wrong answer (--wrong-reward -1)", _vals(ex.pm1)),
        (S3, "mean(r)", _vals(r.mean())),
        (S3, "std(r), Bessel (/ (G - 1)), torch.std's default", _vals(r.std()),
         f"article's hand formula divides by G: {float(r.std(correction=0)):.4f}; "
         "its advantages use 0.5"),
        (S3, "A_i = grpo.group_advantages(r)", _vals(ex.adv)),
        (S3, "A_i of the -1 rewards (a z-score: the same)", _vals(group_advantages(ex.pm1))),
    ]


def _step_4(ex) -> list[tuple[str, ...]]:
    """Step 4 at the chosen ratios: clipping, the reductions, KL, the loss and its gradient."""
    logp, old, adv, mask, w, beta = ex.logp, ex.old, ex.adv, ex.mask, ex.w, 0.04
    surr = lambda k, eps_high=0.2: ppo_loss(  # noqa: E731
        logp, old, adv, mask, w[k], 0.2, eps_high)[0]
    per_resp, _, high = clipped_surrogate(ex.rho, adv, 0.2, 0.2)            # [G] each
    surr("sequence").backward()                                             # logp.grad [G, T]
    article_kl = (logp - ex.ref).exp() - 1.0                                # [G, T] its snippet
    with torch.no_grad():  # the article's Step 4: (ppo_loss + kl_penalty).mean(), padding and all
        article = (clipped_surrogate((logp - old).exp(), adv[:, None], 0.2, 0.2)[0]
                   + beta * (logp - ex.ref).exp()).mean()
    total = policy_loss(logp, old, adv, mask, w["sequence"], ref_logp=ex.ref, beta=beta)[0]
    return [
        (S4, "rho_i = pi_theta / pi_old, one per response (chosen)", _vals(ex.rho)),
        (S4, "clip(rho_i, 1 - eps, 1 + eps), eps 0.2", _vals(ex.rho.clamp(0.8, 1.2)),
         'article (单 Prompt 数值示例): o_3 "被 clip 到 1.15"; eps 0.2 clips it to 1.2'),
        (S4, "clipped above 1 + eps? (then no gradient: grpo.clipped_surrogate)", _yes_no(high)),
        (S4, "-min(rho_i A_i, clip(rho_i) A_i), eps 0.2", _vals(per_resp)),
        (S4, "each token's weight, GRPO: 1 / (G |o_i|) (grpo.token_weights)",
         _vals(w["sequence"][:, 0])),
        (S4, "surrogate, GRPO (--reduction sequence)", _vals(surr("sequence"))),
        (S4, "surrogate, valid tokens' sum / (G * T) (--reduction constant)",
         _vals(surr("constant")), "article's .sum() / (B * G * T_resp), labelled \"Token-level "
         "loss (DAPO: 全局平均)\": Dr. GRPO's constant normaliser, not DAPO's"),
        (S4, "pi_ref / pi_theta, one per response (chosen)", _vals(ex.r_ref)),
        (S4, "KL k3 = pi_ref / pi - log(pi_ref / pi) - 1 (grpo.kl_k3)",
         _vals(kl_k3(logp, ex.ref)[:, 0]), f"article's exp(new - ref) - 1: "
         f"{_vals(article_kl[:, 0])}, negative for o_3; its mean over pi_theta is "
         "chi^2(pi_theta || pi_ref), not KL"),
        (S4, "KL, GRPO's mean (grpo.kl_term)",
         _vals(kl_term(logp, ex.ref, mask, w["sequence"])[0])),
        (S4, f"loss = surrogate + {beta} * KL (grpo.policy_loss)", _vals(total),
         f"article's Step 4, (ppo_loss + beta * exp(new - ref)).mean() over the padded [G, T] "
         f"(padding at ratio 1): {float(article):.4f}"),
        (S4, "训练效果: d surrogate / d log pi(o_i), summed over o_i's tokens",
         _vals(logp.grad.sum(-1))),
        (NUMERIC, "the article's claim",
         "o_1、o_2、o_3 的 advantage > 0，loss 为负（梯度提升概率）; o_3 的 ratio 被 clip 到 1.15"),
        (NUMERIC, "its verdict", "wrong for o_3: clipped (1.25 > 1.2), its gradient is 0 (训练效果 "
         "above), so this update does not raise it; o_1, o_2 rise, o_4 falls"),
    ]


def _next_update(ex) -> list[tuple[str, ...]]:
    """How the ratio leaves 1: an on-policy first update, one SGD step, the clip at the next."""
    logp = torch.zeros_like(ex.mask, requires_grad=True)        # [G, T] each token's log pi - old
    rho1 = (logp - ex.old).exp()[:, 0]                                      # [G] all 1
    first = ppo_loss(logp, ex.old, ex.adv, ex.mask, ex.w["sequence"])[0]
    g1 = torch.autograd.grad(first, logp)[0]                                # [G, T]
    logp = (logp - NEXT_LR * g1).detach().requires_grad_()                  # [G, T] one SGD step
    rho = logp.exp()[:, 0]                                                  # [G]
    _, low, high = clipped_surrogate(rho, ex.adv, 0.2, 0.2)                 # [G] each
    second = ppo_loss(logp, ex.old, ex.adv, ex.mask, ex.w["sequence"])[0]
    g2 = torch.autograd.grad(second, logp)[0]                               # [G, T]
    return [
        (NEXT, "1st update, on-policy (pi_old = pi_theta): rho_i", _vals(rho1)),
        (NEXT, "its d surrogate / d log pi, each token of o_i: -A_i / (G |o_i|)", _vals(g1[:, 0])),
        (NEXT, f"rho_i after one SGD step, lr {NEXT_LR:g} on each token's log pi", _vals(rho)),
        (NEXT, "clipped? (above 1.2 with A > 0, below 0.8 with A < 0)", _yes_no(low | high)),
        (NEXT, "2nd update: d surrogate / d log pi, each token of o_i", _vals(g2[:, 0])),
    ]


def _dapo(ex) -> list[tuple[str, ...]]:
    """DAPO's four fixes on the same group, in the article's order."""
    G, lengths, (max_len, cache) = ex.G, ex.lengths.to(torch.float64), OVERLONG
    surr = lambda k, eps_high: ppo_loss(  # noqa: E731
        ex.logp, ex.old, ex.adv, ex.mask, ex.w[k], 0.2, eps_high)[0]
    per_resp, _, high = clipped_surrogate(ex.rho, ex.adv, 0.2, 0.28)        # [G] each
    # Eq. 13 as dapo.overlong_penalty computes it (dapo imports grpo, so grpo cannot import dapo;
    # test_article_example_prints_the_articles_numbers checks the two agree)
    penalty = ((max_len - cache - lengths) / cache).clamp(-1.0, 0.0)        # [G]
    return [
        (CH, "-min(rho_i A_i, clip(rho_i) A_i), eps_low 0.2, eps_high 0.28", _vals(per_resp)),
        (CH, "clipped above 1 + eps_high? (1.25 < 1.28)", _yes_no(high)),
        (DS, "all right or all wrong, so dropped? (grpo.constant_groups = ~dapo.keep_groups)",
         _yes_no(constant_groups(ex.rewards))),
        (DS, "A_i of an all-right group", _vals(group_advantages(torch.ones(1, G))),
         "no gradient: dropped, and more prompts drawn to refill the batch"),
        (TL, "each token's weight, DAPO: 1 / sum |o_i|", _vals(ex.w["token"][:, 0])),
        (TL, "surrogate, eps 0.2 (--reduction token)", _vals(surr("token", 0.2))),
        (TL, "surrogate, eps_high 0.28 (DAPO's loss)", _vals(surr("token", 0.28))),
        (OL, f"soft penalty of |o_i| (Eq. 13, dapo.overlong_penalty), L_max {max_len}, L_cache "
         f"{cache} (the paper: 20480, 4096)", _vals(penalty)),
        (OL, "r_i = +-1 + penalty (train.reward, --algo dapo)", _vals(ex.pm1[0] + penalty)),
    ]


def article_example() -> list[str]:
    """The article's G = 4 group ("GRPO 训练过程拆解", "单 Prompt 数值示例"), one line per quantity.

    A header, then lines "article step | quantity | values [| where the article differs]": Steps
    1-4 at chosen ratios, the next update (where the ratio leaves 1 and the clip takes a gradient
    away), then DAPO's four fixes. Every value is computed by the functions train.py and update.py
    run (verifier.verify, group_advantages, constant_groups, token_weights, clipped_surrogate,
    ppo_loss, kl_k3, kl_term, policy_loss); booleans print as yes / no.
    """
    ex = _example_group()
    rows = [*_steps_1_to_3(ex), *_step_4(ex), *_next_update(ex), *_dapo(ex)]
    return [EXAMPLE_HEADER, *(" | ".join(row) for row in rows)]


if __name__ == "__main__":
    print("\n".join(article_example()))
