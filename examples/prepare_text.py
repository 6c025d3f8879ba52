"""Turn a text into the token files `shardfx run` trains on: one uint16 id per character.

Character-level, as nanoGPT's data/shakespeare_char/prepare.py: the vocabulary is the sorted
set of characters in the text, and a character's id is its index in that list. The first part of
the text becomes train.bin and the last --val-fraction of it val.bin; both hold the ids as raw
uint16, so a trainer reads them with np.memmap(path, dtype=np.uint16, mode="r"). meta.json keeps
the vocabulary, to decode ids back to text. The same text always gives the same files.

    python examples/prepare_text.py              # examples/data/shakespeare.txt -> examples/data/
    python examples/prepare_text.py my.txt --out data/my --val-fraction 0.05

From Python (examples/ on sys.path):

    from prepare_text import decode, encode, vocabulary
    chars = vocabulary(text)             # or json.load(open("meta.json"))["chars"]
    ids = encode(text, chars)            # (N,) uint16
    assert decode(ids, chars) == text
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MAX_VOCAB = 2**16  # ids are stored as uint16


def vocabulary(text: str) -> str:
    """The sorted set of characters in ``text``; character ``chars[i]`` has id ``i``."""
    return "".join(sorted(set(text)))


def encode(text: str, chars: str) -> np.ndarray:
    """Token ids of ``text``, a (len(text),) uint16 array; each character must be in ``chars``."""
    if len(chars) > MAX_VOCAB:
        raise ValueError(f"{len(chars)} characters do not fit uint16 ids (at most {MAX_VOCAB})")
    stoi = {c: i for i, c in enumerate(chars)}
    missing = set(text) - stoi.keys()
    if missing:
        raise ValueError(f"characters not in the vocabulary: {''.join(sorted(missing))!r}")
    return np.array([stoi[c] for c in text], dtype=np.uint16)


def decode(ids, chars: str) -> str:
    """The text of token ids ``ids`` (any sequence of ints, e.g. a np.memmap of a .bin file)."""
    return "".join(chars[int(i)] for i in ids)


def prepare(text_path: Path, out: Path, val_fraction: float = 0.1) -> dict:
    """Write ``out``/train.bin, val.bin and meta.json for the text at ``text_path``; return meta."""
    with open(text_path, encoding="utf-8", newline="") as f:  # newline="": keep "\r\n" as is
        text = f.read()
    chars = vocabulary(text)
    ids = encode(text, chars)
    n_val = round(len(ids) * val_fraction)
    if not 0 < n_val < len(ids):
        raise ValueError(
            f"--val-fraction {val_fraction} of {len(ids)} tokens leaves train or val empty"
        )
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]

    out.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": len(chars), "chars": chars,
            "train_tokens": len(train), "val_tokens": len(val)}
    for name, part in (("train.bin", train), ("val.bin", val)):
        part.tofile(out / name)
        print(f"wrote {out / name}: {len(part):,} tokens")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out / 'meta.json'}: vocab_size {len(chars)}")
    return meta


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", nargs="?", type=Path, default=HERE / "data" / "shakespeare.txt",
                        help="UTF-8 text to tokenize (default: examples/data/shakespeare.txt)")
    parser.add_argument("--out", type=Path, default=HERE / "data",
                        help="directory for train.bin, val.bin, meta.json (default: examples/data)")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of the text, from its end, that becomes val.bin (default: 0.1)")
    ns = parser.parse_args(argv)
    try:
        prepare(ns.text, ns.out, ns.val_fraction)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"prepare_text.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
