"""A node inventory and its health -> the ResourceSlices of the node's pool (pure, no I/O but sysfs reads).

Shapes follow what a v1.36 API server stores (fixtures ``dra-v1.36`` s1, s3, s4, s5):

- **whole GPU** (``type: gpu``): attributes ``type``, ``uuid``, ``index``, ``minor``, ``productName``,
  ``brand``, ``architecture``, ``cudaComputeCapability`` / ``driverVersion`` / ``cudaDriverVersion``
  (semver versions), ``numaNode``, ``pciBusID``, the standard ``resource.kubernetes.io/pcieRoot``
  (read from sysfs), and with NVLink ``nvlinkClique`` / ``nvlinkPeers``; capacity ``memory``.
- **MIG** (``type: mig``) for the GPU's current geometry: every MIG device is a device of its
  own (``profile``, ``parentUUID``, ``parentIndex``, capacity ``memory`` and ``multiprocessors``),
  and the parent GPU is published too (``migEnabled: true``; after the plain GPUs, so whole-GPU
  claims prefer those). All of them consume a shared counter set
  ``gpu-<i>-counter-set`` (``compute-slices``, ``memory``, ``multiprocessors``): the parent takes
  it all, each MIG device its part, so the allocator never gives a GPU whole and in slices.
- **whole or shares, as demand comes** (every non-MIG GPU unless ``--dra-shared-gpus`` narrows it):
  the GPU stays ``type: gpu`` and gets ``allowMultipleAllocations`` with consumable capacity
  ``compute`` (percent, 1..100) and ``memory`` (1Gi steps). Each capacity's request-policy default
  is the whole of it, so a claim that names no capacity (``gpu.kubegpu.io``, the
  ``nvidia.com/gpu`` mapping) consumes the whole GPU, and a share names both
  (``shared-gpu.kubegpu.io`` with ``capacity.requests: {compute: 30, memory: 8Gi}``).
  kube-scheduler sums what the allocations of a device consume (fixtures ``dra-v1.36`` s4: a
  request over what is left is ``cannot allocate all claims``), so a GPU holds one whole claim
  or shares up to 100 % and its memory, never both, and which one is decided per claim. Under strict
  enforcement a GPU serving shares of one shape publishes that shape as its only share values
  (:func:`keep_to_lock`), so the allocator itself keeps to the lock.
- **health** as device taints: an Xid taints the device ``gpu.kubegpu.io/xid-error=<xid>:NoSchedule``,
  any other failure ``gpu.kubegpu.io/unhealthy:NoSchedule``; recovery removes the taint.

Counter sets go in slices of their own (the API allows only one of ``sharedCounters`` or
``devices`` per slice), at most 8 per slice; devices at most 128 per slice. Every slice of the
pool carries the same ``pool.generation`` and ``resourceSliceCount``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.quantity import format_bytes
from kubegpu.model.share_shape import MIB, ShareShape, parse_shape
from kubegpu.node.dra.names import (
    DRIVER,
    PCIE_ROOT_ATTRIBUTE,
    TAINT_UNHEALTHY,
    TAINT_XID,
    TYPE_GPU,
    TYPE_MIG,
)

if TYPE_CHECKING:
    from kubegpu.node.mps.enforcer import GpuView

GI: Final = 2**30
MAX_DEVICES_PER_SLICE: Final = 128
MAX_COUNTER_SETS_PER_SLICE: Final = 8
_XID_RE = re.compile(r"^Xid (\d+)")

# Compute capability major version -> the architecture name NVIDIA's tools print.
ARCHITECTURES: Final = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 7: "Volta", 8: "Ampere", 9: "Hopper",
                        10: "Blackwell", 12: "Blackwell"}


class SliceError(ValueError):
    """The inventory or the settings cannot be published (the message says which device and why)."""


@dataclass(frozen=True, slots=True)
class DraSettings:
    """What the driver publishes for a node, beside its inventory."""

    node_name: str
    shared_gpus: frozenset[int] | None = frozenset()  # GPUs that also take shares; None = every GPU
    share_memory_default: int | None = None  # what a claim naming no memory consumes; None = all of it
    share_memory_step: int = GI
    sysfs_root: str = "/sys"
    mps: bool = False  # shares are enforced through MPS daemons (node/mps), refused when they cannot be
    enforcement: str = "mps"  # with mps: "mps" (a daemon per share shape) or "strict" (one per GPU, exclusive)
    mps_server_uid: int = 0  # strict: the user each GPU's MPS server runs for
    mps_root: str = "/run/nvidia/mps"
    mps_binary: str = ""  # "" = nvidia-cuda-mps-control under driver_root
    driver_root: str = "/"
    mig_minors_file: str = "/proc/driver/nvidia-caps/mig-minors"  # MIG capability minors (the driver's list)

    def is_shared(self, gpu: Gpu) -> bool:
        return not gpu.mig_enabled and (self.shared_gpus is None or gpu.index in self.shared_gpus)

    @property
    def pool(self) -> str:
        return self.node_name

    @staticmethod
    def parse_shared(text: str) -> frozenset[int] | None:
        """``all``, ``none`` / ``""`` or GPU indexes ``0,2-3``; raises SliceError on anything else."""
        t = text.strip().lower()
        if t == "all":
            return None
        if t in ("", "none"):
            return frozenset()
        out: set[int] = set()
        for part in t.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not m:
                raise SliceError(f"shared GPUs {text!r}: expected all, none or GPU indexes like 0,2-3")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise SliceError(f"shared GPUs {text!r}: range {lo}-{hi} is backwards")
            out.update(range(lo, hi + 1))
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    key: str
    value: str
    effect: str
    time_added: str  # RFC 3339, kept stable across republishing

    def as_dict(self) -> dict[str, str]:
        out = {"effect": self.effect, "key": self.key, "timeAdded": self.time_added}
        if self.value:
            out["value"] = self.value
        return out


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    """One device of the pool as prepare needs it: what to hand to the container."""

    name: str
    pool: str
    type: str  # TYPE_GPU / TYPE_MIG
    uuid: str  # the GPU's, or the MIG device's
    gpu_uuid: str  # the physical GPU
    index: int
    minor: int
    memory_bytes: int
    gi: int | None = None
    ci: int | None = None
    share_memory_max: int = 0  # takes shares (allowMultipleAllocations): the most memory one claim can have

    def whole(self, consumed: Mapping[str, int]) -> bool:
        """Whether an allocation consuming ``consumed`` (compute percent, memory bytes) holds the whole GPU."""
        return consumed.get("compute", 100) >= 100 and consumed.get("memory", self.memory_bytes) >= (
            self.share_memory_max or self.memory_bytes)


def device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.index}"


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    return f"gpu-{gpu.index}-mig-{mig.profile.replace('.', '')}-{mig.gi}"


def counter_set_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.index}-counter-set"


def semver(text: str) -> str | None:
    """``8.0`` -> ``8.0.0``, ``550.54.15`` as is, ``12.4`` -> ``12.4.0``; None when not numeric."""
    parts = text.strip().split(".")
    if not text.strip() or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    parts = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(parts)


def pcie_root(pci_bus_id: str, sysfs_root: str = "/sys") -> str | None:
    """The PCIe root complex (``pci0000:00``) of a GPU, from its sysfs device path; None if unknown."""
    if not pci_bus_id:
        return None
    domain, _, rest = pci_bus_id.lower().partition(":")
    sysname = f"{domain[-4:]}:{rest}" if rest else pci_bus_id.lower()
    link = os.path.join(sysfs_root, "bus", "pci", "devices", sysname)
    try:
        real = os.path.realpath(link, strict=True)
    except OSError:
        return None
    for part in real.split(os.sep):
        if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", part):
            return part
    return None


def nvlink_cliques(inv: NodeInventory) -> dict[str, tuple[int, ...]]:
    """GPU UUID -> the indexes of its NVLink-connected component (itself included); PCIe-only GPUs omitted."""
    by_uuid = {g.uuid: g for g in inv.gpus}
    seen: dict[str, tuple[int, ...]] = {}
    for g in inv.gpus:
        if g.uuid in seen or not any(n > 0 for n in g.links.values()):
            continue
        comp, stack = set(), [g.uuid]
        while stack:
            u = stack.pop()
            if u in comp or u not in by_uuid:
                continue
            comp.add(u)
            stack += [p for p, n in by_uuid[u].links.items() if n > 0]
        idx = tuple(sorted(by_uuid[u].index for u in comp))
        for u in comp:
            seen[u] = idx
    return seen


def _attrs_common(g: Gpu, inv: NodeInventory, settings: DraSettings, dtype: str) -> dict[str, dict[str, Any]]:
    a: dict[str, dict[str, Any]] = {
        "type": {"string": dtype},
        "uuid": {"string": g.uuid},
        "index": {"int": g.index},
        "minor": {"int": g.minor},
        "productName": {"string": g.model},
        "brand": {"string": "Nvidia"},
    }
    if g.compute_capability is not None:
        major, minor = g.compute_capability
        a["cudaComputeCapability"] = {"version": f"{major}.{minor}.0"}
        if major in ARCHITECTURES:
            a["architecture"] = {"string": ARCHITECTURES[major]}
    drv = semver(inv.driver_version)
    if drv:
        a["driverVersion"] = {"version": drv}
    cuda = semver(inv.cuda_version)
    if cuda:
        a["cudaDriverVersion"] = {"version": cuda}
    if g.numa_node is not None:
        a["numaNode"] = {"int": g.numa_node}
    if g.pci_bus_id:
        a["pciBusID"] = {"string": g.pci_bus_id}
        root = pcie_root(g.pci_bus_id, settings.sysfs_root)
        if root:
            a[PCIE_ROOT_ATTRIBUTE] = {"string": root}
    return a


def _nvlink_attrs(g: Gpu, inv: NodeInventory, cliques: Mapping[str, tuple[int, ...]]) -> dict[str, dict[str, Any]]:
    if g.uuid not in cliques:
        return {}
    by_uuid = {x.uuid: x for x in inv.gpus}
    peers = sorted(by_uuid[p].index for p, n in g.links.items() if n > 0 and p in by_uuid)
    clique = cliques[g.uuid]
    return {
        "nvlinkClique": {"string": f"{inv.name}.{clique[0]}"[-64:]},
        "nvlinkPeers": {"string": ",".join(str(i) for i in peers)},
        "nvlinkCliqueSize": {"int": len(clique)},
    }


def taint_for(reason: str, time_added: str) -> DeviceTaint:
    """The taint for an unhealthy device: ``xid-error=<xid>`` when the reason names an Xid."""
    m = _XID_RE.match(reason or "")
    if m and m.group(1) != "0":
        return DeviceTaint(TAINT_XID, m.group(1), "NoSchedule", time_added)
    return DeviceTaint(TAINT_UNHEALTHY, "", "NoSchedule", time_added)


def _sorted(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in sorted(d)}


def _mig_slices(m: MigDevice) -> int:
    if "slices.gi" in m.attributes:
        return int(m.attributes["slices.gi"])
    head = m.profile.split(".")
    for part in head:
        if part.endswith("g") and part[:-1].isdigit():
            return int(part[:-1])
    return 1


def _gpu_slices(g: Gpu) -> int:
    return 7 if g.mig_capable or g.mig_enabled else 0


def _multiprocessors(g: Gpu) -> int | None:
    """The GPU's SM count when the MIG attributes tell it (sum over a full geometry), else None."""
    total = sum(int(m.attributes.get("multiprocessors", 0)) for m in g.mig_devices)
    slices = sum(_mig_slices(m) for m in g.mig_devices)
    if total and slices:
        return total * _gpu_slices(g) // slices
    return None


@dataclass
class PoolContent:
    """The devices and counter sets of a node's pool, before splitting into slices."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    counter_sets: list[dict[str, Any]] = field(default_factory=list)
    table: dict[str, PublishedDevice] = field(default_factory=dict)  # device name -> device


def pool_content(inv: NodeInventory, settings: DraSettings, taints: Mapping[str, DeviceTaint] | None = None,
                 views: Mapping[str, GpuView] | None = None) -> PoolContent:
    """Every device of the node's pool. ``taints`` maps a GPU or MIG UUID to its taint; ``views`` a GPU UUID
    to how its shares are enforced now (:meth:`kubegpu.node.mps.enforcer.ShareEnforcer.views`)."""
    taints = taints or {}
    views = views or {}
    out = PoolContent()
    cliques = nvlink_cliques(inv)
    pool = settings.pool

    def add(dev: dict[str, Any], pd: PublishedDevice) -> None:
        t = taints.get(pd.uuid) or taints.get(pd.gpu_uuid)
        if t is not None:
            dev["taints"] = [t.as_dict()]
        out.devices.append(dev)
        out.table[pd.name] = pd

    # Plain GPUs first: kube-scheduler tries devices in slice order, so a whole-GPU claim lands on a GPU
    # without MIG before it would take a MIG-enabled GPU (with all its instances) whole.
    for g in sorted(inv.gpus, key=lambda x: (x.mig_enabled and bool(x.mig_devices), x.index)):
        attrs = _attrs_common(g, inv, settings, TYPE_GPU)
        attrs.update(_nvlink_attrs(g, inv, cliques))
        name = device_name(g)
        base = PublishedDevice(name, pool, TYPE_GPU, g.uuid, g.uuid, g.index, g.minor, g.memory_bytes)
        if g.mig_enabled and g.mig_devices:
            attrs["migEnabled"] = {"bool": True}
            cs = counter_set_name(g)
            sms = _multiprocessors(g)
            counters: dict[str, Any] = {"compute-slices": {"value": str(_gpu_slices(g))},
                                        "memory": {"value": format_bytes(g.memory_bytes)}}
            if sms:
                counters["multiprocessors"] = {"value": str(sms)}
            out.counter_sets.append({"counters": _sorted(counters), "name": cs})
            add({"attributes": _sorted(attrs), "capacity": {"memory": {"value": format_bytes(g.memory_bytes)}},
                 "consumesCounters": [{"counterSet": cs, "counters": _sorted(counters)}], "name": name}, base)
            for m in sorted(g.mig_devices, key=lambda x: (x.gi, x.ci)):
                mattrs = _attrs_common(g, inv, settings, TYPE_MIG)
                mattrs.pop(PCIE_ROOT_ATTRIBUTE, None)
                mattrs.update({"uuid": {"string": m.uuid}, "parentUUID": {"string": g.uuid},
                               "profile": {"string": m.profile}, "gi": {"int": m.gi}, "ci": {"int": m.ci}})
                if PCIE_ROOT_ATTRIBUTE in attrs:
                    mattrs[PCIE_ROOT_ATTRIBUTE] = attrs[PCIE_ROOT_ATTRIBUTE]
                cap: dict[str, Any] = {"memory": {"value": format_bytes(m.memory_bytes)}}
                use: dict[str, Any] = {"compute-slices": {"value": str(_mig_slices(m))},
                                       "memory": {"value": format_bytes(m.memory_bytes)}}
                msm = m.attributes.get("multiprocessors")
                if msm:
                    cap["multiprocessors"] = {"value": str(msm)}
                    if sms:
                        use["multiprocessors"] = {"value": str(msm)}
                mname = mig_device_name(g, m)
                add({"attributes": _sorted(mattrs), "capacity": _sorted(cap),
                     "consumesCounters": [{"counterSet": cs, "counters": _sorted(use)}], "name": mname},
                    PublishedDevice(mname, pool, TYPE_MIG, m.uuid, g.uuid, g.index, g.minor, m.memory_bytes,
                                    m.gi, m.ci))
        elif settings.is_shared(g):
            # How a share here is held to its limits (a daemon that is down taints the device instead).
            attrs.update(enforcement_attrs(views.get(g.uuid), settings))
            step = settings.share_memory_step
            mem_max = g.memory_bytes - g.memory_bytes % step
            if mem_max < step:
                raise SliceError(f"GPU {g.index}: {g.memory_bytes} bytes of memory is less than one share step")
            default_mem = mem_max if settings.share_memory_default is None else min(
                max(step, settings.share_memory_default), mem_max)
            default_mem -= default_mem % step
            # The defaults are the whole GPU: a claim naming no capacity is a whole-GPU claim (the API
            # allows default == max; recorded s4: a claim without requests consumes the defaults).
            cap = {
                "compute": {"requestPolicy": {"default": "100",
                                              "validRange": {"max": "100", "min": "1", "step": "1"}},
                            "value": "100"},
                "memory": {"requestPolicy": {"default": format_bytes(default_mem),
                                             "validRange": {"max": format_bytes(mem_max), "min": format_bytes(step),
                                                            "step": format_bytes(step)}},
                           "value": format_bytes(g.memory_bytes)},
            }
            view = views.get(g.uuid)
            lock = parse_shape(view.shape_lock) if view is not None and view.shape_lock else None
            if lock is not None:
                keep_to_lock(cap, lock, default_mem)
            add({"allowMultipleAllocations": True, "attributes": _sorted(attrs), "capacity": cap, "name": name},
                PublishedDevice(name, pool, TYPE_GPU, g.uuid, g.uuid, g.index, g.minor, g.memory_bytes,
                                share_memory_max=mem_max))
        else:
            add({"attributes": _sorted(attrs), "capacity": {"memory": {"value": format_bytes(g.memory_bytes)}},
                 "name": name}, base)
    return out


def keep_to_lock(cap: dict[str, Any], lock: ShareShape, default_mem: int) -> None:
    """A strict GPU serving shares of ``lock``: its consumable capacity takes that shape only.

    kube-scheduler rounds a request up to the smallest of ``validValues`` at least as large (KEP-5075; what it
    consumed is in the claim's ``consumedCapacity``, which the node enforces), and refuses the device for a
    request above all of them. So the values are the lock and the defaults: a share up to the lock is given the
    lock's shape, a larger share rounds up to the whole GPU and does not fit beside the running shares, and a
    claim naming no capacity (a whole GPU) consumes the defaults as before. A lock over several GPUs (one
    server over exactly them) takes no new share: the values are the defaults alone."""
    compute = {100} if lock.spans > 1 else {lock.percent, 100}
    memory = {default_mem} if lock.spans > 1 else {lock.memory_mib * MIB, default_mem}
    cap["compute"]["requestPolicy"] = {"default": "100", "validValues": [str(v) for v in sorted(compute)]}
    cap["memory"]["requestPolicy"] = {"default": format_bytes(default_mem),
                                      "validValues": [format_bytes(v) for v in sorted(memory)]}


def enforcement_attrs(view: GpuView | None, settings: DraSettings) -> dict[str, dict[str, Any]]:
    """A shared GPU's enforcement as device attributes (a CEL selector can ask for ``shareEscapable == false``):
    its mode, and under strict its compute mode and the share shape it is locked to while its shares run."""
    if view is None:
        mode = settings.enforcement if settings.mps else "none"
        return {"shareEnforcement": {"string": mode}, "shareEscapable": {"bool": mode != "strict"}}
    out: dict[str, dict[str, Any]] = {"shareEnforcement": {"string": view.mode},
                                      "shareEscapable": {"bool": view.escapable}}
    if view.compute_mode:
        out["computeMode"] = {"string": view.compute_mode}
    if view.shape_lock:
        out["shareShapeLock"] = {"string": view.shape_lock}
    return out


def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def slice_bodies(content: PoolContent, settings: DraSettings, generation: int) -> list[dict[str, Any]]:
    """The ResourceSlice objects (without server fields) for a pool's content at ``generation``."""
    node = settings.node_name
    device_chunks = list(_chunks(content.devices, MAX_DEVICES_PER_SLICE)) or [[]]
    counter_chunks = list(_chunks(content.counter_sets, MAX_COUNTER_SETS_PER_SLICE))
    count = len(device_chunks) + len(counter_chunks)
    pool = {"generation": generation, "name": settings.pool, "resourceSliceCount": count}
    out: list[dict[str, Any]] = []
    for i, devs in enumerate(device_chunks):
        name = f"{node}-{DRIVER}" + (f"-{i}" if i else "")
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                    "spec": {"devices": devs, "driver": DRIVER, "nodeName": node, "pool": dict(pool)}})
    for i, sets in enumerate(counter_chunks):
        name = f"{node}-{DRIVER}-counters" + (f"-{i}" if i else "")
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                    "spec": {"driver": DRIVER, "nodeName": node, "pool": dict(pool), "sharedCounters": sets}})
    return out


def health_taints(inv: NodeInventory, health: Mapping[str, bool], reasons: Mapping[str, str],
                  previous: Mapping[str, DeviceTaint], now: str) -> dict[str, DeviceTaint]:
    """Taints for the unhealthy devices; a device still unhealthy keeps its previous taint (and time)."""
    out: dict[str, DeviceTaint] = {}
    uuids = [g.uuid for g in inv.gpus] + [m.uuid for g in inv.gpus for m in g.mig_devices]
    for u in uuids:
        if health.get(u, True):
            continue
        t = taint_for(reasons.get(u, ""), now)
        prev = previous.get(u)
        out[u] = prev if prev is not None and (prev.key, prev.value) == (t.key, t.value) else t
    return out
