"""End to end, full mode: the stand-in API server, the extender, two `kubegpu node --inventory` daemons with
stand-in kubelets. A mix of whole, shared, multi-GPU and two-container pods goes through filter, prioritize
and bind as kube-scheduler sends them; each node's kubelet then admits its pods in the order it saw them
bound, and every container's environment must be exactly its recorded allocation."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube import make_client
from kubegpu.model import resources as R
from kubegpu.model.allocation import decode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.node.config import load_config
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.handoff import make_resolver
from kubegpu.node.options import load_node_options
from kubegpu.node.publish.kube import KubeNodePublisher
from kubegpu.scheduler.service import ServiceThread
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.kubelet import StandinKubelet

NODES = {"e2e-a100": "dgx-a100", "e2e-v100": "dgx1-v100"}
FLAGS = {"shared-slots": 4, "device-list-strategy": "envvar"}


class Node:
    def __init__(self, name: str, topology: str, kubeconfig: Path, root: Path) -> None:
        self.name = name
        self.dir = root / name
        self.kubelet = StandinKubelet(self.dir / "dp")
        self.kubelet.start()
        self.backend = FakeBackend(topology, node_name=name)
        self.client = make_client(kubeconfig)
        self.resolver = make_resolver(self.client, name, pod_resources_socket=str(self.dir / "pr.sock"),
                                      verify_interval_s=3600)
        publisher = KubeNodePublisher(self.client, name, load_config(flags=FLAGS, env={}))
        settings = {"cdi_dir": str(self.dir / "cdi"), "mig_minors_file": str(self.dir / "mig-minors")}

        def options() -> Any:
            return load_node_options(FLAGS, {}, settings=settings, plugin_dir=str(self.dir / "dp"),
                                     stream_wait_s=2.0, resync_s=0.4)

        self.daemon = NodeDaemon(self.backend, options, publisher=publisher, resolver=self.resolver)
        self.daemon.start()
        assert self.kubelet.wait_registered(R.GPU_SLOTS, timeout_s=10)
        assert self.kubelet.wait_registered(R.NVIDIA_GPU, timeout_s=10)

    def stop(self) -> None:
        self.daemon.stop()
        self.resolver.close()
        self.kubelet.stop()
        self.backend.close()


@pytest.fixture
def world() -> Iterator[tuple[ApiServer, ServiceThread, dict[str, Node]]]:
    root = Path(tempfile.mkdtemp(prefix="kge-", dir="/tmp"))  # unix socket paths must stay short
    api = ApiServer().start()
    nodes: dict[str, Node] = {}
    ext = None
    try:
        for name in NODES:
            api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        kc = api.write_kubeconfig(root / "kubeconfig")
        for name, topo in NODES.items():
            nodes[name] = Node(name, topo, kc, root)
        ext = ServiceThread(kc).start()
        deadline = time.monotonic() + 15
        while ext.call(lambda: sum(r.state is not None for r in ext.service.view.nodes.values())) < len(NODES):
            assert time.monotonic() < deadline, "Device objects not seen by the extender"
            time.sleep(0.05)
        yield api, ext, nodes
    finally:
        if ext is not None:
            ext.stop()
        for n in nodes.values():
            n.stop()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)


def _pod(name: str, *containers: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "e2e"},
            "spec": {"containers": [{"name": f"c{i}", "image": "cuda", "resources": {"limits": lim}}
                                    for i, lim in enumerate(containers)]}}


def _share(core: int, k: int = 1, ratio: int | None = None, mem: str | None = None) -> dict[str, str]:
    out = {R.GPU_CORE: str(core), R.GPU_SLOTS: str(k)}
    if ratio is not None:
        out[R.GPU_MEMORY_RATIO] = str(ratio)
    if mem is not None:
        out[R.GPU_MEMORY] = mem
    return out


MIX = [
    _pod("whole-1", {R.NVIDIA_GPU: "1"}),
    _pod("whole-4", {R.NVIDIA_GPU: "4"}),
    _pod("half-a", _share(50, ratio=50)),
    _pod("half-b", _share(50, ratio=50)),
    _pod("quarter-8g", _share(25, mem="4Gi")),
    _pod("split-2", _share(100, k=2, ratio=60)),
    _pod("two-containers", {R.NVIDIA_GPU: "1"}, _share(30, mem="2Gi")),
    _pod("whole-2", {R.NVIDIA_GPU: "2"}),
    _pod("tenth", _share(10, ratio=10)),
]


def _schedule(http: httpx.Client, pod: dict, nodes: list[str]) -> str:
    args = {"Pod": pod, "Nodes": None, "NodeNames": nodes}
    deadline = time.monotonic() + 15
    while True:  # kube-scheduler retries a pod no node passes (here: the previous pod's acknowledgement)
        out = http.post("/scheduler/filter", json=args).json()
        if out["NodeNames"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert out["Error"] == "" and out["NodeNames"], out
    passed = out["NodeNames"]
    best = passed[0]
    if len(passed) > 1:
        scores = http.post("/scheduler/prioritize", json={**args, "NodeNames": passed}).json()
        best = max(scores, key=lambda h: h["Score"])["Host"]
    meta = pod["metadata"]
    r = http.post("/scheduler/bind", json={"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                           "PodUID": meta["uid"], "Node": best}).json()
    assert r == {"Error": ""}, r
    return best


def test_every_container_gets_its_recorded_gpus(world: tuple[ApiServer, ServiceThread, dict[str, Node]]) -> None:
    api, ext, nodes = world
    http = httpx.Client(base_url=ext.url, timeout=20)
    placed: dict[str, list[dict]] = {n: [] for n in nodes}
    checked = 0
    for spec in MIX:
        pod = api.put_object(spec)
        node_name = _schedule(http, pod, list(nodes))
        placed[node_name].append(pod)
        kubelet = nodes[node_name].kubelet
        # The kubelet admits the pod once bound (the extender binds another pod asking the same number
        # of the same device only after this one is served: docs/handoff.md).
        for admitted in [pod]:
            stored = api.get_object("pods", admitted["metadata"]["name"], "e2e")
            record = decode(stored["metadata"]["annotations"][DEVICE_ALLOCATED])
            for c in stored["spec"]["containers"]:
                limits = c["resources"]["limits"]
                resource, n = ((R.NVIDIA_GPU, int(limits[R.NVIDIA_GPU])) if R.NVIDIA_GPU in limits
                               else (R.GPU_SLOTS, int(limits[R.GPU_SLOTS])))
                got = kubelet.allocate(resource, n)
                env = got.response.envs
                grants = record.for_container(c["name"]).grants
                assert sorted(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(g.uuid for g in grants), c["name"]
                assert {i.split("::")[0] for i in got.device_ids} == {g.uuid for g in grants}  # = the kubelet's
                if resource == R.GPU_SLOTS:
                    assert env["KUBEGPU_GPU_CORE_PERCENT"] == str(grants[0].core)
                    assert env["KUBEGPU_GPU_MEMORY_BYTES"] == str(grants[0].memory_bytes)
                checked += 1
    assert sum(len(v) for v in placed.values()) == len(MIX)
    assert checked == 10
    # No whole GPU is shared, and no GPU is above 100 % compute.
    use: dict[tuple[str, str], int] = {}
    whole: set[tuple[str, str]] = set()
    for p in api.objects("pods", namespace="e2e"):
        for g in decode(p["metadata"]["annotations"][DEVICE_ALLOCATED]).grants():
            key = (p["spec"]["nodeName"], g.uuid)
            use[key] = use.get(key, 0) + g.core
            if g.core == 100:
                assert key not in whole
                whole.add(key)
    assert max(use.values()) <= 100
    # Node capacity was published from the healthy GPUs.
    cap = api.get_object("nodes", "e2e-a100")["status"]["capacity"]
    assert cap[R.GPU_CORE] == "800" and cap[R.GPU_MEMORY_RATIO] == "800"
