"""The scheduler's choice for a pod, and its wire form: the ``kubegpu.io/device-allocated`` annotation.

The extender writes it before binding; the node daemon reads it to hand each
container exactly the GPUs chosen; the extender rebuilds its accounting from
it after a restart; the CLI shows it. Shape (the seed's, per container when a
pod has several GPU containers)::

    {"gpu": [{"minor": 0, "id": "GPU-…", "resources": {"kubegpu.io/gpu-core": "50", …}}]}
    {"containers": [{"name": "trainer", "gpu": [...]}, {"name": "helper", "gpu": [...]}]}

An init container's entry carries ``"init": true`` (see :meth:`PodAllocation.held` for what a
pod with init containers holds).

A MIG grant carries ``"mig": {"id": "MIG-…", "profile": "1g.10gb"}`` beside the parent GPU's minor and id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubegpu.model import resources as R
from kubegpu.model.quantity import QuantityError, format_bytes, parse_int

# The API server caps all of an object's annotations at 256 KiB together; a record is far smaller.
MAX_RECORD_BYTES = 256 * 1024


class AnnotationError(ValueError):
    """A device-allocated annotation that cannot be read (corrupt, or not this shape)."""


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """Part of one GPU given to one container."""

    minor: int
    uuid: str
    core: int  # percent of the GPU's compute
    memory_bytes: int
    memory_ratio: int  # percent of the GPU's memory
    mig_uuid: str | None = None
    mig_profile: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "minor": self.minor,
            "id": self.uuid,
            "resources": {
                R.GPU_CORE: str(self.core),
                R.GPU_MEMORY: format_bytes(self.memory_bytes),
                R.GPU_MEMORY_RATIO: str(self.memory_ratio),
            },
        }
        if self.mig_uuid is not None:
            out["mig"] = {"id": self.mig_uuid, "profile": self.mig_profile or ""}
        return out

    @classmethod
    def from_json(cls, data: object) -> DeviceGrant:
        if not isinstance(data, Mapping):
            raise AnnotationError(f"a device entry must be an object, got {data!r}")
        minor = data.get("minor")
        if not isinstance(minor, int) or isinstance(minor, bool) or minor < 0:
            raise AnnotationError(f"device entry has no valid minor: {data!r}")
        res = data.get("resources", {})
        if not isinstance(res, Mapping):
            raise AnnotationError(f"device entry resources must be an object: {data!r}")
        try:
            core = parse_int(res.get(R.GPU_CORE, "0"))
            memory = parse_int(res.get(R.GPU_MEMORY, "0"))
            ratio = parse_int(res.get(R.GPU_MEMORY_RATIO, "0"))
        except QuantityError as exc:
            raise AnnotationError(f"device entry has a bad quantity: {exc}") from None
        if not (0 <= core <= 100 and 0 <= ratio <= 100 and memory >= 0):
            raise AnnotationError(f"device entry amounts out of range: {data!r}")
        uuid = data.get("id", "")
        if not isinstance(uuid, str):
            raise AnnotationError(f"device entry id must be a string: {data!r}")
        mig = data.get("mig")
        mig_uuid = mig_profile = None
        if mig is not None:
            if not isinstance(mig, Mapping) or not isinstance(mig.get("id"), str):
                raise AnnotationError(f"device entry mig must be an object with an id: {data!r}")
            mig_uuid, mig_profile = mig["id"], str(mig.get("profile", ""))
        return cls(minor, uuid, core, memory, ratio, mig_uuid, mig_profile)


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    container: str
    grants: tuple[DeviceGrant, ...]
    init: bool = False  # an init container: runs before the app containers, never beside them


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """Every GPU container's grants. A single-container record may carry ``container=""``
    when it was read from the seed's shape (it then belongs to the pod's only GPU container)."""

    containers: tuple[ContainerAllocation, ...]

    def for_container(self, name: str) -> ContainerAllocation | None:
        for c in self.containers:
            if c.container == name:
                return c
        if len(self.containers) == 1 and self.containers[0].container == "":
            return self.containers[0]
        return None

    def grants(self) -> tuple[DeviceGrant, ...]:
        return tuple(g for c in self.containers for g in c.grants)

    def held(self) -> PodAllocation:
        """What the pod holds on its GPUs at any one time, by Kubernetes' rule for init containers.

        Init containers run one at a time before the app containers, so a GPU carries the larger
        of the largest init container's part and the sum of the app containers' parts (per GPU and
        per dimension: compute, memory, memory ratio); a MIG device is held when any container
        names it. This is the one home of that rule: the extender's accounting, the node and
        ``kubegpu status`` all call it. A record without init containers is returned unchanged."""
        if not any(c.init for c in self.containers):
            return self
        apps: dict[str, list[int]] = {}
        inits: dict[str, list[int]] = {}
        first: dict[str, DeviceGrant] = {}
        migs: dict[str, DeviceGrant] = {}
        for c in self.containers:
            for g in c.grants:
                if g.mig_uuid is not None:
                    migs.setdefault(g.mig_uuid, g)
                    continue
                first.setdefault(g.uuid, g)
                if c.init:
                    cur = inits.setdefault(g.uuid, [0, 0, 0])
                    cur[0], cur[1], cur[2] = max(cur[0], g.core), max(cur[1], g.memory_bytes), \
                        max(cur[2], g.memory_ratio)
                else:
                    cur = apps.setdefault(g.uuid, [0, 0, 0])
                    cur[0] += g.core
                    cur[1] += g.memory_bytes
                    cur[2] += g.memory_ratio
        grants: list[DeviceGrant] = []
        for uuid, g in first.items():
            a, i = apps.get(uuid, [0, 0, 0]), inits.get(uuid, [0, 0, 0])
            grants.append(DeviceGrant(g.minor, uuid, max(a[0], i[0]), max(a[1], i[1]), max(a[2], i[2])))
        grants.extend(migs.values())
        return PodAllocation((ContainerAllocation("", tuple(grants)),))


def encode(alloc: PodAllocation) -> str:
    """The annotation value (compact JSON)."""
    if len(alloc.containers) == 1:
        body: dict[str, Any] = {"gpu": [g.to_json() for g in alloc.containers[0].grants]}
        if alloc.containers[0].container:
            body["container"] = alloc.containers[0].container
        if alloc.containers[0].init:
            body["init"] = True
    else:
        body = {"containers": [{"name": c.container, "gpu": [g.to_json() for g in c.grants],
                                **({"init": True} if c.init else {})}
                               for c in alloc.containers]}
    return json.dumps(body, separators=(",", ":"), sort_keys=False)


def _grants(items: object) -> tuple[DeviceGrant, ...]:
    if not isinstance(items, list):
        raise AnnotationError(f"'gpu' must be a list, got {items!r}")
    return tuple(DeviceGrant.from_json(x) for x in items)


def decode(text: str) -> PodAllocation:
    """Read an annotation value; raises :class:`AnnotationError` on anything malformed."""
    if isinstance(text, str | bytes) and len(text) > MAX_RECORD_BYTES:
        raise AnnotationError(f"{len(text)} bytes, more than any record ({MAX_RECORD_BYTES})")
    try:
        data = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: "[" * 100000
        raise AnnotationError(f"not JSON: {str(exc)[:200]}") from None
    if not isinstance(data, Mapping):
        raise AnnotationError("must be a JSON object")
    if "containers" in data:
        items = data["containers"]
        if not isinstance(items, list):
            raise AnnotationError("'containers' must be a list")
        out = []
        for c in items:
            if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
                raise AnnotationError(f"container entry must have a name: {c!r}")
            out.append(ContainerAllocation(c["name"], _grants(c.get("gpu", [])), c.get("init") is True))
        return PodAllocation(tuple(out))
    if "gpu" in data:
        name = data.get("container", "")
        if not isinstance(name, str):
            raise AnnotationError("'container' must be a string")
        return PodAllocation((ContainerAllocation(name, _grants(data["gpu"]), data.get("init") is True),))
    raise AnnotationError("has neither 'gpu' nor 'containers'")
