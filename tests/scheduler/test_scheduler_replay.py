"""The extender places exactly as the simulator does: the real extender app over HTTP (filter, prioritize,
bind with the bodies kube-scheduler sends, the stand-in API server) against ``kubegpu simulate``'s replay,
given the same pods in the same order and the same workload learned online from the pods placed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kubegpu.placement.workload import LearnedWorkload
from kubegpu.sim.replay import arrival_order, replay
from kubegpu.sim.trace import TraceNodes, load_nodes, load_pods
from kubegpu_standins.trace_scheduler import TraceScheduler, agreement, replay_cluster, start_replay_cluster


def small_trace() -> tuple[TraceNodes, list]:
    """50 GPU nodes of the packaged openb node list (every 24th, so every model and size is there) and
    150 of its pods (every 50th: shares, whole GPUs and CPU-only pods)."""
    full = load_nodes().gpu_only()
    keep = list(range(0, len(full.names), 24))[:50]
    nodes = TraceNodes(*(tuple(getattr(full, f)[i] for i in keep)
                         for f in ("names", "models", "gpus", "cpu_milli", "memory_bytes")))
    pods = load_pods()[::50][:150]
    return nodes, pods


@pytest.mark.parametrize("policy", ["kubegpu", "fgd"])
def test_extender_over_http_places_every_pod_where_the_simulator_does(tmp_path: Path, policy: str) -> None:
    nodes, pods = small_trace()
    capacity = nodes.total_gpus * 1000
    order = arrival_order(pods, capacity, seed=7, inflate=1.1)
    assert len(order) >= 180
    sim = replay(nodes, pods, policy, seed=7, learned=True, ties="name", record=True, order=order)
    with replay_cluster(nodes, tmp_path, policy) as (api, ext):
        out = TraceScheduler(api, ext.url, nodes).run(pods, order)
        learned = httpx.get(f"{ext.url}/apis/v1/plugins/DeviceShare/workload").json()
        metrics = httpx.get(f"{ext.url}/metrics").text
    node_pct, gpu_pct, differ = agreement(sim.placements, out.placements, nodes.names)
    assert differ == [], [(k, sim.placements[k], out.placements[k]) for k in differ[:5]]
    assert node_pct == gpu_pct == 100.0
    dropped = sum(p is None for p in out.placements)
    assert 0 < dropped < len(order)  # the cluster ran full: the comparison covers contention
    assert learned["generation"] > 3 and learned["live_pods"] > 0  # the workload was learned as pods came
    assert abs(sum(s["frequency"] for s in learned["shapes"]) - 1.0) < 1e-4
    assert f'kubegpu_learned_workload{{what="live_pods"}} {float(learned["live_pods"])}' in metrics


def test_a_restarted_extender_rebuilds_the_same_accounting_and_learned_workload(tmp_path: Path) -> None:
    from kubegpu.scheduler.service import ServiceThread

    nodes, pods = small_trace()
    order = arrival_order(pods, nodes.total_gpus * 1000, seed=3, inflate=0.8)
    api, ext = start_replay_cluster(nodes, tmp_path)

    def snapshot(thread: ServiceThread) -> tuple:
        def read() -> tuple:
            view = thread.service.view
            view.scoring.learner.rebuild()  # what a restart does with the live pods
            wl = view.scoring.workload
            cluster = view.mirror.cluster
            rows = {n: i for i, n in enumerate(cluster.names)}
            free = {n: (int(cluster.cpu_free[r]), int(cluster.mem_free[r]), cluster.core_free[r].tolist())
                    for n, r in rows.items()}
            return wl.shapes, wl.freq.round(12).tolist(), wl.every_freq.round(12).tolist(), free
        return thread.call(read)

    try:
        out = TraceScheduler(api, ext.url, nodes).run(pods, order)
        assert sum(p is not None for p in out.placements) > 50
        before = snapshot(ext)
        ext.stop()
        again = ServiceThread(api.write_kubeconfig(tmp_path / "kc2"), handoff_wait=False).start(timeout_s=60)
        try:
            after = snapshot(again)
            summary = again.call(lambda: again.service.view.scoring.learner.summary())
        finally:
            again.stop()
    finally:
        api.stop()
    assert after == before
    assert summary["live_pods"] == sum(p is not None and LearnedWorkload.shape_of(pods[order[k]].demand) is not None
                                       for k, p in enumerate(out.placements))
