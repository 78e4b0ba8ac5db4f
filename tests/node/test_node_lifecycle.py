"""Lifecycle against the stand-in kubelet: serve before Register, re-register on kubelet restart
and on a dropped stream, stale sockets, failOnInitError, and the recorded v1.24 call sequence."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.model.inventory import NodeInventory
from kubegpu.node.daemon import DaemonInitError
from kubegpu.node.deviceplugin.server import STOP_GRACE_S
from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc
from kubegpu_standins.kubelet import AllocationFailed, StandinKubelet

GPU = "nvidia.com/gpu"
# Recorded from a real kubelet v1.24, shipped with the tests.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-v1.24"


def test_serves_before_register_and_sends_options_both_ways(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("t4x4")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    reg = next(c for c in kubelet.calls if c.rpc.endswith("/Register"))
    assert reg.request["version"] == "v1beta1" and reg.request["endpoint"] == "nvidia-gpu.sock"
    assert reg.request["options"] == {"get_preferred_allocation_available": True}
    opts = next(c for c in kubelet.calls if c.rpc.endswith("/GetDevicePluginOptions"))
    assert opts.response == {"get_preferred_allocation_available": True}
    # The current kubelet dials back during Register: our server was already serving.
    assert kubelet.rpc_sequence(GPU)[:4] == ["Register", "GetDevicePluginOptions", "ListAndWatch:stream-opened",
                                             "ListAndWatch:send"]
    assert kubelet.capacity(GPU) == 4 and kubelet.allocatable(GPU) == 4
    assert d.metrics.registrations.labels(resource=GPU)._value.get() == 1


def test_kubelet_restart_reregisters(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("dgx1-v100")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    held = kubelet.allocate(GPU, 1)
    before = kubelet.register_count(GPU)
    for n in (1, 2):
        t0 = time.monotonic()
        kubelet.restart()
        assert kubelet.wait_for(lambda n=n: kubelet.register_count(GPU) >= before + n, 10), kubelet.rpc_sequence(GPU)
        assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 8, 10)
        assert time.monotonic() - t0 < 10
    # The checkpoint keeps the held device out of the candidates; allocation still works.
    got = kubelet.allocate(GPU, 2)
    assert held.device_ids[0] not in got.device_ids


def test_v124_kubelet_restart_deletes_our_socket_and_we_come_back(sockdir: Path, make_daemon: Any) -> None:
    k = StandinKubelet(sockdir / "dp", mode="v1.24")
    k.start()
    try:
        d, _ = make_daemon("t4x4")
        assert k.wait_registered(GPU, timeout_s=5)
        assert "GetDevicePluginOptions" not in k.rpc_sequence()
        k.restart()
        assert k.wait_for(lambda: k.register_count(GPU) >= 2 and k.allocatable(GPU) == 4, 10), k.rpc_sequence()
        assert d.servers[0].socket_intact()
        assert k.allocate(GPU, 2).preferred is not None  # options came from RegisterRequest
    finally:
        k.stop()


def test_dropped_stream_reregisters(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("t4x4")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    kubelet.drop_stream(GPU)
    assert kubelet.wait_for(lambda: kubelet.register_count(GPU) == 2, 5), kubelet.rpc_sequence(GPU)
    assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, 5)
    time.sleep(1.0)  # re-registering replaced the stream: no loop of registrations follows
    assert kubelet.register_count(GPU) == 2


def test_stale_socket_is_replaced(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    stale = sockdir / "dp" / "nvidia-gpu.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    make_daemon("t4x4")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    with grpc.insecure_channel(f"unix://{stale}") as ch:
        opts = pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=2)
    assert opts.get_preferred_allocation_available


def test_registers_when_the_kubelet_appears_later(sockdir: Path, make_daemon: Any) -> None:
    d, _ = make_daemon("t4x4")
    time.sleep(0.5)  # registration failing: no kubelet yet
    assert d.servers[0].socket_intact()
    k = StandinKubelet(sockdir / "dp")
    t0 = time.monotonic()
    k.start()
    try:
        assert k.wait_registered(GPU, timeout_s=5)
        assert time.monotonic() - t0 < 2
    finally:
        k.stop()


def test_stop_removes_sockets(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    d, _ = make_daemon("a100-mig", flags={"mig-strategy": "mixed"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    socks = [s.socket_path for s in d.servers]
    assert all(p.exists() for p in socks) and len(socks) == 5
    d.stop()
    assert not any(p.exists() for p in socks)
    assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 0, 3)  # stream ended: all unhealthy


class Declines:
    """A resolver with no records: as in cluster mode, Allocate runs in a worker thread (where it may wait on
    the API server), the one place a call can still be running when the daemon stops."""

    def resolve(self, resource: str, device_ids: Sequence[str]) -> None:
        return None

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> None:
        return None

    def set_inventory(self, inventory: NodeInventory) -> None:
        pass

    def kubelet_registered(self, resource: str) -> None:
        pass


def _stop_during_allocate(kubelet: StandinKubelet, d: Any, stop: Callable[[], None]) -> list[object]:
    """Run an Allocate that is held inside the plugin while ``stop`` runs, released 1 s after the stop began;
    returns what the kubelet got (its response or its AllocationFailed). ``d`` has a resolver (Declines)."""
    server = next(s for s in d.servers if s.resource == GPU)
    entered, release = threading.Event(), threading.Event()
    original = server.allocate

    def held(request: pb.AllocateRequest) -> pb.AllocateResponse:
        entered.set()
        release.wait(10)
        return original(request)

    server.allocate = held
    got: list[object] = []

    def run() -> None:
        try:
            got.append(kubelet.allocate(GPU, 1))
        except AllocationFailed as exc:
            got.append(exc)

    caller = threading.Thread(target=run)
    caller.start()
    assert entered.wait(5)
    stopper = threading.Thread(target=stop)
    stopper.start()
    time.sleep(1.0)  # past the old 0.5 s grace
    release.set()
    caller.join(10)
    stopper.join(10)
    return got


def test_stop_lets_an_allocate_in_flight_finish(kubelet: StandinKubelet, make_daemon: Any) -> None:
    # A daemon restart (rollout) while the kubelet admits a pod: cut off, the kubelet would fail the pod's
    # admission with the RPC error; the server's grace lets the Allocate answer first.
    d, _ = make_daemon("t4x4", resolver=Declines())
    assert kubelet.wait_registered(GPU, timeout_s=5)
    got = _stop_during_allocate(kubelet, d, d.stop)
    assert len(got) == 1 and not isinstance(got[0], AllocationFailed), got
    assert STOP_GRACE_S >= 2.0


def test_allocate_cut_off_fails_admission_with_the_rpc_error(kubelet: StandinKubelet, make_daemon: Any) -> None:
    # No grace (a crash): the kubelet fails the pod with grpc-go's text, as the real one does.
    d, _ = make_daemon("t4x4", resolver=Declines())
    assert kubelet.wait_registered(GPU, timeout_s=5)
    server = next(s for s in d.servers if s.resource == GPU)
    got = _stop_during_allocate(kubelet, d, lambda: server.stop(grace_s=0))
    assert len(got) == 1 and isinstance(got[0], AllocationFailed), got
    assert re.match(r"rpc error: code = (Canceled|Unavailable) desc = ", str(got[0])), got[0]


def test_fail_on_init_error(make_daemon: Any) -> None:
    d, backend = make_daemon("t4x4", start=False)
    backend.fail_discovery(message="Driver Not Loaded")
    with pytest.raises(DaemonInitError, match="Driver Not Loaded"):
        d.start()
    d2, backend2 = make_daemon("t4x4", start=False, flags={"fail-on-init-error": "false"})
    backend2.fail_discovery(message="Driver Not Loaded")
    d2.start()  # blocks (serves nothing) instead of failing
    assert "Driver Not Loaded" in d2.waiting_reason and d2.servers == []


def test_reload_restarts_servers_with_the_new_config(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("t4x4")
    assert kubelet.wait_registered(GPU, timeout_s=5)
    d.flags["resource-config"] = "gpu:sharedgpu:2"
    d.reload()
    assert kubelet.wait_registered("nvidia.com/sharedgpu", timeout_s=5)
    assert kubelet.capacity("nvidia.com/sharedgpu") == 8
    assert [s.resource for s in d.servers] == ["nvidia.com/sharedgpu"]
    assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 0, 3)  # old resource's stream ended


# ----- the recorded v1.24 sequence ----------------------------------------------------------------


def _recorded(run: str, upto: int) -> list[str]:
    calls = json.loads((FIXTURES / "device-plugin-calls.json").read_text())
    out = []
    for c in calls:
        if c["plugin_run"] == run and c["n"] <= upto:
            name = c["rpc"].rsplit("/", 1)[1]
            out.append(f"{name}:{c['event']}" if c.get("event") else name)
    return out


def test_v124_recorded_sequence_is_reproduced(sockdir: Path, make_daemon: Any) -> None:
    k = StandinKubelet(sockdir / "dp", mode="v1.24")
    k.start()
    try:
        make_daemon("t4x4", settings={"pre_start_required": True})
        assert k.wait_registered(GPU, timeout_s=5)
        # run2 of the recording, pod by pod (init containers first, then app containers).
        gpu1 = k.allocate(GPU, 1)
        k.pre_start(gpu1)
        gpu2 = k.allocate(GPU, 2)
        k.pre_start(gpu2)
        k.release(gpu1)
        k.release(gpu2)
        first, second = k.allocate(GPU, 1), k.allocate(GPU, 1)
        k.pre_start(first)
        k.pre_start(second)
        k.release(first)
        k.release(second)
        init = k.allocate(GPU, 1)
        app = k.allocate(GPU, 2, must_include=init.device_ids)
        k.pre_start(init)
        k.pre_start(app)
        k.release(init)
        k.release(app)
        init = k.allocate(GPU, 2)
        app = k.allocate(GPU, 1, must_include=init.device_ids[:1])  # fully reused: no GPA
        k.pre_start(init)
        k.pre_start(app)
        k.release(init)
        k.release(app)
        crash = k.allocate(GPU, 1)
        for _ in range(4):
            k.pre_start(crash)  # restarts: PreStart again, never Allocate again
        k.release(crash)
        gpu1 = k.allocate(GPU, 1)
        k.pre_start(gpu1)
        assert k.rpc_sequence(GPU) == _recorded("run2", 40)
        # The request shapes match too: the app container reusing the init device.
        gpa = [c.request for c in k.calls if c.rpc.endswith("/GetPreferredAllocation")]
        app_req = gpa[5]["container_requests"][0]
        assert app_req["allocation_size"] == 2 and len(app_req["must_include_deviceIDs"]) == 1
        assert len(app_req["available_deviceIDs"]) == 4

        # The restart phase: the kubelet restarts with gpu1 still running; the plugin comes back on
        # its own (the recording's driver needed two Register attempts; ours needs one).
        mark = len(k.calls)
        k.restart()
        assert k.wait_for(lambda: k.register_count(GPU) == 2 and k.allocatable(GPU) == 4, 10)
        after = k.allocate(GPU, 2)
        k.pre_start(after)
        recorded = [c for c in _recorded("run2", 52)[len(_recorded("run2", 44)):] if c != "Register"]
        ours = [c for c in k.rpc_sequence(GPU)[mark - len(k.calls):] if c != "Register"]
        assert ours == recorded, (ours, recorded)
        gpa = [c.request for c in k.calls if c.rpc.endswith("/GetPreferredAllocation")][-1]
        avail = gpa["container_requests"][0]["available_deviceIDs"]
        assert len(avail) == 3 and gpu1.device_ids[0] not in avail  # still held (the checkpoint)
    finally:
        k.stop()


def test_standin_v124_ignores_options_not_in_register_request(sockdir: Path) -> None:
    """run1 of the recording: no options in RegisterRequest -> no GetPreferredAllocation, ever."""
    from concurrent import futures

    from kubegpu.node.proto.deviceplugin_pb2_grpc import DevicePluginServicer

    class Plugin(DevicePluginServicer):
        def GetDevicePluginOptions(self, request: Any, context: Any) -> pb.DevicePluginOptions:
            return pb.DevicePluginOptions(get_preferred_allocation_available=True)

        def ListAndWatch(self, request: Any, context: Any):  # type: ignore[no-untyped-def]
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"G{i}", health="Healthy") for i in range(4)])
            while context.is_active():
                time.sleep(0.05)

        def Allocate(self, request: Any, context: Any) -> pb.AllocateResponse:
            ids = list(request.container_requests[0].devices_ids)
            return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse(
                envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)})])

    k = StandinKubelet(sockdir / "dp", mode="v1.24")
    k.start()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    server.add_insecure_port(f"unix://{sockdir / 'dp' / 'rec.sock'}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{k.socket_path}") as ch:
            pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
                version="v1beta1", endpoint="rec.sock", resource_name="nvidia.com/gpu"), timeout=5)
        assert k.wait_registered(GPU, timeout_s=5)
        k.allocate(GPU, 1)
        server.stop(None).wait()
        assert k.wait_for(lambda: k.allocatable(GPU) == 0, 3)
        assert k.rpc_sequence(GPU) == _recorded("run1", 5)
        # Registration checks of the current kubelet.
        cur = StandinKubelet(sockdir / "cur")
        cur.start()
        try:
            with grpc.insecure_channel(f"unix://{cur.socket_path}") as ch:
                stub = pb_grpc.RegistrationStub(ch)
                for req, msg in ((pb.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name="a.com/b"),
                                  "not supported"),
                                 (pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="gpu"),
                                  "extended resource"),
                                 (pb.RegisterRequest(version="v1beta1", endpoint="x.sock",
                                                     resource_name="kubernetes.io/gpu"), "extended resource")):
                    with pytest.raises(grpc.RpcError) as e:
                        stub.Register(req, timeout=5)
                    assert msg in e.value.details()
        finally:
            cur.stop()
    finally:
        k.stop()


def test_register_without_a_stream_is_retried(sockdir: Path, make_daemon: Any) -> None:
    """A v1.24 kubelet answers Register before dialing back and may never dial (its dial failed
    silently): the plugin must not take Register as proof and registers again."""

    class DeafOnce(StandinKubelet):
        ignored = 0

        def _connect(self, request: Any, options: Any) -> Any:
            if self.ignored == 0:
                self.ignored += 1
                return None  # as a dial that timed out: no ListAndWatch, no error to the plugin
            return super()._connect(request, options)

    k = DeafOnce(sockdir / "dp", mode="v1.24")
    k.start()
    try:
        make_daemon("t4x4", stream_wait_s=0.5)
        assert k.wait_registered(GPU, timeout_s=5), k.rpc_sequence()
        assert k.register_count(GPU) == 2 and k.ignored == 1
    finally:
        k.stop()


def test_standin_pod_resources_api(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    from kubegpu.node.proto import podresources_pb2 as pr
    from kubegpu.node.proto import podresources_pb2_grpc as pr_grpc

    make_daemon("t4x4")
    sock = sockdir / "pod-resources" / "kubelet.sock"
    kubelet.serve_pod_resources(sock)
    assert kubelet.wait_registered(GPU, timeout_s=5)
    init = kubelet.allocate(GPU, 1, pod="ml/train", container="setup", init=True)
    app = kubelet.allocate(GPU, 2, must_include=init.device_ids, pod="ml/train", container="main")
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pr_grpc.PodResourcesListerStub(ch)
        listed = stub.List(pr.ListPodResourcesRequest(), timeout=5)
        (pod,) = listed.pod_resources
        assert (pod.namespace, pod.name) == ("ml", "train")
        assert [c.name for c in pod.containers] == ["main"]
        assert [list(d.device_ids) for d in pod.containers[0].devices] == [[i] for i in app.device_ids]
        alloc = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)
        assert len(alloc.devices) == 4
        got = stub.Get(pr.GetPodResourcesRequest(pod_name="train", pod_namespace="ml"), timeout=5)
        assert got.pod_resources.name == "train"
    kubelet.restart()
    assert kubelet.wait_registered(GPU, timeout_s=10, count=2)
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        listed = pr_grpc.PodResourcesListerStub(ch).List(pr.ListPodResourcesRequest(), timeout=5)
        assert len(listed.pod_resources) == 1  # survives a kubelet restart (checkpoint)
