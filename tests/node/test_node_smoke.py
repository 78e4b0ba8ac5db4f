"""End-to-end smoke: the daemon serves nvidia.com/gpu to the stand-in kubelet over unix sockets."""

from __future__ import annotations

from typing import Any

from kubegpu_standins.kubelet import StandinKubelet


def test_register_list_and_allocate(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("dgx1-v100")
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    assert kubelet.capacity("nvidia.com/gpu") == 8
    assert kubelet.allocatable("nvidia.com/gpu") == 8
    got = kubelet.allocate("nvidia.com/gpu", 2)
    assert got.preferred is not None and set(got.device_ids) == set(got.preferred)
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == list(got.device_ids)
    # A second container cannot get the same GPUs: the kubelet keeps them in use.
    again = kubelet.allocate("nvidia.com/gpu", 6)
    assert not set(again.device_ids) & set(got.device_ids)
