"""The loss family's unit tests (variants.py): GSPO, CISPO, the KL estimators, the entropy
bonus, truncated importance sampling, each against its formula and the references' forms.

    python -m pytest -q tests/test_losses.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import correction
import grpo
import update
import variants
from harness import flags
from helpers import read_file, reduce_by_hand

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

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
    got, g_got = _value_and_grad(
        lambda: variants.gspo_loss(logp, old, adv, mask, wt, eps_low, eps_high)[0], logp)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    # per-token advantages: refused (one ratio per response takes one advantage per response)
    with pytest.raises(ValueError):
        variants.gspo_loss(logp, old, torch.randn_like(mask), mask, wt)
    # truncated IS weights multiply each token's loss, as verl's rollout_is_weights do
    w = correction.is_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)[0]
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


def test_gspo_on_policy_gradient_is_the_sequence_policy_gradient():
    # mu = 1: old = current, s_i = 1, nothing clipped (even with the paper's 3e-4 / 4e-4). The
    # gradient of each token is -A_i / |y_i| / N: the sequence-mean policy gradient.
    logp, _, adv, mask = _random_policy_batch(3, 0.0)
    old = logp.detach().clone()
    # [N, T], sequence mean
    wt = grpo.token_weights(mask)
    loss, g_seq = _value_and_grad(lambda: variants.gspo_loss(logp, old, adv, mask, wt)[0], logp)
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
    w = correction.is_weights(old, old + 0.5 * torch.randn_like(old), mask, 2.0)[0]
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
        assert torch.allclose(base, reduce_by_hand(per_token, mask, **kw), atol=1e-12)
        with_kl, m = grpo.policy_loss(logp, old, adv, mask, w, ppo, ref_logp=ref, beta=0.04)
        kl, mk = grpo.kl_term(logp, ref, mask, w, grpo.kl_k3)
        assert (torch.allclose(with_kl, base + 0.04 * kl, atol=1e-12)
                and abs(m["kl"] - mk["kl"]) < 1e-9)
        want = reduce_by_hand(per_token + 0.04 * grpo.kl_k3(logp, ref), mask, **kw)
        assert torch.allclose(with_kl, want, atol=1e-12)
        # another estimator: same "kl" metric (k3)
        k2, mk2 = grpo.kl_term(logp, ref, mask, w, grpo.kl_k2)
        assert torch.allclose(k2, reduce_by_hand(grpo.kl_k2(logp, ref), mask, **kw)) and mk2 == mk
    with pytest.raises(ValueError):
        grpo.token_weights(mask, "mean")


@pytest.mark.parametrize("name,fn", [
    ("gspo", lambda lp, old, adv, mask, w: variants.gspo_loss(lp, old, adv, mask, w, 0.02,
                                                              0.03)[0]),
    ("cispo", lambda lp, old, adv, mask,
     w: variants.cispo_loss(lp, old, adv, mask, w, 0.2, 0.28)[0]),
    ("dppo", lambda lp, old, adv, mask, w: variants.dppo_loss(lp, old, adv, mask, w, 0.01,
                                                              0.01)[0]),
    ("sapo", lambda lp, old, adv, mask, w: variants.sapo_loss(lp, old, adv, mask, w)[0]),
    ("kl-k2", lambda lp, old, adv, mask, w: grpo.kl_term(lp, old, mask, w, grpo.kl_k2)[0]),
    ("tis", lambda lp, old, adv, mask, w: variants.cispo_loss(
        lp, old, adv, mask,
        w * correction.is_weights(old, old + 0.3 * torch.sin(old * 7), mask, 1.2)[0])[0]),
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
    want = reduce_by_hand(naive, mask, **kw)
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
    assert torch.equal(correction.is_weights(old, old.detach(), mask, 2.0)[0],
                       torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # pi_old / pi_sampler = 10 -> capped at 2; 1.5 -> kept; 0.25 -> kept (truncation is from above
    # only)
    sampler = old.detach() - torch.tensor([[math.log(10.0), math.log(1.5), math.log(0.25), 5.0]])
    w = correction.is_weights(old, sampler, mask, 2.0)[0]
    assert torch.allclose(w, torch.tensor([[2.0, 1.5, 0.25, 0.0]])) and not w.requires_grad
    with pytest.raises(ValueError):
        correction.is_weights(old, sampler, mask, 0.0)[0]


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
    assert (set(update.LOSSES) == {"ppo", "gspo", "cispo", "dppo", "sapo"}
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
    want = reduce_by_hand(per_token + 0.1 * grpo.kl_k3(logp, ref), mask, "token")
    assert torch.allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# correction.py: the rollout corrections, each against its anchor's formula
# ---------------------------------------------------------------------------------------------

def _mismatched_batch():
    """old and sampler log-probs that differ by up to ~1.5 nats a token, with padding, and one
    response (row 2) far off-policy."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 7, generator=g) * 3
    sampler = old + 0.6 * torch.randn(4, 7, generator=g)
    sampler[2] += 1.0
    mask = torch.ones(4, 7)
    mask[0, 5:], mask[3, 2:] = 0.0, 0.0
    return old, sampler, mask


def _trl_is(old, sampler, mask, mode, clip_max, clip_min=None):
    """TRL's vllm_importance_sampling_mode, as its GRPOTrainer computes it: the log-ratio masked,
    per token or summed per sequence, exponentiated, then clamped (truncate) or set to 0 outside
    [clip_min, clip_max] (mask)."""
    diff = (old - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max).expand_as(old)
    bad = ratio > clip_max
    if clip_min is not None:
        bad = bad | (ratio < clip_min)
    return ratio.masked_fill(bad, 0.0).expand_as(old)


def _verl_geometric(old, sampler, mask, low, high, reject):
    """verl's geometric-mean ratio exp(mean_t log w_t) per response: its rejection sampling keeps
    (1) or drops (0) the response by [low, high]; as an IS weight, masked outside."""
    lw = ((old - sampler) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    w = torch.exp(lw)
    keep = ((w >= low) & (w <= high)).float()
    return (keep if reject else w * keep).expand_as(old)


def _icepop(old, sampler, alpha=0.5, beta=5.0):
    """IcePop (Ring-1T): M(k) = k for k = pi_train / pi_infer in [alpha, beta], 0 outside."""
    k = torch.exp(old - sampler)
    return torch.where((k >= alpha) & (k <= beta), k, torch.zeros_like(k))


@pytest.mark.parametrize("level,mode,low,cap,anchor", [
    ("token", "truncate", 0.0, 2.0, lambda o, s, m: _trl_is(o, s, m, "token_truncate", 2.0)),
    ("token", "truncate", 0.5, 2.0, lambda o, s, m: _trl_is(o, s, m, "token_truncate", 2.0, 0.5)),
    ("token", "mask", 0.0, 2.0, lambda o, s, m: _trl_is(o, s, m, "token_mask", 2.0)),
    ("sequence", "truncate", 0.0, 3.0,
     lambda o, s, m: _trl_is(o, s, m, "sequence_truncate", 3.0)),
    ("sequence", "mask", 0.0, 3.0, lambda o, s, m: _trl_is(o, s, m, "sequence_mask", 3.0)),
    ("geometric", "reject", 0.5, 1.5,
     lambda o, s, m: _verl_geometric(o, s, m, 0.5, 1.5, reject=True)),
    ("geometric", "mask", 0.5, 1.5,
     lambda o, s, m: _verl_geometric(o, s, m, 0.5, 1.5, reject=False)),
    ("token", "mask", 0.5, 5.0, lambda o, s, m: _icepop(o, s)),
])
def test_rollout_corrections_equal_their_anchors_formulas(level, mode, low, cap, anchor):
    old, sampler, mask = _mismatched_batch()
    w, share = correction.is_weights(old, sampler, mask, cap, level, mode, low)
    want = anchor(old, sampler, mask) * mask                 # the anchors weight padding by mask
    assert torch.allclose(w, want, atol=1e-6, rtol=1e-6) and not w.requires_grad
    # the share acted on: valid tokens whose ratio (their sequence's, at sequence levels) left
    # [low, cap]
    ratio = torch.exp(correction.log_ratio(old, sampler, mask, level)).expand_as(old)
    outside = ((ratio > cap) | (ratio < low)) & mask.bool()
    assert share == pytest.approx(float(outside.sum() / mask.sum())) and 0 < share < 1


def _trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, threshold):
    """TRL's get_off_policy_mask (DeepSeek-V3.2): keep a sequence with advantage >= 0 or a mean
    KL sampler -> current <= threshold."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return ((advantages[:, None] >= 0) | (seq_kl <= threshold)).to(mask.dtype)


def test_off_policy_sequence_mask_equals_trls_and_drops_only_negative_far_responses():
    old, sampler, mask = _mismatched_batch()
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([-1.0, 0.5, -0.3, -2.0])
    keep, share = correction.off_policy_mask(logp, sampler, adv, mask, 0.5)
    want = _trl_off_policy_mask(adv, logp, sampler, mask, 0.5) * mask
    assert torch.equal(keep, want) and not keep.requires_grad
    # row 2 is far off-policy with a negative advantage: dropped; row 1 (A > 0) kept however far
    kl = ((sampler - old) * mask).sum(-1) / mask.sum(-1)
    assert kl[2] > 0.5 and keep[2].sum() == 0 and keep[1].sum() == mask[1].sum()
    assert share == pytest.approx(float(((adv < 0) & (kl > 0.5)).sum()) / 4)


def test_the_correction_flags_reach_the_loss(tiny_run_inputs, tmp_path):
    # through train.py: the shares are logged, and each switch changes the update it is given
    # (a flag parsed but never applied would leave the weights of the run without it). --mu 2: the
    # second pass's policy has moved from the sampler's, so the off-policy mask has work
    from helpers import one_step, weights_of
    base = ["--mu", "2", "--lr", "0.1", "--no-overlong-filter"]
    runs = {}
    # bf16 autocast: the sampler's and the trainer's log-probs differ by ~1e-4 nats a response,
    # which a cap of 1 + 1e-4 on the sequence ratio rejects in part
    seq = ["--tis-cap", "1.0001", "--is-level", "sequence", "--is-mode", "reject"]
    for name, extra in [("plain", []), ("opm", ["--off-policy-mask", "1e-4"]),
                        ("bf16", ["--bf16"]), ("seq", ["--bf16", *seq]),
                        ("tok", ["--bf16", *seq[:2], "--is-mode", "reject"])]:
        out = tmp_path / name
        runs[name] = (one_step(tiny_run_inputs, out, *base, *extra), weights_of(out / "final"))
    (plain, w0), (opm, w1), (_, w2), (seq, w3) = (runs[k] for k in ("plain", "opm", "bf16", "seq"))
    assert "offpolicy/masked_frac" not in plain and "is/corrected_frac" not in plain
    assert 0 < opm["offpolicy/masked_frac"] < 1 and 0 < seq["is/corrected_frac"] < 1
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)
    # the level reaches it too: a sequence's ratio leaves the bounds more often than a token's
    assert seq["is/corrected_frac"] > runs["tok"][0]["is/corrected_frac"]
    flags_ = flags.parse_train_args(["--tis-cap", "3", "--is-level", "geometric", "--is-mode",
                                     "mask", "--is-low", "0.5"], "")
    assert (flags_.is_level, flags_.is_mode, flags_.is_low) == ("geometric", "mask", 0.5)
    with pytest.raises(SystemExit):
        flags.parse_train_args(["--is-mode", "mask"], "")        # shapes a correction that is off


# ---------------------------------------------------------------------------------------------
# DPPO and SAPO against verl's formulas (verl/trainer/ppo/core_algos.py: dppo_tv, sapo)
# ---------------------------------------------------------------------------------------------

def _verl_dppo_tv(old_logp, logp, adv_tok, mask, low, high, mode, ratio_cap=20.0):
    """verl compute_policy_loss_dppo_tv: -A * sg(min(ratio, clip_ratio_c)) * logp on the tokens
    whose probability difference p - p_old stays <= high (A > 0) or >= -low (otherwise)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=ratio_cap).detach()
    diff = torch.exp(logp) - torch.exp(old_logp)
    valid = torch.where(adv_tok > 0, diff <= high, diff >= -low).detach().to(logp.dtype)
    return _verl_agg(-adv_tok * truncated * logp * valid, mask, mode)


def _verl_sapo(old_logp, logp, adv_tok, mask, tau_pos, tau_neg, mode):
    """verl compute_policy_loss_sapo: -A * sigmoid(tau (ratio - 1)) * 4 / tau, tau by A's sign."""
    ratio = torch.exp(torch.clamp(logp - old_logp, min=-20.0, max=20.0))
    taus = torch.where(adv_tok > 0, torch.tensor(tau_pos, dtype=logp.dtype),
                       torch.tensor(tau_neg, dtype=logp.dtype))
    return _verl_agg(-torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv_tok, mask, mode)


def _check_dppo_and_sapo_against_verl(seed, reduction, mode):
    logp, old, adv, mask = _random_policy_batch(seed, 0.8)
    # probabilities near 0.6, where the band can bind
    old = (old + 1.5).clamp(max=-0.05)
    logp = (logp.detach() + 1.5).clamp(max=-0.05).requires_grad_(True)
    adv_tok, wt = adv[:, None].expand_as(mask), grpo.token_weights(mask, reduction)
    for anchor, ours in (
            (lambda: _verl_dppo_tv(old, logp, adv_tok, mask, 0.2, 0.2, mode),
             lambda: variants.dppo_loss(logp, old, adv, mask, wt)[0]),
            (lambda: _verl_sapo(old, logp, adv_tok, mask, 1.0, 1.05, mode),
             lambda: variants.sapo_loss(logp, old, adv, mask, wt)[0])):
        want, g_want = _value_and_grad(anchor, logp)
        got, g_got = _value_and_grad(ours, logp)
        assert torch.allclose(got, want, atol=1e-10) and torch.allclose(g_got, g_want, atol=1e-10)
    m = variants.dppo_loss(logp, old, adv, mask, wt)[1]
    return m["clip/low_frac"] + m["clip/high_frac"]


@pytest.mark.parametrize("reduction,mode",
                         [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_dppo_and_sapo_equal_verls_values_and_gradients(reduction, mode):
    masked = sum(_check_dppo_and_sapo_against_verl(seed, reduction, mode) for seed in range(4))
    assert masked > 0                                   # the band masked some tokens
    # on-policy both are the policy gradient: -A grad(logp), each token by its weight
    logp, _, adv, mask = _random_policy_batch(9, 0.0)
    old, wt = logp.detach().clone(), grpo.token_weights(mask, reduction)
    want = -adv[:, None] * wt
    for fn in (variants.dppo_loss, variants.sapo_loss):
        _, g = _value_and_grad(lambda fn=fn: fn(logp, old, adv, mask, wt)[0], logp)
        assert torch.allclose(g, want, atol=1e-12), fn.__name__
    assert flags.parse_train_args(["--loss", "dppo"], "").eps_high == variants.DPPO_DELTA


def test_dppo_caps_the_weight_of_a_token_whose_probability_rose_past_the_cap():
    # rare tokens, where DPPO's band (p - p_old <= 0.2) lets the ratio grow far: p_old 0.001 -> p
    # 0.03 (ratio 30, p - p_old 0.029: inside the band), 0.004 -> 0.04 (ratio 10), 0.6 -> 0.9
    # (past the band: masked). A > 0, token reduction over 3 tokens: each token's gradient is
    # -A * min(ratio, DPPO_RATIO_CAP = 20) / 3, so the first is capped at 20, not 30
    old = torch.tensor([[0.001, 0.004, 0.6]], dtype=torch.float64).log()
    logp = torch.tensor([[0.03, 0.04, 0.9]], dtype=torch.float64).log().requires_grad_(True)
    mask, adv = torch.ones(1, 3, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)
    loss, m = variants.dppo_loss(logp, old, adv, mask, grpo.token_weights(mask, "token"))
    g = torch.autograd.grad(loss, logp)[0]
    assert torch.allclose(g, torch.tensor([[-2.0 * 20 / 3, -2.0 * 10 / 3, 0.0]],
                                          dtype=torch.float64))
    assert m["clip/high_frac"] == pytest.approx(1 / 3)
    assert _verl_dppo_tv(old, logp, adv[:, None].expand(1, 3), mask, 0.2, 0.2,
                         "token-mean").item() == pytest.approx(loss.item())


@pytest.mark.parametrize("loss", ["dppo", "sapo"])
def test_dppo_and_sapo_run_through_train(tiny_run_inputs, tmp_path, loss):
    from helpers import one_step
    row = one_step(tiny_run_inputs, tmp_path / loss, "--loss", loss, "--mu", "2")
    assert row["loss"] == row["loss"] and row["grad_norm"] > 0     # finite, and it trained


# ---------------------------------------------------------------------------------------------
# docs/from-trl.md's conformance table: TRL's loss_types and verl's loss_agg_modes on one batch
# ---------------------------------------------------------------------------------------------

def _conformance_batch():
    """4 responses of 6, 3, 5 and 2 tokens (T = 6 = --max-new-tokens), off-policy by ~0.3 nats."""
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 - 0.2
    logp = (old + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 5, 2])[:, None]).double()
    return logp, old, adv, mask


def _trl_per_token(logp, old, adv, eps_low=0.2, eps_high=0.28):
    """TRL's per_token_loss: -min(coef_1 A, clamp(coef_1, 1 - epsilon, 1 + epsilon_high) A)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    return -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])


CONFORMANCE = [  # (anchor setting, its reduction of per_token_loss [N, T] by mask, ours or None)
    ('TRL `loss_type="grpo"`', lambda x, m: ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
     "sequence"),
    ('TRL `loss_type="dapo"`', lambda x, m: (x * m).sum() / m.sum(), "token"),
    ('TRL `loss_type="bnpo"`', lambda x, m: (x * m).sum() / m.sum().clamp(min=1.0), "token"),
    ('TRL `loss_type="dr_grpo"`', lambda x, m: (x * m).sum() / (x.size(0) * 6), "constant"),
    ('verl `loss_agg_mode="token-mean"`', lambda x, m: (x * m).sum() / m.sum(), "token"),
    ('verl `"seq-mean-token-mean"`', lambda x, m: ((x * m).sum(-1) / m.sum(-1)).mean(),
     "sequence"),
    ('verl `"seq-mean-token-sum-norm"`', lambda x, m: ((x * m).sum(-1) / m.shape[-1]).mean(),
     "constant"),
    ('verl `"seq-mean-token-sum"`', lambda x, m: (x * m).sum(-1).mean(), None),
]


def test_trl_and_verl_reductions_conform_to_the_flags_here():
    # for one batch (one micro-batch on one rank, as TRL and verl see a whole update), each anchor
    # reduction of TRL's PPO per-token loss equals grpo.ppo_loss under the --reduction named, in
    # value and gradient to 1e-6; docs/from-trl.md's table holds these values (read back here)
    logp, old, adv, mask = _conformance_batch()
    doc = read_file(os.path.join(HERE, "docs", "from-trl.md"))
    for anchor, reduce, ours in CONFORMANCE:
        want, g_want = _value_and_grad(lambda reduce=reduce: reduce(
            _trl_per_token(logp, old, adv), mask), logp)
        row = next(line for line in doc.splitlines() if line.startswith(f"| {anchor} |"))
        assert f"| {want.item():.6f} |" in row, (anchor, want.item(), row)
        if ours is None:
            continue
        w = grpo.token_weights(mask, ours, max_len=6)
        got, g_got = _value_and_grad(lambda w=w: grpo.ppo_loss(logp, old, adv, mask, w, 0.2,
                                                                0.28)[0], logp)
        assert abs(got.item() - want.item()) < 1e-6 and (g_got - g_want).abs().max() < 1e-6, anchor
        assert f"`--reduction {ours}`" in row, row
        print(f"| {anchor} | `--reduction {ours}` | {want.item():.6f} | {got.item():.6f} | "
              f"{(g_got - g_want).abs().max().item():.1e} |")
