"""The reservation policy for wide pods: where it holds GPUs, for whom, and what may still use them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.reservations import (
    ReservationConfig,
    RunningPod,
    WaitingPod,
    choose_reservations,
)

CFG = ReservationConfig(min_gpus=4, wait_seconds=10, max_share=1.0)


def cluster(gpus: list[int]) -> ClusterState:
    n = len(gpus)
    return ClusterState.from_arrays([f"n{i}" for i in range(n)], ["A100"] * n, gpus, [64_000] * n, [2**40] * n)


def occupy(c: ClusterState, running: list[RunningPod]) -> None:
    for p in running:
        c.take(p.node, p.gpus, Demand.whole(len(p.gpus)))


def test_a_wide_pod_that_waited_gets_the_node_with_the_least_in_the_way() -> None:
    c = cluster([8, 8])
    running = [RunningPod("ns/a", 0, (0, 1, 2)), RunningPod("ns/b", 1, (0,))]
    occupy(c, running)
    plan = choose_reservations(c, [WaitingPod("ns/wide", Demand.whole(8), created=0)], running, 20, CFG)
    (r,) = plan.items
    assert (r.node_name, r.gpus, r.free, r.holders) == ("n1", tuple(range(8)), 7, ("ns/b",))
    assert r.reason == "waiting for 8 GPUs on n1: 7 free, 1 held by ns/b"
    assert plan.summary()["reserved_gpus"] == 8


def test_no_reservation_before_the_threshold_or_for_narrow_pods_or_when_disabled() -> None:
    c = cluster([8])
    waiting = [WaitingPod("ns/young", Demand.whole(8), created=15), WaitingPod("ns/narrow", Demand.whole(2), 0),
               WaitingPod("ns/share", Demand.share(500, count=4), 0)]
    assert choose_reservations(c, waiting, [], 20, CFG).items == ()
    old = [WaitingPod("ns/old", Demand.whole(8), 0)]
    assert choose_reservations(c, old, [], 20, ReservationConfig(enabled=False)).items == ()


def test_never_on_a_node_that_can_never_fit_it() -> None:
    c = cluster([4, 8])
    c.node_model[1] = -1  # another model than the pods ask for below
    a100 = frozenset({"A100"})
    waiting = [WaitingPod("ns/w", Demand.whole(8, models=a100), 0), WaitingPod("ns/huge", Demand.whole(16), 1)]
    plan = choose_reservations(c, waiting, [], 20, CFG)
    assert plan.items == () and plan.unreserved == ("ns/w", "ns/huge")
    plan = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(4, models=a100), 0)], [], 20, CFG)
    assert [r.node for r in plan.items] == [0]


def test_oldest_first_and_priority_before_age_within_the_budget() -> None:
    c = cluster([8, 8, 8, 8])  # 32 GPUs; a quarter holds one 8-GPU pod
    waiting = [WaitingPod("ns/new", Demand.whole(8), 5), WaitingPod("ns/old", Demand.whole(8), 1)]
    cfg = ReservationConfig(min_gpus=4, wait_seconds=0, max_share=0.25)
    assert [r.pod for r in choose_reservations(c, waiting, [], 20, cfg).items] == ["ns/old"]
    urgent = [*waiting, WaitingPod("ns/urgent", Demand.whole(8), 9, priority=100)]
    plan = choose_reservations(c, urgent, [], 20, cfg)
    assert [r.pod for r in plan.items] == ["ns/urgent"]
    assert plan.unreserved == ("ns/old", "ns/new")


def test_the_budget_always_serves_the_oldest_but_no_younger_pod_overtakes_it() -> None:
    c = cluster([8, 8])
    cfg = ReservationConfig(min_gpus=4, wait_seconds=0, max_share=0.1)  # 1 GPU of 16
    waiting = [WaitingPod("ns/a", Demand.whole(8), 0), WaitingPod("ns/b", Demand.whole(4), 1)]
    plan = choose_reservations(c, waiting, [], 5, cfg)
    assert [r.pod for r in plan.items] == ["ns/a"] and plan.unreserved == ("ns/b",)


def test_small_pods_use_only_gpus_beyond_the_reservation_or_end_before_it() -> None:
    c = cluster([8])
    running = [RunningPod("ns/a", 0, (0, 1), ends=100.0)]
    occupy(c, running)
    plan = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(4), 0)], running, 20, CFG)
    (r,) = plan.items
    assert r.gpus == (2, 3, 4, 5) and r.start == 20.0  # free GPUs first: it can start now
    assert plan.may_place(0, (6,)) and not plan.may_place(0, (2,))
    assert plan.may_place(0, (2, 3), pod="ns/w")
    assert not plan.may_place(0, (2,), ends=30.0)  # it could start now: nothing may end "before"


def test_backfill_with_a_declared_end_only_when_every_holder_declares_one() -> None:
    c = cluster([8])
    running = [RunningPod(f"ns/r{g}", 0, (g,), ends=50.0 + g) for g in range(6)]
    running.append(RunningPod("ns/forever", 0, (6,)))
    occupy(c, running)
    plan = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(4), 0)], running, 20, CFG)
    (r,) = plan.items
    # The GPUs that free soonest: the free one (7), then the ones that end first; never the endless one.
    assert r.gpus == (0, 1, 2, 7) and r.start == 52.0
    assert r.reason == "waiting for 4 GPUs on n0: 1 free, 3 held by ns/r0, ns/r1, ns/r2 (declared to end within 32 s)"
    assert plan.may_place(0, (7,), ends=40.0) and not plan.may_place(0, (7,), ends=60.0)
    assert not plan.may_place(0, (7,))  # no declared end: it could run past the start


def test_dropped_when_the_pod_is_gone_or_placed_or_its_node_is_gone() -> None:
    c = cluster([8, 8])
    w = WaitingPod("ns/w", Demand.whole(8), 0)
    plan = choose_reservations(c, [w], [], 20, CFG)
    assert plan.for_pod("ns/w") is not None
    assert choose_reservations(c, [], [], 21, CFG, previous=plan).items == ()  # deleted or placed: not waiting
    shrunk = cluster([8, 8])
    shrunk.gpu_ok[plan.items[0].node] = False  # its node left (no usable GPUs)
    again = choose_reservations(shrunk, [w], [], 21, CFG, previous=plan)
    assert [r.node for r in again.items] == [1 - plan.items[0].node]


def test_the_previous_node_is_kept_while_it_can_take_the_pod() -> None:
    c = cluster([8, 8])
    running = [RunningPod("ns/a", 0, (0,)), RunningPod("ns/b", 1, (0, 1))]
    occupy(c, running)
    w = [WaitingPod("ns/w", Demand.whole(8), 0)]
    first = choose_reservations(c, w, running, 20, CFG)
    assert first.items[0].node == 0
    c.give_back(1, (0, 1), Demand.whole(2))  # node 1 empties: better now, but node 0 has drained for it
    kept = choose_reservations(c, w, running[:1], 30, CFG, previous=first)
    assert kept.items[0].node == 0
    assert choose_reservations(c, w, running[:1], 30, CFG).items[0].node == 1


@st.composite
def scenes(draw: st.DrawFn) -> tuple[ClusterState, list[RunningPod], list[WaitingPod]]:
    sizes = draw(st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=5))
    c = cluster(sizes)
    running: list[RunningPod] = []
    for node, g in enumerate(sizes):
        for slot in range(g):
            if draw(st.booleans()):
                end = draw(st.one_of(st.none(), st.floats(0, 200)))
                running.append(RunningPod(f"ns/r{node}-{slot}", node, (slot,), end))
    occupy(c, running)
    waiting = [WaitingPod(f"ns/w{i}", Demand.whole(draw(st.sampled_from([1, 4, 8, 16]))),
                          draw(st.floats(0, 50)), draw(st.integers(0, 2))) for i in range(draw(st.integers(0, 5)))]
    return c, running, waiting


@settings(max_examples=150, deadline=None)
@given(scenes(), st.floats(0, 1), st.floats(0, 300), st.one_of(st.none(), st.floats(0, 300)))
def test_properties(scene: tuple[ClusterState, list[RunningPod], list[WaitingPod]], share: float, ends_in: float,
                    ends: float | None) -> None:
    c, running, waiting = scene
    cfg = ReservationConfig(min_gpus=4, wait_seconds=0, max_share=share)
    now = 60.0
    plan = choose_reservations(c, waiting, running, now, cfg)
    again = choose_reservations(c, waiting, running, now, cfg)
    assert again.items == plan.items and np.array_equal(again.held, plan.held)  # recomputation: the same
    budget = int(share * int(c.gpu_ok.sum()))
    if len(plan.items) > 1:
        assert sum(r.width for r in plan.items) <= budget  # bounded share
    held_count = sum(len(r.gpus) for r in plan.items)
    assert held_count == int(plan.held.sum())  # never the same GPU twice
    ranks = {w.key: (-w.priority, w.created, w.key) for w in waiting}
    assert [ranks[r.pod] for r in plan.items] == sorted(ranks[r.pod] for r in plan.items)
    ends_at = {(p.node, p.gpus[0]): p.ends for p in running}
    taken: set[tuple[int, int]] = set()
    for r in plan.items:
        assert int(c.gpu_ok[r.node].sum()) >= r.width  # only where it can ever fit
        assert len(r.gpus) == r.width
        if r.start is not None:
            # Narrowest: a free GPU is held only for want of busy ones that free by the start.
            by_start = sum(1 for g in range(c.n_slots) if (r.node, g) not in taken and c.gpu_ok[r.node, g]
                           and (e := ends_at.get((r.node, g), -1.0)) is not None and now < e <= r.start)
            assert r.free == max(0, r.width - by_start)
        taken.update((r.node, g) for g in r.gpus)
        # A small pod placed wherever allowed never takes a held GPU unless it ends by the pod's start.
        ok = plan.allowed("ns/small", ends)
        assert ok is not None
        for g in r.gpus:
            if ok[r.node, g]:
                assert ends is not None and r.start is not None and ends <= r.start
    for w in waiting:
        if w.demand.count < cfg.min_gpus:
            assert plan.for_pod(w.key) is None


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="max_share"):
        ReservationConfig(max_share=2)
    with pytest.raises(ValueError, match="min_gpus"):
        ReservationConfig(min_gpus=0)


def test_waits_by_width_feed_the_metrics() -> None:
    from kubegpu.placement.reservations import waits_by_width

    waiting = [WaitingPod("a", Demand.whole(8), 0), WaitingPod("b", Demand.whole(8), 30),
               WaitingPod("c", Demand.share(250), 50), WaitingPod("d", Demand(), 55)]
    assert waits_by_width(waiting, 60) == {"8": {"pods": 2, "max_wait_s": 60}, "share": {"pods": 1, "max_wait_s": 10},
                                           "cpu": {"pods": 1, "max_wait_s": 5}}


def test_a_free_gpu_is_held_only_when_the_pod_cannot_start_as_soon_without_it() -> None:
    c = cluster([8])
    # Two GPUs free, six busy: four end at 50, two at 90. A 4-GPU pod can start at 50 on the four that end then,
    # so the free ones keep working meanwhile (anything may use them); holding them would not start it sooner.
    running = [RunningPod(f"ns/r{g}", 0, (g,), ends=50.0) for g in range(4)]
    running += [RunningPod(f"ns/s{g}", 0, (g,), ends=90.0) for g in (4, 5)]
    occupy(c, running)
    plan = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(4), 0)], running, 20, CFG)
    (r,) = plan.items
    assert r.gpus == (0, 1, 2, 3) and r.start == 50.0 and r.free == 0
    assert plan.may_place(0, (6, 7)) and not plan.may_place(0, (0,))
    assert plan.held_free(c) == 0
    # Wider than what ends by then: the free GPUs are needed, and held.
    plan = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(6), 0)], running, 20, CFG)
    (r,) = plan.items
    assert r.gpus == (0, 1, 2, 3, 6, 7) and r.start == 50.0 and r.free == 2


def test_without_known_ends_the_free_gpus_are_held() -> None:
    c = cluster([8])
    running = [RunningPod(f"ns/r{g}", 0, (g,)) for g in range(6)]  # no declared end: nothing says which ends first
    occupy(c, running)
    (r,) = choose_reservations(c, [WaitingPod("ns/w", Demand.whole(4), 0)], running, 20, CFG).items
    assert r.gpus == (0, 1, 6, 7) and r.start is None and r.free == 2
