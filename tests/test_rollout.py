"""How Step 1 runs (harness/rollout.py, infra/kv_cache.py, infra/packed.py): the KV cache's bytes
against the buffers allocated, every slot count's rollout against all rows at once, packed weights
against plain ones.

    python -m pytest -q tests/test_rollout.py
"""
from __future__ import annotations

import pytest
import torch

from infra import kv_cache
from sampler import sample_groups
from test_grpo import MIXED_PROMPTS, tiny, tiny_gpt2_sampler


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
