"""Where the live view's data comes from: the API server, or the extender's debug API.

Both end in the same :class:`~kubegpu.status.view.ClusterView`, so the table and
``--json`` do not depend on the source.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.annotations import DEVICE_ALLOCATED, DEVICE_ASSIGNED
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.quantity import QuantityError, parse_int
from kubegpu.model.records import pod_allocation
from kubegpu.model.request import RequestKind, parse_pod
from kubegpu.model.resources import served_resources
from kubegpu.status.view import ClusterView, NodeInfo, PodRecord, ReplicaRecord, build_view

log = logging.getLogger(__name__)

SUMMARIES_PATH = "/apis/v1/plugins/DeviceShare/nodeDeviceSummaries"
_DONE_PHASES = ("Succeeded", "Failed")
# The extender's kubegpu addition to the seed's summary: per pod, per container, the minors it holds.
BY_CONTAINER = "allocateSetByContainer"
INSTALL_CRD = ("install it with `kubegpu manifests --mode node-only | kubectl apply -f -` (the namespace, the "
               "Device CRD and the node DaemonSet, whose `kubegpu node` publishes one Device per GPU node)")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the view is built from, from either source."""

    inventories: list[NodeInventory]
    records: list[PodRecord]
    problems: list[str]
    node_info: dict[str, NodeInfo] = field(default_factory=dict)
    replica_pods: list[ReplicaRecord] = field(default_factory=list)

    def view(self, *, node: str | None = None, model: str | None = None,
             namespace: str | None = None) -> ClusterView:
        """The view of this snapshot (filters as :func:`build_view`), with the source's problems."""
        v = build_view(self.inventories, self.records, node=node, model=model, namespace=namespace,
                       node_info=self.node_info, replica_pods=self.replica_pods)
        return ClusterView(v.nodes, v.totals, (*self.problems, *v.problems))


class SourceError(RuntimeError):
    """The API server or the extender could not be read; the message says which and why."""


def pod_records(pods: Iterable[Mapping[str, Any]], problems: list[str],
                key: bytes | None = None) -> list[PodRecord]:
    """Live, bound pods with what the accounting holds for them (``model.records``: the record, moved to
    the GPUs the node acknowledged, or the acknowledged GPUs of a pod the extender did not place);
    corrupt or unsigned records go to ``problems``. ``key``: the record key, when this CLI has it."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        ann = meta.get("annotations") or {}
        node = spec.get("nodeName")
        if (DEVICE_ALLOCATED not in ann and DEVICE_ASSIGNED not in ann) or not node \
                or status.get("phase") in _DONE_PHASES:
            continue
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        alloc, why = pod_allocation(pod, key)
        problems.extend(f"{ns}/{name}: {w}" for w in why)
        if alloc is not None:
            out.append(PodRecord(ns, name, node, alloc))
    return out


def replica_records(pods: Iterable[Mapping[str, Any]],
                    served: frozenset[str] = frozenset()) -> list[ReplicaRecord]:
    """Containers of live, bound pods that hold time-slicing / MPS replicas (the kubelet counts those).
    ``served``: the resource names the nodes say they serve (renamed replicas such as nvidia.com/small)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in _DONE_PHASES:
            continue
        for c in parse_pod(pod, replica_resources=served).containers:
            req = c.request
            if req is not None and req.kind is RequestKind.REPLICA and not c.init:
                out.append(ReplicaRecord(meta.get("namespace", ""), meta.get("name", ""), node, c.name,
                                         req.resource, req.count))
    return out


def node_infos(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeInfo]:
    """Each Node's GPU capacity (``nvidia.com/*``) and labels; unreadable quantities are left out."""
    out = {}
    for node in nodes:
        meta = node.get("metadata") or {}
        capacity: dict[str, int] = {}
        for k, v in ((node.get("status") or {}).get("capacity") or {}).items():
            if k.startswith("nvidia.com/"):
                try:
                    capacity[k] = parse_int(str(v))
                except QuantityError:
                    continue
        out[meta.get("name", "")] = NodeInfo(capacity, dict(meta.get("labels") or {}))
    return out


def _refused(code: int | None, message: str, what: str) -> SourceError:
    if code == 404 and what == "Device":
        # An API server answers an unknown group with a bare "404 page not found", a known group without
        # the resource with a JSON Status: either way the CRD is missing.
        return SourceError(f"the API server has no Device resource (devices.kubegpu.io): the CRD is not "
                           f"installed; {INSTALL_CRD}")
    return SourceError(f"the API server refused to list {what} objects ({code or 'error'}): {message}")


def _non_json(exc: BaseException, what: str) -> SourceError | None:
    """An HTTP error answer without Kubernetes JSON (lightkube lets these through, or trips on a missing
    Content-Type header while looking): the status code and the start of the body."""
    for e in (exc, exc.__context__):
        response = getattr(e, "response", None)
        code = getattr(response, "status_code", None)
        if isinstance(code, int):
            text = " ".join(str(getattr(response, "text", "")).split())[:200]
            return _refused(code, f"{text!r} (not Kubernetes JSON)", what)
    return None


def from_api_server(client: Any, environ: Mapping[str, str]) -> Snapshot:
    """List ``Device`` objects, Nodes and pods through a lightkube client. ``environ`` is the caller's
    environment, read by its entry: the record key and the declared GPU resource names come from it."""
    import httpx2  # lightkube's HTTP client
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Node

    from kubegpu.kube.resources import Device, Pod
    from kubegpu.model.device_object import DeviceObjectError, device_to_inventory

    problems: list[str] = []
    what = "Device"
    try:
        devices = [d.to_dict() if hasattr(d, "to_dict") else dict(d) for d in client.list(Device)]
        what = "Node"
        nodes = [n.to_dict() for n in client.list(Node)]
        what = "Pod"
        pods = [p.to_dict() for p in client.list(Pod, namespace="*")]
    except ApiError as exc:
        raise _refused(exc.status.code, exc.status.message or str(exc), what) from None
    except (httpx.HTTPError, httpx2.HTTPError, KeyError) as exc:
        refused = _non_json(exc, what)
        if refused is not None:
            raise refused from None
        if isinstance(exc, KeyError):
            raise
        raise SourceError(f"cannot reach the API server: {exc}") from None
    inventories = []
    for d in devices:
        try:
            inventories.append(device_to_inventory(d))
        except DeviceObjectError as exc:
            problems.append(f"Device {d.get('metadata', {}).get('name', '?')}: {exc}")
    try:
        key = signing.load_key(environ)  # with the key, unsigned (forged) records are shown as problems
    except signing.RecordKeyError as exc:
        problems.append(str(exc))
        key = None
    from kubegpu.status.dra import from_client as dra_from_client  # DRA nodes and claims (docs/dra.md)

    dra_inventories, dra_records = dra_from_client(client, problems)
    inventories += [i for i in dra_inventories if i.name not in {x.name for x in inventories}]
    return Snapshot(inventories, pod_records(pods, problems, key) + dra_records, problems, node_infos(nodes),
                    replica_records(pods, served_resources(nodes) | R.declared_gpu_resources(environ)))


def _summary_inventory(node: str, summary: Mapping[str, Any]) -> NodeInventory:
    """The node's GPUs from its summary: from kubegpu's ``deviceInfo`` (model, health, MIG, replicated); for an
    extender that speaks only the seed's shape, health from the total (an unhealthy GPU totals 0 %)."""
    info = (summary.get("deviceInfo") or {}).get("gpu") or {}
    gpus = []
    for minor, res in sorted(((summary.get("deviceTotalDetail") or {}).get("gpu") or {}).items(),
                             key=lambda kv: int(kv[0])):
        d = info.get(minor)
        if isinstance(d, Mapping):
            migs = tuple(MigDevice(uuid=str(m["uuid"]), profile=str(m["profile"]), parent_uuid=str(d["uuid"]),
                                   gi=0, ci=0, memory_bytes=int(m["memoryBytes"]), index=int(m["index"]),
                                   healthy=bool(m["healthy"]), attributes={"slices.gi": int(m.get("slices", 0))})
                         for m in d.get("mig") or ())
            gpus.append(Gpu(uuid=str(d["uuid"]), index=int(d["index"]), minor=int(minor), model=str(d["model"]),
                            memory_bytes=int(d["memoryBytes"]), healthy=bool(d["healthy"]),
                            mig_enabled=bool(d["migEnabled"]), mig_devices=migs, replicated=bool(d["replicated"])))
        else:
            gpus.append(Gpu(uuid=f"minor-{minor}", index=int(minor), minor=int(minor), model="",
                            memory_bytes=parse_int(res.get(R.GPU_MEMORY, "0")),
                            healthy=parse_int(res.get(R.GPU_CORE, "100")) > 0))
    return NodeInventory(node, tuple(gpus))


def _mig_of(summary: Mapping[str, Any], pod: str, container: str, minor: str) -> str | None:
    """The MIG device ``container`` of ``pod`` holds on GPU ``minor`` (``deviceInfo``), if any."""
    d = ((summary.get("deviceInfo") or {}).get("gpu") or {}).get(minor)
    for m in d.get("mig") or () if isinstance(d, Mapping) else ():
        if {"pod": pod, "container": container} in (m.get("holders") or ()):
            return str(m["uuid"])
    return None


def _grants(per_minor: Mapping[str, Any], uuids: Mapping[str, str] | None = None,
            mig: Mapping[str, str | None] | None = None) -> tuple[DeviceGrant, ...]:
    return tuple(
        DeviceGrant(int(minor), (uuids or {}).get(minor, f"minor-{minor}"), parse_int(res.get(R.GPU_CORE, "0")),
                    parse_int(res.get(R.GPU_MEMORY, "0")), parse_int(res.get(R.GPU_MEMORY_RATIO, "0")),
                    (mig or {}).get(minor))
        for minor, res in per_minor.items()
    )


def _summary_records(node: str, summary: Mapping[str, Any]) -> list[PodRecord]:
    """The pods' holdings; per container where the extender gives them (kubegpu's addition to the seed's
    shape), else one nameless container per pod (an extender that speaks only the seed's shape)."""
    out = []
    info = (summary.get("deviceInfo") or {}).get("gpu") or {}
    uuids = {minor: str(d["uuid"]) for minor, d in info.items() if isinstance(d, Mapping) and "uuid" in d}
    by_container = (summary.get(BY_CONTAINER) or {}).get("gpu") or {}
    for pod, per_minor in ((summary.get("allocateSet") or {}).get("gpu") or {}).items():
        ns, _, name = pod.partition("/")
        containers = by_container.get(pod)
        if isinstance(containers, Mapping) and containers:
            alloc = PodAllocation(tuple(
                ContainerAllocation(c, _grants(per, uuids, {m: _mig_of(summary, pod, c, m) for m in per}))
                for c, per in containers.items()))
        else:
            alloc = PodAllocation((ContainerAllocation("", _grants(per_minor, uuids)),))
        out.append(PodRecord(ns, name, node, alloc))
    return out


def from_extender(url: str, timeout_s: float = 5.0, ca: str | None = None) -> Snapshot:
    """Read the extender's debug API (the seed's node device summaries). HTTPS is verified: against
    ``ca`` (a PEM bundle) when given, else the system's trust store."""
    try:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        resp = httpx.get(url.rstrip("/") + SUMMARIES_PATH, timeout=timeout_s, verify=verify)
        resp.raise_for_status()
        body = resp.json()
    except httpx.HTTPStatusError as exc:
        raise SourceError(f"{url}{SUMMARIES_PATH} answered {exc.response.status_code}: is this the kubegpu "
                          "extender's address (its --listen or --metrics-listen)?") from None
    except (httpx.HTTPError, ValueError, OSError) as exc:  # OSError, ssl.SSLError: an unreadable CA file
        raise SourceError(f"cannot read {url}{SUMMARIES_PATH}: {exc}") from None
    if not isinstance(body, Mapping):
        raise SourceError(f"{url}{SUMMARIES_PATH} did not answer a JSON object")
    inventories, records, problems = [], [], []
    for node, summary in body.items():
        try:
            inventories.append(_summary_inventory(node, summary))
            records += _summary_records(node, summary)
        except (AttributeError, TypeError, ValueError, KeyError, QuantityError) as exc:
            problems.append(f"node {node}: unreadable summary: {exc}")
    return Snapshot(inventories, records, problems)
