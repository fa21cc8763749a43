"""Collectives every rank must join alike: two CPU ranks over gloo in processes of their own
(torch.multiprocessing), where a rank that decides on its own data and enters a collective alone
fails at once ("Received data size doesn't match expected size") instead of hanging, as it would
over NCCL."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(fn, world: int, *args, timeout_s: float = 240.0) -> None:
    """fn(rank, world, port, *args) in `world` spawned processes; re-raises a rank's error, and
    fails (after killing them) when they are not all done within timeout_s."""
    ctx = mp.start_processes(fn, (world, _free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(1.0):             # raises with a rank's traceback when one fails
            assert time.monotonic() < deadline, f"the ranks were not done in {timeout_s:.0f} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _init_rank(rank: int, world: int, port: int):
    """This process as rank `rank` of a gloo group (what torchrun's environment gives train.py),
    collectives timing out after 30 s."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from infra import parallel
    return parallel.Dist("cpu", fsdp=True, timeout_min=0.5)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2)).eval()


def _update_with_an_empty_rank(rank: int, world: int, port: int) -> None:
    """Step 4 under --fsdp at --top-p 0.9 where dynamic sampling left rank 1 no group
    (Rollout.empty, no Rollout.kept) and rank 0 two groups sampled by sampler.py (with
    Rollout.kept), then by an engine (without: the policy finds it, all ranks gathered for it);
    both in the same two processes (a spawn costs more than the updates)."""
    import update
    from infra import parallel
    from sampler import Rollout, sample_groups
    ranks = _init_rank(rank, world, port)
    try:
        for engine in (False, True):
            model, G = _tiny_llama(), 4
            roll = Rollout.empty(G, 0)
            if rank == 0:
                roll = sample_groups(model, [[3, 4, 5], [6, 7]], G, 6, eos_token_id=1,
                                     pad_token_id=0, temperature=1.0, top_p=0.9,
                                     generator=torch.Generator().manual_seed(0))
                assert roll.kept is not None
                roll = dataclasses.replace(roll, index=torch.arange(2).repeat_interleave(G),
                                           kept=None if engine else roll.kept)
            parallel.wrap(model, ranks, fsdp=True)
            learner = update.Learner(model, model, None,
                                     torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     contextlib.nullcontext)
            args = SimpleNamespace(micro_batch_size=4, micro_batch_tokens=10**6, mini_batches=1,
                                   mu=1, temperature=1.0, top_p=0.9, reduction="token",
                                   loss="ppo", fsdp=True, gradient_checkpointing=False,
                                   max_new_tokens=6, eps_low=0.2, eps_high=0.28, clip_c=0.0,
                                   tis_cap=0.0, off_policy_mask=0.0, entropy_coef=0.0, beta=0.0,
                                   kl="k3", grad_clip=1.0)
            N = roll.response_ids.shape[0]
            stats = update.update_policy(learner, roll, torch.linspace(-1, 1, N), roll.mask,
                                         args, ranks)
            assert stats.first["updates"] == 1.0          # one optimizer step, counted by rank 0
            # both ranks end with the same collectives behind them: one more matches
            assert ranks.sum(torch.ones(1)).item() == world
    finally:
        ranks.close()


@pytest.mark.slow
def test_a_rank_without_a_group_joins_the_others_collectives_under_fsdp_top_p():
    # update.keep_sampling_mask decided from this rank's Rollout.kept: sampler.py's rollouts have
    # it, Rollout.empty has not, so rank 1 alone all-gathered the sharded model (parallel.unsharded)
    # while rank 0 went on to its training forward: gloo failed on the mismatched sizes. With an
    # engine's rollout (no Rollout.kept) rank 0 must gather, and rank 1, without rows, with it
    _run_ranks(_update_with_an_empty_rank, 2)


class _EchoLLM:
    """Stands in for vllm.LLM: each request's response is two tokens of its prompt and the first
    end id."""

    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for r, p in zip(requests, params):
            ids = [*r["prompt_token_ids"][:2], p.stop_token_ids[0]]
            lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)]))
        return outs


def test_evaluation_on_a_tensor_parallel_engine_gathers_as_often_on_every_rank(monkeypatch):
    # --vllm-tensor-parallel-size 2: the engine's 2 ranks gather their prompts in every batch
    # (all_gather_object over the group). 5 held-out rows at 2 a batch give rank 0 rows 0, 2, 4
    # (2 batches) and rank 1 rows 1, 3 (1 batch): rank 0 waited in its second gather while rank 1
    # had gone on. Every rank now runs rank 0's count, the one out of rows asking for none; the
    # scores are those of one rank
    from harness import evaluation, flags, models, vllm_rollout
    monkeypatch.setattr(evaluation, "EVAL_BATCH", 2)
    _, tokenizer, model = models.load_model("builtin")
    rows = [{"prompt": f"{a}x+{b}={a * 3 + b}", "answer": "3"} for a, b in
            [(2, 1), (3, 4), (5, 2), (4, 4), (2, 9)]]
    args = flags.parse_eval_args(["--model", "builtin", "--max-new-tokens", "8"])

    class Rank:
        def __init__(self, rank):
            self.rank, self.world = rank, 2

        def sum(self, x):
            return x.detach().double().clone()

    gathers, scored = {0: 0, 1: 0}, {}
    for r in (0, 1):
        engine = object.__new__(vllm_rollout.Engine)
        engine.llm, engine.tp, engine.group_rank = _EchoLLM(), 2, r
        engine.vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))

        def gather(items, r=r):  # the other rank's share left out: each rank draws its own
            gathers[r] += 1
            return [items, []] if r == 0 else [[], items]
        engine.gather = gather
        _, records = evaluation.evaluate_model(model, tokenizer, rows, args, Rank(r),
                                             sample=engine.sample_groups)
        scored[r] = [rec["index"] for rec in records]
    assert gathers == {0: 2, 1: 2}
    assert scored == {0: [0, 2, 4], 1: [1, 3]}
