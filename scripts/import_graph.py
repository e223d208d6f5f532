"""kdn's import graph, read from the source with ``ast``: circles, side violations, decode loops.

    python scripts/import_graph.py            # a report; exit 1 when a rule is broken
    python scripts/import_graph.py --json     # the same as JSON

Every import counts, wherever it is written: module level, inside a function, under
``if TYPE_CHECKING``. Importing ``kdn.a.b`` also runs the package ``kdn.a`` (its
``__init__``), so that is an edge too, except from a module inside ``kdn.a`` (which runs only
once ``kdn.a`` has been imported); the root package ``kdn`` is not counted: its exports are
lazy (PEP 562), so importing a submodule runs nothing of it.

Rules (the two sides drawn in README.md, section "Architecture"):

* no circles (strongly connected components of more than one module);
* the storage side (``kdn.server``, ``kdn.store``) imports nothing of the model side or the
  client (``kdn.engine``, ``kdn.client``, ``kdn.blend``, ``kdn.rag``, ``kdn.prune``,
  ``kdn.hf``, ``kdn.models``, ``kdn.embed``, ``kdn.integrations``);
* one greedy decoding loop in the package: a ``while`` loop whose body takes an ``argmax``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kdn"
GENERATED = ("kdn.v1",)
STORAGE_SIDE = ("kdn.server", "kdn.store")
MODEL_SIDE = ("kdn.engine", "kdn.client", "kdn.blend", "kdn.rag", "kdn.prune", "kdn.hf",
              "kdn.integrations",
              "kdn.models", "kdn.embed")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        if not name.startswith(GENERATED):
            out[name] = path
    return out


def _resolve(known: dict[str, Path], name: str) -> str | None:
    """The known module ``name`` names, or the module that defines it (``pkg.mod.Class``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.AST, here: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = here.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
        return []
    found = [_resolve(known, n) for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")]
    return [f for f in found if f is not None]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> modules it imports (package __init__ edges included, the lazy root excepted)."""
    known = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            for target in _targets(node, name, is_package, known):
                parts = target.split(".")
                for depth in range(2, len(parts) + 1):  # the packages it runs, then itself
                    step = ".".join(parts[:depth])
                    if step in known and step != name and not name.startswith(step + "."):
                        edges[name].add(step)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def side_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() if _within(a, STORAGE_SIDE)
                  for b in targets if _within(b, MODEL_SIDE))


def decode_loops(root: Path = ROOT) -> list[str]:
    """``file:line`` of every ``while`` loop whose body takes an ``argmax`` (greedy decoding)."""
    out = []
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.While) and any(
                    isinstance(n, ast.Attribute) and n.attr == "argmax"
                    for stmt in node.body for n in ast.walk(stmt)):
                out.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(out)


def report(root: Path = ROOT) -> dict[str, object]:
    edges = graph(root)
    return {
        "modules": len(edges),
        "edges": sum(len(t) for t in edges.values()),
        "circles": circles(edges),
        "storage_imports_model_side": [f"{a} -> {b}" for a, b in side_violations(edges)],
        "greedy_loops": decode_loops(root),
    }


def problems(rep: dict[str, object]) -> list[str]:
    out = [f"import circle: {' <-> '.join(c)}" for c in rep["circles"]]  # type: ignore[attr-defined]
    out += [f"storage side imports model side: {v}"
            for v in rep["storage_imports_model_side"]]  # type: ignore[attr-defined]
    loops = rep["greedy_loops"]
    if len(loops) != 1:  # type: ignore[arg-type]
        out.append(f"expected one greedy decoding loop, found {len(loops)}: {loops}")  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root")
    ns = ap.parse_args(argv)
    rep = report(ns.root)
    bad = problems(rep)
    if ns.json:
        print(json.dumps({**rep, "problems": bad}, indent=2))
    else:
        print(f"{rep['modules']} modules, {rep['edges']} import edges")
        print(f"greedy decoding loops: {', '.join(rep['greedy_loops']) or 'none'}")  # type: ignore[arg-type]
        for line in bad:
            print(line)
        print("ok" if not bad else f"{len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
