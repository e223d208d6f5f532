"""What ``kdn`` commands print: typed JSON (``-o json``) or aligned tables (``-o table``).

JSON keeps types: 64-bit counters are numbers (protobuf's ``MessageToDict`` writes them as
strings), bytes are hex, enums their names, absent messages ``null``. Tables and error lines
escape control characters so that one value stays on one line and a server's text can not
drive the terminal. Nothing here imports grpc or torch.
"""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
"""The exit codes (``kdn.cli.main.EXIT_CODES`` says what each means)."""

PATH_MISTAKES = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
                           errno.ENAMETOOLONG, errno.ELOOP})
"""The errors of a file the user named wrongly (exit 2); another OSError is a failure of the
command (exit 1: the disk filled while it wrote, an I/O error)."""

OUTPUTS = ("table", "json")


def message_dict(msg: Any) -> dict[str, Any]:
    """A protobuf message as a JSON-ready dict of every field (proto field names), typed."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            vf = entry.fields_by_name["value"]
            out[field.name] = {k: _value(vf, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif entry is not None and not msg.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return message_dict(value)
    if field.type == field.TYPE_BYTES:
        return bytes(value).hex()
    if field.type == field.TYPE_ENUM:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else int(value)
    return value  # int (32 or 64 bits), float, bool, str: json writes them as they are


def dump_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def cell(value: Any) -> str:
    """One table cell on one line: text with control characters (a model name from a client,
    an entry stored before names were strict) is shown escaped."""
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = str(value)
    return text if text.isprintable() else ascii(text)[1:-1]


def text_lines(value: str) -> str:
    """Text of several lines (a model's answer) for a terminal: each line as a ``cell``
    (control characters escaped: no escape sequence from a document reaches the terminal),
    the line breaks kept."""
    return "\n".join(cell(line) for line in value.split("\n"))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, *,
          empty: str = "(none)") -> None:
    """``rows`` as left-aligned columns under a header line (``columns``: which, in order)."""
    if not rows:
        print(empty)
        return
    cols = list(columns or rows[0])
    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip())


def fields(pairs: Iterable[tuple[str, Any]]) -> None:
    """``name: value`` lines, names aligned."""
    items = list(pairs)
    width = max((len(k) for k, _ in items), default=0)
    for k, v in items:
        print(f"{k + ':':<{width + 1}} {cell(v)}")


def human_age(seconds: float | None) -> str:
    """``42s``, ``7m``, ``3h``, ``2d``; ``-`` when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def short_key(hex_key: str) -> str:
    """A 64-digit hex key as its first 12 digits: a prefix every key argument takes (as git's
    short hashes; ``-o json`` and ``inspect`` show it whole)."""
    return hex_key[:12]


def human_size(n: int | None) -> str:
    """Bytes for a table: ``512 B``, ``1.5 KiB``, ``7.4 MiB``, ``16 GiB`` (``-o json`` keeps the
    number); ``-`` when absent."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)} B"
    return f"{size:.1f} {unit}".replace(".0 ", " ")


def error(prog: str, message: object, hint: str = "") -> None:
    """One line on stderr: ``prog: message`` and, when given, what to do (``; hint``). The
    message is on one line whatever it held, and control characters in it (a server's error
    text: a terminal's escape sequences) are shown escaped, as in a table cell."""
    text = "".join(c if c.isprintable() else ascii(c)[1:-1]
                   for c in " ".join(str(message).split()))
    print(f"{prog}: {text}" + (f"; {hint}" if hint else ""), file=sys.stderr)
