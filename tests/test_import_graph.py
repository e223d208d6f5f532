"""The house's shape (scripts/import_graph.py): no import circles, the storage side apart from
the model side, one greedy decoding loop. Checked on kdn itself and on small trees that break
each rule, so the checker is known to see what it guards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402


def test_kdn_has_no_circles_no_side_violations_and_one_greedy_loop() -> None:
    rep = import_graph.report(ROOT)
    assert rep["modules"] > 40  # it read the package
    assert import_graph.problems(rep) == []
    loops = rep["greedy_loops"]
    assert isinstance(loops, list) and len(loops) == 1 and loops[0].startswith("kdn/hf.py:")


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


LOOP = "def greedy(d):\n    out = [0]\n    while len(out) < 3:\n        out.append(d().argmax())\n"


@pytest.mark.parametrize("hidden", [
    "from kdn.b import x\n",                                    # module level
    "def f():\n    from kdn.b import x\n",                       # inside a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kdn.b import x\n",
])
def test_a_circle_is_found_wherever_the_import_hides(tmp_path: Path, hidden: str) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/a.py": hidden,
                            "kdn/b.py": "from kdn import a\nx = 1\n", "kdn/hf.py": LOOP})
    rep = import_graph.report(root)
    assert rep["circles"] == [["kdn.a", "kdn.b"]]
    assert import_graph.problems(rep) == ["import circle: kdn.a <-> kdn.b"]


def test_a_package_init_is_part_of_the_graph(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/hf.py": LOOP,
                            "kdn/p/__init__.py": "from kdn.p.m import y\n",
                            "kdn/p/m.py": "from kdn.q import z\ny = 1\n",
                            "kdn/q.py": "import kdn.p\nz = 1\n"})
    assert import_graph.report(root)["circles"] == [["kdn.p", "kdn.p.m", "kdn.q"]]


def test_storage_side_importing_model_side_and_extra_loops_are_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/hf.py": LOOP,
                            "kdn/server/__init__.py": "",
                            "kdn/server/rpc.py": "def f():\n    from kdn.blend import run\n",
                            "kdn/blend/__init__.py": "from kdn.blend.loop import run\n",
                            "kdn/blend/loop.py": LOOP.replace("greedy", "run")})
    rep = import_graph.report(root)
    assert rep["storage_imports_model_side"] == ["kdn.server.rpc -> kdn.blend"]
    assert rep["greedy_loops"] == ["kdn/blend/loop.py:3", "kdn/hf.py:3"]
    assert len(import_graph.problems(rep)) == 2
    assert import_graph.main(["--root", str(root)]) == 1
