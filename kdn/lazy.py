"""Package names imported on first use (PEP 562), so importing a package stays cheap.

    __getattr__, __dir__ = lazy_exports(__name__, {"Client": "kdn.client", ...}, __all__)

``kdn``, ``kdn.server`` and ``kdn.rag`` export this way: ``kdn --help`` and the storage server
import none of torch, transformers or the client until a command or a caller needs them. A name
whose module needs a package of the model extra that is not installed raises MissingExtra
(``kdn.extras``), naming it and the command that installs the extra.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kdn.extras import model_side


def lazy_exports(package: str, homes: Mapping[str, str], exported: Sequence[str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``homes`` maps each exported name to
    the module that defines it (a name mapped to its own module path is that module)."""

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        with model_side(f"{package}.{name}"):
            module = importlib.import_module(home)
        value = module if home.rsplit(".", 1)[-1] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exported})

    return getattr_, dir_
