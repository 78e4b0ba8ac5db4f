"""A node's score is the same bits whatever other nodes it is scored with, and in whatever order.

kube-scheduler sends the extender the nodes its parallel filter found, in that order, starting where the
last pod's search stopped; the simulator scores every feasible node in index order. The two pick the same
node only if every score is bit for bit the same (FGD truncates its scores, so a last-bit difference
is a whole point, and the tie-break among the top nodes is a different set). Before the fragment sums
were made exact, the openb trace's first 1,200 GPU pods (file order) gave 170 pods whose scores differed
with the node order, some with a different pick.
"""

from __future__ import annotations

import numpy as np

from kubegpu.placement import ScoreContext, get_policy, place
from kubegpu.placement.ordered import exact_dot, row_sum, weighted_sum
from kubegpu.placement.workload import LearnedWorkload
from kubegpu.sim.trace import load_nodes, load_pods


def test_scores_do_not_depend_on_the_nodes_scored_with_them_over_a_long_learned_run():
    nodes = load_nodes().gpu_only()
    pods = load_pods()
    rng = np.random.default_rng(5)
    # The recording's order (GPU pods in file order, where the real scheduler first differed at pod #1,076).
    order = [i for i, p in enumerate(pods) if p.demand.count > 0][:1200]
    cluster = nodes.cluster()
    learner = LearnedWorkload()
    sim, ext = get_policy("kubegpu"), get_policy("kubegpu")  # separate instances: separate kept scores
    gen = -1
    ctx = ext_ctx = ScoreContext()
    compared = differing = 0
    first: tuple[int, float] | None = None
    for k, i in enumerate(order):
        d = pods[i].demand
        if learner.generation != gen:
            gen = learner.generation
            ctx, ext_ctx = ScoreContext(workload=learner.current), ScoreContext(workload=learner.current)
        cand = cluster.gpu_candidates(d)
        rows = np.flatnonzero(cluster.feasible(d, cand))
        if len(rows) == 0:
            continue
        want = np.asarray(sim.node_scores(cluster, d, rows, cand[rows], ctx), np.float64)
        perm = rng.permutation(len(rows))  # kube-scheduler's order: any
        got = np.empty(len(rows))
        got[perm] = np.asarray(ext.node_scores(cluster, d, rows[perm], cand[rows[perm]], ext_ctx), np.float64)
        compared += len(rows)
        if not np.array_equal(want, got):
            differing += 1
            if first is None:
                first = (k, float(np.abs(want - got).max()))
        where = place(cluster, d, sim, sim, ctx)
        if where is None:
            continue
        cluster.take(where.node, where.gpus, d)
        learner.add(LearnedWorkload.shape_of(d))
    assert learner.generation > 20  # the workload was relearned many times along the way
    assert compared > 500_000
    assert differing == 0, f"{differing} pods scored differently; first at pod {first}"


def test_ordered_sums_are_the_same_in_any_batch():
    rng = np.random.default_rng(1)
    w = rng.random(37)
    x = rng.random((37, 900)) * 1000
    full = weighted_sum(w, x)
    y = rng.random((900, 8))
    rows = row_sum(y)
    ints = rng.integers(0, 8000, (37, 900))
    counts = rng.integers(1, 5000, 37).astype(np.float64)
    exact = exact_dot(counts, ints)
    for j in rng.integers(0, 900, 50):
        assert weighted_sum(w, x[:, [j]])[0] == full[j]
        assert row_sum(y[[j]])[0] == rows[j]
        assert exact_dot(counts, ints[:, [j]])[0] == exact[j] == float((counts * ints[:, j]).sum())


def test_fragment_weights_stay_exact_and_empty_workloads_score() -> None:
    from collections import Counter

    from kubegpu.placement import ClusterState, Demand, Workload
    from kubegpu.placement.frag import FragCache, FragTerms, frag_delta_per_node, node_frag
    from kubegpu.placement.ordered import EXACT_LIMIT
    from kubegpu.placement.workload import workload_from_counts

    c = ClusterState.from_arrays(["a", "b"], ["A100"] * 2, [8, 8], [96_000] * 2, [2**38] * 2)
    empty = FragTerms.build(c, Workload((), np.zeros(0)))
    assert node_frag(c, empty).tolist() == [8000.0, 8000.0]
    assert frag_delta_per_node(c, empty, np.array([0, 1]), Demand.whole(2), None,
                               FragCache(c, empty)).tolist() == [-2000.0, -2000.0]
    # Counts far beyond any cluster: the weights are scaled down, integer-valued, and every sum stays exact.
    small = workload_from_counts(Counter({Demand.whole(1, 4000): 5, Demand.share(500, cpu_milli=2000): 3}))
    weight = np.array([10**15, 3], np.int64)
    huge = Workload(small.shapes, weight / weight.sum(), small.every, small.every_freq, weight)
    terms = FragTerms.build(c, huge)
    assert np.array_equal(terms.weight, np.round(terms.weight)) and terms.weight.min() >= 1
    assert terms.total * c.n_slots * 1000 * 4 <= EXACT_LIMIT
