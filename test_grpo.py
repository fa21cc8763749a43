"""Tests: hand-sized numeric cases, equivalence checks, and one short end-to-end run.

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

import pytest
import torch

import builtin
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
# grpo.py: advantages, log-probs, entropy, KL, the clipped surrogate
# ---------------------------------------------------------------------------------------------

def test_article_example_advantages():
    # The article's Step 3: rewards [1, 1, 1, 0]; mean 0.75, Bessel std sqrt(0.75 / 3) = 0.5,
    # so (1 - 0.75) / 0.5 = 0.5 and (0 - 0.75) / 0.5 = -1.5.
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5, -1.5]]), atol=1e-5)


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


def test_kl_k3_hand_value_zero_at_equality_and_nonnegative():
    # logp = log 0.5, ref = log 0.25: delta = log 0.5, k3 = 0.5 - log 0.5 - 1 = 0.19315
    assert abs(grpo.kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))).item() - 0.193147) < 1e-5
    x = torch.randn(1000)
    assert torch.equal(grpo.kl_k3(x, x), torch.zeros(1000))
    assert (grpo.kl_k3(x, torch.randn(1000) * 3) >= 0).all()


def _two_token_case(adv: float):
    # one response of two tokens with ratios 1.5 and 0.5
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    return logp, torch.zeros(1, 2), torch.tensor([adv]), torch.ones(1, 2)


def test_policy_loss_clipping_by_hand():
    # A = +1: -min(1.5, 1.2) = -1.2 and -min(0.5, 0.8) = -0.5 -> mean -0.85; token 1 clipped high.
    loss, m = grpo.policy_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() + 0.85) < 1e-6
    assert m["clip/high_frac"] == 0.5 and m["clip/low_frac"] == 0.0 and abs(m["ratio/mean"] - 1.0) < 1e-6
    # A = -1: -min(-1.5, -1.2) = 1.5 and -min(-0.5, -0.8) = 0.8 -> mean 1.15; token 2 clipped low.
    loss, m = grpo.policy_loss(*_two_token_case(-1.0), eps_low=0.2, eps_high=0.2)
    assert abs(loss.item() - 1.15) < 1e-6
    assert m["clip/low_frac"] == 0.5 and m["clip/high_frac"] == 0.0
    # Clip-higher: eps_high 0.6 lets ratio 1.5 through: -(1.5 + 0.5) / 2 = -1.0, nothing clipped.
    loss, m = grpo.policy_loss(*_two_token_case(1.0), eps_low=0.2, eps_high=0.6)
    assert abs(loss.item() + 1.0) < 1e-6 and m["clip/high_frac"] == 0.0


def test_policy_loss_kl_term_and_ratio_one_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    loss, m = grpo.policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, beta=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1  # first token; the second is 0
    assert abs(loss.item() - 0.1 * k3 / 2) < 1e-6 and abs(m["kl"] - k3 / 2) < 1e-6
    # with mu = 1 (old = current) the surrogate's value is -A but its gradient is the policy gradient A * grad logp
    logp2 = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss2, _ = grpo.policy_loss(logp2, logp2.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    loss2.backward()
    assert abs(loss2.item() + 2.0) < 1e-6 and torch.allclose(logp2.grad, torch.tensor([[-1.0, -1.0]]))


def test_reductions_differ_on_unequal_lengths():
    # Two responses with advantages +1 and -1 at ratio 1: per-token losses -1 (1 token) and +1 (3 tokens).
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    seq, _ = grpo.policy_loss(logp, logp, adv, mask, reduction="sequence")
    tok, _ = grpo.policy_loss(logp, logp, adv, mask, reduction="token")
    const, _ = grpo.policy_loss(logp, logp, adv, mask, reduction="constant", max_len=5)
    assert abs(seq.item() - 0.0) < 1e-6            # (-1/1 + 3/3) / 2: each response weighs the same
    assert abs(tok.item() - 0.5) < 1e-6            # (-1 + 3) / 4 valid tokens: each token weighs the same
    assert abs(const.item() - 0.2) < 1e-6          # (-1 + 3) / (2 * 5)
    # padding never counts: garbage in masked positions changes nothing
    logp_garbage = logp.clone()
    logp_garbage[0, 1:] = 7.0
    tok2, _ = grpo.policy_loss(logp_garbage, logp, adv, mask, reduction="token")
    assert abs(tok2.item() - 0.5) < 1e-6
    # a global token count (DDP / accumulation): two halves with num_tokens=4 sum to the whole
    halves = [grpo.policy_loss(logp[i:i + 1], logp[i:i + 1], adv[i:i + 1], mask[i:i + 1], reduction="token",
                               num_tokens=torch.tensor(4.0))[0] for i in range(2)]
    assert abs(sum(h.item() for h in halves) - 0.5) < 1e-6
    # and a global response count: halves that do not cancel (a reduction ignoring num_seqs doubles them)
    adv2 = torch.tensor([1.0, 0.5])
    for reduction, whole in (("sequence", -0.75), ("constant", -(1 + 1.5) / (2 * 5))):
        full, _ = grpo.policy_loss(logp, logp, adv2, mask, reduction=reduction, max_len=5)
        halves = [grpo.policy_loss(logp[i:i + 1], logp[i:i + 1], adv2[i:i + 1], mask[i:i + 1], reduction=reduction,
                                   num_seqs=2, max_len=5)[0] for i in range(2)]
        assert abs(full.item() - whole) < 1e-6 and abs(sum(h.item() for h in halves) - whole) < 1e-6


def test_filtered_responses_leave_the_denominators():
    # overlong filtering zeroes a truncated response's mask row: it is out of the loss, and out of N too
    # (as in verl; TRL keeps counting it, which shrinks the loss of every other response)
    logp, adv = torch.zeros(2, 2), torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for reduction, want in (("sequence", -1.0), ("token", -1.0), ("constant", -1.0)):
        loss, _ = grpo.policy_loss(logp, logp, adv, mask, reduction=reduction, max_len=2)
        assert abs(loss.item() - want) < 1e-6, reduction


def test_policy_loss_guards_log_ratio_and_dual_clip():
    # a log-ratio of 100 (a stale old log-prob) would give exp(100) = inf and a NaN gradient: clamped to 20
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    loss, m = grpo.policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    # dual-clip, A = -1: ratio 5 gives a PPO loss of 5, capped at clip_c * |A| = 3, with no gradient there;
    # ratio 2 (loss 2 < 3) is left alone
    logp = torch.log(torch.tensor([[5.0, 2.0]])).requires_grad_()
    loss, m = grpo.policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), clip_c=3.0)
    loss.backward()
    assert abs(loss.item() - (3.0 + 2.0) / 2) < 1e-5 and m["clip/dual_frac"] == 0.5
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0
    # positive advantages are never dual-clipped
    loss, m = grpo.policy_loss(logp.detach(), torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_c=3.0)
    assert m["clip/dual_frac"] == 0.0 and abs(loss.item() + 1.2) < 1e-5
    with pytest.raises(ValueError):
        grpo.policy_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), clip_c=0.5)


def test_kl_metric_counts_valid_tokens_only():
    logp, mask = torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 0.0]])
    ref = torch.tensor([[-0.5, 9.0, 9.0]])                  # garbage after the response's end
    _, m = grpo.policy_loss(logp, logp, torch.tensor([0.0]), mask, ref_logp=ref, beta=0.1)
    assert abs(m["kl"] - (math.exp(-0.5) + 0.5 - 1)) < 1e-6


# ---------------------------------------------------------------------------------------------
# logprobs.py token kernel and sampler.py inverse-CDF sampling: exact against the naive forms, lean in memory
# ---------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("kind,dtype", [("qwen2", torch.float32), ("qwen2", torch.bfloat16), ("mistral", torch.float32)])
def test_sampler_greedy_groups_equal_generate_alone_with_rows_finishing_early(kind, dtype):
    import sampler
    model, G, T = _tiny(kind, dtype), 3, 24
    layers = {type(layer).__name__ for layer in sampler._make_cache(model, 8).layers}
    assert layers == ({"_BufferedLayer"} if kind == "qwen2" else {"DynamicSlidingWindowLayer"})
    # EOS := the 4th greedy token of the first prompt, so its rows finish early and leave the batch
    free = sample_groups(model, PROMPTS[:1], 1, T, eos_token_id=-1, pad_token_id=0, temperature=0.0)
    eos = int(free.response_ids[0, 3])
    roll = sample_groups(model, PROMPTS, G, T, eos_token_id=eos, pad_token_id=0, temperature=0.0)
    assert roll.lengths[0] <= 4 and roll.lengths.max() > roll.lengths[0]
    for i, p in enumerate(PROMPTS):
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
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                      mode), logp)
    for fn in (variants.gspo_loss, variants.gspo_token_loss):
        got, g_got = _value_and_grad(lambda: fn(logp, old, adv, mask, eps_low, eps_high, reduction)[0], logp)  # noqa: B023
        assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    # per-token advantages: only the token form takes them
    adv_tok = torch.randn_like(mask)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high, mode), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, eps_low, eps_high,
                                                                 reduction)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    with pytest.raises(ValueError):
        variants.gspo_loss(logp, old, adv_tok, mask)
    # truncated IS weights multiply each token's loss, as verl's rollout_is_weights do
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_gspo(old, logp, adv_tok, mask, eps_low, eps_high, mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv_tok, mask, eps_low, eps_high,
                                                                 reduction, weights=w)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    want = _verl_gspo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high, mode, w)
    assert torch.allclose(variants.gspo_loss(logp, old, adv, mask, eps_low, eps_high, reduction, weights=w)[0], want)
    m = variants.gspo_loss(logp, old, adv, mask, eps_low, eps_high)[1]
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
    loss, g_seq = _value_and_grad(lambda: variants.gspo_loss(logp, old, adv, mask)[0], logp)
    _, g_tok = _value_and_grad(lambda: variants.gspo_token_loss(logp, old, adv[:, None].expand_as(mask), mask)[0], logp)
    assert torch.allclose(g_seq, g_tok, atol=1e-12)
    want = -adv[:, None] / mask.sum(-1, keepdim=True) / mask.shape[0] * mask
    assert torch.allclose(g_seq, want, atol=1e-12) and abs(loss.item() + adv.mean().item()) < 1e-12


def _check_cispo_against_verl(seed, reduction, mode, eps_low, eps_high):
    logp, old, adv, mask = _random_policy_batch(seed, 0.4)
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                       mode), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, eps_low, eps_high, reduction)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    w = variants.tis_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)
    want, g_want = _value_and_grad(lambda: _verl_cispo(old, logp, adv[:, None].expand_as(mask), mask, eps_low, eps_high,
                                                       mode, w), logp)
    got, g_got = _value_and_grad(lambda: variants.cispo_loss(logp, old, adv, mask, eps_low, eps_high, reduction,
                                                             weights=w)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    m = variants.cispo_loss(logp, old, adv, mask, eps_low, eps_high)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode", [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_cispo_equals_verl_cispo_values_and_gradients(reduction, mode):
    clipped = [_check_cispo_against_verl(seed, reduction, mode, 0.2, 0.28) for seed in range(3)]
    assert 0 < sum(clipped) < len(clipped)
    _check_cispo_against_verl(3, reduction, mode, variants.CISPO_EPS_LOW, variants.CISPO_EPS_HIGH)
    # a clipped token keeps its gradient: ratio e^1 > 1.28, gradient -1.28 * A (here A = 1, one token)
    one = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    loss, m = variants.cispo_loss(one, torch.full((1, 1), -1.0, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                                  torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert abs(one.grad.item() + 1.28) < 1e-12 and m["clip/high_frac"] == 1.0


def test_policy_loss_is_reduce_loss_of_its_tokens_and_kl_term_splits_off():
    # reduce_loss is policy_loss's reduction; beta * kl_term(k3) added to a beta = 0 loss is policy_loss(beta)
    logp, old, adv, mask = _random_policy_batch(4, 0.3)
    ref = torch.randn_like(old) - 2.0
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    for reduction in ("sequence", "token", "constant"):
        kw = dict(reduction=reduction, num_tokens=torch.tensor(30.0), max_len=9, num_seqs=8)
        base, _ = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.28, **kw)
        assert torch.allclose(base, grpo.reduce_loss(per_token, mask, **kw), atol=1e-12)
        with_kl, m = grpo.policy_loss(logp, old, adv, mask, 0.2, 0.28, ref_logp=ref, beta=0.04, **kw)
        kl, mk = variants.kl_term(logp, ref, mask, grpo.kl_k3, **kw)
        assert torch.allclose(with_kl, base + 0.04 * kl, atol=1e-12) and abs(m["kl"] - mk["kl"]) < 1e-9
        k2, mk2 = variants.kl_term(logp, ref, mask, grpo.kl_k2, **kw)  # another estimator: same "kl" metric (k3)
        assert torch.allclose(k2, grpo.reduce_loss(grpo.kl_k2(logp, ref), mask, **kw)) and mk2 == mk
    with pytest.raises(ValueError):
        grpo.reduce_loss(per_token, mask, "mean")


def _entropy_loss(logits, mask, **kw):
    return variants.entropy_bonus(variants.token_entropy(logits, 0.7), mask, **kw)[0]


@pytest.mark.parametrize("name,fn", [
    ("gspo", lambda lp, old, adv, mask, **kw: variants.gspo_loss(lp, old, adv, mask, 0.02, 0.03, **kw)[0]),
    ("gspo-token", lambda lp, old, adv, mask, **kw: variants.gspo_token_loss(lp, old, adv, mask, 0.02, 0.03, **kw)[0]),
    ("cispo", lambda lp, old, adv, mask, **kw: variants.cispo_loss(lp, old, adv, mask, 0.2, 0.28, **kw)[0]),
    ("kl-k2", lambda lp, old, adv, mask, **kw: variants.kl_term(lp, old, mask, grpo.kl_k2, **kw)[0]),
    ("tis", lambda lp, old, adv, mask, **kw: variants.cispo_loss(
        lp, old, adv, mask, weights=variants.tis_weights(old, old + 0.3 * torch.sin(old * 7), mask, 1.2), **kw)[0]),
])
@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_variant_losses_add_up_over_micro_batches(name, fn, reduction):
    # two micro-batches with the step's global denominators give the full batch's loss and gradient
    logp, old, adv, mask = _random_policy_batch(5, 0.05)
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=9, num_seqs=6)
    full, g_full = _value_and_grad(lambda: fn(logp, old, adv, mask, **kw), logp)
    parts, g_parts = _value_and_grad(lambda: sum(fn(logp[s], old[s], adv[s], mask[s], **kw)
                                                 for s in (slice(0, 2), slice(2, 6))), logp)
    assert torch.allclose(full, parts, atol=1e-12) and torch.allclose(g_full, g_parts, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sequence", "token", "constant"])
def test_entropy_bonus_gradient_equals_autograd_of_the_naive_entropy(reduction):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 5, 11)).requires_grad_(True)  # token_entropy works in float32
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 4])[:, None]).float()
    kw = dict(reduction=reduction, num_tokens=mask.sum(), max_len=6, num_seqs=4)
    got = variants.entropy_bonus(variants.token_entropy(logits, 0.7), mask, **kw)[0]
    (g_got,) = torch.autograd.grad(got, logits)
    x = logits / 0.7
    naive = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)  # [N, T]
    want = grpo.reduce_loss(naive, mask, **kw)
    (g_want,) = torch.autograd.grad(want, logits)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(g_got, g_want, atol=1e-6)
    # micro-batches with global denominators add up, as the losses do
    parts = sum(variants.entropy_bonus(variants.token_entropy(logits[s], 0.7), mask[s], **kw)[0]
                for s in (slice(0, 1), slice(1, 4)))
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
    got, _ = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.1, reduction="token", weights=w)
    want = grpo.reduce_loss(per_token + 0.1 * grpo.kl_k3(logp, ref), mask, "token")
    assert torch.allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# dapo.py
# ---------------------------------------------------------------------------------------------

def test_overlong_penalty_boundaries():
    # L_max 20, L_cache 4: free up to 16, then (16 - L) / 4, -1 beyond 20 (DAPO Eq. 13)
    L = torch.tensor([1, 16, 17, 18, 20, 21, 100])
    want = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    assert torch.allclose(dapo.overlong_penalty(L, 20, 4), want)
    with pytest.raises(ValueError):
        dapo.overlong_penalty(L, 20, 0)


def test_keep_groups_boundaries():
    # Eq. 11 on correctness: 0 < #correct < G
    c = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert dapo.keep_groups(c).tolist() == [False, False, True, True]


def test_overlong_filter_masks_truncated_rows():
    mask = torch.ones(3, 4)
    out = dapo.overlong_filter(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4.0, 0.0, 4.0]


def _fake_rollout(rewards: list[list[float]], start: int = 0) -> Rollout:
    B, G = len(rewards), len(rewards[0])
    N = B * G
    return Rollout(prompts=[[start + i] for i in range(B)], G=G, pad_token_id=0,
                   response_ids=torch.ones(N, 2, dtype=torch.long), mask=torch.ones(N, 2),
                   lengths=torch.full((N,), 2), truncated=torch.zeros(N, dtype=torch.bool),
                   logprobs=torch.zeros(N, 2), extra={"correct": torch.tensor(rewards).view(-1)})


def test_dynamic_sampling_fills_then_stops_and_is_world_size_invariant():
    rounds = [[[1, 0], [1, 1], [0, 1], [0, 0]], [[1, 0], [1, 0], [0, 0], [0, 1]]]  # informative: 2, then 3
    draw = lambda r: _fake_rollout(rounds[r], start=10 * r)  # noqa: E731
    roll, st = dapo.dynamic_sampling(draw, target=4, max_rounds=4)
    # the first two informative groups of round 0, then the first two of round 1
    assert [p[0] for p in roll.prompts] == [0, 2, 10, 11] and st["sampling/rounds"] == 2
    assert st["sampling/groups_drawn"] == 8 and st["sampling/batch_full"] == 1.0
    # round limit: trains on what it has
    roll, st = dapo.dynamic_sampling(draw, target=40, max_rounds=2)
    assert roll.num_groups == 5 and st["sampling/batch_full"] == 0.0
    # two ranks, each drawing half of each round's prompts: together they keep the same groups
    kept = []
    halves = {(r, k): _fake_rollout(rounds[r][2 * k:2 * k + 2], start=10 * r + 2 * k) for r in range(2) for k in range(2)}
    for k in range(2):
        state = {"round": 0}

        def draw_k(r, k=k, state=state):
            state["round"] = r
            return halves[(r, k)]

        def gather_k(_mine, state=state):  # what all_gather would return: both ranks' flags, in rank order
            return [dapo.keep_groups(halves[(state["round"], j)].extra["correct"].view(-1, 2)) for j in range(2)]
        roll_k, _ = dapo.dynamic_sampling(draw_k, target=4, max_rounds=4, gather=gather_k, rank=k)
        kept += [p[0] for p in roll_k.prompts] if roll_k is not None else []
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
            roll = _fake_rollout([[1, 0]] * len(mine)) if mine else None
            if roll is not None:
                roll.extra["index"] = torch.tensor(mine).repeat_interleave(G)
            for k, rows in enumerate(update.minibatch_rows(roll, K, _StubRanks(idx, rank))):
                out.setdefault(k, []).extend(roll.extra["index"][rows][::G].tolist() if rows.stop > rows.start else [])
        return [sorted(v) for _, v in sorted(out.items())]

    # dynamic sampling's kept groups: rank 0 holds prompts 0, 2, 9 and rank 1 holds 4, 5, 12 (two rounds)
    one = groups([[0, 2, 4, 5, 9, 12]], 3)
    assert one == [[0, 2], [4, 5], [9, 12]]             # thirds of the global prompt order
    assert groups([[0, 2, 9], [4, 5, 12]], 3) == one    # not each rank's own thirds
    assert groups([[0, 2, 9], [4, 5, 12]], 1) == [[0, 2, 4, 5, 9, 12]]
    assert groups([[0], [4]], 4) == [[0], [4]]          # fewer groups than mini-batches: no empty updates
    assert groups([[], [4, 5]], 2) == [[4], [5]]        # a rank that kept nothing still takes part
    assert update.minibatch_rows(None, 2, _StubRanks([[], []], 0)) == []


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
    s = grpo.policy_loss(logp, logp.detach(), adv, mask, reduction="sequence")[0]
    t = grpo.policy_loss(logp, logp.detach(), adv, mask, reduction="token")[0]
    assert torch.allclose(s, t)


# ---------------------------------------------------------------------------------------------
# sampler.py
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]]


def _full_forward_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[:, len(prompt) - 1:-1] / temperature
    return logprobs.token_logprobs(logits, ids[:, len(prompt):])[0]


def test_sampler_greedy_equals_generate(tiny_model):
    roll = sample_groups(tiny_model, PROMPTS, 1, 12, eos_token_id=1, pad_token_id=0, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        ref = tiny_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0)
        ref = ref[0, len(p):].tolist()
        L = int(roll.lengths[i])
        assert roll.response_ids[i, :L].tolist() == ref[:L]
        assert L == len(ref) or ref[L:] == [0] * (len(ref) - L)


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


def test_rollout_select_and_cat():
    r = _fake_rollout([[1, 0], [0, 0], [1, 1]])
    s = r.select_groups(torch.tensor([True, False, True]))
    assert s.prompts == [[0], [2]] and s.response_ids.shape[0] == 4
    c = Rollout.cat([s, r])
    assert c.num_groups == 5 and c.extra["correct"].shape == (10,)
    # a longer rollout pads the shorter one's rows: never a valid mask position, never a log-prob
    long = _fake_rollout([[1, 0]])
    long.response_ids, long.mask, long.logprobs = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), -torch.ones(2, 5)
    c = Rollout.cat([r, long])
    assert c.mask.shape == (8, 5) and c.mask[:6, 2:].sum() == 0 and c.logprobs[:6, 2:].abs().sum() == 0
    assert (c.response_ids[:6, 2:] == r.pad_token_id).all() and c.mask[6:].sum() == 10


# ---------------------------------------------------------------------------------------------
# logprobs.py: the shared-prefix training forward (rollout_logprobs) against the per-response one
# ---------------------------------------------------------------------------------------------

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


def _mixed_rollout(model, temperature, G=4, T=20):
    """PROMPTS (3, 6 and 1 tokens) x G samples, some ending in EOS and some truncated."""
    roll = sample_groups(model, PROMPTS, G, T, eos_token_id=1, pad_token_id=0, temperature=temperature,
                         generator=torch.Generator().manual_seed(3))
    assert len(set(roll.lengths.tolist())) > 2 and roll.truncated.any() and (~roll.truncated).any()
    return roll


def _micro_batches(N, mb):
    return [slice(k, min(k + mb, N)) for k in range(0, N, mb)]


@pytest.mark.parametrize("kind,keep", [("llama", 0.8), ("llama", 1.0), ("mistral", 1.0)])
def test_shared_prefix_forward_equals_per_response(tiny_model, kind, keep, monkeypatch):
    # mistral: sliding-window layers (window 5) in the cache; keep 1.0: every slice with two response lengths
    # is split into two length buckets (0.8, the default, keeps these slices whole)
    from logprobs import per_response_logprobs, rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    model = tiny_model if kind == "llama" else _tiny("mistral", torch.float32)
    t, G = 0.7, 4
    roll = _mixed_rollout(model, t, G)
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
                loss, _ = grpo.policy_loss(logp, old[s], adv[s], mask, 0.2, 0.28, ref_logp=ref[s], beta=0.04,
                                           reduction=reduction, num_tokens=roll.mask.sum(), max_len=T_all, num_seqs=N)
                (loss - 0.01 * (ent * mask).sum() / roll.mask.sum()).backward()
            grads.append(torch.cat([p.grad.flatten() for p in params]))
        assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[1].abs().max(), reduction
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("temperature,keep", [(1.0, 0.8), (0.7, 0.8), (0.7, 1.0)])
def test_training_logprobs_equal_the_samplers(tiny_model, temperature, keep, monkeypatch):
    # the tokens' log-probs under the training forward are the ones the sampler drew them with: an
    # off-by-one position, position ids that ignore the left padding, or a dropped temperature all break this
    from logprobs import rollout_logprobs
    monkeypatch.setattr(logprobs, "BUCKET_KEEP", keep)
    roll = _mixed_rollout(tiny_model, temperature)
    N = roll.response_ids.shape[0]
    for mb in (N, 5):
        with torch.no_grad():
            logp = torch.cat([rollout_logprobs(tiny_model, roll, s, temperature)[0] for s in _micro_batches(N, mb)])
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
    R("x=4", "4", 0.0, id="no-marker-no-answer"),
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
    assert format_reward("Answer: 3") == 1.0 and format_reward("x=3") == 0.0 and format_reward("Answer:") == 0.0


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
               ("betas=(0.9, 0.98)", "betas=(0.9, 0.99)"),                    # the optimiser
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
    """bench.py is not run by CI otherwise: its flags must parse, and the warm-start section must run."""
    import bench
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    bench.main(["--only", "warmstart", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "padded to the longest" in out and "packed into rows" in out and "packed / padded time" in out

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
    assert a["majority"] == evaluate.canonical_answer("Answer: 4") and a["majority_score"] == 1.0 and a["correct"] == 2
    assert b["majority"] == evaluate.canonical_answer("Answer: 3") and b["majority_score"] == 0.0
    ks = evaluate.pass_ks(4)
    m = evaluate.metrics(evaluate.totals([a, b], ks), 4, ks)
    assert m == pytest.approx({
        "eval/mean@4": (0.5 + 0.0) / 2, "eval/mean@4_std": 0.25,  # population std of (0.5, 0.0)
        "eval/pass@1": 0.25, "eval/pass@2": (1 - 1 / 6) / 2,      # problem 0: 1 - C(2,2)/C(4,2); problem 1: 0
        "eval/pass@4": 0.5, "eval/maj@4": 0.5, "eval/truncated_frac": 2 / 8, "eval/len_mean": 36 / 8})
    g = evaluate.metrics(evaluate.totals([_record(0, ["Answer: 4"], [1.0]), _record(1, ["Answer: 5"], [0.0])], [1]), 1, [1])
    assert g == {"eval/accuracy": 0.5, "eval/truncated_frac": 0.0, "eval/len_mean": 3.0}  # greedy: today's keys


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


# ---------------------------------------------------------------------------------------------
# train.py: flags, and one short end-to-end run through subprocess
# ---------------------------------------------------------------------------------------------

def test_bad_flags_exit_with_one_line(capsys):
    import train
    for bad in (["--group-size", "1"], ["--max-new-tokens", "0"], ["--algo", "ppo"], ["--reduction", "mean"],
                ["--top-p", "0"], ["--overlong-cache", "999"], ["--steps", "x"], ["--loss", "reinforce"],
                ["--kl", "k4"], ["--loss", "gspo", "--clip-c", "3"], ["--tis-cap", "-1"]):
        with pytest.raises(SystemExit) as e:
            train.parse_args(bad)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


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

    def grads():
        model.train()
        model.zero_grad()
        calls.clear()
        forwards.clear()
        logp, _, valid = rollout_logprobs(model, roll, slice(0, 6), 1.0)
        (-(logp * valid).sum() / valid.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls), len(forwards)

    plain, n_plain, f_plain = grads()
    parallel.checkpoint_activations(model)
    ckpt, n_ckpt, f_ckpt = grads()
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt         # the layer ran again in backward: it was checkpointed
    assert max((plain[k] - ckpt[k]).abs().max().item() for k in plain) <= 1e-5
    assert all(plain[k].abs().sum() > 0 for k in plain if "layers.0" in k)


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
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *_tiny_flags(d, out), "--steps", "2", "--eval-every", "1", *extra]
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


METRIC_KEYS = {"step", "loss", "reward/mean", "reward/correct", "reward/frac_zero_std", "kl", "entropy",
               "clip/low_frac", "clip/high_frac", "ratio/mean", "len/mean", "len/truncated_frac", "grad_norm",
               "lr", "samples", "sampling/rounds", "time/step_s", "time/sample_s", "memory/state_bytes",
               "mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl"}


@pytest.mark.slow
def test_end_to_end_changes_weights_and_writes_metrics(tiny_run_inputs, tmp_path):
    d = tiny_run_inputs
    res = _run_train(d, tmp_path / "run", "--algo", "dapo")
    assert "held-out greedy accuracy" in res.stdout
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
    before, after = _weights(d / "model"), _weights(tmp_path / "run" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)
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


# ---------------------------------------------------------------------------------------------
# Real-model path: data formats, chat template, pluggable reward, checkpoints, clear errors
# ---------------------------------------------------------------------------------------------

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
def test_bf16_flag_autocasts_on_cpu_too(tiny_run_inputs, tmp_path):
    # --bf16 asks for bfloat16 autocast on the run's device; a CUDA-only autocast would leave a CPU run in float32
    for name, flags in (("fp32", []), ("bf16", ["--bf16"])):
        _run_train(tiny_run_inputs, tmp_path / name, "--steps", "1", *flags)
    fp32, bf16 = ([json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines() if "loss" in x][0]
                  for n in ("fp32", "bf16"))
    assert math.isfinite(bf16["entropy"]) and bf16["entropy"] != fp32["entropy"]  # bfloat16 logits round differently
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
def test_final_model_loads_and_generates(tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _run_train(tiny_run_inputs, tmp_path / "run", "--steps", "1")
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    ids = torch.tensor([tok("2x+4=10\n")["input_ids"]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_gsm8k_fields_chat_template_and_reward_plugin(tiny_run_inputs, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Half of 4?", "answer": "4/2 = 2\n#### 2"}) + "\n")
    rows = data.load_rows(str(gsm), "train", prompt_field="question", answer_field="answer")
    assert rows == [{"prompt": "Half of 4?", "answer": "4/2 = 2\n#### 2"}]
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
    ablate.main(["--seeds", "0", "1", "--out", str(tmp_path / "runs"), "--results", str(tmp_path)])
    md = (tmp_path / "tiny.md").read_text()
    assert "| responses | 32.0 ± 0.0 | 32.0 ± 0.0 |" in md and "mean ± sd over 2 seeds per arm." in md  # 2 steps x 4 x 4, all logged
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == \
        ["off-seed0", "off-seed1", "on-dynamic-sampling-seed0", "on-dynamic-sampling-seed1"]
    metrics = ablate.load_run(str(tmp_path / "runs" / "tiny" / "on-dynamic-sampling-seed1")).metrics
    assert all("sampling/groups_kept" in r for r in metrics if "loss" in r)
    assert not any("sampling/groups_kept" in r for r in ablate.load_run(str(tmp_path / "runs" / "tiny" / "off-seed1")).metrics)
    assert ("tiny.png" in os.listdir(tmp_path)) == ("figure:" in capsys.readouterr().out)
    with pytest.raises(SystemExit):
        ablate.main(["--train-flags", "--mu 2"])                              # a --rows flag without --rows

# ---------------------------------------------------------------------------------------------
# Runs through train.main and evaluate.main: the loss flags reach the update, the evaluate command
# ---------------------------------------------------------------------------------------------

def _one_step(d, out, *extra):
    import train
    train.main([*_tiny_flags(d, out), "--steps", "1", "--eval-every", "5", "--grad-clip", "0", "--algo", "dapo",
                "--no-dynamic-sampling", *extra])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][-1]


@pytest.mark.slow
def test_loss_flags_reach_the_update(tiny_run_inputs, tmp_path):
    # The same samples each time (same seed); each flag must change the update as its math says.
    d = tiny_run_inputs
    base = _one_step(d, tmp_path / "base")
    # float32: pi_old and the sampler agree to ~1e-7, so a cap of 0.5 makes every weight 0.5: half the gradient
    tis = _one_step(d, tmp_path / "tis", "--tis-cap", "0.5")
    assert tis["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-4)
    assert tis["loss"] == pytest.approx(0.5 * base["loss"], rel=1e-4, abs=1e-7)
    # entropy bonus: loss - c * (token mean of the entropy over the loss's tokens); a different gradient
    ent = _one_step(d, tmp_path / "ent", "--entropy-coef", "0.5")
    assert ent["grad_norm"] != pytest.approx(base["grad_norm"], rel=1e-3)
    assert ent["loss"] < base["loss"] - 0.1 * ent["entropy"]
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
    # the KL estimator reaches the loss: in the second pass the policy has left the reference
    k3 = _one_step(d, tmp_path / "k3", "--beta", "0.5", "--mu", "2")
    k1 = _one_step(d, tmp_path / "k1", "--beta", "0.5", "--mu", "2", "--kl", "k1")
    assert k1["grad_norm"] != pytest.approx(k3["grad_norm"], rel=1e-4) and k3["kl"] > 0


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
