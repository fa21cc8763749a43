"""Tests: the article walk-through and the units of its modules (hand-sized numeric cases,
equivalences).

The first section follows the article step by step (GRPO's Steps 1-4 on its G = 4 example, then
DAPO's Eq. 10-13), each case worked by hand; then the rewards runs name as `--reward
test_grpo:NAME` (has_x, flip_x, trl_length, ...), then one section per article module: grpo, dapo,
update, logprobs, train. Nothing here is @slow. The shared fixtures and helpers (tiny_model,
tiny_run_inputs, PROMPTS, tiny, tiny_flags, one_step, ...) are in tests/helpers.py. The other tests
are in tests/, by room: the sampler (test_sampler.py), the verifier's rules (test_verifier.py),
evaluation (test_evaluate.py), how Step 1 runs (test_rollout.py), the flags (test_flags.py), the
loss family (test_losses.py), data and the built-in task (test_data.py), ranks and checkpoints
(test_ranks_checkpoints.py), collectives every rank enters (test_collectives.py), metrics, MFU and
LoRA (test_metrics.py), the layout (test_layout.py); and by kind: the end-to-end runs through
subprocess and torchrun (test_runs.py, launched by launch.py), bench and ablate (test_tools.py),
--rollout vllm (test_vllm.py), the real model (test_real_model.py), the docs (test_docs.py). All
of them:

    python -m pytest -q test_grpo.py tests
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import warnings

import pytest
import torch

import dapo
import grpo
import logprobs
import update
import worked_example
from harness import builtin, data, flags, metrics, setup
from infra import lm_head
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups
from verifier import verify

HERE = os.path.dirname(os.path.abspath(__file__))
# the shared helpers (tests/helpers.py): on pytest's path by pyproject.toml; a run's child process
# (train.py --reward test_grpo:NAME) imports this file without it
sys.path.insert(0, os.path.join(HERE, "tests"))
from helpers import (  # noqa: E402
    LONG_PROMPTS,
    PROMPTS,
    fake_rollout,
    full_forward_logprobs,
    mixed_rollout,
    one_step,
    spy_on,
    tiny,
    tiny_gpt2,
    tiny_model,  # noqa: F401  (a fixture)
    tiny_run_inputs,  # noqa: F401  (a fixture)
)

# ---------------------------------------------------------------------------------------------
# The article, step by step: its GRPO walk-through (Steps 1-4 on one prompt, G = 4: rewards [1, 1,
# 1, 0], advantages [0.5, 0.5, 0.5, -1.5]) carried into the loss update.py runs, then DAPO's four
# fixes (Eq. 10-13), each worked by hand. The module sections below test the same functions in
# depth.
# ---------------------------------------------------------------------------------------------

# -- Step 1: Rollout (sampler.sample_groups): G responses per prompt, masks from lengths, old
# log-probs --
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_masks_lengths_truncation_and_logprobs(tiny_model, temperature):
    G, T = 4, 20
    roll = sample_groups(tiny_model, PROMPTS, G, T, eos_token_id=1, pad_token_id=0,
                         temperature=temperature, generator=torch.Generator().manual_seed(3))
    N = len(PROMPTS) * G
    assert roll.response_ids.shape[0] == N and roll.mask.shape == roll.response_ids.shape
    assert roll.truncated.any() and (~roll.truncated).any()  # this seed gives both kinds
    for i in range(N):
        L = int(roll.lengths[i])
        row = roll.response_ids[i].tolist()
        assert roll.mask[i].tolist() == [1.0] * L + [0.0] * (roll.mask.shape[1] - L)
        assert bool(roll.truncated[i]) == (1 not in row[:L])
        if not roll.truncated[i]:
            assert row[L - 1] == 1 and 1 not in row[:L - 1]   # the mask includes the EOS
        else:
            assert L == T
        want = full_forward_logprobs(tiny_model, PROMPTS[i // G], row[:L], temperature)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=1e-4)


# -- Step 2: Reward (verifier.verify) --
def test_article_step2_the_verifier_scores_the_four_responses_1_1_1_0():
    # Step 2 on the article's prompt "2x + 5 = 13" (answer 4): o_1..o_3 reach x = 4 (boxed, bare, in
    # words), o_4 adds 5 instead of subtracting it (x = 9). verify gives 1 or 0 per response:
    # rewards [1, 1, 1, 0], the [B, G] = [1, 4] tensor Step 3 normalises
    # (test_article_example_advantages)
    responses = ["2x = 13 - 5 = 8, so x = 8 / 2 = \\boxed{4}", "x = 4",
                 "Subtract 5: 2x = 8. Divide by 2: x = 4. The answer is 4.",
                 "2x = 13 + 5 = 18, x = \\boxed{9}"]
    rewards = torch.tensor([[verify(o, "4") for o in responses]])              # [1, 4]
    assert rewards.tolist() == [[1.0, 1.0, 1.0, 0.0]]


# -- Step 3: Advantage (grpo.group_advantages): the group z-score --
def test_article_example_advantages():
    # The article's Step 3: rewards [1, 1, 1, 0]; mean 0.75, Bessel std sqrt(0.75 / 3) = 0.5,
    # so (1 - 0.75) / 0.5 = 0.5 and (0 - 0.75) / 0.5 = -1.5.
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5, -1.5]]), atol=1e-5)


# -- Step 4: PPO loss (grpo.policy_loss): the clipped surrogate + beta * KL, as update.update_policy
# runs it --
def _two_token_case(adv: float):
    # one response of two tokens with ratios 1.5 and 0.5; the weights of the sequence mean, 1/2 each
    logp, mask = torch.log(torch.tensor([[1.5, 0.5]])), torch.ones(1, 2)
    return logp, torch.zeros(1, 2), torch.tensor([adv]), mask, grpo.token_weights(mask)


def test_policy_loss_clipping_by_hand():
    # A = +1: -min(1.5, 1.2) = -1.2 and -min(0.5, 0.8) = -0.5 -> mean -0.85; token 1 clipped high.
    loss, m = grpo.ppo_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() + 0.85) < 1e-6
    assert (m["clip/high_frac"] == 0.5 and m["clip/low_frac"] == 0.0
            and abs(m["ratio/mean"] - 1.0) < 1e-6)
    # A = -1: -min(-1.5, -1.2) = 1.5 and -min(-0.5, -0.8) = 0.8 -> mean 1.15; token 2 clipped low.
    loss, m = grpo.ppo_loss(*_two_token_case(-1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() - 1.15) < 1e-6
    assert m["clip/low_frac"] == 0.5 and m["clip/high_frac"] == 0.0
    # Clip-higher: eps_high 0.6 lets ratio 1.5 through: -(1.5 + 0.5) / 2 = -1.0, nothing clipped.
    loss, m = grpo.ppo_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.6)
    assert abs(loss.item() + 1.0) < 1e-6 and m["clip/high_frac"] == 0.0


def test_kl_k3_hand_value_zero_at_equality_and_nonnegative():
    # logp = log 0.5, ref = log 0.25: delta = log 0.5, k3 = 0.5 - log 0.5 - 1 = 0.19315
    assert abs(grpo.kl_k3(torch.tensor(math.log(0.5)),
                          torch.tensor(math.log(0.25))).item() - 0.193147) < 1e-5
    x = torch.randn(1000)
    assert torch.equal(grpo.kl_k3(x, x), torch.zeros(1000))
    assert (grpo.kl_k3(x, torch.randn(1000) * 3) >= 0).all()


def test_article_kl_snippet_is_half_the_gradient_of_chi2():
    # The article's KL term beta * (exp(new_logp - ref_logp) - 1) (Step 4's drops the - 1: the same
    # gradient), on tokens x sampled from pi and differentiated through log pi only. Its expected
    # gradient, exactly, over a 5-token vocabulary (pi's weights detached, as sampling does):
    # sum_x pi_x (pi_x / ref_x) grad log pi_x = sum_x (pi_x / ref_x) grad pi_x
    # = 1/2 grad sum_x pi_x^2 / ref_x = 1/2 grad chi^2(pi || ref), chi^2 = sum_x pi_x^2 / ref_x - 1.
    # A pull toward the reference (chi^2 >= 0, 0 only at pi = ref), not the gradient of the KL; and
    # its value's mean, sum_x pi_x (pi_x / ref_x - 1), is chi^2, not the KL.
    gen = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)

    def grad(theta, f):
        theta = theta.detach().requires_grad_()
        logp = torch.log_softmax(theta, 0)
        return torch.autograd.grad(f(logp), theta)[0]

    snippet = lambda logp: (logp.exp().detach() * ((logp - ref).exp() - 1)).sum()  # noqa: E731
    step4 = lambda logp: (logp.exp().detach() * (logp - ref).exp()).sum()           # noqa: E731
    chi2 = lambda logp: (logp.exp() ** 2 / ref.exp()).sum() - 1                     # noqa: E731
    kl = lambda logp: (logp.exp() * (logp - ref)).sum()                             # noqa: E731
    theta = torch.randn(5, generator=gen, dtype=torch.float64)
    assert torch.allclose(grad(theta, snippet), 0.5 * grad(theta, chi2), atol=1e-6)
    assert torch.allclose(grad(theta, step4), grad(theta, snippet), atol=1e-12)
    assert not torch.allclose(grad(theta, snippet), grad(theta, kl), atol=1e-3)
    # what the snippet's gradient does not tell from k3: neither is the forward KL's. As losses,
    # k3's expected gradient is that of the reverse KL(ref || pi), k2's that of KL(pi || ref); the
    # values are what differ: k3's mean is the KL (and k3 >= 0), the snippet's is chi^2
    on_pi = lambda k: (lambda logp: (logp.exp().detach() * k(logp, ref)).sum())  # noqa: E731
    reverse = lambda logp: (ref.exp() * (ref - logp)).sum()                        # noqa: E731
    assert torch.allclose(grad(theta, on_pi(grpo.kl_k3)), grad(theta, reverse), atol=1e-12)
    assert not torch.allclose(grad(theta, on_pi(grpo.kl_k3)), grad(theta, kl), atol=1e-3)
    assert torch.allclose(grad(theta, on_pi(grpo.kl_k2)), grad(theta, kl), atol=1e-12)
    pi = torch.softmax(theta, 0)
    assert float(on_pi(grpo.kl_k3)(pi.log())) == pytest.approx(float(kl(pi.log())), abs=1e-12)
    assert float(snippet(pi.log())) == pytest.approx(float(chi2(pi.log())), abs=1e-12)
    # at pi = ref: the expected gradient is zero (the fixed point), and so is chi^2
    assert torch.allclose(grad(ref, snippet), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert abs(float(chi2(ref))) < 1e-12
    # a small descent step along it brings pi closer to ref in chi^2
    assert float(chi2(torch.log_softmax(theta - 0.1 * grad(theta, snippet), 0))) < \
        float(chi2(torch.log_softmax(theta, 0)))


class _GivenLogprobs(torch.nn.Module):
    """A stand-in policy whose log-probs of the rollout's tokens [N, T] are its parameter (see the
    fake
    rollout_logprobs below), so update_policy's loss and gradient can be worked out by hand."""

    def __init__(self, logp):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())


@pytest.mark.parametrize("reduction", ["sequence", "token"])
def test_update_policy_loss_is_surrogate_plus_beta_kl_by_hand(reduction, monkeypatch):
    # The article's G = 4 group (Step 3: advantages [0.5, 0.5, 0.5, -1.5]) with lengths 3, 2, 3, 1
    # (9 tokens), through update.update_policy's first update (ratio 1: old = current) in
    # micro-batches of 3 and 1 rows. Probabilities of the sampled tokens under pi_theta and pi_ref,
    # chosen so that r = pi_ref / pi is 1, 1/2 or 2: k3 = r - log r - 1 is 0, log 2 - 1/2 or 1 - log
    # 2. Padding holds garbage (p = 1 vs 0.01).
    import contextlib
    from types import SimpleNamespace

    from infra import parallel
    pi = torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.8, 1.0], [0.9, 0.6, 0.3], [0.25, 1.0, 1.0]])
    pi_ref = torch.tensor([[0.5, 0.25, 0.5], [0.25, 0.4, 0.01], [0.9, 0.6, 0.3], [0.5, 0.01, 0.01]])
    lengths = torch.tensor([3, 2, 3, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).float()                 # [4, 3]
    A = torch.tensor([0.5, 0.5, 0.5, -1.5])                                   # [4]
    r = pi_ref / pi                                                           # [4, 3]
    beta = 0.04
    # by hand: at ratio 1 the surrogate is -A on each token; k3 sums to 1/2, 2 log 2 - 1, 0, 1 - log
    # 2 per row
    if reduction == "sequence":   # GRPO: mean over the 4 responses of each one's token mean
        # = 0: a group's advantages sum to 0
        surrogate = -(0.5 + 0.5 + 0.5 - 1.5) / 4
        # = (1/6 + 1/2) / 4 = 1/6
        kl = (0.5 / 3 + (2 * math.log(2) - 1) / 2 + 0 + (1 - math.log(2))) / 4
        # [4, 3] each token's weight
        w = mask / lengths[:, None] / 4
    else:                         # DAPO: the sum over the 9 tokens / 9
        surrogate = -(0.5 * 3 + 0.5 * 2 + 0.5 * 3 - 1.5 * 1) / 9
        kl = (0.5 + (2 * math.log(2) - 1) + 0 + (1 - math.log(2))) / 9
        w = mask / 9
    # d/d logp of -ratio * A is -A; of k3(logp, ref) = e^(ref - logp) - (ref - logp) - 1 it is 1 - r
    grad = w * (-A[:, None] + beta * (1 - r))                                 # [4, 3]

    def given_logprobs(model, roll, rows, temperature, with_entropy=False, shared_prefix=True,
                       buckets=True, entropy_grad=None):
        logp = model.logp[rows]                                               # [n, 3]
        return logp, torch.zeros_like(logp) if with_entropy else None, roll.mask[rows]

    monkeypatch.setattr(update, "rollout_logprobs", given_logprobs)
    policy, ref = _GivenLogprobs(pi.log()), _GivenLogprobs(pi_ref.log()).requires_grad_(False)
    roll = Rollout(prompts=[[5]], G=4, pad_token_id=0,
                   response_ids=torch.zeros(4, 3, dtype=torch.long), mask=mask,
                   lengths=lengths, truncated=torch.zeros(4, dtype=torch.bool), logprobs=pi.log(),
                   index=torch.zeros(4, dtype=torch.long))
    args = SimpleNamespace(micro_batch_size=3,
                           micro_batch_tokens=10**6, mini_batches=1, mu=1, temperature=1.0,
                           reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=3, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                           off_policy_mask=0.0, top_p=1.0,
                           entropy_coef=0.0, beta=beta, kl="k3", grad_clip=0.0, lr=1.0)
    learner = update.Learner(policy, policy, ref, torch.optim.SGD(policy.parameters(), lr=1.0),
                             contextlib.nullcontext)
    stats = update.update_policy(learner, roll, A, mask, args, parallel.Dist("cpu"))
    assert stats.first["loss"] == pytest.approx(surrogate + beta * kl, abs=1e-6)
    # the k3 sum over the 9 tokens
    assert stats.first["kl"] == pytest.approx(0.5 + math.log(2), abs=1e-5)
    assert stats.first["tokens"] == 9 and stats.first["updates"] == 1
    # one SGD step of lr 1: the parameter moved by minus the gradient worked out above (padding: not
    # at all)
    assert torch.allclose(pi.log() - policy.logp.detach(), grad, atol=1e-6)


# -- DAPO Eq. 10: Clip-Higher (eps_high > eps_low) --
def test_article_clip_higher_lets_the_positive_tokens_rise_further():
    # DAPO Eq. 10 on the article's group, one token per response: A = [0.5, 0.5, 0.5, -1.5] at
    # ratios [1.1, 1.25, 1.25, 0.75], each response weighing 1/4 (the sequence mean).
    # Per token -min(r A, clip(r) A):
    #   GRPO, eps 0.2 both ways: -0.55; -min(0.625, 0.6) = -0.6 twice (clipped high);
    #     -min(-1.125, -1.2) = 1.2 (clipped low). Loss (-0.55 - 0.6 - 0.6 + 1.2) / 4 = -0.1375,
    #     no gradient on o_2, o_3, o_4.
    #   DAPO, eps_low 0.2, eps_high 0.28: 1.25 < 1.28 is inside, -0.625 twice.
    #     Loss (-0.55 - 1.25 + 1.2) / 4 = -0.15, and o_2, o_3 get the gradient -A r / 4 = -0.15625
    #     (o_4 stays clipped: eps_low is unchanged).
    A = torch.tensor([0.5, 0.5, 0.5, -1.5])                                    # [4]
    mask = torch.ones(4, 1)                                                    # [4, 1]
    for eps_high, want, grads, high_frac in ((0.2, -0.1375, [-0.1375, 0, 0, 0], 0.5),
                                             (0.28, -0.15, [-0.1375, -0.15625, -0.15625, 0], 0.0)):
        # [4, 1], old = 0
        logp = torch.log(torch.tensor([[1.1], [1.25], [1.25], [0.75]])).requires_grad_()
        loss, m = grpo.ppo_loss(logp, torch.zeros(4, 1), A, mask, grpo.token_weights(mask),
                                eps_low=0.2, eps_high=eps_high)
        loss.backward()
        assert loss.item() == pytest.approx(want, abs=1e-6)
        assert torch.allclose(logp.grad[:, 0], torch.tensor(grads), atol=1e-6)
        assert m["clip/high_frac"] == high_frac and m["clip/low_frac"] == 0.25


# -- DAPO Eq. 11: Dynamic Sampling (dapo.keep_groups: 0 < #correct < G) --
def test_keep_groups_boundaries():
    # Eq. 11 on correctness: 0 < #correct < G
    c = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 1.0]])
    assert dapo.keep_groups(c).tolist() == [False, False, True, True]


# -- DAPO Eq. 12: Token-Level Loss (grpo.token_weights(mask, "token")); carried through the G = 4
# loss above --
def test_token_weights_by_hand():
    # lengths 1, 3 and an overlong-filtered (empty) row, T = 3
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # 1 / (|o_i| * 2 responses)
    seq = torch.tensor([[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6], [0, 0, 0]])
    assert torch.allclose(grpo.token_weights(mask), seq)
    assert torch.allclose(grpo.token_weights(mask, "token"), mask / 4)       # 4 valid tokens
    # 2 responses x 5
    assert torch.allclose(grpo.token_weights(mask, "constant", max_len=5), mask / 10)
    # the step's global counts win over the micro-batch's own: 8 tokens, 4 responses
    assert torch.allclose(grpo.token_weights(mask, "token", num_tokens=torch.tensor(8.0)), mask / 8)
    assert torch.allclose(grpo.token_weights(mask, "sequence", num_seqs=4), seq / 2)
    # nothing valid: 0
    assert torch.equal(grpo.token_weights(torch.zeros(2, 3), "token"), torch.zeros(2, 3))


# -- DAPO Eq. 13: Overlong Reward Shaping (dapo.overlong_penalty) and overlong filtering --
def test_overlong_penalty_boundaries():
    # L_max 20, L_cache 4: free up to 16, then (16 - L) / 4, -1 beyond 20 (DAPO Eq. 13)
    L = torch.tensor([1, 16, 17, 18, 20, 21, 100])
    want = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    assert torch.allclose(dapo.overlong_penalty(L, 20, 4), want)
    with pytest.raises(ValueError):
        dapo.overlong_penalty(L, 20, 0)


def test_overlong_filter_masks_truncated_rows():
    mask = torch.ones(3, 4)
    out = dapo.overlong_filter(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4.0, 0.0, 4.0]


# -- The whole example, printed by python grpo.py: Steps 1-4, the next update, DAPO's four fixes --
S1, S2 = "Step 1: Rollout 采样", "Step 2: Reward 计算"


S3, S4 = "Step 3: Advantage 估计", "Step 4: PPO Loss 计算"


NEXT, NUM = "Step 4, the next update", "单 Prompt 数值示例"


LN2 = math.log(2)


# The article's Step 4 loss, (ppo_loss + beta * exp(new - ref)).mean() over all G * T = 24
# positions, padding at ratio 1 (log-probs 0 there). Surrogate: the valid tokens sum to 3.01
# (below), the 9 padding positions (3 of o_1, 4 of o_2, 2 of o_3) add -A = -0.5 each:
# 3.01 - 4.5 = -1.49. KL: exp(new - ref) = pi / pi_ref is 1 on o_1's 3 and o_4's 6 tokens, 2 on
# o_2's 2, 1/2 on o_3's 4, and 1 on the 9 padding positions: 3 + 4 + 2 + 6 + 9 = 24, a mean of 1.
ARTICLE_STEP4 = -1.49 / 24 + 0.04 * 24 / 24                                   # -0.0221
# The next update: on-policy each token's gradient is -A_i / (G |o_i|) (ratio 1, nothing clipped);
# one SGD step of lr 4 moves each token's log pi by 4 A_i / (G |o_i|) = 1/6, 1/4, 1/8, -1/4, so the
# ratios are e^(1/6) = 1.18, e^(1/4) = 1.28 > 1.2 with A > 0 (clipped), e^(1/8) = 1.13 and
# e^(-1/4) = 0.78 < 0.8 with A < 0 (clipped). The second update's gradient is -A_i rho_i / (G |o_i|)
# where not clipped, 0 where clipped.
NEXT_STEP = [1 / 6, 1 / 4, 1 / 8, -1 / 4]


# (article step, part of the quantity's name, its values, part of the note where the article
# differs or None); values: a str (exact), bools (printed yes / no) or numbers (4 decimals). By
# hand: A = [0.5, 0.5, 0.5, -1.5] (Step 3); ratios [1.1, 1.04, 1.25, 0.9] give
# rho A = [0.55, 0.52, 0.625, -1.35]; eps 0.2 clips o_3's 1.25 to 1.2 (0.6 < 0.625, so min takes
# it); lengths [3, 2, 4, 6]: 15 tokens, T = 6; k3 of r = pi_ref / pi in {1, 1/2, 2} is 0,
# log 2 - 1/2, 1 - log 2, and the article's exp(new - ref) - 1 = 1 / r - 1 is 0, 1, -1/2.
ARTICLE_EXAMPLE = [
    (S1, "prompt", "求解方程：2x + 5 = 13 (answer 4), G = 4 responses", None),
    (S1, "o_1", "2x = 13 - 5 = 8, so x = 8 / 2 = \\boxed{4}", None),
    (S1, "o_2", "x = 4", None),
    (S1, "o_3", "Subtract 5: 2x = 8. Divide by 2: x = 4. The answer is 4.", None),
    (S1, "o_4", "2x = 13 + 5 = 18, x = \\boxed{9}", None),
    (S1, "|o_i|", [3, 2, 4, 6], None),
    (S2, "verifier.verify", [1, 1, 1, 0], None),
    (S2, "--wrong-reward -1", [1, 1, 1, -1], None),
    (S3, "mean(r)", [0.75], None),
    # sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5; the article's / 4 gives sqrt(0.75 / 4)
    (S3, "Bessel", [0.5], f"divides by G: {math.sqrt(0.75 / 4):.4f}"),
    (S3, "grpo.group_advantages", [0.5, 0.5, 0.5, -1.5], None),
    (S3, "-1 rewards", [0.5, 0.5, 0.5, -1.5], None),  # mean 0.5, std 1: the same z-scores
    (S4, "rho_i", [1.1, 1.04, 1.25, 0.9], None),
    (S4, "clip(rho_i", [1.1, 1.04, 1.2, 0.9], 'o_3 "被 clip 到 1.15"; eps 0.2 clips it to 1.2'),
    (S4, "clipped above", [False, False, True, False], None),                 # 1.25 > 1.2, A > 0
    (S4, "-min(rho_i A_i", [-0.55, -0.52, -0.6, 1.35], None),
    (S4, "1 / (G |o_i|)", [1 / 12, 1 / 8, 1 / 16, 1 / 24], None),
    (S4, "--reduction sequence", [(-0.55 - 0.52 - 0.6 + 1.35) / 4], None),        # -0.08
    # the sum over tokens, 3 * -0.55 + 2 * -0.52 + 4 * -0.6 + 6 * 1.35 = 3.01, over G * T = 24
    # the article's padded sum adds -A_i on each padding position: 3 x -0.5, 4 x -0.5, 2 x -0.5
    (S4, "--reduction constant", [3.01 / 24], f"(ratio 1 on padding: -A_i there): "
     f"{(3.01 - 4.5) / 24:.4f}, Step 4's .mean()"),
    (S4, "pi_ref / pi_theta", [1, 0.5, 2, 1], None),
    (S4, "grpo.kl_k3", [0, LN2 - 0.5, 1 - LN2, 0],
     "exp(new - ref) - 1: " + " ".join(f"{1 / r - 1:.4f}" for r in (1, 0.5, 2, 1))
     + ", negative for o_3; its mean over pi_theta is chi^2(pi_theta || pi_ref), not KL (k3's: the "
     "KL, and never negative). As losses, on-policy expected gradients: the snippet's 1/2 grad "
     "chi^2, k3's grad KL(pi_ref || pi_theta), k2's grad KL(pi_theta || pi_ref)"),
    (S4, "grpo.kl_term", [(LN2 - 0.5 + 1 - LN2) / 4], None),                  # 0.125
    (S4, "grpo.policy_loss", [-0.08 + 0.04 * 0.125], f"(padding at ratio 1): {ARTICLE_STEP4:.4f}"),
    # -A rho / G on each response's tokens, summed; 0 where clipped
    (S4, "训练效果", [-0.55 / 4, -0.52 / 4, 0, 1.35 / 4], None),
    (NUM, "the article's claim",
     "o_1、o_2、o_3 的 advantage > 0，loss 为负（梯度提升概率）; o_3 的 ratio 被 clip 到 1.15",
     None),
    (NUM, "its verdict", "wrong for o_3: clipped (1.25 > 1.2), its gradient is 0 (训练效果 above); "
     "with each token's log-prob its own parameter, as here, this update does not raise it, while "
     "in a network o_3 still moves through weights it shares with o_1, o_2; o_1, o_2 rise, o_4 "
     "falls", None),
    (NEXT, "1st update, on-policy", [1, 1, 1, 1], None),
    (NEXT, "-A_i / (G |o_i|)", [-0.5 / 12, -0.5 / 8, -0.5 / 16, 1.5 / 24], None),
    (NEXT, "after one SGD step, lr 4", [math.exp(d) for d in NEXT_STEP], None),
    (NEXT, "clipped?", [False, True, False, True], None),
    (NEXT, "2nd update", [-0.5 * math.exp(1 / 6) / 12, 0, -0.5 * math.exp(1 / 8) / 16, 0], None),
    ("Clip-Higher", "eps_high 0.28", [-0.55, -0.52, -0.625, 1.35],           # 1.25 < 1.28
     "every ratio is 1 and neither bound acts"),
    ("Clip-Higher", "clipped above 1 + eps_high", [False] * 4, None),
    ("Dynamic Sampling", "grpo.constant_groups", [False], None),              # 3 of 4 right
    ("Dynamic Sampling", "all-right group", [0, 0, 0, 0], "refill the batch"),
    ("Token-Level Loss", "1 / sum |o_i|", [1 / 15] * 4, "a group with more tokens weighs more"),
    ("Token-Level Loss", "--reduction token", [3.01 / 15], None),
    ("Token-Level Loss", "DAPO's loss", [(3.01 - 4 * 0.025) / 15], None),   # o_3 at -0.625
    # Eq. 13 at L_max 7, L_cache 4: 0 up to 3 tokens, then (3 - L) / 4: o_3 (4) -1/4, o_4 (6) -3/4
    ("Overlong Reward Shaping", "L_max 7, L_cache 4", [0, 0, -0.25, -0.75], None),
    ("Overlong Reward Shaping", "+-1 + penalty", [1, 1, 0.75, -1.75], None),
]


def test_article_example_prints_the_articles_numbers(capsys):
    # every line of `python grpo.py` against ARTICLE_EXAMPLE (worked by hand above), to the 4
    # decimals printed, with a note where the article's own text says otherwise
    import re
    import runpy
    lines = worked_example.article_example()
    header = lines[0].split(" | ")
    assert len(header) == 4 and header[2].startswith("o_1 o_2 o_3 o_4"), lines[0]
    assert len(lines) == 1 + len(ARTICLE_EXAMPLE)
    for line, (step, quantity, want, note) in zip(lines[1:], ARTICLE_EXAMPLE):
        got_step, got_quantity, values, *got_note = line.split(" | ")
        assert (got_step, quantity in got_quantity) == (step, True), line
        assert len(got_note) == (note is not None) and (note is None or note in got_note[0]), line
        if isinstance(want, str):
            assert values == want, line
        elif isinstance(want[0], bool):
            assert values.split() == ["yes" if b else "no" for b in want], line
        else:
            numbers = values.split()
            assert all(re.fullmatch(r"-?\d+\.\d{4}|\d+", x) for x in numbers), line
            assert [float(x) for x in numbers] == pytest.approx(want, abs=5.001e-5), line
    # the DAPO order of the article's sections, and Eq. 13's line is dapo.overlong_penalty's
    steps = [line.split(" | ")[0] for line in lines]
    dapo_steps = ["Clip-Higher", "Dynamic Sampling", "Token-Level Loss", "Overlong Reward Shaping"]
    assert [s for i, s in enumerate(steps) if s in dapo_steps and s != steps[i - 1]] == dapo_steps
    assert dapo.overlong_penalty(torch.tensor([3, 2, 4, 6]), *worked_example.OVERLONG).tolist() == \
        [0.0, 0.0, -0.25, -0.75]
    runpy.run_path(os.path.join(HERE, "grpo.py"), run_name="__main__")
    assert capsys.readouterr().out == "\n".join(lines) + "\n"


def test_the_articles_modules_lift_into_an_empty_folder_with_torch_alone(tmp_path):
    # a reader copies grpo.py, dapo.py and verifier.py (and the worked example) into a folder of
    # their own: they import with torch alone (transformers, infra/ and sampler.py made
    # unimportable, and nothing of the project's beyond the copies loaded), and `python grpo.py`
    # prints there, under the same blocks, what it prints here (worked_example.article_example)
    import shutil
    import subprocess
    import sys
    for f in ("grpo.py", "dapo.py", "verifier.py", "worked_example.py"):
        shutil.copy(os.path.join(HERE, f), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = ("import runpy, sys; sys.modules.update(transformers=None, infra=None, sampler=None); "
             "import grpo, dapo, verifier, worked_example; "
             "mine = {m for m, mod in sys.modules.items() if (getattr(mod, '__file__', '') or '')"
             ".startswith(sys.argv[1])}; print(sorted(mine)); "
             "runpy.run_path('grpo.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", check, str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, printed = out.stdout.split("\n", 1)
    assert first == "['dapo', 'grpo', 'verifier', 'worked_example']", first
    assert printed == "\n".join(worked_example.article_example()) + "\n"
    assert len(open(os.path.join(HERE, "grpo.py"), encoding="utf-8").read().splitlines()) <= 300


def test_article_example_next_update_the_clip_takes_the_gradient_away():
    # The next update of `python grpo.py`, by hand (NEXT_STEP above): at ratio 1 every token of
    # o_i gets -A_i / (G |o_i|); after one SGD step of lr 4 the ratios are e^NEXT_STEP, o_2 (1.28 >
    # 1.2, A > 0) and o_4 (0.78 < 0.8, A < 0) are clipped and their gradient is exactly 0, o_1 and
    # o_3 get -A_i rho_i / (G |o_i|).
    lengths = torch.tensor([3, 2, 4, 6])
    mask = (torch.arange(6)[None] < lengths[:, None]).double()                # [4, 6]
    A, w = torch.tensor([0.5, 0.5, 0.5, -1.5]).double(), grpo.token_weights(mask)
    logp = torch.zeros(4, 6, dtype=torch.float64, requires_grad=True)       # old = 0: ratio 1
    g1 = torch.autograd.grad(grpo.ppo_loss(logp, torch.zeros_like(mask), A, mask, w)[0], logp)[0]
    assert torch.allclose(g1, -(A / 4 / lengths)[:, None] * mask, atol=1e-15)
    step = torch.tensor(NEXT_STEP, dtype=torch.float64)                        # [4] 4 A / (G |o_i|)
    assert torch.allclose(-worked_example.NEXT_LR * g1, step[:, None] * mask, atol=1e-15)
    logp = (step[:, None] * mask).requires_grad_()                             # [4, 6]
    loss, m = grpo.ppo_loss(logp, torch.zeros_like(mask), A, mask, w)
    g2 = torch.autograd.grad(loss, logp)[0]
    assert g2[1].abs().sum() == 0 and g2[3].abs().sum() == 0                 # clipped: no gradient
    want = [-0.5 * math.exp(1 / 6) / 12, -0.5 * math.exp(1 / 8) / 16]
    assert g2[[0, 2], 0].tolist() == pytest.approx(want, abs=1e-12)
    # o_2's 2 tokens and o_4's 6, of the 15
    assert (m["clip/high_frac"], m["clip/low_frac"]) == pytest.approx((2 / 15, 6 / 15))


# ---------------------------------------------------------------------------------------------
# Shared helpers: tiny models, the tiny run's inputs, and running train.py in a subprocess or under
# torchrun
# ---------------------------------------------------------------------------------------------


def has_x(response: str, answer: str) -> float:
    """A reward a random model earns sometimes (it never answers right): the tiny runs' groups are
    mixed."""
    return float("x" in response)


# --reward functions the runs name as test_grpo:NAME

def trl_length(completions, **kwargs):
    """A reward in the shape of TRL's docs: a batch of completions in, one float per completion
    out."""
    return [-abs(8 - len(c)) / 8 for c in completions]


def _trl_accuracy(completions, solution, **kwargs):
    """trl.rewards.accuracy_reward's contract, where TRL is not installed: the content of each
    completion's one assistant message against the solution column (verifier.verify here,
    math_verify in TRL)."""
    return [verify(c[0]["content"], s) for c, s in zip(completions, solution)]


TRL_SEEN = []  # what trl_spy_reward was called with, in-process runs


def trl_spy_reward(prompts, completions, reward_model, **kwargs):
    """TRL's signature, recording its arguments; scores a response by its length (mixed groups)."""
    TRL_SEEN.append({"prompts": prompts, "completions": completions, "reward_model": reward_model})
    return [len(c[0]["content"]) / 100 for c in completions]


def flip_x(response: str, answer: str) -> float:
    """has_x, flipped when a coin of the global torch RNG or of `random` says so: a reward drawing
    from both global RNGs, which a resumed run reproduces only if the checkpoint restores them."""
    flip = float(torch.rand(())) < 0.15 or random.random() < 0.15
    return 1.0 - has_x(response, answer) if flip else has_x(response, answer)


# ---------------------------------------------------------------------------------------------
# grpo.py: advantages, reductions as per-token weights, KL, the clipped surrogate
# ---------------------------------------------------------------------------------------------

def test_advantages_scales_and_constant_groups():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.3, 0.3]])
    # group: [1, 0] has mean 0.5 and Bessel std sqrt(0.5); constant groups are exactly zero, not
    # NaN.
    g = grpo.group_advantages(r, "group")
    assert torch.allclose(g[0], torch.tensor([0.5, -0.5]) / math.sqrt(0.5), atol=1e-5)
    assert torch.equal(g[1:], torch.zeros(2, 2))
    # none (Dr. GRPO): only centred.
    assert torch.allclose(grpo.group_advantages(r, "none")[0], torch.tensor([0.5, -0.5]))
    # batch: centred per group, divided by the std of all six rewards.
    b = grpo.group_advantages(r, "batch")
    assert torch.allclose(b[0], torch.tensor([0.5, -0.5]) / (r.std() + 1e-6), atol=1e-5)
    # batch_std (what train.py computes over all ranks) replaces this share's own std
    assert torch.allclose(grpo.group_advantages(r, "batch", batch_std=2.0)[0],
                          torch.tensor([0.25, -0.25]), atol=1e-5)
    # a float leftover must not be blown up: rewards equal up to representation stay zero
    assert torch.equal(grpo.group_advantages(torch.full((1, 4), 0.1 + 0.2)), torch.zeros(1, 4))
    # G = 3 with a constant 0.9: the float32 mean is off by an ulp, which / (std + eps) gives 0.056,
    # not 0
    assert torch.equal(grpo.group_advantages(torch.full((2, 3), 0.9)), torch.zeros(2, 3))
    with pytest.raises(ValueError):
        grpo.group_advantages(r, "bogus")
    # a rank that dynamic sampling left without a group: [0, G], quietly (no torch std warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(grpo.group_advantages(torch.zeros(0, 4), s).shape == (0, 4)
                   for s in ("group", "batch", "none"))


def test_advantages_keep_their_sign_when_the_std_is_below_eps():
    # rewards 0 and 1e-7: std 7.1e-8 < eps = 1e-6, so std + eps is eps-sized and the advantages are
    # small, with the sign of r - mean (std - eps would be negative and flip them: the better answer
    # pushed down)
    r = torch.tensor([[0.0, 1e-7], [1.0, 0.0]])
    for scale, kw in (("group", {}), ("batch", {"batch_std": 5e-7})):
        adv = grpo.group_advantages(r, scale, **kw)
        assert adv[0, 0] < 0 < adv[0, 1] and adv[0].abs().max() < 0.1, (scale, adv)
        assert adv[1, 0] > 0 > adv[1, 1]


def test_policy_loss_kl_term_and_ratio_one_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    loss, m = grpo.policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask,
                               grpo.token_weights(mask), ref_logp=ref, beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1  # first token; the second is 0
    assert abs(loss.item() - 0.1 * k3 / 2) < 1e-6 and abs(m["kl"] - k3 / 2) < 1e-6
    # with mu = 1 (old = current) the surrogate's value is -A but its gradient is the policy
    # gradient A * grad logp
    logp2 = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss2, _ = grpo.policy_loss(logp2, logp2.detach(), torch.tensor([2.0]), mask,
                                grpo.token_weights(mask))
    loss2.backward()
    assert (abs(loss2.item() + 2.0) < 1e-6
            and torch.allclose(logp2.grad, torch.tensor([[-1.0, -1.0]])))


def test_reductions_differ_on_unequal_lengths():
    # Two responses with advantages +1 and -1 at ratio 1: per-token losses -1 (1 token) and +1 (3
    # tokens).
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    ppo = lambda lp, old, a, m, **kw: grpo.ppo_loss(lp, old, a, m, grpo.token_weights(m, **kw))  # noqa: E731
    seq, _ = ppo(logp, logp, adv, mask, reduction="sequence")
    tok, _ = ppo(logp, logp, adv, mask, reduction="token")
    const, _ = ppo(logp, logp, adv, mask, reduction="constant", max_len=5)
    assert abs(seq.item() - 0.0) < 1e-6            # (-1/1 + 3/3) / 2: each response weighs the same
    # (-1 + 3) / 4 valid tokens: each token weighs the same
    assert abs(tok.item() - 0.5) < 1e-6
    assert abs(const.item() - 0.2) < 1e-6          # (-1 + 3) / (2 * 5)
    # padding never counts: garbage in masked positions changes nothing
    logp_garbage = logp.clone()
    logp_garbage[0, 1:] = 7.0
    tok2, _ = ppo(logp_garbage, logp, adv, mask, reduction="token")
    assert abs(tok2.item() - 0.5) < 1e-6
    # a global token count (DDP / accumulation): two halves with num_tokens=4 sum to the whole
    halves = [ppo(logp[i:i + 1], logp[i:i + 1], adv[i:i + 1], mask[i:i + 1], reduction="token",
                  num_tokens=torch.tensor(4.0))[0] for i in range(2)]
    assert abs(sum(h.item() for h in halves) - 0.5) < 1e-6
    # and a global response count: halves that do not cancel (a reduction ignoring num_seqs doubles
    # them)
    adv2 = torch.tensor([1.0, 0.5])
    for reduction, whole in (("sequence", -0.75), ("constant", -(1 + 1.5) / (2 * 5))):
        full, _ = ppo(logp, logp, adv2, mask, reduction=reduction, max_len=5)
        halves = [ppo(logp[i:i + 1], logp[i:i + 1], adv2[i:i + 1], mask[i:i + 1],
                      reduction=reduction, num_seqs=2, max_len=5)[0] for i in range(2)]
        assert abs(full.item() - whole) < 1e-6 and abs(sum(h.item() for h in halves) - whole) < 1e-6


def test_the_on_policy_loss_value_is_the_advantages_mean_under_each_reduction():
    # one update per step: ratio 1, so the surrogate's value is -sum_i w_i A_i with each response's
    # total token weight w_i: -mean(A) under "sequence", -sum |o_i| A_i / sum |o_i| under "token"
    # (--algo dapo's default; not -mean(A)), -sum |o_i| A_i / (N T) under "constant"
    lengths = torch.tensor([5, 1, 3, 2])
    mask = (torch.arange(5)[None] < lengths[:, None]).float()                  # [4, 5]
    A = torch.tensor([0.9, -0.3, 0.5, -1.1])
    logp = -torch.rand(4, 5)
    want = {"sequence": -A.mean(), "token": -(lengths * A).sum() / lengths.sum(),
            "constant": -(lengths * A).sum() / 20}
    for reduction, v in want.items():
        loss = grpo.ppo_loss(logp, logp, A, mask, grpo.token_weights(mask, reduction))[0]
        assert abs(loss.item() - v.item()) < 1e-6, reduction
    assert abs(want["token"] - want["sequence"]) > 0.1


def test_filtered_responses_leave_the_denominators():
    # overlong filtering zeroes a truncated response's mask row: it is out of the loss, and out of N
    # too (as in verl; TRL keeps counting it, which shrinks the loss of every other response)
    logp, adv = torch.zeros(2, 2), torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for reduction, want in (("sequence", -1.0), ("token", -1.0), ("constant", -1.0)):
        loss, _ = grpo.ppo_loss(logp, logp, adv, mask,
                                grpo.token_weights(mask, reduction, max_len=2))
        assert abs(loss.item() - want) < 1e-6, reduction


def test_policy_loss_guards_log_ratio_and_dual_clip():
    # a log-ratio of 100 (a stale old log-prob) would give exp(100) = inf and a NaN gradient:
    # clamped to 20
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    w = grpo.token_weights(torch.ones(1, 2))
    loss, m = grpo.ppo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), w, eps_low=0.2,
                            eps_high=0.2)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    # dual-clip, A = -1: ratio 5 gives a PPO loss of 5, capped at clip_c * |A| = 3, with no gradient
    # there; ratio 2 (loss 2 < 3) is left alone
    logp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_()
    loss, m = grpo.ppo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), w,
                            clip_c=3.0)
    loss.backward()
    assert abs(loss.item() - (3.0 + 2.0) / 2) < 1e-5 and m["clip/dual_frac"] == 0.5
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0
    # positive advantages are never dual-clipped
    loss, m = grpo.ppo_loss(logp.detach(), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                            w, clip_c=3.0)
    assert m["clip/dual_frac"] == 0.0 and abs(loss.item() + 1.2) < 1e-5
    with pytest.raises(ValueError):
        grpo.ppo_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), w, clip_c=0.5)


def test_ppo_loss_takes_the_articles_advantage_column_and_refuses_other_shapes():
    # the article's adv.reshape(B * G, 1) and train.py's [N] give one loss and one gradient, at
    # ratio != 1 (clipping on some tokens) and unequal lengths; with [:, None] applied to [N, 1]
    # the loss broadcasts to [N, N, T] and comes out another number, with no error
    torch.manual_seed(0)
    N, T = 4, 6
    mask = (torch.arange(T)[None] < torch.tensor([6, 2, 4, 1])[:, None]).float()  # [N, T]
    old = -torch.rand(N, T) * 3
    adv = torch.tensor([1.2, -0.4, 0.7, -1.5])                                    # [N]
    w = grpo.token_weights(mask, "sequence")
    got = []
    for a in (adv, adv.reshape(N, 1)):
        logp = (old + 0.4 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))
                ).requires_grad_()
        for loss_fn in (grpo.ppo_loss, grpo.policy_loss):
            loss = loss_fn(logp, old, a, mask, w)[0]
            got.append((loss.item(), torch.autograd.grad(loss, logp)[0]))
    assert all(abs(v - got[0][0]) < 1e-7 and torch.equal(g, got[0][1]) for v, g in got)
    assert got[0][1].abs().sum() > 0 and got[0][1][mask == 0].abs().sum() == 0
    for bad in (adv.reshape(1, N), adv.reshape(N, 1, 1), adv[:3], adv[:, None].expand(N, T)):
        with pytest.raises(ValueError, match=r"advantages must be \[N\] or \[N, 1\]"):
            grpo.ppo_loss(logp, old, bad, mask, w)


def test_kl_metric_counts_valid_tokens_only():
    logp, mask = torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, 9.0, 9.0]])                  # garbage after the response's end
    _, m = grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, grpo.token_weights(mask),
                            ref_logp=ref, beta=0.1)
    assert abs(m["kl"] - (math.exp(-0.5) + 0.5 - 1)) < 1e-6


# ---------------------------------------------------------------------------------------------
# dapo.py: dynamic sampling over ranks, mini-batches of whole groups, DAPO with its fixes off is
# GRPO
# ---------------------------------------------------------------------------------------------

def test_dynamic_sampling_fills_then_stops_and_is_world_size_invariant():
    # informative: 2, then 3
    rounds = [[[1, 0], [1, 1], [0, 1], [0, 0]], [[1, 0], [1, 0], [0, 0], [0, 1]]]
    draw = lambda r: (fake_rollout(rounds[r], start=10 * r), {"round": r})  # noqa: E731
    kept, st, drawn = dapo.dynamic_sampling(draw, target=4, max_rounds=4)
    # the first two informative groups of round 0, then the first two of round 1, one part a round
    assert [[p[0] for p in k.prompts] for k in kept] == [[0, 2], [10, 11]]
    assert st["sampling/rounds"] == 2
    # every round drawn comes back whole (all 4 groups, kept or not), with what draw returned beside
    # it
    assert [(r.num_groups, r.prompts[0][0], info) for r, info in drawn] == [(4, 0, {"round": 0}),
                                                                            (4, 10, {"round": 1})]
    assert st["sampling/groups_drawn"] == 8 and st["sampling/batch_full"] == 1.0
    # round limit: trains on what it has
    kept, st, drawn = dapo.dynamic_sampling(draw, target=40, max_rounds=2)
    assert sum(k.num_groups for k in kept) == 5 and st["sampling/batch_full"] == 0.0
    assert len(drawn) == 2
    # two ranks, each drawing half of each round's prompts, in blocks (groups 0-1, 2-3) or every
    # other one (0, 2 and 1, 3, as train.draw_round spreads them): together they keep the same
    # groups (and with target 1, of informative groups 1 and 2 both keep group 1, the first in
    # prompt order, though every other one puts group 2 first in rank order)
    for share, target, want in [(lambda k: torch.arange(4) // 2 == k, 4, [0, 2, 10, 11]),
                                (lambda k: torch.arange(4) % 2 == k, 4, [0, 2, 10, 11]),
                                (lambda k: torch.arange(4) % 2 == k, 1, [1])]:
        kept, rounds = [], rounds if target == 4 else [[[0, 0], [1, 0], [1, 0], [0, 0]]]
        halves = {(r, k): fake_rollout(rounds[r], start=10 * r).select_groups(share(k))
                  for r in range(len(rounds)) for k in range(2)}
        for k in range(2):
            state = {"round": 0}

            def draw_k(r, k=k, state=state, halves=halves):
                state["round"] = r
                return halves[(r, k)], {}

            # all_gather's: both ranks' x, rank order
            def gather_k(mine, state=state, halves=halves):
                of = lambda h: (dapo.keep_groups(h.correct.view(-1, 2)) if mine.dtype == torch.bool  # noqa: E731
                                else h.index[::2])
                return [of(halves[(state["round"], j)]) for j in range(2)]
            parts, _, _ = dapo.dynamic_sampling(draw_k, target, len(rounds), gather=gather_k,
                                                rank=k)
            # a rank that keeps nothing gets no part
            kept += [p[0] for part in parts for p in part.prompts]
        assert sorted(kept) == want


class _StubRanks:
    """What minibatch_rows needs of Dist for rank `rank` of len(idx) ranks, each holding groups
    idx[r]."""

    def __init__(self, idx, rank):
        self.idx, self.rank = idx, rank

    def max(self, n):
        return max(len(i) for i in self.idx)

    def gather(self, x):
        b = max(len(i) for i in self.idx)
        return [torch.tensor(i + [-1] * (b - len(i))) for i in self.idx]


def test_minibatches_hold_the_same_groups_on_any_number_of_ranks():
    G = 2

    def groups(idx, K):  # the global prompt indices in each mini-batch, gathered over all ranks
        out = {}
        for rank, mine in enumerate(idx):
            roll = fake_rollout([[1, 0]] * len(mine)) if mine else Rollout.empty(G, 0)
            roll.index = torch.tensor(mine, dtype=torch.long).repeat_interleave(G)
            for k, rows in enumerate(update.minibatch_rows(roll, K, _StubRanks(idx, rank))):
                out.setdefault(k, []).extend(roll.index[rows][::G].tolist())
        return [sorted(v) for _, v in sorted(out.items())]

    # dynamic sampling's kept groups: rank 0 holds prompts 0, 2, 9 and rank 1 holds 4, 5, 12 (two
    # rounds)
    one = groups([[0, 2, 4, 5, 9, 12]], 3)
    assert one == [[0, 2], [4, 5], [9, 12]]             # thirds of the global prompt order
    assert groups([[0, 2, 9], [4, 5, 12]], 3) == one    # not each rank's own thirds
    assert groups([[0, 2, 9], [4, 5, 12]], 1) == [[0, 2, 4, 5, 9, 12]]
    # fewer groups than mini-batches: no empty updates
    assert groups([[0], [4]], 4) == [[0], [4]]
    assert groups([[], [4, 5]], 2) == [[4], [5]]        # a rank that kept nothing still takes part
    assert update.minibatch_rows(Rollout.empty(G, 0), 2, _StubRanks([[], []], 0)) == []


def test_every_rank_has_rows_in_every_mini_batch_update():
    # train.draw_round spreads a step's prompts over the ranks every W-th, so each mini-batch (a
    # K-th of the step's prompt order) holds as many rows on every rank: with blocks of prompts per
    # rank, at K >= W each update's rows would sit on one rank while the others ran zero-weight
    # passes
    from types import SimpleNamespace

    import train
    G, B, W = 4, 8, 2
    args = flags.parse_train_args(["--prompts-per-step", str(B), "--group-size", str(G)])
    sample = lambda model, prompts, *a, **k: fake_rollout([[0.0] * G] * len(prompts))  # noqa: E731
    task = setup.Task(rows=builtin.sample_problems(16, 1, False), encode=lambda p: [3, 4],
                      decode=lambda roll, i: "x", reward_fn=data.as_reward(lambda r, a: 1.0),
                      eos=[1], pad=0, sample=sample)
    idx = [train.draw_round(None, task, args, SimpleNamespace(rank=k, world=W),
                            40)[0].index[::G].tolist()
           for k in range(W)]
    assert sorted(idx[0] + idx[1]) == list(range(40, 40 + B))       # the step's prompts, each once
    for K in (1, 2, 4):                                               # up to a group per rank each
        rolls = [dataclasses.replace(fake_rollout([[0.0] * G] * len(i)),
                                     index=torch.tensor(i).repeat_interleave(G)) for i in idx]
        rows = [[r.stop - r.start for r in update.minibatch_rows(rolls[k], K, _StubRanks(idx, k))]
                for k in range(W)]
        assert rows[0] == rows[1] == [B * G // K // W] * K, (K, rows)


def test_dapo_with_fixes_off_is_grpo():
    """DAPO with all four fixes off resolves to exactly GRPO's settings (see also the end-to-end
    check), the run's length aside: on the built-in task DAPO stops at 30 steps, GRPO at 40
    (flags.BUILTIN_ALGO_DEFAULTS), the one setting that is not the objective's."""
    off = ["--eps-high", "0.2", "--reduction", "sequence", "--no-dynamic-sampling",
           "--no-overlong-filter", "--no-overlong-penalty", "--beta", "0.04", "--wrong-reward", "0"]
    a = flags.parse_train_args(["--algo", "dapo", *off])
    b = flags.parse_train_args(["--algo", "grpo"])
    assert {**vars(a), "algo": None, "steps": None} == {**vars(b), "algo": None, "steps": None}
    assert (a.steps, b.steps) == (30, 40)
    a = flags.parse_train_args(["--algo", "dapo", *off, "--model", "some/model"])  # no such split
    assert {**vars(a), "algo": None} == {**vars(flags.parse_train_args(
        ["--algo", "grpo", "--model", "some/model"])), "algo": None}
    # and the loss pieces: no truncation -> the filter changes nothing; token == sequence on equal
    # lengths
    logp, adv, mask = torch.randn(4, 3), torch.randn(4), torch.ones(4, 3)
    assert torch.equal(dapo.overlong_filter(mask, torch.zeros(4, dtype=torch.bool)), mask)
    s = grpo.policy_loss(logp, logp.detach(), adv, mask, grpo.token_weights(mask, "sequence"))[0]
    t = grpo.policy_loss(logp, logp.detach(), adv, mask, grpo.token_weights(mask, "token"))[0]
    assert torch.allclose(s, t)


# ---------------------------------------------------------------------------------------------
# update.py: update_policy against a hand-rolled full-batch loss
# ---------------------------------------------------------------------------------------------

def _hand_rolled_update(model, ref, roll, advantages, mask, args):
    """What update_policy must equal: per mini-batch (the k-th K-th of the groups), one loss over
    all its rows at
    once (per_response_logprobs, token_weights of the mini-batch's own rows), one backward, clip the
    whole gradient, one SGD step; old log-probs of the sampling policy, computed once before the
    first update. Returns the losses."""
    from functools import partial

    from logprobs import per_response_logprobs
    N, G = roll.response_ids.shape[0], roll.G
    every = slice(0, N)
    with torch.no_grad():
        # [N, T]
        old = per_response_logprobs(model, roll, every, args.temperature)[0]
        ref_logp = per_response_logprobs(ref, roll, every,
                                         args.temperature)[0] if ref is not None else None
    groups, losses = N // G, []
    # p * K // B == k
    bounds = [-(-k * groups // args.mini_batches) * G for k in range(args.mini_batches + 1)]
    for _ in range(args.mu):
        for a, b in zip(bounds, bounds[1:]):
            s = slice(a, b)
            model.zero_grad(set_to_none=True)
            # [n, T]
            logp = per_response_logprobs(model, roll, s, args.temperature)[0]
            # [n, T]
            w = grpo.token_weights(mask[s], args.reduction, max_len=args.max_new_tokens)
            ppo = partial(grpo.ppo_loss, eps_low=args.eps_low, eps_high=args.eps_high)
            loss, _ = grpo.policy_loss(logp, old[s], advantages[s], mask[s], w, ppo,
                                       ref_logp=None if ref is None else ref_logp[s],
                                       beta=args.beta)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
            with torch.no_grad():
                for p in model.parameters():
                    p -= args.lr * p.grad
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reduction,grad_clip,beta,max_new_tokens", [
    # overlong-filtered mask: the global token count is the filtered one's
    ("token", 0.0, 0.0, 20),
    # Dr. GRPO divides by --max-new-tokens, not by the rollout's width (20)
    ("constant", 0.0, 0.0, 32),
    # the clip acts on the whole mini-batch's gradient; the KL term to a reference
    ("sequence", 0.05, 0.04, 20),
])
def test_update_policy_equals_a_hand_rolled_full_batch_update(tiny_model, reduction, grad_clip,
                                                              beta, max_new_tokens):
    # 3 groups of 4 in 2 mini-batches (groups 0-1, then group 2), micro-batches of 3 rows that cut
    # groups, mu 1 (DAPO's recipe): the second update is off-policy, so the ratio leaves 1 and the
    # clip bounds act
    import contextlib
    import copy
    from types import SimpleNamespace

    from infra import parallel
    t = 0.7
    roll = mixed_rollout(tiny_model, t)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)  # each response's prompt
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(1))
    mask = dapo.overlong_filter(roll.mask, roll.truncated)
    args = SimpleNamespace(micro_batch_size=3,
                           micro_batch_tokens=10**6, mini_batches=2, mu=1, temperature=t,
                           reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=max_new_tokens, eps_low=0.2, eps_high=0.28, clip_c=0.0,
                           tis_cap=0.0, off_policy_mask=0.0, top_p=1.0,
                           entropy_coef=0.0, beta=beta, kl="k3", grad_clip=grad_clip, lr=2.0)
    mine, hand = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    refs = [copy.deepcopy(tiny_model).requires_grad_(False) if beta else None for _ in range(2)]
    learner = update.Learner(mine, mine, refs[0], torch.optim.SGD(mine.parameters(), lr=args.lr),
                             contextlib.nullcontext)
    stats = update.update_policy(learner, roll, advantages, mask, args, parallel.Dist("cpu"))
    first, rest = stats.first, stats.rest
    losses = _hand_rolled_update(hand, refs[1], roll, advantages, mask, args)
    # the ratio left 1
    assert first["updates"] + rest["updates"] == 2 and rest["ratio/mean"] != rest["tokens"]
    assert (first["loss"] == pytest.approx(losses[0], abs=1e-5)
            and rest["loss"] == pytest.approx(losses[1], abs=1e-5))
    moved = max((p - q).abs().max().item() for p,
                q in zip(hand.parameters(), tiny_model.parameters()))
    diff = max((p - q).abs().max().item() for p, q in zip(mine.parameters(), hand.parameters()))
    assert moved > 1e-2 and diff <= 1e-5 * max(1.0, moved), (moved, diff)


# ---------------------------------------------------------------------------------------------
# logprobs.py: the token kernel (log-probs, entropy) and the shared-prefix training forward
# (rollout_logprobs) against the per-response one
# ---------------------------------------------------------------------------------------------

def test_token_logprobs_matches_log_softmax_and_has_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = lm_head.CHUNK_ELEMENTS["cpu"]
    try:
        lm_head.CHUNK_ELEMENTS["cpu"] = 4  # several chunks
        got = logprobs.token_logprobs(logits, ids)
    finally:
        lm_head.CHUNK_ELEMENTS["cpu"] = old
    assert torch.allclose(got, ref, atol=1e-6)
    got.sum().backward()
    g_ref = torch.autograd.grad(ref.sum(), logits)[0]
    assert torch.allclose(logits.grad, g_ref, atol=1e-6)


def test_entropy_is_the_distribution_entropy_not_the_sampled_nll():
    V = 8
    uniform = torch.zeros(1, 1, V)
    assert torch.allclose(logprobs.token_entropy(uniform), torch.tensor([[math.log(V)]]))
    # two equally likely tokens, the rest ~0: entropy log 2, while the NLL of a sampled token is log
    # 2 too, but with probabilities [0.9, 0.1] the entropy is 0.325 and a sampled token's NLL is
    # 0.105 or 2.303.
    logits = torch.log(torch.tensor([[[0.9, 0.1]]]))
    assert (abs(logprobs.token_entropy(logits).item()
                - (-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))) < 1e-5)


def test_entropy_is_finite_with_masked_logits():
    # a -inf logit (a masked vocabulary entry) has p = 0 and p log p = 0, not 0 * -inf = NaN
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = logprobs.token_entropy(logits)
    h.sum().backward()
    assert abs(h.item() - math.log(2)) < 1e-6 and torch.isfinite(logits.grad).all()


def _naive_logprobs(logits, ids, temperature=1.0):
    return (torch.log_softmax(logits.float() / temperature, -1)
            .gather(-1, ids[..., None]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_in_blocks_equals_the_naive_form(dtype, monkeypatch):
    # V = 50,000 in blocks of 3 rows; the logits are a slice like `.logits[:, :-1]` (not
    # contiguous), so each response's 5 rows make a block of 3 and one of 2. Values and gradients
    # equal log_softmax + gather's.
    torch.manual_seed(0)
    V = 50_000
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    full = (torch.randn(2, 6, V) * 3).to(dtype).requires_grad_(True)
    logits, ids = full[:, :-1], torch.randint(0, V, (2, 5))
    for t in (1.0, 0.7):
        got, want = (logprobs.token_logprobs(logits, ids, temperature=t),
                     _naive_logprobs(logits, ids, t))
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4)
        (g_got,), (g_want,) = torch.autograd.grad(got.sum(), full), torch.autograd.grad(want.sum(),
                                                                                        full)
        assert g_got.dtype == dtype
        assert torch.allclose(g_got.float(), g_want.float(), atol=1e-6 if dtype == torch.float32
                              else 1e-2)
    ent = logprobs.token_entropy(logits, temperature=0.7)
    logp = torch.log_softmax(logits.float() / 0.7, -1)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_allocates_one_block_forward_and_one_gradient_backward(dtype, monkeypatch):
    # Every storage an aten op returns is recorded: the forward's largest is one float32 block (2
    # rows x V), never [N, T, V]; in the backward the only vocabulary-sized one is the gradient
    # itself.
    from torch.utils._python_dispatch import TorchDispatchMode
    V = 1000
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 2 * V)
    logits = torch.randn(3, 4, V).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (3, 4))

    class Storages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            # data pointer -> bytes, for every storage an op returns other than the logits'
            self.bytes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if (isinstance(t, torch.Tensor)
                        and t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()):
                    self.bytes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out

    block = 2 * V * 4
    with Storages() as fwd:
        out = logprobs.token_logprobs(logits, ids)
    assert max(fwd.bytes.values()) <= block
    with Storages() as bwd:
        out.sum().backward()
    sizes = sorted(bwd.bytes.values())
    assert sizes[-1] == logits.numel() * logits.element_size() and sizes[-2] <= block
    assert torch.allclose(logits.grad.float(),
                          torch.autograd.grad(_naive_logprobs(logits, ids).sum(),
                                              logits)[0].float(),
                          atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_token_entropy_gradient_equals_autograd_of_the_naive_form(monkeypatch):
    # blocks of 3 rows over a non-contiguous slice, temperature 0.7: the custom backward
    # dH/dx_v = -s p_v (log p_v + H) equals autograd through log_softmax, exp, sum.
    torch.manual_seed(0)
    V = 300
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    for dtype, atol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        full = (torch.randn(2, 6, V) * 3).to(dtype).requires_grad_(True)
        # w: an arbitrary upstream gradient
        logits, w = full[:, :-1], torch.randn(2, 5)
        got = logprobs.token_entropy(logits, temperature=0.7)
        logp = torch.log_softmax(logits.float() / 0.7, -1)
        want = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(got, want, atol=1e-4)
        (g_got,), (g_want,) = torch.autograd.grad((got * w).sum(),
                                                  full), torch.autograd.grad((want * w).sum(), full)
        assert g_got.dtype == dtype and torch.allclose(g_got.float(), g_want.float(), atol=atol)
        # and without autograd, as the no-grad passes call it
        with torch.no_grad():
            assert torch.allclose(logprobs.token_entropy(logits, 0.7), want, atol=1e-4)


def _micro_batches(N, mb):
    return [slice(k, min(k + mb, N)) for k in range(0, N, mb)]


@pytest.mark.parametrize("kind,keep,prompts",
                         [("llama", 0.8, PROMPTS), ("llama", 1.0, PROMPTS),
                          ("mistral", 1.0, PROMPTS),
                                                ("gpt2", 1.0, PROMPTS),
                                                ("llama", 0.8, LONG_PROMPTS),
                                                ("mistral", 1.0, LONG_PROMPTS),
                                                ("gpt2", 1.0, LONG_PROMPTS)],
                         ids=["llama", "llama-buckets", "mistral", "gpt2", "llama-long",
                              "mistral-long", "gpt2-long"])
def test_shared_prefix_forward_equals_per_response(tiny_model, kind, keep, prompts, monkeypatch):
    # mistral: sliding-window layers (window 5) in the cache; keep 1.0: every slice of two or more
    # responses is cut into up to four length buckets (0.8, the default, keeps these slices
    # whole); gpt2: absolute positions; -long: prompts of 141-146 tokens sharing a 140-token prefix
    from functools import partial

    from logprobs import per_response_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = {"llama": lambda: tiny_model, "mistral": lambda: tiny("mistral", torch.float32),
             "gpt2": tiny_gpt2}[kind]()
    t, G = 0.7, 4
    roll = mixed_rollout(model, t, G, prompts=prompts)
    N, T_all = roll.response_ids.shape
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(N, generator=g)
    # ratio != 1, so clipping acts on some tokens
    old = roll.logprobs + 0.1 * torch.randn(N, T_all, generator=g)
    ref = roll.logprobs + 0.1 * torch.randn(N, T_all, generator=g)
    params = list(model.parameters())
    # micro-batches of 5 and 3 responses cut groups of 4; N = 12 whole; values, entropies, mask
    for mb in (5, 3, N):
        for s in _micro_batches(N, mb):
            with torch.no_grad():
                (a, ea, ma), (b, eb, mb_) = (f(model, roll, s, t, with_entropy=True)
                                             for f in (rollout_logprobs, per_response_logprobs))
            assert a.shape == b.shape == (s.stop - s.start, T_all) and torch.equal(ma, mb_)
            assert ((a * ma).sub(b * ma).abs().max() <= 1e-4
                    and (ea * ma).sub(eb * ma).abs().max() <= 1e-4)
    # gradients of the loss summed over micro-batches of 5, for every reduction, with an entropy
    # bonus
    for reduction in ("sequence", "token", "constant"):
        grads = []
        for f in (rollout_logprobs, per_response_logprobs):
            model.zero_grad(set_to_none=True)
            for s in _micro_batches(N, 5):
                logp, ent, mask = f(model, roll, s, t, with_entropy=True)
                w = grpo.token_weights(mask, reduction, roll.mask.sum(), T_all, N)   # [n, T]
                ppo = partial(grpo.ppo_loss, eps_low=0.2, eps_high=0.28)
                loss, _ = grpo.policy_loss(logp, old[s], adv[s], mask, w, ppo, ref_logp=ref[s],
                                           beta=0.04)
                (loss - 0.01 * (ent * mask).sum() / roll.mask.sum()).backward()
            grads.append(torch.cat([p.grad.flatten() for p in params]))
        assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[1].abs().max(), reduction
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind,temperature,keep,prompts", [
    ("llama", 1.0, 0.8, PROMPTS), ("llama", 0.7, 0.8, PROMPTS), ("llama", 0.7, 1.0, PROMPTS),
    ("gpt2", 0.7, 1.0, PROMPTS),
    ("llama", 0.7, 0.8, LONG_PROMPTS), ("gpt2", 0.7, 1.0, LONG_PROMPTS)],
    ids=["llama-t1", "llama", "llama-buckets", "gpt2", "llama-long", "gpt2-long"])
def test_training_logprobs_equal_the_samplers(tiny_model, kind, temperature, keep, prompts,
                                              monkeypatch):
    # the tokens' log-probs under the training forward are the ones the sampler drew them with: an
    # off-by-one position, position ids that ignore the left padding (gpt2: absolute positions), or
    # a dropped temperature all break this
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = tiny_model if kind == "llama" else tiny_gpt2()
    roll = mixed_rollout(model, temperature, prompts=prompts)
    N = roll.response_ids.shape[0]
    for mb in (N, 5):
        with torch.no_grad():
            logp = torch.cat([rollout_logprobs(model, roll, s, temperature)[0]
                              for s in _micro_batches(N, mb)])
        assert ((logp - roll.logprobs) * roll.mask).abs().max() <= 1e-4


def test_length_buckets_split_only_when_it_pays():
    # lengths 40, 20, 38, 18, 40, 19 in one batch: 6 x 40 = 240 positions; short rows {18, 19, 20}
    # and long rows {38, 40, 40} padded apart: 3 x 20 + 3 x 40 = 180 = 0.75 of it (<= 0.8: split).
    # 40, 38, 39, 37: one batch.
    short, long = logprobs.length_buckets(torch.tensor([40, 20, 38, 18, 40, 19]))
    assert sorted(short.tolist()) == [1, 3, 5] and sorted(long.tolist()) == [0, 2, 4]
    assert ([b.tolist() for b in logprobs.length_buckets(torch.tensor([40, 38, 39, 37]))]
            == [[0, 1, 2, 3]])
    assert [b.tolist() for b in logprobs.length_buckets(torch.tensor([7]))] == [[0]]
    # 4 each of 4, 20 and 64: 768 positions as one; cut at 8 (160 + 256 = 416, 0.54); then the short
    # part (160) at 4 (16 + 80 = 96, 0.6): three buckets, 352 positions. At most two: the first cut.
    lengths = torch.tensor([4, 64, 20] * 4)
    three = logprobs.length_buckets(lengths)
    assert [sorted(lengths[b].tolist()) for b in three] == [[4] * 4, [20] * 4, [64] * 4]
    assert sorted(torch.cat(three).tolist()) == list(range(12))
    two = logprobs.length_buckets(lengths, max_buckets=2)
    assert [sorted(lengths[b].tolist()) for b in two] == [[4] * 4 + [20] * 4, [64] * 4]
    # the cut that saves most goes first: after {1, 1, 10, 10} | {50, 50, 100, 100} (440 of 800),
    # cutting the long part saves 100 positions and the short part 18; a third bucket is the former
    lengths = torch.tensor([100, 1, 50, 10, 100, 1, 50, 10])
    assert [sorted(lengths[b].tolist()) for b in logprobs.length_buckets(lengths, 3)] == [
        [1, 1, 10, 10], [50, 50], [100, 100]]


def test_rollout_logprobs_rejects_bad_slices(tiny_model):
    roll = mixed_rollout(tiny_model, 1.0)
    for bad in (slice(3, 3), slice(0, 12, 2)):
        with pytest.raises(ValueError, match="slice"):
            rollout_logprobs(tiny_model, roll, bad, 1.0)


# ---------------------------------------------------------------------------------------------
# train.py: Step 2's rewards and the overlong filter on a real step, the batch std over ranks
# ---------------------------------------------------------------------------------------------


def test_overlong_filter_masks_the_truncated_rows_the_update_gets(tiny_run_inputs, tmp_path,
                                                                   monkeypatch):
    # one step of train.py in this process with 3 new tokens (most responses truncated): with the
    # filter (dapo's default) update_policy gets the loss mask with every truncated row zeroed,
    # without it the rollout's own mask; the same samples either way
    updates = spy_on(monkeypatch, update, "update_policy")
    masks = {}
    for name, extra in (("on", []), ("off", ["--no-overlong-filter"])):
        one_step(tiny_run_inputs, tmp_path / name, "--max-new-tokens", "3",
                  "--overlong-cache", "1", *extra)
        (_, roll, _, mask, *_), _ = updates.pop()
        masks[name] = mask
    assert 0 < int(roll.truncated.sum()) < roll.truncated.numel()
    assert torch.equal(masks["off"], roll.mask)
    assert torch.equal(masks["on"], roll.mask * ~roll.truncated[:, None])
    assert masks["on"].sum() < masks["off"].sum()


def test_rewards_and_reward_mean_carry_wrong_reward_and_the_overlong_penalty(tiny_model):
    # Step 2 on the tiny model: a right answer scores 1, a wrong one --wrong-reward, plus DAPO's
    # soft overlong penalty (Eq. 13); reward/mean is their mean over every drawn sample (z-scored
    # advantages would hide both)

    import train
    from infra import parallel
    args = flags.parse_train_args(["--algo", "dapo", "--wrong-reward", "-0.5", "--prompts-per-step",
                                   "3", "--group-size", "4",
                             "--max-new-tokens", "8", "--overlong-cache", "4", "--device", "cpu"])
    rows = [{"prompt": str(i), "answer": "even"} for i in range(3)]
    task = setup.Task(rows, lambda p: PROMPTS[int(p)], lambda roll,
                      i: " ".join(map(str, roll.response_ids[i, : roll.lengths[i]].tolist())),
                      data.as_reward(lambda text, answer: float(int(text.split()[0]) % 2 == 0)),
                      eos=[1], pad=0)
    roll, _ = train.draw_round(tiny_model, task, args, parallel.Dist("cpu"), 0)
    right = torch.tensor([float(int(roll.response_ids[i, 0]) % 2 == 0) for i in range(12)])
    L = roll.lengths.float()
    # 0 up to 8 - 4 tokens, then down to -1 at 8
    penalty = torch.where(L <= 4, 0.0, (4 - L) / 4)
    want = torch.where(right == 1, 1.0, -0.5) + penalty
    assert 0 < right.sum() < 12 and (penalty < 0).any() and torch.equal(roll.correct, right)
    assert torch.allclose(roll.rewards, want)
    s = metrics.drawn_sums([roll])
    assert (s["reward"] / s["samples"] == pytest.approx(float(want.mean()))
            and s["correct"] == float(right.sum()))


class _TwoRanks:
    """Dist of one of two ranks: sum adds the other rank's share (what all_reduce returns)."""
    def __init__(self, other):
        self.other = other

    def sum(self, x):
        return x.double() + self.other


def test_batch_std_is_bessel_corrected_over_all_ranks():
    import train
    from infra import parallel
    r = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -0.5])
    halves = []
    for part in (r, r[:4], r[4:]):
        roll = fake_rollout([[1, 0, 0, 1]] * (len(part) // 4))
        roll.rewards = part
        halves.append(roll)
    # n - 1
    assert (train.reward_std(halves[0], parallel.Dist("cpu"))
            == pytest.approx(float(r.double().std()), abs=1e-12))
    # rank k - 1 of 2: its own rewards, and the other rank's count, sum and sum of squares
    for k in (1, 2):
        other = r[4:].double() if k == 1 else r[:4].double()
        sums = torch.stack([torch.tensor(4.0, dtype=torch.float64), other.sum(),
                            (other * other).sum()])
        assert (train.reward_std(halves[k], _TwoRanks(sums))
                == pytest.approx(float(r.double().std()), abs=1e-12))
    assert train.reward_std(Rollout.empty(4, 0), parallel.Dist("cpu")) == 0.0
