"""Ranks and disk (harness/checkpoint.py, harness/models.py, infra/parallel.py): resume, atomic
saves,
the run lock, a kill at any byte; DDP, FSDP and gradient checkpointing.

    python -m pytest -q tests/test_ranks_checkpoints.py
"""
from __future__ import annotations

import datetime
import json
import os
import random

import pytest
import torch

import update
from harness import checkpoint, metrics, models
from helpers import PROMPTS, mixed_rollout, tiny_flags, weights_of
from infra import errors
from launch import CutWrites, on_thread_ranks
from logprobs import rollout_logprobs
from sampler import sample_groups

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

# ---------------------------------------------------------------------------------------------
# harness/checkpoint.py, infra/parallel.py: resume, atomic saves, the run lock; DDP, FSDP and
# gradient
# checkpointing
# ---------------------------------------------------------------------------------------------

def test_dist_on_cuda_uses_the_local_rank_and_nccl(monkeypatch):
    # the CUDA branch of Dist cannot run here: drive it with set_device and init_process_group
    # stubbed out
    from infra import parallel
    calls = []
    for k, v in (("WORLD_SIZE", "2"), ("RANK", "3"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend,
                        **kw: calls.append(("init", backend, kw)))
    ranks = parallel.Dist("cuda")
    assert (ranks.device, ranks.rank, ranks.world, ranks.master) == ("cuda:1", 3, 2, False)
    hour = datetime.timedelta(minutes=60)             # not torch's 10-minute default
    assert calls == [("set_device", "cuda:1"), ("init", "nccl", {"timeout": hour})]
    # --dist-timeout-min reaches the group through train.py's session
    calls.clear()
    from harness import flags, setup
    monkeypatch.setattr(setup.checkpoint, "lock_folder", lambda out, ranks: None)
    with setup.session(flags.parse_train_args(["--device", "cuda", "--dist-timeout-min", "90"])):
        pass
    assert calls[-1] == ("init", "nccl", {"timeout": datetime.timedelta(minutes=90)})
    # without torchrun: no process group, except for --fsdp, which shards over one rank (an
    # in-memory store)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k)
    calls.clear()
    parallel.Dist("cuda")
    assert calls == []
    ranks = parallel.Dist("cuda", fsdp=True)
    assert (ranks.device == "cuda" and [(c[1], c[2]["rank"], c[2]["world_size"])
                                        for c in calls] == [("nccl", 0, 1)])


def test_adamw_is_fused_on_the_cpu_and_left_to_torch_on_cuda():
    # the CPU's default AdamW loops over parameters op by op (5x slower on SmolLM2-135M); CUDA keeps
    # foreach, the form the GPU memory model counts. The same step either way.
    from harness import flags, setup
    from infra import parallel
    args = flags.parse_train_args(["--lr", "1e-2"])
    models = [torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused, _ = setup.make_learner(args, models[0], None, parallel.Dist("cpu"))
    assert fused.opt.defaults["fused"] is True
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=args.weight_decay)
    for opt, model in ((fused.opt, models[0]), (plain, models[1])):
        for _ in range(3):
            model(torch.ones(2, 6)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)
    ranks = parallel.Dist("cpu")
    ranks.device = "cuda"                              # only the optimizer's choice reads it here
    assert setup.make_learner(args, torch.nn.Linear(2, 2), None, ranks)[0].opt.defaults[
        "fused"] is None


def test_fsdp_shards_each_decoder_layer_then_the_root_bf16_on_cuda(monkeypatch):
    # fully_shard recorded instead of run, so the CUDA branch (bf16 compute, float32 reductions)
    # runs on CPU too
    import torch.distributed.device_mesh as device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    calls, meshes = [], []
    monkeypatch.setattr(parallel, "fully_shard", lambda m, **kw: calls.append((m, kw)))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind,
                        shape: meshes.append((kind, shape)) or "mesh")
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 4)
    for device, param_dtype, reduce_dtype in (("cuda:1", torch.bfloat16, torch.float32),
                                              ("cpu", None, None)):
        calls.clear()
        assert parallel.wrap(model, parallel.Dist(device), fsdp=True) is model
        # bottom-up, the root last
        assert [m for m, _ in calls] == [*model.model.layers, model]
        assert [kw["reshard_after_forward"] for _, kw in calls] == [True, True, True, False]
        assert all(kw["mesh"] == "mesh" and kw["mp_policy"].param_dtype == param_dtype
                   and kw["mp_policy"].reduce_dtype == reduce_dtype for _, kw in calls)
    assert meshes == [("cuda", (4,)), ("cpu", (4,))]
    with pytest.raises(errors.ShardingError, match="no decoder layers"):
        parallel.shard(torch.nn.Linear(2, 2), "cpu")
    # one process, no --fsdp: as is
    assert parallel.wrap(model, parallel.Dist("cpu"), fsdp=False) is model


def _fsdp_llama(ranks):
    """A 2-layer Llama sharded by FSDP2 over `ranks`, its AdamW and a decaying lr schedule."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = parallel.wrap(LlamaForCausalLM(cfg), ranks, fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def train_step(model, opt, sched):
    model(input_ids=torch.arange(1, 9)[None]).logits.square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def snapshot(model, opt):
    """The full (gathered) weights and AdamW moments of a sharded model."""
    return ({k: v.full_tensor().clone() for k, v in model.state_dict().items()},
            [t.full_tensor().clone() for s in opt.state.values()
             for t in (s["exp_avg"], s["exp_avg_sq"])])


def test_fsdp_in_one_process_gathers_for_rollouts_and_checkpoints_atomically(tmp_path, monkeypatch):
    # FSDP2 over a one-rank gloo group in this process. `unsharded` leaves the layers sharded again,
    # and freeing their weights after each forward. Checkpoints: save step 1, crash in the middle of
    # saving step 2, and load: `latest` still names step 1, whose weights, AdamW moments and
    # scheduler come back
    import torch.distributed.checkpoint as dcp

    from infra import parallel
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ranks = parallel.Dist("cpu", fsdp=True)
    try:
        fresh = lambda: _fsdp_llama(ranks)  # noqa: E731
        model, opt, sched = fresh()
        layer = model.model.layers[0].self_attn.q_proj
        sharded = lambda: type(layer.weight).__name__ == "DTensor"  # noqa: E731 - the registered parameter is the shard
        with parallel.unsharded(model), torch.no_grad():
            model(input_ids=torch.arange(1, 9)[None])
            assert not sharded()                     # gathered, and kept gathered after a forward
        assert sharded()
        model(input_ids=torch.arange(1, 9)[None])
        # a layer frees its gathered weights after a forward again
        assert sharded()
        folder = str(tmp_path / "checkpoint")
        train_step(model, opt, sched)
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 1, "data_pos": 4}, ranks)
        saved = snapshot(model, opt)
        train_step(model, opt, sched)
        real_save = dcp.save

        def crash(state, checkpoint_id):  # half the shards written, then the process dies
            real_save(dict(list(state.items())[: len(state) // 2]), checkpoint_id=checkpoint_id)
            raise KeyboardInterrupt("killed mid-save")
        monkeypatch.setattr(dcp, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ranks)
        monkeypatch.setattr(dcp, "save", real_save)
        assert (checkpoint.latest(folder).endswith("step-000001")
                and os.path.isdir(folder + "/step-000002.tmp"))
        meta = dcp.FileSystemReader(checkpoint.latest(folder)).read_metadata().state_dict_metadata
        # nothing DCP would unpickle
        assert all(type(m).__name__ == "TensorStorageMetadata" for m in meta.values())
        model2, opt2, sched2 = fresh()
        state = checkpoint.load_sharded(folder, model2, opt2, sched2, ranks)
        assert (state["step"], state["data_pos"], sched2.last_epoch,
                opt2.param_groups[0]["lr"]) == (1, 4, 1, 5e-3)
        (w, m), (w2, m2) = saved, snapshot(model2, opt2)
        assert (all(torch.equal(w[k], w2[k]) for k in w)
                and all(torch.equal(a, b) for a, b in zip(m, m2)) and len(m) > 0)
        # a completed save
        checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8}, ranks)
        # replaces the old one
        assert sorted(os.listdir(folder)) == ["latest", "step-000002"]
    finally:
        ranks.close()


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_sharded_save_leaves_a_whole_checkpoint(tmp_path, monkeypatch):
    """An --fsdp save interrupted at each of its file operations in turn (DCP's shard writes, the
    RNG and state files, the fsyncs, the renames, `latest`'s replacement, the old checkpoint's
    removal, each cut half way where it writes or removes several files): `latest` names a whole
    checkpoint, step 1's or step 2's, whose weights and AdamW moments load back exactly, and the
    next save leaves only itself. Stops once a save runs to the end without reaching the kill."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from infra import parallel
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ranks = parallel.Dist("cpu", fsdp=True)
    calls = {"n": 0, "kill_at": -1}

    def killable(real, partial=None):
        def op(*a, **kw):
            calls["n"] += 1
            if calls["n"] == calls["kill_at"]:
                if partial:
                    partial(real, *a, **kw)
                raise KeyboardInterrupt("killed")
            return real(*a, **kw)
        return op

    def half_of_the_shards(real, state, checkpoint_id):
        real(dict(list(state.items())[: len(state) // 2]), checkpoint_id=checkpoint_id)

    def one_file_of_the_tree(real, path, *a, **kw):
        files = sorted(os.listdir(path)) if os.path.isdir(path) else []
        if files:
            os.remove(os.path.join(path, files[0]))
    try:
        model, opt, sched = _fsdp_llama(ranks)
        for kill_at in range(1, 100):
            folder = str(tmp_path / f"k{kill_at}" / "checkpoint")
            train_step(model, opt, sched)
            checkpoint.save_sharded(folder, model, opt, sched, {"step": 1, "data_pos": 4}, ranks)
            saved = {1: snapshot(model, opt)}
            train_step(model, opt, sched)
            saved[2] = snapshot(model, opt)
            calls.update(n=0, kill_at=kill_at)
            with monkeypatch.context() as m:
                m.setattr(dcp, "save", killable(dcp.save, half_of_the_shards))
                m.setattr(torch, "save", killable(torch.save))
                for name in ("rename", "replace"):
                    m.setattr(os, name, killable(getattr(os, name)))
                m.setattr(shutil, "rmtree", killable(shutil.rmtree, one_file_of_the_tree))
                m.setattr(checkpoint, "_fsync_tree", killable(checkpoint._fsync_tree))
                try:
                    checkpoint.save_sharded(folder, model, opt, sched, {"step": 2, "data_pos": 8},
                                            ranks)
                    killed = False
                except (KeyboardInterrupt, CheckpointException):  # DCP wraps what its writes raise
                    killed = True
            model2, opt2, sched2 = _fsdp_llama(ranks)
            step = checkpoint.load_sharded(folder, model2, opt2, sched2, ranks)["step"]
            (w, mom), (w2, mom2) = saved[step], snapshot(model2, opt2)
            assert (all(torch.equal(w[k], w2[k]) for k in w)
                    and all(torch.equal(a, b) for a, b in zip(mom, mom2))), (kill_at, step)
            assert killed or step == 2
            checkpoint.save_sharded(folder, model, opt, sched, {"step": 3, "data_pos": 12}, ranks)
            assert sorted(os.listdir(folder)) == ["latest", "step-000003"], kill_at
            if not killed:
                break
        print(f"a sharded save interrupted at each of its {kill_at - 1} file operations")
        assert not killed and kill_at > 6   # every operation of the save was a kill point once
    finally:
        ranks.close()


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes():
    from transformers import LlamaConfig, LlamaForCausalLM

    from infra import parallel
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=0, eos_token_id=1))
    roll = sample_groups(model, PROMPTS, 2, 10, eos_token_id=1, pad_token_id=0,
                         generator=[torch.Generator().manual_seed(s) for s in range(3)])
    calls, forwards = [], []
    # runs first in the layer
    model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    # the shared-prefix forward calls the model twice
    model.model.register_forward_hook(lambda *_: forwards.append(1))

    # checkpointed layers drop the cache: update_policy asks for per-response then
    def grads(shared_prefix=True):
        model.train()
        model.zero_grad()
        calls.clear()
        forwards.clear()
        logp, _, valid = rollout_logprobs(model, roll, slice(0, 6), 1.0,
                                          shared_prefix=shared_prefix)
        (-(logp * valid).sum() / valid.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls), len(forwards)

    plain, n_plain, f_plain = grads()
    parallel.checkpoint_activations(model)
    ckpt, n_ckpt, f_ckpt = grads(shared_prefix=False)
    # the layer ran again in backward: it was checkpointed
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt
    assert max((plain[k] - ckpt[k]).abs().max().item() for k in plain) <= 1e-5
    assert all(plain[k].abs().sum() > 0 for k in plain if "layers.0" in k)


def test_update_policy_recomputes_checkpointed_layers_in_an_eval_mode_model(tiny_model):
    """--gradient-checkpointing reaches the update: the model stays in eval mode (as from_pretrained
    gives it), yet each checkpointed layer runs again in backward, only during the gradient passes,
    with the same update as without checkpointing."""
    import contextlib
    import copy
    from types import SimpleNamespace

    from infra import parallel
    roll = mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(0))

    def run(checkpointing):
        model, calls, forwards = copy.deepcopy(tiny_model), [], []
        if checkpointing:
            parallel.checkpoint_activations(model)
        # first in the layer
        model.model.layers[0].input_layernorm.register_forward_hook(lambda *_: calls.append(1))
        # once per forward of the model
        model.model.register_forward_hook(lambda *_: forwards.append(1))
        args = SimpleNamespace(micro_batch_size=4,
                               micro_batch_tokens=10**6, mini_batches=1, mu=1, temperature=1.0,
                               reduction="token",
                               loss="ppo", fsdp=False, gradient_checkpointing=checkpointing,
                               max_new_tokens=20,
                               eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0,
                               off_policy_mask=0.0, top_p=1.0,
                               entropy_coef=0.0, beta=0.0, kl="k3", grad_clip=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        learner = update.Learner(model, model, None, opt, contextlib.nullcontext)
        update.update_policy(learner, roll, adv, roll.mask, args, parallel.Dist("cpu"))
        assert not any(m.training for m in model.modules())                 # eval mode again after
        return model, len(calls), len(forwards)

    plain, n_plain, f_plain = run(False)
    ckpt, n_ckpt, f_ckpt = run(True)
    # the layer ran again in backward
    assert n_plain == f_plain and n_ckpt == 2 * f_ckpt
    assert all(torch.allclose(p, q, atol=1e-6) for p,
               q in zip(plain.parameters(), ckpt.parameters()))


class _OtherRank:
    """Dist of rank 1 of 2 whose all-reduce adds rank 0's flag (1: it took the lock, 0: it was
    refused)."""
    master, world = False, 2

    def __init__(self, rank0_flag):
        self.rank0_flag = rank0_flag

    def sum(self, x):
        return x.double() + self.rank0_flag


def test_the_other_ranks_follow_rank_0s_lock_verdict(tmp_path, capsys):
    # they hold no lock themselves
    assert checkpoint.lock_folder(str(tmp_path / "free"), _OtherRank(1.0)) is None
    assert not (tmp_path / "free").exists()
    with pytest.raises(SystemExit) as e:
        checkpoint.lock_folder(str(tmp_path / "busy"), _OtherRank(0.0))
    assert e.value.code == 2 and capsys.readouterr().err == ""  # rank 0 prints the one line


class _Twin:
    """Dist of rank `rank` of 2 without a process group, whose peer holds exactly what it holds: a
    sum doubles, a gather repeats (so rank 0's verdicts, the lock's among them, come out as on 2
    ranks)."""
    world, device = 2, "cpu"

    def __init__(self, rank):
        self.rank, self.master = rank, rank == 0

    def sum(self, x):
        return x.detach().to(torch.float64) * 2

    def sum_named(self, sums):
        return {k: 2.0 * v for k, v in sums.items()}

    def max(self, n):
        return n

    def gather(self, x):
        return [x, x]

    def barrier(self):
        pass

    def close(self):
        pass


def test_only_rank_0_writes_the_runs_folder(tiny_run_inputs, tmp_path, monkeypatch):
    # train.main in this process as rank 1 of 2, then as rank 0 (DDP's wrap left out: no process
    # group): with a checkpoint every step and completions logged, rank 1 writes nothing under OUT
    # (not even the lock), rank 0 all of it
    import train
    from infra import parallel
    monkeypatch.setattr(parallel, "wrap", lambda model, ranks, fsdp: model)
    files = {}
    for rank in (1, 0):
        monkeypatch.setattr(parallel, "Dist", lambda device, fsdp=False, timeout_min=60.0,
                            rank=rank: _Twin(rank))
        out = tmp_path / f"rank{rank}"
        train.main([*tiny_flags(tiny_run_inputs, out), "--steps", "1", "--save-every", "1",
                    "--no-dynamic-sampling"])
        files[rank] = sorted(str(f.relative_to(out)) for f in out.rglob("*"))  # none: no folder
    assert files[1] == []
    assert {".lock", "config.json", "metrics.jsonl", "completions.jsonl", "checkpoint.pt",
            "final/model.safetensors"} <= set(files[0])


def test_a_save_that_fails_half_way_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    # save step 1; the save of step 2 writes half its bytes and the process dies: step 1 still
    # loads, whole
    import io


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
    assert (ckpt["step"] == 1 and all(torch.equal(v, saved[k]) for k,
                                      v in fresh.state_dict().items()))


def test_unreadable_checkpoint_gets_one_clear_line(tiny_run_inputs, tmp_path, capsys):
    """errors.CheckpointError (harness/checkpoint.py raises its own, not errors.InputError) reaches
    the
    same one line."""
    import train
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.main([*tiny_flags(tiny_run_inputs, tmp_path / "out"), "--steps", "1", "--resume"])
    err = capsys.readouterr().err.strip()
    assert (e.value.code == 2 and "checkpoint.pt: not a usable checkpoint" in err
            and len(err.splitlines()) == 1), err


def _jsonl_file(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_a_cut_last_line_is_dropped_with_a_notice_at_every_byte_and_a_bad_middle_line_is_an_error(
        tmp_path, capsys, monkeypatch):
    """A run killed while appending to metrics.jsonl / completions.jsonl leaves any prefix of its
    bytes past the checkpoint: a step's row, then its completions (one over 8 KB, so written in
    several write()s; one written as raw UTF-8, so cut inside a character too). For every such
    prefix, byte by byte, the reader gives the whole lines and drops a cut last one with exactly one
    notice; for the file cut at each line end (and a byte either side) and every 50th byte,
    read_jsonl does the same and trim_metrics (--resume from step 2) leaves the lines of steps <= 2,
    the checkpoint step's own included, byte for byte."""
    import re

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the rewrites' syncs are tested elsewhere
    kept = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "loss": 0.5},
            {"step": 1, "response": "x+1"}, {"step": 2, "loss": -0.25},
            {"step": 2, "response": "2x=4"}, {"step": 2, "eval/accuracy": 0.5}]
    after = [{"step": 3, "loss": 1.0, "reward/mean": 0.125},
             {"step": 3, "prompt": "3x+1=7\n", "response": "x = 2 ∑é " * 440}]     # > 8 KB
    head = _jsonl_file(kept)
    raw = json.dumps({"step": 3, "response": "∑é" * 60}, ensure_ascii=False) + "\n"
    lines = [_jsonl_file(after[:1]), _jsonl_file(after[1:]), raw.encode()]
    full = head + b"".join(lines)
    assert len(lines[1]) > 8192 and max(full) > 127
    ends = [len(head) + sum(len(x) for x in lines[:i + 1]) for i in range(len(lines))]
    path = tmp_path / "completions.jsonl"

    def expected(cut):
        """The rows a prefix of `cut` bytes holds, and whether its last line is cut (a notice)."""
        whole = sum(e <= cut for e in ends)                     # lines written with their newline
        partial = whole < len(lines) and cut > ([len(head)] + ends)[whole]
        no_newline = partial and cut == ends[whole] - 1          # a whole object but its newline
        rows = kept + [json.loads(x) for x in lines[:whole + no_newline]]
        return rows, partial and not no_newline

    def check_notice(err, cut_short, at):
        if cut_short:
            assert err.count("\n") == 1 and f"{path}: dropped its last line, cut short" in err, at
        else:
            assert err == "", (at, err)
    for cut in range(len(head), len(full) + 1):
        rows, cut_short = expected(cut)
        assert [r for _, r in metrics._parse_jsonl(full[:cut], str(path))] == rows, cut
        check_notice(capsys.readouterr().err, cut_short, cut)
    cuts = {c + k for c in [len(head), *ends] for k in (-1, 0, 1)}
    cuts |= set(range(len(head), len(full), 50))
    for cut in sorted(c for c in cuts if len(head) <= c <= len(full)):
        path.write_bytes(full[:cut])
        rows, cut_short = expected(cut)
        assert metrics.read_metrics(str(path)) == rows, cut
        check_notice(capsys.readouterr().err, cut_short, cut)
        metrics.trim_metrics(str(path), 2)
        check_notice(capsys.readouterr().err, cut_short, cut)
        assert path.read_bytes() == head and os.listdir(tmp_path) == ["completions.jsonl"], cut
    # any other bad line is corruption, not a kill: one line naming file:line, the file as it was
    for bad, line in ((head[:30] + b"\n" + head, 1), (head + b"not json\n", len(kept) + 1)):
        path.write_bytes(bad)
        for read in (metrics.read_metrics, lambda p: metrics.trim_metrics(p, 2)):
            with pytest.raises(errors.CheckpointError,
                               match=f"^{re.escape(str(path))}:{line}: not a JSON line .*corrupt"):
                read(str(path))
        assert path.read_bytes() == bad
    path.write_bytes(head)
    assert metrics.read_metrics(str(path)) == kept            # whole lines: read back as written






class _Killed(BaseException):
    """A kill, in-process: no `except Exception` stops it."""


def test_trim_killed_at_any_byte_of_its_rewrite_keeps_the_whole_log(tmp_path, monkeypatch):
    """trim_metrics (--resume) rewrites the log: dying after any number of bytes of the rewrite
    leaves the old log whole (an in-place rewrite would leave those bytes alone), and the next trim
    does the job."""
    import builtins

    rows = [{"step": s, "loss": s / 8, "response": "y" * 40} for s in range(6)]
    log = tmp_path / "metrics.jsonl"
    old = _jsonl_file(rows) + b'{"step": 6, "lo'                 # killed mid-step 6 the first time
    kept = _jsonl_file(rows[:4])

    def die():
        raise _Killed
    for budget in range(0, len(kept), 7):
        log.write_bytes(old)
        monkeypatch.setattr(os, "fsync", lambda fd: None)
        monkeypatch.setattr(builtins, "open", CutWrites(tmp_path, budget, die))
        with pytest.raises(_Killed):
            metrics.trim_metrics(str(log), 3)
        monkeypatch.setattr(builtins, "open", builtins.open.real_open)
        assert log.read_bytes() == old, budget
        metrics.trim_metrics(str(log), 3)
        assert log.read_bytes() == kept and os.listdir(tmp_path) == ["metrics.jsonl"], budget


def _tagged_folder(folder, tag):
    os.makedirs(folder)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(f"{name} of {tag}")


def _whole_tag(folder):
    """The tag of a whole folder written by _tagged_folder, else None."""
    try:
        texts = {n: open(os.path.join(folder, n)).read() for n in os.listdir(folder)}
    except OSError:
        return None
    tags = {t.split(" of ")[-1] for t in texts.values()}
    if len(tags) != 1 or sorted(texts) != ["config.json", "model.safetensors", "tokenizer.json"]:
        return None
    tag = tags.pop()
    return tag if all(t == f"{n} of {tag}" for n, t in texts.items()) else None


def test_atomic_replaces_a_folder_syncs_first_and_a_kill_at_any_point_leaves_one_whole(
        tmp_path, monkeypatch):
    """atomic() over an existing folder (OUT/final, OUT/adapter) puts the new one in its place; its
    files and itself are fsynced before the rename, the parent folder after. Killed at each of its
    file-system calls in turn (no cleanup runs: every later call dies too), OUT/final or its aside
    copy is at every moment a whole folder (`loadable`), and the next save recovers and leaves
    nothing but OUT/final. A save that fails (a full disk) leaves the old folder, no temporary."""
    import shutil

    path = str(tmp_path / "final")
    with checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "first")
    synced, replaces = [], []
    real_sync, real_replace = checkpoint._fsync_file, os.replace
    monkeypatch.setattr(checkpoint, "_fsync_file",
                        lambda p: synced.append(os.path.relpath(p, tmp_path)) or real_sync(p))
    monkeypatch.setattr(os, "replace",
                        lambda a, b: replaces.append((len(synced), a, b)) or real_replace(a, b))
    with checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "second")
    monkeypatch.undo()
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    files = {f"final.tmp/{n}" for n in ("model.safetensors", "config.json", "tokenizer.json")}
    into_place = [n for n, a, _ in replaces if a.endswith("final.tmp")]
    assert set(synced[:3]) == files and synced[3] == "final.tmp" and into_place == [4]
    assert synced[4:] == ["."]                                    # then the renames themselves
    # a kill at each file-system call of the replacement in turn
    ops = ("replace", "remove", "fsync")
    real = {name: getattr(os, name) for name in ops}
    real_rmtree = shutil.rmtree
    for k in range(20):
        calls = [0]

        def dies(fn, k=k, calls=calls):
            def call(*a, **kw):
                calls[0] += 1
                if calls[0] > k:
                    raise _Killed
                return fn(*a, **kw)
            return call
        for name in ops:
            monkeypatch.setattr(os, name, dies(real[name]))
        monkeypatch.setattr(shutil, "rmtree", dies(real_rmtree))
        killed = False
        try:
            with checkpoint.atomic(path) as tmp:
                _tagged_folder(tmp, f"kill{k}")
        except _Killed:
            killed = True
        monkeypatch.undo()
        whole = _whole_tag(checkpoint.loadable(path))
        assert whole in ("second", f"kill{k}"), (k, os.listdir(tmp_path))
        with checkpoint.atomic(path) as tmp:                      # the next save
            _tagged_folder(tmp, "second")
        assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"], k
        if not killed:
            break
    assert 4 <= k < 19                                            # it was killed at every call
    # killed between the two renames: only final.old; it loads, and recover() puts it back
    os.rename(path, path + ".old")
    assert checkpoint.loadable(path) == path + ".old"
    checkpoint.recover(path)
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    # a save that fails half way: the error goes on, the old folder stays, no temporary is left
    with pytest.raises(OSError, match="No space left"), checkpoint.atomic(path) as tmp:
        _tagged_folder(tmp, "full")
        raise OSError(28, "No space left on device")
    assert _whole_tag(path) == "second" and os.listdir(tmp_path) == ["final"]
    # a file: one os.replace; a failed one leaves no temporary either
    ckpt = str(tmp_path / "checkpoint.pt")
    for text in ("one", "two"):
        with checkpoint.atomic(ckpt) as tmp, open(tmp, "w") as fh:
            fh.write(text)
    with pytest.raises(OSError), checkpoint.atomic(ckpt) as tmp, open(tmp, "w") as fh:
        fh.write("thr")
        raise OSError(28, "No space left on device")
    assert open(ckpt).read() == "two" and sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "final"]


def test_save_final_replaces_final_and_a_kill_between_its_renames_still_loads(tiny_run_inputs,
                                                                              tmp_path, capsys):
    """save_final over an earlier OUT/final: the new weights, nothing else left in OUT. Killed
    between its two renames, only OUT/final.old is there: models.load_model (--model OUT/final,
    as evaluate.py takes it) loads that one with a notice, and the next save puts things right."""
    _, tok, model = models.load_model(str(tiny_run_inputs / "model"))
    out, final = str(tmp_path), str(tmp_path / "final")
    models.save_final(out, model, tok, model.state_dict())
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    models.save_final(out, model, tok, model.state_dict())
    assert os.listdir(tmp_path) == ["final"]
    os.rename(final, final + ".old")                             # the moment between the renames
    path, _, loaded = models.load_model(final)
    assert path == final + ".old" and "final.old is whole" in capsys.readouterr().err
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    models.save_final(out, model, tok, model.state_dict())
    assert os.listdir(tmp_path) == ["final"]
    assert all(torch.equal(v, trained[k]) for k, v in weights_of(final).items())


def test_runlog_trims_both_logs_on_resume_and_a_fresh_run_starts_them(tmp_path, capsys):
    """--resume from step 2 after a run killed in the middle of step 5's lines: metrics.jsonl and
    completions.jsonl both keep steps <= 2 (step 2's own lines too) and go on from there, each step
    logged once. A fresh run (no --resume) in that folder starts both logs (and config.json) anew,
    and without --log-completions leaves no completions.jsonl of the run before."""
    from types import SimpleNamespace
    args = SimpleNamespace(out=str(tmp_path), report_to="none", log_completions=2)

    def steps(log, todo):
        for s in todo:
            log.log({"step": s, "loss": s / 4})
            log.completions(s, [{"response": f"{s}a"}, {"response": f"{s}b"}])
            if s == 2:
                log.log({"step": 2, "eval/accuracy": 0.5})

    def logged(name):
        return [(r["step"], r.get("response", "eval" if "eval/accuracy" in r else ""))
                for r in metrics.read_metrics(str(tmp_path / name))]
    log = metrics.RunLog(args, {"run": 1})
    log.log({"step": 0, "eval/accuracy": 0.25})
    steps(log, [1, 2, 3, 4])
    log.close()
    for name in ("metrics.jsonl", "completions.jsonl"):
        with open(tmp_path / name, "a") as fh:
            fh.write('{"step": 5, "lo')                          # killed mid-write
    log = metrics.RunLog(args, {"run": 1, "resume": True}, resume_step=2)
    steps(log, [3, 4, 5])
    log.close()
    assert [s for s, _ in logged("metrics.jsonl")] == [0, 1, 2, 2, 3, 4, 5]
    assert logged("completions.jsonl") == [(s, f"{s}{c}") for s in range(1, 6) for c in "ab"]
    assert capsys.readouterr().err.count("dropped its last line, cut short") == 2
    log = metrics.RunLog(args, {"run": 2})
    steps(log, [1])
    log.close()
    assert logged("metrics.jsonl") == [(1, "")]
    assert logged("completions.jsonl") == [(1, "1a"), (1, "1b")]
    assert json.loads((tmp_path / "config.json").read_text()) == {"run": 2}
    args.log_completions = 0
    metrics.RunLog(args, {"run": 3}).close()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "metrics.jsonl"]


def test_load_restores_the_global_rng_states_that_a_reward_may_draw_from(tmp_path):
    """train.py draws from no global RNG itself, but a --reward function may (ablate's
    random_reward draws from `random`): load() puts back the torch and Python RNG states that save()
    found, so a resumed run draws what the unbroken one drew after its checkpoint (the kill test
    below checks it end to end, with flip_x)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.manual_seed(1)
    random.seed(1)
    torch.rand(5), random.random()
    checkpoint.save(str(tmp_path / "c.pt"), model, opt, sched, {"step": 1})
    unbroken = torch.rand(5), random.random()
    torch.manual_seed(1)                              # a new process: train.py seeds torch again
    random.seed(2)
    checkpoint.load(str(tmp_path / "c.pt"), model, opt, sched)
    resumed = torch.rand(5), random.random()
    assert torch.equal(resumed[0], unbroken[0]) and resumed[1] == unbroken[1]


class _AloneAs:
    """A Dist for update_policy that says it is one of `world` ranks; each collective sees only
    itself."""
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
    # FSDP2 all-gathers in every forward: per response
    (True, False, 1, (False, True), (False, True)),
    # checkpointed layers drop the cache with gradients
    (False, True, 1, (True, True), (False, True)),
    # DDP syncs in each forward: one bucket per slice
    (False, False, 2, (True, False), (True, False))])
def test_update_policy_tells_the_training_forward_its_mode(tiny_model, monkeypatch, fsdp,
                                                           checkpointing, world, nograd, grad):
    """rollout_logprobs does not inspect the model: update_policy passes (shared_prefix, buckets),
    for the
    no-grad old log-prob pass and for the gradient passes."""
    import contextlib
    import copy
    from types import SimpleNamespace
    seen, real = set(), update.rollout_logprobs

    def spy(model, roll, rows, temperature, with_entropy=False, shared_prefix=True, buckets=True,
            entropy_grad=None):
        seen.add((torch.is_grad_enabled(), shared_prefix, buckets))
        return real(model, roll, rows, temperature, with_entropy, entropy_grad=entropy_grad)

    monkeypatch.setattr(update, "rollout_logprobs", spy)
    roll = mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    args = SimpleNamespace(micro_batch_size=4,
                           micro_batch_tokens=10**6, mini_batches=1, mu=2, temperature=1.0,
                           reduction="token", loss="ppo",
                           fsdp=fsdp, gradient_checkpointing=checkpointing, max_new_tokens=20,
                           eps_low=0.2,
                           eps_high=0.28, clip_c=0.0, tis_cap=0.0, off_policy_mask=0.0, top_p=1.0,
                           entropy_coef=0.0, beta=0.0,
                           kl="k3", grad_clip=1.0)
    model = copy.deepcopy(tiny_model)
    learner = update.Learner(model, model, None, torch.optim.SGD(model.parameters(), lr=0.0),
                             contextlib.nullcontext)
    update.update_policy(learner, roll, torch.randn(N), roll.mask, args, _AloneAs(world))
    assert seen == {(False, *nograd), (True, *grad)}


def _update_args(**kw):
    """update_policy's args (the flags.TrainArgs fields it reads): 2 mini-batches, micro-batches of
    3,
    no clip."""
    from types import SimpleNamespace
    base = dict(micro_batch_size=3,
                micro_batch_tokens=10**6, mini_batches=2, mu=1, temperature=1.0, reduction="token",
                loss="ppo", fsdp=False, gradient_checkpointing=False, max_new_tokens=20,
                eps_low=0.2, eps_high=0.28, clip_c=0.0, tis_cap=0.0, off_policy_mask=0.0, top_p=1.0,
                entropy_coef=0.0, beta=0.0,
                kl="k3", grad_clip=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_update_policy_backwards_world_times_the_loss_for_ddps_mean(tiny_model):
    # DDP averages the ranks' gradients, and each rank's loss is its share of the global mean (the
    # denominators are all ranks' counts), so each rank backwards W x its share: the mean is then
    # the sum. A rank that says it is one of 2 (its collectives see itself alone) backwards twice
    # the gradient of one process on the same rows; SGD (lr 1, no clip) moves each weight by it.
    import contextlib
    import copy
    roll = mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    advantages = torch.randn(N, generator=torch.Generator().manual_seed(1))
    moves, losses = [], []
    for world in (1, 2):
        model = copy.deepcopy(tiny_model)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        learner = update.Learner(model, model, None, sgd, contextlib.nullcontext)
        stats = update.update_policy(learner, roll, advantages, roll.mask,
                                     _update_args(mini_batches=1), _AloneAs(world))
        moves.append(torch.cat([(p - q).detach().view(-1)
                                for p, q in zip(model.parameters(), tiny_model.parameters())]))
        losses.append(stats.first["loss"])
    assert moves[0].abs().max() > 1e-3
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)            # the logged loss: unscaled
    assert torch.allclose(moves[1], 2 * moves[0], atol=1e-6, rtol=1e-4)  # float32, weights ~1


class _MeanGradSGD(torch.optim.SGD):
    """SGD whose step first averages each gradient over the thread ranks, as DDP's all-reduce does
    (so the ranks' weights stay equal through several updates)."""

    def __init__(self, params, rank, lr):
        super().__init__(params, lr=lr)
        self.rank = rank

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        every = self.rank.group.exchange(self.rank.rank, grads)
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in every) / self.rank.world
        return super().step(closure)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_two_thread_ranks_update_as_one_process_on_all_rows(tiny_model, reduction):
    # 3 groups of 4 on 2 ranks (rank 0: groups 0 and 2, rank 1: group 1, so their token and
    # response counts differ), --mini-batches 2 (the second held by rank 0 alone: rank 1 runs a
    # zero-weight pass), --mu 2, SGD with DDP's mean of the gradients: both ranks end on the weights
    # of one process updating on all rows, and their summed metrics are its metrics. Each update's
    # denominators must be the mini-batch's over both ranks (grpo.token_weights' num_tokens,
    # num_seqs): a rank's own count scales its gradient otherwise.
    import contextlib
    import copy

    from infra import parallel
    roll = mixed_rollout(tiny_model, 1.0)
    N, G = roll.response_ids.shape[0], roll.G
    roll.index = torch.arange(N // G).repeat_interleave(G)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(4))
    args = _update_args(mu=2, reduction=reduction)

    def run(r, ranks):
        model = copy.deepcopy(tiny_model)
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if isinstance(ranks, parallel.Dist)
               else _MeanGradSGD(model.parameters(), ranks, lr=0.5))
        learner = update.Learner(model, model, None, opt, contextlib.nullcontext)
        a = adv[torch.cat([torch.arange(i * G, (i + 1) * G) for i in r.index[::G].tolist()])]
        stats = update.update_policy(learner, r, a, r.mask, args, ranks)
        return torch.cat([p.detach().view(-1) for p in model.parameters()]), stats

    one, one_stats = run(roll, parallel.Dist("cpu"))
    parts = [roll.select_groups(torch.tensor(k)) for k in ([True, False, True],
                                                           [False, True, False])]
    assert parts[0].mask.sum() != parts[1].mask.sum()
    out = on_thread_ranks(2, lambda ranks: run(parts[ranks.rank], ranks))
    (w0, s0), (w1, s1) = out
    start = torch.cat([p.detach().view(-1) for p in tiny_model.parameters()])
    assert (one - start).abs().max() > 1e-3
    assert torch.equal(w0, w1)
    assert torch.allclose(w0, one, atol=1e-5), (w0 - one).abs().max()
    for key in ("loss", "tokens", "updates", "ratio/mean"):
        assert s0.first[key] == pytest.approx(one_stats.first[key], rel=1e-5, abs=1e-6), key
        assert s0.rest[key] == pytest.approx(one_stats.rest[key], rel=1e-5, abs=1e-6), key


class _NoSyncRecorder(torch.nn.parallel.DistributedDataParallel):
    """A DDP (so parallel.grad_sync takes it for one) without a process group: it runs the model and
    records, for each forward, its rows and whether it ran outside no_sync (DDP reads that flag as a
    forward starts: outside, the backward all-reduces). A real DDP in this process can deadlock when
    it is freed (its gloo threads wait for the GIL, held by the thread that joins them)."""

    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.inside, self.synced = module, False, []

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def inside():
            assert not self.inside
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
        return inside()

    def forward(self, *args, **kwargs):
        self.synced.append((kwargs["input_ids"].shape[0], not self.inside))
        return self.module(*args, **kwargs)


def test_ddp_syncs_only_the_last_micro_batch_of_each_update(tiny_model):
    # 3 groups of 4 in 2 mini-batches (8 + 4 rows), micro-batches of 3: [3, 3, 2] then [3, 1], twice
    # (--mu 2); only each update's last micro-batch all-reduces. The Dist says 2 ranks, so each
    # micro-batch runs as one DDP forward (ranks' forwards must pair up); the old log-probs run on
    # the model, not through DDP.
    import contextlib
    import copy
    roll = mixed_rollout(tiny_model, 1.0)
    N = roll.response_ids.shape[0]
    roll.index = torch.arange(N // roll.G).repeat_interleave(roll.G)
    model = copy.deepcopy(tiny_model)
    policy = _NoSyncRecorder(model)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    learner = update.Learner(policy, model, None, sgd, contextlib.nullcontext)
    update.update_policy(learner, roll, torch.randn(N), roll.mask, _update_args(mu=2), _AloneAs(2))
    one_pass = [(3, False), (3, False), (2, True), (3, False), (1, True)]
    assert policy.synced == one_pass * 2
