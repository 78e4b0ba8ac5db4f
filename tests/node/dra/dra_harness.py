"""A DRA test bed: the stand-in API server, allocator, claim controller and kubelet DRA manager,
plus kubegpu's DRA daemon on a fake inventory, all over real HTTP and real gRPC on unix sockets."""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.node.dra.daemon import DraDaemon, DraOptions
from kubegpu.node.dra.kube import ApiClaimReader
from kubegpu.node.dra.prepare import ClaimReader, PrepareError
from kubegpu.node.dra.slices import DraSettings
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.dra_allocator import Allocator, ClaimController
from kubegpu_standins.dra_kubelet import DraKubelet
from kubegpu_standins.fake_driver import ENV_DRIVER_STATE
from kubegpu_standins.mps_control import install

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "dra"
NODE = "gpu-node-1"
GROUP = "resource.k8s.io"


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def strip_server(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as a client would create it: no uid, resourceVersion, timestamps, status."""
    o = copy.deepcopy(obj)
    meta = o.get("metadata", {})
    for k in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
        meta.pop(k, None)
    o.pop("status", None)
    return o


def make_sysfs(root: Path, buses: dict[str, str]) -> str:
    """A sysfs tree where /sys/bus/pci/devices/<bus> links under /sys/devices/<root complex>/."""
    devs = root / "bus" / "pci" / "devices"
    devs.mkdir(parents=True, exist_ok=True)
    for bus, complex_ in buses.items():
        real = root / "devices" / complex_ / f"{complex_[3:]}:01.0" / bus
        real.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(real, devs), devs / bus)
    return str(root)


RECORDED_BUSES = {"0000:07:00.0": "pci0000:00", "0000:0f:00.0": "pci0000:00",
                  "0000:87:00.0": "pci0000:80", "0000:90:00.0": "pci0000:80"}


class FailingReader:
    """The API server's claims, except that a claim named in ``fail`` answers its error, as a driver fault
    would: the test's way to make one prepare fail."""

    def __init__(self, reader: ClaimReader, fail: dict[str, str]) -> None:
        self.reader = reader
        self.fail = fail

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        err = self.fail.get(name)
        if err:
            raise PrepareError(err)
        return self.reader.get_claim(namespace, name)

@dataclass
class Bed:
    root: Path
    api: ApiServer
    allocator: Allocator
    controller: ClaimController
    kubelet: DraKubelet
    backend: FakeBackend
    daemon: DraDaemon | None = None
    daemons: list[DraDaemon] = field(default_factory=list)
    settings: DraSettings | None = None
    fail: dict[str, str] = field(default_factory=dict)  # claim name -> injected prepare error
    opts: dict[str, Any] = field(default_factory=dict)

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def start_daemon(self, **kw: Any) -> DraDaemon:
        assert self.settings is not None
        client = make_client(self.api.write_kubeconfig(self.root / "kubeconfig"))
        opts = DraOptions(settings=self.settings, plugins_dir=str(self.root / "kubelet" / "plugins"),
                          registry_dir=str(self.root / "kubelet" / "plugins_registry"),
                          cdi_dir=str(self.cdi_dir), resync_s=5.0, socket_check_s=0.1, recovery_interval_s=0.3,
                          health_wait_s=0.05, **{**self.opts, **kw})
        d = DraDaemon(self.backend, opts, client, reader=FailingReader(ApiClaimReader(client), self.fail),
                      env=os.environ)  # the test is the entry: its environment reaches the MPS stand-ins
        d.start()
        self.daemon = d
        self.daemons.append(d)
        return d

    def stop_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.api.put_object(strip_server(obj))

    def slices(self) -> list[dict[str, Any]]:
        return self.api.objects("resourceslices", GROUP)

    def claim(self, name: str, ns: str = "default") -> dict[str, Any]:
        return self.api.get_object("resourceclaims", name, ns, GROUP)

    def pod(self, name: str, claims: list[dict[str, Any]], containers: list[dict[str, Any]] | None = None,
            ns: str = "default") -> dict[str, Any]:
        ctrs = containers or [{"name": "ctr", "image": "pause",
                               "resources": {"claims": [{"name": c["name"]} for c in claims]}}]
        return self.api.put_object({"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4())},
                                    "spec": {"containers": ctrs, "resourceClaims": claims, "nodeName": NODE}})

    def run(self, pod: dict[str, Any]) -> bool:
        """Schedule (allocate + reserve) and hand the pod to the kubelet; False when it cannot be scheduled."""
        if not self.controller.schedule(self.allocator, pod):
            return False
        self.kubelet.add_pod(self.api.get_object("pods", pod["metadata"]["name"], pod["metadata"]["namespace"]))
        return True

    def running(self, pod: dict[str, Any]) -> bool:
        return pod["metadata"]["uid"] in self.kubelet.running

    def delete(self, pod: dict[str, Any]) -> list[str]:
        """Kubelet kills the pod and unprepares; then the pod leaves and the claims are released."""
        done = self.kubelet.remove_pod(pod)
        self.api.store.delete(self.api.kind("pods"), pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.controller.pod_gone(self.allocator, pod)
        return done

    def wait(self, cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        return self.kubelet.wait(cond, timeout_s)

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        self.kubelet.stop()
        self.api.stop()


def make_bed(root: Path, topology: str | Path = FIXTURES / "gpu-node-1.yaml", *, shared: str = "none",
             retry_s: float = 0.3, wipe_delay_s: float = 30.0, sysfs: bool = True, node: str = NODE,
             kubelet_versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> Bed:
    api = ApiServer().start()
    kubelet = DraKubelet(api, root / "kubelet", node, retry_s=retry_s, wipe_delay_s=wipe_delay_s,
                         versions=kubelet_versions)
    kubelet.start()
    backend = FakeBackend(topology, node_name=node)
    sys_root = make_sysfs(root / "sys", RECORDED_BUSES) if sysfs else "/nonexistent"
    settings = DraSettings(node_name=node, shared_gpus=DraSettings.parse_shared(shared), sysfs_root=sys_root)
    bed = Bed(root, api, Allocator(api), ClaimController(api), kubelet, backend, settings=settings)
    return bed


def make_strict_bed(root: Path, mps_root: Path, monkeypatch: pytest.MonkeyPatch) -> Bed:
    """A bed whose every GPU takes shares enforced strictly (one MPS server per GPU, the GPU exclusive), by the
    stand-in MPS control under ``mps_root`` and the fake driver's compute modes in ``mps_root/driver``."""
    state = mps_root / "driver"
    monkeypatch.setenv(ENV_DRIVER_STATE, str(state))  # the stand-in MPS servers see the fake driver's modes
    bed = make_bed(root, shared="all")
    assert bed.settings is not None
    bed.backend = FakeBackend(FIXTURES / "gpu-node-1.yaml", node_name=bed.settings.node_name, driver_state=state)
    bed.settings = replace(bed.settings, mps=True, enforcement="strict", mps_root=str(mps_root),
                           mps_binary=install(mps_root))
    return bed
