"""Health: Xids mark devices Unhealthy on the ListAndWatch stream at once; quiet GPUs recover."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kubegpu.node.health.monitor import XidPolicy
from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"


def test_xid_marks_gpu_unhealthy_within_a_second_then_recovers(kubelet: StandinKubelet,
                                                                make_daemon: Any) -> None:
    d, backend = make_daemon("dgx1-v100", flags={"health-recovery-interval": "600ms", "shared-slots": "4"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    assert kubelet.wait_registered("kubegpu.io/gpu.shared", timeout_s=5)
    g = d.inventory.gpus[3].uuid
    t0 = time.monotonic()
    backend.inject_xid(3, 48)
    assert kubelet.wait_for(lambda: g in kubelet.unhealthy(GPU), 1.0), "not Unhealthy within 1 s"
    took = time.monotonic() - t0
    assert took < 1.0
    assert kubelet.allocatable(GPU) == 7 and kubelet.capacity(GPU) == 8
    # The GPU's slots go with it.
    assert kubelet.wait_for(lambda: {i.split("::")[0] for i in kubelet.unhealthy("kubegpu.io/gpu.shared")} == {g}, 1)
    assert d.metrics.xid_events.labels(xid="48")._value.get() == 1
    assert d.metrics.gpu_healthy.labels(**d.metrics.device_labels(g))._value.get() == 0
    # Recovery: quiet for the interval and answering the probe -> Healthy again, no restart.
    assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 8, 5)
    assert kubelet.register_count(GPU) == 1


def test_ignored_xids_leave_the_gpu_healthy(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, backend = make_daemon("t4x4", flags={"health-recovery-interval": "0s"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    for xid in (13, 31, 43, 45, 68, 109):
        backend.inject_xid(0, xid)
    backend.inject_xid(1, 63)  # processed after the ignored ones: a marker
    g0, g1 = d.inventory.gpus[0].uuid, d.inventory.gpus[1].uuid
    assert kubelet.wait_for(lambda: g1 in kubelet.unhealthy(GPU), 2)
    assert g0 in kubelet.healthy(GPU)


def test_disable_and_enable_env(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, backend = make_daemon("t4x4", env={"DP_DISABLE_HEALTHCHECKS": "48", "DP_ENABLE_HEALTHCHECKS": "31"},
                             flags={"health-recovery-interval": "0s"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    backend.inject_xid(0, 48)  # disabled
    backend.inject_xid(1, 31)  # forced on
    g0, g1 = d.inventory.gpus[0].uuid, d.inventory.gpus[1].uuid
    assert kubelet.wait_for(lambda: g1 in kubelet.unhealthy(GPU), 2)
    assert g0 in kubelet.healthy(GPU)


def test_probe_failure_keeps_the_gpu_unhealthy_until_it_answers(kubelet: StandinKubelet,
                                                                 make_daemon: Any) -> None:
    d, backend = make_daemon("t4x4", flags={"health-recovery-interval": "300ms"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    backend.fall_off_bus(2)  # Xid 79, probes fail
    g = d.inventory.gpus[2].uuid
    assert kubelet.wait_for(lambda: g in kubelet.unhealthy(GPU), 1)
    time.sleep(1.0)
    assert g in kubelet.unhealthy(GPU)
    backend.recover(2)
    assert kubelet.wait_for(lambda: g in kubelet.healthy(GPU), 3)


def test_wait_error_marks_all_unhealthy(kubelet: StandinKubelet, make_daemon: Any) -> None:
    _, backend = make_daemon("t4x4", flags={"health-recovery-interval": "0s"})
    assert kubelet.wait_registered(GPU, timeout_s=5)
    backend.fail_wait("GPU is lost")
    assert kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 0 and kubelet.capacity(GPU) == 4, 2)


def test_mig_event_hits_only_its_instance(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, backend = make_daemon("a100-mig", flags={"mig-strategy": "mixed", "health-recovery-interval": "0s"})
    res = "nvidia.com/mig-1g.10gb"
    assert kubelet.wait_registered(res, timeout_s=5)
    g0 = d.inventory.gpus[0]
    target = next(m for m in g0.mig_devices if m.profile == "1g.10gb")
    backend.inject_xid(0, 94, gi=target.gi, ci=target.ci)
    assert kubelet.wait_for(lambda: kubelet.unhealthy(res) == {target.uuid}, 2)
    assert kubelet.allocatable("nvidia.com/mig-3g.40gb") == 2
    # An Xid on the parent GPU without an instance takes every MIG device of that GPU.
    backend.inject_xid(0, 79)
    three = next(m for m in g0.mig_devices if m.profile == "3g.40gb")
    assert kubelet.wait_for(lambda: three.uuid in kubelet.unhealthy("nvidia.com/mig-3g.40gb"), 2)
    assert kubelet.allocatable("nvidia.com/gpu") == 2  # the whole GPUs 2 and 3 are untouched


@pytest.mark.parametrize(("env", "ignored", "acted"), [
    ({}, [13, 31, 43, 45, 68, 109], [48, 79, 94, 0]),
    ({"DP_DISABLE_HEALTHCHECKS": "all"}, [48, 79, 13], []),
    ({"DP_DISABLE_HEALTHCHECKS": "xids"}, [48], []),
    ({"DP_DISABLE_HEALTHCHECKS": "48, 63,bogus"}, [48, 63, 13], [79]),
    ({"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "79"}, [48], [79]),
    ({"DP_ENABLE_HEALTHCHECKS": "13,all"}, [], [13, 31, 48]),
    ({"DP_ENABLE_HEALTHCHECKS": "31"}, [13], [31]),
])
def test_xid_policy_matches_nvidia(env: dict[str, str], ignored: list[int], acted: list[int]) -> None:
    p = XidPolicy.from_env(env)
    assert [x for x in ignored if not p.is_ignored(x)] == []
    assert [x for x in acted if p.is_ignored(x)] == []
    off = env.get("DP_DISABLE_HEALTHCHECKS") in ("all", "xids") and "DP_ENABLE_HEALTHCHECKS" not in env
    assert p.checks_off == off


class RecordingPublisher:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, bool], dict[str, int]]] = []

    def publish(self, inventory: Any, resources: Any) -> None:
        self.calls.append(({g.uuid: g.healthy for g in inventory.gpus}, dict(resources)))

    def close(self) -> None:
        pass


def test_publisher_sees_start_and_every_health_change(kubelet: StandinKubelet, sockdir: Any) -> None:
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.options import load_node_options

    backend = FakeBackend("t4x4")
    opts = load_node_options({"shared-slots": "2", "health-recovery-interval": "0s"}, {},
                             plugin_dir=str(kubelet.dir), settings={"cdi_dir": str(sockdir / "cdi")})
    pub = RecordingPublisher()
    d = NodeDaemon(backend, lambda: opts, publisher=pub)
    d.start()
    try:
        assert kubelet.wait_registered(GPU, timeout_s=5)
        assert pub.calls[0][1] == {GPU: 4, "kubegpu.io/gpu.shared": 8}
        assert all(pub.calls[0][0].values())
        g = d.inventory.gpus[2].uuid
        backend.inject_xid(2, 62)
        assert kubelet.wait_for(lambda: g in kubelet.unhealthy(GPU), 2)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not any(not c[0][g] for c in pub.calls):
            time.sleep(0.02)
        last = pub.calls[-1]
        assert last[0][g] is False and last[1] == {GPU: 3, "kubegpu.io/gpu.shared": 6}
        # Every ListAndWatch message is the full list, healthy and unhealthy together.
        sends = [c for c in kubelet.calls if c.event == "send" and c.resource == GPU]
        assert len(sends[-1].response["devices"]) == 4
    finally:
        d.stop()
        backend.close()
