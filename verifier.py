"""Rule-based rewards: is the response's final answer equal to the reference answer?

Article section: "Step 2: Reward 计算" (verifier 判分: 1 for a correct answer, 0 otherwise).

    # agreement with hand labels, the errors, the slowest call
    python verifier.py results/verifier_cases.jsonl

`verify(response, answer)` is total and deterministic: it never raises and never evaluates model
text. Its time is linear and small whatever the inputs: each text is searched whole by a few linear
passes (`str.rfind`, one literal regex), and everything after that reads at most MAX_ANSWER
characters. docs/verifier.md compares it with math-verify (`--reward math-verify`).

The final answer (`extract_answer`; the reference is read the same way, and used whole when it has
none):
1. the content of the last `\\boxed{...}` (nested braces; `\\boxed 7`), with the boxes just before
   it that only `,` `;` `and` `or` `$` `\\quad` `\\text{and}` separate, or one word and such a
   separator (`\\boxed{1} papers and \\boxed{2} bins` is `1, 2`); an unclosed last box (a cut-off
   response) is no answer, an empty one is skipped; a "final answer" marker after the last box
   beats it (a correction);
2. else the line after the last `####` (GSM8K);
3. else the text after the last `answer` (any case, markdown bold allowed) followed by `:`, `is` or
   `=`: its first `$...$` / `\\(...\\)` span when only words precede it (with the spans that follow
   joined by `,` `and` `or`; past a verb: "The largest $n$ is 34." is 34), else its line up to the
   end of the sentence, less a trailing remark (", as computed above") and a subject ("The largest
   n is"). A marker followed by prose or a verdict ("the answer is correct") gives way to the one
   before it; one word is an answer (`Answer: odd`).
4. else the whole response when it is one number and nothing else (`5`, `x = 5`, `$-5$.`): a
   longer text is never read so, as the last number of a reasoning trace is not its answer.

Two answers are equal when their canonical forms (`canonical`) are, and, for one value each with a
unit on both sides, their units agree (`5 cm` is not `5 m`, `5 in` is `5 inches`):
- dropped: `$`, `\\$`, `\\left`/`\\right`, spacing (`\\!` `\\,` `\\quad`), `\\text{}`-like wrappers,
  outer `{}`, degrees, percent (50% equals 50, 0.5 does not), a unit word after a number;
  `\\dfrac` `\\tfrac` `\\cfrac` read as `\\frac`, `\\frac34` as `\\frac{3}{4}`, `\\sqrt2` as
  `\\sqrt{2}`, `\\ln 2` and `\\ln(2)` as `\\ln{2}`;
- numbers are exact rationals: integers (leading zeros; thousands `1,234` outside brackets only,
  `1{,}234`, `10,\\!000`, `1\\,234`, `1 234`), decimals (a decimal comma `1000,99` where the
  reference is a fraction), `a/b`, `\\frac{a}{b}`, mixed numbers `3 1/2`, `0.\\overline{3}`, powers
  and `1.5e3` (exact up to MAX_POWER_DIGITS digits, compared as text beyond);
- `x = 4` and `x \\approx 4` are `4` (a left side without digits but subscripts: `V_1:V_2=11:21`
  is `11:21`); the last side of a chain `x = 5+5+1 = 11` when it is a number; `x \\in [1, 2)` is
  `[1, 2)`;
- an inequality in one variable is its interval: `x \\ge 5`, `5 \\leq x`, `[5, \\infty)` are one;
  `-793 < a < 10` is `(-793, 10)`;
- `\\{...\\}` sets, comma (or semicolon) lists, `2 and 3`, `x = 2 or x = -3`, `A \\cup B` and
  `a \\pm b` are unordered sets; tuples and intervals (`(1,234)`, `(0;0;0)`, `[1, 2)`) are
  ordered, brackets kept;
- multiple-choice letters `C`, `(C)`, `\\text{(C)}`, `\\textbf{(C) }12` are `c`;
- `\\varnothing`, `\\{\\}` are `\\emptyset`; `\\mathbb{R}` is `(-\\infty,\\infty)`;
- a rational times the square root of an integer is canonical (integer arithmetic, no algebra):
  `\\sqrt{12}` is `2\\sqrt{3}`, `\\frac{1}{\\sqrt{2}}` is `\\frac{\\sqrt{2}}{2}`, `\\sqrt{4}` is 2;
- anything else is a string without spaces, in lower case, `a/b` as `\\frac{a}{b}`,
  `\\frac{9}{4}\\pi` as `\\frac{9\\pi}{4}`, `x^{2}` as `x^2`, a sum's terms in one order
  (`2x+3` is `3+2x`, `a-b` is not `b-a`). No symbolic algebra: `(x+1)^2` is not `x^2+2x+1`,
  `\\sqrt{2}\\sqrt{3}` not `\\sqrt{6}`.
"""
from __future__ import annotations

import functools
import json
import re
import time
from collections import deque
from fractions import Fraction

MAX_ANSWER = 1000        # an answer longer than this many characters is no answer
MAX_MARKERS = 64         # answer markers tried, from the last one back
MAX_ITEMS = 20           # an answer with more comma-separated parts is compared as one string
MAX_DIGITS = 100         # longer number literals are compared as strings
MAX_POWER_DIGITS = 1000  # a power with more digits than this is compared as a string

# between boxes that form one answer: `,` `;` `and` `or` `$` `\quad` `\text{and}`; after a box, one
# word when a separator follows it (`\boxed{1} papers and \boxed{2} bins`)
_BOX_GAP = re.compile(r"(?:\$?[ \t]*[A-Za-z]{2,15}(?=[ \t]*(?:[,;]|and\b)))?"
                      r"(?:\s|\$|\\[()\[\],;! ]|\\q?quad|~|[,;]|and|or|"
                      r"\\text\{\s*(?:and|or)\s*\}){0,20}")
_MARK = re.compile(r"(?:\*\*|__|\*)?[ \t]{0,3}(?::|=|is\b[ \t]*:?)[ \t*_:]*")
_PROSE = re.compile(r"(?!(?:yes|no|none|true|false)\b)[a-z]{2,}\b(?!\s*[=(])")
_WORD = re.compile(r"\**([A-Za-z]{2,20})\**\.?")
_VERDICTS = {"correct", "incorrect", "right", "wrong", "valid", "invalid", "verified", "confirmed",
             "consistent", "reasonable", "plausible", "above", "below", "boxed", "shown", "clear",
             "obvious", "same", "unchanged", "as", "not", "that", "this", "it", "given", "final"}
_VERB = re.compile(r"\$*\s+(?:is|are|equals|=)\s+")
_MORE_SPAN = re.compile(r"\$*\s*(?:,|and|or)\s*\$+([^$]+)\$")
_FINAL = re.compile(r"[Ff]inal [Aa]nswer|FINAL ANSWER")
_SUBJECT_VERB = re.compile(r"[A-Z][A-Za-z ,]{0,60}?\s(?:is|are|equals)\s+")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_REMARK = re.compile(r"(?:,\s+|\s+\()(?!and\b|or\b)[a-z]{2,}\s")
_WRAPPER = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|"
                      r"boldsymbol|mbox)\s*\{([^{}]*)\}")
_NOISE = [(re.compile(p), r) for p, r in [
    (r"\\\$|\$", " "), (r"\\(?:left|right|displaystyle|big|Big)(?![a-zA-Z])", ""),
    (r"(?<=\d)(?:\{,\}|,\\!\s*)(?=\d)", ""), (r"\{,\}", ","),  # 1{,}234, 10,\!000: thousands
    (r"\\[dtc]frac", r"\\frac"), (r"\\approx|≈", "="),
    (r"\\(ln|log|sin|cos|tan|cot|sec|csc)\s*(?:\(([^()]{1,20})\)|\{([^{}]{1,20})\}|([a-zA-Z0-9]))",
     lambda m: f"\\{m.group(1)}{{{m.group(2) or m.group(3) or m.group(4)}}}"),  # \ln(2): \ln{2}
    (r"\\geqslant|\\ge(?![a-z])|>=|≥", r"\\geq"),
    (r"\\leqslant|\\le(?![a-z])|<=|≤", r"\\leq"), (r"\\gt(?![a-z])", ">"), (r"\\lt(?![a-z])", "<"),
    (r"(?<![\w}])\+\s*\\infty", r"\\infty"), (r"\\mathbb\s*\{?R\}?", r"(-\\infty,\\infty)"),
    (r"\\varnothing|\\emptyset|\\\{\s*\\\}", r"\\emptyset"),
    (r"\^\s*\{?\\circ\}?|\\circ|\\degree|°|\bdegrees?\b", " "), (r"\\?%|\bpercent\b", " "),
    (r"(?<!\\)\\!", ""), (r"(?<!\\)\\[,;: ]|\\q?quad|~", " "),
    (r"\\(frac|sqrt)\s*([0-9a-zA-Z])", r"\\\1{\2}"),
    (r"\\frac\{([^{}]*)\}\s*([0-9a-zA-Z])", r"\\frac{\1}{\2}"),
    (r"(?<![\d.])(\d{1,3})((?: \d{3})+)(?![\d/])",
     lambda m: m.group(1) + m.group(2).replace(" ", "")),
]]
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?!\d)")
_RELATION = re.compile(r"(\\leq|\\geq|<|>)")
_LESS, _FLIP = ("<", "\\leq"), {"<": ">", ">": "<", "\\leq": "\\geq", "\\geq": "\\leq"}
_VARIABLE = re.compile(r"(?!\\infty)(?:\\[a-zA-Z]+|[a-zA-Z])(?:_\{?\w{1,3}\}?)?")
_SUBSCRIPT = re.compile(r"_\{?\w{1,3}\}?")
_DECIMAL_COMMA = re.compile(r"-?\d+,\d+")  # 1000,99 (1,234 was joined by _clean)
_LHS = re.compile(r"[^=\d<>]{1,20}=(?!=)")
_CHOICE = re.compile(r"\(([A-J])\)(?:\s.*)?|([A-J])\)?")
_UNIT = re.compile(r"(.*?[\d}.)])\s+([a-zA-Z]+)(?:\s+[a-zA-Z]+)*\s*(?:\^\{?\d\}?)?")
_ONE_LETTER_UNITS = ("m", "g", "s", "l", "h")
_UNIT_NAMES = dict(kv.split("=") for kv in (
    "in=inch ft=foot feet=foot yd=yard mi=mile m=meter cm=centimeter mm=millimeter km=kilometer "
    "g=gram kg=kilogram lb=pound lbs=pound oz=ounce s=second sec=second min=minute h=hour hr=hour "
    "hrs=hour l=liter ml=milliliter").split())
_COEFFICIENT = re.compile(r"\\frac\{(\d+)\}\{(\d+)\}(\\?[a-z]+(?:\{[^{}]*\})?)")
_SURD = re.compile(r"(?P<sign>-?)(?:(?P<a>\d{0,8})\\sqrt\{(?P<n>\d{1,8})\}"
                   r"|\\frac\{(?P<sign2>-?)(?P<a2>\d{0,8})\\sqrt\{(?P<n2>\d{1,8})\}\}\{(?P<d>\d{1,8})\}"
                   r"|\\frac\{(?P<a3>\d{1,8})\}\{(?P<b>\d{0,8})\\sqrt\{(?P<n3>\d{1,8})\}\})")
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
        later = _final_answer_after(response, box + 6 + got[1])
        if later is not None:  # "\boxed{255} ... recounting, the final answer is 10,455."
            return later
        answers = [got[0]]
        for _ in range(MAX_ITEMS):  # "$\boxed{2}$ and $\boxed{3}$": boxes apart only by and / , / $
            box, end = response.rfind("\\boxed", max(0, box - MAX_ANSWER), box), box
            got = _boxed(response[box + 6:end]) if box >= 0 else None
            if got is None or not _BOX_GAP.fullmatch(response, box + 6 + got[1], end):
                break
            answers[:0] = [] if got[0] in answers else [got[0]]
        return ", ".join(answers)
    return _unboxed(response)


def _final_answer_after(response: str, start: int) -> str | None:
    """The answer after the last "final answer" marker past `start`, if any (a later correction
    beats an earlier box; a plain `Answer:` after a box does not: it is often a new question)."""
    last = deque(_FINAL.finditer(response, start), maxlen=1)  # linear: one search
    mark = last and _MARK.match(response, last[0].end(), last[0].end() + 40)
    return _after_marker(response[mark.end():mark.end() + MAX_ANSWER]) if mark else None


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
    word = _WORD.fullmatch(line)        # `Answer: odd`; not "the answer is correct."
    if word:
        return None if word.group(1).lower() in _VERDICTS else word.group(1)
    if _PROSE.match(line):
        return None
    # one math span: `\$` is a dollar sign; \( \) and \[ \] delimit like $ (one linear regex, no
    # backtracking)
    dollars = (line.replace("\\$", "\x01").replace("\\(", "$").replace("\\)", "$")
               .replace("\\[", "$").replace("\\]", "$"))
    span = re.search(r"(?<!\$)\$+([^$]+)\$", dollars)
    if span and re.fullmatch(r"[A-Za-z ,:]*", dollars[:span.start()]):
        after = dollars[span.end():]
        verb = _VERB.match(after)  # "The largest $n$ is 34.": the answer follows the verb
        if verb:
            return _after_marker(after[verb.end():].replace("\x01", "\\$"))
        spans, pos = [span.group(1)], 0  # "$(11,7)$ or $(7,11)$": one answer of two
        while len(spans) < MAX_ITEMS and (more := _MORE_SPAN.match(after, pos)):
            spans, pos = spans + [more.group(1)], more.end()
        return ", ".join(spans).replace("\x01", "\\$").strip()
    line = _REMARK.split(_SENTENCE_END.split(line, 1)[0], 1)[0]
    verb = _SUBJECT_VERB.match(line)  # "The largest n is 34."
    return (line[verb.end():] if verb else line).strip().strip("*").strip()


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
    return _join_thousands(s)


def _join_thousands(s: str) -> str:
    """1,234 -> 1234 outside brackets; inside them the comma parts a tuple: (1,234) is a point."""
    out, depth, last = [], 0, 0
    for m in _THOUSANDS.finditer(s):  # one pass: the depth is counted between matches
        seg = s[last:m.start()]
        depth += sum(map(seg.count, "([{")) - sum(map(seg.count, ")]}"))
        out += [seg, m.group(0).replace(",", "") if depth <= 0 else m.group(0)]
        last = m.end()
    return "".join(out) + s[last:]


def _closes_at(s: str, i: int) -> int:
    """Index of the bracket that closes the one opened at s[i] (any of ([{ and )]}), or -1."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] in "([{") - (s[j] in ")]}")
        if depth == 0:
            return j
    return -1


def _split_top(s: str) -> list[str]:
    """s split at its commas (and semicolons: `(0;0;0)`) outside brackets ([s] when that gives
    more than MAX_ITEMS parts)."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch in ",;" and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts] if len(parts) <= MAX_ITEMS else [s]


def _drop_lhs(s: str) -> str:
    """`x = 4` -> `4`, `V_1:V_2 = 11:21` -> `11:21` (a left side without digits but subscripts);
    of a chain `x = 5+5+1 = 11`, its last side when that is a number."""
    if (s.count("=") > 1 and not re.search(r"==|[,;]|\band\b|\bor\b", s)
            and _number(s.rsplit("=", 1)[1].strip()) is not None):
        return s.rsplit("=", 1)[1].strip()
    lhs = _LHS.match(_SUBSCRIPT.sub("_", s))
    return s[s.index("=") + 1:].strip() if lhs and s.count("=") == 1 else s


def _relation(s: str) -> str | None:
    """An inequality in one variable as the interval it states, canonical as a tuple is:
    `x \\geq 5` and `5 \\leq x` are `[5,\\infty)`, `-793 < a < 10` is `(-793,10)`; else None."""
    parts = [p.strip() for p in _RELATION.split(s)]  # side, op, side[, op, side]
    if len(parts) not in (3, 5) or not all(parts) or len(s) > 200:
        return None
    var = [i for i in range(0, len(parts), 2) if _VARIABLE.fullmatch(parts[i])]
    if len(parts) == 3 and var in ([0], [2]):       # x >= 5; 5 >= x is x <= 5
        side, op = parts[2 - var[0]], parts[1] if var == [0] else _FLIP[parts[1]]
        lo, hi = (side, "\\infty") if op in (">", "\\geq") else ("-\\infty", side)
        ops = (op, "<") if op in (">", "\\geq") else ("<", op)
    elif len(parts) == 5 and var == [2] and parts[1] in _LESS and parts[3] in _LESS:
        lo, hi, ops = parts[0], parts[4], (parts[1], parts[3])         # lo < x <= hi
    elif len(parts) == 5 and var == [2] and parts[1] not in _LESS and parts[3] not in _LESS:
        lo, hi, ops = parts[4], parts[0], (_FLIP[parts[3]], _FLIP[parts[1]])  # hi > x > lo
    else:
        return None
    return ("(" if ops[0] in "<>" else "[") + _atom(lo)[0] + "," + _atom(hi)[0] + (
        ")" if ops[1] in "<>" else "]")


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
    parts = _split_top(re.sub(r"\s+(?:and|or)\s+|\s*\\cup\s*", ",", s))
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
    interval = _relation(s) if "<" in s or ">" in s or "\\geq" in s or "\\leq" in s else None
    if interval:
        return interval, None
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
    word = _UNIT_NAMES.get(word, word)  # in -> inch, cm -> centimeter
    value = _number(unit.group(1))
    return (_plain(unit.group(1)) if value is None else str(value)), word


def _plain(s: str) -> str:
    """The text compared when an answer is not a number."""
    # "3 4" stays apart
    s = re.sub(r"\s+", "", re.sub(r"(?<=\d)\s+(?=\d)", "\x00", s)).replace("\x00", " ").lower()
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    m = re.fullmatch(r"([^/+\-=,]+)/([^/+\-=,]+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    m = _COEFFICIENT.fullmatch(s)  # \frac{9}{4}\pi is \frac{9\pi}{4}, \frac{1}{2}x is \frac{x}{2}
    if m:
        s = f"\\frac{{{'' if m.group(1) == '1' else m.group(1)}{m.group(3)}}}{{{m.group(2)}}}"
    return _surd(s) or _sorted_terms(s)


def _surd(s: str) -> str | None:
    """A rational times the square root of an integer, canonical: `\\sqrt{12}` is `2\\sqrt{3}`,
    `\\frac{1}{\\sqrt{2}}` is `\\frac{\\sqrt{2}}{2}`, `\\sqrt{4}` is 2 (integer arithmetic: the
    square factors of the radicand, at most 8 digits, come out); else None."""
    m = _SURD.fullmatch(s)
    if not m:
        return None
    g = m.groupdict()
    a, a2, a3, b, d = (int(g[k]) if g[k] else 1 for k in ("a", "a2", "a3", "b", "d"))
    if g["n"]:                                                      # a\sqrt{n}
        q, n = Fraction(a), int(g["n"])
    elif g["n2"] and d:                                             # \frac{a\sqrt{n}}{d}
        q, n = Fraction(a2, d), int(g["n2"])
    elif g["n3"] and b and int(g["n3"]):                            # \frac{a}{b\sqrt{n}}
        q, n = Fraction(a3, b * int(g["n3"])), int(g["n3"])
    else:
        return None
    q = -q if (g["sign"] or g["sign2"]) else q
    k = 2
    while k * k <= n:  # at most 10^4 steps
        while n % (k * k) == 0:
            n, q = n // (k * k), q * k
        k += 1
    return str(q * (n > 0)) if n <= 1 or q == 0 else f"{q}\\sqrt{{{n}}}"


def _sorted_terms(s: str) -> str:
    """A sum in any order of its terms: `2x+3` and `3+2x` are one (the signs kept: `a-b` is not
    `b-a`); a text with a relation, a comma or a sign after `^` `_` `\\` is left as it is."""
    if not re.search(r"(?<=.)[+-]", s) or re.search(r"[=<>,]|[\^_\\][+-]", s):
        return s
    terms, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch in "+-" and depth == 0 and j > start:
            terms.append(s[start:j])
            start = j
    terms.append(s[start:])
    terms = sorted(t if t[0] in "+-" else "+" + t for t in terms)
    return "".join(terms).removeprefix("+")


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
    got = extract_answer(response) or ""
    a, b = _parse(got), _reference(answer)
    if a and b and a[0] != b[0] and "/" in b[0] and _DECIMAL_COMMA.fullmatch(_clean(got)):
        a = _parse(_clean(got).replace(",", "."))  # "1000,99" where the reference is 1000.99
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
