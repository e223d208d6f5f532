"""LMDB disk tier: entries, their metadata and their access order in one memory-mapped file.

Everything the tier knows lives in the LMDB environment itself (no in-memory index), so a
restarted server serves what it held, with its byte accounting and access order. Four named
databases, all updated in the same write transaction:

    meta     key -> (value size u64, expiry f64 unix seconds or 0, stamp u64, written f64 unix
             seconds; a 24-byte record, ``_META_V1``, has no write time)
    lru      stamp (u64 big-endian) + key -> b""   oldest access first
    entries  key -> value; a value over ``part_bytes`` (LMDB holds at most 4 GiB - 1 in one
             record) is split: key -> part 0, key + b"\\x00" + u32 i -> part i (store keys never
             hold NUL, so the names can not meet)
    info     b"used" -> u64, the sum of len(key) + len(value) over all entries

Crash safety: each ``put``/``put_many``/``delete`` is committed in one write transaction (LMDB's
copy-on-write B+tree with ``sync``/``metasync``), alone or with the writes other threads made at
once, each nested in it so that one that fails is rolled back alone (group commit:
``kdn.store.lmdbgroup``): once it returns the entry survives SIGKILL or power loss, and a
transaction interrupted by SIGKILL leaves no trace, so no partial entry is ever readable.

Byte budget: ``capacity_bytes``, cut where its filesystem could not hold it (with a warning, or
at DEBUG for ``quiet_cut``: a budget nobody set, which ``kdn serve``'s ready line shows as taken;
``kdn.store.diskroom``). A put that would push ``used`` over it evicts the entries with the
oldest access stamps in the same transaction, skipping live keys marked ``protected`` (pins).
Access stamps are approximate LRU: a ``get`` records the key in memory and the stamps are
written with the next write transaction (and at ``close``), so reads never pay for a write.

Files gone: where the data file is no longer the one opened (its directory deleted, the file
replaced), writes would go to a file no restart opens: ``healthy`` then answers False (the
probe marks the tier down) and every write raises ``TierUnavailable`` (nothing is
acknowledged): checked before its transaction commits, so it is rolled back (the folder moved
back, or a restart on it where it now is, serves no write reported failed), and once committed
for a move in between.

File truncated: LMDB maps the data file and reads its pages in place, so a page past the file's
end (a truncated copy, a file cut short on a full disk) is a SIGBUS that kills the process, not
an error. The tier checks the file's size against the last page LMDB has in use: at open, a
shorter file is refused with ``TierUnavailable`` naming both sizes (``kdn serve`` then exits
with that line, not with a crash at its first read of a lost page), and ``healthy`` answers
False once the file is cut short while open (the probe marks the tier down, and reads go to
the other tiers; a read in the probe interval before that still meets the lost page).

Full disk at open: the lock file (LMDB's reader table, written through a map) is allocated
whole before LMDB opens it (``kdn.store.lmdbfiles``): no room for it, or for LMDB's first
pages, is ``DiskFull`` naming the folder and the free bytes (a sparse lock file was a SIGBUS at
open, or at a later read once the disk filled).

Failed writes: a write LMDB fails (the disk full, an I/O error) raises ``PartlyUnavailable``
naming the filesystem's free bytes (LMDB says "Input/output error" for a full disk too):
that write fails (a DISK store is UNAVAILABLE, a queued one is retried with a backoff), while
the tier stays up and serves what it holds; ``healthy`` asks whether it can read. Failed reads
(``kdn.store.lmdbfiles.read_failed``): an I/O error or a damaged file takes the tier down
(its probe brings it back once it reads again); a full reader table fails that read only.
Either is a miss of this tier to the caller, never an error of the request.

One process: the tier holds ``kdn.store.dirlock.DirLock`` on its folder from open to
``close``; a second opener (another process, or this one again) is refused with ``InUse``.

Smaller budget: a tier opened holding more than ``capacity_bytes`` (a restart with a smaller
``disk_bytes``) evicts its oldest entries down to it at once, and its map may pass that file.

Map growth: the map starts small and doubles up to ``max_map_bytes`` on ``MapFullError``;
resizing needs every transaction of this process closed, so transactions share a
readers-writer lock that ``_grow`` takes exclusively. Writes are committed by one thread at a
time (a group's leader): it grows the map it found full and runs the write again (each
growth is logged at INFO and reported as the ``map_grown`` event). A write refused at
``max_map_bytes`` is logged as a WARNING, reported as ``map_full``, and its ``TooLarge`` names
the bytes stored and the budget.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from kdn.errors import Corrupt, PartlyUnavailable, TierUnavailable, TooLarge
from kdn.store.base import Tier, TierStats
from kdn.store.dirlock import LOCK_NAME, DirLock
from kdn.store.diskroom import describe, fitted, make_folder, make_private
from kdn.store.lmdbfiles import MAX_READERS, file_id, open_failed, read_failed, reserve_lock
from kdn.store.lmdbgroup import GroupCommit, Run
from kdn.store.locks import RWLock

log = logging.getLogger(__name__)

_MIN_MAP = 64 << 20
_START_MAP = 256 << 20
_META = struct.Struct("<QdQd")  # value size, expiry (unix s, 0 = none), stamp, written (unix s)
_META_V1 = struct.Struct("<QdQ")  # without the write time
PART_BYTES = 1 << 30  # the largest record of a split value (see the module docstring)
_PART = struct.Struct(">I")


def _part_key(key: bytes, i: int) -> bytes:
    return key + b"\x00" + _PART.pack(i)


_DAMAGED_META = (0, 1.0, 0, 0.0)
"""What a meta record of neither length (damage in the file) reads as: an entry of 0 bytes that
expired long ago, so a miss everywhere, listed nowhere and swept as expired entries are (its
unpacking raised struct.error into every read, listing, Stats and verify)."""


def _unmeta(raw: bytes | memoryview) -> tuple[int, float, int, float]:
    """(size, expiry, stamp, written: 0.0 when unknown) of a meta record of either length;
    ``_DAMAGED_META`` for any other."""
    if len(raw) == _META_V1.size:
        return (*_META_V1.unpack(raw), 0.0)
    if len(raw) != _META.size:
        return _DAMAGED_META
    return _META.unpack(raw)  # type: ignore[no-any-return]
_STAMP = struct.Struct(">Q")
_USED = b"used"
_MAX_TOUCHED = 1 << 16

class LmdbTier(Tier):
    name = "disk"
    durable = True

    def __init__(
        self,
        path: Path | str,
        *,
        capacity_bytes: int,
        sync: bool = True,
        max_map_bytes: int | None = None,
        initial_map_bytes: int = _START_MAP,
        protected: Callable[[bytes], bool] | None = None,
        part_bytes: int = PART_BYTES,
        quiet_cut: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < part_bytes < 1 << 32:
            raise ValueError(f"part_bytes must be in 1..4GiB-1, got {part_bytes}")
        self.part_bytes = part_bytes
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.path = Path(path)
        make_folder(self.path)
        make_private(self.path, ("data.mdb", "lock.mdb", LOCK_NAME))  # before any opens
        self.capacity_bytes, cut = fitted(self.path, capacity_bytes)
        if cut:  # a budget nobody set (the server's default) is cut without a warning
            log.log(logging.DEBUG if quiet_cut else logging.WARNING, "%s", cut)
        self.max_map_bytes = max_map_bytes or (2 * capacity_bytes + _MIN_MAP)
        if protected is not None:
            self.protected = protected
        self._rw = RWLock()
        self._touch_lock = threading.Lock()
        self._touched: dict[bytes, None] = {}
        self._group = GroupCommit(self._transact)
        self._dir_lock = DirLock(self.path)  # before LMDB opens it: one process per environment
        try:
            reserve_lock(self.path, MAX_READERS)  # (a sparse one is a SIGBUS on a full disk)
            self.env = lmdb.open(
                str(self.path), map_size=min(self.max_map_bytes, initial_map_bytes), subdir=True,
                max_dbs=4, sync=sync, metasync=sync, readahead=False, max_readers=MAX_READERS,
                mode=0o600,
            )
            make_private(self.path, ("data.mdb", "lock.mdb"))  # as LMDB made them (0600)
            short = self._truncated()  # before any database is opened: opening one reads
            if short:  # its root page, which may lie past the end (SIGBUS)
                raise TierUnavailable(f"can not open LMDB at {self.path}: {short}; move the "
                                      "folder aside to start with an empty disk tier")
            self.entries = self.env.open_db(b"entries")
            self.meta = self.env.open_db(b"meta")
            self.lru = self.env.open_db(b"lru")
            self.info = self.env.open_db(b"info")
            with self.env.begin(db=self.lru) as txn:
                cur = txn.cursor()
                self._stamp = _STAMP.unpack(cur.key()[:8])[0] if cur.last() else 0
        except BaseException as exc:
            if hasattr(self, "env"):
                self.env.close()
            self._dir_lock.release()
            if isinstance(exc, lmdb.Error):
                raise open_failed(self.path, exc) from exc
            raise
        self._stamp_lock = threading.Lock()
        self._map_bytes = int(self.env.info()["map_size"])  # changed only by ``_grow``
        # room past a file a larger budget left: deletes take fresh pages first (copy-on-write)
        room = 0 if max_map_bytes else _MIN_MAP
        self.max_map_bytes = max(self.max_map_bytes, self._map_bytes + room)
        self._closed = False
        self._file_id = self._data_file()  # the file opened; see ``healthy``
        self._fit_budget()

    def _fit_budget(self) -> None:
        """At open: evict the oldest entries of a tier holding more than ``capacity_bytes``
        (left by a larger budget), in one write transaction, so writes fit again."""
        with self._read() as txn:
            used = self._used(txn)
        if used <= self.capacity_bytes:
            return
        log.warning("disk tier %s: holds %d bytes, over its %d-byte budget; evicting its "
                    "oldest entries", self.path, used, self.capacity_bytes)
        try:
            self.counters.add("evictions", self._write(lambda txn: self._evict(txn, set()), 0))
        except (TooLarge, PartlyUnavailable) as exc:  # the tier opens; its writes may fail
            log.warning("disk tier %s: eviction down to its budget failed: %s", self.path, exc)

    # -- helpers --------------------------------------------------------------------------------

    def _next_stamp(self) -> int:
        with self._stamp_lock:
            self._stamp += 1
            return self._stamp

    @staticmethod
    def _live(meta: bytes | memoryview | None, now: float) -> tuple[int, float, int] | None:
        if meta is None:
            return None
        size, expiry, stamp, _ = _unmeta(meta)
        if expiry and expiry <= now:
            return None
        return size, expiry, stamp

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        self._check_open()
        self._rw.acquire_shared()
        try:
            with self.env.begin() as txn:
                yield txn
        except lmdb.Error as exc:
            raise read_failed(exc) from exc
        finally:
            self._rw.release_shared()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("disk tier is closed")

    def _data_file(self) -> tuple[int, int] | None:
        return file_id(self.path / "data.mdb")

    def _check_file(self) -> None:
        """Raise ``TierUnavailable`` where the data file this tier opened is no longer at its
        path (its directory was removed, or the file replaced): what is written now goes to a
        file no restart opens, so it must not be acknowledged."""
        if self._data_file() != self._file_id:
            raise TierUnavailable(f"disk tier: its data file {self.path / 'data.mdb'} was "
                                  "removed or replaced while open; entries written now would be "
                                  "lost at restart (restart the server)")

    def _truncated(self) -> str:
        """Why the data file is shorter than the pages LMDB has in use (reading one past its
        end is a SIGBUS: see the module docstring); "" where it is not."""
        try:
            size = os.stat(self.path / "data.mdb").st_size
        except OSError:
            return ""  # no file at the path: ``_check_file``'s case
        need = (int(self.env.info()["last_pgno"]) + 1) * int(self.env.stat()["psize"])
        if size >= need:
            return ""
        return (f"its data file {self.path / 'data.mdb'} holds {size} bytes, but its pages "
                f"reach {need}: the file was truncated")

    def healthy(self) -> bool:
        """Whether it serves reads: open, a read transaction works, its data file is still
        the one opened (see ``_check_file``: the probe marks the tier down, and DISK stores
        fail, once its directory is deleted) and not cut short (``_truncated``). A disk too
        full to write is no reason."""
        if self._closed or self._data_file() != self._file_id:
            return False
        if self._truncated():
            return False
        try:
            with self._read() as txn:
                self._used(txn)
        except lmdb.Error:
            return False
        return True

    # -- reads (hot paths: no generator context managers) ---------------------------------------

    def _meta(self, key: bytes) -> tuple[int, float] | None:
        """(value size, expiry) of a live entry, or None."""
        self._check_open()
        self._rw.acquire_shared()
        try:
            with self.env.begin(db=self.meta, buffers=True) as txn:
                raw = txn.get(key)
                if raw is None:
                    return None
                size, expiry, _, _ = _unmeta(raw)
        except lmdb.Error as exc:
            raise read_failed(exc) from exc
        finally:
            self._rw.release_shared()
        if expiry and expiry <= time.time():
            return None
        return size, expiry

    def contains(self, key: bytes) -> bool:
        return self._meta(key) is not None

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        now = time.time()
        with self._read() as txn:
            return [self._live(txn.get(k, db=self.meta), now) is not None for k in keys]

    def get(self, key: bytes) -> bytes | None:
        self._check_open()
        expired = False
        value: bytes | None = None
        self._rw.acquire_shared()
        try:
            with self.env.begin(db=self.meta, buffers=True) as txn:
                raw = txn.get(key)
                if raw is not None:
                    size, expiry, _, _ = _unmeta(raw)
                    if expiry and expiry <= time.time():
                        expired = True
                    else:
                        value = self._value(txn, key, size)
        except lmdb.Error as exc:
            raise read_failed(exc) from exc
        finally:
            self._rw.release_shared()
        if value is None:
            self.counters.add("misses")
            if expired:
                self._write(lambda txn: self._remove_expired(txn, key), 0)
            return None
        self.counters.add("hits")
        if len(self._touched) < _MAX_TOUCHED:
            self._touched[key] = None  # dict assignment is atomic under the GIL
        return value

    def _value(self, txn: lmdb.Transaction, key: bytes, size: int) -> bytes | None:
        """The stored value of ``key`` (``size`` bytes), joined from its records if split."""
        first = txn.get(key, db=self.entries)
        if first is None or len(first) == size:
            return None if first is None else bytes(first)
        out = bytearray(size)  # one copy: a split value is big
        view, at, i = memoryview(out), 0, 0
        part: memoryview | bytes | None = first
        while part is not None and at + len(part) <= size:
            view[at:at + len(part)] = part
            at, i = at + len(part), i + 1
            part = txn.get(_part_key(key, i), db=self.entries) if at < size else None
        if at != size:
            raise Corrupt(f"disk entry {key!r}: its parts hold {at} of {size} bytes")
        return memoryview(out).toreadonly()  # type: ignore[return-value]  # a bytes-like view

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def size_of(self, key: bytes) -> int | None:
        m = self._meta(key)
        return None if m is None else m[0]

    def size_many(self, keys: list[bytes]) -> list[int | None]:
        now = time.time()
        with self._read() as txn:
            lives = [self._live(txn.get(k, db=self.meta), now) for k in keys]
        return [None if m is None else m[0] for m in lives]

    def written_at(self, key: bytes) -> float | None:
        now = time.time()
        with self._read() as txn:
            raw = txn.get(key, db=self.meta)
            if raw is None or self._live(raw, now) is None:
                return None
            written = _unmeta(raw)[3]
        return written or None

    def ttl_remaining(self, key: bytes) -> float | None:
        m = self._meta(key)
        if m is None:
            return 0.0  # absent, or expired (``Tier.ttl_remaining``)
        return None if not m[1] else max(0.0, m[1] - time.time())

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        out = []
        now = time.time()
        with self._read() as txn:
            cur = txn.cursor(db=self.meta)
            if cur.set_range(prefix):
                for k, m in cur:
                    key = bytes(k)
                    if not key.startswith(prefix):
                        break
                    if self._live(m, now) is not None:
                        out.append(key)
        return iter(out)

    def sweep_expired(self) -> tuple[int, int]:
        """Expired entries are in no listing (``keys``) and have no size: found in the meta
        table, and removed in one write where they are still expired then."""
        now = time.time()
        with self._read() as txn:
            expired = [(bytes(k), _unmeta(m)[0]) for k, m in txn.cursor(db=self.meta)
                       if self._live(m, now) is None]
        freed = [0]

        def remove(txn: lmdb.Transaction) -> int:
            gone = [(k, n) for k, n in expired if self._remove_expired(txn, k)]
            freed[0] = sum(len(k) + n for k, n in gone)
            return len(gone)

        return (self._write(remove, 0), freed[0]) if expired else (0, 0)

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, value)], ttl_s=ttl_s)

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, ttl_s: float | None = None) -> None:
        batch = list(items)
        need = sum(len(k) + len(v) for k, v in batch)
        if need > self.capacity_bytes:
            raise TooLarge(f"{need} bytes exceed the disk tier's {self.capacity_bytes}-byte budget")
        expiry = time.time() + ttl_s if ttl_s else 0.0
        evicted = self._write(lambda txn: self._put_txn(txn, batch, expiry), need)
        self.counters.add("evictions", evicted)  # once committed (a group's body may run twice)

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) > 0

    def delete_many(self, keys: list[bytes]) -> int:
        return self._write(lambda txn: sum(self._remove(txn, k) for k in keys), 0)

    def flush_access(self) -> None:
        """Write the access stamps recorded by reads since the last write transaction."""
        self._write(lambda txn: None, 0)

    def _write(self, body: Callable[[lmdb.Transaction], int | None], need: int) -> int:
        """Run ``body`` in a write transaction, maybe shared (``kdn.store.lmdbgroup``); its
        result once committed to the file a restart opens (``_check_file``)."""
        self._check_open()
        try:
            done = self._group.submit(body, need)
        except lmdb.Error as exc:  # the disk full, an I/O error: see the module docstring
            raise PartlyUnavailable(f"disk tier write failed: {exc} "
                                    f"({describe(self.path, need)})") from exc
        self._check_file()  # moved since ``_transact`` checked: in a file no restart opens
        return done

    def _transact(self, run: Run, need: int, quiet: bool = False) -> None:
        """``run`` in one committed write transaction, retried in a grown map where it was full
        (by a group's leader, one at a time: ``kdn.store.lmdbgroup``; ``quiet``: see ``_grow``)."""
        while True:
            self._rw.acquire_shared()
            seen = self._map_bytes  # fixed while the lock is shared
            try:
                self._check_open()
                with self.env.begin(write=True) as txn:
                    self._apply_touches(txn)
                    run(self.env, txn)
                    self._check_file()  # raised: rolled back (the module docstring)
                return
            except lmdb.MapFullError:
                pass
            finally:
                self._rw.release_shared()
            self._grow(seen, need, quiet)

    def _apply_touches(self, txn: lmdb.Transaction) -> None:
        with self._touch_lock:
            touched, self._touched = self._touched, {}
        touched = dict(touched)  # a reader may still be adding to the old dict
        for k in touched:
            meta = txn.get(k, db=self.meta)
            if meta is None:
                continue
            size, expiry, stamp, written = _unmeta(meta)
            new = self._next_stamp()
            txn.delete(_STAMP.pack(stamp) + k, db=self.lru)
            txn.put(_STAMP.pack(new) + k, b"", db=self.lru)
            txn.put(k, _META.pack(size, expiry, new, written), db=self.meta)

    def _used(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_USED, db=self.info)
        return 0 if raw is None else int.from_bytes(raw, "little")

    def _remove(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Delete ``key`` in ``txn``; 1 if it was there. Keeps ``used`` exact."""
        meta = txn.get(key, db=self.meta)
        if meta is None:
            return 0
        size, _, stamp, _ = _unmeta(meta)
        txn.delete(key, db=self.meta)
        txn.delete(key, db=self.entries)
        for i in range(1, -(-size // self.part_bytes)):  # a split value's other records
            txn.delete(_part_key(key, i), db=self.entries)
        txn.delete(_STAMP.pack(stamp) + key, db=self.lru)
        txn.put(_USED, (self._used(txn) - len(key) - size).to_bytes(8, "little"), db=self.info)
        return 1

    def _remove_expired(self, txn: lmdb.Transaction, key: bytes) -> int:
        """``_remove`` of ``key`` where it is still expired in ``txn`` (a put may have come
        in since a read found it expired: that entry stays)."""
        meta = txn.get(key, db=self.meta)
        if meta is None or self._live(meta, time.time()) is not None:
            return 0
        return self._remove(txn, key)

    def _put_txn(self, txn: lmdb.Transaction, batch: list[tuple[bytes, bytes]],
                 expiry: float) -> int:
        now = time.time()
        for k, v in batch:
            self._remove(txn, k)
            stamp = self._next_stamp()
            if len(v) <= self.part_bytes:
                txn.put(k, v, db=self.entries)
            else:
                view = memoryview(v)
                for i, at in enumerate(range(0, len(v), self.part_bytes)):
                    txn.put(_part_key(k, i) if i else k, view[at:at + self.part_bytes],
                            db=self.entries)
            txn.put(k, _META.pack(len(v), expiry, stamp, now), db=self.meta)
            txn.put(_STAMP.pack(stamp) + k, b"", db=self.lru)
            used = self._used(txn) + len(k) + len(v)
            txn.put(_USED, used.to_bytes(8, "little"), db=self.info)
        return self._evict(txn, {k for k, _ in batch}) if self._used(txn) > self.capacity_bytes \
            else 0

    def _evict(self, txn: lmdb.Transaction, keep: set[bytes]) -> int:
        """Remove the oldest entries, unprotected or expired, until ``used`` fits; how many."""
        used, now = self._used(txn), time.time()
        victims: list[bytes] = []
        cur = txn.cursor(db=self.lru)
        for lk in cur.iternext(keys=True, values=False):
            if used <= self.capacity_bytes:
                break
            key = bytes(lk[8:])
            meta = txn.get(key, db=self.meta)
            if key in keep or self.protected(key) and self._live(meta, now) is not None:
                continue
            if meta is not None:
                used -= len(key) + _unmeta(meta)[0]
                victims.append(key)
        if used > self.capacity_bytes:
            raise TooLarge(f"disk tier is full of pinned entries ({used} of "
                           f"{self.capacity_bytes} bytes); unpin or raise disk_bytes")
        for key in victims:
            self._remove(txn, key)
        return len(victims)

    def _grow(self, seen: int, need: int, quiet: bool) -> None:
        """Grow the map a write of ``need`` bytes found full at ``seen`` bytes (unless another
        writer did); ``TooLarge`` at ``max_map_bytes``, reported unless ``quiet``."""
        with self._rw.exclusive():
            self._check_open()
            size = self._map_bytes
            if size != seen:
                return
            new = min(self.max_map_bytes, max(size * 2, size + 2 * need))
            with self.env.begin(db=self.info) as txn:
                used = self._used(txn)
            if new <= size:
                if not quiet:  # (a group's try: each of its writes is run again, alone)
                    self.on_event("map_full", 1)
                    log.warning("disk tier %s: map full at its %d-byte maximum with %d of %d "
                                "bytes stored; a write of %d bytes refused", self.path, size,
                                used, self.capacity_bytes, need)
                raise TooLarge(f"disk tier map is at its {self.max_map_bytes}-byte maximum: "
                               f"{used} bytes stored of a {self.capacity_bytes}-byte budget, "
                               f"a write of {need} bytes does not fit")
            self.env.set_mapsize(new)
            self._map_bytes = int(self.env.info()["map_size"])
            self.on_event("map_grown", 1)
            log.info("disk tier %s: map grown from %d to %d bytes (%d of %d bytes stored)",
                     self.path, size, self._map_bytes, used, self.capacity_bytes)

    # -- admin ----------------------------------------------------------------------------------

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush_access()
        finally:
            self._closed = True
            with self._rw.exclusive():
                self.env.close()
            self._dir_lock.release()

    def stats(self) -> TierStats:
        with self._read() as txn:
            entries = txn.stat(self.meta)["entries"]
            used = self._used(txn)
        c = self.counters
        return TierStats(self.name, entries, used, self.capacity_bytes, c.hits, c.misses,
                         c.evictions, c.corrupt)
