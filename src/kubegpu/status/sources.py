"""Where the live view's data comes from: the API server, or the extender's debug API.

Both end in the same :class:`~kubegpu.status.view.ClusterView`, so the table and
``--json`` do not depend on the source.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.annotations import DEVICE_ALLOCATED, DEVICE_ASSIGNED
from kubegpu.model.inventory import Gpu, NodeInventory
from kubegpu.model.quantity import QuantityError, parse_int
from kubegpu.model.records import pod_allocation
from kubegpu.status.view import PodRecord

log = logging.getLogger(__name__)

SUMMARIES_PATH = "/apis/v1/plugins/DeviceShare/nodeDeviceSummaries"
_DONE_PHASES = ("Succeeded", "Failed")


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


def from_api_server(client: Any) -> tuple[list[NodeInventory], list[PodRecord], list[str]]:
    """List ``Device`` objects and pods through a lightkube client."""
    import httpx2  # lightkube's HTTP client
    from lightkube.core.exceptions import ApiError

    from kubegpu.kube.resources import Device, Pod
    from kubegpu.node.device_object import DeviceObjectError, device_to_inventory

    problems: list[str] = []
    try:
        devices = [d.to_dict() if hasattr(d, "to_dict") else dict(d) for d in client.list(Device)]
        pods = [p.to_dict() for p in client.list(Pod, namespace="*")]
    except ApiError as exc:
        raise SourceError(f"API server refused the list: {exc.status.message}") from None
    except (httpx.HTTPError, httpx2.HTTPError) as exc:
        raise SourceError(f"cannot reach the API server: {exc}") from None
    inventories = []
    for d in devices:
        try:
            inventories.append(device_to_inventory(d))
        except DeviceObjectError as exc:
            problems.append(f"Device {d.get('metadata', {}).get('name', '?')}: {exc}")
    try:
        key = signing.load_key()  # with the key, unsigned (forged) records are shown as problems
    except signing.RecordKeyError as exc:
        problems.append(str(exc))
        key = None
    return inventories, pod_records(pods, problems, key), problems


def _summary_inventory(node: str, summary: Mapping[str, Any]) -> NodeInventory:
    gpus = []
    for minor, res in sorted(((summary.get("deviceTotalDetail") or {}).get("gpu") or {}).items(),
                             key=lambda kv: int(kv[0])):
        gpus.append(Gpu(uuid=f"minor-{minor}", index=int(minor), minor=int(minor), model="",
                        memory_bytes=parse_int(res.get(R.GPU_MEMORY, "0"))))
    return NodeInventory(node, tuple(gpus))


def _summary_records(node: str, summary: Mapping[str, Any]) -> list[PodRecord]:
    out = []
    for pod, per_minor in ((summary.get("allocateSet") or {}).get("gpu") or {}).items():
        ns, _, name = pod.partition("/")
        grants = tuple(
            DeviceGrant(int(minor), f"minor-{minor}", parse_int(res.get(R.GPU_CORE, "0")),
                        parse_int(res.get(R.GPU_MEMORY, "0")), parse_int(res.get(R.GPU_MEMORY_RATIO, "0")))
            for minor, res in per_minor.items()
        )
        out.append(PodRecord(ns, name, node, PodAllocation((ContainerAllocation("", grants),))))
    return out


def from_extender(url: str, timeout_s: float = 5.0) -> tuple[list[NodeInventory], list[PodRecord], list[str]]:
    """Read the extender's debug API (the seed's node device summaries)."""
    try:
        resp = httpx.get(url.rstrip("/") + SUMMARIES_PATH, timeout=timeout_s, verify=False)
        resp.raise_for_status()
        body = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise SourceError(f"cannot read {url}{SUMMARIES_PATH}: {exc}") from None
    if not isinstance(body, Mapping):
        raise SourceError(f"{url}{SUMMARIES_PATH} did not answer a JSON object")
    inventories, records, problems = [], [], []
    for node, summary in body.items():
        try:
            inventories.append(_summary_inventory(node, summary))
            records += _summary_records(node, summary)
        except (AttributeError, TypeError, ValueError, QuantityError) as exc:
            problems.append(f"node {node}: unreadable summary: {exc}")
    return inventories, records, problems
