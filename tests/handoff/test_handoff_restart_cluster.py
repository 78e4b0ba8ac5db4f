"""A node-daemon restart over the stand-in cluster (the real daemon, extender and stand-in kubelet): stopped
(SIGTERM) while shares and whole GPUs are being bound there, it loses no pod; the extender refuses the node
while it is down, with the reason, and places there again once the next daemon serves. Killed (SIGKILL), the
daemon says nothing: the extender learns it from the kubelet's device counts on the Node."""

from __future__ import annotations

from typing import Any

import pytest
from polling import until

from kubegpu.model import node_daemon as ND
from kubegpu_standins.gpu_cluster import GpuCluster, NodeSpec, pod, share, whole


def not_serving(c: GpuCluster, node: str) -> str:
    """Why the extender places nothing on ``node`` now ('' when it does)."""
    ext = c.ext
    assert ext is not None and ext.service is not None
    view = ext.service.view
    return str(ext.call(lambda: view.handoffs.not_serving.get(node, "")))


def filter_reason(c: GpuCluster, p: dict[str, Any], node: str) -> str:
    """The extender's filter answer for ``p`` on ``node``: its reason, or '' when it passes."""
    assert c.ext is not None
    created = next(o for o in c.api.objects("pods") if o["metadata"]["name"] == p["metadata"]["name"])
    out = c.http.post(f"{c.ext.url}/scheduler/filter", json={"Pod": created, "NodeNames": [node]}).json()
    return str((out.get("FailedNodes") or {}).get(node, ""))


def phases(c: GpuCluster, names: set[str]) -> dict[str, str]:
    return {o["metadata"]["name"]: (o.get("status") or {}).get("phase", "")
            for o in c.api.objects("pods") if o["metadata"]["name"] in names}


def daemon_state(c: GpuCluster, node: str) -> ND.DaemonState | None:
    obj = next(n for n in c.api.objects("nodes") if n["metadata"]["name"] == node)
    return ND.decode((obj["metadata"].get("annotations") or {}).get(ND.NODE_DAEMON))


@pytest.mark.timeout(300)  # a guard against a hang, not a bound on speed
def test_a_node_daemon_stopped_mid_bind_turns_no_pod_away() -> None:
    with GpuCluster([NodeSpec("gpu-node-4", "dgx-a100")], swap_prob=0.0, seed=11) as c:
        node = c.nodes["gpu-node-4"]
        burst = [pod(f"b{i}", share(10) if i % 2 else whole(1)) for i in range(12)]
        for p in burst:
            c.create(p)
        first = node.daemon.boot
        assert until(lambda: len(c.binds) >= 3, 60)
        node.stop_daemon()  # SIGTERM while the burst is being bound and admitted
        state = daemon_state(c, "gpu-node-4")
        assert state is not None and state.state == ND.STOPPING and state.boot == first
        assert until(lambda: "is restarting" in not_serving(c, "gpu-node-4"), 30)
        late = [pod("late-share", share(10)), pod("late-whole", whole(1))]
        for p in late:
            c.create(p)
            assert until(lambda p=p: "node daemon on gpu-node-4 is restarting" in filter_reason(c, p, "gpu-node-4"), 30)
        node.start_daemon()
        assert until(lambda: not not_serving(c, "gpu-node-4"), 60), "the extender never took the node back"
        state = daemon_state(c, "gpu-node-4")
        assert state is not None and state.state == ND.SERVING and state.boot == node.daemon.boot != first
        names = {p["metadata"]["name"] for p in burst + late}
        assert c.settled(names, timeout_s=120), "pods not admitted in time"
        got = phases(c, names)
        assert got == dict.fromkeys(names, "Running"), {n: (ph, c.why_pending.get(n)) for n, ph in got.items()
                                                         if ph != "Running"}
        assert c.overcommitted() == []


@pytest.mark.timeout(300)
def test_a_killed_node_daemon_is_known_by_the_kubelets_device_counts_until_the_next_one_serves() -> None:
    with GpuCluster([NodeSpec("gpu-node-6", "dgx-a100")], swap_prob=0.0, seed=12, node_status_s=0.2) as c:
        node = c.nodes["gpu-node-6"]
        node.stop_daemon(kill=True)
        state = daemon_state(c, "gpu-node-6")
        assert state is not None and state.state == ND.SERVING  # a killed daemon said nothing
        assert until(lambda: "reports no healthy" in not_serving(c, "gpu-node-6"), 60)
        node.start_daemon()
        assert until(lambda: not not_serving(c, "gpu-node-6"), 60), "the extender never took the node back"
        after = [pod(f"a{i}", share(10) if i % 2 else whole(1)) for i in range(4)]
        for p in after:
            c.create(p)
        names = {p["metadata"]["name"] for p in after}
        assert c.settled(names, timeout_s=120)
        assert phases(c, names) == dict.fromkeys(names, "Running")
