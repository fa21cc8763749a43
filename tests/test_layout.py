"""The house's layout, measured from the source: three floors by direction, and what it costs.

Not an article section. Reads every module's imports and definitions with `ast` (nothing is
imported) and checks what the layout promises:

- the two commands on top (train.py, evaluate.py), imported only by tests and tools;
- harness/, the run around the article (set-up, flags, data, metrics, checkpoints, the engine,
  evaluation's library): may import anything below it, and nothing below imports it;
- the article's modules at the top level (grpo, dapo, sampler, verifier, logprobs, update, with
  Step 4's extensions variants and correction beside update.py);
- infra/, how the steps run fast and at scale (KV cache, packed weights, LM head, ranks, errors):
  imports nothing above it.

No import circle, no module importing another's underscore name, no test importing bench/ or ablate/
but the tools' own (tests/test_tools.py). Run as a script it prints the figures the layout issue
tracks (lines of the article, of the rest of the product, of the tools; flags; logged keys; README
lines; arrows back up a floor; circles), for a checkout given as its argument (default: this one),
so two checkouts compare:

    python tests/test_layout.py [ROOT]
"""
from __future__ import annotations

import ast
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
COMMANDS = ("train", "evaluate")
TOOLS = ("bench", "ablate", "real_model", "tests")  # their imports count for private names only
# the tools' own tests: bench's and ablate's sections, the memory model (bench/memory.py), the GPU
# checks; every other test reaches the project only through its product code
TOOL_TESTS = ("tests.test_tools", "tests.test_mechanisms", "tests.test_memory", "tests.test_gpu")
FLOORS = {"commands": 4, "harness": 3, "article": 2, "infra": 1}


def modules(root: str) -> dict[str, str]:
    """Dotted name -> path of every project module: the top level, the folders, the tools."""
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


def floor(module: str) -> int | None:
    """4 the commands, 3 harness/, 2 the article (any other top-level module), 1 infra/; None for
    the tools and the tests."""
    head = module.split(".")[0]
    if head in TOOLS or head.startswith("test_"):
        return None
    if module in COMMANDS:
        return FLOORS["commands"]
    return FLOORS.get(head, FLOORS["article"] if "." not in module else None)


def imports(path: str, names: set[str]):
    """(module imported, names taken from it, at top level?) for each project import in the file;
    `if TYPE_CHECKING:` blocks (never run) and `if __name__ == "__main__":` (a script's entry point,
    not a dependency of the module) are left out."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and (
            getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
            or ast.unparse(node.test) == "__name__ == '__main__'")
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
            if all(s in names for s in subs):          # from infra import kv_cache, packed
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


def lines(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(1 for _ in fh)


def flag_count(root: str) -> int:
    """The flags `python train.py --help` lists (0 where it does not run)."""
    import subprocess
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=root, capture_output=True,
                         text=True, timeout=300).stdout
    return sum(1 for x in out.splitlines() if x.startswith("  --"))


def logged_keys(root: str) -> int:
    """Keys of a step's row in the shipped default run's metrics
    (results/default-dapo-metrics.jsonl,
    the first row with a loss)."""
    path = os.path.join(root, "results", "default-dapo-metrics.jsonl")
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(x) for x in fh if x.strip()]
    return len(next(r for r in rows if "loss" in r))


def measure(root: str = HERE, flags: bool = True) -> dict:
    mods = modules(root)
    names = set(mods)
    code = {m for m in mods if floor(m) is not None}
    graph, private, test_private, up, tool_imports = {}, [], [], [], []
    for m in mods:
        for target, taken, _ in imports(mods[m], names):
            if m in code and target in code:
                graph.setdefault(m, set()).add(target)
                if floor(target) > floor(m) and f"{m} -> {target}" not in up:
                    up.append(f"{m} -> {target}")
            head = m.split(".")[0]
            is_test = head == "tests" or head.startswith("test_")
            if (is_test and m not in TOOL_TESTS
                    and target.split(".")[0] in ("bench", "ablate")):
                tool_imports.append(f"{m} -> {target}")
            (test_private if is_test else private).extend(
                f"{m} <- {target}.{t}" for t in taken if t.startswith("_"))
    article = [m for m in code if floor(m) == FLOORS["article"]]
    rest = [m for m in code if floor(m) != FLOORS["article"]]
    tools = [m for m in mods if m.split(".")[0] in ("bench", "ablate", "real_model")]
    tests = [m for m in mods if m.split(".")[-1].startswith("test_") or m.startswith("tests")]
    readme = os.path.join(root, "README.md")
    return {
        "lines of the article": sum(lines(mods[m]) for m in article),
        "lines of the rest (commands, harness, infra)": sum(lines(mods[m]) for m in rest),
        "product lines (the two)": sum(lines(mods[m]) for m in code),
        "lines of the tools (bench, ablate, real_model)": sum(lines(mods[m]) for m in tools),
        "lines of the tests": sum(lines(mods[m]) for m in tests),
        "train.py flags": flag_count(root) if flags else None,
        "keys a default step logs": logged_keys(root),
        "README lines": lines(readme),
        "top-level .py": len([m for m in mods if "." not in m and m not in TOOLS
                              and not os.path.isdir(os.path.join(root, m))]),
        "arrows back up a floor": up,
        "import circles": cycles(graph),
        "tests importing bench/ or ablate/": tool_imports,
        "private cross-module imports": private,
        "the same, test files sharing test_grpo's helpers": test_private,
        "commands imported by product code": [f"{m} -> {t}" for m in code for t, _, _ in
                                              imports(mods[m], names) if t in COMMANDS],
        "longest article module": max((lines(mods[m]), m) for m in article),
        "longest test file": max((lines(mods[m]), m) for m in tests),
    }


def test_three_floors_each_importing_only_below():
    m = measure(flags=False)                          # (the flags: `python tests/test_layout.py`)
    assert m["arrows back up a floor"] == [], m["arrows back up a floor"]
    assert m["import circles"] == [], m["import circles"]
    assert m["commands imported by product code"] == [], m["commands imported by product code"]
    assert m["tests importing bench/ or ablate/"] == [], m["tests importing bench/ or ablate/"]
    assert m["private cross-module imports"] == [], m["private cross-module imports"]
    assert m["top-level .py"] <= 12, m
    assert m["longest article module"][0] <= 600, m["longest article module"]  # verifier.py: 575


def test_the_measures_see_an_arrow_back_up_a_circle_and_a_private_import(tmp_path):
    # infra/ importing the article is an arrow back up; a module pair that imports each other, one
    # taking the other's underscore name, is a circle and a private import
    (tmp_path / "infra").mkdir()
    (tmp_path / "harness").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "train.py").write_text("import a\nfrom harness import flags\n")
    (tmp_path / "a.py").write_text("import b\nfrom infra import fast\n")
    (tmp_path / "b.py").write_text("from a import _helper\n")
    (tmp_path / "infra" / "fast.py").write_text("import c\n")
    (tmp_path / "c.py").write_text("")
    (tmp_path / "harness" / "flags.py").write_text("x: int = flag(1, 'x')\n")
    (tmp_path / "test_x.py").write_text("import bench\n")
    (tmp_path / "README.md").write_text("one\ntwo\n")
    (tmp_path / "results" / "default-dapo-metrics.jsonl").write_text('{"step": 0}\n{"loss": 1}\n')
    m = measure(str(tmp_path))
    assert m["import circles"] == [["a", "b"]]
    assert m["private cross-module imports"] == ["b <- a._helper"]
    assert m["arrows back up a floor"] == ["infra.fast -> c"]
    assert m["README lines"] == 2 and m["keys a default step logs"] == 1


if __name__ == "__main__":
    for k, v in measure(sys.argv[1] if len(sys.argv) > 1 else HERE).items():
        print(f"| {k} | {v if not isinstance(v, list) else (len(v), v[:4])} |")
