"""Strict MPS enforcement in the extender: a strict GPU takes shares of one shape at a time (the shape its running
shares have, as the node enforces it), over HTTP as kube-scheduler asks; other nodes are unaffected."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from polling import until
from sched_harness import Cluster, filter_, start_cluster
from test_scheduler_behaviour import args, bind, pod, share
from test_scheduler_replay import small_trace

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.device_object import device_object
from kubegpu.model.inventory import NodeInventory
from kubegpu.scheduler.state import ClusterView
from kubegpu.sim.replay import arrival_order, replay
from kubegpu_standins.trace_scheduler import agreement, replay_over_http

NODES = ["gpu-node-a", "gpu-node-c"]


def strict(inv: NodeInventory, lock: str = "") -> NodeInventory:
    return replace(inv, gpus=tuple(replace(g, share_enforcement="strict", compute_mode="Exclusive_Process",
                                           share_shape_lock=lock, share_escapable=False) for g in inv.gpus))


def one_gpu(name: str) -> NodeInventory:
    inv = FakeBackend("dgx-a100", node_name=name).discover()
    return replace(inv, gpus=(replace(inv.gpus[0], links={}),))


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Cluster]:
    """gpu-node-a: one GPU, shares unenforced by MPS; gpu-node-c: one strict GPU."""
    api, ext = start_cluster(tmp_path, [one_gpu("gpu-node-a"), strict(one_gpu("gpu-node-c"))])
    try:
        yield Cluster(api, ext)
    finally:
        ext.stop()
        api.stop()


def passed(cluster: Cluster, p: dict) -> tuple[list[str], dict[str, str]]:
    out = cluster.post("/filter", args(p, NODES)).json()
    return out["NodeNames"], out["FailedNodes"] or {}


def delete(cluster: Cluster, name: str) -> None:
    cluster.api.store.delete(cluster.api.kind("pods"), "default", name)
    assert until(lambda: cluster.ext.call(lambda: f"default/{name}" not in cluster.view.ledger.held), 60)


LOCKED = "node gpu-node-c: GPU 0 serves shares of 25 percent / 10Gi only (strict MPS)"


def test_a_strict_gpu_takes_one_share_shape_until_its_shares_end(locked: Cluster) -> None:
    assert bind(locked, pod("q1", share(25, mem="10Gi")), "gpu-node-c") == ""
    half = pod("h", share(50, mem="20Gi"))
    names, failed = passed(locked, half)
    assert names == ["gpu-node-a"] and failed == {"gpu-node-c": LOCKED}
    assert LOCKED in bind(locked, half, "gpu-node-c")  # bind keeps to it as well
    # The same shape joins; on the node without strict enforcement shapes mix.
    assert passed(locked, pod("q", share(25, mem="10Gi")))[0] == NODES
    assert bind(locked, pod("q2", share(25, mem="10Gi")), "gpu-node-c") == ""
    assert bind(locked, pod("a1", share(25, mem="10Gi")), "gpu-node-a") == ""
    assert bind(locked, pod("a2", share(50, mem="20Gi")), "gpu-node-a") == ""
    # The lock falls with the GPU's last share, not before.
    delete(locked, "q1")
    assert passed(locked, pod("h2", share(20, mem="20Gi")))[1] == {"gpu-node-c": LOCKED}
    delete(locked, "q2")
    assert passed(locked, pod("h3", share(20, mem="20Gi")))[0] == NODES
    assert bind(locked, pod("h4", share(20, mem="20Gi")), "gpu-node-c") == ""


def test_the_lock_compares_what_the_node_enforces_a_ratio_resolved_to_bytes(locked: Cluster) -> None:
    cap = one_gpu("x").gpus[0].memory_bytes
    assert bind(locked, pod("bytes", share(25, mem=str(cap // 4))), "gpu-node-c") == ""
    assert bind(locked, pod("ratio", share(25, ratio=25)), "gpu-node-c") == ""  # the same 25 % / a quarter
    names, failed = passed(locked, pod("more", share(25, ratio=20)))
    assert names == ["gpu-node-a"] and "serves shares of 25 percent / " in failed["gpu-node-c"]


def test_the_lock_the_node_reports_counts_before_the_extender_knows_its_shares(locked: Cluster) -> None:
    # A share the ledger does not hold (its pod went, its container still runs): the node says the GPU's lock.
    reported = device_object(strict(one_gpu("gpu-node-c"), lock="25% / 10240M"))
    locked.api.store.update(locked.api.kind("devices", "kubegpu.io"), "", "gpu-node-c",
                            lambda o: {**reported, "metadata": o["metadata"]})
    assert until(lambda: passed(locked, pod("h", share(50, mem="20Gi")))[1] == {"gpu-node-c": LOCKED}, 60)
    assert passed(locked, pod("q", share(25, mem="10Gi")))[0] == NODES
    assert passed(locked, pod("w", {"nvidia.com/gpu": "1"}))[0] == NODES  # whole GPUs: the node's matter


def test_a_pod_fitted_node_by_node_keeps_to_the_lock(locked: Cluster) -> None:
    two = pod("two", [share(25, mem="10Gi"), share(50, mem="20Gi")])  # two shapes on the one GPU
    names, failed = passed(locked, two)
    assert names == ["gpu-node-a"]
    assert failed["gpu-node-c"] == ("node gpu-node-c: GPU 0 serves shares of 25 percent / 10Gi only (strict MPS); "
                                    "this pod's share there is 50 percent / 20Gi")
    assert bind(locked, pod("q1", share(25, mem="10Gi")), "gpu-node-c") == ""
    same = pod("same", [share(25, mem="10Gi"), share(25, mem="10Gi")])
    assert passed(locked, same)[0] == NODES


def test_the_extender_keeps_to_the_locks_where_the_simulator_does(tmp_path: Path) -> None:
    nodes, pods = small_trace()
    order = arrival_order(pods, nodes.total_gpus * 1000, seed=7, inflate=1.1)
    sim = replay(nodes, pods, "kubegpu", seed=7, learned=True, ties="name", record=True, order=order,
                 shape_locks=True)
    free = replay(nodes, pods, "kubegpu", seed=7, learned=True, ties="name", record=True, order=order)
    assert sim.placements != free.placements  # the locks change placements on this trace
    out = replay_over_http(nodes, pods, order, tmp_path, share_enforcement="strict")
    _, same_gpus_pct, differ = agreement(sim.placements, out.placements, nodes.names)
    assert same_gpus_pct == 100.0, [(k, sim.placements[k], out.placements[k]) for k in differ[:5]]


def test_a_share_over_several_gpus_takes_strict_gpus_no_share_holds() -> None:
    inv = FakeBackend("dgx-a100", node_name="gpu-node-d").discover()
    two = strict(replace(inv, gpus=tuple(replace(g, links={}) for g in inv.gpus[:2])))
    view = ClusterView(handoff_wait=False)
    view.set_inventory("gpu-node-d", two)
    gpu0 = two.gpus[0]
    view.ledger.hold("default/q", "uid-q", "gpu-node-d", PodAllocation((ContainerAllocation(
        "c", (DeviceGrant(gpu0.minor, gpu0.uuid, 25, 10 * 2**30, 0),)),)))
    out = filter_(view, pod("wide", share(50, mem="20Gi", k=2)), ["gpu-node-d"])
    assert list(out.passed) == []
    assert dict(out.failed)["gpu-node-d"] == (
        f"node gpu-node-d: GPU {gpu0.index} serves shares of 25 percent / 10Gi only (strict MPS) "
        "(a share over several GPUs takes GPUs no share holds)")
    # Once placed over both GPUs, its twin's per-GPU shape does not join them either (one server over exactly
    # those GPUs; the node would refuse a server over another set).
    view.ledger.release("default/q")
    assert list(filter_(view, pod("wide", share(50, mem="20Gi", k=2)), ["gpu-node-d"]).passed) == ["gpu-node-d"]
    view.ledger.hold("default/w", "uid-w", "gpu-node-d", PodAllocation((ContainerAllocation(
        "c", tuple(DeviceGrant(g.minor, g.uuid, 25, 10 * 2**30, 0) for g in two.gpus)),)))
    one = filter_(view, pod("one", share(25, mem="10Gi")), ["gpu-node-d"])
    assert "serves shares of 25 percent / 10Gi over 2 GPUs only" in dict(one.failed)["gpu-node-d"]
