"""A fast stand-in kube-scheduler for replaying a trace through the real extender over HTTP.

:class:`~kubegpu_standins.scheduler.StandinScheduler` lists every pod and node
per pod, which is right for a handful of pods and far too slow for the openb
trace. This one keeps kube-scheduler's own ``NodeResourcesFit`` (CPU and
memory requests against allocatable) in arrays and, per pod, in the given
order: creates the pod in the stand-in API server, sends ``filter`` with the
names of the nodes that fit (``nodeCacheCapable``), ``prioritize`` with the
nodes the extender kept (when more than one), takes the highest score (ties:
lowest name, as the stand-in scheduler does), and sends ``bind``; the
extender writes the Binding and its annotation to the API server. A pod no
node takes is deleted (the simulator drops it too).

The extender is configured for every pod (no ``managedResources``): CPU-only
pods on GPU nodes are placed by the same policy, as the simulator places them.
Used by ``bench/extender_replay.py`` and ``tests/scheduler/test_scheduler_replay.py``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model.allocation import decode
from kubegpu.model.device_object import device_object
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.sim.trace import TraceNodes, TracePod
from kubegpu_standins.apiserver import ApiServer

GPU_MEMORY = 32 * 2**30
NAMESPACE = "replay"
HEADERS = {"Content-Type": "application/json", "User-Agent": "Go-http-client/1.1"}


def trace_inventories(nodes: TraceNodes) -> list[NodeInventory]:
    """One inventory per trace node: its GPUs (model as the trace names it, no NVLink), CPU and memory."""
    out = []
    for name, model, n, cpu, mem in zip(nodes.names, nodes.models, nodes.gpus, nodes.cpu_milli, nodes.memory_bytes,
                                        strict=True):
        gpus = tuple(Gpu(f"GPU-{name}-{j}", j, j, model or "GPU", GPU_MEMORY) for j in range(n))
        out.append(NodeInventory(name, gpus, cpu, mem))
    return out


def trace_pod(name: str, tp: TracePod) -> dict[str, Any]:
    """A v1 Pod asking for what a trace pod asks: CPU and memory requests, whole GPUs or a share.

    A share is ``kubegpu.io/gpu-core`` (percent) with a 1 % memory ratio (the trace says nothing of GPU
    memory; no GPU of the trace holds enough shares for 1 % each to bind). Allowed models go in the
    ``kubegpu.io/gpu-model`` annotation, in the trace's spelling.
    """
    d = tp.demand
    limits: dict[str, str] = {}
    if d.count and d.exclusive:
        limits[R.NVIDIA_GPU] = str(d.count)
    elif d.count:
        if d.count != 1 or d.milli % 10:
            raise ValueError(f"{tp.name}: a share must be one GPU in whole percents, not {d.count} x {d.milli}")
        limits[R.GPU_CORE] = str(d.milli // 10)
        limits[R.GPU_MEMORY_RATIO] = "1"
    requests = {"cpu": f"{d.cpu_milli}m", "memory": str(d.memory_bytes)}
    annotations = {A.GPU_MODEL: "|".join(sorted(d.models))} if d.models else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations},
        "spec": {"schedulerName": "kubegpu", "containers": [
            {"name": "main", "image": "trace", "resources": {"requests": requests, "limits": limits}}]},
        "status": {"phase": "Pending"},
    }


@dataclass(slots=True)
class ReplayOutcome:
    """Per pod, in order: (node name, GPU minors) or None when dropped; and the time the replay took."""

    placements: list[tuple[str, tuple[int, ...]] | None] = field(default_factory=list)
    seconds: float = 0.0
    verb_seconds: dict[str, list[float]] = field(default_factory=lambda: {"filter": [], "prioritize": [],
                                                                           "bind": []})


def post_verb(http: httpx.Client, url: str, verb: str, body: Any, out: ReplayOutcome) -> Any:
    """One extender verb as kube-scheduler posts it (compact JSON), timed into ``out``."""
    start = time.perf_counter()
    resp = http.post(f"{url}/{verb}", content=json.dumps(body, separators=(",", ":")), headers=HEADERS)
    out.verb_seconds[verb].append(time.perf_counter() - start)
    if resp.status_code != 200:
        raise RuntimeError(f"extender {verb} answered HTTP {resp.status_code}: {resp.text[:200]}")
    return resp.json()


class TraceScheduler:
    """Plays kube-scheduler for a trace against an extender at ``url`` and the stand-in API server ``api``."""

    def __init__(self, api: ApiServer, url: str, nodes: TraceNodes) -> None:
        self.api = api
        self.url = url.rstrip("/")
        self.names = list(nodes.names)
        self.index = {n: j for j, n in enumerate(self.names)}
        self.cpu_free = np.asarray(nodes.cpu_milli, np.int64).copy()
        self.mem_free = np.asarray(nodes.memory_bytes, np.int64).copy()
        self.http = httpx.Client(timeout=30.0)

    def _post(self, verb: str, body: Any, out: ReplayOutcome) -> Any:
        return post_verb(self.http, self.url, verb, body, out)

    def run(self, pods: Sequence[TracePod], order: Sequence[int]) -> ReplayOutcome:
        out = ReplayOutcome()
        start = time.perf_counter()
        for k, i in enumerate(order):
            tp = pods[i]
            pod = self.api.put_object(trace_pod(f"p{k:05d}", tp))
            cached = {key: v for key, v in pod.items() if key not in ("kind", "apiVersion")}
            d = tp.demand
            fits = np.flatnonzero((self.cpu_free >= d.cpu_milli) & (self.mem_free >= d.memory_bytes))
            names = [self.names[j] for j in fits]
            passed = self._post("filter", {"Pod": cached, "Nodes": None, "NodeNames": names}, out)
            if passed.get("Error"):
                raise RuntimeError(f"filter error: {passed['Error']}")
            kept = passed.get("NodeNames") or []
            if not kept:
                self.api.store.delete(self.api.kind("pods"), NAMESPACE, pod["metadata"]["name"])
                out.placements.append(None)
                continue
            node = kept[0]
            if len(kept) > 1:
                scores = {h["Host"]: int(h["Score"]) for h in
                          self._post("prioritize", {"Pod": cached, "Nodes": None, "NodeNames": kept}, out)}
                node = min(kept, key=lambda n: (-scores.get(n, 0), n))
            meta = pod["metadata"]
            result = self._post("bind", {"PodName": meta["name"], "PodNamespace": NAMESPACE,
                                         "PodUID": meta["uid"], "Node": node}, out)
            if result.get("Error"):
                raise RuntimeError(f"bind error for {meta['name']} on {node}: {result['Error']}")
            stored = self.api.get_object("pods", meta["name"], NAMESPACE)
            value = (stored["metadata"].get("annotations") or {}).get(A.DEVICE_ALLOCATED)
            minors = tuple(sorted(g.minor for g in decode(value).grants())) if value else ()
            j = self.index[node]
            self.cpu_free[j] -= d.cpu_milli
            self.mem_free[j] -= d.memory_bytes
            out.placements.append((node, minors))
        out.seconds = time.perf_counter() - start
        return out


def start_replay_cluster(nodes: TraceNodes, workdir: Path, policy: str = "kubegpu",
                         share_enforcement: str = "") -> tuple[ApiServer, Any]:
    """A stand-in API server holding the trace nodes' Device objects, and the extender watching it.
    ``share_enforcement``: what every GPU reports (``strict``: one share shape per GPU at a time)."""
    from kubegpu.scheduler.service import ServiceThread

    api = ApiServer(history=200_000).start()
    for inv in trace_inventories(nodes):
        gpus = tuple(replace(g, share_enforcement=share_enforcement) for g in inv.gpus)
        api.put_object(device_object(replace(inv, gpus=gpus)))
    kc = api.write_kubeconfig(workdir / "kubeconfig")
    ext = ServiceThread(kc, node_policy=policy, gpu_policy=policy).start(timeout_s=120)
    # No node daemon serves these records, so none is ever acknowledged: the one-pod-per-shape handoff
    # wait (docs/handoff.md) would hold every node after its first pod of a shape. Off, as where the
    # kubelets acknowledge at once.
    service = ext.service
    assert service is not None  # started above
    ext.call(lambda: setattr(service.view.handoffs, "enabled", False))
    return api, ext


@contextlib.contextmanager
def replay_cluster(nodes: TraceNodes, workdir: Path, policy: str = "kubegpu",
                   share_enforcement: str = "") -> Iterator[tuple[ApiServer, Any]]:
    """:func:`start_replay_cluster` for the block's life: both stopped when it ends."""
    api, ext = start_replay_cluster(nodes, workdir, policy, share_enforcement)
    try:
        yield api, ext
    finally:
        ext.stop()
        api.stop()


def replay_over_http(nodes: TraceNodes, pods: Sequence[TracePod], order: Sequence[int], workdir: Path,
                     policy: str = "kubegpu", share_enforcement: str = "") -> ReplayOutcome:
    """:class:`TraceScheduler`'s run of ``order`` against a fresh extender (:func:`replay_cluster`)."""
    with replay_cluster(nodes, workdir, policy, share_enforcement) as (api, ext):
        return TraceScheduler(api, ext.url, nodes).run(pods, order)


def agreement(sim: Sequence[tuple[int, tuple[int, ...]] | None], ext: Sequence[tuple[str, tuple[int, ...]] | None],
              names: Sequence[str]) -> tuple[float, float, list[int]]:
    """(% of pods on the same node, % on the same node and GPUs, indexes of the pods that differ)."""
    same_node = same_gpus = 0
    differ = []
    for k, (s, e) in enumerate(zip(sim, ext, strict=True)):
        s_named = None if s is None else (names[s[0]], tuple(sorted(s[1])))
        if s_named == e:
            same_node += 1
            same_gpus += 1
            continue
        differ.append(k)
        if s_named is not None and e is not None and s_named[0] == e[0]:
            same_node += 1
    n = max(1, len(sim))
    return 100.0 * same_node / n, 100.0 * same_gpus / n, differ
