"""How shardfx writes sizes for people: bytes in binary units, FLOPs in decimal ones."""


def nbytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def flops(n: int) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f}" if unit == "" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError
