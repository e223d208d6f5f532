"""LMDB disk tier: entries in one memory-mapped B+tree file under the data directory.

Everything the tier knows lives in the LMDB file itself (no in-memory index), so a restarted
server serves what it held. Each put is one committed write transaction: after ``put`` returns
the entry survives a crash (LMDB's copy-on-write commit), and a write interrupted by SIGKILL
leaves no partial entry. The map grows on demand, up to ``max_map_bytes``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import lmdb

from kdn.errors import TierUnavailable, TooLarge
from kdn.store.base import Tier, TierStats

_MIN_MAP = 64 << 20


class LmdbTier(Tier):
    name = "disk"

    def __init__(self, path: Path | str, *, capacity_bytes: int, sync: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.max_map_bytes = max(_MIN_MAP, int(capacity_bytes * 1.5) + _MIN_MAP)
        self._grow_lock = threading.Lock()
        try:
            self.env = lmdb.open(
                str(self.path), map_size=min(self.max_map_bytes, 1 << 30), subdir=True,
                max_dbs=4, sync=sync, metasync=sync, readahead=False, max_readers=256,
            )
        except lmdb.Error as exc:
            raise TierUnavailable(f"can not open LMDB at {self.path}: {exc}") from exc
        self.db = self.env.open_db(b"entries")

    def contains(self, key: bytes) -> bool:
        with self.env.begin(db=self.db, buffers=True) as txn:
            return txn.get(key) is not None

    def get(self, key: bytes) -> bytes | None:
        with self.env.begin(db=self.db) as txn:
            value = txn.get(key)
        self.counters.add("misses" if value is None else "hits")
        return value

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self.env.begin(db=self.db) as txn:
            return [txn.get(k) for k in keys]

    def size_of(self, key: bytes) -> int | None:
        with self.env.begin(db=self.db, buffers=True) as txn:
            value = txn.get(key)
            return None if value is None else len(value)

    def put(self, key: bytes, value: bytes, *, ttl_s: float | None = None) -> None:
        self.put_many([(key, value)], ttl_s=ttl_s)

    def put_many(self, items: Iterable[tuple[bytes, bytes]], *, ttl_s: float | None = None) -> None:
        batch = list(items)
        need = sum(len(v) for _, v in batch)
        if need > self.capacity_bytes:
            raise TooLarge(f"{need} bytes exceed the disk tier's {self.capacity_bytes}-byte budget")
        while True:
            try:
                with self.env.begin(db=self.db, write=True) as txn:
                    for k, v in batch:
                        txn.put(k, v)
                return
            except lmdb.MapFullError:
                self._grow(need)

    def _grow(self, need: int) -> None:
        with self._grow_lock:
            size = self.env.info()["map_size"]
            new = min(self.max_map_bytes, max(size * 2, size + 2 * need))
            if new <= size:
                raise TooLarge(f"disk tier map is at its {self.max_map_bytes}-byte maximum")
            self.env.set_mapsize(new)

    def delete(self, key: bytes) -> bool:
        with self.env.begin(db=self.db, write=True) as txn:
            return bool(txn.delete(key))

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        with self.env.begin(db=self.db) as txn:
            cur = txn.cursor()
            out = []
            if cur.set_range(prefix):
                for k in cur.iternext(keys=True, values=False):
                    if not k.startswith(prefix):
                        break
                    out.append(k)
        return iter(out)

    def close(self) -> None:
        self.env.close()

    def stats(self) -> TierStats:
        with self.env.begin(db=self.db) as txn:
            st = txn.stat(self.db)
        used = (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"]) * st["psize"]
        c = self.counters
        return TierStats(self.name, st["entries"], used, self.capacity_bytes, c.hits, c.misses,
                         c.evictions, c.corrupt)
