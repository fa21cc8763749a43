"""Rule-based rewards: is the response's final answer equal to the reference answer?

Article section: "Step 2: Reward 计算" (verifier 判分: 1 for a correct answer, 0 otherwise).

    # agreement with hand labels, the errors, the slowest call
    python verifier.py results/verifier_cases.jsonl

`verify(response, answer)` is total and deterministic: it never raises and never evaluates model
text. Its time is linear and small whatever the inputs: each text is searched whole by at most four
`str.rfind` passes, and everything after that reads at most MAX_ANSWER characters (milliseconds for
a 1 MB response and a 1 MB reference, a fraction of a millisecond for a realistic pair).

The final answer (`extract_answer`; the reference is read the same way, and
used whole when it has none):
1. the content of the last `\\boxed{...}` (nested braces; also `\\boxed 7`, `\\boxed {7}`), with the
   boxes just before it that only `,` `and` `or` `$` separate (`$\\boxed{2}$ and $\\boxed{3}$` is
   `2, 3`); an unclosed last box (a cut-off response) is no answer;
   an empty one (`\\boxed{}`) is skipped;
2. else the line after the last `####` (GSM8K);
3. else the text after the last `answer` (any case, markdown bold allowed) followed by `:`, `is` or
   `=`: `Answer: 34`, `**Answer:** 34`, `the answer is 72`, Minerva's "The final answer is $34$. I
   hope it is correct.". It is the first `$...$` / `\\(...\\)` span of the next non-empty line when
   only words precede it, else that line up to the end of its sentence, less a trailing remark (",
   as computed above", " (since ..."). A marker followed by a lower-case word ("the answer is
   correct") gives way to the one before it.
4. else the whole response when it is one number and nothing else (`5`, `x = 5`, `$-5$.`,
   `\\frac{3}{4}`: `_bare`); a longer text is never read so, as the last number of a reasoning trace
is not its answer. A response with none of these states no answer (reward 0, and `format_reward` 0).

Two answers are equal when their canonical forms (`canonical`) are, and, for one value each with a
unit on both sides, their first unit words agree (`5 cm` is not `5 m`; `5 cm` and `5` are equal):
- dropped: `$`, `\\$`, `\\left`/`\\right`, spacing, `\\displaystyle`, wrappers `\\text{}`
  `\\textbf{}` `\\mathbf{}` `\\mathrm{}` `\\mbox{}`, outer `{}`, degrees (`^\\circ`, `^{\\circ}`,
  `°`, "degrees"), percent (`\\%`, `%`, "percent": 50% equals 50, and 0.5 does not equal 50%), a
  unit word after a number; `\\dfrac`/`\\tfrac` read as `\\frac`, `\\frac34` as `\\frac{3}{4}`,
  `\\sqrt2` as `\\sqrt{2}`, `−` as `-`;
- numbers are exact rationals: integers (leading zeros; `1,234`, `1{,}234`, `1\\,234`, `1 234`: only
  groups of three join, so `3 1/2` is never 31/2), decimals, `a/b` and `\\frac{a}{b}` of signed
  numbers, mixed numbers `3 1/2` and `3\\frac{1}{2}`, repeating decimals with `\\overline`
  (`0.\\overline{3}` is 1/3, `0.333` is not), powers `2^{10}`, `1.5 \\times 10^{3}`,
  `1.5\\cdot 10^3`, `1.5e3` (computed exactly up to MAX_POWER_DIGITS digits, compared as text
  beyond), one number in parentheses;
- `x = 4` is `4` (a left side without digits is dropped); `x \\in [1, 2)` is `[1, 2)`;
- `\\{...\\}` sets, comma lists, `2 and 3`, `x = 2 or x = -3` and `a \\pm b` are unordered sets;
  tuples, points and intervals (`(1, 2)`, `[1, 2)`) are ordered, brackets included;
- multiple-choice letters `C`, `(C)`, `\\text{(C)}`, `\\textbf{(C) }12` are `c`;
- anything else is a string without spaces, in lower case, `a/b` as `\\frac{a}{b}`, `x^{2}` as
  `x^2`; digits apart stay apart (`3 4` is not `34`). No symbolic algebra:
  `\\sqrt{12}` is not `2\\sqrt{3}`.
"""
from __future__ import annotations

import functools
import json
import re
import time
from fractions import Fraction

MAX_ANSWER = 1000        # an answer longer than this many characters is no answer
MAX_MARKERS = 64         # answer markers tried, from the last one back
MAX_ITEMS = 20           # an answer with more comma-separated parts is compared as one string
MAX_DIGITS = 100         # longer number literals are compared as strings
MAX_POWER_DIGITS = 1000  # a power with more digits than this is compared as a string

_BOX_GAP = re.compile(r"(?:\s|\$|\\[()\[\]]|[,;]|and|or){0,20}")
_MARK = re.compile(r"(?:\*\*|__|\*)?[ \t]{0,3}(?::|=|is\b[ \t]*:?)[ \t*_:]*")
_PROSE = re.compile(r"(?!(?:yes|no|none|true|false)\b)[a-z]{2,}\b(?!\s*[=(])")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_REMARK = re.compile(r"(?:,\s+|\s+\()(?!and\b|or\b)[a-z]{2,}\s")
_WRAPPER = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|"
                      r"boldsymbol|mbox)\s*\{([^{}]*)\}")
_NOISE = [(re.compile(p), r) for p, r in [
    (r"\\\$|\$", " "), (r"\\(?:left|right|displaystyle|big|Big)(?![a-zA-Z])", ""), (r"\{,\}", ","),
    (r"\\[dt]frac", r"\\frac"), (r"\^\s*\{?\\circ\}?|\\circ|\\degree|°|\bdegrees?\b", " "),
    (r"\\?%|\bpercent\b", " "),
    (r"(?<!\\)\\[,;:! ]|\\q?quad|~", " "), (r"\\(frac|sqrt)\s*([0-9a-zA-Z])", r"\\\1{\2}"),
    (r"\\frac\{([^{}]*)\}\s*([0-9a-zA-Z])", r"\\frac{\1}{\2}"),
    (r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?!\d)", lambda m: m.group(1) + m.group(2).replace(",", "")),
    (r"(?<![\d.])(\d{1,3})((?: \d{3})+)(?![\d/])",
     lambda m: m.group(1) + m.group(2).replace(" ", "")),
]]
_LHS = re.compile(r"[^=\d<>]{1,20}=(?!=)")
_CHOICE = re.compile(r"\(([A-J])\)(?:\s.*)?|([A-J])\)?")
_UNIT = re.compile(r"(.*?[\d}.)])\s+([a-zA-Z]+)(?:\s+[a-zA-Z]+)*\s*(?:\^\{?\d\}?)?")
_ONE_LETTER_UNITS = ("m", "g", "s", "l", "h")
_MIXED = re.compile(r"([+-]?)(\d+)(?:\s+(\d+)/(\d+)|\s*\\frac\{(\d+)\}\{(\d+)\})")
_POWER = re.compile(r"(\d+(?:\.\d+)?)\^\{?([+-]?\d+)\}?")
_DECIMAL = re.compile(r"(\d*)(?:\.(\d*))?(?:\\overline\{(\d+)\})?"
                      r"(?:e([+-]?\d+)|(?:\\times|\\cdot|\*)10\^\{?([+-]?\d+)\}?)?")


# ---------------------------------------------------------------------------------------------
# finding the final answer
# ---------------------------------------------------------------------------------------------

def extract_answer(response: str) -> str | None:
    """The final answer written in `response`, or None when it states none."""
    if not isinstance(response, str):
        return None
    box = response.rfind("\\boxed")  # 6 characters
    if box >= 0:
        got = _boxed(response[box + 6:box + 6 + MAX_ANSWER])
        # unclosed, or an empty "\boxed{}" ("I will put the answer in \boxed{}")
        if got is None or got[0] == "":
            return None if got is None else _unboxed(response)
        answers = [got[0]]
        for _ in range(MAX_ITEMS):  # "$\boxed{2}$ and $\boxed{3}$": boxes apart only by and / , / $
            box, end = response.rfind("\\boxed", max(0, box - MAX_ANSWER), box), box
            got = _boxed(response[box + 6:end]) if box >= 0 else None
            if got is None or not _BOX_GAP.fullmatch(response, box + 6 + got[1], end):
                break
            answers[:0] = [] if got[0] in answers else [got[0]]
        return ", ".join(answers)
    return _unboxed(response)


def _bare(response: str) -> str | None:
    """The whole response when it is one number and nothing else (`5`, `x = 5`, `$-5$.`,
    `\\frac{3}{4}`), else None.

    A model trained to answer with the number alone states its answer so. A longer text is not read
    this way: the last number of a reasoning trace is not its answer (that needs a marker)."""
    text = response.strip()
    if len(text) > 2 * MAX_DIGITS or "\n" in text:
        return None
    # _clean drops `$`, spaces at the ends, a trailing period
    text = re.sub(r"^[a-zA-Z]\s*=\s*", "", _clean(text))
    return text if _number(text) is not None else None


def _unboxed(response: str) -> str | None:
    """The final answer of a response without a (non-empty) box: after `####`,
    else after an answer marker."""
    hashes = response.rfind("####")
    if hashes >= 0:
        line = response[hashes + 4:hashes + 4 + MAX_ANSWER].lstrip(" \t").split("\n", 1)[0]
        return line.strip() if len(line) < MAX_ANSWER else None
    for end in _markers(response):
        got = _after_marker(response[end:end + MAX_ANSWER])
        if got is not None:
            return got
    return _bare(response)


def _boxed(after: str) -> tuple[str, int] | None:
    """(argument, length read) of a \\boxed, given the text after it:
    `{...}` with braces counted, or a bare token."""
    body = after.lstrip()
    skipped = len(after) - len(body)
    if not body.startswith("{"):
        m = re.match(r"[^\s${}\\]+", body) if skipped else None
        return (m.group(0), skipped + m.end()) if m else None
    depth = 0
    for j, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return body[1:j].strip(), skipped + j + 1
    return None  # unclosed within MAX_ANSWER characters: a cut-off response


def _markers(text: str):
    """Ends of the `answer` + `:` / `is` / `=` markers in text, last first,
    at most MAX_MARKERS of them."""
    found = {w: text.rfind(w) for w in ("nswer", "NSWER")}  # answer, Answer, ANSWER
    for _ in range(MAX_MARKERS):
        word, pos = max(found.items(), key=lambda kv: kv[1])
        if pos < 1:
            return
        # each search starts where the last stopped: linear in all
        found[word] = text.rfind(word, 0, pos)
        m = _MARK.match(text, pos + 5, pos + 45) if text[pos - 1] in "aA" else None
        if m:
            yield m.end()


def _after_marker(rest: str) -> str | None:
    """The answer in the text after a marker, or None when it is prose ("the answer is correct")."""
    line = rest.lstrip().split("\n", 1)[0].strip()
    if _PROSE.match(line):
        return None
    # one math span: `\$` is a dollar sign; \( \) and \[ \] delimit like $ (one linear regex, no
    # backtracking)
    dollars = (line.replace("\\$", "\x01").replace("\\(", "$").replace("\\)", "$")
               .replace("\\[", "$").replace("\\]", "$"))
    span = re.search(r"(?<!\$)\$+([^$]+)\$", dollars)
    if span and re.fullmatch(r"[A-Za-z ,:]*", dollars[:span.start()]):
        return span.group(1).replace("\x01", "\\$").strip()
    line = _REMARK.split(_SENTENCE_END.split(line, 1)[0], 1)[0]
    return line.strip().strip("*").strip()


# ---------------------------------------------------------------------------------------------
# canonical forms
# ---------------------------------------------------------------------------------------------

def _clean(s: str) -> str:
    """s without LaTeX noise (spaces kept: they separate units and mixed numbers)."""
    s = s[:MAX_ANSWER].replace("−", "-").replace("×", "\\times").replace("·", "\\cdot")
    s = s.replace("π", "\\pi").replace("∞", "\\infty")
    for _ in range(3):  # nested wrappers: \textbf{\text{(C)}}
        s = _WRAPPER.sub(r" \1 ", s)
    for pattern, repl in _NOISE:
        s = pattern.sub(repl, s)
    s = " ".join(s.split()).rstrip(".").strip()
    for _ in range(3):  # outer braces: {{12}}
        if len(s) > 1 and s[0] + s[-1] == "{}" and _closes_at(s, 0) == len(s) - 1:
            s = s[1:-1].strip()
    return s


def _closes_at(s: str, i: int) -> int:
    """Index of the bracket that closes the one opened at s[i] (any of ([{ and )]}), or -1."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] in "([{") - (s[j] in ")]}")
        if depth == 0:
            return j
    return -1


def _split_top(s: str) -> list[str]:
    """s split at its commas outside brackets ([s] when that gives more than MAX_ITEMS parts)."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts] if len(parts) <= MAX_ITEMS else [s]


def _drop_lhs(s: str) -> str:
    lhs = _LHS.match(s)
    return s[lhs.end():].strip() if lhs and s.count("=") == 1 else s


def _parse(answer: str) -> tuple[str, str | None] | None:
    """(canonical text, unit or None) of an answer; sets are sorted,
    tuples keep order and brackets."""
    if not isinstance(answer, str) or len(answer) > MAX_ANSWER:
        return None
    s = _drop_lhs(re.sub(r"^[a-zA-Z]\s*\\in\s*", "", _clean(answer)))
    if not s:
        return None
    if s.startswith("\\{") and s.endswith("\\}") and _closes_at(s, 1) == len(s) - 1:
        return "{" + ",".join(sorted({_atom(p)[0] for p in _split_top(s[2:-2]) if p})) + "}", None
    if (s[:1] in "([" and s[-1:] in ")]" and _closes_at(s, 0) == len(s) - 1
            and len(_split_top(s[1:-1])) > 1):
        return s[0] + ",".join(_atom(p)[0] for p in _split_top(s[1:-1])) + s[-1], None
    parts = _split_top(re.sub(r"\s+(?:and|or)\s+", ",", s))
    if len(parts) == 1 and s.count("\\pm") == 1:
        before, after = s.split("\\pm")
        parts = ([before + "+" + after, before + "-" + after] if before.strip()
                 else [after, "-" + after])
    if len(parts) > 1:
        return "{" + ",".join(sorted({_atom(p)[0] for p in parts if p})) + "}", None
    return _atom(s)


def _atom(s: str) -> tuple[str, str | None]:
    """(canonical text, unit or None) of one answer."""
    s = _drop_lhs(s)
    choice = _CHOICE.fullmatch(s)
    if choice:
        return (choice.group(1) or choice.group(2)).lower(), None
    value = _number(s)
    if value is not None:
        return str(value), None
    unit = _UNIT.fullmatch(s) if len(s) <= 100 else None
    if unit is None or (len(unit.group(2)) == 1 and unit.group(2) not in _ONE_LETTER_UNITS):
        return _plain(s), None
    word = unit.group(2).lower()  # one spelling: inches -> inch, dollars -> dollar
    word = (word[:-2] if word.endswith(("ches", "shes", "xes"))
            else word[:-1] if word.endswith("s") and len(word) > 3 else word)
    value = _number(unit.group(1))
    return (_plain(unit.group(1)) if value is None else str(value)), word


def _plain(s: str) -> str:
    """The text compared when an answer is not a number."""
    # "3 4" stays apart
    s = re.sub(r"\s+", "", re.sub(r"(?<=\d)\s+(?=\d)", "\x00", s)).replace("\x00", " ").lower()
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    m = re.fullmatch(r"([^/+\-=,]+)/([^/+\-=,]+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def parse_number(answer: str) -> Fraction | None:
    """An exact rational from a numeric answer string, or None when it is not one number."""
    return _number(_clean(answer)) if isinstance(answer, str) else None


def _number(s: str) -> Fraction | None:
    """parse_number of a cleaned string (where spaces still separate mixed numbers)."""
    if len(s) > 2 * MAX_DIGITS:
        return None
    mixed = _MIXED.fullmatch(s)
    if mixed:  # 3 1/2, 3\frac{1}{2}
        num, den = int(mixed.group(3) or mixed.group(5)), int(mixed.group(4) or mixed.group(6))
        if not 0 < num < den:
            return None
        whole = int(mixed.group(2)) + Fraction(num, den)
        return -whole if mixed.group(1) == "-" else whole
    return None if re.search(r"\d\s+\d", s) else _value(re.sub(r"\s+", "", s))


def _value(s: str) -> Fraction | None:
    """A signed number, (number), \\frac{number}{number} or number/number, recursively."""
    sign = 1
    while s[:1] in ("+", "-"):
        sign, s = (-sign if s[0] == "-" else sign), s[1:]
    if s.startswith("(") and _closes_at(s, 0) == len(s) - 1:
        parts = [_value(s[1:-1]), Fraction(1)]
    elif s.startswith("\\frac{"):
        mid = _closes_at(s, 5)
        if mid < 0 or s[mid + 1:mid + 2] != "{" or _closes_at(s, mid + 1) != len(s) - 1:
            return None
        parts = [_value(s[6:mid]), _value(s[mid + 2:-1])]
    elif s.count("/") == 1:
        parts = [_value(p) for p in s.split("/")]
    else:
        parts = [_literal(s), Fraction(1)]
    return None if None in parts or parts[1] == 0 else sign * parts[0] / parts[1]


def _literal(s: str) -> Fraction | None:
    """12, 12.5, .5, 0.1\\overline{6}, 1.5e3, 1.5\\times10^{3}, 2^{10}: exact, with caps on size."""
    power = _POWER.fullmatch(s)
    if power:
        return _power(Fraction(power.group(1)), int(power.group(2)))
    m = _DECIMAL.fullmatch(s)
    if not m or not (m.group(1) or m.group(2)) or len(s) > MAX_DIGITS:
        return None
    whole, frac, repeat, exp = (m.group(1) or "0", m.group(2) or "", m.group(3),
                                m.group(4) or m.group(5))
    value = Fraction(int(whole + frac), 10 ** len(frac))
    if repeat:  # 0.1\overline{6} = 0.1 + 6 / (10 * 9)
        value += Fraction(int(repeat), 10 ** len(frac) * (10 ** len(repeat) - 1))
    ten = Fraction(1) if exp is None else _power(Fraction(10), int(exp))
    return None if ten is None else value * ten


def _power(base: Fraction, exp: int) -> Fraction | None:
    size = max(len(str(base.numerator)), len(str(base.denominator)))
    return None if abs(exp) * size > MAX_POWER_DIGITS or (base == 0 and exp < 0) else base ** exp


def canonical(answer: str) -> str | None:
    """The canonical text of an (extracted) answer: equal answers written
    differently give equal texts."""
    parsed = _parse(answer)
    return None if parsed is None else parsed[0]


def canonical_answer(response: str) -> str | None:
    """The canonical text of the final answer of `response`,
    or None (majority voting counts these)."""
    answer = extract_answer(response)
    return None if answer is None else canonical(answer)


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------

def format_reward(response: str) -> float:
    """1.0 if the response states a final answer in one of the recognised forms,
    else 0.0 (optional shaping)."""
    return float(extract_answer(response) not in (None, ""))


@functools.lru_cache(maxsize=1 << 14)
def _reference(answer: str) -> tuple[str, str | None] | None:
    """_parse of a reference answer, read through its own marker where it has one (GSM8K's "...####
    72"). Cached: the G responses to a prompt share it, and it was two thirds of verify's time."""
    want = extract_answer(answer)
    return _parse(answer if want is None else want)


def verify(response: str, answer: str) -> float:
    """1.0 if the final answer of `response` equals `answer`, else 0.0."""
    if not isinstance(response, str) or not isinstance(answer, str):
        return 0.0
    a, b = _parse(extract_answer(response) or ""), _reference(answer)
    if a is None or b is None or a[0] != b[0]:
        return 0.0
    return float(not (a[1] and b[1]) or a[1] == b[1])  # a unit on both sides must agree


def agreement(cases: list[dict], fn=verify) -> dict:
    """How often fn agrees with hand labels {response, reference, correct};
    its errors and slowest call."""
    report = {"n": len(cases), "agree": 0, "false_positives": [],
              "false_negatives": [], "max_ms": 0.0}
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        got = fn(case["response"], case["reference"]) == 1.0
        report["max_ms"] = max(report["max_ms"], 1000 * (time.perf_counter() - t0))
        report["agree"] += got == case["correct"]
        if got != case["correct"]:
            report["false_positives" if got else "false_negatives"].append(i)
    return report


if __name__ == "__main__":
    import argparse
    cli = argparse.ArgumentParser(prog="python verifier.py",
                                  description="verify() against a labelled case file")
    cli.add_argument("cases", help="JSONL rows of response, reference, expected (e.g. "
                     "results/verifier_cases.jsonl)")
    with open(cli.parse_args().cases, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    r = agreement(rows)
    print(f"{r['n']} cases: agreement {r['agree'] / r['n']:.1%}, false positives "
          f"{len(r['false_positives'])}, "
          f"false negatives {len(r['false_negatives'])}, slowest call {r['max_ms']:.2f} ms")
    for kind in ("false_positives", "false_negatives"):
        for i in r[kind]:
            print(f"  {kind[:-1].replace('_', ' ')}, line {i + 1} ({rows[i].get('note', '')}): "
                  f"{extract_answer(rows[i]['response'])!r} vs {rows[i]['reference'][-60:]!r}")
