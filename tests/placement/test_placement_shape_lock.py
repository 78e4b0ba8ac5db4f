"""One share shape per GPU (strict MPS enforcement): the lock in the placement core and the simulator's study."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from trace_slices import trace_slice

from kubegpu.model.share_shape import share_shape
from kubegpu.placement.cluster import Demand
from kubegpu.placement.engine import place
from kubegpu.placement.policies import ScoreContext
from kubegpu.placement.shape_lock import ShapeLocks
from kubegpu.sim.enforcement_study import MODES, study_list
from kubegpu.sim.replay import replay
from kubegpu.sim.trace import load_nodes, load_pods


def _cut(tmp_path: Path, n_nodes: int = 40, n_pods: int = 300) -> tuple[Path, Path]:
    return trace_slice(tmp_path, n_nodes, n_pods)


def test_a_gpu_takes_one_shape_until_it_is_empty(tmp_path: Path) -> None:
    n, _ = _cut(tmp_path, n_nodes=1)
    cluster = load_nodes(n).cluster()
    locks = ShapeLocks.of(cluster)
    ctx = ScoreContext()
    quarter, half = Demand.share(250), Demand.share(500)
    first = place(cluster, quarter, "bestfit", ctx=ctx, allowed=locks.allowed(quarter))
    assert first is not None
    cluster.take(first.node, first.gpus, quarter)
    locks.take(first.node, first.gpus, quarter)
    quarter_shape = share_shape(25, 0, int(cluster.gmem_cap[first.node, first.gpus[0]]))  # no memory: all of it
    assert locks.describe(first.node, first.gpus[0]) == quarter_shape
    # Best fit alone would stack the half share on the quarter's GPU; the lock sends it elsewhere.
    assert place(cluster, half, "bestfit", ctx=ctx).gpus == first.gpus  # type: ignore[union-attr]
    other = place(cluster, half, "bestfit", ctx=ctx, allowed=locks.allowed(half))
    assert other is not None and other.gpus != first.gpus
    with pytest.raises(ValueError, match="locked to another share shape"):
        locks.take(first.node, first.gpus, half)
    again = place(cluster, quarter, "bestfit", ctx=ctx, allowed=locks.allowed(quarter))
    assert again is not None and again.gpus == first.gpus  # the same shape joins
    cluster.take(again.node, again.gpus, quarter)
    locks.take(again.node, again.gpus, quarter)
    assert locks.allowed(Demand.whole(1)) is None  # whole GPUs need an empty GPU anyway
    locks.give_back(first.node, first.gpus, quarter)
    assert locks.describe(first.node, first.gpus[0]) == quarter_shape  # one share still holds it
    locks.give_back(first.node, first.gpus, quarter)
    assert locks.describe(first.node, first.gpus[0]) is None
    allowed = locks.allowed(half)
    assert allowed is not None and bool(allowed[first.node, first.gpus[0]])


def test_the_simulator_never_mixes_shapes_on_a_gpu_under_the_lock(tmp_path: Path) -> None:
    n, p = _cut(tmp_path)
    pods = load_pods(p)
    r = replay(load_nodes(n), pods, "kubegpu", 42, record=True, shape_locks=True)
    shapes: dict[tuple[int, int], set[int]] = defaultdict(set)
    for k, where in enumerate(r.placements):
        d = pods[r.order[k]].demand
        if where is not None and d.is_share:
            for j in where[1]:
                shapes[(where[0], j)].add(d.milli)
    assert shapes and all(len(s) == 1 for s in shapes.values())
    free = replay(load_nodes(n), pods, "kubegpu", 42, record=True)
    mixed = defaultdict(set)
    for k, where in enumerate(free.placements):
        d = pods[free.order[k]].demand
        if where is not None and d.is_share:
            mixed[(where[0], where[1][0])].add(d.milli)
    assert any(len(s) > 1 for s in mixed.values())  # without the lock, shapes do share GPUs here


def test_the_enforcement_study_reports_each_mode(tmp_path: Path) -> None:
    n, p = _cut(tmp_path)
    got = study_list(load_nodes(n), load_pods(p), "kubegpu", [42])
    assert set(got) == set(MODES)
    base = got["none"]
    assert got["per-shape"]["unallocated_pct_at_100"] == base["unallocated_pct_at_100"]  # placement unchanged
    assert got["strict-shape-lock"]["escape_pct_of_gpu_mean"] == 0 == got["per-shape"]["escape_pct_of_gpu_mean"]
    assert 0 < got["strict-ceiling"]["escape_pct_of_gpu_mean"] < base["escape_pct_of_gpu_mean"]
    assert got["strict-shape-lock"]["servers_per_shared_gpu_mean"] == 1
    assert got["per-shape"]["servers_per_shared_gpu_mean"] > 1
    assert np.isfinite(got["strict-shape-lock"]["turned_away_at_100"])
