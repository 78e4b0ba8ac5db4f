"""What a pod holds, as kubegpu's accounting must see it: its record, checked, and its acknowledgement.

One function, :func:`pod_allocation`, read by the extender's accounting, the node daemon and
``kubegpu status``, so the rules below exist once:

- a record (``kubegpu.io/device-allocated``) counts only when it is the extender's: with a record
  key configured its signature must verify (:mod:`kubegpu.model.signing`); a forged record is
  reported and counts for nothing;
- the node's acknowledgement (``kubegpu.io/device-assigned``) says which GPUs the kubelet really
  holds for each served container. Where it names other GPUs than the record (a divergence the
  node reported), the accounting follows the kubelet: the container's grants move to the
  acknowledged GPUs;
- a pod the extender never placed (the default scheduler's ``nvidia.com/gpu`` pod) has no record,
  but once the node has served it, its acknowledgement names its whole GPUs: those count too, so
  shares are not placed on a GPU the kubelet gave away whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import (
    AnnotationError,
    ContainerAllocation,
    DeviceGrant,
    PodAllocation,
    decode,
)
from kubegpu.model.request import GpuRequest, PodRequest, RequestKind

MAX_ACK_CHARS = 256 * 1024


def device_resource(req: GpuRequest) -> str | None:
    """The kubelet resource a request is served through, or None (replicas carry no record)."""
    if req.kind is RequestKind.SHARE:
        return R.GPU_SLOTS
    if req.kind in (RequestKind.WHOLE, RequestKind.MIG):
        return req.resource
    return None


Shape = tuple[str, int, tuple[int, int, int]]  # kubelet resource, device count, per-GPU amounts


def request_shapes(request: PodRequest, acked: Mapping[str, object] | None = None) -> frozenset[Shape]:
    """Each GPU container not acknowledged yet: (kubelet resource, device count) — what the kubelet's
    identity-less GetPreferredAllocation / Allocate calls for it look like — and the per-GPU amounts
    (core, memory bytes, memory ratio) it would be served."""
    out = set()
    for c in request.gpu_containers:
        r = c.request
        if r is None or (acked is not None and c.name in acked):
            continue
        res = device_resource(r)
        if res is not None:
            out.add((res, r.count, (r.core, r.memory_bytes or 0, r.memory_ratio or 0)))
    return frozenset(out)


def ambiguous(waiting: frozenset[Shape], shapes: frozenset[Shape]) -> Shape | None:
    """A waiting shape the kubelet's calls cannot tell apart from one of ``shapes`` (same resource and
    device count: GetPreferredAllocation could steer one pod onto the other's record), or None."""
    for w in waiting:
        for s in shapes:
            if w[:2] == s[:2]:
                return w
    return None


@dataclass(frozen=True, slots=True)
class Ack:
    """One served container: the kubelet's resource and device IDs, and the grants served."""

    resource: str
    devices: tuple[str, ...]
    grants: tuple[DeviceGrant, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"resource": self.resource, "devices": list(self.devices),
                "gpu": [g.to_json() for g in self.grants]}


def encode_acks(acks: Mapping[str, Ack]) -> str:
    return json.dumps({"containers": {c: a.to_json() for c, a in sorted(acks.items())}},
                      separators=(",", ":"), sort_keys=True)


def decode_acks(text: str) -> dict[str, Ack]:
    """Read an acknowledgement; raises :class:`AnnotationError` on anything malformed."""
    if len(text) > MAX_ACK_CHARS:
        raise AnnotationError(f"acknowledgement too long ({len(text)} characters)")
    try:
        data = json.loads(text)
    except RecursionError:
        raise AnnotationError("acknowledgement nested too deeply") from None
    except ValueError as e:
        raise AnnotationError(f"acknowledgement is not JSON: {e}") from None
    containers = data.get("containers") if isinstance(data, dict) else None
    if not isinstance(containers, dict):
        raise AnnotationError("acknowledgement has no 'containers' object")
    out: dict[str, Ack] = {}
    for name, v in containers.items():
        if not isinstance(v, dict):
            raise AnnotationError(f"acknowledgement of {name!r} is not an object")
        devices = v.get("devices") or []
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise AnnotationError(f"acknowledgement of {name!r}: devices must be a list of strings")
        grants = v.get("gpu") or []
        if not isinstance(grants, list):
            raise AnnotationError(f"acknowledgement of {name!r}: 'gpu' must be a list")
        out[str(name)] = Ack(str(v.get("resource", "")), tuple(devices),
                             tuple(DeviceGrant.from_json(g) for g in grants))
    return out


@dataclass(frozen=True, slots=True)
class PodRecords:
    """A pod's record and acknowledgements as far as they can be trusted, and what is wrong."""

    record: PodAllocation | None
    acks: dict[str, Ack]
    problems: tuple[str, ...] = ()
    forged: bool = False

    def allocation(self) -> PodAllocation | None:
        """The per-container grants the accounting uses (record, moved to the acknowledged GPUs)."""
        if self.record is None:
            extra = [ContainerAllocation(c, a.grants) for c, a in sorted(self.acks.items()) if a.grants]
            return PodAllocation(tuple(extra)) if extra else None
        out = []
        for c in self.record.containers:
            ack = self.acks.get(c.container) or (self.acks.get("") if c.container == "" else None)
            if ack is not None and ack.grants and _gpus(ack.grants) != _gpus(c.grants):
                out.append(ContainerAllocation(c.container, ack.grants, c.init))
            else:
                out.append(c)
        return PodAllocation(tuple(out))


def _gpus(grants: tuple[DeviceGrant, ...]) -> frozenset[str]:
    return frozenset(g.mig_uuid or g.uuid for g in grants)


def read_pod(pod: Mapping[str, Any], key: bytes | None) -> PodRecords:
    """Check a pod's ``device-allocated`` and ``device-assigned`` (signatures when ``key`` is set)."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    uid = str(meta.get("uid") or "")
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    problems: list[str] = []
    record: PodAllocation | None = None
    forged = False
    value = ann.get(A.DEVICE_ALLOCATED)
    if isinstance(value, str) and value:
        if key is not None and not signing.verify(key, uid, node, value, str(ann.get(signing.RECORD_SIGNATURE, ""))):
            forged = True
            problems.append(f"{A.DEVICE_ALLOCATED} is not signed by kubegpu's extender for this pod and node "
                            "(written by someone else?): ignored")
        else:
            try:
                record = decode(value)
            except AnnotationError as e:
                problems.append(f"unreadable {A.DEVICE_ALLOCATED}: {e}")
    acks: dict[str, Ack] = {}
    raw = ann.get(A.DEVICE_ASSIGNED)
    if isinstance(raw, str) and raw:
        if key is not None and not signing.verify(key, uid, node, raw, str(ann.get(signing.ACK_SIGNATURE, "")),
                                                  kind="ack"):
            problems.append(f"{A.DEVICE_ASSIGNED} is not signed by kubegpu's node daemon: ignored")
        else:
            try:
                acks = decode_acks(raw)
            except AnnotationError as e:
                problems.append(f"unreadable {A.DEVICE_ASSIGNED}: {e}")
    return PodRecords(record, acks, tuple(problems), forged)


def pod_allocation(pod: Mapping[str, Any], key: bytes | None) -> tuple[PodAllocation | None, tuple[str, ...]]:
    """What the accounting holds for a pod (before :meth:`PodAllocation.held`), and the problems found."""
    r = read_pod(pod, key)
    return r.allocation(), r.problems
