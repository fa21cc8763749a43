"""The house's layout, measured from the source: the top level is the article, infra/ the rest.

Not an article section. Reads every module's imports and definitions with `ast` (nothing is
imported) and checks what the layout promises: at most 10 top-level `.py`, no import circle, no
module (bench/ and ablate/ too) importing another's underscore name, train.py short with few
project imports; the longest function, article module and test file are reported. Run as a
script it prints the figures as a table, for a checkout given as its argument (default: this one):

    python tests/test_layout.py [ROOT]
"""
from __future__ import annotations

import ast
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
ARTICLE = ("grpo", "dapo", "sampler", "verifier", "logprobs", "update", "train", "evaluate")
TOOLS = ("bench", "ablate", "real_model", "tests")  # their imports count for private names only


def modules(root: str) -> dict[str, str]:
    """Dotted name -> path of every project module: the top level, infra/ (if there), the tools."""
    out = {}
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and (parts[0].startswith(".") or parts[0] in ("base_model", "docs", "results")
                      or "venv" in parts[0] or "__pycache__" in parts):
            continue
        for f in files:
            if f.endswith(".py"):
                name = ".".join([*parts, f[:-3]]).removesuffix(".__init__")
                out[name] = os.path.join(folder, f)
    return out


def imports(path: str, names: set[str]):
    """(module imported, names taken from it, at top level?) for each project import in the file;
    `if TYPE_CHECKING:` blocks (never run) and `if __name__ == "__main__":` (a script's entry point,
    not a dependency of the module) are left out."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and (
            getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
            or ast.unparse(node.test) == "__name__ == '__main__'")   # a script's entry point
            for n in ast.walk(node)}
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in names:
                    yield a.name, [], id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            if all(s in names for s in subs):          # from infra import data, flags
                for s in subs:
                    yield s, [], id(node) in top
            elif node.module in names:
                yield node.module, [a.name for a in node.names], id(node) in top


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def longest_function(path: str) -> tuple[int, str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    return max(((n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), default=(0, ""))


def lines(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(1 for _ in fh)


def measure(root: str = HERE) -> dict:
    mods = modules(root)
    names = set(mods)
    code = {m for m in mods if not m.startswith(TOOLS) and not m.split(".")[-1].startswith("test_")}
    graph, private, test_private = {}, [], []
    for m in mods:
        for target, taken, _ in imports(mods[m], names):
            if m in code and target in code:
                graph.setdefault(m, set()).add(target)
            is_test = m.startswith("tests") or m.split(".")[-1].startswith("test_")
            (test_private if is_test else private).extend(
                f"{m} <- {target}.{t}" for t in taken if t.startswith("_"))
    top = sorted(m for m in mods if "." not in m and m not in TOOLS)
    train = mods["train"]
    train_imports = {t for t, _, _ in imports(train, names)}
    art = [m for m in ARTICLE if m in mods]
    tests = [m for m in mods if m.split(".")[-1].startswith("test_")]
    fn = max(longest_function(mods[m]) + (m,) for m in code)           # (lines, name, module)
    return {
        "top-level .py": len(top),
        "import circles": cycles(graph),
        "private cross-module imports": private,
        "the same, test files sharing test_grpo's helpers": test_private,
        "train.py lines": lines(train),
        "train.py project imports": len(train_imports),
        "longest function": (fn[0], f"{fn[2]}.{fn[1]}"),
        "longest article module": max((lines(mods[m]), m) for m in art),
        "longest test file": max((lines(mods[m]), m) for m in tests),
    }


def test_the_top_level_is_the_article_and_infra_holds_the_rest():
    m = measure()
    assert m["top-level .py"] <= 11, m
    assert m["import circles"] == [], m["import circles"]
    assert m["private cross-module imports"] == [], m["private cross-module imports"]
    assert m["train.py lines"] <= 250 and m["train.py project imports"] <= 10, m


def test_the_measures_see_a_circle_and_a_private_import(tmp_path):
    # a module pair that imports each other, one taking the other's underscore name
    (tmp_path / "train.py").write_text("import a\n")
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("from a import _helper\n")
    (tmp_path / "test_x.py").write_text("")
    m = measure(str(tmp_path))
    assert m["import circles"] == [["a", "b"]]
    assert m["private cross-module imports"] == ["b <- a._helper"]
    assert m["train.py project imports"] == 1 and m["top-level .py"] == 4


if __name__ == "__main__":
    for k, v in measure(sys.argv[1] if len(sys.argv) > 1 else HERE).items():
        print(f"| {k} | {v if not isinstance(v, list) else (len(v), v[:4])} |")
