"""On a slow link to the API server: a whole-GPU container's calls cost no consistent read when the kubelet's own
list (PodResources, read during the call: it lists the pod being admitted) shows only pods this node's view
knows, and one otherwise, not two (the read its GetPreferredAllocation raced the watch with also serves its
Allocate); a pod without a record the kubelet lists without devices may be the caller, one it does not list
is not; acknowledgements of different pods are written side by side while one pod's writes never overlap and
land in order."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from polling import until
from test_handoff_protocol import GA, GB, KEY, WHOLE, bound, grant

from kubegpu.model import resources as R
from kubegpu.model.allocation import ContainerAllocation, PodAllocation
from kubegpu.node.deviceplugin.resolver import AllocationRefused
from kubegpu.node.handoff import HandoffResolver
from kubegpu.node.handoff.acks import AckWriter


def whole_on(uuid: str) -> PodAllocation:
    return PodAllocation((ContainerAllocation("c0", (grant(uuid, 100),)),))


def test_a_whole_gpu_allocate_reuses_the_read_its_preferred_allocation_started() -> None:
    """The recorded 1.5 s-lag run: GetPreferredAllocation found the pod missing from the lagging watch and raced a
    LIST; the watch won; Allocate then made a second LIST (two round trips before each whole-GPU answer). The
    first LIST was started after the container's calls began, so it shows every pod bound before them."""
    running = bound("ran", WHOLE, whole_on(GB), phase="Running")  # the extender places pods here
    pod = bound("w", WHOLE, whole_on(GA), rv=2)
    lists: list[int] = []
    release = threading.Event()

    def refresh() -> list[dict[str, Any]]:
        lists.append(1)
        release.wait(10)
        return [running, pod]

    r = HandoffResolver("n1", key=KEY, refresh=refresh)
    r.observe(running)
    hint: list[Any] = []
    gpa = threading.Thread(target=lambda: hint.append(r.preferred(R.NVIDIA_GPU, [GA], [], 1)))
    gpa.start()
    assert until(lambda: lists == [1])  # the watch does not show the pod yet: a LIST races it
    r.observe(pod)  # the watch catches up first
    gpa.join(10)
    assert hint == [[GA]]
    got: list[Any] = []
    alloc = threading.Thread(target=lambda: got.append(r.resolve(R.NVIDIA_GPU, [GA])))
    alloc.start()
    release.set()
    alloc.join(10)
    assert got and got[0] is not None and got[0].pod == "default/w"
    assert lists == [1]  # one consistent read for the container's two calls


def test_a_whole_gpu_allocate_without_a_preferred_allocation_still_reads_once() -> None:
    """No GetPreferredAllocation (a kubelet without it): the Allocate makes its own consistent read."""
    running = bound("ran", WHOLE, whole_on(GB), phase="Running")
    pod = bound("w", WHOLE, whole_on(GA), rv=2)
    lists: list[int] = []
    r = HandoffResolver("n1", key=KEY, refresh=lambda: lists.append(1) or [running, pod])
    r.observe(running)
    r.observe(pod)
    got = r.resolve(R.NVIDIA_GPU, [GA])
    assert got is not None and got.pod == "default/w" and lists == [1]


def listed(*pods: dict[str, Any], holding: dict[str, list[str]] | None = None) -> list[Any]:
    """The kubelet's PodResources rows: one per pod listed, one per device it holds (``holding``: pod -> IDs)."""
    rows: list[Any] = []
    for p in pods:
        name = p["metadata"]["name"]
        rows.append(("default", name, "", "", []))
        rows += [("default", name, "c0", R.NVIDIA_GPU, [i]) for i in (holding or {}).get(name, [])]
    return rows


def resolver(watched: list[dict[str, Any]], api: list[dict[str, Any]],
             kubelet: list[Any]) -> tuple[HandoffResolver, list[int]]:
    """A resolver whose watch has shown ``watched``, whose consistent reads (counted) return ``api`` and whose
    kubelet lists ``kubelet`` (PodResources rows)."""
    reads: list[int] = []

    def refresh() -> list[dict[str, Any]]:
        reads.append(1)
        return list(api)

    r = HandoffResolver("n1", key=KEY, refresh=refresh)
    for p in watched:
        r.observe(p)
    r.pod_resources = lambda: kubelet
    return r, reads


RECORDED = bound("recorded", WHOLE, whole_on(GA))
PLAIN = bound("plain", WHOLE, None)  # bound by another scheduler: no record


def test_a_whole_gpu_allocate_the_kubelets_list_attributes_needs_no_consistent_read() -> None:
    """The kubelet lists the pod it admits before it calls: when this view knows every pod listed and only the
    recorded pod can still call with this kind, the call is that pod's, whatever the API server has since."""
    running = bound("ran", WHOLE, whole_on(GB), phase="Running")
    pod = bound("w", WHOLE, whole_on(GA), rv=2)
    r, reads = resolver([running, pod], [running, pod], listed(running, pod, holding={"ran": [GB]}))
    assert r.preferred(R.NVIDIA_GPU, [GA, GB], [], 1) == [GA]
    got = r.resolve(R.NVIDIA_GPU, [GA])
    assert got is not None and got.pod == "default/w" and reads == []


def test_a_listed_pod_the_view_has_not_seen_still_costs_the_consistent_read() -> None:
    """The default-scheduler pod the watch has not shown yet is listed by the kubelet (it is the one being
    admitted): only a consistent read says what it asks, and it makes the call ambiguous."""
    r, reads = resolver([RECORDED], [RECORDED, PLAIN], listed(RECORDED, PLAIN))
    with pytest.raises(AllocationRefused, match=r"asked both by default/recorded .* default/plain"):
        r.resolve(R.NVIDIA_GPU, [GA])
    assert reads


def test_a_pod_without_record_listed_without_devices_may_be_the_caller() -> None:
    """A pod the kubelet lists but holds nothing for may be the one it is admitting right now (listed before its
    first call), not one it is done with: the recorded pod's GPUs are not handed to that call."""
    both = [RECORDED, PLAIN]
    r, _ = resolver(both, both, listed(*both))
    with pytest.raises(AllocationRefused, match=r"asked both by default/recorded .* default/plain"):
        r.resolve(R.NVIDIA_GPU, [GA])
    # Once the kubelet holds its GPU, its call is done: the recorded pod's call is its own.
    r, _ = resolver(both, both, listed(*both, holding={"plain": [GB]}))
    got = r.resolve(R.NVIDIA_GPU, [GA])
    assert got is not None and got.pod == "default/recorded"


def test_a_pod_without_record_the_kubelet_does_not_list_is_not_the_caller() -> None:
    """Bound here but not yet seen by the kubelet (not in its pod manager), a default-scheduler pod cannot be the
    pod a call is for: the recorded pod the kubelet lists is served, with no read and no refusal."""
    both = [RECORDED, PLAIN]
    r, reads = resolver(both, both, listed(RECORDED))
    got = r.resolve(R.NVIDIA_GPU, [GA])
    assert got is not None and got.pod == "default/recorded" and reads == []


def test_acknowledgements_of_different_pods_are_written_side_by_side() -> None:
    """One PATCH at a time per node made the last acknowledgement land 16 s after every pod ran: a pod's write
    waiting on a slow round trip must not hold up another pod's."""
    slow = threading.Event()
    landed: list[str] = []

    def write(key: str) -> bool:
        if key == "ns/first":
            slow.wait(10)
        landed.append(key)
        return True

    w = AckWriter(write, workers=2)
    try:
        w.ask("ns/first")
        assert until(lambda: w.pending() == 1)  # taken by a worker, blocked on its round trip
        w.ask("ns/second")
        assert until(lambda: landed == ["ns/second"])  # written while the first is still on its way
        slow.set()
        assert until(lambda: landed == ["ns/second", "ns/first"])
    finally:
        slow.set()
        w.stop()


def test_as_many_acknowledgements_are_in_flight_as_are_due() -> None:
    """A fixed pool of 4 writers left the fifth acknowledgement due at once waiting for a round trip: the
    writer starts a worker whenever a write is due and none is idle, up to its bound, and no more."""
    release = threading.Event()
    inflight: set[str] = set()
    lock = threading.Lock()

    def write(key: str) -> bool:
        with lock:
            inflight.add(key)
        release.wait(10)
        return True

    def workers() -> int:
        return sum(t.name.startswith("acks-due-") for t in threading.enumerate())

    w = AckWriter(write, name="acks-due")
    capped = AckWriter(write, name="acks-capped", workers=3)
    try:
        for i in range(10):
            w.ask(f"ns/p{i}")
            capped.ask(f"other/p{i}")
        assert until(lambda: len(inflight) == 13)  # every one of the first writer's on its way, none queued
        assert workers() == 10 and capped.pending() == 10
        release.set()
        assert until(lambda: w.pending() == 0 and capped.pending() == 0 and len(inflight) == 20)
        w.ask("ns/p0")  # an idle worker takes it: none is started
        assert until(lambda: w.pending() == 0) and workers() == 10
    finally:
        release.set()
        w.stop()
        capped.stop()


def test_a_pods_acknowledgements_never_overlap_and_the_later_one_lands_last() -> None:
    """Asked again while its write is in flight, a pod is written again after that write, never beside it: every
    write carries the pod's whole acknowledgement, so the last one written is the newest."""
    gate = threading.Event()
    state = {"version": 1}
    writes: list[int] = []
    inflight: list[int] = []
    overlap: list[int] = []

    def write(key: str) -> bool:
        inflight.append(1)
        if len(inflight) > 1:
            overlap.append(1)
        seen = state["version"]
        if seen == 1:
            gate.wait(10)
        writes.append(seen)
        inflight.pop()
        return True

    w = AckWriter(write, workers=2)
    try:
        w.ask("ns/p")
        assert until(lambda: inflight == [1])
        state["version"] = 2
        w.ask("ns/p")  # a newer acknowledgement while the first write is on its way
        gate.set()
        assert until(lambda: writes == [1, 2])
        assert not overlap
    finally:
        gate.set()
        w.stop()
