"""--rollout vllm: the unit tests of harness/vllm_rollout.py, and the runs for real on vLLM's CPU
backend (marked vllm, skipped where vllm cannot be imported; in the vLLM venv:
`.venv-vllm/bin/python -m pytest -q test_grpo.py tests -m vllm`)."""
from __future__ import annotations

import json
import os
import sys
import types
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from harness import builtin, data, flags
from helpers import sgd_update, tiny, tiny_flags, weights_of
from launch import ROOT, run_train, torchrun
from logprobs import rollout_logprobs
from sampler import Rollout, sample_groups

# ---------------------------------------------------------------------------------------------
# harness/vllm_rollout.py: --rollout vllm, run for real on vLLM's CPU backend (vllm-cpu, in its own
# venv, see the README: .venv-vllm/bin/python -m pytest -q test_grpo.py tests -m vllm); skipped with
# the reason without vllm
# ---------------------------------------------------------------------------------------------

def test_rollout_flags_tis_default_and_missing_vllm_is_one_line(tiny_run_inputs, tmp_path, capsys,
                                                                monkeypatch):
    import train
    assert (flags.parse_train_args([]).rollout, flags.parse_train_args([]).tis_cap) == ("hf", 0.0)
    # TIS on with an engine
    assert flags.parse_train_args(["--rollout", "vllm"]).tis_cap == flags.VLLM_TIS_CAP == 2.0
    # unless switched off
    assert flags.parse_train_args(["--rollout", "vllm", "--tis-cap", "0"]).tis_cap == 0.0
    for bad in (["--vllm-gpu-memory-utilization", "0"], ["--rollout", "sglang"]):
        with pytest.raises(SystemExit) as e:
            flags.parse_train_args(bad)
        assert e.value.code == 2
    capsys.readouterr()
    # `import vllm` raises ImportError, installed or not
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SystemExit) as e:
        train.main([*tiny_flags(tiny_run_inputs, tmp_path / "run"), "--steps", "1", "--rollout",
                    "vllm"])
    err = capsys.readouterr().err.strip()
    assert (e.value.code == 2 and len(err.splitlines()) == 1
            and err.startswith("error: --rollout vllm needs vLLM: pip install"))


def test_full_weights_gathers_one_tensor_at_a_time_under_fsdp(monkeypatch):
    # FSDP2 over a one-rank gloo group in this process: the stream yields each full tensor (equal to
    # the unsharded model's) only when it is read, so the engine never sees a second whole copy of
    # the model
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness import vllm_rollout
    from infra import parallel
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    gathers, real = [], DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: gathers.append(self.shape)
                        or real(self, **kw))
    ranks = parallel.Dist("cpu", fsdp=True)
    try:
        parallel.wrap(model, ranks, fsdp=True)
        stream, seen = vllm_rollout.full_weights(model, torch.bfloat16), {}
        for i, (name, t) in enumerate(stream):
            # gathered as read, one tensor in flight
            assert len(gathers) == i + 1
            assert (type(t) is torch.Tensor and t.dtype == torch.bfloat16
                    and torch.equal(t, plain[name].bfloat16()))
            seen[name] = t
        assert set(seen) == set(plain)
    finally:
        ranks.close()


class _RecordingLLM:
    """Stands in for vllm.LLM where the real one cannot run here (sleep mode needs CUDA): records
    the calls."""

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
def test_engine_sleeps_for_the_update_and_wakes_weights_then_kv_cache(cuda, monkeypatch):
    from harness import vllm_rollout
    engine = object.__new__(vllm_rollout.Engine)
    # PyTorch's cached blocks are handed back before the engine wakes (a stand-in: no CUDA here)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.llm.calls.append(("empty",)))
    engine.llm, engine.cuda, engine.dtype, engine.asleep = (_RecordingLLM(), cuda, torch.bfloat16,
                                                            False)
    model = tiny("qwen2", torch.float32)
    engine.sleep()
    engine.push(model)
    reload = ("reload_weights", [(n, torch.bfloat16) for n in model.state_dict()])
    want = [("sleep", 2), ("empty",), ("wake_up", ["weights"]), reload,
            ("wake_up", ["kv_cache"])] if cuda else [reload]
    # then the prefix cache goes, on CPU too: no prompt is decoded on K/V the old weights computed
    assert engine.llm.calls == [*want, ("reset_prefix_cache",)] and not engine.asleep
    # vLLM could not drop it: an error, never stale K/V
    engine.llm.reset_prefix_cache = lambda: False
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.push(model)


def test_ddp_gradients_are_its_buckets_and_no_buffer_is_broadcast(monkeypatch):
    # DDP's all-reduce buckets hold one gradient's size of the trained parameters for the whole run;
    # by default the gradients are a second copy beside them (4 B a parameter more at the update's
    # peak, which the engine's share did not leave room for). parallel.wrap asks for the gradients
    # as views into the buckets, and no buffer broadcast in each forward: on a real DDP (a one-rank
    # gloo group here) every gradient after a backward lies in one of its buckets
    import torch.distributed as dist

    from infra import parallel
    model = tiny("qwen2", torch.float32)
    built, real = [], torch.nn.parallel.DistributedDataParallel
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel",
                        lambda m, **kw: built.append(kw) or real(m, **kw))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = parallel.wrap(model, types.SimpleNamespace(world=2, device="cpu"), fsdp=False)
        assert built == [{"gradient_as_bucket_view": True, parallel.DDP_BUFFER_SYNC: False}]
        assert not ddp.will_sync_module_buffers() and len(list(model.buffers())) > 0
        for _ in range(2):                    # the buckets are rebuilt after the first backward
            model.zero_grad(set_to_none=True)
            ddp(input_ids=torch.tensor([[3, 4, 5]])).logits.square().mean().backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(storages) <= 2 and storages.isdisjoint(
            {p.untyped_storage().data_ptr() for p in model.parameters()})
        bucket_bytes = sum(p.grad.untyped_storage().nbytes() for p in
                           {p.grad.untyped_storage().data_ptr(): p for p in
                            model.parameters()}.values())
        assert bucket_bytes == sum(4 * p.numel() for p in model.parameters())
        del ddp
    finally:
        dist.destroy_process_group()


def test_adamw_state_exists_before_the_engine_takes_its_share(tiny_run_inputs, tmp_path,
                                                              monkeypatch):
    # set_up builds the learner (DDP's buckets, AdamW's moments made now: setup.allocate_state)
    # before the engine sizes its share of what the trainer leaves; AdamW made its state lazily in
    # the first update, inside the memory the engine had been given
    from harness import setup, vllm_rollout
    from infra import parallel
    learners, seen = [], []
    real_learner = setup.make_learner
    monkeypatch.setattr(setup, "make_learner",
                        lambda *a: learners.append(real_learner(*a)) or learners[-1])

    def engine_for(path, model, args, device, resident, tp=1):
        opt = learners[0][0].opt if learners else None
        trained = [p for p in model.parameters() if p.requires_grad]
        seen.append(opt is not None and all(
            opt.state[p]["exp_avg"].shape == p.shape and opt.state[p]["exp_avg_sq"].shape
            == p.shape for p in trained))
        return types.SimpleNamespace(sample_groups=None, push=lambda m: seen.append("push"))
    monkeypatch.setattr(vllm_rollout, "engine_for", engine_for)
    args = flags.parse_train_args([*tiny_flags(tiny_run_inputs, tmp_path / "run"), "--rollout",
                                   "vllm"])
    setup.set_up(args, parallel.Dist("cpu"))
    assert seen == [True, "push"]


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_state_made_at_set_up_gives_the_steps_of_a_fresh_adamw(fused):
    # setup.allocate_state's step at lr 0 on zero gradients leaves the weights (weight decay
    # included) and the moments as they were and its step count at 0: three real steps after it
    # are bit for bit those of an AdamW that made its state in its first step
    from harness import setup
    models = [tiny("qwen2", torch.float32) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
            for m in models]
    setup.allocate_state(opts[0])
    assert len(opts[0].state) == len(list(models[0].parameters())) and not opts[1].state
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                 models[1].parameters()))
    for model, opt in zip(models, opts):
        for k in range(3):
            model(input_ids=torch.tensor([[3, 4, 5 + k]])).logits.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                 models[1].parameters()))
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        a, b = opts[0].state[p], opts[1].state[q]
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _doc_commands(script: str) -> list[tuple[str, list[str]]]:
    """(page, the flags after `script`) of each command running it in the bash blocks of README.md
    and docs/*.md (continued lines joined, comments dropped)."""
    import re
    import shlex
    pages = ["README.md", *(f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if n.endswith(".md"))]
    out = []
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
            text = fh.read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            command = ""
            for line in block.splitlines():
                command += line + "\n"
                if line.endswith("\\") or command.count('"') % 2:     # continued, or in quotes
                    continue
                words = shlex.split(command.replace("\\\n", " "), comments=True)
                if script in words:
                    out.append((page, words[words.index(script) + 1:]))
                command = ""
    return out


def test_the_engine_decides_its_own_concurrency_unless_the_flag_is_given(monkeypatch):
    # --max-num-seqs is handed to vLLM as max_num_seqs only when given: the recipes' engines are
    # not capped (the DAPO-Math recipe passed 16, sized for the built-in sampler's KV cache: 16
    # sequences per GPU for vLLM, about a tenth of its concurrency); a user's value still is
    from harness import vllm_rollout as vr
    built = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        LLM=lambda **kw: built.append(kw)))
    model = tiny("qwen2", torch.float32)
    recipes = [(page, parse(argv)) for script, parse in (("train.py", flags.parse_train_args),
                                                         ("evaluate.py", flags.parse_eval_args))
               for page, argv in _doc_commands(script) if "vllm" in argv]
    assert len(recipes) >= 4, recipes              # real-models.md's two, evaluation.md's, ...
    for page, args in recipes:
        vr.engine_for("m", model, args, "cpu", 0)
        assert "max_num_seqs" not in built[-1], (page, built[-1]["max_num_seqs"])
    vr.engine_for("m", model, flags.parse_train_args(["--rollout", "vllm", "--max-num-seqs",
                                                      "64"]), "cpu", 0)
    assert built[-1]["max_num_seqs"] == 64


class _CyclicLLM:
    """Stands in for vllm.LLM: holds a reference cycle, as vLLM's objects do (freed only by the
    cycle collector), answers each request with two prompt tokens and an end id, and notes, when
    built, whether every engine built before it was shut down and freed."""
    made: list = []

    def __init__(self, **kw):
        self.kw, self.me, self.down = kw, self, False          # self.me: the cycle
        self.before = [(r() is None, down) for r, down in _CyclicLLM.made]
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(
            shutdown=lambda: _CyclicLLM.made.__setitem__(index, (_CyclicLLM.made[index][0], True))))
        index = len(_CyclicLLM.made)
        _CyclicLLM.made.append((weakref.ref(self), False))
        _CyclicLLM.seen.append((kw, self.before))

    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for r, p in zip(requests, params):
            ids = [*r["prompt_token_ids"][:2], p.stop_token_ids[0]]
            lps = [{t: types.SimpleNamespace(logprob=-0.5)} for t in ids]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids,
                                                                              logprobs=lps)]))
        return outs


def test_evaluate_shuts_each_models_engine_down_and_frees_it_before_the_next(monkeypatch):
    # evaluate.py --rollout vllm with several --model builds one engine per model in one process:
    # vLLM's sleep mode allows one instance per process (its CuMem allocator must be empty when
    # the next engine loads its weights), so evaluate.py's engines run without it (they never
    # sleep), and each is shut down and its memory collected before the next is built (its
    # objects hold reference cycles: dropping the last name did not free them)
    import gc

    import evaluate
    from harness import vllm_rollout
    _CyclicLLM.made, _CyclicLLM.seen = [], []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        LLM=_CyclicLLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    asked, real = [], vllm_rollout.engine_for
    monkeypatch.setattr(vllm_rollout, "engine_for",
                        lambda *a, **kw: asked.append(kw) or real(*a, **kw))
    gc.collect()
    gc.disable()                                # only an explicit collection frees a cycle
    try:
        evaluate.main(["--model", "builtin", "builtin", "--eval-size", "4", "--max-new-tokens",
                       "8", "--rollout", "vllm"])
    finally:
        gc.enable()
    assert [before for _, before in _CyclicLLM.seen] == [[], [(True, True)]]
    assert asked == [{"sleep_mode": False}] * 2
    # on CUDA: the engine evaluate.py asks for has no sleep mode; train.py's has
    for sleep_mode in (False, True):
        vllm_rollout.Engine("m", "cuda:0", bf16=True, seed=0, gpu_memory_utilization=0.5,
                            sleep_mode=sleep_mode)
        assert _CyclicLLM.seen[-1][0]["enable_sleep_mode"] is sleep_mode


@pytest.fixture(scope="session")
def vllm_env():
    """Skips where vllm cannot be imported; a 1 GiB KV cache per engine on CPU (the default is 30%
    of memory)."""
    pytest.importorskip("vllm", reason="vllm cannot be imported (install: see the README's "
                        "--rollout vllm)")
    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    if old is None:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    else:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A 0.53M Qwen2 with head_dim 64 (vLLM's CPU attention has no kernel for head_dim 8 or 16),
    random
    weights scaled up so greedy responses vary, and the built-in tokenizer: (folder, model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    d = tmp_path_factory.mktemp("vllm") / "model"
    tok = builtin.make_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, tie_word_embeddings=True, initializer_range=0.2)).eval()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def vllm_engine(vllm_env, vllm_model):
    from harness import vllm_rollout
    engine = vllm_rollout.Engine(str(vllm_model[0]), "cpu", bf16=False, seed=0,
                                 gpu_memory_utilization=0.05)
    yield engine
    # and the one-rank process group the engine made in this process
    engine.close()


VLLM_PROMPTS = [[12, 5, 20, 9], [7, 30, 14, 3, 25, 11, 16, 8, 2], [22]]


# prompts as real runs have them: a shared 400-token instruction (3 full KV blocks of vLLM's 128
# tokens, which its prefix cache reuses across requests), then each prompt's own tokens
VLLM_INSTRUCTION = [int(t) for t in torch.randint(3, 33, (400,),
                                                  generator=torch.Generator().manual_seed(5))]


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
    assert (engine.lengths.tolist() == [5, 5, T, T, 2, 2]
            and engine.truncated.tolist() == [False] * 2 + [True] * 2 + [False] * 2)
    # float32 both sides: other kernels, same tokens
    _same_rollout(engine, hf, atol=1e-4)
    # a budget of 5: prompt 0's end token is its last one, which ends it (not truncated); prompt 1
    # is cut
    five = vllm_engine.sample_groups(model, VLLM_PROMPTS, 1, 5, eos, 0, 0.0)
    assert five.lengths.tolist() == [5, 5, 2] and five.truncated.tolist() == [False, True, False]
    _same_rollout(five, sample_groups(model, VLLM_PROMPTS, 1, 5, eos, 0, 0.0), atol=1e-4)
    # prompts of 3+ KV blocks sharing a 400-token prefix (the second call reads the first's cached
    # blocks)
    for _ in range(2):
        long = vllm_engine.sample_groups(model, VLLM_LONG_PROMPTS, 2, T, eos, 0, 0.0)
        _same_rollout(long, sample_groups(model, VLLM_LONG_PROMPTS, 2, T, eos, 0, 0.0), atol=1e-4)


@pytest.mark.vllm
def test_vllm_samples_follow_each_prompts_seed_with_the_trainers_logprobs(vllm_engine, vllm_model):
    model, G, T, temp = vllm_model[1], 3, 16, 0.7
    gens = lambda idx: [data.prompt_generator(0, j) for j in idx]  # noqa: E731
    # 400 shared tokens, then each prompt's own
    prompts = VLLM_LONG_PROMPTS
    batch = vllm_engine.sample_groups(model, prompts, G, T, [1], 0, temp, generator=gens([0, 1, 2]))
    alone = vllm_engine.sample_groups(model, prompts[1:2], G, T, [1], 0, temp, generator=gens([1]))
    t = alone.response_ids.shape[1]
    # the batch does not matter
    assert batch.response_ids[G:2 * G, :t].tolist() == alone.response_ids.tolist()
    # G different samples each
    assert len({tuple(r) for r in batch.response_ids.tolist()}) == G * len(prompts)
    other = vllm_engine.sample_groups(model, prompts[1:2], G, T, [1], 0, temp, generator=gens([7]))
    # another seed, other samples
    assert other.response_ids.tolist() != alone.response_ids.tolist()
    # the sampled tokens' log-probs are those of softmax(logits / temperature), as the trainer
    # recomputes them
    trainer, _, valid = rollout_logprobs(model, batch, slice(0, G * len(prompts)), temp)
    torch.testing.assert_close(batch.logprobs, trainer * valid, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_vllm_top_p_logprobs_are_the_trainers_under_the_nucleus_it_finds(vllm_engine, vllm_model):
    # at top-p 0.8 vLLM reports each token's log-prob under its nucleus ("processed_logprobs") and
    # not the nucleus; the policy finds it (correction.nucleus_sizes) and the trainer's log-probs
    # under it equal the engine's (float32 both sides), where the full distribution's are lower
    import dataclasses

    import correction
    model, G, T, temp = vllm_model[1], 3, 16, 0.7
    gens = [data.prompt_generator(0, j) for j in range(3)]
    roll = vllm_engine.sample_groups(model, VLLM_LONG_PROMPTS, G, T, [1], 0, temp, top_p=0.8,
                                     generator=gens)
    every = slice(0, roll.response_ids.shape[0])
    assert roll.kept is None
    kept = correction.nucleus_sizes(model, roll, [every], temp, 0.8)                # [N, T]
    assert 1 < kept[roll.mask.bool()].float().mean() < model.config.vocab_size
    trainer, _, valid = rollout_logprobs(model, dataclasses.replace(roll, kept=kept), every, temp)
    torch.testing.assert_close(roll.logprobs, trainer * valid, atol=1e-4, rtol=0)
    full = rollout_logprobs(model, roll, every, temp)[0]
    assert ((roll.logprobs - full) * valid).max() > 0.05


@pytest.mark.parametrize("fused", [True, False])
def test_an_engine_rollout_at_top_p_gets_its_nucleus_from_the_policy(fused, monkeypatch):
    # an engine's rollout carries no Rollout.kept; update_policy finds the sizes with the policy
    # that sampled (here the sampler's own model, so they are the sampler's) and updates as on the
    # sampler's rollout; at --top-p 1 (the flag not applied) the update is another one
    import dataclasses
    import warnings

    import correction
    from infra import lm_head
    if not fused:
        monkeypatch.setattr(lm_head, "fusable", lambda m: "a test's plain head")
    model, G, t = tiny("qwen2", torch.float32), 4, 0.9
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]]
    roll = sample_groups(model, prompts, G, 12, 1, 0, temperature=t, top_p=0.8,
                         generator=[torch.Generator().manual_seed(s) for s in (4, 5, 6)])
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // G).repeat_interleave(G)
    engine_like = dataclasses.replace(roll, kept=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = correction.nucleus_sizes(model, engine_like, [slice(0, 5), slice(5, N)], t, 0.8)
    assert torch.equal(kept, roll.kept)
    A = torch.randn(N, generator=torch.Generator().manual_seed(2))

    def updated(r, top_p):
        mine = sgd_update(model, r, A, temperature=t, top_p=top_p)
        return {k: v.detach().clone() for k, v in mine.state_dict().items()}

    want = updated(roll, 0.8)
    got, full = updated(engine_like, 0.8), updated(engine_like, 1.0)
    gap = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    assert gap(got, want) <= 1e-6 and gap(full, want) > 1e-4, (gap(got, want), gap(full, want))


def test_an_engine_rollout_at_top_p_keeps_old_and_reference_under_the_nucleus():
    # --mu 2, --mini-batches 2, --beta 0.1 (four updates; old and reference log-probs from no-grad
    # passes before the first): an engine's rollout (no Rollout.kept) updates the weights as the
    # sampler's rollout (kept recorded) does, so old and reference log-probs are under the nucleus
    # the policy finds, like the new ones; taken under the full distribution they are 0.1-0.3 nats
    # lower and the first update's ratio is already off 1
    import contextlib
    import copy
    import dataclasses
    import warnings
    from types import SimpleNamespace

    import update
    from infra import parallel
    model, G, t = tiny("qwen2", torch.float32), 4, 0.9       # (the heads: the test above)
    roll = sample_groups(model, [[5, 6, 7], [8, 9, 10, 11, 12, 3], [4]], G, 8, 1, 0,
                         temperature=t, top_p=0.8,
                         generator=[torch.Generator().manual_seed(s) for s in (7, 8, 9)])
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // G).repeat_interleave(G)
    A = torch.randn(N, generator=torch.Generator().manual_seed(3))            # [N]

    def updated(r, top_p):
        args = SimpleNamespace(
            micro_batch_size=3, micro_batch_tokens=10**6, mini_batches=2, mu=2, temperature=t,
            top_p=top_p, reduction="token", loss="ppo", fsdp=False, gradient_checkpointing=False,
            max_new_tokens=8, eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
            off_policy_mask=0.0, entropy_coef=0.0, beta=0.1, kl="k3", grad_clip=0.0)
        mine, ref = copy.deepcopy(model).train(), copy.deepcopy(model).requires_grad_(False)
        learner = update.Learner(mine, mine, ref, torch.optim.SGD(mine.parameters(), lr=0.5),
                                 contextlib.nullcontext)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stats = update.update_policy(learner, r, A, r.mask, args, parallel.Dist("cpu"))
        return {k: v.detach().clone() for k, v in mine.state_dict().items()}, stats

    (want, s_want), (got, s_got) = updated(roll, 0.8), updated(dataclasses.replace(roll, kept=None),
                                                               0.8)
    gap = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    assert gap(got, want) <= 1e-6, gap(got, want)
    # the first update is on-policy: ratio 1 on every token, a zero KL to the reference
    for s in (s_want, s_got):
        assert s.first["ratio/mean"] == pytest.approx(s.first["tokens"], rel=1e-6)
        assert abs(s.first["kl"]) < 1e-6 * s.first["tokens"] and s.rest["updates"] == 3
    assert gap(updated(dataclasses.replace(roll, kept=None), 1.0)[0], want) > 1e-4


@pytest.mark.vllm
def test_vllm_push_after_updates_gives_hf_greedy_on_the_trained_weights(vllm_engine, vllm_model):
    import copy
    # prompts sharing 3 full KV blocks: the stale call below leaves them in vLLM's prefix cache,
    # computed by the old weights, so a push that kept the cache would decode the new weights on old
    # K/V
    model, T, prompts = copy.deepcopy(vllm_model[1]), 24, VLLM_LONG_PROMPTS
    before = sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(3):  # a few large updates: push the model towards other continuations
        model(input_ids=torch.tensor([prompts[1]]),
              labels=torch.tensor([prompts[1][::-1]])).loss.backward()
        opt.step()
        opt.zero_grad()
    after = sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    assert after.response_ids.tolist() != before.response_ids.tolist()
    stale = vllm_engine.sample_groups(model, prompts, 1, T, [1], 0, 0.0)
    # without a push: the old weights
    assert stale.response_ids.tolist() == before.response_ids.tolist()
    try:
        vllm_engine.push(model)
        _same_rollout(vllm_engine.sample_groups(model, prompts, 1, T, [1], 0, 0.0), after,
                      atol=1e-4)
    finally:
        vllm_engine.push(vllm_model[1])                    # the other tests' weights back


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_dapo_runs_agree_on_one_rank_and_two_fsdp_ranks(vllm_env, vllm_model, tiny_run_inputs,
                                                             tmp_path):
    """3 DAPO steps with --rollout vllm in one process, and on 2 gloo ranks with --fsdp (each rank's
    engine
    fed full tensors gathered from the shards): the same rewards at every step (the per-prompt
    seeds), the same evaluations (through the engines), weights within 1e-3, truncated IS on at cap
    2, and the sampler/trainer mismatch at the float32 level at every step (an engine left with old
    weights drifts away from the policy step by step). The tiny runs' large learning rate makes
    every step move the policy. Every prompt opens with the same ~400-token instruction, as real
    prompts share a chat header and system prompt: 3 full KV blocks that vLLM's prefix cache keeps
    across requests (and across weight pushes, unless the engine drops it), as each evaluation's
    prompts repeat the last one's."""
    runs, instruction = {}, "3x+4=19\nAnswer: 5\n" * 22
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        flags = [*tiny_flags(tiny_run_inputs, out), "--model", str(vllm_model[0]), "--steps", "3",
                 "--eval-every", "1",
                 "--algo", "dapo", "--rollout", "vllm", "--grad-clip", "0", "--prompt-template",
                 instruction + "{prompt}", *(["--fsdp"] if n == 2 else [])]
        torchrun(n, os.path.join(ROOT, "train.py"), *flags)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((out / "config.json").read_text())["tis_cap"] == 2.0
        runs[n] = ([r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r],
                   weights_of(out / "final"))
    (m1, e1, w1), (m2, e2, w2) = runs[1], runs[2]
    assert len(m1) == len(m2) == 3 and len(e1) == len(e2) == 4
    for a, b in zip(m1, m2):
        for k in ("reward/mean", "len/mean", "samples", "tokens/in_loss"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
    assert [e["eval/accuracy"] for e in e1] == [e["eval/accuracy"] for e in e2]
    assert max(r["mismatch/logp_abs_mean"] for r in m1 + m2) < 1e-4
    # float32 sums in another order; AdamW makes near-zero gradients' noise steps of up to lr (1e-2)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 5e-3
    start = weights_of(vllm_model[0])
    # the steps moved the weights
    assert max((start[k] - w1[k]).abs().max().item() for k in w1) > 1e-2


def test_engine_takes_the_merged_weights_of_a_lora_policy():
    # --lora-r with --rollout vllm (refused before; the adapters never reaching the engine is
    # verl#7495): the engine gets the plain model's names with W + alpha / r B A, as TRL pushes
    pytest.importorskip("peft")
    from harness import lora, vllm_rollout
    model = tiny("qwen2", torch.float32)
    names = list(model.state_dict())
    lora.add_adapters(model, 4, 8.0, "q_proj,v_proj", "tiny")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()                                   # B != 0: the delta shows
    engine = object.__new__(vllm_rollout.Engine)
    engine.llm, engine.cuda, engine.dtype, engine.asleep = (_RecordingLLM(), False, torch.float32,
                                                            False)
    pushed = {}
    engine.llm.collective_rpc = lambda method, kwargs: pushed.update(kwargs["weights_iterator"])
    engine.push(model)
    merged = lora.merged_state_dict(model)
    assert list(pushed) == names and all(torch.equal(pushed[n], merged[n]) for n in names)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(pushed[q], model.state_dict()[q.replace(".weight",
                                                                   ".base_layer.weight")])


class _WeakLLM(_RecordingLLM):
    """A recording stand-in engine that keeps only weak references to the memory (the storages) of
    the merged weights it is handed (as vLLM copies each into its own and drops it), and notes how
    many were still alive when the next one came and when its KV cache woke up."""

    def __init__(self, merged: set[str]):
        super().__init__()
        self.merged, self.refs, self.alive_at_next, self.got = merged, [], [], {}

    def collective_rpc(self, method, kwargs):
        for n, t in kwargs["weights_iterator"]:
            if n in self.merged:
                self.alive_at_next.append(sum(not r.expired() for r in self.refs))
                self.refs.append(StorageWeakRef(t.untyped_storage()))
            self.got[n] = t.clone()

    def wake_up(self, tags=None):
        super().wake_up(tags)
        if tags == ["kv_cache"]:
            self.calls.append(("alive", sum(not r.expired() for r in self.refs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_push_streams_one_merged_weight_at_a_time_in_the_engines_dtype(dtype, monkeypatch):
    # --lora-r with --rollout vllm: push built every merged weight at once and kept them alive
    # through the KV cache's wake-up (~26 GB at 7B, r 64); now each comes when the engine reads it,
    # in the engine's dtype, and none is left when the KV cache wakes
    pytest.importorskip("peft")
    from harness import lora, vllm_rollout
    model = tiny("qwen2", torch.float32)
    lora.add_adapters(model, 4, 8.0, "q_proj,v_proj,down_proj", "tiny")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    merged = {n for n in lora.merged_state_dict(model) if n.endswith(("q_proj.weight",
                                                                       "v_proj.weight",
                                                                       "down_proj.weight"))}
    engine = object.__new__(vllm_rollout.Engine)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine.llm, engine.cuda, engine.dtype, engine.asleep = _WeakLLM(merged), True, dtype, True
    engine.push(model)
    want = lora.merged_state_dict(model)
    assert len(merged) == 6 and engine.llm.alive_at_next == [0] * 6
    assert engine.llm.calls[-3:-1] == [("wake_up", ["kv_cache"]), ("alive", 0)]
    assert list(engine.llm.got) == list(want) and all(
        t.dtype == dtype and torch.equal(t, want[n].to(dtype)) for n, t in engine.llm.got.items())


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_top_p_trains_under_the_nucleus_on_either_rollout(engine, tiny_run_inputs, tmp_path,
                                                          request):
    """--top-p 0.8 through train.py (float32, 2 steps): the trainer's log-probs of the sampled
    tokens are the sampler's, under the nucleus (mismatch/* ~ 0 with --rollout hf, and with vLLM,
    whose nucleus the policy finds); under the full distribution they were lower by the log of the
    kept mass (0.1-0.3 nats a token on these models)."""
    extra = []
    if engine == "vllm":
        request.getfixturevalue("vllm_env")
        extra = ["--model", str(request.getfixturevalue("vllm_model")[0]), "--rollout", "vllm"]
    out = tmp_path / engine
    run_train(tiny_run_inputs, out, "--algo", "dapo", "--top-p", "0.8", "--grad-clip", "0", *extra)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x]
    assert len(rows) == 2
    print(f"\n{engine} --top-p 0.8 mismatch/logp_abs_mean per step: "
          + ", ".join(f"{r['mismatch/logp_abs_mean']:.2e}" for r in rows))
    assert all(r["mismatch/logp_abs_mean"] < 1e-4 for r in rows), rows


@pytest.mark.vllm
def test_evaluate_with_the_engine_scores_as_the_builtin_sampler(vllm_env, vllm_model,
                                                                  tiny_run_inputs):
    # evaluate.py --rollout vllm on vLLM's CPU backend (the stand-in test: tests/test_scale.py):
    # greedy and 4 samples at top-p 0.7, float32; greedy tokens are the built-in sampler's, so the
    # scores are the same
    import evaluate
    argv = ["--model", str(vllm_model[0]), "--data", str(tiny_run_inputs / "eval.jsonl"),
            "--eval-size", "8", "--max-new-tokens", "16"]
    hf, vllm = evaluate.main(argv), evaluate.main([*argv, "--rollout", "vllm"])
    assert vllm == hf and len(hf) == 1
    sampled = evaluate.main([*argv, "--rollout", "vllm", "--eval-samples", "4",
                             "--eval-top-p", "0.7"])
    assert len(sampled) == 1 and sampled[0][1] != hf[0][1]


CORRECTIONS = {                                     # name: flags (docs/rollout-correction.md)
    "token truncate 2 (default)": [],
    "token mask 2 (TRL token_mask)": ["--is-mode", "mask"],
    "sequence mask 3 (TRL's default)": ["--tis-cap", "3", "--is-level", "sequence", "--is-mode",
                                        "mask"],
    "geometric reject [0.999, 1.001] (verl RS)": ["--tis-cap", "1.001", "--is-low", "0.999",
                                                  "--is-level", "geometric", "--is-mode",
                                                  "reject"],
    "IcePop [0.5, 5]": ["--tis-cap", "5", "--is-low", "0.5", "--is-mode", "mask"],
    "off-policy mask 1e-3, --mu 2": ["--off-policy-mask", "1e-3", "--mu", "2"],
}


@pytest.mark.slow
@pytest.mark.vllm
def test_each_rollout_correction_runs_through_the_engine(vllm_env, vllm_model, tiny_run_inputs,
                                                         tmp_path):
    """Every correction of correction.py through train.py with --rollout vllm in bf16 (the
    engine's bf16 kernels against the trainer's bf16 autocast: a mismatch to correct), 2 steps
    each: each logs its share, within [0, 1], and the tight rejection acts; prints the per-step
    mismatch and share (docs/rollout-correction.md's table)."""
    lines = []
    for name, extra in CORRECTIONS.items():
        out = tmp_path / str(len(lines))
        run_train(tiny_run_inputs, out, "--model", str(vllm_model[0]), "--rollout", "vllm",
                  "--bf16", "--algo", "dapo", "--grad-clip", "0", *extra)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in x]
        key = "offpolicy/masked_frac" if "--off-policy-mask" in extra else "is/corrected_frac"
        shares = [r[key] for r in rows]
        assert len(rows) == 2 and all(0 <= s <= 1 for s in shares), (name, shares)
        assert all(r["mismatch/logp_abs_mean"] > 0 for r in rows)
        if "reject" in extra:
            assert max(shares) > 0, name
        lines.append(f"| {name} | " + ", ".join(f"{r['mismatch/logp_abs_mean']:.2e}" for r in rows)
                     + " | " + ", ".join(f"{s:.3f}" for s in shares) + " |")
    print("\n| correction | mismatch/logp_abs_mean per step | share acted on per step |\n"
          "| --- | --- | --- |\n" + "\n".join(lines))


@pytest.mark.slow
@pytest.mark.vllm
def test_fp32_lm_head_on_both_sides_under_bf16(vllm_env, vllm_model, tiny_run_inputs, tmp_path):
    """--fp32-lm-head with --rollout vllm --bf16: the engine (head_dtype float32) and the trainer
    both compute the head in float32; 2 steps with and without, the sampler/trainer mismatch of
    each printed (docs/rollout-correction.md). Only that both run and log it is asserted: the
    figure is what it is."""
    got = {}
    for name, extra in (("bf16 head", []), ("--fp32-lm-head", ["--fp32-lm-head"])):
        out = tmp_path / name.strip("-")
        run_train(tiny_run_inputs, out, "--model", str(vllm_model[0]), "--rollout", "vllm",
                  "--bf16", "--algo", "dapo", "--grad-clip", "0", *extra)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in x]
        got[name] = [r["mismatch/logp_abs_mean"] for r in rows]
        assert len(rows) == 2 and all(m > 0 for m in got[name])
    print("\n" + "\n".join(f"| {k} | " + ", ".join(f"{m:.2e}" for m in v) + " |"
                           for k, v in got.items()))
