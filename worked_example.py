"""The article's worked example, printed: `python grpo.py` (or `python worked_example.py`).

Article sections: "GRPO 训练过程拆解" and "单 Prompt 数值示例" (one prompt, G = 4 answers, Steps 1-4
by hand), then "DAPO：四项修正" on the same group. Every number comes from the functions train.py
and update.py run (verifier.verify, grpo.*, dapo.overlong_penalty); where the article's text or
snippet gives another number, the line says so. Needs grpo.py, dapo.py and verifier.py beside it,
and torch.
"""
from __future__ import annotations

import types

import torch

import dapo
import verifier
from grpo import (
    REDUCTIONS,
    clipped_surrogate,
    group_advantages,
    kl_k3,
    kl_term,
    policy_loss,
    ppo_loss,
    token_weights,
)

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
        padded = clipped_surrogate((logp - old).exp(), adv[:, None], 0.2, 0.2)[0]  # [G, T]
        article = (padded + beta * (logp - ex.ref).exp()).mean()
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
         "loss (DAPO: 全局平均)\", sums the padded [G, T] (ratio 1 on padding: -A_i there): "
         f"{float(padded.sum() / padded.numel()):.4f}, Step 4's .mean(), not DAPO's token mean; "
         "with padding masked out it is this line, Dr. GRPO's constant normaliser"),
        (S4, "pi_ref / pi_theta, one per response (chosen)", _vals(ex.r_ref)),
        (S4, "KL k3 = pi_ref / pi - log(pi_ref / pi) - 1 (grpo.kl_k3)",
         _vals(kl_k3(logp, ex.ref)[:, 0]), f"article's exp(new - ref) - 1: "
         f"{_vals(article_kl[:, 0])}, negative for o_3; its mean over pi_theta is "
         "chi^2(pi_theta || pi_ref), not KL (k3's: the KL, and never negative). As losses, "
         "on-policy expected gradients: the snippet's 1/2 grad chi^2, k3's grad KL(pi_ref || "
         "pi_theta), k2's grad KL(pi_theta || pi_ref)"),
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
         "above); with each token's log-prob its own parameter, as here, this update does not "
         "raise it, while in a network o_3 still moves through weights it shares with o_1, o_2; "
         "o_1, o_2 rise, o_4 falls"),
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
    penalty = dapo.overlong_penalty(lengths, max_len, cache)                # [G] Eq. 13
    return [
        (CH, "-min(rho_i A_i, clip(rho_i) A_i), eps_low 0.2, eps_high 0.28", _vals(per_resp),
         "at the ratios chosen here; with one update per step (--mini-batches 1, --mu 1: "
         "--algo dapo's default) every ratio is 1 and neither bound acts"),
        (CH, "clipped above 1 + eps_high? (1.25 < 1.28)", _yes_no(high)),
        (DS, "all right or all wrong, so dropped? (grpo.constant_groups = ~dapo.keep_groups)",
         _yes_no(~dapo.keep_groups(ex.rewards))),
        (DS, "A_i of an all-right group", _vals(group_advantages(torch.ones(1, G))),
         "no gradient: dropped, and more prompts drawn to refill the batch"),
        (TL, "each token's weight, DAPO: 1 / sum |o_i|", _vals(ex.w["token"][:, 0]),
         "Eq. 12 divides by each prompt's group's tokens; the code (as verl and TRL) by the "
         "whole update's, so a group with more tokens weighs more"),
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
