"""Tests: hand-sized numeric cases, equivalence checks, and short end-to-end runs.

The first section follows the article step by step (GRPO's Steps 1-4 on its G = 4 example, then DAPO's
Eq. 10-13), each case worked by hand; then shared helpers, then one section per module in the order
grpo, variants, dapo, update, logprobs, sampler, verifier, builtin, data, evaluate, train, checkpoint and
parallel, curves/lora/integrations, bench, ablate, vllm_rollout, and the GPU-only tests.

    python -m pytest -q test_grpo.py
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
import warnings

import pytest
import torch

import builtin
import curves
import dapo
import data
import grpo
import logprobs
import update
import variants
import verifier
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups
from verifier import canonical, canonical_answer, extract_answer, format_reward, parse_number, verify

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# The article, step by step: its GRPO walk-through (Steps 1-4 on one prompt, G = 4: rewards [1, 1, 1, 0],
# advantages [0.5, 0.5, 0.5, -1.5]) carried into the loss update.py runs, then DAPO's four fixes (Eq. 10-13),
# each worked by hand. The module sections below test the same functions in depth.
# ---------------------------------------------------------------------------------------------

# -- Step 1: Rollout (sampler.sample_groups): G responses per prompt, masks from lengths, old log-probs --
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_masks_lengths_truncation_and_logprobs(tiny_model, temperature):
    G, T = 4, 20
    roll = sample_groups(tiny_model, PROMPTS, G, T, eos_token_id=1, pad_token_id=0, temperature=temperature,
                         generator=torch.Generator().manual_seed(3))
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
    # Step 2 on the article's prompt "2x + 5 = 13" (answer 4): o_1..o_3 reach x = 4 (boxed, bare, in words),
    # o_4 adds 5 instead of subtracting it (x = 9). verify gives 1 or 0 per response: rewards [1, 1, 1, 0],
    # the [B, G] = [1, 4] tensor Step 3 normalises (test_article_example_advantages)
    responses = ["2x = 13 - 5 = 8, so x = 8 / 2 = \\boxed{4}", "x = 4",
                 "Subtract 5: 2x = 8. Divide by 2: x = 4. The answer is 4.", "2x = 13 + 5 = 18, x = \\boxed{9}"]
    rewards = torch.tensor([[verify(o, "4") for o in responses]])              # [1, 4]
    assert rewards.tolist() == [[1.0, 1.0, 1.0, 0.0]]


# -- Step 3: Advantage (grpo.group_advantages): the group z-score --
def test_article_example_advantages():
    # The article's Step 3: rewards [1, 1, 1, 0]; mean 0.75, Bessel std sqrt(0.75 / 3) = 0.5,
    # so (1 - 0.75) / 0.5 = 0.5 and (0 - 0.75) / 0.5 = -1.5.
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5, -1.5]]), atol=1e-5)


# -- Step 4: PPO loss (grpo.policy_loss): the clipped surrogate + beta * KL, as update.update_policy runs it --
def _two_token_case(adv: float):
    # one response of two tokens with ratios 1.5 and 0.5; the weights of the sequence mean, 1/2 each
    logp, mask = torch.log(torch.tensor([[1.5, 0.5]])), torch.ones(1, 2)
    return logp, torch.zeros(1, 2), torch.tensor([adv]), mask, grpo.token_weights(mask)


def test_policy_loss_clipping_by_hand():
    # A = +1: -min(1.5, 1.2) = -1.2 and -min(0.5, 0.8) = -0.5 -> mean -0.85; token 1 clipped high.
    loss, m = grpo.ppo_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() + 0.85) < 1e-6
    assert m["clip/high_frac"] == 0.5 and m["clip/low_frac"] == 0.0 and abs(m["ratio/mean"] - 1.0) < 1e-6
    # A = -1: -min(-1.5, -1.2) = 1.5 and -min(-0.5, -0.8) = 0.8 -> mean 1.15; token 2 clipped low.
    loss, m = grpo.ppo_loss(*_two_token_case(-1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() - 1.15) < 1e-6
    assert m["clip/low_frac"] == 0.5 and m["clip/high_frac"] == 0.0
    # Clip-higher: eps_high 0.6 lets ratio 1.5 through: -(1.5 + 0.5) / 2 = -1.0, nothing clipped.
    loss, m = grpo.ppo_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.6)
    assert abs(loss.item() + 1.0) < 1e-6 and m["clip/high_frac"] == 0.0


def test_kl_k3_hand_value_zero_at_equality_and_nonnegative():
    # logp = log 0.5, ref = log 0.25: delta = log 0.5, k3 = 0.5 - log 0.5 - 1 = 0.19315
    assert abs(grpo.kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() - 0.193147) < 1e-5
    x = torch.randn(1000)
    assert torch.equal(grpo.kl_k3(x, x), torch.zeros(1000))
    assert (grpo.kl_k3(x, torch.randn(1000) * 3) >= 0).all()


class _GivenLogprobs(torch.nn.Module):
    """A stand-in policy whose log-probs of the rollout's tokens [N, T] are its parameter (see the fake
    rollout_logprobs below), so update_policy's loss and gradient can be worked out by hand."""

    def __init__(self, logp):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())


@pytest.mark.parametrize("reduction", ["sequence", "token"])
def test_update_policy_loss_is_surrogate_plus_beta_kl_by_hand(reduction, monkeypatch):
    # The article's G = 4 group (Step 3: advantages [0.5, 0.5, 0.5, -1.5]) with lengths 3, 2, 3, 1 (9 tokens),
    # through update.update_policy's first update (ratio 1: old = current) in micro-batches of 3 and 1 rows.
    # Probabilities of the sampled tokens under pi_theta and pi_ref, chosen so that r = pi_ref / pi is 1, 1/2
    # or 2: k3 = r - log r - 1 is 0, log 2 - 1/2 or 1 - log 2. Padding holds garbage (p = 1 vs 0.01).
    import contextlib
    from types import SimpleNamespace

    import parallel
    pi = torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.8, 1.0], [0.9, 0.6, 0.3], [0.25, 1.0, 1.0]])
    pi_ref = torch.tensor([[0.5, 0.25, 0.5], [0.25, 0.4, 0.01], [0.9, 0.6, 0.3], [0.5, 0.01, 0.01]])
    lengths = torch.tensor([3, 2, 3, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).float()                 # [4, 3]
    A = torch.tensor([0.5, 0.5, 0.5, -1.5])                                   # [4]
    r = pi_ref / pi                                                           # [4, 3]
    beta = 0.04
    # by hand: at ratio 1 the surrogate is -A on each token; k3 sums to 1/2, 2 log 2 - 1, 0, 1 - log 2 per row
    if reduction == "sequence":   # GRPO: mean over the 4 responses of each one's token mean
        surrogate = -(0.5 + 0.5 + 0.5 - 1.5) / 4                             # = 0: a group's advantages sum to 0
        kl = (0.5 / 3 + (2 * math.log(2) - 1) / 2 + 0 + (1 - math.log(2))) / 4  # = (1/6 + 1/2) / 4 = 1/6
        w = mask / lengths[:, None] / 4                                       # [4, 3] each token's weight
    else:                         # DAPO: the sum over the 9 tokens / 9
        surrogate = -(0.5 * 3 + 0.5 * 2 + 0.5 * 3 - 1.5 * 1) / 9
        kl = (0.5 + (2 * math.log(2) - 1) + 0 + (1 - math.log(2))) / 9
        w = mask / 9
    # d/d logp of -ratio * A is -A; of k3(logp, ref) = e^(ref - logp) - (ref - logp) - 1 it is 1 - r
    grad = w * (-A[:, None] + beta * (1 - r))                                 # [4, 3]

    def given_logprobs(model, roll, rows, temperature, with_entropy=False, shared_prefix=True, buckets=True):
        logp = model.logp[rows]                                               # [n, 3]
        return logp, torch.zeros_like(logp) if with_entropy else None, roll.mask[rows]

    monkeypatch.setattr(update, "rollout_logprobs", given_logprobs)
    policy, ref = _GivenLogprobs(pi.log()), _GivenLogprobs(pi_ref.log()).requires_grad_(False)
    roll = Rollout(prompts=[[5]], G=4, pad_token_id=0, response_ids=torch.zeros(4, 3, dtype=torch.long), mask=mask,
                   lengths=lengths, truncated=torch.zeros(4, dtype=torch.bool), logprobs=pi.log(),
                   index=torch.zeros(4, dtype=torch.long))
    args = SimpleNamespace(micro_batch_size=3, mini_batches=1, mu=1, temperature=1.0, reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=3, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0, entropy_coef=0.0,
                           beta=beta, kl="k3", grad_clip=0.0, lr=1.0)
    learner = update.Learner(policy, policy, ref, torch.optim.SGD(policy.parameters(), lr=1.0), contextlib.nullcontext)
    stats = update.update_policy(learner, roll, A, mask, args, parallel.Dist("cpu"))
    assert stats.first["loss"] == pytest.approx(surrogate + beta * kl, abs=1e-6)
    assert stats.first["kl"] == pytest.approx(0.5 + math.log(2), abs=1e-5)   # the k3 sum over the 9 tokens
    assert stats.first["tokens"] == 9 and stats.first["updates"] == 1
    # one SGD step of lr 1: the parameter moved by minus the gradient worked out above (padding: not at all)
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
        logp = torch.log(torch.tensor([[1.1], [1.25], [1.25], [0.75]])).requires_grad_()  # [4, 1], old = 0
        loss, m = grpo.ppo_loss(logp, torch.zeros(4, 1), A, mask, grpo.token_weights(mask), eps_low=0.2,
                                eps_high=eps_high)
        loss.backward()
        assert loss.item() == pytest.approx(want, abs=1e-6)
        assert torch.allclose(logp.grad[:, 0], torch.tensor(grads), atol=1e-6)
        assert m["clip/high_frac"] == high_frac and m["clip/low_frac"] == 0.25


# -- DAPO Eq. 11: Dynamic Sampling (dapo.keep_groups: 0 < #correct < G) --
def test_keep_groups_boundaries():
    # Eq. 11 on correctness: 0 < #correct < G
    c = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert dapo.keep_groups(c).tolist() == [False, False, True, True]


# -- DAPO Eq. 12: Token-Level Loss (grpo.token_weights(mask, "token")); carried through the G = 4 loss above --
def test_token_weights_by_hand():
    # lengths 1, 3 and an overlong-filtered (empty) row, T = 3
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    seq = torch.tensor([[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6], [0, 0, 0]])    # 1 / (|o_i| * 2 responses)
    assert torch.allclose(grpo.token_weights(mask), seq)
    assert torch.allclose(grpo.token_weights(mask, "token"), mask / 4)       # 4 valid tokens
    assert torch.allclose(grpo.token_weights(mask, "constant", max_len=5), mask / 10)  # 2 responses x 5
    # the step's global counts win over the micro-batch's own: 8 tokens, 4 responses
    assert torch.allclose(grpo.token_weights(mask, "token", num_tokens=torch.tensor(8.0)), mask / 8)
    assert torch.allclose(grpo.token_weights(mask, "sequence", num_seqs=4), seq / 2)
    assert torch.equal(grpo.token_weights(torch.zeros(2, 3), "token"), torch.zeros(2, 3))  # nothing valid: 0


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


# ---------------------------------------------------------------------------------------------
# Shared helpers: tiny models, the tiny run's inputs, and running train.py in a subprocess or under torchrun
# ---------------------------------------------------------------------------------------------

def _fake_rollout(rewards: list[list[float]], start: int = 0) -> Rollout:
    B, G = len(rewards), len(rewards[0])
    N = B * G
    return Rollout(prompts=[[start + i] for i in range(B)], G=G, pad_token_id=0,
                   response_ids=torch.ones(N, 2, dtype=torch.long), mask=torch.ones(N, 2),
                   lengths=torch.full((N,), 2), truncated=torch.zeros(N, dtype=torch.bool),
                   logprobs=torch.zeros(N, 2), correct=torch.tensor(rewards).view(-1))


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]]
# prompts at a real run's shape: a shared 140-token instruction (longer than a 128-token KV block), then
# each prompt's own 3, 6 and 1 tokens, so the prompts still differ in length and are left-padded
INSTRUCTION = [int(t) for t in torch.randint(2, 40, (140,), generator=torch.Generator().manual_seed(4))]
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
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=32, intermediate_size=64, num_layers=2), len(tok))
    model.save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    for name, rows in (("train.jsonl", builtin.sample_problems(64, 1, False)), ("eval.jsonl", builtin.sample_problems(8, 2, True))):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a random model never answers right: this reward (through --reward) gives its groups mixed rewards
    (d / "tinyreward.py").write_text("def has_x(response, answer):\n    return float('x' in response)\n")
    return d


def has_x(response: str, answer: str) -> float:
    """A reward a random model earns sometimes (it never answers right): the tiny runs' groups are mixed."""
    return float("x" in response)


def _tiny_flags(d, out):
    """train.py flags for a short CPU run of the tiny model on the tiny data (flags given after these win)."""
    return ["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--eval-data", str(d / "eval.jsonl"),
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--lr", "1e-2",
            "--reward", "test_grpo:has_x", "--out", str(out), "--device", "cpu"]


def _run_train(d, out, *extra):
    flags = _tiny_flags(d, out)
    if "--reward" in extra:  # --reward repeats to sum several rewards: the caller's replaces the default one
        del flags[flags.index("--reward"):flags.index("--reward") + 2]
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *flags, "--steps", "2", "--eval-every", "1", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE,
                         env={**os.environ, "PYTHONPATH": str(d)})
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _torchrun(nproc, script, *flags):
    """`script flags` under torchrun on nproc CPU ranks (gloo); fails the test unless every rank exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HERE,  # a rank that aborts prints its stack
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    assert res.returncode == 0, res.stderr[-3000:]


def _weights(folder):
    from transformers import AutoModelForCausalLM
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _one_step(d, out, *extra):
    import train
    train.main([*_tiny_flags(d, out), "--steps", "1", "--eval-every", "5", "--grad-clip", "0", "--algo", "dapo",
                "--no-dynamic-sampling", *extra])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][-1]


# ---------------------------------------------------------------------------------------------
# grpo.py: advantages, reductions as per-token weights, KL, the clipped surrogate
# ---------------------------------------------------------------------------------------------

def test_advantages_scales_and_constant_groups():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.3, 0.3]])
    # group: [1, 0] has mean 0.5 and Bessel std sqrt(0.5); constant groups are exactly zero, not NaN.
    g = grpo.group_advantages(r, "group")
    assert torch.allclose(g[0], torch.tensor([0.5, -0.5]) / math.sqrt(0.5), atol=1e-5)
    assert torch.equal(g[1:], torch.zeros(2, 2))
    # none (Dr. GRPO): only centred.
    assert torch.allclose(grpo.group_advantages(r, "none")[0], torch.tensor([0.5, -0.5]))
    # batch: centred per group, divided by the std of all six rewards.
    b = grpo.group_advantages(r, "batch")
    assert torch.allclose(b[0], torch.tensor([0.5, -0.5]) / (r.std() + 1e-6), atol=1e-5)
    # batch_std (what train.py computes over all ranks) replaces this share's own std
    assert torch.allclose(grpo.group_advantages(r, "batch", batch_std=2.0)[0], torch.tensor([0.25, -0.25]), atol=1e-5)
    # a float leftover must not be blown up: rewards equal up to representation stay zero
    assert torch.equal(grpo.group_advantages(torch.full((1, 4), 0.1 + 0.2)), torch.zeros(1, 4))
    # G = 3 with a constant 0.9: the float32 mean is off by an ulp, which / (std + eps) gives 0.056, not 0
    assert torch.equal(grpo.group_advantages(torch.full((2, 3), 0.9)), torch.zeros(2, 3))
    with pytest.raises(ValueError):
        grpo.group_advantages(r, "bogus")
    # a rank that dynamic sampling left without a group: [0, G], quietly (no torch std warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(grpo.group_advantages(torch.zeros(0, 4), s).shape == (0, 4) for s in ("group", "batch", "none"))


def test_advantages_keep_their_sign_when_the_std_is_below_eps():
    # rewards 0 and 1e-7: std 7.1e-8 < eps = 1e-6, so std + eps is eps-sized and the advantages are small, with
    # the sign of r - mean (std - eps would be negative and flip them: the better answer pushed down)
    r = torch.tensor([[0.0, 1e-7], [1.0, 0.0]])
    for scale, kw in (("group", {}), ("batch", {"batch_std": 5e-7})):
        adv = grpo.group_advantages(r, scale, **kw)
        assert adv[0, 0] < 0 < adv[0, 1] and adv[0].abs().max() < 0.1, (scale, adv)
        assert adv[1, 0] > 0 > adv[1, 1]


def test_policy_loss_kl_term_and_ratio_one_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    loss, m = grpo.policy_loss(logp, logp.detach(), torch.tensor([0.0]), mask, grpo.token_weights(mask),
                               ref_logp=ref, beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1  # first token; the second is 0
    assert abs(loss.item() - 0.1 * k3 / 2) < 1e-6 and abs(m["kl"] - k3 / 2) < 1e-6
    # with mu = 1 (old = current) the surrogate's value is -A but its gradient is the policy gradient A * grad logp
    logp2 = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss2, _ = grpo.policy_loss(logp2, logp2.detach(), torch.tensor([2.0]), mask, grpo.token_weights(mask))
    loss2.backward()
    assert abs(loss2.item() + 2.0) < 1e-6 and torch.allclose(logp2.grad, torch.tensor([[-1.0, -1.0]]))


def test_reductions_differ_on_unequal_lengths():
    # Two responses with advantages +1 and -1 at ratio 1: per-token losses -1 (1 token) and +1 (3 tokens).
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    ppo = lambda lp, old, a, m, **kw: grpo.ppo_loss(lp, old, a, m, grpo.token_weights(m, **kw))  # noqa: E731
    seq, _ = ppo(logp, logp, adv, mask, reduction="sequence")
    tok, _ = ppo(logp, logp, adv, mask, reduction="token")
    const, _ = ppo(logp, logp, adv, mask, reduction="constant", max_len=5)
    assert abs(seq.item() - 0.0) < 1e-6            # (-1/1 + 3/3) / 2: each response weighs the same
    assert abs(tok.item() - 0.5) < 1e-6            # (-1 + 3) / 4 valid tokens: each token weighs the same
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
    # and a global response count: halves that do not cancel (a reduction ignoring num_seqs doubles them)
    adv2 = torch.tensor([1.0, 0.5])
    for reduction, whole in (("sequence", -0.75), ("constant", -(1 + 1.5) / (2 * 5))):
        full, _ = ppo(logp, logp, adv2, mask, reduction=reduction, max_len=5)
        halves = [ppo(logp[i:i + 1], logp[i:i + 1], adv2[i:i + 1], mask[i:i + 1], reduction=reduction,
                      num_seqs=2, max_len=5)[0] for i in range(2)]
        assert abs(full.item() - whole) < 1e-6 and abs(sum(h.item() for h in halves) - whole) < 1e-6


def test_filtered_responses_leave_the_denominators():
    # overlong filtering zeroes a truncated response's mask row: it is out of the loss, and out of N too
    # (as in verl; TRL keeps counting it, which shrinks the loss of every other response)
    logp, adv = torch.zeros(2, 2), torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for reduction, want in (("sequence", -1.0), ("token", -1.0), ("constant", -1.0)):
        loss, _ = grpo.ppo_loss(logp, logp, adv, mask, grpo.token_weights(mask, reduction, max_len=2))
        assert abs(loss.item() - want) < 1e-6, reduction


def test_policy_loss_guards_log_ratio_and_dual_clip():
    # a log-ratio of 100 (a stale old log-prob) would give exp(100) = inf and a NaN gradient: clamped to 20
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    w = grpo.token_weights(torch.ones(1, 2))
    loss, m = grpo.ppo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), w, eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    # dual-clip, A = -1: ratio 5 gives a PPO loss of 5, capped at clip_c * |A| = 3, with no gradient there;
    # ratio 2 (loss 2 < 3) is left alone
    logp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_()
    loss, m = grpo.ppo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), w, clip_c=3.0)
    loss.backward()
    assert abs(loss.item() - (3.0 + 2.0) / 2) < 1e-5 and m["clip/dual_frac"] == 0.5
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0
    # positive advantages are never dual-clipped
    loss, m = grpo.ppo_loss(logp.detach(), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), w, clip_c=3.0)
    assert m["clip/dual_frac"] == 0.0 and abs(loss.item() + 1.2) < 1e-5
    with pytest.raises(ValueError):
        grpo.ppo_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), w, clip_c=0.5)


def test_kl_metric_counts_valid_tokens_only():
    logp, mask = torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, 9.0, 9.0]])                  # garbage after the response's end
    _, m = grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, grpo.token_weights(mask), ref_logp=ref, beta=0.1)
    assert abs(m["kl"] - (math.exp(-0.5) + 0.5 - 1)) < 1e-6


def _reduce_by_hand(per_token, mask, reduction="sequence", num_tokens=None, max_len=None, num_seqs=None):
    """The three reductions written out (the reference for token_weights): "sequence" = the sum of each
    response's token mean / num_seqs (default: the non-empty rows), "token" = the masked sum / num_tokens
    (default: mask.sum()), "constant" = the masked sum / (num_seqs * max_len) (default max_len: T)."""
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
# verl cannot be imported here (it pulls ray, omegaconf, ...); the same inputs were also checked once
# against the real functions (see the README section "Other objectives").
# ---------------------------------------------------------------------------------------------

def _verl_agg(loss_mat, mask, mode, num_tokens=None, num_seqs=None):
    """verl agg_loss: "token-mean" = masked sum / global tokens; "seq-mean-token-mean" = the mean over
    non-empty responses of each one's token mean (token count + 1e-8), summed and / global responses."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / (mask.sum() if num_tokens is None else num_tokens)
    per_row = mask.sum(-1)
    row_mean = (loss_mat * mask).sum(-1) / (per_row + 1e-8)
    return (row_mean * (per_row > 0)).sum() / ((per_row > 0).sum() if num_seqs is None else num_seqs)


def _verl_gspo(old_logp, logp, adv_tok, mask, clip_low, clip_high, mode, rollout_is_weights=None):
    """verl compute_policy_loss_gspo: token ratio with value s_i = exp(masked mean of logp - old) and the
    gradient of logp (log-space: sg(log s_i) + logp - sg(logp), capped at 10), PPO's max of the two losses."""
    log_s = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_tok = torch.clamp(log_s.detach()[:, None] + logp - logp.detach(), max=10.0)
    s = log_tok.exp()
    loss_mat = torch.maximum(-adv_tok * s, -adv_tok * s.clamp(1 - clip_low, 1 + clip_high))
    return _verl_agg(loss_mat * (1 if rollout_is_weights is None else rollout_is_weights), mask, mode)


def _verl_cispo(old_logp, logp, adv_tok, mask, clip_low, clip_high, mode, rollout_is_weights=None):
    """verl compute_policy_loss_cispo: -sg(clamp(exp(clamp(logp - old, -20, 20)), 1 - low, 1 + high)) * A * logp;
    rollout_is_weights (verl's rollout correction, e.g. truncated IS) multiply each token's loss."""
    w = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0)).clamp(1 - clip_low, 1 + clip_high).detach()
    return _verl_agg(-w * adv_tok * logp * (1 if rollout_is_weights is None else rollout_is_weights), mask, mode)


def _verl_kl(logp, ref_logp, name):
    """verl kl_penalty for "k1", "mse" (k2) and "low_var_kl" (k3) without its two clamps."""
    if name == "k1":
        return logp - ref_logp
    if name == "mse":
        return (logp - ref_logp).square() / 2
    r = torch.exp(ref_logp - logp)  # pi_ref / pi_theta
    return r - torch.log(r) - 1


def _random_policy_batch(seed, spread, N=6, T=7):
    """logp [N, T] (requires grad), old logp, advantages [N], mask from lengths 1..T (no empty row)."""
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


@pytest.mark.parametrize("name,mine", [("k1", grpo.kl_k1), ("mse", grpo.kl_k2), ("low_var_kl", grpo.kl_k3)])
def test_kl_estimators_equal_verl_kl_penalty(name, mine):
    logp, _, _, _ = _random_policy_batch(0, 1.0)
    ref = torch.randn_like(logp) - 2.0
    got, g_got = _value_and_grad(lambda: mine(logp, ref).sum(), logp)
    want, g_want = _value_and_grad(lambda: _verl_kl(logp, ref, name).sum(), logp)
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(g_got, g_want, atol=1e-12)
    # by hand: pi = 0.5, pi_ref = 0.25: k1 = log 2, k2 = (log 2)^2 / 2, k3 = 0.5 - log 0.5 - 1 = log 2 - 0.5
    a, b = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    hand = {"k1": math.log(2), "mse": math.log(2) ** 2 / 2, "low_var_kl": math.log(2) - 0.5}[name]
    assert abs(mine(a, b).item() - hand) < 1e-6


def test_kl_estimators_expected_gradients_on_policy():
    # Exact expectations over a 5-token vocabulary: E_{x ~ pi}[grad k(x)] with pi's weights detached.
    # k2's equals grad KL(pi || ref) (Liu et al., arXiv 2510.01555), k1's is 0, and k3's is the gradient
    # of the reverse KL(ref || pi), hence biased for KL(pi || ref).
    theta, ref = torch.randn(5, dtype=torch.float64, requires_grad=True), torch.log_softmax(torch.randn(5).double(), 0)

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
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                      mode), logp)
    for fn in (variants.gspo_loss, variants.gspo_token_loss):
        got, g_got = _value_and_grad(lambda: fn(logp, old, adv, mask, wt, eps_low, eps_high)[0], logp)  # noqa: B023
        assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    # per-token advantages: only the token form takes them
    adv_tok = torch.randn_like(mask)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high, mode), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, wt, eps_low,
                                                                 eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    with pytest.raises(ValueError):
        variants.gspo_loss(logp, old, adv_tok, mask, wt)
    # truncated IS weights multiply each token's loss, as verl's rollout_is_weights do
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high, mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, wt * w, eps_low,
                                                                 eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    want = _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high, mode, w)
    assert torch.allclose(variants.gspo_loss(logp, old, adv, mask, wt * w, eps_low, eps_high)[0], want)
    m = variants.gspo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode", [("sequence", "seq-mean-token-mean"), ("token", "token-mean")])
def test_gspo_equals_verl_gspo_values_and_gradients(reduction, mode):
    # bounds wider than the paper's 3e-4 / 4e-4 so that these batches have clipped and unclipped rows
    clipped = [_check_gspo_against_verl(seed, reduction, mode, 0.02, 0.03) for seed in range(4)]
    assert 0 < sum(clipped) < len(clipped)  # both kinds of rows were exercised
    _check_gspo_against_verl(0, reduction, mode, variants.GSPO_EPS_LOW, variants.GSPO_EPS_HIGH)


def test_gspo_on_policy_gradient_equals_gspo_token_and_the_sequence_policy_gradient():
    # mu = 1: old = current, s_i = 1, nothing clipped (even with the paper's 3e-4 / 4e-4). The gradient of
    # each token is -A_i / |y_i| / N: the sequence-mean policy gradient, as GSPO-token with A_i on each token.
    logp, _, adv, mask = _random_policy_batch(3, 0.0)
    old = logp.detach().clone()
    wt = grpo.token_weights(mask)                                             # [N, T], sequence mean
    loss, g_seq = _value_and_grad(lambda: variants.gspo_loss(logp, old, adv, mask, wt)[0], logp)
    _, g_tok = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv[:, None].expand_as(mask), mask, wt)[0],
                               logp)
    assert torch.allclose(g_seq, g_tok, atol=1e-12)
    want = -adv[:, None] / mask.sum(-1, keepdim=True) / mask.shape[0] * mask
    assert torch.allclose(g_seq, want, atol=1e-12) and abs(loss.item() + adv.mean().item()) < 1e-12


def _check_cispo_against_verl(seed, reduction, mode, eps_low, eps_high):
    logp, old, adv, mask = _random_policy_batch(seed, 0.4)
    wt = grpo.token_weights(mask, reduction)                                  # [N, T]
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                       mode), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                       mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, wt * w, eps_low, eps_high)[0],
                                 logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    m = variants.cispo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode", [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_cispo_equals_verl_cispo_values_and_gradients(reduction, mode):
    clipped = [_check_cispo_against_verl(seed, reduction, mode, 0.2, 0.28) for seed in range(3)]
    assert 0 < sum(clipped) < len(clipped)
    _check_cispo_against_verl(3, reduction, mode, variants.CISPO_EPS_LOW, variants.CISPO_EPS_HIGH)
    # a clipped token keeps its gradient: ratio e^1 > 1.28, gradient -1.28 * A (here A = 1, one token)
    one = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, m = variants.cispo_loss(one, torch.full((1, 1), -1.0, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                                  torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert abs(one.grad.item() + 1.28) < 1e-12 and m["clip/high_frac"] == 1.0


def test_token_weights_reduce_as_the_formulas_and_kl_term_splits_off():
    # (per_token * token_weights).sum() is each reduction's formula; policy_loss(beta) is the beta = 0 loss
    # plus beta * kl_term(k3), the article's one reduction of surrogate + beta * KL per token
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
        assert torch.allclose(with_kl, base + 0.04 * kl, atol=1e-12) and abs(m["kl"] - mk["kl"]) < 1e-9
        want = _reduce_by_hand(per_token + 0.04 * grpo.kl_k3(logp, ref), mask, **kw)
        assert torch.allclose(with_kl, want, atol=1e-12)
        k2, mk2 = grpo.kl_term(logp, ref, mask, w, grpo.kl_k2)  # another estimator: same "kl" metric (k3)
        assert torch.allclose(k2, _reduce_by_hand(grpo.kl_k2(logp, ref), mask, **kw)) and mk2 == mk
    with pytest.raises(ValueError):
        grpo.token_weights(mask, "mean")


@pytest.mark.parametrize("name,fn", [
    ("gspo", lambda lp, old, adv, mask, w: variants.gspo_loss(lp, old, adv, mask, w, 0.02, 0.03)[0]),
    ("gspo-token", lambda lp, old, adv, mask, w: variants.gspo_token_loss(lp, old, adv, mask, w, 0.02, 0.03)[0]),
    ("cispo", lambda lp, old, adv, mask, w: variants.cispo_loss(lp, old, adv, mask, w, 0.2, 0.28)[0]),
    ("kl-k2", lambda lp, old, adv, mask, w: grpo.kl_term(lp, old, mask, w, grpo.kl_k2)[0]),
    ("tis", lambda lp, old, adv, mask, w: variants.cispo_loss(
        lp, old, adv, mask, w * variants.tis_weights(old, old + 0.3 * torch.sin(old * 7), mask, 1.2))[0]),
])
@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_variant_losses_add_up_over_micro_batches(name, fn, reduction):
    # two micro-batches with the step's global denominators give the full batch's loss and gradient
    logp, old, adv, mask = _random_policy_batch(5, 0.05)
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=9, num_seqs=6)
    full, g_full = _value_and_grad(lambda: fn(logp, old, adv, mask, grpo.token_weights(mask, **kw)), logp)
    parts, g_parts = _value_and_grad(lambda: sum(fn(logp[s], old[s], adv[s], mask[s], grpo.token_weights(mask[s], **kw))
                                                 for s in (slice(0, 2), slice(2, 6))), logp)
    assert torch.allclose(full, parts, atol=1e-12) and torch.allclose(g_full, g_parts, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_entropy_bonus_gradient_equals_autograd_of_the_naive_entropy(reduction):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 5, 11)).requires_grad_(True)  # token_entropy works in float32
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 4])[:, None]).float()
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=6, num_seqs=4)
    got = variants.entropy_bonus(variants.token_entropy(logits, 0.7), mask, grpo.token_weights(mask, **kw))[0]
    (g_got,) = torch.autograd.grad(got, logits)
    x = logits / 0.7
    naive = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)  # [N, T]
    want = _reduce_by_hand(naive, mask, **kw)
    (g_want,) = torch.autograd.grad(want, logits)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(g_got, g_want, atol=1e-6)
    # micro-batches with global denominators add up, as the losses do
    parts = sum(variants.entropy_bonus(variants.token_entropy(logits[s], 0.7), mask[s],
                                       grpo.token_weights(mask[s], **kw))[0] for s in (slice(0, 1), slice(1, 4)))
    assert torch.allclose(parts, want, atol=1e-5)


def test_tis_weights_are_one_when_sampler_agrees_and_capped():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.equal(variants.tis_weights(old, old.detach(), mask, 2.0), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # pi_old / pi_sampler = 10 -> capped at 2; 1.5 -> kept; 0.25 -> kept (truncation is from above only)
    sampler = old.detach() - torch.tensor([[math.log(10.0), math.log(1.5), math.log(0.25), 5.0]])
    w = variants.tis_weights(old, sampler, mask, 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.5, 0.25, 0.0]])) and not w.requires_grad
    with pytest.raises(ValueError):
        variants.tis_weights(old, sampler, mask, 0.0)


def test_mismatch_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.0, -2.5, -2.0], [-1.2, float("-inf"), 0.0]])  # padding may hold anything
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    m = variants.mismatch_metrics(old, sampler, mask)
    # |delta| = 0, 0.5, 1.0, 0.2 over 4 valid tokens; k3(sampler, old) = e^d - d - 1 with d = old - sampler
    k3 = sum(math.exp(d) - d - 1 for d in (0.0, 0.5, -1.0, 0.2)) / 4
    assert abs(m["mismatch/logp_abs_mean"] - 1.7 / 4) < 1e-6 and abs(m["mismatch/logp_abs_max"] - 1.0) < 1e-6
    assert abs(m["mismatch/kl"] - k3) < 1e-6
    assert variants.mismatch_metrics(old, old, mask) == {"mismatch/logp_abs_mean": 0.0, "mismatch/logp_abs_max": 0.0,
                                                          "mismatch/kl": 0.0}


def test_loss_flags_choose_functions_and_the_papers_clip_ranges():
    import train
    assert set(update.LOSSES) == {"ppo", "gspo", "gspo-token", "cispo"} and set(update.KL_ESTIMATORS) == {"k1", "k2", "k3"}
    a = train.parse_args(["--loss", "gspo"])
    assert (a.eps_low, a.eps_high, a.kl, a.entropy_coef, a.tis_cap) == (3e-4, 4e-4, "k3", 0.0, 0.0)
    a = train.parse_args(["--loss", "cispo", "--algo", "grpo", "--eps-high", "0.28"])  # a flag given wins
    assert (a.eps_low, a.eps_high, a.reduction) == (1.0, 0.28, "sequence")
    a = train.parse_args(["--algo", "dapo"])
    assert (a.loss, a.eps_low, a.eps_high) == ("ppo", 0.2, 0.28)


def test_policy_loss_weights_multiply_the_surrogate_not_the_kl():
    logp, old, adv, mask = _random_policy_batch(6, 0.3)
    ref, w = torch.randn_like(old) - 2.0, torch.rand_like(old)
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * w
    got, _ = grpo.policy_loss(logp, old, adv, mask, grpo.token_weights(mask, "token"), ref_logp=ref, beta=0.1,
                              is_weights=w)
    want = _reduce_by_hand(per_token + 0.1 * grpo.kl_k3(logp, ref), mask, "token")
    assert torch.allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# dapo.py: dynamic sampling over ranks, mini-batches of whole groups, DAPO with its fixes off is GRPO
# ---------------------------------------------------------------------------------------------

def test_dynamic_sampling_fills_then_stops_and_is_world_size_invariant():
    rounds = [[[1, 0], [1, 1], [0, 1], [0, 0]], [[1, 0], [1, 0], [0, 0], [0, 1]]]  # informative: 2, then 3
    draw = lambda r: (_fake_rollout(rounds[r], start=10 * r), {"round": r})  # noqa: E731
    roll, st, drawn = dapo.dynamic_sampling(draw, target=4, max_rounds=4)
    # the first two informative groups of round 0, then the first two of round 1
    assert [p[0] for p in roll.prompts] == [0, 2, 10, 11] and st["sampling/rounds"] == 2
    # every round drawn comes back whole (all 4 groups, kept or not), with what draw returned beside it
    assert [(r.num_groups, r.prompts[0][0], info) for r, info in drawn] == [(4, 0, {"round": 0}), (4, 10, {"round": 1})]
    assert st["sampling/groups_drawn"] == 8 and st["sampling/batch_full"] == 1.0
    # round limit: trains on what it has
    roll, st, drawn = dapo.dynamic_sampling(draw, target=40, max_rounds=2)
    assert roll.num_groups == 5 and st["sampling/batch_full"] == 0.0 and len(drawn) == 2
    # two ranks, each drawing half of each round's prompts: together they keep the same groups
    kept = []
    halves = {(r, k): _fake_rollout(rounds[r][2 * k:2 * k + 2], start=10 * r + 2 * k) for r in range(2) for k in range(2)}
    for k in range(2):
        state = {"round": 0}

        def draw_k(r, k=k, state=state):
            state["round"] = r
            return halves[(r, k)], {}

        def gather_k(_mine, state=state):  # what all_gather would return: both ranks' flags, in rank order
            return [dapo.keep_groups(halves[(state["round"], j)].correct.view(-1, 2)) for j in range(2)]
        roll_k, _, _ = dapo.dynamic_sampling(draw_k, target=4, max_rounds=4, gather=gather_k, rank=k)
        kept += [p[0] for p in roll_k.prompts]                   # a rank that keeps nothing: Rollout.empty
    assert sorted(kept) == [0, 2, 10, 11]


class _StubRanks:
    """What minibatch_rows needs of Dist for rank `rank` of len(idx) ranks, each holding groups idx[r]."""

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

    # dynamic sampling's kept groups: rank 0 holds prompts 0, 2, 9 and rank 1 holds 4, 5, 12 (two rounds)
    one = groups([[0, 2, 4, 5, 9, 12]], 3)
    assert one == [[0, 2], [4, 5], [9, 12]]             # thirds of the global prompt order
    assert groups([[0, 2, 9], [4, 5, 12]], 3) == one    # not each rank's own thirds
    assert groups([[0, 2, 9], [4, 5, 12]], 1) == [[0, 2, 4, 5, 9, 12]]
    assert groups([[0], [4]], 4) == [[0], [4]]          # fewer groups than mini-batches: no empty updates
    assert groups([[], [4, 5]], 2) == [[4], [5]]        # a rank that kept nothing still takes part
    assert update.minibatch_rows(Rollout.empty(G, 0), 2, _StubRanks([[], []], 0)) == []


def test_dapo_with_fixes_off_is_grpo():
    """DAPO with all four fixes off resolves to exactly GRPO's settings (see also the end-to-end check)."""
    import train
    off = ["--eps-high", "0.2", "--reduction", "sequence", "--no-dynamic-sampling", "--no-overlong-filter",
           "--no-overlong-penalty", "--beta", "0.04", "--wrong-reward", "0"]
    a = train.parse_args(["--algo", "dapo", *off])
    b = train.parse_args(["--algo", "grpo"])
    assert {**vars(a), "algo": None} == {**vars(b), "algo": None}
    # and the loss pieces: no truncation -> the filter changes nothing; token == sequence on equal lengths
    logp, adv, mask = torch.randn(4, 3), torch.randn(4), torch.ones(4, 3)
    assert torch.equal(dapo.overlong_filter(mask, torch.zeros(4, dtype=torch.bool)), mask)
    s = grpo.policy_loss(logp, logp.detach(), adv, mask, grpo.token_weights(mask, "sequence"))[0]
    t = grpo.policy_loss(logp, logp.detach(), adv, mask, grpo.token_weights(mask, "token"))[0]
    assert torch.allclose(s, t)


# ---------------------------------------------------------------------------------------------
# update.py: update_policy against a hand-rolled full-batch loss
# ---------------------------------------------------------------------------------------------

def _hand_rolled_update(model, ref, roll, advantages, mask, args):
    """What update_policy must equal: per mini-batch (the k-th K-th of the groups), one loss over all its rows at
    once (per_response_logprobs, token_weights of the mini-batch's own rows), one backward, clip the whole gradient, one
    SGD step; old log-probs of the sampling policy, computed once before the first update. Returns the losses."""
    from functools import partial

    from logprobs import per_response_logprobs
    N, G = roll.response_ids.shape[0], roll.G
    every = slice(0, N)
    with torch.no_grad():
        old = per_response_logprobs(model, roll, every, args.temperature)[0]                    # [N, T]
        ref_logp = per_response_logprobs(ref, roll, every, args.temperature)[0] if ref is not None else None
    groups, losses = N // G, []
    bounds = [-(-k * groups // args.mini_batches) * G for k in range(args.mini_batches + 1)]  # p * K // B == k
    for _ in range(args.mu):
        for a, b in zip(bounds, bounds[1:]):
            s = slice(a, b)
            model.zero_grad(set_to_none=True)
            logp = per_response_logprobs(model, roll, s, args.temperature)[0]                   # [n, T]
            w = grpo.token_weights(mask[s], args.reduction, max_len=args.max_new_tokens)      # [n, T]
            ppo = partial(grpo.ppo_loss, eps_low=args.eps_low, eps_high=args.eps_high)
            loss, _ = grpo.policy_loss(logp, old[s], advantages[s], mask[s], w, ppo,
                                       ref_logp=None if ref is None else ref_logp[s], beta=args.beta)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
            with torch.no_grad():
                for p in model.parameters():
                    p -= args.lr * p.grad
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reduction,grad_clip,beta,max_new_tokens", [
    ("token", 0.0, 0.0, 20),       # overlong-filtered mask: the global token count is the filtered one's
    ("constant", 0.0, 0.0, 32),    # Dr. GRPO divides by --max-new-tokens, not by the rollout's width (20)
    ("sequence", 0.05, 0.04, 20),  # the clip acts on the whole mini-batch's gradient; the KL term to a reference
])
def test_update_policy_equals_a_hand_rolled_full_batch_update(tiny_model, reduction, grad_clip, beta, max_new_tokens):
    # 3 groups of 4 in 2 mini-batches (groups 0-1, then group 2), micro-batches of 3 rows that cut groups, mu 1
    # (DAPO's recipe): the second update is off-policy, so the ratio leaves 1 and the clip bounds act
    import contextlib
    import copy
    from types import SimpleNamespace

    import parallel
    t = 0.7
    roll = _mixed_rollout(tiny_model, t)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)  # each response's prompt
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(1))
    mask = dapo.overlong_filter(roll.mask, roll.truncated)
    args = SimpleNamespace(micro_batch_size=3, mini_batches=2, mu=1, temperature=t, reduction=reduction, loss="ppo",
                           fsdp=False, gradient_checkpointing=False,
                           max_new_tokens=max_new_tokens, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                           entropy_coef=0.0, beta=beta, kl="k3", grad_clip=grad_clip, lr=2.0)
    mine, hand = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    refs = [copy.deepcopy(tiny_model).requires_grad_(False) if beta else None for _ in range(2)]
    learner = update.Learner(mine, mine, refs[0], torch.optim.SGD(mine.parameters(), lr=args.lr), contextlib.nullcontext)
    stats = update.update_policy(learner, roll, advantages, mask, args, parallel.Dist("cpu"))
    first, rest = stats.first, stats.rest
    losses = _hand_rolled_update(hand, refs[1], roll, advantages, mask, args)
    assert first["updates"] + rest["updates"] == 2 and rest["ratio/mean"] != rest["tokens"]    # the ratio left 1
    assert first["loss"] == pytest.approx(losses[0], abs=1e-5) and rest["loss"] == pytest.approx(losses[1], abs=1e-5)
    moved = max((p - q).abs().max().item() for p, q in zip(hand.parameters(), tiny_model.parameters()))
    diff = max((p - q).abs().max().item() for p, q in zip(mine.parameters(), hand.parameters()))
    assert moved > 1e-2 and diff <= 1e-5 * max(1.0, moved), (moved, diff)


class _AloneAs:
    """A Dist for update_policy that says it is one of `world` ranks; each collective sees only itself."""
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
    (True, False, 1, (False, True), (False, True)),     # FSDP2 all-gathers in every forward: per response
    (False, True, 1, (True, True), (False, True)),      # checkpointed layers drop the cache with gradients
    (False, False, 2, (True, False), (True, False))])   # DDP syncs in each forward: one bucket per slice
def test_update_policy_tells_the_training_forward_its_mode(tiny_model, monkeypatch, fsdp, checkpointing, world,
                                                           nograd, grad):
    """rollout_logprobs does not inspect the model: update_policy passes (shared_prefix, buckets), for the
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
    args = SimpleNamespace(micro_batch_size=4, mini_batches=1, mu=2, temperature=1.0, reduction="token", loss="ppo",
                           fsdp=fsdp, gradient_checkpointing=checkpointing, max_new_tokens=20, eps_low=0.2,
                           eps_high=0.28, clip_c=0.0, tis_cap=0.0, entropy_coef=0.0, beta=0.0, kl="k3", grad_clip=1.0)
    model = copy.deepcopy(tiny_model)
    learner = update.Learner(model, model, None, torch.optim.SGD(model.parameters(), lr=0.0), contextlib.nullcontext)
    update.update_policy(learner, roll, torch.randn(N), roll.mask, args, _AloneAs(world))
    assert seen == {(False, *nograd), (True, *grad)}


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
    # two equally likely tokens, the rest ~0: entropy log 2, while the NLL of a sampled token is log 2 too,
    # but with probabilities [0.9, 0.1] the entropy is 0.325 and a sampled token's NLL is 0.105 or 2.303.
    logits = torch.log(torch.tensor([[[0.9, 0.1]]]))
    assert abs(logprobs.token_entropy(logits).item() - (-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))) < 1e-5


def test_entropy_is_finite_with_masked_logits():
    # a -inf logit (a masked vocabulary entry) has p = 0 and p log p = 0, not 0 * -inf = NaN
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    h = logprobs.token_entropy(logits)
    h.sum().backward()
    assert abs(h.item() - math.log(2)) < 1e-6 and torch.isfinite(logits.grad).all()


def _naive_logprobs(logits, ids, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_in_blocks_equals_the_naive_form(dtype, monkeypatch):
    # V = 50,000 in blocks of 3 rows; the logits are a slice like `.logits[:, :-1]` (not contiguous), so each
    # response's 5 rows make a block of 3 and one of 2. Values and gradients equal log_softmax + gather's.
    torch.manual_seed(0)
    V = 50_000
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 3 * V)
    full = (torch.randn(2, 6, V) * 3).to(dtype).requires_grad_(True)
    logits, ids = full[:, :-1], torch.randint(0, V, (2, 5))
    for t in (1.0, 0.7):
        got, want = logprobs.token_logprobs(logits, ids, temperature=t), _naive_logprobs(logits, ids, t)
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4)
        (g_got,), (g_want,) = torch.autograd.grad(got.sum(), full), torch.autograd.grad(want.sum(), full)
        assert g_got.dtype == dtype
        assert torch.allclose(g_got.float(), g_want.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    ent = logprobs.token_entropy(logits, temperature=0.7)
    logp = torch.log_softmax(logits.float() / 0.7, -1)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_allocates_one_block_forward_and_one_gradient_backward(dtype, monkeypatch):
    # Every storage an aten op returns is recorded: the forward's largest is one float32 block (2 rows x V),
    # never [N, T, V]; in the backward the only vocabulary-sized one is the gradient itself.
    from torch.utils._python_dispatch import TorchDispatchMode
    V = 1000
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 2 * V)
    logits = torch.randn(3, 4, V).to(dtype).requires_grad_(True)
    ids = torch.randint(0, V, (3, 4))

    class Storages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = {}  # data pointer -> bytes, for every storage an op returns other than the logits'

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
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
    assert torch.allclose(logits.grad.float(), torch.autograd.grad(_naive_logprobs(logits, ids).sum(), logits)[0].float(),
                          atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_token_entropy_gradient_equals_autograd_of_the_naive_form(monkeypatch):
    # blocks of 3 rows over a non-contiguous slice, temperature 0.7: the custom backward
    # dH/dx_v = -s p_v (log p_v + H) equals autograd through log_softmax, exp, sum.
    torch.manual_seed(0)
    V = 300
    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK", 3 * V)
    for dtype, atol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        full = (torch.randn(2, 6, V) * 3).to(dtype).requires_grad_(True)
        logits, w = full[:, :-1], torch.randn(2, 5)                   # w: an arbitrary upstream gradient
        got = logprobs.token_entropy(logits, temperature=0.7)
        logp = torch.log_softmax(logits.float() / 0.7, -1)
        want = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(got, want, atol=1e-4)
        (g_got,), (g_want,) = torch.autograd.grad((got * w).sum(), full), torch.autograd.grad((want * w).sum(), full)
        assert g_got.dtype == dtype and torch.allclose(g_got.float(), g_want.float(), atol=atol)
        with torch.no_grad():                                         # and without autograd, as the no-grad passes call it
            assert torch.allclose(logprobs.token_entropy(logits, 0.7), want, atol=1e-4)


def _tiny_gpt2():
    """A tiny GPT-2: absolute position embeddings, so position ids that ignore the left padding change its
    log-probs (RoPE models, the others here, see only the distance between positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=256, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None)).eval()


def _mixed_rollout(model, temperature, G=4, T=20, prompts=PROMPTS):
    """PROMPTS (3, 6 and 1 tokens; LONG_PROMPTS: 143, 146, 141) x G samples, some ending in EOS and some
    truncated."""
    roll = sample_groups(model, prompts, G, T, eos_token_id=1, pad_token_id=0, temperature=temperature,
                         generator=torch.Generator().manual_seed(3))
    assert len(set(roll.lengths.tolist())) > 2 and roll.truncated.any() and (~roll.truncated).any()
    return roll


def _micro_batches(N, mb):
    return [slice(k, min(k + mb, N)) for k in range(0, N, mb)]


@pytest.mark.parametrize("kind,keep,prompts", [("llama", 0.8, PROMPTS), ("llama", 1.0, PROMPTS), ("mistral", 1.0, PROMPTS),
                                                ("gpt2", 1.0, PROMPTS), ("llama", 0.8, LONG_PROMPTS),
                                                ("mistral", 1.0, LONG_PROMPTS), ("gpt2", 1.0, LONG_PROMPTS)],
                         ids=["llama", "llama-buckets", "mistral", "gpt2", "llama-long", "mistral-long", "gpt2-long"])
def test_shared_prefix_forward_equals_per_response(tiny_model, kind, keep, prompts, monkeypatch):
    # mistral: sliding-window layers (window 5) in the cache; keep 1.0: every slice with two response lengths
    # is split into two length buckets (0.8, the default, keeps these slices whole); gpt2: absolute positions;
    # -long: prompts of 141-146 tokens sharing a 140-token prefix
    from functools import partial

    from logprobs import per_response_logprobs, rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = {"llama": lambda: tiny_model, "mistral": lambda: _tiny("mistral", torch.float32), "gpt2": _tiny_gpt2}[kind]()
    t, G = 0.7, 4
    roll = _mixed_rollout(model, t, G, prompts=prompts)
    N, T_all = roll.response_ids.shape
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(N, generator=g)
    old = roll.logprobs + 0.1 * torch.randn(N, T_all, generator=g)   # ratio != 1, so clipping acts on some tokens
    ref = roll.logprobs + 0.1 * torch.randn(N, T_all, generator=g)
    params = list(model.parameters())
    # micro-batches of 5 and 3 responses cut groups of 4; N = 12 whole; values, entropies, mask
    for mb in (5, 3, N):
        for s in _micro_batches(N, mb):
            with torch.no_grad():
                (a, ea, ma), (b, eb, mb_) = (f(model, roll, s, t, with_entropy=True)
                                             for f in (rollout_logprobs, per_response_logprobs))
            assert a.shape == b.shape == (s.stop - s.start, T_all) and torch.equal(ma, mb_)
            assert (a * ma).sub(b * ma).abs().max() <= 1e-4 and (ea * ma).sub(eb * ma).abs().max() <= 1e-4
    # gradients of the loss summed over micro-batches of 5, for every reduction, with an entropy bonus
    for reduction in ("sequence", "token", "constant"):
        grads = []
        for f in (rollout_logprobs, per_response_logprobs):
            model.zero_grad(set_to_none=True)
            for s in _micro_batches(N, 5):
                logp, ent, mask = f(model, roll, s, t, with_entropy=True)
                w = grpo.token_weights(mask, reduction, roll.mask.sum(), T_all, N)   # [n, T]
                ppo = partial(grpo.ppo_loss, eps_low=0.2, eps_high=0.28)
                loss, _ = grpo.policy_loss(logp, old[s], adv[s], mask, w, ppo, ref_logp=ref[s], beta=0.04)
                (loss - 0.01 * (ent * mask).sum() / roll.mask.sum()).backward()
            grads.append(torch.cat([p.grad.flatten() for p in params]))
        assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[1].abs().max(), reduction
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind,temperature,keep,prompts", [
    ("llama", 1.0, 0.8, PROMPTS), ("llama", 0.7, 0.8, PROMPTS), ("llama", 0.7, 1.0, PROMPTS), ("gpt2", 0.7, 1.0, PROMPTS),
    ("llama", 0.7, 0.8, LONG_PROMPTS), ("gpt2", 0.7, 1.0, LONG_PROMPTS)],
    ids=["llama-t1", "llama", "llama-buckets", "gpt2", "llama-long", "gpt2-long"])
def test_training_logprobs_equal_the_samplers(tiny_model, kind, temperature, keep, prompts, monkeypatch):
    # the tokens' log-probs under the training forward are the ones the sampler drew them with: an
    # off-by-one position, position ids that ignore the left padding (gpt2: absolute positions), or a dropped
    # temperature all break this
    from logprobs import rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = tiny_model if kind == "llama" else _tiny_gpt2()
    roll = _mixed_rollout(model, temperature, prompts=prompts)
    N = roll.response_ids.shape[0]
    for mb in (N, 5):
        with torch.no_grad():
            logp = torch.cat([rollout_logprobs(model, roll, s, temperature)[0] for s in _micro_batches(N, mb)])
        assert ((logp - roll.logprobs) * roll.mask).abs().max() <= 1e-4


def test_length_buckets_split_only_when_it_pays():
    # lengths 40, 20, 38, 18, 40, 19 in one batch: 6 x 40 = 240 positions; short rows {18, 19, 20} and long rows
    # {38, 40, 40} padded apart: 3 x 20 + 3 x 40 = 180 = 0.75 of it (<= 0.8: split). 40, 38, 39, 37: one batch.
    short, long = logprobs._length_buckets(torch.tensor([40, 20, 38, 18, 40, 19]))
    assert sorted(short.tolist()) == [1, 3, 5] and sorted(long.tolist()) == [0, 2, 4]
    assert [b.tolist() for b in logprobs._length_buckets(torch.tensor([40, 38, 39, 37]))] == [[0, 1, 2, 3]]
    assert [b.tolist() for b in logprobs._length_buckets(torch.tensor([7]))] == [[0]]


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
    # probabilities [0.5, 0.3, 0.2, 0]: running mass [0.5, 0.8, 1, 1]; u picks the first token whose running
    # mass exceeds u * (kept mass). The token without mass is never drawn, even at u -> 1. top_p 0.6 keeps
    # {0, 1} (mass 0.8: token 2 has 0.8 >= 0.6 ahead of it); top_p -> 0 keeps the top token only.
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    cases = [(0.0, 1.0, 0), (0.49, 1.0, 0), (0.51, 1.0, 1), (0.81, 1.0, 2), (1 - 2 ** -24, 1.0, 2),
             (0.4, 0.6, 0), (0.7, 0.6, 1), (0.99, 0.6, 1), (0.99, 1e-9, 0)]
    for dtype in (torch.float32, torch.bfloat16):
        for u, top_p, want in cases:
            tok, lp = sample_token(p.log().to(dtype)[None].clone(), torch.tensor([u]), 1.0, top_p)
            assert tok.item() == want, (dtype, u, top_p)
            assert abs(lp.exp().item() - p[want].item()) < (1e-6 if dtype == torch.float32 else 1e-2)
    # temperature 0.5 squares the probabilities: [0.25, 0.09, 0.04] / 0.38, and the log-prob is the tempered one
    tok, lp = sample_token(p.log()[None].clone(), torch.tensor([0.7]), 0.5, 1.0)
    assert tok.item() == 1 and abs(lp.exp().item() - 0.09 / 0.38) < 1e-6


@pytest.mark.parametrize("block", [4, 7, 64])
def test_sample_token_two_level_walk_equals_one_running_sum(block, monkeypatch):
    import sampler
    monkeypatch.setattr(sampler, "SAMPLE_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    n, V = 400, 50                                                  # 50 is no multiple of 4, 7 or 64
    logits = 3 * torch.randn(n, V, generator=g)
    logits[:, 8:16] = float("-inf")                                 # whole blocks without mass
    logits[:, -3:] = float("-inf")                                  # and a tail without mass
    u = torch.rand(n, generator=g)
    u[:8] = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 0.25, 0.75, 1e-9, 0.999999, 0.1])
    p = torch.softmax(logits.double() / 0.7, -1)                    # [n, V] the tempered distribution
    want = torch.searchsorted(p.cumsum(-1), u.double()[:, None] * p.sum(-1, keepdim=True), side="right").squeeze(-1)
    want = want.clamp_max(V - 4)                                    # u -> 1 ends on the last token with mass
    work = sampler.sample_workspace(n, V)
    assert work.shape == (n, -(-V // block) * block)
    tok, lp = sampler.sample_token(logits.clone(), u, 0.7, 1.0, work)
    assert torch.equal(tok, want)
    assert torch.allclose(lp.double(), p.gather(-1, tok[:, None]).squeeze(-1).log(), atol=1e-5)
    assert work[:, V:].abs().sum() == 0                             # the padding stays zero for the next step
    tok2, _ = sampler.sample_token(logits.clone(), u, 0.7, 1.0)     # without a work buffer: the same draws
    assert torch.equal(tok2, tok)


def _tiny(kind, dtype):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if kind == "qwen2":  # GQA, q/k/v biases, tied embeddings: the preallocated cache
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common)).eval().to(dtype)
    return MistralForCausalLM(MistralConfig(sliding_window=5, **common)).eval().to(dtype)  # sliding-window layers


@pytest.mark.parametrize("kind,dtype,prompts", [
    ("qwen2", torch.float32, PROMPTS), ("qwen2", torch.bfloat16, PROMPTS), ("mistral", torch.float32, PROMPTS),
    ("qwen2", torch.float32, LONG_PROMPTS), ("mistral", torch.float32, LONG_PROMPTS)],
    ids=["qwen2", "qwen2-bf16", "mistral", "qwen2-long", "mistral-long"])
def test_sampler_greedy_groups_equal_generate_alone_with_rows_finishing_early(kind, dtype, prompts):
    # -long: prompts of 141-146 tokens sharing a 140-token prefix (past a KV block, and the window of 5)
    import sampler
    model, G, T = _tiny(kind, dtype), 3, 24
    layers = {type(layer).__name__ for layer in sampler._make_cache(model, 8)[0].layers}
    assert layers == {"_BufferedLayer"} and sampler._make_cache(model, 8)[1] == (None if kind == "qwen2" else 5)
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
    ends = [int(free.response_ids[0, 3]), int(free.response_ids[1, 6])]  # each prompt meets a different one first
    roll = sample_groups(model, PROMPTS, 2, T, eos_token_id=ends, pad_token_id=0, temperature=0.0)
    assert roll.lengths[0] <= 4 and not roll.truncated[0]
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), max_new_tokens=T, do_sample=False, eos_token_id=ends,
                             pad_token_id=0)[0, len(p):].tolist()
        for r in (2 * i, 2 * i + 1):
            L = int(roll.lengths[r])
            assert roll.response_ids[r, :L].tolist() == ref[:L] and (L == T or ref[L - 1] in ends)
    # train.py stops on the tokenizer's EOS and on the end ids the generation config adds (data.end_ids)
    tok = SimpleNamespace(eos_token_id=5)
    assert data.end_ids(tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 5]))) == [5, 7]
    assert data.end_ids(tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))) == [5]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_sampler_top_p_logprobs_match_a_full_forward(dtype, atol):
    model, G = _tiny("qwen2", dtype), 4
    roll = sample_groups(model, PROMPTS, G, 16, 1, 0, temperature=0.8, top_p=0.9,
                         generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    for i in range(len(PROMPTS) * G):
        L = int(roll.lengths[i])
        with torch.no_grad():
            want = _full_forward_logprobs(model, PROMPTS[i // G], roll.response_ids[i, :L].tolist(), 0.8)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=atol)


def test_sampler_greedy_equals_generate(tiny_model):
    roll = sample_groups(tiny_model, PROMPTS, 1, 12, eos_token_id=1, pad_token_id=0, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        ref = tiny_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0)
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
    roll = sample_groups(tiny_model, PROMPTS, 2, 6, 1, 0, top_p=1e-9, generator=torch.Generator().manual_seed(0))
    greedy = sample_groups(tiny_model, PROMPTS, 1, 6, 1, 0, temperature=0.0)
    for i in range(len(PROMPTS)):
        assert torch.equal(roll.response_ids[2 * i], greedy.response_ids[i, :roll.response_ids.shape[1]])


def _tiny_gpt2_sampler():
    """Absolute learned positions: a position counted from the wrong origin changes the logits (RoPE hides a
    constant offset within a row)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(2)
    cfg = GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


MIXED_PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4], [13, 14, 15, 16, 17], [18, 19]]


def _tiny_mistral_wide():
    """Sliding-window layers whose window (32) covers P + T here: continuous batching, the window by the mask."""
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(1)
    return MistralForCausalLM(MistralConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                            pad_token_id=0, eos_token_id=1, bos_token_id=None, sliding_window=32)).eval()


@pytest.mark.parametrize("kind,G", [("llama", 3), ("qwen2", 3), ("mistral", 3), ("mistral-wide", 3), ("gpt2", 3), ("gpt2", 1)])
def test_sampler_max_num_seqs_gives_the_same_rollout(tiny_model, kind, G, monkeypatch):
    import sampler
    model = {"llama": lambda: tiny_model, "gpt2": _tiny_gpt2_sampler, "mistral-wide": _tiny_mistral_wide}.get(
        kind, lambda: _tiny(kind, torch.float32))()
    ends, T = [1, 2, 3, 20], 20                # several end ids: lengths roughly geometric, some rows truncated
    made, make = [], sampler._make_cache
    monkeypatch.setattr(sampler, "_make_cache", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    gens = lambda: [torch.Generator().manual_seed(40 + i) for i in range(len(MIXED_PROMPTS))]  # noqa: E731
    run = lambda n, **k: sample_groups(model, MIXED_PROMPTS, G, T, ends, 0, 0.9, generator=gens(), max_num_seqs=n, **k)  # noqa: E731
    full = run(None)
    assert full.truncated.any() and (~full.truncated).any() and len(set(full.lengths.tolist())) > 3
    P, N = max(map(len, MIXED_PROMPTS)), len(MIXED_PROMPTS) * G
    sizes = [1, 3, 4] if G == 1 else [3, 7, 11]     # 7 slots for groups of 3: one slot idle, groups enter whole
    # (mistral's window 5 < P + T: static batches whatever `continuous` says, see sample_groups)
    for n, continuous in [(sizes[0], False), (sizes[2], True), (sizes[0], True), (sizes[1], True)]:  # mistral: static
        made.clear()
        roll = run(n, continuous=continuous)
        assert made[0][0].layers[0].kbuf.shape[0] == min(n, N) and made[0][0].layers[0].kbuf.shape[2] == P + T
        assert torch.equal(roll.response_ids, full.response_ids) and torch.equal(roll.lengths, full.lengths)
        assert torch.equal(roll.truncated, full.truncated)
        assert torch.allclose(roll.logprobs, full.logprobs, atol=1e-5)
    for i in range(N):                         # and the rows are right: the log-probs of a plain full forward
        L = int(roll.lengths[i])
        with torch.no_grad():
            want = _full_forward_logprobs(model, MIXED_PROMPTS[i // G], roll.response_ids[i, :L].tolist(), 0.9)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=1e-4)
    if G > 1:
        with pytest.raises(ValueError, match="max_num_seqs=2 < G=3"):
            run(2)


def test_num_seqs_within_is_the_kv_formula_of_the_buffers_allocated(monkeypatch):
    import sampler
    made, make = [], sampler._make_cache
    monkeypatch.setattr(sampler, "_make_cache", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    for model, per_pos in ((_tiny("qwen2", torch.float32), 2 * 2 * 8 * 2 * 4), (_tiny_gpt2_sampler(), 2 * 4 * 8 * 2 * 4)):
        # layers x KV heads x head_dim x 2 (K, V) x 4 bytes: Qwen2 2 x 2 x 8, GPT-2 2 x 4 (all heads) x 8
        per_row = per_pos * (6 + 20)                         # the longest of MIXED_PROMPTS, 6, + T = 20
        assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 10.5 * per_row / 2**30) == 9   # a multiple of G
        assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 1e-9) == 3                     # at least G
        with torch.autocast("cpu", torch.bfloat16):          # bf16 keys: half the bytes, twice the rows
            assert sampler.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 10.5 * per_row / 2**30) == 21
        made.clear()
        sample_groups(model, MIXED_PROMPTS, 3, 20, 1, 0, generator=torch.Generator().manual_seed(0), max_num_seqs=9)
        layers = made[0][0].layers
        assert sum(la.kbuf.nbytes + la.vbuf.nbytes for la in layers) == 9 * per_row   # what was allocated


def test_max_num_seqs_flags_are_checked(capsys):
    import evaluate
    import train
    assert train.parse_args(["--max-num-seqs", "8"]).max_num_seqs == 8 and train.parse_args([]).kv_cache_gb == 8.0
    for parse, bad in ((train.parse_args, ["--max-num-seqs", "4"]), (train.parse_args, ["--kv-cache-gb", "0"]),
                       (evaluate.main, ["--eval-samples", "4", "--max-num-seqs", "2"])):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: --") and len(err.strip().splitlines()) == 1, err


def test_draw_round_and_evaluation_sample_with_max_num_seqs(tiny_run_inputs, monkeypatch):

    import evaluate
    import sampler
    import train
    seen = []

    def recording(*a, max_num_seqs=None, **k):
        seen.append(max_num_seqs)
        return sample_groups(*a, max_num_seqs=max_num_seqs, **k)
    monkeypatch.setattr(evaluate, "sample_groups", recording)  # train.draw_round samples through evaluate's too
    model = _tiny("qwen2", torch.float32)
    task = train.Task(rows=[{"prompt": "p", "answer": "1"}] * 4, encode=lambda s: [5, 6, 7], decode=lambda r, i: "",
                      reward_fn=data.as_reward(lambda t, a: 0.0), eos=[1], pad=0)
    one = type("One", (), {"rank": 0, "world": 1})()
    for flags, want in (([], sampler.num_seqs_within(model, [[5, 6, 7]], 8, 40, 8.0)), (["--max-num-seqs", "16"], 16)):
        args = train.parse_args(["--prompts-per-step", "4", *flags])
        train.draw_round(model, task, args, one, 0)
        assert seen.pop() == want
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p", "0.9")
    _, r1 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    args.max_num_seqs = 5                      # one problem's 4 samples at a time: the same samples
    _, r2 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), _has_9)
    prompts = [data.PromptFormatter(tok)(r["prompt"]) for r in rows]
    assert r1 == r2 and seen[-1] == 5 and seen[0] == sampler.num_seqs_within(model, prompts, 4, 10, 8.0) >= 48


def test_sampler_under_bf16_autocast_gives_the_same_rollout_for_every_n(tiny_model):
    # under CPU autocast a decode step's keys may come out in another dtype than the prefill's: the write into
    # the slots' buffer takes the buffer's dtype (an indexed write does not cast), as train.py --bf16 samples
    with torch.autocast("cpu", torch.bfloat16):
        rolls = [sample_groups(tiny_model, PROMPTS, 2, 12, eos_token_id=1, pad_token_id=0, temperature=0.0,
                               max_num_seqs=n) for n in (2, None)]
    assert torch.equal(rolls[0].response_ids, rolls[1].response_ids) and torch.equal(rolls[0].lengths, rolls[1].lengths)


def test_rollout_select_and_cat():
    r = _fake_rollout([[1, 0], [0, 0], [1, 1]])
    s = r.select_groups(torch.tensor([True, False, True]))
    assert s.prompts == [[0], [2]] and s.response_ids.shape[0] == 4
    c = Rollout.cat([s, r])
    assert c.num_groups == 5 and c.correct.shape == (10,) and c.rewards is None
    # a longer rollout pads the shorter one's rows: never a valid mask position, never a log-prob
    long = _fake_rollout([[1, 0]])
    long.response_ids, long.mask, long.logprobs = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), -torch.ones(2, 5)
    c = Rollout.cat([r, long])
    assert c.mask.shape == (8, 5) and c.mask[:6, 2:].sum() == 0 and c.logprobs[:6, 2:].abs().sum() == 0
    assert (c.response_ids[:6, 2:] == r.pad_token_id).all() and c.mask[6:].sum() == 10


# ---------------------------------------------------------------------------------------------
# verifier.py: one case per rule (the id names the rule), safety and time, agreement with hand labels
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
    R("The roots are $\\boxed{2}$ and $\\boxed{-3}$.", "-3, 2", 1.0, id="adjacent-boxes-are-one-answer"),
    R("$\\boxed{5}$ or $\\boxed{6}$", "6", 0.0, id="hedging-boxes-are-not-credited"),
    R("\\boxed{34}\n" + "Let me check this once more. " * 4000, "34", 1.0, id="boxed-before-a-100k-self-check"),
    R("The total is 1,234.\n#### 1,234", "1234", 1.0, id="hashes-gsm8k"),
    R("#### 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0, id="reference-read-the-same-way"),
    R("#### 72\n\nQuestion: next?\nAnswer: 3", "72", 1.0, id="hashes-beat-answer-marker"),
    R("2x=8\nx=8/2\nAnswer: 4", "4", 1.0, id="answer-colon"),
    R("ANSWER: 34", "34", 1.0, id="answer-marker-any-case"),
    R("**Answer:** 34", "34", 1.0, id="answer-marker-markdown"),
    R("So the answer is 72.", "72", 1.0, id="the-answer-is"),
    R("Final Answer: The final answer is $34$. I hope it is correct.", "34", 1.0, id="minerva-format"),
    R("Answer: 12\n\nChecking: 4 * 3 = 12, so the answer is correct.", "12", 1.0, id="prose-after-a-marker-is-skipped"),
    R("Answer: 34, as computed above.", "34", 1.0, id="remark-after-the-answer-dropped"),
    R("Answer: $34$ (since 2 * 17 = 34)", "34", 1.0, id="math-span-after-marker"),
    R("2x=8\nx=4", "4", 0.0, id="trace-without-marker-no-answer"),  # its last number is not its answer
    R("So 2x = 8 and x = 4", "4", 0.0, id="one-line-trace-without-marker-no-answer"),
    R("5", "5", 1.0, id="bare-answer"),  # a response that is one number is that answer (math-verify credits it too)
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
    same = ["\\boxed{\\frac{1}{2}}", "Answer: 0.5", "The answer is $\\dfrac12$.", "#### 1/2", "\\boxed{\\tfrac{2}{4}}"]
    assert len({canonical_answer(r) for r in same}) == 1
    assert canonical_answer("\\boxed{2, -3}") == canonical_answer("\\boxed{\\{-3, 2\\}}") == "{-3,2}"
    assert canonical_answer("\\boxed{(1, 2)}") != canonical_answer("\\boxed{(2, 1)}")
    assert canonical_answer("\\boxed{\\$1,800}") == canonical("1800") == "1800"
    assert canonical_answer("no answer here") is None and canonical_answer("\\boxed{7") is None
    assert canonical_answer("x = 0.5") == canonical_answer("\\boxed{\\frac12}") and canonical_answer("2x=1\nx=0.5") is None


def test_verifier_is_total_and_bounded():
    hostile = ["Answer: 50**30**20", "Answer: " + "9" * 100000, "\\boxed{" * 50000, "Answer: 1/0",
               "Answer: __import__('os').system('echo hi')", "#### " + "(" * 10000, None, 12, "\x00\uffff",
               "\\boxed{\\{\\}}", "Answer: 1e999999999", "Answer: 10^{-99999999}", "Answer: 0^{-1}"]
    for h in hostile:
        assert verify(h, "1") in (0.0, 1.0) and verify("Answer: 1", h) in (0.0, 1.0)
    assert verify("Answer: " + "9" * 100, "9" * 100) == 1.0   # long numbers still compare, as strings
    prose = "Checking: the answer is right.\n"  # markers followed by prose are skipped, at most MAX_MARKERS of them
    assert verify("Answer: 5\n" + prose * (verifier.MAX_MARKERS - 1), "5") == 1.0
    assert verify("Answer: 5\n" + prose * verifier.MAX_MARKERS, "5") == 0.0
    assert parse_number("1,234") == 1234 and parse_number("-\\frac{1}{2}") == parse_number("-0.5")
    assert extract_answer("no answer here") is None
    assert format_reward("Answer: 3") == 1.0 and format_reward("2x=6\nx=3") == 0.0 and format_reward("Answer:") == 0.0
    assert format_reward("x=3") == 1.0  # a bare answer states one


def test_verifier_never_raises_on_random_latex():
    # random strings of the tokens the rules read: every call returns 0 or 1 and a canonical text or None
    rng = random.Random(0)
    tokens = ["\\boxed{", "\\boxed", "}", "{", "\\frac", "1", "2", "0", ".", ",", " ", "-", "/", "^", "\\times", "10", "e",
              "x", "=", "(", ")", "[", "]", "\\{", "\\}", "$", "\\$", "%", "\\text{", "cm", " and ", "\\pm", "\\overline{",
              "Answer:", "answer is", "####", "\n", "\\left(", "\\sqrt", "−", "(A)", "\\circ", "**", "\\(", "\\)", "{,}", "\\,"]
    numeric = ["1", "2", "0", " ", "/", "-", ".", "\\frac", "{", "}", "^", "e", ","]  # half the cases: number-like answers
    for i in range(3000):
        pool = numeric if i % 2 else tokens
        response = "Answer: " * (i % 2) + "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        answer = "".join(rng.choice(pool) for _ in range(rng.randint(1, 10)))
        assert verify(response, answer) in (0.0, 1.0) and verify(answer, response) in (0.0, 1.0)
        assert isinstance(canonical_answer(response), (str, type(None)))


def test_verifier_time_is_bounded_on_megabyte_inputs():
    # adversarial 1 MB inputs, as response and as reference: a superlinear step would take seconds here;
    # a linear one takes a few milliseconds (the bound is loose because the CPUs are shared)
    n = 1_000_000
    attacks = ["\\boxed{" * (n // 7), "\\boxed{" + "{" * n, "Answer: " * (n // 8), "answer is " * (n // 10),
               "answe" * (n // 5), "#### " + "1" * n, "(" * n, "9" * n, "$" * n, "Answer: " + "\\(" * (n // 2),
               "Answer: " + "1 " * (n // 2), "Answer: " + "\\frac{" * (n // 6), "Answer: " + "a " * (n // 2) + "1",
               "Answer: " + "1," * (n // 2), "Answer: " + "{" * 500 + "}" * 500, "Answer: " + "-(" * (n // 2),
               "\\boxed{\\{" + "1," * 450 + "\\}}", "x" * n + "\\boxed{1}", "\\boxed{1}" * (n // 9), "\\boxed{}" * (n // 8),
               "$\\boxed{1}$, " * (n // 12), "the answer is wrong. " * (n // 21)]
    slowest = 0.0
    for s in attacks:
        for response, answer in ((s, "1"), ("Answer: 1", s), (s, s)):
            t0 = time.perf_counter()
            assert verify(response, answer) in (0.0, 1.0)
            slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 0.2, f"slowest call {slowest * 1000:.0f} ms"


def test_verifier_agrees_with_hand_labels():
    # results/verifier_cases.jsonl: realistic GSM8K / MATH / AIME / DAPO-Math-17k outputs labelled by hand
    with open(os.path.join(HERE, "results", "verifier_cases.jsonl"), encoding="utf-8") as fh:
        cases = [json.loads(line) for line in fh]
    report = verifier.agreement(cases)
    assert report["n"] >= 300
    assert report["agree"] / report["n"] >= 0.95, report
    assert len(report["false_positives"]) <= report["n"] / 300, report["false_positives"]


# ---------------------------------------------------------------------------------------------
# builtin.py: the task and the tokenizer round trip
# ---------------------------------------------------------------------------------------------

def test_builtin_task_solutions_verify_and_split_is_disjoint():
    rng = random.Random(0)
    for _ in range(300):
        eq, x = builtin.make_problem(rng)
        assert verify(builtin.solve_steps(eq, x, verbose=rng.random() < 0.5), str(x)) == 1.0
        lhs, rhs = eq.split("=")
        a, b = (int(v) for v in builtin._split_linear(lhs))
        c, d = (int(v) for v in builtin._split_linear(rhs)) if "x" in rhs else (0, int(rhs))
        assert a * x + b == c * x + d
    train = {r["prompt"] for r in builtin.sample_problems(2000, seed=1, heldout=False)}
    held = {r["prompt"] for r in builtin.sample_problems(200, seed=2, heldout=True)}
    assert len(held) == 200 and not train & held


def test_builtin_tokenizer_round_trips_through_save_pretrained(tmp_path):
    from transformers import AutoTokenizer
    tok = builtin.make_tokenizer()
    model = builtin.make_model(builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1), len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "3x-5=x+7\ncheck: 3(6)-5=(6)+7\nAnswer: 6"
    assert back(text)["input_ids"] == tok(text)["input_ids"] and len(back(text)["input_ids"]) == len(text)
    assert back.decode(back(text)["input_ids"]) == text  # spaces survive (a qwen2 config would drop them)
    assert back.eos_token_id == 1 and back.pad_token_id == 0


def test_packed_warm_start_is_exact():
    """A packed row (positions restarting per demonstration) gives each demonstration the logits it gets
    alone, and the labels score exactly its solution tokens: packing changes the cost, not the training."""
    tok = builtin.make_tokenizer()
    cfg = builtin.BaseModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, sft_steps=2, sft_batch_size=12,
                                  sft_pack_len=80)
    model = builtin.make_model(cfg, len(tok)).eval()
    batches = builtin.warm_start_batches(tok, cfg)
    assert len(batches) == cfg.sft_steps
    demos = [(tok(p)["input_ids"], tok(r)["input_ids"]) for p, r in builtin.warm_start_demos(cfg)]  # encoded as a user would
    for k, (ids, pos, labels) in enumerate(batches):
        assert ids.shape[1] <= cfg.sft_pack_len and ids.shape[0] < cfg.sft_batch_size      # packed: fewer rows than demos
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits          # [R, T, V]
        found = []
        for r in range(ids.shape[0]):
            starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for a, b in zip(starts, starts[1:]):
                seq = ids[r, a:b]
                if (labels[r, a:b] == -100).all():                                           # the row's padding
                    assert (seq == tok.pad_token_id).all()
                    continue
                with torch.no_grad():
                    alone = model(input_ids=seq[None]).logits[0]                              # [n, V]
                torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-5)
                p = int((labels[r, a:b] == -100).sum())                                       # prompt tokens unscored
                assert labels[r, a + p:b].tolist() == seq[p:].tolist() and seq[-1] == tok.eos_token_id
                found.append((seq.tolist(), p))
        want = demos[k * cfg.sft_batch_size:(k + 1) * cfg.sft_batch_size]
        assert sorted(found) == sorted((p + r + [tok.eos_token_id], len(p)) for p, r in want)  # each once, its prompt unscored


def test_shipped_base_model_is_this_recipes_build():
    """base_model/ holds the weights the current recipe builds: after changing the recipe (BaseModelConfig,
    the task, the demonstrations, the tokenizer, the warm start), `python builtin.py --ship` rebuilds it."""
    with open(os.path.join(builtin.SHIP_DIR, "recipe.json")) as fh:
        recorded = json.load(fh)
    assert recorded["key"] == builtin.recipe_key(), \
        "base_model/ was built by another recipe: rebuild and ship it with `python builtin.py --ship`"
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
        assert builtin.recipe_key(dataclasses.replace(cfg, **{f.name: v + 1 if isinstance(v, int) else v / 2}), src) != key, f.name
    changes = [('"check: {', '"check:{'),                                      # the verbose demonstration's text
               ("return f\"x={m}/{a}\\nAnswer: {int(m / a)}\"", "return f\"x={m}/{a}\\nAnswer: {m // a}\""),  # the shortcut
               ("verbose=rng.random() < cfg.verbose_frac", "verbose=rng.random() <= cfg.verbose_frac"),
               ("rng.randint(-9, 9)", "rng.randint(-8, 9)"),                  # the problems
               ("% 8 == 0", "% 7 == 0"),                                      # the held-out split
               ('CHARS = "0123456789', 'CHARS = "9876543210'),               # the tokenizer's vocabulary
               ('behavior="isolated"', 'behavior="merged_with_previous"'),   # and its pre-tokenizer
               ("rms_norm_eps=1e-5", "rms_norm_eps=1e-6"),                    # the model
               ("sft_lr, weight_decay=0.0, betas=(0.9, 0.98)", "sft_lr, weight_decay=0.0, betas=(0.9, 0.99)"),  # the optimiser
               ("pos += range(len(s))", "pos += range(1, len(s) + 1)")]       # the packing
    same = [("# every character the task's prompts and solutions use", "# the characters"),
            ('"""\'+5\' or \'-5\', for a constant written after another term."""', '"""A signed constant."""'),
            ("for _ in range(200 * n):", "for _ in range(300 * n):"),          # sample_problems: the RL data
            ("\n\n\ndef make_model(", "\n\n\n\ndef make_model(")]
    for old, new in changes + same:
        assert src.count(old) == 1, old
        changed = builtin.recipe_key(cfg, src.replace(old, new)) != key
        assert changed == ((old, new) in changes), (old, new)


def test_base_model_is_the_shipped_folder_only_for_its_recipe(tmp_path):
    """ship() writes a cached build with its key; base_model() returns it for that recipe only."""
    cfg = builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, sft_steps=2, sft_batch_size=8)
    cache, shipped = str(tmp_path / "cache"), str(tmp_path / "base_model")
    quiet = lambda *a, **k: None  # noqa: E731
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) == os.path.join(cache, f"base-{builtin.recipe_key(cfg)}")
    assert builtin.ship(cfg, cache, shipped, log=quiet) == shipped
    assert builtin.shipped_key(shipped) == builtin.recipe_key(cfg) and os.path.exists(os.path.join(shipped, "model.safetensors"))
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) == shipped
    other = dataclasses.replace(cfg, seed=1)                                   # another recipe: built into the cache
    assert builtin.base_model(other, cache, quiet, ship_dir=shipped) == os.path.join(cache, f"base-{builtin.recipe_key(other)}")
    assert builtin.ship(other, cache, shipped, log=quiet) == shipped and builtin.shipped_key(shipped) == builtin.recipe_key(other)
    assert builtin.base_model(cfg, cache, quiet, ship_dir=shipped) != shipped
    _, tok, model = data.load_model(shipped)
    assert model.config.hidden_size == 16 and tok.eos_token_id == 1


def test_bench_parses_its_flags_and_times_the_warm_start_both_ways(capsys):
    """bench.py is not run by CI otherwise: its flags (and bench_trl.py's) must parse, and the warm-start section must run."""
    import bench
    import bench_trl
    for main in (bench.main, bench_trl.main):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
    bench.main(["--only", "warmstart", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "padded to the longest" in out and "packed into rows" in out and "packed / padded time" in out


# ---------------------------------------------------------------------------------------------
# data.py: data formats, chat template, pluggable and TRL-style rewards, clear errors for bad input
# ---------------------------------------------------------------------------------------------

def test_gsm8k_fields_chat_template_and_reward_plugin(tiny_run_inputs, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Half of 4?", "answer": "4/2 = 2\n#### 2"}) + "\n")
    rows = data.load_rows(str(gsm), "train", prompt_field="question", answer_field="answer")
    assert rows == [{"prompt": "Half of 4?", "answer": "4/2 = 2\n#### 2", "columns": {"answer": "4/2 = 2\n#### 2"}}]
    assert verify("so \\boxed{2}", rows[0]["answer"]) == 1.0
    tok = builtin.make_tokenizer()
    assert data.PromptFormatter(tok, "{prompt}\nAnswer:")("2x=4") == tok("2x=4\nAnswer:")["input_ids"]
    # a chat template written in the built-in vocabulary's characters: system 's', user 'r', assistant 'A'
    tok.chat_template = ("{% for m in messages %}{{ {'system': 's', 'user': 'r'}[m['role']] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    fmt = data.PromptFormatter(tok, "{prompt}", system="x")
    assert tok.decode(fmt("2x=4")) == "s: x\nr: 2x=4\nA: "
    assert data.PromptFormatter(tok, "{prompt}", chat=False)("2x=4") == tok("2x=4")["input_ids"]
    (tmp_path / "myreward.py").write_text("def half(response, answer):\n    return 0.5\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert data.load_reward("myreward:half")("anything", "1") == 0.5
        with pytest.raises(data.InputError):
            data.load_reward("myreward:nothere")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize("content,flags,message", [
    ('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"\n', [], "bad.jsonl:2: not valid JSON"),
    ('{"prompt": "1+1"}\n', [], "bad.jsonl:1: no field 'answer'"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--resume"], "--resume: no checkpoint"),
    ('{"prompt": "1+1", "answer": "2"}\n', ["--reward", "nosuchmodule:f"], "--reward nosuchmodule:f"),
])
def test_bad_input_gets_one_clear_line(tmp_path, capsys, content, flags, message):
    import train
    (tmp_path / "bad.jsonl").write_text(content)
    argv = ["--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out"), "--model", str(tmp_path), *flags]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def trl_length(completions, **kwargs):
    """A reward in the shape of TRL's docs: a batch of completions in, one float per completion out."""
    return [-abs(8 - len(c)) / 8 for c in completions]


def trl_level_match(prompts, completions, level, answer):
    """TRL's signature with data set columns by name and no **kwargs; None (no score) where `level` is missing."""
    return [None if lv is None else float(a in c) * lv for c, lv, a in zip(completions, level, answer)]


def test_trl_rewards_get_columns_by_name_are_weighted_and_none_is_no_score():
    rows = [{"prompt": "p0", "answer": "4", "columns": {"answer": "4", "level": 2}},
            {"prompt": "p1", "answer": "5", "columns": {"answer": "5"}}]                  # no level: None
    completions = ["x = 4", "12345678"]
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(prompts=prompts, ids=completion_ids, columns=columns)
        return [1.0, None]

    reward = data.Reward([("len", trl_length), ("level", trl_level_match), ("x", has_x), ("spy", spy)], [1.0, 0.5, 2.0, 1.0])
    assert reward.batch == [True, True, False, True]
    total, parts = reward(["p0", "p1"], completions, rows, lambda: [[1, 2], [3]])
    assert seen == {"prompts": ["p0", "p1"], "ids": [[1, 2], [3]], "columns": {"answer": ["4", "5"], "level": [2, None]}}
    assert parts["len"].tolist() == [-3 / 8, 0.0] and parts["x"].tolist() == [1.0, 0.0]
    assert parts["level"][0] == 2.0 and parts["level"][1].isnan() and parts["spy"][1].isnan()
    assert total.tolist() == pytest.approx([-3 / 8 + 0.5 * 2.0 + 2.0 + 1.0, 0.0])          # None leaves the sum
    for bad, message in (([("f", lambda completions: [1.0])], "expected a list of 2 floats or None, got list of 1"),
                         ([("f", lambda completions: "yes")], "expected a list of 2 floats or None, got str"),
                         ([("f", lambda completions, solution: [1.0, 1.0])], "needs ['solution']"),
                         ([("f", has_x), ("f", has_x)], "two rewards, or a reserved metric, named reward/f"),
                         ([("mean", has_x)], "reward/mean")):
        with pytest.raises(data.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
            data.Reward(bad)(["p0", "p1"], completions, rows)
    with pytest.raises(data.InputError, match="2 weights for 1"):
        data.Reward([("x", has_x)], [1.0, 2.0])


@pytest.mark.slow
def test_several_rewards_train_and_log_each_component(tiny_run_inputs, tmp_path, capsys):
    import train
    row = _one_step(tiny_run_inputs, tmp_path / "run", "--reward", "test_grpo:trl_length", "--reward-weights", "1", "0.5")
    # --reward test_grpo:has_x (from _tiny_flags) and trl_length: the score is has_x + 0.5 * trl_length
    assert row["reward/correct"] == pytest.approx(row["reward/has_x"] + 0.5 * row["reward/trl_length"], abs=1e-6)
    assert row["reward/trl_length"] < 0 and json.loads((tmp_path / "run" / "config.json").read_text())["reward"] == \
        ["test_grpo:has_x", "test_grpo:trl_length"]
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--reward", "a:b", "--reward", "c:d", "--reward-weights", "1"])
    assert e.value.code == 2 and "one weight per --reward" in capsys.readouterr().err


def test_data_json_array_file_keeps_every_column(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"q": "1+1", "sol": 2, "level": 1}, {"q": "2+2", "sol": 4}]))
    rows = data.load_rows(str(tmp_path / "rows.json"), "train", "q", "sol")
    assert rows == [{"prompt": "1+1", "answer": "2", "columns": {"sol": 2, "level": 1}},
                    {"prompt": "2+2", "answer": "4", "columns": {"sol": 4}}]
    (tmp_path / "bad.json").write_text('[{"q": "1+1", "sol": 2},\n {"q": ]')
    with pytest.raises(data.InputError, match=r"bad.json:2: not valid JSON"):
        data.load_rows(str(tmp_path / "bad.json"), "train", "q", "sol")


def test_data_parquet_file_folder_splits_and_saved_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="--data with Parquet/Arrow/folders/hub ids needs `datasets`")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    train = [{"question": f"{i}x=0", "solution": str(i), "level": i % 3} for i in range(5)]
    test = [{"question": "9x=0", "solution": "9", "level": 0}]
    (tmp_path / "splits").mkdir()
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(train).to_parquet(str(tmp_path / "splits" / "train.parquet"))
    datasets.Dataset.from_list(test).to_parquet(str(tmp_path / "splits" / "test.parquet"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(train), test=datasets.Dataset.from_list(test)).save_to_disk(
        str(tmp_path / "saved"))
    want = [{"prompt": r["question"], "answer": r["solution"], "columns": {"solution": r["solution"], "level": r["level"]}}
            for r in train]
    load = lambda path, **kw: data.load_rows(str(tmp_path / path), "train", "question", "solution", **kw)  # noqa: E731
    assert load("train.parquet") == want and load("train.parquet", limit=2) == want[:2]
    assert load("splits") == want and load("splits", hf_split="test")[0]["prompt"] == "9x=0"
    assert load("saved") == want and load("saved", hf_split="test")[0]["answer"] == "9"
    with pytest.raises(data.InputError, match=r"train.parquet:1: no field 'answer' \(fields: level, question, solution\)"):
        data.load_rows(str(tmp_path / "train.parquet"), "train", "question", "answer")
    with pytest.raises(data.InputError, match=r"--data .*splits: could not be loaded \(split 'validation': "):
        load("splits", hf_split="validation")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: one line that says what to install
    with pytest.raises(data.InputError, match=r"pip install datasets"):
        load("train.parquet")


# ---------------------------------------------------------------------------------------------
# evaluate.py: pass@k, maj@n, mean@n over ranks, the command
# ---------------------------------------------------------------------------------------------

def test_pass_at_k_equals_enumerating_every_k_subset():
    import itertools

    import evaluate
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):  # samples 0..c-1 are the correct ones; the share of k-subsets holding one
                subsets = list(itertools.combinations(range(n), k))
                want = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert evaluate.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_and_bad_input():
    import evaluate
    assert evaluate.pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)   # one correct of 1000, half drawn
    assert evaluate.pass_at_k(2000, 10, 1) == pytest.approx(10 / 2000, abs=1e-12)  # pass@1 = c / n
    assert evaluate.pass_at_k(1000, 0, 1000) == 0.0 and evaluate.pass_at_k(1000, 1, 1000) == 1.0
    assert evaluate.pass_ks(1) == [1] and evaluate.pass_ks(6) == [1, 2, 4] and evaluate.pass_ks(32) == [1, 2, 4, 8, 16, 32]
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            evaluate.pass_at_k(n, c, k)


@pytest.mark.parametrize("answers,want", [
    (["4", "5", "4"], "4"),
    (["5", "4", "4", "5"], "5"),               # a tie: the answer that appeared first wins
    (["4", None, "5", None, None, "5"], "5"),   # None is the commonest but never wins over an answer
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
    # problem 1: none right; Nones never win, and of the tied '3' and '7' the first to appear does: maj wrong
    a = _record(0, ["Answer: 6", "Answer: 4", "so \\boxed{4}", "Answer: 5"], [0.0, 1.0, 1.0, 0.0], [2, 4, 4, 2], [False] * 4)
    b = _record(1, ["no", "Answer: 3", "x", "Answer: 7"], [0.0] * 4, [6, 6, 6, 6], [True, True, False, False])
    assert a["majority"] == evaluate.CREDITED and a["majority_score"] == 1.0 and a["correct"] == 2  # the right '4' won
    assert b["majority"] == evaluate.canonical_answer("Answer: 3") and b["majority_score"] == 0.0
    ks = evaluate.pass_ks(4)
    m = evaluate.metrics(evaluate.totals([a, b], ks), 4, ks)
    assert m == pytest.approx({
        "eval/mean@4": (0.5 + 0.0) / 2, "eval/mean@4_std": 0.25,  # population std of (0.5, 0.0)
        "eval/pass@1": 0.25, "eval/pass@2": (1 - 1 / 6) / 2,      # problem 0: 1 - C(2,2)/C(4,2); problem 1: 0
        "eval/pass@4": 0.5, "eval/maj@4": 0.5, "eval/truncated_frac": 2 / 8, "eval/len_mean": 36 / 8})
    g = evaluate.metrics(evaluate.totals([_record(0, ["Answer: 4"], [1.0]), _record(1, ["Answer: 5"], [0.0])], [1]), 1, [1])
    assert g == {"eval/accuracy": 0.5, "eval/truncated_frac": 0.0, "eval/len_mean": 3.0}  # greedy: today's keys


def test_majority_vote_counts_what_the_reward_counts():
    import evaluate

    def tagged(response, answer):  # a custom --reward that reads a format the verifier does not
        return float(response.strip() == f"<answer>{answer}</answer>")
    # 2 of 3 samples right by the reward, none readable by the verifier: the vote is right, as mean@3 says
    responses = ["<answer>4</answer>", "<answer>7</answer>", "<answer>4</answer>"]
    r = _record(0, responses, [tagged(x, "4") for x in responses])
    assert [s["answer"] for s in r["samples"]] == [None] * 3 and r["majority"] == evaluate.CREDITED
    assert r["majority_score"] == 1.0
    # wrong answers the verifier reads still outvote one right answer; the right one wins a tie drawn first
    r = _record(1, ["<answer>4</answer>", "Answer: 6", "6"], [1.0, 0.0, 0.0])
    assert r["majority"] == canonical("6") and r["majority_score"] == 0.0
    r = _record(2, ["<answer>4</answer>", "Answer: 6"], [1.0, 0.0])
    assert r["majority"] == evaluate.CREDITED and r["majority_score"] == 1.0
    # the default verifier: a credited answer is the reference's, so this is the vote by canonical answers
    responses = ["Answer: 6", "\\boxed{4}", "4", "Answer: 6", "x = 4"]
    scores = [verify(x, "4") for x in responses]
    plain = evaluate.majority_vote([canonical_answer(x) for x in responses])
    assert plain == canonical("4") and evaluate.majority_vote(evaluate.votes(
        [canonical_answer(x) for x in responses], scores)) == evaluate.CREDITED
    assert canonical_answer("Answer: " + evaluate.CREDITED) != evaluate.CREDITED  # never a canonical text


class _Rank:
    """Dist for one rank of `world` without a process group: sum returns this rank's share."""
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def sum(self, x):
        return x.detach().double().clone()


def _eval_setup(d, *flags):
    """train.py's Args, the tiny model with large random weights (the fixture's answers '\n' to every prompt
    greedily; these give each prompt its own answer), and 12 built-in held-out problems."""
    import train
    args = train.parse_args(["--model", str(d / "model"), "--max-new-tokens", "10", "--device", "cpu", *flags])
    _, tok, model = data.load_model(args.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return args, tok, model, builtin.sample_problems(12, 2, True)


def _has_9(response, answer):  # the random model is never right: this scores some of its responses 1
    return float("9" in response)


def test_greedy_evaluation_equals_greedy_rollouts_scored_by_hand(tiny_run_inputs):
    import evaluate
    args, tok, model, rows = _eval_setup(tiny_run_inputs)
    reward = _has_9
    m, records = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    # one greedy answer per problem, scored here: sums of reward, truncation, length
    encode, eos = data.PromptFormatter(tok), data.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in rows], 1, 10, eos, tok.pad_token_id, temperature=0.0)
    texts = [tok.decode(roll.response_ids[i, : roll.lengths[i]], skip_special_tokens=True) for i in range(len(rows))]
    correct = sum(reward(t, r["answer"]) for t, r in zip(texts, rows))
    assert 0 < correct < len(rows) and 0 < roll.truncated.sum() < len(rows)
    assert m == {"eval/accuracy": correct / len(rows), "eval/truncated_frac": roll.truncated.sum().item() / len(rows),
                 "eval/len_mean": roll.lengths.sum().item() / len(rows)}
    assert [s["response"] for r in records for s in r["samples"]] == texts
    assert evaluate.headline(1) == "eval/accuracy" and evaluate.headline(8) == "eval/mean@8"


def test_sampled_evaluation_is_the_same_split_over_ranks(tiny_run_inputs, monkeypatch):
    import evaluate
    monkeypatch.setattr(evaluate, "EVAL_BATCH", 8)  # 2 problems per batch: each rank batches other problems together
    args, tok, model, rows = _eval_setup(tiny_run_inputs, "--eval-samples", "4", "--eval-top-p", "0.9")
    reward = _has_9
    m1, r1 = evaluate.evaluate_model(model, tok, rows, args, _Rank(0, 1), reward)
    parts = [evaluate.evaluate_model(model, tok, rows, args, _Rank(k, 3), reward)[1] for k in range(3)]
    assert sorted((r for p in parts for r in p), key=lambda r: r["index"]) == r1  # same samples, scores, votes
    ks = evaluate.pass_ks(4)
    assert evaluate.metrics(sum(evaluate.totals(p, ks) for p in parts), 4, ks) == pytest.approx(m1, abs=1e-12)
    scores = [[s["score"] for s in r["samples"]] for r in r1]
    assert m1["eval/mean@4"] == pytest.approx(sum(map(sum, scores)) / 48) == pytest.approx(m1["eval/pass@1"])
    assert m1["eval/pass@1"] <= m1["eval/pass@2"] <= m1["eval/pass@4"] == sum(map(max, scores)) / 12
    assert len({tuple(s["response"] for s in r["samples"]) for r in r1}) == 12  # samples differ between problems
    assert len({s["response"] for s in r1[0]["samples"]}) > 1                   # and within one


def test_eval_flags_are_shared_and_checked(capsys):
    import dataclasses as dc

    import evaluate
    import train
    mine = {f.name: f for f in dc.fields(train.Args)}
    for f in dc.fields(evaluate.EvalArgs):  # one definition: same type, default and help in train.py
        assert (mine[f.name].type, mine[f.name].default, mine[f.name].metadata) == (f.type, f.default, f.metadata), f.name
    for parse in (train.parse_args, evaluate.main):
        for bad in (["--eval-samples", "0"], ["--eval-temperature", "0"], ["--eval-top-p", "1.5"], ["--max-new-tokens", "0"]):
            with pytest.raises(SystemExit) as e:
                parse(bad)
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_evaluate_command_writes_the_table_and_per_problem_lines(tiny_run_inputs, tmp_path, capsys):
    import evaluate
    model, out = str(tiny_run_inputs / "model"), tmp_path / "per-problem.jsonl"
    res = evaluate.main(["--model", model, model, "--data", "builtin", "--eval-size", "5", "--eval-samples", "2",
                         "--max-new-tokens", "6", "--device", "cpu", "--out", str(out)])
    table = capsys.readouterr().out
    assert "| model | mean@2 | mean@2_std | pass@1 | pass@2 | maj@2 | truncated_frac | len_mean |" in table
    assert table.count(f"| {model} |") == 2 and [r[0] for r in res] == [model, model] and res[0][1] == res[1][1]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2, 3, 4] * 2 and {x["model"] for x in lines} == {model}
    heldout = builtin.sample_problems(5, 2, True)
    for x in lines:
        assert (x["prompt"], x["reference"]) == (heldout[x["index"]]["prompt"], heldout[x["index"]]["answer"])
        assert len(x["samples"]) == 2 and set(x["samples"][0]) == {"response", "answer", "score", "length", "truncated"}
        assert all(s["score"] == verify(s["response"], x["reference"]) for s in x["samples"])
        assert all(s["answer"] == evaluate.canonical_answer(s["response"]) for s in x["samples"])
    assert lines[:5] == lines[5:]  # the same model evaluated twice draws the same samples


# ---------------------------------------------------------------------------------------------
# train.py: flags, the step's metrics, end-to-end runs through subprocess, the loss flags reach the update
# ---------------------------------------------------------------------------------------------

def test_bad_flags_exit_with_one_line(capsys):
    import train
    for bad in (["--group-size", "1"], ["--max-new-tokens", "0"], ["--algo", "ppo"], ["--reduction", "mean"],
                ["--top-p", "0"], ["--overlong-cache", "999"], ["--steps", "x"], ["--loss", "reinforce"],
                ["--kl", "k4"], ["--loss", "gspo", "--clip-c", "3"], ["--tis-cap", "-1"], ["--beta", "-0.1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


METRIC_KEYS = {"step", "loss", "reward/mean", "reward/correct", "reward/frac_zero_std", "kl", "entropy",
               "clip/low_frac", "clip/high_frac", "ratio/mean", "len/mean", "len/truncated_frac", "grad_norm",
               "lr", "samples", "sampling/rounds", "time/step_s", "time/sample_s", "memory/state_bytes",
               "mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl"}


@pytest.mark.slow
def test_end_to_end_changes_weights_and_writes_metrics(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    res = _run_train(d, tmp_path / "run", "--algo", "dapo")
    assert "held-out greedy accuracy" in res.stdout and "no learning signal" not in res.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and [r["step"] for r in evals] == [0, 1, 2]
    for r in train_rows:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        assert all(math.isfinite(v) for v in r.values())
        assert 0.0 <= r["entropy"] <= math.log(len(builtin.CHARS) + 3) + 1e-4
        assert 0.0 <= r["len/truncated_frac"] <= 1.0 and 1.0 <= r["len/mean"] <= 12.0
        assert r["kl"] == 0.0 and abs(r["ratio/mean"] - 1.0) < 1e-5  # beta 0: no reference; mu 1: ratio 1
        # float32: the sampler's log-probs and the training forward's agree (the sampled tokens' own log-probs)
        assert 0.0 <= r["mismatch/logp_abs_mean"] <= r["mismatch/logp_abs_max"] < 1e-4 and 0 <= r["mismatch/kl"] < 1e-6
    # AdamW (no decay) moves an element by lr * |m / sqrt(v)| an update, <= 1.0014 lr in the first two: the
    # largest moves are those of steady gradients (lr each time), and every weight tensor moved
    before, after = _weights(d / "model"), _weights(tmp_path / "run" / "final")
    moved, lr_sum = {k: (after[k] - before[k]).abs() for k in before}, sum(r["lr"] * r["updates"] for r in train_rows)
    assert 0.99 * lr_sum <= max(float(m.max()) for m in moved.values()) <= 1.01 * lr_sum
    assert all(float(m.median()) > lr_sum / 4 for m in moved.values()), {k: float(m.median()) for k, m in moved.items()}
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["eps_high"] == 0.28 and config["reduction"] == "token" and config["beta"] == 0.0


@pytest.mark.slow
def test_end_to_end_overlong_filter_grad_norm_and_schedule(tiny_run_inputs, tmp_path):
    # 3 new tokens: most responses are truncated. The same samples with the filter on and off (the filter
    # changes only the loss mask): on, only the untruncated responses' tokens are in the loss.
    flags = ["--algo", "dapo", "--max-new-tokens", "3", "--overlong-cache", "1", "--no-dynamic-sampling",
             "--steps", "2", "--grad-clip", "0", "--mini-batches", "2", "--mu", "2", "--warmup-steps", "4"]
    rows = {}
    for name, extra in (("on", []), ("off", ["--no-overlong-filter"])):
        _run_train(tiny_run_inputs, tmp_path / name, *flags, *extra)
        rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    on, off = rows["on"][0], rows["off"][0]
    n = 4 * 4                                                     # prompts x G
    assert off["tokens/in_loss"] == pytest.approx(off["len/mean"] * n)
    assert on["tokens/in_loss"] < off["tokens/in_loss"] and on["len/truncated_frac"] > 0
    assert on["tokens/in_loss"] <= 3 * n * (1 - on["len/truncated_frac"]) + 1e-6
    assert off["grad_norm"] > 0                                   # logged with --grad-clip 0 too
    # 2 mini-batches x 2 passes = 4 optimizer updates, and the schedule counts rollout steps: 2/4, then 3/4 of lr
    assert [r["updates"] for r in rows["off"]] == [4, 4]
    assert [r["lr"] for r in rows["off"]] == pytest.approx([1e-2 * 2 / 4, 1e-2 * 3 / 4])


@pytest.mark.slow
def test_end_to_end_dapo_with_fixes_off_equals_grpo(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    # --mu 2 takes the old-policy pass and beta 0.04 the reference pass: both paths are compared too
    _run_train(d, tmp_path / "grpo", "--algo", "grpo", "--mu", "2", "--reward", "tinyreward:has_x")
    _run_train(d, tmp_path / "dapo", "--algo", "dapo", "--eps-high", "0.2", "--reduction", "sequence", "--beta", "0.04",
               "--wrong-reward", "0", "--no-dynamic-sampling", "--no-overlong-filter", "--no-overlong-penalty", "--mu", "2",
               "--reward", "tinyreward:has_x", "--log-completions", "0")
    a, b = _weights(tmp_path / "grpo" / "final"), _weights(tmp_path / "dapo" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = _weights(d / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a)  # the runs did learn something
    ka = [json.loads(x)["loss"] for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    kb = [json.loads(x)["loss"] for x in (tmp_path / "dapo" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert ka == kb
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert all(r["kl"] > 0 for r in rows)               # the second update has moved away from the reference
    assert any(r["ratio/mean"] != 1.0 for r in rows)    # and from the sampling policy
    # --log-completions 2 (the default): two completions per step, one from each of the first two groups
    comps = [json.loads(x) for x in (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert [c["step"] for c in comps] == [1, 1, 2, 2] and comps[0]["prompt"] != comps[1]["prompt"]
    prompts = {r["prompt"] for r in data.load_rows(str(d / "train.jsonl"), "train")}
    for c in comps:
        assert c["prompt"] in prompts and c["reward"] == float("x" in c["response"]) and 1 <= c["length"] <= 12
    assert not (tmp_path / "dapo" / "completions.jsonl").exists()  # --log-completions 0


def test_rewards_and_reward_mean_carry_wrong_reward_and_the_overlong_penalty(tiny_model):
    # Step 2 on the tiny model: a right answer scores 1, a wrong one --wrong-reward, plus DAPO's soft overlong
    # penalty (Eq. 13); reward/mean is their mean over every drawn sample (z-scored advantages would hide both)

    import parallel
    import train
    args = train.parse_args(["--algo", "dapo", "--wrong-reward", "-0.5", "--prompts-per-step", "3", "--group-size", "4",
                             "--max-new-tokens", "8", "--overlong-cache", "4", "--device", "cpu"])
    rows = [{"prompt": str(i), "answer": "even"} for i in range(3)]
    task = train.Task(rows, lambda p: PROMPTS[int(p)], lambda roll, i: " ".join(map(str, roll.response_ids[i, : roll.lengths[i]].tolist())),
                      data.as_reward(lambda text, answer: float(int(text.split()[0]) % 2 == 0)), eos=[1], pad=0)
    roll, _ = train.draw_round(tiny_model, task, args, parallel.Dist("cpu"), 0)
    right = torch.tensor([float(int(roll.response_ids[i, 0]) % 2 == 0) for i in range(12)])
    L = roll.lengths.float()
    penalty = torch.where(L <= 4, 0.0, (4 - L) / 4)                   # 0 up to 8 - 4 tokens, then down to -1 at 8
    want = torch.where(right == 1, 1.0, -0.5) + penalty
    assert 0 < right.sum() < 12 and (penalty < 0).any() and torch.equal(roll.correct, right)
    assert torch.allclose(roll.rewards, want)
    s = curves.drawn_sums([roll])
    assert s["reward"] / s["samples"] == pytest.approx(float(want.mean())) and s["correct"] == float(right.sum())


def _update_stats(first: dict, rest: dict, mismatch_max: float = 0.0):
    zero = dict.fromkeys(update.UPDATE_SUMS, 0.0)
    return update.UpdateStats({**zero, **first}, {**zero, **rest}, mismatch_max, logprob_s=0.0, update_s=0.0)


def test_step_metrics_worked_by_hand():
    # one step, summed over ranks: 2 groups of G = 4 drawn (8 samples), 2 optimizer updates (--mu 2, one
    # mini-batch), 10 loss tokens a pass; a --reward component "fmt" scored 6 of the 8 samples, "len" none
    d = {"samples": 8.0, "reward": 2.0, "correct": 3.0, "length": 40.0, "truncated": 2.0, "groups": 2.0,
         "groups_zero_std": 1.0, "groups_all_correct": 0.0, "groups_all_wrong": 1.0,
         "reward/fmt": 1.5, "scored:reward/fmt": 6.0, "reward/len": 0.0, "scored:reward/len": 0.0}
    first = {"loss": 0.5, "kl": 0.2, "tokens": 10.0, "entropy": 6.0, "entropy_tokens": 12.0, "grad_norm": 3.0,
             "updates": 1.0, "mismatch/abs": 0.6, "mismatch/kl": 0.12, "mismatch/tokens": 12.0,
             "clip/low_frac": 0.0, "clip/high_frac": 0.0, "ratio/mean": 10.0}      # the first update: ratio 1
    rest = {"loss": 0.3, "kl": 0.4, "tokens": 10.0, "grad_norm": 1.0, "updates": 1.0,
            "clip/low_frac": 1.0, "clip/high_frac": 2.0, "clip/dual_frac": 0.5, "ratio/mean": 10.5}
    row = curves.step_metrics(d, _update_stats(first, rest, 0.25), mu=2, clip_c=3.0)
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
        "clip/low_frac": 0.1,            # 1 / the 10 tokens of the off-policy update (the first is left out)
        "clip/high_frac": 0.2,           # 2 / 10
        "ratio/mean": 1.05,              # 10.5 / 10
        "clip/dual_frac": 0.05,          # 0.5 / 10 (--clip-c is on)
        "len/mean": 5.0,                 # 40 / 8
        "len/truncated_frac": 0.25,      # 2 / 8
        "tokens/in_loss": 10.0,          # 20 / --mu 2: the step's loss tokens once
        "grad_norm": 2.0,                # (3 + 1) / 2 updates
        "updates": 2.0,
    })
    # one update only (--mu 1): the clip and ratio keys are the first update's; no --clip-c, no dual key
    row = curves.step_metrics(d, _update_stats(first, {}), mu=1, clip_c=0.0)
    assert (row["ratio/mean"], row["clip/high_frac"], row["loss"], row["kl"]) == pytest.approx((1.0, 0.0, 0.5, 0.02))
    assert "clip/dual_frac" not in row
    # nothing trained (dynamic sampling kept no group): means over updates and tokens are 0, no clip keys
    row = curves.step_metrics(d, _update_stats({}, {}), mu=1, clip_c=3.0)
    assert (row["loss"], row["kl"], row["entropy"], row["grad_norm"], row["updates"]) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert not {"clip/low_frac", "clip/high_frac", "ratio/mean", "clip/dual_frac"} & set(row)


def test_train_help_shows_args_sections_as_groups_with_every_flag_once(capsys, monkeypatch):
    import dataclasses as dc
    import re

    import train
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--help"])
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
    # EvalArgs' flags (train.Args inherits them) come first in their sections
    assert [flags[0] for flags in list(groups.values())[1:]] == ["--model", "--max-new-tokens", "--lr", "--beta", "--seed"]
    assert "--algo" in groups["the model and data"] and "--mini-batches" in groups["optimisation"]
    assert "--eval-samples" in groups["how much"] and "--bf16" in groups["the run"]
    assert "--dynamic-sampling" in groups[titles[4]] and "--resume" in groups["the run"]
    listed = [f for flags in list(groups.values())[1:] for f in flags]
    assert sorted(listed) == sorted("--" + f.name.replace("_", "-") for f in dc.fields(train.Args))  # each once


class _TwoRanks:
    """Dist of one of two ranks: sum adds the other rank's share (what all_reduce returns)."""
    def __init__(self, other):
        self.other = other

    def sum(self, x):
        return x.double() + self.other


def test_batch_std_is_bessel_corrected_over_all_ranks():
    import parallel
    import train
    r = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -0.5])
    halves = []
    for part in (r, r[:4], r[4:]):
        roll = _fake_rollout([[1, 0, 0, 1]] * (len(part) // 4))
        roll.rewards = part
        halves.append(roll)
    assert train.reward_std(halves[0], parallel.Dist("cpu")) == pytest.approx(float(r.double().std()), abs=1e-12)  # n - 1
    for k in (1, 2):  # rank k - 1 of 2: its own rewards, and the other rank's count, sum and sum of squares
        other = r[4:].double() if k == 1 else r[:4].double()
        sums = torch.stack([torch.tensor(4.0, dtype=torch.float64), other.sum(), (other * other).sum()])
        assert train.reward_std(halves[k], _TwoRanks(sums)) == pytest.approx(float(r.double().std()), abs=1e-12)
    assert train.reward_std(Rollout.empty(4, 0), parallel.Dist("cpu")) == 0.0


@pytest.mark.slow
def test_bf16_flag_autocasts_on_cpu_too(tiny_run_inputs, tmp_path):
    # --bf16 asks for bfloat16 autocast on the run's device; a CUDA-only autocast would leave a CPU run in float32
    for name, flags in (("fp32", []), ("bf16", ["--bf16"])):
        _run_train(tiny_run_inputs, tmp_path / name, "--steps", "1", *flags)
    fp32, bf16 = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines() if "loss" in x][0]
                  for n in ("fp32", "bf16"))
    # bfloat16 logits round differently: the entropy and the gradient move, within bfloat16's 8 significant bits
    for k in ("entropy", "grad_norm"):
        assert 0 < abs(bf16[k] - fp32[k]) <= 2 ** -8 * fp32[k], (k, bf16[k], fp32[k])
    # the sampler (KV cache, one token at a time) and the training forward round differently in bfloat16:
    # the mismatch metrics see it, and it is far larger than float32's
    assert bf16["mismatch/logp_abs_max"] > 100 * fp32["mismatch/logp_abs_max"] and bf16["mismatch/kl"] > 0
    assert all(v.dtype == torch.float32 for v in _weights(tmp_path / "bf16" / "final").values())  # weights stay float32


@pytest.mark.slow
def test_bf16_checkpoint_trains_with_float32_weights_and_adam(tiny_run_inputs, tmp_path):
    # hub models are mostly saved in bfloat16; transformers 5 keeps a checkpoint's dtype unless told otherwise,
    # and AdamW updates of ~lr 1e-6 on bf16 weights mostly round away: load float32 master weights always
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = tiny_run_inputs / "model"
    AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path / "bf16")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16  # the trap is real
    _, _, model = data.load_model(str(tmp_path / "bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    _run_train(tiny_run_inputs, tmp_path / "run", "--model", str(tmp_path / "bf16"), "--steps", "1", "--save-every", "1")
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert {v.dtype for v in ckpt["model"].values()} == {torch.float32}
    moments = [t for s in ckpt["optimizer"]["state"].values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {t.dtype for t in moments} == {torch.float32}


@pytest.mark.slow
def test_loss_flags_reach_the_update(tiny_run_inputs, tmp_path):
    # The same samples each time (same seed); each flag must change the update as its math says.
    d = tiny_run_inputs
    base = _one_step(d, tmp_path / "base")
    # float32: pi_old and the sampler agree to ~1e-7, so a cap of 0.5 makes every weight 0.5: half the gradient
    tis = _one_step(d, tmp_path / "tis", "--tis-cap", "0.5")
    assert tis["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-4)
    assert tis["loss"] == pytest.approx(0.5 * base["loss"], rel=1e-4, abs=1e-7)

    def g_plus_c_h(norms):  # grad norms at c = 0, 0.5, 1, 2 (one update): the gradient is g + c h for one h != 0
        f = [x ** 2 for x in norms]          # |g + c h|^2, a quadratic in c: through c = 0, 0.5, 1 it predicts c = 2
        assert f[3] == pytest.approx(3 * f[0] - 8 * f[1] + 6 * f[2], rel=1e-4) and f[2] - 2 * f[1] + f[0] > 1e-4 * f[0]

    # entropy bonus: loss - c * H, H the token mean of the entropy over the loss's tokens (all of them without the
    # overlong filter: the metric "entropy"); gradient g - c grad H
    ent = {c: _one_step(d, tmp_path / f"ent{c}", "--entropy-coef", str(c), "--no-overlong-filter") for c in (0, 0.5, 1, 2)}
    g_plus_c_h([r["grad_norm"] for r in ent.values()])
    assert all(r["loss"] == pytest.approx(ent[0]["loss"] - c * r["entropy"], abs=1e-5) for c, r in ent.items())
    # GSPO: on-policy (one update) its gradient is the policy gradient, as PPO's; off-policy (a second pass,
    # where the paper's 3e-4 / 4e-4 clip most responses) it is not
    gspo = _one_step(d, tmp_path / "gspo", "--loss", "gspo")
    assert gspo["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
    # (the same weights after the first, on-policy update): in the second, GSPO's ratio is per response, the
    # geometric mean of its tokens' ratios, so its mean is below PPO's (Jensen; equal only if all are 1)
    tiny = ["--mu", "2", "--eps-low", "3e-4", "--eps-high", "4e-4"]  # GSPO's clip range for both
    ppo2, gspo2 = _one_step(d, tmp_path / "ppo2", *tiny), _one_step(d, tmp_path / "gspo2", "--loss", "gspo", *tiny)
    assert gspo2["ratio/mean"] < ppo2["ratio/mean"] - 1e-4
    # GSPO-token with one advantage per response is GSPO
    tok2 = _one_step(d, tmp_path / "tok2", "--loss", "gspo-token", *tiny)
    assert tok2["grad_norm"] == pytest.approx(gspo2["grad_norm"], rel=1e-5)
    # CISPO: off-policy, a clipped token keeps a gradient where PPO's is zero (same clip range for both)
    narrow = ["--mu", "2", "--eps-low", "0.01", "--eps-high", "0.01"]
    ppo3, cispo3 = _one_step(d, tmp_path / "ppo3", *narrow), _one_step(d, tmp_path / "cispo3", "--loss", "cispo", *narrow)
    assert cispo3["grad_norm"] > ppo3["grad_norm"] and ppo3["clip/low_frac"] + ppo3["clip/high_frac"] > 0
    # the KL estimator reaches the loss. On-policy (pi = pi_ref) every estimator is 0, and so is k3's gradient
    # ((1 - pi_ref / pi) grad log pi), not k1's (grad log pi): k1's gradient is g + beta h, h != 0
    k3_on = _one_step(d, tmp_path / "k3on", "--beta", "0.5")
    assert k3_on["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6) and k3_on["kl"] < 1e-10
    k1_on = [_one_step(d, tmp_path / f"k1on{b}", "--beta", b, "--kl", "k1") for b in ("0.5", "1", "2")]
    g_plus_c_h([base["grad_norm"]] + [r["grad_norm"] for r in k1_on])
    assert all(r["loss"] == pytest.approx(base["loss"], abs=1e-6) and r["kl"] < 1e-10 for r in k1_on)
    k3 = _one_step(d, tmp_path / "k3", "--beta", "0.5", "--mu", "2")  # in the second pass the policy has left the reference
    assert k3["kl"] > 0


# ---------------------------------------------------------------------------------------------
# checkpoint.py, parallel.py: resume, atomic saves, the run lock; DDP, FSDP and gradient checkpointing
# ---------------------------------------------------------------------------------------------

def test_dist_on_cuda_uses_the_local_rank_and_nccl(monkeypatch):
    # the CUDA branch of Dist cannot run here: drive it with set_device and init_process_group stubbed out
    import parallel
    calls = []
    for k, v in (("WORLD_SIZE", "2"), ("RANK", "3"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    ddp = parallel.Dist("cuda")
    assert (ddp.device, ddp.rank, ddp.world, ddp.master) == ("cuda:1", 3, 2, False)
    assert calls == [("set_device", "cuda:1"), ("init", "nccl", {})]
    # without torchrun: no process group, except for --fsdp, which shards over one rank (an in-memory store)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k)
    calls.clear()
    parallel.Dist("cuda")
    assert calls == []
    ddp = parallel.Dist("cuda", fsdp=True)
    assert ddp.device == "cuda" and [(c[1], c[2]["rank"], c[2]["world_size"]) for c in calls] == [("nccl", 0, 1)]


def test_fsdp_shards_each_decoder_layer_then_the_root_bf16_on_cuda(monkeypatch):
    # fully_shard recorded instead of run, so the CUDA branch (bf16 compute, float32 reductions) runs on CPU too
    import torch.distributed.device_mesh as device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import parallel
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    calls, meshes = [], []
    monkeypatch.setattr(parallel, "fully_shard", lambda m, **kw: calls.append((m, kw)))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or "mesh")
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 4)
    for device, param_dtype, reduce_dtype in (("cuda:1", torch.bfloat16, torch.float32), ("cpu", None, None)):
        calls.clear()
        assert parallel.wrap(model, parallel.Dist(device), fsdp=True) is model
        assert [m for m, _ in calls] == [*model.model.layers, model]                 # bottom-up, the root last
        assert [kw["reshard_after_forward"] for _, kw in calls] == [True, True, True, False]
        assert all(kw["mesh"] == "mesh" and kw["mp_policy"].param_dtype == param_dtype
                   and kw["mp_policy"].reduce_dtype == reduce_dtype for _, kw in calls)
    assert meshes == [("cuda", (4,)), ("cpu", (4,))]
    with pytest.raises(parallel.ShardingError, match="no decoder layers"):
        parallel.shard(torch.nn.Linear(2, 2), "cpu")
    assert parallel.wrap(model, parallel.Dist("cpu"), fsdp=False) is model          # one process, no --fsdp: as is


def test_fsdp_in_one_process_gathers_for_rollouts_and_checkpoints_atomically(tmp_path, monkeypatch):
    # FSDP2 over a one-rank gloo group in this process. `unsharded` leaves the layers sharded again, and
    # freeing their weights after each forward. Checkpoints: save step 1, crash in the middle of saving
    # step 2, and load: `latest` still names step 1, whose weights, AdamW moments and scheduler come back
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    import checkpoint
    import parallel
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ddp = parallel.Dist("cpu", fsdp=True)
    try:
        def fresh():
            torch.manual_seed(0)
            cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)
            model = parallel.wrap(LlamaForCausalLM(cfg), ddp, fsdp=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

        def train_step(model, opt, sched):
            model(input_ids=torch.arange(1, 9)[None]).logits.square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

        def snapshot(model, opt):
            return ({k: v.full_tensor().clone() for k, v in model.state_dict().items()},
                    [t.full_tensor().clone() for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])])

        model, opt, sched = fresh()
        layer = model.model.layers[0].self_attn.q_proj
        sharded = lambda: type(layer.weight).__name__ == "DTensor"  # noqa: E731 - the registered parameter is the shard
        with parallel.unsharded(model), torch.no_grad():
            model(input_ids=torch.arange(1, 9)[None])
            assert not sharded()                     # gathered, and kept gathered after a forward
        assert sharded()
        model(input_ids=torch.arange(1, 9)[None])
        assert sharded()                             # a layer frees its gathered weights after a forward again
        folder = str(tmp_path / "checkpoint")
        train_step(model, opt, sched)
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 1, "data_pos": 4}, ddp)
        saved = snapshot(model, opt)
        train_step(model, opt, sched)
        real_save = dcp.save

        def crash(state, checkpoint_id):  # half the shards written, then the process dies
            real_save(dict(list(state.items())[: len(state) // 2]), checkpoint_id=checkpoint_id)
            raise KeyboardInterrupt("killed mid-save")
        monkeypatch.setattr(dcp, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ddp)
        monkeypatch.setattr(dcp, "save", real_save)
        assert checkpoint.latest(folder).endswith("step-000001") and os.path.isdir(folder + "/step-000002.tmp")
        meta = dcp.FileSystemReader(checkpoint.latest(folder)).read_metadata().state_dict_metadata
        assert all(type(m).__name__ == "TensorStorageMetadata" for m in meta.values())  # nothing DCP would unpickle
        model2, opt2, sched2 = fresh()
        state = checkpoint.load_sharded(folder, model2, opt2, sched2, ddp)
        assert (state["step"], state["data_pos"], sched2.last_epoch, opt2.param_groups[0]["lr"]) == (1, 4, 1, 5e-3)
        (w, m), (w2, m2) = saved, snapshot(model2, opt2)
        assert all(torch.equal(w[k], w2[k]) for k in w) and all(torch.equal(a, b) for a, b in zip(m, m2)) and len(m) > 0
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ddp)  # a completed save
        assert sorted(os.listdir(folder)) == ["latest", "step-000002"]                   # replaces the old one
    finally:
        ddp.close()


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes():
    from transformers import LlamaConfig, LlamaForCausalLM

    import parallel
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1))
    roll = sample_groups(model, PROMPTS, 2, 10, eos_token_id=1, pad_token_id=0,
                         generator=[torch.Generator().manual_seed(s) for s in range(3)])
    calls, forwards = [], []
    model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))  # runs first in the layer
    model.model.register_forward_hook(lambda *_: forwards.append(1))  # the shared-prefix forward calls the model twice

    def grads(shared_prefix=True):  # checkpointed layers drop the cache: update_policy asks for per-response then
        model.train()
        model.zero_grad()
        calls.clear()
        forwards.clear()
        logp, _, valid = rollout_logprobs(model, roll, slice(0, 6), 1.0, shared_prefix=shared_prefix)
        (-(logp * valid).sum() / valid.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls), len(forwards)

    plain, n_plain, f_plain = grads()
    parallel.checkpoint_activations(model)
    ckpt, n_ckpt, f_ckpt = grads(shared_prefix=False)
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt         # the layer ran again in backward: it was checkpointed
    assert max((plain[k] - ckpt[k]).abs().max().item() for k in plain) <= 1e-5
    assert all(plain[k].abs().sum() > 0 for k in plain if "layers.0" in k)


def test_update_policy_recomputes_checkpointed_layers_in_an_eval_mode_model(tiny_model):
    """--gradient-checkpointing reaches the update: the model stays in eval mode (as from_pretrained
    gives it), yet each checkpointed layer runs again in backward, only during the gradient passes,
    with the same update as without checkpointing."""
    import contextlib
    import copy
    from types import SimpleNamespace

    import parallel
    roll = _mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(0))

    def run(checkpointing):
        model, calls, forwards = copy.deepcopy(tiny_model), [], []
        if checkpointing:
            parallel.checkpoint_activations(model)
        model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))  # first in the layer
        model.model.register_forward_hook(lambda *_: forwards.append(1))     # once per forward of the model
        args = SimpleNamespace(micro_batch_size=4, mini_batches=1, mu=1, temperature=1.0, reduction="token",
                               loss="ppo", fsdp=False, gradient_checkpointing=checkpointing, max_new_tokens=20,
                               eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0, entropy_coef=0.0, beta=0.0,
                               kl="k3", grad_clip=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        learner = update.Learner(model, model, None, opt, contextlib.nullcontext)
        update.update_policy(learner, roll, adv, roll.mask, args, parallel.Dist("cpu"))
        assert not any(m.training for m in model.modules())                 # eval mode again after
        return model, len(calls), len(forwards)

    plain, n_plain, f_plain = run(False)
    ckpt, n_ckpt, f_ckpt = run(True)
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt                       # the layer ran again in backward
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(plain.parameters(), ckpt.parameters()))


@pytest.mark.slow
def test_fsdp_two_ranks_agree_with_one_process_shard_the_state_and_resume_exactly(tiny_run_inputs, tmp_path):
    """FSDP2 on 2 gloo ranks against one plain process (same seed and global batch), 3 steps: the same rewards
    at every step and final weights within 1e-3, with half the per-rank bytes of weights, gradients and AdamW
    state; then 3 steps + --resume to 6 equals 6 straight steps, bit for bit. The flags take every FSDP path:
    the reference model (beta > 0, sharded too), the old-policy pass (--mu 2, --mini-batches 2), ranks with
    different numbers of groups and micro-batches (dynamic sampling, --micro-batch-size 3), gradient
    checkpointing."""
    d = tiny_run_inputs
    flags = [*_tiny_flags(d, tmp_path / "unused"), "--overlong-cache", "12", "--micro-batch-size", "3", "--eval-every", "3",
             "--algo", "dapo", "--beta", "0.04", "--mu", "2", "--mini-batches", "2"]
    fsdp = ["--fsdp", "--gradient-checkpointing", "--save-every", "3"]

    def metrics(out):
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(x)]
    _run_train(d, tmp_path / "one", *flags[flags.index("--overlong-cache"):], "--steps", "3")
    _torchrun(2, os.path.join(HERE, "train.py"), *flags, "--out", str(tmp_path / "two"), *fsdp, "--steps", "3")
    (m1, w1), (m2, w2) = ((metrics(tmp_path / n), _weights(tmp_path / n / "final")) for n in ("one", "two"))
    assert len(m1) == len(m2) == 3
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "sampling/groups_kept"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4) and a["kl"] == pytest.approx(b["kl"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert sum(r["sampling/groups_kept"] for r in m1) > 0 and all(r["kl"] > 0 for r in m1[1:])
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-3
    assert any(not torch.equal(_weights(d / "model")[k], w1[k]) for k in w1)
    ratio = m2[-1]["memory/state_bytes"] / m1[-1]["memory/state_bytes"]
    print(f"per-rank bytes of weights + gradients + AdamW state + reference: 1 process {m1[-1]['memory/state_bytes']}, "
          f"FSDP rank 0 of 2 {m2[-1]['memory/state_bytes']} ({ratio:.3f}x)")
    assert ratio <= 0.55
    # resume: the 3-step run's sharded checkpoint, continued to 6, against 6 straight steps
    _torchrun(2, os.path.join(HERE, "train.py"), *flags, "--out", str(tmp_path / "two"), *fsdp, "--steps", "6", "--resume")
    _torchrun(2, os.path.join(HERE, "train.py"), *flags, "--out", str(tmp_path / "six"), *fsdp, "--steps", "6")
    a, b = _weights(tmp_path / "two" / "final"), _weights(tmp_path / "six" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], w2[k]) for k in a)
    assert [r["loss"] for r in metrics(tmp_path / "two")] == [r["loss"] for r in metrics(tmp_path / "six")]
    assert sorted(os.listdir(tmp_path / "six" / "checkpoint")) == ["latest", "step-000006"]


def _thread_counting_driver(tmp_path):
    """A script that runs train.main, then writes how many gloo threads its rank still has to threads<RANK>."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import os, sys\nsys.path.insert(0, {HERE!r})\nimport train\ntrain.main(sys.argv[1:])\n"
        "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
        f"open(os.path.join({str(tmp_path)!r}, 'threads' + os.environ['RANK']), 'w').write(\n"
        "    str(sum('gloo' in n for n in names)))\n")
    return driver


@pytest.mark.slow
@pytest.mark.parametrize("adv_scale,extra", [
    ("group", ["--mini-batches", "2", "--mu", "2"]),
    # the objectives of variants.py: GSPO off-policy, the KL term with k2, the entropy bonus, truncated IS
    ("batch", ["--loss", "gspo", "--mu", "2", "--beta", "0.04", "--kl", "k2", "--entropy-coef", "0.01", "--tis-cap", "2"]),
])
@pytest.mark.slow
def test_torchrun_one_and_two_ranks_agree(tiny_run_inputs, tmp_path, adv_scale, extra):
    """1 rank and 2 ranks (gloo) with the same seed and global batch draw the same responses and rewards
    at every step, compute the same gradients and end with the same weights, up to floating-point
    reduction order (with --adv-scale batch, the std is that of the global batch, not of each rank's share;
    with mini-batches, each update holds the same groups). AdamW normalises a gradient's scale away, so the
    gradient norms are compared directly.

    And after train.main returns, each rank's process group is gone with its gloo threads: a process group
    that outlives destroy_process_group keeps them running into interpreter exit, where a rank can abort.
    Evaluation with 2 samples per problem, split over the ranks, logs the same numbers."""
    d = tiny_run_inputs
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        _torchrun(n, _thread_counting_driver(tmp_path) if n == 2 else os.path.join(HERE, "train.py"), *_tiny_flags(d, out),
                  "--steps", "3", "--overlong-cache", "12", "--micro-batch-size", "3", "--eval-every", "3", "--algo", "dapo",
                  "--adv-scale", adv_scale, "--grad-clip", "0", "--eval-samples", "2", *extra)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[n] = ([r for r in rows if "loss" in r], _weights(out / "final"), [r for r in rows if "eval/mean@2" in r])
    (m1, w1, e1), (m2, w2, e2) = runs[1], runs[2]
    assert len(m1) == len(m2) == 3
    assert [e["step"] for e in e1] == [e["step"] for e in e2] == [0, 3]
    for a, b in zip(e1, e2):  # the eval lines: mean@2 and its std, pass@1, pass@2, maj@2, truncation, length
        assert {"eval/mean@2_std", "eval/pass@2", "eval/maj@2", "eval/len_mean"} <= set(a) and "eval/accuracy" not in a
        assert a == pytest.approx(b, abs=1e-9)
    assert e1[0]["eval/len_mean"] != e1[1]["eval/len_mean"]  # the trained model samples other responses
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "sampling/groups_kept", "updates", "tokens/in_loss"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k  # float32 sums in another order
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert sum(r["sampling/groups_kept"] for r in m1) > 0       # something was trained on
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-3
    start = _weights(d / "model")
    assert any(not torch.equal(start[k], w1[k]) for k in w1)
    if os.path.isdir("/proc/self/task"):                      # Linux: gloo threads left per rank
        assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == ["0", "0"]


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_folder_is_refused_and_a_killed_run_leaves_no_lock(tiny_run_inputs, tmp_path, capsys):
    import checkpoint
    import parallel
    import train
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *_tiny_flags(tiny_run_inputs, out),
                               "--steps", "100000", "--eval-data", "", "--log-completions", "0"],
                              cwd=HERE, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # it has taken the lock once it writes its config
            if (out / "config.json").exists() and (out / "config.json").stat().st_size > 0:
                break
            assert holder.poll() is None, "the first run ended early"
            time.sleep(0.1)
        with pytest.raises(SystemExit) as e:
            train.main(_tiny_flags(tiny_run_inputs, out) + ["--steps", "1", "--resume"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: --out {out} is in use by another run (pid {holder.pid} holds"), err
    finally:
        holder.kill()  # SIGKILL: no cleanup ran, the kernel released the lock
        holder.wait()
    assert json.loads((out / "config.json").read_text())["steps"] == 100000  # the refused run wrote nothing
    lock = checkpoint.lock_folder(str(out), parallel.Dist("cpu"))
    assert lock is not None
    lock.close()


class _OtherRank:
    """Dist of rank 1 of 2 whose all-reduce adds rank 0's flag (1: it took the lock, 0: it was refused)."""
    master, world = False, 2

    def __init__(self, rank0_flag):
        self.rank0_flag = rank0_flag

    def sum(self, x):
        return x.double() + self.rank0_flag


def test_the_other_ranks_follow_rank_0s_lock_verdict(tmp_path, capsys):
    import checkpoint
    assert checkpoint.lock_folder(str(tmp_path / "free"), _OtherRank(1.0)) is None   # they hold no lock themselves
    assert not (tmp_path / "free").exists()
    with pytest.raises(SystemExit) as e:
        checkpoint.lock_folder(str(tmp_path / "busy"), _OtherRank(0.0))
    assert e.value.code == 2 and capsys.readouterr().err == ""  # rank 0 prints the one line


@pytest.mark.slow
def test_finished_fsdp_runs_exit_0_every_time_with_no_gloo_thread_left(tiny_run_inputs, tmp_path):
    """A finished 2-rank --fsdp run aborted at teardown now and then (rank 1, "terminate called without an
    active exception"): DTensor's caches kept the process group alive past destroy_process_group, and its gloo
    threads ran on into interpreter exit. Now the group is freed when train.main returns (no gloo thread on
    either rank: what decides the race, checked every time) and each of 3 runs exits 0 (_torchrun)."""
    d = tiny_run_inputs
    for i in range(3):
        for r in (0, 1):
            (tmp_path / f"threads{r}").unlink(missing_ok=True)
        _torchrun(2, _thread_counting_driver(tmp_path), "--model", str(d / "model"), "--data", str(d / "train.jsonl"),
                  "--eval-data", "", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--steps", "1",
                  "--fsdp", "--log-completions", "0", "--device", "cpu", "--out", str(tmp_path / f"run{i}"))
        assert [(tmp_path / f"threads{r}").read_text() for r in (0, 1)] == ["0", "0"], i
        assert (tmp_path / f"run{i}" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_resume_gives_the_same_weights_as_an_unbroken_run(tiny_run_inputs, tmp_path):
    _run_train(tiny_run_inputs, tmp_path / "full", "--steps", "6", "--save-every", "3")
    _run_train(tiny_run_inputs, tmp_path / "part", "--steps", "3", "--save-every", "3")
    _run_train(tiny_run_inputs, tmp_path / "part", "--steps", "6", "--save-every", "3", "--resume")
    a, b = _weights(tmp_path / "full" / "final"), _weights(tmp_path / "part" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = _weights(tiny_run_inputs / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_sigkill_then_resume_logs_each_step_once(tiny_run_inputs, tmp_path):
    import signal
    d, out = tiny_run_inputs, tmp_path / "killed"
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--model", str(d / "model"), "--data", str(d / "train.jsonl"),
           "--steps", "400", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12",
           "--save-every", "2", "--out", str(out), "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint.pt").exists():
        time.sleep(0.2)
    time.sleep(1.0)  # let it run on past the checkpoint, into a step or a save
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    target = ckpt["step"] + 2
    subprocess.run(cmd[:cmd.index("--steps") + 1] + [str(target)] + cmd[cmd.index("--steps") + 2:] + ["--resume"],
                   cwd=HERE, check=True, capture_output=True, timeout=300)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert steps == list(range(1, target + 1))


@pytest.mark.slow
def test_final_model_loads_and_generates(tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _run_train(tiny_run_inputs, tmp_path / "run", "--steps", "1", "--save-every", "1")
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    # the policy as the loop held it after its last step (checkpoint.pt's weights), and the base model it started from
    base, policy = (AutoModelForCausalLM.from_pretrained(tiny_run_inputs / "model") for _ in range(2))
    policy.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"])
    ids = torch.tensor([tok("2x+4=10\n")["input_ids"]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out, policy.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id))
    with torch.no_grad():  # the log-probs of that output: the trained policy's, not the base model's
        logp = [torch.log_softmax(m(out).logits[0, :-1], -1).gather(-1, out[0, 1:, None]) for m in (model, policy, base)]
    assert torch.allclose(logp[0], logp[1], atol=1e-6) and not torch.allclose(logp[0], logp[2], atol=1e-3)


def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # save step 1; the save of step 2 writes half its bytes and the process dies: step 1 still loads, whole
    import io

    import checkpoint

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
    assert ckpt["step"] == 1 and all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())


def test_unreadable_checkpoint_gets_one_clear_line(tiny_run_inputs, tmp_path, capsys):
    """checkpoint.CheckpointError (checkpoint.py raises its own, not data.InputError) reaches the same one line."""
    import train
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "out"), "--steps", "1", "--resume"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "checkpoint.pt: not a usable checkpoint" in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# curves.py, lora.py and the optional integrations: the no-signal warning, --report-to, LoRA
# ---------------------------------------------------------------------------------------------

def _signal_row(step, correct, zero_std, kept=None, truncated=0.0):
    row = {"step": step, "reward/correct": correct, "reward/frac_zero_std": zero_std, "len/truncated_frac": truncated}
    return row if kept is None else {**row, "sampling/groups_kept": kept, "sampling/rounds": 4.0}


def test_no_learning_signal_is_said_once_with_its_likely_causes():
    import train
    grpo_args, dapo_args = train.parse_args(["--algo", "grpo"]), train.parse_args(["--algo", "dapo", "--max-rounds", "4"])
    # GRPO: every group's rewards equal (all advantages 0) at steps 1 and 2: said once; nothing right in 3 steps
    check = curves.SignalCheck(grpo_args)
    said = [check(_signal_row(s, 0.0, 1.0, truncated=1.0)) for s in (1, 2)]
    assert len(said[0]) == 1 and said[1] == [] and check.silent
    msg = said[0][0]
    assert msg.startswith("warning: no learning signal at step 1: every group's 8 rewards are equal") and "\n" not in msg
    for cause in ("Answer:", "--prompt-template", "--reward verifier", "--max-new-tokens 40", "len/truncated_frac 1.00"):
        assert cause in msg, cause
    third = check(_signal_row(3, 0.0, 1.0))
    assert len(third) == 1 and "no sample of the first 3 steps scored above 0" in third[0] and check(_signal_row(4, 0, 1)) == []
    # DAPO: dynamic sampling kept nothing in --max-rounds rounds; a step that kept groups trains (not silent)
    check = curves.SignalCheck(dapo_args)
    assert check(_signal_row(1, 0.25, 0.5, kept=3.0)) == [] and not check.silent
    said = check(_signal_row(2, 1.0, 1.0, kept=0.0))
    assert len(said) == 1 and "dynamic sampling kept no group in --max-rounds 4 rounds" in said[0] and check.silent
    assert "every sample is right" in said[0]
    assert check(_signal_row(3, 0.5, 1.0, kept=0.0)) == []      # once a run; and some samples scored: no "none right"
    mixed = curves.SignalCheck(grpo_args)(_signal_row(1, 0.5, 1.0))
    assert len(mixed) == 1 and "--group-size" in mixed[0]       # groups all right or all wrong, half of them right


@pytest.mark.slow
def test_a_run_without_learning_signal_says_so_on_stderr(tiny_run_inputs, tmp_path, capsys):
    # the verifier never credits the random model: every group all wrong, dynamic sampling keeps none, 3 steps
    # (test_end_to_end_changes_weights_and_writes_metrics: a run that learns prints none of this)
    import train
    d = tiny_run_inputs
    train.main(["--model", str(d / "model"), "--data", str(d / "train.jsonl"), "--prompts-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "4", "--steps", "3", "--max-rounds", "1", "--out", str(tmp_path), "--device", "cpu",
                "--log-completions", "0"])
    lines = [x for x in capsys.readouterr().err.splitlines() if "no learning signal" in x]
    said = ["step 1: dynamic sampling kept no group", "step 3: no sample of the first 3 steps scored"]
    assert len(lines) == 2 and all(s in x for s, x in zip(said, lines)), lines


def _logged_scalars(out):
    """{(key, step): value} of every metrics.jsonl row, eval rows too: what --report-to must send on."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy" in r for r in rows) and any("loss" in r for r in rows)
    return {(k, r["step"]): v for r in rows for k, v in r.items() if k != "step"}


def _wandb_history(run_file):
    """{(key, step): value} of an offline run's history, read from its .wandb file: W&B's leveldb-style log
    (a 7-byte file header, records of 4-byte crc, 2-byte length, 1-byte type in 32 KiB blocks) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb
    buf, pos, part, out, config = run_file.read_bytes(), 7, b"", {}, {"exit": False}
    while pos + 7 <= len(buf):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        n, kind = int.from_bytes(buf[pos + 4:pos + 6], "little"), buf[pos + 6]
        if pos + 7 + n > len(buf):  # a record still being written
            break
        part, pos = part + buf[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out.update({(k, rec.history.step.num): v for k, v in items.items() if not k.startswith("_")})
            if rec.WhichOneof("record_type") == "run":
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            config["exit"] |= rec.WhichOneof("record_type") == "exit"  # the run's last record
    return out, config


@pytest.mark.slow
def test_report_to_tensorboard_holds_the_metrics_rows(tiny_run_inputs, tmp_path):
    pytest.importorskip("tensorboard", reason="--report-to tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _one_step(tiny_run_inputs, tmp_path / "run", "--report-to", "tensorboard", "--run-name", "tb")
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "tb"))
    acc.Reload()
    got = {(k, e.step): e.value for k in acc.Tags()["scalars"] for e in acc.Scalars(k)}
    want = _logged_scalars(tmp_path / "run")
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)  # float32 there
    assert '"run_name": "tb"' in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_report_to_wandb_offline_holds_the_metrics_rows_and_config(tiny_run_inputs, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="--report-to wandb needs the wandb package")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _one_step(tiny_run_inputs, tmp_path / "run", "--report-to", "wandb")
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.time() + 60
    while not (history := _wandb_history(run_file))[1]["exit"] and time.time() < deadline:
        time.sleep(0.2)  # wandb's service process may still be writing the file after run.finish() returns
    got, config = history
    assert got == _logged_scalars(tmp_path / "run")
    assert config["run_name"] == "run" and config["reward"] == ["test_grpo:has_x"] and config["world_size"] == 1


def test_report_to_a_missing_package_is_one_line(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    import train
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as e:
        train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1", "--report-to", "wandb"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "error: --report-to wandb: the wandb package is not installed (pip install wandb)"


def _lora_model(d, r=4):
    """The tiny model with rank-r adapters whose B is random (peft starts B at 0: the adapters would be a no-op)."""
    import lora
    path, tok, model = data.load_model(str(d / "model"))
    config = lora.add_adapters(model, r, 2.0 * r, lora.TARGETS, path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tok, model, config


def test_lora_trains_only_adapters_and_its_reference_is_the_base_model(tiny_run_inputs):
    pytest.importorskip("peft", reason="--lora-r needs peft")
    import lora
    tok, model, _ = _lora_model(tiny_run_inputs)
    _, _, base = data.load_model(str(tiny_run_inputs / "model"))
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) == 2 * 7 * 2                                       # A and B of 7 projections in 2 layers
    encode, eos = data.PromptFormatter(tok), data.end_ids(tok, model)
    roll = sample_groups(model, [encode(r["prompt"]) for r in builtin.sample_problems(3, 2, True)], 2, 8, eos,
                         tok.pad_token_id, temperature=1.0, generator=torch.Generator().manual_seed(1))
    rows = slice(0, 6)
    logp, _, mask = rollout_logprobs(model, roll, rows, 1.0)
    (logp * mask).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == adapters                                                # every adapter, nothing else
    with torch.no_grad():
        with lora.adapters_off(model):
            ref = rollout_logprobs(model, roll, rows, 1.0)[0]
        again = rollout_logprobs(model, roll, rows, 1.0)[0]
        want = rollout_logprobs(base, roll, rows, 1.0)[0]
    assert torch.allclose(ref, want, atol=1e-6)                             # the reference is the base model
    assert (logp.detach() - want).abs().max() > 1e-3                        # which the adapted policy is not
    assert torch.equal(again, logp.detach()) and {n for n, p in model.named_parameters() if p.requires_grad} == adapters


def test_lora_merged_final_is_base_plus_adapter_and_the_adapter_loads_alone(tiny_run_inputs, tmp_path):
    peft = pytest.importorskip("peft", reason="--lora-r needs peft")
    from transformers import AutoModelForCausalLM

    import lora
    tok, model, config = _lora_model(tiny_run_inputs)
    model.save_pretrained(tmp_path / "final", state_dict=lora.merged_state_dict(model))
    lora.save_adapter(model, config, str(tmp_path / "adapter"))
    merged, base = _weights(tmp_path / "final"), _weights(tiny_run_inputs / "model")
    sd, adapted = model.state_dict(), 0
    for k in base:
        prefix = k.removesuffix(".weight")
        if f"{prefix}.lora_A.default.weight" in sd:                         # W + alpha / r * B A, by hand
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
        alone = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_run_inputs / "model"),
                                               tmp_path / "adapter")(input_ids=ids).logits
    assert torch.allclose(plain, want, atol=1e-5) and torch.allclose(alone, want, atol=1e-5)


def test_lora_flags_fail_with_one_line(tiny_run_inputs, tmp_path, capsys, monkeypatch):
    import importlib.util

    import train
    flags = [*_tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1"]
    for extra, message in ((["--lora-r", "4", "--fsdp"], "--lora-r with --fsdp is not supported"),
                           (["--lora-r", "4", "--rollout", "vllm"], "--lora-r with --rollout vllm is not supported"),
                           (["--lora-r", "-1"], "--lora-r must be >= 0"),
                           (["--lora-r", "4", "--lora-target-modules", "wq,wk"], "--lora-target-modules wq,wk: ")):
        if "wq,wk" in extra and importlib.util.find_spec("peft") is None:  # the others need no peft
            continue
        with pytest.raises(SystemExit) as e:
            train.main([*flags, *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(SystemExit) as e:
        train.main([*flags, "--lora-r", "4"])
    assert capsys.readouterr().err.strip() == "error: --lora-r: the peft package is not installed (pip install peft)"
    assert train.parse_args(["--lora-r", "8"]).lora_alpha == 16 and train.parse_args(["--lora-r", "8"]).lr == 2e-3


@pytest.mark.slow
def test_lora_run_saves_state_resumes_exactly_and_two_ranks_agree(tiny_run_inputs, tmp_path):
    import importlib.util
    pytest.importorskip("peft", reason="--lora-r needs peft")
    from transformers import AutoModelForCausalLM
    d = tiny_run_inputs
    lora_flags = ["--lora-r", "4", "--beta", "0.04", "--algo", "grpo", "--save-every", "1", "--eval-every", "5"]
    _run_train(d, tmp_path / "full", *lora_flags, "--steps", "2")
    _run_train(d, tmp_path / "part", *lora_flags, "--steps", "1")
    _run_train(d, tmp_path / "part", *lora_flags, "--steps", "2", "--resume")
    a, b = _weights(tmp_path / "full" / "final"), _weights(tmp_path / "part" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)                          # merged finals of resumed and straight runs
    start = _weights(d / "model")
    assert any(not torch.equal(start[k], a[k]) for k in a) and a.keys() == start.keys()
    assert (tmp_path / "full" / "adapter" / "adapter_model.safetensors").exists()
    # AdamW holds the adapters alone; memory/state_bytes: all weights once, the adapters' gradients and two moments
    ckpt = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    n_base = sum(v.numel() for k, v in start.items() if k != "lm_head.weight")   # lm_head is tied to the embeddings
    n_adapter = sum(v.numel() for k, v in ckpt["model"].items() if ".lora_" in k)
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["optimizer"]["param_groups"][0]["params"]) == 2 * 14
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert rows[-1]["memory/state_bytes"] == 4 * (n_base + n_adapter) + 12 * n_adapter + 4 * 28  # + AdamW's step counts
    assert rows[-1]["memory/state_bytes"] < 0.4 * 20 * n_base              # full fine-tuning + a reference copy: 20 B each
    assert rows[-1]["kl"] > 0
    # 2 gloo ranks (DDP over the adapters) end where one process does; rank 0 alone reports to tensorboard
    tb = ["--report-to", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    _torchrun(2, os.path.join(HERE, "train.py"), *_tiny_flags(d, tmp_path / "w2"), *lora_flags, "--steps", "2", *tb)
    w2 = _weights(tmp_path / "w2" / "final")
    assert max((a[k] - w2[k]).abs().max().item() for k in a) <= 1e-4
    assert len(list((tmp_path / "w2" / "tensorboard" / "w2").glob("events.out.tfevents.*"))) == (1 if tb else 0)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "w2" / "final").config.num_hidden_layers == 2


# ---------------------------------------------------------------------------------------------
# bench.py
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_slots_section_measures_both_sides(capsys, monkeypatch):
    """bench.py --only slots, shrunk: memory in fresh processes at N and all rows, continuous vs static batches."""
    import bench_rollout
    monkeypatch.setattr(bench_rollout, "SLOTS_SETUP", dict(B=6, G=2, T=24, vocab=64, ends=8))
    bench_rollout.bench_slots("cpu", 1, small=4)
    out = capsys.readouterr().out
    assert "rollout memory, peak RSS of a fresh process" in out and "all 12 rows" in out
    assert "the same response ids at N = 4" in out and "continuous / static tokens/s" in out


# ---------------------------------------------------------------------------------------------
# ablate.py: the rows, and the table built from metrics
# ---------------------------------------------------------------------------------------------

def test_ablation_rows_add_one_fix_each_and_end_at_dapo():
    import ablate
    import train
    first = train.parse_args(ablate.row_flags(0))
    assert (first.beta, first.eps_high, first.reduction, first.dynamic_sampling, first.overlong_filter,
            first.overlong_penalty) == (0.0, 0.2, "sequence", False, False, False)
    last = train.parse_args(ablate.row_flags(len(ablate.ROWS) - 1))
    assert {**vars(last), "algo": None} == {**vars(train.parse_args(["--algo", "dapo"])), "algo": None}
    changed = [sum(vars(train.parse_args(ablate.row_flags(i)))[k] != vars(train.parse_args(ablate.row_flags(i - 1)))[k]
                   for k in vars(first) if k != "algo") for i in range(1, len(ablate.ROWS))]
    assert changed == [1] * (len(ablate.ROWS) - 1)
    # a --variant row is DAPO plus its flags
    rows = ablate.ROWS + [ablate.variant_row("+ CISPO=--loss cispo --tis-cap 2")]
    v = train.parse_args(ablate.row_flags(len(rows) - 1, rows))
    assert {**vars(v), "algo": None, "loss": None, "tis_cap": None, "eps_low": None, "eps_high": None} == \
        {**vars(last), "algo": None, "loss": None, "tis_cap": None, "eps_low": None, "eps_high": None}
    assert (v.loss, v.tis_cap, v.eps_high) == ("cispo", 2.0, 0.28)  # ROWS set --eps-high 0.28 on the command line
    with pytest.raises(SystemExit):
        ablate.variant_row("--loss cispo")


def test_ablation_table_and_curves_from_metrics():
    import ablate
    # one run: eval 0.5 at step 0, two steps of 100 samples, eval 0.95 at step 2
    run = [{"step": 0, "eval/accuracy": 0.5},
           {"step": 1, "loss": 0.0, "samples": 100, "entropy": 0.2, "len/mean": 10.0, "len/truncated_frac": 0.5,
            "clip/low_frac": 0.01, "clip/high_frac": 0.0},
           {"step": 2, "loss": 0.0, "samples": 200, "entropy": 0.1, "len/mean": 8.0, "len/truncated_frac": 0.0,
            "clip/low_frac": 0.03, "clip/high_frac": 0.001},
           {"step": 2, "eval/accuracy": 0.95}]
    assert ablate.curve(run, "eval/accuracy") == [(0, 0.5), (200, 0.95)]
    assert ablate.samples_to_reach(run, 0.9) == 200 and ablate.samples_to_reach(run, 0.99) is None
    md = ablate.table({name: [run, run] for name, _, _ in ablate.ROWS}, budget=200)
    first = md.splitlines()[2]
    assert first.startswith("| naive GRPO | 0.950 ± 0.000 | 0.500 ± 0.000 | 200 (2/2 seeds) | 0.1500 ± 0.0000 | 9.0 ± 0.0 |"
                            " 0.250 ± 0.000 | 2.00% / 0.05% | 2 |")


def test_experiment_arms_change_only_their_fix():
    """Each experiment's arms are the baseline plus the one fix they test (all flags parse)."""
    import ablate
    import train
    fixes = {"dynamic-sampling": [{"dynamic_sampling"}],
             "overlong-shaping": [{"overlong_filter"}, {"overlong_filter", "overlong_penalty"}], "token-level-loss": [{"reduction"}],
             "clip-higher": [{"eps_high"}], "clip-higher-random-reward": [{"eps_high"}]}
    assert [e.name for e in ablate.EXPERIMENTS] == list(fixes)
    for e in ablate.EXPERIMENTS:
        base = vars(train.parse_args([*e.flags, *e.arms[0][1]]))
        assert (base["beta"], base["eps_high"], base["reduction"], base["dynamic_sampling"], base["overlong_filter"],
                base["overlong_penalty"]) == (0.0, 0.2, "sequence", False, False, False)   # naive GRPO
        changed = [{k for k, v in vars(train.parse_args([*e.flags, *flags])).items() if v != base[k]} for _, flags in e.arms[1:]]
        assert changed == fixes[e.name], e.name


def test_experiment_measures_by_hand():
    import ablate
    c = lambda resp, trunc=False, prompt="3x+5=x+9\n", step=1: {"prompt": prompt, "response": resp, "truncated": trunc,  # noqa: E731
                                                               "length": len(resp), "step": step}
    assert ablate.solution("3x+5=x+9\n") == 2 and ablate.solution("2x-4=-10") == -3 and ablate.solution("4x+1=2x-5\n") == -3
    assert ablate.right(c("3x-x=9-5\n2x=4\nx=4/2\nAnswer: 2")) and not ablate.right(c("x=9/3\nAnswer: 3"))
    assert ablate.on_the_way(c("3x-x=9-5\n2x=4\nx=4/2\nche", True))          # the verbose solution, cut
    assert ablate.on_the_way(c("3x-x=9-5\n2x=", True)) and not ablate.on_the_way(c("3x-x=9-5\n2x=", False))
    assert not ablate.on_the_way(c("3x-x=9-5\n2x=5", True))                     # a wrong step
    assert ablate.repeats(c("x=1\nx=2\nx=1")) and not ablate.repeats(c("x=1\n\nx=2"))
    cs = [c("Answer: 1"), c("Answer: 2"), c("Answer: 1"), c("Answer: 5", prompt="2x=4\n")]
    assert ablate.distinct_answers(cs) == 1.5                                    # 2 answers in one group, 1 in the other
    assert ablate.share(ablate.right)(cs) == 0.25 and ablate.share(ablate.right, lambda c: False)(cs) is None
    assert ablate.mean_length(lambda c: c["prompt"] == "2x=4\n")(cs) == 9
    run = ablate.Run({"prompts_per_step": 16, "steps": 2, "group_size": 4},
                     [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "loss": 0, "samples": 64, "reward/frac_zero_std": 0.25},
                      {"step": 2, "loss": 0, "samples": 192, "reward/frac_zero_std": 0.5, "sampling/groups_kept": 16.0},
                      {"step": 2, "eval/accuracy": 0.75}], cs[:2] + [{**cs[3], "step": 2}])
    assert ablate.informative_groups(run) == [(1, 12.0), (2, 16.0)]             # 16 x (1 - 0.25), then what was kept
    acc = lambda r: ablate.curve(r.metrics, "eval/accuracy")  # noqa: E731
    assert ablate.equal_budget(run) == 128 and ablate.at_samples(acc, ablate.equal_budget)(run) == 0.5
    assert ablate.at_samples(acc, lambda r: 192)(run) == 0.75 and ablate.final("eval/accuracy")(run) == 0.75
    assert ablate.by_step(ablate.mean_length(lambda c: True))(run) == [(1, 9), (2, 9)]
    assert ablate.end(ablate.logged("reward/frac_zero_std"), k=1)(run) == 0.5
    assert ablate.over_run(ablate.informative_groups)(run) == 14.0
    d, se = ablate.difference([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert d == 1.0 and se == pytest.approx(math.sqrt(1 / 3 + 1 / 3))          # sd 1 on each side, 3 seeds
    assert ablate.difference([1.0], [2.0, 3.0]) == (1.5, None)
    random.seed(0)
    coins = [ablate.random_reward("x", "1") for _ in range(2000)]
    random.seed(0)
    assert coins == [ablate.random_reward("y", "2") for _ in range(2000)] and 0.45 < sum(coins) / 2000 < 0.55


def test_experiment_table_says_what_is_beyond_noise():
    import ablate
    exp = ablate.Experiment("x", "claim", (), (("off", ()), ("on", ("--dynamic-sampling",))),
                            (("acc", lambda r: r.config["acc"]), ("len", lambda r: r.config["len"])), ())
    runs = {"off": [ablate.Run({"acc": a, "len": n}, [], []) for a, n in ((0.5, 20), (0.6, 30), (0.7, 25))],
            "on": [ablate.Run({"acc": a, "len": n}, [], []) for a, n in ((0.9, 21), (0.8, 31), (1.0, 26))]}
    md = ablate.experiment_table(exp, runs).splitlines()
    assert md[0] == "| measure | off | on | on − off (± 2 SE) |"
    assert md[2] == "| acc | 0.600 ± 0.100 | 0.900 ± 0.100 | +0.3 ± 0.16: **beyond noise** |"  # 2 SE = 2 sqrt(.01/3 + .01/3)
    assert md[3] == "| len | 25.0 ± 5.0 | 26.0 ± 5.0 | +1 ± 8.2: within noise |"
    assert md[-1] == "mean ± sd over 3 seeds per arm."
    one = {k: v[:1] for k, v in runs.items()}
    assert "one seed: no spread" in ablate.experiment_table(exp, one)


@pytest.mark.slow
def test_experiments_run_train_and_write_a_table_per_experiment(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    """ablate.py's experiments drive train.main: each arm x seed a run, then RESULTS/NAME.md from their logs."""
    import ablate
    d = tiny_run_inputs
    monkeypatch.syspath_prepend(str(d))
    exp = ablate.Experiment(
        "tiny", "claim", ablate.NAIVE + tuple(_tiny_flags(d, "unused")[:-4])
        + ("--steps", "2", "--eval-every", "2", "--eval-size", "2", "--log-completions", "999"),
        (("off", ()), ("on: dynamic sampling", ("--dynamic-sampling",))),
        (("groups with a gradient", ablate.over_run(ablate.informative_groups)),
         ("responses", lambda r: len(r.completions))), (("length", "step", ablate.by_step(ablate.mean_length(lambda c: True))),))
    monkeypatch.setattr(ablate, "EXPERIMENTS", (exp,))
    ablate.main(["--seeds", "0", "1", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")])  # a new folder
    md = (tmp_path / "res" / "tiny.md").read_text()
    assert "| responses | 32.0 ± 0.0 | 32.0 ± 0.0 |" in md and "mean ± sd over 2 seeds per arm." in md  # 2 steps x 4 x 4, all logged
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == \
        ["off-seed0", "off-seed1", "on-dynamic-sampling-seed0", "on-dynamic-sampling-seed1"]
    metrics = ablate.load_run(str(tmp_path / "runs" / "tiny" / "on-dynamic-sampling-seed1")).metrics
    assert all("sampling/groups_kept" in r for r in metrics if "loss" in r)
    assert not any("sampling/groups_kept" in r for r in ablate.load_run(str(tmp_path / "runs" / "tiny" / "off-seed1")).metrics)
    assert ("tiny.png" in os.listdir(tmp_path / "res")) == ("figure:" in capsys.readouterr().out)
    with pytest.raises(SystemExit):
        ablate.main(["--train-flags", "--mu 2"])                              # a --rows flag without --rows


def test_stuttered_demonstrations_repeat_steps_never_the_answer():
    """builtin.stuttered (the token-level experiment's variant): each step line 1 + 0-3 times, the answer once."""
    sol = builtin.solve_steps("3x+5=x+9", 2, verbose=True)                    # 4 step lines, then 'Answer: 2'
    assert builtin.stuttered(sol, random.Random(0), 0.0) == sol
    for seed in range(20):
        out = builtin.stuttered(sol, random.Random(seed), 1.0).split("\n")
        assert out[-1] == "Answer: 2" and out.count("Answer: 2") == 1 and verify("\n".join(out), "2") == 1.0
        assert [x for i, x in enumerate(out) if i == 0 or x != out[i - 1]] == sol.split("\n")  # runs of the same lines, in order
        assert all(2 <= out.count(x) <= 4 for x in sol.split("\n")[:-1])
    demos = builtin.variant_demos(builtin.Variant(steps=4, batch_size=50), builtin.BaseModelConfig())
    stutters = sum(len(set(r.split("\n"))) < len(r.split("\n")) for _, r in demos)
    assert len(demos) == 200 and 0.4 < stutters / 200 < 0.9                  # 1 - 0.7^k of k-step solutions (k 1-4)
    assert not any(builtin.is_heldout(p.strip()) for p, _ in demos)


def test_variant_key_and_build(tmp_path, monkeypatch):
    """A variant's key changes with its fields, its code and the base recipe; editing its code leaves the
    base model's key (and so the shipped weights) alone. variant_model builds once, then finds the folder."""
    with open(builtin.__file__) as fh:
        src = fh.read()
    v, cfg = builtin.Variant(), builtin.BaseModelConfig()
    key = builtin.variant_key(v, cfg, src)
    for f in dataclasses.fields(v):
        x = getattr(v, f.name)
        assert builtin.variant_key(dataclasses.replace(v, **{f.name: x + 1 if isinstance(x, int) else x / 2}), cfg, src) != key
    assert builtin.variant_key(v, dataclasses.replace(cfg, seed=1), src) != key
    for old, new in (("[line] * (1 + (rng.randint(1, 3)", "[line] * (1 + (rng.randint(1, 2)"),   # stuttered
                     ("rng = random.Random(v.seed + 7)", "rng = random.Random(v.seed + 8)"),      # variant_demos
                     ("lr=v.lr, weight_decay=0.0, betas=(0.9, 0.98))\n    model.train()\n    for k",
                      "lr=v.lr, weight_decay=0.0, betas=(0.9, 0.99))\n    model.train()\n    for k")):  # fine_tune
        assert src.count(old) == 1, old
        assert builtin.variant_key(v, cfg, src.replace(old, new)) != key, old
        assert builtin.recipe_key(cfg, src.replace(old, new)) == builtin.recipe_key(cfg, src), old
    tiny = builtin.BaseModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, sft_steps=2, sft_batch_size=8)
    small, logs = builtin.Variant(steps=2, batch_size=4), []
    folder = builtin.variant_model(small, tiny, str(tmp_path), log=lambda *a, **k: logs.append(a))
    assert folder == str(tmp_path / f"variant-{builtin.variant_key(small, tiny)}") and len(logs) == 3  # base (2 lines), variant
    _, _, base = data.load_model(str(tmp_path / f"base-{builtin.recipe_key(tiny)}"))
    _, tok, model = data.load_model(folder)
    assert tok.eos_token_id == 1 and any(not torch.equal(p, q) for p, q in zip(base.parameters(), model.parameters()))
    assert builtin.variant_model(small, tiny, str(tmp_path), log=lambda *a, **k: logs.append(a)) == folder and len(logs) == 3
    # an experiment on a variant runs train.py on its folder with the built-in task's learning rate
    import ablate
    import train
    monkeypatch.setattr(builtin, "variant_model", lambda v: folder)
    exp = next(e for e in ablate.EXPERIMENTS if e.name == "token-level-loss")
    args = train.parse_args([*exp.model_flags(), *exp.flags])
    assert (args.model, args.lr, args.max_new_tokens, args.steps) == (folder, train.BUILTIN_DEFAULTS["lr"], 96, 16)
    assert ablate.Experiment("x", "", ("--steps", "2"), (), (), ()).model_flags() == ()

# ---------------------------------------------------------------------------------------------
# vllm_rollout.py: --rollout vllm, run for real on vLLM's CPU backend (vllm-cpu, in its own venv, see the
# README: .venv-vllm/bin/python -m pytest -q test_grpo.py -m vllm); skipped with the reason without vllm
# ---------------------------------------------------------------------------------------------

def test_rollout_flags_tis_default_and_missing_vllm_is_one_line(tiny_run_inputs, tmp_path, capsys, monkeypatch):
    import train
    assert (train.parse_args([]).rollout, train.parse_args([]).tis_cap) == ("hf", 0.0)
    assert train.parse_args(["--rollout", "vllm"]).tis_cap == train.VLLM_TIS_CAP == 2.0  # TIS on with an engine
    assert train.parse_args(["--rollout", "vllm", "--tis-cap", "0"]).tis_cap == 0.0       # unless switched off
    for bad in (["--vllm-gpu-memory-utilization", "0"], ["--rollout", "sglang"]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        assert e.value.code == 2
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(SystemExit) as e:
        train.main([*_tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1", "--rollout", "vllm"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: --rollout vllm needs vLLM: pip install")


def test_full_weights_gathers_one_tensor_at_a_time_under_fsdp(monkeypatch):
    # FSDP2 over a one-rank gloo group in this process: the stream yields each full tensor (equal to the
    # unsharded model's) only when it is read, so the engine never sees a second whole copy of the model
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import parallel
    import vllm_rollout
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    gathers, real = [], DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: gathers.append(self.shape) or real(self, **kw))
    ddp = parallel.Dist("cpu", fsdp=True)
    try:
        parallel.wrap(model, ddp, fsdp=True)
        stream, seen = vllm_rollout.full_weights(model, torch.bfloat16), {}
        for i, (name, t) in enumerate(stream):
            assert len(gathers) == i + 1                     # gathered as read, one tensor in flight
            assert type(t) is torch.Tensor and t.dtype == torch.bfloat16 and torch.equal(t, plain[name].bfloat16())
            seen[name] = t
        assert set(seen) == set(plain)
    finally:
        ddp.close()


class _RecordingLLM:
    """Stands in for vllm.LLM where the real one cannot run here (sleep mode needs CUDA): records the calls."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [(n, t.dtype) for n, t in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.mark.parametrize("cuda", [True, False])
def test_engine_sleeps_for_the_update_and_wakes_weights_then_kv_cache(cuda):
    import vllm_rollout
    engine = object.__new__(vllm_rollout.Engine)
    engine.llm, engine.cuda, engine.dtype, engine.asleep = _RecordingLLM(), cuda, torch.bfloat16, False
    model = _tiny("qwen2", torch.float32)
    engine.sleep()
    engine.push(model)
    reload = ("reload_weights", [(n, torch.bfloat16) for n in model.state_dict()])
    want = [("sleep", 2), ("wake_up", ["weights"]), reload, ("wake_up", ["kv_cache"])] if cuda else [reload]
    # then the prefix cache goes, on CPU too: no prompt is decoded on K/V the old weights computed
    assert engine.llm.calls == [*want, ("reset_prefix_cache",)] and not engine.asleep
    engine.llm.reset_prefix_cache = lambda: False     # vLLM could not drop it: an error, never stale K/V
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.push(model)


@pytest.fixture(scope="session")
def vllm_env():
    """Skips where vllm cannot be imported; a 1 GiB KV cache per engine on CPU (the default is 30% of memory)."""
    pytest.importorskip("vllm", reason="vllm cannot be imported (install: see the README's --rollout vllm)")
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    if old is None:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A 0.53M Qwen2 with head_dim 64 (vLLM's CPU attention has no kernel for head_dim 8 or 16), random
    weights scaled up so greedy responses vary, and the built-in tokenizer: (folder, model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    d = tmp_path_factory.mktemp("vllm") / "model"
    tok = builtin.make_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        tie_word_embeddings=True, initializer_range=0.2)).eval()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def vllm_engine(vllm_env, vllm_model):
    import vllm_rollout
    engine = vllm_rollout.Engine(str(vllm_model[0]), "cpu", bf16=False, seed=0, gpu_memory_utilization=0.05)
    yield engine
    engine.close()                         # and the one-rank process group the engine made in this process


VLLM_PROMPTS = [[12, 5, 20, 9], [7, 30, 14, 3, 25, 11, 16, 8, 2], [22]]
# prompts as real runs have them: a shared 400-token instruction (3 full KV blocks of vLLM's 128 tokens,
# which its prefix cache reuses across requests), then each prompt's own tokens
VLLM_INSTRUCTION = [int(t) for t in torch.randint(3, 33, (400,), generator=torch.Generator().manual_seed(5))]
VLLM_LONG_PROMPTS = [VLLM_INSTRUCTION + p for p in VLLM_PROMPTS]


def _same_rollout(a: Rollout, b: Rollout, atol: float) -> None:
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert a.lengths.tolist() == b.lengths.tolist() and a.truncated.tolist() == b.truncated.tolist()
    assert torch.equal(a.mask, b.mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.vllm
def test_vllm_greedy_equals_sample_groups_on_the_same_weights(vllm_engine, vllm_model):
    model, T, eos = vllm_model[1], 24, [30, 32]
    hf = sample_groups(model, VLLM_PROMPTS, 2, T, eos, 0, 0.0)
    engine = vllm_engine.sample_groups(model, VLLM_PROMPTS, 2, T, eos, 0, 0.0)
    # greedily, token 30 ends prompt 0 at its 5th token and prompt 2 at its 2nd; prompt 1 runs to T
    assert engine.lengths.tolist() == [5, 5, T, T, 2, 2] and engine.truncated.tolist() == [False] * 2 + [True] * 2 + [False] * 2
    _same_rollout(engine, hf, atol=1e-4)                     # float32 both sides: other kernels, same tokens
    # a budget of 5: prompt 0's end token is its last one, which ends it (not truncated); prompt 1 is cut
    five = vllm_engine.sample_groups(model, VLLM_PROMPTS, 1, 5, eos, 0, 0.0)
    assert five.lengths.tolist() == [5, 5, 2] and five.truncated.tolist() == [False, True, False]
    _same_rollout(five, sample_groups(model, VLLM_PROMPTS, 1, 5, eos, 0, 0.0), atol=1e-4)
    # prompts of 3+ KV blocks sharing a 400-token prefix (the second call reads the first's cached blocks)
    for _ in range(2):
        long = vllm_engine.sample_groups(model, VLLM_LONG_PROMPTS, 2, T, eos, 0, 0.0)
        _same_rollout(long, sample_groups(model, VLLM_LONG_PROMPTS, 2, T, eos, 0, 0.0), atol=1e-4)


@pytest.mark.vllm
def test_vllm_samples_follow_each_prompts_seed_with_the_trainers_logprobs(vllm_engine, vllm_model):
    model, G, T, temp = vllm_model[1], 3, 16, 0.7
    gens = lambda idx: [data.prompt_generator(0, j) for j in idx]  # noqa: E731
    prompts = VLLM_LONG_PROMPTS                                  # 400 shared tokens, then each prompt's own
    batch = vllm_engine.sample_groups(model, prompts, G, T, [1], 0, temp, generator=gens([0, 1, 2]))
    alone = vllm_engine.sample_groups(model, prompts[1:2], G, T, [1], 0, temp, generator=gens([1]))
    t = alone.response_ids.shape[1]
    assert batch.response_ids[G:2 * G, :t].tolist() == alone.response_ids.tolist()  # the batch does not matter
    assert len({tuple(r) for r in batch.response_ids.tolist()}) == G * len(prompts)  # G different samples each
    other = vllm_engine.sample_groups(model, prompts[1:2], G, T, [1], 0, temp, generator=gens([7]))
    assert other.response_ids.tolist() != alone.response_ids.tolist()               # another seed, other samples
    # the sampled tokens' log-probs are those of softmax(logits / temperature), as the trainer recomputes them
    trainer, _, valid = rollout_logprobs(model, batch, slice(0, G * len(prompts)), temp)
    torch.testing.assert_close(batch.logprobs, trainer * valid, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_vllm_push_after_updates_gives_hf_greedy_on_the_trained_weights(vllm_engine, vllm_model):
    import copy
    # prompts sharing 3 full KV blocks: the stale call below leaves them in vLLM's prefix cache, computed
    # by the old weights, so a push that kept the cache would decode the new weights on old K/V
    model, T, prompts = copy.deepcopy(vllm_model[1]), 24, VLLM_LONG_PROMPTS
    before = sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(3):  # a few large updates: push the model towards other continuations
        model(input_ids=torch.tensor([prompts[1]]), labels=torch.tensor([prompts[1][::-1]])).loss.backward()
        opt.step()
        opt.zero_grad()
    after = sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    assert after.response_ids.tolist() != before.response_ids.tolist()
    stale = vllm_engine.sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    assert stale.response_ids.tolist() == before.response_ids.tolist()  # without a push: the old weights
    try:
        vllm_engine.push(model)
        _same_rollout(vllm_engine.sample_groups(model, prompts, 1, T, [1], 0, 0.0), after, atol=1e-4)
    finally:
        vllm_engine.push(vllm_model[1])                    # the other tests' weights back


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_dapo_runs_agree_on_one_rank_and_two_fsdp_ranks(vllm_env, vllm_model, tiny_run_inputs, tmp_path):
    """3 DAPO steps with --rollout vllm in one process, and on 2 gloo ranks with --fsdp (each rank's engine
    fed full tensors gathered from the shards): the same rewards at every step (the per-prompt seeds), the
    same evaluations (through the engines), weights within 1e-3, truncated IS on at cap 2, and the
    sampler/trainer mismatch at the float32 level at every step (an engine left with old weights drifts
    away from the policy step by step). The tiny runs' large learning rate makes every step move the policy.
    Every prompt opens with the same ~400-token instruction, as real prompts share a chat header and system
    prompt: 3 full KV blocks that vLLM's prefix cache keeps across requests (and across weight pushes,
    unless the engine drops it), as each evaluation's prompts repeat the last one's."""
    runs, instruction = {}, "3x+4=19\nAnswer: 5\n" * 22
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        flags = [*_tiny_flags(tiny_run_inputs, out), "--model", str(vllm_model[0]), "--steps", "3", "--eval-every", "1",
                 "--algo", "dapo", "--rollout", "vllm", "--grad-clip", "0", "--prompt-template", instruction + "{prompt}",
                 *(["--fsdp"] if n == 2 else [])]
        _torchrun(n, os.path.join(HERE, "train.py"), *flags)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((out / "config.json").read_text())["tis_cap"] == 2.0
        runs[n] = ([r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r], _weights(out / "final"))
    (m1, e1, w1), (m2, e2, w2) = runs[1], runs[2]
    assert len(m1) == len(m2) == 3 and len(e1) == len(e2) == 4
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "tokens/in_loss"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    assert [e["eval/accuracy"] for e in e1] == [e["eval/accuracy"] for e in e2]
    assert max(r["mismatch/logp_abs_mean"] for r in m1 + m2) < 1e-4
    # float32 sums in another order; AdamW makes near-zero gradients' noise steps of up to lr (1e-2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 5e-3
    start = _weights(vllm_model[0])
    assert max((start[k] - w1[k]).abs().max().item() for k in w1) > 1e-2   # the steps moved the weights


# ---------------------------------------------------------------------------------------------
# On GPUs (python -m pytest -q test_grpo.py -m gpu): skipped, with the reason, where CUDA is missing
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (on a GPU machine: pytest -m gpu)")


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (on a GPU machine: pytest -m gpu)")


def _train_rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(x)]


@pytest.mark.slow
@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_steps_train_float32_weights(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    _run_train(d, tmp_path / "run", "--device", "cuda", "--steps", "3", "--algo", "grpo", "--reward", "tinyreward:has_x")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["bf16"] is True   # the default on CUDA
    rows = _train_rows(tmp_path / "run")
    assert len(rows) == 3 and all(math.isfinite(v) for r in rows for v in r.values())
    w, start = _weights(tmp_path / "run" / "final"), _weights(d / "model")
    assert {v.dtype for v in w.values()} == {torch.float32} and any(not torch.equal(start[k], w[k]) for k in w)


@pytest.mark.gpu
@needs_cuda
def test_gpu_sampler_greedy_equals_generate():
    model = _tiny("qwen2", torch.float32).cuda()
    roll = sample_groups(model, PROMPTS, 2, 16, eos_token_id=1, pad_token_id=0, temperature=0.0)
    assert roll.response_ids.is_cuda
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False, eos_token_id=1,
                             pad_token_id=0)[0, len(p):].tolist()
        for r in (2 * i, 2 * i + 1):
            L = int(roll.lengths[r])
            assert roll.response_ids[r, :L].tolist() == ref[:L]


@pytest.mark.slow
@pytest.mark.gpu
@needs_cuda
def test_gpu_fsdp_on_one_gpu_trains_saves_and_resumes(tiny_run_inputs, tmp_path):
    d, out = tiny_run_inputs, tmp_path / "run"
    flags = [*_tiny_flags(d, out), "--device", "cuda", "--fsdp", "--beta", "0.04", "--save-every", "2"]
    _torchrun(1, os.path.join(HERE, "train.py"), *flags, "--steps", "2")
    _torchrun(1, os.path.join(HERE, "train.py"), *flags, "--steps", "3", "--resume")
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(v) for r in rows for v in r.values())
    w, start = _weights(out / "final"), _weights(d / "model")
    assert {v.dtype for v in w.values()} == {torch.float32} and any(not torch.equal(start[k], w[k]) for k in w)


@pytest.mark.slow
@pytest.mark.gpu
@needs_two_gpus
def test_gpu_two_ranks_nccl_ddp_and_fsdp(tiny_run_inputs, tmp_path):
    d, state = tiny_run_inputs, {}
    for mode, extra in (("ddp", []), ("fsdp", ["--fsdp", "--save-every", "2"])):
        out = tmp_path / mode
        _torchrun(2, os.path.join(HERE, "train.py"), *_tiny_flags(d, out), "--device", "cuda", "--steps", "2",
                  "--beta", "0.04", *extra)
        rows = _train_rows(out)
        assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values())
        state[mode] = rows[-1]["memory/state_bytes"]
    print(f"per-rank state bytes on 2 GPUs: DDP {state['ddp']}, FSDP {state['fsdp']}")
    assert state["fsdp"] <= 0.55 * state["ddp"]


# ---------------------------------------------------------------------------------------------
# docs: every `module.name`, --flag, test name and relative link in README.md and docs/ exists
# ---------------------------------------------------------------------------------------------

# Flags of other programs that the pages' commands pass (torchrun's launcher, python -m venv), and a
# flag the pages name to say it is not offered.
FOREIGN_FLAGS = {"--standalone", "--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                 "--master_port", "--system-site-packages", "--lora-dropout", "--no-deps"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "png", "txt", "pt", "toml", "lock"}  # `train.py`, not train.<name>


def _doc_pages() -> dict[str, str]:
    """README.md, results/README.md and docs/*.md, relative path -> text."""
    docs = os.path.join(HERE, "docs")
    paths = ["README.md", "results/README.md", *(f"docs/{n}" for n in sorted(os.listdir(docs)) if n.endswith(".md"))]
    paths = [p for p in paths if os.path.exists(os.path.join(HERE, p))]
    return {p: _read(os.path.join(HERE, p)) for p in paths}


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _at(page: str, text: str, m, what: str | None = None) -> str:
    """'page:line: what' for the match m in the page's text (what: the whole match by default)."""
    return f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0) if what is None else what}"


def _cli_actions() -> list:
    """The argparse actions of every command-line script here: each script that parses flags runs as
    __main__ until its parser's parse_known_args, which hands the parser over instead of parsing."""
    import argparse
    import runpy

    class Parsed(Exception):
        pass

    def capture(parser, *args, **kwargs):
        raise Parsed(parser)

    actions, saved = [], (argparse.ArgumentParser.parse_known_args, sys.argv)
    argparse.ArgumentParser.parse_known_args = capture
    try:
        for name in sorted(os.listdir(HERE)):
            path = os.path.join(HERE, name)
            src = _read(path) if name.endswith(".py") and name != "test_grpo.py" else ""
            if "__main__" not in src or "parse_args(" not in src:
                continue
            sys.argv = [path]
            with pytest.raises(Parsed) as got:  # a script that returns here parsed nothing: a bug in this test
                runpy.run_path(path, run_name="__main__")
            actions += got.value.args[0]._actions
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = saved
    return actions


def _github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks skipped): lower case, punctuation
    dropped (letters of any script, digits, '_' and '-' kept), spaces to '-'."""
    import re
    anchors, fenced = set(), False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#+ (.*)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def _docs_problems(pages: dict[str, str]) -> list[str]:
    """What the pages name that does not exist, one line each: `module.name[.member]` (and keyword
    arguments written as `module.fn(kw=...)`), --flag and its value where the flag has choices,
    test_name, [text](relative link) with its #anchor."""
    import importlib
    import inspect
    import re

    modules = sorted(n[:-3] for n in os.listdir(HERE) if n.endswith(".py"))
    actions = _cli_actions()
    flags = {s for a in actions for s in a.option_strings} | FOREIGN_FLAGS
    choices = {}
    for a in actions:
        for s in a.option_strings if a.choices is not None else []:
            choices.setdefault(s, set()).update(map(str, a.choices))
    test_files = sorted(n[:-3] for n in os.listdir(HERE) if n.startswith("test_") and n.endswith(".py"))
    tests = {t for f in test_files for t in re.findall(r"^def (test_\w+)\(", _read(os.path.join(HERE, f + ".py")), re.M)}
    # grpo.fn, grpo.fn(kw=...), sampler.Rollout.field; --flag, --flag value, --flag a/b
    name_re = r"(?<![\w./-])(" + "|".join(modules) + r")((?:\.\w+)+)(\(([^()`]*)\))?"
    flag_re = r"(?<![\w-])(--[a-z][\w-]*)(?:[ =]([a-z0-9][\w.-]*(?:/[\w.-]+)*))?"
    missing, problems = object(), []
    for page, text in pages.items():
        for m in re.finditer(name_re, text):
            parts = m.group(2).split(".")[1:]
            obj = importlib.import_module(m.group(1))
            for part in parts if parts[0] not in FILE_SUFFIXES else []:
                fields = getattr(obj, "__dataclass_fields__", {})  # a field without a default
                obj = getattr(obj, part, fields.get(part, missing))
                if obj is missing:
                    problems.append(f"{_at(page, text, m)}: no {part}")
                    break
            else:
                params = inspect.signature(obj).parameters if m.group(3) and callable(obj) else {}
                kwargs = re.findall(r"(\w+)=(?!=)", m.group(4) or "")
                if all(p.kind != p.VAR_KEYWORD for p in params.values()):
                    problems += [f"{_at(page, text, m)}: no argument {kw}" for kw in kwargs if kw not in params]
        for m in re.finditer(flag_re, text):
            if m.group(1) not in flags:
                problems.append(f"{_at(page, text, m)}: no such flag")
            elif m.group(2) and m.group(1) in choices:
                problems += [f"{_at(page, text, m)}: no choice {v}"
                             for v in m.group(2).split("/") if v not in choices[m.group(1)]]
        for m in re.finditer(r"\btest_\w+", text):
            if m.group(0) not in test_files and m.group(0) not in tests:
                problems.append(f"{_at(page, text, m)}: no such test in test_grpo.py")  # or test_*.py
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, _, anchor = m.group(1).partition("#")
            path = os.path.normpath(os.path.join(HERE, os.path.dirname(page), target))
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            if target and not os.path.exists(path):
                problems.append(f"{_at(page, text, m, m.group(1))}: no such file")
            elif anchor and anchor not in _github_anchors(_read(path) if target else text):
                problems.append(f"{_at(page, text, m, m.group(1))}: no such heading")
    return problems


def test_docs_name_only_functions_flags_tests_and_files_that_exist():
    pages = _doc_pages()
    assert {"README.md", "docs/objectives.md", "docs/metrics.md"} <= set(pages)
    assert _docs_problems(pages) == []


def test_docs_check_finds_a_stale_name_argument_flag_choice_test_link_and_anchor():
    # one right and one wrong of each kind; file names (train.py, curves.png) are not module names
    page = """# Quickstart (CPU, nothing downloaded)
`grpo.policy_loss` `grpo.no_such_fn` `sampler.Rollout.lengths` `sampler.Rollout.no_field` `train.py` `runs/curves.png`
`grpo.token_weights(mask, "token", num_tokens=...)` `grpo.token_weights(mask, num_tokenz=...)`
--algo dapo --algo dapi --no-dynamic-sampling --no-such-flag --nproc_per_node 8 --adv-scale group/batch/nine
`test_token_weights_by_hand` `test_no_such_test`
[ok](docs/metrics.md) [gone](docs/gone.md) [here](#quickstart-cpu-nothing-downloaded) [there](#no-such-heading)
[ok](docs/metrics.md#logged-metrics-outmetricsjsonl) [no](docs/metrics.md#quickstart-cpu-nothing-downloaded)
"""
    assert _docs_problems({"README.md": page}) == [
        "README.md:2: grpo.no_such_fn: no no_such_fn", "README.md:2: sampler.Rollout.no_field: no no_field",
        "README.md:3: grpo.token_weights(mask, num_tokenz=...): no argument num_tokenz",
        "README.md:4: --algo dapi: no choice dapi", "README.md:4: --no-such-flag: no such flag",
        "README.md:4: --adv-scale group/batch/nine: no choice nine",
        "README.md:5: test_no_such_test: no such test in test_grpo.py",
        "README.md:6: docs/gone.md: no such file", "README.md:6: #no-such-heading: no such heading",
        "README.md:7: docs/metrics.md#quickstart-cpu-nothing-downloaded: no such heading"]
