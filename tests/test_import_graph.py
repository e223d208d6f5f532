"""The house's shape (scripts/import_graph.py): no import circles, the storage side apart from
the model side, transformers imported only in kdn.model, one greedy decoding loop, no module
using another's privates. Checked on kdn itself and on small trees that break each rule, so the
checker is known to see what it guards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402


def test_kdn_has_no_circles_no_side_violations_and_one_greedy_loop() -> None:
    rep = import_graph.report(ROOT)
    assert isinstance(rep["modules"], int) and rep["modules"] > 40  # it read the package
    assert rep["private_access"] == []
    assert rep["transformers_outside_model"] == []
    assert import_graph.problems(rep) == []
    loops = rep["greedy_loops"]
    assert isinstance(loops, list) and len(loops) == 1 and loops[0].startswith("kdn/model/hf.py:")


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
                            "kdn/b.py": "from kdn import a\nx = 1\n", "kdn/model/hf.py": LOOP})
    rep = import_graph.report(root)
    assert rep["circles"] == [["kdn.a", "kdn.b"]]
    assert import_graph.problems(rep) == ["import circle: kdn.a <-> kdn.b"]


def test_a_package_init_is_part_of_the_graph(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/hf.py": LOOP,
                            "kdn/p/__init__.py": "from kdn.p.m import y\n",
                            "kdn/p/m.py": "from kdn.q import z\ny = 1\n",
                            "kdn/q.py": "import kdn.p\nz = 1\n"})
    assert import_graph.report(root)["circles"] == [["kdn.p", "kdn.p.m", "kdn.q"]]


def test_storage_side_importing_model_side_and_extra_loops_are_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/hf.py": LOOP,
                            "kdn/server/__init__.py": "",
                            "kdn/server/rpc.py": "def f():\n    from kdn.blend import run\n",
                            "kdn/blend/__init__.py": "from kdn.blend.loop import run\n",
                            "kdn/blend/loop.py": LOOP.replace("greedy", "run")})
    rep = import_graph.report(root)
    assert rep["storage_imports_model_side"] == ["kdn.server.rpc -> kdn.blend"]
    assert rep["greedy_loops"] == ["kdn/blend/loop.py:3", "kdn/model/hf.py:3"]
    assert len(import_graph.problems(rep)) == 2
    assert import_graph.main(["--root", str(root)]) == 1


def test_transformers_outside_kdn_model_is_found_wherever_the_import_hides(
        tmp_path: Path) -> None:
    prune = ("import transformers\n"
             "from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n    from transformers.cache_utils import DynamicCache\n"
             "def f():\n    import transformers.models.llama as llama\n"
             "    from transformers import AutoConfig\n"
             "import transformers_stream_generator\n"   # another library
             "from . import transformers\n"              # a kdn module of that name
             "from .transformers import x\n")
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/__init__.py": "",
                            "kdn/model/hf.py": LOOP + "from transformers import DynamicCache\n",
                            "kdn/model/embed.py": "import transformers\n",
                            "kdn/prune/__init__.py": "", "kdn/prune/apply.py": prune,
                            "kdn/prune/transformers.py": "x = 1\n",
                            "kdn/top.py": "def g():\n    from transformers import AutoModel\n"})
    rep = import_graph.report(root)
    assert rep["transformers_outside_model"] == [
        "kdn.prune.apply:1", "kdn.prune.apply:4", "kdn.prune.apply:6", "kdn.prune.apply:7",
        "kdn.top:2"]
    assert import_graph.problems(rep) == [f"transformers imported outside kdn.model: {v}"
                                          for v in rep["transformers_outside_model"]]
    assert import_graph.main(["--root", str(root)]) == 1


OWNER = """\
import collections

_LIMIT = 4


def _helper():
    return _LIMIT


class Box:
    __slots__ = ("_slot",)

    def __init__(self):
        self._slot = 1

    def _peek(self):
        return self._slot

    @classmethod
    def _make_one(cls):
        return cls._peek


class Pair(collections.namedtuple("Pair", "a b")):
    pass
"""

USER = """\
import sys
import kdn.p.owner
import kdn.p.owner as owner_mod
from kdn.p import owner
from kdn.p.owner import Box, _helper
from . import _private_sub


class Mine:
    def __init__(self):
        self._own = 0

    def _tick(self, other: "Mine") -> int:
        return other._own + self._own + super()._tick() + sys._getframe().f_lineno

    def pair(self, p) -> object:
        return p._replace(a=1)


def peek(box: Box, mine: Mine) -> int:
    mine._tick(mine)
    box._peek()
    return box._slot


_LIMIT = Box._make_one(), kdn.p.owner._LIMIT, owner._LIMIT, owner_mod._helper
"""


def test_privates_of_another_module_are_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/hf.py": LOOP,
                            "kdn/p/__init__.py": "", "kdn/p/_private_sub.py": "",
                            "kdn/p/owner.py": OWNER, "kdn/p/user.py": USER,
                            "kdn/q/__init__.py": "from kdn.p import _private_sub\n",
                            # top-level modules are not checked
                            "kdn/top.py": "from kdn.p.owner import _helper\n"})
    rep = import_graph.report(root)
    assert rep["private_access"] == [
        "kdn.p.user:5  kdn.p.owner._helper",
        "kdn.p.user:22  box._peek",   # Box is kdn.p.owner's; user's own _own, _tick pass
        "kdn.p.user:23  box._slot",
        "kdn.p.user:26  Box._make_one",
        "kdn.p.user:26  kdn.p.owner._LIMIT",  # user's own _LIMIT does not excuse the module's
        "kdn.p.user:26  owner._LIMIT",
        "kdn.p.user:26  owner_mod._helper",
        "kdn.q:1  kdn.p._private_sub",  # a private submodule, outside its package
    ]
    assert import_graph.problems(rep) == [f"private of another module: {v}"
                                          for v in rep["private_access"]]
    assert import_graph.main(["--root", str(root)]) == 1


def test_own_privates_self_and_foreign_objects_are_fine(tmp_path: Path) -> None:
    user = ("import os\nimport numpy as np\n\n\n"
            "class Node:\n    _count = 0\n\n    def __init__(self, nxt: 'Node'):\n"
            "        self._next = nxt\n        type(self)._count += 1\n\n"
            "    def walk(self) -> object:\n        n = self._next._next\n"
            "        return n._walk_cache, Node._count, self.__dict__, os._exit, np._NoValue\n\n"
            "    _walk_cache = None\n\n\n"
            "def f(cfg, t) -> object:\n    return cfg._attn_implementation, t._version\n")
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/hf.py": LOOP,
                            "kdn/p/__init__.py": "", "kdn/p/user.py": user})
    rep = import_graph.report(root)
    assert rep["private_access"] == []
    assert import_graph.problems(rep) == []


def test_a_protocol_does_not_make_anothers_privates_ones_own(tmp_path: Path) -> None:
    user = ("from typing import Protocol\n\n\nclass Servicer(Protocol):\n"
            "    def _put(self) -> None: ...\n\n\n"
            "def call(s: Servicer) -> None:\n    s._put()\n")
    root = _tree(tmp_path, {"kdn/__init__.py": "", "kdn/model/hf.py": LOOP,
                            "kdn/p/__init__.py": "", "kdn/p/user.py": user})
    assert import_graph.report(root)["private_access"] == ["kdn.p.user:9  s._put"]
