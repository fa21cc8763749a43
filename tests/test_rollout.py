"""How Step 1 runs (infra/rollout.py, infra/kv_cache.py, infra/static_decode.py): the --kv-cache-gb
sizing against the buffers allocated, and --compile's static-shape batch against the eager one.

    python -m pytest -q tests/test_rollout.py
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sampler
from infra import (
    flags,
    kv_cache,
    rollout,
    static_decode,
)
from sampler import sample_groups
from test_grpo import MIXED_PROMPTS, PROMPTS, one_step, tiny, tiny_gpt2_sampler


def test_num_seqs_within_is_the_kv_formula_of_the_buffers_allocated(monkeypatch):
    made, make = [], kv_cache.make_cache
    monkeypatch.setattr(kv_cache, "make_cache", lambda *a, **k: made.append(make(*a, **k))
                        or made[-1])
    for model, per_pos in ((tiny("qwen2", torch.float32), 2 * 2 * 8 * 2 * 4),
                           (tiny_gpt2_sampler(), 2 * 4 * 8 * 2 * 4)):
        # layers x KV heads x head_dim x 2 (K, V) x 4 bytes: Qwen2 2 x 2 x 8, GPT-2 2 x 4 (all
        # heads) x 8; per row: the longest of MIXED_PROMPTS, 6, + T = 20
        per_row = per_pos * (6 + 20)
        # a multiple of G
        assert rollout.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 10.5 * per_row / 2**30) == 9
        # at least G
        assert rollout.num_seqs_within(model, MIXED_PROMPTS, 3, 20, 1e-9) == 3
        # bf16 keys: half the bytes, twice the rows
        with torch.autocast("cpu", torch.bfloat16):
            assert rollout.num_seqs_within(model, MIXED_PROMPTS, 3, 20,
                                           10.5 * per_row / 2**30) == 21
        made.clear()
        sample_groups(model, MIXED_PROMPTS, 3, 20, 1, 0, generator=torch.Generator().manual_seed(0),
                      max_num_seqs=9)
        layers = made[0][0].layers
        # what was allocated
        assert sum(la.kbuf.nbytes + la.vbuf.nbytes for la in layers) == 9 * per_row


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
    return model, lambda S, temperature, top_p=1.0, compile=True, lean=True: sample_groups(
        model, prompts, 3, 24, [1, 2], 0, temperature=temperature, top_p=top_p, max_num_seqs=S,
        generator=[torch.Generator().manual_seed(60 + i) for i in range(5)],
        static=static_decode if compile else None, lean=lean)


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


def test_packed_weights_give_the_plain_rollout(monkeypatch):
    # infra/packed.py: the eager loop's matmuls through weights packed by oneDNN give the rollout of
    # the plain weights (_static_case: prompts of 131-144 tokens sharing 130, GQA, q/k/v biases; 7
    # slots for 15 rows, so rows leave and groups enter): greedy, sampled, top-p, and with LoRA's
    # adapters (peft); the packed forward ran for every Linear, and after the rollout each Linear's
    # own forward is back. Under bf16 autocast nothing is packed (the matmuls are autocast's), nor
    # weights under MIN_WEIGHT (the test's model is all small: a threshold of 0 packs them). The
    # decode runs through the HF forward here (lean=False; infra/lean_decode.py packs its own)
    from infra import packed
    monkeypatch.setattr(packed, "MIN_WEIGHT", 0)               # this model's weights are small
    made, pack = [], packed.packed_forward
    monkeypatch.setattr(packed, "packed_forward", lambda *a: made.append(a[0]) or pack(*a))
    model, rollout = _static_case()
    with torch.no_grad():
        for m in packed.linears(model):
            if m.bias is not None:                                   # q, k, v: zero at init
                m.bias.normal_(std=0.3)

    def both(temperature, top_p=1.0):
        """(packed, plain) rollouts at 7 slots; `made`: the weights packed for the first."""
        made.clear()
        got = rollout(7, temperature, top_p, compile=False, lean=False)
        with monkeypatch.context() as m:
            m.setattr(packed, "can_pack", lambda model: False)
            return got, rollout(7, temperature, top_p, compile=False, lean=False)
    weights = [m.weight for m in packed.linears(model)]
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.9, 0.8)):
        got, want = both(temperature, top_p)
        assert temperature == 0 or (want.lengths.min() < 5 and want.truncated.any())
        _same_rollout(got, want)
        assert made == weights                                       # each Linear packed once
    assert not any("forward" in m.__dict__ for m in packed.linears(model))
    made.clear()
    with torch.autocast("cpu", torch.bfloat16):
        rollout(7, 1.0, compile=False, lean=False)
    assert made == []
    with monkeypatch.context() as m:
        m.setattr(packed, "MIN_WEIGHT", 64 * 32 + 1)
        rollout(7, 1.0, compile=False, lean=False)
    assert made == []
    pytest.importorskip("peft", reason="LoRA needs peft")
    from infra import lora
    lora.add_adapters(model, 2, 4.0, "q_proj,v_proj", "tiny")
    adapters = [m.weight for m in packed.linears(model) if 2 in m.weight.shape]   # A [2, 32], B
    assert len(adapters) == 2 * 2 * 2                       # 2 layers x q, v x A, B
    for w in adapters:                                       # B is zero at init: make them count
        torch.nn.init.normal_(w, std=0.3)
    got, want = both(1.0)
    _same_rollout(got, want)
    assert len(made) == len(weights) + len(adapters)


def test_lean_decode_is_the_hf_rollout(monkeypatch):
    # infra/lean_decode.py: the eager loop's decode step as plain ops gives the HF forward's rollout
    # (tokens equal, log-probs within 1e-5): _static_case's Qwen2 (GQA, q/k/v biases made nonzero,
    # prompts of 131-144 tokens sharing 130: past a KV block) and a Llama with attention and MLP
    # biases, at 7 slots (rows leave, groups enter) and at all, greedy, sampled and top-p, and with
    # its fused weights packed by oneDNN; it ran every decode step. Where it does not apply it is
    # not built: LoRA's layers, bf16 autocast or weights, a sliding window, eager attention, q/k
    # norms (Qwen3)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from infra import lean_decode, packed
    from infra.lean_decode import LeanDecoder
    ran, step = [], LeanDecoder.step
    monkeypatch.setattr(LeanDecoder, "step", lambda self, *a: ran.append(1) or step(self, *a))
    qwen2, rollout = _static_case()
    torch.manual_seed(4)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, attention_bias=True, mlp_bias=True,
        initializer_range=0.2)).eval()
    for model in (qwen2, llama):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):                               # zero at init
                    p.normal_(std=0.3)
    prefix = [17 + i % 47 for i in range(130)]
    prompts = [prefix[:k] + [20 + (7 * j) % 40] for j, k in enumerate((3, 130, 40, 9))]
    cases = [lambda S, t, p, lean: rollout(S, t, p, compile=False, lean=lean),
             lambda S, t, p, lean: sample_groups(
                 llama, prompts, 3, 20, [1, 2], 0, temperature=t, top_p=p, max_num_seqs=S,
                 generator=[torch.Generator().manual_seed(70 + i) for i in range(4)], lean=lean)]
    for case in cases:
        for S in (7, None):
            for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.9, 0.8)):
                ran.clear()
                want = case(S, temperature, top_p, False)
                assert ran == []
                got = case(S, temperature, top_p, True)
                assert len(ran) >= int(want.lengths.max()) - 1          # every decode step
                assert temperature == 0 or want.lengths.min() < want.lengths.max()
                _same_rollout(got, want)
        with monkeypatch.context() as m:
            m.setattr(packed, "MIN_WEIGHT", 0)                          # every fused weight packed
            _same_rollout(case(7, 1.0, 1.0, True), case(7, 1.0, 1.0, False))
    made, pack = [], packed.packed_forward                    # packed=False: nothing packed, lean
    monkeypatch.setattr(packed, "packed_forward", lambda *a: made.append(a[0]) or pack(*a))
    monkeypatch.setattr(packed, "MIN_WEIGHT", 0)
    for packs in (False, True):
        made.clear()
        sample_groups(llama, prompts, 3, 4, [1, 2], 0, packed=packs)
        # packed: the model's 15 Linears (packed_linears) and per layer the fused q/k/v, gate/up
        assert len(made) == packs * (2 * 7 + 1 + 2 * 2)
    monkeypatch.undo()
    assert LeanDecoder.build(llama, 4) is not None
    with torch.autocast("cpu", torch.bfloat16):
        assert LeanDecoder.build(llama, 4) is None
    assert LeanDecoder.build(tiny("qwen2", torch.bfloat16), 4) is None
    assert LeanDecoder.build(tiny("mistral", torch.float32), 4) is None          # window 5
    llama.config._attn_implementation = "eager"                        # the user's choice, kept
    assert LeanDecoder.build(llama, 4) is None
    llama.config._attn_implementation = "sdpa"
    assert LeanDecoder.build(Qwen3ForCausalLM(Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8)), 4) is None
    assert lean_decode.FAMILY == ("llama", "qwen2", "mistral")
    pytest.importorskip("peft", reason="LoRA needs peft")
    from infra import lora
    lora.add_adapters(llama, 2, 4.0, "q_proj,v_proj", "tiny")
    assert LeanDecoder.build(llama, 4) is None


def test_compile_where_it_cannot_run_warns_once_and_decodes_eagerly(monkeypatch):
    # no C++ compiler for inductor (CPU), and a sliding window shorter than P + T: one line, then
    # the eager loop (the static one is never entered)
    import shutil

    from infra import static_decode
    monkeypatch.setattr(static_decode, "StaticSteps",
                        lambda *a, **k: pytest.fail("static loop ran"))
    _, rollout = _static_case()
    want = rollout(6, 1.0, compile=False)
    with monkeypatch.context() as m:
        m.setattr(shutil, "which", lambda *a, **k: None)
        with pytest.warns(UserWarning, match=r"^--compile: no C\+\+ compiler .*decoding eagerly$"):
            _same_rollout(rollout(6, 1.0), want, tol=0)
    mistral = tiny("mistral", torch.float32)                                  # window 5
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
    one_step(d, tmp_path / "off")
    assert shapes == []
    one_step(d, tmp_path / "on", "--compile")
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
    # time printed once; greedy and sampled rollouts as eager's; and after an in-place update of the
    # weights (an optimizer step) the compiled step reads the new ones (no stale constants)
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
    advance = sampler.EagerSteps.advance

    def recorded(self, tok, keep):
        with _Fresh() as seen:
            advance(self, tok, keep)
        layer = self.cache.layers[0]
        if self.rows.numel():
            steps.append((layer.keys.numel(), seen.made, layer.kbuf.dtype, layer.vbuf.dtype))

    monkeypatch.setattr(sampler.EagerSteps, "advance", recorded)
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

    from infra import lora
    model = tiny("qwen2", torch.float32)
    lora.add_adapters(model, 2, 4.0, lora.TARGETS, "tiny")
    frozen = {tuple(m.weight.shape) for m in model.modules()
              if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    assert len(frozen) >= 3                         # q/k/v/o/gate/up/down base weights' shapes
    casts, advance = [], sampler.EagerSteps.advance

    def recorded(self, tok, keep):
        with _Fresh() as seen:
            advance(self, tok, keep)
        casts.append([m for m in seen.made if m[0] == "aten._to_copy.default"])

    monkeypatch.setattr(sampler.EagerSteps, "advance", recorded)
    args = SimpleNamespace(max_new_tokens=12, max_num_seqs=None, kv_cache_gb=1.0, bf16=True,
                           compile=False)
    rollout.sample_rollout(model, MIXED_PROMPTS, 2, 1.0, 1.0, torch.Generator().manual_seed(0),
                           [1], 0, args)
    assert len(casts) > 5
    weight_casts = [c for step in casts for c in step if c[3] in frozen]
    assert not weight_casts, f"{len(weight_casts)} casts of frozen weights in {len(casts)} steps"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight                 # still tied



def test_bf16_rollout_sizes_its_slots_for_a_bf16_cache(monkeypatch):
    # --kv-cache-gb's rows were counted outside autocast, at 4 bytes a value, while the cache is
    # stored in bf16 (2): half the rows the budget holds. Qwen2 tiny: 2 layers x 2 KV heads x
    # head_dim 8 x 2 (K, V) x (6 + 20) positions = 1,664 values a row
    from types import SimpleNamespace
    model, seen = tiny("qwen2", torch.float32), []
    monkeypatch.setattr(sampler, "sample_groups",
                        lambda *a, **k: seen.append(k["max_num_seqs"]))
    per_row = 2 * 2 * 8 * 2 * 26
    for bf16, want in ((False, 12), (True, 24)):
        args = SimpleNamespace(max_new_tokens=20, max_num_seqs=None, bf16=bf16, compile=False,
                               kv_cache_gb=12.5 * per_row * 4 / 2**30)      # 12.5 float32 rows
        rollout.sample_rollout(model, MIXED_PROMPTS, 3, 1.0, 1.0, None, [1], 0, args)
        assert seen[-1] == want                      # a multiple of G = 3: 12 float32, 24 bf16
