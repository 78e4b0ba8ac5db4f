"""kubegpu's own terms: shares packed by what can still fill a GPU, hosts kept for rare large shapes."""

from __future__ import annotations

import numpy as np

from kubegpu.placement import ClusterState, Demand, ScoreContext, Workload, place
from kubegpu.placement.fill import cpu_floor, cpu_per_milli, cpu_pressure, fill_delta_per_gpu, fill_value
from kubegpu.placement.policies import KubegpuPolicy, ReserveTerms, get_policy

GIB = 2**30


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
    # Only the 120-core shape (and the big node's whole-node request) have fewer hosts than half the nodes.
    assert list(terms.cpu) == [120_000, 128_000]
    rows = np.arange(cl.n_nodes)
    loss = KubegpuPolicy().reserve_loss(cl, ScoreContext(workload=wl), one_gpu(), rows,
                                        cl.gpu_candidates(one_gpu())[rows])
    assert loss[0] == 2 and (loss[1:] == 0).all()


def test_no_reservation_for_a_shape_expected_less_than_once():
    # 32 free GPUs: about 0.3 pods of the rare shape still to come, for one host.
    cl = cluster(3)
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    rows = np.arange(cl.n_nodes)
    loss = KubegpuPolicy().reserve_loss(cl, ScoreContext(workload=wl), one_gpu(), rows,
                                        cl.gpu_candidates(one_gpu())[rows])
    assert (loss == 0).all()


def test_a_rare_node_class_is_kept_before_its_large_shape_is_seen():
    # A workload learned from live pods that has not yet shown the 120-core 8-GPU pod: the big node's
    # whole-node request stands in for it, and small pods tied between it and the small nodes go elsewhere.
    cl = cluster()
    wl = Workload.from_demands([one_gpu()] * 90 + [one_gpu(4000)] * 10)
    terms = ReserveTerms.build(cl, wl)
    assert len(terms.cpu) == 1 and terms.cpu[0] == 128_000 and terms.count[0] == 8
    assert np.isclose(terms.freq[0], 0.1)  # as rare as the rarest shape shown
    ctx = ScoreContext(workload=wl, node_rank=np.arange(cl.n_nodes))  # ties go to "big" first
    k = cl.copy()
    for _ in range(12):
        p = place(k, one_gpu(), KubegpuPolicy(), None, ctx)
        assert p is not None and p.node != 0
        k.take(p.node, p.gpus, one_gpu())
    p = place(k, big_pod(), KubegpuPolicy(), None, ctx)
    assert p is not None and p.node == 0


def test_whole_node_shapes_skip_common_classes_and_shapes_already_shown():
    cl = cluster()
    shown = Workload.from_demands([one_gpu()] * 9 + [Demand.whole(8, 128_000, 768 * GIB)])
    terms = ReserveTerms.build(cl, shown)
    assert len(terms.cpu) == 1 and np.isclose(terms.freq[0], 0.1)  # the shown shape, not a second copy
    even = ClusterState.from_arrays(["a", "b"], ["A100"] * 2, [8, 8], [96_000] * 2, [384 * GIB] * 2)
    assert len(ReserveTerms.build(even, Workload.from_demands([one_gpu()] * 10)).cpu) == 0


def test_small_pods_leave_the_only_big_host_free():
    cl = cluster()
    wl = Workload.from_demands([one_gpu()] * 99 + [big_pod()])
    rank = np.arange(cl.n_nodes)  # ties go to "big" first
    fgd_ctx, kg_ctx = ScoreContext(workload=wl, node_rank=rank), ScoreContext(workload=wl, node_rank=rank)
    fgd = place(cl, one_gpu(), "fgd", None, fgd_ctx)
    assert fgd is not None and fgd.node == 0  # FGD hands the big node to the small pod
    k = cl.copy()
    for _ in range(12):  # more small pods than the small nodes' first GPUs
        p = place(k, one_gpu(), KubegpuPolicy(), None, kg_ctx)
        assert p is not None and p.node != 0
        k.take(p.node, p.gpus, one_gpu())
    p = place(k, big_pod(), KubegpuPolicy(), None, kg_ctx)
    assert p is not None and p.node == 0 and len(p.gpus) == 8


def fill_workload() -> Workload:
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    small = Demand(1, 160, 0, 0, False, 2000, GIB, None)
    return Workload.from_demands([share] * 10 + [small] * 5 + [one_gpu(2000)] * 10)


def test_fill_value_counts_rarely_filled_gaps_as_stranded():
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    small = Demand(1, 160, 0, 0, False, 2000, GIB, None)
    value = fill_value(Workload.from_demands([share] * 40 + [small] + [one_gpu(2000)] * 59), kappa=20)
    assert value[1000] == 0  # a whole-GPU pod takes an idle GPU
    assert value[100] == 100 and value[30] == 30  # nothing fits: all of it stays free
    # Only the 160 (1 % of the one-GPU pods) fits a 190 gap: filled with odds 20 x 1 %, else left.
    assert np.isclose(value[190], 0.8 * 190 + 0.2 * 30)
    assert value[840] < 0.5 * value[190]  # an 810 (or a 160) very likely goes there
    # The common share's gap is what a frequent fill would leave.
    assert np.isclose(fill_value(fill_workload())[190], 30)


def test_fill_value_without_shares_strands_every_gap():
    value = fill_value(Workload.from_demands([one_gpu()] * 3))
    assert value[1000] == 0 and value[999] == 999 and value[1] == 1


def test_cpu_floor_is_the_least_cpu_of_what_fits():
    floor = cpu_floor(fill_workload())
    assert floor[100] == np.inf  # nothing fits
    assert floor[160] == 2000 and floor[900] == 2000
    assert floor[1000] == 2000


def test_a_gap_on_a_node_without_cpu_counts_whole():
    cl = ClusterState.from_arrays(["a", "b"], ["T4", "T4"], [2, 2], [64_000, 3_000], [256 * GIB] * 2)
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    value, floor = fill_value(fill_workload()), cpu_floor(fill_workload())
    cand = cl.gpu_candidates(share)
    delta = fill_delta_per_gpu(cl, np.arange(2), share, cand, value, floor)
    # On "a" the GPU goes from idle (0) to a 190 gap (value[190]); on "b" the 810 takes the CPU the
    # other idle GPU and the new gap would need: 1000 + 190 stranded.
    assert np.isclose(delta[0, 0], value[190])
    assert np.isclose(delta[1, 0], 1190)
    assert not np.isfinite(fill_delta_per_gpu(cl, np.arange(2), share, np.zeros_like(cand), value, floor)).any()


def test_cpu_pressure_compares_the_workloads_cpu_per_gpu_with_the_clusters():
    cl = ClusterState.from_arrays(["a", "b"], ["T4", "T4"], [8, 8], [64_000, 64_000], [256 * GIB] * 2)  # 8 cores/GPU
    light = Workload.from_demands([one_gpu(4000)] * 10)
    assert cpu_per_milli(light) == 4.0
    assert np.isclose(cpu_pressure(cl, light), 0.5)
    # CPU-only pods share the GPU nodes: their CPU counts, their GPU does not.
    heavy = Workload.from_demands([one_gpu(4000)] * 10 + [Demand(cpu_milli=16_000)] * 10)
    assert cpu_per_milli(heavy) == 4.0
    assert np.isclose(cpu_pressure(cl, heavy), 2.5)
    assert cpu_pressure(cl, Workload.from_demands([Demand(cpu_milli=1000)])) == 0.0  # no GPU asked


def test_compute_the_cpu_cannot_feed_counts_as_stranded():
    # Two idle GPUs each; "b" has CPU for only 1250 milli of GPU work at 8 cores per GPU.
    cl = ClusterState.from_arrays(["a", "b"], ["T4", "T4"], [2, 2], [64_000, 10_000], [256 * GIB] * 2)
    share = Demand(1, 470, 0, 0, False, 4000, GIB, None)
    wl = fill_workload()
    value, floor = fill_value(wl), cpu_floor(wl)
    cand = cl.gpu_candidates(share)
    plain = fill_delta_per_gpu(cl, np.arange(2), share, cand, value, floor)
    fed = fill_delta_per_gpu(cl, np.arange(2), share, cand, value, floor, feed=8.0, feed_weight=0.5)
    assert np.allclose(fed[0], plain[0])  # "a" can feed all its GPUs before and after
    # "b": 2000 expected in use against 1250 fed (750 hungry); after the share, 1530 - value[530] in use
    # against 750 fed.
    hungry_after = 1530 - value[530] - 750
    assert np.isclose(fed[1, 0], plain[1, 0] + 0.5 * (hungry_after - 750))
    assert np.allclose(fill_delta_per_gpu(cl, np.arange(2), share, cand, value, floor, feed=0.0), plain)


def test_share_goes_to_the_gpu_it_fills_closest_to_full():
    cl = ClusterState.from_arrays(["a"], ["T4"], [2], [64_000], [256 * GIB])
    share = Demand(1, 810, 0, 0, False, 2000, GIB, None)
    small = Demand(1, 160, 0, 0, False, 2000, GIB, None)
    cl.take(0, [1], small)  # GPU 1 has 840 free: an 810 there leaves 30, on GPU 0 it would leave 190
    p = place(cl, share, "kubegpu", None, ScoreContext(workload=fill_workload()))
    assert p is not None and p.gpus == (1,)


def test_share_scores_depend_on_the_node_alone():
    cl = cluster(6)
    share = Demand(1, 470, 0, 0, False, 4000, GIB, None)
    ctx = ScoreContext(workload=Workload.from_demands([share] * 5 + [one_gpu()] * 5))
    for node, gpu in ((1, 0), (2, 0), (2, 1), (4, 3)):
        cl.take(node, [gpu], share)
    rows = np.arange(cl.n_nodes)
    cand = cl.gpu_candidates(share)
    policy = KubegpuPolicy()
    assert policy.row_local(share) and not policy.row_local(one_gpu())
    together = policy.node_scores(cl, share, rows, cand, ctx)
    alone = [policy.node_scores(cl, share, rows[i : i + 1], cand[i : i + 1], ctx)[0] for i in rows]
    assert np.array_equal(together, alone)
    assert int(np.argmax(together)) in (1, 4)  # a 470 joins a lone 470 rather than open an idle GPU


def test_kept_scores_follow_every_change_of_rows_and_workload():
    """A policy object keeps scores per (workload generation, demand, row version): through takes,
    give-backs and a new workload, its answers equal a fresh object's, for node and GPU scores."""
    from kubegpu.placement import get_policy

    rng = np.random.default_rng(5)
    cl = cluster(12)
    demands = [one_gpu(), Demand.share(470, cpu_milli=4000), Demand.share(810, cpu_milli=3000), big_pod(),
               Demand(0, 0, 0, 0, False, 6000, GIB)]
    wl_a = Workload.from_demands(demands * 3 + [one_gpu()] * 5)
    wl_b = Workload.from_demands(demands + [Demand.share(320, cpu_milli=2000)] * 9)
    kept = {name: get_policy(name) for name in ("kubegpu", "fgd")}
    ctx = ScoreContext(workload=wl_a)
    placed = []
    for step in range(60):
        if step == 30:
            ctx = ScoreContext(workload=wl_b)  # a new workload generation: nothing kept may be reused
        d = demands[int(rng.integers(len(demands)))]
        cand = cl.gpu_candidates(d)
        rows = np.flatnonzero(cl.feasible(d, cand))
        if len(rows):
            for name, pol in kept.items():
                fresh = get_policy(name).node_scores(cl, d, rows, cand[rows], ScoreContext(workload=ctx.workload))
                assert np.allclose(pol.node_scores(cl, d, rows, cand[rows], ctx), fresh), (name, step)
                if d.count == 1 and not d.exclusive:
                    node = int(rows[0])
                    got = pol.gpu_scores(cl, node, d, cand[node], ctx)
                    want = get_policy(name).gpu_scores(cl, node, d, cand[node], ScoreContext(workload=ctx.workload))
                    assert np.array_equal(np.where(cand[node], got, 0), np.where(cand[node], want, 0))
            p = place(cl, d, kept["kubegpu"], None, ctx)
            if p is not None:
                cl.take(p.node, p.gpus, d)
                placed.append((p, d))
        if placed and rng.random() < 0.3:
            p, d = placed.pop(int(rng.integers(len(placed))))
            cl.give_back(p.node, p.gpus, d)


def test_stranding_behind_cpu_counts_only_under_cpu_pressure():
    cl = ClusterState.from_arrays(["a", "b"], ["T4", "T4"], [8, 8], [64_000, 64_000], [256 * GIB] * 2)
    assert ScoreContext(workload=Workload.from_demands([one_gpu(4000)] * 10)).cpu_feed(cl) == 0.0
    heavy = Workload.from_demands([one_gpu(4000)] * 10 + [Demand(cpu_milli=16_000)] * 10)
    assert ScoreContext(workload=heavy).cpu_feed(cl) == 4.0


def test_under_cpu_pressure_a_share_does_not_open_the_only_big_host():
    cl = cluster()
    share = Demand(1, 470, 0, 0, False, 4000, GIB, None)
    rank = np.arange(cl.n_nodes)  # ties go to "big" first
    # CPU-only pods asking 64 cores each: the workload's CPU would run out before the GPUs.
    heavy = [one_gpu()] * 60 + [share] * 39 + [big_pod()] + [Demand(cpu_milli=64_000)] * 100
    ctx = ScoreContext(workload=Workload.from_demands(heavy), node_rank=rank)
    assert ctx.cpu_feed(cl) > 0
    p = place(cl, share, KubegpuPolicy(), None, ctx)
    assert p is not None and p.node != 0
    # Without CPU pressure shares do not reserve: every node is idle and the tie goes to the big host.
    light = Workload.from_demands(heavy[:100])
    calm = ScoreContext(workload=light, node_rank=rank)
    assert calm.cpu_feed(cl) == 0
    q = place(cl, share, KubegpuPolicy(), None, calm)
    assert q is not None and q.node == 0


def test_a_multi_gpu_pod_pays_for_a_lost_host_beyond_fgds_ties():
    cl = cluster()
    four = Demand.whole(4, 40_000, 64 * GIB)
    wl = Workload.from_demands([one_gpu()] * 90 + [Demand.whole(4, 60_000, 64 * GIB)] * 8 + [big_pod()] * 2)
    rows, cand = np.arange(cl.n_nodes), cl.gpu_candidates(four)
    fgd = get_policy("fgd").node_scores(cl, four, rows, cand, ScoreContext(workload=wl))
    assert fgd[0] > fgd[1:].max()  # FGD prefers the big host outright: no tie for the tie-breaks to settle
    kg = KubegpuPolicy().node_scores(cl, four, rows, cand, ScoreContext(workload=wl))
    assert kg[0] == fgd[0] - 1.0  # one point: it would take the only host of the 120-core shape
    assert np.array_equal(kg[1:], fgd[1:])
