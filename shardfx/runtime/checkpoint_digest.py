"""The checksum of a checkpoint's files and the mark that ties each data file to its save, for
``runtime.checkpoint`` (which writes them) and ``runtime.checkpoint_files`` (which checks them).

A save computes each file's ``Digest`` as its bytes are written (``Digesting`` wraps DCP's
stream), ends each data file with a one-line trailer, and records every digest in
``shardfx.json``:

    __0_0.distcp   DCP's bytes, then  \\n{"shardfx_save": "3f9c0e1d2a4b", "bytes": 1048576,
                                         "digest": "9b1f..."}\\n
    shardfx.json   {"save": "3f9c0e1d2a4b", "files": {"__0_0.distcp": {"bytes": 1048576,
                                                     "digest": "9b1f..."}, ".metadata": ...}}

DCP reads a data file by the offsets in ``.metadata``, so it never reads the trailer.

Why not ``zlib.crc32`` or ``hashlib.blake2b``: DCP loads a checkpoint from the page cache at
2-3 GB/s on one core, and a load must stay within 1.1x of one that does not verify; CRC-32 runs
at ~2 GB/s on one core, BLAKE2b at ~1 (``python -m bench.checkpoint`` measures them).
``Digest`` sums each 4 KiB page's 64-bit words with numpy (~11 GB/s, reading the file through
``mmap``: no copy), then hashes the sums, 1/512 of the bytes, with BLAKE2b.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096  # bytes: Digest sums each page's words
CHUNK = 1 << 24  # bytes summed at a time when a file is checked (a multiple of PAGE)


class Digest:
    """A checksum of a byte stream, fed in pieces of any size: BLAKE2b-128 of the sum (modulo
    2**64) of each 4 KiB page's 512 little-endian 64-bit words, the last page zero-padded, and of
    the length.

    It changes when any word of a page changes, when pages move, when bytes are cut or added:
    any damage but changes that cancel within one page (two of its words swapped, equal and
    opposite changes). It guards against damage and mix-ups, not against someone forging a
    file."""

    def __init__(self) -> None:
        self.size = 0
        self._sums = hashlib.blake2b(digest_size=16)
        self._tail = bytearray()  # the start of a page not yet whole

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if self._tail:
            take = min(PAGE - len(self._tail), view.nbytes)
            self._tail += view[:take]
            view = view[take:]
            if len(self._tail) < PAGE:
                return
            self._pages(self._tail)
            self._tail = bytearray()
        whole = view.nbytes - view.nbytes % PAGE
        if whole:
            self._pages(view[:whole])
        self._tail += view[whole:]

    def _pages(self, pages) -> None:
        words = np.frombuffer(pages, "<u8").reshape(-1, PAGE // 8)
        self._sums.update(words.sum(1, dtype=np.uint64).tobytes())

    def hexdigest(self) -> str:
        out = self._sums.copy()
        if self._tail:
            last = np.frombuffer(bytes(self._tail) + bytes(PAGE - len(self._tail)), "<u8")
            out.update(last.sum(dtype=np.uint64).tobytes())
        out.update(self.size.to_bytes(8, "little"))
        return out.hexdigest()


def digest_of(path: Path, size: int) -> str:
    """The ``Digest`` of the first ``size`` bytes of the file at ``path`` (fewer if shorter),
    read through ``mmap``."""
    digest = Digest()
    with open(path, "rb") as f:
        size = min(size, os.fstat(f.fileno()).st_size)
        if size == 0:
            return digest.hexdigest()
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        for start in range(0, size, CHUNK):
            digest.update(np.frombuffer(mapped, np.uint8, min(CHUNK, size - start), start))
    finally:
        mapped.close()  # every view of it is gone: numpy's arrays die in update
    return digest.hexdigest()


def trailer(save: str, size: int, digest: str) -> bytes:
    """The line that ends a data file of save ``save`` whose DCP bytes are ``size`` long."""
    return b"\n" + json.dumps({"shardfx_save": save, "bytes": size, "digest": digest}).encode() \
        + b"\n"


def read_trailer(path: Path) -> dict[str, Any] | None:
    """A data file's trailer (``save``, ``bytes``, ``digest``), or None where its end is not one."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 256))
        end = f.read()
    start = end.rfind(b'\n{"shardfx_save": ')
    try:
        mark = json.loads(end[start + 1:]) if start >= 0 and end.endswith(b"}\n") else None
    except ValueError:
        return None
    if not isinstance(mark, dict) or trailer(mark.get("shardfx_save"), mark.get("bytes"),
                                             mark.get("digest")) != end[start:]:
        return None
    return {"save": mark["shardfx_save"], "bytes": mark["bytes"], "digest": mark["digest"]}


class Digesting:
    """A file DCP writes (what its ``FileSystem.create_stream`` yields), digested as it is
    written. ``close()`` ends a data file with its ``trailer`` and fsyncs it, then calls
    ``done(name, bytes, digest)``."""

    def __init__(self, raw, path: Path, save: str | None, done) -> None:
        self.raw, self.path, self.save, self.done = raw, path, save, done
        self.digest = Digest()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        if self.raw.closed:
            return
        size, digest = self.digest.size, self.digest.hexdigest()
        if self.save is not None:
            self.raw.write(trailer(self.save, size, digest))
            self.raw.flush()
            os.fsync(self.raw.fileno())
        self.raw.close()
        self.done(self.path.name, size, digest)
