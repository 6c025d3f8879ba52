"""One safetensors file, read by row spans straight from a map of it, each span let go of after
its copy.

The format: 8 bytes (little-endian header length), a JSON header (name -> dtype, shape,
``data_offsets`` [begin, end) after the header; ``__metadata__``), then the tensors' bytes,
each row-major. Rows ``a:b`` of a tensor are one span of the file, so a rank's rows (ZeRO) or
the rows a tp slice sits in are one span: ``read`` gives a tensor over the mapped bytes (no
copy; the caller's ``copy_`` into its shard casts and reads the file once), and ``drop``
then tells the kernel those pages are not needed (``MADV_DONTNEED``).

Why not ``safetensors.safe_open``: it maps the file too, but every page a rank touches stays in
its resident memory (file-backed, yet counted in its RSS and its peak) until the map goes, so
a rank reading a quarter of a 2 GB checkpoint peaked 0.6 GB above what it holds; and its
slices of later dimensions are read row by row.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}


class Damaged(Exception):
    """The file is not a whole safetensors file: why, in words."""


class SafetensorsFile:
    def __init__(self, path: Path):
        """Read and check the header: every tensor's bytes inside the file, sized as its
        dtype and shape say. Raises ``Damaged``."""
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._map: mmap.mmap | None = None  # made on the first read
        self._spans: list[tuple[int, int]] = []  # (offset, bytes) read since the last drop
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise Damaged(f"{size} bytes: not even a header length")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise Damaged(f"cut short: its header says {length} bytes, the file has {size - 8}")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
            assert isinstance(header, dict)
        except (ValueError, AssertionError) as e:
            raise Damaged(f"its header is not a JSON object ({e})") from None
        self.start = 8 + length
        self.tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}  # dtype, shape, offset
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), \
                    entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise Damaged(f"its header entry for {name} is malformed") from None
            item = DTYPES[dtype].itemsize if dtype in DTYPES else None
            numel = 1
            for n in shape:
                numel *= n
            if item is not None and end - begin != numel * item:
                raise Damaged(f"{name}: {end - begin} bytes for {dtype} {list(shape)}")
            if self.start + end > size:
                raise Damaged(f"cut short: {name} ends at byte {self.start + end}, the file has "
                              f"{size}")
            self.tensors[name] = (dtype, shape, begin)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or its rows ``rows`` (a slice of dim 0, step 1), in its own dtype:
        a view of the mapped file, valid until ``drop`` (``clone`` it to keep it)."""
        dtype_name, shape, begin = self.tensors[name]
        dtype = DTYPES[dtype_name]
        if not shape:
            return self._span(begin, dtype.itemsize).view(dtype).reshape(())
        row = dtype.itemsize
        for n in shape[1:]:
            row *= n
        first, last, _ = (rows or slice(None)).indices(shape[0])
        count = max(0, last - first)
        return self._span(begin + first * row, count * row).view(dtype).view(count, *shape[1:])

    def _span(self, offset: int, n: int) -> torch.Tensor:
        if self._map is None:
            # copy-on-write: a writable buffer for torch.frombuffer; nothing writes it
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        at = self.start + offset
        self._spans.append((at, n))
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=n, offset=at)

    def drop(self) -> None:
        """The pages of the spans read since the last ``drop`` leave this process's resident
        memory (they stay in the page cache)."""
        page = mmap.PAGESIZE
        for at, n in self._spans:
            start = at // page * page
            if n:
                self._map.madvise(mmap.MADV_DONTNEED, start, at + n - start)
        self._spans.clear()

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self._fd)
