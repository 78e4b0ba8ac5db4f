"""Reservations for wide pods through the extender's HTTP app: a wide pod that waited past the threshold gets GPUs
held on one node, small pods go elsewhere, the pod binds there once the node drained, and the reservation goes
with the pod; the plan is rebuilt after a restart and bounded by its share. The clock is the test's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from polling import until
from sched_harness import Cluster
from test_scheduler_behaviour import pod
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import PodAllocation
from kubegpu.model.device_object import device_object
from kubegpu.placement.reservations import ReservationConfig
from kubegpu.scheduler.reservations import api_time
from kubegpu.scheduler.service import ServiceThread
from kubegpu_standins.apiserver import ApiServer

A, B = "gpu-node-a", "gpu-node-b"
BOTH = [A, B]
CONFIG = ReservationConfig(min_gpus=4, wait_seconds=60.0, max_share=0.5)


class Clock:
    """The extender's wall clock, moved by the test: ``at(pod, s)`` is ``s`` seconds after ``pod``'s creation (the
    API server stamps it, in whole seconds), so waits are exact whatever the time the test takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def at(self, pod: dict[str, Any], seconds: float) -> None:
        created = api_time(pod["metadata"]["creationTimestamp"])
        assert created is not None
        self.now = created + seconds


def _start(api: ApiServer, tmp_path: Path, clock: Clock, config: ReservationConfig) -> ServiceThread:
    kc = api.write_kubeconfig(tmp_path / "kubeconfig")
    return ServiceThread(kc, handoff_wait=False, reservations=config, clock=clock).start()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Cluster, Clock]]:
    api = ApiServer(history=5000).start()
    for name in BOTH:
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        api.put_object(device_object(FakeBackend("dgx-a100", node_name=name).discover()))
    clock = Clock()
    ext = _start(api, tmp_path, clock, CONFIG)
    cluster = Cluster(api, ext)
    try:
        yield cluster, clock
    finally:
        cluster.ext.stop()
        api.stop()


def create(cluster: Cluster, clock: Clock, name: str, gpus: int, **spec: Any) -> dict[str, Any]:
    p = pod(name, {"nvidia.com/gpu": str(gpus)})
    p["spec"].update(spec)
    return cluster.api.put_object(p)


def filter_(cluster: Cluster, p: dict[str, Any]) -> dict[str, Any]:
    out = cluster.post("/filter", {"Pod": p, "Nodes": None, "NodeNames": BOTH}).json()
    assert not out.get("Error"), out
    return out


def bind(cluster: Cluster, p: dict[str, Any], node: str) -> str:
    meta = p["metadata"]
    r = cluster.post("/bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                               "Node": node})
    return str(r.json().get("Error", ""))


def summary(cluster: Cluster) -> dict[str, Any]:
    r = cluster.http.get("/apis/v1/plugins/DeviceShare/reservations")
    assert r.status_code == 200
    return r.json()


def fill(cluster: Cluster, clock: Clock, counts: dict[str, int]) -> None:
    """Single-GPU pods bound through the extender, ``counts[node]`` on each node; wait until the watch has them."""
    n = 0
    for node, count in counts.items():
        for _ in range(count):
            p = create(cluster, clock, f"small-{n}", 1)
            assert bind(cluster, p, node) == ""
            n += 1
    view = cluster.view
    assert until(lambda: cluster.ext.call(lambda: sum(len(view.ledger.by_node.get(x, ())) for x in BOTH)
                                          - view.ledger.assumed_count) == n)


def reserved(cluster: Cluster, clock: Clock) -> dict[str, Any]:
    """Nodes a: 6 of 8 GPUs busy, b: 7; a pod asking 4 GPUs waits past the threshold: its reservation."""
    fill(cluster, clock, {A: 6, B: 7})
    wide = create(cluster, clock, "wide", 4)
    clock.at(wide, 10.0)
    out = filter_(cluster, wide)
    assert out["NodeNames"] == []
    assert summary(cluster)["reservations"] == []  # not waited long enough yet
    clock.at(wide, 61.0)
    out = filter_(cluster, wide)
    assert out["NodeNames"] == []
    # a is drained soonest at the least cost (fewer busy GPUs): the event says where and what it waits for.
    assert out["FailedNodes"][A].startswith("waiting for 4 GPUs on gpu-node-a: 2 free, 2 held by default/small-")
    return wide


def test_a_wide_pod_gets_a_reservation_small_pods_go_elsewhere_and_it_binds_once_drained(
        world: tuple[Cluster, Clock]) -> None:
    cluster, clock = world
    wide = reserved(cluster, clock)
    s = summary(cluster)
    assert s["reserved_gpus"] == 4 and s["waiting"]["4"]["pods"] == 1
    (r,) = s["reservations"]
    assert (r["pod"], r["node"], r["width"], r["free"]) == ("default/wide", A, 4, 2)
    holders = r["held_by"]
    assert len(holders) == 2
    metrics = cluster.http.get("/metrics").text
    assert "kubegpu_reserved_gpus 4.0" in metrics and 'kubegpu_reservations{width="4"} 1.0' in metrics
    # A small pod: a's free GPUs are held, so it goes to b; a bind to a is refused with the reason.
    small = create(cluster, clock, "late", 1)
    out = filter_(cluster, small)
    assert out["NodeNames"] == [B]
    assert out["FailedNodes"][A] == "GPUs held for a waiting wide pod: default/wide (4 GPUs, waiting 61 s)"
    assert "GPUs held for a waiting wide pod: default/wide" in bind(cluster, small, A)
    assert bind(cluster, small, B) == ""
    # The holders end: the wide pod fits a and binds there; its reservation is gone with it.
    for key in holders:
        cluster.api.store.delete(cluster.api.kind("pods"), "default", key.split("/")[1])
    assert until(lambda: summary(cluster)["reservations"][0]["free"] == 4)
    assert filter_(cluster, wide)["NodeNames"] == [A]
    assert bind(cluster, wide, A) == ""
    assert until(lambda: summary(cluster)["reservations"] == [])
    assert summary(cluster)["waiting"] == {}  # every pod filtered here is bound
    assert 'kubegpu_pod_wait_seconds_count{width="4"} 1.0' in cluster.http.get("/metrics").text


def declare_ends(cluster: Cluster, wide: dict[str, Any], smalls: range) -> None:
    """The ``smalls`` (bound by :func:`fill`) declare they run 100 s from the wide pod's creation, as they started
    then; wait until the extender's watch has their ends."""
    started = wide["metadata"]["creationTimestamp"]
    pods = cluster.api.kind("pods")
    for i in smalls:
        cluster.api.store.update(pods, "default", f"small-{i}",
                                 lambda o: {**o, "spec": {**o["spec"], "activeDeadlineSeconds": 100}})
        cluster.api.store.update(pods, "default", f"small-{i}",
                                 lambda o: {**o, "status": {"phase": "Running", "startTime": started}},
                                 subresource="status")
    view = cluster.view
    assert until(lambda: cluster.ext.call(lambda: len(view.reservations.ends)) == len(smalls))


def test_held_gpus_are_backfilled_only_by_pods_that_end_before_the_wide_pod_can_start(
        world: tuple[Cluster, Clock]) -> None:
    """Two of the six pods on a declare they end at 100 s (from the wide pod's creation), the others nothing: the
    wide pod can start there at 100 s on those two GPUs and the two free ones, so at 61 s a pod declaring 30 s may
    use a held GPU, and one declaring 60 s may not."""
    cluster, clock = world
    fill(cluster, clock, {A: 6, B: 7})
    wide = create(cluster, clock, "wide", 4)
    declare_ends(cluster, wide, range(2))
    clock.at(wide, 61.0)
    out = filter_(cluster, wide)
    assert out["FailedNodes"][A] == ("waiting for 4 GPUs on gpu-node-a: 2 free, 2 held by default/small-0, "
                                     "default/small-1 (declared to end within 39 s)")
    short = create(cluster, clock, "short", 1, activeDeadlineSeconds=30)
    assert filter_(cluster, short)["NodeNames"] == BOTH
    long = create(cluster, clock, "long", 1, activeDeadlineSeconds=60)
    assert filter_(cluster, long)["NodeNames"] == [B]
    assert bind(cluster, short, A) == ""
    assert "GPUs held for a waiting wide pod" in bind(cluster, long, A)


def test_free_gpus_the_wide_pod_can_start_without_are_not_held(world: tuple[Cluster, Clock]) -> None:
    """All six pods on a declare they end at 100 s: four of them free enough GPUs for the wide pod then, so only
    those are held, and the two free GPUs stay open to any pod (the wide pod's start is the same)."""
    cluster, clock = world
    fill(cluster, clock, {A: 6, B: 7})
    wide = create(cluster, clock, "wide", 4)
    declare_ends(cluster, wide, range(6))
    clock.at(wide, 61.0)
    reason = filter_(cluster, wide)["FailedNodes"][A]
    assert reason.startswith("waiting for 4 GPUs on gpu-node-a: 0 free, 4 held by default/small-")
    assert reason.endswith("(declared to end within 39 s)")
    long = create(cluster, clock, "long", 1)  # no declared end: never a held GPU
    assert filter_(cluster, long)["NodeNames"] == BOTH
    assert bind(cluster, long, A) == ""
    (r,) = summary(cluster)["reservations"]
    assert (r["node"], r["free"], len(r["held_by"])) == (A, 0, 4)


def test_kubegpu_status_shows_the_reservations_from_the_extender(world: tuple[Cluster, Clock]) -> None:
    cluster, clock = world
    reserved(cluster, clock)
    out = CliRunner().invoke(app, ["status", "--extender", cluster.ext.url, "-o", "json"])
    assert out.exit_code == 0, out.output
    (r,) = json.loads(out.output)["reservations"]["reservations"]
    assert (r["pod"], r["node"]) == ("default/wide", A)
    out = CliRunner().invoke(app, ["status", "--extender", cluster.ext.url], env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    assert "Reservations for wide pods (4 GPUs held)" in out.output
    assert "waiting for 4 GPUs on gpu-node-a: 2 free, 2 held by" in out.output


def test_a_wide_pod_kube_scheduler_never_sends_is_seen_waiting_in_the_watch(world: tuple[Cluster, Clock]) -> None:
    """kube-scheduler calls the extender only with the nodes its own filters passed: a wide pod no node has room
    for by its count is never filtered here. Pending pods of the profile that calls the extender (learnt from
    the pods it filters) are seen waiting in the pod watch; another scheduler's are not."""
    cluster, clock = world
    fill(cluster, clock, {A: 6, B: 7})
    filter_(cluster, create(cluster, clock, "late", 1, schedulerName="kubegpu-scheduler"))
    create(cluster, clock, "other", 8, schedulerName="default-scheduler")
    wide = create(cluster, clock, "wide", 4, schedulerName="kubegpu-scheduler", priority=5)
    clock.at(wide, 61.0)
    assert until(lambda: [r["pod"] for r in summary(cluster)["reservations"]] == ["default/wide"])
    s = summary(cluster)
    assert s["reservations"][0]["node"] == A and "8" not in s["waiting"]
    assert filter_(cluster, create(cluster, clock, "next", 1))["NodeNames"] == [B]


def test_a_wide_pod_bound_here_holds_nothing_more_before_the_watch_shows_it(world: tuple[Cluster, Clock]) -> None:
    """Bind holds the pod's GPUs before the watch echoes the Binding: from then on it waits no more (else it would
    get GPUs held on another node, and the reservations after it would move)."""
    cluster, clock = world
    wide = reserved(cluster, clock)
    view = cluster.view
    key, uid = "default/wide", wide["metadata"]["uid"]

    def bound_meanwhile() -> tuple[bool, bool]:  # in the extender's loop: no watch event in between
        r = view.reservations
        before = r.current().for_pod(key) is not None
        view.ledger.hold(key, uid, B, PodAllocation(()), assumed=True)
        after = r.current()
        view.ledger.release(key)
        return before, after is None

    assert cluster.ext.call(bound_meanwhile) == (True, True)


def test_deleting_the_wide_pod_drops_its_reservation(world: tuple[Cluster, Clock]) -> None:
    cluster, clock = world
    reserved(cluster, clock)
    cluster.api.store.delete(cluster.api.kind("pods"), "default", "wide")
    assert until(lambda: summary(cluster)["reservations"] == [])
    assert filter_(cluster, create(cluster, clock, "late", 1))["NodeNames"] == BOTH


def test_a_restart_rebuilds_the_reservation_on_the_same_gpus(world: tuple[Cluster, Clock], tmp_path: Path) -> None:
    cluster, clock = world
    wide = reserved(cluster, clock)
    before = summary(cluster)["reservations"]
    cluster.ext.stop()
    cluster.ext = _start(cluster.api, tmp_path, clock, CONFIG)
    cluster.http = httpx.Client(base_url=cluster.ext.url, timeout=10)
    assert summary(cluster)["reservations"] == []  # nothing waits until kube-scheduler asks again
    out = filter_(cluster, wide)  # its creation time says how long it has waited
    assert out["FailedNodes"][A].startswith("waiting for 4 GPUs on gpu-node-a: 2 free, 2 held by")
    assert summary(cluster)["reservations"] == before


def test_reservations_are_bounded_by_their_share_and_served_by_priority(world: tuple[Cluster, Clock],
                                                                         tmp_path: Path) -> None:
    cluster, clock = world
    cluster.ext.stop()  # a budget of a quarter of the 16 GPUs: one 4-GPU reservation
    cluster.ext = _start(cluster.api, tmp_path, clock, ReservationConfig(max_share=0.25))
    cluster.http = httpx.Client(base_url=cluster.ext.url, timeout=10)
    fill(cluster, clock, {A: 6, B: 7})
    old = create(cluster, clock, "wide-old", 4)
    urgent = create(cluster, clock, "wide-urgent", 4, priority=10)
    clock.at(urgent, 61.0)  # both waited past the threshold
    filter_(cluster, old)
    out = filter_(cluster, urgent)
    assert out["FailedNodes"][A].startswith("waiting for 4 GPUs on gpu-node-a")
    s = summary(cluster)
    assert [r["pod"] for r in s["reservations"]] == ["default/wide-urgent"]
    assert s["without_reservation"] == ["default/wide-old"] and s["reserved_gpus"] == 4


def test_disabled_reservations_hold_nothing(world: tuple[Cluster, Clock], tmp_path: Path) -> None:
    cluster, clock = world
    cluster.ext.stop()
    cluster.ext = _start(cluster.api, tmp_path, clock, ReservationConfig(enabled=False))
    cluster.http = httpx.Client(base_url=cluster.ext.url, timeout=10)
    fill(cluster, clock, {A: 6, B: 7})
    wide = create(cluster, clock, "wide", 4)
    clock.at(wide, 600.0)
    assert "waiting for" not in filter_(cluster, wide)["FailedNodes"][A]
    assert filter_(cluster, create(cluster, clock, "late", 1))["NodeNames"] == BOTH
    assert summary(cluster)["reserved_gpus"] == 0
