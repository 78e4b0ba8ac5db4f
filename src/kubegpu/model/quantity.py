"""Kubernetes resource quantities (``8Gi``, ``16384Mi``, ``500M``, ``"100"``, ``1e3``).

The parser is exact: the API server's own quantity type and lightkube's parser
both round up to thousandths, which would let ``nvidia.com/gpu: "1.9999"``
pass as 2 GPUs. kubegpu refuses fractions instead of rounding them, so the
grammar is implemented here with :class:`decimal.Decimal` and no rounding.
Sizes are bounded (digits and exponent) so a hostile value cannot make the
webhook build a number with millions of digits.

:mod:`decimal` is imported by the first parse, not with this module: the node
daemon imports the model (through the inventory) but on a GPU node may never
parse a quantity, and would hold ``decimal``'s memory for nothing.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decimal import Decimal

_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


@functools.cache
def _suffixes() -> dict[str, Decimal]:
    from decimal import Decimal

    return {
        **{s: Decimal(m) for s, m in _BINARY},
        "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
        "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
        "P": Decimal("1e15"), "E": Decimal("1e18"),
    }

# <sign><digits>[.<digits>]<suffix>, the suffix being binary, decimal SI or an exponent (e3, E-2). ASCII digits
# only, as Kubernetes' own parser (Python's \d would take any script's digits, and Decimal would read them).
_QUANTITY_RE = re.compile(
    r"^([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?$")
_MAX_CHARS = 64
_MAX_EXPONENT = 30


class QuantityError(ValueError):
    """A value that is not a Kubernetes quantity, or not one this resource allows."""


def parse(value: object) -> Decimal:
    """Parse a quantity given as YAML/JSON gives it (str, int or float), exactly."""
    from decimal import Decimal, InvalidOperation, localcontext

    if isinstance(value, bool) or value is None:
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"{value!r} is not a quantity")
        value = repr(value)
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity")
    text = value.strip()
    if len(text) > _MAX_CHARS:
        raise QuantityError(f"{value[:20]!r}… is too long to be a quantity")
    match = _QUANTITY_RE.match(text)
    if match is None:
        raise QuantityError(f"{value!r} is not a quantity")
    sign, number, suffix, exponent = match.groups()
    try:
        with localcontext() as ctx:
            # Enough digits that no accepted input is ever rounded (64 chars plus an 18-digit suffix).
            ctx.prec = 128
            amount = _scale(Decimal(number), suffix, exponent, value)
    except InvalidOperation as exc:
        raise QuantityError(f"{value!r} is not a quantity") from exc
    return -amount if sign == "-" else amount


def _scale(amount: Decimal, suffix: str | None, exponent: str | None, value: str) -> Decimal:
    if exponent is not None:
        exp = int(exponent)
        if abs(exp) > _MAX_EXPONENT:
            raise QuantityError(f"{value!r} is out of range")
        return amount.scaleb(exp)
    return amount * _suffixes()[suffix or ""]


# parse_int's common case: ASCII digits and a suffix that multiplies by a whole number ("30", "20Gi", "4k").
# Its value is exactly what parse gives, in integer arithmetic, without Decimal's context per call.
_WHOLE = re.compile(r"([0-9]{1,30})(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_WHOLE_FACTOR: dict[str | None, int] = {
    **dict(_BINARY), None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def parse_int(value: object) -> int:
    """Parse a quantity that must be a whole number (counts, percents, bytes)."""
    if type(value) is int:
        return value
    if type(value) is str and (whole := _WHOLE.fullmatch(value)) is not None:
        return int(whole[1]) * _WHOLE_FACTOR[whole[2]]
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
