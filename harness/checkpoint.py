"""Checkpoints on disk: everything an exact resume needs, written atomically (harness/models.py
loads
--model and writes the final model through `atomic`).

Not an article section: the run's bookkeeping, written so that a SIGKILL at any byte (the OOM
killer, a preemption) loses nothing but the work since the last checkpoint. `save` writes model,
optimizer, scheduler, RNG states, step and data position to one file through `atomic` (a temporary
name, fsync, os.replace), so a crash in the middle of a save leaves the previous checkpoint intact.
`load` reads it back with `weights_only=True` (no pickled code is ever executed). `recover` and
`loadable` find the whole copy of a folder whose atomic replacement a kill cut (OUT/final.old).

The logs (metrics.jsonl, completions.jsonl) are harness/metrics.py's: appended to line by line, read
back without a last line a kill cut (metrics.read_metrics), rewritten by --resume through
`write_text`.

With `--fsdp` no rank holds the whole model: `save_sharded` writes a folder through
torch.distributed.checkpoint (DCP), each rank its own shards, into OUT/checkpoint/step-N.tmp; after
a barrier rank 0 renames it to step-N and then atomically replaces the pointer file
OUT/checkpoint/latest, so a crash at any point leaves `latest` naming a complete checkpoint. Only
tensors go through DCP (its loader unpickles anything else with weights_only=False); the rest
(optimizer hyperparameters, scheduler, step, data position) is one small torch.save file, and each
rank's RNG states another, both read back with weights_only=True. `load_sharded` reads the shards
into the model's and optimizer's own sharded tensors, so a checkpoint is never gathered on one rank,
and DCP reshards them: a run saved on N ranks resumes on any other number (`rank_for_rng`).

One run per output folder: `lock_folder` holds an flock on OUT/.lock for the whole run, so a second
run (a double launch, a --resume while the first still runs) stops at once instead of writing into a
live run's metrics and checkpoints.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import random
import shutil
import sys

import torch

from infra.errors import CheckpointError, FolderInUse


def lock_folder(out: str, ranks):
    """An exclusive lock on the output folder for the whole run: rank 0 takes `fcntl.flock` on
    OUT/.lock and keeps the returned file open; the kernel drops the lock when the process ends,
    however it ends (a SIGKILL leaves no stale lock). Every rank learns rank 0's verdict (an
    all-reduced flag); when another run holds the folder,
    rank 0 raises FolderInUse (one line) and the other ranks exit 2 without a word."""
    fh, held = None, 1.0
    if ranks.master:
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
    # rank 0's flag, and 1 from each other rank
    if ranks.sum(torch.tensor([held])).item() == ranks.world:
        return fh
    if not ranks.master:
        sys.exit(2)
    raise FolderInUse(f"--out {out} is in use by another run (pid {pid} holds "
                      f"{os.path.join(out, '.lock')}): let it finish or stop it, or pass another "
                      f"--out")


# what torch.load(weights_only=True) and load_state_dict raise on a corrupt, truncated or foreign
# file
UNREADABLE = (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError)


@contextlib.contextmanager
def atomic(path: str):
    """Yields a temporary name beside `path`, PATH.tmp, to write a file or a folder to; once the
    body is done, it is fsynced (a folder: each file in it, then the folder) and takes the place of
    `path`, so that a crash or a kill at any moment leaves the old `path` or the new one, whole.

    A file: one os.replace. A folder, which os.replace cannot put over another: the old one is
    renamed aside to PATH.old, the new one into place, then the old one removed. A kill between the
    two renames leaves PATH.old alone: `loadable` reads it, and the next atomic() on `path` first
    renames it back (`recover`, which also removes a PATH.tmp or a PATH.old that a killed save
    left). When the body raises (a full disk), the temporary is removed and the error goes on. The
    caller holds the folder's lock (`lock_folder`): one writer at a time."""
    tmp, old = f"{path}.tmp", f"{path}.old"
    recover(path)
    try:
        yield tmp
        _fsync_tree(tmp)
        folder = os.path.isdir(tmp) and os.path.isdir(path)
        if folder:
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))  # the renames reach the disk
        if folder:
            shutil.rmtree(old)
    except BaseException:
        _remove(tmp)
        recover(path)  # failed between the renames of a folder: the old one back
        raise


def recover(path: str) -> None:
    """Undo what a killed `atomic` on `path` left: PATH.old alone (killed between the renames) goes
    back to `path`; PATH.old beside a new `path` (killed before removing it) and a PATH.tmp are
    removed."""
    old = f"{path}.old"
    if os.path.lexists(old):
        if os.path.lexists(path):
            _remove(old)
        else:
            os.replace(old, path)
    _remove(f"{path}.tmp")


def loadable(path: str) -> str:
    """`path`, or its aside copy PATH.old where a kill in `atomic` left only that one (read-only:
    the next save puts it back); a notice says so."""
    old = f"{path.rstrip(os.sep)}.old"
    if not os.path.exists(path) and os.path.isdir(old):
        print(f"note: {path} is missing, {old} is whole (a save was killed half way): loading that",
              file=sys.stderr)
        return old
    return path


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    """fsync a folder: its entries (a rename, a new name) reach the disk."""
    _fsync_file(path)


def _fsync_tree(path: str) -> None:
    """fsync a file, or every file and folder under a folder (the folder last)."""
    if not os.path.isdir(path):
        _fsync_file(path)
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            _fsync_file(os.path.join(root, name))
        _fsync_dir(root)


def write_text(path: str, text: str) -> None:
    """Write a small file (config.json, a rewritten log) through `atomic`."""
    with atomic(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)


def save(path: str, model, opt, sched, state: dict) -> None:
    """Write everything a resume needs to `path` atomically:
    a crash mid-save keeps the last good one."""
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": _rng_states(), **state}
    with atomic(path) as tmp:
        torch.save(ckpt, tmp)


def load(path: str, model, opt, sched) -> dict:
    """Restore model, optimizer, scheduler and RNG states from `path`;
    returns the checkpoint's dict."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    except UNREADABLE as e:
        raise CheckpointError(
            f"{path}: not a usable checkpoint ({str(e).splitlines()[0]})") from None
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
    """A copy of nested dicts / lists / tuples with every tensor leaf moved to
    tensors[path], left as its path."""
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
    # this rank's shards (DTensors); creates AdamW's state if it has none
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def latest(folder: str) -> str | None:
    """The complete sharded checkpoint under `folder` (OUT/checkpoint), or None."""
    try:
        with open(os.path.join(folder, "latest")) as fh:
            return os.path.join(folder, fh.read().strip())
    except FileNotFoundError:
        return None


def save_sharded(folder: str, model, opt, sched, state: dict, ranks) -> None:
    """Every rank writes its shards of model and optimizer to folder/step-N;
    atomic as a whole (see above)."""
    import torch.distributed.checkpoint as dcp
    name = f"step-{state['step']:06d}"
    target, tmp = os.path.join(folder, name), os.path.join(folder, name + ".tmp")
    if ranks.master:
        shutil.rmtree(tmp, ignore_errors=True)          # left by a crash mid-save
        os.makedirs(tmp)
    ranks.barrier()
    tensors = {}
    skeleton = _split(_sharded_dicts(model, opt), "", tensors)
    dcp.save(tensors, checkpoint_id=tmp)                 # fsyncs its files (sync_files)
    rng = os.path.join(tmp, f"rng-rank{ranks.rank}.pt")
    torch.save({"rng": _rng_states()}, rng)
    _fsync_file(rng)                                     # each rank its own (on its host)
    if ranks.master:
        torch.save({"skeleton": skeleton, "scheduler": sched.state_dict(),
                    "world_size": ranks.world, **state},
                   os.path.join(tmp, "state.pt"))
    ranks.barrier()                                        # every rank's files are written
    if ranks.master:
        _fsync_tree(tmp)
        # a same-step save that never became `latest`
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.rename(tmp, target)
        with atomic(os.path.join(folder, "latest")) as tmp_latest, open(tmp_latest, "w") as fh:
            fh.write(name)
        # the previous checkpoint, and what a save killed half way left (a step-N.tmp, a step-N
        # that never became `latest`, one cut by a kill in this rmtree)
        for entry in os.listdir(folder):
            if entry.startswith("step-") and entry != name:
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    ranks.barrier()


def rank_for_rng(rank: int, saved_world: int) -> int:
    """Whose saved RNG states rank `rank` takes when the checkpoint was written by `saved_world`
    ranks: its own where that rank saved, else rank `rank mod saved_world`'s. The run itself draws
    from no global RNG (each prompt's responses come from its own generator, data.prompt_generator,
    and the denominators are global), so a run resumed on another rank count is the unbroken run up
    to the 1-vs-N-ranks reduction order; only a --reward that draws from torch's or Python's global
    RNG sees other draws."""
    return rank % saved_world


def load_sharded(folder: str, model, opt, sched, ranks) -> dict:
    """Restore this rank's shards, the optimizer, the scheduler and this rank's RNG from `folder`'s
    latest checkpoint; returns the saved train state (step, data position, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    path = latest(folder)
    if path is None:
        raise CheckpointError(f"{folder}: no sharded checkpoint (no 'latest' file)")
    try:
        meta = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
        # another rank count: rank r takes saved rank r mod W's global RNG (see rank_for_rng)
        saver = rank_for_rng(ranks.rank, meta["world_size"])
        rng = torch.load(os.path.join(path, f"rng-rank{saver}.pt"), map_location="cpu",
                         weights_only=True)["rng"]
        tensors = {}
        # the tensors to read into, sharded as this run shards
        _split(_sharded_dicts(model, opt), "", tensors)
        dcp.load(tensors, checkpoint_id=path)
        saved = _join(meta["skeleton"], tensors)
        set_state_dict(model, opt, model_state_dict=saved["model"],
                       optim_state_dict=saved["optimizer"])
        sched.load_state_dict(meta["scheduler"])
    except UNREADABLE as e:
        raise CheckpointError(
            f"{path}: not a usable checkpoint ({str(e).splitlines()[0]})") from None
    _set_rng_states(rng)
    return meta


