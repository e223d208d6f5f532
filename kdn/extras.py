"""The ``model`` extra of pyproject.toml as kdn's code sees it: its packages' import names, the
command that installs it, and the one error for one that is missing.

A plain ``pip install kdn`` is the storage side (no torch); the tensor side (``kdn.KVCache``,
the codec's encode/decode, the engine, the blender, RAG, a ``Client`` read into tensors) needs
the extra. Where kdn's code imports the model side for a caller, it does so inside
``model_side(what)``, which turns the ModuleNotFoundError of one of the extra's packages into
MissingExtra naming ``what`` and ``INSTALL_MODEL``: the package entries (``kdn.model``,
``kdn.engine``, ``kdn.blend``, ``kdn.prune``), the lazy exports (``kdn.lazy``,
``kdn.codec``) and every ``Client`` call. The CLI checks ``missing()`` before loading a model.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterable, Iterator

from kdn.errors import MissingExtra

MODEL = ("torch", "transformers", "constriction", "numba", "gguf", "accelerate")
"""Import names of the packages of the ``model`` extra (a test holds them to pyproject.toml)."""

INSTALL_MODEL = "pip install 'kdn[model]' (in a checkout of kdn: scripts/bootstrap.sh model)"


def missing(modules: Iterable[str] = MODEL) -> list[str]:
    """Those of ``modules`` that are not installed (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def missing_model(exc: ModuleNotFoundError, what: str) -> MissingExtra | None:
    """``exc`` told as MissingExtra when the module it did not find is a package of the model
    extra (or under one); None for any other module, or when ``exc`` already is one."""
    root = (exc.name or "").partition(".")[0]
    if isinstance(exc, MissingExtra) or root not in MODEL:
        return None
    return MissingExtra(f"{what} needs kdn's model extra, of which this install lacks "
                        f"{root!r}; install it with {INSTALL_MODEL}", name=exc.name)


@contextlib.contextmanager
def model_side(what: str) -> Iterator[None]:
    """Run an import of (or a call into) the model side for ``what``: a model extra's package
    not installed raises MissingExtra (``missing_model``), from the ModuleNotFoundError."""
    try:
        yield
    except ModuleNotFoundError as exc:
        told = missing_model(exc, what)
        if told is None:
            raise
        raise told from exc
