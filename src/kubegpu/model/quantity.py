"""Kubernetes resource quantities (``8Gi``, ``16384Mi``, ``500M``, ``"100"``).

Parsing is lightkube's; this module adds the integer checks the resource
protocol needs and a formatter that writes bytes the way people read them.
"""

from __future__ import annotations

from decimal import Decimal

from lightkube.utils.quantity import parse_quantity

_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


class QuantityError(ValueError):
    """A value that is not a Kubernetes quantity, or not one this resource allows."""


def parse(value: object) -> Decimal:
    """Parse a quantity given as YAML/JSON gives it (str, int or float)."""
    if isinstance(value, bool) or value is None:
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        value = str(value)
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity")
    try:
        parsed = parse_quantity(value.strip())
    except (ValueError, ArithmeticError) as exc:
        raise QuantityError(f"{value!r} is not a quantity") from exc
    if parsed is None:
        raise QuantityError(f"{value!r} is not a quantity")
    return parsed


def parse_int(value: object) -> int:
    """Parse a quantity that must be a whole number (counts, percents, bytes)."""
    parsed = parse(value)
    if parsed != parsed.to_integral_value():
        raise QuantityError(f"{value!r} is not a whole number")
    return int(parsed)


def format_bytes(n: int) -> str:
    """Bytes as the largest exact binary suffix: 8589934592 -> ``8Gi``."""
    if n == 0:
        return "0"
    for suffix, size in _BINARY:
        if n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)
