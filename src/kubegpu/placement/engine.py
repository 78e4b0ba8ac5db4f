"""Placing one demand on a cluster: filter, score the nodes, pick one, choose its GPUs.

This is the loop body the extender and the simulator share. Nothing here
changes the cluster; the caller commits the :class:`Placement` with
``ClusterState.take`` (and undoes it with ``give_back``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.policies import Policy, ScoreContext, bestfit_choice, get_policy
from kubegpu.placement.topology import best_set


@dataclass(frozen=True, slots=True)
class Placement:
    """A node (row of the cluster) and the GPU slots on it, with the node's score."""

    node: int
    gpus: tuple[int, ...]
    score: float


def pick_best(scores: np.ndarray, rng: np.random.Generator | None = None, rank: np.ndarray | None = None) -> int:
    """Index of the highest score. Ties: at random with ``rng`` (as stock kube-scheduler does),
    else the lowest ``rank`` (same length as ``scores``), else the lowest index."""
    top = np.flatnonzero(scores == scores.max())
    if len(top) == 1:
        return int(top[0])
    if rng is not None:
        return int(top[rng.integers(len(top))])
    if rank is not None:
        return int(top[np.argmin(rank[top])])
    return int(top[0])


def score_nodes(
    cluster: ClusterState, demand: Demand, policy: str | Policy = "kubegpu", ctx: ScoreContext | None = None,
    allowed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(feasible node rows, their scores) for a demand; vectorised over every node. ``allowed`` ((N, G) bool)
    narrows the GPUs a rule outside the free capacity admits (a GPU's share-shape lock)."""
    ctx = ctx or ScoreContext()
    cand = cluster.gpu_candidates(demand)
    if allowed is not None:
        cand = cand & allowed
    feasible = cluster.feasible(demand, cand)
    rows = np.flatnonzero(feasible)
    if len(rows) == 0:
        return rows, np.zeros(0)
    return rows, np.asarray(get_policy(policy).node_scores(cluster, demand, rows, cand[rows], ctx), np.float64)


def choose_gpus(
    cluster: ClusterState,
    node: int,
    demand: Demand,
    gpu_policy: str | Policy = "kubegpu",
    ctx: ScoreContext | None = None,
    allowed: np.ndarray | None = None,
) -> tuple[int, ...]:
    """The GPU slots of ``node`` for ``demand`` (empty for CPU-only). Raises ValueError when it does not fit.

    Whole GPUs follow the node's link topology (best NVLink set, keeping good
    sets whole) or, without one, the lowest free slots. Shares go to the GPUs
    the GPU-level policy scores highest.
    """
    if demand.count == 0:
        return ()
    ctx = ctx or ScoreContext()
    cand = cluster.gpu_candidates(demand)[node]
    if allowed is not None:
        cand = cand & allowed[node]
    slots = np.flatnonzero(cand)
    if len(slots) < demand.count:
        raise ValueError(f"{cluster.names[node]}: {len(slots)} GPUs can take this, {demand.count} needed")
    if demand.exclusive:
        links = None if cluster.links is None else cluster.links[node]
        if links is None or not links.any() or demand.count == len(slots):
            return tuple(int(s) for s in slots[: demand.count])
        return tuple(int(s) for s in best_set(links.tolist(), slots.tolist(), [], demand.count))
    policy = get_policy(gpu_policy)
    scores = np.asarray(policy.gpu_scores(cluster, node, demand, cand, ctx), np.float64).copy()
    scores[~cand] = -np.inf
    if demand.count == 1:
        if policy.name == "random" and ctx.rng is not None:
            return (int(slots[ctx.rng.integers(len(slots))]),)
        return (int(np.argmax(scores)),)
    # Highest scores first; lowest slot first on ties.
    order = np.lexsort((np.arange(len(scores)), -scores))
    return tuple(sorted(int(s) for s in order[: demand.count]))


def place(
    cluster: ClusterState,
    demand: Demand,
    node_policy: str | Policy = "kubegpu",
    gpu_policy: str | Policy | None = None,
    ctx: ScoreContext | None = None,
    allowed: np.ndarray | None = None,
) -> Placement | None:
    """Where ``demand`` goes under the given policies, or ``None`` when no node can take it.

    ``gpu_policy`` defaults to the node policy's paired GPU-level policy; ``allowed``: see :func:`score_nodes`.
    """
    ctx = ctx or ScoreContext()
    npol = get_policy(node_policy)
    if gpu_policy is None:
        gpu_policy = npol.gpu_default
    if gpu_policy == npol.name:
        gpu_policy = npol  # the same instance: its kept per-GPU scores serve the GPU choice
    rows, scores = score_nodes(cluster, demand, npol, ctx, allowed)
    if len(rows) == 0:
        return None
    rank = None if ctx.node_rank is None else ctx.node_rank[rows]
    i = pick_best(scores, ctx.rng if ctx.random_ties else None, rank)
    node = int(rows[i])
    gpus = choose_gpus(cluster, node, demand, gpu_policy, ctx, allowed)
    return Placement(node, gpus, float(scores[i]))


__all__ = ["Placement", "bestfit_choice", "choose_gpus", "pick_best", "place", "score_nodes"]
