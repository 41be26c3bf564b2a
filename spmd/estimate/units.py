"""How quantities are written for people: the planner's decimal prefixes (1 GB = 1e9 bytes), and
binary ones (1 GiB = 2^30 bytes) for what a compiled program or a device holds."""

from __future__ import annotations


def si(n: float, unit: str = "B") -> str:
    """A decimal-prefixed quantity: 1 kB = 1e3 B, 1 GB = 1e9 B."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def binary(n: float) -> str:
    """Bytes with a binary prefix: "512 B", "1.06 MiB", "2.83 TiB"."""
    for prefix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}B"
    return f"{n:.0f} B"


def ms(seconds: float) -> str:
    """A duration with three significant digits, in ms below a second, else in s."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
