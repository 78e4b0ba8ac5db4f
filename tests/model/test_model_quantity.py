"""Kubernetes quantities, parsed exactly (no rounding that would turn 1.9999 GPUs into 2)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubegpu.model.quantity import QuantityError, format_bytes, parse, parse_int


@pytest.mark.parametrize(("text", "value"), [
    ("1", 1), (2, 2), ("100", 100), ("8Gi", 8 * 2**30), ("16384Mi", 16 * 2**30), ("500M", 500_000_000),
    ("1k", 1000), ("1Ki", 1024), ("1e3", 1000), ("1E3", 1000), ("2E", 2 * 10**18), ("1.5Gi", 3 * 2**29),
    ("+5", 5), (" 7 ", 7), ("5.", 5), ("1000m", 1), ("1Ei", 2**60), ("0", 0), ("-3", -3),
])
def test_whole_quantities(text: object, value: int) -> None:
    assert parse_int(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("0.5", Decimal("0.5")), ("500m", Decimal("0.5")), (".25", Decimal("0.25")), ("1.9999", Decimal("1.9999")),
    ("1e-3", Decimal("0.001")), ("100u", Decimal("0.0001")), ("3n", Decimal("3e-9")), (0.5, Decimal("0.5")),
])
def test_fractions_are_exact(text: object, value: Decimal) -> None:
    assert parse(text) == value
    with pytest.raises(QuantityError):
        parse_int(text)


@pytest.mark.parametrize("bad", [
    "", " ", "two", "1K", "1 Gi", "8GB", "1.5.5", "0x10", "1e", "e3", "Gi", "--1", "1e31", "1e-31", "NaN",
    "Infinity", "1" * 80, "١٢", "１", None, True, False, [1], {"a": 1}, float("nan"), float("inf"),
])
def test_not_quantities(bad: object) -> None:
    with pytest.raises(QuantityError):
        parse(bad)


@given(st.integers(min_value=0, max_value=2**70))
def test_format_bytes_round_trips(n: int) -> None:
    assert parse_int(format_bytes(n)) == n


def test_format_bytes_uses_the_largest_exact_suffix() -> None:
    assert [format_bytes(n) for n in (0, 1, 1024, 8 * 2**30, 3 * 2**29, 2**60)] == \
        ["0", "1", "1Ki", "8Gi", "1536Mi", "1Ei"]


@given(st.text("0123456789", min_size=1, max_size=40),
       st.sampled_from(["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E", "e3"]))
def test_whole_numbers_read_fast_are_what_parse_reads(digits: str, suffix: str) -> None:
    # parse_int reads plain digits with a whole-number suffix in integer arithmetic: the same value as parse's.
    text = digits + suffix
    try:
        exact = parse(text)
    except QuantityError:
        with pytest.raises(QuantityError):
            parse_int(text)
        return
    if exact == exact.to_integral_value():
        assert parse_int(text) == int(exact)
    else:
        with pytest.raises(QuantityError):
            parse_int(text)


@pytest.mark.parametrize("bad", ["", "two", "1K", "1 Gi", "8GB", "1" * 80, "١٢", None, True, [1], float("nan")])
def test_parse_int_refuses_what_parse_refuses(bad: object) -> None:
    with pytest.raises(QuantityError):
        parse_int(bad)
