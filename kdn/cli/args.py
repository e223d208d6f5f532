"""argparse types for names (the rules of ``kdn.names``): a malformed namespace, tenant or key
on the command line is a usage error (exit 2, the rule in the message), not a server call."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kdn.cli.output import OUTPUTS
from kdn.errors import InvalidArgument
from kdn.names import check_namespace, check_tenant, parse_hex_key, parse_hex_prefix


def name_type(check: Callable[[str], object], what: str, *, empty: bool = False
              ) -> Callable[[str], str]:
    """An argparse ``type`` that checks the argument with ``check`` and returns it unchanged;
    with ``empty`` "" passes too (a filter that means "all")."""

    def parse(text: str) -> str:
        if empty and text == "":
            return text
        try:
            check(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parse.__name__ = what  # argparse names the type in its messages
    return parse


NAMESPACE = name_type(check_namespace, "namespace")
NAMESPACE_FILTER = name_type(check_namespace, "namespace", empty=True)
TENANT_FILTER = name_type(check_tenant, "tenant", empty=True)
HEX_KEY = name_type(parse_hex_key, "key")
HEX_PREFIX = name_type(parse_hex_prefix, "key prefix", empty=True)


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_output_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """``-o json|table`` and ``--json``. On a command group (``suppress`` False) they carry the
    defaults; repeated on its subcommands with ``suppress`` they set only what is given, so
    an option is read wherever it stands."""
    g = p.add_argument_group("output")
    g.add_argument("-o", "--output", choices=OUTPUTS,
                   default=argparse.SUPPRESS if suppress else "table",
                   help="table (default) or json (typed: numbers are numbers)")
    g.add_argument("--json", dest="output", action="store_const", const="json",
                   default=argparse.SUPPRESS, help="same as -o json")


def model_problem(name: str) -> str | None:
    """Why ``name`` can not be loaded by ``kdn.model.models.load_model`` (None when it can): the
    packaged model's name or a local transformers folder, never a hub id (no network)."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):
        return (f"model {name!r} needs torch and transformers, which this install lacks; "
                "pip install 'kdn[model]' (the server alone needs neither)")
    if Path(name).expanduser().is_dir():
        return None
    from kdn.model.models import SMOLLM2_NAME

    if name == SMOLLM2_NAME:
        return None
    return (f"model {name!r} is neither {SMOLLM2_NAME!r} (packaged) nor a local model folder; "
            f"pass --model {SMOLLM2_NAME} or the path of a transformers folder (e.g. one "
            "`huggingface-cli download ID --local-dir DIR` wrote)")
