"""The filter's kept per-node work: the reasons a node cannot take a demand (``ReasonCache``, by row
version) and the GPU candidates and their per-node counts (``ArrayMirror.candidates``, by layout and row
version) answer exactly what computing them afresh answers, through holds, releases, new and removed
nodes."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sched_harness import hold_random

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.placement import Demand
from kubegpu.scheduler.reasons import insufficient
from kubegpu.scheduler.state import ClusterView

DEMANDS = [Demand.whole(1), Demand.whole(2), Demand.whole(4), Demand.share(500), Demand.share(250),
           Demand.share(250, count=2), Demand.share(900)]


def check(view: ClusterView, rng: random.Random) -> None:
    cluster = view.mirror.cluster
    for d in DEMANDS:
        fresh = cluster.gpu_candidates(d)
        kept = view.mirror.candidates(d)
        assert np.array_equal(kept, fresh) and not kept.flags.writeable
        counts = view.mirror.candidate_counts(d)
        assert np.array_equal(counts, fresh.sum(axis=1)) and not counts.flags.writeable
        rows = np.array(rng.sample(range(cluster.n_nodes), rng.randint(1, cluster.n_nodes)), np.int64)
        assert view.mirror.reasons.insufficient(cluster, rows, d, kept) == insufficient(cluster, rows, d)
        assert view.mirror.reasons.insufficient(cluster, rows, d) == insufficient(cluster, rows, d)


@pytest.mark.parametrize("seed", range(3))
def test_kept_reasons_and_candidates_follow_every_change(seed: int) -> None:
    rng = random.Random(seed)
    view = ClusterView(handoff_wait=False)
    nodes = [f"n{i}" for i in range(6)]
    for n in nodes:
        view.set_inventory(n, FakeBackend(rng.choice(["t4x4", "dgx-a100"]), node_name=n).discover())
    held: list[str] = []
    for step in range(120):
        check(view, rng)
        op = rng.random()
        if op < 0.6:  # a pod takes a share or whole GPUs on some node
            key = f"d/p{step}"
            if not hold_random(view, rng, nodes, key):
                continue
            held.append(key)
        elif op < 0.9 and held:  # one leaves
            view.ledger.release(held.pop(rng.randrange(len(held))))
        elif op < 0.95:  # a node's Device object goes away, or comes back: new arrays, new layout
            node = rng.choice(nodes)
            if view.nodes[node].inventory is None:
                view.set_inventory(node, FakeBackend("t4x4", node_name=node).discover())
            else:
                view.set_inventory(node, None)
        else:  # a new node joins
            node = f"n{len(nodes)}"
            nodes.append(node)
            view.set_inventory(node, FakeBackend("dgx-a100", node_name=node).discover())
    check(view, rng)


def test_one_situation_is_one_text_whichever_gpus_it_is_on() -> None:
    """Nodes alike but for which GPU is busy give kube-scheduler's event one reason to count, not one per GPU;
    nodes with less free get another."""
    view = ClusterView(handoff_wait=False)
    for n in ("a", "b", "c"):
        view.set_inventory(n, FakeBackend("t4x4", node_name=n).discover())

    def share(key: str, node: str, index: int, core: int) -> None:
        gpu = view.nodes[node].inventory.gpus[index]  # type: ignore[union-attr]
        grant = DeviceGrant(gpu.minor, gpu.uuid, core, gpu.memory_bytes * core // 100, core)
        view.ledger.hold(key, key, node, PodAllocation((ContainerAllocation("c", (grant,)),)))

    for node, busy in (("a", 0), ("b", 3), ("c", 1)):  # three GPUs 60 % used, the fourth on a and b 40 %
        for i in range(4):
            share(f"d/{node}{i}", node, i, 60 if i != busy or node == "c" else 40)
    cluster = view.mirror.cluster
    rows = view.mirror.rows_of(["a", "b", "c"])
    a, b, c = insufficient(cluster, rows, Demand.share(700))
    assert a == b == "GPU compute free: 60 percent at most, 70 percent requested"
    assert c == "GPU compute free: 40 percent at most, 70 percent requested"
    a, b, c = insufficient(cluster, rows, Demand.whole(1))
    assert a == b == c == "free whole GPUs: 0 of 4, 1 requested"
