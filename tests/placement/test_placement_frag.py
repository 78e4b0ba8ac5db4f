"""The vectorised fragment deltas equal a recomputation from scratch (FGD's and the capacity-aware one)."""

from __future__ import annotations

import numpy as np
import pytest

from kubegpu.placement import ClusterState, Demand, ScoreContext, Workload, node_frag, place
from kubegpu.placement.frag import (
    FragTerms,
    capacity_delta_per_gpu,
    capacity_delta_per_node,
    capacity_frag,
    frag_delta_per_gpu,
    frag_delta_per_node,
)
from kubegpu.placement.policies import bestfit_choice

GIB = 2**30


def workload_and_cluster(seed: int) -> tuple[list[Demand], ClusterState]:
    rng = np.random.default_rng(seed)
    demands = []
    for _ in range(300):
        kind = rng.integers(3)
        cpu, mem = int(rng.choice([2000, 4000, 12000])), int(rng.choice([4, 16, 64])) * GIB
        models = None if rng.random() < 0.8 else frozenset({"T4"})
        if kind == 0:
            demands.append(Demand(1, int(rng.choice([250, 470, 810])), 0, 0, False, cpu, mem, models))
        elif kind == 1:
            demands.append(Demand.whole(int(rng.choice([1, 1, 2, 4])), cpu, mem, models))
        else:
            demands.append(Demand(0, 0, 0, 0, False, cpu, mem, None))
    n = 30
    cl = ClusterState.from_arrays(
        [f"n{i}" for i in range(n)],
        ["T4" if i % 3 else "G2" for i in range(n)],
        [2 if i % 3 else 8 for i in range(n)],
        [48_000] * n,
        [192 * GIB] * n,
    )
    return demands, cl


def recompute(
    cl: ClusterState, terms: FragTerms, node: int, gpus: list[int], d: Demand, capacity: bool, ctx: ScoreContext
) -> float:
    after = cl.copy()
    after.take(node, gpus, d)
    rows = np.array([node])
    if capacity:
        c2 = ScoreContext(workload=ctx.workload)
        return float(
            capacity_frag(after, c2.frag_cache(after, True), rows)[0]
            - capacity_frag(cl, ScoreContext(workload=ctx.workload).frag_cache(cl, True), rows)[0]
        )
    return float(node_frag(after, terms, rows)[0] - node_frag(cl, terms, rows)[0])


@pytest.mark.parametrize("capacity", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_deltas_match_recomputation(seed: int, capacity: bool) -> None:
    demands, cl = workload_and_cluster(seed)
    wl = Workload.from_demands(demands)
    ctx = ScoreContext(workload=wl, rng=np.random.default_rng(seed))
    checked = 0
    for i, d in enumerate(demands[:120]):
        terms = ctx.frag_terms(cl, capacity)
        cache = ctx.frag_cache(cl, capacity)
        cand = cl.gpu_candidates(d)
        rows = np.flatnonzero(cl.feasible(d, cand))
        if len(rows) and i % 3 == 0:
            if d.count == 1 and not d.exclusive:
                delta = (
                    capacity_delta_per_gpu(cl, cache, rows, d, cand[rows])
                    if capacity
                    else frag_delta_per_gpu(cl, terms, rows, d, cand[rows], cache)
                )
                if not capacity:  # the cached and the uncached path agree
                    fresh = frag_delta_per_gpu(cl, terms, rows, d, cand[rows])
                    assert np.allclose(np.where(np.isfinite(fresh), fresh, 0), np.where(np.isfinite(delta), delta, 0))
                for j, node in enumerate(rows[:6]):
                    for g in np.flatnonzero(cand[node]):
                        assert delta[j, g] == pytest.approx(recompute(cl, terms, node, [g], d, capacity, ctx))
                        checked += 1
            else:
                left = np.where(cl.gpu_ok[rows], cl.core_free[rows], 0)
                choice = bestfit_choice(left, cand[rows], d.count) if d.count else None
                delta = (
                    capacity_delta_per_node(cl, cache, rows, d, choice)
                    if capacity
                    else frag_delta_per_node(cl, terms, rows, d, choice, cache)
                )
                for j, node in enumerate(rows[:6]):
                    gpus = [] if choice is None else [int(x) for x in choice[j]]
                    assert delta[j] == pytest.approx(recompute(cl, terms, node, gpus, d, capacity, ctx))
                    checked += 1
        p = place(cl, d, "fgd", None, ctx)
        if p is not None:
            cl.take(p.node, p.gpus, d)
    assert checked > 50


def test_fgd_prefers_the_placement_that_strands_less():
    # One node has a GPU with 500 free; a 470 share there leaves 30 (useless), on a fresh GPU it leaves 530
    # (usable by the 470 shape). FGD puts it where the fragment grows least: the half-used GPU.
    cl = ClusterState.from_arrays(["a", "b"], ["T4", "T4"], [2, 2], [64_000, 64_000], [256 * GIB] * 2)
    half = Demand(1, 500, 0, 0, False, 1000, GIB, None)
    cl.take(0, [0], half)
    share = Demand(1, 470, 0, 0, False, 1000, GIB, None)
    wl = Workload.from_demands([share] * 5 + [Demand.whole(1, 1000, GIB)] * 5)
    p = place(cl, share, "fgd", None, ScoreContext(workload=wl))
    assert (p.node, p.gpus) == (0, (0,))
