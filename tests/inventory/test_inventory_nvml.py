"""The NVML backend's real code against a scripted pynvml stand-in: discovery, topology, MIG, errors, health."""

from __future__ import annotations

import queue
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as real
import pytest

from kubegpu.inventory.base import HealthEvent, InventoryError
from kubegpu.inventory.nvml import NvmlBackend, normalize_bus_id, sysfs_bus_id
from kubegpu.inventory.topology import load_topology, parse_topology
from kubegpu.model.inventory import Gpu, NodeInventory

_SUFFIX_TO_GI_PROFILE = {"": 0x0, "+me": 0x7, "+gfx": 0xA, "-me": 0xD, "+me.all": 0xF}


def nvml_error(code: int) -> Exception:
    """A real-shaped NVMLError subclass instance (e.g. NVMLError_GpuIsLost) with .value = code."""
    return real.NVMLError(code)


class Handle:
    def __init__(self, gpu: int, mig: int | None = None) -> None:
        self.gpu, self.mig = gpu, mig


class ScriptedNvml:
    """A pynvml stand-in playing a machine described by a NodeInventory.

    ``fail[name]`` makes function ``name`` raise (an exception, or a callable(args) returning
    one or None); ``events`` feeds nvmlEventSetWait; ``calls`` records what was called.
    """

    def __init__(self, inv: NodeInventory, nvswitch: bool = False, driver: str = "550.54.15",
                 cuda: int = 12040) -> None:
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
                setattr(self, name, getattr(real, name))
        self.inv, self.nvswitch, self.driver, self.cuda = inv, nvswitch, driver, cuda
        self.fail: dict[str, Any] = {}
        self.events: queue.Queue[Any] = queue.Queue()
        self.calls: list[str] = []
        self.registered: dict[int, int] = {}
        self.supported = real.nvmlEventTypeXidCriticalError | 0x1 | 0x2 | 0x4
        self._link_table = {g.index: self._links(g) for g in inv.gpus}

    def _links(self, g: Gpu) -> list[tuple[int, str | None]]:
        """Per NVLink: (remote device type, remote bus id)."""
        if self.nvswitch and g.links:
            return [(real.NVML_NVLINK_DEVICE_TYPE_SWITCH, None)] * max(g.links.values())
        out: list[tuple[int, str | None]] = []
        for peer, n in g.links.items():
            bus = self.inv.gpu(peer).pci_bus_id
            out += [(real.NVML_NVLINK_DEVICE_TYPE_GPU, bus)] * n
        return out

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append(name)
        f = self.fail.get(name)
        if f is None:
            return
        exc = f(*args) if callable(f) and not isinstance(f, BaseException) else f
        if exc is not None:
            raise exc

    def _gpu(self, h: Handle) -> Gpu:
        return self.inv.gpus[h.gpu]

    # --- library / system
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    # --- devices
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.inv.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Handle:
        self._enter("nvmlDeviceGetHandleByIndex", i)
        if not 0 <= i < len(self.inv.gpus):
            raise nvml_error(real.NVML_ERROR_INVALID_ARGUMENT)
        return Handle(i)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        self._enter("nvmlDeviceGetHandleByUUID", uuid)
        for g in self.inv.gpus:
            if g.uuid == uuid:
                return Handle(g.index)
            for m in g.mig_devices:
                if m.uuid == uuid:
                    return Handle(g.index, m.index)
        raise nvml_error(real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        self._enter("nvmlDeviceGetUUID", h)
        g = self._gpu(h)
        return g.uuid if h.mig is None else g.mig_devices[h.mig].uuid

    def nvmlDeviceGetName(self, h: Handle) -> str:
        self._enter("nvmlDeviceGetName", h)
        return self._gpu(h).model

    def nvmlDeviceGetMemoryInfo(self, h: Handle) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", h)
        g = self._gpu(h)
        total = g.memory_bytes if h.mig is None else g.mig_devices[h.mig].memory_bytes
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetMinorNumber(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetMinorNumber", h)
        return self._gpu(h).minor

    def nvmlDeviceGetIndex(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetIndex", h)
        return self._gpu(h).index

    def nvmlDeviceGetPciInfo(self, h: Handle) -> Any:
        self._enter("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=self._gpu(h).pci_bus_id.encode())  # c_char field: bytes

    def nvmlDeviceGetNumaNodeId(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetNumaNodeId", h)
        numa = self._gpu(h).numa_node
        return -1 if numa is None else numa

    def nvmlDeviceGetCudaComputeCapability(self, h: Handle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", h)
        cc = self._gpu(h).compute_capability
        if cc is None:
            raise nvml_error(real.NVML_ERROR_NOT_SUPPORTED)
        return cc

    # --- MIG
    def nvmlDeviceGetMigMode(self, h: Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", h)
        g = self._gpu(h)
        if not g.mig_capable:
            raise nvml_error(real.NVML_ERROR_NOT_SUPPORTED)
        return [int(g.mig_enabled), int(g.mig_enabled)]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", h)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Handle, i: int) -> Handle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        if i >= len(self._gpu(h).mig_devices):
            raise nvml_error(real.NVML_ERROR_NOT_FOUND)
        return Handle(h.gpu, i)

    def nvmlDeviceGetGpuInstanceId(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", h)
        return self._gpu(h).mig_devices[h.mig].gi  # type: ignore[index]

    def nvmlDeviceGetComputeInstanceId(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", h)
        return self._gpu(h).mig_devices[h.mig].ci  # type: ignore[index]

    def nvmlDeviceGetAttributes(self, h: Handle) -> Any:
        self._enter("nvmlDeviceGetAttributes", h)
        m = self._gpu(h).mig_devices[h.mig]  # type: ignore[index]
        a = m.attributes
        return SimpleNamespace(
            multiprocessorCount=a.get("multiprocessors", 0), sharedCopyEngineCount=a.get("engines.copy", 0),
            sharedDecoderCount=a.get("engines.decoder", 0), sharedEncoderCount=a.get("engines.encoder", 0),
            sharedJpegCount=a.get("engines.jpeg", 0), sharedOfaCount=a.get("engines.ofa", 0),
            gpuInstanceSliceCount=a["slices.gi"], computeInstanceSliceCount=a["slices.ci"],
            memorySizeMB=m.memory_bytes // 2**20)

    def nvmlDeviceGetGpuInstanceById(self, h: Handle, gi: int) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceById", h, gi)
        for m in self._gpu(h).mig_devices:
            if m.gi == gi:
                return SimpleNamespace(profile=m.profile)
        raise nvml_error(real.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gih: Any) -> Any:
        self._enter("nvmlGpuInstanceGetInfo", gih)
        suffix = gih.profile[gih.profile.index("gb") + 2:]
        return SimpleNamespace(profileId=_SUFFIX_TO_GI_PROFILE[suffix])

    # --- NVLink
    def nvmlDeviceGetNvLinkState(self, h: Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState", h, link)
        if link >= len(self._link_table[h.gpu]):
            raise nvml_error(real.NVML_ERROR_INVALID_ARGUMENT if link < 18 else real.NVML_ERROR_NOT_SUPPORTED)
        return real.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
        return self._link_table[h.gpu][link][0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Handle, link: int) -> Any:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        bus = self._link_table[h.gpu][link][1] or "00000000:FF:00.0"
        # NVML reports remote ids with a 4-digit domain on some drivers, lower case.
        return SimpleNamespace(busId=sysfs_bus_id(bus).encode())

    def nvmlDeviceGetP2PStatus(self, a: Handle, b: Handle, index: int) -> int:
        self._enter("nvmlDeviceGetP2PStatus", a, b, index)
        assert isinstance(index, int)
        return real.NVML_P2P_STATUS_OK if self._gpu(a).links.get(self._gpu(b).uuid) else 1

    # --- events
    def nvmlEventSetCreate(self) -> str:
        self._enter("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: Handle) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", h)
        return self.supported

    def nvmlDeviceRegisterEvents(self, h: Handle, mask: int, es: str) -> None:
        self._enter("nvmlDeviceRegisterEvents", h, mask, es)
        self.registered[h.gpu] = mask

    def nvmlEventSetWait(self, es: str, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait", es, timeout_ms)
        try:
            item = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise nvml_error(real.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def nvmlEventSetFree(self, es: str) -> None:
        self._enter("nvmlEventSetFree", es)

    # --- helpers for tests
    def xid(self, gpu: int, xid: int, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF,
            event_type: int = real.nvmlEventTypeXidCriticalError) -> None:
        self.events.put(SimpleNamespace(device=Handle(gpu), eventType=event_type, eventData=xid,
                                        gpuInstanceId=gi, computeInstanceId=ci))


def comparable(inv: NodeInventory) -> NodeInventory:
    """What NVML can know: drop the node-level fields the host, not NVML, provides."""
    return replace(inv, name="n", cpu_milli=0, memory_bytes=0, labels={})


@pytest.mark.parametrize(("name", "nvswitch"), [("dgx1-v100", False), ("a100-mig", False), ("t4x4", False),
                                                ("dgx-a100", True), ("dgx-h100", True), ("l4x8", False)])
def test_discovery_reproduces_the_machine(name: str, nvswitch: bool) -> None:
    expected = load_topology(name).inventory
    major, minor = (int(x) for x in expected.cuda_version.split("."))
    nvml = ScriptedNvml(expected, nvswitch=nvswitch, driver=expected.driver_version, cuda=major * 1000 + minor * 10)
    got = NvmlBackend(node_name="n", nvml=nvml).discover()
    assert comparable(got) == comparable(expected)
    assert got.name == "n" and got.cpu_milli > 0


def test_mig_names_come_from_the_go_nvlib_rule_with_suffixes() -> None:
    inv = parse_topology({"gpu": {"model": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "migCapable": True},
                          "gpus": [{"mig": [{"profile": "1g.10gb+me", "gi": 7}, {"profile": "1c.3g.40gb", "gi": 2},
                                            {"profile": "2g.20gb", "gi": 3}]}]}).inventory
    got = NvmlBackend(nvml=ScriptedNvml(inv)).discover()
    assert [m.profile for m in got.gpus[0].mig_devices] == ["1g.10gb+me", "1c.3g.40gb", "2g.20gb"]
    assert [m.index for m in got.gpus[0].mig_devices] == [0, 1, 2]


def test_empty_mig_slots_are_skipped() -> None:
    inv = load_topology("a100-mig").inventory
    nvml = ScriptedNvml(inv)
    nvml.fail["nvmlDeviceGetMigDeviceHandleByIndex"] = lambda h, i: nvml_error(real.NVML_ERROR_NOT_FOUND) \
        if i == 0 else None
    got = NvmlBackend(nvml=nvml).discover()
    assert [m.profile for m in got.gpus[0].mig_devices] == ["2g.20gb", "1g.10gb", "1g.10gb"]
    assert [m.index for m in got.gpus[0].mig_devices] == [0, 1, 2]


def test_numa_falls_back_to_sysfs(tmp_path: Path) -> None:
    inv = load_topology("t4x4").inventory
    nvml = ScriptedNvml(inv)
    nvml.fail["nvmlDeviceGetNumaNodeId"] = nvml_error(real.NVML_ERROR_NOT_SUPPORTED)
    for g, value in zip(inv.gpus, ("1", "0", "-1"), strict=False):
        d = tmp_path / "bus" / "pci" / "devices" / sysfs_bus_id(g.pci_bus_id)
        d.mkdir(parents=True)
        (d / "numa_node").write_text(value + "\n")
    got = NvmlBackend(nvml=nvml, sysfs_root=tmp_path).discover()
    assert [g.numa_node for g in got.gpus] == [1, 0, None, None]
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0000:3b:00.0") == "00000000:3B:00.0"


def test_numa_when_the_library_lacks_the_call(tmp_path: Path) -> None:
    inv = load_topology("t4x4").inventory
    nvml = ScriptedNvml(inv)
    nvml.nvmlDeviceGetNumaNodeId = None  # an older nvidia-ml-py
    got = NvmlBackend(nvml=nvml, sysfs_root=tmp_path).discover()
    assert [g.numa_node for g in got.gpus] == [None] * 4


def test_p2p_status_when_nvlink_queries_are_unsupported() -> None:
    inv = load_topology("dgx1-v100").inventory
    nvml = ScriptedNvml(inv)
    nvml.fail["nvmlDeviceGetNvLinkState"] = nvml_error(real.NVML_ERROR_NOT_SUPPORTED)
    got = NvmlBackend(nvml=nvml).discover()
    m = got.link_matrix()
    assert m[0][1] == 1 and m[0][3] == 1 and m[0][5] == 0 and m[1][0] == 1


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (real.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML not available: NVML shared library not found"),
        (real.NVML_ERROR_DRIVER_NOT_LOADED, "NVML not available: driver not loaded"),
        (real.NVML_ERROR_NO_PERMISSION, "NVML failed to initialize: Insufficient Permissions"),
    ],
)
def test_init_errors_are_clear(code: int, message: str) -> None:
    nvml = ScriptedNvml(load_topology("t4x4").inventory)
    nvml.fail["nvmlInit"] = nvml_error(code)
    backend = NvmlBackend(nvml=nvml)
    with pytest.raises(InventoryError) as err:
        backend.discover()
    assert message in str(err.value)
    assert backend.probe(load_topology("t4x4").inventory.gpus[0].uuid) is False


def test_missing_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(InventoryError, match="NVML not available: the nvidia-ml-py package is not installed"):
        NvmlBackend().discover()


def test_library_call_errors_name_the_step() -> None:
    nvml = ScriptedNvml(load_topology("t4x4").inventory)
    nvml.fail["nvmlDeviceGetCount"] = nvml_error(real.NVML_ERROR_UNKNOWN)
    with pytest.raises(InventoryError, match=r"NVML failed to count GPUs: Unknown Error \(NVML error 999\)"):
        NvmlBackend(nvml=nvml).discover()
    nvml = ScriptedNvml(load_topology("a100-mig").inventory)
    nvml.fail["nvmlDeviceGetAttributes"] = nvml_error(real.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(InventoryError, match="NVML failed to read MIG device 0 of GPU 0: GPU is lost"):
        NvmlBackend(nvml=nvml).discover()


def test_a_lost_gpu_is_kept_unhealthy_and_unopenable_ones_skipped() -> None:
    inv = load_topology("t4x4").inventory
    nvml = ScriptedNvml(inv)
    nvml.fail["nvmlDeviceGetName"] = lambda h: nvml_error(real.NVML_ERROR_GPU_IS_LOST) if h.gpu == 2 else None
    nvml.fail["nvmlDeviceGetHandleByIndex"] = lambda i: nvml_error(real.NVML_ERROR_UNKNOWN) if i == 3 else None
    got = NvmlBackend(nvml=nvml).discover()
    assert [g.uuid for g in got.gpus] == [g.uuid for g in inv.gpus[:3]]
    assert [g.healthy for g in got.gpus] == [True, True, False]


def test_xid_events_map_to_gpus_and_mig_devices() -> None:
    inv = load_topology("a100-mig").inventory
    nvml = ScriptedNvml(inv)
    b = NvmlBackend(nvml=nvml)
    b.discover()
    assert b.wait_event(0.01) is None  # timeout
    assert set(nvml.registered) == {0, 1, 2, 3}
    assert all(m & real.nvmlEventTypeXidCriticalError for m in nvml.registered.values())
    nvml.xid(2, 48)
    assert b.wait_event(1.0) == HealthEvent(uuid=inv.gpus[2].uuid, xid=48, message="Xid 48")
    mig = inv.gpus[0].mig_devices[1]
    nvml.xid(0, 94, gi=mig.gi, ci=mig.ci)
    ev = b.wait_event(1.0)
    assert ev is not None and (ev.uuid, ev.xid, ev.gi, ev.ci) == (mig.uuid, 94, mig.gi, mig.ci)
    nvml.xid(0, 79)  # not attributable to one MIG instance: the parent GPU
    assert b.wait_event(1.0).uuid == inv.gpus[0].uuid  # type: ignore[union-attr]
    nvml.xid(1, 1, event_type=0x2)  # a double-bit ECC event: registered, not acted on
    assert b.wait_event(1.0) is None


def test_wait_errors_concern_every_device() -> None:
    inv = load_topology("t4x4").inventory
    nvml = ScriptedNvml(inv)
    b = NvmlBackend(nvml=nvml)
    nvml.events.put(nvml_error(real.NVML_ERROR_UNKNOWN))
    ev = b.wait_event(1.0)
    assert ev is not None and ev.uuid is None and "Unknown Error" in ev.message
    nvml.xid(1, 48)
    nvml.fail["nvmlDeviceGetUUID"] = nvml_error(real.NVML_ERROR_GPU_IS_LOST)
    ev = b.wait_event(1.0)
    assert ev is not None and ev.uuid is None and ev.xid == 48


def test_registration_skips_old_gpus_and_reports_failures() -> None:
    inv = load_topology("t4x4").inventory
    nvml = ScriptedNvml(inv)
    nvml.fail["nvmlDeviceGetSupportedEventTypes"] = \
        lambda h: nvml_error(real.NVML_ERROR_NOT_SUPPORTED) if h.gpu == 0 else None
    nvml.fail["nvmlDeviceRegisterEvents"] = lambda h, m, es: nvml_error(real.NVML_ERROR_UNKNOWN) \
        if h.gpu == 3 else None
    b = NvmlBackend(nvml=nvml)
    ev = b.wait_event(0.01)
    assert ev is not None and ev.uuid == inv.gpus[3].uuid and "cannot register" in ev.message
    assert set(nvml.registered) == {1, 2}
    assert b.wait_event(0.01) is None


def test_probe_reflects_the_device() -> None:
    inv = load_topology("a100-mig").inventory
    nvml = ScriptedNvml(inv)
    b = NvmlBackend(nvml=nvml)
    assert b.probe(inv.gpus[1].uuid) and b.probe(inv.gpus[0].mig_devices[2].uuid)
    assert not b.probe("GPU-00000000-0000-0000-0000-000000000000")
    nvml.fail["nvmlDeviceGetMemoryInfo"] = nvml_error(real.NVML_ERROR_GPU_IS_LOST)
    assert not b.probe(inv.gpus[1].uuid)
    del nvml.fail["nvmlDeviceGetMemoryInfo"]
    assert b.probe(inv.gpus[1].uuid)


def test_close_frees_the_event_set_and_shuts_down() -> None:
    nvml = ScriptedNvml(load_topology("t4x4").inventory)
    b = NvmlBackend(nvml=nvml)
    b.wait_event(0.0)
    b.close()
    assert nvml.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]
    with pytest.raises(InventoryError, match="closed"):
        b.discover()
    b.close()  # idempotent
