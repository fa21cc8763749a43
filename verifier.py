"""Rule-based rewards: is the response's final answer equal to the reference answer?

Article section: "Step 2: Reward 计算" (verifier 判分: 1 for a correct answer, 0 otherwise).

`verify(response, answer)` is total and deterministic: it never raises, never evaluates model text as
code, and costs bounded time on any input (the response is cut to its last MAX_CHARS characters and a
number longer than MAX_DIGITS digits is compared as a string, never converted).

The final answer of a response is, in order of preference: the content of the last `\\boxed{...}`
(nested braces allowed), else the text after the last `####` (GSM8K), else the text after the last
`Answer:`. Two answers are equal if both parse as the same exact rational number (integers with
thousands separators, decimals, `a/b`, `\\frac{a}{b}`, `\\dfrac{a}{b}`, signs, a trailing `.0`,
surrounding `$`), else if their normalised strings are equal.
"""
from __future__ import annotations

import importlib
import re
from fractions import Fraction

from data import InputError

MAX_CHARS = 4096   # only the tail of a response is searched for its final answer
MAX_DIGITS = 64    # longer numbers are compared as strings, so no huge integer is ever built

_NUM = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_TAIL = re.compile(r"(####|Answer:)")


def extract_answer(response: str) -> str | None:
    """The final answer written in `response`, or None when it states none."""
    text = response[-MAX_CHARS:]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marks = list(_TAIL.finditer(text))
    for mark in ("####", "Answer:"):
        hits = [m for m in marks if m.group(1) == mark]
        if hits:
            rest = text[hits[-1].end():].strip()
            return rest.splitlines()[0].strip() if rest else ""
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, matching nested braces by counting (linear time)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: no answer


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", "", s).lower()


def parse_number(s: str) -> Fraction | None:
    """An exact rational from a numeric answer string, or None when it is not one number."""
    s = _normalise(s)
    m = _FRAC.fullmatch(s) or re.fullmatch(r"([^/]+)/([^/]+)", s)
    if m:
        num, den = _plain_number(m.group(1)), _plain_number(m.group(2))
        if num is None or den is None or den == 0:
            return None
        return num / den
    if s.startswith("-") and _FRAC.fullmatch(s[1:]):
        inner = parse_number(s[1:])
        return -inner if inner is not None else None
    return _plain_number(s)


def _plain_number(s: str) -> Fraction | None:
    s = s.strip()
    if not s or len(s) > MAX_DIGITS + 8 or _NUM.fullmatch(s) is None or not any(c.isdigit() for c in s):
        return None
    return Fraction(s.replace(",", ""))


def format_reward(response: str) -> float:
    """1.0 if the response states a final answer in one of the recognised forms, else 0.0 (optional shaping)."""
    return float(isinstance(response, str) and extract_answer(response) not in (None, ""))


def verify(response: str, answer: str) -> float:
    """1.0 if the final answer of `response` equals `answer`, else 0.0."""
    if not isinstance(response, str) or not isinstance(answer, str):
        return 0.0
    got = extract_answer(response)
    if got is None:
        return 0.0
    want = extract_answer(answer)  # a reference like GSM8K's "...#### 72" carries its own marker
    want = answer if want is None else want
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return float(a == b)
    return float(_normalise(got) == _normalise(want) and _normalise(got) != "")


def load_reward(spec: str):
    """verify, or the function named by 'module:function' (imported, never evaluated)."""
    if spec == "verifier":
        return verify
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InputError(f"--reward {spec}: expected module:function ({e})") from None
    if not callable(fn):
        raise InputError(f"--reward {spec}: {name} is not callable")
    return fn
