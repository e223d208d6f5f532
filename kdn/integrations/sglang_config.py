"""The settings of kdn's SGLang HiCache backend (``kdn.integrations.sglang``): ``KDNBackendConfig``,
the ``"kdn"`` object of ``--hicache-storage-backend-extra-config``, each field documented and
checked when made (a ``ConfigError`` naming the field otherwise), read from SGLang's extra-config
by ``from_extra``. It imports nothing of SGLang: a config can be made and checked without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from kdn import keys
from kdn.checks import MAX_WAIT_S
from kdn.client.client import TLSOptions
from kdn.codec.catalog import check_codec, default_level
from kdn.errors import ConfigError, KDNError
from kdn.integrations.settings import check_field_types, check_number, check_tls_files, tls_options
from kdn.options import StoreOptions


@dataclass(frozen=True)
class KDNBackendConfig:
    """The ``"kdn"`` object of ``--hicache-storage-backend-extra-config``."""

    address: str = "127.0.0.1:50051"
    """The kdn server (host:port, or unix:PATH)."""
    namespace: str = "sglang"
    """kdn namespace of the pages."""
    mode: str = "raw"
    """Codec mode of each page: ``raw`` (bit-exact, no decode), ``lossless`` (bit-exact,
    zstd), ``int8``, ``kdn``..."""
    level: str = ""
    """Codec level (``kdn`` mode: ``default``, ``high``, ``small``...); "" = the mode's default
    (``kdn.codec.catalog.default_level``: ``kdn``'s ``default``), which ``level`` then holds."""
    api_key: str = ""
    """API key of the kdn tenant; "" reads ``$KDN_API_KEY`` (none when unset)."""
    tls_ca: str = ""
    """PEM file of the CA to trust. Any of ``tls_ca``, ``tls_cert``, ``tls_key`` (files that
    exist) turns TLS on (no ``tls_ca``: the system's roots); ``tls_cert``/``tls_key``: mTLS."""
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    """Send the API key even in plaintext to a non-loopback server (refused otherwise)."""
    adapter: str = ""
    """Id of the LoRA adapter the engine serves with (part of every key)."""
    salt: str = ""
    """Opaque salt in every key: engines with different salts never share pages."""
    weights_id: str = ""
    """Checkpoint identity (e.g. a revision hash) when ``model_name`` alone is ambiguous."""
    ttl_s: int = 0
    """Seconds a stored page lives (0: the server's default)."""
    timeout_s: float = 30.0
    """Deadline of each kdn call (at most a day, ``kdn.checks.MAX_WAIT_S``)."""
    workers: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    """Threads a batch's chunks run on (encoding, decoding, calls): one per core, four at most
    (more threads than cores only take turns, and each turn costs a switch)."""
    shm_bytes: int | None = None
    """Client's shared segment (same host); None: the client's default, 0: gRPC only."""
    local_bytes: int = 0
    """In-process tier of encoded pages in front of the server (0: none)."""

    def __post_init__(self) -> None:
        """Every field's type and range (JSON values): a ``ConfigError`` naming it otherwise."""
        check_field_types(self, "kdn.")
        check_number("kdn.workers", self.workers, whole=True, positive=True)
        check_number("kdn.timeout_s", self.timeout_s, whole=False, positive=True,
                     high=MAX_WAIT_S)
        check_number("kdn.ttl_s", self.ttl_s, whole=True, positive=False)
        check_number("kdn.local_bytes", self.local_bytes, whole=True, positive=False)
        if self.shm_bytes is not None:
            check_number("kdn.shm_bytes", self.shm_bytes, whole=True, positive=False)
        if not self.level:
            object.__setattr__(self, "level", default_level(self.mode))
        for name, check in (("kdn.mode/kdn.level", lambda: check_codec(self.mode, self.level)),
                            ("kdn.namespace", lambda: keys.check_namespace(self.namespace)),
                            ("kdn.ttl_s", lambda: StoreOptions(ttl_s=self.ttl_s))):
            try:
                check()
            except KDNError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        check_tls_files("kdn.", self.tls_ca, self.tls_cert, self.tls_key)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KDNBackendConfig:
        """The config in ``extra["kdn"]`` (defaults when absent); unknown names are errors."""
        if extra is not None and not isinstance(extra, dict):
            raise ConfigError(f"the backend's extra config is a JSON object ({{\"kdn\": "
                              f"{{...}}}}), got {type(extra).__name__}")
        got = (extra or {}).get("kdn", {})
        if not isinstance(got, dict):  # "", 0, false are no config, nor dict() of pairs
            raise ConfigError(f"kdn: the backend's settings are a JSON object ({{\"address\": "
                              f"...}}), got {type(got).__name__}")
        given = dict(got)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown kdn backend settings {unknown}; known: {sorted(known)}")
        return cls(**given)

    def tls(self) -> TLSOptions | None:
        return tls_options(self.tls_ca, self.tls_cert, self.tls_key)
