"""How the planner writes quantities: decimal prefixes (1 GB = 1e9 bytes, not GiB)."""

from __future__ import annotations


def si(n: float, unit: str = "B") -> str:
    """A decimal-prefixed quantity: 1 kB = 1e3 B, 1 GB = 1e9 B."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def ms(seconds: float) -> str:
    """A duration with three significant digits, in ms below a second, else in s."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
