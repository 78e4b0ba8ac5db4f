"""Strict share enforcement wired through the node daemon, over the stand-in kubelet's sockets, with the fake
NVML and the stand-in MPS control obeying compute modes as the driver does: shares make their GPU
EXCLUSIVE_PROCESS, a whole-GPU Allocate on it is refused with the reason, the GPU's mode comes back once the
kubelet no longer lists its shares, and only then is it served whole."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_mps_node import Records  # the scheduler's record: 25 % / 4 GiB on the kubelet's slot

from kubegpu.inventory.compute_modes import DEFAULT, EXCLUSIVE_PROCESS
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.device_object import device_object
from kubegpu.model.inventory import NodeInventory
from kubegpu_standins.fake_driver import ENV_DRIVER_STATE
from kubegpu_standins.kubelet import StandinKubelet
from kubegpu_standins.mps_control import connect_client

SLOTS = "kubegpu.io/gpu.shared"
WHOLE = "nvidia.com/gpu"


class Published:
    """A publisher that keeps what the node last published (its Device object)."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []

    def publish(self, inventory: NodeInventory, resources: Mapping[str, int]) -> None:
        self.objects.append(device_object(inventory))

    def close(self) -> None:
        pass


def _shown(d: Any, gpu: str) -> tuple[dict[str, Any], dict[str, float]]:
    """GPU ``gpu``'s shareEnforcement in the Device object the node publishes now, and its metric samples."""
    d.publisher = Published()
    d._publish()
    [obj] = d.publisher.objects
    enf = next(g["shareEnforcement"] for g in obj["spec"]["devices"] if g["id"] == gpu)
    samples = {f"{m.name}{'/' + s.labels['mode'] if 'mode' in s.labels else ''}": s.value
               for m in d.metrics.registry.collect() for s in m.samples
               if s.labels.get("uuid") == gpu and m.name.startswith(("kubegpu_node_gpu_compute_mode",
                                                                      "kubegpu_node_gpu_share_"))}
    return enf, samples


@pytest.fixture
def strict_node(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path, mps_binary: str,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeBackend, Path]]:
    """A strict node (daemon, backend, PodResources socket); the live holders are read only when a test asks."""
    state = sockdir / "driver"
    monkeypatch.setenv(ENV_DRIVER_STATE, str(state))  # the stand-in MPS servers see the fake driver's modes
    podres = sockdir / "podres.sock"
    kubelet.serve_pod_resources(podres)
    backend = FakeBackend("t4x4", driver_state=state)
    flags = {"shared-slots": "4", "share-enforcement": "strict", "mps-control-binary": mps_binary,
             "mps-root": str(sockdir / "mps"), "pod-resources-socket": str(podres)}
    d, _ = make_daemon("t4x4", flags=flags, resolver=Records(), backend=backend, holder_grace_s=0.0,
                       holders_s=1e9)
    assert kubelet.wait_registered(SLOTS, timeout_s=5) and kubelet.wait_registered(WHOLE, timeout_s=5)
    yield d, backend, state


def _refused(kubelet: StandinKubelet, resource: str, ids: list[str]) -> str:
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate_ids(resource, ids)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(err.value.details())


def test_a_strict_gpu_goes_exclusive_refuses_whole_until_its_shares_end(
        kubelet: StandinKubelet, strict_node: tuple[Any, FakeBackend, Path]) -> None:
    d, backend, state = strict_node
    share = kubelet.allocate(SLOTS, 1, pod="default/p1", container="c")
    gpu = dict(share.response.envs)["KUBEGPU_VISIBLE_GPUS"]
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    # A tenant that skips its server gets no GPU at all.
    assert "busy" in str(connect_client({}, [gpu], driver_state=str(state))["error"])
    # A second share of the same shape joins the GPU's one server; a whole GPU is refused with the reason.
    same = kubelet.allocate(SLOTS, 1, must_include=[i for i in share.device_ids], pod="default/p2", container="c")
    assert same.response.envs["CUDA_MPS_PIPE_DIRECTORY"] == share.response.envs["CUDA_MPS_PIPE_DIRECTORY"]
    why = _refused(kubelet, WHOLE, [gpu])
    assert "cannot be given whole" in why and "MPS-enforced share" in why and gpu in why
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS  # nothing switched under the shares
    # The Device object and the metrics show the GPU exclusive, locked to the shape, not escapable.
    enf, samples = _shown(d, gpu)
    assert enf == {"mode": "strict", "computeMode": EXCLUSIVE_PROCESS, "shapeLock": "25% / 4096M",
                   "escapable": False}
    assert samples == {f"kubegpu_node_gpu_compute_mode/{EXCLUSIVE_PROCESS}": 1.0,
                       "kubegpu_node_gpu_share_escapable": 0.0, "kubegpu_node_gpu_share_shape_lock": 1.0,
                       "kubegpu_node_gpu_share_enforced/strict": 1.0}
    # One share ends: the GPU stays exclusive for the other.
    kubelet.release_pod("default/p1")
    assert d.reconcile_holders() == [] and backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    # The last ends: the kubelet no longer lists it, the server quits and the mode goes back.
    kubelet.release_pod("default/p2")
    assert d.reconcile_holders() == [gpu]
    assert backend.compute_mode(gpu) == DEFAULT
    enf, samples = _shown(d, gpu)
    assert enf == {"mode": "strict", "escapable": False}
    assert samples == {"kubegpu_node_gpu_share_escapable": 0.0, "kubegpu_node_gpu_share_enforced/strict": 1.0}
    # Now the GPU is served whole, and a share waits for that container, with the reason.
    whole = kubelet.allocate_ids(WHOLE, [gpu])
    assert gpu in whole.envs["NVIDIA_VISIBLE_DEVICES"] and backend.compute_mode(gpu) == DEFAULT
    why = _refused(kubelet, SLOTS, [f"{gpu}::0"])
    assert "held whole by" in why
    # The whole-GPU container ends (the kubelet no longer lists it): shares may take the GPU again.
    assert d.reconcile_holders() == [gpu]
    kubelet.allocate_ids(SLOTS, [f"{gpu}::0"])
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS


def test_a_served_share_the_kubelet_does_not_list_yet_keeps_its_gpu_within_the_grace(
        kubelet: StandinKubelet, strict_node: tuple[Any, FakeBackend, Path]) -> None:
    d, backend, _ = strict_node
    d.options = replace(d.options, holder_grace_s=3600.0)
    share = kubelet.allocate(SLOTS, 1)  # no pod: PodResources does not list it
    gpu = dict(share.response.envs)["KUBEGPU_VISIBLE_GPUS"]
    assert d.reconcile_holders() == [] and backend.compute_mode(gpu) == EXCLUSIVE_PROCESS


def test_a_node_restart_with_shares_running_keeps_the_gpu_bound_and_restores_it_after(
        kubelet: StandinKubelet, make_daemon: Any, strict_node: tuple[Any, FakeBackend, Path]) -> None:
    d, backend, state = strict_node
    share = kubelet.allocate(SLOTS, 1, pod="default/p1", container="c")
    gpu = dict(share.response.envs)["KUBEGPU_VISIBLE_GPUS"]
    d.stop()
    assert backend.compute_mode(gpu) == EXCLUSIVE_PROCESS  # its share still runs: switching back would free it
    assert "busy" in str(connect_client({}, [gpu], driver_state=str(state))["error"])
    again, _ = make_daemon("t4x4", flags=d.flags, resolver=Records(), backend=backend, holder_grace_s=0.0,
                           holders_s=1e9)
    assert kubelet.wait_registered(WHOLE, timeout_s=5, count=2)
    assert again.reconcile_holders() == [] and backend.compute_mode(gpu) == EXCLUSIVE_PROCESS
    assert "MPS-enforced share" in _refused(kubelet, WHOLE, [gpu])
    kubelet.release_pod("default/p1")
    assert again.reconcile_holders() == [gpu] and backend.compute_mode(gpu) == DEFAULT
