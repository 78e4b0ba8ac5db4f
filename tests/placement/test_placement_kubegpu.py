"""kubegpu's own tie-breaks: hosts kept for rare large shapes, shares packed by what can still fill a GPU."""

from __future__ import annotations

import numpy as np

from kubegpu.placement import ClusterState, Demand, ScoreContext, Workload, place
from kubegpu.placement.policies import KubegpuPolicy, ReserveTerms

GIB = 2**30


class Reserving(KubegpuPolicy):
    """kubegpu with host reservation switched on."""

    reserve_weight = 0.35


def one_gpu(cpu: int = 8000) -> Demand:
    return Demand.whole(1, cpu, 16 * GIB)


def big_pod() -> Demand:
    return Demand.whole(8, 120_000, 700 * GIB)


def cluster(small: int = 20) -> ClusterState:
    # One node large enough for the 120-core 8-GPU pod, ``small`` that are not.
    return ClusterState.from_arrays(
        ["big", *(f"s{i}" for i in range(small))],
        ["A100"] * (small + 1),
        [8] * (small + 1),
        [128_000] + [96_000] * small,
        [768 * GIB] + [384 * GIB] * small,
    )


def test_workload_keeps_every_shape_with_its_share():
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    assert len(wl) == 1  # the coverage cut drops the rare shape ...
    assert len(wl.every) == 2  # ... which is still known
    assert np.isclose(wl.every_freq.sum(), 1.0)
    assert wl.every[1].cpu_milli == 120_000 and np.isclose(wl.every_freq[1], 0.01)


def test_reserve_loss_counts_only_nodes_that_lose_a_rare_host():
    # 168 free GPUs at 1.07 GPU per pod: about 1.6 pods of the 1 % shape still to come, for one host.
    cl = cluster()
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    terms = ReserveTerms.build(cl, wl)
    assert len(terms.cpu) == 1  # only the 120-core shape has fewer hosts than half the nodes
    rows = np.arange(cl.n_nodes)
    choice = np.zeros((cl.n_nodes, 1), np.int64)
    loss = terms.loss(cl, rows, one_gpu(), choice)
    assert loss[0] == 1 and (loss[1:] == 0).all()


def test_no_reservation_while_hosts_outnumber_the_pods_expected():
    # 32 free GPUs: about 0.3 pods of the rare shape still to come, for one host.
    cl = cluster(3)
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    rows = np.arange(cl.n_nodes)
    loss = ReserveTerms.build(cl, wl).loss(cl, rows, one_gpu(), np.zeros((cl.n_nodes, 1), np.int64))
    assert (loss == 0).all()


def test_small_pods_leave_the_only_big_host_free():
    cl = cluster()
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    rank = np.arange(cl.n_nodes)  # ties go to "big" first
    fgd_ctx, kg_ctx = ScoreContext(workload=wl, node_rank=rank), ScoreContext(workload=wl, node_rank=rank)
    fgd = place(cl, one_gpu(), "fgd", None, fgd_ctx)
    assert fgd is not None and fgd.node == 0  # FGD hands the big node to the small pod
    k = cl.copy()
    for _ in range(12):  # more small pods than the small nodes' first GPUs
        p = place(k, one_gpu(), Reserving(), None, kg_ctx)
        assert p is not None and p.node != 0
        k.take(p.node, p.gpus, one_gpu())
    p = place(k, big_pod(), Reserving(), None, kg_ctx)
    assert p is not None and p.node == 0 and len(p.gpus) == 8


def test_leftover_table_is_the_best_packing_of_one_gpu_shapes():
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    small = Demand(1, 160, 0, 0, False, 2000, GIB, None)
    ctx = ScoreContext(workload=Workload.from_demands([share] * 10 + [small] * 5 + [one_gpu()] * 10))
    table = ctx.leftover()
    assert table[1000] == 0  # a whole-GPU pod fills it
    assert table[190] == 30  # only a 160 still fits
    assert table[100] == 100  # nothing fits
    assert table[840] == 30  # 810 + 30


def test_share_goes_to_the_gpu_it_fills_closest_to_full():
    cl = ClusterState.from_arrays(["a"], ["T4"], [2], [64_000], [256 * GIB])
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    small = Demand(1, 160, 0, 0, False, 2000, GIB, None)
    cl.take(0, [1], small)  # GPU 1 has 840 free: an 810 there leaves 30, on GPU 0 it would leave 190
    wl = Workload.from_demands([share] * 10 + [small] * 5 + [one_gpu(2000)] * 10)
    p = place(cl, share, "kubegpu", None, ScoreContext(workload=wl))
    assert p is not None and p.gpus == (1,)
