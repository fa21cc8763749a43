"""Memory at the recipes' shapes (infra/lm_head.py, logprobs.py, update.py): the LM head fused with
the log-softmax against the plain head, no [n, T, V] tensor in the training forward at Qwen's
vocabulary of 151,936, the entropy without a graph unless its bonus is on, no KV cache written by
the training forward.

    python -m pytest -q tests/test_memory.py
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import logprobs
from bench.memory import rollout_of, tiny_qwen
from infra import lm_head
from sampler import Rollout

V_QWEN = 151_936


def _naive(h, W, b, ids, t):
    """The plain head: logits [.., V] = h W^T + b, log softmax(logits / t), its entropy."""
    logp = torch.log_softmax((h @ W.t() + b) / t, -1)
    return logp.gather(-1, ids[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_fused_head_equals_the_plain_head_values_and_gradients(entropy_grad, monkeypatch):
    # 3 rows a chunk over 2 x 5 positions, temperature 0.7, a bias: the log-probs and entropies,
    # and the gradients of the hidden states, W and b, equal autograd through the plain head; the
    # entropy's gradient term is there only when asked for
    torch.manual_seed(0)
    V, H = 300, 8
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    h = torch.randn(2, 5, H, requires_grad=True)
    W, b = (torch.randn(V, H) * 2).requires_grad_(True), torch.randn(V).requires_grad_(True)
    ids, w1, w2 = torch.randint(0, V, (2, 5)), torch.randn(2, 5), torch.randn(2, 5)
    out = lm_head._FusedHead.apply(h, W, b, ids, None, 1 / 0.7, True, entropy_grad,
                                   False)  # [2, 5, 2]
    want_lp, want_ent = _naive(h, W, b, ids, 0.7)
    assert torch.allclose(out[..., 0], want_lp, atol=1e-5)
    assert torch.allclose(out[..., 1], want_ent, atol=1e-5)
    got = torch.autograd.grad((out[..., 0] * w1 + out[..., 1] * w2).sum(), (h, W, b))
    loss = (want_lp * w1 + (want_ent * w2 if entropy_grad else 0)).sum()
    for g, want in zip(got, torch.autograd.grad(loss, (h, W, b))):
        assert torch.allclose(g, want, atol=1e-5), (g - want).abs().max()


def test_fused_head_under_bf16_autocast_matches_the_autocast_head():
    # under CPU autocast the chunk's matmul runs in bf16 as the plain head's would, the softmax in
    # float32, and backward recomputes under the same autocast: gradients within bf16 rounding
    torch.manual_seed(1)
    V, H = 500, 16
    h = torch.randn(3, 4, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    ids = torch.randint(0, V, (3, 4))
    with torch.autocast("cpu", torch.bfloat16):
        out = lm_head._FusedHead.apply(h, W, None, ids, None, 1.0, False, False, False)
        logits = torch.nn.functional.linear(h, W)                             # bf16 [3, 4, V]
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(out[..., 0], want, atol=1e-4)
    g = torch.autograd.grad(out[..., 0].sum(), (h, W))
    g_want = torch.autograd.grad(want.sum(), (h, W))
    for a, b in zip(g, g_want):
        assert torch.allclose(a, b, atol=3e-2 * b.abs().max())


def _nucleus_naive(z, ids, kept):
    """The nucleus objective written out: logits z [n, V], ids [n], kept [n] (0: all of V) ->
    log softmax(z)[id] - log(mass of the kept[i] most probable tokens), by a full sort, so autograd
    gives its gradient."""
    logp = torch.log_softmax(z, -1)                                          # [n, V]
    top = logp.sort(-1, descending=True).values                              # [n, V]
    k = torch.where(kept > 0, kept, torch.full_like(kept, z.shape[-1]))      # [n]
    inside = torch.arange(z.shape[-1])[None] < k[:, None]                    # [n, V] sorted
    mass = top.masked_fill(~inside, float("-inf")).logsumexp(-1)             # [n]
    return logp.gather(-1, ids[:, None]).squeeze(-1) - mass


def _nucleus_case(n, V, H, seed):
    """Hidden states h [n, H], a head W [V, H] and b [V], drawn tokens ids [n] and nucleus sizes
    kept [n] at the shapes where the head's bugs bite: every third row peaked (a one-token nucleus:
    the top token drawn, kept 1, as a confident model at top-p 0.9 gives), the others a nucleus
    of rank(id) + 1 + 0..5 tokens (so sizes differ from chunk to chunk), one in 7 the full
    vocabulary (0)."""
    g = torch.Generator().manual_seed(seed)
    h, W = torch.randn(n, H, generator=g), torch.randn(V, H, generator=g)
    b = torch.randn(V, generator=g)
    z = h @ W.t() + b                                                        # [n, V]
    ids = torch.randint(0, V, (n,), generator=g)
    rank = (z > z.gather(-1, ids[:, None])).sum(-1)                          # [n]
    kept = (rank + 1 + torch.randint(0, 6, (n,), generator=g)).clamp_max(V - 1)
    peaked = torch.arange(n) % 3 == 0
    ids, kept = torch.where(peaked, z.argmax(-1), ids), torch.where(peaked, 1, kept)
    kept[torch.arange(n) % 7 == 5] = 0
    return h, W, b, ids, kept


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_fused_head_at_top_p_over_many_chunks_is_the_nucleus_objective(entropy_grad,
                                                                       monkeypatch):
    # 2 x 11 positions at 3 rows a chunk (8 chunks, as 27-row chunks cut a real forward at
    # V = 151,936): each row's log-prob is under its own nucleus, never the first chunk's sizes, in
    # the forward and the backward; one-token nuclei (kept 1: the top token alone reaches top-p)
    # give log-prob 0 and no gradient, as the sampler reported, not the full log p
    V, H, t = 40, 8, 0.7
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    h, W, b, ids, kept = _nucleus_case(22, V, H, seed=3)
    h, W, b = (x.clone().requires_grad_(True) for x in (h * t, W, b * t))  # z / t as drawn above
    w1, w2 = torch.randn(22), torch.randn(22)
    out = lm_head._FusedHead.apply(h.view(2, 11, H), W, b, ids.view(2, 11), kept.view(2, 11),
                                   1 / t, True, entropy_grad, False).view(22, 2)
    z = (h @ W.t() + b) / t                                                  # [22, V]
    want = _nucleus_naive(z, ids, kept)
    logp_all = torch.log_softmax(z, -1)
    want_ent = -(logp_all.exp() * logp_all).sum(-1)                          # the full entropy
    assert torch.allclose(out[:, 0], want, atol=1e-5), (out[:, 0] - want).abs().max()
    assert torch.allclose(out[:, 1], want_ent, atol=1e-5)
    assert (out[kept == 1, 0] == 0).all() and (want[kept > 1] < -1e-3).all()
    got = torch.autograd.grad((out[:, 0] * w1 + out[:, 1] * w2).sum(), (h, W, b),
                              retain_graph=True)
    loss = (want * w1 + (want_ent * w2 if entropy_grad else 0)).sum()
    for g, g_want in zip(got, torch.autograd.grad(loss, (h, W, b))):
        assert torch.allclose(g, g_want, atol=1e-5), (g - g_want).abs().max()
    if not entropy_grad:                                  # a one-token nucleus has no gradient
        g_h = torch.autograd.grad(out[:, 0].sum(), h)[0]
        assert (g_h[kept == 1] == 0).all() and (g_h[kept > 1].abs().sum(-1) > 0).all()


def test_plain_head_at_top_p_over_many_blocks_is_the_nucleus_objective(monkeypatch):
    # the fallback kernel (token_logprobs over [n, T, V] logits: heads the fused path refuses) at
    # 3 rows a block over 2 x 11 positions, on a contiguous tensor and on a slice of one: values
    # and gradients of each row under its own nucleus (not the first block's sizes), one-token
    # nuclei at log-prob 0 with no gradient
    V, t = 40, 0.7
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    h, W, b, ids, kept = _nucleus_case(22, V, 8, seed=4)
    base = (h @ W.t() + b).view(2, 11, V)
    for logits in (base.clone().requires_grad_(True),
                   torch.cat([base, base[:, :1]], 1).requires_grad_(True)):
        x = logits[:, :11]                                                   # [2, 11, V]
        w = torch.randn(2, 11)
        got = logprobs.token_logprobs(x * t, ids.view(2, 11), t, kept.view(2, 11))
        want = _nucleus_naive((x * t).reshape(22, V) / t, ids, kept).view(2, 11)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert (got.view(-1)[kept == 1] == 0).all()
        g, g_want = (torch.autograd.grad((y * w).sum(), logits)[0] for y in (got, want))
        assert torch.allclose(g, g_want, atol=1e-5), (g - g_want).abs().max()
        assert (g[:, :11].reshape(22, V)[kept == 1] == 0).all()


def test_nucleus_sizes_over_many_chunks_hold_the_token_drawn_past_the_edge(monkeypatch):
    # what the trainer finds for an engine's rollout (lm_head.nucleus_size, through sizes_head at
    # 3 rows a chunk): the smallest count whose mass reaches top-p, row by row in every chunk; a
    # token the engine drew just past that edge (its kernels round the edge otherwise) widens its
    # row's nucleus to hold it, so that it is scored under a nucleus that has it
    V, H, t, top_p = 40, 8, 0.7, 0.8
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    h, W, b, _, _ = _nucleus_case(22, V, H, seed=5)
    z = (h @ W.t() + b) / t                                                  # [22, V]
    logp = torch.log_softmax(z, -1)
    cum = logp.exp().sort(-1, descending=True).values.cumsum(-1)             # [22, V]
    edge = (cum < top_p).sum(-1) + 1                                         # [22] the nucleus
    order = logp.argsort(-1, descending=True)                                # [22, V]
    inside = order[torch.arange(22), (torch.arange(22) % 4).clamp_max(edge - 1)]  # within it
    past = order[torch.arange(22), edge]                                     # the next token
    drawn = torch.where(torch.arange(22) % 2 == 0, inside, past)             # [22]
    want = torch.where(torch.arange(22) % 2 == 0, edge, edge + 1)
    assert torch.equal(lm_head.nucleus_size(logp, drawn, top_p), want)
    head = torch.nn.Linear(H, V)
    head.weight.data, head.bias.data = W.clone(), b.clone()
    model = types.SimpleNamespace(get_output_embeddings=lambda: head)
    with lm_head.sizes_head(model, drawn.view(2, 11), t, top_p):
        sizes = head(h.view(2, 11, H))                                       # [2, 11, 1]
    assert torch.equal(sizes.view(-1), want)
    rank = (logp > logp.gather(-1, drawn[:, None])).sum(-1)                  # [22] ahead of it
    assert (rank < sizes.view(-1)).all()                           # every token in its nucleus


class _Storages(TorchDispatchMode):
    """The bytes of every storage an aten op returns (the largest is what the test bounds)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


class _WeightSized(TorchDispatchMode):
    """The fresh (not view, not in-place) outputs of aten ops shaped like a [V, H] weight:
    (op, dtype) each."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.made = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            self.made += [(str(func), t.dtype) for t in
                          (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape]
        return out


@pytest.mark.parametrize("frozen", [False, True])
def test_fused_head_casts_its_weight_once_a_pass_and_makes_no_dw_temporaries(frozen, monkeypatch):
    # 12 rows in 4 chunks of 3 under bf16 autocast. The backward cast W once or twice per chunk
    # (autocast's linear, outside the forward's autocast region, and `weight.to` for dh) and
    # accumulated dW through a [V, H] product and its float32 copy per chunk: 17 weight-sized
    # tensors. Now: the one cast, and dW's float32 zeros, accumulated in place. A frozen head
    # (--lora-r): the forward cast it once per chunk (autocast caches only weights that require
    # grad), the backward made a dW it then dropped; now one cast per pass and no dW.
    V, H = 300, 16
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * V)
    torch.manual_seed(0)
    h = torch.randn(3, 4, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=not frozen)
    ids = torch.randint(0, V, (3, 4))
    with _WeightSized(W.shape) as fwd, torch.autocast("cpu", torch.bfloat16):
        out = lm_head._FusedHead.apply(h, W, None, ids, None, 1.0, True, True, False)
    assert fwd.made == [("aten._to_copy.default", torch.bfloat16)]
    with _WeightSized(W.shape) as bwd:
        grads = torch.autograd.grad(out.sum(), (h,) if frozen else (h, W))
    want = [("aten._to_copy.default", torch.bfloat16)] + (
        [] if frozen else [("aten.zeros.default", torch.float32)])
    assert sorted(bwd.made) == sorted(want)
    # the values are still the autocast head's
    with torch.autocast("cpu", torch.bfloat16):
        z = torch.nn.functional.linear(h, W).float()                          # [3, 4, V]
    logp = torch.log_softmax(z, -1)
    ref = (logp.gather(-1, ids[..., None]).squeeze(-1) - (logp.exp() * logp).sum(-1)).sum()
    for a, b in zip(grads, torch.autograd.grad(ref, (h,) if frozen else (h, W))):
        assert torch.allclose(a, b, atol=3e-2 * b.abs().max())


def test_head_chunks_hold_at_least_the_weights_size_on_an_accelerator():
    # on a GPU a chunk holds at least H / 2 rows (its float32 logits as large as the bf16 W): at
    # V = 151,936 the [V, H] traffic per chunk no longer outweighs the chunk's matmuls (7B's H:
    # 1,792 rows); CPU keeps its cache-sized chunk
    assert lm_head.head_chunk_rows(151_936, 3_584, "cuda") == 1_792
    assert lm_head.head_chunk_rows(151_936, 256, "cuda") == 441
    assert lm_head.head_chunk_rows(151_936, 1_536, "cpu") == 27


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_the_training_forward_builds_no_vocabulary_sized_logits(shared_prefix, monkeypatch):
    # Qwen's vocabulary, 8 responses of 64 tokens: one [8, 64, V] float32 logits tensor is 311 MB.
    # The fused head's largest storage, forward and backward, is a chunk (27 rows x V, 16 MB) or
    # the head's own gradient (V x 16); the plain head (the fallback, forced here) builds the
    # [n, T, V] logits, so the bound fails without the fusion.
    model, roll = tiny_qwen(V_QWEN), rollout_of(V_QWEN, 8, 64)
    full = 8 * 64 * V_QWEN * 4
    sizes = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(lm_head, "fusable", lambda m: "forced off by the test")
        with warnings.catch_warnings(), _Storages() as seen:
            warnings.simplefilter("ignore")
            logp, ent, _ = logprobs.rollout_logprobs(model, roll, slice(0, 8), 1.0, True,
                                                     shared_prefix=shared_prefix,
                                                     entropy_grad=False)
            logp.sum().backward()
        sizes[fused] = seen.largest
        model.zero_grad(set_to_none=True)
    chunk = lm_head.chunk_rows(V_QWEN, torch.device("cpu")) * V_QWEN * 4
    assert sizes[True] <= chunk < full / 10, sizes
    assert sizes[False] >= full, sizes


def test_the_entropy_has_no_graph_unless_its_bonus_asks(tiny_model):
    # the first pass measures the entropy (with_entropy) and differentiates it only with the bonus
    roll = rollout_of(40, 4, 6)
    for grad in (False, True):
        _, ent, _ = logprobs.rollout_logprobs(tiny_model, roll, slice(0, 4), 1.0, True,
                                              entropy_grad=grad)
        g = torch.autograd.grad(ent.sum(), [p for p in tiny_model.parameters()],
                                allow_unused=True)
        assert any(x is not None and x.abs().sum() > 0 for x in g) == grad


def test_a_head_that_cannot_be_fused_falls_back_with_one_warning(monkeypatch):
    # final logit soft-capping transforms the logits after the head: the fused path would skip it,
    # so the plain head runs (one warning, then quiet) and the values are the capped model's
    monkeypatch.setattr(lm_head, "_WARNED", set())
    model, roll = tiny_qwen(50, softcap=30.0), rollout_of(50, 4, 5)
    assert "final_logit_softcapping" in lm_head.fusable(model)
    assert lm_head.fusable(tiny_qwen(50)) is None
    with pytest.warns(UserWarning, match="not fused") as w:
        a = logprobs.rollout_logprobs(model, roll, slice(0, 4), 1.0)[0]
        b = logprobs.rollout_logprobs(model, roll, slice(0, 4), 1.0)[0]
    assert len(w) == 1 and torch.equal(a, b)


def test_the_training_forward_writes_no_kv_cache_it_does_not_read(tiny_model, monkeypatch):
    # the per-response forward (FSDP2, gradient checkpointing) and a one-token-prompt slice run
    # with use_cache=False: no cache is built and thrown away
    calls = []
    real = type(tiny_model).forward

    def spy(self, *a, **kw):
        calls.append(kw.get("use_cache"))
        return real(self, *a, **kw)
    monkeypatch.setattr(type(tiny_model), "forward", spy)
    roll = rollout_of(40, 4, 6)
    logprobs.rollout_logprobs(tiny_model, roll, slice(0, 4), 1.0, shared_prefix=False)
    one = Rollout.from_lengths([[5]], 4, 0, roll.response_ids, roll.logprobs, roll.lengths,
                               roll.truncated)
    logprobs.rollout_logprobs(tiny_model, one, slice(0, 4), 1.0)
    assert calls == [False, False]


def test_micro_batches_by_a_token_budget_by_hand():
    # G = 2, prompts of 3 and 5 tokens; lengths 2, 10 | 3, 3 | 20, 1 (rows 4-5: the first prompt
    # again). Budget 30 positions = responses x (longest prompt + longest response): [0, 2) is
    # 2 x (3 + 10) = 26; adding row 2 would be 3 x (5 + 10) = 45; [2, 4) 2 x 8 = 16, then row 4
    # (3 + 20 = 23 alone) cannot join 3 x (5 + 20); row 5 joins it: 2 x 23 = 46 > 30, so alone
    from update import micro_slices
    roll = Rollout.from_lengths([[1] * 3, [1] * 5, [1] * 3], 2, 0, torch.zeros(6, 20).long(),
                                torch.zeros(6, 20), torch.tensor([2, 10, 3, 3, 20, 1]),
                                torch.zeros(6, dtype=torch.bool))
    cut = lambda size, budget, rows=slice(0, 6): [(s.start, s.stop) for s in  # noqa: E731
                                                  micro_slices(roll, rows, size, budget)]
    assert cut(64, 30) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert cut(64, 10**6) == [(0, 6)] and cut(4, 10**6) == [(0, 4), (4, 6)]
    assert cut(64, 1) == [(i, i + 1) for i in range(6)]          # a row over the budget: alone
    assert cut(64, 30, slice(2, 5)) == [(2, 4), (4, 5)] and cut(64, 30, slice(3, 3)) == []
    # another rank cut its rows into 2 more: this one runs as many, the extra ones empty
    from types import SimpleNamespace

    from update import plan_minibatches
    roll.index = torch.arange(3).repeat_interleave(2)
    other = SimpleNamespace(world=2, max=lambda n: n + 2, gather=lambda x: [x],
                            sum=lambda x: x.double())
    args = SimpleNamespace(mini_batches=1, micro_batch_size=64, micro_batch_tokens=30)
    (mb,) = plan_minibatches(roll, roll.mask, args, other)
    assert [(s.start, s.stop) for s in mb.micro] == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 6),
                                                     (6, 6)]


def test_the_token_budget_leaves_the_update_unchanged_and_no_gradient_is_kept(tiny_model):
    # the same update (SGD, so the gradient shows one to one) with the whole step in one pass and
    # cut by a budget of 24 positions into several micro-batches of different sizes: the global
    # denominators make the summed micro-batch gradients the whole batch's; every rank runs as
    # many passes (here one rank: the cuts are its own)
    import contextlib
    import copy
    from types import SimpleNamespace

    import update
    from helpers import mixed_rollout
    from infra import parallel
    roll = mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(3))
    planned = []

    def run(budget):
        model = copy.deepcopy(tiny_model)
        args = SimpleNamespace(micro_batch_size=64, micro_batch_tokens=budget, mini_batches=2,
                               mu=1, temperature=1.0, reduction="token", loss="ppo", fsdp=False,
                               gradient_checkpointing=False, max_new_tokens=20, eps_low=0.2,
                               eps_high=0.28, clip_c=0.0, tis_cap=0.0, off_policy_mask=0.0,
                               top_p=1.0,
                               entropy_coef=0.0,
                               beta=0.0, kl="k3", grad_clip=0.0)
        learner = update.Learner(model, model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                 contextlib.nullcontext)
        stats = update.update_policy(learner, roll, adv, roll.mask, args, parallel.Dist("cpu"))
        planned.append(stats.micro)
        # no gradient held past the update (through the rollout, evaluation, the engine's wake-up)
        assert all(p.grad is None for p in model.parameters())
        return model
    whole, cut = run(10**6), run(24)
    assert len(planned[0]) == 2 and len(planned[1]) > 4                   # 2 mini-batches
    P = lambda s: max(len(roll.prompts[i // roll.G]) for i in range(s.start, s.stop))  # noqa: E731
    assert all((s.stop - s.start) * (P(s) + int(roll.lengths[s].max())) <= 24
               or s.stop - s.start == 1 for s in planned[1])
    moved = max((p - q).abs().max().item() for p, q in zip(whole.parameters(),
                                                            tiny_model.parameters()))
    diff = max((p - q).abs().max().item() for p, q in zip(whole.parameters(), cut.parameters()))
    assert moved > 1e-3 and diff <= 1e-6 * max(1.0, moved), (moved, diff)


def test_the_memory_models_update_peak_is_its_backward_or_its_optimizer_step():
    # bench/memory.py's per_gpu by hand: the backward holds 18 B/param (float32 weights, gradients,
    # AdamW; bf16 autocast copies), the activations, four head chunks and the backward's bf16 copy
    # of the head (2 V H) and, tied, the embedding's second dense gradient; the step 16 B/param and
    # AdamW's foreach temporaries (4 B/param); the update's peak is the larger. Checked against
    # measured CPU peaks by `python -m bench --only memory` (part 4)
    from bench import memory
    shape = dict(layers=2, hidden=100, inter=400, heads=2, kv=1, params=10**7, tied=True)
    m = memory.per_gpu(shape, (1000.0, 10.0), 1, False, False, 512, 100, False, 0.0,
                       chunk_bytes=2**20, padded=False)
    tied = memory.V_QWEN * 100 * 4
    want = 18 * 10**7 + 512 * 2 * 1000 + 4 * 2**20 + 2 * memory.V_QWEN * 100 + tied
    assert m["backward"] * memory.GIB == pytest.approx(want)
    assert m["step"] * memory.GIB == pytest.approx(20 * 10**7)
    assert m["update"] == max(m["backward"], m["step"])
    untied = memory.per_gpu(dict(shape, tied=False), (1000.0, 10.0), 1, False, False, 512, 100,
                            False, 0.0, chunk_bytes=2**20, padded=False)
    assert (m["backward"] - untied["backward"]) * memory.GIB == pytest.approx(tied)
    small = memory.per_gpu(dict(shape, hidden=0), (0.0, 0.0), 1, False, False, 1, 1, False, 0.0,
                           chunk_bytes=0, adam_temp=10**8,
                           padded=False)                         # a step larger than the backward
    assert small["update"] == small["step"] == pytest.approx(26 * 10**7 / memory.GIB)


def test_the_memory_model_counts_ddp_nccl_the_rollouts_copies_and_the_padded_bias():
    # what the model left out: DDP's float32 gradient buckets (4 B/param; with
    # gradient_as_bucket_view they are the gradients in the update, and stay through the rollout)
    # and NCCL's buffers at world > 1, in both phases; the built-in sampler's bf16 weight copies
    # (autocast's, 2 B/param) beside its kv_gb of bf16 KV (--max-num-seqs rows); left-padded rows'
    # [rows, 1, row, row] bias, MASK_BYTES per element per layer (one layer under checkpointing) +
    # HF's 1-byte mask: the T^2 term
    from bench import memory
    G = memory.GIB
    shape = dict(layers=4, hidden=100, inter=400, heads=2, kv=1, params=10**8, tied=False)
    args = ((1000.0, 10.0), 1, False, False, 4096, 2048, False, 0.0)
    one = memory.per_gpu(shape, *args, padded=False)
    ddp = memory.per_gpu(shape, args[0], 8, *args[2:], padded=False)
    buckets, nccl = 4 * 10**8, memory.NCCL_GIB * G
    assert (ddp["update"] - one["update"]) * G == pytest.approx(nccl)
    assert (ddp["rollout"] - one["rollout"]) * G == pytest.approx(buckets + nccl)
    assert one["rollout"] * G == pytest.approx(12 * 10**8 + 2 * 10**8 + 8 * G)
    padded = memory.per_gpu(shape, *args, padded=True)
    rows = 4096 // 2048
    assert (padded["acts"] - one["acts"]) * G == pytest.approx(rows * 2048**2 * (2 * 4 + 1))
    ckpt = (memory.per_gpu(shape, args[0], 1, False, True, *args[4:], padded=True)["acts"]
            - memory.per_gpu(shape, args[0], 1, False, True, *args[4:], padded=False)["acts"])
    assert ckpt * G == pytest.approx(rows * 2048**2 * (2 + 1))
    assert padded["reserved"] == pytest.approx(padded["update"] * memory.RESERVED)


def test_a_left_padded_row_saves_a_bias_that_grows_with_t_squared():
    # measured on the CPU (bench/memory.padded_bias_bytes): what one more layer saves for a row
    # with one padding column, over an unpadded row, at 256 and 1,024 tokens, solved for a T + b
    # T^2: b is SDPA's bf16 [1, 1, T, T] bias, 2 bytes an element (MASK_BYTES), so at 1,024
    # tokens the bias is 16x its size at 256, where the per-token figures (32..96 tokens) see ~0
    from bench import memory
    a, b = memory.padded_bias_bytes(dict(hidden=64, inter=128, heads=4, kv=2))
    assert b == pytest.approx(memory.MASK_BYTES, rel=0.02) and a >= 0


def test_the_logits_kernel_takes_the_devices_chunk(monkeypatch):
    # the plain-head fallback (token_logprobs over [n, T, V] logits) asks infra/lm_head.py for its
    # rows per block, as the fused head does: 27 rows of V = 151,936 on CPU, 441 on a GPU (it was 27
    # everywhere: ~3,000 blocks a pass at GPU shapes)
    import logprobs
    from infra import lm_head
    real, seen = lm_head.chunk_rows, []
    monkeypatch.setattr(lm_head, "chunk_rows",
                        lambda V, device: seen.append((V, torch.device(device).type))
                        or real(V, device))
    logits, ids = torch.randn(2, 3, 50), torch.randint(0, 50, (2, 3))
    logprobs.token_logprobs(logits, ids)
    assert seen == [(50, "cpu")]
    assert (real(151_936, "cpu"), real(151_936, "cuda"), real(151_936, "cuda:3")) == (27, 441, 441)


def test_fp32_lm_head_computes_the_heads_logits_in_float32_under_bf16(monkeypatch):
    # --fp32-lm-head: under bf16 autocast, the trainer's fused head, the plain head (the sampler's
    # and evaluation's forward) and their gradients are the float32 head's on the trunk's hidden
    # states, to float32 rounding; without it they are bf16's, ~1e-2 away
    import logprobs
    from harness import setup
    V = 300
    model = tiny_qwen(V)
    roll = rollout_of(V, 4, 16)
    W = lm_head.output_layer(model).weight

    def trainer(model):
        with torch.autocast("cpu", torch.bfloat16):
            logp, _, valid = logprobs.rollout_logprobs(model, roll, slice(0, 4), 1.0, False)
        return logp, valid.bool()

    def by_hand():                                       # the trunk under autocast, head in fp32
        ids = torch.cat([torch.tensor(roll.prompts[0]).expand(4, -1), roll.response_ids], 1)
        with torch.autocast("cpu", torch.bfloat16):
            h = model.model(input_ids=ids).last_hidden_state[:, 6:-1]     # response positions
        logp = torch.log_softmax(h.float() @ W.float().t(), -1)
        return logp.gather(-1, roll.response_ids[..., None]).squeeze(-1)
    bf16, valid = trainer(model)
    lm_head.run_in_fp32(model)
    assert type(lm_head.output_layer(model)) is lm_head.Fp32Linear
    fp32, _ = trainer(model)
    want = by_hand()
    assert (fp32 - want)[valid].abs().max() < 1e-5 < (bf16 - want)[valid].abs().max()
    # the plain head (what the sampler's decode calls) is the float32 one too
    with torch.autocast("cpu", torch.bfloat16):
        z = lm_head.output_layer(model)(torch.randn(2, 16))
    assert z.dtype == torch.float32
    # and the gradient of W through the fused head is the float32 head's
    g = torch.autograd.grad(trainer(model)[0][valid].sum(), W)[0]
    g_want = torch.autograd.grad(by_hand()[valid].sum(), W)[0]
    assert torch.allclose(g, g_want, atol=1e-5 * g_want.abs().max().item() + 1e-6)
    # the flag reaches both commands' models and the engine (vLLM's head_dtype override)
    seen = {}
    monkeypatch.setattr(lm_head, "run_in_fp32", lambda m: seen.setdefault("model", m))
    monkeypatch.setattr(setup.models, "load_model", lambda *a: ("p", None, model))
    from harness import flags
    setup.load_policy(flags.parse_train_args(["--fp32-lm-head", "--device", "cpu"], ""),
                      types.SimpleNamespace(world=1, device="cpu", master=True))
    assert seen["model"] is model


def test_the_engine_runs_its_head_in_float32_with_the_flag(monkeypatch):
    import sys

    from harness import vllm_rollout
    seen = {}
    fake = types.SimpleNamespace(LLM=lambda **kw: seen.update(kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    vllm_rollout.Engine("m", "cpu", True, 0, 0.3, fp32_head=True)
    assert seen["hf_overrides"] == {"head_dtype": "float32"}
    seen.clear()
    vllm_rollout.Engine("m", "cpu", True, 0, 0.3)
    assert seen and "hf_overrides" not in seen
