"""The DRA kubelet plugin's services on their real unix sockets, called by grpcio (the kubelet's grpc-go is
another implementation than the plugin's grpclib): claims answered apart, bad requests, registration,
the health stream, the thread prepares run in, graceful stop and sockets served again."""

from __future__ import annotations

import contextlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from polling import until

from kubegpu.node.dra.names import DRIVER
from kubegpu.node.dra.plugin import _END, DraPlugin, _next_change
from kubegpu.node.dra.prepare import PreparedDevice, PrepareError
from kubegpu.node.dra.proto import (
    dra_health_pb2,
    dra_health_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)


class _Preparer:
    """Prepares any claim onto gpu-0; refuses "refused", fails on "bug", waits on "slow"."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: set[str] = set()
        self.unprepared: list[str] = []

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        self.threads.add(threading.current_thread().name)
        self.started.set()
        if name == "refused":
            raise PrepareError(f"ResourceClaim {namespace}/{name} is not allocated")
        if name == "bug":
            raise KeyError("bug")
        if name == "slow":
            self.release.wait(10)
        return [PreparedDevice(("gpu",), "pool", "gpu-0", (f"k8s.gpu.kubegpu.io/device={uid}-gpu-0",),
                               share_id="s-1" if name == "share" else None)]

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        if name == "refused":
            raise PrepareError("cannot remove the CDI spec")
        self.unprepared.append(uid)


class _Bed:
    def __init__(self, root: Path) -> None:
        self.preparer = _Preparer()
        self.devices = [("pool", "gpu-0", True, ""), ("pool", "gpu-1", True, "")]
        self.registered_in: list[str] = []
        self.observed: list[str] = []
        self.plugin = DraPlugin(self.preparer, lambda: list(self.devices),  # type: ignore[arg-type]
                                plugins_dir=root / "plugins", registry_dir=root / "registry",
                                on_registered=lambda: self.registered_in.append(threading.current_thread().name),
                                observe=lambda what, _s: self.observed.append(what), workers=2)
        self.plugin.start()
        self.dra = grpc.insecure_channel(f"unix://{self.plugin.endpoint}")
        self.reg = grpc.insecure_channel(f"unix://{self.plugin.registration_socket}")

    def close(self) -> None:
        self.preparer.release.set()
        self.dra.close()
        self.reg.close()
        self.plugin.stop(0)


@pytest.fixture
def bed() -> Iterator[_Bed]:
    root = Path(tempfile.mkdtemp(prefix="kgp-", dir="/tmp"))  # unix socket paths must stay short
    b = _Bed(root)
    try:
        yield b
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)


def _claims(pb, *names: str):  # type: ignore[no-untyped-def]
    return [pb.Claim(namespace="default", uid=f"uid-{n}", name=n) for n in names]


@pytest.mark.parametrize(("pb", "stub"), [(dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub),
                                          (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub)])
def test_claims_are_answered_apart_and_a_failed_one_keeps_its_reason(bed: _Bed, pb, stub) -> None:  # type: ignore[no-untyped-def]
    call = stub(bed.dra)
    resp = call.NodePrepareResources(pb.NodePrepareResourcesRequest(
        claims=_claims(pb, "ok", "refused", "bug", "share")), timeout=5)
    ok = resp.claims["uid-ok"]
    assert ok.error == ""
    [dev] = ok.devices
    assert (list(dev.request_names), dev.pool_name, dev.device_name, list(dev.cdi_device_ids)) == (
        ["gpu"], "pool", "gpu-0", ["k8s.gpu.kubegpu.io/device=uid-ok-gpu-0"])
    assert not dev.HasField("share_id") and resp.claims["uid-share"].devices[0].share_id == "s-1"
    assert resp.claims["uid-refused"].error == "ResourceClaim default/refused is not allocated"
    assert not resp.claims["uid-refused"].devices
    assert resp.claims["uid-bug"].error == "internal error: 'bug'"
    # Prepare reads the API server and writes files: it runs in the plugin's pool, never on the gRPC loop.
    assert bed.preparer.threads and all(t.startswith("dra-rpc") for t in bed.preparer.threads)
    un = call.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=_claims(pb, "ok", "refused")), timeout=5)
    assert un.claims["uid-ok"].error == "" and un.claims["uid-refused"].error == "cannot remove the CDI spec"
    assert bed.preparer.unprepared == ["uid-ok"]
    assert bed.observed == ["prepare", "unprepare"]


def test_bad_requests_are_refused_and_the_plugin_serves_on(bed: _Bed) -> None:
    raw = bed.dra.unary_unary("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
                              request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as garbled:
        raw(b"\xff\xff\xff\xff", timeout=5)  # not a protobuf message
    # An error status, whichever: grpclib answers a request it cannot decode UNKNOWN, grpcio INTERNAL.
    assert garbled.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.INVALID_ARGUMENT)
    unknown = bed.dra.unary_unary("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NoSuchMethod",
                                  request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as missing:
        unknown(b"", timeout=5)
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # An empty request has no claims to answer.
    stub = dra_v1_pb2_grpc.DRAPluginStub(bed.dra)
    assert not stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=5).claims
    resp = stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(
        claims=_claims(dra_v1_pb2, "ok", "ok")), timeout=5)
    assert resp.claims["uid-ok"].error == "" and len(resp.claims["uid-ok"].devices) == 1  # listed twice, once


def test_registration_answers_and_reports_off_the_loop(bed: _Bed) -> None:
    stub = pluginregistration_pb2_grpc.RegistrationStub(bed.reg)
    info = stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(bed.plugin.endpoint))
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=False,
                                                                            error="version refused"), timeout=5)
    assert not bed.plugin.registered and bed.plugin.registration_error == "version refused"
    assert bed.registered_in == []
    stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
    assert bed.plugin.registered and bed.plugin.registrations == 1
    # The daemon's callback may block: it runs in the pool, not on the process's one gRPC loop.
    assert len(bed.registered_in) == 1 and bed.registered_in[0].startswith("dra-rpc")


def _health(msg: dra_health_pb2.NodeWatchResourcesResponse) -> dict[str, str]:
    return {d.device.device_name: dra_health_pb2.HealthStatus.Name(d.health) for d in msg.devices}


def test_health_stream_sends_every_device_then_each_change_and_ends_with_its_client(bed: _Bed) -> None:
    stub = dra_health_pb2_grpc.DRAResourceHealthStub(bed.dra)
    call = stub.NodeWatchResources(dra_health_pb2.NodeWatchResourcesRequest(), timeout=30)
    assert _health(next(call)) == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
    assert bed.plugin.active_streams == 1
    bed.devices[1] = ("pool", "gpu-1", False, "Xid 79")
    bed.plugin.health_changed()
    second = next(call)
    assert _health(second) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}
    assert second.devices[1].message == "Xid 79" and second.devices[1].health_check_timeout_seconds == 60
    call.cancel()
    assert until(lambda: bed.plugin.active_streams == 0, 5), "the stream outlived its client"


def test_prepare_is_answered_while_a_hundred_idle_health_streams_are_open(bed: _Bed) -> None:
    # A kubelet that reopened its health stream on every registration, on one connection: its prepares share
    # that connection and must not wait behind the streams for a slot.
    watch = dra_health_pb2_grpc.DRAResourceHealthStub(bed.dra)
    calls = [watch.NodeWatchResources(dra_health_pb2.NodeWatchResourcesRequest(), timeout=60) for _ in range(100)]
    for call in calls:
        next(call)
    assert bed.plugin.active_streams == 100
    resp = dra_v1_pb2_grpc.DRAPluginStub(bed.dra).NodePrepareResources(
        dra_v1_pb2.NodePrepareResourcesRequest(claims=_claims(dra_v1_pb2, "ok")), timeout=30)
    assert resp.claims["uid-ok"].error == ""
    for call in calls:
        call.cancel()
    assert until(lambda: bed.plugin.active_streams == 0, 10)


def test_health_changes_a_stream_has_not_sent_yet_go_out_as_one_message() -> None:
    """Changes that came while the stream waited (its client reading slowly: the stream holds its generator)
    are one message of the newest state, not a backlog of one per change; the call's end is seen among them."""
    q: queue.Queue[bool] = queue.Queue()
    for _ in range(50):
        q.put(True)
    assert _next_change(q) is True and q.empty()
    q.put(True)
    q.put(_END)
    q.put(True)
    assert _next_change(q) is False


def test_stop_lets_a_prepare_finish_ends_streams_and_removes_the_sockets(bed: _Bed) -> None:
    watch = dra_health_pb2_grpc.DRAResourceHealthStub(bed.dra).NodeWatchResources(
        dra_health_pb2.NodeWatchResourcesRequest(), timeout=30)
    next(watch)
    result: dict[str, object] = {}

    def slow() -> None:
        try:
            resp = dra_v1_pb2_grpc.DRAPluginStub(bed.dra).NodePrepareResources(
                dra_v1_pb2.NodePrepareResourcesRequest(claims=_claims(dra_v1_pb2, "slow")), timeout=10)
            result["error"] = resp.claims["uid-slow"].error
        except grpc.RpcError as exc:
            result["rpc"] = exc.code()

    caller = threading.Thread(target=slow)
    caller.start()
    assert bed.preparer.started.wait(5)
    threading.Timer(0.3, bed.preparer.release.set).start()
    t0 = time.monotonic()
    bed.plugin.stop(grace_s=5)
    caller.join(5)
    assert result == {"error": ""}
    assert time.monotonic() - t0 < 5
    assert until(lambda: bed.plugin.active_streams == 0, 5)
    # The stream has ended (with OK: the plugin ended it, or an error if the server closed first).
    with contextlib.suppress(grpc.RpcError):
        assert list(watch) == []
    assert not bed.plugin.endpoint.exists() and not bed.plugin.registration_socket.exists()


def test_sockets_deleted_or_replaced_are_served_again(bed: _Bed) -> None:
    assert not bed.plugin.ensure_sockets()
    bed.plugin.endpoint.unlink()
    bed.plugin.registration_socket.unlink()
    bed.plugin.registration_socket.write_text("someone else's")
    assert bed.plugin.ensure_sockets()
    assert not bed.plugin.ensure_sockets()
    with grpc.insecure_channel(f"unix://{bed.plugin.endpoint}") as ch:
        resp = dra_v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(claims=_claims(dra_v1_pb2, "ok")), timeout=5)
    assert resp.claims["uid-ok"].error == ""
    with grpc.insecure_channel(f"unix://{bed.plugin.registration_socket}") as ch:
        info = pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(pluginregistration_pb2.InfoRequest(),
                                                                         timeout=5)
    assert info.name == DRIVER


def test_the_daemon_module_does_not_import_grpcio() -> None:
    code = "import sys, kubegpu.node.dra.daemon; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"

