"""Tenants, API keys, roles, rate limits and byte quotas.

Lifecycle: the server loads an ``AuthConfig`` (YAML, see ``load_auth``) at start-up; the
request interceptor (``kdn.server.observe``) calls ``Authenticator.identify`` with each call's
metadata and ``admit`` for its rate limit, then publishes the ``Principal`` in a context
variable for the handlers (``current_principal``). Handlers name every entry with the principal's
tenant (``kdn.keys.store_key(current_principal.get().tenant, namespace, key)``), so one tenant
can not name another tenant's entries, even knowing the key hash. Admin RPCs require
``Role.ADMIN``.

With auth disabled and no mutual TLS every caller is the anonymous admin of the unscoped key
space (a server that only listens on loopback, or one on a trusted network). Under mutual TLS
a client certificate can name a tenant (``subjects`` in the tenants file: its subject CN or a
SAN, typed as ``cn:``, ``dns:``, ``uri:``, ``email:``, ``ip:`` or untyped for any of them); a
certificate whose names point at two tenants is refused. Without a tenants file, a certificate
gets the server's ``mtls_role`` (tenant by default: never admin unless configured so); with
one, a certificate it does not list needs an API key.

API keys are compared by SHA-256 digest in constant time; the file may hold either the key
itself or ``sha256:<hex>`` so plaintext keys need not live on the server.
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdn.errors import (
    ConfigError,
    InvalidArgument,
    PermissionDenied,
    RateLimited,
    TooLarge,
    Unauthenticated,
)
from kdn.names import UNSCOPED, check_tenant
from kdn.transport.metadata import API_KEY_HEADER


class Role(enum.Enum):
    TENANT = "tenant"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    tenant: str
    """Tenant name; "" = the unscoped key space (auth disabled)."""
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


ANONYMOUS = Principal("", Role.ADMIN)
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "kdn_principal", default=ANONYMOUS)


def require_admin() -> Principal:
    p = current_principal.get()
    if not p.is_admin:
        raise PermissionDenied(f"tenant {p.tenant!r} is not an admin")
    return p


def acting_tenant(principal: Principal, tenant: str) -> str:
    """The tenant whose entries a request that names ``tenant`` acts on: the caller's own when
    it names none (or its own); another one only for an admin (PermissionDenied otherwise),
    who sees every tenant's entries in ``ls`` and must be able to reach them by key too:
    the unscoped key space's (stored with no auth file) as ``UNSCOPED``."""
    if tenant == UNSCOPED and not principal.tenant:  # no tenants: everyone's own
        return ""
    if not tenant or tenant == principal.tenant:
        return principal.tenant
    if tenant == UNSCOPED:
        if not principal.is_admin:
            raise PermissionDenied(f"tenant {principal.tenant!r} can not reach the unscoped "
                                   "entries (stored without an auth file; only admins can)")
        return ""
    check_tenant(tenant)
    if not principal.is_admin:
        raise PermissionDenied(f"tenant {principal.tenant!r} can not reach tenant {tenant!r}'s "
                               "entries (only admins can)")
    return tenant


@dataclass(frozen=True)
class TenantPolicy:
    """Limits for one tenant (0 = unlimited)."""

    rate_rps: float = 0.0
    """Sustained requests per second (token bucket refill rate)."""
    burst: int = 0
    """Bucket size; defaults to max(1, 2 * rate_rps)."""
    quota_bytes: int = 0
    """Total stored bytes the tenant may hold."""
    egress_bytes_per_s: int = 0
    """Bytes per second sent to all the tenant's connections together (kdn.server.egress)."""


@dataclass(frozen=True)
class AuthConfig:
    enabled: bool = False
    keys: Mapping[str, tuple[str, Role]] = field(default_factory=dict)
    """sha256 hex of an API key -> (tenant, role)."""
    policies: Mapping[str, TenantPolicy] = field(default_factory=dict)
    subjects: Mapping[str, tuple[str, Role]] = field(default_factory=dict)
    """A client certificate's name -> (tenant, role): under mutual TLS these clients need no
    API key. Keys are ``kind:value`` (``SUBJECT_KINDS``) or a bare value matching any kind."""


SUBJECT_KINDS = ("cn", "dns", "uri", "email", "ip")
"""Kinds of certificate names: the subject's common name and the SAN types."""


def subject_key(kind: str, value: str) -> str:
    """The lookup form of a certificate name: DNS names ignore case, IPs are normalized."""
    if kind == "dns":
        value = value.lower().rstrip(".")
    elif kind == "ip":
        import ipaddress

        value = ipaddress.ip_address(value.strip("[]")).compressed
    return f"{kind}:{value}"


def _typed(spec: str) -> bool:
    """Whether ``spec`` names its kind (``cn:``, ``dns:``, ...)."""
    kind, sep, _ = spec.partition(":")
    return bool(sep) and kind.lower() in SUBJECT_KINDS


def _subject_spec(spec: str) -> str:
    """A ``subjects`` entry in lookup form (``ValueError`` when malformed)."""
    kind, _, value = spec.partition(":")
    if _typed(spec):
        if not value:
            raise ValueError("empty name")
        return subject_key(kind.lower(), value)
    return spec


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def load_auth(path: Path | str) -> AuthConfig:
    """Read a tenants file::

        tenants:
          team-a: {api_keys: ["secret-a"], rate_rps: 50, quota_bytes: 10GiB,
                   egress_bytes_per_s: 125MB}
          ops:    {api_keys: ["sha256:9f86d0..."], role: admin}
    """
    from kdn.yamlfiles import load_yaml_file

    path = Path(path)
    raw = load_yaml_file(path, "auth file", secret=True)  # (errors quote none of its keys)
    unknown = sorted(map(str, set(raw) - {"tenants"})) if isinstance(raw, dict) else []
    if unknown:
        raise ConfigError(f"auth file {path}: unknown settings {unknown} (only 'tenants')")
    tenants = raw.get("tenants") if isinstance(raw, dict) else None
    return parse_tenants(tenants, f"auth file {path}")


def tenants_from_text(text: str) -> AuthConfig:
    """The ``auth_tenants`` setting: a tenants mapping as YAML/JSON text, keys as digests."""
    import yaml

    from kdn.yamlfiles import parse_yaml, yaml_problem

    try:
        tenants = parse_yaml(text)
    except yaml.YAMLError as exc:  # (what and where: never the text, which may hold keys)
        raise ConfigError(f"auth_tenants: not valid YAML: {yaml_problem(exc)}") from None
    if isinstance(tenants, dict) and "tenants" in tenants:  # a whole tenants file: as
        unknown = sorted(map(str, set(tenants) - {"tenants"}))  # ``load_auth``, nothing else
        if unknown:
            raise ConfigError(f"auth_tenants: unknown settings {unknown} (only 'tenants')")
        tenants = tenants["tenants"]
    return parse_tenants(tenants, "auth_tenants", digests_only=True)


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _number(spec: dict[str, Any], field: str, where: str, *, whole: bool = True,
            size: bool = False) -> float:
    """``spec[field]`` (0 when absent) as a finite number >= 0 (0: no limit), whole where
    ``whole``, a size like 10GiB where ``size``; ConfigError naming it otherwise."""
    from kdn.checks import shown
    from kdn.server.config import MAX_SIZE, parse_size

    value = spec.get(field, 0)
    try:
        if isinstance(value, bool):
            raise ValueError("a number, not a boolean")
        got = parse_size(value) if size and isinstance(value, str) else float(value)
        if not math.isfinite(got) or got < 0 or (whole and got != int(got)):
            raise ValueError(f"must be a finite{' whole' if whole else ''} number >= 0 "
                             f"(0 = no limit), got {shown(value)}")
        if got > MAX_SIZE:  # (carried in 64-bit fields: a tenant's Stats)
            raise ValueError(f"at most {MAX_SIZE}, got {shown(value)}")
    except (TypeError, ValueError, OverflowError) as exc:  # float() of 400 digits
        raise ConfigError(f"{where}: {field}: {exc}") from None
    return got


def parse_tenants(tenants: Any, where_all: str, *, digests_only: bool = False) -> AuthConfig:
    """An ``AuthConfig`` from a ``tenants`` mapping (``where_all`` names it in errors)."""
    if not isinstance(tenants, dict) or not tenants:
        raise ConfigError(f"{where_all}: expected a 'tenants' mapping")
    keys: dict[str, tuple[str, Role]] = {}
    subjects: dict[str, tuple[str, Role]] = {}
    policies: dict[str, TenantPolicy] = {}
    for name, spec in tenants.items():
        where = f"{where_all}: tenant {name!r}"
        try:
            check_tenant(name)
        except InvalidArgument as exc:
            raise ConfigError(f"{where_all}: {exc}") from None
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a mapping")
        unknown = set(spec) - {"api_keys", "subjects", "role", "rate_rps", "burst",
                               "quota_bytes", "egress_bytes_per_s"}
        if unknown:
            raise ConfigError(f"{where}: unknown settings {sorted(unknown)}")
        try:
            role = Role(spec.get("role", "tenant"))
        except ValueError:
            raise ConfigError(f"{where}: role must be 'tenant' or 'admin'") from None
        api_keys, subj = spec.get("api_keys", []), spec.get("subjects", [])
        if not isinstance(api_keys, list) or not isinstance(subj, list) or \
                not (api_keys or subj):
            raise ConfigError(f"{where}: needs api_keys or subjects (client certificate "
                              "names), as non-empty lists")
        for name_ in subj:
            try:
                subject = _subject_spec(name_) if isinstance(name_, str) and name_ else ""
            except ValueError:
                subject = ""
            if not subject or subject in subjects:
                raise ConfigError(f"{where}: malformed or duplicate subject {name_!r} (a "
                                  "certificate name: CN or SAN, optionally typed as "
                                  f"{', '.join(k + ':' for k in SUBJECT_KINDS)})")
            subjects[subject] = (name, role)
        for i, k in enumerate(api_keys):
            if not isinstance(k, str) or not k.strip():  # YAML null (an unset template
                # value) or a number (012345 reads as 5349): never a key by accident
                got = ("null" if k is None else "blank" if isinstance(k, str) else "a number"
                       if isinstance(k, (int, float)) else f"a {type(k).__name__}")  # (never
                # the value: it may be the key)
                raise ConfigError(f"{where}: api_keys[{i}] must be a non-empty string (quote "
                                  f"a key that looks like a number), got {got}")
            if not (k.isascii() and k.isprintable()) or k.strip() != k:  # no client can
                raise ConfigError(f"{where}: api_keys[{i}] must be printable ASCII with no "
                                  "leading or trailing whitespace: a key travels as a gRPC "
                                  "header value")  # send it (a gRPC header; kdn's client)
            if digests_only and not k.startswith("sha256:"):
                raise ConfigError(f"{where}: api_keys here must be sha256:HEX digests (printf "
                                  "%s KEY | sha256sum), never the keys themselves")
            d = k.removeprefix("sha256:").lower() if k.startswith("sha256:") else digest(k)
            if not _HEX64.fullmatch(d) or d in keys:
                raise ConfigError(f"{where}: api_keys[{i}]: malformed (sha256: and 64 hex "
                                  "digits) or duplicate api key")
            keys[d] = (name, role)
        rate_rps, burst = _number(spec, "rate_rps", where, whole=False), _number(spec, "burst",
                                                                                 where)
        if burst and not rate_rps:
            raise ConfigError(f"{where}: burst needs rate_rps (the rate its bucket refills at; "
                              "without one the tenant is not limited)")
        policies[name] = TenantPolicy(
            rate_rps=rate_rps,
            burst=int(burst),
            quota_bytes=int(_number(spec, "quota_bytes", where, size=True)),
            egress_bytes_per_s=int(_number(spec, "egress_bytes_per_s", where, size=True)))
    return AuthConfig(enabled=True, keys=keys, policies=policies, subjects=subjects)


def certificates_unasked(config: AuthConfig) -> list[str]:
    """For a server that asks no client certificate (no ``tls_client_ca``): the tenants whose
    ``subjects`` will never be matched (beside their API keys). A tenant named only by
    ``subjects`` could never enter: ConfigError naming it."""
    by_subject = sorted({t for t, _ in config.subjects.values()})
    with_keys = {t for t, _ in config.keys.values()}
    never = [t for t in by_subject if t not in with_keys]
    if never:
        raise ConfigError(f"tenant{'s' * (len(never) > 1)} {', '.join(map(repr, never))}: "
                          "named only by subjects "
                          "(client certificate names), which this server does not ask for; set "
                          "tls_client_ca (mutual TLS) or give them api_keys")
    return by_subject


class _Bucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.capacity = rate, float(burst or max(1.0, 2 * rate))
        self.tokens, self.stamp = self.capacity, time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False


class AuthFailed(Unauthenticated):
    """An authentication that failed, with why in a word (the metric's ``reason`` label)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Authenticator:
    """Who a call is: an API key (``x-kdn-api-key`` or ``authorization: Bearer``) names a
    tenant; under mutual TLS (``mtls``), so does a client certificate whose subject CN or a SAN
    an auth-file tenant lists (``subjects``); without a tenants file a certificate gets
    ``mtls_role`` (None: refused; never admin unless the operator says so)."""

    def __init__(self, config: AuthConfig, *, mtls: bool = False,
                 mtls_role: Role | None = Role.TENANT) -> None:
        self.config = config
        self.mtls = mtls
        self.mtls_role = mtls_role
        self._buckets = {t: _Bucket(p.rate_rps, p.burst) for t, p in config.policies.items()
                         if p.rate_rps > 0}
        self._usage: dict[str, int] = {}
        self.usage_whole = True
        """Whether every tenant's usage was last counted with every tier up and whole
        (``kdn.server.ingest.recount_usage``); while not, the server recounts once none is
        down, nor any part of one."""
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def open(self) -> bool:
        """No key and no certificate is asked of anyone (auth off, no mutual TLS)."""
        return not self.config.enabled and not self.mtls

    def identify(self, metadata: Sequence[tuple[str, Any]] | None,
                 identities: Sequence[tuple[str, str]] = ()) -> Principal:
        """The caller of a call with ``metadata``; ``identities``: the (kind, name) pairs of
        its verified client certificate (mutual TLS; kinds in ``SUBJECT_KINDS``), else empty.
        An API key, when sent, decides alone. Raises ``AuthFailed``."""
        if self.open:
            return ANONYMOUS
        supplied = self.supplied_key(metadata)
        if supplied:
            d = digest(supplied)
            for known, (tenant, role) in self.config.keys.items():
                if hmac.compare_digest(known, d):
                    return Principal(tenant, role)
            raise AuthFailed("unknown API key", "unknown_key")
        if self.mtls:
            found = self.by_certificate(identities)
            if len(found) == 1:
                return Principal(*found.pop())
            names = ", ".join(f"{k}:{v}" for k, v in identities) or "no name"
            if found:
                raise AuthFailed(f"the client certificate ({names}) names several tenants "
                                 f"({', '.join(sorted(t for t, _ in found))}); refused",
                                 "ambiguous_certificate")
            if self.config.enabled:  # a tenants file says who may enter: this one is not in it
                raise AuthFailed(f"missing API key, and the client certificate ({names}) is "
                                 "no tenant's", "unknown_certificate")
            if self.mtls_role is None:
                raise AuthFailed("this server needs an API key besides the client "
                                 "certificate (mtls_role: none)", "certificate_not_enough")
            return Principal("", self.mtls_role)
        raise AuthFailed(f"missing API key (metadata {API_KEY_HEADER!r})", "missing_key")

    @staticmethod
    def supplied_key(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """The API key a call's ``metadata`` carries (``x-kdn-api-key`` or ``authorization:
        Bearer``; the last one sent), or None."""
        supplied = None
        for k, v in metadata or ():
            if k == API_KEY_HEADER:
                supplied = v.decode() if isinstance(v, bytes) else str(v)
            elif k == "authorization" and str(v).lower().startswith("bearer "):
                supplied = str(v)[7:]
        return supplied

    def by_certificate(self, identities: Sequence[tuple[str, str]]) -> set[tuple[str, Role]]:
        """The (tenant, role) pairs the ``subjects`` give a certificate with these names."""
        found: set[tuple[str, Role]] = set()
        for kind, value in identities:
            specs = []
            try:
                specs.append(subject_key(kind, value))
            except ValueError:  # not an IP address after all: only its bare form can match
                pass
            if not _typed(value):  # a bare entry is never typed (``_subject_spec``): a name
                specs.append(value)  # that spells one ("cn:ops" as a DNS name) is not it
            found.update(self.config.subjects[spec] for spec in specs
                         if spec in self.config.subjects)
        return found

    def admit(self, principal: Principal) -> None:
        bucket = self._buckets.get(principal.tenant)
        if bucket is not None:
            with self._lock:
                ok = bucket.take()
            if not ok:
                raise RateLimited(f"{RateLimited.MARK}tenant {principal.tenant!r} exceeded "
                                  f"{bucket.rate:g} requests/s")

    # -- byte quotas ----------------------------------------------------------------------------

    def set_usage(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self._usage[tenant] = nbytes

    def usage(self, tenant: str) -> int:
        return self._usage.get(tenant, 0)

    def refund(self, tenant: str, nbytes: int) -> None:
        """Give ``nbytes`` back to ``tenant`` (an entry of that size left the store)."""
        if tenant:
            with self._lock:
                self._usage[tenant] = max(0, self._usage.get(tenant, 0) - nbytes)

    def room(self, principal: Principal) -> int | None:
        """The bytes the tenant may still grow by (None: no quota)."""
        policy = self.config.policies.get(principal.tenant) if principal.tenant else None
        if policy is None or not policy.quota_bytes:
            return None
        with self._lock:
            return max(0, policy.quota_bytes - self._usage.get(principal.tenant, 0))

    def charge(self, principal: Principal, delta: int, over: int = 0) -> None:
        """Add ``delta`` stored bytes to the tenant; refuse growth past its quota (plus
        ``over``: bytes a batch gives back once its later items are in)."""
        if not principal.tenant:
            return
        policy = self.config.policies.get(principal.tenant)
        with self._lock:
            now = self._usage.get(principal.tenant, 0)
            if delta > 0 and policy and policy.quota_bytes \
                    and now + delta > policy.quota_bytes + over:
                raise TooLarge(f"tenant {principal.tenant!r} quota of {policy.quota_bytes} "
                               f"bytes exceeded ({now} stored, {delta} more requested)")
            self._usage[principal.tenant] = max(0, now + delta)
