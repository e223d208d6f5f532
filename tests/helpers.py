"""Shared builders for tests: layouts (uniform, GQA-like, pruned), random caches, polling,
stopping a process (SIGSTOP) for good."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kdn.cache import KVCache
from kdn.layout import DType, KVLayout, LayerLayout


def uniform_layout(layers: int = 4, heads: int = 2, dim: int = 16,
                   dtype: DType = DType.FLOAT16, model: str = "test-model") -> KVLayout:
    return KVLayout(model, tuple(LayerLayout(heads, dim, dim) for _ in range(layers)),
                    dtype=dtype, head_dim=dim)


def pruned_layout(dtype: DType = DType.FLOAT16) -> KVLayout:
    """Every layer keeps its own K and V channel subsets (KVPruner-style)."""
    dims = [(16, 16), (12, 16), (8, 10), (16, 4), (6, 12)]
    layers = []
    for i, (kc, vc) in enumerate(dims):
        k_kept = tuple(sorted((c * 2 + i) % 16 for c in range(kc))) if kc < 16 else None
        v_kept = tuple(range(16 - vc, 16)) if vc < 16 else None
        if k_kept is not None and len(set(k_kept)) != kc:
            k_kept = tuple(range(kc))
        layers.append(LayerLayout(2, kc, vc, k_kept, v_kept))
    return KVLayout("pruned-model", tuple(layers), dtype=dtype, head_dim=16)


def random_kv(layout: KVLayout, tokens: int = 32, seed: int = 0, start: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    dt = layout.dtype.torch
    layers = [
        (torch.randn(lay.kv_heads, tokens, lay.k_channels, generator=g).to(dt),
         torch.randn(lay.kv_heads, tokens, lay.v_channels, generator=g).to(dt))
        for lay in layout.layers
    ]
    return KVCache(layout, layers, start)


def eventually(cond: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; its last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def sigstop(pid: int) -> None:
    """SIGSTOP process ``pid`` (a hung host: its connections are still taken, nothing answers)
    and wait until the kernel has stopped every thread of it: the signal takes effect as each
    runs next, so a call made at once could still be answered."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")

    def stopped() -> bool:
        for task in tasks.iterdir():
            try:
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended meanwhile
            if state not in "tT":
                return False
        return True

    if not eventually(stopped, timeout=5, interval=0.002):
        raise AssertionError(f"process {pid} did not stop within 5 s of SIGSTOP")


def make_certs(tmp: Path, clients: tuple[str, ...] = ("engine-1",),
               client_sans: dict[str, list[str]] | None = None) -> dict[str, Path]:
    """A throwaway CA, a server certificate for localhost/127.0.0.1 and client certificates
    (CN = each name in ``clients``; ``client_sans``: DNS names added to a client's SAN), as
    PEM files in ``tmp``: ``ca.crt``, ``server.crt``/``.key``, ``<name>.crt``/``.key`` (and
    ``client.crt``/``.key`` for the first client). Keys are private (0600), as a server
    requires of its own."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name: str, issuer: tuple | None, ca: bool, sans: list[x509.GeneralName]
             ) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = (x509.CertificateBuilder().subject_name(subject)
             .issuer_name(issuer[0].subject if issuer else subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(issuer[1] if issuer else key, hashes.SHA256()), key

    ca = make("kdn-test-ca", None, True, [])
    made = {"ca": ca, "server": make("localhost", ca, False, [
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])}
    for name in clients:
        made[name] = make(name, ca, False, [x509.DNSName(d)
                                            for d in (client_sans or {}).get(name, [])])
    made["client"] = made[clients[0]]
    out = {}
    for name, (cert, key) in made.items():
        out[f"{name}.crt"] = tmp / f"{name}.crt"
        out[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}.key"] = tmp / f"{name}.key"
        out[f"{name}.key"].write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        out[f"{name}.key"].chmod(0o600)
    return out


def churn(writer: Any, key: bytes, versions: Sequence[KVCache], stop: threading.Event,
          written: list[int] | None = None) -> None:
    """Store ``versions`` under ``key`` in turn with ``writer`` (a Client), deleting it every
    seventh time, until ``stop`` is set: the writer side of the read races. ``written[0]``
    counts the writes and deletes done."""
    i = 0
    while not stop.is_set():
        i += 1
        if i % 7 == 0:
            writer.delete(key)
        else:
            writer.store(key, versions[i % len(versions)], mode="raw")
        if written is not None:
            written[0] = i


def count_staging_copies(monkeypatch: Any) -> list[int]:
    """Record every ``Tensor.pin_memory`` call (a pinned staging copy on the way to a GPU)
    from now on: the list grows by one per call."""
    import torch

    staged: list[int] = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a: staged.append(1) or real(self, *a))
    return staged


def count_decoders(monkeypatch: Any) -> list[int]:
    """Record the tokens of every entry a decoder is made for from now on (every way from
    stored bytes to a tensor makes a ``StreamDecoder`` per entry)."""
    from kdn import codec

    made: list[int] = []
    init = codec.StreamDecoder.__init__

    def counted(self: codec.StreamDecoder, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self.header.tokens)

    monkeypatch.setattr(codec.StreamDecoder, "__init__", counted)
    return made


def numbered_key(i: int) -> bytes:
    """A 32-byte key made of ``i`` (tests that number their entries)."""
    return i.to_bytes(4, "little") * 8


def raw_entry(kv: KVCache) -> bytes:
    """``kv`` as a stored ``raw`` container."""
    from kdn import codec

    return codec.encode_parts(kv, "raw").to_bytes()


def copy_into(dst: memoryview, value: bytes | memoryview) -> None:
    """An arena fill that copies without a check (``Arena.lease``'s ``fill``)."""
    dst[:] = value


def read_while_churned(writer: Any, reader: Any, key: bytes, versions: Sequence[KVCache],
                       reads: int, layout: KVLayout, *, touch: bool = False) -> list[int]:
    """``reads`` retrieves of ``key`` by ``reader`` while ``writer`` stores ``versions`` under
    it in turn and deletes it now and then (``churn``): the version each read returned (-1: a
    miss). AssertionError at the first read that is not one stored version, whole. ``touch``:
    the reader writes into a tensor of every read (its own pages, never the next read's).
    Reads go on past ``reads`` until the writer has made 8 writes (60 s at most): reads that
    need no call (the arena's directory) can all be done before a loaded host's first store
    lands, and then race nothing."""
    stop = threading.Event()
    written, failed = [0], []

    def writes() -> None:
        try:
            churn(writer, key, versions, stop, written)
        except BaseException as exc:  # raised by the reading thread, at its end
            failed.append(exc)

    thread = threading.Thread(target=writes)
    seen: list[int] = []
    thread.start()
    deadline = time.monotonic() + 60
    try:
        while len(seen) < reads or (written[0] < 8 and time.monotonic() < deadline
                                    and thread.is_alive()):
            got = reader.retrieve(key, layout=layout)
            if got is None:
                seen.append(-1)
                continue
            match = [j for j, v in enumerate(versions) if got.equal(v)]
            assert len(match) == 1, f"read {len(seen)} is not one stored version"
            seen.append(match[0])
            if touch:
                got.layers[0][0].add_(1)
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]
    return seen


def without_directory(monkeypatch: Any) -> None:
    """Same-host reads ask the server as before the read arena's directory: the server lists
    no entry (``kdn.server.arena.LIST_BELOW_BYTES``) and clients look none up. For tests of
    the ways a read takes when an entry is not listed (inline answers, leases, kept leases)."""
    from kdn.client.shm import LeasedArena
    from kdn.server import arena

    monkeypatch.setattr(arena, "LIST_BELOW_BYTES", 0)
    monkeypatch.setattr(LeasedArena, "find", lambda self, namespace, key: None)


def leased_small_entries(monkeypatch: Any) -> None:
    """Small entries read alone are leased, as larger ones are: not answered inline
    (``kdn.client.dataplane.SMALL_ENTRY_BYTES``) nor read from the arena's directory
    (``without_directory``). For tests of leases and kept leases on small entries."""
    from kdn.client import dataplane

    monkeypatch.setattr(dataplane, "SMALL_ENTRY_BYTES", 0)
    without_directory(monkeypatch)


def data_ticket(c: Any) -> str:
    """The network data path ticket a client (``kdn.client.Client``) holds."""
    net = c.dataplane.net()
    assert net is not None, "the server offered no data path"
    return str(net.ticket)


def data_connect(st: Any) -> socket.socket:
    """A raw connection to a server's (``ServerThread``) network data path."""
    return socket.create_connection(("127.0.0.1", st.server.servicer.data_port), timeout=10)


@contextmanager
def running_nodes(tmp: Path, n: int = 2, **config: Any) -> Iterator[list[Any]]:
    """``n`` in-process kdn nodes of a fleet (``ServerConfig(**config)``, each its own data
    directory under ``tmp`` and no disk tier), started; stopped on the way out."""
    from kdn.server import ServerConfig, ServerThread

    nodes = [ServerThread(ServerConfig(port=0, data_dir=tmp / f"n{i}", disk_bytes=0, **config))
             for i in range(n)]
    for node in nodes:
        node.start()
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def all_codecs() -> list[tuple[str, str]]:
    """Every registered (mode, level) pair."""
    from kdn.codec import mode_names
    from kdn.codec.modes import get_mode

    return [(m, lv) for m in mode_names() for lv in get_mode(m).levels]


def small_kv() -> KVCache:
    """A 3-layer cache of 5 tokens, one head, channels 4/2/3: small enough to damage every
    bit of its container."""
    layout = KVLayout("tiny", (LayerLayout(1, 4, 3), LayerLayout(1, 2, 4), LayerLayout(1, 3, 2)),
                      head_dim=4)
    return random_kv(layout, tokens=5, seed=7)
