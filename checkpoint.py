"""Checkpoints: everything an exact resume needs, written atomically.

Not an article section: the run's bookkeeping. `save` writes model, optimizer, scheduler, RNG states,
step and data position to one file through a temporary name and os.replace, so a crash or SIGKILL in
the middle of a save leaves the previous checkpoint intact. `load` reads it back with
`weights_only=True` (no pickled code is ever executed).

With `--fsdp` no rank holds the whole model: `save_sharded` writes a folder through
torch.distributed.checkpoint (DCP), each rank its own shards, into OUT/checkpoint/step-N.tmp; after a
barrier rank 0 renames it to step-N and then atomically replaces the pointer file OUT/checkpoint/latest, so
a crash at any point leaves `latest` naming a complete checkpoint. Only tensors go through DCP (its loader
unpickles anything else with weights_only=False); the rest (optimizer hyperparameters, scheduler, step,
data position) is one small torch.save file, and each rank's RNG states another, both read back with
weights_only=True. `load_sharded` reads the shards into the model's and optimizer's own sharded tensors,
so a checkpoint is never gathered on one rank.

One run per output folder: `lock_folder` holds an flock on OUT/.lock for the whole run, so a second run (a
double launch, a --resume while the first still runs) stops at once instead of writing into a live run's
metrics and checkpoints.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import random
import shutil
import sys

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing or cannot be read: train.py prints the message in one line."""


class FolderInUse(ValueError):
    """Another live run holds the output folder: train.py prints the message in one line."""


def lock_folder(out: str, ddp):
    """An exclusive lock on the output folder for the whole run: rank 0 takes `fcntl.flock` on OUT/.lock and
    keeps the returned file open; the kernel drops the lock when the process ends, however it ends (a
    SIGKILL leaves no stale lock). Every rank learns rank 0's verdict (an all-reduced flag); when another run
    holds the folder, rank 0 raises FolderInUse (one line) and the other ranks exit 2 without a word."""
    fh, held = None, 1.0
    if ddp.master:
        os.makedirs(out, exist_ok=True)
        fh = open(os.path.join(out, ".lock"), "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fh.truncate(0)
            fh.write(f"{os.getpid()}\n")  # who holds it, for the message a second run prints
            fh.flush()
        except BlockingIOError:
            fh.seek(0)
            pid = fh.read().strip() or "?"
            fh.close()
            fh, held = None, 0.0
    if ddp.sum(torch.tensor([held])).item() == ddp.world:  # rank 0's flag, and 1 from each other rank
        return fh
    if not ddp.master:
        sys.exit(2)
    raise FolderInUse(f"--out {out} is in use by another run (pid {pid} holds {os.path.join(out, '.lock')}): "
                          "let it finish or stop it, or pass another --out")


# what torch.load(weights_only=True) and load_state_dict raise on a corrupt, truncated or foreign file
UNREADABLE = (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError)


@contextlib.contextmanager
def atomic(path: str):
    """Yields a temporary name beside `path` to write a file or folder to; once written, it replaces `path`
    in one os.replace (an old folder is removed first), so a crash mid-write never leaves a half-written
    `path` and keeps the previous one."""
    tmp = f"{path}.tmp{os.getpid()}"
    yield tmp
    if os.path.isdir(tmp) and os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def save_final(out: str, model, tokenizer, weights: dict, adapter=None) -> str:
    """OUT/final: the trained model (with `weights`: LoRA's merged, FSDP2's gathered) and its tokenizer,
    written atomically; with `adapter` (a function writing LoRA's adapter alone into a folder), OUT/adapter
    beside it. Returns OUT/final."""
    final = os.path.join(out, "final")
    with atomic(final) as tmp:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
    if adapter is not None:
        with atomic(os.path.join(out, "adapter")) as tmp:
            adapter(tmp)
    return final


def save(path: str, model, opt, sched, state: dict) -> None:
    """Write everything a resume needs to `path` atomically: a crash mid-save keeps the last good one."""
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": _rng_states(), **state}
    with atomic(path) as tmp:
        torch.save(ckpt, tmp)


def load(path: str, model, opt, sched) -> dict:
    """Restore model, optimizer, scheduler and RNG states from `path`; returns the checkpoint's dict."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    except UNREADABLE as e:
        raise CheckpointError(f"{path}: not a usable checkpoint ({str(e).splitlines()[0]})") from None
    _set_rng_states(ckpt["rng"])
    return ckpt


def _rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_states(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _split(tree, prefix: str, tensors: dict):
    """A copy of nested dicts / lists / tuples with every tensor leaf moved to tensors[path], left as its path."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree
        return {"__tensor__": prefix}
    if isinstance(tree, dict):
        return {k: _split(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree))
    return tree


def _join(tree, tensors: dict):
    """The inverse of _split: the skeleton with each path replaced by its tensor."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        return {k: _join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_join(v, tensors) for v in tree)
    return tree


def _sharded_dicts(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)  # this rank's shards (DTensors); creates AdamW's state if it has none
    return {"model": msd, "optimizer": osd}


def latest(folder: str) -> str | None:
    """The complete sharded checkpoint under `folder` (OUT/checkpoint), or None."""
    try:
        with open(os.path.join(folder, "latest")) as fh:
            return os.path.join(folder, fh.read().strip())
    except FileNotFoundError:
        return None


def save_sharded(folder: str, model, opt, sched, state: dict, ddp) -> None:
    """Every rank writes its shards of model and optimizer to folder/step-N; atomic as a whole (see above)."""
    import torch.distributed.checkpoint as dcp
    name = f"step-{state['step']:06d}"
    target, tmp = os.path.join(folder, name), os.path.join(folder, name + ".tmp")
    if ddp.master:
        shutil.rmtree(tmp, ignore_errors=True)          # left by a crash mid-save
        os.makedirs(tmp)
    ddp.barrier()
    tensors = {}
    skeleton = _split(_sharded_dicts(model, opt), "", tensors)
    dcp.save(tensors, checkpoint_id=tmp)
    torch.save({"rng": _rng_states()}, os.path.join(tmp, f"rng-rank{ddp.rank}.pt"))
    if ddp.master:
        torch.save({"skeleton": skeleton, "scheduler": sched.state_dict(), "world_size": ddp.world, **state},
                   os.path.join(tmp, "state.pt"))
    ddp.barrier()                                        # every rank's files are written
    if ddp.master:
        previous = latest(folder)
        if os.path.isdir(target):                        # a same-step save that never became `latest`
            shutil.rmtree(target)
        os.rename(tmp, target)
        with atomic(os.path.join(folder, "latest")) as tmp_latest, open(tmp_latest, "w") as fh:
            fh.write(name)
        if previous and os.path.abspath(previous) != os.path.abspath(target):
            shutil.rmtree(previous, ignore_errors=True)
    ddp.barrier()


def load_sharded(folder: str, model, opt, sched, ddp) -> dict:
    """Restore this rank's shards, the optimizer, the scheduler and this rank's RNG from `folder`'s latest
    checkpoint; returns the saved train state (step, data position, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    path = latest(folder)
    if path is None:
        raise CheckpointError(f"{folder}: no sharded checkpoint (no 'latest' file)")
    try:
        meta = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
        if meta["world_size"] != ddp.world:
            raise ValueError(f"saved by {meta['world_size']} ranks, resumed on {ddp.world}: the RNG states are per rank")
        rng = torch.load(os.path.join(path, f"rng-rank{ddp.rank}.pt"), map_location="cpu", weights_only=True)["rng"]
        tensors = {}
        _split(_sharded_dicts(model, opt), "", tensors)   # the tensors to read into, sharded as this run shards
        dcp.load(tensors, checkpoint_id=path)
        saved = _join(meta["skeleton"], tensors)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
        sched.load_state_dict(meta["scheduler"])
    except UNREADABLE as e:
        raise CheckpointError(f"{path}: not a usable checkpoint ({str(e).splitlines()[0]})") from None
    _set_rng_states(rng)
    return meta


def trim_metrics(path: str, last_step: int) -> None:
    """Keep the metric lines of steps <= last_step, so a resumed run logs each step exactly once."""
    if os.path.exists(path):
        with open(path) as fh:
            keep = [line for line in fh if line.strip() and json.loads(line)["step"] <= last_step]
        with open(path, "w") as fh:
            fh.writelines(keep)
