"""The per-node ``Device`` object (``kubegpu.io/v1alpha1``) to and from a :class:`NodeInventory`.

The node daemon writes it; the extender and the CLI read it back to rebuild the node's
inventory, so the conversion round-trips exactly (``inventory_from_device(device_object(inv))
== inv``). The shape is the seed's (``spec.devices[]`` with ``type``, ``id``, ``minor``,
``health`` and the three ``kubegpu.io/*`` per-GPU resources) plus kubegpu's fields per GPU:
``index``, ``model``, ``computeCapability``, ``shareEnforcement`` (``mode``: mps, none or unenforced,
and the ``reason``), ``topology`` (NUMA node, PCI bus id, NVLink peers
with link counts) and ``mig`` (capable, enabled, devices), and ``spec.node`` (CPU, memory,
driver and CUDA versions, labels). ``kubegpu/install/crd-device.yaml`` (rendered into
``deploy/kubegpu.yaml``) is the schema of exactly this.

A corrupt object raises :class:`DeviceObjectError` naming the field
(``spec.devices[1].resources.kubegpu.io/gpu-memory: 'lots' is not a quantity``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kubegpu.model import resources as R
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.quantity import QuantityError, format_bytes, parse, parse_int

GROUP: Final = "kubegpu.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "Device"
PLURAL: Final = "devices"
DEVICE_TYPE_GPU: Final = "gpu"


class DeviceObjectError(ValueError):
    """A Device object that does not describe an inventory; the message names the field."""


def _cpu(milli: int) -> str:
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _mig_to_dict(m: MigDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": m.uuid, "profile": m.profile, "gi": m.gi, "ci": m.ci, "index": m.index,
        "memory": format_bytes(m.memory_bytes), "health": m.healthy,
    }
    if m.attributes:
        out["attributes"] = dict(sorted(m.attributes.items()))
    return out


def gpu_entry(g: Gpu, peers: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One ``spec.devices[]`` entry. ``peers`` orders NVLink peers (uuid -> position) for stable output."""
    entry: dict[str, Any] = {
        "type": DEVICE_TYPE_GPU,
        "id": g.uuid,
        "minor": g.minor,
        "health": g.healthy,
        "resources": {
            R.GPU_CORE: str(g.core),
            R.GPU_MEMORY: format_bytes(g.memory_bytes),
            R.GPU_MEMORY_RATIO: "100",
        },
        "index": g.index,
        "model": g.model,
    }
    if g.compute_capability is not None:
        entry["computeCapability"] = f"{g.compute_capability[0]}.{g.compute_capability[1]}"
    order = peers or {}
    topology: dict[str, Any] = {}
    if g.numa_node is not None:
        topology["numaNode"] = g.numa_node
    if g.pci_bus_id:
        topology["pciBusId"] = g.pci_bus_id
    if g.links:
        ranked = sorted(g.links.items(), key=lambda kv: (order.get(kv[0], 1 << 30), kv[0]))
        topology["nvlinks"] = [{"peer": peer, "links": n} for peer, n in ranked]
    if topology:
        entry["topology"] = topology
    if g.mig_capable or g.mig_enabled or g.mig_devices:
        entry["mig"] = {"capable": g.mig_capable, "enabled": g.mig_enabled,
                        "devices": [_mig_to_dict(m) for m in g.mig_devices]}
    if g.replicated:  # only when set: objects of nodes without replicas keep the seed's shape
        entry["replicated"] = True
    if g.share_enforcement:  # only when reported: how shares on this GPU are held to their limits
        enf: dict[str, Any] = {"mode": g.share_enforcement}
        if g.share_enforcement_reason:
            enf["reason"] = g.share_enforcement_reason
        if g.compute_mode:
            enf["computeMode"] = g.compute_mode
        if g.share_shape_lock:
            enf["shapeLock"] = g.share_shape_lock
        if g.share_escapable is not None:
            enf["escapable"] = g.share_escapable
        entry["shareEnforcement"] = enf
    return entry


def device_object(inv: NodeInventory, node_uid: str | None = None) -> dict[str, Any]:
    """The cluster-scoped ``Device`` object of a node (owned by its Node when ``node_uid`` is known)."""
    metadata: dict[str, Any] = {"name": inv.name}
    if node_uid:
        metadata["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "Node", "name": inv.name, "uid": node_uid,
            "controller": True, "blockOwnerDeletion": True,
        }]
    node: dict[str, Any] = {"cpu": _cpu(inv.cpu_milli), "memory": format_bytes(inv.memory_bytes)}
    if inv.driver_version:
        node["driverVersion"] = inv.driver_version
    if inv.cuda_version:
        node["cudaVersion"] = inv.cuda_version
    if inv.labels:
        node["labels"] = dict(sorted(inv.labels.items()))
    order = {g.uuid: i for i, g in enumerate(inv.gpus)}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"node": node, "devices": [gpu_entry(g, order) for g in inv.gpus]},
        # Derived counts for `kubectl get devices` (printer columns); ignored when read back.
        "status": {"node": inv.name, "model": inv.model, "gpus": len(inv.gpus),
                   "healthy": len(inv.healthy_gpus())},
    }


# --- reading -----------------------------------------------------------------------------------


class _Fields:
    """Typed reads of a decoded JSON object; every error names the field path."""

    @staticmethod
    def mapping(v: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise DeviceObjectError(f"{path}: expected an object, got {type(v).__name__}")
        return v

    @staticmethod
    def array(v: Any, path: str) -> list[Any]:
        if v is None:
            return []
        if not isinstance(v, list):
            raise DeviceObjectError(f"{path}: expected a list, got {type(v).__name__}")
        return v

    @staticmethod
    def get(m: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in m or m[key] is None:
            raise DeviceObjectError(f"{path}.{key}: missing")
        return m[key]

    @staticmethod
    def integer(v: Any, path: str, minimum: int = 0) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise DeviceObjectError(f"{path}: {v!r} is not an integer >= {minimum}")
        return v

    @staticmethod
    def string(v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise DeviceObjectError(f"{path}: {v!r} is not a string")
        return v

    @staticmethod
    def boolean(v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            raise DeviceObjectError(f"{path}: {v!r} is not true or false")
        return v

    @staticmethod
    def quantity(v: Any, path: str) -> int:
        try:
            n = parse_int(v)
        except QuantityError:
            raise DeviceObjectError(f"{path}: {v!r} is not a quantity") from None
        if n < 0:
            raise DeviceObjectError(f"{path}: {v!r} is negative")
        return n


F = _Fields


def _parse_mig(v: Any, path: str, parent: str) -> MigDevice:
    m = F.mapping(v, path)
    attrs = F.mapping(m.get("attributes") or {}, f"{path}.attributes")
    return MigDevice(
        uuid=F.string(F.get(m, "id", path), f"{path}.id"),
        profile=F.string(F.get(m, "profile", path), f"{path}.profile"),
        parent_uuid=parent,
        gi=F.integer(F.get(m, "gi", path), f"{path}.gi"),
        ci=F.integer(F.get(m, "ci", path), f"{path}.ci"),
        memory_bytes=F.quantity(F.get(m, "memory", path), f"{path}.memory"),
        index=F.integer(m.get("index", 0), f"{path}.index"),
        healthy=F.boolean(m.get("health", True), f"{path}.health"),
        attributes={str(k): F.integer(a, f"{path}.attributes.{k}") for k, a in attrs.items()},
    )


def _parse_gpu(v: Any, path: str, position: int) -> Gpu:
    d = F.mapping(v, path)
    kind = d.get("type", DEVICE_TYPE_GPU)
    if kind != DEVICE_TYPE_GPU:
        raise DeviceObjectError(f"{path}.type: {kind!r} is not a device type kubegpu knows (gpu)")
    uuid = F.string(F.get(d, "id", path), f"{path}.id")
    res = F.mapping(F.get(d, "resources", path), f"{path}.resources")
    core = F.quantity(F.get(res, R.GPU_CORE, f"{path}.resources"), f"{path}.resources.{R.GPU_CORE}")
    memory = F.quantity(F.get(res, R.GPU_MEMORY, f"{path}.resources"), f"{path}.resources.{R.GPU_MEMORY}")
    if R.GPU_MEMORY_RATIO in res:
        try:
            parse(res[R.GPU_MEMORY_RATIO])
        except QuantityError:
            bad = res[R.GPU_MEMORY_RATIO]
            raise DeviceObjectError(
                f"{path}.resources.{R.GPU_MEMORY_RATIO}: {bad!r} is not a quantity") from None
    enf = F.mapping(d.get("shareEnforcement") or {}, f"{path}.shareEnforcement")
    cc = None
    if d.get("computeCapability") is not None:
        text = F.string(d["computeCapability"], f"{path}.computeCapability")
        major, dot, minor = text.partition(".")
        if not (dot and major.isdigit() and minor.isdigit()):
            raise DeviceObjectError(f"{path}.computeCapability: {text!r} is not <major>.<minor>")
        cc = (int(major), int(minor))
    topo = F.mapping(d.get("topology") or {}, f"{path}.topology")
    links: dict[str, int] = {}
    raw_links = F.array(topo.get("nvlinks"), f"{path}.topology.nvlinks")
    for j, link in enumerate(raw_links):
        lp = f"{path}.topology.nvlinks[{j}]"
        link = F.mapping(link, lp)
        links[F.string(F.get(link, "peer", lp), f"{lp}.peer")] = F.integer(F.get(link, "links", lp),
                                                                          f"{lp}.links", 1)
    numa = topo.get("numaNode")
    mig = F.mapping(d.get("mig") or {}, f"{path}.mig")
    raw_migs = F.array(mig.get("devices"), f"{path}.mig.devices")
    return Gpu(
        uuid=uuid,
        index=F.integer(d.get("index", position), f"{path}.index"),
        minor=F.integer(F.get(d, "minor", path), f"{path}.minor"),
        model=F.string(d.get("model", ""), f"{path}.model"),
        memory_bytes=memory,
        healthy=F.boolean(F.get(d, "health", path), f"{path}.health"),
        numa_node=None if numa is None else F.integer(numa, f"{path}.topology.numaNode"),
        pci_bus_id=F.string(topo.get("pciBusId", ""), f"{path}.topology.pciBusId"),
        compute_capability=cc,
        links=links,
        mig_enabled=F.boolean(mig.get("enabled", False), f"{path}.mig.enabled"),
        mig_devices=tuple(_parse_mig(m, f"{path}.mig.devices[{k}]", uuid) for k, m in enumerate(raw_migs)),
        core=core,
        mig_capable=F.boolean(mig.get("capable", False), f"{path}.mig.capable"),
        replicated=F.boolean(d.get("replicated", False), f"{path}.replicated"),
        share_enforcement=F.string(enf.get("mode", ""), f"{path}.shareEnforcement.mode"),
        share_enforcement_reason=F.string(enf.get("reason", ""), f"{path}.shareEnforcement.reason"),
        compute_mode=F.string(enf.get("computeMode", ""), f"{path}.shareEnforcement.computeMode"),
        share_shape_lock=F.string(enf.get("shapeLock", ""), f"{path}.shareEnforcement.shapeLock"),
        share_escapable=None if "escapable" not in enf else F.boolean(enf["escapable"],
                                                                      f"{path}.shareEnforcement.escapable"),
    )


def inventory_from_device(obj: Mapping[str, Any]) -> NodeInventory:
    """Rebuild a node's inventory from its ``Device`` object (a dict as the API returns it)."""
    obj = F.mapping(obj, "Device")
    if obj.get("apiVersion", API_VERSION) != API_VERSION or obj.get("kind", KIND) != KIND:
        raise DeviceObjectError(f"apiVersion/kind: {obj.get('apiVersion')}/{obj.get('kind')} is not "
                                f"{API_VERSION}/{KIND}")
    meta = F.mapping(F.get(obj, "metadata", "Device"), "metadata")
    name = F.string(F.get(meta, "name", "metadata"), "metadata.name")
    spec = F.mapping(F.get(obj, "spec", "Device"), "spec")
    node = F.mapping(spec.get("node") or {}, "spec.node")
    raw = F.array(spec.get("devices"), "spec.devices")
    gpus = tuple(_parse_gpu(d, f"spec.devices[{i}]", i) for i, d in enumerate(raw))
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise DeviceObjectError("spec.devices: a device id appears twice")
    known = set(uuids)
    for i, g in enumerate(gpus):
        for peer in g.links:
            if peer not in known:
                raise DeviceObjectError(
                    f"spec.devices[{i}].topology.nvlinks: peer {peer} is not a device of {name}")
    cpu = node.get("cpu", "0")
    try:
        cpu_milli = int(parse(cpu) * 1000)
    except QuantityError:
        raise DeviceObjectError(f"spec.node.cpu: {cpu!r} is not a quantity") from None
    labels = F.mapping(node.get("labels") or {}, "spec.node.labels")
    return NodeInventory(
        name=name,
        gpus=gpus,
        cpu_milli=cpu_milli,
        memory_bytes=F.quantity(node.get("memory", "0"), "spec.node.memory"),
        labels={str(k): F.string(v, f"spec.node.labels.{k}") for k, v in labels.items()},
        driver_version=F.string(node.get("driverVersion", ""), "spec.node.driverVersion"),
        cuda_version=F.string(node.get("cudaVersion", ""), "spec.node.cudaVersion"),
    )



# The readers' name for the inverse (``kubegpu.status`` and the extender use it).
device_to_inventory = inventory_from_device
