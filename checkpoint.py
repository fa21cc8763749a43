"""Checkpoints: everything an exact resume needs, written atomically.

Not an article section: the run's bookkeeping. `save` writes model, optimizer, scheduler, RNG states,
step and data position to one file through a temporary name and os.replace, so a crash or SIGKILL in
the middle of a save leaves the previous checkpoint intact. `load` reads it back with
`weights_only=True` (no pickled code is ever executed).
"""
from __future__ import annotations

import json
import os
import random

import torch

from data import InputError


def save(path: str, model, opt, sched, state: dict) -> None:
    """Write everything a resume needs to `path` atomically: a crash mid-save keeps the last good one."""
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            **state}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def load(path: str, model, opt, sched) -> dict:
    """Restore model, optimizer, scheduler and RNG states from `path`; returns the checkpoint's dict."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise InputError(f"{path}: not a usable checkpoint ({str(e).splitlines()[0]})") from None
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    if ckpt["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return ckpt


def trim_metrics(path: str, last_step: int) -> None:
    """Keep the metric lines of steps <= last_step, so a resumed run logs each step exactly once."""
    if os.path.exists(path):
        with open(path) as fh:
            keep = [line for line in fh if line.strip() and json.loads(line)["step"] <= last_step]
        with open(path, "w") as fh:
            fh.writelines(keep)
