"""The export file of ``kdn admin export`` / ``import``: verified entries, one record each, read
and written as a stream (one record in memory at a time, however large the file).

Format 4 (written now)::

    file    = b"KDNX4\\n" filter record* end
    filter  = u16 len(tenant) | tenant | u16 len(namespace) | namespace
              | u16 len(key_prefix) | key_prefix | u16 len(source) | source | u64 xxh3_64
    record  = u16 len(tenant) | tenant | u16 len(namespace) | namespace | u16 len(key) | key
              | u16 len(cursor) | cursor | u64 expires_ms | u8 pinned | u64 len(value) | value
              | u64 xxh3_64 of everything before it in the record
    end     = u16 0xFFFF | u64 records | u64 xxh3_64 of the ten bytes before it

A record's tenant is the entry's ("" the unscoped key space of a server without tenants), so an
admin's backup of a server with tenants restores each entry to its tenant; the filter's tenant
is the one an admin's export was narrowed to ("" every tenant the caller sees). ``source`` is
the server's address as the exporting client was given it: the cursors of a file belong to that
server's listing. ``expires_ms``: when the entry expires (unix milliseconds, 0 never); ``pinned``
1 for a pinned entry. Formats 3 (``KDNX3``), 2 and 1 are read only: format 3 is format 4 without
the source, expiries and pins, format 2 is format 3 without the tenants, format 1 is format 2
without the filter and the end marker; their records, tenant "", are imported into the
importer's tenant.

Lifecycle: ``ExportWriter.open`` starts a file, or resumes one: a file written with other
filters, or from another server, is refused (its cursor belongs to another listing; a server
restarted at the same address resumes it), a finished one (with its end marker) is left as it
is (made read-only too; an unfinished read-only one is refused), a torn last record is cut
off and the export goes on after the last complete record's cursor; ``finish`` writes the end
marker; ``abandon`` undoes the start of a file no record went into (an export refused:
the file it made is removed). A new file is made mode 0600; a file of another user's
(its owner could read every tenant's entries) is refused. ``scan`` reads a file for import and
raises ``Corrupt`` on a foreign file, a bad checksum, or a format-2 file without its end marker
(an export that did not finish: cut off, or still running): never a silent partial import.

One writer: ``open`` holds an ``flock`` on a regular file until ``close``; a second export into
it meanwhile (a run still going, overlapping crons) is refused (each wrote at its own offset).
``finish`` fsyncs the file and its folder, so an export reported done survives a power loss.
A target that is not a regular file (``/dev/stdout``, a pipe) is opened to write only: a
writer that is also a reader of its own pipe never has EPIPE once its reader leaves, and
blocks for good once the pipe is full (``BrokenPipeError`` now: ``kdn admin export`` exits 1).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

from kdn.errors import Corrupt, InvalidArgument

MAGIC_V1 = b"KDNX1\n"
MAGIC_V2 = b"KDNX2\n"
MAGIC_V3 = b"KDNX3\n"
MAGIC = b"KDNX4\n"
VERSION = 4
_MAGICS = {MAGIC_V1: 1, MAGIC_V2: 2, MAGIC_V3: 3, MAGIC: VERSION}
_H = struct.Struct("<H")
_Q = struct.Struct("<Q")
_META = struct.Struct("<QB")  # a format 4 record's expires_ms, pinned
_END = 0xFFFF  # never a tenant's or namespace's length (at most 32 and 64 bytes)


@dataclass(frozen=True)
class Record:
    namespace: str
    key: bytes
    cursor: bytes
    value: bytes
    tenant: str = ""
    """The entry's tenant ("": none recorded, or the unscoped key space)."""
    expires_at: float = 0.0
    """Unix seconds the entry expires at (0: never, or not recorded)."""
    pinned: bool = False


@dataclass(frozen=True)
class Filter:
    """What an export selected: ``namespace`` ("" all), ``key_prefix`` (b"" all) and
    ``tenant`` ("" every tenant the caller sees)."""

    namespace: str = ""
    key_prefix: bytes = b""
    tenant: str = ""

    def describe(self) -> str:
        ns = repr(self.namespace) if self.namespace else "every namespace"
        return ns + (f", key prefix {self.key_prefix.hex()}" if self.key_prefix else "") + \
            (f", tenant {self.tenant!r}" if self.tenant else "")


def _fields(*values: bytes, fixed: bytes = b"", value: bytes | None = None) -> bytes:
    """``values`` each after its u16 length, ``fixed``, then ``value`` after its u64 length (a
    record's), then the xxh3_64 of it all."""
    body = b"".join(_H.pack(len(v)) + v for v in values) + fixed
    if value is not None:
        body += _Q.pack(len(value)) + value
    return body + _Q.pack(xxhash.xxh3_64_intdigest(body))


def encode_record(r: Record, version: int = VERSION) -> bytes:
    """``r`` as a record of a file of format ``version`` (an older one drops the expiry and
    pin, then the tenant)."""
    tenant = (r.tenant.encode(),) if version >= 3 else ()
    meta = _META.pack(max(0, round(r.expires_at * 1000)), r.pinned) if version >= 4 else b""
    return _fields(*tenant, r.namespace.encode(), r.key, r.cursor, fixed=meta, value=r.value)


def encode_filter(f: Filter, version: int = VERSION, source: str = "") -> bytes:
    """``f`` (and the ``source`` server) as the header of a file of format ``version``
    (format 3's has no source, format 2's no tenant)."""
    tenant = (f.tenant.encode(),) if version >= 3 else ()
    src = (source.encode(),) if version >= 4 else ()
    return _fields(*tenant, f.namespace.encode(), f.key_prefix, *src)


def encode_end(records: int) -> bytes:
    body = _H.pack(_END) + _Q.pack(records)
    return body + _Q.pack(xxhash.xxh3_64_intdigest(body))


class _Torn(Exception):
    """The file ends inside a record (or a filter / end marker)."""


def _take(f: BinaryIO, n: int, parts: list[bytes]) -> bytes:
    if n > _left(f):  # a length no file this size can hold: never read (nor allocated)
        raise _Torn
    data = f.read(n)
    if len(data) != n:
        raise _Torn
    parts.append(data)
    return data


def _left(f: BinaryIO) -> int:
    """Bytes of ``f`` after its position."""
    try:
        end = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        at = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(at)
    return end - f.tell()


def _field(f: BinaryIO, size: struct.Struct, parts: list[bytes]) -> bytes:
    (n,) = size.unpack(_take(f, size.size, parts))
    return _take(f, n, parts)


@dataclass
class Scan:
    """What reading a file found: its format, filter, records, where the last complete record
    ends (``good``), whether it ends with its end marker and whether a torn record follows."""

    version: int
    filter: Filter | None
    source: str = ""
    """The server the file was exported from (format 4; "" not recorded)."""
    records: int = 0
    good: int = 0
    last_cursor: bytes = b""
    ended: bool = False
    torn: bool = False


def _records(path: Path, f: BinaryIO, scan: Scan) -> Iterator[Record]:
    while True:
        start = f.tell()
        parts: list[bytes] = []
        try:
            head = _take(f, _H.size, parts)
        except _Torn:
            if f.tell() != start:  # one byte of a length field
                scan.torn = True
            return
        if scan.version >= 2 and _H.unpack(head)[0] == _END:
            try:
                count = _take(f, _Q.size, parts)
                (want,) = _Q.unpack(_take(f, _Q.size, []))
            except _Torn:
                scan.torn = True
                return
            if xxhash.xxh3_64_intdigest(b"".join(parts)) != want or \
                    _Q.unpack(count)[0] != scan.records or f.read(1):
                raise Corrupt(f"{path}: the end marker at byte {start} does not match the "
                              f"{scan.records} records before it")
            scan.ended = True
            return
        try:
            f.seek(start)
            parts = []
            tenant = _field(f, _H, parts) if scan.version >= 3 else b""
            ns = _field(f, _H, parts)
            key = _field(f, _H, parts)
            cursor = _field(f, _H, parts)
            meta = _take(f, _META.size, parts) if scan.version >= 4 else _META.pack(0, 0)
            value = _field(f, _Q, parts)
            (want,) = _Q.unpack(_take(f, _Q.size, []))
        except _Torn:
            scan.torn = True
            return
        if xxhash.xxh3_64_intdigest(b"".join(parts)) != want:
            raise Corrupt(f"{path}: record {scan.records} (at byte {start}) fails its checksum")
        names = []
        for what, raw in (("namespace", ns), ("tenant", tenant)):
            try:
                names.append(raw.decode())
            except UnicodeDecodeError:
                raise InvalidArgument(f"{path}: record {scan.records}: the {what} is not "
                                      "UTF-8") from None
        scan.records += 1
        scan.good = f.tell()
        scan.last_cursor = cursor
        expires_ms, pinned = _META.unpack(meta)
        yield Record(names[0], key, cursor, value, names[1], expires_ms / 1000, bool(pinned))


def _open_scan(path: Path, f: BinaryIO) -> Scan:
    version = _MAGICS.get(f.read(len(MAGIC)))
    if version is None:
        raise Corrupt(f"{path} is not a kdn export file (it does not start with {MAGIC!r})")
    if version == 1:
        return Scan(version=1, filter=None, good=len(MAGIC))
    parts: list[bytes] = []
    try:
        tenant = _field(f, _H, parts) if version >= 3 else b""
        ns = _field(f, _H, parts)
        prefix = _field(f, _H, parts)
        source = _field(f, _H, parts) if version >= 4 else b""
        (want,) = _Q.unpack(_take(f, _Q.size, []))
    except _Torn:
        raise Corrupt(f"{path}: the export file is cut off in its header") from None
    if xxhash.xxh3_64_intdigest(b"".join(parts)) != want:
        raise Corrupt(f"{path}: the export file's header fails its checksum")
    return Scan(version=version, good=f.tell(), source=source.decode(errors="replace"),
                filter=Filter(ns.decode(errors="replace"), prefix,
                              tenant.decode(errors="replace")))


def scan(path: Path, *, complete: bool = True) -> Iterator[tuple[Scan, Record]]:
    """Every record of ``path`` with the scan so far. With ``complete`` (import) a file that
    does not end as a finished export does raises ``Corrupt`` after its last record."""
    path = Path(path)
    with open(path, "rb") as f:
        s = _open_scan(path, f)
        for rec in _records(path, f, s):
            yield s, rec
    if complete and s.torn:
        raise Corrupt(f"{path} is cut off inside record {s.records} (byte {s.good}): the export "
                      "that wrote it did not finish; run it again to resume, then import")
    if complete and s.version >= 2 and not s.ended:
        raise Corrupt(f"{path} ends after record {s.records} without its end marker: the "
                      "export that wrote it did not finish; run it again to resume, then import")


def summary(path: Path) -> Scan:
    """Read the whole file (one record at a time) without raising for an unfinished one."""
    path = Path(path)
    with open(path, "rb") as f:
        return _summary(path, f)


def _summary(path: Path, f: BinaryIO) -> Scan:
    f.seek(0)
    s = _open_scan(path, f)
    for _ in _records(path, f, s):
        pass
    return s


def _open_own(path: Path) -> tuple[BinaryIO, bool]:
    """``path`` opened to read and write: made (mode 0600) where nothing is there, else a
    regular file of this user's, or another kind (``/dev/stdout``, a pipe, ``/dev/null``: to
    write only) of this user's or root's. Another user's file (made there first: it stays
    readable by its owner whatever mode kdn gives it) is refused before anything is written
    or cut off; a link is followed only to what is there (never made through one). A regular
    file this user may not write (made read-only to keep it: a finished export) is opened to
    read only, not through a link: ``ExportWriter.open`` refuses it where it must be written.
    Also whether this call made it."""
    writable, made = True, True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        made = False
        try:  # a pipe to write only (the module docstring)
            flags = os.O_RDWR if stat.S_ISREG(os.stat(path).st_mode) else os.O_WRONLY
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:  # a link to nothing
            raise InvalidArgument(f"{path} is a link to nothing; export into a file of your "
                                  "own") from None
        except PermissionError as denied:
            fd, writable = _open_to_read(path, denied), False
    st = os.fstat(fd)
    regular = stat.S_ISREG(st.st_mode)
    if st.st_uid != os.geteuid() and (regular or st.st_uid != 0):
        os.close(fd)
        raise InvalidArgument(f"{path} is owned by uid {st.st_uid}, not by this user (uid "
                              f"{os.geteuid()}): an export may hold every tenant's entries; "
                              "export into a new file")
    return os.fdopen(fd, "rb" if not writable else "r+b" if regular else "wb"), made


def _open_to_read(path: Path, denied: PermissionError) -> int:
    """``path``, a regular file, opened to read only (never through a link, without blocking
    on a pipe); else ``denied`` raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC |
                     os.O_NOCTTY)
    except OSError:
        raise denied from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise denied
    return fd


def _lock(path: Path, f: BinaryIO) -> None:
    """Hold the flock of ``f`` (``path``, a regular file) until it is closed; InvalidArgument
    where another export holds it, or removed the file meanwhile (it abandoned it)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidArgument(f"another export is writing {path}; let it finish, or export "
                              "into a new file") from None
    try:
        there = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        there = False
    if not there:
        raise InvalidArgument(f"{path} was removed by another export as this one opened it; "
                              "run this one again")


def _sync_folder(folder: Path) -> None:
    """fsync ``folder``, so that a file made in it is there after a power loss (a filesystem
    that can not, or a folder this user may not open, is left as it is)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def read_records(path: Path) -> tuple[list[Record], int]:
    """Complete records of a (small) export file and the byte length they cover."""
    s = summary(path)
    return [r for _, r in scan(path, complete=False)], s.good


class ExportWriter:
    """Appends records to an export file; ``open`` starts or resumes it for ``filt`` and the
    ``source`` server (its address as the client was given it)."""

    def __init__(self, path: Path, f: BinaryIO | None, records: int, after: bytes,
                 began: str = "") -> None:
        self.path, self._f = path, f
        self.records = records  # in the file, the resumed ones included
        self.after = after      # the cursor to list after (b"": from the start)
        self.complete = f is None  # the file holds a finished export: nothing to add
        self.began = began
        """How ``open`` began a new file, which ``abandon`` undoes: "made" (it was not
        there), "emptied" (it was an empty file), "" (a resumed or finished one, or not a
        regular file)."""

    @classmethod
    def open(cls, path: Path, filt: Filter, source: str = "") -> ExportWriter:
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory", str(path))
        f, made = _open_own(path)
        try:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # /dev/stdout, a pipe
                f.write(MAGIC + encode_filter(filt, source=source))
                return cls(path, f, 0, b"")
            _lock(path, f)
            if not f.writable() and (os.fstat(f.fileno()).st_size == 0 or
                                     not _summary(path, f).ended):
                raise InvalidArgument(f"{path} is read-only and holds no finished export: "
                                      "make it writable (chmod u+w) to resume it, or export "
                                      "into a new file")
            if os.fstat(f.fileno()).st_size == 0:
                os.fchmod(f.fileno(), 0o600)  # private to its writer, as the disk tier is
                f.write(MAGIC + encode_filter(filt, source=source))
                return cls(path, f, 0, b"", "made" if made else "emptied")
            s = _summary(path, f)
            if s.version != VERSION:
                raise InvalidArgument(f"{path} was written by an older kdn (format "
                                      f"{s.version}) and can not be resumed; export into a "
                                      "new file")
            if s.filter != filt:
                assert s.filter is not None
                raise InvalidArgument(f"{path} is an export of {s.filter.describe()}, not of "
                                      f"{filt.describe()}; pass the same --namespace/--prefix/"
                                      "--tenant to resume it, or export into a new file")
            if s.source != source:  # its cursor is in another server's listing
                raise InvalidArgument(f"{path} is an export of the server at {s.source!r}, "
                                      f"not {source!r}; resume it with that --address, or "
                                      "export into a new file")
        except BaseException:
            f.close()
            raise
        if s.ended:  # finished: left as it is (a new export goes into a new file)
            f.close()
            return cls(path, None, s.records, s.last_cursor)
        os.fchmod(f.fileno(), 0o600)  # whatever mode it was given since
        f.truncate(s.good)  # a torn record goes; the export goes on after the last one
        f.seek(s.good)
        return cls(path, f, s.records, s.last_cursor)

    def write(self, rec: Record) -> None:
        assert self._f is not None
        self._f.write(encode_record(rec))
        self.records += 1

    def finish(self) -> None:
        assert self._f is not None
        self._f.write(encode_end(self.records))
        self._f.flush()
        if stat.S_ISREG(os.fstat(self._f.fileno()).st_mode):  # done only once it is durable
            os.fsync(self._f.fileno())
            _sync_folder(self.path.parent)

    def abandon(self) -> None:
        """Undo the start of a file that no record was written to (the export was refused,
        or failed before its first entry): the file ``open`` made is removed, an empty one
        it began is emptied again, so that no header of these filters is left in the way of
        the next export. Anything else is kept (resumed later)."""
        if self._f is None or not self.began or self.records:
            return
        if self.began == "made":
            self.path.unlink(missing_ok=True)
        else:
            self._f.truncate(0)
        self._f.close()
        self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
