"""Helpers for the extender tests: the fixture's three nodes with Device objects in the stand-in API server,
and the extender itself on a real loopback port."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from kubegpu.cli.scheduler import environment_settings
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.device_object import device_object
from kubegpu.model.inventory import NodeInventory
from kubegpu.placement import PlacementConflict
from kubegpu.scheduler.limits import Limits, bounded_filter, fitted_node_by_node
from kubegpu.scheduler.plan import PlanSettings, PodPlan, plan_pod
from kubegpu.scheduler.service import ServiceThread
from kubegpu.scheduler.state import ClusterView
from kubegpu.scheduler.verbs import FilterOutcome
from kubegpu_standins.apiserver import ApiServer

# Recorded from a real kube-scheduler v1.24 (the bodies it sent, its nodes, the pods), shipped with the tests.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kube-scheduler-v1.24"


def fixture_inventories() -> list[NodeInventory]:
    a = FakeBackend("dgx-a100", node_name="gpu-node-a").discover()
    b = FakeBackend("dgx-h100", node_name="gpu-node-b").discover()
    one = FakeBackend("dgx-a100", node_name="gpu-node-c").discover()
    c = replace(one, gpus=(replace(one.gpus[0], links={}),))
    return [a, b, c]


def fixture_nodes() -> list[dict]:
    data = json.loads((FIXTURES / "nodecache-true" / "nodes.json").read_text())
    out = []
    for node in data["items"] if isinstance(data, dict) else data:
        node = copy.deepcopy(node)
        for k in ("resourceVersion", "uid", "managedFields", "creationTimestamp"):
            node["metadata"].pop(k, None)
        node["apiVersion"], node["kind"] = "v1", "Node"
        out.append(node)
    return out


def fixture_pod(name: str) -> dict:
    """A fixture pod as the API server holds it (with the recorded UID, so recorded binds match)."""
    body = json.loads((FIXTURES / "nodecache-true" / "raw" / _raw_name(name)).read_bytes())
    pod = copy.deepcopy(body["Pod"])
    for k in ("resourceVersion", "managedFields", "creationTimestamp"):
        pod["metadata"].pop(k, None)
    pod["apiVersion"], pod["kind"] = "v1", "Pod"
    return pod


def _raw_name(pod: str) -> str:
    for f in sorted((FIXTURES / "nodecache-true" / "raw").glob("*-filter-*.request.body")):
        if f.name.split("-filter-")[1] == f"{pod}.request.body":
            return f.name
    raise KeyError(pod)


def pod_yaml(name: str) -> dict:
    return yaml.safe_load((FIXTURES / "pods" / f"{name}.yaml").read_text())


class Cluster:
    def __init__(self, api: ApiServer, ext: ServiceThread) -> None:
        self.api, self.ext = api, ext
        self.http = httpx.Client(base_url=ext.url, timeout=10)

    def post(self, path: str, body: bytes | dict) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(path, content=content, headers={"Content-Type": "application/json"})

    @property
    def view(self):
        assert self.ext.service is not None
        return self.ext.service.view


def start_cluster(tmp_path: Path, inventories: list[NodeInventory] | None = None,
                  nodes: list[dict] | None = None, filter_wait_s: float = 0.0,
                  **policies: str) -> tuple[ApiServer, ServiceThread]:
    """The API server with ``nodes`` and ``inventories`` (the fixture's by default) and the extender watching it.
    These tests post filters without the binds kube-scheduler sends after them, so by default no filter waits for
    a bind (``filter_wait_s``; the tests of that wait give their own)."""
    api = ApiServer(history=5000).start()
    for node in nodes if nodes is not None else fixture_nodes():
        api.put_object(node)
    for inv in inventories if inventories is not None else fixture_inventories():
        api.put_object(device_object(inv))
    kc = api.write_kubeconfig(tmp_path / "kubeconfig")
    env = environment_settings(os.environ)  # the conftest and some tests set the handoff wait's variables
    ext = ServiceThread(kc, handoff_wait=env["handoff_wait"], handoff_wait_s=env["handoff_wait_s"],
                        filter_wait_s=filter_wait_s, **policies).start()
    return api, ext




def hold_random(view: ClusterView, rng: random.Random, nodes: list[str], key: str) -> bool:
    """A pod ``key`` takes a share or whole GPUs (one or two, 10–100 %) on a random node of ``view``; False when
    the node has no GPUs known or the GPUs drawn cannot take it (what the churn tests draw next instead)."""
    node = rng.choice(nodes)
    rec = view.nodes[node]
    if rec.inventory is None:
        return False
    gpus = rng.sample(list(rec.inventory.gpus), rng.randint(1, 2))
    core = rng.choice([10, 25, 50, 100])
    grants = tuple(DeviceGrant(g.minor, g.uuid, core, g.memory_bytes * core // 100, core) for g in gpus)
    try:
        view.ledger.hold(key, key, node, PodAllocation((ContainerAllocation("c", grants),)))
    except PlacementConflict:
        return False
    return True


def mark_running(cluster: Cluster, name: str) -> None:
    """The kubelet admitted pod ``default/<name>`` and runs it (its Allocate calls are done)."""
    store = cluster.api.store
    store.update(cluster.api.kind("pods"), "default", name, lambda o: {**o, "status": {"phase": "Running"}},
                 subresource="status")


def plan_of(pod: dict[str, Any], **settings: Any) -> PodPlan:
    """The pod's plan as the extender makes it, with the default settings (or ``settings``)."""
    return plan_pod(pod, PlanSettings(**settings))


def filter_(view: ClusterView, pod: dict[str, Any], names: Sequence[str]) -> FilterOutcome:
    """The extender's filter of ``pod`` over ``names`` (the array paths and the node-by-node fit alike)."""
    plan = plan_of(pod)
    if not fitted_node_by_node(plan):
        return view.filter(plan, names)  # no loop: nothing formats the answer before the caller reads it
    return asyncio.run(bounded_filter(view, plan, names, Limits(filter_budget_s=3600)))  # no time budget


def blocked(view: ClusterView, pod: dict[str, Any]) -> dict[str, str]:
    """The nodes where ``pod`` would wait for its handoff turn, with why."""
    plan = plan_of(pod)
    return view.handoffs.blocked(plan.key, plan.shapes)


def observe(view: ClusterView, pod: dict[str, Any], deleted: bool = False, version: str = "") -> None:
    """A pod event from the watch, as the extender's pod handler hands it to the accounting."""
    view.ledger.observe_pod(pod, plan_of(pod), deleted, version)
