"""Checks of an engine integration's settings, shared by SGLang's backend (its ``"kdn"``
extra-config object, ``kdn.integrations.sglang``) and vLLM's connector (its
``kv_connector_extra_config``, ``kdn.integrations.vllm_meta``). Their values come from JSON
on the engine's command line, so each field's type is checked as well as its range (a string
``"false"`` is not false), and every refusal is a ``ConfigError`` naming the field. Imports no
engine.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from kdn.checks import MAX_BYTES, shown
from kdn.client.client import TLSOptions
from kdn.errors import ConfigError


def check_number(name: str, value: object, *, whole: bool, positive: bool,
                 high: float = MAX_BYTES) -> None:
    """A ConfigError naming ``name`` unless ``value`` is a finite number (an int, not a bool,
    when ``whole``), > 0 when ``positive``, else >= 0, and at most ``high`` (JSON gives floats
    and strings too; a size of 2**63 overflowed an off_t, a timeout of 1e10 s threading's and
    gRPC's clocks: ``MAX_WAIT_S`` for seconds)."""
    kind = "a whole number" if whole else "a finite number"
    if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
            or isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{name} must be {kind}, got {shown(value)}")
    if value < 0 or (positive and value == 0):
        bound = (">= 1" if whole else "> 0") if positive else ">= 0"
        raise ConfigError(f"{name} must be {bound}, got {shown(value)}")
    if value > high:  # (an int: 10**400 compares, where float() overflows)
        top = high if isinstance(high, int) else f"{high:g}"
        raise ConfigError(f"{name} must be at most {top}, got {shown(value)}")


def check_string(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def check_field_types(config: Any, prefix: str = "") -> None:
    """Each ``str`` field of the dataclass ``config`` holds a string and each ``bool`` field a
    bool (``prefix`` + the field's name in the error)."""
    for f in fields(config):
        if f.type in ("str", str):
            check_string(prefix + f.name, getattr(config, f.name))
        elif f.type in ("bool", bool):
            check_bool(prefix + f.name, getattr(config, f.name))


def check_tls_files(prefix: str, ca: str, cert: str, key: str) -> None:
    """Refuse a client certificate without its key (or the reverse) and a file named that is
    not there (``prefix`` + the field's name in the error)."""
    if bool(cert) != bool(key):
        raise ConfigError(f"{prefix}tls_cert and {prefix}tls_key: a client certificate and its "
                          "private key go together (mutual TLS); set both or neither")
    for name, path in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{prefix}{name}: no such file {path!r}")


def tls_options(ca: str, cert: str, key: str) -> TLSOptions | None:
    """TLS when any of the three files is named, as ``kdn admin``'s flags: trusting ``ca``,
    else the system's roots (``TLSOptions``); presenting ``cert``/``key`` for mutual TLS.
    None (plaintext) when none is."""
    if not (ca or cert or key):
        return None

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return TLSOptions(ca=read(ca), cert=read(cert), key=read(key))
