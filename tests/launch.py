"""Launchers for the end-to-end tests (not collected): train.py in a subprocess, a script under
torchrun on CPU ranks (gloo), the gloo-thread-counting driver and the SIGKILL driver, each run with
the repo root (ROOT) as cwd so that `--reward test_grpo:NAME` and `import train` resolve. A launch
that times out ends with every process it started (`run_tree`): torchrun starts each worker in a
session of its own, so ending torchrun, or its process group, left the workers running. And, for
the fast tier, ranks as threads of this process (`on_thread_ranks`): collectives over values that
differ from rank to rank, without a process group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import torch

from helpers import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root


def _children(pid: int) -> list[int]:
    """The pids whose parent is pid (from /proc; [] where there is none)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:   # "pid (comm) state ppid ...": comm may
                    fields = fh.read().rsplit(")", 1)[1].split()  # hold spaces and parentheses
            except OSError:                                # it ended while listed
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL to pid, every process below it (in any session: torchrun's workers start their own)
    and its process group. The tree is stopped top-down first (SIGSTOP), so nothing in it forks
    while it is walked or is reparented away before its kill."""
    stopped, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        stopped.append(p)
        todo += _children(p)
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


PIPE_GRACE_S = 10  # run_tree: how long the output may stay open after the kill


def run_tree(cmd, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs), the command
    in a new session; when it times out (or the test is interrupted) the whole tree it started is
    killed (kill_tree) before subprocess.TimeoutExpired is raised, so no worker outlives its test
    holding its ports."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as e:
            kill_tree(proc.pid)
            try:          # the pipes close when the last process holding them ends: the tree's
                out, err = proc.communicate(timeout=PIPE_GRACE_S)
            except subprocess.TimeoutExpired:        # one outside it holds them: give up on them
                out, err = "", f"(the output was still held open {PIPE_GRACE_S} s after the kill)"
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class ThreadGroup:
    """W ranks as W threads of this process: each collective is an exchange of one value per rank
    (write, wait for all, read all, wait until all have read)."""

    def __init__(self, world):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world, timeout=120)   # a rank that never comes: fails

    def exchange(self, rank, x):
        self.slots[rank] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadRank:
    """Dist of rank `rank` of a ThreadGroup: sums, maxima and gathers over the ranks' own values,
    which differ (test_ranks_checkpoints' _Twin adds a rank to itself), so a per-rank count used
    where the global one belongs shows."""
    device = "cpu"

    def __init__(self, group, rank):
        self.group, self.rank, self.world, self.master = group, rank, group.world, rank == 0

    def sum(self, x):
        return sum(self.group.exchange(self.rank, x.detach().to(torch.float64).clone()))

    def sum_named(self, sums):
        keys = sorted(sums)
        total = self.sum(torch.tensor([float(sums[k]) for k in keys]))
        return dict(zip(keys, total.tolist()))

    def max(self, n):
        return max(self.group.exchange(self.rank, n))

    def gather(self, x):
        return [y.clone() for y in self.group.exchange(self.rank, x)]


def on_thread_ranks(world: int, fn) -> list:
    """[fn(ThreadRank(group, r)) for r in range(world)], each rank on a thread of its own (their
    collectives meet); an exception on one rank breaks the others' waits and is raised."""
    group, out = ThreadGroup(world), [None] * world

    def main(r):
        try:
            out[r] = fn(ThreadRank(group, r))
        except BaseException as e:
            out[r] = e
            group.barrier.abort()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException) and not isinstance(o, threading.BrokenBarrierError):
            raise o
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def run_train(d, out, *extra):
    flags = tiny_flags(d, out)
    # --reward repeats to sum several rewards: the caller's replaces the default one
    if "--reward" in extra:
        del flags[flags.index("--reward"):flags.index("--reward") + 2]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *flags, "--steps", "2", "--eval-every",
           "1", *extra]
    res = run_tree(cmd, 300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(d)})
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def torchrun(nproc, script, *flags):
    """`script flags` under torchrun on nproc CPU ranks (gloo); fails the test unless every rank
    exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *flags]
    # a rank that aborts prints its stack
    res = run_tree(cmd, 300, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    assert res.returncode == 0, res.stderr[-3000:]


def thread_counting_driver(tmp_path):
    """A script that runs train.main, then writes how many gloo threads its rank still has to
    threads<RANK>."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        f"import os, sys\nsys.path.insert(0, {ROOT!r})\nimport train\ntrain.main(sys.argv[1:])\n"
        "def comm(t):  # a thread that ended since the listing is not one left running\n"
        "    try:\n"
        "        return open(f'/proc/self/task/{t}/comm').read().strip()\n"
        "    except (FileNotFoundError, ProcessLookupError):\n"
        "        return ''\n"
        "names = [comm(t) for t in os.listdir('/proc/self/task')]\n"
        f"open(os.path.join({str(tmp_path)!r}, 'threads' + os.environ['RANK']), 'w').write(\n"
        "    str(sum('gloo' in n for n in names)))\n")
    return driver


# A process that imports train.py (torch, transformers, what they import on first use) once, then
# forks one child per line of stdin ({"argv", "out", "log", "kill_after_s" | "kill_after_bytes"}):
# a train.main run that the driver kills with SIGKILL after kill_after_s seconds, or that kills
# itself with SIGKILL once kill_after_bytes bytes went to the files it writes under OUT
# (CutWrites). One line back per run: how it ended.
KILL_DRIVER = r"""
import builtins, json, os, random, signal, sys, time, traceback
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import train
from harness import models
from launch import CutWrites
# what transformers and torch import on first use: the model, AdamW
models.load_model(sys.argv[1])
param = torch.zeros(1, requires_grad=True)
param.grad = torch.ones(1)
torch.optim.AdamW([param]).step()

def child(cmd):
    log = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    cut = CutWrites(cmd["out"], cmd.get("kill_after_bytes"),
                    lambda: os.kill(os.getpid(), signal.SIGKILL))
    builtins.open = cut
    random.seed(0)  # as python -m ablate does: the Python RNG of a fresh run is seeded too
    code = 0
    try:
        train.main(cmd["argv"])
    except SystemExit as e:  # train.py's one-line errors: exit 2
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    with cut.real_open(cmd["log"] + ".bytes", "w") as fh:
        fh.write(str(cut.written))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    cmd = json.loads(line)
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        child(cmd)
    deadline = t0 + min(cmd.get("kill_after_s") or 120.0, 120.0)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.001)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"killed": killed, "code": os.waitstatus_to_exitcode(status),
                      "seconds": time.time() - t0}), flush=True)
"""


def _clocked(key: str) -> bool:
    """A metric read off the wall clock: time/*, perf/'s MFU and tokens/s (not perf/flops)."""
    return key.startswith(("time/", "perf/mfu")) or key == "perf/tokens_per_s"


def run_record(out):
    """What a finished run left: its logs without the wall-clock keys (_clocked), its final/ byte
    for byte, config.json without the keys that name the folder or the resume, and the names in
    OUT."""
    def rows(name):
        return [{k: v for k, v in json.loads(x).items() if not _clocked(k)}
                for x in (out / name).read_text().splitlines()]
    config = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
              if k not in ("out", "resume")}
    final = {p.name: p.read_bytes() for p in sorted((out / "final").iterdir())}
    return {"metrics": rows("metrics.jsonl"), "completions": rows("completions.jsonl"),
            "final": final, "config": config, "files": sorted(os.listdir(out))}


class CutWrites:
    """A stand-in for builtins.open: the files it opens for writing under `folder` count the
    characters written to them, all together; once `budget` of them are written, the write in
    progress puts only its first part in the file, flushes, and calls die() (budget None: it only
    counts). What a kill after that many bytes leaves (json writes ASCII: characters are bytes)."""

    def __init__(self, folder, budget, die):
        import builtins
        self.folder, self.budget, self.die = os.path.abspath(folder) + os.sep, budget, die
        self.written, self.real_open = 0, builtins.open

    def __call__(self, file, mode="r", *args, **kwargs):
        fh = self.real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and \
                os.path.abspath(file).startswith(self.folder):
            return _CutFile(fh, self)
        return fh


class _CutFile:
    def __init__(self, fh, cut):
        self.fh, self.cut = fh, cut

    def write(self, text):
        c = self.cut
        if c.budget is not None and c.written + len(text) > c.budget:
            self.fh.write(text[:c.budget - c.written])
            self.fh.flush()
            c.die()
        c.written += len(text)
        return self.fh.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.fh.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.fh, name)
