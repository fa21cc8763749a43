"""`--reward math-verify`: Hugging Face's math-verify (symbolic equivalence through sympy, the
checker TRL's `accuracy_reward` and open-r1 use) as the reward, each response bounded in time.

Article section: "Step 2: Reward 计算", the optional symbolic verifier beside `verifier.verify`
(docs/verifier.md says which to use for which data). Imported only when `--reward math-verify` asks
for it; `pip install math-verify` (requirements-optional.txt).

    python train.py --reward math-verify ...
    python evaluate.py --reward math-verify ...

Why a worker process: math-verify bounds its own time with SIGALRM, which works only in a process's
main thread (elsewhere it raises ValueError) and replaces any SIGALRM handler of the caller; and
with its timeouts off a comparison can run forever (`\\boxed{9^{9^{9^{9}}}}` against `1`). train.py
(`train.reward`, in each torchrun rank's process) and evaluate.py call the reward in the main
thread today, but a reward must not depend on where it is called from (a thread pool, a notebook's
executor, a future asynchronous scorer), nor take the process's one alarm from it. So the
comparison runs in one child process (`python -m harness.math_verify_reward --worker`, its timeouts
off), which the caller waits for at most `timeout_s` per response, from any thread: past that the
child is killed, the response scores 0, `timeouts` counts it and the next call starts a new child.
The reference is read as `verifier.py` reads it (GSM8K's "... #### 72" is 72) and parsed as LaTeX.
"""
from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys

from infra.errors import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
TIMEOUT_S = 5.0     # per response, math-verify's own default (parse and verify 5 s each)
START_S = 120.0     # the child's start (importing sympy): once, and after each timeout


def check_installed() -> None:
    """The one-line error of a run that asks for math-verify without the package."""
    if importlib.util.find_spec("math_verify") is None:
        raise InputError("--reward math-verify needs the math-verify package: "
                         "pip install math-verify (requirements-optional.txt)")


class MathVerify:
    """f(response, answer) -> 1.0 if math-verify finds the response's answer equal to the reference,
    else 0.0 (also when it times out or fails: `timeouts`, `errors` count those)."""

    def __init__(self, timeout_s: float = TIMEOUT_S, command: list[str] | None = None):
        self.child: subprocess.Popen | None = None
        check_installed()
        self.timeout_s, self.timeouts, self.errors = timeout_s, 0, 0
        self.command = command or [sys.executable, "-m", "harness.math_verify_reward", "--worker"]

    def __call__(self, response: str, answer: str) -> float:
        if not isinstance(response, str) or not isinstance(answer, str):
            return 0.0
        import verifier  # the reference's final answer, read as the default reward reads it
        gold = verifier.extract_answer(answer) or answer
        if self.child is None:
            self._start()
        try:
            self.child.stdin.write(json.dumps([response, gold]) + "\n")
            self.child.stdin.flush()
            line = self._read_line(self.timeout_s)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:            # past the bound, or the child died: a new child next time
            self.timeouts += 1
            self.close()
            return 0.0
        self.errors += line.strip() == "error"
        return 1.0 if line.strip() == "1" else 0.0

    def _start(self) -> None:
        self.child = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      encoding="utf-8")
        ready = self._read_line(START_S)
        if ready is None or ready.strip() != "ready":
            self.close()
            raise InputError(f"--reward math-verify: its worker did not start "
                             f"({(ready or 'no answer').strip()[:200]})")

    def _read_line(self, seconds: float) -> str | None:
        """The child's next line, or None when none comes within `seconds` (or it exited)."""
        out = self.child.stdout
        if not select.select([out], [], [], seconds)[0]:
            return None
        return out.readline() or None

    def close(self) -> None:
        """Kill the child (the next call starts another)."""
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            for pipe in (self.child.stdin, self.child.stdout):
                pipe.close()
            self.child = None

    def __del__(self):
        self.close()


def _worker() -> None:
    """The child: one JSON [response, reference] a line in, "1", "0" or "error" a line out."""
    import logging
    logging.disable(logging.WARNING)  # "Timeout is disabled": the parent bounds the time
    try:
        from math_verify import parse, verify
    except ImportError as e:
        print(f"import failed: {e}", flush=True)
        return
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            response, gold = json.loads(line)
            ok = verify(parse(f"${gold}$", parsing_timeout=None),
                        parse(response, parsing_timeout=None), timeout_seconds=None)
            print("1" if ok else "0", flush=True)
        except Exception:  # noqa: BLE001 -- any failure of the checker scores 0, counted
            print("error", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
