"""The NVML inventory backend: a real node's GPUs, topology, MIG state and Xid health events.

It talks to the driver through ``nvidia-ml-py`` (``import pynvml``), imported lazily so the
rest of kubegpu runs without it; tests hand in a scripted stand-in module instead. Every
NVMLError becomes an :class:`InventoryError` with a readable message (no driver or library:
``NVML not available: …``). What it reads, and how (contracts.md §6):

- per GPU: UUID, index, minor, name, memory, PCI bus id, NUMA node (NVML, else sysfs),
  compute capability; per node: driver and CUDA versions, CPU count and memory;
- NVLink: each enabled link's remote PCI bus id names the peer GPU; links to NVSwitches
  connect every pair of switch-attached GPUs (with the smaller link count of the two); with
  no NVLink information, NVML's P2P-over-NVLink status counts as one link;
- MIG: mode, devices (empty slots skipped), GI/CI ids, attributes, and the profile name by
  go-nvlib's rule, with the ``+me`` / ``-me`` / ``+gfx`` suffix from the GPU-instance profile;
- health as NVIDIA's ``health.go``: register Xid (plus ECC) events on every GPU, wait with a
  timeout (``NVMLError_Timeout`` -> ``None``), map the event's device and GI/CI to the GPU or
  MIG UUID; any other wait error, or an event whose device cannot be named, is an event with
  ``uuid=None`` (all devices). GPUs too old for events are logged and skipped;
- ``probe(uuid)``: a memory-info query on the device.

The §6.4 gotchas are handled: ``c_char`` fields (bus ids) arrive as bytes and are decoded;
MIG handles come from the parent (``nvmlDeviceIsMigDeviceHandle`` and its ``c_uint`` are not
needed); P2P indexes are passed as plain ints (``NVML_P2P_CAPS_INDEX_READ`` is a tuple in
13.615.71); functions an older library lacks count as "not supported".
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from kubegpu.inventory.base import HealthEvent, InventoryError
from kubegpu.inventory.compute_modes import FROM_NVML, NVML_VALUES
from kubegpu.inventory.mig import profile_name
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory

log = logging.getLogger(__name__)

T = TypeVar("T")

_NO_INSTANCE = 0xFFFFFFFF
_MIB = 2**20
_XID = 0x8
_ECC = 0x1 | 0x2
_P2P_CAPS_INDEX_NVLINK = 2
_NVLINK_DEVICE_TYPE_GPU = 0x00
_NVLINK_DEVICE_TYPE_SWITCH = 0x02

# NVML error codes that mean "there is no usable NVML here" rather than "this call failed".
_UNAVAILABLE = {9: "driver not loaded", 12: "NVML shared library not found", 13: "function not found",
                18: "NVML/driver version mismatch"}

# Where NVIDIA's device plugin looks for the driver's NVML library under the (container) driver root
# (k8s-device-plugin ``root.tryResolveLibrary``), in this order.
NVML_LIBRARY = "libnvidia-ml.so.1"
LIBRARY_DIRS = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64",
                "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")


def locate_nvml(driver_root: str | Path | None) -> Path | None:
    """``libnvidia-ml.so.1`` under the driver root mounted into this container, or None.

    NVIDIA's plugin loads NVML from the driver root it is given (the chart mounts the host's at
    ``/driver-root``) and otherwise from the library path, where the NVIDIA container runtime
    puts it for a container started with ``NVIDIA_VISIBLE_DEVICES`` set."""
    if not driver_root:
        return None
    root = Path(driver_root)
    for d in LIBRARY_DIRS:
        candidate = root / d / NVML_LIBRARY
        if candidate.exists():
            return candidate
    return None


def _preload(path: Path) -> None:
    """Load the library by path with global symbols: pynvml's own ``dlopen("libnvidia-ml.so.1")`` then
    finds the already loaded object by its soname instead of searching the library path."""
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def runtime_hint(env: Mapping[str, str]) -> str:
    """Why the driver may be missing from this container, from the environment the runtime saw."""
    visible = env.get("NVIDIA_VISIBLE_DEVICES")
    caps = env.get("NVIDIA_DRIVER_CAPABILITIES", "")
    if not visible or visible in ("void", "none"):
        return ("NVIDIA_VISIBLE_DEVICES is not set to 'all' in this container, so the NVIDIA container runtime "
                "did not inject the driver: run it as `kubegpu manifests` renders it (NVIDIA_VISIBLE_DEVICES=all, "
                "runtimeClassName of the NVIDIA runtime where it is not the default)")
    if caps and caps != "all" and "utility" not in caps.split(","):
        return (f"NVIDIA_DRIVER_CAPABILITIES={caps} lacks 'utility', the capability that carries NVML "
                "(use compute,utility)")
    return ("is the NVIDIA driver installed on the node and this pod run by the NVIDIA container runtime "
            "(runtimeClassName, or the runtime's default), or the host driver root mounted at the container "
            "driver root?")


# GPU-instance profile ids -> go-nvlib's name suffix.
_PROFILE_SUFFIX = {0x7: "+me", 0x8: "+me", 0xA: "+gfx", 0xB: "+gfx", 0xC: "+gfx", 0x11: "+gfx",
                   0xD: "-me", 0xE: "-me", 0xF: "+me.all", 0x10: "+me.all"}


def _text(value: Any) -> str:
    """NVML strings arrive as str or, from c_char struct fields, as bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def normalize_bus_id(bus_id: str) -> str:
    """``0000:3b:00.0`` / ``00000000:3B:00.0`` -> ``00000000:3B:00.0`` (NVML's 8-digit domain form)."""
    bus_id = bus_id.strip().upper()
    domain, sep, rest = bus_id.partition(":")
    if sep and rest.count(":") == 1 and len(domain) <= 8:
        return f"{domain.zfill(8)}:{rest}"
    return bus_id


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's bus id as sysfs names it: lower case, 4-digit domain."""
    b = normalize_bus_id(bus_id).lower()
    domain, _, rest = b.partition(":")
    return f"{domain[-4:]}:{rest}"


class NvmlBackend:
    """GPUs as the NVIDIA driver reports them."""

    def __init__(self, node_name: str | None = None, nvml: ModuleType | Any | None = None,
                 sysfs_root: str | Path = "/sys", driver_root: str | Path | None = None,
                 env: Mapping[str, str] | None = None,
                 preload: Callable[[Path], None] = _preload) -> None:
        self._env = dict(env or {})  # the node's environment, as its entry read it (NODE_NAME, the runtime's hints)
        self._node_name = node_name or self._env.get("NODE_NAME") or socket.gethostname()
        self._nvml_module = nvml
        # The host's driver root as mounted in this container (NVIDIA's containerDriverRoot).
        self._driver_root = driver_root
        self._preload = preload
        self.library: Path | None = None  # the NVML library loaded by path, if any
        self._sysfs = Path(sysfs_root)
        self._lock = threading.Lock()
        self._initialized = False
        self._event_set: Any = None
        self._pending: list[HealthEvent] = []
        self._mig_by_parent: dict[tuple[str, int, int], str] = {}
        self._closed = False

    # --- plumbing ----------------------------------------------------------------------------

    @property
    def nvml(self) -> Any:
        if self._nvml_module is None:
            try:
                self._nvml_module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise InventoryError(
                    f"NVML not available: the nvidia-ml-py package is not installed ({exc})") from exc
        return self._nvml_module

    def _is_nvml_error(self, exc: BaseException) -> bool:
        return isinstance(exc, self.nvml.NVMLError)

    def _error(self, exc: BaseException, what: str) -> InventoryError:
        code = getattr(exc, "value", None)
        if code in _UNAVAILABLE:
            where = (f" (no {NVML_LIBRARY} under the driver root {self._driver_root} either)"
                     if self._driver_root and self.library is None else "")
            return InventoryError(
                f"NVML not available: {_UNAVAILABLE[code]} while trying to {what} ({exc}){where}; "
                f"{runtime_hint(self._env)}")
        return InventoryError(f"NVML failed to {what}: {exc} (NVML error {code})")

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            if self._is_nvml_error(exc):
                raise self._error(exc, what) from exc
            raise

    def _try(self, name: str, *args: Any, default: Any = None) -> Any:
        """An NVML call whose failure (NotSupported, an older library without it) means 'unknown'."""
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except Exception as exc:
            if self._is_nvml_error(exc):
                return default
            raise

    def _ensure_init(self) -> None:
        if self._closed:
            raise InventoryError("NVML backend is closed")
        if not self._initialized:
            if self.library is None:
                found = locate_nvml(self._driver_root)
                if found is not None:
                    try:
                        self._preload(found)
                        self.library = found
                        log.info("NVML from the driver root: %s", found)
                    except OSError as exc:
                        log.warning("cannot load %s (%s); trying the library path", found, exc)
            try:
                self.nvml.nvmlInit()
            except InventoryError:
                raise
            except Exception as exc:
                if self._is_nvml_error(exc):
                    raise self._error(exc, "initialize") from exc
                raise InventoryError(f"NVML not available: {exc}") from exc
            self._initialized = True

    # --- discovery ---------------------------------------------------------------------------

    def discover(self) -> NodeInventory:
        with self._lock:
            self._ensure_init()
            n = self.nvml
            driver = _text(self._call("read the driver version", n.nvmlSystemGetDriverVersion))
            cuda = self._try("nvmlSystemGetCudaDriverVersion")
            count = self._call("count GPUs", n.nvmlDeviceGetCount)
            handles: list[tuple[int, Any]] = []
            gpus: list[Gpu] = []
            for i in range(count):
                try:
                    h = n.nvmlDeviceGetHandleByIndex(i)
                except Exception as exc:
                    if not self._is_nvml_error(exc):
                        raise
                    log.warning("GPU %d: skipped, NVML cannot open it: %s", i, exc)
                    continue
                gpus.append(self._gpu(i, h))
                handles.append((i, h))
            gpus = self._with_links(gpus, handles)
            self._mig_by_parent = {(g.uuid, m.gi, m.ci): m.uuid for g in gpus for m in g.mig_devices}
            return NodeInventory(
                name=self._node_name,
                gpus=tuple(gpus),
                cpu_milli=(os.cpu_count() or 0) * 1000,
                memory_bytes=_host_memory(),
                driver_version=driver,
                cuda_version=_cuda_version(cuda),
            )

    def _gpu(self, i: int, h: Any) -> Gpu:
        n = self.nvml
        try:
            uuid = _text(n.nvmlDeviceGetUUID(h))
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            raise self._error(exc, f"read the UUID of GPU {i}") from exc
        try:
            name = _text(n.nvmlDeviceGetName(h))
            memory = int(n.nvmlDeviceGetMemoryInfo(h).total)
            minor = int(n.nvmlDeviceGetMinorNumber(h))
            index = int(self._try("nvmlDeviceGetIndex", h, default=i))
            bus_id = normalize_bus_id(_text(n.nvmlDeviceGetPciInfo(h).busId))
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            # A GPU that answers to its UUID but not to basic queries (fallen off the bus, Xid 79):
            # keep it, unhealthy, so the plugin reports it Unhealthy instead of losing it.
            log.warning("GPU %d (%s): unhealthy, NVML query failed: %s", i, uuid, exc)
            return Gpu(uuid=uuid, index=i, minor=i, model="", memory_bytes=0, healthy=False)
        cc = self._try("nvmlDeviceGetCudaComputeCapability", h)
        mig_capable, mig_enabled, migs = self._mig(h, uuid, i, memory)
        return Gpu(
            uuid=uuid,
            index=index,
            minor=minor,
            model=name,
            memory_bytes=memory,
            numa_node=self._numa(h, bus_id),
            pci_bus_id=bus_id,
            compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
            mig_enabled=mig_enabled,
            mig_devices=migs,
            mig_capable=mig_capable,
        )

    def _numa(self, h: Any, bus_id: str) -> int | None:
        node = self._try("nvmlDeviceGetNumaNodeId", h)
        if isinstance(node, int):
            return node if node >= 0 else None
        try:
            text = (self._sysfs / "bus" / "pci" / "devices" / sysfs_bus_id(bus_id) / "numa_node").read_text()
            value = int(text.strip())
        except (OSError, ValueError):
            return None
        return value if value >= 0 else None

    def _mig(self, h: Any, parent: str, gpu_index: int,
             total: int) -> tuple[bool, bool, tuple[MigDevice, ...]]:
        n = self.nvml
        mode = self._try("nvmlDeviceGetMigMode", h)
        if mode is None:
            return False, False, ()
        current = mode[0] if isinstance(mode, list | tuple) else mode
        if int(current) != 1:
            return True, False, ()
        migs: list[MigDevice] = []
        slots = self._call(f"count MIG devices of GPU {gpu_index}", n.nvmlDeviceGetMaxMigDeviceCount, h)
        for slot in range(slots):
            try:
                mh = n.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            except Exception as exc:
                if self._is_nvml_error(exc) and getattr(exc, "value", None) == 6:  # NotFound: empty slot
                    continue
                if self._is_nvml_error(exc):
                    raise self._error(exc, f"open MIG slot {slot} of GPU {gpu_index}") from exc
                raise
            what = f"read MIG device {slot} of GPU {gpu_index}"
            uuid = _text(self._call(what, n.nvmlDeviceGetUUID, mh))
            gi = int(self._call(what, n.nvmlDeviceGetGpuInstanceId, mh))
            ci = int(self._call(what, n.nvmlDeviceGetComputeInstanceId, mh))
            a = self._call(what, n.nvmlDeviceGetAttributes, mh)
            suffix = ""
            gih = self._try("nvmlDeviceGetGpuInstanceById", h, gi)
            if gih is not None:
                info = self._try("nvmlGpuInstanceGetInfo", gih)
                if info is not None:
                    suffix = _PROFILE_SUFFIX.get(int(info.profileId), "")
            mem_mib = int(a.memorySizeMB)
            migs.append(MigDevice(
                uuid=uuid,
                profile=profile_name(int(a.gpuInstanceSliceCount), int(a.computeInstanceSliceCount),
                                     mem_mib, total, suffix),
                parent_uuid=parent, gi=gi, ci=ci, memory_bytes=mem_mib * _MIB, index=len(migs),
                attributes={
                    "multiprocessors": int(a.multiprocessorCount),
                    "slices.gi": int(a.gpuInstanceSliceCount),
                    "slices.ci": int(a.computeInstanceSliceCount),
                    "engines.copy": int(a.sharedCopyEngineCount),
                    "engines.decoder": int(a.sharedDecoderCount),
                    "engines.encoder": int(a.sharedEncoderCount),
                    "engines.jpeg": int(a.sharedJpegCount),
                    "engines.ofa": int(a.sharedOfaCount),
                },
            ))
        return True, True, tuple(migs)

    def _with_links(self, gpus: list[Gpu], handles: list[tuple[int, Any]]) -> list[Gpu]:
        n = self.nvml
        by_bus = {g.pci_bus_id: g.uuid for g in gpus if g.pci_bus_id}
        links: dict[str, dict[str, int]] = {g.uuid: {} for g in gpus}
        switch_links: dict[str, int] = {}
        max_links = int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))
        healthy = [(g, h) for g, (_, h) in zip(gpus, handles, strict=True) if g.healthy]
        for g, h in healthy:
            for link in range(max_links):
                state = self._try("nvmlDeviceGetNvLinkState", h, link)
                if state is None or int(state) != 1:
                    continue
                kind = self._try("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
                if kind == _NVLINK_DEVICE_TYPE_SWITCH:
                    switch_links[g.uuid] = switch_links.get(g.uuid, 0) + 1
                    continue
                remote = self._try("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
                if remote is None:
                    continue
                peer = by_bus.get(normalize_bus_id(_text(remote.busId)))
                if peer is not None and peer != g.uuid:
                    links[g.uuid][peer] = links[g.uuid].get(peer, 0) + 1
                elif peer is None and kind not in (None, _NVLINK_DEVICE_TYPE_GPU):
                    switch_links[g.uuid] = switch_links.get(g.uuid, 0) + 1
        # NVSwitch: every pair of switch-attached GPUs talks over min(links of either) links.
        for a in switch_links:
            for b in switch_links:
                if a != b:
                    links[a][b] = max(links[a].get(b, 0), min(switch_links[a], switch_links[b]))
        # No NVLink information at all: fall back to NVML's P2P-over-NVLink status.
        if not any(links.values()):
            for ga, ha in healthy:
                for gb, hb in healthy:
                    if ga.uuid < gb.uuid and self._try("nvmlDeviceGetP2PStatus", ha, hb,
                                                       _P2P_CAPS_INDEX_NVLINK) == 0:
                        links[ga.uuid][gb.uuid] = links[gb.uuid][ga.uuid] = 1
        return [replace(g, links=dict(sorted(links[g.uuid].items()))) for g in gpus]

    # --- health --------------------------------------------------------------------------------

    def _register_events(self) -> None:
        """NVIDIA's health.go: Xid + ECC events on every GPU; too-old GPUs are skipped."""
        n = self.nvml
        self._event_set = self._call("create an event set", n.nvmlEventSetCreate)
        for i in range(self._call("count GPUs", n.nvmlDeviceGetCount)):
            uuid = None
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(n.nvmlDeviceGetUUID(h))
                supported = int(n.nvmlDeviceGetSupportedEventTypes(h))
                mask = (_XID | _ECC) & supported
                if not mask & _XID:
                    log.warning("GPU %s: too old for Xid health checks; not monitored", uuid)
                    continue
                n.nvmlDeviceRegisterEvents(h, mask, self._event_set)
            except Exception as exc:
                if not self._is_nvml_error(exc):
                    raise
                if getattr(exc, "value", None) == 3:  # NotSupported
                    log.warning("GPU %s: health events not supported; not monitored", uuid or i)
                    continue
                # NVIDIA marks a GPU it cannot watch unhealthy; say so on the next wait.
                self._pending.append(HealthEvent(uuid=uuid, xid=0,
                                                 message=f"cannot register health events: {exc}"))

    def wait_event(self, timeout_s: float) -> HealthEvent | None:
        n = self.nvml
        with self._lock:
            self._ensure_init()
            if self._event_set is None:
                self._register_events()
            if self._pending:
                return self._pending.pop(0)
            event_set = self._event_set
        try:
            data = n.nvmlEventSetWait(event_set, max(0, int(timeout_s * 1000)))
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            if getattr(exc, "value", None) == 10:  # Timeout
                return None
            return HealthEvent(uuid=None, xid=0, message=f"NVML event wait failed: {exc}")
        if int(data.eventType) != _XID:
            return None  # ECC events are registered (as NVIDIA does) but not acted on
        xid = int(data.eventData)
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        try:
            parent = _text(n.nvmlDeviceGetUUID(data.device))
        except Exception as exc:
            if not self._is_nvml_error(exc):
                raise
            return HealthEvent(uuid=None, xid=xid, message=f"Xid {xid} on a device NVML cannot name: {exc}")
        if gi != _NO_INSTANCE and ci != _NO_INSTANCE:
            mig = self._mig_by_parent.get((parent, gi, ci))
            if mig is not None:
                return HealthEvent(uuid=mig, xid=xid, gi=gi, ci=ci, message=f"Xid {xid}")
            return HealthEvent(uuid=parent, xid=xid, gi=gi, ci=ci,
                               message=f"Xid {xid} (MIG {gi}/{ci} not known)")
        return HealthEvent(uuid=parent, xid=xid, message=f"Xid {xid}")

    def probe(self, uuid: str) -> bool:
        n = self.nvml
        try:
            self._ensure_init()
            h = n.nvmlDeviceGetHandleByUUID(uuid)
            n.nvmlDeviceGetMemoryInfo(h)
        except InventoryError:
            return False
        except Exception as exc:
            if self._is_nvml_error(exc):
                return False
            raise
        return True

    # --- compute modes (strict share enforcement, node/mps/compute_mode.py) ---------------------

    def compute_mode(self, uuid: str) -> str:
        with self._lock:
            self._ensure_init()
            n = self.nvml
            h = self._call(f"open GPU {uuid}", n.nvmlDeviceGetHandleByUUID, uuid)
            value = self._call(f"read the compute mode of {uuid}", n.nvmlDeviceGetComputeMode, h)
        return FROM_NVML.get(int(value), f"unknown ({value})")

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        """As ``nvidia-smi -i <uuid> -c <mode>``: needs root (CAP_SYS_ADMIN) on the host's driver."""
        if mode not in NVML_VALUES:
            raise InventoryError(f"unknown compute mode {mode!r}")
        with self._lock:
            self._ensure_init()
            n = self.nvml
            h = self._call(f"open GPU {uuid}", n.nvmlDeviceGetHandleByUUID, uuid)
            self._call(f"set compute mode {mode} on {uuid}", n.nvmlDeviceSetComputeMode, h, NVML_VALUES[mode])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._initialized:
                return
            if self._event_set is not None:
                self._try("nvmlEventSetFree", self._event_set)
                self._event_set = None
            self._try("nvmlShutdown")
            self._initialized = False


def _cuda_version(value: Any) -> str:
    """NVML's CUDA driver version integer (12040) as ``12.4``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return f"{value // 1000}.{value % 1000 // 10}"
    return ""


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
