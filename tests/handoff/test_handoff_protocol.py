"""The node side of the handoff, rule by rule: an Allocate is served only as the signed record naming
exactly the kubelet's GPUs; a lagging view reads consistently; a lagging watch never resurrects a pod;
forged records get nothing; whole GPUs never land on shared ones; the verifier groups PodResources
entries per container (the recorded v1.24 kubelet lists one entry per device)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from kubegpu.kube.informer import EventType, WatchEvent
from kubegpu.kube.resources import Pod
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.records import Ack, decode_acks
from kubegpu.node.deviceplugin.resolver import AllocationRefused
from kubegpu.node.handoff import HandoffResolver

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "handoff"
KEY = b"a-test-record-key-of-32-bytes-ok"
NODE = "n1"
GA, GB, GC = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


def grant(uuid: str, core: int = 25, minor: int = 0) -> DeviceGrant:
    return DeviceGrant(minor, uuid, core, core * 2**28, core)


def bound(name: str, limits: dict[str, str], alloc: PodAllocation | None, *, uid: str | None = None,
          key: bytes | None = KEY, rv: int = 1, phase: str = "Pending", init: dict[str, str] | None = None,
          signature: str | None = None) -> dict[str, Any]:
    uid = uid or f"uid-{name}"
    ann: dict[str, str] = {}
    if alloc is not None:
        value = encode(alloc)
        ann[A.DEVICE_ALLOCATED] = value
        ann[signing.RECORD_SIGNATURE] = signature if signature is not None else (
            signing.sign(key, uid, NODE, value) if key else "")
    spec: dict[str, Any] = {"nodeName": NODE, "containers": [
        {"name": "c0", "resources": {"limits": limits}}]}
    if init:
        spec["initContainers"] = [{"name": "i0", "resources": {"limits": init}}]
    return {"metadata": {"name": name, "namespace": "default", "uid": uid, "annotations": ann,
                         "creationTimestamp": "2026-11-24T01:00:00Z", "resourceVersion": str(rv)},
            "spec": spec, "status": {"phase": phase}}


SHARE = {R.GPU_CORE: "25", R.GPU_MEMORY_RATIO: "25", R.GPU_SLOTS: "1"}
WHOLE = {R.NVIDIA_GPU: "1"}


def one(uuid: str, core: int = 25) -> PodAllocation:
    return PodAllocation((ContainerAllocation("c0", (grant(uuid, core),)),))


def test_allocate_serves_only_the_record_naming_the_kubelets_gpus() -> None:
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("p-b", SHARE, one(GB, 30)))
    # GetPreferredAllocation steers to the waiting record's GPU.
    assert r.preferred(R.GPU_SLOTS, [f"{GB}::1", f"{GA}::2", f"{GC}::3"], [], 1) == [f"{GB}::1"]
    got = r.resolve(R.GPU_SLOTS, [f"{GB}::5"])
    assert got is not None and got.pod == "default/p-b" and got.uuids == (GB,)
    assert got.gpus[0].core == 30
    r.observe(bound("p-a", SHARE, one(GA)))
    with pytest.raises(AllocationRefused, match=r"no pod bound to n1 has a signed, unserved record naming exactly"):
        r.resolve(R.GPU_SLOTS, [f"{GC}::0"])
    # Served once: the same GPUs again find nothing to serve.
    with pytest.raises(AllocationRefused):
        r.resolve(R.GPU_SLOTS, [f"{GB}::6"])
    assert r.preferred(R.GPU_SLOTS, [f"{GB}::1", f"{GA}::2", f"{GC}::3"], [], 1) == [f"{GA}::2"]


def test_two_pods_waiting_with_one_kind_are_refused_never_guessed() -> None:
    """Issue 24: the call carries no pod; with two records of one (resource, count) waiting, the node
    cannot know whose call it is, so it refuses (the extender lets only one wait, at bind) rather than
    serve one pod's record to another."""
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("p-a", SHARE, one(GA)))
    r.observe(bound("p-b", SHARE, one(GB, 30)))
    assert r.preferred(R.GPU_SLOTS, [f"{GB}::1", f"{GA}::2"], [], 1) is None  # no steering
    with pytest.raises(AllocationRefused, match=r"waited for by several pods bound to n1 \(default/p-a, default/p-b\)"):
        r.resolve(R.GPU_SLOTS, [f"{GB}::5"])
    # Once one of them runs (its Allocate is done, whoever served it), the other's record is unambiguous.
    r.observe(bound("p-a", SHARE, one(GA), phase="Running", rv=2))
    got = r.resolve(R.GPU_SLOTS, [f"{GB}::5"])
    assert got is not None and got.pod == "default/p-b"


def test_a_lagging_view_reads_the_api_server_before_deciding() -> None:
    pods = [bound("late", SHARE, one(GC))]
    r = HandoffResolver(NODE, key=KEY, refresh=lambda: pods)  # the watch has shown nothing yet
    assert r.preferred(R.GPU_SLOTS, [f"{GA}::0", f"{GC}::1"], [], 1) == [f"{GC}::1"]
    got = r.resolve(R.GPU_SLOTS, [f"{GC}::1"])
    assert got is not None and got.pod == "default/late"
    assert r.metrics.consistent_reads._value.get() >= 1


def test_a_lagging_watch_never_brings_back_a_deleted_pod() -> None:
    listed: list[dict[str, Any]] = []
    r = HandoffResolver(NODE, key=KEY, refresh=lambda: listed)
    old = bound("gone", SHARE, one(GA), rv=5)
    r.observe(old)
    assert r.consistent_read()  # the API server no longer has it
    r.observe(old)  # the same old state, delivered late by the watch
    with pytest.raises(AllocationRefused):
        r.resolve(R.GPU_SLOTS, [f"{GA}::0"])
    # An older state of a live pod is ignored too.
    live = bound("live", SHARE, one(GB), rv=9, uid="u-live")
    listed.append(live)
    r.observe(live)
    r.observe(bound("live", SHARE, None, rv=3, uid="u-live"))  # an older state: ignored
    with r._lock:
        assert r._pods["default/live"].entries
    r._refresh = None  # the API server unreachable: the local view decides
    assert r.resolve(R.GPU_SLOTS, [f"{GB}::0"]) is not None


def test_forged_records_get_nothing() -> None:
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("forged", SHARE, one(GA), signature="0" * 64))
    r.observe(bound("wrong-key", SHARE, one(GB), key=b"someone-elses-key-0123456789"))
    copied = bound("victim", SHARE, one(GC))
    thief = bound("thief", SHARE, None)
    thief["metadata"]["annotations"] = dict(copied["metadata"]["annotations"])  # another pod's signed record
    r.observe(thief)
    for gpu in (GA, GB, GC):
        with pytest.raises(AllocationRefused):
            r.resolve(R.GPU_SLOTS, [f"{gpu}::0"])
    assert r.metrics.forged._value.get() == 3


def test_whole_gpus_never_land_on_shared_ones_and_shares_never_on_whole() -> None:
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("share", SHARE, one(GA)))
    assert r.resolve(R.GPU_SLOTS, [f"{GA}::0"]) is not None
    # A pod the extender did not place: GetPreferredAllocation steers it off the shared GPU ...
    assert r.preferred(R.NVIDIA_GPU, [GA, GB], [], 1) == [GB]
    # ... and a kubelet that gives it the shared GPU anyway is refused with the reason.
    with pytest.raises(AllocationRefused, match=r"carries a 25 % share of default/share"):
        r.resolve(R.NVIDIA_GPU, [GA])
    assert r.resolve(R.NVIDIA_GPU, [GB]) is None  # a free GPU: served as asked
    r.observe(bound("later", SHARE, one(GB)))
    with pytest.raises(AllocationRefused, match=r"held whole by"):
        r.resolve(R.GPU_SLOTS, [f"{GB}::1"])


def test_a_pod_without_record_waiting_beside_a_record_makes_the_call_ambiguous() -> None:
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("recorded", WHOLE, PodAllocation((ContainerAllocation("c0", (grant(GA, 100),)),))))
    r.observe(bound("plain", WHOLE, None))
    with pytest.raises(AllocationRefused, match=r"without a kubegpu record"):
        r.resolve(R.NVIDIA_GPU, [GA])
    with pytest.raises(AllocationRefused, match=r"no waiting record names"):
        r.resolve(R.NVIDIA_GPU, [GB])


def test_a_pod_without_record_the_watch_has_not_shown_is_found_by_a_consistent_read() -> None:
    """The stress test's swap: a default-scheduler pod asking one whole GPU is admitted while a recorded pod of
    that kind waits, and this node's watch (2 s behind the kubelet's) does not show it yet. Its call must not
    be served the recorded pod's GPUs: a consistent read shows it, and the call is refused as ambiguous."""
    recorded = bound("recorded", WHOLE, PodAllocation((ContainerAllocation("c0", (grant(GA, 100),)),)))
    plain = bound("plain", WHOLE, None)
    r = HandoffResolver(NODE, key=KEY, refresh=lambda: [recorded, plain])
    r.observe(recorded)  # the watch has shown the recorded pod only
    with pytest.raises(AllocationRefused, match=r"asked both by default/recorded .* default/plain"):
        r.resolve(R.NVIDIA_GPU, [GA])
    assert r.metrics.consistent_reads._value.get() >= 1
    # With the API server unreachable the view alone decides (what it did before): the record is served.
    alone = HandoffResolver(NODE, key=KEY)
    alone.observe(recorded)
    got = alone.resolve(R.NVIDIA_GPU, [GA])
    assert got is not None and got.pod == "default/recorded"


def test_init_container_devices_are_reused_by_the_app_container() -> None:
    r = HandoffResolver(NODE, key=KEY)
    alloc = PodAllocation((ContainerAllocation("i0", (grant(GA, 100),), init=True),
                           ContainerAllocation("c0", (grant(GA, 100),))))
    r.observe(bound("init", WHOLE, alloc, init=WHOLE))
    assert r.preferred(R.NVIDIA_GPU, [GA, GB], [], 1) == [GA]
    first = r.resolve(R.NVIDIA_GPU, [GA])
    second = r.resolve(R.NVIDIA_GPU, [GA])  # no GetPreferredAllocation: the kubelet reuses the init device
    assert (first.container, second.container) == ("i0", "c0")


def _podresources_text(path: Path) -> list[tuple[str, str, str, str, list[str]]]:
    """The recorded protobuf text of one pod's PodResources entry -> holdings rows."""
    text = path.read_text()
    ns = re.search(r'namespace: "([^"]+)"', text).group(1)  # type: ignore[union-attr]
    name = re.search(r'^name: "([^"]+)"', text, re.M).group(1)  # type: ignore[union-attr]
    container = re.search(r'containers \{\s*name: "([^"]+)"', text).group(1)  # type: ignore[union-attr]
    rows = []
    for res, dev in re.findall(r'resource_name: "([^"]+)"\s*device_ids: "([^"]+)"', text):
        rows.append((ns, name, container, res, [dev]))
    return rows


def test_verifier_groups_the_kubelets_one_entry_per_device() -> None:
    rows = _podresources_text(FIXTURES / "podresources-two-gpu-container.txt")
    assert len(rows) == 2  # the real kubelet: one entry per device for a 2-GPU container
    gpus = [r[4][0] for r in rows]
    alloc = PodAllocation((ContainerAllocation("main", tuple(grant(g, 100, i) for i, g in enumerate(gpus))),))
    pod = bound("m-two-gpu", {R.NVIDIA_GPU: "2"}, alloc)
    pod["spec"]["containers"][0]["name"] = "main"
    r = HandoffResolver(NODE, key=KEY)
    r.observe(pod)
    assert r.resolve(R.NVIDIA_GPU, list(reversed(gpus))) is not None
    assert r.verify(rows) == []  # no false alarm for a multi-GPU container
    assert r.metrics.mismatches._value.get() == 0
    # A real divergence: the kubelet says the container holds another GPU.
    wrong = [(rows[0][0], rows[0][1], "main", R.NVIDIA_GPU, [gpus[0]]), (rows[0][0], rows[0][1], "main",
                                                                        R.NVIDIA_GPU, ["GPU-other"])]
    problems = r.verify(wrong)
    assert len(problems) == 1 and "the kubelet holds" in problems[0]
    assert r.metrics.mismatches._value.get() == 1
    # Reported once; what was served now follows the kubelet, so the next pass is quiet.
    assert r.verify(wrong) == [] and r.metrics.mismatches._value.get() == 1


def test_acknowledgements_are_signed_and_read_back() -> None:
    from kubegpu.model.records import Ack, encode_acks, read_pod

    pod = bound("acked", SHARE, one(GA))
    value = encode_acks({"c0": Ack(R.GPU_SLOTS, (f"{GB}::1",), (grant(GB),))})
    pod["metadata"]["annotations"][A.DEVICE_ASSIGNED] = value
    pod["metadata"]["annotations"][signing.ACK_SIGNATURE] = signing.sign(KEY, "uid-acked", NODE, value, kind="ack")
    recs = read_pod(pod, KEY)
    assert recs.problems == () and decode_acks(value)["c0"].devices == (f"{GB}::1",)
    alloc = recs.allocation()
    assert alloc is not None and alloc.grants()[0].uuid == GB  # the accounting follows the kubelet
    pod["metadata"]["annotations"][signing.ACK_SIGNATURE] = "f" * 64
    assert read_pod(pod, KEY).allocation().grants()[0].uuid == GA  # an unsigned ack is ignored


def test_the_cache_answers_without_a_list_and_acknowledgements_follow_the_answer_until_they_land() -> None:
    """Issue 24 item 4: GetPreferredAllocation and Allocate answer from the watched view (no LIST when it shows
    the one waiting pod); the acknowledgement is written after the answer and retried through failures (a
    validating webhook down) until it lands."""
    import threading

    from kubegpu.model.records import read_pod

    lists: list[int] = []
    release = threading.Event()
    patches: list[dict[str, Any]] = []

    class Client:
        fails = 2

        def patch(self, _kind: Any, name: str, body: dict[str, Any], **_kw: Any) -> None:
            release.wait(10)  # the answer must not be waiting on this
            if Client.fails:
                Client.fails -= 1
                raise RuntimeError('failed calling webhook "validate.kubegpu.io": connection refused')
            patches.append(body)

    r = HandoffResolver(NODE, key=KEY, client=Client(), refresh=lambda: lists.append(1) or [])  # type: ignore[arg-type]
    assert r.acks is not None
    r.acks.first_s = 0.01
    r.observe(bound("p", SHARE, one(GA)))
    assert r.preferred(R.GPU_SLOTS, [f"{GB}::0", f"{GA}::1"], [], 1) == [f"{GA}::1"]
    got = r.resolve(R.GPU_SLOTS, [f"{GA}::1"])
    assert got is not None and got.pod == "default/p" and lists == []  # answered before any write, no LIST
    release.set()
    deadline = time.monotonic() + 10
    while not patches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(patches) == 1 and r.acks.failures == 2  # refused twice, then it landed
    meta = patches[0]["metadata"]
    pod = bound("p", SHARE, one(GA))
    pod["metadata"]["annotations"].update(meta["annotations"])
    acks = read_pod(pod, KEY).acks
    assert acks["c0"].devices == (f"{GA}::1",) and meta["uid"] == "uid-p"
    r.close()


@pytest.mark.parametrize("how", ["refused here", "failed by a restarted kubelet"])
def test_after_a_refusal_the_next_call_of_that_kind_reads_the_api_server(how: str) -> None:
    """A refused call fails its pod (so does a restarted kubelet, for the pods it admitted before the plugins
    registered again, without any call); the extender, seeing it fail, binds the next pod of the kind, which
    this node's lagging watch may not show yet while it still shows the failed one waiting. The cache must not
    serve the failed pod's record to the new pod's call (issue 24: a share got another pod's amounts)."""
    failed = bound("failed", SHARE, one(GA, 40))
    listed: list[dict[str, Any]] = [failed]
    r = HandoffResolver(NODE, key=KEY, refresh=lambda: listed)
    r.observe(failed)
    if how == "refused here":
        with pytest.raises(AllocationRefused):
            r.resolve(R.GPU_SLOTS, [f"{GB}::0"])  # the kubelet chose GPUs no record names: "failed" fails
    else:
        r.kubelet_registered(R.GPU_SLOTS)  # at start
        r.kubelet_registered(R.GPU_SLOTS)  # after the kubelet restarted
    # The API server now: "failed" has failed, "next" is bound; this node's watch has shown neither.
    listed[:] = [bound("failed", SHARE, one(GA, 40), phase="Failed", rv=2), bound("next", SHARE, one(GA, 10))]
    got = r.resolve(R.GPU_SLOTS, [f"{GA}::3"])
    assert got is not None and got.pod == "default/next" and got.gpus[0].core == 10


def test_a_container_served_another_pods_record_is_reported_and_acknowledged_with_what_it_was_told() -> None:
    """The one window the cache cannot close (a waiting pod deleted before its admission, the next pod of its
    kind not in this node's view yet): PodResources shows who really holds what was served, and the
    acknowledgement then carries the amounts the container was told, never silently its own record's."""
    r = HandoffResolver(NODE, key=KEY)
    r.observe(bound("deleted", SHARE, one(GA, 40)))
    got = r.resolve(R.GPU_SLOTS, [f"{GA}::4"])
    assert got is not None and got.pod == "default/deleted"  # the view's only waiting pod: in fact "next"'s call
    r.observe(bound("deleted", SHARE, one(GA, 40), rv=2), deleted=True)  # its end, delivered late
    r.observe(bound("next", SHARE, one(GA, 10)))
    problems = r.verify([("default", "next", "c0", R.GPU_SLOTS, [f"{GA}::4"])])
    assert len(problems) == 1 and "served as the record of a pod now gone" in problems[0]
    assert r.metrics.mismatches._value.get() == 1
    with r._lock:
        uid_next = r._pods["default/next"].uid
        assert r._served[(uid_next, "c0")].grants[0].core == 40  # what it was told
        assert ("uid-deleted", "c0") not in r._served


def test_the_node_publishes_how_far_its_view_has_got_when_a_gpu_pod_ends() -> None:
    """The other half of the deleted-pod window: once this view has a GPU pod's end (a deletion, a failure, a
    LIST that no longer has it), the Node carries the version it has got to (A.HANDOFF_SEEN), written off the
    kubelet's path and retried until it lands; the extender binds the next pod of the ended pod's kind only
    then. A pod without GPUs ending writes nothing; the first LIST announces the view."""
    import threading

    written: list[str] = []
    landed = threading.Event()

    class Client:
        fails = 1

        def patch(self, kind: Any, name: str, body: dict[str, Any], **_kw: Any) -> None:
            if kind.__name__ != "Node":
                return
            assert name == NODE
            if Client.fails:
                Client.fails -= 1
                raise RuntimeError("the API server is restarting")
            written.append(body["metadata"]["annotations"][A.HANDOFF_SEEN])
            landed.set()

    def wait_for(value: str) -> None:
        deadline = time.monotonic() + 10
        while (not written or written[-1] != value) and time.monotonic() < deadline:
            landed.wait(0.05)
            landed.clear()
        assert written and written[-1] == value, written

    listed: list[dict[str, Any]] = [bound("p", SHARE, one(GA), rv=10)]

    class Listed(list):  # type: ignore[type-arg]
        resource_version = "20"

    r = HandoffResolver(NODE, key=KEY, client=Client(), refresh=lambda: Listed(listed))  # type: ignore[arg-type]
    assert r.acks is not None
    r.acks.first_s = 0.01
    assert r.consistent_read()
    wait_for("20")  # the first LIST, after one failed write
    r.observe(bound("cpu-only", {"cpu": "1"}, None, rv=21), deleted=True)
    r.observe(bound("p", SHARE, one(GA), rv=25), deleted=True)  # the watch: its deletion
    wait_for("25")
    r.observe(bound("q", WHOLE, None, rv=26))
    r.observe(bound("q", WHOLE, None, rv=30, phase="Failed"))  # failed by its kubelet, never served
    wait_for("30")
    r.observe(bound("s", SHARE, one(GB), rv=31))
    kept = {"metadata": {"name": "s", "namespace": "default", "uid": "uid-s", "resourceVersion": "31"}}
    r.on_event(WatchEvent(EventType.DELETED, Pod.from_dict(kept), version="40"))
    wait_for("40")  # a relist found it gone (its cache kept only its identity): known as of the LIST's version
    count = len(written)
    r.observe(bound("cpu-only-2", {"cpu": "1"}, None, rv=41))
    r.observe(bound("cpu-only-2", {"cpu": "1"}, None, rv=42), deleted=True)
    r.observe(bound("ran", SHARE, one(GC), rv=43))
    r.observe(bound("ran", SHARE, one(GC), rv=44, phase="Succeeded"))  # it ran: its calls were served
    time.sleep(0.1)
    assert len(written) == count  # nothing new for a pod without GPUs, nor for one that ran
    # A pod this view never had live: the LIST shows it failed (the kubelet refused it while the watch lagged).
    listed[:] = [bound("never-seen", SHARE, one(GC), rv=45, phase="Failed")]
    Listed.resource_version = "50"
    assert r.consistent_read()
    wait_for("50")
    # A lagging watch then delivers a pod that the LIST, newer, did not have: it is not brought back.
    r.observe(bound("gone-before-the-list", SHARE, one(GA), rv=48))
    with r._lock:
        assert "default/gone-before-the-list" not in r._pods
    # The watch broke and a relist at 60 repaired it: a GPU pod bound here and gone while it was broken was
    # never seen, and the extender holds its kind until the Node has got past its end. The view is complete
    # as of the relist: published, with nothing ended in it.
    r.on_event(WatchEvent(EventType.RELISTED, None, version="60"))
    wait_for("60")
    r.close()


def test_a_list_does_not_read_again_a_pod_at_the_version_held() -> None:
    """The same version is the same object: a consistent read skips it (110 pods a node), and the view keeps
    what it learnt since (an acknowledgement written, not yet echoed by the watch)."""
    pod = bound("p", SHARE, one(GA), rv=7)
    r = HandoffResolver(NODE, key=KEY, refresh=lambda: [pod])
    r.observe(pod)
    served = {"c0": Ack(R.GPU_SLOTS, (f"{GA}::1",), (grant(GA),))}
    with r._lock:
        view = r._pods["default/p"]
        view.acks = dict(served)
    assert r.consistent_read()
    with r._lock:
        assert r._pods["default/p"] is view and view.acks == served
    r.observe(bound("p", SHARE, one(GA), rv=8))  # a newer version is read
    with r._lock:
        assert r._pods["default/p"] is not view
