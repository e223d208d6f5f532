"""Settings files in YAML, read one way everywhere (``kdn serve --config``, its tenants file,
a fleet file): YAML's safe loader, refusing a key named twice in one mapping (where the last
would win silently: a tenant defined twice, its role changed by the second; merge keys, ``<<:
*anchor``, are taken), and every failure
a ConfigError naming the file (unreadable, larger than ``MAX_FILE_BYTES``, not UTF-8, not
YAML, a value its tag can not make such as ``!!int abc``, nested too deeply; for a file of
secrets, a tenants file, what and where without quoting its lines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kdn.checks import shown
from kdn.errors import ConfigError

_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (where the last one
    would win silently: a tenant defined twice, its role changed by the second). Merge keys
    (``<<: *anchor``) are YAML's as ever: the keys a mapping names itself win over those it
    merges, and only those it names itself are checked, before merging (which rewrites the
    mapping's node, in place, once: also where it is merged into another first)."""

    def flatten_mapping(self, node: Any) -> None:
        checked: set[Any] = self.__dict__.setdefault("_checked", set())
        if node not in checked:
            checked.add(node)
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node)
                if isinstance(key, (str, int, float, bool)):  # (a list key: refused by YAML's
                    if key in seen:  # own construct_mapping, "found unhashable key")
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{shown(key)} is defined twice", key_node.start_mark)
                    seen.add(key)
        super().flatten_mapping(node)

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        """A value its tag can not make (``!!int sk-...``, ``!!float fast``, an unquoted date
        that is none, 2024-02-30) is a ConstructorError at its line and column, naming the
        tag, and quoting no value (PyYAML's own error would be that of ``int()`` and the like,
        which quotes it: an API key of a tenants file)."""
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # noqa: BLE001 - any constructor's failure (IndexError of an
            # empty !!int '' too) is the text's, named by its place
            tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
            raise yaml.constructor.ConstructorError(
                None, None, f"a value YAML can not read as {tag} ({type(exc).__name__}; "
                "quote it to make it text)", node.start_mark) from None


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key defined twice in one mapping; every failure is a
    yaml.YAMLError (a value its tag can not make, nesting too deep for the parser too), whose
    message quotes no value (``yaml_problem``)."""
    try:
        return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506  # a SafeLoader
    except RecursionError:
        raise yaml.constructor.ConstructorError(
            None, None, "nested too deeply", None) from None
    except (ValueError, KeyError, AttributeError, TypeError, OverflowError, IndexError) as exc:
        raise yaml.constructor.ConstructorError(
            None, None, f"a value YAML can not read ({type(exc).__name__})", None) from None


MAX_FILE_BYTES = 4 << 20
"""A settings file larger than this is refused unread (tens of thousands of tenants fit; a
device given by mistake, ``--config /dev/zero``, never ends)."""


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong in YAML text and where (line and column), without the lines PyYAML's own
    message quotes: for text that holds secrets (a tenants file's API keys)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return "; ".join(p for p in (exc.context, exc.problem) if p) + where
    if isinstance(exc, yaml.reader.ReaderError):
        return f"a character YAML does not allow at position {exc.position}"
    return "malformed YAML"


def load_yaml_file(path: Path, what: str, *, secret: bool = False) -> Any:
    """The parsed YAML in ``path`` ({} when empty); a ConfigError names it as ``{what} {path}``.
    A pipe or ``/dev/stdin`` is read as a file is, up to ``MAX_FILE_BYTES``. Where ``secret``,
    a YAML error says what and where (``yaml_problem``), quoting none of the file's lines."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(f"{what} {path}: larger than {MAX_FILE_BYTES >> 20} MiB; "
                              "is it a settings file?")
        return parse_yaml(data.decode("utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        problem = yaml_problem(exc) if secret else str(exc)
        raise ConfigError(f"{what} {path}: not valid YAML: {problem}") from None
