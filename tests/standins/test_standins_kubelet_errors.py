"""The stand-in kubelet words a call that could not reach a plugin as the kubelet does: grpc-go's
``rpc error: code = ... desc = ...`` with the code in Go's spelling, for GetPreferredAllocation (inside the
device manager's own sentence) and for Allocate alike, so that a refusal made while a plugin is away is
told by its code."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu_standins.kubelet import AllocationFailed, ResourceState, StandinKubelet

GPU = "nvidia.com/gpu"


@pytest.fixture
def kubelet() -> Iterator[StandinKubelet]:
    with tempfile.TemporaryDirectory(prefix="kgk-", dir="/tmp") as d, StandinKubelet(Path(d)) as k:
        yield k


def _gone_plugin(kubelet: StandinKubelet, *, preferred: bool) -> None:
    """A registered resource with healthy devices whose plugin's socket is gone (it stopped, and the kubelet
    has not seen its stream end yet)."""
    gone = kubelet.dir / "gone.sock"
    kubelet.resources[GPU] = ResourceState(
        GPU, endpoint="gone.sock", healthy={"GPU-0", "GPU-1"},
        options=pb.DevicePluginOptions(get_preferred_allocation_available=preferred),
        channel=grpc.insecure_channel(f"unix://{gone}"))


def test_get_preferred_allocation_to_a_gone_plugin_fails_as_the_kubelet_says_it(kubelet: StandinKubelet) -> None:
    _gone_plugin(kubelet, preferred=True)
    with pytest.raises(AllocationFailed) as e:
        kubelet.allocate(GPU, 1, timeout_s=5)
    assert str(e.value).startswith(
        "device plugin GetPreferredAllocation rpc failed with err: rpc error: code = Unavailable desc = ")


def test_allocate_to_a_gone_plugin_fails_with_the_code(kubelet: StandinKubelet) -> None:
    _gone_plugin(kubelet, preferred=False)
    with pytest.raises(AllocationFailed) as e:
        kubelet.allocate(GPU, 1, timeout_s=5)
    assert str(e.value).startswith("rpc error: code = Unavailable desc = ")
