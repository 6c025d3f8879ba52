"""``runtime.safetensors_file``: a header is checked as safetensors checks it before anything is
read, so a file whose header would load one tensor's bytes into another (overlapping ranges),
leave bytes out or run past the file is refused by name, never loaded wrong. Each damage here
is one safetensors' own loader refuses too (checked beside ours), and files that are not
safetensors at all are named as what they are."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shardfx.runtime.safetensors_file import Damaged, SafetensorsFile


def written(tmp_path: Path) -> Path:
    """A file of three tensors (f32 2 x 3, bf16 4, i64 2), as safetensors writes it."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "c": torch.tensor([7, 8])}, path, metadata={"format": "pt"})
    return path


def split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def rewrite(path: Path, header: dict | str, data: bytes) -> Path:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def theirs_refuses(path: Path) -> bool:
    try:
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except (SafetensorError, RuntimeError, ValueError):  # their errors, by kind of damage
        return True
    return False


def offsets(header: dict) -> dict[str, list[int]]:
    return {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


def test_a_whole_file_reads_as_safetensors_reads_it(tmp_path):
    path = written(tmp_path)
    f = SafetensorsFile(path)
    with safe_open(path, "pt") as want:
        for k in want.keys():
            assert torch.equal(f.read(k), want.get_tensor(k)), k
    f.close()


def _overlap(h, data):  # the repro: one tensor's range is another's, so "a" reads as "c"
    h["a"]["data_offsets"], h["c"]["data_offsets"] = h["c"]["data_offsets"], \
        h["a"]["data_offsets"]
    h["a"]["dtype"], h["a"]["shape"] = "I64", [2]
    h["c"]["dtype"], h["c"]["shape"] = "F32", [6]
    h["b"]["data_offsets"] = [0, 8]  # inside a's bytes; b's own range is left to no one
    return h, data


def _gap(h, data):
    last = max(offsets(h).items(), key=lambda kv: kv[1][0])[0]
    begin, end = h[last]["data_offsets"]
    h[last]["data_offsets"] = [begin + 8, end + 8]
    return h, data + bytes(8)


def _tail(h, data):
    return h, data + bytes(5)


def _short(h, data):
    return h, data[:-3]


def _size(h, data):  # a shape that does not fit its bytes
    h["a"]["shape"] = [3, 3]
    return h, data


def _dtype(h, data):
    h["b"]["dtype"] = "F17"
    return h, data


def _twice(h, data):  # the same name twice: JSON's last one wins in Python, hiding the first
    text = json.dumps(h)
    entry = json.dumps({"dtype": "I64", "shape": [2], "data_offsets": h["c"]["data_offsets"]})
    return text[:-1] + f', "a": {entry}}}', data


def _meta(h, data):
    h["__metadata__"] = {"format": 3}
    return h, data


def _backwards(h, data):
    begin, end = h["c"]["data_offsets"]
    h["c"]["data_offsets"] = [end, begin]
    return h, data


DAMAGES = {
    "overlap": (_overlap, r"overlaps|belong to no tensor"),
    "gap": (_gap, r"bytes \d+ to \d+ of the data belong to no tensor \(before \w\)"),
    "tail": (_tail, r"its last 5 bytes belong to no tensor"),
    "short": (_short, r"cut short: \w ends at byte \d+, the file has \d+"),
    "size": (_size, r"a: bytes \d+ to \d+ of the data for F32 \[3, 3\], which takes 36"),
    "dtype": (_dtype, r"b has dtype 'F17', which safetensors does not define"),
    "twice": (_twice, r"its header is not a JSON object \('a' is in it twice\)"),
    "meta": (_meta, r"__metadata__ is not an object of strings"),
    "backwards": (_backwards, r"c: bytes \d+ to \d+ of the data for I64"),
}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_each_damaged_header_is_refused_as_safetensors_refuses_it(tmp_path, name):
    damage, says = DAMAGES[name]
    path = rewrite(written(tmp_path), *damage(*split(written(tmp_path))))
    with pytest.raises(Damaged, match=says):
        SafetensorsFile(path)
    assert theirs_refuses(path), f"safetensors loads the '{name}' file: not a damage it checks"


def test_overlapping_ranges_are_named_even_when_they_cover_the_data(tmp_path):
    """Two tensors of the same size swapped onto one range, the other range left to nobody:
    the repro's shape, where q_proj read o_proj's bytes."""
    h, data = split(written(tmp_path))
    h["d"] = dict(h["c"])  # d reads c's bytes; every byte is still some tensor's
    path = rewrite(tmp_path / "model.safetensors", h, data)
    with pytest.raises(Damaged, match=r"d \(bytes \d+ to \d+ of the data\) overlaps c, which "
                                      r"ends at byte \d+: one would be read as the other"):
        SafetensorsFile(path)
    assert theirs_refuses(path)


@pytest.mark.parametrize("head, what, fix", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 2617\n",
     "a Git LFS pointer", "git lfs pull"),
    (b"PK\x03\x04\x14\x00\x00\x00" + bytes(100), "a zip archive", "torch.load it"),
    (b"\x80\x02}q\x00(X\x06\x00\x00\x00" + bytes(40), "a Python pickle", "torch.load it"),
    (b"<!DOCTYPE html><html><body>Sign in</body></html>", "a web page", "download the file "
                                                                         "again"),
])
def test_a_file_that_is_not_safetensors_is_named_as_what_it_is(tmp_path, head, what, fix):
    path = tmp_path / "model.safetensors"
    path.write_bytes(head)
    with pytest.raises(Damaged, match=f"it is {what}") as e:
        SafetensorsFile(path)
    assert fix in e.value.fix


def test_a_header_whose_length_starts_like_a_pickle_is_still_read(tmp_path):
    """0x80 is also the low byte of a header 384 bytes long: files are named as something
    else only when they cannot be safetensors."""
    path = written(tmp_path)
    h, data = split(path)
    h["__metadata__"]["pad"] = ""
    text = json.dumps(h)
    h["__metadata__"]["pad"] = " " * (0x180 - len(text))
    rewrite(path, h, data)
    assert path.read_bytes()[:2] == b"\x80\x01"
    assert torch.equal(SafetensorsFile(path).read("c"), torch.tensor([7, 8]))
