"""NVLink-aware GPU-set choice on the DGX-1 V100 hybrid cube-mesh."""

from __future__ import annotations

from itertools import combinations

import pytest
from placement_topologies import DGX1_LINKS, dgx1_gpus

from kubegpu.placement import GpuSetError, choose_gpu_set, pair_score
from kubegpu.placement.topology import set_score

GPUS = dgx1_gpus()
IDS = [g.uuid for g in GPUS]


def idx(uuids: list[str]) -> list[int]:
    return [int(u.split("-")[1]) for u in uuids]


def links(a: int, b: int) -> int:
    return DGX1_LINKS.get((min(a, b), max(a, b)), 0)


def fully_connected(s: list[int]) -> bool:
    return all(links(a, b) > 0 for a, b in combinations(s, 2))


def test_the_matrix_is_the_dgx1():
    for g in range(8):
        assert sum(links(g, o) for o in range(8) if o != g) == 6


def test_pair_scores_come_from_one_table():
    assert pair_score(GPUS[0], GPUS[3]) > pair_score(GPUS[0], GPUS[1]) > pair_score(GPUS[0], GPUS[5])
    assert pair_score(GPUS[1], GPUS[4]) < pair_score(GPUS[1], GPUS[2])  # cross-socket PCIe is worst


def test_two_gpus_get_a_two_link_pair():
    assert links(*idx(choose_gpu_set(GPUS, IDS, [], 2))) == 2


def test_four_gpus_get_a_fully_connected_quad():
    quad = idx(choose_gpu_set(GPUS, IDS, [], 4))
    assert quad in ([0, 1, 2, 3], [4, 5, 6, 7])
    assert fully_connected(quad)


def test_two_link_pairs_while_any_remain():
    avail = list(IDS)
    for _ in range(4):
        has_two = any(links(a, b) == 2 for a, b in combinations(idx(avail), 2))
        pair = choose_gpu_set(GPUS, avail, [], 2)
        if has_two:
            assert links(*idx(pair)) == 2, (avail, pair)
        avail = [u for u in avail if u not in pair]


def test_single_gpus_fill_one_quad_and_keep_the_other_whole():
    avail = list(IDS)
    taken = []
    for _ in range(4):
        (one,) = choose_gpu_set(GPUS, avail, [], 1)
        taken.append(one)
        avail.remove(one)
        # After every single GPU, a fully connected quad is still offered to a 4-GPU request.
        assert fully_connected(idx(choose_gpu_set(GPUS, avail, [], 4)))
    assert sorted(idx(taken)) in ([0, 1, 2, 3], [4, 5, 6, 7])


def test_quad_after_a_single_gpu_is_the_untouched_quad():
    (one,) = choose_gpu_set(GPUS, IDS, [], 1)
    avail = [u for u in IDS if u != one]
    quad = idx(choose_gpu_set(GPUS, avail, [], 4))
    assert fully_connected(quad) and idx([one])[0] not in quad


def test_must_include_is_honoured_and_extended_well():
    got = idx(choose_gpu_set(GPUS, IDS, ["GPU-5"], 2))
    assert 5 in got and links(*got) == 2
    got4 = idx(choose_gpu_set(GPUS, IDS, ["GPU-5"], 4))
    assert 5 in got4 and fully_connected(got4)


def test_the_best_sum_is_reached_for_every_size():
    for size in range(1, 9):
        got = choose_gpu_set(GPUS, IDS, [], size)
        best = max(set_score(GPUS, list(c)) for c in combinations(IDS, size))
        assert set_score(GPUS, got) == best


def test_deterministic_and_order_independent():
    a = choose_gpu_set(GPUS, IDS, [], 3)
    b = choose_gpu_set(list(reversed(GPUS)), list(reversed(IDS)), [], 3)
    assert a == b == choose_gpu_set(GPUS, IDS, [], 3)


@pytest.mark.parametrize(
    ("available", "must", "size", "words"),
    [
        (["GPU-0", "GPU-X"], [], 1, "unknown"),
        (["GPU-0"], ["GPU-1"], 1, "not available"),
        (["GPU-0", "GPU-1"], [], 3, "larger"),
        (["GPU-0", "GPU-1"], ["GPU-0", "GPU-1"], 1, "smaller"),
    ],
)
def test_bad_requests_are_refused_clearly(available, must, size, words):
    with pytest.raises(GpuSetError, match=words):
        choose_gpu_set(GPUS, available, must, size)


def test_size_zero_and_all():
    assert choose_gpu_set(GPUS, IDS, [], 0) == []
    assert choose_gpu_set(GPUS, IDS, [], 8) == IDS


def test_large_nodes_use_the_greedy_search_deterministically():
    from kubegpu.model import Gpu

    # 16 GPUs in two NVLink islands of 8: an 8-GPU request must stay inside one island.
    gpus = []
    for i in range(16):
        peers = {f"G{j}": 2 for j in range(16) if j != i and j // 8 == i // 8}
        gpus.append(Gpu(f"G{i}", i, i, "H100", 80 * 2**30, numa_node=i // 8, links=peers))
    ids = [g.uuid for g in gpus]
    got = choose_gpu_set(gpus, ids, [], 8)
    assert len({int(u[1:]) // 8 for u in got}) == 1
    assert got == choose_gpu_set(gpus, ids, [], 8)
