"""Who an identity-less kubelet call can be for (kubegpu.node.handoff.callers), pods that ended included."""

from __future__ import annotations

from kubegpu.model import resources as R
from kubegpu.node.handoff.callers import callers, open_kinds
from kubegpu.node.handoff.entries import PodView

SHARE = R.GPU_SLOTS


def view(key: str, *asks: tuple[str, str, int], running: bool = False) -> PodView:
    return PodView(key, f"uid-{key}", "", 0, [], running=running, asks=tuple((c, r, n, False) for c, r, n in asks))


def row(key: str, container: str = "", resource: str = "", ids: tuple[str, ...] = ()) -> tuple[str, str, str, str,
                                                                                             list[str]]:
    ns, name = key.split("/")
    return ns, name, container, resource, list(ids)


def test_open_kinds_are_the_calls_a_pod_never_made() -> None:
    pod = view("ns/a", ("c0", SHARE, 1), ("c1", R.NVIDIA_GPU, 2))
    assert open_kinds(pod, {}) == {("c0", SHARE, 1), ("c1", R.NVIDIA_GPU, 2)}
    assert open_kinds(pod, {("uid-ns/a", "c0"): object()}) == {("c1", R.NVIDIA_GPU, 2)}  # c0 was served
    assert open_kinds(view("ns/b", ("c0", SHARE, 1), running=True), {}) == frozenset()  # its calls are done


def test_a_listed_pod_that_ended_with_the_call_open_is_named_and_nothing_else_is() -> None:
    ended = {"ns/first": frozenset({("c0", SHARE, 1)}), "ns/old": frozenset({("c0", R.NVIDIA_GPU, 1)})}
    pods = {"ns/second": view("ns/second", ("c0", SHARE, 1))}
    # The kubelet admits the deleted pod: it lists it (no devices), not the next pod of its kind.
    found = callers(pods, {}, [row("ns/first")], SHARE, 1, ended)
    assert found.ended == ("ns/first",) and found.unknown == ("ns/first",) and found.possible == ()
    # Another kind (count, resource) is not that pod's call.
    assert callers(pods, {}, [row("ns/first")], SHARE, 2, ended).ended == ()
    assert callers(pods, {}, [row("ns/old")], SHARE, 1, ended).ended == ()
    # Its container already holds such devices: that call is done.
    assert callers(pods, {}, [row("ns/first", "c0", SHARE, ("g::0",))], SHARE, 1, ended).ended == ()
    # A pod of that name the view has (recreated under the same name) is the view's pod, not the ended one.
    again = {"ns/first": view("ns/first", ("c0", SHARE, 1))}
    found = callers(again, {}, [row("ns/first")], SHARE, 1, ended)
    assert found.possible == ("ns/first",) and found.ended == ()
    # Without what ended, an unknown listed pod stays unknown only.
    assert callers(pods, {}, [row("ns/first")], SHARE, 1).ended == ()
