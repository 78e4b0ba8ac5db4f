"""Restarts of the node daemon turn no pod away, piece by piece: the daemon says "stopping" before it closes its
plugins and "serving" only once the kubelet has them; the extender reads both (and the kubelet's own device
counts, for a daemon that died saying nothing), refuses the node at filter and holds its binds in between; the
stand-in kubelet rejects a pod whose devices are all unhealthy with the real kubelet's words."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import until

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import node_daemon as ND
from kubegpu.model.resources import GPU_SLOTS, NVIDIA_GPU, SERVED_RESOURCES_ANNOTATION
from kubegpu.node.daemon import NodeDaemon
from kubegpu.node.handoff import HandoffResolver
from kubegpu.node.options import load_node_options
from kubegpu.scheduler.handoff import HandoffQueue
from kubegpu.scheduler.nodes import NodeDaemons
from kubegpu.scheduler.plan import PlanSettings, plan_pod
from kubegpu.scheduler.reasons import ReasonMap
from kubegpu.scheduler.state import ClusterView
from kubegpu_standins.kubelet import AllocationFailed, StandinKubelet

SERVED = {SERVED_RESOURCES_ANNOTATION: f"{GPU_SLOTS},{NVIDIA_GPU}"}
HEALTHY = {"capacity": {NVIDIA_GPU: "8", GPU_SLOTS: "160"}, "allocatable": {NVIDIA_GPU: "8", GPU_SLOTS: "160"}}
LOST = {"capacity": {NVIDIA_GPU: "8", GPU_SLOTS: "160"}, "allocatable": {NVIDIA_GPU: "0", GPU_SLOTS: "0"}}


def said(state: str, boot: str) -> dict[str, str]:
    return {**SERVED, ND.NODE_DAEMON: ND.DaemonState(state, boot, 1_700_000_000.0).encode()}


# ---- the extender's reading of the Node ------------------------------------------------------------------
def test_a_stopping_daemon_takes_the_node_out_until_the_next_one_serves() -> None:
    d = NodeDaemons()
    assert d.observe("gpu-node-4", SERVED, HEALTHY) is None  # an older daemon, or none said: as before
    why = d.observe("gpu-node-4", said(ND.STOPPING, "b1"), HEALTHY)
    assert why is not None and why.startswith("kubegpu node daemon on gpu-node-4 is restarting (stopping since ")
    assert d.observe("gpu-node-4", said(ND.STOPPING, "b1"), LOST) == why  # the kubelet's word comes in meanwhile
    # The next daemon says it serves before the kubelet posts its devices again: its word is newer.
    assert d.observe("gpu-node-4", said(ND.SERVING, "b2"), LOST) is None
    assert d.observe("gpu-node-4", said(ND.SERVING, "b2"), HEALTHY) is None


def test_a_daemon_that_died_saying_nothing_is_known_by_the_kubelets_device_counts() -> None:
    d = NodeDaemons()
    assert d.observe("n", said(ND.SERVING, "b1"), HEALTHY) is None
    why = d.observe("n", said(ND.SERVING, "b1"), LOST)
    assert why is not None and "the kubelet on n reports no healthy" in why and NVIDIA_GPU in why
    assert d.observe("n", said(ND.SERVING, "b2"), LOST) is None  # a new daemon registered and says so
    # One resource alone without a healthy device is a health matter (e.g. shares MPS cannot enforce), not a
    # daemon gone: whole GPUs are still given.
    half = {"capacity": LOST["capacity"], "allocatable": {NVIDIA_GPU: "8", GPU_SLOTS: "0"}}
    assert d.observe("m", said(ND.SERVING, "b1"), half) is None
    # And a Node that says nothing of our resources, or has no status, holds nothing up.
    assert d.observe("m", said(ND.SERVING, "b1"), None) is None
    assert d.observe("k", {}, LOST) is None


def test_the_filter_refuses_the_node_with_the_reason_and_takes_it_back_once_serving() -> None:
    view = ClusterView()
    view.set_inventory("gpu-node-4", FakeBackend("dgx-a100", node_name="gpu-node-4").discover())
    view.set_inventory("gpu-node-5", FakeBackend("dgx-a100", node_name="gpu-node-5").discover())
    pod = {"metadata": {"name": "p", "namespace": "d", "uid": "u"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {NVIDIA_GPU: "1"}}}]}}
    plan = plan_pod(pod, PlanSettings())
    view.set_node_daemon("gpu-node-4", said(ND.STOPPING, "b1"), HEALTHY)
    out = view.filter(plan, ["gpu-node-4", "gpu-node-5"])
    assert list(out.passed) == ["gpu-node-5"]
    assert isinstance(out.failed, ReasonMap)
    assert "is restarting" in json.loads(out.failed.json())["gpu-node-4"]
    view.set_node_daemon("gpu-node-4", said(ND.SERVING, "b2"), HEALTHY)
    assert sorted(view.filter(plan, ["gpu-node-4", "gpu-node-5"]).passed) == ["gpu-node-4", "gpu-node-5"]
    view.remove_node("gpu-node-5")
    assert view.handoffs.not_serving == {}


def test_a_held_bind_goes_on_only_once_the_node_serves_again() -> None:
    pod = {"metadata": {"name": "p", "namespace": "d", "uid": "u"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {NVIDIA_GPU: "1"}}}]}}
    shapes = plan_pod(pod, PlanSettings()).shapes

    async def scenario() -> tuple[bool, str | None, str | None]:
        q = HandoffQueue()
        loop = asyncio.get_running_loop()
        q.node_daemon("n", "kubegpu node daemon on n is restarting")
        held = asyncio.create_task(q.turn("n", "d/p", shapes, loop.time() + 3600))
        q.node_progress("n", "42")  # the next daemon's first write (its view's version) lets nothing through
        await asyncio.sleep(0)
        waiting = not held.done()
        q.node_daemon("n", None)
        released = await asyncio.wait_for(held, 60)
        q.node_daemon("n", "still restarting")
        timed_out = await q.turn("n", "d/q", shapes, loop.time())  # past its wait: fails with the reason
        return waiting, released, timed_out

    waiting, released, timed_out = asyncio.run(scenario())
    assert waiting and released is None and timed_out == "still restarting"


# ---- the node daemon's side ------------------------------------------------------------------------------
class Announcer:
    """A publisher that records each state written and what the kubelet had at that moment."""

    def __init__(self, kubelet: StandinKubelet) -> None:
        self.kubelet = kubelet
        self.said: list[tuple[str, str, bool]] = []  # (state, boot, the kubelet had a stream from the plugin)

    def publish(self, inventory: Any, resources: Any) -> None:
        pass

    def announce(self, state: str, boot: str, timeout_s: float) -> bool:
        with self.kubelet._cond:
            st = self.kubelet.resources.get(NVIDIA_GPU)
            streaming = st is not None and st.connected
        self.said.append((state, boot, streaming))
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgr-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def daemon_for(d: Path, publisher: Any, backend: FakeBackend) -> NodeDaemon:
    settings = {"cdi_dir": str(d / "cdi"), "mig_minors_file": str(d / "mm")}
    return NodeDaemon(backend, lambda: load_node_options({"shared-slots": 0}, {}, settings=settings,
                                                         plugin_dir=str(d / "dp"), stream_wait_s=2.0,
                                                         stop_settle_s=0.0),
                      publisher=publisher)


def test_the_daemon_says_stopping_while_it_still_serves_and_serving_once_the_kubelet_streams(
        plugin_dir: Path) -> None:
    kubelet = StandinKubelet(plugin_dir / "dp", seed=1)
    kubelet.start()
    backend = FakeBackend("dgx-a100")
    announcer = Announcer(kubelet)
    first = daemon_for(plugin_dir, announcer, backend)
    try:
        first.start()
        assert until(lambda: bool(announcer.said), 20)
        assert announcer.said == [(ND.SERVING, first.boot, True)]
        first.stop()
        # "stopping" was written while the kubelet still had the plugin's stream; then the plugin closed and
        # the kubelet took every device as Unhealthy.
        assert announcer.said[-1] == (ND.STOPPING, first.boot, True)
        assert kubelet.wait_for(lambda: not kubelet.resources[NVIDIA_GPU].healthy, 10)
        second = daemon_for(plugin_dir, announcer, backend)
        second.start()
        try:
            assert until(lambda: len(announcer.said) == 3, 20)
            assert announcer.said[-1] == (ND.SERVING, second.boot, True) and second.boot != first.boot
        finally:
            second.stop()
    finally:
        kubelet.stop()
        backend.close()


# ---- the stand-in kubelet --------------------------------------------------------------------------------
def test_the_kubelet_rejects_a_pod_whose_devices_are_all_unhealthy_as_the_real_one_did(plugin_dir: Path) -> None:
    kubelet = StandinKubelet(plugin_dir / "dp", seed=2)
    kubelet.start()
    backend = FakeBackend("dgx-a100")
    daemon = daemon_for(plugin_dir, None, backend)
    try:
        daemon.start()
        assert kubelet.wait_registered(NVIDIA_GPU, timeout_s=10)
        daemon.stop()  # its streams end: every device of the resource is Unhealthy, none gone
        assert kubelet.wait_for(lambda: not kubelet.resources[NVIDIA_GPU].healthy, 10)
        assert kubelet.capacity(NVIDIA_GPU) == 8 and kubelet.allocatable(NVIDIA_GPU) == 0
        with pytest.raises(AllocationFailed) as exc:
            kubelet.allocate(NVIDIA_GPU, 1)
        assert str(exc.value) == f"no healthy devices present; cannot allocate unhealthy devices {NVIDIA_GPU}"
        got = kubelet.admit_pod({"metadata": {"name": "c-0203", "namespace": "churn", "uid": "u"},
                                 "spec": {"containers": [{"name": "c", "resources": {"limits": {NVIDIA_GPU: "1"}}}]}})
        assert not got.ok and "cannot allocate unhealthy devices" in got.reason
        assert kubelet.node_status() == {"capacity": {NVIDIA_GPU: "8"}, "allocatable": {NVIDIA_GPU: "0"}}
    finally:
        kubelet.stop()
        backend.close()


def test_a_stop_is_bounded_when_the_api_server_does_not_answer_and_pods_never_get_served() -> None:
    from kubegpu.node.config import load_config
    from kubegpu.node.publish.kube import KubeNodePublisher

    release = threading.Event()

    class Stuck:
        def patch(self, *args: Any, **kw: Any) -> None:
            release.wait()  # an API server that never answers

    publisher = KubeNodePublisher(Stuck(), "gpu-node-4", load_config(flags={}, env={}))
    try:
        assert publisher.announce(ND.STOPPING, "b1", timeout_s=0.05) is False  # logged, and the stop goes on
    finally:
        release.set()


class NeverServed(HandoffResolver):
    """A resolver whose pods bound here are never served (the kubelet does not admit them)."""

    def unserved(self) -> int:
        return 3


def test_a_stopping_daemon_serves_on_while_pods_wait_but_not_forever(plugin_dir: Path) -> None:
    kubelet = StandinKubelet(plugin_dir / "dp", seed=3)
    kubelet.start()
    backend = FakeBackend("dgx-a100")
    announcer = Announcer(kubelet)
    settings = {"cdi_dir": str(plugin_dir / "cdi"), "mig_minors_file": str(plugin_dir / "mm")}
    daemon = NodeDaemon(backend, lambda: load_node_options({"shared-slots": 0}, {}, settings=settings,
                                                           plugin_dir=str(plugin_dir / "dp"), stream_wait_s=2.0,
                                                           stop_settle_s=0.0, stop_drain_s=0.2),
                        publisher=announcer, resolver=NeverServed("gpu-node-4"))
    try:
        daemon.start()
        assert until(lambda: bool(announcer.said), 20)
        daemon.stop()  # returns: the drain is bounded
        assert announcer.said[-1][0] == ND.STOPPING and not daemon.servers
    finally:
        kubelet.stop()
        backend.close()
