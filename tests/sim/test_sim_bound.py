"""The packing floor: exact on instances small enough to solve by hand or by brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.sim.bound import packing_patterns, share_packing_floor


def brute_force_gpus(items: list[int]) -> int:
    """The least GPUs: first fit over every order of the items reaches the optimum for one of them."""
    best = len(items)
    for order in itertools.permutations(items):
        bins: list[int] = []
        for x in order:
            for j, used in enumerate(bins):
                if used + x <= 1000:
                    bins[j] += x
                    break
            else:
                bins.append(x)
        best = min(best, len(bins))
    return best


def test_floor_of_hand_solved_instances() -> None:
    assert share_packing_floor({500: 4}).gpus == 2
    assert share_packing_floor({500: 4}).waste_milli == 0
    # Volume alone says 2 GPUs; no two 600s share one.
    assert share_packing_floor({600: 3}).gpus == 3
    # The openb shape: an 810 leaves 190 that only a share of at most 190 fills.
    f = share_packing_floor({810: 3, 160: 2})
    assert (f.gpus, f.share_milli, f.waste_milli, f.optimal) == (3, 2750, 250, True)
    assert f.waste_pct(10_000) == pytest.approx(2.5)
    assert share_packing_floor({}).gpus == 0


def test_only_maximal_patterns_are_enumerated() -> None:
    # Sizes descending (810, 160): 810+160 and 160+160 (no 810 fits beside two 160s); 810 alone is not
    # maximal while a 160 is left to add, and neither is a lone 160.
    pats = packing_patterns({810: 3, 160: 2})
    assert sorted(map(tuple, pats.T.tolist())) == [(0, 2), (1, 1)]


def test_sizes_outside_one_gpu_are_refused() -> None:
    with pytest.raises(ValueError, match=r"1\.\.1000"):
        share_packing_floor({1200: 1})
    with pytest.raises(ValueError, match=r"1\.\.1000"):
        share_packing_floor({-5: 1})


def test_too_many_small_sizes_are_refused_not_enumerated_forever() -> None:
    with pytest.raises(ValueError, match="too many small share sizes"):
        share_packing_floor({s: 50 for s in range(10, 200, 10)})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([50, 110, 160, 230, 320, 470, 550, 650, 810]), min_size=1, max_size=6))
def test_floor_equals_brute_force(items: list[int]) -> None:
    counts: dict[int, int] = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    f = share_packing_floor(counts)
    assert f.optimal
    assert f.gpus == brute_force_gpus(items)
    assert f.waste_milli == f.gpus * 1000 - sum(items)
