"""kdn's import graph, read from the source with ``ast``: circles, side violations, transformers
outside ``kdn.model``, decode loops, private names used across modules.

    python scripts/import_graph.py            # a report; exit 1 when a rule is broken
    python scripts/import_graph.py --json     # the same as JSON

Every import counts, wherever it is written: module level, inside a function, under
``if TYPE_CHECKING``. Importing ``kdn.a.b`` also runs the package ``kdn.a`` (its
``__init__``), so that is an edge too, except from a module inside ``kdn.a`` (which runs only
once ``kdn.a`` has been imported); the root package ``kdn`` is not counted: its exports are
lazy (PEP 562), so importing a submodule runs nothing of it.

Rules (the two sides drawn in README.md, section "Architecture"):

* no circles (strongly connected components of more than one module);
* the storage side (``kdn.server``, ``kdn.store``, ``kdn.transport``) imports nothing of the
  model side or the client (``kdn.engine``, ``kdn.client``, ``kdn.blend``, ``kdn.rag``,
  ``kdn.prune``, ``kdn.model``, ``kdn.integrations``);
* only ``kdn.model`` and its modules import ``transformers`` (``import transformers``,
  ``from transformers.x import y``, wherever written); the rest of the model side reaches
  transformers through them. Reported as ``module:line``; ``importlib`` calls are not read;
* one greedy decoding loop in the package: a ``while`` loop whose body takes an ``argmax``;
* no module uses a private name (``_name``, not a dunder) of another module: neither an
  attribute of an object of another module's class nor a module's private (``from kdn.x import
  _p``, ``kdn.x._p``, ``mod._p`` where ``mod`` is a kdn module). Checked in the modules of
  kdn's subpackages (``kdn.server.*``, ``kdn.codec.*``, ...); the top-level ``kdn/*.py`` modules
  and the generated ``kdn.v1`` are not checked (``private_checked``), but their privates are
  protected from the checked modules like any other.

The private-name rule is a static approximation (``ast`` knows no types). In module M, for
every attribute ``X._name`` (read, call or write):

* ``X`` is ``self``, ``cls`` or ``super()``: fine (the class's own business);
* ``X`` is a kdn module (``kdn.x``, ``import kdn.x as m`` / ``from kdn import x`` then ``m``):
  a violation unless that module is M;
* ``X`` is rooted at a name M imported from outside kdn (``sys._getframe``, ``os._exit``,
  ``torch._C``): not kdn's business, fine;
* ``X`` is a name M imported from another kdn module (``from kdn.x import Cls``;
  ``Cls._helper()``): a violation;
* any other ``X`` (an object whose class ``ast`` cannot know): fine when M itself defines
  ``_name`` (a function, method or class name; an assignment target, class attributes and
  dataclass fields included; ``self._name = ...`` / ``cls._name = ...``; a ``__slots__`` entry;
  an import alias; not what a ``typing.Protocol`` class declares: it describes another
  module's class) or when ``_name`` is in ``FOREIGN_PRIVATES``, a short list of private names
  that stdlib and third-party objects publish (namedtuple's ``_replace``, transformers'
  ``config._attn_implementation``, ...); otherwise a violation.

So an object of a kdn class of another module whose private ``_name`` M happens to define too
goes unseen, and ``getattr(x, "_name")`` is not read. ``from kdn.x import _p`` (relative
forms too) is a violation unless it imports from M's own module, or ``_p`` is a private
submodule of the package M is in. Reported as ``module:line  X._name``.
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
STORAGE_SIDE = ("kdn.server", "kdn.store", "kdn.transport")
MODEL_SIDE = ("kdn.engine", "kdn.client", "kdn.blend", "kdn.rag", "kdn.prune", "kdn.model",
              "kdn.integrations")
MODEL_LIBRARY = "transformers"  # imported by the modules of MODEL_ADAPTERS and no others
MODEL_ADAPTERS = ("kdn.model",)
# Private names of stdlib / third-party objects that are their public API (objects of
# non-kdn classes are not in the rule's scope, but ``ast`` cannot tell their type).
FOREIGN_PRIVATES = frozenset({
    "_replace", "_asdict", "_fields", "_make", "_field_defaults",  # collections.namedtuple
    "_fields_", "_pack_", "_anonymous_",                            # ctypes.Structure
    "_value_", "_name_", "_missing_",                               # enum
    "_attn_implementation",                                         # transformers' config
    "_version",                                                     # torch.Tensor
})
SELVES = ("self", "cls")


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


def _import_base(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    base = node.module or ""
    if node.level:
        anchor = here.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _targets(node: ast.AST, here: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = _import_base(node, here, is_package)
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


def library_imports(root: Path = ROOT, library: str = MODEL_LIBRARY,
                    allowed: tuple[str, ...] = MODEL_ADAPTERS) -> list[str]:
    """``module:line`` of every import of ``library`` (or a submodule) outside ``allowed``."""
    out: list[tuple[str, int]] = []
    for name, path in modules(root).items():
        if _within(name, allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n == library or n.startswith(library + ".") for n in names):
                out.append((name, node.lineno))
    return [f"{name}:{line}" for name, line in sorted(out)]


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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_checked(name: str, known: dict[str, Path]) -> bool:
    """Whether the private-name rule checks module ``name``: kdn's subpackages, not kdn/*.py."""
    return name.count(".") >= 2 or (name.count(".") == 1 and known[name].name == "__init__.py")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_protocol(node: ast.ClassDef) -> bool:
    return any((isinstance(b, ast.Name) and b.id == "Protocol")
               or (isinstance(b, ast.Attribute) and b.attr == "Protocol") for b in node.bases)


def _walk_skipping_protocols(tree: ast.AST) -> list[ast.AST]:
    """``ast.walk`` less the bodies of ``Protocol`` classes: they describe other classes."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not (isinstance(node, ast.ClassDef) and _is_protocol(node)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _own_names(tree: ast.AST) -> set[str]:
    """The names module ``tree`` defines (see the docstring): its privates are its own."""
    out: set[str] = set()
    for node in _walk_skipping_protocols(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in SELVES):
            out.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            out.update(n.value for n in ast.walk(node.value)
                       if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return out


def _in_kdn(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _private_uses(tree: ast.AST, here: str, is_package: bool,
                  known: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, "X._name")`` for every private of another module that module ``here`` uses."""
    # A name an import binds -> the kdn module it is (or the kdn module it was imported from),
    # or None for anything imported from outside kdn.
    modules_bound: dict[str, str] = {}
    from_kdn: dict[str, str] = {}
    foreign: set[str] = set()
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _in_kdn(a.name):
                    foreign.add((a.asname or a.name).split(".")[0])
                elif a.asname:
                    modules_bound[a.asname] = a.name
                else:
                    modules_bound[PACKAGE] = PACKAGE
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, here, is_package)
            for a in node.names:
                name, full = a.asname or a.name, f"{base}.{a.name}"
                if not _in_kdn(base):
                    foreign.add(name)
                    continue
                if full in known:
                    modules_bound[name] = full
                else:
                    from_kdn[name] = base
                if not _is_private(a.name):
                    continue
                if full in known:  # a private submodule: its package's own
                    if here != base and not here.startswith(f"{base}."):
                        out.append((node.lineno, full))
                elif _resolve(known, base) != here:
                    out.append((node.lineno, full))
    own = _own_names(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        x = node.value
        if (isinstance(x, ast.Name) and x.id in SELVES) or (
                isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id == "super"):
            continue
        use = (node.lineno, f"{ast.unparse(x)}.{node.attr}")
        dotted = _dotted(x)
        root, _, rest = (dotted or "").partition(".")
        if root in foreign:  # sys._getframe, torch._C: not kdn's
            continue
        if root in modules_bound:  # a kdn module, or something of one: kdn.x._p, m.Cls._p
            if _resolve(known, ".".join(filter(None, (modules_bound[root], rest)))) != here:
                out.append(use)
        elif root in from_kdn:  # from kdn.x import Cls; Cls._p
            if _resolve(known, from_kdn[root]) != here:
                out.append(use)
        elif node.attr not in own and node.attr not in FOREIGN_PRIVATES:
            out.append(use)
    return sorted(set(out))


def private_access(root: Path = ROOT) -> list[str]:
    """``module:line  X._name`` for every private of another module used (see the docstring)."""
    known = modules(root)
    out = []
    for name, path in known.items():
        if not private_checked(name, known):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, use in _private_uses(tree, name, path.name == "__init__.py", known):
            out.append(f"{name}:{line}  {use}")
    return out


def report(root: Path = ROOT) -> dict[str, object]:
    edges = graph(root)
    return {
        "modules": len(edges),
        "edges": sum(len(t) for t in edges.values()),
        "circles": circles(edges),
        "storage_imports_model_side": [f"{a} -> {b}" for a, b in side_violations(edges)],
        "transformers_outside_model": library_imports(root),
        "greedy_loops": decode_loops(root),
        "private_access": private_access(root),
    }


def problems(rep: dict[str, object]) -> list[str]:
    out = [f"import circle: {' <-> '.join(c)}" for c in rep["circles"]]  # type: ignore[attr-defined]
    out += [f"storage side imports model side: {v}"
            for v in rep["storage_imports_model_side"]]  # type: ignore[attr-defined]
    out += [f"{MODEL_LIBRARY} imported outside {', '.join(MODEL_ADAPTERS)}: {v}"
            for v in rep["transformers_outside_model"]]  # type: ignore[attr-defined]
    loops = rep["greedy_loops"]
    if len(loops) != 1:  # type: ignore[arg-type]
        out.append(f"expected one greedy decoding loop, found {len(loops)}: {loops}")  # type: ignore[arg-type]
    out += [f"private of another module: {v}"
            for v in rep["private_access"]]  # type: ignore[attr-defined]
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
