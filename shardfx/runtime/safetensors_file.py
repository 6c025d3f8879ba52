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

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}


CHUNK = 1 << 20  # bytes read at a time by copy_rows: fits in a core's cache before its cast


class Damaged(Exception):
    """The file is not a whole safetensors file: why, in words."""


class SafetensorsFile:
    def __init__(self, path: Path):
        """Read and check the header: every tensor's bytes inside the file, sized as its
        dtype and shape say. Raises ``Damaged``."""
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._buf: torch.Tensor | None = None  # copy_rows' bytes, CHUNK at most
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

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, in its own dtype: a new tensor the file is read into."""
        dtype_name, shape, begin = self.tensors[name]
        dtype = DTYPES[dtype_name]
        out = torch.empty(shape, dtype=dtype)
        self._pread(out.view(-1).view(torch.uint8), begin)
        return out

    def copy_rows(self, name: str, rows: slice, out: torch.Tensor,
                  cols: tuple[slice, ...] = ()) -> None:
        """``out.copy_(tensor[rows][:, *cols])`` (rows: a slice of dim 0, step 1), cast to
        ``out``'s dtype, read ``CHUNK`` bytes at a time through one buffer (rows whole: a
        slice of later dimensions is cut in memory)."""
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
            out[at - first:at - first + n].copy_(part[(slice(None), *cols)] if cols else part)

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
