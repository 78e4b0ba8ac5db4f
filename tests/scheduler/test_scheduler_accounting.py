"""Accounting under concurrency, failures and restarts: no GPU is ever given twice or past 100 %."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import defaultdict
from pathlib import Path

import httpx
from sched_harness import Cluster, filter_, observe, plan_of
from test_scheduler_behaviour import bind, pod, share

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model.allocation import PodAllocation, decode, encode
from kubegpu.model.annotations import DEVICE_ALLOCATED
from kubegpu.placement import fit
from kubegpu.scheduler.service import ServiceThread
from kubegpu.scheduler.state import ClusterView


def _concurrent_binds(cluster: Cluster, pods: list[dict], node: str) -> list[str]:
    uids = [cluster.api.put_object(p)["metadata"]["uid"] for p in pods]

    def one(i: int) -> str:
        with httpx.Client(base_url=cluster.ext.url, timeout=20) as c:
            r = c.post("/bind", json={"PodName": pods[i]["metadata"]["name"], "PodNamespace": "default",
                                      "PodUID": uids[i], "Node": node})
            return r.json().get("Error", "")

    with cf.ThreadPoolExecutor(len(pods)) as pool:
        return list(pool.map(one, range(len(pods))))


def _allocations(cluster: Cluster) -> dict[str, PodAllocation]:
    out = {}
    for p in cluster.api.objects("pods"):
        value = (p["metadata"].get("annotations") or {}).get(DEVICE_ALLOCATED)
        if value and p["spec"].get("nodeName"):
            out[p["metadata"]["name"]] = decode(value)
    return out


def test_concurrent_whole_gpu_binds_never_share_a_gpu(cluster: Cluster) -> None:
    errors = _concurrent_binds(cluster, [pod(f"w{i}", {"nvidia.com/gpu": "1"}) for i in range(12)], "gpu-node-a")
    assert errors.count("") == 8
    assert all("whole GPU" in e or "in use" in e or "GPU" in e for e in errors if e)
    uuids = [g.uuid for a in _allocations(cluster).values() for g in a.grants()]
    assert len(uuids) == 8 == len(set(uuids))
    # Pods whose bind failed hold nothing; nor are they bound.
    assert len(cluster.ext.call(lambda: list(cluster.view.ledger.held))) == 8


def test_concurrent_share_binds_never_exceed_a_gpu(cluster: Cluster) -> None:
    pods = [pod(f"s{i}", share(30, ratio=10)) for i in range(10)]
    errors = _concurrent_binds(cluster, pods, "gpu-node-c")
    assert errors.count("") == 3  # 3 x 30 % fit one GPU, a fourth would be 120 %
    core = defaultdict(int)
    for a in _allocations(cluster).values():
        for g in a.grants():
            core[g.uuid] += g.core
    assert list(core.values()) == [90]


def test_failed_binding_releases_the_assumption_and_retry_is_idempotent(cluster: Cluster) -> None:
    cluster.api.inject_failure("POST pods/binding", 409)  # not a "bound to this node" conflict
    err = bind(cluster, pod("f", {"nvidia.com/gpu": "8"}), "gpu-node-b")
    assert "API error 409" in err
    assert cluster.ext.call(lambda: "default/f" not in cluster.view.ledger.held)
    # The scheduler retries: the annotation already written is reused, and the bind goes through.
    uid = cluster.api.get_object("pods", "f", "default")["metadata"]["uid"]
    r = cluster.post("/bind", {"PodName": "f", "PodNamespace": "default", "PodUID": uid, "Node": "gpu-node-b"})
    assert r.json() == {"Error": ""}
    assert cluster.api.get_object("pods", "f", "default")["spec"]["nodeName"] == "gpu-node-b"
    # A transient 500 on the Binding is retried inside the bind.
    cluster.api.inject_failure("POST pods/binding", 500)
    assert bind(cluster, pod("g", {"nvidia.com/gpu": "1"}), "gpu-node-a") == ""
    # Unknown pod, recreated pod, pod bound elsewhere: clear errors, nothing held.
    r = cluster.post("/bind", {"PodName": "ghost", "PodNamespace": "default", "PodUID": "", "Node": "gpu-node-a"})
    assert "cannot read pod default/ghost" in r.json()["Error"]
    r = cluster.post("/bind", {"PodName": "g", "PodNamespace": "default", "PodUID": "old", "Node": "gpu-node-a"})
    assert "recreated" in r.json()["Error"]
    elsewhere = pod("e", {"nvidia.com/gpu": "1"})
    elsewhere["spec"]["nodeName"] = "gpu-node-b"
    assert "already bound to gpu-node-b" in bind(cluster, elsewhere, "gpu-node-a")
    # "e" was put on gpu-node-b by someone else without GPUs recorded: only its CPU and memory are held.
    assert cluster.ext.call(lambda: sorted(k for k, h in cluster.view.ledger.held.items() if h.alloc.containers)) == [
        "default/f", "default/g"]
    assert cluster.ext.call(lambda: cluster.view.ledger.held["default/e"].alloc.containers) == ()
    # Filtered, then deleted and recreated under the same name before the bind: bind reads the pod
    # (and the Binding carries a UID precondition), so it is refused and nothing is held.
    old = cluster.api.put_object(pod("r", {"nvidia.com/gpu": "1"}))
    assert cluster.post("/filter", {"Pod": old, "Nodes": None, "NodeNames": ["gpu-node-a"]}).json()["NodeNames"]
    cluster.api.store.delete(cluster.api.kind("pods"), "default", "r")
    cluster.api.put_object({**pod("r", {"nvidia.com/gpu": "1"})})
    r = cluster.post("/bind", {"PodName": "r", "PodNamespace": "default", "PodUID": old["metadata"]["uid"],
                               "Node": "gpu-node-a"})
    assert "recreated" in r.json()["Error"] and "UID" in r.json()["Error"]
    assert cluster.ext.call(lambda: "default/r" not in cluster.view.ledger.held)
    assert not cluster.api.get_object("pods", "r", "default")["spec"].get("nodeName")


def test_restart_rebuilds_the_same_accounting(cluster: Cluster, tmp_path: Path) -> None:
    assert bind(cluster, pod("a", {"nvidia.com/gpu": "3"}), "gpu-node-a") == ""
    assert bind(cluster, pod("b", share(25, mem="8Gi")), "gpu-node-a") == ""
    assert bind(cluster, pod("c", [{"nvidia.com/gpu": "1"}, share(50, ratio=50)]), "gpu-node-b") == ""
    # The watch echo arrives; then a pod finishes and is released.
    assert bind(cluster, pod("done", {"nvidia.com/gpu": "1"}), "gpu-node-c") == ""
    done = cluster.api.get_object("pods", "done", "default")
    cluster.api.store.update(cluster.api.kind("pods"), "default", "done",
                             lambda p: {**p, "status": {"phase": "Succeeded"}}, "status")
    url = "/apis/v1/plugins/DeviceShare/nodeDeviceSummaries"
    for _ in range(400):  # generous: the machine may be busy
        before = cluster.http.get(url).json()
        if before["gpu-node-c"]["deviceUsed"]["kubegpu.io/gpu-core"] == "0" and all(
                h.assumed_at is None for h in cluster.ext.call(lambda: list(cluster.view.ledger.held.values()))):
            break
        time.sleep(0.05)
    assert done["metadata"]["uid"]
    assert before["gpu-node-c"]["deviceUsed"]["kubegpu.io/gpu-core"] == "0"
    cluster.ext.stop()
    fresh = ServiceThread(tmp_path / "kubeconfig", handoff_wait=False).start()
    try:
        after = httpx.get(fresh.url + url).json()
        assert after == before
        assert fresh.call(lambda: sorted(fresh.service.view.ledger.held)) == ["default/a", "default/b", "default/c"]
    finally:
        fresh.stop()


def test_view_expires_assumptions_never_echoed() -> None:
    now = [0.0]
    view = ClusterView(handoff_wait=False, assume_ttl_s=10, clock=lambda: now[0])
    inv = FakeBackend("t4x4", node_name="n").discover()
    view.set_inventory("n", inv)
    alloc, _ = view.choose(plan_of(pod("p", {"nvidia.com/gpu": "4"})), "n")
    assert alloc is not None
    view.ledger.hold("default/p", "u1", "n", alloc, assumed=True)
    now[0] = 100
    assert view.ledger.expire_assumed() == []  # a bind in flight never expires
    view.ledger.mark_bound("default/p")
    now[0] = 105
    assert view.ledger.expire_assumed() == []
    now[0] = 111
    assert view.ledger.expire_assumed() == ["default/p"]
    assert filter_(view, pod("q", {"nvidia.com/gpu": "4"}), ["n"]).passed == ["n"]


def test_a_failed_bind_releases_only_its_own_assumption() -> None:
    """A bind that fails drops what it held, unless the watch has shown the pod bound since (its write went
    through after all, or another scheduler bound it elsewhere): that hold is the pod's own."""
    view = ClusterView(handoff_wait=False)
    for n in ("n", "m"):
        view.set_inventory(n, FakeBackend("t4x4", node_name=n).discover())
    want = pod("p", {"nvidia.com/gpu": "1"})

    def bound(node: str, alloc: PodAllocation) -> dict:
        return {**want, "metadata": {**want["metadata"], "uid": "u1", "annotations": {
            DEVICE_ALLOCATED: encode(alloc)}}, "spec": {**want["spec"], "nodeName": node}}

    for echoed_on in (None, "n", "m"):
        alloc, _ = view.choose(plan_of(want), "n")
        assert alloc is not None
        view.ledger.hold("default/p", "u1", "n", alloc, assumed=True)
        if echoed_on is not None:
            other, _ = view.choose(plan_of(want), echoed_on)
            assert other is not None
            observe(view, bound(echoed_on, alloc if echoed_on == "n" else other))
        view.ledger.release_assumed("default/p", "u1", "n")  # the bind's write failed, as its caller saw it
        held = view.ledger.held.get("default/p")
        assert (held.node if held else None) == echoed_on
        view.ledger.release("default/p")


def test_view_counts_each_pod_once_and_reports_collisions() -> None:
    view = ClusterView(handoff_wait=False)
    inv = FakeBackend("t4x4", node_name="n").discover()
    view.set_inventory("n", inv)
    alloc = fit(view.nodes["n"].state, __import__("kubegpu.model", fromlist=["parse_pod"]).parse_pod(
        pod("p", {"nvidia.com/gpu": "2"}))).choice.to_allocation()
    bound = {"metadata": {"name": "p", "namespace": "default", "uid": "u1",
                          "annotations": {DEVICE_ALLOCATED: encode(alloc)}},
             "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    for _ in range(3):
        observe(view, bound)  # relists and echoes
    assert view.nodes["n"].state.core_free(inv.gpus[0].uuid) + view.nodes["n"].state.core_free(
        inv.gpus[1].uuid) == 0
    assert sum(view.nodes["n"].state.core_free(g.uuid) for g in inv.gpus) == 200
    twin = {**bound, "metadata": {**bound["metadata"], "name": "twin", "uid": "u2"}}
    observe(view, twin)
    # A collision is counted, reported and held: its GPUs are full for new placements (160 % is not
    # "the later record does not exist").
    ledger = view.ledger
    assert ledger.conflicts == 1 and "default/twin" in ledger.held and "default/twin" in ledger.collisions
    used = [g.uuid for g in alloc.grants()]
    assert all(view.nodes["n"].state.core_free(u) < 0 for u in used)
    assert filter_(view, pod("w", {"nvidia.com/gpu": "3"}), ["n"]).passed == []
    corrupt = {**bound, "metadata": {**bound["metadata"], "name": "bad", "uid": "u3",
                                     "annotations": {DEVICE_ALLOCATED: "{nope"}}}
    observe(view, corrupt)
    assert view.ledger.corrupt == 1
    observe(view, twin, deleted=True)
    assert "default/twin" not in view.ledger.collisions
    assert sum(view.nodes["n"].state.core_free(g.uuid) for g in inv.gpus) == 200  # exact again
    observe(view, bound, deleted=True)
    assert sum(view.nodes["n"].state.core_free(g.uuid) for g in inv.gpus) == 400


def test_health_change_updates_the_node_in_place() -> None:
    view = ClusterView(handoff_wait=False)
    inv = FakeBackend("dgx-a100", node_name="n").discover()
    other = FakeBackend("dgx-a100", node_name="m").discover()
    view.set_inventory("n", inv)
    view.set_inventory("m", other)
    arrays = view.mirror.cluster
    assert filter_(view, pod("p", {"nvidia.com/gpu": "8"}), ["n", "m"]).passed == ["n", "m"]
    view.set_inventory("n", inv.with_gpu_health(inv.gpus[5].uuid, False))
    assert view.mirror.cluster is arrays  # same arrays, row refreshed
    out = filter_(view, pod("p", {"nvidia.com/gpu": "8"}), ["n", "m"])
    assert out.passed == ["m"] and out.failed["n"] == "free whole GPUs: 7 of 7, 8 requested"
    view.set_inventory("n", inv)
    assert filter_(view, pod("p", {"nvidia.com/gpu": "8"}), ["n"]).passed == ["n"]


def test_rotated_and_repeated_node_lists_give_the_same_answers() -> None:
    view = ClusterView(handoff_wait=False)
    names = []
    for i, topo in enumerate(["t4x4", "dgx-a100", "t4x4", "dgx1-v100"]):
        inv = FakeBackend(topo, node_name=f"n{i}").discover()
        view.set_inventory(inv.name, inv)
        names.append(inv.name)
    names.insert(2, "ghost")
    want = pod("p", {"nvidia.com/gpu": "5"})
    first = filter_(view, want, names)
    assert set(first.passed) == {"n1", "n3"} and "ghost" in first.failed
    for k in range(len(names)):
        rotated = names[k:] + names[:k]
        out = filter_(view, want, rotated)
        assert out.passed == [n for n in rotated if n in {"n1", "n3"}]
        assert out.failed == first.failed
        scores = dict(zip(out.passed, view.prioritize(plan_of(want), out.passed), strict=True))
        assert set(scores) == set(out.passed) and max(scores.values()) == 10
    # A different list of the same length is looked up afresh.
    other = ["n3", "n2", "n1", "n0", "ghost"]
    assert filter_(view, want, other).passed == ["n3", "n1"]


def test_pods_with_several_containers_are_fitted_exactly_until_enough_nodes() -> None:
    view = ClusterView(handoff_wait=False, exact_fit_enough=3)
    names = []
    for i in range(8):
        inv = FakeBackend("t4x4" if i % 2 else "dgx-a100", node_name=f"n{i}").discover()
        view.set_inventory(inv.name, inv)
        names.append(inv.name)
    two = pod("two", [{"nvidia.com/gpu": "3"}, share(50, mem="20Gi")])  # T4s have 15 GiB: never on them
    out = filter_(view, two, names)
    assert out.passed == ["n0", "n2", "n4"]
    assert out.failed["n6"].startswith("not examined: 3 feasible nodes were found first")
    assert out.failed["n1"] == "container 'c1': GPU memory free with the compute: 15.0 GiB at most, 20.0 GiB requested"
    whole = pod("w", [{"nvidia.com/gpu": "3"}, {"nvidia.com/gpu": "2"}])
    assert filter_(view, whole, ["n1", "n0"]).failed["n1"] == ("containers 'c0', 'c1': 5 whole GPUs requested in all, "
                                                               "4 free")


def test_kept_scores_equal_fresh_scores_after_changes() -> None:
    """The policies' kept per-row scores (keyed by row version and workload generation) equal scores
    computed now by a fresh policy object, through holds that change rows and workload rebuilds."""
    import numpy as np

    from kubegpu.model.request import parse_pod
    from kubegpu.placement import get_policy, request_demand
    from kubegpu.placement.workload import LearnedWorkload

    view = ClusterView(handoff_wait=False, learner=LearnedWorkload(refresh_min=2, min_pods=2))
    names = []
    for i in range(6):
        inv = FakeBackend("dgx-a100", node_name=f"n{i}").discover()
        view.set_inventory(inv.name, inv)
        names.append(inv.name)
    shapes = [share(30, ratio=20), {"nvidia.com/gpu": "2"}, share(60, ratio=50)]
    gens = set()
    for step in range(12):
        p = pod(f"p{step}", shapes[step % 3])
        out = filter_(view, p, names)
        rows = view.mirror.rows_of(out.passed, remember=False)
        demand = request_demand(parse_pod(p).gpu_containers[0].request)
        cand = view.mirror.cluster.gpu_candidates(demand)[rows]
        for policy in ("kubegpu", "fgd", "bestfit"):  # raw scores, before scaling hides small terms
            kept = view.node_scores(policy, demand, rows, cand)
            assert np.allclose(kept, view.node_scores(policy, demand, rows, cand))
            assert np.allclose(kept, get_policy(policy).node_scores(view.mirror.cluster, demand, rows, cand,
                                                                    view.scoring.context())), (policy, step)
        node = out.passed[step % len(out.passed)]
        alloc, _ = view.choose(plan_of(p), node)
        view.ledger.hold(f"default/p{step}", f"u{step}", node, alloc, plan=plan_of(p))
        gens.add(view.scoring.learner.generation)
    assert len(gens) > 3  # the workload was rebuilt on the way, and kept scores followed


def test_trace_style_model_names_select_nodes() -> None:
    view = ClusterView(handoff_wait=False)
    for topo, name in (("dgx1-v100", "v100"), ("t4x4", "t4"), ("dgx-a100", "a100")):
        view.set_inventory(name, FakeBackend(topo, node_name=name).discover())
    names = ["v100", "t4", "a100"]

    def allowed(models: str) -> list[str]:
        return filter_(view, pod("p", {"nvidia.com/gpu": "1"}, {"kubegpu.io/gpu-model": models}), names).passed

    assert allowed("V100M16") == ["v100"]  # the trace's gpu_spec: V100 with 16 GB
    assert allowed("V100M32") == []
    assert allowed("V100M32|T4") == ["t4"]
    assert allowed("A100, V100") == ["v100", "a100"]
    alloc, why = view.choose(plan_of(pod("p", {"nvidia.com/gpu": "2"}, {"kubegpu.io/gpu-model": "V100M16"})), "v100")
    assert alloc is not None and len(alloc.grants()) == 2, why


def test_policies_declared_row_local_really_score_each_node_on_its_own() -> None:
    """The contract behind kept scores: where a policy says ``row_local(demand)``, a node's score does not
    depend on which other nodes are scored with it. A policy that starts comparing nodes must say so."""
    import numpy as np

    from kubegpu.placement import POLICY_NAMES, get_policy, request_demand

    view = ClusterView(handoff_wait=False)
    names = []
    for i, topo in enumerate(["dgx-a100", "dgx-a100", "dgx1-v100", "t4x4", "dgx-a100", "dgx-h100"]):
        inv = FakeBackend(topo, node_name=f"n{i}").discover()
        view.set_inventory(inv.name, inv)
        names.append(inv.name)
    for step, (node, limits) in enumerate([("n0", {"nvidia.com/gpu": "3"}), ("n1", share(50, ratio=50)),
                                           ("n4", share(30, ratio=10)), ("n2", {"nvidia.com/gpu": "1"})]):
        p = pod(f"f{step}", limits)
        alloc, _ = view.choose(plan_of(p), node)
        view.ledger.hold(f"default/f{step}", f"u{step}", node, alloc, plan=plan_of(p))
    cluster, ctx = view.mirror.cluster, view.scoring.context()
    rows = view.mirror.rows_of(names)
    checked = set()
    for limits in ({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "2"}, share(25, ratio=25), share(50, mem="4Gi")):
        from kubegpu.model.request import parse_pod

        req = parse_pod(pod("q", limits)).gpu_containers[0].request
        demand = request_demand(req)
        cand = cluster.gpu_candidates(demand)[rows]
        assert get_policy("kubegpu").row_local(demand) == (demand.count == 1 and not demand.exclusive)
        for name in POLICY_NAMES:
            if not get_policy(name).row_local(demand):
                continue
            checked.add(name)
            together = np.asarray(get_policy(name).node_scores(cluster, demand, rows, cand, ctx), np.float64)
            alone = [float(get_policy(name).node_scores(cluster, demand, rows[i:i + 1], cand[i:i + 1], ctx)[0])
                     for i in range(len(rows))]
            assert np.allclose(together, alone), (name, limits)
    assert checked == set(POLICY_NAMES) - {"random"}
    assert get_policy("kubegpu").refines == "fgd"


def test_learned_workload_counts_cpu_pods_on_gpu_nodes_but_not_daemonset_or_static_pods() -> None:
    from kubegpu.placement.workload import LearnedWorkload

    view = ClusterView(handoff_wait=False, learner=LearnedWorkload(refresh_min=1, min_pods=1))
    inv = FakeBackend("t4x4", node_name="n").discover()
    view.set_inventory("n", inv)

    def cpu_pod(name: str, **meta: object) -> dict:
        return {"metadata": {"name": name, "namespace": "default", "uid": f"u-{name}", **meta},
                "spec": {"nodeName": "n", "containers": [{"name": "c", "resources": {"requests": {"cpu": "6"}}}]},
                "status": {"phase": "Running"}}

    free = int(view.mirror.cluster.cpu_free[view.mirror.rows_of(["n"], remember=False)[0]])
    observe(view, cpu_pod("batch"))
    ds = {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "d",
                               "controller": True}]}
    observe(view, cpu_pod("agent-x", **ds))
    observe(view, cpu_pod("static", annotations={"kubernetes.io/config.mirror": "abc"}))
    learner = view.scoring.learner
    assert learner.live == 1  # the CPU-only pod, not the DaemonSet's or the static pod
    assert [(s.cpu_milli, s.count) for s in learner.current.every] == [(6000, 0)]
    # All three hold their CPU on the node.
    assert free - int(view.mirror.cluster.cpu_free[view.mirror.rows_of(["n"], remember=False)[0]]) == 18_000
    observe(view, cpu_pod("batch"), deleted=True)
    assert learner.live == 0


def test_named_mask_matches_names_known_or_not() -> None:
    """prioritize's mask of the nodes handing a pod over: by row for known nodes, by name for the others."""
    view = ClusterView(handoff_wait=False)
    for i in range(4):
        inv = FakeBackend("t4x4", node_name=f"n{i}").discover()
        view.set_inventory(inv.name, inv)
    names = ["n2", "ghost", "n0", "n2", "n3", "other", "n1"]
    rows = view.mirror.rows_of(names, remember=False)
    for which in ({}, {"n2": "w"}, {"ghost": "w", "n0": "w"}, {"n1": "w", "gone": "w", "other": "w", "n3": "w"}):
        assert view.named(names, rows, which).tolist() == [n in which for n in names]
