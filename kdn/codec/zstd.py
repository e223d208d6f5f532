"""zstd decompression of untrusted bytes, bounded by what the caller expects.

python-zstandard's ``decompress(data, max_output_size=n)`` honours ``n`` only for frames that do
not declare their content size; a frame that declares one gets a buffer of that size, whatever
``n`` is (a 20-byte frame declaring 2**45 bytes raises MemoryError, one declaring 16 GiB
reserves it). Bodies and entropy tables are checksummed, but a checksum says who wrote the
bytes, not that they are sane, so the declared size is checked first.
"""

from __future__ import annotations

import zstandard

from kdn.errors import Corrupt


def decompress(data: bytes | memoryview, limit: int, where: str) -> bytes:
    """The single zstd frame ``data`` decompressed, at most ``limit`` bytes; Corrupt if it
    declares more or does not decode."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared > limit:
            raise Corrupt(f"{where}: zstd frame declares {declared} bytes, at most {limit} "
                          "expected")
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise Corrupt(f"{where}: zstd data does not decode: {exc}") from exc
