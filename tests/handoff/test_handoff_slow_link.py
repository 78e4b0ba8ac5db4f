"""On a slow link to the API server: a whole-GPU container's calls cost one consistent read, not two (the
read its GetPreferredAllocation raced the watch with also serves its Allocate), and acknowledgements of
different pods are written side by side while one pod's writes never overlap and land in order."""

from __future__ import annotations

import threading
from typing import Any

from polling import until
from test_handoff_protocol import GA, GB, KEY, WHOLE, bound, grant

from kubegpu.model import resources as R
from kubegpu.model.allocation import ContainerAllocation, PodAllocation
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
