"""Device-plugin serving that does not depend on how many ListAndWatch streams are open, errors that do
not echo unbounded input, sizes checked (issue 12, item 5)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.options import load_node_options
from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc
from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"


@pytest.fixture
def plugin() -> Iterator[tuple[StandinKubelet, grpc.Channel, NodeDaemon]]:
    d = Path(tempfile.mkdtemp(prefix="kgl-", dir="/tmp"))
    kubelet = StandinKubelet(d / "dp")
    kubelet.start()
    backend = FakeBackend("t4x4")
    settings = {"cdi_dir": str(d / "cdi"), "mig_minors_file": str(d / "mm")}
    daemon = NodeDaemon(backend, lambda: load_node_options({"shared-slots": 0}, {}, settings=settings,
                                                           plugin_dir=str(d / "dp"), stream_wait_s=2.0))
    daemon.start()
    assert kubelet.wait_registered(GPU, timeout_s=10)
    server = next(s for s in daemon.servers if s.resource == GPU)
    channel = grpc.insecure_channel(f"unix://{server.socket_path}")
    try:
        yield kubelet, channel, daemon
    finally:
        channel.close()
        daemon.stop()
        kubelet.stop()
        backend.close()
        shutil.rmtree(d, ignore_errors=True)


def test_extra_streams_end_the_stale_ones_and_allocate_still_answers(plugin) -> None:  # type: ignore[no-untyped-def]
    kubelet, channel, daemon = plugin
    stub = pb_grpc.DevicePluginStub(channel)
    # Far more than the 4 worker threads. The plugin sees the opens in the order they reach it, which
    # under load is not always the order sent, so which one stays open is the plugin's to say.
    streams = [stub.ListAndWatch(pb.Empty(), timeout=120) for _ in range(12)]
    for s in streams:
        assert len(next(s).devices) == 4  # each got its list
    deadline = time.monotonic() + 30
    while sum(s.done() for s in streams) < len(streams) - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = [s for s in streams if s.done()]
    assert len(ended) == len(streams) - 1  # every stream but the newest was ended by the plugin
    for s in ended:
        assert s.code() == grpc.StatusCode.OK and list(s) == []  # ended cleanly, nothing more sent
    (live,) = [s for s in streams if not s.done()]
    # The worker threads are free: GetPreferredAllocation and Allocate are answered at once.
    ids = sorted(kubelet.healthy(GPU) | kubelet.unhealthy(GPU))
    assert len(kubelet.preferred(GPU, ids, 1, timeout_s=5)) == 1
    assert kubelet.allocate_ids(GPU, ids[:1], timeout_s=5).envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]
    # The newest stream ends too: the daemon registers again and the kubelet's stream is the live one.
    live.cancel()
    assert kubelet.wait_registered(GPU, timeout_s=10, count=2)
    assert kubelet.wait_for(lambda: len(kubelet.healthy(GPU)) == 4, 5)
    assert daemon.status()["resources"][0]["streams"] <= 2


def test_errors_do_not_echo_unbounded_ids_and_sizes_are_checked(plugin) -> None:  # type: ignore[no-untyped-def]
    kubelet, channel, _ = plugin
    stub = pb_grpc.DevicePluginStub(channel)
    huge = "GPU-" + "x" * (1 << 20)
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[huge])]),
                      timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 400
    assert "characters" in e.value.details()
    known = sorted(kubelet.healthy(GPU))
    for size, avail in ((2**31 - 1, known), (5, known), (-1, known), (1, [huge])):
        req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=avail, allocation_size=size)])
        with pytest.raises(grpc.RpcError) as e:
            stub.GetPreferredAllocation(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 400
    ok = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(available_deviceIDs=known, allocation_size=2)]), timeout=10)
    assert len(ok.container_responses[0].deviceIDs) == 2
