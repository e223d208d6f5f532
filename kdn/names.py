"""The names callers choose, one rule each: namespaces, tenants, keys (and key prefixes).

Every place that accepts a name checks it here: the server (each request message is checked
field by field before a handler sees it, ``kdn.server.requests``, and again where it builds a
tier key, ``kdn.keys.store_key``), the clients, the CLI, the auth file and the admin import
path. Each rule matches the WHOLE string (``re.fullmatch``): a pattern ending in ``$`` used
with ``re.match`` also accepts a final ``"\\n"``, which made ``"default\\n"`` a namespace of its
own.

* namespace: 1-64 characters, ASCII letters, digits, ``.``, ``_``, ``-``; the first a letter or
  digit. In a request ``""`` (protobuf's unset string) is ``"default"`` where one namespace is
  named and "every namespace" where a listing is filtered (``request_namespace``).
* tenant: 1-32 characters, lowercase ASCII letters, digits, ``_``, ``-``; the first a letter or
  digit. ``""`` in a request filter means every tenant. Where a request names the tenant it
  acts on (``check_scope``), ``UNSCOPED`` (``-``, no tenant's name) is the unscoped key
  space: entries stored while the server had no auth file, which only admins reach.
* key: exactly ``KEY_BYTES`` (32) bytes, any values (a ``kdn.keys`` digest).
* key prefix: at most ``KEY_BYTES`` bytes (a longer one can never match).

Names that pass are stored, listed and looked up exactly as given: nothing is trimmed,
case-folded or normalized.

This module imports no torch: the CLI and the server's request checks use it alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TypeVar

from kdn.errors import InvalidArgument

T = TypeVar("T")

KEY_BYTES = 32
MAX_CALL_KEYS = 16384
"""Names one request may list (``keys`` of a Lookup, Delete, GetMany, RetrieveMany, an admin
keys call: 4M tokens of 256-token blocks): more is refused before the call is served (each
key costs the server about a kilobyte while it is answered), and the client sends a longer
list in calls of this many."""


def call_batches(keys: Sequence[T]) -> Iterator[Sequence[T]]:
    """``keys`` in runs of at most ``MAX_CALL_KEYS``, a call each (one, empty, for none: a
    call of no keys still checks its namespace)."""
    for at in range(0, max(len(keys), 1), MAX_CALL_KEYS):
        yield keys[at : at + MAX_CALL_KEYS]
DEFAULT_NAMESPACE = "default"
NAMESPACE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}"
TENANT_PATTERN = r"[a-z0-9][a-z0-9_\-]{0,31}"
_NAMESPACE = re.compile(NAMESPACE_PATTERN)
_TENANT = re.compile(TENANT_PATTERN)
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")
_STORE_KEY = re.compile(  # kdn.keys.store_key's form, whole: lowercase hex, names that pass
    f"(?:({TENANT_PATTERN}):)?({NAMESPACE_PATTERN})/([0-9a-f]{{{2 * KEY_BYTES}}})".encode())
_SHOWN = 80
"""Characters of a refused name quoted in an error message."""


def _shown(name: object) -> str:
    """``name`` quoted for an error message: escaped (one line) and cut to a readable size."""
    text = ascii(name)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}..."


def check_namespace(namespace: object) -> str:
    """``namespace`` when it is a namespace name (see the module docstring), else
    InvalidArgument."""
    if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
        raise InvalidArgument(
            f"namespace {_shown(namespace)} is malformed: 1-64 characters of ASCII letters, "
            "digits, '.', '_', '-', starting with a letter or digit")
    return namespace


def request_namespace(namespace: str) -> str:
    """The namespace a request names: its field, or ``DEFAULT_NAMESPACE`` when unset ("")."""
    return check_namespace(namespace or DEFAULT_NAMESPACE)


def check_tenant(tenant: object) -> str:
    """``tenant`` when it is a tenant name (see the module docstring), else InvalidArgument."""
    if not isinstance(tenant, str) or _TENANT.fullmatch(tenant) is None:
        raise InvalidArgument(
            f"tenant {_shown(tenant)} is malformed: 1-32 characters of lowercase ASCII letters, "
            "digits, '_', '-', starting with a letter or digit")
    return tenant


UNSCOPED = "-"
"""The tenant a request names for the unscoped key space (``kdn.keys.store_key`` of tenant
""): entries stored while the server had no auth file. Admins only (``kdn.server.auth.
acting_tenant``); an admin's export records it for those entries so that an import puts them
back there."""


def check_scope(tenant: object) -> str:
    """``check_tenant``, or ``UNSCOPED``: the tenant a request acts on."""
    return UNSCOPED if tenant == UNSCOPED else check_tenant(tenant)


def check_key(key: object) -> bytes:
    """``key`` as bytes when it is exactly ``KEY_BYTES`` bytes, else InvalidArgument."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        hint = ""
        if isinstance(key, str):
            hint = " (a key printed as hex: bytes.fromhex(it))"
        elif isinstance(key, int):
            hint = " (a call taking a list of keys given one key?)"
        raise InvalidArgument(f"key must be {KEY_BYTES} bytes (a kdn.keys digest), got "
                              f"{size}{hint}")
    return bytes(key)


def check_key_prefix(prefix: object) -> bytes:
    """``prefix`` as bytes when it is at most ``KEY_BYTES`` bytes, else InvalidArgument."""
    if not isinstance(prefix, (bytes, bytearray)) or len(prefix) > KEY_BYTES:
        size = len(prefix) if isinstance(prefix, (bytes, bytearray)) else type(prefix).__name__
        raise InvalidArgument(f"key prefix must be at most {KEY_BYTES} bytes, got {size}")
    return bytes(prefix)


def parse_hex_key(text: str) -> bytes:
    """A key written as ``2 * KEY_BYTES`` hex digits (nothing else: no spaces, no newline)."""
    if len(text) != 2 * KEY_BYTES or _HEX.fullmatch(text) is None:
        raise InvalidArgument(f"key {_shown(text)} is malformed: {2 * KEY_BYTES} hex digits")
    return bytes.fromhex(text)


def parse_hex_prefix(text: str) -> bytes:
    """A key prefix written as hex digits, two per byte, at most ``KEY_BYTES`` bytes."""
    if len(text) > 2 * KEY_BYTES or _HEX.fullmatch(text) is None:
        raise InvalidArgument(f"key prefix {_shown(text)} is malformed: an even number of hex "
                              f"digits, at most {2 * KEY_BYTES}")
    return bytes.fromhex(text)


def parse_store_key(skey: bytes) -> tuple[str, str, bytes] | None:
    """``kdn.keys.split_store_key``'s answer, or None for a tier key no ``store_key`` made:
    one that something else wrote into a shared tier (a Redis key under kdn's prefix), which
    listings skip rather than fail on (it broke Stats and ``kdn admin ls`` for every caller).
    Here, not in ``kdn.keys``: the store reads it, and ``kdn --help`` loads no numpy.

    Exactly the keys ``store_key`` makes: a tenant and a namespace that pass their checks and
    ``2 * KEY_BYTES`` lowercase hex digits, nothing else (not uppercase hex, which would alias
    the lowercase key, nor hex with spaces that ``bytes.fromhex`` skips)."""
    found = _STORE_KEY.fullmatch(skey)
    if found is None:
        return None
    tenant, namespace, hexkey = found.groups()
    return (tenant or b"").decode(), namespace.decode(), bytes.fromhex(hexkey.decode())
