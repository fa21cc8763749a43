"""Tests: the article walk-through and the unit tests (hand-sized numeric cases, equivalences).

The first section follows the article step by step (GRPO's Steps 1-4 on its G = 4 example, then
DAPO's Eq. 10-13), each case worked by hand; then the shared fixtures and helpers (tiny_model,
tiny_run_inputs, PROMPTS, _tiny_flags, and the rewards `--reward test_grpo:NAME` names: has_x,
flip_x, trl_length, ...), then one section per module in the order grpo, variants, dapo, update,
logprobs, sampler, verifier, builtin, data, evaluate, train and flags, checkpoint and parallel,
metrics/lora/integrations. Nothing here is @slow. The other tests are in tests/, by kind: the
end-to-end runs through subprocess and torchrun (test_runs.py, launched by launch.py), bench and
ablate (test_tools.py), --rollout vllm (test_vllm.py), GPUs (test_gpu.py), the docs (test_docs.py);
tests/conftest.py hands them this file's fixtures. All of them:

    python -m pytest -q test_grpo.py tests
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
import warnings

import pytest
import torch

import dapo
import grpo
import logprobs
import update
import verifier
from infra import (
    builtin,
    checkpoint,
    data,
    errors,
    flags,
    metrics,
    models,
    rollout,
    setup,
    static_decode,
    variants,
)
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups
from verifier import (
    canonical,
    canonical_answer,
    extract_answer,
    format_reward,
    parse_number,
    verify,
)

HERE = os.path.dirname(os.path.abspath(__file__))



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
        want = _full_forward_logprobs(tiny_model, PROMPTS[i // G], row[:L], temperature)
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
                       buckets=True):
        logp = model.logp[rows]                                               # [n, 3]
        return logp, torch.zeros_like(logp) if with_entropy else None, roll.mask[rows]

    monkeypatch.setattr(update, "rollout_logprobs", given_logprobs)
    policy, ref = _GivenLogprobs(pi.log()), _GivenLogprobs(pi_ref.log()).requires_grad_(False)
    roll = Rollout(prompts=[[5]], G=4, pad_token_id=0,
                   response_ids=torch.zeros(4, 3, dtype=torch.long), mask=mask,
                   lengths=lengths, truncated=torch.zeros(4, dtype=torch.bool), logprobs=pi.log(),
                   index=torch.zeros(4, dtype=torch.long))
    args = SimpleNamespace(micro_batch_size=3, mini_batches=1, mu=1, temperature=1.0,
                           reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=3, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
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


# -- The whole example, printed by python grpo.py: Steps 1-4, then three of DAPO's fixes --
S1, S2 = "Step 1: Rollout 采样", "Step 2: Reward 计算"


S3, S4 = "Step 3: Advantage 估计", "Step 4: PPO Loss 计算"


LN2 = math.log(2)


# (article step, part of the quantity's name, its values, part of the note where the article
# differs or None). By hand: A = [0.5, 0.5, 0.5, -1.5] (Step 3); ratios [1.1, 1.04, 1.25, 0.9]
# give rho A = [0.55, 0.52, 0.625, -1.35]; eps 0.2 clips o_3's 1.25 to 1.2 (0.6 < 0.625, so min
# takes it); lengths [3, 2, 4, 6]: 15 tokens, T = 6; k3 of r = pi_ref / pi in {1, 1/2, 2} is 0,
# log 2 - 1/2, 1 - log 2.
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
    (S4, "clipped above", [0, 0, 1, 0], None),
    (S4, "-min(rho_i A_i", [-0.55, -0.52, -0.6, 1.35], None),
    (S4, "1 / (G |o_i|)", [1 / 12, 1 / 8, 1 / 16, 1 / 24], None),
    (S4, "--reduction sequence", [(-0.55 - 0.52 - 0.6 + 1.35) / 4], None),        # -0.08
    # the sum over tokens, 3 * -0.55 + 2 * -0.52 + 4 * -0.6 + 6 * 1.35 = 3.01, over G * T = 24
    (S4, "--reduction constant", [3.01 / 24], "Dr. GRPO"),
    (S4, "pi_ref / pi_theta", [1, 0.5, 2, 1], None),
    (S4, "grpo.kl_k3", [0, LN2 - 0.5, 1 - LN2, 0], None),
    (S4, "exp(new - ref) - 1", [0, 1, -0.5, 0], "not a KL estimate"),         # pi / pi_ref - 1
    (S4, "grpo.kl_term", [(LN2 - 0.5 + 1 - LN2) / 4], None),                  # 0.125
    (S4, "grpo.policy_loss", [-0.08 + 0.04 * 0.125], None),
    # -A rho / G on each response's tokens, summed; 0 where clipped
    (S4, "训练效果", [-0.55 / 4, -0.52 / 4, 0, 1.35 / 4], "clipped o_3: no push"),
    ("Clip-Higher", "eps_high 0.28", [-0.55, -0.52, -0.625, 1.35], None),     # 1.25 < 1.28
    ("Token-Level Loss", "1 / sum |o_i|", [1 / 15] * 4, None),
    ("Token-Level Loss", "--reduction token", [3.01 / 15], None),
    ("Token-Level Loss", "DAPO's loss", [(3.01 - 4 * 0.025) / 15], None),   # o_3 at -0.625
    ("Dynamic Sampling", "grpo.constant_groups", [0], None),                  # 3 of 4 right
    ("Dynamic Sampling", "all-right group", [0, 0, 0, 0], "refill the batch"),
]


def test_article_example_prints_the_articles_numbers(capsys):
    # every line of `python grpo.py` against ARTICLE_EXAMPLE (worked by hand above), to the 4
    # decimals printed, with a note where the article's own text says otherwise
    import re
    import runpy
    lines = grpo.article_example()
    assert len(lines) == len(ARTICLE_EXAMPLE)
    for line, (step, quantity, want, note) in zip(lines, ARTICLE_EXAMPLE):
        got_step, got_quantity, values, *got_note = line.split(" | ")
        assert (got_step, quantity in got_quantity) == (step, True), line
        assert len(got_note) == (note is not None) and (note is None or note in got_note[0]), line
        if isinstance(want, str):
            assert values == want, line
            continue
        numbers = values.split()
        assert all(re.fullmatch(r"-?\d+\.\d{4}|\d+", x) for x in numbers), line
        assert [float(x) for x in numbers] == pytest.approx(want, abs=5.001e-5), line
    runpy.run_path(os.path.join(HERE, "grpo.py"), run_name="__main__")
    assert capsys.readouterr().out == "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Shared helpers: tiny models, the tiny run's inputs, and running train.py in a subprocess or under
# torchrun
# ---------------------------------------------------------------------------------------------

def _fake_rollout(rewards: list[list[float]], start: int = 0) -> Rollout:
    B, G = len(rewards), len(rewards[0])
    N = B * G
    return Rollout(prompts=[[start + i] for i in range(B)], G=G, pad_token_id=0,
                   response_ids=torch.ones(N, 2, dtype=torch.long), mask=torch.ones(N, 2),
                   lengths=torch.full((N,), 2), truncated=torch.zeros(N, dtype=torch.bool),
                   logprobs=torch.zeros(N, 2), correct=torch.tensor(rewards).view(-1),
                   # [N] prompt positions
                   index=torch.arange(start, start + B).repeat_interleave(G))


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]]


# prompts at a real run's shape: a shared 140-token instruction (longer than a 128-token KV block),
# then each prompt's own 3, 6 and 1 tokens, so the prompts still differ in length and are
# left-padded
INSTRUCTION = [int(t) for t in torch.randint(2, 40, (140,),
                                             generator=torch.Generator().manual_seed(4))]


LONG_PROMPTS = [INSTRUCTION + p for p in PROMPTS]


def _full_forward_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[:, len(prompt) - 1:-1] / temperature
    return logprobs.token_logprobs(logits, ids[:, len(prompt):])[0]


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """A tiny random model with the built-in tokenizer, and small train / eval JSONL files."""
    d = tmp_path_factory.mktemp("tiny")
    tok = builtin.make_tokenizer()
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=32, intermediate_size=64,
                                                       num_layers=2), len(tok))
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    for name, rows in (("train.jsonl", builtin.sample_problems(64, 1, False)),
                       ("eval.jsonl", builtin.sample_problems(8, 2, True))):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a random model never answers right: this reward (through --reward) gives its groups mixed
    # rewards
    (d / "tinyreward.py").write_text("def has_x(response, answer):\n    return float('x' in "
                                     "response)\n")
    return d


def has_x(response: str, answer: str) -> float:
    """A reward a random model earns sometimes (it never answers right): the tiny runs' groups are
    mixed."""
    return float("x" in response)


def _tiny_flags(d, out):
    """train.py flags for a short CPU run of the tiny model on the tiny data (flags given after
    these win)."""
    return ["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--eval-data",
            str(d / "eval.jsonl"),
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--lr",
            "1e-2", "--reward", "test_grpo:has_x", "--out", str(out), "--device", "cpu"]


def _weights(folder):
    from transformers import AutoModelForCausalLM
    return {k: v.clone() for k,
            v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _one_step(d, out, *extra):
    import train
    train.main([*_tiny_flags(d, out), "--steps", "1", "--eval-every", "5", "--grad-clip", "0",
                "--algo", "dapo", "--no-dynamic-sampling", *extra])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x][-1]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


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


def test_kl_metric_counts_valid_tokens_only():
    logp, mask = torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, 9.0, 9.0]])                  # garbage after the response's end
    _, m = grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, grpo.token_weights(mask),
                            ref_logp=ref, beta=0.1)
    assert abs(m["kl"] - (math.exp(-0.5) + 0.5 - 1)) < 1e-6


def _reduce_by_hand(per_token, mask, reduction="sequence", num_tokens=None, max_len=None,
                    num_seqs=None):
    """The three reductions written out (the reference for token_weights): "sequence" = the sum of
    each
    response's token mean / num_seqs (default: the non-empty rows), "token" = the masked sum /
    num_tokens (default: mask.sum()), "constant" = the masked sum / (num_seqs * max_len) (default
    max_len: T)."""
    rows = mask.sum(-1)                                                       # [N]
    n = (rows > 0).sum() if num_seqs is None else num_seqs
    if reduction == "sequence":
        return ((per_token * mask).sum(-1) / rows.clamp_min(1)).sum() / n
    if reduction == "token":
        return (per_token * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)
    return (per_token * mask).sum() / (n * (mask.shape[1] if max_len is None else max_len))


# ---------------------------------------------------------------------------------------------
# variants.py: GSPO, CISPO, KL estimators, entropy bonus, truncated importance sampling
#
# The references below restate the formulas of verl 0.9.1 (verl/trainer/ppo/core_algos.py, read on
# PyPI's verl==0.9.1): compute_policy_loss_gspo, compute_policy_loss_cispo, kl_penalty and agg_loss.
# verl cannot be imported here (it pulls ray, omegaconf, ...); the same inputs were also checked
# once against the real functions (see the README section "Other objectives").
# ---------------------------------------------------------------------------------------------

def _verl_agg(loss_mat, mask, mode, num_tokens=None, num_seqs=None):
    """verl agg_loss: "token-mean" = masked sum / global tokens; "seq-mean-token-mean" = the mean
    over
    non-empty responses of each one's token mean (token count + 1e-8), summed and / global
    responses."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)
    per_row = mask.sum(-1)
    row_mean = (loss_mat * mask).sum(-1) / (per_row + 1e-8)
    return (row_mean * (per_row > 0)).sum() / ((per_row > 0).sum() if num_seqs is None
                                               else num_seqs)


def _verl_gspo(old_logp, logp, adv_tok, mask, clip_low, clip_high, mode, rollout_is_weights=None):
    """verl compute_policy_loss_gspo: token ratio with value s_i = exp(masked mean of logp - old)
    and the
    gradient of logp (log-space: sg(log s_i) + logp - sg(logp), capped at 10), PPO's max of the two
    losses."""
    log_s = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_tok = torch.clamp(log_s.detach()[:, None] + logp - logp.detach(), max=10.0)
    s = log_tok.exp()
    loss_mat = torch.maximum(-adv_tok * s, -adv_tok * s.clamp(1 - clip_low, 1 + clip_high))
    return _verl_agg(loss_mat * (1 if rollout_is_weights is None else rollout_is_weights), mask,
                     mode)


def _verl_cispo(old_logp, logp, adv_tok, mask, clip_low, clip_high, mode, rollout_is_weights=None):
    """verl compute_policy_loss_cispo: -sg(clamp(exp(clamp(logp - old, -20, 20)), 1 - low, 1 +
    high)) * A * logp;
    rollout_is_weights (verl's rollout correction, e.g. truncated IS) multiply each token's loss."""
    w = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0)).clamp(1 - clip_low,
                                                                   1 + clip_high).detach()
    return _verl_agg(-w * adv_tok * logp * (1 if rollout_is_weights is None
                                            else rollout_is_weights), mask, mode)


def _verl_kl(logp, ref_logp, name):
    """verl kl_penalty for "k1", "mse" (k2) and "low_var_kl" (k3) without its two clamps."""
    if name == "k1":
        return logp - ref_logp
    if name == "mse":
        return (logp - ref_logp).square() / 2
    r = torch.exp(ref_logp - logp)  # pi_ref / pi_theta
    return r - torch.log(r) - 1


def _random_policy_batch(seed, spread, N=6, T=7):
    """logp [N, T] (requires grad), old logp, advantages [N], mask from lengths 1..T (no empty
    row)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(N, T, generator=g, dtype=torch.float64) - 2.0
    logp = (old + spread * torch.randn(N, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    lengths = torch.tensor([1, T, 3, 5, 2, T][:N])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    return logp, old, adv, mask


def _value_and_grad(fn, logp):
    logp.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), logp.grad.clone()


@pytest.mark.parametrize("name,mine", [("k1", grpo.kl_k1), ("mse", grpo.kl_k2),
                                       ("low_var_kl", grpo.kl_k3)])
def test_kl_estimators_equal_verl_kl_penalty(name, mine):
    logp, _, _, _ = _random_policy_batch(0, 1.0)
    ref = torch.randn_like(logp) - 2.0
    got, g_got = _value_and_grad(lambda: mine(logp, ref).sum(), logp)
    want, g_want = _value_and_grad(lambda: _verl_kl(logp, ref, name).sum(), logp)
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(g_got, g_want, atol=1e-12)
    # by hand: pi = 0.5, pi_ref = 0.25: k1 = log 2, k2 = (log 2)^2 / 2, k3 = 0.5 - log 0.5 - 1 = log
    # 2 - 0.5
    a, b = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    hand = {"k1": math.log(2), "mse": math.log(2) ** 2 / 2, "low_var_kl": math.log(2) - 0.5}[name]
    assert abs(mine(a, b).item() - hand) < 1e-6


def test_kl_estimators_expected_gradients_on_policy():
    # Exact expectations over a 5-token vocabulary: E_{x ~ pi}[grad k(x)] with pi's weights
    # detached. k2's equals grad KL(pi || ref) (Liu et al., arXiv 2510.01555), k1's is 0, and k3's
    # is the gradient of the reverse KL(ref || pi), hence biased for KL(pi || ref).
    theta, ref = torch.randn(5, dtype=torch.float64,
                             requires_grad=True), torch.log_softmax(torch.randn(5).double(), 0)

    def grad(f):
        theta.grad = None
        f().backward()
        return theta.grad.clone()

    logp = lambda: torch.log_softmax(theta, 0)  # noqa: E731
    exp_grad = lambda k: grad(lambda: (logp().exp().detach() * k(logp(), ref)).sum())  # noqa: E731
    forward_kl = grad(lambda: (logp().exp() * (logp() - ref)).sum())
    reverse_kl = grad(lambda: (ref.exp() * (ref - logp())).sum())
    assert torch.allclose(exp_grad(grpo.kl_k2), forward_kl, atol=1e-12)
    assert torch.allclose(exp_grad(grpo.kl_k1), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(exp_grad(grpo.kl_k3), reverse_kl, atol=1e-12)
    assert not torch.allclose(exp_grad(grpo.kl_k3), forward_kl, atol=1e-3)


def _check_gspo_against_verl(seed, reduction, mode, eps_low, eps_high):
    logp, old, adv, mask = _random_policy_batch(seed, 0.1)
    wt = grpo.token_weights(mask, reduction)                                  # [N, T]
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask,
                                                      eps_low, eps_high, mode), logp)
    for fn in (variants.gspo_loss, variants.gspo_token_loss):
        got, g_got = _value_and_grad(
            lambda: fn(logp, old, adv, mask, wt, eps_low, eps_high)[0], logp)  # noqa: B023
        assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    # per-token advantages: only the token form takes them
    adv_tok = torch.randn_like(mask)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high,
                                                      mode), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, wt,
                                                                  eps_low,
                                                                 eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    with pytest.raises(ValueError):
        variants.gspo_loss(logp, old, adv_tok, mask, wt)
    # truncated IS weights multiply each token's loss, as verl's rollout_is_weights do
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high,
                                                      mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, wt * w,
                                                                  eps_low,
                                                                 eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    want = _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high, mode, w)
    assert torch.allclose(variants.gspo_loss(logp, old, adv, mask, wt * w, eps_low, eps_high)[0],
                          want)
    m = variants.gspo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode",
                         [("sequence", "seq-mean-token-mean"), ("token", "token-mean")])
def test_gspo_equals_verl_gspo_values_and_gradients(reduction, mode):
    # bounds wider than the paper's 3e-4 / 4e-4 so that these batches have clipped and unclipped
    # rows
    clipped = [_check_gspo_against_verl(seed, reduction, mode, 0.02, 0.03) for seed in range(4)]
    assert 0 < sum(clipped) < len(clipped)  # both kinds of rows were exercised
    _check_gspo_against_verl(0, reduction, mode, variants.GSPO_EPS_LOW, variants.GSPO_EPS_HIGH)


def test_gspo_on_policy_gradient_equals_gspo_token_and_the_sequence_policy_gradient():
    # mu = 1: old = current, s_i = 1, nothing clipped (even with the paper's 3e-4 / 4e-4). The
    # gradient of each token is -A_i / |y_i| / N: the sequence-mean policy gradient, as GSPO-token
    # with A_i on each token.
    logp, _, adv, mask = _random_policy_batch(3, 0.0)
    old = logp.detach().clone()
    # [N, T], sequence mean
    wt = grpo.token_weights(mask)
    loss, g_seq = _value_and_grad(lambda: variants.gspo_loss(logp, old, adv, mask, wt)[0], logp)
    _, g_tok = _value_and_grad(
        lambda: variants.gspo_token_loss(logp, old, adv[:, None].expand_as(mask), mask, wt)[0],
        logp)
    assert torch.allclose(g_seq, g_tok, atol=1e-12)
    want = -adv[:, None] / mask.sum(-1, keepdim=True) / mask.shape[0] * mask
    assert torch.allclose(g_seq, want, atol=1e-12) and abs(loss.item() + adv.mean().item()) < 1e-12


def _check_cispo_against_verl(seed, reduction, mode, eps_low, eps_high):
    logp, old, adv, mask = _random_policy_batch(seed, 0.4)
    wt = grpo.token_weights(mask, reduction)                                  # [N, T]
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask),
                                                       mask, eps_low, eps_high, mode), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, wt, eps_low,
                                                             eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask),
                                                       mask, eps_low, eps_high, mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, wt * w, eps_low,
                                                             eps_high)[0],
                                 logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    m = variants.cispo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode",
                         [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_cispo_equals_verl_cispo_values_and_gradients(reduction, mode):
    clipped = [_check_cispo_against_verl(seed, reduction, mode, 0.2, 0.28) for seed in range(3)]
    assert 0 < sum(clipped) < len(clipped)
    _check_cispo_against_verl(3, reduction, mode, variants.CISPO_EPS_LOW, variants.CISPO_EPS_HIGH)
    # a clipped token keeps its gradient: ratio e^1 > 1.28, gradient -1.28 * A (here A = 1, one
    # token)
    one = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, m = variants.cispo_loss(one, torch.full((1, 1), -1.0, dtype=torch.float64),
                                  torch.ones(1, dtype=torch.float64),
                                  torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert abs(one.grad.item() + 1.28) < 1e-12 and m["clip/high_frac"] == 1.0


def test_token_weights_reduce_as_the_formulas_and_kl_term_splits_off():
    # (per_token * token_weights).sum() is each reduction's formula; policy_loss(beta) is the beta =
    # 0 loss plus beta * kl_term(k3), the article's one reduction of surrogate + beta * KL per token
    from functools import partial
    logp, old, adv, mask = _random_policy_batch(4, 0.3)
    ref = torch.randn_like(old) - 2.0
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    ppo = partial(grpo.ppo_loss, eps_low=0.2, eps_high=0.28)
    for reduction in ("sequence", "token", "constant"):
        kw = dict(reduction=reduction, num_tokens=torch.tensor(30.0), max_len=9, num_seqs=8)
        w = grpo.token_weights(mask, **kw)
        base, _ = grpo.policy_loss(logp, old, adv, mask, w, ppo)
        assert torch.allclose(base, _reduce_by_hand(per_token, mask, **kw), atol=1e-12)
        with_kl, m = grpo.policy_loss(logp, old, adv, mask, w, ppo, ref_logp=ref, beta=0.04)
        kl, mk = grpo.kl_term(logp, ref, mask, w, grpo.kl_k3)
        assert (torch.allclose(with_kl, base + 0.04 * kl, atol=1e-12)
                and abs(m["kl"] - mk["kl"]) < 1e-9)
        want = _reduce_by_hand(per_token + 0.04 * grpo.kl_k3(logp, ref), mask, **kw)
        assert torch.allclose(with_kl, want, atol=1e-12)
        # another estimator: same "kl" metric (k3)
        k2, mk2 = grpo.kl_term(logp, ref, mask, w, grpo.kl_k2)
        assert torch.allclose(k2, _reduce_by_hand(grpo.kl_k2(logp, ref), mask, **kw)) and mk2 == mk
    with pytest.raises(ValueError):
        grpo.token_weights(mask, "mean")


@pytest.mark.parametrize("name,fn", [
    ("gspo", lambda lp, old, adv, mask, w: variants.gspo_loss(lp, old, adv, mask, w, 0.02,
                                                              0.03)[0]),
    ("gspo-token", lambda lp, old, adv, mask,
     w: variants.gspo_token_loss(lp, old, adv, mask, w, 0.02, 0.03)[0]),
    ("cispo", lambda lp, old, adv, mask,
     w: variants.cispo_loss(lp, old, adv, mask, w, 0.2, 0.28)[0]),
    ("kl-k2", lambda lp, old, adv, mask, w: grpo.kl_term(lp, old, mask, w, grpo.kl_k2)[0]),
    ("tis", lambda lp, old, adv, mask, w: variants.cispo_loss(
        lp, old, adv, mask, w * variants.tis_weights(old, old + 0.3 * torch.sin(old * 7), mask,
                                                     1.2))[0]),
])
@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_variant_losses_add_up_over_micro_batches(name, fn, reduction):
    # two micro-batches with the step's global denominators give the full batch's loss and gradient
    logp, old, adv, mask = _random_policy_batch(5, 0.05)
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=9, num_seqs=6)
    full, g_full = _value_and_grad(lambda: fn(logp, old, adv, mask, grpo.token_weights(mask, **kw)),
                                   logp)
    parts, g_parts = _value_and_grad(lambda: sum(fn(logp[s], old[s], adv[s], mask[s],
                                                    grpo.token_weights(mask[s], **kw))
                                                 for s in (slice(0, 2), slice(2, 6))), logp)
    assert torch.allclose(full, parts, atol=1e-12) and torch.allclose(g_full, g_parts, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_entropy_bonus_gradient_equals_autograd_of_the_naive_entropy(reduction):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 5, 11)).requires_grad_(True)  # token_entropy works in float32
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 4])[:, None]).float()
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=6, num_seqs=4)
    got = variants.entropy_bonus(variants.token_entropy(logits, 0.7), mask,
                                 grpo.token_weights(mask, **kw))[0]
    (g_got,) = torch.autograd.grad(got, logits)
    x = logits / 0.7
    naive = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)  # [N, T]
    want = _reduce_by_hand(naive, mask, **kw)
    (g_want,) = torch.autograd.grad(want, logits)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(g_got, g_want, atol=1e-6)
    # micro-batches with global denominators add up, as the losses do
    parts = sum(variants.entropy_bonus(variants.token_entropy(logits[s], 0.7), mask[s],
                                       grpo.token_weights(mask[s], **kw))[0]
                                       for s in (slice(0, 1), slice(1, 4)))
    assert torch.allclose(parts, want, atol=1e-5)


def test_tis_weights_are_one_when_sampler_agrees_and_capped():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.equal(variants.tis_weights(old, old.detach(), mask, 2.0),
                       torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # pi_old / pi_sampler = 10 -> capped at 2; 1.5 -> kept; 0.25 -> kept (truncation is from above
    # only)
    sampler = old.detach() - torch.tensor([[math.log(10.0), math.log(1.5), math.log(0.25), 5.0]])
    w = variants.tis_weights(old, sampler, mask, 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.5, 0.25, 0.0]])) and not w.requires_grad
    with pytest.raises(ValueError):
        variants.tis_weights(old, sampler, mask, 0.0)


def test_mismatch_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    # padding may hold anything
    sampler = torch.tensor([[-1.0, -2.5, -2.0], [-1.2, float("-inf"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    m = variants.mismatch_metrics(old, sampler, mask)
    # |delta| = 0, 0.5, 1.0, 0.2 over 4 valid tokens; k3(sampler, old) = e^d - d - 1 with d = old -
    # sampler
    k3 = sum(math.exp(d) - d - 1 for d in (0.0, 0.5, -1.0, 0.2)) / 4
    assert (abs(m["mismatch/logp_abs_mean"] - 1.7 / 4) < 1e-6
            and abs(m["mismatch/logp_abs_max"] - 1.0) < 1e-6)
    assert abs(m["mismatch/kl"] - k3) < 1e-6
    assert variants.mismatch_metrics(old, old, mask) == {"mismatch/logp_abs_mean": 0.0,
                                                         "mismatch/logp_abs_max": 0.0,
                                                          "mismatch/kl": 0.0}


def test_loss_flags_choose_functions_and_the_papers_clip_ranges():
    assert (set(update.LOSSES) == {"ppo", "gspo", "gspo-token", "cispo"}
            and set(update.KL_ESTIMATORS) == {"k1", "k2", "k3"})
    a = flags.parse_train_args(["--loss", "gspo"])
    assert (a.eps_low, a.eps_high, a.kl, a.entropy_coef, a.tis_cap) == (3e-4, 4e-4, "k3", 0.0, 0.0)
    # a flag given wins
    a = flags.parse_train_args(["--loss", "cispo", "--algo", "grpo", "--eps-high", "0.28"])
    assert (a.eps_low, a.eps_high, a.reduction) == (1.0, 0.28, "sequence")
    a = flags.parse_train_args(["--algo", "dapo"])
    assert (a.loss, a.eps_low, a.eps_high) == ("ppo", 0.2, 0.28)


def test_policy_loss_weights_multiply_the_surrogate_not_the_kl():
    logp, old, adv, mask = _random_policy_batch(6, 0.3)
    ref, w = torch.randn_like(old) - 2.0, torch.rand_like(old)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * w
    got, _ = grpo.policy_loss(logp, old, adv, mask, grpo.token_weights(mask, "token"), ref_logp=ref,
                              beta=0.1, is_weights=w)
    want = _reduce_by_hand(per_token + 0.1 * grpo.kl_k3(logp, ref), mask, "token")
    assert torch.allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# dapo.py: dynamic sampling over ranks, mini-batches of whole groups, DAPO with its fixes off is
# GRPO
# ---------------------------------------------------------------------------------------------

def test_dynamic_sampling_fills_then_stops_and_is_world_size_invariant():
    # informative: 2, then 3
    rounds = [[[1, 0], [1, 1], [0, 1], [0, 0]], [[1, 0], [1, 0], [0, 0], [0, 1]]]
    draw = lambda r: (_fake_rollout(rounds[r], start=10 * r), {"round": r})  # noqa: E731
    roll, st, drawn = dapo.dynamic_sampling(draw, target=4, max_rounds=4)
    # the first two informative groups of round 0, then the first two of round 1
    assert [p[0] for p in roll.prompts] == [0, 2, 10, 11] and st["sampling/rounds"] == 2
    # every round drawn comes back whole (all 4 groups, kept or not), with what draw returned beside
    # it
    assert [(r.num_groups, r.prompts[0][0], info) for r, info in drawn] == [(4, 0, {"round": 0}),
                                                                            (4, 10, {"round": 1})]
    assert st["sampling/groups_drawn"] == 8 and st["sampling/batch_full"] == 1.0
    # round limit: trains on what it has
    roll, st, drawn = dapo.dynamic_sampling(draw, target=40, max_rounds=2)
    assert roll.num_groups == 5 and st["sampling/batch_full"] == 0.0 and len(drawn) == 2
    # two ranks, each drawing half of each round's prompts, in blocks (groups 0-1, 2-3) or every
    # other one (0, 2 and 1, 3, as train.draw_round spreads them): together they keep the same
    # groups (and with target 1, of informative groups 1 and 2 both keep group 1, the first in
    # prompt order, though every other one puts group 2 first in rank order)
    for share, target, want in [(lambda k: torch.arange(4) // 2 == k, 4, [0, 2, 10, 11]),
                                (lambda k: torch.arange(4) % 2 == k, 4, [0, 2, 10, 11]),
                                (lambda k: torch.arange(4) % 2 == k, 1, [1])]:
        kept, rounds = [], rounds if target == 4 else [[[0, 0], [1, 0], [1, 0], [0, 0]]]
        halves = {(r, k): _fake_rollout(rounds[r], start=10 * r).select_groups(share(k))
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
            roll_k, _, _ = dapo.dynamic_sampling(draw_k, target, len(rounds), gather=gather_k,
                                                 rank=k)
            # a rank that keeps nothing: Rollout.empty
            kept += [p[0] for p in roll_k.prompts]
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
            roll = _fake_rollout([[1, 0]] * len(mine)) if mine else Rollout.empty(G, 0)
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
    sample = lambda model, prompts, *a, **k: _fake_rollout([[0.0] * G] * len(prompts))  # noqa: E731
    task = setup.Task(rows=builtin.sample_problems(16, 1, False), encode=lambda p: [3, 4],
                      decode=lambda roll, i: "x", reward_fn=data.as_reward(lambda r, a: 1.0),
                      eos=[1], pad=0, sample=sample)
    idx = [train.draw_round(None, task, args, SimpleNamespace(rank=k, world=W),
                            40)[0].index[::G].tolist()
           for k in range(W)]
    assert sorted(idx[0] + idx[1]) == list(range(40, 40 + B))       # the step's prompts, each once
    for K in (1, 2, 4):                                               # up to a group per rank each
        rolls = [dataclasses.replace(_fake_rollout([[0.0] * G] * len(i)),
                                     index=torch.tensor(i).repeat_interleave(G)) for i in idx]
        rows = [[r.stop - r.start for r in update.minibatch_rows(rolls[k], K, _StubRanks(idx, k))]
                for k in range(W)]
        assert rows[0] == rows[1] == [B * G // K // W] * K, (K, rows)


def test_dapo_with_fixes_off_is_grpo():
    """DAPO with all four fixes off resolves to exactly GRPO's settings (see also the end-to-end
    check)."""
    off = ["--eps-high", "0.2", "--reduction", "sequence", "--no-dynamic-sampling",
           "--no-overlong-filter", "--no-overlong-penalty", "--beta", "0.04", "--wrong-reward", "0"]
    a = flags.parse_train_args(["--algo", "dapo", *off])
    b = flags.parse_train_args(["--algo", "grpo"])
    assert {**vars(a), "algo": None} == {**vars(b), "algo": None}
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
    roll = _mixed_rollout(tiny_model, t)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)  # each response's prompt
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(1))
    mask = dapo.overlong_filter(roll.mask, roll.truncated)
    args = SimpleNamespace(micro_batch_size=3, mini_batches=2, mu=1, temperature=t,
                           reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=max_new_tokens, eps_low=0.2, eps_high=0.28, clip_c=0.0,
                           tis_cap=0.0,
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


class _AloneAs:
    """A Dist for update_policy that says it is one of `world` ranks; each collective sees only
    itself."""
    rank, master, device = 0, True, "cpu"

    def __init__(self, world):
        self.world = world

    def sum(self, x):
        return x.detach().double().clone()

    def sum_named(self, sums):
        return dict(sums)

    def max(self, n):
        return n

    def gather(self, x):
        return [x]


@pytest.mark.parametrize("fsdp,checkpointing,world,nograd,grad", [
    (False, False, 1, (True, True), (True, True)),      # one process: shared prefix, length buckets
    # FSDP2 all-gathers in every forward: per response
    (True, False, 1, (False, True), (False, True)),
    # checkpointed layers drop the cache with gradients
    (False, True, 1, (True, True), (False, True)),
    # DDP syncs in each forward: one bucket per slice
    (False, False, 2, (True, False), (True, False))])
def test_update_policy_tells_the_training_forward_its_mode(tiny_model, monkeypatch, fsdp,
                                                           checkpointing, world, nograd, grad):
    """rollout_logprobs does not inspect the model: update_policy passes (shared_prefix, buckets),
    for the
    no-grad old log-prob pass and for the gradient passes."""
    import contextlib
    import copy
    from types import SimpleNamespace
    seen, real = set(), update.rollout_logprobs

    def spy(model, roll, rows, temperature, with_entropy=False, shared_prefix=True, buckets=True):
        seen.add((torch.is_grad_enabled(), shared_prefix, buckets))
        return real(model, roll, rows, temperature, with_entropy)

    monkeypatch.setattr(update, "rollout_logprobs", spy)
    roll = _mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    args = SimpleNamespace(micro_batch_size=4, mini_batches=1, mu=2, temperature=1.0,
                           reduction="token", loss="ppo",
                           fsdp=fsdp, gradient_checkpointing=checkpointing, max_new_tokens=20,
                           eps_low=0.2,
                           eps_high=0.28, clip_c=0.0, tis_cap=0.0, entropy_coef=0.0, beta=0.0,
                           kl="k3", grad_clip=1.0)
    model = copy.deepcopy(tiny_model)
    learner = update.Learner(model, model, None, torch.optim.SGD(model.parameters(), lr=0.0),
                             contextlib.nullcontext)
    update.update_policy(learner, roll, torch.randn(N), roll.mask, args, _AloneAs(world))
    assert seen == {(False, *nograd), (True, *grad)}


def _update_args(**kw):
    """update_policy's args (the flags.TrainArgs fields it reads): 2 mini-batches, micro-batches of
    3,
    no clip."""
    from types import SimpleNamespace
    base = dict(micro_batch_size=3, mini_batches=2, mu=1, temperature=1.0, reduction="token",
                loss="ppo", fsdp=False, gradient_checkpointing=False, max_new_tokens=20,
                eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0, entropy_coef=0.0, beta=0.0,
                kl="k3", grad_clip=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_update_policy_backwards_world_times_the_loss_for_ddps_mean(tiny_model):
    # DDP averages the ranks' gradients, and each rank's loss is its share of the global mean (the
    # denominators are all ranks' counts), so each rank backwards W x its share: the mean is then
    # the sum. A rank that says it is one of 2 (its collectives see itself alone) backwards twice
    # the gradient of one process on the same rows; SGD (lr 1, no clip) moves each weight by it.
    import contextlib
    import copy
    roll = _mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(1))
    moves, losses = [], []
    for world in (1, 2):
        model = copy.deepcopy(tiny_model)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        learner = update.Learner(model, model, None, sgd, contextlib.nullcontext)
        stats = update.update_policy(learner, roll, advantages, roll.mask,
                                     _update_args(mini_batches=1), _AloneAs(world))
        moves.append(torch.cat([(p - q).detach().view(-1)
                                for p, q in zip(model.parameters(), tiny_model.parameters())]))
        losses.append(stats.first["loss"])
    assert moves[0].abs().max() > 1e-3
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)            # the logged loss: unscaled
    assert torch.allclose(moves[1], 2 * moves[0], atol=1e-6, rtol=1e-4)  # float32, weights ~1


class _NoSyncRecorder(torch.nn.parallel.DistributedDataParallel):
    """A DDP (so parallel.grad_sync takes it for one) without a process group: it runs the model and
    records, for each forward, its rows and whether it ran outside no_sync (DDP reads that flag as a
    forward starts: outside, the backward all-reduces). A real DDP in this process can deadlock when
    it is freed (its gloo threads wait for the GIL, held by the thread that joins them)."""

    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.inside, self.synced = module, False, []

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def inside():
            assert not self.inside
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
        return inside()

    def forward(self, *args, **kwargs):
        self.synced.append((kwargs["input_ids"].shape[0], not self.inside))
        return self.module(*args, **kwargs)


def test_ddp_syncs_only_the_last_micro_batch_of_each_update(tiny_model):
    # 3 groups of 4 in 2 mini-batches (8 + 4 rows), micro-batches of 3: [3, 3, 2] then [3, 1], twice
    # (--mu 2); only each update's last micro-batch all-reduces. The Dist says 2 ranks, so each
    # micro-batch runs as one DDP forward (ranks' forwards must pair up); the old log-probs run on
    # the model, not through DDP.
    import contextlib
    import copy
    roll = _mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    model = copy.deepcopy(tiny_model)
    policy = _NoSyncRecorder(model)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    learner = update.Learner(policy, model, None, sgd, contextlib.nullcontext)
    update.update_policy(learner, roll, torch.randn(N), roll.mask, _update_args(mu=2), _AloneAs(2))
    one_pass = [(3, False), (3, False), (2, True), (3, False), (1, True)]
    assert policy.synced == one_pass * 2


# ---------------------------------------------------------------------------------------------
# logprobs.py: the token kernel (log-probs, entropy) and the shared-prefix training forward
# (rollout_logprobs) against the per-response one
# ---------------------------------------------------------------------------------------------

def test_token_logprobs_matches_log_softmax_and_has_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = logprobs.LOGPROB_CHUNK
    try:
        logprobs.LOGPROB_CHUNK = 4  # several chunks
        got = logprobs.token_logprobs(logits, ids)
    finally:
        logprobs.LOGPROB_CHUNK = old
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
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 3 * V)
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
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 2 * V)
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
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 3 * V)
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


def _tiny_gpt2():
    """A tiny GPT-2: absolute position embeddings, so position ids that ignore the left padding
    change its
    log-probs (RoPE models, the others here, see only the distance between positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=256, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None)).eval()


def _mixed_rollout(model, temperature, G=4, T=20, prompts=PROMPTS):
    """PROMPTS (3, 6 and 1 tokens; LONG_PROMPTS: 143, 146, 141) x G samples, some ending in EOS and
    some
    truncated."""
    roll = sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0,
                         temperature=temperature, generator=torch.Generator().manual_seed(3))
    assert len(set(roll.lengths.tolist())) > 2 and roll.truncated.any() and (~roll.truncated).any()
    return roll


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
    # mistral: sliding-window layers (window 5) in the cache; keep 1.0: every slice with two
    # response lengths is split into two length buckets (0.8, the default, keeps these slices
    # whole); gpt2: absolute positions;
    # -long: prompts of 141-146 tokens sharing a 140-token prefix
    from functools import partial

    from logprobs import per_response_logprobs, rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = {"llama": lambda: tiny_model, "mistral": lambda: _tiny("mistral", torch.float32),
             "gpt2": _tiny_gpt2}[kind]()
    t, G = 0.7, 4
    roll = _mixed_rollout(model, t, G, prompts=prompts)
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
    from logprobs import rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = tiny_model if kind == "llama" else _tiny_gpt2()
    roll = _mixed_rollout(model, temperature, prompts=prompts)
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


def test_rollout_logprobs_rejects_bad_slices(tiny_model):
    from logprobs import rollout_logprobs
    roll = _mixed_rollout(tiny_model, 1.0)
    for bad in (slice(3, 3), slice(0, 12, 2)):
        with pytest.raises(ValueError, match="slice"):
            rollout_logprobs(tiny_model, roll, bad, 1.0)


# ---------------------------------------------------------------------------------------------
# sampler.py: inverse-CDF sampling, the batched sampler against generate, --max-num-seqs, Rollout
# ---------------------------------------------------------------------------------------------

def test_sample_token_inverse_cdf_by_hand():
    from sampler import sample_token
    # probabilities [0.5, 0.3, 0.2, 0]: running mass [0.5, 0.8, 1, 1]; u picks the first token whose
    # running mass exceeds u * (kept mass). The token without mass is never drawn, even at u -> 1.
    # top_p 0.6 keeps {0, 1} (mass 0.8: token 2 has 0.8 >= 0.6 ahead of it); top_p -> 0 keeps the
    # top token only.
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    cases = [(0.0, 1.0, 0), (0.49, 1.0, 0), (0.51, 1.0, 1), (0.81, 1.0, 2), (1 - 2 ** -24, 1.0, 2),
             (0.4, 0.6, 0), (0.7, 0.6, 1), (0.99, 0.6, 1), (0.99, 1e-9, 0)]
    for dtype in (torch.float32, torch.bfloat16):
        for u, top_p, want in cases:
            tok, lp = sample_token(p.log().to(dtype)[None].clone(), torch.tensor([u]), 1.0, top_p)
            assert tok.item() == want, (dtype, u, top_p)
            assert abs(lp.exp().item() - p[want].item()) < (1e-6 if dtype == torch.float32
                                                            else 1e-2)
    # temperature 0.5 squares the probabilities: [0.25, 0.09, 0.04] / 0.38, and the log-prob is the
    # tempered one
    tok, lp = sample_token(p.log()[None].clone(), torch.tensor([0.7]), 0.5, 1.0)
    assert tok.item() == 1 and abs(lp.exp().item() - 0.09 / 0.38) < 1e-6


@pytest.mark.parametrize("block", [4, 7, 64])
def test_sample_token_two_level_walk_equals_one_running_sum(block, monkeypatch):
    import sampler
    monkeypatch.setattr(sampler, "SAMPLE_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    # 50 is no multiple of 4, 7 or 64
    n, V = 400, 50
    logits = 3 * torch.randn(n, V, generator=g)
    logits[:, 8:16] = float("-inf")                                 # whole blocks without mass
    logits[:, -3:] = float("-inf")                                  # and a tail without mass
    u = torch.rand(n, generator=g)
    u[:8] = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 0.25, 0.75, 1e-9, 0.999999, 0.1])
    # [n, V] the tempered distribution
    p = torch.softmax(logits.double() / 0.7, -1)
    want = torch.searchsorted(p.cumsum(-1), u.double()[:, None] * p.sum(-1, keepdim=True),
                              side="right").squeeze(-1)
    # u -> 1 ends on the last token with mass
    want = want.clamp_max(V - 4)
    work = sampler.sample_workspace(n, V)
    assert work.shape == (n, -(-V // block) * block)
    tok, lp = sampler.sample_token(logits.clone(), u, 0.7, 1.0, work)
    assert torch.equal(tok, want)
    assert torch.allclose(lp.double(), p.gather(-1, tok[:, None]).squeeze(-1).log(), atol=1e-5)
    # the padding stays zero for the next step
    assert work[:, V:].abs().sum() == 0
    # without a work buffer: the same draws
    tok2, _ = sampler.sample_token(logits.clone(), u, 0.7, 1.0)
    assert torch.equal(tok2, tok)


def _tiny(kind, dtype):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    if kind == "qwen2":  # GQA, q/k/v biases, tied embeddings: the preallocated cache
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common)).eval().to(dtype)
    # sliding-window layers
    return MistralForCausalLM(MistralConfig(sliding_window=5, **common)).eval().to(dtype)


@pytest.mark.parametrize("kind,dtype,prompts", [
    ("qwen2", torch.float32, PROMPTS), ("qwen2", torch.bfloat16, PROMPTS),
    ("mistral", torch.float32, PROMPTS),
    ("qwen2", torch.float32, LONG_PROMPTS), ("mistral", torch.float32, LONG_PROMPTS)],
    ids=["qwen2", "qwen2-bf16", "mistral", "qwen2-long", "mistral-long"])
def test_sampler_greedy_groups_equal_generate_alone_with_rows_finishing_early(kind, dtype, prompts):
    # -long: prompts of 141-146 tokens sharing a 140-token prefix (past a KV block, and the window
    # of 5)
    import sampler
    model, G, T = _tiny(kind, dtype), 3, 24
    layers = {type(layer).__name__ for layer in sampler.make_cache(model, 8)[0].layers}
    assert (layers == {"_BufferedLayer"}
            and sampler.make_cache(model, 8)[1] == (None if kind == "qwen2" else 5))
    # EOS := the 4th greedy token of the first prompt, so its rows finish early and leave the batch
    free = sample_groups(model, prompts[:1], 1, T, eos_token_id=-1, pad_token_id=0, temperature=0.0)
    eos = int(free.response_ids[0, 3])
    roll = sample_groups(model, prompts, G, T, eos_token_id=eos, pad_token_id=0, temperature=0.0)
    assert roll.lengths[0] <= 4 and roll.lengths.max() > roll.lengths[0]
    for i, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p]), max_new_tokens=T, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)[0, len(p):].tolist()
        for r in range(i * G, (i + 1) * G):
            L = int(roll.lengths[r])
            assert roll.response_ids[r, :L].tolist() == ref[:L]
            assert L == len(ref) or ref[L:] == [0] * (len(ref) - L)


def test_sampler_stops_on_any_of_several_end_ids_like_generate():
    from types import SimpleNamespace
    model, T = _tiny("qwen2", torch.float32), 24
    free = sample_groups(model, PROMPTS, 1, T, eos_token_id=-1, pad_token_id=0, temperature=0.0)
    # each prompt meets a different one first
    ends = [int(free.response_ids[0, 3]), int(free.response_ids[1, 6])]
    roll = sample_groups(model, PROMPTS, 2, T, eos_token_id=ends, pad_token_id=0, temperature=0.0)
    assert roll.lengths[0] <= 4 and not roll.truncated[0]
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), max_new_tokens=T, do_sample=False,
                             eos_token_id=ends, pad_token_id=0)[0, len(p):].tolist()
        for r in (2 * i, 2 * i + 1):
            L = int(roll.lengths[r])
            assert roll.response_ids[r, :L].tolist() == ref[:L] and (L == T or ref[L - 1] in ends)
    # train.py stops on the tokenizer's EOS and on the end ids the generation config adds
    # (models.end_ids)
    tok = SimpleNamespace(eos_token_id=5)
    assert (models.end_ids(
        tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 5]))) == [5, 7])
    assert (models.end_ids(
        tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))) == [5])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_sampler_top_p_logprobs_match_a_full_forward(dtype, atol):
    model, G = _tiny("qwen2", dtype), 4
    roll = sample_groups(model, PROMPTS, G, 16, 1, 0, temperature=0.8, top_p=0.9,
                         generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    for i in range(len(PROMPTS) * G):
        L = int(roll.lengths[i])
        with torch.no_grad():
            want = _full_forward_logprobs(model, PROMPTS[i // G], roll.response_ids[i, :L].tolist(),
                                          0.8)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=atol)


def test_sampler_greedy_equals_generate(tiny_model):
    roll = sample_groups(tiny_model, PROMPTS, 1, 12, eos_token_id=1, pad_token_id=0,
                         temperature=0.0)
    for i, p in enumerate(PROMPTS):
        ref = tiny_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=1, pad_token_id=0)
        ref = ref[0, len(p):].tolist()
        L = int(roll.lengths[i])
        assert roll.response_ids[i, :L].tolist() == ref[:L]
        assert L == len(ref) or ref[L:] == [0] * (len(ref) - L)


def test_sampler_per_prompt_generators_ignore_batch_company(tiny_model):
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    both = sample_groups(tiny_model, PROMPTS, 3, 10, 1, 0, generator=gens([11, 12, 13]))
    alone = sample_groups(tiny_model, PROMPTS[1:2], 3, 10, 1, 0, generator=gens([12]))
    L = alone.response_ids.shape[1]
    assert torch.equal(both.response_ids[3:6, :L], alone.response_ids)


def test_sampler_top_p_keeps_the_top_token(tiny_model):
    roll = sample_groups(tiny_model, PROMPTS, 2, 6, 1, 0, top_p=1e-9,
                         generator=torch.Generator().manual_seed(0))
    greedy = sample_groups(tiny_model, PROMPTS, 1, 6, 1, 0, temperature=0.0)
    for i in range(len(PROMPTS)):
        assert torch.equal(roll.response_ids[2 * i],
                           greedy.response_ids[i, :roll.response_ids.shape[1]])


def _tiny_gpt2_sampler():
    """Absolute learned positions: a position counted from the wrong origin changes the logits (RoPE
    hides a
    constant offset within a row)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(2)
    cfg = GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                     eos_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


MIXED_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4], [13, 14, 15, 16, 17], [18, 19]]


def _tiny_mistral_wide():
    """Sliding-window layers whose window (32) covers P + T here: continuous batching, the window by
    the mask."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(1)
    return MistralForCausalLM(MistralConfig(vocab_size=48, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128,
                                            pad_token_id=0, eos_token_id=1, bos_token_id=None,
                                            sliding_window=32)).eval()


@pytest.mark.parametrize("kind,G", [("llama", 3), ("qwen2", 3), ("mistral", 3), ("mistral-wide", 3),
                                    ("gpt2", 3), ("gpt2", 1)])
def test_sampler_max_num_seqs_gives_the_same_rollout(tiny_model, kind, G, monkeypatch):
    import sampler
    model = {"llama": lambda: tiny_model, "gpt2": _tiny_gpt2_sampler,
             "mistral-wide": _tiny_mistral_wide}.get(
        kind, lambda: _tiny(kind, torch.float32))()
    # several end ids: lengths roughly geometric, some rows truncated
    ends, T = [1, 2, 3, 20], 20
    made, make = [], sampler.make_cache
    monkeypatch.setattr(sampler, "make_cache", lambda *a, **k: made.append(make(*a, **k))
                        or made[-1])
    gens = lambda: [torch.Generator().manual_seed(40 + i) for i in range(len(MIXED_PROMPTS))]  # noqa: E731
    run = lambda n, **k: sample_groups(  # noqa: E731
        model, MIXED_PROMPTS, G, T, ends, 0, 0.9, generator=gens(), max_num_seqs=n, **k)
    full = run(None)
    assert full.truncated.any() and (~full.truncated).any() and len(set(full.lengths.tolist())) > 3
    P, N = max(map(len, MIXED_PROMPTS)), len(MIXED_PROMPTS) * G
    # 7 slots for groups of 3: one slot idle, groups enter whole
    sizes = [1, 3, 4] if G == 1 else [3, 7, 11]
    # (mistral's window 5 < P + T: static batches whatever `continuous` says, see sample_groups)
    # mistral: static
    for n, continuous in [(sizes[0], False), (sizes[2], True), (sizes[0], True), (sizes[1], True)]:
        made.clear()
        roll = run(n, continuous=continuous)
        assert (made[0][0].layers[0].kbuf.shape[0] == min(n, N)
                and made[0][0].layers[0].kbuf.shape[2] == P + T)
        assert (torch.equal(roll.response_ids, full.response_ids)
                and torch.equal(roll.lengths, full.lengths))
        assert torch.equal(roll.truncated, full.truncated)
        assert torch.allclose(roll.logprobs, full.logprobs, atol=1e-5)
    # and the rows are right: the log-probs of a plain full forward
    for i in range(N):
        L = int(roll.lengths[i])
        with torch.no_grad():
            want = _full_forward_logprobs(model, MIXED_PROMPTS[i // G],
                                          roll.response_ids[i, :L].tolist(), 0.9)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=1e-4)
    if G > 1:
        with pytest.raises(ValueError, match="max_num_seqs=2 < G=3"):
            run(2)


def _slot_schedule(lengths, G, S, continuous):
    """Rows of each decode forward when groups of G enter S slots in order, each row leaving after
    its length: continuous, a group enters as soon as G slots are free; static, only once the batch
    is empty."""
    waiting, running, forwards = list(lengths), [], []
    while waiting or running:
        admit = continuous or not running
        while admit and waiting and len(running) + G <= S:
            running, waiting = running + waiting[:G], waiting[G:]  # a group, prefilled with others
        running = [left - 1 for left in running if left > 1]       # each row samples a token
        if running:
            forwards.append(len(running))                          # the survivors' next forward
    return forwards


def test_max_num_seqs_refills_a_freed_slot_at_once():
    # 6 prompts of 131-135 tokens sharing a 130-token prefix, G = 3, 7 slots (two groups, one slot
    # idle), lengths from 1 to T. A slot freed by a short row goes to the next waiting group as soon
    # as G are free (continuous batching): the decode forwards follow the continuous _slot_schedule,
    # not the static one (the rollout is the same either way). Through rollout.sample_rollout, as
    # train.py samples.
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    prefix = [4 + i % 44 for i in range(130)]
    prompts = [prefix + list(range(5, 5 + k)) for k in (1, 5, 2, 4, 3, 1)]
    G, S, T, ends = 3, 7, 16, [1, 2, 3, 20]
    calls = []                                                 # (rows, positions) of each forward
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                    with_kwargs=True)
    gens = lambda: [torch.Generator().manual_seed(40 + i) for i in range(6)]  # noqa: E731
    args = SimpleNamespace(max_new_tokens=T, max_num_seqs=S, kv_cache_gb=8.0, bf16=False,
                           compile=False)
    roll = rollout.sample_rollout(model, prompts, G, 0.9, 1.0, gens(), ends, 0, args)
    lengths = roll.lengths.tolist()
    assert min(lengths) == 1 and max(lengths) == T and len(set(lengths)) > 5
    prefills = [c for c in calls if c[1] > 1]                     # [k groups, P of the k]
    decodes = [c[0] for c in calls if c[1] == 1]                  # rows of each decode forward
    want, static = _slot_schedule(lengths, G, S, True), _slot_schedule(lengths, G, S, False)
    assert decodes == want and max(decodes) <= S and len(want) < len(static)
    assert sum(k for k, _ in prefills) == 6 and len(prefills) > 3  # groups entered as slots freed
    calls.clear()
    plain = sample_groups(model, prompts, G, T, ends, 0, 0.9, generator=gens(), max_num_seqs=S,
                          continuous=False)
    assert [c[0] for c in calls if c[1] == 1] == static       # the baseline it is measured against
    assert torch.equal(plain.response_ids, roll.response_ids)
    assert torch.equal(plain.lengths, roll.lengths)


def test_num_seqs_within_is_the_kv_formula_of_the_buffers_allocated(monkeypatch):
    import sampler
    made, make = [], sampler.make_cache
    monkeypatch.setattr(sampler, "make_cache", lambda *a, **k: made.append(make(*a, **k))
                        or made[-1])
    for model, per_pos in ((_tiny("qwen2", torch.float32), 2 * 2 * 8 * 2 * 4),
                           (_tiny_gpt2_sampler(), 2 * 4 * 8 * 2 * 4)):
        # layers x KV heads x head_dim x 2 (K, V) x 4 bytes: Qwen2 2 x 2 x 8, GPT-2 2 x 4 (all
        # heads) x 8; per row: the longest of MIXED_PROMPTS, 6, + T = 20
        per_row = per_pos * (6 + 20)
        # a multiple of G
        assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 10.5 * per_row / 2**30) == 9
        # at least G
        assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 1e-9) == 3
        # bf16 keys: half the bytes, twice the rows
        with torch.autocast("cpu", torch.bfloat16):
            assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20,
                                           10.5 * per_row / 2**30) == 21
        made.clear()
        sample_groups(model, MIXED_PROMPTS, 3, 20, 1, 0, generator=torch.Generator().manual_seed(0),
                      max_num_seqs=9)
        layers = made[0][0].layers
        # what was allocated
        assert sum(la.kbuf.nbytes + la.vbuf.nbytes for la in layers) == 9 * per_row


def test_max_num_seqs_flags_are_checked(capsys):
    import evaluate
    assert (flags.parse_train_args(["--max-num-seqs", "8"]).max_num_seqs == 8
            and flags.parse_train_args([]).kv_cache_gb == 8.0)
    for parse, bad in ((flags.parse_train_args, ["--max-num-seqs", "4"]),
                       (flags.parse_train_args, ["--kv-cache-gb", "0"]),
                       (evaluate.main, ["--eval-samples", "4", "--max-num-seqs", "2"])):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        err = capsys.readouterr().err
        assert (e.value.code == 2 and err.startswith("error: --")
                and len(err.strip().splitlines()) == 1), err


def test_draw_round_and_evaluation_sample_with_max_num_seqs(tiny_run_inputs, monkeypatch):

    import evaluate
    import sampler
    import train
    seen = []

    def recording(*a, max_num_seqs=None, **k):
        seen.append(max_num_seqs)
        return sample_groups(*a, max_num_seqs=max_num_seqs, **k)
    # rollout.sample_rollout reads it at call time
    monkeypatch.setattr(sampler, "sample_groups", recording)
    model = _tiny("qwen2", torch.float32)
    task = setup.Task(rows=[{"prompt": "p", "answer": "1"}] * 4, encode=lambda s: [5, 6, 7],
                      decode=lambda r, i: "",
                      reward_fn=data.as_reward(lambda t, a: 0.0), eos=[1], pad=0)
    one = type("One", (), {"rank": 0, "world": 1})()
    for extra, want in (([], sampler.num_seqs_within(model, [[5, 6, 7]], 8, 40, 8.0)),
                        (["--max-num-seqs", "16"], 16)):
        args = flags.parse_train_args(["--prompts-per-step", "4", *extra])
        train.draw_round(model, task, args, one, 0)
        assert seen.pop() == want
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p",
                                         "0.9")
    _, r1 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    args.max_num_seqs = 5                      # one problem's 4 samples at a time: the same samples
    _, r2 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    prompts = [data.PromptFormatter(tok)(r["prompt"]) for r in rows]
    assert (r1 == r2 and seen[-1] == 5 and seen[0] == sampler.num_seqs_within(model, prompts, 4, 10,
                                                                              8.0) >= 48)


def test_sampler_under_bf16_autocast_gives_the_same_rollout_for_every_n(tiny_model):
    # under CPU autocast a decode step's keys may come out in another dtype than the prefill's: the
    # write into the slots' buffer takes the buffer's dtype (an indexed write does not cast), as
    # train.py
    # --bf16 samples
    with torch.autocast("cpu", torch.bfloat16):
        rolls = [sample_groups(tiny_model, PROMPTS, 2, 12, eos_token_id=1, pad_token_id=0,
                               temperature=0.0, max_num_seqs=n) for n in (2, None)]
    assert (torch.equal(rolls[0].response_ids, rolls[1].response_ids)
            and torch.equal(rolls[0].lengths, rolls[1].lengths))


def _static_case():
    """--compile's test case: a Qwen2 with 2 KV heads for 4 query heads, 5 prompts of 131-144 tokens
    sharing a 130-token prefix (past a 128-token KV block; left-padded to P = 144), G = 3, T = 24,
    2 of 64 ids end a response. Returns (model, rollout(S, temperature, top_p, compile)), one
    generator per prompt."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
        initializer_range=0.2)).eval()            # peaked logits: a wrong position shows in tokens
    prefix = [17 + i % 47 for i in range(130)]
    prompts = [prefix + [20 + (7 * j + i) % 40 for i in range(k)]
               for j, k in enumerate((1, 14, 6, 9, 3))]
    return model, lambda S, temperature, top_p=1.0, compile=True: sample_groups(
        model, prompts, 3, 24, [1, 2], 0, temperature=temperature, top_p=top_p, max_num_seqs=S,
        generator=[torch.Generator().manual_seed(60 + i) for i in range(5)],
        static=static_decode if compile else None)


def _same_rollout(a, b, tol=1e-5) -> None:
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.truncated, b.truncated)
    assert (a.logprobs - b.logprobs).abs().max() <= tol


def _eager_static_step(monkeypatch, shapes: list):
    """static_decode with its step eager (no compile) and the shapes of each step's inputs."""
    from infra import static_decode

    def step(model, cache, tok, pos, mask):
        shapes.append((tuple(tok.shape), tuple(pos.shape), tuple(mask.shape)))
        return static_decode.decode_step(model, cache, tok, pos, mask)
    monkeypatch.setattr(static_decode, "compiled_step", lambda device: step)
    return step


def test_static_decode_gives_the_eager_rollout_at_every_slot_count(monkeypatch):
    # --compile's loop (S slots x a fixed buffer of C = 192 >= P + T columns, a mask of the columns
    # each slot wrote, per-slot positions, a freed slot refilled by the next group) with its step
    # left eager: every step has the same shapes, and the rollout is the eager loop's, greedy and
    # sampled at 3 slots (one group at a time), 7 (one slot never used), 12, all 15 and 20 (more
    # than the rows: 15), top-p at 7 and 15
    shapes = []
    _eager_static_step(monkeypatch, shapes)
    _, rollout = _static_case()
    every = (3, 7, 12, 15, 20)
    for temperature, top_p, slots in ((0.0, 1.0, every), (1.0, 1.0, every), (0.9, 0.8, (7, 15))):
        want = rollout(None, temperature, top_p, compile=False)
        assert temperature == 0 or (want.lengths.min() < 5 and want.truncated.any())
        for S in slots:
            shapes.clear()
            _same_rollout(rollout(S, temperature, top_p), want)
            S = min(S, 15)
            assert set(shapes) == {((S, 1), (S, 1), (S, 1, 1, 192))}, (S, set(shapes))
            assert len(shapes) >= want.lengths.max() - 1


def test_compile_where_it_cannot_run_warns_once_and_decodes_eagerly(monkeypatch):
    # no C++ compiler for inductor (CPU), and a sliding window shorter than P + T: one line, then
    # the eager loop (the static one is never entered)
    import shutil

    from infra import static_decode
    monkeypatch.setattr(static_decode, "decode", lambda *a, **k: pytest.fail("static loop ran"))
    _, rollout = _static_case()
    want = rollout(6, 1.0, compile=False)
    with monkeypatch.context() as m:
        m.setattr(shutil, "which", lambda *a, **k: None)
        with pytest.warns(UserWarning, match=r"^--compile: no C\+\+ compiler .*decoding eagerly$"):
            _same_rollout(rollout(6, 1.0), want, tol=0)
    mistral = _tiny("mistral", torch.float32)                                  # window 5
    with pytest.warns(UserWarning, match=r"a sliding window \(5\) shorter than P \+ T") as w:
        got = sample_groups(mistral, PROMPTS, 2, 8, 1, 0, temperature=0.0, static=static_decode)
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert torch.equal(got.response_ids, sample_groups(mistral, PROMPTS, 2, 8, 1, 0,
                                                       temperature=0.0).response_ids)


def test_compile_on_cuda_is_a_cuda_graph_and_its_path_runs(monkeypatch):
    # No GPU here: the mode chosen for a cuda device (torch.compile recorded, not run), then the
    # loop's CUDA-graph path on CPU with a step that, like a graph replay, returns the same output
    # tensor every time: the inputs and KV buffers marked static, a step begun per replay, the
    # output copied out before the next replay overwrites it. Untested on CUDA hardware.
    from infra import static_decode
    made = []
    monkeypatch.setattr(static_decode, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: made.append(kw) or fn)
    static_decode.compiled_step(torch.device("cuda"))
    static_decode.compiled_step(torch.device("cpu"))
    assert made == [dict(mode="reduce-overhead", dynamic=False, fullgraph=True),
                    dict(mode=None, dynamic=False, fullgraph=True)]
    out, marked, begun = {}, [], []

    def replay(model, cache, tok, pos, mask):
        logits = static_decode.decode_step(model, cache, tok, pos, mask)
        out.setdefault("buf", torch.empty_like(logits)).copy_(logits)
        return out["buf"]
    monkeypatch.setattr(static_decode, "compiled_step", lambda device: replay)
    monkeypatch.setattr(static_decode, "uses_graphs", lambda device: True)
    monkeypatch.setattr(torch._dynamo, "mark_static_address", marked.append)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: begun.append(1))
    model, rollout = _static_case()
    want = rollout(7, 1.0, compile=False)
    _same_rollout(rollout(7, 1.0), want)
    shapes = sorted(tuple(x.shape) for x in marked)
    assert shapes == sorted([(7,), (7, 1), (7, 1), (7, 1, 1, 192)] + [(7, 2, 192, 8)] * 4)
    assert len(begun) >= want.lengths.max() - 1


def test_compile_flag_reaches_the_sampler_in_train_and_evaluate(tiny_run_inputs, tmp_path,
                                                                 monkeypatch):
    # --compile parsed by train.py and evaluate.py (flags.EvalArgs) must decode with the static
    # loop (its step left eager here); without it, never
    import evaluate
    shapes = []
    _eager_static_step(monkeypatch, shapes)
    d = tiny_run_inputs
    _one_step(d, tmp_path / "off")
    assert shapes == []
    _one_step(d, tmp_path / "on", "--compile")
    # its evaluation (8 held-out problems, greedy: 8 slots) and its step (4 prompts x G = 4: 16)
    assert {s[0][0] for s in shapes} == {8, 16}
    shapes.clear()
    evaluate.main(["--model", str(d / "model"), "--data", str(d / "eval.jsonl"), "--eval-size",
                   "4", "--max-new-tokens", "6", "--device", "cpu", "--compile"])
    assert shapes and {s[0][0] for s in shapes} == {4}
    with pytest.raises(SystemExit) as e:                     # the engine's rollout never reads it
        flags.parse_train_args(["--compile", "--rollout", "vllm"])
    assert e.value.code == 2


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_rollout_and_follows_the_weights(capfd):
    # torch.compile for real (inductor, a C++ compiler): one compile (~40 s on 2 loaded cores), its
    # time printed once; greedy and sampled rollouts as eager's; and after an in-place update of
    # the weights (an optimizer step) the compiled step reads the new ones (no stale constants)
    import shutil
    if not any(shutil.which(x) for x in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler: inductor cannot build the compiled step on CPU")
    model, rollout = _static_case()
    for temperature in (0.0, 1.0):
        _same_rollout(rollout(6, temperature), rollout(6, temperature, compile=False), tol=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = rollout(6, 1.0, compile=False)
    _same_rollout(rollout(6, 1.0), after, tol=1e-4)
    err = capfd.readouterr().err
    assert err.count("sampler: compiled the decode step (6 slots x 192 positions) in") == 1, err


def test_rollout_select_and_cat():
    r = _fake_rollout([[1, 0], [0, 0], [1, 1]])
    s = r.select_groups(torch.tensor([True, False, True]))
    assert s.prompts == [[0], [2]] and s.response_ids.shape[0] == 4
    c = Rollout.cat([s, r])
    assert c.num_groups == 5 and c.correct.shape == (10,) and c.rewards is None
    # a longer rollout pads the shorter one's rows: never a valid mask position, never a log-prob
    long = _fake_rollout([[1, 0]])
    long.response_ids, long.mask, long.logprobs = (torch.ones(2, 5, dtype=torch.long),
                                                   torch.ones(2, 5), -torch.ones(2, 5))
    c = Rollout.cat([r, long])
    assert (c.mask.shape == (8, 5) and c.mask[:6, 2:].sum() == 0
            and c.logprobs[:6, 2:].abs().sum() == 0)
    assert (c.response_ids[:6, 2:] == r.pad_token_id).all() and c.mask[6:].sum() == 10


# ---------------------------------------------------------------------------------------------
# verifier.py: one case per rule (the id names the rule), safety and time, agreement with hand
# labels
# ---------------------------------------------------------------------------------------------

R = pytest.param


VERIFIER_RULES = [
    # finding the final answer
    R("so \\boxed{5}, no: \\boxed{6}", "6", 1.0, id="last-boxed-wins"),
    R("so \\boxed{5}, no: \\boxed{6}", "5", 0.0, id="last-boxed-wins-not-the-earlier"),
    R("\\boxed{\\dfrac{3}{4}} then Answer: 7", "3/4", 1.0, id="boxed-beats-answer-marker"),
    R("\\boxed{{1}+{2}}", "{1}+{2}", 1.0, id="boxed-nested-braces"),
    R("so $\\boxed 7$.", "7", 1.0, id="boxed-bare-token"),
    R("\\boxed {7}", "7", 1.0, id="boxed-space-before-brace"),
    R("\\boxed{7", "7", 0.0, id="unclosed-last-box-is-no-answer"),
    R("I will put it in \\boxed{}.\nAnswer: 7", "7", 1.0, id="empty-box-is-skipped"),
    R("The roots are $\\boxed{2}$ and $\\boxed{-3}$.", "-3, 2", 1.0,
      id="adjacent-boxes-are-one-answer"),
    R("$\\boxed{5}$ or $\\boxed{6}$", "6", 0.0, id="hedging-boxes-are-not-credited"),
    R("\\boxed{34}\n" + "Let me check this once more. " * 4000, "34", 1.0,
      id="boxed-before-a-100k-self-check"),
    R("The total is 1,234.\n#### 1,234", "1234", 1.0, id="hashes-gsm8k"),
    R("#### 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0, id="reference-read-the-same-way"),
    R("#### 72\n\nQuestion: next?\nAnswer: 3", "72", 1.0, id="hashes-beat-answer-marker"),
    R("2x=8\nx=8/2\nAnswer: 4", "4", 1.0, id="answer-colon"),
    R("ANSWER: 34", "34", 1.0, id="answer-marker-any-case"),
    R("**Answer:** 34", "34", 1.0, id="answer-marker-markdown"),
    R("So the answer is 72.", "72", 1.0, id="the-answer-is"),
    R("Final Answer: The final answer is $34$. I hope it is correct.", "34", 1.0,
      id="minerva-format"),
    R("Answer: 12\n\nChecking: 4 * 3 = 12, so the answer is correct.", "12", 1.0,
      id="prose-after-a-marker-is-skipped"),
    R("Answer: 34, as computed above.", "34", 1.0, id="remark-after-the-answer-dropped"),
    R("Answer: $34$ (since 2 * 17 = 34)", "34", 1.0, id="math-span-after-marker"),
    # its last number is not its answer
    R("2x=8\nx=4", "4", 0.0, id="trace-without-marker-no-answer"),
    R("So 2x = 8 and x = 4", "4", 0.0, id="one-line-trace-without-marker-no-answer"),
    # a response that is one number is that answer (math-verify credits it too)
    R("5", "5", 1.0, id="bare-answer"),
    R("x=5", "5", 1.0, id="bare-answer-x-equals"),
    R(" x = 5 ", "5", 1.0, id="bare-answer-x-equals-spaced"),
    R("5.", "5", 1.0, id="bare-answer-trailing-period"),
    R("$-5$.", "-5", 1.0, id="bare-answer-dollars"),
    R("$\\frac{3}{4}$", "0.75", 1.0, id="bare-answer-latex"),
    R("6", "5", 0.0, id="bare-answer-wrong"),
    R("5 apples and 6 pears", "5", 0.0, id="bare-answer-is-only-a-number"),
    R("Answer: ", "", 0.0, id="empty-answer"),
    # units, money, percent, degrees
    R("\\boxed{\\$18}", "18", 1.0, id="money-boxed"),
    R("The answer is \\$18.00.", "18", 1.0, id="money-cents"),
    R("Answer: 18 dollars", "18", 1.0, id="money-word"),
    R("\\boxed{72 \\text{ clips}}", "72", 1.0, id="unit-text"),
    R("\\boxed{5\\mathrm{~cm}}", "5", 1.0, id="unit-mathrm"),
    R("\\boxed{5}", "5\\text{ cm}", 1.0, id="unit-only-in-reference"),
    R("\\boxed{5\\text{ m}}", "5\\text{ cm}", 0.0, id="units-on-both-sides-must-agree"),
    R("\\boxed{30^{\\circ}}", "30", 1.0, id="degrees-braced"),
    R("\\boxed{30^\\circ}", "30^{\\circ}", 1.0, id="degrees"),
    R("\\boxed{50\\%}", "50", 1.0, id="percent-latex"),
    R("The answer is 50%.", "50", 1.0, id="percent-sign"),
    R("Answer: 50 percent", "50\\%", 1.0, id="percent-word"),
    R("\\boxed{0.5}", "50\\%", 0.0, id="percent-is-a-label-not-a-hundredth"),
    # wrappers and number forms
    R("\\boxed{\\textbf{12}}", "12", 1.0, id="textbf"),
    R("\\boxed{\\mathbf{12}}", "12", 1.0, id="mathbf"),
    R("\\boxed{{12}}", "12", 1.0, id="outer-braces"),
    R("\\boxed{(12)}", "12", 1.0, id="parentheses-around-one-number"),
    R("\\boxed{\\tfrac{3}{4}}", "0.75", 1.0, id="tfrac"),
    R("\\boxed{\\frac34}", "3/4", 1.0, id="brace-less-frac"),
    R("\\boxed{\\frac 34}", "3/4", 1.0, id="brace-less-frac-spaced"),
    R("\\boxed{1{,}234}", "1234", 1.0, id="latex-thousands-comma"),
    R("\\boxed{1\\,234}", "1,234", 1.0, id="thin-space-thousands"),
    R("Answer: 1 234", "1234", 1.0, id="space-thousands"),
    R("Answer: 3 4", "34", 0.0, id="digits-apart-never-merge"),
    R("\\boxed{3 1/2}", "7/2", 1.0, id="mixed-number"),
    R("\\boxed{3 1/2}", "31/2", 0.0, id="mixed-number-is-not-31/2"),
    R("\\boxed{3\\frac{1}{2}}", "3.5", 1.0, id="latex-mixed-number"),
    R("Answer: −5", "-5", 1.0, id="unicode-minus"),
    R("Answer: 5.0", "5", 1.0, id="trailing-zero"),
    R("Answer: $-2.50$", "-5/2", 1.0, id="decimal-vs-fraction"),
    R("\\boxed{\\frac{-1}{2}}", "-\\frac12", 1.0, id="negative-numerator"),
    R("\\boxed{\\dfrac{1}{-2}}", "-0.5", 1.0, id="negative-denominator"),
    R("\\boxed{\\frac{1}{2}}", "-\\frac{1}{2}", 0.0, id="sign-matters"),
    R("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0, id="scientific-times"),
    R("\\boxed{1.5\\cdot 10^3}", "1500", 1.0, id="scientific-cdot"),
    R("\\boxed{1.5e3}", "1500", 1.0, id="e-notation"),
    R("\\boxed{2^{10}}", "1024", 1.0, id="power"),
    R("\\boxed{10^{-3}}", "0.001", 1.0, id="negative-power"),
    R("\\boxed{2^{100000}}", "2^{100000}", 1.0, id="power-past-the-cap-compared-as-text"),
    R("\\boxed{2^{100000}}", "2^{100001}", 0.0, id="power-past-the-cap-not-equal"),
    R("\\boxed{0.\\overline{3}}", "\\frac{1}{3}", 1.0, id="repeating-decimal-exact"),
    R("\\boxed{0.1\\overline{6}}", "1/6", 1.0, id="repeating-decimal-with-prefix"),
    R("\\boxed{0.333}", "\\frac{1}{3}", 0.0, id="cut-decimal-is-not-a-third"),
    R("\\boxed{034}", "34", 1.0, id="leading-zero"),
    R("\\boxed{73}", "72", 0.0, id="near-miss"),
    # equations, several answers, choices, text
    R("\\boxed{x = 4}", "4", 1.0, id="x-equals-in-response"),
    R("\\boxed{4}", "x=4", 1.0, id="x-equals-in-reference"),
    R("\\boxed{m+n=115}", "115", 1.0, id="expression-equals"),
    R("\\boxed{2, -3}", "-3, 2", 1.0, id="roots-unordered"),
    R("\\boxed{x = 2 \\text{ or } x = -3}", "-3,2", 1.0, id="roots-as-equations"),
    R("\\boxed{2, 3}", "-3, 2", 0.0, id="roots-one-wrong"),
    R("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", 1.0, id="set-unordered"),
    R("\\boxed{\\{1, 2\\}}", "\\{3,2,1\\}", 0.0, id="set-partial"),
    R("\\boxed{\\pm 2}", "2, -2", 1.0, id="plus-minus"),
    R("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0, id="tuple-left-right"),
    R("\\boxed{(2, 1)}", "(1,2)", 0.0, id="tuple-ordered"),
    R("\\boxed{x \\in [-2, 5)}", "[-2,5)", 1.0, id="interval"),
    R("\\boxed{[-2, 5]}", "[-2,5)", 0.0, id="interval-brackets-matter"),
    R("\\boxed{\\text{(C)}}", "C", 1.0, id="choice-text"),
    R("\\boxed{C}", "\\textbf{(C) }12", 1.0, id="choice-with-value"),
    R("\\boxed{(B)}", "C", 0.0, id="choice-wrong"),
    R("\\boxed{\\text{Monday}}", "Monday", 1.0, id="text-fallback"),
    R("Answer: x + 1", "x+1", 1.0, id="string-fallback"),
    R("\\boxed{\\sqrt2/2}", "\\frac{\\sqrt{2}}{2}", 1.0, id="string-slash-as-frac"),
    R("\\boxed{x^{2}+1}", "x^2+1", 1.0, id="string-braced-exponent"),
]


@pytest.mark.parametrize("response,answer,want", VERIFIER_RULES)
def test_verifier_rules(response, answer, want):
    assert verify(response, answer) == want


def test_verifier_canonical_answer_groups_equal_answers():
    # majority voting: equal answers written differently share one canonical string
    same = ["\\boxed{\\frac{1}{2}}", "Answer: 0.5", "The answer is $\\dfrac12$.", "#### 1/2",
            "\\boxed{\\tfrac{2}{4}}"]
    assert len({canonical_answer(r) for r in same}) == 1
    assert (canonical_answer("\\boxed{2, -3}") == canonical_answer("\\boxed{\\{-3, 2\\}}")
            == "{-3,2}")
    assert canonical_answer("\\boxed{(1, 2)}") != canonical_answer("\\boxed{(2, 1)}")
    assert canonical_answer("\\boxed{\\$1,800}") == canonical("1800") == "1800"
    assert canonical_answer("no answer here") is None and canonical_answer("\\boxed{7") is None
    assert (canonical_answer("x = 0.5") == canonical_answer("\\boxed{\\frac12}")
            and canonical_answer("2x=1\nx=0.5") is None)


def test_verifier_is_total_and_bounded():
    hostile = ["Answer: 50**30**20", "Answer: " + "9" * 100000, "\\boxed{" * 50000, "Answer: 1/0",
               "Answer: __import__('os').system('echo hi')", "#### " + "(" * 10000, None, 12,
               "\x00\uffff",
               "\\boxed{\\{\\}}", "Answer: 1e999999999", "Answer: 10^{-99999999}", "Answer: 0^{-1}"]
    for h in hostile:
        assert verify(h, "1") in (0.0, 1.0) and verify("Answer: 1", h) in (0.0, 1.0)
    # long numbers still compare, as strings
    assert verify("Answer: " + "9" * 100, "9" * 100) == 1.0
    # markers followed by prose are skipped, at most MAX_MARKERS of them
    prose = "Checking: the answer is right.\n"
    assert verify("Answer: 5\n" + prose * (verifier.MAX_MARKERS - 1), "5") == 1.0
    assert verify("Answer: 5\n" + prose * verifier.MAX_MARKERS, "5") == 0.0
    assert parse_number("1,234") == 1234 and parse_number("-\\frac{1}{2}") == parse_number("-0.5")
    assert extract_answer("no answer here") is None
    assert (format_reward("Answer: 3") == 1.0 and format_reward("2x=6\nx=3") == 0.0
            and format_reward("Answer:") == 0.0)
    assert format_reward("x=3") == 1.0  # a bare answer states one


def test_verifier_never_raises_on_random_latex():
    # random strings of the tokens the rules read: every call returns 0 or 1 and a canonical text or
    # None
    rng = random.Random(0)
    tokens = ["\\boxed{", "\\boxed", "}", "{", "\\frac", "1", "2", "0", ".", ",", " ", "-", "/",
              "^", "\\times", "10", "e",
              "x", "=", "(", ")", "[", "]", "\\{", "\\}", "$", "\\$", "%", "\\text{", "cm", " and ",
              "\\pm", "\\overline{",
              "Answer:", "answer is", "####", "\n", "\\left(", "\\sqrt", "−", "(A)", "\\circ", "**",
              "\\(", "\\)", "{,}", "\\,"]
    # half the cases: number-like answers
    numeric = ["1", "2", "0", " ", "/", "-", ".", "\\frac", "{", "}", "^", "e", ","]
    for i in range(3000):
        pool = numeric if i % 2 else tokens
        response = "Answer: " * (i % 2) + "".join(rng.choice(pool)
                                                  for _ in range(rng.randint(1, 30)))
        answer = "".join(rng.choice(pool) for _ in range(rng.randint(1, 10)))
        assert verify(response, answer) in (0.0, 1.0) and verify(answer, response) in (0.0, 1.0)
        assert isinstance(canonical_answer(response), (str, type(None)))


def test_verifier_time_is_bounded_on_megabyte_inputs():
    # adversarial 1 MB inputs, as response and as reference: a superlinear step would take seconds
    # here; a linear one takes a few milliseconds (the bound is loose because the CPUs are shared)
    n = 1_000_000
    attacks = ["\\boxed{" * (n // 7), "\\boxed{" + "{" * n, "Answer: " * (n // 8),
               "answer is " * (n // 10),
               "answe" * (n // 5), "#### " + "1" * n, "(" * n, "9" * n, "$" * n,
               "Answer: " + "\\(" * (n // 2),
               "Answer: " + "1 " * (n // 2), "Answer: " + "\\frac{" * (n // 6),
               "Answer: " + "a " * (n // 2) + "1",
               "Answer: " + "1," * (n // 2), "Answer: " + "{" * 500 + "}" * 500,
               "Answer: " + "-(" * (n // 2),
               "\\boxed{\\{" + "1," * 450 + "\\}}", "x" * n + "\\boxed{1}", "\\boxed{1}" * (n // 9),
               "\\boxed{}" * (n // 8),
               "$\\boxed{1}$, " * (n // 12), "the answer is wrong. " * (n // 21)]
    slowest = 0.0
    for s in attacks:
        for response, answer in ((s, "1"), ("Answer: 1", s), (s, s)):
            t0 = time.perf_counter()
            assert verify(response, answer) in (0.0, 1.0)
            slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 0.2, f"slowest call {slowest * 1000:.0f} ms"


def test_verifier_agrees_with_hand_labels():
    # results/verifier_cases.jsonl: realistic GSM8K / MATH / AIME / DAPO-Math-17k outputs labelled
    # by hand
    with open(os.path.join(HERE, "results", "verifier_cases.jsonl"), encoding="utf-8") as fh:
        cases = [json.loads(line) for line in fh]
    report = verifier.agreement(cases)
    assert report["n"] >= 300
    assert report["agree"] / report["n"] >= 0.95, report
    assert len(report["false_positives"]) <= report["n"] / 300, report["false_positives"]


def test_verifier_command_line_reports_the_case_file_and_explains_its_usage():
    # `python verifier.py CASES.jsonl` (docs/verifier.md); --help and a missing argument answer
    # with argparse's usage, not a traceback
    import subprocess
    run = [sys.executable, os.path.join(HERE, "verifier.py")]
    cases = os.path.join(HERE, "results", "verifier_cases.jsonl")
    out = subprocess.run([*run, cases], capture_output=True, text=True, cwd=HERE)
    assert out.returncode == 0 and " cases: agreement " in out.stdout, out.stderr[-500:]
    assert subprocess.run([*run, "--help"], capture_output=True, text=True).stdout.startswith(
        "usage: python verifier.py")
    missing = subprocess.run(run, capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


# ---------------------------------------------------------------------------------------------
# builtin.py: the task and the tokenizer round trip
# ---------------------------------------------------------------------------------------------

def test_builtin_task_solutions_verify_and_split_is_disjoint():
    rng = random.Random(0)
    for _ in range(300):
        eq, x = builtin.make_problem(rng)
        assert verify(builtin.solve_steps(eq, x, verbose=rng.random() < 0.5), str(x)) == 1.0
        lhs, rhs = eq.split("=")
        a, b = (int(v) for v in builtin.split_linear(lhs))
        c, d = (int(v) for v in builtin.split_linear(rhs)) if "x" in rhs else (0, int(rhs))
        assert a * x + b == c * x + d
    train = {r["prompt"] for r in builtin.sample_problems(2000, seed=1, heldout=False)}
    held = {r["prompt"] for r in builtin.sample_problems(200, seed=2, heldout=True)}
    assert len(held) == 200 and not train & held


def test_builtin_tokenizer_round_trips_through_save_pretrained(tmp_path):
    from transformers import AutoTokenizer
    tok = builtin.make_tokenizer()
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=16, intermediate_size=32,
                                                       num_layers=1), len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "3x-5=x+7\ncheck: 3(6)-5=(6)+7\nAnswer: 6"
    assert (back(text)["input_ids"] == tok(text)["input_ids"]
            and len(back(text)["input_ids"]) == len(text))
    # spaces survive (a qwen2 config would drop them)
    assert back.decode(back(text)["input_ids"]) == text
    assert back.eos_token_id == 1 and back.pad_token_id == 0


def test_packed_warm_start_is_exact():
    """A packed row (positions restarting per demonstration) gives each demonstration the logits it
    gets
    alone, and the labels score exactly its solution tokens: packing changes the cost, not the
    training."""
    tok = builtin.make_tokenizer()
    cfg = builtin.BaseModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, sft_steps=2,
                                  sft_batch_size=12, sft_pack_len=80)
    model = builtin.make_model(cfg, len(tok)).eval()
    batches = builtin.warm_start_batches(tok, cfg)
    assert len(batches) == cfg.sft_steps
    # encoded as a user would
    demos = [(tok(p)["input_ids"], tok(r)["input_ids"]) for p, r in builtin.warm_start_demos(cfg)]
    for k, (ids, pos, labels) in enumerate(batches):
        # packed: fewer rows than demos
        assert ids.shape[1] <= cfg.sft_pack_len and ids.shape[0] < cfg.sft_batch_size
        with torch.no_grad():
            # [R, T, V]
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        found = []
        for r in range(ids.shape[0]):
            starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for a, b in zip(starts, starts[1:]):
                seq = ids[r, a:b]
                # the row's padding
                if (labels[r, a:b] == -100).all():
                    assert (seq == tok.pad_token_id).all()
                    continue
                with torch.no_grad():
                    # [n, V]
                    alone = model(input_ids=seq[None]).logits[0]
                torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-5)
                # prompt tokens unscored
                p = int((labels[r, a:b] == -100).sum())
                assert (labels[r, a + p:b].tolist() == seq[p:].tolist()
                        and seq[-1] == tok.eos_token_id)
                found.append((seq.tolist(), p))
        want = demos[k * cfg.sft_batch_size:(k + 1) * cfg.sft_batch_size]
        # each once, its prompt unscored
        assert sorted(found) == sorted((p + r + [tok.eos_token_id], len(p)) for p, r in want)


def test_shipped_base_model_is_this_recipes_build():
    """base_model/ holds the weights the current recipe builds: after changing the recipe
    (BaseModelConfig,
    the task, the demonstrations, the tokenizer, the warm start), `python -m infra.builtin --ship`
    rebuilds it."""
    with open(os.path.join(builtin.SHIP_DIR, "recipe.json")) as fh:
        recorded = json.load(fh)
    assert recorded["key"] == builtin.recipe_key(), (
        "base_model/ was built by another recipe: rebuild and ship it with "
        "`python -m infra.builtin --ship`")
    assert recorded["config"] == dataclasses.asdict(builtin.BaseModelConfig())
    assert builtin.base_model() == builtin.SHIP_DIR


def test_recipe_key_changes_with_every_part_of_the_recipe_and_only_with_it():
    """The key changes with each config field and each edit of the code a build runs; comments,
    docstrings and the RL data (sample_problems, not part of the build) leave it alone."""
    with open(builtin.__file__) as fh:
        src = fh.read()
    cfg = builtin.BaseModelConfig()
    key = builtin.recipe_key(cfg, src)
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        changed = {f.name: v + 1 if isinstance(v, int) else v / 2}
        assert builtin.recipe_key(dataclasses.replace(cfg, **changed), src) != key, f.name
    # the verbose demonstration's text
    changes = [('"check: {', '"check:{'),
               # the shortcut
               ("return f\"x={m}/{a}\\nAnswer: {int(m / a)}\"",
                "return f\"x={m}/{a}\\nAnswer: {m // a}\""),
               ("verbose=rng.random() < cfg.verbose_frac",
                "verbose=rng.random() <= cfg.verbose_frac"),
               ("rng.randint(-9, 9)", "rng.randint(-8, 9)"),                  # the problems
               ("% 8 == 0", "% 7 == 0"),                                      # the held-out split
               # the tokenizer's vocabulary
               ('CHARS = "0123456789', 'CHARS = "9876543210'),
               ('behavior="isolated"', 'behavior="merged_with_previous"'),   # and its pre-tokenizer
               ("rms_norm_eps=1e-5", "rms_norm_eps=1e-6"),                    # the model
               # the optimiser
               ("sft_lr, weight_decay=0.0, betas=(0.9, 0.98)",
                "sft_lr, weight_decay=0.0, betas=(0.9, 0.99)"),
               ("pos += range(len(s))", "pos += range(1, len(s) + 1)")]       # the packing
    same = [("# every character the task's prompts and solutions use", "# the characters"),
            ('"""\'+5\' or \'-5\', for a constant written after another term."""',
             '"""A signed constant."""'),
            # sample_problems: the RL data
            ("for _ in range(200 * n):", "for _ in range(300 * n):"),
            ("\n\n\ndef make_model(", "\n\n\n\ndef make_model(")]
    for old, new in changes + same:
        assert src.count(old) == 1, old
        changed = builtin.recipe_key(cfg, src.replace(old, new)) != key
        assert changed == ((old, new) in changes), (old, new)


def test_base_model_is_the_shipped_folder_only_for_its_recipe(tmp_path):
    """ship() writes a cached build with its key; base_model() returns it for that recipe only."""
    cfg = builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, sft_steps=2,
                                  sft_batch_size=8)
    cache, shipped = str(tmp_path / "cache"), str(tmp_path / "base_model")
    quiet = lambda *a, **k: None  # noqa: E731
    assert (builtin.base_model(cfg, cache, quiet, ship_dir=shipped)
            == os.path.join(cache, f"base-{builtin.recipe_key(cfg)}"))
    assert builtin.ship(cfg, cache, shipped, log=quiet) == shipped
    assert (builtin.shipped_key(shipped) == builtin.recipe_key(cfg)
            and os.path.exists(os.path.join(shipped, "model.safetensors")))
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) == shipped
    # another recipe: built into the cache
    other = dataclasses.replace(cfg, seed=1)
    assert (builtin.base_model(other, cache, quiet, ship_dir=shipped)
            == os.path.join(cache, f"base-{builtin.recipe_key(other)}"))
    assert (builtin.ship(other, cache, shipped, log=quiet) == shipped
            and builtin.shipped_key(shipped) == builtin.recipe_key(other))
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) != shipped
    _, tok, model = models.load_model(shipped)
    assert model.config.hidden_size == 16 and tok.eos_token_id == 1


def test_bench_parses_its_flags_and_times_the_warm_start_both_ways(capsys):
    """python -m bench is not run by CI otherwise: its flags (and python -m bench.vs_trl's) must
    parse, and the warm-start section must run."""
    from bench import __main__ as bench_main
    from bench import vs_trl
    for main in (bench_main.main, vs_trl.main):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
    bench_main.main(["--only", "warmstart", "--repeats", "1"])
    out = capsys.readouterr().out
    assert ("padded to the longest" in out and "packed into rows" in out
            and "packed / padded time" in out)


# ---------------------------------------------------------------------------------------------
# data.py: data formats, chat template, pluggable and TRL-style rewards, clear errors for bad input
# ---------------------------------------------------------------------------------------------

def test_gsm8k_fields_chat_template_and_reward_plugin(tiny_run_inputs, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Half of 4?", "answer": "4/2 = 2\n#### 2"}) + "\n")
    rows = data.load_rows(str(gsm), "train", prompt_field="question", answer_field="answer")
    assert rows == [{"prompt": "Half of 4?", "answer": "4/2 = 2\n#### 2",
                     "columns": {"answer": "4/2 = 2\n#### 2"}}]
    assert verify("so \\boxed{2}", rows[0]["answer"]) == 1.0
    tok = builtin.make_tokenizer()
    assert (data.PromptFormatter(tok, "{prompt}\nAnswer:")("2x=4")
            == tok("2x=4\nAnswer:")["input_ids"])
    # a chat template written in the built-in vocabulary's characters: system 's', user 'r',
    # assistant 'A'
    tok.chat_template = ("{% for m in messages %}{{ {'system': 's', 'user': 'r'}[m['role']] }}: {{ "
                         "m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    fmt = data.PromptFormatter(tok, "{prompt}", system="x")
    assert tok.decode(fmt("2x=4")) == "s: x\nr: 2x=4\nA: "
    assert data.PromptFormatter(tok, "{prompt}", chat=False)("2x=4") == tok("2x=4")["input_ids"]
    (tmp_path / "myreward.py").write_text("def half(response, answer):\n    return 0.5\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert data.load_reward("myreward:half")("anything", "1") == 0.5
        with pytest.raises(errors.InputError):
            data.load_reward("myreward:nothere")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("content,flags,message", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n', [], "bad.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1"}\n', [], "bad.jsonl:1: no field 'answer'"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--model", "/nonexistent/model"],
     "--model /nonexistent/model: no such folder"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--resume"], "--resume: no checkpoint"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--reward", "nosuchmodule:f"],
     "--reward nosuchmodule:f"),
])
def test_bad_input_gets_one_clear_line(tmp_path, capsys, content, flags, message):
    import train
    (tmp_path / "bad.jsonl").write_text(content)
    argv = ["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out"), "--model",
            str(tmp_path), *flags]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def trl_length(completions, **kwargs):
    """A reward in the shape of TRL's docs: a batch of completions in, one float per completion
    out."""
    return [-abs(8 - len(c)) / 8 for c in completions]


def trl_level_match(prompts, completions, level, answer):
    """TRL's signature with data set columns by name and no **kwargs; None (no score) where `level`
    is missing."""
    return [None if lv is None else float(a in c) * lv for c, lv,
            a in zip(completions, level, answer)]


def test_trl_rewards_get_columns_by_name_are_weighted_and_none_is_no_score():
    rows = [{"prompt": "p0", "answer": "4", "columns": {"answer": "4", "level": 2}},
            # no level: None
            {"prompt": "p1", "answer": "5", "columns": {"answer": "5"}}]
    completions = ["x = 4", "12345678"]
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(prompts=prompts, ids=completion_ids, columns=columns)
        return [1.0, None]

    reward = data.Reward([("len", trl_length), ("level", trl_level_match), ("x", has_x),
                          ("spy", spy)], [1.0, 0.5, 2.0, 1.0])
    assert reward.batch == [True, True, False, True]
    total, parts = reward(["p0", "p1"], completions, rows, lambda: [[1, 2], [3]])
    assert seen == {"prompts": ["p0", "p1"], "ids": [[1, 2], [3]],
                    "columns": {"answer": ["4", "5"], "level": [2, None]}}
    assert parts["len"].tolist() == [-3 / 8, 0.0] and parts["x"].tolist() == [1.0, 0.0]
    assert parts["level"][0] == 2.0 and parts["level"][1].isnan() and parts["spy"][1].isnan()
    # None leaves the sum
    assert total.tolist() == pytest.approx([-3 / 8 + 0.5 * 2.0 + 2.0 + 1.0, 0.0])
    for bad, message in (([("f", lambda completions: [1.0])],
                          "expected a list of 2 floats or None, got list of 1"),
                         ([("f", lambda completions: "yes")],
                          "expected a list of 2 floats or None, got str"),
                         ([("f", lambda completions, solution: [1.0, 1.0])], "needs ['solution']"),
                         ([("f", has_x), ("f", has_x)],
                          "two rewards, or a reserved metric, named reward/f"),
                         ([("mean", has_x)], "reward/mean")):
        pattern = message.replace("[", r"\[").replace("]", r"\]")
        with pytest.raises(errors.InputError, match=pattern):
            data.Reward(bad)(["p0", "p1"], completions, rows)
    with pytest.raises(errors.InputError, match="2 weights for 1"):
        data.Reward([("x", has_x)], [1.0, 2.0])


def _spy(monkeypatch, module, name):
    """Calls of module.name (arguments, return value) recorded as they happen; the real one runs."""
    seen, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append((args, real(*args, **kwargs)))
        return seen[-1][1]
    monkeypatch.setattr(module, name, spy)
    return seen


def test_reward_weights_weigh_the_rewards_train_py_trains_on(tiny_run_inputs, tmp_path,
                                                              monkeypatch):
    # one step of train.py in this process with --reward has_x --reward trl_length and
    # --reward-weights 1 0.5: each drawn response's score (Rollout.correct, what DAPO's +-1 reward
    # and the filter read) is has_x + 0.5 trl_length, row by row; the row logs the same mean
    import train
    drawn = _spy(monkeypatch, train, "draw_round")
    row = _one_step(tiny_run_inputs, tmp_path / "run", "--reward", "test_grpo:trl_length",
                    "--reward-weights", "1", "0.5")
    (_, (roll, _)), = drawn
    x, length = roll.reward_parts["has_x"], roll.reward_parts["trl_length"]          # [N] each
    assert (length < 0).any() and 0 < x.sum() < x.numel()
    assert torch.allclose(roll.correct, x + 0.5 * length, atol=1e-6)
    penalty = dapo.overlong_penalty(roll.lengths, 12, 2)                  # --algo dapo: +-1, Eq. 13
    assert torch.allclose(roll.rewards, 2 * roll.correct - 1 + penalty, atol=1e-6)
    assert row["reward/correct"] == pytest.approx(float(roll.correct.mean()), abs=1e-6)


def test_data_json_array_file_keeps_every_column(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"q": "1+1", "sol": 2, "level": 1},
                                                    {"q": "2+2", "sol": 4}]))
    rows = data.load_rows(str(tmp_path / "rows.json"), "train", "q", "sol")
    assert rows == [{"prompt": "1+1", "answer": "2", "columns": {"sol": 2, "level": 1}},
                    {"prompt": "2+2", "answer": "4", "columns": {"sol": 4}}]
    (tmp_path / "bad.json").write_text('[{"q": "1+1", "sol": 2},\n {"q": ]')
    with pytest.raises(errors.InputError, match=r"bad.json:2: not valid JSON"):
        data.load_rows(str(tmp_path / "bad.json"), "train", "q", "sol")


def test_data_parquet_file_folder_splits_and_saved_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets",
                                   reason="--data with Parquet/Arrow/folders/hub ids needs "
                                   "`datasets`")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    train = [{"question": f"{i}x=0", "solution": str(i), "level": i % 3} for i in range(5)]
    test = [{"question": "9x=0", "solution": "9", "level": 0}]
    (tmp_path / "splits").mkdir()
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "splits" / "train.parquet"))
    datasets.Dataset.from_list(test).to_parquet(str(tmp_path / "splits" / "test.parquet"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                         test=datasets.Dataset.from_list(test)).save_to_disk(
        str(tmp_path / "saved"))
    want = [{"prompt": r["question"], "answer": r["solution"],
             "columns": {"solution": r["solution"], "level": r["level"]}}
            for r in train]
    load = lambda path, **kw: data.load_rows(  # noqa: E731
        str(tmp_path / path), "train", "question", "solution", **kw)
    assert load("train.parquet") == want and load("train.parquet", limit=2) == want[:2]
    assert load("splits") == want and load("splits", hf_split="test")[0]["prompt"] == "9x=0"
    assert load("saved") == want and load("saved", hf_split="test")[0]["answer"] == "9"
    with pytest.raises(errors.InputError, match=r"train.parquet:1: no field 'answer' \(fields: "
                       r"level, question, solution\)"):
        data.load_rows(str(tmp_path / "train.parquet"), "train", "question", "answer")
    with pytest.raises(errors.InputError, match=r"--data .*splits: could not be loaded \(split "
                       r"'validation': "):
        load("splits", hf_split="validation")
    # as if not installed: one line that says what to install
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(errors.InputError, match=r"pip install datasets"):
        load("train.parquet")


# Hub data sets as they are: a few rows of each real schema, read by the docs' recipes. The schemas
# (field names, nesting, types) are those of openai/gsm8k (main), BytedTsinghua-SIA/DAPO-Math-17k
# (verl's format) and trl-lib/DeepMath-103K (TRL's conversational prompt-only format); the problems
# are made up.
DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response "
                    "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                    "answer to the problem.\n\n{}\n\n"
                    "Remember to put your answer on its own line after \"Answer:\".")


SCHEMA_PROBLEMS = [("Let $f(x) = 3x + 2$. Find $f(f(1))$.", "17"),
                   ("How many positive divisors does $36$ have?", "9"),
                   ("What is the remainder when $2^{10}$ is divided by $7$?", "2")]


RECIPE_SCHEMAS = {"openai/gsm8k:main": "gsm8k", "BytedTsinghua-SIA/DAPO-Math-17k": "dapo",
                  "trl-lib/DeepMath-103K": "trl"}  # a docs recipe's --data: the schema of its rows


def _schema_rows(schema: str) -> list[dict]:
    """Rows of a real schema: gsm8k, dapo (verl's), trl (conversational; one row with a system
    turn), text (a plain JSONL)."""
    if schema == "gsm8k":
        return [{"question": q, "answer": f"It takes a few steps.\n#### {a}"}
                for q, a in SCHEMA_PROBLEMS]
    if schema == "dapo":
        return [{"data_source": "math_dapo",
                 "prompt": [{"content": DAPO_INSTRUCTION.format(q), "role": "user"}],
                 "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lean"},
                 "extra_info": {"index": f"0f3c9a52-77e1-4d0b-9c1e-5b2a8d4e{i:04d}"}}
                for i, (q, a) in enumerate(SCHEMA_PROBLEMS)]
    if schema == "trl":
        rows = [{"prompt": [{"content": q, "role": "user"}], "solution": a}
                for q, a in SCHEMA_PROBLEMS]
        rows[1]["prompt"].insert(0, {"content": "You are a careful mathematician.",
                                     "role": "system"})
        return rows
    return [{"prompt": q, "answer": a} for q, a in SCHEMA_PROBLEMS]


def _chat_tokenizer():
    """A byte-level tokenizer (any text round-trips) with a ChatML chat template, as Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def _chatml(messages: list[dict]) -> str:
    """What _chat_tokenizer's template renders for these messages (generation prompt on), written
    out by hand."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _doc_commands(page: str, script: str) -> list[list[str]]:
    """The `script` commands of a docs page's bash blocks, each as the words after `script`
    (comments dropped, continuation lines joined, a quoted text may span lines: as bash reads
    them)."""
    import re
    import shlex
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", _read(os.path.join(HERE, page)), re.S):
        text = ""
        for line in block.splitlines(keepends=True):
            text += line
            if text.endswith("\\\n"):
                continue
            try:
                words = shlex.split(text.replace("\\\n", " "), comments=True)
            except ValueError:  # an open quote: the text goes on on the next line
                continue
            text = ""
            at = [i for i, w in enumerate(words) if w.endswith(script)]
            if at:
                commands.append(words[at[0] + 1:])
    return commands


def _trl_accuracy(completions, solution, **kwargs):
    """trl.rewards.accuracy_reward's contract, where TRL is not installed: the content of each
    completion's one assistant message against the solution column (verifier.verify here,
    math_verify in TRL)."""
    return [verify(c[0]["content"], s) for c, s in zip(completions, solution)]


def _recipe_flags(schema: str, data_path, model) -> list[str]:
    """The docs recipe of this schema with --data / --eval-data on the test's file and --model on
    the test's folder, every other flag as the page gives it (text rows: train.py's defaults)."""
    pages = ("docs/real-models.md", "docs/from-trl.md")
    recipes = {RECIPE_SCHEMAS[f[f.index("--data") + 1]]: f
               for page in pages for f in _doc_commands(page, "train.py")}
    assert set(recipes) == {"gsm8k", "dapo", "trl"}, "a recipe without its schema in RECIPE_SCHEMAS"
    flags = list(recipes.get(schema, ["--data", "x", "--eval-data", "x"]))
    for name, value in (("--data", data_path), ("--eval-data", data_path), ("--model", model)):
        if name in flags:
            flags[flags.index(name) + 1] = str(value)
        else:
            flags += [name, str(value)]
    if "trl.rewards:accuracy_reward" in flags:  # TRL's own, where TRL and math-verify are installed
        try:
            import math_verify  # noqa: F401
            import trl.rewards  # noqa: F401
        except ImportError:
            flags[flags.index("trl.rewards:accuracy_reward")] = "test_grpo:_trl_accuracy"
    return flags


@pytest.mark.parametrize("schema", ["gsm8k", "dapo", "trl", "text"])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_docs_recipes_read_the_real_rows_of_their_data_sets(tmp_path, schema, fmt):
    raw = _schema_rows(schema)
    path = tmp_path / f"rows.{fmt}"
    if fmt == "parquet":
        datasets = pytest.importorskip("datasets", reason="Parquet is read through `datasets`")
        datasets.Dataset.from_list(raw).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in raw))
    args = flags.parse_train_args(_recipe_flags(schema, path, tmp_path))
    fields = args.prompt_field, args.answer_field
    rows = data.load_rows(args.data, "train", *fields, hf_split=args.data_split)
    eval_rows = data.load_rows(args.eval_data, "eval", *fields, args.eval_size, args.eval_split)
    assert len(rows) == len(eval_rows) == 3
    tok = _chat_tokenizer()
    encode = data.PromptFormatter(tok, args.prompt_template, args.system_prompt, args.chat_template)
    encode.check(rows, "--data")
    answers = [a for _, a in SCHEMA_PROBLEMS]
    for r, raw_row, (question, answer) in zip(rows, raw, SCHEMA_PROBLEMS):
        if schema == "gsm8k":  # the text through --prompt-template, as one user turn
            want = [{"role": "user", "content": args.prompt_template.replace("{prompt}", question)}]
            assert want[0]["content"].endswith("within \\boxed{}.")
            assert r["answer"] == raw_row["answer"]
        elif schema == "text":
            want = [{"role": "user", "content": question}]
            assert r["answer"] == answer
        else:  # the row's messages as they are (a system turn kept); the answer: the nested one
            want = raw_row["prompt"]
            assert r["prompt"] == want and r["answer"] == answer
        ids = encode(r["prompt"])
        assert tok.decode(ids) == _chatml(want), tok.decode(ids)
        if schema == "dapo":  # the real instruction: prompts over a 128-token KV block, one prefix
            assert len(ids) > 128 and ids[:100] == encode(rows[0]["prompt"])[:100]
    # the recipe's reward: a right final answer scores 1, a wrong one 0 (DAPO asks for "Answer: N")
    right = [f"So the answer line is\nAnswer: {a}" if schema == "dapo" else f"\\boxed{{{a}}}"
             for a in answers]
    prompts, completions = [r["prompt"] for r in rows] * 2, right + ["\\boxed{1000}"] * 3
    total, _ = data.Reward.load(args.reward, args.reward_weights)(prompts, completions, rows * 2)
    assert total.tolist() == [1.0] * 3 + [0.0] * 3
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):  # what GRPOTrainer passes
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [0.0] * len(completions)

    data.Reward([("spy", spy)])(prompts[:3], completions[:3], rows)
    chat = schema in ("dapo", "trl")  # TRL's conversational format: one assistant message each
    assert seen["completions"] == ([[{"role": "assistant", "content": c}] for c in right] if chat
                                   else right)
    assert seen["prompts"] == [r.get("prompt", r.get("question")) for r in raw]
    others = {k: [r[k] for r in raw] for k in raw[0] if k != args.prompt_field}
    assert seen["columns"] == others  # dapo: reward_model, extra_info, ... as the rows hold them
    if schema == "dapo":
        assert seen["columns"]["reward_model"][0] == {"ground_truth": "17", "style": "rule-lean"}


def test_message_prompts_keep_their_system_turn_and_bad_prompts_name_their_row(tiny_run_inputs,
                                                                               tmp_path, capsys):
    import train
    tok = _chat_tokenizer()
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
           {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    fmt = data.PromptFormatter(tok, "{prompt} (think first)", system="You are a tutor.")
    # the row's own system turn wins over --system-prompt; the template rewrites the last user turn
    want = [*own[:3], {"role": "user", "content": "Q2 (think first)"}]
    assert tok.decode(fmt(own)) == _chatml(want)
    assert own[3]["content"] == "Q2"                                     # the row is left as it was
    assert tok.decode(fmt(own[1:2])) == _chatml([{"role": "system", "content": "You are a tutor."},
                                                 {"role": "user", "content": "Q1 (think first)"}])
    assert fmt(own[1:2]) == fmt("Q1")  # a text prompt: the one-user-turn message list it stands for
    # a message list has no raw-text form: --no-chat-template, or a tokenizer without a chat
    # template, is one line naming the first such row, before any sampling
    rows = [{"prompt": "2x=4", "answer": "2"}, {"prompt": own, "answer": "2"}]
    for formatter, why in ((data.PromptFormatter(tok, chat=False), "--no-chat-template sends raw"),
                           (data.PromptFormatter(builtin.make_tokenizer()),
                            "the tokenizer has no chat template")):
        formatter.check(rows[:1], "--data x")
        message = rf"^--data x: row 2: its prompt is a list of chat messages: {why}"
        with pytest.raises(errors.InputError, match=message):
            formatter.check(rows, "--data x")
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for extra, why in (([], "the tokenizer has no chat template"),
                       (["--no-chat-template"], "--no-chat-template")):
        with pytest.raises(SystemExit) as e:
            train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "out"), "--data", str(jsonl),
                        *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"--data {jsonl}: row 2: " in err and why in err
    # a prompt that is neither text nor messages, a dotted field that is not there: file and line
    bad = tmp_path / "bad.jsonl"
    for prompt, got in ((7, "int 7"), ({"role": "user"}, 'dict {"role": "user"}'),
                        (["a", "b"], 'list ["a", "b"]'), ([], "list []"),
                        ([{"role": "user", "content": None}], "list"),
                        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "list"),
                        (None, "NoneType null")):
        bad.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                               for p in ("ok", prompt)))
        with pytest.raises(errors.InputError) as e:
            data.load_rows(str(bad), "train")
        message = f"{bad}:2: field 'prompt' is neither a text nor a list of chat messages"
        assert str(e.value).startswith(message) and f"(got {got}" in str(e.value)
        assert "\n" not in str(e.value)
    verl = tmp_path / "verl.jsonl"
    for reward_model, message in (({"style": "rule"}, r"\(reward_model's fields: style\)"),
                                  ("34", r"\(reward_model is a str, not an object\)")):
        verl.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1"}],
                                    "reward_model": reward_model}) + "\n")
        with pytest.raises(errors.InputError,
                           match=rf"^{verl}:1: no field 'reward_model.ground_truth' {message}$"):
            data.load_rows(str(verl), "train", answer_field="reward_model.ground_truth")
    verl.write_text(json.dumps({"prompt": "1+1", "a.b": "2", "a": {"b": "3"}}) + "\n")
    assert data.load_rows(str(verl), "train", answer_field="a.b")[0]["answer"] == "2"  # a key wins


def test_trl_reward_columns_are_the_keys_of_every_row():
    # JSONL rows need not share their keys (a Dataset's always do): a column only later rows hold
    # still reaches the reward, None for the rows without it, whichever row comes first
    rows = [{"prompt": "p0", "answer": "1", "columns": {"answer": "1"}},
            {"prompt": "p1", "answer": "2", "columns": {"answer": "2", "level": 3}},
            {"prompt": "p2", "answer": "3", "columns": {"answer": "3", "hint": "odd"}}]
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns)
        return [1.0] * len(completions)

    data.Reward([("spy", spy)])(["p0", "p1", "p2"], ["a", "b", "c"], rows)
    assert seen == {"answer": ["1", "2", "3"], "level": [None, 3, None],
                    "hint": [None, None, "odd"]}
    total, parts = data.Reward([("level", trl_level_match)])(["p0", "p1", "p2"], ["2"] * 3, rows)
    assert parts["level"][1] == 3.0 and parts["level"][0].isnan()
    assert total.tolist() == [0.0, 3.0, 0.0]


TRL_SEEN = []  # what trl_spy_reward was called with, in-process runs


def trl_spy_reward(prompts, completions, reward_model, **kwargs):
    """TRL's signature, recording its arguments; scores a response by its length (mixed groups)."""
    TRL_SEEN.append({"prompts": prompts, "completions": completions, "reward_model": reward_model})
    return [len(c[0]["content"]) / 100 for c in completions]


# ---------------------------------------------------------------------------------------------
# evaluate.py: pass@k, maj@n, mean@n over ranks, the command
# ---------------------------------------------------------------------------------------------

def test_pass_at_k_equals_enumerating_every_k_subset():
    import itertools

    import evaluate
    for n in range(1, 8):
        for c in range(n + 1):
            # samples 0..c-1 are the correct ones; the share of k-subsets holding one
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                want = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert evaluate.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_and_bad_input():
    import evaluate
    # one correct of 1000, half drawn
    assert evaluate.pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert evaluate.pass_at_k(2000, 10, 1) == pytest.approx(10 / 2000, abs=1e-12)  # pass@1 = c / n
    assert evaluate.pass_at_k(1000, 0, 1000) == 0.0 and evaluate.pass_at_k(1000, 1, 1000) == 1.0
    assert (evaluate.pass_ks(1) == [1] and evaluate.pass_ks(6) == [1, 2, 4]
            and evaluate.pass_ks(32) == [1, 2, 4, 8, 16, 32])
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            evaluate.pass_at_k(n, c, k)


@pytest.mark.parametrize("answers,want", [
    (["4", "5", "4"], "4"),
    (["5", "4", "4", "5"], "5"),               # a tie: the answer that appeared first wins
    # None is the commonest but never wins over an answer
    (["4", None, "5", None, None, "5"], "5"),
    ([None, "3", None], "3"),
    ([None, None], None), ([], None),           # no answer at all
    (["7"], "7"),
])
def test_majority_vote_by_hand(answers, want):
    import evaluate
    assert evaluate.majority_vote(answers) == want


def _record(i, responses, scores, lengths=None, truncated=None):
    import evaluate
    n = len(responses)
    return evaluate.problem_record(i, {"prompt": f"p{i}", "answer": "4"}, responses, scores,
                                   lengths or [3] * n, truncated or [False] * n)


def test_eval_metrics_by_hand():
    import evaluate
    # problem 0: 2 of 4 right; '4' wins the vote (the first sample's '6' does not): maj right
    # problem 1: none right; Nones never win, and of the tied '3' and '7' the first to appear does:
    # maj wrong
    a = _record(0, ["Answer: 6", "Answer: 4", "so \\boxed{4}", "Answer: 5"], [0.0, 1.0, 1.0, 0.0],
                [2, 4, 4, 2], [False] * 4)
    b = _record(1, ["no", "Answer: 3", "x", "Answer: 7"], [0.0] * 4, [6, 6, 6, 6],
                [True, True, False, False])
    # the right '4' won
    assert a["majority"] == evaluate.CREDITED and a["majority_score"] == 1.0 and a["correct"] == 2
    assert b["majority"] == evaluate.canonical_answer("Answer: 3") and b["majority_score"] == 0.0
    ks = evaluate.pass_ks(4)
    m = evaluate.eval_metrics(evaluate.totals([a, b], ks), 4, ks)
    assert m == pytest.approx({
        "eval/mean@4": (0.5 + 0.0) / 2, "eval/mean@4_std": 0.25,  # population std of (0.5, 0.0)
        # problem 0: 1 - C(2,2)/C(4,2); problem 1: 0
        "eval/pass@1": 0.25, "eval/pass@2": (1 - 1 / 6) / 2,
        "eval/pass@4": 0.5, "eval/maj@4": 0.5, "eval/truncated_frac": 2 / 8,
        "eval/len_mean": 36 / 8})
    g = evaluate.eval_metrics(evaluate.totals([_record(0, ["Answer: 4"], [1.0]),
                                               _record(1, ["Answer: 5"], [0.0])], [1]), 1, [1])
    # greedy: today's keys
    assert g == {"eval/accuracy": 0.5, "eval/truncated_frac": 0.0, "eval/len_mean": 3.0}


def test_majority_vote_counts_what_the_reward_counts():
    import evaluate

    def tagged(response, answer):  # a custom --reward that reads a format the verifier does not
        return float(response.strip() == f"<answer>{answer}</answer>")
    # 2 of 3 samples right by the reward, none readable by the verifier: the vote is right, as
    # mean@3 says
    responses = ["<answer>4</answer>", "<answer>7</answer>", "<answer>4</answer>"]
    r = _record(0, responses, [tagged(x, "4") for x in responses])
    assert [s["answer"] for s in r["samples"]] == [None] * 3 and r["majority"] == evaluate.CREDITED
    assert r["majority_score"] == 1.0
    # wrong answers the verifier reads still outvote one right answer; the right one wins a tie
    # drawn first
    r = _record(1, ["<answer>4</answer>", "Answer: 6", "6"], [1.0, 0.0, 0.0])
    assert r["majority"] == canonical("6") and r["majority_score"] == 0.0
    r = _record(2, ["<answer>4</answer>", "Answer: 6"], [1.0, 0.0])
    assert r["majority"] == evaluate.CREDITED and r["majority_score"] == 1.0
    # the default verifier: a credited answer is the reference's, so this is the vote by canonical
    # answers
    responses = ["Answer: 6", "\\boxed{4}", "4", "Answer: 6", "x = 4"]
    scores = [verify(x, "4") for x in responses]
    plain = evaluate.majority_vote([canonical_answer(x) for x in responses])
    assert plain == canonical("4") and evaluate.majority_vote(evaluate.votes(
        [canonical_answer(x) for x in responses], scores)) == evaluate.CREDITED
    # never a canonical text
    assert canonical_answer("Answer: " + evaluate.CREDITED) != evaluate.CREDITED


def test_majority_vote_merges_one_answer_written_three_ways():
    import evaluate
    # 2 of 5 samples right (4); three wrong ones give 1/2 as 0.5, \frac{1}{2} and 1/2: one answer,
    # so it has the majority (3 votes to 2), maj@5 is 0. Voted as written, they would split 1-1-1
    # and the right 4 would win.
    responses = ["\\boxed{4}", "Answer: 0.5", "so \\boxed{\\frac{1}{2}}", "x = 4",
                 "the answer is 1/2"]
    scores = [verify(x, "4") for x in responses]
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert len({extract_answer(responses[i]) for i in (1, 2, 4)}) == 3     # three texts, one number
    r = _record(0, responses, scores)
    half, four = canonical("1/2"), canonical("4")
    assert [s["answer"] for s in r["samples"]] == [four, half, half, four, half]
    assert r["majority"] == canonical("1/2") and r["majority_score"] == 0.0 and r["correct"] == 2
    m = evaluate.eval_metrics(evaluate.totals([r], [1]), 5, [1])
    assert m["eval/maj@5"] == 0.0 and m["eval/mean@5"] == pytest.approx(0.4)


class _Rank:
    """Dist for one rank of `world` without a process group: sum returns this rank's share."""
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def sum(self, x):
        return x.detach().double().clone()


def _eval_setup(d, *extra):
    """train.py's flags (flags.TrainArgs), the tiny model with large random weights (the fixture's
    answers '\n' to every prompt
    greedily; these give each prompt its own answer), and 12 built-in held-out problems."""
    args = flags.parse_train_args(["--model", str(d / "model"), "--max-new-tokens", "10",
                                   "--device", "cpu", *extra])
    _, tok, model = models.load_model(args.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return args, tok, model, builtin.sample_problems(12, 2, True)


# the random model is never right: this scores some of its responses 1
def _has_9(response, answer):
    return float("9" in response)


def test_greedy_evaluation_equals_greedy_rollouts_scored_by_hand(tiny_run_inputs):
    import evaluate
    args, tok, model, rows = _eval_setup(tiny_run_inputs)
    reward = _has_9
    m, records = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    # one greedy answer per problem, scored here: sums of reward, truncation, length
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in rows], 1, 10, eos, tok.pad_token_id,
                         temperature=0.0)
    texts = [tok.decode(roll.response_ids[i, : roll.lengths[i]], skip_special_tokens=True)
             for i in range(len(rows))]
    correct = sum(reward(t, r["answer"]) for t, r in zip(texts, rows))
    assert 0 < correct < len(rows) and 0 < roll.truncated.sum() < len(rows)
    assert m == {"eval/accuracy": correct / len(rows),
                 "eval/truncated_frac": roll.truncated.sum().item() / len(rows),
                 "eval/len_mean": roll.lengths.sum().item() / len(rows)}
    assert [s["response"] for r in records for s in r["samples"]] == texts
    assert evaluate.headline(1) == "eval/accuracy" and evaluate.headline(8) == "eval/mean@8"


def test_sampled_evaluation_is_the_same_split_over_ranks(tiny_run_inputs, monkeypatch):
    import evaluate
    # 2 problems per batch: each rank batches other problems together
    monkeypatch.setattr(evaluate, "EVAL_BATCH", 8)
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p",
                                         "0.9")
    reward = _has_9
    m1, r1 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    parts = [evaluate.evaluate_model(model, tok, rows, args, _Rank(k, 3), reward)[1]
             for k in range(3)]
    # same samples, scores, votes
    assert sorted((r for p in parts for r in p), key=lambda r: r["index"]) == r1
    ks = evaluate.pass_ks(4)
    assert evaluate.eval_metrics(sum(evaluate.totals(p, ks) for p in parts), 4,
                                 ks) == pytest.approx(m1, abs=1e-12)
    scores = [[s["score"] for s in r["samples"]] for r in r1]
    assert (m1["eval/mean@4"] == pytest.approx(sum(map(sum, scores)) / 48)
            == pytest.approx(m1["eval/pass@1"]))
    assert m1["eval/pass@1"] <= m1["eval/pass@2"] <= m1["eval/pass@4"] == sum(map(max, scores)) / 12
    # samples differ between problems
    assert len({tuple(s["response"] for s in r["samples"]) for r in r1}) == 12
    assert len({s["response"] for s in r1[0]["samples"]}) > 1                   # and within one


def test_eval_flags_are_shared_and_checked(capsys):
    import dataclasses as dc

    import evaluate
    mine = {f.name: f for f in dc.fields(flags.TrainArgs)}
    for f in dc.fields(flags.EvalArgs):  # one definition: same type, default and help in train.py
        assert ((mine[f.name].type, mine[f.name].default, mine[f.name].metadata)
                == (f.type, f.default, f.metadata)), f.name
    for parse in (flags.parse_train_args, evaluate.main):
        for bad in (["--eval-samples", "0"], ["--eval-temperature", "0"], ["--eval-top-p", "1.5"],
                    ["--max-new-tokens", "0"]):
            with pytest.raises(SystemExit) as e:
                parse(bad)
            err = capsys.readouterr().err
            assert (e.value.code == 2 and err.startswith("error: ")
                    and len(err.strip().splitlines()) == 1), err


# ---------------------------------------------------------------------------------------------
# train.py, flags.py: flags, the step's metrics, end-to-end runs through subprocess, the loss flags
# reach the update
# ---------------------------------------------------------------------------------------------

def test_bad_flags_exit_with_one_line(capsys):
    for bad in (["--group-size", "1"], ["--max-new-tokens", "0"], ["--algo", "ppo"],
                ["--reduction", "mean"],
                ["--top-p", "0"], ["--overlong-cache", "999"], ["--steps", "x"],
                ["--loss", "reinforce"],
                ["--kl", "k4"], ["--loss", "gspo", "--clip-c", "3"], ["--tis-cap", "-1"],
                ["--beta", "-0.1"]):
        with pytest.raises(SystemExit) as e:
            flags.parse_train_args(bad)
        err = capsys.readouterr().err
        assert (e.value.code == 2 and err.startswith("error: ")
                and len(err.strip().splitlines()) == 1), err


def test_overlong_filter_masks_the_truncated_rows_the_update_gets(tiny_run_inputs, tmp_path,
                                                                   monkeypatch):
    # one step of train.py in this process with 3 new tokens (most responses truncated): with the
    # filter (dapo's default) update_policy gets the loss mask with every truncated row zeroed,
    # without it the rollout's own mask; the same samples either way
    updates = _spy(monkeypatch, update, "update_policy")
    masks = {}
    for name, extra in (("on", []), ("off", ["--no-overlong-filter"])):
        _one_step(tiny_run_inputs, tmp_path / name, "--max-new-tokens", "3",
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


def _update_stats(first: dict, rest: dict, mismatch_max: float = 0.0):
    zero = dict.fromkeys(update.UPDATE_SUMS, 0.0)
    return update.UpdateStats({**zero, **first}, {**zero, **rest}, mismatch_max, logprob_s=0.0,
                              update_s=0.0)


def test_step_metrics_worked_by_hand():
    # one step, summed over ranks: 2 groups of G = 4 drawn (8 samples), 2 optimizer updates (--mu 2,
    # one mini-batch), 10 loss tokens a pass; a --reward component "fmt" scored 6 of the 8 samples,
    # "len" none
    d = {"samples": 8.0, "reward": 2.0, "correct": 3.0, "length": 40.0, "truncated": 2.0,
         "groups": 2.0, "groups_zero_std": 1.0, "groups_all_correct": 0.0, "groups_all_wrong": 1.0,
         "reward/fmt": 1.5, "scored:reward/fmt": 6.0, "reward/len": 0.0, "scored:reward/len": 0.0}
    first = {"loss": 0.5, "kl": 0.2, "tokens": 10.0, "entropy": 6.0, "entropy_tokens": 12.0,
             "grad_norm": 3.0,
             "updates": 1.0, "mismatch/abs": 0.6, "mismatch/kl": 0.12, "mismatch/tokens": 12.0,
             # the first update: ratio 1
             "clip/low_frac": 0.0, "clip/high_frac": 0.0, "ratio/mean": 10.0}
    rest = {"loss": 0.3, "kl": 0.4, "tokens": 10.0, "grad_norm": 1.0, "updates": 1.0,
            "clip/low_frac": 1.0, "clip/high_frac": 2.0, "clip/dual_frac": 0.5, "ratio/mean": 10.5}
    row = metrics.step_metrics(d, _update_stats(first, rest, 0.25), mu=2, clip_c=3.0)
    assert row == pytest.approx({
        "loss": 0.4,                     # (0.5 + 0.3) / 2 updates
        "reward/mean": 0.25,             # 2 / 8 samples
        "reward/correct": 0.375,         # 3 / 8
        "reward/frac_zero_std": 0.5,     # 1 / 2 groups
        "groups/all_correct": 0.0,       # 0 / 2
        "groups/all_wrong": 0.5,         # 1 / 2
        "reward/fmt": 0.25,              # 1.5 / the 6 samples it scored ("len" scored none: no key)
        "kl": 0.03,                      # (0.2 + 0.4) / 20 loss tokens of both updates
        "entropy": 0.5,                  # 6 / 12 tokens, counted in the first pass only
        "mismatch/logp_abs_mean": 0.05,  # 0.6 / 12
        "mismatch/logp_abs_max": 0.25,   # as update_policy gave it
        "mismatch/kl": 0.01,             # 0.12 / 12
        # 1 / the 10 tokens of the off-policy update (the first is left out)
        "clip/low_frac": 0.1,
        "clip/high_frac": 0.2,           # 2 / 10
        "ratio/mean": 1.05,              # 10.5 / 10
        "clip/dual_frac": 0.05,          # 0.5 / 10 (--clip-c is on)
        "len/mean": 5.0,                 # 40 / 8
        "len/truncated_frac": 0.25,      # 2 / 8
        "tokens/in_loss": 10.0,          # 20 / --mu 2: the step's loss tokens once
        "grad_norm": 2.0,                # (3 + 1) / 2 updates
        "updates": 2.0,
    })
    # one update only (--mu 1): the clip and ratio keys are the first update's; no --clip-c, no dual
    # key
    row = metrics.step_metrics(d, _update_stats(first, {}), mu=1, clip_c=0.0)
    assert (row["ratio/mean"], row["clip/high_frac"], row["loss"],
            row["kl"]) == pytest.approx((1.0, 0.0, 0.5, 0.02))
    assert "clip/dual_frac" not in row
    # nothing trained (dynamic sampling kept no group): means over updates and tokens are 0, no clip
    # keys
    row = metrics.step_metrics(d, _update_stats({}, {}), mu=1, clip_c=3.0)
    assert ((row["loss"], row["kl"], row["entropy"], row["grad_norm"], row["updates"])
            == (0.0, 0.0, 0.0, 0.0, 0.0))
    assert not {"clip/low_frac", "clip/high_frac", "ratio/mean", "clip/dual_frac"} & set(row)


def test_train_help_shows_args_sections_as_groups_with_every_flag_once(capsys, monkeypatch):
    import dataclasses as dc
    import re

    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        flags.parse_train_args(["--help"])
    assert e.value.code == 0
    groups, where = {}, None                   # group title -> the flags listed under it, in order
    for line in capsys.readouterr().out.splitlines():
        if re.fullmatch(r"\S.*:", line):       # a group's heading: "how much:"
            where = groups.setdefault(line[:-1], [])
        elif m := re.match(r"  (?:-h, )?(--[\w-]+)", line):
            where.append(m.group(1))
    titles = ["options", "the model and data", "how much", "optimisation",
              "the loss: GRPO's settings, and DAPO's four fixes one by one", "the run"]
    assert list(groups) == titles and groups["options"] == ["--help"]
    # EvalArgs' flags (flags.TrainArgs inherits them) come first in their sections
    assert [group[0] for group in list(groups.values())[1:]] == ["--model", "--max-new-tokens",
                                                                 "--lr", "--beta", "--seed"]
    assert "--algo" in groups["the model and data"] and "--mini-batches" in groups["optimisation"]
    assert "--eval-samples" in groups["how much"] and "--bf16" in groups["the run"]
    assert "--dynamic-sampling" in groups[titles[4]] and "--resume" in groups["the run"]
    listed = [f for group in list(groups.values())[1:] for f in group]
    # each once
    assert sorted(listed) == sorted("--" + f.name.replace("_", "-")
                                    for f in dc.fields(flags.TrainArgs))


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
        roll = _fake_rollout([[1, 0, 0, 1]] * (len(part) // 4))
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


# ---------------------------------------------------------------------------------------------
# checkpoint.py, parallel.py: resume, atomic saves, the run lock; DDP, FSDP and gradient
# checkpointing
# ---------------------------------------------------------------------------------------------

def test_dist_on_cuda_uses_the_local_rank_and_nccl(monkeypatch):
    # the CUDA branch of Dist cannot run here: drive it with set_device and init_process_group
    # stubbed out
    from infra import parallel
    calls = []
    for k, v in (("WORLD_SIZE", "2"), ("RANK", "3"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend,
                        **kw: calls.append(("init", backend, kw)))
    ranks = parallel.Dist("cuda")
    assert (ranks.device, ranks.rank, ranks.world, ranks.master) == ("cuda:1", 3, 2, False)
    assert calls == [("set_device", "cuda:1"), ("init", "nccl", {})]
    # without torchrun: no process group, except for --fsdp, which shards over one rank (an
    # in-memory store)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k)
    calls.clear()
    parallel.Dist("cuda")
    assert calls == []
    ranks = parallel.Dist("cuda", fsdp=True)
    assert (ranks.device == "cuda" and [(c[1], c[2]["rank"], c[2]["world_size"])
                                        for c in calls] == [("nccl", 0, 1)])


def test_fsdp_shards_each_decoder_layer_then_the_root_bf16_on_cuda(monkeypatch):
    # fully_shard recorded instead of run, so the CUDA branch (bf16 compute, float32 reductions)
    # runs on CPU too
    import torch.distributed.device_mesh as device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    calls, meshes = [], []
    monkeypatch.setattr(parallel, "fully_shard", lambda m, **kw: calls.append((m, kw)))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind,
                        shape: meshes.append((kind, shape)) or "mesh")
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 4)
    for device, param_dtype, reduce_dtype in (("cuda:1", torch.bfloat16, torch.float32),
                                              ("cpu", None, None)):
        calls.clear()
        assert parallel.wrap(model, parallel.Dist(device), fsdp=True) is model
        # bottom-up, the root last
        assert [m for m, _ in calls] == [*model.model.layers, model]
        assert [kw["reshard_after_forward"] for _, kw in calls] == [True, True, True, False]
        assert all(kw["mesh"] == "mesh" and kw["mp_policy"].param_dtype == param_dtype
                   and kw["mp_policy"].reduce_dtype == reduce_dtype for _, kw in calls)
    assert meshes == [("cuda", (4,)), ("cpu", (4,))]
    with pytest.raises(errors.ShardingError, match="no decoder layers"):
        parallel.shard(torch.nn.Linear(2, 2), "cpu")
    # one process, no --fsdp: as is
    assert parallel.wrap(model, parallel.Dist("cpu"), fsdp=False) is model


def test_fsdp_in_one_process_gathers_for_rollouts_and_checkpoints_atomically(tmp_path, monkeypatch):
    # FSDP2 over a one-rank gloo group in this process. `unsharded` leaves the layers sharded again,
    # and freeing their weights after each forward. Checkpoints: save step 1, crash in the middle of
    # saving step 2, and load: `latest` still names step 1, whose weights, AdamW moments and
    # scheduler come back
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ranks = parallel.Dist("cpu", fsdp=True)
    try:
        def fresh():
            torch.manual_seed(0)
            cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
            model = parallel.wrap(LlamaForCausalLM(cfg), ranks, fsdp=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

        def train_step(model, opt, sched):
            model(input_ids=torch.arange(1, 9)[None]).logits.square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

        def snapshot(model, opt):
            return ({k: v.full_tensor().clone() for k, v in model.state_dict().items()},
                    [t.full_tensor().clone() for s in opt.state.values()
                     for t in (s["exp_avg"], s["exp_avg_sq"])])

        model, opt, sched = fresh()
        layer = model.model.layers[0].self_attn.q_proj
        sharded = lambda: type(layer.weight).__name__ == "DTensor"  # noqa: E731 - the registered parameter is the shard
        with parallel.unsharded(model), torch.no_grad():
            model(input_ids=torch.arange(1, 9)[None])
            assert not sharded()                     # gathered, and kept gathered after a forward
        assert sharded()
        model(input_ids=torch.arange(1, 9)[None])
        # a layer frees its gathered weights after a forward again
        assert sharded()
        folder = str(tmp_path / "checkpoint")
        train_step(model, opt, sched)
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 1, "data_pos": 4}, ranks)
        saved = snapshot(model, opt)
        train_step(model, opt, sched)
        real_save = dcp.save

        def crash(state, checkpoint_id):  # half the shards written, then the process dies
            real_save(dict(list(state.items())[: len(state) // 2]), checkpoint_id=checkpoint_id)
            raise KeyboardInterrupt("killed mid-save")
        monkeypatch.setattr(dcp, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ranks)
        monkeypatch.setattr(dcp, "save", real_save)
        assert (checkpoint.latest(folder).endswith("step-000001")
                and os.path.isdir(folder + "/step-000002.tmp"))
        meta = dcp.FileSystemReader(checkpoint.latest(folder)).read_metadata().state_dict_metadata
        # nothing DCP would unpickle
        assert all(type(m).__name__ == "TensorStorageMetadata" for m in meta.values())
        model2, opt2, sched2 = fresh()
        state = checkpoint.load_sharded(folder, model2, opt2, sched2, ranks)
        assert (state["step"], state["data_pos"], sched2.last_epoch,
                opt2.param_groups[0]["lr"]) == (1, 4, 1, 5e-3)
        (w, m), (w2, m2) = saved, snapshot(model2, opt2)
        assert (all(torch.equal(w[k], w2[k]) for k in w)
                and all(torch.equal(a, b) for a, b in zip(m, m2)) and len(m) > 0)
        # a completed save
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ranks)
        # replaces the old one
        assert sorted(os.listdir(folder)) == ["latest", "step-000002"]
    finally:
        ranks.close()


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes():
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=0, eos_token_id=1))
    roll = sample_groups(model, PROMPTS, 2, 10, eos_token_id=1, pad_token_id=0,
                         generator=[torch.Generator().manual_seed(s) for s in range(3)])
    calls, forwards = [], []
    # runs first in the layer
    model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    # the shared-prefix forward calls the model twice
    model.model.register_forward_hook(lambda *_: forwards.append(1))

    # checkpointed layers drop the cache: update_policy asks for per-response then
    def grads(shared_prefix=True):
        model.train()
        model.zero_grad()
        calls.clear()
        forwards.clear()
        logp, _, valid = rollout_logprobs(model, roll, slice(0, 6), 1.0,
                                          shared_prefix=shared_prefix)
        (-(logp * valid).sum() / valid.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls), len(forwards)

    plain, n_plain, f_plain = grads()
    parallel.checkpoint_activations(model)
    ckpt, n_ckpt, f_ckpt = grads(shared_prefix=False)
    # the layer ran again in backward: it was checkpointed
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt
    assert max((plain[k] - ckpt[k]).abs().max().item() for k in plain) <= 1e-5
    assert all(plain[k].abs().sum() > 0 for k in plain if "layers.0" in k)


def test_update_policy_recomputes_checkpointed_layers_in_an_eval_mode_model(tiny_model):
    """--gradient-checkpointing reaches the update: the model stays in eval mode (as from_pretrained
    gives it), yet each checkpointed layer runs again in backward, only during the gradient passes,
    with the same update as without checkpointing."""
    import contextlib
    import copy
    from types import SimpleNamespace

    from infra import parallel
    roll = _mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(0))

    def run(checkpointing):
        model, calls, forwards = copy.deepcopy(tiny_model), [], []
        if checkpointing:
            parallel.checkpoint_activations(model)
        # first in the layer
        model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
        # once per forward of the model
        model.model.register_forward_hook(lambda *_: forwards.append(1))
        args = SimpleNamespace(micro_batch_size=4, mini_batches=1, mu=1, temperature=1.0,
                               reduction="token",
                               loss="ppo", fsdp=False, gradient_checkpointing=checkpointing,
                               max_new_tokens=20,
                               eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                               entropy_coef=0.0, beta=0.0, kl="k3", grad_clip=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        learner = update.Learner(model, model, None, opt, contextlib.nullcontext)
        update.update_policy(learner, roll, adv, roll.mask, args, parallel.Dist("cpu"))
        assert not any(m.training for m in model.modules())                 # eval mode again after
        return model, len(calls), len(forwards)

    plain, n_plain, f_plain = run(False)
    ckpt, n_ckpt, f_ckpt = run(True)
    # the layer ran again in backward
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt
    assert all(torch.allclose(p, q, atol=1e-6) for p,
               q in zip(plain.parameters(), ckpt.parameters()))


class _OtherRank:
    """Dist of rank 1 of 2 whose all-reduce adds rank 0's flag (1: it took the lock, 0: it was
    refused)."""
    master, world = False, 2

    def __init__(self, rank0_flag):
        self.rank0_flag = rank0_flag

    def sum(self, x):
        return x.double() + self.rank0_flag


def test_the_other_ranks_follow_rank_0s_lock_verdict(tmp_path, capsys):
    # they hold no lock themselves
    assert checkpoint.lock_folder(str(tmp_path / "free"), _OtherRank(1.0)) is None
    assert not (tmp_path / "free").exists()
    with pytest.raises(SystemExit) as e:
        checkpoint.lock_folder(str(tmp_path / "busy"), _OtherRank(0.0))
    assert e.value.code == 2 and capsys.readouterr().err == ""  # rank 0 prints the one line


class _Twin:
    """Dist of rank `rank` of 2 without a process group, whose peer holds exactly what it holds: a
    sum doubles, a gather repeats (so rank 0's verdicts, the lock's among them, come out as on 2
    ranks)."""
    world, device = 2, "cpu"

    def __init__(self, rank):
        self.rank, self.master = rank, rank == 0

    def sum(self, x):
        return x.detach().to(torch.float64) * 2

    def sum_named(self, sums):
        return {k: 2.0 * v for k, v in sums.items()}

    def max(self, n):
        return n

    def gather(self, x):
        return [x, x]

    def barrier(self):
        pass

    def close(self):
        pass


def test_only_rank_0_writes_the_runs_folder(tiny_run_inputs, tmp_path, monkeypatch):
    # train.main in this process as rank 1 of 2, then as rank 0 (DDP's wrap left out: no process
    # group): with a checkpoint every step and completions logged, rank 1 writes nothing under OUT
    # (not even the lock), rank 0 all of it
    import train
    from infra import parallel
    monkeypatch.setattr(parallel, "wrap", lambda model, ranks, fsdp: model)
    files = {}
    for rank in (1, 0):
        monkeypatch.setattr(parallel, "Dist", lambda device, fsdp=False, rank=rank: _Twin(rank))
        out = tmp_path / f"rank{rank}"
        train.main([*_tiny_flags(tiny_run_inputs, out), "--steps", "1", "--save-every", "1",
                    "--no-dynamic-sampling"])
        files[rank] = sorted(str(f.relative_to(out)) for f in out.rglob("*"))  # none: no folder
    assert files[1] == []
    assert {".lock", "config.json", "metrics.jsonl", "completions.jsonl", "checkpoint.pt",
            "final/model.safetensors"} <= set(files[0])


def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # save step 1; the save of step 2 writes half its bytes and the process dies: step 1 still
    # loads, whole
    import io


    def state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = str(tmp_path / "checkpoint.pt")
    model, opt, sched = state(0)
    checkpoint.save(path, model, opt, sched, {"step": 1, "data_pos": 4})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    real_save = torch.save

    def crash(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        with open(f, "wb") as fh:
            fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise KeyboardInterrupt("killed mid-save")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, *state(1), {"step": 2, "data_pos": 8})
    monkeypatch.setattr(torch, "save", real_save)
    fresh, fresh_opt, fresh_sched = state(2)
    ckpt = checkpoint.load(path, fresh, fresh_opt, fresh_sched)
    assert (ckpt["step"] == 1 and all(torch.equal(v, saved[k]) for k,
                                      v in fresh.state_dict().items()))


def test_unreadable_checkpoint_gets_one_clear_line(tiny_run_inputs, tmp_path, capsys):
    """errors.CheckpointError (checkpoint.py raises its own, not errors.InputError) reaches the
    same one line."""
    import train
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "out"), "--steps", "1", "--resume"])
    err = capsys.readouterr().err.strip()
    assert (e.value.code == 2 and "checkpoint.pt: not a usable checkpoint" in err
            and len(err.splitlines()) == 1), err


def _jsonl_file(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_a_cut_last_line_is_dropped_with_a_notice_at_every_byte_and_a_bad_middle_line_is_an_error(
        tmp_path, capsys, monkeypatch):
    """A run killed while appending to metrics.jsonl / completions.jsonl leaves any prefix of its
    bytes past the checkpoint: a step's row, then its completions (one over 8 KB, so written in
    several write()s; one written as raw UTF-8, so cut inside a character too). For every such
    prefix, byte by byte, the reader gives the whole lines and drops a cut last one with exactly one
    notice; for the file cut at each line end (and a byte either side) and every 50th byte,
    read_jsonl does the same and trim_metrics (--resume from step 2) leaves the lines of steps <= 2,
    the checkpoint step's own included, byte for byte."""
    import re

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the rewrites' syncs are tested elsewhere
    kept = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "loss": 0.5},
            {"step": 1, "response": "x+1"}, {"step": 2, "loss": -0.25},
            {"step": 2, "response": "2x=4"}, {"step": 2, "eval/accuracy": 0.5}]
    after = [{"step": 3, "loss": 1.0, "reward/mean": 0.125},
             {"step": 3, "prompt": "3x+1=7\n", "response": "x = 2 ∑é " * 440}]     # > 8 KB
    head = _jsonl_file(kept)
    raw = json.dumps({"step": 3, "response": "∑é" * 60}, ensure_ascii=False) + "\n"
    lines = [_jsonl_file(after[:1]), _jsonl_file(after[1:]), raw.encode()]
    full = head + b"".join(lines)
    assert len(lines[1]) > 8192 and max(full) > 127
    ends = [len(head) + sum(len(x) for x in lines[:i + 1]) for i in range(len(lines))]
    path = tmp_path / "completions.jsonl"

    def expected(cut):
        """The rows a prefix of `cut` bytes holds, and whether its last line is cut (a notice)."""
        whole = sum(e <= cut for e in ends)                     # lines written with their newline
        partial = whole < len(lines) and cut > ([len(head)] + ends)[whole]
        no_newline = partial and cut == ends[whole] - 1          # a whole object but its newline
        rows = kept + [json.loads(x) for x in lines[:whole + no_newline]]
        return rows, partial and not no_newline

    def check_notice(err, cut_short, at):
        if cut_short:
            assert err.count("\n") == 1 and f"{path}: dropped its last line, cut short" in err, at
        else:
            assert err == "", (at, err)
    for cut in range(len(head), len(full) + 1):
        rows, cut_short = expected(cut)
        assert [r for _, r in metrics._parse_jsonl(full[:cut], str(path))] == rows, cut
        check_notice(capsys.readouterr().err, cut_short, cut)
    cuts = {c + k for c in [len(head), *ends] for k in (-1, 0, 1)}
    cuts |= set(range(len(head), len(full), 50))
    for cut in sorted(c for c in cuts if len(head) <= c <= len(full)):
        path.write_bytes(full[:cut])
        rows, cut_short = expected(cut)
        assert metrics.read_metrics(str(path)) == rows, cut
        check_notice(capsys.readouterr().err, cut_short, cut)
        metrics.trim_metrics(str(path), 2)
        check_notice(capsys.readouterr().err, cut_short, cut)
        assert path.read_bytes() == head and os.listdir(tmp_path) == ["completions.jsonl"], cut
    # any other bad line is corruption, not a kill: one line naming file:line, the file as it was
    for bad, line in ((head[:30] + b"\n" + head, 1), (head + b"not json\n", len(kept) + 1)):
        path.write_bytes(bad)
        for read in (metrics.read_metrics, lambda p: metrics.trim_metrics(p, 2)):
            with pytest.raises(errors.CheckpointError,
                               match=f"^{re.escape(str(path))}:{line}: not a JSON line .*corrupt"):
                read(str(path))
        assert path.read_bytes() == bad
    path.write_bytes(head)
    assert metrics.read_metrics(str(path)) == kept            # whole lines: read back as written


class _CutWrites:
    """A stand-in for builtins.open: the files it opens for writing under `folder` count the
    characters written to them, all together; once `budget` of them are written, the write in
    progress puts only its first part in the file, flushes, and calls die() (budget None: it only
    counts). What a kill after that many bytes leaves (json writes ASCII: characters are bytes)."""

    def __init__(self, folder, budget, die):
        import builtins
        self.folder, self.budget, self.die = os.path.abspath(folder) + os.sep, budget, die
        self.written, self.real_open = 0, builtins.open

    def __call__(self, file, mode="r", *args, **kwargs):
        fh = self.real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and \
                os.path.abspath(file).startswith(self.folder):
            return _CutFile(fh, self)
        return fh


class _CutFile:
    def __init__(self, fh, cut):
        self.fh, self.cut = fh, cut

    def write(self, text):
        c = self.cut
        if c.budget is not None and c.written + len(text) > c.budget:
            self.fh.write(text[:c.budget - c.written])
            self.fh.flush()
            c.die()
        c.written += len(text)
        return self.fh.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.fh.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.fh, name)


class _Killed(BaseException):
    """A kill, in-process: no `except Exception` stops it."""


def test_trim_killed_at_any_byte_of_its_rewrite_keeps_the_whole_log(tmp_path, monkeypatch):
    """trim_metrics (--resume) rewrites the log: dying after any number of bytes of the rewrite
    leaves the old log whole (an in-place rewrite would leave those bytes alone), and the next trim
    does the job."""
    import builtins

    rows = [{"step": s, "loss": s / 8, "response": "y" * 40} for s in range(6)]
    log = tmp_path / "metrics.jsonl"
    old = _jsonl_file(rows) + b'{"step": 6, "lo'                 # killed mid-step 6 the first time
    kept = _jsonl_file(rows[:4])

    def die():
        raise _Killed
    for budget in range(0, len(kept), 7):
        log.write_bytes(old)
        monkeypatch.setattr(os, "fsync", lambda fd: None)
        monkeypatch.setattr(builtins, "open", _CutWrites(tmp_path, budget, die))
        with pytest.raises(_Killed):
            metrics.trim_metrics(str(log), 3)
        monkeypatch.setattr(builtins, "open", builtins.open.real_open)
        assert log.read_bytes() == old, budget
        metrics.trim_metrics(str(log), 3)
        assert log.read_bytes() == kept and os.listdir(tmp_path) == ["metrics.jsonl"], budget


def _tagged_folder(folder, tag):
    os.makedirs(folder)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(f"{name} of {tag}")


def _whole_tag(folder):
    """The tag of a whole folder written by _tagged_folder, else None."""
    try:
        texts = {n: open(os.path.join(folder, n)).read() for n in os.listdir(folder)}
    except OSError:
        return None
    tags = {t.split(" of ")[-1] for t in texts.values()}
    if len(tags) != 1 or sorted(texts) != ["config.json", "model.safetensors", "tokenizer.json"]:
        return None
    tag = tags.pop()
    return tag if all(t == f"{n} of {tag}" for n, t in texts.items()) else None


def test_atomic_replaces_a_folder_syncs_first_and_a_kill_at_any_point_leaves_one_whole(
        tmp_path, monkeypatch):
    """atomic() over an existing folder (OUT/final, OUT/adapter) puts the new one in its place; its
    files and itself are fsynced before the rename, the parent folder after. Killed at each of its
    file-system calls in turn (no cleanup runs: every later call dies too), OUT/final or its aside
    copy is at every moment a whole folder (`loadable`), and the next save recovers and leaves
    nothing but OUT/final. A save that fails (a full disk) leaves the old folder, no temporary."""
    import shutil

    path = str(tmp_path / "final")
    with checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "first")
    synced, replaces = [], []
    real_sync, real_replace = checkpoint._fsync_file, os.replace
    monkeypatch.setattr(checkpoint, "_fsync_file",
                        lambda p: synced.append(os.path.relpath(p, tmp_path)) or real_sync(p))
    monkeypatch.setattr(os, "replace",
                        lambda a, b: replaces.append((len(synced), a, b)) or real_replace(a, b))
    with checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "second")
    monkeypatch.undo()
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    files = {f"final.tmp/{n}" for n in ("model.safetensors", "config.json", "tokenizer.json")}
    into_place = [n for n, a, _ in replaces if a.endswith("final.tmp")]
    assert set(synced[:3]) == files and synced[3] == "final.tmp" and into_place == [4]
    assert synced[4:] == ["."]                                    # then the renames themselves
    # a kill at each file-system call of the replacement in turn
    ops = ("replace", "remove", "fsync")
    real = {name: getattr(os, name) for name in ops}
    real_rmtree = shutil.rmtree
    for k in range(20):
        calls = [0]

        def dies(fn, k=k, calls=calls):
            def call(*a, **kw):
                calls[0] += 1
                if calls[0] > k:
                    raise _Killed
                return fn(*a, **kw)
            return call
        for name in ops:
            monkeypatch.setattr(os, name, dies(real[name]))
        monkeypatch.setattr(shutil, "rmtree", dies(real_rmtree))
        killed = False
        try:
            with checkpoint.atomic(path) as tmp:
                _tagged_folder(tmp, f"kill{k}")
        except _Killed:
            killed = True
        monkeypatch.undo()
        whole = _whole_tag(checkpoint.loadable(path))
        assert whole in ("second", f"kill{k}"), (k, os.listdir(tmp_path))
        with checkpoint.atomic(path) as tmp:                      # the next save
            _tagged_folder(tmp, "second")
        assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"], k
        if not killed:
            break
    assert 4 <= k < 19                                            # it was killed at every call
    # killed between the two renames: only final.old; it loads, and recover() puts it back
    os.rename(path, path + ".old")
    assert checkpoint.loadable(path) == path + ".old"
    checkpoint.recover(path)
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    # a save that fails half way: the error goes on, the old folder stays, no temporary is left
    with pytest.raises(OSError, match="No space left"), checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "full")
        raise OSError(28, "No space left on device")
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    # a file: one os.replace; a failed one leaves no temporary either
    ckpt = str(tmp_path / "checkpoint.pt")
    for text in ("one", "two"):
        with checkpoint.atomic(ckpt) as tmp, open(tmp, "w") as fh:
            fh.write(text)
    with pytest.raises(OSError), checkpoint.atomic(ckpt) as tmp, open(tmp, "w") as fh:
        fh.write("thr")
        raise OSError(28, "No space left on device")
    assert open(ckpt).read() == "two" and sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "final"]


def test_save_final_replaces_final_and_a_kill_between_its_renames_still_loads(tiny_run_inputs,
                                                                              tmp_path, capsys):
    """save_final over an earlier OUT/final: the new weights, nothing else left in OUT. Killed
    between its two renames, only OUT/final.old is there: models.load_model (--model OUT/final,
    as evaluate.py takes it) loads that one with a notice, and the next save puts things right."""
    _, tok, model = models.load_model(str(tiny_run_inputs / "model"))
    out, final = str(tmp_path), str(tmp_path / "final")
    models.save_final(out, model, tok, model.state_dict())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    models.save_final(out, model, tok, model.state_dict())
    assert os.listdir(tmp_path) == ["final"]
    os.rename(final, final + ".old")                             # the moment between the renames
    path, _, loaded = models.load_model(final)
    assert path == final + ".old" and "final.old is whole" in capsys.readouterr().err
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    models.save_final(out, model, tok, model.state_dict())
    assert os.listdir(tmp_path) == ["final"]
    assert all(torch.equal(v, trained[k]) for k, v in _weights(final).items())


def test_runlog_trims_both_logs_on_resume_and_a_fresh_run_starts_them(tmp_path, capsys):
    """--resume from step 2 after a run killed in the middle of step 5's lines: metrics.jsonl and
    completions.jsonl both keep steps <= 2 (step 2's own lines too) and go on from there, each step
    logged once. A fresh run (no --resume) in that folder starts both logs (and config.json) anew,
    and without --log-completions leaves no completions.jsonl of the run before."""
    from types import SimpleNamespace
    args = SimpleNamespace(out=str(tmp_path), report_to="none", run_name="r", log_completions=2)

    def steps(log, todo):
        for s in todo:
            log.log({"step": s, "loss": s / 4})
            log.completions(s, [{"response": f"{s}a"}, {"response": f"{s}b"}])
            if s == 2:
                log.log({"step": 2, "eval/accuracy": 0.5})

    def logged(name):
        return [(r["step"], r.get("response", "eval" if "eval/accuracy" in r else ""))
                for r in metrics.read_metrics(str(tmp_path / name))]
    log = metrics.RunLog(args, {"run": 1})
    log.log({"step": 0, "eval/accuracy": 0.25})
    steps(log, [1, 2, 3, 4])
    log.close()
    for name in ("metrics.jsonl", "completions.jsonl"):
        with open(tmp_path / name, "a") as fh:
            fh.write('{"step": 5, "lo')                          # killed mid-write
    log = metrics.RunLog(args, {"run": 1, "resume": True}, resume_step=2)
    steps(log, [3, 4, 5])
    log.close()
    assert [s for s, _ in logged("metrics.jsonl")] == [0, 1, 2, 2, 3, 4, 5]
    assert logged("completions.jsonl") == [(s, f"{s}{c}") for s in range(1, 6) for c in "ab"]
    assert capsys.readouterr().err.count("dropped its last line, cut short") == 2
    log = metrics.RunLog(args, {"run": 2})
    steps(log, [1])
    log.close()
    assert logged("metrics.jsonl") == [(1, "")]
    assert logged("completions.jsonl") == [(1, "1a"), (1, "1b")]
    assert json.loads((tmp_path / "config.json").read_text()) == {"run": 2}
    args.log_completions = 0
    metrics.RunLog(args, {"run": 3}).close()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "metrics.jsonl"]


def test_load_restores_the_global_rng_states_that_a_reward_may_draw_from(tmp_path):
    """train.py draws from no global RNG itself, but a --reward function may (ablate's
    random_reward draws from `random`): load() puts back the torch and Python RNG states that save()
    found, so a resumed run draws what the unbroken one drew after its checkpoint (the kill test
    below checks it end to end, with flip_x)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.manual_seed(1)
    random.seed(1)
    torch.rand(5), random.random()
    checkpoint.save(str(tmp_path / "c.pt"), model, opt, sched, {"step": 1})
    unbroken = torch.rand(5), random.random()
    torch.manual_seed(1)                              # a new process: train.py seeds torch again
    random.seed(2)
    checkpoint.load(str(tmp_path / "c.pt"), model, opt, sched)
    resumed = torch.rand(5), random.random()
    assert torch.equal(resumed[0], unbroken[0]) and resumed[1] == unbroken[1]


def flip_x(response: str, answer: str) -> float:
    """has_x, flipped when a coin of the global torch RNG or of `random` says so: a reward drawing
    from both global RNGs, which a resumed run reproduces only if the checkpoint restores them."""
    flip = float(torch.rand(())) < 0.15 or random.random() < 0.15
    return 1.0 - has_x(response, answer) if flip else has_x(response, answer)


# ---------------------------------------------------------------------------------------------
# perf.py: model FLOPs by hand and as torch's FLOP counter sees the code run, the peak, MFU rows
# ---------------------------------------------------------------------------------------------

def _tiny_qwen2(**kw):
    """2 layers, d_model 16, 4 query heads of 4 over 2 KV heads (GQA), MLP 24, V 50, tied."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, **kw)).eval()


def _hand_rollout() -> Rollout:
    """2 prompts of 3 and 5 tokens, G = 2, responses of 2, 4 and 1, 3 tokens padded to 4."""
    lengths = torch.tensor([2, 4, 1, 3])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()                 # [4, 4]
    return Rollout(prompts=[[5, 6, 7], [8, 9, 10, 11, 12]], G=2, pad_token_id=0,
                   response_ids=torch.where(mask > 0, 3, 0), mask=mask, lengths=lengths,
                   truncated=torch.zeros(4, dtype=torch.bool), logprobs=torch.zeros(4, 4))


def test_flops_of_a_tiny_qwen2_with_gqa_and_lora_by_hand():
    from infra import perf
    sh = perf.model_shape(_tiny_qwen2())
    # a layer's matmuls (multiply-accumulates a token): q 16x16, k and v 16x(2 KV heads x 4), o,
    # gate, up, down 16x24; the LM head is the tied embedding, 16 x 50; d_attn 4 heads x 4
    layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 3 * 16 * 24
    assert sh == perf.Shape(body=2 * layer, trained=2 * layer, adapters=0, head=16 * 50,
                            head_trained=True, layers=2, d_attn=16)
    roll = _hand_rollout()
    # Step 1: each prompt prefilled once (contexts 1..3, 1..5), then every response token but the
    # last fed at contexts p+1.. (L = 2: 4; L = 4: 4, 5, 6; L = 1: none; L = 3: 6, 7); a logit per
    # prefill and per fed token
    tokens, context, logits = 3 + 5 + 1 + 3 + 0 + 2, 6 + 15 + 4 + 15 + 0 + 13, 2 + 1 + 3 + 0 + 2
    assert perf.forward_flops(sh, perf.rollout_work(roll)) == (
        2 * 2 * layer * tokens + 4 * 2 * 16 * context + 2 * 16 * 50 * logits)
    # the training forward, one micro-batch: the prompts but their last token once (contexts 1..2,
    # 1..4), each response from that token on (contexts 3..4, 3..6, 5, 5..7); a logit per response
    # token. Split after row 0, group 0's prompt runs twice; per response, each its own prompt.
    one, split, own = [slice(0, 4)], [slice(0, 1), slice(1, 4)], [slice(0, 4)]
    assert perf.forward_work(roll, one, True) == perf.Work(2 + 4 + 2 + 4 + 1 + 3,
                                                           3 + 10 + 7 + 18 + 5 + 18, 10)
    assert perf.forward_work(roll, split, True) == perf.Work(2 + 2 + (2 + 4 + 4 + 1 + 3),
                                                             3 + 7 + (3 + 10 + 18 + 5 + 18), 10)
    assert perf.forward_work(roll, own, False) == perf.Work(4 + 6 + 5 + 7, 10 + 21 + 15 + 28, 10)
    # full fine-tuning: the backward is 2x the forward, the update 3x
    w = perf.forward_work(roll, one, True)
    assert perf.train_flops(sh, w) == 3 * perf.forward_flops(sh, w)
    # LoRA r = 2 on q and v: A [2, 16] and B [16, 2] on q, B [8, 2] on v, a layer; the base weights
    # and the tied head frozen: 2x their forward (activation gradients), the adapters and attention
    # 3x; the reference pass runs without the adapters
    pytest.importorskip("peft", reason="LoRA needs peft")
    from infra import lora
    model = _tiny_qwen2()
    lora.add_adapters(model, 2, 4.0, "q_proj,v_proj", "tiny")
    ad = 2 * (16 * 2 + 2 * 16 + 16 * 2 + 2 * 8)
    sl = perf.model_shape(model)
    assert sl == perf.Shape(2 * layer + ad, ad, ad, 16 * 50, False, 2, 16)
    assert perf.train_flops(sl, w) == (2 * (2 * layer + ad) * 16 + 2 * (2 * layer + ad) * 16
                                       + 2 * ad * 16 + 3 * 4 * 2 * 16 * 61 + 2 * 2 * 800 * 10)
    assert perf.forward_flops(sl, w, adapters=False) == perf.forward_flops(sh, w)


def test_flop_count_is_what_the_sampler_and_the_training_forward_run():
    # torch's FLOP counter on the code itself (eager attention: QK^T and AV as bmm), prompts of 143
    # tokens sharing 140 (equal lengths: no left-padding): Step 1's matmuls are exactly the count
    # (finished rows leave the batch; a decode step's rows attend exactly their own context), but
    # for the prefill, whose causal mask hides half of the p x p scores it computes
    from torch.utils.flop_counter import FlopCounterMode

    from infra import perf
    model = _tiny_qwen2(attn_implementation="eager")
    sh, p = perf.model_shape(model), len(LONG_PROMPTS[0])
    prompts = [INSTRUCTION + [5, 6, 7], INSTRUCTION + [8, 9, 10]]

    def counted(fn) -> tuple[float, float]:
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            out = fn()
        c = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
        return out, c.pop("aten.bmm"), sum(c.values())               # attention, the weights'

    roll, attn, weights = counted(lambda: sample_groups(
        model, prompts, 4, 6, 1, 0, generator=torch.Generator().manual_seed(0)))
    w = perf.rollout_work(roll)
    assert roll.lengths.unique().numel() > 1 and p == 143
    assert weights == 2 * sh.body * w.tokens + 2 * sh.head * w.logits
    assert attn == 4 * sh.layers * sh.d_attn * (w.context + 2 * (p * p - p * (p + 1) // 2))
    # the training forward on 8 responses of 5 tokens (no padding) in micro-batches of 3 and 5
    # rows: the weights' matmuls are the count plus what the code computes and drops: one logit
    # per group and micro-batch at the prompt's end (3), or per response (8) its last token and
    # one logit
    T, g = 5, torch.Generator().manual_seed(1)
    full = Rollout(prompts=prompts, G=4, pad_token_id=0,
                   response_ids=torch.randint(2, 50, (8, T), generator=g), mask=torch.ones(8, T),
                   lengths=torch.full((8,), T), truncated=torch.ones(8, dtype=torch.bool),
                   logprobs=torch.zeros(8, T))
    micro = [slice(0, 3), slice(3, 8)]
    for shared, dropped in ((True, 3 * 2 * sh.head), (False, 8 * (2 * sh.body + 2 * sh.head))):
        _, _, weights = counted(lambda shared=shared: [
            rollout_logprobs(model, full, s, 1.0, shared_prefix=shared) for s in micro])
        w = perf.forward_work(full, micro, shared)
        assert weights == 2 * sh.body * w.tokens + 2 * sh.head * w.logits + dropped, shared


def test_peak_from_the_device_name_a_cpu_probe_or_peak_tflops():
    from infra import perf
    assert [perf.peak_tflops_of(n) for n in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100 80GB PCIe", "NVIDIA A10", "NVIDIA L40S")] == [989.4, 756.5, 989.4, 312.0,
                                                                   312.0, 125.0, 362.0]
    said = []
    # an unknown GPU (A10G is not an A10): one line said, no peak, so no MFU; --peak-tflops wins
    assert perf.peak_tflops_of("NVIDIA A10G") is None
    assert perf.peak_flops("cuda", torch.bfloat16, None, "NVIDIA A10G", said.append) is None
    assert len(said) == 1 and "NVIDIA A10G" in said[0] and "--peak-tflops" in said[0]
    assert perf.peak_flops("cuda", torch.bfloat16, 2.5, "NVIDIA A10G", said.append) == 2.5e12
    assert perf.peak_flops("cuda:0", torch.bfloat16, None, "NVIDIA H100 PCIe") == 756.5e12
    t0 = time.time()
    probe = perf.peak_flops("cpu", torch.float32, None)
    assert 1e8 < probe < 1e13 and time.time() - t0 < 5 and len(said) == 1
    assert perf.peak_flops("cpu", torch.float32, 0.01) == 1e10                 # no probe
    with pytest.raises(SystemExit) as e:
        flags.parse_train_args(["--peak-tflops", "0"])
    assert e.value.code == 2
    # no FLOPs in a phase (no old or reference pass: one update, beta 0): no MFU for it
    m = perf.Meter(perf.model_shape(_tiny_qwen2()), 1e9, world=2)
    d = {"length": 30.0, "perf:rollout": 4e9, "perf:logprob": 0.0, "perf:update": 8e9}
    row = {"time/sample_s": 1.0, "time/logprob_s": 1e-4, "time/update_s": 2.0, "time/step_s": 4.0}
    assert m.metrics(d, row) == {"perf/tokens_per_s": 7.5, "perf/flops": 12e9,
                                 "perf/mfu_rollout": 2.0, "perf/mfu_update": 2.0,
                                 "perf/mfu": 1.5}


def test_a_run_logs_mfu_per_phase_and_tokens_per_s(tiny_run_inputs, tmp_path, monkeypatch,
                                                   capsys):
    # one step of train.py in this process, with an old-policy pass (--mu 2), a reference pass
    # (beta), 2 mini-batches in micro-batches of 3 rows (groups of 4 split) and --peak-tflops: the
    # row's FLOPs are the step's counts, its MFU those over the phase's seconds and that peak
    from infra import perf
    updates = _spy(monkeypatch, update, "update_policy")
    peak = 0.02e12
    row = _one_step(tiny_run_inputs, tmp_path / "run", "--peak-tflops", "0.02", "--mu", "2",
                    "--beta", "0.04", "--mini-batches", "2", "--micro-batch-size", "3")
    (_, roll, *_), stats = updates.pop()
    sh = perf.model_shape(models.load_model(str(tiny_run_inputs / "model"))[2])
    assert stats.micro == [slice(a, b) for a, b in ((0, 3), (3, 6), (6, 8), (8, 11), (11, 14),
                                                    (14, 16))]       # 2 mini-batches of 8 rows
    nograd = perf.forward_flops(sh, perf.forward_work(roll, stats.micro, True))
    flops = {"rollout": perf.forward_flops(sh, perf.rollout_work(roll)),  # one round, all kept
             "logprob": 2 * nograd,                                       # old and reference
             "update": 2 * perf.train_flops(sh, perf.forward_work(roll, stats.micro, True))}
    assert row["perf/flops"] == pytest.approx(sum(flops.values()), rel=1e-6)
    for phase, t in (("rollout", "sample"), ("logprob", "logprob"), ("update", "update")):
        assert row[f"perf/mfu_{phase}"] == pytest.approx(flops[phase] / row[f"time/{t}_s"] / peak,
                                                         rel=1e-6)
    assert 0 < row["perf/mfu"] == pytest.approx(row["perf/flops"] / row["time/step_s"] / peak)
    # tokens/s: the step's sampled response tokens (4 prompts x G 4) over the step's seconds
    assert row["perf/tokens_per_s"] * row["time/step_s"] == pytest.approx(row["len/mean"] * 16)
    assert f"mfu={100 * row['perf/mfu']:.3g}%" in capsys.readouterr().err  # the progress bar
    glossary = _read(os.path.join(os.path.dirname(__file__), "docs", "metrics.md"))
    assert all(f"`{k}`" in glossary for k in row if k.startswith("perf/"))


# ---------------------------------------------------------------------------------------------
# metrics.py, lora.py and the optional integrations: the no-signal warning, --report-to, LoRA
# ---------------------------------------------------------------------------------------------

def _signal_row(step, correct, zero_std, kept=None, truncated=0.0):
    row = {"step": step, "reward/correct": correct, "reward/frac_zero_std": zero_std,
           "len/truncated_frac": truncated}
    return row if kept is None else {**row, "sampling/groups_kept": kept, "sampling/rounds": 4.0}


def test_no_learning_signal_is_said_once_with_its_likely_causes():
    grpo_args, dapo_args = (flags.parse_train_args(["--algo", "grpo"]),
                            flags.parse_train_args(["--algo", "dapo", "--max-rounds", "4"]))
    # GRPO: every group's rewards equal (all advantages 0) at steps 1 and 2: said once; nothing
    # right in 3 steps
    check = metrics.SignalCheck(grpo_args)
    said = [check(_signal_row(s, 0.0, 1.0, truncated=1.0)) for s in (1, 2)]
    assert len(said[0]) == 1 and said[1] == [] and check.silent
    msg = said[0][0]
    assert (msg.startswith("warning: no learning signal at step 1: every group's 8 rewards are "
                           "equal") and "\n" not in msg)
    for cause in ("Answer:", "--prompt-template", "--reward verifier", "--max-new-tokens 40",
                  "len/truncated_frac 1.00"):
        assert cause in msg, cause
    third = check(_signal_row(3, 0.0, 1.0))
    assert (len(third) == 1 and "no sample of the first 3 steps scored above 0" in third[0]
            and check(_signal_row(4, 0, 1)) == [])
    # DAPO: dynamic sampling kept nothing in --max-rounds rounds; a step that kept groups trains
    # (not silent)
    check = metrics.SignalCheck(dapo_args)
    assert check(_signal_row(1, 0.25, 0.5, kept=3.0)) == [] and not check.silent
    said = check(_signal_row(2, 1.0, 1.0, kept=0.0))
    assert (len(said) == 1 and "dynamic sampling kept no group in --max-rounds 4 rounds" in said[0]
            and check.silent)
    assert "every sample is right" in said[0]
    # once a run; and some samples scored: no "none right"
    assert check(_signal_row(3, 0.5, 1.0, kept=0.0)) == []
    mixed = metrics.SignalCheck(grpo_args)(_signal_row(1, 0.5, 1.0))
    # groups all right or all wrong, half of them right
    assert len(mixed) == 1 and "--group-size" in mixed[0]


def test_none_right_in_three_steps_is_no_silent_step_when_rewards_differ():
    # GRPO + --format-weight: no answer is right (reward/correct 0) but half the groups' rewards
    # differ, so the steps train (advantages != 0). Step 3 says "none right", and is still not a
    # step that trained nothing (train.py's bar shows signal=none for those only); a step whose
    # groups are all equal is one, after it.
    check = metrics.SignalCheck(flags.parse_train_args(["--algo", "grpo", "--format-weight",
                                                        "0.5"]))
    said, silent = [], []
    for step in (1, 2, 3, 4):
        said.append(check(_signal_row(step, 0.0, 0.5)))
        silent.append(check.silent)
    assert said[:2] == [[], []] and said[3] == [] and silent == [False] * 4
    assert len(said[2]) == 1
    assert said[2][0].startswith("warning: no learning signal at step 3: no sample of the first 3")
    assert "(this step trained nothing)" not in said[2][0]
    assert check(_signal_row(5, 0.0, 1.0)) != [] and check.silent     # every group equal: silent
    assert check(_signal_row(6, 0.0, 0.5)) == [] and not check.silent  # the next step trains again


def test_report_to_wandb_logs_each_row_at_its_step(tiny_run_inputs, tmp_path, monkeypatch):
    # a stand-in wandb module records what LiveCurves calls; one step of train.py in this process:
    # wandb gets every metrics.jsonl row (eval rows too: step 1 holds two, the update's and the
    # eval's) at its step, the config once, and the run is finished
    import types
    calls = []

    class Run:
        def log(self, scalars, step=None, **kw):
            calls.append(("log", dict(scalars), step, kw))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    out = tmp_path / "run"
    _one_step(tiny_run_inputs, out, "--report-to", "wandb", "--run-name", "w")
    (_, kw), *logs, finish = calls
    assert kw == {"project": "grpo-dapo", "name": "w", "dir": str(out),
                  "config": json.loads((out / "config.json").read_text())} and finish == ("finish",)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [c[0] for c in logs] == ["log"] * len(rows) and all(c[3] == {} for c in logs)
    assert [(c[2], c[1]) for c in logs] == [(r["step"], {k: v for k, v in r.items() if k != "step"})
                                            for r in rows]
    assert [c[2] for c in logs] == [0, 1, 1]


def test_report_to_a_missing_package_is_one_line(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    import train
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as e:
        train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1", "--report-to",
                    "wandb"])
    err = capsys.readouterr().err.strip()
    assert (e.value.code == 2 and err == "error: --report-to wandb: the wandb package is not "
            "installed (pip install wandb)")


def _lora_model(d, r=4):
    """The tiny model with rank-r adapters whose B is random (peft starts B at 0: the adapters would
    be a no-op)."""
    from infra import lora
    path, tok, model = models.load_model(str(d / "model"))
    config = lora.add_adapters(model, r, 2.0 * r, lora.TARGETS, path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tok, model, config


def test_lora_trains_only_adapters_and_its_reference_is_the_base_model(tiny_run_inputs):
    pytest.importorskip("peft", reason="--lora-r needs peft")
    from infra import lora
    tok, model, _ = _lora_model(tiny_run_inputs)
    _, _, base = models.load_model(str(tiny_run_inputs / "model"))
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    # A and B of 7 projections in 2 layers
    assert len(adapters) == 2 * 7 * 2
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in builtin.sample_problems(3, 2, True)],
                         2, 8, eos, tok.pad_token_id, temperature=1.0,
                         generator=torch.Generator().manual_seed(1))
    rows = slice(0, 6)
    logp, _, mask = rollout_logprobs(model, roll, rows, 1.0)
    (logp * mask).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None
             and p.grad.abs().sum() > 0}
    # every adapter, nothing else
    assert grads == adapters
    with torch.no_grad():
        with lora.adapters_off(model):
            ref = rollout_logprobs(model, roll, rows, 1.0)[0]
        again = rollout_logprobs(model, roll, rows, 1.0)[0]
        want = rollout_logprobs(base, roll, rows, 1.0)[0]
    # the reference is the base model
    assert torch.allclose(ref, want, atol=1e-6)
    # which the adapted policy is not
    assert (logp.detach() - want).abs().max() > 1e-3
    assert (torch.equal(again, logp.detach())
            and {n for n, p in model.named_parameters() if p.requires_grad} == adapters)


def test_lora_freezes_the_base_itself_and_an_update_moves_only_the_adapters(tiny_run_inputs,
                                                                            monkeypatch):
    # peft.inject_adapter_in_model documents the injection only (peft 0.21 also freezes the rest, as
    # get_peft_model does); add_adapters freezes every base weight itself, so here peft leaves all
    # trainable. Then one update as train.py builds it (AdamW over the parameters that require grad,
    # weight decay on, beta > 0 with the adapters off as the reference; the step's 3 groups in 2
    # mini-batches): every base weight is bit-for-bit unchanged, every A and B has moved.
    import contextlib
    from types import SimpleNamespace

    from infra import lora, parallel
    peft = pytest.importorskip("peft", reason="--lora-r needs peft")
    inject = peft.inject_adapter_in_model

    def leaves_all_trainable(config, model, adapter_name="default"):
        out = inject(config, model, adapter_name=adapter_name)
        model.requires_grad_(True)
        return out
    monkeypatch.setattr(peft, "inject_adapter_in_model", leaves_all_trainable)
    tok, model, _ = _lora_model(tiny_run_inputs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = {n for n in before if ".lora_" not in n}
    assert len(base) == len(before) - 28                          # A and B of 14 projections
    assert not any(model.get_parameter(n).requires_grad for n in base)
    encode, eos = data.PromptFormatter(tok), models.end_ids(tok, model)
    prompts = [encode(r["prompt"]) for r in builtin.sample_problems(3, 2, True)]
    roll = sample_groups(model, prompts, 4, 8, eos, tok.pad_token_id, temperature=1.0,
                         generator=torch.Generator().manual_seed(1))
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    args = SimpleNamespace(micro_batch_size=5, mini_batches=2, mu=1, temperature=1.0,
                           reduction="token", loss="ppo", fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=8, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                           entropy_coef=0.0, beta=0.04, kl="k3", grad_clip=1.0)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    learner = update.Learner(model, model, model, opt, contextlib.nullcontext,
                             lambda: lora.adapters_off(model))
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(2))
    update.update_policy(learner, roll, advantages, roll.mask, args, parallel.Dist("cpu"))
    after = dict(model.named_parameters())
    assert [n for n in base if not torch.equal(after[n], before[n])] == []            # untouched
    assert [n for n in before if n not in base and torch.equal(after[n], before[n])] == []  # moved
    assert not any(after[n].requires_grad for n in base)                              # still frozen


def test_lora_merged_final_is_base_plus_adapter_and_the_adapter_loads_alone(tiny_run_inputs,
                                                                            tmp_path):
    peft = pytest.importorskip("peft", reason="--lora-r needs peft")
    from transformers import AutoModelForCausalLM

    from infra import lora
    tok, model, config = _lora_model(tiny_run_inputs)
    model.save_pretrained(tmp_path / "final", state_dict=lora.merged_state_dict(model))
    lora.save_adapter(model, config, str(tmp_path / "adapter"))
    merged, base = _weights(tmp_path / "final"), _weights(tiny_run_inputs / "model")
    sd, adapted = model.state_dict(), 0
    for k in base:
        prefix = k.removesuffix(".weight")
        # W + alpha / r * B A, by hand
        if f"{prefix}.lora_A.default.weight" in sd:
            A, B = sd[f"{prefix}.lora_A.default.weight"], sd[f"{prefix}.lora_B.default.weight"]
            assert torch.allclose(merged[k], base[k] + 2.0 * B @ A, atol=1e-6), k
            assert (merged[k] - base[k]).abs().max() > 1e-3
            adapted += 1
        else:
            assert torch.equal(merged[k], base[k]), k
    assert adapted == 14
    ids = torch.tensor([tok("2x+4=10\n")["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")(input_ids=ids).logits
        alone = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_run_inputs / "model"),
            tmp_path / "adapter")(input_ids=ids).logits
    assert torch.allclose(plain, want, atol=1e-5) and torch.allclose(alone, want, atol=1e-5)


def test_lora_flags_fail_with_one_line(tiny_run_inputs, tmp_path, capsys, monkeypatch):
    import importlib.util

    import train
    run = [*_tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1"]
    for extra, message in ((["--lora-r", "4", "--fsdp"], "--lora-r with --fsdp is not supported"),
                           (["--lora-r", "4", "--rollout", "vllm"],
                            "--lora-r with --rollout vllm is not supported"),
                           (["--lora-r", "-1"], "--lora-r must be >= 0"),
                           (["--lora-r", "4", "--lora-target-modules", "wq,wk"],
                            "--lora-target-modules wq,wk: ")):
        if "wq,wk" in extra and importlib.util.find_spec("peft") is None:  # the others need no peft
            continue
        with pytest.raises(SystemExit) as e:
            train.main([*run, *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(SystemExit) as e:
        train.main([*run, "--lora-r", "4"])
    assert (capsys.readouterr().err.strip()
            == "error: --lora-r: the peft package is not installed (pip install peft)")
    assert (flags.parse_train_args(["--lora-r", "8"]).lora_alpha == 16
            and flags.parse_train_args(["--lora-r", "8"]).lr == 2e-3)
