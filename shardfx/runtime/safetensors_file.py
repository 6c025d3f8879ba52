"""One safetensors file, its header checked, its tensors read by row span.

The format: 8 bytes (little-endian header length), a JSON header (name -> dtype, shape,
``data_offsets`` [begin, end) after the header; ``__metadata__``), then the tensors' bytes,
each row-major. Rows ``a:b`` of a tensor are one span of the file, so a rank's rows (ZeRO) or
the rows a tp slice sits in are one span: ``copy_rows`` reads it ``CHUNK`` bytes at a time
into one small buffer and casts each chunk into the caller's shard while it is still in the
core's cache. Nothing is mapped, so no page of the file is ever counted in the process's
memory, and the only bytes it holds are the shard and the buffer.

Why not ``safetensors.safe_open``: it maps the file, and every page a rank touches stays in
its resident memory (file-backed, yet counted in its RSS and its peak) until the map goes, so
a rank reading a quarter of a 2 GB checkpoint peaked 0.6 GB above what it holds; and its
slices of later dimensions are read row by row. A map whose pages are dropped after each
copy (``MADV_DONTNEED``) fixes the peak but was 10% slower on 4 ranks than reading: a
page fault per few pages, and the unmapping.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from shardfx.runtime.nonfinite import kinds

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E8M0": torch.float8_e8m0fnu, "C64": torch.complex64, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
          "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool}

MAX_HEADER = 100_000_000  # bytes: safetensors' own limit on the JSON header
CHUNK = 1 << 20  # bytes read at a time by copy_rows: fits in a core's cache before its cast

# What files that are not safetensors begin with, and what to do about each.
_OTHER_FILES = (
    (b"version https://git-lfs", "a Git LFS pointer, not the file it points to",
     "fetch the real file: `git lfs pull` in the clone it came from (or download it again)"),
    (b"PK\x03\x04", "a zip archive (torch.save's format), not safetensors",
     "convert it: torch.load it and write it with safetensors.torch.save_file, or "
     "save_pretrained(path) from a loaded model"),
    (b"\x80", "a Python pickle (torch.save's old format), not safetensors",
     "convert it: torch.load it and write it with safetensors.torch.save_file, or "
     "save_pretrained(path) from a loaded model"),
    (b"<", "a web page (HTML or XML), not safetensors",
     "download the file again: the server answered with a page (a login or an error) instead"),
)
DOWNLOAD_AGAIN = "the file is cut short or damaged: copy or download it again"


class Damaged(Exception):
    """The file is not a whole safetensors file: why, in words, and what to do (``fix``)."""

    def __init__(self, why: str, fix: str = DOWNLOAD_AGAIN):
        super().__init__(why)
        self.fix = fix


class SafetensorsFile:
    def __init__(self, path: Path):
        """Read and check the header as safetensors itself does (``_check``) before any tensor
        is read. Raises ``Damaged``."""
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._buf: torch.Tensor | None = None  # copy_rows' bytes, CHUNK at most
        self.nonfinite: dict[str, frozenset[str]] = {}  # name -> NaN/Inf among values read
        try:
            self.start, self.tensors = _check(self._fd)
        except Damaged:
            os.close(self._fd)
            raise

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, in its own dtype: a new tensor the file is read into."""
        dtype_name, shape, begin = self.tensors[name]
        dtype = DTYPES[dtype_name]
        out = torch.empty(shape, dtype=dtype)
        self._pread(out.view(-1).view(torch.uint8), begin)
        self._look(name, out)
        return out

    def copy_rows(self, name: str, rows: slice, out: torch.Tensor,
                  cols: tuple[slice, ...] = ()) -> None:
        """``out.copy_(tensor[rows][:, *cols])`` (rows: a slice of dim 0, step 1), cast to
        ``out``'s dtype, read ``CHUNK`` bytes at a time through one buffer (rows whole: a
        slice of later dimensions is cut in memory). Values that are not finite once cast
        (NaN, Inf: an overflow of the cast too) are noted in ``nonfinite``."""
        dtype_name, shape, begin = self.tensors[name]
        dtype = DTYPES[dtype_name]
        row = dtype.itemsize
        for n in shape[1:]:
            row *= n
        first, last, _ = rows.indices(shape[0])
        per = max(1, CHUNK // max(row, 1))
        for at in range(first, last, per):
            n = min(per, last - at)
            raw = self._buffer(n * row)
            self._pread(raw, begin + at * row)
            part = raw.view(dtype).view(n, *shape[1:])
            into = out[at - first:at - first + n]
            into.copy_(part[(slice(None), *cols)] if cols else part)
            self._look(name, into)  # while it is still in cache

    def _look(self, name: str, values: torch.Tensor) -> None:
        if found := kinds(values):
            self.nonfinite[name] = self.nonfinite.get(name, frozenset()) | found

    def _buffer(self, n: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.uint8)
        return self._buf[:n]

    def _pread(self, into: torch.Tensor, offset: int) -> None:
        """Fill the contiguous uint8 tensor ``into`` from the tensor bytes at ``offset``."""
        view = memoryview(into.numpy())
        at, done = self.start + offset, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], at + done)
            if got <= 0:
                raise Damaged(f"cut short while reading at byte {at + done}")
            done += got

    def close(self) -> None:
        self._buf = None
        os.close(self._fd)


def _check(fd: int) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int]]]:
    """The header of the file ``fd``: where the tensors' bytes start, and each tensor's dtype,
    shape and offset, once every check safetensors makes holds. The tensors' byte ranges,
    sorted, run from 0 with no gap and no overlap to the file's end (a range two tensors share
    would load one tensor's values into the other); each range is as long as its dtype and
    shape say; the dtype is one safetensors defines; the header is one JSON object without a
    repeated name, and ``__metadata__`` maps strings to strings. A file that is something else
    (a Git LFS pointer, a pickle, a web page) is named as what it is."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
    if length is None or length > MAX_HEADER or 8 + length > size or \
            not os.pread(fd, 1, 8).startswith(b"{"):
        prefix = os.pread(fd, 64, 0)
        for magic, what, fix in _OTHER_FILES:  # only once it cannot be safetensors
            if prefix.startswith(magic):
                raise Damaged(f"it is {what} ({size} bytes)", fix)
    if length is None:
        raise Damaged(f"{size} bytes: not even a header length")
    if length > MAX_HEADER:
        raise Damaged(f"it is not safetensors: its first 8 bytes give a header of {length} "
                      f"bytes, over safetensors' limit of {MAX_HEADER}",
                      "pass a file written by safetensors (save_pretrained writes them)")
    if 8 + length > size:
        raise Damaged(f"cut short: its header says {length} bytes, the file has {size - 8}")
    try:
        header = json.loads(os.pread(fd, length, 8), object_pairs_hook=_no_repeats)
        assert isinstance(header, dict)
    except (ValueError, AssertionError) as e:
        raise Damaged(f"its header is not a JSON object ({e})") from None
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise Damaged("its header's __metadata__ is not an object of strings")
    start, tensors, ranges = 8 + length, {}, []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), \
                entry["data_offsets"]
            assert all(_whole(v) for v in (*shape, begin, end))
        except (KeyError, TypeError, ValueError, AssertionError):
            raise Damaged(f"its header entry for {name} is malformed: {entry!r:.80}") from None
        if dtype not in DTYPES:
            raise Damaged(f"{name} has dtype {dtype!r}, which safetensors does not define",
                          f"write it as one of {', '.join(DTYPES)}")
        numel = 1
        for n in shape:
            numel *= n
        if end < begin or end - begin != numel * DTYPES[dtype].itemsize:
            raise Damaged(f"{name}: bytes {begin} to {end} of the data for {dtype} "
                          f"{list(shape)}, which takes {numel * DTYPES[dtype].itemsize}")
        tensors[name] = (dtype, shape, begin)
        ranges.append((begin, end, name))
    at, before = 0, None
    for begin, end, name in sorted(ranges):
        if begin < at:
            raise Damaged(f"{name} (bytes {begin} to {end} of the data) overlaps {before}, which "
                          f"ends at byte {at}: one would be read as the other")
        if begin > at:
            raise Damaged(f"bytes {at} to {begin} of the data belong to no tensor (before "
                          f"{name})")
        at, before = end, name
    if start + at > size:
        raise Damaged(f"cut short: {before} ends at byte {start + at}, the file has {size}")
    if start + at < size:
        raise Damaged(f"its last {size - start - at} bytes belong to no tensor (the header's "
                      f"tensors end at byte {start + at}, the file at {size})")
    return start, tensors


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"{twice!r} is in it twice")
    return out


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
