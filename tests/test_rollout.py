"""How Step 1 runs (harness/rollout.py, infra/kv_cache.py, infra/packed.py): the KV cache's bytes
against the buffers allocated, every slot count's rollout against all rows at once, packed weights
against plain ones.

    python -m pytest -q tests/test_rollout.py
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sampler
from harness import rollout
from helpers import MIXED_PROMPTS, PROMPTS, tiny, tiny_gpt2_sampler
from infra import kv_cache
from sampler import sample_groups


def test_the_kv_cache_allocated_is_the_formula_of_max_num_seqs_rows(monkeypatch):
    made, make = [], kv_cache.make_cache
    monkeypatch.setattr(kv_cache, "make_cache", lambda *a, **k: made.append(make(*a, **k))
                        or made[-1])
    for model, per_pos in ((tiny("qwen2", torch.float32), 2 * 2 * 8 * 2 * 4),
                           (tiny_gpt2_sampler(), 2 * 4 * 8 * 2 * 4)):
        # layers x KV heads x head_dim x 2 (K, V) x 4 bytes: Qwen2 2 x 2 x 8, GPT-2 2 x 4 (all
        # heads) x 8; per row: the longest of MIXED_PROMPTS, 6, + T = 20
        per_row = per_pos * (6 + 20)
        made.clear()
        sample_groups(model, MIXED_PROMPTS, 3, 20, 1, 0, generator=torch.Generator().manual_seed(0),
                      max_num_seqs=9)
        layers = made[0][0].layers
        # what was allocated
        assert sum(la.kbuf.nbytes + la.vbuf.nbytes for la in layers) == 9 * per_row


def _long_case():
    """The slots' test case: a Qwen2 with 2 KV heads for 4 query heads, 5 prompts of 131-144 tokens
    sharing a 130-token prefix (past a 128-token KV block; left-padded to P = 144), G = 3, T = 24,
    2 of 64 ids end a response. Returns (model, rollout(S, temperature, top_p)), one generator
    per prompt."""
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
    return model, lambda S, temperature, top_p=1.0: sample_groups(
        model, prompts, 3, 24, [1, 2], 0, temperature=temperature, top_p=top_p, max_num_seqs=S,
        generator=[torch.Generator().manual_seed(60 + i) for i in range(5)])


def _same_rollout(a, b, tol=1e-5) -> None:
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.truncated, b.truncated)
    assert (a.logprobs - b.logprobs).abs().max() <= tol


def test_every_slot_count_gives_the_rollout_of_all_rows_at_once():
    # continuous batching (S slots, a freed slot refilled by the next group, rows moved into the
    # holes finished rows leave) is the rollout of all 15 rows decoding together, greedy and
    # sampled at 3 slots (one group at a time), 7 (one slot never used), 12 and 20 (more than the
    # rows), top-p at 7; prompts past a 128-token KV block, sharing a 130-token prefix
    _, rollout = _long_case()
    for temperature, top_p, slots in ((0.0, 1.0, (3, 7, 12, 20)), (1.0, 1.0, (3, 7, 12, 20)),
                                      (0.9, 0.8, (7,))):
        want = rollout(None, temperature, top_p)
        assert temperature == 0 or (want.lengths.min() < 5 and want.truncated.any())
        for S in slots:
            _same_rollout(rollout(S, temperature, top_p), want)


def test_packed_weights_give_the_plain_rollout(monkeypatch):
    # infra/packed.py: the eager loop's matmuls through weights packed by oneDNN give the rollout of
    # the plain weights (_long_case: prompts of 131-144 tokens sharing 130, GQA, q/k/v biases; 7
    # slots for 15 rows, so rows leave and groups enter): greedy, sampled, top-p, and with LoRA's
    # adapters (peft); the packed forward ran for every Linear, and after the rollout each Linear's
    # own forward is back. Under bf16 autocast nothing is packed (the matmuls are autocast's), nor
    # weights under MIN_WEIGHT (the test's model is all small: a threshold of 0 packs them).
    from infra import packed
    monkeypatch.setattr(packed, "MIN_WEIGHT", 0)               # this model's weights are small
    made, pack = [], packed.packed_forward
    monkeypatch.setattr(packed, "packed_forward", lambda *a: made.append(a[0]) or pack(*a))
    model, rollout = _long_case()
    with torch.no_grad():
        for m in packed.linears(model):
            if m.bias is not None:                                   # q, k, v: zero at init
                m.bias.normal_(std=0.3)

    def both(temperature, top_p=1.0):
        """(packed, plain) rollouts at 7 slots; `made`: the weights packed for the first."""
        made.clear()
        got = rollout(7, temperature, top_p)
        with monkeypatch.context() as m:
            m.setattr(packed, "can_pack", lambda model: False)
            return got, rollout(7, temperature, top_p)
    weights = [m.weight for m in packed.linears(model)]
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.9, 0.8)):
        got, want = both(temperature, top_p)
        assert temperature == 0 or (want.lengths.min() < 5 and want.truncated.any())
        _same_rollout(got, want)
        assert made == weights                                       # each Linear packed once
    assert not any("forward" in m.__dict__ for m in packed.linears(model))
    made.clear()
    with torch.autocast("cpu", torch.bfloat16):
        rollout(7, 1.0)
    assert made == []
    with monkeypatch.context() as m:
        m.setattr(packed, "MIN_WEIGHT", 64 * 32 + 1)
        rollout(7, 1.0)
    assert made == []
    pytest.importorskip("peft", reason="LoRA needs peft")
    from harness import lora
    lora.add_adapters(model, 2, 4.0, "q_proj,v_proj", "tiny")
    adapters = [m.weight for m in packed.linears(model) if 2 in m.weight.shape]   # A [2, 32], B
    assert len(adapters) == 2 * 2 * 2                       # 2 layers x q, v x A, B
    for w in adapters:                                       # B is zero at init: make them count
        torch.nn.init.normal_(w, std=0.3)
    got, want = both(1.0)
    _same_rollout(got, want)
    assert len(made) == len(weights) + len(adapters)


# ---------------------------------------------------------------------------------------------
# --top-p: the draw, the nucleus sizes through select_groups/cat, peaked rows through the trainer
# ---------------------------------------------------------------------------------------------

def test_top_p_draws_scale_the_uniform_by_the_nucleus_mass():
    # probabilities [0.5, 0.3, 0.2, 0], top-p 0.6: the nucleus {0, 1} (mass 0.8) renormalised to
    # [0.625, 0.375]. u in [0.5, 0.625) is where scaling u by the nucleus' mass (0.8 u < 0.5:
    # token 0) and by the whole mass (u >= 0.5: token 1) differ
    import sampler
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    for u in (0.5, 0.55, 0.62):
        tok, lp, k = sampler.sample_token(p.log()[None].clone(), torch.tensor([u]), 1.0, 0.6)
        assert (tok.item(), k.item()) == (0, 2) and abs(lp.exp().item() - 0.625) < 1e-6, u
    # the frequencies of 40,000 draws over 30 rows of 50 tokens at temperature 0.8, top-p 0.7
    # are the nucleus' renormalised probabilities (the whole mass' scaling gives the last nucleus
    # token the tail's mass, ~0.3 here), and each draw's log-prob is its token's in that nucleus
    g = torch.Generator().manual_seed(0)
    n, V, draws = 30, 50, 40_000
    logits = 2 * torch.randn(n, V, generator=g)
    rows = torch.arange(n).repeat(draws // n + 1)[:draws]                    # [draws]
    u = torch.rand(draws, generator=g)
    tok, lp, k = sampler.sample_token(logits[rows].clone(), u, 0.8, 0.7)
    p = torch.softmax(logits.double() / 0.8, -1)                             # [n, V]
    sorted_p, order = p.sort(-1, descending=True)
    last = (sorted_p.cumsum(-1) < 0.7 * sorted_p.sum(-1, keepdim=True)).sum(-1)  # [n]
    inside = torch.arange(V)[None] <= last[:, None]                          # [n, V] sorted
    nuc = torch.zeros_like(p).scatter_(-1, order, sorted_p * inside)
    nuc = nuc / nuc.sum(-1, keepdim=True)                                    # [n, V]
    assert torch.equal(k, last[rows] + 1)
    assert torch.allclose(lp.double().exp(), nuc[rows, tok], atol=1e-5)
    freq = torch.zeros(n, V, dtype=torch.float64).index_put_((rows, tok),
                                                             torch.ones(draws).double(), True)
    freq = freq / freq.sum(-1, keepdim=True)
    assert (freq - nuc).abs().max() < 0.06, (freq - nuc).abs().max()


def test_select_groups_and_cat_carry_each_rows_nucleus_sizes():
    # Rollout.kept is per token like logprobs: dynamic sampling (select_groups) and rounds drawn
    # ahead (cat) keep each row's own sizes, never another row's; a rollout without sizes (top-p 1,
    # an engine's) joins with zeros (the full distribution)
    from sampler import Rollout
    G, T = 2, 3
    kept = torch.arange(1, 3 * G * T + 1).view(3 * G, T)                    # [6, 3] all distinct
    roll = Rollout.from_lengths([[5], [6, 7], [8]], G, 0, torch.arange(18).view(6, 3),
                                torch.zeros(6, T), torch.full((6,), T), torch.ones(6, dtype=bool),
                                kept)
    roll.index = torch.arange(3).repeat_interleave(G)
    sel = roll.select_groups(torch.tensor([True, False, True]))
    assert torch.equal(sel.kept, kept[[0, 1, 4, 5]]) and sel.kept.shape == sel.response_ids.shape
    other = Rollout.from_lengths([[9]], G, 0, torch.zeros(2, 4, dtype=torch.long),
                                 torch.zeros(2, 4), torch.full((2,), 4), torch.ones(2, dtype=bool))
    other.index = torch.tensor([3, 3])
    both = Rollout.cat([sel, roll.select_groups(torch.tensor([False, True, False])), other])
    want = torch.nn.functional.pad(torch.cat([kept[[0, 1, 4, 5]], kept[[2, 3]]]), (0, 1))
    assert torch.equal(both.kept, torch.cat([want, torch.zeros(2, 4, dtype=torch.long)]))


@pytest.mark.parametrize("fused", [True, False])
def test_peaked_rows_at_top_p_are_scored_as_drawn_over_many_chunks(fused, monkeypatch):
    # a confident model (its final norm scaled x 10: ~40% of nuclei at top-p 0.9 are the top token
    # alone, kept 1, log-prob 0) and 3 rows a chunk of the head: the trainer's log-probs (fused and
    # plain head, shared-prefix and per-response forwards) are the sampler's, one-token nuclei
    # included, where the full distribution's are below them
    import dataclasses
    import warnings

    import logprobs
    from infra import lm_head
    model, t = tiny("qwen2", torch.float32), 1.0
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    monkeypatch.setitem(lm_head.CHUNK_ELEMENTS, "cpu", 3 * model.config.vocab_size)
    if not fused:
        monkeypatch.setattr(lm_head, "fusable", lambda m: "a test's plain head")
    roll = sample_groups(model, PROMPTS, 4, 10, 1, 0, temperature=t, top_p=0.9,
                         generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    valid = roll.mask.bool()
    ones = (roll.kept == 1) & valid
    assert 0.3 < ones.sum() / valid.sum() < 1 and (roll.logprobs[ones] == 0).all()
    every = slice(0, roll.response_ids.shape[0])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for f in (logprobs.rollout_logprobs, logprobs.per_response_logprobs):
            lp = f(model, roll, every, t)[0] * roll.mask                    # [N, T]
            assert torch.allclose(lp, roll.logprobs, atol=1e-5), (f.__name__,
                                                                   (lp - roll.logprobs).abs().max())
        full = logprobs.rollout_logprobs(model, dataclasses.replace(roll, kept=None), every, t)[0]
    assert (roll.logprobs - full)[ones].max() > 1e-3


def test_top_p_rows_in_length_buckets_are_scored_under_their_own_nuclei():
    # 5 prompts x G = 3 at top-p 0.8 whose responses end at 1-12 tokens: the shared-prefix forward
    # runs them in several length buckets, each row in its bucket scored under its own nucleus
    # sizes (Rollout.kept of that row), not those of the slice's first rows
    import warnings

    import logprobs
    from helpers import MIXED_PROMPTS
    model = tiny("qwen2", torch.float32)
    roll = sample_groups(model, MIXED_PROMPTS, 3, 12, [1, 2, 3, 4, 5, 6], 0, temperature=0.9,
                         top_p=0.8, generator=[torch.Generator().manual_seed(20 + i)
                                               for i in range(5)])
    assert len(logprobs.length_buckets(roll.lengths)) > 2
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lp = logprobs.rollout_logprobs(model, roll, slice(0, 15), 0.9)[0] * roll.mask  # [N, T]
    assert torch.allclose(lp, roll.logprobs, atol=1e-5), (lp - roll.logprobs).abs().max()



class _Fresh(TorchDispatchMode):
    """Every aten op's freshly allocated outputs (not views, not in-place): (op, numel, dtype,
    shape)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            self.made += [(str(func), t.numel(), t.dtype, tuple(t.shape)) for t in
                          (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor)]
        return out


def test_bf16_kv_cache_is_stored_in_bf16_and_no_decode_step_copies_it(monkeypatch):
    # --bf16 on float32 master weights: K leaves RoPE in float32 (the rotary cos/sin follow the
    # float32 hidden states), V leaves v_proj in bf16. A cache sized from K was float32 (twice the
    # memory), and attention then cast each layer's whole cache to bf16 at every decode step; a
    # GQA model (Qwen2 here: 4 query heads on 2 KV heads) also had HF's SDPA repeat K and V per
    # query head whenever a mask is passed (transformers < 5.23). A decode step over n rows and L
    # columns must make no tensor as large as one layer's K view, n x KV heads x L x head_dim.
    model, steps = tiny("qwen2", torch.float32), []
    advance = sampler.Slots.advance

    def recorded(self, tok, keep):
        with _Fresh() as seen:
            advance(self, tok, keep)
        layer = self.cache.layers[0]
        if self.rows.numel():
            steps.append((layer.keys.numel(), seen.made, layer.kbuf.dtype, layer.vbuf.dtype))

    monkeypatch.setattr(sampler.Slots, "advance", recorded)
    with torch.autocast("cpu", torch.bfloat16):
        roll = sample_groups(model, MIXED_PROMPTS, 3, 20, 1, 0,
                             generator=torch.Generator().manual_seed(0))
    assert roll.lengths.max() > 8 and len(steps) > 8
    for view, made, kdt, vdt in steps:
        assert (kdt, vdt) == (torch.bfloat16, torch.bfloat16)
        big = [m for m in made if m[1] >= view]
        assert not big, big[:4]


def test_decode_attention_without_repeat_is_hf_sdpa():
    # kv_cache._decode_sdpa (a decode step's q [n, H, 1, D] as [n, Hkv, g, D]) against HF's
    # SDPA with K and V repeated per query head, under a left-padding mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    torch.manual_seed(0)
    n, H, Hkv, L, D = 3, 6, 2, 7, 4
    q, k, v = torch.randn(n, H, 1, D), torch.randn(n, Hkv, L, D), torch.randn(n, Hkv, L, D)
    mask = torch.ones(n, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :3] = False                                             # row 0 left-padded
    module = type("Attn", (), {"num_key_value_groups": H // Hkv, "is_causal": True})()
    kv_cache._HF_SDPA = sdpa_attention_forward
    try:
        got, _ = kv_cache._decode_sdpa(module, q, k, v, mask, scaling=0.5)
    finally:
        kv_cache._HF_SDPA = None
    rep = lambda x: x.repeat_interleave(H // Hkv, 1)  # noqa: E731
    want = torch.nn.functional.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask,
                                                            scale=0.5).transpose(1, 2)
    assert got.shape == want.shape == (n, 1, H, D)
    assert torch.allclose(got, want, atol=1e-6)


def test_lora_rollout_under_bf16_casts_no_frozen_weight_per_decode_step(monkeypatch):
    # autocast caches the casts of weights that require grad only: with --lora-r the frozen base
    # weights were cast to bf16 again at every decode step (here 2 layers x 7 projections a step).
    # rollout.frozen_in gives the rollout bf16 copies made once: no decode step casts a frozen
    # weight; the tied head (Qwen2's, shared with the embedding) stays float32, as do the weights
    # after the rollout.
    pytest.importorskip("peft", reason="--lora-r needs peft")
    from types import SimpleNamespace

    from harness import lora
    model = tiny("qwen2", torch.float32)
    lora.add_adapters(model, 2, 4.0, lora.TARGETS, "tiny")
    frozen = {tuple(m.weight.shape) for m in model.modules()
              if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    assert len(frozen) >= 3                         # q/k/v/o/gate/up/down base weights' shapes
    casts, advance = [], sampler.Slots.advance

    def recorded(self, tok, keep):
        with _Fresh() as seen:
            advance(self, tok, keep)
        casts.append([m for m in seen.made if m[0] == "aten._to_copy.default"])

    monkeypatch.setattr(sampler.Slots, "advance", recorded)
    args = SimpleNamespace(max_new_tokens=12, max_num_seqs=None, bf16=True)
    rollout.sample_rollout(model, MIXED_PROMPTS, 2, 1.0, 1.0, torch.Generator().manual_seed(0),
                           [1], 0, args)
    assert len(casts) > 5
    weight_casts = [c for step in casts for c in step if c[3] in frozen]
    assert not weight_casts, f"{len(weight_casts)} casts of frozen weights in {len(casts)} steps"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight                 # still tied


