"""The simulator's placement is the one a cluster gets: the real extender over HTTP, called the way
kube-scheduler calls it with the profile ``kubegpu manifests`` renders (its search window, the nodes in no
order, its score plugins and weights, ties at random), the handoff wait on and each pod acknowledged by its
node, places every GPU pod where ``replay(..., learned=True, ties="name")`` does. The profile rendered
before this (kube-scheduler's score plugins on) does not, so the comparison can tell them apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubegpu.install.render import scheduler_config
from kubegpu.install.values import Values
from kubegpu.sim.replay import arrival_order, replay
from kubegpu.sim.trace import TraceNodes, load_nodes, load_pods
from kubegpu_standins.kube_scheduler_model import profile_model
from kubegpu_standins.production_replay import ProductionScheduler
from kubegpu_standins.trace_scheduler import agreement, replay_cluster


def small_trace() -> tuple[TraceNodes, list]:
    """60 GPU nodes of the openb node list (every 20th: every model and size) and its GPU pods, every 20th."""
    full = load_nodes().gpu_only()
    keep = list(range(0, len(full.names), 20))[:60]
    nodes = TraceNodes(*(tuple(getattr(full, f)[i] for i in keep)
                         for f in ("names", "models", "gpus", "cpu_milli", "memory_bytes")))
    pods = [p for p in load_pods() if p.demand.count > 0][::20]
    return nodes, pods


@pytest.mark.parametrize("profile", ["rendered", "before"])
def test_kube_scheduler_with_the_rendered_profile_places_every_gpu_pod_where_the_simulator_does(
        tmp_path: Path, profile: str) -> None:
    nodes, pods = small_trace()
    order = arrival_order(pods, nodes.total_gpus * 1000, seed=11, inflate=1.05)
    cfg = scheduler_config(Values(kube_version="1.36"))
    if profile == "before":
        cfg.pop("percentageOfNodesToScore")
        cfg["profiles"] = [{"schedulerName": "kubegpu-scheduler"}]
    model = profile_model(cfg, (1, 36), "kubegpu-scheduler")
    sim = replay(nodes, pods, "kubegpu", seed=11, learned=True, ties="name", record=True, order=order)
    with replay_cluster(nodes, tmp_path) as (api, ext):
        sched = ProductionScheduler(api, ext.url, ext, nodes, model, seed=3)
        out = sched.run(pods, order)
        waiting = ext.call(lambda: sum(len(p) for p in sched.handoffs.pending.values()))
    node_pct, gpu_pct, differ = agreement(sim.placements, out.placements, nodes.names)
    assert waiting == 0  # every bound pod was acknowledged, and the extender saw it
    assert 0 < sched.turned_away < len(order)  # the cluster ran full: the comparison covers contention
    if profile == "rendered":
        assert differ == [], [(k, sim.placements[k], out.placements[k]) for k in differ[:5]]
        assert node_pct == gpu_pct == 100.0
    else:
        assert node_pct < 90.0
