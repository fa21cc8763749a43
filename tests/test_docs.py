"""The docs test: every `module.name`, --flag, test name (of test_grpo.py and tests/) and relative
link in README.md, results/README.md and docs/*.md exists, and the figures the pages quote match the
results tables.

    python -m pytest -q tests/test_docs.py
"""
from __future__ import annotations

import os
import sys

import pytest

from helpers import read_file
from launch import ROOT

# ---------------------------------------------------------------------------------------------
# docs: every `module.name`, --flag, test name and relative link in README.md and docs/ exists
# ---------------------------------------------------------------------------------------------

# Flags of other programs that the pages' commands pass (torchrun's launcher, python -m venv, pip),
# and a flag the pages name to say it is not offered.
FOREIGN_FLAGS = {"--standalone", "--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                 "--master_port", "--system-site-packages", "--lora-dropout", "--no-deps"}


# `train.py`, not train.<name>
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "png", "txt", "pt", "toml", "lock"}


FOREIGN_FILES = {"grpo_config.py"}  # other projects' files the pages name (TRL's)


def _doc_pages() -> dict[str, str]:
    """README.md, results/README.md and docs/*.md, relative path -> text."""
    docs = os.path.join(ROOT, "docs")
    paths = ["README.md", "results/README.md",
             *(f"docs/{n}" for n in sorted(os.listdir(docs)) if n.endswith(".md"))]
    paths = [p for p in paths if os.path.exists(os.path.join(ROOT, p))]
    return {p: read_file(os.path.join(ROOT, p)) for p in paths}


def _at(page: str, text: str, m, what: str | None = None) -> str:
    """'page:line: what' for the match m in the page's text (what: the whole match by default)."""
    return f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0) if what is None else what}"


def _packages() -> list[str]:
    """The folders whose modules the pages name: those run as `python -m NAME` (bench, ablate),
    with a __main__.py, and infra/, a package (`harness.data.load_rows`)."""
    return sorted(n for n in os.listdir(ROOT)
                  if any(os.path.isfile(os.path.join(ROOT, n, f))
                         for f in ("__main__.py", "__init__.py")))


def _test_files() -> list[str]:
    """The test files: the top-level test_*.py (test_grpo.py) and tests/test_*.py, full paths."""
    return [os.path.join(ROOT, folder, n) for folder in ("", "tests")
            for n in sorted(os.listdir(os.path.join(ROOT, folder)))
            if n.startswith("test_") and n.endswith(".py")]


def _cli_actions() -> list:
    """The argparse actions of every command here: each top-level script and each module of a
    package (`python -m bench`, `python -m bench.vs_trl`, `python -m ablate`) that parses flags runs
    as __main__ until its parser's parse_known_args, which hands the parser over instead of
    parsing."""
    import argparse
    import re
    import runpy

    class Parsed(Exception):
        pass

    def capture(parser, *args, **kwargs):
        raise Parsed(parser)

    commands = [(os.path.join(ROOT, n), None) for n in sorted(os.listdir(ROOT))
                if not n.startswith("test_")]
    commands += [(os.path.join(ROOT, pkg, n), f"{pkg}.{n[:-3]}") for pkg in _packages()
                 for n in sorted(os.listdir(os.path.join(ROOT, pkg)))]
    actions, saved = [], (argparse.ArgumentParser.parse_known_args, sys.argv)
    argparse.ArgumentParser.parse_known_args = capture
    try:
        for path, module in commands:
            src = read_file(path) if path.endswith(".py") else ""
            if "__main__" not in src or not re.search(r"parse_\w*args\(", src):
                continue
            sys.argv = [path]
            # a script that returns here parsed nothing: a bug in this test
            with pytest.raises(Parsed) as got:
                if module is None:
                    runpy.run_path(path, run_name="__main__")
                else:                           # as `python -m` does, on a fresh copy of the module
                    imported = sys.modules.pop(module, None)
                    try:
                        runpy.run_module(module, run_name="__main__", alter_sys=True)
                    finally:
                        if imported is not None:
                            sys.modules[module] = imported
            actions += got.value.args[0]._actions
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = saved
    return actions


def _import_longest(names: list[str]):
    """The module named by the longest prefix of names that imports, and the names after it: `grpo`
    for grpo.policy_loss, `bench.vs_trl` for bench.vs_trl.main (a namespace package such as bench
    has its submodules as attributes only once they are imported)."""
    import importlib
    for k in range(len(names), 1, -1):
        dotted = ".".join(names[:k])
        try:
            return importlib.import_module(dotted), names[k:]
        except ModuleNotFoundError as e:
            if not (dotted + ".").startswith(e.name + "."):  # an import inside the module failed
                raise
    return importlib.import_module(names[0]), names[1:]


def _github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks skipped): lower case, punctuation
    dropped (letters of any script, digits, '_' and '-' kept), spaces to '-'."""
    import re
    anchors, fenced = set(), False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#+ (.*)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def _docs_problems(pages: dict[str, str]) -> list[str]:
    """What the pages name that does not exist, one line each: `module.name[.member]` (and keyword
    arguments written as `module.fn(kw=...)`), --flag and its value where the flag has choices,
    test_name, [text](relative link) with its #anchor, a .py file named from the repo root
    (bench/common.py)."""
    import inspect
    import re

    modules = sorted([n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")] + _packages())
    actions = _cli_actions()
    flags = {s for a in actions for s in a.option_strings} | FOREIGN_FLAGS
    choices = {}
    for a in actions:
        for s in a.option_strings if a.choices is not None else []:
            choices.setdefault(s, set()).update(map(str, a.choices))
    test_files = _test_files()  # a test file's own name (tests/test_docs.py) is no test name
    tests = {name for path in test_files
             for name in re.findall(r"^def (test_\w+)\(", read_file(path), re.M)}
    tests |= {os.path.basename(path)[:-3] for path in test_files}
    # grpo.fn, grpo.fn(kw=...), sampler.Rollout.field; --flag, --flag value, --flag a/b
    name_re = r"(?<![\w./-])(" + "|".join(modules) + r")((?:\.\w+)+)(\(([^()`]*)\))?"
    flag_re = r"(?<![\w-])(--[a-z][\w-]*)(?:[ =]([a-z0-9][\w.-]*(?:/[\w.-]+)*))?"
    missing, problems = object(), []
    for page, text in pages.items():
        for m in re.finditer(name_re, text):
            parts = m.group(2).split(".")[1:]
            if parts[0] in FILE_SUFFIXES:
                continue
            obj, parts = _import_longest([m.group(1), *parts])
            for part in parts:
                fields = getattr(obj, "__dataclass_fields__", {})  # a field without a default
                obj = getattr(obj, part, fields.get(part, missing))
                if obj is missing:
                    problems.append(f"{_at(page, text, m)}: no {part}")
                    break
            else:
                params = inspect.signature(obj).parameters if m.group(3) and callable(obj) else {}
                kwargs = re.findall(r"(\w+)=(?!=)", m.group(4) or "")
                if all(p.kind != p.VAR_KEYWORD for p in params.values()):
                    problems += [f"{_at(page, text, m)}: no argument {kw}" for kw in kwargs
                                 if kw not in params]
        for m in re.finditer(flag_re, text):
            if m.group(1) not in flags:
                problems.append(f"{_at(page, text, m)}: no such flag")
            elif m.group(2) and m.group(1) in choices:
                problems += [f"{_at(page, text, m)}: no choice {v}"
                             for v in m.group(2).split("/") if v not in choices[m.group(1)]]
        for m in re.finditer(r"\btest_\w+", text):
            if m.group(0) not in tests:
                problems.append(f"{_at(page, text, m)}: no such test")
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, _, anchor = m.group(1).partition("#")
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            if target and not os.path.exists(path):
                problems.append(f"{_at(page, text, m, m.group(1))}: no such file")
            elif anchor and anchor not in _github_anchors(read_file(path) if target else text):
                problems.append(f"{_at(page, text, m, m.group(1))}: no such heading")
        for m in re.finditer(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b", text):
            path = os.path.join(ROOT, m.group(1))
            if m.group(1) not in FOREIGN_FILES and not os.path.isfile(path):
                problems.append(f"{_at(page, text, m)}: no such file")
    return problems


def test_docs_name_only_functions_flags_tests_and_files_that_exist():
    pages = _doc_pages()
    assert {"README.md", "docs/objectives.md", "docs/metrics.md"} <= set(pages)
    assert _docs_problems(pages) == []


def test_docs_check_finds_a_stale_name_argument_flag_choice_test_link_and_anchor():
    # one right and one wrong of each kind; file names (train.py, curves.png) are not module names
    page = ("""# Quickstart (CPU, nothing downloaded)
`grpo.policy_loss` `grpo.no_such_fn` `sampler.Rollout.lengths` `sampler.Rollout.no_field` """
    """`train.py` `runs/curves.png`
`grpo.token_weights(mask, "token", num_tokens=...)` `grpo.token_weights(mask, num_tokenz=...)`
--algo dapo --algo dapi --no-dynamic-sampling --no-such-flag --nproc_per_node 8 --adv-scale """
    """group/batch/nine
`test_token_weights_by_hand` `test_no_such_test` `test_sigkill_then_resume_logs_each_step_once`
[ok](docs/metrics.md) [gone](docs/gone.md) [here](#quickstart-cpu-nothing-downloaded) """
    """[there](#no-such-heading)
[ok](docs/metrics.md#logged-metrics-outmetricsjsonl) """
    """[no](docs/metrics.md#quickstart-cpu-nothing-downloaded)
`bench.vs_trl.main` `bench.vs_trl.no_such_fn` `bench.gone.x` --init random --init nothing
`bench/common.py` `bench.py` `grpo_config.py` `bench/gone.py` `tests/test_docs.py`
`ablate.rows.extra_row` `ablate.rows.variant_row` --add-row --variant `ablate/habits.py` `ablate.py`
""")
    assert _docs_problems({"README.md": page}) == [
        "README.md:2: grpo.no_such_fn: no no_such_fn",
        "README.md:2: sampler.Rollout.no_field: no no_field",
        "README.md:3: grpo.token_weights(mask, num_tokenz=...): no argument num_tokenz",
        "README.md:8: bench.vs_trl.no_such_fn: no no_such_fn", "README.md:8: bench.gone.x: no gone",
        "README.md:10: ablate.rows.variant_row: no variant_row",
        "README.md:4: --algo dapi: no choice dapi", "README.md:4: --no-such-flag: no such flag",
        "README.md:4: --adv-scale group/batch/nine: no choice nine",
        "README.md:8: --init nothing: no choice nothing", "README.md:10: --variant: no such flag",
        "README.md:5: test_no_such_test: no such test",
        "README.md:6: docs/gone.md: no such file", "README.md:6: #no-such-heading: no such heading",
        "README.md:7: docs/metrics.md#quickstart-cpu-nothing-downloaded: no such heading",
        "README.md:9: bench.py: no such file", "README.md:9: bench/gone.py: no such file",
        "README.md:10: ablate.py: no such file"]


# -- the figures the pages quote from the results tables --
class _ResultsTable:
    """The markdown tables of a results page. read((row, column[, n])) gives the first n (default 1)
    numbers of a cell: the row is the one table line that contains `row`, the column its exact
    header; column(c) the first number of column c in every row that has it."""

    def __init__(self, text: str):
        self.rows, header = [], None
        for line in text.splitlines():
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip()[1:-1].split("|")]
            if header is None:
                header = cells
            elif not set(line) <= set("| -"):
                self.rows.append((line, dict(zip(header, cells))))

    @staticmethod
    def numbers(cell: str) -> list[float]:
        # "0.608 ± 0.019", "+1.47e+03 ± 2.6e+02: beyond", "0.11% / 0.06%", "2,496", "3-10%" (3, 10)
        import re
        return [float(x.replace(",", ""))
                for x in re.findall(r"(?<![\d.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", cell)]

    def read(self, spec) -> list[float]:
        row, column, n = (*spec, 1)[:3]
        found = [cells[column] for line, cells in self.rows if row in line and column in cells]
        if len(found) != 1:
            raise KeyError(f"{len(found)} rows contain {row!r} under {column!r}")
        return self.numbers(found[0])[:n]

    def column(self, column: str) -> list[float]:
        return [self.numbers(cells[column])[0] for _, cells in self.rows if column in cells]


def _span(values):
    return [min(values), max(values)]


_DS, _OS, _TL = "dynamic-sampling.md", "overlong-shaping.md", "token-level-loss.md"


_CH, _CHR, _AB = "clip-higher.md", "clip-higher-random-reward.md", "ablation-mb4.md"


_CHP = "clip-higher-paths.md"


P1, P2, _RR = "README.md", "results/README.md", "README.md"  # the pages; results/README.md's table


ON, HARD, SOFT = "on: dynamic sampling", "hard: truncated = wrong", "filter + soft penalty"


E2, E28, D28 = "eps_high 0.2", "eps_high 0.28", "eps_high 0.28 − eps_high 0.2 (± 2 SE)"


DTL, TRY = "token − sequence (± 2 SE)", "beyond 2 SE?"


DOS = "filter − hard: truncated = wrong (± 2 SE)"


_DEF, DDEF = "default-dapo-vs-grpo.md", "dapo − grpo (± 2 SE)"
K4 = "dapo, 4 mini-batches"  # the default runs' arm with 4 updates per step


ALONE, DALONE = "soft penalty alone", "soft penalty alone − hard: truncated = wrong (± 2 SE)"


AT_END, LOW, HIGH = "held-out acc. at end", "tokens clipped low", "tokens clipped high"


ENT, TRUNC, QUARTER = "entropy (last 5 steps)", "truncated (last 5)", "acc. at 1/4 budget"


HABIT = "habit model, 16"  # the tries table's row of the stuttering habit model, 16 mini-batches


# the ablation's rows (a line of the first table) and differences (of the second)
NAIVE, DAPO_ROW = "| naive GRPO |", "(= DAPO) |"
FIXES = ["| + overlong filtering |", "| + clip-higher |", "| + soft overlong punishment |",
         "| + token-level loss |"]
VS_ABOVE = "(− the row above)"
DVN = "DAPO − naive GRPO"


def _above(row: str) -> str:
    """The difference line of a fix (a FIXES entry or DAPO_ROW) from the row above."""
    return row.strip("| ") + " " + VS_ABOVE if row != DAPO_ROW else "(= DAPO) " + VS_ABOVE


def _responses_ratio(t):
    return [t.read(("responses sampled", ON))[0] / t.read(("responses sampled", "off"))[0]]


def _clipped_high_tries(t):  # the one-seed clip-higher tries that kept the policy working
    return [max(t.read(("shipped, 16 mini", TRY, 2)) + t.read((HABIT, TRY, 2)))]


# (page, what it says with each figure [in brackets], results/ file, how to read the figures: a
# list of cells (row, column[, n]) or a function of the table). A figure must equal the value read,
# rounded to the figure's decimals; the one-seed tries are the table of results/README.md itself.
DOC_FIGURES = [
    # results/README.md's table of the article's claims
    (P2, "[0.61] of the sampled groups at the end; with the fix [15.9] vs [9.6] of 16 groups", _DS,
     [("all wrong, last 5", "off"), ("with a gradient", ON), ("with a gradient", "off")]),
    (P2, "per update no gain (sampled accuracy [0.850] vs [0.839], within noise) at [2.4]x the "
     "responses, and behind at equal responses ([0.721] vs [0.885], beyond noise)", _DS,
     lambda t: t.read(("last 5 updates", ON)) + t.read(("last 5 updates", "off"))
     + _responses_ratio(t) + t.read(("1,024 responses", ON)) + t.read(("1,024 responses", "off"))),
    (P2, "the rows' only fix that lifts the end accuracy at an equal budget ([+0.039] ± [0.009])",
     _AB, [(_above(DAPO_ROW), AT_END, 2)]),
    (P2, "[0.90] of the truncated responses are the start of a right solution", _OS,
     [("on the way", HARD)]),
    (P2, "held-out accuracy ends equal ([0.948] hard, [0.951] filter, [0.951] filter + penalty, "
     "[0.953] penalty alone)", _OS, [("held-out", c) for c in (HARD, "filter", SOFT, ALONE)]),
    (P2, "the filter keeps more responses truncated ([0.010] vs [0.001] in the rows, beyond noise)",
     _AB, [(FIXES[0], TRUNC), (NAIVE, TRUNC)]),
    (P2, "wrong responses end [44.2] vs [35.9] tokens, [0.54] vs [0.30] repeating a line", _TL,
     [("length of wrong", "sequence"), ("length of wrong", "token"), ("repeat a line", "sequence"),
      ("repeat a line", "token")]),
    (P2, "the token-level row's end accuracy is within noise of the row above ([-0.003] ± [0.025]",
     _AB, [(_above(FIXES[3]), AT_END, 2)]),
    (P2, "entropy [0.056] vs [0.055] (clip-higher.md)", _CH, [("entropy", E2), ("entropy", E28)]),
    (P2, "random reward [0.105] vs [0.114]", _CHR, [("entropy", E2), ("entropy", E28)]),
    (P2, "rows [+0.0005] ± [0.0009]", _AB, [(_above(FIXES[1]), ENT, 2)]),
    (P2, "several valid paths per answer ([0.331] nats/token at the start), 12 seeds: [0.266] vs "
     "[0.280] over the last 5 steps ([+0.015] ± [0.049], within noise", _CHP,
     [("entropy at step 1", E2), ("entropy, last 5", E2), ("entropy, last 5", E28),
      ("entropy, last 5", D28, 2)]),
    (P2, "clipped at the upper bound is at most [0.001] in any of them", _CHR,
     lambda t: [max(t.read(("upper bound", E2)) + t.read(("upper bound", E28)))]),
    # results/README.md: dynamic sampling
    (P2, "to [0.61] ± [0.02] over the last 5 steps, as sampled accuracy goes from 0.55 "
     "to [0.84]", _DS, [("all wrong, last 5", "off", 2), ("last 5 updates", "off")]),
    (P2, "trains on [9.6] ± [0.2] groups", _DS, [("with a gradient", "off", 2)]),
    (P2, "with it on [15.9] ± [0.1] (beyond noise)", _DS, [("with a gradient", ON, 2)]),
    (P2, "the last 5 updates [0.839] ± [0.013] off vs [0.850] ± [0.022] on", _DS,
     [("last 5 updates", "off", 2), ("last 5 updates", ON, 2)]),
    (P2, "after 16 updates [0.948] ± [0.016] vs [0.951] ± [0.027], both within noise",
     _DS, [("held-out", "off", 2), ("held-out", ON, 2)]),
    (P2, "It costs [2.4]x the responses ([2,496] ± [222] vs [1,024])", _DS,
     lambda t: _responses_ratio(t) + t.read(("responses sampled", ON, 2))
     + t.read(("responses sampled", "off"))),
    (P2, "(sampled accuracy [0.721] vs [0.885],", _DS,
     [("1,024 responses", ON), ("1,024 responses", "off")]),
    # overlong shaping
    (P2, "and [0.897] ± [0.006] of the truncated ones", _OS, [("on the way", HARD, 2)]),
    (P2, "[0.050] ± [0.024] hard vs [0.094] ± [0.030] with the filter ([+0.044] ± "
     "[0.044], at the edge of 2 SE) and [0.093] ± [0.033] with the filter and the soft", _OS,
     [("truncated responses", c, 2) for c in (HARD, "filter", DOS, SOFT)]),
    (P2, "truncates like hard punishment: [0.047] ± [0.030] ([-0.003] ± [0.044] vs hard, within "
     "noise)", _OS, [("truncated responses", c, 2) for c in (ALONE, DALONE)]),
    (P2, "ends the same in all four ([0.948] ± [0.016] hard, [0.951] ± [0.032], [0.951] ± "
     "[0.027], and [0.953] ± [0.008] with the penalty alone, [+0.005] ± [0.021];", _OS,
     [("held-out", c, 2) for c in (HARD, "filter", SOFT, ALONE, DALONE)]),
    (P2, "alone too ([0.785] ± [0.027], [-0.053] ± [0.035], beyond noise)", _OS,
     [("accuracy of the sampled", c, 2) for c in (ALONE, DALONE)]),
    (P2, "with the filter ([0.803] ± [0.008] vs [0.839] ± [0.013], beyond noise)", _OS,
     [("accuracy of the sampled", "filter", 2), ("accuracy of the sampled", HARD, 2)]),
    # token-level loss
    (P2, "wrong responses stayed [30.1] ± [4.9] vs [29.1] ± [2.5] tokens", _RR,
     [("shipped base model, G 4", "fix off", 2), ("shipped base model, G 4", "fix on", 2)]),
    (P2, "wrong responses are [44.2] ± [1.0] tokens under `sequence` vs [35.9] ± [2.1] "
     "under `token` ([-8.3] ± [2.7], beyond noise), and [0.54] ± [0.10] vs [0.30] ± [0.10] of them "
     "repeat a line ([-0.23] ± [0.16], beyond noise)", _TL,
     [(r, c, 2) for r in ("length of wrong", "repeat a line") for c in ("sequence", "token", DTL)]),
    (P2, "Right responses shorten too ([43.9] vs [37.2], beyond noise)", _TL,
     [("length of right", "sequence"), ("length of right", "token")]),
    (P2, "held-out greedy accuracy ends [0.630] ± [0.166] vs [0.591] ± [0.175]", _TL,
     [("held-out", "sequence", 2), ("held-out", "token", 2)]),
    (P2, "| [44.2] ± [1.0] | [35.9] ± [2.1] | **yes** ([-8.3] ± [2.7]); repeating a "
     "line [0.54] vs [0.30],", _TL,
     [("length of wrong", c, 2) for c in ("sequence", "token", DTL)]
     + [("repeat a line", "sequence"), ("repeat a line", "token")]),
    # clip-higher
    (P2, "entropy is [0.056] ± [0.003] vs [0.055] ± [0.002] nats/token over the last 5 "
     "steps (within noise), [2.40] distinct answers", _CH,
     [("entropy", E2, 2), ("entropy", E28, 2), ("distinct answers", E2)]),
    (P2, "clipped at the upper bound is [0.000] to three decimals under both", _CH,
     lambda t: [max(t.read(("upper bound", E2)) + t.read(("upper bound", E28)))]),
    (P2, "accuracy [0.956] ± [0.005] vs [0.969] ± [0.014] (within noise)", _CH,
     [("held-out", E2, 2), ("held-out", E28, 2)]),
    (P2, "| [0.056] ± [0.003] | [0.055] ± [0.002] | no ([-0.001] ± [0.004]); clipped "
     "high [0.000] |", _CH,
     lambda t: [x for c in (E2, E28, D28) for x in t.read(("entropy", c, 2))]
     + [max(t.read(("upper bound", E2)) + t.read(("upper bound", E28)))]),
    (P2, "both, to [0.105] ± [0.006] vs [0.114] ± [0.006] ([+0.009] ± [0.010], within "
     "noise)", _CHR, [("entropy", c, 2) for c in (E2, E28, D28)]),
    (P2, "| [0.105] ± [0.006] | [0.114] ± [0.006] | no ([+0.009] ± [0.010]) |", _CHR,
     [("entropy", c, 2) for c in (E2, E28, D28)]),
    (P2, "(whose entropy, [0.16] nats/token, does collapse to ~[0.08]) leave the two "
     "bounds within [0.002] nats/token", _RR,
     lambda t: [t.read((HABIT, "measure", 2))[1], *t.read((HABIT, "fix off")),
                max(abs(t.read((r, "fix off"))[0] - t.read((r, "fix on"))[0])
                    for r in ("shipped, 16", HABIT))]),
    (P2, "reached by at most [0.3]% of tokens", _RR, _clipped_high_tries),
    # clip-higher on the paths habit model
    (P2, "It starts at [0.331] ± [0.013] nats/token", _CHP, [("at step 1", E2, 2)]),
    (P2, "entropy over the last 5 steps is [0.266] ± [0.055] under eps_high 0.2 vs [0.280] ± "
     "[0.065] under 0.28 ([+0.015] ± [0.049], within noise)", _CHP,
     [("entropy, last 5", c, 2) for c in (E2, E28, D28)]),
    (P2, "Distinct paths per group of 8 (spaces dropped) [5.4] vs [5.6] and distinct answers [3.7] "
     "vs [3.9], both within noise", _CHP,
     [("distinct paths", E2), ("distinct paths", E28), ("distinct answers", E2),
      ("distinct answers", E28)]),
    (P2, "clipped at the upper bound is [0.004] vs [0.003] (lower under 0.28, beyond noise", _CHP,
     [("upper bound", E2), ("upper bound", E28)]),
    (P2, "at the lower bound [0.018] vs [0.019]; sampled accuracy over the last 5 steps [0.128] vs "
     "[0.146] and held-out greedy accuracy [0.158] vs [0.151]", _CHP,
     [("lower bound", E2), ("lower bound", E28), ("accuracy of the sampled", E2),
      ("accuracy of the sampled", E28), ("held-out", E2), ("held-out", E28)]),
    (P2, "| entropy, last 5 (from [0.331]) | [0.266] ± [0.055] | [0.280] ± [0.065] | no "
     "([+0.015] ± [0.049]); clipped high [0.004] vs [0.003] |", _CHP,
     [("at step 1", E2)] + [("entropy, last 5", c, 2) for c in (E2, E28, D28)]
     + [("upper bound", E2), ("upper bound", E28)]),
    (P2, "under both bounds (accuracy [0], [86]-[93]% truncated)", _RR,
     [("lr 1e-3, T 1.5", TRY, 3)]),
    # the default runs
    (P1, "held-out accuracy [0.975] vs [0.970] (within noise), entropy over the last 5 steps "
     "[0.0126] vs [0.0073] nats/token (beyond noise), with [3.0]x the responses", _DEF,
     lambda t: [t.read(spec)[0] for spec in (("at the end", "dapo"), ("at the end", "grpo"),
                                             ("entropy", "dapo"), ("entropy", "grpo"))]
     + [t.read(("responses sampled", "dapo"))[0] / t.read(("responses sampled", "grpo"))[0]]),
    (P1, "With 4 updates per step [0.0006] of the tokens reach the upper bound, and DAPO ends "
     "lower ([0.947] vs [0.975]) in [1.2]x the time", _DEF,
     lambda t: [t.read(("upper bound", K4))[0], t.read(("at the end", K4))[0],
                t.read(("at the end", "dapo"))[0],
                t.read(("training time", K4))[0] / t.read(("training time", "dapo"))[0]]),
    (P2, "Held-out greedy accuracy ends [0.975] ± [0.008] under DAPO vs [0.970] ± [0.008] under "
     "GRPO ([+0.005] ± [0.013], within noise; [0.958] ± [0.002] vs [0.957] ± [0.008] at step 20), "
     "and DAPO draws [30,208] ± [512] responses for it vs [10,240]", _DEF,
     [("at the end", c, 2) for c in ("dapo", "grpo", DDEF)]
     + [("step 20", c, 2) for c in ("dapo", "grpo")]
     + [("responses sampled", "dapo", 2), ("responses sampled", "grpo")]),
    (P2, "[0.0126] ± [0.0008] vs [0.0073] ± [0.0011] nats/token over the last 5 steps "
     "([+0.0054] ± [0.0015]), and keeps more responses truncated, [0.007] ± [0.001] vs [0.003] ± "
     "[0.002] ([+0.004] ± [0.002]); the length ends the same ([33.4] ± [0.1] vs [33.3] ± [0.2] "
     "tokens)", _DEF,
     [(r, c, 2) for r in ("entropy", "truncated") for c in ("dapo", "grpo", DDEF)]
     + [("length", c, 2) for c in ("dapo", "grpo")]),
    (P2, "the upper-clipped share is [0.0000] under both", _DEF,
     lambda t: [max(t.read(("upper bound", "dapo")) + t.read(("upper bound", "grpo")))]),
    (P2, "[0.0006] ± [0.0001] of the tokens reach the upper bound, entropy is [0.0140] ± [0.0004], "
     "and the run ends lower, [0.947] ± [0.006] (below GRPO by [-0.023] ± [0.012], beyond noise), "
     "in [153] ± [4] s of steps against [124] ± [4] s for one update, with [35,925] ± [391] "
     "responses", _DEF,
     [("upper bound", K4, 2), ("entropy", K4, 2), ("at the end", K4, 2),
      ("at the end", K4 + " − grpo (± 2 SE)", 2), ("training time", K4, 2),
      ("training time", "dapo", 2), ("responses sampled", K4, 2)]),
    # the article's ablation in miniature
    (P2, "it lifts the end accuracy over the row above by [+0.039] ± [0.009] ([0.961] ± [0.007] "
     "for DAPO); every other row is within noise of the row above", _AB,
     [(_above(DAPO_ROW), AT_END, 2), (DAPO_ROW, AT_END, 2)]),
    (P2, "went from -0.014 ± 0.012 (beyond noise, the first run) to [-0.003] ± [0.025] (within "
     "noise)", _AB, [(_above(FIXES[3]), AT_END, 2)]),
    (P2, "DAPO against naive GRPO: [+0.010] ± [0.010] at the end (within noise: naive GRPO ends at "
     "[0.951] ± [0.006]) and [+0.018] ± [0.011] at a quarter of the budget", _AB,
     [(DVN, AT_END, 2), (NAIVE, AT_END, 2), (DVN, QUARTER, 2)]),
    (P2, "[0.0157] nats/token for DAPO vs [0.0072] for naive GRPO over the last 5 steps "
     "([+0.0085] ± [0.0013], beyond noise)", _AB, [(DAPO_ROW, ENT), (NAIVE, ENT), (DVN, ENT, 2)]),
    (P2, "overlong filtering ([+0.0025] ± [0.0008]) and dynamic sampling ([+0.0060] ± [0.0025]), "
     "both beyond noise; clip-higher adds [+0.0005] ± [0.0009]", _AB,
     [(_above(r), ENT, 2) for r in (FIXES[0], DAPO_ROW, FIXES[1])]),
    (P2, "a share of [0.0007]-[0.0009] of the tokens hits the lower bound ([0.0022] with dynamic "
     "sampling) and [0.0002]-[0.0004] the upper one ([0.0007] with dynamic sampling)", _AB,
     lambda t: _span([t.read((r, LOW))[0] for r in (NAIVE, *FIXES)]) + t.read((DAPO_ROW, LOW))
     + _span([t.read((r, HIGH))[0] for r in (NAIVE, *FIXES)]) + t.read((DAPO_ROW, HIGH))),
    (P2, "changes the upper-clipped share by [-0.00008] ± [0.00017] (within noise)", _AB,
     [(_above(FIXES[1]), HIGH, 2)]),
    (P2, "[0.010] ± [0.005] of the samples over the last 5 steps vs [0.001] for naive GRPO", _AB,
     [(FIXES[0], TRUNC, 2), (NAIVE, TRUNC)]),
    (P2, "does not lower it within the budget ([+0.001] ± [0.007])", _AB,
     [(_above(FIXES[2]), TRUNC, 2)]),
    (P2, "it spends the budget in [15] steps (the others take [40]), with 2-3x the clipped share "
     "([+0.00138] ± [0.00022] and [+0.00050] ± [0.00012] over the row above)", _AB,
     lambda t: [*t.read((DAPO_ROW, "steps")), *{t.read((r, "steps"))[0] for r in (NAIVE, *FIXES)},
                *t.read((_above(DAPO_ROW), LOW, 2)), *t.read((_above(DAPO_ROW), HIGH, 2))]),
]


def _figure_problems(pages: dict[str, str], results: dict[str, str]) -> list[str]:
    """Each DOC_FIGURES quote that its page no longer says, or whose figures its results table does
    not give; and results/README.md's copy of the ablation table if it is not ablation-mb4.md's."""
    import itertools
    import re
    problems = []
    for page, quote, name, how in DOC_FIGURES:
        said = quote.replace("[", "").replace("]", "")
        if said not in " ".join(pages[page].split()):
            problems.append(f"{page} no longer says {said!r}")
            continue
        table = _ResultsTable(results[name])
        values = how(table) if callable(how) else [x for spec in how for x in table.read(spec)]
        for figure, value in itertools.zip_longest(re.findall(r"\[([^]]+)\]", quote), values):
            places = len(figure.partition(".")[2]) if figure else 0
            if figure is None or value is None \
                    or abs(round(value, places) - float(figure.replace(",", ""))) > 1e-9:
                problems.append(f"{page}: {said!r}: {figure} but results/{name} gives {value}")
    rows = [[line for line in results[n].splitlines() if line.startswith("| naive GRPO |")]
            for n in ("README.md", _AB)]
    if rows[0] != rows[1]:
        problems.append("results/README.md's ablation table is not results/ablation-mb4.md's")
    return problems


def test_docs_quote_the_figures_of_the_results_tables():
    pages = _doc_pages()
    names = {f[2] for f in DOC_FIGURES}
    results = {name: read_file(os.path.join(ROOT, "results", name)) for name in names}
    assert _figure_problems(pages, results) == []
    # an edited page, an edited table: each is caught
    edited = {**pages, P2: pages[P2].replace("with the fix 15.9 vs", "with the fix 15.8 vs")}
    assert _figure_problems(edited, results) == [
        "results/README.md no longer says '0.61 of the sampled groups at the end; with the fix "
        "15.9 vs 9.6 of 16 groups'"]
    table = results[_DS].replace("| 9.646 ± 0.157 |", "| 9.746 ± 0.157 |")
    assert _figure_problems(pages, {**results, _DS: table}) == [
        "results/README.md: '0.61 of the sampled groups at the end; with the fix 15.9 vs 9.6 of 16 "
        "groups': 9.6 but results/dynamic-sampling.md gives 9.746",
        "results/README.md: 'trains on 9.6 ± 0.2 groups': 9.6 but results/dynamic-sampling.md "
        "gives 9.746"]


# ---------------------------------------------------------------------------------------------
# docs/evaluation.md's table against results/eval-builtin.md, docs/builtin.md's figures against the
# default runs' metrics in results/
# ---------------------------------------------------------------------------------------------

EVAL_DECODING = {"greedy": "greedy", "16 samples, T = 1.0": "top-p 1.0",
                 "16 samples, T = 1.0, top-p 0.7": "top-p 0.7"}


def _eval_problems(page: str, printed: str) -> list[str]:
    """Each row of evaluation.md's before/after table whose figures are not the printed table's (the
    section of eval-builtin.md for its decoding, the row of its model)."""
    import re
    sections = re.split(r"\n(?=256 problems of builtin)", printed)
    problems = []
    for line in page.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or cells[1] not in EVAL_DECODING:
            continue
        model = "builtin" if cells[0].startswith("base") else "runs/dapo/final"
        section = next(s for s in sections if EVAL_DECODING[cells[1]] in s.splitlines()[0]
                       or (cells[1] == "greedy" and "greedy" in s.splitlines()[0]))
        row = next(x for x in section.splitlines() if x.startswith(f"| {model} |"))
        got = [c.strip() for c in row.strip().strip("|").split("|")][1:]
        said = [x for c in cells[2:] for x in re.findall(r"[0-9]+\.[0-9]+", c)]
        # greedy: accuracy, truncated, length; sampled: mean@16 and its std, pass@2.., maj@16, ...
        want = got if cells[1] == "greedy" else got[:2] + got[3:]
        if said != want:
            problems.append(f"{cells[0]}, {cells[1]}: {said} but the printed row is {want}")
    return problems


def test_evaluation_page_quotes_the_printed_tables():
    page = read_file(os.path.join(ROOT, "docs", "evaluation.md"))
    printed = read_file(os.path.join(ROOT, "results", "eval-builtin.md"))
    assert _eval_problems(page, printed) == []
    assert page.count("| DAPO, 40 steps |") == 3
    # a figure edited on the page is caught
    assert _eval_problems(page.replace("| 0.676 |", "| 0.677 |"), printed) == [
        "base (`builtin`), 16 samples, T = 1.0: ['0.478', '0.254', '0.677', '0.842', '0.949', "
        "'0.988', '0.547', '0.140', '27.4'] but the printed row is ['0.478', '0.254', '0.676', "
        "'0.842', '0.949', '0.988', '0.547', '0.140', '27.4']"]


def test_builtin_page_quotes_the_default_runs_metrics():
    import json
    runs = {}
    for algo in ("dapo", "grpo"):
        rows = [json.loads(x) for x in read_file(
            os.path.join(ROOT, "results", f"default-{algo}-metrics.jsonl")).splitlines()]
        runs[algo] = ({r["step"]: r for r in rows if "loss" in r},
                      {r["step"]: r for r in rows if "eval/accuracy" in r})
    (dapo, dapo_eval), (grpo, grpo_eval) = runs["dapo"], runs["grpo"]
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    groups = lambda r: r["groups/all_correct"] + r["groups/all_wrong"]  # noqa: E731
    said = (f"DAPO ends at {dapo_eval[40]['eval/accuracy']:.3f} with {dapo[40]['samples']:,} "
            f"samples and GRPO at\n{grpo_eval[40]['eval/accuracy']:.3f}",
            f"within 20 steps ({dapo_eval[20]['eval/accuracy']:.3f} and "
            f"{grpo_eval[20]['eval/accuracy']:.3f} at step 20)",
            f"grow from {dapo_eval[0]['eval/len_mean']:.0f} to "
            f"{dapo_eval[40]['eval/len_mean']:.0f} tokens",
            f"falls from {pct(dapo[1]['len/truncated_frac'])} (DAPO; GRPO "
            f"{pct(grpo[1]['len/truncated_frac'])}) at step 1 to "
            f"{100 * dapo[40]['len/truncated_frac']:.1f}% at step 40",
            f"DAPO samples {dapo[40]['samples'] / grpo[40]['samples']:.1f}\ntimes",
            " / ".join(pct(groups(dapo[s])) for s in (1, 20, 40)) + " of the groups",
            f"At step 1, {pct(groups(dapo[1]))} of the groups are all right or\nall wrong but only "
            f"{pct(dapo[1]['reward/frac_zero_std'])} have equal rewards")
    page = " ".join(read_file(os.path.join(ROOT, "docs", "builtin.md")).split())
    assert [s for s in said if " ".join(s.split()) not in page] == []
    assert abs(grpo[40]["len/truncated_frac"] - dapo[40]["len/truncated_frac"]) < 5e-4  # "(both)"


def test_walkthrough_quotes_what_python_grpo_py_prints():
    """docs/walkthrough.md's printout lines are lines of worked_example.article_example() as they
    are, or their start where the page cuts a remark with '...'; every section's printout is
    quoted."""
    import worked_example
    printed = worked_example.article_example()
    page = read_file(os.path.join(ROOT, "docs", "walkthrough.md"))
    labels = {line.split(" | ")[0] for line in printed[1:]}
    quoted = [line for line in page.splitlines() if line.split(" | ")[0] in labels
              and line.count(" | ") >= 2]

    def stale(lines):
        return [x for x in lines if not any(
            p == x or (x.endswith(" | ...") and p.startswith(x[:-len("...")])) for p in printed)]

    assert len(quoted) >= 30 and stale(quoted) == []
    assert {x.split(" | ")[0] for x in quoted} == labels
    # an edited figure is caught
    assert stale([quoted[0].replace("0.", "9.", 1)]) == [quoted[0].replace("0.", "9.", 1)]
