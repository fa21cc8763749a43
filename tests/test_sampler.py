"""sampler.py: inverse-CDF sampling, the batched sampler against generate, top-p, --max-num-seqs and
continuous batching, Rollout. Article section: "Step 1: Rollout 采样".

    python -m pytest -q tests/test_sampler.py
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import logprobs
from harness import models, rollout
from helpers import (
    LONG_PROMPTS,
    MIXED_PROMPTS,
    PROMPTS,
    fake_rollout,
    full_forward_logprobs,
    sgd_update,
    tiny,
    tiny_gpt2_sampler,
)
from infra import kv_cache
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups


def test_sample_token_inverse_cdf_by_hand():
    from sampler import sample_token
    # probabilities [0.5, 0.3, 0.2, 0]: running mass [0.5, 0.8, 1, 1]; u picks the first token whose
    # running mass exceeds u * (kept mass). The token without mass is never drawn, even at u -> 1.
    # top_p 0.6 keeps {0, 1} (mass 0.8: token 2 has 0.8 >= 0.6 ahead of it); top_p -> 0 keeps the
    # top token only. The log-prob is the one under the nucleus drawn from: p / (kept mass), and
    # the nucleus' size comes back (None without top-p).
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    cases = [(0.0, 1.0, 0, None), (0.49, 1.0, 0, None), (0.51, 1.0, 1, None),
             (0.81, 1.0, 2, None), (1 - 2 ** -24, 1.0, 2, None), (0.4, 0.6, 0, 2),
             (0.7, 0.6, 1, 2), (0.99, 0.6, 1, 2), (0.99, 1e-9, 0, 1), (0.99, 0.9, 2, 3)]
    for dtype in (torch.float32, torch.bfloat16):
        for u, top_p, want, kept in cases:
            tok, lp, k = sample_token(p.log().to(dtype)[None].clone(), torch.tensor([u]), 1.0,
                                      top_p)
            assert tok.item() == want, (dtype, u, top_p)
            mass = 1.0 if kept is None else p[:kept].sum().item()
            assert abs(lp.exp().item() - p[want].item() / mass) < (
                1e-6 if dtype == torch.float32 else 1e-2)
            assert (k is None) if kept is None else k.tolist() == [kept]
    # temperature 0.5 squares the probabilities: [0.25, 0.09, 0.04] / 0.38, and the log-prob is the
    # tempered one
    tok, lp, _ = sample_token(p.log()[None].clone(), torch.tensor([0.7]), 0.5, 1.0)
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
    tok, lp, _ = sampler.sample_token(logits.clone(), u, 0.7, 1.0, work)
    assert torch.equal(tok, want)
    assert torch.allclose(lp.double(), p.gather(-1, tok[:, None]).squeeze(-1).log(), atol=1e-5)
    # the padding stays zero for the next step
    assert work[:, V:].abs().sum() == 0
    # without a work buffer: the same draws
    tok2, _, _ = sampler.sample_token(logits.clone(), u, 0.7, 1.0)
    assert torch.equal(tok2, tok)




@pytest.mark.parametrize("kind,dtype,prompts", [
    ("qwen2", torch.float32, PROMPTS), ("qwen2", torch.bfloat16, PROMPTS),
    ("mistral", torch.float32, PROMPTS),
    ("qwen2", torch.float32, LONG_PROMPTS), ("mistral", torch.float32, LONG_PROMPTS)],
    ids=["qwen2", "qwen2-bf16", "mistral", "qwen2-long", "mistral-long"])
def test_sampler_greedy_groups_equal_generate_alone_with_rows_finishing_early(kind, dtype, prompts):
    # -long: prompts of 141-146 tokens sharing a 140-token prefix (past a KV block, and the window
    # of 5)
    model, G, T = tiny(kind, dtype), 3, 24
    layers = {type(layer).__name__ for layer in kv_cache.make_cache(model, 8)[0].layers}
    assert (layers == {"BufferedLayer"}
            and kv_cache.make_cache(model, 8)[1] == (None if kind == "qwen2" else 5))
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
    model, T = tiny("qwen2", torch.float32), 24
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


def _nucleus_by_hand(model, prompt, response, temperature, kept):
    """The nucleus objective written out from a full forward: log-softmax(logits / t), sorted, the
    token's log-prob less the log-mass of the kept[t] most probable tokens; also the full log-probs
    [L, V] and the smallest count whose mass reaches each top-p (for the caller to check `kept`)."""
    ids = torch.tensor([prompt + response])
    z = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature        # [L, V]
    logp = torch.log_softmax(z, -1)                                             # [L, V]
    top = logp.sort(dim=-1, descending=True, stable=True).values                    # [L, V]
    inside = torch.arange(logp.shape[-1])[None] < kept[:, None]                 # [L, V] sorted
    mass = top.masked_fill(~inside, -math.inf).logsumexp(-1)                    # [L]
    tok = torch.tensor(response)
    return logp.gather(-1, tok[:, None]).squeeze(-1) - mass, logp


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_sampler_top_p_logprobs_are_the_nucleus_and_the_trainer_recomputes_them(dtype, atol,
                                                                                 monkeypatch):
    # --top-p 0.8: each token is drawn from the smallest set of most probable tokens whose mass
    # reaches 0.8 of the tempered distribution, renormalised. The sampler reports the token's
    # log-prob under that nucleus and its size (Rollout.kept); the trainer's forwards
    # (shared-prefix, per-response; fused and plain head) given the sizes return the same log-probs
    # to 1e-5, where the full distribution's are below them by the log of the kept mass.
    model, G, t, top_p = tiny("qwen2", dtype), 4, 0.8, 0.8
    roll = sample_groups(model, PROMPTS, G, 16, 1, 0, temperature=t, top_p=top_p,
                         generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    N, V = roll.response_ids.shape[0], model.config.vocab_size
    assert roll.kept is not None and roll.kept.shape == roll.response_ids.shape
    assert (roll.kept * (1 - roll.mask).long()).abs().sum() == 0               # 0 past the ends
    gap = 0.0
    for i in range(N):
        L, resp = int(roll.lengths[i]), roll.response_ids[i, :int(roll.lengths[i])].tolist()
        kept = roll.kept[i, :L]
        with torch.no_grad():
            want, logp = _nucleus_by_hand(model, PROMPTS[i // G], resp, t, kept)
        assert torch.allclose(roll.logprobs[i, :L], want, atol=atol)
        gap = max(gap, (want - logp.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)).max())
        if dtype == torch.float32:    # kept is the nucleus: the smallest count reaching top_p
            cum = logp.exp().sort(-1, descending=True).values.cumsum(-1)       # [L, V]
            reach = (cum < top_p - 1e-6).sum(-1) + 1                           # [L]
            assert (kept - reach).abs().max() <= 1, (kept, reach)
            rank = (logp > logp.gather(-1, torch.tensor(resp)[:, None])).sum(-1)  # [L]
            assert (rank < kept).all()                             # the token is inside it
    assert 1 < roll.kept[roll.mask.bool()].float().mean() < V and gap > 0.05
    if dtype != torch.float32:
        return
    every = slice(0, N)
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(logprobs.lm_head, "fusable", lambda m: "a test's plain head")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for f in (rollout_logprobs, logprobs.per_response_logprobs):
                lp = f(model, roll, every, t)[0] * roll.mask                   # [N, T]
                assert torch.allclose(lp, roll.logprobs, atol=1e-5), (fused, f.__name__)
            # without the sizes: the full distribution's, off by the log of the kept mass
            full = rollout_logprobs(model, dataclasses.replace(roll, kept=None), every, t)[0]
            assert ((roll.logprobs - full) * roll.mask).max() > 0.05




@pytest.mark.parametrize("fused", [True, False])
def test_update_at_top_p_is_the_gradient_of_the_nucleus_objective_by_hand(fused, monkeypatch):
    # One update (ratio 1, beta 0, token reduction, SGD at lr 1) on a rollout drawn at top-p 0.7
    # from a model with a 48-token vocabulary: the parameters move by minus the gradient of
    # -sum_t w A exp(lp_nuc - sg(lp_nuc)), lp_nuc the nucleus log-prob written out with a sort
    # (_nucleus_by_hand). The full distribution's gradient is another one (the check can fail).
    import copy

    if not fused:
        monkeypatch.setattr(logprobs.lm_head, "fusable", lambda m: "a test's plain head")
    model, G, t = tiny("qwen2", torch.float32), 4, 0.9
    roll = sample_groups(model, PROMPTS, G, 12, 1, 0, temperature=t, top_p=0.7,
                         generator=[torch.Generator().manual_seed(s) for s in (4, 5, 6)])
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // G).repeat_interleave(G)
    A = torch.randn(N, generator=torch.Generator().manual_seed(2))             # [N]
    mine = sgd_update(model, roll, A, temperature=t, top_p=0.7)

    def hand_gradient(nucleus):
        hand = copy.deepcopy(model).train()
        loss, n_tok = 0.0, roll.mask.sum()
        for i in range(N):
            L = int(roll.lengths[i])
            resp = roll.response_ids[i, :L].tolist()
            kept = roll.kept[i, :L] if nucleus else torch.full((L,), 48)
            lp = _nucleus_by_hand(hand, PROMPTS[i // G], resp, t, kept)[0]    # [L]
            loss = loss - (A[i] * torch.exp(lp - lp.detach())).sum() / n_tok
        loss.backward()
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in hand.parameters()]

    moved = [q - p for p, q in zip(model.parameters(), mine.parameters())]
    for nucleus in (True, False):
        want = [-g for g in hand_gradient(nucleus)]
        err = max((m - w).abs().max().item() for m, w in zip(moved, want))
        scale = max(w.abs().max().item() for w in want)
        if nucleus:
            assert scale > 1e-3 and err <= 1e-5 * max(1.0, scale), (err, scale)
        else:
            assert err > 1e-3, err


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
    model = {"llama": lambda: tiny_model, "gpt2": tiny_gpt2_sampler,
             "mistral-wide": _tiny_mistral_wide}.get(
        kind, lambda: tiny(kind, torch.float32))()
    # several end ids: lengths roughly geometric, some rows truncated
    ends, T = [1, 2, 3, 20], 20
    made, make = [], kv_cache.make_cache
    monkeypatch.setattr(kv_cache, "make_cache", lambda *a, **k: made.append(make(*a, **k))
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
            want = full_forward_logprobs(model, MIXED_PROMPTS[i // G],
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


def test_max_num_seqs_refills_a_freed_slot_at_once(monkeypatch):
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
    args = SimpleNamespace(max_new_tokens=T, max_num_seqs=S, bf16=False)
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


def test_sampler_under_bf16_autocast_gives_the_same_rollout_for_every_n(tiny_model):
    # under CPU autocast a decode step's keys may come out in another dtype than the prefill's: the
    # write into the slots' buffer takes the buffer's dtype (an indexed write does not cast), as
    # train.py --bf16 samples
    with torch.autocast("cpu", torch.bfloat16):
        rolls = [sample_groups(tiny_model, PROMPTS, 2, 12, eos_token_id=1, pad_token_id=0,
                               temperature=0.0, max_num_seqs=n) for n in (2, None)]
    assert (torch.equal(rolls[0].response_ids, rolls[1].response_ids)
            and torch.equal(rolls[0].lengths, rolls[1].lengths))


def test_rollout_select_and_cat():
    r = fake_rollout([[1, 0], [0, 0], [1, 1]])
    s = r.select_groups(torch.tensor([True, False, True]))
    assert s.prompts == [[0], [2]] and s.response_ids.shape[0] == 4
    c = Rollout.cat([s, r])
    assert c.num_groups == 5 and c.correct.shape == (10,) and c.rewards is None
    # a longer rollout pads the shorter one's rows: never a valid mask position, never a log-prob
    long = fake_rollout([[1, 0]])
    long.response_ids, long.mask, long.logprobs = (torch.ones(2, 5, dtype=torch.long),
                                                   torch.ones(2, 5), -torch.ones(2, 5))
    c = Rollout.cat([r, long])
    assert (c.mask.shape == (8, 5) and c.mask[:6, 2:].sum() == 0
            and c.logprobs[:6, 2:].abs().sum() == 0)
    assert (c.response_ids[:6, 2:] == r.pad_token_id).all() and c.mask[6:].sum() == 10


