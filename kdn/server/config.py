"""Server configuration: one frozen dataclass, one loader for YAML file + KDN_* env + flags.

Precedence (later wins): defaults < YAML file < ``KDN_<FIELD>`` environment variables < flags.
Every value is validated at start-up; an error names the setting and where it came from.
Sizes accept plain byte counts or units: ``512MiB``, ``2GB``, ``1.5GiB``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kdn.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 512MiB or 1073741824, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kdn serve`` needs. Field docstrings are shown by ``kdn serve --help``."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 50051
    """TCP port to listen on (0 = any free port)."""
    data_dir: Path = Path("kdn-data")
    """Directory holding the LMDB disk tier."""
    ram_bytes: int = 1 << 30
    """Byte budget of the RAM tier."""
    disk_bytes: int = 16 << 30
    """Byte budget of the LMDB disk tier (0 = no disk tier)."""
    redis_url: str = ""
    """Redis URL for the shared tier (redis://host:port/db); empty = no Redis tier."""
    max_message_bytes: int = 64 << 20
    """Largest single gRPC message accepted or sent."""
    max_entry_bytes: int = 1 << 30
    """Largest stored entry (header plus frames)."""
    allowed_models: tuple[str, ...] = ()
    """Model fingerprints this server accepts (empty = any)."""
    shutdown_grace_s: float = 10.0
    """Seconds in-flight RPCs get to finish on shutdown."""
    log_level: str = "INFO"
    """Python logging level name."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if self.ram_bytes <= 0:
            raise ConfigError(f"ram_bytes: must be > 0, got {self.ram_bytes}")
        if self.disk_bytes < 0:
            raise ConfigError(f"disk_bytes: must be >= 0, got {self.disk_bytes}")
        if not 1024 <= self.max_message_bytes <= (2**31 - 1):
            raise ConfigError(
                f"max_message_bytes: must be in 1KiB..2GiB-1, got {self.max_message_bytes}"
            )
        if self.max_entry_bytes <= 0:
            raise ConfigError(f"max_entry_bytes: must be > 0, got {self.max_entry_bytes}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url: expected redis://host:port, got {self.redis_url!r}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


_SIZE_FIELDS = {"ram_bytes", "disk_bytes", "max_message_bytes", "max_entry_bytes"}


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = {f.name: f.type for f in fields(ServerConfig)}[name]
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)
        if kind in ("int", int):
            if isinstance(value, bool):
                raise ValueError("not an integer")
            return int(value)
        if kind in ("float", float):
            return float(value)
        if kind in ("Path", Path):
            return Path(os.path.expanduser(str(value)))
        if name == "allowed_models":
            items = value if isinstance(value, (list, tuple)) else str(value).split(",")
            return tuple(str(v).strip() for v in items if str(v).strip())
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: invalid value {value!r} (from {source}): {exc}") from None


def load_config(
    file: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Merge defaults, a YAML file, KDN_* variables and flags into a validated ServerConfig."""
    known = {f.name for f in fields(ServerConfig)}
    values: dict[str, Any] = {}
    if file is not None:
        path = Path(file)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping of settings")
        for k, v in raw.items():
            if k not in known:
                raise ConfigError(f"{k}: unknown setting (in {path}); known: {sorted(known)}")
            values[k] = _coerce(k, v, str(path))
    env = os.environ if env is None else env
    for k, v in env.items():
        if not k.startswith("KDN_"):
            continue
        name = k[4:].lower()
        if name in known:
            values[name] = _coerce(name, v, f"${k}")
    for k, v in (flags or {}).items():
        if v is None:
            continue
        if k not in known:
            raise ConfigError(f"{k}: unknown setting")
        values[k] = _coerce(k, v, f"--{k.replace('_', '-')}")
    try:
        return ServerConfig(**values)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def describe() -> list[tuple[str, str, str]]:
    """(name, default, doc) of every setting, for help output."""
    import inspect

    src = inspect.getsource(ServerConfig)
    docs = dict(re.findall(r"\n    (\w+): [^\n]*\n    \"\"\"(.*?)\"\"\"", src))
    return [(f.name, str(f.default), docs.get(f.name, "")) for f in dataclasses.fields(ServerConfig)]
