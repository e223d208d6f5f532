"""Client segments and data path tickets: what a same-host or remote batch call names.

Lifecycle of a segment: the client creates a memfd named ``kdn-client`` sealed against
shrinking, growing and more seals (``F_SEAL_SHRINK``: the server's mapping never faults), writes
16 random bytes at its start, and calls ``Attach(pid, fd, size, nonce)``. The server opens
``/proc/<pid>/fd/<fd>``, checks the name, the seals, the size and the nonce, maps it, and
returns a random ``segment_id`` bound to the calling tenant. ``GetMany``/``PutMany`` name the
segment and a region in it; ``Detach`` (or server shutdown) unmaps it, and so does ``reap``
once its client exited without one (when a fast-path connection of it closes, or at an
``Attach``). A server that can not open the segment (another host, another container, no
permission) answers FAILED_PRECONDITION and the client keeps using gRPC.

What is trusted: pid, fd and nonce are the caller's word, and the server opens the descriptor
with its own rights (often more than the caller's: root, or kdn's user). So it opens only a
regular memfd of the client's name and seals (``open_client_memfd``; never a device, a pipe or
another file: O_NOCTTY and O_NONBLOCK besides), and maps it only when its first bytes are the
nonce. Another process's memfd passes only if it took the client's name and seals and the caller
knows its first 16 bytes: kdn's client writes random ones there.

Tenancy: a segment is looked up by (tenant, segment_id); another tenant's id is NOT_FOUND. The
server writes a tenant's entries only into that tenant's segments and reads stores only from
them, so no descriptor can make it copy one tenant's bytes to another.

A client on another host gets a ticket instead (``Attach`` with ``remote``): 128 random bits
that name the caller on the network data path (``kdn.server.netpath``), as a segment id does.
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdn.errors import InvalidArgument, KDNError, NotFound, Status, TooLarge
from kdn.server.arena import Slot, next_lease
from kdn.server.auth import Principal
from kdn.v1 import kdn_pb2 as pb

NONCE_BYTES = 16
MAX_SEGMENTS_PER_TENANT = 256
MAX_TICKETS_PER_TENANT = 4096
"""Network data path tickets a tenant holds at most (``Segments.ticket``)."""
MAX_SEGMENT_BYTES = 64 << 30
CLIENT_MEMFD = "kdn-client"
"""The name ``kdn.client.shm.SharedSegment`` gives its memfd; Attach opens nothing else."""
CLIENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals that client sets: Attach requires them all."""


class SegmentUnavailable(KDNError):
    """The server can not map the client's segment (another host, no permission, bad seals)."""

    status = Status.FAILED_PRECONDITION


@dataclass
class Segment:
    principal: Principal
    """Who attached it: calls naming the segment act as this caller."""
    source: tuple[str, int]
    """(``/proc/<pid>/fd/<fd>``, inode) it was opened from: gone or another file once the
    client closed it or exited, and then the segment is detached (``Segments.reap``)."""
    size: int
    view: mmap.mmap
    array: np.ndarray[Any, Any] | None
    """The whole segment as uint8, for copies that release the GIL (``span``); None once
    detached."""
    leases: dict[int, Slot] = field(default_factory=dict)
    """Read-arena slots this segment's client holds, by lease number (``kdn.server.arena``)."""
    lease_lock: threading.Lock = field(default_factory=threading.Lock)
    detached: bool = False

    def span(self, start: int, stop: int) -> memoryview:
        """Its bytes [start, stop) as a view (a copy into or out of it releases the GIL; the
        mapping stays while the view does); NotFound once the segment was detached, as a call
        copying may find it."""
        array = self.array
        if array is None:
            raise NotFound("segment detached during the call")
        return memoryview(array[start:stop])  # type: ignore[arg-type]

    def hold(self, slot: Slot) -> int:
        """Record a lease on ``slot`` (already counted by its arena); its number. On a
        segment detached meanwhile the lease is given back at once."""
        n = next_lease()
        with self.lease_lock:
            if not self.detached:
                self.leases[n] = slot
                return n
        slot.arena.release(slot)
        return n

    def release(self, numbers: Any) -> int:
        """Give back the leases ``numbers`` of this segment (others' and unknown ones are
        ignored: a client can only release what it holds); how many were held."""
        with self.lease_lock:
            slots = [s for s in (self.leases.pop(int(n), None) for n in numbers) if s]
        for slot in slots:
            slot.arena.release(slot)
        return len(slots)

    def release_all(self) -> None:
        with self.lease_lock:
            slots, self.leases, self.detached = list(self.leases.values()), {}, True
        for slot in slots:
            slot.arena.release(slot)


class Segments:
    """Mapped client segments by id, each bound to the tenant that attached it."""

    def __init__(self) -> None:
        self._by_id: dict[str, Segment] = {}
        self._tickets: OrderedDict[str, Principal] = OrderedDict()  # the network data path's
        self._named: OrderedDict[str, None] = OrderedDict()  # tickets a connection named, the
        # least recently named first
        self.busy: Callable[[str], bool] = lambda ticket: False
        """Whether a ticket holds live data path connections (set by ``kdn.server.netpath``)."""
        self._lock = threading.Lock()

    def ticket(self, principal: Principal) -> str:
        """A ticket for the network data path (``kdn.server.netpath``): its calls act as
        ``principal``. 128 random bits handed only to the authenticated caller, as a segment
        id is. A tenant holds at most ``MAX_TICKETS_PER_TENANT`` (a client that went away
        without Detach leaves its ticket behind): past it, tickets no connection ever named go
        first, oldest first, then the least recently named; never one whose connections are
        live (``busy``). So a member of a tenant asking for tickets over and over takes back
        its own, not the ones its tenant's working clients use; TooLarge where every one is
        in use."""
        tid = secrets.token_hex(16)
        tenant = principal.tenant
        with self._lock:
            mine = [t for t, p in self._tickets.items() if p.tenant == tenant]
            over = len(mine) + 1 - MAX_TICKETS_PER_TENANT
            if over > 0:
                named = set(self._named)
                order = [t for t in mine if t not in named] + [
                    t for t in self._named if self._tickets[t].tenant == tenant]
                gone = [t for t in order if not self.busy(t)][:over]
                if len(gone) < over:
                    raise TooLarge(f"tenant holds {len(mine)} data path tickets in use (at "
                                   f"most {MAX_TICKETS_PER_TENANT}); use gRPC")
                for old in gone:
                    del self._tickets[old]
                    self._named.pop(old, None)
            self._tickets[tid] = principal
        return tid

    def ticket_owner(self, tid: str) -> Principal:
        """The caller a network data path ticket acts as; NotFound for any other string."""
        with self._lock:
            principal = self._tickets.get(tid)
            if principal is not None:
                self._named[tid] = None
                self._named.move_to_end(tid)
        if principal is None:
            raise NotFound("no such data path ticket (detached, or the server restarted)")
        return principal

    def attach(self, principal: Principal, pid: int, fd: int, size: int, nonce: bytes) -> str:
        tenant = principal.tenant
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
        if not any(nonce):  # what a segment holds before its client writes its nonce
            raise InvalidArgument("a nonce of zeros names no segment")
        if not NONCE_BYTES < size <= MAX_SEGMENT_BYTES:
            raise InvalidArgument(f"segment size {size} outside ({NONCE_BYTES}, "
                                  f"{MAX_SEGMENT_BYTES}]")
        self.reap()
        with self._lock:
            mine = sum(1 for s in self._by_id.values() if s.principal.tenant == tenant)
        if mine >= MAX_SEGMENTS_PER_TENANT:
            raise TooLarge(f"tenant holds {mine} attached segments (at most "
                           f"{MAX_SEGMENTS_PER_TENANT}); detach one first")
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        handle = open_client_memfd(path)
        try:
            inode = os.fstat(handle).st_ino
            if os.fstat(handle).st_size != size:
                raise SegmentUnavailable(f"the segment has {os.fstat(handle).st_size} bytes, "
                                         f"the request says {size}")
            view = mmap.mmap(handle, size)
        except OSError as exc:
            raise SegmentUnavailable(f"can not map the client's segment: {exc.strerror}") \
                from None
        finally:
            os.close(handle)
        if not hmac.compare_digest(view[:NONCE_BYTES], nonce):
            view.close()
            raise SegmentUnavailable("the segment's nonce differs: not the client's segment")
        seg_id = secrets.token_hex(16)
        with self._lock:
            self._by_id[seg_id] = Segment(principal, (path, inode), size, view,
                                          np.frombuffer(view, dtype=np.uint8))
        return seg_id

    def reap(self, only: Collection[str] | None = None) -> int:
        """Detach the segments (of ids ``only``, when given) whose client exited or closed
        them without Detach; how many."""
        with self._lock:
            segs = [(i, s) for i, s in self._by_id.items() if only is None or i in only]
        gone = []
        for seg_id, seg in segs:
            path, inode = seg.source
            try:
                alive = os.stat(path).st_ino == inode
            except OSError:
                alive = False
            if not alive:
                gone.append(seg_id)
        with self._lock:
            dropped = [s for s in (self._by_id.pop(i, None) for i in gone) if s is not None]
        for seg in dropped:
            self._unmap(seg)
        return len(dropped)

    def get(self, tenant: str, seg_id: str) -> Segment:
        with self._lock:
            seg = self._by_id.get(seg_id)
        if seg is None or seg.principal.tenant != tenant:
            raise NotFound(f"no attached segment {seg_id!r}")
        return seg

    def owner(self, seg_id: str) -> Principal:
        """The caller that attached ``seg_id`` (the fast path acts as it)."""
        with self._lock:
            seg = self._by_id.get(seg_id)
        if seg is None:
            raise NotFound(f"no attached segment {seg_id!r}")
        return seg.principal

    def detach(self, tenant: str, seg_id: str) -> None:
        with self._lock:
            principal = self._tickets.get(seg_id)
            if principal is not None and principal.tenant == tenant:
                del self._tickets[seg_id]
                self._named.pop(seg_id, None)
                return
        self.get(tenant, seg_id)
        with self._lock:
            seg = self._by_id.pop(seg_id, None)
        if seg is not None:
            self._unmap(seg)

    @staticmethod
    def _unmap(seg: Segment) -> None:
        seg.release_all()  # its client is gone: its arena leases with it
        seg.array = None  # a copy still running holds a view (``span``)
        try:
            seg.view.close()
        except BufferError:  # a copy still holds a view: the mapping goes with it
            pass

    def close(self) -> None:
        with self._lock:
            segs, self._by_id = list(self._by_id.values()), {}
        for seg in segs:
            self._unmap(seg)

    def __len__(self) -> int:
        return len(self._by_id)


def _memfd_name(path: str) -> str:
    """What ``path`` (a ``/proc/.../fd/N`` link) names; SegmentUnavailable when it is not a
    memfd kdn's client made (``CLIENT_MEMFD``)."""
    try:
        target = os.readlink(path)
    except OSError as exc:
        raise SegmentUnavailable(f"can not open the client's segment: {exc.strerror}") \
            from None
    if target.removesuffix(" (deleted)") != "/memfd:" + CLIENT_MEMFD:
        raise SegmentUnavailable(f"the descriptor names {target[:100]!r}, not a kdn client "
                                 f"segment (a memfd named {CLIENT_MEMFD!r})")
    return target


def open_client_memfd(path: str) -> int:
    """``path`` (``/proc/<pid>/fd/<fd>``) opened read-write, checked to be a kdn client's
    segment (module docstring): a memfd of the client's name, a regular file, sealed as the
    client seals it (``CLIENT_SEALS``). Its name is checked before it is opened (nothing else
    is opened with the server's rights) and again on what was opened (the descriptor number
    may have been reused in between); SegmentUnavailable for anything else."""
    _memfd_name(path)
    try:
        handle = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise SegmentUnavailable(f"can not open the client's segment: {exc.strerror}") \
            from None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise SegmentUnavailable("the descriptor is not a regular file")
        _memfd_name(f"/proc/self/fd/{handle}")
        seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
        if seals & CLIENT_SEALS != CLIENT_SEALS:
            raise SegmentUnavailable("the segment is not sealed as a kdn client seals it "
                                     "(F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL)")
    except OSError as exc:
        os.close(handle)
        raise SegmentUnavailable(f"can not check the client's segment: {exc.strerror}") \
            from None
    except BaseException:
        os.close(handle)
        raise
    return handle


def region_span(seg: Segment, region: pb.Region) -> tuple[int, int]:
    """The span [start, stop) of the segment that ``region`` names; InvalidArgument when it
    reaches outside the segment (or into its nonce)."""
    start, length = int(region.offset), int(region.length)
    if start < NONCE_BYTES or start + length > seg.size:
        raise InvalidArgument(f"region [{start}, {start + length}) outside the segment's "
                              f"[{NONCE_BYTES}, {seg.size})")
    return start, start + length
